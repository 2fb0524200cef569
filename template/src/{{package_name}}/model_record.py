"""Which model saved weights are of, read from what they record, before any rank loads them.

A checkpoint records its model twice: DCP's `.metadata` holds the name and shape of every tensor,
and COMPLETE.json the [model] table of the run that saved it (checkpoint.recorded_model; checkpoints
saved before it was recorded have none). A checkpoint of another model, or of this one at other
sizes, would otherwise fail inside DCP's load on every rank (a key it lacks, a shape that differs);
here it is refused in one line that names both models, what differs and the fix, from the metadata
alone: no tensor is read. An export, or a Hugging Face model, names its architecture in its
config.json (`model_type`): weights.match_config refuses another architecture's (other_architecture)
before it compares the fields that change what a model of this one computes.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import checkpoint_to_resume, recorded_model
from .config import CheckpointConfig, UsageError
from .models import MODELS, ModelConfig, ModelSpec
from .models.lora import ADAPTERS
from .train_state import CHECKPOINT_KEY

INFORMATIONAL = ("name", "preset")
"""[model] keys that build nothing: a checkpoint of the same model under another preset name is the same model."""


def saved_shapes(path: Path) -> dict[str, list[int]]:
    """Each base-model tensor of the checkpoint at `path` (LoRA's adapters left out) -> its shape: DCP's metadata."""
    prefix = f"{CHECKPOINT_KEY}.model."
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {key.removeprefix(prefix): list(item.size) for key, item in saved.items()
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata) and not _adapter(key)}  # fmt: skip


def model_shapes(spec: ModelSpec, cfg: ModelConfig) -> dict[str, list[int]]:
    """Each tensor of the base model `cfg` describes -> its shape, as a checkpoint of it holds them (built on the meta
    device: nothing is allocated)."""
    with torch.device("meta"):
        model = spec.build(cfg)
    return {key: list(tensor.shape) for key, tensor in model.state_dict().items() if not _adapter(key)}


def _adapter(key: str) -> bool:
    return key.rpartition(".")[2] in ADAPTERS


def checkpoint_refusal(path: Path, *, model: ModelConfig, spec: ModelSpec, where: str, otherwise: str) -> str:
    """Empty if the checkpoint at `path` holds the weights of the model `model` describes (every name and shape);
    else one line: `where` (the setting that named it, the subject of the sentence), both models and what differs,
    then the fix: the [model] flags that build its model where its record says it is this model at other sizes,
    and `otherwise`."""
    theirs, ours = saved_shapes(path), model_shapes(spec, model)
    if theirs == ours:
        return ""
    tensors, record = _tensor_differences(theirs, ours), recorded_model(path)
    this = f"{model.name} (preset {model.preset})"
    if record is not None and record.get("name") != model.name:
        name = record.get("name")
        absent = "" if name in MODELS else f"; this repo has no {name} model"
        return (f"{where} is a checkpoint of a {name} model (preset {record.get('preset')}), and this config builds "
                f"{this}: {tensors}{absent}: {otherwise}")  # fmt: skip
    differs = _field_differences(record, model) if record is not None else None
    if not differs:  # no record (saved before it was kept), or one that tells nothing the tensors do not
        return f"{where} holds other weights than this config's {this}: {tensors}: {otherwise}"
    said = "; ".join(f"{key}: {_flag_value(theirs)} there, {_flag_value(here)} here" for key, theirs, here in differs)
    flags = " ".join(f"--model.{key} {_flag_value(theirs)}" for key, theirs, _ in differs)
    return f"{where} is a checkpoint of {model.name} at other sizes ({said}): set {flags} to build it, or {otherwise}"


def check_resume_model(*, checkpoint: CheckpointConfig, model: ModelConfig, spec: ModelSpec, run_dir: Path) -> None:
    """Refuse, before the process group starts, to resume or evaluate a checkpoint of another model than [model]'s:
    checkpoint.resume's, or with auto the newest complete one in the run directory."""
    path = checkpoint_to_resume(checkpoint=checkpoint, run_dir=run_dir)
    if path is None:
        return
    if checkpoint.resume == "auto":
        where = f"run_dir={run_dir} resumes {path} (checkpoint.resume=auto), which"
        otherwise = "point --run_dir at a run of this model (at a new directory to start afresh)"
    else:
        where = f"checkpoint.resume={checkpoint.resume}"
        otherwise = (f"point --checkpoint.resume at a checkpoint of this config's {model.name} (--checkpoint.resume "
                     "never starts from initial weights)")  # fmt: skip
    problem = checkpoint_refusal(path, model=model, spec=spec, where=where, otherwise=otherwise)
    if problem:
        raise UsageError(problem)


def _tensor_differences(theirs: dict[str, list[int]], ours: dict[str, list[int]]) -> str:
    """What the two sets of tensors differ in, with the first name of each kind."""
    only_theirs, only_ours = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    reshaped = [key for key in sorted(set(theirs) & set(ours)) if theirs[key] != ours[key]]

    def first(names: list[str]) -> str:
        return names[0] + (f" and {len(names) - 1} more are" if len(names) > 1 else " is")

    said = []
    if only_theirs:
        said.append(f"its {first(only_theirs)} not in this model")
    if only_ours:
        said.append(f"this model's {first(only_ours)} not in it")
    if reshaped:
        more = f" ({len(reshaped) - 1} more differ in shape)" if len(reshaped) > 1 else ""
        said.append(f"{reshaped[0]} is {theirs[reshaped[0]]} there, {ours[reshaped[0]]} here{more}")
    return "; ".join(said)


def _field_differences(record: dict, model: ModelConfig) -> list[tuple[str, object, object]] | None:
    """(key, the record's value, this config's) for each [model] key that differs, nested keys dotted
    (rope_scaling.factor); None when the record has a key this model lacks (no setting builds its model)."""
    theirs, ours = _flat(record), _flat(json.loads(json.dumps(dataclasses.asdict(model), default=str)))
    if set(theirs) - set(ours):
        return None
    return [(key, theirs[key], ours[key]) for key in ours
            if key in theirs and key not in INFORMATIONAL and theirs[key] != ours[key]]  # fmt: skip


def _flat(table: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in table.items():
        flat |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return flat


def _flag_value(value: object) -> str:
    """`value` as command-line words: true/false as TOML writes them, numbers as JSON, strings quoted for a shell."""
    if isinstance(value, list):
        return " ".join(_flag_value(item) for item in value)
    if isinstance(value, str):
        return shlex.quote(value)
    return "None" if value is None else json.dumps(value)


def other_architecture(theirs: dict, ours: dict, *, model: str, also: tuple[str, ...] = ()) -> str:
    """Empty if the config.json `theirs` (an export's, a Hugging Face model's) is of the architecture of `ours` (the
    one this config's model exports), or of a model type in `also` (ConfigMath.model_types, whose files the model
    reads); else why its weights are another architecture's. Without a model_type, nothing to compare."""
    kind, own = theirs.get("model_type"), ours.get("model_type")
    if not kind or not own or kind == own or kind in also:
        return ""

    def classes(config: dict) -> str:
        return "".join(f", {name}" for name in config.get("architectures") or ())

    return (
        f"it holds a {kind} model (model_type {kind}{classes(theirs)} in its config.json), another architecture "
        f"than the {model} this config builds (model_type {own}{classes(ours)}): name weights of a {own} model"
    )
