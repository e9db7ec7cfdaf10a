"""TTT attention on the CPU by blocks: step 0's keys through the fused kernel, each later step's key as a diagonal.

At TTT step k every query t attends to the step-0 keys its mask allows (j <= t, its own sample) and to the k keys
that steps 1..k put at position t (docs/ttt.md). The dense form runs SDPA over all (k+1)T keys under a mask that
keeps T + k of each row's. Here only step 0's T keys go through the CPU's fused attention kernel (under their
(T, T) mask), which also returns its log-sum-exp; the k diagonal scores are one dot product per query, and the two
parts merge by log-sum-exp: the same softmax over the same T + k keys, with k*T fewer keys per query through the
kernel. GPU training uses flex_attention's BlockMask for the same rule (eyas.train.ttt).

Backward: with a = exp(lse_0 - lse), the share of step 0's keys in each row, step 0's gradients are the fused
kernel's backward called with grad_out = a * dy and out = the merged output y (its rowsum(grad_out * out) is then
the merged softmax's term); the diagonal keys' gradients are written out beside it. The kernel pair
(aten::_scaled_dot_product_flash_attention_for_cpu and its _backward, what SDPA itself calls on the CPU) is looked
up at the call, so importing this module never depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class StepBlocks:
    """One batch's TTT mask as blocks: keys are [step 0 | step 1 | ... | step k], each T long; step 0's follow `ctx`,
    a later step's key at position j is seen only by query j."""

    ctx: Tensor
    """(B, T, T) bool, True = query t may attend to step-0 key j (dense_masks' first block; each row allows one)."""


def _diagonals(k: Tensor, v: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """The later steps' keys and values laid out per position: (B, g, T, hd, s) and (B, g, T, s, hd), fp32."""
    B, g, L, hd = k.shape
    s = L // T - 1
    kd = k[:, :, T:].float().view(B, g, s, T, hd).permute(0, 1, 3, 4, 2)    # (B, g, T, hd, s)
    vd = v[:, :, T:].float().view(B, g, s, T, hd).transpose(2, 3)            # (B, g, T, s, hd)
    return kd, vd


class _BlockAttention(torch.autograd.Function):
    """q (B, nh, T, hd); k, v (B, g, (s+1)T, hd) with s >= 1 later steps; mask (B, 1, T, T) additive
    -> (B, nh, T, hd). Query head g*r+i reads kv head g. The diagonal parts run per position as (r, hd) x (hd, s)
    products: nothing of size s*T*hd per query head is materialised."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        B, nh, T, hd = q.shape
        g = k.shape[1]
        r, scale = nh // g, hd ** -0.5
        k0, v0 = k[:, :, :T], v[:, :, :T]                                    # (B, g, T, hd) step-0 keys
        if r > 1:
            k0, v0 = k0.repeat_interleave(r, dim=1), v0.repeat_interleave(r, dim=1)  # (B, nh, T, hd)
        with torch.autocast(q.device.type, enabled=False):
            o0, lse0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k0, v0, 0.0, False, attn_mask=mask, scale=scale)           # (B, nh, T, hd), (B, nh, T) fp32
            kd, vd = _diagonals(k, v, T)
            qt = q.float().reshape(B, g, r, T, hd).transpose(2, 3)            # (B, g, T, r, hd)
            sd = torch.matmul(qt, kd) * scale                                 # (B, g, T, r, s) diagonal scores
            l0 = lse0.reshape(B, g, r, T, 1).transpose(2, 3)                  # (B, g, T, r, 1)
            lse = torch.logsumexp(torch.cat([l0, sd], dim=-1), dim=-1, keepdim=True)  # (B, g, T, r, 1) all T+s keys
            a, b = torch.exp(l0 - lse), torch.exp(sd - lse)                   # step 0's share; each diagonal's
            y = a * o0.reshape(B, g, r, T, hd).transpose(2, 3).float() + torch.matmul(b, vd)  # (B, g, T, r, hd)
            y = y.transpose(2, 3).to(q.dtype).reshape(B, nh, T, hd)           # (B, nh, T, hd)
        ctx.save_for_backward(q, k0, v0, k, v, mask, y, lse0, a, b)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        q, k0, v0, k, v, mask, y, lse0, a, b = ctx.saved_tensors
        B, nh, T, hd = q.shape
        g = k.shape[1]
        r, s, scale = nh // g, k.shape[2] // T - 1, hd ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            dyt = dy.float().reshape(B, g, r, T, hd).transpose(2, 3)          # (B, g, T, r, hd)
            ga = (a * dyt).transpose(2, 3).to(q.dtype).reshape(B, nh, T, hd)  # step 0's share of dy
            dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                ga, q, k0, v0, y, lse0, 0.0, False, attn_mask=mask, scale=scale)  # (B, nh, T, hd) each
            kd, vd = _diagonals(k, v, T)
            qt = q.float().reshape(B, g, r, T, hd).transpose(2, 3)            # (B, g, T, r, hd)
            rowdot = (dyt * y.float().reshape(B, g, r, T, hd).transpose(2, 3)).sum(-1, keepdim=True)  # (B,g,T,r,1)
            dsd = b * (torch.matmul(dyt, vd.transpose(-1, -2)) - rowdot)      # (B, g, T, r, s) diagonal dS
            dqd = torch.matmul(dsd, kd.transpose(-1, -2)) * scale             # (B, g, T, r, hd)
            dq = dq.float() + dqd.transpose(2, 3).reshape(B, nh, T, hd)       # (B, nh, T, hd)
            dkd = torch.matmul(dsd.transpose(-1, -2), qt) * scale             # (B, g, T, s, hd)
            dvd = torch.matmul(b.transpose(-1, -2), dyt)                      # (B, g, T, s, hd)
            dk = torch.cat([dk0.float().reshape(B, g, r, T, hd).sum(2),
                            dkd.permute(0, 1, 3, 2, 4).reshape(B, g, s * T, hd)], dim=2)  # (B, g, (s+1)T, hd)
            dv = torch.cat([dv0.float().reshape(B, g, r, T, hd).sum(2),
                            dvd.permute(0, 1, 3, 2, 4).reshape(B, g, s * T, hd)], dim=2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def block_attend(q: Tensor, k: Tensor, v: Tensor, blocks: StepBlocks) -> Tensor:
    """Attention under StepBlocks (CPU), GQA aware. q (B, nh, T, hd); k, v (B, nkv, (s+1)*T, hd). -> (B, T, nh*hd).

    The diagonal scores and the merge run in fp32; the result is rounded to q's dtype once."""
    B, nh, T, hd = q.shape
    if k.shape[2] == T:  # step 0: no diagonal keys, SDPA alone (the dense path's own call)
        r = nh // k.shape[1]
        k, v = (k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)) if r > 1 else (k, v)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=blocks.ctx[:, None])  # (B, nh, T, hd)
    else:
        mask = torch.zeros(blocks.ctx.shape, dtype=q.dtype, device=q.device).masked_fill_(~blocks.ctx, float("-inf"))
        y = _BlockAttention.apply(q, k.contiguous(), v.contiguous(), mask[:, None])  # (B, nh, T, hd)
    return y.transpose(1, 2).reshape(B, T, nh * hd)                           # (B, T, nh*hd)
