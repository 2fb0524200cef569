"""Run the generated repos' own tests on CPU ranks: smoke test, FSDP2 rules, plan, checkpoints, crashes.

Each render's tests are chosen by marker (the generated pyproject.toml lists them), never by file or test name:
a test here carries `generated_suite(render, marker expression)`. A render's suite runs once, in the background
from the session's start, as the union of the selections it is in (tests/generated_suites.py: one pytest process,
whose imports, fixtures and reference runs are paid once); the plugin in tests/plugin records each test's outcome
and markers, and each selection passes when none of its tests failed and the tests that matter ran: it names a
few (by the end of their id) that must be among those that passed. So a test added to a generated file runs
without a change here, and one that stops running is noticed.
"""

from __future__ import annotations

import pytest
import yaml
from answers import (
    COMPILED,
    CONTEXT_PARALLEL,
    FAULTS,
    FLOAT8,
    FULL,
    GENERATE,
    HF_CONFIG,
    HOST_MEMORY,
    LORA,
    MOE,
    ONCE,
    PRETRAINED,
    SFT,
    SMOKE,
    STRATEGIES,
    TENSOR_PARALLEL,
    TRANSFORMERS_TENSOR_PARALLEL,
)

generated_suite = pytest.mark.generated_suite  # (render, marker expression): see tests/generated_suites.py
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
OWN = ["faults", "strategies", "tensor_parallel", "context_parallel", "float8", "sft", "lora", "pretrained", "compiled",
       "host_memory", "generate", "hf_config", "moe"]  # fmt: skip


def test_smoke_renders_cover_every_choice_that_runs_on_cpu(rendered):
    answers = [yaml.safe_load((rendered[name] / ".copier-answers.yml").read_text()) for name in SMOKE]
    for question, choices in RUN_ON_CPU.items():
        assert {a[question] for a in answers} == choices, question


def fast_tier(name: str) -> str:
    """A SMOKE render's fast tier (what `pytest` runs), with the compiled run in the COMPILED renders and the
    host-memory measurement in the HOST_MEMORY renders; the tests marked `once` in the ONCE render only."""
    extra = [mark for mark, names in (("compiled", COMPILED), ("host_memory", HOST_MEMORY)) if name in names]
    marks = " or ".join(["not full", *extra])
    return marks if name == ONCE else f"({marks}) and not once"


def full_tier(name: str) -> str:
    """A FULL render's full tier but the selections other renders run (OWN); the tests marked `once` in the
    ONCE render only."""
    return f"full and not ({' or '.join(OWN if name == ONCE else [*OWN, 'once'])})"


SMOKE_TESTS = [
    "test_smoke.py::test_loss_is_finite_and_falls",
    "test_smoke.py::test_world_size_one_matches_two",
    "test_smoke.py::test_resume_reproduces_the_continuous_run",
    "test_fsdp_rules.py::test_train_py_structure",
    "test_fsdp_rules.py::test_initial_weights_identical_at_any_world_size",
    "test_fsdp_rules.py::test_grad_norm_is_the_global_norm_on_the_device",
    "test_fsdp_rules.py::test_one_rank_with_nothing_to_shard_trains_the_model_as_it_is",
    "test_fsdp_rules.py::test_a_nonfinite_step_is_skipped_on_the_device_and_refused_at_the_log_interval",
    "test_plan.py::test_sharded_state_bytes_match_the_plan",
    "test_plan.py::test_activation_bytes_per_block_match_what_the_model_declares",
    "test_wrong_inputs.py::test_a_checkpoint_of_another_model_is_refused_naming_both_and_the_fix_works",
    "test_wrong_inputs.py::test_a_misspelt_flags_box_names_a_help_command_and_a_flag_that_work",
    "test_torch_compat.py::test_no_private_torch_name_is_reached_at_import_time",
    "test_torch_compat.py::test_a_torch_without_private_names_imports_this_repo_and_trains",
    "test_paths.py::test_every_path_module_and_flag_named_exists",
    "test_activation_offload.py::test_parked_inputs_give_the_losses_and_gradients_of_kept_ones_bit_for_bit[full]",
    "test_activation_offload.py::test_the_host_holds_the_parked_inputs_and_the_device_the_rest_as_planned[full]",
]


@pytest.mark.parametrize("name", [pytest.param(name, marks=generated_suite(name, fast_tier(name))) for name in SMOKE])
def test_generated_smoke_rules_and_plan(rendered, suites, name):
    must = [*SMOKE_TESTS]
    if name in COMPILED:
        must.append("test_smoke.py::test_compiled_run_trains_and_resumes")
    if name in HOST_MEMORY:
        must.append("test_plan.py::test_host_plan_matches_resident_memory")
    model_type = yaml.safe_load((rendered[name] / ".copier-answers.yml").read_text())["model_type"]
    if model_type in ("llama", "hf_causal_lm"):  # greedy generation against transformers' generate
        must.append("test_generate.py::test_greedy_llama_with_llama31_rope_scaling_picks_transformers_tokens")
        # context extension: yarn against transformers' tables and export, and trained at twice the context
        must.append("test_rope_scaling.py::test_a_yarn_export_is_transformers_model_and_reads_back")
        must.append("test_rope_scaling.py::test_twice_the_context_trains_to_the_same_losses_at_one_rank_and_two")
    if model_type == "hf_causal_lm":  # model.hf_config: one description of the model, fp32 whatever the file says
        must.append("test_hf_config.py::test_a_model_that_disagrees_with_hf_config_is_refused_and_the_fix_agrees")
    suites[name].check(fast_tier(name), *must)


FULL_TESTS = [
    "test_checkpoint.py::test_checkpoint_reshards_to_one_and_four_ranks",
    "test_checkpoint.py::test_one_rank_checkpoint_moves_to_two_ranks_and_back",
    "test_checkpoint.py::test_resume_names_what_it_skips_and_a_save_heals_the_damage",
    "test_errors.py::test_bad_input_is_reported_once_and_nothing_is_written",
    "test_uneven.py::test_min_stops_every_rank_at_the_shortest",
    "test_activation_offload.py::test_with_parked_inputs_the_run_trains_to_the_same_losses_bit_for_bit[ws4-full]",
]
ONCE_TESTS = [
    "test_fsdp_rules.py::test_entry_point_reports_the_failing_rank",
    "test_fsdp_rules.py::test_a_ddp_job_ends_its_process_group",
    "test_checkpoint.py::test_zero_checkpoint_moves_across_world_sizes_and_modes",
    "test_data.py::test_a_token_file_run_resumes_exactly_on_one_rank_with_workers",
    "test_model_contract.py::test_a_new_decoder_starts_from_transformers_trains_resumes_and_exports",
    "test_source_contract.py::test_two_ranks_train_and_validate_on_the_new_source",
    "test_source_contract.py::test_the_trainer_averages_over_the_targets_the_source_scores",
]


@pytest.mark.parametrize("name", [pytest.param(name, marks=generated_suite(name, full_tier(name))) for name in FULL])
def test_generated_checkpoints_and_errors(suites, name):
    suites[name].check(full_tier(name), *FULL_TESTS, *(ONCE_TESTS if name == ONCE else []))


# The selections of the full tier that one render each runs (answers.py says which): the marker expression, the
# renders, and the tests that must be among those that passed.
SELECTIONS = {
    "crash_recovery": ("faults", FAULTS, ["test_faults.py::test_killed_jobs_resume_bit_identically"]),
    "strategies_golden_losses": (
        "strategies",
        STRATEGIES,
        ["test_strategies.py::test_strategy_matches_the_golden_losses"],
    ),
    "float8": (
        "float8",
        FLOAT8,
        [
            "test_float8.py::test_float8_trains_under_fsdp_and_resumes_exactly",
            "test_float8.py::test_a_float8_checkpoint_continues_in_bf16_with_close_losses",
        ],
    ),
    "sft": (
        "sft",
        SFT,
        [
            "test_sft.py::test_unscored_targets_contribute_exactly_zero_gradient",
            "test_sft.py::test_two_ranks_train_to_the_losses_of_one_process",
            "test_sft.py::test_prepare_packs_the_chats_and_scores_only_the_replies",
        ],
    ),
    "lora": (
        "lora",
        LORA,
        [
            "test_lora.py::test_resuming_with_the_other_finetune_method_is_refused_before_the_process_group",
            "test_lora.py::test_activation_bytes_per_block_match_the_plan",
        ],
    ),
    "pretrained": (
        "pretrained",
        PRETRAINED,
        [
            "test_pretrained.py::test_read_through_init_from_at_world_size_2_it_computes_transformers_logits",
            "test_pretrained.py::test_the_export_loads_back_in_transformers_with_the_same_logits",
        ],
    ),
    "tensor_parallel": (
        "tensor_parallel",
        TENSOR_PARALLEL,
        [
            "test_tensor_parallel.py::test_2x2_trains_to_the_golden_losses",
            "test_tensor_parallel.py::test_2x2_checkpoint_reshards_to_2x2_and_data_parallel_4",
            "test_tensor_parallel.py::test_a_group_larger_than_the_node_is_refused_at_launch",
        ],
    ),
    "context_parallel": (
        "context_parallel",
        CONTEXT_PARALLEL,
        [
            "test_context_parallel.py::test_context_parallel_trains_to_one_ranks_losses_and_gradient_norms",
            "test_context_parallel.py::test_with_a_loss_mask_context_parallel_trains_and_validates_to_one_ranks_losses",
            "test_context_parallel.py::test_lora_adapters_train_alike_with_context_parallelism",
            "test_context_parallel.py::test_a_cp2_checkpoint_loads_and_resumes_on_one_rank_and_at_cp2_x_fsdp2",
            "test_context_parallel.py::test_the_export_of_a_cp2_run_loads_in_transformers_with_the_same_logits",
            "test_context_parallel.py::test_a_group_larger_than_the_node_is_refused_at_launch",
        ],
    ),
    # What the built-in model's run already shows for every model (marked `once`) runs in TENSOR_PARALLEL only.
    "transformers_tensor_parallel": (
        "tensor_parallel and not once",
        TRANSFORMERS_TENSOR_PARALLEL,
        [
            "test_tensor_parallel.py::test_2x2_trains_to_the_golden_losses",
            "test_tensor_parallel.py::test_2x2_export_loads_in_transformers_with_the_same_logits",
        ],
    ),
    "text_generation": (
        "generate",
        GENERATE,
        [
            "test_generate.py::test_a_checkpoint_saved_at_world_size_2_generates_what_its_export_does",
            "test_generate.py::test_bad_input_is_one_line_and_exit_code_2",
        ],
    ),
    "hf_config_one_description": (
        "hf_config",
        HF_CONFIG,
        [
            "test_hf_config.py::test_a_bf16_config_json_trains_fp32_and_validates_to_transformers_loss",
            "test_hf_config.py::test_the_tensor_parallel_export_equals_the_fsdp_export",
        ],
    ),
    # The fast tier of a render whose debug model is the mixture of experts, and its `moe` tier: expert
    # parallelism against one rank, its checkpoints, transformers' weights and the plan's MoE terms.
    "mixture_of_experts": (
        "(not full or moe) and not once",
        MOE,
        [
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
        ],
    ),
}


@pytest.mark.parametrize(
    ("selection", "name"),
    [
        pytest.param(selection, name, marks=generated_suite(name, marks))
        for selection, (marks, names, _) in SELECTIONS.items()
        for name in names
    ],
)
def test_generated_selection(suites, selection, name):
    marks, _, must_pass = SELECTIONS[selection]
    selected = suites[name].check(marks, *must_pass)
    if selection == "strategies_golden_losses":  # every strategy applies to the debug model
        assert all(o["outcome"] == "passed" for o in selected.values()), selected
