"""A trio client: connect, authenticate, request/response with typed errors,
and typed pushes.  A reader task routes each reply to its caller and each
push to a bounded event queue, so calls and event consumption may run
concurrently."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_websocket

from client.wire import decode_frame

EVENT_BUFFER = 10_000


class ClientError(Exception):
    """An `error` reply: `code` is the stable error code."""

    def __init__(self, code: str, message: str, details: dict | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}


class Connection:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._replies: dict[str, trio.MemorySendChannel] = {}
        self._events_in, self._events_out = trio.open_memory_channel[dict](EVENT_BUFFER)

    async def _read(self) -> None:
        try:
            while True:
                frame = decode_frame(await self.ws.get_message())
                if frame.get("type") == "event":
                    try:
                        self._events_in.send_nowait(frame)
                    except trio.WouldBlock:  # the application is not consuming: drop and let it resume
                        await self.ws.aclose(4408, "client event buffer full")
                        return
                elif frame.get("id") in self._replies:
                    self._replies.pop(frame["id"]).send_nowait(frame)
        except trio_websocket.ConnectionClosed:
            pass
        finally:
            self._events_in.close()
            for waiting in self._replies.values():
                waiting.close()

    async def call(self, op: str, **fields: Any) -> Any:
        """Send one request and return its result data; ClientError on an error reply."""
        request_id = str(next(self._ids))
        send, receive = trio.open_memory_channel[dict](1)
        self._replies[request_id] = send
        await self.ws.send_message(json.dumps({"op": op, "id": request_id, **fields}))
        try:
            reply = await receive.receive()
        except trio.EndOfChannel:
            raise trio_websocket.ConnectionClosed(self.ws.closed) from None
        if reply["type"] == "error":
            raise ClientError(reply["code"], reply["message"], reply.get("details"))
        return reply["data"]

    async def next_event(self) -> dict:
        """The next push; ConnectionClosed once the connection is gone and drained."""
        try:
            return await self._events_out.receive()
        except trio.EndOfChannel:
            raise trio_websocket.ConnectionClosed(self.ws.closed) from None

    def queued_events(self) -> list[dict]:
        """Pushes received and not yet consumed (without waiting)."""
        events = []
        while True:
            try:
                events.append(self._events_out.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return events

    async def login(self, email: str, password: str) -> dict:
        return await self.call("login", email=email, password=password)

    async def auth(self, *, token: str | None = None, api_key: str | None = None) -> dict:
        fields = {"token": token} if token is not None else {"api_key": api_key}
        return await self.call("auth", **fields)

    @property
    def close_code(self) -> int | None:
        reason = self.ws.closed
        return reason.code if reason is not None else None

    async def wait_closed(self) -> int:
        """Block until the server closes the connection; returns the close code."""
        with contextlib.suppress(trio_websocket.ConnectionClosed):
            while True:
                await self.next_event()
        assert self.ws.closed is not None  # set before the reader closed the event queue
        return self.ws.closed.code


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[Connection]:
    try:
        async with trio_websocket.open_websocket_url(url) as ws, trio.open_nursery() as nursery:
            connection = Connection(ws)
            nursery.start_soon(connection._read)
            try:
                yield connection
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The reader's nursery wraps the caller's own exception; hand it back as raised.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
