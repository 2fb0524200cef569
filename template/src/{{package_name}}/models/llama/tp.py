"""The decoder's tensor-parallel plan (parallel.tensor_parallel): the layouts parallelize.apply_tp
turns into torch's parallel styles, and the sizes a degree must divide.
"""

from __future__ import annotations

from ..spec import TensorParallelPlan
from .model import LlamaConfig


def decoder_tp_errors(m: LlamaConfig, degree: int, seq_len: int) -> list[str]:
    """What the decoder splits `degree` ways: heads, SwiGLU width, vocabulary, and the sequence."""
    sizes = {"model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads, "model.ffn_hidden_dim": m.ffn_hidden_dim,
             "model.vocab_size": m.vocab_size, "train.seq_len": seq_len}  # fmt: skip
    return [
        f"parallel.tensor_parallel={degree} must divide {name}={size}"
        + (" (sequence parallelism splits every sequence between the ranks)" if name == "train.seq_len" else "")
        for name, size in sizes.items()
        if size % degree
    ]


# Megatron-style tensor parallelism with sequence parallelism (torchtitan's Llama plan): q, k, v
# and SwiGLU's w1, w3 split by output features (whole heads per rank), wo and w2 by input
# features, the norms on each rank's part of the sequence. Per block forward that is two
# all-gathers (before attention and before the feed-forward) and two reduce-scatters (after wo and w2).
TP_PLAN = TensorParallelPlan(
    root={"tok_embeddings": "embedding", "norm": "sequence", "output": "head"},
    block={
        "attention_norm": "sequence",
        "attention": "gather",
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "ffn_norm": "sequence",
        "feed_forward": "gather",
        "feed_forward.w1": "colwise",
        "feed_forward.w3": "colwise",
        "feed_forward.w2": "rowwise",
    },
    check=decoder_tp_errors,
)
