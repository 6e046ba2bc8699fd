"""Structured outputs in a request: the fields that ask for them, mapped onto one ``GrammarSpec``.

    response_format {"type": "json_object"}                           -> json_object
    response_format {"type": "json_schema", "json_schema": {"schema"}}  -> json (the schema)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}  (vLLM's)
    guided_json | guided_regex | guided_choice | guided_grammar        (vLLM's older names)

At most one of them may ask for a grammar (a second is a 400 naming it). The grammar is enforced
whatever ``json_schema.strict`` says (vLLM's behaviour: a schema sent is a schema honoured). A
schema or grammar that does not compile, or not within the deadline, is a 400 naming its field
before anything is queued (app.generation.ServingContext.check_grammar).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.grammar import GrammarSpec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError('type "json_schema" needs json_schema.schema')
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return GrammarSpec("json_object")
        if self.type == "json_schema":
            return GrammarSpec.json_schema(self.json_schema.json_schema)
        return None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``; its other keys (``structural_tag``, ``whitespace_pattern`` ...)
    would change the answer and are not implemented: a 400 (extra keys are forbidden)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def grammar_spec(self) -> GrammarSpec | None:
        given = [(name, value) for name, value in (("json", self.json_schema), ("regex", self.regex),
                                                    ("choice", self.choice), ("grammar", self.grammar),
                                                    ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) > 1:
            raise ValueError(f"give one of json, regex, choice, grammar, json_object; got {[n for n, _ in given]}")
        if not given:
            return None
        return _spec(*given[0])


def _spec(kind: str, value: Any) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec.json_schema(value)
    if kind == "choice":
        return GrammarSpec.choice(value)
    if kind == "json_object":
        return GrammarSpec("json_object")
    return GrammarSpec("regex" if kind == "regex" else "ebnf", value)


def requested_grammar(fields: dict[str, Any]) -> tuple[str, GrammarSpec] | None:
    """(field, spec) of the one field that asks for a grammar; ``fields``: the request's values of
    ``response_format``, ``structured_outputs`` and the ``guided_*`` fields (None when absent).
    ValueError (field, message) when two ask, or one cannot be read."""
    found: list[tuple[str, GrammarSpec]] = []
    for name, value in fields.items():
        try:
            spec = _field_spec(name, value)
        except ValueError as exc:
            raise FieldError(name, str(exc)) from None
        if spec is not None:
            found.append((name, spec))
    if len(found) > 1:
        raise FieldError(found[1][0], f"only one structured-output field per request; {found[0][0]} is set too")
    return found[0] if found else None


class FieldError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _field_spec(name: str, value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if name == "response_format":
        return value.grammar()
    if name == "structured_outputs":
        return value.grammar_spec()
    kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    return _spec(kind[name], value)
