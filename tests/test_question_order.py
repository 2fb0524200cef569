"""The questions come in the order their defaults need: each after every answer its default is planned from
(the sequence length before the degrees planned for it), so that what a repo records, and what its PLAN.md
says about it, agree."""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import JINJA, TEMPLATE, answers_of, misfit, render
from test_refusals import suggestions

QUESTIONS = [k for k in yaml.safe_load((TEMPLATE / "copier.yml").read_text()) if not k.startswith("_")]
ANSWERS = JINJA.get_template("hooks/answers.jinja").module
HARDWARE = {"accelerator": "cuda", "gpu_arch": "hopper", "gpus_per_node": 8, "num_nodes": 1, "gpu_memory_gb": 80,
            "host_memory_gb": 2048, "intra_node_link": "nvlink", "inter_node_link": "infiniband"}  # fmt: skip


def test_a_question_reads_only_the_answers_asked_before_it():
    # copier.yml: what a question's default, help, `when` and validators name of the other questions.
    spec = yaml.safe_load((TEMPLATE / "copier.yml").read_text())
    late = []
    for i, name in enumerate(QUESTIONS):
        text = yaml.safe_dump({k: v for k, v in spec[name].items() if k in ("default", "help", "when", "choices")})
        jinja = " ".join(re.findall(r"\{\{.*?\}\}|\{%.*?%\}", text, re.S))
        later = set(re.findall(r"\b\w+\b", jinja)) & set(QUESTIONS[i + 1 :])
        late += [f"{name} reads {q}" for q in sorted(later)]
    assert not late, late
    # hooks/answers.jinja's ORDER is copier.yml's order of the planned questions.
    assert ANSWERS.ORDER == [q for q in QUESTIONS if q in ANSWERS.ORDER]
    assert QUESTIONS.index("seq_len") < min(
        QUESTIONS.index(q) for q in ("tensor_parallel", "expert_parallel", "context_parallel", "micro_batch_size")
    )


@pytest.mark.parametrize("model", [{"model_type": "llama", "model_size": "70b"},
                                   {"model_type": "qwen3_moe", "model_size": "30b-a3b"}])  # fmt: skip
def test_each_default_and_rule_reads_only_earlier_answers(model):
    # answers.jinja's default(q, a) and check(q, a) for answers that hold only the questions before q: an answer
    # they read from later would be undefined (StrictUndefined raises). Each default is then an allowed answer.
    a = dict(HARDWARE)
    for q in ANSWERS.ORDER:
        a[q] = model[q] if q in model else yaml.safe_load(ANSWERS.default(q, a))
        assert ANSWERS.check(q, a) == "", (q, a[q])
    assert a["seq_len"] == 8192 if model["model_type"] == "llama" else 4096


def plan_sections(root) -> dict[str, str]:
    text = (root / "PLAN.md").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.S | re.M)}


def bold_row(section: str) -> list[str]:
    (row,) = [line for line in section.splitlines() if line.startswith("| **")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def assert_plan_agrees(root) -> dict:
    """PLAN.md's chosen degrees, its tables and its memory line agree with each other and with the answers the repo
    recorded (all the planner's: nothing was given but the hardware, the model and the sequence)."""
    a = {"tensor_parallel": 1, "context_parallel": 1, "expert_parallel": 1} | answers_of(root)  # those it asked
    assert misfit(a) == "", a
    sections = plan_sections(root)
    text = (root / "PLAN.md").read_text()
    assert "your answer" not in text, "PLAN.md calls a default the user's answer"
    plan = f"{a['activation_checkpointing']}, {a['sharding']}, {'yes' if a['cpu_offload'] else 'no'}"
    if "## Activation offload: yes" in text:  # not a question: the planner's, where nothing fits without it
        plan += ", activation offload"
    # The memory table and the line under it: the configured plan, the planner's own pick, within the budget.
    budget = 0.9 * a["gpu_memory_gb"]
    peak = float(re.search(r"The configured plan \(bold\) needs \*\*([\d.]+) GiB\*\* per GPU", text).group(1))
    assert peak <= budget and "which is what this repo uses" in text, (peak, budget)
    memory = next(s for title, s in sections.items() if "|" in s and "| peak (GiB) |" in s and "sharding |" in s)
    assert bold_row(memory)[-1] == "yes"
    # Tensor parallelism: the planner's degree is the one recorded, and its row is the recorded plan.
    tp = sections[f"Tensor parallelism: {a['tensor_parallel']}"]
    if "| degree |" in tp:
        assert f"strictly better: **{a['tensor_parallel']}**" in tp
        row, head = bold_row(tp), tp[tp.index("| degree |") :].split("\n")[0]
        assert row[0] == f"**{a['tensor_parallel']}**"
        if "context-parallel" in head:
            assert row.pop(1) == str(a["context_parallel"])
        assert (row[1], row[2]) == (str(a["micro_batch_size"]), plan), (row, a)
    # Context parallelism: the planner's degree is the one recorded; one sequence fits it, at the peak above when a
    # micro-batch is one sequence.
    cp = sections[f"Context parallelism: {a['context_parallel']}"]
    if "| degree |" in cp:
        assert f"The planner's degree: **{a['context_parallel']}**" in cp
        row = bold_row(cp)
        assert row[2] != "nothing fits" and int(row[1]) == a["seq_len"] // a["context_parallel"]
        if a["micro_batch_size"] == 1:
            assert float(row[4]) == peak and row[2] == plan, (row, peak, plan)
    # Expert parallelism (a mixture of experts): the planner's degree is the one recorded.
    if a["model_type"] == "qwen3_moe":
        ep = sections[f"Mixture of experts: expert parallelism {a['expert_parallel']}"]
        assert f"seconds per token: **{a['expert_parallel']}**" in ep
        assert bold_row(ep)[2] == plan and int(bold_row(ep)[1]) == a["micro_batch_size"]
    # The summary at the top: the same degrees, the same peak, and the step its degree's table row estimates.
    summary = sections["Summary"]
    degrees = f"tensor parallel {a['tensor_parallel']}, context parallel {a['context_parallel']}"
    assert degrees in summary and f"**{peak:.1f} GiB** planned at the peak" in summary, summary
    table = ep if a["model_type"] == "qwen3_moe" else tp
    if "| degree |" in table:
        head = [c.strip() for c in table[table.index("| degree |") :].split("\n")[0].strip("|").split("|")]
        assert f"about {bold_row(table)[head.index('step s')]} s for " in summary, (bold_row(table), summary)
    return a


# Sizes x lengths on one and two nodes of 8 x H100: from a preset's length to its whole context (8b: and 8 times it,
# the context extended). Only PLAN.md and the answers are written (a render of them takes about 2 s).
MATRIX = [
    (model, size, seq, nodes)
    for model, size, lengths in [("llama", "1b", [4096, 131072]), ("llama", "8b", [8192, 32768, 131072, 1048576]),
                                 ("llama", "70b", [8192, 65536, 131072]), ("qwen3_moe", "30b-a3b", [4096, 40960])]
    for seq in lengths
    for nodes in (1, 2)
]  # fmt: skip


@pytest.mark.parametrize(("model", "size", "seq", "nodes"), MATRIX, ids=lambda v: str(v))
def test_plan_md_agrees_with_itself_and_the_answers(tmp_path, model, size, seq, nodes):
    given = {"model_type": model, "model_size": size, "seq_len": seq, "num_nodes": nodes}
    only_the_plan = {"exclude": ["*", "!PLAN.md", "!.copier-answers.yml"]}
    try:
        root = render(tmp_path / "p", given, **only_the_plan)
    except ValueError as refusal:
        # A length no split of these GPUs takes: refused at seq_len with a length that renders.
        (offer,) = suggestions(str(refusal))
        assert "'seq_len'" in str(refusal) and offer["seq_len"] < seq, str(refusal)
        root = render(tmp_path / "fixed", {**given, **offer}, **only_the_plan)
        given = {**given, **offer}
    a = assert_plan_agrees(root)
    assert {k: a[k] for k in given} == given
