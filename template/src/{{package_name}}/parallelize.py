"""Float8, tensor, context and expert parallelism, activation checkpointing and offload, compile and FSDP,
applied to a model on the meta device.

`parallelize` is the one place that applies them, in torchtitan's order: float8 layers, then split
each layer over the tensor-parallel ranks, swap attention for its context-parallel form
(context_parallel.py) and split the experts over the expert-parallel ranks (expert_parallel.py),
checkpoint each block, park the inputs it keeps in host memory (activation_offload.py), compile each
block, then shard each block and finally the root over the data-parallel (and context-parallel) ranks.
Each step only works on what the one before it left (FSDP shards the DTensors that TP and EP made; the
checkpoint wrappers rename the modules TP and CP find by path; compile sees the wrappers), so the order
is not a matter of taste. This is the only file that calls `parallelize_module` and `fully_shard`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .activation_offload import apply_activation_offload
from .config import JOB_WIDE, ParallelConfig, UsageError
from .context_parallel import apply_cp
from .distributed import data_parallel_mesh
from .expert_parallel import apply_ep, expert_fsdp_mesh, expert_placement
from .models.spec import ContextParallelPlan, TensorParallelPlan

# Private torch names are imported, or looked up, only on the path of the feature that needs them (activation
# checkpointing, compile, expert parallelism): the torch a cluster has decides which features run, not whether
# the run starts.
if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
logger = logging.getLogger(__name__)


def parallelize(
    model: nn.Module, *, parallel: ParallelConfig, mesh: DeviceMesh | None, tp_plan: TensorParallelPlan | None,
    cp_plan: ContextParallelPlan | None = None, adapter_rank: int = 0, expert_mesh: DeviceMesh | None = None,
    one_rank: bool = False,
) -> None:  # fmt: skip
    """Make the model on the meta device what `parallel` asks for, in place: float8 -> TP -> CP -> EP -> AC ->
    activation offload -> compile -> FSDP.

    `mesh` is distributed.build_mesh's (None for DDP, which strategy.py wraps once the weights are in);
    `tp_plan` and `cp_plan` the model's tensor- and context-parallel plans, used when the mesh has a "tp"
    or a "cp" dimension; `adapter_rank` LoRA's rank (0: no adapters), which selective checkpointing
    recomputes rather than keeps; `expert_mesh` distributed.expert_mesh's, whose "ep" ranks split the
    experts (None: every rank holds every expert); `one_rank` that the run has nothing to shard
    (strategy.shards_nothing): no FSDP then, and compile takes the whole model, as the plain loop does (block by
    block with activation offload, whose hooks run between the compiled blocks).
    """
    sharded = parallel.sharding != "no_shard" and not one_rank
    apply_float8(model.layers, parallel.float8, fsdp=sharded)
    float8_compile_settings(parallel.float8, compiled=parallel.compile)
    if mesh is not None and "tp" in mesh.mesh_dim_names:
        apply_tp(model, mesh["tp"], tp_plan)  # before the wrappers rename the blocks' modules
    if mesh is not None and "cp" in mesh.mesh_dim_names:
        apply_cp(model, mesh["cp"], cp_plan)  # likewise
    if expert_mesh is not None:
        apply_ep(model.layers, expert_mesh["ep"])
    apply_ac(model.layers, parallel.activation_checkpointing, adapter_rank=adapter_rank)
    if parallel.activation_offload:
        parking = apply_activation_offload(model.layers)  # its hooks run around compiled blocks: blocks to hook
        logger.info("activation offload: the inputs of %d of %d blocks wait for backward in host memory",
                    parking.parked_blocks, len(model.layers))  # fmt: skip
    if parallel.compile and one_rank and not parallel.activation_offload:
        apply_compile_whole(model, parallel.compile_backend)
    elif parallel.compile:
        # The all-to-all's split sizes are data: an expert-parallel block compiles in pieces around it.
        apply_compile(model.layers, parallel.compile_backend, fullgraph=expert_mesh is None)
    if sharded:
        hybrid = parallel.sharding == "hybrid"
        experts = expert_fsdp_mesh(expert_mesh, hybrid=hybrid) if expert_mesh is not None else None
        apply_fsdp(model, data_parallel_mesh(mesh, hybrid), parallel, experts=experts)


# Selective checkpointing keeps what is expensive to recompute (matmuls and attention) and
# recomputes the cheap elementwise work around it (norms, activations, rotary embeddings). With
# context and expert parallelism it keeps the all-to-alls' outputs too: recomputing them would repeat
# the communication in backward.
@functools.cache
def _save_ops() -> frozenset:
    # Private ops, looked up once selective checkpointing runs; one this torch lacks is one no block calls.
    packets = (
        getattr(torch.ops._c10d_functional, "all_to_all_single", None),
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        getattr(torch.ops.aten, "_grouped_mm", None),  # a mixture of experts' expert matmuls
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    )
    return frozenset(packet.default for packet in packets if packet is not None)


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _save_matmuls(ctx, op, *args, adapter_rank: int = 0, **kwargs) -> CheckpointPolicy:
    if op in _MATMULS and adapter_rank and min(args[-2].shape[-1], args[-1].shape[-1]) <= adapter_rank:
        # A LoRA adapter's matmul: it contracts over or produces adapter_rank columns, so recomputing
        # it costs little, while keeping the up-projection's output would cost as much as the base layer's.
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _save_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(layers: nn.ModuleList, mode: str, *, adapter_rank: int = 0) -> None:
    """Wrap each block so its activations are recomputed in backward; `adapter_rank` is LoRA's rank (0: none)."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {}
    if mode == "selective":
        policy = functools.partial(_save_matmuls, adapter_rank=adapter_rank)
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    for i, block in enumerate(layers):
        # preserve_rng_state=False: the blocks have no dropout, and saving RNG state costs a sync.
        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def check_float8(recipe: str, device: torch.device) -> None:
    """Refuse float8 on a GPU without float8 tensor cores (before the process group starts)."""
    if recipe != "none" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise UsageError(
            f"parallel.float8={recipe} needs float8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
            f"this GPU is sm {major}.{minor}: set parallel.float8=none"
        )


def apply_float8(layers: nn.ModuleList, recipe: str, *, fsdp: bool) -> None:
    """Swap the blocks' linear layers for torchao's Float8Linear (float8 matmuls, bf16 outputs).

    Only the blocks: the embeddings and the output projection stay in bf16 (the logits are where
    float8's rounding costs the most, as torchtitan found). Layers whose sizes are not multiples of
    16 stay too (float8 matmuls need them). With tensorwise scaling under FSDP, parameters are
    all-gathered in float8 as well: half the bytes of bf16.
    """
    if recipe == "none":
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fsdp:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    for block in layers:
        convert_to_float8_training(block, config=config, module_filter_fn=float8_eligible)


def float8_compile_settings(recipe: str, *, compiled: bool) -> None:
    """What float8 needs from torch.compile. Without it every cast into float8 (an abs, a max, a scale and a cast
    per tensor, forward and backward) is a kernel of its own and float8 runs slower than bf16: the launch says so.
    Rowwise scaling compiles with inductor emulating eager's precision casts, torchtitan's workaround for NaNs
    when recomputed float8 activations round otherwise than the forward's (pytorch/pytorch#150859)."""
    if recipe == "none":
        return
    if not compiled:
        logger.warning(
            "parallel.float8=%s without parallel.compile: each float8 cast is a kernel of its own, and the step is "
            "likely slower than bf16's; set parallel.compile=true", recipe, extra=JOB_WIDE,
        )  # fmt: skip
    elif recipe == "rowwise":
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True


def float8_after_update(model: nn.Module, recipe: str, *, fsdp: bool) -> Callable[[], None] | None:
    """What train_step runs after each optimizer step for float8 (None: nothing). With tensorwise scaling under
    FSDP the weights are all-gathered in float8, each cast with its own scale: torchao's
    precompute_float8_dynamic_scale_for_fsdp computes every weight's scale at once, one max per weight and one
    all-reduce in all, where each all-gather would otherwise compute its weight's (its max, its all-reduce,
    eagerly, outside the compiled blocks), forward and backward. torchtitan calls it there too."""
    if recipe != "tensorwise" or not fsdp:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return functools.partial(precompute_float8_dynamic_scale_for_fsdp, model)


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    """float8 matmuls need both sizes to be multiples of 16."""
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


class Replicated(ParallelStyle):
    """A module that every rank of the group runs whole, on whole activations (a norm without sequence
    parallelism): its parameters become replicated DTensors, on the same mesh as the split ones."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate, self._whole_input, self._local_output)

    @staticmethod
    def _replicate(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        # from_local, as SequenceParallel does: there is nothing to broadcast on the meta device, and
        # the weights arrive later, from rank 0 or a checkpoint.
        for key, param in module.named_parameters(recurse=False):
            replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
            module.register_parameter(key, nn.Parameter(replicated, param.requires_grad))

    @staticmethod
    def _whole_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        first = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
        return (first, *inputs[1:])

    @staticmethod
    def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()


def tp_styles(sequence_parallel: bool) -> dict[str, Callable[[], ParallelStyle]]:
    """The layouts a TensorParallelPlan names (models/spec.py), as torch's parallel styles.

    Between the blocks, (batch, sequence, features) activations are split by sequence (Shard(1))
    with sequence parallelism, which each split module all-gathers or reduce-scatters; without it
    they are whole (Replicate()), and a row-wise split all-reduces its output.
    """
    between = Shard(1) if sequence_parallel else Replicate()
    styles = {
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "colwise": ColwiseParallel,
        "rowwise": lambda: RowwiseParallel(output_layouts=between),
        # Whole logits on every rank: the loss and validation read them as they are (no loss parallelism).
        "head": lambda: ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if not sequence_parallel:
        return styles | {"replicate": Replicated}
    return styles | {
        "sequence": SequenceParallel,
        "gather": lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: TensorParallelPlan) -> None:
    """Split the model's layers over the ranks of `mesh` (one tensor-parallel group) as its plan says."""
    styles = tp_styles(plan.sequence_parallel)
    unknown = {layout for layout in (*plan.root.values(), *plan.block.values()) if layout not in styles}
    if unknown:
        mode = "with" if plan.sequence_parallel else "without"
        raise ValueError(
            f"the tensor-parallel plan names layout(s) {sorted(unknown)}, which {mode} sequence parallelism are not "
            f"among {sorted(styles)} (models/spec.py TensorParallelPlan)"
        )
    parallelize_module(model, mesh, {path: styles[layout]() for path, layout in plan.root.items()})
    for block in model.layers:
        parallelize_module(block, mesh, {path: styles[layout]() for path, layout in plan.block.items()})
    # The embedding's output is DTensor.to_local()'s, a view; FSDP hooks its backward onto it, and
    # a compiled first block then drops that gradient (the embedding would never learn). A copy
    # (one micro-batch's hidden states, or this rank's part of them) is not a view.
    if (embed := model.get_input_embeddings()) is not None:
        embed.register_forward_hook(lambda module, args, output: output.clone())
    # Splitting the embedding and the head gave each a parameter of its own: tie them again (both
    # are split by vocabulary row), so that FSDP keeps them in one group.
    model.tie_weights()
    # The head's logits are a view too (every rank gets them whole); FSDP warns that an in-place op
    # on them would skip its backward hook. train_step and evaluate never modify them in place.
    warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(.*\) returned a view tensor", UserWarning)
    whole = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if whole:
        raise ValueError(
            f"the tensor-parallel plan leaves {len(whole)} parameter(s) whole ({', '.join(whole[:3])}): "
            "give their modules a layout in SPEC.tp_plan (models/spec.py TensorParallelPlan)"
        )


def apply_compile(layers: nn.ModuleList, backend: str, *, fullgraph: bool = True) -> None:
    """Compile each block in place; whole-model compile would break at every FSDP hook."""
    _allow_checkpointed_side_effects()
    for block in layers:
        block.compile(backend=backend, fullgraph=fullgraph)


def apply_compile_whole(model: nn.Module, backend: str) -> None:
    """Compile the whole model in place, where no FSDP hook splits it (one rank): the embeddings, the final norm
    and the output projection fuse too, and the blocks' graphs run back to back. Not fullgraph: a model may
    break its graph where it must (it then runs in pieces, each compiled)."""
    _allow_checkpointed_side_effects()
    model.compile(backend=backend)


def _allow_checkpointed_side_effects() -> None:
    # Dynamo refuses a write to state outside a checkpointed region, because eager checkpointing would replay it
    # when it recomputes the block. With `kernels` installed (a dependency of transformers 5.25), transformers wraps
    # attention's forward in such a write: it sets a global that routes the rotary function, then restores it, so
    # there is nothing to replay, and without this flag no checkpointed transformers block compiles.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Compute in `precision`, reduce gradients in fp32 (sharded master weights stay fp32)."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def reshard_after_forward(cfg: ParallelConfig, shard_group_size: int) -> bool | int:
    """full frees gathered parameters after forward (ZeRO-3); shard_grad_op keeps them (ZeRO-2).

    An integer reshards to groups of that many ranks: backward re-gathers within the group
    (faster links, less traffic) at the cost of holding 1/size of each block meanwhile.
    """
    if cfg.reshard_size:
        if shard_group_size % cfg.reshard_size or not 1 < cfg.reshard_size < shard_group_size:
            raise ValueError(
                f"parallel.reshard_size={cfg.reshard_size} must divide the shard group of {shard_group_size} ranks "
                "and lie strictly between 1 and it; use 0 to follow parallel.sharding"
            )
        return cfg.reshard_size
    return cfg.sharding != "shard_grad_op"


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, *, experts: FSDPMeshInfo | None = None) -> None:
    """Shard each block, then the embeddings and output head, then the root; `experts`: the ranks that shard
    expert-parallel weights (expert_parallel.expert_fsdp_mesh), None without expert parallelism."""
    # pin_memory needs an accelerator; on a CPU-only build pinning raises during to_empty().
    offload = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available()) if cfg.cpu_offload else OffloadPolicy()
    shard = functools.partial(
        fully_shard, mesh=mesh, mp_policy=mixed_precision_policy(cfg.mixed_precision), offload_policy=offload
    )
    reshard = reshard_after_forward(cfg, mesh.size(-1))
    for block in model.layers:
        shard(block, reshard_after_forward=reshard, shard_placement_fn=shard_placement(block, experts))
    if cfg.prefetch_blocks:
        apply_prefetch(list(model.layers), cfg.prefetch_blocks)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and head is not None and embed.weight is head.weight:
        # A tied weight must live in exactly one FSDP group; sharding either module alone
        # unties them and fails at the first forward.
        shard([embed, head], reshard_after_forward=reshard)
    else:
        if embed is not None:
            shard(embed, reshard_after_forward=reshard)
        if head is not None:
            # The head runs last in forward and first in backward: resharding it would only
            # trigger an immediate re-gather.
            shard(head, reshard_after_forward=False)
    shard(model)


def shard_placement(block: nn.Module, experts: FSDPMeshInfo | None = None) -> Callable | None:
    """FSDP's dimension for each parameter of `block`: 0 (None), unless its module names another in
    `fsdp_shard_dim`. A mixture of experts' stacked expert weights (Qwen3-MoE's GroupedExperts) shard along
    their hidden dimension: the state-dict adapter splits them per expert along the first, and DTensor
    refuses that split along a sharded dimension, while along another each expert is a view of every
    rank's shard, which DCP reads and writes in place. Under expert parallelism (`experts`: the ranks
    that share an expert) those weights shard over those ranks, the others over the whole mesh."""
    dims = {id(p): Shard(m.fsdp_shard_dim) for m in block.modules() if hasattr(m, "fsdp_shard_dim")
            for p in m.parameters(recurse=False)}  # fmt: skip
    if not dims:
        return None
    if experts is not None:
        return lambda p: expert_placement(p, dims.get(id(p), Shard(0)), experts)
    return lambda p: dims.get(id(p))


def apply_prefetch(blocks: list[FSDPModule], n: int) -> None:
    """Each block's forward issues the all-gathers of the next n blocks, its backward those of the n before.

    FSDP's implicit prefetch gathers one block ahead, issued when that block is reached; explicit
    prefetch issues it earlier from the CPU, and n >= 2 overlaps more communication at the cost of
    n + 1 gathered blocks in memory (the plan counts them).
    """
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + n])
        block.set_modules_to_backward_prefetch(blocks[max(i - n, 0) : i][::-1])
