"""Offline converters: a distributed checkpoint into one file, in one process, without a GPU.

    python -m <package>.convert --config configs/debug.toml \
        --checkpoint runs/debug/checkpoints/step_00000040 --to hf --out exported/

`--to safetensors` and `--to hf` write the model weights as weights.py exports them (this repo's
names, or a Hugging Face directory for models with a Hugging Face layout; a LoRA checkpoint's
adapters merged in, given the config it was trained with, and alone in `exported/adapter`, the PEFT
adapter directory an export has beside them). `--to torch` writes
the whole checkpoint, optimizer and all, for any model, as one torch.save file
(`format_utils.dcp_to_torch_save`'s conversion, read weights-only): `exported/checkpoint.pt`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import check_finetune_matches
from .config import FinetuneConfig, load_config
from .models import ModelConfig, build_model, model_spec
from .models.lora import merge_adapters
from .train_state import CHECKPOINT_KEY, WeightsOnlyLoadPlanner
from .weights import ADAPTER_DIR, peft_modules, save, save_adapter


def load_checkpoint(
    path: Path, cfg: ModelConfig, finetune: FinetuneConfig | None = None, merge: bool = True
) -> dict[str, torch.Tensor]:
    """The model weights of a distributed checkpoint, resharded into one process (no process group).

    A LoRA checkpoint (`finetune` with method lora, as it was trained) comes back with its adapters
    merged into plain weights under the base model's names (`merge=False`: as saved, adapters apart).
    """
    with torch.device("cpu"):
        model = build_model(cfg, finetune)
    check_finetune_matches(path, model)
    # In the dtypes they were saved in (LoRA's frozen weights may be bf16), so merging is the run's own.
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = f"{CHECKPOINT_KEY}.model."
    weights = {k: v.to(saved[prefix + k].properties.dtype) for k, v in model.state_dict().items()}
    state = {CHECKPOINT_KEY: {"model": weights}}
    dcp.load(state, checkpoint_id=path, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    weights = state[CHECKPOINT_KEY]["model"]
    if merge and finetune is not None and finetune.method == "lora":
        weights = merge_adapters(weights, finetune.lora_alpha / finetune.lora_rank)
    return weights


def to_torch_save(checkpoint: Path, out: Path) -> Path:
    """The whole checkpoint (model, optimizer, schedule, step, data position, RNG) as one torch.save file.

    The conversion `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` does, for any
    model (no model class is needed), except that non-tensor entries are read weights_only like
    every load here; the format_utils converter unpickles them in full. In one process, no GPU.
    Read the file back with `torch.load(path, weights_only=True)`.
    """
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    state: dict = {}
    for key, item in metadata.state_dict_metadata.items():
        empty = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        _set_path(state, metadata.planner_data[key], empty)
    dcp.load(state, checkpoint_id=checkpoint, planner=WeightsOnlyLoadPlanner(), no_dist=True)  # fills it in place
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return out


def _set_path(root: dict, path: tuple, value) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (or lists, for integer steps) on the way."""
    node = root
    for step, following in zip(path[:-1], path[1:], strict=True):
        if isinstance(node, list):
            node.extend([None] * (step + 1 - len(node)))
        if (node[step] if isinstance(node, list) else node.get(step)) is None:
            node[step] = [] if isinstance(following, int) else {}
        node = node[step]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a distributed checkpoint into one file.", add_help=False)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory (step_XXXXXXXX)")
    parser.add_argument("--to", choices=["safetensors", "hf", "torch"], default="hf")
    parser.add_argument("--out", type=Path, required=True)
    args, rest = parser.parse_known_args(argv)
    if args.to == "torch":
        written = to_torch_save(args.checkpoint, args.out / "checkpoint.pt")
    else:
        cfg = load_config(rest)
        written = save(load_checkpoint(args.checkpoint, cfg.model, cfg.finetune), cfg.model, args.out, args.to)
        spec = model_spec(cfg.model.name)
        if cfg.finetune.method == "lora" and spec.hf:  # as weights.export_weights does
            adapters = load_checkpoint(args.checkpoint, cfg.model, cfg.finetune, merge=False)
            adapter = save_adapter(adapters, finetune=cfg.finetune, init_from=cfg.checkpoint.init_from,
                                   out=args.out / ADAPTER_DIR, modules=peft_modules(spec, cfg.model))  # fmt: skip
            if adapter is not None:
                print(f"wrote {written}")
                written = adapter
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
