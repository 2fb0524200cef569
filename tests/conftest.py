from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import copier
import pytest
from answers import MATRIX

TEMPLATE = Path(__file__).resolve().parents[1]


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


def tagged_template(root: Path, tag: str = "v1.0.0") -> Path:
    """A copy of this template as a git repository whose HEAD is tagged `tag` (what update needs)."""
    tpl = root / "template"
    shutil.copytree(TEMPLATE, tpl, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache"))
    git(tpl, "init", "-q")
    git(tpl, "add", "-A")
    git(tpl, "commit", "-qm", tag)
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
