"""eyas bench with a DFlash drafter opened from its directory: the report names the drafter kind, its block and
chain, is lossless, and the bench refuses what a block drafter cannot run."""

import json

import pytest
import torch

from support.models import make_tiny_llama
from eyas.bench.bench import BenchConfig, run_bench
from eyas.errors import EyasError
from eyas.model.checkpoint import save_drafter
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.target import target_from_model
from support.models import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

BLOCK = 6


@pytest.fixture(scope="module")
def tiny_dflash_run(tmp_path_factory):
    """A tiny target and a random DFlash drafter for it, saved with save_drafter under a train dir's layout."""
    model = make_tiny_llama(vocab=258, seed=31)
    model.config.eos_token_id = 257
    model.generation_config.eos_token_id = 257
    target = target_from_model(model, byte_tokenizer(), name="tiny", aux_layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    cfg = DFlashConfig.from_target(model.config, aux_layer_ids=(1, 2, 3), mask_token_id=255, num_layers=2,
                                   block_size=BLOCK)
    run = tmp_path_factory.mktemp("train")
    save_drafter(DFlashDrafter(cfg), run / "drafter", meta={"target": target.fingerprint})
    return target, str(run)


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello there"}, {"turns": ["one", "two, again"]}, {"prompt": "abcabcabcabc"}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_bench_dflash_report_block_chain_and_lossless(tiny_dflash_run, prompts, tmp_path, capsys):
    """No k given: the drafter's whole block (B-1 drafts); acceptance by position has B-1 block slots; the fp32
    bench is itself the lossless check; the JSON, the table and the plot say dflash and the block."""
    target, run = tiny_dflash_run
    out = tmp_path / "bench.json"
    cfg = BenchConfig(prompts=prompts, drafter=run, max_new_tokens=16, max_seq=200, json_out=str(out))
    rep = run_bench(cfg, target=target)
    assert set(rep["methods"]) == {"plain", "lookup", "dflash"}
    written = json.loads(out.read_text())
    assert written["drafter_kind"] == "dflash" and written["block_size"] == BLOCK
    assert written["config"]["spec"]["k"] == BLOCK - 1 and written["config"]["spec"]["method"] == "chain"
    m = written["methods"]["dflash"]
    assert m["label"] == f"dflash block {BLOCK} ({BLOCK - 1} drafts)"
    assert len(m["acceptance_by_position"]) == BLOCK - 1 and m["tau"] >= 1.0
    assert m["tokens"] == written["methods"]["plain"]["tokens"] and m["target_forwards"] < m["tokens"] + 4
    ll = written["lossless"]["dflash"]
    assert ll["held"] and ll["identical_turns"] == ll["turns"] == 4 and ll["dtype"] == "fp32"
    table = capsys.readouterr().out
    assert f"dflash: dflash block {BLOCK} ({BLOCK - 1} drafts)" in table and "dflash lossless (fp32" in table
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_dflash_given_k_graph_round_and_refusals(tiny_dflash_run, prompts, capsys):
    """A given k <= B-1 is kept; graph_round (the CUDA default) runs whole rounds, here eagerly on the CPU; without
    baselines the fp32 rerun checks losslessness; k > B-1 and trees are refused, naming B-1."""
    target, run = tiny_dflash_run
    cfg = BenchConfig(prompts=prompts, drafter=run, k=2, graph_round=True, max_new_tokens=8, max_seq=200,
                      baselines=False, limit=1)
    rep = run_bench(cfg, target=target)
    assert rep["config"]["spec"]["k"] == 2 and rep["config"]["spec"]["graph_round"] is True
    assert len(rep["methods"]["dflash"]["acceptance_by_position"]) == 2
    ll = rep["lossless"]["dflash"]  # no plain baseline in the bench: the fp32 rerun (a copy of the drafter) checks
    assert ll["held"] and ll["rerun"] and ll["turns"] == 1
    with pytest.raises(EyasError, match=f"B-1 = {BLOCK - 1}"):
        run_bench(BenchConfig(prompts=prompts, drafter=run, k=BLOCK, max_seq=200, limit=1), target=target)
    with pytest.raises(EyasError, match="not a tree"):
        run_bench(BenchConfig(prompts=prompts, drafter=run, method="tree", max_seq=200, limit=1), target=target)
