"""CPU benchmarks of a rendered project, each a ratio measured side by side in this one run.

    python bench/cpu.py            # about 5 minutes on 2 cores; prints a Markdown table

1. Step time: the generated trainer at world size 1 (torchrun, FSDP2 on one rank, gloo) over a
   plain single-process PyTorch loop (same model class, batch, AdamW and clipping).
2. Model-state bytes: parameters + gradients + AdamW state held by one of 2 ranks, measured,
   over the ideal 16 P / N.
3. Checkpoint blocking: how long the loop waits for an async save over a synchronous one.
4. Host memory for pretrained weights at world size 2: the peak a rank adds while loading
   (`checkpoint.init_from`) and exporting through DCP's Hugging Face reader and writer (each rank
   its own slices) over the same through one full copy on rank 0 (the path before them).
5. Rendering a project, and the generated smoke test, in seconds.

Timings vary with the machine; the ratios are what the README records.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import copier

ROOT = Path(__file__).resolve().parents[1]
# A model big enough that per-step overheads show, small enough for a 2-core CI box.
MEDIUM = ["--model.dim", "512", "--model.n_layers", "6", "--model.n_heads", "8", "--model.n_kv_heads", "4",
          "--model.ffn_hidden_dim", "1536", "--model.vocab_size", "8192", "--model.max_seq_len", "256",
          "--train.seq_len", "256", "--train.micro_batch_size", "4", "--eval.interval", "0"]  # fmt: skip


def render(dst: Path, answers: dict) -> float:
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copier.run_copy(str(ROOT), str(dst), data=answers, defaults=True, unsafe=False, settings=copier.Settings(),
                        vcs_ref="HEAD", quiet=True)  # fmt: skip
    return time.perf_counter() - started


def env_for(project: Path) -> dict:
    return {**os.environ, "PYTHONPATH": f"{project / 'src'}:{project / 'tests'}", "OMP_NUM_THREADS": "1"}


def train(project: Path, run: Path, nproc: int, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "bench_pkg.train", "--config", str(project / "configs" / "debug.toml"), "--device", "cpu",
           "--run_dir", str(run), "--metrics.progress_bar", "False", *MEDIUM,
           "--train.global_batch_size", str(4 * nproc), *overrides]  # fmt: skip
    done = subprocess.run(cmd, cwd=project, env=env_for(project), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"training failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")


def trainer_step_seconds(project: Path, run: Path, steps: int) -> float:
    train(project, run, 1, "--train.steps", str(steps), "--train.warmup_steps", "1", "--checkpoint.interval", "100000")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[3:])  # skip warm-up steps


PLAIN_LOOP = """
import statistics, sys, time, torch
import torch.nn.functional as F
from bench_pkg.config import load_config
from bench_pkg.data import build_loader
from bench_pkg.models import build_model

cfg = load_config(sys.argv[1:])
model = build_model(cfg.model)
model.init_weights(torch.Generator().manual_seed(0))
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=cfg.train.betas)
loader = build_loader(cfg, 0, 1, torch.device("cpu"))
times = []
for _ in range(cfg.train.steps):
    started = time.perf_counter()
    for inputs, targets in loader.next_batches():
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - started)
print(statistics.median(times[3:]))
"""


def plain_step_seconds(project: Path, steps: int) -> float:
    cmd = [sys.executable, "-c", PLAIN_LOOP, "--config", str(project / "configs" / "debug.toml"), *MEDIUM,
           "--train.global_batch_size", "4", "--train.steps", str(steps)]  # fmt: skip
    out = subprocess.run(cmd, cwd=project, env=env_for(project), check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def state_bytes_ratio(project: Path, run: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fsdp_probe",
           "--config", str(project / "configs" / "debug.toml"), "--device", "cpu", "--run_dir", str(run),
           "--train.micro_batch_size", "2"]  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, cwd=project, env=env_for(project), check=True, capture_output=True)
    report = json.loads((run / "probe_rank0.json").read_text())
    sys.path.insert(0, str(project / "src"))
    from bench_pkg.config import load_config
    from bench_pkg.plan import ModelShape

    n_params = ModelShape.of(load_config(["--config", str(project / "configs" / "debug.toml")]).model).P
    return report["state_bytes"] / (16 * n_params / 2)


def checkpoint_blocked_seconds(project: Path, run: Path, fmt: str) -> float:
    train(project, run, 2, "--train.steps", "12", "--train.warmup_steps", "1", "--checkpoint.interval", "3",
          "--checkpoint.format", fmt)  # fmt: skip
    events = [json.loads(line) for line in (run / "checkpoints" / "events.jsonl").read_text().splitlines()]
    return statistics.median(e["blocked_s"] for e in events[:-1])  # the final save also waits for the last write


WEIGHTS_MEMORY = """
import json, sys, threading, time
from pathlib import Path
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from bench_pkg import train, weights
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


op, path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
cfg = load_config(sys.argv[4:])
spec = model_spec(cfg.model.name)
env = train.init_distributed(cfg, spec)
model = train.build_model_meta(cfg, spec, env, init_weights=False)
if op == "load_sharded":
    cfg.checkpoint.init_from = path
    added = peak_added(lambda: weights.load_pretrained(model, cfg, spec))
elif op == "load_rank0":
    full_state = lambda: weights.load(Path(path), cfg.model)  # noqa: E731
    added = peak_added(lambda: env.strategy.apply_weights_from_rank0(model, full_state))
elif op == "export_sharded":
    added = peak_added(lambda: weights.export_weights(model, cfg, spec, Path(path), env.is_main))
else:
    def gather_and_save():
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.is_main:
            weights.save(full, cfg.model, Path(path), "safetensors")

    added = peak_added(gather_and_save)
(out / f"{op}_rank{env.rank}.json").write_text(json.dumps(added))
"""


def weights_memory_ratios(project: Path, tmp: Path) -> tuple[float, float, int, int, int, int]:
    """Peak host bytes a rank adds (the larger of 2 ranks): sharded / rank-0 path, for load and for export."""
    script = tmp / "weights_memory.py"
    script.write_text(WEIGHTS_MEMORY)
    added = {}
    for op, path in [("export_sharded", tmp / "exported"), ("export_rank0", tmp / "exported_rank0"),
                     ("load_sharded", tmp / "exported"), ("load_rank0", tmp / "exported")]:  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), op,
               str(path), str(tmp), "--config", str(project / "configs" / "debug.toml"), "--device", "cpu",
               "--run_dir", str(tmp / "weights_run"), "--checkpoint.export", "safetensors", *MEDIUM]  # fmt: skip
        done = subprocess.run(cmd, cwd=project, env=env_for(project), capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{op} failed:\n{done.stderr[-4000:]}")
        added[op] = max(json.loads((tmp / f"{op}_rank{r}.json").read_text()) for r in range(2))
    load_new, load_old, export_new, export_old = (added[k] for k in ("load_sharded", "load_rank0", "export_sharded",
                                                                      "export_rank0"))  # fmt: skip
    return load_new / load_old, export_new / export_old, load_new, load_old, export_new, export_old


def smoke_seconds(project: Path) -> float:
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_smoke.py"]
    subprocess.run(cmd, cwd=project, env=env_for(project), check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        render_s = render(tmp / "default", {})
        project = tmp / "cpu"
        render(project, {"accelerator": "cpu", "model_size": "debug", "package_name": "bench_pkg"})
        trainer = trainer_step_seconds(project, tmp / "trainer", 15)
        plain = plain_step_seconds(project, 15)
        state = state_bytes_ratio(project, tmp / "probe")
        sync = checkpoint_blocked_seconds(project, tmp / "sync", "dcp")
        async_ = checkpoint_blocked_seconds(project, tmp / "async", "dcp_async")
        load_ratio, export_ratio, *memory = weights_memory_ratios(project, tmp)
        smoke = smoke_seconds(project)
    rows = [
        ("trainer step time at world size 1 / plain PyTorch loop", f"{trainer / plain:.3f}",
         f"{trainer * 1e3:.0f} ms / {plain * 1e3:.0f} ms", "<= 1.10"),
        ("model-state bytes per rank at world size 2 / ideal 16P/N", f"{state:.3f}", "", "<= 1.02"),
        ("loop blocked by an async save / by a sync save", f"{async_ / sync:.3f}",
         f"{async_ * 1e3:.0f} ms / {sync * 1e3:.0f} ms", "< 1"),
        ("host memory a rank adds loading pretrained weights, world size 2: sharded reader / rank-0 copy",
         f"{load_ratio:.3f}", f"{memory[0] / 2**20:.0f} MiB / {memory[1] / 2**20:.0f} MiB", "< 1"),
        ("host memory a rank adds exporting the weights, world size 2: sharded writer / rank-0 copy",
         f"{export_ratio:.3f}", f"{memory[2] / 2**20:.0f} MiB / {memory[3] / 2**20:.0f} MiB", "< 1"),
        ("render the default project", f"{render_s:.1f} s", "", ""),
        ("generated smoke test (tests/test_smoke.py)", f"{smoke:.0f} s", "", "about a minute"),
    ]  # fmt: skip
    print("| measurement | ratio or time | raw | goal |\n| --- | ---: | ---: | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
