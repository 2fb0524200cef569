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

    python -m <package>.data prepare --dataset DIR --tokenizer DIR --out tokens.bin

turns a local Hugging Face dataset and tokenizer into a token file for `data.source = "memmap"`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config import Config, UsageError

logger = logging.getLogger(__name__)
Batch = tuple[torch.Tensor, torch.Tensor]


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class SyntheticTokens:
    """A random Markov chain in which every token has `branching` possible successors.

    Learnable by construction: the loss starts near ln(vocab_size) and can fall to
    ln(branching), so a falling loss shows the model, optimizer and sharding all work.
    """

    def __init__(self, vocab_size: int, seq_len: int, branching: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=_generator(seed, -1))

    def batch(self, index: int, size: int) -> Batch:
        g = _generator(self.seed, index)
        tokens = torch.empty(size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (size,), generator=g)
        choices = torch.randint(self.successors.shape[1], (size, self.seq_len), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


class MemmapTokens:
    """Windows of seq_len + 1 tokens from a flat token file, in a seeded order reshuffled per epoch."""

    def __init__(self, path: Path, dtype: str, seq_len: int, seed: int, part: tuple[int, int] | None = None):
        if not path.is_file():
            raise UsageError(f"data.path={path}: no such token file (python -m {__package__}.data prepare writes one)")
        tokens = np.memmap(path, dtype=dtype, mode="r")
        if part is not None:  # this rank's contiguous slice of one shared file
            index, count = part
            tokens = tokens[index * len(tokens) // count : (index + 1) * len(tokens) // count]
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise UsageError(f"data.path={path} holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")

    def window(self, sample: int, shuffle: bool = True) -> torch.Tensor:
        epoch, position = divmod(sample, self.windows)
        w = int(torch.randperm(self.windows, generator=_generator(self.seed, epoch))[position]) if shuffle else position
        chunk = self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1]
        return torch.from_numpy(chunk.astype(np.int64))

    def batch(self, index: int, size: int, shuffle: bool = True) -> Batch:
        tokens = torch.stack([self.window(index * size + i, shuffle) for i in range(size)])
        return tokens[:, :-1], tokens[:, 1:]


class SyntheticImages:
    """Images made of a class prototype plus noise: learnable, so the loss falls from ln(classes)."""

    def __init__(self, image_size: int, channels: int, num_classes: int, seed: int):
        self.shape, self.num_classes, self.seed = (channels, image_size, image_size), num_classes, seed
        self.prototypes = torch.randn(num_classes, *self.shape, generator=_generator(seed, -1))

    def batch(self, index: int, size: int) -> Batch:
        g = _generator(self.seed, index)
        labels = torch.randint(self.num_classes, (size,), generator=g)
        return self.prototypes[labels] + torch.randn(size, *self.shape, generator=g), labels


class ImageFolder:
    """`<root>/<class>/<image>` files (anything Pillow reads), resized, in a seeded order per epoch."""

    def __init__(self, root: Path, image_size: int, channels: int, seed: int):
        classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        self.samples = [
            (f, label) for label, c in enumerate(classes) for f in sorted((root / c).iterdir()) if f.is_file()
        ]
        if not self.samples:
            raise UsageError(f"data.path={root}: expected <class>/<image> files, found none")
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


class Loader:
    """This rank's micro-batches of each step, in order, from a global or a per-rank source."""

    def __init__(self, source, cfg: Config, rank: int, world_size: int, device: torch.device):
        t = cfg.train
        self.grad_accum_steps = grad_accum_steps(t.global_batch_size, t.micro_batch_size, world_size)
        self.source, self.device, self.rank = source, device, rank
        self.global_batch_size, self.micro_batch_size = t.global_batch_size, t.micro_batch_size
        self.per_rank = t.global_batch_size // world_size
        self.rank_sharded = cfg.data.shard_by == "rank"
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
    if d.source not in ("memmap", "image_folder"):
        return None
    return Path(d.path.format(rank=rank) if d.shard_by == "rank" and "{rank}" in d.path else d.path)


def check_data(cfg: Config, rank: int, world_size: int) -> None:
    """Refuse, before the process group starts, a data path that does not exist or a batch that does not split."""
    grad_accum_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    path = data_path(cfg, rank)
    if path is not None and not path.exists():
        if cfg.data.source == "memmap":
            what = f"token file (python -m {__package__}.data prepare writes one)"
        else:
            what = "image folder (<class>/<image> files)"
        raise UsageError(f"data.path={path}: no such {what}; point data.path at it")


def build_loader(cfg: Config, rank: int, world_size: int, device: torch.device) -> Loader:
    d, t, m = cfg.data, cfg.train, cfg.model
    path = data_path(cfg, rank)
    if d.source == "memmap":
        per_rank_file = d.shard_by == "rank" and "{rank}" in d.path
        part = (rank, world_size) if d.shard_by == "rank" and not per_rank_file else None
        source = MemmapTokens(path, d.dtype, t.seq_len, t.seed, part)
    elif d.source == "synthetic_images":
        source = SyntheticImages(m.image_size, m.channels, m.num_classes, t.seed)
    elif d.source == "image_folder":
        source = ImageFolder(path, m.image_size, m.channels, t.seed)
    else:
        source = SyntheticTokens(m.vocab_size, t.seq_len, d.synthetic_branching, t.seed)
    return Loader(source, cfg, rank, world_size, device)


def prepare(dataset: Path, tokenizer: Path, out: Path, text_column: str = "text") -> int:
    """Tokenize a local Hugging Face dataset into a flat token file; return the token count."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    data = load_from_disk(str(dataset))
    dtype = np.uint16 if len(tok) <= 2**16 else np.uint32
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids = [i for row in data[text_column] for i in tok(row)["input_ids"] + eos]
    np.asarray(ids, dtype=dtype).tofile(out)
    print(f"wrote {len(ids)} {np.dtype(dtype).name} tokens to {out} (data.dtype = {np.dtype(dtype).name!r})")
    return len(ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Data tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize a local Hugging Face dataset into a token file")
    p.add_argument("--dataset", type=Path, required=True, help="a directory written by datasets' save_to_disk")
    p.add_argument("--tokenizer", type=Path, required=True, help="a local tokenizer directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--text-column", default="text")
    args = parser.parse_args(argv)
    prepare(args.dataset, args.tokenizer, args.out, args.text_column)


if __name__ == "__main__":
    main()
