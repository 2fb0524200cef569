"""The promises a user and a bot rely on: no --trust, and `copier update` keeps their edits."""

from __future__ import annotations

import os
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
    first = render(tmp_path / "a", {"accelerator": "cpu", "model_size": "1b", "host_memory_gb": 64})  # 1b: 33 GiB
    answers = yaml.safe_load((first / ".copier-answers.yml").read_text())
    data = {k: v for k, v in answers.items() if not k.startswith("_")}
    second = render(tmp_path / "b", data)
    for path in first.rglob("*"):
        if path.is_file() and path.name != ".copier-answers.yml":
            assert path.read_bytes() == (second / path.relative_to(first)).read_bytes(), path


def test_generated_ci_reports_a_newer_template(tmp_path):
    """The generated workflow's template-update step, run as written: silent on the newest tag,
    a warning and a job summary once the template has a newer one."""
    tpl = tagged_template(tmp_path, "v1.0.0")
    dst = committed_render(tpl, tmp_path / "proj", {"accelerator": "cpu", "model_size": "debug"}, "v1.0.0")
    workflow = yaml.safe_load((dst / ".github" / "workflows" / "ci.yml").read_text())
    (step,) = [s for s in workflow["jobs"]["template-update"]["steps"] if s.get("name") == "Check for a newer template"]
    assert "--trust" not in step["run"]

    def check() -> tuple[str, str]:
        summary = tmp_path / "summary.md"
        summary.unlink(missing_ok=True)
        env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
        proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=dst, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout, summary.read_text() if summary.exists() else ""

    out, summary = check()
    assert "::warning" not in out and "1.0.0 is the newest release" in out and summary == ""
    (tpl / "README.md").write_text((tpl / "README.md").read_text() + "\nA template change.\n")
    git(tpl, "commit", "-qam", "v1.1.0")
    git(tpl, "tag", "v1.1.0")
    out, summary = check()
    assert "::warning title=Template update available::fsdp-template 1.1.0 is out; this repo is on 1.0.0" in out
    assert "copier update --defaults" in summary and "1.1.0" in summary
