"""A language model's loss in chunks of positions (train.loss_chunk), so that no rank ever holds the logits of a
whole micro-batch, nor their gradient.

Why: the logits are the largest activation of a long sequence. A rank that holds 16,384 positions of a 128,256-word
vocabulary holds 4.2 GB of bf16 logits, 8.4 GB more in fp32 for the cross-entropy, and as much again for the
log-softmax and its gradient; a chunk of 2,048 positions holds an eighth of one fp32 copy, and only while it is
computed. PLAN.md's memory table counts one or the other (plan/memory.py says when each applies).

How: `apply_chunked_loss` makes the model's output layer a ChunkedHead, the same nn.Linear (the same parameter,
under the same name, in the same FSDP group). Inside `scoring(head, targets)`, its forward takes the final hidden
states and returns each position's cross-entropy instead of its logits; the model returns that as it would have
returned the logits. Being the head's own forward, it runs inside FSDP's hooks: the weight is gathered once for all
the chunks, and its gradient is reduce-scattered once. Forward computes each chunk's logits, their log-sum-exp
and the target's logit, and keeps the hidden states, the weight and one float per position; backward computes
each chunk's logits again, turns them into softmax - one-hot, and from that the chunk's hidden-state gradient and
its share of the weight's, summed into one buffer (Liger's fused linear cross-entropy does the same in forward, and
keeps both gradients from forward to backward instead; torchtune's chunked loss keeps every chunk's logits).
The matmuls and the cross-entropy's arithmetic are the whole computation's, so in fp32 the loss and the gradients
equal it within rounding (the chunked-loss tests: 1e-6). Below fp32 the weight's gradient is summed chunk by
chunk in the compute dtype (as Liger does, and autograd where a weight is used more than once), which rounds once a
chunk: in bf16, 16 chunks of 512 positions put its largest error at 1.2e-2 of its largest value, 3.8e-3 whole;
an fp32 sum would cost 4 bytes a weight more.

Tensor parallelism: the weight is split by vocabulary over the group's ranks, and the loss is computed on each
rank's share of the vocabulary (loss parallelism, as torch's loss_parallel and Megatron's vocabulary-parallel
cross-entropy): per chunk, one all-reduce of the logits' maxima and one of the exponentials' sums and the
targets' logits, a few floats per position, instead of gathering V logits per position. The hidden-state gradient
is then each rank's partial sum, which DTensor reduces on its way back into the sequence-parallel activations.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from .config import TrainConfig, UsageError
from .data import IGNORE_INDEX

logger = logging.getLogger(__name__)


def loss_chunk(*, train: TrainConfig, context_parallel: int, logits: int = 0) -> int:
    """Positions per chunk of the loss, or 0 for the whole logits: train.loss_chunk where a rank's micro-batch has
    more positions that produce logits (`logits` per sample, the model shape's: 0 for every token, 1 for a
    classifier's one). The planner (plan/memory.py, and the template's hooks/plan.jinja at question time) applies
    the same rule."""
    positions = (logits or train.seq_len) * train.micro_batch_size // context_parallel
    return train.loss_chunk if 0 < train.loss_chunk < positions else 0


@dataclass
class Scoring:
    """What the head reads and writes while scoring() is open."""

    targets: torch.Tensor
    """The positions' target classes (IGNORE_INDEX: not scored), shaped as the hidden states without their width."""
    predictions: torch.Tensor | None = None
    """With predict=True, each position's most likely class (argmax of its logits), for validation's accuracy."""
    predict: bool = False


class ChunkedHead(nn.Linear):
    """The model's output layer, computing the cross-entropy chunk by chunk while scoring() is open."""

    chunk: int
    """Positions per chunk."""
    scoring: Scoring | None
    """Set by scoring() while it is open."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of `hidden` (..., h); while scoring() is open, each position's loss (...) in fp32 instead."""
        if self.scoring is None:  # generation, exports, probes: the logits
            return super().forward(hidden)
        targets = self.scoring.targets
        weight, mesh = self.weight, None
        if isinstance(weight, DTensor):  # tensor parallelism: this rank's rows of the vocabulary
            mesh = weight.device_mesh
            # Each rank's hidden-state gradient is its vocabulary's share of the whole: a partial sum.
            hidden = hidden.to_local(grad_placements=[Partial()]) if isinstance(hidden, DTensor) else hidden
            weight = weight.to_local()
        shape, device = hidden.shape[:-1], hidden.device.type
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if torch.is_autocast_enabled(device):  # DDP's mixed precision: the matmuls autocast would run
            dtype = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        vocab = _Vocabulary(mesh.get_group(), mesh.get_local_rank() * weight.shape[0]) if mesh is not None else None
        with torch.autocast(device, enabled=False):
            if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
                losses = _ChunkedCrossEntropy.apply(hidden, weight, targets.reshape(-1), self.chunk, vocab)
            else:  # validation: no backward, and the predictions
                losses, _, predictions = _forward(hidden, weight, targets.reshape(-1), self.chunk, vocab,
                                                  predict=self.scoring.predict)  # fmt: skip
                if predictions is not None:
                    self.scoring.predictions = predictions.view(shape)
        losses = losses.view(shape)
        # The tensor-parallel style gathers a DTensor output: every rank of the group has every loss already.
        return DTensor.from_local(losses, mesh, [Replicate()], run_check=False) if mesh is not None else losses


def apply_chunked_loss(model: nn.Module, chunk: int) -> None:
    """Make the model's output layer a ChunkedHead of `chunk` positions (0: leave it). Before tensor parallelism and
    FSDP, which keep the class they find (FSDP subclasses it)."""
    if not chunk:
        return
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise UsageError(
            f"train.loss_chunk={chunk}: the chunked loss computes the output layer itself, and this model's is "
            f"{type(head).__name__}, not an nn.Linear; set train.loss_chunk=0"
        )
    if reason := getattr(model, "chunked_loss_refusal", ""):
        raise UsageError(f"train.loss_chunk={chunk}: {reason}; set train.loss_chunk=0")
    head.__class__ = ChunkedHead
    head.chunk, head.scoring = chunk, None
    logger.info("the loss in chunks of %d positions (train.loss_chunk): the logits are never whole", chunk)


def chunked_head(model: nn.Module) -> ChunkedHead | None:
    """The model's ChunkedHead (None: it computes whole logits); `model` may be wrapped (DDP)."""
    return next((m for m in model.modules() if isinstance(m, ChunkedHead)), None)


@contextmanager
def scoring(head: ChunkedHead | None, targets: torch.Tensor, *, predict: bool = False) -> Iterator[Scoring | None]:
    """While open, the model returns each position's loss against `targets` instead of its logits (a no-op without
    a chunked head). `predict` (validation, under no_grad) also records each position's most likely class."""
    if head is None:
        yield None
        return
    head.scoring = Scoring(targets, predict=predict)
    try:
        yield head.scoring
    finally:
        head.scoring = None


def cross_entropy(out: torch.Tensor, targets: torch.Tensor, *, chunked: bool, reduction: str = "mean") -> torch.Tensor:
    """The cross-entropy of the model's output, the mean or sum over the targets that are scored (not IGNORE_INDEX):
    `out` is the logits (..., V), or with `chunked` the per-position losses scoring() makes the model return."""
    if not chunked:
        return F.cross_entropy(out.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction=reduction)  # fmt: skip
    total = out.sum()  # unscored positions are 0
    return total if reduction == "sum" else total / targets.ne(IGNORE_INDEX).sum()


@dataclass(frozen=True)
class _Vocabulary:
    """Tensor parallelism: this rank holds rows start .. start + rows of the vocabulary; the group holds all."""

    group: dist.ProcessGroup
    start: int


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One chunk's logits in fp32 (the compute dtype's copy is freed on return)."""
    return (hidden @ weight.T).float()


def _targets(targets: torch.Tensor, rows: int, vocab: _Vocabulary | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the targets' columns in this rank's logits, clamped into them; whether the target is scored and there)."""
    local = targets - vocab.start if vocab is not None else targets
    here = (targets != IGNORE_INDEX) & (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), here


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, vocab: _Vocabulary | None,
    *, predict: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(each position's loss, each position's log-sum-exp, each position's argmax if `predict`), chunk by chunk.

    The loss is log(sum exp(x - max)) - (x_target - max): log_softmax's own arithmetic, which F.cross_entropy
    negates; unscored positions lose 0.
    """
    n, rows = hidden.shape[0], weight.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(losses)
    predictions = torch.empty(n, dtype=torch.long, device=hidden.device) if predict else None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        logits = _logits(hidden[start:end], weight)
        column, here = _targets(targets[start:end], rows, vocab)
        target = torch.where(here, logits.gather(1, column[:, None]).squeeze(1), 0.0)
        high, best = logits.max(dim=-1)
        if vocab is not None:
            local_high = high.clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=vocab.group)
        sums = logits.sub_(high[:, None]).exp_().sum(dim=-1)  # in place: the chunk's one fp32 copy
        del logits
        if vocab is not None:  # the exponentials' sums, and the one rank's target logit
            both = torch.stack([sums, target])
            dist.all_reduce(both, group=vocab.group)
            sums, target = both[0], both[1]
        log_sums = sums.log()
        scored = targets[start:end] != IGNORE_INDEX
        losses[start:end] = torch.where(scored, log_sums - (target - high), 0.0)
        lse[start:end] = high + log_sums
        if predictions is not None:
            if vocab is not None:  # the first class with the highest logit, as argmax: the lowest of the ranks'
                best = torch.where(local_high == high, best + vocab.start, torch.iinfo(torch.long).max)
                dist.all_reduce(best, op=dist.ReduceOp.MIN, group=vocab.group)
            predictions[start:end] = best
    return losses, lse, predictions


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Each position's cross-entropy of hidden @ weight.T against its target, chunk by chunk in forward and again
    in backward: no more than one chunk's logits exist at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, vocab: _Vocabulary | None):
        losses, lse, _ = _forward(hidden, weight, targets, chunk, vocab)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.vocab = chunk, vocab
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        rows = weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None  # LoRA freezes the head: none
        # Unscored positions have no gradient; each scored one's is its loss's gradient x (softmax - one-hot).
        scale = torch.where(targets != IGNORE_INDEX, grad_losses, 0.0)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            chunk = hidden[start:end]
            probs = _logits(chunk, weight).sub_(lse[start:end, None]).exp_()  # the softmax, in place
            column, here = _targets(targets[start:end], rows, ctx.vocab)
            probs.scatter_add_(1, column[:, None], -here[:, None].to(probs.dtype))
            grad = probs.mul_(scale[start:end, None]).to(hidden.dtype)
            del probs
            if want_hidden:
                torch.mm(grad, weight, out=grad_hidden[start:end])
            if want_weight:
                grad_weight.addmm_(grad.T, chunk)
            del grad  # before the next chunk's logits
        return grad_hidden, grad_weight, None, None, None
