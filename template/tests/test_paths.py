"""Every file, module and flag this repo's words name exists in this repo.

Read: README.md, PLAN.md, TROUBLESHOOTING.md, FSDP1_TO_FSDP2.md and the READMEs of tests/ and src/ whole, the
comments of configs/*.toml, scripts/* and k8s/*.yaml, and every docstring (ast) and comment (tokenize) in src/. A
word is what lies between spaces, backticks, quotes, brackets, commas, `=` and `|`, less trailing punctuation, `'s`
and `::test_name`; `<placeholder>` and `*` match any name. Checked:

- A path: a word whose last part ends in a source suffix (SOURCE), or that holds a `/` and starts with a folder of
  the repo or of src/<pkg>/ (configs/, tests/, models/, plan/, ...). It exists under the repo, under src/<pkg>/ or
  under a folder from src/<pkg>/ down to the naming file's; a bare name (no `/`) anywhere in the repo. Not paths:
  URLs, absolute, home and shell-variable paths, and words whose first part the repo lacks or whose suffix is
  another (runs/..., data/train.bin, export/config.json): a run or the user makes those.
- A module: `<pkg>.a.b` (`python -m <pkg>.plan`): its longest prefix that is a module exists, and what follows is
  a name that module defines or imports.
- A flag: `--section.key` is a field of the config tree (any model's `[model]` for `--model.`); `--word` is one that
  an add_argument call in src/ declares, or an outside tool's (OUTSIDE).

A word right after "the template's" names a file of the template, which a user does not receive: the template's
tests/test_docs.py checks those against the template.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import io
import os
import posixpath
import re
import tokenize
import typing
from importlib import import_module
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
PKG = next(p for p in (ROOT / "src").iterdir() if (p / "__init__.py").is_file())
PKG_DIR = PKG.relative_to(ROOT).as_posix()
DOCS = ["README.md", "PLAN.md", "TROUBLESHOOTING.md", "FSDP1_TO_FSDP2.md"]
SOURCE = {".py", ".toml", ".md", ".sh", ".sbatch", ".yaml", ".yml", ".jinja", ".cfg"}
# The flags of torchrun, copier, SLURM, nvidia-smi, xpu-smi, tensorboard, ruff, py-spy and pip that the docs use.
OUTSIDE = {
    "--nproc_per_node", "--nnodes", "--node_rank", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--standalone",
    "--max-restarts", "--shutdown-timeout", "--defaults", "--trust", "--vcs-ref", "--data-file", "--time",
    "--partition", "--mem", "--requeue", "--signal", "--exclusive", "--cpus-per-task", "--query-gpu", "--format",
    "--dump", "--logdir", "--check", "--pid", "--help", "--index-url",
}  # fmt: skip
# What the user makes: the answers `--out` writes, a tokenizer's chat template, the field README.md's example adds,
# the shape of an override.
USERS = {"hw.yml", "chat_template.jinja", "--model.dropout", "--section.key"}
TEMPLATE_FILE = re.compile(r"(?:[Tt]he\s+|fsdp-)template's\s+`?[^\s`]+")
COMMENT = re.compile(r"(?:^|\s)#(?!!|SBATCH).*")  # a TOML, shell or YAML comment; not #! or SLURM's #SBATCH
PLACEHOLDER = re.compile(r"<[^<>\n]{1,40}>")
WORD = re.compile(r"[^\s`'\"()\[\]{},;=|]+")


def repo() -> tuple[set[str], set[str]]:
    """The repo's files and its folders, relative to it: not what .gitignore names (runs/, .venv/) or a hidden
    folder but .github holds."""
    ignored = {line.strip("/") for line in (ROOT / ".gitignore").read_text().split()}
    files, folders = set(), set()
    for folder, subs, names in os.walk(ROOT):
        subs[:] = [d for d in subs if d not in ignored and (d == ".github" or not d.startswith("."))]
        rel = Path(folder).relative_to(ROOT)
        files |= {(rel / name).as_posix() for name in names}
        folders |= {(rel / name).as_posix() for name in subs}
    return files, folders


FILES, FOLDERS = repo()
# The first parts of the repo's paths; data/ at the top is also where the user's data goes.
TOPS = {f.removeprefix(PKG_DIR + "/") for f in FOLDERS if "/" not in f.removeprefix(PKG_DIR + "/")} - {"data"}


def texts() -> list[tuple[str, str, str]]:
    """(where, the folder of the file, the text) for each text read."""
    out = [(doc, "", (ROOT / doc).read_text()) for doc in DOCS]
    for path in [*ROOT.glob("tests/README.md"), *sorted(PKG.rglob("README.md"))]:  # each beside what it describes
        out.append((path.relative_to(ROOT).as_posix(), path.parent.relative_to(ROOT).as_posix(), path.read_text()))
    for path in [*ROOT.glob("configs/*.toml"), *ROOT.glob("scripts/*"), *ROOT.glob("k8s/*.yaml")]:
        lines = enumerate(path.read_text().splitlines(), 1)
        out += [(f"{path.relative_to(ROOT)}:{i}", "", c[0]) for i, line in lines if (c := COMMENT.search(line))]
    for path in sorted(PKG.rglob("*.py")):
        source, where, here = path.read_text(), path.relative_to(ROOT), path.parent.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str):
                out.append((f"{where}:{node.lineno}", here, node.value.value))
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        out += [(f"{where}:{t.start[0]}", here, t.string) for t in tokens if t.type == tokenize.COMMENT]
    return out


def path_exists(word: str, here: str) -> bool | None:
    """Whether the path `word`, named in folder `here`, exists; None when `word` is no path of the repo."""
    word = word.split("::")[0].removeprefix("./")
    if "://" in word or "$" in word or word.startswith(("/", "~")) or not re.search(r"[\w*]", word):
        return None
    path = word.rstrip("/")
    parts, suffix = path.split("/"), PurePosixPath(path).suffix
    if suffix not in SOURCE and (suffix or len(parts) == 1 or parts[0] not in TOPS):
        return None
    entries = FOLDERS if word.endswith("/") else FILES | FOLDERS
    if len(parts) == 1:
        return bool(fnmatch.filter({e.rsplit("/", 1)[-1] for e in entries}, path))
    up = here.split("/") if here.startswith(PKG_DIR) else []
    bases = {"", PKG_DIR, *("/".join(up[:n]) for n in range(3, len(up) + 1))}
    return any(fnmatch.filter(entries, posixpath.normpath(posixpath.join(base, path))) for base in bases)


def module_exists(name: str) -> bool:
    """Whether `name` (<pkg>.a.b) is a module of src/, or a name that one defines or imports at its top level."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath("src", *parts[:n])
        for file in (base / "__init__.py", base.with_suffix(".py")):
            if file.is_file():
                body = ast.parse(file.read_text()).body
                top = {a.asname or a.name for node in body for a in getattr(node, "names", [])}
                top |= {getattr(t, "id", getattr(t, "name", "")) for node in body
                        for t in [node, getattr(node, "target", node), *getattr(node, "targets", [])]}  # fmt: skip
                return parts[n:] == [] or (len(parts) == n + 1 and parts[n] in top)
    return False


def flags() -> set[str]:
    """`--section.key` for every field of the config tree (`[model]`'s of every model here), and every flag that an
    add_argument call in src/ declares."""

    def fields(cls: type, prefix: str) -> set[str]:
        hints, out = typing.get_type_hints(cls), set()
        for f in dataclasses.fields(cls):
            sub = hints[f.name]
            out |= fields(sub, f"{prefix}{f.name}.") if dataclasses.is_dataclass(sub) else {f"--{prefix}{f.name}"}
        return out

    models = import_module(f"{PKG.name}.models")
    found = fields(import_module(f"{PKG.name}.config").Config, "")
    found |= {flag for name in models.MODELS for flag in fields(models.model_spec(name).config, "model.")}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                found |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return found


def test_every_path_module_and_flag_named_exists():
    known, missing = flags() | OUTSIDE | USERS, []
    for where, here, text in texts():
        text = PLACEHOLDER.sub("*", TEMPLATE_FILE.sub("", text))
        for word in WORD.findall(text):
            word = re.sub(r"('s)?[.,:;!?]*$", "", word)
            if word not in USERS and path_exists(word, here) is False:
                missing.append(f"{where}: {word} (no such file)")
        for name in re.findall(rf"(?<![\w/.]){PKG.name}(?:\.\w+)+", text):
            if not module_exists(name):
                missing.append(f"{where}: {name} (no such module)")
        for flag in re.findall(r"(?<![\w-])--[A-Za-z][\w.*-]*[\w*]", text):
            if not fnmatch.filter(known, flag):
                missing.append(f"{where}: {flag} (no such flag)")
    assert not missing, f"what this repo lacks ({len(missing)}):\n" + "\n".join(missing)
