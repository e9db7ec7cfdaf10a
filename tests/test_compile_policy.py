"""target/compile.py: the runner's compile settings resolved and checked as one policy, before any weight is copied."""

import pytest
import torch

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.target.compile import CompilePolicy
from eyas.target.runner import Runner

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only the device's type is read: no GPU needed


def test_gemv_default_is_one_only_for_a_static_whole_model_matmul_compile_on_cuda():
    gemv = lambda device=CUDA, **kw: CompilePolicy.resolve(device=device, **kw).gemv  # noqa: E731
    assert gemv(compile=True) == 1
    assert gemv(CPU, compile=True) == 0 and gemv() == 0
    assert gemv(compile=True, dynamic=True) == 0 and gemv(compile=True, regions=True) == 0
    assert gemv(compile=True, attention="flex") == 0
    assert gemv(compile=True, gemv=0) == 0 and gemv(compile=True, gemv=8) == 8


@pytest.mark.parametrize("kw, msg", [
    ({"attention": "sdpa"}, "attention 'sdpa'"),
    ({"gemv": -1}, "gemv -1"),
    ({"gemv": 1}, "gemv needs compile"),
    ({"fuse": True, "compile": True}, "fuse compiles the layers' pieces of an eager step"),
    ({"compile": True, "regions": True, "attention": "flex"}, "flex attention inside compile regions"),
    ({"compile_options": {"no_such_knob": 1}}, "unknown inductor option.*no_such_knob"),
    ({"persist": "x"}, "persist needs compile"),
    ({"persist": "x", "compile": True, "dynamic": True}, "static shapes"),
    ({"persist": "x", "compile": True, "regions": True}, "not regions or flex"),
    ({"persist": "x", "compile": True, "compile_options": {"freezing": True}}, "freezing"),
])
def test_settings_that_cannot_work_are_refused_before_the_weights_are_copied(monkeypatch, kw, msg):
    """The same refusals as Runner.from_hf's, and from_hf raises them without touching the model's weights."""
    with pytest.raises(EyasError, match=msg):
        CompilePolicy.resolve(device=CPU, **kw)

    def copied(*a, **k):
        raise AssertionError("weights copied before the settings were checked")
    monkeypatch.setattr(Runner, "copy_hf_weights", copied)
    with pytest.raises(EyasError, match=msg):
        Runner.from_hf(make_tiny_llama(layers=1, seed=0), max_batch=1, max_seq=8, **kw)


def test_the_runner_carries_its_policy_and_its_layers_follow_it():
    model = make_tiny_llama(layers=2, seed=0)
    r = Runner.from_hf(model, max_batch=1, max_seq=8, attention="flex")
    assert r.policy == CompilePolicy(attention="flex") and not r.compiled
    assert all(layer.flex and layer.gemv == 0 and not layer.fused for layer in r.layers)
    fused = Runner.from_hf(model, max_batch=1, max_seq=8, fuse=True)
    assert fused.policy == CompilePolicy(fuse=True) and not fused.compiled and all(la.fused for la in fused.layers)
    assert Runner.from_hf(model, max_batch=1, max_seq=8).policy == CompilePolicy()
