"""The chat reply of a request with tools: ``message.tool_calls`` whole, or tool-call deltas streamed.

Whole (app.tool_parser reads the text)::

    "message": {"role": "assistant", "content": <text outside the calls, or null>,
                "tool_calls": [{"id": "call_<random>", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]}

Streamed, per call, as OpenAI sends them (the official client's stream helper assembles them)::

    delta {"tool_calls": [{"index": i, "id": ..., "type": "function", "function": {"name": ..., "arguments": ""}}]}
    delta {"tool_calls": [{"index": i, "function": {"arguments": "<the arguments' JSON>"}}]}

A call goes out once its closing tag arrived (before that it might still turn out to be content), so
its arguments come as one fragment. ``finish_reason`` is ``tool_calls`` when calls were made and the
model stopped by itself; ``length`` when max_tokens cut the output, and then a call it cut stays in
``content`` as the text written so far (the calls before it are returned).
"""

from __future__ import annotations

import uuid

from app.streaming import Collected
from app.tool_parser import ToolCall, ToolCallParser, parse_tool_calls
from engine.outputs import RequestUpdate


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str, num_calls: int) -> str:
    return "tool_calls" if num_calls and reason == "stop" else reason


class ToolReplyFormatter:
    """Wraps app.routes_chat's ChatFormatter (its chunks and envelope) and passes the text through
    app.tool_parser; ``tool_names``: the calls it accepts."""

    def __init__(self, chat, tool_names: frozenset[str]) -> None:
        self.chat = chat
        self.tool_names = tool_names
        self.parser = ToolCallParser(tool_names)
        self.num_calls = 0  # streamed so far

    @property
    def created(self) -> int:
        return self.chat.created

    @created.setter
    def created(self, value: int) -> None:  # app.choices stamps every choice with the first one's
        self.chat.created = value

    def stream_start(self) -> list[dict]:
        """The role chunk with ``content: null`` (OpenAI's, when calls may follow): a reply of calls only
        assembles to ``content`` None, as it is whole."""
        chunks = self.chat.stream_start()
        for choice in (choice for chunk in chunks for choice in chunk["choices"]):
            choice["delta"]["content"] = None
        return chunks

    def stream_usage(self, usage: dict) -> dict:
        return self.chat.stream_usage(usage)

    def stream_update(self, update: RequestUpdate) -> list[dict]:
        events = self.parser.feed(update.new_text)
        if update.is_finished:
            events += self.parser.finish()
        chunks = [chunk for event in events for chunk in self._event_chunks(event)]
        if update.logprobs:  # the tokens' logprobs ride the first chunk after them, or one of their own
            if chunks:
                chunks[0]["choices"][0]["logprobs"] = self.chat._logprobs(update.logprobs)
            else:
                chunks = [self.chat._chunk({}, update.logprobs, None)]
        return chunks

    def _event_chunks(self, event: str | ToolCall) -> list[dict]:
        if isinstance(event, str):
            return [self._delta({"content": event})]
        index, self.num_calls = self.num_calls, self.num_calls + 1
        head = {"index": index, "id": call_id(), "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        tail = {"index": index, "function": {"arguments": event.arguments}}
        return [self._delta({"tool_calls": [head]}), self._delta({"tool_calls": [tail]})]

    def _delta(self, delta: dict) -> dict:
        return self.chat._chunk(delta, None, None)

    def stream_finish(self, reason: str) -> dict:
        return self.chat._chunk({}, None, finish_reason(reason, self.num_calls))

    def response(self, collected: Collected, usage: dict) -> dict:
        body = self.chat.response(collected, usage)
        parsed = parse_tool_calls(collected.text, self.tool_names)
        choice = body["choices"][0]
        choice["message"]["content"] = parsed.content
        if parsed.tool_calls:
            choice["message"]["tool_calls"] = [
                {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in parsed.tool_calls]
        choice["finish_reason"] = finish_reason(collected.finish_reason, len(parsed.tool_calls))
        return body
