"""Small typed messages between workers, and the one codec of the control messages.

No KV data crosses the control plane. ``Prefilled`` (the handed-over outputs' update
and a ``KVHandle``) travels over Ray (Serve handles pickle it); the control messages travel between transport agents
(``actors.control``) as JSON, one object per message::

    {"mode": "ask",   "id": 7,    "type": "Claim", "body": {"request_id": "r|1"}}
    {"mode": "reply", "id": 7,    "type": "Error", "body": {"text": "... expired ..."}}
    {"mode": "tell",  "id": null, "type": "Extend", "body": {"request_id": "r|1", "seconds": 30.0}}

``type`` names a class of ``CONTROL_MESSAGES``; ``body`` is its fields. A
peer may send anything, so ``decode`` checks every field and raises
``BadMessage``, which keeps the id of an ask when it could be read so the
sender still gets an ``Error`` reply.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass

from engine.outputs import RequestUpdate, TokenLogprob, num_kv_tokens


@dataclass(frozen=True)
class KVHandle:
    """Where a prefilled request's KV lives, and for how long it is held.

    ``output_token_ids``: the k >= 1 outputs the context side handed over
    (``engine.handoff``); KV exists for ``num_kv_tokens = prompt_len + k - 1``
    positions (the prompt and all outputs but the last). ``block_ordinals[group]``
    is the context side's table for the request (entry ``i`` = page holding
    positions ``[i*B, (i+1)*B)``, -1 where none).
    ``lease_deadline`` is wall-clock seconds (``time.time()``).
    ``output_logprobs``: one per output when the request asked for logprobs, else None.
    ``num_cached_tokens``: the context side's prefix-cache hit (prompt tokens it did not
    compute), reported in usage as the aggregated path reports it.
    """

    context_agent: str
    request_id: str
    prompt_len: int
    output_token_ids: list[int]
    block_ordinals: dict[str, list[int]]
    lease_deadline: float
    tokens_per_block: int
    output_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if not self.output_token_ids:
            raise ValueError("a handoff carries at least one output token")
        if self.output_logprobs is not None and len(self.output_logprobs) != len(self.output_token_ids):
            raise ValueError(f"{len(self.output_logprobs)} logprobs for {len(self.output_token_ids)} output tokens")
        if not 0 <= self.num_cached_tokens < self.prompt_len:
            raise ValueError(f"num_cached_tokens must be in [0, {self.prompt_len}), got {self.num_cached_tokens}")

    @property
    def num_kv_tokens(self) -> int:
        """Positions whose KV the context side holds for the transfer: ``[0, prompt_len + k - 1)``."""
        return num_kv_tokens(self.prompt_len, len(self.output_token_ids))


@dataclass(frozen=True)
class Prefilled:
    """What a context worker's prefill returns: the handed-over outputs, to stream at once, and their KV.

    ``first`` carries the k outputs (``engine.handoff``) in one update, with the
    text an aggregated engine streams for them (held back as far as a stop
    string could still match), its ``finish_reason`` set when an output ends
    the request. ``kv`` is where the pages are held under a lease, or None when
    the request ended: then nothing is held and no generation worker is needed.
    """

    first: RequestUpdate
    kv: KVHandle | None

    def __post_init__(self) -> None:
        first = self.first
        if first.prefill is not None or not 1 <= first.num_output_tokens == len(first.new_token_ids):
            raise ValueError(f"first must be the one update of a request's first outputs, got {first!r}")
        if first.is_finished != (self.kv is None):
            raise ValueError("kv must be None exactly when the handed-over outputs finish the request")
        if self.kv is not None and self.kv.output_token_ids != first.new_token_ids:
            raise ValueError(f"kv carries outputs {self.kv.output_token_ids}, first {first.new_token_ids}")

    @property
    def is_finished(self) -> bool:
        return self.kv is None


# -- control messages -------------------------------------------------------------------------

def _check(is_valid: bool, what: str) -> None:
    if not is_valid:
        raise ValueError(what)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RequestMessage:
    """A message about one request's pages on the context worker."""

    request_id: str

    def __post_init__(self) -> None:
        _check(isinstance(self.request_id, str) and self.request_id != "",
               f"request_id must be a non-empty string, got {self.request_id!r}")


@dataclass(frozen=True)
class Claim(RequestMessage):
    """Ask: hold the pages for a transfer; the lease must be live, and cannot expire under it."""


@dataclass(frozen=True)
class Extend(RequestMessage):
    """Tell: keep the lease at least ``seconds`` longer (the generation side waits for free pages)."""

    seconds: float

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(isinstance(self.seconds, (int, float)) and not isinstance(self.seconds, bool)
               and math.isfinite(self.seconds) and self.seconds > 0,
               f"seconds must be a finite number > 0, got {self.seconds!r}")


@dataclass(frozen=True)
class Release(RequestMessage):
    """Tell: the transfer is over (or failed); free the pages."""


@dataclass(frozen=True)
class Reply:
    """What an ask gets back; ``text`` says what was done, or why not."""

    text: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.text, str), f"text must be a string, got {self.text!r}")


@dataclass(frozen=True)
class Ok(Reply):
    """Reply: the ask was done."""


@dataclass(frozen=True)
class Error(Reply):
    """Reply: the ask failed, or could not be read."""


ControlMessage = Claim | Extend | Release | Ok | Error
CONTROL_MESSAGES: dict[str, type[ControlMessage]] = {
    cls.__name__: cls for cls in (Claim, Extend, Release, Ok, Error)}


class Mode(str, enum.Enum):
    ASK = "ask"      # one reply expected, matched by id
    TELL = "tell"    # no reply
    REPLY = "reply"  # answers the ask with the same id


@dataclass(frozen=True)
class Envelope:
    """A control message on the wire: ``msg_id`` (an int, unique per sender) on asks and
    their replies, None on tells; replies carry Ok or Error, asks and tells never do."""

    mode: Mode
    message: ControlMessage
    msg_id: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.mode, Mode), f"mode must be a Mode, got {self.mode!r}")
        _check(type(self.message) in CONTROL_MESSAGES.values(), f"not a control message: {self.message!r}")
        _check(isinstance(self.message, Reply) == (self.mode is Mode.REPLY),
               f"a {self.mode.value} cannot carry {type(self.message).__name__}")
        if self.mode is Mode.TELL:
            _check(self.msg_id is None, f"a tell needs no id, got {self.msg_id!r}")
        else:
            _check(_is_int(self.msg_id), f"a {self.mode.value} needs an int id, got {self.msg_id!r}")


class BadMessage(ValueError):
    """A control message that cannot be read; ``reply_to`` is its id when it was a readable ask."""

    def __init__(self, why: str, reply_to: int | None = None) -> None:
        super().__init__(why)
        self.reply_to = reply_to


def encode(envelope: Envelope) -> bytes:
    message = envelope.message
    wire = {"mode": envelope.mode.value, "id": envelope.msg_id, "type": type(message).__name__,
            "body": dataclasses.asdict(message)}
    return json.dumps(wire).encode()


def decode(raw: bytes) -> Envelope:
    """The envelope in ``raw``; BadMessage if it is not one (JSON, known type, valid fields)."""
    try:
        wire = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadMessage(f"control message is not JSON: {e}") from None
    if not isinstance(wire, dict):
        raise BadMessage(f"control message is not a JSON object: {wire!r}")
    msg_id = wire.get("id")
    is_ask = wire.get("mode") == Mode.ASK.value and _is_int(msg_id)
    try:
        return Envelope(Mode(wire.get("mode")), _message(wire.get("type"), wire.get("body")), msg_id)
    except (TypeError, ValueError) as e:
        raise BadMessage(f"bad control message: {e}", msg_id if is_ask else None) from None


def _message(type_name: object, body: object) -> ControlMessage:
    cls = CONTROL_MESSAGES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ValueError(f"unknown control message type {type_name!r}")
    if not isinstance(body, dict):
        raise ValueError(f"the body of {type_name} must be a JSON object, got {body!r}")
    return cls(**body)
