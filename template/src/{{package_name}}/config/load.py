"""Reading the config: the defaults, then a TOML file (`--config FILE`), then the command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import io
import tomllib
import typing
from pathlib import Path
from typing import Literal

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from ..models import ModelConfig, model_spec
from .tree import DEFAULT_MODEL, Config
from .usage import UsageError, reports_errors


def _from_dict(cls: type, data: dict, where: str):
    """Build dataclass `cls` from a TOML table, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}{key}"
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean '{where}{close[0]}'?" if close else "--help lists every key"
            raise UsageError(f"unknown config key '{name}' ({hint})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise UsageError(f"config key '{name}' must be a table")
            kwargs[key] = _from_dict(hint, value, f"{name}.")
        else:
            kwargs[key] = _check_type(name, hint, value)
    return cls(**kwargs)


def _model_from_table(table: object, chosen: str | None) -> ModelConfig:
    """`[model]` read into the hyperparameters of the model it names, or of `chosen` (--model.name) with the
    table's fields that model also has."""
    if not isinstance(table, dict):
        raise UsageError("config key 'model' must be a table")
    named = table.get("name", DEFAULT_MODEL)
    name = chosen or named
    try:
        cls = model_spec(name).config
    except ValueError as error:
        raise UsageError(str(error)) from None
    if name != named:
        fields = {f.name for f in dataclasses.fields(cls)}
        table = {key: value for key, value in table.items() if key in fields}
    return _from_dict(cls, {**table, "name": name}, "model.")


def _check_type(name: str, hint, value):
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise UsageError(f"config key '{name}' = {value!r} is not one of {list(typing.get_args(hint))}")
        return value
    if origin is tuple:
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise UsageError(f"config key '{name}' = {value!r} should be {hint.__name__}")
    return value


TOML_BOOLS = ConstructorRegistry()
"""The command line reads a bool as TOML writes one (`--model.tie_embeddings false`), and as Python does (False)."""


@TOML_BOOLS.primitive_rule
def _toml_bool(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    if info.type is not bool:
        return None
    return PrimitiveConstructorSpec(
        nargs=1, metavar="{true,false}", choices=("true", "false", "True", "False"),
        instance_from_str=lambda args: args[0] in ("true", "True"), is_instance=lambda value: isinstance(value, bool),
        str_from_instance=lambda value: [str(value).lower()],
    )  # fmt: skip


def _quiet_unless_reporting() -> contextlib.AbstractContextManager:
    """Drop this process's output unless it is the rank that reports errors (reports_errors)."""
    stack = contextlib.ExitStack()
    if not reports_errors():
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


TRAIN = f"python -m {__package__.rpartition('.')[0]}.train"
"""The trainer's command, as its help and tyro's refusals name it: `TRAIN --help` lists every flag."""


def _pre_parser() -> argparse.ArgumentParser:
    """The flags read before the config tree: the file, the modes, and the model whose fields the rest are."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None, help="TOML file with the run's settings")
    pre.add_argument("--eval-only", action="store_true", help="evaluate a checkpoint once (eval.only)")
    pre.add_argument("--check-only", action="store_true", help="check the inputs and exit (dist.check_only)")
    # Read first: it decides which dataclass [model] and the --model.* flags are read into.
    pre.add_argument("--model.name", dest="model_name", default=None, help=argparse.SUPPRESS)
    return pre


def config_file(argv: list[str] | None = None) -> Path | None:
    """The `--config FILE` of a command line (None: none), for the commands a run suggests next."""
    return _pre_parser().parse_known_args(argv)[0].config


def load_config(argv: list[str] | None = None) -> Config:
    """Parse `--config FILE` and the overrides that follow it."""
    args, rest = _pre_parser().parse_known_args(argv)
    table = {}
    if args.config is not None:
        if not args.config.is_file():
            raise UsageError(f"--config {args.config}: no such file")
        with args.config.open("rb") as f:
            table = tomllib.load(f)
    model = _model_from_table(table.pop("model", {}), args.model_name)
    base = dataclasses.replace(_from_dict(Config, table, ""), model=model)
    if args.eval_only:
        base = dataclasses.replace(base, eval=dataclasses.replace(base.eval, only=True))
    if args.check_only:
        base = dataclasses.replace(base, dist=dataclasses.replace(base.dist, check_only=True))
    with _quiet_unless_reporting():  # tyro prints its own refusals (and --help), then exits with EXIT_USAGE
        cfg = tyro.cli(
            Config,
            prog=TRAIN,  # not the file: run as a script, its relative imports fail
            default=base,
            args=rest,
            description="Train with FSDP2. --config FILE loads a TOML file; flags below override it.",
            config=(tyro.conf.FlagConversionOff,),
            registry=TOML_BOOLS,
        )
    return cfg.validate()
