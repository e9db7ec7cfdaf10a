"""Engine path vs in-process capture: per-layer max abs diff, naming an off-by-one layer."""

from __future__ import annotations

import torch


def crosscheck(engine: list[torch.Tensor], ref_all: list[torch.Tensor], aux_ids, *, tol: float) -> list[dict]:
    """engine[i] (T, 4, h) from the engine path; ref_all[i] (T, N+1, h) = HF hidden_states of sample i
    (index N = final-norm output). One row per slot: max abs diff to the intended layer, and the
    neighbouring layer (id-1, id+1) it matches instead when the intended one is off."""
    n = ref_all[0].shape[1] - 1
    want = list(aux_ids) + [n]
    rows = []
    for slot, lid in enumerate(want):
        def diff(j):
            return max(float((e[:, slot].float() - r[:, j].float()).abs().max()) for e, r in zip(engine, ref_all))
        d = diff(lid)
        row = {"slot": slot, "layer": lid, "max_abs_diff": d, "ok": d <= tol, "matches": None}
        if d > tol:
            for j in (lid - 1, lid + 1):
                if 0 <= j <= n and diff(j) <= tol:
                    row["matches"] = j
        rows.append(row)
    return rows


def report(rows) -> str:
    lines = ["slot  layer  max_abs_diff  verdict"]
    for r in rows:
        v = "ok" if r["ok"] else (f"OFF BY ONE: matches layer {r['matches']}" if r["matches"] is not None
                                  else "MISMATCH")
        lines.append(f"{r['slot']:>4}  {r['layer']:>5}  {r['max_abs_diff']:>12.3e}  {v}")
    return "\n".join(lines)


@torch.inference_mode()
def reference_states(model, ids_list) -> list[torch.Tensor]:
    """In-process: HF output_hidden_states with the last entry replaced by the final-norm output."""
    out = []
    for ids in ids_list:
        o = model(input_ids=torch.as_tensor(ids)[None], output_hidden_states=True)
        out.append(torch.stack(o.hidden_states, dim=2)[0])     # (T, N+1, h)
    return out
