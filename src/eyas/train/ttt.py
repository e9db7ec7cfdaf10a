"""Training-time test (TTT): K unrolled draft steps over every position of a sequence, and their loss.

Alignment (EAGLE3.md section 3, worked out with indices in docs/ttt.md). At step k, position t:
  input token   x_{t+k+1}      (ground truth, frozen target embedding)
  hidden        g_t (k = 0) or the step k-1 output at t (k > 0)
  RoPE position t + k
  target        P_{t+k+1} = softmax(target logits at t+k+1) restricted to the draft vocab, renormalised;
                it is the target's belief about x_{t+k+2}, the token this step predicts
  counted iff   t+k+2 < T, valid[t..t+k+2] all True, loss_mask[t+k+2], argmax(full target logits at t+k+1)
                lies in the draft vocab
  attends to    step-0 keys at j <= t (j valid or j == t) + keys of steps 1..k at position t (diagonal)

Fast path: step k runs all T positions in one `drafter.layer` call with the keys of steps 0..k-1 as the
cache and a (T, (k+1)T) mask sliced from one built up front; logits and loss are computed per step (and per
position chunk when `chunk_size` is set, with activation checkpointing so only one chunk of logits lives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True, kw_only=True)
class TTTConfig:
    num_steps: int = 7
    """K, the number of unrolled draft steps."""
    decay: float = 0.8
    """Loss weight of step k is decay**k."""
    chunk_size: int | None = None
    """Positions (along T) per logits/loss chunk; None computes one step's logits at once."""
    reduction: str = "mean"
    """'mean': loss_k is the mean over step k's counted positions; 'sum': the plain sum (for the caller to divide)."""

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"ttt: num_steps must be >= 1, got {self.num_steps}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"ttt: decay must be in (0, 1], got {self.decay}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"ttt: chunk_size must be >= 1 or None, got {self.chunk_size}")
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"ttt: reduction must be 'mean' or 'sum', got {self.reduction!r}")


@dataclass
class TTTOutput:
    loss: Tensor
    """Scalar with grad: sum_k decay**k * loss_k."""
    loss_k: Tensor
    """(K,) detached per-step loss (mean or sum, per TTTConfig.reduction)."""
    count_k: Tensor
    """(K,) int64 counted positions per step."""
    correct_k: Tensor
    """(K,) int64 counted positions where drafter argmax == target argmax."""
    cond_count_k: Tensor
    """(K,) int64 counted positions whose steps < k were all counted and correct."""
    cond_correct_k: Tensor
    """(K,) int64 of those, the ones correct at step k."""

    @property
    def acc_k(self) -> list[float]:
        return (self.correct_k / self.count_k.clamp(min=1)).tolist()

    @property
    def cond_acc_k(self) -> list[float]:
        return (self.cond_correct_k / self.cond_count_k.clamp(min=1)).tolist()


def target_logits_from_final(final: Tensor, lm_head_weight: Tensor, token_ids: Tensor | None = None) -> Tensor:
    """Target logits (..., V) = final @ W^T, or only the draft-vocab columns (..., V_draft) given token_ids."""
    w = lm_head_weight if token_ids is None else lm_head_weight[token_ids]
    return F.linear(final.to(w.dtype), w)


def _shift(x: Tensor, s: int) -> Tensor:
    """y[:, t] = x[:, t + s], zero/False past the end. x (B, T, ...)."""
    if s == 0:
        return x
    pad = torch.zeros_like(x[:, :s])
    return torch.cat([x[:, s:], pad], dim=1)[:, : x.shape[1]]                  # (B, T, ...)


def _chunk_loss(drafter, hidden, final, w_draft, mask):
    """Soft CE summed over `mask`, and the drafter's argmax there (-1 elsewhere).

    hidden (B, c, h), final (B, c, h_t), mask (B, c). Logits are computed only at the counted positions
    (prompt and padding positions never need them), which saves most of the LM head's cost."""
    logp = F.log_softmax(drafter.logits(hidden[mask]).float(), dim=-1)             # (N, Vd)
    with torch.no_grad():
        p = F.softmax(F.linear(final[mask].to(w_draft.dtype), w_draft).float(), dim=-1)  # (N, Vd)
    ce = -(p * logp).sum(-1)                                                      # (N,)
    pred = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)       # (B, c)
    pred[mask] = logp.argmax(-1)
    return ce.sum(), pred


def ttt_forward(drafter: nn.Module, *, input_ids: Tensor, loss_mask: Tensor, valid: Tensor, aux: Tensor,
                final: Tensor, embed: nn.Module | Tensor, lm_head_weight: Tensor,
                cfg: TTTConfig = TTTConfig()) -> TTTOutput:
    """TTT loss and metrics for one batch.

    input_ids, loss_mask, valid: (B, T) (valid False on padding); aux (B, T, 3h_t) concat(low, mid, high);
    final (B, T, h_t) the target's final-norm output; embed: the frozen target nn.Embedding (or its weight);
    lm_head_weight (V, h_t) the target's lm_head weight.
    """
    B, T = input_ids.shape
    if loss_mask.shape != (B, T) or valid.shape != (B, T) or aux.shape[:2] != (B, T) or final.shape[:2] != (B, T):
        raise ValueError(f"ttt: shape mismatch: input_ids {tuple(input_ids.shape)}, loss_mask {tuple(loss_mask.shape)}, "
                         f"valid {tuple(valid.shape)}, aux {tuple(aux.shape)}, final {tuple(final.shape)}")
    K, dev = cfg.num_steps, input_ids.device
    chunk = cfg.chunk_size or T
    token_ids, t2d = drafter.token_ids, drafter.t2d
    valid = valid.bool()
    lmask = loss_mask.bool() & valid

    with torch.no_grad():
        # About x_{s+1}, per position s: the full-vocab target argmax, and its draft id when in the draft vocab.
        # Only positions s with loss_mask[s+1] can ever be counted (as t+k+1 of some step), so the full-vocab
        # product runs there only; elsewhere tgt_id stays 0 and is never read.
        need = _shift(lmask, 1)                                                    # (B, T)
        tgt_id = torch.zeros(B, T, dtype=torch.long, device=dev)                   # (B, T)
        rows = final[need]                                                         # (N, h_t)
        tgt_id[need] = torch.cat([target_logits_from_final(rows[i:i + chunk * B], lm_head_weight).argmax(-1)
                                  for i in range(0, rows.shape[0], chunk * B)]) if rows.numel() else tgt_id[need]
        in_draft = t2d[tgt_id]                                                     # (B, T)
        tgt_draft = torch.searchsorted(token_ids, tgt_id).clamp(max=token_ids.numel() - 1)  # (B, T)
        w_draft = lm_head_weight[token_ids]                                        # (Vd, h_t)
        embeds = embed(input_ids) if isinstance(embed, nn.Module) else F.embedding(input_ids, embed)  # (B, T, h)
        # Attention mask for all steps, built once: [step-0 causal | I | I | ...], (B, T, K*T).
        eye = torch.eye(T, dtype=torch.bool, device=dev)
        ctx = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev)) & (valid[:, None, :] | eye)  # (B, T, T)
        full_mask = torch.cat([ctx] + [eye.expand(B, T, T)] * (K - 1), dim=-1)    # (B, T, K*T)

    hidden = drafter.fuse(aux)                                                     # (B, T, h) = g
    positions = torch.arange(T, device=dev).expand(B, T)                           # (B, T)
    cache = None
    run = valid & _shift(valid, 1)            # valid[t..t+k+2] all True, built up per step
    prev_right = torch.ones(B, T, dtype=torch.bool, device=dev)
    weights = torch.tensor([cfg.decay ** k for k in range(K)], device=dev)
    total, losses, counts, corrects, ccounts, ccorrects = 0.0, [], [], [], [], []
    for k in range(K):
        emb_k = _shift(embeds, k + 1)                                              # (B, T, h) embed(x_{t+k+1})
        mask_k = full_mask[:, :, : (k + 1) * T].contiguous()                      # (B, T, (k+1)T)
        out, cache = drafter.layer(hidden, emb_k, positions + k, mask_k, cache)
        run = run & _shift(valid, k + 2)
        m = run & _shift(lmask, k + 2) & _shift(in_draft, k + 1)                   # (B, T) counted positions
        fin_k, tgt_k = _shift(final, k + 1), _shift(tgt_draft, k + 1)              # target at t+k+1
        loss_sum, preds = 0.0, []
        for i in range(0, T, chunk):
            args = (out[:, i:i + chunk], fin_k[:, i:i + chunk], w_draft, m[:, i:i + chunk])
            if cfg.chunk_size is not None and torch.is_grad_enabled():
                ls, pr = checkpoint(_chunk_loss, drafter, *args, use_reentrant=False)
            else:
                ls, pr = _chunk_loss(drafter, *args)
            loss_sum, preds = loss_sum + ls, preds + [pr]
        pred = torch.cat(preds, dim=1)                                             # (B, T)
        count = m.sum()
        loss_k = loss_sum / count.clamp(min=1) if cfg.reduction == "mean" else loss_sum
        total = total + weights[k] * loss_k
        right = (pred == tgt_k) & m
        cond = m & prev_right
        prev_right = prev_right & right
        losses.append(loss_k.detach())
        counts.append(count)
        corrects.append(right.sum())
        ccounts.append(cond.sum())
        ccorrects.append((cond & right).sum())
        hidden = out
    if not isinstance(total, Tensor):
        total = torch.zeros((), device=dev)
    return TTTOutput(loss=total, loss_k=torch.stack(losses), count_k=torch.stack(counts),
                     correct_k=torch.stack(corrects), cond_count_k=torch.stack(ccounts),
                     cond_correct_k=torch.stack(ccorrects))
