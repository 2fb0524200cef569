"""Context extension at question time: a llama-family seq_len past the preset's context (up to 8 x it) raises
max_seq_len and scales the rotary frequencies by the rope_scaling answer (hooks/extension.jinja), asked only then;
models without rope scaling, and the debug presets, keep the preset's context as the bound. The planner's side (the
long-context goals, both planners) is in test_planner.py."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml
from conftest import TEMPLATE, answers_of, render
from terminal import columns


def preset_config(root, preset: str) -> dict:
    return tomllib.loads((root / "configs" / f"{preset}.toml").read_text())


def test_within_the_context_nothing_is_asked_or_changed(tmp_path):
    root = render(tmp_path / "p", {"model_size": "8b"})
    assert "rope_scaling" not in answers_of(root)
    model = preset_config(root, "8b")["model"]
    assert model["max_seq_len"] == 131072 and model["rope_scaling"]["rope_type"] == "llama3"
    assert "## Context extension" not in (root / "PLAN.md").read_text()


@pytest.mark.parametrize(("model_type", "rule"), [("hf_causal_lm", "linear"), ("custom", "yarn")])
def test_past_the_context_the_answer_scales_the_rotary_table(tmp_path, model_type, rule):
    answers = {"model_type": model_type, "model_size": "1b", "seq_len": 262144, "rope_scaling": rule}
    root = render(tmp_path / "p", answers)
    assert answers_of(root)["rope_scaling"] == rule
    model = preset_config(root, "1b")["model"]
    scaling = {"rope_type": rule, "factor": 2.0}
    if rule == "yarn":
        scaling |= {"original_max_position_embeddings": 131072, "beta_fast": 32.0, "beta_slow": 1.0}
    assert model["max_seq_len"] == 262144 and model["rope_scaling"] == scaling
    assert f"## Context extension: 131072 to 262144 tokens, {rule}" in (root / "PLAN.md").read_text()


@pytest.mark.parametrize(
    ("answers", "refusal"),
    [
        ({"model_size": "8b", "seq_len": 1048577}, "1 to 1048576 (8 x max_seq_len 131072)"),
        ({"model_type": "qwen3_moe", "model_size": "30b-a3b", "seq_len": 40961},
         "1 to 40960 (qwen3_moe: rope unscaled)"),
        ({"model_size": "debug", "seq_len": 65}, "1 to 64 (the preset's max_seq_len)"),
    ],
)  # fmt: skip
def test_past_the_longest_a_sequence_is_refused_with_the_bound(tmp_path, answers, refusal):
    with pytest.raises(ValueError, match=re.escape(f"question 'seq_len': {refusal}") + "$"):
        render(tmp_path / "p", answers)
    assert len(f"Validation error for question 'seq_len': {refusal}") < 80  # the questionnaire's terminal


def test_the_question_fits_an_80_column_terminal():
    question = yaml.safe_load((TEMPLATE / "copier.yml").read_text())["rope_scaling"]
    lines = ["🎤 " + line for line in question["help"].splitlines()] + [f"   {label}" for label in question["choices"]]
    assert all(columns(line) < 80 for line in lines), [line for line in lines if columns(line) >= 80]
