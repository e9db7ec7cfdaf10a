"""How a Runner compiles its steps: from_hf's compile options checked as one policy, and the step compiler.

`CompilePolicy.resolve` turns Runner.from_hf's keywords into one checked policy (gemv's default filled in) and
refuses the combinations that cannot work, before any weight is copied. `compile_step` compiles one step under
it: plain torch.compile, or with `persist` a step saved to and loaded from disk (`eyas.target.persist`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.target import persist as persist_mod
from eyas.target.fingerprint import cache_root
from eyas.target.persist import PersistentStep

ATTENTION = ("matmul", "flex")


def check_attention(attention: str) -> None:
    """Refuse an attention kind the runner does not have (checked before the target's family is looked at)."""
    if attention not in ATTENTION:
        raise EyasError(f"runner: attention {attention!r}: expected matmul or flex")


def raise_recompile_limit(at_least: int = 64) -> None:
    """Let dynamo keep `at_least` compiled versions of one code object (default 8). Every runner, drafter, batch and
    shape is a recompile of the same code; past the limit a fullgraph compile raises and others fall back to eager.
    The one place eyas raises it (runner steps, static drafters, flex attention, training)."""
    from torch import _dynamo

    _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, at_least)


def has_regions() -> bool:
    """Whether this torch has compile regions (torch.compiler.nested_compile_region)."""
    return hasattr(torch.compiler, "nested_compile_region")


@dataclass(frozen=True, kw_only=True)
class CompilePolicy:
    """How Runner.from_hf builds and compiles its steps; the default is eager with matmul attention."""

    compile: bool = False
    """torch.compile the decode and verify steps (each CUDA graph then replays fused kernels)."""
    dynamic: bool = False
    """One compile for every batch and slot count (batched generation meets many), not one per shape."""
    regions: bool = False
    """With compile: inductor compiles the decoder layer once for all layers, not the unrolled stack (faster to
    compile, no fusion across layer boundaries; BENCHMARKS.md#compile-regions-vs-whole-step-compile-2026-12-01-1403-utc)."""
    options: dict = field(default_factory=dict)
    """Inductor options for those compiles (torch.compile `options`); benchmarks.compile_variants compares them."""
    attention: str = "matmul"
    """"matmul" (few-query steps as plain matmuls, many as fused SDPA) or "flex" (flex_attention over the mask)."""
    gemv: int = 0
    """With compile: projections of steps of at most this many rows as inductor reductions, not GEMMs (0: off)."""
    persist: Path | None = None
    """With a static whole-model compile: where compiled steps are saved and loaded (`eyas.target.persist`)."""
    fuse: bool = False
    """Without compile: each decoder layer's norms, projections, RoPE and MLP as two compiled functions shared by all
    layers, around an eager attention and cache write; the step stays eager (a CUDA graph on CUDA), so it also takes
    steps by lengths, which a compiled step refuses."""

    @classmethod
    def resolve(cls, *, compile: bool = False, dynamic: bool = False, regions: bool = False,
                compile_options: dict | None = None, attention: str = "matmul", gemv: int | None = None,
                persist: str | os.PathLike | None = None, fuse: bool = False,
                device: torch.device) -> "CompilePolicy":
        """The policy for from_hf's keywords on `device`, or an EyasError naming the setting that cannot work.

        gemv None is the default: 1 for a static-shape whole-model compile with matmul attention on CUDA, where it
        made the batch-1 decode step faster with equal tokens (BENCHMARKS.md#runner-compile-variants-compile_variantspy-6c4c7d7), else 0.
        """
        check_attention(attention)
        if gemv is None:
            whole_static_matmul = compile and not dynamic and not regions and attention == "matmul"
            gemv = 1 if whole_static_matmul and device.type == "cuda" else 0
        if int(gemv) < 0:
            raise EyasError(f"runner: gemv {gemv!r}: expected a row count >= 0 (0: off)")
        if persist is not None:
            check_persist(compile=compile, dynamic=dynamic, regions=regions, attention=attention,
                          compile_options=compile_options)
        if fuse and compile:
            raise EyasError("runner: fuse compiles the layers' pieces of an eager step; with compile=True the whole "
                            "step is compiled already: use one or the other")
        if gemv and not compile:
            raise EyasError("runner: gemv needs compile=True (its reductions replace GEMMs in compiled steps only)")
        if attention == "flex" and regions and compile:  # torch 2.13: an internal functionalization assert
            raise EyasError("runner: flex attention inside compile regions fails to compile (torch "
                            f"{torch.__version__}); use one or the other")
        options = dict(compile_options or {})
        if options:
            from torch._inductor import config as inductor_config

            unknown = sorted(set(options) - set(inductor_config.get_config_copy()))
            if unknown:
                raise EyasError(f"runner: unknown inductor option(s) {', '.join(unknown)} (torch {torch.__version__})")
        if regions and compile and not has_regions():
            raise EyasError(f"runner: compile regions need torch.compiler.nested_compile_region, which torch "
                            f"{torch.__version__} lacks")
        return cls(compile=compile, dynamic=dynamic, regions=regions, options=options, attention=attention,
                   gemv=int(gemv), persist=None if persist is None else Path(persist), fuse=fuse)


def check_persist(*, compile: bool, dynamic: bool, regions: bool, attention: str, compile_options: dict | None) -> None:
    """Refuse persist where a saved step could not serve: only static whole-model matmul steps, weights not baked in."""
    if not compile or dynamic:
        raise EyasError("runner: persist needs compile=True with static shapes (dynamic=False)")
    if regions or attention != "matmul":
        raise EyasError("runner: persist saves whole-model matmul-attention steps only (not regions or flex)")
    if (compile_options or {}).get("freezing"):  # frozen weights would be constants inside the file
        raise EyasError("runner: persist cannot save steps compiled with inductor freezing (weights baked in)")
    if not persist_mod.supported():
        raise EyasError(f"runner: torch {torch.__version__} cannot save compiled functions "
                        "(torch.compile(...).aot_compile); leave persist unset")


def compile_step(policy: CompilePolicy, fn, *, dynamic, owner=None, free=None, extra=(), config: str = ""):
    """torch.compile(fn) under `policy`; with persist and `free` (fn as a function of `owner`, then `extra`), a
    PersistentStep that saves it on disk, its files named also by `config` (what else shapes the step's code)."""
    raise_recompile_limit()  # a process holds a few runners (a bench's, the batched decoder's, the tests')
    if policy.persist is not None and free is not None:
        return PersistentStep(free, owner, policy.persist, config, policy.options, extra)
    c = torch.compile(fn, fullgraph=True, dynamic=dynamic, options=policy.options or None)
    if policy.regions:
        # with dynamic shapes the norms' eps would become a symbolic float, which a compile region
        # mishandles (torch 2.13: "Argument ... does not belong to this Graph"); it is a constant anyway
        c = torch._dynamo.config.patch(specialize_float=True)(c)
    return c


def _inductor_counters() -> dict:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {"fx_graph_hits": int(c.get("fxgraph_cache_hit", 0)), "fx_graph_misses": int(c.get("fxgraph_cache_miss", 0))}


@contextmanager
def compile_cache(enabled: bool):
    """A persistent compile cache, for the bench's start-up and for training (bench/startup.py says why). While
    open, inductor's caches live under $EYAS_CACHE/inductor (a TORCHINDUCTOR_CACHE_DIR the user set to a
    non-default path wins) with the FX graph cache on. Yields a dict that, on exit, holds the directory and the
    FX-graph cache hits/misses of the block. Restores the environment after."""
    info: dict = {}
    if not enabled:
        yield info
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    mine = before is None or os.path.abspath(before) == os.path.abspath(default_cache_dir())
    path = str(Path(cache_root()) / "inductor") if mine else before
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    start = _inductor_counters()
    try:
        with inductor_config.patch(fx_graph_cache=True):
            yield info
    finally:
        end = _inductor_counters()
        info.update({"dir": path, **{k: end[k] - start[k] for k in end}})
        if mine:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
