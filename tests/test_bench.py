"""eyas bench on a tiny random Llama with a byte-level tokenizer: report, agreement and the fp32 lossless
check, start-up phases, bad input."""

import argparse
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from support.models import byte_tokenizer, make_tiny_llama
from eyas.bench import startup
from eyas.bench.bench import BenchConfig, run_bench
from eyas.bench.check import agreement
from eyas.bench.command import register
from eyas.data.chat import encode_prompt
from eyas.decode import spec as spec_mod
from eyas.decode.spec import SpecDecoder
from eyas.errors import EyasError
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.target import target_from_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello there"}, {"turns": ["one", "two, again"]}, {"prompt": "x" * 300},
             {"prompt": "abcabcabcabc"}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_bench_report_lossless_and_files(tiny, prompts, tmp_path, capsys):
    target, drafter = tiny
    out = tmp_path / "r" / "bench.json"
    cfg = BenchConfig(prompts=prompts, k=3, max_new_tokens=12, max_seq=160, json_out=str(out))
    rep = run_bench(cfg, target=target, drafter=drafter)
    assert set(rep["methods"]) == {"plain", "lookup", "eagle-chain"}
    assert rep["records"] == 4 and rep["turns"] == 5 and rep["truncated"] == 1
    assert rep["methods"]["plain"]["tau"] == 1.0
    for name in ("lookup", "eagle-chain"):
        m = rep["methods"][name]
        assert rep["lossless"][name]["held"] and rep["lossless"][name]["identical_turns"] == 5
        assert len(m["acceptance_by_position"]) == 3 and m["tau"] >= 1.0 and "speedup" in m
        assert m["tokens"] == rep["methods"]["plain"]["tokens"]
        # per record (a record's turns together): they sum to the totals, and the interval brackets tau
        assert len(m["per_record"]) == 4
        assert [sum(c) for c in zip(*m["per_record"])] == [m["tokens"], m["target_forwards"]]
        lo, hi = m["tau_ci95"]
        assert lo <= m["tau"] <= hi
    assert json.loads(out.read_text())["methods"]["eagle-chain"]["tau"] == rep["methods"]["eagle-chain"]["tau"]
    assert out.with_suffix(".png").stat().st_size > 1000
    text = capsys.readouterr().out
    assert "eagle-chain lossless (fp32, all 5 turns): yes" in text and "left-truncated" in text
    assert "eagle-chain fp32 agreement: 5/5 turns identical, mean identical prefix" in text


def test_speedup_is_each_methods_rate_over_plains(tiny, prompts, monkeypatch):
    """speedup = a method's tok/s over plain decoding's, for every method (not over another baseline's). Plain is
    slowed by a sleep per turn, so the rates of plain and lookup are far apart and the two ratios cannot agree."""
    import time

    from eyas.bench import bench

    target, drafter = tiny
    plain = bench._plain
    monkeypatch.setattr(bench, "_plain", lambda *a: (plain(*a), time.sleep(0.2))[0])
    rep = run_bench(BenchConfig(prompts=prompts, k=3, max_new_tokens=12, max_seq=160), target=target,
                    drafter=drafter)
    ms = rep["methods"]
    rate = {n: m["tokens"] / m["seconds"] for n, m in ms.items()}
    assert rate["lookup"] > 1.5 * rate["plain"], rate
    assert "speedup" not in ms["plain"]
    for name in ("lookup", "eagle-chain"):
        assert ms[name]["speedup"] == pytest.approx(rate[name] / rate["plain"], rel=5e-3), (name, ms)
        assert ms[name]["speedup"] == pytest.approx(ms[name]["tokens_per_s"] / ms["plain"]["tokens_per_s"], rel=1e-2)


def test_bench_tree_sampled(tiny, prompts):
    target, drafter = tiny
    cfg = BenchConfig(prompts=prompts, method="tree", top_k=3, depth=3, total_tokens=8, temperature=0.8,
                      max_new_tokens=8, max_seq=160, limit=2)
    rep = run_bench(cfg, target=target, drafter=drafter)
    assert "lossless" not in rep and rep["records"] == 2
    assert len(rep["methods"]["eagle-tree"]["acceptance_by_position"]) == 3


def test_bench_refuses_bad_input(tiny, prompts, tmp_path):
    target, drafter = tiny
    with pytest.raises(EyasError, match="target"):
        other = dict(target.fingerprint, config={**target.fingerprint["config"], "hidden_size": 1})
        run_bench(BenchConfig(prompts=prompts, max_seq=160, max_new_tokens=4), target=target, drafter=drafter,
                  drafter_meta={"target": other, "source": "somewhere"})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EyasError, match="no prompts"):
        run_bench(BenchConfig(prompts=str(empty), max_seq=160), target=target, drafter=drafter)
    with pytest.raises(EyasError):
        BenchConfig(temperature=-1)
    with pytest.raises(EyasError):
        run_bench(BenchConfig(prompts=prompts, method="tree", total_tokens=200, max_seq=160, max_new_tokens=4),
                  target=target, drafter=drafter)


def test_cli_parses_into_config():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    register(sub)
    a = ap.parse_args(["bench", "--drafter", "RUN", "--prompts", "humaneval", "--tree", "--temperature", "0.5",
                       "--limit", "7", "--json", "o.json", "--lossless-turns", "2"])
    assert a.tree and a.chain is None and a.limit == 7 and a.json_out == "o.json" and callable(a.func)
    assert a.lossless_turns == 2 and ap.parse_args(["bench"]).lossless_turns == 4
    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "--chain", "3", "--tree"])


def test_cli_graph_round_default_follows_the_device():
    """--graph-round: on for greedy chains and trees on CUDA unless --no-graph-round; off on the CPU and for
    sampling; asked for with sampling, the decode config refuses it in one line."""
    from eyas.bench.command import bench_config

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())

    def graph(argv, device):
        return bench_config(ap.parse_args(["bench", *argv]), device).spec.graph_round

    assert graph(["--chain", "3"], "cuda") is True and graph([], "cuda:1") is True
    assert graph([], "cpu") is False and graph(["--tree"], "cuda") is True and graph(["--tree"], "cpu") is False
    assert graph(["--tree", "--no-graph-round"], "cuda") is False
    assert graph(["--temperature", "0.7"], "cuda") is False and graph(["--no-graph-round"], "cuda") is False
    assert graph(["--graph-round"], "cpu") is True and graph(["--tree", "--graph-round"], "cuda") is True
    with pytest.raises(EyasError, match="graph_round runs greedy chains and trees only"):
        graph(["--temperature", "0.7", "--graph-round"], "cuda")


def test_recipe_benches_take_the_cli_graph_round_default():
    """Every greedy chain and the tree of the gpu preset run one-graph rounds (its tree once ran host rounds at 0.72x
    plain); a recipe's [[bench]] table without graph_round gets `eyas bench`'s default: on for greedy chains and
    trees on CUDA, off on the CPU and for sampling."""
    from pathlib import Path

    from eyas.run import RunConfig, resolve_stages

    def rounds(**over):
        bench = resolve_stages(RunConfig(preset="gpu", overrides=over), Path("RUN"), vocab_size=49152).bench
        return {n: b.spec.graph_round for n, b in bench.items()}

    shipped = rounds()
    assert {"sharegpt-heldout-tree", "sharegpt-heldout-chain5"} <= shipped.keys() and all(shipped.values()), shipped
    tables = [{"method": "tree"}, {"method": "chain", "k": 3}, {"method": "chain", "k": 4, "temperature": 0.7}]
    assert rounds(bench=tables) == {"sharegpt-heldout-tree": True, "sharegpt-heldout-chain3": True,
                                    "sharegpt-heldout-chain4": False}
    assert not any(rounds(bench=tables, **{"run.device": "cpu"}).values())


def test_compiled_runner_compiles_the_drafter(tiny, monkeypatch):
    """A bench on a compiled runner builds its chain and tree decoders with the drafter's steps compiled (one-graph
    rounds: the round's chain function is a dynamo wrapper; host rounds: compile_drafter passed); an eager runner
    keeps the drafter eager."""
    from eyas.bench import bench as bench_mod
    from eyas.target.runner import Runner

    asked = []

    def spy(*a, **kw):
        asked.append(kw.get("compile_drafter", False))
        return SpecDecoder(*a, **kw)

    monkeypatch.setattr(bench_mod, "SpecDecoder", spy)
    target, drafter = tiny
    for compile in (False, True):
        runner = Runner.from_hf(target.model, max_batch=1, max_seq=256, compile=compile)
        assert runner.compiled is compile
        for spec in (dict(graph_round=True), dict(graph_round=False), dict(method="tree"),
                     dict(method="tree", graph_round=True)):
            asked.clear()
            cfg = BenchConfig(max_seq=256, **spec)
            dec = bench_mod._methods(cfg, runner, copy.deepcopy(drafter), [257], baselines=False)[0].decoder
            assert asked == [compile], (compile, spec)
            if spec.get("graph_round"):
                body = dec._round.drafting._tree_fn if spec.get("method") == "tree" else dec._round.drafting._chain_fn
                assert hasattr(body, "_torchdynamo_orig_callable") is compile, spec


def _drafter_for(model, dtype=torch.float32):
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=258, aux_layer_ids=(1, 2, 3)))
    return d.eval().to(dtype)


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
    model = copy.deepcopy(tiny[0].model).to(torch.bfloat16)
    return target_from_model(model, byte_tokenizer(), name="tiny", aux_layer_ids=(1, 2, 3))


def test_agreement_counts_on_known_outputs():
    ref = [[[1, 2, 3, 4], [5, 6]], [[7, 8, 9]]]
    out = [[[1, 2, 3, 4], [5, 0]], [[0, 8, 9, 10]]]
    a = agreement(out, ref)
    # turn 1 identical (prefix 4 of 4), turn 2 diverges at index 1 (1 of 2), turn 3 at index 0 (0 of max(3, 4))
    assert a["turns"] == 3 and a["identical_turns"] == 1 and a["identical_share"] == round(1 / 3, 4)
    assert a["prefix_by_turn"] == [4, 1, 0]
    assert a["mean_prefix_tokens"] == round(5 / 3, 2) and a["mean_prefix_share"] == round((1 + 0.5 + 0) / 3, 4)
    # a strict prefix is not identical: the longer turn sets the share
    b = agreement([[[1, 2]]], [[[1, 2, 3, 4]]])
    assert b["identical_turns"] == 0 and b["prefix_by_turn"] == [2] and b["mean_prefix_share"] == 0.5
    with pytest.raises(ValueError):  # a method that lost a turn is an error, not a shorter count
        agreement([[[1]]], [[[1], [2]]])


def test_bench_agreement_equals_direct_count(tiny, monkeypatch, capsys):
    """Speculative outputs corrupted at token J: the bench's statistics must equal a count made here from
    plain greedy outputs computed independently with the runner."""
    from eyas.target.runner import Runner

    target, drafter = tiny
    J, new = 5, 12
    turns = ["hello there", "abcabcabcabc", "one", "a longer question, please?"]
    real = SpecDecoder.generate

    def corrupted(self, prompt, max_new_tokens, **kw):
        out, st = real(self, prompt, max_new_tokens, **kw)
        if len(out) > J:
            out = out[:J] + [(out[J] + 1) % 258] + out[J + 1:]
        return out, st

    monkeypatch.setattr(SpecDecoder, "generate", corrupted)
    cfg = BenchConfig(k=3, max_new_tokens=new, max_seq=160)
    rep = run_bench(cfg, target=target, drafter=drafter, records=[{"turns": [t]} for t in turns])
    r = Runner.from_hf(target.model, max_seq=160)
    plain = [r.generate([encode_prompt(target.tokenizer, [{"role": "user", "content": t}])], new,
                        eos_ids=target.eos_token_ids)[0] for t in turns]
    prefix = [min(J, len(p)) for p in plain]
    assert any(len(p) > J for p in plain)  # some turn really is corrupted
    for name in ("lookup", "eagle-chain"):
        a = rep["agreement"][name]
        assert a["dtype"] == "fp32" and a["turns"] == len(turns)
        assert a["identical_turns"] == sum(len(p) <= J for p in plain)
        assert a["prefix_by_turn"] == prefix
        assert a["mean_prefix_tokens"] == round(sum(prefix) / len(turns), 2)
        assert a["mean_prefix_share"] == round(sum(x / len(p) for x, p in zip(prefix, plain)) / len(turns), 4)
        assert rep["lossless"][name]["held"] is False and rep["lossless"][name]["rerun"] is False
    text = capsys.readouterr().out
    a = rep["agreement"]["eagle-chain"]
    assert (f"eagle-chain fp32 agreement: {a['identical_turns']}/4 turns identical, mean identical prefix "
            f"{a['mean_prefix_tokens']:.1f} tokens") in text
    assert "eagle-chain lossless (fp32, all 4 turns): NO" in text


def _accept_every_draft(draft, logits, temperature, top_p, gen):
    """A broken greedy verify: accepts the whole chain whatever the target says, bonus from the last node."""
    path = list(range(len(draft)))
    return path, int(logits[path[-1]].argmax())


@pytest.mark.parametrize("broken", [False, True])
def test_fp32_rerun_is_the_exact_check(tiny_bf16, prompts, monkeypatch, capsys, broken):
    """A bf16 bench reruns its first turns in fp32: the real decoder passes, a verify that accepts wrong
    tokens is caught (NO); the caller's drafter is not converted to fp32 by the rerun."""
    drafter = _drafter_for(tiny_bf16.model, torch.bfloat16)
    if broken:
        monkeypatch.setattr(spec_mod, "verify", _accept_every_draft)
    cfg = BenchConfig(prompts=prompts, k=3, max_new_tokens=12, max_seq=160, lossless_turns=3)
    rep = run_bench(cfg, target=tiny_bf16, drafter=drafter)
    assert rep["dtype"] == "bf16" and set(rep["agreement"]) == {"lookup", "eagle-chain"}
    for name in ("lookup", "eagle-chain"):
        ll = rep["lossless"][name]
        assert ll["rerun"] and ll["dtype"] == "fp32" and ll["turns"] == 3
        assert ll["held"] is (not broken)
        assert rep["agreement"][name]["turns"] == 5 and rep["agreement"][name]["dtype"] == "bf16"
    if not broken:  # drafts were really rejected sometimes, so accepting them all would be visible
        assert rep["methods"]["eagle-chain"]["tau"] < 4
    assert next(drafter.parameters()).dtype == torch.bfloat16
    text = capsys.readouterr().out
    assert f"eagle-chain lossless (fp32 rerun of 3 turns): {'NO' if broken else 'yes'}" in text
    assert "eagle-chain bf16 agreement: " in text and "lossless check" in text


def test_fp32_rerun_off_and_sampled(tiny_bf16, prompts):
    cfg = BenchConfig(prompts=prompts, k=2, max_new_tokens=6, max_seq=160, limit=2, lossless_turns=0)
    rep = run_bench(cfg, target=tiny_bf16, drafter=_drafter_for(tiny_bf16.model, torch.bfloat16))
    assert "lossless" not in rep and rep["agreement"]["eagle-chain"]["turns"] == 3
    # without baselines there is no bf16 plain to agree with, but the fp32 rerun still runs plain itself
    cfg = BenchConfig(prompts=prompts, k=2, max_new_tokens=6, max_seq=160, limit=2, baselines=False)
    rep = run_bench(cfg, target=tiny_bf16, drafter=_drafter_for(tiny_bf16.model, torch.bfloat16))
    assert "agreement" not in rep and set(rep["lossless"]) == {"eagle-chain"} and rep["lossless"]["eagle-chain"]["held"]
    assert rep["lossless"]["eagle-chain"]["turns"] == 3 and rep["lossless"]["eagle-chain"]["rerun"]
    with pytest.raises(EyasError, match="lossless_turns"):
        BenchConfig(lossless_turns=-1)


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_warmup_covers_every_timed_shape(tiny, prompts, method, monkeypatch):
    """Start-up phases are reported separately and nothing new is built for the runner inside the timed
    loop. Lookup pads its drafts to the chain's K+1 rows, so a chain bench has no lookup shape of its own (left
    out of the warm-up set, nothing is late); beside a tree it has one, and leaving it out is detected."""
    target, drafter = tiny
    # max_seq above the plain decoder's 256-slot window: a windowed plain step would be a new shape per window
    cfg = BenchConfig(prompts=prompts, method=method, k=3, top_k=3, depth=3, total_tokens=8, max_new_tokens=12,
                      max_seq=600)
    rep = run_bench(cfg, target=target, drafter=drafter)
    s = rep["seconds"]
    assert set(s) == {"load", "warmup", "decode", "lossless_check", "total"}
    assert s["decode"] >= sum(m["seconds"] for m in rep["methods"].values()) - 1e-3
    assert s["load"] + s["warmup"] + s["decode"] + s["lossless_check"] <= s["total"] + 1e-3
    assert rep["warmup"]["late_shapes"] == 0 and "compile_cache" not in rep
    real = startup.verify_shapes
    monkeypatch.setattr("eyas.bench.bench.verify_shapes",
                        lambda kind, k, size: [] if kind == "lookup" else real(kind, k, size))
    target2 = target_from_model(copy.deepcopy(target.model), target.tokenizer, name="tiny", aux_layer_ids=(1, 2, 3))
    rep = run_bench(cfg, target=target2, drafter=drafter)  # a fresh runner: lookup's own shapes now built late
    assert rep["warmup"]["late_shapes"] == (0 if method == "chain" else 1)


def test_tree_nodes_matches_the_drafter(tiny):
    from eyas.decode.eagle import EagleDrafting
    from eyas.target.runner import Runner

    target, drafter = tiny
    r = Runner.from_hf(target.model, max_seq=64)
    d = EagleDrafting(drafter, r.embed)
    d.extend(torch.randn(1, 4, 3 * 64), torch.tensor([[5, 6, 7, 8]]))
    for top_k, depth, total in ((3, 3, 8), (2, 4, 60), (10, 6, 60), (4, 1, 60)):
        assert len(d.propose_tree(1, top_k, depth, total)) - 1 == startup.tree_nodes(top_k, depth, total, 258)
        d.rollback()


def test_compile_cache_dir_is_scoped(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "eyas"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with startup.compile_cache(True) as info:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "eyas" / "inductor")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and info["dir"] == str(tmp_path / "eyas" / "inductor")
    assert info["fx_graph_hits"] == 0 and info["fx_graph_misses"] == 0
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice wins
    with startup.compile_cache(True) as info:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    with startup.compile_cache(False) as info:
        pass
    assert info == {}


_COMPILE_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from support.models import make_tiny_llama
from eyas.bench.startup import compile_cache, warm_up
from eyas.target.runner import Runner
torch.set_num_threads(1)
with compile_cache(True) as info:
    r = Runner.from_hf(make_tiny_llama(layers=2, seed=3), max_seq=32, compile=True)
    warm_up(r, [(None, [1])])
print(json.dumps(info))
"""


@pytest.mark.slow
def test_compile_cache_survives_the_process(tmp_path):
    """The second bench process finds the first one's compiled graph in $EYAS_CACHE/inductor."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(EYAS_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    runs = [json.loads(subprocess.run([sys.executable, "-c", _COMPILE_CHILD], env=env, check=True, text=True,
                                      capture_output=True, cwd=os.path.dirname(os.path.dirname(__file__))
                                      ).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["dir"] == str(tmp_path / "inductor") and (tmp_path / "inductor" / "fxgraph").is_dir()
    assert runs[0]["fx_graph_misses"] >= 1 and runs[0]["fx_graph_hits"] == 0
    assert runs[1]["fx_graph_hits"] >= 1 and runs[1]["fx_graph_misses"] == 0


def test_report_bench_table_shows_both_checks(tiny_bf16, prompts, tmp_path):
    """report.md's bench table carries the fp32 verdict, the bf16 agreement and the start-up phases of the JSON,
    and for a run's bench stage the sums and the stage's decoding share."""
    from dataclasses import replace
    from types import SimpleNamespace

    from eyas.report import write_report

    run = tmp_path / "run"
    (run / "bench").mkdir(parents=True)
    cfg = BenchConfig(prompts=prompts, k=3, max_new_tokens=8, max_seq=160, limit=2, lossless_turns=2,
                      json_out=str(run / "bench" / "b.json"))
    rep = run_bench(cfg, target=tiny_bf16, drafter=_drafter_for(tiny_bf16.model, torch.bfloat16))
    json.loads((run / "bench" / "b.json").read_text())  # what the report reads
    write_report(run, {"stages": {}}, SimpleNamespace(preset="test", target="tiny", data="d"))
    md = (run / "report.md").read_text()
    a, ll = rep["agreement"]["eagle-chain"], rep["lossless"]["eagle-chain"]
    e = rep["methods"]["eagle-chain"]
    assert f"| b | eagle-chain | {e['tau']:.2f} ({e['tau_ci95'][0]:.2f}-{e['tau_ci95'][1]:.2f}) |" in md
    assert (f"| {'yes' if ll['held'] else 'NO'} (fp32 rerun of 2 turns) | bf16: {a['identical_turns']}/3 turns "
            f"identical, mean identical prefix {a['mean_prefix_tokens']:.1f} tokens") in md
    s = rep["seconds"]
    assert f"| b | {s['load']:.1f} | {s['warmup']:.1f} | {s['decode']:.1f} | {s['lossless_check']:.1f} | {s['total']:.1f} |" in md
    assert "all benches" not in md  # one bench and no stage clock: its own row says it all
    # the bench stage of a run (one process, here two benches and the stage's clock): a row of sums, its share
    # of decoding against the stage's wall time
    rep2 = run_bench(replace(cfg, json_out=str(run / "bench" / "c.json"), limit=1), target=tiny_bf16,
                     drafter=_drafter_for(tiny_bf16.model, torch.bfloat16))
    write_report(run, {"stages": {"bench": {"seconds": 100.0}}}, SimpleNamespace(preset="test", target="tiny", data="d"))
    md = (run / "report.md").read_text()
    s2 = rep2["seconds"]
    dec = s["decode"] + s2["decode"]
    assert (f"| all benches (the bench stage, one process) | {s['load'] + s2['load']:.1f} | "
            f"{s['warmup'] + s2['warmup']:.1f} | {dec:.1f} | {s['lossless_check'] + s2['lossless_check']:.1f} | "
            f"100.0 | {dec / 100:.0%} |") in md


def test_bench_config_holds_one_spec_config():
    """The decode knobs are SpecConfig's, declared and validated there once: BenchConfig takes them as `spec` or
    flat (recipes' [[bench]] tables), and from_dict reads back only the form to_dict writes."""
    from dataclasses import fields, replace

    from eyas.decode.spec import SpecConfig

    nested = BenchConfig(spec=SpecConfig(method="tree", top_k=3, depth=3, total_tokens=8), limit=2)
    flat = BenchConfig(method="tree", top_k=3, depth=3, total_tokens=8, limit=2)
    assert nested == flat and flat.spec == SpecConfig(method="tree", top_k=3, depth=3, total_tokens=8)
    assert "k" not in {f.name for f in fields(BenchConfig)}                       # one home: SpecConfig
    assert replace(flat, k=3).spec.k == 3 and replace(flat, k=3).spec.method == "tree"
    assert BenchConfig().spec == SpecConfig()
    assert flat.lookup == SpecConfig(method="lookup", top_k=3, depth=3, total_tokens=8)
    # SpecConfig's checks apply to a bench, with its message; bench narrows the method to the drafter's
    with pytest.raises(EyasError, match="top_p must be in"):
        BenchConfig(top_p=0.0)
    with pytest.raises(EyasError, match="bench method 'lookup': expected chain or tree"):
        BenchConfig(method="lookup")
    with pytest.raises(TypeError, match="nope"):
        BenchConfig(nope=1)
    # to_dict's form round-trips; a flat config without `spec` (an older eyas's) is refused in one line
    cfg = BenchConfig(prompts="humaneval", k=3, limit=5, json_out="runs/x/bench/humaneval-chain3.json")
    assert BenchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.to_dict()["spec"]["k"] == 3 and "k" not in cfg.to_dict()
    old = {k: v for k, v in cfg.to_dict().items() if k != "spec"} | {"method": "chain", "k": 3}
    with pytest.raises(EyasError, match=r"^bench config: no `spec` table of decode knobs \(written by an older eyas: "
                                        r"run the bench again\)$"):
        BenchConfig.from_dict(old)
    with pytest.raises(EyasError, match="unknown keys.*'kk'"):
        BenchConfig.from_dict({**cfg.to_dict(), "kk": 3})
    with pytest.raises(EyasError, match="unknown keys.*'kk'"):
        BenchConfig.from_dict({**cfg.to_dict(), "spec": {**cfg.to_dict()["spec"], "kk": 3}})


def test_lookup_shares_the_eagle_verify_step(tiny):
    """With a drafter, the bench's lookup verifies through the same runner step function as the eagle chain (one
    compile on CUDA, not two) and decodes exactly what a lookup with its own step does; a capture that contradicts
    the drafter's aux ids is refused."""
    from eyas.bench.bench import _methods
    from eyas.target.runner import Runner

    target, drafter = tiny
    runner = Runner.from_hf(target.model, max_seq=128)
    cfg = BenchConfig(method="chain", k=3, max_new_tokens=20)
    plain, lookup, eagle = _methods(cfg, runner, drafter, [257])
    assert lookup.decoder._verify_fn is eagle.decoder._verify_fn
    assert lookup.decoder.verify_capture == eagle.decoder.aux_ids == (1, 2, 3) and lookup.decoder.aux_ids == ()
    alone = SpecDecoder(runner, None, cfg.lookup)
    assert alone.verify_capture == () and alone._verify_fn is not eagle.decoder._verify_fn
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    out, st = lookup.decoder.generate(prompt, 20, eos_ids=[257])
    ref, rst = alone.generate(prompt, 20, eos_ids=[257])
    assert out == ref and st.accepted == rst.accepted and st.target_forwards == rst.target_forwards
    assert max(rst.accepted) > 0                       # the lookup did accept something: the test sees drafts
    assert [m.name for m in _methods(cfg, runner, None, [257])] == ["plain", "lookup"]
    _, lookup, eagle = _methods(BenchConfig(method="chain", k=3, graph_round=True), runner, drafter, [257])
    assert lookup.decoder._verify_fn is eagle.decoder._round._verify  # graph rounds: the round's step, shared
    with pytest.raises(EyasError, match="verify_capture"):
        SpecDecoder(runner, drafter, cfg.spec, verify_capture=(0, 1))


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_bench_runs_graph_rounds_like_host_rounds(tiny, prompts, method):
    """graph_round through a whole bench (warm-up, timed decoding, fp32 rerun; the gpu recipe's chains, and trees):
    the same tokens and counts as host rounds, lossless, and the config records it.
    The random drafter here accepts little; tests/test_graph_round_chain.py and tests/test_graph_round_tree.py check the rounds'
    per-round acceptance with a trained drafter."""
    target, drafter = tiny
    shape = dict(method="tree", top_k=3, depth=3, total_tokens=8) if method == "tree" else dict(k=3)
    reps = [run_bench(BenchConfig(prompts=prompts, max_new_tokens=12, max_seq=160, graph_round=g, **shape),
                      target=target, drafter=drafter) for g in (False, True)]
    name = f"eagle-{method}"
    host, graph = (r["methods"][name] for r in reps)
    for key in ("tokens", "tau", "target_forwards", "acceptance_by_position", "per_record"):
        assert graph[key] == host[key], key
    assert graph["tokens"] == reps[1]["methods"]["plain"]["tokens"]
    assert reps[1]["lossless"][name]["held"] and reps[1]["config"]["spec"]["graph_round"]


def test_compiled_bench_runs_tree_rounds_with_the_proposer_compiled(tiny, tmp_path):
    """What `eyas bench --tree --compile` runs on CUDA (one-graph rounds, the runner and the tree
    proposer compiled), here on the CPU: the eager host rounds' tokens and counts, lossless."""
    target, drafter = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "abcabcabcabc"}\n')
    shape = dict(method="tree", top_k=3, depth=3, total_tokens=8, prompts=str(prompts), max_new_tokens=8,
                 max_seq=96, lossless_turns=1, baselines=False)
    host = run_bench(BenchConfig(**shape), target=target, drafter=drafter)
    fast = run_bench(BenchConfig(**shape, graph_round=True, compile=True), target=target, drafter=drafter)
    a, b = host["methods"]["eagle-tree"], fast["methods"]["eagle-tree"]
    for key in ("tokens", "tau", "target_forwards", "acceptance_by_position", "per_record"):
        assert b[key] == a[key], key
    assert fast["lossless"]["eagle-tree"]["held"] and fast["config"]["spec"]["graph_round"]
    assert fast["config"]["compile"] is True


def test_tau_interval_bootstraps_records():
    """The 95% interval of tau resamples records: equal records give a point, a spread gives an interval inside the
    range of per-record tau around the pooled tau, seeded (the same every run); fewer than two records give none."""
    from eyas.bench.bench import tau_interval

    assert tau_interval([[30, 10]] * 8) == [3.0, 3.0]
    recs = [[20, 10], [50, 10], [12, 10], [40, 10], [25, 10], [31, 10]]   # per-record tau 1.2 .. 5.0, pooled 2.97
    lo, hi = tau_interval(recs)
    assert 1.2 < lo < 178 / 60 < hi < 5.0 and hi - lo > 0.5
    assert tau_interval(recs) == [lo, hi]
    assert tau_interval([[5, 2]]) is None and tau_interval([]) is None


def test_exact_fp32_restores_every_precision_switch():
    """Inside: fp32 matmuls without TF32. After: every switch as it was, the newer fp32_precision fields included
    (inductor's cache keys read them; a changed field made each later compile miss a warm cache)."""
    from eyas.bench.check import _precision_state, exact_fp32

    def state():
        return ([v for _, v in _precision_state()], torch.get_float32_matmul_precision(),
                torch.backends.cudnn.allow_tf32)

    before = state()
    assert before[0], "this torch has no fp32_precision fields: the test checks nothing new"
    with exact_fp32():
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert state() == before
