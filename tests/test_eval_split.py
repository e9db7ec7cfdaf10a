"""The training eval split (train/data.is_eval): the parts of one ShareGPT conversation (ids `X_0`, `X_1`, ...)
land on the same side, each conversation scored by its first reply set. Hashing the
full id (with its `_N` suffix) fails test_eval_split_keeps_sharegpt_parts_together."""


import pytest
import torch


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


# ------------------------------------------------------------------ the training eval split

class _Source:
    def __init__(self, ids):
        self.ids = ids
        self.lengths = [10] * len(ids)


def test_eval_split_keeps_sharegpt_parts_together():
    """ShareGPT splits one chat into `<id>_0, <id>_1, ...`: all parts of a chat go to one side."""
    from eyas.train.data import is_eval, split_indices

    g = torch.Generator().manual_seed(0)
    alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    bases = ["".join(alnum[int(i)] for i in torch.randint(0, len(alnum), (7,), generator=g)) for _ in range(300)]
    ids = [f"{b}_{k}" for b in bases for k in range(4)]
    train, ev = split_indices(_Source(ids), 0.2)
    side = {}
    for i in train:
        side.setdefault(ids[i][:7], set()).add("train")
    for i in ev:
        side.setdefault(ids[i][:7], set()).add("eval")
    split = [b for b, s in side.items() if len(s) > 1]
    assert not split, f"{len(split)} chats straddle the eval split, e.g. {split[:3]}"
    assert 30 <= len(ev) // 4 <= 90 and len(train) + len(ev) == len(ids)  # about 20% of the chats
    for b in bases[:20]:
        assert len({is_eval(f"{b}_{k}", 0.2) for k in range(12)}) == 1


def test_eval_split_scores_each_conversation_by_its_first_reply_set():
    """Sampled reply sets `<id>#s1..#s3`: a train-side conversation trains on all three, an eval-side one is scored
    on #s1 alone (the greedy set under --greedy-sample) and its other sets are in neither split."""
    from eyas.train.data import is_eval, split_indices

    ids = [f"c{n}#s{k}" for n in range(200) for k in (1, 2, 3)] + ["plain-a", "plain-b"]
    train, ev = split_indices(_Source(ids), 0.3)
    assert {ids[i] for i in ev} == {i for i in ids if is_eval(i, 0.3) and not i.endswith(("#s2", "#s3"))}
    assert {ids[i] for i in train} == {i for i in ids if not is_eval(i, 0.3)}
    assert 30 <= len(ev) <= 90 and all(ids[i].endswith("#s1") or "#" not in ids[i] for i in ev)
    assert len(train) + 3 * sum(ids[i].endswith("#s1") for i in ev) + sum("#" not in ids[i] for i in ev) == len(ids)
