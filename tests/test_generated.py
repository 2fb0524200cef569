"""Run the generated repos' own tests on CPU ranks: smoke test, FSDP2 rules, plan, checkpoints, crashes.

Each render runs tiers of its own suite chosen by marker (the generated pyproject.toml lists them), never by
file or test name, and passes when nothing failed and the tests that matter ran: each selection names a few
tests (by the end of their name) that must be among those that passed. So a test added to a generated file
runs without a change here, and one that stops running is noticed.
"""

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
    MOE,
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
# The full-tier selections that one render of the matrix runs on its own (answers.py says which).
OWN = ["faults", "strategies", "tensor_parallel", "float8", "sft", "lora", "pretrained", "compiled", "host_memory",
       "moe"]


def test_smoke_renders_cover_every_choice_that_runs_on_cpu(rendered):
    answers = [yaml.safe_load((rendered[name] / ".copier-answers.yml").read_text()) for name in SMOKE]
    for question, choices in RUN_ON_CPU.items():
        assert {a[question] for a in answers} == choices, question


def run_generated(root, marks: str, *must_pass: str) -> str:
    """The render's tests selected by marker expression `marks` (on CPU ranks): none may fail, and every name in
    `must_pass` (the end of a test's id: `test_file.py::test_name`, a parameter list left off) must have passed."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "-m", marks]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    passed = {re.sub(r"\[.*\]$", "", line.split()[1]) for line in out.splitlines() if line.startswith("PASSED ")}
    missing = [name for name in must_pass if not any(test.endswith(name) for test in passed)]
    assert not missing, f"did not pass (skipped, deselected or gone?): {missing}\n{out[-3000:]}"
    return out


SMOKE_TESTS = [
    "test_smoke.py::test_loss_is_finite_and_falls",
    "test_smoke.py::test_world_size_one_matches_two",
    "test_smoke.py::test_resume_reproduces_the_continuous_run",
    "test_fsdp_rules.py::test_train_py_structure",
    "test_fsdp_rules.py::test_initial_weights_identical_at_any_world_size",
    "test_fsdp_rules.py::test_grad_norm_is_the_global_norm_as_a_float",
    "test_plan.py::test_sharded_state_bytes_match_the_plan",
    "test_plan.py::test_activation_bytes_per_block_match_what_the_model_declares",
]


@pytest.mark.parametrize("name", SMOKE)
def test_generated_smoke_rules_and_plan(rendered, name):
    # The fast tier (what `pytest` runs), with the compiled run in the COMPILED renders and the host-memory
    # measurement in the HOST_MEMORY renders.
    extra = [mark for mark, names in (("compiled", COMPILED), ("host_memory", HOST_MEMORY)) if name in names]
    must = [*SMOKE_TESTS]
    if name in COMPILED:
        must.append("test_smoke.py::test_compiled_run_trains_and_resumes")
    if name in HOST_MEMORY:
        must.append("test_plan.py::test_host_plan_matches_resident_memory")
    run_generated(rendered[name], " or ".join(["not full", *extra]), *must)


FULL_TESTS = [
    "test_checkpoint.py::test_checkpoint_reshards_to_one_and_four_ranks",
    "test_checkpoint.py::test_resume_names_what_it_skips_and_a_save_heals_the_damage",
    "test_errors.py::test_bad_input_is_reported_once_and_nothing_is_written",
    "test_eval.py::test_evaluation_leaves_training_as_it_was",
]
ONCE_TESTS = [
    "test_checkpoint.py::test_zero_checkpoint_moves_across_world_sizes_and_modes",
    "test_data.py::test_a_token_file_run_resumes_exactly_on_one_rank_with_workers",
    "test_model_contract.py::test_a_new_decoder_starts_from_transformers_trains_resumes_and_exports",
]


@pytest.mark.parametrize("name", FULL)
def test_generated_checkpoints_and_errors(rendered, name):
    # The full tier but the selections other renders run (OWN); the tests marked `once` in the first render only.
    once = name == FULL[0]
    run_generated(
        rendered[name],
        f"full and not ({' or '.join(OWN if once else [*OWN, 'once'])})",
        *FULL_TESTS,
        *(ONCE_TESTS if once else []),
    )


@pytest.mark.parametrize("name", FAULTS)
def test_generated_crash_recovery(rendered, name):
    run_generated(rendered[name], "faults", "test_faults.py::test_killed_job_resumes_bit_identically")


@pytest.mark.parametrize("name", STRATEGIES)
def test_generated_strategies_match_the_golden_losses(rendered, name):
    out = run_generated(rendered[name], "strategies", "test_strategies.py::test_strategy_matches_the_golden_losses")
    assert " skipped" not in out, out[-2000:]  # every strategy applies to the debug model


@pytest.mark.parametrize("name", FLOAT8)
def test_generated_float8_converts_trains_and_checkpoints(rendered, name):
    run_generated(
        rendered[name],
        "float8",
        "test_float8.py::test_float8_trains_under_fsdp_and_resumes_exactly",
        "test_float8.py::test_a_float8_checkpoint_continues_in_bf16_with_close_losses",
    )


@pytest.mark.parametrize("name", SFT)
def test_generated_sft_masks_packs_and_matches_one_process(rendered, name):
    run_generated(
        rendered[name],
        "sft",
        "test_sft.py::test_unscored_targets_contribute_exactly_zero_gradient",
        "test_sft.py::test_two_ranks_train_to_the_losses_of_one_process",
        "test_sft.py::test_prepare_packs_the_chats_and_scores_only_the_replies",
    )


@pytest.mark.parametrize("name", LORA)
def test_generated_lora_trains_only_adapters_and_exports_merged_weights(rendered, name):
    run_generated(
        rendered[name],
        "lora",
        "test_lora.py::test_resuming_with_the_other_finetune_method_is_refused_before_the_process_group",
        "test_lora.py::test_activation_bytes_per_block_match_the_plan",
    )


@pytest.mark.parametrize("name", PRETRAINED)
def test_generated_pretrained_llama3_weights_compute_transformers_logits(rendered, name):
    run_generated(
        rendered[name],
        "pretrained",
        "test_pretrained.py::test_read_through_init_from_at_world_size_2_it_computes_transformers_logits",
        "test_pretrained.py::test_the_export_loads_back_in_transformers_with_the_same_logits",
    )


@pytest.mark.parametrize("name", TENSOR_PARALLEL)
def test_generated_tensor_parallel_trains_reshards_and_exports(rendered, name):
    run_generated(
        rendered[name],
        "tensor_parallel",
        "test_tensor_parallel.py::test_2x2_trains_to_the_golden_losses",
        "test_tensor_parallel.py::test_2x2_checkpoint_reshards_to_2x2_and_data_parallel_4",
        "test_tensor_parallel.py::test_a_group_larger_than_the_node_is_refused_at_launch",
    )


@pytest.mark.parametrize("name", TRANSFORMERS_TENSOR_PARALLEL)
def test_generated_transformers_tensor_parallel_trains_loads_on_one_rank_and_exports(rendered, name):
    # What the built-in model's run already shows for every model (marked `once`) runs in TENSOR_PARALLEL only.
    run_generated(
        rendered[name],
        "tensor_parallel and not once",
        "test_tensor_parallel.py::test_2x2_trains_to_the_golden_losses",
        "test_tensor_parallel.py::test_2x2_export_loads_in_transformers_with_the_same_logits",
    )


@pytest.mark.parametrize("name", MOE)
def test_generated_mixture_of_experts_trains_with_expert_parallelism(rendered, name):
    # The fast tier of a render whose debug model is the mixture of experts, and its `moe` tier: the launches of
    # expert parallelism against one rank, its checkpoints, transformers' weights and the plan's MoE terms.
    run_generated(
        rendered[name],
        "not full or moe",
        *SMOKE_TESTS,
        "test_moe_model.py::test_logits_and_aux_loss_match_transformers",
        "test_expert_parallel.py::test_the_all_to_all_dispatcher_computes_what_one_rank_does",
        "test_expert_parallel.py::test_expert_parallel_runs_train_to_the_losses_of_one_rank",
        "test_expert_parallel.py::test_a_checkpoint_saved_at_ep2_loads_bit_for_bit_at_any_degree",
        "test_expert_parallel.py::test_resuming_at_ep2_is_exact_and_at_ep1_continues_the_run",
        "test_expert_parallel.py::test_the_plan_counts_what_experts_hold_and_send",
        "test_expert_parallel.py::test_init_from_transformers_files_computes_their_logits_at_every_position",
        "test_expert_parallel.py::test_the_export_under_expert_parallelism_loads_back_in_transformers",
        "test_expert_parallel.py::test_impossible_settings_are_refused_with_the_fix",
        "test_expert_parallel.py::test_degrees_the_world_cannot_hold_are_refused_at_launch",
        "test_expert_parallel.py::test_a_launch_beyond_the_world_is_refused_once_with_exit_code_2",
    )
