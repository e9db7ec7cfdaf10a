"""metrics.round_counts replays greedy chain decoding from one TTT forward: its tau equals what `SpecDecoder`
measures on the same replies, round for round, while the per-position estimate (chain_acceptance) does not.

fp32 on the CPU with the tiny peaky target, briefly trained drafter, prompts and mid-round eos of
test_batch_chains.py. The replies are the target's own greedy outputs (what regeneration trains on), so a chain
drafted at position t in decoding is exactly TTT's step-0..K-1 predictions at t. Two samples share each packed
row (segment ids, positions restarting) to cover the packed eval batches too.
"""

import pytest
import torch

from eyas.decode.spec import SpecConfig, SpecDecoder, SpecStats
from eyas.target.load import target_from_model
from eyas.train.data import Batch, target_features
from eyas.train.metrics import chain_acceptance, round_counts
from eyas.train.ttt import TTTConfig, ttt_forward
from test_batch_chains import NEW, setup  # noqa: F401 (setup: fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

K = 4


def ttt_rows(model, drafter, rows):
    """rows: list of [(prompt, reply), ...] packed together -> (TTTOutput, loss_mask, valid, segment_ids)."""
    T = max(sum(len(p) + len(r) for p, r in row) for row in rows)
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    lm, valid = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
    seg, pos = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(rows):
        c = 0
        for s, (p, r) in enumerate(row):
            n = len(p) + len(r)
            ids[b, c:c + n] = torch.tensor(p + r)
            lm[b, c + len(p):c + n] = True
            valid[b, c:c + n] = True
            seg[b, c:c + n] = s + 1
            pos[b, c:c + n] = torch.arange(n)
            c += n
    target = target_from_model(model, aux_layer_ids=drafter.config.aux_layer_ids)
    feats = Batch(["x"] * B, ids, lm, valid)
    for b, row in enumerate(rows):  # features per sample (the target sees each conversation alone)
        c = 0
        for p, r in row:
            n = len(p) + len(r)
            one = target_features(target, Batch(["x"], ids[b:b + 1, c:c + n], lm[b:b + 1, c:c + n],
                                                 valid[b:b + 1, c:c + n]))
            if feats.aux is None:
                feats.aux = one.aux.new_zeros(B, T, one.aux.shape[-1])
                feats.final = one.final.new_zeros(B, T, one.final.shape[-1])
            feats.aux[b, c:c + n], feats.final[b, c:c + n] = one.aux[0], one.final[0]
            c += n
    with torch.no_grad():
        out = ttt_forward(drafter, input_ids=ids, loss_mask=lm, valid=valid, aux=feats.aux, final=feats.final,
                          embed=model.get_input_embeddings(), lm_head_weight=model.lm_head.weight,
                          cfg=TTTConfig(num_steps=K, attention="dense"), segment_ids=seg, position_ids=pos)
    return out, lm, valid, seg


def test_round_counts_equal_decoding(setup):
    model, runner, drafter, prompts, ref, eos = setup
    pairs = [(p, r) for p, r in zip(prompts, ref) if len(p) >= 2]
    rows = [pairs[i:i + 2] for i in range(0, len(pairs), 2)]
    out, lm, valid, seg = ttt_rows(model, drafter, rows)
    counts = round_counts(out.accept_len, lm, valid, seg, K)
    assert out.accept_len.max() == K and out.accept_len[lm].min() == 0  # full chains and misses both occur
    cond = (out.cond_correct_k / out.cond_count_k.clamp(min=1)).tolist()
    for j in range(1, K + 1):
        dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=j), fast=False)
        total = SpecStats()
        for p, r in pairs:
            o, st = dec.generate(p, NEW, eos_ids=[eos])
            assert o == r
            total.add(st)
        # the replies end at eos inside rounds or at max_new_tokens: both are cut where decoding cuts them
        assert (counts[j - 1], counts[K + j - 1]) == (total.tokens, total.target_forwards), j
        if j > 1:  # the per-position average is a different (biased) number: the replay is what is checked
            assert abs(chain_acceptance(cond[:j]) - total.tau) > 1e-3


def test_round_counts_by_hand():
    """One reply of 7 tokens after a 3-token prompt; accept_len at the positions rounds start from."""
    lm = torch.tensor([[False, False, False, True, True, True, True, True, True, True, False]])
    valid = torch.ones_like(lm)
    acc = torch.zeros(1, 11, dtype=torch.long)
    acc[0, 2], acc[0, 5] = 2, 3  # round 1 from t=2 accepts 2 (+bonus): t=5 accepts 3 (+bonus): x_3..x_9 done
    c = round_counts(acc, lm, valid, None, 3)
    # chain-3: prefill (x_3) + a round from t=2 (x_4..x_6) + one from t=5 (x_7..x_9, its 4th token cut)
    assert c[2].item() == 7 and c[3 + 2].item() == 3
    # chain-1: prefill + rounds from t=2 (a=1), t=4 (a=0), t=5 (a=1), t=7 (a=0): x_9 is the last bonus
    assert c[0].item() == 7 and c[3].item() == 5


def test_round_counts_first_replies_are_each_samples_first_run():
    """A packed row of two samples: sample 1 holds two replies (turns 1 and 2), sample 2 one. The first-reply counts
    are the replay of exactly the runs that open a sample, the same as replaying a mask holding only those runs."""
    T, K = 24, 3
    seg = torch.tensor([[1] * 14 + [2] * 8 + [0] * 2])
    valid = seg > 0
    lm = torch.zeros(1, T, dtype=torch.bool)
    lm[0, 3:7] = True      # sample 1, reply 1 (turn 1)
    lm[0, 9:14] = True     # sample 1, reply 2 (turn 2): not a first reply
    lm[0, 16:22] = True    # sample 2, reply 1
    acc = torch.tensor([[0, 1, 2, 3, 1, 0, 2, 1, 3, 3, 2, 1, 0, 2, 1, 0, 3, 2, 1, 3, 0, 1, 0, 0]])
    c = round_counts(acc, lm, valid, seg, K)
    assert c.shape == (4 * K,)
    first_only = lm.clone()
    first_only[0, 9:14] = False
    ref = round_counts(acc, first_only, valid, seg, K)
    assert torch.equal(c[2 * K:], ref[:2 * K])                       # first replies: runs 1 and 3
    assert torch.equal(ref[:2 * K], ref[2 * K:])                     # a mask of first replies only: all are first
    assert (c[:2 * K] > c[2 * K:]).all()                             # the second turn adds tokens and forwards
    # without segment ids (one sample per row) the row's first run is the only first reply
    one = round_counts(acc, lm & (seg == 1), valid, None, K)
    only_first = lm & (seg == 1)
    only_first[0, 9:14] = False
    assert torch.equal(one[2 * K:], round_counts(acc, only_first, valid, None, K)[:2 * K])
