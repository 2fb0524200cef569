"""Device memory per rank at the peak of a step. The trainer checks the plan against the live device
before it allocates anything, and the planner compares choices with it, so every term is a
formula of the config, not a measurement; tests/test_plan.py measures them on CPU ranks, and the
template's hooks/plan.jinja (memory_plan) computes the same at question time."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig
from ..distributed import Degrees, parallel_degrees
from ..models import ModelConfig, ModelShape, model_shape, model_spec
from ..presets import ACTIVATION_OFFLOAD, HEADROOM, LORA, LOSS_CHUNK

GIB = 2**30
SHARDINGS = ("no_shard", "shard_grad_op", "full", "hybrid")
AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank, by term (memory_plan says how each is counted)."""

    params: float
    grads: float
    optim: float
    grads_live: float
    """Gradient bytes alive during the forward pass (accumulation only)."""
    gathered: float
    gradbuf: float
    activations: float
    host: float
    """Bytes kept in host memory by CPU offload."""
    dispatch: float = 0.0
    """Expert parallelism's all-to-all buffers in a sparse layer (0 without)."""
    parked: float = 0.0
    """Block inputs that activation offload keeps in host memory (0 without); not on the device."""

    @property
    def total(self) -> float:
        """Peak bytes on the device: offloaded state is on the host, so it does not count here."""
        resident = 0 if self.host else self.params + self.optim
        return resident + self.grads_live + self.gathered + self.gradbuf + self.activations + self.dispatch

    def fits(self, gpu_memory_gb: float) -> bool:
        """HEADROOM leaves the rest to what `max_memory_allocated` does not see: the CUDA context, NCCL's
        buffers, the allocator's fragmentation."""
        return self.total <= HEADROOM * gpu_memory_gb * GIB


def planned_degrees(*, parallel: ParallelConfig, hardware: HardwareConfig) -> Degrees:
    """The degrees of `parallel` on the planned hardware (distributed.parallel_degrees), as memory_plan prices
    them: hybrid's shard group is one node, as the template's questions plan it."""
    hw, p = hardware, parallel
    return parallel_degrees(p.sharding, world_size=hw.gpus_per_node * hw.num_nodes, ranks_per_node=hw.gpus_per_node,
                            tp=p.tensor_parallel, cp=p.context_parallel, ep=p.expert_parallel)  # fmt: skip


def memory_plan(
    s: ModelShape, *, seq_len: int, micro_batch_size: int, precision: str, ac: str, sharding: str,
    cpu_offload: bool, gpus_per_node: int, num_nodes: int, grad_accum: int = 1, sync_every_microbatch: bool = False,
    zero_optimizer: bool = False, prefetch_blocks: int = 0, float8: str = "none", lora_rank: int = 0,
    lora_targets: str = LORA["targets"], tensor_parallel: int = 1, sequence_parallel: bool = True,
    context_parallel: int = 1, expert_parallel: int = 1, loss_chunk: int = LOSS_CHUNK, activation_offload: bool = False,
) -> MemoryPlan:  # fmt: skip
    """Bytes per rank of each term, for the model's shape `s` (P parameters, Pb per block, Pn outside the
    blocks, L blocks, vocabulary V), p bytes per element of the compute dtype, G = the shard group's ranks
    sharing the state (distributed.Degrees.shard_group: one copy's data-parallel ranks times c), t =
    tensor_parallel, c = context_parallel and T = micro_batch_size x seq_len / c tokens a rank holds (a
    ViT's: its patches; context parallelism splits every sequence over c ranks, which hold the parameters'
    shards together with the data-parallel ones, so only the activations change):

        params, grads, optim  4P, 4P and 8P over G t: fp32 parameters (FSDP2 keeps the sharded ones in
                    their own dtype: these are the master weights), gradients and AdamW's two moments;
                    on the host with CPU offload. DDP's ZeRO optimizer splits only the 8P, over every
                    rank (it hands out whole parameters, so a rank may own a little more).
        gathered    parameters all-gathered in the compute dtype: the running and the prefetched block
                    and the embedding/head group, 2 Pb p + Pn p ((1 + n) Pb p with prefetch_blocks = n
                    >= 2), for full and hybrid; P p for shard_grad_op, which frees nothing until
                    backward; P p for DDP under autocast (0 in fp32). Over t.
        gradbuf     Pb (p + 4) / t: one block's unsharded gradient and its fp32 reduce-scatter input.
        activations T [L a + V (p + 12)] + T a_none under full recomputation (the block recomputed in
                    backward), where a = activation_bytes_per_token and V (p + 12) is the logits, their
                    fp32 copy, the log-softmax output and its gradient (whole on every rank of a
                    tensor-parallel group: no loss parallelism; a context-parallel rank's for its tokens).
                    With more than `loss_chunk` such positions (train.loss_chunk, 0: never) the loss is computed
                    in chunks of C = loss_chunk (loss.py), and V (p + 12) per position becomes C V (4 + p') / t
                    + T (h p + 16) + V h p / t: one chunk's fp32 logits (and below fp32, p' = p, its copy in
                    the compute dtype) on this rank's share of the vocabulary (loss parallelism), the hidden
                    states' gradient, four floats per position (losses, their gradient, log-sum-exps, scales)
                    and the head's weight gradient, which the chunks sum into (none with LoRA: it is frozen).
        grads_live  the gradients alive during the forward pass: none with one micro-batch a step
                    (zero_grad(set_to_none) frees them first); with accumulation the sharded 4P / G t,
                    or 4P / t where FSDP keeps unsharded fp32 gradients until the last micro-batch.
        parked      with activation offload (and checkpointing): T (L - K) b, the inputs of all blocks but
                    the last K = ACTIVATION_OFFLOAD["keep"], which wait for backward in host memory
                    (activation_offload.py) and leave the activations; b is a block's input per token,
                    what full checkpointing keeps (a_full).

    With LoRA (lora_rank r > 0) the P weights are frozen and A = L Ab adapter parameters train
    (Ab = adapter_params): params (p P + 4A) / G t, since frozen weights are stored in the compute
    dtype without a master copy, grads 4A / G t, optim 8A / G t; gathered and gradbuf count Pb + Ab
    parameters a block and only Ab gradients. float8 tensorwise gathers one byte per linear weight
    (block_gather_bytes). MemoryPlan.total is the peak.

    A mixture of experts (E routed experts of R = expert_params each per sparse block, k per token) with
    expert parallelism e: its experts are split among e ranks and FSDP shards each over G / e, so every
    rank still holds 1/G of the state, but a gathered block holds E R / e of its routed weights (gathered
    and gradbuf count Pb - E R (e - 1) / e), and each sparse layer sends and receives its T k token
    copies by all-to-all: dispatch, 2 T k h p, the send and receive buffers of one all-to-all (routing in
    balance: a rank receives as many copies as it sends).
    """
    p, t = (4 if precision == "fp32" else 2), tensor_parallel
    adapters = adapter_params(s, lora_rank, lora_targets)  # per block
    trained, trained_block = (s.L * adapters, adapters) if lora_rank else (s.P, s.Pb)
    if expert_parallel > 1:  # this rank gathers and reduces 1/e of the routed experts
        trained_block -= s.routed_params * (expert_parallel - 1) / expert_parallel
    block = block_gather_bytes(s, p, sharding, float8, adapters, expert_parallel) / t
    degrees = parallel_degrees(sharding, world_size=gpus_per_node * num_nodes, ranks_per_node=gpus_per_node, tp=t,
                               cp=context_parallel, ep=expert_parallel)  # fmt: skip
    group = degrees.shard_group
    # LoRA stores the frozen weights in the compute dtype (models/lora.py's apply_lora).
    stored = p * s.P + 4 * s.L * adapters if lora_rank else 4 * s.P
    params, grads, optim = stored / (group * t), 4 * trained / (group * t), 8 * trained / (group * t)
    if sharding == "no_shard" and zero_optimizer:
        optim = 8 * trained / degrees.world_size
    if grad_accum == 1 or (cpu_offload and (sync_every_microbatch or sharding == "hybrid")):
        grads_live = 0
    elif sharding in ("no_shard", "hybrid") or sync_every_microbatch:
        grads_live = grads
    else:
        grads_live = 4 * trained / t  # FSDP accumulates unsharded fp32 gradients while sync is off
    if sharding == "shard_grad_op":
        gathered = s.L * block + s.Pn * p / t
    elif sharding == "no_shard":
        gathered = trained * p / t if p < 4 else 0  # autocast's copies of the fp32 parameters
    else:
        gathered = (1 + max(prefetch_blocks, 1)) * block + s.Pn * p / t
    gradbuf = 0 if sharding == "no_shard" else trained_block * (p + 4) / t
    per_layer = functools.partial(activation_bytes_per_token, s, precision, lora_rank=lora_rank,
                                  lora_targets=lora_targets, tensor_parallel=t, sequence_parallel=sequence_parallel,
                                  context_parallel=context_parallel)  # fmt: skip
    tokens = (s.tokens or seq_len) * micro_batch_size / context_parallel
    logits = (s.logits or seq_len) * micro_batch_size / context_parallel
    extra = per_layer("none") if ac == "full" else 0  # the one block being recomputed in backward
    loss = loss_bytes(s, positions=logits, p=p, loss_chunk=loss_chunk, tensor_parallel=t, trained_head=not lora_rank)
    parked = parked_bytes(s, tokens, per_layer("full")) if activation_offload and ac != "none" else 0
    activations = tokens * (s.L * per_layer(ac) + extra) + loss - parked
    host = params + grads + optim if cpu_offload else 0
    dispatch = 2 * tokens * s.top_k * s.h * p if expert_parallel > 1 and s.sparse_layers else 0
    return MemoryPlan(params, grads, optim, grads_live, gathered, gradbuf, activations, host, dispatch, parked)


def parked_bytes(s: ModelShape, tokens: float, block_input: float) -> float:
    """memory_plan's parked: the inputs (`block_input` bytes per token, of `tokens`) of all blocks but the last
    ACTIVATION_OFFLOAD["keep"]. tests/test_activation_offload.py counts what the offload's hooks hold."""
    return tokens * max(s.L - ACTIVATION_OFFLOAD["keep"], 0) * block_input


def loss_bytes(
    s: ModelShape, *, positions: float, p: int, loss_chunk: int, tensor_parallel: int = 1, trained_head: bool = True
) -> float:
    """What the loss of `positions` that produce logits holds at its peak, with p bytes per element of the compute
    dtype (memory_plan's V (p + 12) per position, or in chunks of `loss_chunk`: its formula there).
    The chunked-loss tests measure both on the CPU."""
    if not 0 < loss_chunk < positions:  # loss.py's loss_chunk rule: the logits whole
        return positions * s.V * (p + 12)
    head = s.V * s.h * p if trained_head else 0
    return (loss_chunk * s.V * (4 + (p if p < 4 else 0)) + head) / tensor_parallel + positions * (s.h * p + 16)


def block_gather_bytes(
    s: ModelShape, p: int, sharding: str, float8: str, adapters: int = 0, expert_parallel: int = 1
) -> float:
    """Bytes of one all-gathered block with its `adapters` LoRA parameters: (Pb + Ab) p, or with float8
    tensorwise one byte per linear weight, since FSDP then gathers them in float8 (the norms and biases
    stay in the compute dtype). Under expert parallelism e a block gathers 1/e of its routed experts."""
    if float8 == "tensorwise" and sharding != "no_shard":
        return s.linear_params + (s.Pb - s.linear_params) * p
    if expert_parallel > 1:
        return (s.Pb + adapters - s.routed_params * (expert_parallel - 1) / expert_parallel) * p
    return (s.Pb + adapters) * p


def adapter_params(s: ModelShape, lora_rank: int, lora_targets: str) -> int:
    """Ab, LoRA's parameters per block: r (in + out) per adapted linear layer, so that the planner counts
    exactly what models/lora.py adds (ModelShape.adapter_params reads the block's layers); 0 for rank 0."""
    return s.adapter_params(lora_rank, lora_targets)


def activation_bytes_per_token(
    s: ModelShape, precision: str, ac: str, lora_rank: int = 0, lora_targets: str = LORA["targets"],
    tensor_parallel: int = 1, sequence_parallel: bool = True, context_parallel: int = 1,
) -> float:  # fmt: skip
    """a, the bytes one block keeps for backward per token (a rank holds). Only the model knows what its blocks
    keep, so the formula is its shape's `activation_bytes` (models/llama/shape.py's blocks,
    the hf_causal_lm model's transformers layers); tests/test_plan.py measures it for every model in the
    registry, tests/test_context_parallel.py with context parallelism."""
    kwargs = {"context_parallel": context_parallel} if context_parallel > 1 else {}  # models without it: 1
    return s.activation_bytes(
        4 if precision == "fp32" else 2, ac, lora_rank=lora_rank, lora_targets=lora_targets,
        tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel, **kwargs,
    )  # fmt: skip


def grad_accum(*, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig) -> int:
    """Micro-batches per step on the planned world size, which decide whether gradients live through the
    forward pass (1 when the batch does not split). Tensor- and context-parallel groups share their batches."""
    dp = planned_degrees(parallel=parallel, hardware=hardware).dp
    return max(train.global_batch_size // (train.micro_batch_size * dp), 1)


def lora_of(*, finetune: FinetuneConfig, method: str | None = None) -> dict:
    """memory_plan's LoRA arguments for `finetune`, or for finetune.method = `method` (to compare with full
    fine-tuning): rank 0 is full fine-tuning."""
    lora = (method or finetune.method) == "lora"
    return {"lora_rank": finetune.lora_rank if lora else 0, "lora_targets": finetune.lora_targets}


def sequence_parallel(*, model: ModelConfig, parallel: ParallelConfig) -> bool:
    """Whether tensor parallelism splits the activations between the blocks by sequence: the model's plan
    says so (the built-in decoder's does, transformers' plans do not), and the activations differ."""
    if parallel.tensor_parallel == 1:
        return True  # nothing is split: the formulas agree either way
    plan = model_spec(model.name).tensor_parallel_plan(model)
    return plan is None or plan.sequence_parallel


def plan_for(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, sharding: str | None = None, cpu_offload: bool | None = None, ac: str | None = None,
    zero_optimizer: bool | None = None, method: str | None = None, activation_offload: bool | None = None,
) -> MemoryPlan:  # fmt: skip
    """The memory plan of these settings on the planned hardware; the keywords after `finetune` replace one
    choice, so the planner and the table can price the alternatives."""
    p = parallel
    return memory_plan(
        model_shape(model), seq_len=train.seq_len, micro_batch_size=train.micro_batch_size,
        precision=p.mixed_precision, ac=ac or p.activation_checkpointing, sharding=sharding or p.sharding,
        cpu_offload=p.cpu_offload if cpu_offload is None else cpu_offload,
        gpus_per_node=hardware.gpus_per_node, num_nodes=hardware.num_nodes,
        grad_accum=grad_accum(train=train, parallel=p, hardware=hardware),
        sync_every_microbatch=p.grad_sync_every_microbatch,
        zero_optimizer=p.zero_optimizer if zero_optimizer is None else zero_optimizer,
        prefetch_blocks=p.prefetch_blocks, float8=p.float8, **lora_of(finetune=finetune, method=method),
        tensor_parallel=p.tensor_parallel, sequence_parallel=sequence_parallel(model=model, parallel=p),
        context_parallel=p.context_parallel, expert_parallel=p.expert_parallel, loss_chunk=train.loss_chunk,
        activation_offload=p.activation_offload if activation_offload is None else activation_offload,
    )  # fmt: skip
