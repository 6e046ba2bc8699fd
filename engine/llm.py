"""The offline API, vLLM-style: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput, RequestUpdate
from engine.params import SamplingParams


class LLM:
    """Runs batches of prompts to completion on one in-process engine.

    ``LLM(model="windserve-tiny" or a local HF directory, tokens_per_block=16,
    max_draft_len=0, device="auto", ...)``; any EngineConfig field is accepted.
    """

    def __init__(self, model: str = "windserve-tiny", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._num_requests = 0

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts."""
        token_lists = self._token_lists(prompts, prompt_token_ids)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(token_lists) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(token_lists):
            raise ValueError(f"{len(params_list)} sampling params for {len(token_lists)} prompts")
        ids = []
        for tokens, p in zip(token_lists, params_list):
            request_id = f"offline-{self._num_requests}"
            self._num_requests += 1
            self.engine.add_request(request_id, tokens, p)
            ids.append(request_id)
        return self._run(ids, dict(zip(ids, token_lists)))

    def _token_lists(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(t) for t in prompt_token_ids]
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        return [self.tokenizer.encode(text) for text in texts]

    def _run(self, ids: list[str], prompts: dict[str, list[int]]) -> list[RequestOutput]:
        updates: dict[str, list[RequestUpdate]] = {request_id: [] for request_id in ids}
        while self.engine.has_unfinished():
            for update in self.engine.step():
                updates[update.request_id].append(update)
        return [self._output(request_id, prompts[request_id], updates[request_id]) for request_id in ids]

    @staticmethod
    def _output(request_id, prompt, updates: list[RequestUpdate]) -> RequestOutput:
        logprobs = [lp for u in updates for lp in (u.logprobs or [])] or None
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt,
            token_ids=[t for u in updates for t in u.new_token_ids],
            text="".join(u.new_text for u in updates),
            finish_reason=updates[-1].finish_reason,
            logprobs=logprobs,
            num_drafts_proposed=updates[-1].num_drafts_proposed,
            num_drafts_accepted=updates[-1].num_drafts_accepted,
            num_cached_tokens=updates[-1].num_cached_tokens,
        )
