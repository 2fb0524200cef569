"""GPU benchmark of a rendered project: the ~1B preset on one CUDA GPU (NCCL, world size 1).

    python bench/gpu.py [--steps 30]        # about 10 minutes on an H100/H200

For bf16 with compile off/on and activation checkpointing none/selective/full, and float8
(tensorwise and rowwise, compiled) where the GPU has float8 tensor cores (sm 8.9+), it prints, as a
Markdown table, tokens/s per GPU, MFU, the peak of torch.cuda.max_memory_allocated, and that
peak over the memory plan's estimate (the plan aims to be within 15%); float8 rows also give their
tokens/s over the compiled bf16 row's. Run it where a GPU is
at hand and record the table in the README; CI has no GPU and does not run it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import copier

ROOT = Path(__file__).resolve().parents[1]
# (compile, activation checkpointing, float8)
VARIANTS = [("off", "none", "none"), ("off", "selective", "none"), ("off", "full", "none"), ("on", "selective", "none")]
FLOAT8 = [("on", "selective", "tensorwise"), ("on", "selective", "rowwise")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "gpu"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answers = {"package_name": "bench_gpu", "model_size": "1b", "gpus_per_node": 1, "gpu_memory_gb": 80,
                       "seq_len": 4096, "micro_batch_size": 2, "mixed_precision": "bf16",
                       "sharding": "full"}  # fmt: skip
            copier.run_copy(str(ROOT), str(project), data=answers, defaults=True, unsafe=False,
                            settings=copier.Settings(), vcs_ref="HEAD", quiet=True)  # fmt: skip
        sys.path.insert(0, str(project / "src"))
        from bench_gpu.config import load_config
        from bench_gpu.plan import GIB, plan_for

        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        import torch

        float8 = torch.cuda.get_device_capability() >= (8, 9)
        print("| compile | activation checkpointing | float8 | tokens/s/GPU | vs bf16 | MFU | peak GiB | peak / plan |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        bf16_tps = None
        for compile_, ac, recipe in VARIANTS + (FLOAT8 if float8 else []):
            run = Path(tmp) / f"run-{compile_}-{ac}-{recipe}"
            overrides = ["--train.steps", str(args.steps), "--train.warmup_steps", "5", "--checkpoint.interval",
                         "100000", "--checkpoint.export", "none", "--parallel.compile", str(compile_ == "on"),
                         "--parallel.activation_checkpointing", ac, "--metrics.progress_bar", "False",
                         "--parallel.float8", recipe, "--eval.interval", "0"]  # fmt: skip
            config = ["--config", str(project / "configs" / "1b.toml"), "--run_dir", str(run), *overrides]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   "-m", "bench_gpu.train", *config]  # fmt: skip
            subprocess.run(cmd, cwd=project, env=env, check=True)
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][5:]
            tps = statistics.median(r["tokens_per_s_per_device"] for r in records)
            mfu = statistics.median(r["mfu_pct"] or 0 for r in records)
            peak = max(r["peak_mem_gib"] for r in records)
            planned = plan_for(load_config(config)).total / GIB
            if (compile_, recipe) == ("on", "none"):
                bf16_tps = tps
            ratio = f"{tps / bf16_tps:.2f}" if recipe != "none" and bf16_tps else ""
            cells = [compile_, ac, recipe, f"{tps:,.0f}", ratio, f"{mfu:.1f}%", f"{peak:.1f}", f"{peak / planned:.2f}"]
            print("| " + " | ".join(cells) + " |")
        if not float8:
            print("float8 rows skipped: this GPU has no float8 tensor cores (compute capability below 8.9)")


if __name__ == "__main__":
    main()
