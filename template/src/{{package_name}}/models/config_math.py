"""What a Hugging Face config.json says a model computes, and where two such models differ.

Names and shapes (weights.match_layout) cannot tell apart two models that compute different
functions with the same tensors: another rotary base or scaling, norm epsilon, tied embeddings,
biases or attention window. checkpoint.init_from therefore also compares the checkpoint's
config.json with the one this config's model exports (its spec's `hf.config_json`), field by
field, before the process group starts. `computed_by` reads either form transformers writes:
transformers 5's `rope_parameters`, or the `rope_theta` and `rope_scaling` of older files and of
Meta's published Llama 3.x configs; a key a file leaves out means what it means to transformers'
LlamaConfig. Plain Python: nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

MATH_FIELDS: dict[str, object] = {
    "hidden_size": None,
    "num_hidden_layers": None,
    "num_attention_heads": None,
    "num_key_value_heads": None,  # missing: num_attention_heads (no grouped-query attention)
    "head_dim": None,  # missing: hidden_size / num_attention_heads
    "intermediate_size": None,
    "vocab_size": None,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rope_scaling": None,  # None: plain rotary frequencies; else the rule and its parameters
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,  # None: every position attends to every earlier one
    # A mixture of experts (Qwen3-MoE); a dense model's file has none of these, and neither does its export.
    "num_experts": None,
    "num_experts_per_tok": None,
    "moe_intermediate_size": None,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
"""The config.json fields that change what a decoder computes, with what each means when a file leaves it out."""

SETTINGS = {
    "hidden_size": "model.dim",
    "num_hidden_layers": "model.n_layers",
    "num_attention_heads": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads",
    "intermediate_size": "model.ffn_hidden_dim",
    "vocab_size": "model.vocab_size",
    "rope_theta": "model.rope_theta",
    "rope_scaling": "model.rope_scaling",
    "rms_norm_eps": "model.norm_eps",
    "tie_word_embeddings": "model.tie_embeddings",
}
"""The config key that sets each field; no [model] key sets the others (head_dim follows dim / n_heads)."""

MOE_SETTINGS = {
    "head_dim": "model.head_dim",
    "num_experts": "model.num_experts",
    "num_experts_per_tok": "model.num_experts_per_tok",
    "moe_intermediate_size": "model.moe_intermediate_size",
    "norm_topk_prob": "model.norm_topk_prob",
    "decoder_sparse_step": "model.decoder_sparse_step",
    "mlp_only_layers": "model.mlp_only_layers",
}
"""The keys of a mixture of experts' [model] (models/qwen3_moe), for the fields SETTINGS leaves out; a model
whose [model] has no such key (`fields` of mismatches) is told that no key sets it."""


def read_config_json(directory: Path) -> dict | None:
    """The config.json beside the weights in `directory`; None without one (this repo's safetensors export)."""
    path = Path(directory) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def computed_by(config: dict) -> dict:
    """The fields of MATH_FIELDS a config.json sets, in one form whichever transformers wrote it."""
    math = {field: config.get(field, default) for field, default in MATH_FIELDS.items()}
    heads = math["num_attention_heads"]
    math["num_key_value_heads"] = math["num_key_value_heads"] or heads
    # Qwen's own files say num_experts; transformers 5 writes the same count as num_local_experts.
    math["num_experts"] = config.get("num_experts", config.get("num_local_experts"))
    math["head_dim"] = math["head_dim"] or (math["hidden_size"] // heads if heads else None)
    rope = {k: v for k, v in dict(config.get("rope_parameters") or config.get("rope_scaling") or {}).items()
            if v is not None}  # fmt: skip
    math["rope_theta"] = float(rope.pop("rope_theta", math["rope_theta"]))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))  # files before transformers 4.45 say "type"
    math["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **dict(sorted(rope.items()))}
    if not config.get("use_sliding_window", True):  # qwen2 writes a window it does not use
        math["sliding_window"] = None
    return math


def mismatches(ours: dict, theirs: dict, fields: Collection[str] = ()) -> list[str]:
    """Every field where `theirs` (the checkpoint's config.json) computes otherwise than `ours`, with the fix;
    `fields`: the keys of this model's [model], which say whether one of them sets a field."""
    ours, theirs = computed_by(ours), computed_by(theirs)
    return [
        _differs(field, theirs[field], ours[field], fields) for field in MATH_FIELDS if theirs[field] != ours[field]
    ]


def _differs(field: str, theirs: object, ours: object, fields: Collection[str] = ()) -> str:
    said = f"{field} is {theirs!r} there and {ours!r} here"
    if field in MOE_SETTINGS and MOE_SETTINGS[field].removeprefix("model.") in fields:
        return f"{said} (set {MOE_SETTINGS[field]} = {json.dumps(theirs)})"
    if field == "head_dim":
        return f"{said} (it is model.dim / model.n_heads here)"
    if field not in SETTINGS:
        return f"{said} (no [model] key sets it)"
    key = SETTINGS[field]
    if field != "rope_scaling":
        return f"{said} (set {key} = {json.dumps(theirs)})"
    if theirs is None:
        return f'{said} (set {key}.rope_type = "none")'
    if theirs.get("rope_type") != "llama3":
        return f"{said} ({key} computes none or llama3, not {theirs.get('rope_type')!r})"
    return f"{said} (set [{key}] {', '.join(f'{k} = {json.dumps(v)}' for k, v in theirs.items())})"
