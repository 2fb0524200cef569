"""The run-time side of the hardware plan (the memory model arrives with the planner)."""

from __future__ import annotations

import torch

from .config import Config


def check_plan(cfg: Config, world_size: int, device: torch.device) -> None:
    """Refuse to start when the live job contradicts the plan the repo was generated with."""
    hw = cfg.hardware
    if not hw.enforce or device.type != hw.accelerator:
        return
    planned = hw.gpus_per_node * hw.num_nodes
    if world_size != planned:
        raise ValueError(
            f"launched on {world_size} ranks but the plan is for {planned} ({hw.num_nodes} node(s) x "
            f"{hw.gpus_per_node}); launch {planned} ranks, or re-plan with `python -m <package>.plan --detect`"
        )
