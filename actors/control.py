"""Small control messages between workers over the transport's notifications.

Serve replicas cannot be addressed one by one through a deployment handle,
but their transport agents can: a generation worker reaches the context
worker that holds a request's pages by the agent name in the KV handle.

The messages are ``actors.messages``' typed ones (Claim, Extend, Release;
Ok / Error replies), JSON-encoded by its one codec. An ask waits for its
reply (or times out); a tell expects none. Nothing a peer sends stops the
channel: a message that cannot be read is logged, and answered with an
``Error`` when it was a readable ask; a handler's exception becomes an
``Error`` reply.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from actors.background import BackgroundTask
from actors.messages import (
    BadMessage,
    ControlMessage,
    Envelope,
    Error,
    Mode,
    Ok,
    Reply,
    decode,
    encode,
)
from actors.peers import PeerDirectory
from actors.transport import KVTransport

log = logging.getLogger(__name__)
M = TypeVar("M", bound=ControlMessage)


class ControlError(RuntimeError):
    """The peer answered with an error, or did not answer in time."""


class ControlTimeout(ControlError):
    """The peer did not answer in time: it may be dead, unlike one that answered with an error."""


class ControlChannel:
    def __init__(self, transport: KVTransport, peers: PeerDirectory, poll_s: float = 0.001) -> None:
        self.transport = transport
        self.peers = peers
        self.poll_s = poll_s
        self._handlers: dict[type, Callable[[str, ControlMessage], Awaitable[str]]] = {}
        self._pending: dict[tuple[str, int], asyncio.Future[Reply]] = {}  # (peer, msg_id) -> its reply
        self._ids = itertools.count()
        self._receiver = BackgroundTask(self._run)

    def on(self, message_type: type[M], handler: Callable[[str, M], Awaitable[str]]) -> None:
        """``handler(peer_name, message)`` handles one type; its return value is the Ok reply's text."""
        self._handlers[message_type] = handler

    def start(self) -> None:
        """Start receiving (on the running event loop)."""
        self._receiver.start()

    async def stop(self) -> None:
        """Stop receiving; asks still waiting fail now instead of timing out."""
        await self._receiver.stop()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ControlError(f"{self.transport.agent_name}: control channel stopped"))

    async def ask(self, peer: str, message: ControlMessage, timeout_s: float = 10.0) -> str:
        """Send ``message`` and wait for the reply: the Ok's text; ControlError on an Error,
        ControlTimeout on no answer within ``timeout_s`` (the bound on a dead peer)."""
        key = (peer, next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            self._send(peer, Envelope(Mode.ASK, message, key[1]))
            reply = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            what = type(message).__name__
            raise ControlTimeout(f"{peer} did not answer {what} within {timeout_s:.1f}s") from None
        finally:
            self._pending.pop(key, None)
        if isinstance(reply, Error):
            raise ControlError(reply.text)
        return reply.text

    def tell(self, peer: str, message: ControlMessage) -> None:
        self._send(peer, Envelope(Mode.TELL, message))

    def _send(self, peer: str, envelope: Envelope) -> None:
        self.peers.ensure_connected(peer)
        self.transport.send_notif(peer, encode(envelope))

    async def _run(self) -> None:
        while True:
            try:
                arrived = self.transport.get_notifs()
            except Exception:
                log.exception("%s: reading control messages failed", self.transport.agent_name)
                arrived = []
            for peer, raw in arrived:
                await self._receive(peer, raw)
            await asyncio.sleep(self.poll_s)

    async def _receive(self, peer: str, raw: bytes) -> None:
        """Handle one message from ``peer``: resolve a reply, or run a handler and answer an ask."""
        try:
            envelope = decode(raw)
        except BadMessage as bad:
            log.warning("%s: unreadable control message from %s: %s", self.transport.agent_name, peer, bad)
            if bad.reply_to is not None:
                self._answer(peer, Envelope(Mode.REPLY, Error(str(bad)), bad.reply_to))
            return
        if envelope.mode is Mode.REPLY:
            future = self._pending.get((peer, envelope.msg_id))
            if future is not None and not future.done():
                future.set_result(envelope.message)
            return
        reply = await self._handle(peer, envelope.message)
        if envelope.mode is Mode.ASK:
            self._answer(peer, Envelope(Mode.REPLY, reply, envelope.msg_id))
        elif isinstance(reply, Error):
            log.debug("%s: %s from %s failed: %s", self.transport.agent_name, envelope.message, peer, reply.text)

    async def _handle(self, peer: str, message: ControlMessage) -> Reply:
        handler = self._handlers.get(type(message))
        if handler is None:
            return Error(f"{self.transport.agent_name} does not handle {type(message).__name__}")
        try:
            return Ok(await handler(peer, message))
        except Exception as exc:
            return Error(str(exc) or type(exc).__name__)

    def _answer(self, peer: str, envelope: Envelope) -> None:
        try:
            self._send(peer, envelope)
        except Exception:  # the asker is gone; its ask times out on its side
            log.warning("%s: cannot reply to %s", self.transport.agent_name, peer, exc_info=True)
