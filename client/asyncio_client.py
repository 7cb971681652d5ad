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


class ResumingAsyncioClient:
    """The asyncio twin of client.resuming.ResumingClient: reconnects with
    backoff, re-authenticates, re-subscribes with its cursors."""

    def __init__(self, url: str, *, api_key: str | None = None, email: str | None = None,
                 password: str | None = None, workspace_id: str | None = None, max_backoff: float = 5.0) -> None:
        self.url = url
        self.api_key, self.email, self.password = api_key, email, password
        self.workspace_id = workspace_id
        self.cursors = Cursors()
        self.max_backoff = max_backoff
        self.reconnects = 0

    async def events(self) -> AsyncIterator[dict]:
        backoff = 0.1
        while True:
            try:
                async with connect(self.url) as conn:
                    identity = (await conn.auth(api_key=self.api_key) if self.api_key
                                else await conn.login(self.email, self.password))
                    self.workspace_id = self.workspace_id or identity.get("workspace_id")
                    if self.cursors.scopes or self.cursors.workspace_feed:
                        self.cursors.started(await conn.call("subscribe", workspace_id=self.workspace_id,
                                                             **self.cursors.subscribe_fields()))
                    backoff = 0.1
                    while True:
                        event = await conn.next_event()
                        if self.cursors.accept(event):
                            yield event
            except (OSError, ConnectionError, websockets.WebSocketException):
                self.reconnects += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
