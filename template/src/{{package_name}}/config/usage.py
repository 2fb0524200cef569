"""What bad input is (UsageError), how it is reported once per job, and how each config section lists what is
wrong with it (`failed`)."""

from __future__ import annotations

import os

EXIT_USAGE = 2
"""Exit code of the rank that reports bad input (argparse's and tyro's code too); see TROUBLESHOOTING.md."""


class UsageError(ValueError):
    """Bad input: config, command line, data path, checkpoint to resume, or a world size the plan refuses.

    The trainer finds these before the process group starts and prints the message once, without
    a traceback (train.refuse). Any other exception is a bug and keeps its traceback.
    """


JOB_WIDE = {"job_wide": True}
"""`logger.warning(..., extra=JOB_WIDE)`: a warning that every rank would give alike (about the config, the
job or a shared file) is printed once per job, by rank 0 (metrics.init_logging). A warning about one
rank's own state goes without it and comes from each rank that has it."""


def reports_errors() -> bool:
    """Whether this process prints a refusal: local rank 0, so each node's log says why; other ranks exit quietly."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def failed(*rules: tuple[bool, str]) -> list[str]:
    """The messages of the (ok, message) rules that do not hold: how each sub-config lists what is wrong with it."""
    return [message for ok, message in rules if not ok]
