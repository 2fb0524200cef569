"""Drive `copier copy` the way a person does: in a pseudo-terminal of 80 x 24, reading each prompt
and answering with keystrokes (arrow keys, Enter, typing). Copier validates typed answers and shows
choices whose validator fails as disabled; these tests see exactly what a user sees.

Copier's prompt library (questionary on prompt_toolkit) cuts a line at the terminal's edge instead
of wrapping it, and shows a typed answer's refusal on one line. It draws the last column apart (a
return, then the cursor moved to it), so a line that reaches it cannot be told from one it cut:
every line must leave it free (`fits`). A session records each line that reached it
(`CopierSession.too_wide`), and `shown_lines` lists every line the questions show for a set of
answers, so a test can hold each to the width."""

from __future__ import annotations

import os
import re
import sys
import unicodedata
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import copier
import pexpect
import yaml

TEMPLATE = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]|\r")
QMARK = "🎤"
DOWN, UP, ENTER, CLEAR_LINE = "\x1b[B", "\x1b[A", "\r", "\x15"
REDRAW = "\x0c"  # Ctrl-L: prompt_toolkit clears the screen and draws the prompt again
COLUMNS, ROWS = 80, 24
"""The terminal the questions are written for: every help line, choice and refusal fits its width."""
LAST_COLUMN = re.compile(rf"[\r\n]\x1b\[{COLUMNS - 1}C")
"""How prompt_toolkit draws a line that reaches the last column: a carriage return or newline, then the cursor
moved to it."""


def columns(line: str) -> int:
    """How many terminal columns `line` takes (an emoji such as the prompt's microphone takes two)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in line)


def fits(line: str) -> bool:
    """Whether `line` is shown whole in a COLUMNS-wide terminal: the last column stays free."""
    return columns(line) < COLUMNS


def choice_labels(name: str) -> dict:
    """A pick-from-list question's choices: value -> label, from copier.yml."""
    choices = yaml.safe_load((TEMPLATE / "copier.yml").read_text())[name]["choices"]
    if isinstance(choices, list):
        return {c: str(c) for c in choices}
    return {spec["value"] if isinstance(spec, dict) else spec: label for label, spec in choices.items()}


def refusal_line(question: str, value, message: str) -> str:
    """The line a terminal shows for an answer that `copier copy -d question=value` refuses with `message`:
    a disabled choice as questionary draws it, or a typed answer's refusal, which copier words alike."""
    prefix = f"Invalid choice for '{question}': "
    if message.startswith(prefix):
        return f"   - {choice_labels(question)[value]} ({message.removeprefix(prefix)})"
    return message


def question_prefixes() -> dict[str, str]:
    """The literal start of each question's help (what the prompt shows first) -> its name."""
    questions = yaml.safe_load((TEMPLATE / "copier.yml").read_text())
    prefixes = {}
    for name, spec in questions.items():
        if name.startswith("_"):
            continue
        prefix = re.split(r"\{\{|\{%", " ".join(spec["help"].split()))[0][:24]
        assert prefix not in prefixes, f"{name} and {prefixes[prefix]} start their help alike"
        prefixes[prefix] = name
    return prefixes


@dataclass
class Choice:
    label: str
    disabled: str = ""
    """The reason the choice cannot be picked, as the prompt shows it; empty when it can."""
    whole: bool = True
    """Whether the reason is on screen to its end (a line longer than the terminal is cut)."""


@dataclass
class Prompt:
    name: str
    text: str
    choices: list[Choice] = field(default_factory=list)
    pointer: int = -1
    """Index of the highlighted choice (the default) in a pick-from-list prompt."""

    def choice(self, label_start: str) -> Choice:
        # An exact label wins over labels it starts (dcp beside dcp_async).
        found = [c for c in self.choices if c.label == label_start] or [
            c for c in self.choices if c.label.startswith(label_start)
        ]
        assert len(found) == 1, (label_start, self.choices)
        return found[0]


class CopierSession:
    """One interactive `copier copy --vcs-ref HEAD <template> <dst>`."""

    def __init__(self, dst: Path, home: Path, *extra: str):
        # copier's command line, in a process whose renders share compiled Jinja code (tests/compile_once.py).
        env = {
            **os.environ,
            "PYTHONPATH": str(Path(__file__).parent),
            "TERM": "xterm",
            "HOME": str(home),
            "COPIER_SETTINGS_PATH": str(home / "none.yml"),
            "PROMPT_TOOLKIT_NO_CPR": "1",
        }
        args = ["-m", "compile_once", "copy", "--vcs-ref", "HEAD", *extra, str(TEMPLATE), str(dst)]
        self.child = pexpect.spawn(sys.executable, args,
                                   env=env, encoding="utf-8", dimensions=(ROWS, COLUMNS), timeout=120)  # fmt: skip
        self.prefixes = question_prefixes()
        self.raw = ""  # everything printed so far
        self.screen = ""  # the same, escape codes removed
        self.asked: list[str] = []
        self.current: Prompt | None = None

    def _read_until_quiet(self, quiet: float = 0.5) -> str:
        chunk = ""
        while True:
            try:
                chunk += self.child.read_nonblocking(65536, timeout=quiet)
            except pexpect.TIMEOUT:
                break
            except pexpect.EOF:
                break
        self.raw += chunk
        text = ANSI.sub("", chunk)
        self.screen += text
        return text

    def too_wide(self) -> list[str]:
        """The lines the session drew to the terminal's last column (prompt_toolkit cuts longer ones there), with
        what came before them; and the lines of the message printed after copying (which the terminal wraps) that
        reach it, but for the one naming the destination."""
        wide = [ANSI.sub("", self.raw[max(0, m.start() - 2000) : m.start()]).rsplit("\n", 1)[-1]
                for m in LAST_COLUMN.finditer(self.raw)]  # fmt: skip
        _, found, message = self.screen.partition("Your FSDP2 training repo")
        lines = (found + message).split("\n") if found else []
        return wide + [line for line in lines if not fits(line) and " cd /" not in line]

    def next_prompt(self) -> Prompt | None:
        """Wait for the next question (None once copier has exited) and parse what it shows."""
        previous = self.current.name if self.current else None
        for _ in range(200):  # a minute of quiet reads at most
            self._read_until_quiet(0.3)
            tail = self.screen.rsplit(QMARK, 1)[-1] if QMARK in self.screen else ""
            name = self._name(tail)
            if name and name != previous:
                break
            if not self.child.isalive():
                self.child.expect(pexpect.EOF)
                self.current = None
                return None
        else:
            raise AssertionError(f"no new question after {previous}; the terminal shows:\n{self.screen[-3000:]}")
        self.current = self._parse(name, tail)
        self.asked.append(name)
        return self.current

    def _name(self, text: str) -> str | None:
        flat = " ".join(text.split())
        for prefix, name in self.prefixes.items():
            if flat.startswith(prefix):
                return name
        return None

    def _parse(self, name: str, text: str) -> Prompt:
        prompt = Prompt(name, text)
        lines = [line for line in text.split("\n")[1:] if line.strip()]
        start = next((i for i, line in enumerate(lines) if "(Use arrow keys" in line), None)  # after the help's lines
        if start is None:
            return prompt
        labels = sorted(self._labels(name), key=len, reverse=True)
        for line in lines[start + 1 :]:
            body = line[3:]
            disabled = body.startswith("- ")
            body = body[2:] if disabled else body
            label = next((lb for lb in labels if body.startswith(lb)), body.strip())
            # questionary shows a disabled choice as "- <label> (<reason>)"; a reason cut at the
            # terminal's edge has no closing parenthesis.
            shown = body[len(label) :].strip()
            reason = shown.removeprefix("(").removesuffix(")") if disabled else ""
            prompt.choices.append(
                Choice(label, reason or ("disabled" if disabled else ""), not disabled or shown.endswith(")"))
            )
            if line.startswith(" » "):
                prompt.pointer = len(prompt.choices) - 1
        return prompt

    @staticmethod
    def _labels(name: str) -> list[str]:
        choices = yaml.safe_load((TEMPLATE / "copier.yml").read_text())[name]["choices"]
        return [str(c) for c in choices] if isinstance(choices, list) else list(choices)

    # -- answering ----------------------------------------------------------------------------

    def accept(self) -> None:
        """Enter: take the default."""
        self.child.send(ENTER)

    def pick(self, label_start: str) -> None:
        """Move the highlight to the choice whose label starts with `label_start` and press Enter."""
        prompt = self.current
        target = prompt.choices.index(prompt.choice(label_start))
        assert not prompt.choices[target].disabled, f"{label_start} is disabled: {prompt.choices[target].disabled}"
        # questionary skips disabled choices, so each press moves to the next enabled one.
        lo, hi = sorted((prompt.pointer, target))
        moves = sum(1 for c in prompt.choices[lo : hi + 1] if not c.disabled) - 1  # the highlighted one is enabled
        self.child.send((DOWN if target > prompt.pointer else UP) * moves + ENTER)

    def type(self, value: str) -> str:
        """Replace the text of a typed prompt with `value` and press Enter; the validator's
        message if copier refused it (the prompt stays), else ""."""
        # prompt_toolkit redraws only the cells that change, so a second refusal in a row would show only where
        # its message differs from the first: Ctrl-L, handled once the validator has run (it may take seconds:
        # the planner), redraws the whole prompt, message included (or the next question, harmlessly).
        self.child.send(CLEAR_LINE + value + ENTER + REDRAW)
        shown, silent = "", 0
        for _ in range(240):  # two minutes at most
            new = self._read_until_quiet()
            shown, silent = shown + new, 0 if new else silent + 1
            tail = shown.rsplit(QMARK, 1)[-1] if QMARK in shown else shown
            if "Validation error" in tail or "Invalid input" in tail:
                shown += self._read_until_quiet()  # the redraw, if it came after: the message in full
                tail = shown.rsplit(QMARK, 1)[-1]
                return " ".join(tail.split())
            name = self._name(tail)
            if (name and name != self.current.name) or not self.child.isalive() or silent == 20:
                return ""  # another question, copier done, or a refusal shown blank (a checkbox's)
        raise AssertionError(f"{self.current.name}: no answer to {value!r}; the terminal shows:\n{self.screen[-3000:]}")

    def confirm(self, yes: bool) -> None:
        self.child.send("y" if yes else "n")

    def finish(self, answer=None) -> int:
        """Answer every remaining question with `answer(prompt)` (default: Enter) until copier exits."""
        while (prompt := self.next_prompt()) is not None:
            (answer or (lambda p: self.accept()))(prompt)
        self.child.close()
        return self.child.exitstatus


def shown_lines(wanted: dict, dst: Path) -> list[tuple[str, str]]:
    """(question, line) for each line `copier copy` shows a user who answers yes to `customize`, `wanted`
    where given and the default elsewhere: every help line, every choice (disabled ones with their
    reason) and the refusal of an answer copier refuses (the default is taken instead). Copier builds
    each prompt as it would for the terminal; only the keystrokes are left out."""
    shown: list[tuple[str, str]] = []

    def prompt(questions: list[dict], answers: dict) -> dict:  # questionary's unsafe_prompt, as copier calls it
        (q,) = questions
        name, default = q["name"], answers[q["name"]]
        if not q["when"](answers):  # a question its `when` skips: questionary keeps the default, shows nothing
            return {name: default}
        answer = wanted.get(name, True if name == "customize" else default)
        help_lines = q["message"].rstrip().split("\n")
        shown.extend((name, f"{q['qmark']} {line}" if i == 0 else line) for i, line in enumerate(help_lines))
        if q["type"] == "select":
            for c in q["choices"]:
                shown.append((name, f"   - {c.title} ({c.disabled})" if c.disabled else f"   {c.title}"))
            allowed = [c.value for c in q["choices"] if not c.disabled]
            return {name: answer if answer in allowed else default}
        if q["type"] == "checkbox":
            shown.extend((name, f"   ○ {c.title}") for c in q["choices"])
        if q["type"] == "confirm":
            return {name: answer}
        typed = answer if q["type"] == "checkbox" else str(answer)
        verdict = q["validate"](typed)
        if verdict is not True:
            shown.append((name, verdict))
            return {name: default}
        return {name: typed if q["type"] == "checkbox" else q["filter"](typed)}

    with mock.patch("copier._main.unsafe_prompt", prompt), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DirtyLocalWarning while developing the template
        copier.run_copy(str(TEMPLATE), str(dst), defaults=False, unsafe=False, settings=copier.Settings(),
                        vcs_ref="HEAD", quiet=True, pretend=True)  # fmt: skip
    return shown
