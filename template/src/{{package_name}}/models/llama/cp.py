"""The decoder's context-parallel plan (parallel.context_parallel): where its attention core is, and the heads a
degree must divide. context_parallel.py does the splitting; model.py's forward takes the positions it hands out.
"""

from __future__ import annotations

from ..spec import ContextParallelPlan
from .model import LlamaConfig


def decoder_cp_errors(m: LlamaConfig, degree: int, tensor_parallel: int) -> list[str]:
    """DeepSpeed-Ulysses gives each rank of a context-parallel group whole heads: the query heads a rank holds
    (all of them, or n_heads / tensor_parallel) must divide by the degree. Key/value heads need not: where they
    do not divide, every rank repeats them to the query heads first (more traffic, the same result)."""
    local = m.n_heads // tensor_parallel
    if degree <= 1 or m.n_heads % tensor_parallel or local % degree == 0:
        return []
    held = f"model.n_heads={m.n_heads}" + (f" / parallel.tensor_parallel={tensor_parallel} = {local}"
                                          if tensor_parallel > 1 else "")  # fmt: skip
    fits = [d for d in range(1, local + 1) if local % d == 0]
    return [
        f"parallel.context_parallel={degree} must divide the attention heads of each rank ({held}): Ulysses attention "
        f"gives every rank of the group whole heads; choose one of {fits}"
    ]


CP_PLAN = ContextParallelPlan(core="attention.core", check=decoder_cp_errors)
