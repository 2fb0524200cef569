"""hwprobe.py: the hardware probe against captured tool output, its YAML as copier answers, and the
re-size round trip: `plan --detect` on other hardware prints a `copier update` that re-plans the repo."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, committed_render, git, render, tagged_template

spec = importlib.util.spec_from_file_location("hwprobe", TEMPLATE / "hwprobe.py")
hwprobe = importlib.util.module_from_spec(spec)
sys.modules["hwprobe"] = hwprobe  # dataclasses look their module up while building the classes
spec.loader.exec_module(hwprobe)


def topo(*rows: list[str], extra: str = "") -> str:
    """`nvidia-smi topo -m` as the driver prints it: tab-separated, then the legend."""
    gpus = [f"GPU{i}" for i in range(len(rows))]
    lines = ["\t" + "\t".join([*gpus, "NIC0", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for i, row in enumerate(rows):
        lines.append("\t".join([gpus[i], *row, "PIX" if i < 4 else "SYS", "0-55,112-167" if i < 4 else "56-111", "0"]))
    lines.append("\t".join(["NIC0", *("PIX" if i < 4 else "SYS" for i in range(len(rows))), " X "]))
    legend = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
"""
    return "\n".join(lines) + "\n" + legend + extra


def matrix(n: int, link) -> list[list[str]]:
    return [[" X " if i == j else link(i, j) for j in range(n)] for i in range(n)]


# An 8 x H100 SXM node (HGX): every pair of GPUs through NVSwitch, 18 links each.
H100_QUERY = "NVIDIA H100 80GB HBM3, 81559, 9.0\n" * 8
H100_TOPO = topo(*matrix(8, lambda i, j: "NV18"))
# A cloud VM with 4 x A10 on PCIe (no NVLink), as `nvidia-smi topo -m` prints it with spaces.
A10_QUERY = "NVIDIA A10, 23028, 8.6\n" * 4
A10_TOPO = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      PHB     PHB     PHB     0-47    0               N/A
GPU1    PHB      X      PHB     PHB     0-47    0               N/A
GPU2    PHB     PHB      X      PHB     0-47    0               N/A
GPU3    PHB     PHB     PHB      X      0-47    0               N/A

Legend:

  X    = Self
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  NV#  = Connection traversing a bonded set of # NVLinks
"""
# 4 x RTX A6000 with NVLink bridges on two pairs only: collectives across all four run at PCIe speed.
A6000_TOPO = topo(*matrix(4, lambda i, j: "NV4" if i // 2 == j // 2 else "SYS"))
XPU_DUMP = """\
Device ID,Device Name,Memory Physical Size
0,"Intel(R) Data Center GPU Max 1550","131072.00 MiB"
1,"Intel(R) Data Center GPU Max 1550","131072.00 MiB"
"""
XPU_TOPO = """\
         GPU 0/0|GPU 0/1|GPU 1/0|GPU 1/1|CPU Affinity
GPU 0/0 |S      |MDF    |XL*    |XL16   |0-23,48-71
GPU 0/1 |MDF    |S      |XL16   |XL*    |0-23,48-71
GPU 1/0 |XL*    |XL16   |S      |MDF    |24-47,72-95
GPU 1/1 |XL16   |XL*    |MDF    |S      |24-47,72-95
"""


def tools(outputs: dict[tuple[str, ...], str]):
    """A `run` that answers the commands in `outputs` and finds no other tool."""
    return lambda argv: outputs.get(tuple(argv))


def machine(outputs: dict, proc: Path = Path("/nonexistent")):
    return hwprobe.detect(run=tools(outputs), torch_probe=lambda: None, proc=proc)


def nvidia(query: str, topology: str | None = None) -> dict:
    outputs = {tuple(hwprobe.NVIDIA_QUERY): query}
    if topology is not None:
        outputs[tuple(hwprobe.NVIDIA_TOPO)] = topology
    return outputs


H100 = nvidia(H100_QUERY, H100_TOPO)
A10 = nvidia(A10_QUERY, A10_TOPO)
CPU: dict = {}
MACHINES = {
    "h100": (H100, {"accelerator": "cuda", "gpu_arch": "hopper", "gpus_per_node": 8, "gpu_memory_gb": 80,
                    "intra_node_link": "nvlink"}),
    # 23028 MiB is 22.5 GiB, rounded up (hwprobe's docstring says why).
    "a10": (A10, {"accelerator": "cuda", "gpu_arch": "ampere", "gpus_per_node": 4, "gpu_memory_gb": 23,
                  "intra_node_link": "pcie"}),
    "cpu": (CPU, {"accelerator": "cpu", "gpus_per_node": 2}),
}  # fmt: skip


@pytest.mark.parametrize("name", MACHINES)
def test_probe_reads_the_machine(name):
    outputs, expected = MACHINES[name]
    found = machine(outputs)
    assert found.answers == expected
    assert set(found.how) == set(expected)  # every value says where it came from
    if name != "cpu":
        assert all(found.how[k].startswith("nvidia-smi") for k in expected), found.how


def test_parsers_on_captured_text():
    assert [g.compute_cap for g in hwprobe.parse_nvidia_smi(H100_QUERY)] == ["9.0"] * 8
    assert hwprobe.parse_nvidia_smi("NVIDIA A10, [N/A], 8.6\n") == []
    assert hwprobe.parse_nvidia_topo(H100_TOPO) == "nvlink"
    assert hwprobe.parse_nvidia_topo(A10_TOPO) == "pcie"
    assert hwprobe.parse_nvidia_topo(A6000_TOPO) == "pcie"
    assert hwprobe.parse_nvidia_topo("\x1b[4mGPU0\tCPU Affinity\x1b[0m\nGPU0\t X \t0-15\n") is None  # one GPU
    assert hwprobe.parse_nvidia_topo("No devices were found\n") is None
    assert hwprobe.parse_xpu_topo(XPU_TOPO) == "nvlink"
    assert hwprobe.parse_xpu_topo(XPU_TOPO.replace("XL16", "SYS ").replace("XL*", "SYS")) == "pcie"
    caps = {"10.0": "blackwell", "12.0": "blackwell", "9.0": "hopper", "8.9": "ada", "8.6": "ampere",
            "8.0": "ampere", "7.5": "turing", "7.0": "volta", "6.0": None}  # fmt: skip
    assert {cap: hwprobe.arch_of(cap) for cap in caps} == caps
    names = {"NVIDIA B200": "blackwell", "NVIDIA GH200 480GB": "hopper", "NVIDIA L40S": "ada",
             "NVIDIA RTX 6000 Ada Generation": "ada", "NVIDIA A100-SXM4-40GB": "ampere", "NVIDIA RTX A6000": "ampere",
             "Tesla T4": "turing", "Tesla V100-SXM2-32GB": "volta", "Tesla P100-PCIE-16GB": None}  # fmt: skip
    assert {name: hwprobe.arch_of("", name) for name in names} == names
    assert [hwprobe.memory_gib(m) for m in (81559, 23028, 40960, 143771)] == [80, 23, 40, 141]


def test_probe_falls_back_and_says_what_it_could_not_tell(tmp_path):
    # A driver older than the compute_cap field: the name gives the generation.
    old = machine({tuple(hwprobe.NVIDIA_QUERY_OLD): "Tesla V100-SXM2-32GB, 32510\n" * 2})
    assert old.answers == {"accelerator": "cuda", "gpu_arch": "volta", "gpus_per_node": 2, "gpu_memory_gb": 32}
    assert any("intra_node_link" in note for note in old.notes)
    assert "# intra_node_link:" in hwprobe.to_yaml(old)
    # Pascal has no gpu_arch choice: left to the user, with the reason.
    pascal = machine(nvidia("Tesla P100-PCIE-16GB, 16280, 6.0\n"))
    assert "gpu_arch" not in pascal.answers and any("6.0" in note for note in pascal.notes)
    # No nvidia-smi in the container, but the kernel driver lists the GPUs under /proc.
    for bus in ("0000:07:00.0", "0000:0f:00.0"):
        info = tmp_path / "driver" / "nvidia" / "gpus" / bus / "information"
        info.parent.mkdir(parents=True)
        info.write_text("Model: \t\t NVIDIA A100-SXM4-40GB\nIRQ:   \t\t 158\nBus Type: \t PCIe\n")
    proc = machine({}, proc=tmp_path)
    assert proc.answers == {"accelerator": "cuda", "gpu_arch": "ampere", "gpus_per_node": 2}
    assert "# gpu_memory_gb:" in hwprobe.to_yaml(proc)
    # Intel GPUs through xpu-smi, Xe Link between the cards.
    xpu = machine({tuple(hwprobe.XPU_DUMP): XPU_DUMP, tuple(hwprobe.XPU_TOPO): XPU_TOPO})
    assert xpu.answers == {"accelerator": "xpu", "gpus_per_node": 2, "gpu_memory_gb": 128, "intra_node_link": "nvlink"}


# /proc/meminfo of a DGX H100 (2 TiB installed; the kernel keeps some back) and of this kind of laptop.
MEMINFO_DGX = "MemTotal:       2113407452 kB\nMemFree:        2037565012 kB\nMemAvailable:   2074170244 kB\n"
MEMINFO_LAPTOP = "MemTotal:       16164024 kB\nMemFree:         9010216 kB\n"


def node(root: Path, meminfo: str, cgroup: str = "", limits: dict[str, str] | None = None) -> tuple[Path, Path]:
    """A /proc with `meminfo` and /proc/self/cgroup, and a cgroup filesystem with `limits` (relative path -> value)."""
    proc, fs = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(cgroup)
    for path, value in (limits or {}).items():
        (fs / path).parent.mkdir(parents=True, exist_ok=True)
        (fs / path).write_text(value + "\n")
    return proc, fs


def test_probe_reads_host_memory_and_the_cgroup_limit(tmp_path):
    assert hwprobe.parse_meminfo(MEMINFO_DGX) == 2113407452 / 1024
    assert hwprobe.parse_meminfo("MemFree: 1 kB\n") is None
    # A whole node: MemTotal, rounded down (2015.5 GiB is written as 2015).
    proc, fs = node(tmp_path / "dgx", MEMINFO_DGX, "0::/\n", {"memory.max": "max"})
    found = hwprobe.detect(run=tools(H100), torch_probe=lambda: None, proc=proc, cgroup=fs)
    assert found.answers == {**MACHINES["h100"][1], "host_memory_gb": 2015}
    assert found.how["host_memory_gb"].startswith(f"{proc}/meminfo: MemTotal 2063874 MiB")
    # A SLURM job with --mem=64G on that node (cgroup v2): the job's limit, which an ancestor may lower further.
    job = "system.slice/slurmstepd.scope/job_42"
    proc, fs = node(tmp_path / "slurm", MEMINFO_DGX, f"0::/{job}/step_0/user/task_0\n",
                    {f"{job}/memory.max": str(64 * 2**30), "system.slice/memory.max": "max"})  # fmt: skip
    assert hwprobe.host_memory_mib(proc, fs) == (64 * 1024, "cgroup memory limit 65536 MiB (MemTotal 2063874 MiB)")
    # A container under cgroup v1 with a 12 GiB limit on a laptop-sized host; v1's "no limit" is near 2**63.
    proc, fs = node(tmp_path / "v1", MEMINFO_LAPTOP, "12:pids:/docker/abc\n4:memory:/docker/abc\n",
                    {"memory/docker/abc/memory.limit_in_bytes": str(12 * 2**30),
                     "memory/memory.limit_in_bytes": "9223372036854771712"})  # fmt: skip
    found = hwprobe.detect(run=tools(CPU), torch_probe=lambda: None, proc=proc, cgroup=fs)
    assert found.answers == {"accelerator": "cpu", "gpus_per_node": 2, "host_memory_gb": 12}
    unlimited = {"memory/memory.limit_in_bytes": "9223372036854771712"}
    proc, fs = node(tmp_path / "none", MEMINFO_LAPTOP, "4:memory:/\n", unlimited)
    assert hwprobe.host_memory_mib(proc, fs)[0] == 16164024 / 1024  # 15.4 GiB: written as 15
    # No /proc/meminfo: left to the user, with the question in the YAML.
    assert "host_memory_gb" not in machine(H100).answers and "# host_memory_gb:" in hwprobe.to_yaml(machine(H100))


def test_yaml_round_trips_without_pyyaml():
    for outputs, expected in MACHINES.values():
        text = hwprobe.to_yaml(machine(outputs))
        assert yaml.safe_load(text) == expected == hwprobe.read_answers(text)
        assert "# num_nodes:" in text and "# inter_node_link:" in text  # left for the user
    answers = "_commit: v1.0.0\n_src_path: /tmp/t\ncompile: true\nmodel_size: 8b\nproject_name: 'x y'\nseq_len: 8192\n"
    assert hwprobe.read_answers(answers) == yaml.safe_load(answers)


def test_real_machine_does_not_crash(tmp_path):
    out = tmp_path / "hw.yml"
    proc = subprocess.run([sys.executable, str(TEMPLATE / "hwprobe.py"), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    answers = yaml.safe_load(out.read_text())
    assert "accelerator" in proc.stderr and f"wrote {out}" in proc.stderr
    assert answers["accelerator"] in ("cuda", "xpu", "cpu")
    has_gpu_tool = shutil.which("nvidia-smi") or shutil.which("xpu-smi") or Path("/proc/driver/nvidia/gpus").is_dir()
    if not has_gpu_tool and answers["accelerator"] != "cpu":
        pytest.fail(f"no GPU tool here, yet the probe reported {answers}")
    assert answers["host_memory_gb"] >= 1  # every Linux machine has /proc/meminfo
    if answers["accelerator"] == "cpu":
        assert answers.keys() == {"accelerator", "gpus_per_node", "host_memory_gb"} and answers["gpus_per_node"] == 2


def test_probe_source_is_jinja_safe_and_renders_verbatim(tmp_path):
    # Rendered into the generated repo through `{% include %}`: Jinja would interpret its delimiters.
    source = (TEMPLATE / "hwprobe.py").read_text()
    assert not re.search(r"\{[{%#]", source)
    root = render(tmp_path / "p", {"accelerator": "cpu", "model_size": "debug", "package_name": "probed"})
    assert (root / "src" / "probed" / "hardware.py").read_text() == source


def settings_env(tmp_path: Path) -> dict[str, str]:
    """The environment for copier's CLI, isolated from the user's copier settings."""
    settings = tmp_path / "copier-settings.yml"
    settings.write_text("{}\n")
    return {**os.environ, "COPIER_SETTINGS_PATH": str(settings)}


@pytest.mark.parametrize("name", ["h100", "a10", "cpu"])
def test_probe_yaml_is_a_copier_data_file(tmp_path, name):
    outputs, expected = MACHINES[name]
    data = yaml.safe_load(hwprobe.to_yaml(machine(outputs)))
    root = render(tmp_path / "p", data)  # on 4 x 23 GiB the planner picks a sequence length that fits
    for config in (root / "configs").glob("*.toml"):
        hardware = tomllib.loads(config.read_text())["hardware"]
        assert {k: hardware[k] for k in expected} == expected, config


def test_probe_yaml_with_copier_cli(tmp_path):
    # The README's command, to the letter: copier reads the file itself.
    hw = tmp_path / "hw.yml"
    hw.write_text(hwprobe.to_yaml(machine(A10)))
    cmd = [sys.executable, "-m", "copier", "copy", "--data-file", str(hw), "--defaults",
           "--vcs-ref", "HEAD", str(TEMPLATE), str(tmp_path / "p")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=settings_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr
    answers = yaml.safe_load((tmp_path / "p" / ".copier-answers.yml").read_text())
    assert {k: answers[k] for k in MACHINES["a10"][1]} == MACHINES["a10"][1]


def plan_detect(project: Path, package: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    cmd = [sys.executable, "-m", f"{package}.plan", *args]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_detect_prints_the_update_that_resizes_the_repo(tmp_path):
    # The template as a git repo tagged v1.0.0, rendered for one 8 x H100 node, committed, and
    # edited by its user ...
    tpl = tagged_template(tmp_path)
    answers = {"package_name": "resized", "model_size": "8b", "seq_len": 4096, **MACHINES["h100"][1]}
    project = committed_render(tpl, tmp_path / "project", answers)
    debug = project / "configs" / "debug.toml"
    debug.write_text(debug.read_text().replace("steps = 40", "steps = 77  # the user's choice"))
    (project / "NOTES.md").write_text("my notes\n")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "user edits")
    plan_before = (project / "PLAN.md").read_text()
    # ... which moves to a 4 x A10 machine: the probe's file from there, handed to `plan --detected`.
    hw = tmp_path / "hw.yml"
    hw.write_text(hwprobe.to_yaml(machine(A10)))
    out = plan_detect(project, "resized", "--detected", str(hw))
    assert "gpus_per_node" in out and "<- this config" in out  # the differences and the plan on the A10s
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("copier update"))
    args = shlex.split(command)
    printed = dict(arg.split("=", 1) for arg in args[args.index("-d") + 1 :: 2])
    assert printed.keys() >= {"gpu_arch", "gpus_per_node", "gpu_memory_gb", "intra_node_link", "sharding",
                              "activation_checkpointing", "cpu_offload"}  # fmt: skip
    assert "accelerator" not in printed  # unchanged answers are not repeated
    # The printed command, run as printed, from the project's clean checkout.
    proc = subprocess.run([sys.executable, "-m", *args], cwd=project, capture_output=True, text=True,
                          env=settings_env(tmp_path), timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    after = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert {k: str(after[k]).lower() for k in printed} == printed
    for config in (project / "configs").glob("*.toml"):
        hardware = tomllib.loads(config.read_text())["hardware"]
        assert {k: hardware[k] for k in MACHINES["a10"][1]} == MACHINES["a10"][1], config
        assert tomllib.loads(config.read_text())["parallel"]["sharding"] == printed["sharding"]
    assert (project / "PLAN.md").read_text() != plan_before
    assert "steps = 77  # the user's choice" in debug.read_text() and "<<<<<<<" not in debug.read_text()
    assert (project / "NOTES.md").read_text() == "my notes\n"
    # Re-sized: the same probe now matches.
    git(project, "add", "-A")
    git(project, "commit", "-qm", "re-sized")
    assert "nothing to re-size" in plan_detect(project, "resized", "--detected", str(hw))
