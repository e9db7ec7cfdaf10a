"""Per-request assembly of engine forward batches into verified samples (engine-agnostic, no GPU).

A forward batch holds the extend segments of several requests, packed in order. For each request
row: rid, extend length L (tokens computed now) and prefix length P (tokens before them that were
NOT computed in this forward). Chunked prefill gives one request several rows over several forwards
with P = tokens already seen; a prefix-cache hit gives P > tokens seen (states missing). Both are
told apart here, so chunked segments are joined and cache hits are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ATTEMPT_SEP = "#a"   # rid = f"{sample_id}#a{attempt}": a retry is a new request, the sample id stays
# rejections that no retry can fix (the client stops at the first one, engines/capture.py)
NO_AUX = "no aux hidden states reached the logits processor"
STORE_LOCKED = "store locked"
# Two-batch overlap: DeepSeek/Kimi run the layers from first_k_dense_replace on through model_forward_stages
# (SGLang deepseek_v2.py), which take no capture list; vLLM's extract_hidden_states asserts it is off.
OVERLAP_WHY = {
    "--enable-two-batch-overlap": "under it SGLang runs the layers from first_k_dense_replace on through "
                                  "model_forward_stages, which capture no aux hidden states",
    "--enable-dbo": "vLLM's extract_hidden_states does not implement dual-batch overlap (it asserts)",
}


def overlap_refusal(where: str, flag: str) -> str:
    """The one line that refuses a server running with a batch-overlap flag."""
    return f"{where} runs with {flag}: {OVERLAP_WHY[flag]}; restart it without {flag} (eyas engine launch-args " \
           f"never emits it)"


NO_IDS = "no token ids reached the logits processor (input_ids None and no forward_batch.input_ids)"


def sample_id_of(rid: str) -> str:
    return rid.split(ATTEMPT_SEP, 1)[0]


@dataclass
class Record:
    """One finished request: ok (states verified) or rejected (reason says why)."""
    rid: str
    sample_id: str
    ok: bool
    reason: str = ""
    kind: str = ""                          # rejected: a short countable reason ("wrong shape", ...)
    input_ids: torch.Tensor | None = None   # (T,) int64
    aux: torch.Tensor | None = None         # (T, 3, h)
    final: torch.Tensor | None = None       # (T, h)


@dataclass
class _Pending:
    ids: list = field(default_factory=list)
    aux: list = field(default_factory=list)
    final: list = field(default_factory=list)
    seen: int = 0


def check_states(sent_ids, ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                 num_aux: int = 3) -> tuple[str, str] | None:
    """None if the returned states fit the sent sample, else (kind, detail): kind is short and countable."""
    if ids.shape[0] != len(sent_ids):
        return "token count", f"token count {ids.shape[0]} != sent {len(sent_ids)}"
    diff = (ids.cpu().long() != torch.as_tensor(sent_ids, dtype=torch.long)).nonzero()
    if diff.numel():
        return "token ids differ", f"token ids differ from the sent ones first at position {int(diff[0])}"
    if aux.dim() != 3 or aux.shape[1] != num_aux:
        return "wrong shape", f"expected {num_aux} aux layers, got aux shape {tuple(aux.shape)}"
    if aux.shape[0] != ids.shape[0] or final.shape[0] != ids.shape[0] or final.shape[-1] != aux.shape[-1]:
        return "wrong shape", (f"state shapes aux {tuple(aux.shape)} final {tuple(final.shape)} do not match "
                               f"{ids.shape[0]} tokens")
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        return "non-finite", "non-finite values in the hidden states"
    return None


def verify_states(sample_id: str, sent_ids, ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                  num_aux: int = 3) -> str:
    """'' if the returned states fit the sent sample, else the reason (the client-side checks)."""
    bad = check_states(sent_ids, ids, aux, final, num_aux)
    return "" if bad is None else bad[1]


class Assembler:
    """Joins chunked segments per request, rejects prefix-cache hits, verifies against the sent samples.

    expected: sample_id -> sent token ids (list[int]). Requests whose sample id is unknown (the
    engine's warm-up, other users) are ignored and counted. A sample id finished once is never
    emitted ok again (`done`, seeded with the ids already committed to the store).
    """

    def __init__(self, expected: dict, *, num_aux: int = 3, done: set | None = None):
        self.expected, self.num_aux = expected, num_aux
        self.done: set[str] = set(done or ())
        self.pending: dict[str, _Pending] = {}
        self.rejected_rids: set[str] = set()
        self.ignored = 0

    def feed(self, rids, extend_lens, prefix_lens, input_ids: torch.Tensor, final: torch.Tensor,
             aux: torch.Tensor | None) -> list[Record]:
        """input_ids (N,), final (N, h), aux (N, 3, h) or None: rows packed in rid order. input_ids None (the
        engine gave no token ids) rejects every request of the batch."""
        out: list[Record] = []
        if input_ids is None:
            return [self._reject(r, NO_IDS) for r in rids if sample_id_of(r) in self.expected]
        if sum(extend_lens) != input_ids.shape[0] or final.shape[0] != input_ids.shape[0] \
                or (aux is not None and aux.shape[0] != input_ids.shape[0]):
            # padded or gathered tensors: cannot attribute rows to requests -> reject every request in it
            why = (f"batch rows do not add up: extend lens sum {sum(extend_lens)}, input_ids "
                   f"{input_ids.shape[0]}, final {final.shape[0]}, aux {None if aux is None else aux.shape[0]}")
            return [self._reject(r, why) for r in rids if sample_id_of(r) in self.expected]
        start = 0
        for rid, n, p in zip(rids, extend_lens, prefix_lens):
            sl = slice(start, start + n)
            start += n
            sid = sample_id_of(rid)
            if sid not in self.expected:
                self.ignored += 1
                continue
            if rid in self.rejected_rids:
                continue
            if sid in self.done:
                out.append(self._reject(rid, "sample already captured (duplicate request)", final=False))
                continue
            if aux is None:
                out.append(self._reject(rid, NO_AUX))
                continue
            st = self.pending.setdefault(rid, _Pending())
            if p != st.seen:
                why = (f"prefix-cache hit: {p} tokens not recomputed" if p > st.seen else
                       f"segment starts at {p} but {st.seen} tokens were already seen (out of order)")
                out.append(self._reject(rid, why))
                continue
            st.ids.append(input_ids[sl].cpu().long())
            st.aux.append(aux[sl].cpu())
            st.final.append(final[sl].cpu())
            st.seen += n
            want = len(self.expected[sid])
            if st.seen > want:
                out.append(self._reject(rid, f"{st.seen} tokens computed, the sample has {want}"))
            elif st.seen == want:
                out.append(self._finish(rid, sid))
        return out

    def _finish(self, rid: str, sid: str) -> Record:
        st = self.pending.pop(rid)
        ids, aux, final = torch.cat(st.ids), torch.cat(st.aux), torch.cat(st.final)
        why = verify_states(sid, self.expected[sid], ids, aux, final, self.num_aux)
        if why:
            return self._reject(rid, why)
        self.done.add(sid)
        return Record(rid, sid, True, input_ids=ids, aux=aux, final=final)

    def _reject(self, rid: str, reason: str, final: bool = True) -> Record:
        self.pending.pop(rid, None)
        if final:
            self.rejected_rids.add(rid)
        return Record(rid, sample_id_of(rid), False, reason)
