"""Target fingerprints: what a target *is*, portable across machines, paths and transformers versions.

    {"fingerprint": 2,
     "identity": "smollm2-135m",              # how it was named; informational, never compared
     "config": {"model_type": "llama", "hidden_size": 576, ...},   # architecture fields, normalised
     "tokenizer_sha256": "...",               # vocabulary (token -> id) and bos/eos/unk, not the files
     "weights": {"format": "gguf", "sha256": "..."} | null}      # content hash of the weights file(s)

`manifest.diff_dicts` compares two fingerprints field by field (config fields by name) and compares weights only
when both sides hashed the same format. Fingerprints written before version 2 ({"identity", "config_sha256",
"tokenizer_sha256"}) still compare against a loaded target through `TargetFingerprint.legacy`: the same hashes
computed the old way (equal when the transformers version is the same).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

VERSION = 2
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
_LEGACY_VOLATILE = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config",
                    "_attn_implementation_autoset", "architectures", "_commit_hash", "use_cache"}


class TargetFingerprint(dict):
    """A fingerprint dict (JSON as it is) that also carries the pre-version-2 hashes of the live target in
    `.legacy`, so that manifests written by older eyas versions can still be compared with it."""

    legacy: dict | None = None


def _sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _number(v):
    """Floats to 6 significant digits: fp32-stored values (GGUF) equal their fp64 spelling."""
    return float(f"{v:.6g}") if isinstance(v, float) else v


def _rope(cfg) -> dict:
    """rope_theta and any scaling, the same whether the config spells rope_parameters (transformers 5)
    or rope_theta + rope_scaling (4.x)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    out = {"rope_theta": _number(float(theta)) if theta is not None else None}
    if kind != "default":
        out["rope_scaling"] = {"rope_type": kind, **{k: _number(v) for k, v in sorted(params.items())}}
    return out


def config_fields(config) -> dict:
    """The normalised architecture fields of a HF config (its text config for multimodal wrappers)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {}
    for k in CONFIG_FIELDS:
        v = getattr(cfg, k, None)
        if v is not None:
            out[k] = _number(v)
    if "head_dim" not in out and "hidden_size" in out and getattr(cfg, "num_attention_heads", None):
        out["head_dim"] = out["hidden_size"] // cfg.num_attention_heads
    out.update(_rope(cfg))
    return out


def tokenizer_sha256(tokenizer) -> str | None:
    """The vocabulary (token -> id, added tokens included) and the bos/eos/unk tokens, not the files."""
    if tokenizer is None:
        return None
    special = {k: getattr(tokenizer, f"{k}_token", None) for k in ("bos", "eos", "unk")}
    return _sha256_json({"vocab": sorted(tokenizer.get_vocab().items()), "special": {k: str(v) if v else None
                                                                                      for k, v in special.items()}})


def cache_root() -> Path:
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, cached under $EYAS_CACHE/hashes by its path, size and mtime."""
    path = Path(path).resolve()
    st = path.stat()
    key = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    entry = cache_root() / "hashes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        cached = json.loads(entry.read_text())
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**key, "sha256": digest}))
        os.replace(tmp, entry)
    except OSError:
        pass   # a read-only cache only costs the hash next time
    return digest


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


def legacy_hashes(config, tokenizer) -> dict:
    """The version-1 {"config_sha256", "tokenizer_sha256"}: hashes of config.to_dict() and of the tokenizer's
    vocab, chat template and special tokens, which change with the transformers version."""
    conf = _sha256_json({k: v for k, v in config.to_dict().items() if k not in _LEGACY_VOLATILE})
    tok = None
    if tokenizer is not None:
        tok = _sha256_json({"vocab": sorted(tokenizer.get_vocab().items()), "chat_template": tokenizer.chat_template,
                            "special": sorted(map(str, tokenizer.all_special_tokens))})
    return {"config_sha256": conf, "tokenizer_sha256": tok}


def fingerprint(config, tokenizer, *, identity: str, weights: dict | None = None) -> TargetFingerprint:
    fp = TargetFingerprint(fingerprint=VERSION, identity=identity, config=config_fields(config),
                           tokenizer_sha256=tokenizer_sha256(tokenizer), weights=weights)
    fp.legacy = legacy_hashes(config, tokenizer)
    return fp
