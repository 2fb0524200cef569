"""Answers that cannot work are refused before anything is written, naming the question."""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import answers_of, misfit, render

REFUSED = {
    "nccl_on_cpu": ({"accelerator": "cpu", "backend": "nccl"}, "backend", "cannot run collectives on cpu"),
    "xccl_on_cuda": ({"backend": "xccl"}, "backend", "cannot run collectives on cuda"),
    "gloo_on_xpu": ({"accelerator": "xpu", "backend": "gloo"}, "backend", "cannot run collectives on xpu"),
    "mpi_cannot_shard": ({"backend": "mpi", "sharding": "full"}, "backend", "does not support reduce_scatter"),
    "bf16_on_volta": ({"gpu_arch": "volta", "mixed_precision": "bf16"}, "mixed_precision", "compute capability 8.0"),
    "bf16_on_turing": ({"gpu_arch": "turing", "mixed_precision": "bf16"}, "mixed_precision", "turing is 7.5"),
    "hybrid_on_one_node": ({"sharding": "hybrid"}, "sharding", "hybrid needs several nodes"),
    "package_with_dash": ({"package_name": "my-model"}, "package_name", "not a lowercase Python identifier"),
    "package_with_digit": ({"package_name": "1st_try"}, "package_name", "not a lowercase Python identifier"),
    "package_shadows_torch": ({"package_name": "torch"}, "package_name", "would shadow"),
    "package_shadows_a_test_helper": ({"package_name": "launch"}, "package_name", "e.g. launch_train"),
    "package_name_empty": ({"package_name": ""}, "package_name", "(e.g. fsdp_train)"),
    "package_is_a_keyword": ({"package_name": "lambda"}, "package_name", "keyword"),
    "project_name_with_space": ({"project_name": "my project"}, "project_name", "letters, digits"),
    "70b_on_one_small_gpu": (
        {"gpus_per_node": 1, "gpu_memory_gb": 8, "model_size": "70b"},
        "model_size",
        "GiB per GPU even at one 128-token sequence",
    ),
    "70b_sequence_too_long": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "70b", "seq_len": 8192},
        "seq_len",
        "needs 39.0 GiB even with full sharding, full activation checkpointing and CPU offload, over the 21.6 GiB "
        "usable: 2048 tokens fit",
    ),
    "micro_batch_too_large": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "8b", "micro_batch_size": 64},
        "micro_batch_size",
        "1 fits (gradient accumulation",
    ),
    "8b_ddp_does_not_fit": (
        {"model_size": "8b", "sharding": "no_shard", "activation_checkpointing": "selective"},
        "sharding",
        "with sharding=no_shard nothing fits: at best 91.1 GiB per GPU, over the 72.0 GiB usable of 80; "
        "choose sharding=shard_grad_op",
    ),
    "ac_none_cannot_fit": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "8b", "activation_checkpointing": "none"},
        "activation_checkpointing",
        "choose activation_checkpointing=full",
    ),
    "8b_ddp_fits_only_with_zero": (
        {"model_size": "8b", "sharding": "no_shard", "activation_checkpointing": "full", "zero_optimizer": False},
        "zero_optimizer",
        "choose zero_optimizer=true to split AdamW's state over the ranks (69.8 GiB)",
    ),
    "offload_needed": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "8b", "cpu_offload": False},
        "cpu_offload",
        "cpu_offload=true (21.4 GiB)",
    ),
    "offload_with_ddp": (
        {"model_size": "debug", "sharding": "no_shard", "cpu_offload": True},
        "cpu_offload",
        "needs a sharded mode",
    ),
    "tensor_parallel_across_nodes": (
        {"model_size": "8b", "tensor_parallel": 3},
        "tensor_parallel",
        "tensor_parallel=3 must divide gpus_per_node=8: a tensor-parallel group communicates in every layer and "
        "stays within one node; answer one of 1, 2, 4, 8",
    ),
    "tensor_parallel_splits_heads": (
        {"model_size": "125m", "tensor_parallel": 8},
        "tensor_parallel",
        "must divide the 125m preset's n_heads=12, n_kv_heads=12",
    ),
    "tensor_parallel_splits_transformers_heads": (
        {"model_type": "hf_causal_lm", "model_size": "125m", "tensor_parallel": 8},
        "tensor_parallel",
        "must divide the 125m preset's n_heads=12, n_kv_heads=12 (each rank takes whole heads and an equal share of "
        "every matrix): answer one of 1, 2, 4",
    ),
    "tensor_parallel_without_a_plan": (
        {"model_type": "vit", "model_size": "vit-base", "tensor_parallel": 2},
        "tensor_parallel",
        "only the decoders (llama, hf_causal_lm) have a tensor-parallel plan",
    ),
    "tensor_parallel_zero": ({"model_size": "8b", "tensor_parallel": 0}, "tensor_parallel", "must be at least 1"),
    "tensor_parallel_with_ddp": (
        {"model_size": "8b", "tensor_parallel": 2, "sharding": "no_shard"},
        "sharding",
        "no_shard (DDP) is not combined with tensor_parallel=2",
    ),
    "sequence_tensor_parallel_cannot_split": (
        {"model_size": "8b", "tensor_parallel": 8, "seq_len": 8188},
        "seq_len",
        "must be a multiple of tensor_parallel=8",
    ),
    "no_gpus": ({"gpus_per_node": 0}, "gpus_per_node", "between 1 and 128"),
    "zero_gpu_memory": ({"gpu_memory_gb": 0}, "gpu_memory_gb", "between 1 and 1024"),
    "sequence_too_long": ({"model_size": "debug", "seq_len": 128}, "seq_len", "max_seq_len"),
    "unknown_size": ({"model_size": "13b"}, "model_size", "13b"),
    "chats_for_an_image_model": ({"model_type": "vit", "data_source": "sft"}, "data_source", "token data"),
    "lora_for_vit": ({"model_type": "vit", "finetune": "lora"}, "finetune", "llama or hf_causal_lm, and vit has none"),
    "lora_for_custom": ({"model_type": "custom", "finetune": "lora"}, "finetune", "choose full"),
    "lora_with_float8": ({"finetune": "lora", "float8": "tensorwise"}, "float8", "with finetune=lora choose none"),
    "lora_with_tp": ({"finetune": "lora", "tensor_parallel": 2}, "tensor_parallel", "not combined with finetune=lora"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_with_the_question_named_and_nothing_written(tmp_path, case):
    answers, question, reason = REFUSED[case]
    dst = tmp_path / "project"
    with pytest.raises(ValueError) as refusal:
        render(dst, answers)
    message = str(refusal.value)
    assert f"'{question}'" in message, message
    assert reason in message, message
    assert not dst.exists()


@pytest.mark.parametrize(
    "case", ["8b_ddp_does_not_fit", "ac_none_cannot_fit", "offload_needed", "70b_sequence_too_long"]
)
def test_the_fix_a_memory_refusal_names_is_accepted(tmp_path, case):
    """A refusal ends in `choose question=value` (or `N tokens fit`); taking that advice renders."""
    answers, question, _ = REFUSED[case]
    with pytest.raises(ValueError) as refusal:
        render(tmp_path / "refused", answers)
    message = str(refusal.value)
    advice = re.search(rf"choose .*?\b{question}=(\w+)", message) or re.search(r": (\d+) tokens fit", message)
    assert advice, message
    value = yaml.safe_load(advice.group(1))
    dst = render(tmp_path / "accepted", {**answers, question: value})
    assert yaml.safe_load((dst / ".copier-answers.yml").read_text())[question] == value


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
    {"gpus_per_node": 2, "gpu_memory_gb": 40, "model_type": "hf_causal_lm", "finetune": "lora"},
    # Ethernet between nodes: the planner splits layers within each node (tensor_parallel > 1), in groups of
    # 4 for llama, of 8 for transformers' plan, whose whole activations need more memory.
    {"num_nodes": 4, "inter_node_link": "ethernet", "gpu_memory_gb": 80, "model_type": "llama"},
    {"num_nodes": 4, "inter_node_link": "ethernet", "gpu_memory_gb": 80, "model_type": "hf_causal_lm"},
]


@pytest.mark.parametrize("hardware", HARDWARE, ids=lambda h: "-".join(f"{v}" for v in h.values()))
def test_the_planners_defaults_are_always_allowed_and_fit(tmp_path, hardware):
    """What a user gets by pressing Enter: never a refused default (copier would crash on it), always a plan
    that fits, whatever the hardware."""
    answers = answers_of(render(tmp_path / "p", hardware))
    assert misfit(answers) == "", answers
    assert {k: answers[k] for k in hardware} == hardware
    if hardware.get("num_nodes") == 4:
        expected = 4 if hardware["model_type"] == "llama" else 8
        assert answers["tensor_parallel"] == expected and answers["sharding"] != "no_shard", answers
