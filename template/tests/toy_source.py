"""A data source this repo has never seen, for tests/test_source_contract.py: arithmetic progressions, padded.

The test copies it into src/<package>/data/sources/toy.py (hence the relative imports) and adds one
line to the registry. It differs from the built-in sources on purpose: its samples are read by
index, in order.py's shuffled order, like a token file's windows, but come from no file; and a
different share of each sample's targets is unscored (its padding), so the loss is the mean over
the scored targets only if the trainer asks the source whether some are not.
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import UsageError
from ..order import Shuffle
from .spec import IGNORE_INDEX, Batch, IndexedSource, SourceSpec

ITEMS = 512
"""Progressions in all; the last eval.fraction of them are held out for validation."""
PAD = 0


def progression(item: int, vocab_size: int, seq_len: int) -> tuple[np.ndarray, int]:
    """Item `item`'s seq_len + 1 tokens, and how many of them are the progression: a, a + d, a + 2d, ... modulo
    the vocabulary (a = item % vocab_size, d = 1 + item // vocab_size), then PAD. Its length is between half
    the window and the whole of it."""
    start, step = item % vocab_size, 1 + item // vocab_size
    length = seq_len // 2 + 1 + item % (seq_len // 2 + 1)
    tokens = np.full(seq_len + 1, PAD, dtype=np.int64)
    tokens[:length] = (start + step * np.arange(length)) % vocab_size
    return tokens, length


class Progressions(IndexedSource):
    """Items first .. last - 1 of the ITEMS progressions, read in a seeded order reshuffled per epoch.

    A sample's inputs are its tokens but the last; its targets the tokens shifted by one, IGNORE_INDEX
    where they are padding.
    """

    def __init__(self, items: range, vocab_size: int, seq_len: int, seed: int):
        self.first, self.count, self.seed = items.start, len(items), seed
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.order = Shuffle(self.count, seed)

    def __len__(self) -> int:
        return self.count

    def take(self, first: int, count: int, shuffle: bool = True) -> Batch:
        items = self.first + self.items(first, count, shuffle)
        rows = [progression(int(item), self.vocab_size, self.seq_len) for item in items]
        tokens = torch.from_numpy(np.stack([t for t, _ in rows]))
        targets = tokens[:, 1:].clone()
        for row, (_, length) in enumerate(rows):
            targets[row, length - 1 :] = IGNORE_INDEX  # the targets after the progression's last token
        return tokens[:, :-1], targets


def cut(eval) -> int:
    """The first held-out item: the last eval.fraction of them are held out (whether or not validation runs)."""
    return ITEMS - int(ITEMS * eval.fraction)


def train_items(*, train, eval, model, **_) -> Progressions:
    return Progressions(range(cut(eval)), model.vocab_size, train.seq_len, train.seed)


def held_out_items(*, train, eval, model, **_) -> Progressions:
    return Progressions(range(cut(eval), ITEMS), model.vocab_size, train.seq_len, train.seed)


def check(*, eval, **_) -> None:
    """Refuse an eval.fraction that leaves none of the ITEMS progressions to train on, or with validation on holds
    out none."""
    if cut(eval) <= 0 or (eval.enabled and cut(eval) >= ITEMS):
        raise UsageError(f"eval.fraction={eval.fraction} holds out {ITEMS - cut(eval)} of the toy's {ITEMS} items: "
                         "hold out some, and leave some to train on")  # fmt: skip


SPEC = SourceSpec(build=train_items, held_out=held_out_items, check=check, unscored_targets=True)
