"""One typed config tree. Precedence: command line > TOML file > the defaults below.

    torchrun --nproc_per_node 2 -m <package>.train --config configs/debug.toml --train.steps 100

Every field has one line of documentation, which is also its `--help` text. Values are checked
before anything is allocated, in two stages: here, each sub-config's `errors()` says what is wrong
with its own fields and `Config.cross_errors` what two of them cannot be together (`validate`
runs both when the config is loaded); at launch, preflight.py checks the config against the
world size, the devices and the files. A bad value raises UsageError naming the field and the fix.

`[model]` belongs to the model it names: `model.name` picks a module in models/, and the table
is read into that module's own dataclass of hyperparameters (its SPEC.config), so `--help` lists
that model's fields. `--model.name` on the command line picks another model; the fields of the
file's `[model]` table that the other model also has are kept, the rest describe the file's
model and are left out. This module imports the model registry; nothing in models/ imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import io
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

from .models import ModelConfig, ModelSpec, model_spec
from .models.lora import lora_errors
from .presets import DEBUG_RUN, EXPORT_FILE_GB, LLAMA_PRESETS, LORA

# The defaults are the debug run's (configs/debug.toml), from presets.py.
DEBUG = LLAMA_PRESETS["debug"]
DEFAULT_MODEL = "llama"
"""model.name when neither the config file nor the command line names a model."""

EXIT_USAGE = 2
"""Exit code of the rank that reports bad input (argparse's and tyro's code too); see TROUBLESHOOTING.md."""


class UsageError(ValueError):
    """Bad input: config, command line, data path, checkpoint to resume, or a world size the plan refuses.

    The trainer finds these before the process group starts and prints the message once, without
    a traceback (train.refuse). Any other exception is a bug and keeps its traceback.
    """


JOB_WIDE = {"job_wide": True}
"""`logger.warning(..., extra=JOB_WIDE)`: a warning that every rank would give alike (about the config, the
job or a shared file) is printed once per job, by rank 0 (metrics.init_logging). A warning about one
rank's own state goes without it and comes from each rank that has it."""


def reports_errors() -> bool:
    """Whether this process prints a refusal: local rank 0, so each node's log says why; other ranks exit quietly."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def failed(*rules: tuple[bool, str]) -> list[str]:
    """The messages of the (ok, message) rules that do not hold: how each sub-config lists what is wrong with it."""
    return [message for ok, message in rules if not ok]


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
    """Data-parallel ranks per shard group for hybrid; 0 uses one node's (LOCAL_WORLD_SIZE / tensor_parallel)."""
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
    source: Literal["synthetic", "memmap", "sft", "synthetic_images", "image_folder"] = "synthetic"
    """synthetic (learnable tokens), memmap (a token file), sft (chats), synthetic_images, image_folder (<class>/*)."""
    path: str = ""
    """memmap, sft: the token file (`python -m <package>.data prepare` writes it and sft's mask); image_folder: root."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """memmap, sft: token dtype of the file (uint16 for vocabularies up to 65536)."""
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
            (
                self.source not in ("memmap", "sft", "image_folder") or bool(self.path),
                f"data.source={self.source} needs data.path",
            ),
            # sft's loss divides by the step's scored targets over all ranks: one all-reduce that a rank
            # whose data ran out could not join.
            (
                self.shard_by != "rank" or self.source == "memmap",
                f"data.shard_by=rank needs data.source=memmap, not {self.source}",
            ),
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


@dataclass
class Config:
    device: Literal["auto", "cuda", "xpu", "cpu"] = "auto"
    """Device to train on; auto takes cuda or xpu when present and falls back to CPU + gloo."""
    run_dir: str = "runs/debug"
    """Directory for checkpoints and metrics of this run."""
    model: ModelConfig = field(default_factory=lambda: model_spec(DEFAULT_MODEL).config())
    """The model and its hyperparameters: `[model]`, read into the dataclass of the model `name` names."""
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)

    def validate(self) -> Config:
        """Raise UsageError listing every value that cannot work, whatever the world size: what each sub-config
        says of itself, then the rules that tie two of them together (cross_errors)."""
        errors = [e for sub in (self.train, self.finetune, self.parallel, self.checkpoint, self.data, self.eval,
                                self.metrics) for e in sub.errors()]  # fmt: skip
        errors += self.cross_errors()
        if errors:
            raise UsageError("invalid config:\n  " + "\n  ".join(errors))
        return self

    def cross_errors(self) -> list[str]:
        """What two sub-configs cannot be together: the model with its data, LoRA and tensor parallelism (each
        asks the model's spec), uneven inputs with the sharding, validation with the data."""
        m, d, p = self.model, self.data, self.parallel
        try:
            spec = model_spec(m.name)
        except ValueError as error:
            return [str(error)]
        errors = m.errors(self.train.seq_len)
        images = d.source in ("synthetic_images", "image_folder")
        if images != (spec.inputs == "images"):
            errors.append(f"data.source={d.source} does not feed model.name={m.name}, which takes {spec.inputs}")
        if not m.errors(self.train.seq_len):  # the shape of a model that cannot be built means nothing
            errors += lora_errors(finetune=self.finetune, shape=spec.shape(m), layout=spec.lora, model_name=m.name,
                                  float8=p.float8, tensor_parallel=p.tensor_parallel)  # fmt: skip
            errors += self.tensor_parallel_errors(spec)
        errors += failed(
            (
                d.uneven_inputs != "join" or p.sharding == "no_shard",
                "data.uneven_inputs=join needs parallel.sharding=no_shard: FSDP modules are not Joinable, only DDP is",
            ),
            (
                not (d.uneven_inputs == "join" and p.zero_optimizer and not d.join_throw),
                "data.uneven_inputs=join with parallel.zero_optimizer needs data.join_throw=true: ZeRO's join hook "
                "steps a finished rank's share of the parameters without gradients, so that share would silently "
                "stop training while the other ranks go on; or use data.uneven_inputs=min",
            ),
        )
        return errors + self.eval_errors()

    def tensor_parallel_errors(self, spec: ModelSpec) -> list[str]:
        """What stops parallel.tensor_parallel from splitting this model (the world size is checked at launch)."""
        degree = self.parallel.tensor_parallel
        if degree <= 1:
            return []
        plan = spec.tensor_parallel_plan(self.model)
        if plan is None:
            return [f"parallel.tensor_parallel={degree} cannot split model.name={self.model.name}: {spec.tp_refusal}; "
                    "set parallel.tensor_parallel=1"]  # fmt: skip
        return plan.check(self.model, degree, self.train.seq_len)

    def eval_errors(self) -> list[str]:
        """What stops validation (eval.*) from working with this data; see data.build_held_out."""
        e, d = self.eval, self.data
        files = d.source in ("memmap", "sft", "image_folder")
        errors = failed(
            (
                not (e.path and not files),
                f"eval.path is for data.source=memmap, sft or image_folder; {d.source} data holds out its own seed: "
                "remove eval.path",
            ),
            (
                not (e.only and self.checkpoint.resume == "never"),
                "--eval-only evaluates a checkpoint: set checkpoint.resume to auto or a checkpoint directory",
            ),
        )
        if files and e.enabled and not e.path:
            errors += failed(
                (
                    e.fraction != 0,
                    "eval.fraction=0 holds nothing of data.path out for validation: set eval.path to held-out "
                    "data, eval.fraction to a share such as 0.05, or eval.interval=0",
                ),
                (
                    not (d.shard_by == "rank" and "{rank}" in d.path),
                    "per-rank data files (data.path with {rank}) need one held-out file for every rank to "
                    "evaluate: set eval.path, or eval.interval=0",
                ),
            )
        return errors


def _from_dict(cls: type, data: dict, where: str):
    """Build dataclass `cls` from a TOML table, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}{key}"
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean '{where}{close[0]}'?" if close else "--help lists every key"
            raise UsageError(f"unknown config key '{name}' ({hint})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise UsageError(f"config key '{name}' must be a table")
            kwargs[key] = _from_dict(hint, value, f"{name}.")
        else:
            kwargs[key] = _check_type(name, hint, value)
    return cls(**kwargs)


def _model_from_table(table: object, chosen: str | None) -> ModelConfig:
    """`[model]` read into the hyperparameters of the model it names, or of `chosen` (--model.name) with the
    table's fields that model also has."""
    if not isinstance(table, dict):
        raise UsageError("config key 'model' must be a table")
    named = table.get("name", DEFAULT_MODEL)
    name = chosen or named
    try:
        cls = model_spec(name).config
    except ValueError as error:
        raise UsageError(str(error)) from None
    if name != named:
        fields = {f.name for f in dataclasses.fields(cls)}
        table = {key: value for key, value in table.items() if key in fields}
    return _from_dict(cls, {**table, "name": name}, "model.")


def _check_type(name: str, hint, value):
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise UsageError(f"config key '{name}' = {value!r} is not one of {list(typing.get_args(hint))}")
        return value
    if origin is tuple:
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise UsageError(f"config key '{name}' = {value!r} should be {hint.__name__}")
    return value


def _quiet_unless_reporting() -> contextlib.AbstractContextManager:
    """Drop this process's output unless it is the rank that reports errors (reports_errors)."""
    stack = contextlib.ExitStack()
    if not reports_errors():
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def load_config(argv: list[str] | None = None) -> Config:
    """Parse `--config FILE` and the overrides that follow it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None, help="TOML file with the run's settings")
    pre.add_argument("--eval-only", action="store_true", help="evaluate a checkpoint once (eval.only)")
    pre.add_argument("--check-only", action="store_true", help="check the inputs and exit (dist.check_only)")
    # Read first: it decides which dataclass [model] and the --model.* flags are read into.
    pre.add_argument("--model.name", dest="model_name", default=None, help=argparse.SUPPRESS)
    args, rest = pre.parse_known_args(argv)
    table = {}
    if args.config is not None:
        if not args.config.is_file():
            raise UsageError(f"--config {args.config}: no such file")
        with args.config.open("rb") as f:
            table = tomllib.load(f)
    model = _model_from_table(table.pop("model", {}), args.model_name)
    base = dataclasses.replace(_from_dict(Config, table, ""), model=model)
    if args.eval_only:
        base = dataclasses.replace(base, eval=dataclasses.replace(base.eval, only=True))
    if args.check_only:
        base = dataclasses.replace(base, dist=dataclasses.replace(base.dist, check_only=True))
    with _quiet_unless_reporting():  # tyro prints its own refusals (and --help), then exits with EXIT_USAGE
        cfg = tyro.cli(
            Config,
            default=base,
            args=rest,
            description="Train with FSDP2. --config FILE loads a TOML file; flags below override it.",
            config=(tyro.conf.FlagConversionOff,),
        )
    return cfg.validate()
