"""GPU benchmark of rendered projects on one machine: the generated trainer against the plain PyTorch loop a user
would write, in the same run, on the ~1B Llama preset (one GPU); float8; a mixture of experts with Qwen3-30B-A3B's
blocks; activation checkpointing; long sequences; then the project's own tests/test_gpu.py. One JSON file, written
again as each row ends.

    python bench/gpu.py --prepare .gpu                        # here, where copier is: renders, and the wheels a
                                                              # machine with only torch lacks (bench/gpu_machine.sh)
    bash bench/gpu_machine.sh .gpu                            # there: install the wheels, run the default rows
    python bench/gpu.py --renders .gpu --rows all --json gpu.json   # every row, from renders made elsewhere
    python bench/gpu.py --dry-run                             # every kind of row on CPU, about a minute of CPU
    python bench/gpu.py --from-json gpu.json                  # the table of a recorded run (the README's)

Without --renders it renders the projects itself (copier). The rows, most wanted first (`--rows` takes their
keys, comma-separated, or `default` (the first eight), `rest` or `all`):

    trainer               the generated trainer, bf16, eager, one GPU (NCCL, world size 1), the preset's
                          sequence (4096) and micro-batch (2), one micro-batch a step
    loop                  bench/_plain_loop.py: 40 lines of plain PyTorch on the render's own model, fp32
                          parameters, autocast bf16, fused AdamW, the same batch
    trainer-compiled      the trainer with its blocks compiled (inductor)
    loop-compiled         the plain loop, torch.compile(model)
    float8-tensorwise     the trainer, compiled, torchao float8 (sm 8.9+; elsewhere listed as not run)
    float8-rowwise
    moe                   two of Qwen3-30B-A3B's blocks (128 experts of which 8 a token, grouped matmuls, its
                          vocabulary and widths) from an MoE render, compiled, selective recomputation; its MFU
                          counts the active parameters
    test-gpu              the render's tests/test_gpu.py: the plan against torch.cuda.max_memory_allocated for
                          each activation-checkpointing mode (needs pytest)
    transformers          the plain loop on transformers' LlamaForCausalLM (sdpa) of the same shape, eager
    ac-selective, ac-full the trainer, eager, with selective and full activation checkpointing
    long-32k, -64k, -131k one sequence of 32,768, 65,536, 131,072 tokens a step, eager, full recomputation, split
                          over every GPU of the machine by context parallelism (on one GPU: none)
    offload-kept,         one sequence of 131,072 tokens (the 1b preset's longest) on one GPU, eager, full
      offload-parked      recomputation, the blocks' inputs kept on the GPU, then parked in host memory
                          (parallel.activation_offload): its tokens/s over the kept row's, and both peaks
    transformers-compiled the transformers loop, torch.compile(model) (over 100 s of compile on an H200)

Each row gives the median step time over the steps after the first five, tokens/s per GPU, its ratio to the row it
is measured against (the trainer to the plain loop, float8 to compiled bf16, ...), MFU (against the GPU's dense
bf16 peak), the peak of torch.cuda.max_memory_allocated, that peak over the memory plan's estimate (the plan aims
to be within 15%), and the row's wall seconds. The default rows are meant to end within 8 minutes on one H200
(EXPECTED_S, from the first GPU session's 25-60 s per 1b row: 455 s; `rest` 457 s more); a row that would not
finish by --max-minutes is listed as not run, one that fails or passes --row-timeout (or the time left) is listed
with its error (in the JSON file) while the others run, and the command exits 1 if a row failed. The JSON file
lists every row from the start, those not yet reached saying so: a run cut short keeps what it finished.

Without a CUDA GPU it says so in one line and exits 1. --dry-run runs every kind of row on CPU: the debug-sized
models, gloo, the long sequences as 32 tokens over 2 ranks, compiled rows through aot_eager (graph capture, no
code generation), float8 through torch's reference float8 matmul, MFU against a stand-in peak of 1 TFLOP/s;
tests/test_gpu.py skips itself there. It lists the rows whose code path another row runs as not run
(DRY_RUN_SAME_AS). Its figures mean nothing; tests/test_bench.py runs it to keep this file from rotting.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import arguments, gpu_machine, host_machine, machine_line, markdown, render

BENCH = Path(__file__).resolve().parent
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
LONG = {"32k": 32768, "64k": 65536, "131k": 131072}
"""Tokens per sequence of the long-sequence rows (--dry-run: 32 for each, on CPU ranks)."""
TEST_GPU = "generated tests/test_gpu.py: plan vs torch.cuda.max_memory_allocated"
LOOP = "plain loop (bench/_plain_loop.py), bf16 autocast, fused AdamW"


@dataclass(frozen=True)
class Row:
    key: str
    name: str
    kind: str
    """trainer (the generated trainer), loop (bench/_plain_loop.py) or test_gpu (the render's tests/test_gpu.py)."""
    expected_s: int
    """About how long the row takes on one H200, start-up and compile included (a 1b trainer row took 25-60 s,
    compiling transformers' whole Llama over 100 s): a row is not started unless this much time is left."""
    compile: bool = False
    ac: str = "none"
    float8: str = "none"
    seq_len: int = 0
    """A long sequence split over the machine's GPUs by context parallelism (0: the preset's, on one GPU)."""
    split: bool = True
    """seq_len's sequence split over every GPU; False: one GPU holds it whole."""
    offload: bool = False
    """parallel.activation_offload: the blocks' inputs wait for backward in host memory."""
    moe: bool = False
    """Qwen3-30B-A3B's blocks from the MoE render, rather than the 1b preset."""
    model: str = "render"
    """The plain loop's model: the render's own, or transformers' LlamaForCausalLM."""
    reference: str = ""
    """The key of the row whose tokens/s this row's is divided by."""


def _trainer(key: str, detail: str, expected_s: int, **kw) -> Row:
    return Row(key, f"generated trainer, {detail}", "trainer", expected_s, **kw)


def _loop(key: str, detail: str, expected_s: int, **kw) -> Row:
    return Row(key, f"{LOOP}, {detail}", "loop", expected_s, **kw)


# fmt: off
RUNS = [
    _trainer("trainer", "bf16, eager, AC none", 35, reference="loop"),
    _loop("loop", "the render's model, eager", 30),
    _trainer("trainer-compiled", "bf16, compiled, AC none", 60, compile=True, reference="loop-compiled"),
    _loop("loop-compiled", "the render's model, torch.compile(model)", 80, compile=True),
    *(_trainer(f"float8-{recipe}", f"float8 {recipe}, compiled, AC none", 60, compile=True, float8=recipe,
               reference="trainer-compiled") for recipe in ("tensorwise", "rowwise")),
    _trainer("moe", "MoE (2 Qwen3-30B-A3B blocks), bf16, compiled, AC selective", 70, compile=True, ac="selective",
             moe=True),
    Row("test-gpu", TEST_GPU, "test_gpu", 60),
    _loop("transformers", "transformers' LlamaForCausalLM (sdpa), eager", 40, model="transformers", reference="loop"),
    *(_trainer(f"ac-{ac}", f"bf16, eager, AC {ac}", 35, ac=ac, reference="trainer") for ac in ("selective", "full")),
    *(_trainer(f"long-{k}", f"bf16, eager, AC full, {seq:,} tokens over every GPU (context parallel)",
               35 + seq // 2048, ac="full", seq_len=seq) for k, seq in LONG.items()),
    _loop("transformers-compiled", "transformers' LlamaForCausalLM (sdpa), torch.compile(model)", 130, compile=True,
          model="transformers", reference="loop-compiled"),
    *(_trainer(f"offload-{state}", f"bf16, eager, AC full, 131,072 tokens on one GPU, block inputs {state}",
               35 + LONG["131k"] // 2048, ac="full", seq_len=LONG["131k"], split=False, offload=state == "parked",
               reference="offload-kept" if state == "parked" else "") for state in ("kept", "parked")),
]
# fmt: on
BY_KEY = {row.key: row for row in RUNS}
ROWS = [row.name for row in RUNS]
"""Every row, in the order they run."""
GROUPS = {"default": [row.key for row in RUNS[:8]], "rest": [row.key for row in RUNS[8:]], "all": list(BY_KEY)}
EXPECTED_S = {group: sum(BY_KEY[key].expected_s for key in keys) for group, keys in GROUPS.items()}
DRY_RUN_SAME_AS = {BY_KEY[a]: BY_KEY[b] for a, b in [
    ("trainer-compiled", "float8-tensorwise"), ("loop-compiled", "loop"), ("float8-rowwise", "float8-tensorwise"),
    ("ac-selective", "trainer"), ("ac-full", "trainer"), ("long-64k", "long-32k"), ("long-131k", "long-32k"),
    ("transformers-compiled", "transformers"), ("offload-kept", "trainer")]}  # fmt: skip
"""Rows that --dry-run lists as not run: each takes the code path of the row named here, on CPU, with another float8
recipe (or none), sequence length or AC mode (which the generated tests run), or torch.compile(model) besides; a
launch costs a CPU 5 to 13 s."""
REFERENCES = {"loop": "plain loop, eager", "loop-compiled": "plain loop, compiled",
              "trainer-compiled": "trainer, compiled bf16", "trainer": "trainer, AC none",
              "offload-kept": "block inputs kept"}  # fmt: skip


class RowFailed(Exception):
    """A row that failed or ran out of time: its entry says why, and the others still run."""


def execute(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """cmd in a session of its own, so that a row stopped for its time bound (or this process stopped) takes
    torchrun's workers and the GPU memory they hold with it."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RowFailed(f"stopped after {timeout:.0f} s (its time bound): {' '.join(cmd)}") from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch_env(*paths: Path, dry_run: bool) -> dict:
    """This process's environment with `paths` ahead of its PYTHONPATH, never instead of it: packages installed
    beside the image's (bench/gpu_machine.sh) stay importable in every launch."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), *inherited])}
    if dry_run:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun sets for several ranks; on a GPU, rank 0's full init takes all
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Setup:
    renders: Path
    runs: Path
    """Where the rows' run directories go (each removed once read: a 1b trainer row's last checkpoint is 15 GB)."""
    dry_run: bool
    steps: int
    warmup: int
    gpu_memory_gb: int
    """The GPU's memory, which the trainer rows plan against (0: the render's answer, for --dry-run)."""


def row_config(setup: Setup, row: Row) -> tuple[Path, str, int, list[str]]:
    """The project, package, ranks and config arguments (`--config FILE` and overrides) of a trainer or loop row."""
    project, package, config = setup.renders / "gpu", "bench_gpu", "1b.toml"
    shape = TINY if setup.dry_run else []
    if row.moe:
        project, package, config = setup.renders / "moe", "bench_moe", "debug.toml"
        shape = TINY_MOE if setup.dry_run else MOE_SHAPE
    batch = str(ANSWERS["micro_batch_size"])
    overrides = ["--train.steps", str(setup.steps), "--train.warmup_steps", str(setup.warmup),
                 "--train.global_batch_size", batch, "--train.micro_batch_size", batch,
                 "--checkpoint.interval", "100000", "--checkpoint.export", "none", "--eval.interval", "0",
                 "--metrics.progress_bar", "False", "--metrics.backend", "none", "--parallel.compile", str(row.compile),
                 "--parallel.activation_checkpointing", row.ac, "--parallel.float8", row.float8,
                 "--parallel.activation_offload", str(row.offload)]  # fmt: skip
    if setup.gpu_memory_gb:
        overrides += ["--hardware.gpu_memory_gb", str(setup.gpu_memory_gb)]
    ranks = 1
    if row.seq_len:  # one sequence a step, split over every GPU (2 CPU ranks with --dry-run), or on one
        import torch

        ranks = (2 if setup.dry_run else torch.cuda.device_count()) if row.split else 1
        seq = 32 if setup.dry_run else row.seq_len
        overrides += ["--train.seq_len", str(seq), "--model.max_seq_len", str(max(seq, 128)),
                      "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
                      "--parallel.context_parallel", str(ranks), "--hardware.gpus_per_node", str(ranks)]  # fmt: skip
    if row.offload and setup.dry_run:
        shape = [*shape, "--model.n_layers", "4"]  # TINY's 2 blocks are the 2 kept: 4 park 2
    return project, package, ranks, ["--config", str(project / "configs" / config), *overrides, *shape]


def planned_gib(package: str, config: list[str]) -> tuple[float, object]:
    """The memory plan's total for a row's config, in GiB, and the config (the render's own modules)."""
    cfg = importlib.import_module(f"{package}.config").load_config(config)
    plan_module = importlib.import_module(f"{package}.plan")
    plan = plan_module.plan_for(model=cfg.model, train=cfg.train, parallel=cfg.parallel, hardware=cfg.hardware,
                                finetune=cfg.finetune)  # fmt: skip
    return plan.total / plan_module.GIB, cfg


def run_trainer(setup: Setup, row: Row, run_dir: Path, timeout: float) -> dict:
    """Train setup.steps steps of the generated trainer: one rank as its own process (RANK, WORLD_SIZE, MASTER_*
    as torchrun would set them), several under torchrun. Medians over the steps after setup.warmup."""
    project, package, ranks, config = row_config(setup, row)
    module = ["-m", f"{package}.train", *config, "--run_dir", str(run_dir)]
    env = launch_env(project / "src", dry_run=setup.dry_run)
    if ranks == 1:
        cmd = [sys.executable, *module]
        env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *module]
    done = execute(cmd, project, env, timeout)
    if done.returncode:
        raise RowFailed(f"exit code {done.returncode}: {' '.join(cmd)}\n{done.stderr[-5000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r][setup.warmup :]  # not validation rows
    planned, cfg = planned_gib(package, config)
    peak = max(r["peak_mem_gib"] for r in records)
    return {
        **({"context_parallel": float(cfg.parallel.context_parallel)} if row.seq_len and row.split else {}),
        "step_time_s": statistics.median(r["step_time_s"] for r in records),
        "tokens_per_s": statistics.median(r["tokens_per_s_per_device"] for r in records),
        # None where metrics.py knows no peak FLOP/s for this GPU (add it to PEAK_TFLOPS in hooks/presets.jinja).
        "mfu_pct": statistics.median(r["mfu_pct"] for r in records) if records[0]["mfu_pct"] else None,
        "peak_gib": peak,
        "plan_gib": planned,
        "peak_over_plan": peak / planned,
    }


def run_loop(setup: Setup, row: Row, run_dir: Path, timeout: float) -> dict:
    """bench/_plain_loop.py on the row's model, in a process of its own (its peak memory is its own)."""
    project, package, _, config = row_config(setup, row)
    run_dir.mkdir(parents=True)
    out = run_dir / "loop.json"
    cmd = [sys.executable, str(BENCH / "_plain_loop.py"), "--project", str(project), "--package", package,
           "--out", str(out), "--model", row.model, "--steps", str(setup.steps), "--warmup", str(setup.warmup),
           *(["--compile"] if row.compile else []), "--", *config]  # fmt: skip
    done = execute(cmd, project, launch_env(project / "src", dry_run=setup.dry_run), timeout)
    if done.returncode:
        raise RowFailed(f"exit code {done.returncode}: {' '.join(cmd)}\n{done.stderr[-5000:]}")
    figures = json.loads(out.read_text())
    planned, _ = planned_gib(package, config)
    return {**figures, "plan_gib": planned, "peak_over_plan": figures["peak_gib"] / planned}


def run_test_gpu(setup: Setup, timeout: float) -> dict:
    """The project's tests/test_gpu.py: pytest's counts, and what each case measured and planned (GiB)."""
    project = setup.renders / "gpu"
    env = launch_env(project / "src", project / "tests", dry_run=setup.dry_run)
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    done = execute(cmd, project, env, timeout)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    if not counts:
        raise RowFailed(f"pytest did not run: {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    figures = {k: float(counts.get(k, 0)) for k in ("passed", "failed", "skipped")}
    for ac, measured, planned in re.findall(r"(\w+): measured ([\d.]+) GiB, planned ([\d.]+) GiB", done.stdout):
        figures |= {f"{ac}_measured_gib": float(measured), f"{ac}_plan_gib": float(planned)}
    return figures


def add_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s over its reference row's, where both ran."""
    tokens = {row["key"]: row["figures"].get("tokens_per_s") for row in rows}
    for row in rows:
        reference = BY_KEY[row["key"]].reference
        if row["figures"].get("tokens_per_s") and tokens.get(reference):
            row["figures"]["tokens_over_reference"] = row["figures"]["tokens_per_s"] / tokens[reference]


def selected_rows(text: str) -> list[str]:
    keys = [key for part in text.split(",") if part.strip() for key in GROUPS.get(part.strip(), [part.strip()])]
    unknown = [key for key in keys if key not in BY_KEY]
    if unknown:
        sys.exit(f"bench/gpu.py: --rows {text}: no row {', '.join(unknown)}; rows are {', '.join(BY_KEY)}, "
                 f"or the groups {', '.join(GROUPS)}")  # fmt: skip
    return keys


def measure(args, setup: Setup, float8: bool, save) -> list[dict]:
    """Run the selected rows in RUNS order; `save(rows)` after each."""
    selected = set(selected_rows(args.rows or ("all" if args.dry_run else "default")))
    deadline = math.inf if args.dry_run else time.monotonic() + 60 * args.max_minutes
    rows = [{"key": row.key, "name": row.name, "figures": {},
             "note": "not reached: the run stopped before it" if row.key in selected else "not selected (--rows)"}
            for row in RUNS]  # fmt: skip
    save(rows)
    for index, (row, entry) in enumerate(zip(RUNS, rows, strict=True)):
        if row.key not in selected:
            continue
        left = deadline - time.monotonic()
        if args.dry_run and row in DRY_RUN_SAME_AS:
            entry["note"] = f"not run in a dry run: the code path of {DRY_RUN_SAME_AS[row].name!r}"
        elif row.float8 != "none" and not float8:
            entry["note"] = "not run: this GPU has no float8 tensor cores (compute capability below 8.9)"
        elif left < row.expected_s:
            entry["note"] = f"not run: it takes about {row.expected_s} s, {max(left, 0):.0f} s were left of " \
                            f"--max-minutes {args.max_minutes:g}"  # fmt: skip
        else:
            entry["note"] = "stopped while it ran: the run ended first"
            save(rows)
            started, timeout = time.monotonic(), min(args.row_timeout, left)
            try:
                if row.kind == "test_gpu":
                    entry["figures"] = run_test_gpu(setup, timeout)
                elif row.kind == "loop":
                    entry["figures"] = run_loop(setup, row, setup.runs / f"{index}-{row.key}", timeout)
                else:
                    entry["figures"] = run_trainer(setup, row, setup.runs / f"{index}-{row.key}", timeout)
                del entry["note"]
            except Exception as failure:  # noqa: BLE001 - one row's failure, which must not cost the others
                error = str(failure) if isinstance(failure, RowFailed) else f"{type(failure).__name__}: {failure}"
                entry["note"], entry["error"] = "failed (see its error in the JSON file)", error
                print(f"{row.key}: {error}", file=sys.stderr)
            shutil.rmtree(setup.runs / f"{index}-{row.key}", ignore_errors=True)
            entry["figures"]["wall_s"] = time.monotonic() - started
            add_ratios(rows)
            print(f"{row.key}: {progress(entry)}", file=sys.stderr, flush=True)
        save(rows)
    return rows


def progress(entry: dict) -> str:
    f = entry["figures"]
    if "tokens_per_s" not in f:
        return entry.get("note", ", ".join(f"{k} {v:g}" for k, v in f.items()))
    ratio = f" ({f['tokens_over_reference']:.3f} of {REFERENCES[BY_KEY[entry['key']].reference]})" if (
        "tokens_over_reference" in f) else ""  # fmt: skip
    mfu = f", MFU {f['mfu_pct']:.1f}%" if f.get("mfu_pct") is not None else ""
    return (f"{f['tokens_per_s']:,.0f} tokens/s{ratio}{mfu}, peak {f['peak_gib']:.1f} GiB of {f['plan_gib']:.1f} "
            f"planned, {f['wall_s']:.0f} s")  # fmt: skip


def table(results: dict) -> str:
    """The Markdown table of a results dict (what --json writes), with the machine line under it."""
    lines = []
    for row in results["rows"]:
        f = row["figures"]
        if "tokens_per_s" not in f:
            continue
        reference = BY_KEY[row["key"]].reference
        ratio = f"{f['tokens_over_reference']:.3f} of {REFERENCES[reference]}" if "tokens_over_reference" in f else ""
        mfu = "n/a" if f["mfu_pct"] is None else f"{f['mfu_pct']:.1f}%"
        name = row["name"] + (f" (degree {f['context_parallel']:.0f})" if "context_parallel" in f else "")
        lines.append([name, f"{f['step_time_s'] * 1e3:,.0f}", f"{f['tokens_per_s']:,.0f}", ratio, mfu,
                      f"{f['peak_gib']:.1f}", f"{f['plan_gib']:.1f}", f"{f['peak_over_plan']:.2f}",
                      f"{f['wall_s']:.0f}"])  # fmt: skip
    header = ["run", "step ms", "tokens/s", "tokens/s ratio", "MFU", "peak GiB", "plan GiB", "peak / plan", "row s"]
    out = [markdown(header, lines, "lrrrrrrrr")]
    test = next(row["figures"] for row in results["rows"] if row["name"] == TEST_GPU)
    if "passed" in test:
        cases = [f"AC {key.removesuffix('_measured_gib')}: {test[key]:.2f} GiB measured, "
                 f"{test[key.replace('_measured_', '_plan_')]:.2f} planned"
                 for key in test if key.endswith("_measured_gib")]  # fmt: skip
        counts = ", ".join(f"{test[k]:.0f} {k}" for k in ("passed", "failed", "skipped") if test[k])
        out.append(f"{TEST_GPU}: {counts} in {test['wall_s']:.0f} s" + (f" ({'; '.join(cases)})" if cases else ""))
    out += [f"{row['name']}: {row['note']}" for row in results["rows"] if "note" in row]
    dry = " (--dry-run on CPU: a harness check, not a measurement)" if results["quick"] else ""
    return "\n\n".join([*out, machine_line(results["machine"]) + dry])


def prepare(target: Path, wheels: list[str], python_version: str) -> None:
    """Render both projects into `target` (gpu/, moe/), and download the wheels of `wheels` and their dependencies
    for CPython `python_version` on x86-64 Linux into target/wheels, for a machine that has torch and nothing of
    ours (bench/gpu_machine.sh installs them there)."""
    for name, answers in (("gpu", ANSWERS), ("moe", MOE_ANSWERS)):
        print(f"rendered {target / name} in {render(target / name, answers):.1f} s")
    platforms = [arg for p in ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "any") for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", python_version, *platforms, "-d", str(target / "wheels"), *wheels]  # fmt: skip
    subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in (target / "wheels").glob("*.whl")) / 2**20
    print(f"{len(list((target / 'wheels').glob('*.whl')))} wheels, {size:.1f} MiB, in {target / 'wheels'}")


def installed(name: str) -> str:
    from importlib.metadata import version

    return f"{name}=={version(name)}"


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0], "--dry-run", "run every kind of row on CPU with tiny models and gloo")
    parser.add_argument("--renders", type=Path, help="run the projects --prepare rendered here (default: render them)")
    parser.add_argument("--rows", help=f"row keys ({', '.join(BY_KEY)}), comma-separated, or the groups "
                        f"{', '.join(GROUPS)} (default: default, the first eight; --dry-run: all)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="steps per row; the first 5 are not timed")
    parser.add_argument("--max-minutes", type=float, default=8.0, help="start no row that would end after this")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="stop a row after this many seconds")
    parser.add_argument("--prepare", type=Path, help="render the projects and download the wheels here, then stop")
    parser.add_argument("--wheel", action="append", help="a requirement to download with --prepare (default: the "
                        "tyro and torchao installed here)")  # fmt: skip
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python, for --prepare's wheels")
    args = parser.parse_args()
    if args.rows:
        selected_rows(args.rows)
    if args.from_json:
        print(table(json.loads(args.from_json.read_text())))
        return
    if args.prepare:
        prepare(args.prepare, args.wheel or [installed("tyro"), installed("torchao")], args.python_version)
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(f"bench/gpu.py: no CUDA GPU here (torch {torch.__version__} sees none); run it on a machine "
                 "with one, or add --dry-run to check it on CPU")  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit's SIGTERM stops the running row too
    float8 = args.dry_run or torch.cuda.get_device_capability() >= (8, 9)
    machine = host_machine() if args.dry_run else gpu_machine()
    memory = 0 if args.dry_run else int(torch.cuda.get_device_properties(0).total_memory / 2**30)
    results = {"bench": "gpu", "quick": args.dry_run, "machine": machine, "float8": float8, "rows": []}

    def save(rows: list[dict]) -> None:
        results["rows"] = rows
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            partial = args.json.with_name(args.json.name + ".part")
            partial.write_text(json.dumps(results, indent=1) + "\n")
            partial.replace(args.json)  # whole, whenever the run is stopped

    with tempfile.TemporaryDirectory() as tmp:
        renders = args.renders.resolve() if args.renders else Path(tmp)  # the rows run in the project
        if args.renders is None:
            render(renders / "gpu", ANSWERS)
            render(renders / "moe", MOE_ANSWERS)
        sys.path[:0] = [str(renders / "gpu" / "src"), str(renders / "moe" / "src")]  # the plans' modules
        steps, warmup = (4, 2) if args.dry_run else (args.steps, 5)
        measure(args, Setup(renders, Path(tmp) / "runs", args.dry_run, steps, warmup, memory), float8, save)
    print(table(results))
    if any("error" in row for row in results["rows"]):
        sys.exit("bench/gpu.py: some rows failed (their entries say why); the other figures are in the table")


if __name__ == "__main__":
    main()
