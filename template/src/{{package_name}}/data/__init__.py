"""The data a run reads, and `python -m <package>.data prepare`, which makes it. One concern a module:

    order.py     the seeded order in which token files and image folders are read (Shuffle)
    sources.py   where samples come from: token files, chats, image folders, generated data
    loader.py    this rank's batches of each step, built ahead of it: build_loader, and build_held_out's HeldOut
    held_out.py  what validation reads and training leaves out, and its checks (the batches: loader.HeldOut)
    prepare.py   `data prepare`: its command line (main, which __main__.py runs) and prepare
    corpus.py    `data prepare --dataset`: local text tokenized by worker processes, streamed to disk
    sft.py       `data prepare --jsonl`: chats into a token file and its mask of scored targets

The names the rest of the repo imports are re-exported here (`from <package>.data import build_loader`).
"""

from .held_out import HeldOutRows, check_held_out_tokens, held_out_tail
from .loader import HeldOut, Loader, Steps, agree_on_steps, build_held_out, build_loader, check_data, data_path
from .order import ORDER, ORDERS, UNRECORDED_ORDER, Shuffle
from .prepare import main, prepare
from .sft import prepare_sft
from .sources import IGNORE_INDEX, Batch, ImageFolder, MaskedTokens, MemmapTokens, mask_path

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ORDER",
    "ORDERS",
    "UNRECORDED_ORDER",
    "HeldOut",
    "HeldOutRows",
    "ImageFolder",
    "Loader",
    "MaskedTokens",
    "MemmapTokens",
    "Shuffle",
    "Steps",
    "agree_on_steps",
    "build_held_out",
    "build_loader",
    "check_data",
    "check_held_out_tokens",
    "data_path",
    "held_out_tail",
    "main",
    "mask_path",
    "prepare",
    "prepare_sft",
]
