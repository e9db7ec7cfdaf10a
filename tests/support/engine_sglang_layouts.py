"""What each SGLang release offers eyas's capture path, per version, and a stub package with that layout.

LAYOUTS records, for the releases where something changes, what was read from the wheel:
  rank_fns        the get_attention_{tp_rank,dp_rank,dp_size} functions in sglang/srt/layers/dp_attention.py
  get_parallel    sglang/srt/runtime_context.py defines get_parallel(), whose context exposes
                  attn_tp_rank / attn_dp_rank / attn_dp_size
  hooks           --forward-hooks is a server argument (sglang/srt/model_executor/hook_manager.py exists)
  rids            ForwardBatch has a `rids` field (the hook attributes rows to requests by it)
  aux_flag        --enable-return-aux-hidden-states is a server argument
`layout_from_wheel` reads the same facts from a wheel with `ast`/text search, so
test_engine_sglang_versions checks this table against the real releases whenever PyPI (or the
wheel cache) is reachable; the fast tests build `stub_package` from the table and need no network.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from . import engine_src

RANK_FNS = ("get_attention_tp_rank", "get_attention_dp_rank", "get_attention_dp_size")
ALL = frozenset(RANK_FNS)
DP_ONLY = frozenset(RANK_FNS[1:])


def _v(rank_fns, get_parallel, hooks, rids, aux_flag):
    return {"rank_fns": frozenset(rank_fns), "get_parallel": get_parallel, "hooks": hooks, "rids": rids,
            "aux_flag": aux_flag}


LAYOUTS = {
    "0.5.5.post3": _v(ALL, False, False, False, False),
    "0.5.6": _v(ALL, False, True, False, False),       # --forward-hooks arrives; ForwardBatch has no rids
    "0.5.9": _v(ALL, False, True, False, False),
    "0.5.10": _v(ALL, False, True, True, False),       # ForwardBatch.rids arrives
    "0.5.13.post1": _v(ALL, False, True, True, False),
    "0.5.14": _v(ALL, True, True, True, False),        # runtime_context.get_parallel arrives
    "0.5.15": _v(ALL, True, True, True, False),
    "0.5.16": _v(DP_ONLY, True, True, True, False),    # get_attention_tp_rank gone
    "0.5.20": _v(DP_ONLY, True, True, True, False),
    "0.5.21": _v((), True, True, True, False),         # all get_attention_* gone
    "0.5.22": _v((), True, True, True, False),
    "0.5.23": _v((), True, True, True, True),          # --enable-return-aux-hidden-states arrives
}


def _defs(src: str | None) -> dict[str, ast.AST]:
    return {} if src is None else {n.name: n for n in ast.parse(src).body
                                   if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _context_has_ranks(src: str | None) -> bool:
    """runtime_context: get_parallel() exists and ParallelContext serves the three attn_* names."""
    defs = _defs(src)
    ctx = defs.get("ParallelContext")
    if "get_parallel" not in defs or not isinstance(ctx, ast.ClassDef):
        return False
    members = {n.name for n in ctx.body if isinstance(n, ast.FunctionDef)}
    names = ("attn_tp_rank", "attn_dp_rank", "attn_dp_size")
    if all(n in members for n in names):
        return True                                   # 0.5.14-0.5.20: properties
    # 0.5.21+: __getattr__ reads values published per rank name, listed as string constants in the module
    consts = {c.value for c in ast.walk(ast.parse(src)) if isinstance(c, ast.Constant)}
    return "__getattr__" in members and all(n in consts for n in names)


def server_arg_sources(whl: Path) -> list[str]:
    import zipfile
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n == "sglang/srt/server_args.py"
                 or (n.startswith("sglang/srt/arg_groups/") and n.endswith(".py"))]
        return [z.read(n).decode() for n in names]


def declares_flag(sources: list[str], flag: str) -> bool:
    """`--x-y` is an argparse string (<= 0.5.13) or a declared field `x_y:` (arg_groups, 0.5.14+)."""
    field = flag.lstrip("-").replace("-", "_")
    pat = re.compile(rf"^\s+{field}\s*:", re.M)
    return any(f'"{flag}"' in s or pat.search(s) for s in sources)


def layout_from_wheel(whl: Path) -> dict:
    dp = _defs(engine_src.read_member(whl, "sglang/srt/layers/dp_attention.py"))
    fb = engine_src.read_member(whl, "sglang/srt/model_executor/forward_batch_info.py") or ""
    fb_cls = _defs(fb).get("ForwardBatch")
    fields = {t.target.id for t in getattr(fb_cls, "body", []) if isinstance(t, ast.AnnAssign)
              and isinstance(t.target, ast.Name)}
    args = server_arg_sources(whl)
    return _v([n for n in RANK_FNS if n in dp],
              _context_has_ranks(engine_src.read_member(whl, "sglang/srt/runtime_context.py")),
              engine_src.read_member(whl, "sglang/srt/model_executor/hook_manager.py") is not None
              and declares_flag(args, "--forward-hooks"),
              "rids" in fields, declares_flag(args, "--enable-return-aux-hidden-states"))


def stub_package(root: Path, layout: dict, ranks: tuple[int, int, int]) -> Path:
    """root/sglang with only the modules and names `layout` says the release has, returning `ranks`."""
    tp, dp, size = ranks
    pkg = root / "sglang"
    for d in (pkg, pkg / "srt", pkg / "srt" / "layers"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    values = {"get_attention_tp_rank": tp, "get_attention_dp_rank": dp, "get_attention_dp_size": size}
    fns = "".join(f"def {n}():\n    return {values[n]}\n\n" for n in sorted(layout["rank_fns"]))
    (pkg / "srt" / "layers" / "dp_attention.py").write_text(fns)
    if layout["get_parallel"]:
        (pkg / "srt" / "runtime_context.py").write_text(textwrap.dedent(f"""\
            class ParallelContext:
                def __getattr__(self, name):
                    return {{"attn_tp_rank": {tp}, "attn_dp_rank": {dp}, "attn_dp_size": {size}}}[name]

            def get_parallel():
                return ParallelContext()
            """))
    return root


def _call_name(node) -> str | None:
    f = node.func if isinstance(node, ast.Call) else None
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def model_classes(whl: Path) -> dict[str, ast.ClassDef]:
    """Every class of sglang/srt/models/*.py; a name an EntryClass lists wins over other same-named classes."""
    import zipfile
    classes, entries = {}, {}
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if n.startswith("sglang/srt/models/") and n.endswith(".py"):
                tree = ast.parse(z.read(n).decode("utf-8-sig"))
                listed = {e.id for a in tree.body if isinstance(a, ast.Assign)
                          and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in a.targets)
                          for e in ast.walk(a.value) if isinstance(e, ast.Name)}
                for c in tree.body:
                    if isinstance(c, ast.ClassDef) and (c.name not in classes or c.name in listed):
                        if c.name not in entries:
                            classes[c.name] = c
                        if c.name in listed:
                            entries[c.name] = c
    return {**classes, **entries}


def init_attrs(classes: dict, cls: str, depth: int = 0) -> dict[str, str]:
    """self.<attr> = <Ctor>(...) assignments of the class's __init__, its bases' first: attr -> Ctor."""
    node = classes.get(cls)
    if node is None or depth > 5:
        return {}
    attrs: dict[str, str] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id != cls:
            attrs.update(init_attrs(classes, base.id, depth + 1))
    for f in node.body:
        if isinstance(f, ast.FunctionDef) and f.name == "__init__":
            for s in ast.walk(f):
                if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call):
                    for t in s.targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            attrs[t.attr] = _call_name(s.value) or ""
    return attrs


def logits_processor_names(classes: dict, cls: str, prefix: str = "", depth: int = 0) -> list[str]:
    """Names in model.named_modules() of every LogitsProcessor the class builds in __init__ (own or
    inherited, following sub-modules that are model classes), as hook_manager would see them."""
    out = []
    for attr, made in init_attrs(classes, cls).items():
        if made == "LogitsProcessor":
            out.append(prefix + attr)
        elif made in classes and depth < 3:
            out += logits_processor_names(classes, made, f"{prefix}{attr}.", depth + 1)
    return sorted(set(out))
