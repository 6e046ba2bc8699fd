"""``POST /v1/completions``: OpenAI's legacy text completion, one prompt."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response

from app.choices import respond_choices
from app.errors import bad_request
from app.generation import GenerationRun, ServingContext
from app.protocol import CompletionRequest, ParamError
from app.streaming import Collected, finite_logprob, respond
from engine.outputs import RequestUpdate, TokenLogprob

router = APIRouter()


class CompletionFormatter:
    """``text_completion`` objects of one request."""

    def __init__(self, ctx: ServingContext, request_id: str, with_logprobs: bool) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.with_logprobs = with_logprobs
        self.created = int(time.time())
        self.text_offset = 0

    def _envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.backend.model_name,
            "choices": choices,
        }

    def _choice(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        return {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(logprobs or []) if self.with_logprobs else None,
            "finish_reason": finish_reason,
        }

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        """OpenAI's completion logprobs; text_offset counts on across a stream."""
        decode = self.ctx.tokenizer.decode
        tokens, offsets = [], []
        for entry in logprobs:
            tokens.append(decode([entry.token_id]))
            offsets.append(self.text_offset)
            self.text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [finite_logprob(entry.logprob) for entry in logprobs],
            "top_logprobs": [
                {decode([token_id]): finite_logprob(lp) for token_id, lp in entry.top} for entry in logprobs
            ],
            "text_offset": offsets,
        }

    def stream_start(self) -> list[dict]:
        return []

    def stream_update(self, update: RequestUpdate) -> list[dict]:
        if not update.new_text and not update.logprobs:
            return []
        return [self._envelope([self._choice(update.new_text, update.logprobs, None)])]

    def stream_finish(self, finish_reason: str) -> dict:
        return self._envelope([self._choice("", [], finish_reason)])

    def stream_usage(self, usage: dict) -> dict:
        return self._envelope([]) | {"usage": usage}

    def response(self, collected: Collected, usage: dict) -> dict:
        choice = self._choice(collected.text, collected.logprobs, collected.finish_reason)
        return self._envelope([choice]) | {"usage": usage}


async def _prompt_token_ids(ctx: ServingContext, body: CompletionRequest) -> list[int]:
    try:
        prompt = body.single_prompt()
    except ParamError as exc:
        raise bad_request(str(exc), param=exc.param) from exc
    if isinstance(prompt, str):
        prompt = await ctx.encode(prompt)
        if not prompt:
            raise bad_request("prompt encodes to no tokens", param="prompt")
    vocab_size = getattr(ctx.tokenizer, "vocab_size", None)  # test tokenizers may not say
    if vocab_size is not None and max(prompt, default=0) >= vocab_size:
        raise bad_request(f"prompt token ids must be below the vocabulary size {vocab_size}", param="prompt")
    return list(prompt)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx: ServingContext = request.app.state.serving
    ctx.check_model(body.model)
    prompt_token_ids = await _prompt_token_ids(ctx, body)
    params = ctx.sampling_params(body, len(prompt_token_ids), param="prompt")
    await ctx.check_grammar(body, params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    with_logprobs = body.logprobs is not None
    if body.n > 1:
        return await respond_choices(request, ctx, request_id, prompt_token_ids, params, body,
                                     lambda: CompletionFormatter(ctx, request_id, with_logprobs=with_logprobs))
    run = GenerationRun(ctx, request_id, prompt_token_ids, params)
    formatter = CompletionFormatter(ctx, request_id, with_logprobs=body.logprobs is not None)
    return await respond(request, run, formatter, stream=body.stream, include_usage=body.include_usage)

