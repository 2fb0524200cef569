"""Rank-aware logging, throughput, MFU, memory, and the run's metrics file."""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .config import MetricsConfig
from .evaluate import EvalResult
from .models import ModelShape
from .models.lora import frozen_matmul_params
from .presets import PEAK_TFLOPS

logger = logging.getLogger(__name__)


_WARNED: set[tuple[str, str]] = set()
"""The warnings this process has given (logger, text): each is given once (init_logging's filter)."""


def _first_time(record: logging.LogRecord) -> bool:
    """A warning this process has given already is dropped: the launch-time checks and the build both resolve
    the backend, for one, and would say twice that it falls back to gloo. INFO lines all pass."""
    if record.levelno < logging.WARNING:
        return True
    key = (record.name, record.getMessage())
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


def init_logging(rank: int) -> None:
    """INFO from rank 0 only; warnings and errors from every rank, tagged with the rank, except the
    warnings every rank would give alike (extra=config.JOB_WIDE), which rank 0 alone prints; each
    warning once."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_first_time)
        if rank != 0:
            handler.addFilter(lambda record: not getattr(record, "job_wide", False))
    # torch warns, on every rank, that a selective-checkpointing policy under torch.compile must not meet an
    # in-place op. The policy is this repo's (parallelize.apply_ac), and the generated tests check it: the
    # compiled, checkpointed blocks give the eager run's gradient norm (tests/test_fsdp_rules.py).
    logging.getLogger("torch._higher_order_ops.wrap").setLevel(logging.ERROR)


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """Peak TFLOP/s of one device: the configured value, else looked up by name; None if unknown."""
    if configured > 0:
        return configured
    if device.type == "cpu":
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.xpu.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory, or the process's peak resident memory on the CPU."""
    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return torch.accelerator.max_memory_allocated(device) / 2**30


def flops_per_token(shape: ModelShape, model: torch.nn.Module, tokens: int) -> float:
    """Training FLOPs per token for MFU: the model's count (ModelShape.flops_per_token), with 6 for each parameter
    the built model has beyond it (LoRA's adapters), less the weight gradients that frozen weights skip (2 each)."""
    added = sum(p.numel() for p in model.parameters()) - shape.P
    return shape.flops_per_token(tokens) + 6 * added - 2 * frozen_matmul_params(model)


@dataclass(frozen=True)
class Outcome:
    """What one job of a run did (train.train_loop), for the summary it ends with (summary)."""

    start: int
    """The step it started after (0, or the checkpoint it resumed)."""
    step: int
    """The step it reached."""
    tokens: int
    """Tokens it trained on, over every rank."""
    seconds: float
    loss: tuple[int, float] | None
    """The last logged step and its loss (None: no step was logged)."""
    val_loss: tuple[int, float] | None
    """The last validation's step and loss (None: none ran)."""
    stopped: str
    """Why it stopped before train.steps (train.stop_after_steps, a preemption signal); "" when it did not."""


def summary(outcome: Outcome, *, steps: int, checkpoint: Path | None, export: Path | None,
            next_steps: list[tuple[str, str]]) -> str:  # fmt: skip
    """The lines a run ends with: what it did, where its checkpoint and export are, and what to run next
    (`next_steps`: (what, command) pairs, train.next_steps)."""
    o = outcome
    figures = f"steps {o.start + 1}-{o.step} of {steps}, {o.tokens:,} tokens in {o.seconds:.0f} s"
    if o.step == o.start:
        figures = f"no step taken (step {o.step} of {steps})"
    scores = [f"{name} {value[1]:.4f} at step {value[0]}" for name, value in (("loss", o.loss),
              ("validation loss", o.val_loss)) if value is not None]  # fmt: skip
    head = f"stopped ({o.stopped})" if o.stopped else "done"
    lines = [f"{head}: {figures}" + (f"; {', '.join(scores)}" if scores else "")]
    lines += [f"  {name:<11} {path}" for name, path in (("checkpoint", checkpoint), ("export", export)) if path]
    if next_steps:
        lines.append("next:")
        lines += [f"  {what:<11} {command}" for what, command in next_steps]
    return "\n".join(lines)


class MetricsLogger:
    """Logs on rank 0 every `log_every` steps: the console, metrics.jsonl, and TensorBoard or W&B.

    Also times the data loading of each step and runs the optional profiler window.
    """

    def __init__(
        self, *, metrics: MetricsConfig, run_dir: Path, run_config: dict, steps: int, enabled: bool, start_step: int,
        tokens_per_step: int, world_size: int, flops_per_token: float, peak_tflops: float | None,
        device: torch.device, rank: int, compiles: bool = False,
    ):  # fmt: skip
        m = metrics
        self.enabled, self.log_every, self.device = enabled, m.log_every, device
        self.tokens_per_step, self.world_size = tokens_per_step, world_size
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.file = (run_dir / "metrics.jsonl").open("a") if enabled else None
        self.bar = tqdm(total=steps, initial=start_step, disable=not (enabled and m.progress_bar), unit="step")
        self.last_time, self.last_step, self.data_seconds = time.perf_counter(), start_step, 0.0
        self.sink = _sink(m, run_dir, run_config) if enabled else None
        self.profiler = _Profiler(m.profile_steps, run_dir / "profile", rank, device, start_step)
        self.start_step, self.started, self.compiles = start_step, time.perf_counter(), compiles
        self.loss: tuple[int, float] | None = None
        """The last logged step and its loss (the mean over the ranks), for the run's summary."""
        self.val_loss: tuple[int, float] | None = None
        if compiles:  # the first step sits silent for up to minutes otherwise
            logger.info(
                "step %d compiles the model's blocks (parallel.compile): a minute or more on a CPU, "
                "less on a GPU; the steps after it reuse the compiled code",
                start_step + 1,
            )

    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0

    def timed(self, fetch):
        """fetch(), with its time counted as waiting for data."""
        started = time.perf_counter()
        result = fetch()
        self.data_seconds += time.perf_counter() - started
        return result

    def log(self, step: int, loss: float, grad_norm: float, lr: float, extra: dict[str, float] | None = None) -> None:
        """Record a step; call on every rank (only rank 0 writes). `extra`: more figures of the step (a mixture
        of experts' aux loss, expert imbalance and bias range: step.RouterBalance), logged under their names."""
        self.bar.update(step - self.bar.n)
        self.loss = (step, loss)
        if not self.enabled:
            return
        now = time.perf_counter()
        steps = max(step - self.last_step, 1)
        seconds = (now - self.last_time) / steps
        self.last_time, self.last_step = now, step
        tokens_per_s_device = self.tokens_per_step / seconds / self.world_size
        mfu = None
        if self.peak_tflops:
            mfu = 100 * self.flops_per_token * tokens_per_s_device / (self.peak_tflops * 1e12)
        record = {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time_s": seconds,
            "data_wait_s": self.data_seconds / steps, "tokens_per_s_per_device": tokens_per_s_device, "mfu_pct": mfu,
            "peak_mem_gib": peak_memory_gib(self.device), **(extra or {}),
        }  # fmt: skip
        self.data_seconds = 0.0
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.sink:
            self.sink(step, {k: v for k, v in record.items() if k != "step" and v is not None})
        mfu_text = f"{mfu:.1f}%" if mfu is not None else "n/a"
        experts = ""
        if "moe/aux_loss" in record:  # a collapsing router shows here first: imbalance towards num_experts / top_k
            experts = f"  aux {record['moe/aux_loss']:.4f}  experts max/mean {record['moe/imbalance_max']:.2f}"
            if "moe/bias_min" in record:
                experts += f"  bias [{record['moe/bias_min']:.3f}, {record['moe/bias_max']:.3f}]"
        logger.info(
            "step %d  loss %.4f  grad_norm %.3f  lr %.2e  %.0f tok/s/dev  mfu %s  data %.0f%%  peak mem %.2f GiB%s",
            step, loss, grad_norm, lr, tokens_per_s_device, mfu_text, 100 * record["data_wait_s"] / seconds,
            record["peak_mem_gib"], experts,
        )  # fmt: skip

    def log_eval(self, step: int, result: EvalResult) -> None:
        """Record a validation (rank 0 writes): a metrics.jsonl row of its own, with val_ keys."""
        if not self.enabled:
            return
        scalars = result.scalars()
        self.val_loss = (step, scalars["loss"])
        record = {"step": step, **{f"val_{k}": v for k, v in scalars.items()}, "val_targets": result.targets,
                  "eval_time_s": result.seconds}  # fmt: skip
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.sink:
            self.sink(step, scalars, "val")
        logger.info(
            "step %d  validation  %s  (%d targets, %.1f s)",
            step, "  ".join(f"val_{k} {v:.4f}" for k, v in scalars.items()), result.targets, result.seconds,
        )  # fmt: skip
        # The next training step's throughput must not count the evaluation.
        self.last_time += result.seconds

    def after_step(self, step: int) -> None:
        self.profiler.after_step(step)
        if self.compiles and step == self.start_step + 1:
            logger.info("step %d took %.1f s, compiling included", step, time.perf_counter() - self.started)

    def outcome(self, step: int, stopped: str) -> Outcome:
        """What this job did, from its first step to `step`; `stopped`: why it ended before train.steps ("")."""
        steps = step - self.start_step
        return Outcome(self.start_step, step, steps * self.tokens_per_step, time.perf_counter() - self.started,
                       self.loss, self.val_loss, stopped)  # fmt: skip

    def close(self) -> None:
        self.bar.close()
        self.profiler.close()
        if self.file:
            self.file.close()
        if self.sink:
            self.sink(None, None)


def _sink(metrics: MetricsConfig, run_dir: Path, run_config: dict):
    """A callable(step, scalars, section="train") for the configured metrics backend; (None, None) closes it.
    `run_config` is the whole config as a dict, which W&B records with the run."""
    backend = metrics.backend
    if backend == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

        def write(step, scalars, section="train"):
            if step is None:
                return writer.close()
            for name, value in scalars.items():
                writer.add_scalar(f"{section}/{name}", value, step)
            writer.flush()

        return write
    if backend == "wandb":
        import wandb  # reads WANDB_API_KEY / WANDB_MODE from the environment; no key is ever stored

        run = wandb.init(project=metrics.wandb_project or run_dir.name, dir=str(run_dir), config=run_config)
        return lambda step, scalars, section="train": (
            run.finish() if step is None else run.log({f"{section}/{k}": v for k, v in scalars.items()}, step=step)
        )
    return None


class _Profiler:
    """torch.profiler over the steps first..last of `metrics.profile_steps`, one trace per rank."""

    def __init__(self, window: str, out: Path, rank: int, device: torch.device, start_step: int):
        self.first, self.last = (int(x) for x in window.split("-")) if window else (0, -1)
        self.out, self.rank = out, rank
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.active = False
        if self.first <= start_step + 1 <= self.last:  # the window opens with the next step
            self.after_step(self.first - 1)

    def after_step(self, step: int) -> None:
        if step == self.first - 1:
            self.profile.start()
            self.active = True
        elif step == self.last:
            self.close()

    def close(self) -> None:
        if self.active:
            self.profile.stop()
            self.out.mkdir(parents=True, exist_ok=True)
            self.profile.export_chrome_trace(str(self.out / f"trace_rank{self.rank}.json"))
            logger.info("profiled steps %d-%d: %s", self.first, self.last, self.out)
            self.active = False
