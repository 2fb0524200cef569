"""One typed config tree. Precedence: command line > TOML file > the defaults.

    torchrun --nproc_per_node 2 -m <package>.train --config configs/debug.toml --train.steps 100

Every field has one line of documentation, which is also its `--help` text. Values are checked
before anything is allocated, in two stages: here, each sub-config's `errors()` says what is wrong
with its own fields and `Config.cross_errors` what two of them cannot be together (`validate`
runs both when the config is loaded); at launch, preflight.py checks the config against the
world size, the devices and the files. A bad value raises UsageError naming the field and the fix.

`[model]` belongs to the model it names: `model.name` picks a module in models/, and the table
is read into that module's own dataclass of hyperparameters (its SPEC.config), so `--help` lists
that model's fields. `--model.name` on the command line picks another model; the fields of the
file's `[model]` table that the other model also has are kept, the rest describe the file's
model and are left out. This package imports the model registry; nothing in models/ imports it.

The package: sections.py holds the sections (`[train]`, `[parallel]`, ...), tree.py the root `Config`
and the rules between sections, load.py the reading, usage.py `UsageError` and how it is reported.
"""

from .load import config_file, load_config
from .sections import (
    CheckpointConfig,
    DataConfig,
    DistConfig,
    EvalConfig,
    FinetuneConfig,
    HardwareConfig,
    MetricsConfig,
    ParallelConfig,
    Precision,
    Sharding,
    TrainConfig,
)
from .tree import DEFAULT_MODEL, Config
from .usage import EXIT_USAGE, JOB_WIDE, UsageError, failed, reports_errors

__all__ = [
    "DEFAULT_MODEL",
    "EXIT_USAGE",
    "JOB_WIDE",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "EvalConfig",
    "FinetuneConfig",
    "HardwareConfig",
    "MetricsConfig",
    "ParallelConfig",
    "Precision",
    "Sharding",
    "TrainConfig",
    "UsageError",
    "config_file",
    "failed",
    "load_config",
    "reports_errors",
]
