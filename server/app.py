"""The WebSocket server: accept connections, decode frames, dispatch, reply.

Shutdown order (SIGINT/SIGTERM or cancellation of `run`): stop accepting, close
every live connection with 1001 "going away", then let the caller stop the
actors and the database.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
import trio_websocket

from protocol import frames
from protocol.codec import decode_request, encode, error_frame
from protocol.errors import ErrorCode, ProtocolError
from server.config import ServerConfig
from storage.bridge import Database
from storage.errors import DatabaseUnavailable

log = logging.getLogger("scopewire.server")

MSGPACK_SUBPROTOCOL = "scopewire.msgpack"
JSON_SUBPROTOCOL = "scopewire.json"
MAX_FRAME_BYTES = 256 * 1024


@dataclass
class Server:
    config: ServerConfig
    db: Database
    connections: set[trio_websocket.WebSocketConnection] = field(default_factory=set)
    port: int | None = None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; then close every connection before returning."""
        async with trio.open_nursery() as handlers:
            try:
                async with trio.open_nursery() as listener:
                    ws_server = await listener.start(
                        partial(
                            trio_websocket.serve_websocket,
                            self._handle,
                            self.config.host,
                            self.config.port,
                            None,
                            handler_nursery=handlers,
                            max_message_size=MAX_FRAME_BYTES,
                        )
                    )
                    self.port = ws_server.port
                    task_status.started(ws_server.port)
                    await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await self._close_all()
                handlers.cancel_scope.cancel()

    async def _close_all(self) -> None:
        with trio.move_on_after(self.config.shutdown_grace_seconds):
            async with trio.open_nursery() as closers:
                for ws in list(self.connections):
                    closers.start_soon(ws.aclose, 1001, "server shutting down")

    async def _handle(self, request: trio_websocket.WebSocketRequest) -> None:
        offered = request.proposed_subprotocols
        subprotocol = next((p for p in (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL) if p in offered), None)
        ws = await request.accept(subprotocol=subprotocol)
        binary = subprotocol == MSGPACK_SUBPROTOCOL
        self.connections.add(ws)
        try:
            await self._serve_connection(ws, binary)
        except trio_websocket.ConnectionClosed:
            pass
        finally:
            self.connections.discard(ws)

    async def _serve_connection(self, ws: trio_websocket.WebSocketConnection, binary: bool) -> None:
        while True:
            raw = await ws.get_message()
            request_id: str | None = None
            try:
                request = decode_request(raw, binary=binary)
                request_id = request.id
                reply: Any = frames.Result(id=request.id, op=type(request).__struct_config__.tag,
                                           data=await self._dispatch(request))
            except ProtocolError as exc:
                reply = error_frame(exc, request_id if request_id is not None else exc.details.get("id"))
            except DatabaseUnavailable:
                reply = error_frame(ProtocolError(ErrorCode.UNAVAILABLE, "database unavailable, retry"), request_id)
            except Exception:
                log.exception("request failed", extra={"request_id": request_id})
                reply = error_frame(ProtocolError(ErrorCode.INTERNAL, "internal error"), request_id)
            payload = encode(reply, binary=binary)
            await ws.send_message(payload if binary else payload.decode())

    async def _dispatch(self, request: frames.Request) -> Any:
        if isinstance(request, frames.Ping):
            return frames.PingResult(server_time_ms=time.time_ns() // 1_000_000)
        raise ProtocolError(ErrorCode.UNKNOWN_OP, "unknown op")
