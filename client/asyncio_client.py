"""An asyncio client (on the `websockets` library) with the same shape as the
trio one: connect, authenticate, request/response with typed errors, pushes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import websockets

from client.cursors import Cursors
from client.trio_client import EVENT_BUFFER, ClientError
from client.wire import decode_frame


class AsyncioConnection:
    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._replies: dict[str, asyncio.Future] = {}
        self._events: asyncio.Queue[dict | None] = asyncio.Queue(EVENT_BUFFER)

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = decode_frame(raw)
                if frame.get("type") == "event":
                    if self._events.full():  # the application is not consuming: drop and let it resume
                        await self.ws.close(4408, "client event buffer full")
                        return
                    self._events.put_nowait(frame)
                elif frame.get("id") in self._replies:
                    self._replies.pop(frame["id"]).set_result(frame)
        except websockets.ConnectionClosed:
            pass
        finally:
            for waiting in self._replies.values():
                if not waiting.done():
                    waiting.set_exception(ConnectionError("connection closed"))
            with contextlib.suppress(asyncio.QueueFull):
                self._events.put_nowait(None)

    async def call(self, op: str, **fields: Any) -> Any:
        request_id = str(next(self._ids))
        reply_future = asyncio.get_running_loop().create_future()
        self._replies[request_id] = reply_future
        await self.ws.send(json.dumps({"op": op, "id": request_id, **fields}))
        reply = await reply_future
        if reply["type"] == "error":
            raise ClientError(reply["code"], reply["message"], reply.get("details"))
        return reply["data"]

    async def next_event(self) -> dict:
        event = await self._events.get()
        if event is None:
            self._events.put_nowait(None)
            raise ConnectionError("connection closed")
        return event

    async def login(self, email: str, password: str) -> dict:
        return await self.call("login", email=email, password=password)

    async def auth(self, *, token: str | None = None, api_key: str | None = None) -> dict:
        return await self.call("auth", **({"token": token} if token is not None else {"api_key": api_key}))


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[AsyncioConnection]:
    async with websockets.connect(url, max_size=None) as ws:
        connection = AsyncioConnection(ws)
        reader = asyncio.create_task(connection._read())
        try:
            yield connection
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


RETRYABLE = (OSError, ConnectionError, websockets.WebSocketException)


class ResumingAsyncioClient:
    """The asyncio twin of client.resuming.ResumingClient: reconnects with
    backoff, re-authenticates, re-subscribes with its cursors (and to its
    routed feed after `follow_deliveries`).  Requests go through `call` while
    `events()` is being iterated."""

    def __init__(self, url: str, *, api_key: str | None = None, email: str | None = None,
                 password: str | None = None, workspace_id: str | None = None, max_backoff: float = 5.0) -> None:
        self.url = url
        self.api_key, self.email, self.password = api_key, email, password
        self.workspace_id = workspace_id
        self.cursors = Cursors()
        self.max_backoff = max_backoff
        self.reconnects = 0
        self.identity: dict = {}
        self.connection: AsyncioConnection | None = None
        self._connected = asyncio.Event()
        self.delivery_max_in_flight: int | None = None
        self.delivery_feed: dict = {}  # the last `delivery.subscribe` result

    def follow_deliveries(self, max_in_flight: int = 100) -> None:
        """Subscribe to this member's routed feed on every (re)connect: `delivery`
        events then arrive from `events()` like any other event.

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

    async def call(self, op: str, *, retry: bool = True, **fields: Any) -> Any:
        """A request on the current connection (`events()` must be running).  With
        `retry` (for idempotent requests), a connection lost meanwhile is waited
        out and the request sent again on the next one."""
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
                    self._connected.clear()

    async def events(self, buffer: int = 1000) -> AsyncIterator[dict]:
        """`async for event in client.events(): ...` — every event, in order,
        across reconnects.  A background task holds the connection (and
        reconnects) while the loop body runs, so the body may `call` and `ack`."""
        queue: asyncio.Queue[dict] = asyncio.Queue(buffer)
        pump = asyncio.create_task(self._pump(queue))
        try:
            while True:
                next_event = asyncio.ensure_future(queue.get())
                try:
                    done, _ = await asyncio.wait({next_event, pump}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not next_event.done():
                        next_event.cancel()
                if next_event not in done:
                    pump.result()  # the pump only ends by raising: hand that to the caller
                yield next_event.result()
        finally:
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    async def _pump(self, events: asyncio.Queue[dict]) -> None:
        backoff = 0.1
        while True:
            try:
                async with connect(self.url) as conn:
                    self.identity = (await conn.auth(api_key=self.api_key) if self.api_key
                                     else await conn.login(self.email, self.password))
                    self.workspace_id = self.workspace_id or self.identity.get("workspace_id")
                    self.connection = conn
                    self._connected.set()
                    if self.cursors.scopes or self.cursors.workspace_feed:
                        self.cursors.started(await conn.call("subscribe", workspace_id=self.workspace_id,
                                                             **self.cursors.subscribe_fields()))
                    if self.delivery_max_in_flight is not None:
                        self.delivery_feed = await conn.call("delivery.subscribe", workspace_id=self.workspace_id,
                                                             max_in_flight=self.delivery_max_in_flight)
                    backoff = 0.1
                    while True:
                        event = await conn.next_event()
                        if self.cursors.accept(event):
                            await events.put(event)
            except RETRYABLE:
                self.reconnects += 1
            finally:
                self.connection = None
                self._connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)
