"""A pytest plugin the template's tests load into a run of a generated repo's suite (`-p template_outcomes`).

It writes what each test did and which markers it carries to the JSON file that TEMPLATE_OUTCOMES names, so that
one run of a render's suite (the union of its selections) answers every selection of that render: a selection's
tests are those whose markers satisfy its marker expression.
"""

from __future__ import annotations

import json
import os
import resource

import pytest

_tests: dict[str, dict] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    _tests[item.nodeid] = {"markers": sorted({mark.name for mark in item.iter_markers()}), "outcome": "passed"}
    before = _cpu_seconds()
    try:
        return (yield)
    finally:
        # This process's CPU time and that of the processes it waited for (forked ranks, torchrun and its ranks):
        # on a small CI runner, what the test costs the others running beside it.
        _tests[item.nodeid]["cpu_seconds"] = _cpu_seconds() - before


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_runtest_logreport(report):
    test = _tests[report.nodeid]
    test["seconds"] = test.get("seconds", 0.0) + report.duration
    # A failure in any phase (setup, call, teardown) fails the test; a skip in setup or call skips it.
    if report.failed:
        test["outcome"], test["report"] = "failed", report.longreprtext[-6000:]
    elif report.skipped and test["outcome"] == "passed":
        test["outcome"] = "skipped"


def pytest_sessionfinish(session):
    with open(os.environ["TEMPLATE_OUTCOMES"], "w") as out:
        json.dump(_tests, out, indent=1)
