"""Training batches: sources (offline store / online prepared data), the eval split, the batch plan, collate.

Both modes produce the same `Batch`: right-padded (B, T) ids/masks plus aux (B, T, 3h_t) = concat(low, mid,
high) and final (B, T, h_t). Offline reads them from the store; online runs the target's decoder stack with
forward pre-hooks on the aux layers (no lm_head, so no T x V logits) and keeps nothing.

The batch plan is a pure function of (seed, epoch, lengths): micro-batch m of an epoch goes to rank
m % world_size, and a step on a rank uses `grad_accum` consecutive micro-batches of its own. A single process
with grad_accum = A * W therefore sees exactly the micro-batches that W ranks with grad_accum = A see.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from eyas.data.split import sample_number, split_key
from eyas.errors import EyasError
from eyas.target.hooks import LayerInputs, decoder_stack

EVAL_SALT = "eyas-train-eval:"   # independent of the prepare stage's own held-out split


def is_eval(sample_id: str, fraction: float) -> bool:
    """Held-out for training-time eval: a salted hash of the id (ShareGPT parts `<id>_N` stay together)."""
    if fraction <= 0:
        return False
    key = EVAL_SALT + split_key(sample_id, sharegpt=True)
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return h < fraction * 2**64


@dataclass
class Batch:
    ids: list[str]
    """Sample id of each row."""
    input_ids: Tensor
    """(B, T) int64, 0 on padding."""
    loss_mask: Tensor
    """(B, T) bool, trainable tokens."""
    valid: Tensor
    """(B, T) bool, False on padding."""
    aux: Tensor | None = None
    """(B, T, 3h_t) concat(low, mid, high); None until the online target fills it."""
    final: Tensor | None = None
    """(B, T, h_t) the target's final-norm output."""
    segment_ids: Tensor | None = None
    """Packed rows only: (B, T) int, 1.. per sample in the row, 0 on padding."""
    position_ids: Tensor | None = None
    """Packed rows only: (B, T) RoPE position of each token within its sample."""
    scale: Tensor | None = None
    """An fp8 store's batch on the host: (B, T, 4) float32 scales of the low, mid, high and final slots, with aux
    and final still float8 (one byte a value to read, pin and copy); `to` dequantizes them on the device."""
    dtype: torch.dtype | None = None
    """With scale: what aux and final become on `to`."""

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())

    def to(self, device, dtype: torch.dtype | None = None) -> "Batch":
        """On the device; from the CPU to CUDA through pinned memory without waiting (no host sync)."""
        f = (lambda t: None if t is None else h2d(t, device).to(dtype or t.dtype))
        g = (lambda t: None if t is None else h2d(t, device))
        if self.scale is not None:   # fp8 store: dequantized here, on the device (format.dequantize's arithmetic)
            s, to = g(self.scale), dtype or self.dtype
            aux = (g(self.aux).float().unflatten(-1, (3, -1)) * s[..., :3, None]).flatten(-2).to(to)  # (B, T, 3h)
            final = (g(self.final).float() * s[..., 3:]).to(to)                                      # (B, T, h)
        else:
            aux, final = f(self.aux), f(self.final)
        return Batch(self.ids, g(self.input_ids), g(self.loss_mask), g(self.valid), aux, final,
                     g(self.segment_ids), g(self.position_ids))


def h2d(x: Tensor, device) -> Tensor:
    """x on `device`. A CPU tensor goes to CUDA through pinned memory with non_blocking: a copy from pageable
    memory makes the host wait for everything queued on the stream, which starves the GPU between steps."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


# ------------------------------------------------------------------------------------------------ sources
class StoreSource:
    """Offline: a hidden-state store. Token tables are read from the shards without the hidden states."""

    def __init__(self, store, *, max_len: int, feature_dtype: torch.dtype = torch.float32):
        from safetensors import safe_open

        self.store, self.max_len, self.feature_dtype = store, max_len, feature_dtype
        self.ids: list[str] = list(store.ids)
        self._tokens: list[tuple[Tensor, Tensor]] = []
        for rec in store.records:
            with safe_open(str(Path(store.path) / rec["file"]), framework="pt") as f:
                off = f.get_tensor("offsets").tolist()
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            for j in range(len(off) - 1):
                self._tokens.append((ids[off[j]:off[j + 1]], mask[off[j]:off[j + 1]]))
        assert len(self._tokens) == len(self.ids)
        self.lengths = [min(len(t[0]), max_len) for t in self._tokens]
        self.where = str(store.path)

    def tokens(self, i: int) -> tuple[Tensor, Tensor]:
        ids, mask = self._tokens[i]
        return ids[: self.max_len], mask[: self.max_len]

    def collate(self, idx: list[int], pin: bool = False) -> Batch:
        """The samples `idx` as a right-padded Batch; pin: features in pinned memory (for a CUDA copy). An fp8
        store's features stay fp8, with their scales, until Batch.to dequantizes them on the device."""
        stored = [self.store.get_stored(i) for i in idx]
        b = _pad([self.ids[i] for i in idx], [(ids.long(), mask.bool()) for ids, mask, _, _ in stored], self.max_len)
        T, h = b.input_ids.shape[1], stored[0][2].shape[-1]
        fp8 = stored[0][3] is not None
        kind = stored[0][2].dtype if fp8 else self.feature_dtype
        # empty, then each row's states and a zeroed tail: the features are most of a batch's bytes, and zeroing
        # them all first would write every byte twice
        b.aux = torch.empty(len(idx), T, 3 * h, dtype=kind, pin_memory=pin)       # (B, T, 3h)
        b.final = torch.empty(len(idx), T, h, dtype=kind, pin_memory=pin)         # (B, T, h)
        if fp8:
            b.scale, b.dtype = torch.empty(len(idx), T, 4, pin_memory=pin), self.feature_dtype  # (B, T, 4)
        for r, (_, _, hidden, scale) in enumerate(stored):
            n = min(hidden.shape[0], self.max_len)
            b.aux[r, :n] = hidden[:n, :3].reshape(n, 3 * h)                  # (n, 3, h) -> (n, 3h) low|mid|high
            b.final[r, :n] = hidden[:n, 3]
            b.aux[r, n:] = 0
            b.final[r, n:] = 0
            if fp8:
                b.scale[r, :n] = scale[:n]
                b.scale[r, n:] = 0
        return b


class PreparedSource:
    """Online: prepared samples (ids + loss mask only); features come from the target at train time."""

    def __init__(self, data, *, max_len: int):
        self.data, self.max_len = data, max_len
        samples = [data[i] for i in range(len(data))]
        self.ids = [s.id for s in samples]
        self.lengths = [min(len(s.input_ids), max_len) for s in samples]
        self.where = str(getattr(data, "path", "prepared data"))
        # tensors once, not per step (a step's collate would otherwise convert ~30k Python ints); the Python
        # lists are not kept
        self._tokens = [(torch.tensor(s.input_ids[:max_len], dtype=torch.int64),
                         torch.tensor(s.loss_mask[:max_len], dtype=torch.bool)) for s in samples]

    def tokens(self, i: int) -> tuple[Tensor, Tensor]:
        return self._tokens[i]

    def collate(self, idx: list[int]) -> Batch:
        return _pad([self.ids[i] for i in idx], [self.tokens(i) for i in idx], self.max_len)


def _pad(ids: list[str], toks: list[tuple[Tensor, Tensor]], max_len: int) -> Batch:
    B, T = len(toks), max(min(len(t[0]), max_len) for t in toks)
    out = Batch(ids, torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool),
                torch.zeros(B, T, dtype=torch.bool))
    for r, (x, m) in enumerate(toks):
        n = min(len(x), max_len)
        out.input_ids[r, :n] = x[:n]
        out.loss_mask[r, :n] = m[:n].bool()
        out.valid[r, :n] = True
    return out


@torch.no_grad()
def target_features(target, batch: Batch, sub_tokens: int | None = None, lengths: list[int] | None = None) -> Batch:
    """Online: run the target's decoder stack on the batch; fill aux (B,T,3h) and final (B,T,h) in place.

    Forward pre-hooks on layers[i] give hidden_states[i] (the residual entering layer i); the decoder stack's
    last_hidden_state is the final-norm output. No lm_head call, so no (T, V) logits; nothing is stored.
    Rows are right-padded (collate's layout), so the forward runs with no attention mask, as capture does: causal
    attention alone keeps every real token from the padding after it (its states are the masked forward's), and
    SDPA takes its causal kernel instead of reading a dense mask. Padding positions hold zeros, as the store's
    collate gives them (the TTT loss never reads them), so that a batch the feature cache assembles is this one.
    With sub_tokens, rows run in length-sorted groups of at most that many padded tokens (each group cut to
    its own longest row), so short rows do not pay for the longest one. `lengths`: each row's valid count, when
    the caller knows it on the host (else it is read back from the device, a host sync).
    """
    base = decoder_stack(target.model)
    n = len(base.layers)
    dev = target.device
    lengths = batch.valid.sum(-1).tolist() if lengths is None else lengths
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    groups = group(order, lengths, sub_tokens) if sub_tokens else [list(range(len(lengths)))]
    B, T = batch.input_ids.shape
    for rows in groups:
        Tg = max(1, max(lengths[r] for r in rows)) if sub_tokens else T
        ri = h2d(torch.tensor(rows), batch.input_ids.device)
        with LayerInputs(base.layers, target.aux_layer_ids) as cap:
            final = base(input_ids=batch.input_ids[ri, :Tg].to(dev), use_cache=False).last_hidden_state  # (b, Tg, h)
        aux = torch.cat([final if i == n else cap.states[i] for i in target.aux_layer_ids], dim=-1)  # (b, Tg, 3h)
        pad = ~h2d(batch.valid[ri, :Tg], dev)[..., None]                       # (b, Tg, 1) the pad token's states
        aux.masked_fill_(pad, 0)
        final.masked_fill_(pad, 0)
        if not sub_tokens:
            batch.aux, batch.final = aux, final                                # (B, T, 3h) low|mid|high, (B, T, h)
            break
        if batch.aux is None:
            batch.aux = aux.new_zeros(B, T, aux.shape[-1])                     # (B, T, 3h)
            batch.final = final.new_zeros(B, T, final.shape[-1])               # (B, T, h)
        ri = h2d(ri, dev)
        batch.aux[ri, :Tg] = aux
        batch.final[ri, :Tg] = final
    return batch


def pack_rows(lengths: list[int], rows: int, row_len: int) -> list[list[int]] | None:
    """First-fit placement of samples (in order) into `rows` rows of `row_len` tokens: for each row the positions
    (into `lengths`) of its samples, or None when they do not fit."""
    out, free = [[] for _ in range(rows)], [row_len] * rows
    for j, n in enumerate(lengths):
        r = next((r for r in range(rows) if free[r] >= n), None)
        if r is None:
            return None
        out[r].append(j)
        free[r] -= n
    return out


def pack(batch: Batch, rows: int, row_len: int, lengths: list[int] | None = None) -> Batch:
    """A right-padded per-sample batch (features filled or not) -> `rows` packed rows of exactly `row_len` tokens,
    with segment and position ids. The placement is pack_rows' first fit, so it is a function of the batch.
    `lengths`: each sample's valid count when the caller knows it on the host (else read back: a host sync)."""
    lengths = batch.valid.sum(-1).tolist() if lengths is None else lengths
    plan = pack_rows(lengths, rows, row_len)
    if plan is None:
        raise ValueError(f"pack: samples of lengths {lengths} do not fit {rows} rows of {row_len} tokens")
    # one entry per sample, in placement order; then one per token by repeat_interleave (no per-token Python)
    order = [(r, s, j) for r, members in enumerate(plan) for s, j in enumerate(members, start=1)]
    n = torch.tensor([lengths[j] for _, _, j in order], dtype=torch.long)                 # (S,)
    at = torch.tensor([sum(lengths[i] for i in plan[r][:s - 1]) for r, s, _ in order], dtype=torch.long)
    rep = lambda v: torch.repeat_interleave(torch.tensor(v, dtype=torch.long), n)         # noqa: E731 (S,) -> (N,)
    pos = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)       # (N,) 0..n-1 per sample
    dev = batch.input_ids.device
    sb, st, db, dt, sg, ps = (h2d(x, dev) for x in (rep([j for *_, j in order]), pos, rep([r for r, *_ in order]),
                                                    torch.repeat_interleave(at, n) + pos, rep([s for _, s, _ in order]),
                                                    pos))

    def move(x: Tensor | None, fill=0) -> Tensor | None:
        if x is None:
            return None
        y = torch.full((rows, row_len, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)  # (R, L, ...)
        y[db, dt] = x[sb, st]
        return y
    out = Batch(batch.ids, move(batch.input_ids), move(batch.loss_mask, False), move(batch.valid, False),
                move(batch.aux), move(batch.final))
    out.segment_ids = torch.zeros(rows, row_len, dtype=torch.long, device=dev)            # (R, L)
    out.segment_ids[db, dt] = sg
    out.position_ids = torch.zeros(rows, row_len, dtype=torch.long, device=dev)           # (R, L)
    out.position_ids[db, dt] = ps
    return out


def nonfinite_flags(batch: Batch) -> Tensor:
    """(B,) bool on the features' device: rows whose aux or final hold NaN/Inf on valid positions (no host sync)."""
    bad = ~(torch.isfinite(batch.aux).all(-1) & torch.isfinite(batch.final).all(-1))  # (B, T)
    return (bad & batch.valid.to(bad.device)).any(-1)                                   # (B,)


def nonfinite_rows(batch: Batch) -> list[str]:
    """Ids of rows whose aux or final features hold NaN/Inf on valid positions."""
    return [batch.ids[r] for r in nonfinite_flags(batch).nonzero().flatten().tolist()]


# ----------------------------------------------------------------------------------------------- planning
def split_indices(source, fraction: float) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices in sample-id order (so a store and the prepared data it was captured from
    plan the same batches); samples shorter than 3 tokens (nothing to predict) are dropped. The eval scores each
    conversation once: of its sampled reply sets `#s1..#sN` only the first (greedy under prepare's greedy_sample, so
    the eval reads the texts a run with one greedy set reads); the others are in neither split."""
    train, ev = [], []
    for i, sid in enumerate(source.ids):
        if source.lengths[i] < 3:
            continue
        if not is_eval(sid, fraction):
            train.append(i)
        elif (sample_number(sid) or 1) == 1:
            ev.append(i)
    by_id = lambda i: source.ids[i]  # noqa: E731
    return sorted(train, key=by_id), sorted(ev, key=by_id)


def group(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Greedy micro-batches in the given order with rows * padded length <= batch_tokens."""
    out, cur, longest = [], [], 0
    for i in indices:
        n = lengths[i]
        if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def group_packed(indices: list[int], lengths: list[int], rows: int, row_len: int, lookahead: int = 16
                 ) -> list[list[int]]:
    """Micro-batches whose samples first-fit into `rows` rows of `row_len` tokens, in about the given order: a
    sample that does not fit waits (up to `lookahead` of them) while later ones fill the gaps."""
    fits = lambda b: pack_rows([lengths[j] for j in b], rows, row_len) is not None  # noqa: E731
    out, cur, waiting = [], [], []
    for i in indices:
        if lengths[i] > row_len:
            raise ValueError(f"group_packed: sample {i} has {lengths[i]} tokens, more than a row ({row_len})")
        if fits(cur + [i]):
            cur.append(i)
            continue
        waiting.append(i)
        while len(waiting) >= lookahead or (not cur and waiting):
            out.append(cur) if cur else None
            cur, pend, waiting = [], waiting, []
            for j in pend:
                (cur if fits(cur + [j]) else waiting).append(j)
    while cur or waiting:
        out.append(cur) if cur else None
        cur, pend, waiting = [], waiting, []
        for j in pend:
            (cur if fits(cur + [j]) else waiting).append(j)
    return out


def epoch_batches(indices: list[int], lengths: list[int], *, batch_tokens: int, seed: int, epoch: int,
                  bucket: int = 64, packed: tuple[int, int] | None = None) -> list[list[int]]:
    """The epoch's micro-batches: shuffle (seed, epoch), sort windows of `bucket` samples by length (less
    padding), group to the token budget, shuffle the batch order. Same on every rank. With packed=(rows,
    row_len), the shuffled samples are grouped by first fit into packed rows instead (no sorting needed)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = [indices[j] for j in torch.randperm(len(indices), generator=g).tolist()]
    if packed is not None:
        batches = group_packed(perm, lengths, *packed)
        return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
    ordered = []
    for s in range(0, len(perm), bucket):
        ordered += sorted(perm[s:s + bucket], key=lambda i: lengths[i])
    batches = group(ordered, lengths, batch_tokens)
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def rank_batches(batches: list[list[int]], *, rank: int, world_size: int, grad_accum: int) -> list[list[list[int]]]:
    """This rank's steps: step s uses global micro-batches s*W*A + a*W + rank, a < A. The tail is dropped."""
    per_step = world_size * grad_accum
    steps = len(batches) // per_step
    return [[batches[s * per_step + a * world_size + rank] for a in range(grad_accum)] for s in range(steps)]
