"""Batched greedy EAGLE chains are lossless and accept, row by row, exactly what batch 1 accepts.

fp32 on the CPU, the tiny peaky target and briefly trained drafter of test_decode.py. For prompts of
1..240 tokens, some ending at eos after different numbers of tokens and some at max_new_tokens:
(a) every row's tokens == plain greedy decoding of that prompt alone;
(b) every row's per-round accepted counts == the batch-1 eager chain decoder's on that prompt alone.
Two injected bugs show that each property is checked: another row's bonus token breaks (a), another
row's aux features in the drafter's cache keep (a) (verification makes any drafter lossless) but break (b).
"""

import copy

import pytest
import torch

from support.models import make_tiny_llama
from eyas.decode import batch as batch_mod
from eyas.decode import cache as cache_mod
from eyas.decode.batch import BatchChainDecoder, BatchSpecConfig, accept
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.errors import EyasError
from eyas.target.runner import Runner
from support.drafters import eagle3_for_model
from test_decode import peaky, train_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

NEW = 24


@pytest.fixture(scope="module")
def setup():
    model = peaky(make_tiny_llama(seed=11), 4.0, 0.3)
    runner = Runner.from_hf(model, max_batch=8, max_seq=320)
    drafter = train_drafter(model, runner)
    g = torch.Generator().manual_seed(2)
    lengths = [1, 2, 3, 5, 8] + torch.randint(4, 40, (12,), generator=g).tolist() + [120, 200, 240]
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    eos = mid_round_token(runner, drafter, prompts)
    ref = [runner.generate([p], NEW, eos_ids=[eos])[0] for p in prompts]  # plain greedy, each prompt alone
    return model, runner, drafter, prompts, ref, eos


def mid_round_token(runner, drafter, prompts, k=4) -> int:
    """The token whose first occurrence in a row's greedy output is most often an accepted draft with more
    tokens after it in the same batch-1 round: as eos it ends rows inside a round (see overshoots)."""
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=k), fast=False)
    count = torch.zeros(runner.cfg.vocab_size, dtype=torch.long)
    for p in prompts:
        out, stats = dec.generate(p, NEW)
        mid, c = set(), 1
        for a in stats.accepted:  # a round emits out[c..c+a]; out[c+a] is its bonus
            mid |= set(range(c, c + a))
            c += a + 1
        first = {}
        for i, t in enumerate(out):
            first.setdefault(t, i)
        for t, i in first.items():
            count[t] += i in mid
    return int(count.argmax())


def batch1_accepted(runner, drafter, prompts, eos, k):
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=k), fast=False)
    return [dec.generate(p, NEW, eos_ids=[eos])[1].accepted for p in prompts]


def overshoots(accepted: list[int], tokens: int) -> bool:
    """Whether the rounds produced more tokens than the output kept: the last round held an eos (or the
    max_new_tokens cut) before its end. The first token comes from the prefill."""
    return 1 + sum(a + 1 for a in accepted) > tokens


def test_fixture_covers_the_cases(setup):
    _, runner, drafter, prompts, ref, eos = setup
    eos_ends = {len(o) for o in ref if o[-1] == eos and len(o) < NEW}
    assert len(eos_ends) >= 3, eos_ends  # rows finish at eos after different numbers of tokens
    b1 = batch1_accepted(runner, drafter, prompts, eos, 4)
    assert sum(o[-1] == eos and overshoots(a, len(o)) for a, o in zip(b1, ref)) >= 3  # some inside a round
    assert sum(len(o) == NEW for o in ref) >= 3  # and some at max_new_tokens
    assert len({len(p) for p in prompts}) >= 10 and max(map(len, prompts)) == 240


@pytest.mark.parametrize("k,max_batch,compact,max_seq,graphs", [
    (4, 8, True, 320, False), (4, 20, False, 320, False), (1, 8, True, 320, False),
    (3, 5, True, 200 + NEW + 3 + 1, False), (4, 8, True, 320, True), (3, 5, True, 200 + NEW + 3 + 1, True)],
    ids=["k4-b8", "k4-b20-nocompact", "k1-b8", "k3-b5-full-cache", "k4-b8-graphs", "k3-b5-full-cache-graphs"])
def test_rows_equal_plain_greedy_and_batch1_acceptance(setup, k, max_batch, compact, max_seq, graphs, monkeypatch):
    """The last cases fill the 200-token prompt's cache row to the end: finished rows must not write past it.
    graphs: the CUDA path's fixed-width drafter steps with static inputs (eager replays on the CPU); their
    warm-up calls run for real inside a decoding, so they must leave the committed cache as it was."""
    model, _, drafter, prompts, ref, eos = setup
    keep = [i for i, p in enumerate(prompts) if len(p) + NEW + k + 1 <= max_seq]
    prompts, ref = [prompts[i] for i in keep], [ref[i] for i in keep]
    runner = Runner.from_hf(model, max_batch=max_batch, max_seq=max_seq)
    if graphs:  # the CUDA capture's real warm-up calls, then replays (graphs.capture runs neither on the CPU)
        monkeypatch.setattr(cache_mod, "capture", lambda fn, *a, cuda=None: [fn(*a) for _ in range(2)] and
                            (lambda: fn(*a)))
    dec = BatchChainDecoder(runner, drafter, BatchSpecConfig(k=k, compact=compact), graphs=graphs)
    moves = []
    move = dec._move_rows
    monkeypatch.setattr(dec, "_move_rows", lambda keep, w: moves.append(keep.numel()) or move(keep, w))
    outs, stats = dec.generate(prompts, NEW, eos_ids=[eos])
    assert outs == ref  # (a)
    want = batch1_accepted(runner, drafter, prompts, eos, k)
    assert [s.accepted for s in stats] == want  # (b)
    assert [s.tokens for s in stats] == list(map(len, ref))
    assert all(s.target_forwards == 1 + s.rounds for s in stats)
    # acceptance is non-trivial, and rows accept different lengths in the same round
    acc = sum((s.accepted for s in stats), [])
    assert k in acc and 0 in acc and sum(acc) / len(acc) > 0.3
    assert bool(moves) == compact  # finished rows were (or were not) moved out of the batch
    if graphs:  # one propose and one extend graph per batch size met (chunks and compaction: several), not per round
        keys = dec.drafting.graph_keys
        sizes = {key[1] for key in keys}
        assert {max_batch, *moves} <= sizes and len(keys) == 2 * len(sizes)


def record(seen: list, lg):
    seen.append(lg[:, -1].detach().clone())  # (B,Vd)
    return lg


def test_draft_logits_equal_batch1(setup, monkeypatch):
    """Every draft step of every live row gives the batch-1 eager drafter's logits (to fp32 rounding): the
    per-row drafter cache, RoPE positions and masks are right, not just good enough to pick the same argmax."""
    model, _, drafter, prompts, ref, eos = setup
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # so cache row i decodes prompt i
    prompts, ref = [prompts[i] for i in order], [ref[i] for i in order]
    runner = Runner.from_hf(model, max_batch=len(prompts), max_seq=320)
    seen = []
    logits = drafter.logits
    monkeypatch.setattr(drafter, "logits", lambda h: record(seen, logits(h)))
    _, stats = BatchChainDecoder(runner, drafter, BatchSpecConfig(k=4, compact=False)).generate(
        prompts, NEW, eos_ids=[eos])
    batched = torch.stack(seen, 1)  # (B, calls, Vd): K calls per round, every row each time
    one = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=4), fast=False)
    for b, p in enumerate(prompts):
        seen.clear()
        one.generate(p, NEW, eos_ids=[eos])
        steps = 4 * stats[b].rounds
        assert len(seen) >= steps
        if steps:
            torch.testing.assert_close(batched[b, :steps], torch.cat(seen[:steps]), rtol=1e-4, atol=1e-5)
    assert sum(s.rounds for s in stats) >= 100


def test_wrong_rows_bonus_breaks_losslessness(setup, monkeypatch):
    model, _, drafter, prompts, ref, eos = setup
    runner = Runner.from_hf(model, max_batch=8, max_seq=320)

    def rolled(draft, greedy):
        acc, bonus = accept(draft, greedy)
        return acc, bonus.roll(1, 0)  # each row gets the previous row's bonus token

    monkeypatch.setattr(batch_mod, "accept", rolled)
    outs, _ = BatchChainDecoder(runner, drafter, BatchSpecConfig(k=4)).generate(prompts, NEW, eos_ids=[eos])
    assert sum(o != r for o, r in zip(outs, ref)) >= len(prompts) // 2


def test_wrong_rows_drafter_features_change_acceptance_only(setup, monkeypatch):
    model, _, drafter, prompts, ref, eos = setup
    runner = Runner.from_hf(model, max_batch=8, max_seq=320)
    extend = cache_mod.DraftCache.extend
    monkeypatch.setattr(cache_mod.DraftCache, "extend",
                        lambda self, aux, *a, **kw: extend(self, aux.roll(1, 0), *a, **kw))  # the previous row's aux
    outs, stats = BatchChainDecoder(runner, drafter, BatchSpecConfig(k=4)).generate(prompts, NEW, eos_ids=[eos])
    assert outs == ref  # still lossless: the target verifies every draft
    want = batch1_accepted(runner, drafter, prompts, eos, 4)
    assert [s.accepted for s in stats] != want


def test_accept_per_row():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 4, 4]])
    greedy = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [4, 0, 0, 0], [4, 4, 5, 6]])
    acc, bonus = accept(draft, greedy)
    assert acc.tolist() == [3, 1, 0, 2]
    assert bonus.tolist() == [8, 6, 4, 5]


def test_bad_input_refused(setup):
    model, runner, drafter, *_ = setup
    with pytest.raises(EyasError, match="not implemented for batch > 1"):
        BatchSpecConfig(temperature=0.7)
    with pytest.raises(EyasError):
        BatchSpecConfig(k=0)
    with pytest.raises(EyasError, match="needs? a drafter"):
        BatchChainDecoder(runner, None)
    with pytest.raises(EyasError, match="does not fit"):
        BatchChainDecoder(runner, drafter, BatchSpecConfig(k=400))
    with pytest.raises(EyasError, match="target vocab"):
        BatchChainDecoder(runner, eagle3_for_model(make_tiny_llama(vocab=128)))
    dec = BatchChainDecoder(runner, drafter, BatchSpecConfig(k=4))
    with pytest.raises(EyasError, match="prompt 1 is empty"):
        dec.generate([[5], []], NEW)
    with pytest.raises(EyasError, match="prompt 1: 300 tokens"):
        dec.generate([[5], [5] * 300], NEW)
    with pytest.raises(EyasError, match="max_new_tokens"):
        dec.generate([[5]], 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_batched_chains_equal_cpu(setup, compile):
    """On CUDA (graphed drafter steps and verify, compiled or not) every row's tokens and per-round acceptance
    equal the CPU's, through compaction."""
    model, cpu, drafter, prompts, ref, eos = setup
    gpu = Runner.from_hf(model, max_batch=8, max_seq=320, device="cuda", compile=compile, dynamic=compile)
    dec = BatchChainDecoder(gpu, copy.deepcopy(drafter), BatchSpecConfig(k=4))
    outs, stats = dec.generate(prompts, NEW, eos_ids=[eos])
    assert dec.graphs and dec.drafting.graph_keys
    assert outs == ref
    assert [s.accepted for s in stats] == batch1_accepted(cpu, drafter, prompts, eos, 4)
