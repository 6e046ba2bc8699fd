"""Control messages: the JSON codec, and a channel between two in-process (local) transports."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from actors.control import ControlChannel, ControlError
from actors.leases import LeaseDenied
from actors.messages import (
    BadMessage,
    Claim,
    Envelope,
    Error,
    Extend,
    Mode,
    Ok,
    Release,
    decode,
    encode,
)
from actors.transport import LocalFabric, make_transport

ODD_IDS = ["a|b", "|", "ask|1|claim|x", "r\u00e9q-\u4e2d\u6587-\U0001f600", "\x00"]
request_ids = st.text(min_size=1) | st.sampled_from(ODD_IDS)
seconds = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False) | st.integers(1, 10**6)
requests = st.builds(Claim, request_ids) | st.builds(Release, request_ids) | st.builds(Extend, request_ids, seconds)
replies = st.builds(Ok, st.text()) | st.builds(Error, st.text())
msg_ids = st.integers(0, 2**53)
envelopes = (st.builds(Envelope, st.just(Mode.ASK), requests, msg_ids)
             | st.builds(Envelope, st.just(Mode.TELL), requests)
             | st.builds(Envelope, st.just(Mode.REPLY), replies, msg_ids))


@given(envelopes)
def test_codec_round_trips(envelope):
    assert decode(encode(envelope)) == envelope


@given(request_ids)
def test_request_ids_with_separators_and_unicode_stay_whole(request_id):
    decoded = decode(encode(Envelope(Mode.TELL, Extend(request_id, 2.5))))
    assert decoded.message == Extend(request_id, 2.5)
    assert type(decoded.message) is Extend


def _wire(**fields) -> bytes:
    return json.dumps({"mode": "ask", "id": 3, "type": "Claim", "body": {"request_id": "r"}, **fields}).encode()


@pytest.mark.parametrize("raw, reply_to, why", [
    (b"ask|0|claim|r", None, "not JSON"),
    (b"\xff\xfe\x00", None, "not JSON"),
    (b"[1, 2]", None, "not a JSON object"),
    (_wire(mode="shout"), None, "not a valid Mode"),
    (_wire(type="Steal"), 3, "unknown control message type 'Steal'"),
    (_wire(body={"request_id": 7}), 3, "request_id must be a non-empty string"),
    (_wire(body={"request_id": ""}), 3, "request_id must be a non-empty string"),
    (_wire(body={}), 3, "request_id"),
    (_wire(body={"request_id": "r", "extra": 1}), 3, "extra"),
    (_wire(body="r"), 3, "must be a JSON object"),
    (_wire(type="Extend", body={"request_id": "r", "seconds": "5"}), 3, "seconds"),
    (_wire(type="Extend", body={"request_id": "r", "seconds": -1}), 3, "seconds"),
    (_wire(type="Extend", body={"request_id": "r", "seconds": True}), 3, "seconds"),
    (_wire(type="Ok", body={"text": "yes"}), 3, "cannot carry Ok"),
    (_wire(id=None), None, "int id"),
    (_wire(id="3"), None, "int id"),
    (_wire(mode="tell"), None, "no id"),
    (_wire(mode="reply"), None, "a reply cannot carry Claim"),
])
def test_malformed_messages_are_bad_with_the_ask_id_when_readable(raw, reply_to, why):
    with pytest.raises(BadMessage, match=why) as caught:
        decode(raw)
    assert caught.value.reply_to == reply_to


# -- the channel ------------------------------------------------------------------------------

class LocalDirectory:
    """PeerDirectory's connecting half for transports of one fabric (no Ray)."""

    def __init__(self, transport, members: dict) -> None:
        self.transport, self.members = transport, members

    def ensure_connected(self, peer_name: str) -> None:
        self.transport.connect(peer_name, self.members[peer_name].metadata())


def channel_pair() -> tuple[ControlChannel, ControlChannel]:
    """(asker, answerer): channels over two local transports, started on the running loop."""
    fabric, members = LocalFabric(), {}
    for name in ("gen", "ctx"):
        members[name] = make_transport("local", name, fabric=fabric)
        members[name].register({"full": torch.zeros(2, 4)})
    channels = tuple(ControlChannel(t, LocalDirectory(t, members)) for t in members.values())
    for channel in channels:
        channel.start()
    return channels


class Holder:
    """A context side's handlers that record what they were sent, typed."""

    def __init__(self, channel: ControlChannel) -> None:
        self.seen: list[tuple[str, object]] = []
        channel.on(Claim, self.claim)
        channel.on(Release, self.release)

    async def claim(self, peer: str, claim: Claim) -> str:
        self.seen.append((peer, claim))
        if claim.request_id == "gone":
            raise LeaseDenied("request 'gone' no longer holds pages (lease expired)")
        return f"claimed {claim.request_id}"

    async def release(self, peer: str, release: Release) -> str:
        self.seen.append((peer, release))
        return "released"


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_asks_reach_typed_handlers_and_errors_come_back_whole():
    async def main():
        gen, ctx = channel_pair()
        holder = Holder(ctx)
        assert await gen.ask("ctx", Claim("r|1")) == "claimed r|1"
        with pytest.raises(ControlError, match=r"^request 'gone' no longer holds pages \(lease expired\)$"):
            await gen.ask("ctx", Claim("gone"))
        with pytest.raises(ControlError, match="ctx does not handle Extend"):
            await gen.ask("ctx", Extend("r|1", 5.0))
        gen.tell("ctx", Release("r|1"))
        await _until(lambda: len(holder.seen) == 3)
        await gen.stop(), await ctx.stop()
        return holder.seen

    assert asyncio.run(main()) == [("gen", Claim("r|1")), ("gen", Claim("gone")), ("gen", Release("r|1"))]


def test_bad_messages_get_an_error_reply_and_the_channel_keeps_serving():
    async def main():
        gen, ctx = channel_pair()
        holder = Holder(ctx)
        await gen.stop()  # send raw bytes and read the replies ourselves
        raw_gen = gen.transport
        raw_gen.connect("ctx", ctx.transport.metadata())
        for raw in (b"ask|0|claim|r", _wire(id=41, type="Steal"), _wire(id=42, body={"request_id": 7}), b"\xff"):
            raw_gen.send_notif("ctx", raw)
        replies = []
        await _until(lambda: replies.extend(raw_gen.get_notifs()) or len(replies) == 2)
        gen.start()
        answered = await gen.ask("ctx", Claim("after"))  # the channel survived all of it
        await gen.stop(), await ctx.stop()
        return [decode(raw) for _, raw in replies], answered, holder.seen

    replies, answered, seen = asyncio.run(main())
    assert [(r.mode, r.msg_id, type(r.message)) for r in replies] == [(Mode.REPLY, 41, Error), (Mode.REPLY, 42, Error)]
    assert "unknown control message type 'Steal'" in replies[0].message.text
    assert "request_id must be a non-empty string" in replies[1].message.text
    assert answered == "claimed after" and seen == [("gen", Claim("after"))]


def test_an_unanswered_ask_times_out_and_a_stopped_channel_fails_its_asks():
    async def main():
        gen, ctx = channel_pair()
        await ctx.stop()  # nobody answers
        with pytest.raises(ControlError, match="ctx did not answer Claim within 0.1s"):
            await gen.ask("ctx", Claim("r"), timeout_s=0.1)
        waiting = asyncio.ensure_future(gen.ask("ctx", Claim("r"), timeout_s=30))
        await asyncio.sleep(0.01)
        await gen.stop()
        with pytest.raises(ControlError, match="control channel stopped"):
            await waiting

    asyncio.run(main())
