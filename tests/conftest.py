from __future__ import annotations

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
