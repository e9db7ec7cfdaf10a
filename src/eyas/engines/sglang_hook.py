"""SGLang forward hook (loaded with --forward-hooks) that writes EAGLE-3 states into an eyas store.

It is registered on the target's `logits_processor` (hook_manager.register_forward_hook), whose
positional inputs are (input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states):
  input_ids      (N,)    None when the model was called with input_embeds (Kimi-K2.5): forward_batch.input_ids
  hidden_states  (N, h)  final-norm output of every token of the batch (before pruning to last tokens)
  aux            list of K x (N, h), or packed (N, K*h) from 0.5.23 (DeepSeek; Llama keeps the list); the
                 residual stream entering the captured layers (SGLang's layers_to_capture = HF ids); K = 3,
                 or the layers a served-check probe asked for
  forward_batch  .rids, .extend_seq_lens_cpu, .extend_prefix_lens_cpu, .forward_mode
Only attention-TP rank 0 of each attention-DP group writes (TP ranks hold the same states after the
all-reduce); DP group g writes store rank g + 1 (rank 0 is the capture client, engines/locking.py), so each
DP group has its own shards in the one store. It holds that rank's lock from its first accepted sample to its
next flush; when another process holds it, the samples are rejected with the holder named, never written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch

from eyas.engines.locking import HOOK_RANK_OFFSET, hook_rank
from eyas.engines.records import STORE_LOCKED, Assembler, Record, overlap_refusal
from eyas.errors import EyasError

IDLE_FLUSH_S = 5.0
FLUSH_RID = "eyas-control-flush"


def events_name(rank: int) -> str:
    return f"engine-events-r{rank:03d}.jsonl"


RUNTIME_CONTEXT = "sglang.srt.runtime_context"      # get_parallel().attn_tp_rank ... from 0.5.14 (only way from 0.5.21)
DP_ATTENTION = "sglang.srt.layers.dp_attention"     # get_attention_tp_rank() ... up to 0.5.15 (tp) / 0.5.20 (dp)


def _optional_module(name: str):
    import importlib  # noqa: PLC0415
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise                                   # the module exists but one of its imports is broken
        return None                                 # it, or a package above it (no SGLang at all), is absent


MOE_UTILS = "sglang.srt.layers.moe.utils"           # is_tbo_enabled(): --enable-two-batch-overlap, 0.5.14 to 0.5.23


def refuse_two_batch_overlap(is_tbo_enabled=None) -> None:
    """Raise (at hook load, so the server does not start) when this SGLang runs two-batch overlap.

    SGLang's scheduler sets the flag read by moe.utils.is_tbo_enabled() from the server args
    (initialize_moe_config, for MoE targets, the only ones that run it) before it loads the model and the hooks.
    """
    if is_tbo_enabled is None:
        m = _optional_module(MOE_UTILS)
        is_tbo_enabled = getattr(m, "is_tbo_enabled", None)
    if is_tbo_enabled is not None and is_tbo_enabled():
        raise RuntimeError(overlap_refusal("eyas capture hook: this SGLang server", "--enable-two-batch-overlap"))


def sglang_ranks() -> tuple[int, int, int]:
    """(attention TP rank, attention DP rank, attention DP size) of this SGLang process.

    SGLang 0.5.14+ has runtime_context.get_parallel() with attn_tp_rank / attn_dp_rank / attn_dp_size;
    its dp_attention.get_attention_* functions lost get_attention_tp_rank in 0.5.16 and the rest in
    0.5.21. Before 0.5.14 the functions are the only source. So: the context when it exists, else the
    functions (tests/support/engine_sglang_layouts.py records each version's layout, checked against the wheels).
    """
    rc = _optional_module(RUNTIME_CONTEXT)
    if rc is not None and hasattr(rc, "get_parallel"):
        p = rc.get_parallel()
        return int(p.attn_tp_rank), int(p.attn_dp_rank), int(p.attn_dp_size)
    d = _optional_module(DP_ATTENTION)
    names = ("get_attention_tp_rank", "get_attention_dp_rank", "get_attention_dp_size")
    if d is None or not all(hasattr(d, n) for n in names):
        raise RuntimeError(f"eyas capture hook: this SGLang has neither {RUNTIME_CONTEXT}.get_parallel nor "
                           f"{DP_ATTENTION}.{{{','.join(names)}}}; cannot tell which rank writes")
    return tuple(int(getattr(d, n)()) for n in names)  # type: ignore[return-value]


def unpack_aux(aux, n: int, h: int, num_aux: int) -> torch.Tensor | None:
    """list of K x (N, h) | packed (N, K*h) | packer with .finalize() -> (N, K, h)."""
    if aux is None:
        return None
    if hasattr(aux, "finalize") and not isinstance(aux, torch.Tensor):
        aux = aux.finalize()
    if isinstance(aux, (list, tuple)):
        if len(aux) == 0:
            return None
        aux = torch.stack(list(aux), dim=1)            # (N, K, h)
    elif isinstance(aux, torch.Tensor) and aux.dim() == 2:
        aux = aux.reshape(aux.shape[0], -1, h)         # (N, K*h) -> (N, K, h)
    return aux


def batch_view(args: tuple, num_aux: int = 3):
    """The logits processor's positional inputs -> (mode, rids, extend lens, prefix lens, ids, final, aux).

    ids are None only when neither the logits processor nor the forward batch has them. A multimodal wrapper
    (Kimi-K2.5: general_mm_embed_routine) calls its language model with input_ids=None and input_embeds, so the
    logits processor gets None; the batch's own forward_batch.input_ids are the tokens then.
    """
    input_ids, hidden = args[0], args[1]
    fb = args[3]
    if input_ids is None:
        input_ids = getattr(fb, "input_ids", None)
    aux = args[4] if len(args) > 4 else None
    handed = take_handoff()                           # this forward's aux from the enable hook (before 0.5.23)
    if aux is None:
        aux = handed
    mode = getattr(getattr(fb, "forward_mode", None), "name", str(getattr(fb, "forward_mode", "")))
    rids = list(getattr(fb, "rids", None) or [])
    ext = getattr(fb, "extend_seq_lens_cpu", None)    # list[int], or a CPU tensor on some paths (0.5.10+)
    pre = getattr(fb, "extend_prefix_lens_cpu", None)
    ext = None if ext is None else [int(x) for x in ext]
    pre = None if pre is None else [int(x) for x in pre]
    aux = unpack_aux(aux, hidden.shape[0], hidden.shape[-1], num_aux)
    return mode, rids, ext, pre, input_ids, hidden, aux


class CaptureHook:
    """The callable SGLang registers: hook(module, args, output)."""

    def __init__(self, *, store, expected: dict, loss_masks: dict, num_aux: int = 3, ranks=None,
                 writer_factory=None, idle_flush_s: float = IDLE_FLUSH_S):
        self.store = Path(store)
        self.loss_masks = loss_masks
        self._ranks = ranks or sglang_ranks
        self._writer_factory = writer_factory or self._store_writer
        self.tp_rank = self.dp_rank = self.dp_size = None
        self.asm = Assembler(expected, num_aux=num_aux)
        self.writer = None
        self._store_lock = None
        self.idle_flush_s = idle_flush_s
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._timer = None

    # ---- writer ----
    def _store_writer(self, rank: int, world: int):
        from eyas.manifest import read_manifest  # noqa: PLC0415
        from eyas.store import format as fmt  # noqa: PLC0415
        from eyas.store.writer import StoreWriter  # noqa: PLC0415
        m = read_manifest(self.store, kind=fmt.KIND)   # created by run_engine_capture before any request
        header = {k: m[k] for k in m if k in ("target", "layers", "dtype", "hidden_size", "vocab_size",
                                              "data", "config")}
        return StoreWriter(self.store, header=header, rank=rank, world_size=world, setup=False)

    def _ensure_ranks(self) -> bool:
        if self.tp_rank is None:
            self.tp_rank, self.dp_rank, self.dp_size = self._ranks()
            if self.tp_rank == 0:
                from eyas.store.writer import read_sidecars  # noqa: PLC0415
                if self.store.exists():
                    self.asm.done |= {i for r in read_sidecars(self.store) for i in r["ids"]}
        return self.tp_rank == 0

    def _event(self, rec: Record) -> None:
        line = {"rid": rec.rid, "id": rec.sample_id, "ok": rec.ok, "reason": rec.reason, "dp_rank": self.dp_rank,
                "tokens": None if rec.input_ids is None else int(rec.input_ids.shape[0]), "time": time.time()}
        with open(self.store / events_name(self.dp_rank), "a") as f:
            f.write(json.dumps(line) + "\n")

    def _write(self, rec: Record) -> str:
        """Add one verified sample to this rank's writer, opened (lock first) if needed -> '' or why not."""
        from eyas.store.lock import acquire_store_lock  # noqa: PLC0415
        with self._lock:
            if self.writer is None:
                rank = hook_rank(self.dp_rank)
                try:
                    self._store_lock = acquire_store_lock(self.store, rank)
                except EyasError as e:
                    return f"{STORE_LOCKED}: {e}"
                try:
                    self.writer = self._writer_factory(rank, self.dp_size + HOOK_RANK_OFFSET)
                except BaseException:
                    self._store_lock.release()
                    self._store_lock = None
                    raise
            self.writer.add_sample(rec.sample_id, rec.input_ids, self.loss_masks[rec.sample_id], rec.aux, rec.final)
        return ""

    def flush(self) -> None:
        """Commit everything accepted so far (closes the writer and releases the rank's lock; the next sample
        opens a new one)."""
        with self._lock:
            try:
                if self.writer is not None:
                    self.writer.close()
            finally:
                self.writer = None
                if self._store_lock is not None:
                    self._store_lock.release()
                    self._store_lock = None

    def _idle_loop(self) -> None:
        while True:
            time.sleep(self.idle_flush_s / 2)
            if self.writer is not None and time.monotonic() - self._last > self.idle_flush_s:
                self.flush()

    # ---- the hook ----
    def __call__(self, module, args, output=None):
        if not self._ensure_ranks():
            return None                          # TP duplicate: rank 0 of the group writes
        mode, rids, ext, pre, ids, final, aux = batch_view(args, self.asm.num_aux)
        if mode not in ("EXTEND", "MIXED") or not rids:
            return None                          # decode / idle / dummy forwards carry no prompt states
        if any(r.startswith(FLUSH_RID) for r in rids):
            self.flush()
            return None
        from eyas.engines.served_check import record_probe  # noqa: PLC0415
        if record_probe(self.store, rids, ext if ext is not None or ids is None else [int(ids.shape[0])], pre,
                        ids, aux):
            return None                          # the check's probe (engines/served_check.py): never stored
        if ids is None:
            ext = pre = None                     # the Assembler rejects each request, saying why
        elif ext is None or pre is None:
            ext, pre = [int(ids.shape[0])], [0]
        self._last = time.monotonic()
        for rec in self.asm.feed(rids, list(ext or ()), list(pre or ()), ids, final, aux):
            if rec.ok:
                why = self._write(rec)
                if why:
                    self.asm.done.discard(rec.sample_id)     # not written: a later request may capture it
                rec = Record(rec.rid, rec.sample_id, not why, why)   # no tensors kept alive in the log path
            self._event(rec)
        if self._timer is None and self.idle_flush_s > 0:
            self._timer = threading.Thread(target=self._idle_loop, daemon=True, name="eyas-idle-flush")
            self._timer.start()
        return None


def load_expected(data_path) -> tuple[dict, dict]:
    """Prepared data -> ({sample id: token ids}, {sample id: loss mask})."""
    from eyas.data.prepared import PreparedData  # noqa: PLC0415
    ids, masks = {}, {}
    for s in PreparedData(data_path):
        ids[s.id], masks[s.id] = s.input_ids, s.loss_mask
    return ids, masks


def make_capture_hook(config: dict):
    """--forward-hooks factory: config {store, data, aux_layer_ids, num_layers}."""
    refuse_two_batch_overlap()
    expected, masks = load_expected(config["data"])
    return CaptureHook(store=config["store"], expected=expected, loss_masks=masks,
                       num_aux=len(config.get("aux_layer_ids", [0, 0, 0])),
                       idle_flush_s=float(config.get("idle_flush_s", IDLE_FLUSH_S)))


# Aux states of the last inner-model forward, handed from the enable hook to the capture hook (one process, one
# forward at a time: SGLang's scheduler runs the model from one thread).
_AUX_HANDOFF: list = []


def make_aux_enable_hook(config: dict):
    """--forward-hooks factory for SGLang releases without --enable-return-aux-hidden-states (before 0.5.23);
    config {layers_to_capture: the HF aux ids}.

    Its target is the inner model that owns `layers_to_capture` (Llama: `model`; Kimi-K2.5:
    `language_model.model`), not the root: SGLang's runners call the root's .forward() directly, so a hook on
    the root never runs (seen live on SGLang 0.5.14: the capture hook got no aux states). The inner model is
    called as a module, so its hooks run. Its first call (the server's warm-up) sets layers_to_capture; from
    then on it returns (hidden, aux), and this hook hands the root `hidden` alone, keeping aux for the capture
    hook, so the root's own switch (capture_aux_hidden_states, which an EAGLE-3 server sets) stays as it was.
    If layers_to_capture was already set by the server itself, the aux states reach the capture hook through
    the logits processor's arguments and this hook does nothing.
    """
    refuse_two_batch_overlap()
    want = [int(i) for i in config["layers_to_capture"]]
    state: dict = {}

    def hook(module, args, output):
        if "mode" not in state:
            if not hasattr(module, "layers_to_capture"):
                state["mode"] = "absent"  # SGLang says nothing; the capture client stops on its first samples
                import sys  # noqa: PLC0415
                print(f"eyas capture hook: {type(module).__name__} has no layers_to_capture, so no aux hidden "
                      f"states will reach the capture hook (SGLang 0.5.23+: --enable-return-aux-hidden-states)",
                      file=sys.stderr, flush=True)
            elif list(module.layers_to_capture):
                state["mode"] = "native"
            else:
                module.layers_to_capture = want
                state["mode"] = "handoff"
            if state["mode"] != "absent":        # the check's probe switches the layers per probe forward
                from eyas.engines.served_check import install_probe_switch  # noqa: PLC0415
                install_probe_switch(module)
            return None
        if state["mode"] == "handoff" and isinstance(output, tuple) and len(output) == 2:
            _AUX_HANDOFF[:] = [output[1]]
            return output[0]
        return None
    return hook


def make_probe_switch_hook(config: dict):
    """--forward-hooks factory for SGLang 0.5.23+, whose --enable-return-aux-hidden-states sets the inner model's
    `layers_to_capture` itself; config {} (unused).

    Same target as the enable hook (the inner model). It never writes `layers_to_capture`: at the first forward
    whose batch carries requests it only installs the served check's probe switch (engines/served_check.py),
    which swaps the layers for probe-only batches and puts the server's own list back after each. Not at an
    idle forward: 0.5.23's logits processor checks the aux count once, at its first forward with tokens, and
    that forward must see the server's layers, not a probe's. A model whose `layers_to_capture` is absent or
    empty gets no switch (its probes are reported unchecked).
    """
    state: dict = {}

    def hook(module, args, output):
        if state:
            return None
        from eyas.engines.served_check import find_forward_batch, install_probe_switch  # noqa: PLC0415
        fb = find_forward_batch(args, {})
        if fb is not None and not list(getattr(fb, "rids", None) or []):
            return None                              # idle (DP attention): wait for a forward with requests
        state["done"] = True
        if list(getattr(module, "layers_to_capture", None) or []):
            install_probe_switch(module)
        else:
            import sys  # noqa: PLC0415
            print(f"eyas probe switch: {type(module).__name__} has no layers_to_capture set by the server, so the "
                  f"served check cannot probe its aux slots (launched without --enable-return-aux-hidden-states?)",
                  file=sys.stderr, flush=True)
        return None
    return hook


def take_handoff():
    """The aux states the enable hook kept from this forward (None when it kept none)."""
    return _AUX_HANDOFF.pop() if _AUX_HANDOFF else None


HOOK_ENV = "EYAS_SGLANG_HOOK"


def attach(model) -> None:
    """Called by the patched SGLang model __init__: registers the capture hook if $EYAS_SGLANG_HOOK is set.

    $EYAS_SGLANG_HOOK: the JSON list printed for --forward-hooks (or a path to a file holding it).
    """
    import os  # noqa: PLC0415
    raw = os.environ.get(HOOK_ENV)
    if not raw:
        return
    spec = json.loads(Path(raw).read_text() if not raw.lstrip().startswith("[") else raw)
    for s in spec:
        cfg = s.get("config") or {}
        if s["hook_factory"].endswith(":make_capture_hook"):
            hook = make_capture_hook(cfg)
        elif s["hook_factory"].endswith(":make_aux_enable_hook"):
            hook = make_aux_enable_hook(cfg)
        else:
            continue
        for name in s["target_modules"]:          # the names hook_manager would match (exact, as launch-args prints)
            model.get_submodule(name).register_forward_hook(hook)
