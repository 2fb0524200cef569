"""The training loop a user would write in 40 lines, on a rendered project's own model (or transformers' Llama of
the same shape): what bench/gpu.py sets the generated trainer against, in the same run, on the same batch shape.

    python bench/_plain_loop.py --project DIR --package PKG --out row.json [--model transformers] [--compile] \
        -- --config DIR/configs/1b.toml [config overrides]

fp32 parameters, autocast to the config's mixed precision, fused AdamW, gradient clipping at the config's
max norm, random tokens, one micro-batch a step, one device (cuda, or the config's device for a dry run); no
FSDP, no checkpoints, no data loader. It writes the median step time over the steps after --warmup,
tokens/s, MFU (the render's FLOP count and peak table, as its metrics.py reports the trainer's) and the peak of
torch.cuda.max_memory_allocated (the process's resident peak on a CPU), in GiB.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def build(args, cfg, device: torch.device) -> torch.nn.Module:
    """The render's model (its own init), or transformers' LlamaForCausalLM from the config.json the render
    exports for it (sdpa attention)."""
    if args.model == "transformers":
        from transformers import LlamaConfig, LlamaForCausalLM

        hf = importlib.import_module(f"{args.package}.models.llama.hf")
        config = LlamaConfig.from_dict({**json.loads(hf.hf_config_json(cfg.model)), "torch_dtype": "float32"})
        config._attn_implementation = "sdpa"
        with torch.device(device):
            return LlamaForCausalLM(config).float()  # fp32 parameters, as the trainer's
    models = importlib.import_module(f"{args.package}.models")
    with torch.device(device):
        model = models.build_model(cfg.model)
        model.init_weights()
    return model


def train(model, cfg, device: torch.device, steps: int, compile_model: bool, transformers: bool) -> list[float]:
    """The loop itself: the seconds of each step."""
    batch, seq, vocab = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.parallel.mixed_precision]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=True)
    forward = torch.compile(model, backend=cfg.parallel.compile_backend) if compile_model else model
    generator = torch.Generator(device).manual_seed(0)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        tokens = torch.randint(vocab, (batch, seq + 1), device=device, generator=generator)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = forward(tokens[:, :-1])
        logits = out.logits if transformers else out
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        if cfg.train.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    if not torch.isfinite(loss):
        raise RuntimeError(f"the loss is {loss.item()}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, required=True, help="a rendered project")
    parser.add_argument("--package", required=True, help="its package name")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--model", choices=["render", "transformers"], default="render")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed")
    parser.add_argument("config", nargs="*", help="the config file and overrides, as the trainer takes them")
    args = parser.parse_args()
    sys.path.insert(0, str(args.project / "src"))
    cfg = importlib.import_module(f"{args.package}.config").load_config(args.config)
    metrics = importlib.import_module(f"{args.package}.metrics")
    shape = importlib.import_module(f"{args.package}.models").model_shape(cfg.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.train.seed)
    model = build(args, cfg, device)
    times = train(model, cfg, device, args.steps, args.compile, args.model == "transformers")[args.warmup :]
    step_s = statistics.median(times)
    tokens_per_s = cfg.train.micro_batch_size * cfg.train.seq_len / step_s
    peak = metrics.peak_tflops(device, cfg.metrics.peak_tflops)
    figures = {
        "step_time_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu_pct": 100 * shape.flops_per_token(cfg.train.seq_len) * tokens_per_s / (peak * 1e12) if peak else None,
        "peak_gib": metrics.peak_memory_gib(device),
    }
    args.out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
