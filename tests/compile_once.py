"""Jinja compiles each template once per test session, not once per render.

Copier builds a Jinja environment for every render, from a fresh clone of the template, and so compiles every
template file and every expression of copier.yml again (an interactive session, again for each question): two
thirds of a render's time, and the tests render a few hundred times. Compiled code depends only on the source,
its name and the environment's settings, not on the clone's path (only the code's filename, for tracebacks), so
`install()` makes Environment.compile remember what it compiled. The tests' renders import this through
conftest.py; tests/terminal.py starts copier's command line with it (`python -m compile_once copy ...`).
"""

from __future__ import annotations

import functools
import sys

from jinja2 import Environment


def install() -> None:
    """Make every Jinja environment of this process share compiled code (once; later calls do nothing)."""
    if getattr(Environment.compile, "compiled_once", False):
        return
    compile_source, codes = Environment.compile, {}

    @functools.wraps(compile_source)
    def compile_once(env, source, name=None, filename=None, raw=False, defer_init=False):
        settings = (type(env), env.block_start_string, env.block_end_string, env.variable_start_string,
                    env.variable_end_string, env.comment_start_string, env.comment_end_string,
                    env.line_statement_prefix, env.line_comment_prefix, env.trim_blocks, env.lstrip_blocks,
                    env.newline_sequence, env.keep_trailing_newline, tuple(sorted(env.extensions)), env.undefined,
                    env.finalize, env.autoescape, env.optimized, env.is_async)  # fmt: skip
        key = (settings, source, name, raw, defer_init)
        if key not in codes:
            codes[key] = compile_source(env, source, name, filename, raw, defer_init)
        return codes[key]

    compile_once.compiled_once = True
    Environment.compile = compile_once


if __name__ == "__main__":  # copier's command line, sharing compiled code between its renders
    from copier.__main__ import CopierApp

    install()
    sys.argv[0] = "copier"
    sys.exit(CopierApp.run())
