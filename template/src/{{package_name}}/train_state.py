"""What a checkpoint holds: the train state (model, optimizer, LR schedule, step, data position, RNG), as DCP
saves and loads it, and how non-tensor entries are read back safely. checkpoint.py decides when and where
it is written, and which one a run resumes.
"""

from __future__ import annotations

import io
import random

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .data import UNRECORDED_ORDER
from .strategy import Strategy

CHECKPOINT_KEY = "train"
"""The one top-level key of every checkpoint: DCP saves {"train": TrainState}."""


class TrainState(Stateful):
    """Everything a resumed run needs: model, optimizer, LR schedule, step, data position, RNG.

    The model and optimizer state come from the strategy (torch's distributed state-dict API, or
    ZeRO's per-rank shares in its layout): sharded DTensors under FSDP, so they reshard on load,
    and so does the position of global-batch data. Per-rank state (RNG, and the position of
    per-rank data) is restored only when the world size and the tensor- and context-parallel degrees are
    unchanged (set `restore_per_rank` before loading).
    """

    def __init__(self, model, optimizer, scheduler, loader, rank: int, strategy: Strategy):
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.rank, self.strategy, self.step, self.restore_per_rank = rank, strategy, 0, True
        self.saved_keys: set[str] | None = None
        """Keys of the checkpoint being loaded (DCP metadata); None while saving."""

    def state_dict(self) -> dict:
        model_state, optim_state = self.strategy.state_dict(self.model, self.optimizer, self._saved_optim_keys())
        state = {
            "model": plain_tensors(model_state),
            "optim": plain_tensors(optim_state),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }
        if not self.loader.rank_sharded:
            state["data"] = self._data_state("data")
        if self.restore_per_rank:
            state[f"rank{self.rank}"] = {"rng": _rng_state(), "data": self._data_state(f"rank{self.rank}.data")}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(self.model, self.optimizer, state["model"], state["optim"])
        # Which AdamW kernel runs (fused, foreach) is this run's choice (strategy.adamw_kernel), not a hyperparameter
        # to restore: a checkpoint saved with another (an earlier release's default) must not bring it back.
        local = self.strategy.local_optimizer(self.optimizer)
        kernel = {key: local.defaults[key] for key in ("fused", "foreach") if key in local.defaults}
        for group in [*self.optimizer.param_groups, *local.param_groups]:
            group.update(kernel)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        # Checkpoints saved before the data order was recorded read the order UNRECORDED_ORDER names.
        if not self.loader.rank_sharded:
            self.loader.load_state_dict({"order": UNRECORDED_ORDER, **state["data"]})
        if self.restore_per_rank:
            _set_rng_state(state[f"rank{self.rank}"]["rng"])
            if self.loader.rank_sharded:
                self.loader.load_state_dict({"order": UNRECORDED_ORDER, **state[f"rank{self.rank}"]["data"]})

    def _data_state(self, key: str) -> dict:
        """The loader's state; while loading, only the entries the checkpoint has (DCP refuses missing ones)."""
        state = self.loader.state_dict()
        if self.saved_keys is None:
            return state
        return {name: value for name, value in state.items() if f"{CHECKPOINT_KEY}.{key}.{name}" in self.saved_keys}

    def _saved_optim_keys(self) -> set[str] | None:
        """The optimizer's keys in the checkpoint being loaded (`state.<param>.exp_avg`, ...); None while saving."""
        if self.saved_keys is None:
            return None
        prefix = f"{CHECKPOINT_KEY}.optim."
        return {key.removeprefix(prefix) for key in self.saved_keys if key.startswith(prefix)}


def plain_tensors(state: dict) -> dict:
    """`state` with wrapper-subclass shards (torchao's float8 weights) replaced by the plain tensor inside.

    The inner tensor shares the shard's storage, so DCP saves it as an ordinary tensor (a float8
    checkpoint loads into a bf16 run and back) and loads into it in place.
    """

    def unwrap(value):
        if isinstance(value, dict):
            return {key: unwrap(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(unwrap(item) for item in value)
        # A wrapper subclass (torch's traceable-subclass protocol) names the plain tensors it holds.
        if isinstance(value, DTensor) and hasattr(local := value.to_local(), "__tensor_flatten__"):
            names, _ = local.__tensor_flatten__()
            if len(names) == 1:
                inner = getattr(local, names[0])
                return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False,
                                          shape=value.shape, stride=value.stride())  # fmt: skip
        return value

    return unwrap(state)


def _rng_state() -> dict:
    """This rank's generators: CPU, Python's, and the accelerator's (CUDA or XPU) when there is one."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()[1]}
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None:
        state[accelerator.type] = torch.get_device_module(accelerator).get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type in state:
        torch.get_device_module(accelerator).set_rng_state(state[accelerator.type])


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with weights_only=False.

    Here they are first read with weights_only=True (plain containers and numbers only), so a
    tampered checkpoint cannot run code; the parent then stores the vetted value.
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        vetted = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), vetted)
        vetted.seek(0)
        super().load_bytes(read_item, vetted)
