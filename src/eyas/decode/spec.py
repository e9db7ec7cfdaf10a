"""Lossless speculative decoding at batch 1: EAGLE-3 chains and trees, prompt lookup, one verify path.

Each round: the drafter proposes a tree (a chain is a tree); the target runs the root (pending
token) plus all draft nodes in ONE forward with the tree mask, capturing its aux hidden states;
`verify` accepts the longest matching path and draws the bonus token; accepted cache slots are
compacted; the drafter continues from the aux states of the accepted positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyas.decode.eagle import EagleDrafting
from eyas.decode.lookup import lookup
from eyas.target.sampling import sample
from eyas.decode.tree import Draft, chain, verify
from eyas.errors import EyasError

METHODS = ("plain", "chain", "tree", "lookup")


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    method: str = "chain"
    """plain (no drafter) | chain | tree (EAGLE-2 dynamic) | lookup (prompt n-gram)."""
    k: int = 5
    """Chain length / prompt-lookup tokens per round."""
    top_k: int = 10
    """Tree: children kept per expanded node and nodes expanded per level."""
    depth: int = 6
    """Tree: maximum depth in draft tokens."""
    total_tokens: int = 60
    """Tree: draft nodes verified per round."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples with rejection sampling that preserves the target's law."""
    top_p: float = 1.0
    """Nucleus filter of the target (and draft) law when sampling."""
    max_ngram: int = 3
    """Prompt lookup: longest suffix n-gram searched."""
    graph_round: bool = False
    """Greedy chains and trees: run each whole round on the device, one CUDA graph on CUDA (decode/round.py,
    decode/round_tree.py)."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise EyasError(f"decode method {self.method!r}: expected one of {METHODS}")
        if self.temperature < 0:
            raise EyasError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EyasError(f"top_p must be in (0, 1], got {self.top_p}")
        if min(self.k, self.top_k, self.depth, self.total_tokens, self.max_ngram) < 1:
            raise EyasError("k, top_k, depth, total_tokens and max_ngram must all be >= 1")
        if self.graph_round and (self.method not in ("chain", "tree") or self.temperature > 0):
            raise EyasError(f"graph_round runs greedy chains and trees only (method chain or tree, temperature 0), "
                            f"got method {self.method!r}, temperature {self.temperature}")

    @property
    def draft_size(self) -> int:
        """Most draft nodes verified in one round."""
        return {"plain": 0, "chain": self.k, "lookup": self.k, "tree": self.total_tokens}[self.method]

    @property
    def max_depth(self) -> int:
        return {"plain": 0, "chain": self.k, "lookup": self.k, "tree": self.depth}[self.method]


@dataclass
class SpecStats:
    tokens: int = 0
    """Tokens generated."""
    target_forwards: int = 0
    """Target forwards (prefill counts one: it yields the first token)."""
    rounds: int = 0
    """Verify rounds."""
    accepted_at: list[int] = field(default_factory=list)
    """accepted_at[j]: rounds in which draft position j (depth j+1) was accepted."""
    accepted: list[int] = field(default_factory=list)
    """Draft tokens accepted in each verify round, in order (the replay test maps them to positions)."""

    @property
    def tau(self) -> float:
        """Tokens per target forward, bonus included."""
        return self.tokens / max(self.target_forwards, 1)

    def add(self, other: "SpecStats") -> None:
        self.tokens += other.tokens
        self.target_forwards += other.target_forwards
        self.rounds += other.rounds
        if len(self.accepted_at) < len(other.accepted_at):
            self.accepted_at += [0] * (len(other.accepted_at) - len(self.accepted_at))
        for j, a in enumerate(other.accepted_at):
            self.accepted_at[j] += a
        self.accepted += other.accepted

    def acceptance_by_position(self) -> list[float]:
        """Fraction of rounds whose accepted path reached draft position j."""
        return [a / max(self.rounds, 1) for a in self.accepted_at]


def prefill(runner, prompt: list[int], aux_ids: tuple[int, ...], chunk: int = 512):
    """Target slots 0..n-1 of cache row 0 from the prompt, in causal chunks -> (last position's logits (V,), the
    captured aux states (1,n,len(aux_ids)*h) or None without aux ids)."""
    dev = runner.device
    ids = torch.tensor([prompt], device=dev)
    n = len(prompt)
    auxs, logits = [], None
    for s0 in range(0, n, chunk):
        s1 = min(n, s0 + chunk)
        q = torch.arange(s0, s1, device=dev)
        mask = (torch.arange(s1, device=dev)[None] <= q[:, None])[None]  # (1,S,s1)
        logits, cap = runner.forward(ids[:, s0:s1], q[None], q[None], mask, capture=aux_ids, last_only=True)
        if aux_ids:
            auxs.append(torch.cat([cap[i] for i in aux_ids], -1))  # (1,S,3h)
    return logits[0, -1], (torch.cat(auxs, 1) if auxs else None)


def fit_drafter(runner, drafter):
    """The drafter on the runner's device and dtype, in eval mode; refused when it was made for another target
    shape (vocabulary, hidden size). Every decoder (this one, batch.py, round.py) takes its drafter through here."""
    if drafter.config.vocab_size != runner.cfg.vocab_size:
        raise EyasError(f"drafter vocab {drafter.config.vocab_size} != target vocab {runner.cfg.vocab_size}")
    if drafter.config.target_hidden_size != runner.cfg.hidden_size:
        raise EyasError(f"drafter expects target hidden size {drafter.config.target_hidden_size}, "
                        f"target has {runner.cfg.hidden_size}")
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


class SpecDecoder:
    """Speculative decoding with a target `Runner` and an optional EAGLE-3 drafter (batch 1, cache row 0)."""

    def __init__(self, runner, drafter=None, cfg: SpecConfig = SpecConfig(), *, fast: bool | None = None,
                 verify_capture: tuple[int, ...] | None = None, compile_drafter: bool = False):
        """fast: use the static-cache drafters, one CUDA graph per step (default: on CUDA): graphed.py for greedy
        chains, tree_static.py for trees. verify_capture: the aux ids the verify step returns (default: the
        drafter's, none without one); a drafter-less decoder given a drafter's ids shares that decoder's compiled
        verify step (the bench: one compile fewer) and ignores the extra output. compile_drafter: torch.compile the
        static drafters' proposers and extends (greedy chains: graphed.py, with graph_round the round's; trees:
        tree_static.py)."""
        if cfg.method in ("chain", "tree") and drafter is None:
            raise EyasError(f"decode method {cfg.method!r} needs a drafter")
        if cfg.draft_size + 2 > runner.cfg.max_seq:
            raise EyasError(f"a draft of {cfg.draft_size} tokens does not fit a target cache of "
                            f"{runner.cfg.max_seq} slots")
        self.runner, self.cfg = runner, cfg
        self.aux_ids: tuple[int, ...] = ()
        self.drafting = None
        self._round = None
        if cfg.graph_round and cfg.method == "tree":
            from eyas.decode.round_tree import RoundTreeDecoder
            self._round = RoundTreeDecoder(runner, drafter, cfg, compile_drafter=compile_drafter)
        elif cfg.graph_round:
            from eyas.decode.round import RoundChainDecoder
            self._round = RoundChainDecoder(runner, drafter, cfg, compile_drafter=compile_drafter)
        elif drafter is not None and cfg.method in ("chain", "tree"):
            drafter = fit_drafter(runner, drafter)
            self.aux_ids = tuple(drafter.config.aux_layer_ids)
            if fast is None:
                fast = runner.device.type == "cuda"
            if fast and cfg.method == "chain" and cfg.temperature == 0:
                from eyas.decode.graphed import GraphedChainDrafting
                self.drafting = GraphedChainDrafting(drafter, runner.embed, runner.cfg.max_seq, cfg.k,
                                                     compile=compile_drafter)
            elif fast and cfg.method == "tree":  # trees are top-k (deterministic) at every temperature
                from eyas.decode.tree_static import StaticTreeDrafting
                self.drafting = StaticTreeDrafting(drafter, runner.embed, runner.cfg.max_seq, top_k=cfg.top_k,
                                                   depth=cfg.depth, total=cfg.total_tokens, compile=compile_drafter)
            else:
                self.drafting = EagleDrafting(drafter, runner.embed)
        if verify_capture is not None and self.aux_ids and tuple(verify_capture) != self.aux_ids:
            raise EyasError(f"verify_capture {tuple(verify_capture)} differs from the drafter's aux ids {self.aux_ids}")
        own = self._round.aux_ids if self._round is not None else self.aux_ids  # what this decoder's verify captures
        self.verify_capture = own if verify_capture is None else tuple(verify_capture)
        self._verify_fn = runner.step_fn(self.verify_capture)  # compiled when the runner is

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
        return prefill(self.runner, prompt, self.aux_ids, chunk)

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
            stats.target_forwards += 1
            stats.rounds += 1
            for j in range(len(path) - 1):
                stats.accepted_at[j] += 1
            stats.accepted.append(len(path) - 1)
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
        for i, t in enumerate(out):
            if t in eos:
                out = out[:i + 1]
                break
        out = out[:max_new_tokens]
        stats.tokens = len(out)
        return out, stats
