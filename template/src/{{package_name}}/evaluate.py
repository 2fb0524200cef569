"""Validation: the loss on held-out batches (data.HeldOut), exact at any world size.

Each rank sums the loss and counts the correct predictions and the targets of its slice; one
all-reduce of those sums gives the mean over every held-out target, the same at 1, 2 or 4 ranks.
Targets that are not scored (data.IGNORE_INDEX: the prompts of sft chats) count nowhere.
It runs under no_grad with the model in eval mode, draws no random numbers and reads its own
loader, so training goes on exactly as it would have without it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .checkpoint import verify
from .config import CheckpointConfig, EvalConfig, UsageError
from .context_parallel import SequenceSplit
from .data import IGNORE_INDEX
from .loss import chunked_head, scoring

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class EvalResult:
    loss: float
    """Mean cross-entropy over every held-out target (token or image)."""
    accuracy: float
    """Share of targets whose top-1 prediction is right."""
    targets: int
    """Held-out targets scored, over all ranks."""
    seconds: float
    """Wall time of the evaluation."""
    classifier: bool
    """One label per sample (a ViT), rather than one target per token (a decoder)."""

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows a float beyond ~709

    def scalars(self) -> dict[str, float]:
        """What is reported: loss and top-1 accuracy for a classifier, loss and perplexity for a decoder."""
        second = {"accuracy": self.accuracy} if self.classifier else {"perplexity": self.perplexity}
        return {"loss": self.loss, **second}


def evaluate(
    model: nn.Module,
    batches: Iterable[list[Batch]],
    device: torch.device,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    group: dist.ProcessGroup | None = None,
    split: SequenceSplit | None = None,
) -> EvalResult:
    """Score every micro-batch of `batches` (each step's list), summed over ranks; call it on every rank.

    Every rank must pass the same number of batches: with FSDP each forward all-gathers.
    `autocast` is the strategy's: DDP computes in low precision under autocast, FSDP casts itself.
    `group` holds the ranks that split the batches (the strategy's dp_group; None: all ranks):
    the ranks of a tensor-parallel group score the same samples, so only one of each is summed.
    `split` is context parallelism's (step.StepContext.sequence_split): each rank of the group scores its chunks
    of every sequence, and the group is among the ranks whose sums add up. A model whose head computes the loss
    in chunks (loss.py) is scored so too: its logits are never whole here either.
    """
    started = time.perf_counter()
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, targets
    classifier, head = False, chunked_head(model)
    try:
        with torch.no_grad():
            for micro_batches in batches:
                for inputs, targets in micro_batches:
                    positions = None
                    if split is not None:
                        inputs, targets, positions = split(inputs, targets)
                    with autocast(), scoring(head, targets, predict=True) as scored:
                        # model(x): FSDP's hooks live in __call__
                        out = model(inputs) if positions is None else model(inputs, positions=positions)
                    classifier, flat = targets.ndim == 1, targets.flatten()
                    if scored is not None:  # each position's loss (0 where not scored), and its prediction
                        totals[0] += out.sum().double()
                        totals[1] += (scored.predictions.flatten() == flat).sum()
                    else:
                        logits = out.flatten(0, -2).float()
                        totals[0] += F.cross_entropy(logits, flat, reduction="sum").double()
                        totals[1] += (logits.argmax(-1) == flat).sum()
                    totals[2] += (flat != IGNORE_INDEX).sum()  # every target, but the unscored ones of sft
    finally:
        model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(totals, group=group)
    loss_sum, correct, count = totals.tolist()
    return EvalResult(loss_sum / count, correct / count, int(count), time.perf_counter() - started, classifier)


def check_eval_only(*, eval: EvalConfig, checkpoint: CheckpointConfig, run_dir: Path) -> None:
    """--eval-only with checkpoint.resume=auto: refuse a run dir without a checkpoint before the group starts."""
    root = Path(run_dir) / "checkpoints"
    if eval.only and checkpoint.resume == "auto" and not _complete(root):
        raise UsageError(
            f"--eval-only found no complete checkpoint in {root}: point --run_dir at a run that saved one, or pass "
            "--checkpoint.resume <checkpoint dir>"
        )


def checkpoint_to_evaluate(*, checkpoint: CheckpointConfig, run_dir: Path, rank: int) -> Path:
    """checkpoint.resume, or with auto the newest complete checkpoint, chosen by rank 0 and shared.

    Read-only, unlike CheckpointManager.resume_path, which clears what unfinished saves left: here
    those may belong to a run that is still training in the same directory.
    """
    choice = [checkpoint.resume]
    if rank == 0 and checkpoint.resume == "auto":
        choice[0] = str(_complete(Path(run_dir) / "checkpoints")[0])
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, newest first."""
    return [p for p in sorted(root.glob("step_*"), reverse=True) if ".partial" not in p.name and not verify(p)]
