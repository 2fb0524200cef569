"""Distributed checkpoints (DCP): sharded, atomic, and resumable at any world size.

Layout of a run directory:

    checkpoints/step_00000020/            complete: DCP shards + .metadata + COMPLETE.json
    checkpoints/step_00000030.partial-*/  being written (or left by a crash): never loaded

A checkpoint is written into a `.partial-*` directory; once every rank's shards are on disk,
rank 0 writes COMPLETE.json (with the size of every file, and the [model] table the run was configured
with, which model_record.py reads) and renames the directory. A
checkpoint is trusted only if it verifies: the marker is there and every file has its recorded
size. A save whose step already holds a damaged checkpoint writes a new one the same way, then
swaps it in (the damaged one is moved aside first, and deleted after the swap); one that
verifies is never overwritten. Old checkpoints are deleted only after a newer one is complete,
so a crash at any moment leaves the last good checkpoint in place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .config import JOB_WIDE, CheckpointConfig, FinetuneConfig, UsageError
from .distributed import Degrees
from .models import ModelConfig
from .train_state import CHECKPOINT_KEY, TrainState, WeightsOnlyLoadPlanner

logger = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
MODEL = "model"
"""The key of COMPLETE.json that records the [model] table of the run that saved it (recorded_model)."""


FaultHook = Callable[[str, int | None], None]
"""Called as hook(point, step) where a crash must leave the last good checkpoint loadable; tests pass one to
run.build_run to crash a rank there (tests/fault_train.py), a training run passes none:

    "step"      the loop is about to take optimizer step `step` (every rank; train.train_loop)
    "save"      save(step) was called; nothing written yet (every rank)
    "written"   every rank's shards and .metadata are on disk; no marker yet (every rank)
    "marked"    COMPLETE.json is written; the directory is not yet renamed (rank 0)
    "removing"  a directory being deleted has lost its marker, not yet its files (rank 0); step is
                that of the save under way, None when a resume clears what a crash left
    "load"      a checkpoint is about to be read (every rank); step is None
"""


class CheckpointManager:
    """Saves, prunes and finds the checkpoints under `root`; see the module docstring.

    `model`: the [model] table every checkpoint records (COMPLETE.json); `faults` lets tests crash the process at
    each point of a save, a deletion or a load (tests/fault_train.py).
    """

    def __init__(
        self, cfg: CheckpointConfig, root: Path, rank: int, degrees: Degrees, *, model: ModelConfig | None = None,
        faults: FaultHook | None = None,
    ):  # fmt: skip
        self.cfg, self.root, self.rank, self.degrees, self.model, self.faults = cfg, root, rank, degrees, model, faults
        # Async saves run their collectives on a gloo group of their own, off the training stream.
        self.async_group = dist.new_group(backend="gloo") if cfg.format == "dcp_async" else None
        self.pending = None  # (future, partial dir, step) of an async save in flight

    # -- finding checkpoints ------------------------------------------------------------------

    def scan(self) -> tuple[list[Path], dict[Path, str]]:
        """Complete checkpoints, newest first; and every other `step_*` entry, with why it cannot be loaded."""
        complete, unusable = [], {}
        for path in sorted(self.root.glob("step_*"), reverse=True):
            problem = "left by an interrupted save" if ".partial" in path.name else verify(path)
            if problem:
                unusable[path] = problem
            else:
                complete.append(path)
        return complete, unusable

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from, decided on rank 0 and shared, so every rank agrees."""
        choice = [None]
        if self.rank == 0:
            choice[0] = self._choose_resume()
        dist.broadcast_object_list(choice, src=0)
        return Path(choice[0]) if choice[0] else None

    def _choose_resume(self) -> str | None:
        if self.cfg.resume == "never":
            return None
        if self.cfg.resume != "auto":
            check_resume(self.cfg)
            return self.cfg.resume
        complete, unusable = self.scan()
        if unusable:  # one warning that names everything skipped, and what becomes of it
            fates = {path: "deleted" if _is_debris(path) else "kept until a save of its step replaces it"
                     for path in unusable}  # fmt: skip
            logger.warning(
                "skipping checkpoints in %s that cannot be loaded: %s",
                self.root, "; ".join(f"{path.name}: {why} ({fates[path]})" for path, why in unusable.items()),
            )  # fmt: skip
            self._clear_debris(step=None)
        return str(complete[0]) if complete else None

    # -- saving ---------------------------------------------------------------------------------

    def save(self, state: TrainState, step: int) -> None:
        """Write a checkpoint of `state` at `step`; async mode returns once the state is staged."""
        started = time.perf_counter()
        self.fault("save", step)
        self._save(state, step)
        if self.rank == 0:
            # How long the training loop waited: the figure to watch when choosing dcp_async.
            event = {"step": step, "format": self.cfg.format, "blocked_s": time.perf_counter() - started}
            self.root.mkdir(parents=True, exist_ok=True)  # an async save may not have created it yet
            with (self.root / "events.jsonl").open("a") as f:
                f.write(json.dumps(event) + "\n")

    def _save(self, state: TrainState, step: int) -> None:
        self.wait()
        target = self.root / f"step_{step:08d}"
        token = [None]
        if self.rank == 0:
            problem = verify(target)
            if problem and target.exists():
                logger.warning("checkpoint %s is damaged (%s): saving it again", target, problem)
            token[0] = f"{time.time_ns():x}" if problem else None
        dist.broadcast_object_list(token, src=0)
        if token[0] is None:
            return  # a checkpoint of this step verifies (a resumed run stopping at once): never overwrite it
        partial = self.root / f"{target.name}.partial-{token[0]}"
        state.step = step
        if self.async_group is None:
            dcp.save({CHECKPOINT_KEY: state}, checkpoint_id=partial)
            self._finalize(partial, target, step)
        else:
            future = dcp.async_save({CHECKPOINT_KEY: state}, checkpoint_id=partial, process_group=self.async_group)
            self.pending = (future, partial, target, step)

    def wait(self) -> None:
        """Block until an async save in flight is on disk, then finalize it."""
        if self.pending is None:
            return
        future, partial, target, step = self.pending
        self.pending = None
        future.result()
        self._finalize(partial, target, step)

    def _finalize(self, partial: Path, target: Path, step: int) -> None:
        # dcp.save returns on every rank only after all shards and .metadata are written.
        self.fault("written", step)
        if self.rank != 0:
            return
        files = {p.name: p.stat().st_size for p in partial.iterdir() if p.is_file()}
        d = self.degrees
        marker = {"step": step, "world_size": d.world_size, "tensor_parallel": d.tp, "context_parallel": d.cp,
                  "torch": torch.__version__, "files": files}  # fmt: skip
        if self.model is not None:
            marker[MODEL] = dataclasses.asdict(self.model)
        _write_durably(partial / MARKER, json.dumps(marker, indent=1, default=str))  # a [model] field JSON lacks: str
        self.fault("marked", step)
        # A directory at the target is damaged (_save verified it): it would block the rename, so it
        # goes aside first. A crash between the renames leaves two `.partial` directories, which the
        # next resume reports and deletes; the checkpoints before this step are untouched.
        damaged = partial.with_name(f"{partial.name}-replaced") if target.exists() else None
        if damaged:
            os.replace(target, damaged)
        os.replace(partial, target)
        _fsync_dir(self.root)
        if damaged:
            self._remove(damaged, step)
        logger.info("saved checkpoint %s", target)
        self._purge(keep=target, step=step)

    def _purge(self, keep: Path, step: int) -> None:
        """Delete checkpoints beyond keep_last, and what crashed saves or deletions left behind."""
        complete = [p for p in self.scan()[0] if p != keep]
        for old in complete[self.cfg.keep_last - 1 :]:
            self._remove(old, step)
        self._clear_debris(step)

    def _clear_debris(self, step: int | None) -> None:
        """Remove what interrupted saves and deletions left: see _is_debris."""
        for path in self.root.glob("step_*"):
            if _is_debris(path):
                self._remove(path, step)

    def _remove(self, path: Path, step: int | None) -> None:
        """Drop the marker first: a crash mid-delete must not leave a 'complete' checkpoint with holes."""
        (path / MARKER).unlink(missing_ok=True)
        self.fault("removing", step)
        shutil.rmtree(path, ignore_errors=True)

    def fault(self, point: str, step: int | None) -> None:
        """Give the fault hook (if any) the chance to crash this rank at `point` (see FaultHook)."""
        if self.faults is not None:
            self.faults(point, step)

    # -- loading --------------------------------------------------------------------------------

    def load(self, state: TrainState, path: Path) -> None:
        self.fault("load", None)
        marker = json.loads((path / MARKER).read_text())
        # Markers written before tensor or context parallelism existed: 1.
        saved = marker["world_size"], marker.get("tensor_parallel", 1), marker.get("context_parallel", 1)
        now = self.degrees.world_size, self.degrees.tp, self.degrees.cp
        state.restore_per_rank = saved == now
        if not state.restore_per_rank:
            per_rank = "RNG states and per-rank data positions" if state.loader.rank_sharded else "RNG states"
            cp_too = max(saved[2], now[2]) > 1
            logger.warning(
                "checkpoint %s was saved by %s, this run has %s: model, optimizer, schedule and global data position "
                "reshard; per-rank %s do not and are not restored",
                path, _layout(*saved, cp_too=cp_too), _layout(*now, cp_too=cp_too), per_rank, extra=JOB_WIDE,
            )  # fmt: skip
        check_finetune_matches(path, state.model)
        state.saved_keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        dcp.load({CHECKPOINT_KEY: state}, checkpoint_id=path, planner=WeightsOnlyLoadPlanner())
        state.restore_per_rank, state.saved_keys = True, None
        logger.info("resumed from %s at step %d", path, state.step)

    def close(self) -> None:
        self.wait()
        if self.async_group is not None:
            dist.destroy_process_group(self.async_group)


def _layout(world_size: int, tensor_parallel: int, context_parallel: int, *, cp_too: bool) -> str:
    """E.g. "4 ranks (tensor parallel 2)", with the context-parallel degree where either side has one."""
    cp = f", context parallel {context_parallel}" if cp_too else ""
    return f"{world_size} rank{'s' * (world_size != 1)} (tensor parallel {tensor_parallel}{cp})"


def check_resume(cfg: CheckpointConfig) -> None:
    """Refuse an explicit checkpoint.resume that is not a complete checkpoint (auto and never pass)."""
    if cfg.resume in ("auto", "never"):
        return
    problem = verify(Path(cfg.resume))
    if problem:
        raise UsageError(
            f"checkpoint.resume={cfg.resume}: {problem}; pass a complete checkpoint directory, or "
            "checkpoint.resume=auto to take the newest complete one in the run directory"
        )


def finetune_mismatch(path: Path, *, lora: bool) -> str:
    """Empty if the checkpoint at `path` holds LoRA adapters exactly when `lora`; else why it cannot be loaded.

    DCP loads the weights a model asks for and ignores the rest: a LoRA checkpoint read into a
    plain model would silently lose its adapters.
    """
    saved = any(key.endswith(".lora_a") for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    if saved == lora:
        return ""
    trained, now = ("lora", "full") if saved else ("full", "lora")
    fix = ("pass the config it was trained with" if saved else
           f"to fine-tune its weights with LoRA, convert it (python -m {__package__}.convert --checkpoint {path} "
           "--to safetensors --out DIR) and start a new run directory from checkpoint.init_from=DIR")  # fmt: skip
    return f"{path} was trained with finetune.method={trained}, and this config has finetune.method={now}: {fix}"


def check_finetune_matches(path: Path, model: torch.nn.Module) -> None:
    """Refuse a checkpoint trained with LoRA adapters into a model without them, or the other way round."""
    problem = finetune_mismatch(path, lora=any(name.endswith(".lora_a") for name, _ in model.named_parameters()))
    if problem:
        raise ValueError(problem)


def check_resume_finetune(*, checkpoint: CheckpointConfig, finetune: FinetuneConfig, run_dir: Path) -> None:
    """Refuse, before the process group starts, to resume or evaluate a checkpoint of the other finetune.method.

    The checkpoint is the one the run would load: checkpoint.resume's, or with auto the newest
    complete one in the run directory.
    """
    path = checkpoint_to_resume(checkpoint=checkpoint, run_dir=run_dir)
    if path is None:
        return
    problem = finetune_mismatch(path, lora=finetune.method == "lora")
    if problem:
        raise UsageError(f"checkpoint.resume={checkpoint.resume}: {problem}")


def checkpoint_to_resume(*, checkpoint: CheckpointConfig, run_dir: Path) -> Path | None:
    """The checkpoint a launch would load: checkpoint.resume's, or with auto the newest complete one in
    `run_dir`; None when it starts from initial weights."""
    if checkpoint.resume == "never":
        return None
    if checkpoint.resume != "auto":
        return Path(checkpoint.resume)
    steps = checkpoint_steps(Path(run_dir) / "checkpoints")
    return steps[max(steps)] if steps else None


def verify(path: Path) -> str:
    """Empty if `path` is a complete checkpoint whose files are all present at their recorded size."""
    if not path.is_dir():
        return "no such directory"
    marker = path / MARKER
    if not marker.is_file():
        return f"no {MARKER} (the save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable {MARKER}: {exc}"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, expected {size} (truncated or overwritten)"
    return ""


def recorded_model(path: Path) -> dict | None:
    """The [model] table COMPLETE.json records of the checkpoint at `path` (None: saved before it was recorded)."""
    return json.loads((path / MARKER).read_text()).get(MODEL)


def checkpoint_steps(root: Path) -> dict[int, Path]:
    """Every complete checkpoint under `root` (see verify), by the step its marker records, oldest first."""
    complete = (path for path in sorted(root.glob("step_*")) if ".partial" not in path.name and not verify(path))
    return {json.loads((path / MARKER).read_text())["step"]: path for path in complete}


def _is_debris(path: Path) -> bool:
    """A `.partial-*` directory (an unfinished save), or one without a marker (an interrupted deletion).

    Neither can be loaded: saves write into `.partial-*` and rename only after the marker.
    """
    return path.is_dir() and (".partial" in path.name or not (path / MARKER).exists())


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
