"""`python -m <package>.plan`: the per-rank plan of a config (report.py's table, or --json), or with
--detect this machine against the planned hardware and how to re-size the repo for it (resize.py)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .. import hardware
from ..config import EXIT_USAGE, load_config
from . import host_plan_for, plan_for
from .report import format_table
from .resize import detect_main


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
    if args.detect or args.detected:
        try:
            print(detect_main(rest, args.detected))  # which prints report.format_table too
        except ValueError as error:  # a missing file or config: say which, without a traceback
            print(f"{__package__}: error: {error}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
        return
    cfg = load_config(rest)
    hw, degree = cfg.hardware, cfg.parallel.tensor_parallel
    if hw.gpus_per_node % degree:
        why = f"parallel.tensor_parallel={degree} does not divide the planned hardware.gpus_per_node={hw.gpus_per_node}"
        print(f"{__package__}: error: {why}: choose a divisor, or plan other hardware", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    if args.json:
        chosen = plan_for(cfg)
        host = host_plan_for(cfg, chosen)
        print(json.dumps({**asdict(chosen), "total": chosen.total, "node": {**asdict(host), "total": host.total}}))
    else:
        print(format_table(cfg))


if __name__ == "__main__":
    main()
