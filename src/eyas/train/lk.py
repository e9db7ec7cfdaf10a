"""The drafter's LM head fused with the LK losses' per-row terms (arXiv 2602.23881), in row chunks as soft_ce.py.

Per counted row n, with q = softmax(z) the drafter's draft-vocab distribution (z = x @ W^T), p' the target's soft
labels (its draft-vocab logits renormalised, as the CE uses them) and m = exp(log_mass) the target's probability
mass on the draft vocabulary, so p = m p' is the target's own probability of each draft token:

    ce    = logsumexp(z) - <p', z>                       the soft cross-entropy (soft_ce.py)
    alpha = sum_v min(p_v, q_v)                           the chance a token drafted from q is accepted by
                                                          speculative sampling against the target (1 - TV)
    nla   = -log alpha                                    (alpha floored at ALPHA_FLOOR)

    dce/dz = q - p'    dalpha/dz = q * (1[q < p] - S),  S = sum_{v: q_v < p_v} q_v    dnla/dz = -(dalpha/dz) / alpha

alpha uses the target's unrenormalised p: a drafter that proposes only draft tokens is accepted with this
probability, and the renormalised p' would overstate it by up to 1/m. As in the fused CE, the (c, Vd) products
exist one chunk at a time and the gradients wrt x and W of each requested term are summed in the forward pass;
the backward scales them by the terms' incoming gradients, so a caller may combine the three sums in any way
(the LK^lambda weight depends on the step's mean alpha, known only after the last chunk). The naive reference is
written out in tests/test_lk.py.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from eyas.train.soft_ce import _compute_dtype

ALPHA_FLOOR = 1e-20
"""Smallest alpha taken into -log alpha (so nla is at most about 46, and its gradient stays finite where drafter and
target share no mass in fp32)."""

TERMS = ("ce", "alpha", "nla")


def _chunk(z: Tensor, zt: Tensor, lmass: Tensor, wr: Tensor | None, g_ce: bool, g_alpha: bool, g_nla: bool):
    """(ce sum, alpha sum, nla sum, argmax, dce/dz or None, dalpha/dz or None, dnla/dz or None) of one chunk: z the
    drafter's logits, zt the target's draft-vocab logits (c, Vd), lmass (c,) log of the target's draft-vocab mass,
    wr (c,) optional 0/1 row weights. The CE's operations are soft_ce._chunk's, in the same order."""
    z = z.float()                                                                # (c, Vd)
    lse = torch.logsumexp(z, dim=-1)                                             # (c,)
    pn = torch.softmax(zt, dim=-1, dtype=torch.float32)                          # (c, Vd) p', sums to 1
    ce, pred = lse - torch.linalg.vecdot(pn, z), z.max(-1).indices               # (c,), (c,)
    q = z.sub_(lse[:, None]).exp_()                                              # (c, Vd) softmax(z), z's buffer
    p = pn * lmass.float().exp()[:, None]                                        # (c, Vd) the target's p, sums to m
    below = q < p                                                                # (c, Vd) where min(p, q) = q
    alpha = torch.where(below, q, p).sum(-1)                                     # (c,)
    safe = alpha.clamp(min=ALPHA_FLOOR)                                          # (c,)
    nla = -safe.log()                                                            # (c,)
    d_alpha = d_nla = None
    if g_alpha or g_nla:
        s = torch.where(below, q, 0.0).sum(-1)                                   # (c,) S
        d_alpha = q * (below.float() - s[:, None])                               # (c, Vd)
        if g_nla:
            d_nla = d_alpha / -safe[:, None]                                     # (c, Vd)
            d_alpha = d_alpha if g_alpha else None
    d_ce = q.sub_(pn) if g_ce else None                                          # (c, Vd) q's buffer, used last
    if wr is not None:
        ce, alpha, nla = ce * wr, alpha * wr, nla * wr
        d_ce, d_alpha, d_nla = (None if d is None else d.mul_(wr[:, None]) for d in (d_ce, d_alpha, d_nla))
    return ce.sum(), alpha.sum(), nla.sum(), pred, d_ce, d_alpha, d_nla


@functools.cache
def _compiled_chunk():
    # as soft_ce._compiled_chunk: the row dimension goes symbolic after its first change; one graph per set of
    # requested gradients (a training run uses one)
    return torch.compile(_chunk)


class _FusedLK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, f, wt, lmass, chunk: int, dtype: torch.dtype, weight, grads: tuple[bool, bool, bool]):
        N = x.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grads = tuple(g and need_grad for g in grads)
        sums = torch.zeros(3, dtype=torch.float32, device=x.device)              # ce, alpha, nla
        pred = torch.empty(N, dtype=torch.long, device=x.device)                 # (N,)
        gx = [torch.empty(x.shape, dtype=dtype, device=x.device) if g else None for g in grads]    # (N, h) each
        gw = [torch.zeros(w.shape, dtype=torch.float32, device=x.device) if g else None for g in grads]  # (Vd, h)
        with torch.autocast(x.device.type, enabled=False):
            wc, wtc = w.to(dtype), None if wt is None else wt.to(dtype)
            # compiled for training on CUDA; a pass without gradients (eval) runs eagerly: its few passes over
            # (c, Vd) cost less than the compile would
            part = _compiled_chunk() if x.is_cuda and any(grads) else _chunk
            for i in range(0, N, chunk):
                xc = x[i:i + chunk].to(dtype)                                    # (c, h)
                wr = None if weight is None else weight[i:i + chunk].float()     # (c,)
                fc = f[i:i + chunk]                                              # (c, h_t) or (c, Vd)
                zt = fc if wtc is None else fc.to(dtype) @ wtc.T                 # (c, Vd) target logits
                *s, pr, d_ce, d_alpha, d_nla = part(xc @ wc.T, zt, lmass[i:i + chunk], wr, *grads)
                sums += torch.stack(s)
                pred[i:i + chunk] = pr
                for j, dz in enumerate((d_ce, d_alpha, d_nla)):
                    if dz is not None:
                        dz = dz.to(dtype)                                        # (c, Vd)
                        gx[j][i:i + chunk] = dz @ wc                             # (c, h)
                        gw[j] += (dz.T @ xc).float()                             # (Vd, h)
        ctx.grads = grads
        ctx.save_for_backward(*(t for t in gx + gw if t is not None))
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        outs = tuple(sums[j].clone() for j in range(3))
        ctx.mark_non_differentiable(pred, *(o for o, g in zip(outs, grads) if not g))
        return *outs, pred

    @staticmethod
    def backward(ctx, g_ce, g_alpha, g_nla, g_pred):
        saved, n = ctx.saved_tensors, sum(ctx.grads)
        gx, gw = iter(saved[:n]), iter(saved[n:])
        dx = dw = None
        for on, g in zip(ctx.grads, (g_ce, g_alpha, g_nla)):
            if on:
                a, b = next(gx) * g, next(gw) * g
                dx, dw = (a, b) if dx is None else (dx + a, dw + b)
        dx = dx.to(ctx.x_dtype) if ctx.needs_input_grad[0] and dx is not None else None
        dw = dw.to(ctx.w_dtype) if ctx.needs_input_grad[1] and dw is not None else None
        return dx, dw, None, None, None, None, None, None, None


def fused_lk_terms(x: Tensor, w: Tensor, f: Tensor, wt: Tensor | None, log_mass: Tensor, *, grads: tuple[str, ...] = (),
                   chunk: int = 4096, weight: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(sum of ce, sum of alpha, sum of -log alpha, drafter argmax per row) over the rows, fused with the drafter's
    LM head. x, w, f, wt, chunk and weight as soft_ce.fused_soft_ce; log_mass (N,) the log of the target's
    probability mass on the draft vocabulary at each row (0: the target's whole law lies in it). grads names the
    sums that carry gradients (of 'ce', 'alpha', 'nla'); the others are metrics, with none.

    Matmuls run in the autocast dtype when autocast is on (else x's dtype); everything per row in fp32."""
    if x.shape[0] != f.shape[0] or log_mass.shape != x.shape[:1]:
        raise ValueError(f"fused_lk_terms: {x.shape[0]} drafter rows but {f.shape[0]} target rows and "
                         f"{tuple(log_mass.shape)} masses")
    if weight is not None and weight.shape != x.shape[:1]:
        raise ValueError(f"fused_lk_terms: weight {tuple(weight.shape)} for {x.shape[0]} rows")
    if wt is None and f.shape[1] != w.shape[0]:
        raise ValueError(f"fused_lk_terms: target logits have {f.shape[1]} columns for a {w.shape[0]}-token head")
    if set(grads) - set(TERMS):
        raise ValueError(f"fused_lk_terms: grads must name terms of {TERMS}, got {grads}")
    if x.shape[0] == 0:
        zero = (x.sum() + w.sum()) * 0.0
        return zero, zero.clone(), zero.clone(), torch.empty(0, dtype=torch.long, device=x.device)
    return _FusedLK.apply(x, w, f.detach(), None if wt is None else wt.detach(), log_mass.detach(), int(chunk),
                          _compute_dtype(x), None if weight is None else weight.detach(),
                          tuple(t in grads for t in TERMS))


@torch.no_grad()
def log_draft_mass(z: Tensor, token_ids: Tensor, rows: int = 1024) -> Tensor:
    """(c,) fp32: log of the probability mass softmax(z) puts on the columns token_ids, for target logits z (c, V);
    in fp32 slices of `rows` rows (a bf16 logsumexp over the whole vocabulary is too coarse for it)."""
    out = []
    for i in range(0, z.shape[0], rows):
        zf = z[i:i + rows].float()                                               # (r, V)
        out.append(torch.logsumexp(zf[:, token_ids], dim=-1) - torch.logsumexp(zf, dim=-1))  # (r,)
    return torch.cat(out) if out else z.new_zeros(0, dtype=torch.float32)
