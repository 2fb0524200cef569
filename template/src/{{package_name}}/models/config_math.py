"""What a Hugging Face config.json says a model computes, and where two such models differ.

Names and shapes (weights.match_layout) cannot tell apart two models that compute different
functions with the same tensors: another rotary base or scaling, norm epsilon, tied embeddings,
biases or attention window. So a model's state-dict adapter declares its config.json math
(HFLayout.config_math, a `ConfigMath`): the fields that change what it computes, what each means
when a file leaves it out, and the [model] key that sets it. checkpoint.init_from compares the
checkpoint's config.json with the one this config's model exports (its spec's `hf.config_json`),
field by field, before the process group starts, and a refusal names the model's own key.

`LLAMA` is the Llama family's (the built-in decoder, and transformers' llama, qwen2 and mistral);
it reads either form transformers writes: transformers 5's `rope_parameters`, or the `rope_theta`
and `rope_scaling` of older files and of Meta's published Llama 3.x configs; a key a file leaves out
means what it means to transformers' LlamaConfig. Plain Python: nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ConfigMath:
    """The config.json fields that change what a model computes, and how they map to its [model] keys.

    A model declares one in its state-dict adapter (HFLayout.config_math); a model whose fields are
    not plain values (several file forms, fields that follow others) subclasses it and overrides
    `derive`, and `assignment` where a [model] key is set otherwise than `key = value`.
    """

    fields: dict[str, object]
    """Each field that changes what the model computes -> what it means when a file leaves it out."""
    settings: dict[str, str] = field(default_factory=dict)
    """Field -> the [model] key that sets it (`model.<name>`); the model's own code fixes the others."""
    notes: dict[str, str] = field(default_factory=dict)
    """Field -> why no [model] key sets it, where that is more than "no [model] key sets it"."""
    here: str = "here"
    """What the model of this config is called in a refusal ("X is a there and b here")."""
    per_field_fix: bool = True
    """Name each field's fix after it (the key to set); False: `hint` is the one fix."""
    hint: Callable[[str, list[str]], str] | None = None
    """The fix that builds the model from the checkpoint's own config.json, given the checkpoint's directory
    and the [model] settings that must come with it (None: the model has no such setting)."""
    model_types: tuple[str, ...] = ()
    """The config.json `model_type`s whose files these fields describe, besides the one the model exports: a file of
    any other is another architecture, refused as such before any field is compared."""

    def computed_by(self, config: dict) -> dict:
        """The fields a config.json sets (defaults for the ones it leaves out), in one form whichever wrote it."""
        return self.derive({name: config.get(name, default) for name, default in self.fields.items()}, config)

    def derive(self, math: dict, config: dict) -> dict:
        """`math` (the fields as the file has them) in the one form they are compared in: a subclass's hook."""
        return math

    def assignment(self, name: str, theirs: object) -> str | None:
        """The [model] setting that makes this model compute what `theirs` says (None: no key sets `name`)."""
        key = self.settings.get(name)
        return None if key is None else f"{key} = {json.dumps(theirs)}"

    def why_unset(self, name: str, theirs: object) -> str:
        """Why no [model] setting makes this model compute what `theirs` says of `name`."""
        return self.notes.get(name, "no [model] key sets it")

    def differences(self, ours: dict, theirs: dict) -> list[tuple[str, object, object]]:
        """(field, theirs, ours) for every field where the config.json `theirs` computes otherwise than `ours`."""
        ours, theirs = self.computed_by(ours), self.computed_by(theirs)
        return [(name, theirs[name], ours[name]) for name in self.fields if theirs[name] != ours[name]]

    def explain(self, ours: dict, theirs: dict) -> tuple[list[str], list[str]]:
        """What differs where the config.json `theirs` computes otherwise than `ours`: a clause per field (with its
        fix unless `per_field_fix` is off), and the [model] settings that make this model compute what `theirs` does."""
        said, assignments = [], []
        for name, there, here in self.differences(ours, theirs):
            setting = self.assignment(name, there)
            assignments += [setting] if setting else []
            fix = f"set {setting}" if setting else self.why_unset(name, there)
            clause = f"{name} is {there!r} there and {here!r} {self.here}"
            said.append(f"{clause} ({fix})" if self.per_field_fix else clause)
        return said, assignments

    def refusal(self, ours: dict, theirs: dict, directory: str) -> str:
        """Every field where `theirs` (the config.json in `directory`) computes otherwise than `ours`, then `hint`;
        empty when they compute the same."""
        said, assignments = self.explain(ours, theirs)
        if said and self.hint:
            said.append(self.hint(directory, assignments))
        return "; ".join(said)


def read_config_json(directory: Path) -> dict | None:
    """The config.json beside the weights in `directory`; None without one (this repo's safetensors export)."""
    path = Path(directory) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


ROPE_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"),
}
"""The rotary scaling rules [model.rope_scaling] computes, and the fields of each that config.json holds."""


def yarn_attention_factor(rope: dict) -> float:
    """The factor transformers' YaRN multiplies cos and sin by, from a config.json's rope fields: attention_factor,
    or from factor (and mscale over mscale_all_dim, where a file gives both) as the YaRN paper's 0.1 ln(s) + 1."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope["factor"]
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
    return mscale(factor)


def _yarn_in_one_form(rope: dict, config: dict) -> dict:
    """A yarn rope dict as what it computes: factor (from the contexts where a file leaves it out), YaRN's defaults
    and the attention factor filled in; `truncate` kept only where it is off (no [model] key turns it off)."""
    rope = dict(rope)
    original = rope.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    factor = rope.get("factor") or (config.get("max_position_embeddings") or 0) / (original or 1)
    rope.update(factor=float(factor), original_max_position_embeddings=original)
    attention_factor = yarn_attention_factor(rope)
    for name in ("mscale", "mscale_all_dim", "attention_factor"):
        rope.pop(name, None)
    if rope.pop("truncate", True) is False:
        rope["truncate"] = False
    return {**rope, "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "attention_factor": attention_factor}  # fmt: skip


class LlamaMath(ConfigMath):
    """The Llama family's config.json: rotary settings in either form, head size and key/value heads that
    follow others when a file leaves them out, and qwen2's sliding window that it does not use."""

    def derive(self, math: dict, config: dict) -> dict:
        heads = math["num_attention_heads"]
        math["num_key_value_heads"] = math["num_key_value_heads"] or heads
        math["head_dim"] = math["head_dim"] or (math["hidden_size"] // heads if heads else None)
        rope = {k: v for k, v in dict(config.get("rope_parameters") or config.get("rope_scaling") or {}).items()
                if v is not None}  # fmt: skip
        math["rope_theta"] = float(rope.pop("rope_theta", math["rope_theta"]))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))  # files before transformers 4.45 say "type"
        rope = _yarn_in_one_form(rope, config) if rope_type == "yarn" else rope
        scaled = {"rope_type": rope_type, **dict(sorted(rope.items()))}
        math["rope_scaling"] = None if rope_type == "default" else scaled
        if not config.get("use_sliding_window", True):  # qwen2 writes a window it does not use
            math["sliding_window"] = None
        return math

    def differences(self, ours: dict, theirs: dict) -> list[tuple[str, object, object]]:
        """As ConfigMath's, except that a model extending the file's context (`extends`) may scale its rotary
        frequencies otherwise: the one change a long-context fine-tune makes to the model it starts from."""
        said = super().differences(ours, theirs)
        return [d for d in said if d[0] != "rope_scaling"] if self.extends(ours, theirs) else said

    def extends(self, ours: dict, theirs: dict) -> bool:
        """Whether the config.json `ours` stretches the context of `theirs` (max_position_embeddings) by its rotary
        scaling's factor: linear, or yarn over theirs as original_max_position_embeddings."""
        rope, context = self.computed_by(ours)["rope_scaling"] or {}, theirs.get("max_position_embeddings")
        if rope.get("rope_type") not in ("linear", "yarn") or not context:
            return False
        if rope["rope_type"] == "yarn" and rope["original_max_position_embeddings"] != context:
            return False
        return ours.get("max_position_embeddings") == rope["factor"] * context > context

    def assignment(self, name: str, theirs: object) -> str | None:
        key = self.settings.get(name)
        if name != "rope_scaling" or key is None:
            return super().assignment(name, theirs)
        if theirs is None:
            return f'{key}.rope_type = "none"'
        rule = theirs.get("rope_type")
        if rule not in ROPE_FIELDS or set(theirs) - {"rope_type", *ROPE_FIELDS[rule]}:
            return None  # a rule, or a field of one, that [model] does not compute (why_unset says so)
        return f"[{key}] {', '.join(f'{k} = {json.dumps(v)}' for k, v in theirs.items())}"

    def why_unset(self, name: str, theirs: object) -> str:
        if name == "rope_scaling" and (rule := theirs.get("rope_type")) in ROPE_FIELDS:
            unknown = sorted(set(theirs) - {"rope_type", *ROPE_FIELDS[rule]})
            return f"{self.settings[name]} has no {', '.join(unknown)} ({rule} computes {', '.join(ROPE_FIELDS[rule])})"
        if name == "rope_scaling":
            return f"{self.settings[name]} computes none, {', '.join(ROPE_FIELDS)}, not {theirs.get('rope_type')!r}"
        return super().why_unset(name, theirs)


LLAMA = LlamaMath(
    fields={
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
    },
    settings={
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
    },
    notes={
        "head_dim": "it is model.dim / model.n_heads here",
    },
    model_types=("llama", "qwen2", "mistral"),
)
"""The Llama family's config.json math: the built-in decoder's and transformers' llama, qwen2 and mistral."""

# The Llama family's declaration by its parts, as earlier releases named them.
MATH_FIELDS: dict[str, object] = LLAMA.fields
SETTINGS: dict[str, str] = LLAMA.settings


def computed_by(config: dict) -> dict:
    """The Llama family's fields a config.json sets (LLAMA.computed_by)."""
    return LLAMA.computed_by(config)


def mismatches(ours: dict, theirs: dict) -> list[str]:
    """Every Llama-family field where `theirs` computes otherwise than `ours`, with the fix (LLAMA.refusal)."""
    return LLAMA.explain(ours, theirs)[0]
