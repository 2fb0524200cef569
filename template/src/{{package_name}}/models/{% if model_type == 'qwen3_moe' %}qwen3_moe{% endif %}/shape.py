"""The MoE decoder's sizes and cost terms: total and active parameters, activations, FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import Linear, ModelShape
from .model import Qwen3MoeConfig


@dataclass(frozen=True)
class MoeShape(ModelShape):
    """A ModelShape whose blocks may be sparse. P counts every parameter, `active` those one token is
    multiplied by; Pb is the larger block (the sparse one: the FSDP unit the planner sizes buffers by).
    f is one expert's SwiGLU width; `active` (ModelShape's) all parameters but the (num_experts - top_k) routed
    experts a token skips in every sparse layer."""

    q: int = 0
    """Query width (heads x head size), which need not be the hidden size."""
    head_dim: int = 1
    """Size of one attention head."""
    dense_f: int = 0
    """SwiGLU width of the dense layers."""
    shared_f: int = 0
    """Summed SwiGLU width of a sparse layer's shared experts (0: none)."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token from the ACTIVE parameters (a token multiplies top_k experts, not all):
        6 (active - lookups) + 12 L q seq_len, the attention term with the query width q (heads x head size)."""
        return 6 * (self.active - self.lookups) + 12 * self.L * self.q * seq_len

    def activation_bytes(
        self, p: int, ac: str, *, lora_rank: int = 0, lora_targets: str = "all", tensor_parallel: int = 1,
        sequence_parallel: bool = True,
    ) -> float:  # fmt: skip
        """Bytes a block keeps for backward per token, averaged over the sparse and dense blocks, for hidden
        size h, query width q, key/value width kv, a query and g key/value heads, E experts of which a token
        takes k, expert width f, shared width s, dense width F, and p bytes per element (measured op by op
        with saved-tensor hooks on CPU, and as a whole by tests/test_plan.py with MemTracker):

            none, sparse   16h + 8 (q + kv) + 4 (2a + g) + 4E + 28k + 12
                           + p (2h + 2q + 2kv + k (2h + 4f + 1) + 4s)
            none, dense    16h + 8 (q + kv) + 4 (2a + g) + 8 + p (2h + 2q + 2kv + 4F)
            selective      4a + p (2h + 2q + 2kv + E + k (h + 2f) + [2s + h])   sparse ([...] with shared experts)
                           4a + p (3h + 2q + 2kv + 2F)                          dense
            full           p h                                                  the block input

        none: the two RMSNorms keep their input and normalised output in fp32 (2 x 8h), and so do the
        per-head query and key norms (8 (q + kv)), with an fp32 rstd per row (4 per head, 4 per norm);
        then the norms' outputs (2 p h), attention's q, k, v and output (p (2q + 2kv); its log-sum-exp 4a).
        The router keeps its fp32 scores (4E), the chosen ids, their token and inverse-permutation indices
        (3 x 8k, int64), the routing weights in fp32 and p (4k + p k) and their sum (4); every routed
        copy keeps its row (p h), gate, up, silu(gate) and their product (4 p f), and its output for the
        weighted sum (p h). A shared expert or dense SwiGLU keeps 4 p of its width (its input is the norm's
        output, counted). selective keeps the block input and the outputs of the matmuls (the router's
        logits p E and the experts' grouped matmuls among them) and of attention. No tensor-parallel
        plan and no LoRA: tensor_parallel and lora_rank do not apply.
        """
        h, q, kv, f, s, F, k, E = self.h, self.q, self.kv, self.f, self.shared_f, self.dense_f, self.top_k, self.experts
        a, g = q // self.head_dim, kv // self.head_dim
        if ac == "full":
            return p * h
        if ac == "selective":
            sparse = 4 * a + p * (2 * h + 2 * q + 2 * kv + E + k * (h + 2 * f) + (2 * s + h if s else 0))
            dense = 4 * a + p * (3 * h + 2 * q + 2 * kv + 2 * F)
        else:
            norms = 16 * h + 8 * (q + kv) + 4 * (2 * a + g)
            sparse = norms + 4 * E + 28 * k + 12 + p * (2 * h + 2 * q + 2 * kv + k * (2 * h + 4 * f + 1) + 4 * s)
            dense = norms + 8 + p * (2 * h + 2 * q + 2 * kv + 4 * F)
        return (self.sparse_layers * sparse + (self.L - self.sparse_layers) * dense) / self.L


def moe_shape(m: Qwen3MoeConfig) -> MoeShape:
    """The decoder's shape: attention with QK-norm, sparse and dense blocks, and outside them the embedding,
    final norm and (untied) head; an untied embedding is a lookup table (no FLOPs)."""
    h, q, kv, f, E = m.dim, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.moe_intermediate_size, m.num_experts
    shared_f = m.n_shared_experts * f
    attention = (Linear("attention", h, q), Linear("attention", h, kv), Linear("attention", h, kv),
                 Linear("attention", q, h))  # fmt: skip
    # The stacked expert weights, as the one tensor each is (what FSDP shards and `largest` sees).
    experts = (Linear("mlp", h, E), Linear("mlp", h, E * f), Linear("mlp", h, E * f), Linear("mlp", E * f, h))
    shared = (Linear("mlp", h, shared_f), Linear("mlp", h, shared_f), Linear("mlp", shared_f, h)) if shared_f else ()
    dense = (Linear("mlp", h, m.ffn_hidden_dim), Linear("mlp", h, m.ffn_hidden_dim), Linear("mlp", m.ffn_hidden_dim, h))
    norms = 2 * h + 2 * m.head_dim
    sparse_linears, dense_linears = attention + experts + shared, attention + dense
    sparse_block = sum(x.inputs * x.outputs for x in sparse_linears) + norms
    dense_block = sum(x.inputs * x.outputs for x in dense_linears) + norms
    n_sparse = len(m.sparse_layers)
    embedding = m.vocab_size * h
    outside = embedding * (1 if m.tie_embeddings else 2) + h
    P = n_sparse * sparse_block + (m.n_layers - n_sparse) * dense_block + outside
    skipped = n_sparse * (E - m.num_experts_per_tok) * 3 * h * f
    Pb, linears = (sparse_block, sparse_linears) if n_sparse else (dense_block, dense_linears)
    return MoeShape(
        P, Pb, outside, m.n_layers, h, kv, f, m.vocab_size, linears=linears,
        lookups=0 if m.tie_embeddings else embedding, active=P - skipped, q=q, head_dim=m.head_dim,
        dense_f=m.ffn_hidden_dim, shared_f=shared_f, experts=E, top_k=m.num_experts_per_tok, sparse_layers=n_sparse,
        expert_params=3 * h * f,
    )  # fmt: skip
