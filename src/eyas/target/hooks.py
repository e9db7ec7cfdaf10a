"""Forward hooks that take exactly the EAGLE-3 states out of an HF decoder stack: the one hook implementation,
used by the capture stage (`capture_states`) and by online training (`train/data.target_features`).

HF convention (checked against output_hidden_states in tests/test_capture.py):
  hidden_states[i], i < N  = the residual stream ENTERING decoder layer i (= input of layers[i]);
  hidden_states[N]         = the final norm output = model.model(...).last_hidden_state.
So aux id i < N is a forward-pre-hook on layers[i]; aux id N (allowed, unusual) is the final state.
We call the decoder stack (model.model) rather than the causal LM: no lm_head, no T x V logits, and no
output_hidden_states (which keeps all N+1 states alive).
The static-cache runner (target/runner.py) records states inside its own forward, not with these hooks; it
uses the same ids: tests/test_hooks.py compares it with these hooks id for id (0..N) on a tiny random Llama.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_stack(model: nn.Module) -> nn.Module:
    """The base model under the LM head (LlamaForCausalLM.model)."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise TypeError(f"{type(model).__name__}: expected an HF causal LM with .model.layers")
    return base


class LayerInputs:
    """Context manager recording the input hidden state of selected decoder layers."""

    def __init__(self, layers: nn.ModuleList, ids):
        self.layers, self.ids = layers, [i for i in ids if i < len(layers)]
        self.states: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> "LayerInputs":
        for i in self.ids:
            self._handles.append(self.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self.states[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@torch.inference_mode()
def capture_states(model: nn.Module, aux_ids, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) token ids -> (B, T, 4, h): slots 0..2 = hidden_states[aux_ids], slot 3 = final norm output."""
    base = decoder_stack(model)
    n = len(base.layers)
    with LayerInputs(base.layers, aux_ids) as cap:
        final = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    states = [final if i == n else cap.states[i].to(final.device) for i in aux_ids]
    return torch.stack(states + [final], dim=2)  # (B, T, 4, h)
