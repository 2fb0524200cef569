"""This rank's batches of each step, the same at every world size, resumable, read ahead of the step.

With `data.shard_by = "global"` (the default) each optimizer step reads one *global* batch,
identified by its index: rank r of N reads samples r * B / N to (r + 1) * B / N of it (B the
global batch size), only those, and splits them into micro-batches. The only state is the index
of the next global batch, which does not depend on the world size, so a checkpoint taken on 2
ranks resumes exactly on 1 or 4. The data repeats, reshuffled each epoch, so every rank always has
a batch and all ranks take the same number of steps (FSDP modules cannot `Join`).

Batches are built ahead of the step that needs them: by `data.workers` DataLoader processes, or
by a thread of the training process (`data.prefetch` batches ahead; Loader).

With `data.shard_by = "rank"` each rank reads its own part (a file per rank, `{rank}` in
`data.path`, or its slice of one file) in order, once: ranks may run out at different steps, and
`data.uneven_inputs` decides what happens then (see `agree_on_steps` and train.py).

build_loader builds the training batches and build_held_out validation's, alike but from the data
that training leaves out, each from the samples of the source data.source names (sources/).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ..config import JOB_WIDE, DataConfig, EvalConfig, TrainConfig, UsageError
from .order import ORDER, ORDERS
from .sources import Batch, IndexedSource, source_errors, source_spec
from .sources.spec import rank_path

if TYPE_CHECKING:
    from ..models import ModelConfig

logger = logging.getLogger(__name__)


class Steps(Dataset):
    """Step index -> this rank's (inputs, targets) of that step, on the CPU.

    What a DataLoader worker or the prefetch thread runs. From an IndexedSource a rank reads only
    its own samples of each global batch; generated data is drawn whole (one random stream per
    batch) and sliced. Per-rank data (rank_sharded) is read in file order.
    """

    def __init__(self, source, rank: int, per_rank: int, global_batch_size: int, rank_sharded: bool):
        self.source, self.rank, self.per_rank, self.global_batch_size = source, rank, per_rank, global_batch_size
        self.rank_sharded = rank_sharded

    def __getitem__(self, step: int) -> Batch:
        if self.rank_sharded:
            return self.source.take(step * self.per_rank, self.per_rank, shuffle=False)
        first = self.rank * self.per_rank
        if isinstance(self.source, IndexedSource):
            return self.source.take(step * self.global_batch_size + first, self.per_rank)
        inputs, targets = self.source.batch(step, self.global_batch_size)
        return inputs[first : first + self.per_rank], targets[first : first + self.per_rank]


class Prefetch:
    """Builds the batches of `steps` in a thread, up to `depth` ahead of the loop that takes them (next()).

    The work is numpy and torch calls that release the GIL, so it overlaps the training step; an
    error in the thread is raised by the next() that would have returned its batch. The thread ends
    at close(), or once this object is dropped: it holds no reference to it.
    """

    def __init__(self, read, steps: Iterable[int], depth: int, pin_memory: bool):
        self.ready: queue.Queue = queue.Queue(depth)
        self.stopped, self.ended = threading.Event(), False
        args = (self.ready, self.stopped, read, steps, pin_memory)
        self.thread = threading.Thread(target=_fill, args=args, daemon=True)
        self.thread.start()
        weakref.finalize(self, self.stopped.set)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        item = None if self.ended else self.ready.get()
        if isinstance(item, Exception):
            raise item
        if item is None:
            self.ended = True
            raise StopIteration
        return item

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()


def _fill(ready: queue.Queue, stopped: threading.Event, read, steps: Iterable[int], pin_memory: bool) -> None:
    """Prefetch's thread: queue the batch of each step, then None, until `stopped` is set."""

    def put(item) -> bool:
        while not stopped.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for step in steps:
            batch = read(step)
            if not put(tuple(t.pin_memory() for t in batch) if pin_memory else batch):
                return
    except Exception as error:  # noqa: BLE001 - handed to the training loop, which raises it
        put(error)
        return
    put(None)


class Loader:
    """This rank's micro-batches of each step, in order, built ahead of the step that takes them.

    `data.workers` DataLoader processes build them (each a whole step's batch, `data.prefetch`
    steps ahead each), or without workers a thread does (`data.prefetch` steps ahead; 0: the step
    builds its own). With `data.pin_memory` on an accelerator they are built in page-locked memory,
    so the copy to the device does not block. The position is that of the next step the loop
    takes, not of what was built ahead: a checkpoint resumes on the step after the last trained.
    """

    def __init__(
        self, source, *, train: TrainConfig, data: DataConfig, rank: int, world_size: int, device: torch.device,
        rank_sharded: bool | None = None,
    ):  # fmt: skip
        t, d = train, data
        self.grad_accum_steps = grad_accum_steps(t.global_batch_size, t.micro_batch_size, world_size)
        self.source, self.device, self.rank = source, device, rank
        self.global_batch_size, self.micro_batch_size = t.global_batch_size, t.micro_batch_size
        self.per_rank = t.global_batch_size // world_size
        self.rank_sharded = d.shard_by == "rank" if rank_sharded is None else rank_sharded
        self.steps = Steps(source, rank, self.per_rank, t.global_batch_size, self.rank_sharded)
        self.workers, self.prefetch, self.seed = d.workers, d.prefetch, t.seed
        self.pin_memory = d.pin_memory and device.type in ("cuda", "xpu")
        self.position, self.order, self.ahead = 0, ORDER, None

    def local_steps(self) -> int | None:
        """Steps of data this rank has (None when the data repeats forever)."""
        return len(self.source) // self.per_rank if self.rank_sharded else None

    def next_batches(self) -> list[Batch]:
        """(inputs, targets) per micro-batch of the next step; StopIteration when per-rank data ran out."""
        if self.ahead is None:
            self.ahead = self._read_ahead()
        inputs, targets = next(self.ahead)
        self.position += 1
        return self._micro_batches(inputs, targets)

    def batches_at(self, step: int) -> list[Batch]:
        """The micro-batches of step `step`, built now; the position does not move (HeldOut reads this way)."""
        return self._micro_batches(*self.steps[step])

    def _micro_batches(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[Batch]:
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        return list(zip(inputs.split(self.micro_batch_size), targets.split(self.micro_batch_size), strict=True))

    def _read_ahead(self) -> Iterable[Batch]:
        steps = range(self.position, self.local_steps()) if self.rank_sharded else itertools.count(self.position)
        if self.workers:
            # Its own generator: the workers' seeds must not be drawn from the training RNG, which is checkpointed.
            return iter(DataLoader(
                self.steps, batch_size=None, sampler=steps, num_workers=self.workers, prefetch_factor=self.prefetch,
                pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(self.seed),
            ))  # fmt: skip
        if self.prefetch:
            return Prefetch(self.steps.__getitem__, steps, self.prefetch, self.pin_memory)
        return map(self.steps.__getitem__, steps)

    def close(self) -> None:
        """Stop building batches ahead (the thread, or the worker processes)."""
        if isinstance(self.ahead, Prefetch):
            self.ahead.close()
        self.ahead = None  # a DataLoader's iterator shuts its workers down when it is dropped

    def state_dict(self) -> dict:
        return {"position": self.position, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state`: its position, and the order its run read (ORDER unless it says otherwise)."""
        self.close()
        self.position, self.order = int(state["position"]), state.get("order", self.order)
        if self.order not in ORDERS:
            raise UsageError(
                f"the checkpoint's data was read in order {self.order!r}, which this version does not know "
                f"({', '.join(ORDERS)}): resume it with the version of the code that saved it"
            )
        if isinstance(self.source, IndexedSource):
            self.source.use_order(self.order)
            if self.order != ORDER:
                logger.info("the data goes on in the order its run read (%s), not %s: its checkpoint says so",
                            self.order, ORDER)  # fmt: skip


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


def data_path(data: DataConfig, rank: int) -> Path | None:
    """The file or folder this rank reads (a file per rank when data.path has `{rank}`); None for generated data."""
    return rank_path(data, rank) if source_spec(data.source).reads else None


def check_data(
    *, data: DataConfig, train: TrainConfig, eval: EvalConfig, model: ModelConfig, rank: int, world_size: int
) -> None:
    """Refuse, before the process group starts, a data source this repo lacks or settings it cannot read with
    (sources.source_errors), a data path that does not exist, files its source refuses (SourceSpec.check), or a
    batch that does not split."""
    grad_accum_steps(train.global_batch_size, train.micro_batch_size, world_size)
    spec = source_spec(data.source)
    errors = source_errors(data=data, eval=eval, model=model)
    if errors:
        raise UsageError("invalid config:\n  " + "\n  ".join(errors))
    path = data_path(data, rank)
    if path is not None and not path.exists():
        raise UsageError(f"data.path={path}: no such {spec.reads}; point data.path at it")
    if path is not None and eval.enabled and eval.path and not Path(eval.path).exists():
        raise UsageError(f"eval.path={eval.path}: no such held-out {spec.reads}; point eval.path at it")
    if spec.check is not None:
        spec.check(data=data, train=train, eval=eval, path=path)


def build_loader(
    *, data: DataConfig, train: TrainConfig, eval: EvalConfig, model: ModelConfig, rank: int, world_size: int,
    device: torch.device,
) -> Loader:  # fmt: skip
    """This rank's training batches, from data.source's samples less those validation keeps (its held_out)."""
    sections = {"data": data, "train": train, "eval": eval, "model": model}
    source = source_spec(data.source).build(**sections, rank=rank, world_size=world_size)
    return Loader(source, train=train, data=data, rank=rank, world_size=world_size, device=device)


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
            yield self.loader.batches_at(index)

    def __len__(self) -> int:
        return self.batches

    def due(self, step: int, last: int) -> bool:
        """Evaluate after this step: every eval.interval steps and after the last."""
        return self.interval > 0 and (step % self.interval == 0 or step == last)


def build_held_out(
    *, data: DataConfig, train: TrainConfig, eval: EvalConfig, model: ModelConfig, rank: int, world_size: int,
    device: torch.device,
) -> HeldOut | None:  # fmt: skip
    """The held-out batches validation reads (None when it is off): data that build_loader never returns."""
    t, e = train, eval
    if not e.enabled:
        return None
    source = source_spec(data.source).held_out(data=data, train=train, eval=eval, model=model)
    wanted = e.batches * t.global_batch_size
    if hasattr(source, "__len__") and len(source) < wanted:
        logger.warning(
            "eval.batches=%d x train.global_batch_size=%d = %d samples, but the held-out data has %d: some count "
            "more than once (hold out more data, or lower eval.batches)", e.batches, t.global_batch_size, wanted,
            len(source), extra=JOB_WIDE,
        )  # fmt: skip
    loader = Loader(source, train=t, data=data, rank=rank, world_size=world_size, device=device, rank_sharded=False)
    return HeldOut(loader, e.batches, e.interval)
