"""Draft vocabulary: top-k by frequency of trainable tokens, d2t/t2d as SGLang and vLLM read them."""

from dataclasses import dataclass

import pytest
import torch

from eyas.errors import EyasError
from eyas.model.vocab import build_draft_vocab, count_tokens, load_draft_vocab, save_draft_vocab


def test_count_tokens_counts_only_loss_masked_tokens():
    @dataclass
    class S:
        id: str
        input_ids: list
        loss_mask: list

    samples = [([1, 2, 3, 3, 9], [0, 1, 1, 1, 0]), S("x", [9, 9, 4], [1, 1, 0])]
    counts = count_tokens(samples, 10)
    expected = torch.zeros(10, dtype=torch.int64)
    expected[2], expected[3], expected[9] = 1, 2, 2
    assert torch.equal(counts, expected)
    with pytest.raises(EyasError, match="sample x: token id outside"):
        count_tokens([S("x", [10], [1])], 10)
    with pytest.raises(EyasError, match="differ in length"):
        count_tokens([([1, 2], [1])], 10)


def test_top_k_maps_round_trip_and_coverage():
    g = torch.Generator().manual_seed(0)
    V, k = 500, 37
    counts = torch.randint(0, 50, (V,), generator=g) * torch.randint(0, 2, (V,), generator=g)
    vocab = build_draft_vocab(counts, k)
    tok = vocab.token_ids
    assert tok.dtype == vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert tok.shape == (k,) and torch.all(tok[1:] > tok[:-1])                 # ascending, unique
    assert torch.equal(torch.arange(k) + vocab.d2t, tok)                       # target_id = i + d2t[i]
    assert vocab.t2d.sum() == k and vocab.t2d[tok].all()
    # top-k by count with ties broken by lower id: a naive selection over (-count, id)
    naive = sorted(sorted(range(V), key=lambda i: (-int(counts[i]), i))[:k])
    assert tok.tolist() == naive
    inside = min(int(counts[i]) for i in naive)
    assert all(int(counts[i]) <= inside for i in range(V) if i not in set(naive))
    assert vocab.coverage == pytest.approx(float(counts[tok].sum()) / float(counts.sum()))
    assert 0 < vocab.coverage < 1


def test_deterministic_tie_break():
    counts = torch.tensor([5, 7, 5, 5, 7, 0, 5])
    v = build_draft_vocab(counts, 4)
    assert v.token_ids.tolist() == [0, 1, 2, 4]                                # 7,7 then the two lowest-id 5s
    assert torch.equal(build_draft_vocab(counts.clone(), 4).token_ids, v.token_ids)


def test_identity_when_k_covers_the_vocab():
    counts = torch.tensor([0, 3, 1, 0])
    for k in (4, 10):
        v = build_draft_vocab(counts, k)
        assert v.token_ids.tolist() == [0, 1, 2, 3]
        assert v.d2t.tolist() == [0, 0, 0, 0] and v.t2d.all() and v.coverage == 1.0


def test_empty_counts_refused():
    with pytest.raises(EyasError, match="no trainable tokens"):
        build_draft_vocab(torch.zeros(10, dtype=torch.int64), 3)


def test_save_load(tmp_path):
    v = build_draft_vocab(torch.arange(100) % 7, 20)
    save_draft_vocab(v, tmp_path / "vocab.safetensors")
    w = load_draft_vocab(tmp_path / "vocab.safetensors")
    assert torch.equal(w.token_ids, v.token_ids) and torch.equal(w.d2t, v.d2t) and torch.equal(w.t2d, v.t2d)
    assert w.coverage == v.coverage
    with pytest.raises(EyasError, match="missing"):
        load_draft_vocab(tmp_path / "none.safetensors")
