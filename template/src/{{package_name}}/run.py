"""The run, built once: process group, model, optimizer, data, checkpoints. `build_run(cfg)` is the one build
that training (train.py), the tests' probes and fault injection, and the tools use, so none of them
re-assembles the sequence, and a change to it reaches them all.

    init_distributed -> build_model_meta -> build_optimizer -> loaders, checkpoints, train state

build_model_meta follows the FSDP2 rules (tests/test_fsdp_rules.py): the model is built on the meta device, LoRA
adds its adapters (one hook), parallelize() applies float8, tensor and context parallelism, activation
checkpointing, compile and FSDP in that order, `to_empty` allocates this rank's shards only, and then every weight
is set: from rank 0's seeded init or pretrained files, the same at any world size, and every
non-persistent buffer recomputed. The optimizer is built after sharding, on the sharded parameters.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import CheckpointManager, FaultHook
from .config import Config, DistConfig, FinetuneConfig, ParallelConfig, TrainConfig
from .data import HeldOut, Loader, build_held_out, build_loader, source_spec
from .distributed import (
    DistEnv,
    build_mesh,
    degrees_of,
    expert_mesh,
    init_process_group,
    rendezvous_from_env,
    resolve_backend,
    resolve_device,
)
from .evaluate import checkpoint_to_evaluate
from .loss import apply_chunked_loss, loss_chunk
from .metrics import init_logging
from .models import ModelConfig, ModelSpec, model_spec
from .models.lora import apply_lora, lora_rank
from .parallelize import DTYPES, parallelize
from .step import StepContext, build_step_context
from .strategy import Strategy, build_strategy, shards_nothing, strategy_class
from .train_state import TrainState
from .weights import apply_initial_weights

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a training job is made of, built once by build_run, in the order it was built."""

    cfg: Config
    """The whole config, for the loop (train.py) and for the record (metrics)."""
    env: DistEnv
    """This rank, the world, the device, the backend and the mesh."""
    strategy: Strategy
    """FSDP or DDP: how gradients are synchronised, what a checkpoint holds, how the ranks keep pace."""
    spec: ModelSpec
    """The model's contract, resolved once for the run."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: Loader
    held_out: HeldOut | None
    """The validation batches (None when eval.interval = 0 and no --eval-only)."""
    checkpoints: CheckpointManager
    state: TrainState
    """What a checkpoint saves and restores (model, optimizer, schedule, step, data position, RNG)."""
    step_context: StepContext
    resume: Path | None
    """The checkpoint checkpoint_load restores (None: the run starts at step 0 from its initial weights)."""

    def release(self) -> None:
        """Stop the data threads and drop every reference to the model and its state.

        A DDP reducer that outlives the process group deadlocks gloo's teardown (it joins worker
        threads while holding the GIL), so nothing may keep the model alive once the job is over.
        """
        self.loader.close()
        if self.held_out is not None:
            self.held_out.loader.close()
        for field in ("model", "optimizer", "scheduler", "state", "step_context", "strategy", "loader", "held_out"):
            setattr(self, field, None)


def build_run(cfg: Config, *, env: DistEnv | None = None, faults: FaultHook | None = None) -> Run:
    """The run `cfg` describes, on the ranks the launcher started (RANK, WORLD_SIZE, ... in the environment).

    Call preflight.check first: this assumes the inputs are good. `env`: the process group is already
    up (init_distributed was called; a probe that measures the build alone). `faults` lets a test crash
    a rank where a crash must leave the last good checkpoint loadable (checkpoint.FaultHook)."""
    spec = model_spec(cfg.model.name)
    if env is None:
        env = init_distributed(device=cfg.device, dist=cfg.dist, parallel=cfg.parallel, seed=cfg.train.seed)
    strategy = build_strategy(cfg.parallel, env.mesh, env.device, degrees=env.degrees)
    root = Path(cfg.run_dir) / "checkpoints"
    checkpoints = CheckpointManager(cfg.checkpoint, root, env.rank, env.degrees, model=cfg.model, faults=faults)
    if cfg.eval.only:
        resume = checkpoint_to_evaluate(checkpoint=cfg.checkpoint, run_dir=Path(cfg.run_dir), rank=env.rank)
    else:
        resume = checkpoints.resume_path()
    model = build_model_meta(
        spec=spec, model=cfg.model, finetune=cfg.finetune, parallel=cfg.parallel, env=env, strategy=strategy,
        init_from=cfg.checkpoint.init_from, seed=cfg.train.seed, init_weights=resume is None,
        loss_chunk=loss_chunk(train=cfg.train, context_parallel=cfg.parallel.context_parallel,
                              logits=spec.shape(cfg.model).logits),
    )  # fmt: skip
    optimizer, scheduler = build_optimizer(model, train=cfg.train, strategy=strategy)
    data = {"data": cfg.data, "train": cfg.train, "eval": cfg.eval, "model": cfg.model}
    ranks = {"rank": env.degrees.dp_rank(env.rank), "world_size": env.degrees.dp, "device": env.device}
    loader, held_out = build_loader(**data, **ranks), build_held_out(**data, **ranks)
    step_context = build_step_context(
        parallel=cfg.parallel, train=cfg.train, unscored_targets=source_spec(cfg.data.source).unscored_targets,
        strategy=strategy, device=env.device, cp_rank=env.degrees.cp_rank(env.rank), cp=env.degrees.cp,
        model=strategy.unwrap(model), log_every=cfg.metrics.log_every,
    )  # fmt: skip
    state = TrainState(model, optimizer, scheduler, loader, env.rank, strategy)
    return Run(cfg, env, strategy, spec, model, optimizer, scheduler, loader, held_out, checkpoints, state,
               step_context, resume)  # fmt: skip


def init_distributed(*, device: str, dist: DistConfig, parallel: ParallelConfig, seed: int) -> DistEnv:
    """Join the process group on this rank's device and backend, and build the mesh parallelize() shards over."""
    rdzv = rendezvous_from_env(dist.init_method)
    init_logging(rdzv.rank)
    on = resolve_device(device, rdzv.local_rank)
    backend = resolve_backend(dist.backend, on, cpu_collectives=parallel.cpu_offload)
    if on.type != "cpu":
        torch.accelerator.set_device_index(on.index)
    degrees = degrees_of(parallel, world_size=rdzv.world_size, ranks_per_node=rdzv.local_world_size)
    degrees.check()  # preflight has (a probe or a test may come here without it)
    strategy_class(parallel, degrees).before_process_group()
    init_process_group(rdzv, on, backend, dist.init_method, dist.init_timeout_s)
    mesh = build_mesh(on.type, degrees)
    experts = expert_mesh(mesh, degrees)
    torch.manual_seed(seed)
    logger.info("world size %d on %s, backend %s, mesh %s", rdzv.world_size, on, backend, experts or mesh)
    return DistEnv(rdzv.rank, rdzv.world_size, rdzv.local_world_size, on, backend, mesh, degrees, experts)


def build_model_meta(
    *, spec: ModelSpec, model: ModelConfig, finetune: FinetuneConfig, parallel: ParallelConfig, env: DistEnv,
    strategy: Strategy, init_from: str, seed: int, init_weights: bool, loss_chunk: int = 0,
) -> nn.Module:  # fmt: skip
    """Build on the meta device (with LoRA's adapters for finetune.method=lora, and an output layer that computes
    the loss in chunks of `loss_chunk` positions unless 0), parallelize, materialise this rank's shards, set the
    weights (unless a checkpoint will: `init_weights`=False), wrap."""
    with torch.device("meta"):
        module = spec.build(model)
    apply_lora(module, finetune=finetune, layout=spec.lora, frozen_dtype=DTYPES[parallel.mixed_precision])
    apply_chunked_loss(module, loss_chunk)  # before parallelize: tensor parallelism and FSDP keep its class
    parallelize(module, parallel=parallel, mesh=env.mesh, tp_plan=spec.tensor_parallel_plan(model),
                cp_plan=spec.cp_plan, adapter_rank=lora_rank(finetune), expert_mesh=env.expert_mesh,
                one_rank=shards_nothing(env.degrees, parallel))  # fmt: skip
    # Allocates only this rank's shards (on the host with CPU offload); the contents are garbage.
    module.to_empty(device=env.device)
    module.tie_weights()
    if init_weights:
        apply_initial_weights(module, spec=spec, model_cfg=model, finetune=finetune, init_from=init_from, seed=seed,
                              strategy=strategy)  # fmt: skip
    # Non-persistent buffers are neither broadcast nor checkpointed: every rank recomputes them.
    module.init_buffers()
    wrapped = strategy.wrap(module)
    n_params = sum(p.numel() for p in wrapped.parameters())
    n_trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    logger.info(
        "model %s: %.2fM parameters, %.2fM trained (finetune %s), sharding %s",
        model.preset, n_params / 1e6, n_trained / 1e6, finetune.method,
        "none (one rank)" if shards_nothing(env.degrees, parallel) else parallel.sharding,
    )  # fmt: skip
    return wrapped


def build_optimizer(model: nn.Module, *, train: TrainConfig, strategy: Strategy):
    """AdamW over the sharded parameters that train, with linear warm-up and cosine decay.

    Built after sharding, so its state is created for (and sharded like) the DTensor parameters.
    Frozen parameters (all but the adapters with LoRA) get no state. With parallel.zero_optimizer
    (DDP), each rank keeps AdamW state only for the parameters it owns, steps those and broadcasts
    them (ZeroRedundancyOptimizer: the ZeroDDP strategy builds it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    # LoRA's adapters are matrices: decay pulls their update towards the pretrained weights.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]  # LoRA trains no vectors
    optimizer = strategy.build_optimizer(groups, lr=train.lr, betas=train.betas)

    def lr_factor(done: int) -> float:
        if done < train.warmup_steps:
            return (done + 1) / train.warmup_steps
        progress = (done - train.warmup_steps) / max(train.steps - train.warmup_steps, 1)
        return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
