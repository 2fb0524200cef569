"""data.source = "memmap": windows of train.seq_len + 1 tokens from a flat token file (data.path, data.dtype).

`python -m <package>.data prepare --dataset` writes one from local text (and its held-out rows to
val.bin, for eval.path); any flat file of uint16 or uint32 token ids will do. Validation reads
eval.path, or the last eval.fraction of the file, which training then leaves out. The one source
that data.shard_by = "rank" reads: a file per rank (`{rank}` in data.path), or a rank's slice of one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...config import DataConfig, EvalConfig, TrainConfig, UsageError
from ..held_out import check_held_out_tokens, held_out_split, held_out_tail
from ..order import Shuffle
from .spec import PREPARE, Batch, IndexedSource, SourceSpec, map_file, rank_path

TOKEN_FILE = f"token file ({PREPARE} writes one)"
"""What data.path names (SourceSpec.reads), for the messages."""


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
            raise UsageError(f"data.path={path}: no such {TOKEN_FILE}")
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


def token_windows(
    *, data: DataConfig, train: TrainConfig, eval: EvalConfig, rank: int, world_size: int, **_
) -> MemmapTokens:
    """This rank's training windows: the file less its held-out tail, all of it to every rank, or with
    data.shard_by = "rank" the rank's own file (`{rank}` in data.path) or its slice of the one file."""
    per_rank_file = data.shard_by == "rank" and "{rank}" in data.path
    part = (rank, world_size) if data.shard_by == "rank" and not per_rank_file else None
    return MemmapTokens(rank_path(data, rank), data.dtype, train.seq_len, train.seed, part, tail=held_out_tail(eval))


def held_out_windows(*, data: DataConfig, train: TrainConfig, eval: EvalConfig, **_) -> MemmapTokens:
    """Validation's windows: eval.path's, or those of the tail of data.path that training leaves out."""
    path, tail, held_out = held_out_split(data=data, eval=eval)
    return MemmapTokens(path, data.dtype, train.seq_len, train.seed, tail=tail, held_out=held_out)


def check_token_file(*, data: DataConfig, train: TrainConfig, eval: EvalConfig, path: Path) -> None:
    """Refuse held-out data shorter than one window: eval.path's, or the tail of data.path eval.fraction keeps."""
    if not eval.enabled:
        return
    if eval.path:
        check_held_out_tokens(data=data, train=train, eval=eval)
    elif path.is_file():
        tokens = path.stat().st_size // np.dtype(data.dtype).itemsize
        if int(tokens * eval.fraction) < train.seq_len + 1:
            raise UsageError(
                f"eval.fraction={eval.fraction} of data.path={path} ({tokens} tokens) holds out fewer than one "
                f"sequence of {train.seq_len + 1} tokens: raise eval.fraction, or set eval.path to a held-out "
                "token file"
            )


SPEC = SourceSpec(
    build=token_windows,
    held_out=held_out_windows,
    reads=TOKEN_FILE,
    check=check_token_file,
    rank_sharded=True,
)
