"""The decoder's state-dict adapter: its parameter names beside Hugging Face LlamaForCausalLM's, and the
config.json that makes transformers build the same model (checkpoint.init_from, export=hf; weights.py).
"""

from __future__ import annotations

import json

from ..config_math import ROPE_FIELDS
from ..spec import RenameTable
from .model import LlamaConfig, RopeScaling

# This repo's parameter names beside Hugging Face LlamaForCausalLM's ({i}: a layer, {x}: q, k, v
# or o). Both use the rotate-half rotary layout, so the state-dict adapter renames only, never permutes.
HF_NAMES = RenameTable(
    rows=(
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("layers.{i}.attention.w{x}.weight", "model.layers.{i}.self_attn.{x}_proj.weight"),
        ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ),
    fields=(("i", r"\d+"), ("x", "[qkvo]")),
)


def hf_rope_scaling(scaling: RopeScaling) -> dict | None:
    """transformers' rope_scaling for this rule: its rope_type and the fields it reads (config_math.ROPE_FIELDS);
    None for plain frequencies. A yarn attention_factor of 0 is left out: transformers then computes YaRN's own."""
    if scaling.rope_type == "none":
        return None
    fields = {name: getattr(scaling, name) for name in ROPE_FIELDS[scaling.rope_type]}
    if fields.get("attention_factor") == 0:
        del fields["attention_factor"]
    return {"rope_type": scaling.rope_type, **fields}


def hf_config_json(cfg: LlamaConfig) -> str:
    """config.json for transformers' LlamaForCausalLM that computes what this model does.

    Rotary scaling is written as Meta's Llama 3.x files write it (`rope_theta`, `rope_scaling` with
    `rope_type`, hf_rope_scaling), which transformers 4 reads as is and transformers 5 files under
    `rope_parameters`.
    """
    config = {
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
        "rope_scaling": hf_rope_scaling(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    return json.dumps(config, indent=2)
