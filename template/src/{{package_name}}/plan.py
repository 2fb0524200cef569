"""The per-rank memory and communication plan, from the live config.

    python -m <package>.plan --config configs/<size>.toml
    python -m <package>.plan --detect [--config configs/<size>.toml]

The first prints what every sharding choice costs per rank and which one the config uses. The
second detects this machine's accelerators (hardware.py, the template's hwprobe.py) and, when they
differ from the hardware the repo was generated for, prints the plan on them and the
`copier update` command that re-sizes the repo. At start-up the trainer checks the plan against
the live world size and device memory (`check_plan`).

The formulas are the template's hooks/plan.jinja, which chose the defaults at generation time;
the template's tests check that both agree. For P parameters (Pb per block, Pn outside the
blocks), L blocks, hidden size h, key/value width kv, SwiGLU width f, vocabulary V, compute
dtype of p bytes and T = micro_batch_size * seq_len tokens, bytes per rank are:

    params, grads, optim   4P, 4P and 8P over the G ranks of a shard group: fp32 parameters,
                 gradients and AdamW's two moments (on the host with CPU offload). FSDP2 keeps
                 sharded parameters in their original dtype: these are the fp32 master weights.
                 DDP with parallel.zero_optimizer splits only the 8P over all ranks (ZeRO-1;
                 ZeroRedundancyOptimizer hands out whole parameters, so a rank may own a little more).
    gathered     parameters all-gathered in the compute dtype: 2 Pb p + Pn p for full and hybrid
                 (the running and the prefetched block, plus the embedding/head group; (1 + n) Pb p
                 with parallel.prefetch_blocks = n >= 2), P p for
                 shard_grad_op (nothing is freed until backward), P p for DDP under autocast.
    gradbuf      Pb (p + 4): one block's unsharded gradient and its fp32 reduce-scatter input.
    activations  T [L a + V (p + 12)], where the V term is the logits, their fp32 copy, the
                 log-softmax output and its gradient, and a, the bytes autograd keeps per token
                 per block (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198, redone for
                 SwiGLU and fused attention, which stores no seq x seq scores), is
                   none       16h + p (5h + 2kv + 4f)   each RMSNorm keeps its input and normalised
                              output in fp32 (2 x 8h); then the norm outputs, q, k, v, attention
                              output and its re-laid-out copy, w1, w3, silu and their product
                   selective  p (5h + 2kv + 2f)   block input + every matmul and attention output
                   full       p h                 block input, plus one block recomputed at a time
                 (tests/test_plan.py measures these with torch's MemTracker.)

The peak is params + optim + gathered + gradbuf + activations + the gradients alive during the
forward pass: none with one micro-batch per step (zero_grad(set_to_none) frees them first);
with accumulation the sharded 4P/G, or 4P when FSDP keeps unsharded fp32 gradients until the
last micro-batch (gradient sync skipped, the default). A plan fits when its peak is at most 90%
of device memory; the rest covers the CUDA context, NCCL buffers and allocator fragmentation,
which `max_memory_allocated` does not count.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import hardware
from .config import Config, HardwareConfig, UsageError, load_config
from .models import ModelShape

logger = logging.getLogger(__name__)

HEADROOM = 0.9
GIB = 2**30
SHARDINGS = ("no_shard", "shard_grad_op", "full", "hybrid")
AC_MODES = ("none", "selective", "full")
# Effective per-GPU bandwidth of each link in GB/s, for ring collectives (rough, conservative).
LINK_GBPS = {"nvlink": 150.0, "pcie": 16.0, "infiniband": 25.0, "ethernet": 3.0, "": 150.0}
# Dense bf16 peak TFLOP/s by generation, for the compute side of the communication estimate.
ARCH_TFLOPS = {"blackwell": 2250.0, "hopper": 989.0, "ada": 362.0, "ampere": 312.0, "turing": 65.0, "volta": 125.0}


@dataclass(frozen=True)
class MemoryPlan:
    params: float
    grads: float
    optim: float
    grads_live: float
    """Gradient bytes alive during the forward pass (accumulation only)."""
    gathered: float
    gradbuf: float
    activations: float
    host: float
    """Bytes kept in host memory by CPU offload."""

    @property
    def total(self) -> float:
        """Peak bytes on the device."""
        resident = 0 if self.host else self.params + self.optim
        return resident + self.grads_live + self.gathered + self.gradbuf + self.activations

    def fits(self, gpu_memory_gb: float) -> bool:
        return self.total <= HEADROOM * gpu_memory_gb * GIB


def shard_group(sharding: str, gpus_per_node: int, num_nodes: int) -> int:
    """Ranks that share one copy of the model state."""
    return {"hybrid": gpus_per_node, "no_shard": 1}.get(sharding, gpus_per_node * num_nodes)


def memory_plan(
    s: ModelShape, *, seq_len: int, micro_batch_size: int, precision: str, ac: str, sharding: str,
    cpu_offload: bool, gpus_per_node: int, num_nodes: int, grad_accum: int = 1, sync_every_microbatch: bool = False,
    zero_optimizer: bool = False, prefetch_blocks: int = 0, float8: str = "none",
) -> MemoryPlan:  # fmt: skip
    """Bytes per rank of each term (see the module docstring)."""
    p = 4 if precision == "fp32" else 2
    block = block_gather_bytes(s, p, sharding, float8)
    group = shard_group(sharding, gpus_per_node, num_nodes)
    params, grads, optim = 4 * s.P / group, 4 * s.P / group, 8 * s.P / group
    if sharding == "no_shard" and zero_optimizer:
        optim = 8 * s.P / (gpus_per_node * num_nodes)
    if grad_accum == 1 or (cpu_offload and (sync_every_microbatch or sharding == "hybrid")):
        grads_live = 0
    elif sharding in ("no_shard", "hybrid") or sync_every_microbatch:
        grads_live = grads
    else:
        grads_live = 4 * s.P  # FSDP accumulates unsharded fp32 gradients while sync is off
    if sharding == "shard_grad_op":
        gathered = s.L * block + s.Pn * p
    elif sharding == "no_shard":
        gathered = s.P * p if p < 4 else 0
    else:
        gathered = (1 + max(prefetch_blocks, 1)) * block + s.Pn * p
    gradbuf = 0 if sharding == "no_shard" else s.Pb * (p + 4)
    full_layer = activation_bytes_per_token(s, precision, "none")
    tokens = (s.tokens or seq_len) * micro_batch_size
    logits = (s.logits or seq_len) * micro_batch_size
    extra = full_layer if ac == "full" else 0  # the one block being recomputed in backward
    activations = tokens * (s.L * activation_bytes_per_token(s, precision, ac) + extra) + logits * s.V * (p + 12)
    host = params + grads + optim if cpu_offload else 0
    return MemoryPlan(params, grads, optim, grads_live, gathered, gradbuf, activations, host)


def block_gather_bytes(s: ModelShape, p: int, sharding: str, float8: str) -> float:
    """Bytes of one all-gathered block: the compute dtype, or one byte per linear weight when FSDP
    gathers float8 (tensorwise scaling); the two norm weights stay in the compute dtype."""
    if float8 == "tensorwise" and sharding != "no_shard":
        return (s.Pb - 2 * s.h) + 2 * s.h * p
    return s.Pb * p


def activation_bytes_per_token(s: ModelShape, precision: str, ac: str) -> int:
    """Bytes one block keeps for backward, per token (the `a` of the module docstring)."""
    p = 4 if precision == "fp32" else 2
    if ac == "none":
        return 16 * s.h + p * (5 * s.h + 2 * s.kv + 4 * s.f)
    if ac == "selective":
        return p * (5 * s.h + 2 * s.kv + 2 * s.f)
    return p * s.h


def sharding_candidates(num_nodes: int, inter_node_link: str) -> tuple[str, ...]:
    """Least communication first; hybrid ahead of full when the link between nodes is slow."""
    if num_nodes > 1 and inter_node_link == "ethernet":
        return ("no_shard", "shard_grad_op", "hybrid", "full")
    if num_nodes > 1:
        return ("no_shard", "shard_grad_op", "full", "hybrid")
    return ("no_shard", "shard_grad_op", "full")


def grad_accum(cfg: Config) -> int:
    """Micro-batches per step on the planned world size (1 when the batch does not split)."""
    world = cfg.hardware.gpus_per_node * cfg.hardware.num_nodes
    return max(cfg.train.global_batch_size // (cfg.train.micro_batch_size * world), 1)


def plan_for(
    cfg: Config, *, sharding: str | None = None, cpu_offload: bool | None = None, ac: str | None = None,
    zero_optimizer: bool | None = None,
) -> MemoryPlan:  # fmt: skip
    """The memory plan of `cfg` on its planned hardware, optionally with other choices."""
    p, hw, t = cfg.parallel, cfg.hardware, cfg.train
    return memory_plan(
        ModelShape.of(cfg.model), seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
        precision=p.mixed_precision, ac=ac or p.activation_checkpointing, sharding=sharding or p.sharding,
        cpu_offload=p.cpu_offload if cpu_offload is None else cpu_offload,
        gpus_per_node=hw.gpus_per_node, num_nodes=hw.num_nodes,
        grad_accum=grad_accum(cfg), sync_every_microbatch=p.grad_sync_every_microbatch,
        zero_optimizer=p.zero_optimizer if zero_optimizer is None else zero_optimizer,
        prefetch_blocks=p.prefetch_blocks, float8=p.float8,
    )  # fmt: skip


def recommend(cfg: Config) -> tuple[str, str, bool]:
    """The cheapest (activation checkpointing, sharding, offload) that fits the device.

    Sharding harder is tried before recomputing (recomputation costs every step), and CPU
    offload only when nothing else fits. DDP with a ZeRO optimizer is never the pick:
    shard_grad_op splits the gradients as well, and sends less (one all-gather and a
    reduce-scatter against an all-reduce and a broadcast).
    """
    hw = cfg.hardware
    if hw.accelerator == "cpu":
        return "none", "full", False
    for offload in (False, True):
        for ac in AC_MODES:
            for sharding in sharding_candidates(hw.num_nodes, hw.inter_node_link):
                if offload and sharding == "no_shard":
                    continue
                plan = plan_for(cfg, sharding=sharding, cpu_offload=offload, ac=ac, zero_optimizer=False)
                if plan.fits(hw.gpu_memory_gb):
                    return ac, sharding, offload
    return "full", "full", True


def communication_bytes(
    s: ModelShape, sharding: str, precision: str, gpus_per_node: int, num_nodes: int, zero_optimizer: bool = False,
    float8: str = "none",
) -> dict:  # fmt: skip
    """Bytes each rank sends per optimizer step, within a node and across nodes (ring collectives).

    full and hybrid gather parameters twice (forward and backward) and reduce-scatter fp32
    gradients once; shard_grad_op gathers once; DDP all-reduces fp32 gradients (2x the data),
    and with ZeRO also broadcasts the fp32 parameters each rank updated.
    """
    p = 4 if precision == "fp32" else 2
    world = gpus_per_node * num_nodes
    gather = s.L * block_gather_bytes(s, p, sharding, float8) + s.Pn * p  # one all-gather of every parameter
    if sharding == "no_shard":
        volume, group = (3 if zero_optimizer else 2) * s.P * 4, world
    elif sharding == "shard_grad_op":
        volume, group = gather + s.P * 4, world
    else:
        volume, group = 2 * gather + s.P * 4, (gpus_per_node if sharding == "hybrid" else world)
    sent = volume * (group - 1) / group
    if sharding == "hybrid":  # plus the all-reduce of each shard across the nodes
        return {"intra": sent, "inter": 2 * (s.P / gpus_per_node) * 4 * (num_nodes - 1) / num_nodes}
    return {"intra": sent if num_nodes == 1 else 0.0, "inter": sent if num_nodes > 1 else 0.0}


def step_seconds(s: ModelShape, cfg: Config, sharding: str, zero_optimizer: bool = False) -> tuple[float, float]:
    """(compute, communication) seconds per step, assuming 40% MFU and the link speeds above."""
    hw, t = cfg.hardware, cfg.train
    world = hw.gpus_per_node * hw.num_nodes
    tokens_per_rank = t.global_batch_size * t.seq_len / world
    compute = 6 * s.P * tokens_per_rank / (0.4 * ARCH_TFLOPS.get(hw.gpu_arch, 312.0) * 1e12)
    p = cfg.parallel
    sent = communication_bytes(s, sharding, p.mixed_precision, hw.gpus_per_node, hw.num_nodes, zero_optimizer, p.float8)
    comm = sent["intra"] / (LINK_GBPS[hw.intra_node_link] * 1e9) + sent["inter"] / (LINK_GBPS[hw.inter_node_link] * 1e9)
    return compute, comm


def device_memory_gb(device: torch.device) -> float | None:
    """Total memory of the live device in GiB; None on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    if device.type == "xpu":
        return torch.xpu.get_device_properties(device).total_memory / GIB
    return None


def check_plan(cfg: Config, world_size: int, device: torch.device) -> None:
    """Refuse to start when the live job contradicts the plan the repo was generated with.

    Applies when the run is on the planned kind of device and `hardware.enforce` is set (the
    preset configs); the debug config and CPU fallbacks only log the plan.
    """
    hw = cfg.hardware
    planned = hw.gpus_per_node * hw.num_nodes
    if device.type != hw.accelerator:
        logger.info("running on %s, not the planned %s: the hardware plan is not checked", device.type, hw.accelerator)
        return
    problems = []
    if world_size != planned:
        problems.append(
            f"launched on {world_size} ranks but the plan is for {planned} "
            f"({hw.num_nodes} node(s) x {hw.gpus_per_node})"
        )
    live = device_memory_gb(device)
    plan = plan_for(cfg)
    if live is not None and not plan.fits(live):
        problems.append(
            f"the plan needs {plan.total / GIB:.1f} GiB per device and this {device.type} has {live:.1f} GiB "
            f"({HEADROOM:.0%} usable)"
        )
    if problems and hw.enforce:
        raise UsageError(
            "; ".join(problems) + ". Launch the planned world size, or re-plan for this machine: "
            f"`python -m {__package__}.plan --config <file>` shows every option, and "
            "`copier update --defaults -d gpus_per_node=N -d gpu_memory_gb=M` regenerates the configs "
            "(or set hardware.enforce = false to run anyway)"
        )
    for problem in problems:
        logger.warning("%s (hardware.enforce is off: continuing)", problem)


def format_table(cfg: Config) -> str:
    """Per-rank memory and per-step communication of every sharding choice for this config."""
    s, hw, p = ModelShape.of(cfg.model), cfg.hardware, cfg.parallel
    unit, unit_name = (GIB, "GiB") if plan_for(cfg, sharding="no_shard").total >= GIB else (2**20, "MiB")
    widths = (15, 8, 11, 7, 10, 8, 10, 6, 8, 13)

    def line(*values) -> str:
        return "".join(
            f"{v:<{w}}" if i in (0, 7) else f"{v:>{w}}" for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    rows = [
        f"{cfg.model.preset}: {s.P / 1e9:.2f}B parameters; per rank {cfg.train.micro_batch_size} x {cfg.train.seq_len} "
        f"tokens x {grad_accum(cfg)} micro-batch(es); {p.mixed_precision}; activation checkpointing "
        f"{p.activation_checkpointing}",
        f"hardware: {hw.num_nodes} node(s) x {hw.gpus_per_node} {hw.accelerator}"
        + (f", {hw.gpu_memory_gb:g} GiB each ({HEADROOM * hw.gpu_memory_gb:.1f} usable)" if hw.gpu_memory_gb else ""),
        "",
        line(
            "sharding",
            "offload",
            "params+opt",
            "grads",
            "gathered",
            "activ.",
            f"peak {unit_name}",
            "  fits",
            "comm GB",
            "comm/compute",
        ),  # fmt: skip
    ]
    choices = [("no_shard", False, False), ("no_shard", False, True)] + [
        (x, offload, False) for x in SHARDINGS[1:] if x != "hybrid" or hw.num_nodes > 1 for offload in (False, True)
    ]
    for sharding, offload, zero in choices:
        m = plan_for(cfg, sharding=sharding, cpu_offload=offload, zero_optimizer=zero)
        compute, comm = step_seconds(s, cfg, sharding, zero)
        sent = communication_bytes(s, sharding, p.mixed_precision, hw.gpus_per_node, hw.num_nodes, zero)
        fits = "yes" if not hw.gpu_memory_gb or m.fits(hw.gpu_memory_gb) else "no"
        resident = 0 if offload else m.params + m.optim
        sizes = [f"{b / unit:.1f}" for b in (resident, m.grads_live, m.gathered + m.gradbuf, m.activations, m.total)]
        this = (sharding, offload, zero) == (p.sharding, p.cpu_offload, p.zero_optimizer)
        name, sent_gb = sharding + ("+zero" if zero else ""), sum(sent.values()) / 1e9
        row = line(name, "yes" if offload else "no", *sizes, f"  {fits}", f"{sent_gb:.1f}", f"{comm / compute:.2f}")
        rows.append(row + ("   <- this config" if this else ""))
    ac, sharding, offload = recommend(cfg)
    rows += [
        "",
        f"planner's choice: sharding={sharding}, activation_checkpointing={ac}, cpu_offload={offload}",
        "comm/compute: estimated communication time over compute time per step (40% MFU); above 1, FSDP cannot "
        "hide the communication behind compute",
    ]
    return "\n".join(rows)


# copier.yml's hardware questions, in its order.
HARDWARE_QUESTIONS = ("accelerator", "gpu_arch", "gpus_per_node", "gpu_memory_gb", "intra_node_link")
DEFAULT_BACKEND = {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo"}


def default_precision(hw: HardwareConfig) -> str:
    """copier.yml's default mixed_precision: no bf16 before Ampere, fp32 on CPU."""
    if hw.accelerator == "cpu":
        return "fp32"
    return "fp16" if hw.accelerator == "cuda" and hw.gpu_arch in ("turing", "volta") else "bf16"


def asked(question: str, hw: HardwareConfig) -> bool:
    """Whether copier.yml asks `question` on this hardware (its `when:` conditions)."""
    return {
        "gpu_arch": hw.accelerator == "cuda",
        "gpu_memory_gb": hw.accelerator != "cpu",
        "intra_node_link": hw.accelerator != "cpu" and hw.gpus_per_node > 1,
    }.get(question, True)


def live_hardware(planned: HardwareConfig, detected: dict) -> HardwareConfig:
    """The planned hardware as `detected` on this machine (copier answers, as hardware.detect gives them).

    num_nodes and inter_node_link stay as planned: one machine cannot see the others. CPU ranks
    are a choice rather than hardware, so a CPU plan keeps its own number of them.
    """
    accelerator = detected.get("accelerator")
    if accelerator not in DEFAULT_BACKEND:
        raise ValueError(f"detected accelerator={accelerator!r}: expected one of cuda, xpu, cpu")
    if accelerator == "cpu":
        ranks = planned.gpus_per_node if planned.accelerator == "cpu" else int(detected.get("gpus_per_node", 2))
        return replace(
            planned, accelerator="cpu", gpu_arch="", gpus_per_node=ranks, gpu_memory_gb=0.0, intra_node_link=""
        )
    same_kind = planned.accelerator == accelerator
    memory = float(detected.get("gpu_memory_gb") or (planned.gpu_memory_gb if same_kind else 0))
    if not memory:
        raise ValueError(
            "the probe could not read the device memory: write `gpu_memory_gb: <GiB>` into its YAML "
            f"(`python -m {__package__}.hardware --out hw.yml`) and pass it with --detected hw.yml"
        )
    gpus = int(detected["gpus_per_node"])
    arch = str(detected.get("gpu_arch", planned.gpu_arch if same_kind else "")) if accelerator == "cuda" else ""
    link = str(detected.get("intra_node_link", planned.intra_node_link)) if gpus > 1 else ""
    return replace(
        planned, accelerator=accelerator, gpu_arch=arch, gpus_per_node=gpus, gpu_memory_gb=memory, intra_node_link=link
    )


def with_answers(cfg: Config, live: HardwareConfig, answers: dict) -> Config:
    """`cfg` as `copier update -d answers` would render it on `live`, keeping its micro-batches per step."""
    world = live.gpus_per_node * live.num_nodes
    parallel_keys = ("mixed_precision", "compile", "sharding", "activation_checkpointing", "cpu_offload")
    return replace(
        cfg,
        hardware=live,
        train=replace(cfg.train, global_batch_size=cfg.train.micro_batch_size * world * grad_accum(cfg)),
        dist=replace(cfg.dist, backend=answers.get("backend", cfg.dist.backend)),
        parallel=replace(cfg.parallel, **{k: answers[k] for k in parallel_keys if k in answers}),
    )


def resize(cfg: Config, live: HardwareConfig) -> dict:
    """The `copier update -d` answers that re-size a repo planned as `cfg` for `live`; empty when it matches.

    The hardware answers that differ; mixed_precision, backend and compile where they were the old
    hardware's defaults or cannot work on the new one (bf16 before Ampere, nccl off CUDA, xccl off
    XPU); and the planner's sharding, activation checkpointing and offload for `live`, because
    `copier update --defaults` keeps the previous answers to every question not given with -d.
    """
    old, p = cfg.hardware, cfg.parallel
    answers: dict = {}
    for question in HARDWARE_QUESTIONS:
        value = getattr(live, question)
        if asked(question, live) and value != getattr(old, question):
            answers[question] = int(value) if isinstance(value, float) and value.is_integer() else value
    if not answers:
        return {}
    precision = p.mixed_precision
    if precision == default_precision(old) or (precision == "bf16" and default_precision(live) == "fp16"):
        precision = default_precision(live)
    backend = cfg.dist.backend
    if backend == DEFAULT_BACKEND[old.accelerator] or backend in ("nccl", "xccl"):
        backend = DEFAULT_BACKEND[live.accelerator]
    compile_ = live.accelerator == "cuda" if p.compile == (old.accelerator == "cuda") else p.compile
    for key, new, now in (
        ("mixed_precision", precision, p.mixed_precision),
        ("backend", backend, cfg.dist.backend),
        ("compile", compile_, p.compile),
    ):
        if new != now:
            answers[key] = new
    ac, sharding, offload = recommend(with_answers(cfg, live, answers))
    return {**answers, "sharding": sharding, "activation_checkpointing": ac, "cpu_offload": offload}


def update_command(answers: dict) -> str:
    """The copier command line that gives a generated repo these answers."""
    values = {k: str(v).lower() if isinstance(v, bool) else v for k, v in answers.items()}
    return "copier update --defaults " + " ".join(f"-d {k}={v}" for k, v in values.items())


def describe(hw: HardwareConfig) -> str:
    details = [hw.gpu_arch, f"{hw.gpu_memory_gb:g} GiB" if hw.accelerator != "cpu" else "", hw.intra_node_link]
    extra = ", ".join(d for d in details if d)
    return f"{hw.num_nodes} node(s) x {hw.gpus_per_node} {hw.accelerator}" + (f" ({extra})" if extra else "")


def detect_report(cfg: Config, detected: dict, how: dict | None = None, preset: Config | None = None) -> str:
    """What `--detect` prints: `cfg`'s planned hardware against `detected`, and how to re-size the repo.

    `preset` is the config of the repo's model_size, which copier plans for (default: `cfg`); the
    table is `cfg`'s plan on the detected hardware with the answers the update would give.
    """
    preset, how = preset or cfg, how or {}
    live = live_hardware(preset.hardware, detected)
    answers = resize(preset, live)
    if not answers:
        return f"This machine matches the hardware the repo was planned for, {describe(live)}: nothing to re-size."
    lines = [f"planned for:   {describe(preset.hardware)}", f"this machine:  {describe(live)}"]
    for question in HARDWARE_QUESTIONS:
        was = getattr(preset.hardware, question)
        if question in answers:
            was = f"{was:g}" if isinstance(was, float) else was or "-"
            lines.append(f"  {question:<16} {was:>7} -> {answers[question]!s:<8} {how.get(question, '')}")
        elif asked(question, live) and question not in detected:
            lines.append(
                f"  {question:<16} {was!s:>7}    not detected: kept as planned (add -d {question}=... to change)"
            )
    if live.num_nodes > 1:
        lines.append(f"  num_nodes={live.num_nodes} and inter_node_link={live.inter_node_link} are kept as planned")
    replanned = with_answers(cfg, live, answers)
    lines += ["", f"The {cfg.model.preset} config on this machine, after the update:", "", format_table(replanned), ""]
    final = with_answers(preset, live, answers)
    if live.accelerator != "cpu" and not plan_for(final).fits(live.gpu_memory_gb):
        lines += [
            f"Nothing fits {preset.model.preset} on {describe(live)}, not even full sharding with CPU offload and full "
            "activation checkpointing: add -d micro_batch_size=N or -d seq_len=N below, or -d model_size=<smaller>.",
            "",
        ]
    lines += [
        "Re-size the repo for this machine (from a clean git checkout; your edits are kept):",
        "",
        "    " + update_command(answers),
    ]
    return "\n".join(lines)


def detect_main(rest: list[str], detected_file: Path | None) -> str:
    """`--detect`: probe this machine (or read a probe's YAML) and compare with the repo's answers."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    config = pre.parse_known_args(rest)[0].config
    # The repo's root holds the answers copier generated it with: model_size names the preset config.
    root = config.resolve().parent.parent if config else Path.cwd()
    answers_file = root / ".copier-answers.yml"
    answers = hardware.read_answers(answers_file.read_text()) if answers_file.is_file() else {}
    preset_file = root / "configs" / f"{answers.get('model_size', '')}.toml"
    if config is None:
        if not preset_file.is_file():
            raise ValueError(
                f"--detect: no .copier-answers.yml in {root} to find the repo's preset config; "
                "run it from the repo root or pass --config configs/<preset>.toml"
            )
        rest = ["--config", str(preset_file), *rest]
    cfg = load_config(rest)
    preset = load_config(["--config", str(preset_file)]) if preset_file.is_file() else cfg
    notes: list[str] = []
    if detected_file is not None:
        if not detected_file.is_file():
            raise ValueError(
                f"--detected {detected_file}: no such file (`python -m {__package__}.hardware --out FILE` writes one)"
            )
        detected = hardware.read_answers(detected_file.read_text())
        how = {key: f"from {detected_file}" for key in detected}
    else:
        found = hardware.detect()
        detected, how, notes = found.answers, found.how, found.notes
    return "\n".join([detect_report(cfg, detected, how, preset), *(f"note: {n}" for n in notes)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--json", action="store_true", help="print the chosen plan as JSON")
    parser.add_argument(
        "--detect", action="store_true", help="compare this machine with the planned hardware; print how to re-size"
    )
    parser.add_argument(
        "--detected",
        type=Path,
        metavar="FILE",
        help=f"--detect with hardware detected elsewhere (`python -m {__package__}.hardware --out FILE` there)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.detect or args.detected:
        print(detect_main(rest, args.detected))
        return
    cfg = load_config(rest)
    if args.json:
        plan = plan_for(cfg)
        print(json.dumps({**asdict(plan), "total": plan.total}))
    else:
        print(format_table(cfg))


if __name__ == "__main__":
    main()
