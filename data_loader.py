"""How samples reach the ranks.

Training (in place of torch's DistributedSampler): every epoch is a seeded permutation cut into *global* batches of
sum(per-rank batch sizes) samples, and rank r takes its slice: N ranks see exactly what one process sees with the
combined batch, ranks may have different batch sizes, and a position counted in samples of the epoch's order is all
resume needs, whatever the global batch.
Evaluation: one contiguous piece of the split per rank, no padding, no duplicates: every sample counts once.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from core import data_order
from core.errors import ConfigError


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


class GlobalBatchSampler:
    """Makes the index lists of one rank for one epoch, from a given position (for mid-epoch resume): epoch_batches()
    returns them as an EpochBatches, which yields them. E.g. two
    ranks of 32: each global batch is 64 positions of the epoch's order, rank 0 takes the first 32, rank 1 the next
    32 (rank_slice); an epoch's shorter last batch is split in the same proportion (split_proportional).
    Batches are made as they are consumed (epoch_batches), so a sampler over a dataset larger than memory (with
    shard_sizes) holds a few shards' worth of indices, not an epoch's."""

    def __init__(self, n: int, batch_sizes: Sequence[int], rank: int, seed: int,
                 shard_sizes: Optional[Sequence[int]] = None, lengths: Optional[Sequence[int]] = None,
                 drop_last: bool = False):
        self.n, self.batch_sizes, self.rank, self.seed = n, list(batch_sizes), rank, seed
        self.shard_sizes, self.lengths, self.drop_last = shard_sizes, lengths, drop_last
        self.global_batch = sum(self.batch_sizes)
        if n < len(self.batch_sizes):
            # (a traceback from every rank, exit 1, was what a user saw: the run cannot start, and that is one line)
            raise ConfigError(f"the training set has {n} samples, fewer than the {len(self.batch_sizes)} "
                              "data-parallel ranks that each take a share of every batch; train on fewer ranks "
                              "(dist.procs_per_node, dist.nodes) or on more data")

    def batches_per_epoch(self, start_sample: int = 0) -> int:
        """Global batches of the epoch from position `start_sample` on (which tail counts: EpochBatches)."""
        full, tail = divmod(self.n - start_sample, self.global_batch)
        tail_is_a_batch = tail >= len(self.batch_sizes) and not self.drop_last  # every rank gets a sample of it
        return full + int(tail_is_a_batch)

    def epoch_batches(self, epoch: int, start_sample: int = 0) -> "EpochBatches":
        """This rank's index lists of `epoch` from position `start_sample` of the epoch's order on (where a resumed
        epoch continues), made one at a time as they are iterated."""
        return EpochBatches(self, epoch, start_sample)

    def check_position(self, start_sample: int, counted_in: int) -> None:
        """A resumed epoch's position `start_sample`, reached at `counted_in` samples per micro-step. group_by_length
        makes an epoch's batches (and their shuffle) per global batch, so a position reached at another one is not
        in this order, even where it divides by it (4 x 2 accumulation resuming 8 x 1): that epoch would repeat
        samples and skip others."""
        if self.lengths is None or counted_in == self.global_batch or not start_sample or \
                not self.batches_per_epoch(start_sample):
            return
        raise ConfigError(f"data.group_by_length: a run cannot resume mid-epoch with another number of samples per "
                          f"micro-step (its batches are made per window of them): the checkpoint reached sample "
                          f"{start_sample} of its epoch at {counted_in} samples per micro-step, this run takes "
                          f"{self.global_batch}; resume with per-rank batch sizes that sum to {counted_in} "
                          f"(train.grad_accum_steps may change), or from a checkpoint at an epoch's end")

    def rank_slice(self, global_batch: np.ndarray) -> np.ndarray:
        sizes = self.batch_sizes if len(global_batch) == self.global_batch else \
            split_proportional(len(global_batch), self.batch_sizes, minimum=1)
        start = sum(sizes[: self.rank])
        return global_batch[start:start + sizes[self.rank]]


class EpochBatches:
    """One rank's batches of one epoch from position `start_sample` of its order on: a sized iterable of index lists,
    which DataLoader takes as its batch_sampler. The epoch order (a seeded permutation) is cut into global batches of
    sum(batch sizes) samples from that position; a tail smaller than the number of ranks (or than a global batch,
    with drop_last) cannot give every rank a sample and is dropped. Sharded datasets and group_by_length:
    data_order.py."""

    def __init__(self, sampler: GlobalBatchSampler, epoch: int, start_sample: int = 0):
        self.sampler, self.start_sample = sampler, start_sample
        rng = np.random.default_rng([sampler.seed, epoch])
        if sampler.shard_sizes:
            self.order = data_order.ShardOrder(rng, sampler.shard_sizes)
        else:
            self.order = rng.permutation(sampler.n)
        g = sampler.global_batch
        self.count = sampler.batches_per_epoch(start_sample)  # global batches from start_sample on
        self.end = min(start_sample + self.count * g, sampler.n)  # epoch positions the batches cover
        self.groups = None
        if sampler.lengths is not None:
            # Length groups are made per window of global batches counted from the epoch's start: a resumed epoch
            # must continue at a whole number of them (a position reached with another global batch is not).
            if start_sample % g and self.count:
                raise ConfigError("data.group_by_length: a run cannot resume mid-epoch with another global batch "
                                  "(its batches are made per window of global batches); resume with the global "
                                  f"batch it was saved with, which had reached sample {start_sample}")
            whole = sampler.batches_per_epoch()
            self.groups = data_order.LengthGroups(self.order, sampler.lengths, g, min(whole * g, sampler.n), whole,
                                                  sampler.seed, epoch)

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        g, first = self.sampler.global_batch, self.start_sample // self.sampler.global_batch
        for k in range(self.count):
            batch = self.groups[first + k] if self.groups is not None else \
                self.order[self.start_sample + k * g:min(self.start_sample + (k + 1) * g, self.end)]
            yield self.sampler.rank_slice(batch).tolist()


def eval_shard(n: int, rank: int, world: int) -> range:
    """Contiguous, non-overlapping piece of an evaluation split for `rank` (sizes differ by at most one)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def make_loader(dataset: Dataset, batches: list[list[int]], collate: Callable, num_workers, pin_memory: bool,
                seed: int, keep_workers: bool = False) -> DataLoader:
    """A DataLoader over precomputed index lists. The generator keeps worker seeding off the global RNG, so
    loading data never changes the random stream that dropout uses (and resume stays bit-exact). `keep_workers`:
    its workers outlive an iteration (persistent_workers), and the next reads `batches` as refilled in place."""
    if num_workers == "auto":
        num_workers = auto_workers()
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=keep_workers and num_workers > 0,
                      generator=torch.Generator().manual_seed(seed))


# ---- The training stream's one loader, whose workers are kept from epoch to epoch (which samples: above) ---------
class TrainingLoader:
    """One DataLoader for every epoch of a training stream: its workers (data.num_workers) start once and are kept
    (persistent_workers). `epoch(e, batches)` is the loader to iterate over epoch e's index lists (an EpochBatches)."""

    def __init__(self, dataset: Dataset, collate: Callable, num_workers, pin_memory: bool, seed: int,
                 start_epoch: Callable):
        if num_workers == "auto":
            num_workers = auto_workers()
        # (its own object: were the loader to hold this one, the cycle would keep the workers until a gc.collect)
        self.current = CurrentEpochBatches()
        self.loader = DataLoader(EpochItems(dataset, start_epoch), batch_sampler=self.current, collate_fn=collate,
                                 num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0,
                                 generator=torch.Generator().manual_seed(seed))

    def epoch(self, epoch: int, batches: EpochBatches) -> DataLoader:
        self.current.epoch, self.current.batches = epoch, batches  # what the loader's next `for` reads
        return self.loader


class CurrentEpochBatches:
    """The batch_sampler of a TrainingLoader: the current epoch's EpochBatches, each index sent as (epoch, index) so
    that workers kept from the last epoch know the new one."""

    def __init__(self):
        self.epoch, self.batches = 0, []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        epoch = self.epoch
        for batch in self.batches:
            yield [(epoch, i) for i in batch]


class EpochItems(Dataset):
    """`dataset` read by (epoch, index). A worker's copy of it missed the main process's start_epoch (it was made
    when the worker started, epochs ago): a worker starts each new epoch on its copy itself."""

    def __init__(self, dataset: Dataset, start_epoch: Callable):
        self.dataset, self.start_epoch, self.epoch = dataset, start_epoch, None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple):
        epoch, i = key
        if epoch != self.epoch and get_worker_info() is not None:  # (in the main process the Trainer did it)
            self.start_epoch(self.dataset, epoch)
        self.epoch = epoch
        return self.dataset[i]


def auto_workers() -> int:
    """data.num_workers: auto: this rank's share of the cores (distributed.share_cores set its threads to it) less
    one for the training step, at least 1 (decoding never runs inside the step), at most 8."""
    return max(1, min(8, torch.get_num_threads() - 1))


def eval_shard_batches(n: int, rank: int, world: int, batch_size: int) -> list[list[int]]:
    """`rank`'s piece of an evaluation split of `n` (eval_shard), cut into batches of positions."""
    shard = eval_shard(n, rank, world)
    return [list(shard[i:i + batch_size]) for i in range(0, len(shard), batch_size)]
