"""The drafter's LM head fused with the soft cross-entropy against the target, in row chunks.

For N counted positions, drafter hidden x (N, h) (already normed), drafter head W (Vd, h), and the target's
soft labels p = softmax(f @ Wt^T) from its final states f (N, h_t) and draft-vocab head rows Wt (Vd, h_t):

    z = x @ W^T                  loss = sum_n  logsumexp(z_n) - <p_n, z_n>      (= -sum p log softmax z)
    dloss/dz = softmax(z) - p    dx = dz @ W,  dW = dz^T @ x

The (N, Vd) logits, soft labels and their gradient exist one chunk of rows at a time, and the gradients
are computed in the forward pass (as Liger's fused linear cross-entropy does), so nothing of size
N x Vd is kept for the backward. A caller that already holds the target's draft-vocab logits (N, Vd) passes
them instead of f and Wt (ttt.py computes them once per position, not once per TTT step). The naive reference is
`soft_ce_reference` (tests/test_soft_ce.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _chunk(z: Tensor, zt: Tensor, wr: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss sum, drafter argmax, dloss/dz) of one chunk from drafter logits z and target logits zt, (c, Vd);
    wr (c,) optional row weights: 0 drops a row from the loss and the gradient, 1 keeps it."""
    # Few passes over (c, Vd) and no temporaries of that size but p: on the CPU these elementwise passes are a large
    # share of the loss's time. z's buffer becomes dz (z is the caller's temporary product).
    z = z.float()                                                                # (c, Vd)
    lse = torch.logsumexp(z, dim=-1)                                             # (c,)
    p = torch.softmax(zt, dim=-1, dtype=torch.float32)                           # (c, Vd)
    ce, pred = lse - torch.linalg.vecdot(p, z), z.max(-1).indices                # (c,), (c,) first max = argmax
    dz = z.sub_(lse[:, None]).exp_().sub_(p)                                     # (c, Vd) softmax(z) - p
    if wr is not None:
        ce, dz = ce * wr, dz.mul_(wr[:, None])
    return ce.sum(), pred, dz


def _hard_chunk(z: Tensor, labels: Tensor, wr: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """_chunk with one-hot labels (c,) token ids: (loss sum, argmax, softmax(z) - onehot)."""
    z = z.float()                                                                # (c, Vd)
    lse = torch.logsumexp(z, dim=-1)                                             # (c,)
    ce, pred = lse - z.gather(1, labels[:, None])[:, 0], z.max(-1).indices       # (c,), (c,)
    dz = z.sub_(lse[:, None]).exp_()                                             # (c, Vd) softmax(z)
    dz[torch.arange(len(labels), device=z.device), labels] -= 1.0
    if wr is not None:
        ce, dz = ce * wr, dz.mul_(wr[:, None])
    return ce.sum(), pred, dz


@functools.cache
def _compiled_chunk():
    # dynamic=None: the last chunk's row count changes every step (the counted positions vary); after the first
    # change dynamo makes the row dimension symbolic, so two compiles in all (per weighted / unweighted use).
    # dynamic=False compiled one graph per row count and hit the recompile limit (8) in the first steps of a
    # packed run, then ran eagerly.
    return torch.compile(_chunk)


class _FusedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, f, wt, chunk: int, dtype: torch.dtype, weight, targets: bool):
        N = x.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        pred = torch.empty(N, dtype=torch.long, device=x.device)                 # (N,)
        tpred = torch.full((N,) if targets else (0,), -1, dtype=torch.long, device=x.device)  # the target's argmax
        gx = torch.empty(x.shape, dtype=dtype, device=x.device) if need_grad else None  # (N, h)
        # a frozen head (DFlash reads the target's) gets no (V, h) gradient buffer
        gw = (torch.zeros(w.shape, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None)
        hard = f.dtype == torch.long                                             # f (N,) token ids: hard labels
        with torch.autocast(x.device.type, enabled=False):
            wc, wtc = w.to(dtype), None if wt is None else wt.to(dtype)
            # on CUDA the elementwise/reduction part is one compiled kernel set (a few passes over (c, Vd))
            part = _compiled_chunk() if x.is_cuda else _chunk
            for i in range(0, N, chunk):
                xc = x[i:i + chunk].to(dtype)                                    # (c, h)
                wr = None if weight is None else weight[i:i + chunk].float()     # (c,)
                fc = f[i:i + chunk]                                              # (c, h_t), (c, Vd) or (c,)
                if hard:
                    ls, pr, dz = _hard_chunk(xc @ wc.T, fc, wr)                  # dz (c, Vd) softmax(z) - onehot
                else:
                    zt = fc if wtc is None else fc.to(dtype) @ wtc.T             # (c, Vd) target logits
                    if targets:
                        tpred[i:i + chunk] = zt.max(-1).indices                  # (c,) first max = argmax
                    ls, pr, dz = part(xc @ wc.T, zt, wr)                         # dz (c, Vd) softmax(z) - p
                loss += ls
                pred[i:i + chunk] = pr
                if need_grad:
                    dz = dz.to(dtype)                                            # (c, Vd)
                    gx[i:i + chunk] = dz @ wc                                    # (c, h)
                    if gw is not None:
                        gw += (dz.T @ xc).float()                                # (Vd, h)
        ctx.save_for_backward(gx, gw if gw is not None else torch.zeros(0, device=x.device))
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        ctx.mark_non_differentiable(pred, tpred)
        return loss, pred, tpred

    @staticmethod
    def backward(ctx, g_loss, g_pred, g_tpred):
        gx, gw = ctx.saved_tensors
        dx = (gx * g_loss).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = (gw * g_loss).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None, None


def fused_soft_ce(x: Tensor, w: Tensor, f: Tensor, wt: Tensor | None, *, chunk: int = 4096,
                  weight: Tensor | None = None, targets: bool = False) -> tuple[Tensor, ...]:
    """(sum over rows of soft CE, drafter argmax per row). x (N, h) normed drafter states, w (Vd, h) the drafter's
    lm_head weight, f (N, h_t) the target's final states, wt (Vd, h_t) the target's lm_head rows of the draft vocab;
    or wt None and f (N, Vd) the target's draft-vocab logits themselves (f @ wt^T, computed by the caller).
    weight (N,) of 0/1, optional: rows weighted 0 add nothing to the loss or the gradients (fixed-size row sets).
    f (N,) int64 instead: hard labels (token ids; the plain cross-entropy). A w that needs no gradient (a frozen head)
    gets none computed. targets: also return the target's argmax per row (N,), read off the soft labels' logits
    (-1 with hard labels, which have none).

    Matmuls run in the autocast dtype when autocast is on (else x's dtype); logsumexp/softmax in fp32."""
    if x.shape[0] != f.shape[0]:
        raise ValueError(f"fused_soft_ce: {x.shape[0]} drafter rows but {f.shape[0]} target rows")
    if x.shape[0] == 0:
        empty = torch.empty(0, dtype=torch.long, device=x.device)
        return ((x.sum() + w.sum()) * 0.0, empty) + ((empty,) if targets else ())
    if weight is not None and weight.shape != x.shape[:1]:
        raise ValueError(f"fused_soft_ce: weight {tuple(weight.shape)} for {x.shape[0]} rows")
    if f.dtype == torch.long:  # hard labels
        if f.shape != x.shape[:1] or wt is not None:
            raise ValueError(f"fused_soft_ce: hard labels {tuple(f.shape)} for {x.shape[0]} rows (and no wt)")
    elif wt is None and f.shape[1] != w.shape[0]:
        raise ValueError(f"fused_soft_ce: target logits have {f.shape[1]} columns for a {w.shape[0]}-token head")
    loss, pred, tpred = _FusedSoftCE.apply(x, w, f.detach(), None if wt is None else wt.detach(), int(chunk),
                                           _compute_dtype(x), None if weight is None else weight.detach(),
                                           bool(targets) and f.dtype != torch.long)
    return (loss, pred, tpred) if targets else (loss, pred)


def soft_ce_reference(x: Tensor, w: Tensor, f: Tensor, wt: Tensor) -> tuple[Tensor, Tensor]:
    """The plain autograd version: -sum p * log_softmax(x @ w^T), p = softmax(f @ wt^T)."""
    logp = F.log_softmax((x @ w.T).float(), dim=-1)                              # (N, Vd)
    with torch.no_grad():
        p = F.softmax((f @ wt.T).float(), dim=-1)                                # (N, Vd)
    return -(p * logp).sum(), logp.argmax(-1)
