"""Expert parallelism (`parallel.expert_parallel` = n): a mixture of experts' experts split among n ranks, tokens
sent to them by all-to-all and their outputs sent back.

The data-parallel ranks form groups of n neighbours (the "ep" dimension of distributed.expert_mesh, so that
dp_shard = efsdp x ep, as torchtitan lays it out). Each rank of a group holds num_experts / n experts of every
sparse layer, which FSDP shards over the "efsdp" ranks (the ranks of the other groups that hold the same
experts), while every other weight is sharded over all data-parallel ranks as without experts. Every rank
still trains on batches of its own. A sparse layer's forward pass, with AllToAllDispatcher:

    counts    every rank tells every other how many of its token copies go to each of that rank's experts
              (an all-to-all of num_experts counts), so each knows how many rows it will receive
    dispatch  the copies themselves (all_to_all_single with those split sizes, differentiable), then
              regrouped by local expert
    experts   one grouped matmul per projection over this rank's experts (Qwen3-MoE's GroupedExperts)
    combine   the outputs back to the ranks that sent them (the reverse all-to-all), in their order

The split sizes depend on the routing, so such a block compiles with graph breaks (parallelize.apply_compile).
An expert's gradient already sums the tokens of its whole group, which the all-to-all brought to it, while
FSDP averages it over the efsdp ranks alone, N / n of the N data-parallel ranks: n times the mean over the
global batch. So the dispatcher divides what flows back into the experts by n and multiplies what flows out
of them by n again: the experts' gradients come out right and no other gradient changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .config import UsageError
from .distributed import Degrees
from .models import ModelShape
from .models.spec import StateDict

# The private names expert parallelism needs (FSDP's per-parameter mesh, as torchtitan uses it; the functional
# all-to-all) are imported where an expert-parallel run uses them, never at import: a torch without them (2.11 has
# no ShardPlacementResult) runs every other model and degree, and check_expert_parallel refuses this one.
if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(tensor)


class AllToAllDispatcher(nn.Module):
    """Qwen3-MoE's Dispatcher over the ranks of `mesh` (one expert-parallel group), each holding
    num_experts / mesh.size() consecutive experts: rank j the experts j E / n to (j + 1) E / n - 1."""

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        super().__init__()
        self.mesh, self.ranks = mesh, mesh.size()
        self.local_experts = num_experts // self.ranks

    def dispatch(
        self, x: torch.Tensor, expert_ids: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        import torch.distributed._functional_collectives as funcol

        n, local = self.ranks, self.local_experts
        order = torch.argsort(expert_ids.flatten(), stable=True)  # copy slots by global expert: by destination rank
        rows = x.index_select(0, order // expert_ids.shape[1])
        sent = tokens_per_expert.to(torch.int64)
        with torch.no_grad():  # [source rank, local expert]: the rows this rank receives
            received = _wait(funcol.all_to_all_single(sent, None, None, self.mesh)).view(n, local)
        send_splits = sent.view(n, local).sum(1).tolist()
        receive_splits = received.sum(1).tolist()
        rows = _wait(funcol.all_to_all_single_autograd(rows, receive_splits, send_splits, self.mesh))
        # Received by source rank, then local expert; the experts want them by local expert, then source.
        sizes = received.flatten()
        starts = (torch.cumsum(sizes, 0) - sizes).view(n, local).t().flatten()
        by_expert = received.t().flatten()
        begins = torch.cumsum(by_expert, 0) - by_expert
        regroup = torch.arange(int(sizes.sum()), device=x.device) + torch.repeat_interleave(starts - begins, by_expert)
        ungroup = torch.empty_like(regroup).scatter_(0, regroup, torch.arange(regroup.numel(), device=x.device))
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        rows = _ScaleGradient.apply(rows.index_select(0, regroup), float(n))  # gradient out of the experts: x n
        return rows, received.sum(0).to(torch.int32), (ungroup, unsort, send_splits, receive_splits)

    def combine(self, rows: torch.Tensor, handle: tuple) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        ungroup, unsort, send_splits, receive_splits = handle
        rows = _ScaleGradient.apply(rows, 1.0 / self.ranks).index_select(0, ungroup)  # gradient into them: / n
        rows = _wait(funcol.all_to_all_single_autograd(rows, send_splits, receive_splits, self.mesh))
        return rows.index_select(0, unsort)


def is_expert_parallel(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is split by expert over an expert-parallel mesh dimension ("ep")."""
    return isinstance(tensor, DTensor) and "ep" in (tensor.device_mesh.mesh_dim_names or ())


def apply_ep(layers: nn.ModuleList, mesh: DeviceMesh) -> None:
    """Split the experts of every mixture-of-experts layer (a module with a `dispatcher` and stacked `experts`)
    over the ranks of `mesh`, on the meta device, and give the layer the all-to-all dispatcher.

    Each stacked weight becomes a DTensor sharded by expert (dim 0): this rank's experts, which the forward
    pass computes with (its to_local), and which FSDP then shards over the efsdp ranks (expert_placement).
    """
    for block in layers:
        for module in block.modules():
            if not hasattr(module, "dispatcher"):
                continue
            experts = module.experts
            num_experts = next(experts.parameters()).shape[0]  # every stacked weight's first dimension
            for name, param in list(experts.named_parameters(recurse=False)):
                local = torch.empty(num_experts // mesh.size(), *param.shape[1:], dtype=param.dtype, device="meta")
                split = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape,
                                           stride=param.stride())  # fmt: skip
                experts.register_parameter(name, nn.Parameter(split, param.requires_grad))
            experts.split_by_expert = True
            module.dispatcher = AllToAllDispatcher(mesh, num_experts)


def expert_fsdp_mesh(expert_mesh: DeviceMesh, *, hybrid: bool) -> FSDPMeshInfo:
    """The ranks FSDP shards each expert over (and, for hybrid sharding, replicates it across), for
    fully_shard's shard_placement_fn: "efsdp", or ("dp_replicate", "efsdp")."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if hybrid:
        mesh = expert_mesh["dp_replicate", "efsdp"]
        return HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    return FSDPMeshInfo(mesh=expert_mesh["efsdp"], shard_mesh_dim=0)


def expert_placement(param: nn.Parameter, placement: Shard, mesh: FSDPMeshInfo) -> ShardPlacementResult | None:
    """FSDP's placement for an expert-parallel weight: `placement` over `mesh` (expert_fsdp_mesh); None otherwise."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

    return ShardPlacementResult(placement=placement, mesh_info=mesh) if is_expert_parallel(param) else None


def local_experts(state: StateDict) -> tuple[StateDict, int]:
    """`state` with each expert-parallel weight as this rank's experts alone: a DTensor over the other dimensions
    of its mesh (the ranks that share those experts), the same local shard; and the first of those experts.

    A state-dict adapter can then take each expert apart along dim 0 (no rank's shard is split there) and name
    it from that first expert (HFLayout.to_hf_local_experts): views of this rank's shard that DCP reads into
    and writes from, which the whole weight, split by expert across ranks, does not allow.
    """
    out, first = {}, 0
    for key, value in state.items():
        if not is_expert_parallel(value):
            out[key] = value
            continue
        names = value.device_mesh.mesh_dim_names
        ep = names.index("ep")
        local = value.to_local()
        rest = tuple(name for name in names if name != "ep")
        placements = value.placements[:ep] + value.placements[ep + 1 :]
        shape = (value.shape[0] // value.device_mesh.size(ep), *value.shape[1:])
        out[key] = DTensor.from_local(local, value.device_mesh[rest], placements, run_check=False, shape=shape,
                                      stride=torch.empty(shape, device="meta").stride())  # fmt: skip
        first = value.device_mesh["ep"].get_local_rank() * shape[0]
    return out, first


def split_experts(
    state: StateDict, to_files: Callable[[StateDict, int], StateDict] | None
) -> tuple[StateDict, StateDict]:
    """`state` less its expert-parallel weights, and those weights as `to_files` of this rank's experts (views of
    its shards, which DCP reads into and writes from in place: weights.py's Layout); with no `to_files` (no
    adapter splits the experts) every weight stays in the first."""
    split = {k: v for k, v in state.items() if to_files and is_expert_parallel(v)}
    whole = {k: v for k, v in state.items() if k not in split}
    return whole, (to_files(*local_experts(split)) if split else {})


PER_PARAMETER_MESH_TORCH = "2.12"
"""The first torch release whose fully_shard takes a mesh per parameter (ShardPlacementResult)."""


def has_per_parameter_mesh() -> bool:
    """Whether this torch's fully_shard can shard the experts over other ranks than the rest of a block."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_common
    except ImportError:
        return False
    return hasattr(_fsdp_common, "ShardPlacementResult")


def check_expert_parallel(*, shape: ModelShape, degrees: Degrees) -> None:
    """Refuse a degree this torch cannot run, or one that leaves FSDP an expert it cannot shard (a model with experts
    only: a dense model's config refuses any degree but 1; Degrees.check refuses one that does not divide the ranks
    that shard each weight).

    FSDP shards an expert along its second dimension (Qwen3-MoE's GroupedExperts), evenly: the hidden
    size and one expert's width must split over the degrees.efsdp ranks that share it (all of the shard group's
    without expert parallelism).
    """
    if not shape.experts:
        return
    efsdp, degree = degrees.efsdp, degrees.ep
    if degree > 1 and not has_per_parameter_mesh():
        raise UsageError(
            f"parallel.expert_parallel={degree} needs torch {PER_PARAMETER_MESH_TORCH} or newer (fully_shard's mesh "
            f"per parameter, ShardPlacementResult); this is torch {torch.__version__}: install torch>="
            f"{PER_PARAMETER_MESH_TORCH}, or set parallel.expert_parallel=1"
        )
    if shape.h % efsdp or shape.f % efsdp:
        raise UsageError(
            f"parallel.expert_parallel={degree} at world size {degrees.world_size} leaves {efsdp} ranks to shard each "
            f"expert, which must divide both model.dim={shape.h} and the experts' width (model.moe_intermediate_size) "
            f"{shape.f}: choose a degree that leaves a divisor of both"
        )
