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
         "num_drafts_proposed": 40, "num_drafts_accepted": 25, "num_transfer_fallbacks": 2,
         "kv_transfers": 7},
    ]
}


class ByteTokenizer:
    """One token per UTF-8 byte; the chat template tags each message with its role."""

    def __init__(self, has_template: bool = True) -> None:
        self.has_template = has_template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # no BOS

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


def cached_prefix_len(prompt: list[int], earlier: list[list[int]], tokens_per_block: int) -> int:
    """A prefix cache's hit, by the engine's rule for full-attention blocks: the longest prefix shared
    with an earlier prompt, in whole blocks, leaving at least one prompt token to compute.

        B=4, earlier "abcdefghij", prompt "abcdefgXYZ": shared 7 -> 4 (block 0 only)
    """
    shared = max((common_prefix_len(prompt, old) for old in earlier), default=0)
    return min(shared, len(prompt) - 1) // tokens_per_block * tokens_per_block


def common_prefix_len(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class FakeBackend:
    """Replies REPLY (cycled), one token per update, ``token_delay_s`` apart.

    With ``tokens_per_block``, it also plays a prefix cache that never evicts: every update of a
    request reports ``num_cached_tokens`` = ``cached_prefix_len`` over the prompts it saw before,
    and ``stats()`` adds the cumulative prompt tokens looked up and found to worker ctx-0.
    """

    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self, token_delay_s: float = 0.0, tokens_per_block: int | None = None) -> None:
        self.token_delay_s = token_delay_s
        self.tokens_per_block = tokens_per_block
        self.seen_prompts: list[list[int]] = []
        self.num_queried_tokens = self.num_hit_tokens = 0
        self.is_healthy = True
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.requests[request_id] = (list(prompt_token_ids), params)
        prompt_text = bytes(t for t in prompt_token_ids if t < 256).decode("utf-8", errors="replace")
        update = partial(self._update, request_id, len(prompt_token_ids), params, self._cache(prompt_token_ids))
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

    def _cache(self, prompt_token_ids: list[int]) -> int:
        if self.tokens_per_block is None:
            return 0
        hit = cached_prefix_len(prompt_token_ids, self.seen_prompts, self.tokens_per_block)
        self.seen_prompts.append(list(prompt_token_ids))
        self.num_queried_tokens += len(prompt_token_ids)
        self.num_hit_tokens += hit
        return hit

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
    def _update(request_id, num_prompt_tokens, params, num_cached, tokens, num_output, finish_reason, error=None):
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
            num_cached_tokens=num_cached,
        )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check_health(self) -> None:
        if not self.is_healthy:
            raise RuntimeError("worker gen-0 is gone")

    async def stats(self) -> dict:
        if self.tokens_per_block is None:
            return WORKER_STATS
        context, *others = WORKER_STATS["workers"]
        cache = {"prefix_cache_queries": self.num_queried_tokens, "prefix_cache_hits": self.num_hit_tokens}
        return {"workers": [context | cache, *others]}


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
