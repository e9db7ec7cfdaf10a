"""AST patcher against the real model files of SGLang releases (0.5.14 and the newest on PyPI)."""

import ast
import hashlib

import pytest

from support import engine_src
from eyas.engines import sglang_patch as sp
from eyas.errors import EyasError


@pytest.fixture(params=engine_src.versions(), ids=lambda v: v or "newest")
def models(request, tmp_path):
    whl = engine_src.wheel(request.param)
    if whl is None:
        pytest.skip(f"no SGLang wheel {request.param or 'newest'} cached and PyPI not reachable")
    return sp.models_dir(engine_src.extract_models(whl, tmp_path))


def digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def enclosing(tree, lineno):
    """(class, method, previous statement) of the top-level method statement starting at lineno."""
    for c in tree.body:
        if isinstance(c, ast.ClassDef):
            for f in c.body:
                if isinstance(f, ast.FunctionDef):
                    for k, s in enumerate(f.body):
                        if s.lineno == lineno:
                            return c.name, f.name, f.body[k - 1] if k else None
    return None


def test_apply_check_revert_on_real_sources(models):
    before = digest(models)
    changes = sp.plan(models)
    for c in changes:                                              # --check: 4 added lines, nothing removed
        body = c.diff().splitlines()[2:]
        assert [l[:1] for l in body if l[:1] in "+-"] == ["+"] * 4
    assert digest(models) == before                                # --check writes nothing
    sp.apply(models)
    once = digest(models)
    for point in sp.POINTS:
        src = (models / point.file).read_text()
        tree = ast.parse(src)                                      # patched file parses
        lines = src.splitlines()
        calls = [i + 1 for i, l in enumerate(lines) if l.strip() == "_eyas_attach(self)"]
        imports = [i + 1 for i, l in enumerate(lines) if l.strip() == sp.BODY[0]]
        assert len(calls) == 1 and len(imports) == 1
        cls, meth, prev = enclosing(tree, imports[0])
        assert (cls, meth) == (point.cls, point.method)
        assert sp._is_target_stmt(prev, point.attr)               # right after self.logits_processor = ...
        assert enclosing(tree, calls[0])[:2] == (point.cls, point.method)
    sp.apply(models)
    assert digest(models) == once                                  # apply twice == apply once
    assert all(c.new == c.old for c in sp.plan(models))
    sp.revert(models)
    assert digest(models) == before                                # byte-exact revert, backups gone


def test_refuses_missing_and_ambiguous_points(tmp_path):
    point = sp.PatchPoint("x.py", "M", "__init__", "logits_processor")
    ok = "class M:\n    def __init__(self):\n        self.logits_processor = 1\n        self.y = 2\n"
    assert "_eyas_attach(self)" in sp.patched_source(ok, point)
    two = ok + "        self.logits_processor = 3\n"
    nested = "class M:\n    def __init__(self):\n        if x:\n            self.logits_processor = 1\n"
    wrong_method = "class M:\n    def forward(self):\n        self.logits_processor = 1\n"
    for src, msg in [(two, "found 2"), (nested, "found 0"), (wrong_method, "M.__init__"),
                     ("class N:\n    pass\n", "one class M"), ("def (:\n", "does not parse")]:
        with pytest.raises(EyasError, match=msg.replace("(", r"\(")):
            sp.patched_source(src, point)


def test_revert_refuses_foreign_edits(tmp_path):
    d = tmp_path / "sglang" / "srt" / "models"
    d.mkdir(parents=True)
    src = "class LlamaForCausalLM:\n    def __init__(self):\n        self.logits_processor = 1\n"
    (d / "llama.py").write_text(src)
    pts = sp.POINTS[:1]
    sp.apply(d, pts)
    (d / "llama.py").write_text((d / "llama.py").read_text() + "# someone else\n")
    with pytest.raises(EyasError, match="outside the eyas block"):
        sp.revert(d, pts)
    with pytest.raises(EyasError, match="missing"):
        sp.plan(d)                                                 # qwen2.py etc. absent -> refused


def test_attach_registers_the_same_hook(monkeypatch, tmp_path):
    """The patched-source path registers what launch-args prints, on the same modules hook_manager would."""
    import json

    from support.engine_fakes import ForwardMode, make_args
    from eyas.engines import sglang_hook
    from eyas.engines.launch_args import hook_spec
    from test_engine_client import SAMPLES
    from test_engine_sglang_forward import LlamaForCausalLM as Causal

    made = []
    monkeypatch.setattr(sglang_hook, "make_capture_hook", lambda cfg: made.append(cfg) or (lambda *a: None))
    spec = hook_spec("S", "D", [2, 4, 5], num_layers=6, aux_flag=False)     # what launch-args prints
    monkeypatch.setenv(sglang_hook.HOOK_ENV, json.dumps(spec))
    m = Causal()
    sglang_hook.attach(m)
    assert made == [spec[0]["config"]] and len(m.logits_processor._forward_hooks) == 1
    assert len(m.model._forward_hooks) == 1 and not m._forward_hooks   # the inner model: SGLang runs root.forward
    m.forward(make_args([("warmup", "s0", 0, 3, 0)], SAMPLES, mode=ForwardMode.DECODE))
    assert m.model.layers_to_capture == [2, 4, 5]
    monkeypatch.delenv(sglang_hook.HOOK_ENV)
    m2 = Causal()
    sglang_hook.attach(m2)                                          # unset -> patched server is unchanged
    assert not m2.logits_processor._forward_hooks and not m2._forward_hooks
