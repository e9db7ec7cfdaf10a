"""The exported README's engine commands name the drafter and a local target by absolute path."""

import json
import re
import shlex
from pathlib import Path

from support.models import make_tiny_llama
from eyas.export.export import export_drafter
from eyas.target import target_from_model
from support.drafters import eagle3_for_target


def commands(readme: str) -> list[list[str]]:
    blocks = re.findall(r"```\n(.*?)```", readme, re.S)
    return [shlex.split(b.replace("\\\n", " ")) for b in blocks]


def test_readme_paths_are_absolute_from_a_relative_export(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    target = target_from_model(make_tiny_llama(layers=8), name="tiny")
    out = export_drafter(eagle3_for_target(target), "exports/x", target_ref="models/tiny")
    sglang, vllm = commands((out / "README.md").read_text())
    draft = Path(sglang[sglang.index("--speculative-draft-model-path") + 1])
    model = Path(sglang[sglang.index("--model-path") + 1])
    assert draft.is_absolute() and draft == (tmp_path / "exports" / "x").resolve() and (draft / "config.json").exists()
    assert model == (tmp_path / "models" / "tiny").resolve()
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert Path(spec["model"]) == draft and Path(vllm[2]) == model
    hub = export_drafter(eagle3_for_target(target), "exports/y", target_ref="org/model")   # a hub id stays an id
    assert commands((hub / "README.md").read_text())[0][4] == "org/model"
