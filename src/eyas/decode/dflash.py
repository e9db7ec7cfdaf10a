"""The DFlash block drafter at decode time: a static context cache and one block forward per round.

After the prefill of n tokens the context is the target's aux states of positions 0..n-1 (what the verify step
captures for EAGLE-3); the pending token (bonus) x_n sits at position n. A round's block is
[bonus, MASK x (B-1)] at positions n..n+B-1: it attends every context entry and the whole block (bidirectional),
and the drafts are the target's LM head argmax (or a draw, when sampling) at slots 1..B-1, so one forward proposes
up to B-1 tokens. After verification the aux states of the root and the accepted drafts (accepted+1 entries) are
appended. Only the context's keys and values are cached, per drafter layer, in static buffers of `slots` entries;
the block's own keys are never cached, so a rejected draft leaves nothing to roll back.

With `graphs` the block forward (and its argmax) and the extends of up to B entries replay as CUDA graphs (plain
calls off CUDA): they read the committed count from a device tensor and attend the whole buffer under a mask, so
their shapes do not depend on it. Without, the block attends exactly the committed entries (mask None).
The same fixed-shape bodies serve round.py's one-graph greedy round, through `root`, `draft_chain` and `commit`
(DraftCache's names): the round writes its bonus into the block's slot 0, drafts, verifies and appends the verified
entries without the host.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eyas.decode.common import SpecConfig
from eyas.decode.tree import Draft, chain
from eyas.errors import EyasError
from eyas.target.graphs import capture
from eyas.target.sampling import probs


def is_dflash(drafter) -> bool:
    """Whether `drafter` is a DFlash block drafter (model/dflash.py) rather than an EAGLE-3 one."""
    return getattr(drafter, "kind", None) == "dflash"


def block_drafts(drafter) -> int:
    """Most drafts one DFlash round proposes: B-1 (slot 0 of the block is the bonus token)."""
    return drafter.config.block_size - 1


def check_spec(cfg: SpecConfig, drafter) -> None:
    """Refuse what a DFlash drafter cannot do with a one-line error: trees, k > B-1."""
    B = drafter.config.block_size
    if cfg.method == "tree":
        raise EyasError(f"a DFlash drafter proposes one block (a chain), not a tree: use method 'chain' "
                        f"(k up to {B - 1})")
    if cfg.method == "chain" and cfg.k > B - 1:
        raise EyasError(f"chain length k={cfg.k} exceeds this DFlash drafter's block: block size {B} proposes at "
                        f"most B-1 = {B - 1} drafts")


class DFlashDrafting:
    """EagleDrafting's interface (reset, extend, propose_chain, rollback) for a DFlash drafter, batch 1, and the
    steps of round.py's one-graph round (root, draft_chain, commit) that DraftCache also has."""

    def __init__(self, drafter, embed, lm_head, *, slots: int, graphs: bool = False, k: int | None = None):
        """embed: the target's embedding (nn.Embedding or its weight); lm_head: the target's head; slots: context
        entries kept (the runner's max_seq); graphs: replay the block and short extends as CUDA graphs; k: the drafts
        `draft_chain` returns (default B-1)."""
        self.d, self.lm_head, self.M, self.graphs = drafter, lm_head, slots, graphs
        self.embed_weight = embed.weight if isinstance(embed, nn.Module) else embed
        cfg = drafter.config
        self.B = cfg.block_size
        p = next(drafter.parameters())
        dev, dt = p.device, p.dtype
        shape = (1, cfg.num_key_value_heads, slots, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_hidden_layers)]
        self.count = 0  # committed entries (host copy): positions 0..count-1
        self.n = torch.zeros(1, dtype=torch.long, device=dev)  # the same count on the device, read by the graphs
        self.ids = torch.full((1, self.B), cfg.mask_token_id, dtype=torch.long, device=dev)  # [bonus, MASK..]
        self.cols = torch.arange(slots, device=dev)  # entry indices; also the offsets of new positions from n
        self.root = self.ids[0, :1]  # (1,) a view of the block's slot 0: the pending token a round writes
        self.k = self.B - 1 if k is None else k
        if not 1 <= self.k <= self.B - 1:
            raise EyasError(f"DFlash drafts per round k={self.k}: between 1 and B-1 = {self.B - 1}")
        self._graphs: dict = {}

    # ------------------------------------------------------------------ the bodies
    def _write(self, aux: Tensor) -> None:
        """Context keys and values of aux (1,S,K*h_t) at positions n..n+S-1, written into every layer's buffer."""
        pos = self.n[:, None] + self.cols[:aux.shape[1]]  # (1,S)
        for (k, v), kb, vb in zip(self.d.context_kv(aux, pos), self.keys, self.values):  # (1,nkv,S,hd) each
            kb.index_copy_(2, pos[0], k)
            vb.index_copy_(2, pos[0], v)

    def _block(self, width: int | None = None) -> tuple[Tensor, Tensor]:
        """The block [ids] at positions n..n+B-1 over the context -> (logits (B-1,V) fp32 of slots 1..B-1, their
        argmax (B-1,)). width None: the whole buffer under a mask (fixed shapes); else its first `width` entries,
        all committed (mask None)."""
        B = self.B
        pos = self.n[:, None] + self.cols[:B]  # (1,B)
        emb = self.d.embed_block(self.ids, self.embed_weight)  # (1,B,h)
        if width is None:
            old = (self.cols < self.n)[None, None].expand(1, B, self.M)  # (1,B,M) committed entries
            mask = torch.cat([old, torch.ones(1, B, B, dtype=torch.bool, device=pos.device)], -1)  # (1,B,M+B)
            ctx = list(zip(self.keys, self.values))
        else:
            mask, ctx = None, [(k[:, :, :width], v[:, :, :width]) for k, v in zip(self.keys, self.values)]
        h = self.d(emb, pos, ctx, mask)  # (1,B,h)
        logits = self.lm_head(h[0, 1:]).float()  # (B-1,V)
        return logits, logits.argmax(-1)

    # ------------------------------------------------------------------ the one-graph round's steps (round.py)
    def draft_chain(self) -> Tensor:
        """(1,k) greedy drafts after the pending token in `root`, on fixed shapes (no host sync)."""
        return self._block()[1][None, :self.k]

    def commit(self, aux: Tensor, tokens: Tensor, acc: Tensor) -> None:
        """A round's entries: aux (1,k+1,K*h_t) the verify's features of [root, drafts] at positions n..n+k, acc (1,)
        the accepted drafts; entries n..n+acc count, the rest lie past the new n (masked, overwritten next round).
        tokens (DraftCache's pairing) is not needed: a DFlash context entry is the feature alone."""
        self._write(aux)
        self.n += acc + 1

    # ------------------------------------------------------------------ calls
    @torch.no_grad()
    def block(self, root: int) -> tuple[Tensor, Tensor]:
        """The block after the pending `root` token: (logits (B-1,V), argmax (B-1,)); graph output buffers with
        `graphs` (the next call overwrites them)."""
        self.root.fill_(int(root))
        if not self.graphs:
            return self._block(self.count)
        if "block" not in self._graphs:
            self._graphs["block"] = capture(self._block, cuda=self.n.is_cuda)
        return self._graphs["block"]()

    @torch.no_grad()
    def extend(self, aux: Tensor, next_tokens: Tensor | None = None) -> None:
        """Append the context entries of aux (1,S,K*h_t), the target's features of positions count..count+S-1.
        next_tokens (EagleDrafting's pairing) is not needed: a DFlash context entry is the feature alone."""
        S = aux.shape[1]
        if self.count + S > self.M:
            raise EyasError(f"DFlash context of {self.count + S} entries exceeds its {self.M} slots")
        if self.graphs and S <= self.B:
            if S not in self._graphs:
                # _write is idempotent for fixed inputs (it writes slots n..n+S-1 from aux): the capture's warm-up
                # calls change nothing the replay does not redo
                buf = aux.clone()
                self._graphs[S] = (capture(self._write, buf, cuda=self.n.is_cuda), buf)
            run, buf = self._graphs[S]
            buf.copy_(aux)
            run()
        else:  # the prompt (any length) runs eagerly
            self._write(aux)
        self.count += S
        self.n += S

    def propose_chain(self, root: int, K: int, temperature: float, top_p: float, gen, vocab: int) -> Draft:
        """K <= B-1 drafts from one block forward: argmax at temperature 0, else each slot's token drawn from its
        own law q_k (the target's head over the drafter's slot k), passed on for lossless rejection sampling."""
        assert 1 <= K <= self.B - 1, (K, self.B)
        logits, greedy = self.block(root)
        if temperature == 0:
            return chain(root, greedy[:K].tolist())
        q = probs(logits[:K], temperature, top_p)  # (K,V)
        assert q.shape[-1] == vocab, (q.shape, vocab)
        toks = torch.multinomial(q, 1, generator=gen)[:, 0]  # (K,) slot k drawn from q_k alone
        return chain(root, toks.tolist(), list(q))

    def reset(self) -> None:
        self.count = 0
        self.n.zero_()

    def rollback(self) -> None:
        pass  # the block's own keys are never cached

    @property
    def graph_keys(self) -> list:
        """What has been captured: "block", and the extend lengths S."""
        return list(self._graphs)
