"""A decoder this repo has never seen, for tests/test_model_contract.py: GPT-2, written as a new user would.

The test copies it into src/<package>/models/gpt2.py (hence the relative imports) and adds one
line to the registry. It differs from the Llama blocks where GPT-2 does: learned positions,
LayerNorm with biases, GELU, biased projections, a tied head. It computes with `nn.Linear` and
separate q, k, v projections (what LoRA, float8 and tensor parallelism need), while transformers'
GPT2LMHeadModel stores `Conv1D` weights, transposed, with q, k and v fused into one `c_attn`: its
state-dict adapter (HF) transposes, fuses and splits, so the layout needs a transform both ways.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config_math import ConfigMath
from .spec import HFLayout, Linear, LoraLayout, ModelConfig, ModelShape, ModelSpec, StateDict


@dataclass
class GPT2Config(ModelConfig):
    name: str = "gpt2"
    """Model family; models/__init__.py maps it to the module that defines it."""
    vocab_size: int = 256
    """Vocabulary size."""
    dim: int = 64
    """Hidden size."""
    n_layers: int = 2
    """Blocks."""
    n_heads: int = 4
    """Attention heads."""
    max_seq_len: int = 64
    """Learned positions: the longest sequence the model takes."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon."""

    def errors(self, seq_len: int) -> list[str]:
        reasons = [f"model.n_heads={self.n_heads} must divide model.dim={self.dim}"] if self.dim % self.n_heads else []
        if seq_len > self.max_seq_len:
            reasons.append(f"train.seq_len={seq_len} is longer than model.max_seq_len={self.max_seq_len}")
        return reasons


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.c_proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's gelu_new


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln_f(h))

    def get_input_embeddings(self) -> nn.Module:
        return self.wte

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def tie_weights(self) -> None:
        self.head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2's init: N(0, 0.02), the residual projections scaled by 1/sqrt(2 * blocks), zero biases."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module is not self.head:
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, std=std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def init_buffers(self) -> None:
        """No buffers: the positions are made in forward."""


@dataclass(frozen=True)
class GPT2Shape(ModelShape):
    def activation_bytes(self, p: int, ac: str, *, lora_rank: int = 0, **parallel) -> float:
        """What a block keeps per token, p bytes per element, for hidden size h and MLP width f: none 8h + 2f
        (the block input; each LayerNorm's output; q, k, v and the attention output; the residual; the MLP's
        f before and after GELU); selective 7h + f (the block input, q, k, v, the attention output and the
        outputs of the other three matmuls); full h (the block input). The LayerNorm statistics and
        attention's log-sum-exp are a few bytes per token, left out."""
        h, f = self.h, self.f
        terms = {"none": 8 * h + 2 * f, "selective": 7 * h + f}
        return p * terms.get(ac, h)


def gpt2_shape(m: GPT2Config) -> ModelShape:
    h, f = m.dim, 4 * m.dim
    linears = tuple(Linear("attention", h, h) for _ in range(4)) + (Linear("mlp", h, f), Linear("mlp", f, h))
    block = sum(layer.inputs * layer.outputs + layer.outputs for layer in linears) + 4 * h  # biases, 2 LayerNorms
    outside = (m.vocab_size + m.max_seq_len) * h + 2 * h  # tied embeddings, positions, final LayerNorm
    return GPT2Shape(block * m.n_layers + outside, block, outside, m.n_layers, h, kv=h, f=f, V=m.vocab_size,
                     linears=linears, lookups=m.max_seq_len * h)  # fmt: skip


def to_hf(state: StateDict, cfg: GPT2Config) -> StateDict:
    """This model's state dict as GPT2LMHeadModel's: Conv1D weights are (in, out), q, k, v one c_attn."""
    out = {}
    for key, value in state.items():
        if key.startswith("layers."):
            i, rest = key.removeprefix("layers.").split(".", 1)
            if rest.startswith(("attn.q.", "attn.k.", "attn.v.")):
                if rest.startswith("attn.q."):
                    kind = rest.rsplit(".", 1)[1]  # weight or bias
                    parts = [state[f"layers.{i}.attn.{x}.{kind}"] for x in "qkv"]
                    fused = torch.cat([part.t() for part in parts], dim=1) if kind == "weight" else torch.cat(parts)
                    out[f"transformer.h.{i}.attn.c_attn.{kind}"] = fused
                continue
            if rest.endswith(".weight") and rest.startswith(("attn.c_proj", "mlp.")):
                value = value.t()
            out[f"transformer.h.{i}.{rest}"] = value
        elif key == "head.weight":
            out["lm_head.weight"] = value
        else:
            out[f"transformer.{key}"] = value
    return out


def from_hf(state: StateDict, cfg: GPT2Config) -> StateDict:
    """GPT2LMHeadModel's state dict as this model's: to_hf undone."""
    out = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            out["head.weight"] = value
            continue
        key = key.removeprefix("transformer.")
        if not key.startswith("h."):
            out[key] = value
            continue
        i, rest = key.removeprefix("h.").split(".", 1)
        if rest.startswith("attn.c_attn."):
            kind = rest.rsplit(".", 1)[1]
            for x, part in zip("qkv", value.chunk(3, dim=-1), strict=True):
                out[f"layers.{i}.attn.{x}.{kind}"] = part.t() if kind == "weight" else part
            continue
        if rest.endswith(".weight") and rest.startswith(("attn.c_proj", "mlp.")):
            value = value.t()
        out[f"layers.{i}.{rest}"] = value
    return out


def hf_config_json(m: GPT2Config) -> str:
    """config.json for transformers' GPT2LMHeadModel that computes what this model does."""
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.max_seq_len,
        "n_embd": m.dim,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": 4 * m.dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.layer_norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": m.vocab_size - 1,  # GPT-2's <|endoftext|> is its last token
        "eos_token_id": m.vocab_size - 1,
    }
    return json.dumps(config, indent=2)


class GPT2Math(ConfigMath):
    """GPT-2's config.json: n_inner, when a file leaves it out (null), is 4 x n_embd."""

    def derive(self, math: dict, config: dict) -> dict:
        return {**math, "n_inner": math["n_inner"] or 4 * math["n_embd"]}


# The config.json fields that change what GPT2LMHeadModel computes, with transformers' GPT2Config defaults,
# and the [model] key that sets each; this model fixes the rest in its code (GELU, a tied head, scaled attention).
GPT2_MATH = GPT2Math(
    fields={
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    },
    settings={
        "vocab_size": "model.vocab_size", "n_positions": "model.max_seq_len", "n_embd": "model.dim",
        "n_layer": "model.n_layers", "n_head": "model.n_heads", "layer_norm_epsilon": "model.layer_norm_eps",
    },
    notes={"n_inner": "it is 4 x model.dim here"},
)  # fmt: skip


SPEC = ModelSpec(
    config=GPT2Config,
    build=GPT2,
    shape=gpt2_shape,
    hf=HFLayout(to_hf=to_hf, from_hf=from_hf, config_json=hf_config_json, config_math=GPT2_MATH),
    lora=LoraLayout(attention="attn", mlp="mlp"),
)
