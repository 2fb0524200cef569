"""Every launch-time check, in one place: what this config needs of the world size, the devices, the files.

The config has checked its own values when it was loaded (config/). What is left depends on where
it runs: the plan against the world size and the memory of the devices and the node, the data and
the checkpoints on disk, the weights to start from, the device and the backend. `check` runs it all
on every rank before the process group starts, so every rank finds the same UsageError and one of
them reports it (train.refuse); `check_launch` runs the same checks in one process for the ranks a
launch script is about to start (`--check-only`), so bad input costs one message and exit code 2,
and no rank starts. Each check reads only the config, the environment and the files.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .checkpoint import check_resume, check_resume_finetune
from .config import Config
from .data import check_data
from .distributed import (
    Rendezvous,
    check_backend,
    check_init_method,
    degrees_of,
    planned_rendezvous,
    resolve_backend,
    resolve_device,
)
from .evaluate import check_eval_only
from .expert_parallel import check_expert_parallel
from .model_record import check_resume_model
from .models import model_spec
from .parallelize import check_float8
from .plan import check_plan
from .weights import check_init_from


def check(cfg: Config, rdzv: Rendezvous) -> None:
    """Refuse bad input for the rank `rdzv` describes: the device, the plan, the data, what to resume or
    load, the backend (UsageError, naming the setting and the fix)."""
    device = resolve_device(cfg.device, rdzv.local_rank)
    p, run_dir = cfg.parallel, Path(cfg.run_dir)
    degrees = degrees_of(p, world_size=rdzv.world_size, ranks_per_node=rdzv.local_world_size)
    degrees.check()
    check_expert_parallel(shape=model_spec(cfg.model.name).shape(cfg.model), degrees=degrees)
    check_plan(
        model=cfg.model, train=cfg.train, parallel=p, hardware=cfg.hardware, finetune=cfg.finetune,
        checkpoint=cfg.checkpoint, world_size=rdzv.world_size, device=device, local_world_size=rdzv.local_world_size,
    )  # fmt: skip
    # A tensor- or context-parallel group shares its batches: the data splits over the data-parallel ranks.
    check_data(data=cfg.data, train=cfg.train, eval=cfg.eval, model=cfg.model, rank=degrees.dp_rank(rdzv.rank),
               world_size=degrees.dp)  # fmt: skip
    check_resume(cfg.checkpoint)
    check_resume_model(checkpoint=cfg.checkpoint, model=cfg.model, spec=model_spec(cfg.model.name), run_dir=run_dir)
    check_resume_finetune(checkpoint=cfg.checkpoint, finetune=cfg.finetune, run_dir=run_dir)
    check_init_from(checkpoint=cfg.checkpoint, finetune=cfg.finetune, model=cfg.model,
                    spec=model_spec(cfg.model.name), run_dir=run_dir)  # fmt: skip
    check_eval_only(eval=cfg.eval, checkpoint=cfg.checkpoint, run_dir=run_dir)
    check_float8(p.float8, device)
    backend = resolve_backend(cfg.dist.backend, device, cpu_collectives=p.cpu_offload)
    check_backend(backend, device.type, p.sharding)


def check_launch(cfg: Config) -> None:
    """--check-only: `check` for the ranks a launch script is about to start (WORLD_SIZE, LOCAL_WORLD_SIZE), in
    this one process, with no process group. The scripts run it before torchrun."""
    check_init_method(cfg.dist.init_method)
    logging.disable(logging.WARNING)  # the ranks log what the checks note; this process speaks only to refuse
    check(cfg, planned_rendezvous())
