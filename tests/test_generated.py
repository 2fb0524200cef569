"""Run the generated repos' own tests on CPU ranks: smoke test, FSDP2 rules, plan, checkpoints, crashes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from answers import (
    COMPILED,
    FAULTS,
    FLOAT8,
    FULL,
    HOST_MEMORY,
    LORA,
    PRETRAINED,
    SFT,
    SMOKE,
    STRATEGIES,
    TENSOR_PARALLEL,
    TRANSFORMERS_TENSOR_PARALLEL,
)

RUN_ON_CPU = {
    "sharding": {"full", "shard_grad_op", "hybrid", "no_shard"},
    "mixed_precision": {"bf16", "fp16", "fp32"},
    "activation_checkpointing": {"none", "selective", "full"},
    "cpu_offload": {True, False},
    "compile": {True, False},
    "init_method": {"env", "tcp", "file"},
    "checkpoint_format": {"dcp", "dcp_async"},
}


def test_smoke_renders_cover_every_choice_that_runs_on_cpu(rendered):
    answers = [yaml.safe_load((rendered[name] / ".copier-answers.yml").read_text()) for name in SMOKE]
    for question, choices in RUN_ON_CPU.items():
        assert {a[question] for a in answers} == choices, question


SMOKE_FILES = ["tests/test_smoke.py", "tests/test_fsdp_rules.py", "tests/test_plan.py"]
# Generated test files that a selection of their own runs, in one render: the FULL renders skip them.
OWN_SELECTION = ["tests/test_float8.py", "tests/test_sft.py", "tests/test_lora.py", "tests/test_tensor_parallel.py",
                 "tests/test_pretrained.py"]  # fmt: skip
# What FULL runs in its first render only: subjects that do not change with a render's sharding,
# rendezvous or checkpoint format (data, metrics, hardware detection, a new model), and the ZeRO
# checkpoint and Join tests, which force DDP whatever the render says.
ONCE_FILES = ["tests/test_data.py", "tests/test_observability.py", "tests/test_detect.py",
              "tests/test_model_contract.py"]  # fmt: skip
ONCE_TESTS = "zero_checkpoint_moves or test_join_"


def run_generated(root, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    return proc.stdout


@pytest.mark.parametrize("name", SMOKE)
def test_generated_smoke_rules_and_plan(rendered, name):
    # Both tiers of these files (-m "" lifts the fast-tier default), but the full tier's compiled run only in
    # the COMPILED renders and its host-memory measurement only in the HOST_MEMORY renders.
    tiers = (("full and not host_memory", COMPILED), ("host_memory", HOST_MEMORY))
    skip = " and ".join(f"not ({marks})" for marks, names in tiers if name not in names)
    out = run_generated(rendered[name], "-m", skip, "-rp", *SMOKE_FILES)
    if name in HOST_MEMORY:
        assert "PASSED tests/test_plan.py::test_host_plan_matches_resident_memory" in out, out[-2000:]


@pytest.mark.parametrize("name", FULL)
def test_generated_checkpoints_and_errors(rendered, name):
    skip, once = [*SMOKE_FILES, *OWN_SELECTION], []
    if name != FULL[0]:
        skip, once = [*skip, *ONCE_FILES], ["-k", f"not ({ONCE_TESTS})"]
    run_generated(rendered[name], "-m", "not faults and not strategies", *once, "tests",
                  *(f"--ignore={f}" for f in skip))  # fmt: skip


@pytest.mark.parametrize("name", FAULTS)
def test_generated_crash_recovery(rendered, name):
    out = run_generated(rendered[name], "-m", "faults", "tests/test_faults.py")
    assert "10 passed" in out


@pytest.mark.parametrize("name", STRATEGIES)
def test_generated_strategies_match_the_golden_losses(rendered, name):
    out = run_generated(rendered[name], "-m", "strategies", "tests/test_strategies.py")
    # Nineteen strategies and the prefetch wiring check, none of them skipped.
    assert int(re.search(r"(\d+) passed", out).group(1)) >= 20 and "skipped" not in out, out[-2000:]


def run_every_test_of(root, test_file: str, count: int) -> None:
    """Both tiers of one generated test file: exactly `count` tests pass, none skipped."""
    out = run_generated(root, "-m", "", test_file)
    assert f"{count} passed" in out and "skipped" not in out, out[-2000:]


@pytest.mark.parametrize("name", FLOAT8)
def test_generated_float8_converts_trains_and_checkpoints(rendered, name):
    run_every_test_of(rendered[name], "tests/test_float8.py", 6)


@pytest.mark.parametrize("name", SFT)
def test_generated_sft_masks_packs_and_matches_one_process(rendered, name):
    run_every_test_of(rendered[name], "tests/test_sft.py", 15)


@pytest.mark.parametrize("name", LORA)
def test_generated_lora_trains_only_adapters_and_exports_merged_weights(rendered, name):
    run_every_test_of(rendered[name], "tests/test_lora.py", 26)


@pytest.mark.parametrize("name", PRETRAINED)
def test_generated_pretrained_llama3_weights_compute_transformers_logits(rendered, name):
    run_every_test_of(rendered[name], "tests/test_pretrained.py", 13)


@pytest.mark.parametrize("name", TENSOR_PARALLEL)
def test_generated_tensor_parallel_trains_reshards_and_exports(rendered, name):
    run_every_test_of(rendered[name], "tests/test_tensor_parallel.py", 10)


@pytest.mark.parametrize("name", TRANSFORMERS_TENSOR_PARALLEL)
def test_generated_transformers_tensor_parallel_trains_loads_on_one_rank_and_exports(rendered, name):
    out = run_generated(rendered[name], "-m", "", "tests/test_tensor_parallel.py",
                        "-k", "not (reshards_to or eager_pair or larger_than_the_node)")  # fmt: skip
    assert "8 passed" in out and "skipped" not in out, out[-2000:]
