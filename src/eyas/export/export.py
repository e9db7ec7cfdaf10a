"""Export a trained drafter in the layout SGLang and vLLM load (EAGLE3.md section 5).

    OUT/config.json        LlamaForCausalLMEagle3 config, aux layer ids in both engine conventions
    OUT/model.safetensors  fc, midlayer.*, norm, lm_head (+ d2t int64, t2d bool); never embed_tokens
    OUT/README.md          the exact SGLang and vLLM command lines

Layer ids: vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as HF hidden_states
indices; SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 (Llama and most
targets), so it gets HF ids - 1. SGLang's deepseek_v2.py adds the 1 only when the first id is 1, so with
the target given, a DeepSeek-family drafter whose low id is not 2 gets its HF ids as they are
(target/layers.py holds every mapping).

EAGLE 3.1's norm_before_fc: the top-level `norm_before_fc: true` and the weight `input_norm.weight` (3*h_t), read
by SGLang (0.5.20 and later; 0.5.16 and earlier drop both silently) and vLLM (0.25 and later), which apply one RMSNorm to the
concatenated aux features before fc; written only for a drafter trained with it (NORM_BEFORE_FC_NOTE).

Full draft vocabulary (draft_vocab_size == vocab_size): d2t/t2d are identities and are NOT
written, because vLLM 0.33 has no `draft_id_to_target_id` parameter then and refuses the key
(checked by tests/test_engine_contract.py). SGLang is fine either way.

A DFlash drafter (kind "dflash", model/dflash.py) is written as `DFlashDraftModel` (dflash_export_config; docs/export.md):
its state dict already carries the engines' weight names, the mask slots use the target's own embedding row (so no
mask_embedding.pt, which SGLang 0.5.14 could not read), and causality is stated in every key an engine reads.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.export.engine_pins import ENGINE_VERSIONS
from eyas.manifest import atomic_write_bytes, check_target
from eyas.model.checkpoint import open_drafter
from eyas.target.layers import SGLANG_OFFSET, sglang_layer_ids
from eyas.target.load import EMBEDDED, resolve
from eyas.target.meta import open_target_meta

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
NORM_BEFORE_FC_NOTE = ("this drafter normalises its aux features before fc (norm_before_fc). SGLang 0.5.16 and earlier "
                       "ignore that key and the input_norm weight without a word and then draft poorly: serve it "
                       "with SGLang >= 0.5.20 or vLLM >= 0.25.")


def export_sglang_ids(hf_ids, arch: str | None = None, model_type: str | None = None) -> list[int]:
    """eagle_config's ids for the target's architecture (target/layers.py). Ids SGLang cannot capture (HF 0, or
    DeepSeek's HF first id 1) are written as HF - 1 with a warning: vLLM, which reads the HF ids, is unaffected."""
    try:
        return sglang_layer_ids(hf_ids, arch, model_type)
    except EyasError as e:
        log.warning("%s; eagle_config gets HF - 1 and SGLang will capture other layers (vLLM is unaffected)", e)
        return [int(i) - SGLANG_OFFSET for i in hf_ids]


def export_config(cfg, *, dtype: torch.dtype = torch.bfloat16, arch: str | None = None,
                  model_type: str | None = None) -> dict[str, Any]:
    """The config.json dict for a DrafterConfig (see module docstring); `arch`/`model_type` are the target's
    (DeepSeek-family SGLang ids differ, target/layers.py), unknown: the common HF - 1."""
    hf_ids = [int(i) for i in cfg.aux_layer_ids]
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": DTYPE_NAMES[dtype],
        "eagle_aux_hidden_state_layer_ids": hf_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": export_sglang_ids(hf_ids, arch, model_type),
                         "use_aux_hidden_state": True},
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.norm_before_fc:  # absent = off in both engines, so a plain export stays as it was
        out["norm_before_fc"] = True
    return out


def export_state(drafter, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors to write: float weights cast to `dtype`, d2t int64 / t2d bool (omitted for a full vocab)."""
    cfg = drafter.config
    out = {}
    for name, t in drafter.state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        if "embed_tokens" in name:
            raise EyasError(f"drafter has its own embedding {name!r}; eyas exports must not (EAGLE3.md section 5)")
        out[name] = t.detach().to("cpu", dtype).contiguous()
    if cfg.draft_vocab_size != cfg.vocab_size:
        out["d2t"] = drafter.d2t.detach().to("cpu", torch.int64).contiguous()
        out["t2d"] = drafter.t2d.detach().to("cpu", torch.bool).contiguous()
    return out


DFLASH_ARCHITECTURE = "DFlashDraftModel"


def check_dflash_servable(cfg, where: str) -> None:
    """Refuse a DFlash drafter the engines would serve wrongly without a word: a context layer SGLang never captures
    (the last, N-1: its capture loop stops before it), ids out of ascending order (both engines concatenate the
    captured layers in layer order, so fc's column blocks would be swapped) or repeated (captured once: K shrinks),
    and context features narrower than the drafter (SGLang sizes fc from hidden_size alone)."""
    ids, n = cfg.target_layer_ids, cfg.num_target_layers
    if n - 1 in ids:
        raise EyasError(f"{where}: target_layer_ids {ids} include {n - 1}, the target's last layer (of {n}), which "
                        f"SGLang cannot capture; train with context layers <= {n - 2} (HF aux ids <= {n - 1})")
    if ids != sorted(set(ids)):
        raise EyasError(f"{where}: target_layer_ids {ids} are not strictly ascending; the engines concatenate the "
                        f"captured layers in ascending order, so this drafter's fc would read them swapped")
    if cfg.target_hidden_size != cfg.hidden_size:
        raise EyasError(f"{where}: context width {cfg.target_hidden_size} != drafter width {cfg.hidden_size}; "
                        f"SGLang sizes DFlash's fc as K * hidden_size")


def dflash_export_config(cfg, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json dict for a DFlashConfig: Qwen3 dims (both engines load it with HF AutoConfig, whose Qwen3
    defaults would fill any dim left out), the target's vocab and RoPE, and the DFlash keys each engine reads."""
    layer_types = ["full_attention"] * cfg.num_hidden_layers
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,   # SGLang refuses one below the target's context
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": layer_types,          # all full attention: bidirectional inside the block in every engine
        "is_causal": False,                  # SGLang 0.5.23 and vLLM 0.33 read this one ...
        "block_size": cfg.block_size,        # SGLang's default B (top level: what 0.5.14-era heads carry)
        "num_target_layers": cfg.num_target_layers,   # SGLang 0.5.14 checks the ids against it (else its own depth)
        "torch_dtype": DTYPE_NAMES[dtype],
        "dflash_config": {
            "target_layer_ids": cfg.target_layer_ids,   # "after layer k" = HF hidden_states index - 1
            "mask_token_id": cfg.mask_token_id,
            "causal": False,                 # ... and vLLM 0.25 only this one
            "block_size": cfg.block_size,
        },
    }


def dflash_readme_text(cfg, *, target: str, out_dir: str, engines: dict[str, str], note: str | None = None) -> str:
    b = cfg.block_size
    vllm_spec = json.dumps({"method": "dflash", "model": out_dir, "num_speculative_tokens": b - 1,
                            "attention_backend": "FLASH_ATTN"})
    pins = ", ".join(f"{k} {v}" for k, v in engines.items())
    warning = f"\n**Warning:** {note}\n" if note else ""
    return f"""# DFlash drafter for `{target}`

Exported by eyas. {cfg.num_hidden_layers} Qwen3-style layers, hidden {cfg.hidden_size}, block {b} (one forward
proposes {b - 1} tokens), context after target layers {cfg.target_layer_ids} of {cfg.num_target_layers} (HF
hidden_states indices {list(cfg.aux_layer_ids)}), bidirectional inside the block. Mask token {cfg.mask_token_id}: its
embedding is the target's own row (no mask_embedding.pt), so every engine version serves it the same way.
No embed_tokens or lm_head: both engines use the target's.
Checked against the DFlash loaders of {pins} (eyas tests/test_dflash_contract.py).
Paths below are absolute, resolved when eyas exported this directory; a hub id stays as it is.
{warning}
## SGLang

The block size is `--speculative-num-draft-tokens` (= `--speculative-dflash-block-size`); SGLang forces one step
and top-k 1 for DFlash.

```
python -m sglang.launch_server --model-path {target} \\
    --speculative-algorithm DFLASH --speculative-draft-model-path {out_dir} \\
    --speculative-num-draft-tokens {b}
```

## vLLM

`num_speculative_tokens` is B - 1 (vLLM does not read block_size). The drafter attends bidirectionally inside the
block, which needs an attention backend with non-causal support (FLASH_ATTN; TRITON_ATTN, FLEX_ATTENTION and
FLASHINFER also work); `attention_backend` pins it for the draft only.

```
vllm serve {target} --speculative-config '{vllm_spec}'
```
"""


def readme_text(cfg, *, target: str, out_dir: str, engines: dict[str, str], sglang_ids: list[int],
                num_speculative_tokens: int = 3, note: str | None = None) -> str:
    hf_ids = list(cfg.aux_layer_ids)
    vllm_spec = json.dumps({"method": "eagle3", "model": out_dir, "num_speculative_tokens": num_speculative_tokens})
    pins = ", ".join(f"{k} {v}" for k, v in engines.items())
    warning = f"\n**Warning:** {note}\n" if note else ""
    return f"""# EAGLE-3 drafter for `{target}`

Exported by eyas. One Llama decoder layer; hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size} of
{cfg.vocab_size}, aux layers (HF hidden_states indices) {hf_ids}; SGLang's eagle_config holds
{sglang_ids} (it adds 1). No embed_tokens: both engines use the target's embedding.
Checked against the weight loaders of {pins} (eyas tests/test_engine_contract.py).
Paths below are absolute, resolved when eyas exported this directory; a hub id stays as it is.
{warning}
## SGLang

```
python -m sglang.launch_server --model-path {target} \\
    --speculative-algorithm EAGLE3 --speculative-draft-model-path {out_dir} \\
    --speculative-num-steps {num_speculative_tokens} --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens {num_speculative_tokens + 1}
```

## vLLM

```
vllm serve {target} --speculative-config '{vllm_spec}'
```
"""


def engine_model_path(ref: str, *, resolve_embedded: bool) -> str:
    """The target as an engine's --model-path takes it: an absolute directory for a local path (or, once
    eyas has its HF copy, an embedded name), otherwise the reference unchanged (a hub id)."""
    p = Path(ref).expanduser()
    if p.exists():
        return str(p.resolve())
    if resolve_embedded and ref in EMBEDDED:
        try:
            return str(Path(resolve(ref)[0]).resolve())
        except EyasError:
            return ref
    return ref


def export_drafter(drafter, out_dir: str | os.PathLike, *, meta: dict | None = None, dtype: str = "bf16",
                   target=None, target_ref: str | None = None, num_speculative_tokens: int = 3,
                   allow_target_mismatch: bool = False) -> Path:
    """Write config.json, model.safetensors and README.md to `out_dir`.

    `meta["target"]` is the training target's fingerprint; when `target` (an eyas Target) is given,
    its fingerprint must match, and `target_ref` defaults to its name for the command lines. With
    `allow_target_mismatch` a differing one is accepted: the export then records the given target's fingerprint
    (this converts a drafter whose fingerprint an older eyas recorded) and its README the warning.
    """
    from safetensors.torch import save

    if dtype not in DTYPES:
        raise EyasError(f"export dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    if getattr(drafter, "kind", None) == "dflash":
        return export_dflash(drafter, out_dir, meta=meta, dtype=DTYPES[dtype], target=target, target_ref=target_ref,
                             allow_target_mismatch=allow_target_mismatch)
    tdtype = DTYPES[dtype]
    cfg = drafter.config
    trained_on = (meta or {}).get("target")
    arch = model_type = mismatch = None   # unknown without the target: SGLang's common +1 convention
    if target is not None:
        if trained_on:
            mismatch = check_target(trained_on, target.fingerprint, what="target (drafter was trained on another)",
                                    where=str(out_dir), allow_mismatch=allow_target_mismatch)
            trained_on = target.fingerprint if mismatch else trained_on
        if target.vocab_size != cfg.vocab_size or target.hidden_size != cfg.target_hidden_size:
            raise EyasError(f"{out_dir}: target vocab/hidden {target.vocab_size}/{target.hidden_size} != drafter's "
                            f"{cfg.vocab_size}/{cfg.target_hidden_size}")
        arch = (getattr(target.config, "architectures", None) or [None])[0]
        model_type = getattr(target.config, "model_type", None)
        target_ref = target_ref or target.name
    target_ref = target_ref or (trained_on or {}).get("identity") or "TARGET"

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    atomic_write_bytes(out / "model.safetensors", save(export_state(drafter, dtype=tdtype),
                                                       metadata={"format": "pt"}))
    config = export_config(cfg, dtype=tdtype, arch=arch, model_type=model_type)
    if trained_on:
        config["eyas_target"] = trained_on   # informational; neither engine reads it
    atomic_write_bytes(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    # Absolute paths: the README's commands are run from wherever the engine is, not from this directory.
    engine_target = engine_model_path(target_ref, resolve_embedded=target is not None)
    atomic_write_bytes(out / "README.md", readme_text(cfg, target=engine_target, out_dir=str(out.resolve()),
                                                      sglang_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                                                      engines=ENGINE_VERSIONS,
                                                      num_speculative_tokens=num_speculative_tokens,
                                                      note=_notes(mismatch, cfg)).encode())
    return out


def export_dflash(drafter, out_dir: str | os.PathLike, *, meta: dict | None, dtype: torch.dtype, target=None,
                  target_ref: str | None = None, allow_target_mismatch: bool = False) -> Path:
    """export_drafter for a DFlash drafter: config.json (dflash_export_config), model.safetensors (the state dict as
    it is, in `dtype`), README.md. Everything is checked before the first file is written."""
    from safetensors.torch import save

    cfg = drafter.config
    check_dflash_servable(cfg, str(out_dir))
    if drafter.mask_embedding is not None:
        raise EyasError(f"{out_dir}: this DFlash drafter has its own mask embedding (a published head's "
                        f"mask_embedding.pt); eyas exports serve the target's row in every engine and do not write one")
    trained_on = (meta or {}).get("target")
    mismatch = None
    if target is not None:
        if trained_on:
            mismatch = check_target(trained_on, target.fingerprint, what="target (drafter was trained on another)",
                                    where=str(out_dir), allow_mismatch=allow_target_mismatch)
            trained_on = target.fingerprint if mismatch else trained_on
        if (target.vocab_size, target.hidden_size, target.num_layers) != (cfg.vocab_size, cfg.target_hidden_size,
                                                                          cfg.num_target_layers):
            raise EyasError(f"{out_dir}: target vocab/hidden/layers {target.vocab_size}/{target.hidden_size}/"
                            f"{target.num_layers} != drafter's {cfg.vocab_size}/{cfg.target_hidden_size}/"
                            f"{cfg.num_target_layers}")
        target_ref = target_ref or target.name
    target_ref = target_ref or (trained_on or {}).get("identity") or "TARGET"
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    config = dflash_export_config(cfg, dtype=dtype)
    if trained_on:
        config["eyas_target"] = trained_on   # informational; neither engine reads it

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    atomic_write_bytes(out / "model.safetensors", save(state, metadata={"format": "pt"}))
    atomic_write_bytes(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    engine_target = engine_model_path(target_ref, resolve_embedded=target is not None)
    atomic_write_bytes(out / "README.md", dflash_readme_text(cfg, target=engine_target, out_dir=str(out.resolve()),
                                                             engines=ENGINE_VERSIONS, note=mismatch).encode())
    return out


def _notes(mismatch: str | None, cfg) -> str | None:
    notes = [n for n in (mismatch, NORM_BEFORE_FC_NOTE if cfg.norm_before_fc else None) if n]
    return " ".join(notes) or None


def run_export(drafter_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "bf16",
               target_spec: str | None = None, allow_target_mismatch: bool = False,
               trust_remote_code: bool = False) -> Path:
    """`eyas export`: open any drafter (run dir, drafter dir, export or published EAGLE-3 head;
    eyas.model.checkpoint.open_drafter), optionally check the target (its config, tokenizer and fingerprint
    only: target/meta.py, no weights loaded), write the export."""
    # the target is checked once, by export_drafter (it records the override in the README)
    drafter, meta = open_drafter(drafter_path)
    target = None
    if target_spec is not None:
        target = open_target_meta(target_spec, aux_layer_ids=drafter.config.aux_layer_ids, tensors=(),
                                  trust_remote_code=trust_remote_code)
    return export_drafter(drafter, out_dir, meta=meta, dtype=dtype, target=target, target_ref=target_spec,
                          allow_target_mismatch=allow_target_mismatch)
