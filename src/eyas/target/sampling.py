"""Token distributions and the rejection rules that keep speculative sampling lossless.

The target distribution at temperature t > 0 with nucleus top_p is `probs(logits, t, top_p)`;
plain and speculative decoding both sample from exactly this distribution. Temperature 0 is
greedy (argmax, ties to the lowest id, as torch.argmax).
"""

from __future__ import annotations

import torch
from torch import Tensor


def probs(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """(..., V) logits -> (..., V) fp32 probabilities after temperature and nucleus filtering."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = p.sort(dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass strictly before each token
        sp = sp.masked_fill(before >= top_p, 0.0)  # keep the smallest prefix reaching top_p
        p = torch.zeros_like(p).scatter(-1, si, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(p: Tensor, gen: torch.Generator | None) -> Tensor:
    """Sample one id per row of (B,V) probabilities."""
    return torch.multinomial(p, 1, generator=gen)[:, 0]


def sample(logits: Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> Tensor:
    """(B,V) logits -> (B,) ids: argmax at temperature 0, else a draw from `probs`."""
    if temperature == 0:
        return logits.argmax(-1)
    return draw(probs(logits, temperature, top_p), gen)


def uniform(gen: torch.Generator | None, device) -> float:
    return float(torch.rand((), generator=gen, device=device))


def accept_sampled(p: Tensor, q: Tensor, token: int, gen) -> tuple[bool, Tensor]:
    """Standard speculative sampling for a draft token drawn from q (Leviathan et al.; Chen et al.).

    Accept with probability min(1, p[x]/q[x]); on rejection the caller samples from the returned
    residual norm(max(p - q, 0)). Returns (accepted, residual-or-p).
    """
    px, qx = float(p[token]), float(q[token])
    if qx > 0 and uniform(gen, p.device) * qx < px:  # u < p/q, written without dividing
        return True, p
    res = (p - q).clamp(min=0)
    total = res.sum()
    return False, (res / total if total > 0 else p)


def accept_fixed(p: Tensor, token: int, gen) -> tuple[bool, Tensor]:
    """Rejection step for a deterministic draft (a top-k child, a prompt-lookup token).

    The draft is a point mass, so accept with probability p[x]; on rejection x is impossible and the
    residual is p with x removed, renormalised. Applied to the children of a tree node one after
    the other this is the recursive rejection scheme of SpecInfer/EAGLE; the token finally emitted
    is distributed exactly as p.
    """
    px = float(p[token])
    if uniform(gen, p.device) < px:
        return True, p
    res = p.clone()
    res[token] = 0.0
    total = res.sum()
    return False, (res / total if total > 0 else p)
