"""Check an engine-captured store against the served target, with only its embedding, LM head and final norm.

`eyas engine crosscheck` compares with an in-process forward, which no one can run for a 1T target. This check
needs the server and three tensors (read by name from the safetensors index, so a weightless target directory
with the head shards is enough):

  final slot  (any engine)
    post-norm   y = x / rms(x) * w gives rms(y / w) == 1 per token; a pre-norm slot (vLLM's last slot before
                eyas's ingest applies the norm, or a hook in the wrong place) does not.
    greedy      at a few cut points c of each stored sample, the server's own greedy next token for ids[:c+1]
                must be argmax(lm_head(final[c])) (within a bf16 tie margin): the stored state is the one the
                engine's logits come from.
  aux slots   (SGLang, the probe)
    A probe request (rid `eyas-probe-<layers>-<n>`) re-sends a stored sample's first tokens. In a forward whose
    batch holds nothing but probe requests, a pre-hook on the inner model switches `layers_to_capture` to the
    layers named in the rid (SGLang loop indices, no HF->SGLang mapping) and the post-hook puts the list it
    replaced back (the same object); the capture hook writes what it got to STORE/probe/ (never to the store).
    A probe batched with other requests is reported and resent. The switch is installed by launch-args' hook on
    the inner model: eyas_enable_aux before SGLang 0.5.23, eyas_probe_switch from 0.5.23 (the server sets the
    layers itself; aux states of any count arrive packed (N, K*h) or as a list, both unpacked to (N, K, h)).
    anchor      probe layer 0 must be the embedding of the ids: loop index i is then "the stream entering layer i"
                = HF id i. A capture placed after the layer (the seed's own bug) fails here, whatever ids it got.
    neighbours  stored slot k with declared HF id i must match probe layer i within tol, closer than layers
                i - 1 and i + 1; a closer neighbour is named: the store is one layer off.
    Layer 0 is probed only on DeepSeek-family models (deepseek_v2.py captures the residual after its first
    norm's add, which is the embedding at layer 0); SGLang's llama.py adds `hidden_states + residual` with
    residual None there and would crash, so other models get no anchor.
vLLM's extract_hidden_states fixes its layers at launch: there is no per-request switch, so its aux slots
are not probed (use crosscheck where the target fits in process).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eyas.engines.launch_args import VLLM_SERVED_NAME
from eyas.errors import EyasError
from eyas.manifest import atomic_write_bytes
from eyas.serving import greedy_request, post_json, reply_ids  # light: no httpx until a request
from eyas.store.reader import Store
from eyas.target.fingerprint import text_config
from eyas.target.layers import is_deepseek
from eyas.target.meta import open_heads, read_json, read_tensor

PROBE_RID = "eyas-probe-"
CHECK_RID = "eyas-check-"
PROBE_DIR = "probe"
CHECK_FILE = "check.json"
# Inner-model classes whose layer loop can capture layer 0 (the embedding output): see the module docstring.
LAYER0_MODULES = ("DeepseekV2Model",)
NO_SWITCH = "the inner model has no eyas probe switch"
SWITCH_HOOKS = ("the inner-model hook of `eyas engine launch-args` installs it: eyas_enable_aux before SGLang "
                "0.5.23, eyas_probe_switch from 0.5.23")


class ProbeUnavailable(EyasError):
    """The server cannot probe (no probe switch): the aux slots are reported unchecked, not failed."""


# ---------------------------------------------------------------- server side (inside SGLang) ----

def probe_rid(layers, n: int | str) -> str:
    return f"{PROBE_RID}{'.'.join(str(int(i)) for i in layers)}-{n}"


def probe_layers(rid: str) -> list[int] | None:
    """The layers a probe rid asks for (sorted: SGLang's loop appends in layer order), None if not a probe."""
    m = re.match(re.escape(PROBE_RID) + r"(\d+(?:\.\d+)*)-", rid or "")
    return sorted({int(x) for x in m[1].split(".")}) if m else None


# What the probe switch did in the current forward, handed to the capture hook (one forward at a time):
# [layers] when it switched, [str] when it refused, [] when the batch was not a probe batch.
_ACTIVE: list = []


def find_forward_batch(args, kwargs):
    for a in (*args, *kwargs.values()):
        if hasattr(a, "rids") and hasattr(a, "forward_mode"):
            return a
    return None


class ProbeSwitch:
    """Forward pre-hook + hook on the inner model that owns `layers_to_capture` (installed by the aux enable
    or probe switch hook at its first call: hook_manager registers forward hooks only). The hook that puts the
    server's list back runs even when the forward raises (always_call: torch's try/finally around the forward);
    where torch skips it (a compiled forward, an exception that is not an Exception) the next pre-hook does it."""

    def __init__(self, module):
        self.saved = None
        self.layer0_ok = any(c.__name__ in LAYER0_MODULES for c in type(module).__mro__)

    def pre(self, module, args, kwargs):
        self.post(module, args, None)                     # a forward whose restore torch skipped left it on
        _ACTIVE.clear()
        fb = find_forward_batch(args, kwargs)
        rids = list(getattr(fb, "rids", None) or [])
        wants = [probe_layers(r) for r in rids]
        if not rids or any(w is None for w in wants):
            return None                                   # no probe, or a probe batched with other requests
        if any(w != wants[0] for w in wants):
            _ACTIVE.append("probe requests asking different layers in one batch")
        elif 0 in wants[0] and not self.layer0_ok:
            _ACTIVE.append(f"{type(module).__name__} cannot capture layer 0 (only {', '.join(LAYER0_MODULES)})")
        elif not wants[0]:
            _ACTIVE.append("a probe asking no layers")
        elif wants[0][-1] >= len(getattr(module, "layers", range(wants[0][-1] + 1))):
            _ACTIVE.append(f"layer {wants[0][-1]} is past the model's {len(module.layers)} layers (a model that "
                           f"captures nothing would break the server's (hidden, aux) unpack)")
        else:
            self.saved = module.layers_to_capture         # the object itself: restored untouched
            module.layers_to_capture = list(wants[0])
            _ACTIVE.append(wants[0])
        return None

    def post(self, module, args, output):
        if self.saved is not None:
            module.layers_to_capture, self.saved = self.saved, None
        return None


def install_probe_switch(module) -> ProbeSwitch | None:
    if not hasattr(module, "register_forward_pre_hook"):
        return None                                       # not a torch module (no SGLang model is one)
    sw = ProbeSwitch(module)
    module.register_forward_pre_hook(sw.pre, with_kwargs=True)
    module.register_forward_hook(sw.post, always_call=True)     # restore after a forward that raised too
    return sw


def record_probe(store, rids, ext, pre, ids, aux) -> bool:
    """Capture hook side: write each probe request of this batch to STORE/probe/<rid>.pt (ids, layers, states
    (T, K, h)) or <rid>.json (why not). True when every request was a probe (the batch is then not captured)."""
    probes = [r for r in rids if probe_layers(r) is not None]
    if not probes:
        return False
    d = Path(store) / PROBE_DIR
    d.mkdir(parents=True, exist_ok=True)
    act = _ACTIVE[0] if _ACTIVE else None
    _ACTIVE.clear()
    why = ""
    if len(probes) < len(rids):
        why = "batched with other requests (the layers were not switched)"
    elif act is None:
        why = f"{NO_SWITCH} ({SWITCH_HOOKS})"
    elif isinstance(act, str):
        why = act
    elif ids is None or aux is None or ext is None or aux.shape[1] != len(act):
        why = f"no ids or aux states for the {len(act)} probed layers reached the capture hook"
    elif pre and any(pre):
        why = "prefix not recomputed (radix cache on?)"
    start = 0
    for r, n in zip(rids, ext or [0] * len(rids)):
        sl = slice(start, start + n)
        start += n
        if r not in probes:
            continue
        tmp = d / f".{r}.tmp"
        if why:
            tmp.write_text(json.dumps({"rid": r, "error": why}))
            tmp.replace(d / f"{r}.json")
        else:
            torch.save({"ids": ids[sl].cpu().long(), "layers": list(act), "states": aux[sl].cpu()}, tmp)
            tmp.replace(d / f"{r}.pt")
    return len(probes) == len(rids)


# ---------------------------------------------------------------- the target's head tensors ----

@dataclass(frozen=True)
class Head:
    """What the check reads of the target: three tensors and a few config fields."""
    embed: torch.Tensor      # (V, h) as stored
    lm_head: torch.Tensor    # (V, h) as stored (the embedding when tied)
    norm: torch.Tensor       # (h,)
    num_layers: int
    architecture: str
    model_type: str


def locate_head(target) -> tuple[dict, dict, dict]:
    """(config.json, its text config, kind -> {"name", "path", ...}) of a target directory, checked without
    reading a tensor: the head tensors found by name as every stage finds them (target/meta.py open_heads; no
    tokenizer, no code from the checkpoint), each in a shard that is there."""
    d = Path(target)
    raw = read_json(d / "config.json")
    _, where, _ = open_heads(d, raw)
    return raw, text_config(raw), where


def load_head(target) -> Head:
    """The embedding, LM head and final norm of a target directory (config.json, safetensors index or single
    file; a weightless copy holding only the head shards works), read by name without loading the rest."""
    raw, text, where = locate_head(target)
    out = {kind: read_tensor(loc) for kind, loc in where.items()}
    arch = (raw.get("architectures") or text.get("architectures") or ["?"])[0]
    return Head(out["embed"], out.get("lm_head", out["embed"]), out["norm"], int(text["num_hidden_layers"]), arch,
                str(text.get("model_type") or raw.get("model_type") or ""))


def logits(w: torch.Tensor, x: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """(V, h) weight, (P, h) states -> (P, V) float32, a vocabulary chunk at a time (the head stays as stored)."""
    x = x.float()
    return torch.cat([x @ w[i:i + chunk].float().T for i in range(0, w.shape[0], chunk)], dim=1)   # (P, V)


# ---------------------------------------------------------------- the checks ----

@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    engine: str                 # "sglang" or "vllm"
    url: str                    # server base URL
    store: str                  # the engine-captured store (SGLang: the hook's --store, probes land in it)
    target: str                 # target directory: config.json + the safetensors holding embed / lm_head / norm
    n: int = 4                  # stored samples checked
    cuts: int = 4               # greedy cut points per sample
    probe_tokens: int = 256     # probe at most this many leading tokens of a sample
    tol: float = 0.02           # largest relative error counted as the same state (bf16 engine)
    norm_tol: float = 0.05      # largest |rms(y / w) - 1| of a post-norm token (95th percentile)
    min_agree: float = 0.9      # smallest share of greedy cut points that must agree
    tie: float = 0.01           # a disagreement within tie * (max - mean logit) counts as a bf16 tie
    timeout_s: float = 120.0    # per request
    retries: int = 3            # probe resends (batched with other requests, transport errors)
    wait_s: float = 10.0        # how long a probe's file may take to appear
    vllm_dir: str = ""          # vLLM's shared_storage_path: the check's own requests' files are removed from it

    def __post_init__(self):
        if self.engine not in ("sglang", "vllm"):
            raise EyasError(f"engine {self.engine!r}: expected sglang or vllm")
        if self.n < 1 or self.cuts < 1 or self.probe_tokens < 2 or self.retries < 0:
            raise EyasError("check: n >= 1, cuts >= 1, probe_tokens >= 2 and retries >= 0 are required")


def norm_signature(final: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(T, h) stored final states -> (T,) rms(y / w): 1 for a post-norm state y = x / rms(x) * w."""
    keep = w.float().abs() > 0                                          # (h,) a zero weight says nothing
    z = final.float()[:, keep] / w.float()[keep]                        # (T, h')
    return z.square().mean(-1).sqrt()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def compare_slots(probe: list[dict], stored: list, aux_ids, *, tol: float) -> list[dict]:
    """Each stored aux slot against probe layers i-1, i, i+1 (rows like crosscheck's, plus 'matches')."""
    rows = []
    for k, i in enumerate(aux_ids):
        def err(j):
            pairs = [(s.aux[: p["ids"].shape[0], k], p["states"][:, p["layers"].index(j)])
                     for p, s in zip(probe, stored) if j in p["layers"]]
            if not pairs:
                return None
            num = sum(float((a.float() - b.float()).square().sum()) for a, b in pairs)
            den = sum(float(b.float().square().sum()) for _, b in pairs)
            return (num / max(den, 1e-30)) ** 0.5
        e = err(i)
        near = {j: v for j in (i - 1, i + 1) if (v := err(j)) is not None}
        best = min(near, key=near.get, default=None)
        ok = e is not None and e <= tol and all(e < v for v in near.values())
        matches = best if not ok and best is not None and (e is None or near[best] < e) else None
        rows.append({"check": f"aux slot {k} (HF id {i})", "value": "no probe of this layer" if e is None else
                     f"rel {e:.2e}; " + ", ".join(f"layer {j}: {v:.2e}" for j, v in near.items()),
                     "ok": ok, "why": "" if ok else (
                         f"matches layer {matches} better: the store is one layer off" if matches is not None
                         else f"not within {tol:g} of layer {i}")})
    return rows


class Server:
    """The check's requests: greedy next tokens and probes (serving.greedy_request), through
    `post(url, body, timeout) -> json` (serving.post_json, or a fake server in tests)."""

    def __init__(self, cfg: CheckConfig, post):
        self.cfg, self.post, self.n = cfg, post, 0

    def _rid(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{uuid.uuid4().hex[:8]}-{self.n}"

    def next_token(self, ids: list[int]) -> int:
        rid = self._rid(CHECK_RID)
        path, body = greedy_request(self.cfg.engine, ids, 1, model=VLLM_SERVED_NAME, rid=rid, token_ids=True)
        r = self.post(self.cfg.url.rstrip("/") + path, body, self.cfg.timeout_s)
        out = reply_ids(self.cfg.engine, r)
        if self.cfg.engine == "vllm" and self.cfg.vllm_dir:   # extract_hidden_states dumped this request too
            for p in Path(self.cfg.vllm_dir).glob(f"*{rid}*.safetensors"):
                p.unlink(missing_ok=True)
        if not out:
            raise EyasError(f"{self.cfg.url}: the reply to a greedy request carries no output token ids "
                            f"(SGLang: output_ids; vLLM: choices[0].token_ids from return_token_ids): {str(r)[:200]}")
        return int(out[0])

    def probe(self, ids: list[int], layers) -> dict:
        """Send one probe (resent when batched with other requests) -> {ids, layers, states} from STORE/probe."""
        d = Path(self.cfg.store) / PROBE_DIR
        last = ""
        for _ in range(self.cfg.retries + 1):
            rid = probe_rid(layers, self._rid(""))
            path, body = greedy_request("sglang", ids, 1, rid=rid)
            try:
                self.post(self.cfg.url.rstrip("/") + path, body, self.cfg.timeout_s)
            except Exception as e:  # noqa: BLE001 - resent
                last = f"{type(e).__name__}: {e}"
                continue
            deadline = time.monotonic() + self.cfg.wait_s
            while not (d / f"{rid}.pt").exists() and not (d / f"{rid}.json").exists():
                if time.monotonic() > deadline:
                    raise EyasError(f"{self.cfg.url} answered probe {rid} but nothing reached {d} within "
                                    f"{self.cfg.wait_s:g} s: is the server's capture hook writing to "
                                    f"{self.cfg.store} (its --forward-hooks store)?")
                time.sleep(0.02)
            if (d / f"{rid}.pt").exists():
                return torch.load(d / f"{rid}.pt", weights_only=True)
            last = json.loads((d / f"{rid}.json").read_text())["error"]
            if last.startswith(NO_SWITCH):
                raise ProbeUnavailable(last)
            if not last.startswith("batched"):
                break
        raise EyasError(f"{self.cfg.url}: the aux probe failed: {last}")


def final_rows(cfg: CheckConfig, head: Head, samples, server: Server) -> list[dict]:
    """The post-norm signature and the greedy agreement of the stored final states."""
    r = torch.cat([norm_signature(s.final, head.norm) for s in samples])          # (sum T,)
    dev = (r - 1).abs()
    p95 = float(dev.quantile(0.95))
    rows = [{"check": "final slot post-norm", "value": f"rms(y/w) median {float(r.median()):.4f}, p95 |r-1| "
             f"{p95:.3e}", "ok": p95 <= cfg.norm_tol,
             "why": "" if p95 <= cfg.norm_tol else "the final slot is not a final-norm output (pre-norm?)"}]
    agree = tied = total = 0
    for s in samples:
        t = s.input_ids.shape[0]
        cuts = sorted({round(x) for x in torch.linspace(0, t - 1, min(cfg.cuts, t)).tolist()})
        lg = logits(head.lm_head, s.final[cuts])                                   # (C, V)
        for c, row in zip(cuts, lg):
            tok = server.next_token(s.input_ids[: c + 1].tolist())
            total += 1
            if tok == int(row.argmax()):
                agree += 1
            elif float(row.max() - row[tok]) <= cfg.tie * float(row.max() - row.mean()):
                tied += 1
    rate = (agree + tied) / total
    rows.append({"check": "final slot greedy", "value": f"{agree}/{total} argmax, {tied} within the tie margin "
                 f"({rate:.1%})", "ok": rate >= cfg.min_agree,
                 "why": "" if rate >= cfg.min_agree else
                 "lm_head(final) does not give the engine's own greedy tokens"})
    return rows


def probe_rows(cfg: CheckConfig, head: Head, samples, aux_ids, server: Server) -> list[dict]:
    anchor = is_deepseek(head.architecture, head.model_type)
    lo = 0 if anchor else 1
    layers = sorted(({0} if anchor else set()) | {j for i in aux_ids for j in (i - 1, i, i + 1)
                                                    if lo <= j < head.num_layers})
    try:
        probe = [server.probe(s.input_ids[: cfg.probe_tokens].tolist(), layers) for s in samples]
    except ProbeUnavailable as e:
        return [{"check": "aux slots", "value": "not probed", "ok": None, "why": str(e)}]
    except EyasError as e:
        return [{"check": "aux probe", "value": "failed", "ok": False, "why": str(e)}]
    for p, s in zip(probe, samples):
        if not torch.equal(p["ids"], s.input_ids[: p["ids"].shape[0]].long()):
            raise EyasError(f"{cfg.store}/{PROBE_DIR}: a probe's ids differ from the ids sent")
    rows = []
    if anchor:
        e = max(rel(p["states"][:, p["layers"].index(0)], head.embed[p["ids"]]) for p in probe)
        rows.append({"check": "probe anchor layer 0", "value": f"rel {e:.2e} vs the embedding", "ok": e <= cfg.tol,
                     "why": "" if e <= cfg.tol else "SGLang's layer-i capture is not the stream entering layer i "
                     "(captured in the wrong place): every aux id is off"})
    else:
        rows.append({"check": "probe anchor layer 0", "value": "not probed", "ok": None,
                     "why": f"{head.architecture}: SGLang cannot capture layer 0 of it"})
    return rows + compare_slots(probe, samples, aux_ids, tol=cfg.tol)


def run_served_check(cfg: CheckConfig, *, post=None, head: Head | None = None) -> dict:
    """Run every check that applies to the engine -> {"ok", "rows", "config"}; written to STORE/check.json."""
    st = Store(cfg.store, allow_incomplete=True)
    if len(st) == 0:
        raise EyasError(f"{cfg.store}: the store holds no samples, so there is nothing to check")
    head = head or load_head(cfg.target)
    if head.norm.shape[0] != st.hidden_size:
        raise EyasError(f"{cfg.target}: hidden size {head.norm.shape[0]} != the store's {st.hidden_size} (another "
                        f"target?)")
    samples = [st.get(i, dtype=torch.float32) for i in range(min(cfg.n, len(st)))]
    server = Server(cfg, post or post_json)
    rows = final_rows(cfg, head, samples, server)
    if cfg.engine == "sglang":
        rows += probe_rows(cfg, head, samples, st.aux_layer_ids, server)
    else:
        rows.append({"check": "aux slots", "value": "not probed", "ok": None,
                     "why": "vLLM has no per-request layer switch; crosscheck in process where the target fits"})
    result = {"ok": all(r["ok"] is not False for r in rows), "rows": rows, "config": asdict(cfg), "time": time.time()}
    atomic_write_bytes(Path(cfg.store) / CHECK_FILE, (json.dumps(result, indent=1) + "\n").encode())
    return result


def report(rows) -> str:
    w = max(len(r["check"]) for r in rows)
    lines = [f"{'check':<{w}}  verdict  value"]
    for r in rows:
        v = {True: "ok", False: "FAIL", None: "skip"}[r["ok"]]
        lines.append(f"{r['check']:<{w}}  {v:<7}  {r['value']}" + (f"  ({r['why']})" if r["why"] else ""))
    return "\n".join(lines)
