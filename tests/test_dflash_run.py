"""`eyas run --set train.method=dflash` on both presets: the preset's EAGLE-3 knobs are dropped, its chain benches
draft whole blocks, each round one CUDA graph where the EAGLE-3 chain's is, its trees are skipped; an EAGLE-3 knob
set by --set is refused."""

import pytest

from eyas.errors import EyasError
from eyas.run import RunConfig, resolve_stages
from eyas.train.config import EAGLE_ONLY


@pytest.mark.parametrize("preset", ["cpu-demo", "gpu"])
def test_set_method_dflash_resolves_every_stage(preset, tmp_path):
    eagle = resolve_stages(RunConfig(preset=preset), tmp_path, vocab_size=49152)
    st = resolve_stages(RunConfig(preset=preset, overrides={"train.method": "dflash"}), tmp_path, vocab_size=49152)
    t = st.train
    assert t.method == "dflash" and all(getattr(t, k) == v for k, v in EAGLE_ONLY.items())
    assert (t.lr, t.epochs, t.batch_tokens) == (eagle.train.lr, eagle.train.epochs, eagle.train.batch_tokens)
    chains = [n for n, b in eagle.bench.items() if b.spec.method == "chain"]
    assert chains and all(b.spec.method != "tree" for b in st.bench.values())
    dflash = {n: b for n, b in st.bench.items() if n.endswith("-dflash")}
    assert dflash and {b.spec.graph_round for b in dflash.values()} == {preset == "gpu"}  # on CUDA, as EAGLE-3's
    # the chain benches that differed only in k become one block bench per prompt set
    assert {n.rsplit("-", 1)[0] for n in dflash} == {n.rsplit("-", 1)[0] for n in chains}


def test_a_set_eagle_knob_is_refused_and_a_set_bench_k_kept(tmp_path):
    with pytest.raises(EyasError, match="ttt_steps"):
        resolve_stages(RunConfig(preset="cpu-demo", overrides={"train.method": "dflash", "train.ttt_steps": 3}),
                       tmp_path, vocab_size=49152)
    st = resolve_stages(RunConfig(preset="cpu-demo", overrides={"train.method": "dflash", "bench.0.k": 7}),
                        tmp_path, vocab_size=49152)
    assert any(n.endswith("-dflash7") and b.spec.k == 7 for n, b in st.bench.items())


def test_gpu_dflash_recipe_shares_the_gpu_presets_data(tmp_path):
    """The gpu-dflash preset prepares exactly as the gpu preset (a run can reuse that run's prepared data) and
    trains a DFlash drafter benched with whole blocks on the same prompt sets."""
    gpu = resolve_stages(RunConfig(preset="gpu"), tmp_path / "a", vocab_size=49152)
    dfl = resolve_stages(RunConfig(preset="gpu-dflash"), tmp_path / "a", vocab_size=49152)
    assert dfl.prepare == gpu.prepare
    assert dfl.train.method == "dflash" and dfl.train.pack == "on" and dfl.train.attention == "flex"
    assert sorted(dfl.bench) == ["humaneval-dflash", "long-dflash", "sharegpt-heldout-dflash"]
    assert all(b.spec.method == "chain" and b.spec.graph_round for b in dfl.bench.values())
