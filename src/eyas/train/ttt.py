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


@dataclass
class Layout:
    """Where a batch's samples lie, as the TTT and DFlash losses read it; every field (B, T)."""

    valid: Tensor
    """bool: False on padding."""
    seg: Tensor
    """int64: the segment id of each token (one per sample of a packed row), 0 on padding."""
    positions: Tensor
    """int64: the RoPE position of each token within its sample."""
    lmask: Tensor
    """bool: loss_mask & valid."""
    holes: Tensor
    """int64: invalid tokens up to and including t; equal values at s and t mean nothing invalid in between."""


def layout(what: str, input_ids: Tensor, loss_mask: Tensor, valid: Tensor, aux: Tensor, final: Tensor,
           segment_ids: Tensor | None, position_ids: Tensor | None) -> Layout:
    """The batch's Layout, after checking that its tensors agree on (B, T); `what` names the loss in the error.
    By default each row is one sample (segment = valid) at positions 0..T-1."""
    B, T = input_ids.shape
    if loss_mask.shape != (B, T) or valid.shape != (B, T) or aux.shape[:2] != (B, T) or final.shape[:2] != (B, T):
        raise ValueError(f"{what}: shape mismatch: input_ids {tuple(input_ids.shape)}, loss_mask "
                         f"{tuple(loss_mask.shape)}, valid {tuple(valid.shape)}, aux {tuple(aux.shape)}, final "
                         f"{tuple(final.shape)}")
    valid = valid.bool()
    seg = valid.long() if segment_ids is None else torch.where(valid, segment_ids, 0)          # (B, T)
    positions = (torch.arange(T, device=input_ids.device).expand(B, T) if position_ids is None
                 else position_ids)                                                           # (B, T)
    return Layout(valid=valid, seg=seg, positions=positions, lmask=loss_mask.bool() & valid,
                  holes=(~valid).long().cumsum(-1))                                           # (B, T)


class StepTally:
    """TTTOutput's per-step counts, one step at a time, and the accept length they give: a position's accept length
    is the number of leading steps that were all counted and correct there."""

    def __init__(self, shape: tuple[int, ...], device):
        self.prev_right = torch.ones(shape, dtype=torch.bool, device=device)   # every step so far right
        self.accept = torch.zeros(shape, dtype=torch.long, device=device)
        self.losses, self.counts, self.corrects, self.cond_counts, self.cond_corrects = [], [], [], [], []

    def add(self, loss: Tensor, count: Tensor, right: Tensor, drafted: Tensor) -> None:
        """One step: its loss, its counted positions, `right` (counted and correct) and `drafted` (where decoding
        drafts this step; a target outside the draft vocabulary is a miss there, not a skip)."""
        cond = drafted & self.prev_right
        self.prev_right = self.prev_right & right
        self.accept += self.prev_right
        self.losses.append(loss.detach())
        self.counts.append(count)
        self.corrects.append(right.sum())
        self.cond_counts.append(cond.sum())
        self.cond_corrects.append((cond & right).sum())

    def output(self, loss: Tensor, accept_len: Tensor, **extra) -> TTTOutput:
        return TTTOutput(loss=loss, loss_k=torch.stack(self.losses), count_k=torch.stack(self.counts),
                         correct_k=torch.stack(self.corrects), cond_count_k=torch.stack(self.cond_counts),
                         cond_correct_k=torch.stack(self.cond_corrects), accept_len=accept_len, **extra)


def _attention(cfg: TTTConfig, drafter: nn.Module, input_ids: Tensor) -> str:
    """The step masks' kind for this batch: 'flex', 'blocks' or 'dense' (TTTConfig.attention resolved)."""
    dev = input_ids.device
    # flex's CUDA kernels need head_dim >= 16; smaller (test-sized) heads stay on the dense path under 'auto'
    if cfg.attention == "flex" or (cfg.attention == "auto" and input_ids.is_cuda and drafter.config.head_dim >= 16):
        return "flex"
    if cfg.attention == "blocks" or (cfg.attention == "auto" and dev.type == "cpu"):
        if dev.type != "cpu":
            raise EyasError(f"ttt: attention 'blocks' runs on the CPU only (this batch is on {dev.type})")
        return "blocks"
    return "dense"


@dataclass
class _Labels:
    """The target's side of a batch, made once before the steps (no grad). Step k at position t reads position
    s = t+k+1: the target's argmax there (about x_{s+1}) and its draft-vocab logits, the soft labels."""

    tgt_id: Tensor
    """(B, T) int64: the full-vocab target argmax at s where loss_mask[s+1], else 0 (never read)."""
    in_draft: Tensor
    """(B, T) bool: tgt_id lies in the draft vocabulary."""
    tgt_draft: Tensor
    """(B, T) int64: tgt_id's draft id (clamped where it is not in the draft vocabulary)."""
    table: Tensor | None
    """(N, V_draft) the target's draft-vocab logits of the positions `row_of` maps, or None: each step multiplies
    its rows (the table would pass LABEL_TABLE_BYTES)."""
    row_of: Tensor
    """(B*T,) int64: flat position -> table row."""
    w_draft: Tensor
    """(V_draft, h_t) the draft vocabulary's rows of the target's head."""
    lmass: Tensor | None
    """(B*T,) float32 log m_s, the target's probability mass on the draft vocabulary (when alpha is measured)."""

    def step(self, final: Tensor, k: int, at: Tensor) -> tuple[Tensor, Tensor | None]:
        """Step k's soft labels at the flat positions `at` (N_k,): (target draft logits, None) from the table,
        else (the target's final states at t+k+1, w_draft) for the loss to multiply."""
        BT = self.row_of.shape[0]
        if self.table is not None:  # counted rows read position t+k+1 (a table row); weight-0 extras any row
            return self.table[self.row_of[(at + k + 1).clamp(max=BT - 1)]], None         # (N_k, Vd)
        return _shift(final, k + 1).reshape(BT, -1)[at], self.w_draft                    # (N_k, h_t)

    def log_mass(self, k: int, at: Tensor) -> Tensor | None:
        """(N_k,) log m at t+k+1 of the flat positions `at`, or None when alpha is not measured."""
        if self.lmass is None:
            return None
        return self.lmass[(at + k + 1).clamp(max=self.lmass.shape[0] - 1)]


@torch.no_grad()
def _target_labels(final: Tensor, lm_head_weight: Tensor, drafter: nn.Module, need: Tensor, *, chunk: int,
                   max_counted: int | None, target_ids: Tensor | None, alpha: bool) -> _Labels:
    """The batch's _Labels, at the positions s with `need` (B, T) = loss_mask[s+1]: only those can ever be counted
    (as t+k+1 of some step), so the full-vocab product runs there only.

    The soft labels of every step are rows of these same positions: when their draft-vocab logits fit in
    LABEL_TABLE_BYTES they are taken from the full-vocab product here, once per position, instead of a second
    product per step (K x V_draft more multiply-adds per position). Given target_ids (the same argmax, kept from an
    earlier epoch) only the draft-vocab columns are multiplied. With alpha, also log m_s from the same product."""
    B, T = need.shape
    dev, token_ids = need.device, drafter.token_ids
    known = target_ids is not None and not alpha
    lmass = torch.zeros(B * T, dtype=torch.float32, device=dev) if alpha else None      # (B*T,) log m_s
    tgt_id = target_ids.reshape(B * T).long() if known else torch.zeros(B * T, dtype=torch.long, device=dev)
    at, _ = _select(need, max_counted)                                                 # (N,) (extra ones: not read)
    rows = final.reshape(B * T, -1)[at]                                                # (N, h_t)
    N, Vd = rows.shape[0], token_ids.numel()
    itemsize = (torch.get_autocast_dtype(dev.type).itemsize if torch.is_autocast_enabled(dev.type)
                else lm_head_weight.element_size())
    keep, table = N * Vd * itemsize <= LABEL_TABLE_BYTES, None
    w_draft = lm_head_weight[token_ids]                                                # (Vd, h_t)
    for i in range(0, N if keep or not known else 0, chunk):
        if known:
            zd = target_logits_from_final(rows[i:i + chunk], w_draft)                  # (c, Vd)
        else:
            z = target_logits_from_final(rows[i:i + chunk], lm_head_weight)            # (c, V)
            tgt_id[at[i:i + chunk]] = first_argmax(z)
            if lmass is not None:
                lmass[at[i:i + chunk]] = log_draft_mass(z, token_ids)
            if not keep:
                continue
            zd = z[:, token_ids]                                                       # (c, Vd)
        table = zd.new_empty(N, Vd) if table is None else table                       # (N, Vd) target draft logits
        table[i:i + chunk] = zd
    row_of = torch.zeros(B * T, dtype=torch.long, device=dev)                          # (B*T,) position -> table row
    row_of[at] = torch.arange(N, device=dev)
    tgt_id = tgt_id.view(B, T)                                                         # (B, T)
    return _Labels(tgt_id=tgt_id, in_draft=drafter.t2d[tgt_id],
                   tgt_draft=torch.searchsorted(token_ids, tgt_id).clamp(max=Vd - 1),  # (B, T)
                   table=table, row_of=row_of, w_draft=w_draft, lmass=lmass)


def _step_loss(drafter: nn.Module, cfg: TTTConfig, x: Tensor, f: Tensor, f_w: Tensor | None, weight: Tensor | None,
               lm: Tensor | None, count: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """One step's loss, summed over its rows x (N_k, h) (row weights `weight`, None: all 1) against the labels
    (f, f_w) of _Labels.step; the drafter's argmax (N_k,); the alpha sum (detached; None without lm, the plain CE)."""
    chunk = cfg.chunk_size or 4096
    if lm is None:
        loss, pred = fused_soft_ce(x, drafter.lm_head.weight, f, f_w, chunk=chunk, weight=weight)
        return loss, pred, None
    grads = {"ce": ("ce",), "lk_alpha": ("nla",), "lk_lambda": ("ce", "alpha")}[cfg.loss]
    ce, a, nla, pred = fused_lk_terms(x, drafter.lm_head.weight, f, f_w, lm, grads=grads, chunk=chunk, weight=weight)
    if cfg.loss == "lk_lambda":  # sums over the step's positions: w CE_n + (1 - w)(1 - alpha_n)
        lam = torch.exp(-cfg.lk_eta * a.detach() / count.clamp(min=1))                  # () the CE's weight
        loss = lam * ce + (1 - lam) * (count - a)
    else:
        loss = nla if cfg.loss == "lk_alpha" else ce
    return loss, pred, a.detach()


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
    lay = layout("ttt", input_ids, loss_mask, valid, aux, final, segment_ids, position_ids)
    B, T = input_ids.shape
    K, dev, seg = cfg.num_steps, input_ids.device, lay.seg
    attention = _attention(cfg, drafter, input_ids)
    labels = _target_labels(final, lm_head_weight, drafter, _shift(lay.lmask, 1), chunk=cfg.chunk_size or 4096,
                            max_counted=max_counted, target_ids=target_ids, alpha=alpha or cfg.loss != "ce")
    with torch.no_grad():
        embeds = embed(input_ids) if isinstance(embed, nn.Module) else F.embedding(input_ids, embed)  # (B, T, h)
        blocks = StepBlocks(dense_masks(seg, 1)) if attention == "blocks" else None  # step 0's (B, T, T) block
        full_mask = dense_masks(seg, K) if attention == "dense" else None           # (B, T, K*T)

    hidden = drafter.fuse(aux)                                                     # (B, T, h) = g
    cache, total, alphas = None, 0.0, []
    tally = StepTally((B, T), dev)
    for k in range(K):
        emb_k = _shift(embeds, k + 1)                                              # (B, T, h) embed(x_{t+k+1})
        mask_k = (flex_mask(seg, k) if attention == "flex" else blocks if attention == "blocks"
                  else full_mask[:, :, : (k + 1) * T])                             # (B, T, (k+1)T)
        out, cache = drafter.layer(hidden, emb_k, lay.positions + k, mask_k, cache)
        # counted: x_t .. x_{t+k+2} valid and in one sample, loss on x_{t+k+2}, target in the draft vocab
        span = ((seg > 0) & (seg == _shift(seg, k + 2)) & (lay.holes == _shift(lay.holes, k + 2))
                & _shift(lay.lmask, k + 2))                                        # (B, T) drafted in decoding
        m = span & _shift(labels.in_draft, k + 1)                                  # (B, T) counted (loss, acc_k)
        at, wt = _select(m, max_counted)                                           # (N_k,), weights (N_k,) or None
        f_k, w_k = labels.step(final, k, at)
        x_k, count = drafter.norm(out.reshape(B * T, -1)[at]), m.sum()             # (N_k, h)
        ls, pr, a = _step_loss(drafter, cfg, x_k, f_k, w_k, wt, labels.log_mass(k, at), count)
        if a is not None:
            alphas.append(a)
        pred = torch.full((B * T,), -1, dtype=torch.long, device=dev)              # (B*T,)
        pred[at] = pr                                     # extra (weight 0) entries land where m is False
        pred = pred.view(B, T)                                                     # (B, T): read only where m
        loss_k = ls / count.clamp(min=1) if cfg.reduction == "mean" else ls
        total = total + cfg.decay ** k * loss_k
        tally.add(loss_k, count, (pred == _shift(labels.tgt_draft, k + 1)) & m, span)
        hidden = out
    return tally.output(total, tally.accept, target_ids=labels.tgt_id,
                        alpha_k=torch.stack(alphas) if alphas else None)
