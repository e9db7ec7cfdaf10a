"""The EAGLE-3 drafter at decode time: its own KV cache, chains and EAGLE-2 dynamic trees.

Drafter entry t pairs the fused target feature g_t = fc(aux_t) with the token x_{t+1} and sits at
RoPE position t; its output predicts x_{t+2}. After a verify round the target's aux states of the
accepted positions (captured in that same verify forward) become new entries; draft-only entries
are dropped. Draft step k from the last entry p runs at position p+k on the previous step's output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.target.sampling import probs
from eyas.decode.tree import Draft, chain, select_tree


class EagleDrafting:
    def __init__(self, drafter, embed):
        self.drafter = drafter
        self.embed = embed  # the frozen target embedding (nn.Embedding)
        self.keys = self.values = None  # committed drafter cache (1, kv, n, hd)
        self.last = None  # output (1,1,h) of the last committed entry
        self.n = 0  # committed entries: positions 0..n-1

    def reset(self) -> None:
        self.keys = self.values = self.last = None
        self.n = 0

    @torch.no_grad()
    def extend(self, aux: Tensor, next_tokens: Tensor) -> None:
        """Append entries for positions n..n+S-1: aux (1,S,3h_t) target features, next_tokens (1,S)."""
        d = self.drafter
        S = aux.shape[1]
        g = d.fuse(aux)  # (1,S,h)
        emb = self.embed(next_tokens)  # (1,S,h)
        pos = torch.arange(self.n, self.n + S, device=aux.device)[None]  # (1,S)
        mask = torch.ones(1, S, self.n + S, dtype=torch.bool, device=aux.device)
        mask[0, :, self.n:] = torch.ones(S, S, dtype=torch.bool, device=aux.device).tril()
        cache = None if self.keys is None else (self.keys, self.values)
        out, (self.keys, self.values) = d.layer(g, emb, pos, mask, cache)
        self.last = out[:, -1:]
        self.n += S

    def _draft_logits(self, hidden: Tensor) -> Tensor:
        return self.drafter.logits(hidden).float()  # (1,S,Vd)

    def _to_target(self, draft_ids: Tensor) -> Tensor:
        return self.drafter.draft_to_target(draft_ids)

    @torch.no_grad()
    def propose_chain(self, root: int, K: int, temperature: float, top_p: float, gen, vocab: int) -> Draft:
        """K tokens, each fed back: argmax at temperature 0, else sampled from the draft law q."""
        d, dev = self.drafter, self.last.device
        hidden, k, v = self.last, self.keys, self.values
        toks, qs = [], []
        for step in range(K):
            lg = self._draft_logits(hidden)[0, -1]  # (Vd,)
            if temperature == 0:
                tok = int(self._to_target(lg.argmax()))
                qs.append(None)
            else:
                qd = probs(lg, temperature, top_p)
                i = torch.multinomial(qd, 1, generator=gen)[0]
                tok = int(self._to_target(i))
                q = torch.zeros(vocab, device=dev)
                q[self._to_target(torch.arange(qd.numel(), device=dev))] = qd
                qs.append(q)
            toks.append(tok)
            if step + 1 == K:
                break
            L = k.shape[2]
            mask = torch.ones(1, 1, L + 1, dtype=torch.bool, device=dev)
            pos = torch.tensor([[self.n + step]], device=dev)  # entry n-1 + (step+1)
            hidden, (k, v) = d.layer(hidden, self.embed(torch.tensor([[tok]], device=dev)), pos, mask, (k, v))
        return chain(root, toks, qs if temperature > 0 else None)

    @torch.no_grad()
    def propose_tree(self, root: int, top_k: int, depth: int, total: int) -> Draft:
        """EAGLE-2 dynamic tree: expand the top_k best nodes of each level, keep `total` by cumulative
        draft log-prob. Children are top-k (deterministic), so verification uses the point-mass rule."""
        d, dev = self.drafter, self.last.device
        lp = torch.log_softmax(self._draft_logits(self.last)[0, -1], -1)  # (Vd,)
        s, i = lp.topk(min(top_k, lp.numel()))
        toks = self._to_target(i).tolist()
        scores, parents, depths = s.tolist(), [-1] * len(toks), [1] * len(toks)
        frontier = list(range(len(toks)))  # pool indices of the nodes to expand
        hidden = self.last.expand(1, len(frontier), -1)  # (1,F,h) input hidden of each frontier node
        k, v = self.keys, self.values
        n = self.n
        anc_cols: dict[int, list[int]] = {-1: []}
        for level in range(2, depth + 1):
            F_ = len(frontier)
            L = k.shape[2]
            mask = torch.zeros(1, F_, L + F_, dtype=torch.bool)  # built on the CPU, one copy
            mask[0, :, :n] = True
            for r, node in enumerate(frontier):
                cols = anc_cols[parents[node]] + [L + r]
                anc_cols[node] = cols
                mask[0, r, cols] = True
            mask = mask.to(dev, non_blocking=True)
            emb = self.embed(torch.tensor([[toks[j] for j in frontier]], device=dev))  # (1,F,h)
            pos = torch.full((1, F_), n - 1 + level - 1, device=dev)
            out, (k, v) = d.layer(hidden, emb, pos, mask, (k, v))  # (1,F,h)
            lp = torch.log_softmax(self._draft_logits(out)[0], -1)  # (F,Vd)
            cs, ci = lp.topk(min(top_k, lp.shape[-1]), dim=-1)  # (F,k)
            cum = cs + torch.tensor([scores[j] for j in frontier], device=dev)[:, None]  # (F,k)
            base = len(toks)
            ctoks = self._to_target(ci).flatten().tolist()
            kk = ci.shape[1]
            toks += ctoks
            scores += cum.flatten().tolist()
            parents += [frontier[r // kk] for r in range(F_ * kk)]
            depths += [level] * (F_ * kk)
            best = cum.flatten().topk(min(top_k, F_ * kk)).indices.tolist()
            frontier = [base + b for b in best]
            hidden = out[:, [b // kk for b in best]]  # (1,F,h) parent outputs of the new frontier
        keep, tparents = select_tree(toks, parents, scores, depths, total)
        return Draft([root] + [toks[j] for j in keep], [-1] + tparents)

    def rollback(self) -> None:
        """Drop any cache entries beyond the committed ones (draft-only keys)."""
        if self.keys is not None and self.keys.shape[2] > self.n:
            self.keys, self.values = self.keys[:, :, :self.n], self.values[:, :, :self.n]
