"""The EAGLE-3 drafter's static KV cache at decode time: one class for batch 1 and batch B, chains and trees.

Row b holds entries 0..n_b-1: entry t pairs fc(aux_t) with the embedding of x_{t+1}, sits in slot t at RoPE
position t and predicts x_{t+2} (EAGLE3.md section 3); `last[b]` is the output of entry n_b-1. Every drafter call
passes a fixed number of cache slots as the past plus a mask over them and writes its new keys at their slots, so
shapes do not depend on n and the calls replay as CUDA graphs. Keys at or past n_b (drafts, rejected entries,
padding) are never attended until they are overwritten. A tree's draft keys go to a scratch region after the live
slots.

- extend: append entries (the prompt's, then each round's accepted positions and the bonus token);
- draft_chain: K greedy draft tokens per row, draft step j at position n_b + j - 1;
- draft_tree: one EAGLE-2 dynamic tree (batch 1), the tree of `eagle.EagleDrafting.propose_tree` in the same node
  order (tree_static.py has the pieces and the tie rule);
- move_rows: batched decoding's compaction.
With `graphs`, extends of up to `graph_max` entries, chains and trees replay as CUDA graphs (plain calls off CUDA);
a one-graph round (round.py) captures the whole round itself and builds its cache without.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.decode.tree import Draft, chain
from eyas.decode import tree_static as ts
from eyas.decode.tree_static import StaticTree, TreeDraft
from eyas.target.compile import raise_recompile_limit
from eyas.target.graphs import capture


def compiled(fn):
    """torch.compile(fn, fullgraph=True) for a cache body. Every cache compiles the same code objects, with guards
    on its sizes: a bench holds several (chains of two lengths, the tree, fp32 reruns)."""
    raise_recompile_limit()
    return torch.compile(fn, fullgraph=True)


class DraftCache:
    def __init__(self, drafter, embed, *, slots: int, rows: int = 1, k: int = 1,
                 tree: tuple[int, int, int] | None = None, graphs: bool = False, compile: bool = False):
        """rows x slots live slots; k: the chain length (SpecConfig.k, kept as chain_len); tree: (top_k, depth,
        total) for EAGLE-2 trees (adds the scratch region). graphs: replay extends of up to k+1 (trees: depth+1)
        entries, chains and trees as CUDA graphs; longer extends (the prompt) run eagerly. compile: torch.compile
        the fixed-shape bodies (not the prompt's extend). The drafter's keys and values are `keys` and `values`."""
        self.d, self.embed, self.chain_len, self.live, self.tree = drafter, embed, k, slots, tree  # embed: the target's
        cfg = drafter.config
        self.sizes: list[int] = []  # a tree's frontier sizes, levels 2..depth
        if tree is not None:
            top_k, depth, total = tree
            if min(top_k, depth, total) < 1:
                raise ValueError(f"tree top_k, depth and total must be >= 1, got {top_k}, {depth}, {total}")
            self.top_k, self.depth, self.total = tree
            self.kk = min(top_k, cfg.draft_vocab_size)
            self.sizes = ts.tree_plan(top_k, depth, cfg.draft_vocab_size)
        self.M = slots + sum(self.sizes)
        p = next(drafter.parameters())
        dev, dt = p.device, p.dtype
        shape = (rows, cfg.num_key_value_heads, self.M, cfg.head_dim)
        self.keys = torch.zeros(shape, device=dev, dtype=dt)     # (rows, kv heads, M, head_dim)
        self.values = torch.zeros(shape, device=dev, dtype=dt)   # (rows, kv heads, M, head_dim)
        self.n = torch.zeros(rows, dtype=torch.long, device=dev)  # committed entries per row
        self.last = torch.zeros(rows, 1, cfg.hidden_size, device=dev, dtype=dt)  # output of entry n_b-1
        self.cols = torch.arange(self.M, device=dev)
        self.root = torch.zeros(1, dtype=torch.long, device=dev)  # a tree's root: the pending token
        if tree is not None:
            offs = [slots + sum(self.sizes[:j]) for j in range(len(self.sizes))]
            self.slots = [torch.arange(o, o + f, device=dev) for o, f in zip(offs, self.sizes)]  # per level
            scratch = torch.arange(slots, self.M, device=dev)
            self.own = [scratch[None] == s[:, None] for s in self.slots]  # (F, scratch): each row's own draft slot
            depths = [torch.ones(self.kk, dtype=torch.long)] + [torch.full((f * self.kk,), level, dtype=torch.long)
                                                                for level, f in enumerate(self.sizes, start=2)]
            self.pool_depths = torch.cat(depths).to(dev)  # (P,)
        self.graphs, self.graph_max = graphs, (k if tree is None else self.depth) + 1
        self._graphs: dict = {}
        self._write_fn = compiled(self._write) if compile else self._write
        self._chain_fn = compiled(self._chain) if compile else self._chain
        self._tree_fn = compiled(self._tree) if compile else self._tree

    # ------------------------------------------------------------------ the bodies (fixed shapes)
    def _layer(self, hidden: Tensor, tokens: Tensor, pos: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """One drafter layer for new entries (B,S) at RoPE positions `pos`, their keys written at `slots` (B,S);
        mask (B,S,W+S) over the first W cache slots, then the new entries."""
        B, S = tokens.shape
        W = mask.shape[-1] - S
        past = (self.keys[:B, :, :W], self.values[:B, :, :W])
        out, (k, v) = self.d.layer(hidden, self.embed(tokens), pos, mask, past)
        if B == 1:  # one index_copy_ along the slots
            self.keys[:1].index_copy_(2, slots[0], k[:, :, W:])
            self.values[:1].index_copy_(2, slots[0], v[:, :, W:])
        else:
            rows = torch.arange(B, device=pos.device)[:, None].expand(B, S)  # (B,S)
            self.keys[rows, :, slots] = k[:, :, W:].transpose(1, 2)  # cache[b, :, slot[b,s]] = k_new[b, :, s]
            self.values[rows, :, slots] = v[:, :, W:].transpose(1, 2)
        return out  # (B,S,h)

    def _write(self, aux: Tensor, tokens: Tensor, count: Tensor | None = None, width: int | None = None) -> Tensor:
        """Entries at slots n_b..n_b+S-1 (aux (B,S,3h_t), tokens (B,S) the token after each); the first count_b
        (default all) are real: `last` becomes entry n_b+count_b-1 (unchanged where count_b = 0). n is not moved."""
        B, S = tokens.shape
        n = self.n[:B]
        W = self.M if width is None else width  # cached slots passed as the past (>= max n)
        pos = n[:, None] + torch.arange(S, device=aux.device)  # (B,S) slot = RoPE position
        old = (self.cols[:W][None, None] < n[:, None, None]).expand(B, S, W)  # (B,S,W) committed slots
        tri = torch.ones(S, S, dtype=torch.bool, device=aux.device).tril()[None].expand(B, S, S)  # (B,S,S)
        out = self._layer(self.d.fuse(aux), tokens, pos, pos, torch.cat([old, tri], -1))  # (B,S,h)
        if count is None:
            self.last[:B].copy_(out[:, -1:])
        else:
            last = out[torch.arange(B, device=aux.device), (count - 1).clamp(min=0)][:, None]  # (B,1,h)
            self.last[:B] = torch.where((count > 0)[:, None, None], last, self.last[:B])
        return out

    def _chain(self, B: int = 1, width: int | None = None) -> Tensor:
        """K greedy draft tokens per row (B,K) target ids; draft keys go to slots n_b..n_b+K-2."""
        d, K = self.d, self.chain_len
        W = self.M if width is None else width  # >= max n + K - 2
        n, hidden = self.n[:B], self.last[:B]  # (B,), (B,1,h)
        toks = []
        for step in range(K):
            # (B,) not 0-d: indexing d2t with a 0-d tensor would call .item() (a sync)
            toks.append(d.draft_to_target(d.logits(hidden)[:, -1].argmax(-1)))  # (B,)
            if step + 1 == K:
                break
            pos = (n + step)[:, None]  # (B,1) entry n_b-1 + (step+1)
            old = (self.cols[:W][None] < pos)[:, None]  # (B,1,W) committed and earlier draft entries
            mask = torch.cat([old, torch.ones(B, 1, 1, dtype=torch.bool, device=pos.device)], -1)  # (B,1,W+1)
            hidden = self._layer(hidden, toks[-1][:, None], pos, pos, mask)
        return torch.stack(toks, 1)  # (B,K)

    def _tree(self) -> StaticTree:
        """The EAGLE-2 tree after `root` from row 0's last entry (tree_static.py: levels, frontier, selection)."""
        d, M, live, kk = self.d, self.M, self.live, self.kk
        n = self.n[:1]
        lp = torch.log_softmax(d.logits(self.last[:1]).float()[0, -1], -1)  # (Vd,)
        score, ids = ts.stable_topk(lp, kk)                                  # (k,) level 1
        tok = d.draft_to_target(ids)                                         # (k,) target ids
        toks, scores, parents = [tok], [score], [torch.full_like(ids, -1)]
        front = torch.arange(kk, device=ids.device)                          # pool indices of the frontier
        hidden = self.last[:1].expand(1, kk, -1)                             # (1,F,h) input of each frontier row
        anc = torch.zeros(kk, M - live, dtype=torch.bool, device=ids.device)  # (F, scratch) ancestors' draft slots
        committed = (self.cols[:live] < n)[None]                             # (1, live)
        base = kk
        for level, (F, slots, own) in enumerate(zip(self.sizes, self.slots, self.own), start=2):
            eye = torch.eye(F, dtype=torch.bool, device=ids.device)
            mask = torch.cat([committed.expand(F, live), anc, eye], -1)[None]  # (1,F,M+F)
            pos = (n + (level - 2)).view(1, 1).expand(1, F)                  # entry n-1 + (level-1)
            out = self._layer(hidden, tok[None], pos, slots[None], mask)     # (1,F,h)
            lp = torch.log_softmax(d.logits(out).float()[0], -1)             # (F,Vd)
            cs, ci = ts.stable_topk(lp, kk)                                  # (F,kk)
            cum = cs + score[:, None]                                        # (F,kk)
            ctok = d.draft_to_target(ci).flatten()                           # (F*kk,)
            toks.append(ctok)
            scores.append(cum.flatten())
            parents.append(front.repeat_interleave(kk))
            if level < self.depth:
                best, rows = ts.frontier(cum, self.sizes[level - 1])         # (F',)
                anc = (anc | own)[rows]                                      # (F', scratch)
                front, tok, score, hidden = base + best, ctok[best], cum.flatten()[best], out[:, rows]
            base += F * kk
        keep, tparents = ts.select(torch.cat(scores), torch.cat(parents), self.total)
        tparents = torch.cat([torch.full_like(self.root, -1), tparents])    # (S,)
        return StaticTree(tokens=torch.cat([self.root, torch.cat(toks)[keep]]), parents=tparents,
                          depths=torch.cat([torch.zeros_like(self.root), self.pool_depths[keep]]),
                          mask=ts.ancestor_mask(tparents, self.depth))

    # ------------------------------------------------------------------ calls (graphed where asked)
    def _graph(self, key, fn, *args):
        """The captured replay of fn(*args) for `key` (args are static buffers the caller refills)."""
        if key not in self._graphs:
            self._graphs[key] = capture(fn, *args, cuda=self.keys.is_cuda)
        return self._graphs[key]

    @torch.no_grad()
    def extend(self, aux: Tensor, tokens: Tensor, count: Tensor | None = None, width: int | None = None) -> None:
        """Append count_b (default all S) entries to row b of rows 0..B-1 and advance n; `_write` has the rest.
        width: the cached slots passed as the past (default all; an eager batched step passes max n)."""
        S = tokens.shape[1]
        if self.graphs and width is None and S <= self.graph_max:
            key = ("extend", *tokens.shape, count is None)
            if key not in self._graphs:
                # _write is idempotent for fixed inputs (it reads slots < n, writes slots >= n and `last`): the
                # capture's warm-up calls change nothing that the replay does not redo
                bufs = (aux.clone(), tokens.clone()) + (() if count is None else (count.clone(),))
                self._graphs[key] = (capture(self._write_fn, *bufs, cuda=self.keys.is_cuda), bufs)
            run, bufs = self._graphs[key]
            for b, x in zip(bufs, (aux, tokens, count)):
                b.copy_(x)
            run()
        else:  # compiled only at a round's fixed sizes: a prompt's length would recompile at decode time
            (self._write_fn if width is None and S <= self.graph_max else self._write)(aux, tokens, count, width)
        self.n[:tokens.shape[0]] += S if count is None else count

    def commit(self, aux: Tensor, tokens: Tensor, acc: Tensor) -> None:
        """A round's entries at n..n+P-1 (batch 1, inside the round's graph): aux (1,P,3h_t) the verify's features
        of the accepted path, tokens (P,) the token after each (the accepted drafts, the bonus at index acc, filler
        past it), acc (1,) accepted drafts. Entries 0..acc count."""
        self._write_fn(aux, tokens[None], acc + 1)
        self.n[:1] += acc + 1

    @torch.no_grad()
    def draft_chain(self, B: int = 1, width: int | None = None) -> Tensor:
        """(B,K) greedy drafts of rows 0..B-1 from their committed entries (the decoder sets n)."""
        if self.graphs and width is None:
            return self._graph(("chain", B), self._chain_fn, B)()
        return self._chain_fn(B, width)

    @torch.no_grad()
    def draft_tree(self, root=None) -> StaticTree:
        """This round's tree after the pending `root` token (int, or a (1,)/0-d tensor; None: `self.root` as it is,
        which a round writes); no host sync. With graphs the tensors are the graph's output buffers: the next call
        overwrites them."""
        if isinstance(root, Tensor):
            self.root.copy_(root.view(1))
        elif root is not None:
            self.root.fill_(int(root))
        if self.graphs:
            return self._graph(("tree",), self._tree_fn)()
        return self._tree_fn()

    @property
    def graph_keys(self) -> list[tuple]:
        """What has been captured: ("extend", B, S, all entries real), ("chain", B), ("tree",)."""
        return list(self._graphs)

    def move_rows(self, keep: Tensor, width: int) -> None:
        """Rows `keep` (1-D) of slots [:width] become rows 0..len(keep)-1."""
        m = keep.numel()
        self.keys[:m, :, :width] = self.keys[keep, :, :width]
        self.values[:m, :, :width] = self.values[keep, :, :width]
        self.last[:m] = self.last[keep]
        self.n[:m] = self.n[keep]

    # ------------------------------------------------------------------ `EagleDrafting`'s interface (SpecDecoder)
    def reset(self) -> None:
        self.n.zero_()

    def rollback(self) -> None:
        pass  # draft entries live at or past n: masked, then overwritten

    def propose_chain(self, root: int, K: int, temperature: float, top_p: float, gen, vocab: int) -> Draft:
        assert temperature == 0 and K == self.chain_len
        return chain(root, self.draft_chain()[0].tolist())

    def propose_tree(self, root: int, top_k: int, depth: int, total: int) -> TreeDraft:
        """The tree as a Draft (one host copy per round)."""
        if (top_k, depth, total) != (self.top_k, self.depth, self.total):
            raise ValueError(f"this drafter was built for tree {self.top_k}/{self.depth}/{self.total}, "
                             f"asked for {top_k}/{depth}/{total}")
        t = self.draft_tree(root)
        return StaticTree(t.tokens, t.parents, t.depths, t.mask.clone()).to_draft()
