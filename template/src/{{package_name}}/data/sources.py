"""Where samples come from: token files, chats, image folders, or data generated from a seed.

A file source (IndexedSource) reads any sample of any epoch in the order order.py gives it, and
reads only the samples asked for: a rank reads its own share of each global batch. Generated data
draws each global batch from a random stream of its own, so there every rank draws it and keeps
its slice; it has no files to read.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch

from ..config import UsageError
from .order import ORDERS, Randperm, Shuffle, seeded_generator

Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE_INDEX = -100
"""A target that is not scored (data.source = "sft": prompts, example starts): F.cross_entropy's ignore_index."""
TOKEN_FILES = ("memmap", "sft")
"""Sources that read a token file from data.path (sft also its mask beside it, mask_path)."""


def _stream(index: int, held_out: bool) -> int:
    """Generator index of batch `index`: training counts up from 0, held-out data down from -2 (-1 draws
    the data's own structure), so the two splits never share a random stream."""
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


class SyntheticTokens:
    """A random Markov chain in which every token has `branching` possible successors.

    Learnable by construction: the loss starts near ln(vocab_size) and can fall to
    ln(branching), so a falling loss shows the model, optimizer and sharding all work.
    """

    def __init__(self, vocab_size: int, seq_len: int, branching: int, seed: int, held_out: bool = False):
        self.vocab_size, self.seq_len, self.seed, self.held_out = vocab_size, seq_len, seed, held_out
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=seeded_generator(seed, -1))

    def batch(self, index: int, size: int) -> Batch:
        g = seeded_generator(self.seed, _stream(index, self.held_out))
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
            raise UsageError(f"data.path={path}: no such token file (python -m {__package__} prepare writes one)")
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
        raise UsageError(f"{name} has no mask {mask} beside it: python -m {__package__} prepare --jsonl writes both")
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
        self.prototypes = torch.randn(num_classes, *self.shape, generator=seeded_generator(seed, -1))

    def batch(self, index: int, size: int) -> Batch:
        g = seeded_generator(self.seed, _stream(index, self.held_out))
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
        for label, names in enumerate(image_files(root).values()):
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


def image_files(root: Path) -> dict[str, list[Path]]:
    """Files of each class folder under `root`, classes and files in name order (labels follow the classes)."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return {c: sorted(f for f in (root / c).iterdir() if f.is_file()) for c in classes}
