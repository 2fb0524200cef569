"""LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685): trainable low-rank adapters beside frozen weights.

`apply_lora` swaps the blocks' linear layers (those `finetune.lora_targets` names) for LoRALinear,
which keeps the frozen weight and bias under their old names and adds two trainable matrices,
lora_a (rank x in) and lora_b (out x rank): y = x W^T + b + (lora_alpha / lora_rank) x A^T B^T.
B starts at zero, so the adapted model computes exactly what the base model does until the first
step; every other parameter (embeddings, norms, head) is frozen too. It runs on the meta device
before activation checkpointing, compile and sharding, so those see the adapted layers, and FSDP
keeps each block's frozen and trainable parameters in one group (it reduces only the gradients
that exist). `merge_adapters` folds the adapters into plain weights, W + (alpha / rank) B A, for
exports; `peft_adapter` gives the adapters alone as a PEFT LoRA adapter, for the export beside them.
With bf16 or fp16 compute, `apply_lora(..., frozen_dtype=)` stores the frozen weights in that dtype:
only the adapters need fp32 master weights.

LoRA is this one module: the build calls `apply_lora` once (a no-op for finetune.method=full), and
the config's validation (config/tree.py) calls `lora_errors`, so the limits are checked beside the
code that has them.
Plain torch: nothing here imports torch.distributed (sharded tensors merge through their own
operators) or config/.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .spec import LoraLayout, ModelShape

ADAPTERS = ("lora_a", "lora_b")
"""The parameter names LoRALinear adds; everything else in an adapted model is frozen."""
PEFT_NAMES = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}
"""PEFT's names for A and B, after the module's: the same shapes (r x in, out x r) and the same scale, alpha / r."""


class LoraSettings(Protocol):
    """The `[finetune]` settings LoRA reads: the config's FinetuneConfig (config/ imports the models)."""

    method: str
    lora_rank: int
    lora_alpha: float
    lora_targets: str


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-r update, scaled by alpha / r."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scale = alpha / rank
        # The base layer's own parameters, under the same names: pretrained weights, checkpoints
        # and exports address them exactly as without adapters.
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_a.shape[0]}, scale={self.scale:g}"


@torch.no_grad()
def init_adapter(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """A as nn.Linear initialises its weight (Kaiming-uniform), B = 0: the update starts at zero."""
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    nn.init.zeros_(b)


def targeted(name: str, targets: str, layout: LoraLayout) -> bool:
    """Whether the linear layer at `name` (relative to its block) gets an adapter under `targets`."""
    if targets == "all":
        return True
    prefix = layout.attention if targets == "attention" else layout.mlp
    return name.startswith(prefix + ".")


def apply_lora(
    model: nn.Module, *, finetune: LoraSettings, layout: LoraLayout | None, frozen_dtype: torch.dtype | None = None
) -> None:
    """Freeze every parameter, give the targeted linear layers of each block a trainable adapter, and
    store the frozen parameters in `frozen_dtype` (None: as built).

    A no-op for finetune.method=full. The adapters are left uninitialised (on the meta device there
    is nothing to initialise): initial_adapters' values, or a checkpoint, fill them. The trainer
    passes its compute dtype as `frozen_dtype`; a model built only for its names and shapes, or to
    load a checkpoint in the dtypes it was saved in, passes none.
    """
    if finetune.method != "lora":
        return
    if layout is None:
        raise ValueError("this model declares no LoRA layout (ModelSpec.lora): use finetune.method=full")
    model.requires_grad_(False)
    for block in model.layers:
        swaps = [(name, module) for name, module in block.named_modules() if isinstance(module, nn.Linear)]
        for name, module in swaps:
            if targeted(name, finetune.lora_targets, layout):
                parent, _, child = name.rpartition(".")
                adapted = LoRALinear(module, finetune.lora_rank, finetune.lora_alpha)
                block.get_submodule(parent).register_module(child, adapted)
    if frozen_dtype is not None:
        _store_frozen(model, frozen_dtype)


def lora_errors(
    *,
    finetune: LoraSettings,
    shape: ModelShape,
    layout: LoraLayout | None,
    model_name: str,
    float8: str,
    tensor_parallel: int,
    refusal: str = "",
) -> list[str]:
    """What stops finetune.method=lora with this model (its `shape` and `layout`; `refusal`: why it has no layout)
    and these settings; empty for finetune.method=full. The config's validation reports them with the rest."""
    f = finetune
    if f.method != "lora":
        return []
    if layout is None and refusal:
        return [
            f"finetune.method=lora: model.name={model_name} has no LoRA layout: {refusal}; use finetune.method=full"
        ]
    if layout is None:
        return [
            f"finetune.method=lora: model.name={model_name} declares no LoRA layout (ModelSpec.lora in "
            "models/spec.py says where a block's adapters go; the llama and hf_causal_lm models have one): "
            "use finetune.method=full, or add one"
        ]
    errors = []
    adapted = shape.adapted(f.lora_targets)
    narrowest = min((min(layer.inputs, layer.outputs) for layer in adapted), default=0)
    if not 1 <= f.lora_rank <= narrowest:
        errors.append(
            f"finetune.lora_rank={f.lora_rank} must be between 1 and {narrowest}, the width of the narrowest "
            f"layer it adapts (lora_targets={f.lora_targets}): a rank beyond that adds parameters, not capacity"
        )
    if float8 != "none":
        errors.append(
            f"finetune.method=lora with parallel.float8={float8}: float8 would replace the adapted "
            "linear layers and drop their adapters; set parallel.float8=none"
        )
    if tensor_parallel > 1:
        errors.append(
            f"finetune.method=lora with parallel.tensor_parallel={tensor_parallel}: the adapters "
            "are not split across a tensor-parallel group; set parallel.tensor_parallel=1 or finetune.method=full"
        )
    return errors


def _store_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen parameters in `dtype`, the compute dtype their forward casts them to anyway.

    Trained parameters stay as they are (fp32: the optimizer steps on them). A frozen weight needs
    no fp32 master copy, so in bf16 it takes half the memory, checkpoint and export bytes. Tied
    weights stay tied (one new parameter per old one).
    """
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.requires_grad and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                setattr(module, name, cast[id(param)])


def adapters(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """The model's LoRA layers by name, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoRALinear)]


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' initial values by state-dict name, on the CPU: the same for a seed at any world size.

    `model` may be on the meta device (only the names and shapes are read). The draws come from a
    generator of their own, seed + 1, so they do not repeat the base weights' draws from `seed`.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    state = {}
    for name, layer in adapters(model):
        a, b = torch.empty(layer.lora_a.shape), torch.empty(layer.lora_b.shape)
        init_adapter(a, b, generator)
        state |= {f"{name}.lora_a": a, f"{name}.lora_b": b}
    return state


def lora_rank(cfg: LoraSettings) -> int:
    """The adapters' rank, 0 without adapters (finetune.method=full)."""
    return cfg.lora_rank if cfg.method == "lora" else 0


def frozen_matmul_params(model: nn.Module) -> int:
    """Frozen parameters that multiply activations (all but embedding lookups).

    Each costs 2 FLOPs per token fewer than a trained one: it has no weight gradient, while its
    input gradient still flows to the adapters before it.
    """
    head = model.get_output_embeddings()
    embeddings = (m for m in model.modules() if isinstance(m, nn.Embedding))
    lookups = {id(m.weight) for m in embeddings if head is None or m.weight is not head.weight}
    return sum(p.numel() for p in model.parameters() if not p.requires_grad and id(p) not in lookups)


def merge_adapters(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """`state` with every adapter folded into its weight, W + scale * B @ A, and the adapter entries dropped.

    Works shard by shard on sharded tensors: B is split by rows like W, A (rank x in) is small and
    gathered whole, so no rank holds more than its rows of each merged weight.
    """
    merged = {k: v for k, v in state.items() if not k.endswith(tuple(f".{a}" for a in ADAPTERS))}
    for key in state:
        if key.endswith(".lora_a"):
            prefix = key.removesuffix(".lora_a")
            weight, a, b = state[f"{prefix}.weight"], state[key], state[f"{prefix}.lora_b"]
            # In the adapters' fp32; the sum keeps the weight's dtype (frozen weights may be bf16).
            merged[f"{prefix}.weight"] = (weight + scale * (b @ a)).to(weight.dtype)
    return merged


def peft_adapter(
    state: dict[str, torch.Tensor], cfg: LoraSettings, hf_module: Callable[[str], str], base: str | None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapters of `state` as PEFT saves a LoRA adapter: its tensors and adapter_config.json.

    `hf_module` maps a LoRALinear's name here to its transformers module's name (weights.py knows the
    layout); `base` is the base model's directory, for base_model_name_or_path. With them,
    `peft.PeftModel.from_pretrained(base_model, directory)` adds (lora_alpha / r) B A x to each targeted
    layer of the transformers base model, which is what LoRALinear computes.
    """
    tensors, targets = {}, set()
    for key, value in state.items():
        layer, _, name = key.rpartition(".")
        if name in PEFT_NAMES:
            module = hf_module(layer)
            tensors[f"base_model.model.{module}.{PEFT_NAMES[name]}"] = value
            targets.add(module.rpartition(".")[2])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha, "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "inference_mode": True,
    }  # fmt: skip
    return tensors, config
