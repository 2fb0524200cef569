"""The built-in Llama decoder (`model.name = "llama"`), one concern per file, joined here into its `SPEC`:

    model.py  the hyperparameters (LlamaConfig) and the nn.Module, which never imports torch.distributed
    shape.py  its sizes and cost terms, for the planner and the MFU figure
    hf.py     its state-dict adapter: Hugging Face names and config.json
    tp.py     its tensor-parallel plan
    cp.py     its context-parallel plan

Every public name of those files is re-exported, so `from <package>.models.llama import X` needs no
file name; the ViT, hf_causal_lm and the custom stub build on the blocks and the cost terms.
"""

from ..config_math import LLAMA
from ..spec import HFLayout, LoraLayout, ModelSpec, new_kv_cache
from .cp import CP_PLAN, decoder_cp_errors
from .hf import HF_NAMES, hf_config_json, hf_rope_scaling
from .model import (
    DEBUG,
    Attention,
    AttentionCore,
    Block,
    BlockConfig,
    FeedForward,
    Llama,
    LlamaConfig,
    RopeScaling,
    apply_rope,
    causal_mask,
    model_rope_cache,
    rope_attention_factor,
    rope_cache,
    rope_frequencies,
    rope_scaling_errors,
)
from .shape import DecoderShape, block_shape, decoder_shape
from .tp import TP_PLAN, decoder_tp_errors

__all__ = [
    "CP_PLAN",
    "DEBUG",
    "HF_NAMES",
    "SPEC",
    "TP_PLAN",
    "Attention",
    "AttentionCore",
    "Block",
    "BlockConfig",
    "DecoderShape",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "apply_rope",
    "block_shape",
    "causal_mask",
    "decoder_cp_errors",
    "decoder_shape",
    "decoder_tp_errors",
    "hf_config_json",
    "hf_rope_scaling",
    "model_rope_cache",
    "rope_attention_factor",
    "rope_cache",
    "rope_frequencies",
    "rope_scaling_errors",
]

SPEC = ModelSpec(
    config=LlamaConfig,
    build=Llama,
    shape=decoder_shape,
    hf=HFLayout(
        to_hf=HF_NAMES.to_hf,
        from_hf=HF_NAMES.from_hf,
        config_json=hf_config_json,
        config_math=LLAMA,
    ),
    lora=LoraLayout(attention="attention", mlp="feed_forward"),
    tp_plan=TP_PLAN,
    cp_plan=CP_PLAN,
    kv_cache=new_kv_cache,
)
