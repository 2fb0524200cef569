"""Answers that cannot work are refused before anything is written, naming the question."""

from __future__ import annotations

import pytest
from conftest import render

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
    "project_name_with_space": ({"project_name": "my project"}, "project_name", "letters, digits"),
    "70b_on_one_small_gpu": (
        {"gpus_per_node": 1, "gpu_memory_gb": 24, "model_size": "70b"},
        "sharding",
        "GiB per GPU",
    ),
    "8b_ddp_does_not_fit": (
        {"model_size": "8b", "sharding": "no_shard", "activation_checkpointing": "selective"},
        "sharding",
        "you have 80",
    ),
    "8b_ddp_fits_only_with_zero": (
        {"model_size": "8b", "sharding": "no_shard", "activation_checkpointing": "full"},
        "zero_optimizer",
        "choose zero_optimizer=true to split AdamW's state over the ranks (69.8 GiB)",
    ),
    "offload_with_ddp": (
        {"model_size": "debug", "sharding": "no_shard", "cpu_offload": True},
        "cpu_offload",
        "needs a sharded mode",
    ),
    "no_gpus": ({"gpus_per_node": 0}, "gpus_per_node", "between 1 and 128"),
    "zero_gpu_memory": ({"gpu_memory_gb": 0}, "gpu_memory_gb", "between 1 and 1024"),
    "sequence_too_long": ({"model_size": "debug", "seq_len": 128}, "seq_len", "max_seq_len"),
    "unknown_size": ({"model_size": "13b"}, "model_size", "13b"),
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


def test_memory_refusal_gives_the_numbers_and_a_plan_that_fits(tmp_path):
    with pytest.raises(ValueError) as refusal:
        render(
            tmp_path / "p",
            {"model_size": "8b", "gpus_per_node": 8, "sharding": "no_shard", "activation_checkpointing": "none"},
        )
    message = str(refusal.value)
    # "needs 189.3 GiB per GPU (model state 119.7, ...); you have 80 GiB, ...: choose sharding=..."
    assert "needs" in message and "you have 80" in message and "choose sharding=" in message, message
