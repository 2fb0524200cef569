"""Full (unsharded) model weights: the initial ones, imported ones, and exported ones.

Exports are consolidated safetensors files: `safetensors` keeps this repo's parameter names,
`hf` writes a Hugging Face Llama directory (config.json + model.safetensors) that
`transformers.AutoModelForCausalLM.from_pretrained` loads. A distributed checkpoint converts
offline, in one process, without a GPU:

    python -m <package>.weights --config configs/debug.toml --checkpoint runs/debug/checkpoints/step_00000040 \
        --to hf --out exported/

`--to torch` writes the whole checkpoint, optimizer and all, for any model, as one torch.save file
(`format_utils.dcp_to_torch_save`'s conversion, read weights-only): `exported/checkpoint.pt`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .checkpoint import CHECKPOINT_KEY, WeightsOnlyLoadPlanner, to_torch_save
from .config import Config, ModelConfig, load_config
from .models import build_model

logger = logging.getLogger(__name__)

# This repo's parameter names beside Hugging Face LlamaForCausalLM's ({i}: a layer, {x}: q, k, v
# or o). Both use the rotate-half rotary layout, so weights need renaming only, never permuting.
_HF_NAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.w{x}.weight", "model.layers.{i}.self_attn.{x}_proj.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]
_FIELDS = {r"\{i\}": r"(?P<i>\d+)", r"\{x\}": r"(?P<x>[qkvo])"}


def _rename(name: str, *, to_hf: bool) -> str:
    for ours, theirs in _HF_NAMES:
        source, target = (ours, theirs) if to_hf else (theirs, ours)
        pattern = re.escape(source)
        for field, group in _FIELDS.items():
            pattern = pattern.replace(field, group)
        if match := re.fullmatch(pattern, name):
            return target.format(**match.groupdict())
    raise ValueError(f"no Hugging Face name for parameter {name!r}")


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for transformers' LlamaForCausalLM with this model's shapes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def _tied_key(cfg: ModelConfig) -> str | None:
    """The state-dict key of a tied output head (stored once, restored on load), if any."""
    if not cfg.tie_embeddings or cfg.name == "vit":
        return None
    return "hf.lm_head.weight" if cfg.name == "hf_causal_lm" else "output.weight" if cfg.name == "llama" else None


def save(state: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, fmt: str) -> Path:
    """Write `state` (this repo's names) as `fmt` (safetensors or hf) into directory `out`."""
    out.mkdir(parents=True, exist_ok=True)
    # A tied output head is the embedding: store it once (safetensors refuses shared tensors).
    tied = _tied_key(cfg)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if k != tied}
    if fmt == "hf":
        if cfg.name == "llama":
            tensors = {_rename(k, to_hf=True): v for k, v in tensors.items()}
            (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
        elif cfg.name == "hf_causal_lm":
            tensors = {k.removeprefix("hf."): v for k, v in tensors.items()}
            (out / "config.json").write_text(build_model_on_meta(cfg).hf.config.to_json_string())
        else:
            raise ValueError(f"checkpoint.export=hf needs model.name llama or hf_causal_lm, not {cfg.name}")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt", "layout": fmt})
    return out / "model.safetensors"


def load(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A full state dict (this repo's names) from a safetensors file or a Hugging Face directory."""
    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"checkpoint.init_from={path}: no model.safetensors there")
    tensors = load_file(file)  # safetensors holds tensors only: nothing in it can run code
    if cfg.name == "hf_causal_lm" and not any(k.startswith("hf.") for k in tensors):
        tensors = {f"hf.{k}": v for k, v in tensors.items()}
    elif cfg.name == "llama" and any(k.startswith("model.") for k in tensors):
        tensors = {_rename(k, to_hf=False): v for k, v in tensors.items()}
    tied = _tied_key(cfg)
    if tied:
        embed = "hf.model.embed_tokens.weight" if cfg.name == "hf_causal_lm" else "tok_embeddings.weight"
        tensors[tied] = tensors[embed]
    expected = set(build_model_on_meta(cfg).state_dict())
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"{file} does not fit model {cfg.preset}: missing {missing[:5]}, unexpected {extra[:5]}")
    return tensors


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


def load_checkpoint(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model weights of a distributed checkpoint, resharded into one process (no process group)."""
    with torch.device("cpu"):
        model = build_model(cfg)
    state = {CHECKPOINT_KEY: {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=path, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return state[CHECKPOINT_KEY]["model"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a distributed checkpoint's weights.", add_help=False)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory (step_XXXXXXXX)")
    parser.add_argument("--to", choices=["safetensors", "hf", "torch"], default="hf")
    parser.add_argument("--out", type=Path, required=True)
    args, rest = parser.parse_known_args(argv)
    if args.to == "torch":
        written = to_torch_save(args.checkpoint, args.out / "checkpoint.pt")
    else:
        cfg = load_config(rest)
        written = save(load_checkpoint(args.checkpoint, cfg.model), cfg.model, args.out, args.to)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
