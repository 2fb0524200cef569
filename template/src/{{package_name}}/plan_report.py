"""What `python -m <package>.plan` prints: every sharding choice's per-rank memory and per-step
communication for a config (plan.py's formulas), or with --detect the re-sizing advice of
plan_resize.py."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from . import plan
from .config import EXIT_USAGE, Config, load_config
from .plan import (
    GIB,
    HEADROOM,
    SHARDINGS,
    ModelShape,
    adapter_params,
    communication_bytes,
    grad_accum,
    lora_of,
    plan_for,
    recommend,
    step_seconds,
)


def format_table(cfg: Config) -> str:
    """Per-rank memory and per-step communication of every sharding choice for this config."""
    s, hw, p = ModelShape.of(cfg.model), cfg.hardware, cfg.parallel
    unit, unit_name = (GIB, "GiB") if plan_for(cfg, sharding="no_shard").total >= GIB else (2**20, "MiB")
    widths = (15, 8, 11, 7, 10, 8, 10, 6, 8, 13)

    def line(*values) -> str:
        return "".join(
            f"{v:<{w}}" if i in (0, 7) else f"{v:>{w}}" for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    rows = [
        f"{cfg.model.preset}: {s.P / 1e9:.2f}B parameters; per rank {cfg.train.micro_batch_size} x {cfg.train.seq_len} "
        f"tokens x {grad_accum(cfg)} micro-batch(es); {p.mixed_precision}; activation checkpointing "
        f"{p.activation_checkpointing}",
        f"hardware: {hw.num_nodes} node(s) x {hw.gpus_per_node} {hw.accelerator}"
        + (f", {hw.gpu_memory_gb:g} GiB each ({HEADROOM * hw.gpu_memory_gb:.1f} usable)" if hw.gpu_memory_gb else ""),
        *lora_lines(cfg, unit, unit_name),
        "",
        line(
            "sharding",
            "offload",
            "params+opt",
            "grads",
            "gathered",
            "activ.",
            f"peak {unit_name}",
            "  fits",
            "comm GB",
            "comm/compute",
        ),  # fmt: skip
    ]
    choices = [("no_shard", False, False), ("no_shard", False, True)] + [
        (x, offload, False) for x in SHARDINGS[1:] if x != "hybrid" or hw.num_nodes > 1 for offload in (False, True)
    ]
    for sharding, offload, zero in choices:
        m = plan_for(cfg, sharding=sharding, cpu_offload=offload, zero_optimizer=zero)
        compute, comm = step_seconds(s, cfg, sharding, zero)
        sent = communication_bytes(
            s, sharding, p.mixed_precision, hw.gpus_per_node, hw.num_nodes, zero, p.float8, **lora_of(cfg)
        )
        fits = "yes" if not hw.gpu_memory_gb or m.fits(hw.gpu_memory_gb) else "no"
        resident = 0 if offload else m.params + m.optim
        sizes = [f"{b / unit:.1f}" for b in (resident, m.grads_live, m.gathered + m.gradbuf, m.activations, m.total)]
        this = (sharding, offload, zero) == (p.sharding, p.cpu_offload, p.zero_optimizer)
        name, sent_gb = sharding + ("+zero" if zero else ""), sum(sent.values()) / 1e9
        row = line(name, "yes" if offload else "no", *sizes, f"  {fits}", f"{sent_gb:.1f}", f"{comm / compute:.2f}")
        rows.append(row + ("   <- this config" if this else ""))
    ac, sharding, offload = recommend(cfg)
    rows += [
        "",
        f"planner's choice: sharding={sharding}, activation_checkpointing={ac}, cpu_offload={offload}",
        "comm/compute: estimated communication time over compute time per step (40% MFU); above 1, FSDP cannot "
        "hide the communication behind compute",
    ]
    return "\n".join(rows)


def lora_lines(cfg: Config, unit: float, unit_name: str) -> list[str]:
    """With LoRA: the adapters trained, and the peak of the same plan with full fine-tuning."""
    f = cfg.finetune
    if f.method != "lora":
        return []
    s = ModelShape.of(cfg.model)
    adapters = s.L * adapter_params(s, **lora_of(cfg))
    lora, full = plan_for(cfg).total, plan_for(cfg, finetune="full").total
    return [
        f"finetune: lora, rank {f.lora_rank}, lora_targets {f.lora_targets}: {adapters / 1e6:.2f}M trained "
        f"parameters ({adapters / s.P:.2%}); peak {lora / unit:.1f} {unit_name} against {full / unit:.1f} with full "
        "fine-tuning"
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=plan.__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--json", action="store_true", help="print the chosen plan as JSON")
    parser.add_argument(
        "--detect", action="store_true", help="compare this machine with the planned hardware; print how to re-size"
    )
    parser.add_argument(
        "--detected",
        type=Path,
        metavar="FILE",
        help=f"--detect with hardware detected elsewhere (`python -m {__package__}.hardware --out FILE` there)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.detect or args.detected:
        from .plan_resize import detect_main  # which prints format_table too

        try:
            print(detect_main(rest, args.detected))
        except ValueError as error:  # a missing file or config: say which, without a traceback
            print(f"{__package__}.plan: error: {error}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
        return
    cfg = load_config(rest)
    if args.json:
        chosen = plan_for(cfg)
        print(json.dumps({**asdict(chosen), "total": chosen.total}))
    else:
        print(format_table(cfg))
