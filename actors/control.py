"""Small control messages between workers over the transport's notifications.

Serve replicas cannot be addressed one by one through a deployment handle,
but their transport agents can: a generation worker reaches the context
worker that holds a request's pages by the agent name in the KV handle.

Wire format (UTF-8, ``|``-separated; request ids never contain ``|``)::

    ask   : "ask|<msg_id>|<kind>|<arg>..."     one reply expected
    tell  : "tell|-|<kind>|<arg>..."           no reply
    reply : "re|<msg_id>|ok|<text>"  or  "re|<msg_id>|err|<text>"
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Awaitable, Callable

from actors.peers import PeerDirectory
from actors.transport import KVTransport

log = logging.getLogger(__name__)
Handler = Callable[[str, list[str]], Awaitable[str]]


class ControlError(RuntimeError):
    """The peer answered with an error, or did not answer in time."""


class ControlChannel:
    def __init__(self, transport: KVTransport, peers: PeerDirectory, poll_s: float = 0.001) -> None:
        self.transport = transport
        self.peers = peers
        self.poll_s = poll_s
        self._handlers: dict[str, Handler] = {}
        self._pending: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None

    def on(self, kind: str, handler: Handler) -> None:
        """``handler(peer_name, args)`` answers an ask (its return value) or handles a tell."""
        self._handlers[kind] = handler

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def ask(self, peer: str, kind: str, *args: str, timeout_s: float = 10.0) -> str:
        msg_id = f"{self.transport.agent_name}:{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        try:
            self._send(peer, "ask", msg_id, kind, *args)
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise ControlError(f"{peer} did not answer {kind!r} within {timeout_s:.1f}s") from None
        finally:
            self._pending.pop(msg_id, None)

    def tell(self, peer: str, kind: str, *args: str) -> None:
        self._send(peer, "tell", "-", kind, *args)

    def _send(self, peer: str, *fields: str) -> None:
        if any("|" in f for f in fields):
            raise ValueError(f"control message fields may not contain '|': {fields}")
        self.peers.ensure_connected(peer)
        self.transport.send_notif(peer, "|".join(fields).encode())

    async def _run(self) -> None:
        while True:
            try:
                for peer, raw in self.transport.get_notifs():
                    await self._dispatch(peer, raw.decode(errors="replace").split("|"))
            except Exception:  # a bad message or a gone peer must not stop the channel
                log.exception("control channel")
            await asyncio.sleep(self.poll_s)

    async def _dispatch(self, peer: str, fields: list[str]) -> None:
        mode, msg_id, rest = fields[0], fields[1], fields[2:]
        if mode == "re":
            future = self._pending.get(msg_id)
            if future is not None and not future.done():
                status, text = rest[0], "|".join(rest[1:])
                future.set_result(text) if status == "ok" else future.set_exception(ControlError(text))
            return
        handler = self._handlers.get(rest[0])
        if handler is None:
            status, text = "err", f"unknown control message {rest[0]!r}"
        else:
            try:
                status, text = "ok", await handler(peer, rest[1:])
            except Exception as exc:
                status, text = "err", str(exc)
        if mode == "ask":
            self._send(peer, "re", msg_id, status, text.replace("|", "/"))
