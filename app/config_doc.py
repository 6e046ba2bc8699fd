"""The configuration reference (docs/configuration.md), generated from the config chain's dataclasses.

    python -m app.config_doc            print the generated tables
    python -m app.config_doc --write    rewrite them in docs/configuration.md

Each layer of the chain (engine.config.EngineConfig <- actors.config.WorkerConfig <- app.config.AppConfig)
gets one table of the fields it declares: name, type, default, and what the field does, read from the
class's docstring. A field's text is the docstring's run of sentences that begins with the field's name in
double backquotes (``name`` ... up to the next sentence that begins with another field's name), so the
docstring stays the one place a field is described. ``tests/app/test_config_doc.py`` fails when the
document and the dataclasses disagree, or a field has no text.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

from app.config import AppConfig

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BEGIN = "<!-- begin generated: python -m app.config_doc --write -->"
END = "<!-- end generated -->"
# A sentence starts after ". " or "; " (or at the docstring's start) and may open with ``a`` / ``b``.
_SENTENCE = re.compile(r"(?:^|(?<=[.;])\s+)(?=``)")
_LEADING_NAMES = re.compile(r"^``(\w+)``(?:\s*/\s*``(\w+)``)*")


def config_chain() -> list[type]:
    """The config dataclasses from the bottom of the chain up: EngineConfig, WorkerConfig, AppConfig."""
    return [cls for cls in reversed(AppConfig.__mro__) if dataclasses.is_dataclass(cls)]


def own_fields(cls: type) -> list[dataclasses.Field]:
    """The fields ``cls`` declares itself (each field is declared once, in one layer)."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return [f for f in dataclasses.fields(cls) if f.name not in inherited]


def field_texts(cls: type) -> dict[str, str]:
    """Field name -> its text in ``cls``'s docstring (see the module's docstring)."""
    names = {f.name for f in dataclasses.fields(cls)}
    text = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
    texts: dict[str, str] = {}
    current: list[str] = []
    for chunk in _SENTENCE.split(text):
        leading = _leading_names(chunk) & names
        if leading:
            current = sorted(leading)
        for name in current:
            texts[name] = f"{texts.get(name, '')} {chunk}".strip()
    return texts


def _leading_names(chunk: str) -> set[str]:
    match = _LEADING_NAMES.match(chunk)
    return set(re.findall(r"``(\w+)``", match.group(0))) if match else set()


def default_of(field: dataclasses.Field) -> str:
    default = field.default
    default = getattr(default, "default", default)  # pydantic's Field(...) keeps it one level down
    return "required" if default is dataclasses.MISSING else f"`{default!r}`"


def render_table(cls: type) -> list[str]:
    texts = field_texts(cls)
    rows = [f"### `{cls.__name__}` (`{cls.__module__}`)", "", "| field | type | default | what it does |",
            "| --- | --- | --- | --- |"]
    for field in own_fields(cls):
        text = texts.get(field.name, "").replace("``", "`").replace("|", "\\|")
        text = text[:-1] + "." if text.endswith(";") else text
        type_name = str(field.type).replace("|", "or")
        rows.append(f"| `{field.name}` | {type_name} | {default_of(field)} | {text} |")
    return rows + [""]


def render() -> str:
    """The generated section of docs/configuration.md, markers included."""
    lines = [BEGIN, ""]
    for cls in config_chain():
        lines += render_table(cls)
    return "\n".join(lines + [END])


def undocumented_fields() -> list[str]:
    return [f"{cls.__name__}.{f.name}" for cls in config_chain() for f in own_fields(cls)
            if f.name not in field_texts(cls)]


def generated_section(document: str) -> str:
    """The part of ``document`` between the markers, markers included ('' without them)."""
    start, end = document.find(BEGIN), document.find(END)
    return document[start:end + len(END)] if 0 <= start < end else ""


def write(path: Path = DOC_PATH) -> None:
    document = path.read_text()
    old = generated_section(document)
    if not old:
        raise SystemExit(f"{path} has no {BEGIN!r} ... {END!r} markers")
    path.write_text(document.replace(old, render()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the tables in {DOC_PATH}")
    args = parser.parse_args(argv)
    missing = undocumented_fields()
    if missing:
        raise SystemExit(f"no docstring text for {missing}: start a sentence of the class's docstring with ``name``")
    if args.write:
        write()
    else:
        sys.stdout.write(render() + "\n")


if __name__ == "__main__":
    main()
