"""A stage that refuses its target writes nothing: `eyas train`, `eyas capture` and `eyas run`
open and check the target before they make their output directory, so a target that fails to open (a bad path, a
missing head tensor, a remote-code tokenizer without --trust-remote-code) or an --init head that does not fit leaves
no directory behind. The in-process bench and `eyas run` take --trust-remote-code and say when it is missing."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.models import make_tiny_llama
from eyas.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

REMOTE_MAP = {"AutoTokenizer": ["tokenization_remote.RemoteTokenizer", None]}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny Llama target directory, its remote-code twin (the tokenizer names its own code, which raises if it
    ever runs), its copy without lm_head.weight, a store captured from it, chats and bench prompts."""
    from test_chat_masks import make_tokenizer
    from test_prepare import write_data

    from eyas.capture.capture import CaptureConfig, run_capture
    from eyas.target import target_from_model

    r = tmp_path_factory.mktemp("refusals")
    tok = make_tokenizer()
    model = make_tiny_llama(layers=4, hidden=32, heads=4, kv_heads=2, vocab=len(tok), inter=64)
    model.save_pretrained(r / "target")
    tok.save_pretrained(r / "target")
    remote = Path(shutil.copytree(r / "target", r / "remote"))
    tc = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**tc, "auto_map": REMOTE_MAP}))
    (remote / "tokenization_remote.py").write_text("raise SystemExit('remote code ran')\n")
    headless = Path(shutil.copytree(r / "target", r / "headless"))
    w = load_file(headless / "model.safetensors")
    del w["lm_head.weight"]
    save_file(w, headless / "model.safetensors", metadata={"format": "pt"})
    g = torch.Generator().manual_seed(0)
    samples = [(f"s{i}", torch.randint(3, len(tok), (12,), generator=g).tolist(), [0] * 4 + [1] * 8)
               for i in range(8)]
    run_capture(CaptureConfig(out=str(r / "store"), progress=False), target_from_model(model, tok), samples=samples)
    write_data(r / "chats.jsonl", 12)
    with open(r / "prompts.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "the cat sat on the mat"}) + "\n")
    return r


def fail(argv, capsys) -> str:
    """Run the CLI expecting exit 2 and one line on stderr; return that line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if ": error: " in x]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def plain_tokenizer_for_remote(root, monkeypatch):
    """AutoTokenizer.from_pretrained records trust_remote_code and loads the plain copy's tokenizer (the remote
    code would exit): the calls' flags, in order."""
    from transformers import AutoTokenizer

    asked, real = [], AutoTokenizer.from_pretrained

    def record(path, *a, **k):
        if Path(str(path)).name == "remote":
            asked.append(k.get("trust_remote_code"))
            path, k = str(root / "target"), {**k, "trust_remote_code": False}
        return real(path, *a, **k)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", record)
    return asked


# ---- train ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["no-store", "bad-path", "remote", "headless"])
def test_train_refusing_its_target_or_store_leaves_no_run_dir(root, tmp_path, capsys, case):
    """Before: the run directory (and its parents) existed before the store or target was opened."""
    target, store = {"no-store": ("target", tmp_path / "nothing"), "bad-path": (tmp_path / "nowhere", root / "store"),
                     "remote": ("remote", root / "store"), "headless": ("headless", root / "store")}[case]
    out = tmp_path / "runs" / "run"
    line = fail(["train", "--store", str(store), "--target", str(root / target), "--out", str(out), "--steps", "1",
                 "--device", "cpu", "--no-progress"], capsys)
    expect = {"no-store": "no manifest", "bad-path": "nowhere", "remote": "--trust-remote-code",
              "headless": "lm_head"}[case]
    assert expect in line
    assert not (tmp_path / "runs").exists()


def test_capture_refusing_its_target_leaves_no_parent_dirs(root, tmp_path, capsys):
    """Before: the store's lock removed the store directory it made, but not the parents it made with it."""
    out, prep = tmp_path / "a" / "b" / "store", tmp_path / "prep"
    assert main(["prepare", "--target", str(root / "target"), "--data", str(root / "chats.jsonl"), "--out", str(prep),
                 "--heldout-fraction", "0", "--device", "cpu"]) == 0   # data that pass, so the target is refused
    line = fail(["capture", "--target", str(root / "remote"), "--data", str(prep), "--out", str(out)], capsys)
    assert "--trust-remote-code" in line
    assert not (tmp_path / "a").exists()


# ---- --init: position bounds differ, meaning does not -------------------------------------------------------

@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """The DeepSeek-V3 twin (the Kimi-K2.5 language model's shape: MLA, YaRN, MoE) in process, and a store of it."""
    from support.deepseek_twin import make_twin

    from eyas.capture.capture import CaptureConfig, run_capture
    from eyas.target import target_from_model

    r = tmp_path_factory.mktemp("init")
    model, tok = make_twin()
    target = target_from_model(model, tok, name="twin")
    g = torch.Generator().manual_seed(1)
    samples = [(f"s{i}", torch.randint(3, 300, (16,), generator=g).tolist(), [0] * 4 + [1] * 12) for i in range(12)]
    run_capture(CaptureConfig(out=str(r / "store"), progress=False), target, samples=samples)
    return target, r / "store"


def published_head(target, out: Path, **change) -> tuple[Path, dict]:
    """A head as a published EAGLE-3 checkpoint for the target (no eyas fingerprint), its config the target's
    drafter shape with `change`, written in fp32; (its directory, its state dict)."""
    from dataclasses import replace

    from eyas.export.export import export_drafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    base = DrafterConfig.from_target(target.config, draft_vocab_size=64, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(3)
    d = Eagle3Drafter(replace(base, **change))
    d.set_vocab(torch.zeros(64, dtype=torch.long), torch.arange(target.vocab_size) < 64)
    export_drafter(d, out, dtype="fp32", target=target)   # the target names its SGLang layer-id convention
    return out, {k: v.clone() for k, v in d.state_dict().items()}


def train_cfg(out: Path, store: Path, init: Path):
    from eyas.train.config import TrainConfig

    return TrainConfig(out=str(out), store=str(store), init=str(init), steps=1, batch_tokens=64, ttt_steps=2,
                       eval_fraction=0.0, progress=False, deterministic=True, device="cpu")


def test_init_head_whose_max_positions_differ_is_taken_with_the_runs_value(twin, tmp_path, capsys):
    """A published Kimi-K2 head says max_position_embeddings 131072, a Kimi-K2.5 run 262144: the drafter's plain RoPE
    never reads it, so the head is loaded as written (every tensor) under the run's value, said in one line.
    Before: refused as a differing drafter config."""
    from eyas.train.trainer import Trainer

    target, store = twin
    ours = target.config.max_position_embeddings
    head, state = published_head(target, tmp_path / "head", max_position_embeddings=ours // 2)
    capsys.readouterr()
    t = Trainer(train_cfg(tmp_path / "run", store, head), target)
    assert t.dcfg.max_position_embeddings == ours
    got = t.module.drafter.state_dict()
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    # the drafter the head's own config builds holds the same RoPE frequencies (the one buffer derived from the
    # config, non-persistent): only the position bound differs
    from dataclasses import replace

    from eyas.model.drafter import Eagle3Drafter
    own = dict(Eagle3Drafter(replace(t.dcfg, max_position_embeddings=ours // 2)).named_buffers())
    mine = dict(t.module.drafter.named_buffers())
    assert torch.equal(own["inv_freq"], mine["inv_freq"])
    notes = [x for x in capsys.readouterr().err.splitlines() if "--init" in x]
    assert notes == [f"eyas train: --init {head}: max_position_embeddings {ours // 2} -> {ours}, the run's (it only "
                     f"bounds positions; the drafter's plain RoPE does not read it)"]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["drafter"]["max_position_embeddings"] == ours


@pytest.mark.parametrize("change", [{"rope_theta": 10000.0}, {"rms_norm_eps": 1e-5}])
def test_init_head_whose_meaning_differs_is_refused_and_nothing_written(twin, tmp_path, change):
    """RoPE theta or eps change what the weights compute: refused naming the field. Before: the refusal came after
    the run directory and its vocabulary were written."""
    from eyas.errors import EyasError
    from eyas.train.trainer import Trainer

    target, store = twin
    head, _ = published_head(target, tmp_path / "head", **change)
    with pytest.raises(EyasError, match=f"drafter config of --init does not match \\({next(iter(change))}"):
        Trainer(train_cfg(tmp_path / "run", store, head), target)
    assert not (tmp_path / "run").exists()


# ---- bench and run: --trust-remote-code ------------------------------------------------------------------------

def test_in_process_bench_takes_trust_remote_code(root, tmp_path, capsys, plain_tokenizer_for_remote):
    """Before: --trust-remote-code was an --engine flag only; the in-process bench refused a remote-code target."""
    argv = ["bench", "--target", str(root / "remote"), "--prompts", str(root / "prompts.jsonl"), "--limit", "1",
            "--max-new-tokens", "4", "--device", "cpu", "--dtype", "fp32", "--json", str(tmp_path / "b.json")]
    line = fail(argv, capsys)
    assert "needs its own code" in line and "tokenization_remote.py" in line and "--trust-remote-code" in line
    assert plain_tokenizer_for_remote == [] and not (tmp_path / "b.json").exists()
    assert main(argv + ["--trust-remote-code"]) == 0
    assert plain_tokenizer_for_remote == [True]
    assert json.loads((tmp_path / "b.json").read_text())["methods"]["plain"]["tokens"] > 0


def test_run_takes_trust_remote_code_and_refuses_without_writing(root, tmp_path, capsys, plain_tokenizer_for_remote):
    """`eyas run` without the flag: the one-line refusal, and no run directory (before: run.json and logs/ were
    written first, and there was no flag to give). With it: every stage config carries it, the target opens with
    it, and the run's identity is the one without it."""
    from eyas.run import RunConfig, resolve_stages

    out = tmp_path / "run"
    argv = ["run", "--target", str(root / "remote"), "--data", str(root / "chats.jsonl"), "--out", str(out),
            "--preset", "cpu-demo", "--quiet", "--until", "prepare", "--set", "prepare.regenerate=false",
            "--set", "prepare.regenerate_limit=null",
            "--set", "prepare.limit=8", "--set", "dtype=\"fp32\""]
    line = fail(argv, capsys)
    assert "needs its own code" in line and "--trust-remote-code" in line
    assert not out.exists() and plain_tokenizer_for_remote == []
    assert main(argv + ["--trust-remote-code"]) == 0
    assert plain_tokenizer_for_remote == [True]
    assert json.loads((out / "run.json").read_text())["stages"]["prepare"]["done"]

    base = dict(target=str(root / "remote"), data=str(root / "chats.jsonl"), preset="cpu-demo", out=str(out))
    trusted = RunConfig(**base, trust_remote_code=True)
    assert trusted.identity() == RunConfig(**base).identity()
    s = resolve_stages(trusted, out, vocab_size=300)
    assert [c.trust_remote_code for c in (s.prepare, s.capture, s.train, *s.bench.values())] == [True] * 4
    s = resolve_stages(RunConfig(**base), out, vocab_size=300)
    assert not any(c.trust_remote_code for c in (s.prepare, s.capture, s.train, *s.bench.values()))


def test_run_bench_reopens_the_target_with_the_flag(root, tmp_path, monkeypatch):
    """The bench stage opens the target again when it benches in another dtype: with the run's flag too."""
    import eyas.target
    from eyas.run import RunConfig, _bench, resolve_stages

    seen = []

    class Opened(Exception):
        pass

    def load_target(spec, **kw):
        seen.append(kw.get("trust_remote_code"))
        raise Opened
    monkeypatch.setattr(eyas.target, "load_target", load_target)
    cfg = RunConfig(target=str(root / "remote"), data=str(root / "chats.jsonl"), preset="cpu-demo",
                    out=str(tmp_path / "run"), overrides={"dtype": "bf16", "bench_dtype": "fp32"},
                    trust_remote_code=True)
    with pytest.raises(Opened):
        _bench(cfg, resolve_stages(cfg, tmp_path / "run", vocab_size=300), tmp_path / "run", None)
    assert seen == [True]


def test_a_recipe_cannot_set_trust_remote_code(tmp_path):
    """It is the run's flag (trust is about the target, not a shareable recipe), so a stage table may not set it."""
    from eyas.errors import EyasError
    from eyas.recipes import load_recipe

    for table in ("prepare", "capture", "train"):
        p = tmp_path / f"{table}.toml"
        p.write_text(f"[{table}]\ntrust_remote_code = true\n")
        with pytest.raises(EyasError, match=f"\\[{table}\\] trust_remote_code is set by eyas run \\(from "
                                            f"--trust-remote-code\\)"):
            load_recipe(p)
