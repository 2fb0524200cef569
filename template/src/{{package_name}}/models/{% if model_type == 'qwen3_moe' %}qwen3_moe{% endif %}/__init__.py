"""The built-in mixture-of-experts decoder (`model.name = "qwen3_moe"`), one concern per file, joined into its `SPEC`:

    model.py  the hyperparameters (Qwen3MoeConfig) and the decoder, which never imports torch.distributed
    moe.py    the mixture-of-experts layer: router, grouped experts, the dispatcher expert parallelism replaces
    shape.py  its sizes and cost terms (total and active parameters), for the planner and the MFU figure
    hf.py     its state-dict adapter (the hub's per-expert tensors) and config.json

Every public name of those files is re-exported, so `from <package>.models.qwen3_moe import X` needs no file name.
"""

from ..spec import HFLayout, ModelSpec, new_kv_cache
from .hf import NAMES, QWEN3_MOE, config_json, from_hf, hf_errors, to_hf
from .model import Attention, Block, Qwen3Moe, Qwen3MoeConfig
from .moe import (
    LOAD,
    PROB,
    Dispatcher,
    FeedForward,
    GroupedExperts,
    LocalDispatcher,
    MoE,
    Router,
    bias_update,
    load_balancing_loss,
)
from .shape import MoeShape, moe_shape

__all__ = [
    "LOAD",
    "NAMES",
    "PROB",
    "QWEN3_MOE",
    "SPEC",
    "Attention",
    "Block",
    "Dispatcher",
    "FeedForward",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "MoeShape",
    "Qwen3Moe",
    "Qwen3MoeConfig",
    "Router",
    "bias_update",
    "config_json",
    "from_hf",
    "hf_errors",
    "load_balancing_loss",
    "moe_shape",
    "to_hf",
]

SPEC = ModelSpec(
    config=Qwen3MoeConfig,
    build=Qwen3Moe,
    shape=moe_shape,
    hf=HFLayout(
        to_hf=to_hf,
        from_hf=from_hf,
        config_json=config_json,
        config_math=QWEN3_MOE,
        errors=hf_errors,
        to_hf_local_experts=to_hf,
    ),
    # No LoRA: models/lora.py adapts nn.Linear layers, and the routed experts, where a MoE's weights are,
    # are stacked 3-D parameters (GroupedExperts); adapters on attention alone would train a sliver of it.
    lora=None,
    kv_cache=new_kv_cache,
    lora_refusal="its routed experts, where most of its weights are, are stacked 3-D weights that models/lora.py "
    "(adapters beside nn.Linear layers) does not adapt",
    # No tensor-parallel plan yet: attention alone would split cleanly (llama's colwise / rowwise, with
    # the per-head q_norm and k_norm replicated), but the experts need expert parallelism's mesh, which
    # is how this model is meant to split; parallel.tensor_parallel > 1 is refused with tp_refusal.
    tp_refusal="its experts split by expert parallelism, not tensor parallelism (no SPEC.tp_plan yet)",
    # No context-parallel plan yet: its attention would split as the decoder's does (models/llama/cp.py), but
    # the router's aux loss is a product of sums over a micro-batch's tokens, which a group would have to
    # reduce before the product, and expert parallelism's mesh would have to span the group.
    cp_refusal="its router's aux loss and expert parallelism's mesh do not yet span a context-parallel group "
    "(no SPEC.cp_plan)",
)
