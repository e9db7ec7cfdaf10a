"""Engine path vs in-process capture: per-layer relative error, naming an off-by-one layer."""

from __future__ import annotations

import torch


def _rel(engine, ref_all, slot: int, j: int) -> tuple[float, float]:
    """(||e - r|| / ||r|| over every token of every sample, max abs diff) of engine slot `slot` vs layer j."""
    num = den = 0.0
    mx = 0.0
    for e, r in zip(engine, ref_all):
        d = e[:, slot].float() - r[:, j].float()
        num += float(d.square().sum())
        den += float(r[:, j].float().square().sum())
        mx = max(mx, float(d.abs().max()))
    return (num ** 0.5) / max(den ** 0.5, 1e-30), mx


def crosscheck(engine: list[torch.Tensor], ref_all: list[torch.Tensor], aux_ids, *, tol: float) -> list[dict]:
    """engine[i] (T, 4, h) from the engine path; ref_all[i] (T, N+1, h) = HF hidden_states of sample i
    (index N = final-norm output). One row per slot: the relative error ||e - r|| / ||r|| against the intended
    layer (the residual stream holds a few huge activations, so an absolute bound says nothing: a bf16 engine
    against an fp32 reference differs by tens in absolute terms on SmolLM2's deep layers, seen live), the same
    against the neighbouring layers, and the neighbour it matches instead when the intended one is off. A slot
    is ok when its error is within tol and below both neighbours'."""
    if not engine or not ref_all:
        raise ValueError("crosscheck: no samples to compare (is the engine store empty?)")
    n = ref_all[0].shape[1] - 1
    want = list(aux_ids) + [n]
    rows = []
    for slot, lid in enumerate(want):
        rel, mx = _rel(engine, ref_all, slot, lid)
        near = {j: _rel(engine, ref_all, slot, j)[0] for j in (lid - 1, lid + 1) if 0 <= j <= n}
        ok = rel <= tol and all(rel < v for v in near.values())
        row = {"slot": slot, "layer": lid, "rel_err": rel, "max_abs_diff": mx, "neighbours": near, "ok": ok,
               "matches": None}
        if not ok:
            best = min(near, key=near.get, default=None)
            if best is not None and near[best] <= tol and near[best] < rel:
                row["matches"] = best
        rows.append(row)
    return rows


def report(rows) -> str:
    lines = ["slot  layer  rel_err    neighbours (layer: rel_err)   max_abs_diff  verdict"]
    for r in rows:
        v = "ok" if r["ok"] else (f"OFF BY ONE: matches layer {r['matches']}" if r["matches"] is not None
                                  else "MISMATCH")
        nb = ", ".join(f"{j}: {e:.3e}" for j, e in r["neighbours"].items())
        lines.append(f"{r['slot']:>4}  {r['layer']:>5}  {r['rel_err']:.3e}  {nb:<28}  {r['max_abs_diff']:>12.3e}  {v}")
    return "\n".join(lines)


@torch.inference_mode()
def reference_states(model, ids_list) -> list[torch.Tensor]:
    """In-process: HF output_hidden_states with the last entry replaced by the final-norm output."""
    out = []
    for ids in ids_list:
        o = model(input_ids=torch.as_tensor(ids, device=model.device)[None], output_hidden_states=True)
        out.append(torch.stack(o.hidden_states, dim=2)[0].cpu())     # (T, N+1, h)
    return out
