"""The draft vocabulary: the top-k target tokens by frequency over trainable (loss-masked) tokens.

Conventions (EAGLE3.md section 4, as SGLang and vLLM read them):
  token_ids  int64 (k,) ascending target ids;   d2t[i] = token_ids[i] - i, so target_id = i + d2t[i];
  t2d        bool (V,) membership mask.          k >= V gives the identity maps.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from eyas.errors import EyasError
from eyas.manifest import atomic_write_bytes


@dataclass(frozen=True)
class DraftVocab:
    token_ids: Tensor
    """int64 (k,) target ids in the draft vocab, ascending."""
    d2t: Tensor
    """int64 (k,) offsets: target_id = draft_id + d2t[draft_id]."""
    t2d: Tensor
    """bool (V,) True where a target id is in the draft vocab."""
    coverage: float
    """Share of the counted (trainable) tokens whose id is in the draft vocab."""

    @property
    def size(self) -> int:
        return int(self.token_ids.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())


def count_tokens(samples: Iterable, vocab_size: int) -> Tensor:
    """int64 (V,) counts of the tokens whose loss_mask is 1.

    `samples` yields (input_ids, loss_mask) pairs or objects with .input_ids / .loss_mask (eyas Sample).
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for n, s in enumerate(samples):
        ids, mask = (s.input_ids, s.loss_mask) if hasattr(s, "input_ids") else s
        ids, mask = torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(mask).bool()
        if ids.shape != mask.shape:
            raise EyasError(f"sample {getattr(s, 'id', n)}: input_ids {tuple(ids.shape)} and loss_mask "
                            f"{tuple(mask.shape)} differ in length")
        picked = ids[mask]
        if picked.numel() and (picked.min() < 0 or picked.max() >= vocab_size):
            raise EyasError(f"sample {getattr(s, 'id', n)}: token id outside [0, {vocab_size})")
        counts += torch.bincount(picked, minlength=vocab_size)
    return counts


def build_draft_vocab(token_counts: Tensor, k: int) -> DraftVocab:
    """Top-k ids by count (ties: lower id first), sorted ascending. k >= V gives the identity maps."""
    counts = torch.as_tensor(token_counts, dtype=torch.int64).cpu()
    V = counts.numel()
    if k <= 0:
        raise ValueError(f"draft vocab size must be positive, got {k}")
    total = int(counts.sum())
    if k >= V:
        token_ids = torch.arange(V, dtype=torch.int64)
    else:
        if total == 0:
            raise EyasError("draft vocab: no trainable tokens were counted (empty or fully masked data)")
        # Stable descending sort keeps ascending id order among equal counts.
        order = torch.sort(counts, descending=True, stable=True).indices
        token_ids = torch.sort(order[:k]).values
    kk = token_ids.numel()
    d2t = token_ids - torch.arange(kk, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[token_ids] = True
    coverage = float(counts[token_ids].sum()) / total if total else 1.0
    return DraftVocab(token_ids=token_ids, d2t=d2t, t2d=t2d, coverage=coverage)


def save_draft_vocab(vocab: DraftVocab, path: str | os.PathLike) -> None:
    """One safetensors file with token_ids, d2t, t2d (coverage in the metadata)."""
    from safetensors.torch import save

    tensors = {"token_ids": vocab.token_ids.contiguous(), "d2t": vocab.d2t.contiguous(),
               "t2d": vocab.t2d.contiguous()}
    atomic_write_bytes(path, save(tensors, metadata={"coverage": repr(vocab.coverage)}))


def load_draft_vocab(path: str | os.PathLike) -> DraftVocab:
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise EyasError(f"{path}: draft vocab file missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise EyasError(f"{path}: not a readable safetensors draft vocab ({e})") from e
    if set(t) != {"token_ids", "d2t", "t2d"} or "coverage" not in meta:
        raise EyasError(f"{path}: expected tensors token_ids, d2t, t2d and coverage metadata, got {sorted(t)}")
    vocab = DraftVocab(token_ids=t["token_ids"], d2t=t["d2t"], t2d=t["t2d"], coverage=float(meta["coverage"]))
    if not torch.equal(vocab.token_ids, torch.arange(vocab.size) + vocab.d2t) or \
            int(vocab.t2d.sum()) != vocab.size or not bool(vocab.t2d[vocab.token_ids].all()):
        raise EyasError(f"{path}: token_ids, d2t and t2d are inconsistent")
    return vocab
