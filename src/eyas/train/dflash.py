"""The DFlash training loss: blocks at sampled anchors, one parallel forward, a position-decayed cross-entropy.

Alignment (docs/dflash.md), for an anchor a in a sample of a row:
  block slot k (k = 0..B-1)  token x_a at k = 0, the mask token after; RoPE position pos(a) + k
  attends to                 the context vectors of positions j < a of the same sample, and the whole block
  label of slot k >= 1       x_{a+k}: the target's law there, softmax(lm_head(final_{a+k-1})) ('soft'), or the token
                             itself ('hard'); the anchor slot carries no loss (decoding gives it: the bonus token)
  counted iff                a+k in the same sample, valid from a to a+k, loss_mask[a+k], the anchor real
  weight                     exp(-(k-1) / gamma): early slots decide how much of a block is accepted
Anchors: `anchors` per row, drawn uniformly without replacement among the positions a with loss_mask[a+1] in the
same sample (a decoding round can start there), sorted; at evaluation every such position is an anchor (in groups
of `anchors`), so accept_len replays decoding at every round start (train/metrics.round_counts).
Metrics map onto ttt.TTTOutput with K = B-1 steps: step k-1 is block slot k; "correct" is the drafter's argmax equal
to the target's (greedy acceptance), whatever the labels; accept_len[t] is the leading correct slots of the block
anchored at t+1 (the round that starts with features up to t, as ttt's accept_len).
The attention is a dense bool mask (SDPA; the CPU and the reference) or a flex BlockMask (CUDA) that computes only
each block's context prefix and its own block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.errors import EyasError
from eyas.train.soft_ce import fused_soft_ce
from eyas.train.ttt import Layout, StepTally, TTTOutput, first_argmax, layout

LABELS = ("soft", "hard")


def default_gamma(block_size: int) -> float:
    """The DFlash paper's decay: 7 for blocks of 16 and longer, 4 for shorter ones."""
    return 7.0 if block_size >= 16 else 4.0


@dataclass(frozen=True, kw_only=True)
class BlockLossConfig:
    anchors: int = 512
    """Anchors (blocks) per row in training; evaluation anchors every eligible position, this many per forward."""
    gamma: float | None = None
    """Loss weight of slot k is exp(-(k-1)/gamma) (None: default_gamma of the block)."""
    labels: str = "soft"
    """'soft' (the target's law from its final state) or 'hard' (the data's next token)."""
    chunk_size: int | None = None
    """Rows per chunk of the fused LM head + cross-entropy (None: 4096)."""
    attention: str = "auto"
    """'dense' (explicit mask, SDPA), 'flex' (BlockMask; CUDA) or 'auto' (flex on CUDA with head_dim >= 16)."""

    def __post_init__(self):
        if self.anchors < 1:
            raise EyasError(f"dflash: anchors must be >= 1, got {self.anchors}")
        if self.gamma is not None and not self.gamma > 0:
            raise EyasError(f"dflash: gamma must be > 0, got {self.gamma}")
        if self.labels not in LABELS:
            raise EyasError(f"dflash: labels must be soft or hard, got {self.labels!r}")
        if self.attention not in ("auto", "dense", "flex"):
            raise EyasError(f"dflash: attention must be auto, dense or flex, got {self.attention!r}")


def _at(x: Tensor, idx: Tensor) -> Tensor:
    """x (B, T, ...) gathered at idx (B, ...) of positions -> (B, ..., ...)."""
    B = x.shape[0]
    flat = idx.reshape(B, -1)                                                      # (B, M)
    if x.dim() == 2:
        return x.gather(1, flat).view(idx.shape)
    out = x.gather(1, flat[..., None].expand(-1, -1, x.shape[-1]))                 # (B, M, d)
    return out.view(*idx.shape, x.shape[-1])


def candidates(lmask: Tensor, seg: Tensor) -> Tensor:
    """(B, T) bool: positions a where a decoding round can start, loss_mask[a+1] in a's sample."""
    nxt = torch.zeros_like(lmask)
    nxt[:, :-1] = lmask[:, 1:] & (seg[:, 1:] == seg[:, :-1])
    return nxt & (seg > 0)


def sample_anchors(cand: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """n anchors per row drawn without replacement among cand (B, T), ascending -> (positions (B, n), real (B, n)).
    A row with fewer candidates fills up with non-candidates, real False. Draws from torch's global RNG on the
    device (seeded by the trainer, saved in its checkpoints); no host sync."""
    B, T = cand.shape
    n = min(n, T)
    score = torch.rand(B, T, device=cand.device) + cand.float()                    # candidates above the rest
    pos = score.topk(n, dim=1).indices.sort(dim=1).values                          # (B, n)
    return pos, cand.gather(1, pos)


def block_mask_dense(anchors: Tensor, seg: Tensor, B: int) -> Tensor:
    """(R, N*B, T + N*B) bool: slot queries of block n see context j < anchor_n of the anchor's sample, and block n."""
    R, N = anchors.shape
    T = seg.shape[1]
    j = torch.arange(T, device=seg.device)
    a_seg = seg.gather(1, anchors)                                                 # (R, N)
    ctx = (j[None, None] < anchors[..., None]) & (seg[:, None, :] == a_seg[..., None])  # (R, N, T)
    own = torch.eye(N, dtype=torch.bool, device=seg.device)                        # (N, N)
    blk = own[:, :, None].expand(N, N, B).reshape(N, N * B)                        # (N, N*B)
    m = torch.cat([ctx, blk.expand(R, N, N * B)], dim=-1)                          # (R, N, T + N*B)
    return m[:, :, None].expand(R, N, B, T + N * B).reshape(R, N * B, T + N * B)


def block_mask_flex(anchors: Tensor, seg: Tensor, B: int):
    """block_mask_dense as a flex BlockMask: only each block's context prefix and its own block are computed."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, N = anchors.shape
    T = seg.shape[1]
    a_seg = seg.gather(1, anchors)                                                 # (R, N)

    def rule(b, h, q, kv):
        n = q // B
        ctx = (kv < anchors[b, n]) & (seg[b, kv.clamp(max=T - 1)] == a_seg[b, n])
        return ctx | ((kv >= T) & ((kv - T) // B == n))
    return create_block_mask(rule, R, None, N * B, T + N * B, device=seg.device, _compile=seg.is_cuda)


def block_hidden(drafter: nn.Module, *, input_ids: Tensor, aux: Tensor, embed: Tensor, anchors: Tensor,
                 seg: Tensor, positions: Tensor, flex: bool) -> Tensor:
    """The drafter's output states (R, N, B, h) of the blocks [x_a, MASK x (B-1)] at the anchors (R, N), each at
    positions pos(a)..pos(a)+B-1 over the context of its sample before a: what a decoding round computes for the
    block after the committed tokens x_0..x_a (decode/dflash.py)."""
    R, N = anchors.shape
    B = drafter.config.block_size
    with torch.no_grad():
        k = torch.arange(B, device=anchors.device)                                 # (B,)
        ids = torch.full((R, N, B), drafter.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = input_ids.gather(1, anchors)                                 # (R, N, B) [x_a, MASK, ...]
        block_pos = (positions.gather(1, anchors)[..., None] + k).reshape(R, N * B)  # (R, N*B)
        mask = (block_mask_flex if flex else block_mask_dense)(anchors, seg, B)
    ctx = drafter.context_input(aux, positions)                                    # each layer makes its k, v
    hidden = drafter(drafter.embed_block(ids.reshape(R, N * B), embed), block_pos, ctx, mask)  # (R, N*B, h)
    return hidden.view(R, N, B, -1)


@torch.no_grad()
def counted_slots(lay: Layout, anchors: Tensor, real: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """(label positions (R, N, B) = anchor + slot, counted (R, N, B) bool): slot k of the block at a real anchor a
    counts iff a+k lies in a's sample with nothing invalid in between and loss_mask[a+k]; the anchor slot never."""
    T = lay.seg.shape[1]
    lab = anchors[..., None] + torch.arange(B, device=anchors.device)                  # (R, N, B) label positions
    labc = lab.clamp(max=T - 1)                                                        # (R, N, B)
    a_seg, a_holes = lay.seg.gather(1, anchors), lay.holes.gather(1, anchors)          # (R, N)
    counted = ((lab < T) & real[..., None] & (_at(lay.seg, labc) == a_seg[..., None])
               & (_at(lay.holes, labc) == a_holes[..., None]) & _at(lay.lmask, labc))  # (R, N, B)
    counted[..., 0] = False                                                            # the anchor slot: no loss
    return lab, counted


def slot_loss(x: Tensor, prev: Tensor, lm_head_weight: Tensor, *, labels: str, tokens: Tensor | None, weight: Tensor,
              chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """One block slot's summed cross-entropy over its rows x (M, h) (row weights `weight`), the drafter's argmax and
    the target's, both (M,). prev (M, h_t): the target's final state before each label; labels 'soft' learns its
    law there, 'hard' the data's tokens (M,)."""
    if labels == "soft":  # the target's argmax comes with its soft labels (the same logits)
        return fused_soft_ce(x, lm_head_weight, prev, lm_head_weight, chunk=chunk, weight=weight, targets=True)
    loss, pred = fused_soft_ce(x, lm_head_weight, tokens, None, chunk=chunk, weight=weight)
    with torch.no_grad():  # the target's argmax, in row chunks: (M, V) logits never exist at once
        tgt = torch.cat([first_argmax(F.linear(prev[i:i + chunk].to(lm_head_weight.dtype), lm_head_weight))
                         for i in range(0, prev.shape[0], chunk)])                     # (M,)
    return loss, pred, tgt


def dflash_forward(drafter: nn.Module, *, input_ids: Tensor, loss_mask: Tensor, valid: Tensor, aux: Tensor,
                   final: Tensor, embed: Tensor, lm_head_weight: Tensor, cfg: BlockLossConfig,
                   anchors: Tensor, real: Tensor, segment_ids: Tensor | None = None,
                   position_ids: Tensor | None = None) -> TTTOutput:
    """The DFlash loss and metrics of one batch at the given anchors (R, N) (real (R, N) False: ignored).

    input_ids, loss_mask, valid (R, T); aux (R, T, K*h_t); final (R, T, h_t); embed (V, h) and lm_head_weight (V, h_t)
    the target's, frozen; segment_ids / position_ids for packed rows as ttt_forward takes them."""
    lay = layout("dflash", input_ids, loss_mask, valid, aux, final, segment_ids, position_ids)
    R, T = input_ids.shape
    dc, dev = drafter.config, input_ids.device
    B, N, h_t = dc.block_size, anchors.shape[1], final.shape[-1]
    gamma = cfg.gamma or default_gamma(B)
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and input_ids.is_cuda and dc.head_dim >= 16)
    lab, counted = counted_slots(lay, anchors, real, B)                                # (R, N, B) each
    hidden = block_hidden(drafter, input_ids=input_ids, aux=aux, embed=embed, anchors=anchors, seg=lay.seg,
                          positions=lay.positions, flex=use_flex)                      # (R, N, B, h)

    total = torch.zeros((), device=dev)
    tally = StepTally((R, N), dev)
    for s in range(1, B):
        m = counted[..., s].reshape(-1)                                            # (R*N,)
        x = hidden[:, :, s].reshape(R * N, -1)                                     # (R*N, h)
        prev = _at(final, (lab[..., s] - 1).clamp(max=T - 1)).reshape(R * N, h_t)  # (R*N, h_t) final_{a+s-1}
        tokens = (_at(input_ids, lab[..., s].clamp(max=T - 1)).reshape(-1) if cfg.labels == "hard"
                  else None)                                                       # (R*N,) x_{a+s}
        ls, pred, tgt = slot_loss(x, prev, lm_head_weight, labels=cfg.labels, tokens=tokens, weight=m.float(),
                                  chunk=cfg.chunk_size or 4096)
        count = m.sum()
        loss_s = ls / count.clamp(min=1)
        total = total + math.exp(-(s - 1) / gamma) * loss_s
        tally.add(loss_s, count, ((pred == tgt) & m).view(R, N), m.view(R, N))
    accept_len = torch.zeros(R, T, dtype=torch.long, device=dev)                   # at t = a - 1
    ok = real & (anchors > 0)
    accept_len.scatter_(1, (anchors - 1).clamp(min=0), torch.where(ok, tally.accept, 0))
    return tally.output(total, accept_len)


def merge(outs: list[TTTOutput]) -> TTTOutput:
    """One TTTOutput of several forwards over the same rows at disjoint anchors (mean losses re-weighted by count)."""
    counts = torch.stack([o.count_k for o in outs])                                # (n, K)
    loss_k = (torch.stack([o.loss_k for o in outs]) * counts).sum(0) / counts.sum(0).clamp(min=1)
    return TTTOutput(loss=sum(o.loss.detach() for o in outs) / len(outs), loss_k=loss_k, count_k=counts.sum(0),
                     correct_k=sum(o.correct_k for o in outs), cond_count_k=sum(o.cond_count_k for o in outs),
                     cond_correct_k=sum(o.cond_correct_k for o in outs),
                     accept_len=sum(o.accept_len for o in outs))


class DFlashModule(nn.Module):
    """The DFlash drafter plus its loss behind one forward() with TTTModule's signature and outputs (train/trainer.py
    calls either the same way): sampled anchors in training, every eligible position in eval mode."""

    def __init__(self, drafter: nn.Module, loss: BlockLossConfig):
        super().__init__()
        self.drafter, self.loss = drafter, loss

    def forward(self, input_ids, loss_mask, valid, aux, final, embed_weight, lm_head_weight, segment_ids=None,
                position_ids=None, max_counted=None, target_ids=None, alpha=False):
        valid = valid.bool()
        seg = valid.long() if segment_ids is None else torch.where(valid, segment_ids, 0)
        cand = candidates(loss_mask.bool() & valid, seg)                           # (R, T)
        kw = dict(input_ids=input_ids, loss_mask=loss_mask, valid=valid, aux=aux, final=final, embed=embed_weight,
                  lm_head_weight=lm_head_weight, cfg=self.loss, segment_ids=segment_ids, position_ids=position_ids)
        if self.training:
            anchors, real = sample_anchors(cand, self.loss.anchors)
            o = dflash_forward(self.drafter, anchors=anchors, real=real, **kw)
        else:  # every candidate, `anchors` at a time per row (a host sync: evaluation only)
            n_max, n = max(1, int(cand.sum(1).max())), min(self.loss.anchors, cand.shape[1])
            order = torch.sort((~cand).to(torch.uint8), dim=1, stable=True).indices  # (R, T) candidates first
            order = torch.cat([order, order.new_zeros(order.shape[0], n)], dim=1)   # (R, T+n) padding: position 0
            outs = []
            for i in range(0, n_max, n):  # always n anchors: one shape for the compiled layers
                anchors = order[:, i:i + n]                                         # (R, n)
                real = cand.gather(1, anchors) & (torch.arange(i, i + n, device=cand.device) < cand.shape[1])
                outs.append(dflash_forward(self.drafter, anchors=anchors, real=real, **kw))
            o = merge(outs)
        return (o.loss, o.loss_k, o.count_k, o.correct_k, o.cond_count_k, o.cond_correct_k, o.accept_len, None)
