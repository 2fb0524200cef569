"""One optimizer step: the loss of each micro-batch, gradient accumulation, clipping and the update.

train_step is the `train_step` block of the loop (train.py). Its arithmetic is chosen so that the
update is the one a single process would make on the whole global batch, whatever the world size,
the number of micro-batches or the share of targets that are scored (see scaled_loss). Nothing in it
waits for the device between log intervals: the loss and the gradient norm stay device tensors, and
a step with a non-finite gradient is skipped on the device and reported at the next one (NonFinite).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .config import ParallelConfig, TrainConfig
from .context_parallel import SequenceSplit
from .data import IGNORE_INDEX, Batch
from .loss import ChunkedHead, chunked_head, cross_entropy, scoring
from .parallelize import float8_after_update
from .strategy import Strategy


@dataclass
class StepContext:
    """What train_step needs besides the model, the optimizer and the batches; built once per run."""

    strategy: Strategy
    """Skips gradient sync on all but the last micro-batch; DDP's autocast."""
    sync_every_microbatch: bool
    """Reduce gradients after every micro-batch rather than only the last."""
    scaler: torch.amp.GradScaler | None
    """fp16 only: scales the loss so small gradients survive, skips steps that overflow."""
    max_grad_norm: float
    """Clip the global gradient norm to this (0: no clipping, the norm is still measured)."""
    device: torch.device
    scored_targets_only: bool = False
    """Some targets are IGNORE_INDEX (data.source = "sft"): average over the step's scored targets instead."""
    sequence_split: SequenceSplit | None = None
    """Context parallelism: this rank's chunks of every sequence (context_parallel.py); None: whole sequences."""
    experts: RouterBalance | None = None
    """A mixture of experts: its router's aux loss joins the loss, and its balance is kept and reported."""
    nonfinite: NonFinite | None = None
    """Skips and reports steps whose gradient norm is not finite (None: none are, fp16's loss scaler skips them)."""
    after_update: Callable[[], None] | None = None
    """Runs after each optimizer step: float8's scales for the next all-gather (parallelize.float8_after_update)."""
    loss_head: ChunkedHead | None = None
    """The model's output layer when it computes the loss in chunks (loss.py); None: the model returns logits."""


@dataclass
class StepResult:
    loss: torch.Tensor
    """This rank's loss, whose mean over the ranks is the global batch's (a detached scalar on the device)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (a scalar on the device: reading it waits for the step)."""
    lr: float
    """Learning rate the step used."""
    metrics: dict[str, float] = field(default_factory=dict)
    """More to log: a mixture of experts' aux loss and balance (RouterBalance.after_step)."""


@dataclass
class RouterBalance:
    """A mixture of experts' router, from the trainer's side (the model's aux_loss, take_expert_load,
    balance_metrics and apply_balance, as Qwen3-MoE's model defines them).

    Each micro-batch's loss adds the model's aux loss (router_aux_loss_coef x its load-balancing loss),
    scaled as the cross-entropy is. After the step, the tokens each expert received on every data-parallel
    rank and the aux loss are summed in one all-reduce; every rank moves its routing biases alike from
    that sum (bias balancing), and the step reports the imbalance (max / mean tokens per expert), the
    mean aux loss and the bias range. Validation passes count nothing: the model counts in train mode only.
    """

    model: nn.Module
    """The model itself (not the DDP wrapper), which has aux_loss and the rest."""
    group: dist.ProcessGroup | None
    """The ranks that split the batch (strategy.dp_group; None: all)."""

    def aux_loss(self) -> torch.Tensor:
        return self.model.aux_loss()

    def after_step(self, aux_sum: torch.Tensor, micro_batches: int) -> dict[str, float]:
        load = self.model.take_expert_load()
        if load is None:  # no sparse layer ran
            return {}
        both = torch.cat([load.flatten(), (aux_sum / micro_batches).float().view(1)])
        if dist.is_initialized():
            dist.all_reduce(both, group=self.group)
        ranks = dist.get_world_size(self.group) if dist.is_initialized() else 1
        load = both[:-1].view_as(load)
        self.model.apply_balance(load)
        return {"moe/aux_loss": both[-1].item() / ranks, **self.model.balance_metrics(load)}


class NonFinite:
    """Refuses to train on a non-finite gradient norm (a NaN or inf loss or gradient) without reading the norm on
    the host every step, which would stall the host until the backward pass ends, before it may queue the update.

    With fused AdamW (strategy.adamw_kernel) the update itself is conditional: the fused kernel takes
    `found_inf`, as torch's GradScaler gives it, and where it is set leaves the weights, the moments and
    the step count as they were; a device counter keeps the steps skipped so. The host reads it every
    `every` steps (the log interval, metrics.log_every) and at step `last`, and raises FloatingPointError
    naming them: a non-finite step is detected up to every - 1 steps late, and no update is ever made from
    it. A checkpoint saved meanwhile holds the weights from before it. With foreach AdamW (parameters
    without fused kernels) the norm is read before every update, as the check cannot wait.
    """

    def __init__(self, device: torch.device, *, every: int, last: int):
        self.every, self.last, self.since = every, last, 1
        self.skipped = torch.zeros((), device=device)

    def step(self, optimizer: torch.optim.Optimizer, local: torch.optim.Optimizer, grad_norm: torch.Tensor,
             step: int) -> None:  # fmt: skip
        """optimizer.step() unless `grad_norm` is not finite; `local` is the torch optimizer inside it (ZeRO's)."""
        if not local.defaults.get("fused"):
            if not math.isfinite(grad_norm.item()):
                self.skipped += 1
                self.check(step)
            optimizer.step()
            return
        found_inf = torch.logical_not(torch.isfinite(grad_norm)).float()
        local.found_inf = found_inf  # read by the fused kernel, as GradScaler sets it (torch.optim.Adam.step)
        try:
            optimizer.step()
        finally:
            del local.found_inf
        self.skipped += found_inf
        if step % self.every == 0 or step == self.last:
            self.check(step)

    def check(self, step: int) -> None:
        """Raise FloatingPointError if a step since the last check had a non-finite gradient norm (a sync)."""
        skipped, first = int(self.skipped.item()), self.since
        self.since = step + 1
        if skipped:
            raise FloatingPointError(
                f"non-finite loss or gradient in {skipped} of steps {first}-{step}; their updates were skipped and the "
                "weights are those before them. Lower train.lr, raise train.warmup_steps, or check the data"
            )


def build_step_context(
    *, parallel: ParallelConfig, train: TrainConfig, unscored_targets: bool, strategy: Strategy, device: torch.device,
    cp_rank: int = 0, cp: int = 1, model: nn.Module | None = None, log_every: int = 1,
) -> StepContext:  # fmt: skip
    """The step's settings; `unscored_targets` says the data source may mark targets IGNORE_INDEX (its
    SourceSpec's), `cp_rank` is this rank's place in its context-parallel group of `cp` ranks (distributed.Degrees),
    `model` the model itself (strategy.unwrap), whose aux_loss makes it a mixture of experts, `log_every` the steps
    between the host's reads of the step's figures (metrics.log_every)."""
    experts = RouterBalance(model, strategy.dp_group) if hasattr(model, "aux_loss") else None
    fp16 = parallel.mixed_precision == "fp16"
    float8 = float8_after_update(model, parallel.float8, fsdp=strategy.shards_parameters) if model is not None else None
    return StepContext(
        strategy=strategy,
        sync_every_microbatch=parallel.grad_sync_every_microbatch,
        scaler=torch.amp.GradScaler(device.type) if fp16 else None,
        max_grad_norm=train.max_grad_norm,
        device=device,
        scored_targets_only=unscored_targets,
        sequence_split=SequenceSplit(cp_rank, cp) if cp > 1 else None,
        experts=experts,
        nonfinite=None if fp16 else NonFinite(device, every=log_every, last=train.steps),
        after_update=float8,
        loss_head=chunked_head(model) if model is not None else None,
    )


def scaled_loss(micro_batches: list[Batch], ctx: StepContext) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of one micro-batch (the model's output and the targets), scaled so that the ranks' gradients, which
    FSDP and DDP average, average to the gradient of the mean over every scored target of the global batch.

    When every target is scored, every micro-batch has as many, and its mean / len does it. With
    unscored targets (IGNORE_INDEX: data.source = "sft") micro-batches and ranks score different
    numbers, and a mean per micro-batch or per rank would weigh a target by how few others share it:
    each micro-batch's sum is divided by the step's scored targets on all ranks (one all-reduce) and
    multiplied by the world size that the ranks' average divides by.

    With context parallelism the micro-batches are this rank's chunks of its sequences (train_step splits
    them first), and nothing changes: each rank's mean over its tokens (or sum over the step's scored
    targets) is a share of the sequence's, which FSDP's average over the group (it shards over it too)
    adds up. The logged loss, the mean over ranks, is then the one a single rank computes.
    """
    chunked = ctx.loss_head is not None  # the model returns each position's loss (loss.py), not its logits
    if not ctx.scored_targets_only:
        return lambda out, targets: cross_entropy(out, targets, chunked=chunked) / len(micro_batches)
    scored = torch.stack([(targets != IGNORE_INDEX).sum() for _, targets in micro_batches]).sum()
    world = 1
    if dist.is_initialized():
        dist.all_reduce(scored)
        world = dist.get_world_size()
    # Tensor parallelism: a group's ranks count the same targets, and the group size cancels.
    per_rank = scored.clamp(min=1) / world  # nothing scored in the whole step: a zero loss, not 0/0

    def summed(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(out, targets, chunked=chunked, reduction="sum") / per_rank

    return summed


def train_step(model: nn.Module, optimizer, scheduler, micro_batches: list[Batch], ctx: StepContext) -> StepResult:
    """One optimizer step over this rank's micro-batches; gradients are reduced on the last one."""
    positions: list[torch.Tensor | None] = [None] * len(micro_batches)
    if ctx.sequence_split is not None:  # context parallelism: this rank's chunks of every sequence
        split = [ctx.sequence_split(inputs, targets) for inputs, targets in micro_batches]
        micro_batches, positions = [(inputs, targets) for inputs, targets, _ in split], [p for *_, p in split]
    loss_of = scaled_loss(micro_batches, ctx)
    loss_sum, aux_sum = torch.zeros((), device=ctx.device), torch.zeros((), device=ctx.device)
    for i, (inputs, targets) in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1 or ctx.sync_every_microbatch
        with ctx.strategy.gradient_sync(model, sync), scoring(ctx.loss_head, targets):
            with ctx.strategy.autocast():  # the forward alone: backward computes in the dtypes it chose
                # model(x), never model.forward(x): FSDP hooks live in __call__
                out = model(inputs) if positions[i] is None else model(inputs, positions=positions[i])
            # The micro-batch losses sum to this rank's share of the global-batch mean (scaled_loss).
            loss = loss_of(out, targets)
            objective = loss
            if ctx.experts is not None:  # the router's aux loss, averaged over the micro-batches likewise
                aux = ctx.experts.aux_loss()
                objective = loss + aux / len(micro_batches)
                aux_sum += aux.detach()
            (ctx.scaler.scale(objective) if ctx.scaler else objective).backward()
        loss_sum += loss.detach()
    if ctx.scaler:
        ctx.scaler.unscale_(optimizer)
    grad_norm = clip_gradients(model, ctx.max_grad_norm if ctx.max_grad_norm > 0 else math.inf)
    lr = optimizer.param_groups[0]["lr"]
    if ctx.scaler:
        ctx.scaler.step(optimizer)  # skipped when the scaled gradients overflowed (on the device with fused AdamW)
        ctx.scaler.update()
    else:
        local = ctx.strategy.local_optimizer(optimizer)
        ctx.nonfinite.step(optimizer, local, grad_norm, step=scheduler.last_epoch + 1)
    if ctx.after_update is not None:
        ctx.after_update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    metrics = ctx.experts.after_step(aux_sum, len(micro_batches)) if ctx.experts is not None else {}
    return StepResult(loss_sum, grad_norm, lr, metrics)


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradients down to a global norm of at most `max_norm` (inf: measure it only); return their norm
    before that, a scalar on the device.

    With sharded parameters the norm is a DTensor, summed over the mesh dimensions that split the
    gradients in one all-reduce (with tensor parallelism, over the "dp_shard_tp" group that
    distributed.build_mesh flattens for it); full_tensor() then makes it the global value, on every rank.
    Expert parallelism puts the experts' gradients on a mesh of their own (expert_parallel.py), which
    one norm cannot mix with the others: each mesh's norm is then taken whole, and they are combined.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if len(meshes) <= 1:
        if math.isinf(max_norm):  # nothing to scale: a multiplication of every gradient by 1 saved
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    # In the same order on every rank (a set's is not): each norm below is a collective.
    ordered = sorted(meshes, key=lambda mesh: mesh.mesh_dim_names)
    by_mesh = [[g for g in grads if g.device_mesh == mesh] for mesh in ordered]
    norms = [torch.nn.utils.get_total_norm(group, foreach=True).full_tensor() for group in by_mesh]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if math.isinf(max_norm):  # measured only, as above
        return total
    # clip_grad_norm_'s rule (and its fp32 arithmetic), applied to each mesh's gradients.
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # on the device: no host read
    torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coefficient)
    return total
