"""The one-graph tree round (decode/round.py's tree body) decodes exactly like `SpecDecoder`'s greedy tree.

fp32 on the CPU, where the same round code runs eagerly, with the tiny peaky target, the trained drafter, the
prompts (1..240 tokens, some ending at eos mid-round) and the tree settings of test_static_tree.py:
(a) every prompt's tokens == plain greedy decoding of it;
(b) its per-round accepted counts == the eager reference tree's, as the host-driven static tree's are (one test
    parametrized over both modes; test_static_tree.py proves the static trees equal the eager ones);
also with the cache filled to its last checked slot. A round reads nothing back to the host. Injected bugs show
the properties are checked: without the k/v compaction of an accepted side branch the tokens change (a); a
drafter continuing from the wrong path entry keeps (a) but changes (b). The gpu test compares the CUDA graph
(drafter eager and compiled) with the CPU run.
"""

import copy

import pytest
import torch

from eyas.decode.round import RoundDecoder
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.errors import EyasError
from eyas.target.runner import Runner
from test_static_tree import IDS, NEW, SETTINGS, runs, setup, trap_host_reads  # noqa: F401 (setup: fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def tree(top_k=10, depth=6, total=60) -> SpecConfig:
    return SpecConfig(method="tree", top_k=top_k, depth=depth, total_tokens=total)


def decode_all(dec, prompts, eos, new=NEW):
    res = [dec.generate(p, new, eos_ids=[eos]) for p in prompts]
    return [o for o, _ in res], [s.accepted for _, s in res]


_rounds = {}


def round_runs(setup, setting):
    if setting not in _rounds:
        model, runner, drafters, prompts, ref, eos = setup
        name, top_k, depth, total = setting
        _rounds[setting] = decode_all(RoundDecoder(runner, drafters[name], tree(top_k, depth, total)),
                                      prompts, eos)
    return _rounds[setting]


@pytest.mark.parametrize("setting,mode", [(s, m) for s in SETTINGS for m in ("static", "round")],
                         ids=[f"{i}-{m}" for i in IDS for m in ("static", "round")])
def test_tree_modes_equal_plain_greedy_and_eager_acceptance(setup, setting, mode):
    """The host-driven static tree and the one-graph round: plain greedy's tokens and, round by round, the eager
    reference tree's accepted counts."""
    ref = setup[4]
    (_, acc_eager, _), static = runs(setup, setting)
    outs, acc = round_runs(setup, setting) if mode == "round" else static[:2]
    assert outs == ref  # (a)
    assert acc == acc_eager  # (b)
    if setting[0] == "trained":  # acceptance is non-trivial; the bigger trees accept paths of 2+ drafts
        assert sum(map(sum, acc)) / sum(map(len, acc)) > 0.3, acc
        assert setting[3] < 16 or max(max(a) for a in acc) >= 2, acc


def side_branch_rounds(setup, setting) -> int:
    """Rounds of the host-driven static tree whose accepted path was not nodes 0..a (k/v had to move)."""
    model, runner, drafters, prompts, ref, eos = setup
    name, top_k, depth, total = setting
    dec = SpecDecoder(runner, drafters[name], tree(top_k, depth, total), fast=True)
    moved = []
    copy_slots = runner.copy_slots
    runner.copy_slots = lambda src, dst, row=0: moved.append(1) or copy_slots(src, dst, row)
    try:
        decode_all(dec, prompts, eos)
    finally:
        del runner.copy_slots
    return len(moved)


def test_without_compaction_the_tokens_change(setup, monkeypatch):
    """An accepted side branch leaves its k/v at its tree slots; without moving them next to the prefix the
    next round attends the wrong keys."""
    setting = ("trained", 10, 6, 60)
    assert side_branch_rounds(setup, setting) >= 3  # the default tree accepts side branches here
    model, runner, drafters, prompts, ref, eos = setup
    dec = RoundDecoder(runner, drafters["trained"], tree())
    monkeypatch.setattr(runner, "copy_slots", lambda src, dst, row=0: None)
    outs, _ = decode_all(dec, prompts, eos)
    assert outs != ref


def test_drafter_continuing_from_the_wrong_entry_changes_acceptance_only(setup, monkeypatch):
    """`last` taken one entry past the accepted node: the target still decides every token, the drafts change."""
    model, runner, drafters, prompts, ref, eos = setup
    dec = RoundDecoder(runner, drafters["trained"], tree(4, 5, 16))

    def commit(self, aux, tokens, acc):
        out = self._write_fn(aux, tokens[None])  # (1,P,h)
        self.last.copy_(out.index_select(1, (acc + 1).clamp(max=tokens.numel() - 1)))
        self.n.add_(acc[0] + 1)
    monkeypatch.setattr(type(dec.drafting), "commit", commit)
    outs, acc = decode_all(dec, prompts, eos)
    assert outs == ref
    assert acc != round_runs(setup, ("trained", 4, 5, 16))[1]


def test_verify_mask_is_the_eager_mask(setup, monkeypatch):
    """Every round's verify mask is `SpecDecoder`'s eager one over the whole cache: node i attends slots 0..n-1
    and its ancestors' slots n + j, and nothing at or beyond n+S (stale k/v of earlier, longer prompts)."""
    model, runner, drafters, prompts, ref, eos = setup
    dec = RoundDecoder(runner, drafters["trained"], tree(4, 5, 16))
    d, S, M = dec.drafting, dec.S, runner.cfg.max_seq
    seen, tree_fn, verify = [], d._tree_fn, dec._verify
    monkeypatch.setattr(d, "_tree_fn", lambda: seen.append([int(d.n), tree_fn()]) or seen[-1][1])
    monkeypatch.setattr(dec, "_verify", lambda *a: seen[-1].append(a[3].clone()) or verify(*a))
    dec.generate(prompts[4], NEW)
    assert len(seen) >= 5
    for r, (n, t, mask) in enumerate(seen):
        assert n + S < M  # slots past the tree exist
        eager = torch.zeros(1, S, M, dtype=torch.bool)
        eager[0, :, :n] = True
        eager[0, :, n:n + S] = t.mask
        late = mask[0, :, n + S:].any(-1).nonzero().flatten().tolist()
        assert late == [], f"round {r}: nodes {late} attend slots at or beyond n+S"
        assert torch.equal(mask, eager), f"round {r}: verify mask != the eager mask"


def test_paths_ending_at_the_last_node_equal_plain_greedy(setup, monkeypatch):
    """A one-level tree of every draft token, ranked by a drafter with its head negated: the last node is the
    trained drafter's first choice, so many rounds accept it and take the bonus token from its logits."""
    model, runner, drafters, prompts, ref, eos = setup
    rev = copy.deepcopy(drafters["trained"])
    with torch.no_grad():
        rev.lm_head.weight.neg_()
    V = rev.config.draft_vocab_size
    dec = RoundDecoder(runner, rev, tree(V, 1, V))
    ends, copy_slots = [], runner.copy_slots  # copy_slots(n + path, n + 0..P-1): path[acc] is the accepted node
    monkeypatch.setattr(runner, "copy_slots",
                        lambda src, dst, row=0: ends.append(src - dst[0]) or copy_slots(src, dst, row))
    short = [(p, want) for p, want in zip(prompts, ref) if len(p) + NEW + dec.S <= runner.cfg.max_seq]
    last = 0
    for p, want in short:
        ends.clear()
        out, stats = dec.generate(p, NEW, eos_ids=[eos])
        assert out == want
        last += sum(int(path[a]) == dec.S - 1 for path, a in zip(ends, stats.accepted))
    assert len(short) >= 5 and last >= 10, last  # not vacuous


def test_a_round_never_reads_the_device(setup, monkeypatch):
    """The round body calls no item/tolist/bool/int/float/nonzero on a tensor (each a host sync on CUDA)."""
    model, runner, drafters, prompts, ref, eos = setup
    dec = RoundDecoder(runner, drafters["trained"], tree())
    dec.generate(prompts[3], 4)  # a committed state after a few rounds
    calls = trap_host_reads(monkeypatch)
    info = dec._round()
    assert calls == [], calls
    assert info.shape == (dec.P + 1,)


def test_cache_filled_to_the_end(setup):
    """A prompt that leaves exactly room for max_new tokens and one tree: the host waits before launching a round
    that might not fit, and the tokens are still plain greedy's."""
    model, runner, drafters, prompts, ref, eos = setup
    dec = RoundDecoder(runner, drafters["trained"], tree())
    M = runner.cfg.max_seq
    prompt = (prompts[-1] * 2)[: M - NEW - dec.S]
    out, stats = dec.generate(prompt, NEW)
    assert out == runner.generate([prompt], NEW)[0] and stats.tokens == NEW
    with pytest.raises(EyasError, match="exceed the target cache"):
        dec.generate(prompt + [5], NEW)


def test_spec_decoder_graph_round_flag_dispatches_here(setup):
    model, runner, drafters, prompts, ref, eos = setup
    dec = SpecDecoder(runner, drafters["trained"], SpecConfig(method="tree", graph_round=True))
    assert isinstance(dec._round, RoundDecoder)
    outs, acc = decode_all(dec, prompts[::3], eos)
    direct = round_runs(setup, ("trained", 10, 6, 60))
    assert outs == ref[::3] == direct[0][::3] and acc == direct[1][::3]


def test_bad_input_refused(setup):
    model, runner, drafters, *_ = setup
    d = drafters["trained"]
    assert RoundDecoder(runner, d, SpecConfig(method="chain")).drafting.tree is None  # a chain config: chain rounds
    with pytest.raises(EyasError, match="greedy chains and trees only"):
        RoundDecoder(runner, d, SpecConfig(method="plain"))
    with pytest.raises(EyasError, match="greedy chains and trees only"):
        RoundDecoder(runner, d, SpecConfig(method="tree", temperature=0.5))
    with pytest.raises(EyasError, match="needs a drafter"):
        RoundDecoder(runner, None, tree())
    with pytest.raises(EyasError, match="400 draft nodes does not fit a target cache of 352"):
        RoundDecoder(runner, d, tree(10, 6, 400))
    with pytest.raises(EyasError, match="empty prompt"):
        RoundDecoder(runner, d, tree()).generate([], NEW)


# ---------------------------------------------------------------- CUDA graph == CPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True], ids=["eager-drafter", "compiled-drafter"])
def test_cuda_graph_round_equals_cpu(setup, compile):
    """One CUDA graph per round (captured once, replayed): the CPU round's tokens and acceptance; the round body,
    run outside the graph under the sync debugger, never syncs."""
    model, runner, drafters, prompts, ref, eos = setup
    setting = ("trained", 10, 6, 60)
    outs_cpu, acc_cpu = round_runs(setup, setting)
    gpu = Runner.from_hf(model, max_batch=1, max_seq=runner.cfg.max_seq, device="cuda")
    dec = RoundDecoder(gpu, copy.deepcopy(drafters["trained"]), tree(), compile_drafter=compile)
    outs, acc = decode_all(dec, prompts, eos)
    assert outs == ref == outs_cpu
    assert acc == acc_cpu
    torch.cuda.synchronize()
    # under no_grad, as generate() runs it: a compiled proposer called with grad on recompiles, and inductor's
    # compile syncs (constant folding), which the debugger would blame on the round
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            dec._round()
        finally:
            torch.cuda.set_sync_debug_mode(0)
