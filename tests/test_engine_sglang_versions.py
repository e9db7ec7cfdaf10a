"""The SGLang releases eyas supports, read from where the API exists, and the hook's rank lookup in each.

The fast tests build a stub `sglang` package with exactly the modules and names each release has
(engine_sglang_layouts.LAYOUTS) and import it for real; the wheel tests check that table, and every
flag launch-args emits, against the released wheels (skipped when PyPI and the cache are unreachable).
"""

import json
import sys

import pytest

from support import engine_src
from support.engine_fakes import init_store, make_args
from support.engine_sglang_layouts import LAYOUTS, declares_flag, layout_from_wheel, server_arg_sources, stub_package
from eyas.engines import launch_args as la
from eyas.engines.sglang_hook import CaptureHook, events_name, sglang_ranks
from eyas.errors import EyasError
from eyas.store.reader import Store

SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576}
SUPPORTED = [v for v, lay in LAYOUTS.items() if lay["hooks"] and lay["rids"]]


@pytest.fixture
def sglang_release(tmp_path, monkeypatch):
    """Install a stub sglang with one release's layout for the duration of a test."""
    def install(version, ranks):
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            monkeypatch.delitem(sys.modules, name)
        root = tmp_path / f"{version}-{'-'.join(map(str, ranks))}"   # a fresh dir: no stale bytecode
        monkeypatch.syspath_prepend(str(stub_package(root, LAYOUTS[version], ranks)))
    return install


@pytest.mark.parametrize("version", SUPPORTED)
def test_ranks_resolve_in_every_supported_release(version, sglang_release):
    sglang_release(version, (3, 1, 2))
    assert sglang_ranks() == (3, 1, 2)


def test_hook_without_injected_ranks_writes_once_per_dp_group(tmp_path, sglang_release):
    """The server path (and the patch path, through attach -> make_capture_hook) resolves ranks itself."""
    samples = {"s0": list(range(10, 22))}
    masks = {"s0": [1] * 12}
    store = tmp_path / "store"
    init_store(store, world_size=2)
    for tp in (1, 0):                                   # a TP duplicate writes nothing; rank 0 of DP group 1 does
        sglang_release("0.5.23", (tp, 1, 2))
        h = CaptureHook(store=store, expected=samples, loss_masks=masks, idle_flush_s=0)
        h(None, make_args([("s0#a0", "s0", 0, 12, 0)], samples))
        h.flush()
        assert (h.tp_rank, h.dp_rank, h.dp_size) == (tp, 1, 2)
    st = Store(store, allow_incomplete=True)
    assert {r["rank"]: r["ids"] for r in st.records} == {2: ["s0"]}     # DP group 1 is store rank 2
    assert [json.loads(x)["ok"] for x in (store / events_name(1)).read_text().splitlines()] == [True]


@pytest.mark.parametrize("version", list(LAYOUTS))
def test_version_gates_follow_the_releases(version, tmp_path):
    lay = LAYOUTS[version]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMOL))
    if not (lay["hooks"] and lay["rids"]):
        with pytest.raises(EyasError, match="rids" if lay["hooks"] else "no --forward-hooks"):
            la.sglang_args(cfg, version)
        return
    args = la.sglang_args(cfg, version)
    assert ("--enable-return-aux-hidden-states" in args) == lay["aux_flag"]
    spec = json.loads(args[args.index("--forward-hooks") + 1])
    assert [s["name"] for s in spec] == ["eyas_capture", "eyas_probe_switch" if lay["aux_flag"] else "eyas_enable_aux"]


def _wheel(version):
    whl = engine_src.wheel(version)
    if whl is None:
        pytest.skip(f"no SGLang {version} wheel cached and PyPI not reachable")
    return whl


@pytest.mark.slow
@pytest.mark.parametrize("version", list(LAYOUTS))
def test_layout_table_matches_the_wheel(version):
    assert layout_from_wheel(_wheel(version)) == LAYOUTS[version]


@pytest.mark.slow
@pytest.mark.parametrize("version", SUPPORTED)
def test_every_emitted_flag_exists_in_that_release(version, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMOL))
    sources = server_arg_sources(_wheel(version))
    flags = [a for a in la.sglang_args(cfg, version, tp=2, attn_dp=2, ep=2) if a.startswith("--")]
    assert [f for f in flags if not declares_flag(sources, f)] == []
