"""What a step sends and how long that takes against its compute. Memory decides what fits;
communication decides, among the plans that fit, which is fast: FSDP's collectives overlap with
compute only while they take less time than it, and tensor and context parallelism's do not overlap
at all. The template's hooks/plan.jinja computes the same bytes at question time, with macros of the same
names."""

from __future__ import annotations

from ..config import FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig
from ..distributed import parallel_degrees
from ..models import ModelShape
from ..presets import ACTIVATION_OFFLOAD, GPU_ARCHS, LINK_GBPS, LORA, PEAK_TFLOPS
from .memory import (
    activation_bytes_per_token,
    adapter_params,
    block_gather_bytes,
    lora_of,
    parked_bytes,
    planned_degrees,
)

# Peak TFLOP/s by generation (its flagship device's), for the compute side of the estimates; XPU and CPU
# plans assume an A100.
ARCH_TFLOPS = {arch: PEAK_TFLOPS[spec["flagship"]] for arch, spec in GPU_ARCHS.items()}
MFU = 0.4
"""The model FLOPs utilisation the estimates assume: what a well-tuned FSDP run reaches."""


def communication_bytes(
    s: ModelShape, sharding: str, precision: str, gpus_per_node: int, num_nodes: int, zero_optimizer: bool = False,
    float8: str = "none", lora_rank: int = 0, lora_targets: str = LORA["targets"], tensor_parallel: int = 1,
    expert_parallel: int = 1,
) -> dict:  # fmt: skip
    """Bytes each rank sends per optimizer step, within a node ("intra") and across nodes ("inter"), as
    ring collectives send (N - 1) / N of the data over a group of N.

    With G the gathered bytes of every block and the rest (block_gather_bytes), W = 4 bytes a trained
    parameter: full and hybrid all-gather twice (forward and backward) and reduce-scatter the fp32
    gradients once, 2G + W P; shard_grad_op gathers once, G + W P; DDP all-reduces the fp32 gradients,
    2 W P (twice a reduce-scatter), and with the ZeRO optimizer also broadcasts the parameters each rank
    updated, 3 W P. Hybrid adds the all-reduce of each node's shard across the nodes,
    2 W P / gpus_per_node. With LoRA only the adapters have gradients and updates; the frozen weights
    are still gathered. With tensor parallelism each rank moves its group's 1/t among the data-parallel
    ranks. With expert parallelism e a rank gathers and reduces 1/e of the routed experts (X, the
    sparse blocks' routed parameters: 2 X p + W X of full's volume), among the N / e ranks that
    share them; the all-to-all of the tokens is expert_parallel_bytes.
    """
    p, t = (4 if precision == "fp32" else 2), tensor_parallel
    degrees = parallel_degrees(sharding, world_size=gpus_per_node * num_nodes, ranks_per_node=gpus_per_node, tp=t,
                               ep=expert_parallel)  # fmt: skip
    adapters = adapter_params(s, lora_rank, lora_targets)
    trained = s.L * adapters if lora_rank else s.P
    gather = (s.L * block_gather_bytes(s, p, sharding, float8, adapters) + s.Pn * p) / t  # one all-gather of everything
    if sharding == "no_shard":
        volume = (3 if zero_optimizer else 2) * trained * 4
    elif sharding == "shard_grad_op":
        volume = gather + trained * 4 / t
    else:
        volume = 2 * gather + trained * 4 / t
    # DDP all-reduces over every rank (it is not combined with the other degrees), FSDP gathers and reduce-scatters
    # over the ranks of one copy.
    group = degrees.world_size if sharding == "no_shard" else degrees.shard_group
    sent = volume * (group - 1) / group
    if expert_parallel > 1 and sharding != "no_shard":  # the routed experts travel among fewer ranks, less of them
        e, routed, efsdp = expert_parallel, s.sparse_layers * s.routed_params, degrees.efsdp
        experts = ((1 if sharding == "shard_grad_op" else 2) * routed * p + routed * 4) / t
        sent = (volume - experts) * (group - 1) / group + experts / e * (efsdp - 1) / efsdp
    if sharding == "hybrid":  # plus the all-reduce of each shard across the nodes
        return {"intra": sent, "inter": 2 * (trained / gpus_per_node) * 4 * (num_nodes - 1) / num_nodes}
    return {"intra": sent if num_nodes == 1 else 0.0, "inter": sent if num_nodes > 1 else 0.0}


def tensor_parallel_bytes(s: ModelShape, precision: str, ac: str, tensor_parallel: int, tokens: int) -> float:
    """Bytes each rank sends per step for tensor parallelism, on the link inside its node (ring
    collectives): tokens p (h (c L + 4) + V) (t - 1) / t, for `tokens` what one tensor-parallel group
    processes per step.

    In each block, forward all-gathers the sequence before attention and before the feed-forward and
    reduce-scatters after wo and w2: four collectives of the hidden states, which backward mirrors
    (c = 8; 12 when activation checkpointing runs the forward again). Around the blocks the embedding's
    reduce-scatter, the head's all-gather and their backward move the hidden states 4 times more, and
    the head all-gathers the logits (V). Without sequence parallelism one all-reduce (twice the bytes)
    takes the place of each all-gather and reduce-scatter pair: the same traffic.
    """
    p, t = (4 if precision == "fp32" else 2), tensor_parallel
    per_block = 8 if ac == "none" else 12
    return tokens * p * (s.h * (per_block * s.L + 4) + s.V) * (t - 1) / t


def context_parallel_bytes(
    s: ModelShape, precision: str, ac: str, tensor_parallel: int, context_parallel: int, tokens: int
) -> float:
    """Bytes each rank sends per step for context parallelism (Ulysses attention), on the link inside its node:
    tokens / c p (2h + 2g) / t k L (c - 1) / c, for `tokens` what one context-parallel group processes per step,
    c = context_parallel, t = tensor_parallel.

    In each block forward all-to-alls q, k and v to be split by heads and the attention output back, a rank's
    share of each going to the c - 1 others: (2h + 2g) / t elements per token it holds, where g is the
    key/value width, or h where the key/value heads (per tensor-parallel rank) do not divide by c and are
    repeated first. Backward all-to-alls their gradients alike (k = 2); full recomputation runs the forward's
    again (k = 3), while selective checkpointing keeps their outputs (k = 2)."""
    c, t, p = context_parallel, tensor_parallel, (4 if precision == "fp32" else 2)
    if c <= 1:
        return 0.0
    g = s.kv if s.kv_heads // t % c == 0 else s.h
    k = 3 if ac == "full" else 2
    return tokens / c * p * (2 * s.h + 2 * g) / t * k * s.L * (c - 1) / c


def expert_parallel_bytes(s: ModelShape, precision: str, ac: str, expert_parallel: int, tokens: int) -> float:
    """Bytes each rank sends per step for expert parallelism, on the link inside its node: c tokens k h p
    (e - 1) / e for each sparse layer, for `tokens` this rank's tokens per step, each sent as k copies of
    h values.

    A sparse layer's all-to-all sends the copies to the ranks of their experts and the outputs back
    (dispatch and combine), and backward sends their gradients the same two ways (c = 4; 6 when full
    activation checkpointing runs the forward again; selective keeps the all-to-all's outputs). A copy
    for one of this rank's own experts stays (1/e of them, with routing in balance). The counts sent
    first (num_experts integers) are left out.
    """
    if expert_parallel <= 1:
        return 0.0
    p, e = (4 if precision == "fp32" else 2), expert_parallel
    c = 6 if ac == "full" else 4
    return c * tokens * s.top_k * s.h * p * (e - 1) / e * s.sparse_layers


def activation_offload_bytes(
    s: ModelShape, precision: str, tokens: float, tensor_parallel: int = 1, sequence_parallel: bool = True,
    context_parallel: int = 1,
) -> float:  # fmt: skip
    """Bytes a GPU moves over its host link per step for activation offload: 2 T (L - K) b, for T = `tokens` a rank
    holds per step (its micro-batches' together), b a block's input per token (activation_bytes_per_token's full:
    what full checkpointing keeps) and K = ACTIVATION_OFFLOAD["keep"]. Each parked input goes to the host in forward
    and comes back in backward; the copies run on a side stream and overlap compute (activation_offload.py)."""
    block_input = activation_bytes_per_token(
        s, precision, "full", tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
        context_parallel=context_parallel,
    )  # fmt: skip
    return 2 * parked_bytes(s, tokens, block_input)


def activation_offload_seconds(sent: float, *, hardware: HardwareConfig) -> float:
    """Seconds to move `sent` bytes (activation_offload_bytes) over a GPU's host link: ACTIVATION_OFFLOAD's host_gbps
    of the planned generation (a Hopper's where there is none to name); 0 on CPU ranks, which copy in memory."""
    if not sent or hardware.accelerator == "cpu":
        return 0.0
    kind = hardware.gpu_arch if hardware.accelerator == "cuda" else hardware.accelerator
    return sent / (ACTIVATION_OFFLOAD["host_gbps"].get(kind, ACTIVATION_OFFLOAD["host_gbps"]["hopper"]) * 1e9)


def link_seconds(sent: dict, *, hardware: HardwareConfig) -> float:
    """Seconds to send communication_bytes' figures over the planned links."""
    intra, inter = LINK_GBPS[hardware.intra_node_link] * 1e9, LINK_GBPS[hardware.inter_node_link] * 1e9
    return sent["intra"] / intra + sent["inter"] / inter


def peak_flops(*, hardware: HardwareConfig) -> float:
    """FLOP/s of one GPU of the planned generation (an A100's where there is none to name)."""
    return ARCH_TFLOPS.get(hardware.gpu_arch, ARCH_TFLOPS["ampere"]) * 1e12


def step_seconds(
    s: ModelShape, *, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, sharding: str, zero_optimizer: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """(compute, communication) seconds per step at MFU and the planned link speeds: whether FSDP's
    traffic can hide behind compute is their ratio.

    6 FLOPs per parameter and token (forward, input and weight gradients), of the parameters a token is
    multiplied by (a mixture of experts' active ones); a frozen weight has no weight gradient, so with LoRA 4
    per frozen parameter and 6 per adapter parameter. Communication is FSDP's or
    DDP's (communication_bytes), which overlaps with compute; tensor parallelism's, which does not, is
    tensor_parallel_seconds.
    """
    hw, lora = hardware, lora_of(finetune=finetune)
    world = hw.gpus_per_node * hw.num_nodes
    tokens_per_rank = train.global_batch_size * train.seq_len / world
    adapters = s.L * adapter_params(s, **lora)
    flops = 4 * s.P + 6 * adapters if lora["lora_rank"] else 6 * s.active_params
    compute = flops * tokens_per_rank / (MFU * peak_flops(hardware=hw))
    sent = communication_bytes(
        s, sharding, parallel.mixed_precision, hw.gpus_per_node, hw.num_nodes, zero_optimizer, parallel.float8,
        **lora, tensor_parallel=parallel.tensor_parallel, expert_parallel=parallel.expert_parallel,
    )  # fmt: skip
    return compute, link_seconds(sent, hardware=hw)


def tensor_parallel_seconds(
    s: ModelShape, *, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig
) -> float:
    """Seconds per step that tensor parallelism's collectives take on the link inside a node, which compute
    waits for."""
    t, degrees = parallel.tensor_parallel, planned_degrees(parallel=parallel, hardware=hardware)
    tokens = train.global_batch_size * train.seq_len // (degrees.dp * degrees.cp)  # a tensor-parallel group's
    sent = tensor_parallel_bytes(s, parallel.mixed_precision, parallel.activation_checkpointing, t, tokens)
    return sent / (LINK_GBPS[hardware.intra_node_link] * 1e9)


def context_parallel_seconds(
    s: ModelShape, *, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig
) -> float:
    """Seconds per step that context parallelism's all-to-alls take on the link inside a node, which compute
    waits for."""
    c, t = parallel.context_parallel, parallel.tensor_parallel
    tokens = train.global_batch_size * train.seq_len // planned_degrees(parallel=parallel, hardware=hardware).dp
    sent = context_parallel_bytes(s, parallel.mixed_precision, parallel.activation_checkpointing, t, c, tokens)
    if not sent:  # no context parallelism (and perhaps one rank a node, and no link to name)
        return 0.0
    return sent / (LINK_GBPS[hardware.intra_node_link] * 1e9)


def expert_parallel_seconds(
    s: ModelShape, *, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig
) -> float:
    """Seconds per step that expert parallelism's all-to-alls take on the link inside a node; compute waits
    for them (a layer's experts need its tokens)."""
    tokens = train.global_batch_size * train.seq_len // (hardware.gpus_per_node * hardware.num_nodes)
    sent = expert_parallel_bytes(s, parallel.mixed_precision, parallel.activation_checkpointing,
                                 parallel.expert_parallel, tokens)  # fmt: skip
    return sent / (LINK_GBPS[hardware.intra_node_link] * 1e9)
