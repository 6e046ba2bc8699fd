"""Tool calls in a model's output, Hermes style, read whole or as the text streams in.

The format (Hermes 2 Pro, Qwen 2.5 and the models trained on their data)::

    some text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call> more text <tool_call>...</tool_call>

A call is the JSON object between ``<tool_call>`` and ``</tool_call>``: ``name``, one of the request's
tools, and ``arguments``, a JSON object (or a JSON string holding one). Everything else is content,
and so is a block that is not such a call (bad JSON, an unknown name, no closing tag before the end):
a call is never swallowed, it is either returned or left in the text.

Content is the text outside the calls, concatenated, without leading and trailing whitespace (the
newlines a model writes around its calls); ``None`` when nothing is left.

Streaming: ``ToolCallParser.feed`` returns what is known so far, in order: content pieces (``str``)
and complete calls (``ToolCall``). Text that may be the start of ``<tool_call>`` is held back until
the next characters show it is not, and a call comes out when its closing tag arrives (only then is
it known to be a call rather than content). Fed in any split, the events concatenate to those of the
whole text (tests/app/test_tool_parser.py checks it).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from typing import NamedTuple

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class ToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)


class ParsedReply(NamedTuple):
    content: str | None
    tool_calls: list[ToolCall]


def format_call(name: str, arguments: dict) -> str:
    """One call as the model writes it; the prompt renders past calls this way and app.tools' grammar
    forces this exact text (``{"name": `` ... ``, "arguments": `` ... ``}``)."""
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE_TAG}"


def read_call(body: str, tool_names: Collection[str] | None) -> ToolCall | None:
    """The call a block's text holds, or None if it is not one (then the block stays content)."""
    try:
        call = json.loads(body, parse_constant=_no_constant)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or (tool_names is not None and call["name"] not in tool_names):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
        (call["name"] + text).encode("utf-8")  # a lone surrogate from a \ud800 escape cannot be sent
    except UnicodeEncodeError:
        return None
    return ToolCall(call["name"], text)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; no client would


class ToolCallParser:
    """Splits streamed text into content pieces and calls (module docstring)."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.tool_names = tool_names
        self._buffer = ""  # text not yet decided
        self._is_in_call = False  # the buffer is the inside of an open <tool_call>
        self._held_space = ""  # trailing whitespace of the content so far: sent only if content follows
        self._has_content = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        events: list[str | ToolCall] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[str | ToolCall]:
        """The end of the output: what is still held back is content (an unclosed call included)."""
        rest = (OPEN_TAG if self._is_in_call else "") + self._buffer
        self._buffer, self._is_in_call = "", False
        return self._content(rest)

    def _step(self, events: list[str | ToolCall]) -> bool:
        """Decides what the buffer allows; True if it should be looked at again."""
        if self._is_in_call:
            end = self._buffer.find(CLOSE_TAG)
            if end < 0:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG):]
            self._is_in_call = False
            call = read_call(body, self.tool_names)
            events.extend([call] if call is not None else self._content(OPEN_TAG + body + CLOSE_TAG))
            return True
        start = self._buffer.find(OPEN_TAG)
        if start >= 0:
            events.extend(self._content(self._buffer[:start]))
            self._buffer, self._is_in_call = self._buffer[start + len(OPEN_TAG):], True
            return True
        keep = _partial_tag_len(self._buffer)
        events.extend(self._content(self._buffer[:len(self._buffer) - keep]))
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _content(self, text: str) -> list[str]:
        """``text`` as content pieces, leading and trailing whitespace of the whole held back."""
        if not self._has_content:
            text = text.lstrip()
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if not body:
            return []
        self._has_content = True
        return [body]


def _partial_tag_len(text: str) -> int:
    """Length of the longest end of ``text`` that ``<tool_call>`` starts with (it may still become one)."""
    for size in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0


def gather(events: Iterable[str | ToolCall]) -> ParsedReply:
    """Events as one reply: the content pieces joined (None if none), the calls in order."""
    events = list(events)
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedReply(content or None, [e for e in events if isinstance(e, ToolCall)])


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> ParsedReply:
    """The content and calls of a whole output (the streaming parser fed once, so both agree)."""
    parser = ToolCallParser(tool_names)
    return gather(parser.feed(text) + parser.finish())
