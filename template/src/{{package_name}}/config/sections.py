"""The sections of the config tree, one dataclass each: `[train]`, `[finetune]`, `[parallel]`, `[dist]`,
`[checkpoint]`, `[data]`, `[eval]`, `[metrics]`, `[hardware]` (`[model]` is the model's own, models/).
Every field has a default and one line of documentation, its `--help` text; `errors()` lists what is
wrong with the section's own fields, whatever the rest of the config says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..presets import DEBUG_RUN, EXPORT_FILE_GB, LLAMA_PRESETS, LORA, LOSS_CHUNK
from .usage import failed

# The defaults are the debug run's (configs/debug.toml), from presets.py.
DEBUG = LLAMA_PRESETS["debug"]


Sharding = Literal["full", "shard_grad_op", "hybrid", "no_shard"]
Precision = Literal["bf16", "fp16", "fp32"]


@dataclass
class TrainConfig:
    steps: int = DEBUG_RUN["steps"]
    """Optimizer steps in the whole run; the LR schedule spans them."""
    stop_after_steps: int = 0
    """Stop this job after this many steps (a time-boxed allocation) and save; 0 runs to `steps`."""
    global_batch_size: int = DEBUG_RUN["global_batch_size"]["debug"]
    """Sequences per optimizer step, summed over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = DEBUG_RUN["micro_batch_size"]["debug"]
    """Sequences per rank per forward pass; accumulation makes up the rest of the global batch."""
    seq_len: int = DEBUG["seq_len"]
    """Tokens per sequence."""
    lr: float = DEBUG_RUN["lr"]
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of lr."""
    warmup_steps: int = DEBUG_RUN["warmup_steps"]
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not norms)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    loss_chunk: int = LOSS_CHUNK
    """The loss in chunks of this many positions where a rank's micro-batch has more (loss.py); 0: never."""
    seed: int = 0
    """Seed for weight init and data order; the same seed gives the same run at any world size."""

    def errors(self) -> list[str]:
        return failed(
            (self.steps > 0, f"train.steps={self.steps} must be positive"),
            (
                0 <= self.warmup_steps < self.steps,
                f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps)",
            ),
            (self.lr > 0, f"train.lr={self.lr} must be positive"),
            (self.loss_chunk >= 0, f"train.loss_chunk={self.loss_chunk} must be 0 (whole logits) or positive"),
            (self.micro_batch_size > 0, f"train.micro_batch_size={self.micro_batch_size} must be positive"),
            (
                self.micro_batch_size > 0 and self.global_batch_size % self.micro_batch_size == 0,
                f"train.global_batch_size={self.global_batch_size} must be a multiple of train.micro_batch_size",
            ),
        )


@dataclass
class FinetuneConfig:
    method: Literal["full", "lora"] = "full"
    """full trains every weight; lora freezes them and trains low-rank adapters in the blocks (models/lora.py)."""
    lora_rank: int = LORA["rank"]
    """lora: rank r of each adapter (A is r x in, B is out x r): r (in + out) trained parameters per layer."""
    lora_alpha: float = LORA["alpha"]
    """lora: the adapters' output is scaled by lora_alpha / lora_rank."""
    lora_targets: Literal["all", "attention", "mlp"] = LORA["targets"]
    """lora: the blocks' linear layers that get adapters: all, attention (q, k, v, o) or mlp (feed-forward)."""

    def errors(self) -> list[str]:
        """What LoRA's settings alone rule out; models/lora.py's lora_errors checks them against the model."""
        return failed(
            (
                self.method != "lora" or self.lora_alpha > 0,
                f"finetune.lora_alpha={self.lora_alpha} must be positive (adapters are scaled by alpha / rank)",
            ),
        )


@dataclass
class ParallelConfig:
    sharding: Sharding = "full"
    """full (ZeRO-3), shard_grad_op (ZeRO-2), hybrid (HSDP: shard in a node, replicate across), no_shard (DDP)."""
    hsdp_shard_size: int = 0
    """Data-parallel ranks per shard group for hybrid; 0: one node's (LOCAL_WORLD_SIZE / tensor / context_parallel)."""
    reshard_size: int = 0
    """After forward, keep blocks gathered over groups of this many ranks (ZeRO++ hpZ); 0 follows sharding."""
    prefetch_blocks: int = 0
    """All-gather this many blocks ahead, issued explicitly (behind, in backward); 0 keeps FSDP's implicit one."""
    mixed_precision: Precision = "fp32"
    """Compute dtype of the unsharded parameters; gradients are reduced and kept in fp32."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy)."""
    zero_optimizer: bool = False
    """no_shard only: split AdamW's state across ranks with ZeroRedundancyOptimizer (ZeRO-1)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (keep matmul/attention outputs), full (keep block inputs)."""
    activation_offload: bool = False
    """Park the block inputs that checkpointing keeps in pinned host memory until backward (activation_offload.py)."""
    grad_sync_every_microbatch: bool = False
    """Reduce gradients after every micro-batch (more traffic, but they stay sharded) instead of only the last."""
    compile: bool = False
    """torch.compile each block (after activation checkpointing, before sharding)."""
    compile_backend: str = "inductor"
    """torch.compile backend; aot_eager checks graph capture without code generation."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """torchao float8 matmuls in the blocks' linear layers (sm 8.9+): one scale per tensor, or per row."""
    tensor_parallel: int = 1
    """Ranks of one node that split every layer (tensor + sequence parallelism); FSDP shards across the groups."""
    context_parallel: int = 1
    """Ranks of one node that split every sequence (Ulysses attention over them); FSDP shards over them too."""
    expert_parallel: int = 1
    """Ranks that split a mixture of experts' experts (tokens reach them by all-to-all); FSDP shards each further."""

    def errors(self) -> list[str]:
        sharded = self.sharding != "no_shard"
        return failed(
            (
                not (self.cpu_offload and not sharded),
                "parallel.cpu_offload needs a sharded mode: no_shard (DDP) keeps everything on the device",
            ),
            (
                self.float8 == "none" or self.mixed_precision == "bf16",
                f"parallel.float8={self.float8} computes in float8 with bf16 outputs: set "
                f"parallel.mixed_precision=bf16 (not {self.mixed_precision}), or parallel.float8=none",
            ),
            (
                not (self.zero_optimizer and sharded),
                f"parallel.zero_optimizer needs parallel.sharding=no_shard: sharding={self.sharding} already splits "
                "the optimizer state",
            ),
            (
                not (self.activation_offload and self.activation_checkpointing == "none"),
                "parallel.activation_offload parks the block inputs activation checkpointing keeps, and "
                "parallel.activation_checkpointing=none keeps none: set it to full or selective",
            ),
            (self.prefetch_blocks >= 0, f"parallel.prefetch_blocks={self.prefetch_blocks} must be 0 or more"),
            (
                self.prefetch_blocks == 0 or sharded,
                "parallel.prefetch_blocks needs a sharded mode: no_shard (DDP) gathers no parameters",
            ),
            (
                self.tensor_parallel >= 1,
                f"parallel.tensor_parallel={self.tensor_parallel} must be at least 1 (1: no tensor parallelism)",
            ),
            (
                self.tensor_parallel <= 1 or sharded,
                f"parallel.tensor_parallel={self.tensor_parallel} needs FSDP across the tensor-parallel groups: "
                "sharding=no_shard (DDP) is not combined with it; choose sharding=full, shard_grad_op or hybrid",
            ),
            (
                self.context_parallel >= 1,
                f"parallel.context_parallel={self.context_parallel} must be at least 1 (1: no context parallelism)",
            ),
            (
                self.context_parallel <= 1 or sharded,
                f"parallel.context_parallel={self.context_parallel} needs FSDP, which shards the parameters over the "
                "context-parallel ranks too: sharding=no_shard (DDP) is not combined with it; choose sharding=full, "
                "shard_grad_op or hybrid",
            ),
            (
                self.expert_parallel >= 1,
                f"parallel.expert_parallel={self.expert_parallel} must be at least 1 (1: each rank holds every expert)",
            ),
            (
                self.expert_parallel <= 1 or sharded,
                f"parallel.expert_parallel={self.expert_parallel} needs FSDP to shard each expert over the other "
                "ranks: sharding=no_shard (DDP) is not combined with it; choose sharding=full, shard_grad_op or hybrid",
            ),
            (
                self.expert_parallel <= 1 or self.tensor_parallel <= 1,
                f"parallel.expert_parallel={self.expert_parallel} with parallel.tensor_parallel="
                f"{self.tensor_parallel}: no model here has both a tensor-parallel plan and experts; set one to 1",
            ),
            (
                self.expert_parallel <= 1 or not self.reshard_size,
                f"parallel.reshard_size={self.reshard_size} with parallel.expert_parallel={self.expert_parallel}: "
                "experts are sharded over a smaller group than the other weights; set parallel.reshard_size=0",
            ),
        )


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "xccl", "gloo", "mpi"] = "auto"
    """Process-group backend for the device; auto picks nccl/xccl/gloo from it."""
    init_method: str = "env://"
    """Rendezvous: env:// (torchrun), tcp://host:port or file:///shared/path."""
    init_timeout_s: int = 600
    """Collective timeout until the first step has finished (covers init, compile, first load)."""
    train_timeout_s: int = 300
    """Collective timeout after the first step; a hung rank is reported after this long."""
    check_only: bool = False
    """Check the config, data and checkpoints for WORLD_SIZE ranks, then exit (the --check-only flag)."""


@dataclass
class CheckpointConfig:
    format: Literal["dcp", "dcp_async"] = "dcp"
    """dcp saves synchronously; dcp_async stages to host memory and writes in the background."""
    interval: int = DEBUG_RUN["checkpoint_interval"]
    """Save every N steps (and at the end of the run or job)."""
    keep_last: int = 2
    """Complete checkpoints to keep; older ones are deleted only after a newer one is complete."""
    resume: str = "auto"
    """auto (newest complete checkpoint in the run dir), never, or a checkpoint directory."""
    export: Literal["none", "safetensors", "hf"] = "none"
    """At the end of the run write the weights to <run_dir>/export: safetensors, or a Hugging Face directory."""
    export_file_gb: float = EXPORT_FILE_GB
    """Largest export file in GB; a bigger model is split into model-0000x-of-0000y.safetensors with an index."""
    init_from: str = ""
    """Start from these weights (a directory of safetensors files, ours or Hugging Face's) instead of a random init."""

    def errors(self) -> list[str]:
        return failed(
            (self.interval > 0, f"checkpoint.interval={self.interval} must be positive"),
            (self.export_file_gb > 0, f"checkpoint.export_file_gb={self.export_file_gb} must be positive"),
            (self.keep_last >= 1, f"checkpoint.keep_last={self.keep_last} must be at least 1"),
        )


@dataclass
class DataConfig:
    source: str = "synthetic"
    """A source in data/sources/ (SOURCES): synthetic (learnable tokens), memmap (a token file), sft (chats), ..."""
    path: str = ""
    """memmap, sft: the token file (`python -m <package>.data prepare` writes it and sft's mask); image_folder: root."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """memmap, sft: token dtype of the file (uint16 for vocabularies up to 65536)."""
    tokenizer: str = ""
    """memmap, sft: the local tokenizer `data prepare` used (--tokenizer); generate.py reads and writes text with it."""
    shard_by: Literal["global", "rank"] = "global"
    """global: every rank slices the same global batches; rank: each rank reads its own contiguous part."""
    uneven_inputs: Literal["min", "join"] = "min"
    """shard_by=rank: min stops every rank at the shortest part; join (DDP only) lets finished ranks shadow."""
    join_throw: bool = False
    """uneven_inputs=join: raise on every rank as soon as one runs out (Join's throw_on_early_termination)."""
    synthetic_branching: int = 2
    """Successors per token in the synthetic chain; the loss floor is ln(branching)."""
    workers: int = 0
    """Processes per rank that build batches ahead of the step (a DataLoader); 0: a thread of the training process."""
    prefetch: int = 2
    """Steps of batches built ahead (per worker with workers > 0); 0 with workers = 0: each step builds its own."""
    pin_memory: bool = True
    """On a GPU, build batches in page-locked memory so that their copy to the device overlaps the step."""

    def errors(self) -> list[str]:
        least_prefetch = 1 if self.workers else 0
        per_worker = f" with data.workers={self.workers}: each worker builds at least one step ahead"
        return failed(
            (self.synthetic_branching >= 1, "data.synthetic_branching must be at least 1"),
            (self.workers >= 0, f"data.workers={self.workers} must be 0 (a thread builds the batches) or more"),
            (
                self.prefetch >= least_prefetch,
                f"data.prefetch={self.prefetch} must be at least {least_prefetch}"
                + (per_worker if self.workers else ""),
            ),
        )


@dataclass
class EvalConfig:
    interval: int = 100
    """Evaluate on held-out data every N steps and at the end of the run; 0 turns validation off."""
    batches: int = 10
    """Global batches per evaluation: the same held-out batches every time, at any world size."""
    path: str = ""
    """memmap, sft: a held-out token file (`data prepare` writes val.bin); image_folder: a <class>/<image> tree."""
    fraction: float = 0.05
    """Without eval.path: the share of data.path (its tail) held out for validation and never trained on."""
    only: bool = False
    """Evaluate the checkpoint that checkpoint.resume finds once and exit, writing nothing (the --eval-only flag)."""

    @property
    def enabled(self) -> bool:
        return self.interval > 0 or self.only

    def errors(self) -> list[str]:
        return failed(
            (self.interval >= 0, f"eval.interval={self.interval} must be 0 (no validation) or a number of steps"),
            (self.batches >= 1, f"eval.batches={self.batches} must be at least 1"),
            (
                0 <= self.fraction < 1,
                f"eval.fraction={self.fraction} must be in [0, 1): the share of data.path held out",
            ),
        )


@dataclass
class MetricsConfig:
    log_every: int = 1
    """Log loss, grad norm, throughput, MFU and memory every N steps (rank 0)."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 looks the device up by name."""
    backend: Literal["none", "tensorboard", "wandb"] = "none"
    """Also send metrics to TensorBoard (<run_dir>/tensorboard) or Weights & Biases (key from WANDB_API_KEY)."""
    wandb_project: str = ""
    """Weights & Biases project; empty uses the run directory's name."""
    profile_steps: str = ""
    """Profile a window of steps with torch.profiler, e.g. "10-12"; traces go to <run_dir>/profile."""

    def errors(self) -> list[str]:
        window = self.profile_steps.split("-")
        return failed(
            (self.log_every > 0, f"metrics.log_every={self.log_every} must be positive"),
            (
                not self.profile_steps or (len(window) == 2 and all(w.isdigit() for w in window)),
                f"metrics.profile_steps={self.profile_steps!r} must look like 10-12 (first and last step)",
            ),
        )


@dataclass
class HardwareConfig:
    accelerator: Literal["cuda", "xpu", "cpu"] = "cpu"
    """Device kind the repo was generated for."""
    gpu_arch: str = ""
    """CUDA generation (hopper, ampere, ...) the plan assumed; empty for XPU and CPU."""
    gpus_per_node: int = 2
    """Ranks per node in the plan."""
    num_nodes: int = 1
    """Nodes in the plan."""
    gpu_memory_gb: float = 0.0
    """Memory of one device in GiB (0 for CPU)."""
    host_memory_gb: float = 0.0
    """RAM of one node in GiB the plan was made for; 0 leaves host memory out of the plan."""
    intra_node_link: Literal["", "nvlink", "pcie"] = ""
    """Link between the devices of a node; sets the communication estimates of the plan."""
    inter_node_link: Literal["", "infiniband", "ethernet"] = ""
    """Link between nodes; sets the communication estimates of the plan."""
    enforce: bool = False
    """Refuse to start when the live world size, device or host memory contradicts the plan."""
