"""Local text into a token file, streamed: what `python -m <package>.data prepare --dataset` runs (prepare.py).

The inputs (find_inputs), several at once, each a file, a directory or a glob:
  - a Hugging Face dataset directory (`save_to_disk`), read through `datasets.load_from_disk`;
  - .parquet files, read a row group at a time by pyarrow;
  - .jsonl (or .json) files of JSON Lines: one object per line, the text under the text column;
  - .txt files: one row per line that is not blank (as the `datasets` text loader reads them);
  - a directory that is not a saved dataset: the files of those kinds in it.

find_inputs splits them into batches (BATCH_ROWS rows, or fewer lines that reach BATCH_BYTES; a
Parquet file's row groups), and each worker process reads its batch from the file itself, up to two
batches per process at a time: it tokenizes the batch in one call of the tokenizer, appends the
end-of-text token to each row and sends the ids back, and they are appended to the output files in
input order as they come. Memory depends on the batch size (a row group's) and the number of
processes, not on the size of the corpus. The outputs are written under temporary names and
renamed into place once complete (Outputs).
"""

from __future__ import annotations

import collections
import functools
import glob
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..config import UsageError

BATCH_ROWS = 1024
"""Rows per batch a worker tokenizes in one call."""
BATCH_BYTES = 4 * 2**20
"""A batch of JSON Lines or text rows ends once it holds this much text."""
KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text"}
"""The files find_inputs reads, by suffix."""


def load_tokenizer(path: Path, extra: str = "data"):
    """The tokenizer in a local directory (nothing is downloaded); without transformers, a UsageError naming the
    optional dependencies to install (`extra`: data for --dataset, sft for --jsonl)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(f'--tokenizer needs transformers: pip install -e ".[{extra}]"') from None

    if not path.is_dir():
        raise UsageError(f"--tokenizer {path}: no such directory (a local tokenizer, as save_pretrained writes it)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def token_dtype(tok) -> np.dtype:
    """The smallest unsigned type that holds every id of the tokenizer (data.dtype)."""
    return np.dtype(np.uint16 if len(tok) <= 2**16 else np.uint32)


def default_processes() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Input:
    path: Path
    kind: str
    """dataset, parquet, jsonl or text."""
    parts: tuple[tuple[int, ...], ...]
    """What a worker reads as one batch, each a tuple whose last item is its row count: (start, stop, rows) of a
    dataset, (row group, first row, rows) of a Parquet file, (offset, end, first line, rows) of lines."""

    @property
    def rows(self) -> int:
        return sum(part[-1] for part in self.parts)


def find_inputs(patterns: Sequence[str | Path], column: str) -> list[Input]:
    """Every input the patterns name, in the order given (a glob's or a directory's files in name order), split
    into batches; UsageError naming the pattern or file that cannot be read."""
    inputs = []
    for pattern in map(str, patterns):
        if any(c in pattern for c in "*?["):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
            if not matches:
                raise UsageError(f"--dataset {pattern}: matches no file")
        elif not Path(pattern).exists():
            raise UsageError(f"--dataset {pattern}: no such file or directory")
        else:
            matches = [Path(pattern)]
        for path in matches:
            inputs += _inputs_at(path, column)
    if not sum(i.rows for i in inputs):
        raise UsageError(f"--dataset {' '.join(map(str, patterns))}: no rows of text")
    return inputs


def _inputs_at(path: Path, column: str) -> list[Input]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        raise UsageError(f"--dataset {path} holds the splits {splits}: name one, e.g. {path / splits[0]}")
    if (path / "state.json").is_file():
        from datasets import load_from_disk

        data = load_from_disk(str(path))
        _check_column(path, column, data.column_names)
        starts = range(0, len(data), BATCH_ROWS)
        return [Input(path, "dataset", tuple((s, min(s + BATCH_ROWS, len(data)), min(BATCH_ROWS, len(data) - s))
                                             for s in starts))]  # fmt: skip
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix in KINDS and f.is_file())
        if not files:
            raise UsageError(f"--dataset {path}: a directory with no {', '.join(KINDS)} files and no saved dataset")
        return [i for f in files for i in _inputs_at(f, column)]
    kind = KINDS.get(path.suffix)
    if kind is None:
        raise UsageError(f"--dataset {path}: not a {', '.join(KINDS)} file or a dataset directory (save_to_disk)")
    if kind == "parquet":
        import pyarrow.parquet as pq

        metadata = pq.ParquetFile(path).metadata
        _check_column(path, column, metadata.schema.names)
        groups = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        firsts = [0, *itertools.accumulate(groups)][:-1]
        return [Input(path, kind, tuple((g, *rows) for g, rows in enumerate(zip(firsts, groups, strict=True))))]
    return [Input(path, kind, tuple(_line_parts(path)))]


def _line_parts(path: Path) -> Iterator[tuple[int, int, int, int]]:
    """(offset, end, first line, rows) of each batch of a file's lines: BATCH_ROWS lines that are not blank, or
    fewer that reach BATCH_BYTES."""
    offset = end = rows = 0
    first = 1
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            end += len(line)
            rows += not line.isspace()
            if rows == BATCH_ROWS or end - offset >= BATCH_BYTES:
                if rows:
                    yield offset, end, first, rows
                offset, first, rows = end, number + 1, 0
    if rows:
        yield offset, end, first, rows


def _check_column(path: Path, column: str, columns: list[str]) -> None:
    if column not in columns:
        raise UsageError(f"--dataset {path} has no column {column!r} (its columns: {columns}): pass --text-column")


# A batch for a worker: (kind, file, index of its first row in the corpus, the part of the file: Input.parts).
Task = tuple[str, str, int, tuple[int, ...]]


def _tasks(inputs: list[Input]) -> Iterator[Task]:
    """The corpus in batches, in input order."""
    first = 0
    for source in inputs:
        for part in source.parts:
            yield source.kind, str(source.path), first, part
            first += part[-1]


class _Worker:
    """What each worker process holds: the tokenizer, and how to turn a batch into token ids."""

    current: _Worker | None = None

    def __init__(self, tokenizer: Path, column: str, held_out: Callable, one_thread: bool):
        if one_thread:  # one tokenizer thread per process: the processes are the parallelism
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.tok, self.column, self.held_out = load_tokenizer(tokenizer), column, held_out
        self.dtype = token_dtype(self.tok)
        self.eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        backend = getattr(self.tok, "backend_tokenizer", None)  # a fast tokenizer's own (tokenizers)
        if backend is not None:
            backend.no_truncation()  # as transformers' tokenizer(texts) calls it
            backend.no_padding()
        # Without offsets, which are not kept: about a quarter faster than tokenizer(texts).
        self.encode = getattr(backend, "encode_batch_fast", None)

    def ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, as tokenizer(text)["input_ids"] gives them."""
        if self.encode is None:
            return self.tok(texts, return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        return [encoding.ids for encoding in self.encode(texts, add_special_tokens=True)]


def _start_worker(*args) -> None:
    _Worker.current = _Worker(*args)


def _encode(task: Task) -> tuple[np.ndarray, np.ndarray, int]:
    """A batch's token ids, each row followed by end-of-text: those of the rows trained on, those held out, and
    the batch's row count."""
    w, (kind, where, first, part) = _Worker.current, task
    texts = _texts(kind, where, part, w.column)
    ids = w.ids(texts)
    held = w.held_out(np.arange(first, first + len(texts)))

    def flat(keep: np.ndarray) -> np.ndarray:
        chosen = [ids[i] + w.eos for i in np.flatnonzero(keep)]
        return np.fromiter(itertools.chain.from_iterable(chosen), w.dtype, count=sum(map(len, chosen)))

    return flat(~held), flat(held), len(texts)


def _texts(kind: str, where: str, part: tuple[int, ...], column: str) -> list[str]:
    """The text of every row of a batch, read from its file; UsageError naming the file and line (or row) of the
    first that has none."""
    if kind == "dataset":
        start, stop, _ = part
        rows, numbers = _dataset(where)[start:stop][column], range(start + 1, stop + 1)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        group, first, count = part
        rows = pq.ParquetFile(where).read_row_group(group, columns=[column]).column(0).to_pylist()
        numbers = range(first + 1, first + count + 1)
    else:
        offset, end, first, _ = part
        with open(where, "rb") as f:
            f.seek(offset)
            lines = f.read(end - offset).split(b"\n")
        numbered = [(n, line) for n, line in enumerate(lines, first) if line and not line.isspace()]
        numbers, rows = [n for n, _ in numbered], [line for _, line in numbered]
        if kind == "jsonl":
            rows = [row.get(column) if isinstance(row, dict) else None for row in _json_lines(where, rows, numbers)]
        else:
            rows = _utf8_lines(where, rows, numbers)
    for row, number in zip(rows, numbers, strict=True):
        if not isinstance(row, str):
            at = f"{where}:{number}" if kind == "jsonl" else f"{where}: row {number}"
            raise UsageError(f"{at}: no text under {column!r} (--text-column names the column that holds it)")
    return rows


@functools.lru_cache(maxsize=4)
def _dataset(path: str):
    """A dataset directory, opened once per worker (memory-mapped)."""
    from datasets import load_from_disk

    return load_from_disk(path)


def _json_lines(where: str, lines: list[bytes], numbers: list[int]) -> list:
    """Every line parsed: in one call of the JSON parser, or line by line to name the first that does not parse."""
    try:
        rows = json.loads(b"[" + b",".join(lines) + b"]")
        if len(rows) == len(lines):
            return rows
    except ValueError:  # JSONDecodeError, or UnicodeDecodeError
        pass
    for line, number in zip(lines, numbers, strict=True):
        try:
            json.loads(line)
        except ValueError as error:
            raise UsageError(f"{where}:{number}: not a line of JSON ({error})") from None
    raise UsageError(f"{where}:{numbers[0]}-{numbers[-1]}: lines that are not one JSON value each")


def _utf8_lines(where: str, lines: list[bytes], numbers: list[int]) -> list[str]:
    texts = []
    for line, number in zip(lines, numbers, strict=True):
        try:
            texts.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError:
            raise UsageError(f"{where}:{number}: not UTF-8 text") from None
    return texts


def _encoded(tasks: Iterator[Task], setup: tuple, processes: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """_encode of every task, in order: in this process, or in `processes` workers, two tasks ahead for each."""
    if processes <= 1:
        _start_worker(*setup)
        yield from map(_encode, tasks)
        return
    # fork: the workers start at once, with this module loaded (spawn where there is no fork)
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(processes, _start_worker, setup) as pool:
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode, (task,)))
            if len(pending) >= 2 * processes:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def tokenize_corpus(
    inputs: list[Input], tokenizer: Path, column: str, outputs: Outputs, train: Path, val: Path | None,
    held_out: Callable[[np.ndarray], np.ndarray], processes: int,
) -> dict[Path, int]:  # fmt: skip
    """Append the token ids of every row of `inputs` to `train`, or to `val` for the rows `held_out` picks (by
    their index in the corpus); return the token count of each. Shows a progress bar with tokens/s."""
    setup = (tokenizer, column, held_out, processes > 1)
    counts, started = {train: 0, val: 0}, time.perf_counter()
    with tqdm(total=sum(i.rows for i in inputs), unit="row", unit_scale=True, desc="tokenizing", mininterval=1) as bar:
        for trained, held, rows in _encoded(_tasks(inputs), setup, processes):
            for path, ids in ((train, trained), (val, held)):
                if len(ids):
                    outputs.write(path, ids)
                    counts[path] += len(ids)
            bar.update(rows)
            tokens_per_s = (counts[train] + counts[val]) / (time.perf_counter() - started)
            bar.set_postfix_str(f"{tokens_per_s:,.0f} tok/s", refresh=False)
    counts.pop(None, None)
    return counts


class Outputs:
    """Files written under temporary names (`<name>.partial`) and renamed into place together by commit().

    A prepare that stops before commit (a bad row, Ctrl-C, a kill) leaves every file it would have
    replaced as it was, and nothing under their names: training never reads a half-written file.
    Leaving the `with` block on an error removes the temporary files (and the directory it
    created); after a kill, rerunning the command writes them again from the start.
    """

    def __init__(self, paths: Sequence[Path]):
        self.paths = list(paths)
        parent = self.paths[0].parent
        self.created = parent if not parent.exists() else None
        parent.mkdir(parents=True, exist_ok=True)
        self.files = {path: _partial(path).open("wb") for path in self.paths}

    def write(self, path: Path, ids: np.ndarray) -> None:
        ids.tofile(self.files[path])

    def commit(self) -> None:
        """Make every file durable, then rename each into place."""
        for file in self.files.values():
            file.flush()
            os.fsync(file.fileno())
            file.close()
        for path in self.paths:
            os.replace(_partial(path), path)

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is None:
            return
        for path, file in self.files.items():
            file.close()
            _partial(path).unlink(missing_ok=True)
        if self.created is not None and not any(self.created.iterdir()):
            self.created.rmdir()


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")
