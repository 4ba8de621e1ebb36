"""Epoch orders for the runs that need more than one permutation in memory, loaded by data_loader.py only for
them: a dataset stored in shards, read one file at a time (ShardOrder), and data.group_by_length (LengthGroups).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class ShardOrder:
    """The epoch's order of a dataset stored in consecutive shards: the shards in a random order, the samples in a
    random order inside each. `order[a:b]` is a piece of it.

    Only the shard order is drawn up front; each shard's inner permutation is drawn when a position inside it is
    asked for, from the same random stream in the same order as drawing them all at once would, so the sample
    order does not depend on what was asked first. Memory: the last two shards' permutations plus the generator's
    state at the start of each shard reached so far, whatever the dataset's size."""

    def __init__(self, rng: np.random.Generator, shard_sizes: Sequence[int]):
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

    def __getitem__(self, piece: slice) -> np.ndarray:
        a, b = piece.start, piece.stop
        parts, i = [], int(np.searchsorted(self.ends, a, side="right"))
        while a < b:
            begin = self.ends[i] - self.sizes[i]
            parts.append(self.shard(i)[a - begin:min(b, self.ends[i]) - begin])
            a, i = min(b, int(self.ends[i])), i + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class LengthGroups:
    """data.group_by_length: the epoch's global batches, made of samples sorted by decreasing length inside windows
    of WINDOW global batches, then shuffled; `groups[k]` is the k-th, its window sorted when first asked for."""
    WINDOW = 50

    def __init__(self, order, lengths, global_batch: int, end: int, count: int, seed: int, epoch: int):
        self.order, self.global_batch, self.end = order, global_batch, end
        # lengths: anything indexable by an index array (a list becomes an array once; lazy shard readers pass
        # their own object, see tasks/token_shards.py)
        self.lengths = np.asarray(lengths) if isinstance(lengths, (list, tuple)) else lengths
        self.shuffle = np.random.default_rng([seed, epoch, 1]).permutation(count)
        self.window: tuple[int, list] = (-1, [])

    def __getitem__(self, k: int) -> np.ndarray:
        w, i = divmod(int(self.shuffle[k]), self.WINDOW)
        if self.window[0] != w:
            a, b = w * self.WINDOW * self.global_batch, min((w + 1) * self.WINDOW * self.global_batch, self.end)
            flat = self.order[a:b]
            flat = flat[np.argsort(-np.asarray(self.lengths[flat]), kind="stable")]
            self.window = (w, np.split(flat, range(self.global_batch, len(flat), self.global_batch)))
        return self.window[1][i]
