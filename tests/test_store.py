"""The store on its own: round trip against naive references, verify, resume bookkeeping, training stream."""

import argparse
import json
import os
import pickle
import re

import pytest
import torch

from eyas.errors import EyasError
from eyas.store import Store, StoreWriter, collate
from eyas.store import format as fmt
from eyas.store.command import register

H = 16


def target_fp(identity="tiny", hidden_size=H):
    """A target fingerprint as target/fingerprint.py writes it (its version, the compared fields)."""
    return {"fingerprint": 3, "identity": identity, "config": {"model_type": "llama", "hidden_size": hidden_size},
            "tokenizer_sha256": None, "special_tokens": {}}


def header(dtype="bf16", identity="tiny"):
    return {"target": target_fp(identity),
            "layers": {"aux": [1, 2, 3]}, "dtype": dtype, "hidden_size": H, "vocab_size": 100,
            "data": {"source": "test"}, "config": {}}


def make(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(n):
        t = int(torch.randint(1, 20, (1,), generator=g))
        out[f"s{k}"] = (torch.randint(0, 100, (t,), generator=g), torch.randint(0, 2, (t,), generator=g),
                        torch.randn(t, 3, H, generator=g) * 10, torch.randn(t, H, generator=g))
    return out


def write(path, samples, dtype="bf16", shard_bytes=2000, **kw):
    w = StoreWriter(path, header=header(dtype), shard_bytes=shard_bytes, **kw)
    for sid, (ids, mask, aux, final) in samples.items():
        w.add_sample(sid, ids, mask, aux, final)
    w.close()
    return w.finalize(set(samples))


def naive_fp8(x):
    """Reference fp8 round trip: per row scale = max|x| / 448, e4m3 round, multiply back."""
    out = torch.empty_like(x)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in x.shape[:-1]]).reshape(-1, x.dim() - 1):
        row = x[tuple(idx)]
        s = row.abs().max() / 448 if row.abs().max() > 0 else torch.tensor(1.0)
        out[tuple(idx)] = (row / s).to(torch.float8_e4m3fn).float() * s
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_round_trip_against_naive(tmp_path, dtype):
    samples = make()
    m = write(tmp_path / "s", samples, dtype)
    assert m["complete"] and m["num_samples"] == 10 and m["num_shards"] > 2
    store = Store(tmp_path / "s", dtype=torch.float32)
    assert len(store) == 10
    for sid, (ids, mask, aux, final) in samples.items():
        s = store.by_id(sid)
        assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask.bool())
        if dtype == "bf16":
            assert torch.equal(s.aux, aux.bfloat16().float()) and torch.equal(s.final, final.bfloat16().float())
        else:
            assert torch.equal(s.aux, naive_fp8(aux)) and torch.equal(s.final, naive_fp8(final))
        assert store[store.index_of(sid)].id == sid
    assert store.get(0, torch.bfloat16).aux.dtype == torch.bfloat16


def test_info_bytes_per_token(tmp_path):
    for dtype in ("bf16", "fp8"):
        write(tmp_path / dtype, make(), dtype, shard_bytes=1 << 20)
        info = Store(tmp_path / dtype).info()
        # safetensors header (~500 B per shard) is the only overhead beyond the formula
        payload = info["tokens"] * fmt.bytes_per_token(dtype, H) + 8 * (info["samples"] + 1)
        assert payload <= info["bytes"] <= payload + 1000, dtype
        assert info["aux_layer_ids"] == [1, 2, 3] and info["layer_convention"] == "hf_hidden_states"


def test_verify_names_flipped_shard(tmp_path):
    write(tmp_path / "s", make())
    store = Store(tmp_path / "s")
    assert store.verify()["ok"]
    bad = tmp_path / "s" / store.records[2]["file"]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    with pytest.raises(EyasError, match=rf"{bad.name}: sha256 mismatch"):
        Store(tmp_path / "s").verify()
    # a truncated shard is refused at open
    bad.write_bytes(bytes(data[:-10]))
    with pytest.raises(EyasError, match=rf"{bad.name}: missing or wrong size"):
        Store(tmp_path / "s")


def test_shard_rewritten_in_place_at_the_same_size_is_refused(tmp_path):
    """An open shard overwritten in place (same size, same inode, a later mtime): the next read stops with
    "changed on disk", naming the shard, instead of serving the new bytes; the other shards still read."""
    write(tmp_path / "s", make())
    store = Store(tmp_path / "s")
    first = store.records[0]["samples"]  # sample `first` lives in shard 1
    store.get(0), store.get(first)      # both shards open and checked
    f = tmp_path / "s" / store.records[1]["file"]
    before = os.stat(f)
    with open(f, "r+b") as fh:          # in place: no truncation, no new inode
        fh.seek(before.st_size - 5)
        b = fh.read(1)
        fh.seek(before.st_size - 5)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    after = os.stat(f)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert after.st_mtime_ns != before.st_mtime_ns
    with pytest.raises(EyasError, match=re.escape(f"{f}: shard changed on disk")):
        store.get(first)
    assert store.get(0).id == "s0"


def test_verify_catches_non_finite_even_with_good_checksum(tmp_path):
    s = make(3)
    s["s1"][2][1, 0, 0] = float("nan")
    write(tmp_path / "s", s, shard_bytes=1)   # one sample per shard
    with pytest.raises(EyasError, match=r"shard-r000-00001.safetensors: non-finite hidden state at token 1"):
        Store(tmp_path / "s").verify()


def test_refuses_other_target_and_incomplete(tmp_path):
    write(tmp_path / "s", make())
    with pytest.raises(EyasError, match="target does not match.*config.hidden_size"):
        Store(tmp_path / "s", target=target_fp(hidden_size=H + 1))
    Store(tmp_path / "s", target=header()["target"])
    w = StoreWriter(tmp_path / "p", header=header(), shard_bytes=1)
    w.add_sample("a", [1], [1], torch.zeros(1, 3, H), torch.zeros(1, H))
    w.close()
    assert not w.finalize({"a", "b"})["complete"]
    with pytest.raises(EyasError, match="incomplete"):
        Store(tmp_path / "p")
    assert len(Store(tmp_path / "p", allow_incomplete=True)) == 1


def test_resume_cleans_orphans_and_skips_committed(tmp_path):
    p = tmp_path / "s"
    samples = make(6)
    first = dict(list(samples.items())[:3])
    w = StoreWriter(p, header=header(), shard_bytes=1)
    for sid, (ids, mask, aux, final) in first.items():
        w.add_sample(sid, ids, mask, aux, final)
    w.close()
    # leftovers of a crash: a temp file, a renamed shard without its sidecar, and another rank's temp file
    (p / ".shard-r000-00003.safetensors.tmp").write_bytes(b"partial")
    (p / "shard-r000-00004.safetensors").write_bytes((p / "shard-r000-00000.safetensors").read_bytes())
    (p / ".shard-r001-00000.safetensors.tmp").write_bytes(b"partial")
    w = StoreWriter(p, header=header(), shard_bytes=1, rank=0, world_size=2)
    assert w.committed_ids == set(first)
    assert not (p / ".shard-r000-00003.safetensors.tmp").exists()
    assert not (p / "shard-r000-00004.safetensors").exists()
    assert (p / ".shard-r001-00000.safetensors.tmp").exists()      # rank 1 cleans its own
    for sid, (ids, mask, aux, final) in samples.items():
        if sid not in w.committed_ids:
            w.add_sample(sid, ids, mask, aux, final)
    w.close()
    assert w.finalize(set(samples))["complete"]
    names = [r["file"] for r in Store(p).records]
    assert names == [fmt.shard_name(0, i) for i in range(6)]       # numbering continued after 2


def test_stream_shuffle_ranks_and_resume(tmp_path):
    write(tmp_path / "s", make(11))
    store = Store(tmp_path / "s")
    take = lambda it, n: [next(it).id for _ in range(n)]  # noqa: E731
    a = take(iter(store.stream(seed=3)), 22)
    assert a == take(iter(store.stream(seed=3)), 22)
    assert sorted(a[:11]) == sorted(store.ids) == sorted(a[11:]) and a[:11] != a[11:]
    assert a != take(iter(store.stream(seed=4)), 22)
    assert take(iter(store.stream(shuffle=False)), 11) == store.ids
    # ranks: disjoint, equal length, cover all but the remainder
    r = [take(iter(store.stream(seed=3, rank=k, world_size=3)), 3) for k in range(3)]
    assert sum(map(len, r)) == 9 and len(set(sum(r, []))) == 9
    # resume: a restored stream continues exactly where the saved one stopped (across epochs)
    s1 = store.stream(seed=5, rank=1, world_size=2)
    it = iter(s1)
    take(it, 7)
    state = json.loads(json.dumps(s1.state_dict()))
    rest = take(it, 9)
    s2 = store.stream(seed=5, rank=1, world_size=2)
    s2.load_state_dict(state)
    assert take(iter(s2), 9) == rest
    with pytest.raises(EyasError, match="seed"):
        store.stream(seed=6, rank=1, world_size=2).load_state_dict(state)


def test_pickle_and_collate(tmp_path):
    samples = make(4)
    write(tmp_path / "s", samples)
    store = Store(tmp_path / "s", dtype=torch.float32)
    store[0]
    clone = pickle.loads(pickle.dumps(store))          # DataLoader workers get a copy without open maps
    assert torch.equal(clone[1].aux, store[1].aux)
    batch = collate([store[i] for i in range(4)])
    T = max(len(samples[f"s{k}"][0]) for k in range(4))
    assert batch["aux"].shape == (4, T, 3, H) and batch["final"].shape == (4, T, H)
    for b in range(4):
        n = int(batch["attention_mask"][b].sum())
        assert torch.equal(batch["final"][b, :n], store[b].final) and not batch["final"][b, n:].any()


def test_cli(tmp_path, capsys):
    write(tmp_path / "s", make())
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["store", "info", str(tmp_path / "s")])
    assert args.func(args) == 0 and json.loads(capsys.readouterr().out)["samples"] == 10
    args = parser.parse_args(["store", "verify", str(tmp_path / "s")])
    assert args.func(args) == 0 and "OK" in capsys.readouterr().out
    shard = sorted((tmp_path / "s").glob("shard-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(EyasError, match=shard.name):
        args.func(args)


def test_nonfinite_bit_test_matches_isfinite():
    from eyas.store.verify import _nonfinite
    x = torch.tensor([0.0, 1.0, -3.5, float("inf"), float("-inf"), float("nan"), 1e38, -1e-40])
    assert _nonfinite(x.bfloat16()).tolist() == (~torch.isfinite(x.bfloat16())).tolist()
    q = torch.tensor([0.0, 448.0, -448.0, 1e-3, float("nan")]).to(torch.float8_e4m3fn)
    assert _nonfinite(q).tolist() == [False, False, False, False, True]
    assert _nonfinite(q.float()).tolist() == _nonfinite(q).tolist()


# ---- the overlapped writer (intake + writer threads, one buffer per shard) against the synchronous reference
def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if not p.name.startswith(".")}


def _batches(n=40, seed=1):
    """(ids, lengths, input_ids, loss_mask, states) batches of 1-5 samples, one bigger than several shards."""
    g = torch.Generator().manual_seed(seed)
    out, k = [], 0
    for b in range(n):
        lengths = [int(torch.randint(1, 30, (1,), generator=g)) for _ in range(int(torch.randint(1, 6, (1,),
                                                                                                generator=g)))]
        if b == 7:
            lengths = [300, 2]   # ~19 KB of bf16 rows: past several shards at once
        N = sum(lengths)
        ids = [f"id-{k + j}" + ('"\\ü\t' * (k + j) if b % 5 == 0 else "") for j in range(len(lengths))]
        k += len(lengths)
        out.append((ids, lengths, torch.randint(0, 100, (N,), generator=g, dtype=torch.int32),
                    torch.randint(0, 2, (N,), generator=g, dtype=torch.uint8), torch.randn(N, 4, H, generator=g) * 5))
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("lead", [1 << 20, 64])   # 64: the header never fits in front, every shard moves its rows
def test_overlapped_writer_equals_synchronous_file_for_file(tmp_path, monkeypatch, dtype, lead):
    import eyas.store.shardfile as sf
    monkeypatch.setattr(sf, "_LEAD", lead)
    batches = _batches()
    for overlap in (False, True):
        out = StoreWriter(tmp_path / str(overlap), header=header(dtype), shard_bytes=1500, threads=3,
                          overlap=overlap)
        for ids, lengths, input_ids, mask, states in batches:
            out.add(ids, lengths, input_ids, mask, *fmt.quantize(states, dtype))
        out.close()
        out.finalize({i for b in batches for i in b[0]})
    sync, overlapped = _files(tmp_path / "False"), _files(tmp_path / "True")
    assert len(sync) > 2 * 12 and sync.keys() == overlapped.keys()   # more shards than buffers: they are reused
    for name in sync:
        assert sync[name] == overlapped[name], name
    store = Store(tmp_path / "True", dtype=torch.float32)
    store.verify()
    s = store.by_id("id-0")
    assert torch.equal(s.input_ids, batches[0][2][: batches[0][1][0]].long())


def test_header_is_safetensors_own_with_sorted_metadata():
    """st_header writes exactly safetensors.save's header but for the metadata order, which save randomises."""
    from safetensors.torch import save as st_save

    from eyas.store.shardfile import canonical, st_header, st_order
    g = torch.Generator().manual_seed(0)
    tensors = {"offsets": torch.arange(4), "scale": torch.rand(5, 4, generator=g),
               "input_ids": torch.arange(5, dtype=torch.int32), "loss_mask": torch.ones(5, dtype=torch.uint8),
               "hidden": torch.randn(5, 4, 3, generator=g).to(torch.float8_e4m3fn)}
    meta = {"format": fmt.FORMAT, "ids": json.dumps(["a", 'q"uo\\te', "ünï", "tab\there", "\x01"])}
    raw = {st_save(tensors, metadata=meta) for _ in range(40)}
    assert len(raw) == 2                                   # save's metadata order is random...
    assert len({canonical(d) for d in raw}) == 1           # ...canonical's is not
    data = canonical(raw.pop())
    order = st_order(tuple((k, t.dtype) for k, t in tensors.items()))
    entries = [(k, dt, tensors[k].shape, tensors[k].numel() * tensors[k].element_size()) for k, dt in order]
    head = st_header(entries, meta)
    assert data[: len(head)] == head
    assert data[len(head):] == b"".join(tensors[k].contiguous().view(torch.uint8).numpy().tobytes()
                                        for k, _ in order)
