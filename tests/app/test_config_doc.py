"""docs/configuration.md's field tables are the config dataclasses' own fields and docstrings (app.config_doc)."""

from __future__ import annotations

import dataclasses
import re

from app.config_doc import DOC_PATH, config_chain, field_texts, generated_section, own_fields, render


@dataclasses.dataclass(frozen=True)
class Base:
    """What a base does.

    ``a`` is the first field; it says more. Not about a field. ``b`` / ``c``: two fields at once;
    ``d`` ends after a semicolon."""

    a: int = 1
    b: str = "x"
    c: bool | None = None
    d: float = 0.5


@dataclasses.dataclass(frozen=True)
class Layer(Base):
    """``e``: the layer's own field, mentioning ``a`` inside."""

    e: int = 2


def test_a_fields_text_runs_from_its_name_to_the_next_fields_name():
    texts = field_texts(Base)
    assert texts["a"] == "``a`` is the first field; it says more. Not about a field."
    assert texts["b"] == texts["c"] == "``b`` / ``c``: two fields at once;"
    assert texts["d"] == "``d`` ends after a semicolon."
    assert field_texts(Layer)["e"] == "``e``: the layer's own field, mentioning ``a`` inside."


def test_each_layer_lists_only_the_fields_it_declares():
    assert [f.name for f in own_fields(Layer)] == ["e"]
    names = [f.name for cls in config_chain() for f in own_fields(cls)]
    assert len(names) == len(set(names))  # every field declared once along the chain
    assert [cls.__name__ for cls in config_chain()] == ["EngineConfig", "WorkerConfig", "AppConfig"]


def test_every_field_of_the_chain_has_text_of_its_own():
    missing = [f"{cls.__name__}.{f.name}" for cls in config_chain() for f in own_fields(cls)
               if not field_texts(cls).get(f.name)]
    assert not missing, "start a sentence of the class's docstring with ``name``"


def test_the_document_says_what_the_dataclasses_say():
    document = DOC_PATH.read_text()
    assert generated_section(document) == render(), "run: python -m app.config_doc --write"
    rows = set(re.findall(r"^\| `(\w+)` \|", generated_section(document), flags=re.MULTILINE))
    assert rows == {f.name for cls in config_chain() for f in dataclasses.fields(cls)}
