"""The DFlash block drafter: L Qwen3-style layers whose queries come from one block of tokens and whose keys and
values also come from the target's context features (docs/dflash.md).

    c_t    = hidden_norm(fc(concat(aux_t)))                       one context vector per committed token t
    block  = [bonus, MASK x (B-1)] at positions p .. p+B-1         embedded by the target's frozen embedding
    layer  : queries q_norm(q_proj(input_layernorm(h))) of the block only; keys/values = the layer's own
             k_proj/v_proj (k_norm on K) of [c_0..c_{p-1}] (no input norm on that path) then of the block;
             RoPE at each token's position; bidirectional inside the block; SwiGLU MLP; residuals
    drafts = argmax of the target's lm_head(norm(h)) at slots 1..B-1

State-dict keys are the engines' DFlash weight names (DFLASH.md section 4). The target's embedding and LM head
are not part of the drafter: the caller passes the block's embeddings and applies the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.errors import EyasError
from eyas.knobs import from_known, to_json
from eyas.model.drafter import (GROUPED_ROWS, MLP, RMSNorm, flex_attend, grouped_attend, init_normal, rope_at,
                                rope_inv_freq, rotate_half)
from eyas.model.shape import DecoderShape, count_text, mla_or_moe, target_shape, text_view

MAX_BLOCK = 32
"""Largest block: the engines' CUDA-graph and verify buffers are sized for blocks of up to 16-32 tokens."""


def default_layers(num_target_layers: int) -> int:
    """Drafter depth for a target of N layers: N/8 rounded, 1 to 5. The published heads use 5 layers for 36-61-layer
    targets (Qwen3-8B, Kimi-K2.5); a shallow target gets fewer, so the drafter stays a small share of a round."""
    return max(1, min(5, round(num_target_layers / 8)))


def default_block(hf_config) -> int:
    """16 (the published dense-target heads), 8 for DeepSeek-V3 / Kimi-class MoE targets: each verified token
    there activates its own experts, and the published Kimi-K2.5 head is served with blocks of 8."""
    return 8 if mla_or_moe(text_view(hf_config)) else 16


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The mask slots' token: the tokenizer's mask token, else `<|MASK|>` (the engines' lookup), else the vocabulary's
    last id. Any id inside the vocabulary serves: its embedding is the target's own row, frozen, in training and in
    every engine (docs/dflash.md, "The mask token")."""
    for tok in (getattr(tokenizer, "mask_token_id", None),
                (getattr(tokenizer, "get_vocab", None) or dict)().get("<|MASK|>")):
        if isinstance(tok, int) and 0 <= tok < vocab_size:
            return tok
    return vocab_size - 1


@dataclass(frozen=True, kw_only=True)
class DFlashConfig(DecoderShape):
    """The DFlash drafter: the target's shape (DecoderShape; the context vectors and the block's embeddings are
    hidden_size wide, q_norm and k_norm head_dim wide, drafts are read from the target's own LM head), its depth,
    context layers, block and mask token."""

    what: ClassVar[str] = "dflash config"

    num_hidden_layers: int
    """Decoder layers L."""
    aux_layer_ids: tuple[int, ...]
    """HF hidden_states indices of the context features (the store's aux ids); the engines' target_layer_ids are
    these minus one ("after layer k")."""
    num_target_layers: int
    """The target's decoder layers (exported as num_target_layers)."""
    block_size: int = 16
    """B: tokens per block, the bonus token and B-1 mask tokens; a round proposes B-1 drafts."""
    mask_token_id: int
    """Token id of the mask slots; its embedding is the target's own row, frozen (never a learned sidecar)."""

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        super().__post_init__()
        self.check_positive(("num_hidden_layers", "num_target_layers"))
        if not 2 <= self.block_size <= MAX_BLOCK:
            raise EyasError(f"dflash config: block_size must be 2 to {MAX_BLOCK}, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise EyasError(f"dflash config: mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                            f"(0..{self.vocab_size - 1}); the engines read its embedding from the target")
        if not self.aux_layer_ids or min(self.aux_layer_ids) < 1 or max(self.aux_layer_ids) > self.num_target_layers:
            raise EyasError(f"dflash config: aux_layer_ids {list(self.aux_layer_ids)} must be HF hidden-state indices "
                            f"1..{self.num_target_layers} (the engines capture after layer id - 1)")

    @property
    def target_layer_ids(self) -> list[int]:
        """The engines' dflash_config.target_layer_ids: 0-based "after layer k" = HF index - 1."""
        return [a - 1 for a in self.aux_layer_ids]

    @classmethod
    def from_target(cls, hf_config, *, aux_layer_ids, mask_token_id: int, num_layers: int | None = None,
                    block_size: int | None = None, intermediate_size: int | None = None) -> "DFlashConfig":
        """Every size, eps and the RoPE from the target's config (model/shape.py target_shape, the heads EAGLE-3
        gets); depth from default_layers, block from default_block, each unless given."""
        shape = target_shape(hf_config, intermediate_size=intermediate_size)
        n = int(text_view(hf_config).num_hidden_layers)
        return cls(**shape, aux_layer_ids=tuple(aux_layer_ids), num_target_layers=n,
                   num_hidden_layers=num_layers or default_layers(n),
                   block_size=block_size or default_block(hf_config), mask_token_id=int(mask_token_id))

    def param_count(self) -> int:
        """Trainable parameters: fc, hidden_norm, per layer q/k/v/o, q_norm, k_norm, the MLP and two norms, norm."""
        h, a, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = h * (a + 2 * kv) + a * h + 3 * h * self.intermediate_size + 2 * self.head_dim + 2 * h
        return len(self.aux_layer_ids) * self.target_hidden_size * h + h + self.num_hidden_layers * layer + h

    def summary(self) -> str:
        """One line: depth, block, sizes, context layers and parameter count (what `eyas train` announces)."""
        return (f"DFlash, {self.num_hidden_layers} layers, block {self.block_size} (mask token {self.mask_token_id}),"
                f" h {self.hidden_size}, {self.num_attention_heads} x {self.head_dim} heads "
                f"({self.num_key_value_heads} kv), mlp {self.intermediate_size}, context after target layers "
                f"{self.target_layer_ids}, vocab {self.vocab_size}, {count_text(self.param_count())} params")

    def to_dict(self) -> dict:
        return {"kind": "dflash", **to_json(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        return from_known(cls, {k: v for k, v in d.items() if k != "kind"}, "dflash config")


@dataclass
class Context:
    """The context vectors (B, T, h) and their RoPE (cos, sin (B, T, hd)): each layer makes its keys and values from
    them inside its own forward (training, where FSDP2 gathers a layer's weights only for that forward)."""

    c: Tensor
    cos: Tensor
    sin: Tensor


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, n, S, hd) rotated at cos/sin (B, S, hd) (HF's rotate_half convention, the engines' neox style)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (k_norm, then RoPE) and values of x (B, S, h) -> (B, nkv, S, hd) each."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd)).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)            # (B, nkv, S, hd)
        return rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: tuple[Tensor, Tensor], mask) -> Tensor:
        """x (B, S, h) the normed block; ctx (k, v) (B, nkv, L, hd) the context's; mask: None (every key), bool
        (B, S, L + S) True = may attend, or a flex BlockMask over the same keys."""
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.nh, self.hd)).transpose(1, 2)  # (B, nh, S, hd)
        q = rope(q, cos, sin)
        kb, vb = self.kv(x, cos, sin)                                               # (B, nkv, S, hd)
        k = torch.cat([ctx[0].to(kb.dtype), kb], dim=2)                             # (B, nkv, L+S, hd)
        v = torch.cat([ctx[1].to(vb.dtype), vb], dim=2)                             # (B, nkv, L+S, hd)
        if mask is not None and not isinstance(mask, Tensor):                        # a flex BlockMask (training)
            y = flex_attend(q, k, v, mask).transpose(1, 2).reshape(B, S, -1)         # (B, S, nh*hd)
            return self.o_proj(y)
        rep = self.nh // self.nkv
        if not torch.is_grad_enabled() and rep * S <= GROUPED_ROWS and not torch.is_autocast_enabled(q.device.type):
            full = mask if mask is not None else torch.ones(B, S, k.shape[2], dtype=torch.bool, device=q.device)
            return self.o_proj(grouped_attend(q, k, v, full))                        # decoding: fp32 scores
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                           enable_gqa=rep > 1)                      # (B, nh, S, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.nh * self.hd))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx: tuple[Tensor, Tensor] | Context, mask) -> Tensor:
        if isinstance(ctx, Context):
            ctx = self.self_attn.kv(ctx.c, ctx.cos, ctx.sin)                        # (B, nkv, T, hd) each
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    kind = "dflash"

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.mask_embedding: Tensor | None = None
        self.init_weights()

    def set_mask_embedding(self, row: Tensor | None) -> None:
        """A published head's own mask-token embedding (its `mask_embedding.pt`), or None: the target's row. eyas's
        drafters never have one: they train on the target's frozen row, which every engine version serves."""
        if row is not None and tuple(row.shape) != (self.config.hidden_size,):
            raise EyasError(f"mask embedding of shape {tuple(row.shape)}; expected ({self.config.hidden_size},)")
        self.mask_embedding = None if row is None else row.detach().clone()

    def embed_block(self, ids: Tensor, embed_weight: Tensor) -> Tensor:
        """The block tokens' embeddings (..., h): the target's rows, the mask slots' from set_mask_embedding if set."""
        e = F.embedding(ids, embed_weight)                                          # (..., h)
        if self.mask_embedding is not None:
            m = (ids == self.config.mask_token_id)[..., None]
            e = torch.where(m, self.mask_embedding.to(e), e)
        return e

    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) for every Linear, ones for every RMSNorm (init_normal)."""
        init_normal(self, std)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (B, S, hd) at positions (B, S)."""
        return rope_at(positions, self.inv_freq, dtype)

    def context(self, aux: Tensor) -> Tensor:
        """(B, T, K*h_t) concatenated target features -> the context vectors (B, T, h)."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_input(self, aux: Tensor, positions: Tensor) -> Context:
        """The context of features aux (B, T, K*h_t) at positions (B, T), for the layers to make keys and values of."""
        c = self.context(aux)                                                        # (B, T, h)
        return Context(c, *self.rope(positions, c.dtype))

    def context_kv(self, aux: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every layer's context keys and values (B, nkv, T, hd) for features aux (B, T, K*h_t) at positions (B, T).
        They depend on the features alone, not on other layers: a decoder appends them once per committed token."""
        ctx = self.context_input(aux, positions)
        return [layer.self_attn.kv(ctx.c, ctx.cos, ctx.sin) for layer in self.layers]

    def forward(self, block_embeds: Tensor, positions: Tensor, ctx: list[tuple[Tensor, Tensor]] | Context,
                mask=None) -> Tensor:
        """block_embeds (B, S, h) the target's embeddings of the block tokens at positions (B, S); ctx: every layer's
        (k, v) from context_kv, or a Context from context_input; mask as Attention.forward's. -> the normed hidden
        states (B, S, h), for the target's LM head."""
        h = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rope(positions, h.dtype)
        for layer, kv in zip(self.layers, ctx if isinstance(ctx, list) else [ctx] * len(self.layers)):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)
