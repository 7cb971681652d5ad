"""A trio client that survives disconnects and server restarts without loss.

It remembers its credential, its subscriptions and, per followed scope, the
last `seq` it delivered (and the last `global_seq` of the workspace feed).
After a drop it reconnects with backoff, re-authenticates and re-subscribes
with those cursors, so the server replays exactly what was missed; anything
at or below a cursor is dropped here as a second line of defence.

Routed deliveries (`follow_deliveries`) resume differently: the server keeps
each member's unacked deliveries and hands them out again on every
`delivery.subscribe`, so the client needs no cursor, only to ack.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_websocket

from client.cursors import Cursors
from client.trio_client import Connection, connect

log = logging.getLogger("scopewire.client")

RETRYABLE = (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError, OSError, trio.BrokenResourceError)


class ResumingClient:
    def __init__(self, url: str, *, api_key: str | None = None, token: str | None = None,
                 email: str | None = None, password: str | None = None, workspace_id: str | None = None,
                 max_backoff: float = 5.0) -> None:
        self.url = url
        self._credential = {"api_key": api_key, "token": token, "email": email, "password": password}
        self.workspace_id = workspace_id
        self.cursors = Cursors()
        self.max_backoff = max_backoff
        self.connection: Connection | None = None
        self._connected = trio.Event()
        self.reconnects = 0
        self.identity: dict = {}
        self.delivery_max_in_flight: int | None = None
        self.delivery_feed: dict = {}  # the last `delivery.subscribe` result

    def follow(self, scope_id: str, after_seq: int | None = None) -> None:
        self.cursors.scopes[scope_id] = after_seq

    def follow_workspace(self, after_global_seq: int | None = None) -> None:
        self.cursors.workspace_feed = True
        self.cursors.global_seq = after_global_seq

    def follow_deliveries(self, max_in_flight: int = 100) -> None:
        """Subscribe to this member's routed feed on every (re)connect: `delivery`
        events (mentions, explicit recipients, DM messages, auto-wake, reactions)
        arrive in the `running()` stream like any other event.

        Delivery is at least once: a delivery not acked is handed out again after
        a reconnect, a server restart or its lease's expiry, possibly after later
        ones.  Handle each one idempotently — dedupe by `data["dedupe_key"]` — and
        `ack` it only after handling it; an acked delivery is never sent again.
        At most `max_in_flight` unacked deliveries are outstanding at once."""
        self.delivery_max_in_flight = max_in_flight

    async def ack(self, delivery_seqs: list[int]) -> list[int]:
        """Ack handled deliveries by `delivery_seq`; returns those acked by this call
        (already acked or unknown ones are left out: acking again is harmless)."""
        return (await self.call("delivery.ack", delivery_seqs=list(delivery_seqs)))["acked"]

    @property
    def global_cursor(self) -> int | None:
        return self.cursors.global_seq

    async def call(self, op: str, *, retry: bool = True, **fields: Any) -> Any:
        """A request on the current connection.  With `retry` (for idempotent
        requests), a connection lost meanwhile is waited out and the request
        sent again on the next one."""
        while True:
            await self._connected.wait()
            connection = self.connection
            if self.workspace_id is not None and "workspace_id" not in fields:
                fields["workspace_id"] = self.workspace_id
            try:
                return await connection.call(op, **fields)
            except RETRYABLE:
                if not retry:
                    raise
                if self.connection is connection:  # not replaced yet: wait for the next session
                    self._connected = trio.Event()

    @contextlib.asynccontextmanager
    async def running(self, buffer: int = 1000) -> AsyncIterator[trio.MemoryReceiveChannel]:
        """`async with client.running() as events: async for event in events: ...` —
        every event, in order, across reconnects, until the block exits."""
        send, receive = trio.open_memory_channel[dict](buffer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, send)
            try:
                yield receive
            finally:
                nursery.cancel_scope.cancel()

    async def _pump(self, events: trio.MemorySendChannel) -> None:
        backoff = 0.1
        while True:
            try:
                async with self._session() as connection:
                    backoff = 0.1
                    while True:
                        event = await connection.next_event()
                        if self.cursors.accept(event):
                            await events.send(event)
            except RETRYABLE as exc:
                self.connection = None
                if self._connected.is_set():
                    self._connected = trio.Event()
                self.reconnects += 1
                log.info("connection lost (%s); reconnecting in %.1fs", type(exc).__name__, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Connection]:
        async with connect(self.url) as connection:
            credential = self._credential
            if credential["api_key"]:
                self.identity = await connection.auth(api_key=credential["api_key"])
            elif credential["email"]:
                self.identity = await connection.login(credential["email"], credential["password"])
            else:
                self.identity = await connection.auth(token=credential["token"])
            if self.workspace_id is None:
                self.workspace_id = self.identity.get("workspace_id")
            self.connection = connection
            self._connected.set()
            if self.cursors.scopes or self.cursors.workspace_feed:
                self.cursors.started(await connection.call("subscribe", workspace_id=self.workspace_id,
                                                           **self.cursors.subscribe_fields()))
            if self.delivery_max_in_flight is not None:
                self.delivery_feed = await connection.call("delivery.subscribe", workspace_id=self.workspace_id,
                                                           max_in_flight=self.delivery_max_in_flight)
            yield connection
