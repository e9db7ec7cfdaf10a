"""`eyas engine launch-args` prints the server command one flag and its value(s) per line, and the printed text is
still the very argument list: joined at its backslash continuations and split as a shell splits it (shlex, and bash
itself), it gives back each argument, JSON values included."""

import json
import shlex
import shutil
import subprocess

import pytest

from eyas.cli import main
from eyas.engines import launch_args

SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576}
DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "hidden_size": 7168}


@pytest.mark.parametrize("engine, config, extra", [
    ("sglang", SMOL, ["--version", "0.5.23"]),
    ("sglang", DSV3, ["--version", "0.5.14", "--tp", "8", "--ep", "8"]),
    ("vllm", DSV3, ["--max-model-len", "4096", "--model", "/models/my model"]),   # a path a shell must quote
])
def test_printed_command_is_the_argument_list_one_flag_per_line(engine, config, extra, tmp_path, capsys,
                                                                monkeypatch):
    seen = []
    real = launch_args.format_command
    monkeypatch.setattr(launch_args, "format_command", lambda args: seen.append(list(args)) or real(args))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["engine", "launch-args", engine, "--target-config", str(path), *extra]) == 0
    text = capsys.readouterr().out
    (args,) = seen
    assert shlex.split(text.replace("\\\n", "")) == args
    if shutil.which("bash"):   # what a user's shell makes of the pasted text
        out = subprocess.run(["bash", "-c", 'printf "%s\\0" ' + text], capture_output=True, check=True).stdout
        assert out.decode().split("\0")[:-1] == args

    lines = text.rstrip("\n").split("\n")
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    first, *rest = [shlex.split(line.rstrip("\\")) for line in lines]
    assert not any(w.startswith("--") for w in first)                      # the program and its leading words
    assert rest and all(words[0].startswith("--") and not any(w.startswith("--") for w in words[1:])
                        for words in rest)                                  # then one flag and its values a line
    assert sum(len(words) for words in [first, *rest]) == len(args)
