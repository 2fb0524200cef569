"""The generated PLAN.md is specific to the answers, and every link in the generated docs is well formed."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
from answers import MATRIX
from conftest import TEMPLATE

DOCS = ["PLAN.md", "TROUBLESHOOTING.md", "FSDP1_TO_FSDP2.md", "README.md"]
# "the template's hooks/plan.jinja": a file of the template, which a user does not receive (template/tests/test_paths.py
# leaves these to test_the_template_files_a_render_names_exist).
TEMPLATE_FILE = re.compile(r"(?:[Tt]he\s+|fsdp-)template's\s+`?([^\s`]+)")
HOSTS = {"docs.pytorch.org", "arxiv.org", "github.com", "download.pytorch.org"}  # the last: pip's index of torch builds
DECISIONS = ["Memory per rank", "Host memory per node", "Fine-tuning", "Sharding", "Tensor parallelism",
             "Context parallelism",
             "reshard_after_forward", "Mixed precision", "CPU offload", "Activation checkpointing", "float8",
             "torch.compile", "Backend",
             "Rendezvous", "Initialisation", "Gradient accumulation", "Data and uneven inputs", "Checkpoints",
             "What to change if"]  # fmt: skip


def docs(root):
    """A render's documents: DOCS, and the READMEs beside the tests, the models and the data sources."""
    return [root / doc for doc in DOCS] + sorted(root.glob("tests/README.md")) + sorted(root.glob("src/*/**/README.md"))


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, spaces to hyphens, only letters, digits, `_` and `-` kept."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {part.split("\n", 1)[0].split(":")[0].strip(): part for part in parts}


def test_plan_covers_every_decision_with_a_docs_link(rendered):
    for name, root in rendered.items():
        found = sections((root / "PLAN.md").read_text())
        for decision in DECISIONS:
            assert any(title.startswith(decision) for title in found), (name, decision)


def test_plan_sections_are_not_boilerplate(rendered):
    # Every decision section reads differently in at least two renders of the matrix.
    texts = {name: sections((root / "PLAN.md").read_text()) for name, root in rendered.items()}
    for decision in DECISIONS:
        variants = {next(v for k, v in s.items() if k.startswith(decision)) for s in texts.values()}
        assert len(variants) > 1, f"PLAN.md section '{decision}' is identical in every render"


def test_plan_numbers_come_from_the_answers(rendered):
    plan = (rendered["ada_offload"] / "PLAN.md").read_text()
    assert "2 cuda GPUs** of 48 GiB" in plan and "## CPU offload: yes" in plan and "43.2 GiB" in plan


@pytest.mark.parametrize("name", MATRIX)
def test_links_are_well_formed(rendered, name):
    for path in docs(rendered[name]):
        doc, text = path.name, path.read_text()
        for url in re.findall(r"https?://[^\s)>\]`]+", text):
            parsed = urlparse(url)
            assert parsed.scheme == "https", url
            assert parsed.netloc in HOSTS, url
            assert re.fullmatch(
                r"[A-Za-z0-9/._#-]+", parsed.path + ("#" + parsed.fragment if parsed.fragment else "")
            ), url
        assert text.count("](") == len(re.findall(r"\]\([^)\s]+\)", text)), f"{doc}: a markdown link is broken"
        # A link to a heading of the same document, or to a heading of another document of the render, exists.
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            linked = (path.parent / target) if target else path
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"{name}: {path.name}: no heading for {target}#{anchor}"


def test_plan_explains_a_mixture_of_experts_and_its_degree(rendered):
    # Qwen3-30B-A3B on 8 x H100: the active parameters, what expert parallelism 8 holds and sends, every degree's
    # estimate; the debug MoE on CPU ranks says why it plans none; dense renders have no such section.
    moe = sections((rendered["moe_30b_h100"] / "PLAN.md").read_text())["Mixture of experts"]
    assert "**30.53B parameters, of which a token is multiplied by\n3.35B**" in moe
    assert "| **8** | 1 | selective, shard_grad_op, no |" in moe and "The planner picks" in moe and "**8**." in moe
    assert "dispatch buffers" in moe and "448.0 MiB per layer" in moe
    cpu = sections((rendered["cpu_moe"] / "PLAN.md").read_text())["Mixture of experts"]
    assert "CPU ranks gain nothing from it" in cpu
    assert "Mixture of experts" not in sections((rendered["default"] / "PLAN.md").read_text())


@pytest.mark.parametrize("name", ["default", "xpu", "vit_base", "volta_pcie_fp16", "cpu_moe"])
def test_the_readme_layout_names_every_module(rendered, name):
    """The generated README's file table is the list of what exists: every module and package of src/<pkg>."""
    root = rendered[name]
    package = next(p for p in (root / "src").iterdir() if p.is_dir())
    readme = (root / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    for path in sorted(package.iterdir()):
        if path.name.startswith("__") or path.name.endswith(".pyc"):
            continue
        named = f"src/{package.name}/{path.name}" + ("/" if path.is_dir() else "")
        assert f"`{named}`" in layout, f"README.md's Layout does not name {named}"


def test_the_template_files_a_render_names_exist(rendered):
    """What a render calls "the template's" file (its README, PLAN.md, TROUBLESHOOTING.md, sources, configs and
    scripts) exists here; and no render names the design document, which neither it nor the template holds."""
    named, missing = set(), []
    for name, root in rendered.items():
        for path in [*docs(root), *root.glob("src/**/*.py"), *root.glob("configs/*"), *root.glob("scripts/*")]:
            text = path.read_text()
            assert "DESIGN" not in text, f"{name}: {path.relative_to(root)} names DESIGN"
            for word in TEMPLATE_FILE.findall(text):
                word = re.sub(r"('s)?[.,:;!?)]*$", "", word)
                if "/" in word or "." in word:  # a path, not "the template's default"
                    named.add(word)
                    if not (TEMPLATE / word).exists():
                        missing.append(f"{name}: {path.relative_to(root)}: {word}")
    assert not missing, "not in the template:\n" + "\n".join(missing)
    assert {"hooks/plan.jinja", "hwprobe.py", "copier.yml"} <= named, named
