"""Capture on 2 GPUs: launch-args' TP / EP / attention-DP flags, and every sample exactly once across
the hooks of several DP groups.

SGLang deals requests to its DP groups round robin, and each group's hook knows only what it wrote. The fake
server below does the same with two real CaptureHooks (DP ranks 0 and 1) on one store; a reply lost after the
hook saw the request makes the client retry, which round robin sends to the other group.
"""

import json
import re
import threading
import zipfile
from pathlib import Path

import pytest

from support import engine_src
from support.engine_fakes import H, make_args
from support.engine_sglang_layouts import declares_flag, server_arg_sources
from eyas.cli import main
from eyas.engines.capture import run_engine_capture
from eyas.engines.client import EngineCaptureConfig
from eyas.engines.records import sample_id_of
from eyas.engines.sglang_hook import CaptureHook
from eyas.errors import EyasError
from eyas.store.reader import Store
from eyas.store.writer import read_sidecars

SAMPLES = {f"s{i}": list(range(10 * i + 1, 10 * i + 7)) for i in range(8)}
MASKS = {k: [1] * len(v) for k, v in SAMPLES.items()}
PREP = ({"target": {"identity": "fake", "config_sha256": "0", "tokenizer_sha256": "0"}}, SAMPLES, MASKS)
TWIN = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 7,
        "hidden_size": 256, "first_k_dense_replace": 1}


class TwoGroupServer:
    """SGLang with `--dp-size 2 --enable-dp-attention`: round robin over two DP groups unless the request names one
    (routed_dp_rank); /server_info reports dp_size 2. `lost`: samples whose first reply is lost after the forward."""

    def __init__(self, store, lost=()):
        self.hooks = [CaptureHook(store=store, expected=SAMPLES, loss_masks=MASKS, ranks=lambda g=g: (0, g, 2),
                                  idle_flush_s=0.2) for g in (0, 1)]
        self.lost, self.seen, self.next, self.lock = set(lost), set(), 0, threading.Lock()

    def get(self, url, timeout):
        return {"dp_size": 2, "enable_dp_attention": True, "enable_two_batch_overlap": False}

    def post(self, url, body, timeout):
        rid, sid = body["rid"], sample_id_of(body["rid"])
        with self.lock:
            g = body.get("routed_dp_rank")
            if g is None:
                g, self.next = self.next, (self.next + 1) % 2
            self.hooks[g](None, make_args([(rid, sid, 0, len(body["input_ids"]), 0)], SAMPLES))
            first = sid not in self.seen
            self.seen.add(sid)
        if first and sid in self.lost:
            raise TimeoutError("read timeout (the server ran the forward)")
        return {"text": "x", "meta_info": {"id": rid}}


def capture(out, srv):
    cfg = EngineCaptureConfig(engine="sglang", url="http://fake", data="fake", out=str(out), concurrency=2, retries=2,
                              commit_wait_s=10)
    return run_engine_capture(cfg, aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000, samples=PREP,
                              post=srv.post, get=srv.get)


def test_a_lost_reply_under_attention_dp_is_captured_once_across_the_groups(tmp_path):
    out = tmp_path / "store"
    m = capture(out, TwoGroupServer(out, lost={"s1", "s2", "s5"}))
    assert m["complete"]
    ids = [i for r in read_sidecars(out) for i in r["ids"]]
    assert sorted(ids) == sorted(SAMPLES)                     # each sample once over both ranks' shards
    assert {r["rank"] for r in read_sidecars(out)} == {1, 2}  # both DP groups wrote (store ranks 1 and 2)
    assert sorted(Store(out).ids) == sorted(SAMPLES)


def test_a_sample_two_ranks_committed_is_named_and_the_store_resumes_after_one_shard_goes(tmp_path):
    out = tmp_path / "store"
    capture(out, TwoGroupServer(out))                         # a complete store; then group 1 writes s3 again
    wrote = next(r["rank"] for r in read_sidecars(out) if "s3" in r["ids"])     # store rank 1 or 2
    other = 2 - wrote                                          # the DP group that did not write it
    hook = CaptureHook(store=out, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (0, other, 2), idle_flush_s=0)
    hook.tp_rank, hook.dp_rank, hook.dp_size = 0, other, 2    # a writer that never read the sidecars
    hook(None, make_args([("s3#a9", "s3", 0, len(SAMPLES["s3"]), 0)], SAMPLES))
    hook.flush()
    with pytest.raises(EyasError) as e:
        capture(out, TwoGroupServer(out))
    msg = str(e.value)
    assert "\n" not in msg and "'s3'" in msg and len(re.findall(r"shard-r00\d-\d+\.safetensors", msg)) == 2
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    dup = re.findall(r"(shard-r00\d-\d+)\.safetensors", msg)[1]
    for f in out.glob(f"{dup}.*"):                            # the repair the message gives
        f.unlink()
    assert capture(out, TwoGroupServer(out))["complete"]
    assert sorted(Store(out).ids) == sorted(SAMPLES)


# ---- launch-args for 2 GPUs ----

def launch(capsys, tmp_path, engine, *extra, rc=0):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TWIN))
    assert main(["engine", "launch-args", engine, "--target-config", str(cfg), "--max-model-len", "2048",
                 *extra]) == rc
    cap = capsys.readouterr()
    return (cap.out if rc == 0 else cap.err).replace("\\\n", " ").split()


PAR = ("--tp-size", "--ep-size", "--dp-size", "--enable-dp-attention", "--attn-dp-size", "--tensor-parallel-size",
       "--enable-expert-parallel")


def parallel_flags(out):
    return [a for k, a in enumerate(out) if a in PAR or (k and out[k - 1] in PAR and a.isdigit())]


@pytest.mark.parametrize("engine, extra, want", [
    ("sglang", ["--tp", "2"], ["--tp-size", "2"]),
    ("sglang", ["--tp", "2", "--ep", "2"], ["--tp-size", "2", "--ep-size", "2"]),
    ("sglang", ["--tp", "2", "--attn-dp", "2"], ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]),
    ("vllm", ["--tp", "2"], ["--tensor-parallel-size", "2"]),
    ("vllm", ["--tp", "2", "--ep", "2"], ["--tensor-parallel-size", "2", "--enable-expert-parallel"])])
def test_the_two_gpu_configurations_emit_their_flags(capsys, tmp_path, engine, extra, want):
    ver = ["--version", "0.5.14"] if engine == "sglang" else []
    assert parallel_flags(launch(capsys, tmp_path, engine, *ver, *extra)) == want


@pytest.mark.parametrize("engine, extra, why", [
    ("sglang", ["--tp", "2", "--attn-dp", "3"], "--attn-dp 3 does not divide --tp 2"),
    ("sglang", ["--tp", "2", "--ep", "4"], "--ep 4 does not divide --tp 2"),
    ("sglang", ["--tp", "0"], "must be >= 1"),
    ("vllm", ["--tp", "4", "--ep", "2"], "--ep must be 1 or 4"),
    ("vllm", ["--tp", "2", "--attn-dp", "2"], "--attn-dp is SGLang's")])
def test_sizes_the_engine_would_refuse_at_start_are_refused_in_one_line(capsys, tmp_path, engine, extra, why):
    err = " ".join(launch(capsys, tmp_path, engine, *extra, rc=2))
    assert why in err


# ---- against the wheels' own argument declarations ----

def vllm_wheel() -> Path | None:
    found = sorted(engine_src.cache_dir().glob("vllm-0.25.0-*.whl"))
    return found[0] if found else None


def vllm_cli_flags(whl: Path) -> set[str]:
    """Every option string vLLM 0.25.0's `vllm serve` parser adds: the add_argument calls of its engine and
    frontend argument modules (a bool option also gets its --no- form: BooleanOptionalAction)."""
    import ast
    flags: set[str] = set()
    with zipfile.ZipFile(whl) as z:
        for member in ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py"):
            tree = ast.parse(z.read(member))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                    flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
            # FrontendArgs: dataclass fields become --field-name options through its own loop
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name == "FrontendArgs":
                    flags |= {"--" + s.target.id.replace("_", "-") for s in node.body if isinstance(s, ast.AnnAssign)}
    return flags | {"--no-" + f[2:] for f in flags}


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--tp", "2"], ["--tp", "2", "--ep", "2"], ["--tp", "2", "--attn-dp", "2"]])
def test_sglang_0_5_14_declares_every_flag_of_the_two_gpu_commands(capsys, tmp_path, extra):
    whl = engine_src.wheel("0.5.14")
    if whl is None:
        pytest.skip("sglang 0.5.14 wheel not cached and PyPI unreachable")
    src = server_arg_sources(whl)
    out = launch(capsys, tmp_path, "sglang", "--version", "0.5.14", *extra)
    assert [f for f in out if f.startswith("--") and not declares_flag(src, f)] == []
    for f in ("--tp-size", "--ep-size", "--dp-size"):          # integer fields, as launch-args writes them
        if f in out:
            assert re.search(rf"^\s+{f[2:].replace('-', '_')}:\s*A\[\s*int\b", src[0], re.M) or \
                any(re.search(rf"^\s+{f[2:].replace('-', '_')}:\s*A\[\s*int\b", s, re.M) for s in src[1:])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--tp", "2"], ["--tp", "2", "--ep", "2"]])
def test_vllm_0_25_0_declares_every_flag_of_the_two_gpu_commands(capsys, tmp_path, extra):
    whl = vllm_wheel()
    if whl is None:
        pytest.skip("vllm 0.25.0 wheel not in the engine-wheel cache")
    flags = vllm_cli_flags(whl)
    assert {"--tensor-parallel-size", "--no-enable-prefix-caching"} <= flags and "--ep-size" not in flags
    out = launch(capsys, tmp_path, "vllm", *extra)
    assert [f for f in out[2:] if f.startswith("--") and f not in flags] == []
