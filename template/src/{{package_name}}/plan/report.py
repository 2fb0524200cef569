"""The table `python -m <package>.plan` prints: every sharding choice's per-rank memory and per-step
communication for a config, from the formulas of plan/, so that a user re-sizing a run sees the
alternatives with the numbers the planner compared."""

from __future__ import annotations

from dataclasses import replace

from ..config import CheckpointConfig, FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig
from ..models import ModelConfig, model_shape
from . import (
    GIB,
    HEADROOM,
    HOST_MEMORY,
    SHARDINGS,
    adapter_params,
    communication_bytes,
    context_parallel_bytes,
    context_parallel_degrees,
    context_parallel_seconds,
    estimate_expert_parallel,
    estimate_tensor_parallel,
    expert_parallel_degrees,
    expert_parallel_seconds,
    grad_accum,
    host_plan_for,
    lora_of,
    plan_for,
    recommend,
    recommend_context_parallel,
    recommend_expert_parallel,
    recommend_tensor_parallel,
    step_seconds,
    tensor_parallel_degrees,
)


def format_table(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> str:  # fmt: skip
    """Per-rank memory and per-step communication of every sharding choice for these settings."""
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune)
    s, hw, p = model_shape(model), hardware, parallel
    unit, unit_name = (GIB, "GiB") if plan_for(**args, sharding="no_shard").total >= GIB else (2**20, "MiB")
    widths = (15, 8, 11, 7, 10, 8, 10, 9, 7, 8, 13)

    def line(*values) -> str:
        return "".join(
            f"{v:<{w}}" if i in (0, 8) else f"{v:>{w}}" for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    split = [f"{n} ({what} parallel)" for n, what in ((p.tensor_parallel, "tensor"), (p.context_parallel, "context"))
             if n > 1]  # fmt: skip
    group = f"group of {' x '.join(split)}" if split else "rank"
    usable = HOST_MEMORY["headroom"] * hw.host_memory_gb
    ram = f"; {hw.host_memory_gb:g} GiB of RAM per node ({usable:.1f} usable)" if hw.host_memory_gb else ""
    accum = grad_accum(train=train, parallel=p, hardware=hw)
    active = f" ({s.active_params / 1e9:.2f}B active a token)" if s.active_params != s.P else ""
    rows = [
        f"{model.preset}: {s.P / 1e9:.2f}B parameters{active}; per {group} {train.micro_batch_size} x "
        f"{train.seq_len} tokens x {accum} micro-batch(es); {p.mixed_precision}; activation "
        f"checkpointing {p.activation_checkpointing}",
        f"hardware: {hw.num_nodes} node(s) x {hw.gpus_per_node} {hw.accelerator}"
        + (f", {hw.gpu_memory_gb:g} GiB each ({HEADROOM * hw.gpu_memory_gb:.1f} usable)" if hw.gpu_memory_gb else "")
        + ram,
        *lora_lines(**args, unit=unit, unit_name=unit_name),
        "",
        line(
            "sharding",
            "offload",
            "params+opt",
            "grads",
            "gathered",
            "activ.",
            f"peak {unit_name}",
            f"host {unit_name}",
            "  fits",
            "comm GB",
            "comm/compute",
        ),  # fmt: skip
    ]
    single = p.tensor_parallel == p.context_parallel == p.expert_parallel == 1
    ddp = [("no_shard", False, False), ("no_shard", False, True)] if single else []
    choices = ddp + [
        (x, offload, False) for x in SHARDINGS[1:] if x != "hybrid" or hw.num_nodes > 1 for offload in (False, True)
    ]
    for sharding, offload, zero in choices:
        m = plan_for(**args, sharding=sharding, cpu_offload=offload, zero_optimizer=zero)
        compute, comm = step_seconds(s, train=train, parallel=p, hardware=hw, finetune=finetune, sharding=sharding,
                                     zero_optimizer=zero)  # fmt: skip
        sent = communication_bytes(
            s, sharding, p.mixed_precision, hw.gpus_per_node, hw.num_nodes, zero, p.float8,
            **lora_of(finetune=finetune), tensor_parallel=p.tensor_parallel, expert_parallel=p.expert_parallel,
        )  # fmt: skip
        host = host_plan_for(**args, checkpoint=checkpoint, m=m, cpu_offload=offload)
        device_fits = not hw.gpu_memory_gb or m.fits(hw.gpu_memory_gb)
        fits = "no" if not device_fits else "yes" if host.fits(hw.host_memory_gb) else "host"
        resident = 0 if offload else m.params + m.optim
        sizes = [f"{b / unit:.1f}" for b in (resident, m.grads_live, m.gathered + m.gradbuf, m.activations, m.total,
                                             host.total)]  # fmt: skip
        this = (sharding, offload, zero) == (p.sharding, p.cpu_offload, p.zero_optimizer)
        name, sent_gb = sharding + ("+zero" if zero else ""), sum(sent.values()) / 1e9
        row = line(name, "yes" if offload else "no", *sizes, f"  {fits}", f"{sent_gb:.1f}", f"{comm / compute:.2f}")
        rows.append(row + ("   <- this config" if this else ""))
    ac, sharding, offload, parked = recommend(**args, checkpoint=checkpoint)
    rows += [
        "",
        f"planner's choice: sharding={sharding}, activation_checkpointing={ac}, cpu_offload={offload}"
        + (", activation_offload=True" if parked else ""),
        f"host: RAM of one node ({hw.gpus_per_node} ranks) at its peak; this config's: "
        f"{host_plan_for(**args, checkpoint=checkpoint).describe()}",
        "comm/compute: estimated communication time over compute time per step (40% MFU); above 1, FSDP cannot "
        "hide the communication behind compute",
    ]
    rows += expert_parallel_rows(**args, checkpoint=checkpoint)
    more = tensor_parallel_rows(**args, checkpoint=checkpoint) + context_parallel_rows(**args, checkpoint=checkpoint)
    return "\n".join(rows + more)


def context_parallel_rows(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> list[str]:  # fmt: skip
    """Every context-parallel degree's peak with this config's other settings, the all-to-all traffic of one
    micro-batch, and the planner's degree (choice.recommend_context_parallel)."""
    degrees = context_parallel_degrees(model=model, train=train, parallel=parallel, hardware=hardware)
    if len(degrees) == 1 or not hardware.gpu_memory_gb:
        return []
    s, p, hw = model_shape(model), parallel, hardware
    tokens = train.micro_batch_size * train.seq_len  # one micro-batch of a group
    header = f"{'degree':<8}{'tokens/rank':>12}{'activ. GiB':>11}{'peak GiB':>10}  {'fits':<6}{'all-to-all GB':>14}"
    rows = ["", f"context parallelism at {train.micro_batch_size} x {train.seq_len} tokens per group and micro-batch:",
            header]  # fmt: skip
    for c in degrees:
        m = plan_for(model=model, train=train, parallel=replace(p, context_parallel=c), hardware=hw, finetune=finetune)
        sent = context_parallel_bytes(s, p.mixed_precision, p.activation_checkpointing, p.tensor_parallel, c, tokens)
        this = "   <- this config" if c == p.context_parallel else ""
        fits = "yes" if m.fits(hw.gpu_memory_gb) else "no"
        rows.append(f"{c:<8}{tokens // c:>12}{m.activations / GIB:>11.1f}{m.total / GIB:>10.1f}  {fits:<6}"
                    f"{sent / 1e9:>14.1f}{this}")  # fmt: skip
    best = recommend_context_parallel(model=model, train=train, parallel=parallel, hardware=hardware,
                                      finetune=finetune, checkpoint=checkpoint)  # fmt: skip
    rows.append(f"planner's context_parallel: {best} (the smallest degree with which a plan fits)")
    if p.context_parallel > 1:
        seconds = context_parallel_seconds(s, train=train, parallel=p, hardware=hw)
        rows.append(f"this config's all-to-alls: {seconds:.2f} s per step on the link inside a node, which compute "
                    "waits for")  # fmt: skip
    return rows


def tensor_parallel_rows(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> list[str]:  # fmt: skip
    """Every tensor-parallel degree's cheapest plan and estimated step (choice.estimate_tensor_parallel)."""
    degrees = tensor_parallel_degrees(model=model, train=train, hardware=hardware,
                                      context_parallel=parallel.context_parallel)  # fmt: skip
    if len(degrees) == 1 or not hardware.gpu_memory_gb:
        return []
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune,
                checkpoint=checkpoint)  # fmt: skip
    base = max(train.micro_batch_size // parallel.tensor_parallel, 1)  # sequences per GPU
    rows = ["", f"tensor parallelism at {train.seq_len} tokens, from {base} sequence(s) per GPU:",
            f"{'degree':<8}{'micro':>6}  {'plan (AC, sharding, offload)':<30}{'compute s':>10}{'FSDP s':>8}"
            f"{'TP s':>7}{'step s':>8}{'s / 1M tokens':>15}"]  # fmt: skip
    for degree in degrees:
        e = estimate_tensor_parallel(**args, degree=degree, base_micro_batch=base)
        this = "   <- this config" if degree == parallel.tensor_parallel else ""
        if e is None:
            rows.append(f"{degree:<8}{'-':>6}  nothing fits{this}")
            continue
        choice = f"{e.ac}, {e.sharding}, {'yes' if e.cpu_offload else 'no'}"
        per_million = e.seconds_per_token * 1e6
        seconds = f"{e.compute_s:>10.2f}{e.fsdp_s:>8.2f}{e.degree_s:>7.2f}{e.step_s:>8.2f}{per_million:>15.1f}"
        rows.append(f"{degree:<8}{e.micro_batch_size:>6}  {choice:<30}{seconds}{this}")
    best = recommend_tensor_parallel(**args, base_micro_batch=base)
    rows.append(f"planner's tensor_parallel: {best} (no CPU offload if any degree avoids it, then the fewest "
                "seconds per token; TP's collectives are not overlapped)")  # fmt: skip
    return rows


def expert_parallel_rows(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> list[str]:  # fmt: skip
    """A mixture of experts: the all-to-alls of this config, and every expert-parallel degree's cheapest plan and
    estimated step (choice.estimate_expert_parallel)."""
    s, hw = model_shape(model), hardware
    if not s.experts:
        return []
    a2a = expert_parallel_seconds(s, train=train, parallel=parallel, hardware=hw)
    rows = ["", f"experts: {s.experts} per layer, {s.top_k} a token; expert_parallel={parallel.expert_parallel}: "
            f"all-to-alls {a2a:.3f} s a step on the link inside a node (not overlapped)"]  # fmt: skip
    degrees = expert_parallel_degrees(model=model, hardware=hw)
    if len(degrees) == 1 or not hw.gpu_memory_gb:
        return rows
    args = dict(model=model, train=train, parallel=parallel, hardware=hw, finetune=finetune, checkpoint=checkpoint)
    rows.append(f"{'degree':<8}{'micro':>6}  {'plan (AC, sharding, offload)':<30}{'compute s':>10}{'FSDP s':>8}"
                f"{'a2a s':>7}{'step s':>8}{'s / 1M tokens':>15}")  # fmt: skip
    for degree in degrees:
        e = estimate_expert_parallel(**args, degree=degree, base_micro_batch=train.micro_batch_size)
        this = "   <- this config" if degree == parallel.expert_parallel else ""
        if e is None:
            rows.append(f"{degree:<8}{'-':>6}  nothing fits{this}")
            continue
        choice = f"{e.ac}, {e.sharding}, {'yes' if e.cpu_offload else 'no'}"
        seconds = (
            f"{e.compute_s:>10.2f}{e.fsdp_s:>8.2f}{e.degree_s:>7.2f}{e.step_s:>8.2f}{e.seconds_per_token * 1e6:>15.1f}"
        )
        rows.append(f"{degree:<8}{e.micro_batch_size:>6}  {choice:<30}{seconds}{this}")
    best = recommend_expert_parallel(**args, base_micro_batch=train.micro_batch_size)
    rows.append(f"planner's expert_parallel: {best} (no CPU offload if any degree avoids it, then the fewest seconds "
                "per token; the all-to-alls are not overlapped)")  # fmt: skip
    return rows


def lora_lines(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, unit: float, unit_name: str,
) -> list[str]:  # fmt: skip
    """With LoRA: the adapters trained, and the peak of the same plan with full fine-tuning, which is what
    LoRA saves."""
    if finetune.method != "lora":
        return []
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune)
    s = model_shape(model)
    adapters = s.L * adapter_params(s, **lora_of(finetune=finetune))
    lora, full = plan_for(**args).total, plan_for(**args, method="full").total
    return [
        f"finetune: lora, rank {finetune.lora_rank}, lora_targets {finetune.lora_targets}: {adapters / 1e6:.2f}M "
        f"trained parameters ({adapters / s.P:.2%}); peak {lora / unit:.1f} {unit_name} against {full / unit:.1f} "
        "with full fine-tuning"
    ]
