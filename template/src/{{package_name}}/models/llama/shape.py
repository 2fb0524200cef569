"""The decoder's sizes and cost terms, which the planner (plan/) and the MFU figure (metrics.py) read.

The activation formula of the blocks in model.py is written once, in `DecoderShape.activation_bytes`'s
docstring; plan/, the template's hooks/plan.jinja and PLAN.md point here. The hf_causal_lm model, the ViT and the
custom stub are built of these blocks, so they count with these terms (or, like hf_causal_lm, adjust them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import Linear, ModelShape
from .model import BlockConfig, LlamaConfig


@dataclass(frozen=True)
class DecoderShape(ModelShape):
    """The sizes and cost terms of models built of model.py's blocks (the decoder, the ViT, the custom stub)."""

    def activation_bytes(
        self, p: int, ac: str, *, lora_rank: int = 0, lora_targets: str = "all", tensor_parallel: int = 1,
        sequence_parallel: bool = True, context_parallel: int = 1,
    ) -> float:  # fmt: skip
        """Bytes a block keeps for backward per token (Korthikanti et al. 2022,
        https://arxiv.org/abs/2205.05198, redone for SwiGLU and fused attention, which keeps no seq x seq
        scores), for hidden size h, key/value width kv, SwiGLU width f and p bytes per element:

            none       16h + p (5h + 2kv + 4f)   each RMSNorm keeps its input and normalised output in
                       fp32 (2 x 8h); then the norm outputs, q, k, v, the attention output and its
                       re-laid-out copy, w1, w3, silu and their product
            selective  p (5h + 2kv + 2f)         the block input and every matmul and attention output
            full       p h                       the block input (one block is recomputed at a time)

        Tensor parallelism over t ranks splits what the heads and the SwiGLU width split; sequence
        parallelism (tp.py's TP_PLAN) splits the norms and the block input by sequence, and 2h stays whole (the
        all-gathered inputs of attention and the feed-forward, which their first matmuls keep, and in
        selective the outputs of wo and w2 before their reduce-scatter): none 16h/t + p (2h + (3h + 2kv
        + 4f)/t), selective p (2h + (3h + 2kv + 2f)/t), full p h/t. Without it the norms and the block
        input are whole too: none 16h + p (2h + (3h + 2kv + 4f)/t), selective p (3h + (2h + 2kv + 2f)/t),
        full p h.

        With LoRA adapters of rank r on n layers, none keeps 8h + p (5h + 2kv + 4f - d + n r): a norm
        with a frozen weight keeps only its fp32 input, each adapted layer its rank-r intermediate, and
        a frozen layer no input, so d drops what only frozen layers needed (h + f with attention-only
        adapters: the feed-forward's two inputs; h with feed-forward-only ones: the attention's input).
        selective recomputes the adapters' matmuls, so it keeps what it keeps without them. LoRA and
        tensor parallelism are not combined (models/lora.py refuses it). tests/test_plan.py measures these.

        Context parallelism over c ranks (context_parallel.py, Ulysses attention) counts per token a rank
        holds (micro-batch x sequence / c of them): attention keeps q, k, v and its output for 1/c of the
        heads over the whole sequence, as many bytes as all heads over a rank's tokens, so the terms stay,
        with two changes. Key/value heads that c does not divide (per tensor-parallel rank) are repeated to
        the query heads first, so what attention keeps of k and v is h wide (g = h, else g = kv): none
        keeps 2g where it kept 2kv. Selective also keeps the all-to-alls' outputs (q, k, v and the attention
        output, so that backward does not repeat the communication): p (2h + 2g) / t more.
        tests/test_context_parallel.py measures these on CPU ranks.
        """
        h, kv, f, t = self.h, self.kv, self.f, tensor_parallel
        g = kv if context_parallel <= 1 or self.kv_heads // t % context_parallel == 0 else h
        exchanged = p * (2 * h + 2 * g) / t if context_parallel > 1 else 0  # the all-to-alls' outputs
        q = t if sequence_parallel else 1  # what splits the norms and the block input: the sequence, or nothing
        if ac == "none" and lora_rank:
            frozen_inputs = {"all": 0, "attention": h + f, "mlp": h}[lora_targets]
            adapted = len(self.adapted(lora_targets)) * lora_rank
            return 8 * h + p * (5 * h + 2 * g + 4 * f - frozen_inputs + adapted)
        if ac == "none":
            return 16 * h / q + p * (2 * h + (3 * h + 2 * g + 4 * f) / t)
        if ac == "selective":
            return p * (2 * h + h / q + (2 * h + 2 * kv + 2 * f) / t) + exchanged
        return p * h / q


def block_shape(
    m: BlockConfig, outside: int, classes: int, *, shape: type[DecoderShape] = DecoderShape, **per_sample: int
) -> DecoderShape:
    """The blocks of model.py (attention, SwiGLU, two RMSNorms, no biases) plus `outside` parameters around them."""
    h, f = m.dim, m.ffn_hidden_dim
    kv = m.n_kv_heads * (h // m.n_heads)
    wq = wo = Linear("attention", h, h)
    wk = wv = Linear("attention", h, kv)
    w1 = w3 = Linear("mlp", h, f)
    w2 = Linear("mlp", f, h)
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    P = block * m.n_layers + outside
    linears = (wq, wk, wv, wo, w1, w3, w2)
    return shape(P, block, outside, m.n_layers, h, kv, f, classes, linears=linears, kv_heads=m.n_kv_heads,
                 **per_sample)  # fmt: skip


def decoder_shape(m: LlamaConfig, shape: type[DecoderShape] = DecoderShape) -> DecoderShape:
    """The decoder: the blocks, and outside them the embedding, final norm and (untied) head; an untied
    embedding is a lookup table (no FLOPs), a tied one is the head's matmul too."""
    embedding = m.vocab_size * m.dim
    outside = embedding * (1 if m.tie_embeddings else 2) + m.dim
    return block_shape(m, outside, m.vocab_size, shape=shape, lookups=0 if m.tie_embeddings else embedding)
