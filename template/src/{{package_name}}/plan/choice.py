"""The planner's picks: the cheapest sharding, activation checkpointing and offloads that fit, the tensor-
and expert-parallel degrees with the cheapest estimated step, and the smallest context-parallel degree
with which the sequence fits. The same search ran at question time (the template's hooks/plan.jinja, whose
macros have these functions' names) to choose the repo's defaults; the trainer's
checks, `python -m <package>.plan` and its re-sizing advice run it on the live config."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..config import CheckpointConfig, FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig
from ..models import ModelConfig, model_shape, model_spec
from ..presets import SEQ_LEN_STEP
from .communication import (
    MFU,
    activation_offload_bytes,
    activation_offload_seconds,
    communication_bytes,
    context_parallel_bytes,
    expert_parallel_bytes,
    link_seconds,
    peak_flops,
    tensor_parallel_bytes,
)
from .host import host_plan_for
from .memory import AC_MODES, plan_for, planned_degrees, sequence_parallel


def sharding_candidates(
    num_nodes: int, inter_node_link: str, tensor_parallel: int = 1, context_parallel: int = 1, expert_parallel: int = 1
) -> tuple[str, ...]:
    """Least communication first; hybrid ahead of full when the link between nodes is slow, since it keeps
    the parameter traffic inside the nodes. DDP (no_shard) is not combined with tensor, context or expert
    parallelism."""
    if num_nodes > 1 and inter_node_link == "ethernet":
        order = ("no_shard", "shard_grad_op", "hybrid", "full")
    elif num_nodes > 1:
        order = ("no_shard", "shard_grad_op", "full", "hybrid")
    else:
        order = ("no_shard", "shard_grad_op", "full")
    return order if tensor_parallel == context_parallel == expert_parallel == 1 else order[1:]


OFFLOAD_TIERS = ((False, False), (False, None), (None, None))
"""The (cpu_offload, activation_offload) settings the searches below try in turn, as cheapest() takes them (None:
its choice): neither offload, then activation offload, then CPU offload too. A larger micro-batch or a smaller
context-parallel degree is no reason for an offload."""


class PlanChoice(NamedTuple):
    """What the planner picks for a config (cheapest, recommend)."""

    ac: str
    """parallel.activation_checkpointing"""
    sharding: str
    cpu_offload: bool
    activation_offload: bool = False


def cheapest(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, activation_offload: bool | None = None,
    cpu_offload: bool | None = None,
) -> PlanChoice | None:  # fmt: skip
    """The cheapest (activation checkpointing, sharding, CPU offload, activation offload) that fits the device and
    the node's RAM; None if nothing does. `activation_offload` and `cpu_offload` fix those choices (None: the
    planner's).

    Sharding harder is tried before recomputing (recomputation costs every step). Then activation offload, with
    selective and then full checkpointing: the checkpointed blocks' inputs cross the host link twice a step
    (activation_offload_bytes), overlapped with compute. CPU offload only when nothing else fits: it moves the
    model state over that link and steps AdamW on the CPU every step. DDP with a ZeRO optimizer is never the
    pick: shard_grad_op splits the gradients as well, and sends less (one all-gather and a reduce-scatter against
    an all-reduce and a broadcast). CPU ranks have no device budget: full sharding without either offload,
    recomputing only where host memory needs it. The host plan takes `checkpoint`'s format and export
    (copier's questions assume dcp and an export, the defaults of the later questions, and check the answers
    to those when they are given).
    """
    hw, cpu = hardware, hardware.accelerator == "cpu"
    degrees = (parallel.tensor_parallel, parallel.context_parallel, parallel.expert_parallel)
    shardings = ("full",) if cpu else sharding_candidates(hw.num_nodes, hw.inter_node_link, *degrees)
    args = dict(model=model, train=train, parallel=parallel, hardware=hw, finetune=finetune)
    parking = (False, True) if activation_offload is None else (activation_offload,)
    offloads = (False, True) if cpu_offload is None else (cpu_offload,)
    for offload, parked, ac in ((o, a, m) for o in offloads for a in parking for m in AC_MODES):
        if cpu and (offload or parked) or parked and ac == "none":  # offload frees nothing on a CPU rank
            continue
        for sharding in shardings:
            if offload and sharding == "no_shard":
                continue
            plan = plan_for(**args, sharding=sharding, cpu_offload=offload, ac=ac, zero_optimizer=False,
                            activation_offload=parked)  # fmt: skip
            host = host_plan_for(**args, checkpoint=checkpoint, m=plan, cpu_offload=offload)
            if (cpu or plan.fits(hw.gpu_memory_gb)) and host.fits(hw.host_memory_gb):
                return PlanChoice(ac, sharding, offload, parked)
    return None


def recommend(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> PlanChoice:  # fmt: skip
    """cheapest(), or the most frugal plan when nothing fits, which check_plan and copier then refuse with
    the figures; CPU ranks gain nothing from either offload."""
    found = cheapest(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune,
                     checkpoint=checkpoint)  # fmt: skip
    gpu = hardware.accelerator != "cpu"
    return found or PlanChoice("full", "full", gpu, gpu)


def needs_activation_offload(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig,
) -> bool:  # fmt: skip
    """Whether the plan of these settings fits the device only with its checkpointed blocks' inputs parked in host
    memory: what copier renders into parallel.activation_offload for the answers given (the template's
    hooks/plan.jinja), and the smallest fix where a config without it does not fit. The device decides; the
    node's RAM must then hold the parked inputs (host.check_host_memory). False on CPU ranks and without
    activation checkpointing."""
    if hardware.accelerator == "cpu" or parallel.activation_checkpointing == "none":
        return False
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune)
    without, parked = (plan_for(**args, activation_offload=park) for park in (False, True))
    return not without.fits(hardware.gpu_memory_gb) and parked.fits(hardware.gpu_memory_gb)


@dataclass(frozen=True)
class DegreeEstimate:
    """The cheapest plan with one tensor- or expert-parallel degree, and what a step of it is estimated to cost
    (estimate_tensor_parallel, estimate_expert_parallel)."""

    degree: int
    micro_batch_size: int
    """Sequences per forward pass of a rank (of a tensor-parallel group): the largest of the base (times the
    tensor-parallel degree) and its halvings that fits."""
    ac: str
    sharding: str
    cpu_offload: bool
    compute_s: float
    """Seconds of compute per step: 6 FLOPs per (active) parameter and token at MFU, a third more with full
    recomputation."""
    fsdp_s: float
    """Seconds of FSDP's communication per step, which overlaps with compute."""
    degree_s: float
    """Seconds of the degree's own communication per step (tensor parallelism's collectives with its
    context-parallel group's all-to-alls, expert parallelism's all-to-alls), which compute waits for."""
    tokens: int
    """Tokens per step over all ranks."""
    activation_offload: bool = False
    host_s: float = 0.0
    """Seconds per step of activation offload's copies over the host link, which overlap with compute."""

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.fsdp_s, self.host_s) + self.degree_s

    @property
    def seconds_per_token(self) -> float:
        return self.step_s / self.tokens


def tensor_parallel_degrees(
    *, model: ModelConfig, train: TrainConfig, hardware: HardwareConfig, context_parallel: int = 1
) -> list[int]:
    """1, and the powers of two that divide the GPUs per node (beside `context_parallel` ranks of a context-parallel
    group) and split the model: its spec's plan says what must divide (heads, widths, the sequence)."""
    plan = model_spec(model.name).tensor_parallel_plan(model)
    if hardware.accelerator == "cpu" or plan is None:
        return [1]
    degrees, t = [1], 2
    while t <= hardware.gpus_per_node:
        if hardware.gpus_per_node % (t * context_parallel) == 0 and not plan.check(model, t, train.seq_len):
            degrees.append(t)
        t *= 2
    return degrees


def largest_fitting_micro_batch(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, start: int, parking: bool = True,
) -> tuple[int, PlanChoice] | None:  # fmt: skip
    """The largest halving of `start` sequences per GPU (twelve halvings at most) whose cheapest plan fits, with
    that plan; None when none fits. A tensor- or context-parallel group reads the same sequences, so the global
    batch is micro x the data-parallel ranks. Plans without activation offload first: a larger micro-batch is no
    reason to park block inputs or to move the model state to the CPU (and no parking at all unless `parking`)."""
    dp = planned_degrees(parallel=parallel, hardware=hardware).dp
    tiers = OFFLOAD_TIERS if parking else ((False, False), (None, False))
    for offload, park in tiers:
        for micro in (start // 2**i for i in range(12) if start // 2**i >= 1):
            batch = replace(train, micro_batch_size=micro, global_batch_size=micro * dp)
            choice = cheapest(model=model, train=batch, parallel=parallel, hardware=hardware, finetune=finetune,
                              checkpoint=checkpoint, activation_offload=park, cpu_offload=offload)  # fmt: skip
            if choice:
                return micro, choice
    return None


def estimate_tensor_parallel(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, degree: int, base_micro_batch: int, parking: bool = True,
) -> DegreeEstimate | None:  # fmt: skip
    """The cheapest plan with `degree` at train's sequence length; None when no micro-batch fits (without activation
    offload unless `parking`).

    A group of `degree` GPUs starts from `base_micro_batch` sequences per GPU, so its micro-batch (and
    the global batch) matches FSDP alone's until the memory runs out. Compute is 6 P FLOPs a token at
    MFU, a third more with full recomputation. The degree's own seconds are tensor parallelism's collectives and,
    with a context-parallel group, its all-to-alls: compute waits for both.
    """
    hw, s, trial = hardware, model_shape(model), replace(parallel, tensor_parallel=degree)
    precision, degrees = parallel.mixed_precision, planned_degrees(parallel=trial, hardware=hw)
    fit = largest_fitting_micro_batch(model=model, train=train, parallel=trial, hardware=hw, finetune=finetune,
                                      checkpoint=checkpoint, start=base_micro_batch * degree,
                                      parking=parking)  # fmt: skip
    if fit is None:
        return None
    micro, (ac, sharding, offload, parked) = fit
    tokens = micro * train.seq_len // degrees.cp  # per tensor-parallel group and step
    compute = 6 * s.P * tokens / degree / (MFU * peak_flops(hardware=hw)) * (4 / 3 if ac == "full" else 1)
    sent = communication_bytes(s, sharding, precision, hw.gpus_per_node, hw.num_nodes, False, parallel.float8,
                               tensor_parallel=degree)  # fmt: skip
    group = micro * train.seq_len  # the tokens of a context-parallel group
    cp_sent = context_parallel_bytes(s, precision, ac, degree, degrees.cp, group)
    tp = link_seconds({"intra": tensor_parallel_bytes(s, precision, ac, degree, tokens) + cp_sent, "inter": 0.0},
                      hardware=hw)  # fmt: skip
    fsdp, everyone = link_seconds(sent, hardware=hw), micro * train.seq_len * degrees.dp  # tokens per step
    sp = sequence_parallel(model=model, parallel=trial)
    parked_sent = activation_offload_bytes(s, precision, tokens, degree, sp, degrees.cp) if parked else 0.0
    host = activation_offload_seconds(parked_sent, hardware=hw)
    return DegreeEstimate(degree, micro, ac, sharding, offload, compute, fsdp, tp, everyone, parked, host)


def tensor_parallel_estimates(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, base_micro_batch: int,
) -> dict[int, DegreeEstimate | None]:  # fmt: skip
    """The estimates recommend_tensor_parallel compares, by degree (None where nothing fits): each degree with
    parallel's context-parallel degree where a plan without either offload fits so; else with the smallest
    context-parallel degree that fits one sequence with it (recommend_context_parallel: without offload, then
    with activation offload, then with CPU offload), its group taking as many times the sequences. A long
    sequence is split over a context-parallel group before its blocks' inputs are parked or the model state
    leaves the GPU: the group's all-to-alls stay on the link inside a node and are priced in the estimate."""
    args = dict(model=model, train=train, hardware=hardware, finetune=finetune, checkpoint=checkpoint)
    cp, one = parallel.context_parallel, replace(train, micro_batch_size=1)
    found = {}
    for d in tensor_parallel_degrees(model=model, train=train, hardware=hardware, context_parallel=cp):
        found[d] = estimate_tensor_parallel(**args, parallel=parallel, degree=d, base_micro_batch=base_micro_batch,
                                            parking=False)  # fmt: skip
        if found[d] is None or found[d].cpu_offload:
            trial = replace(parallel, tensor_parallel=d)
            c = recommend_context_parallel(**(args | {"train": one}), parallel=trial)
            found[d] = estimate_tensor_parallel(**args, parallel=replace(trial, context_parallel=c), degree=d,
                                                base_micro_batch=base_micro_batch * c)  # fmt: skip
    return found


def recommend_tensor_parallel(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, base_micro_batch: int,
) -> int:  # fmt: skip
    """The tensor-parallel degree with the cheapest estimated plan (tensor_parallel_estimates): without CPU offload
    if any fits, then the fewest seconds per token; 1 unless a larger degree is strictly better.

    Tensor parallelism divides what FSDP moves between nodes (each rank gathers 1/t of the parameters)
    and the activations of one sequence, and adds collectives on the link inside a node that compute
    waits for: it wins where FSDP alone needs offload, or its communication cannot hide behind compute.
    """
    best, key = 1, None
    estimates = tensor_parallel_estimates(model=model, train=train, parallel=parallel, hardware=hardware,
                                          finetune=finetune, checkpoint=checkpoint,
                                          base_micro_batch=base_micro_batch)  # fmt: skip
    for degree, found in estimates.items():
        if found is not None and (key is None or (found.cpu_offload, found.seconds_per_token) < key):
            best, key = degree, (found.cpu_offload, found.seconds_per_token)
    return best


def context_parallel_degrees(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig
) -> list[int]:
    """1, and the degrees that split every sequence over ranks of one node: each divides the GPUs a node has per
    tensor-parallel group, the query heads of a rank (the model's plan checks them), and the sequence into 2 x
    degree chunks (of a multiple of the tensor-parallel degree where sequence parallelism splits them again)."""
    spec, t, per_node, seq = model_spec(model.name), parallel.tensor_parallel, hardware.gpus_per_node, train.seq_len
    if hardware.accelerator == "cpu" or spec.cp_plan is None or per_node % t:
        return [1]
    return [1] + [
        c
        for c in range(2, per_node + 1)
        if per_node % (c * t) == 0 and not spec.cp_plan.check(model, c, t) and seq % (2 * c) == 0 and seq // c % t == 0
    ]


def recommend_context_parallel(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> int:  # fmt: skip
    """The smallest context-parallel degree with which train's micro-batch of train's sequences fits some plan:
    1 when they fit without it (it costs all-to-alls in every block, and a group reads the same sequences, so
    the global batch shrinks with it); the largest degree when none fits (the checks then refuse it). Each
    degree is planned as the template writes its config: one micro-batch per data-parallel rank a step. Plans
    without either offload first, then with activation offload, then with CPU offload too: the group's all-to-alls
    stay on the link inside a node, where parked inputs would cross the host link, and CPU offload moves the model
    state over it and steps AdamW on the CPU."""
    degrees = context_parallel_degrees(model=model, train=train, parallel=parallel, hardware=hardware)
    for offload, parking in OFFLOAD_TIERS:
        for degree in degrees:
            trial = replace(parallel, context_parallel=degree)
            dp = planned_degrees(parallel=trial, hardware=hardware).dp
            batch = replace(train, global_batch_size=train.micro_batch_size * dp)
            if cheapest(model=model, train=batch, parallel=trial, hardware=hardware, finetune=finetune,
                        checkpoint=checkpoint, activation_offload=parking, cpu_offload=offload):  # fmt: skip
                return degree
    return degrees[-1]


def seq_len_multiple(*, model: ModelConfig, parallel: ParallelConfig) -> int:
    """The number every sequence length must be a multiple of for parallel's split: 2 x context_parallel chunks
    (each rank of a context-parallel group holds two), each a multiple of tensor_parallel tokens where sequence
    parallelism splits them again; tensor_parallel with sequence parallelism alone; else 1."""
    t, c = parallel.tensor_parallel, parallel.context_parallel
    if c > 1:
        return c * math.lcm(2, t)
    return t if sequence_parallel(model=model, parallel=parallel) else 1


def longest_fitting_seq_len(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, longest: int,
) -> int:  # fmt: skip
    """The longest sequence of at most `longest` tokens that parallel's split takes and with which some plan fits
    train's micro-batch; 0 when none does.

    The lengths tried are the multiples of seq_len_multiple that are multiples of SEQ_LEN_STEP tokens too (of
    seq_len_multiple alone where `longest` is shorter): every split takes them and attention tiles them evenly.
    Memory grows with the sequence, so a binary search over them finds the longest.
    """
    unit = seq_len_multiple(model=model, parallel=parallel)
    step = math.lcm(unit, SEQ_LEN_STEP)
    step = step if step <= longest else unit
    lo, hi = 0, longest // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = replace(train, seq_len=mid * step)
        if cheapest(model=model, train=trial, parallel=parallel, hardware=hardware, finetune=finetune,
                    checkpoint=checkpoint):  # fmt: skip
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def expert_parallel_degrees(*, model: ModelConfig, hardware: HardwareConfig) -> list[int]:
    """1, and on GPUs the powers of two that divide the GPUs per node and the experts: an expert-parallel group
    sends tokens in every sparse layer, so it stays on the link inside a node, as a tensor-parallel one does."""
    experts = model_shape(model).experts
    if hardware.accelerator == "cpu" or not experts:
        return [1]
    degrees, e = [1], 2
    while e <= hardware.gpus_per_node:
        if hardware.gpus_per_node % e == 0 and experts % e == 0:
            degrees.append(e)
        e *= 2
    return degrees


def estimate_expert_parallel(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, degree: int, base_micro_batch: int,
) -> DegreeEstimate | None:  # fmt: skip
    """The cheapest plan with expert-parallel `degree` at train's sequence length; None when no micro-batch fits."""
    hw, s, trial = hardware, model_shape(model), replace(parallel, expert_parallel=degree)
    world, precision = hw.gpus_per_node * hw.num_nodes, parallel.mixed_precision
    fit = largest_fitting_micro_batch(model=model, train=train, parallel=trial, hardware=hw, finetune=finetune,
                                      checkpoint=checkpoint, start=base_micro_batch)  # fmt: skip
    if fit is None:
        return None
    micro, (ac, sharding, offload, parked) = fit
    tokens = micro * train.seq_len  # per rank and step
    compute = 6 * s.active_params * tokens / (MFU * peak_flops(hardware=hw)) * (4 / 3 if ac == "full" else 1)
    sent = communication_bytes(s, sharding, precision, hw.gpus_per_node, hw.num_nodes, False, parallel.float8,
                               expert_parallel=degree)  # fmt: skip
    a2a = {"intra": expert_parallel_bytes(s, precision, ac, degree, tokens), "inter": 0.0}
    host = activation_offload_seconds(activation_offload_bytes(s, precision, tokens) if parked else 0.0, hardware=hw)
    return DegreeEstimate(degree, micro, ac, sharding, offload, compute, link_seconds(sent, hardware=hw),
                          link_seconds(a2a, hardware=hw), tokens * world, parked, host)  # fmt: skip


def recommend_expert_parallel(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, base_micro_batch: int,
) -> int:  # fmt: skip
    """The expert-parallel degree with the cheapest estimated plan: without CPU offload if any fits, then the
    fewest seconds per token; 1 unless a larger degree is strictly better.

    Expert parallelism shrinks what FSDP gathers and reduces of the experts (a rank moves 1/e of them,
    among 1/e of the ranks) and the gathered block, and adds all-to-alls of the tokens inside a node that
    compute waits for: it wins where the experts' traffic dominates a step, as in every large mixture
    of experts, whose routed experts are most of its weights but few of its FLOPs.
    """
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune,
                checkpoint=checkpoint)  # fmt: skip
    best, key = 1, None
    for degree in expert_parallel_degrees(model=model, hardware=hardware):
        found = estimate_expert_parallel(**args, degree=degree, base_micro_batch=base_micro_batch)
        if found is not None and (key is None or (found.cpu_offload, found.seconds_per_token) < key):
            best, key = degree, (found.cpu_offload, found.seconds_per_token)
    return best
