"""Target fingerprints: what a target *is*, portable across machines, paths and transformers versions.

    {"fingerprint": 3,
     "identity": "smollm2-135m",              # how it was named; informational, never compared
     "config": {"model_type": "llama", "hidden_size": 576, ...},   # architecture fields, normalised
     "tokenizer_sha256": "...",               # the vocabulary (token -> id, added tokens included), not the files
     "special_tokens": {"bos": [1], "eos": [2], "unk": [0]},       # ids the config declares, else the tokenizer's
     "weights": {"format": "gguf", "sha256": "..."} | null}      # content hash of the weights file(s)

A safetensors directory's weights are its weight map plus the bytes of its head tensors (format "safetensors-head",
`head_identity`), never every weight: a checkpoint and its weightless copy are the same target.

`diffs` compares two fingerprints field by field (config fields by name). A GGUF file is the whole target (tensors,
config and tokenizer in one file), so two fingerprints with the same GGUF hash are the same target whatever a
transformers version converted the file to. Other weights are compared only when both sides hashed the same format.

The tokenizer is its vocabulary and the special ids the config declares, never the bos/eos *strings*: those are
what a converter makes of the files (transformers 5.17.0 converts the SmolLM2 GGUF, eos_token_id 2, to a tokenizer
whose eos is '<|im_start|>', id 1; 5.24.0 to one whose eos is '<|im_end|>'; the vocabularies are equal).

A fingerprint of another version (an older eyas's: no "fingerprint" key is version 1) is not compared: `diffs`
refuses it in one line that says to rerun the stage that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

VERSION = 3
# Architecture fields that decide what the target computes; absent or None ones are left out.
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                 "tie_word_embeddings", "attention_bias", "mlp_bias",
                 # mixture of experts and multi-head latent attention (DeepSeek/Kimi, Qwen-MoE, Mixtral)
                 "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# The weights are hashed only up to this many bytes in all (once per file: cached by path, size and mtime).
WEIGHTS_HASH_MAX_BYTES = 8 << 30
FIELDS = ("config", "tokenizer_sha256", "special_tokens")
"""The compared fields (identity and weights aside)."""


def _sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _number(v):
    """Floats to 6 significant digits: fp32-stored values (GGUF) equal their fp64 spelling."""
    return float(f"{v:.6g}") if isinstance(v, float) else v


def text_config(config):
    """The language model's part of a target config: a multimodal wrapper (Kimi-K2.5, Llava, Qwen-VL) keeps it
    under `text_config`; any other config is its own. The one unwrap, for what callers hold: a dict of config.json
    (-> its `text_config` dict, else itself), a transformers config (-> `get_text_config()`), or an attribute view
    of config.json (-> its `text_config`, else itself). The wrapper's own fields (architectures,
    quantization_config, a wrapper-level eos) are not in a wrapper's result: read those from `config`."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    return getattr(config, "text_config", None) or config


def rope_of(cfg) -> tuple[float | None, dict]:
    """(rope_theta, or None where the config has none; the RoPE parameters, their kind under "rope_type", "default"
    when none) the same whether the config spells rope_parameters (transformers 5) or rope_theta + rope_scaling
    (4.x). `cfg`: a config or an attribute view of one; a dict (config.json) is read as its keys. The one reading
    of a target's RoPE: the fingerprint's (_rope) and the drafter shape's (model/shape.py target_rope)."""
    if isinstance(cfg, dict):
        cfg = SimpleNamespace(**cfg)
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None)
    # a 4.x config spells the kind "type"; transformers 5 keeps that key beside the "rope_type" it adds
    if not params.get("rope_type"):
        params["rope_type"] = params.pop("type", None) or "default"
    return theta, params


def _rope(cfg) -> dict:
    """rope_theta and any scaling (rope_of), numbers normalised, the 4.x "type" key dropped."""
    theta, params = rope_of(cfg)
    kind = params.pop("rope_type")
    params.pop("type", None)
    out = {"rope_theta": _number(float(theta)) if theta is not None else None}
    if kind != "default":
        out["rope_scaling"] = {"rope_type": kind, **{k: _number(v) for k, v in sorted(params.items())}}
    return out


def config_fields(config) -> dict:
    """The normalised architecture fields of a HF config (its text config for multimodal wrappers), the same
    whether `config` is a transformers config object or an attribute view of the raw config.json (a model type
    transformers does not know: eyas.target.meta)."""
    cfg = text_config(config)
    out = {}
    for k in CONFIG_FIELDS:
        v = getattr(cfg, k, None)
        if v is not None:
            out[k] = _number(v)
    if out.get("num_local_experts") == out.get("n_routed_experts"):
        out.pop("num_local_experts", None)   # transformers' DeepSeek class aliases it; the raw JSON has one name
    if "head_dim" not in out and "qk_rope_head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]   # MLA: what transformers' DeepseekV3Config derives
    if "head_dim" not in out and "hidden_size" in out and getattr(cfg, "num_attention_heads", None):
        out["head_dim"] = out["hidden_size"] // cfg.num_attention_heads
    out.update(_rope(cfg))
    return out


def vocabulary(tokenizer) -> dict[str, int]:
    """token -> id, added tokens included whether or not this transformers version's get_vocab lists them."""
    vocab = dict(tokenizer.get_vocab())
    for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        vocab.setdefault(str(t), int(i))
    return vocab


def tokenizer_sha256(tokenizer) -> str | None:
    """The vocabulary (token -> id), not the files nor what a converter makes special."""
    if tokenizer is None:
        return None
    return _sha256_json({"vocab": sorted(vocabulary(tokenizer).items())})


def special_tokens(config, tokenizer) -> dict:
    """{"bos", "eos", "unk": sorted ids}: the ids the model config declares, else the tokenizer's. The config's
    agree across transformers versions; a tokenizer's bos/eos attributes are a converter's guess (see above)."""
    cfg = text_config(config)
    out = {}
    for k in ("bos", "eos", "unk"):
        v = getattr(cfg, f"{k}_token_id", None)
        if v is None and tokenizer is not None:
            v = getattr(tokenizer, f"{k}_token_id", None)
        if v is not None:
            out[k] = sorted({int(i) for i in (v if isinstance(v, (list, tuple)) else [v])})
    return out


def cache_root() -> Path:
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def _cached_sha256(entry: Path, key: dict, compute) -> str:
    """compute() (a sha256 hex digest), kept in the JSON file `entry` with `key` (path, size, mtime_ns, ...): an
    entry whose key differs is computed again."""
    try:
        cached = json.loads(entry.read_text())
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    digest = compute()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**key, "sha256": digest}))
        os.replace(tmp, entry)
    except OSError:
        pass   # a read-only cache only costs the hash next time
    return digest


def _bytes_sha256(path: Path, start: int = 0, end: int | None = None) -> str:
    """sha256 of bytes [start, end) of a file (end None: to its end), read in blocks (never whole in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = float("inf") if end is None else end - start
        while left > 0 and (block := f.read(int(min(left, 1 << 22)))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _file_key(path: Path) -> dict:
    """The cache key of a file's hashes: its path, size, mtime, inode and device. A file replaced by another of the
    same size with its mtime kept (`rsync -t`, `cp -p` to a temporary name and a rename) has another inode, so it is
    hashed again; both caches below use this one key."""
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "device": st.st_dev}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, cached under $EYAS_CACHE/hashes by its path, size, mtime and inode (_file_key): a
    file is hashed once per machine while it stays as it is (a rewrite or replacement changes the key)."""
    path = Path(path).resolve()
    key = _file_key(path)
    entry = cache_root() / "hashes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    return _cached_sha256(entry, key, lambda: _bytes_sha256(path))


def range_sha256(path: str | os.PathLike, start: int, end: int) -> str:
    """sha256 of bytes [start, end) of a file, read in blocks (never whole in memory); cached like file_sha256."""
    path = Path(path).resolve()
    key = {**_file_key(path), "range": [start, end]}
    entry = cache_root() / "hashes" / f"{_sha256_json([str(path), start, end])[:32]}.json"
    return _cached_sha256(entry, key, lambda: _bytes_sha256(path, start, end))


HEAD_FORMAT = "safetensors-head"
"""The weights identity of a safetensors directory: its weight map plus the bytes of the head tensors only, so
that a 600 GB checkpoint and its weightless copy (config, tokenizer, index, the head's shards) hash alike and
fast. A fingerprint whose weights were hashed in another format is not compared on weights (`diffs`)."""


def head_identity(weight_map: dict[str, str], heads: dict[str, dict]) -> dict:
    """{"format": HEAD_FORMAT, "sha256"} over the weight map (tensor -> shard file name) and, per head tensor,
    its dtype, shape and the sha256 of its bytes. heads: name -> {"path", "start", "end", "dtype", "shape"}."""
    hashed = {name: {"dtype": h["dtype"], "shape": list(h["shape"]),
                     "sha256": range_sha256(h["path"], h["start"], h["end"])} for name, h in sorted(heads.items())}
    return {"format": HEAD_FORMAT, "sha256": _sha256_json({"weight_map": sorted(weight_map.items()),
                                                           "head": hashed})}


def weights_identity(files: list[Path], fmt: str) -> dict | None:
    """{"format", "sha256"} over the files' contents (names and hashes), or None when they are missing or larger
    than WEIGHTS_HASH_MAX_BYTES together (hashing would not be cheap)."""
    files = sorted(files, key=lambda p: p.name)
    if not files or sum(p.stat().st_size for p in files) > WEIGHTS_HASH_MAX_BYTES:
        return None
    if len(files) == 1:
        return {"format": fmt, "sha256": file_sha256(files[0])}
    return {"format": fmt, "sha256": hashlib.sha256("".join(f"{p.name} {file_sha256(p)}\n" for p in files)
                                                    .encode()).hexdigest()}


def fingerprint(config, tokenizer, *, identity: str, weights: dict | None = None) -> dict:
    return {"fingerprint": VERSION, "identity": identity, "config": config_fields(config),
            "tokenizer_sha256": tokenizer_sha256(tokenizer), "special_tokens": special_tokens(config, tokenizer),
            "weights": weights}


def version(fp: dict) -> int:
    return int(fp.get("fingerprint", 1))


def _short(v):
    return f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else v


def _field_diffs(a, b, name: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in _field_diffs(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{name}.{k}")]
    return [] if a == b else [f"{name}: {_short(a)!r} != {_short(b)!r}"]


def _same_gguf(a: dict, b: dict) -> bool:
    wa, wb = a.get("weights") or {}, b.get("weights") or {}
    return wa.get("format") == wb.get("format") == "gguf" and bool(wa.get("sha256")) and wa == wb


def diffs(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    """What makes two target fingerprints differ, one line per field; [] for the same target. The name/path
    ("identity") never counts; the same GGUF file is the same target; other weights count only when both sides
    hashed the same format. A fingerprint of another version than VERSION is one line that refuses it."""
    old = [version(fp) for fp in (expected, actual) if version(fp) != VERSION]
    if old:
        return [f"{prefix}fingerprint version {old[0]} (recorded by an older eyas; this eyas compares version "
                f"{VERSION}): rerun the stage that wrote it"]
    if _same_gguf(expected, actual):
        return []
    out = [d for k in FIELDS for d in _field_diffs(expected.get(k), actual.get(k), prefix + k)]
    we, wa = expected.get("weights") or {}, actual.get("weights") or {}
    if we.get("format") == wa.get("format") and we.get("sha256") and wa.get("sha256") and we != wa:
        out.append(f"{prefix}weights.sha256 ({we['format']}): {_short(we['sha256'])!r} != {_short(wa['sha256'])!r}")
    return out
