"""The one-graph chain round (decode/round.py's chain body) decodes exactly like the host-driven eager chain decoder.

fp32 on the CPU, where the same round code runs eagerly, with the tiny peaky target, the briefly trained drafter,
the prompts (1..240 tokens) and the mid-round eos of test_batch_chains.py. For K = 1, 3, 5:
(a) every prompt's tokens == plain greedy decoding of it;
(b) its per-round accepted counts == the eager `SpecDecoder` chain's (both stop at the round holding the eos);
(c) every draft step's logits == the eager drafter's, to fp32 rounding;
also with the cache filled to its last checked slot, where the host must wait before launching a round.
Injected bugs show each property is checked: a bonus token from the wrong position breaks (a); a drafter
continuing from one entry too many (or too few) keeps (a) but breaks (b) and (c); launching the next round
near the end of the cache without waiting writes past the cache. The gpu test compares the CUDA graph with the
CPU eager run.
"""

import copy

import pytest
import torch

from eyas.decode import round as round_mod
from eyas.decode.batch import accept
from eyas.decode.cache import DraftCache
from eyas.decode.round import RoundDecoder
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.errors import EyasError
from eyas.target.runner import Runner
from test_batch_chains import NEW, batch1_accepted, overshoots, record, setup  # noqa: F401 (setup: fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def chain(k: int) -> SpecConfig:
    return SpecConfig(method="chain", k=k)


def decode_all(dec, prompts, eos, new=NEW):
    res = [dec.generate(p, new, eos_ids=eos) for p in prompts]
    return [o for o, _ in res], [s for _, s in res]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_round_equals_plain_greedy_and_eager_chain_acceptance(setup, k, monkeypatch):
    """Rounds are launched one ahead of the host's reads: at most one round past the stop is thrown away."""
    _, runner, drafter, prompts, ref, eos = setup
    dec = RoundDecoder(runner, drafter, chain(k))  # one decoder for every prompt: its state is reset
    launches = []
    launch = dec._launch
    monkeypatch.setattr(dec, "_launch", lambda r: launches.append(r) or launch(r))
    outs, stats = [], []
    for p in prompts:
        launches.clear()
        o, s = dec.generate(p, NEW, eos_ids=[eos])
        outs.append(o)
        stats.append(s)
        assert launches == list(range(len(launches))) and s.rounds <= len(launches) <= s.rounds + 1
    assert outs == ref  # (a)
    eager = batch1_accepted(runner, drafter, prompts, eos, k)
    assert [s.accepted for s in stats] == eager  # (b)
    assert [s.tokens for s in stats] == list(map(len, ref))
    assert all(s.target_forwards == 1 + s.rounds == 1 + len(s.accepted) for s in stats)
    assert all(sum(s.accepted_at) == sum(s.accepted) for s in stats)
    acc = sum((s.accepted for s in stats), [])
    assert k in acc and 0 in acc and sum(acc) / len(acc) > 0.3  # acceptance is non-trivial
    assert sum(o[-1] == eos and overshoots(a, len(o)) for a, o in zip(eager, ref)) >= 3  # eos inside a round
    launches.clear()
    dec.generate(prompts[-1], 2)
    assert launches == [0]  # the round in flight surely ends the decoding: nothing is launched behind it


def test_draft_logits_equal_eager_drafter(setup, monkeypatch):
    """(c): the round's static drafter cache, RoPE positions and masks are right, not merely good enough to pick
    the same argmax (a weak drafter's acceptance counts would miss a position off by one)."""
    _, runner, drafter, prompts, ref, eos = setup
    k = 4
    seen = []
    logits = drafter.logits
    monkeypatch.setattr(drafter, "logits", lambda h: record(seen, logits(h)))
    dec = RoundDecoder(runner, drafter, chain(k))
    eager = SpecDecoder(runner, drafter, chain(k), fast=False)
    steps = 0
    for p in prompts:
        seen.clear()
        _, stats = dec.generate(p, NEW, eos_ids=[eos])
        ours = list(seen)  # K calls per round, plus a thrown-away round launched after the stop
        seen.clear()
        eager.generate(p, NEW, eos_ids=[eos])
        n = k * stats.rounds
        assert len(ours) >= n and len(seen) >= n
        if n:
            torch.testing.assert_close(torch.cat(ours[:n]), torch.cat(seen[:n]), rtol=1e-4, atol=1e-5)
        steps += n
    assert steps >= 200


@pytest.fixture(scope="module")
def full(setup):
    """Prompts of 100 tokens, decoded to exactly the last checked slot of a cache of 100 + NEW + K + 1 (no eos)."""
    model, _, drafter, *_ = setup
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (100,), generator=g).tolist() for _ in range(8)]
    return model, drafter, prompts


def full_runner(model, k):
    return Runner.from_hf(model, max_batch=1, max_seq=100 + NEW + k + 1)


@pytest.mark.parametrize("k", [3, 5])
def test_cache_filled_to_the_end(full, k, monkeypatch):
    model, drafter, prompts = full
    runner = full_runner(model, k)
    dec = RoundDecoder(runner, drafter, chain(k))
    fits = []
    check = dec._fits_another
    monkeypatch.setattr(dec, "_fits_another", lambda c: fits.append(check(c)) or fits[-1])
    outs, stats = decode_all(dec, prompts, [])
    assert outs == runner.generate(prompts, NEW) and all(len(o) == NEW for o in outs)
    assert [s.accepted for s in stats] == batch1_accepted(runner, drafter, prompts, -1, k)
    assert True in fits and False in fits  # rounds were launched ahead, and near the end the host waited
    with pytest.raises(EyasError, match="exceed the target cache"):
        dec.generate(prompts[0] + [5], NEW)


def test_launching_ahead_near_the_end_writes_past_the_cache(full, monkeypatch):
    """Injected: the host launches round r+1 before reading round r even near the end of the cache."""
    model, drafter, prompts = full
    dec = RoundDecoder(full_runner(model, 5), drafter, chain(5))
    monkeypatch.setattr(dec, "_fits_another", lambda c: True)
    with pytest.raises((IndexError, RuntimeError), match="out of (range|bounds)"):
        decode_all(dec, prompts, [])


# ---------------------------------------------------------------- injected bugs in the round itself
def bonus_after(draft, greedy):
    acc, _ = accept(draft, greedy)
    return acc, greedy.gather(1, (acc + 1).clamp(max=draft.shape[1])[:, None])[:, 0]


def bonus_before(draft, greedy):
    acc, _ = accept(draft, greedy)
    return acc, greedy.gather(1, (acc - 1).clamp(min=0)[:, None])[:, 0]


@pytest.mark.parametrize("wrong", [bonus_after, bonus_before], ids=["acc+1", "acc-1"])
def test_bonus_from_the_wrong_position_breaks_losslessness(setup, wrong, monkeypatch):
    _, runner, drafter, prompts, ref, eos = setup
    monkeypatch.setattr(round_mod, "accept", wrong)
    outs, _ = decode_all(RoundDecoder(runner, drafter, chain(3)), prompts, [eos])
    assert sum(o != r for o, r in zip(outs, ref)) >= len(prompts) // 2


def last_entry_off_by(shift):
    def commit(self, aux, tokens, acc):
        out = self._write(aux, tokens[None])  # (1,K+1,h)
        self.last.copy_(out.index_select(1, (acc + shift).clamp(0, self.chain_len)))
        self.n.add_(acc[0] + 1)
    return commit


@pytest.mark.parametrize("shift", [1, -1], ids=["one-entry-too-many", "one-entry-too-few"])
def test_drafter_continuing_from_the_wrong_entry_changes_acceptance_only(setup, shift, monkeypatch):
    _, runner, drafter, prompts, ref, eos = setup
    monkeypatch.setattr(DraftCache, "commit", last_entry_off_by(shift))
    outs, stats = decode_all(RoundDecoder(runner, drafter, chain(3)), prompts, [eos])
    assert outs == ref  # still lossless: the target verifies every draft
    want = batch1_accepted(runner, drafter, prompts, eos, 3)
    assert [s.accepted for s in stats] != want


# ---------------------------------------------------------------- wiring and refusals
def test_spec_decoder_graph_round_flag_dispatches_here(setup):
    _, runner, drafter, prompts, ref, eos = setup
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=3, graph_round=True))
    assert isinstance(dec._round, RoundDecoder) and dec.mode == "round"
    outs, stats = decode_all(dec, prompts[::4], [eos])
    direct = decode_all(RoundDecoder(runner, drafter, chain(3)), prompts[::4], [eos])
    assert outs == ref[::4] == direct[0]
    assert [s.accepted for s in stats] == [s.accepted for s in direct[1]]
    assert SpecDecoder(runner, drafter, chain(3))._round is None  # off by default, on every device
    assert SpecDecoder(runner, drafter, chain(3), fast=True).mode == "static"
    assert SpecDecoder(runner, drafter, chain(3), fast=False).mode == "eager"
    assert SpecDecoder(runner, None, SpecConfig(method="lookup")).mode == "draftless"


def test_bad_input_refused(setup):
    _, runner, drafter, *_ = setup
    with pytest.raises(EyasError, match="greedy chains and trees only"):
        SpecConfig(method="lookup", graph_round=True)
    with pytest.raises(EyasError, match="greedy chains and trees only"):
        SpecConfig(method="chain", temperature=0.7, graph_round=True)
    with pytest.raises(EyasError, match="greedy chains and trees only"):
        SpecConfig(method="tree", temperature=0.7, graph_round=True)
    with pytest.raises(EyasError, match="greedy chains and trees only"):
        RoundDecoder(runner, drafter, SpecConfig(method="lookup"))
    with pytest.raises(EyasError, match="needs a drafter"):
        RoundDecoder(runner, None, chain(3))
    with pytest.raises(EyasError, match="does not fit"):
        RoundDecoder(runner, drafter, chain(400))
    dec = RoundDecoder(runner, drafter, chain(3))
    with pytest.raises(EyasError, match="empty prompt"):
        dec.generate([], NEW)
    with pytest.raises(EyasError, match="exceed the target cache"):
        dec.generate([5] * 300, NEW)
    assert dec.generate([5, 6], 1)[0] == runner.generate([[5, 6]], 1)[0]  # max_new 1: the prefill's token only


# ---------------------------------------------------------------- CUDA graph == CPU eager
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True, "drafter"])
def test_cuda_graph_round_equals_cpu_eager(setup, compile, monkeypatch):
    """On CUDA every round replays one graph (the round's Python body ran only for the capture), launching a
    round never syncs with the host, and the tokens and accepted counts equal the CPU eager run's, for K = 1, 3,
    5 with mid-round eos, and with the cache filled to the end."""
    model, cpu, drafter, prompts, ref, eos = setup
    gpu = Runner.from_hf(model, max_batch=1, max_seq=320, device="cuda", compile=bool(compile))
    for k in (1, 3, 5):
        want = decode_all(RoundDecoder(cpu, drafter, chain(k)), prompts, [eos])
        dec = RoundDecoder(gpu, copy.deepcopy(drafter), chain(k), compile_drafter=compile == "drafter")
        bodies = []
        body = dec._round
        monkeypatch.setattr(dec, "_round", lambda: bodies.append(1) or body())
        launch = dec._launch

        def strict_launch(r):
            torch.cuda.set_sync_debug_mode("error")
            try:
                launch(r)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monkeypatch.setattr(dec, "_launch", strict_launch)
        got = decode_all(dec, prompts, [eos])
        assert got[0] == want[0] == ref
        assert [s.accepted for s in got[1]] == [s.accepted for s in want[1]]
        assert len(bodies) == round_mod.WARMUP + 1  # captured once, then only replays
        host = decode_all(SpecDecoder(gpu, copy.deepcopy(drafter), chain(k)), prompts, [eos])  # today's CUDA path
        assert [s.accepted for s in got[1]] == [s.accepted for s in host[1]]
        assert sum(s.rounds for s in got[1]) > 50
    full = Runner.from_hf(model, max_batch=1, max_seq=200 + NEW + 5 + 1, device="cuda", compile=bool(compile))
    long = [p for p in prompts if len(p) == 200]
    got = decode_all(RoundDecoder(full, copy.deepcopy(drafter), chain(5)), long, [])
    assert got[0] == cpu.generate(long, NEW)


@pytest.mark.parametrize("graph_round", [True, False])
def test_compiled_drafter_decodes_like_the_eager_drafter(setup, graph_round):
    """compile_drafter (torch.compile of the static chain drafter's draft and extend steps; inductor on the CPU):
    the one-graph round and the host-driven graphed chain give plain greedy's tokens and the eager chain's
    per-round acceptance, so the compiled draft steps propose exactly what the eager ones do."""
    from torch._dynamo.utils import counters

    _, runner, drafter, prompts, ref, eos = setup
    cfg = SpecConfig(method="chain", k=3, graph_round=graph_round)
    dec = SpecDecoder(runner, drafter, cfg, fast=True, compile_drafter=True)
    drafting = dec._round.drafting if graph_round else dec.drafting
    assert hasattr(drafting._chain_fn, "_torchdynamo_orig_callable")  # torch.compile's wrapper
    assert hasattr(drafting._write_fn, "_torchdynamo_orig_callable")
    torch._dynamo.reset()  # both cases compile the same DraftCache bodies: count this case's compiles
    counters.clear()
    outs, stats = decode_all(dec, prompts[:4], [eos])
    assert counters["stats"]["unique_graphs"] >= 2  # the draft steps and an extend were compiled and ran
    assert outs == ref[:4]
    assert [s.accepted for s in stats] == batch1_accepted(runner, drafter, prompts[:4], eos, 3)


def test_many_compiled_drafters_in_one_process(setup, monkeypatch):
    """Every compiled drafter body is one code object with guards on K: eighteen decoders (host and one-graph
    rounds, K = 1..9) give the chain body more than dynamo's default 8 entries, where fullgraph would raise instead
    of falling back. `cache.compiled` leaves room. (dynamo's eager backend here: the guards, not inductor, are the point.)"""
    from torch._dynamo.utils import counters

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    counters.clear()
    _, runner, drafter, prompts, ref, eos = setup
    for k in range(1, 10):
        for graph_round in (False, True):
            dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=k, graph_round=graph_round), fast=True,
                              compile_drafter=True)
            assert dec.generate(prompts[0], 8, eos_ids=[eos])[0] == ref[0][:8]
    assert counters["stats"]["unique_graphs"] > 8  # more entries than the default limit: the test is not vacuous


@pytest.mark.parametrize("graph_round", [True, False])
def test_prompt_lengths_compile_nothing(setup, graph_round, monkeypatch):
    """compile_drafter compiles the drafter's fixed-shape bodies only: once a decoder has decoded one prompt, prompts
    of other lengths compile nothing more (a prompt's extend compiled for its length recompiled inside the
    bench's timed loop: BENCHMARKS.md, decode/ before and after). The first prompt decodes 40 tokens without an eos,
    so later rounds bring no new fixed shape either."""
    from torch._dynamo.utils import counters

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    _, runner, drafter, prompts, ref, eos = setup
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=3, graph_round=graph_round), fast=True,
                      compile_drafter=True)
    torch._dynamo.reset()
    counters.clear()
    by_len = {len(p): p for p in prompts if len(p) > 5}  # longer than any round's extend
    first, *rest = sorted(by_len.values(), key=len)
    assert len(rest) >= 3
    dec.generate(first, 40)  # no eos: rounds of every accepted count
    before = counters["stats"]["unique_graphs"]
    assert before >= 2  # the draft steps and an extend were compiled: the count is not vacuous
    for p in rest:
        i = prompts.index(p)
        assert dec.generate(p, NEW, eos_ids=[eos])[0] == ref[i]
    assert counters["stats"]["unique_graphs"] == before
