"""``POST /v1/chat/completions``: messages rendered with the chat template."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response

from app.choices import respond_choices
from app.errors import bad_request
from app.generation import GenerationRun, ServingContext
from app.protocol import ChatCompletionRequest
from app.streaming import Collected, finite_logprob, respond
from app.tool_prompt import template_messages, tool_dicts
from app.tool_reply import ToolReplyFormatter
from engine.outputs import RequestUpdate, TokenLogprob

router = APIRouter()


class ChatFormatter:
    """``chat.completion`` and ``chat.completion.chunk`` objects of one request."""

    def __init__(self, ctx: ServingContext, request_id: str, with_logprobs: bool) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.with_logprobs = with_logprobs
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.ctx.backend.model_name,
            "choices": choices,
        }

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        token = self.ctx.tokenizer.decode([token_id])
        return {"token": token, "logprob": finite_logprob(logprob), "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if not self.with_logprobs:
            return None
        content = []
        for entry in logprobs or []:
            top = [self._token_entry(token_id, lp) for token_id, lp in entry.top]
            content.append(self._token_entry(entry.token_id, entry.logprob) | {"top_logprobs": top})
        return {"content": content}

    def _chunk(self, delta: dict, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(logprobs) if logprobs else None,
            "finish_reason": finish_reason,
        }
        return self._envelope("chat.completion.chunk", [choice])

    def stream_start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def stream_update(self, update: RequestUpdate) -> list[dict]:
        if not update.new_text and not update.logprobs:
            return []
        return [self._chunk({"content": update.new_text}, update.logprobs, None)]

    def stream_finish(self, finish_reason: str) -> dict:
        return self._chunk({}, None, finish_reason)

    def stream_usage(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk", []) | {"usage": usage}

    def response(self, collected: Collected, usage: dict) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": collected.text},
            "logprobs": self._logprobs(collected.logprobs),
            "finish_reason": collected.finish_reason,
        }
        return self._envelope("chat.completion", [choice]) | {"usage": usage}


async def _prompt_token_ids(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    takes_tools = getattr(ctx.tokenizer, "chat_template_takes_tools", False)
    tools = body.rendered_tools
    messages = template_messages(body.messages, tools, takes_tools)
    prompt_token_ids = await ctx.apply_chat_template(messages, tool_dicts(tools) if tools and takes_tools else None)
    if not prompt_token_ids:
        raise bad_request("messages render to an empty prompt", param="messages")
    return list(prompt_token_ids)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx: ServingContext = request.app.state.serving
    ctx.check_model(body.model)
    prompt_token_ids = await _prompt_token_ids(ctx, body)
    params = ctx.sampling_params(body, len(prompt_token_ids), param="messages")
    await ctx.check_grammar(body, params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"

    def formatter() -> ChatFormatter | ToolReplyFormatter:
        chat = ChatFormatter(ctx, request_id, with_logprobs=body.logprobs)
        if not body.rendered_tools:  # tool_choice "none": neither rendered nor parsed
            return chat
        return ToolReplyFormatter(chat, frozenset(tool.function.name for tool in body.rendered_tools))

    if body.n > 1:
        return await respond_choices(request, ctx, request_id, prompt_token_ids, params, body, formatter)
    run = GenerationRun(ctx, request_id, prompt_token_ids, params)
    return await respond(request, run, formatter(), stream=body.stream, include_usage=body.include_usage)
