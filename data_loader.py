"""How samples reach the ranks.

Training: every epoch is a seeded permutation of the training set, cut into *global* batches of
sum(per-rank batch sizes) samples; rank r takes its slice of each global batch. So one optimizer step across N
ranks sees exactly the samples one process would see with the combined batch, every sample is used once per epoch,
ranks may have different batch sizes (heterogeneous clusters), and a position (epoch, batch) is all resume needs.

Evaluation: the split is cut into one contiguous piece per rank, with no padding and no duplicates, so metrics
computed from the gathered pieces count every sample exactly once.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def split_proportional(total: int, weights: Sequence[float], minimum: int = 0) -> list[int]:
    """Split `total` into integers proportional to `weights` (largest remainder), each at least `minimum`."""
    weights = np.asarray(weights, dtype=np.float64)
    exact = total * weights / weights.sum()
    parts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - parts), kind="stable")[: total - parts.sum()]:
        parts[i] += 1
    for i in range(len(parts)):  # lift parts below the minimum, taking from the largest
        while parts[i] < minimum:
            j = int(np.argmax(parts))
            if parts[j] <= minimum:
                raise ValueError(f"cannot split {total} into {len(parts)} parts of at least {minimum}")
            parts[j] -= 1
            parts[i] += 1
    return [int(p) for p in parts]


def epoch_permutation(n: int, seed: int, epoch: int, shard_sizes: Optional[Sequence[int]] = None) -> np.ndarray:
    """The sample order of one epoch. With `shard_sizes` (samples stored in consecutive files), the order of the
    shards is shuffled and samples are shuffled inside each shard, so a rank reads one file at a time."""
    rng = np.random.default_rng([seed, epoch])
    if not shard_sizes:
        return rng.permutation(n)
    starts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]])
    return np.concatenate([starts[s] + rng.permutation(shard_sizes[s]) for s in rng.permutation(len(shard_sizes))])


class GlobalBatchSampler:
    """Yields the index lists of one rank for one epoch, from a given batch position (for mid-epoch resume)."""

    def __init__(self, n: int, batch_sizes: Sequence[int], rank: int, seed: int,
                 shard_sizes: Optional[Sequence[int]] = None, lengths: Optional[Sequence[int]] = None,
                 drop_last: bool = False):
        self.n, self.batch_sizes, self.rank, self.seed = n, list(batch_sizes), rank, seed
        self.shard_sizes, self.lengths, self.drop_last = shard_sizes, lengths, drop_last
        self.global_batch = sum(self.batch_sizes)
        if n < len(self.batch_sizes):
            raise ValueError(f"the training set has {n} samples, fewer than the {len(self.batch_sizes)} ranks")

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        order = epoch_permutation(self.n, self.seed, epoch, self.shard_sizes)
        g = self.global_batch
        cuts = list(range(0, self.n, g))
        batches = [order[c:c + g] for c in cuts]
        if len(batches[-1]) < (g if self.drop_last else len(self.batch_sizes)):
            batches.pop()  # a tail smaller than the number of ranks cannot give every rank a sample: dropped
        if self.lengths is not None:  # group similar lengths: sort inside windows of 50 global batches
            lengths = np.asarray(self.lengths)
            grouped = []
            for w in range(0, len(batches), 50):
                flat = np.concatenate(batches[w:w + 50])
                flat = flat[np.argsort(-lengths[flat], kind="stable")]
                sizes = [len(b) for b in batches[w:w + 50]]
                grouped += np.split(flat, np.cumsum(sizes)[:-1])
            rng = np.random.default_rng([self.seed, epoch, 1])
            batches = [grouped[i] for i in rng.permutation(len(grouped))]
        return batches

    def rank_slice(self, global_batch: np.ndarray) -> np.ndarray:
        sizes = self.batch_sizes if len(global_batch) == self.global_batch else \
            split_proportional(len(global_batch), self.batch_sizes, minimum=1)
        start = sum(sizes[: self.rank])
        return global_batch[start:start + sizes[self.rank]]

    def batches(self, epoch: int, start: int = 0) -> list[list[int]]:
        return [self.rank_slice(b).tolist() for b in self.global_batches(epoch)[start:]]

    def batches_per_epoch(self) -> int:
        full, tail = divmod(self.n, self.global_batch)
        return full + (tail >= len(self.batch_sizes) and not self.drop_last)


def eval_shard(n: int, rank: int, world: int) -> range:
    """Contiguous, non-overlapping piece of an evaluation split for `rank` (sizes differ by at most one)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def make_loader(dataset: Dataset, batches: list[list[int]], collate: Callable, num_workers: int, pin: bool,
                seed: int) -> DataLoader:
    """A DataLoader over precomputed index lists. The generator keeps worker seeding off the global RNG, so
    loading data never changes the random stream that dropout uses (and resume stays bit-exact)."""
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=num_workers,
                      pin_memory=pin, generator=torch.Generator().manual_seed(seed),
                      persistent_workers=False)


def eval_batches(n: int, rank: int, world: int, batch_size: int) -> list[list[int]]:
    shard = eval_shard(n, rank, world)
    return [list(shard[i:i + batch_size]) for i in range(0, len(shard), batch_size)]
