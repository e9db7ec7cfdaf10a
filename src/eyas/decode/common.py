"""What every decoder in decode/ shares: the config, the stats (with the eos cut), the prefill (target/prefill.py),
greedy chain acceptance and the drafter check. It imports nothing else from decode/, so every other module imports it at the top.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from eyas.errors import EyasError
from eyas.target.prefill import prefill, right_padded  # noqa: F401 (decode's names for them)

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
    """Greedy chains and trees: run each whole round on the device, one CUDA graph on CUDA (decode/round.py)."""

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

    def add_round(self, accepted: int) -> None:
        """Count one verify round that accepted `accepted` draft tokens (and emitted one more, the bonus)."""
        self.rounds += 1
        self.target_forwards += 1
        self.accepted.append(accepted)
        for j in range(accepted):
            self.accepted_at[j] += 1

    def finish(self, out: list[int], eos_ids, max_new_tokens: int) -> list[int]:
        """`out` cut after its first eos and to max_new_tokens (a round may overshoot both); sets `tokens`."""
        eos = set(eos_ids)
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        out = out[:min(cut, max_new_tokens)]
        self.tokens = len(out)
        return out


def fit_drafter(runner, drafter):
    """The drafter on the runner's device and dtype, in eval mode; refused when it was made for another target
    shape (vocabulary, hidden size). Every decoder takes its drafter through here."""
    if drafter.config.vocab_size != runner.cfg.vocab_size:
        raise EyasError(f"drafter vocab {drafter.config.vocab_size} != target vocab {runner.cfg.vocab_size}")
    if drafter.config.target_hidden_size != runner.cfg.hidden_size:
        raise EyasError(f"drafter expects target hidden size {drafter.config.target_hidden_size}, "
                        f"target has {runner.cfg.hidden_size}")
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


def accept(draft: Tensor, greedy: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy chain acceptance, per row. draft (B,K) target ids; greedy (B,K+1) the target's argmax after
    [pending, d_1..d_K]. Returns (accepted (B,) in 0..K, bonus (B,)): the longest prefix with
    d_j == greedy[:, j-1], and the target's token after it."""
    K = draft.shape[1]
    hit = (draft == greedy[:, :K]).long().cumprod(1)  # (B,K) 1 while every draft so far matched
    acc = hit.sum(1)  # (B,)
    bonus = greedy.gather(1, acc[:, None])[:, 0]  # (B,)
    return acc, bonus
