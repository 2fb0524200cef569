"""Training entry point. main() reads top to bottom as the run happens:

    init_distributed -> build_model_meta -> build_optimizer -> checkpoint_load
    -> train_loop { train_step -> metrics -> validate -> checkpoint_save } -> teardown

`--eval-only` stops after checkpoint_load: it scores the checkpoint on the held-out data once.

Launch with torchrun, e.g. `torchrun --standalone --nproc_per_node 2 -m <package>.train
--config configs/debug.toml`, or with scripts/run_local.sh. Bad input (config, data path,
checkpoint to resume, a world size the plan refuses) is found before the process group starts
and reported once, by local rank 0, which exits with code 2 (config.EXIT_USAGE); see refuse().
The launch scripts find it before any rank starts: `--check-only` runs the same checks in one
process for the world size they are about to launch (check_launch).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor
from tqdm.contrib.logging import logging_redirect_tqdm

from .checkpoint import CheckpointManager, FaultHook, TrainState, check_resume, check_resume_finetune
from .config import EXIT_USAGE, Config, UsageError, load_config, reports_errors
from .data import IGNORE_INDEX, HeldOut, agree_on_steps, build_held_out, build_loader, check_data
from .distributed import (
    DistEnv,
    LoopControl,
    Rendezvous,
    StopRequest,
    any_rank,
    build_mesh,
    check_backend,
    check_init_method,
    check_tensor_parallel,
    init_process_group,
    mean_across_ranks,
    planned_rendezvous,
    rendezvous_from_env,
    resolve_backend,
    resolve_device,
    set_collective_timeout,
)
from .evaluate import EvalResult, check_eval_only, checkpoint_to_evaluate, evaluate
from .metrics import MetricsLogger, init_logging, peak_tflops
from .models import ModelShape, ModelSpec, model_spec
from .models.lora import apply_frozen_dtype, apply_lora, frozen_matmul_params, lora_rank
from .parallelize import DTYPES, apply_ac, apply_compile, apply_float8, check_float8
from .plan import check_plan
from .strategy import Strategy, build_strategy
from .weights import apply_initial_weights, check_init_from, export_weights

logger = logging.getLogger(__name__)


def check_inputs(cfg: Config, spec: ModelSpec, rdzv: Rendezvous) -> tuple[torch.device, str]:
    """Refuse bad input for these ranks: the device, the plan, the data, what to resume or load, the
    backend. Each check reads only the config, the environment and the files, so every rank finds the
    same UsageError (see refuse), and a launch script finds it first (--check-only, check_launch).
    Returns the device and the backend string for init_process_group.
    """
    device = resolve_device(cfg.device, rdzv.local_rank)
    tp = cfg.parallel.tensor_parallel
    check_tensor_parallel(tp, rdzv.world_size, rdzv.local_world_size)
    check_plan(
        model=cfg.model, train=cfg.train, parallel=cfg.parallel, hardware=cfg.hardware, finetune=cfg.finetune,
        checkpoint=cfg.checkpoint, world_size=rdzv.world_size, device=device, local_world_size=rdzv.local_world_size,
    )  # fmt: skip
    check_data(cfg, rdzv.rank // tp, rdzv.world_size // tp)  # a tensor-parallel group shares its batches
    check_resume(cfg.checkpoint)
    check_resume_finetune(cfg)
    check_init_from(cfg, spec)
    check_eval_only(cfg)
    check_float8(cfg.parallel.float8, device)
    backend = resolve_backend(cfg.dist.backend, device, cpu_collectives=cfg.parallel.cpu_offload)
    check_backend(backend, device.type, cfg.parallel.sharding)
    return device, backend


def check_launch(cfg: Config, spec: ModelSpec) -> None:
    """--check-only: check_inputs for the ranks a launch script is about to start (WORLD_SIZE,
    LOCAL_WORLD_SIZE), in this one process, with no process group. The scripts run it before torchrun,
    so bad input costs one message and exit code 2, and no rank starts."""
    check_init_method(cfg.dist.init_method)
    logging.disable(logging.WARNING)  # the ranks log what the checks note; this process speaks only to refuse
    check_inputs(cfg, spec, planned_rendezvous())


def init_distributed(cfg: Config, spec: ModelSpec) -> DistEnv:
    """Check the plan and the inputs, join the process group on the right device and backend, choose the strategy."""
    rdzv = rendezvous_from_env(cfg.dist.init_method)
    init_logging(rdzv.rank)
    device, backend = check_inputs(cfg, spec, rdzv)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    init_process_group(rdzv, device, backend, cfg.dist.init_method, cfg.dist.init_timeout_s)
    tp = cfg.parallel.tensor_parallel
    shard_size = cfg.parallel.hsdp_shard_size or rdzv.local_world_size // tp
    mesh = build_mesh(cfg.parallel.sharding, device.type, rdzv.world_size, shard_size, tp)
    strategy = build_strategy(cfg.parallel, mesh, device)
    torch.manual_seed(cfg.train.seed)
    logger.info("world size %d on %s, backend %s, mesh %s", rdzv.world_size, device, backend, mesh)
    return DistEnv(rdzv.rank, rdzv.world_size, rdzv.local_world_size, device, backend, strategy, tp)


def build_model_meta(cfg: Config, spec: ModelSpec, env: DistEnv, *, init_weights: bool) -> nn.Module:
    """Build on the meta device (with LoRA adapters for finetune.method=lora), parallelize, materialise
    this rank's shards, initialise."""
    with torch.device("meta"):
        model = spec.build(cfg.model)
    apply_lora(model, cfg.finetune, spec.lora)
    p, strategy = cfg.parallel, env.strategy
    if cfg.finetune.method == "lora":
        apply_frozen_dtype(model, DTYPES[p.mixed_precision])
    apply_float8(model.layers, p.float8, fsdp=strategy.shards_parameters)
    # Before the wrappers rename the blocks.
    strategy.apply_tensor_parallel(model, spec.tensor_parallel_plan(cfg.model))
    apply_ac(model.layers, p.activation_checkpointing, adapter_rank=lora_rank(cfg.finetune))
    if p.compile:
        apply_compile(model.layers, p.compile_backend)
    strategy.apply_sharding(model)
    # Allocates only this rank's shards (on the host with CPU offload); the contents are garbage.
    model.to_empty(device=env.device)
    model.tie_weights()
    if init_weights:  # a resumed run gets its weights from the checkpoint
        apply_initial_weights(model, cfg, spec, strategy)
    # Non-persistent buffers are neither broadcast nor checkpointed: every rank recomputes them.
    model.init_buffers()
    model = strategy.wrap(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "model %s: %.2fM parameters, %.2fM trained (finetune %s), sharding %s",
        cfg.model.preset, n_params / 1e6, n_trained / 1e6, cfg.finetune.method, p.sharding,
    )  # fmt: skip
    return model


def build_optimizer(cfg: Config, model: nn.Module, strategy: Strategy):
    """AdamW over the sharded parameters that train, with linear warm-up and cosine decay.

    Built after sharding, so its state is created for (and sharded like) the DTensor parameters.
    Frozen parameters (all but the adapters with LoRA) get no state. With parallel.zero_optimizer
    (DDP), each rank keeps AdamW state only for the parameters it owns, steps those and broadcasts
    them (ZeroRedundancyOptimizer: the ZeroDDP strategy builds it).
    """
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    # LoRA's adapters are matrices: decay pulls their update towards the pretrained weights.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]  # LoRA trains no vectors
    optimizer = strategy.build_optimizer(groups, lr=t.lr, betas=t.betas)

    def lr_factor(done: int) -> float:
        if done < t.warmup_steps:
            return (done + 1) / t.warmup_steps
        progress = (done - t.warmup_steps) / max(t.steps - t.warmup_steps, 1)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


@dataclass
class StepContext:
    strategy: Strategy
    """Skips gradient sync on all but the last micro-batch; DDP's autocast."""
    sync_every_microbatch: bool
    """Reduce gradients after every micro-batch rather than only the last."""
    scaler: torch.amp.GradScaler | None
    """fp16 only: scales the loss so small gradients survive, skips steps that overflow."""
    max_grad_norm: float
    device: torch.device
    scored_targets_only: bool = False
    """Some targets are IGNORE_INDEX (data.source = "sft"): average over the step's scored targets instead."""


@dataclass
class StepResult:
    loss: torch.Tensor
    """This rank's loss, whose mean over the ranks is the global batch's (a detached scalar on the device)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate the step used."""


def build_loss(micro_batches, ctx: StepContext) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of one micro-batch (flat logits and targets), scaled so that the ranks' gradients, which
    FSDP and DDP average, average to the gradient of the mean over every scored target of the global batch.

    When every target is scored, every micro-batch has as many, and its mean / len does it. With
    unscored targets (IGNORE_INDEX: data.source = "sft") micro-batches and ranks score different
    numbers, and a mean per micro-batch or per rank would weigh a target by how few others share it:
    each micro-batch's sum is divided by the step's scored targets on all ranks (one all-reduce) and
    multiplied by the world size that the ranks' average divides by.
    """
    if not ctx.scored_targets_only:
        return lambda logits, targets: F.cross_entropy(logits, targets) / len(micro_batches)
    scored = torch.stack([(targets != IGNORE_INDEX).sum() for _, targets in micro_batches]).sum()
    world = 1
    if dist.is_initialized():
        dist.all_reduce(scored)
        world = dist.get_world_size()
    # Tensor parallelism: a group's ranks count the same targets, and the group size cancels.
    per_rank = scored.clamp(min=1) / world  # nothing scored in the whole step: a zero loss, not 0/0

    def summed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / per_rank

    return summed


def train_step(model: nn.Module, optimizer, scheduler, micro_batches, ctx: StepContext) -> StepResult:
    """One optimizer step over this rank's micro-batches; gradients are reduced on the last one."""
    loss_of = build_loss(micro_batches, ctx)
    loss_sum = torch.zeros((), device=ctx.device)
    for i, (inputs, targets) in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1 or ctx.sync_every_microbatch
        with ctx.strategy.gradient_sync(model, sync), ctx.strategy.autocast():
            logits = model(inputs)  # model(x), never model.forward(x): FSDP hooks live in __call__
            # The micro-batch losses sum to this rank's share of the global-batch mean (build_loss).
            loss = loss_of(logits.flatten(0, -2).float(), targets.flatten())
            (ctx.scaler.scale(loss) if ctx.scaler else loss).backward()
        loss_sum += loss.detach()
    if ctx.scaler:
        ctx.scaler.unscale_(optimizer)
    grad_norm = clip_gradients(model, ctx.max_grad_norm if ctx.max_grad_norm > 0 else math.inf)
    if not math.isfinite(grad_norm) and ctx.scaler is None:
        raise FloatingPointError(
            f"non-finite loss or gradient (grad norm {grad_norm}) at step {scheduler.last_epoch + 1}; refusing "
            "to update the weights. Lower train.lr, raise train.warmup_steps, or check the data"
        )
    lr = optimizer.param_groups[0]["lr"]
    if ctx.scaler:
        ctx.scaler.step(optimizer)  # skipped when the scaled gradients overflowed
        ctx.scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return StepResult(loss_sum, grad_norm, lr)


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Scale the gradients down to a global norm of at most `max_norm`; return their norm before that.

    With sharded parameters the norm is a DTensor, summed over the mesh dimensions that split the
    gradients in one all-reduce (with tensor parallelism, over the "dp_shard_tp" group that
    distributed.build_mesh flattens for it); full_tensor() then makes .item() the global value.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def checkpoint_load(ckpt: CheckpointManager, state: TrainState, path: Path | None) -> int:
    """Resume model, optimizer, LR schedule, data position and RNG; return the step reached."""
    if path is None:
        logger.info("no checkpoint to resume (checkpoint.resume=%s): starting at step 0", ckpt.cfg.resume)
        return 0
    ckpt.load(state, path)
    return state.step


def checkpoint_save(ckpt: CheckpointManager, state: TrainState, step: int, *, final: bool) -> None:
    """Save every checkpoint.interval steps, and whenever the run or this job ends."""
    if final or step % ckpt.cfg.interval == 0:
        ckpt.save(state, step)


def validate(
    model: nn.Module, held_out: HeldOut, ctx: StepContext, step: int, metrics: MetricsLogger | None
) -> EvalResult:
    """Score the model on the held-out batches (the same ones every time) after `step`, and report it.

    Every rank calls it after the same step: the forward passes all-gather (FSDP) and the sums
    are all-reduced. The model goes back to train mode and nothing else changes: no gradients, no
    random draws, and the training loader keeps its position. Without metrics (--eval-only)
    rank 0 prints the result as one JSON line and nothing is written.
    """
    result = evaluate(model, held_out, ctx.device, ctx.strategy.autocast, ctx.strategy.dp_group)
    if metrics is not None:
        metrics.log_eval(step, result)
    elif dist.get_rank() == 0:
        print(json.dumps({"step": step, **{f"val_{k}": v for k, v in result.scalars().items()}}), flush=True)
    return result


def build_step_context(cfg: Config, env: DistEnv) -> StepContext:
    p = cfg.parallel
    return StepContext(
        strategy=env.strategy,
        sync_every_microbatch=p.grad_sync_every_microbatch,
        scaler=torch.amp.GradScaler(env.device.type) if p.mixed_precision == "fp16" else None,
        max_grad_norm=cfg.train.max_grad_norm,
        device=env.device,
        scored_targets_only=cfg.data.source == "sft",
    )


def build_join(
    cfg: Config, strategy: Strategy, model: nn.Module, optimizer, control: LoopControl, joining: bool
) -> AbstractContextManager:
    """Join for DDP ranks whose data may run out (data.uneven_inputs=join); a no-op context otherwise.

    The joinables are listed in the order of each step's collectives: the strategy's (DDP's
    gradient all-reduce, ZeRO's parameter broadcast), then the loop's own.
    """
    if not joining:
        return nullcontext()
    joinables = [*strategy.joinables(model, optimizer), control]
    return Join(joinables, throw_on_early_termination=cfg.data.join_throw)


def build_metrics(cfg: Config, spec: ModelSpec, env: DistEnv, model: nn.Module, start_step: int) -> MetricsLogger:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    shape = spec.shape(cfg.model)
    tokens = shape.tokens or cfg.train.seq_len  # per sample (patches + 1 for a ViT)
    return MetricsLogger(
        cfg,
        run_dir,
        enabled=env.is_main,
        start_step=start_step,
        tokens_per_step=cfg.train.global_batch_size * tokens,
        world_size=env.world_size,
        flops_per_token=flops_per_token(shape, env.strategy.unwrap(model), tokens),
        peak_tflops=peak_tflops(env.device, cfg.metrics.peak_tflops),
        device=env.device,
        rank=env.rank,
    )


def flops_per_token(shape: ModelShape, model: nn.Module, tokens: int) -> float:
    """Training FLOPs per token for MFU: the model's count (its shape's), with 6 for each parameter the built
    model has beyond it (LoRA's adapters), less the weight gradients frozen weights skip."""
    added = sum(p.numel() for p in model.parameters()) - shape.P
    return shape.flops_per_token(tokens) + 6 * added - 2 * frozen_matmul_params(model)


def refuse(error: UsageError | None) -> NoReturn:
    """Report bad input once, without a traceback: local rank 0 prints it and exits with EXIT_USAGE.

    Every rank found the same error; the others exit 0 without a word, because torchrun stops
    every rank as soon as one fails, and could stop the reporting rank before it has printed.
    SystemExit passes through @record without an error file: there is no traceback to keep.
    """
    if not reports_errors():
        raise SystemExit(0)
    if error is not None:  # None: tyro has printed its own refusal of the command line
        print(f"{__package__}.train: error: {error}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def train_loop(cfg: Config, spec: ModelSpec, env: DistEnv, state: TrainState, ckpt: CheckpointManager,
               held_out: HeldOut | None, start: int) -> int:  # fmt: skip
    """Train from step `start` to train.steps, a preemption signal or train.stop_after_steps; return the step reached.

    Every rank runs the same steps: per-rank data may run out unevenly, so the ranks agree on the
    shortest (data.uneven_inputs=min), or DDP ranks that ran out shadow the others' collectives
    (join); global-batch data never runs out. A checkpoint is saved every checkpoint.interval
    steps and when the loop ends, validation runs every eval.interval steps and at the end.
    """
    model, optimizer, scheduler, loader = state.model, state.optimizer, state.scheduler, state.loader
    ctx, metrics, stop = build_step_context(cfg, env), build_metrics(cfg, spec, env, model, start), StopRequest()
    joining = cfg.data.uneven_inputs == "join" and loader.rank_sharded
    last = cfg.train.steps if joining else agree_on_steps(loader, cfg.train.steps, env.device)
    control, step = LoopControl(env.device, cfg.metrics.log_every, start), start
    with logging_redirect_tqdm(), build_join(cfg, env.strategy, model, optimizer, control, joining):
        while step < last:
            try:
                batches = metrics.timed(loader.next_batches)
            except StopIteration:  # this rank's data ran out; Join shadows the others from here
                break
            step = control.step = step + 1
            result = train_step(model, optimizer, scheduler, batches, ctx)
            Join.notify_join_context(control)
            if metrics.should_log(step):
                metrics.log(step, mean_across_ranks(result.loss, env.device), result.grad_norm, result.lr)
            metrics.after_step(step)
            if held_out and held_out.due(step, last) and not joining:  # a joined rank runs no forward
                validate(model, held_out, ctx, step, metrics)
            if step == start + 1:
                set_collective_timeout(cfg.dist.train_timeout_s)
            preempted = any_rank(stop.requested, env.device)
            job_done = preempted or step - start == cfg.train.stop_after_steps
            if not joining:  # a rank that has joined could not take part in a save
                checkpoint_save(ckpt, state, step, final=job_done or step == last)
            if job_done:
                why = "preemption signal" if preempted else "train.stop_after_steps"
                logger.info("stopping after step %d (%s); resume with the same command", step, why)
                break
    if joining:  # every rank is back in step: save where the longest-running rank stopped
        step = control.step
        checkpoint_save(ckpt, state, step, final=True)
        if held_out and held_out.interval:
            validate(model, held_out, ctx, step, metrics)
    metrics.close()
    loader.close()  # stop building batches ahead
    return step


@record
def main(argv: list[str] | None = None, *, faults: FaultHook | None = None) -> None:
    """Train as the config says; `faults` is for tests that crash a save (tests/fault_train.py)."""
    try:
        cfg = load_config(argv)
        spec = model_spec(cfg.model.name)  # the model's contract, resolved once for the run
        if cfg.dist.check_only:  # a launch script's check before it starts the ranks
            check_launch(cfg, spec)
            return
        env = init_distributed(cfg, spec)
    except UsageError as error:
        refuse(error)
    except SystemExit as tyro_exit:  # a refused command line (tyro printed why), or --help
        if tyro_exit.code:
            refuse(None)
        raise
    model = state = None
    try:
        ckpt = CheckpointManager(
            cfg.checkpoint, Path(cfg.run_dir) / "checkpoints", env.rank, env.world_size, env.tensor_parallel,
            faults=faults,
        )  # fmt: skip
        resume = checkpoint_to_evaluate(cfg, env.rank) if cfg.eval.only else ckpt.resume_path()
        model = build_model_meta(cfg, spec, env, init_weights=resume is None)
        optimizer, scheduler = build_optimizer(cfg, model, env.strategy)
        loader = build_loader(cfg, env.dp_rank, env.dp_size, env.device)
        state = TrainState(model, optimizer, scheduler, loader, env.rank, env.strategy)
        step = checkpoint_load(ckpt, state, resume)
        held_out = build_held_out(cfg, env.dp_rank, env.dp_size, env.device)
        if cfg.eval.only:  # score the checkpoint and stop, writing nothing
            validate(model, held_out, build_step_context(cfg, env), step, None)
            return
        step = train_loop(cfg, spec, env, state, ckpt, held_out, step)
        if step == cfg.train.steps and cfg.checkpoint.export != "none":
            export_weights(model, cfg, spec, Path(cfg.run_dir) / "export", env.is_main)
        ckpt.close()
        any_rank(False, env.device)  # no rank tears down while another is still communicating
    finally:
        # Release the model before the process group: a DDP reducer that outlives the group
        # deadlocks gloo's teardown (it joins worker threads while holding the GIL). So nothing
        # else may keep a reference to the model once main() returns (train_loop's Join lives in its with).
        if state is not None:  # the thread or the workers that build batches ahead, when an error stopped the loop
            state.loader.close()
        del model, state
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
