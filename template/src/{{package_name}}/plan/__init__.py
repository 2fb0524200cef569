"""The per-rank memory and communication plan, from the live config.

    python -m <package>.plan --config configs/<size>.toml
    python -m <package>.plan --detect [--config configs/<size>.toml]

The first prints what every sharding choice costs per rank and which one the config uses. The
second detects this machine's accelerators (hardware.py, the template's hwprobe.py) and, when they
differ from the hardware the repo was generated for, prints the plan on them and the
`copier update` command that re-sizes the repo. At start-up the trainer checks the plan against
the live world size and device memory (`check_plan`). This module holds the formulas, which the
trainer imports; report.py beside it prints the table, resize.py the `--detect` advice, and
__main__.py is the command line (both import the formulas, never the other way round).

The formulas are the template's hooks/plan.jinja, which chose the defaults at generation time;
the template's tests check that both agree. What they know of the model comes from the model
module: its shape (models/spec.py's ModelShape, `SPEC.shape`) gives P parameters (Pb per block,
Pn outside the blocks), L blocks, hidden size h, vocabulary V, a block's linear layers, and the
bytes a block keeps for backward per token, a (`activation_bytes`). For a compute dtype of p
bytes and T = micro_batch_size * seq_len tokens, bytes per rank are:

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
    activations  T [L a + V (p + 12)], plus one block's a with no recomputation under full
                 activation checkpointing (the block recomputed in backward), where the V term is
                 the logits, their fp32 copy, the log-softmax output and its gradient, and a is the
                 model's, for the activation checkpointing mode (models/llama/shape.py documents
                 the built-in blocks', models/hf_causal_lm/shape.py transformers' decoder layers';
                 tests/test_plan.py measures every model's with torch's MemTracker).
    tensor parallelism  with parallel.tensor_parallel = t, every block's matrices, the embedding
                 and the head are split t ways within a node, and the shard group G counts
                 data-parallel ranks (groups of t): params, grads and optim are over G t (the
                 norms' few replicated weights are counted as split), gathered, gradbuf and
                 FSDP's unsharded accumulation gradients over t. The model's a says what its plan
                 splits: what the heads and widths split, and with sequence parallelism (the
                 built-in decoder's plan) the activations between the blocks, which transformers'
                 plans (hf_causal_lm) keep whole. The logits stay whole on every rank (no loss
                 parallelism).

With LoRA (finetune.method=lora, models/lora.py) the P parameters are frozen and A adapter
parameters train, Ab = A / L per block: r (in + out) for each adapted linear layer of rank r (for
the built-in blocks r (9h + 2kv + 3f) with every layer adapted, r (6h + 2kv) attention only,
r (3h + 3f) feed-forward only, for kv the key/value width and f the SwiGLU width). Then
params = (p P + 4A) / G (the frozen weights are stored in the compute dtype, without gradients or
optimizer state; only the adapters keep fp32 master weights), grads = 4A / G, optim = 8A / G;
gathered and gradbuf count each block's Pb + Ab parameters and only Ab gradients (DDP's autocast
copies only the adapters: A p), and a is the model's with adapters (what frozen layers and norms
no longer keep, and each adapter's rank-r intermediate).

The peak is params + optim + gathered + gradbuf + activations + the gradients alive during the
forward pass: none with one micro-batch per step (zero_grad(set_to_none) frees them first);
with accumulation the sharded 4P/G, or 4P when FSDP keeps unsharded fp32 gradients until the
last micro-batch (gradient sync skipped, the default). A plan fits when its peak is at most
HEADROOM (presets.py) of device memory; the rest covers the CUDA context, NCCL buffers and
allocator fragmentation, which `max_memory_allocated` does not count.

Host memory (RAM) is planned per node (host_memory_plan), for r ranks per node, A adapter
parameters, Lmax elements in the largest tensor (the embedding or head, V h, or a block's widest
layer), e = 4 bytes per exported
parameter (p with LoRA, whose export merges into the frozen dtype), F = checkpoint.export_file_gb:

    runtime  r x HOST_MEMORY["runtime_gb"]: each rank's process before any model state (Python,
             torch, the accelerator's libraries; tests/test_plan.py measures a CPU rank's)
    state    r (params + grads + optim) with CPU offload (CPUOffloadPolicy keeps them on the host)
    device   r x peak on CPU ranks, whose device memory is host memory
    staging  r (params + optim) with checkpoint.format=dcp_async: async_save copies each rank's
             checkpoint shard to host memory and writes it while training goes on
    load     r c 4 Lmax: a whole fp32 tensor in transit per rank (a slice read from
             checkpoint.init_from, c = 1; CPU ranks also receive the broadcast of the initial
             weights, strategy.apply_weights_from_rank0, in host memory and copy their shard out
             of it, c = 2; GPUs receive it in device memory). Without checkpoint.init_from also
             4 (P + A) on rank 0, which builds the seeded initial weights whole, and the shards the
             broadcast fills before it loads them, a second r x params where parameters live on
             the host (CPU offload, CPU ranks); with it, 4 A: rank 0 builds the adapters only
    export   2 r min(F, e P) / world + 2 e Lmax with checkpoint.export: each rank's share of an
             export file, gathered on the host and serialised, and the whole tensor rank 0 joins
             at a time with its pieces
    os       HOST_MEMORY["os_gb"]: the kernel, system services, the launcher

Loading ends before training starts, and the last async save may still be written while the
export runs, so the peak is runtime + os + max(start, state + device + staging + export), with
start = load + the parameters alive then (r x params with offload or on CPU ranks). The loaders
start no worker processes (data/ reads in the training process; token files through a memory
map, whose pages are the kernel's cache), so there is no term for them. A plan fits a node when
its peak is at most HOST_MEMORY["headroom"] of its RAM; at start-up `check_plan` compares it with
this node's (MemTotal, or a smaller cgroup limit: hardware.host_memory_mib).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch

from .. import hardware
from ..config import JOB_WIDE, Config, UsageError
from ..models import ModelShape, model_shape, model_spec
from ..presets import EXPORT_FILE_GB, GPU_ARCHS, HEADROOM, HOST_MEMORY, LINK_GBPS, LORA, PEAK_TFLOPS

logger = logging.getLogger(__name__)

GIB = 2**30
SHARDINGS = ("no_shard", "shard_grad_op", "full", "hybrid")
AC_MODES = ("none", "selective", "full")
# Peak TFLOP/s by generation (its flagship device's), for the compute side of the communication
# estimate; XPU and CPU plans assume an A100.
ARCH_TFLOPS = {arch: PEAK_TFLOPS[spec["flagship"]] for arch, spec in GPU_ARCHS.items()}


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


@dataclass(frozen=True)
class HostPlan:
    """Host memory (RAM) of one node, by term, in bytes (see the module docstring)."""

    runtime: float
    state: float
    """Offloaded parameters, gradients and optimizer state."""
    device: float
    """CPU ranks' device plan, which is host memory."""
    staging: float
    """dcp_async's host copy of every rank's checkpoint shard."""
    load: float
    """Initial or pretrained weights in transit, and rank 0's whole initial copy."""
    start: float
    """What loading holds: `load`, and the parameters already allocated."""
    export: float
    os: float

    @property
    def total(self) -> float:
        """Peak bytes of the node: loading, or training with its checkpoint and export buffers."""
        return self.runtime + self.os + max(self.start, self.state + self.device + self.staging + self.export)

    def fits(self, host_memory_gb: float) -> bool:
        """Whether the peak fits a node of this much RAM; 0 (unknown) always does."""
        return not host_memory_gb or self.total <= HOST_MEMORY["headroom"] * host_memory_gb * GIB

    def describe(self) -> str:
        """The terms that make up the peak, in GiB."""
        if self.start > self.state + self.device + self.staging + self.export:
            terms = {"runtime": self.runtime, "loading weights": self.start}
        else:
            terms = {"runtime": self.runtime, "offload": self.state, "CPU ranks": self.device,
                     "async staging": self.staging, "export": self.export}  # fmt: skip
        terms["OS"] = self.os
        return ", ".join(f"{name} {n / GIB:.1f}" for name, n in terms.items() if n) + " GiB"


def shard_group(sharding: str, gpus_per_node: int, num_nodes: int, tensor_parallel: int = 1) -> int:
    """Data-parallel ranks (tensor-parallel groups) that share one copy of the model state."""
    per_node = gpus_per_node // tensor_parallel
    return {"hybrid": per_node, "no_shard": 1}.get(sharding, per_node * num_nodes)


def memory_plan(
    s: ModelShape, *, seq_len: int, micro_batch_size: int, precision: str, ac: str, sharding: str,
    cpu_offload: bool, gpus_per_node: int, num_nodes: int, grad_accum: int = 1, sync_every_microbatch: bool = False,
    zero_optimizer: bool = False, prefetch_blocks: int = 0, float8: str = "none", lora_rank: int = 0,
    lora_targets: str = LORA["targets"], tensor_parallel: int = 1, sequence_parallel: bool = True,
) -> MemoryPlan:  # fmt: skip
    """Bytes per rank of each term (see the module docstring); lora_rank 0 is full fine-tuning."""
    p, t = (4 if precision == "fp32" else 2), tensor_parallel
    adapters = adapter_params(s, lora_rank, lora_targets)  # per block
    trained, trained_block = (s.L * adapters, adapters) if lora_rank else (s.P, s.Pb)
    block = block_gather_bytes(s, p, sharding, float8, adapters) / t
    group = shard_group(sharding, gpus_per_node, num_nodes, t)
    # LoRA stores the frozen weights in the compute dtype (models/lora.py's apply_lora, frozen_dtype).
    stored = p * s.P + 4 * s.L * adapters if lora_rank else 4 * s.P
    params, grads, optim = stored / (group * t), 4 * trained / (group * t), 8 * trained / (group * t)
    if sharding == "no_shard" and zero_optimizer:
        optim = 8 * trained / (gpus_per_node * num_nodes)
    if grad_accum == 1 or (cpu_offload and (sync_every_microbatch or sharding == "hybrid")):
        grads_live = 0
    elif sharding in ("no_shard", "hybrid") or sync_every_microbatch:
        grads_live = grads
    else:
        grads_live = 4 * trained / t  # FSDP accumulates unsharded fp32 gradients while sync is off
    if sharding == "shard_grad_op":
        gathered = s.L * block + s.Pn * p / t
    elif sharding == "no_shard":
        gathered = trained * p / t if p < 4 else 0  # autocast's copies of the fp32 parameters
    else:
        gathered = (1 + max(prefetch_blocks, 1)) * block + s.Pn * p / t
    gradbuf = 0 if sharding == "no_shard" else trained_block * (p + 4) / t
    per_layer = functools.partial(activation_bytes_per_token, s, precision, lora_rank=lora_rank,
                                  lora_targets=lora_targets, tensor_parallel=t,
                                  sequence_parallel=sequence_parallel)  # fmt: skip
    tokens = (s.tokens or seq_len) * micro_batch_size
    logits = (s.logits or seq_len) * micro_batch_size
    extra = per_layer("none") if ac == "full" else 0  # the one block being recomputed in backward
    activations = tokens * (s.L * per_layer(ac) + extra) + logits * s.V * (p + 12)
    host = params + grads + optim if cpu_offload else 0
    return MemoryPlan(params, grads, optim, grads_live, gathered, gradbuf, activations, host)


def host_memory_plan(
    s: ModelShape, m: MemoryPlan, *, accelerator: str, precision: str, gpus_per_node: int, num_nodes: int,
    cpu_offload: bool, lora_rank: int = 0, lora_targets: str = LORA["targets"], checkpoint_format: str = "dcp",
    export: bool = True, init_from: bool = False, export_file_gb: float = EXPORT_FILE_GB,
) -> HostPlan:  # fmt: skip
    """Host bytes of one node for a rank's memory plan `m` (see the module docstring); rank 0's node."""
    r, world, cpu = gpus_per_node, gpus_per_node * num_nodes, accelerator == "cpu"
    p = 4 if precision == "fp32" else 2
    adapters = s.L * adapter_params(s, lora_rank, lora_targets) if lora_rank else 0
    largest = s.largest
    e = p if lora_rank else 4  # bytes per exported parameter
    resident = r * m.params if cpu_offload or cpu else 0  # parameters that live in host memory
    load = r * (2 if cpu else 1) * 4 * largest + (4 * adapters if init_from else 4 * (s.P + adapters) + resident)
    out = r * 2 * min(export_file_gb * 1e9, e * s.P) / world + 2 * e * largest if export else 0
    return HostPlan(
        runtime=r * HOST_MEMORY["runtime_gb"][accelerator] * GIB,
        state=r * m.host,
        device=r * m.total if cpu else 0,
        staging=r * (m.params + m.optim) if checkpoint_format == "dcp_async" else 0,
        load=load,
        start=load + resident,
        export=out,
        os=HOST_MEMORY["os_gb"] * GIB,
    )


def host_plan_for(
    cfg: Config, m: MemoryPlan | None = None, *, cpu_offload: bool | None = None, ranks_per_node: int | None = None,
) -> HostPlan:  # fmt: skip
    """The host plan of `cfg` (with memory plan `m`, default plan_for(cfg)) on a node of `ranks_per_node` ranks."""
    hw, c = cfg.hardware, cfg.checkpoint
    offload = cfg.parallel.cpu_offload if cpu_offload is None else cpu_offload
    return host_memory_plan(
        model_shape(cfg.model), m or plan_for(cfg), accelerator=hw.accelerator,
        precision=cfg.parallel.mixed_precision, gpus_per_node=ranks_per_node or hw.gpus_per_node,
        num_nodes=hw.num_nodes, cpu_offload=offload, **lora_of(cfg), checkpoint_format=c.format,
        export=c.export != "none", init_from=bool(c.init_from), export_file_gb=c.export_file_gb,
    )  # fmt: skip


def block_gather_bytes(s: ModelShape, p: int, sharding: str, float8: str, adapters: int = 0) -> float:
    """Bytes of one all-gathered block (with its `adapters` LoRA parameters): the compute dtype, or one
    byte per linear weight when FSDP gathers float8 (tensorwise scaling); the rest of the block (norms,
    biases) stays in the compute dtype."""
    if float8 == "tensorwise" and sharding != "no_shard":
        return s.linear_params + (s.Pb - s.linear_params) * p
    return (s.Pb + adapters) * p


def adapter_params(s: ModelShape, lora_rank: int, lora_targets: str) -> int:
    """LoRA parameters per block, r (in + out) per adapted layer (the Ab of the module docstring); 0 for rank 0."""
    return s.adapter_params(lora_rank, lora_targets)


def activation_bytes_per_token(
    s: ModelShape, precision: str, ac: str, lora_rank: int = 0, lora_targets: str = LORA["targets"],
    tensor_parallel: int = 1, sequence_parallel: bool = True,
) -> float:  # fmt: skip
    """Bytes one block keeps for backward, per token (the `a` of the module docstring): the model's declaration."""
    return s.activation_bytes(
        4 if precision == "fp32" else 2, ac, lora_rank=lora_rank, lora_targets=lora_targets,
        tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
    )  # fmt: skip


def sharding_candidates(num_nodes: int, inter_node_link: str, tensor_parallel: int = 1) -> tuple[str, ...]:
    """Least communication first; hybrid ahead of full when the link between nodes is slow.

    DDP (no_shard) is not combined with tensor parallelism.
    """
    if num_nodes > 1 and inter_node_link == "ethernet":
        order = ("no_shard", "shard_grad_op", "hybrid", "full")
    elif num_nodes > 1:
        order = ("no_shard", "shard_grad_op", "full", "hybrid")
    else:
        order = ("no_shard", "shard_grad_op", "full")
    return order if tensor_parallel == 1 else order[1:]


def grad_accum(cfg: Config) -> int:
    """Micro-batches per step on the planned world size (1 when the batch does not split)."""
    dp = cfg.hardware.gpus_per_node * cfg.hardware.num_nodes // cfg.parallel.tensor_parallel
    return max(cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp), 1)


def lora_of(cfg: Config, *, finetune: str | None = None) -> dict:
    """The plan's LoRA arguments for `cfg` (or for finetune.method=`finetune`): a rank of 0 is full fine-tuning."""
    f = cfg.finetune
    return {"lora_rank": f.lora_rank if (finetune or f.method) == "lora" else 0, "lora_targets": f.lora_targets}


def plan_for(
    cfg: Config, *, sharding: str | None = None, cpu_offload: bool | None = None, ac: str | None = None,
    zero_optimizer: bool | None = None, finetune: str | None = None,
) -> MemoryPlan:  # fmt: skip
    """The memory plan of `cfg` on its planned hardware, optionally with other choices."""
    p, hw, t = cfg.parallel, cfg.hardware, cfg.train
    return memory_plan(
        model_shape(cfg.model), seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
        precision=p.mixed_precision, ac=ac or p.activation_checkpointing, sharding=sharding or p.sharding,
        cpu_offload=p.cpu_offload if cpu_offload is None else cpu_offload,
        gpus_per_node=hw.gpus_per_node, num_nodes=hw.num_nodes,
        grad_accum=grad_accum(cfg), sync_every_microbatch=p.grad_sync_every_microbatch,
        zero_optimizer=p.zero_optimizer if zero_optimizer is None else zero_optimizer,
        prefetch_blocks=p.prefetch_blocks, float8=p.float8, **lora_of(cfg, finetune=finetune),
        tensor_parallel=p.tensor_parallel, sequence_parallel=sequence_parallel(cfg),
    )  # fmt: skip


def sequence_parallel(cfg: Config) -> bool:
    """Whether cfg's tensor parallelism splits the activations between the blocks by sequence (its model's plan)."""
    if cfg.parallel.tensor_parallel == 1:
        return True  # nothing is split: the formulas agree either way
    plan = model_spec(cfg.model.name).tensor_parallel_plan(cfg.model)
    return plan is None or plan.sequence_parallel


def cheapest(cfg: Config) -> tuple[str, str, bool] | None:
    """The cheapest (activation checkpointing, sharding, offload) that fits the device and the node's RAM; None if
    nothing does.

    Sharding harder is tried before recomputing (recomputation costs every step), and CPU
    offload only when nothing else fits. DDP with a ZeRO optimizer is never the pick:
    shard_grad_op splits the gradients as well, and sends less (one all-gather and a
    reduce-scatter against an all-reduce and a broadcast). CPU ranks have no device budget: full
    sharding without offload, recomputing only where host memory needs it. The host plan takes
    cfg's checkpoint format and export (copier's questions assume dcp and an export, the defaults
    of the later questions, and check the answers to those when they are given).
    """
    hw, cpu = cfg.hardware, cfg.hardware.accelerator == "cpu"
    degree = cfg.parallel.tensor_parallel
    shardings = ("full",) if cpu else sharding_candidates(hw.num_nodes, hw.inter_node_link, degree)
    for offload in (False,) if cpu else (False, True):
        for ac in AC_MODES:
            for sharding in shardings:
                if offload and sharding == "no_shard":
                    continue
                plan = plan_for(cfg, sharding=sharding, cpu_offload=offload, ac=ac, zero_optimizer=False)
                if (cpu or plan.fits(hw.gpu_memory_gb)) and host_plan_for(cfg, plan, cpu_offload=offload).fits(
                    hw.host_memory_gb
                ):
                    return ac, sharding, offload
    return None


def recommend(cfg: Config) -> tuple[str, str, bool]:
    """cheapest(cfg), or the most frugal plan when nothing fits (check_plan and copier then refuse it); CPU ranks
    gain nothing from offload."""
    return cheapest(cfg) or ("full", "full", cfg.hardware.accelerator != "cpu")


def communication_bytes(
    s: ModelShape, sharding: str, precision: str, gpus_per_node: int, num_nodes: int, zero_optimizer: bool = False,
    float8: str = "none", lora_rank: int = 0, lora_targets: str = LORA["targets"], tensor_parallel: int = 1,
) -> dict:  # fmt: skip
    """Bytes each rank sends per optimizer step for FSDP or DDP, within a node and across nodes (ring collectives).

    full and hybrid gather parameters twice (forward and backward) and reduce-scatter fp32
    gradients once; shard_grad_op gathers once; DDP all-reduces fp32 gradients (2x the data),
    and with ZeRO also broadcasts the fp32 parameters each rank updated. With LoRA only the
    adapters have gradients and updates; the frozen weights are still gathered. With tensor
    parallelism a rank moves only its group's 1/t of the parameters, among the data-parallel ranks.
    """
    p, t = (4 if precision == "fp32" else 2), tensor_parallel
    world = gpus_per_node * num_nodes
    adapters = adapter_params(s, lora_rank, lora_targets)
    trained = s.L * adapters if lora_rank else s.P
    gather = (s.L * block_gather_bytes(s, p, sharding, float8, adapters) + s.Pn * p) / t  # one all-gather of everything
    if sharding == "no_shard":
        volume, group = (3 if zero_optimizer else 2) * trained * 4, world
    elif sharding == "shard_grad_op":
        volume, group = gather + trained * 4 / t, world // t
    else:
        volume, group = 2 * gather + trained * 4 / t, (gpus_per_node if sharding == "hybrid" else world) // t
    sent = volume * (group - 1) / group
    if sharding == "hybrid":  # plus the all-reduce of each shard across the nodes
        return {"intra": sent, "inter": 2 * (trained / gpus_per_node) * 4 * (num_nodes - 1) / num_nodes}
    return {"intra": sent if num_nodes == 1 else 0.0, "inter": sent if num_nodes > 1 else 0.0}


def tensor_parallel_bytes(s: ModelShape, precision: str, ac: str, tensor_parallel: int, tokens: int) -> float:
    """Bytes each rank sends per step for tensor parallelism, on the link inside its node (ring collectives).

    In each block, forward all-gathers the sequence before attention and before the feed-forward
    and reduce-scatters after wo and w2: four collectives of the hidden states, which backward
    mirrors (eight; twelve when activation checkpointing runs the forward again). Around the
    blocks, the embedding's reduce-scatter and the head's all-gather and their backward move the
    hidden states four times more, and the head all-gathers the logits. Without sequence
    parallelism one all-reduce (twice the bytes) takes the place of each all-gather and
    reduce-scatter pair: the same traffic. `tokens`: what one tensor-parallel group processes per step.
    """
    p, t = (4 if precision == "fp32" else 2), tensor_parallel
    per_block = 8 if ac == "none" else 12
    return tokens * p * (s.h * (per_block * s.L + 4) + s.V) * (t - 1) / t


def step_seconds(s: ModelShape, cfg: Config, sharding: str, zero_optimizer: bool = False) -> tuple[float, float]:
    """(compute, communication) seconds per step, assuming 40% MFU and the link speeds above.

    6 FLOPs per parameter and token (forward, input and weight gradients); a frozen weight has no
    weight gradient, so with LoRA 4 per frozen parameter and 6 per adapter parameter.
    Communication is FSDP's or DDP's, which overlaps with compute; tensor parallelism's, which
    does not, is tensor_parallel_seconds.
    """
    hw, t, lora = cfg.hardware, cfg.train, lora_of(cfg)
    world = hw.gpus_per_node * hw.num_nodes
    tokens_per_rank = t.global_batch_size * t.seq_len / world
    adapters = s.L * adapter_params(s, **lora)
    flops = 4 * s.P + 6 * adapters if lora["lora_rank"] else 6 * s.P
    compute = flops * tokens_per_rank / (0.4 * ARCH_TFLOPS.get(hw.gpu_arch, ARCH_TFLOPS["ampere"]) * 1e12)
    p = cfg.parallel
    sent = communication_bytes(
        s, sharding, p.mixed_precision, hw.gpus_per_node, hw.num_nodes, zero_optimizer, p.float8, **lora,
        tensor_parallel=p.tensor_parallel,
    )  # fmt: skip
    comm = sent["intra"] / (LINK_GBPS[hw.intra_node_link] * 1e9) + sent["inter"] / (LINK_GBPS[hw.inter_node_link] * 1e9)
    return compute, comm


def tensor_parallel_seconds(s: ModelShape, cfg: Config) -> float:
    """Seconds per step the tensor-parallel collectives take on the link inside a node (compute waits for them)."""
    hw, t, p = cfg.hardware, cfg.train, cfg.parallel
    tokens = t.global_batch_size * t.seq_len * p.tensor_parallel // (hw.gpus_per_node * hw.num_nodes)
    sent = tensor_parallel_bytes(s, p.mixed_precision, p.activation_checkpointing, p.tensor_parallel, tokens)
    return sent / (LINK_GBPS[hw.intra_node_link] * 1e9)


@dataclass(frozen=True)
class TensorParallelEstimate:
    """The cheapest plan with one tensor-parallel degree, and what a step of it is estimated to cost."""

    degree: int
    micro_batch_size: int
    """Sequences per forward pass of a group: the largest of base x degree and its halvings that fits."""
    ac: str
    sharding: str
    cpu_offload: bool
    compute_s: float
    """Seconds of compute per step (40% MFU; full activation checkpointing adds a third)."""
    fsdp_s: float
    """Seconds of FSDP's communication per step, which overlaps with compute."""
    tp_s: float
    """Seconds of tensor parallelism's communication per step, which does not."""
    tokens: int
    """Tokens per step over all ranks (a global batch of micro_batch_size per data-parallel rank)."""

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.fsdp_s) + self.tp_s

    @property
    def seconds_per_token(self) -> float:
        return self.step_s / self.tokens


def tensor_parallel_degrees(cfg: Config) -> list[int]:
    """1, and the powers of two that divide the GPUs per node and split the model (its spec's tp_plan)."""
    hw, plan = cfg.hardware, model_spec(cfg.model.name).tensor_parallel_plan(cfg.model)
    if hw.accelerator == "cpu" or plan is None:
        return [1]
    degrees, t = [1], 2
    while t <= hw.gpus_per_node:
        if hw.gpus_per_node % t == 0 and not plan.check(cfg.model, t, cfg.train.seq_len):
            degrees.append(t)
        t *= 2
    return degrees


def estimate_tensor_parallel(cfg: Config, degree: int, base_micro_batch: int) -> TensorParallelEstimate | None:
    """The cheapest plan with `degree` at cfg's sequence length; None when no micro-batch fits.

    A group of `degree` GPUs starts from `base_micro_batch` sequences per GPU, so its micro-batch
    (and the global batch) matches FSDP alone's until the memory runs out.
    """
    hw, s = cfg.hardware, model_shape(cfg.model)
    world, precision = hw.gpus_per_node * hw.num_nodes, cfg.parallel.mixed_precision
    for i in range(12):
        micro = base_micro_batch * degree // 2**i
        if micro < 1:
            return None
        train = replace(cfg.train, micro_batch_size=micro, global_batch_size=micro * world // degree)
        trial = replace(cfg, parallel=replace(cfg.parallel, tensor_parallel=degree), train=train)
        choice = cheapest(trial)
        if choice:
            break
    else:
        return None
    ac, sharding, offload = choice
    tokens = micro * cfg.train.seq_len  # per group and step
    peak = ARCH_TFLOPS.get(hw.gpu_arch, ARCH_TFLOPS["ampere"]) * 1e12
    compute = 6 * s.P * tokens / degree / (0.4 * peak) * (4 / 3 if ac == "full" else 1)
    sent = communication_bytes(s, sharding, precision, hw.gpus_per_node, hw.num_nodes, False, cfg.parallel.float8,
                               tensor_parallel=degree)  # fmt: skip
    fsdp = sent["intra"] / (LINK_GBPS[hw.intra_node_link] * 1e9) + sent["inter"] / (LINK_GBPS[hw.inter_node_link] * 1e9)
    tp = tensor_parallel_bytes(s, precision, ac, degree, tokens) / (LINK_GBPS[hw.intra_node_link] * 1e9)
    return TensorParallelEstimate(degree, micro, ac, sharding, offload, compute, fsdp, tp, tokens * world // degree)


def recommend_tensor_parallel(cfg: Config, base_micro_batch: int) -> int:
    """The tensor-parallel degree with the cheapest estimated plan: without CPU offload if any fits,
    then the fewest seconds per token; 1 unless a larger degree is strictly better.

    Tensor parallelism divides what FSDP moves between nodes (each rank gathers 1/t of the
    parameters) and the activations of one sequence, and adds collectives on the link inside a
    node that compute waits for: it wins where FSDP alone needs offload, or its communication
    cannot hide behind compute.
    """
    best, key = 1, None
    for degree in tensor_parallel_degrees(cfg):
        found = estimate_tensor_parallel(cfg, degree, base_micro_batch)
        if found is not None and (key is None or (found.cpu_offload, found.seconds_per_token) < key):
            best, key = degree, (found.cpu_offload, found.seconds_per_token)
    return best


def device_memory_gb(device: torch.device) -> float | None:
    """Total memory of the live device in GiB; None on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    if device.type == "xpu":
        return torch.xpu.get_device_properties(device).total_memory / GIB
    return None


def check_plan(cfg: Config, world_size: int, device: torch.device, ranks_per_node: int | None = None) -> None:
    """Refuse to start when the live job contradicts the plan the repo was generated with.

    Applies when the run is on the planned kind of device and `hardware.enforce` is set (the
    preset configs); the debug config and CPU fallbacks only log the plan. The host plan is for
    `ranks_per_node` ranks (the launch's LOCAL_WORLD_SIZE; default: the plan's) against this
    node's RAM.
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
    live, degree = device_memory_gb(device), cfg.parallel.tensor_parallel
    if hw.gpus_per_node % degree:  # the planned hardware has no plan with this degree to check
        problems.append(
            f"parallel.tensor_parallel={degree} does not split the plan's {hw.gpus_per_node} ranks per node into groups"
        )
    elif live is not None and not (plan := plan_for(cfg)).fits(live):
        problems.append(
            f"the plan needs {plan.total / GIB:.1f} GiB per device and this {device.type} has {live:.1f} GiB "
            f"({HEADROOM:.0%} usable)"
        )
    message = "; ".join(problems) + (
        ". Launch the planned world size, or re-plan for this machine: "
        f"`python -m {__name__} --config <file>` shows every option, and "
        "`copier update --defaults -d gpus_per_node=N -d gpu_memory_gb=M` regenerates the configs"
        if problems
        else ""
    )
    # Nor a host plan: a degree that splits no node into groups leaves no data-parallel rank to plan for.
    host = check_host_memory(cfg, ranks_per_node or hw.gpus_per_node) if not hw.gpus_per_node % degree else ""
    if host:
        problems.append(host)
        message = f"{message}. {host[0].upper()}{host[1:]}" if message else host
    if problems and hw.enforce:
        raise UsageError(f"{message} (or set hardware.enforce = false to run anyway)")
    for problem in problems:
        logger.warning("%s (hardware.enforce is off: continuing)", problem, extra=JOB_WIDE)


def check_host_memory(cfg: Config, ranks_per_node: int, ram_gib: float | None = None) -> str:
    """Why `cfg`'s host plan does not fit this node's RAM (`ram_gib`, default: read from the machine), or ""."""
    if ram_gib is None:
        found = hardware.host_memory_mib()
        if found is None:
            return ""  # no /proc/meminfo: nothing to compare with
        ram_gib = found[0] / 1024
    host = host_plan_for(cfg, ranks_per_node=ranks_per_node)
    if host.fits(ram_gib):
        return ""
    fixes = ["fewer ranks per node"] if ranks_per_node > 1 else []
    fixes.append("more nodes")
    if cfg.parallel.cpu_offload:
        fixes.append("parallel.cpu_offload=false")
    if cfg.checkpoint.format == "dcp_async":
        fixes.append("checkpoint.format=dcp")
    fix = f"{', '.join(fixes[:-1])} or {fixes[-1]}" if len(fixes) > 1 else fixes[0]
    return (
        f"the plan needs {host.total / GIB:.1f} GiB of host memory per node ({host.describe()}) and this node has "
        f"{ram_gib:.1f} GiB ({HOST_MEMORY['headroom']:.0%} usable): {fix}"
    )
