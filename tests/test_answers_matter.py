"""Every question changes the generated repo: no answer is decoration."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, render

# Every question answered explicitly, so that changing one changes nothing else.
BASE = {
    "project_name": "proj", "package_name": "proj", "accelerator": "cuda", "gpu_arch": "hopper",
    "gpus_per_node": 8, "num_nodes": 2, "gpu_memory_gb": 80, "host_memory_gb": 2048, "intra_node_link": "nvlink",
    "inter_node_link": "infiniband", "model_type": "llama", "model_size": "1b", "tensor_parallel": 1, "seq_len": 4096,
    "context_parallel": 1,
    "micro_batch_size": 2, "mixed_precision": "bf16", "activation_checkpointing": "none", "sharding": "full",
    "cpu_offload": False, "compile": True, "backend": "nccl", "init_method": "env", "checkpoint_format": "dcp",
    "checkpoint_interval": 500, "checkpoint_keep_last": 3, "checkpoint_export": "hf", "resume": "auto",
    "launchers": ["torchrun"], "ci_workflow": True,
}  # fmt: skip
# question -> (answers that must differ from BASE for the change to be valid, the other answer)
CHANGE = {
    "project_name": ({}, "other-proj"),
    "package_name": ({}, "other"),
    "accelerator": ({"backend": "gloo"}, "cpu"),
    "gpu_arch": ({}, "ampere"),
    "gpus_per_node": ({}, 4),
    "num_nodes": ({}, 1),
    "gpu_memory_gb": ({}, 40),
    "host_memory_gb": ({}, 512),
    "intra_node_link": ({}, "pcie"),
    "inter_node_link": ({}, "ethernet"),
    "model_type": ({"checkpoint_export": "safetensors"}, "custom"),
    "hf_architecture": ({"model_type": "hf_causal_lm"}, "qwen2"),
    "finetune": ({}, "lora"),
    "data_source": ({}, "memmap"),
    "logging": ({}, "wandb"),
    "model_size": ({}, "3b"),
    "tensor_parallel": ({}, 2),
    "expert_parallel": (
        {
            "model_type": "qwen3_moe",
            "model_size": "30b-a3b",
            "micro_batch_size": 1,
            "activation_checkpointing": "full",
            "expert_parallel": 8,
        },
        4,
    ),
    "seq_len": ({}, 2048),
    "context_parallel": ({}, 2),
    # Asked only past the preset's context (1b: 131,072 tokens), where yarn is the default.
    "rope_scaling": ({"seq_len": 262144, "context_parallel": 8, "activation_checkpointing": "full"}, "linear"),
    "micro_batch_size": ({}, 1),
    "mixed_precision": ({}, "fp16"),
    "activation_checkpointing": ({}, "full"),
    "sharding": ({}, "shard_grad_op"),
    "cpu_offload": ({}, True),
    "zero_optimizer": ({"sharding": "no_shard", "activation_checkpointing": "full"}, True),
    "compile": ({}, False),
    "float8": ({}, "tensorwise"),
    "backend": ({}, "gloo"),
    "init_method": ({}, "tcp"),
    "checkpoint_format": ({}, "dcp_async"),
    "checkpoint_interval": ({}, 100),
    "checkpoint_keep_last": ({}, 5),
    "checkpoint_export": ({}, "safetensors"),
    "resume": ({}, "never"),
    "launchers": ({}, ["slurm", "kubernetes"]),
    "ci_workflow": ({}, False),
}


def questions() -> dict:
    config = yaml.safe_load((TEMPLATE / "copier.yml").read_text())
    return {k: v for k, v in config.items() if not k.startswith("_")}


# Questions that decide only which other questions are asked (tests/test_interactive.py checks them).
GATES = {"customize"}


def test_every_question_is_covered():
    single_choice = {q for q, spec in questions().items() if len(spec.get("choices", [None, None])) == 1}
    assert set(questions()) - single_choice - GATES == set(CHANGE)


def differences(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=[".copier-answers.yml"])
    found = []

    def walk(c: filecmp.dircmp, prefix: str) -> None:
        found.extend(prefix + n for n in c.left_only + c.right_only + c.diff_files)
        for name, sub in c.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(cmp, "")
    return found


@pytest.fixture(scope="module")
def base_render(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("base") / "p", BASE)


@pytest.mark.parametrize("question", CHANGE)
def test_answer_changes_the_render(tmp_path, base_render, question):
    fixed, other = CHANGE[question]
    before = render(tmp_path / "before", {**BASE, **fixed}) if fixed else base_render
    after = render(tmp_path / "after", {**BASE, **fixed, question: other})
    assert differences(before, after), f"answering {question}={other!r} changed nothing"
