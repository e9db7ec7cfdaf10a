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

Fast path: step k runs all T positions in one `drafter.layer` call with the keys of steps 0..k-1 as the cache.
The attention rule is a dense (B, T, (k+1)T) bool mask (`dense_masks`, the reference), a flex-attention BlockMask
(`flex_mask`; CUDA) that computes only the causal step-0 blocks and the k diagonal blocks, or on the CPU the same
blocks as StepBlocks (eyas.model.blocks: the fused kernel over step 0's keys, the diagonals beside it).
Logits and the soft cross-entropy run fused, in row chunks, at the counted positions only (eyas.train.soft_ce).
TTTConfig.loss picks the per-step loss: 'ce' (that soft cross-entropy), or one of the LK losses (arXiv 2602.23881,
eyas.train.lk) over the same positions, mask and step weights: 'lk_alpha' = mean of -log alpha, 'lk_lambda' =
w CE + (1 - w)(1 - mean alpha) with w = exp(-lk_eta * mean alpha) of the step (detached), where alpha =
sum_v min(p_v, q_v) is the chance that the target accepts a token sampled from the drafter.
Packed rows (several samples per row) carry segment ids: attention and counting never cross a sample boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.errors import EyasError
from eyas.model.blocks import StepBlocks
from eyas.train.lk import fused_lk_terms, log_draft_mass
from eyas.train.soft_ce import fused_soft_ce


LABEL_TABLE_BYTES = 256 << 20
"""Largest (positions x V_draft) table of target logits one batch keeps; past it each step recomputes its labels in
chunks (a CPU batch of 2048 tokens and an 8k draft vocabulary takes 32 MiB; 16 x 2048 rows x 32k, 2 GiB, do not)."""


LOSSES = ("ce", "lk_alpha", "lk_lambda")
"""TTTConfig.loss's names (and `eyas train --loss`'s choices)."""


@dataclass(frozen=True, kw_only=True)
class TTTConfig:
    num_steps: int = 7
    """K, the number of unrolled draft steps."""
    decay: float = 0.8
    """Loss weight of step k is decay**k."""
    chunk_size: int | None = None
    """Rows per chunk of the fused LM head + soft cross-entropy (None: 4096)."""
    attention: str = "auto"
    """'dense' (explicit mask, SDPA), 'flex' (BlockMask, flex_attention; CUDA for training), 'blocks' (StepBlocks; CPU)
    or 'auto' (flex on CUDA, blocks on the CPU)."""
    reduction: str = "mean"
    """'mean': loss_k is the mean over step k's counted positions; 'sum': the plain sum (for the caller to divide)."""
    loss: str = "ce"
    """Per-step loss: 'ce' (soft cross-entropy), 'lk_alpha' (-log alpha) or 'lk_lambda' (CE and 1 - alpha mixed)."""
    lk_eta: float = 3.0
    """lk_lambda: the CE's weight is exp(-lk_eta * the step's mean alpha); 0 gives the plain CE."""

    def __post_init__(self):
        if self.num_steps < 1:
            raise EyasError(f"ttt: num_steps must be >= 1, got {self.num_steps}")
        if not 0.0 < self.decay <= 1.0:
            raise EyasError(f"ttt: decay must be in (0, 1], got {self.decay}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise EyasError(f"ttt: chunk_size must be >= 1 or None, got {self.chunk_size}")
        if self.attention not in ("auto", "dense", "flex", "blocks"):
            raise EyasError(f"ttt: attention must be auto, dense, flex or blocks, got {self.attention!r}")
        if self.reduction not in ("mean", "sum"):
            raise EyasError(f"ttt: reduction must be 'mean' or 'sum', got {self.reduction!r}")
        if self.loss not in LOSSES:
            raise EyasError(f"ttt: loss must be {', '.join(LOSSES[:-1])} or {LOSSES[-1]}, got {self.loss!r}")
        if not self.lk_eta >= 0.0:
            raise EyasError(f"ttt: lk_eta must be >= 0, got {self.lk_eta}")


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
    """(K,) int64 positions decoding would draft at step k (valid, loss-masked; the target may lie outside the draft
    vocab, which counts as a miss) whose steps < k were all counted and correct."""
    cond_correct_k: Tensor
    """(K,) int64 of those, the ones correct at step k."""
    accept_len: Tensor | None = None
    """(B, T) int64, detached: how many leading drafts the chain drafted at position t gets right (0..K), i.e.
    what a greedy decoding round that starts there accepts. Rounds start only at some positions; see
    metrics.round_tau for the estimate that follows decoding's round starts."""

    target_ids: Tensor | None = None
    """(B, T) int64, detached: the full-vocab target argmax at s (about x_{s+1}) where loss_mask[s+1], else 0; what
    ttt_forward's target_ids takes on a later pass over the same rows."""
    alpha_k: Tensor | None = None
    """(K,) float32, detached: the sum over step k's counted positions of alpha = sum_v min(p_v, q_v), the chance
    that the target accepts a token sampled from the drafter (eyas.train.lk); None unless measured (an LK loss, or
    ttt_forward's alpha=True)."""

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


def first_argmax(z: Tensor) -> Tensor:
    """z.argmax(-1), the first index of the maximum: max(-1) has the same rule and is several times faster on bf16
    CPU tensors, where argmax over the target's whole vocabulary costs about as much as the product itself."""
    return z.max(-1).indices


def _shift(x: Tensor, s: int) -> Tensor:
    """y[:, t] = x[:, t + s], zero/False past the end. x (B, T, ...)."""
    if s == 0:
        return x
    pad = torch.zeros_like(x[:, :s])
    return torch.cat([x[:, s:], pad], dim=1)[:, : x.shape[1]]                  # (B, T, ...)


def dense_masks(seg: Tensor, K: int) -> Tensor:
    """The reference mask for every step at once: [step-0 causal within the segment | I | I | ...], (B, T, K*T).

    seg (B, T) int segment ids (0 = padding); a padding query attends only to itself."""
    B, T = seg.shape
    eye = torch.eye(T, dtype=torch.bool, device=seg.device)                      # (T, T)
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)          # (B, T, T)
    ctx = torch.tril(torch.ones(T, T, dtype=torch.bool, device=seg.device)) & (same | eye)  # (B, T, T)
    return torch.cat([ctx] + [eye.expand(B, T, T)] * (K - 1), dim=-1)           # (B, T, K*T)


def flex_mask(seg: Tensor, k: int):
    """Step k's BlockMask over the keys [step 0 | step 1 | ... | step k], each T long: the same rule as
    dense_masks, but only the causal blocks and the k diagonal blocks are ever computed."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = seg.shape

    def rule(b, h, q, kv):
        j = kv % T
        step0 = (kv < T) & (j <= q) & (((seg[b, j] == seg[b, q]) & (seg[b, j] > 0)) | (j == q))
        return step0 | ((kv >= T) & (j == q))
    return create_block_mask(rule, B, None, T, (k + 1) * T, device=seg.device, _compile=seg.is_cuda)


def _select(m: Tensor, n: int | None) -> tuple[Tensor, Tensor | None]:
    """Flat positions (into B*T) of m's True entries, in order, and a 0/1 weight per entry (None: all 1).

    n None: exactly the True ones (their count is read back from the device: a host sync). n an upper bound on
    m.sum() that the caller knows on the host: exactly n entries, the True ones first and then False positions
    weighted 0, so the shapes are known and nothing waits for the device."""
    flat = m.reshape(-1)                                                          # (B*T,)
    if n is None:
        return flat.nonzero().squeeze(1), None
    order = torch.sort((~flat).to(torch.uint8), stable=True).indices[:n]        # (n,) True first, in order
    return order, flat[order].float()


def ttt_forward(drafter: nn.Module, *, input_ids: Tensor, loss_mask: Tensor, valid: Tensor, aux: Tensor,
                final: Tensor, embed: nn.Module | Tensor, lm_head_weight: Tensor, cfg: TTTConfig = TTTConfig(),
                segment_ids: Tensor | None = None, position_ids: Tensor | None = None,
                max_counted: int | None = None, target_ids: Tensor | None = None,
                alpha: bool = False) -> TTTOutput:
    """TTT loss and metrics for one batch.

    input_ids, loss_mask, valid: (B, T) (valid False on padding); aux (B, T, 3h_t) concat(low, mid, high);
    final (B, T, h_t) the target's final-norm output; embed: the frozen target nn.Embedding (or its weight);
    lm_head_weight (V, h_t) the target's lm_head weight. Packed rows (several samples per row) pass
    segment_ids (B, T) int (one id per sample, 0 on padding) and position_ids (B, T) (RoPE position within the
    sample); by default each row is one sample (segment = valid) at positions 0..T-1. max_counted: an upper bound
    on the positions with loss_mask & valid, known on the host (the trainer counts them before the copy); with
    it the counted positions are gathered into fixed-size row sets and the forward never waits for the device.
    target_ids: (B, T) the full-vocab target argmax at each position s with loss_mask[s+1] (TTTOutput.target_ids of an
    earlier pass over the same rows): the full-vocab product is skipped (not with alpha measured: alpha needs the
    target's full-vocab normaliser at each position). alpha: also measure alpha_k with the 'ce' loss (the LK losses
    always do); its CE is soft_ce's, to the bit on the CPU.
    """
    B, T = input_ids.shape
    if loss_mask.shape != (B, T) or valid.shape != (B, T) or aux.shape[:2] != (B, T) or final.shape[:2] != (B, T):
        raise ValueError(f"ttt: shape mismatch: input_ids {tuple(input_ids.shape)}, loss_mask {tuple(loss_mask.shape)}, "
                         f"valid {tuple(valid.shape)}, aux {tuple(aux.shape)}, final {tuple(final.shape)}")
    K, dev = cfg.num_steps, input_ids.device
    # flex's CUDA kernels need head_dim >= 16; smaller (test-sized) heads stay on the dense path under 'auto'
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and input_ids.is_cuda
                                           and drafter.config.head_dim >= 16)
    use_blocks = cfg.attention == "blocks" or (cfg.attention == "auto" and dev.type == "cpu")
    if use_blocks and dev.type != "cpu":
        raise EyasError(f"ttt: attention 'blocks' runs on the CPU only (this batch is on {dev.type})")
    token_ids, t2d = drafter.token_ids, drafter.t2d
    valid = valid.bool()
    seg = valid.long() if segment_ids is None else torch.where(valid, segment_ids, 0)   # (B, T)
    positions = torch.arange(T, device=dev).expand(B, T) if position_ids is None else position_ids  # (B, T)
    lmask = loss_mask.bool() & valid
    alpha = alpha or cfg.loss != "ce"
    holes = (~valid).long().cumsum(-1)                                           # (B, T) invalid tokens up to t

    with torch.no_grad():
        # About x_{s+1}, per position s: the full-vocab target argmax, and its draft id when in the draft vocab.
        # Only positions s with loss_mask[s+1] can ever be counted (as t+k+1 of some step), so the full-vocab
        # product runs there only; elsewhere tgt_id stays 0 and is never read.
        # The soft labels of every step are rows of these same positions (step k at t reads position t+k+1):
        # when their draft-vocab logits fit in LABEL_TABLE_BYTES they are taken from the full-vocab product here,
        # once per position, instead of a second product per step (K x V_draft more multiply-adds per position).
        # Given target_ids (the same argmax, kept from an earlier epoch) only the draft-vocab columns are multiplied.
        # With alpha, also log m_s, the target's probability mass on the draft vocabulary (from the same product).
        need = _shift(lmask, 1)                                                    # (B, T)
        known = target_ids is not None and not alpha
        lmass = torch.zeros(B * T, dtype=torch.float32, device=dev) if alpha else None  # (B*T,) log m_s
        tgt_id = target_ids.reshape(B * T).long() if known else torch.zeros(B * T, dtype=torch.long, device=dev)
        at, _ = _select(need, max_counted)                                         # (N,) (extra ones: not read)
        rows, step = final.reshape(B * T, -1)[at], cfg.chunk_size or 4096          # (N, h_t)
        N, Vd = rows.shape[0], token_ids.numel()
        itemsize = (torch.get_autocast_dtype(dev.type).itemsize if torch.is_autocast_enabled(dev.type)
                    else lm_head_weight.element_size())
        keep, table = N * Vd * itemsize <= LABEL_TABLE_BYTES, None
        w_draft = lm_head_weight[token_ids]                                        # (Vd, h_t)
        for i in range(0, N if keep or not known else 0, step):
            if known:
                zd = target_logits_from_final(rows[i:i + step], w_draft)           # (c, Vd)
            else:
                z = target_logits_from_final(rows[i:i + step], lm_head_weight)    # (c, V)
                tgt_id[at[i:i + step]] = first_argmax(z)
                if lmass is not None:
                    lmass[at[i:i + step]] = log_draft_mass(z, token_ids)
                if not keep:
                    continue
                zd = z[:, token_ids]                                               # (c, Vd)
            table = zd.new_empty(N, Vd) if table is None else table               # (N, Vd) target draft logits
            table[i:i + step] = zd
        row_of = torch.zeros(B * T, dtype=torch.long, device=dev)                  # (B*T,) position -> table row
        row_of[at] = torch.arange(N, device=dev)
        tgt_id = tgt_id.view(B, T)                                                 # (B, T)
        in_draft = t2d[tgt_id]                                                     # (B, T)
        tgt_draft = torch.searchsorted(token_ids, tgt_id).clamp(max=token_ids.numel() - 1)  # (B, T)
        embeds = embed(input_ids) if isinstance(embed, nn.Module) else F.embedding(input_ids, embed)  # (B, T, h)
        blocks = StepBlocks(dense_masks(seg, 1)) if use_blocks else None          # step 0's (B, T, T) block
        full_mask = None if use_flex or use_blocks else dense_masks(seg, K)        # (B, T, K*T)

    hidden = drafter.fuse(aux)                                                     # (B, T, h) = g
    cache = None
    prev_right = torch.ones(B, T, dtype=torch.bool, device=dev)
    accept_len = torch.zeros(B, T, dtype=torch.long, device=dev)
    total, losses, counts, corrects, ccounts, ccorrects, alphas = 0.0, [], [], [], [], [], []
    grads = {"ce": ("ce",), "lk_alpha": ("nla",), "lk_lambda": ("ce", "alpha")}[cfg.loss]
    for k in range(K):
        emb_k = _shift(embeds, k + 1)                                              # (B, T, h) embed(x_{t+k+1})
        mask_k = (flex_mask(seg, k) if use_flex else blocks if use_blocks
                  else full_mask[:, :, : (k + 1) * T])                             # (B, T, (k+1)T)
        out, cache = drafter.layer(hidden, emb_k, positions + k, mask_k, cache)
        # counted: x_t .. x_{t+k+2} valid and in one sample, loss on x_{t+k+2}, target in the draft vocab
        span = ((seg > 0) & (seg == _shift(seg, k + 2)) & (holes == _shift(holes, k + 2))
                & _shift(lmask, k + 2))                                            # (B, T) drafted in decoding
        m = span & _shift(in_draft, k + 1)                                         # (B, T) counted (loss, acc_k)
        at, wt = _select(m, max_counted)                                           # (N,), weights (N,) or None
        if table is not None:  # counted rows read position t+k+1 (same row, need True); weight-0 extras any row
            f_k, w_k = table[row_of[(at + k + 1).clamp(max=B * T - 1)]], None      # (N_k, Vd) target logits
        else:
            f_k, w_k = _shift(final, k + 1).reshape(B * T, -1)[at], w_draft        # (N_k, h_t) target states
        x_k, count = drafter.norm(out.reshape(B * T, -1)[at]), m.sum()             # (N_k, h)
        if lmass is None:  # the plain CE
            ls, pr = fused_soft_ce(x_k, drafter.lm_head.weight, f_k, w_k, chunk=cfg.chunk_size or 4096, weight=wt)
        else:
            lm_k = lmass[(at + k + 1).clamp(max=B * T - 1)]                         # (N_k,) log m at t+k+1
            ce, a, nla, pr = fused_lk_terms(x_k, drafter.lm_head.weight, f_k, w_k, lm_k, grads=grads,
                                            chunk=cfg.chunk_size or 4096, weight=wt)
            alphas.append(a.detach())
            if cfg.loss == "lk_lambda":  # sums over the step's positions: w CE_n + (1 - w)(1 - alpha_n)
                lam = torch.exp(-cfg.lk_eta * a.detach() / count.clamp(min=1))      # () the CE's weight
                ls = lam * ce + (1 - lam) * (count - a)
            else:
                ls = nla if cfg.loss == "lk_alpha" else ce
        pred = torch.full((B * T,), -1, dtype=torch.long, device=dev)              # (B*T,)
        pred[at] = pr                                     # extra (weight 0) entries land where m is False
        pred = pred.view(B, T)                                                     # (B, T): read only where m
        loss_k = ls / count.clamp(min=1) if cfg.reduction == "mean" else ls
        total = total + cfg.decay ** k * loss_k
        right = (pred == _shift(tgt_draft, k + 1)) & m
        # conditional counts see what decoding sees: a target outside the draft vocab is a miss, not a skip
        cond = span & prev_right
        prev_right = prev_right & right
        accept_len += prev_right
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
                     cond_correct_k=torch.stack(ccorrects), accept_len=accept_len, target_ids=tgt_id,
                     alpha_k=torch.stack(alphas) if alphas else None)
