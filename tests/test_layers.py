"""target/layers.py: the one home of aux layer ids. Every case here is off-by-one sensitive (EAGLE3.md section 1)."""

import json

import pytest

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.target.layers import (check_aux_layer_ids, default_aux_layer_ids, is_deepseek, resolve_aux_layer_ids,
                                sglang_capture_ids, sglang_capture_readings, sglang_layer_ids)

LLAMA, DSV3, KIMI = "LlamaForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"


def test_defaults_are_hf_2_half_n_minus_3():
    assert default_aux_layer_ids(30) == (2, 15, 27)   # SmolLM2-135M
    assert default_aux_layer_ids(61) == (2, 30, 58)   # DeepSeek-V3 / Kimi-K2
    assert default_aux_layer_ids(32) == (2, 16, 29)   # Llama-3.1-8B
    assert default_aux_layer_ids(7) == (2, 3, 4)      # the shallowest target with the EAGLE default


@pytest.mark.parametrize("n,ids", [(6, (1, 3, 5)), (5, (1, 2, 4)), (4, (1, 2, 3)), (3, (0, 1, 2))])
def test_shallow_targets_get_three_increasing_ids_below_n(n, ids):
    assert default_aux_layer_ids(n) == ids
    assert check_aux_layer_ids(ids, n) == ids   # the fallback passes the range check


@pytest.mark.parametrize("n", [0, 1, 2])
def test_too_shallow_refused(n):
    with pytest.raises(EyasError, match="too shallow"):
        default_aux_layer_ids(n)


def test_range_bound_is_n_minus_1():
    """hidden_states has N+1 entries; index N is the final norm's output, never an aux state."""
    assert check_aux_layer_ids((1, 2, 3), 4) == (1, 2, 3)
    assert check_aux_layer_ids((0, 14, 29), 30) == (0, 14, 29)
    for ids in [(1, 2, 4), (2, 15, 30), (-1, 2, 3)]:
        with pytest.raises(EyasError, match="out of range.*final norm"):
            check_aux_layer_ids(ids, 4 if max(ids) < 10 else 30)


def test_given_ids_are_checked_and_none_means_the_default():
    assert resolve_aux_layer_ids(None, 30) == (2, 15, 27) and resolve_aux_layer_ids(None, 4) == (1, 2, 3)
    assert resolve_aux_layer_ids([3, 10, 29], 30) == (3, 10, 29)
    with pytest.raises(EyasError, match="out of range"):
        resolve_aux_layer_ids([2, 15, 30], 30)


@pytest.mark.parametrize("ids", [(2, 2, 3), (3, 2, 1), (1, 2), (1, 2, 3, 3)])
def test_bad_shapes_refused(ids):
    with pytest.raises(EyasError):
        check_aux_layer_ids(ids, 8)


def test_sglang_ids_are_hf_minus_1():
    assert sglang_layer_ids([2, 15, 27], LLAMA) == [1, 14, 26]     # SmolLM2: SGLang adds +1
    assert sglang_layer_ids([2, 15, 27]) == [1, 14, 26]            # unknown architecture: the common convention
    assert sglang_capture_ids([1, 14, 26], LLAMA) == [2, 15, 27]
    with pytest.raises(EyasError, match="embedding"):
        sglang_layer_ids([0, 15, 27], LLAMA)


def test_deepseek_first_id_quirk():
    """deepseek_v2.py adds +1 only when the first id is 1."""
    assert sglang_layer_ids([2, 30, 58], DSV3) == [1, 29, 57]      # first becomes 1: +1 applies to all
    assert sglang_capture_ids([1, 29, 57], DSV3) == [2, 30, 58]
    assert sglang_layer_ids([3, 30, 58], DSV3) == [3, 30, 58]      # first != 1: used as given
    assert sglang_capture_ids([3, 30, 58], DSV3) == [3, 30, 58]
    assert sglang_capture_ids([2, 29, 57], DSV3) == [2, 29, 57]    # not [3, 30, 58]: no +1
    with pytest.raises(EyasError, match="cannot be expressed"):
        sglang_layer_ids([1, 30, 58], DSV3)
    assert sglang_layer_ids([2, 30, 58], KIMI) == [1, 29, 57]
    assert is_deepseek("X", "kimi_k2") and is_deepseek("X", "deepseek_v2") and not is_deepseek(LLAMA, "llama")
    # architecture unknown: both readings of SGLang ids, one when they agree (first id 1)
    assert sglang_capture_readings([1, 29, 57]) == [[2, 30, 58]]
    assert sglang_capture_readings([2, 29, 57]) == [[3, 30, 58], [2, 29, 57]]


@pytest.mark.parametrize("arch", [LLAMA, DSV3, None])
@pytest.mark.parametrize("n", [4, 7, 30, 32, 61])
def test_round_trip_every_default(arch, n):
    hf = list(default_aux_layer_ids(n))
    if arch == DSV3 and hf[0] == 1:   # shallow fallback: SGLang's DeepSeek cannot express it
        with pytest.raises(EyasError, match="cannot be expressed"):
            sglang_layer_ids(hf, arch)
        return
    assert sglang_capture_ids(sglang_layer_ids(hf, arch), arch) == hf


@pytest.mark.parametrize("hf", [[2, 15, 27], [3, 10, 20], [5, 6, 7], [1, 2, 3]])
@pytest.mark.parametrize("arch", [LLAMA, DSV3])
def test_round_trip_any_expressible_ids(hf, arch):
    try:
        sg = sglang_layer_ids(hf, arch)
    except EyasError:
        assert arch == DSV3 and hf[0] == 1
        return
    assert sglang_capture_ids(sg, arch) == hf


def test_launch_args_and_export_use_the_same_mapping(tmp_path):
    """The engines' launch flags, the exported eagle_config and the importer agree on every id."""
    from eyas.engines.launch_args import sglang_args
    from eyas.export.export import export_config
    from eyas.model.drafter import DrafterConfig
    from eyas.model.importer import resolve_layer_ids

    for arch, mt, n in [(LLAMA, "llama", 30), (DSV3, "deepseek_v3", 61)]:
        info = {"num_layers": n, "hidden_size": 64, "architecture": arch, "model_type": mt, "wrapper": False}
        for hf in [list(default_aux_layer_ids(n)), [3, n // 2, n - 2]]:
            args = sglang_args(info, "0.5.23", aux_layer_ids=hf)
            i = args.index("--return-aux-hidden-state-layer-ids")
            launched = [int(a) for a in args[i + 1:i + 4]]
            assert launched == sglang_layer_ids(hf, arch, mt)
            cfg = DrafterConfig.from_target(make_tiny_llama().config, draft_vocab_size=256, aux_layer_ids=tuple(hf))
            exported = export_config(cfg, arch=arch, model_type=mt)
            assert exported["eagle_aux_hidden_state_layer_ids"] == hf
            assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == launched
            back = resolve_layer_ids(json.loads(json.dumps(exported)), num_target_layers=n, where="x", warnings=[],
                                     arch=arch, model_type=mt)
            assert list(back) == hf
            sg_only = {"eagle_config": exported["eagle_config"]}
            assert list(resolve_layer_ids(sg_only, num_target_layers=n, where="x", warnings=[], arch=arch,
                                          model_type=mt)) == hf


def test_launch_args_refuse_id_n_and_importer_refuses_it():
    from eyas.engines.launch_args import sglang_args, vllm_args
    from eyas.model.importer import resolve_layer_ids

    info = {"num_layers": 30, "hidden_size": 64, "architecture": LLAMA, "model_type": "llama", "wrapper": False}
    for fn in (lambda ids: sglang_args(info, "0.5.23", aux_layer_ids=ids), lambda ids: vllm_args(info, aux_layer_ids=ids, max_model_len=64)):
        with pytest.raises(EyasError, match="out of range"):
            fn([2, 15, 30])
        fn([2, 15, 29])
    with pytest.raises(EyasError, match="out of range"):
        resolve_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 15, 30]}, num_target_layers=30, where="x",
                          warnings=[])
    with pytest.raises(EyasError, match="disagree"):
        resolve_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 15, 27],
                           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}},
                          num_target_layers=30, where="x", warnings=[], arch=LLAMA)


def test_one_definition_each():
    """grep finds one definition of each mapping."""
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[1] / "src"
    for name in ("default_aux", "sglang_layer_ids", "sglang_capture_ids", "sglang_capture_readings",
                 "check_aux_layer_ids", "resolve_aux_layer_ids", "is_deepseek"):
        hits = [p for p in src.rglob("*.py") if re.search(rf"^def {name}", p.read_text(), re.M)]
        assert len(hits) == 1, (name, hits)
    # the DeepSeek quirk is keyed on architectures named in target/layers.py only
    quirk = [p for p in src.rglob("*.py") if "DeepseekV3ForCausalLM\"" in p.read_text()]
    assert [p.relative_to(src).as_posix() for p in quirk] == ["eyas/target/layers.py"]
