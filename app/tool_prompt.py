"""A conversation with tools as the chat template reads it.

A template that takes ``tools`` (it reads the variable, as Qwen 2.5's and Hermes' do) gets them, and
the messages in transformers' form: assistant ``tool_calls`` with their arguments as dicts, ``tool``
messages with their ``tool_call_id``. The model's own template knows its own format best.

Any other template (SmolLM2's, the built-in Gemma one) gets the Hermes format written into the
messages, in roles every template accepts::

    system     {the system message, if any}\\n\\n{TOOLS_PROMPT with the tools as JSON lines}
    assistant  {content}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    user       <tool_response>\\n{result}\\n</tool_response>   (consecutive tool messages: one turn)

Either way app.tool_parser reads the reply, so only models that answer in the Hermes
``<tool_call>`` JSON format get their calls back as ``tool_calls`` (docs/openai_fields.md).
"""

from __future__ import annotations

import json

from app.tools import Tool

TOOLS_PROMPT = """\
You can call functions to help with the user's request. Their signatures are the JSON objects \
within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, reply with a JSON object holding its name and its arguments within \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


def tool_dicts(tools: list[Tool]) -> list[dict]:
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_messages(messages: list, tools: list[Tool] | None, takes_tools: bool) -> list[dict]:
    """``messages`` (app.protocol.ChatMessage) as the template's dicts; ``tools``: those to render, None
    for none (tool_choice "none" renders none); ``takes_tools``: the template renders tools itself."""
    if takes_tools:
        return [message.to_template_dict() for message in messages]
    rendered: list[dict] = []
    for message in messages:
        turn = _hermes_turn(message)
        if message.role == "tool" and rendered and rendered[-1].get("is_tool_turn"):
            rendered[-1]["content"] += "\n" + turn["content"]
        else:
            rendered.append(turn)
    for turn in rendered:
        turn.pop("is_tool_turn", None)
    return _with_tools_prompt(rendered, tools) if tools else rendered


def _hermes_turn(message) -> dict:
    turn = message.to_template_dict()
    turn.pop("tool_call_id", None)
    calls = turn.pop("tool_calls", None)
    if calls:
        turn["content"] = "\n".join(([turn["content"]] if turn["content"] else [])
                                    + [call.hermes_text() for call in message.tool_calls])
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>",
                "is_tool_turn": True}
    return turn


def _with_tools_prompt(messages: list[dict], tools: list[Tool]) -> list[dict]:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tool_dicts(tools))
    prompt = TOOLS_PROMPT.format(tools=lines)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [first | {"content": f"{first['content']}\n\n{prompt}" if first["content"] else prompt},
                *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
