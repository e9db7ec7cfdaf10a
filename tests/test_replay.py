"""Replay: chain decoding accepts exactly what the TTT eval says it would, position by position.

The target's greedy continuation of a prompt (fp32) is fixed, so it is known in advance which token
every draft step must produce. Two computations of the drafter over that text must agree:

(a) teacher-forced, as the TTT eval computes it: `ttt_forward` with a one-hot loss mask at position s
    counts exactly one (t, k) per step k (t = s-k-2), so its correct_k / loss_k ("sum") give, per
    (t, k), whether step k at t is counted and right, and its soft cross-entropy;
(b) decoded: `SpecDecoder` chains, recording for every round which position it starts from, each
    draft step's logits and how many drafts the target accepted.

Round r starts from drafter entry p = committed - 1 (its step 0 predicts x_{p+2}), so draft step j
of the round is TTT step j at t = p. Greedy acceptance of a chain is then "the leading steps that
are right"; a step whose target token is outside the draft vocabulary is not counted by TTT and can
never be accepted by decoding, so both read it as a miss. The continuation is generated K+1 tokens
past the decoded length, so the last round's drafts still have known targets (the sequence end).

Acceptance alone would be weak with a random drafter (it is almost never right), so the drafter is
trained briefly, and in addition every decoded step whose inputs were teacher-forced (all steps
when the chain is forced along the continuation, steps up to the first miss otherwise) must give the
TTT eval's cross-entropy to fp32 precision. A stale or extra key slot, or a RoPE position off by
one, in the decode-time drafter changes those numbers (test_injected_decode_bugs_are_caught).
"""

from __future__ import annotations

import pytest
import torch

from support.models import make_tiny_llama
from eyas.decode import eagle as eagle_mod
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.model.vocab import build_draft_vocab
from eyas.target.runner import Runner
from eyas.train.ttt import TTTConfig, target_logits_from_final, ttt_forward

K = 4  # chain length = TTT steps


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


# ----------------------------------------------------------------------------- helpers
def features(model, aux_ids, x: list[int]):
    """One full-sequence fp32 prefill: aux (1,T,3h) and the final-norm output (1,T,h)."""
    with torch.no_grad():
        hs = model(torch.tensor([x]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in aux_ids], -1), hs[-1]


def teacher_forced(drafter, model, aux_ids, x: list[int], n: int, num_steps: int):
    """Per (t, k): counted, right and soft CE of TTT step k at position t, as ttt_forward computes them."""
    T = len(x)
    aux, final = features(model, aux_ids, x)
    ids = torch.tensor([x])
    counted = torch.zeros(T, num_steps, dtype=torch.bool)
    right = torch.zeros(T, num_steps, dtype=torch.bool)
    ce = torch.full((T, num_steps), float("nan"), dtype=torch.float64)
    cfg = TTTConfig(num_steps=num_steps, reduction="sum")
    for s in range(n + 1, T):
        lm = torch.zeros(1, T, dtype=torch.bool)
        lm[0, s] = True
        with torch.no_grad():
            out = ttt_forward(drafter, input_ids=ids, loss_mask=lm, valid=torch.ones(1, T, dtype=torch.bool),
                              aux=aux, final=final, embed=model.get_input_embeddings(),
                              lm_head_weight=model.lm_head.weight, cfg=cfg)
        for k in range(num_steps):
            t = s - k - 2
            if t < 0:
                continue
            assert int(out.count_k[k]) <= 1  # one-hot loss mask: at most one counted (t, k) per step
            counted[t, k] = bool(out.count_k[k])
            right[t, k] = bool(out.correct_k[k])
            if counted[t, k]:
                ce[t, k] = float(out.loss_k[k])
    return counted, right, ce, final[0]


def chain_walk(right, start: int, rounds: int, K: int):
    """Greedy chain decoding replayed on the teacher-forced table: (round starts, accepted per round)."""
    starts, acc, p = [], [], start
    for _ in range(rounds):
        a = 0
        while a < K and right[p, a]:
            a += 1
        starts.append(p)
        acc.append(a)
        p += a + 1
    return starts, acc


class Probe:
    """Records every chain draft step of a SpecDecoder (round start p, step j, draft logits) by wrapping
    the drafter's `logits` and `draft_to_target`, which the eager and the static-cache drafters both call
    once per step; with `force`, the step's token is replaced by the continuation's x_{p+j+2}."""

    def __init__(self, dec: SpecDecoder, x: list[int], force: bool):
        self.steps: list[tuple[int, int, torch.Tensor]] = []
        self.starts: list[int] = []
        drafting, d = dec.drafting, dec.drafting.drafter if hasattr(dec.drafting, "drafter") else dec.drafting.d
        logits, to_target, propose = d.logits, d.draft_to_target, drafting.propose_chain
        self.p = self.j = None

        def propose_chain(*a, **kw):
            self.p, self.j = int(drafting.n) - 1, 0
            self.starts.append(self.p)
            return propose(*a, **kw)

        def rec_logits(hidden):
            lg = logits(hidden)
            self.steps.append((self.p, self.j, lg[0, -1].detach().double().clone()))
            return lg

        def rec_to_target(ids):
            tok = to_target(ids)
            if force:
                tok = torch.full_like(tok, x[self.p + self.j + 2])
            self.j += 1
            return tok

        drafting.propose_chain, d.logits, d.draft_to_target = propose_chain, rec_logits, rec_to_target
        self.undo = lambda: [delattr(o, name) for o, name in ((drafting, "propose_chain"), (d, "logits"),
                                                              (d, "draft_to_target"))]


def decode(runner, drafter, x, n, new, *, force, fast):
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=K), fast=fast)
    probe = Probe(dec, x, force)
    try:
        out, stats = dec.generate(x[:n], new)
    finally:
        probe.undo()
    assert out == x[n:n + new]  # lossless (fp32): decoding reproduces the fixed greedy continuation
    return probe, stats


def draft_ce(drafter, final, lm_head_weight, t_plus_k_plus_1: int, logits: torch.Tensor) -> float:
    """The TTT eval's soft CE for one step, from decode-time draft logits (Vd,)."""
    w = lm_head_weight[drafter.token_ids]
    p = torch.softmax(target_logits_from_final(final[t_plus_k_plus_1], w).double(), -1)
    return float(-(p * torch.log_softmax(logits, -1)).sum())


def replay(drafter, model, runner, aux_ids, x: list[int], n: int, new: int, *, fast: bool, num_steps: int = K):
    """Everything both computations say about sequence x (prompt x[:n], `new` tokens decoded)."""
    assert len(x) >= n + new + num_steps + 1, "the continuation must cover the last round's drafts"
    counted, right, ce, final = teacher_forced(drafter, model, aux_ids, x, n, num_steps)
    W = model.lm_head.weight.detach()
    # (b1) free decoding: round starts and accepted counts equal the walk over the TTT table
    probe, stats = decode(runner, drafter, x, n, new, force=False, fast=fast)
    starts, acc = chain_walk(right, n - 1, len(stats.accepted), num_steps)
    hit_dec, hit_ttt, ces_dec, ces_ttt = [], [], [], []

    def compare(p, j, lg):  # one teacher-forced decode step against TTT step j at t = p
        hit_dec.append((p, j, int(drafter.draft_to_target(lg.argmax())) == x[p + j + 2]))
        hit_ttt.append((p, j, bool(right[p, j])))
        if counted[p, j]:
            ces_dec.append(draft_ce(drafter, final, W, p + j + 1, lg))
            ces_ttt.append(float(ce[p, j]))

    for p, j, lg in probe.steps:
        r = probe.starts.index(p)
        if j > stats.accepted[r]:
            continue  # this step's input token was a rejected draft: not teacher-forced
        compare(p, j, lg)
    # (b2) chains forced along the continuation, from K+1 prompt offsets: every (t, k) of the replies
    seen = set()
    for o in range(num_steps + 1):
        fprobe, fstats = decode(runner, drafter, x, n + o, new - o, force=True, fast=fast)
        assert set(fstats.accepted) == {num_steps}  # forced drafts are the target's own tokens
        for p, j, lg in fprobe.steps:
            seen.add((p, j))
            compare(p, j, lg)
    return dict(starts=(probe.starts, starts), accepted=(stats.accepted, acc), hit=(hit_dec, hit_ttt),
                ce=(ces_dec, ces_ttt), seen=seen, counted=counted, right=right, stats=stats)


def assert_agree(res, n: int, new: int, num_steps: int = K):
    assert res["starts"][0] == res["starts"][1]
    assert res["accepted"][0] == res["accepted"][1]
    assert res["hit"][0] == res["hit"][1]  # the draft argmax is the target's token exactly where TTT says
    every = {(t, k) for t in range(n - 1, n + new - 2) for k in range(num_steps)}
    assert every <= res["seen"], sorted(every - res["seen"])[:5]
    torch.testing.assert_close(torch.tensor(res["ce"][0]), torch.tensor(res["ce"][1]), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- tiny target
AUX = (1, 2, 3)
N_PROMPT, NEW = 6, 40


def peaky(model, scale, layer_scale):
    """Sharpen the target (lm_head * scale) and shrink its layers' residual writes, so the next token
    depends mostly on the current one: a target a tiny drafter learns to predict in seconds."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    return model


def train_ttt(drafter, model, aux_ids, seqs, n, steps, lr=3e-3, num_steps=K):
    """A few Adam steps of the full K-step TTT loss on the target's own greedy text."""
    x = torch.tensor(seqs)
    B, T = x.shape
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states
    aux, final = torch.cat([hs[i] for i in aux_ids], -1), hs[-1]
    lm = torch.zeros(B, T, dtype=torch.bool)
    lm[:, n:] = True
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    drafter.train()
    for _ in range(steps):
        out = ttt_forward(drafter, input_ids=x, loss_mask=lm, valid=torch.ones(B, T, dtype=torch.bool), aux=aux,
                          final=final, embed=model.get_input_embeddings(), lm_head_weight=model.lm_head.weight,
                          cfg=TTTConfig(num_steps=num_steps))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def tiny_trained():
    model = peaky(make_tiny_llama(seed=11), 4.0, 0.3)
    runner = Runner.from_hf(model, max_batch=8, max_seq=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (N_PROMPT,), generator=g).tolist() for _ in range(26)]
    seqs = [p + o for p, o in zip(prompts, runner.generate(prompts, NEW + K + 1))]
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s[N_PROMPT:]]), minlength=256)
    # Draft vocab: every reply token but the 3 rarest of the held-out replies, so some draft steps have
    # a target outside the draft vocabulary (TTT does not count them; decoding cannot accept them).
    held = sorted({t for s in seqs[24:] for t in s[N_PROMPT + 1:]}, key=lambda t: (int(counts[t]), t))
    counts[held[:3]] = 0
    size = int((counts > 0).sum())
    vocab = build_draft_vocab(counts, size)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=size, aux_layer_ids=AUX)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    train_ttt(drafter, model, AUX, seqs[:24], N_PROMPT, steps=120)
    return model, runner, drafter, seqs[24:], vocab


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "static-cache"])
def test_decoded_acceptance_equals_teacher_forced(tiny_trained, fast):
    model, runner, drafter, held, vocab = tiny_trained
    outside = accepted = deep = 0
    for x in held:
        res = replay(drafter, model, runner, AUX, x, N_PROMPT, NEW, fast=fast)
        assert_agree(res, N_PROMPT, NEW)
        accepted += sum(res["accepted"][0])
        deep += sum(a >= 2 for a in res["accepted"][0])
        outside += int((~vocab.t2d[torch.tensor(x[N_PROMPT + 1:])]).sum())
    # the comparison is not vacuous: drafts are accepted, deep chains happen, and some reply tokens are
    # outside the draft vocabulary
    assert accepted >= 10 and deep >= 3 and outside >= 1, (accepted, deep, outside)


# ----------------------------------------------------------------------------- injected decode bugs
def decode_step(mask) -> bool:
    """Whether a drafter layer call is a decode-time draft step (one query, a dense mask); TTT's CPU attention
    passes its own block structure instead of a mask, and the teacher-forced side must stay correct."""
    return isinstance(mask, torch.Tensor) and mask.shape[1] == 1


def _stale_slot(orig):
    """Draft step attends one extra stale key: the cache's first key is appended again."""
    def layer(hidden, emb, pos, mask, cache=None):
        if cache is not None and decode_step(mask):
            k, v = cache
            cache = (torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2))
            mask = torch.cat([mask[..., :-1], torch.ones_like(mask[..., :1]), mask[..., -1:]], -1)
            out, (k2, v2) = orig(hidden, emb, pos, mask, cache)
            keep = [i for i in range(k2.shape[2]) if i != k2.shape[2] - 2]
            return out, (k2[:, :, keep], v2[:, :, keep])
        return orig(hidden, emb, pos, mask, cache)
    return layer


def _rope_off_by_one(orig):
    """Draft steps (one query at a time) run at RoPE position p+k+1 instead of p+k."""
    def layer(hidden, emb, pos, mask, cache=None):
        if cache is not None and decode_step(mask):
            pos = pos + 1
        return orig(hidden, emb, pos, mask, cache)
    return layer


def _hide_newest_key(orig):
    """Draft steps cannot see the newest cached key (a mask off by one)."""
    def layer(hidden, emb, pos, mask, cache=None):
        if cache is not None and decode_step(mask):
            mask = mask.clone()
            live = mask[0, 0, :-1].nonzero().flatten()
            committed = [i for i in live.tolist() if i < cache[0].shape[2]]
            if committed:
                mask[0, 0, committed[-1]] = False
        return orig(hidden, emb, pos, mask, cache)
    return layer


@pytest.mark.parametrize("bug", [_stale_slot, _rope_off_by_one, _hide_newest_key],
                         ids=["stale-slot", "rope-off-by-one", "mask-off-by-one"])
def test_injected_decode_bugs_are_caught(tiny_trained, bug, monkeypatch):
    """Each bug keeps decoding lossless (the target verifies) but must break the replay agreement."""
    model, runner, drafter, held, _ = tiny_trained
    x = held[0]
    monkeypatch.setattr(drafter, "layer", bug(drafter.layer))
    res = replay(drafter, model, runner, AUX, x, N_PROMPT, NEW, fast=False)
    with pytest.raises(AssertionError):
        assert_agree(res, N_PROMPT, NEW)
    # by a wide margin: the correct drafter agrees to ~5e-7 here, these bugs move the CE by >1e-2
    assert max(abs(a - b) for a, b in zip(*res["ce"])) > 1e-3


# ----------------------------------------------------------------------------- the real target
@pytest.mark.slow
def test_smollm2_decoded_acceptance_equals_teacher_forced():
    """The same agreement with the embedded SmolLM2-135M (fp32) and a drafter fitted for a few steps to
    this one reply (so that chains are accepted), eager and static-cache drafting."""
    from eyas.target.load import load_target

    target = load_target("smollm2-135m")
    model, tok, aux_ids = target.model, target.tokenizer, target.aux_layer_ids
    new = 48
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain in a few sentences why the sky is blue."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    n = len(prompt)
    runner = Runner.from_hf(model, max_batch=1, max_seq=n + new + 2 * K + 8)
    x = prompt + runner.generate([prompt], new + K + 1)[0]
    assert len(x) == n + new + K + 1
    counts = torch.bincount(torch.tensor(x), minlength=target.vocab_size)
    reply = sorted(set(x[n + 1:]), key=lambda t: (int(counts[t]), t))
    counts[reply[:2]] = 0  # two reply tokens outside the draft vocabulary
    vocab = build_draft_vocab(counts, 1024)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=1024, aux_layer_ids=aux_ids)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    train_ttt(drafter, model, aux_ids, [x], n, steps=30, lr=1e-3)
    for fast in (False, True):
        res = replay(drafter, model, runner, aux_ids, x, n, new, fast=fast)
        assert_agree(res, n, new)
        acc = res["accepted"][0]
        assert sum(acc) >= 10 and sum(a >= 2 for a in acc) >= 2, acc  # chains are accepted, not vacuous
