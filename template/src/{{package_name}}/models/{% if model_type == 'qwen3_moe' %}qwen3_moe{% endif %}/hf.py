"""The state-dict adapter between this model and a Hugging Face Qwen3-MoE checkpoint, and its config.json.

transformers 5 holds a layer's experts fused in memory (`mlp.experts.gate_up_proj` [experts, 2 x
moe_intermediate, hidden] and `mlp.experts.down_proj`), but `save_pretrained` writes, and the hub's
Qwen3-MoE files hold, one tensor per expert and projection: `mlp.experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`. Files are what `checkpoint.init_from` reads and an export writes, so `to_hf`
makes the files' names: each of this model's stacked expert weights (moe.GroupedExperts, [experts,
...]) is split into one view per expert (`unbind`), and `from_hf` stacks them back. Other weights
are renamed only; both sides use the rotate-half rotary layout, so nothing is permuted.

DeepSeek-V3's options have no place in a Qwen3MoeForCausalLM: shared experts and the routing bias
take DeepSeek-V3's names (`mlp.shared_experts.*`, `mlp.gate.e_score_correction_bias`) so a state dict
still maps both ways, but `config_json` refuses to describe such a model (`hf_errors` says why).
"""

from __future__ import annotations

import json
import re

import torch

from ..config_math import LLAMA, LlamaMath
from ..spec import RenameTable, StateDict
from .model import Qwen3MoeConfig

NAMES = RenameTable(
    rows=(
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("layers.{i}.attention.w{x}.weight", "model.layers.{i}.self_attn.{x}_proj.weight"),
        ("layers.{i}.attention.{n}_norm.weight", "model.layers.{i}.self_attn.{n}_norm.weight"),
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
        ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
        ("layers.{i}.moe.router.expert_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
        ("layers.{i}.moe.shared_experts.w1.weight", "model.layers.{i}.mlp.shared_experts.gate_proj.weight"),
        ("layers.{i}.moe.shared_experts.w3.weight", "model.layers.{i}.mlp.shared_experts.up_proj.weight"),
        ("layers.{i}.moe.shared_experts.w2.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ),
    fields=(("i", r"\d+"), ("x", "[qkvo]"), ("n", "[qk]")),
)
"""Every weight but the routed experts': this repo's names beside the checkpoint's ({i}: a layer)."""

PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""GroupedExperts' stacked weights -> the projection each expert's slice is in the files."""
OURS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
THEIRS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def to_hf(state: StateDict, cfg: Qwen3MoeConfig | None = None, first_expert: int = 0) -> StateDict:
    """This model's state dict under the checkpoint files' names, each stacked expert weight split into
    its experts (views of it, so DCP can read a checkpoint into them in place). Under expert parallelism a
    stacked weight holds this rank's experts only, numbered from `first_expert` (SPEC.hf.to_hf_local_experts)."""
    out = {}
    for key, tensor in state.items():
        if match := OURS.fullmatch(key):
            layer, weight = match.groups()
            for e, expert in enumerate(torch.unbind(tensor, 0), start=first_expert):
                out[f"model.layers.{layer}.mlp.experts.{e}.{PROJECTIONS[weight]}.weight"] = expert
        else:
            out[NAMES.rename(key, to_hf=True)] = tensor
    return out


def from_hf(state: StateDict, cfg: Qwen3MoeConfig | None = None) -> StateDict:
    """A checkpoint's state dict (the hub's per-expert tensors) under this model's names, each layer's
    experts stacked into one weight per projection, in expert order."""
    out, experts = {}, {}
    for key, tensor in state.items():
        if match := THEIRS.fullmatch(key):
            layer, e, projection = match.groups()
            experts.setdefault((layer, projection), {})[int(e)] = tensor
        else:
            out[NAMES.rename(key, to_hf=False)] = tensor
    weights = {projection: weight for weight, projection in PROJECTIONS.items()}
    for (layer, projection), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"layer {layer}'s {projection} experts are not 0..n-1: {sorted(by_expert)[:8]}...")
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        out[f"layers.{layer}.moe.experts.{weights[projection]}"] = stacked
    return out


class Qwen3MoeMath(LlamaMath):
    """Qwen3-MoE's config.json: the Llama family's, and its experts. Qwen's files count them as `num_experts`,
    transformers 5 writes `num_local_experts`: either is read."""

    def derive(self, math: dict, config: dict) -> dict:
        math = super().derive(math, config)
        math["num_experts"] = config.get("num_experts", config.get("num_local_experts"))
        return math


QWEN3_MOE = Qwen3MoeMath(
    fields={
        **LLAMA.fields,
        "num_experts": None,
        "num_experts_per_tok": None,
        "moe_intermediate_size": None,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },  # fmt: skip
    settings={
        **LLAMA.settings,
        "head_dim": "model.head_dim",
        "num_experts": "model.num_experts",
        "num_experts_per_tok": "model.num_experts_per_tok",
        "moe_intermediate_size": "model.moe_intermediate_size",
        "norm_topk_prob": "model.norm_topk_prob",
        "decoder_sparse_step": "model.decoder_sparse_step",
        "mlp_only_layers": "model.mlp_only_layers",
    },  # fmt: skip
)
"""The config.json fields that change what this model computes (models/config_math.py): the Llama family's,
head_dim set by its own key, and the experts'."""


def hf_errors(cfg: Qwen3MoeConfig) -> list[str]:
    """What keeps transformers' Qwen3MoeForCausalLM from computing this model (empty when it can)."""
    unsupported = {
        "n_shared_experts": cfg.n_shared_experts != 0,
        "score_func": cfg.score_func != "softmax",
        "routed_scaling_factor": cfg.routed_scaling_factor != 1.0,
        "bias_update_rate": cfg.bias_update_rate != 0,
    }
    return [
        f"model.{key}={getattr(cfg, key)!r} has no counterpart in transformers' Qwen3MoeForCausalLM "
        "(Hugging Face files would compute another model): use checkpoint.export=safetensors"
        for key, differs in unsupported.items()
        if differs
    ]


def config_json(cfg: Qwen3MoeConfig) -> str:
    """config.json for transformers' Qwen3MoeForCausalLM that computes what this model does (the hub's field
    names; `num_experts` as Qwen's own files write it). ValueError for the DeepSeek-V3 options (hf_errors)."""
    errors = hf_errors(cfg)
    if errors:
        raise ValueError("; ".join(errors))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "torch_dtype": "float32",
    }
    return json.dumps(config, indent=2)
