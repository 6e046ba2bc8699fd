"""Tool calling in a chat request: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked, and
the grammar that makes ``required`` and a named function binding.

    tool_choice                          tools in the prompt   output                         parsed
    "none"                               no                    free                           no
    "auto" (the default with tools)      yes                   free                           yes
    "required"                           yes                   1+ calls of any tool, then EOS   yes
    {"type": "function", "function": {"name": n}}   yes        1+ calls of n, then EOS          yes

``parallel_tool_calls: false`` makes the grammar stop after one call (``auto`` is not constrained,
so there the parser keeps every call the model wrote). The grammar is an xgrammar structural tag
(engine.grammar): each call is the exact text app.tool_parser.format_call writes, its arguments
constrained by the tool's ``parameters`` schema, so they always parse and validate. It rides in
SamplingParams like any structured output, so it is honoured on both sides of a disaggregated
request (app.structured, engine.grammar).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.structured import FieldError
from app.tool_parser import format_call
from engine.grammar import GrammarSpec

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_JSON_WHITESPACE = 1  # a small model under a grammar can otherwise write whitespace until max_tokens


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)  # a JSON schema; {} takes any object
    strict: bool | None = None  # the grammar enforces the schema whatever it says (as for response_format)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"function name {name!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
        return name

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"parameters is not a valid JSON schema: {exc.message}") from None
        if schema.get("type", "object") != "object":
            raise ValueError(f"parameters must be a schema of type object, got {schema['type']!r}")
        return schema

    def arguments_schema(self) -> dict[str, Any]:
        """The schema the grammar holds the arguments to: always an object."""
        return {"type": "object", **self.parameters}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI returned it


class AssistantToolCall(BaseModel):
    """A call in an earlier assistant message (``messages[i].tool_calls``)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def to_template_dict(self) -> dict:
        """As transformers' chat templates read it: ``arguments`` a dict where it is JSON."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}

    def hermes_text(self) -> str:
        arguments = self.to_template_dict()["function"]["arguments"]
        return format_call(self.function.name, arguments if isinstance(arguments, dict) else {})


def check_tool_fields(tools: list[Tool] | None, tool_choice: ToolChoice | None, messages: list) -> None:
    """Names unique, a named choice among them, a choice other than "none" only with tools, tool messages
    answering calls (FieldError naming the field)."""
    names = [tool.function.name for tool in tools or []]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise FieldError("tools", f"function names must be unique; {', '.join(duplicates)} appears twice")
    if tool_choice not in (None, "none") and not names:
        raise FieldError("tool_choice", "tool_choice is only allowed when tools are given")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise FieldError("tool_choice", f"no tool is named {tool_choice.function.name!r}")
    _check_tool_messages(messages)


def tool_template_fields(tool_calls: list[AssistantToolCall] | None, tool_call_id: str | None) -> dict:
    """A message's ``tool_calls`` and ``tool_call_id`` as a chat template reads them (absent when unset)."""
    fields = {"tool_calls": [call.to_template_dict() for call in tool_calls]} if tool_calls else {}
    return fields | ({"tool_call_id": tool_call_id} if tool_call_id is not None else {})


def _check_tool_messages(messages: list) -> None:
    """Only assistants call; each ``tool`` message answers a call of an earlier assistant message."""
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise FieldError("messages", f"messages[{index}]: only assistant messages carry tool_calls")
        call_ids.update(call.id for call in message.tool_calls or ())
        if message.role == "tool" and message.tool_call_id is None:
            raise FieldError("messages", f"messages[{index}]: a tool message needs the tool_call_id of the call "
                             "it answers")
        if message.role == "tool" and message.tool_call_id not in call_ids:
            raise FieldError("messages", f"messages[{index}]: tool_call_id {message.tool_call_id!r} answers no "
                             "tool call of an earlier assistant message")


def tool_call_grammar(tools: list[Tool], tool_choice: ToolChoice, parallel: bool) -> GrammarSpec | None:
    """The grammar of ``required`` and a named choice (module docstring); None for ``auto`` and ``none``."""
    if tool_choice in ("auto", "none"):
        return None
    chosen = [tool.function for tool in tools
              if tool_choice == "required" or tool.function.name == tool_choice.function.name]
    tag_format = {"type": "tags_with_separator", "tags": [_call_tag(function) for function in chosen],
                  "separator": "\n", "at_least_one": True, "stop_after_first": not parallel}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": tag_format}))


def with_tool_grammar(grammar: tuple[str, GrammarSpec] | None, tools: list[Tool] | None,
                      tool_choice: ToolChoice | None, parallel: bool) -> tuple[str, GrammarSpec] | None:
    """The request's grammar, (field, spec): a structured-output field's or the tool calls' (field
    ``tools``: a schema xgrammar cannot compile is a 400 naming it); both at once is a FieldError."""
    spec = tool_call_grammar(tools, tool_choice or "auto", parallel) if tools else None
    if spec is None:
        return grammar
    if grammar is not None:
        raise FieldError("tool_choice", f"this tool_choice forces tool calls; {grammar[0]} asks for another grammar")
    return "tools", spec


def _call_tag(function: FunctionDefinition) -> dict:
    """``<tool_call>\\n{"name": "f", "arguments": `` schema ``}\\n</tool_call>``, split off format_call's text
    (names hold no braces, so the last ``{}`` is the arguments)."""
    begin, _, end = format_call(function.name, {}).rpartition("{}")
    content = {"type": "json_schema", "json_schema": function.arguments_schema(),
               "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    return {"type": "tag", "begin": begin, "content": content, "end": end}
