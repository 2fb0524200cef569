"""Re-sizing advice: the hardware this machine has against the hardware the repo was planned for,
and the `copier update` answers that re-plan it (`python -m <package>.plan --detect`)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from .. import hardware
from ..config import Config, HardwareConfig, load_config
from ..presets import DEFAULT_BACKEND, DEFAULT_PRECISION
from . import (
    GIB,
    HOST_MEMORY,
    estimate_tensor_parallel,
    grad_accum,
    host_plan_for,
    plan_for,
    recommend,
    recommend_tensor_parallel,
)
from .report import format_table

# copier.yml's hardware questions, in its order.
HARDWARE_QUESTIONS = ("accelerator", "gpu_arch", "gpus_per_node", "gpu_memory_gb", "host_memory_gb", "intra_node_link")


def default_precision(hw: HardwareConfig) -> str:
    """copier.yml's default mixed_precision: no bf16 before Ampere, fp32 on CPU."""
    return DEFAULT_PRECISION[hw.gpu_arch if hw.accelerator == "cuda" else hw.accelerator]


def asked(question: str, hw: HardwareConfig) -> bool:
    """Whether copier.yml asks `question` on this hardware (its `when:` conditions)."""
    return {
        "gpu_arch": hw.accelerator == "cuda",
        "gpu_memory_gb": hw.accelerator != "cpu",
        "intra_node_link": hw.accelerator != "cpu" and hw.gpus_per_node > 1,
    }.get(question, True)


def live_hardware(planned: HardwareConfig, detected: dict) -> HardwareConfig:
    """The planned hardware as `detected` on this machine (copier answers, as hardware.detect gives them).

    num_nodes and inter_node_link stay as planned: one machine cannot see the others. CPU ranks
    are a choice rather than hardware, so a CPU plan keeps its own number of them. Host memory
    stays as planned when the probe did not read it.
    """
    accelerator = detected.get("accelerator")
    if accelerator not in DEFAULT_BACKEND:
        raise ValueError(f"detected accelerator={accelerator!r}: expected one of cuda, xpu, cpu")
    planned = replace(planned, host_memory_gb=float(detected.get("host_memory_gb") or planned.host_memory_gb))
    if accelerator == "cpu":
        ranks = planned.gpus_per_node if planned.accelerator == "cpu" else int(detected.get("gpus_per_node", 2))
        return replace(
            planned, accelerator="cpu", gpu_arch="", gpus_per_node=ranks, gpu_memory_gb=0.0, intra_node_link=""
        )
    same_kind = planned.accelerator == accelerator
    memory = float(detected.get("gpu_memory_gb") or (planned.gpu_memory_gb if same_kind else 0))
    if not memory:
        raise ValueError(
            "the probe could not read the device memory: write `gpu_memory_gb: <GiB>` into its YAML "
            f"(`python -m {hardware.__name__} --out hw.yml`) and pass it with --detected hw.yml"
        )
    gpus = int(detected["gpus_per_node"])
    arch = str(detected.get("gpu_arch", planned.gpu_arch if same_kind else "")) if accelerator == "cuda" else ""
    link = str(detected.get("intra_node_link", planned.intra_node_link)) if gpus > 1 else ""
    return replace(
        planned, accelerator=accelerator, gpu_arch=arch, gpus_per_node=gpus, gpu_memory_gb=memory, intra_node_link=link
    )


def with_answers(cfg: Config, live: HardwareConfig, answers: dict) -> Config:
    """`cfg` as `copier update -d answers` would render it on `live`, keeping its micro-batches per step."""
    parallel_keys = ("mixed_precision", "compile", "sharding", "activation_checkpointing", "cpu_offload",
                     "tensor_parallel")  # fmt: skip
    parallel = replace(cfg.parallel, **{k: answers[k] for k in parallel_keys if k in answers})
    micro = answers.get("micro_batch_size", cfg.train.micro_batch_size)
    dp = live.gpus_per_node * live.num_nodes // parallel.tensor_parallel
    return replace(
        cfg,
        hardware=live,
        train=replace(cfg.train, micro_batch_size=micro, global_batch_size=micro * dp * grad_accum(cfg)),
        dist=replace(cfg.dist, backend=answers.get("backend", cfg.dist.backend)),
        parallel=parallel,
    )


def resize(cfg: Config, live: HardwareConfig) -> dict:
    """The `copier update -d` answers that re-size a repo planned as `cfg` for `live`; empty when it matches.

    The hardware answers that differ; mixed_precision, backend and compile where they were the old
    hardware's defaults or cannot work on the new one (bf16 before Ampere, nccl off CUDA, xccl off
    XPU); and the planner's sharding, activation checkpointing and offload for `live`, because
    `copier update --defaults` keeps the previous answers to every question not given with -d.
    """
    old, p = cfg.hardware, cfg.parallel
    answers: dict = {}
    for question in HARDWARE_QUESTIONS:
        value = getattr(live, question)
        if asked(question, live) and value != getattr(old, question):
            answers[question] = int(value) if isinstance(value, float) and value.is_integer() else value
    if not answers:
        return {}
    precision = p.mixed_precision
    if precision == default_precision(old) or (precision == "bf16" and default_precision(live) == "fp16"):
        precision = default_precision(live)
    backend = cfg.dist.backend
    if backend == DEFAULT_BACKEND[old.accelerator] or backend in ("nccl", "xccl"):
        backend = DEFAULT_BACKEND[live.accelerator]
    compile_ = live.accelerator == "cuda" if p.compile == (old.accelerator == "cuda") else p.compile
    for key, new, now in (
        ("mixed_precision", precision, p.mixed_precision),
        ("backend", backend, cfg.dist.backend),
        ("compile", compile_, p.compile),
    ):
        if new != now:
            answers[key] = new
    if cfg.model.preset not in ("debug", "vit-debug"):  # only preset configs carry a tensor-parallel degree
        answers |= tensor_parallel_answers(with_answers(cfg, live, answers))
    ac, sharding, offload = recommend(with_answers(cfg, live, answers))
    return {**answers, "sharding": sharding, "activation_checkpointing": ac, "cpu_offload": offload}


def tensor_parallel_answers(cfg: Config) -> dict:
    """tensor_parallel and micro_batch_size for cfg's new hardware, when the planner's degree differs from cfg's.

    A group of t GPUs takes t times the sequences of one GPU (as copier plans it), so the
    micro-batch changes with the degree: the largest that fits, or t times one GPU's where nothing
    fits (or on CPU ranks, which are not memory-planned).
    """
    degree = cfg.parallel.tensor_parallel
    base = max(cfg.train.micro_batch_size // degree, 1)
    best = recommend_tensor_parallel(cfg, base)
    if best == degree:
        return {}
    estimate = estimate_tensor_parallel(cfg, best, base)
    return {"tensor_parallel": best, "micro_batch_size": estimate.micro_batch_size if estimate else base * best}


def update_command(answers: dict) -> str:
    """The copier command line that gives a generated repo these answers."""
    values = {k: str(v).lower() if isinstance(v, bool) else v for k, v in answers.items()}
    return "copier update --defaults " + " ".join(f"-d {k}={v}" for k, v in values.items())


def describe(hw: HardwareConfig) -> str:
    ram = f"{hw.host_memory_gb:g} GiB RAM per node" if hw.host_memory_gb else ""
    details = [hw.gpu_arch, f"{hw.gpu_memory_gb:g} GiB" if hw.accelerator != "cpu" else "", hw.intra_node_link, ram]
    extra = ", ".join(d for d in details if d)
    return f"{hw.num_nodes} node(s) x {hw.gpus_per_node} {hw.accelerator}" + (f" ({extra})" if extra else "")


def detect_report(cfg: Config, detected: dict, how: dict | None = None, preset: Config | None = None) -> str:
    """What `--detect` prints: `cfg`'s planned hardware against `detected`, and how to re-size the repo.

    `preset` is the config of the repo's model_size, which copier plans for (default: `cfg`); the
    table is `cfg`'s plan on the detected hardware with the answers the update would give.
    """
    preset, how = preset or cfg, how or {}
    live = live_hardware(preset.hardware, detected)
    answers = resize(preset, live)
    if not answers:
        return f"This machine matches the hardware the repo was planned for, {describe(live)}: nothing to re-size."
    lines = [f"planned for:   {describe(preset.hardware)}", f"this machine:  {describe(live)}"]
    for question in HARDWARE_QUESTIONS:
        was = getattr(preset.hardware, question)
        if question in answers:
            was = f"{was:g}" if isinstance(was, float) else was or "-"
            lines.append(f"  {question:<16} {was:>7} -> {answers[question]!s:<8} {how.get(question, '')}")
        elif asked(question, live) and question not in detected:
            lines.append(
                f"  {question:<16} {was!s:>7}    not detected: kept as planned (add -d {question}=... to change)"
            )
    if live.num_nodes > 1:
        lines.append(f"  num_nodes={live.num_nodes} and inter_node_link={live.inter_node_link} are kept as planned")
    replanned = with_answers(cfg, live, answers)
    lines += ["", f"The {cfg.model.preset} config on this machine, after the update:", "", format_table(replanned), ""]
    final = with_answers(preset, live, answers)
    if live.accelerator != "cpu" and not plan_for(final).fits(live.gpu_memory_gb):
        lines += [
            f"Nothing fits {preset.model.preset} on {describe(live)}, not even full sharding with CPU offload and full "
            "activation checkpointing: add -d micro_batch_size=N or -d seq_len=N below, or -d model_size=<smaller>.",
            "",
        ]
    elif not (host := host_plan_for(final)).fits(live.host_memory_gb):
        lines += [
            f"{preset.model.preset} needs {host.total / GIB:.1f} GiB of RAM per node ({host.describe()}), over the "
            f"{HOST_MEMORY['headroom'] * live.host_memory_gb:.1f} GiB usable of {live.host_memory_gb:g}: add "
            "-d num_nodes=N below, or -d model_size=<smaller>.",
            "",
        ]
    lines += [
        "Re-size the repo for this machine (from a clean git checkout; your edits are kept):",
        "",
        "    " + update_command(answers),
    ]
    return "\n".join(lines)


def detect_main(rest: list[str], detected_file: Path | None) -> str:
    """`--detect`: probe this machine (or read a probe's YAML) and compare with the repo's answers."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    config = pre.parse_known_args(rest)[0].config
    # The repo's root holds the answers copier generated it with: model_size names the preset config.
    root = config.resolve().parent.parent if config else Path.cwd()
    answers_file = root / ".copier-answers.yml"
    answers = hardware.read_answers(answers_file.read_text()) if answers_file.is_file() else {}
    preset_file = root / "configs" / f"{answers.get('model_size', '')}.toml"
    if answers and not preset_file.is_file():  # the debug presets (debug, vit-debug) are configs/debug.toml
        preset_file = root / "configs" / "debug.toml"
    if config is None:
        if not preset_file.is_file():
            raise ValueError(
                f"--detect: no .copier-answers.yml in {root} to find the repo's preset config; "
                "run it from the repo root or pass --config configs/<preset>.toml"
            )
        rest = ["--config", str(preset_file), *rest]
    cfg = load_config(rest)
    preset = load_config(["--config", str(preset_file)]) if preset_file.is_file() else cfg
    notes: list[str] = []
    if detected_file is not None:
        if not detected_file.is_file():
            raise ValueError(
                f"--detected {detected_file}: no such file (`python -m {hardware.__name__} --out FILE` writes one)"
            )
        detected = hardware.read_answers(detected_file.read_text())
        how = {key: f"from {detected_file}" for key in detected}
    else:
        found = hardware.detect()
        detected, how, notes = found.answers, found.how, found.notes
    return "\n".join([detect_report(cfg, detected, how, preset), *(f"note: {n}" for n in notes)])
