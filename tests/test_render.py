"""Every render of the matrix is a clean, complete Python project."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib

import pytest
import yaml
from answers import MATRIX

# The labelled blocks of a run and the module that holds each: train.py's main() is the table of contents,
# run.build_run the build (the first three blocks, in order), step.py the step, train.py the loop around it.
BLOCKS = {"init_distributed": "run", "build_model_meta": "run", "build_optimizer": "run", "checkpoint_load": "train",
          "train_step": "step", "checkpoint_save": "train"}  # fmt: skip
ORDER = {("train", "main"): ["load_config", "check", "job"],
         ("train", "job"): ["build_run", "checkpoint_load", "train_loop"],
         ("run", "build_run"): ["init_distributed", "build_model_meta", "build_optimizer"],
         ("train", "train_loop"): ["train_step", "validate_and_save"],
         ("train", "validate_and_save"): ["validate", "checkpoint_save"]}  # fmt: skip


def first_calls(function: ast.FunctionDef) -> dict[str, int]:
    """The line of the first call of each name `function` calls."""
    first: dict[str, int] = {}
    for call in ast.walk(function):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            first[call.func.id] = min(call.lineno, first.get(call.func.id, call.lineno))
    return first


def text_files(root):
    caches = {".git", ".ruff_cache", "__pycache__", ".pytest_cache"}
    return [p for p in root.rglob("*") if p.is_file() and not caches.intersection(p.parts)]


@pytest.mark.parametrize("name", MATRIX)
def test_render_compiles_and_is_ruff_clean(rendered, name):
    root = rendered[name]
    for path in root.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")  # raises SyntaxError with the location
    # --no-cache: a .ruff_cache would be one more file in the render for the other tests to read.
    for args in (["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=root, capture_output=True, text=True)
        assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("name", MATRIX)
def test_render_leaves_no_template_syntax(rendered, name):
    for path in text_files(rendered[name]):
        text = path.read_text(errors="ignore")
        assert "{{" not in text and "{%" not in text, path
        assert "{{" not in str(path) and "{%" not in str(path), path


@pytest.mark.parametrize("name", MATRIX)
def test_render_has_the_labelled_blocks_in_order(rendered, name):
    package = yaml.safe_load((rendered[name] / ".copier-answers.yml").read_text())["package_name"]
    functions = {}
    for module in ("train", "run", "step"):
        tree = ast.parse((rendered[name] / "src" / package / f"{module}.py").read_text())
        functions[module] = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert all(f.end_lineno - f.lineno < 60 for f in functions[module].values()), module  # main() too
    assert all(block in functions[module] for block, module in BLOCKS.items())
    for (module, caller), calls in ORDER.items():  # each reads top to bottom in this order
        assert sorted(calls, key=first_calls(functions[module][caller]).get) == calls, caller


@pytest.mark.parametrize("name", MATRIX)
def test_render_configs_parse_and_record_the_answers(rendered, name):
    root = rendered[name]
    answers = yaml.safe_load((root / ".copier-answers.yml").read_text())
    for path in (root / "configs").glob("*.toml"):
        cfg = tomllib.loads(path.read_text())
        assert cfg["parallel"]["sharding"] == answers["sharding"]
        assert cfg["parallel"]["mixed_precision"] == answers["mixed_precision"]
        assert cfg["parallel"]["cpu_offload"] == answers["cpu_offload"]
        # Asked only for DDP; the other modes shard the optimizer state already.
        assert cfg["parallel"].get("zero_optimizer") == answers.get("zero_optimizer")
        assert cfg["dist"]["backend"] == answers["backend"]
        assert cfg["hardware"]["gpus_per_node"] == answers["gpus_per_node"]
    debug = answers["model_size"] in ("debug", "vit-debug", "moe-debug")
    assert (root / "configs" / ("debug.toml" if debug else f"{answers['model_size']}.toml")).is_file()
