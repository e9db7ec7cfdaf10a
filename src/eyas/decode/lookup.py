"""Prompt-lookup (n-gram) drafting: a drafter-free baseline through the same verify path."""

from __future__ import annotations


def lookup(tokens: list[int], K: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Find the most recent earlier occurrence of the longest suffix n-gram (max_ngram down to
    min_ngram) of `tokens` and propose the up-to-K tokens that followed it; [] if none."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        for start in range(n_tok - n - 1, -1, -1):  # most recent match first, excluding the suffix itself
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + K]
                if follow:
                    return follow
    return []
