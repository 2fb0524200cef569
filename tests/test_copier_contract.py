"""The promises a user and a bot rely on: no --trust, and `copier update` keeps their edits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

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


def run_update_check(dst: Path, tmp_path: Path) -> tuple[str, str]:
    """The generated workflow's template-update step, run as written: what it prints and its job summary."""
    workflow = yaml.safe_load((dst / ".github" / "workflows" / "ci.yml").read_text())
    (step,) = [s for s in workflow["jobs"]["template-update"]["steps"] if s.get("name") == "Check for a newer template"]
    assert "--trust" not in step["run"]
    summary = tmp_path / "summary.md"
    summary.unlink(missing_ok=True)
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=dst, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, summary.read_text() if summary.exists() else ""


def test_generated_ci_reports_a_newer_template(tmp_path):
    """Silent on the newest tag, a warning and a job summary once the template has a newer one."""
    tpl = tagged_template(tmp_path, "v1.0.0")
    dst = committed_render(tpl, tmp_path / "proj", {"accelerator": "cpu", "model_size": "debug"}, "v1.0.0")
    out, summary = run_update_check(dst, tmp_path)
    assert "::warning" not in out and "1.0.0 is the newest release" in out and summary == ""
    (tpl / "README.md").write_text((tpl / "README.md").read_text() + "\nA template change.\n")
    git(tpl, "commit", "-qam", "v1.1.0")
    git(tpl, "tag", "v1.1.0")
    out, summary = run_update_check(dst, tmp_path)
    assert "::warning title=Template update available::fsdp-template 1.1.0 is out; this repo is on 1.0.0" in out
    assert "copier update --defaults" in summary and "1.1.0" in summary


def test_generated_ci_names_commits_when_the_template_has_no_tags(tmp_path):
    """Without release tags copier derives development versions (0.0.0.postN.dev0+<commit>): the step
    says the repo is on a commit that is not a release, and names commits, never those versions."""
    tpl = tagged_template(tmp_path, None)
    dst = committed_render(tpl, tmp_path / "proj", {"accelerator": "cpu", "model_size": "debug"}, "HEAD")
    commit = git(tpl, "rev-parse", "--short", "HEAD").strip()
    out, summary = run_update_check(dst, tmp_path)
    assert f"this repo is on fsdp-template commit {commit}, which is not a release (no tag names it)" in out, out
    assert "0.0.0" not in out and "::warning" not in out and summary == ""
    (tpl / "README.md").write_text((tpl / "README.md").read_text() + "\nA template change.\n")
    git(tpl, "commit", "-qam", "later")
    newer = git(tpl, "rev-parse", "--short", "HEAD").strip()
    out, summary = run_update_check(dst, tmp_path)
    assert f"fsdp-template commit {newer} is out; this repo is on commit {commit}" in out, out
    assert "0.0.0" not in out + summary


def test_one_version_in_pyproject_changelog_and_readme():
    """The template's version lives in pyproject.toml; the CHANGELOG's newest release section, the README
    and the newest release tag (once there is one) agree with it."""
    version = tomllib.loads((TEMPLATE / "pyproject.toml").read_text())["project"]["version"]
    released = re.findall(r"^## (\d+\.\d+\.\d+)\s*$", (TEMPLATE / "CHANGELOG.md").read_text(), re.M)
    assert released and released[0] == version, (released, version)
    assert f"now **{version}**" in (TEMPLATE / "README.md").read_text()
    # A generated repo's answers file names the release it was made from.
    assert f'{{%- set TEMPLATE_VERSION = "{version}" -%}}' in (TEMPLATE / "hooks" / "presets.jinja").read_text()
    try:
        tags = git(TEMPLATE, "tag", "--list", "v*").split()
    except (subprocess.CalledProcessError, FileNotFoundError):  # a copy of the template without its history
        return
    releases = sorted((tuple(map(int, t[1:].split("."))), t) for t in tags if re.fullmatch(r"v\d+\.\d+\.\d+", t))
    if releases:
        assert releases[-1][1] == f"v{version}", f"newest tag {releases[-1][1]}, pyproject.toml says {version}"
