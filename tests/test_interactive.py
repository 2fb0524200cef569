"""The questions as a person answers them: `copier copy` in a pseudo-terminal of 80 x 24.

Copier checks a pick-from-list answer only through per-choice validators, shown as disabled
choices; a question-level validator guards typed answers only. These sessions check that every
refusal the template makes with `-d` holds here too, that no session crashes, that the
short path asks what it promises, and that nothing any of them shows is cut at the terminal's edge.
"""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import TEMPLATE, answers_of, misfit, render
from terminal import COLUMNS, DOWN, UP, CopierSession, columns, fits, shown_lines

# The questions a user who accepts the plan answers, per kind of machine.
SHORT_PATH_CUDA = ["project_name", "accelerator", "gpu_arch", "gpus_per_node", "num_nodes", "gpu_memory_gb",
                   "host_memory_gb", "intra_node_link", "customize", "model_type", "model_size", "data_source",
                   "checkpoint_interval", "launchers"]  # fmt: skip
SHORT_PATH_CPU = ["project_name", "accelerator", "gpus_per_node", "num_nodes", "host_memory_gb", "customize",
                  "model_type", "model_size", "data_source", "launchers"]  # fmt: skip
NUMBERS = re.compile(r"\d+\.\d GiB")


@pytest.fixture
def session(tmp_path):
    sessions = []

    def start(name: str = "proj") -> CopierSession:
        sessions.append(CopierSession(tmp_path / name, tmp_path / "home"))
        return sessions[-1]

    yield start
    for s in sessions:
        s.child.close(force=True)
    # Every line each session showed, the message after copying included, fits the 80-column terminal.
    assert not [line for s in sessions for line in s.too_wide()], [line for s in sessions for line in s.too_wide()]


def run_to(s: CopierSession, question: str, answers: dict) -> None:
    """Answer questions until `question` is on screen: `answers[name](session)` or Enter."""
    while (prompt := s.next_prompt()).name != question:
        answers.get(prompt.name, CopierSession.accept)(s)


def assert_valid_plan(tmp_path, root) -> dict:
    """What the session wrote passes every check `copier copy --data` makes, and renders the same."""
    answers = answers_of(root)
    again = render(tmp_path / "check", answers)
    assert answers_of(again) == answers
    assert misfit(answers) == ""
    return answers


def test_short_path_on_gpus_asks_fourteen_questions_and_records_every_answer(session, tmp_path):
    s = session()
    assert s.finish() == 0
    assert s.asked == SHORT_PATH_CUDA
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    # The questions the gate skipped are still answered (the planner's), so `copier update` keeps them.
    defaults = answers_of(render(tmp_path / "defaults"))
    assert answers == defaults
    for skipped in ["package_name", "mixed_precision", "sharding", "activation_checkpointing", "cpu_offload",
                    "compile", "backend", "init_method", "checkpoint_export", "logging", "ci_workflow"]:  # fmt: skip
        assert skipped in answers, skipped
    assert (answers["sharding"], answers["activation_checkpointing"]) == ("shard_grad_op", "selective")


def test_short_path_on_cpu_speaks_of_processes_and_trains_the_debug_model(session, tmp_path):
    s = session()
    shown = {}

    def on_cpu(s):
        s.pick("CPU only")

    def note(s):
        shown[s.current.name] = s.current
        s.accept()

    run_to(s, "accelerator", {})
    on_cpu(s)
    code = s.finish(lambda prompt: note(s))
    assert code == 0
    assert s.asked == SHORT_PATH_CPU
    assert "CPU processes" in shown["gpus_per_node"].text and "GPU" not in shown["gpus_per_node"].text
    model_size = shown["model_size"]
    assert model_size.choices[model_size.pointer].label.startswith("debug")
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert (answers["model_size"], answers["backend"], answers["mixed_precision"]) == ("debug", "gloo", "fp32")


def test_volta_then_fp32_then_enter_completes_with_a_plan_that_fits(session, tmp_path):
    s = session()
    run_to(s, "gpu_arch", {})
    s.pick("Volta")
    run_to(s, "customize", {})
    s.confirm(True)
    run_to(s, "mixed_precision", {})
    bf16 = s.current.choice("bf16")
    assert bf16.disabled.endswith("bf16 needs sm 8.0+ (Ampere), volta is 7.0"), bf16
    assert s.current.choices[s.current.pointer].label.startswith("fp16")  # the default is allowed
    s.pick("fp32")
    assert s.finish() == 0
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert answers["mixed_precision"] == "fp32" and answers["gpu_arch"] == "volta"
    # 8b in fp32 at 8192 tokens per GPU on 8 x 32 GiB: with its logits whole it needed 29.8 GiB even with offload
    # and full recomputation, so pairs of GPUs split each sequence (tensor parallelism); with the loss in chunks
    # (train.loss_chunk) it needs 28.4 GiB without offload, and FSDP alone fits.
    got = [answers[k] for k in ("model_size", "seq_len", "tensor_parallel", "activation_checkpointing", "cpu_offload")]
    assert got == ["8b", 8192, 1, "full", False], got


def pick_disabled(s: CopierSession, label: str) -> str:
    """The reason `label` cannot be picked at the current prompt, on screen to its end (and assert that
    it cannot be picked)."""
    choice = s.current.choice(label)
    assert choice.disabled, f"{s.current.name}: {label} is selectable"
    assert choice.whole, f"{s.current.name}: {label}'s reason is cut at the terminal's edge: {choice.disabled}"
    with pytest.raises(AssertionError):
        s.pick(label)
    return choice.disabled


def test_impossible_picks_on_one_gpu_node_are_disabled_or_refused(session, tmp_path):
    """8 x H100 80 GiB, the 8b preset, every detail adjusted by hand."""
    s = session()
    refusals = {}
    run_to(s, "customize", {})
    s.confirm(True)
    run_to(s, "package_name", {})
    refusals["package_name=launch"] = s.type("launch")
    assert s.type("mymodel") == ""
    run_to(s, "seq_len", {})
    refusals["seq_len=2000000"] = s.type("2000000")  # past 8 x Llama 3.1's 131,072-token context
    assert s.type("8192") == ""
    s.next_prompt()
    assert s.current.name == "tensor_parallel"  # asked after the sequence its default is planned for
    refusals["tensor_parallel=3"] = s.type("3")  # a typed number: copier asks again
    assert s.type("1") == ""
    s.next_prompt()
    assert s.current.name == "context_parallel"
    refusals["context_parallel=3"] = s.type("3")  # a group must divide the node
    assert s.type("1") == ""
    s.next_prompt()
    refusals["micro_batch_size=64"] = s.type("64")
    assert s.type("2") == ""  # two sequences: without recomputation nothing fits (with the loss in chunks one does)
    run_to(s, "activation_checkpointing", {})
    refusals["activation_checkpointing=none"] = pick_disabled(s, "none")
    s.pick("full")
    s.next_prompt()
    assert s.current.name == "sharding"
    refusals["sharding=hybrid"] = pick_disabled(s, "hybrid")
    s.pick("no_shard")  # DDP fits with full recomputation only if AdamW's state is split
    run_to(s, "cpu_offload", {})
    refusals["cpu_offload=yes with no_shard"] = pick_disabled(s, "yes")
    s.pick("no")
    run_to(s, "zero_optimizer", {})
    refusals["zero_optimizer=no"] = pick_disabled(s, "no")
    assert s.current.choices[s.current.pointer].label == "yes"
    s.pick("yes")
    run_to(s, "backend", {})
    refusals["backend=xccl"] = pick_disabled(s, "xccl")
    assert not s.current.choice("mpi").disabled  # DDP needs no reduce_scatter
    s.accept()
    assert s.finish() == 0

    # A typed answer's refusal is one line under the prompt: the fix first, and on screen to its end (the forms
    # that fit after copier's "Validation error for question '<name>': ").
    assert refusals["package_name=launch"].endswith("'package_name': try launch_train")
    assert refusals["tensor_parallel=3"].endswith("'tensor_parallel': answer 1, 2, 4 or 8 (8 GPUs)")
    assert refusals["seq_len=2000000"].endswith("'seq_len': 1 to 1048576 (8 x max_seq_len 131072)")
    assert refusals["context_parallel=3"].endswith("'context_parallel': answer 1, 2, 4 or 8 (8 GPUs)")
    assert re.search(r"'micro_batch_size': 1 fits: needs \d+\.\d GiB/GPU$", refusals["micro_batch_size=64"])
    assert refusals["activation_checkpointing=none"].startswith("choose selective: at best")
    assert NUMBERS.search(refusals["activation_checkpointing=none"])
    assert "hybrid needs several nodes" in refusals["sharding=hybrid"]
    assert "needs a sharded mode" in refusals["cpu_offload=yes with no_shard"]
    assert "choose zero_optimizer=true" in refusals["zero_optimizer=no"]
    assert NUMBERS.search(refusals["zero_optimizer=no"])
    assert "cannot run collectives on cuda" in refusals["backend=xccl"]
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert (answers["sharding"], answers["zero_optimizer"], answers["package_name"]) == ("no_shard", True, "mymodel")


def test_a_whole_131072_token_context_takes_context_parallelism(session, tmp_path):
    """8 x 12 GiB GPUs, 8b at Llama 3.1's whole context: the sequence is accepted, the planner's degree is the
    node's 8 GPUs (with CPU offload and the blocks' inputs parked in host memory), smaller ones are refused with
    their figure, and DDP is disabled for it. (On 80 GiB GPUs, with the loss in chunks, each GPU holds a whole
    sequence.)"""
    s = session()
    run_to(s, "gpu_memory_gb", {})
    assert s.type("12") == ""
    run_to(s, "customize", {})
    s.confirm(True)
    run_to(s, "seq_len", {})
    assert s.type("131072") == ""
    s.next_prompt()
    assert s.current.name == "tensor_parallel" and s.current.text.split()[-1] == "1"  # planned for 131072 tokens
    s.accept()
    s.next_prompt()
    assert s.current.name == "context_parallel"
    too_few = s.type("2")
    assert too_few.endswith("answer 8: needs 21.7 GiB/GPU"), too_few
    beyond = s.type("16")
    assert beyond.endswith("'context_parallel': answer 8 (8 GPUs)"), beyond
    assert s.type("8") == ""
    run_to(s, "sharding", {})
    ddp = pick_disabled(s, "no_shard")
    assert ddp.endswith("choose full: DDP is not combined with context_parallel=8"), ddp
    s.accept()
    assert s.finish() == 0
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert (answers["seq_len"], answers["context_parallel"], answers["micro_batch_size"]) == (131072, 8, 1)
    config = (tmp_path / "proj" / "configs" / "8b.toml").read_text()
    assert "context_parallel = 8" in config and "activation_offload = true" in config


def test_impossible_picks_when_memory_is_short(session, tmp_path):
    """One 24 GiB GPU: 70b fits only with short sequences, 8b only with offload; 8 GiB fits no 70b."""
    s = session()
    run_to(s, "gpus_per_node", {})
    assert s.type("1") == ""
    run_to(s, "gpu_memory_gb", {})
    assert s.type("8") == ""
    run_to(s, "customize", {})
    s.confirm(True)
    run_to(s, "model_size", {})
    too_big = pick_disabled(s, "70b")
    assert re.fullmatch(r"needs \d+\.\d GiB/GPU at 128 tokens, 7\.2 usable", too_big), too_big
    assert s.current.choices[s.current.pointer].label.startswith("8b")  # the default still fits
    s.pick("8b")
    run_to(s, "activation_checkpointing", {})
    s.pick("full")
    run_to(s, "sharding", {})
    for mode in ["shard_grad_op", "no_shard"]:  # one GPU: only full sharding with offload fits
        reason = pick_disabled(s, mode)
        assert reason.startswith("choose sharding=full: at best") and reason.endswith("7.2 usable"), reason
    s.pick("full")
    s.next_prompt()
    no_offload = pick_disabled(s, "no")
    assert "cpu_offload=true" in no_offload and NUMBERS.search(no_offload), no_offload
    s.pick("yes")
    assert s.finish() == 0
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert (answers["gpu_memory_gb"], answers["cpu_offload"], answers["sharding"]) == (8, True, "full")


def test_picks_the_node_cannot_hold_are_disabled(session, tmp_path):
    """One 24 GiB GPU in a node of 200 GiB: 70b needs offload to 1 TiB of RAM, 8b fits only with synchronous
    checkpoints (async staging would add a copy of its 90 GiB of parameters and moments)."""
    s = session()
    run_to(s, "gpus_per_node", {})
    assert s.type("1") == ""
    run_to(s, "gpu_memory_gb", {})
    assert s.type("24") == ""
    s.next_prompt()
    assert s.current.name == "host_memory_gb"
    assert "between 1 and 65536" in s.type("0")
    assert s.type("200") == ""
    run_to(s, "customize", {})
    s.confirm(True)
    run_to(s, "model_size", {})
    too_big = pick_disabled(s, "70b")
    assert too_big == "needs 1073.5 GiB RAM per node, 180.0 usable", too_big
    s.pick("8b")
    run_to(s, "cpu_offload", {})
    assert "cpu_offload=true" in pick_disabled(s, "no")  # the GPU needs it, and the node holds it
    s.pick("yes")
    run_to(s, "checkpoint_format", {})
    staging = pick_disabled(s, "dcp_async")
    assert staging == "choose dcp: 227.6 GiB RAM (async staging 89.7), 180.0 usable", staging
    s.pick("dcp")
    assert s.finish() == 0
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert (answers["host_memory_gb"], answers["cpu_offload"], answers["checkpoint_format"]) == (200, True, "dcp")


def test_impossible_picks_on_cpu_ranks_and_for_an_image_model(session, tmp_path):
    s = session()
    run_to(s, "accelerator", {})
    s.pick("CPU only")
    run_to(s, "num_nodes", {})
    assert s.type("2") == ""
    run_to(s, "customize", {})
    s.confirm(True)
    s.next_prompt()
    empty = s.type("")  # a refusal's example is never empty
    assert empty.endswith("'package_name': try fsdp_train: not an identifier"), empty
    assert s.type("vision") == ""
    run_to(s, "model_type", {})
    s.pick("A Vision Transformer")
    s.next_prompt()
    assert s.current.name == "finetune"
    assert pick_disabled(s, "lora") == "choose full: LoRA adapts only llama and hf_causal_lm"
    s.accept()
    s.next_prompt()
    assert not s.current.choice("vit-debug").disabled
    assert pick_disabled(s, "8b") == "for vit: choose a vit-* preset"
    s.pick("vit-debug")
    run_to(s, "data_source", {})
    assert pick_disabled(s, "memmap") == "for vit: image_folder or synthetic"
    assert pick_disabled(s, "sft") == "for vit: image_folder or synthetic"
    s.accept()
    run_to(s, "backend", {})
    for backend in ["nccl", "xccl"]:
        assert pick_disabled(s, backend).startswith(f"choose gloo: {backend} cannot run collectives on cpu")
    assert pick_disabled(s, "mpi") == "choose gloo or sharding=no_shard: mpi lacks reduce_scatter on cpu"
    s.accept()
    run_to(s, "checkpoint_export", {})
    assert pick_disabled(s, "hf") == "choose safetensors: transformers has no vit class"
    s.accept()
    run_to(s, "launchers", {})
    assert [c.label[2:10] for c in s.current.choices[:2]] == ["torchrun", "SLURM ba"]  # ticked: the default
    assert "Pick at least one: 2 nodes need a launcher that starts every node" in " ".join(s.current.text.split())
    s.child.send(" " + DOWN + " ")  # untick both: two nodes and no way to start them
    # Refused: Enter keeps the question (questionary shows a checkbox's validation message blank,
    # hence the help above) and nothing is written.
    s.type("")
    assert s.child.isalive() and "Copying from template" not in s.screen
    assert not (tmp_path / "proj").exists()
    s.child.send(" " + UP + " \r")
    assert s.finish() == 0
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert (answers["model_size"], answers["launchers"]) == ("vit-debug", ["torchrun", "slurm"])


def test_a_mixture_of_experts_on_a_gpu_node_plans_its_expert_parallelism(session, tmp_path):
    """8 x H100 80 GiB, Qwen3-30B-A3B: LoRA, dense presets, degrees beyond the node, DDP and float8 are refused,
    and the planner's degree (all 8 GPUs split the experts) is the default."""
    s = session()
    run_to(s, "customize", {})
    s.confirm(True)
    run_to(s, "model_type", {})
    s.pick("Built-in mixture")
    s.next_prompt()
    assert pick_disabled(s, "lora") == "choose full: its experts are not nn.Linear layers"
    s.accept()
    s.next_prompt()
    assert pick_disabled(s, "8b") == "for qwen3_moe: moe-debug, 30b-a3b or 235b-a22b"
    assert s.current.choices[s.current.pointer].label.startswith("30b-a3b")  # the default fits
    s.accept()
    s.next_prompt()
    assert s.current.name == "seq_len"
    s.accept()
    s.next_prompt()
    assert s.current.name == "expert_parallel"  # no tensor_parallel: its experts split by expert parallelism
    assert s.type("3").endswith("'expert_parallel': answer 1, 2, 4 or 8 (8 GPUs)")
    assert s.type("8") == ""  # the planner's degree, the default
    run_to(s, "sharding", {})
    assert pick_disabled(s, "no_shard").endswith("not with expert_parallel=8")
    s.accept()
    run_to(s, "float8", {})
    assert pick_disabled(s, "rowwise") == "choose none: its experts are not nn.Linear"
    s.accept()
    assert s.finish() == 0
    answers = assert_valid_plan(tmp_path, tmp_path / "proj")
    assert (answers["model_size"], answers["expert_parallel"], answers["sharding"]) == ("30b-a3b", 8, "shard_grad_op")
    assert "expert_parallel = 8" in (tmp_path / "proj" / "configs" / "30b-a3b.toml").read_text()


def test_no_pick_from_list_question_relies_on_a_question_level_validator():
    """Copier runs a question's `validator` on typed answers only; a select or yes/no question must
    refuse through its choices' validators, or a terminal user could pick what `-d` refuses."""
    questions = yaml.safe_load((TEMPLATE / "copier.yml").read_text())
    for name, spec in questions.items():
        if name.startswith("_") or "validator" not in spec:
            continue
        typed = "choices" not in spec and spec.get("type") in ("int", "str", "path", "float")
        assert typed or spec.get("multiselect"), f"{name}: its validator would never run in a terminal"


# Answer sets whose questions, between them, show every question and disable or refuse the most; the
# other questions take their defaults. Refused answers (a typed tensor_parallel=3, ...) show their
# refusal, and the default is taken instead.
SCREENS = {
    "cpu_vit_two_nodes": {"accelerator": "cpu", "num_nodes": 2, "model_type": "vit", "package_name": "launch",
                          "launchers": [], "checkpoint_keep_last": 0},
    "one_small_volta": {"gpu_arch": "volta", "gpus_per_node": 1, "gpu_memory_gb": 8,
                        "project_name": "my project, with a name longer than any line of a terminal"},
    "ddp_8b_on_h100s": {"activation_checkpointing": "full", "sharding": "no_shard", "tensor_parallel": 3,
                        "seq_len": 2000000, "context_parallel": 3, "micro_batch_size": 64},
    # A refusal does not grow with the number typed.
    "long_context_8b": {"seq_len": 131072, "context_parallel": 2, "sharding": "no_shard", "micro_batch_size": 100000},
    "extended_8b": {"seq_len": 1048576, "rope_scaling": "linear"},  # past the context: the rope_scaling question
    "hf_lora_fp16": {"model_type": "hf_causal_lm", "finetune": "lora", "mixed_precision": "fp16", "seq_len": 131071,
                     "tensor_parallel": 2},
    "moe_on_turing": {"model_type": "qwen3_moe", "gpu_arch": "turing", "gpus_per_node": 2, "gpu_memory_gb": 16,
                      "expert_parallel": 3, "compile": True, "finetune": "lora"},
}  # fmt: skip


def test_every_line_the_questions_show_fits_the_terminal(tmp_path):
    """Copier's prompts cut what does not fit: every help line, choice, disabled reason and refusal
    fits COLUMNS (the last column free), so a user sees each figure and each fix. The questions come
    from copier.yml, so a new one is held to this too (and must be shown by one of SCREENS)."""
    too_wide, asked = [], set()
    for name, wanted in SCREENS.items():
        for question, line in shown_lines(wanted, tmp_path / name):
            asked.add(question)
            if not fits(line):
                too_wide.append(f"{name} {question} ({columns(line)} of {COLUMNS}): {line}")
    assert not too_wide, "\n".join(too_wide)
    questions = {k for k in yaml.safe_load((TEMPLATE / "copier.yml").read_text()) if not k.startswith("_")}
    assert asked == questions, f"shown by no answer set: {sorted(questions - asked)}"
