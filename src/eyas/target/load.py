"""Load a target model: an HF directory, an offline hub id, a GGUF file, or an embedded default (the spec resolved
to files by target/resolve.py)."""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import eyas.target.device  # its functions looked up at call time: tests patch them
from eyas.errors import EyasError
from eyas.target.fingerprint import cache_root, file_sha256, fingerprint  # noqa: F401 (cache_root, file_sha256)
from eyas.target.layers import resolve_aux_layer_ids
from eyas.target.meta import needs_remote_code, read_json, weights_bytes, weights_of  # noqa: F401 (weights_of)
from eyas.target.resolve import EMBEDDED, embedded_path, gguf_to_cache  # noqa: F401 (other modules import them here)
from eyas.target.resolve import eos_ids, gguf_special_tokens, resolve

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
    runners: dict = field(default_factory=dict, repr=False, compare=False)
    """Static-cache runners built on this model, by their shape and options: a runner compiles and captures its
    graphs once, so every bench of this target reuses it; they go when the target does."""

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


def target_from_model(model, tokenizer=None, *, name: str = "custom", aux_layer_ids=None,
                      weights: dict | None = None) -> Target:
    """Wrap an already-built HF causal LM (tests build tiny random Llamas this way). `weights`: the content hash
    of its weight files for the fingerprint (target/fingerprint.py), if it was loaded from some."""
    model.eval()
    ids = resolve_aux_layer_ids(aux_layer_ids, model.config.num_hidden_layers)
    fp = fingerprint(model.config, tokenizer, identity=name, weights=weights)
    return Target(name=name, model=model, tokenizer=tokenizer, aux_layer_ids=ids, fingerprint=fp)


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
    need, free = weights_bytes(src, dtype), eyas.target.device.free_bytes(device)
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
