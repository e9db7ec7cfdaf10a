"""`eyas target slim SRC DST`: the weightless copy of a sharded target holds config, tokenizer, index and only the
head's shards, opens with the full checkpoint's fingerprint, and bad input is one line with nothing written."""

import json
from pathlib import Path

import pytest

from support.deepseek_twin import HEAD_TENSORS, save_twin
from eyas.cli import main
from eyas.target.meta import open_target_meta


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    root = tmp_path_factory.mktemp("slim")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EYAS_CACHE", str(root / "cache"))
        yield save_twin(root / "twin")


def test_slim_copy_keeps_the_head_shards_and_the_fingerprint(twin, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    assert main(["target", "slim", str(twin), str(tmp_path / "slim")]) == 0
    assert "head shards" in capsys.readouterr().out
    index = json.loads((twin / "model.safetensors.index.json").read_text())
    heads = {index["weight_map"][k] for k in HEAD_TENSORS if k in index["weight_map"]}
    shards = {p.name for p in twin.glob("*.safetensors")}
    kept = {p.name for p in (tmp_path / "slim").glob("*.safetensors")}
    assert kept == heads and kept < shards                     # the other shards are left out
    small = {p.name for p in twin.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    assert small <= {p.name for p in (tmp_path / "slim").iterdir()}   # config, tokenizer, index, code
    a, b = open_target_meta(str(twin)).fingerprint, open_target_meta(str(tmp_path / "slim")).fingerprint
    assert {k: v for k, v in a.items() if k != "identity"} == {k: v for k, v in b.items() if k != "identity"}


def test_bad_input_is_one_line_and_writes_nothing(twin, tmp_path, capsys):
    def fail(argv) -> str:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "not empty" in fail(["target", "slim", str(twin), str(tmp_path / "full")])
    assert "config.json" in fail(["target", "slim", str(tmp_path / "nope"), str(tmp_path / "a")])
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text("{}")
    assert "single-file checkpoint" in fail(["target", "slim", str(single), str(tmp_path / "b")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not list(Path(tmp_path).glob("*.partial"))
