"""Training metrics: per-step TTT sums -> loss_k / acc_k / cond_acc_k / predicted chain acceptance, the
frequency baseline, and the sinks (RUN/metrics.jsonl, TensorBoard in RUN/tb, a tqdm bar on rank 0)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.errors import EyasError
from eyas.manifest import atomic_write_bytes
from eyas.train import dist
from eyas.train.ttt import first_argmax


class FiniteWatch:
    """NaN/Inf flags of training steps, kept on the device until check() reads them all back at once: steps that
    are not logged never wait for the device, and a bad value is still reported before anything is evaluated or
    saved."""

    def __init__(self):
        self._watched: list[tuple[int, str, list[str], Tensor]] = []   # (step, what, sample ids, flags)

    def watch(self, step: int, what: str, ids: list[str], flags: Tensor) -> None:
        """Flags of `what` at `step`: one per row of `ids` ("features"), or one for all of them."""
        if hasattr(flags, "full_tensor"):  # FSDP2's gradient norm is a DTensor
            flags = flags.full_tensor()
        self._watched.append((step, what, ids, flags.detach().reshape(-1)))

    def check(self) -> None:
        """Read back the NaN/Inf flags of the steps since the last check (one host sync); raise for the first bad
        one on any rank, naming its step and sample(s). Every rank calls it at the same steps."""
        watched, self._watched = self._watched, []
        if not watched:
            return
        bad = dist.max_over_ranks(torch.stack([f.any() for *_, f in watched]).float())     # (entries,)
        if not bool(bad.any()):
            return
        j = int(bad.nonzero()[0])
        step, what, ids, flags = watched[j]
        local = flags.tolist()
        if what == "features":
            names = [ids[r] for r, x in enumerate(local) if x]
        else:
            names = list(ids) if any(local) else []
        names = dist.gather_lists(names)
        raise EyasError(f"step {step}: NaN/Inf in {what}, sample(s) {', '.join(map(repr, names)) or '(another rank)'}")


class Sums:
    """Sums of TTT outputs over micro-batches (and ranks after all_reduce), as one flat float64 tensor."""

    def __init__(self, K: int, device):
        self.K = K
        # [n_micro, loss, tokens, base_count, base_correct, loss_k*K, lsum_k*K, count_k*K, correct_k*K,
        #  cond_count_k*K, cond_correct_k*K, round_tokens_j*K, round_forwards_j*K, the same two over first replies,
        #  alpha_sum_k*K, alpha_count_k*K (the positions of the micro-batches that measured alpha)]
        self.t = torch.zeros(5 + 12 * K, dtype=torch.float64, device=device)

    def add(self, out, tokens: int, baseline: tuple[Tensor, Tensor] | None = None,
            rounds: Tensor | None = None) -> None:
        """rounds: round_counts(...) of the same batch (eval only)."""
        K, t = self.K, self.t
        t[0] += 1
        t[1] += out.loss.detach().double()
        t[2] += tokens
        if baseline is not None:
            t[3] += baseline[0]
            t[4] += baseline[1]
        t[5:5 + K] += out.loss_k.double()
        t[5 + K:5 + 2 * K] += out.loss_k.double() * out.count_k
        for j, x in enumerate((out.count_k, out.correct_k, out.cond_count_k, out.cond_correct_k)):
            t[5 + (2 + j) * K:5 + (3 + j) * K] += x.double()
        if rounds is not None:
            t[5 + 6 * K:5 + 10 * K] += rounds.to(t)
        if out.alpha_k is not None:
            t[5 + 10 * K:5 + 11 * K] += out.alpha_k.double()
            t[5 + 11 * K:5 + 12 * K] += out.count_k.double()

    def all_reduce(self) -> "Sums":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.t)
        return self

    def summary(self, *, token_weighted: bool = False) -> dict:
        """loss / loss_k (mean over micro-batches, or token-weighted), acc_k, cond_acc_k, tau estimate, and alpha_k
        (mean alpha per step over the counted positions) when measured."""
        K = self.K
        v = self.t.cpu().tolist()
        n, loss, tokens = max(v[0], 1.0), v[1], v[2]
        sec = lambda j: v[5 + j * K:5 + (j + 1) * K]   # noqa: E731
        loss_k, lsum_k, count, correct, ccount, ccorrect, rtok, rfw, ftok, ffw, asum, acount = map(sec, range(12))
        acc = [c / max(m, 1.0) for c, m in zip(correct, count)]
        cond = [c / max(m, 1.0) for c, m in zip(ccorrect, ccount)]
        if token_weighted:
            loss_k = [s / max(m, 1.0) for s, m in zip(lsum_k, count)]
        else:
            loss_k = [x / n for x in loss_k]
        out = {"loss": loss / n, "loss_k": loss_k, "acc_k": acc, "cond_acc_k": cond,
               "tau_est": chain_acceptance(cond), "tokens": int(tokens), "positions_k": [int(c) for c in count],
               # a chain of j drafts can only use cond_acc_0..j-1: compare a chain-j bench with tau_est_by_chain[j-1]
               "tau_est_by_chain": [chain_acceptance(cond[:j]) for j in range(1, K + 1)]}
        if any(rfw):
            # what greedy decoding of these replies would measure: tokens per target forward with rounds starting
            # where the previous round ended (round_counts), for chains of 1..K drafts
            out["round_tau_by_chain"] = [a / max(b, 1.0) for a, b in zip(rtok, rfw)]
            # the same over each sample's first reply only: what `eyas bench` decodes (first turns), so the
            # number to hold a bench of the same prompt distribution against (later turns accept more)
            out["round_tau_first_by_chain"] = [a / max(b, 1.0) for a, b in zip(ftok, ffw)]
        if any(acount):
            # sum_v min(p_v, q_v): the chance that the target accepts a token sampled from the drafter (the LK losses'
            # quantity; the temperature-1 acceptance, where acc_k is the greedy one)
            out["alpha_k"] = [a / max(m, 1.0) for a, m in zip(asum, acount)]
        if v[3] > 0:
            out["baseline_acc_0"] = v[4] / v[3]
            out["baseline_positions"] = int(v[3])
        return out


def round_counts(accept_len: Tensor, loss_mask: Tensor, valid: Tensor, segment_ids: Tensor | None, K: int) -> Tensor:
    """Replay greedy chain decoding over the batch's replies: (4K,) float64 = [tokens per chain length j=1..K,
    target forwards per j, the same two over first replies only], to be summed over batches; tokens / forwards is
    the tau such decoding measures.

    Each maximal run [P, E) of loss-masked tokens within one sample is one reply decoded after the prompt x_<P:
    the prefill forward gives x_P; a round from position t (features up to t, last token x_{t+1}) accepts
    a = min(accept_len[t], j) drafts (ttt.TTTOutput.accept_len), adds the bonus token, and the next round starts
    at t + a + 1. Unlike the per-position average (chain_acceptance), rounds skip the positions inside accepted
    drafts, so easy stretches weigh as few rounds: this is the estimate to hold a bench against. A sample's first
    reply (its first run; a sample is a segment of a packed row, else the row) is also counted on its own: a bench
    decodes first turns.
    """
    B, T = loss_mask.shape
    live = (loss_mask.bool() & valid.bool()).tolist()
    seg = (segment_ids if segment_ids is not None else valid.long()).tolist()
    acc = accept_len.tolist()
    out = [0.0] * (4 * K)
    for b in range(B):
        lm, sg, ac = live[b], seg[b], acc[b]
        seen: set[int] = set()
        t = 0
        while t < T:
            if not lm[t] or t == 0:
                t += 1
                continue
            E = t
            while E < T and lm[E] and sg[E] == sg[t]:
                E += 1
            first = sg[t] not in seen
            seen.add(sg[t])
            for j in range(1, K + 1):
                pos, tokens, forwards = t - 1, 1, 1   # the prefill forward produced x_P
                while pos + 2 < E:                     # x_P .. x_{pos+1} are out; x_{pos+2} is next
                    a = min(ac[pos], j)
                    step = min(a + 1, E - (pos + 2))
                    tokens += step
                    forwards += 1
                    pos += a + 1
                out[j - 1] += tokens
                out[K + j - 1] += forwards
                if first:
                    out[2 * K + j - 1] += tokens
                    out[3 * K + j - 1] += forwards
            t = E
    return torch.tensor(out, dtype=torch.float64)


def chain_acceptance(cond_acc: list[float]) -> float:
    """Expected tokens per target forward for a chain of len(cond_acc) drafts: 1 + sum_k prod_{j<=k} cond_acc_j."""
    tau, p = 1.0, 1.0
    for a in cond_acc:
        p *= a
        tau += p
    return tau


@torch.no_grad()
def frequency_baseline(input_ids: Tensor, loss_mask: Tensor, valid: Tensor, final: Tensor, lm_head_weight: Tensor,
                       t2d: Tensor, top_id: int, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """(count, correct) of always predicting target id `top_id` on TTT step 0's counted positions.

    Step 0 at position t predicts x_{t+2} against the target's argmax at s = t+1; it counts iff valid[s-1..s+1],
    loss_mask[s+1] and argmax(target logits at s) is in the draft vocab (the same rule as eyas.train.ttt).
    """
    B, T = input_ids.shape
    tgt = torch.cat([first_argmax(F.linear(final[:, i:i + chunk].to(lm_head_weight.dtype), lm_head_weight))
                     for i in range(0, T, chunk)], dim=1)                     # (B, T) target argmax at s
    v, lm = valid.bool(), loss_mask.bool() & valid.bool()
    m = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    if T >= 3:
        m[:, 1:T - 1] = v[:, :T - 2] & v[:, 1:T - 1] & v[:, 2:] & lm[:, 2:] & t2d[tgt[:, 1:T - 1]]
    return m.sum(), (m & (tgt == top_id)).sum()


class MetricsSink:
    """metrics.jsonl + TensorBoard + tqdm. Only rank 0 writes; other ranks get a no-op sink."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int, progress: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = self.bar = None
        self.t0, self.tokens = time.perf_counter(), 0
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step or None)
        except ImportError:  # tensorboard is a dependency, but training must not die without it
            self.tb = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            split, step = record.get("split", "train"), record["step"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{split}/{k}", v, step)
                elif isinstance(v, list) and k in ("loss_k", "acc_k", "cond_acc_k", "alpha_k"):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{split}/{k[:-2]}_{i}", x, step)

    def step(self, n_tokens: int, postfix: dict | None) -> float:
        """Advance the bar; returns tokens/s since the sink was created. postfix None keeps the last one's values
        (steps that do not read their metrics back from the device)."""
        self.tokens += n_tokens
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.postfix = {**getattr(self, "postfix", {}), **(postfix or {})}
            self.bar.set_postfix({**self.postfix, "tok/s": f"{rate:,.0f}"}, refresh=False)
            self.bar.update(1)
        return rate

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def truncate_metrics(path: Path, step: int) -> None:
    """On resume: drop records logged after the checkpoint's step (the interrupted run's tail)."""
    if not path.exists():
        return

    keep = []
    for line in path.read_text().splitlines():
        try:
            if line.strip() and json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut by the kill
            continue
    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())
