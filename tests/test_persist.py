"""Runner steps saved on disk (`Runner.from_hf(persist=DIR)`, eyas.target.persist): a second runner loads them
without compiling, equal to the eager runner; another configuration, a torn file and bad settings."""

import pytest
import torch

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.target import persist
from eyas.target.runner import Runner

pytestmark = pytest.mark.skipif(not persist.supported(), reason=f"torch {torch.__version__} lacks aot_compile")


def steps(r):
    """A decode step and a 3-node tree verify step with aux capture, on fixed inputs -> (outputs, the two callables)."""
    M = r.cfg.max_seq
    mask = torch.zeros(1, 1, M, dtype=torch.bool)
    mask[..., :4] = True
    tree = torch.zeros(1, 3, M, dtype=torch.bool)
    tree[..., :3] = True
    tree[0, :, 3] = True
    tree[0, 1, 4] = True
    tree[0, 2, 5] = True
    decode, verify = r._compiled or r._decode, r.step_fn((1, 2))
    out = decode(torch.tensor([[7]]), torch.tensor([[3]]), torch.tensor([[3]]), mask)
    logits, aux = verify(torch.tensor([[7, 8, 9]]), torch.tensor([[3, 4, 4]]), torch.tensor([[3, 4, 5]]), tree)
    return (out, logits, aux, r.layers[1].k_cache.clone()), (decode, verify)


def test_saved_steps_load_without_compiling_and_equal_eager(tmp_path, monkeypatch, capsys):
    model = make_tiny_llama(seed=5)
    want, _ = steps(Runner.from_hf(model, max_batch=1, max_seq=64))
    first = Runner.from_hf(model, max_batch=1, max_seq=64, compile=True, persist=tmp_path)
    got, (d, v) = steps(first)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (d.compiled, v.compiled, d.loaded, v.loaded) == (1, 1, 0, 0)
    files = sorted(tmp_path.glob("*.bin"))
    assert [f.name.split("-")[0] for f in files] == ["_decode_step", "_verify_step"]

    def no_compile(*a, **kw):
        raise AssertionError("torch.compile called: the saved steps were not used")
    monkeypatch.setattr(torch, "compile", no_compile)
    again, (d, v) = steps(Runner.from_hf(model, max_batch=1, max_seq=64, compile=True, persist=tmp_path))
    for a, b in zip(again, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (d.compiled, v.compiled, d.loaded, v.loaded) == (0, 0, 1, 1)
    monkeypatch.undo()

    # another cache length is another configuration: its own files
    _, (d, v) = steps(Runner.from_hf(model, max_batch=1, max_seq=32, compile=True, persist=tmp_path))
    assert (d.compiled, v.compiled) == (1, 1) and len(list(tmp_path.glob("*.bin"))) == 4

    # a torn file is compiled again, said on stderr, and replaced by a whole one
    files[0].write_bytes(files[0].read_bytes()[:100])
    capsys.readouterr()
    again, (d, _) = steps(Runner.from_hf(model, max_batch=1, max_seq=64, compile=True, persist=tmp_path))
    assert d.compiled == 1 and f"{files[0]}: could not use the saved compiled step" in capsys.readouterr().err
    torch.testing.assert_close(again[0], want[0], atol=1e-5, rtol=1e-5)
    _, (d, _) = steps(Runner.from_hf(model, max_batch=1, max_seq=64, compile=True, persist=tmp_path))
    assert d.loaded == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in tmp_path.glob("*.bin"))  # no temps


def test_a_call_with_aliased_arguments_gets_its_own_step(tmp_path):
    """round.py calls the verify step with one tensor as positions and slots; a saved function guards on such
    aliasing and would raise. It is its own call signature: its own file, compiled, equal to eager, loaded later."""
    model = make_tiny_llama(seed=5)
    M = 64
    mask = torch.zeros(1, 2, M, dtype=torch.bool)
    mask[..., :5] = True
    mask[0, 1, 5] = True
    ids, slots = torch.tensor([[7, 8]]), torch.tensor([[4, 5]])
    want = Runner.from_hf(model, max_batch=1, max_seq=M).step_fn((1, 2))(ids, slots, slots, mask)
    for run in range(2):
        r = Runner.from_hf(model, max_batch=1, max_seq=M, compile=True, persist=tmp_path)
        v = r.step_fn((1, 2))
        v(ids, slots.clone(), slots.clone(), mask)  # separate buffers (the graphed warm-up)
        got = v(ids, slots, slots, mask)  # one tensor twice (the one-graph round)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert (v.compiled, v.loaded, v.fallbacks) == ((2, 0, 0) if run == 0 else (0, 2, 0))


def test_bad_persist_settings_are_refused(tmp_path):
    model = make_tiny_llama(seed=5)
    for kw, msg in (({}, "persist needs compile"), ({"compile": True, "dynamic": True}, "static shapes"),
                    ({"compile": True, "compile_options": {"freezing": True}}, "freezing"),
                    ({"compile": True, "regions": True}, "not regions or flex"),
                    ({"compile": True, "attention": "flex"}, "not regions or flex")):
        with pytest.raises(EyasError, match=msg):
            Runner.from_hf(model, max_batch=1, max_seq=16, persist=tmp_path, **kw)


def test_the_file_name_follows_the_source_and_the_call(tmp_path, monkeypatch):
    """A file is named by a hash of eyas's source (a code change must not load an old step), and by the call's
    tensors, their aliasing and the thread count (dynamo guards on them)."""
    h = persist.source_hash()
    assert len(h) == 64
    persist.source_hash.cache_clear()
    assert persist.source_hash() == h
    r = Runner.from_hf(make_tiny_llama(seed=5), max_batch=1, max_seq=16, compile=True, persist=tmp_path)
    x, y = torch.zeros(1, 2), torch.zeros(1, 3)
    name = lambda *a: r._compiled.path_for(persist.signature(a)).name  # noqa: E731
    assert name(x) == name(x.clone()) and name(x) != name(y) and name(x, x) != name(x, x.clone())
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        other = name(x)
    finally:
        torch.set_num_threads(threads)
    assert other != name(x)
    monkeypatch.setattr(persist, "source_hash", lambda: "edited")
    edited = name(x)
    monkeypatch.undo()
    assert edited != name(x)


def test_bench_persist_steps_needs_compile(capsys):
    """`eyas bench --persist-steps` without --compile: one line naming the fix, exit 2 (the CLI's bad-input code)."""
    from eyas.cli import main

    assert main(["bench", "--target", "smollm2-135m", "--persist-steps", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "persist_steps keeps compiled steps: it needs compile" in err[0]


def test_captured_graphs_do_not_stop_a_step_from_being_saved(tmp_path):
    """On CUDA the runner's captured steps close over CUDA graphs, which cannot be pickled; dynamo pickles the guard
    state of a step with the runner as its argument, so a verify step compiled after the decode step's capture
    failed on the H200 ("cannot pickle 'CUDAGraph' object"). The runner's captured steps pickle as an
    empty dict: an unpicklable object in them (a lock, on the CPU) leaves the verify step compiled and saved, not a
    fallback, and equal to eager."""
    import threading

    model = make_tiny_llama(seed=5)
    want, _ = steps(Runner.from_hf(model, max_batch=1, max_seq=64))
    r = Runner.from_hf(model, max_batch=1, max_seq=64, compile=True, persist=tmp_path)
    r._graphs[("stand-in for a CUDA graph",)] = threading.Lock()  # stored itself: torch 2.13 does not pickle closures
    got, (d, v) = steps(r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (d.compiled, v.compiled, d.fallbacks, v.fallbacks) == (1, 1, 0, 0)
    assert len(list(tmp_path.glob("*.bin"))) == 2


def test_a_runner_with_captured_steps_is_freed():
    """The captured steps hold the runner (bound methods): kept on the runner, not in a module-level map, the cycle
    is collected when the runner is dropped."""
    import gc
    import weakref

    r = Runner.from_hf(make_tiny_llama(seed=5), max_batch=1, max_seq=16)
    r.graphed(1, 1)
    assert r._graphs
    gone = weakref.ref(r)
    del r
    gc.collect()
    assert gone() is None


def test_a_step_that_cannot_be_saved_runs_under_plain_torch_compile(tmp_path, capsys):
    """aot_compile raising (here: a plain dict attribute of the runner holding a lock, which dynamo's guard pickler
    walks) costs the save, not the run: one line on stderr, plain torch.compile, the eager result, no file."""
    import threading

    model = make_tiny_llama(seed=5)
    want, _ = steps(Runner.from_hf(model, max_batch=1, max_seq=64))
    r = Runner.from_hf(model, max_batch=1, max_seq=64, compile=True, persist=tmp_path)
    r.unpicklable = {"lock": threading.Lock()}
    got, (d, v) = steps(r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (d.fallbacks, v.fallbacks, d.compiled, v.compiled) == (1, 1, 0, 0)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eyas:")]
    assert len(err) == 2 and all("this step cannot be saved (TypeError: cannot pickle" in e for e in err), err
    assert not list(tmp_path.glob("*.bin"))


def test_the_steps_pass_every_keyword_so_no_defaults_guard(caplog):
    """A keyword left to forward's default becomes a dynamo guard on `__kwdefaults__` (a DefaultsSource), which
    torch 2.11 saves but cannot load ("DefaultsSource.__init__() takes from 3 to 4 positional arguments but 6 were
    given" on the H200; fixed in torch 2.12). The guards dynamo prints for both steps name none."""
    import logging

    r = Runner.from_hf(make_tiny_llama(seed=5), max_batch=1, max_seq=64, compile=True)
    torch._logging.set_logs(guards=True)
    try:
        with caplog.at_level(logging.DEBUG):
            steps(r)
    finally:
        torch._logging.set_logs()
    text = "\n".join(rec.getMessage() for rec in caplog.records)
    assert text.count("GUARDS:") >= 2 and "cfg.num_layers" in text  # both steps' guards were printed
    assert "__kwdefaults__" not in text and "__defaults__" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphed_steps_are_saved_and_loaded(tmp_path):
    """The bench's order on CUDA: the decode step captured as a CUDA graph, then the verify step compiled and
    captured (where torch 2.11 raised "cannot pickle 'CUDAGraph' object"). Both are saved, a second
    runner loads both without compiling, and the graphs' outputs equal the eager CPU runner's."""
    model = make_tiny_llama(seed=5)
    M = 64
    cpu = Runner.from_hf(model, max_batch=1, max_seq=M)
    mask = torch.zeros(1, 3, M, dtype=torch.bool)
    mask[..., :4] = True
    mask[0, 1, 4] = True
    mask[0, 2, 5] = True
    ids, pos, slots = torch.tensor([[7, 8, 9]]), torch.tensor([[4, 5, 5]]), torch.tensor([[4, 5, 6]])
    one = (ids[:, :1], pos[:, :1], slots[:, :1], mask[:, :1])
    want = (cpu._decode(*one), *cpu.step_fn((1, 2))(ids, pos, slots, mask))
    for run in range(2):
        r = Runner.from_hf(model, max_batch=1, max_seq=M, device="cuda", compile=True, persist=tmp_path)
        verify = r.step_fn((1, 2))
        got = (r.graphed(1, 1)(*(t.cuda() for t in one)).clone(),
               *(t.clone() for t in r.graphed(1, 3, verify)(ids.cuda(), pos.cuda(), slots.cuda(), mask.cuda())))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)
        counts = (r._compiled.compiled, verify.compiled, r._compiled.loaded, verify.loaded, verify.fallbacks)
        assert counts == ((1, 1, 0, 0, 0) if run == 0 else (0, 0, 1, 1, 0)), counts
