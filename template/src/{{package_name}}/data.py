"""Batches that are the same at every world size, resumable from a position, read ahead of the step.

With `data.shard_by = "global"` (the default) each optimizer step reads one *global* batch,
identified by its index: rank r of N reads samples r * B / N to (r + 1) * B / N of it (B the
global batch size), only those, and splits them into micro-batches. The only state is the index
of the next global batch, which does not depend on the world size, so a checkpoint taken on 2
ranks resumes exactly on 1 or 4. The data repeats, reshuffled each epoch, so every rank always has
a batch and all ranks take the same number of steps (FSDP modules cannot `Join`).

Token files and image folders are read in a seeded order per epoch that costs the same to look up
at any position of any epoch, whatever the size of the data (Shuffle: nothing is drawn or stored
per window). Generated data draws each global batch from a random stream of its own, so there
every rank draws it and keeps its slice; it has no files to read.

Batches are built ahead of the step that needs them: by `data.workers` DataLoader processes, or
by a thread of the training process (`data.prefetch` batches ahead; Loader).

With `data.shard_by = "rank"` each rank reads its own part (a file per rank, `{rank}` in
`data.path`, or its slice of one file) in order, once: ranks may run out at different steps, and
`data.uneven_inputs` decides what happens then (see `agree_on_steps` and train.py).

Validation reads held-out data that training never reads (build_held_out): generated data from
random streams of its own, token files and image folders from `eval.path` or, without one, from
the tail of `data.path` (`eval.fraction`), which training then leaves out.

    python -m <package>.data prepare --dataset DIR_OR_FILES... --tokenizer DIR --out tokens.bin
    python -m <package>.data prepare --jsonl chats.jsonl --tokenizer DIR --out sft.bin

turn local text (a Hugging Face dataset directory, .parquet, .jsonl or .txt files, globs of
them; corpus.py streams it) and a tokenizer into a token file for `data.source = "memmap"`,
or chats into a token file and its mask of scored targets for `data.source = "sft"` (prepare_sft),
and a held-out share of their rows into val.bin beside it (for `eval.path`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import mmap
import os
import queue
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from .config import EXIT_USAGE, JOB_WIDE, Config, TrainConfig, UsageError
from .corpus import Outputs, default_processes, find_inputs, load_tokenizer, token_dtype, tokenize_corpus

logger = logging.getLogger(__name__)
Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE_INDEX = -100
"""A target that is not scored (data.source = "sft": prompts, example starts): F.cross_entropy's ignore_index."""
TOKEN_FILES = ("memmap", "sft")
"""Sources that read a token file from data.path (sft also its mask beside it, mask_path)."""
SEQ_LEN = TrainConfig.seq_len
"""train.seq_len's default (the debug config's): the window `data prepare --jsonl` holds out one of by default."""


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def _stream(index: int, held_out: bool) -> int:
    """Generator index of batch `index`: training counts up from 0, held-out data down from -2 (-1 draws
    the data's own structure), so the two splits never share a random stream."""
    return -2 - index if held_out else index


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
            self.epochs[epoch] = torch.randperm(self.size, generator=_generator(self.seed, epoch)).numpy()
        return np.array([self.epochs[e][p] for e, p in zip(epochs.tolist(), positions.tolist(), strict=True)])


ORDERS = {"shuffle": Shuffle, "randperm": Randperm}
"""The orders a token file or image folder can be read in, by the name a checkpoint records (Loader.state_dict)."""
ORDER = "shuffle"
"""The order new runs read."""
UNRECORDED_ORDER = "randperm"
"""The order of the runs whose checkpoints record none: they were saved before Shuffle."""


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


class SyntheticTokens:
    """A random Markov chain in which every token has `branching` possible successors.

    Learnable by construction: the loss starts near ln(vocab_size) and can fall to
    ln(branching), so a falling loss shows the model, optimizer and sharding all work.
    """

    def __init__(self, vocab_size: int, seq_len: int, branching: int, seed: int, held_out: bool = False):
        self.vocab_size, self.seq_len, self.seed, self.held_out = vocab_size, seq_len, seed, held_out
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=_generator(seed, -1))

    def batch(self, index: int, size: int) -> Batch:
        g = _generator(self.seed, _stream(index, self.held_out))
        tokens = torch.empty(size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (size,), generator=g)
        choices = torch.randint(self.successors.shape[1], (size, self.seq_len), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


class MemmapTokens(IndexedSource):
    """Windows of seq_len + 1 tokens from a flat token file, in a seeded order reshuffled per epoch.

    `tail` is the share at the end of the file held out for validation: training reads the rest,
    `held_out=True` reads only that tail. The file is memory-mapped on first use (in a DataLoader
    worker, by the worker).
    """

    def __init__(
        self, path: Path, dtype: str, seq_len: int, seed: int, part: tuple[int, int] | None = None,
        tail: float = 0.0, held_out: bool = False,
    ):  # fmt: skip
        if not path.is_file():
            raise UsageError(f"data.path={path}: no such token file (python -m {__package__}.data prepare writes one)")
        begin, end = _bounds(path.stat().st_size // np.dtype(dtype).itemsize, tail, held_out)
        if part is not None:  # this rank's contiguous slice of one shared file
            index, count = part
            begin, end = begin + index * (end - begin) // count, begin + (index + 1) * (end - begin) // count
        self.path, self.dtype, self.bounds, self._tokens = path, dtype, (begin, end), None
        self.seq_len, self.seed = seq_len, seed
        self.windows = (end - begin - 1) // seq_len
        if self.windows < 1:
            what = f"{path} (its held-out tail, eval.fraction={tail})" if held_out else str(path)
            raise UsageError(f"{what} holds {end - begin} tokens, fewer than one sequence of {seq_len + 1}")
        self.order = Shuffle(self.windows, seed)

    mapped = ("_tokens",)

    @property
    def tokens(self) -> np.ndarray:
        """The tokens this source reads from (its part of the file)."""
        if self._tokens is None:
            self._tokens = map_file(self.path, self.dtype, self.bounds)
        return self._tokens

    def __len__(self) -> int:
        return self.windows

    def start(self, sample: int, shuffle: bool = True) -> int:
        """Where sample `sample`'s window of seq_len + 1 tokens starts in self.tokens."""
        return int(self.items(sample, 1, shuffle)[0]) * self.seq_len

    def take(self, first: int, count: int, shuffle: bool = True) -> Batch:
        """(inputs, targets) of samples first .. first + count - 1: each window's tokens, and them shifted by one."""
        return self._windows(self.items(first, count, shuffle) * self.seq_len)

    def _windows(self, starts: np.ndarray) -> Batch:
        tokens = torch.from_numpy(np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]


def _bounds(length: int, tail: float, held_out: bool) -> tuple[int, int]:
    """Where the last `tail` share of `length` items begins and ends when `held_out`, else the rest."""
    cut = length - int(length * tail)
    return (cut, length) if held_out else (0, cut)


def mask_path(path: Path) -> Path:
    """The mask beside an sft token file (sft.bin -> sft.mask.bin): one uint8 per token, 1 where it is scored."""
    return path.with_name(f"{path.stem}.mask{path.suffix}")


class MaskedTokens(MemmapTokens):
    """data.source = "sft": windows of packed chats, whose unscored targets are IGNORE_INDEX.

    The mask (mask_path) marks token i when it is scored as the prediction made at token i - 1:
    the assistant turns, never an example's first token. So no scored target is predicted from
    another example's tokens; attention still sees the earlier examples of the window (no
    document mask: TROUBLESHOOTING.md).
    """

    def __init__(self, path: Path, dtype: str, seq_len: int, seed: int, tail: float = 0.0, held_out: bool = False):
        super().__init__(path, dtype, seq_len, seed, tail=tail, held_out=held_out)
        check_mask(path, dtype)
        self._mask = None

    mapped = ("_tokens", "_mask")

    @property
    def mask(self) -> np.ndarray:
        """1 where the token at the same place of self.tokens is scored."""
        if self._mask is None:
            self._mask = map_file(mask_path(self.path), np.uint8, self.bounds)
        return self._mask

    def _windows(self, starts: np.ndarray) -> Batch:
        inputs, targets = super()._windows(starts)
        scored = torch.from_numpy(np.stack([self.mask[s + 1 : s + self.seq_len + 1] for s in starts]) != 0)
        return inputs, targets.masked_fill(~scored, IGNORE_INDEX)


def check_mask(path: Path, dtype: str, key: str = "") -> None:
    """sft: refuse a token file (config key `key`) without its mask beside it, or with a mask of another length."""
    mask, name = mask_path(path), f"{key}={path}" if key else str(path)
    if not mask.is_file():
        raise UsageError(
            f"{name} has no mask {mask} beside it: python -m {__package__}.data prepare --jsonl writes both"
        )
    tokens, marks = path.stat().st_size // np.dtype(dtype).itemsize, mask.stat().st_size
    if marks != tokens:
        raise UsageError(
            f"{mask} marks {marks} tokens but {name} holds {tokens} {dtype} tokens: set data.dtype to the one "
            "data prepare printed, or prepare both files again"
        )


class SyntheticImages:
    """Images made of a class prototype plus noise: learnable, so the loss falls from ln(classes)."""

    def __init__(self, image_size: int, channels: int, num_classes: int, seed: int, held_out: bool = False):
        self.shape, self.num_classes, self.seed = (channels, image_size, image_size), num_classes, seed
        self.held_out = held_out
        self.prototypes = torch.randn(num_classes, *self.shape, generator=_generator(seed, -1))

    def batch(self, index: int, size: int) -> Batch:
        g = _generator(self.seed, _stream(index, self.held_out))
        labels = torch.randint(self.num_classes, (size,), generator=g)
        return self.prototypes[labels] + torch.randn(size, *self.shape, generator=g), labels


class ImageFolder(IndexedSource):
    """`<root>/<class>/<image>` files (anything Pillow reads), resized, in a seeded order per epoch.

    `tail` is the share of each class's files (the last in name order, but never all) held out for
    validation: training reads the rest, `held_out=True` reads only those. The file names are kept
    in one numpy array rather than a list of Path objects: DataLoader workers share it with the
    training process, where the reference counts of a million Python objects would be copied into
    every worker as they are touched.
    """

    def __init__(self, root: Path, image_size: int, channels: int, seed: int, tail: float = 0.0, held_out=False):
        files, labels = [], []
        for label, names in enumerate(_image_files(root).values()):
            cut = len(names) - min(math.ceil(len(names) * tail), len(names) - 1)
            chosen = names[cut:] if held_out else names[:cut]
            files += [os.fsencode(f) for f in chosen]
            labels += [label] * len(chosen)
        if not files:
            what = "no held-out files (raise eval.fraction or set eval.path)" if held_out else "none"
            raise UsageError(f"data.path={root}: expected <class>/<image> files, found {what}")
        self.files, self.labels = np.array(files, dtype=np.bytes_), np.array(labels, dtype=np.int64)
        self.image_size, self.mode, self.seed = image_size, {1: "L", 3: "RGB"}[channels], seed
        self.order = Shuffle(len(files), seed)

    @property
    def samples(self) -> list[tuple[Path, int]]:
        """(file, label) of every image, classes in name order and the files of each in name order."""
        return [(Path(os.fsdecode(f)), int(label)) for f, label in zip(self.files, self.labels, strict=True)]

    def load(self, sample: int, shuffle: bool = True) -> tuple[torch.Tensor, int]:
        """Sample `sample`'s image, resized to image_size and scaled to [-1, 1], and its label."""
        item = int(self.items(sample, 1, shuffle)[0])
        return self._decode(item), int(self.labels[item])

    def take(self, first: int, count: int, shuffle: bool = True) -> Batch:
        items = self.items(first, count, shuffle)
        return torch.stack([self._decode(item) for item in items]), torch.from_numpy(self.labels[items])

    def _decode(self, item: int) -> torch.Tensor:
        from PIL import Image  # only this source needs Pillow

        with Image.open(os.fsdecode(self.files[item])) as image:
            image = image.convert(self.mode).resize((self.image_size, self.image_size))
            pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)
        return pixels.unsqueeze(0) if pixels.ndim == 2 else pixels.permute(2, 0, 1)

    def __len__(self) -> int:
        return len(self.files)


def _image_files(root: Path) -> dict[str, list[Path]]:
    """Files of each class folder under `root`, classes and files in name order (labels follow the classes)."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return {c: sorted(f for f in (root / c).iterdir() if f.is_file()) for c in classes}


class Steps(Dataset):
    """Step index -> this rank's (inputs, targets) of that step, on the CPU.

    What a DataLoader worker or the prefetch thread runs. From an IndexedSource a rank reads only
    its own samples of each global batch; generated data is drawn whole (one random stream per
    batch) and sliced. Per-rank data (rank_sharded) is read in file order.
    """

    def __init__(self, source, rank: int, per_rank: int, global_batch_size: int, rank_sharded: bool):
        self.source, self.rank, self.per_rank, self.global_batch_size = source, rank, per_rank, global_batch_size
        self.rank_sharded = rank_sharded

    def __getitem__(self, step: int) -> Batch:
        if self.rank_sharded:
            return self.source.take(step * self.per_rank, self.per_rank, shuffle=False)
        first = self.rank * self.per_rank
        if isinstance(self.source, IndexedSource):
            return self.source.take(step * self.global_batch_size + first, self.per_rank)
        inputs, targets = self.source.batch(step, self.global_batch_size)
        return inputs[first : first + self.per_rank], targets[first : first + self.per_rank]


class Prefetch:
    """Builds the batches of `steps` in a thread, up to `depth` ahead of the loop that takes them (next()).

    The work is numpy and torch calls that release the GIL, so it overlaps the training step; an
    error in the thread is raised by the next() that would have returned its batch.
    """

    def __init__(self, read, steps: Iterable[int], depth: int, pin_memory: bool):
        self.ready: queue.Queue = queue.Queue(depth)
        self.stopped, self.ended = threading.Event(), False
        self.thread = threading.Thread(target=self._fill, args=(read, steps, pin_memory), daemon=True)
        self.thread.start()

    def _fill(self, read, steps: Iterable[int], pin_memory: bool) -> None:
        try:
            for step in steps:
                batch = read(step)
                if not self._put(tuple(t.pin_memory() for t in batch) if pin_memory else batch):
                    return
        except Exception as error:  # noqa: BLE001 - handed to the training loop, which raises it
            self._put(error)
            return
        self._put(None)

    def _put(self, item) -> bool:
        """Queue `item` unless close() was called first."""
        while not self.stopped.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        item = None if self.ended else self.ready.get()
        if isinstance(item, Exception):
            raise item
        if item is None:
            self.ended = True
            raise StopIteration
        return item

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()


class Loader:
    """This rank's micro-batches of each step, in order, built ahead of the step that takes them.

    `data.workers` DataLoader processes build them (each a whole step's batch, `data.prefetch`
    steps ahead each), or without workers a thread does (`data.prefetch` steps ahead; 0: the step
    builds its own). With `data.pin_memory` on an accelerator they are built in page-locked memory,
    so the copy to the device does not block. The position is that of the next step the loop
    takes, not of what was built ahead: a checkpoint resumes on the step after the last trained.
    """

    def __init__(
        self, source, cfg: Config, rank: int, world_size: int, device: torch.device, rank_sharded: bool | None = None
    ):
        t, d = cfg.train, cfg.data
        self.grad_accum_steps = grad_accum_steps(t.global_batch_size, t.micro_batch_size, world_size)
        self.source, self.device, self.rank = source, device, rank
        self.global_batch_size, self.micro_batch_size = t.global_batch_size, t.micro_batch_size
        self.per_rank = t.global_batch_size // world_size
        self.rank_sharded = cfg.data.shard_by == "rank" if rank_sharded is None else rank_sharded
        self.steps = Steps(source, rank, self.per_rank, t.global_batch_size, self.rank_sharded)
        self.workers, self.prefetch, self.seed = d.workers, d.prefetch, t.seed
        self.pin_memory = d.pin_memory and device.type in ("cuda", "xpu")
        self.position, self.order, self.ahead = 0, ORDER, None

    def local_steps(self) -> int | None:
        """Steps of data this rank has (None when the data repeats forever)."""
        return self.source.windows // self.per_rank if self.rank_sharded else None

    def next_batches(self) -> list[Batch]:
        """(inputs, targets) per micro-batch of the next step; StopIteration when per-rank data ran out."""
        if self.ahead is None:
            self.ahead = self._read_ahead()
        inputs, targets = next(self.ahead)
        self.position += 1
        return self._micro_batches(inputs, targets)

    def batches_at(self, step: int) -> list[Batch]:
        """The micro-batches of step `step`, built now; the position does not move (HeldOut reads this way)."""
        return self._micro_batches(*self.steps[step])

    def _micro_batches(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[Batch]:
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        return list(zip(inputs.split(self.micro_batch_size), targets.split(self.micro_batch_size), strict=True))

    def _read_ahead(self) -> Iterable[Batch]:
        steps = range(self.position, self.local_steps()) if self.rank_sharded else itertools.count(self.position)
        if self.workers:
            # Its own generator: the workers' seeds must not be drawn from the training RNG, which is checkpointed.
            return iter(DataLoader(
                self.steps, batch_size=None, sampler=steps, num_workers=self.workers, prefetch_factor=self.prefetch,
                pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(self.seed),
            ))  # fmt: skip
        if self.prefetch:
            return Prefetch(self.steps.__getitem__, steps, self.prefetch, self.pin_memory)
        return map(self.steps.__getitem__, steps)

    def close(self) -> None:
        """Stop building batches ahead (the thread, or the worker processes)."""
        if isinstance(self.ahead, Prefetch):
            self.ahead.close()
        self.ahead = None  # a DataLoader's iterator shuts its workers down when it is dropped

    def state_dict(self) -> dict:
        return {"position": self.position, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state`: its position, and the order its run read (ORDER unless it says otherwise)."""
        self.close()
        self.position, self.order = int(state["position"]), state.get("order", self.order)
        if self.order not in ORDERS:
            raise UsageError(
                f"the checkpoint's data was read in order {self.order!r}, which this version does not know "
                f"({', '.join(ORDERS)}): resume it with the version of the code that saved it"
            )
        if isinstance(self.source, IndexedSource):
            self.source.use_order(self.order)
            if self.order != ORDER:
                logger.info("the data goes on in the order its run read (%s), not %s: its checkpoint says so",
                            self.order, ORDER)  # fmt: skip


def grad_accum_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per step; the global batch must split evenly."""
    per_rank, rest = divmod(global_batch_size, world_size)
    if rest or per_rank % micro_batch_size:
        raise UsageError(
            f"train.global_batch_size={global_batch_size} does not split into {world_size} ranks x "
            f"micro-batches of train.micro_batch_size={micro_batch_size}; make it a multiple of "
            f"{world_size * micro_batch_size}"
        )
    return per_rank // micro_batch_size


def agree_on_steps(loader: Loader, steps: int, device: torch.device) -> int:
    """With per-rank data and `uneven_inputs = "min"`: the steps every rank can take (a MIN all-reduce)."""
    local = loader.local_steps()
    if local is None:
        return steps
    agreed = torch.tensor([local], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    common = int(agreed.item())
    if common < min(local, steps):
        logger.warning("rank data differs: this rank has %d steps, the shortest has %d", local, common)
    logger.info("per-rank data: every rank stops after step %d (data.uneven_inputs=min)", min(common, steps))
    return min(common, steps)


def data_path(cfg: Config, rank: int) -> Path | None:
    """The file or folder this rank reads (a file per rank when data.path has `{rank}`); None for generated data."""
    d = cfg.data
    if d.source not in (*TOKEN_FILES, "image_folder"):
        return None
    return Path(d.path.format(rank=rank) if d.shard_by == "rank" and "{rank}" in d.path else d.path)


def check_data(cfg: Config, rank: int, world_size: int) -> None:
    """Refuse, before the process group starts, a data path that does not exist or a batch that does not split."""
    grad_accum_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    path = data_path(cfg, rank)
    if path is None:
        return
    d = cfg.data
    if d.source in TOKEN_FILES:
        what = f"token file (python -m {__package__}.data prepare writes one)"
    else:
        what = "image folder (<class>/<image> files)"
    if not path.exists():
        raise UsageError(f"data.path={path}: no such {what}; point data.path at it")
    if d.source == "sft":
        check_mask(path, d.dtype, "data.path")
    e = cfg.eval
    if e.enabled and e.path:
        if not Path(e.path).exists():
            raise UsageError(f"eval.path={e.path}: no such held-out {what}; point eval.path at it")
        if d.source == "sft":
            check_mask(Path(e.path), d.dtype, "eval.path")
        if d.source in TOKEN_FILES:
            check_held_out_tokens(cfg)
        if d.source == "image_folder" and list(_image_files(Path(e.path))) != list(_image_files(path)):
            raise UsageError(
                f"eval.path={e.path} has classes {list(_image_files(Path(e.path)))}, data.path={path} has "
                f"{list(_image_files(path))}: the labels would not match; give both the same class folders"
            )
    elif e.enabled and d.source in TOKEN_FILES and path.is_file():
        tokens = path.stat().st_size // np.dtype(cfg.data.dtype).itemsize
        if int(tokens * e.fraction) < cfg.train.seq_len + 1:
            raise UsageError(
                f"eval.fraction={e.fraction} of data.path={path} ({tokens} tokens) holds out fewer than one sequence "
                f"of {cfg.train.seq_len + 1} tokens: raise eval.fraction, or set eval.path to a held-out token file"
            )


def check_held_out_tokens(cfg: Config) -> None:
    """Refuse a held-out token file (eval.path) shorter than one window of train.seq_len + 1 tokens."""
    path, window = Path(cfg.eval.path), cfg.train.seq_len + 1
    tokens = path.stat().st_size // np.dtype(cfg.data.dtype).itemsize if path.is_file() else window
    if tokens < window:
        raise UsageError(
            f"eval.path={path} holds {tokens} tokens, fewer than one window of train.seq_len + 1 = {window}: "
            f"prepare it again holding out more (data prepare --val-fraction, --seq-len {cfg.train.seq_len}), "
            "or set eval.interval = 0"
        )


def build_loader(cfg: Config, rank: int, world_size: int, device: torch.device) -> Loader:
    d, t, m = cfg.data, cfg.train, cfg.model
    path = data_path(cfg, rank)
    if d.source == "memmap":
        per_rank_file = d.shard_by == "rank" and "{rank}" in d.path
        part = (rank, world_size) if d.shard_by == "rank" and not per_rank_file else None
        source = MemmapTokens(path, d.dtype, t.seq_len, t.seed, part, tail=held_out_tail(cfg))
    elif d.source == "sft":
        source = MaskedTokens(path, d.dtype, t.seq_len, t.seed, tail=held_out_tail(cfg))
    elif d.source == "synthetic_images":
        source = SyntheticImages(m.image_size, m.channels, m.num_classes, t.seed)
    elif d.source == "image_folder":
        source = ImageFolder(path, m.image_size, m.channels, t.seed, tail=held_out_tail(cfg))
    else:
        source = SyntheticTokens(m.vocab_size, t.seq_len, d.synthetic_branching, t.seed)
    return Loader(source, cfg, rank, world_size, device)


def held_out_tail(cfg: Config) -> float:
    """The share of data.path kept for validation: eval.fraction, unless eval.path holds the held-out data.

    Held out whether or not this run evaluates, so that turning validation on, or evaluating a
    checkpoint later (--eval-only), never scores data the model has trained on.
    """
    return 0.0 if cfg.eval.path else cfg.eval.fraction


class HeldOut:
    """The validation batches: the first eval.batches global batches of the held-out data, every time.

    Each is a global batch, sliced per rank and split into micro-batches like the training
    batches, so every rank runs the same number of forward passes (FSDP's all-gathers are
    collectives) and the set of samples does not depend on the world size. It has a loader of
    its own: evaluating never moves the training data's position.
    """

    def __init__(self, loader: Loader, batches: int, interval: int):
        self.loader, self.batches, self.interval = loader, batches, interval

    def __iter__(self):
        for index in range(self.batches):
            yield self.loader.batches_at(index)

    def __len__(self) -> int:
        return self.batches

    def due(self, step: int, last: int) -> bool:
        """Evaluate after this step: every eval.interval steps and after the last."""
        return self.interval > 0 and (step % self.interval == 0 or step == last)


def build_held_out(cfg: Config, rank: int, world_size: int, device: torch.device) -> HeldOut | None:
    """The held-out batches validation reads (None when it is off): data that build_loader never returns."""
    d, t, m, e = cfg.data, cfg.train, cfg.model, cfg.eval
    if not e.enabled:
        return None
    root = Path(e.path or d.path)
    tail, held_out = held_out_tail(cfg), not e.path  # without eval.path: the tail that training leaves out
    if d.source == "memmap":
        source = MemmapTokens(root, d.dtype, t.seq_len, t.seed, tail=tail, held_out=held_out)
    elif d.source == "sft":
        source = MaskedTokens(root, d.dtype, t.seq_len, t.seed, tail=tail, held_out=held_out)
    elif d.source == "synthetic_images":
        source = SyntheticImages(m.image_size, m.channels, m.num_classes, t.seed, held_out=True)
    elif d.source == "image_folder":
        source = ImageFolder(root, m.image_size, m.channels, t.seed, tail=tail, held_out=held_out)
    else:
        source = SyntheticTokens(m.vocab_size, t.seq_len, d.synthetic_branching, t.seed, held_out=True)
    wanted = e.batches * t.global_batch_size
    if hasattr(source, "__len__") and len(source) < wanted:
        logger.warning(
            "eval.batches=%d x train.global_batch_size=%d = %d samples, but the held-out data has %d: some count "
            "more than once (hold out more data, or lower eval.batches)", e.batches, t.global_batch_size, wanted,
            len(source), extra=JOB_WIDE,
        )  # fmt: skip
    return HeldOut(Loader(source, cfg, rank, world_size, device, rank_sharded=False), e.batches, e.interval)


def held_out_count(rows: int, val_fraction: float) -> int:
    """How many of `rows` rows `data prepare` holds out: val_fraction of them, rounded up, leaving some to train on."""
    count = math.ceil(rows * val_fraction)
    if count >= rows:
        raise UsageError(
            f"--val-fraction {val_fraction} of {rows} rows leaves none to train on: add rows, lower --val-fraction, "
            "or pass 0 and set eval.interval = 0"
        )
    return count


class HeldOutRows:
    """The rows of a corpus that `data prepare` holds out: `count` of its `rows`, picked at random with `seed`.

    Those whose place in a Shuffle of the rows is among the first `count`: each row is decided on
    its own, by its index, before the corpus has been read.
    """

    def __init__(self, rows: int, count: int, seed: int):
        self.shuffle, self.count = Shuffle(rows, seed), count

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        return self.shuffle(indices) < self.count


def prepare(
    dataset: str | Path | Sequence[str | Path], tokenizer: Path, out: Path, text_column: str = "text",
    val_fraction: float = 0.01, seed: int = 0, processes: int = 1,
) -> int:  # fmt: skip
    """Tokenize local text (a Hugging Face dataset directory, .parquet, .jsonl or .txt files, directories or globs
    of them: corpus.find_inputs) into a flat token file, streamed by `processes` workers, and a held-out share of
    its rows (val_fraction of them, rounded up, picked at random with `seed`) into val.bin beside it; return the
    training token count. The rows keep their input order; nothing replaces an earlier output until all is written.
    """
    inputs = find_inputs([dataset] if isinstance(dataset, str | Path) else dataset, text_column)
    rows = sum(i.rows for i in inputs)
    count = held_out_count(rows, val_fraction)
    dtype = token_dtype(load_tokenizer(tokenizer))
    val = out.with_name("val.bin") if count else None
    with Outputs([out, val] if val else [out]) as outputs:
        counts = tokenize_corpus(inputs, tokenizer, text_column, outputs, out, val, HeldOutRows(rows, count, seed),
                                 processes)  # fmt: skip
        outputs.commit()
    for path, tokens in counts.items():
        print(f"wrote {tokens} {dtype.name} tokens to {path} (data.dtype = {dtype.name!r})")
    return counts[out]


ROW_FORMS = '{"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "response": ...}'
"""The rows of a JSONL file of chats that `data prepare --jsonl` reads."""


def read_chats(jsonl: Path) -> list[tuple[str, list[dict]]]:
    """(file:line, messages) for every row of a JSONL file of chats; a bad row is refused by its file:line.

    A row is {"messages": [{"role": ..., "content": ...}, ...]} (any roles the chat template knows,
    at least one "assistant"), or {"prompt": ..., "response": ...}: a user turn and the reply.
    """
    if not jsonl.is_file():
        raise UsageError(f"--jsonl {jsonl}: no such file")
    chats = []
    with jsonl.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            where = f"{jsonl}:{number}"
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                raise UsageError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
            chats.append((where, _messages(row, where)))
    if not chats:
        raise UsageError(f"--jsonl {jsonl}: no rows")
    return chats


def _messages(row, where: str) -> list[dict]:
    """A row's chat as a list of messages; UsageError naming the row when it is neither form."""
    if isinstance(row, dict) and "messages" not in row and {"prompt", "response"} <= row.keys():
        if isinstance(row["prompt"], str) and isinstance(row["response"], str):
            return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        got = f"keys {sorted(row)}" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
        raise UsageError(f"{where}: expected {ROW_FORMS} with strings for values, got {got}")
    for i, message in enumerate(messages, 1):
        if not (isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))):
            got = json.dumps(message)[:80]
            raise UsageError(f'{where}: message {i} needs a string "role" and "content", got {got}')
    if not any(message["role"] == "assistant" for message in messages):
        raise UsageError(f"{where}: no assistant message; SFT scores only the assistant's turns, so it teaches nothing")
    return messages


def encode_chat(tok, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """One chat's token ids, rendered with the tokenizer's own chat template, and its mask: 1 on the tokens
    of every assistant turn, 0 elsewhere and always on the first token.

    A turn's characters are what rendering the chat through it adds to rendering it up to the turn's
    generation prompt; a token is the turn's when it starts there (the tokenizer's offsets). So a turn
    is the reply, its end-of-turn marker and whatever the template writes after the marker (ChatML's
    newline after <|im_end|>): the rule needs no list of markers, and that newline always follows the
    marker, so it costs one near-certain target per reply and is never generated (decoding stops at
    the marker). README.md, "Fine-tuning on chats", says the same.
    """
    from jinja2 import TemplateError

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tok.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation_prompt)
        except (TemplateError, ValueError) as error:  # the template's raise_exception, or a Jinja error
            raise UsageError(f"{where}: the tokenizer's chat template refused this chat: {error}") from None

    text, spans = render(len(messages), False), []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before, through = render(i, True), render(i + 1, False)
            if not (through.startswith(before) and text.startswith(through)):
                raise UsageError(
                    f"{where}: the chat template renders message {i + 1} (assistant) differently once the chat goes "
                    "on (it rewrites earlier turns), so that turn's tokens cannot be found: use a chat template that "
                    "renders earlier turns as they are (TROUBLESHOOTING.md)"
                )
            spans.append((len(before), len(through)))
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    if len(mask) < 2 or not any(mask[1:]):
        raise UsageError(f"{where}: its assistant turns render to no tokens after the first; nothing would be scored")
    mask[0] = 0  # an example's first token would be predicted from the previous example's last
    return encoded["input_ids"], mask


def prepare_sft(
    jsonl: Path, tokenizer: Path, out: Path, val_fraction: float = 0.01, seed: int = 0, seq_len: int = SEQ_LEN
) -> int:
    """Render every chat of a JSONL file with the tokenizer's chat template and pack them, in file order,
    into a token file and its mask of scored targets (mask_path); a held-out share of the rows (picked at
    random with `seed`) goes to val.bin and its mask beside it, and must hold one window of `seq_len` + 1
    tokens (what validation reads). Return the training token count.

    Every row is read and checked before anything is written.
    """
    chats = read_chats(jsonl)  # before the tokenizer loads: a bad row is refused at once
    tok = load_tokenizer(tokenizer, extra="sft")
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"--tokenizer {tokenizer} has no chat template (chat_template in tokenizer_config.json)")
    if not tok.is_fast:
        raise UsageError(f"--tokenizer {tokenizer} is not a fast tokenizer (tokenizer.json): its offsets are needed")
    examples = [encode_chat(tok, messages, where) for where, messages in chats]
    held_out: set[int] = set()
    if val_fraction > 0:
        order = np.random.default_rng(seed).permutation(len(examples))
        check_held_out_window([len(examples[i][0]) for i in order], val_fraction, seq_len)
        held_out = set(order[: held_out_count(len(examples), val_fraction)].tolist())
    splits = {out: [e for i, e in enumerate(examples) if i not in held_out]}
    if held_out:
        splits[out.with_name("val.bin")] = [examples[i] for i in sorted(held_out)]
    dtype, written = token_dtype(tok), []
    with Outputs([p for path in splits for p in (path, mask_path(path))]) as outputs:
        for path, part in splits.items():
            ids, mask = [t for e in part for t in e[0]], [m for e in part for m in e[1]]
            outputs.write(path, np.asarray(ids, dtype=dtype))
            outputs.write(mask_path(path), np.asarray(mask, dtype=np.uint8))
            written.append(f"wrote {len(part)} chats, {len(ids)} {dtype.name} tokens ({sum(mask)} scored), to {path} "
                           f"and {mask_path(path)} (data.dtype = {dtype.name!r})")  # fmt: skip
        outputs.commit()
    print("\n".join(written))
    return sum(len(e[0]) for e in splits[out])


def check_held_out_window(lengths: list[int], val_fraction: float, seq_len: int) -> None:
    """Refuse held-out chats that hold fewer tokens than one window of seq_len + 1, which validation reads whole.

    `lengths` are the chats' token counts in the order they are held out: --val-fraction f holds out the
    first held_out_count(chats, f) of them, so the refusal can name the fraction of the fewest that hold enough.
    """
    window, rows = seq_len + 1, len(lengths)
    count = held_out_count(rows, val_fraction)
    if sum(lengths[:count]) >= window:
        return
    what = f"--val-fraction {val_fraction} holds out {count} of {rows} chats, {sum(lengths[:count])} tokens"
    need = f"fewer than one window of --seq-len {seq_len} + 1 = {window}, which validation reads"
    enough = next((k for k, total in enumerate(itertools.accumulate(lengths), 1) if total >= window), rows)
    fraction = math.ceil(1000 * enough / rows) / 1000
    if fraction < 1 and math.ceil(rows * fraction) < rows:
        count = held_out_count(rows, fraction)
        fix = f"pass --val-fraction {fraction:g} ({count} chats, {sum(lengths[:count])} tokens)"
    else:
        fix = f"the {rows} chats hold {sum(lengths)} tokens in all: add chats, or pass a lower --seq-len"
    raise UsageError(f"{what}, {need}: {fix}, or --val-fraction 0 and eval.path = a held-out file of your own")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Data tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize local text, or a JSONL of chats, into a token file")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--dataset", nargs="+", metavar="PATH", help="text for data.source = memmap: directories written by datasets' "
        "save_to_disk, .parquet files, .jsonl files (one JSON object per line), .txt files (one row per line), "
        "directories of such files, or globs of them, read in the order given",
    )  # fmt: skip
    source.add_argument(
        "--jsonl", type=Path, help='chats, one per line: {"messages": [...]} or {"prompt": ..., "response": ...} '
        "(for data.source = sft; writes the mask of scored tokens beside --out: each assistant turn as the chat "
        "template writes it, its end-of-turn marker and anything the template puts after the marker, such as "
        "ChatML's newline, included; never a system or user turn, a generation prompt or a chat's first token)",
    )  # fmt: skip
    p.add_argument("--tokenizer", type=Path, required=True, help="a local tokenizer directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--text-column", default="text", help="--dataset: the column holding the text")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of rows held out into val.bin beside --out")
    p.add_argument(
        "--seq-len", type=int, default=SEQ_LEN, help="--jsonl: train.seq_len of the config that trains on --out; "
        "val.bin must hold one window of it + 1 tokens (default: %(default)s, the debug config's)",
    )  # fmt: skip
    p.add_argument(
        "--processes", type=int, default=default_processes(), help="--dataset: processes that tokenize (default: "
        "every core this process may use)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.out.name == "val.bin" and args.val_fraction > 0:
        parser.error("--out val.bin is where the held-out rows go: name the training file otherwise")
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    if args.processes < 1:
        parser.error(f"--processes {args.processes} must be at least 1")
    if args.seq_len < 1:
        parser.error(f"--seq-len {args.seq_len} must be at least 1")
    try:
        if args.jsonl:
            prepare_sft(args.jsonl, args.tokenizer, args.out, args.val_fraction, seq_len=args.seq_len)
        else:
            prepare(
                args.dataset, args.tokenizer, args.out, args.text_column, args.val_fraction, processes=args.processes
            )
    except UsageError as error:  # one line, no traceback, exit 2 (as the trainer's refusals)
        print(f"{__package__}.data prepare: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


if __name__ == "__main__":
    main()
