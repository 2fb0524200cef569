"""The data-source contract: what a source module declares so the rest of the repo needs no per-source code.

Each module in data/sources/ reads one kind of data and defines `SPEC = SourceSpec(...)`;
data/sources/__init__.py maps `data.source` to the module. From the spec, loader.py builds the
training batches (`build`) and validation's (`held_out`), data_path and check_data find and check
the files it reads (`reads`, `check`), and the rules between the source and the rest of the config
are checked (`inputs`, `rank_sharded`); step.py averages the loss over the scored targets alone
where some are not (`unscored_targets`).

A source is one of two kinds, which the loader reads alike at any world size:

- an IndexedSource (a file's windows, an image folder) reads any sample of any epoch in the order
  order.py gives it, and reads only the samples asked for: a rank reads its own share of each
  global batch;
- generated data draws each global batch from a random stream of its own (`batch(index, size)`;
  held-out batches from other streams, `generated_stream`), so every rank draws it and keeps its
  slice; it has no files to read.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..order import ORDERS, Randperm, Shuffle

Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE_INDEX = -100
"""A target that is not scored (a source with `unscored_targets`: sft's prompts and example starts): F.cross_entropy's
ignore_index."""
PREPARE = f"python -m {__package__.rpartition('.')[0]} prepare"
"""The command that writes token files (prepare.py), for the messages that point to it."""


def generated_stream(index: int, held_out: bool) -> int:
    """Generator index of batch `index` of generated data: training counts up from 0, held-out data down from -2
    (-1 draws the data's own structure), so the two splits never share a random stream."""
    return -2 - index if held_out else index


class IndexedSource:
    """Items (windows of a token file, images) read as samples in an order reshuffled per epoch.

    Sample i of the run is item order(i) of epoch i // len(self). A subclass sets self.seed and
    self.order and implements __len__ and take(first, count, shuffle).
    """

    seed: int
    order: Shuffle | Randperm
    mapped: tuple[str, ...] = ()
    """Attributes that hold a file's memory map (map_file), opened on first use."""

    def use_order(self, name: str) -> None:
        self.order = ORDERS[name](len(self), self.seed)

    def items(self, first: int, count: int, shuffle: bool = True) -> np.ndarray:
        """The items that samples first .. first + count - 1 read: shuffled per epoch, or in file order."""
        samples = np.arange(first, first + count)
        return self.order(samples) if shuffle else samples % len(self)

    def batch(self, index: int, size: int, shuffle: bool = True) -> Batch:
        """Global batch `index` of `size` samples (every rank's share of it)."""
        return self.take(index * size, size, shuffle)

    def __getstate__(self) -> dict:
        # A DataLoader worker started by spawn (macOS, Windows) gets a copy of the source: it maps the
        # files again there rather than receive their contents.
        return {k: None if k in self.mapped else v for k, v in self.__dict__.items()}


def map_file(path: Path, dtype, bounds: tuple[int, int]) -> np.ndarray:
    """Items bounds[0] .. bounds[1] - 1 of a file of `dtype` items, memory-mapped read-only.

    Windows are read at random places: MADV_RANDOM tells the kernel not to read ahead of each one
    (by default it reads 128 KiB or more around every page fault, which is most of the I/O of a
    file much larger than memory).
    """
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise"):  # not on Windows
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype)[slice(*bounds)]


def rank_path(data, rank: int) -> Path:
    """The file or folder rank `rank` reads: data.path, or its own with data.shard_by = "rank" and `{rank}` in it."""
    return Path(data.path.format(rank=rank) if data.shard_by == "rank" and "{rank}" in data.path else data.path)


@dataclass(frozen=True)
class SourceSpec:
    """Everything outside data/sources/ needs to know about one data source.

    The builders take the config's sections by keyword (`data`, `train`, `eval`, and `model`, the
    model's hyperparameters) and return an IndexedSource or generated data (the module docstring).
    """

    build: Callable[..., object]
    """This rank's training data, `build(*, data, train, eval, model, rank, world_size)`: all of it but what
    `held_out` reads (rank and world_size matter only to data.shard_by = "rank")."""
    held_out: Callable[..., object]
    """What validation reads, which `build` never returns: `held_out(*, data, train, eval, model)`."""
    inputs: Literal["tokens", "images"] = "tokens"
    """What a batch holds; it must be what the model takes (models/spec.py's ModelSpec.inputs)."""
    reads: str = ""
    """What data.path (and eval.path) name, for messages, e.g. "image folder (<class>/<image> files)"; "" for
    generated data, which reads no file and holds out random streams of its own."""
    check: Callable[..., None] | None = None
    """Launch-time checks of its settings and files, `check(*, data, train, eval, path)`: `path` is this rank's
    data.path, which exists, as does eval.path if set (None where it reads no file); it raises UsageError
    (config.UsageError) naming the setting and the fix."""
    unscored_targets: bool = False
    """Some targets may be IGNORE_INDEX: the loss is then the mean over the step's scored targets (step.py)."""
    rank_sharded: bool = False
    """It can be read with data.shard_by = "rank": each rank its own part, in order, once (its len: samples)."""
