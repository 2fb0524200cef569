"""The promises a user and a bot rely on: no --trust, and `copier update` keeps their edits."""

from __future__ import annotations

import subprocess
import sys

import copier
import yaml
from conftest import TEMPLATE, committed_render, git, render, tagged_template

UNSAFE_KEYS = {"_tasks", "_migrations", "_jinja_extensions"}


def test_copier_yml_uses_no_unsafe_feature():
    config = yaml.safe_load((TEMPLATE / "copier.yml").read_text())
    assert not UNSAFE_KEYS & set(config)


def test_cli_copy_without_trust(tmp_path):
    # The command the README gives, minus the network: copier's own CLI, no --trust.
    proc = subprocess.run(
        [sys.executable, "-m", "copier", "copy", "--defaults", "--vcs-ref", "HEAD", str(TEMPLATE), str(tmp_path / "p")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "p" / ".copier-answers.yml").is_file()
    assert "scripts/run_local.sh" in proc.stderr  # _message_after_copy names the next commands


def test_update_round_trip_keeps_user_edits(tmp_path):
    # The template as a git repo tagged v1.0.0, rendered into a project the user commits and edits ...
    tpl = tagged_template(tmp_path)
    project = committed_render(tpl, tmp_path / "project", {"accelerator": "cpu"})
    debug = project / "configs" / "debug.toml"
    debug.write_text(debug.read_text().replace("steps = 40", "steps = 77  # the user's choice"))
    (project / "NOTES.md").write_text("my notes\n")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "user edits")
    # ... the template improves and is tagged v2.0.0 ...
    readme = tpl / "template" / "README.md.jinja"
    readme.write_text(readme.read_text() + "\nA template improvement.\n")
    git(tpl, "commit", "-qam", "v2")
    git(tpl, "tag", "v2.0.0")
    # ... and `copier update --defaults` brings it in without --trust, keeping the edits.
    copier.run_update(str(project), defaults=True, overwrite=True, unsafe=False, settings=copier.Settings(), quiet=True)
    assert "steps = 77  # the user's choice" in debug.read_text()
    assert (project / "NOTES.md").read_text() == "my notes\n"
    assert "A template improvement." in (project / "README.md").read_text()
    assert yaml.safe_load((project / ".copier-answers.yml").read_text())["_commit"] == "v2.0.0"
    assert "<<<<<<<" not in debug.read_text()


def test_rendered_answers_file_replays(tmp_path):
    # The answers file alone reproduces the project: what `copier update` relies on.
    first = render(tmp_path / "a", {"accelerator": "cpu", "model_size": "1b"})
    answers = yaml.safe_load((first / ".copier-answers.yml").read_text())
    data = {k: v for k, v in answers.items() if not k.startswith("_")}
    second = render(tmp_path / "b", data)
    for path in first.rglob("*"):
        if path.is_file() and path.name != ".copier-answers.yml":
            assert path.read_bytes() == (second / path.relative_to(first)).read_bytes(), path
