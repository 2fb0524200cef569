"""The generated repos' own suites, run in the background while the template's other tests run.

A test of tests/test_generated.py carries `generated_suite(render, marks)`: it checks the tests of that render's
suite that the marker expression `marks` selects. Each render's suite runs once, as the union of the selections
this session's tests check, in one pytest process on a copy of the render (the template's tests read the renders
while it runs; the suite writes caches and run dirs). tests/plugin/template_outcomes.py records each test's
outcome, markers and seconds; `Suite.check` judges one selection from that record.

The suites start with the session, two at a time, and conftest.py runs the tests that check them last: a
generated suite spends much of its time starting processes and waiting on them, and the template's own tests
(renders, pseudo-terminal sessions) use one core, so on two cores the two kinds of work fill each other's gaps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PLUGIN = Path(__file__).parent / "plugin"
WORKERS = 2
TIMEOUT_S = 2400  # one render's suite, a guard against a hang


def matches(marks: str, markers: list[str]) -> bool:
    """Whether a test carrying `markers` is selected by the marker expression `marks` (pytest -m's rule: names
    joined by and, or, not and parentheses, each true when the test carries that marker)."""
    return eval(marks, {"__builtins__": {}}, defaultdict(bool, dict.fromkeys(markers, True)))


@dataclass
class Suite:
    """One run of a render's generated suite: each test's outcome and markers (tests/plugin), and its output."""

    tests: dict[str, dict]
    output: str
    started: float
    """Seconds after the session's suites were started."""
    seconds: float

    def check(self, marks: str, *must_pass: str) -> dict[str, dict]:
        """The tests of selection `marks`: none may have failed, and every name in `must_pass` (the end of a test's
        id: `test_file.py::test_name`; with a parameter list, that case alone, without one, any case) must be among
        those that passed."""
        selected = {test: o for test, o in self.tests.items() if matches(marks, o["markers"])}
        failed = [f"{test}\n{o['report']}" for test, o in selected.items() if o["outcome"] == "failed"]
        assert not failed, "\n\n".join(failed)[-12000:]
        passed = [test for test, o in selected.items() if o["outcome"] == "passed"]

        def found(name: str) -> bool:  # with its parameters where the name gives them, else any of them
            return any((test if "[" in name else test.split("[")[0]).endswith(name) for test in passed)

        missing = [name for name in must_pass if not found(name)]
        assert not missing, f"did not pass (skipped, deselected or gone?): {missing}\n{self.output[-3000:]}"
        return selected


def wanted(items) -> dict[str, str]:
    """Render -> the union of the marker expressions that the `generated_suite` tests among `items` check, in the
    order the renders first appear."""
    selections: dict[str, list[str]] = defaultdict(list)
    for item in items:
        if mark := item.get_closest_marker("generated_suite"):
            render, marks = mark.args
            selections[render].append(f"({marks})")
    return {render: " or ".join(marks) for render, marks in selections.items()}


class Suites:
    """The suites of `wanted` renders, started at once, WORKERS at a time; `suites[name]` waits for one."""

    def __init__(self, renders: dict[str, Path], wanted: dict[str, str], work: Path):
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._t0 = time.monotonic()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="generated-suite")
        self._futures: dict[str, Future[Suite]] = {
            name: self._pool.submit(self._run, name, renders[name], marks, work / name)
            for name, marks in wanted.items()
        }

    def __getitem__(self, name: str) -> Suite:
        return self._futures[name].result()

    def _run(self, name: str, render: Path, marks: str, work: Path) -> Suite:
        root, outcomes = work / "repo", work / "outcomes.json"
        shutil.copytree(render, root)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(PLUGIN)]),
               "TEMPLATE_OUTCOMES": str(outcomes)}  # fmt: skip
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "template_outcomes", "-m", marks]
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{name}: the session ended before its suite started")
            started = time.monotonic()
            # A session of its own: stopping the suite stops the ranks its tests launched too.
            proc = self._procs[name] = subprocess.Popen(
                cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            message = f"{name}: the suite ran past {TIMEOUT_S} s\n{stdout[-6000:]}{stderr[-3000:]}"
            raise AssertionError(message) from None
        # 0: every test passed; 1: some failed, which the selections they belong to report. Else it did not run.
        assert proc.returncode in (0, 1) and outcomes.is_file(), f"{name}:\n{stdout[-6000:]}{stderr[-3000:]}"
        seconds = time.monotonic() - started
        return Suite(json.loads(outcomes.read_text()), stdout, started - self._t0, seconds)

    def report(self) -> list[str]:
        """A line per suite that ended: when it started, its seconds and CPU seconds, and the tests that cost the most
        CPU (the budget's ledger: on two cores, CPU time is what a test takes from the others)."""
        lines = []
        for name, future in self._futures.items():
            if not future.done() or future.cancelled() or future.exception() is not None:
                continue
            suite = future.result()
            cpu = sum(o.get("cpu_seconds", 0.0) for o in suite.tests.values())
            slow = sorted(suite.tests.items(), key=lambda item: -item[1].get("cpu_seconds", 0.0))[:4]
            tests = ", ".join(f"{test.split('::')[-1][:60]} {o['seconds']:.0f} s, {o['cpu_seconds']:.0f} CPU s"
                              for test, o in slow)  # fmt: skip
            lines.append(f"{name}: {suite.seconds:.0f} s from +{suite.started:.0f} s, {cpu:.0f} CPU s in "
                         f"{len(suite.tests)} tests; the costliest: {tests}")  # fmt: skip
        return lines

    def close(self) -> None:
        """Stop what is still running (a session cut short), and what it launched."""
        with self._lock:
            self._closed = True
            for proc in self._procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        self._pool.shutdown(cancel_futures=True)
