"""CPU benchmarks of rendered projects, each a ratio or a time measured side by side in this one run.

    python bench/cpu.py --json bench/results/cpu.json   # about 15 minutes on 2 cores; prints a Markdown table
    python bench/cpu.py --quick                         # every row on the debug model, in about two minutes
    python bench/cpu.py --from-json bench/results/cpu.json   # the README's table, from the recorded figures
    python bench/cpu.py --moe-only --json bench/results/cpu_moe.json   # the mixture-of-experts rows alone

1. Step time: the generated trainer at world size 1 (torchrun, gloo; one rank shards nothing, so no
   FSDP) over the plain single-process loop a user would write (PLAIN_LOOP: the same model class and
   batch, autocast where the config computes in low precision, fused AdamW, clip_grad_norm_). Then
   the step-overhead proxy, which needs no GPU: per step, torch.profiler's aten ops (all of them, and
   the leaves, since a DTensor op shows once as itself and once as its local op) and the host's reads
   of device values (syncs) between log intervals, trainer over plain loop, on the debug model in bf16
   with two micro-batches (trace_counts says what is counted).
2. Model-state bytes: parameters + gradients + AdamW state held by one of 2 ranks, measured,
   over the ideal 16 P / N.
3. Checkpoint blocking: how long the loop waits for an async save over a synchronous one.
4. Host memory for pretrained weights at world size 2: the peak a rank adds while loading
   (`checkpoint.init_from`) and exporting through DCP's Hugging Face reader and writer (each rank
   its own slices) over the same through one full copy on rank 0 (the path before them).
5. Context parallelism at world size 2, one sequence per micro-batch (1,024 tokens of the model
   above): the step time, and the peak a rank holds in a one-micro-batch step beyond its model
   state (torch's MemTracker), with parallel.context_parallel = 2 (each rank holds half of every
   sequence; Ulysses attention) over FSDP alone (each rank holds whole sequences).
6. The loss in chunks at world size 2, one 1,024-token sequence per micro-batch of the model above: the peak a
   rank holds in a one-micro-batch step beyond its model state (torch's MemTracker) with train.loss_chunk = 128
   (the output layer computes 128 positions' logits at a time) over the whole logits (0).
7. Activation offload on the debug model (8 blocks, 6 of whose inputs park) at world size 1 with full
   recomputation: the step time with parallel.activation_offload over without. On CPU ranks the host copy is a
   copy in the same memory, so this is what the hooks and copies cost, not a GPU's overlap.
8. Rendering the default project; the generated fast tier (`pytest`) of the default render and of
   a CPU render, and the default render's smoke test, each in a fresh torch.compile cache (cold),
   in wall seconds and in the CPU seconds of every process they ran (less sensitive to other work
   on the machine). The step and checkpoint timings are each the fastest of two runs, taken in turn.
9. A mixture of experts (an MoE render's debug model, 8 experts of which 2 a token) on 2 ranks: the
   step time with its experts split between the ranks (expert parallelism 2, all-to-all) over every
   rank holding all of them (1), and the bytes its all-to-alls send in a step, measured from their
   split sizes (tests/moe_probe.py), over the plan's `expert_parallel_bytes`.

The quick mode (tests/test_bench.py runs it) measures the same rows with the debug model, fewer
steps, and one generated test in place of the fast tier and the smoke test: it checks the harness,
and its figures mean nothing. Timings vary with the machine, named by the line under the table.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import env_for, ratio_row, render, run_cpu_bench, table

# What tests/test_bench.py reads of every benchmark: its rows, its table and its command line.
__all__ = ["ROWS", "main", "table"]

# A model big enough that per-step overheads show, small enough for a 2-core CI box.
MEDIUM = ["--model.dim", "512", "--model.n_layers", "6", "--model.n_heads", "8", "--model.n_kv_heads", "4",
          "--model.ffn_hidden_dim", "1536", "--model.vocab_size", "8192", "--model.max_seq_len", "256",
          "--train.seq_len", "256", "--train.micro_batch_size", "4"]  # fmt: skip
QUICK_SIZE = ["--train.micro_batch_size", "4"]
# Context parallelism: one sequence per micro-batch, long enough that what grows with it dominates a rank's memory.
LONG = [*MEDIUM[:-6], "--model.max_seq_len", "1024", "--train.seq_len", "1024", "--train.micro_batch_size", "1"]
QUICK_LONG = ["--train.micro_batch_size", "1"]
# The loss in chunks of this many positions, against the whole logits, on LONG's sequence (the quick mode's: 64).
LOSS_CHUNK, QUICK_LOSS_CHUNK = "128", "16"
# One generated test that launches nothing: the quick mode's stand-in for the timed pytest runs.
QUICK_SELECTION = ["tests/test_fsdp_rules.py::test_train_py_structure"]
ROWS = [
    "trainer step time at world size 1 / plain PyTorch loop",
    "aten ops per step, leaves (ops with no aten op inside), world size 1, bf16: trainer / plain loop",
    "aten ops per step, all (a DTensor op counts twice), world size 1, bf16: trainer / plain loop",
    "host-device syncs per step between log intervals, world size 1, bf16: trainer / plain loop",
    "model-state bytes per rank at world size 2 / ideal 16P/N",
    "loop blocked by an async save / by a sync save",
    "host memory a rank adds loading pretrained weights, world size 2: sharded reader / rank-0 copy",
    "host memory a rank adds exporting the weights, world size 2: sharded writer / rank-0 copy",
    "step time at world size 2, one sequence per micro-batch: context parallel 2 / FSDP alone",
    "peak a rank holds beyond its model state in that step: context parallel 2 / FSDP alone",
    "peak a rank holds beyond its model state in that step: the loss in chunks of 128 / the whole logits",
    "step time at world size 1, debug model (8 blocks), full recomputation: activation offload on / off",
    "render the default project",
    "generated fast tier (`pytest`), default render, cold",
    "generated smoke test (`pytest tests/test_smoke.py`), default render, cold",
    "generated fast tier (`pytest`), CPU render, cold",
    "MoE debug model step time at world size 2: expert parallelism 2 / 1",
    "MoE all-to-all bytes per step at expert parallelism 2: measured / planned",
]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(project: Path, run: Path, nproc: int, size: list[str], *overrides: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "bench_pkg.train", "--config", str(project / "configs" / "debug.toml"), "--device", "cpu",
           "--run_dir", str(run), "--metrics.progress_bar", "False", "--eval.interval", "0", *size,
           "--train.global_batch_size", str(4 * nproc), *overrides]  # fmt: skip
    done = subprocess.run(cmd, cwd=project, env=env_for(project), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"training failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")


def trainer_step_seconds(project: Path, run: Path, size: list[str], steps: int) -> float:
    train(project, run, 1, size, "--train.steps", str(steps), "--train.warmup_steps", "1",
          "--checkpoint.interval", "100000")  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[3:])  # skip warm-up steps


PLAIN_LOOP = """
import statistics, sys, time, torch
import torch.nn.functional as F
from bench_pkg.config import load_config
from bench_pkg.data import build_loader
from bench_pkg.models import build_model

# The loop a user would write around the render's own module: fp32 weights, autocast where the config computes in
# low precision, fused AdamW, clip_grad_norm_; nothing synchronises with the device inside a step.
trace, argv = (sys.argv[2], sys.argv[3:]) if sys.argv[1] == "--trace" else (None, sys.argv[1:])
cfg = load_config(argv)
device = torch.device("cpu")
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[cfg.parallel.mixed_precision]
model = build_model(cfg.model)
model.init_weights(torch.Generator().manual_seed(0))
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=cfg.train.betas,
                              weight_decay=cfg.train.weight_decay, fused=True)
loader = build_loader(data=cfg.data, train=cfg.train, eval=cfg.eval, model=cfg.model, rank=0, world_size=1,
                      device=device)
warm_up = 3
profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
times = []
for step in range(cfg.train.steps):
    if trace and step == warm_up:
        profiler.start()
    started = time.perf_counter()
    batches = loader.next_batches()
    for inputs, targets in batches:
        with torch.autocast(device.type, dtype, enabled=dtype is not None):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten()) / len(batches)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm, foreach=True)  # a GPU's default
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - started)
if trace:
    profiler.stop()
    profiler.export_chrome_trace(trace)
loader.close()
print(statistics.median(times[warm_up:]))
"""


def plain_step_seconds(project: Path, size: list[str], steps: int, *overrides: str) -> float:
    cmd = [sys.executable, "-c", PLAIN_LOOP, "--config", str(project / "configs" / "debug.toml"), *size,
           "--train.global_batch_size", "4", "--train.steps", str(steps), *overrides]  # fmt: skip
    out = subprocess.run(cmd, cwd=project, env=env_for(project), check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


# The step-overhead proxy: what the trainer's step does on the host beyond the plain loop, counted by torch.profiler
# on the CPU, where no GPU is needed. The debug model at bf16 (the GPU presets' precision), two micro-batches.
PROXY = ["--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--parallel.mixed_precision", "bf16"]
PROXY_WARM_UP = 3
SYNCS = ("aten::_local_scalar_dense",)
"""Where the host reads a tensor's value (.item(), bool(), .tolist()); on a GPU also the CUDA runtime's
synchronisations below. Counted where the step's own Python code reads a value, not inside an aten op (the CPU
kernel of fused AdamW reads each step count, which on a GPU stays on the device) nor inside Optimizer.step (on
a GPU its step counts are host tensors, or device tensors the fused kernel reads itself)."""
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


KERNELS = ("aten::_foreach_", "aten::_fused_", "aten::_scaled_mm")
"""Ops that are one kernel on a GPU and many ops on a CPU (a loop over the tensors, chunked; float8's matmul, which
the CPU computes through bf16 copies): what runs inside them is not counted."""


def trace_counts(path: Path, steps: int) -> dict[str, float]:
    """Per step, from a torch.profiler chrome trace of `steps` steps: aten ops (all of them, and the leaves: ops
    with no aten op inside them, which a DTensor op is not: it shows once as itself and once as its local op),
    and host-device synchronisations (SYNCS)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    n_ops, parents, syncs = 0, set(), 0
    for tid in {e["tid"] for e in ops}:
        stack: list[tuple[int, int]] = []  # (end, index) of the open events, outermost first
        spans = sorted(((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000), i) for i, e in enumerate(ops)
                        if e["tid"] == tid), key=lambda span: (span[0], -span[1]))  # fmt: skip
        for _, end, i in spans:
            while stack and stack[-1][0] < end:  # the open event ended before this one does: not its parent
                stack.pop()
            name, enclosing = ops[i]["name"], [ops[j]["name"] for _, j in stack]
            stack.append((end, i))
            if not name.startswith("aten::") or any(n.startswith(KERNELS) for n in enclosing):
                continue
            n_ops += 1
            aten = [j for _, j in stack[:-1] if ops[j]["name"].startswith("aten::")]
            if aten:
                parents.add(aten[-1])
            if name in SYNCS and all(n == "aten::item" or not n.startswith(("aten::", "Optimizer.step"))
                                     for n in enclosing):  # fmt: skip
                syncs += 1
    syncs += sum(e["name"] in CUDA_SYNCS for e in events)
    return {"ops": n_ops / steps, "leaf_ops": (n_ops - len(parents)) / steps, "syncs": syncs / steps}


def trainer_step_counts(project: Path, run: Path, steps: int) -> dict[str, float]:
    """trace_counts of the trainer at world size 1 over `steps` steps after PROXY_WARM_UP, between log intervals
    (it logs the last step only), without validation or checkpoints in the window: its own profiler's trace."""
    first, last = PROXY_WARM_UP + 1, PROXY_WARM_UP + steps
    train(project, run, 1, [], *PROXY, "--train.steps", str(last + 1), "--train.warmup_steps", "1",
          "--checkpoint.interval", "100000", "--metrics.log_every", str(last + 1),
          "--metrics.profile_steps", f"{first}-{last}")  # fmt: skip
    return trace_counts(run / "profile" / "trace_rank0.json", steps)


def plain_step_counts(project: Path, out: Path, steps: int) -> dict[str, float]:
    """trace_counts of PLAIN_LOOP over `steps` steps after the same warm-up."""
    trace = out / "plain_trace.json"
    cmd = [sys.executable, "-c", PLAIN_LOOP, "--trace", str(trace), "--config", str(project / "configs" / "debug.toml"),
           *PROXY, "--train.steps", str(PROXY_WARM_UP + steps)]  # fmt: skip
    subprocess.run(cmd, cwd=project, env=env_for(project), check=True, capture_output=True, text=True)
    return trace_counts(trace, steps)


def proxy_rows(trainer: dict[str, float], plain: dict[str, float]) -> list[dict]:
    rows = []
    for name, key in zip(ROWS[1:4], ("leaf_ops", "ops", "syncs"), strict=True):
        new, old = trainer[key], plain[key]
        rows.append(ratio_row(name, new, old, f"{new:,.1f} / {old:,.1f}", "<= 1.05"))
    return rows


def state_bytes(project: Path, run: Path) -> tuple[int, int]:
    """(bytes of model state rank 0 holds at world size 2, parameters) on the debug preset."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fsdp_probe",
           "--config", str(project / "configs" / "debug.toml"), "--device", "cpu", "--run_dir", str(run),
           "--train.micro_batch_size", "2"]  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, cwd=project, env=env_for(project), check=True, capture_output=True)
    report = json.loads((run / "probe_rank0.json").read_text())
    sys.path.insert(0, str(project / "src"))
    from bench_pkg.config import load_config
    from bench_pkg.models import model_shape

    n_params = model_shape(load_config(["--config", str(project / "configs" / "debug.toml")]).model).P
    return report["memory"]["state_bytes"], n_params


def context_parallel_step_seconds(project: Path, run: Path, size: list[str], steps: int, degree: int) -> float:
    """Median step time at world size 2 with parallel.context_parallel = `degree` (4 sequences a step)."""
    train(project, run, 2, size, "--train.steps", str(steps), "--train.warmup_steps", "1", "--checkpoint.interval",
          "100000", "--train.global_batch_size", "4", "--parallel.context_parallel", str(degree))  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[3:])  # skip warm-up steps


def held_bytes(project: Path, run: Path, size: list[str], *overrides: str) -> int:
    """Bytes rank 0 holds at the peak of a one-micro-batch step beyond its parameters, gradients and AdamW
    state, at world size 2 with `overrides` (tests/fsdp_probe.py's MemTracker)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fsdp_probe",
           "--config", str(project / "configs" / "debug.toml"), "--device", "cpu", "--run_dir", str(run), *size,
           "--train.global_batch_size", "4", *overrides]  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, cwd=project, env=env_for(project), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"fsdp_probe failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    memory = json.loads((run / "probe_rank0.json").read_text())["memory"]
    return memory["tracked_peak_bytes"] - memory["state_bytes"]


# Activation offload: the debug model with 8 blocks, whose first 6 inputs park, recomputing every block.
OFFLOAD = ["--model.n_layers", "8", "--parallel.activation_checkpointing", "full"]


def offload_step_seconds(project: Path, run: Path, steps: int, offload: bool) -> float:
    """Median step time at world size 1 on the debug model, with or without parallel.activation_offload."""
    train(project, run, 1, QUICK_SIZE, *OFFLOAD, "--parallel.activation_offload", str(offload), "--train.steps",
          str(steps), "--train.warmup_steps", "1", "--checkpoint.interval", "100000")  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[3:])  # skip warm-up steps


def checkpoint_blocked_seconds(project: Path, run: Path, size: list[str], steps: int, fmt: str) -> float:
    train(project, run, 2, size, "--train.steps", str(steps), "--train.warmup_steps", "1",
          "--checkpoint.interval", str(steps // 4 or 1), "--checkpoint.format", fmt)  # fmt: skip
    events = [json.loads(line) for line in (run / "checkpoints" / "events.jsonl").read_text().splitlines()]
    return statistics.median(e["blocked_s"] for e in events[:-1])  # the final save also waits for the last write


WEIGHTS_MEMORY = """
import json, sys, threading, time
from pathlib import Path
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from bench_pkg import weights
from bench_pkg.run import build_model_meta, init_distributed
from bench_pkg.strategy import build_strategy
from bench_pkg.config import load_config
from bench_pkg.models import model_spec

PAGE = 4096


def rss() -> int:
    # Resident memory not backed by a file: mapped safetensors pages are page cache, not held memory.
    resident, shared = Path("/proc/self/statm").read_text().split()[1:3]
    return (int(resident) - int(shared)) * PAGE


def peak_added(work) -> int:
    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    work()
    done.set()
    thread.join()
    return max(peak[0], rss()) - base


jobs, out = sys.argv[1], Path(sys.argv[2])
first = load_config(sys.argv[3:])
spec = model_spec(first.model.name)
env = init_distributed(device=first.device, dist=first.dist, parallel=first.parallel, seed=first.train.seed)
strategy = build_strategy(first.parallel, env.mesh, env.device, degrees=env.degrees)
for job in jobs.split(","):  # op=path, each on a model of its own
    op, path = job.split("=", 1)
    cfg = load_config(sys.argv[3:])
    model = build_model_meta(spec=spec, model=cfg.model, finetune=cfg.finetune, parallel=cfg.parallel, env=env,
                             strategy=strategy, init_from="", seed=0, init_weights=False)
    if op == "load_sharded":
        added = peak_added(lambda: weights.load_pretrained(model, init_from=path, model_cfg=cfg.model, spec=spec))
    elif op == "load_rank0":
        full_state = lambda: weights.load(Path(path), cfg.model)  # noqa: E731
        added = peak_added(lambda: strategy.apply_weights_from_rank0(model, full_state))
    elif op == "export_sharded":
        export = {"spec": spec, "model_cfg": cfg.model, "checkpoint": cfg.checkpoint, "finetune": cfg.finetune}
        added = peak_added(lambda: weights.export_weights(model, **export, out=Path(path), is_main=env.is_main))
    else:
        def gather_and_save():
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if env.is_main:
                weights.save(full, cfg.model, Path(path), "safetensors")

        added = peak_added(gather_and_save)
    (out / f"{op}_rank{env.rank}.json").write_text(json.dumps(added))
"""


def weights_memory(project: Path, tmp: Path, size: list[str], quick: bool) -> dict[str, int]:
    """Peak host bytes a rank adds (the larger of 2 ranks), per operation: sharded and rank-0 paths, load and export.
    Each operation runs in a launch of its own, as memory a process freed is not all returned; the quick mode runs
    the four in one launch."""
    script = tmp / "weights_memory.py"
    script.write_text(WEIGHTS_MEMORY)
    jobs = [("export_sharded", tmp / "exported"), ("export_rank0", tmp / "exported_rank0"),
            ("load_sharded", tmp / "exported"), ("load_rank0", tmp / "exported")]  # fmt: skip
    for launch in [jobs] if quick else [[job] for job in jobs]:
        ops = ",".join(f"{op}={path}" for op, path in launch)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), ops,
               str(tmp), "--config", str(project / "configs" / "debug.toml"), "--device", "cpu",
               "--run_dir", str(tmp / "weights_run"), "--checkpoint.export", "safetensors", *size]  # fmt: skip
        done = subprocess.run(cmd, cwd=project, env=env_for(project), capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{ops} failed:\n{done.stderr[-4000:]}")
    return {op: max(json.loads((tmp / f"{op}_rank{r}.json").read_text()) for r in range(2)) for op, _ in jobs}


def moe_probe(project: Path, run: Path, degree: int, steps: int) -> dict:
    """tests/moe_probe.py on 2 ranks with `degree`: rank 0's report (step time, all-to-all bytes measured and
    planned), each rank's micro-batch one of 4 sequences."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "moe_probe",
           "--config", str(project / "configs" / "debug.toml"), "--device", "cpu", "--run_dir", str(run),
           "--parallel.expert_parallel", str(degree), "--train.micro_batch_size", "4", "--parallel.compile", "False",
           "--metrics.progress_bar", "False"]  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    env = {**env_for(project), "MOE_PROBE_STEPS": str(steps)}
    done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"moe_probe failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return json.loads((run / "moe_probe_rank0.json").read_text())


def pytest_seconds(project: Path, selection: list[str]) -> tuple[float, float, float, str]:
    """Wall and CPU seconds of the generated tests `selection` in a fresh torch.compile cache, the machine's
    1-minute load average as they ended (other work slows them down), and pytest's summary."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    started, cpu = time.perf_counter(), children_cpu_s()
    done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - started, children_cpu_s() - cpu
    if done.returncode:
        sys.exit(f"pytest {' '.join(selection)} failed in {project}:\n{done.stdout[-4000:]}")
    return wall, cpu, os.getloadavg()[0], done.stdout.strip().splitlines()[-1].strip("= ")


def memory_row(name: str, memory: dict[str, int], op: str) -> dict:
    new, old = memory[f"{op}_sharded"], memory[f"{op}_rank0"]
    return ratio_row(name, new, old, f"{new / 2**20:.0f} MiB / {old / 2**20:.0f} MiB", "< 1")


def seconds_row(name: str, timed: tuple[float, float, float, str], goal: str) -> dict:
    wall, cpu, load, summary = timed
    figures = {"wall_s": wall, "cpu_s": cpu, "load_at_end": load}
    return {"name": name, "figures": figures, "raw": f"{cpu:.0f} CPU s, load {load:.1f} at the end; {summary}",
            "goal": goal}  # fmt: skip


def fastest(repeats: int, *measurements: Callable[[int], float]) -> list[float]:
    """Each measurement's fastest of `repeats` runs, taken in turn: other work on the machine only
    slows a run down, and alternating spreads it over both sides of a ratio."""
    runs = [[run(i) for run in measurements] for i in range(repeats)]
    return [min(times) for times in zip(*runs, strict=True)]


def measure(quick: bool) -> list[dict]:
    size, steps, saves, repeats = (QUICK_SIZE, 6, 2, 1) if quick else (MEDIUM, 15, 12, 2)
    long, long_steps = (QUICK_LONG, 5) if quick else (LONG, 8)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        render_s = render(tmp / "default", {})
        project = tmp / "cpu"
        render(project, {"accelerator": "cpu", "model_size": "debug", "package_name": "bench_pkg"})
        trainer, plain = fastest(
            repeats,
            lambda i: trainer_step_seconds(project, tmp / f"trainer{i}", size, steps),
            lambda i: plain_step_seconds(project, size, steps),
        )
        counted = 2 if quick else 4  # steps profiled: every step counts the same ops
        proxy = proxy_rows(trainer_step_counts(project, tmp / "proxy", counted),
                           plain_step_counts(project, tmp, counted))  # fmt: skip
        state, n_params = state_bytes(project, tmp / "probe")
        sync, async_ = fastest(
            repeats,
            lambda i: checkpoint_blocked_seconds(project, tmp / f"sync{i}", size, saves, "dcp"),
            lambda i: checkpoint_blocked_seconds(project, tmp / f"async{i}", size, saves, "dcp_async"),
        )
        memory = weights_memory(project, tmp, size, quick)
        split, whole = fastest(
            repeats,
            lambda i: context_parallel_step_seconds(project, tmp / f"cp2-{i}", long, long_steps, 2),
            lambda i: context_parallel_step_seconds(project, tmp / f"cp1-{i}", long, long_steps, 1),
        )
        cp = "--parallel.context_parallel"
        held = {d: held_bytes(project, tmp / f"cp-probe{d}", long, cp, str(d)) for d in (1, 2)}
        chunk = QUICK_LOSS_CHUNK if quick else LOSS_CHUNK
        loss = {c: held_bytes(project, tmp / f"loss-probe{c}", long, "--train.loss_chunk", c) for c in (chunk, "0")}
        parked, kept = fastest(
            repeats,
            lambda i: offload_step_seconds(project, tmp / f"parked{i}", steps + 5, True),
            lambda i: offload_step_seconds(project, tmp / f"kept{i}", steps + 5, False),
        )
        fast = pytest_seconds(tmp / "default", QUICK_SELECTION if quick else [])
        # The quick mode's selection is the same for both rows of the default render: it runs once.
        smoke = fast if quick else pytest_seconds(tmp / "default", ["tests/test_smoke.py"])
        fast_cpu = pytest_seconds(project, QUICK_SELECTION if quick else [])
    return [
        ratio_row(ROWS[0], trainer, plain, f"{trainer * 1e3:.0f} ms / {plain * 1e3:.0f} ms", "<= 1.05"),
        *proxy,
        ratio_row(ROWS[4], state, 16 * n_params / 2, f"{state:,} B", "<= 1.02"),
        ratio_row(ROWS[5], async_, sync, f"{async_ * 1e3:.0f} ms / {sync * 1e3:.0f} ms", "< 1"),
        memory_row(ROWS[6], memory, "load"),
        memory_row(ROWS[7], memory, "export"),
        ratio_row(ROWS[8], split, whole, f"{split * 1e3:.0f} ms / {whole * 1e3:.0f} ms", "about 1"),
        ratio_row(ROWS[9], held[2], held[1], f"{held[2] / 2**20:.0f} MiB / {held[1] / 2**20:.0f} MiB", "about 1/2"),
        ratio_row(
            ROWS[10], loss[chunk], loss["0"], f"{loss[chunk] / 2**20:.0f} MiB / {loss['0'] / 2**20:.0f} MiB", "< 1"
        ),
        ratio_row(ROWS[11], parked, kept, f"{parked * 1e3:.1f} ms / {kept * 1e3:.1f} ms", OFFLOAD_GOAL),
        {"name": ROWS[12], "figures": {"wall_s": render_s}, "raw": "", "goal": ""},
        seconds_row(ROWS[13], fast, "under 2 minutes"),
        seconds_row(ROWS[14], smoke, "under a minute"),
        seconds_row(ROWS[15], fast_cpu, "under 2 minutes"),
        *measure_moe(quick),
    ]


OFFLOAD_GOAL = "about 1 (on a GPU the copies overlap compute)"
MOE_STEP_GOAL = "about 1 on CPU ranks (the saving is a GPU node's, where the experts' traffic dominates)"


def measure_moe(quick: bool) -> list[dict]:
    """The mixture-of-experts rows (9. above), in an MoE render of their own."""
    steps, repeats = (3, 1) if quick else (20, 5)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        moe = tmp / "moe"
        render(moe, {"accelerator": "cpu", "model_type": "qwen3_moe", "package_name": "bench_pkg"})
        probes = {}  # (degree, repeat): the probe's figures

        def step_seconds(degree: int, i: int) -> float:
            probes[degree, i] = moe_probe(moe, tmp / f"moe{degree}-{i}", degree, steps)
            return probes[degree, i]["step_s"]

        ep1, ep2 = fastest(repeats, lambda i: step_seconds(1, i), lambda i: step_seconds(2, i))
        a2a = probes[2, 0]  # the bytes a step sends do not vary between runs: routing is seeded
    sent, planned = a2a["a2a_sent"], a2a["planned_a2a_sent"]
    return [
        ratio_row(ROWS[16], ep2, ep1, f"{ep2 * 1e3:.0f} ms / {ep1 * 1e3:.0f} ms", MOE_STEP_GOAL),
        ratio_row(ROWS[17], sent, planned, f"{sent:,.0f} B / {planned:,.0f} B", "about 1 (routing in balance)"),
    ]


def main() -> None:
    # --moe-only: the mixture-of-experts rows alone (bench/results/cpu_moe.json), a run of a minute or two.
    moe_only = "--moe-only" in sys.argv
    if moe_only:
        sys.argv.remove("--moe-only")
    run_cpu_bench("cpu", __doc__, "every row on the debug model, in about two minutes",
                  measure_moe if moe_only else measure)  # fmt: skip


if __name__ == "__main__":
    main()
