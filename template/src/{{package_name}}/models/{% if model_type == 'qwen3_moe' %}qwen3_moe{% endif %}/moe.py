"""The mixture-of-experts layer: a token-choice top-k router, SwiGLU experts computed with grouped matmuls,
optional shared experts, and a pluggable token dispatcher.

Plain torch, no torch.distributed: expert parallelism replaces `MoE.dispatcher` from outside
(parallelize.py's business), and nothing else here changes. A forward pass is

    router      scores (softmax, or sigmoid) of every expert for every token; each token picks its
                top k (with `expert_bias` added for the choice only, when bias balancing is on)
    dispatch    the T k token copies, grouped by the expert that computes them (Dispatcher)
    experts     one grouped matmul per projection over the groups (GroupedExperts)
    combine     the copies back in (token, slot) order, weighted by their routing weights and summed
    shared      experts every token passes through, added (DeepSeek-V3; none for Qwen3-MoE)

The layer also returns its router statistics rather than keeping them: blocks are compiled with
fullgraph=True, so a forward pass may not write attributes. The root model pools them into the
load-balancing loss (`load_balancing_loss`) and counts each expert's load for the bias update.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

LOAD, PROB = 0, 1
"""Rows of a layer's router statistics ([2, experts], float32): tokens routed to each expert (no gradient),
and the sum over tokens of each expert's routing probability (differentiable: the aux loss's gradient)."""


class Dispatcher(Protocol):
    """Moves token copies to the experts that compute them, and back.

    `dispatch(x, expert_ids, tokens_per_expert)` takes this rank's tokens `x` [T, dim], the experts each
    picked `expert_ids` [T, k] (int64, global ids in [0, num_experts)), and how many copies each expert
    gets from them, `tokens_per_expert` [num_experts] (float32, from the router's statistics). It returns

        rows     [N, dim]: the copies this rank's experts compute, grouped by local expert (the first
                 local expert's copies first, then the next's)
        counts   [num_local_experts] int32: rows per local expert (they sum to N; an expert may get 0)
        handle   whatever `combine` needs (the sort order; under expert parallelism the split sizes too)

    `combine(rows, handle)` takes the experts' outputs for those rows [N, dim] and returns this rank's
    copies [T k, dim] in (token, slot) order: row t k + j is token t's copy for its j-th expert.

    LocalDispatcher keeps every expert on this rank (N = T k, shapes fixed: a block compiles in one
    graph). An expert-parallel dispatcher holds num_experts / ep experts per rank (GroupedExperts'
    weights are then that slice, [E / ep, ...]): it all-to-alls the counts first, then the rows
    (variable sizes, so N depends on the routing), regroups what it received by local expert, and in
    `combine` sends the outputs back the same way. Both ends must be differentiable (the autograd
    all-to-all of torch.distributed._functional_collectives). A dispatcher is an nn.Module without
    parameters or buffers: it replaces the MoE's `dispatcher` submodule and leaves the state dict as is.
    """

    def dispatch(
        self, x: torch.Tensor, expert_ids: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor: ...


class LocalDispatcher(nn.Module):
    """Every expert on this rank: sort the copies by expert (a stable sort, so each expert sees its tokens in order)."""

    def dispatch(
        self, x: torch.Tensor, expert_ids: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        order = torch.argsort(expert_ids.flatten(), stable=True)  # copy slots, grouped by expert
        rows = x.index_select(0, order // expert_ids.shape[1])
        # Where each copy slot's row went: combine gathers by it (index_select keeps only the indices for
        # backward, where index_copy would keep the experts' outputs too).
        inverse = torch.zeros_like(order).scatter(0, order, torch.arange(order.numel(), device=order.device))
        return rows, tokens_per_expert.to(torch.int32), inverse

    def combine(self, rows: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        return rows.index_select(0, handle)


class Router(nn.Module):
    """Token-choice top-k routing: transformers' Qwen3MoeTopKRouter (softmax), or DeepSeek-V3's sigmoid scores.

    Scores are computed in float32 whatever the compute dtype, as transformers does, so the choice of
    experts does not depend on bf16 rounding. `expert_bias` (bias balancing only) shifts which experts
    are chosen but not the weights their outputs get, so it needs no gradient: the root model moves it
    between steps from the tokens each expert received (DeepSeek-V3's auxiliary-loss-free balancing).
    """

    def __init__(
        self, dim: int, num_experts: int, top_k: int, *, score_func: Literal["softmax", "sigmoid"],
        norm_topk_prob: bool, scale: float = 1.0, bias: bool = False, layer_id: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.norm_topk_prob, self.scale, self.layer_id = norm_topk_prob, scale, layer_id
        if bias:  # persistent: checkpoints carry it, and an exact resume routes as the run did
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] (in x's dtype), expert ids [T, k] and statistics [2, experts] of tokens x [T, dim]."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        chosen = scores if self.expert_bias is None else scores + self.expert_bias
        expert_ids = chosen.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # histc has a fixed output size (bincount's depends on the data): no graph break when compiled.
        load = torch.histc(expert_ids.flatten().float(), bins=self.num_experts, min=0, max=self.num_experts)
        # The aux loss's probabilities: softmax scores, or sigmoid scores normalised per token (DeepSeek-V3).
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        stats = torch.stack([load, probs.sum(0)])
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights.to(x.dtype), expert_ids, stats


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w1 (gate) and w3 (up) [experts, hidden, dim], w2 (down)
    [experts, dim, hidden], computed with one grouped matmul per projection over rows grouped by expert.

    torchtitan's layout rather than transformers' fused gate_up [experts, 2 hidden, dim]: tensor or
    expert-tensor parallelism then splits each weight's hidden dimension without un-interleaving gate
    from up, torchao's float8 grouped matmuls convert this layout, and each of the checkpoint files'
    per-expert tensors is one slice of one weight. The cost is two grouped matmuls where one could do.
    Under expert parallelism the weights are DTensors sharded by expert: forward computes with this
    rank's slice (to_local), so num_experts here is the local count.
    """

    fsdp_shard_dim = 1
    """FSDP shards these weights along dim 1 (parallelize.shard_placement): the state-dict adapter splits
    them per expert along dim 0, which DTensor allows only along a dimension that is not sharded."""
    split_by_expert = False
    """Set by expert parallelism (expert_parallel.apply_ep), whose weights are DTensors sharded by expert. An
    attribute rather than a look at the weight's type: a compiled block reads it as a constant."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each row [N, dim] by the expert of its group; `counts` [experts] int32 are the group sizes.

        grouped_mm needs 16-byte strides: dim and hidden multiples of 8 at 16-bit precision (errors() checks).
        Eagerly it runs in fp32 too (on CPU, equal to a per-expert loop; CUDA's fast kernels take bf16), but
        torch 2.13 compiles it in bf16 only (its meta function refuses fp32 and fp16): a compiled block
        needs bf16 compute.
        """
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.split_by_expert:  # this rank's experts
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        if torch.is_autocast_enabled(rows.device.type):
            # Autocast casts mm's operands, not grouped_mm's: cast them as it would, or fp32 weights (one rank trains
            # without FSDP's cast, under autocast) meet bf16 rows, or fp32 rows from the norm reach a compile.
            dtype = torch.get_autocast_dtype(rows.device.type)
            rows, w1, w2, w3 = rows.to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype)
        gate = F.grouped_mm(rows, w1.transpose(-2, -1), offs=offsets)
        up = F.grouped_mm(rows, w3.transpose(-2, -1), offs=offsets)
        return F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)


class FeedForward(nn.Module):
    """A dense SwiGLU: the MLP of dense layers (transformers' Qwen3MoeMLP) and the shared experts."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A sparse MLP: routed experts (grouped), and shared experts beside them when `shared_hidden` > 0."""

    def __init__(self, router: Router, dim: int, hidden: int, shared_hidden: int = 0) -> None:
        super().__init__()
        self.router = router
        self.experts = GroupedExperts(router.num_experts, dim, hidden)
        # DeepSeek-V3 holds its shared experts as one SwiGLU of their summed width: the same function.
        self.shared_experts = FeedForward(dim, shared_hidden) if shared_hidden else None
        self.dispatcher: Dispatcher = LocalDispatcher()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output for `x` [batch, seq, dim], and its router statistics [2, experts] (LOAD, PROB)."""
        tokens = x.reshape(-1, x.shape[-1])
        weights, expert_ids, stats = self.router(tokens)
        rows, counts, handle = self.dispatcher.dispatch(tokens, expert_ids, stats[LOAD])
        copies = self.dispatcher.combine(self.experts(rows, counts), handle)
        out = (copies.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(x.shape), stats


def load_balancing_loss(stats: torch.Tensor, top_k: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer, eq. 4-6), from the router statistics of
    every sparse layer of one forward pass, `stats` [layers, 2, experts]:

        E sum_i f_i P_i,   f_i = (tokens routed to expert i, over all layers) / (L T)
                           P_i = (routing probability of expert i, summed over all layers and tokens) / (L T)

    for E experts, L sparse layers and T tokens. Like transformers it pools the layers before the product
    (not a mean of per-layer losses), counts each of a token's k choices (so sum_i f_i = k), and gets its
    gradient through P only. It is k at perfect balance (f_i = k / E, P_i = 1 / E).
    """
    num_experts = stats.shape[-1]
    rows = stats[:, LOAD].sum() / top_k  # L T
    return num_experts * (stats[:, LOAD].sum(0) / rows * (stats[:, PROB].sum(0) / rows)).sum()


def bias_update(load: torch.Tensor, rate: float) -> torch.Tensor:
    """How much each expert's routing bias moves after a step in which experts received `load` tokens
    ([..., experts]): `rate` toward the mean (up for underloaded experts, down for overloaded), centred so
    the biases do not drift together (torchtitan's form of DeepSeek-V3's update)."""
    delta = rate * torch.sign(load.mean(-1, keepdim=True) - load)
    return delta - delta.mean(-1, keepdim=True)
