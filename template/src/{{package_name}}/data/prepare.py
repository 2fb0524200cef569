"""`data prepare`: local text, or chats, into the token files that training reads.

    python -m <package>.data prepare --dataset DIR_OR_FILES... --tokenizer DIR --out tokens.bin
    python -m <package>.data prepare --jsonl chats.jsonl --tokenizer DIR --out sft.bin

turn local text (a Hugging Face dataset directory, .parquet, .jsonl or .txt files, globs of
them; corpus.py streams it) and a tokenizer into a token file for `data.source = "memmap"`,
or chats into a token file and its mask of scored targets for `data.source = "sft"` (sft.py),
and a held-out share of their rows into val.bin beside it (for `eval.path`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..config import EXIT_USAGE, UsageError
from .corpus import Outputs, default_processes, find_inputs, load_tokenizer, token_dtype, tokenize_corpus
from .held_out import HeldOutRows, held_out_count
from .sft import SEQ_LEN, prepare_sft


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


def main(argv: list[str] | None = None) -> None:
    # Usage and refusals name the command `<package>.data`, as main's own refusals do, not "__main__.py".
    parser = argparse.ArgumentParser(prog=__package__, description="Data tools.")
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
        print(f"{__package__} prepare: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
