"""Read the EAGLE-3 loader contract out of SGLang / vLLM source with `ast` (no engine import, no GPU).

Two pieces, both mechanical:
- `build_params`: a tiny abstract interpreter over the engines' `__init__` methods. It runs the
  constructors of the EAGLE-3 model with OUR exported config.json as the HF config and records
  every module that holds a weight (Linear, RMSNorm, QKVParallelLinear, ParallelLMHead, ...) with
  its shape, evaluated from the constructor arguments. Anything it cannot evaluate is `UNKNOWN`.
- literal extraction: rename maps, stacked-parameter maps, skipped/special key substrings and the
  config fields the code reads, taken from the source as literals.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


class _Unknown:
    def __repr__(self):
        return "UNKNOWN"

    def __bool__(self):
        raise _Stop("truth value of UNKNOWN")


UNKNOWN = _Unknown()


class _Stop(Exception):
    pass


class _Return(Exception):
    """A `return` inside interpreted code, carrying its value."""

    def __init__(self, value=None):
        super().__init__()
        self.value = value


@dataclass
class LeafType:
    """A weight-holding module class the interpreter does not parse (RMSNorm from a layers file), used as a value:
    `norm_cls = RMSNorm; norm_cls(h)` builds the same Leaf as `RMSNorm(h)`."""
    kind: str


class NS:
    """A namespace object: attributes from a dict (the HF config, vllm_config, ...)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


@dataclass
class Leaf:
    kind: str
    args: list
    kwargs: dict


@dataclass
class Obj:
    cls: str
    attrs: dict = field(default_factory=dict)


@dataclass
class ParamSpec:
    shape: tuple
    dtype: str


# Weight-holding module types -> (positional parameter names) for shape evaluation.
LEAF_SIGNATURES = {
    "Linear": ("in_features", "out_features"),
    "ReplicatedLinear": ("input_size", "output_size"),
    "RowParallelLinear": ("input_size", "output_size"),
    "ColumnParallelLinear": ("input_size", "output_size"),
    "MergedColumnParallelLinear": ("input_size", "output_sizes"),
    "QKVParallelLinear": ("hidden_size", "head_size", "total_num_heads", "total_num_kv_heads"),
    "RMSNorm": ("hidden_size",),
    "ParallelLMHead": ("num_embeddings", "embedding_dim"),
    "VocabParallelEmbedding": ("num_embeddings", "embedding_dim"),
}


class Module:
    """One parsed source file: its classes and the names it imports."""

    def __init__(self, path: Path, dotted: str):
        self.path, self.dotted = path, dotted
        self.tree = ast.parse(path.read_text())
        self.classes = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)}
        self.imports: dict[str, tuple[str, str]] = {}
        self.aliases: dict[str, str] = {}
        for node in self.tree.body:
            self._scan(node)

    def _scan(self, node):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:   # `from .qwen2 import X`: module ".qwen2", resolved against this file's package
                self.imports[a.asname or a.name] = ("." * node.level + node.module, a.name)
        elif isinstance(node, ast.If):   # `if TYPE_CHECKING: ... else: Alias = Real` -> the runtime branch
            for n in (node.orelse if "TYPE_CHECKING" in ast.unparse(node.test) else node.body + node.orelse):
                self._scan(n)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            self.aliases[node.targets[0].id] = node.value.id


class Interpreter:
    def __init__(self, modules: dict[str, Module], builtins: dict):
        self.modules = modules
        self.builtins = builtins          # names / call results we model, e.g. get_current_vllm_config

    # --- name resolution -------------------------------------------------------------------------
    def resolve_class(self, mod: Module, name: str, *, exclude=None):
        name = mod.aliases.get(name, name)
        if name in mod.classes and mod.classes[name] is not exclude:
            return mod, mod.classes[name]
        if name in mod.imports:
            src, real = mod.imports[name]
            if src.startswith("."):
                src = mod.dotted.rsplit(".", 1)[0] + src
            if src in self.modules:
                return self.resolve_class(self.modules[src], real)
        return None

    # --- execution ---------------------------------------------------------------------------------
    def construct(self, mod: Module, cls: ast.ClassDef, args, kwargs, obj: Obj | None = None) -> Obj:
        obj = obj or Obj(cls.name)
        # class attributes (`decoder_layer_cls = X`, `supports_quantization = False`); a subclass's are set first and win
        for n in cls.body:
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                obj.attrs.setdefault(n.targets[0].id, self.eval(n.value, mod, {}, cls))
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            return obj
        self.call_function(mod, init, args, kwargs, cls, obj)
        return obj

    def call_function(self, mod: Module, fn: ast.FunctionDef, args, kwargs, cls, self_obj=None):
        """Run fn's body with its parameters bound; its return value (None without a `return`)."""
        env = {"self": self_obj} if self_obj is not None else {}
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args][1 if self_obj is not None else 0:]
        defaults = fn.args.defaults
        for name, d in zip(params[len(params) - len(defaults):], defaults):
            env[name] = self.eval(d, mod, {}, cls)
        for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
            env[a.arg] = self.eval(d, mod, {}, cls) if d is not None else UNKNOWN
        for name, v in zip(params, args):
            env[name] = v
        env.update({k: v for k, v in kwargs.items() if k in env or k in params})
        try:
            self.run(fn.body, mod, env, cls)
        except _Return as r:
            return r.value
        return None

    def find_method(self, mod: Module, cls: ast.ClassDef, name: str):
        """(module, FunctionDef) of method `name` on cls or its first parsed base that has it, else None."""
        fn = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if fn is not None:
            return mod, fn
        for b in cls.bases:
            base = self.resolve_class(mod, ast.unparse(b), exclude=cls)
            if base is not None and (found := self.find_method(base[0], base[1], name)) is not None:
                return found
        return None

    def run(self, stmts, mod, env, cls):
        for s in stmts:
            if isinstance(s, ast.Return):
                raise _Return(self.eval(s.value, mod, env, cls) if s.value is not None else None)
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and ast.unparse(s.value.func) == "super().__init__":
                base = self.resolve_class(mod, ast.unparse(cls.bases[0]), exclude=cls) if cls.bases else None
                if base is not None:
                    args = [self.eval(a, mod, env, cls) for a in s.value.args]
                    kw = {k.arg: self.eval(k.value, mod, env, cls) for k in s.value.keywords if k.arg}
                    try:
                        self.construct(base[0], base[1], args, kw, obj=env["self"])
                    except _Return:
                        pass
            elif isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value is not None:
                value = self.eval(s.value, mod, env, cls)
                for t in (s.targets if isinstance(s, ast.Assign) else [s.target]):
                    self.assign(t, value, mod, env, cls)
            elif isinstance(s, ast.If):
                try:
                    branch = s.body if self.truth(self.eval(s.test, mod, env, cls)) else s.orelse
                except _Stop:   # undecidable: run both, the later branch wins
                    self.run(s.body, mod, env, cls)
                    branch = s.orelse
                self.run(branch, mod, env, cls)
            elif isinstance(s, ast.With):
                self.run(s.body, mod, env, cls)

    @staticmethod
    def truth(v):
        if v is UNKNOWN:
            raise _Stop("undecidable")
        return bool(v)

    def assign(self, t, value, mod, env, cls):
        if isinstance(t, ast.Name):
            env[t.id] = value
        elif isinstance(t, ast.Attribute):
            owner = self.eval(t.value, mod, env, cls)
            if isinstance(owner, Obj):
                owner.attrs[t.attr] = value
            elif isinstance(owner, NS):
                setattr(owner, t.attr, value)

    def eval(self, e, mod, env, cls):
        try:
            return self._eval(e, mod, env, cls)
        except (_Stop, TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError):
            return UNKNOWN

    def _eval(self, e, mod, env, cls):
        ev = lambda x: self._eval(x, mod, env, cls)   # noqa: E731
        if isinstance(e, ast.Constant):
            return e.value
        if isinstance(e, ast.Name):
            if e.id in env:
                return env[e.id]
            if e.id in self.builtins:
                return self.builtins[e.id]
            if e.id in ("None", "True", "False"):
                return {"None": None, "True": True, "False": False}[e.id]
            found = self.resolve_class(mod, e.id)
            if found is None and mod.aliases.get(e.id, e.id) in LEAF_SIGNATURES:
                return LeafType(mod.aliases.get(e.id, e.id))
            return found if found is not None else UNKNOWN
        if isinstance(e, ast.NamedExpr):
            v = ev(e.value)
            env[e.target.id] = v
            return v
        if isinstance(e, ast.Attribute):
            src = ast.unparse(e)
            if src in self.builtins:
                return self.builtins[src]
            owner = ev(e.value)
            if isinstance(owner, Obj):
                return owner.attrs.get(e.attr, UNKNOWN)
            if isinstance(owner, NS):
                return getattr(owner, e.attr)   # AttributeError -> UNKNOWN (HF configs raise too)
            return UNKNOWN
        if isinstance(e, (ast.List, ast.Tuple)):
            return [ev(x) for x in e.elts]
        if isinstance(e, ast.Dict):
            return {ev(k): ev(v) for k, v in zip(e.keys, e.values)}
        if isinstance(e, ast.Subscript):
            return ev(e.value)[ev(e.slice)]
        if isinstance(e, ast.IfExp):
            return ev(e.body) if self.truth(ev(e.test)) else ev(e.orelse)
        if isinstance(e, ast.BoolOp):
            v = None
            for x in e.values:
                v = ev(x)
                if isinstance(e.op, ast.Or) == self.truth(v):
                    return v
            return v
        if isinstance(e, ast.UnaryOp):
            v = ev(e.operand)
            if v is UNKNOWN:
                return UNKNOWN
            return (not v) if isinstance(e.op, ast.Not) else -v if isinstance(e.op, ast.USub) else UNKNOWN
        if isinstance(e, ast.BinOp):
            a, b = ev(e.left), ev(e.right)
            if a is UNKNOWN or b is UNKNOWN:
                return UNKNOWN
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
                   ast.FloorDiv: lambda: a // b, ast.Pow: lambda: a ** b}
            return ops[type(e.op)]() if type(e.op) in ops else UNKNOWN
        if isinstance(e, ast.Compare) and len(e.ops) == 1:
            a, b = ev(e.left), ev(e.comparators[0])
            op = type(e.ops[0])
            if op is ast.Is:
                return UNKNOWN if a is UNKNOWN else a is b
            if op is ast.IsNot:
                return UNKNOWN if a is UNKNOWN else a is not b
            if a is UNKNOWN or b is UNKNOWN:
                return UNKNOWN
            return {ast.Eq: lambda: a == b, ast.NotEq: lambda: a != b, ast.In: lambda: a in b,
                    ast.NotIn: lambda: a not in b, ast.Lt: lambda: a < b, ast.Gt: lambda: a > b,
                    ast.LtE: lambda: a <= b, ast.GtE: lambda: a >= b}[op]()
        if isinstance(e, ast.Call):
            return self._call(e, mod, env, cls)
        return UNKNOWN

    def _call(self, e, mod, env, cls):
        ev = lambda x: self._eval(x, mod, env, cls)   # noqa: E731
        fname = ast.unparse(e.func)
        short = fname.rsplit(".", 1)[-1]
        if fname in self.builtins and callable(self.builtins[fname]):
            return self.builtins[fname]()
        if fname == "getattr":
            owner, name = ev(e.args[0]), ev(e.args[1])
            default = ev(e.args[2]) if len(e.args) > 2 else UNKNOWN
            if isinstance(owner, NS):
                return getattr(owner, name, default)
            if isinstance(owner, Obj):
                return owner.attrs.get(name, default)
            return UNKNOWN
        if fname == "hasattr":
            owner = ev(e.args[0])
            return hasattr(owner, ev(e.args[1])) if isinstance(owner, NS) else UNKNOWN
        if fname in ("bool", "int", "len", "max", "min"):
            vals = [ev(a) for a in e.args]
            if any(v is UNKNOWN for v in vals):
                return UNKNOWN
            return {"bool": bool, "int": int, "len": len, "max": max, "min": min}[fname](*vals)
        if short == "get" and isinstance(e.func, ast.Attribute):
            owner = ev(e.func.value)
            if isinstance(owner, dict):
                return owner.get(ev(e.args[0]), ev(e.args[1]) if len(e.args) > 1 else None)
            return UNKNOWN
        if short == "ModuleList":
            comp = e.args[0]
            if isinstance(comp, ast.ListComp):
                gen = comp.generators[0]
                it = ev(gen.iter)
                out = []
                for i in it:
                    local = dict(env)
                    local[gen.target.id] = i
                    out.append(self._eval(comp.elt, mod, local, cls))
                return out
            return ev(comp)
        if fname == "range":
            n = ev(e.args[0])
            return UNKNOWN if n is UNKNOWN else range(n)
        if short == "Parameter":
            t = ev(e.args[0])
            return ParamSpec(*t) if isinstance(t, tuple) else UNKNOWN
        if fname in ("torch.zeros", "torch.empty", "torch.ones"):
            shape = tuple(ev(a) for a in e.args)
            dtype = next((ast.unparse(k.value) for k in e.keywords if k.arg == "dtype"), "default")
            return (shape, dtype)
        # an argument that cannot be evaluated (a field HF would derive, e.g. rope_parameters) is passed as UNKNOWN
        # rather than losing the whole call: a shape that depends on it still shows as UNKNOWN
        args = [self.eval(a, mod, env, cls) for a in e.args]
        kwargs = {k.arg: self.eval(k.value, mod, env, cls) for k in e.keywords if k.arg}
        if short in LEAF_SIGNATURES:
            return Leaf(short, args, kwargs)
        if isinstance(e.func, ast.Attribute) and ast.unparse(e.func.value) == "self" and isinstance(env.get("self"), Obj) \
                and e.func.attr not in env["self"].attrs and (m := self.find_method(mod, cls, e.func.attr)):
            return self.call_function(m[0], m[1], args, kwargs, cls, env["self"])   # self._build_x(...)
        if isinstance(e.func, ast.Name) and e.func.id not in env and (fn := next(
                (n for n in mod.tree.body if isinstance(n, ast.FunctionDef) and n.name == e.func.id), None)):
            return self.call_function(mod, fn, args, kwargs, cls)                     # a module-level helper
        target = ev(e.func) if isinstance(e.func, (ast.Name, ast.Attribute)) else None
        if isinstance(target, LeafType):
            return Leaf(target.kind, args, kwargs)
        if isinstance(target, tuple) and len(target) == 2 and isinstance(target[1], ast.ClassDef):
            return self.construct(target[0], target[1], args, kwargs)
        return UNKNOWN


def leaf_params(leaf: Leaf) -> dict[str, tuple]:
    """Leaf module -> {param suffix (with shard tag for fused ones): shape}."""
    names = LEAF_SIGNATURES[leaf.kind]
    a = dict(zip(names, leaf.args))
    a.update({k: v for k, v in leaf.kwargs.items() if k in names})
    g = lambda k: a.get(k, UNKNOWN)   # noqa: E731
    if leaf.kind in ("Linear",):
        return {"weight": (g("out_features"), g("in_features"))}
    if leaf.kind in ("ReplicatedLinear", "RowParallelLinear", "ColumnParallelLinear"):
        return {"weight": (g("output_size"), g("input_size"))}
    if leaf.kind == "MergedColumnParallelLinear":
        outs = g("output_sizes")
        return {f"weight#{i}": (o, g("input_size")) for i, o in enumerate(outs)} if isinstance(outs, list) \
            else {"weight#?": (UNKNOWN, g("input_size"))}
    if leaf.kind == "QKVParallelLinear":
        hd, nh, nkv, h = g("head_size"), g("total_num_heads"), g("total_num_kv_heads"), g("hidden_size")
        mul = lambda x, y: UNKNOWN if UNKNOWN in (x, y) else x * y   # noqa: E731
        return {"weight#q": (mul(nh, hd), h), "weight#k": (mul(nkv, hd), h), "weight#v": (mul(nkv, hd), h)}
    if leaf.kind == "RMSNorm":
        return {"weight": (g("hidden_size"),)}
    return {"weight": (g("num_embeddings"), g("embedding_dim"))}


def flatten(obj, prefix="") -> dict[str, tuple]:
    """Obj tree -> {engine param name (#shard): shape or ParamSpec}."""
    out = {}
    items = obj.attrs.items() if isinstance(obj, Obj) else enumerate(obj)
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, Leaf):
            for suffix, shape in leaf_params(v).items():
                out[f"{name}.{suffix}"] = shape
        elif isinstance(v, ParamSpec):
            out[name] = v
        elif isinstance(v, Obj) or (isinstance(v, list) and v and all(isinstance(x, Obj) for x in v)):
            out.update(flatten(v, name + "."))
    return out


# --- literal extraction ----------------------------------------------------------------------------
def find_function(mod: Module, cls: str, name: str) -> ast.FunctionDef:
    return next(n for n in mod.classes[cls].body if isinstance(n, ast.FunctionDef) and n.name == name)


def assigned_literal(fn: ast.AST, var: str):
    """The literal value assigned to local `var` (dict/list/tuple of constants) inside fn."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == var for t in n.targets):
            return ast.literal_eval(n.value)
    raise LookupError(var)


def substring_branches(fn: ast.AST, var: str = "name") -> dict[str, str]:
    """`if "X" in name:` branches in fn -> {"X": "skip" if the body only continues, else "handled"}."""
    out = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and isinstance(n.test.ops[0], ast.In) \
                and isinstance(n.test.left, ast.Constant) and ast.unparse(n.test.comparators[0]) == var:
            body = [s for s in n.body if not isinstance(s, ast.Expr)]
            out[n.test.left.value] = "skip" if len(body) == 1 and isinstance(body[0], ast.Continue) else "handled"
    return out


def replace_calls(fn: ast.AST) -> dict[str, str]:
    """Literal `name.replace("a", "b")` calls in fn -> {"a": "b"}."""
    out = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "replace" \
                and all(isinstance(a, ast.Constant) for a in n.args) and len(n.args) == 2:
            out[n.args[0].value] = n.args[1].value
    return out


def config_fields_read(tree: ast.AST, config_names=("config", "self.config", "hf_config")) -> set[str]:
    """Fields read from an HF config: `config.X`, getattr(config, "X"...), hasattr(config, "X")."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and ast.unparse(n.value) in config_names:
            out.add(n.attr)
        elif isinstance(n, ast.Call) and ast.unparse(n.func) in ("getattr", "hasattr") and len(n.args) >= 2 \
                and ast.unparse(n.args[0]) in config_names and isinstance(n.args[1], ast.Constant):
            out.add(n.args[1].value)
    return out


def dict_keys_read(tree: ast.AST, dict_name: str) -> set[str]:
    """Keys read from a dict variable: d.get("k"), d["k"], "k" in d."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" \
                and ast.unparse(n.func.value) == dict_name and n.args and isinstance(n.args[0], ast.Constant):
            out.add(n.args[0].value)
        elif isinstance(n, ast.Subscript) and ast.unparse(n.value) == dict_name and isinstance(n.slice, ast.Constant):
            out.add(n.slice.value)
        elif isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and isinstance(n.ops[0], ast.In) \
                and ast.unparse(n.comparators[0]) == dict_name:
            out.add(n.left.value)
    return out
