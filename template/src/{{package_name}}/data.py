"""Batches that are the same at every world size, resumable from a position.

With `data.shard_by = "global"` (the default) each optimizer step reads one *global* batch,
identified by its index: every rank builds (or reads) the same global batch, keeps its own
contiguous slice and splits that into micro-batches. The only state is the index of the next
global batch, which does not depend on the world size, so a checkpoint taken on 2 ranks resumes
exactly on 1 or 4. The data repeats, reshuffled each epoch, so every rank always has a batch
and all ranks take the same number of steps (FSDP modules cannot `Join`).

With `data.shard_by = "rank"` each rank reads its own part (a file per rank, `{rank}` in
`data.path`, or its slice of one file) in order, once: ranks may run out at different steps, and
`data.uneven_inputs` decides what happens then (see `agree_on_steps` and train.py).

Validation reads held-out data that training never reads (build_held_out): generated data from
random streams of its own, token files and image folders from `eval.path` or, without one, from
the tail of `data.path` (`eval.fraction`), which training then leaves out.

    python -m <package>.data prepare --dataset DIR --tokenizer DIR --out tokens.bin
    python -m <package>.data prepare --jsonl chats.jsonl --tokenizer DIR --out sft.bin

turn a local Hugging Face dataset and tokenizer into a token file for `data.source = "memmap"`,
or chats into a token file and its mask of scored targets for `data.source = "sft"` (prepare_sft),
and a held-out share of their rows into val.bin beside it (for `eval.path`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config import EXIT_USAGE, JOB_WIDE, Config, UsageError

logger = logging.getLogger(__name__)
Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE_INDEX = -100
"""A target that is not scored (data.source = "sft": prompts, example starts): F.cross_entropy's ignore_index."""
TOKEN_FILES = ("memmap", "sft")
"""Sources that read a token file from data.path (sft also its mask beside it, mask_path)."""


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def _stream(index: int, held_out: bool) -> int:
    """Generator index of batch `index`: training counts up from 0, held-out data down from -2 (-1 draws
    the data's own structure), so the two splits never share a random stream."""
    return -2 - index if held_out else index


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


class MemmapTokens:
    """Windows of seq_len + 1 tokens from a flat token file, in a seeded order reshuffled per epoch.

    `tail` is the share at the end of the file held out for validation: training reads the rest,
    `held_out=True` reads only that tail.
    """

    def __init__(
        self, path: Path, dtype: str, seq_len: int, seed: int, part: tuple[int, int] | None = None,
        tail: float = 0.0, held_out: bool = False,
    ):  # fmt: skip
        if not path.is_file():
            raise UsageError(f"data.path={path}: no such token file (python -m {__package__}.data prepare writes one)")
        tokens = _split(np.memmap(path, dtype=dtype, mode="r"), tail, held_out)
        if part is not None:  # this rank's contiguous slice of one shared file
            index, count = part
            tokens = tokens[index * len(tokens) // count : (index + 1) * len(tokens) // count]
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            what = f"{path} (its held-out tail, eval.fraction={tail})" if held_out else str(path)
            raise UsageError(f"{what} holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")

    def __len__(self) -> int:
        return self.windows

    def start(self, sample: int, shuffle: bool = True) -> int:
        """Where sample `sample`'s window of seq_len + 1 tokens starts in self.tokens."""
        epoch, position = divmod(sample, self.windows)
        w = int(torch.randperm(self.windows, generator=_generator(self.seed, epoch))[position]) if shuffle else position
        return w * self.seq_len

    def window(self, sample: int, shuffle: bool = True) -> torch.Tensor:
        start = self.start(sample, shuffle)
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def batch(self, index: int, size: int, shuffle: bool = True) -> Batch:
        tokens = torch.stack([self.window(index * size + i, shuffle) for i in range(size)])
        return tokens[:, :-1], tokens[:, 1:]


def _split(array: np.ndarray, tail: float, held_out: bool) -> np.ndarray:
    """The last `tail` share of `array` when `held_out`, else the rest."""
    cut = len(array) - int(len(array) * tail)
    return array[cut:] if held_out else array[:cut]


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
        self.mask = _split(np.memmap(mask_path(path), dtype=np.uint8, mode="r"), tail, held_out)

    def batch(self, index: int, size: int, shuffle: bool = True) -> Batch:
        starts = [self.start(index * size + i, shuffle) for i in range(size)]
        tokens = torch.stack([torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64)) for s in starts])
        scored = torch.stack([torch.from_numpy(self.mask[s + 1 : s + self.seq_len + 1] != 0) for s in starts])
        return tokens[:, :-1], tokens[:, 1:].masked_fill(~scored, IGNORE_INDEX)


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


class ImageFolder:
    """`<root>/<class>/<image>` files (anything Pillow reads), resized, in a seeded order per epoch.

    `tail` is the share of each class's files (the last in name order, but never all) held out for
    validation: training reads the rest, `held_out=True` reads only those.
    """

    def __init__(self, root: Path, image_size: int, channels: int, seed: int, tail: float = 0.0, held_out=False):
        self.samples = []
        for label, files in enumerate(_image_files(root).values()):
            cut = len(files) - min(math.ceil(len(files) * tail), len(files) - 1)
            self.samples += [(f, label) for f in (files[cut:] if held_out else files[:cut])]
        if not self.samples:
            what = "no held-out files (raise eval.fraction or set eval.path)" if held_out else "none"
            raise UsageError(f"data.path={root}: expected <class>/<image> files, found {what}")
        self.image_size, self.mode, self.seed = image_size, {1: "L", 3: "RGB"}[channels], seed

    def load(self, sample: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # only this source needs Pillow

        epoch, position = divmod(sample, len(self.samples))
        path, label = self.samples[
            int(torch.randperm(len(self.samples), generator=_generator(self.seed, epoch))[position])
        ]
        with Image.open(path) as image:
            image = image.convert(self.mode).resize((self.image_size, self.image_size))
            pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)
        return (pixels.unsqueeze(0) if pixels.ndim == 2 else pixels.permute(2, 0, 1)), label

    def batch(self, index: int, size: int) -> Batch:
        loaded = [self.load(index * size + i) for i in range(size)]
        return torch.stack([x for x, _ in loaded]), torch.tensor([y for _, y in loaded])

    def __len__(self) -> int:
        return len(self.samples)


def _image_files(root: Path) -> dict[str, list[Path]]:
    """Files of each class folder under `root`, classes and files in name order (labels follow the classes)."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return {c: sorted(f for f in (root / c).iterdir() if f.is_file()) for c in classes}


class Loader:
    """This rank's micro-batches of each step, in order, from a global or a per-rank source."""

    def __init__(
        self, source, cfg: Config, rank: int, world_size: int, device: torch.device, rank_sharded: bool | None = None
    ):
        t = cfg.train
        self.grad_accum_steps = grad_accum_steps(t.global_batch_size, t.micro_batch_size, world_size)
        self.source, self.device, self.rank = source, device, rank
        self.global_batch_size, self.micro_batch_size = t.global_batch_size, t.micro_batch_size
        self.per_rank = t.global_batch_size // world_size
        self.rank_sharded = cfg.data.shard_by == "rank" if rank_sharded is None else rank_sharded
        self.position = 0

    def local_steps(self) -> int | None:
        """Steps of data this rank has (None when the data repeats forever)."""
        return self.source.windows // self.per_rank if self.rank_sharded else None

    def next_batches(self) -> list[Batch]:
        """(inputs, targets) per micro-batch of the next step; StopIteration when per-rank data ran out."""
        if self.rank_sharded:
            if self.position >= self.local_steps():
                raise StopIteration
            inputs, targets = self.source.batch(self.position, self.per_rank, shuffle=False)
        else:
            inputs, targets = self.source.batch(self.position, self.global_batch_size)
            mine = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
            inputs, targets = inputs[mine], targets[mine]
        self.position += 1
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        return list(zip(inputs.split(self.micro_batch_size), targets.split(self.micro_batch_size), strict=True))

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


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
            self.loader.position = index
            yield self.loader.next_batches()

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
            "more than once", e.batches, t.global_batch_size, wanted, len(source), extra=JOB_WIDE,
        )  # fmt: skip
    return HeldOut(Loader(source, cfg, rank, world_size, device, rank_sharded=False), e.batches, e.interval)


def _tokenizer(path: Path):
    """The tokenizer in a local directory (nothing is downloaded)."""
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise UsageError(f"--tokenizer {path}: no such directory (a local tokenizer, as save_pretrained writes it)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def prepare(
    dataset: Path, tokenizer: Path, out: Path, text_column: str = "text", val_fraction: float = 0.01, seed: int = 0
) -> int:
    """Tokenize a local Hugging Face dataset into a flat token file, and a held-out share of its rows
    (picked at random with `seed`) into val.bin beside it; return the training token count."""
    from datasets import load_from_disk

    tok = _tokenizer(tokenizer)
    data = load_from_disk(str(dataset))
    splits = {out: data}
    if val_fraction > 0:
        split = data.train_test_split(test_size=val_fraction, seed=seed)
        splits = {out: split["train"], out.with_name("val.bin"): split["test"]}
    dtype = np.uint16 if len(tok) <= 2**16 else np.uint32
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    counts = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, rows in splits.items():
        ids = [i for row in rows[text_column] for i in tok(row)["input_ids"] + eos]
        np.asarray(ids, dtype=dtype).tofile(path)
        counts.append(len(ids))
        print(f"wrote {len(ids)} {np.dtype(dtype).name} tokens to {path} (data.dtype = {np.dtype(dtype).name!r})")
    return counts[0]


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
    of every assistant turn, its end marker included, 0 elsewhere and always on the first token.

    A turn's characters are what rendering the chat through it adds to rendering it up to the turn's
    generation prompt; a token is the turn's when it starts there (the tokenizer's offsets).
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


def prepare_sft(jsonl: Path, tokenizer: Path, out: Path, val_fraction: float = 0.01, seed: int = 0) -> int:
    """Render every chat of a JSONL file with the tokenizer's chat template and pack them, in file order,
    into a token file and its mask of scored targets (mask_path); a held-out share of the rows (picked at
    random with `seed`) goes to val.bin and its mask beside it. Return the training token count.

    Every row is read and checked before anything is written.
    """
    chats = read_chats(jsonl)  # before the tokenizer loads: a bad row is refused at once
    tok = _tokenizer(tokenizer)
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"--tokenizer {tokenizer} has no chat template (chat_template in tokenizer_config.json)")
    if not tok.is_fast:
        raise UsageError(f"--tokenizer {tokenizer} is not a fast tokenizer (tokenizer.json): its offsets are needed")
    examples = [encode_chat(tok, messages, where) for where, messages in chats]
    held_out: set[int] = set()
    if val_fraction > 0:
        count = math.ceil(len(examples) * val_fraction)
        if count >= len(examples):
            raise UsageError(
                f"--val-fraction {val_fraction} of {len(examples)} rows leaves none to train on: add rows, lower "
                "--val-fraction, or pass 0 and set eval.interval = 0"
            )
        held_out = set(np.random.default_rng(seed).permutation(len(examples))[:count].tolist())
    splits = {out: [e for i, e in enumerate(examples) if i not in held_out]}
    if held_out:
        splits[out.with_name("val.bin")] = [examples[i] for i in sorted(held_out)]
    dtype = np.dtype(np.uint16 if len(tok) <= 2**16 else np.uint32)
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, part in splits.items():
        ids, mask = [t for e in part for t in e[0]], [m for e in part for m in e[1]]
        np.asarray(ids, dtype=dtype).tofile(path)
        np.asarray(mask, dtype=np.uint8).tofile(mask_path(path))
        print(
            f"wrote {len(part)} chats, {len(ids)} {dtype.name} tokens ({sum(mask)} scored), to {path} and "
            f"{mask_path(path)} (data.dtype = {dtype.name!r})"
        )
    return sum(len(e[0]) for e in splits[out])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Data tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize a local Hugging Face dataset, or a JSONL of chats, into a token file")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--dataset", type=Path, help="a directory written by datasets' save_to_disk (for data.source = memmap)"
    )
    source.add_argument(
        "--jsonl", type=Path, help='chats, one per line: {"messages": [...]} or {"prompt": ..., "response": ...} '
        "(for data.source = sft; writes the mask of scored tokens beside --out)",
    )  # fmt: skip
    p.add_argument("--tokenizer", type=Path, required=True, help="a local tokenizer directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--text-column", default="text", help="--dataset: the column holding the text")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of rows held out into val.bin beside --out")
    args = parser.parse_args(argv)
    if args.out.name == "val.bin" and args.val_fraction > 0:
        parser.error("--out val.bin is where the held-out rows go: name the training file otherwise")
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    try:
        if args.jsonl:
            prepare_sft(args.jsonl, args.tokenizer, args.out, args.val_fraction)
        else:
            prepare(args.dataset, args.tokenizer, args.out, args.text_column, args.val_fraction)
    except UsageError as error:  # one line, no traceback, exit 2 (as the trainer's refusals)
        print(f"{__package__}.data prepare: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


if __name__ == "__main__":
    main()
