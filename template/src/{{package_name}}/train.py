"""Training entry point. main() reads top to bottom as the job happens:

    load_config -> preflight.check -> build_run -> checkpoint_load
    -> train_loop { train_step -> metrics -> validate -> checkpoint_save } -> export -> teardown

build_run (run.py) holds init_distributed, build_model_meta and build_optimizer; train_step and its
math are step.py's. `--eval-only` stops after checkpoint_load: it scores the checkpoint on the
held-out data once.

Launch with torchrun, e.g. `torchrun --standalone --nproc_per_node 2 -m <package>.train
--config configs/debug.toml`, or with scripts/run_local.sh. Bad input (config, data path,
checkpoint to resume, a world size the plan refuses) is found before the process group starts
and reported once, by local rank 0, which exits with code 2 (config.EXIT_USAGE); see refuse().
The launch scripts find it before any rank starts: `--check-only` runs the same checks in one
process for the world size they are about to launch (preflight.check_launch).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm.contrib.logging import logging_redirect_tqdm

from .checkpoint import FaultHook
from .config import EXIT_USAGE, Config, UsageError, config_file, load_config, reports_errors
from .distributed import StopRequest, any_rank, mean_across_ranks, rendezvous_from_env, set_collective_timeout
from .evaluate import EvalResult, evaluate
from .metrics import MetricsLogger, Outcome, flops_per_token, init_logging, peak_tflops, summary
from .preflight import check, check_launch
from .presets import PLANNED_CONFIG
from .run import Run, build_run
from .step import train_step
from .weights import export_weights

logger = logging.getLogger(__name__)


@record
def main(argv: list[str] | None = None) -> None:
    """Train as the config says: `--config FILE` and overrides (config/), on the ranks torchrun started."""
    with refusals():
        cfg = load_config(argv)
        if cfg.dist.check_only:  # a launch script's check before it starts the ranks
            check_launch(cfg)
            return
        rdzv = rendezvous_from_env(cfg.dist.init_method)
        init_logging(rdzv.rank)
        check(cfg, rdzv)
    job(cfg, config=config_file(argv))


def job(cfg: Config, *, faults: FaultHook | None = None, config: Path | None = None) -> None:
    """build_run -> checkpoint_load -> train_loop -> export -> the summary, and teardown however it ends. The
    inputs are checked (preflight); `faults` is for tests that crash a rank mid-job (checkpoint.FaultHook);
    `config` is the --config file, which the summary's next commands name."""
    run = None
    try:
        run = build_run(cfg, faults=faults)
        step = checkpoint_load(run)
        if cfg.eval.only:  # score the checkpoint and stop, writing nothing
            validate(run, step, None)
            return
        outcome = train_loop(run, step)
        export = None
        if outcome.step == cfg.train.steps and cfg.checkpoint.export != "none":
            export = Path(cfg.run_dir) / "export"
            kinds = {"spec": run.spec, "model_cfg": cfg.model, "checkpoint": cfg.checkpoint, "finetune": cfg.finetune}
            export_weights(run.model, **kinds, out=export, is_main=run.env.is_main)
        run.checkpoints.close()
        any_rank(False, run.env.device)  # no rank tears down while another is still communicating
        if run.env.is_main:
            report(run, outcome, export=export, config=config)
    finally:
        teardown(run)


def checkpoint_load(run: Run) -> int:
    """Resume model, optimizer, LR schedule, data position and RNG from run.resume; return the step reached."""
    if run.resume is None:
        logger.info("no checkpoint to resume (checkpoint.resume=%s): starting at step 0", run.cfg.checkpoint.resume)
        return 0
    run.checkpoints.load(run.state, run.resume)
    return run.state.step


def train_loop(run: Run, start: int) -> Outcome:
    """Train from step `start` to train.steps, a preemption signal or train.stop_after_steps; return what it did
    (the step reached, the last losses: metrics.Outcome).

    Every rank runs the same steps: per-rank data may run out unevenly, so the ranks agree on the
    shortest (data.uneven_inputs=min), or DDP ranks that ran out shadow the others' collectives
    (join); global-batch data never runs out. How they keep pace is the strategy's (strategy.Pace).
    A checkpoint is saved every checkpoint.interval steps and when the loop ends, validation runs
    every eval.interval steps and at the end.
    """
    cfg, env = run.cfg, run.env
    metrics, stop, step, why = build_metrics(run, start), StopRequest(), start, ""
    pace = run.strategy.pace(run.model, run.optimizer, run.loader, data=cfg.data, steps=cfg.train.steps, start=start,
                             log_every=cfg.metrics.log_every, device=env.device)  # fmt: skip
    with logging_redirect_tqdm(), pace:
        while step < pace.last:
            try:
                batches = metrics.timed(run.loader.next_batches)
            except StopIteration:  # this rank's data ran out; Join shadows the others from here
                break
            step += 1
            run.checkpoints.fault("step", step)
            result = train_step(run.model, run.optimizer, run.scheduler, batches, run.step_context)
            pace.took(step)
            if metrics.should_log(step):
                # The step's figures stay on the device until here: the host reads them once an interval.
                loss, grad_norm = mean_across_ranks(result.loss, env.device), result.grad_norm.item()
                metrics.log(step, loss, grad_norm, result.lr, result.metrics)
            metrics.after_step(step)
            if step == start + 1:
                set_collective_timeout(cfg.dist.train_timeout_s)
            preempted = any_rank(stop.requested, env.device)
            job_done = preempted or step - start == cfg.train.stop_after_steps
            if pace.together:  # a rank that has joined could take part in neither
                validate_and_save(run, metrics, step, last=pace.last, final=job_done or step == pace.last)
            if job_done:
                why = "preemption signal" if preempted else "train.stop_after_steps"
                logger.info("stopping after step %d (%s); resume with the same command", step, why)
                break
    if not pace.together:  # every rank is back in step: where the longest-running rank stopped
        step = pace.step
        validate_and_save(run, metrics, step, last=step, final=True)
    metrics.close()
    run.loader.close()  # stop building batches ahead
    return metrics.outcome(step, why)


def validate_and_save(run: Run, metrics: MetricsLogger, step: int, *, last: int, final: bool) -> None:
    """Between steps: validate when it is due (every eval.interval steps and after `last`), then checkpoint_save."""
    if run.held_out is not None and run.held_out.due(step, last):
        validate(run, step, metrics)
    checkpoint_save(run, step, final=final)


def checkpoint_save(run: Run, step: int, *, final: bool) -> None:
    """Save every checkpoint.interval steps, and whenever the run or this job ends."""
    if final or step % run.cfg.checkpoint.interval == 0:
        run.checkpoints.save(run.state, step)


def validate(run: Run, step: int, metrics: MetricsLogger | None) -> EvalResult:
    """Score the model on the held-out batches (the same ones every time) after `step`, and report it.

    Every rank calls it after the same step: the forward passes all-gather (FSDP) and the sums
    are all-reduced. The model goes back to train mode and nothing else changes: no gradients, no
    random draws, and the training loader keeps its position. Without metrics (--eval-only)
    rank 0 prints the result as one JSON line and nothing is written.
    """
    strategy = run.strategy
    result = evaluate(run.model, run.held_out, run.env.device, strategy.autocast, strategy.dp_group,
                      split=run.step_context.sequence_split)  # fmt: skip
    if metrics is not None:
        metrics.log_eval(step, result)
    elif run.env.is_main:
        print(json.dumps({"step": step, **{f"val_{k}": v for k, v in result.scalars().items()}}), flush=True)
    return result


def build_metrics(run: Run, start_step: int) -> MetricsLogger:
    """The run's metrics (rank 0 writes them), with the FLOPs per token its MFU figure counts."""
    cfg, env = run.cfg, run.env
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    shape = run.spec.shape(cfg.model)
    tokens = shape.tokens or cfg.train.seq_len  # per sample (patches + 1 for a ViT)
    return MetricsLogger(
        metrics=cfg.metrics, run_dir=run_dir, run_config=dataclasses.asdict(cfg), steps=cfg.train.steps,
        enabled=env.is_main, start_step=start_step, tokens_per_step=cfg.train.global_batch_size * tokens,
        world_size=env.world_size, flops_per_token=flops_per_token(shape, run.strategy.unwrap(run.model), tokens),
        peak_tflops=peak_tflops(env.device, cfg.metrics.peak_tflops), device=env.device, rank=env.rank,
        compiles=cfg.parallel.compile,
    )  # fmt: skip


def report(run: Run, outcome: Outcome, *, export: Path | None, config: Path | None) -> None:
    """Rank 0 ends the job with a summary (metrics.summary): what it did, where its checkpoint and export are, and
    what to run next: resume it if it stopped early, sample the trained model, train the model this repo was
    planned for or on more devices. `config`: the --config file the job ran."""
    pkg, cfg = __package__, run.cfg
    saved = next(iter(run.checkpoints.scan()[0]), None)  # the newest complete checkpoint
    with_config = f"--config {config} " if config else ""
    steps = []
    if outcome.stopped and saved is not None:
        again = "the same command" + (" with --checkpoint.resume auto" if cfg.checkpoint.resume == "never" else "")
        steps.append(("resume", f"{again}: it continues from {saved.name}"))
    if run.spec.inputs == "tokens" and (export or saved):
        prompt = "Hello" if cfg.data.tokenizer else " ".join(str(i) for i in range(4))
        weights = export or saved
        steps.append(("generate", f'python -m {pkg}.generate {with_config}--weights {weights} --prompt "{prompt}"'))
    planned = Path(PLANNED_CONFIG)
    if config is not None and config.resolve() != planned.resolve() and planned.is_file():
        steps.append(("the model", f"bash scripts/run_local.sh {planned}   # as planned: PLAN.md"))
    elif cfg.hardware.gpus_per_node > run.env.world_size:
        steps.append(("more GPUs", f"NPROC={cfg.hardware.gpus_per_node} bash scripts/run_local.sh {config or ''}"))
    print(summary(outcome, steps=cfg.train.steps, checkpoint=saved, export=export, next_steps=steps), flush=True)


def teardown(run: Run | None) -> None:
    """Release the run, then leave the process group.

    The model must go first: a DDP reducer that outlives the group deadlocks gloo's teardown (it
    joins worker threads while holding the GIL), so nothing else may keep a reference to it.
    """
    if run is not None:
        run.release()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def refusals() -> Iterator[None]:
    """Bad input raised in here (UsageError, or a command line tyro refused) is reported by refuse()."""
    try:
        yield
    except UsageError as error:
        refuse(error)
    except SystemExit as tyro_exit:  # a refused command line (tyro printed why), or --help
        if tyro_exit.code:
            refuse(None)
        raise


def refuse(error: UsageError | None) -> NoReturn:
    """Report bad input once, without a traceback: local rank 0 prints it and exits with EXIT_USAGE.

    Every rank found the same error; the others exit 0 without a word, because torchrun stops
    every rank as soon as one fails, and could stop the reporting rank before it has printed.
    SystemExit passes through @record without an error file: there is no traceback to keep.
    """
    if not reports_errors():
        raise SystemExit(0)
    if error is not None:  # None: tyro has printed its own refusal of the command line
        print(f"{__package__}.train: error: {error}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


if __name__ == "__main__":
    main()
