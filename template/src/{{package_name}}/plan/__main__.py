"""`python -m <package>.plan`: the per-rank plan of a config (report.py's table, or --json), or with
--detect this machine against the planned hardware and how to re-size the repo for it (resize.py).
The command line is the one place that holds whole Configs: it hands each function the sub-configs
it reads."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .. import hardware
from ..config import EXIT_USAGE, Config, load_config
from . import host_plan_for, plan_for
from .check import degree_fix
from .report import format_table
from .resize import detect_inputs, detect_report, live_hardware, resize, shortfall, with_answers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="The per-rank memory and communication plan of a config.", add_help=False
    )
    parser.add_argument("--json", action="store_true", help="print the chosen plan as JSON")
    parser.add_argument(
        "--detect", action="store_true", help="compare this machine with the planned hardware; print how to re-size"
    )
    parser.add_argument(
        "--detected",
        type=Path,
        metavar="FILE",
        help=f"--detect with hardware detected elsewhere (`python -m {hardware.__name__} --out FILE` there)",
    )
    args, rest = parser.parse_known_args(argv)

    def planned(cfg: Config) -> dict:
        """The sub-configs the planner reads."""
        return dict(model=cfg.model, train=cfg.train, parallel=cfg.parallel, hardware=cfg.hardware,
                    finetune=cfg.finetune, checkpoint=cfg.checkpoint)  # fmt: skip

    if args.detect or args.detected:
        try:
            shown, preset_argv, detected, how, notes = detect_inputs(rest, args.detected)
            cfg = load_config(shown)
            preset = load_config(preset_argv) if preset_argv else cfg  # the config of the repo's model_size
            live = live_hardware(planned=preset.hardware, detected=detected)
        except ValueError as error:  # a missing file or config: say which, without a traceback
            print(f"{__package__}: error: {error}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
        answers = resize(**planned(preset), dist=preset.dist, live=live)
        table, note = "", []
        if answers:  # the config on this machine after the update, and what still does not fit the preset
            after = with_answers(train=cfg.train, parallel=cfg.parallel, hardware=cfg.hardware, live=live,
                                 answers=answers)  # fmt: skip
            table = f"The {cfg.model.preset} config on this machine, after the update:\n\n"
            table += format_table(**{**planned(cfg), **after})
            final = with_answers(train=preset.train, parallel=preset.parallel, hardware=preset.hardware,
                                 live=live, answers=answers)  # fmt: skip
            note = shortfall(**{**planned(preset), **final})
        report = detect_report(planned=preset.hardware, live=live, answers=answers, detected=detected, how=how,
                               table=table, note=note)  # fmt: skip
        print("\n".join([report, *(f"note: {n}" for n in notes)]))
        return
    try:
        cfg = load_config(rest)
    except ValueError as error:  # a config that cannot be built: one line, as the trainer refuses it
        print(f"{__package__}: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    hw, degree = cfg.hardware, cfg.parallel.tensor_parallel
    if hw.gpus_per_node % degree:
        why = f"parallel.tensor_parallel={degree} does not divide the planned hardware.gpus_per_node={hw.gpus_per_node}"
        fix = degree_fix(**{k: v for k, v in planned(cfg).items() if k != "checkpoint"}, memory_gb=hw.gpu_memory_gb)
        print(f"{__package__}: error: {why}: {fix}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    if args.json:
        chosen = plan_for(**{k: v for k, v in planned(cfg).items() if k != "checkpoint"})
        host = host_plan_for(**planned(cfg), m=chosen)
        print(json.dumps({**asdict(chosen), "total": chosen.total, "node": {**asdict(host), "total": host.total}}))
    else:
        print(format_table(**planned(cfg)))


if __name__ == "__main__":
    main()
