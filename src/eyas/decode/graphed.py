"""CUDA-graph fast path for greedy EAGLE-3 chains (same results as eagle.EagleDrafting, fewer launches).

The drafter keeps a STATIC cache of `max_len` slots; `n` (a device tensor) counts committed
entries. Every call uses the contract's `layer(hidden, embeds, positions, mask, kv_cache)` with
the whole static cache as "past" and a mask that hides unused slots, so all shapes are fixed and
the K draft steps (layer, logits, argmax, d2t, embedding) replay as one CUDA graph. The new keys
that `layer` appends are copied into the static cache at slot n+step inside the graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.decode.tree import Draft, chain
from eyas.target.compile import raise_recompile_limit
from eyas.target.graphs import capture


def compiled(fn):
    """torch.compile(fn, fullgraph=True) for a static drafter's body. Every drafter instance compiles the same code
    object, with guards on its K, class and shapes: a bench holds several (chains of two lengths, the tree, fp32
    reruns)."""
    raise_recompile_limit()
    return torch.compile(fn, fullgraph=True)


class GraphedChainDrafting:
    def __init__(self, drafter, embed, max_len: int, K: int, compile: bool = False):
        """compile: torch.compile the fixed-shape bodies (the K draft steps, the extends of 1..K+1 entries), so each
        CUDA graph replays fused kernels instead of the drafter's eager ones. The prompt's extend (once per prompt,
        of its length) stays eager."""
        self.d, self.embed, self.M, self.K = drafter, embed, max_len, K
        cfg = drafter.config
        p = next(drafter.parameters())
        dev, dt = p.device, p.dtype
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=dev, dtype=dt)
        self.v = torch.zeros(shape, device=dev, dtype=dt)
        self.n = torch.zeros((), dtype=torch.long, device=dev)  # committed entries
        self.last = torch.zeros(1, 1, cfg.hidden_size, device=dev, dtype=dt)
        self.cols = torch.arange(max_len, device=dev)
        self._extend: dict[int, tuple] = {}
        self._chain = None
        self._chain_fn = compiled(self._chain_body) if compile else self._chain_body
        self._extend_fn = compiled(self._extend_body) if compile else self._extend_body

    def reset(self) -> None:
        self.n.zero_()

    # ------------------------------------------------------------------ cache updates
    def _extend_body(self, aux: Tensor, next_tokens: Tensor) -> Tensor:
        S = aux.shape[1]
        d = self.d
        g = d.fuse(aux)  # (1,S,h)
        emb = self.embed(next_tokens)  # (1,S,h)
        new = torch.arange(S, device=aux.device)
        pos = (self.n + new)[None]  # (1,S)
        old = (self.cols < self.n)[None, None].expand(1, S, self.M)  # (1,S,M) committed slots
        tri = torch.ones(S, S, dtype=torch.bool, device=aux.device).tril()[None]  # (1,S,S)
        out, (k, v) = d.layer(g, emb, pos, torch.cat([old, tri], -1), (self.k, self.v))
        slots = self.n + new
        self.k.index_copy_(2, slots, k[:, :, self.M:])
        self.v.index_copy_(2, slots, v[:, :, self.M:])
        self.last.copy_(out[:, -1:])
        return out

    @torch.no_grad()
    def extend(self, aux: Tensor, next_tokens: Tensor) -> None:
        """Append S entries (aux (1,S,3h_t), next_tokens (1,S)); graphed for the small S of a round."""
        S = aux.shape[1]
        if S > self.K + 1:  # prefill: once per prompt, eager
            self._extend_body(aux, next_tokens)
        else:
            if S not in self._extend:
                a = torch.zeros_like(aux)
                t = torch.zeros_like(next_tokens)
                self._extend[S] = (capture(self._extend_fn, a, t), a, t)
            run, a, t = self._extend[S]
            a.copy_(aux)
            t.copy_(next_tokens)
            run()
        self.n += S

    def rollback(self) -> None:
        pass  # draft entries live beyond n and are masked / overwritten

    # ------------------------------------------------------------------ drafting
    def _chain_body(self) -> Tensor:
        d, K, M = self.d, self.K, self.M
        hidden = self.last
        toks = []
        for step in range(K):
            # (1,) not a 0-d index: indexing d2t with a 0-d tensor would call .item() (a sync)
            tok = d.draft_to_target(d.logits(hidden)[0, -1].argmax(-1, keepdim=True))  # (1,)
            toks.append(tok)
            if step + 1 == K:
                break
            mask = torch.cat([(self.cols < self.n + step)[None, None],
                              torch.ones(1, 1, 1, dtype=torch.bool, device=hidden.device)], -1)  # (1,1,M+1)
            pos = (self.n + step).view(1, 1)  # entry n-1 + (step+1)
            hidden, (k, v) = d.layer(hidden, self.embed(tok.view(1, 1)), pos, mask, (self.k, self.v))
            slot = (self.n + step).view(1)
            self.k.index_copy_(2, slot, k[:, :, M:])
            self.v.index_copy_(2, slot, v[:, :, M:])
        return torch.cat(toks)  # (K,)

    @torch.no_grad()
    def propose_chain(self, root: int, K: int, temperature: float, top_p: float, gen, vocab: int) -> Draft:
        assert temperature == 0 and K == self.K
        if self._chain is None:
            self._chain = capture(self._chain_fn, cuda=self.k.device.type == "cuda")
        return chain(root, self._chain().tolist())
