"""Ingest the files of vLLM's `extract_hidden_states` speculative method into an eyas store.

Format (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py, 0.25.0 and
0.33.0): one safetensors file per request, `{shared_storage_path}/{req_id}.safetensors` (path also
returned as kv_transfer_params["hidden_states_path"]), written by TP rank 0 only, with
  token_ids      int64 (T,)                 the prompt token ids
  hidden_states  (T, n_layers, H) model dtype  one slot per id of eagle_aux_hidden_state_layer_ids
and a companion `.lock` file held (flock LOCK_EX) until the write finished. eyas launches vLLM with
ids [a, b, c, N] (launch_args.vllm_args): slots 0..2 = aux, slot 3 = the residual stream after the last
layer, BEFORE the final norm; the ingester applies the target's norm (final_norm.py) so that the store
holds the final-norm output like every other capture path.

req_id is vLLM's internal id, not the one eyas sends: the completions endpoint makes it
`cmpl-{request_id}-{prompt index}` and the engine appends `-{8 hex}` (input_processor.assign_request_id,
unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION). eyas's request_id is `{sample id}#a{attempt}`, so
`cmpl-{sample id}#a{attempt}-{index}[-{8 hex}].safetensors` names the sample.
"""

from __future__ import annotations

import fcntl
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.data.prepared import load_prepared_samples
from eyas.engines.final_norm import FinalNorm, load_final_norm
from eyas.engines.locking import CLIENT_RANK, client_writer, finalize_store
from eyas.engines.records import ATTEMPT_SEP, Record, check_states
from eyas.errors import EyasError
from eyas.manifest import atomic_write_bytes, read_manifest
from eyas.store.lock import acquire_store_lock


def read_vllm_file(path) -> dict[str, torch.Tensor]:
    """Load one request file, waiting on its .lock (shared flock) if one exists."""
    p = Path(path)
    lock = Path(str(p) + ".lock")
    try:
        if lock.exists():
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
                return load_file(str(p), device="cpu")
        return load_file(str(p), device="cpu")
    except (OSError, Exception) as e:  # safetensors raises its own error type on a truncated file
        raise EyasError(f"{p}: unreadable vLLM hidden-states file ({e})") from e


def check_sample_id(sample_id: str, where: str = "") -> None:
    """Refuse a sample id that vLLM would turn into a path outside its directory (it names its file
    `{shared_storage_path}/cmpl-{request id}-...`): no path separators, no NUL, not `.`/`..`."""
    if (not isinstance(sample_id, str) or not sample_id or any(c in sample_id for c in "/\\\0")
            or sample_id in (".", "..")):
        raise EyasError(f"{where + ': ' if where else ''}sample id {sample_id!r} is not a safe file name part "
                        "(a path separator, NUL or '..'): refused, nothing is read or written by its name")


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


VLLM_NAME = re.compile(rf"^cmpl-(?P<sid>.+){re.escape(ATTEMPT_SEP)}(?P<attempt>\d+)-\d+(?:-[0-9a-f]{{8}})?\.safetensors$")


def find_files(vllm_dir, sample_ids) -> dict[str, list[Path]]:
    """sample id -> its vLLM files, newest attempt first (`{sample id}.safetensors` also counts)."""
    found: dict[str, list[tuple[int, Path]]] = {}
    wanted = set(sample_ids)
    for p in Path(vllm_dir).glob("*.safetensors"):
        m = VLLM_NAME.match(p.name)
        sid, attempt = (m["sid"], int(m["attempt"])) if m else (p.name[: -len(".safetensors")], -1)
        if sid in wanted:
            found.setdefault(sid, []).append((attempt, p))
    return {sid: [p for _, p in sorted(v, key=lambda t: (-t[0], t[1].name))] for sid, v in found.items()}


def to_record(sample_id: str, sent_ids, tensors: dict, *, final_norm: FinalNorm, num_layers: int = 4,
              where: str = "") -> Record:
    """Verify one vLLM file against the sent sample -> Record (ok with aux/final, or rejected with kind and reason)."""
    def bad(kind: str, why: str) -> Record:
        return Record(sample_id, sample_id, False, f"{where}: {why}", kind=kind)
    if "token_ids" not in tensors or "hidden_states" not in tensors:
        return bad("missing keys", f"keys {sorted(tensors)}, expected token_ids, hidden_states")
    ids, hs = tensors["token_ids"].long(), tensors["hidden_states"]
    if ids.dim() != 1 or hs.dim() != 3 or hs.shape[1] != num_layers:
        return bad("wrong shape", f"hidden_states {tuple(hs.shape)}, token_ids {tuple(ids.shape)}: expected "
                   f"(T, {num_layers}, H) and (T,) (were the layer ids launched as [aux x3, N]?)")
    if hs.shape[-1] != final_norm.weight.shape[0]:
        return bad("wrong hidden size", f"hidden size {hs.shape[-1]} != the target's final norm "
                   f"{final_norm.weight.shape[0]} (another model?)")
    aux, final = hs[:, :3], final_norm(hs[:, 3])               # (T, 3, H), (T, H) pre-norm -> final-norm
    why = check_states(sent_ids, ids, aux, final)
    if why:
        return bad(*why)
    return Record(sample_id, sample_id, True, input_ids=ids, aux=aux, final=final)


def _verified(sid: str, sent, p: Path, *, final_norm: FinalNorm, num_layers: int) -> Record:
    try:
        tensors = read_vllm_file(p)
    except EyasError as e:                      # truncated / not safetensors: this file only, not the whole ingest
        return Record(sid, sid, False, str(e), kind="unreadable file")
    return to_record(sid, sent, tensors, final_norm=final_norm, num_layers=num_layers, where=str(p))


def ingest_dir(vllm_dir, writer, expected: dict, loss_masks: dict, *, final_norm: FinalNorm,
               names: dict | None = None, num_layers: int = 4,
               skipped: list | None = None) -> tuple[list[str], list[Record]]:
    """Write every verified file of `vllm_dir` into `writer` (a StoreWriter-like .add_sample).

    names: sample id -> file path (kv_transfer_params["hidden_states_path"] from the response), tried
    first; then the sample's files found by name (find_files), newest attempt first. A file that cannot be
    read or does not verify is skipped (the next one is tried); `skipped` collects one Skip per such file and
    per sample without any file.
    Samples already committed (writer.committed_ids) are skipped: nothing is written twice.
    Returns (written ids, rejected records: the last reason of each sample not written).
    A sample id or a file that points outside `vllm_dir` is refused (EyasError), never skipped.
    """
    for sid in expected:  # before anything is read or written
        check_sample_id(sid, str(vllm_dir))
    skipped = [] if skipped is None else skipped
    done = set(getattr(writer, "committed_ids", ()))
    on_disk = find_files(vllm_dir, expected)
    written, rejected = [], []
    for sid, sent in expected.items():
        if sid in done:
            continue
        paths = ([Path(names[sid])] if names and sid in names else []) + on_disk.get(sid, [])
        paths = [p for k, p in enumerate(paths) if p.exists() and p not in paths[:k]]
        for p in paths:
            if not _inside(p, Path(vllm_dir)):
                raise EyasError(f"{p}: the file for sample {sid} resolves outside {vllm_dir} "
                                f"({p.resolve()}): refused")
        if not paths:
            rec = Record(sid, sid, False, f"{vllm_dir}: no file for {sid} "
                         f"(looked for cmpl-{sid}{ATTEMPT_SEP}K-I-XXXXXXXX.safetensors)", kind="no file")
            skipped.append(Skip(sid, rec.kind, str(vllm_dir), rec.reason))
            rejected.append(rec)
            continue
        for p in paths:
            rec = _verified(sid, sent, p, final_norm=final_norm, num_layers=num_layers)
            if rec.ok:
                break
            skipped.append(Skip(sid, rec.kind, str(p), rec.reason))
        if not rec.ok:
            rejected.append(rec)
            continue
        writer.add_sample(sid, rec.input_ids, loss_masks[sid], rec.aux, rec.final)
        done.add(sid)
        written.append(sid)
    return written, rejected


@dataclass(frozen=True)
class Skip:
    """One skipped file (or a sample without one): a line of STORE/skipped.jsonl, like prepare's skipped records."""
    id: str        # the sample id
    reason: str    # short, countable: "unreadable file", "wrong shape", "token count", "no file", ...
    where: str     # the file (or the vLLM directory when there is none)
    detail: str


SKIPPED = "skipped.jsonl"


def run_ingest(vllm_dir, data, out, target_config, target_weights=None, *, wait_s: float = 60.0) -> dict:
    """`eyas engine ingest-vllm`: every readable, verified file into STORE as its rank 0 (under its lock).

    Files that cannot be read or do not verify are skipped, not fatal. STORE/skipped.jsonl is rewritten with this
    run's skips (one line each); the returned summary counts them by reason. A rerun resumes: committed samples
    are kept, the others are tried again (a newer vLLM attempt first).
    """
    norm = load_final_norm(target_config, target_weights or None)
    with acquire_store_lock(out, CLIENT_RANK):
        _, ids, masks = load_prepared_samples(data)
        header = {k: v for k, v in read_manifest(out).items()
                  if k in ("target", "layers", "dtype", "hidden_size", "vocab_size", "data", "config")}
        skips: list[Skip] = []
        with client_writer(out, header, wait_s=wait_s) as w:
            written, _ = ingest_dir(vllm_dir, w, ids, masks, final_norm=norm, skipped=skips)
        m = finalize_store(out, header, ids, wait_s=wait_s)
        atomic_write_bytes(Path(out) / SKIPPED, "".join(json.dumps(asdict(k)) + "\n" for k in skips).encode())
    counts = Counter(k.reason for k in skips)
    return {"written": len(written), "samples": m["num_samples"], "expected": len(ids),
            "complete": bool(m["complete"]), "skipped": dict(counts.most_common()),
            "skipped_log": str(Path(out) / SKIPPED)}


def skip_summary(summary: dict) -> str | None:
    """One line for stderr: what was skipped, by reason, and what that leaves (None when nothing was skipped)."""
    if not summary["skipped"]:
        return None
    by = ", ".join(f"{n} {reason}" for reason, n in summary["skipped"].items())
    missing = summary["expected"] - summary["samples"]
    left = (f"{missing} of {summary['expected']} samples are not in the store (incomplete: `eyas capture --engine "
            f"vllm` re-requests only those)" if missing else "every sample is in the store (an older or newer "
            "file of each skipped one verified)")
    return f"eyas engine ingest-vllm: skipped {sum(summary['skipped'].values())} ({by}); {left}; details in " \
           f"{summary['skipped_log']}"
