"""Run each generated repo's own test suite (smoke test and FSDP2 rules) on CPU ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from answers import MATRIX, SMOKE


def test_smoke_subset_covers_the_matrix_choices():
    # The subset must still exercise every parallelism choice that changes what runs on CPU.
    for question in ("sharding", "mixed_precision", "activation_checkpointing", "cpu_offload", "compile",
                     "init_method", "checkpoint_format"):  # fmt: skip
        seen = set()
        for name in SMOKE:
            seen.add(MATRIX[name].get(question, "<default>"))
        assert len(seen) > 1, question


@pytest.mark.parametrize("name", SMOKE)
def test_generated_suite_passes(rendered, name):
    root = rendered[name]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=root, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
