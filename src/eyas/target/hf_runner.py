"""The generic, slow runner: the part of `Runner`'s interface the decoders use, on the HF model itself.

`Runner` (target/runner.py) copies a Llama's weights into its own static-cache forward. Other families
(DeepSeek-V3 / Kimi with MLA and MoE, ...) run here through their own HF forward, eagerly, with:
  - a slot cache (`SlotCache`): each attention layer's `cache.update(k, v, layer_idx)` writes its new states
    at the runner's `cache_slots` and returns the first L slots. It keeps whatever the layer caches, at any
    widths (transformers 5.x DeepSeek-V3 caches MLA's compressed latent and rotated key, one head each);
  - the runner's bool mask (B,S,L) over slots as an explicit additive 4-D mask (B,1,S,L), which HF's mask
    builders pass through unchanged;
  - positions as `position_ids`, independent of slots (a tree node sits at prefix+depth in slot prefix+index).
So trees over arbitrary slots, slot copies (tree compaction) and row moves (batched compaction) work as in
`Runner`. Aux states are taken with the capture stage's hooks (target/hooks.py: same HF ids).

For correctness on small targets and for families the fast runner does not cover, not for speed: no
compile, no CUDA graphs (`graphed` is a plain call on every device).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from eyas.errors import EyasError
from eyas.target.hooks import LayerInputs, decoder_stack
from eyas.target.generate import generate
from eyas.target.slots import SlotRunner


@dataclass(frozen=True, kw_only=True)
class HFRunnerConfig:
    """Shapes of the target the decoders read, and of the cache (RunnerConfig adds the attention's)."""

    num_layers: int
    """Decoder layers N."""
    hidden_size: int
    """Residual width h."""
    vocab_size: int
    """Target vocabulary."""
    max_batch: int
    """Rows of the KV cache."""
    max_seq: int
    """Slots per row of the KV cache."""

    def __post_init__(self):
        if self.max_batch < 1 or self.max_seq < 2:
            raise ValueError(f"runner needs max_batch >= 1 and max_seq >= 2, got {self.max_batch}, {self.max_seq}")


class SlotLayer:
    """One attention layer's cache: k_cache/v_cache (max_batch, heads, max_seq, width), allocated at the first
    write from the states' own shapes (keys and values may differ in heads and width). Named like `Layer`'s
    buffers: target/generate.py and decode/batch.py move rows through `runner.layers[i].k_cache`."""

    def __init__(self):
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None


class SlotCache:
    """Duck-typed HF cache: `update` writes at `slots` (B,S) and returns slots 0..width-1 of rows 0..B-1.
    The runner sets `slots` and `width` before each forward."""

    is_compileable = False

    def __init__(self, num_layers: int, max_batch: int, max_seq: int):
        self.layers = [SlotLayer() for _ in range(num_layers)]
        self.max_batch, self.max_seq = max_batch, max_seq
        self.slots: Tensor | None = None
        self.width = 0
        self.writes = 0  # updates since the runner last reset it: one per attention layer and forward

    def __len__(self) -> int:
        return len(self.layers)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        self.writes += 1
        B, S = self.slots.shape
        if layer.k_cache is None:
            def buf(x):
                return x.new_zeros(self.max_batch, x.shape[1], self.max_seq, x.shape[-1])
            layer.k_cache, layer.v_cache = buf(key_states), buf(value_states)
        rows = torch.arange(B, device=key_states.device)[:, None].expand(B, S)  # (B,S)
        layer.k_cache[rows, :, self.slots] = key_states.transpose(1, 2).to(layer.k_cache.dtype)  # [b,:,slot[b,s]]
        layer.v_cache[rows, :, self.slots] = value_states.transpose(1, 2).to(layer.v_cache.dtype)
        return layer.k_cache[:B, :, :self.width], layer.v_cache[:B, :, :self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


class HFRunner(SlotRunner):
    """Runner interface (forward, step_fn, graphed, graph_count, copy_slots, move_rows, generate, embed, lm_head, cfg, layers) on an HF causal
    LM. Build with `HFRunner.from_hf(model, max_batch=, max_seq=)`; `Runner.from_hf` picks it for targets
    that are not Llama-family."""

    compiled = False

    def __init__(self, model: nn.Module, cfg: HFRunnerConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.base = decoder_stack(model)
        self.cache = SlotCache(cfg.num_layers, cfg.max_batch, cfg.max_seq)
        params = inspect.signature(self.base.forward).parameters
        # transformers 5.24 names it `cache` (past_key_values deprecated); 5.17 `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._graphs: dict = {}
        self._step_fns: dict = {}

    @classmethod
    @torch.no_grad()
    def from_hf(cls, model, *, max_batch: int = 1, max_seq: int = 2048, dtype=None, device=None) -> "HFRunner":
        """A runner over `model` (a copy when dtype or device differ from the model's: the caller's model is
        left as it was). Refuses models with sliding-window or linear-attention layers (the explicit mask
        would be wrong there) and models without `.model.layers`."""
        hf = model.config
        kinds = set(getattr(hf, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise EyasError(f"runner: {hf.model_type} has {sorted(kinds - {'full_attention'})} layers; the generic "
                            "runner decodes full-attention targets only")
        try:
            decoder_stack(model)
        except TypeError as e:
            raise EyasError(f"runner: {e}") from None
        p = next(model.parameters())
        dtype = dtype or p.dtype
        device = torch.device(device) if device is not None else p.device
        if dtype != p.dtype or device != p.device:
            model = copy.deepcopy(model).to(device=device, dtype=dtype)
        cfg = HFRunnerConfig(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                             vocab_size=model.get_input_embeddings().weight.shape[0], max_batch=max_batch,
                             max_seq=max_seq)
        return cls(model.eval(), cfg)

    @property
    def embed(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def layers(self) -> list[SlotLayer]:
        """The per-layer caches (what `Runner.layers` users read: k_cache / v_cache)."""
        return self.cache.layers

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor, *,
                capture: tuple[int, ...] = (), logits: bool = True, last_only: bool = False
                ) -> tuple[Tensor, dict[int, Tensor]]:
        """As `Runner.forward`: ids/positions/slots (B,S) long, attn_mask bool (B,S,L) over cache slots 0..L-1
        -> (logits (B,S,V) or the final-norm state (B,S,h); with last_only position S-1 only) and
        {aux id: hidden (B,S,h)} (HF hidden_states ids; id N is the final-norm state)."""
        B, S = input_ids.shape
        cfg, N = self.cfg, self.cfg.num_layers
        if B > cfg.max_batch or attn_mask.shape[-1] > cfg.max_seq:
            raise EyasError(f"runner: batch {B} x {attn_mask.shape[-1]} slots exceeds the cache "
                            f"({cfg.max_batch} x {cfg.max_seq})")
        self.cache.slots, self.cache.width, self.cache.writes = cache_slots, attn_mask.shape[-1], 0
        bias = torch.zeros(attn_mask.shape, dtype=self.dtype, device=input_ids.device)
        bias = bias.masked_fill_(~attn_mask, torch.finfo(self.dtype).min)[:, None]  # (B,1,S,L)
        kw = {"input_ids": input_ids, "position_ids": positions, "attention_mask": bias, "use_cache": True,
              self._cache_kw: self.cache}
        with LayerInputs(self.base.layers, capture) as cap:
            final = self.base(**kw).last_hidden_state  # (B,S,h), after the final norm
        if self.cache.writes != N:  # a model that kept its own cache would decode without the slots given
            raise EyasError(f"runner: {self.model.config.model_type} wrote the cache from {self.cache.writes} of its "
                            f"{N} layers; the generic runner needs every layer to call cache.update")
        captured = {i: (final if i == N else cap.states[i]) for i in capture}
        if last_only:
            final = final[:, -1:]
        return (self.model.get_output_embeddings()(final) if logits else final), captured

    def step_fn(self, capture: tuple[int, ...] = ()):
        """(ids, pos, slots, mask) -> (logits (B,S,V), aux (B,S,len(capture)*h)), as `Runner.step_fn`."""
        capture = tuple(capture)
        if capture not in self._step_fns:
            def step(ids, pos, slots, mask):
                lg, cap = self.forward(ids, pos, slots, mask, capture=capture)
                return lg, (torch.cat([cap[i] for i in capture], -1) if capture else lg[..., :0])
            self._step_fns[capture] = step
        return self._step_fns[capture]

    def _decode(self, ids, pos, slots, mask):
        return self.forward(ids, pos, slots, mask)[0]

    def graphed(self, batch: int, seq: int, fn=None, slots: int | None = None):
        """`fn` (default: the logits step) as a plain call, one entry per shape as `Runner.graphed` counts them."""
        key = (batch, seq, fn, slots or self.cfg.max_seq)
        if key not in self._graphs:
            f = fn or self._decode
            self._graphs[key] = lambda ids, pos, sl, mask: f(ids, pos, sl, mask)
        return self._graphs[key]

    def generate(self, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
        """Plain batched decoding (`eyas.target.generate.generate`)."""
        return generate(self, prompts, max_new_tokens, **kw)
