"""The training loader: this rank's steps in order, from a data position that checkpoints save and restore.

A step is `grad_accum` micro-batches (lists of sample indices). The plan of an epoch is a pure function of
(seed, epoch, lengths) (data.epoch_batches, data.rank_batches), so the loader's whole state is where it stands:
(epoch, position within the epoch) and the tokens seen so far. `state_dict()` / `load_state_dict()` carry exactly
that, and a restored loader hands out the same steps as one that never stopped.
"""

from __future__ import annotations

from typing import Iterator

from eyas.train.data import epoch_batches, rank_batches


class TrainLoader:
    """This rank's training steps from the data position (epoch, pos).

    The trainer takes `next_batch()`, runs the step, then `advance()`; at `end_of_epoch` it moves on with
    `next_epoch()` (after its epoch-end eval, whose records name the epoch just finished)."""

    def __init__(self, indices: list[int], lengths: list[int], *, batch_tokens: int, seed: int, grad_accum: int,
                 rank: int = 0, world: int = 1, packed: tuple[int, int] | None = None):
        self.indices, self.lengths = indices, lengths
        self.batch_tokens, self.seed, self.grad_accum, self.packed = batch_tokens, seed, grad_accum, packed
        self.rank, self.world = rank, world
        # the step to run next is plan(epoch)[pos]; `seen` counts the tokens (valid, all ranks) of the steps run
        self.epoch, self.pos, self.seen = 0, 0, 0
        self._plan: tuple[int, list] = (-1, [])               # (epoch, plan(epoch)) of the last epoch asked
        self._step_tokens: tuple[int, list[int]] = (-1, [])   # (epoch, tokens of each of its steps)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        return epoch_batches(self.indices, self.lengths, batch_tokens=self.batch_tokens, seed=self.seed, epoch=epoch,
                             packed=self.packed)

    def rank_plan(self, epoch: int) -> list[list[list[int]]]:
        """This rank's steps of `epoch`, each a list of grad_accum micro-batches (sample indices). Made anew on
        each call (the prefetch thread's); plan() keeps the last epoch's."""
        return rank_batches(self._epoch_batches(epoch), rank=self.rank, world_size=self.world,
                            grad_accum=self.grad_accum)

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """rank_plan(epoch), kept for the next call with the same epoch."""
        if self._plan[0] != epoch:
            self._plan = (epoch, self.rank_plan(epoch))
        return self._plan[1]

    def tokens_of_step(self, epoch: int, pos: int) -> int:
        """Counted tokens (valid, all ranks) of step `pos` of `epoch`, from the plan: no host sync."""
        if self._step_tokens[0] != epoch:
            mb = self._epoch_batches(epoch)
            per_rank = [rank_batches(mb, rank=r, world_size=self.world, grad_accum=self.grad_accum)
                        for r in range(self.world)]
            self._step_tokens = (epoch, [sum(self.lengths[i] for p in per_rank for idx in p[s] for i in idx)
                                         for s in range(len(per_rank[0]))])
        return self._step_tokens[1][pos]

    def upcoming(self, epoch: int, pos: int, steps: int) -> Iterator[tuple[tuple[int, int], list[list[int]]]]:
        """((epoch, pos), micro-batches) of the next `steps` steps from data position (epoch, pos), in order; reads
        nothing of the loader's position (the prefetch thread walks it while the loop runs)."""
        plan = self.rank_plan(epoch)
        for _ in range(steps):
            if pos == len(plan):
                epoch, pos, plan = epoch + 1, 0, self.rank_plan(epoch + 1)
            yield (epoch, pos), plan[pos]
            pos += 1

    def next_batch(self) -> list[list[int]]:
        """The micro-batches of the step at the data position."""
        return self.plan(self.epoch)[self.pos]

    def advance(self) -> None:
        """The step at the data position has run: count its tokens and move past it (within the epoch)."""
        self.seen += self.tokens_of_step(self.epoch, self.pos)
        self.pos += 1

    @property
    def end_of_epoch(self) -> bool:
        return self.pos == len(self.plan(self.epoch))

    def next_epoch(self) -> None:
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """The data position and the tokens seen: plain ints, what a checkpoint's state.pt holds under "data"."""
        return {"epoch": self.epoch, "position": self.pos, "tokens_seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos, self.seen = state["epoch"], state["position"], state["tokens_seen"]
