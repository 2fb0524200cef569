"""A model this repo has never seen, for tests/test_model_contract.py: a token MLP.

The test copies it into src/<package>/models/toy.py (hence the relative imports) and adds one
line to the registry. It differs from the Llama blocks on purpose: no attention, LayerNorm with
biases, an untied head, so nothing can work by accident through Llama-specific code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .spec import ModelConfig, ModelShape, ModelSpec


@dataclass
class ToyConfig(ModelConfig):
    name: str = "toy"
    """Model family; models/__init__.py maps it to the module that defines it."""
    vocab_size: int = 256
    """Vocabulary size."""
    dim: int = 64
    """Hidden size."""
    n_layers: int = 2
    """Blocks."""
    ffn_hidden_dim: int = 128
    """Width of each block's MLP."""

    def errors(self, seq_len: int) -> list[str]:
        return [] if self.ffn_hidden_dim > 0 else ["model.ffn_hidden_dim must be positive for the toy model"]


class ToyBlock(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.ffn_hidden_dim)
        self.down = nn.Linear(cfg.ffn_hidden_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Toy(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(ToyBlock(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def tie_weights(self) -> None:
        """Nothing is tied."""

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def init_buffers(self) -> None:
        """No buffers."""


@dataclass(frozen=True)
class ToyShape(ModelShape):
    def activation_bytes(self, p: int, ac: str, **parallel) -> float:
        """LayerNorm's input and output, the MLP's hidden layer before and after GELU; or the block input."""
        return {"none": p * (2 * self.h + 2 * self.f), "selective": p * (2 * self.h + self.f)}.get(ac, p * self.h)

    def flops_per_token(self, seq_len: int) -> float:
        return 6 * (self.P - self.lookups)  # no attention


def toy_shape(m: ToyConfig) -> ModelShape:
    block = 2 * m.dim * m.ffn_hidden_dim + m.ffn_hidden_dim + 3 * m.dim  # up, down (+ biases), LayerNorm
    outside = 2 * m.vocab_size * m.dim  # embedding and head
    P = block * m.n_layers + outside
    # No attention: no FLOPs but the matmuls', and neither the embedding nor the norms multiply.
    not_multiplied = m.vocab_size * m.dim + 2 * m.dim * m.n_layers
    return ToyShape(P, block, outside, m.n_layers, m.dim, kv=0, f=m.ffn_hidden_dim, V=m.vocab_size,
                    lookups=not_multiplied)  # fmt: skip


SPEC = ModelSpec(config=ToyConfig, build=Toy, shape=toy_shape)
