"""Model registry: `model.name` in the config selects the class."""

from torch import nn

from ..config import ModelConfig
from .llama import Llama

MODELS = {"llama": Llama}


def build_model(cfg: ModelConfig) -> nn.Module:
    """A new, uninitialised model; call it under `torch.device("meta")` to allocate nothing."""
    return MODELS[cfg.name](cfg)
