"""The benchmarks in bench/ cannot rot: each one's quick mode produces every row of its table, the GPU
benchmark refuses a machine without a GPU in one line, and the README's tables are the ones the
recorded figures in bench/results/ print.

Every bench/<name>.py (files starting with "_" are helpers) keeps bench/_common.py's contract:
`ROWS` names the rows of its quick mode's table; the quick mode (`--quick`, or QUICK_FLAG's) with
`--json PATH` writes {"quick": true, "machine": {...}, "rows": [{"name", "figures"}]}; `table()`
turns such a dict into what it prints. Figures are printed, never asserted: they vary with the
machine, and the quick mode's mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEMPLATE

BENCH = TEMPLATE / "bench"
BENCHES = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
QUICK_FLAG = {"gpu.py": "--dry-run"}
"""A benchmark's quick mode, where it is not --quick."""
QUICK_TEST = "test_quick_mode_produces_every_row_with_the_machine_line"


def bench_module(name: str):
    """bench/<name> imported as a module (its helpers import from bench/ by name, as when it runs)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{Path(name).stem}", BENCH / name)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_runs(request, tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """The quick mode of every benchmark a selected test checks, all started at once: their figures
    mean nothing, so they may share the cores, and together they take half the time."""
    root = tmp_path_factory.mktemp("bench")
    selected = {item.callspec.params["name"] for item in request.session.items if item.originalname == QUICK_TEST}
    runs = {}
    for name in sorted(selected):
        out = root / name
        out.mkdir()
        cmd = [sys.executable, str(BENCH / name), QUICK_FLAG.get(name, "--quick"), "--json", str(out / "results.json")]
        with (out / "stdout").open("w") as stdout, (out / "stderr").open("w") as stderr:
            runs[name] = (subprocess.Popen(cmd, cwd=out, stdout=stdout, stderr=stderr), out)
    yield runs
    for proc, _ in runs.values():
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("name", BENCHES)
def test_quick_mode_produces_every_row_with_the_machine_line(quick_runs, name):
    proc, out = quick_runs[name]
    proc.wait(timeout=1800)
    stdout, stderr = (out / "stdout").read_text(), (out / "stderr").read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    results, module = json.loads((out / "results.json").read_text()), bench_module(name)
    assert results["quick"] is True
    assert [row["name"] for row in results["rows"]] == module.ROWS
    # gpu.py --dry-run lists the rows whose code path another row runs as not run, saying which.
    skipped = {run.name: same.name for run, same in getattr(module, "DRY_RUN_SAME_AS", {}).items()}
    for row in results["rows"]:
        if row["name"] in skipped:
            note = f"not run in a dry run: the code path of {skipped[row['name']]!r}"
            assert row["figures"] == {} and row["note"] == note, row
            continue
        assert row["figures"], f"{row['name']}: no figures"
        assert all(isinstance(v, int | float) and math.isfinite(v) for v in row["figures"].values()), row
    machine = results["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["torch"]
    # What it printed is the table of what it saved, machine line included: --from-json reprints it.
    assert module.table(results) in stdout
    assert f"{machine['cpu']}, {machine['cores']} cores" in stdout


def test_gpu_bench_without_a_gpu_says_so_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: bench/gpu.py would run")
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "no CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert proc.stdout == "" and not list(tmp_path.iterdir())  # nothing rendered, nothing written


@pytest.mark.parametrize("recorded", sorted((BENCH / "results").glob("*.json")), ids=lambda p: p.name)
def test_readme_tables_are_printed_from_the_recorded_figures(recorded):
    results = json.loads(recorded.read_text())
    assert results["quick"] is False, f"{recorded.name} holds a quick mode's figures"
    table = bench_module(f"{results['bench']}.py").table(results)
    assert table in (TEMPLATE / "README.md").read_text(), f"README.md lacks the table {recorded.name} prints"
