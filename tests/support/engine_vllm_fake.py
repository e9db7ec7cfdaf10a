"""A stand-in vLLM server built from the flags `eyas engine launch-args vllm` prints and a tiny HF Llama.

It does what vLLM 0.25.0 / 0.33.0 do on the capture path (read from their source):
- serves the model under --served-model-name (default: the --model path) and answers any other
  "model" with an error (entrypoints/serve/engine/serving.py `_check_model`; an absent model is fine);
- names the request `cmpl-{request_id}-{prompt index}` and the engine appends `-{8 hex}`
  (completion/serving.py, v1/engine/input_processor.assign_request_id);
- stores, per layer id k of eagle_aux_hidden_state_layer_ids, `hidden_states + residual` after layer
  k-1: HF hidden_states[k] for k < N, and for k == N the stream BEFORE the final norm (llama.py
  `_maybe_add_hidden_state`, then `self.norm`), in `{shared_storage_path}/{req_id}.safetensors` with a
  `.lock` beside it (example_hidden_states_connector.py), and returns that path in kv_transfer_params.
"""

from __future__ import annotations

import json
import secrets
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from .models import make_tiny_llama


class VllmError(RuntimeError):
    pass


def save_tiny_target(path: Path, *, layers: int = 6):
    """A tiny Llama with a non-trivial final norm, saved as a HF checkpoint in `path`."""
    model = make_tiny_llama(layers=layers)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@torch.inference_mode()
def vllm_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """(T, len(layer_ids), h): what vLLM's extract_hidden_states stores for these ids."""
    pre = []
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: pre.append(a[0]))
    try:
        hs = model(input_ids=torch.tensor(ids)[None], output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    n = model.config.num_hidden_layers
    return torch.stack([pre[0][0] if k == n else hs[k][0] for k in layer_ids], dim=1)   # (T, K, h)


class FakeVllmServer:
    def __init__(self, launch_args: list[str], model):
        def value(flag, default=None):
            return launch_args[launch_args.index(flag) + 1] if flag in launch_args else default
        assert launch_args[:2] == ["vllm", "serve"]
        self.served = [value("--served-model-name", launch_args[2])]
        spec = json.loads(value("--speculative-config"))
        assert spec["method"] == "extract_hidden_states"
        self.layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        kv = json.loads(value("--kv-transfer-config"))
        assert kv["kv_connector"] == "ExampleHiddenStatesConnector"
        self.dir = Path(kv["kv_connector_extra_config"]["shared_storage_path"])
        self.model = model
        self.calls = 0
        self.lock = threading.Lock()              # one forward at a time, as the engine loop runs them

    def post(self, url: str, body: dict, timeout: float) -> dict:
        self.calls += 1
        assert url.endswith("/v1/completions")
        if body.get("model") and body["model"] not in self.served:
            raise VllmError(f"404: The model `{body['model']}` does not exist. Valid aliases: {self.served}")
        req_id = f"cmpl-{body.get('request_id') or secrets.token_hex(8)}-0-{secrets.token_hex(4)}"
        path = self.dir / f"{req_id}.safetensors"
        self.dir.mkdir(parents=True, exist_ok=True)
        Path(str(path) + ".lock").touch()
        with self.lock:
            hs = vllm_states(self.model, body["prompt"], self.layer_ids).to(torch.bfloat16)
        save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(body["prompt"], dtype=torch.int64)},
                  str(path))
        return {"id": req_id, "choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": str(path)}}
