"""Context parallelism (parallel.context_parallel): the ranks of a group split every sequence between them, so
each holds the activations of 1/degree of its tokens, and attention, the one part of a block that mixes
positions, runs as DeepSpeed-Ulysses (https://arxiv.org/abs/2309.14509).

Why Ulysses: torch's ring attention (`torch.distributed.tensor.experimental.context_parallel`) has no CPU
path, while `all_to_all_single_autograd` runs on gloo and NCCL alike, backpropagates, and compiles; so the
code the CPU tests prove is the code a GPU runs, and only the kernel that SDPA picks differs. Per block,
q, k and v (sharded by sequence) are swapped by one all-to-all each to be sharded by heads; every rank
then attends over the whole sequence with 1/degree of the heads (the model's own attention core, e.g.
flash attention on a GPU) and one all-to-all swaps the output back.

The sequence is split as torchtitan splits it (head-tail load balancing): in 2 x degree chunks, rank r
holds chunks r and 2 x degree - 1 - r, so that under a causal mask each rank has as much work as the
others. Inputs, targets (IGNORE_INDEX included) and the positions the rotary table is read at are split
alike (`SequenceSplit`); once an all-to-all has gathered the sequence, attention puts it in natural order
for the causal mask, and back after. The data, the weights and the checkpoints do not depend on this
layout, so a ring or all-gather attention could replace Ulysses without changing them.

The group reads the same batches (data splits over the data-parallel ranks, as for a tensor-parallel
group), FSDP shards parameters over data-parallel x context-parallel ranks (distributed.build_mesh's
"dp_shard_cp"), and the loss needs nothing more: each rank's mean over its tokens, averaged by FSDP's
gradient reduction over the group, is the mean over the sequence (step.scaled_loss says why SFT's count
holds too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .models.spec import ContextParallelPlan


def chunk_order(degree: int) -> list[int]:
    """The chunks of a sequence cut in 2 x degree, in the order the ranks of a group hold them: rank r holds
    the r-th pair, chunks r and 2 x degree - 1 - r."""
    return [chunk for rank in range(degree) for chunk in (rank, 2 * degree - 1 - rank)]


def rank_positions(seq_len: int, rank: int, degree: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions (of 0 .. seq_len - 1) whose tokens `rank` of a context-parallel group holds, in its order."""
    chunk = seq_len // (2 * degree)
    first, second = rank, 2 * degree - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])  # fmt: skip


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's share of every micro-batch: its two chunks of each sequence (head and tail), and their
    positions. Called by train_step and evaluate on whole micro-batches, the same on every rank of the group."""

    rank: int
    """This rank's index in its context-parallel group."""
    degree: int
    """Ranks in the group."""

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, positions) of this rank: the tokens and targets (batch, seq / degree) it holds, and
        the positions (seq / degree,) they sit at, which the model's position embeddings read."""
        positions = rank_positions(inputs.shape[1], self.rank, self.degree, inputs.device)
        return inputs[:, positions], targets[:, positions], positions


class UlyssesAttention(nn.Module):
    """The attention core of a block, over the whole sequence of a context-parallel group: q, k and v come in
    (batch, heads, seq / degree, head_dim) and are swapped to (batch, heads / degree, seq, head_dim) by
    all-to-alls, `inner` (the model's own core) attends, and the output is swapped back.

    Grouped-query attention splits the key/value heads when the degree divides them, else repeats them to the
    query heads first. It holds no parameters, like the core it wraps: state dicts do not change.
    """

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, degree: int):
        super().__init__()
        self.inner, self.group, self.degree = inner, group, degree

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
        if k.shape[1] % self.degree:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = self.inner(self._to_heads(q), self._to_heads(k), self._to_heads(v), causal=causal)
        return self._to_sequence(out)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(b, heads, s, d) sharded by sequence -> (b, heads / degree, degree x s, d) in natural order."""
        n, (b, heads, s, d) = self.degree, x.shape
        # Rank j is sent heads j x heads / n onwards; all-to-all works on the first dimension.
        x = x.reshape(b, n, heads // n, s, d).transpose(0, 1).contiguous()
        x = _all_to_all(x, self.group)  # (n, b, heads / n, s, d): rank i's part
        # Rank i held chunks i and 2n - 1 - i: chunks 0 .. n - 1 are the first halves in rank order,
        # chunks n .. 2n - 1 the second halves in reverse rank order.
        x = x.permute(1, 2, 0, 3, 4).reshape(b, heads // n, n, 2, s // 2, d)
        return torch.cat([x[:, :, :, 0], x[:, :, :, 1].flip(2)], dim=2).reshape(b, heads // n, n * s, d)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of _to_heads: (b, heads / degree, seq, d) in natural order -> (b, heads, seq / degree, d)."""
        n, (b, heads, seq, d) = self.degree, x.shape
        chunks = x.reshape(b, heads, 2 * n, seq // (2 * n), d)
        pairs = torch.stack([chunks[:, :, :n], chunks[:, :, n:].flip(2)], dim=3)  # (b, heads, n, 2, chunk, d)
        x = pairs.reshape(b, heads, n, seq // n, d).permute(2, 0, 1, 3, 4).contiguous()
        x = _all_to_all(x, self.group)  # (n, b, heads, s, d): heads of rank i
        return x.transpose(0, 1).reshape(b, n * heads, seq // n, d)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal parts of x's first dimension to each rank of `group`, differentiable and traceable: torch's functional
    collectives, private, so imported only where a context-parallel run arrives."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, None, None, group)


def apply_cp(model: nn.Module, mesh, plan: ContextParallelPlan) -> None:
    """Swap every block's attention core (plan.core) for Ulysses attention over the ranks of `mesh` (one
    context-parallel group). Before activation checkpointing and compile wrap the blocks (parallelize)."""
    group, degree = mesh.get_group(), mesh.size()
    parent_path, _, name = plan.core.rpartition(".")
    for block in model.layers:
        parent = block.get_submodule(parent_path)
        setattr(parent, name, UlyssesAttention(getattr(parent, name), group, degree))
