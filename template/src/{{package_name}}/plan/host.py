"""Host memory (RAM) per node. A node's RAM is shared by all its ranks and holds what the devices do
not: offloaded state, async checkpoint staging, weights in transit, exports. Running out of it kills
the job long after start-up (the kernel's OOM killer, or swapping), so the trainer checks this plan
against the node's RAM before it starts. The template's hooks/plan.jinja computes the same at question
time (host_memory_plan, check_host_memory)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import hardware as machine
from ..config import CheckpointConfig, FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig
from ..models import ModelConfig, ModelShape, model_shape
from ..presets import EXPORT_FILE_GB, HOST_MEMORY, LORA
from .memory import GIB, MemoryPlan, adapter_params, lora_of, plan_for


@dataclass(frozen=True)
class HostPlan:
    """Host memory (RAM) of one node, by term, in bytes (host_memory_plan says how each is counted)."""

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
    parked: float = 0.0
    """Block inputs that activation offload keeps in pinned host memory during a step."""

    @property
    def total(self) -> float:
        """Peak bytes of the node. Loading ends before training starts, and the last async save may still be
        written while the export runs: runtime + os + max(start, state + device + parked + staging + export)."""
        return self.runtime + self.os + max(self.start, self.training)

    @property
    def training(self) -> float:
        """What training holds, besides the runtime and the OS."""
        return self.state + self.device + self.parked + self.staging + self.export

    def fits(self, host_memory_gb: float) -> bool:
        """Whether the peak fits a node of this much RAM; 0 (unknown) always does. HOST_MEMORY["headroom"]
        leaves the rest to the page cache of data and checkpoint files and to the allocator's slack."""
        return not host_memory_gb or self.total <= HOST_MEMORY["headroom"] * host_memory_gb * GIB

    def describe(self) -> str:
        """The terms that make up the peak, in GiB, so that a refusal says what to shrink."""
        if self.start > self.training:
            terms = {"runtime": self.runtime, "loading weights": self.start}
        else:
            terms = {"runtime": self.runtime, "offload": self.state, "CPU ranks": self.device,
                     "activation offload": self.parked, "async staging": self.staging,
                     "export": self.export}  # fmt: skip
        terms["OS"] = self.os
        return ", ".join(f"{name} {n / GIB:.1f}" for name, n in terms.items() if n) + " GiB"


def host_memory_plan(
    s: ModelShape, m: MemoryPlan, *, accelerator: str, precision: str, gpus_per_node: int, num_nodes: int,
    cpu_offload: bool, lora_rank: int = 0, lora_targets: str = LORA["targets"], checkpoint_format: str = "dcp",
    export: bool = True, init_from: bool = False, export_file_gb: float = EXPORT_FILE_GB,
) -> HostPlan:  # fmt: skip
    """Host bytes of rank 0's node for a rank's memory plan `m`, for r = gpus_per_node ranks, A adapter
    parameters, Lmax elements in the largest tensor (ModelShape.largest: the embedding or head, or a
    block's widest layer), e = 4 bytes per exported parameter (p with LoRA, whose export merges into the
    frozen dtype) and F = export_file_gb:

        runtime  r x HOST_MEMORY["runtime_gb"]: each rank's process before any model state (Python,
                 torch, the accelerator's libraries; tests/test_plan.py measures a CPU rank's)
        state    r (params + grads + optim) with CPU offload (CPUOffloadPolicy keeps them on the host)
        device   r x peak on CPU ranks, whose device memory is host memory
        parked   r x the memory plan's parked: the block inputs activation offload keeps in pinned host
                 memory from a block's forward to its backward (on CPU ranks too: there a copy)
        staging  r (params + optim) with dcp_async: async_save copies each rank's checkpoint shard to
                 host memory and writes it while training goes on
        load     r c 4 Lmax: a whole fp32 tensor in transit per rank (a slice read from init_from,
                 c = 1; CPU ranks also receive the broadcast of the initial weights in host memory and
                 copy their shard out of it, c = 2). Without init_from also 4 (P + A) on rank 0, which
                 builds the seeded initial weights whole, and a second r x params where parameters live
                 on the host (offload, CPU ranks): the shards the broadcast fills before loading them;
                 with it, 4 A: rank 0 builds the adapters only
        export   2 r min(F, e P) / world + 2 e Lmax: each rank's share of an export file, gathered on the
                 host and serialised, and the whole tensor rank 0 joins at a time with its pieces
        os       HOST_MEMORY["os_gb"]: the kernel, system services, the launcher

    start = load + the parameters alive then (r x params with offload or on CPU ranks); HostPlan.total is
    the peak (the pinned allocator rounds each parked block up to a power of two: the usual sizes are). The
    loaders start no worker processes by default and map token files (the kernel's page cache), so the data
    adds no term.
    """
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
        parked=r * m.parked,
    )


def host_plan_for(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, m: MemoryPlan | None = None,
    cpu_offload: bool | None = None, ranks_per_node: int | None = None,
) -> HostPlan:  # fmt: skip
    """The host plan of these settings (with memory plan `m`, default plan_for's) on a node of
    `ranks_per_node` ranks: the launch's, which may differ from the plan's gpus_per_node."""
    offload = parallel.cpu_offload if cpu_offload is None else cpu_offload
    m = m or plan_for(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune)
    return host_memory_plan(
        model_shape(model), m, accelerator=hardware.accelerator, precision=parallel.mixed_precision,
        gpus_per_node=ranks_per_node or hardware.gpus_per_node, num_nodes=hardware.num_nodes, cpu_offload=offload,
        **lora_of(finetune=finetune), checkpoint_format=checkpoint.format, export=checkpoint.export != "none",
        init_from=bool(checkpoint.init_from), export_file_gb=checkpoint.export_file_gb,
    )  # fmt: skip


def check_host_memory(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, ranks_per_node: int, ram_gib: float | None = None,
) -> str:  # fmt: skip
    """Why this host plan does not fit this node's RAM (`ram_gib`, default: read from the machine), or "".

    The refusal names only changes that make the plan fit, each checked against this node's RAM and the
    planned device: a change that frees host memory may not fit the GPU (offload), and more nodes do
    not divide what rank 0 builds whole or what hybrid sharding and DDP replicate per node.
    """
    if ram_gib is None:
        found = machine.host_memory_mib()
        if found is None:
            return ""  # no /proc/meminfo: nothing to compare with
        ram_gib = found[0] / 1024
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune,
                checkpoint=checkpoint)  # fmt: skip
    host = host_plan_for(**args, ranks_per_node=ranks_per_node)
    if host.fits(ram_gib):
        return ""
    return (
        f"the plan needs {host.total / GIB:.1f} GiB of host memory per node ({host.describe()}) and this node has "
        f"{ram_gib:.1f} GiB ({HOST_MEMORY['headroom']:.0%} usable): "
        + host_fixes(**args, ranks_per_node=ranks_per_node, ram_gib=ram_gib)
    )


def host_fixes(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, ranks_per_node: int, ram_gib: float,
) -> str:  # fmt: skip
    """The changes with which the host plan fits a node of `ram_gib` and the device plan its GPU, each
    alone: fewer ranks per node, no offload (of the model state, or of the activations), synchronous checkpoints,
    more nodes (the same ranks per node, re-planned); both settings together where neither does alone."""

    def fits(r: int = ranks_per_node, **changes) -> bool:
        p = replace(parallel, **{k: v for k, v in changes.items() if k != "format" and k != "num_nodes"})
        c = replace(checkpoint, format=changes.get("format", checkpoint.format))
        hw = replace(hardware, num_nodes=changes.get("num_nodes", hardware.num_nodes))
        m = plan_for(model=model, train=train, parallel=p, hardware=hw, finetune=finetune)
        device = hw.accelerator == "cpu" or not hw.gpu_memory_gb or m.fits(hw.gpu_memory_gb)
        kwargs = dict(model=model, train=train, parallel=p, hardware=hw, finetune=finetune, checkpoint=c)
        return device and host_plan_for(**kwargs, m=m, ranks_per_node=r).fits(ram_gib)

    fixes = []
    fewer = next((r for r in range(ranks_per_node - 1, 0, -1) if fits(r)), 0)
    if fewer:
        fixes.append(f"at most {fewer} rank{'s' if fewer > 1 else ''} per node")
    if parallel.cpu_offload and fits(cpu_offload=False):
        fixes.append("parallel.cpu_offload=false")
    if parallel.activation_offload and fits(activation_offload=False):
        fixes.append("parallel.activation_offload=false")
    if checkpoint.format == "dcp_async" and fits(format="dcp"):
        fixes.append("checkpoint.format=dcp")
    both = parallel.cpu_offload and checkpoint.format == "dcp_async"
    if not fixes and both and fits(cpu_offload=False, format="dcp"):
        fixes.append("parallel.cpu_offload=false and checkpoint.format=dcp")
    nodes = next((n * hardware.num_nodes for n in (2, 4, 8, 16) if fits(num_nodes=n * hardware.num_nodes)), 0)
    if nodes:
        fixes.append(f"{nodes} nodes (hardware.num_nodes={nodes})")
    if not fixes:
        return "nothing in this config fits it: a smaller model, or a node with more RAM"
    return f"{', '.join(fixes[:-1])} or {fixes[-1]}" if len(fixes) > 1 else fixes[0]
