"""package_name is refused when the generated package would shadow a module the project imports.

The generated tests run with PYTHONPATH=src, so src/<package_name> comes before the standard
library and site-packages: a package called `logging` or `launch` breaks the repo it is in.
hooks/names.jinja keeps the list; these tests derive what it must hold from the renders.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re

import pytest
from answers import MATRIX
from conftest import JINJA, answers_of, hook, render

NAMES = JINJA.get_template("hooks/names.jinja").module
REFUSED = sorted(set(NAMES.SHADOWED) | set(NAMES.KEYWORDS))


def imported_modules(root) -> set[str]:
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_every_module_a_render_imports_is_on_the_list(rendered):
    needed = set()
    for root in rendered.values():
        package = answers_of(root)["package_name"]
        needed |= imported_modules(root) - {package, "__future__"}
        # The generated tests import their helpers (launch, fsdp_probe, ...) by module name.
        needed |= {p.stem for p in (root / "tests").glob("*.py") if not p.stem.startswith("test_")}
    # What torch imports at start-up: a package named after one of them breaks `import torch`.
    for requirement in importlib.metadata.requires("torch"):
        if "extra ==" not in requirement:
            needed.add(re.split(r"[ ;<>=!\[]", requirement)[0].replace("-", "_").lower())
    assert len(rendered) == len(MATRIX)
    assert needed - set(NAMES.SHADOWED) == set()


def test_every_name_on_the_list_is_refused_with_a_name_that_works():
    # copier.yml's validator is this macro; test_a_refused_name_stops_the_render shows copier applies it.
    # A refusal fits the 33 columns copier leaves it in an 80-column terminal: the suggestion first, then the reason
    # as fully as the room allows (the refused name itself where it fits; the prompt shows it anyway).
    for name in REFUSED:
        message = hook("names", "check_package_name", name, "x")
        suggestion = re.search(r"^try (\w+)(: |$)", message).group(1)
        tails = ("is not an identifier", "is a keyword", "shadows a module")
        tail = next((t for t in tails if t.split()[-1] in message), "is a keyword")  # none: not even the shortest fit
        named = f"'{name}'" in message or len(f"try {suggestion}: '{name}' {tail}") > 33  # the form with the name
        assert len(message) <= 33 and named, message
        assert hook("names", "check_package_name", suggestion, "x") == "", (name, suggestion)


@pytest.mark.parametrize("name", ["logging", "launch", "class"])
def test_a_refused_name_stops_the_render(tmp_path, name):
    dst = tmp_path / "p"
    with pytest.raises(ValueError) as refusal:
        render(dst, {"package_name": name})
    message = str(refusal.value)
    assert "'package_name'" in message and f": try {name}" in message, message
    assert not dst.exists()


@pytest.mark.parametrize(
    ("project", "package"), [("launch", "launch_train"), ("1st-model", "p1st_model"), ("My.Model", "my_model")]
)
def test_the_default_package_name_is_always_allowed(tmp_path, project, package):
    root = render(tmp_path / "p", {"project_name": project})
    assert answers_of(root)["package_name"] == package
    assert (root / "src" / package / "train.py").is_file()
