"""Decoding where a one-line change went unnoticed before: the drafter cache's `last` entry after a batched prefill
in several chunks (decode/cache.py, through BatchChainDecoder) and the one-graph round at max_new_tokens=1
(decode/round.py, against the eager SpecDecoder). A tiny random Llama and an untrained drafter, fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from support.models import make_tiny_llama
from eyas.decode.batch import BatchChainDecoder, BatchSpecConfig
from eyas.decode.round import RoundDecoder
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.target.runner import Runner
from support.drafters import eagle3_for_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


@pytest.fixture(scope="module")
def setup():
    model = make_tiny_llama(seed=11)
    runner = Runner.from_hf(model, max_batch=4, max_seq=128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 5, 20, 3)]
    return model, runner, eagle3_for_model(model), prompts


def draft_logits(runner, drafter, prompts, chunk, monkeypatch) -> tuple[list, list, torch.Tensor]:
    """(outputs, per-row accepted counts, every draft step's logits (calls, B, Vd)) of batched chains."""
    seen = []
    logits = drafter.logits
    monkeypatch.setattr(drafter, "logits", lambda h: seen.append(logits(h)[:, -1].detach().clone()) or logits(h))
    dec = BatchChainDecoder(runner, drafter, BatchSpecConfig(k=3, compact=False, prefill_chunk=chunk))
    outs, stats = dec.generate(prompts, 8)
    monkeypatch.undo()
    return outs, [s.accepted for s in stats], torch.stack(seen)


def test_a_prefill_in_chunks_drafts_like_a_prefill_in_one(setup, monkeypatch):
    """Prompts of 40, 5, 20 and 3 tokens prefilled 16 at a time: the short rows have no entries in the later
    chunks, and their drafter must go on from their own last prompt token, not from a padding entry. Every draft
    step of every row then gives the logits of the one-chunk prefill."""
    model, runner, drafter, prompts = setup
    ref = runner.generate(prompts, 8)
    whole = draft_logits(runner, drafter, prompts, 512, monkeypatch)
    chunked = draft_logits(runner, drafter, prompts, 16, monkeypatch)
    assert whole[0] == chunked[0] == ref                                   # lossless either way
    assert chunked[1] == whole[1]
    assert chunked[2].shape == whole[2].shape
    torch.testing.assert_close(chunked[2], whole[2], rtol=1e-5, atol=1e-5)


def test_one_new_token_runs_no_round(setup, monkeypatch):
    """max_new_tokens=1: the prefill gives the token, so the one-graph round decoder runs no round and no verify
    forward, and its output and stats are the eager SpecDecoder's."""
    model, runner, drafter, prompts = setup
    dec = RoundDecoder(runner, drafter, SpecConfig(method="chain", k=3))
    launched = []
    launch = dec._launch
    monkeypatch.setattr(dec, "_launch", lambda r: launched.append(r) or launch(r))
    eager = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=3), fast=False)
    for p in prompts:
        out, stats = dec.generate(p, 1)
        want, wstats = eager.generate(p, 1)
        assert out == want == runner.generate([p], 1)[0]
        assert (stats.rounds, stats.target_forwards, stats.accepted) == (0, 1, []) == \
            (wstats.rounds, wstats.target_forwards, wstats.accepted)
    assert launched == []
