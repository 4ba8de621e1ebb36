"""How samples reach the ranks.

Training: every epoch is a seeded permutation of the training set, cut into *global* batches of
sum(per-rank batch sizes) samples; rank r takes its slice of each global batch. So one optimizer step across N
ranks sees exactly the samples one process would see with the combined batch, every sample is used once per epoch,
ranks may have different batch sizes (heterogeneous clusters), and a position (epoch, sample) is all resume needs:
counted in samples of the epoch's order, it means the same after a resume with another global batch.

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


class EpochOrder:
    """epoch_permutation(n, seed, epoch, shard_sizes), computed a piece at a time: `take(a, b)` is its [a:b].

    Without shard sizes it is the whole permutation (an in-memory dataset is O(n) anyway). With them, only the
    shard order is drawn up front; each shard's inner permutation is drawn when a position inside it is asked
    for, from the same random stream in the same order as epoch_permutation draws them, so the sample order is
    identical. Memory: the last two shards' permutations plus the generator's state at the start of each shard
    reached so far (to draw an earlier shard again without going back to the start), whatever n is."""

    def __init__(self, n: int, seed: int, epoch: int, shard_sizes: Optional[Sequence[int]] = None):
        rng = np.random.default_rng([seed, epoch])
        self.n = n
        if not shard_sizes:
            self.whole = rng.permutation(n)
            return
        self.whole = None
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        visit = rng.permutation(len(sizes))  # the shards in the order the epoch reads them
        self.first = np.concatenate([[0], np.cumsum(sizes)[:-1]])[visit]  # dataset index of each one's sample 0
        self.sizes = sizes[visit]
        self.ends = np.cumsum(self.sizes)  # epoch position just after each visited shard
        self.states = [rng.bit_generator.state]  # the generator before the i-th visited shard's permutation
        self.cache: dict[int, np.ndarray] = {}

    def shard(self, i: int) -> np.ndarray:
        """Dataset indices of the i-th visited shard, in this epoch's order."""
        if i not in self.cache:
            known = min(i, len(self.states) - 1)
            gen = np.random.Generator(np.random.PCG64())
            gen.bit_generator.state = self.states[known]
            for j in range(known, i + 1):
                perm = gen.permutation(self.sizes[j])  # earlier shards are drawn only to move the stream on
                if j + 1 == len(self.states):
                    self.states.append(gen.bit_generator.state)
            if len(self.cache) >= 2:
                self.cache.pop(next(iter(self.cache)))
            self.cache[i] = self.first[i] + perm
        return self.cache[i]

    def take(self, a: int, b: int) -> np.ndarray:
        if self.whole is not None:
            return self.whole[a:b]
        parts, i = [], int(np.searchsorted(self.ends, a, side="right"))
        while a < b:
            begin = self.ends[i] - self.sizes[i]
            parts.append(self.shard(i)[a - begin:min(b, self.ends[i]) - begin])
            a, i = min(b, int(self.ends[i])), i + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class GlobalBatchSampler:
    """Yields the index lists of one rank for one epoch, from a given batch position (for mid-epoch resume).
    Batches are made as they are consumed (epoch_batches), so a sampler over a dataset larger than memory (with
    shard_sizes) holds a few shards' worth of indices, not an epoch's."""

    def __init__(self, n: int, batch_sizes: Sequence[int], rank: int, seed: int,
                 shard_sizes: Optional[Sequence[int]] = None, lengths: Optional[Sequence[int]] = None,
                 drop_last: bool = False):
        self.n, self.batch_sizes, self.rank, self.seed = n, list(batch_sizes), rank, seed
        # lengths: anything indexable by an index array (a list is made an array once; lazy shard readers pass
        # their own object, see tasks/token_shards.py)
        self.shard_sizes, self.drop_last = shard_sizes, drop_last
        self.lengths = np.asarray(lengths) if isinstance(lengths, (list, tuple)) else lengths
        self.global_batch = sum(self.batch_sizes)
        if n < len(self.batch_sizes):
            raise ValueError(f"the training set has {n} samples, fewer than the {len(self.batch_sizes)} ranks")

    def batches_per_epoch(self) -> int:
        full, tail = divmod(self.n, self.global_batch)
        return full + (tail >= len(self.batch_sizes) and not self.drop_last)

    def epoch_batches(self, epoch: int, start: int = 0, start_sample: Optional[int] = None) -> "EpochBatches":
        """This rank's index lists of `epoch` from batch `start` on (or from position `start_sample` of the epoch's
        order), made one at a time as they are iterated."""
        return EpochBatches(self, epoch, start, start_sample)

    def rank_slice(self, global_batch: np.ndarray) -> np.ndarray:
        sizes = self.batch_sizes if len(global_batch) == self.global_batch else \
            split_proportional(len(global_batch), self.batch_sizes, minimum=1)
        start = sum(sizes[: self.rank])
        return global_batch[start:start + sizes[self.rank]]

    def batches(self, epoch: int, start: int = 0) -> list[list[int]]:
        return list(self.epoch_batches(epoch, start))


class EpochBatches:
    """One rank's batches of one epoch from batch `start` on: a sized iterable of index lists, which DataLoader
    takes as its batch_sampler. The epoch order is cut into global batches of sum(batch sizes) samples; a tail
    smaller than the number of ranks (or than a global batch, with drop_last) cannot give every rank a sample and
    is dropped. With lengths (group_by_length), samples are sorted by length inside windows of 50 global batches
    and the batches are then shuffled, each window sorted when one of its batches is asked for."""
    WINDOW = 50

    def __init__(self, sampler: GlobalBatchSampler, epoch: int, start: int, start_sample: Optional[int] = None):
        self.s, self.start, self.offset = sampler, start, 0
        self.order = EpochOrder(sampler.n, sampler.seed, epoch, sampler.shard_sizes)
        self.count = sampler.batches_per_epoch()
        g = sampler.global_batch
        if start_sample is not None and start_sample % g == 0:
            self.start = start_sample // g
        elif start_sample is not None:
            # A position that is not a whole number of global batches: resumed with another global batch. The rest
            # of the epoch is cut into global batches from there, so no sample is skipped or seen twice.
            if sampler.lengths is not None:
                raise ValueError("data.group_by_length: a run cannot resume mid-epoch with another global batch "
                                 "(its batches are made per window of global batches); resume with the global "
                                 f"batch it was saved with, which had reached sample {start_sample}")
            self.offset, self.start = start_sample, 0
            full, tail = divmod(sampler.n - start_sample, g)
            self.count = full + (tail >= len(sampler.batch_sizes) and not sampler.drop_last)
        self.end = min(self.offset + self.count * g, sampler.n)  # epoch positions the batches cover
        self.shuffle = None if sampler.lengths is None else \
            np.random.default_rng([sampler.seed, epoch, 1]).permutation(self.count)
        self.window: tuple[int, list] = (-1, [])

    def __len__(self) -> int:
        return max(0, self.count - self.start)

    def __iter__(self):
        for b in self.global_batches(self.start):
            yield self.s.rank_slice(b).tolist()

    def global_batches(self, start: int = 0):
        g = self.s.global_batch
        for k in range(start, self.count):
            if self.shuffle is None:
                yield self.order.take(self.offset + k * g, min(self.offset + (k + 1) * g, self.end))
            else:
                w, i = divmod(int(self.shuffle[k]), self.WINDOW)
                yield self.grouped(w)[i]

    def grouped(self, w: int) -> list[np.ndarray]:
        """The global batches of window w, its samples sorted by decreasing length (stable)."""
        if self.window[0] != w:
            g = self.s.global_batch
            a, b = w * self.WINDOW * g, min((w + 1) * self.WINDOW * g, self.end)
            flat = self.order.take(a, b)
            flat = flat[np.argsort(-np.asarray(self.s.lengths[flat]), kind="stable")]
            self.window = (w, np.split(flat, range(g, len(flat), g)))
        return self.window[1]


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
