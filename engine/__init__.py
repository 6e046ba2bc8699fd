"""The torch side both workers share: model, loading, tokenizer, scheduler,
sampler, speculative drafter. No Ray here."""

from engine.config import EngineConfig
from engine.engine import LLMEngine, PromptTooLongError
from engine.llm import LLM
from engine.outputs import FinishReason, PrefillResult, RequestOutput, RequestUpdate, TokenLogprob
from engine.params import SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "FinishReason",
    "LLMEngine",
    "PrefillResult",
    "PromptTooLongError",
    "RequestOutput",
    "RequestUpdate",
    "SamplingParams",
    "TokenLogprob",
]
