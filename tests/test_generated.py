"""Run the generated repos' own tests on CPU ranks: smoke test, FSDP2 rules, plan, checkpoints, crashes.

Each render's tests are chosen by marker (the generated pyproject.toml lists them), never by file or test name.
A render's suite runs once, as the union of the selections it is in (one pytest process: its imports, fixtures
and reference runs are paid once); the plugin in tests/plugin records each test's outcome and markers, and each
selection passes when none of its tests failed and the tests that matter ran: it names a few (by the end of their
id) that must be among those that passed. So a test added to a generated file runs without a change here, and
one that stops running is noticed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    PRETRAINED,
    SFT,
    SMOKE,
    STRATEGIES,
    TENSOR_PARALLEL,
    TRANSFORMERS_TENSOR_PARALLEL,
)

PLUGIN = Path(__file__).parent / "plugin"
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


def matches(marks: str, markers: list[str]) -> bool:
    """Whether a test carrying `markers` is selected by the marker expression `marks` (pytest -m's rule: names
    joined by and, or, not and parentheses, each true when the test carries that marker)."""
    return eval(marks, {"__builtins__": {}}, defaultdict(bool, dict.fromkeys(markers, True)))


@dataclass
class Suite:
    """One run of a render's generated suite: each test's outcome and markers (tests/plugin), and its output."""

    tests: dict[str, dict]
    output: str

    def check(self, marks: str, *must_pass: str) -> dict[str, dict]:
        """The tests of selection `marks`: none may have failed, and every name in `must_pass` (the end of a test's
        id: `test_file.py::test_name`, a parameter list left off) must be among those that passed."""
        selected = {test: o for test, o in self.tests.items() if matches(marks, o["markers"])}
        failed = [f"{test}\n{o['report']}" for test, o in selected.items() if o["outcome"] == "failed"]
        assert not failed, "\n\n".join(failed)[-12000:]
        passed = {test.split("[")[0] for test, o in selected.items() if o["outcome"] == "passed"}
        missing = [name for name in must_pass if not any(test.endswith(name) for test in passed)]
        assert not missing, f"did not pass (skipped, deselected or gone?): {missing}\n{self.output[-3000:]}"
        return selected


def run_generated(root: Path, marks: str, outcomes: Path) -> Suite:
    """The render's tests selected by marker expression `marks`, run once on CPU ranks."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(PLUGIN)]),
           "TEMPLATE_OUTCOMES": str(outcomes)}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "template_outcomes", "-m", marks]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=2400)
    # 0: every test passed; 1: some failed, which the selections they belong to report. Else it did not run.
    assert proc.returncode in (0, 1) and outcomes.is_file(), proc.stdout[-6000:] + proc.stderr[-3000:]
    return Suite(json.loads(outcomes.read_text()), proc.stdout)


def fast_tier(name: str) -> str:
    """A SMOKE render's fast tier (what `pytest` runs), with the compiled run in the COMPILED renders and the
    host-memory measurement in the HOST_MEMORY renders; the tests marked `once` in the first render only."""
    extra = [mark for mark, names in (("compiled", COMPILED), ("host_memory", HOST_MEMORY)) if name in names]
    marks = " or ".join(["not full", *extra])
    return marks if name == SMOKE[0] else f"({marks}) and not once"


def full_tier(name: str) -> str:
    """A FULL render's full tier but the selections other renders run (OWN); the tests marked `once` in the
    first render only."""
    return f"full and not ({' or '.join(OWN if name == FULL[0] else [*OWN, 'once'])})"


def selected_marks(item: pytest.Item) -> tuple[str, str] | None:
    """The render and marker expression of one of this file's selection tests; None for any other test."""
    params = getattr(item, "callspec", None) and item.callspec.params
    if item.originalname == "test_generated_smoke_rules_and_plan":
        return params["name"], fast_tier(params["name"])
    if item.originalname == "test_generated_checkpoints_and_errors":
        return params["name"], full_tier(params["name"])
    if item.originalname == "test_generated_selection":
        return params["name"], SELECTIONS[params["selection"]][0]
    return None


@pytest.fixture(scope="session")
def suite(request, rendered, tmp_path_factory) -> Callable[[str], Suite]:
    """suite(name): render `name`'s generated suite, run once with the union of the selections of it that this
    session's tests check (all of them in a whole run; a CI job of the template's workflow checks some)."""
    wanted: dict[str, list[str]] = defaultdict(list)
    for name, marks in filter(None, map(selected_marks, request.session.items)):
        wanted[name].append(f"({marks})")
    runs: dict[str, Suite] = {}

    def run(name: str) -> Suite:
        if name not in runs:
            outcomes = tmp_path_factory.mktemp(name) / "outcomes.json"
            runs[name] = run_generated(rendered[name], " or ".join(wanted[name]), outcomes)
        return runs[name]

    return run


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
def test_generated_smoke_rules_and_plan(rendered, suite, name):
    must = [*SMOKE_TESTS]
    if name in COMPILED:
        must.append("test_smoke.py::test_compiled_run_trains_and_resumes")
    if name in HOST_MEMORY:
        must.append("test_plan.py::test_host_plan_matches_resident_memory")
    model_type = yaml.safe_load((rendered[name] / ".copier-answers.yml").read_text())["model_type"]
    if model_type in ("llama", "hf_causal_lm"):  # greedy generation against transformers' generate
        must.append("test_generate.py::test_greedy_llama_with_llama31_rope_scaling_picks_transformers_tokens")
    if model_type == "hf_causal_lm":  # model.hf_config: one description of the model, fp32 whatever the file says
        must.append("test_hf_config.py::test_a_model_that_disagrees_with_hf_config_is_refused_and_the_fix_agrees")
    suite(name).check(fast_tier(name), *must)


FULL_TESTS = [
    "test_checkpoint.py::test_checkpoint_reshards_to_one_and_four_ranks",
    "test_checkpoint.py::test_resume_names_what_it_skips_and_a_save_heals_the_damage",
    "test_errors.py::test_bad_input_is_reported_once_and_nothing_is_written",
    "test_uneven.py::test_min_stops_every_rank_at_the_shortest",
]
ONCE_TESTS = [
    "test_fsdp_rules.py::test_entry_point_reports_the_failing_rank",
    "test_checkpoint.py::test_zero_checkpoint_moves_across_world_sizes_and_modes",
    "test_data.py::test_a_token_file_run_resumes_exactly_on_one_rank_with_workers",
    "test_model_contract.py::test_a_new_decoder_starts_from_transformers_trains_resumes_and_exports",
]


@pytest.mark.parametrize("name", FULL)
def test_generated_checkpoints_and_errors(suite, name):
    suite(name).check(full_tier(name), *FULL_TESTS, *(ONCE_TESTS if name == FULL[0] else []))


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
    ("selection", "name"), [(selection, name) for selection, (_, names, _) in SELECTIONS.items() for name in names]
)
def test_generated_selection(suite, selection, name):
    marks, _, must_pass = SELECTIONS[selection]
    selected = suite(name).check(marks, *must_pass)
    if selection == "strategies_golden_losses":  # every strategy applies to the debug model
        assert all(o["outcome"] == "passed" for o in selected.values()), selected
