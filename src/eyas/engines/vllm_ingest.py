"""Ingest the files of vLLM's `extract_hidden_states` speculative method into an eyas store.

Format (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py): one
safetensors file per request, `{shared_storage_path}/{req_id}.safetensors` (path also returned as
kv_transfer_params["hidden_states_path"]), written by TP rank 0 only, with
  token_ids      int64 (T,)                 the prompt token ids
  hidden_states  (T, n_layers, H) model dtype  one slot per id of eagle_aux_hidden_state_layer_ids
and a companion `.lock` file held (flock LOCK_EX) until the write finished. eyas launches vLLM with
ids [a, b, c, N] (launch_args.vllm_args): slots 0..2 = aux, slot 3 = final.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.engines.records import Record, verify_states
from eyas.errors import EyasError


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


def to_record(sample_id: str, sent_ids, tensors: dict, *, num_layers: int = 4, where: str = "") -> Record:
    """Verify one vLLM file against the sent sample -> Record (ok with aux/final, or rejected with reason)."""
    if "token_ids" not in tensors or "hidden_states" not in tensors:
        return Record(sample_id, sample_id, False, f"{where}: keys {sorted(tensors)}, expected token_ids, hidden_states")
    ids, hs = tensors["token_ids"].long(), tensors["hidden_states"]
    if hs.dim() != 3 or hs.shape[1] != num_layers:
        return Record(sample_id, sample_id, False,
                      f"{where}: hidden_states {tuple(hs.shape)}, expected (T, {num_layers}, H) "
                      f"(were the layer ids launched as [aux x3, N]?)")
    aux, final = hs[:, :3], hs[:, 3]                            # (T, 3, H), (T, H)
    why = verify_states(sample_id, sent_ids, ids, aux, final)
    if why:
        return Record(sample_id, sample_id, False, f"{where}: {why}")
    return Record(sample_id, sample_id, True, input_ids=ids, aux=aux, final=final)


def ingest_dir(vllm_dir, writer, expected: dict, loss_masks: dict, *, names: dict | None = None,
               num_layers: int = 4) -> tuple[list[str], list[Record]]:
    """Write every verified file of `vllm_dir` into `writer` (a StoreWriter-like .add_sample).

    names: sample id -> file path (from the client); default `{sample_id}.safetensors`.
    Samples already committed (writer.committed_ids) are skipped: nothing is written twice.
    Returns (written ids, rejected records); missing files are rejected as 'no file'.
    """
    done = set(getattr(writer, "committed_ids", ()))
    written, rejected = [], []
    for sid, sent in expected.items():
        if sid in done:
            continue
        path = Path(names[sid]) if names and sid in names else Path(vllm_dir) / f"{sid}.safetensors"
        if not path.exists():
            rejected.append(Record(sid, sid, False, f"{path}: no file"))
            continue
        rec = to_record(sid, sent, read_vllm_file(path), num_layers=num_layers, where=str(path))
        if not rec.ok:
            rejected.append(rec)
            continue
        writer.add_sample(sid, rec.input_ids, loss_masks[sid], rec.aux, rec.final)
        done.add(sid)
        written.append(sid)
    return written, rejected
