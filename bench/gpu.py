"""GPU benchmark of a rendered project: the ~1B Llama preset on one CUDA GPU (NCCL, world size 1), a
mixture of experts with Qwen3-30B-A3B's blocks, long sequences over every GPU of the machine, then the
project's own tests/test_gpu.py, in one command that writes one JSON file.

    python bench/gpu.py --json gpu.json       # meant to end within 10 minutes on one H100 or H200 (not yet run on one)
    python bench/gpu.py --dry-run             # the same code path on CPU: a tiny model, gloo, in a minute or two
    python bench/gpu.py --from-json gpu.json  # the table of a recorded run (the README's)

It needs the template's test environment with a CUDA build of torch (`pip install --group test`
without the CPU wheel index). Each run is bf16 at the preset's sequence length and micro-batch,
one micro-batch per step: eager with activation checkpointing none, selective and full, compiled
(inductor) with none, and, where the GPU has float8 tensor cores (sm 8.9+), compiled float8
tensorwise and rowwise; then two of Qwen3-30B-A3B's blocks (128 experts of which 8 a token, grouped
matmuls; the vocabulary and widths as published), compiled, selective recomputation, from an MoE render
(its MFU counts the active parameters' FLOPs). Then long sequences, 32,768, 65,536 and 131,072 tokens,
one a step, eager with full recomputation, each split over every GPU of the machine by context
parallelism (the degree is the number of GPUs, on as many ranks; on one GPU, none). Each row gives the
median step time, tokens/s per GPU, MFU (against the GPU's dense bf16 peak), the peak of
torch.cuda.max_memory_allocated and that peak over the memory plan's estimate (the plan aims to be
within 15%); float8 rows also give their tokens/s over the compiled bf16 row's. tests/test_gpu.py
then compares the plan with the measured peak on a smaller model. Runs that would start after
--max-minutes are listed as not run, and a run that fails or takes over 5 minutes is listed with
its error (in the JSON file) while the others still run, so a session with a few minutes of GPU
time always gets its JSON file; the command exits 1 if a run failed.

Without a CUDA GPU it says so in one line and exits 1. --dry-run runs every step on CPU ranks: the
debug-sized models (the MoE row: the debug MoE), gloo, the long sequences as 32, 64 and 128 tokens
over 2 ranks, compiled rows through aot_eager (graph capture, no code generation), float8 rows
through torch's reference float8 matmul (no float8 kernels), and MFU against a stand-in peak of
1 TFLOP/s; tests/test_gpu.py skips itself there. It runs one row of each kind and lists the others as
not run (DRY_RUN_SAME_AS: another float8 recipe, sequence length or AC mode on the same code path). Its
figures mean nothing; tests/test_bench.py runs it to keep this file from rotting between GPU sessions.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import arguments, gpu_machine, host_machine, machine_line, markdown, render, save

ANSWERS = {"package_name": "bench_gpu", "model_size": "1b", "gpus_per_node": 1, "gpu_memory_gb": 80,
           "seq_len": 4096, "micro_batch_size": 2, "mixed_precision": "bf16", "sharding": "full"}  # fmt: skip
MOE_ANSWERS = {"package_name": "bench_moe", "model_type": "qwen3_moe", "model_size": "moe-debug", "gpus_per_node": 1,
               "gpu_memory_gb": 80, "mixed_precision": "bf16", "sharding": "full"}  # fmt: skip
# Two of Qwen3-30B-A3B's 48 blocks, its vocabulary, at 4096 tokens: the experts' grouped matmuls at their real widths.
MOE_SHAPE = ["--model.dim", "2048", "--model.n_layers", "2", "--model.n_heads", "32", "--model.n_kv_heads", "4",
             "--model.head_dim", "128", "--model.moe_intermediate_size", "768", "--model.num_experts", "128",
             "--model.num_experts_per_tok", "8", "--model.vocab_size", "151936", "--model.max_seq_len", "4096",
             "--train.seq_len", "4096"]  # fmt: skip
# --dry-run of the MoE row: the debug MoE (widths multiples of 8, as grouped matmuls need), short sequences.
TINY_MOE = ["--train.seq_len", "16", "--device", "cpu", "--dist.backend", "gloo", "--parallel.compile_backend",
            "aot_eager", "--metrics.peak_tflops", "1"]  # fmt: skip
# --dry-run: every size a multiple of 16 (float8 matmuls need it), as tests/test_float8.py's tiny model.
TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2", "--model.n_kv_heads", "1",
        "--model.ffn_hidden_dim", "64", "--model.vocab_size", "256", "--model.max_seq_len", "16",
        "--train.seq_len", "16", "--device", "cpu", "--dist.backend", "gloo",
        "--parallel.compile_backend", "aot_eager", "--metrics.peak_tflops", "1"]  # fmt: skip
LONG = (32768, 65536, 131072)
"""Tokens per sequence of the context-parallel rows (--dry-run: these / 1024 on CPU ranks)."""
RUN_TIMEOUT_S = 300
"""A run that takes longer is stopped and reported as failed: the others still run."""


@dataclass(frozen=True)
class Variant:
    compile: bool
    ac: str
    float8: str = "none"
    seq_len: int = 0
    """A long sequence split over the machine's GPUs by context parallelism (0: the preset's, on one GPU)."""
    moe: bool = False
    """The mixture of experts (Qwen3-30B-A3B's blocks) of an MoE render, rather than the 1b preset."""

    @property
    def name(self) -> str:
        precision = f"float8 {self.float8}" if self.float8 != "none" else "bf16"
        model = "MoE (2 Qwen3-30B-A3B blocks), " if self.moe else ""
        long = f", {self.seq_len:,} tokens over every GPU (context parallel)" if self.seq_len else ""
        return f"{model}{precision}, {'compiled' if self.compile else 'eager'}, AC {self.ac}{long}"


# In the order they run, most wanted first: --max-minutes cuts the last ones.
BF16 = [Variant(False, "none"), Variant(True, "none")]
FLOAT8 = [Variant(True, "none", "tensorwise"), Variant(True, "none", "rowwise")]
MORE_AC = [Variant(False, "selective"), Variant(False, "full")]
MOE = Variant(True, "selective", moe=True)
CONTEXT_PARALLEL = [Variant(False, "full", seq_len=seq) for seq in LONG]
TEST_GPU = "generated tests/test_gpu.py: plan vs torch.cuda.max_memory_allocated"
RUNS = [*BF16, *FLOAT8, MOE, TEST_GPU, *CONTEXT_PARALLEL, *MORE_AC]
ROWS = [run if run == TEST_GPU else run.name for run in RUNS]
"""Every row, in order (on a GPU without float8 tensor cores, less the float8 rows)."""
DRY_RUN_SAME_AS = {FLOAT8[1]: FLOAT8[0], CONTEXT_PARALLEL[1]: CONTEXT_PARALLEL[0],
                   CONTEXT_PARALLEL[2]: CONTEXT_PARALLEL[0], MORE_AC[0]: BF16[0], MORE_AC[1]: BF16[0]}  # fmt: skip
"""Rows that --dry-run lists as not run: each takes the code path of the row named here, on CPU ranks, with another
float8 recipe, sequence length or AC mode (which the generated tests run); a launch costs a CPU about 10 s."""


class RunFailed(Exception):
    """A run that failed or timed out: its row says why, and the others still run."""


def execute(cmd: list[str], project: Path, env: dict) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as timeout:
        raise RunFailed(f"stopped after {RUN_TIMEOUT_S} s: {' '.join(cmd)}") from timeout
    return done


def long_sequence(variant: Variant, dry_run: bool) -> tuple[int, list[str]]:
    """Ranks and arguments of a context-parallel row: one sequence a step, split over every GPU (2 CPU ranks with
    --dry-run), planned for that many."""
    if not variant.seq_len:
        return 1, []
    import torch

    ranks = 2 if dry_run else torch.cuda.device_count()
    seq = variant.seq_len // 1024 if dry_run else variant.seq_len
    return ranks, ["--train.seq_len", str(seq), "--model.max_seq_len", str(max(seq, 128)), "--train.micro_batch_size",
                   "1", "--train.global_batch_size", "1", "--parallel.context_parallel", str(ranks),
                   "--hardware.gpus_per_node", str(ranks)]  # fmt: skip


def run_variant(project: Path, run: Path, variant: Variant, steps: int, warmup: int, dry_run: bool) -> dict:
    """Train `steps` steps of one variant (on one rank, or a long sequence over every GPU); its figures, medians
    over the steps after `warmup`. The MoE variant runs in the MoE render beside `project` (moe/, package
    bench_moe)."""
    package, config_file, shape = "bench_gpu", project / "configs" / "1b.toml", TINY if dry_run else []
    if variant.moe:
        project = project.parent / "moe"
        package, config_file = "bench_moe", project / "configs" / "debug.toml"
        shape = TINY_MOE if dry_run else MOE_SHAPE
    overrides = ["--train.steps", str(steps), "--train.warmup_steps", str(warmup), "--train.global_batch_size",
                 str(ANSWERS["micro_batch_size"]), "--train.micro_batch_size", str(ANSWERS["micro_batch_size"]),
                 "--checkpoint.interval", "100000", "--checkpoint.export", "none",
                 "--eval.interval", "0", "--metrics.progress_bar", "False", "--parallel.compile", str(variant.compile),
                 "--parallel.activation_checkpointing", variant.ac, "--parallel.float8", variant.float8]  # fmt: skip
    ranks, long = long_sequence(variant, dry_run)
    config = ["--config", str(config_file), "--run_dir", str(run), *overrides, *shape, *long]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", f"{package}.train", *config]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    if dry_run:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun sets for several ranks; on a GPU, rank 0's full init takes all
    done = execute(cmd, project, env)
    if done.returncode:
        raise RunFailed(f"exit code {done.returncode}: {' '.join(cmd)}\n{done.stderr[-5000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][warmup:]
    records = [r for r in records if "loss" in r]  # not validation rows
    config_module = importlib.import_module(f"{package}.config")
    plan_module = importlib.import_module(f"{package}.plan")
    cfg = config_module.load_config(config)
    plan = plan_module.plan_for(model=cfg.model, train=cfg.train, parallel=cfg.parallel, hardware=cfg.hardware,
                                finetune=cfg.finetune)  # fmt: skip
    GIB = plan_module.GIB  # noqa: N806 - the plan's unit
    peak, planned = max(r["peak_mem_gib"] for r in records), plan.total / GIB
    return {
        **({"context_parallel": float(cfg.parallel.context_parallel)} if variant.seq_len else {}),
        "step_time_s": statistics.median(r["step_time_s"] for r in records),
        "tokens_per_s": statistics.median(r["tokens_per_s_per_device"] for r in records),
        # None where metrics.py knows no peak FLOP/s for this GPU (add it to PEAK_TFLOPS in hooks/presets.jinja).
        "mfu_pct": statistics.median(r["mfu_pct"] for r in records) if records[0]["mfu_pct"] else None,
        "peak_gib": peak,
        "plan_gib": planned,
        "peak_over_plan": peak / planned,
    }


def run_test_gpu(project: Path) -> dict:
    """The project's tests/test_gpu.py: pytest's counts, and what each case measured and planned (GiB)."""
    env = {**os.environ, "PYTHONPATH": f"{project / 'src'}:{project / 'tests'}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    done = execute(cmd, project, env)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    if not counts:
        raise RunFailed(f"pytest did not run: {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    figures = {k: float(counts.get(k, 0)) for k in ("passed", "failed", "skipped")}
    for ac, measured, planned in re.findall(r"(\w+): measured ([\d.]+) GiB, planned ([\d.]+) GiB", done.stdout):
        figures |= {f"{ac}_measured_gib": float(measured), f"{ac}_plan_gib": float(planned)}
    return figures


def measure(args, float8: bool) -> list[dict]:
    steps, warmup = (4, 2) if args.dry_run else (args.steps, 5)
    # --max-minutes rations a lent GPU's time; a dry run checks that every row runs, however busy the CPU.
    deadline = math.inf if args.dry_run else time.monotonic() + 60 * args.max_minutes
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "gpu"
        render(project, ANSWERS)
        render(Path(tmp) / "moe", MOE_ANSWERS)
        sys.path[:0] = [str(project / "src"), str(Path(tmp) / "moe" / "src")]
        for job, name in zip(RUNS, ROWS, strict=True):
            if job in FLOAT8 and not float8:
                continue
            row = {"name": name, "figures": {}}
            if args.dry_run and job in DRY_RUN_SAME_AS:
                row["note"] = f"not run in a dry run: the code path of {DRY_RUN_SAME_AS[job].name!r}"
            elif time.monotonic() > deadline:
                row["note"] = f"not run: past --max-minutes {args.max_minutes:g}"
            else:
                try:
                    if job == TEST_GPU:
                        row["figures"] = run_test_gpu(project)
                    else:
                        row["figures"] = run_variant(project, Path(tmp) / f"run-{len(rows)}", job, steps, warmup,
                                                     args.dry_run)  # fmt: skip
                except RunFailed as failure:
                    row["note"], row["error"] = "failed (see its error in the JSON file)", str(failure)
                    print(f"{name}: {failure}", file=sys.stderr)
            rows.append(row)
    compiled = next(r["figures"] for r in rows if r["name"] == Variant(True, "none").name)
    for row in rows:
        if row["name"].startswith("float8") and row["figures"] and compiled:
            row["figures"]["tokens_over_compiled_bf16"] = row["figures"]["tokens_per_s"] / compiled["tokens_per_s"]
    return rows


def table(results: dict) -> str:
    """The Markdown table of a results dict (what --json writes), with the machine line under it."""
    lines = []
    for row in results["rows"]:
        f = row["figures"]
        if row["name"] == TEST_GPU or not f:
            continue
        ratio = f"{f['tokens_over_compiled_bf16']:.2f}" if "tokens_over_compiled_bf16" in f else ""
        mfu = "n/a" if f["mfu_pct"] is None else f"{f['mfu_pct']:.1f}%"
        name = row["name"] + (f" (degree {f['context_parallel']:.0f})" if "context_parallel" in f else "")
        lines.append([name, f"{f['step_time_s'] * 1e3:,.0f}", f"{f['tokens_per_s']:,.0f}", ratio, mfu,
                      f"{f['peak_gib']:.1f}", f"{f['plan_gib']:.1f}", f"{f['peak_over_plan']:.2f}"])  # fmt: skip
    header = ["run", "step ms", "tokens/s", "vs compiled bf16", "MFU", "peak GiB", "plan GiB", "peak / plan"]
    out = [markdown(header, lines, "lrrrrrrr")]
    test = next(row["figures"] for row in results["rows"] if row["name"] == TEST_GPU)
    if test:
        cases = [f"AC {key.removesuffix('_measured_gib')}: {test[key]:.2f} GiB measured, "
                 f"{test[key.replace('_measured_', '_plan_')]:.2f} planned"
                 for key in test if key.endswith("_measured_gib")]  # fmt: skip
        counts = ", ".join(f"{test[k]:.0f} {k}" for k in ("passed", "failed", "skipped") if test[k])
        out.append(f"{TEST_GPU}: {counts}" + (f" ({'; '.join(cases)})" if cases else ""))
    out += [f"{row['name']}: {row['note']}" for row in results["rows"] if "note" in row]
    if not results["float8"]:
        out.append("float8: not run, this GPU has no float8 tensor cores (compute capability below 8.9)")
    dry = " (--dry-run on CPU: a harness check, not a measurement)" if results["quick"] else ""
    return "\n\n".join([*out, machine_line(results["machine"]) + dry])


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0], "--dry-run", "run every step on CPU with a tiny model and gloo")
    parser.add_argument("--steps", type=int, default=20, help="steps per run; the first 5 are not timed")
    parser.add_argument("--max-minutes", type=float, default=8.0, help="start no run after this many minutes")
    args = parser.parse_args()
    if args.from_json:
        print(table(json.loads(args.from_json.read_text())))
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(f"bench/gpu.py: no CUDA GPU here (torch {torch.__version__} sees none); run it on a machine "
                 "with one, or add --dry-run to check it on CPU")  # fmt: skip
    float8 = args.dry_run or torch.cuda.get_device_capability() >= (8, 9)
    machine = host_machine() if args.dry_run else gpu_machine()
    results = {"bench": "gpu", "quick": args.dry_run, "machine": machine, "float8": float8,
               "rows": measure(args, float8)}  # fmt: skip
    save(results, args.json)
    print(table(results))
    if any("error" in row for row in results["rows"]):
        sys.exit("bench/gpu.py: some runs failed (their rows say so); the other figures are in the table")


if __name__ == "__main__":
    main()
