"""Re-sizing advice (`python -m <package>.plan --detect`): the hardware this machine has against the
hardware the repo was planned for, and the `copier update` answers that re-plan it. Copier's
`--defaults` keeps every earlier answer it is not given, so the command must carry the planner's
choices for the new hardware, checked to fit, or the update would keep a plan that does not."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from .. import hardware as machine
from ..config import CheckpointConfig, DistConfig, FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig
from ..models import ModelConfig, model_shape
from ..presets import DEFAULT_BACKEND, DEFAULT_PRECISION
from . import (
    GIB,
    HOST_MEMORY,
    cheapest,
    estimate_tensor_parallel,
    grad_accum,
    host_plan_for,
    longest_fitting_seq_len,
    plan_for,
    planned_degrees,
    recommend,
    recommend_context_parallel,
    recommend_expert_parallel,
    recommend_tensor_parallel,
)

# The hardware questions of the template's copier.yml, in its order.
HARDWARE_QUESTIONS = ("accelerator", "gpu_arch", "gpus_per_node", "gpu_memory_gb", "host_memory_gb", "intra_node_link")


def default_precision(*, hardware: HardwareConfig) -> str:
    """The default mixed_precision of the template's copier.yml: no bf16 before Ampere, fp32 on CPU."""
    return DEFAULT_PRECISION[hardware.gpu_arch if hardware.accelerator == "cuda" else hardware.accelerator]


def asked(question: str, *, hardware: HardwareConfig) -> bool:
    """Whether the template's copier.yml asks `question` on this hardware (its `when:` conditions)."""
    return {
        "gpu_arch": hardware.accelerator == "cuda",
        "gpu_memory_gb": hardware.accelerator != "cpu",
        "intra_node_link": hardware.accelerator != "cpu" and hardware.gpus_per_node > 1,
    }.get(question, True)


def live_hardware(*, planned: HardwareConfig, detected: dict) -> HardwareConfig:
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
            f"(`python -m {machine.__name__} --out hw.yml`) and pass it with --detected hw.yml"
        )
    gpus = int(detected["gpus_per_node"])
    arch = str(detected.get("gpu_arch", planned.gpu_arch if same_kind else "")) if accelerator == "cuda" else ""
    link = str(detected.get("intra_node_link", planned.intra_node_link)) if gpus > 1 else ""
    return replace(
        planned, accelerator=accelerator, gpu_arch=arch, gpus_per_node=gpus, gpu_memory_gb=memory, intra_node_link=link
    )


def with_answers(
    *, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig, live: HardwareConfig, answers: dict
) -> dict:
    """The train, parallel and hardware sub-configs as `copier update -d answers` would render them on
    `live`, keeping the micro-batches per step (the global batch follows the data-parallel ranks)."""
    parallel_keys = ("mixed_precision", "compile", "sharding", "activation_checkpointing", "cpu_offload",
                     "tensor_parallel", "context_parallel", "expert_parallel")  # fmt: skip
    new = replace(parallel, **{k: answers[k] for k in parallel_keys if k in answers})
    micro = answers.get("micro_batch_size", train.micro_batch_size)
    dp = planned_degrees(parallel=new, hardware=live).dp
    accum = grad_accum(train=train, parallel=parallel, hardware=hardware)
    batch = replace(train, micro_batch_size=micro, global_batch_size=micro * dp * accum,
                    seq_len=answers.get("seq_len", train.seq_len))  # fmt: skip
    return {"train": batch, "parallel": new, "hardware": live}


def resize(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig, dist: DistConfig, live: HardwareConfig,
) -> dict:  # fmt: skip
    """The `copier update -d` answers that re-size a repo planned with these settings for `live`; empty when
    it matches.

    The hardware answers that differ; mixed_precision, backend and compile where they were the old
    hardware's defaults or cannot work on the new one (bf16 before Ampere, nccl off CUDA, xccl off
    XPU); and the planner's sharding, activation checkpointing and offload for `live`, because
    `copier update --defaults` keeps the previous answers to every question not given with -d. Where
    nothing fits the preset's micro-batch and sequence, a micro-batch or sequence that fits comes with them
    (fitting_batch), so that copier accepts the command as printed.
    """
    old, p = hardware, parallel
    answers: dict = {}
    for question in HARDWARE_QUESTIONS:
        value = getattr(live, question)
        if asked(question, hardware=live) and value != getattr(old, question):
            answers[question] = int(value) if isinstance(value, float) and value.is_integer() else value
    if not answers:
        return {}
    precision = p.mixed_precision
    was, now = default_precision(hardware=old), default_precision(hardware=live)
    if precision == was or (precision == "bf16" and now == "fp16"):
        precision = now
    backend = dist.backend
    if backend == DEFAULT_BACKEND[old.accelerator] or backend in ("nccl", "xccl"):
        backend = DEFAULT_BACKEND[live.accelerator]
    compile_ = live.accelerator == "cuda" if p.compile == (old.accelerator == "cuda") else p.compile
    for key, new, now in (
        ("mixed_precision", precision, p.mixed_precision),
        ("backend", backend, dist.backend),
        ("compile", compile_, p.compile),
    ):
        if new != now:
            answers[key] = new
    fixed = dict(model=model, finetune=finetune, checkpoint=checkpoint)
    replan = dict(train=train, parallel=parallel, hardware=hardware, live=live)
    if model.preset not in ("debug", "vit-debug", "moe-debug"):  # only preset configs carry the degrees
        answers |= tensor_parallel_answers(**fixed, **with_answers(**replan, answers=answers))
        if parallel.context_parallel > 1:  # a repo planned without it keeps its sequence, or the longest that fits
            answers |= context_parallel_answers(**fixed, **with_answers(**replan, answers=answers))
        if model_shape(model).experts:  # the experts' degree for the new node (copier asks it for qwen3_moe)
            degree = recommend_expert_parallel(**fixed, **with_answers(**replan, answers=answers),
                                               base_micro_batch=train.micro_batch_size)  # fmt: skip
            answers |= {"expert_parallel": degree} if degree != parallel.expert_parallel else {}
    if live.accelerator != "cpu" and cheapest(**fixed, **with_answers(**replan, answers=answers)) is None:
        answers |= fitting_batch(**fixed, **with_answers(**replan, answers=answers))
    choice = recommend(**fixed, **with_answers(**replan, answers=answers))  # copier decides activation offload itself
    return {**answers, "sharding": choice.sharding, "activation_checkpointing": choice.ac,
            "cpu_offload": choice.cpu_offload}  # fmt: skip


def fitting_batch(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> dict:  # fmt: skip
    """micro_batch_size and seq_len answers with which some plan fits where train's do not: the largest
    halving of the micro-batch, then the longest sequence that fits one sample (longest_fitting_seq_len);
    empty when none fits (the report then says so). A ViT's micro-batch is its images; its sequence is not
    asked."""
    smaller = [(train.micro_batch_size // 2**i, train.seq_len) for i in range(1, 12)]
    shorter = []
    if model.name != "vit":
        one = replace(train, micro_batch_size=1)
        longest = longest_fitting_seq_len(model=model, train=one, parallel=parallel, hardware=hardware,
                                          finetune=finetune, checkpoint=checkpoint, longest=train.seq_len)  # fmt: skip
        shorter = [(1, longest)] if longest else []
    for micro, seq in dict.fromkeys(c for c in smaller + shorter if c[0] >= 1):
        trial = replace(train, micro_batch_size=micro, seq_len=seq)
        if cheapest(model=model, train=trial, parallel=parallel, hardware=hardware, finetune=finetune,
                    checkpoint=checkpoint):  # fmt: skip
            changed = {"micro_batch_size": micro, "seq_len": seq}
            return {k: v for k, v in changed.items() if v != getattr(train, k)}
    return {}


def tensor_parallel_answers(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> dict:  # fmt: skip
    """tensor_parallel and micro_batch_size for the new hardware, when the planner's degree differs.

    A group of t GPUs takes t times the sequences of one GPU (as copier plans it), so the micro-batch
    changes with the degree: the largest that fits, or t times one GPU's where nothing fits (or on CPU
    ranks, which are not memory-planned).
    """
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune,
                checkpoint=checkpoint)  # fmt: skip
    degree = parallel.tensor_parallel
    base = max(train.micro_batch_size // degree, 1)
    best = recommend_tensor_parallel(**args, base_micro_batch=base)
    estimate = estimate_tensor_parallel(**args, degree=best, base_micro_batch=base)
    if estimate is None:  # picked with context parallelism the repo lacks: FSDP alone, and fitting_batch's sequence
        best = 1
    if best == degree:
        return {}
    return {"tensor_parallel": best, "micro_batch_size": estimate.micro_batch_size if estimate else base * best}


def context_parallel_answers(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> dict:  # fmt: skip
    """context_parallel for the new hardware, when the planner's degree (the smallest with which one sequence
    fits, as copier plans it) differs from the config's: a node with fewer GPUs may not hold its group, a
    larger device may not need it."""
    one = replace(train, micro_batch_size=1)
    best = recommend_context_parallel(model=model, train=one, parallel=parallel, hardware=hardware,
                                      finetune=finetune, checkpoint=checkpoint)  # fmt: skip
    return {} if best == parallel.context_parallel else {"context_parallel": best}


def update_command(answers: dict) -> str:
    """The copier command line that gives a generated repo these answers."""
    values = {k: str(v).lower() if isinstance(v, bool) else v for k, v in answers.items()}
    return "copier update --defaults " + " ".join(f"-d {k}={v}" for k, v in values.items())


def describe(*, hardware: HardwareConfig) -> str:
    """The hardware in one line, for the report."""
    hw = hardware
    ram = f"{hw.host_memory_gb:g} GiB RAM per node" if hw.host_memory_gb else ""
    details = [hw.gpu_arch, f"{hw.gpu_memory_gb:g} GiB" if hw.accelerator != "cpu" else "", hw.intra_node_link, ram]
    extra = ", ".join(d for d in details if d)
    return f"{hw.num_nodes} node(s) x {hw.gpus_per_node} {hw.accelerator}" + (f" ({extra})" if extra else "")


def shortfall(
    *, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, hardware: HardwareConfig,
    finetune: FinetuneConfig, checkpoint: CheckpointConfig,
) -> list[str]:  # fmt: skip
    """What the report says when the re-sized preset still does not fit `hardware` (the live machine):
    the only answer left to change is the model, or the number of nodes."""
    args = dict(model=model, train=train, parallel=parallel, hardware=hardware, finetune=finetune)
    where = describe(hardware=hardware)
    if hardware.accelerator != "cpu" and not plan_for(**args).fits(hardware.gpu_memory_gb):
        return [
            f"Nothing fits {model.preset} on {where}, not even full sharding with CPU offload and full activation "
            "checkpointing at one short sequence: add -d model_size=<smaller> below.",
            "",
        ]
    if not (host := host_plan_for(**args, checkpoint=checkpoint)).fits(hardware.host_memory_gb):
        return [
            f"{model.preset} needs {host.total / GIB:.1f} GiB of RAM per node ({host.describe()}), over the "
            f"{HOST_MEMORY['headroom'] * hardware.host_memory_gb:.1f} GiB usable of {hardware.host_memory_gb:g}: add "
            "-d num_nodes=N below, or -d model_size=<smaller>.",
            "",
        ]
    return []


def detect_report(
    *, planned: HardwareConfig, live: HardwareConfig, answers: dict, detected: dict, how: dict, table: str,
    note: list[str],
) -> str:  # fmt: skip
    """What `--detect` prints: the `planned` hardware against the `live` one, the `table` of the config on
    it after the update, the `note` of shortfall(), and the update command that gives the repo `answers`."""
    if not answers:
        where = describe(hardware=live)
        return f"This machine matches the hardware the repo was planned for, {where}: nothing to re-size."
    lines = [f"planned for:   {describe(hardware=planned)}", f"this machine:  {describe(hardware=live)}"]
    for question in HARDWARE_QUESTIONS:
        was = getattr(planned, question)
        if question in answers:
            was = f"{was:g}" if isinstance(was, float) else was or "-"
            lines.append(f"  {question:<16} {was:>7} -> {answers[question]!s:<8} {how.get(question, '')}")
        elif asked(question, hardware=live) and question not in detected:
            lines.append(
                f"  {question:<16} {was!s:>7}    not detected: kept as planned (add -d {question}=... to change)"
            )
    if live.num_nodes > 1:
        lines.append(f"  num_nodes={live.num_nodes} and inter_node_link={live.inter_node_link} are kept as planned")
    batch = [f"{k}={answers[k]}" for k in ("micro_batch_size", "seq_len") if k in answers]
    if batch and "tensor_parallel" not in answers:
        lines.append(f"  {' and '.join(batch)}: the largest that fits this machine")
    lines += ["", table, ""] + note
    lines += [
        "Re-size the repo for this machine (from a clean git checkout; your edits are kept):",
        "",
        "    " + update_command(answers),
    ]
    return "\n".join(lines)


def detect_inputs(rest: list[str], detected_file: Path | None) -> tuple[list[str], list[str] | None, dict, dict, list]:
    """What `--detect` compares: the command line of the config to show, that of the repo's preset config
    (None: the same), and the hardware detected here (or read from a probe's YAML), how each value was
    found, and the probe's notes."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    config = pre.parse_known_args(rest)[0].config
    # The repo's root holds the answers copier generated it with: model_size names the preset config.
    root = config.resolve().parent.parent if config else Path.cwd()
    answers_file = root / ".copier-answers.yml"
    answers = machine.read_answers(answers_file.read_text()) if answers_file.is_file() else {}
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
    preset = ["--config", str(preset_file)] if preset_file.is_file() else None
    if detected_file is not None:
        if not detected_file.is_file():
            raise ValueError(
                f"--detected {detected_file}: no such file (`python -m {machine.__name__} --out FILE` writes one)"
            )
        detected = machine.read_answers(detected_file.read_text())
        return rest, preset, detected, {key: f"from {detected_file}" for key in detected}, []
    found = machine.detect()
    return rest, preset, found.answers, found.how, found.notes
