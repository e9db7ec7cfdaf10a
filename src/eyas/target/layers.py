"""The EAGLE-3 layer-id convention: the one home of aux layer ids and their engine mappings.

eyas ids are HF `output_hidden_states` indices (EAGLE3.md section 1): `hidden_states[i]` is the residual
stream *entering* decoder layer i, index 0 is the embedding output, and `hidden_states[N]` is the final
norm's output (the "final" state, stored separately). Aux ids are therefore 0 <= id < N: id N is post-norm
and no engine captures it as an aux state.

Engine conventions (EAGLE3.md sections 1 and 5):
  - vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as HF ids: no mapping.
  - SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures `[i + 1 for i in ids]`,
    so it is given HF - 1.
  - SGLang's deepseek_v2.py (DeepSeek-V2/V3/V3.2, Kimi-K2/K2.5) adds the +1 only when the first id is 1
    (SGLang PR #25454) and otherwise uses the ids as given.
"""

from __future__ import annotations

from eyas.errors import EyasError

SGLANG_OFFSET = 1   # SGLang's layers_to_capture = [i + SGLANG_OFFSET for i in ids]
DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                  "KimiK25ForConditionalGeneration")
DEEPSEEK_MODEL_TYPES = ("deepseek", "kimi")   # model_type prefixes: deepseek_v2, deepseek_v3, kimi_k2, ...


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 default: HF hidden_states indices (2, N//2, N-3), the residual entering those layers.

    Targets too shallow for that (N < 7) get (1, N//2, N-1) or (0, N//2, N-1): three increasing ids < N."""
    n = int(num_layers)
    for ids in ((2, n // 2, n - 3), (1, n // 2, n - 1), (0, n // 2, n - 1)):
        if ids[0] < ids[1] < ids[2]:
            return ids
    raise EyasError(f"a target with {n} layers is too shallow for three aux layers (it needs at least 3)")


def check_aux_layer_ids(ids, num_layers: int) -> tuple[int, int, int]:
    """Three strictly increasing HF ids in 0..N-1 (id N is the final norm's output, not an aux state)."""
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3:
        raise EyasError(f"aux layer ids {list(ids)}: expected exactly three (low, mid, high)")
    if any(i < 0 or i >= num_layers for i in ids):
        raise EyasError(f"aux layer ids {list(ids)}: out of range for a target with {num_layers} layers "
                        f"(HF hidden_states indices 0..{num_layers - 1}; {num_layers} is the final norm's output)")
    if not ids[0] < ids[1] < ids[2]:
        raise EyasError(f"aux layer ids {list(ids)}: must be strictly increasing")
    return ids


def resolve_aux_layer_ids(ids, num_layers: int) -> tuple[int, int, int]:
    """The ids a user gave, checked against the target's depth, or the default when none were given (None)."""
    return check_aux_layer_ids(ids, num_layers) if ids is not None else default_aux_layer_ids(num_layers)


def is_deepseek(arch: str | None, model_type: str | None = None) -> bool:
    """Whether SGLang serves this target with deepseek_v2.py (the first-id quirk)."""
    return (arch or "") in DEEPSEEK_ARCHS or (model_type or "").startswith(DEEPSEEK_MODEL_TYPES)


def sglang_layer_ids(hf_ids, arch: str | None = None, model_type: str | None = None) -> list[int]:
    """HF hidden_states ids -> the ids to give SGLang (eagle_config, --return-aux-hidden-state-layer-ids)
    so that it captures exactly those. Unknown architecture: the common +1 convention.

    Raises when SGLang cannot capture them: HF id 0 (the embedding), or DeepSeek with HF first id 1.
    """
    hf = [int(i) for i in hf_ids]
    if min(hf) < SGLANG_OFFSET:
        raise EyasError(f"aux layer ids {hf}: SGLang cannot capture hidden_states[0] (the embedding)")
    if not is_deepseek(arch, model_type) or hf[0] == 1 + SGLANG_OFFSET:
        return [i - SGLANG_OFFSET for i in hf]   # DeepSeek: first id becomes 1 -> SGLang adds +1 to all
    if hf[0] == 1:
        raise EyasError(f"aux layer ids {hf}: with DeepSeek SGLang ids starting at 1 get +1, so HF id 1 "
                        f"cannot be expressed; choose a first id other than 1")
    return hf                                    # DeepSeek, first id != 1: SGLang uses them as given


def sglang_capture_ids(sglang_ids, arch: str | None = None, model_type: str | None = None) -> list[int]:
    """The reverse: what SGLang's set_eagle3_layers_to_capture makes of `sglang_ids` (its layers_to_capture,
    i.e. HF hidden_states ids)."""
    ids = [int(i) for i in sglang_ids]
    if is_deepseek(arch, model_type) and (not ids or ids[0] != 1):
        return ids
    return [i + SGLANG_OFFSET for i in ids]


def sglang_capture_readings(sglang_ids) -> list[list[int]]:
    """The HF ids an SGLang eagle_config may mean when the target's architecture is unknown: the common +1
    reading, and DeepSeek's (+1 only when the first id is 1) where it differs."""
    common = sglang_capture_ids(sglang_ids)
    deepseek = sglang_capture_ids(sglang_ids, DEEPSEEK_ARCHS[1])
    return [common] if deepseek == common else [common, deepseek]
