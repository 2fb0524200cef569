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
import contextlib
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import check_finetune_matches, verify
from .config import EXIT_USAGE, FinetuneConfig, UsageError, load_config
from .model_record import checkpoint_refusal
from .models import ModelConfig, build_model, model_spec
from .models.lora import merge_adapters
from .train_state import CHECKPOINT_KEY, WeightsOnlyLoadPlanner
from .weights import ADAPTER_DIR, peft_modules, save, save_adapter


@contextlib.contextmanager
def _in_one_process():
    """DCP warns that it reads without a process group: reading in one process is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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
    with _in_one_process():
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
    with _in_one_process():
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {__package__}.convert",
        description="Convert a distributed checkpoint into one file, in one process, without a GPU.",
        epilog=f"Every other flag is the training config's (--config FILE, --model.*, --finetune.*): the config the "
        f"checkpoint was trained with builds the model its weights are loaded into. `python -m {__package__}.train "
        "--help` lists them.",
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory (step_XXXXXXXX)")
    p.add_argument("--to", choices=["safetensors", "hf", "torch"], default="hf", help="the format written (hf)")
    p.add_argument("--out", type=Path, required=True, help="the directory written to")
    return p


def convert(argv: list[str] | None = None) -> Path:
    """Parse the command line, check the checkpoint against the config's model, write the file; what it wrote."""
    args, rest = parser().parse_known_args(argv)
    path = args.checkpoint
    if problem := verify(path):
        raise UsageError(f"--checkpoint {path}: not a complete checkpoint ({problem}); name a step_* that finished")
    if args.to == "torch":
        return to_torch_save(path, args.out / "checkpoint.pt")
    cfg = load_config(rest)
    spec = model_spec(cfg.model.name)
    otherwise = "pass the --config (and [model] flags) it was trained with"
    if problem := checkpoint_refusal(
        path, model=cfg.model, spec=spec, where=f"--checkpoint {path}", otherwise=otherwise
    ):
        raise UsageError(problem)
    written = save(load_checkpoint(path, cfg.model, cfg.finetune), cfg.model, args.out, args.to)
    if cfg.finetune.method == "lora" and spec.hf:  # as weights.export_weights does
        adapters = load_checkpoint(path, cfg.model, cfg.finetune, merge=False)
        adapter = save_adapter(adapters, finetune=cfg.finetune, init_from=cfg.checkpoint.init_from,
                               out=args.out / ADAPTER_DIR, modules=peft_modules(spec, cfg.model))  # fmt: skip
        if adapter is not None:
            print(f"wrote {written}")
            written = adapter
    return written


def main(argv: list[str] | None = None) -> None:
    """The command line: bad input is one line on stderr and exit code 2 (config.EXIT_USAGE), never a traceback."""
    try:
        written = convert(argv)
    except UsageError as error:
        print(f"{__package__}.convert: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
