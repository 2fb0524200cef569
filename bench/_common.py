"""What the benchmarks share: the machine line, rendering a project, and results as JSON and Markdown.

Every benchmark here (bench/<name>.py; files starting with "_" are helpers) keeps one contract,
which tests/test_bench.py runs in its quick mode:

- `--json PATH` writes its raw figures as {"bench", "quick", "machine", "rows": [{"name", "figures"}]},
  every figure a number, and `--from-json PATH` prints the table of a saved file again (the README's
  tables are printed this way from bench/results/*.json);
- a quick mode (`--quick`; bench/gpu.py: `--dry-run`) runs every code path on a small problem in a
  minute or two and produces every row (its figures mean nothing);
- the table carries the machine line, so that a slower machine is not read as a regression.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hwprobe.py, the template's hardware probe

import hwprobe  # noqa: E402


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_machine() -> dict:
    """The host: CPU model and cores, its load when the run started, Python and torch versions."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        # Other work on the machine slows every timing: the 1-minute load average when the run began,
        # and this run's niceness (below 0 it took the cores ahead of that work).
        "load_at_start": round(os.getloadavg()[0], 2),
        "nice": os.nice(0),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def gpu_machine() -> dict:
    """host_machine() and the first CUDA GPU: name, memory, compute capability, driver and CUDA versions."""
    import torch

    props = torch.cuda.get_device_properties(0)
    driver = hwprobe.run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        **host_machine(),
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "compute_capability": f"{props.major}.{props.minor}",
        "driver": driver.splitlines()[0].strip() if driver else "unknown (no nvidia-smi)",
        "cuda": torch.version.cuda,
    }


def machine_line(m: dict) -> str:
    """One line naming the machine a table was measured on."""
    nice = f" (run at nice {m['nice']})" if m.get("nice") else ""
    host = (
        f"{m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), load {m['load_at_start']} at start{nice}; "
        f"Python {m['python']}, torch {m['torch']}"
    )
    if "gpu" not in m:
        return f"Machine: {host}"
    return (
        f"Machine: {m['gpu']} ({m['gpu_memory_gib']} GiB, sm {m['compute_capability']}), driver {m['driver']}, "
        f"CUDA {m['cuda']}; host {host}"
    )


def render(dst: Path, answers: dict) -> float:
    """Render the template at HEAD (with uncommitted changes) into dst; return the seconds it took."""
    import copier  # here, not above: bench/gpu.py runs renders made elsewhere where copier is not installed

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DirtyLocalWarning while developing the template
        copier.run_copy(str(ROOT), str(dst), data=answers, defaults=True, unsafe=False, settings=copier.Settings(),
                        vcs_ref="HEAD", quiet=True)  # fmt: skip
    return time.perf_counter() - started


def env_for(project: Path) -> dict:
    """The environment a rendered project's commands run in: its source and tests importable, one thread per rank."""
    return {**os.environ, "PYTHONPATH": f"{project / 'src'}:{project / 'tests'}", "OMP_NUM_THREADS": "1"}


def markdown(header: list[str], rows: list[list[str]], align: str) -> str:
    """A Markdown table; align has one letter per column, l or r."""
    rule = ["---" if a == "l" else "---:" for a in align]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, rule, *rows])


def ratio_row(name: str, new: float, old: float, raw: str, goal: str) -> dict:
    """A row whose figure is new / old (none where old is 0: the table says n/a)."""
    ratio = {"ratio": new / old} if old else {}
    return {"name": name, "figures": {**ratio, "measured": new, "reference": old}, "raw": raw, "goal": goal}


def table(results: dict) -> str:
    """The Markdown table of a results dict of ratio and time rows (what --json writes), with the machine line
    under it."""
    rows, times = [], False
    for row in results["rows"]:
        figures = row["figures"]
        if "wall_s" in figures:
            times, figure = True, f"{figures['wall_s']:.1f} s"
        else:
            figure = f"{figures['ratio']:.3f}" if "ratio" in figures else "n/a"
        rows.append([row["name"], figure, row["raw"], row["goal"]])
    quick = " (quick mode: a harness check, not a measurement)" if results["quick"] else ""
    body = markdown(["measurement", "ratio or time" if times else "ratio", "raw", "goal"], rows, "lrrl")
    return f"{body}\n\n{machine_line(results['machine'])}{quick}"


def arguments(description: str, quick: str, quick_help: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: its quick mode, --json and --from-json."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(quick, action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--from-json", type=Path, help="print the table of a saved --json file, and run nothing")
    return parser


def save(results: dict, path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")


def run_cpu_bench(bench: str, doc: str, quick_help: str, measure) -> None:
    """The command line of a benchmark that runs on this machine's CPU: `measure(quick)` gives its rows."""
    args = arguments(doc.split("\n\n")[0], "--quick", quick_help).parse_args()
    if args.from_json:
        print(table(json.loads(args.from_json.read_text())))
        return
    results = {"bench": bench, "quick": args.quick, "machine": host_machine(), "rows": measure(args.quick)}
    save(results, args.json)
    print(table(results))
