"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Plain nn.Module code. Parallelism is applied from outside (parallelize.py, reading tp.py's plan),
so nothing here imports torch.distributed. The model is built on the meta device, sharded,
materialised with `to_empty`, and only then initialised; `init_weights` and `init_buffers` are
that last step.

Rotary embeddings use the rotate-half layout of Hugging Face's LlamaForCausalLM, so exported
weights need renaming only, no permutation (hf.py).

Its hyperparameters are `LlamaConfig`, the `[model]` table of a config with `name = "llama"`;
`BlockConfig` holds the blocks' part, which the ViT builds on too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ...presets import LLAMA3_ROPE_SCALING, LLAMA_PRESETS
from ..spec import BlockCache, KVCache, ModelConfig

# The defaults are the debug preset's (configs/debug.toml), from presets.py.
DEBUG = LLAMA_PRESETS["debug"]


@dataclass
class RopeScaling:
    """How the rotary frequencies stretch past a context: [model.rope_scaling], transformers' rope_scaling."""

    rope_type: Literal["none", "linear", "llama3", "yarn"] = "none"
    """none: frequencies from rope_theta alone; linear: position interpolation (every frequency / factor); llama3:
    Llama 3.1's long-context rule; yarn: YaRN (https://arxiv.org/abs/2309.00071). rope_frequencies has each rule."""
    factor: float = LLAMA3_ROPE_SCALING["factor"]
    """How many times longer the context becomes (8 for Llama 3.1 8B and 70B, 32 for Llama 3.2 1B and 3B)."""
    low_freq_factor: float = LLAMA3_ROPE_SCALING["low_freq_factor"]
    """llama3: wavelengths over original_max_position_embeddings / low_freq_factor are scaled in full."""
    high_freq_factor: float = LLAMA3_ROPE_SCALING["high_freq_factor"]
    """llama3: wavelengths under original_max_position_embeddings / high_freq_factor stay; those between blend."""
    original_max_position_embeddings: int = LLAMA3_ROPE_SCALING["original_max_position_embeddings"]
    """llama3, yarn: the context the model was trained with before this extension."""
    beta_fast: float = 32.0
    """yarn: channels that turn more than beta_fast times over the original context keep their frequency."""
    beta_slow: float = 1.0
    """yarn: channels that turn fewer than beta_slow times are divided by factor; those between blend."""
    attention_factor: float = 0.0
    """yarn: cos and sin are multiplied by it (sharper attention at long range); 0: YaRN's 0.1 ln(factor) + 1."""


@dataclass
class BlockConfig(ModelConfig):
    """The shapes of the pre-norm transformer blocks below (`Block`), which the decoder and the ViT share."""

    name: str = "llama"
    """Model family; models/__init__.py maps it to the module that defines it."""
    dim: int = DEBUG["dim"]
    """Hidden size."""
    n_layers: int = DEBUG["n_layers"]
    """Number of blocks; each block is one FSDP unit."""
    n_heads: int = DEBUG["n_heads"]
    """Attention heads."""
    n_kv_heads: int = DEBUG["n_kv_heads"]
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden_dim: int = DEBUG["ffn_hidden_dim"]
    """SwiGLU hidden size."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def errors(self, seq_len: int) -> list[str]:
        """Head counts that multi-head and grouped-query attention can split."""
        errors = []
        if self.dim % self.n_heads:
            errors.append(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            errors.append(f"model.n_heads={self.n_heads} must be a multiple of n_kv_heads")
        return errors


@dataclass
class LlamaConfig(BlockConfig):
    """The decoder's hyperparameters: its blocks, and the vocabulary, rotary embeddings and head around them."""

    vocab_size: int = DEBUG["vocab_size"]
    """Vocabulary size (embedding rows and output logits)."""
    rope_theta: float = DEBUG["rope_theta"]
    """Rotary embedding base."""
    rope_scaling: RopeScaling = field(default_factory=lambda: RopeScaling(**(DEBUG["rope_scaling"] or {})))
    """Rotary frequency scaling: [model.rope_scaling] (the Llama 3.x presets set the llama3 rule)."""
    max_seq_len: int = DEBUG["max_seq_len"]
    """Longest sequence the rotary cache covers (the model's context; train.seq_len is what is trained)."""
    tie_embeddings: bool = DEBUG["tie_embeddings"]
    """Share the input embedding and output projection weights."""

    def __post_init__(self) -> None:
        # LlamaConfig(**LLAMA_PRESETS[name]) gives the preset's rope_scaling as presets.py holds it: a dict or None.
        if not isinstance(self.rope_scaling, RopeScaling):
            self.rope_scaling = RopeScaling(**(self.rope_scaling or {}))

    def errors(self, seq_len: int) -> list[str]:
        """A rotary decoder: attention heads, an even head size, and sequences the rotary table covers."""
        errors = super().errors(seq_len)
        if self.dim // self.n_heads % 2:
            errors.append("model.dim / model.n_heads must be even for rotary embeddings")
        if seq_len > self.max_seq_len:
            errors.append(f"train.seq_len={seq_len} exceeds model.max_seq_len={self.max_seq_len}: set --train.seq_len "
                          f"{self.max_seq_len} or {' '.join(self.extension_flags(seq_len))} (a longer rotary table "
                          "alone would show the model positions it never trained on)")  # fmt: skip
        return errors + rope_scaling_errors(self.rope_scaling)

    def extension_flags(self, seq_len: int) -> list[str]:
        """The flags that extend the model's context to `seq_len` positions: max_seq_len, and the rotary scaling
        that stretches what the model was trained on to cover them (YaRN, unless linear is already chosen).
        Llama 3.1's llama3 rule gives way to yarn over its 131,072 positions, as long-context fine-tunes do."""
        r, key = self.rope_scaling, "--model.rope_scaling"
        flags = ["--model.max_seq_len", str(seq_len)]
        if r.rope_type == "linear":
            return [*flags, f"{key}.factor", str(r.factor * seq_len / self.max_seq_len)]
        trained = r.original_max_position_embeddings if r.rope_type == "yarn" else self.max_seq_len
        if r.rope_type != "yarn":
            flags += [f"{key}.rope_type", "yarn"]
        flags += [f"{key}.factor", str(seq_len / trained)]
        return [*flags, f"{key}.original_max_position_embeddings", str(trained)]


def rope_scaling_errors(r: RopeScaling) -> list[str]:
    """The parameters a rule reads, where they are out of its range: one line each, naming the key."""
    key = "model.rope_scaling"
    if r.rope_type == "llama3" and not (
        r.factor > 0 and 0 < r.low_freq_factor < r.high_freq_factor and r.original_max_position_embeddings > 0
    ):
        return [
            f"{key} (llama3) needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
            f"original_max_position_embeddings > 0, not {r.factor}, {r.low_freq_factor}, {r.high_freq_factor} "
            f"and {r.original_max_position_embeddings} (the Llama 3.x presets hold the published values)"
        ]
    errors = []
    if r.rope_type in ("linear", "yarn") and not r.factor >= 1:
        errors.append(f"{key}.factor={r.factor} must be at least 1 ({r.rope_type}: new context / original context)")
    if r.rope_type != "yarn":
        return errors
    if not r.original_max_position_embeddings > 0:
        errors.append(f"{key}.original_max_position_embeddings={r.original_max_position_embeddings} must be positive "
                      "(yarn: the context the model was trained with)")  # fmt: skip
    if not r.beta_slow > 0:
        errors.append(f"{key}.beta_slow={r.beta_slow} must be positive (yarn; YaRN's own is 1)")
    if not r.beta_fast > r.beta_slow:
        errors.append(f"{key}.beta_fast={r.beta_fast} must exceed beta_slow={r.beta_slow} (yarn; YaRN's own: 32, 1)")
    if not r.attention_factor >= 0:
        errors.append(f"{key}.attention_factor={r.attention_factor} must be positive, or 0 for YaRN's own "
                      "0.1 ln(factor) + 1")  # fmt: skip
    return errors


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """Angle per position of each rotated pair of channels, in float32, under `scaling.rope_type`'s rule (the
    arithmetic of transformers' modeling_rope_utils, so that its models compute what these compute).

    linear divides every frequency by `factor` (position interpolation). llama3 keeps frequencies whose
    wavelength is under original_max_position_embeddings / high_freq_factor, divides those over
    original_max_position_embeddings / low_freq_factor by `factor`, and blends the ones between: the
    model sees positions past its pretraining context as it saw nearby ones. Llama 3.1 and 3.2 weights
    were trained with it, and compute something else without it. yarn draws the same line by how many
    turns a channel makes over the original context (beta_fast, beta_slow), on a ramp over channels,
    and sharpens attention (rope_attention_factor).
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None or scaling.rope_type == "none":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(theta**exponents, head_dim, theta, scaling)
    context, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, blended, scaled)


def _yarn_frequencies(wavelength_base: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies, from theta ** (2i / head_dim) per pair i: pairs up to the one that turns beta_fast
    times over the original context keep their frequency, pairs from the one that turns beta_slow times
    on are divided by factor, and a linear ramp over the pairs between blends the two."""

    def pair_turning(turns: float) -> float:  # the (fractional) pair index whose channel turns `turns` times
        return head_dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    first, last = max(math.floor(pair_turning(s.beta_fast)), 0), min(math.ceil(pair_turning(s.beta_slow)), head_dim - 1)
    span = last - first if last != first else 0.001  # one pair: a step
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=wavelength_base.device)
    kept = 1 - ((pairs - first) / span).clamp(0, 1)  # the weight of the unscaled frequency
    return 1.0 / (s.factor * wavelength_base) * (1 - kept) + 1.0 / wavelength_base * kept


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention_factor (0.1 ln(factor) + 1 unless set), else 1."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def rope_cache(
    head_dim: int, max_seq_len: int, theta: float, device=None, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """cos and sin tables, shape (max_seq_len, 2, head_dim), in float32 (times YaRN's attention factor)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    table = torch.stack([angles.cos(), angles.sin()], dim=1)
    factor = rope_attention_factor(scaling)
    return table if factor == 1.0 else table * factor


def model_rope_cache(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """The rotary table of a model with this config: its head size, context, base and scaling."""
    return rope_cache(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device, cfg.rope_scaling)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by the cached angles of its positions: the table's first rows, or
    the rows of the positions the model was given (Llama.forward)."""
    seq_len = x.shape[-2]
    # The cache stays float32; casting here keeps bf16 activations bf16 (FSDP does not cast buffers).
    cos, sin = cache[:seq_len, 0].to(x.dtype), cache[:seq_len, 1].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class AttentionCore(nn.Module):
    """Scaled dot-product attention over q, k, v (batch, heads, seq, head_dim), a module of its own so that
    context parallelism can put attention over the whole sequence in its place (context_parallel.py swaps
    `attention.core`). It holds no parameters: state dicts, checkpoints and exports do not change."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.core = AttentionCore()

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor | None = None, cache: BlockCache | None = None
    ) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # Head counts come from the projections' outputs: under tensor parallelism each rank
        # computes only its share of the heads (parallel.tensor_parallel divides both counts).
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        if rope is not None:  # a decoder; the ViT encoder has learned positions instead
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is None:
            out = self.core(q, k, v, causal=rope is not None)
        else:  # generation: these positions follow the cached ones, and attend to them too
            cached = cache.length
            k, v = cache.update(k, v)
            gqa = k.shape[1] != q.shape[1]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(seq_len, cached, x.device),
                                                 is_causal=cached == 0, enable_gqa=gqa)  # fmt: skip
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


def causal_mask(new: int, cached: int, device=None) -> torch.Tensor | None:
    """Which keys each of `new` positions after `cached` ones may attend to (every earlier position and itself).

    None where scaled_dot_product_attention needs no mask: a prompt with nothing cached (is_causal, whose
    mask is aligned to the first key) and one new position (it sees every key).
    """
    if cached == 0 or new == 1:
        return None
    return torch.ones(new, cached + new, dtype=torch.bool, device=device).tril(diagonal=cached)


class FeedForward(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One transformer layer; each block becomes one FSDP unit (and one AC / compile region).

    With a rotary table it is a causal decoder layer; without, a bidirectional encoder layer.
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor | None = None, cache: BlockCache | None = None
    ) -> torch.Tensor:
        # rope by keyword: tensor parallelism all-gathers the first positional input only.
        if cache is None:
            x = x + self.attention(self.attention_norm(x), rope=rope)
        else:
            x = x + self.attention(self.attention_norm(x), rope=rope, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, never trained or saved: persistent=False keeps it out of
        # checkpoints, which is why init_buffers must recompute it after to_empty().
        self.register_buffer("rope", model_rope_cache(cfg), persistent=False)

    def forward(
        self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Logits of every position of `tokens` (batch, seq). `positions` (seq,) are where in their sequence those
        tokens sit, when they are not 0 .. seq - 1: context parallelism gives a rank two chunks of every sequence
        (context_parallel.py), which the rotary table must turn by their own angles. With a `cache`
        (generation), `tokens` are the positions after the cached ones, and their keys and values join the cache."""
        h = self.tok_embeddings(tokens)
        if cache is None:
            rope = self.rope if positions is None else self.rope[positions]
            for layer in self.layers:
                h = layer(h, rope)
        else:
            rope = self.rope[cache.length :]  # the rotary angles of these positions
            for layer, block_cache in zip(self.layers, cache.blocks, strict=True):
                h = layer(h, rope, cache=block_cache)
        return self.output(self.norm(h))

    def tie_weights(self) -> None:
        """Share the embedding with the output head (again).

        Materialising a plain module from meta (`to_empty`) gives each module a new Parameter,
        which silently unties them; FSDP keeps the tie, DDP and single-device runs do not.
        """
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.tok_embeddings

    def get_output_embeddings(self) -> nn.Module:
        return self.output

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)."""
        std, residual_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith(("attention.wo", "feed_forward.w2"))
                nn.init.normal_(module.weight, std=residual_std if is_residual else std, generator=generator)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute non-persistent buffers in place, on whatever device they now live on."""
        self.rope.copy_(model_rope_cache(self.cfg, device=self.rope.device))
