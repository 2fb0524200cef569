"""Process-group plumbing: rank discovery, device and backend choice, meshes, timeouts, agreement between ranks."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import JOB_WIDE, ParallelConfig, UsageError
from .presets import BACKEND_TABLE, REQUIRED_OPS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


@dataclass(frozen=True)
class Degrees:
    """How the job's ranks split the work (torchtitan's ParallelDims), built once from the config and the world
    size (parallel_degrees) and refused in one place (check): the only source of the mesh, the groups, the data's
    ranks, the checkpoints' layout and the planner's degrees. No other module derives one degree from another.

    Ranks are laid out as (dp_replicate, dp_shard, cp, tp), the last the fastest: tensor- and context-parallel
    groups are neighbouring ranks of a node, the data-parallel dimensions run across them. Expert parallelism
    splits dp_shard into (efsdp, ep). pp is room for pipeline parallelism, 1 until it lands."""

    sharding: str
    """How the data-parallel ranks hold the model state: full, shard_grad_op, hybrid or no_shard (DDP)."""
    world_size: int
    ranks_per_node: int
    dp_replicate: int
    """Copies of the model state: hybrid's replicas (one per shard group), DDP's ranks; 1 for full, shard_grad_op."""
    dp_shard: int
    """Data-parallel ranks that shard one copy: hybrid's shard group, all for full and shard_grad_op; 1 for DDP."""
    cp: int = 1
    """Ranks that split every sequence, fed the same batches."""
    tp: int = 1
    """Ranks that split every layer, fed the same batches."""
    ep: int = 1
    """Ranks of dp_shard that split the experts."""
    pp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the ways every global batch splits (a tensor- or context-parallel group shares one)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks that share one copy of the model state, each holding 1/tp of it: FSDP shards over the shards and
        the context-parallel ranks (build_mesh's "dp_shard_cp"); 1 for DDP, whose ranks each hold all of it."""
        return 1 if self.sharding == "no_shard" else self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that shard one expert: the shard group's ranks that hold the same experts (expert_mesh)."""
        return self.dp_shard // self.ep

    @property
    def sharded(self) -> bool:
        """Whether any weight is split over ranks (FSDP's shards, a tensor- or context-parallel group): False on
        one rank, and for DDP, whose ranks each hold everything."""
        return self.shard_group * self.tp > 1

    def dp_rank(self, rank: int) -> int:
        """`rank`'s data-parallel index: which slice of every global batch it trains on."""
        return rank // (self.cp * self.tp) % self.dp

    def cp_rank(self, rank: int) -> int:
        """`rank`'s index in its context-parallel group: which chunks of every sequence it holds."""
        return rank // self.tp % self.cp

    def check(self) -> None:
        """Refuse degrees that do not split the world and its nodes into whole groups (UsageError naming the setting
        and a fix): tensor- and context-parallel groups communicate in every layer, on the links inside a node."""
        world, local, tp, cp, span = self.world_size, self.ranks_per_node, self.tp, self.cp, self.cp * self.tp
        if tp > 1 and (local % tp or world % tp):
            raise UsageError(
                f"parallel.tensor_parallel={tp} must divide the ranks of each node ({local}) and the world size "
                f"({world}): a tensor-parallel group communicates in every layer and must sit within one node; choose "
                "a divisor of the ranks per node, or 1"
            )
        if cp > 1 and (local % span or world % span):
            ranks = f"parallel.context_parallel={cp}" + (
                f" x parallel.tensor_parallel={tp} = {span} ranks" if tp > 1 else ""
            )
            fits = [d for d in range(1, local + 1) if local % (d * tp) == 0 and world % (d * tp) == 0]
            raise UsageError(
                f"{ranks} must divide the ranks of each node ({local}) and the world size ({world}): a "
                f"context-parallel group exchanges every block's attention inputs and must sit within one node; "
                f"choose parallel.context_parallel among {fits}"
            )
        dp = world // (span * self.pp)
        if self.sharding == "hybrid" and (self.dp_shard < 1 or dp % self.dp_shard):
            split = f"tensor_parallel {tp}" + (f" x context_parallel {cp}" if cp > 1 else "")
            raise UsageError(
                f"hybrid sharding: shard group size {self.dp_shard} must divide the {dp} data-parallel ranks (world "
                f"size {world} / {split}): set parallel.hsdp_shard_size to a divisor of {dp}"
            )
        if self.ep > self.dp_shard or self.dp_shard % self.ep:
            raise UsageError(
                f"parallel.expert_parallel={self.ep} must divide the {self.dp_shard} ranks that shard each weight "
                f"(world size {world}): a group of that many ranks splits the experts; choose a divisor of "
                f"{self.dp_shard}"
            )


def parallel_degrees(
    sharding: str, *, world_size: int, ranks_per_node: int, tp: int = 1, cp: int = 1, ep: int = 1,
    hsdp_shard_size: int = 0,
) -> Degrees:  # fmt: skip
    """The degrees of `sharding` with tp, cp and ep on `world_size` ranks, `ranks_per_node` a node (the template's
    hooks/plan.jinja has the same macro); hybrid's shard group is `hsdp_shard_size` data-parallel ranks, or a
    node's (0). Nothing is refused here: the planner prices degrees that may not fit, Degrees.check refuses them."""
    dp = max(world_size // (tp * cp), 1)
    if sharding == "no_shard":
        replicate, shard = dp, 1
    elif sharding == "hybrid":
        shard = hsdp_shard_size or max(ranks_per_node // (tp * cp), 1)
        replicate = max(dp // shard, 1)
    else:
        replicate, shard = 1, dp
    return Degrees(sharding, world_size, ranks_per_node, replicate, shard, cp=cp, tp=tp, ep=ep)


def degrees_of(parallel: ParallelConfig, *, world_size: int, ranks_per_node: int) -> Degrees:
    """parallel_degrees of the config's parallel section: a job's (preflight.check, run.init_distributed)."""
    return parallel_degrees(
        parallel.sharding, world_size=world_size, ranks_per_node=ranks_per_node, tp=parallel.tensor_parallel,
        cp=parallel.context_parallel, ep=parallel.expert_parallel, hsdp_shard_size=parallel.hsdp_shard_size,
    )  # fmt: skip


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, once the process group has started (run.init_distributed)."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    mesh: DeviceMesh | None
    """The device mesh parallelize() and the FSDP strategy use (build_mesh); None for DDP."""
    degrees: Degrees
    """How the ranks split the work: the mesh's shape, this rank's slice of the data and of every sequence."""
    expert_mesh: DeviceMesh | None = None
    """The data-parallel ranks as (["dp_replicate",] "efsdp", "ep") for expert parallelism (expert_mesh); else None."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_init_method(init_method: str) -> None:
    if not init_method.startswith(("env://", "tcp://", "file://")):
        raise UsageError(f"dist.init_method={init_method!r}: use env://, tcp://host:port or file:///shared/path")


def rendezvous_from_env(init_method: str) -> Rendezvous:
    """Rank and world size from torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    check_init_method(init_method)
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if init_method.startswith("env://"):
        missing += [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UsageError(
            f"dist.init_method={init_method} needs {', '.join(missing)} in the environment; launch with "
            "torchrun (scripts/run_local.sh), or export them from your scheduler (SLURM: RANK=$SLURM_PROCID, "
            "WORLD_SIZE=$SLURM_NTASKS)"
        )
    if init_method.startswith("tcp://") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun, tcp:// connects to torchrun's own store instead of starting one, so
        # any other address waits forever.
        agent = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if init_method != agent:
            raise UsageError(
                f"dist.init_method={init_method} under torchrun, whose store is {agent}: use env:// with "
                "torchrun, or start the ranks yourself (srun, mpirun, scripts/run_local.sh) for tcp://"
            )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % local_world_size))
    return Rendezvous(rank, world_size, local_rank, local_world_size)


def planned_rendezvous() -> Rendezvous:
    """The ranks a launch script is about to start (--check-only): WORLD_SIZE and LOCAL_WORLD_SIZE as
    it sets them (1, and WORLD_SIZE, when unset), seen by rank 0 with the node's last local rank, the
    one whose device must exist."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return Rendezvous(rank=0, world_size=world_size, local_rank=local_world_size - 1, local_world_size=local_world_size)


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """The device this rank trains on; `auto` falls back to the CPU when no accelerator exists."""
    available = {"cuda": torch.cuda.is_available(), "xpu": torch.xpu.is_available(), "cpu": True}
    kind = requested if requested != "auto" else next(k for k, ok in available.items() if ok)
    if not available[kind]:
        raise UsageError(f"device={requested!r} but no {kind} device is visible; use device='auto' or 'cpu'")
    if kind == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if kind == "cuda" else torch.xpu.device_count()
    if local_rank >= count:
        raise UsageError(f"local rank {local_rank} has no {kind} device ({count} visible); lower --nproc_per_node")
    return torch.device(kind, local_rank)


def resolve_backend(requested: str, device: torch.device, *, cpu_collectives: bool) -> str:
    """The backend string for init_process_group.

    `auto`, or a backend that cannot run on the device `auto` fell back to, becomes the device's
    default. `cpu_collectives` adds gloo for CPU tensors next to an accelerator backend: CPU
    offload reduces gradient norms over CPU DTensors.
    """
    default = dist.get_default_backend_for_device(device)
    backend = requested
    if requested == "auto":
        backend = default
    elif device.type not in BACKEND_TABLE[requested]:
        logger.warning(
            "backend %s cannot run on %s; using %s for this run", requested, device.type, default, extra=JOB_WIDE
        )
        backend = default
    if not dist.is_backend_available(backend):
        hint = "MPI needs a source build" if backend == "mpi" else "install the build for this device"
        fix = f"; dist.backend=auto uses the device's default ({default})" if backend != default else ""
        raise UsageError(f"dist.backend={backend!r} is not available in this PyTorch build ({hint}){fix}")
    if cpu_collectives and device.type != "cpu":
        return f"cpu:gloo,{device.type}:{backend}"
    return backend


def check_backend(backend: str, device_type: str, sharding: str) -> None:
    """Refuse a backend that lacks a collective the chosen sharding issues."""
    # A mixed string such as "cpu:gloo,cuda:nccl" names one backend per device kind.
    name = dict(part.split(":") for part in backend.split(","))[device_type] if ":" in backend else backend
    ops = BACKEND_TABLE[name].get(device_type)
    if ops is None:
        raise UsageError(f"backend {name} cannot run collectives on {device_type}")
    missing = [op for op in REQUIRED_OPS[sharding] if ops.get(op) == "x"]
    if missing:
        raise UsageError(f"backend {name} lacks {', '.join(missing)} on {device_type}, which sharding={sharding} needs")
    unsure = [op for op in REQUIRED_OPS[sharding] if ops.get(op) == "?"]
    if unsure:
        logger.warning(
            "backend %s: %s on %s depend on how MPI was built", name, ", ".join(unsure), device_type, extra=JOB_WIDE
        )


def build_mesh(device_type: str, degrees: Degrees) -> DeviceMesh | None:
    """1-D ("dp_shard") mesh for full/shard_grad_op, ("dp_replicate", "dp_shard") for hybrid, none for DDP.

    Context parallelism adds a dimension "cp" after them and tensor parallelism a last one, "tp": their
    groups are neighbouring ranks (within one node, see Degrees.check), and the data-parallel dimensions run
    across the groups. FSDP shards over "dp_shard" and "cp" together (flattened as "dp_shard_cp",
    torchtitan's layout): a context-parallel group holds the same parameters, so their shards split over it too.
    """
    sharding, tp, cp = degrees.sharding, degrees.tp, degrees.cp
    if sharding == "no_shard":
        return None
    if sharding != "hybrid":
        shape, names = (degrees.dp_shard,), ("dp_shard",)
    else:
        shape, names = (degrees.dp_replicate, degrees.dp_shard), ("dp_replicate", "dp_shard")
    if tp == 1 and cp == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    inner = {"cp": cp, "tp": tp}
    inner = {name: size for name, size in inner.items() if size > 1}
    mesh = init_device_mesh(device_type, (*shape, *inner.values()), mesh_dim_names=(*names, *inner))
    # Flattened views (private, but torchtitan builds its meshes with them). A gradient is split over
    # "dp_shard", "cp" and "tp" (hybrid's replicas hold it whole), so its norm is a sum over those
    # dimensions: with one flattened group DTensor reduces it in one all-reduce instead of one per
    # dimension (torch warns "flatten mesh dimensions" otherwise). Hybrid's "dp" is one group over the
    # data-parallel dimensions (validation sums over it, with "cp" when there is one).
    split = ("dp_shard", *inner)
    if cp > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if len(split) > 2:
        mesh[split]._flatten("dp_shard_cp_tp")
    elif tp > 1:
        mesh[split]._flatten("dp_shard_tp")
    if sharding == "hybrid" and tp > 1:
        mesh[(*names, "cp") if cp > 1 else names]._flatten("dp")
    return mesh


def expert_mesh(mesh: DeviceMesh | None, degrees: Degrees) -> DeviceMesh | None:
    """The data-parallel ranks of `mesh` as expert parallelism splits them (None for degrees.ep 1): its "dp_shard"
    dimension unflattened into ("efsdp", "ep"), groups of degrees.ep neighbouring ranks that split the experts
    ("ep"), and the ranks that hold the same experts across the groups ("efsdp"). It shares `mesh`'s ranks,
    so FSDP can shard the experts over "efsdp" and every other weight over "dp_shard" within one block."""
    if degrees.ep <= 1 or mesh is None:
        return None
    dim = mesh.mesh_dim_names.index("dp_shard")
    # Private, but torchtitan builds its meshes this way too: the new dimensions reuse the mesh's process groups.
    experts = mesh._unflatten(dim, (degrees.efsdp, degrees.ep), ("efsdp", "ep"))
    # An expert's gradient is split over both: with the flattened group DTensor reduces its norm in one all-reduce.
    experts["efsdp", "ep"]._flatten("efsdp_ep")
    return experts


def data_parallel_mesh(mesh: DeviceMesh, hybrid: bool) -> DeviceMesh:
    """The dimensions of `mesh` that FSDP shards (and, for hybrid, replicates) over: all but "tp", with "cp"
    flattened into the shards ("dp_shard_cp")."""
    names = mesh.mesh_dim_names
    if "tp" not in names and "cp" not in names:
        return mesh
    if "cp" not in names:
        return mesh["dp_replicate", "dp_shard"] if hybrid else mesh["dp_shard"]
    shards = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # build_mesh's, cached
    # Joined to the replicas as FSDP joins its mesh to the tensor-parallel one (torch deprecates slicing a
    # flattened dimension out of the mesh it was flattened from).
    return DeviceMesh._concatenate([mesh["dp_replicate"], shards]) if hybrid else shards


def batch_group(mesh: DeviceMesh | None, hybrid: bool) -> dist.ProcessGroup | None:
    """The ranks that split every global batch between them, its samples or their tokens: all but the
    tensor-parallel ones, which compute the same samples (None: every rank)."""
    if mesh is None or "tp" not in mesh.mesh_dim_names:
        return None
    if hybrid:  # the data-parallel (and context-parallel) dimensions as one group: build_mesh's, cached
        return mesh[tuple(name for name in mesh.mesh_dim_names if name != "tp")]._flatten("dp").get_group()
    return data_parallel_mesh(mesh, hybrid).get_group()


def init_process_group(rdzv: Rendezvous, device: torch.device, backend: str, init_method: str, timeout_s: int) -> None:
    timeout = timedelta(seconds=timeout_s)
    store = None
    if init_method.startswith("env://") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store across restarts (--max-restarts), and torch 2.13 no longer
        # prefixes its keys per attempt: a restarted rank would read the dead ranks' addresses
        # and hang or fail to connect. Each attempt gets a key space of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.PrefixStore(f"attempt_{attempt}", dist.TCPStore(host, port, is_master=False, timeout=timeout))
    # Sharded parameters, meshes and optimizer state keep the process group alive, some through
    # reference cycles that Python would otherwise free only while shutting down, when gloo's
    # worker threads can no longer take the GIL and the process aborts. Collect them first. (A
    # module that holds the group itself stops this: see strategy.ZeroDDP.before_process_group.)
    atexit.register(gc.collect)
    dist.init_process_group(
        backend=backend,
        init_method=None if store else init_method,
        store=store,
        rank=rdzv.rank,
        world_size=rdzv.world_size,
        timeout=timeout,
        # Binding the device lets NCCL form its communicator now, so a bad setup fails here.
        device_id=device if device.type != "cpu" else None,
    )


def set_collective_timeout(seconds: int) -> None:
    """Shorten the default group's timeout once start-up (and its slow first steps) is over."""
    # Private but stable since 2.3; torchtitan relies on the same call. A torch without it keeps the start-up
    # timeout: a hung collective is then found later, and the run is the same.
    try:
        from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout
    except ImportError:
        logger.warning("torch %s cannot change a process group's timeout: dist.train_timeout_s=%d is not applied, "
                       "collectives keep dist.init_timeout_s", torch.__version__, seconds)  # fmt: skip
        return
    _set_pg_timeout(timedelta(seconds=seconds), _get_default_group())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True if any rank passes True; every rank gets the same answer, so control flow stays in step. The loop asks
    after every step: alone, a rank asks no one (a collective read back on the host would wait for the step)."""
    if dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_across_ranks(t: torch.Tensor | None, device: torch.device) -> float:
    """The mean of a scalar over the ranks that pass one (a collective: every rank must call it).

    A rank whose data has run out (data.uneven_inputs=join) passes None and is not counted.
    """
    pair = torch.zeros(2, device=device)
    if t is not None:
        pair[0], pair[1] = t.detach(), 1.0
    dist.all_reduce(pair)  # SUM: gloo has no AVG
    return (pair[0] / pair[1].clamp(min=1)).item()


class StopRequest:
    """Turns SIGTERM / SIGUSR1 (how SLURM and Kubernetes announce preemption) into a flag.

    The loop checks the flag between steps, agrees on it across ranks, saves and exits 0.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.requested = False
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.requested = True
        logger.warning("received %s: stopping after this step", signal.Signals(signum).name)
