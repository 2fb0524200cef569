"""The per-rank memory and communication plan, from the live config.

    python -m <package>.plan --config configs/<size>.toml
    python -m <package>.plan --detect [--config configs/<size>.toml]

The first prints what every sharding choice costs per rank and which one the config uses. The
second detects this machine's accelerators (hardware.py, the template's hwprobe.py) and, when they
differ from the hardware the repo was generated for, prints the plan on them and the
`copier update` command that re-sizes the repo. At start-up the trainer checks the plan against
the live world size, device memory and RAM (check.py's `check_plan`).

The template chose the repo's defaults with the same formulas, written in Jinja as macros of the
same names (the template's hooks/plan.jinja); its tests hold the two together on a grid of inputs.
Each formula is written once here, in the docstring of the function that computes it:

    memory.py          memory_plan: the device bytes per rank (parameters, gradients, optimizer
                       state, gathered blocks, activations) and their peak (MemoryPlan.total);
                       activation_bytes_per_token: what a block keeps per token, which the model's
                       shape declares (models/llama/shape.py, each other model's own); block_gather_bytes,
                       adapter_params (LoRA), grad_accum, planned_degrees (distributed.Degrees on the
                       planned hardware: the shard group, the data-parallel ranks), parked_bytes
                       (activation offload's block inputs in host memory)
    host.py            host_memory_plan: a node's RAM by term and its peak (HostPlan.total);
                       check_host_memory, which refuses a node without room and names what fits
    communication.py   communication_bytes (FSDP and DDP), tensor_parallel_bytes, context_parallel_bytes,
                       expert_parallel_bytes (the all-to-alls), activation_offload_bytes (the host
                       link), step_seconds
    choice.py          cheapest / recommend (sharding, activation checkpointing, CPU and activation offload),
                       needs_activation_offload (whether a plan fits only with its block inputs parked),
                       recommend_tensor_parallel and recommend_expert_parallel (the degrees, from their
                       estimate_* functions) and recommend_context_parallel (the smallest degree with
                       which the sequence fits)
    check.py           check_plan, the launch-time check, with a fix that fits for each refusal

report.py prints the table, resize.py the `--detect` advice, and __main__.py is the command line,
the one place that unpacks a whole Config: everything here takes the sub-configs it reads.
"""

from ..presets import HEADROOM, HOST_MEMORY
from .check import check_plan, device_memory_gb
from .choice import (
    DegreeEstimate,
    PlanChoice,
    cheapest,
    context_parallel_degrees,
    estimate_expert_parallel,
    estimate_tensor_parallel,
    expert_parallel_degrees,
    longest_fitting_seq_len,
    needs_activation_offload,
    recommend,
    recommend_context_parallel,
    recommend_expert_parallel,
    recommend_tensor_parallel,
    seq_len_multiple,
    sharding_candidates,
    tensor_parallel_degrees,
    tensor_parallel_estimates,
)
from .communication import (
    ARCH_TFLOPS,
    activation_offload_bytes,
    activation_offload_seconds,
    communication_bytes,
    context_parallel_bytes,
    context_parallel_seconds,
    expert_parallel_bytes,
    expert_parallel_seconds,
    step_seconds,
    tensor_parallel_bytes,
    tensor_parallel_seconds,
)
from .host import HostPlan, check_host_memory, host_memory_plan, host_plan_for
from .memory import (
    AC_MODES,
    GIB,
    SHARDINGS,
    MemoryPlan,
    activation_bytes_per_token,
    adapter_params,
    block_gather_bytes,
    grad_accum,
    lora_of,
    memory_plan,
    parked_bytes,
    plan_for,
    planned_degrees,
    sequence_parallel,
)

__all__ = [
    "AC_MODES",
    "ARCH_TFLOPS",
    "GIB",
    "HEADROOM",
    "HOST_MEMORY",
    "SHARDINGS",
    "DegreeEstimate",
    "HostPlan",
    "MemoryPlan",
    "PlanChoice",
    "activation_bytes_per_token",
    "activation_offload_bytes",
    "activation_offload_seconds",
    "adapter_params",
    "block_gather_bytes",
    "cheapest",
    "check_host_memory",
    "check_plan",
    "communication_bytes",
    "context_parallel_bytes",
    "context_parallel_degrees",
    "context_parallel_seconds",
    "device_memory_gb",
    "estimate_expert_parallel",
    "estimate_tensor_parallel",
    "expert_parallel_bytes",
    "expert_parallel_degrees",
    "expert_parallel_seconds",
    "grad_accum",
    "host_memory_plan",
    "host_plan_for",
    "longest_fitting_seq_len",
    "lora_of",
    "memory_plan",
    "needs_activation_offload",
    "parked_bytes",
    "plan_for",
    "planned_degrees",
    "recommend",
    "recommend_context_parallel",
    "recommend_expert_parallel",
    "recommend_tensor_parallel",
    "seq_len_multiple",
    "sequence_parallel",
    "sharding_candidates",
    "step_seconds",
    "tensor_parallel_bytes",
    "tensor_parallel_degrees",
    "tensor_parallel_estimates",
    "tensor_parallel_seconds",
]
