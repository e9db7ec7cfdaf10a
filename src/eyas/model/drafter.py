"""The EAGLE-3 drafter: fc (3h_t -> h), one Llama decoder layer over concat(embedding, hidden), norm, lm_head.

State-dict keys are exactly the export keys of EAGLE3.md section 5. The target's token embedding is
NOT part of the drafter: the caller applies the frozen target embedding and passes `input_embeds`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import sdpa_kernel

from eyas.errors import EyasError
from eyas.knobs import from_known, to_json
from eyas.model.blocks import StepBlocks, block_attend
from eyas.model.shape import MLA_ROPE_THETA, DecoderShape, param_count, summary, target_shape  # noqa: F401
from eyas.sdpa import INFERENCE_SDPA
from eyas.target.compile import raise_recompile_limit


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # TTT calls it with K key lengths (and eval/train variants): room for every shape, never the eager fallback
    # that materialises the whole score matrix
    raise_recompile_limit()
    return torch.compile(flex_attention, dynamic=False)


def flex_attend(q: Tensor, k: Tensor, v: Tensor, block_mask) -> Tensor:
    """flex_attention with a BlockMask (GQA aware): compiled on CUDA, eager elsewhere (forward only on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if q.is_cuda else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


@dataclass(frozen=True, kw_only=True)
class DrafterConfig(DecoderShape):
    """The EAGLE-3 drafter: the target's shape (DecoderShape), its draft vocabulary and aux layers."""

    what: ClassVar[str] = "drafter config"

    draft_vocab_size: int
    """Draft vocabulary size (rows of lm_head, length of d2t; the target's vocab_size is the length of t2d)."""
    aux_layer_ids: tuple[int, int, int]
    """HF hidden_states indices of the low/mid/high aux features."""
    norm_before_fc: bool = False
    """EAGLE 3.1: one RMSNorm (`input_norm`, 3*h_t wide) over concat(low, mid, high) before fc (docs/training.md)."""

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        super().__post_init__()
        self.check_positive(("draft_vocab_size",))
        if self.draft_vocab_size > self.vocab_size:
            raise EyasError(f"drafter config: draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        if len(self.aux_layer_ids) != 3:
            raise EyasError(f"drafter config: aux_layer_ids needs 3 ids, got {self.aux_layer_ids}")

    @classmethod
    def from_target(cls, hf_config, *, draft_vocab_size: int, aux_layer_ids, intermediate_size: int | None = None,
                    norm_before_fc: bool = False) -> "DrafterConfig":
        """Derive every size, eps and the RoPE from the target's config (model/shape.py target_shape; docs/training.md,
        "The drafter's shape"). `hf_config`: a transformers config, a VLM wrapper of one, or an attribute view (or
        dict) of config.json whose language model may sit under `text_config`."""
        shape = target_shape(hf_config, intermediate_size=intermediate_size)
        return cls(**shape, draft_vocab_size=min(int(draft_vocab_size), shape["vocab_size"]),
                   aux_layer_ids=tuple(aux_layer_ids), norm_before_fc=bool(norm_before_fc))

    def param_count(self) -> int:
        """Trainable parameters of Eagle3Drafter(self) (model/shape.py param_count)."""
        return param_count(self)

    def summary(self) -> str:
        """One line: sizes, vocabulary, RoPE and parameter count (what `eyas train` announces)."""
        return summary(self)

    def to_dict(self) -> dict:
        return to_json(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        return from_known(cls, d, "drafter config")


def rope_inv_freq(cfg: DecoderShape) -> Tensor:
    """Inverse frequencies (head_dim/2,) for the configured RoPE type (HF Llama conventions)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = cfg.rope_scaling or {}
    rope_type = s.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(s["factor"])
    elif rope_type == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / lo, inv_freq / factor,
                               torch.where(wavelen < old_ctx / hi, inv_freq, smoothed))
    return inv_freq.float()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_at(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (B, S, hd) at positions (B, S) for a drafter's inverse frequencies (hd/2,)."""
    freqs = positions.float()[..., None] * inv_freq                       # (B, S, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                # (B, S, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def init_normal(model: nn.Module, std: float) -> None:
    """A drafter's initialisation: Normal(0, std) for every Linear, ones for every RMSNorm (uses the global torch
    RNG)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


# Decoding attends with at most this many query rows per kv head through plain matmuls: the fused SDPA kernels give
# each (head, query block) one thread block and crawl through a long static cache (the drafter's attention was the
# top kernel of a chain round: docs/decoding.md, BENCHMARKS.md#kernels-per-decode-step-and-round-kernelspy---compile-6c4c7d7-gemv-on).
GROUPED_ROWS = 256


def grouped_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention without repeating k/v for GQA: each kv head answers its rep query heads as rep*S rows.

    q (B, nh, S, hd); k, v (B, nkv, L, hd); mask bool (B, S, L), True = may attend; every row must allow at least
    one key (each decoding caller's rows see themselves; a row that sees nothing gives NaN, where SDPA's
    memory-efficient kernel gave 0). Scores and softmax in fp32. -> (B, S, nh*hd)."""
    B, nh, S, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    rep = nh // nkv
    qg = q.reshape(B, nkv, rep * S, hd)                                   # row r*S+s: head kv*rep+r, query s
    att = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * hd ** -0.5  # (B, nkv, rep*S, L)
    att = att.view(B, nkv, rep, S, L).masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.softmax(att, dim=-1).to(v.dtype).view(B, nkv, rep * S, L)
    y = torch.matmul(p, v)                                                # (B, nkv, rep*S, hd)
    return y.view(B, nh, S, hd).transpose(1, 2).reshape(B, S, nh * hd)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(self, x, cos, sin, attn_mask, kv_cache):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nh, self.hd).transpose(1, 2)   # (B, nh, S, hd)
        k = self.k_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, S, hd)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                     # (B, 1, S, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv_cache is not None:
            k = torch.cat([kv_cache[0], k], dim=2)                        # (B, nkv, L, hd)
            v = torch.cat([kv_cache[1], v], dim=2)                        # (B, nkv, L, hd)
        if isinstance(attn_mask, StepBlocks):  # the TTT mask by blocks (training on the CPU, eyas.train.ttt)
            return self.o_proj(block_attend(q, k, v, attn_mask)), (k, v)
        if not isinstance(attn_mask, Tensor):  # a flex-attention BlockMask (training on the GPU, eyas.train.ttt)
            y = flex_attend(q, k.to(q.dtype), v.to(q.dtype), attn_mask)  # (B, nh, S, hd)
            return self.o_proj(y.transpose(1, 2).reshape(B, S, self.nh * self.hd)), (k, v)
        rep = self.nh // self.nkv
        # decoding: few queries, a long cache (not under autocast, e.g. the trainer's bf16 evaluation: it would run
        # the fp32 score matmul in bf16)
        if not torch.is_grad_enabled() and rep * S <= GROUPED_ROWS and not torch.is_autocast_enabled(q.device.type):
            return self.o_proj(grouped_attend(q, k, v, attn_mask)), (k, v)
        kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k            # (B, nh, L, hd)
        vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v            # (B, nh, L, hd)
        if torch.is_grad_enabled():  # training: the default backend choice
            y = F.scaled_dot_product_attention(q, kr, vr, attn_mask=attn_mask.unsqueeze(1))  # (B, nh, S, hd)
        else:
            with sdpa_kernel(INFERENCE_SDPA):
                y = F.scaled_dot_product_attention(q, kr, vr, attn_mask=attn_mask.unsqueeze(1))  # (B, nh, S, hd)
        y = y.transpose(1, 2).reshape(B, S, self.nh * self.hd)            # (B, S, nh*hd)
        return self.o_proj(y), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama layer whose attention reads concat(input_layernorm(embeds), hidden_norm(hidden)), 2h wide."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden, input_embeds, cos, sin, attn_mask, kv_cache):
        residual = hidden                                                  # un-normed g (or previous output)
        x = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2h)
        a, kv = self.self_attn(x, cos, sin, attn_mask, kv_cache)
        h = residual + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        if cfg.norm_before_fc:  # only then: a plain drafter's state dict keeps exactly the EAGLE-3 keys
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Identity-prefix draft vocab until set_vocab(): draft id i <-> target id i.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) for every Linear, ones for every RMSNorm (init_normal)."""
        init_normal(self, std)

    @torch.no_grad()
    def set_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install the draft vocabulary maps (see eyas.model.vocab)."""
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise ValueError(f"draft vocab maps have shapes {tuple(d2t.shape)}, {tuple(t2d.shape)}; expected "
                             f"({cfg.draft_vocab_size},), ({cfg.vocab_size},)")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    @property
    def token_ids(self) -> Tensor:
        """Target id of every draft id, (draft_vocab,) int64, ascending."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, aux: Tensor) -> Tensor:
        """(B, T, 3*h_t) concat(low, mid, high) -> g (B, T, h); with norm_before_fc, fc(input_norm(concat)) as the
        engines compute it (one norm over the whole concatenation, not one per aux slot)."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)                                       # (B, T, 3*h_t)
        return self.fc(aux)

    def rope(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_at(position_ids, self.inv_freq, dtype)

    def layer(self, hidden: Tensor, input_embeds: Tensor, position_ids: Tensor, attn_mask: Tensor,
              kv_cache: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One draft step. attn_mask bool (B, S, past_len + S), True = may attend; keys = cache then new.

        Returns (pre-norm output (B, S, h), (k_all, v_all)) with the S new (rotated) keys appended.
        """
        cos, sin = self.rope(position_ids, hidden.dtype)
        return self.midlayer(hidden, input_embeds.to(hidden.dtype), cos, sin, attn_mask, kv_cache)

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, S, h) -> (B, S, draft_vocab)."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]
