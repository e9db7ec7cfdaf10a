"""Fail fast when the server answers but its capture side never ran.

A server whose hook never runs still answers every request: SGLang only logs "No modules matched" for a
`--forward-hooks` target that is not in the model, a server started without the hook or with another
`--store` writes elsewhere, and vLLM started without the extract_hidden_states flags writes no file. Before
0.5.23, SGLang with an inner model lacking `layers_to_capture` runs the hook but gives it no aux states. Without a
check each sample would wait for its commit, time out and be retried.

A server that reports two-batch overlap (SGLang) or dual-batch overlap (vLLM) in its server info is refused
before any request; an SGLang server reporting several DP groups gets each sample routed to one (client.dp_group). Then the first round sends its first sample alone and looks for its dump before sending the rest: a hook event
(STORE/engine-events-r*.jsonl) or a vLLM hidden-states file. No dump within `hook_wait_s` stops the capture
with one line saying what to check. A hook that saw no aux states on two samples in a row stops it too. One
such sample can be the server's first forward when it skipped its warm-up: before 0.5.23 eyas's enable hook
switches the aux layers on only after that forward. A hook refused the store lock also stops it: a retry cannot
fix that.
"""

from __future__ import annotations

import time
from pathlib import Path

from eyas.engines.client import EngineCaptureConfig, event_offsets, new_events, send_all
from eyas.engines.records import NO_AUX, STORE_LOCKED, overlap_refusal
from eyas.engines.vllm_ingest import find_files
from eyas.errors import EyasError
from eyas.serving import SERVER_INFO, get_json


def overlap_flag(engine: str, info: dict) -> str | None:
    """The batch-overlap flag a server-info reply says is on (None: off or not reported)."""
    if engine == "sglang":
        return "--enable-two-batch-overlap" if info.get("enable_two_batch_overlap") else None
    vc = info.get("vllm_config")                    # a dict with config_format=json, else a string
    par = vc.get("parallel_config") if isinstance(vc, dict) else None
    return "--enable-dbo" if isinstance(par, dict) and par.get("enable_dbo") else None


def dp_groups(engine: str, info: dict) -> int:
    """How many schedulers an SGLang server deals requests to: dp_size (0.5.14: `--dp-size N
    --enable-dp-attention`), times attn_dp_size where the release has it (0.5.22+: `--attn-dp-size N`)."""
    if engine != "sglang":
        return 1
    try:
        return max(1, int(info.get("dp_size") or 1)) * max(1, int(info.get("attn_dp_size") or 1))
    except (TypeError, ValueError):
        return 1


def refuse_overlap(cfg: EngineCaptureConfig, get=get_json) -> dict:
    """Stop before any request when the server reports a batch-overlap flag; else its server info ({} when it
    reports nothing: no such endpoint; the SGLang hook refuses two-batch overlap itself when it loads)."""
    for path in SERVER_INFO[cfg.engine]:
        try:
            info = get(cfg.url.rstrip("/") + path, min(cfg.timeout_s, 30.0))
        except Exception:  # noqa: BLE001 - an engine without the endpoint: nothing to check here
            continue
        info = info if isinstance(info, dict) else {}
        flag = overlap_flag(cfg.engine, info)
        if flag:
            raise EyasError(overlap_refusal(cfg.url, flag))
        return info
    return {}


class Probe:
    """Sends the first samples of a capture one by one until one shows that the capture side runs."""

    def __init__(self, cfg: EngineCaptureConfig, out: Path, poll_s: float = 0.05, get=get_json):
        self.cfg, self.out, self.poll_s, self.get = cfg, Path(out), poll_s, get
        self.verified = self.flags_checked = False
        self.groups = 1   # the server's DP groups, read from it before the first request (dp_groups)
        self.no_aux: list[str] = []

    def send(self, todo: dict, *, attempt: int, **kw) -> dict:
        """send_all(todo) -> {id: reply | error}, its first samples alone until the capture side is verified."""
        if not self.flags_checked:
            self.groups = dp_groups(self.cfg.engine, refuse_overlap(self.cfg, self.get))
            self.flags_checked = True
        resp: dict = {}
        for sid in list(todo):
            if self.verified:
                break
            resp.update(self._one(sid, todo[sid], attempt, kw))
            if isinstance(resp[sid], str):
                break                   # transport error: no verdict; the rest fail or succeed as they will
        rest = {k: v for k, v in todo.items() if k not in resp}
        if rest:
            resp.update(send_all(self.cfg, rest, attempt=attempt, dp_groups=self.groups, **kw))
        return resp

    def _one(self, sid: str, ids, attempt: int, kw) -> dict:
        before = event_offsets(self.out) if self.cfg.engine == "sglang" else set(self._vllm_files(sid))
        r = send_all(self.cfg, {sid: ids}, attempt=attempt, dp_groups=self.groups, **kw)
        if not isinstance(r[sid], str):
            if self.cfg.engine == "sglang":
                self._check_hook(sid, before)
            else:
                self._check_vllm(sid, r[sid], before)
        return r

    def _vllm_files(self, sid: str) -> list[Path]:
        return find_files(self.cfg.vllm_dir, [sid]).get(sid, []) if Path(self.cfg.vllm_dir).is_dir() else []

    def _wait(self, found):
        deadline = time.monotonic() + self.cfg.hook_wait_s
        while True:
            x = found()
            if x or time.monotonic() > deadline:
                return x
            time.sleep(self.poll_s)

    def _check_hook(self, sid: str, before: dict) -> None:
        ev = self._wait(lambda: [e for e in new_events(self.out, before) if e.get("id") == sid])
        if not ev:
            raise EyasError(
                f"{self.cfg.url} answered sample {sid!r} but no eyas capture hook ran: nothing reached "
                f"{self.out}/engine-events-r*.jsonl within {self.cfg.hook_wait_s:g} s. Start the server with the "
                f"--forward-hooks that `eyas engine launch-args sglang --store {self.out}` prints; if its log says "
                f"'No modules matched', the hook's module is not in this model (launch-args --lm-head-module)")
        reason = ev[-1].get("reason") or ""
        if reason.startswith(STORE_LOCKED):
            raise EyasError(f"{self.cfg.url}: the capture hook cannot write: {reason}")
        if reason != NO_AUX:
            self.verified = True        # the hook ran and saw aux states; other rejections are retried as usual
            return
        self.no_aux.append(sid)
        if len(self.no_aux) >= 2:
            raise EyasError(
                f"{self.cfg.url}: the capture hook ran but got no aux hidden states for samples "
                f"{', '.join(map(repr, self.no_aux))}: SGLang 0.5.23+ needs --enable-return-aux-hidden-states; "
                f"before 0.5.23 the eyas_enable_aux hook of `eyas engine launch-args` must be given (on the inner "
                f"model, e.g. `model`) and that module must have layers_to_capture (without it SGLang captures "
                f"nothing, silently)")

    def _check_vllm(self, sid: str, reply: dict, before: set) -> None:
        named = ((reply or {}).get("kv_transfer_params") or {}).get("hidden_states_path")
        ok = self._wait(lambda: (named and Path(named).exists()) or set(self._vllm_files(sid)) - before)
        if not ok:
            raise EyasError(
                f"{self.cfg.url} answered sample {sid!r} but no hidden-states file for it reached "
                f"{self.cfg.vllm_dir} within {self.cfg.hook_wait_s:g} s (the reply names "
                f"{named or 'none'}). Start vLLM with the --speculative-config and --kv-transfer-config that "
                f"`eyas engine launch-args vllm` prints, and pass its shared_storage_path as --vllm-dir")
        self.verified = True
