"""Server flags for capture through SGLang or vLLM, per target config and engine version.

Every SGLang flag emitted for a version is checked to be declared in that version's wheel
(server_args.py / arg_groups/**, tests/test_engine_sglang_versions.py), from 0.5.10 to 0.5.23:
  --disable-radix-cache, --chunked-prefill-size -1, CUDA graphs off (--disable-cuda-graph before
  0.5.14, --cuda-graph-backend-{decode,prefill} disabled from 0.5.14), --forward-hooks JSON (list of
  {name, target_modules, hook_factory, config}: the capture hook and a hook on the inner model), and from
  0.5.23 --enable-return-aux-hidden-states with --speculative-algorithm EAGLE3
  --return-aux-hidden-state-layer-ids IDS; attention DP as --attn-dp-size N
  from 0.5.22, --dp-size N --enable-dp-attention before; expert parallelism as --ep-size N (every release);
  --trust-remote-code for a target whose config or tokenizer is its own code. Never --enable-two-batch-overlap: under it DeepSeek/Kimi layers capture nothing.
vLLM flags come from its extract_hidden_states example and connector source (never --enable-dbo, which that
path asserts against); expert parallelism is --enable-expert-parallel, whose EP size is the TP size.
Parallel sizes a server would refuse at start (attention DP or EP not dividing TP) are refused here, in one line.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.target.layers import resolve_aux_layer_ids, sglang_layer_ids
from eyas.target.meta import needs_remote_code, read_config

# Read from the wheels (tests/support/engine_sglang_layouts.py records each release; the tests check it):
FIRST_HOOKS_VERSION = (0, 5, 6)       # --forward-hooks and model_executor/hook_manager.py
FIRST_RIDS_VERSION = (0, 5, 10)       # ForwardBatch.rids: the hook attributes rows to requests by it
FIRST_SUPPORTED = max(FIRST_HOOKS_VERSION, FIRST_RIDS_VERSION)
FIRST_GRAPH_BACKEND_VERSION = (0, 5, 14)  # --cuda-graph-backend-{decode,prefill}; before: --disable-cuda-graph
FIRST_AUX_FLAG_VERSION = (0, 5, 23)   # --enable-return-aux-hidden-states
FIRST_ATTN_DP_SIZE_VERSION = (0, 5, 22)   # --attn-dp-size N; it deprecates --dp-size N --enable-dp-attention
HOOK_FACTORY = "eyas.engines.sglang_hook:make_capture_hook"
AUX_ENABLE_FACTORY = "eyas.engines.sglang_hook:make_aux_enable_hook"
PROBE_SWITCH_FACTORY = "eyas.engines.sglang_hook:make_probe_switch_hook"
# Where SGLang keeps the target's LogitsProcessor, as a name in model.named_modules(), when it is not the
# root's `logits_processor`: multimodal wrappers hold the language model in an attribute. hook_manager
# matches target_modules against those names with fnmatch, so the name must be exact; a miss only logs
# "No modules matched". Checked against the wheels' model sources (tests/test_engine_lm_head.py).
LM_HEAD_MODULES = {
    "KimiK25ForConditionalGeneration": "language_model.logits_processor",   # wraps DeepseekV3ForCausalLM
}
# vLLM answers a completion only for a model name it serves (default: the --model path); launch-args
# serves the target under this name and the capture client asks for it (client.request_body).
VLLM_SERVED_NAME = "eyas-target"



def parse_version(v: str) -> tuple[int, int, int]:
    """'0.5.15.post1' -> (0, 5, 15)."""
    try:
        parts = [int(p) for p in v.split(".")[:3]]
    except ValueError:
        raise EyasError(f"engine version {v!r}: expected X.Y.Z") from None
    if len(parts) != 3:
        raise EyasError(f"engine version {v!r}: expected X.Y.Z")
    return tuple(parts)  # type: ignore[return-value]


def read_target_config(path) -> dict:
    """A HF config.json; multimodal wrappers (Kimi-K2.5) keep the LM, and so its depth and width, under
    text_config. remote_code: why the engine needs --trust-remote-code (target/meta.py needs_remote_code)."""
    p = Path(path)
    cfg, text = read_config(p)
    if "num_hidden_layers" not in text:
        raise EyasError(f"{p}: no num_hidden_layers (not a HF causal-LM config.json?)")
    arch = (cfg.get("architectures") or text.get("architectures") or ["?"])[0]
    return {"num_layers": int(text["num_hidden_layers"]), "hidden_size": int(text["hidden_size"]),
            "architecture": arch, "model_type": text.get("model_type", cfg.get("model_type")),
            "wrapper": "text_config" in cfg, "remote_code": needs_remote_code(p.parent, cfg, engine=True)}


def lm_head_module(info: dict, override: str | None = None) -> str:
    """The SGLang module name of the target's LogitsProcessor (the capture hook's target_modules entry)."""
    if override:
        return override
    arch = info["architecture"]
    if arch in LM_HEAD_MODULES:
        return LM_HEAD_MODULES[arch]
    if info.get("wrapper") or not arch.endswith("ForCausalLM"):
        raise EyasError(f"architecture {arch}: eyas does not know where SGLang keeps its LogitsProcessor; pass "
                        f"--lm-head-module NAME (its name in model.named_modules(), e.g. "
                        f"language_model.logits_processor)")
    return "logits_processor"


def inner_model_module(lm_head: str) -> str:
    """The module holding layers_to_capture: the `model` beside the LogitsProcessor (Llama, Qwen, DeepSeek
    keep their decoder stack in `self.model`; Kimi-K2.5: language_model.model)."""
    prefix = lm_head[: -len("logits_processor")] if lm_head.endswith("logits_processor") else ""
    return prefix + "model"


def hook_spec(store: str, data: str, hf_ids, *, num_layers: int, aux_flag: bool,
              lm_head: str = "logits_processor") -> list[dict]:
    """The --forward-hooks JSON (format of sglang/srt/model_executor/hook_manager.py)."""
    cfg = {"store": store, "data": data, "aux_layer_ids": list(hf_ids), "num_layers": num_layers}
    spec = [{"name": "eyas_capture", "target_modules": [lm_head],
             "hook_factory": HOOK_FACTORY, "config": cfg}]
    # A hook on the inner model (the LM head's sibling `model`, which owns layers_to_capture; not the root, name
    # "": SGLang calls the root's .forward() directly, so its hooks never run). Without
    # --enable-return-aux-hidden-states it switches aux capture on after its first forward (the server's
    # warm-up); with it the server captures by itself and the hook only installs the served check's probe switch.
    inner = [inner_model_module(lm_head)]
    if not aux_flag:
        spec.append({"name": "eyas_enable_aux", "target_modules": inner,
                     "hook_factory": AUX_ENABLE_FACTORY, "config": {"layers_to_capture": list(hf_ids)}})
    else:
        spec.append({"name": "eyas_probe_switch", "target_modules": inner,
                     "hook_factory": PROBE_SWITCH_FACTORY, "config": {}})
    return spec


def _dotted(v) -> str:
    return ".".join(map(str, v))


def check_sglang_version(version: str) -> None:
    """Refuse SGLang releases the capture hook cannot work in, saying what they lack."""
    v = parse_version(version)
    if v < FIRST_HOOKS_VERSION:
        raise EyasError(f"SGLang {version} has no --forward-hooks (added in {_dotted(FIRST_HOOKS_VERSION)}) and "
                        f"no ForwardBatch.rids; eyas capture needs SGLang >= {_dotted(FIRST_SUPPORTED)}")
    if v < FIRST_RIDS_VERSION:
        raise EyasError(f"SGLang {version} has --forward-hooks but its ForwardBatch carries no rids (added in "
                        f"{_dotted(FIRST_RIDS_VERSION)}), so the hook cannot tell requests apart; "
                        f"eyas capture needs SGLang >= {_dotted(FIRST_SUPPORTED)}")


def check_parallel(engine: str, tp: int, attn_dp: int = 1, ep: int = 1) -> None:
    """Refuse sizes the engine asserts against at start: SGLang needs tp % attn_dp == 0 and tp % ep == 0 (its
    MoE runs tp / ep ways inside each expert group); vLLM's --enable-expert-parallel makes EP the TP size."""
    if min(tp, attn_dp, ep) < 1:
        raise EyasError(f"{engine} launch-args: --tp {tp}, --attn-dp {attn_dp}, --ep {ep}: each must be >= 1")
    if tp % attn_dp:
        raise EyasError(f"{engine} launch-args: --attn-dp {attn_dp} does not divide --tp {tp} (each attention-DP "
                        f"group is tp / attn_dp GPUs)")
    if engine == "sglang" and tp % ep:
        raise EyasError(f"sglang launch-args: --ep {ep} does not divide --tp {tp} (SGLang splits each expert group "
                        f"tp / ep ways)")
    if engine == "vllm" and ep not in (1, tp):
        raise EyasError(f"vllm launch-args: --ep {ep} with --tp {tp}: vLLM's --enable-expert-parallel makes the EP "
                        f"size the TP size, so --ep must be 1 or {tp}")
    if engine == "vllm" and attn_dp != 1:
        raise EyasError("vllm launch-args: --attn-dp is SGLang's; vLLM capture runs one engine (tensor parallel)")


def sglang_args(target_config, version: str, *, model: str = "MODEL", store: str = "STORE",
                data: str = "PREPARED", aux_layer_ids=None, tp: int = 1, attn_dp: int = 1, ep: int = 1,
                lm_head: str | None = None) -> list[str]:
    info = read_target_config(target_config) if not isinstance(target_config, dict) else target_config
    v = parse_version(version)
    check_sglang_version(version)
    check_parallel("sglang", tp, attn_dp, ep)
    head = lm_head_module(info, lm_head)
    n = info["num_layers"]
    hf = list(resolve_aux_layer_ids(aux_layer_ids, n))
    sg = sglang_layer_ids(hf, info["architecture"], info.get("model_type"))
    aux_flag = v >= FIRST_AUX_FLAG_VERSION
    args = ["python", "-m", "sglang.launch_server", "--model-path", model, "--tp-size", str(tp)]
    if info.get("remote_code"):
        args += ["--trust-remote-code"]
    if attn_dp > 1:
        args += (["--attn-dp-size", str(attn_dp)] if v >= FIRST_ATTN_DP_SIZE_VERSION else
                 ["--dp-size", str(attn_dp), "--enable-dp-attention"])
    if ep > 1:
        args += ["--ep-size", str(ep)]
    args += ["--disable-radix-cache", "--chunked-prefill-size", "-1"]
    if v >= FIRST_GRAPH_BACKEND_VERSION:
        args += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    else:
        args += ["--disable-cuda-graph"]
    if aux_flag:
        args += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                 "--return-aux-hidden-state-layer-ids", *map(str, sg)]
    args += ["--forward-hooks", json.dumps(hook_spec(store, data, hf, num_layers=n, aux_flag=aux_flag,
                                                     lm_head=head), separators=(",", ":"))]
    return args


def longest_prompt(data) -> int | None:
    """The longest sample of a prepared-data directory, in tokens (None when `data` is not one)."""
    if not (Path(data) / "manifest.json").is_file():
        return None
    return max((len(s.input_ids) for s in PreparedData(data)), default=None)


def vllm_args(target_config, *, model: str = "MODEL", out_dir: str = "VLLM_OUT", aux_layer_ids=None,
              tp: int = 1, ep: int = 1, max_model_len: int | None = None) -> list[str]:
    """vLLM: extract_hidden_states speculative method + ExampleHiddenStatesConnector.

    Layer ids are HF indices (vLLM's convention). Id N (num_layers) is requested as the 4th state for
    the final hidden state; whether vLLM returns it pre- or post-norm is checked by `engine crosscheck`.
    max_model_len is required: with chunked prefill off vLLM batches up to max_model_len tokens, and the
    extractor allocates (max_model_len, 4, h) for them, so the target's own context (262k for Kimi-K2.5) would
    take about 15 GB per GPU and a 262k-token profiling forward.
    """
    info = read_target_config(target_config) if not isinstance(target_config, dict) else target_config
    check_parallel("vllm", tp, 1, ep)
    if not max_model_len or int(max_model_len) < 2:
        raise EyasError("vLLM capture needs --max-model-len (or --data PREPARED, whose longest sample plus the one "
                        "generated token sets it): vLLM would otherwise batch and allocate the target's whole context")
    n = info["num_layers"]
    hf = list(resolve_aux_layer_ids(aux_layer_ids, n))
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*hf, n]}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": out_dir}}
    return ["vllm", "serve", model, "--served-model-name", VLLM_SERVED_NAME,
            *(["--trust-remote-code"] if info.get("remote_code") else []),
            "--tensor-parallel-size", str(tp), *(["--enable-expert-parallel"] if ep > 1 else []),
            "--max-model-len", str(int(max_model_len)),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enforce-eager",
            "--speculative-config", json.dumps(spec, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]


def format_command(args: list[str]) -> str:
    """`args` as a shell command to paste: the program and its leading words on the first line, then one flag and
    its value(s) per line (a new line at each `--` token), joined by backslash continuations."""
    lines: list[list[str]] = [[]]
    for a in args:
        if a.startswith("--") and lines[-1]:
            lines.append([])
        lines[-1].append(shlex.quote(a))
    return " \\\n  ".join(" ".join(line) for line in lines)
