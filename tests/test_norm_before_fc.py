"""EAGLE 3.1's norm_before_fc: one RMSNorm over concat(low, mid, high) before fc. The numerics against a hand-written
reference, the export the engines read, import/save round trips (old checkpoints load as off), training and decoding
with it on."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import test_train as tt
from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.export.export import export_drafter
from eyas.model.checkpoint import load_drafter, open_drafter, save_drafter
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.model.importer import load_eagle3_checkpoint
from eyas.target import target_from_model
from eyas.train.config import TrainConfig
from eyas.train.trainer import run_train

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

# What the engines read (the export contract's pinned versions; tests/test_engine_contract.py replays their loaders):
#   config: eagle_config["norm_before_fc"], else the top-level "norm_before_fc", else False
#     SGLang 0.5.23 sglang/srt/models/llama_eagle3.py:173-175, vLLM 0.33.0 vllm/model_executor/models/llama_eagle3.py:184-188
#   module: RMSNorm(target_hidden_size * 3, eps=rms_norm_eps) applied to the whole concatenation, then fc
#     SGLang 0.5.23 llama_eagle3.py:176-180 and 239-240; vLLM 0.33.0 llama_eagle3.py:223-227 and 405-407
#   weight: "input_norm.weight" (both prefix "model."; vLLM drops "input_norm." keys when the flag is off, :464-465)
# SGLang 0.5.14 (the live engines' image) has no norm_before_fc at all: only the per-slot fc_norm (llama_eagle3.py:161-173).
CONFIG_KEY, WEIGHT = "norm_before_fc", "input_norm.weight"
AUX = (1, 2, 3)


def drafter(model, *, on=True, draft_vocab=None, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=draft_vocab or model.config.vocab_size,
                                    aux_layer_ids=AUX, norm_before_fc=on)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():   # non-trivial norm weights, so a skipped or misplaced norm shows
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return d.eval()


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(layers=6, seed=5)


def test_fuse_is_fc_of_one_rmsnorm_over_the_concatenation(model):
    d = drafter(model)
    h_t, eps = d.config.target_hidden_size, d.config.rms_norm_eps
    # residual-stream features of very different sizes per slot (as a real target's low/mid/high are)
    aux = torch.randn(2, 7, 3 * h_t) * torch.tensor([0.1] * h_t + [1.0] * h_t + [30.0] * h_t)
    w, W = d.input_norm.weight, d.fc.weight
    ref = torch.empty(2, 7, d.config.hidden_size)
    for b in range(2):
        for t in range(7):
            x = aux[b, t]
            rms = (sum(float(v) ** 2 for v in x) / (3 * h_t) + eps) ** 0.5
            ref[b, t] = W @ (w * (x / rms))
    got = d.fuse(aux)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    per_slot = d.fc(torch.cat([d.input_norm.weight[i * h_t:(i + 1) * h_t]
                               * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps))
                               for i, c in enumerate(aux.chunk(3, -1))], -1))
    assert not torch.allclose(got, per_slot, atol=1e-3)       # not SGLang/vLLM's other variant, fc_norm
    off = drafter(model, on=False)
    assert not hasattr(off, "input_norm") and WEIGHT not in off.state_dict()
    assert torch.equal(off.fuse(aux), off.fc(aux))            # off: exactly the plain EAGLE-3 fc
    assert d.config.param_count() == sum(p.numel() for p in d.parameters()) == off.config.param_count() + 3 * h_t


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_export_writes_what_the_engines_read_and_imports_back(model, tmp_path, on):
    d = drafter(model, on=on, draft_vocab=100)
    ids = torch.randperm(256)[:100].sort().values
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(100), t2d)
    out = export_drafter(d, tmp_path / "x", dtype="fp32")
    cfg, w = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert cfg.get(CONFIG_KEY, False) is on and CONFIG_KEY not in cfg["eagle_config"]
    assert (WEIGHT in w) is on and set(w) == set(d.state_dict())
    if on:
        assert tuple(w[WEIGHT].shape) == (3 * d.config.target_hidden_size,)
        assert "SGLang 0.5.16 and earlier" in (out / "README.md").read_text()
    back, meta = load_eagle3_checkpoint(out)
    assert back.config == d.config and meta["warnings"] == []
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    aux = torch.randn(1, 5, 3 * d.config.target_hidden_size)
    assert torch.equal(back.fuse(aux), d.fuse(aux))
    # eyas's own save/load, and a run dir's drafter through the one opener
    save_drafter(d, tmp_path / "own")
    own, _ = open_drafter(tmp_path / "own")
    assert own.config == d.config and all(torch.equal(own.state_dict()[k], v) for k, v in d.state_dict().items())


def test_engine_config_precedence_and_mismatches_refused(model, tmp_path):
    d = drafter(model)
    out = export_drafter(d, tmp_path / "x", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())

    def write(c, weights=None):
        (out / "config.json").write_text(json.dumps(c))
        if weights is not None:
            save_file(weights, str(out / "model.safetensors"))

    # the flag under eagle_config (where both engines look first) is read; eagle_config's value wins
    write({**{k: v for k, v in cfg.items() if k != CONFIG_KEY},
           "eagle_config": {**cfg["eagle_config"], CONFIG_KEY: True}})
    assert load_eagle3_checkpoint(out)[0].config.norm_before_fc
    write({**cfg, "eagle_config": {**cfg["eagle_config"], CONFIG_KEY: False}})
    with pytest.raises(EyasError, match=r"unexpected \['input_norm.weight'\]"):   # weight without the flag
        load_eagle3_checkpoint(out)
    weights = load_file(out / "model.safetensors")
    write(cfg, {k: v for k, v in weights.items() if k != WEIGHT})
    with pytest.raises(EyasError, match=r"config.json: weights do not match|missing \['input_norm.weight'\]"):
        load_eagle3_checkpoint(out)                                                # flag without the weight
    write({**cfg, "fc_norm": True}, weights)
    with pytest.raises(EyasError, match="config.json: fc_norm / use_aux_norm .* not supported"):
        load_eagle3_checkpoint(out)


def test_checkpoints_without_the_key_load_as_off(model, tmp_path):
    """Drafters saved and exported before the flag existed: no key, no input_norm -> off, unchanged."""
    d = drafter(model, on=False)
    save_drafter(d, tmp_path / "own")
    raw = json.loads((tmp_path / "own" / "config.json").read_text())
    assert raw.pop(CONFIG_KEY) is False
    (tmp_path / "own" / "config.json").write_text(json.dumps(raw))
    back, meta = load_drafter(tmp_path / "own")
    assert back.config == d.config and not back.config.norm_before_fc and CONFIG_KEY not in meta
    out = export_drafter(d, tmp_path / "exp")
    assert CONFIG_KEY not in json.loads((out / "config.json").read_text())   # a plain export is as before
    assert not load_eagle3_checkpoint(out)[0].config.norm_before_fc


def test_train_flag_identity_and_a_run_that_learns(tmp_path):
    from eyas.cli import build_parser
    from eyas.knobs import from_args

    a = build_parser().parse_args(["train", "--store", "S", "--out", "R", "--norm-before-fc"])
    assert from_args(TrainConfig, a) == TrainConfig(store="S", out="R", norm_before_fc=True)
    # a --resume must match it, off or on
    assert TrainConfig(store="S", out="R").identity()["norm_before_fc"] is False
    assert TrainConfig(store="S", out="R", norm_before_fc=True).identity()["norm_before_fc"] is True

    import test_decode as td

    # a sharpened target (test_decode.peaky), so there is something to learn in 60 steps; uniform drafting scores
    # ln(64) * (1 + 0.8 + 0.64) = 10.15
    t = target_from_model(td.peaky(make_tiny_llama(layers=4, hidden=32, heads=4, kv_heads=2, vocab=tt.V, inter=64),
                                   8.0, 0.3))
    store = tt.capture(tmp_path, t, tt.make_samples(40))
    res = run_train(tt.cfg(tmp_path, store, steps=60, lr=3e-2, norm_before_fc=True, eval_fraction=0.0), target=t)
    losses = [r["loss"] for r in tt.records(tmp_path / "run")]
    assert len(losses) == 60 and sum(losses[-10:]) / 10 < sum(losses[:5]) / 5 - 0.3, losses
    d, _ = open_drafter(tmp_path / "run")
    assert d.config.norm_before_fc and res["step"] == 60
    assert not torch.equal(d.input_norm.weight, torch.ones_like(d.input_norm.weight))   # trained, not left at init


def test_decoders_use_the_norm(model):
    """A drafter trained with the norm on decodes losslessly and is accepted; the same drafter with fuse() skipping
    the norm is accepted far less, so the decoders do go through fuse()'s norm."""
    from eyas.decode.spec import SpecConfig, SpecDecoder
    from eyas.target.runner import Runner

    import test_decode as td

    target = td.peaky(make_tiny_llama(seed=11), 4.0, 0.3)
    runner = Runner.from_hf(target, max_batch=8, max_seq=160)
    d = drafter(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (4,), generator=g).tolist() for _ in range(24)]
    x = torch.tensor([p + o for p, o in zip(prompts, runner.generate(prompts, 40))])   # (B, T)
    B, T = x.shape
    with torch.no_grad():
        hs = target(x, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in AUX], -1)                                    # (B, T, 3h)
    emb = target.get_input_embeddings()(x).detach()
    d.train()
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    pos = torch.arange(T - 2)[None].expand(B, -1)
    mask = torch.ones(T - 2, T - 2, dtype=torch.bool).tril()[None].expand(B, -1, -1)
    for _ in range(150):
        out, _ = d.layer(d.fuse(aux[:, :-2]), emb[:, 1:-1], pos, mask)
        loss = torch.nn.functional.cross_entropy(d.logits(out)[:, 3:].flatten(0, 1), x[:, 5:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.eval()
    test_prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 5, 9, 17, 30, 60)]
    ref = runner.generate(test_prompts, 24)
    taus = {}
    for fast in (False, True):
        dec = SpecDecoder(runner, d, SpecConfig(method="chain", k=4), fast=fast)
        outs, stats = td.run_all_dec(dec, test_prompts, eos=-1)
        assert outs == ref
        taus[fast] = stats.tau
    assert taus[False] == taus[True] > 1.3, taus
    outs, tree = td.run_all_dec(SpecDecoder(runner, d, SpecConfig(method="tree", top_k=4, depth=5, total_tokens=16)),
                                test_prompts, eos=-1)
    assert outs == ref and tree.tau > 1.3, tree.tau
    plain_fuse = Eagle3Drafter.fuse
    try:
        Eagle3Drafter.fuse = lambda self, a: self.fc(a.to(self.fc.weight.dtype))
        outs, skipped = td.run_all_dec(SpecDecoder(runner, d, SpecConfig(method="chain", k=4)), test_prompts, eos=-1)
    finally:
        Eagle3Drafter.fuse = plain_fuse
    assert outs == ref and skipped.tau < taus[False] - 0.1, (skipped.tau, taus)
