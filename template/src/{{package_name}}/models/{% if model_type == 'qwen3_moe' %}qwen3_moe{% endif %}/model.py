"""Qwen3-MoE as transformers' Qwen3MoeForCausalLM computes it, with DeepSeek-V3's cheap options beside it.

Plain nn.Module code: parallelism (FSDP, expert parallelism through `MoE.dispatcher`) is applied
from outside, so nothing here imports torch.distributed. The block is Qwen3's: attention with
RMSNorm on every query and key head before the rotary embedding (QK-norm), grouped-query heads
whose size need not be dim / n_heads, and then either a mixture of experts (moe.py) or, in the
layers `mlp_only_layers` and `decoder_sparse_step` leave dense, a SwiGLU.

The module contract (models/__init__.py) holds, and adds three things a trainer reads after the
forward pass, because a block returns its router statistics instead of storing them (blocks are
compiled with fullgraph=True):

    aux_loss()             router_aux_loss_coef x the load-balancing loss of the last forward pass:
                           what the trainer adds to the cross-entropy (load_balancing_loss() is the
                           unweighted one, transformers' `outputs.aux_loss`)
    take_expert_load()     tokens each expert received since the last call ([sparse layers, experts],
                           summed over the training forward passes of a step); the trainer sums it
                           over the data-parallel ranks, then calls
    balance_metrics(load)  what to log: max / mean tokens per expert per layer, and the bias range
    apply_balance(load)    bias balancing: move each expert's routing bias toward balance
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ...presets import MOE_PRESETS
from ..llama import apply_rope, causal_mask, rope_cache
from ..spec import BlockCache, KVCache, ModelConfig
from .moe import LOAD, FeedForward, MoE, Router, bias_update, load_balancing_loss

# The fields are transformers' Qwen3MoeConfig's under this repo's names (hidden_size -> dim,
# num_hidden_layers -> n_layers, intermediate_size -> ffn_hidden_dim, ...; hf.py maps them), plus
# DeepSeek-V3's options. The defaults are the moe-debug preset's (an MoE render's configs/debug.toml):
# 4 blocks, 8 experts, 2 per token.
DEBUG = MOE_PRESETS["moe-debug"]


@dataclass
class Qwen3MoeConfig(ModelConfig):
    """The MoE decoder's hyperparameters: Qwen3-MoE's, and DeepSeek-V3's shared experts and router options."""

    name: str = "qwen3_moe"
    """Model family; models/__init__.py maps it to the module that defines it."""
    preset: str = "moe-debug"
    """Name of the size preset these shapes came from (informational)."""
    dim: int = DEBUG["dim"]
    """Hidden size (transformers: hidden_size)."""
    n_layers: int = DEBUG["n_layers"]
    """Number of blocks; each block is one FSDP unit (num_hidden_layers)."""
    n_heads: int = DEBUG["n_heads"]
    """Attention (query) heads (num_attention_heads)."""
    n_kv_heads: int = DEBUG["n_kv_heads"]
    """Key/value heads (grouped-query attention); must divide n_heads (num_key_value_heads)."""
    head_dim: int = DEBUG["head_dim"]
    """Size of one attention head; need not be dim / n_heads (Qwen3-30B-A3B: 128 with dim 2048 and 32 heads)."""
    vocab_size: int = DEBUG["vocab_size"]
    """Vocabulary size (embedding rows and output logits)."""
    rope_theta: float = DEBUG["rope_theta"]
    """Rotary embedding base (Qwen3-MoE: 1e6)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon, of the blocks' norms and the per-head query/key norms (rms_norm_eps)."""
    max_seq_len: int = DEBUG["max_seq_len"]
    """Longest sequence the rotary cache covers (max_position_embeddings)."""
    tie_embeddings: bool = DEBUG["tie_embeddings"]
    """Share the input embedding and output projection weights (tie_word_embeddings)."""
    ffn_hidden_dim: int = DEBUG["ffn_hidden_dim"]
    """SwiGLU hidden size of the dense layers (intermediate_size); unused when every layer is sparse."""
    moe_intermediate_size: int = DEBUG["moe_intermediate_size"]
    """SwiGLU hidden size of one expert."""
    num_experts: int = DEBUG["num_experts"]
    """Routed experts per sparse layer."""
    num_experts_per_tok: int = DEBUG["num_experts_per_tok"]
    """Experts each token is routed to (top-k)."""
    norm_topk_prob: bool = True
    """Rescale a token's k routing weights to sum to 1 (Qwen3-30B-A3B: true; with k = 1 no loss trains the router)."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) is a multiple of this (1: every layer), and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers (0-based) that are dense SwiGLUs of ffn_hidden_dim whatever decoder_sparse_step says."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss added to the cross-entropy (0: none; DeepSeek-V3 balances by bias instead)."""
    n_shared_experts: int = 0
    """Experts every token passes through beside its routed ones, each moe_intermediate_size wide (DeepSeek-V3: 1)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Qwen3-MoE), or a sigmoid per expert (DeepSeek-V3)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3: 2.5)."""
    bias_update_rate: float = 0.0
    """Bias balancing: each step moves every routing bias this much toward balance (0: off; DeepSeek-V3: 0.001)."""

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(self.mlp_only_layers)  # a TOML array arrives as a list

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` (0-based) is a mixture of experts: transformers' Qwen3MoeDecoderLayer rule."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_sparse(i)]

    def errors(self, seq_len: int) -> list[str]:
        """Every value this model cannot be built or trained with, naming the field and the fix."""
        errors = []
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len",
                    "ffn_hidden_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                    "decoder_sparse_step")  # fmt: skip
        errors += [f"model.{key}={getattr(self, key)} must be at least 1" for key in positive if getattr(self, key) < 1]
        if errors:
            return errors
        if self.n_heads % self.n_kv_heads:
            errors.append(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            errors.append(f"model.head_dim={self.head_dim} must be even: rotary embeddings rotate pairs of channels")
        if seq_len > self.max_seq_len:
            errors.append(f"train.seq_len={seq_len} exceeds model.max_seq_len={self.max_seq_len}: set --train.seq_len "
                          f"{self.max_seq_len} or --model.max_seq_len {seq_len}")  # fmt: skip
        if self.num_experts_per_tok > self.num_experts:
            errors.append(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds model.num_experts={self.num_experts}: "
                "a token is routed to that many different experts; set num_experts_per_tok <= num_experts"
            )
        for key in ("dim", "moe_intermediate_size"):
            if getattr(self, key) % 8:
                errors.append(
                    f"model.{key}={getattr(self, key)} must be a multiple of 8: the experts' grouped matmuls "
                    "need rows of 16 bytes at 16-bit precision"
                )
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if outside:
            errors.append(f"model.mlp_only_layers has {outside}, not layers of 0..{self.n_layers - 1}: drop them")
        for key in ("router_aux_loss_coef", "n_shared_experts", "bias_update_rate"):
            if getattr(self, key) < 0:
                errors.append(f"model.{key}={getattr(self, key)} must be >= 0 (0 turns it off)")
        if self.routed_scaling_factor <= 0:
            errors.append(f"model.routed_scaling_factor={self.routed_scaling_factor} must be > 0 (1: unscaled)")
        if self.norm_eps <= 0:
            errors.append(f"model.norm_eps={self.norm_eps} must be > 0")
        return errors

    def parallel_errors(self, parallel) -> list[str]:
        """The `[parallel]` settings this model cannot train with: an expert-parallel degree that does not divide
        the experts, float8, and compiled blocks in another precision than bf16."""
        errors, degree = [], parallel.expert_parallel
        if degree > 1 and self.num_experts % degree:
            divisors = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            errors.append(
                f"parallel.expert_parallel={degree} must divide model.num_experts={self.num_experts}: each rank holds "
                f"num_experts / degree of them; choose one of {divisors}"
            )
        if parallel.float8 != "none":
            errors.append(
                f"parallel.float8={parallel.float8}: most of model.name={self.name}'s weights are its experts, stacked "
                "3-D weights that torchao's Float8Linear does not convert, and its router must score in full "
                "precision; set parallel.float8=none"
            )
        if parallel.compile and parallel.mixed_precision != "bf16":
            errors.append(
                f"parallel.compile with parallel.mixed_precision={parallel.mixed_precision}: torch compiles the "
                "experts' grouped matmuls in bf16 only; set parallel.mixed_precision=bf16, or parallel.compile=false"
            )
        return errors


class Attention(nn.Module):
    """Qwen3's attention: grouped-query heads of head_dim, each query and key head RMS-normalised before RoPE."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: BlockCache | None = None) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # Head counts come from the projections' outputs, so a tensor-parallel plan may split the heads.
        q = self.q_norm(self.wq(x).view(bsz, seq_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(bsz, seq_len, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        cached = 0
        if cache is not None:  # generation: these positions follow the cached ones, and attend to them too
            cached = cache.length
            k, v = cache.update(k, v)
        mask = causal_mask(seq_len, cached, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cached == 0,
                                             enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class Block(nn.Module):
    """One decoder layer, sparse (`moe`) or dense (`feed_forward`); one FSDP unit, AC and compile region.

    forward returns (output, router statistics [2, experts] or None for a dense layer): the statistics
    leave the block as outputs, since a compiled block may not write attributes.
    """

    def __init__(self, cfg: Qwen3MoeConfig, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe, self.feed_forward = None, None
        if cfg.is_sparse(layer_id):
            router = Router(
                cfg.dim, cfg.num_experts, cfg.num_experts_per_tok, score_func=cfg.score_func,
                norm_topk_prob=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor, bias=cfg.bias_update_rate > 0,
                layer_id=layer_id,
            )  # fmt: skip
            shared = cfg.n_shared_experts * cfg.moe_intermediate_size
            self.moe = MoE(router, cfg.dim, cfg.moe_intermediate_size, shared)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, cache: BlockCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attention(self.attention_norm(x), rope=rope, cache=cache)
        if self.moe is None:
            return x + self.feed_forward(self.ffn_norm(x)), None
        out, stats = self.moe(self.ffn_norm(x))
        return x + out, stats


class Qwen3Moe(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, never trained or saved: init_buffers recomputes it after to_empty().
        self.register_buffer("rope", self._rope_cache(), persistent=False)
        self._router_stats: torch.Tensor | None = None  # the last forward pass's, [sparse layers, 2, experts]
        self._expert_load: torch.Tensor | None = None  # LOAD summed over the training passes since take_expert_load

    def _rope_cache(self, device=None) -> torch.Tensor:
        return rope_cache(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device)

    def forward(self, tokens: torch.Tensor, *, cache: KVCache | None = None) -> torch.Tensor:
        """Logits of every position of `tokens` (batch, seq). With a `cache` (generation), `tokens` are the
        positions after the cached ones, and their keys and values join the cache; routing is per token, so
        the experts need nothing cached."""
        h = self.tok_embeddings(tokens)
        stats = []
        rope = self.rope if cache is None else self.rope[cache.length :]
        blocks = [None] * len(self.layers) if cache is None else cache.blocks
        for layer, block_cache in zip(self.layers, blocks, strict=True):
            h, layer_stats = layer(h, rope=rope, cache=block_cache)
            if layer_stats is not None:
                stats.append(layer_stats)
        # The root is not compiled: it may keep what its blocks returned, for aux_loss and the balance.
        self._router_stats = torch.stack(stats) if stats else None
        if self.training and stats:
            load = self._router_stats[:, LOAD].detach()
            self._expert_load = load if self._expert_load is None else self._expert_load + load
        return self.output(self.norm(h))

    def load_balancing_loss(self) -> torch.Tensor:
        """The last forward pass's load-balancing loss, unweighted: transformers' `aux_loss` (0: no sparse layer)."""
        if self._router_stats is None:
            return self.output.weight.new_zeros(())
        return load_balancing_loss(self._router_stats, self.cfg.num_experts_per_tok)

    def aux_loss(self) -> torch.Tensor:
        """What the trainer adds to the cross-entropy of the last forward pass: router_aux_loss_coef x the
        load-balancing loss (transformers' `loss += router_aux_loss_coef * aux_loss`). Differentiable; scale it
        with the cross-entropy under gradient accumulation."""
        return self.cfg.router_aux_loss_coef * self.load_balancing_loss()

    def take_expert_load(self) -> torch.Tensor | None:
        """Tokens routed to each expert ([sparse layers, experts], float32) over the training forward passes
        since the last call, which restarts the count (None before any). Sum it over the data-parallel ranks
        before balance_metrics and apply_balance, so every rank moves its biases alike."""
        load, self._expert_load = self._expert_load, None
        return load

    def _routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def balance_metrics(self, load: torch.Tensor) -> dict[str, float]:
        """Per-step balance of a step's `load` (take_expert_load's, summed over ranks): max / mean tokens per
        expert of each sparse layer (1: balanced; num_experts / top_k: every token on the same k), the worst
        and mean over layers, and with bias balancing the range of the routing biases, so a collapsing
        router shows early."""
        ratio = (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).tolist()
        routers = self._routers()
        metrics = {"moe/imbalance_max": max(ratio), "moe/imbalance_mean": sum(ratio) / len(ratio)}
        metrics |= {f"moe/imbalance/layer{r.layer_id}": value for r, value in zip(routers, ratio, strict=True)}
        biases = [r.expert_bias for r in routers if r.expert_bias is not None]
        if biases:
            metrics |= {"moe/bias_min": min(b.min().item() for b in biases),
                        "moe/bias_max": max(b.max().item() for b in biases)}  # fmt: skip
        return metrics

    @torch.no_grad()
    def apply_balance(self, load: torch.Tensor) -> None:
        """Move every sparse layer's routing bias toward balance by bias_update_rate, from a step's `load`
        (take_expert_load's, summed over the data-parallel ranks); nothing without bias balancing."""
        for router, delta in zip(self._routers(), bias_update(load, self.cfg.bias_update_rate), strict=True):
            if router.expert_bias is not None:
                router.expert_bias.add_(delta.to(router.expert_bias.device))

    def tie_weights(self) -> None:
        """Share the embedding with the output head (again): `to_empty` unties them on a plain module."""
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.tok_embeddings

    def get_output_embeddings(self) -> nn.Module:
        return self.output

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style, as models/llama/model.py: N(0, 0.02), the projections into the residual stream (wo, and every
        SwiGLU's w2, the experts' too) scaled by 1/sqrt(2 n_layers); norms to 1, routing biases to 0."""
        std, residual_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:
                residual = name.endswith(("attention.wo.weight", "w2.weight", "experts.w2"))
                nn.init.normal_(param, std=residual_std if residual else std, generator=generator)
        for router in self._routers():
            if router.expert_bias is not None:
                router.expert_bias.zero_()
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (the rotary table) in place, where they now live."""
        self.rope.copy_(self._rope_cache(device=self.rope.device))
