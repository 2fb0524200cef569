"""Full (unsharded) model weights: the initial ones, imported ones, and exported ones.

Exports are consolidated safetensors files: `safetensors` keeps this repo's parameter names,
`hf` writes a Hugging Face directory (config.json + model.safetensors) that
`transformers.AutoModelForCausalLM.from_pretrained` loads, for models whose spec has a Hugging
Face layout (models/spec.py). Nothing here knows a model by name: names, tied weights and
config.json all come from the model and its spec. Converting a distributed checkpoint offline:
convert.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .config import Config, ModelConfig
from .models import build_model, model_spec

logger = logging.getLogger(__name__)


def shared_keys(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that alias an earlier one (a tied output head -> its embedding)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def save(state: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, fmt: str) -> Path:
    """Write `state` (this repo's names) as `fmt` (safetensors or hf) into directory `out`."""
    spec = model_spec(cfg.name)
    if fmt == "hf" and spec.hf is None:
        raise ValueError(f"checkpoint.export=hf: model.name={cfg.name} has no Hugging Face layout; export safetensors")
    out.mkdir(parents=True, exist_ok=True)
    # A tied weight is stored once (safetensors refuses shared tensors) and re-tied on load.
    aliases = shared_keys(build_model_on_meta(cfg))
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in aliases}
    if fmt == "hf":
        tensors = {spec.hf.to_hf(k): v for k, v in tensors.items()}
        (out / "config.json").write_text(spec.hf.config_json(cfg))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt", "layout": fmt})
    return out / "model.safetensors"


def load(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A full state dict (this repo's names) from a safetensors file or a Hugging Face directory."""
    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"checkpoint.init_from={path}: no model.safetensors there")
    tensors = load_file(file)  # safetensors holds tensors only: nothing in it can run code
    model, spec = build_model_on_meta(cfg), model_spec(cfg.name)
    expected = set(model.state_dict())
    if spec.hf is not None and not set(tensors) <= expected:  # Hugging Face names
        tensors = {_from_hf(spec.hf.from_hf, k): v for k, v in tensors.items()}
    for alias, source in shared_keys(model).items():
        if source in tensors:
            tensors[alias] = tensors[source]
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"{file} does not fit model {cfg.preset}: missing {missing[:5]}, unexpected {extra[:5]}")
    return tensors


def _from_hf(rename, name: str) -> str:
    try:
        return rename(name)
    except ValueError:
        return name  # no counterpart here: reported as unexpected


def build_model_on_meta(cfg: ModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(cfg)


def initial_state(cfg: Config) -> dict[str, torch.Tensor]:
    """Rank 0's full initial weights: imported from checkpoint.init_from, else a seeded random init."""
    if cfg.checkpoint.init_from:
        return load(Path(cfg.checkpoint.init_from), cfg.model)
    with torch.device("cpu"):
        reference = build_model(cfg.model)
    reference.init_weights(torch.Generator().manual_seed(cfg.train.seed))
    return reference.state_dict()


def export_weights(model: torch.nn.Module, cfg: Config, out: Path, is_main: bool) -> None:
    """Gather the full weights (a collective: every rank calls this) and write them on rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full copy on rank 0's host only
    state = get_model_state_dict(model, options=options)
    if is_main:
        written = save(state, cfg.model, out, cfg.checkpoint.export)
        logger.info("exported %s weights to %s", cfg.checkpoint.export, written)
