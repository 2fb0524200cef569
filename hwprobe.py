"""Detect this machine's accelerators and write them as answers to fsdp-template's hardware questions.

    python -m <package>.hardware --out hw.yml             # in a generated repo
    copier copy --data-file hw.yml <template> <project>   # then answer the rest (or add --defaults)

Before generating, the template's hwprobe.py is this file: run it with `python`, in a checkout of the template.

Needs nothing but Python. Uses, when present: `nvidia-smi` (GPU count, memory, compute capability)
and `nvidia-smi topo -m` (NVLink or PCIe), torch (CUDA or XPU devices), `xpu-smi` (Intel GPUs and
Xe Link), and /proc (the NVIDIA driver's GPU list, when nvidia-smi is missing; MemTotal, the node's
RAM, and the cgroup memory limit a SLURM job or a container runs under). The YAML goes to
stdout or --out, with the question names of the template's copier.yml as keys; what was detected, and which tool
said so, goes to stderr. One machine cannot see the others, so num_nodes and inter_node_link are
left to you, as commented lines.

Memory is reported in whole GiB rounded up: the driver keeps a little back, so an "80 GB" H100
shows 81559 MiB (79.6 GiB) and is written as 80, and an A10 (23028 MiB, 22.5 GiB) as 23. The
planner budgets 90% of the figure, which absorbs the < 1 GiB rounding. Host memory is rounded
down: the smaller of MemTotal and the cgroup limit is what the job may use.

Tool output is parsed by pure functions of the text (parse_*), and every tool runs through a `run`
callable (argv -> stdout, or None when the tool is missing or fails), so tests replay captured
output. The template renders this file verbatim into src/<package>/hardware.py through Jinja, so
it must never contain a Jinja opening delimiter (a brace followed by a brace, percent or hash).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Run = Callable[[Sequence[str]], str | None]

# The gpu_arch choices of the template's copier.yml, newest first, with the compute capabilities each covers.
ARCHS = ("blackwell", "hopper", "ada", "ampere", "turing", "volta")
NVIDIA_QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"]
# Drivers older than 510 reject the compute_cap field; the name then gives the generation.
NVIDIA_QUERY_OLD = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
NVIDIA_TOPO = ["nvidia-smi", "topo", "-m"]
XPU_DUMP = ["xpu-smi", "discovery", "--dump", "1,2,16"]
XPU_TOPO = ["xpu-smi", "topology", "-m"]
# Marketing names by generation, for drivers that do not report the compute capability.
NAME_ARCH = (
    ("blackwell", r"\bG?B[123]00\b|RTX 50\d0|RTX PRO \d+ Blackwell"),
    ("hopper", r"\bG?H[12]00\b|\bH[28]00\b|\bH20\b"),
    ("ada", r"\bL4\b|\bL40S?\b|RTX 40\d0|RTX \d+ Ada"),
    ("ampere", r"\bA\d{1,3}\b|RTX 30\d0|RTX A\d+"),
    ("turing", r"\bT4\b|RTX 20\d0|Quadro RTX|TITAN RTX"),
    ("volta", r"V100|TITAN V\b"),
)
CPU_RANKS = 2  # the template's default for CPU: enough ranks to exercise sharding on a laptop


@dataclass
class Gpu:
    name: str
    memory_mib: float
    compute_cap: str = ""
    """Major.minor, e.g. "9.0"; empty when the tool does not report it."""


@dataclass
class Detected:
    answers: dict[str, str | int] = field(default_factory=dict)
    """copier question -> detected value."""
    how: dict[str, str] = field(default_factory=dict)
    """copier question -> the tool and the reading it came from."""
    notes: list[str] = field(default_factory=list)
    """What could not be detected, and fallbacks taken."""


def run_tool(argv: Sequence[str], timeout: float = 20.0) -> str | None:
    """stdout of `argv`, or None when the tool is missing, fails or hangs (a wedged driver can)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=name,memory.total[,compute_cap] --format=csv,noheader,nounits`."""
    gpus = []
    for row in csv.reader(line for line in text.splitlines() if line.strip()):
        cells = [c.strip() for c in row]
        if len(cells) < 2:
            continue
        memory = re.match(r"[\d.]+", cells[1])  # "81559", or "81559 MiB" without nounits
        if memory is None:  # "[N/A]" or "[Insufficient Permissions]"
            continue
        cap = cells[2] if len(cells) > 2 and re.fullmatch(r"\d+\.\d+", cells[2]) else ""
        gpus.append(Gpu(cells[0], float(memory.group()), cap))
    return gpus


def _matrix(text: str, label: str) -> tuple[list[str], dict[str, list[str]]]:
    """Device columns and device rows of a topology matrix whose device names match `label`."""
    header: list[str] = []
    rows: dict[str, list[str]] = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():  # nvidia-smi underlines names on a tty
        cells = re.split(r"[|\t]", line) if "|" in line or "\t" in line else line.split()
        cells = [c.strip() for c in cells if c.strip()]
        if len(cells) < 2 or not re.fullmatch(label, cells[0]):
            continue
        if re.fullmatch(label, cells[1]):
            header = list(itertools.takewhile(lambda c: re.fullmatch(label, c) is not None, cells))
        elif header:
            rows[cells[0]] = cells[1 : 1 + len(header)]
    return header, rows


def parse_nvidia_topo(text: str) -> str | None:
    """intra_node_link from `nvidia-smi topo -m`: nvlink when every pair of GPUs has an NV# entry.

    A node where only some pairs are bridged (e.g. NVLink bridges on pairs of PCIe cards) is pcie:
    FSDP's collectives span every rank, so the slowest pair sets their speed. None when the
    matrix has fewer than two GPUs or cannot be read.
    """
    header, rows = _matrix(text, r"GPU\d+")
    if len(header) < 2 or set(rows) != set(header):
        return None
    links = [rows[a][j] for a in header for j, b in enumerate(header) if a != b]
    return "nvlink" if all(re.fullmatch(r"NV\d+", link) for link in links) else "pcie"


def parse_xpu_dump(text: str) -> list[Gpu]:
    """GPUs from `xpu-smi discovery --dump 1,2,16` (device id, name, memory physical size)."""
    rows = list(csv.reader(line for line in text.splitlines() if line.strip()))
    if not rows or "Device Name" not in rows[0] or "Memory Physical Size" not in rows[0]:
        return []
    name, memory = rows[0].index("Device Name"), rows[0].index("Memory Physical Size")
    gpus = []
    for row in rows[1:]:
        found = re.match(r"\s*([\d.]+)\s*(GiB|MiB)?", row[memory]) if len(row) > memory else None
        if found:
            size = float(found.group(1)) * (1024 if found.group(2) == "GiB" else 1)
            gpus.append(Gpu(row[name].strip(), size))
    return gpus


def parse_xpu_topo(text: str) -> str | None:
    """intra_node_link from `xpu-smi topology -m`: nvlink (Xe Link) when every pair of cards has an XL entry.

    Rows are tiles ("GPU 1/0" is tile 0 of card 1); tiles of one card talk over MDF, which says
    nothing about the link between cards, so only pairs of tiles on different cards count.
    """
    header, rows = _matrix(text, r"GPU \d+/\d+")
    cards = {t.split()[1].split("/")[0] for t in header}
    if len(cards) < 2 or set(rows) != set(header):
        return None
    card = {t: t.split()[1].split("/")[0] for t in header}
    links = [rows[a][j] for a in header for j, b in enumerate(header) if card[a] != card[b]]
    return "nvlink" if all(re.fullmatch(r"XL(\d+|\*)", link) for link in links) else "pcie"


def arch_of(compute_cap: str, name: str = "") -> str | None:
    """The gpu_arch answer for a compute capability ("9.0"), or from the GPU's name without one."""
    if compute_cap:
        major, minor = (int(x) for x in compute_cap.split(".")[:2])
        if major >= 10:  # 10.x data centre, 12.x workstation Blackwell
            return "blackwell"
        return {9: "hopper", 8: "ada" if minor == 9 else "ampere", 7: "turing" if minor >= 5 else "volta"}.get(major)
    for arch, pattern in NAME_ARCH:
        if re.search(pattern, name):
            return arch
    return None


def memory_gib(mib: float) -> int:
    """Whole GiB, rounded up (see the module docstring)."""
    return math.ceil(mib / 1024 - 1e-9)


def probe_torch() -> tuple[str, list[Gpu]] | None:
    """("cuda" | "xpu", devices) as torch sees them, or None without torch or a device."""
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        # ROCm builds report AMD GPUs as "cuda" too; their gcn arch is no gpu_arch choice.
        hip = getattr(torch.version, "hip", None)
        return "cuda", [Gpu(p.name, p.total_memory / 2**20, "" if hip else f"{p.major}.{p.minor}") for p in props]
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available() and xpu.device_count() > 0:
        props = [xpu.get_device_properties(i) for i in range(xpu.device_count())]
        return "xpu", [Gpu(p.name, p.total_memory / 2**20) for p in props]
    return None


def proc_nvidia_gpus(proc: Path) -> list[Gpu]:
    """GPUs the NVIDIA kernel driver lists under /proc (names only: it does not report memory)."""
    gpus = []
    for info in sorted((proc / "driver" / "nvidia" / "gpus").glob("*/information")):
        model = re.search(r"^Model:\s*(.+)$", info.read_text(errors="replace"), re.M)
        gpus.append(Gpu(model.group(1).strip() if model else "NVIDIA GPU", 0.0))
    return gpus


def parse_meminfo(text: str) -> float | None:
    """MemTotal of /proc/meminfo in MiB (the RAM the kernel manages); None when it is not there."""
    found = re.search(r"^MemTotal:\s*(\d+)\s*kB", text, re.M)
    return int(found.group(1)) / 1024 if found else None


def cgroup_memory_limit(proc: Path, cgroup: Path) -> float | None:
    """The memory limit in MiB of this process's cgroup or an ancestor's (SLURM's --mem, a container's limit).

    /proc/self/cgroup names the cgroup: "0::<path>" under cgroup v2 (memory.max), "<n>:memory:<path>"
    under v1 (memory.limit_in_bytes). Inside a container the path is often "/", the root of a
    mount that is already the container's cgroup. None when no limit is set or nothing is readable.
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if not controllers:
            base, name = cgroup, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = cgroup / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = Path(path.strip().lstrip("/")).parts
        for depth in range(len(parts), -1, -1):  # the cgroup, then each ancestor: every limit applies
            try:
                value = base.joinpath(*parts[:depth], name).read_text().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < 2**60:  # "max", or v1's near-2**63 for none
                limits.append(int(value) / 2**20)
    return min(limits) if limits else None


def host_memory_mib(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[float, str] | None:
    """The RAM this process's job may use, in MiB, and where the figure came from; None without /proc/meminfo."""
    try:
        total = parse_meminfo((proc / "meminfo").read_text())
    except OSError:
        total = None
    if total is None:
        return None
    limit = cgroup_memory_limit(proc, cgroup)
    if limit is not None and limit < total:
        return limit, f"cgroup memory limit {limit:.0f} MiB (MemTotal {total:.0f} MiB)"
    return total, f"{proc}/meminfo: MemTotal {total:.0f} MiB"


def _describe(gpus: list[Gpu]) -> str:
    names = sorted({g.name for g in gpus})
    return f"{len(gpus)} x {names[0]}" if len(names) == 1 else f"{len(gpus)} GPUs ({', '.join(names)})"


def _set(found: Detected, key: str, value: str | int, how: str) -> None:
    found.answers[key] = value
    found.how[key] = how


def detect(
    run: Run = run_tool,
    torch_probe: Callable[[], tuple[str, list[Gpu]] | None] = probe_torch,
    proc: Path = Path("/proc"),
    cgroup: Path = Path("/sys/fs/cgroup"),
) -> Detected:
    """What this machine has, as copier answers; the first source that sees a device wins.

    nvidia-smi comes before torch because it sees the node, not just the CUDA_VISIBLE_DEVICES of
    this shell; /proc is the last resort, as it knows names but not memory.
    """
    found = _detect_devices(run, torch_probe, proc)
    ram = host_memory_mib(proc, cgroup)
    if ram is None:
        found.notes.append(f"no {proc}/meminfo: answer host_memory_gb (the RAM of one node, GiB) yourself")
    else:
        _set(found, "host_memory_gb", max(int(ram[0] // 1024), 1), f"{ram[1]}, rounded down to whole GiB")
    return found


def _detect_devices(run: Run, torch_probe: Callable[[], tuple[str, list[Gpu]] | None], proc: Path) -> Detected:
    """The accelerator answers of detect()."""
    found = Detected()
    gpus, kind, source = [], "", ""
    text = run(NVIDIA_QUERY) or run(NVIDIA_QUERY_OLD)
    if text and (gpus := parse_nvidia_smi(text)):
        kind, source = "cuda", "nvidia-smi"
    elif (seen := torch_probe()) and seen[1]:
        (kind, gpus), source = seen, "torch"
    elif (text := run(XPU_DUMP)) and (gpus := parse_xpu_dump(text)):
        kind, source = "xpu", "xpu-smi"
        found.notes.append("xpu-smi counts cards; if torch sees each tile as a device, set gpus_per_node to the tiles")
    elif gpus := proc_nvidia_gpus(proc):
        kind, source = "cuda", f"{proc}/driver/nvidia/gpus"
    if not gpus:
        _set(found, "accelerator", "cpu", "no GPU seen by nvidia-smi, torch, xpu-smi or /proc/driver/nvidia")
        cores = os.cpu_count() or 1
        _set(found, "gpus_per_node", CPU_RANKS, f"{CPU_RANKS} CPU ranks, the template's default ({cores} cores here)")
        return found

    _set(found, "accelerator", kind, f"{source}: {_describe(gpus)}")
    _set(found, "gpus_per_node", len(gpus), source)
    if kind == "cuda":
        archs = [arch_of(g.compute_cap, g.name) for g in gpus]
        caps = sorted({g.compute_cap for g in gpus if g.compute_cap})
        reading = f"compute capability {', '.join(caps)}" if caps else f"name {gpus[0].name!r}"
        if None in archs:
            found.notes.append(
                f"{reading} is not a gpu_arch choice of the template ({', '.join(ARCHS)}); "
                "answer gpu_arch yourself (volta for pre-Volta NVIDIA GPUs: fp16 or fp32, no bf16)"
            )
        else:
            # Mixed generations: plan for the oldest, whose precision every GPU supports.
            _set(found, "gpu_arch", max(archs, key=ARCHS.index), f"{source}: {reading}")
    memories = [g.memory_mib for g in gpus if g.memory_mib > 0]
    if memories:
        smallest = min(memories)
        _set(found, "gpu_memory_gb", memory_gib(smallest), f"{source}: {smallest:.0f} MiB, rounded up to whole GiB")
    else:
        found.notes.append(f"{source} does not report device memory: answer gpu_memory_gb yourself")
    if len(gpus) > 1:
        topo_cmd, parse = (NVIDIA_TOPO, parse_nvidia_topo) if kind == "cuda" else (XPU_TOPO, parse_xpu_topo)
        topo = run(topo_cmd)
        link = parse(topo) if topo else None
        if link:
            tag = "NV#" if kind == "cuda" else "XL"
            seen_as = f"{tag} between every pair" if link == "nvlink" else f"not {tag} between every pair"
            _set(found, "intra_node_link", link, f"{' '.join(topo_cmd)}: {seen_as}")
        else:
            found.notes.append(f"`{' '.join(topo_cmd)}` gave no topology: answer intra_node_link (nvlink or pcie)")
    return found


def to_yaml(found: Detected) -> str:
    """A --data-file for copier: one `question: value` line each, plus commented lines for the rest."""
    lines = [
        "# Hardware detected by hwprobe.py. Use it with: copier copy --data-file <this file> <template> <project>",
    ]
    lines += [f"{key}: {value}  # {found.how[key]}" for key, value in found.answers.items()]
    if found.answers.get("accelerator") != "cpu":
        choices = {"gpu_arch": " | ".join(ARCHS), "gpu_memory_gb": "GiB", "intra_node_link": "nvlink | pcie"}
        if found.answers.get("gpus_per_node") == 1:
            del choices["intra_node_link"]  # copier asks it only with several GPUs per node
        lines += [f"# {key}:   # not detected: {what}" for key, what in choices.items() if key not in found.answers]
    if "host_memory_gb" not in found.answers:
        lines.append("# host_memory_gb:   # not detected: GiB of RAM per node")
    lines += [
        "# One machine cannot see the others. For a cluster, uncomment and set:",
        "# num_nodes: 2",
        "# inter_node_link: infiniband  # or ethernet",
    ]
    return "\n".join(lines) + "\n"


def read_answers(text: str) -> dict[str, str | int | float | bool]:
    """The top-level `key: scalar` lines of a flat YAML file: what to_yaml writes, or .copier-answers.yml.

    Enough YAML to read these files without PyYAML, which generated repos do not depend on.
    """
    answers: dict[str, str | int | float | bool] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or not key or key[0] in " \t#-" or not re.fullmatch(r"[\w.-]+", key):
            continue
        value = value.strip()
        quoted = re.match(r"""(['"])(.*)\1""", value)
        if quoted:
            answers[key] = quoted.group(2)
            continue
        value = value.split(" #", 1)[0].strip()
        if value in ("true", "false"):
            answers[key] = value == "true"
        elif re.fullmatch(r"-?\d+", value):
            answers[key] = int(value)
        elif re.fullmatch(r"-?\d+\.\d*", value):
            answers[key] = float(value)
        else:
            answers[key] = value
    return answers


def report(found: Detected) -> str:
    """What was detected and how, for a person (stderr)."""
    lines = ["detected:"]
    lines += [f"  {key:<16} {value!s:<8} {found.how[key]}" for key, value in found.answers.items()]
    lines.append("  num_nodes, inter_node_link: not visible from one machine; set them for a cluster")
    lines += [f"note: {note}" for note in found.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the YAML here instead of stdout")
    args = parser.parse_args(argv)
    found = detect()
    print(report(found), file=sys.stderr)
    if args.out:
        args.out.write_text(to_yaml(found))
        print(f"wrote {args.out}: copier copy --data-file {args.out} <template> <project>", file=sys.stderr)
    else:
        sys.stdout.write(to_yaml(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
