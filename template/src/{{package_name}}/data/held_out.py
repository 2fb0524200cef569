"""Validation's data, which training never reads, and the checks that it holds what validation reads.

Generated data is held out as random streams of its own; token files and image folders as
`eval.path` or, without one, as the tail of `data.path` (`eval.fraction`), which training then
leaves out (held_out_tail). `data prepare` holds out a random share of the rows it reads and
writes them to val.bin, for `eval.path` (held_out_count, HeldOutRows). The batches validation
reads are loader.HeldOut's, which loader.build_held_out builds.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np

from ..config import DataConfig, EvalConfig, TrainConfig, UsageError, failed
from .order import Shuffle


def held_out_tail(eval: EvalConfig) -> float:
    """The share of data.path kept for validation: eval.fraction, unless eval.path holds the held-out data.

    Held out whether or not this run evaluates, so that turning validation on, or evaluating a
    checkpoint later (--eval-only), never scores data the model has trained on.
    """
    return 0.0 if eval.path else eval.fraction


def held_out_split(*, data: DataConfig, eval: EvalConfig) -> tuple[Path, float, bool]:
    """Where a file source's validation data is, as (path, tail, held_out): all of eval.path, (eval.path, 0,
    False); or without it the tail of data.path that training leaves out, (data.path, eval.fraction, True)."""
    return Path(eval.path or data.path), held_out_tail(eval), not eval.path


def held_out_errors(*, data: DataConfig, eval: EvalConfig, reads_files: bool, file_sources: str) -> list[str]:
    """What stops validation from holding out data of data.source (`reads_files`: it reads data.path; the
    sources that do, for the message): eval.path for generated data, which holds out random streams of its own;
    nothing held out of data.path; per-rank files without a held-out file."""
    errors = failed(
        (
            not (eval.path and not reads_files),
            f"eval.path is for data.source={file_sources}; {data.source} data holds out its own seed: remove eval.path",
        ),
    )
    if reads_files and eval.enabled and not eval.path:
        errors += failed(
            (
                eval.fraction != 0,
                "eval.fraction=0 holds nothing of data.path out for validation: set eval.path to held-out "
                "data, eval.fraction to a share such as 0.05, or eval.interval=0",
            ),
            (
                not (data.shard_by == "rank" and "{rank}" in data.path),
                "per-rank data files (data.path with {rank}) need one held-out file for every rank to "
                "evaluate: set eval.path, or eval.interval=0",
            ),
        )
    return errors


def check_held_out_tokens(*, data: DataConfig, train: TrainConfig, eval: EvalConfig) -> None:
    """Refuse a held-out token file (eval.path) shorter than one window of train.seq_len + 1 tokens."""
    path, window = Path(eval.path), train.seq_len + 1
    tokens = path.stat().st_size // np.dtype(data.dtype).itemsize if path.is_file() else window
    if tokens < window:
        raise UsageError(
            f"eval.path={path} holds {tokens} tokens, fewer than one window of train.seq_len + 1 = {window}: "
            f"prepare it again holding out more (data prepare --val-fraction, --seq-len {train.seq_len}), "
            "or set eval.interval = 0"
        )


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
