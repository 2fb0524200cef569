"""data.source = "sft": windows of packed chats (data.path) whose unscored targets are IGNORE_INDEX.

`python -m <package>.data prepare --jsonl` writes the token file and its mask beside it (mask_path;
data/sft.py), and a held-out share of the chats to val.bin and its mask, for eval.path. The windows
are read as memmap's; the loss is the mean over the step's scored targets (`unscored_targets`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...config import DataConfig, EvalConfig, TrainConfig, UsageError
from ..held_out import held_out_split, held_out_tail
from .memmap import TOKEN_FILE, MemmapTokens, check_token_file
from .spec import IGNORE_INDEX, PREPARE, Batch, SourceSpec, map_file


def mask_path(path: Path) -> Path:
    """The mask beside an sft token file (sft.bin -> sft.mask.bin): one uint8 per token, 1 where it is scored."""
    return path.with_name(f"{path.stem}.mask{path.suffix}")


class MaskedTokens(MemmapTokens):
    """Windows of packed chats, whose unscored targets are IGNORE_INDEX.

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
    """Refuse a token file (config key `key`) without its mask beside it, or with a mask of another length."""
    mask, name = mask_path(path), f"{key}={path}" if key else str(path)
    if not mask.is_file():
        raise UsageError(f"{name} has no mask {mask} beside it: {PREPARE} --jsonl writes both")
    tokens, marks = path.stat().st_size // np.dtype(dtype).itemsize, mask.stat().st_size
    if marks != tokens:
        raise UsageError(
            f"{mask} marks {marks} tokens but {name} holds {tokens} {dtype} tokens: set data.dtype to the one "
            "data prepare printed, or prepare both files again"
        )


def chat_windows(*, data: DataConfig, train: TrainConfig, eval: EvalConfig, **_) -> MaskedTokens:
    """The training windows: data.path less its held-out tail."""
    return MaskedTokens(Path(data.path), data.dtype, train.seq_len, train.seed, tail=held_out_tail(eval))


def held_out_chat_windows(*, data: DataConfig, train: TrainConfig, eval: EvalConfig, **_) -> MaskedTokens:
    """Validation's windows: eval.path's (data prepare's val.bin), or the tail of data.path."""
    path, tail, held_out = held_out_split(data=data, eval=eval)
    return MaskedTokens(path, data.dtype, train.seq_len, train.seed, tail=tail, held_out=held_out)


def check_chats(*, data: DataConfig, train: TrainConfig, eval: EvalConfig, path: Path) -> None:
    """Refuse a token file or held-out file without its mask, then what memmap refuses."""
    check_mask(path, data.dtype, "data.path")
    if eval.enabled and eval.path:
        check_mask(Path(eval.path), data.dtype, "eval.path")
    check_token_file(data=data, train=train, eval=eval, path=path)


SPEC = SourceSpec(
    build=chat_windows,
    held_out=held_out_chat_windows,
    reads=TOKEN_FILE,
    check=check_chats,
    unscored_targets=True,
)
