"""bench/data.py --quick: every row of the data-path benchmark is measured and printed (the figures are the
README's, from a full run; speed is never asserted here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROWS = [
    "time per window read, 100 M-token file / 10 M",
    "time per window read, 1 B-token file / 10 M",
    "one rank's read of a step, world size 8 / world size 1",
    "data prepare tokens/s / datasets.map(batched=True), 2 processes",
    "data prepare peak resident memory, 4x the corpus / 1x",
    "data wait share of the step, ViT debug model on an image folder at world size 2: prefetch on / off",
]


def test_quick_data_benchmark_prints_every_row():
    bench = Path(__file__).resolve().parents[1] / "bench" / "data.py"
    done = subprocess.run([sys.executable, str(bench), "--quick"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    table = {cells[0]: cells[1:] for line in done.stdout.splitlines() if line.startswith("| ")
             for cells in [[c.strip() for c in line.strip("|").split("|")]]}  # fmt: skip
    for row in ROWS:
        ratio, raw, _goal = table[row]
        assert re.fullmatch(r"\d+\.\d+", ratio), (row, ratio)  # a measured, finite ratio
        assert re.search(r"\d", raw), (row, raw)
    assert set(table) - {"measurement", "---"} == set(ROWS)
