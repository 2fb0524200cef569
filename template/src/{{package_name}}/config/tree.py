"""The config tree's root: every section, the model's `[model]`, and the rules that tie two sections together."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..models import ModelConfig, ModelSpec, model_spec
from ..models.lora import lora_errors
from .sections import (
    CheckpointConfig,
    DataConfig,
    DistConfig,
    EvalConfig,
    FinetuneConfig,
    HardwareConfig,
    MetricsConfig,
    ParallelConfig,
    TrainConfig,
)
from .usage import UsageError, failed

DEFAULT_MODEL = "llama"
"""model.name when neither the config file nor the command line names a model."""


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
        """What two sub-configs cannot be together: the model with LoRA, tensor, context and expert parallelism
        and the other parallel settings, and Hugging Face export (each asks the model or its spec), uneven inputs
        with the sharding, validation with resuming. What the data source needs of the rest is its own (data/
        sources/, which config/ does not import): preflight.py checks it at launch (data.check_data)."""
        m, d, p = self.model, self.data, self.parallel
        try:
            spec = model_spec(m.name)
        except ValueError as error:
            return [str(error)]
        errors = m.errors(self.train.seq_len)
        if not m.errors(self.train.seq_len):  # the shape of a model that cannot be built means nothing
            errors += lora_errors(finetune=self.finetune, shape=spec.shape(m), layout=spec.lora, model_name=m.name,
                                  float8=p.float8, tensor_parallel=p.tensor_parallel,
                                  refusal=spec.lora_refusal)  # fmt: skip
            errors += self.tensor_parallel_errors(spec)
            errors += self.context_parallel_errors(spec)
            errors += m.parallel_errors(p)
            if self.checkpoint.export == "hf" and spec.hf is not None:
                errors += spec.hf.errors(m)
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

    def context_parallel_errors(self, spec: ModelSpec) -> list[str]:
        """What stops parallel.context_parallel from splitting this model's sequences (context_parallel.py; the
        world size and the nodes are checked at launch)."""
        degree, tp, seq_len = self.parallel.context_parallel, self.parallel.tensor_parallel, self.train.seq_len
        if degree <= 1:
            return []
        if spec.cp_plan is None:
            return [f"parallel.context_parallel={degree} cannot split model.name={self.model.name}: {spec.cp_refusal}; "
                    "set parallel.context_parallel=1"]  # fmt: skip
        errors = spec.cp_plan.check(self.model, degree, tp)
        if seq_len % (2 * degree):
            errors.append(
                f"train.seq_len={seq_len} must be divisible by 2 x parallel.context_parallel = {2 * degree}: each rank "
                f"holds two of {2 * degree} equal chunks of every sequence; set train.seq_len to a multiple of "
                f"{2 * degree} (e.g. {seq_len // (2 * degree) * 2 * degree or 2 * degree})"
            )
        elif tp > 1 and seq_len // degree % tp:
            errors.append(
                f"train.seq_len={seq_len} / parallel.context_parallel={degree} = {seq_len // degree} tokens per rank "
                f"must be divisible by parallel.tensor_parallel={tp} (sequence parallelism splits them); set "
                f"train.seq_len to a multiple of {2 * degree * tp // math.gcd(2, tp)}"
            )
        return errors

    def eval_errors(self) -> list[str]:
        """What stops validation (eval.*) from working with the rest; what it needs of the data is the data
        source's (data/held_out.py's held_out_errors)."""
        return failed(
            (
                not (self.eval.only and self.checkpoint.resume == "never"),
                "--eval-only evaluates a checkpoint: set checkpoint.resume to auto or a checkpoint directory",
            ),
        )
