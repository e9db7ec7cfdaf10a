"""Tests that each fail under one mutation of the code (the mutation is named beside each test).

| mutation                                                               | test                                        |
|------------------------------------------------------------------------|---------------------------------------------|
| sampling.accept_fixed: residual after a rejection not renormalised     | test_point_mass_children_keep_the_target_law |
| writer: manifest + committed count updated before the shard is written | test_manifest_matches_shards_after_enospc,   |
|                                                                        | test_manifest_matches_shards_after_kill_9    |
| writer: shard renamed before its fsync / no directory fsync            | test_fsync_before_rename_before_commit       |
| train/data.is_eval hashes the full ShareGPT id (with its `_N` suffix)  | test_eval_split_keeps_sharegpt_parts_together |
| graphed drafter: a draft step attends one stale slot                   | test_graphed_chain_logits_equal_eager_*      |
| tree: nodes do not attend their draft ancestors                        | test_tree_node_logits_equal_forced_chains    |
| tree: next level expanded from the wrong parent's hidden state         | test_tree_node_logits_equal_forced_chains    |
"""

import copy
import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from support.models import make_tiny_llama
from eyas.decode.eagle import EagleDrafting
from eyas.decode.cache import DraftCache
from eyas.decode.tree import Draft, chain, select_tree, verify
from eyas.errors import EyasError
from eyas.manifest import MANIFEST, read_manifest
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.store import Store, StoreWriter
from eyas.store import format as fmt

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


# ------------------------------------------------------------------ sampling: point-mass children

def chi2_critical(df, z=3.09):
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("children", [[0, 1, 2], [3, 1, 5]], ids=["top3", "mixed"])
def test_point_mass_children_keep_the_target_law(children):
    """A root with 3 deterministic children and a flat-ish target law: the first emitted token is
    distributed as p. Without renormalising the residual after each rejection, child j is accepted
    with p_j instead of p_j / (1 - rejected mass); at p = .30/.25 that moves ~7% of the mass."""
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    draft = Draft([0] + children, [-1, 0, 0, 0])  # deterministic children: q = [] (point masses)
    logits = p.log().expand(len(draft), -1)  # (S, V): every node sees the same law
    gen = torch.Generator().manual_seed(1234)
    n = 20_000
    counts = torch.zeros(len(p))
    for _ in range(n):
        path, bonus = verify(draft, logits, 1.0, 1.0, gen)
        counts[draft.tokens[path[1]] if len(path) > 1 else bonus] += 1
    stat = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert stat < chi2_critical(len(p) - 1), (stat, (counts / n).tolist())


# ------------------------------------------------------------------ store: manifest vs shards, fsync order

H = 8


def header():
    return {"target": {"identity": "tiny", "config_sha256": "c", "tokenizer_sha256": None},
            "layers": {"aux": [1, 2, 3]}, "dtype": "bf16", "hidden_size": H, "vocab_size": 100,
            "data": {"source": "test"}, "config": {}}


def store_samples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(n):
        t = 3 + k
        out[f"s{k}"] = (torch.randint(0, 100, (t,), generator=g), torch.randint(0, 2, (t,), generator=g),
                        torch.randn(t, 3, H, generator=g), torch.randn(t, H, generator=g))
    return out


def assert_manifest_agrees(path, expected_samples):
    """The manifest counts what a reader sees, and every shard it lists is on disk at its size."""
    m = read_manifest(path, kind=fmt.KIND)
    reader = Store(path, allow_incomplete=True)
    assert m["num_samples"] == len(reader) == expected_samples, (m["num_samples"], len(reader))
    assert m["num_shards"] == len(m["shards"]) == len(reader.records)
    assert sorted(s["file"] for s in m["shards"]) == [r["file"] for r in reader.records]
    for s in m["shards"]:
        f = path / s["file"]
        assert f.exists() and f.stat().st_size == s["bytes"], s["file"]
    reader.verify()


def finish_and_compare(path, samples):
    """Resume the interrupted store with the missing samples; it must equal the samples exactly."""
    w = StoreWriter(path, header=header(), shard_bytes=1, threads=1)
    for sid, (ids, mask, aux, final) in samples.items():
        if sid not in w.committed_ids:
            w.add_sample(sid, ids, mask, aux, final)
    w.close()
    assert w.finalize(set(samples))["complete"]
    store = Store(path, dtype=torch.float32)
    assert sorted(store.ids) == sorted(samples) and len(store.ids) == len(set(store.ids))
    store.verify()
    for sid, (ids, mask, aux, final) in samples.items():
        s = store.by_id(sid)
        assert torch.equal(s.input_ids, ids) and torch.equal(s.aux, aux.bfloat16().float()), sid
    assert not [p for p in os.listdir(path) if p.startswith(".")]


def test_manifest_matches_shards_after_enospc(tmp_path, monkeypatch):
    import eyas.store.writer as writer
    samples = store_samples(6)
    real, calls = writer._write_file, []

    def full_disk(path, data):
        calls.append(path)
        if len(calls) == 3:  # the third shard: half written, then the disk is full
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(writer, "_write_file", full_disk)
    p = tmp_path / "s"
    w = StoreWriter(p, header=header(), shard_bytes=1, threads=1)  # one sample per shard
    with pytest.raises(EyasError, match="disk full") as err:
        try:
            for sid, (ids, mask, aux, final) in samples.items():
                w.add_sample(sid, ids, mask, aux, final)
            w.close()
        finally:
            w.abort()
    said = int(re.search(r"keeps its (\d+) committed samples", str(err.value)).group(1))
    assert said == 2, str(err.value)
    assert_manifest_agrees(p, said)
    monkeypatch.setattr(writer, "_write_file", real)
    finish_and_compare(p, samples)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path[:0] = [{tests!r}, {src!r}]
    import eyas.store.writer as writer
    from test_survivors import header, store_samples
    real, calls = writer._write_file, []

    def killed(path, data):
        calls.append(path)
        if len(calls) == {kill_at}:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, data)

    writer._write_file = killed
    w = writer.StoreWriter({out!r}, header=header(), shard_bytes=1, threads=1)
    for sid, (ids, mask, aux, final) in store_samples({n}).items():
        w.add_sample(sid, ids, mask, aux, final)
    w.close()
""")


@pytest.mark.parametrize("kill_at", [1, 3])
def test_manifest_matches_shards_after_kill_9(tmp_path, kill_at):
    """kill -9 in the middle of writing shard `kill_at`: the manifest lists exactly the committed shards."""
    p, n = tmp_path / "s", 6
    code = KILL_SCRIPT.format(tests=str(ROOT / "tests"), src=str(ROOT / "src"), out=str(p), n=n, kill_at=kill_at)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert_manifest_agrees(p, kill_at - 1)
    finish_and_compare(p, store_samples(n))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fsync'd descriptors")
def test_fsync_before_rename_before_commit(tmp_path, monkeypatch):
    """Per shard: fsync(temp file) < rename(temp -> shard) < fsync(directory) < rename(-> sidecar) <
    rename(-> manifest); the sidecar and manifest temp files are fsync'd before their renames too."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, **kw)

    p = tmp_path / "s"
    p.mkdir()
    p = p.resolve()
    samples = store_samples(3)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    w = StoreWriter(p, header=header(), shard_bytes=1, threads=1)
    for sid, (ids, mask, aux, final) in samples.items():
        w.add_sample(sid, ids, mask, aux, final)
    w.close()
    w.finalize(set(samples))
    monkeypatch.undo()

    def index(ev, start=0):
        return next((i for i in range(start, len(events)) if events[i] == ev), None)

    def renamed_to(dst, start=0):
        return next((i for i in range(start, len(events)) if events[i][0] == "replace" and events[i][2] == dst), None)

    shards = sorted(x.name for x in p.glob("shard-*.safetensors"))
    assert len(shards) == 3
    for name in shards:
        tmp, final, side = str(p / f".{name}.tmp"), str(p / name), str(p / fmt.sidecar_name(name))
        synced = index(("fsync", tmp))
        moved = index(("replace", tmp, final))
        assert synced is not None and moved is not None and synced < moved, (name, events)
        dir_synced = index(("fsync", str(p)), moved)
        committed = renamed_to(side, moved)
        assert dir_synced is not None and committed is not None and dir_synced < committed, (name, events)
        side_tmp = events[committed][1]
        assert index(("fsync", side_tmp)) is not None and index(("fsync", side_tmp)) < committed, name
        assert renamed_to(str(p / MANIFEST), committed) is not None, name
    for i, ev in enumerate(events):  # every rename's source was fsync'd before it
        if ev[0] == "replace":
            assert ("fsync", ev[1]) in events[:i], ev


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


# ------------------------------------------------------------------ drafter helpers

V, DV = 256, 100


def drafter_and_embeddings(seed=0, draft_vocab=V, std=0.2):
    """A tiny random drafter with weights large enough that its logits are far from flat."""
    model = make_tiny_llama(seed=3)
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=draft_vocab, aux_layer_ids=(1, 2, 3))
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg).eval()
    d.init_weights(std)
    if draft_vocab < V:
        ids = torch.randperm(V)[:draft_vocab].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        d.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return d, model.get_input_embeddings()


class LogitsRecorder:
    """Wraps drafter.logits: every call's output is kept (under a CUDA graph: the graph's output buffers)."""

    def __init__(self, drafter):
        self.fn, self.calls = drafter.logits, []
        drafter.logits = self

    def __call__(self, hidden):
        out = self.fn(hidden)
        self.calls.append(out)
        return out


# ------------------------------------------------------------------ graphed vs eager chain drafter

def graphed_vs_eager(device, rounds=12, K=4):
    """Drive both chain drafters through the same rounds (prefill, then per round: propose, accept j of K
    drafts with j random in 0..K, extend with j+1 fresh entries) and compare their draft logits."""
    d, embed = drafter_and_embeddings()
    d, embed = d.to(device), embed.to(device)
    dg = copy.deepcopy(d)
    rec_e, rec_g = LogitsRecorder(d), LogitsRecorder(dg)
    eager = EagleDrafting(d, embed)
    graphed = DraftCache(dg, embed, slots=128, k=K, graphs=True)
    g = torch.Generator().manual_seed(0)
    hs = embed.weight.shape[1]
    aux, toks = torch.randn(1, 12, 3 * hs, generator=g), torch.randint(0, V, (1, 12), generator=g)
    for x in (eager, graphed):
        x.reset()
        x.extend(aux.to(device), toks.to(device))
    graph_out, accepted = None, []
    for _ in range(rounds):
        de = eager.propose_chain(5, K, 0.0, 1.0, None, V)
        le = torch.cat([c[0, -1:] for c in rec_e.calls[-K:]]).float()  # (K, Vd)
        before = len(rec_g.calls)
        dgr = graphed.propose_chain(5, K, 0.0, 1.0, None, V)
        if len(rec_g.calls) > before:  # first call (eager on the CPU every time; captured once on CUDA)
            graph_out = rec_g.calls[-K:]
        lg = torch.cat([c[0, -1:] for c in graph_out]).float()  # (K, Vd)
        torch.testing.assert_close(lg, le, rtol=1e-4, atol=1e-4)
        assert dgr.tokens == de.tokens
        j = int(torch.randint(0, K + 1, (1,), generator=g))
        accepted.append(j)
        new = de.tokens[1:1 + j] + [int(torch.randint(0, V, (1,), generator=g))]
        a = torch.randn(1, j + 1, 3 * hs, generator=g).to(device)
        for x in (eager, graphed):
            x.rollback()
            x.extend(a, torch.tensor([new], device=device))
    assert 0 in accepted and K in accepted  # rounds with rejections (stale draft slots) and full accepts


def test_graphed_chain_logits_equal_eager_cpu():
    """cache.DraftCache's static-cache logic without CUDA graphs (on the CPU _capture is a plain call)."""
    graphed_vs_eager("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_chain_logits_equal_eager_cuda():
    graphed_vs_eager("cuda")


# ------------------------------------------------------------------ tree drafter vs forced chains

def forced_logits(drafting, drafter, embed, path):
    """Naive reference: (Vd,) draft logits after feeding the target ids `path` one at a time from the
    committed state, each step attending the whole cache (committed entries + its own ancestors)."""
    hidden, k, v, n = drafting.last, drafting.k, drafting.v, drafting.n
    for step, tok in enumerate(path):
        mask = torch.ones(1, 1, k.shape[2] + 1, dtype=torch.bool)
        hidden, (k, v) = drafter.layer(hidden, embed(torch.tensor([[tok]])), torch.tensor([[n + step]]), mask, (k, v))
    return drafter.logits.fn(hidden)[0, -1].float()


def naive_tree(drafting, drafter, embed, root, top_k, depth, total):
    """EAGLE-2 dynamic tree built node by node from forced chains -> (Draft, per-level (F, Vd) logits)."""
    lg = forced_logits(drafting, drafter, embed, [])
    levels = [lg[None]]
    s, i = torch.log_softmax(lg, -1).topk(top_k)
    toks = drafter.draft_to_target(i).tolist()
    scores, parents, depths = s.tolist(), [-1] * len(toks), [1] * len(toks)
    paths = {j: [t] for j, t in enumerate(toks)}
    frontier = list(range(len(toks)))
    for level in range(2, depth + 1):
        lg = torch.stack([forced_logits(drafting, drafter, embed, paths[j]) for j in frontier])  # (F, Vd)
        levels.append(lg)
        cs, ci = torch.log_softmax(lg, -1).topk(top_k, dim=-1)  # (F, k)
        cum = cs + torch.tensor([scores[j] for j in frontier])[:, None]  # (F, k)
        base = len(toks)
        for r, t in enumerate(drafter.draft_to_target(ci).flatten().tolist()):
            par = frontier[r // top_k]
            paths[base + r] = paths[par] + [t]
            toks.append(t)
            parents.append(par)
            depths.append(level)
        scores += cum.flatten().tolist()
        frontier = [base + b for b in cum.flatten().topk(min(top_k, cum.numel())).indices.tolist()]
    keep, tparents = select_tree(toks, parents, scores, depths, total)
    return Draft([root] + [toks[j] for j in keep], [-1] + tparents), levels


@pytest.fixture(scope="module")
def tree_setup():
    d, embed = drafter_and_embeddings(seed=1, draft_vocab=DV)
    rec = LogitsRecorder(d)
    drafting = EagleDrafting(d, embed)
    g = torch.Generator().manual_seed(2)
    hs = embed.weight.shape[1]
    drafting.extend(torch.randn(1, 12, 3 * hs, generator=g), torch.randint(0, V, (1, 12), generator=g))
    return d, embed, rec, drafting


def test_top1_tree_logits_equal_chain(tree_setup):
    d, embed, rec, drafting = tree_setup
    rec.calls.clear()
    tree = drafting.propose_tree(7, 1, 5, 20)
    tree_logits = [c[0, -1].float() for c in rec.calls]
    rec.calls.clear()
    ch = drafting.propose_chain(7, 5, 0.0, 1.0, None, V)
    chain_logits = [c[0, -1].float() for c in rec.calls]
    assert len(tree_logits) == len(chain_logits) == 5
    for level, (a, b) in enumerate(zip(tree_logits, chain_logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"level {level + 1}")
    assert tree.tokens == ch.tokens and tree.parents == chain(7, ch.tokens[1:]).parents


@pytest.mark.parametrize("top_k", [2, 3])
def test_tree_node_logits_equal_forced_chains(tree_setup, top_k):
    """Each expanded node's draft logits equal a chain forced along its ancestors; the tree equals the
    one built from those chains. Catches a node that misses its ancestors in the mask, and a level
    expanded from another parent's hidden state."""
    d, embed, rec, drafting = tree_setup
    rec.calls.clear()
    tree = drafting.propose_tree(7, top_k, 5, 20)
    got = [c[0].float() for c in rec.calls]  # level 1: (1, Vd); level l > 1: (F, Vd) in frontier order
    with torch.no_grad():
        ref, levels = naive_tree(drafting, d, embed, 7, top_k, 5, 20)
    assert len(got) == len(levels) == 5
    for level, (a, b) in enumerate(zip(got, levels)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"level {level + 1}")
    assert tree.tokens == ref.tokens and tree.parents == ref.parents
    assert max(tree.depths) >= 3  # the kept tree reaches levels built from expanded nodes
