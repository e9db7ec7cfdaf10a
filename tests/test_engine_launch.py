"""`eyas engine launch-args` for SmolLM2 (30 layers) and a DeepSeek-V3-shaped config (61 layers).

Every command runs through `eyas.cli.main`, the parser a user gets, never a hand-built one."""

import argparse
import json

import pytest

from eyas import __version__
from eyas.cli import build_parser, main


def run(capsys, tmp_path, cfg, *extra, rc=0):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert main(["engine", "launch-args", *extra[:1], "--target-config", str(p), *extra[1:]]) == rc
    cap = capsys.readouterr()
    return (cap.out if rc == 0 else cap.err).replace("\\\n", " ").split()


def flag(out, name, k=1):
    i = out.index(name)
    return out[i + 1: i + 1 + k]


SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576}
DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "hidden_size": 7168}


def test_smollm2_0_5_23(capsys, tmp_path):
    out = run(capsys, tmp_path, SMOL, "sglang", "--version", "0.5.23")
    assert flag(out, "--return-aux-hidden-state-layer-ids", 3) == ["1", "14", "26"]
    assert "--enable-return-aux-hidden-states" in out and flag(out, "--speculative-algorithm") == ["EAGLE3"]
    assert "--disable-radix-cache" in out and flag(out, "--chunked-prefill-size") == ["-1"]
    assert flag(out, "--cuda-graph-backend-decode") == ["disabled"] == flag(out, "--cuda-graph-backend-prefill")
    spec = json.loads(flag(out, "--forward-hooks")[0].strip("'"))
    assert spec[0]["target_modules"] == ["logits_processor"] and spec[0]["config"]["aux_layer_ids"] == [2, 15, 27]
    # the server sets its layers itself; the hook on the inner model only installs the served check's probe switch
    assert [s["name"] for s in spec] == ["eyas_capture", "eyas_probe_switch"]
    assert spec[1]["target_modules"] == ["model"] and spec[1]["config"] == {}
    assert spec[1]["hook_factory"] == "eyas.engines.sglang_hook:make_probe_switch_hook"


def test_deepseek_0_5_14_no_aux_flag(capsys, tmp_path):
    out = run(capsys, tmp_path, DSV3, "sglang", "--version", "0.5.14")
    assert "--enable-return-aux-hidden-states" not in out
    spec = json.loads(flag(out, "--forward-hooks")[0].strip("'"))
    assert spec[0]["config"]["aux_layer_ids"] == [2, 30, 58]
    # the enable hook sets the inner model's layers_to_capture itself: HF ids, no DeepSeek +1 quirk to undo
    assert spec[1]["target_modules"] == ["model"] and spec[1]["config"]["layers_to_capture"] == [2, 30, 58]


def test_deepseek_vllm(capsys, tmp_path):
    out = run(capsys, tmp_path, DSV3, "vllm", "--max-model-len", "4096")
    spec = json.loads(flag(out, "--speculative-config")[0].strip("'"))
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58, 61]
    assert "--no-enable-prefix-caching" in out and "--no-enable-chunked-prefill" in out


def test_old_sglang_refused(capsys, tmp_path):
    err = " ".join(run(capsys, tmp_path, SMOL, "sglang", "--version", "0.5.4", rc=2))
    assert "no --forward-hooks" in err and __version__ not in err.split()


def test_subcommand_version_is_the_engine_version_not_eyas(capsys, tmp_path):
    out = run(capsys, tmp_path, SMOL, "sglang", "--version", "0.5.14")
    assert out[:3] == ["python", "-m", "sglang.launch_server"] and "--enable-return-aux-hidden-states" not in out
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == __version__


def _dests(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            yield (), a.dest
            for name, sub in a.choices.items():
                for path, dest in _dests(sub):
                    yield (name, *path), dest
        elif a.dest != "help":
            yield (), a.dest


def test_no_subcommand_option_shadows_a_top_level_one():
    """argparse copies a subcommand's values over same-named top-level ones (the old --version bug)."""
    top = {d for path, d in _dests(build_parser()) if not path}
    clash = [(" ".join(path), d) for path, d in _dests(build_parser()) if path and d in top]
    assert clash == []
