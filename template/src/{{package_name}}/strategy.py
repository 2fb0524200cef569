"""The data-parallel strategy: FSDP2 (full, shard_grad_op, hybrid), DDP (no_shard, optionally with ZeRO-1), or
none at all where one rank has nothing to shard (OneRank).

build_strategy chooses one from the config and the world size, once; the run then asks it, instead of
asking which mode it is in: how to wrap the model, how to load rank 0's weights, how to skip gradient
sync while accumulating, which optimizer to build, what goes into a checkpoint, and how the ranks stay
in step when their data runs out unevenly (Pace; DDP's Join). parallelize.py shards the model
(FSDP) before the strategy sees it; DDP wraps it here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from .config import DataConfig, ParallelConfig
from .data import Loader, agree_on_steps
from .distributed import Degrees, any_rank, batch_group, mean_across_ranks
from .parallelize import DTYPES

if TYPE_CHECKING:  # imported where ZeroDDP builds one: torch.distributed.optim scripts its optimizers on import
    from torch.distributed.optim import ZeroRedundancyOptimizer

FullState = Callable[[], dict[str, torch.Tensor]]
"""Builds the full model weights; called on rank 0 only."""


class Pace:
    """How the ranks stay in step: every rank takes the same steps, 1 .. `last`.

    Global-batch data never runs out; with per-rank data (data.shard_by = "rank") the ranks agree on
    the shortest part first (data.uneven_inputs = "min", a MIN all-reduce). Between steps every rank
    is free to join collectives: validation and checkpoints run there (`together`).
    """

    together = True

    def __init__(self, last: int, start: int):
        self.last, self.step = last, start

    def __enter__(self) -> Pace:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def took(self, step: int) -> None:
        """This rank has finished optimizer step `step` (and its gradient collectives)."""
        self.step = step


class LoopControl(Joinable):
    """The training loop's own collectives, made Joinable for `data.uneven_inputs = "join"`.

    Under `torch.distributed.algorithms.join.Join`, a rank whose data has run out keeps calling
    each joinable's JoinHook.main_hook once per step of the others: DDP's hook shadows the
    gradient all-reduce, this one the loop's metric mean and stop-flag agreement, in the same
    order, so no collective waits forever. JoinHook.post_hook runs once everyone is done (DDP's
    broadcasts the final weights); this one needs none.
    """

    def __init__(self, device: torch.device, log_every: int, step: int):
        super().__init__()
        self.device, self.log_every, self.step = device, log_every, step

    def join_hook(self, **kwargs) -> JoinHook:
        control = self

        class ShadowStep(JoinHook):
            def main_hook(self) -> None:
                control.step += 1
                if control.step % control.log_every == 0:
                    mean_across_ranks(None, control.device)
                any_rank(False, control.device)

        return ShadowStep()

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


class JoinPace(Pace):
    """DDP ranks whose per-rank data may run out (data.uneven_inputs = "join"): each trains while it has
    data, then shadows the others' collectives until the longest-running rank is done (torch's Join).

    A rank that has joined cannot take part in a save or a validation, so nothing runs between steps
    (`together` is False): the loop saves and validates once, after Join, at `step`, the longest-running
    rank's. The joinables are listed in the order of each step's collectives: the strategy's (DDP's
    gradient all-reduce, ZeRO's parameter broadcast), then the loop's own.
    """

    together = False

    def __init__(self, last: int, start: int, joinables: list[Joinable], control: LoopControl, throw: bool):
        super().__init__(last, start)
        self.control = control
        self.join = Join([*joinables, control], throw_on_early_termination=throw)

    def __enter__(self) -> JoinPace:
        self.join.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.join.__exit__(*exc)
        self.step = self.control.step  # where the longest-running rank stopped

    def took(self, step: int) -> None:
        self.control.step = self.step = step
        Join.notify_join_context(self.control)


class Strategy(ABC):
    """What differs between the data-parallel modes; the defaults are the FSDP and plain-DDP behaviour."""

    shards_parameters: ClassVar[bool]
    """Each rank holds only a shard of every parameter (FSDP); DDP holds all of them."""

    @classmethod
    def before_process_group(cls) -> None:
        """What must happen before the process group exists (init_distributed calls it); nothing by default."""
        return

    @abstractmethod
    def apply_weights_from_rank0(self, model: nn.Module, full_state: FullState, *, strict: bool = True) -> None:
        """Load the weights full_state() builds on rank 0 into the materialised model, on every rank.

        The weights are then the same at any world size: DTensor random init depends on the
        sharding, and on a CPU mesh it even repeats one shard on every rank. This is the FSDP2
        replacement for FSDP1's sync_module_states. With strict=False full_state() may hold only
        some of the weights (LoRA adapters beside pretrained ones); the others keep their values.
        """

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the training loop calls, once the model is materialised and initialised."""

    @abstractmethod
    def gradient_sync(self, model: nn.Module, enabled: bool) -> AbstractContextManager:
        """A micro-batch's forward and backward in here reduce gradients only when `enabled`."""

    def autocast(self) -> AbstractContextManager:
        """Where the forward computes in low precision, if the strategy does not cast for itself."""
        return nullcontext()

    def build_optimizer(self, param_groups: list[dict], **hyper) -> torch.optim.Optimizer:
        """AdamW over the parameters this rank updates, fused where they allow (adamw_kernel)."""
        return torch.optim.AdamW(param_groups, **adamw_kernel(param_groups), **hyper)

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The torch optimizer that updates this rank's parameters (ZeRO's wraps one)."""
        return optimizer

    def state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, saved_optim_keys: set[str] | None = None
    ) -> tuple[dict, dict]:
        """Model and optimizer state for a distributed checkpoint, keyed by parameter name.

        torch's distributed state-dict API: sharded DTensors under FSDP, which DCP reshards on
        load. `saved_optim_keys` (loading only) are the optimizer keys the checkpoint holds.
        """
        return get_state_dict(model, optimizer)

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict
    ) -> None:
        """Install what DCP loaded into the dicts state_dict() gave it."""
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)

    def pace(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Loader, *, data: DataConfig, steps: int,
        start: int, log_every: int, device: torch.device,
    ) -> Pace:  # fmt: skip
        """How the ranks stay in step from `start` to `steps` (data.uneven_inputs): the shortest rank's steps."""
        return Pace(agree_on_steps(loader, steps, device), start)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module that owns the architecture (its layers, its embeddings)."""
        return model

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks that split each global batch between them, by samples or by tokens (None: all of them)."""
        return None


@dataclass(frozen=True)
class FSDP(Strategy):
    """FSDP2: parallelize.parallelize has sharded every block, then the root, over the mesh (fully_shard).

    With tensor parallelism the mesh has a last "tp" dimension, whose ranks split every layer and
    read the same batches; FSDP shards over the data-parallel dimensions before it. Context parallelism
    adds "cp" before "tp": its ranks read the same batches too, each a part of every sequence, and FSDP
    shards over them as well (distributed.build_mesh).
    """

    mesh: DeviceMesh
    hybrid: bool
    """HSDP: a (replicate, shard) mesh; accumulation skips only the all-reduce across replicas."""

    shards_parameters: ClassVar[bool] = True

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return batch_group(self.mesh, self.hybrid)

    def apply_weights_from_rank0(self, model: nn.Module, full_state: FullState, *, strict: bool = True) -> None:
        state = full_state() if dist.get_rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        set_model_state_dict(model, state, options=options)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard has changed the modules in place

    @contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        if self.hybrid:
            # Keep the reduce-scatter (gradients stay sharded, memory stays bounded) and skip only
            # the all-reduce across replicas until the last micro-batch.
            model.set_requires_all_reduce(enabled)
        else:
            model.set_requires_gradient_sync(enabled)
        yield


@dataclass(frozen=True)
class OneRank(Strategy):
    """One rank with nothing to shard (shards_nothing): the model as it is, no wrapper, no collective.

    FSDP on one rank gathers and reduces nothing, yet every step pays for its hooks, its DTensor
    dispatch (an op on a parameter runs as the DTensor op and as its local one) and its weight casts;
    torchtitan applies none on one GPU either. Low precision is torch.autocast over fp32 master
    weights: matmuls in the compute dtype, norms, softmax and the residual stream in fp32 (FSDP's
    MixedPrecisionPolicy computes everything in it). The state dict holds plain tensors, which DCP
    reshards into FSDP's DTensors at any world size, and back.
    """

    device: torch.device
    autocast_dtype: torch.dtype | None
    """Compute dtype under autocast; None: fp32, no autocast."""

    shards_parameters: ClassVar[bool] = False

    def apply_weights_from_rank0(self, model: nn.Module, full_state: FullState, *, strict: bool = True) -> None:
        if dist.get_rank() == 0:
            # DDP (below) is not yet wrapped: its constructor broadcasts rank 0's parameters and buffers.
            model.load_state_dict(full_state(), strict=strict)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def gradient_sync(self, model: nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()  # nothing to synchronise

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device.type, self.autocast_dtype) if self.autocast_dtype else nullcontext()


@dataclass(frozen=True)
class DDP(OneRank):
    """no_shard: one rank's training on every rank, each holding everything; gradients are all-reduced in
    buckets (DistributedDataParallel), and low precision is autocast's, as on one rank."""

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type != "cpu" else None)

    def gradient_sync(self, model: nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext() if enabled else model.no_sync()

    def pace(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Loader, *, data: DataConfig, steps: int,
        start: int, log_every: int, device: torch.device,
    ) -> Pace:  # fmt: skip
        """With per-rank data and data.uneven_inputs = "join", Join (FSDP modules are not Joinable: config/
        refuses it for them); otherwise the shortest rank's steps."""
        if data.uneven_inputs != "join" or not loader.rank_sharded:
            return super().pace(model, optimizer, loader, data=data, steps=steps, start=start, log_every=log_every,
                                device=device)  # fmt: skip
        control = LoopControl(device, log_every, start)
        return JoinPace(steps, start, self.joinables(model, optimizer), control, data.join_throw)

    def joinables(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Joinable]:
        """What Join shadows for a rank whose data ran out, in the order of each step's collectives."""
        return [model]  # DDP's gradient all-reduce

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module  # DDP hides the model behind .module


@dataclass(frozen=True)
class ZeroDDP(DDP):
    """DDP with ZeroRedundancyOptimizer (ZeRO-1).

    Each rank keeps AdamW state only for the parameters it owns, steps those and broadcasts them.
    """

    @classmethod
    def before_process_group(cls) -> None:
        # ZeroRedundancyOptimizer's module takes dist.group.WORLD as a default argument when it is first imported.
        # Imported once the group exists, it keeps the group past destroy_process_group, and gloo's threads are
        # then stopped while the interpreter shuts down, where they can abort a job that has saved (exit -6, now
        # and then). Imported before, it holds None. (Not at the top of this file: the import scripts torch's
        # functional optimizers, a quarter of a second that the other strategies need not pay.)
        from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401

    def build_optimizer(self, param_groups: list[dict], **hyper) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(param_groups, torch.optim.AdamW, **adamw_kernel(param_groups), **hyper)

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer.optim

    def state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, saved_optim_keys: set[str] | None = None
    ) -> tuple[dict, dict]:
        return get_model_state_dict(model), zero_state_dict(self.unwrap(model), optimizer, saved_optim_keys)

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict
    ) -> None:
        set_model_state_dict(model, model_state)
        set_zero_state_dict(self.unwrap(model), optimizer, optim_state)

    def joinables(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Joinable]:
        return [model, optimizer]  # DDP's gradient all-reduce, then ZeRO's parameter broadcast


def shards_nothing(degrees: Degrees, parallel: ParallelConfig) -> bool:
    """One rank with nothing to shard: no data-parallel peer, no tensor, context or expert parallelism (none can
    exceed the world size), and no CPU offload, which needs FSDP even on one rank (it keeps the weights on the
    host). Such a run trains the model as it is (OneRank), whatever parallel.sharding says. The one place that
    decides it: the process group's start (run.init_distributed) and the strategy (build_strategy) ask here."""
    return degrees.world_size == 1 and not parallel.cpu_offload


def strategy_class(parallel: ParallelConfig, degrees: Degrees) -> type[Strategy]:
    """The strategy for the job's `degrees`: OneRank where they shard nothing, else the one parallel.sharding
    names: FSDP, or DDP (with ZeRO-1 if parallel.zero_optimizer)."""
    if shards_nothing(degrees, parallel):
        return OneRank
    if parallel.sharding != "no_shard":
        return FSDP
    return ZeroDDP if parallel.zero_optimizer else DDP


def build_strategy(
    parallel: ParallelConfig, mesh: DeviceMesh | None, device: torch.device, *, degrees: Degrees
) -> Strategy:
    """strategy_class's strategy: FSDP over `mesh`, or OneRank or DDP on `device`."""
    chosen = strategy_class(parallel, degrees)
    if chosen is FSDP:
        return FSDP(mesh, hybrid=parallel.sharding == "hybrid")
    autocast_dtype = DTYPES[parallel.mixed_precision] if parallel.mixed_precision != "fp32" else None
    return chosen(device, autocast_dtype)


def adamw_kernel(param_groups: list[dict]) -> dict[str, bool]:
    """fused=True where every parameter is floating point on a device with fused AdamW kernels (CUDA, XPU, CPU;
    FSDP's DTensors too, since torch 2.4): one kernel per device and dtype, which can skip a step on the device
    (step.NonFinite) without the host reading the gradient norm; foreach=True otherwise."""
    params = [p for group in param_groups for p in group["params"]]
    fused = all(p.device.type in ("cuda", "xpu", "cpu") and p.is_floating_point() for p in params)
    return {"fused": True} if fused else {"foreach": True}


def zero_state_dict(model: nn.Module, optimizer: ZeroRedundancyOptimizer, saved_optim_keys: set[str] | None) -> dict:
    """ZeroRedundancyOptimizer's state in the layout of torch's distributed state-dict API.

    Each rank holds AdamW state only for the parameters it owns, so it saves those, keyed by
    parameter name; loading, it asks for the ones it owns now. The layout is get_state_dict's, so
    a checkpoint moves between world sizes and between ZeRO and plain DDP. ZeRO's own
    `consolidate_state_dict` would gather everything on one rank and key it by position instead.
    `saved_optim_keys` (loading only) leaves out parameters with no saved state, as when fp16 has
    skipped every step so far: they stay without state, as they were.
    """
    names = _parameter_names(model)
    if saved_optim_keys is None:  # saving: the state this rank holds
        state = {names[param]: values for param, values in optimizer.optim.state.items()}
    else:  # loading: empty tensors of the right shape for DCP to fill, for the parameters this rank owns
        owned = (param for group in optimizer.optim.param_groups for param in group["params"])
        state = {
            names[param]: {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(param),
                           "exp_avg_sq": torch.zeros_like(param)}
            for param in owned
            if f"state.{names[param]}.exp_avg" in saved_optim_keys
        }  # fmt: skip
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def set_zero_state_dict(model: nn.Module, optimizer: ZeroRedundancyOptimizer, optim_state: dict) -> None:
    """Install the state zero_state_dict() loaded; hyperparameters reach the local optimizer at its next step."""
    params = {name: param for param, name in _parameter_names(model).items()}
    for name, values in optim_state["state"].items():
        optimizer.optim.state[params[name]] = values
    for group, saved in zip(optimizer.param_groups, optim_state["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _parameter_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Parameter -> the name get_state_dict uses: its state-dict key, the first one for a tied weight.

    Not named_parameters(): that keeps the wrappers' own components (activation checkpointing adds
    `_checkpoint_wrapped_module.`), which state-dict hooks remove. `model` is unwrapped from DDP.
    """
    names: dict[nn.Parameter, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter):
            names.setdefault(value, key)
    return names
