"""`eyas run --recipe recipes/cpu-demo.toml` reproduces `eyas run --preset cpu-demo` exactly.

tests/test_recipes.py shows that both resolve to the same stage configs. Here both go through `eyas.cli.main` end to
end on a tiny target, with the same --set values shrinking the preset. The property is that the two runs give the
same prepared data, store, drafter weights, training curve and bench results (tau, acceptance by position, forward
counts, the lossless check), bit for bit; only paths and timings may differ.
"""

import hashlib
import json
from pathlib import Path

from test_run import tiny_run_inputs  # noqa: F401  (the tiny target + conversations fixture)

from eyas.cli import main

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-demo.toml"   # the top-level file users pass

# The preset's knobs cut down to seconds; every other value (dtype/autocast "auto", ttt_steps, lr, k, ...) is the
# recipe's own.
SETS = ("prepare.limit=40", "prepare.max_len=160", "prepare.max_new_tokens=8", "prepare.batch_size=8",
        "prepare.gen_batch=8", "train.draft_vocab=64", "train.batch_tokens=512", "train.epochs=6",
        "bench.0.limit=3", "bench.0.max_new_tokens=8")
TIMING = {"tokens_per_s", "data_wait_s", "seconds", "speedup"}   # wall-clock numbers in metrics.jsonl and the bench JSON


def run(root, out, *how):
    args = ["run", "--target", str(root / "target"), "--data", str(root / "chats.jsonl"), *how, "--out", str(out),
            "--quiet"]
    for s in SETS:
        args += ["--set", s]
    assert main(args) == 0


def untimed(x):
    """A metrics record or bench report without its wall-clock numbers."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [untimed(v) for v in x]
    return x


def digests(run):
    """sha256 of the data each stage wrote: prepared samples, store shards, draft vocabulary, drafter, export (the
    paths and clocks live in the JSON manifests, logs and the pickled training state)."""
    keep = ("*.safetensors", "samples.jsonl", "skipped.jsonl")
    out = {}
    for pattern in keep:
        for p in run.rglob(pattern):
            out[str(p.relative_to(run))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_recipe_file_run_reproduces_the_preset_run(tiny_run_inputs, tmp_path):  # noqa: F811
    a, b = tmp_path / "by-preset", tmp_path / "by-recipe"
    run(tiny_run_inputs, a, "--preset", "cpu-demo")
    run(tiny_run_inputs, b, "--recipe", str(RECIPE))

    sa, sb = (json.loads((r / "run.json").read_text()) for r in (a, b))
    assert [s for s, v in sa["stages"].items() if v["done"]] == ["prepare", "capture", "train", "bench", "export"]
    assert sa["identity"]["recipe"] == sb["identity"]["recipe"]          # the resolved tables, value for value

    # the same data, store, drafter and export, byte for byte
    da, db = digests(a), digests(b)
    assert any(k.startswith("train/drafter/") for k in da) and any(k.startswith("store/") for k in da)
    assert da == db
    # the same training curve, loss for loss
    ma, mb = ([untimed(json.loads(x)) for x in (r / "train" / "metrics.jsonl").read_text().splitlines()] for r in (a, b))
    assert ma == mb and any(m["split"] == "eval" for m in ma)

    # the same bench: tau, acceptance by position, forwards and the lossless check, exactly
    [name] = [p.name for p in (a / "bench").glob("*.json")]
    ra, rb = (json.loads((r / "bench" / name).read_text()) for r in (a, b))
    tau = ra["methods"]["eagle-chain"]["tau"]
    assert tau > 1.0                      # the drafter is accepted sometimes: equal taus are not both a trivial 1.0
    assert tau == rb["methods"]["eagle-chain"]["tau"]
    assert ra["lossless"]["eagle-chain"]["held"]
    assert untimed(ra["methods"]) == untimed(rb["methods"])
    assert untimed(ra["lossless"]) == untimed(rb["lossless"]) and ra["agreement"] == rb["agreement"]
