"""Fake SGLang forward batches and a tiny 'engine' built from a tiny Llama's true hidden states."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from eyas.store.writer import StoreWriter

H = 16


class ForwardMode(enum.Enum):   # mirrors sglang.srt.model_executor.forward_batch_info.ForwardMode names
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4


@dataclass
class FakeForwardBatch:         # the ForwardBatch fields the hook reads
    forward_mode: ForwardMode
    rids: list
    extend_seq_lens_cpu: list
    extend_prefix_lens_cpu: list


def true_states(ids: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-token 'hidden states' keyed by (token, position): (T, 3, H), (T, H)."""
    g = torch.Generator().manual_seed(seed + 7)
    base = torch.randn(1000, 4, H, generator=g)
    aux = torch.stack([base[t % 1000, :3] + p * 0.01 for p, t in enumerate(ids)])    # (T, 3, H)
    final = torch.stack([base[t % 1000, 3] + p * 0.01 for p, t in enumerate(ids)])   # (T, H)
    return aux, final


def make_args(segments, samples, *, packed=False, mode=ForwardMode.EXTEND, drop_aux=False):
    """segments: [(rid, sample_id, start, end, prefix_len)] -> the logits processor's positional args."""
    ids, aux, fin = [], [], []
    for rid, sid, a, b, _ in segments:
        s_aux, s_fin = true_states(samples[sid])
        ids.append(torch.tensor(samples[sid][a:b]))
        aux.append(s_aux[a:b])
        fin.append(s_fin[a:b])
    ids_t, aux_t, fin_t = torch.cat(ids), torch.cat(aux), torch.cat(fin)
    if drop_aux:
        aux_arg = None
    elif packed:
        aux_arg = aux_t.reshape(aux_t.shape[0], -1)     # (N, 3H) as SGLang 0.5.23 packs it
    else:
        aux_arg = [aux_t[:, k] for k in range(3)]       # list of 3 x (N, H)
    fb = FakeForwardBatch(mode, [s[0] for s in segments], [s[3] - s[2] for s in segments],
                          [s[4] for s in segments])
    return (ids_t, fin_t, None, fb, aux_arg)


def header(dtype="bf16"):
    return {"target": {"identity": "fake", "config_sha256": "0", "tokenizer_sha256": "0"},
            "layers": {"aux": [2, 4, 5]}, "dtype": dtype, "hidden_size": H, "vocab_size": 1000,
            "data": {"path": "fake"}, "config": {"engine": "fake"}}


def init_store(path, world_size=1):
    w = StoreWriter(path, header=header(), rank=0, world_size=world_size)
    w.close()
