"""A target opened without building its model: the text config, the tokenizer, and the three head tensors.

Every stage but the target's forward (prepare without local regeneration, offline training, export, engine
capture) needs only these. The embedding, the final norm and the LM head are found by name in the safetensors
weight map (`model.safetensors.index.json`, or the header of a single `model.safetensors`), checked from the
shards' headers when the target is opened (present, shard there, a bf16/fp16/fp32 tensor), and read from their
shard only when a stage touches `.weight`. So a directory holding only config, tokenizer, index and the head's
shard(s) opens like the full checkpoint, with the same fingerprint (target/fingerprint.py `head_identity`).

The config is the TEXT config (a wrapper's `text_config`): transformers' own config class when it knows the model
type (what `load_target` sees), else an attribute view of the JSON. No code from the checkpoint runs unless
trust_remote_code=True, and a target that needs it is refused without.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.target.fingerprint import fingerprint, head_identity, text_config, weights_identity
from eyas.target.layers import resolve_aux_layer_ids
from eyas.target.resolve import EMBEDDED, embedded_path, eos_ids, gguf_special_tokens, resolve

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Names of the head tensors, most common first: plain causal LMs, then VLM wrappers (Kimi-K2.5, Llava, Qwen-VL).
NAMES = {
    "embed": ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
              "model.language_model.embed_tokens.weight", "language_model.embed_tokens.weight"),
    "lm_head": ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight"),
    "norm": ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight",
             "language_model.norm.weight"),
}
# Where a multimodal checkpoint names its remote-code processor (auto_map.AutoProcessor).
PROCESSOR_CONFIGS = ("processor_config.json", "preprocessor_config.json")
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Tensors that sit beside a quantized weight (GPTQ/AWQ, fp8 block scales, compressed-tensors packing).
QUANT_COMPANIONS = ("weight_scale", "weight_scale_inv", "weight_packed", "weight_shape", "weight_zero_point",
                    "input_scale", "qweight", "qzeros", "scales", "g_idx")


class JsonConfig:
    """An attribute view of a config.json dict (a model type transformers does not know); missing keys raise
    AttributeError, so getattr(cfg, k, None) reads like on a transformers config."""

    def __init__(self, d: dict):
        self.__dict__.update(d)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def read_json(path: Path, absent: str | None = None) -> dict:
    """The JSON object in the file `path`, refused in one line that names it: unreadable, not JSON, not an object,
    or (`absent`: what to say then, e.g. which directory was expected) not there."""
    if absent is not None and not path.exists():
        raise EyasError(f"{path}: {absent}")
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise EyasError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise EyasError(f"{path}: expected a JSON object, got a JSON {type(d).__name__}")
    return d


def read_config(path) -> tuple[dict, dict]:
    """A target's config.json as a dict (read_json), and its language model's fields (`text_config`: a multimodal
    wrapper's inner config, else the same dict)."""
    cfg = read_json(Path(path))
    return cfg, text_config(cfg)


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor name -> {"dtype", "shape", "data_offsets"}, byte offset of the data) from a file's header only."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise EyasError(f"{path}: no such file") from None
    except (OSError, ValueError, struct.error) as e:
        raise EyasError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def weight_map(d: Path) -> tuple[dict[str, str], Path] | None:
    """(tensor name -> shard file name, the file that says so) of a directory, or None without safetensors."""
    if (d / INDEX).exists():
        wm = read_json(d / INDEX).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise EyasError(f"{d / INDEX}: no weight_map")
        return {str(k): str(v) for k, v in wm.items()}, d / INDEX
    if (d / SINGLE).exists():
        return {k: SINGLE for k in safetensors_header(d / SINGLE)[0]}, d / SINGLE
    return None


def weights_bytes(d: Path, dtype: torch.dtype) -> int | None:
    """Bytes the weights of directory `d` take once loaded with 16/32/64-bit floats in `dtype`, from the safetensors
    headers alone (fp8 and integer tensors at their stored size: a lower bound). A directory lacking shards its
    weight map names (a weightless copy) gives the index's `total_size`; None without safetensors or a total."""
    found = weight_map(d)
    if found is None:
        return None
    wm, _ = found
    files = sorted(set(wm.values()))
    present = [f for f in files if (d / f).exists()]
    if len(present) < len(files):  # a weightless copy: only the index says how large the whole is
        total = (read_json(d / INDEX).get("metadata") or {}).get("total_size") if (d / INDEX).exists() else None
        return int(total) if isinstance(total, (int, float)) else None
    size, to = 0, torch.empty((), dtype=dtype).element_size()
    for f in present:
        for t in safetensors_header(d / f)[0].values():
            if t["dtype"] in ("F64", "F32", "F16", "BF16"):   # loaded as `dtype`
                size += math.prod(t["shape"]) * to
            else:                                             # fp8, packed integers: at least their stored size
                size += t["data_offsets"][1] - t["data_offsets"][0]
    return size


def find_name(wm: dict[str, str], kind: str, where: Path | str = "the weight map") -> str | None:
    """The weight-map name of a head tensor: a known name, else the one name ending in `.<known name>` outside
    the decoder layers (MTP layers and vision towers have their own norms and heads); None when there is none.
    Several such names are refused (`where` names the file in the error): which one is the language model's cannot
    be told from the names, and taking none would read a missing LM head as a tied one."""
    for name in NAMES[kind]:
        if name in wm:
            return name
    hits = sorted({k for k in wm for n in NAMES[kind] if k.endswith("." + n)
                   and ".layers." not in k and not k.startswith(("vision", "mm_projector", "multi_modal"))})
    if len(hits) > 1:
        raise EyasError(f"{where}: {len(hits)} tensors could be the {kind} ({', '.join(hits)}); eyas finds the "
                        f"embedding, final norm and LM head by name and cannot tell which is the language model's")
    return hits[0] if hits else None


def needs_remote_code(d: Path, raw: dict, *, engine: bool = False) -> list[str]:
    """Why a directory's config or tokenizer would run its own code (empty: it would not); `raw` is its config.json.

    engine=False, in this process: transformers runs a config's auto_map.AutoConfig only for a model type it lacks
    (a DeepSeek-V3 config.json maps its own class yet opens without code here), a tokenizer's auto_map always.
    engine=True, in a serving engine (`eyas engine launch-args`), whose transformers may be older than this one:
    any auto_map, and any model type (the wrapper's or its text_config's) this transformers lacks, counts; so does a
    processor's auto_map (processor_config.json, preprocessor_config.json), which SGLang loads through AutoProcessor
    at start-up for a multimodal architecture (Kimi-K2.5)."""
    from transformers import CONFIG_MAPPING

    auto = raw.get("auto_map") or {}
    tok_cfg = read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").exists() else {}
    if engine:
        types = sorted({raw.get("model_type"), text_config(raw).get("model_type")} - {None})
        procs = [f for f in PROCESSOR_CONFIGS if (d / f).exists() and read_json(d / f).get("auto_map")]
        return ((["config.json has an auto_map"] if auto else [])
                + [f"transformers has no model_type {mt!r}" for mt in types if mt not in CONFIG_MAPPING]
                + (["tokenizer_config.json has an auto_map"] if tok_cfg.get("auto_map") else [])
                + [f"{f} has an auto_map" for f in procs])
    why = []
    if "AutoConfig" in auto and raw.get("model_type") not in CONFIG_MAPPING:
        why.append(f"config.json auto_map.AutoConfig {auto['AutoConfig']!r}")
    for where, m in (("tokenizer_config.json", tok_cfg.get("auto_map") or {}), ("config.json", auto)):
        if isinstance(m, dict) and "AutoTokenizer" in m:
            why.append(f"{where} auto_map.AutoTokenizer {m['AutoTokenizer']!r}")
        elif isinstance(m, (list, tuple)) and m:   # old tokenizer_config spelling: [slow, fast]
            why.append(f"{where} auto_map {list(m)!r}")
    why += [p.name for p in sorted(d.glob("tokenization_*.py"))]
    return why


def open_text_config(d: Path, raw: dict):
    """The text config: transformers' class when it knows the (wrapper's or text) model type, else a JSON view."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if raw.get("model_type") in CONFIG_MAPPING:
        cfg = AutoConfig.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
        text = text_config(cfg)
        if not getattr(text, "architectures", None):
            text.architectures = raw.get("architectures")   # the wrapper's: SGLang's layer-id convention reads it
        return text
    text = dict(text_config(raw))
    if text.get("model_type") in CONFIG_MAPPING:
        return CONFIG_MAPPING[text["model_type"]].from_dict(text)
    if "architectures" not in text and "architectures" in raw:
        text["architectures"] = raw["architectures"]
    return JsonConfig(text)


def check_unquantized(where: Path, wm: dict, name: str, dtype: str, raw: dict) -> None:
    """Refuse a quantized head tensor: eyas reads the embedding, LM head and final norm as plain floats."""
    prefix = name.rsplit(".", 1)[0]
    companions = sorted(k for k in wm if k.rsplit(".", 1)[0] == prefix and k.rsplit(".", 1)[-1] in QUANT_COMPANIONS)
    if dtype in FLOAT_DTYPES and not companions:
        return
    q = raw.get("quantization_config") or text_config(raw).get("quantization_config") or {}
    method = f" (quantization_config: {q.get('quant_method') or q.get('format') or 'set'})" if q else ""
    what = f"dtype {dtype}" + (f" with {', '.join(companions)}" if companions else "")
    raise EyasError(f"{where}: {name} is quantized ({what}){method}; eyas needs the embedding, LM head and final "
                    f"norm in bf16, fp16 or fp32 (the rest of the checkpoint may be quantized)")


class HeadTensor:
    """A module stand-in whose `.weight` is read from its shard on first use (then kept)."""

    def __init__(self, read):
        self._read, self._weight = read, None

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is None:
            self._weight = self._read()
        return self._weight


class TargetMeta:
    """What the stages that do not run the target's forward read of a Target (target/load.py), with `.model`
    None. Build it with open_target_meta."""

    model = None

    def __init__(self, *, name, directory: Path, config, tokenizer, aux_layer_ids, fingerprint, heads: dict,
                 tied: bool, generation_eos, dtype: torch.dtype | None):
        self.name, self.directory, self.config, self.tokenizer = name, directory, config, tokenizer
        self.aux_layer_ids, self.fingerprint, self.heads, self._tied = aux_layer_ids, fingerprint, heads, tied
        self._generation_eos, self._dtype = generation_eos, dtype
        self.embed_tokens = HeadTensor(lambda: self._read("embed"))
        self.final_norm = HeadTensor(lambda: self._read("norm"))
        self.lm_head = self.embed_tokens if tied else HeadTensor(lambda: self._read("lm_head"))

    def _read(self, kind: str) -> torch.Tensor:
        h = self.heads.get(kind)
        if h is None:
            raise EyasError(f"target {self.name}: its {kind} tensor was not opened (a stage asked for more than "
                            f"open_target_meta's tensors=)")
        w = read_tensor(h)
        return w if self._dtype is None else w.to(self._dtype)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.heads["embed"]["shape"][0])

    @property
    def tie_word_embeddings(self) -> bool:
        return self._tied

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype or FLOAT_DTYPES.get(self.heads["embed"]["dtype"], torch.float32)

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_ids([self._generation_eos, getattr(self.config, "eos_token_id", None)], self.tokenizer)


def _locate(d: Path, wm: dict[str, str], wm_file: Path, name: str, headers: dict) -> dict:
    """{"name", "path", "start", "end", "dtype", "shape"} of one tensor, from its shard's header."""
    shard = d / wm[name]
    if not shard.exists():
        raise EyasError(f"{wm_file}: {name} is in {wm[name]}, which is missing from {d}")
    if shard not in headers:
        headers[shard] = safetensors_header(shard)
    header, base = headers[shard]
    if name not in header:
        raise EyasError(f"{shard}: lacks {name}, which {wm_file.name} places there")
    t = header[name]
    start, end = t["data_offsets"]
    return {"name": name, "path": shard, "start": base + start, "end": base + end, "dtype": t["dtype"],
            "shape": tuple(t["shape"])}


def _heads(d: Path, wm: dict[str, str], wm_file: Path, raw: dict, tied: bool, check: tuple[str, ...]) -> dict:
    """kind -> _locate's dict for the head tensors a stage may read; quantized ones among `check` refused."""
    out, headers = {}, {}
    for kind in ("embed", "norm") if tied else ("embed", "norm", "lm_head"):
        name = find_name(wm, kind, wm_file)
        if name is None:
            for n in NAMES[kind]:   # e.g. lm_head.qweight without lm_head.weight
                if any(k.startswith(n.rsplit(".", 1)[0] + ".") for k in wm):
                    check_unquantized(wm_file, wm, n, "none", raw)
            raise EyasError(f"{wm_file}: no {kind} tensor ({' / '.join(NAMES[kind])}); eyas needs the embedding, "
                            f"final norm{'' if tied else ' and LM head'} of the target")
        out[kind] = _locate(d, wm, wm_file, name, headers)
        if kind in check:
            check_unquantized(wm_file, wm, name, out[kind]["dtype"], raw)
    return out


def read_tensor(loc: dict) -> torch.Tensor:
    """One tensor by name from its shard alone ({"name", "path"}, as _locate gives), memory-mapped."""
    from safetensors import safe_open

    with safe_open(str(loc["path"]), framework="pt") as f:
        return f.get_tensor(loc["name"])


def open_heads(d: Path, raw: dict | None = None, *, check: tuple[str, ...] = ()) -> tuple[object, dict, bool]:
    """(text config, kind -> _locate's dict, tied) of a directory's embedding, final norm and (untied) LM head:
    found by name through the weight map and checked from the shards' headers, none read; `check`: the kinds
    refused when quantized. No tokenizer and no code from the checkpoint (open_target_meta and the served check,
    engines/served_check.py, both locate the head here). `raw`: config.json when the caller has read it."""
    raw = read_json(d / "config.json") if raw is None else raw
    try:
        config = open_text_config(d, raw)
    except (OSError, ValueError, TypeError) as e:
        raise EyasError(f"{d / 'config.json'}: {e}") from None
    found = weight_map(d)
    if found is None:
        raise EyasError(f"{d}: no {INDEX} or {SINGLE}; eyas reads the head tensors from safetensors")
    wm, wm_file = found
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None or isinstance(config, JsonConfig) and "tie_word_embeddings" not in config.__dict__:
        tied = find_name(wm, "lm_head", wm_file) is None   # the raw JSON does not say: a missing head is tied
    return config, _heads(d, wm, wm_file, raw, bool(tied), tuple(check)), bool(tied)


def head_weights(d: Path) -> dict | None:
    """The fingerprint's weights of a safetensors directory (fingerprint.head_identity): its weight map and the
    bytes of the head tensors it holds; None when it has no weight map or no embedding/final norm found by name."""
    found = weight_map(d)
    if found is None:
        return None
    wm, wm_file = found
    names = {}
    for kind in NAMES:
        try:
            names[kind] = find_name(wm, kind)
        except EyasError:       # several candidates: the identity goes without that tensor (the weight map holds it)
            names[kind] = None
    if names["embed"] is None or names["norm"] is None:
        return None
    headers: dict = {}
    return head_identity(wm, {n: _locate(d, wm, wm_file, n, headers) for n in names.values() if n is not None})


def weights_of(spec: str) -> dict | None:
    """The content hash of a target's weights for its fingerprint: the GGUF file (embedded or given); for a
    directory its weight map and head tensors (target/meta.py head_weights: never every weight), else its
    *.safetensors files; None for a hub id or weights too large to hash cheaply."""
    p = Path(spec).expanduser()
    if spec in EMBEDDED or p.is_file():
        return weights_identity([embedded_path(spec) if spec in EMBEDDED else p], "gguf")
    if p.is_dir():
        return head_weights(p) or weights_identity(list(p.glob("*.safetensors")), "safetensors")
    return None


def local_dir(spec: str) -> tuple[Path, str]:
    """(directory, identity) of a target spec: a directory, the cached safetensors of a GGUF / embedded default
    (load.gguf_to_cache), or a hub id's snapshot in the local HF cache."""
    src, identity = resolve(spec)
    if isinstance(src, Path):
        return src, identity
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(src, local_files_only=True)), identity
    except Exception as e:  # noqa: BLE001 (the hub raises several types for "not cached")
        raise EyasError(f"target {spec!r}: not in the local HF cache ({type(e).__name__}); eyas never downloads; "
                        f"pass a directory") from None


def open_target_meta(spec: str, *, aux_layer_ids=None, trust_remote_code: bool = False,
                     tensors: tuple[str, ...] = ("embed", "lm_head", "norm"), dtype: torch.dtype | None = None
                     ) -> TargetMeta:
    """Open a target for the stages that do not run its forward. `tensors`: the head tensors the caller will read
    (checked to be plain bf16/fp16/fp32); all three are still located and hashed for the fingerprint. `dtype`:
    convert them on read (None: as stored)."""
    d, identity = local_dir(spec)
    raw = read_json(d / "config.json")
    if (why := needs_remote_code(d, raw)) and not trust_remote_code:
        raise EyasError(f"target {spec!r} needs its own code ({'; '.join(why)}); rerun with --trust-remote-code "
                        f"if you trust it")
    config, heads, tied = open_heads(d, raw, check=tuple(tensors))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        tok = None
    weights = weights_of(spec)
    if tok is not None and (weights or {}).get("format") == "gguf":
        gguf_special_tokens(tok, config)
    gen = read_json(d / "generation_config.json").get("eos_token_id") if (d / "generation_config.json").exists() \
        else None
    ids = resolve_aux_layer_ids(aux_layer_ids, int(config.num_hidden_layers))
    fp = fingerprint(config, tok, identity=identity, weights=weights)
    return TargetMeta(name=identity, directory=d, config=config, tokenizer=tok, aux_layer_ids=ids, fingerprint=fp,
                      heads=heads, tied=tied, generation_eos=gen, dtype=dtype)
