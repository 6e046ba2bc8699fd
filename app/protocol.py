"""OpenAI request schemas (pydantic) and their mapping onto SamplingParams.

Every field that changes the answer is honoured or rejected, never silently
ignored (docs/openai_fields.md lists each field and its handling):

- honoured: the sampling fields, OpenAI's (``temperature``, ``top_p``,
  ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``,
  ``logit_bias``, ``logprobs`` ...) and vLLM's (``top_k``,
  ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``);
- honoured: structured outputs (``response_format`` json_object / json_schema,
  vLLM's ``structured_outputs`` and ``guided_*``: app.structured), in every choice;
- honoured: tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``,
  ``tool`` messages and assistant ``tool_calls``: app.tools);
- honoured: ``n`` in [1, MAX_N] (a 400 naming ``n`` outside): n child requests, the
  prompt prefilled once and shared through the prefix cache (app.choices);
- a 400 naming the field (``ParamError``, from app.unimplemented's tables)
  when it asks for what windserve lacks: ``functions``, ``best_of``, ``echo``,
  ``suffix``, ``audio`` ..., and non-text content parts;
- ignored: fields that cannot change the tokens (``user``, ``metadata``,
  ``store``, ``service_tier`` ...) and any unknown field. ``null`` means
  "the default", as clients that serialize every optional field expect.

Length policy (the prompt must leave room for one token; ``max_tokens`` is
then clamped, not rejected)::

    prompt_len >= max_model_len        -> 400 context_length_exceeded
    max_tokens omitted                 -> 16 (completions, OpenAI's default)
                                          max_model_len - prompt_len (chat)
    max_tokens > room left             -> clamped to max_model_len - prompt_len

vLLM rejects ``prompt_len + max_tokens > max_model_len`` instead; clamping
keeps clients that always send a large ``max_tokens`` working, and the
clamped request reports ``finish_reason="length"`` like any other.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.structured import GUIDED_FIELDS, ResponseFormat, StructuredOutputs, requested_grammar
from app.tools import AssistantToolCall, Tool, ToolChoice, check_tool_fields, tool_template_fields, with_tool_grammar
from app.unimplemented import CHAT, COMMON, COMPLETION, Unimplemented, first_unimplemented
from engine.grammar import GrammarSpec
from engine.params import MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, REPETITION_PENALTY_RANGE, SamplingParams


def _encodable(text: str) -> str:
    """JSON escapes can smuggle lone surrogates in; no tokenizer accepts them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid Unicode (lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
TokenId = Annotated[StrictInt, Field(ge=0)]
MAX_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_N = 16  # choices per request: each is a child request holding its own decode pages


class ParamError(ValueError):
    """A request field the schema accepts but this request cannot use (a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    UNIMPLEMENTED: ClassVar[dict[str, Unimplemented]] = COMMON

    model: Text | None = None  # echoed in errors: a lone surrogate could not be encoded there
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM extension; -1 and 0 mean off
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: int = Field(default=1, ge=1, le=MAX_N)  # n > 1: app.choices
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0],
                                      le=REPETITION_PENALTY_RANGE[1])  # vLLM extension
    logit_bias: dict[str, float] = Field(default_factory=dict)
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM extension, as are the guided_* fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: object) -> object:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="before")
    @classmethod
    def _reject_unimplemented(cls, data: object) -> object:
        """A field that would change the answer, and that windserve lacks, is a 400 naming it."""
        found = first_unimplemented(data, cls.UNIMPLEMENTED) if isinstance(data, dict) else None
        if found is not None:
            raise ParamError(*found)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float]) -> dict[str, float]:
        """OpenAI's keys are token ids as strings; the vocabulary bound is checked once it is known."""
        for key, value in bias.items():
            if not key.strip().isdecimal():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {value}")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop_strings_non_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def requested_grammar(self) -> tuple[str, GrammarSpec] | None:
        """(field, spec) of the structured output asked for (app.structured); ParamError naming a bad one."""
        fields = {"response_format": self.response_format, "structured_outputs": self.structured_outputs}
        fields |= {name: getattr(self, name) for name in GUIDED_FIELDS}
        try:
            return requested_grammar(fields)
        except ValueError as exc:
            raise ParamError(getattr(exc, "param", "response_format"), str(exc)) from None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """``max_tokens`` is the already-clamped budget (see module docstring)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        grammar = self.requested_grammar()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(key): value for key, value in self.logit_bias.items()},
            min_tokens=self.min_tokens,
            grammar=grammar[1] if grammar else None,
        )


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    UNIMPLEMENTED: ClassVar[dict[str, Unimplemented]] = COMPLETION

    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def single_prompt(self) -> str | list[int]:
        """The one prompt; a batch of several, or an empty one, raises ParamError."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ParamError("prompt", "only one prompt per request is supported")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ParamError("prompt", "prompt must not be empty")
        return prompt

    def requested_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: Text | None = None

    def to_template_dict(self) -> dict:
        """The message as a chat template reads it: content flattened to text."""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        message = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message | tool_template_fields(self.tool_calls, self.tool_call_id)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    UNIMPLEMENTED: ClassVar[dict[str, Unimplemented]] = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tools_fit(self) -> ChatCompletionRequest:
        check_tool_fields(self.tools, self.tool_choice, self.messages)
        self.requested_grammar()  # a forced tool_choice beside another grammar: a 400 before rendering
        return self

    @property
    def rendered_tools(self) -> list[Tool] | None:  # None without tools or with tool_choice "none" (app.tools)
        return self.tools if self.tools and self.tool_choice != "none" else None

    def requested_grammar(self) -> tuple[str, GrammarSpec] | None:
        return with_tool_grammar(super().requested_grammar(), self.rendered_tools, self.tool_choice,
                                 self.parallel_tool_calls)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return top

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def clamp_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """Tokens this request may generate; the caller has checked prompt_len < max_model_len."""
    room = max_model_len - prompt_len
    return room if requested is None else min(requested, room)
