"""Lossless speculative decoding at batch 1: EAGLE-3 chains and trees, prompt lookup, one verify path.

Each round: the drafter proposes a tree (a chain is a tree); the target runs the root (pending
token) plus all draft nodes in ONE forward with the tree mask, capturing its aux hidden states;
`verify` accepts the longest matching path and draws the bonus token; accepted cache slots are
compacted; the drafter continues from the aux states of the accepted positions.
"""

from __future__ import annotations

import torch

from eyas.decode.cache import DraftCache
from eyas.decode.common import METHODS, SpecConfig, SpecStats, fit_drafter, prefill  # noqa: F401 (public names)
from eyas.decode.dflash import DFlashDrafting, check_spec, is_dflash
from eyas.decode.eagle import EagleDrafting
from eyas.decode.lookup import lookup
from eyas.decode.round import RoundDecoder
from eyas.decode.tree import Draft, chain, verify
from eyas.errors import EyasError
from eyas.target.sampling import sample

class SpecDecoder:
    """Speculative decoding with a target `Runner` and an optional EAGLE-3 or DFlash drafter (batch 1, cache row 0)."""

    def __init__(self, runner, drafter=None, cfg: SpecConfig = SpecConfig(), *, fast: bool | None = None,
                 verify_capture: tuple[int, ...] | None = None, compile_drafter: bool = False):
        """fast: use the static drafter cache (cache.py), one CUDA graph per call (default: on CUDA), for greedy
        chains and for trees. verify_capture: the aux ids the verify step returns (default: the
        drafter's, none without one); a drafter-less decoder given a drafter's ids shares that decoder's compiled
        verify step (the bench: one compile fewer) and ignores the extra output. compile_drafter: torch.compile the
        static drafter cache's proposers and extends (with graph_round the round's). A DFlash drafter (model/dflash.py)
        drafts chains of k <= B-1 tokens from one block forward (dflash.py), graphed when `fast`, or with graph_round
        whole greedy rounds (round.py); it refuses trees."""
        if cfg.method in ("chain", "tree") and drafter is None:
            raise EyasError(f"decode method {cfg.method!r} needs a drafter")
        if drafter is not None and cfg.method in ("chain", "tree") and is_dflash(drafter):
            check_spec(cfg, drafter)
        if cfg.draft_size + 2 > runner.cfg.max_seq:
            raise EyasError(f"a draft of {cfg.draft_size} tokens does not fit a target cache of "
                            f"{runner.cfg.max_seq} slots")
        self.runner, self.cfg = runner, cfg
        self.aux_ids: tuple[int, ...] = ()
        self.drafting = None
        self._round = None
        if cfg.graph_round:
            self._round = RoundDecoder(runner, drafter, cfg, compile_drafter=compile_drafter)
        elif drafter is not None and cfg.method in ("chain", "tree"):
            drafter = fit_drafter(runner, drafter)
            self.aux_ids = tuple(drafter.config.aux_layer_ids)
            if fast is None:
                fast = runner.device.type == "cuda"
            if is_dflash(drafter):  # greedy and sampled chains alike: one block forward per round
                self.drafting = DFlashDrafting(drafter, runner.embed, runner.lm_head, slots=runner.cfg.max_seq,
                                               graphs=fast)
            elif fast and cfg.method == "chain" and cfg.temperature == 0:
                self.drafting = DraftCache(drafter, runner.embed, slots=runner.cfg.max_seq, k=cfg.k, graphs=True,
                                           compile=compile_drafter)
            elif fast and cfg.method == "tree":  # trees are top-k (deterministic) at every temperature
                self.drafting = DraftCache(drafter, runner.embed, slots=runner.cfg.max_seq,
                                           tree=(cfg.top_k, cfg.depth, cfg.total_tokens), graphs=True,
                                           compile=compile_drafter)
            else:
                self.drafting = EagleDrafting(drafter, runner.embed)
        if verify_capture is not None and self.aux_ids and tuple(verify_capture) != self.aux_ids:
            raise EyasError(f"verify_capture {tuple(verify_capture)} differs from the drafter's aux ids {self.aux_ids}")
        own = self._round.aux_ids if self._round is not None else self.aux_ids  # what this decoder's verify captures
        self.verify_capture = own if verify_capture is None else tuple(verify_capture)
        self._verify_fn = runner.step_fn(self.verify_capture)  # compiled when the runner is

    @property
    def mode(self) -> str:
        """How this decoder runs: "round" (whole greedy rounds on the device, one CUDA graph each), "static" (a
        static-cache drafter, one CUDA graph per drafter step), "eager" (the reference drafter) or "draftless"
        (plain, prompt lookup)."""
        if self._round is not None:
            return "round"
        if self.drafting is None:
            return "draftless"
        if isinstance(self.drafting, DFlashDrafting):
            return "static" if self.drafting.graphs else "eager"
        return "eager" if isinstance(self.drafting, EagleDrafting) else "static"

    def _padded(self, S: int) -> int:
        """Rows of the verify forward for a draft of S tokens (root included). Drafter-less decoders (prompt
        lookup, plain) propose 0..K tokens; any non-empty draft is padded to K+1 rows, so they verify at two
        shapes, not K+1 (`step_for`; the bench's start-up: no S-generic recompile of the step, fewer CUDA graphs).
        The fillers' rows attend only to themselves, their logits are not read and their cache slots lie past the
        accepted ones, masked until a later round overwrites them. Drafters verify their own S (a chain's K+1, a
        tree's fixed node count)."""
        return S if self.drafting is not None or S == 1 else max(S, self.cfg.draft_size + 1)

    def step_for(self, P: int):
        """The runner function a verify of P rows runs (`Runner.graphed`'s fn; None: the plain decode step, which
        returns logits only). A drafter-less decoder's empty draft on CUDA takes the plain decode step, the graph
        plain decoding already has; elsewhere the verify step: a CPU step attends only the slots in use, so the
        plain compiled step (static shapes) would recompile at every length."""
        if self.drafting is None and P == 1 and self.runner.device.type == "cuda":
            return None
        return self._verify_fn

    def _prefill(self, prompt: list[int], chunk: int = 512):
        logits, aux = prefill(self.runner, [prompt], self.aux_ids, chunk)
        return logits[0], aux

    def _propose(self, tokens: list[int], gen) -> Draft:
        c, root = self.cfg, tokens[-1]
        if c.method == "plain":
            return chain(root, [])
        if c.method == "lookup":
            return chain(root, lookup(tokens, c.k, c.max_ngram))
        if c.method == "chain":
            return self.drafting.propose_chain(root, c.k, c.temperature, c.top_p, gen, self.runner.cfg.vocab_size)
        return self.drafting.propose_tree(root, c.top_k, c.depth, c.total_tokens)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, *, eos_ids=(), seed: int = 0
                 ) -> tuple[list[int], SpecStats]:
        """New tokens for one prompt (ending at the first eos or after max_new_tokens) and stats."""
        if self._round is not None:
            return self._round.generate(prompt, max_new_tokens, eos_ids=eos_ids, seed=seed)
        c, r = self.cfg, self.runner
        dev, M = r.device, r.cfg.max_seq
        n = len(prompt)
        if n == 0:
            raise EyasError("speculative decoding: empty prompt")
        if n + max_new_tokens + c.draft_size + 1 > M:
            raise EyasError(f"prompt {n} + {max_new_tokens} new + {c.draft_size} draft tokens exceed the "
                            f"target cache ({M} slots)")
        eos = set(eos_ids)
        gen = torch.Generator(device=dev).manual_seed(seed)
        stats = SpecStats(accepted_at=[0] * c.max_depth)
        last_logits, aux = self._prefill(prompt)
        first = int(sample(last_logits[None], c.temperature, c.top_p, gen)[0])
        out = [first]
        stats.target_forwards = 1
        if self.drafting is not None:
            self.drafting.reset()
            self.drafting.extend(aux, torch.tensor([prompt[1:] + [first]], device=dev))
        committed = n  # target cache slots 0..n-1 hold processed tokens; out[-1] is pending
        while len(out) < max_new_tokens and out[-1] not in eos:
            draft = self._propose(prompt + out, gen)
            S = len(draft)
            P = self._padded(S)  # rows verified: the draft's S, then fillers that only see themselves
            ids = torch.tensor([draft.tokens + [draft.tokens[0]] * (P - S)], device=dev)
            pos = committed + torch.tensor([draft.depths + [0] * (P - S)], device=dev)
            slots = committed + torch.arange(P, device=dev)[None]
            width = M if dev.type == "cuda" else committed + P
            mask = torch.zeros(1, P, width, dtype=torch.bool, device=dev)
            mask[0, :S, :committed] = True
            mask[0, :S, committed:committed + S] = draft.ancestors().to(dev)
            mask[0, S:, committed + S:committed + P] = torch.eye(P - S, dtype=torch.bool, device=dev)
            fn = self.step_for(P)
            res = r.graphed(1, P, fn)(ids, pos, slots, mask)
            logits, vaux = (res, None) if fn is None else res
            path, bonus = verify(draft, logits[0, :S], c.temperature, c.top_p, gen)
            stats.add_round(len(path) - 1)
            new = [draft.tokens[i] for i in path[1:]] + [bonus]
            if path[-1] != len(path) - 1:  # tree: move the accepted path's k/v next to the prefix
                r.copy_slots(committed + torch.tensor(path, device=dev), committed + torch.arange(len(path), device=dev))
            if self.drafting is not None:
                self.drafting.rollback()
                self.drafting.extend(vaux[:, path], torch.tensor([new], device=dev))
            committed += len(path)
            out += new
            if eos.intersection(new):  # an eos among the accepted drafts ends decoding here, not a round later
                break
        return stats.finish(out, eos, max_new_tokens), stats
