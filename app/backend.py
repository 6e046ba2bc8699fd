"""What the HTTP layer needs from the rest of the system: a Backend and a ServingTokenizer.

    app.api, app.generation, app.routes_*  ──use──►  Backend, ServingTokenizer  (this module)
                                                        ▲
    app.serve_backend.ServeBackend (Serve handles) ─────┤ implement
    tests.app.fakes.FakeBackend (in process) ───────────┘

Both are protocols, so this module imports nothing of the app: app.api and
app.generation both import it, and neither imports the other for its types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.outputs import RequestUpdate
from engine.params import SamplingParams


class Backend(Protocol):
    """Where requests are served; the HTTP layer's only view of the workers."""

    model_name: str
    max_model_len: int

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestUpdate]:
        """Updates of one request; the last has ``finish_reason`` set.

        The backend applies stop strings, stop tokens and max_tokens itself,
        and sends text already detokenized in ``new_text``.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; unknown ids are no-ops."""
        ...

    async def check_health(self) -> None:
        """Raises if the backend cannot serve."""
        ...

    async def stats(self) -> dict:
        """Free-form worker stats; app.metrics documents the keys it reads."""
        ...


class ServingTokenizer(Protocol):
    """The text <-> token ids the HTTP layer needs (``engine.tokenizer.Tokenizer`` is one)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids of the messages; ValueError if there is no template. ``tools`` is passed only
        to a tokenizer whose ``chat_template_takes_tools`` is true (app.tool_prompt)."""
        ...
