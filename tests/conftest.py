from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import compile_once
import copier
import generated_suites
import pytest
import yaml
from answers import MATRIX
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from jinja2_ansible_filters import AnsibleCoreFiltersExtension

TEMPLATE = Path(__file__).resolve().parents[1]
SUITES = pytest.StashKey["generated_suites.Suites"]()
"""The session's generated suites, for the summary (pytest_terminal_summary)."""


compile_once.install()  # renders share compiled Jinja code (tests/compile_once.py)
JINJA = Environment(
    loader=FileSystemLoader(TEMPLATE), undefined=StrictUndefined, extensions=[AnsibleCoreFiltersExtension]
)


def tool(name: str) -> str | None:
    """The command `name` from a wheel of the test group (installed beside this interpreter, whether or not its
    environment is activated), else from PATH; None when neither has it."""
    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def hook(module: str, macro: str, *args):
    """Call a macro of hooks/<module>.jinja, as copier.yml does."""
    template = JINJA.from_string(f"{{% from 'hooks/{module}.jinja' import {macro} %}}{{{{ {macro}(*args) }}}}")
    return template.render(args=args)


def answers_of(root: Path) -> dict:
    """The answers a render recorded, without copier's own keys."""
    return {k: v for k, v in yaml.safe_load((root / ".copier-answers.yml").read_text()).items() if k[0] != "_"}


def misfit(a: dict) -> str:
    """The planner's objection to the recorded answers (hooks/plan.jinja's check_plan for the GPUs,
    check_host_memory for the node's RAM; the render's plan/ has both); empty when they fit."""
    zero = a.get("zero_optimizer", False)
    sp = a.get("model_type") != "hf_causal_lm"  # transformers' tensor-parallel plans split no sequence
    device = hook("plan", "check_plan", a["model_size"], a.get("seq_len", 0), a["micro_batch_size"],
                  a["mixed_precision"], a["activation_checkpointing"], a["sharding"], a["cpu_offload"],
                  a["gpus_per_node"], a["num_nodes"], a.get("gpu_memory_gb", 0), a.get("inter_node_link", "infiniband"),
                  a["accelerator"], zero, a.get("finetune", "full"), a.get("tensor_parallel", 1), 0, sp,
                  a.get("context_parallel", 1), a.get("expert_parallel", 1))  # fmt: skip
    host = hook("plan", "check_host_memory", a["model_size"], a.get("seq_len", 0), a["micro_batch_size"],
                a["mixed_precision"], a["activation_checkpointing"], a["sharding"], a["cpu_offload"],
                a["gpus_per_node"], a["num_nodes"], a["host_memory_gb"], a["accelerator"], zero,
                a.get("finetune", "full"), a.get("tensor_parallel", 1), a["checkpoint_format"],
                a["checkpoint_export"] != "none", "", sp, a.get("context_parallel", 1),
                a.get("expert_parallel", 1))  # fmt: skip
    return device + host


def render(dst: Path, answers: dict | None = None, src: Path = TEMPLATE, **kwargs) -> Path:
    """Render the template with copier's own API, isolated from the user's copier settings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DirtyLocalWarning while developing the template
        copier.run_copy(
            str(src), str(dst), data=answers or {}, defaults=True, unsafe=False,
            settings=copier.Settings(), vcs_ref="HEAD", quiet=True, **kwargs,
        )  # fmt: skip
    return dst


@pytest.fixture(scope="session")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Every answer set of the matrix, rendered once per session."""
    root = tmp_path_factory.mktemp("renders")
    return {name: render(root / name, answers) for name, answers in MATRIX.items()}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that check a generated suite run last: the suites run in the background meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("generated_suite") is not None)  # stable: order kept


@pytest.fixture(scope="session", autouse=True)
def suites(request, tmp_path_factory):
    """The generated suites that this session's tests check (tests/generated_suites.py), started with the
    session (all of them in a whole run; a CI job of the template's workflow checks some)."""
    wanted = generated_suites.wanted(request.session.items)
    if not wanted:
        yield None
        return
    renders = request.getfixturevalue("rendered")
    suites = generated_suites.Suites(renders, wanted, tmp_path_factory.mktemp("generated"))
    request.config.stash[SUITES] = suites
    yield suites
    suites.close()


def pytest_terminal_summary(terminalreporter, config) -> None:
    """How long each generated suite ran, and when: with two running at a time, they set the session's length."""
    if (suites := config.stash.get(SUITES, None)) and (lines := suites.report()):
        terminalreporter.section("generated suites")
        for line in lines:
            terminalreporter.write_line(line)


def git(cwd: Path, *args: str) -> str:
    identity = [
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.com",
        "-c",
        "commit.gpgsign=false",
        "-c",
        "tag.gpgsign=false",
    ]
    return subprocess.run(["git", *identity, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def tagged_template(root: Path, tag: str | None = "v1.0.0") -> Path:
    """A copy of this template as a git repository whose HEAD is tagged `tag` (what update needs; None: no tag)."""
    tpl = root / "template"
    shutil.copytree(TEMPLATE, tpl, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache"))
    git(tpl, "init", "-q")
    git(tpl, "add", "-A")
    git(tpl, "commit", "-qm", tag or "untagged")
    if tag:
        git(tpl, "tag", tag)
    return tpl


def committed_render(tpl: Path, dst: Path, answers: dict, tag: str = "v1.0.0") -> Path:
    """Render `tpl` at `tag` into `dst` and commit it, as a user's project starts."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copier.run_copy(str(tpl), str(dst), data=answers, defaults=True, unsafe=False, settings=copier.Settings(),
                        vcs_ref=tag, quiet=True)  # fmt: skip
    git(dst, "init", "-q")
    git(dst, "add", "-A")
    git(dst, "commit", "-qm", "generated")
    return dst
