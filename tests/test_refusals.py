"""Answers that cannot work are refused before anything is written, naming the question."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import yaml
from conftest import TEMPLATE, answers_of, misfit, render
from terminal import COLUMNS, columns, fits, refusal_line

REFUSED = {
    "nccl_on_cpu": (
        {"accelerator": "cpu", "backend": "nccl"},
        "backend",
        "choose gloo: nccl cannot run collectives on cpu",
    ),
    "xccl_on_cuda": ({"backend": "xccl"}, "backend", "cannot run collectives on cuda"),
    "gloo_on_xpu": ({"accelerator": "xpu", "backend": "gloo"}, "backend", "cannot run collectives on xpu"),
    "mpi_cannot_shard": (
        {"model_size": "1b", "backend": "mpi", "sharding": "full"},
        "backend",
        "choose nccl or sharding=no_shard: mpi lacks reduce_scatter",
    ),
    # DDP does not fit 8b with the activation checkpointing chosen before it: sharding=no_shard is no fix.
    "mpi_where_ddp_does_not_fit": (
        {"backend": "mpi", "sharding": "full"},
        "backend",
        "choose nccl: mpi does not support reduce_scatter on cuda",
    ),
    "bf16_on_volta": (
        {"gpu_arch": "volta", "mixed_precision": "bf16"},
        "mixed_precision",
        "bf16 needs sm 8.0+ (Ampere), volta is 7.0",
    ),
    "bf16_on_turing": ({"gpu_arch": "turing", "mixed_precision": "bf16"}, "mixed_precision", "turing is 7.5"),
    "hybrid_on_one_node": ({"sharding": "hybrid"}, "sharding", "hybrid needs several nodes"),
    "package_with_dash": ({"package_name": "my-model"}, "package_name", "try my_model: not an identifier"),
    "package_with_digit": ({"package_name": "1st_try"}, "package_name", "try p1st_try: not an identifier"),
    "package_shadows_torch": ({"package_name": "torch"}, "package_name", "try torch_train: shadows a module"),
    "package_shadows_a_test_helper": ({"package_name": "launch"}, "package_name", "try launch_train"),
    "package_name_empty": ({"package_name": ""}, "package_name", "try fsdp_train"),
    "package_is_a_keyword": ({"package_name": "lambda"}, "package_name", "try lambda_train: a keyword"),
    "project_name_with_space": ({"project_name": "my project"}, "project_name", "try my-project"),
    "70b_on_one_small_gpu": (
        {"gpus_per_node": 1, "gpu_memory_gb": 8, "model_size": "70b"},
        "model_size",
        "needs 12.2 GiB/GPU at 128 tokens, 7.2 usable",
    ),
    "70b_sequence_too_long": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "host_memory_gb": 2048, "model_size": "70b", "seq_len": 16384},
        "seq_len",
        "13568 fit: this needs 22.9 GiB/GPU",
    ),
    # Offload is the only plan for 70b on one 24 GiB GPU, and its 16 bytes per parameter need 1 TiB of RAM.
    "70b_host_memory": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "host_memory_gb": 256, "model_size": "70b"},
        "model_size",
        "needs 1073.5 GiB RAM per node, 230.4 usable",
    ),
    "offload_host_memory": (
        {"host_memory_gb": 48, "model_size": "1b", "sharding": "full", "cpu_offload": True},
        "cpu_offload",
        "choose cpu_offload=false: 55.6 GiB RAM (offload 18.4), 43.2 usable",
    ),
    # Llama 3.1 8B's whole 131,072-token context on each H100 (no context parallelism) fits the GPUs only with the
    # blocks' inputs parked in host memory: 30 GiB a GPU, more than a 256 GiB node holds for 8.
    "activation_offload_host_memory": (
        {
            "model_size": "8b",
            "seq_len": 131072,
            "context_parallel": 1,
            "activation_checkpointing": "full",
            "sharding": "full",
            "cpu_offload": False,
            "host_memory_gb": 256,
        },
        "cpu_offload",
        "choose cpu_offload=true: 279.2 GiB RAM (parked 240.0), 230.4 usable",
    ),
    "async_checkpoint_host_memory": (
        {
            "gpus_per_node": 1,
            "gpu_memory_gb": 24,
            "host_memory_gb": 200,
            "model_size": "8b",
            "checkpoint_format": "dcp_async",
        },
        "checkpoint_format",
        "choose dcp: 227.6 GiB RAM (async staging 89.7), 180.0 usable",
    ),
    "cpu_ranks_host_memory": (
        {"accelerator": "cpu", "host_memory_gb": 16, "model_size": "1b"},
        "model_size",
        "GiB RAM per node, 14.4 usable",
    ),
    "micro_batch_too_large": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "8b", "micro_batch_size": 64},
        "micro_batch_size",
        "1 fits: needs",
    ),
    "8b_ddp_does_not_fit": (
        {"model_size": "8b", "sharding": "no_shard", "activation_checkpointing": "selective"},
        "sharding",
        "choose shard_grad_op: at best 43.7 GiB per GPU, 72.0 usable",
    ),
    "ac_none_cannot_fit": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "8b", "activation_checkpointing": "none"},
        "activation_checkpointing",
        "choose full: at best",
    ),
    "8b_ddp_fits_only_with_zero": (
        {"model_size": "8b", "sharding": "no_shard", "activation_checkpointing": "full", "zero_optimizer": False},
        "zero_optimizer",
        "choose zero_optimizer=true (58.6 GiB): this needs 110.9 GiB/GPU",
    ),
    "offload_needed": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "8b", "cpu_offload": False},
        "cpu_offload",
        "cpu_offload=true (10.2 GiB)",
    ),
    "offload_with_ddp": (
        {"model_size": "debug", "sharding": "no_shard", "cpu_offload": True},
        "cpu_offload",
        "needs a sharded mode",
    ),
    "tensor_parallel_across_nodes": (
        {"model_size": "8b", "tensor_parallel": 3},
        "tensor_parallel",
        "answer 1, 2, 4 or 8 (8 GPUs)",
    ),
    "tensor_parallel_splits_heads": (
        {"model_size": "125m", "tensor_parallel": 8},
        "tensor_parallel",
        "answer 1, 2 or 4 (n_heads=12)",
    ),
    "tensor_parallel_splits_transformers_heads": (
        {"model_type": "hf_causal_lm", "model_size": "125m", "tensor_parallel": 8},
        "tensor_parallel",
        "answer 1, 2 or 4 (n_heads=12)",
    ),
    "tensor_parallel_without_a_plan": (
        {"model_type": "vit", "model_size": "vit-base", "tensor_parallel": 2},
        "tensor_parallel",
        "answer 1 (no plan for vit)",
    ),
    "tensor_parallel_zero": ({"model_size": "8b", "tensor_parallel": 0}, "tensor_parallel", "must be at least 1"),
    "tensor_parallel_with_ddp": (
        {"model_size": "8b", "tensor_parallel": 2, "sharding": "no_shard"},
        "sharding",
        "choose full or shard_grad_op: not with tensor_parallel=2",
    ),
    # The sequence is asked first; a degree must split it (sequence parallelism cuts it tensor_parallel ways).
    "tensor_parallel_splits_the_sequence": (
        {"model_size": "8b", "tensor_parallel": 8, "seq_len": 8188},
        "tensor_parallel",
        "answer 1, 2 or 4 (seq_len)",
    ),
    # On 8 GiB GPUs 131,072 tokens need every sequence split over more than 8 / tensor_parallel GPUs of the node: with
    # tensor parallelism 8 no context-parallel degree is left to do that.
    "tensor_parallel_leaves_no_plan": (
        {"model_size": "8b", "seq_len": 131072, "tensor_parallel": 8, "gpu_memory_gb": 8},
        "tensor_parallel",
        "'tensor_parallel': answer 4",
    ),
    # On 40 GiB GPUs no plan takes a whole 131,071-token sequence, and no split takes an odd length: the nearest
    # lengths the one that would fit takes (tensor parallelism 2: multiples of 2).
    "sequence_no_split_takes": (
        {"seq_len": 131071, "gpu_memory_gb": 40},
        "seq_len",
        "a multiple of 2: 131070 or 131072",
    ),
    # A refusal does not grow with the number typed.
    "micro_batch_far_too_large": ({"model_size": "8b", "micro_batch_size": 100000}, "micro_batch_size", ": 1 fits"),
    # Context parallelism: a sequence no degree fits, and degrees that cannot split it.
    "sequence_too_long_even_split": (
        {"gpu_memory_gb": 6, "seq_len": 131072},
        "seq_len",
        "100608 fit: this needs 6.5 GiB/GPU",
    ),
    "context_parallel_beyond_node": (
        {"seq_len": 131072, "context_parallel": 16},
        "context_parallel",
        "answer 1, 2, 4 or 8 (8 GPUs)",
    ),
    "context_parallel_splits_heads": (
        {"model_size": "125m", "seq_len": 2048, "context_parallel": 8},
        "context_parallel",
        "answer 1, 2 or 4 (12 heads)",
    ),
    "context_parallel_splits_the_sequence": (
        {"seq_len": 8200, "context_parallel": 8},
        "context_parallel",
        "answer 1, 2 or 4 (seq_len)",
    ),
    "context_parallel_too_small": (
        {"gpu_memory_gb": 12, "seq_len": 131072, "context_parallel": 4},
        "context_parallel",
        "answer 8: needs 14.1 GiB/GPU",
    ),
    "context_parallel_without_a_plan": (
        {"model_type": "custom", "context_parallel": 2},
        "context_parallel",
        "answer 1 (no plan for custom)",
    ),
    "context_parallel_zero": ({"context_parallel": 0}, "context_parallel", "must be at least 1"),
    "context_parallel_with_ddp": (
        {"seq_len": 131072, "context_parallel": 8, "sharding": "no_shard"},
        "sharding",
        "choose full or shard_grad_op: not with context_parallel=8",
    ),
    "no_gpus": ({"gpus_per_node": 0}, "gpus_per_node", "between 1 and 128"),
    "zero_gpu_memory": ({"gpu_memory_gb": 0}, "gpu_memory_gb", "between 1 and 1024"),
    "zero_host_memory": ({"host_memory_gb": 0}, "host_memory_gb", "between 1 and 65536"),
    "sequence_too_long": ({"model_size": "debug", "seq_len": 128}, "seq_len", "max_seq_len"),
    "unknown_size": ({"model_size": "13b"}, "model_size", "13b"),
    "chats_for_an_image_model": (
        {"model_type": "vit", "data_source": "sft"},
        "data_source",
        "for vit: image_folder or synthetic",
    ),
    "lora_for_vit": ({"model_type": "vit", "finetune": "lora"}, "finetune", "LoRA adapts only llama and hf_causal_lm"),
    "lora_for_custom": ({"model_type": "custom", "finetune": "lora"}, "finetune", "choose full"),
    "lora_with_float8": (
        {"finetune": "lora", "float8": "tensorwise"},
        "float8",
        "choose none: LoRA adapts those layers",
    ),
    "lora_with_tp": ({"finetune": "lora", "tensor_parallel": 2}, "tensor_parallel", "answer 1 (finetune=lora)"),
    "hf_export_of_a_vit": (
        {"model_type": "vit", "checkpoint_export": "hf"},
        "checkpoint_export",
        "choose safetensors: transformers",
    ),
    "moe_on_six_gpus": (
        {"model_type": "qwen3_moe", "gpus_per_node": 6},
        "model_type",
        "its experts need 2^n GPUs, not 6",
    ),
    "moe_preset_for_llama": ({"model_size": "30b-a3b"}, "model_size", "only for model_type qwen3_moe"),
    "dense_preset_for_moe": (
        {"model_type": "qwen3_moe", "model_size": "8b"},
        "model_size",
        "for qwen3_moe: moe-debug, 30b-a3b or 235b-a22b",
    ),
    "expert_parallel_across_nodes": (
        {"model_type": "qwen3_moe", "num_nodes": 2, "expert_parallel": 16},
        "expert_parallel",
        "answer 1, 2, 4 or 8 (8 GPUs)",
    ),
    "expert_parallel_zero": ({"model_type": "qwen3_moe", "expert_parallel": 0}, "expert_parallel", "at least 1"),
    "expert_parallel_with_ddp": (
        {"model_type": "qwen3_moe", "expert_parallel": 8, "sharding": "no_shard"},
        "sharding",
        "choose full or shard_grad_op: not with expert_parallel=8",
    ),
    "lora_for_moe": (
        {"model_type": "qwen3_moe", "finetune": "lora"},
        "finetune",
        "choose full: its experts are not nn.Linear layers",
    ),
    "float8_for_moe": (
        {"model_type": "qwen3_moe", "float8": "rowwise"},
        "float8",
        "choose none: its experts are not nn.Linear",
    ),
    "compiled_moe_in_fp16": (
        {"model_type": "qwen3_moe", "gpu_arch": "turing", "gpus_per_node": 2, "gpu_memory_gb": 16, "compile": True},
        "compile",
        "choose no: grouped matmuls compile in bf16 only, not fp16",
    ),
    "no_nodes": ({"num_nodes": 0}, "num_nodes", "must be at least 1"),
    "checkpoint_interval_zero": ({"model_size": "1b", "checkpoint_interval": 0}, "checkpoint_interval", "at least 1"),
    "keep_no_checkpoint": ({"checkpoint_keep_last": 0}, "checkpoint_keep_last", "must be at least 1"),
    "two_nodes_no_launcher": ({"num_nodes": 2, "launchers": []}, "launchers", "pick one: 2 nodes need a launcher"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_with_the_question_named_and_nothing_written(tmp_path, case):
    """And the refusal fits an 80-column terminal, as a typed answer's refusal or a disabled choice."""
    answers, question, reason = REFUSED[case]
    dst = tmp_path / "project"
    with pytest.raises(ValueError) as refusal:
        render(dst, answers)
    message = str(refusal.value)
    assert f"'{question}'" in message, message
    assert reason in message, message
    assert not dst.exists()
    if case != "unknown_size":  # not a choice: a terminal never offers it
        line = refusal_line(question, answers[question], message)
        assert fits(line), f"{columns(line)} of {COLUMNS} columns: {line}"


def test_every_question_that_can_refuse_has_a_case_here():
    """Each question with a validator (its own, or one of its choices') is refused above at least once,
    so its refusal is held to the terminal's width; copier.yml says which questions these are."""
    questions = yaml.safe_load((TEMPLATE / "copier.yml").read_text())
    refusing = set()
    for name, spec in questions.items():
        choices = spec.get("choices") if isinstance(spec, dict) else None
        per_choice = isinstance(choices, dict) and any(
            isinstance(c, dict) and "validator" in c for c in choices.values()
        )
        if not name.startswith("_") and ("validator" in spec or per_choice):
            refusing.add(name)
    assert refusing - {question for _, question, _ in REFUSED.values()} == set()


@pytest.mark.parametrize(
    "case",
    ["8b_ddp_does_not_fit", "ac_none_cannot_fit", "offload_needed", "70b_sequence_too_long", "offload_host_memory",
     "activation_offload_host_memory", "async_checkpoint_host_memory", "sequence_too_long_even_split",
     "sequence_no_split_takes", "micro_batch_far_too_large", "tensor_parallel_leaves_no_plan"],
)  # fmt: skip
def test_the_fix_a_memory_refusal_names_is_accepted(tmp_path, case):
    """A refusal starts with its fix (`choose ...`, `N fit`, `a multiple of M: A or B`, `answer ...`); taking each
    answer it offers renders, and the repo records it."""
    answers, question, _ = REFUSED[case]
    with pytest.raises(ValueError) as refusal:
        render(tmp_path / "refused", answers, pretend=True)
    offers = suggestions(str(refusal.value))
    assert offers, str(refusal.value)
    for i, offer in enumerate(offers):
        recorded = answers_of(render(tmp_path / f"accepted{i}", {**answers, **offer}))
        assert {k: recorded[k] for k in offer} == offer and misfit(recorded) == "", (offer, recorded)


def test_70b_on_one_gpu_renders_with_the_host_memory_it_needs(tmp_path):
    """The plan 70b_host_memory refuses, on a node with 2 TiB: CPU offload, the preset's 8,192 tokens with the blocks'
    inputs parked in host memory too, and PLAN.md's host column says why."""
    root = render(tmp_path / "p", {**REFUSED["70b_host_memory"][0], "host_memory_gb": 2048})
    answers = answers_of(root)
    assert (answers["cpu_offload"], answers["sharding"], misfit(answers)) == (True, "full", "")
    plan = (root / "PLAN.md").read_text()
    assert "| peak (GiB) | host per node (GiB) | fits |" in plan
    assert answers["seq_len"] == 8192
    assert "| **full** | yes | 0.0 | 11.9 | 7.2 (+ 9.8 parked) | 19.1 | 1083.2 | yes |" in plan
    assert "| offload | 1051.3 GiB |" in plan and "| **peak** | **1083.2 GiB** |" in plan
    assert "| activation offload | 9.8 GiB |" in plan and "## Activation offload: yes" in plan
    assert "host_memory_gb = 2048" in (root / "configs" / "70b.toml").read_text()


HARDWARE = [
    {"gpus_per_node": gpus, "gpu_memory_gb": memory, "model_type": model}
    for gpus in (1, 8)
    for memory in (8, 24)
    for model in ("llama", "vit", "custom")
] + [
    {"gpu_arch": "volta", "gpus_per_node": 1, "gpu_memory_gb": 16, "mixed_precision": "fp32"},
    {"num_nodes": 2, "inter_node_link": "ethernet", "gpu_memory_gb": 24, "model_type": "hf_causal_lm"},
    {"accelerator": "xpu", "gpus_per_node": 2, "gpu_memory_gb": 16, "model_type": "vit"},
    {"gpus_per_node": 1, "gpu_memory_gb": 24, "finetune": "lora"},
    # Little RAM: 8b would need offload to 120 GiB of host memory, so the default is the largest preset that fits.
    {"gpus_per_node": 1, "gpu_memory_gb": 24, "host_memory_gb": 64, "model_type": "llama"},
    {"accelerator": "cpu", "gpus_per_node": 4, "host_memory_gb": 8, "model_type": "llama"},
    {"gpus_per_node": 2, "gpu_memory_gb": 40, "model_type": "hf_causal_lm", "finetune": "lora"},
    # Ethernet between nodes: the planner splits layers within each node (tensor_parallel > 1), in groups of 8,
    # which fit 8 sequences a micro-batch with the loss in chunks (train.loss_chunk).
    {"num_nodes": 4, "inter_node_link": "ethernet", "gpu_memory_gb": 80, "model_type": "llama"},
    {"num_nodes": 4, "inter_node_link": "ethernet", "gpu_memory_gb": 80, "model_type": "hf_causal_lm"},
    # Llama 3.1's whole context on 8 x 40 GiB: every sequence split over 4 GPUs (context_parallel=4); on 80 GiB
    # each GPU holds a whole one, its loss in chunks, with CPU offload.
    {"gpu_memory_gb": 40, "model_type": "llama", "seq_len": 131072},
    # A mixture of experts: Qwen3-30B-A3B on one node of 8 x 80 GiB (expert parallelism 8, the planner's pick), on
    # two nodes, and on one 80 GiB GPU (the largest MoE preset that fits), and the debug MoE on CPU ranks.
    {"gpu_memory_gb": 80, "model_type": "qwen3_moe"},
    {"num_nodes": 2, "gpu_memory_gb": 80, "model_type": "qwen3_moe"},
    {"gpus_per_node": 1, "gpu_memory_gb": 80, "model_type": "qwen3_moe"},
    {"accelerator": "cpu", "gpus_per_node": 4, "model_type": "qwen3_moe"},
]


@pytest.mark.parametrize("hardware", HARDWARE, ids=lambda h: "-".join(f"{v}" for v in h.values()))
def test_the_planners_defaults_are_always_allowed_and_fit(tmp_path, hardware):
    """What a user gets by pressing Enter: never a refused default (copier would crash on it), always a plan
    that fits, whatever the hardware."""
    answers = answers_of(render(tmp_path / "p", hardware))
    assert misfit(answers) == "", answers
    assert {k: answers[k] for k in hardware} == hardware
    if hardware.get("num_nodes") == 4:
        assert answers["tensor_parallel"] == 8 and answers["sharding"] != "no_shard", answers
    assert answers.get("context_parallel", 1) == (4 if hardware.get("seq_len") == 131072 else 1), answers
    if hardware.get("model_type") == "qwen3_moe" and hardware.get("gpus_per_node", 8) == 8:
        assert (answers["model_size"], answers["expert_parallel"]) == ("30b-a3b", 8), answers


def suggestions(message: str) -> list[dict]:
    """The answers a refusal tells the user to give, one dict per alternative it offers: "choose a=x, b=y and
    c=z: ...", "choose full, sharding=full" (the refused question's own answer bare), "choose fp16 or fp32: ...",
    "choose nccl or sharding=no_shard: ...", "answer 1, 2 or 4 (...)", "answer 1 with sharding=full: ...",
    "2048 fit with micro_batch_size=1: ...", "1 fits", "a multiple of 8: 131064 or 131072"."""
    question, text = re.match(r"[^']*'(\w+)': (.*)", message, re.S).groups()

    def answers(offer: str) -> dict:
        pairs = [item.partition("=") for item in re.split(r", | and ", offer)]
        return {k if eq else question: yaml.safe_load(v if eq else k) for k, eq, v in pairs}

    if found := re.match(r"choose (.+?)(?: \(\d+\.\d GiB\))?(?:: |$)", text):
        offer = found.group(1)
        return [answers(alt) for alt in re.split(r", | or ", offer)] if " or " in offer else [answers(offer)]
    if found := re.match(r"answer (.+?)(?: \(|: |$)", text):
        offer, _, rest = found.group(1).partition(" with ")
        return (
            [{question: int(offer), **(answers(rest) if rest else {})}]
            if rest
            else [{question: int(t)} for t in re.split(r", | or ", offer)]
        )
    if found := re.match(r"(\d+) (?:tokens fit|fits?)(?: with (.+?))?(?:: |$)", text):
        return [{question: int(found.group(1)), **(answers(found.group(2)) if found.group(2) else {})}]
    if found := re.match(r"a multiple of \d+: (.+)$", text):
        return [{question: int(n)} for n in found.group(1).split(" or ")]
    return []


def refusal_of(tmp_path, answers: dict) -> str:
    with pytest.raises(ValueError) as refusal:
        render(tmp_path / "refused", answers, pretend=True)
    return str(refusal.value)


# The Volta case of issue 28: 8b on 8 x 32 GiB GPUs with DDP, no offload and no ZeRO optimizer given on the
# command line, at 32,768 tokens (at 8,192 the loss in chunks leaves room without offload). Selective
# recomputation fits only with other sharding, and full sharding only with offload.
VOLTA = {"gpu_arch": "volta", "gpus_per_node": 8, "gpu_memory_gb": 32, "model_type": "custom", "model_size": "8b",
         "micro_batch_size": 1, "intra_node_link": "pcie", "sharding": "no_shard", "cpu_offload": False,
         "zero_optimizer": False, "activation_checkpointing": "selective", "customize": True,
         "seq_len": 49152}  # fmt: skip


def test_a_refusal_names_every_answer_its_fix_changes_and_following_it_renders(tmp_path):
    message = refusal_of(tmp_path, VOLTA)
    # The figure does not fit beside so long a fix in a terminal (the disabled choice "   - selective (...)").
    assert message == ("Invalid choice for 'activation_checkpointing': choose full, sharding=full and cpu_offload=true")
    # Following only the first answer of it, the next refusal asks for the rest, with the suggested plan's figure, not
    # the refused one's.
    half = refusal_of(tmp_path, {**VOLTA, "activation_checkpointing": "full"})
    assert half == "Invalid choice for 'sharding': choose full and cpu_offload=true: at best 17.9 GiB/GPU"
    (fix,) = suggestions(message)
    root = render(tmp_path / "fixed", {**VOLTA, **fix})
    recorded = answers_of(root)
    assert {k: recorded[k] for k in fix} == fix and misfit(recorded) == ""
    assert recorded["micro_batch_size"] == 1 and recorded["model_size"] == "8b"  # the answers it did not name stay


def test_the_readmes_volta_example_run_as_printed_answers_with_the_refusal_it_quotes(tmp_path):
    text = " ".join((TEMPLATE / "README.md").read_text().split())
    example = re.search(r"`copier copy --defaults ((?:-d \w+=\w+ )+)\S+ my-run`, is refused with `([^`]+)`", text)
    assert example, "README.md: the Volta example's command and the refusal it quotes"
    answers = {key: yaml.safe_load(value) for key, value in re.findall(r"-d (\w+)=(\w+)", example.group(1))}
    assert answers["gpu_arch"] == "volta"
    assert refusal_of(tmp_path, answers).endswith(f": {example.group(2)}")


@pytest.mark.parametrize(
    "case",
    ["sequence_too_long_even_split", "context_parallel_beyond_node", "context_parallel_splits_heads",
     "context_parallel_splits_the_sequence", "context_parallel_too_small", "context_parallel_without_a_plan"],
)  # fmt: skip
def test_following_a_context_parallel_refusals_fix_renders(tmp_path, case):
    """Each degree (or sequence) a context-parallel refusal offers renders with the other answers as given, and
    the repo records it."""
    answers, question, _ = REFUSED[case]
    offers = suggestions(refusal_of(tmp_path, answers))
    assert offers, case
    for i, offer in enumerate(offers):
        recorded = answers_of(render(tmp_path / f"fixed{i}", {**answers, **offer}))
        assert {k: recorded[k] for k in offer} == offer and misfit(recorded) == "", (offer, recorded)


# Answer sets the planner refuses: hardware, a model, and later answers given on the command line that
# a fix may have to change too. A seeded sample keeps the run short; every question that suggests an
# answer by memory or by a rule of the plan is among them.
HARDWARE_SETS = [
    {"gpu_arch": "volta", "gpus_per_node": 8, "gpu_memory_gb": 32, "intra_node_link": "pcie"},
    {"gpus_per_node": 1, "gpu_memory_gb": 24},
    {"gpu_arch": "ampere", "gpus_per_node": 2, "gpu_memory_gb": 40},
    {"accelerator": "cpu", "gpus_per_node": 2, "host_memory_gb": 96},
]
GIVEN = [
    {"sharding": "no_shard", "cpu_offload": False, "zero_optimizer": False, "activation_checkpointing": "selective"},
    {"sharding": "no_shard", "activation_checkpointing": "none"},
    {"cpu_offload": False, "activation_checkpointing": "none"},
    {"sharding": "shard_grad_op", "cpu_offload": False},
    {"micro_batch_size": 8, "activation_checkpointing": "none"},
    {"seq_len": 131072, "micro_batch_size": 2},
    {"backend": "mpi", "sharding": "full"},
    {"mixed_precision": "bf16", "sharding": "no_shard"},
    {"tensor_parallel": 3, "sharding": "no_shard"},
    {"finetune": "lora", "micro_batch_size": 4, "cpu_offload": False},
    {"checkpoint_format": "dcp_async", "cpu_offload": True, "sharding": "full"},
]
GRID = random.Random(0).sample(
    [{**hw, "model_type": model, "model_size": size, **given}
     for hw, (model, size), given in itertools.product(HARDWARE_SETS, [("custom", "1b"), ("llama", "3b")], GIVEN)],
    24,
)  # fmt: skip


def test_following_each_suggested_fix_renders(tmp_path):
    """Every alternative a refusal offers renders with the other answers as given: a fix names every
    answer that must change with it, and none that is refused after it."""
    refused = 0
    for i, answers in enumerate(GRID):
        try:
            render(tmp_path / f"as_given{i}", answers, pretend=True)
            continue
        except ValueError as error:
            message = str(error)
        offers = suggestions(message)
        if "needs " in message and not offers:  # a model or sequence that fits no plan names no fix: it has none
            continue
        assert offers, (answers, message)
        for offer in offers:
            try:
                render(tmp_path / f"fixed{i}", {**answers, **offer}, pretend=True)
            except ValueError as error:
                raise AssertionError(f"{answers}: following {offer} of '{message}' is refused: {error}") from None
        refused += 1
    assert refused >= 16, refused
