"""README.md and docs/ point at things that exist: relative links (and their anchors), the modules
``python -m`` names, the configs ``serve run`` names and the scripts ``bash`` runs. Nothing is executed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PYTHON_M = re.compile(r"\bpython3? -m ([A-Za-z_]\w*(?:\.\w+)*)")
FILE_ARGS = re.compile(r"\b(?:serve run|bash) ((?:[\w.-]+/)*[\w.-]+\.(?:yaml|sh))")


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            problems.append(f"{target}: not a file of this repository")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            problems.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved.name}")
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{name}: {problem}" for problem in problems]


def is_runnable_module(name: str) -> bool:
    """``python -m name`` would find something: a module or a package with ``__main__`` of this
    repository, else an installed top-level module (found by its spec, not imported)."""
    local = ROOT.joinpath(*name.split("."))
    if local.with_suffix(".py").is_file() or (local / "__main__.py").is_file():
        return True
    if (ROOT / name.split(".")[0]).is_dir():
        return False  # one of ours that does not exist (or a package without __main__)
    return "." not in name and importlib.util.find_spec(name) is not None


def test_the_checks_catch_what_they_must(tmp_path):
    assert slug("## Tried, not kept".lstrip("#")) == "tried-not-kept"
    assert slug("The `bench.engine` table") == "the-benchengine-table"
    assert is_runnable_module("bench.engine") and is_runnable_module("bench.serve") and is_runnable_module("pytest")
    assert not is_runnable_module("bench.no_such_bench") and not is_runnable_module("bench")
    assert not is_runnable_module("no_such_module_anywhere")
    doc = ROOT / "docs" / "design.md"
    assert anchors(doc) and "the-worked-example" in anchors(doc)
    outside = tmp_path / "outside.md"
    outside.write_text("[a](missing.md) [b](https://example.org) [c](../../x.md)")
    assert len(broken_links(outside)) == 3


def test_every_relative_link_resolves_inside_the_repository():
    problems = [problem for path in documents() for problem in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_every_python_m_names_a_runnable_module():
    missing = sorted({f"{path.relative_to(ROOT)}: python -m {name}" for path in documents()
                      for name in PYTHON_M.findall(path.read_text()) if not is_runnable_module(name)})
    assert not missing, "\n".join(missing)


def test_every_config_and_script_named_exists():
    missing = sorted({f"{path.relative_to(ROOT)}: {name}" for path in documents()
                      for name in FILE_ARGS.findall(path.read_text()) if not (ROOT / name).is_file()})
    assert not missing, "\n".join(missing)
