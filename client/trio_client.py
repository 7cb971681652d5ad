"""A trio client: connect, authenticate, request/response with typed errors."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import trio_websocket


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
        # Pushes that arrived while waiting for a reply, in arrival order.
        self.events: collections.deque[dict] = collections.deque()

    async def call(self, op: str, **fields: Any) -> Any:
        """Send one request and return its result data; ClientError on an error reply."""
        request_id = str(next(self._ids))
        await self.ws.send_message(json.dumps({"op": op, "id": request_id, **fields}))
        while True:
            reply = json.loads(await self.ws.get_message())
            if reply.get("type") == "event":
                self.events.append(reply)
            elif reply.get("id") == request_id:
                break
        if reply["type"] == "error":
            raise ClientError(reply["code"], reply["message"], reply.get("details"))
        return reply["data"]

    async def next_event(self) -> dict:
        """The next push (waiting for it if none is queued)."""
        while not self.events:
            frame = json.loads(await self.ws.get_message())
            if frame.get("type") == "event":
                self.events.append(frame)
        return self.events.popleft()

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
                await self.ws.get_message()
        assert self.ws.closed is not None
        return self.ws.closed.code


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[Connection]:
    async with trio_websocket.open_websocket_url(url) as ws:
        yield Connection(ws)
