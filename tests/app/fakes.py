"""A deterministic in-process backend, a byte tokenizer and a live uvicorn server for app tests.

The fake stands in for the workers: this layer sits above the engine, so
what matters is that it honours the Backend contract (stop strings and
max_tokens applied backend-side, text already detokenized, a finished last
update), not that it runs a model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from functools import partial

import openai
import uvicorn

from engine.outputs import RequestUpdate, TokenLogprob
from engine.params import SamplingParams

MODEL = "fake-model"
MAX_MODEL_LEN = 256
REPLY = "The quick brown fox jumps over the lazy dog. "
RAISE_TRIGGER = "\x00RAISE\x00"  # prompt text that makes generate() raise
FAIL_TRIGGER = "\x00FAIL\x00"  # prompt text that makes the request finish with "error"
SECRET = "secret-internal-detail"
WORKER_STATS = {
    "workers": [
        {"name": "ctx-0", "role": "context", "pages_in_use": 3, "num_free_pages": 61,
         "kv_transfer_bytes": 4096, "kv_transfer_seconds": 0.5},
        {"name": "gen-0", "role": "generation", "pages_in_use": 12, "num_free_pages": 52,
         "num_drafts_proposed": 40, "num_drafts_accepted": 25},
    ]
}


class ByteTokenizer:
    """One token per UTF-8 byte; the chat template tags each message with its role."""

    def __init__(self, has_template: bool = True) -> None:
        self.has_template = has_template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t % 256 for t in token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.has_template:
            raise ValueError("this tokenizer has no chat template")
        rendered = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return self.encode(rendered + "<|assistant|>")


def reply_tokens(num_tokens: int) -> list[int]:
    text = REPLY * (num_tokens // len(REPLY) + 1)
    return list(text.encode("utf-8"))[:num_tokens]


class FakeBackend:
    """Replies REPLY (cycled), one token per update, ``token_delay_s`` apart."""

    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self, token_delay_s: float = 0.0) -> None:
        self.token_delay_s = token_delay_s
        self.is_healthy = True
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.requests[request_id] = (list(prompt_token_ids), params)
        prompt_text = bytes(t for t in prompt_token_ids if t < 256).decode("utf-8", errors="replace")
        update = partial(self._update, request_id, len(prompt_token_ids), params)
        if RAISE_TRIGGER in prompt_text:
            raise RuntimeError(SECRET)
        if FAIL_TRIGGER in prompt_text:
            yield update([], 0, "error", error="KV transfer failed")
            return
        tokens, finish_reason = self._planned_output(params)
        if not tokens:
            yield update([], 0, finish_reason)
        for i, token in enumerate(tokens):
            await asyncio.sleep(self.token_delay_s)
            yield update([token], i + 1, finish_reason if i == len(tokens) - 1 else None)

    @staticmethod
    def _planned_output(params: SamplingParams) -> tuple[list[int], str]:
        tokens = reply_tokens(params.max_tokens)
        text = bytes(tokens).decode("utf-8")
        cuts = [text.find(s) for s in params.stop if s in text]
        cuts += [tokens.index(t) for t in params.stop_token_ids if t in tokens]
        if cuts:
            return tokens[: min(cuts)], "stop"
        return tokens, "length"

    @staticmethod
    def _update(request_id, num_prompt_tokens, params, tokens, num_output, finish_reason, error=None):
        logprobs = None
        if params.logprobs is not None:
            top = lambda t: tuple(((t + k) % 256, -0.25 - k) for k in range(params.logprobs))  # noqa: E731
            logprobs = [TokenLogprob(t, -0.25, top(t)) for t in tokens]
        return RequestUpdate(
            request_id=request_id,
            new_token_ids=list(tokens),
            new_text=bytes(tokens).decode("utf-8"),
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=num_output,
            finish_reason=finish_reason,
            logprobs=logprobs,
            error=error,
        )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check_health(self) -> None:
        if not self.is_healthy:
            raise RuntimeError("worker gen-0 is gone")

    async def stats(self) -> dict:
        return WORKER_STATS


class LiveServer:
    """uvicorn on 127.0.0.1, on a free port, in a daemon thread."""

    def __init__(self, app) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=10)
