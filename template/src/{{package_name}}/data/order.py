"""The order in which token files and image folders are read: seeded, and reshuffled each epoch.

Looking a sample up costs the same at any position of any epoch, whatever the size of the data
(Shuffle: nothing is drawn or stored per window). A checkpoint records the order's name (ORDERS),
so the runs saved before Shuffle go on in their own (Randperm).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def seeded_generator(seed: int, index: int) -> torch.Generator:
    """Random stream `index` of a run seeded `seed`: Randperm's epochs, and each batch of generated data."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


_M64 = 2**64


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays: a bijective hash whose every output bit depends on every input bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Shuffle:
    """A seeded permutation of range(size), a different one per epoch, looked up at any position in O(1).

    Sample i of a run is item self(i) of epoch i // size. The permutation is a Feistel network on
    a grid of rows x cols >= size cells (both about sqrt(size)): a position is a (row, col) pair,
    and each round swaps the pair and adds a hash of one part (and of the seed, epoch and round)
    to the other, modulo its range, which is a bijection whatever the hash. Cycle walking keeps it
    one of range(size): a position that lands on one of the few cells past `size` (fewer than
    rows + cols) is permuted again. Nothing is drawn or stored per item: a lookup costs the same
    in a file of 10 M tokens as in one of 10 B.
    """

    ROUNDS = 6

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        rows = math.isqrt(size - 1) + 1  # ceil(sqrt(size))
        self.grid, self.keys = (rows, -(-size // rows)), {}

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(np.asarray(samples, dtype=np.int64), self.size)
        if epochs.min() == epochs.max():
            return self._walk(positions.astype(np.uint64), self._keys(int(epochs[0])))
        items = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():  # a batch that spans the end of an epoch
            here = epochs == epoch
            items[here] = self._walk(positions[here].astype(np.uint64), self._keys(epoch))
        return items

    def _keys(self, epoch: int) -> np.ndarray:
        """The round keys of an epoch: hashes of the seed, the epoch and the round (the last two epochs' kept)."""
        if epoch not in self.keys:
            base = _mix(np.array([epoch % _M64], dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
            base = _mix(base ^ np.uint64(self.seed % _M64))
            rounds = np.arange(1, self.ROUNDS + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
            self.keys = {e: k for e, k in self.keys.items() if e >= epoch - 1} | {epoch: _mix(base + rounds)}
        return self.keys[epoch]

    def _walk(self, positions: np.ndarray, keys: np.ndarray) -> np.ndarray:
        items = self._permute(positions, keys)
        outside = items >= self.size
        while outside.any():
            items[outside] = self._permute(items[outside], keys)
            outside = items >= self.size
        return items.astype(np.int64)

    def _permute(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        rows, cols = (np.uint64(n) for n in self.grid)
        left, right = x // cols, x % cols
        for key in keys:
            left, right = right, (left + _mix(right ^ key) % rows) % rows
            rows, cols = cols, rows
        return left * cols + right


class Randperm:
    """The order of runs saved before Shuffle: a torch.randperm of every item per epoch (O(items) per epoch).

    Only for resuming their checkpoints exactly (Loader.load_state_dict); each epoch's permutation
    is drawn once and kept while the epoch is read.
    """

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epochs = size, seed, {}

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(np.asarray(samples, dtype=np.int64), self.size)
        for epoch in set(epochs.tolist()) - self.epochs.keys():
            self.epochs = {e: p for e, p in self.epochs.items() if e >= epoch - 1}  # this epoch and the last
            self.epochs[epoch] = torch.randperm(self.size, generator=seeded_generator(self.seed, epoch)).numpy()
        return np.array([self.epochs[e][p] for e, p in zip(epochs.tolist(), positions.tolist(), strict=True)])


ORDERS = {"shuffle": Shuffle, "randperm": Randperm}
"""The orders a token file or image folder can be read in, by the name a checkpoint records (Loader.state_dict)."""
ORDER = "shuffle"
"""The order new runs read."""
UNRECORDED_ORDER = "randperm"
"""The order of the runs whose checkpoints record none: they were saved before Shuffle."""
