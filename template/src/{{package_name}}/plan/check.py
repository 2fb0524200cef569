"""The launch-time check of the plan: a job that contradicts the plan its repo was generated with
(another world size, a smaller device, a node with less RAM) would run out of memory minutes or
hours in, so it is refused before the process group starts, with a change that fits."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..config import (
    JOB_WIDE,
    CheckpointConfig,
    FinetuneConfig,
    HardwareConfig,
    ParallelConfig,
    TrainConfig,
    UsageError,
)
from ..models import ModelConfig, model_spec
from ..presets import HEADROOM
from .choice import cheapest, context_parallel_degrees, longest_fitting_seq_len, needs_activation_offload
from .host import check_host_memory
from .memory import GIB, plan_for

logger = logging.getLogger(__name__)
PACKAGE = __package__


def device_memory_gb(device: torch.device) -> float | None:
    """Total memory of the live device in GiB; None on the CPU, whose memory the host plan covers."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    if device.type == "xpu":
        return torch.xpu.get_device_properties(device).total_memory / GIB
    return None


def check_plan(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, world_size: int, device: torch.device,
    local_world_size: int | None = None,
) -> None:  # fmt: skip
    """Refuse to start when the live job contradicts the plan the repo was generated with.

    Applies when the run is on the planned kind of device and `hardware.enforce` is set (the preset
    configs); the debug config and CPU fallbacks only log the plan. The host plan is for
    `local_world_size` ranks per node (default: the plan's) against this node's RAM.
    """
    hw = hardware
    planned = hw.gpus_per_node * hw.num_nodes
    if device.type != hw.accelerator:
        logger.info("running on %s, not the planned %s: the hardware plan is not checked", device.type, hw.accelerator)
        return
    args = dict(model=model, train=train, parallel=parallel, hardware=hw, finetune=finetune)
    problems = []
    if world_size != planned:
        problems.append(
            f"launched on {world_size} ranks but the plan is for {planned} ({hw.num_nodes} node(s) x "
            f"{hw.gpus_per_node}). Launch the planned world size, or re-plan the repo for this machine "
            f"(`python -m {PACKAGE} --detect` prints the `copier update` command)"
        )
    live, degree, cp = device_memory_gb(device), parallel.tensor_parallel, parallel.context_parallel
    if hw.gpus_per_node % degree:  # the planned hardware has no plan with this degree to check
        problems.append(
            f"parallel.tensor_parallel={degree} does not split the plan's {hw.gpus_per_node} ranks per node into "
            f"groups: {degree_fix(**args, memory_gb=live or hw.gpu_memory_gb)}"
        )
    elif hw.gpus_per_node % (degree * cp):
        problems.append(
            f"parallel.context_parallel={cp}{f' x parallel.tensor_parallel={degree}' if degree > 1 else ''} does not "
            f"split the plan's {hw.gpus_per_node} ranks per node into groups: "
            f"{cp_degree_fix(**args, memory_gb=live or hw.gpu_memory_gb)}"
        )
    elif live is not None and not (plan := plan_for(**args)).fits(live):
        problems.append(
            f"the plan needs {plan.total / GIB:.1f} GiB per device and this {device.type} has {live:.1f} GiB "
            f"({HEADROOM:.0%} usable): {device_fix(**args, checkpoint=checkpoint, memory_gb=live)}"
        )
    if not hw.gpus_per_node % (degree * cp):  # a group that splits no node leaves no data-parallel rank to plan for
        ranks = local_world_size or hw.gpus_per_node
        if host := check_host_memory(**args, checkpoint=checkpoint, ranks_per_node=ranks):
            problems.append(host)
    if problems and hw.enforce:
        raise UsageError("; ".join(problems) + " (or set hardware.enforce = false to run anyway)")
    for problem in problems:
        logger.warning("%s (hardware.enforce is off: continuing)", problem, extra=JOB_WIDE)


def listed(values: list[str], last: str = "or") -> str:
    """The values as a sentence lists them: "a, b or c" (or "and")."""
    return f"{', '.join(values[:-1])} {last} {values[-1]}" if len(values) > 1 else values[0]


def degree_fix(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, memory_gb: float,
) -> str:  # fmt: skip
    """The tensor-parallel degrees that split the planned nodes and the model (config/ refuses it with
    LoRA and with DDP) and fit a device of `memory_gb` (0: not checked), as the refusal offers them."""
    tp_plan = model_spec(model.name).tensor_parallel_plan(model)
    splits = tp_plan is not None and finetune.method != "lora" and parallel.sharding != "no_shard"
    fitting = []
    for d in range(1, hardware.gpus_per_node + 1):
        if hardware.gpus_per_node % d or (d > 1 and not (splits and not tp_plan.check(model, d, train.seq_len))):
            continue
        trial = replace(parallel, tensor_parallel=d)
        m = plan_for(model=model, train=train, parallel=trial, hardware=hardware, finetune=finetune)
        if not memory_gb or m.fits(memory_gb):
            fitting.append(str(d))
    if not fitting:
        return "no degree that divides it fits: plan other hardware (`copier update`)"
    return f"choose parallel.tensor_parallel={listed(fitting)}"


def cp_degree_fix(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, memory_gb: float,
) -> str:  # fmt: skip
    """The context-parallel degrees that split the planned nodes (with the tensor-parallel degree), the model's
    heads and the sequence, and fit a device of `memory_gb` (0: not checked), as the refusal offers them."""
    fitting = []
    for c in context_parallel_degrees(model=model, train=train, parallel=parallel, hardware=hardware):
        trial = replace(parallel, context_parallel=c)
        m = plan_for(model=model, train=train, parallel=trial, hardware=hardware, finetune=finetune)
        if not memory_gb or m.fits(memory_gb):
            fitting.append(str(c))
    if not fitting:
        return "no degree that divides it fits: plan other hardware (`copier update`)"
    return f"choose parallel.context_parallel={listed(fitting)}"


def device_fix(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, memory_gb: float,
) -> str:  # fmt: skip
    """The settings with which the plan fits a device of `memory_gb`: activation offload alone where it fits so
    (what copier would have rendered), else the planner's cheapest choice for it, with a smaller micro-batch (the
    same global batch, more accumulation), then a larger context-parallel degree (the sequence split over more
    ranks of a node), then the longest sequence that fits (longest_fitting_seq_len) where the config's fits no
    choice. Only what differs from the config is named."""
    live, cp = replace(hardware, gpu_memory_gb=memory_gb), parallel.context_parallel
    args = dict(model=model, train=train, parallel=parallel, hardware=live, finetune=finetune)
    if not parallel.activation_offload and needs_activation_offload(**args):
        return f"set parallel.activation_offload=true (`python -m {PACKAGE} --config <file>` shows every option)"
    smaller = [(train.micro_batch_size // 2**i, train.seq_len, cp) for i in range(12)]
    degrees = context_parallel_degrees(model=model, train=train, parallel=parallel, hardware=live)
    split = [(1, train.seq_len, c) for c in degrees if c > cp]
    one = replace(train, micro_batch_size=1)
    longest = longest_fitting_seq_len(model=model, train=one, parallel=parallel, hardware=live, finetune=finetune,
                                      checkpoint=checkpoint, longest=train.seq_len)  # fmt: skip
    for micro, seq, c in dict.fromkeys(x for x in smaller + split + [(1, longest, cp)] if min(x) >= 1):
        trial = replace(train, micro_batch_size=micro, seq_len=seq)
        found = cheapest(model=model, train=trial, parallel=replace(parallel, context_parallel=c), hardware=live,
                         finetune=finetune, checkpoint=checkpoint)  # fmt: skip
        if found is None:
            continue
        ac, sharding, offload, parked = found
        changes = [
            f"{name}={str(value).lower() if isinstance(value, bool) else value}"
            for name, value, now in [
                ("train.seq_len", seq, train.seq_len),
                ("train.micro_batch_size", micro, train.micro_batch_size),
                ("parallel.context_parallel", c, cp),
                ("parallel.activation_checkpointing", ac, parallel.activation_checkpointing),
                ("parallel.sharding", sharding, parallel.sharding),
                ("parallel.cpu_offload", offload, parallel.cpu_offload),
                ("parallel.activation_offload", parked, parallel.activation_offload),
            ]
            if value != now
        ]
        if changes:
            return f"set {listed(changes, 'and')} (`python -m {PACKAGE} --config <file>` shows every option)"
    return "nothing fits it even at one short sequence per micro-batch: a smaller model, or a larger device"
