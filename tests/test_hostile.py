"""Hostile inputs through the CLI: every one ends in ONE line on stderr, exit
code 2 and no traceback, and no pickle is ever executed.

The corpus is generated here (no binary files in the repository): each case builds its bad input under a
temporary directory and returns the `eyas` argv that reads it. Channels: `eyas store verify|info` (store
reader, shard safetensors headers), `eyas export --drafter` (drafter config.json and safetensors),
`eyas bench --target/--drafter/--prompts` (GGUF, EAGLE-3 checkpoints, prompt files).
"""

import http.server
import json
import pickle
import re
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch

from support.models import make_tiny_llama
from eyas.cli import main
from eyas.errors import EyasError
from support.models import byte_tokenizer
from test_stage_start import TARGET_LINE

H = 8


# ------------------------------------------------------------------ builders

def st_bytes(header: dict, payload: bytes) -> bytes:
    """A safetensors file from a raw header dict (so it can lie about its tensors)."""
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + payload


def good_store(root: Path, n=3) -> Path:
    from eyas.store import StoreWriter

    p = root / "store"
    w = StoreWriter(p, header={"target": {"identity": "tiny", "config_sha256": "c", "tokenizer_sha256": None},
                               "layers": {"aux": [1, 2, 3]}, "dtype": "bf16", "hidden_size": H, "vocab_size": 100,
                               "data": {"source": "test"}, "config": {}}, shard_bytes=1, threads=1)
    g = torch.Generator().manual_seed(0)
    for k in range(n):
        t = 4 + k
        w.add_sample(f"s{k}", torch.randint(0, 100, (t,), generator=g), torch.ones(t, dtype=torch.long),
                     torch.randn(t, 3, H, generator=g), torch.randn(t, H, generator=g))
    w.close()
    w.finalize({f"s{k}" for k in range(n)})
    return p


def edit_json(path: Path, fn):
    obj = json.loads(path.read_text())
    fn(obj)  # edits in place
    path.write_text(json.dumps(obj))


def replace_shard(store: Path, data: bytes, *, fix_record=True) -> Path:
    """Overwrite the first shard; with fix_record its sidecar's size and sha256 agree with the new bytes,
    so only the content itself is hostile."""
    import hashlib

    shard = sorted(store.glob("shard-*.safetensors"))[0]
    shard.write_bytes(data)
    if fix_record:
        side = shard.with_suffix(".json")
        rec = json.loads(side.read_text())
        rec["bytes"], rec["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        side.write_text(json.dumps(rec))
        edit_json(store / "manifest.json",
                  lambda m: m["shards"][0].update(bytes=len(data), sha256=rec["sha256"]))
    return shard


def first(store: Path, pattern: str) -> Path:
    return sorted(store.glob(pattern))[0]


# ---- store cases: (name, builder(root) -> argv)

def store_case(mutate, cmd="verify"):
    def build(root):
        p = good_store(root)
        mutate(p)
        return ["store", cmd, str(p)]
    return build


def _hdr(n_bytes_hidden, offsets):
    """A shard header whose tensors are described by `offsets` (the payload may be shorter)."""
    return {"__metadata__": {"format": "eyas-store-v1", "ids": json.dumps(["s0"])},
            "hidden": {"dtype": "BF16", "shape": [4, 4, H], "data_offsets": offsets}}


STORE_CASES = {
    "store-no-manifest": store_case(lambda p: (p / "manifest.json").unlink()),
    "store-manifest-not-json": store_case(lambda p: (p / "manifest.json").write_text("{not json")),
    "store-manifest-invalid-utf8": store_case(lambda p: (p / "manifest.json").write_bytes(b'{"schema": "\xff\xfe"}')),
    "store-manifest-is-a-list": store_case(lambda p: (p / "manifest.json").write_text("[1, 2]")),
    "store-manifest-other-schema": store_case(lambda p: edit_json(p / "manifest.json", lambda m: m.update(schema=99))),
    "store-manifest-other-kind": store_case(lambda p: edit_json(p / "manifest.json", lambda m: m.update(kind="prepared"))),
    "store-other-format": store_case(lambda p: edit_json(p / "manifest.json", lambda m: m.update(format="v0"))),
    "store-incomplete": store_case(lambda p: edit_json(p / "manifest.json", lambda m: m.update(complete=False))),
    "store-manifest-lists-other-shards": store_case(
        lambda p: edit_json(p / "manifest.json", lambda m: m.update(shards=m["shards"][:1]))),
    "store-sidecar-not-json": store_case(lambda p: first(p, "shard-*.json").write_text("{")),
    "store-sidecar-empty-object": store_case(lambda p: first(p, "shard-*.json").write_text("{}")),
    "store-sidecar-wrong-types": store_case(
        lambda p: edit_json(first(p, "shard-*.json"), lambda r: r.update(samples="three", ids="s0"))),
    "store-sidecar-path-traversal": store_case(
        lambda p: edit_json(first(p, "shard-*.json"), lambda r: r.update(file="../../../etc/passwd"))),
    # a sidecar pointing outside the store at a file of the right size and checksum (read by verify before the fix)
    "store-sidecar-path-traversal-same-size": lambda root: store_case(lambda p: (
        (p.parent / "victim.safetensors").write_bytes(first(p, "shard-*.safetensors").read_bytes()),
        edit_json(first(p, "shard-*.json"), lambda r: r.update(file="../victim.safetensors")),
        edit_json(p / "manifest.json", lambda m: m.update(complete=False))))(root)
        + ["--allow-incomplete"],
    "store-manifest-shards-garbage": store_case(lambda p: edit_json(p / "manifest.json", lambda m: m.update(shards=[1]))),
    "store-manifest-unknown-dtype": store_case(lambda p: edit_json(p / "manifest.json", lambda m: m.update(dtype="fp4"))),
    "store-manifest-layers-a-list": store_case(lambda p: edit_json(p / "manifest.json", lambda m: m.update(layers=[2]))),
    "store-manifest-no-hidden-size": store_case(
        lambda p: edit_json(p / "manifest.json", lambda m: m.pop("hidden_size")), cmd="info"),
    "store-sidecar-names-another-shard": store_case(
        lambda p: edit_json(first(p, "shard-*.json"), lambda r: r.update(file="shard-r000-00002.safetensors"))),
    "store-shard-missing": store_case(lambda p: first(p, "shard-*.safetensors").unlink()),
    "store-shard-truncated": store_case(
        lambda p: first(p, "shard-*.safetensors").write_bytes(first(p, "shard-*.safetensors").read_bytes()[:-7])),
    "store-shard-bit-flip": store_case(lambda p: (lambda f, b: f.write_bytes(b[:-1] + bytes([b[-1] ^ 1])))(
        first(p, "shard-*.safetensors"), first(p, "shard-*.safetensors").read_bytes())),
    "store-duplicate-id": store_case(
        lambda p: edit_json(sorted(p.glob("shard-*.json"))[1], lambda r: r.update(ids=["s0"]))),
    "store-shard-header-huge-tensor": store_case(
        lambda p: replace_shard(p, st_bytes({"hidden": {"dtype": "BF16", "shape": [1 << 40, 4, H],
                                                        "data_offsets": [0, (1 << 40) * 4 * H * 2]}}, b"\0" * 64))),
    "store-shard-header-overlapping": store_case(
        lambda p: replace_shard(p, st_bytes({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                             "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
                                            b"\0" * 24))),
    "store-shard-header-length-lies": store_case(
        lambda p: replace_shard(p, struct.pack("<Q", 1 << 60) + b"{}" + b"\0" * 30)),
    "store-shard-header-not-json": store_case(lambda p: replace_shard(p, struct.pack("<Q", 6) + b"{nope}")),
    "store-shard-empty-file": store_case(lambda p: replace_shard(p, b"")),
    "store-shard-wrong-tensors": store_case(
        lambda p: replace_shard(p, st_bytes({"hidden": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                                            b"\0" * 8))),
    "store-info-on-a-file": lambda root: ["store", "info", str((root / "f").write_text("x") and root / "f")],
}


# ---- drafter (eyas export --drafter) cases

def saved_drafter(root: Path) -> Path:
    from eyas.model.checkpoint import save_drafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    model = make_tiny_llama(layers=4, hidden=32, heads=2, kv_heads=1, vocab=64, inter=64)
    d = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=64, aux_layer_ids=(1, 2, 3)))
    p = root / "drafter"
    save_drafter(d, p, meta={"target": {"identity": "tiny"}})
    return p


def export_case(mutate):
    def build(root):
        p = saved_drafter(root)
        mutate(p)
        return ["export", "--drafter", str(p), "--out", str(root / "out")]
    return build


EXPORT_CASES = {
    "drafter-dir-missing": lambda root: ["export", "--drafter", str(root / "nope"), "--out", str(root / "out")],
    "drafter-config-not-json": export_case(lambda p: (p / "config.json").write_text("{")),
    "drafter-config-invalid-utf8": export_case(lambda p: (p / "config.json").write_bytes(b"{\"a\": \"\xc3\x28\"}")),
    "drafter-config-missing-fields": export_case(lambda p: (p / "config.json").write_text("{\"aux_layer_ids\": [1, 2, 3]}")),
    "drafter-config-wrong-types": export_case(
        lambda p: edit_json(p / "config.json", lambda c: c.update(hidden_size="wide"))),
    "drafter-weights-missing": export_case(lambda p: (p / "model.safetensors").unlink()),
    "drafter-weights-empty": export_case(lambda p: (p / "model.safetensors").write_bytes(b"")),
    "drafter-weights-truncated": export_case(
        lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:200])),
    "drafter-weights-huge-tensor": export_case(lambda p: (p / "model.safetensors").write_bytes(
        st_bytes({"fc.weight": {"dtype": "F32", "shape": [1 << 30, 1 << 10], "data_offsets": [0, 1 << 42]}},
                 b"\0" * 64))),
    "drafter-weights-overlapping": export_case(lambda p: (p / "model.safetensors").write_bytes(
        st_bytes({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24))),
    "drafter-weights-wrong-shapes": export_case(lambda p: edit_json(
        p / "config.json", lambda c: c.update(intermediate_size=c["intermediate_size"] * 2))),
    "drafter-weights-are-a-pickle": export_case(lambda p: (p / "model.safetensors").write_bytes(
        pickle.dumps(Boom(p.parent / "PWNED")))),
}


class Boom:
    """Unpickling this writes a marker file: proof that a pickle was executed."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path(self.marker).write_text, ("pwned",))


# ---- bench cases: a tiny HF target directory (random Llama + byte-level tokenizer with a chat template)

def tiny_target_dir(root: Path, layers=4) -> Path:
    p = root / "target"
    model = make_tiny_llama(layers=layers, hidden=32, heads=2, kv_heads=1, vocab=258, inter=64)
    model.save_pretrained(p)
    byte_tokenizer().save_pretrained(p)
    return p


def prompts_file(root: Path, data: bytes | None = None) -> Path:
    p = root / "prompts.jsonl"
    p.write_bytes(data if data is not None else b'{"prompt": "hello"}\n')
    return p


def eagle3_dir(root: Path, mutate=None) -> Path:
    """An exported EAGLE-3 checkpoint for the tiny target (the layout SGLang and vLLM load)."""
    from eyas.export.export import export_drafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(root / "target")
    d = Eagle3Drafter(DrafterConfig.from_target(cfg, draft_vocab_size=258, aux_layer_ids=(1, 2, 3)))
    p = export_drafter(d, root / "eagle3", dtype="fp32")
    if mutate:
        mutate(p)
    return p


def bench(root, *extra):
    return ["bench", "--device", "cpu", "--limit", "1", "--max-new-tokens", "2", "--max-seq", "64",
            "--no-baselines", *extra]


def gguf_cut_short(root):
    # magic, version 3, 2 tensors, 5 key/value pairs: then the file ends in the middle of the first key
    p = root / "cut.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2, 5) + struct.pack("<Q", 40) + b"general.arch")
    return bench(root, "--target", str(p), "--prompts", str(prompts_file(root)))


def pickle_weights(p):
    (p / "model.safetensors").unlink()
    (p / "pytorch_model.bin").write_bytes(pickle.dumps(Boom(p.parent / "PWNED")))


def two_layer_config(p):
    edit_json(p / "config.json", lambda c: c.update(num_hidden_layers=2))


def target_more_layers(root):
    t = tiny_target_dir(root)
    edit_json(t / "config.json", lambda c: c.update(num_hidden_layers=6))
    return bench(root, "--target", str(t), "--prompts", str(prompts_file(root)))


BENCH_CASES = {
    "gguf-cut-short": gguf_cut_short,
    "gguf-empty-file": lambda root: bench(root, "--target", str((root / "e.gguf").write_bytes(b"") or root / "e.gguf")),
    "gguf-not-gguf": lambda root: bench(root, "--target", str((root / "x.gguf").write_text("GGML?") and root / "x.gguf")),
    "prompts-invalid-utf8": lambda root: bench(
        root, "--target", str(tiny_target_dir(root)),
        "--prompts", str(prompts_file(root, b'{"prompt": "caf\xe9"}\n{"prompt": "\xff\xfe"}\n'))),
    "prompts-not-jsonl": lambda root: bench(
        root, "--target", str(tiny_target_dir(root)), "--prompts", str(prompts_file(root, b"\x00\x01garbage"))),
    "eagle3-weights-are-a-pickle": lambda root: bench(
        root, "--target", str(tiny_target_dir(root)), "--prompts", str(prompts_file(root)),
        "--drafter", str(eagle3_dir(root, pickle_weights))),
    "eagle3-config-two-layers": lambda root: bench(
        root, "--target", str(tiny_target_dir(root)), "--prompts", str(prompts_file(root)),
        "--drafter", str(eagle3_dir(root, two_layer_config))),
    "target-config-more-layers-than-weights": target_more_layers,
}

# ---- prepare cases: chat templates that raise, a regeneration server that answers garbage

def conversations_file(root: Path, n=3) -> Path:
    p = root / "convs.jsonl"
    p.write_text("".join(json.dumps({"id": f"c{k}", "messages": [{"role": "user", "content": f"question {k}"},
                                                                {"role": "assistant", "content": f"answer {k}"}]})
                         + "\n" for k in range(n)))
    return p


def template_target(root: Path, template: str) -> Path:
    """The tiny target with `template` as its tokenizer_config chat_template (the saved .jinja file removed, as
    it would take precedence)."""
    t = tiny_target_dir(root)
    (t / "chat_template.jinja").unlink(missing_ok=True)
    edit_json(t / "tokenizer_config.json", lambda c: c.update(chat_template=template))
    return t


def prepare(root, target, *extra):
    return ["prepare", "--target", str(target), "--data", str(conversations_file(root)), "--out", str(root / "prep"),
            "--heldout-fraction", "0", *extra]


RAISES = "{{ raise_exception('this template refuses everything') }}"
# renders the probe (a lone user turn) but raises on every assistant turn, so every conversation fails
RAISES_ON_REPLIES = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                     "{{ raise_exception('no assistant turns here') }}{% endif %}"
                     "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MALFORMED = "{% for m in messages %}{{ m['content'] }"  # unclosed tag and loop


class _Garbage(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server gone wrong; the mode is the first path segment of the URL."""

    def log_message(self, *a):
        pass

    def _send(self, body: bytes, length=None):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(json.dumps({"data": [{"id": "m"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = self.path.strip("/").split("/")[0]
        if mode == "garbage":
            self._send(b"\x00\xffthis is not json {{{")
        elif mode == "close":  # promises 4096 bytes, sends a few, hangs up
            self._send(b'{"choices": [{"message": {"content": "hel', length=4096)
            self.close_connection = True
        elif mode == "wrong-types":
            self._send(json.dumps({"choices": [{"message": {"content": 5}, "finish_reason": "stop"}],
                                   "usage": {"completion_tokens": "three"}}).encode())
        elif mode == "no-choices":
            self._send(json.dumps({"choices": []}).encode())


_SERVERS: list = []


def garbage_server(mode: str) -> str:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _SERVERS.append(srv)
    return f"http://127.0.0.1:{srv.server_address[1]}/{mode}/v1"


def regen_case(mode: str, *extra):
    return lambda root: prepare(root, tiny_target_dir(root), "--regenerate", "--server", garbage_server(mode),
                                "--retries", "1", "--timeout", "10", "--max-len", "64", "--max-new-tokens", "4",
                                *extra)


PREPARE_CASES = {
    "chat-template-raises": lambda root: prepare(root, template_target(root, RAISES)),
    "chat-template-raises-on-every-reply": lambda root: prepare(root, template_target(root, RAISES_ON_REPLIES)),
    "chat-template-malformed-jinja": lambda root: prepare(root, template_target(root, MALFORMED)),
    "regen-server-streams-garbage": regen_case("garbage", "--model", "m"),
    "regen-server-closes-mid-reply": regen_case("close", "--model", "m"),
    "regen-server-reply-wrong-types": regen_case("wrong-types", "--model", "m"),
    "regen-server-no-choices": regen_case("no-choices"),
}


# ---- engine ingest-vllm: a sample id or a file that points outside the directories

def ingest_case(sample_id: str, plant=None):
    def build(root):
        from eyas.data.prepared import PreparedWriter, Sample
        from eyas.store.writer import StoreWriter

        target, vllm_dir, prep, out = tiny_target_dir(root), root / "vllm", root / "prepared", root / "store"
        vllm_dir.mkdir()
        w = PreparedWriter(prep, identity={"test": 1})
        w.add(Sample(id=sample_id, input_ids=list(range(3, 12)), loss_mask=[1] * 9))
        w.commit(1, {})
        w.finish({"counts": {"kept": 1}})
        StoreWriter(out, header={"target": {"identity": "tiny", "config_sha256": "c", "tokenizer_sha256": None},
                                 "layers": {"aux": [1, 2, 3]}, "dtype": "bf16", "hidden_size": 32,
                                 "vocab_size": 258, "data": {"source": "test"}, "config": {}}).close()
        if plant:
            plant(root, vllm_dir, sample_id)
        return ["engine", "ingest-vllm", "--vllm-dir", str(vllm_dir), "--data", str(prep), "--out", str(out),
                "--target-config", str(target / "config.json")]
    return build


def symlink_outside(root, vllm_dir, sid):
    from safetensors.torch import save_file

    outside = root / "outside.safetensors"
    save_file({"token_ids": torch.arange(3, 12), "hidden_states": torch.zeros(9, 4, 32)}, str(outside))
    (vllm_dir / f"cmpl-{sid}#a0-0.safetensors").symlink_to(Path("..") / outside.name)


INGEST_CASES = {
    "ingest-vllm-sample-id-dotdot": ingest_case("../../escape"),
    "ingest-vllm-sample-id-dotdot-only": ingest_case(".."),
    "ingest-vllm-file-links-outside": ingest_case("s0", symlink_outside),
}


# ---- eyas run: a recipe value of the wrong type

def recipe_file(root: Path) -> Path:
    p = root / "bad.toml"
    p.write_text('[run]\ndevice = "cpu"\n\n[train]\nepochs = "two"\n')
    return p


RUN_CASES = {
    "run-set-wrong-type": lambda root: ["run", "--preset", "cpu-demo", "--out", str(root / "run"),
                                        "--set", 'train.epochs="two"'],
    "run-set-bare-word": lambda root: ["run", "--preset", "cpu-demo", "--out", str(root / "run"),
                                       "--set", "prepare.max_len=long"],
    "run-recipe-wrong-type": lambda root: ["run", "--recipe", str(recipe_file(root)), "--out", str(root / "run")],
}


# case -> a word the error line must contain (the input was refused for the right reason)
EXPECT = {"target-config-more-layers-than-weights": "layer", "eagle3-config-two-layers": "num_hidden_layers",
          "gguf-cut-short": "GGUF", "prompts-invalid-utf8": "UTF-8",
          "chat-template-raises": "chat template", "chat-template-raises-on-every-reply": "chat template",
          "chat-template-malformed-jinja": "chat template", "regen-server-streams-garbage": "attempts",
          "regen-server-closes-mid-reply": "attempts", "regen-server-reply-wrong-types": "attempts",
          "ingest-vllm-sample-id-dotdot": "escape", "ingest-vllm-sample-id-dotdot-only": "..",
          "ingest-vllm-file-links-outside": "outside", "run-set-wrong-type": "epochs",
          "run-set-bare-word": "max_len", "run-recipe-wrong-type": "epochs"}

CASES = {**STORE_CASES, **EXPORT_CASES, **BENCH_CASES, **PREPARE_CASES, **INGEST_CASES, **RUN_CASES}


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    yield
    while _SERVERS:
        srv = _SERVERS.pop()
        srv.shutdown()
        srv.server_close()


PROGRESS = re.compile(r"^[^|]*\|[^|]*\|\s*\d+/\d+ \[")


def is_progress(line: str) -> bool:
    """A tqdm progress-bar line (redrawn with carriage returns): not an error line."""
    parts = [x for x in line.split("\r") if x.strip()]
    return bool(parts) and all(PROGRESS.match(x) for x in parts)


def run_cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# Known gaps: strict xfails, so a fix turns them into failures to un-mark. None left.
XFAIL: dict[str, str] = {}


def is_diagnostic(line: str) -> bool:
    """Per-record skip notices name the record and why, and the stage's first line names its target; they are not the
    error line."""
    return line.startswith("eyas: skipped ") or bool(TARGET_LINE.fullmatch(line))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=XFAIL[n], strict=True))
                                  if n in XFAIL else n for n in sorted(CASES)])
def test_hostile_input_one_line_exit_2(name, tmp_path, capsys):
    root = tmp_path / "case"
    root.mkdir()
    argv = CASES[name](root)
    capsys.readouterr()
    rc, out, err = run_cli(argv, capsys)
    lines = [ln for ln in err.split("\n") if ln.strip() and not is_progress(ln)]
    errors = [ln for ln in lines if not is_diagnostic(ln)]
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err and len(errors) == 1, err[-2000:]
    assert errors[0].startswith(f"eyas {argv[0]}: error: "), errors[0]
    assert EXPECT.get(name, "") in "\n".join(lines), lines
    assert not (root / "PWNED").exists(), "a pickle was executed"
    assert not (root / "out" / "config.json").exists(), "a partial export was left behind"
    assert not (root / "prep" / "manifest.json").exists(), "prepare finished a dataset it could not fill"


def test_corpus_size():
    assert len(CASES) >= 25


@pytest.mark.parametrize("planted", ["state.pt", "rng-r000.pt"])
def test_checkpoint_pickle_is_never_executed(tmp_path, planted):
    """A pickle planted in a checkpoint directory (as a raw pickle or inside torch.save's zip) is refused with
    an EyasError naming the file, and never run."""
    from eyas.train.checkpoint import load_checkpoint, save_checkpoint

    ck = save_checkpoint(tmp_path / "run", 1, {"model": {"w": torch.ones(2)}, "step": 1})
    for how, data in (("raw pickle", pickle.dumps(Boom(tmp_path / "PWNED"))), ("torch.save", None)):
        if data is None:
            torch.save({"model": Boom(tmp_path / "PWNED")}, ck / planted)
        else:
            (ck / planted).write_bytes(data)
        with pytest.raises(EyasError, match=re.escape(str(ck / planted)) + ".*refused without running it"):
            load_checkpoint(ck)
        assert not (tmp_path / "PWNED").exists(), f"a pickle in a checkpoint directory was executed ({how})"


def test_checkpoint_round_trips_under_weights_only(tmp_path):
    """What a training checkpoint holds (optimizer and scheduler state, RNG states) loads with weights_only."""
    import random

    from eyas.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state

    w = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    w.sum().backward()
    opt.step()
    sched.step()
    state = {"model": {"w": w.detach()}, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "step": 1, "data": {"epoch": 0, "position": 3}, "config": {"betas": [0.9, 0.95], "out": "x"}}
    random.seed(5)
    torch.manual_seed(5)
    expect = (random.random(), torch.rand(2))
    random.seed(5)
    torch.manual_seed(5)
    ck = save_checkpoint(tmp_path / "run", 1, state)
    got, rng = load_checkpoint(ck)
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert got["scheduler"] == state["scheduler"] and got["data"] == state["data"]
    set_rng_state(rng)
    assert random.random() == expect[0] and torch.equal(torch.rand(2), expect[1])


def test_chat_template_failing_some_records_skips_them(tmp_path, capsys):
    """Only a template that fails on EVERY conversation stops prepare; one failing some is a counted skip."""
    some = RAISES_ON_REPLIES.replace("m['role'] == 'assistant'", "m['content'] == 'answer 1'")
    argv = prepare(tmp_path, template_target(tmp_path, some))
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0, err[-2000:]
    m = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert m["counts"]["kept"] == 2 and m["counts"]["dropped"] == {"chat template error": 1}
