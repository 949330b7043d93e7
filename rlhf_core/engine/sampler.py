"""Deterministic, resumable data order.

Every epoch is a permutation seeded by ``seed + epoch`` (independent of how many steps ran before),
padded like ``DistributedSampler`` to a multiple of the world size and sharded ``rank::world``.
Training consumes one endless stream of micro-batches across epochs; optimizer step ``k`` consumes
micro-batches ``[k * grad_accum, (k + 1) * grad_accum)``.  A run resumed at micro-batch ``m`` therefore
sees exactly the batches an uninterrupted run sees after ``m``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(n, generator=g)


@dataclass(frozen=True)
class StepPlan:
    """How many micro-batches and optimizer steps a run has."""

    n_examples: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    epochs: int
    max_steps: int = 0

    @property
    def per_rank(self) -> int:
        return math.ceil(self.n_examples / self.world_size)

    @property
    def micro_batches_per_epoch(self) -> int:
        return math.ceil(self.per_rank / self.micro_batch_size)

    @property
    def total_steps(self) -> int:
        full = math.ceil(self.epochs * self.micro_batches_per_epoch / self.grad_accum)
        return min(full, self.max_steps) if self.max_steps else full

    @property
    def total_micro_batches(self) -> int:
        return self.total_steps * self.grad_accum


class ResumableSampler:
    """Index batches for one rank, addressed by global micro-batch number."""

    def __init__(self, plan: StepPlan, seed: int, rank: int):
        self.plan, self.seed, self.rank = plan, seed, rank
        self._epoch, self._shard = -1, torch.empty(0, dtype=torch.long)

    def shard(self, epoch: int) -> torch.Tensor:
        """This rank's indices for ``epoch`` (DistributedSampler padding: wrap around to equal shards)."""
        if epoch != self._epoch:
            p = self.plan
            order = epoch_permutation(p.n_examples, self.seed, epoch)
            total = p.per_rank * p.world_size
            if total > p.n_examples:
                order = torch.cat([order, order[: total - p.n_examples]])
            self._epoch, self._shard = epoch, order[self.rank::p.world_size]
        return self._shard

    def position(self, micro: int) -> tuple[int, int]:
        """(epoch, micro-batch within epoch) of global micro-batch ``micro``."""
        return divmod(micro, self.plan.micro_batches_per_epoch)

    def batch(self, micro: int) -> torch.Tensor:
        epoch, i = self.position(micro)
        b = self.plan.micro_batch_size
        return self.shard(epoch)[i * b:(i + 1) * b]
