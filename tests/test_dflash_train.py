"""The DFlash loss against a naive reference (each block run on its own with its explicit context), one test per
silent train/serve mismatch its users have hit, and `eyas train --method dflash` end to end (resume, online,
refusals)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.target import target_from_model
from eyas.model.dflash import DFlashConfig, DFlashDrafter, default_mask_token
from eyas.train.config import TrainConfig
from eyas.train.dflash import BlockLossConfig, DFlashModule, candidates, dflash_forward, sample_anchors
from eyas.train.trainer import run_train
from test_train import capture, crashed_run, make_samples, prepared, records, tiny_target

H, V, B = 32, 96, 4


def drafter(seed=0, block=B, layers=2, std=0.3):
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=H, target_hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=256, vocab_size=V, aux_layer_ids=(1, 2, 3), num_target_layers=4,
                       block_size=block, mask_token_id=V - 1)
    d = DFlashDrafter(cfg)
    d.init_weights(std)                    # sharper than training's init: differences show in the outputs
    return d.eval()


def batch(seed=0, R=2, T=24, packed=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (R, T), generator=g)
    lm = torch.rand(R, T, generator=g) < 0.8
    valid = torch.ones(R, T, dtype=torch.bool)
    valid[1, T - 5:] = False
    seg = None
    pos = None
    if packed:  # two samples in row 0, positions restarting at each
        seg = valid.long()
        seg[0, 10:] = 2
        pos = torch.arange(T).expand(R, T).clone()
        pos[0, 10:] -= 10
    return dict(input_ids=ids, loss_mask=lm, valid=valid, aux=torch.randn(R, T, 3 * H, generator=g),
                final=torch.randn(R, T, H, generator=g), embed=torch.randn(V, H, generator=g),
                lm_head_weight=torch.randn(V, H, generator=g), segment_ids=seg, position_ids=pos)


def naive(d, b, anchors, real, gamma=None, labels="soft"):
    """Each real block alone: context = the aux states of its sample's positions before the anchor, the block
    [x_a, MASK...] at positions pos(a)..pos(a)+B-1, no mask at all; per-slot mean CE over the counted slots."""
    ids, lm, valid, aux, final = b["input_ids"], b["loss_mask"], b["valid"], b["aux"], b["final"]
    E, W = b["embed"], b["lm_head_weight"]
    R, T = ids.shape
    seg = b["segment_ids"] if b["segment_ids"] is not None else valid.long()
    pos = b["position_ids"] if b["position_ids"] is not None else torch.arange(T).expand(R, T)
    Bk = d.config.block_size
    sums, counts, rights = torch.zeros(Bk), torch.zeros(Bk), torch.zeros(Bk)
    accept = torch.zeros(R, T, dtype=torch.long)
    for r in range(R):
        for n in range(anchors.shape[1]):
            a = int(anchors[r, n])
            if not real[r, n]:
                continue
            js = [j for j in range(a) if seg[r, j] == seg[r, a] and valid[r, j]]
            ctx = d.context_kv(aux[r, js][None], pos[r, js][None])
            block = torch.tensor([int(ids[r, a])] + [d.config.mask_token_id] * (Bk - 1))
            h = d(F.embedding(block, E)[None], (pos[r, a] + torch.arange(Bk))[None], ctx, None)[0]  # (Bk, h)
            logits = h @ W.T
            lead, leading = 0, True
            for k in range(1, Bk):
                l = a + k
                if not (l < T and seg[r, l] == seg[r, a] and valid[r, a:l + 1].all() and lm[r, l]):
                    leading = False
                    continue
                p = F.softmax(W @ final[r, l - 1], -1)
                target = F.one_hot(ids[r, l], V).float() if labels == "hard" else p
                sums[k] += -(target * F.log_softmax(logits[k], -1)).sum()
                counts[k] += 1
                ok = int(logits[k].argmax()) == int(p.argmax())
                rights[k] += ok
                leading = leading and ok
                lead += leading
            if a > 0:
                accept[r, a - 1] = lead
    loss_k = sums[1:] / counts[1:].clamp(min=1)
    g = gamma or (7.0 if Bk >= 16 else 4.0)
    total = sum(torch.exp(torch.tensor(-(k - 1) / g)) * loss_k[k - 1] for k in range(1, Bk))
    return total, loss_k, counts[1:].long(), rights[1:].long(), accept


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("labels", ["soft", "hard"])
def test_loss_equals_the_naive_reference(packed, labels):
    d, b = drafter(), batch(packed=packed)
    seg = b["segment_ids"] if packed else b["valid"].long()
    cand = candidates(b["loss_mask"] & b["valid"], torch.where(b["valid"], seg, 0))
    torch.manual_seed(3)
    anchors, real = sample_anchors(cand, 7)
    o = dflash_forward(d, cfg=BlockLossConfig(labels=labels, attention="dense"), anchors=anchors, real=real, **b)
    total, loss_k, count_k, right_k, accept = naive(d, b, anchors, real, labels=labels)
    assert real.sum() >= 10 and count_k.min() >= 5
    assert o.count_k.tolist() == count_k.tolist() and o.correct_k.tolist() == right_k.tolist()
    torch.testing.assert_close(o.loss_k, loss_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.loss, total, rtol=1e-5, atol=1e-5)
    assert torch.equal(o.accept_len, accept)


def _slot_logits(d, b, anchors):
    """The block outputs' logits (R, N, B, V) of the fast path, through its own forward."""
    captured = {}
    hook = d.register_forward_hook(lambda m, i, out: captured.setdefault("h", out))
    dflash_forward(d, cfg=BlockLossConfig(attention="dense"), anchors=anchors,
                   real=torch.ones_like(anchors, dtype=torch.bool), **b)
    hook.remove()
    R, N = anchors.shape
    return (captured["h"] @ b["lm_head_weight"].T).view(R, N, d.config.block_size, -1)


def test_context_is_strictly_before_the_anchor():
    """Changing the features at the anchor or after it changes nothing of its block; at anchor - 1 it does."""
    d, b = drafter(), batch()
    anchors = torch.tensor([[9], [9]])
    base = _slot_logits(d, b, anchors)
    later = dict(b, aux=b["aux"].clone())
    later["aux"][:, 9:] += 5.0
    torch.testing.assert_close(_slot_logits(d, later, anchors), base)
    before = dict(b, aux=b["aux"].clone())
    before["aux"][:, 8] += 5.0
    assert not torch.allclose(_slot_logits(d, before, anchors), base)


def test_blocks_do_not_see_each_other_nor_other_samples():
    """A block's outputs are the same alone or beside other blocks, and another packed sample's features or tokens
    do not reach it."""
    d, b = drafter(), batch(packed=True)
    alone = _slot_logits(d, b, torch.tensor([[15], [15]]))
    beside = _slot_logits(d, b, torch.tensor([[5, 12, 15, 18], [3, 15, 16, 20]]))
    torch.testing.assert_close(beside[0, 2], alone[0, 0])
    torch.testing.assert_close(beside[1, 1], alone[1, 0])
    other = dict(b, aux=b["aux"].clone(), input_ids=b["input_ids"].clone())
    other["aux"][0, :10] += 5.0          # row 0's first sample; the anchor at 15 is in the second
    other["input_ids"][0, :10] = 7
    torch.testing.assert_close(_slot_logits(d, other, torch.tensor([[15], [15]]))[0], alone[0])


def test_attention_inside_the_block_is_bidirectional():
    """Slot 1's output depends on the last slot's input: the block is not causal (the engines' default)."""
    d = drafter(block=6)
    ctx = d.context_kv(torch.randn(1, 5, 3 * H), torch.arange(5)[None])
    e = torch.randn(1, 6, H)
    pos = torch.arange(5, 11)[None]
    e2 = e.clone()
    e2[0, 5] += 1.0
    assert not torch.allclose(d(e, pos, ctx)[0, 1], d(e2, pos, ctx)[0, 1])


def test_positions_continue_the_context():
    """The block sits at pos(a)..pos(a)+B-1: shifting its positions by one changes the outputs (RoPE is relative,
    so the same shift on context and block changes nothing)."""
    d = drafter()
    aux, e = torch.randn(1, 6, 3 * H), torch.randn(1, B, H)
    out = d(e, torch.arange(6, 6 + B)[None], d.context_kv(aux, torch.arange(6)[None]))
    moved = d(e, torch.arange(7, 7 + B)[None], d.context_kv(aux, torch.arange(6)[None]))
    both = d(e, torch.arange(16, 16 + B)[None], d.context_kv(aux, torch.arange(10, 16)[None]))
    assert not torch.allclose(out, moved, atol=1e-4)
    torch.testing.assert_close(out, both, rtol=1e-4, atol=1e-4)


def test_labels_are_the_token_at_anchor_plus_k_and_the_head_is_the_targets():
    """Hard labels: slot k's loss is the CE of lm_head(slot k) against x_{a+k} (no extra one-token shift), with the
    target's head passed in: the drafter owns no head and the head gets no gradient."""
    d, b = drafter(), batch()
    b["loss_mask"][:] = True
    anchors = torch.tensor([[6], [6]])
    logits = _slot_logits(d, b, anchors)
    o = dflash_forward(d, cfg=BlockLossConfig(labels="hard", attention="dense"), anchors=anchors,
                       real=torch.ones_like(anchors, dtype=torch.bool), **b)
    ids = b["input_ids"]
    for k in range(1, B):
        want = F.cross_entropy(logits[:, 0, k], ids[:, 6 + k])
        shifted = F.cross_entropy(logits[:, 0, k], ids[:, 7 + k])
        got = float(o.loss_k[k - 1].detach())
        assert abs(got - float(want)) < 1e-4 < abs(float(want) - float(shifted))
    assert not any("lm_head" in n or "embed" in n for n in d.state_dict())
    w = b["lm_head_weight"].clone().requires_grad_(False)
    o = dflash_forward(d, cfg=BlockLossConfig(attention="dense"), anchors=anchors,
                       real=torch.ones_like(anchors, dtype=torch.bool), **dict(b, lm_head_weight=w))
    o.loss.backward()
    assert w.grad is None and d.fc.weight.grad is not None


def test_mask_slots_use_the_targets_own_row():
    """The mask slots are embedded by the target's row of mask_token_id (what SGLang 0.5.14 serves without a
    sidecar); a published head's own row replaces it only when set."""
    d, E = drafter(), torch.randn(V, H)
    ids = torch.tensor([[5, V - 1, V - 1]])
    torch.testing.assert_close(d.embed_block(ids, E), F.embedding(ids, E))
    row = torch.randn(H)
    d.set_mask_embedding(row)
    out = d.embed_block(ids, E)
    torch.testing.assert_close(out[0, 1], row) and torch.testing.assert_close(out[0, 0], E[5])


def test_target_layer_ids_are_hf_indices_minus_one():
    """The store's aux index a is hidden_states[a], the output of decoder layer a-1: the engines' "after layer k"
    id k = a - 1 (both capture layers_to_capture = [k + 1])."""
    model = make_tiny_llama(layers=4, hidden=32, heads=4, kv_heads=2, vocab=V, inter=64)
    cfg = DFlashConfig.from_target(model.config, aux_layer_ids=(1, 2, 3), mask_token_id=V - 1, num_layers=1)
    assert cfg.target_layer_ids == [0, 1, 2]
    outs = {}
    for k in cfg.target_layer_ids:
        model.model.layers[k].register_forward_hook(lambda m, i, o, k=k: outs.setdefault(k, o[0] if isinstance(
            o, tuple) else o))
    ids = torch.randint(0, V, (1, 8))
    hs = model(ids, output_hidden_states=True).hidden_states
    for a, k in zip(cfg.aux_layer_ids, cfg.target_layer_ids):
        torch.testing.assert_close(hs[a], outs[k])


def test_shape_derived_from_the_target_and_bad_values_refused():
    tiny = make_tiny_llama(layers=24, hidden=32, heads=4, kv_heads=2, vocab=V, inter=64).config
    c = DFlashConfig.from_target(tiny, aux_layer_ids=(2, 12, 21), mask_token_id=3)
    assert (c.num_hidden_layers, c.block_size, c.hidden_size, c.num_key_value_heads) == (3, 16, 32, 2)
    assert c.param_count() == sum(p.numel() for p in DFlashDrafter(c).parameters())
    for bad in (dict(block_size=1), dict(block_size=33)):
        with pytest.raises(EyasError, match="block_size"):
            DFlashConfig.from_target(tiny, aux_layer_ids=(2, 12, 21), mask_token_id=3, **bad)
    with pytest.raises(EyasError, match="outside the target's vocabulary"):
        DFlashConfig.from_target(tiny, aux_layer_ids=(2, 12, 21), mask_token_id=V)
    with pytest.raises(EyasError, match="aux_layer_ids"):
        DFlashConfig.from_target(tiny, aux_layer_ids=(0, 12, 21), mask_token_id=3)

    class Tok:
        mask_token_id = None

        def get_vocab(self):
            return {"<|MASK|>": 17}
    assert default_mask_token(Tok(), V) == 17 and default_mask_token(None, V) == V - 1


# ------------------------------------------------------------------------------------- eyas train
def dcfg(tmp_path, store, name="run", **kw):
    base = dict(out=str(tmp_path / name), store=store, method="dflash", steps=6, batch_tokens=96, block_size=4,
                dflash_layers=2, anchors=8, eval_fraction=0.2, progress=False, deterministic=True, lr=1e-3)
    return TrainConfig(**{**base, **kw})


def test_train_dflash_resume_equals_uninterrupted(tmp_path, monkeypatch):
    """Anchors are drawn from the RNG the checkpoints save: a killed and resumed run equals one that never stopped,
    bit for bit, and its eval replays block decoding."""
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    full = run_train(dcfg(tmp_path, store, "full", steps=8, checkpoint_every=4), target=t)
    crashed_run(monkeypatch, lambda: run_train(dcfg(tmp_path, store, "cut", steps=8, checkpoint_every=4), target=t))
    run_train(dcfg(tmp_path, store, "cut", steps=8, checkpoint_every=4, resume=True), target=t)
    assert records(tmp_path / "full") == records(tmp_path / "cut")
    ev = full["eval"]
    assert len(ev["acc_k"]) == 3 and len(ev["round_tau_by_chain"]) == 3 and ev["round_tau_by_chain"][-1] >= 1.0
    conf = json.loads((tmp_path / "full" / "drafter" / "config.json").read_text())
    assert conf["kind"] == "dflash" and conf["block_size"] == 4 and conf["mask_token_id"] == V - 1


def test_train_dflash_learns_a_copy_task(tmp_path):
    """Samples that repeat one token: after training the block predicts it at every slot (acc and the replayed tau
    rise far above a random drafter's)."""
    t = tiny_target()
    samples = [(f"r{i}", [3 + i % 4] * 24, [0] * 4 + [1] * 20) for i in range(40)]
    store = capture(tmp_path, t, samples)
    r = run_train(dcfg(tmp_path, store, steps=60, lr=3e-3, eval_fraction=0.2, deterministic=False),
                  target=t)
    assert min(r["eval"]["acc_k"]) > 0.9 and r["eval"]["round_tau_by_chain"][-1] > 3.0


def test_train_dflash_online_matches_offline(tmp_path):
    t = tiny_target()
    samples = make_samples(16)
    store = capture(tmp_path, t, samples)
    prepared(tmp_path / "prep", t, samples)
    a = run_train(dcfg(tmp_path, store, "off", steps=1, eval_fraction=0.0), target=t)
    b = run_train(dcfg(tmp_path, None, "on", data=str(tmp_path / "prep"), target="custom", steps=1,
                       eval_fraction=0.0), target=t)
    assert a["train"]["positions_k"] == b["train"]["positions_k"]
    assert abs(a["train"]["loss"] - b["train"]["loss"]) < 1e-2 * abs(b["train"]["loss"])


def test_refusals_write_nothing(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(12))
    for kw, what in ((dict(ttt_steps=3), "ttt_steps"), (dict(draft_vocab=32), "draft_vocab"),
                     (dict(block_size=1), "block_size"), (dict(block_size=40), "block_size")):
        with pytest.raises(EyasError, match=what):
            dcfg(tmp_path, store, **kw)
    with pytest.raises(EyasError, match="does not apply to --method eagle3"):
        TrainConfig(out=str(tmp_path / "e"), store=store, block_size=8)
    with pytest.raises(EyasError, match="outside the target's vocabulary"):
        run_train(dcfg(tmp_path, store, "m", mask_token_id=V), target=t)
    assert not os.path.exists(tmp_path / "m")
    # an EAGLE-3 drafter as --init of a DFlash run, and the reverse
    run_train(TrainConfig(out=str(tmp_path / "e3"), store=store, steps=1, batch_tokens=96, draft_vocab=64,
                          ttt_steps=2, eval_fraction=0.0, progress=False), target=t)
    run_train(dcfg(tmp_path, store, "df", steps=1, eval_fraction=0.0), target=t)
    with pytest.raises(EyasError, match="EAGLE-3 drafter, but this run trains --method dflash"):
        run_train(dcfg(tmp_path, store, "x", init=str(tmp_path / "e3")), target=t)
    with pytest.raises(EyasError, match="DFlash drafter, but this run trains --method eagle3"):
        run_train(TrainConfig(out=str(tmp_path / "y"), store=store, steps=1, batch_tokens=96, ttt_steps=2,
                              init=str(tmp_path / "df"), progress=False), target=t)
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_gpu_flex_block_mask_equals_the_dense_mask(packed):
    """On CUDA the loss runs through a flex BlockMask: the same losses, counts and gradients as the dense mask."""
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=H, target_hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=256, vocab_size=V, aux_layer_ids=(1, 2, 3),
                       num_target_layers=4, block_size=8, mask_token_id=V - 1)
    d = DFlashDrafter(cfg).cuda()
    d.init_weights(0.3)
    b = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch(T=96, packed=packed).items()}
    seg = b["segment_ids"] if packed else b["valid"].long()
    anchors, real = sample_anchors(candidates(b["loss_mask"] & b["valid"], torch.where(b["valid"], seg, 0)), 24)
    outs = []
    for attention in ("dense", "flex"):
        d.zero_grad()
        o = dflash_forward(d, cfg=BlockLossConfig(attention=attention), anchors=anchors, real=real, **b)
        o.loss.backward()
        outs.append((o, d.fc.weight.grad.clone()))
    (a, ga), (f, gf) = outs
    assert a.count_k.tolist() == f.count_k.tolist()
    torch.testing.assert_close(f.loss_k, a.loss_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gf, ga, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_packed_flex_training_runs_and_learns(tmp_path):
    """`eyas train --method dflash` on CUDA as the gpu recipe runs it: packed rows, flex, compiled layers, bf16."""
    t = target_from_model(make_tiny_llama(layers=4, hidden=32, heads=2, kv_heads=1, vocab=V, inter=64))  # head_dim
    # 16: flex's CUDA kernels need >= 16
    samples = [(f"r{i}", [3 + i % 4] * 48, [0] * 8 + [1] * 40) for i in range(64)]
    store = capture(tmp_path, t, samples)
    r = run_train(dcfg(tmp_path, store, steps=40, lr=3e-3, batch_tokens=256, max_len=128, pack="on",
                       attention="flex", compile=True, deterministic=False, device="cuda", eval_fraction=0.2),
                  target=t)
    assert r["eval"]["round_tau_by_chain"][-1] > 2.0


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ddp", "fsdp2"])
def test_train_dflash_on_two_ranks(tmp_path, fsdp):
    """2 gloo ranks (DDP, or FSDP2 sharding the layers) train and evaluate a DFlash drafter: the held-out counts,
    summed over the ranks, equal one process's (evaluation anchors every position, so nothing random is left)."""
    import torch.multiprocessing as mp

    from test_train import _ddp_worker, _free_port

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    single = dcfg(tmp_path, store, "single", steps=3, grad_accum=2, deterministic=False)
    run_train(single, target=t)
    kw = {**single.to_dict(), "out": str(tmp_path / "ranks"), "grad_accum": 1, "fsdp": fsdp}
    mp.spawn(_ddp_worker, args=(2, _free_port(), kw), nprocs=2, join=True)
    a, b = records(tmp_path / "single", "eval")[-1], records(tmp_path / "ranks", "eval")[-1]
    assert a["positions_k"] == b["positions_k"] and len(b["round_tau_by_chain"]) == 3
    conf = json.loads((tmp_path / "ranks" / "drafter" / "config.json").read_text())
    assert conf["kind"] == "dflash"
