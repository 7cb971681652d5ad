"""WebSocket connections on trio, shaped for fanout (RFC 6455 through wsproto).

Why not trio-websocket on the server side: every one of its connections is a
nursery, a reader task, channels, events and a stream lock, and every send is
awaited under that lock.  Fanout wants the opposite: one publisher writing a
prepared frame to a thousand sockets without a task switch.  So a connection
here is a non-blocking socket, a wsproto parser for what the client sends, and
an outgoing buffer:

* `write(frames)` is synchronous.  With nothing queued it goes straight to the
  kernel (one `send` per batch of frames);
  whatever the kernel does not take waits in the buffer, drained in order by a
  flush task that exists only while there is a backlog.
* the connection's own task calls `receive()`: it parses client frames
  (a read that is exactly one whole masked message without wsproto, see
  `_whole_message`), answers pings and runs the closing handshake.
* `close_soon()` queues a close frame and gives the peer `close_grace` seconds
  to answer before the socket is dropped; `abort()` drops it at once.

Server frames are never compressed (no extensions are negotiated), so one
frame's bytes are valid on every connection (server/wire.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from wsproto.connection import Connection as FrameParser
from wsproto.connection import ConnectionState, ConnectionType
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Ping, Pong, RejectConnection, Request,
                            TextMessage)
from wsproto.handshake import H11Handshake
from wsproto.utilities import RemoteProtocolError

log = logging.getLogger("scopewire.transport")

RECV_BYTES = 64 * 1024
CONNECTION_TASK_NAME = "scopewire.connection"
CLOSE_ABNORMAL = 1006
CLOSE_MESSAGE_TOO_BIG = 1009
ACCEPT_BACKOFF_SECONDS = 0.1
ACCEPT_FAILURE_LOG_INTERVAL = 10.0
REFUSED_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\nContent-Length: 0\r\n"
                    b"Connection: close\r\n\r\n")


class ConnectionClosed(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _PendingEvents(list):
    """wsproto's queue of pending events, for the parser's only use of it (append,
    popleft; wsproto 1.3, pinned): a list of the one close event it ever holds, where
    wsproto's own deque allocates a 64-slot block — 760 bytes on every connection."""

    __slots__ = ()

    def popleft(self) -> Any:
        return self.pop(0)


class WebSocket:
    """One accepted WebSocket connection (server side)."""

    __slots__ = ("_sock", "_parser", "subprotocol", "binary", "_spawn", "_max_message_bytes", "_close_grace",
                 "_out", "_flushing", "_drained", "_parts", "_parts_size", "_closing", "_closed", "_closed_event",
                 "_close_deadline", "_read_scope", "_read_deadline", "close_code", "awaiting_pong",
                 "unpark_hook", "direct_write_hook")

    def __init__(self, sock: socket.socket, parser: FrameParser, subprotocol: str | None, *,
                 spawn: Callable[..., Any], max_message_bytes: int, close_grace: float) -> None:
        self._sock = sock
        self._parser = parser
        self.subprotocol = subprotocol
        self.binary = False
        self._spawn = spawn  # starts the flush task in the server's nursery
        self._max_message_bytes = max_message_bytes
        self._close_grace = close_grace
        self._out = bytearray()
        self._flushing = False
        self._drained: trio.Event | None = None
        self._parts: list[Any] = []
        self._parts_size = 0
        self._closing = False   # a close frame was queued: nothing more is written
        self._closed = False    # the socket is closed
        self._closed_event: trio.Event | None = None
        self._close_deadline = float("inf")
        self._read_scope: trio.CancelScope | None = None
        self._read_deadline = math.inf
        self.close_code: int | None = None
        self.awaiting_pong = False
        # Set while the connection is parked without a task (server/parking.py): a
        # close or abort from elsewhere must start one to finish the connection.
        self.unpark_hook: Callable[[WebSocket], None] | None = None
        # Called once when the socket stops taking writes straight to the kernel (bytes
        # queued, closing or closed): a fanout group writing to its descriptor directly
        # lets the connection go before anything could interleave or the descriptor close.
        self.direct_write_hook: Callable[[], None] | None = None

    def fileno(self) -> int:
        return self._sock.fileno()

    # --- writing ---------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Bytes accepted by `write` that the kernel has not taken yet."""
        return len(self._out)

    @property
    def closing(self) -> bool:
        return self._closing or self._closed

    def write(self, frames: list[bytes] | tuple[bytes, ...]) -> bool:
        """Queue whole frames for the peer, in order, without blocking.  False if
        the connection no longer sends (closing or closed)."""
        if self._closing or self._closed:
            return False
        self._write(frames)
        return True

    @property
    def sends_now(self) -> bool:
        """Whether a write would go straight to the kernel: open, nothing queued."""
        return not (self._out or self._closing or self._closed)

    def write_now(self, data: bytes, control: bool = False) -> int:
        """`write` of whole frames already joined, for the fanout's one call per
        subscriber: the bytes still queued after them (the backlog), or -1 if the
        connection no longer sends (`control`: a control frame, which may go out
        while closing)."""
        if not control and (self._closing or self._closed):
            return -1
        if self._out:  # a backlog: keep the order
            self._out += data
            return len(self._out)
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.abort()
            return -1
        return self.sent(data, sent) if sent < len(data) else 0

    def sent(self, data: bytes, sent: int) -> int:
        """After a send of `data` made elsewhere (server/send_ring.py) while `sends_now`:
        `sent` bytes taken, or -errno.  Queues the rest; the backlog, or -1 if the
        send failed (the connection is dropped)."""
        if sent < 0:
            if sent not in (-errno.EAGAIN, -errno.EWOULDBLOCK):
                self.abort()
                return -1
            sent = 0
        if sent < len(data):
            self._out += memoryview(data)[sent:]
            self._end_direct_writes()
            if not self._flushing:
                self._flushing = True
                self._spawn(self._flush)
        return len(self._out)

    def _end_direct_writes(self) -> None:
        hook = self.direct_write_hook
        if hook is not None:
            self.direct_write_hook = None
            hook()

    def _write(self, frames: list[bytes] | tuple[bytes, ...]) -> None:
        if self._out:  # a backlog: keep the order, without joining
            for frame in frames:
                self._out += frame
            return
        # One syscall for the batch; joining measured cheaper than sendmsg's iovec.
        self.write_now(frames[0] if len(frames) == 1 else b"".join(frames), True)

    async def _flush(self) -> None:
        try:
            while self._out and not self._closed:
                try:
                    await trio.lowlevel.wait_writable(self._sock)
                    sent = self._sock.send(self._out)
                except BlockingIOError:
                    continue
                except (OSError, trio.ClosedResourceError):
                    self.abort()
                    return
                del self._out[:sent]
                self._wake_drained()
        finally:
            self._flushing = False
            self._wake_drained()

    def _wake_drained(self) -> None:
        if self._drained is not None and (len(self._out) < RECV_BYTES or self._closed):
            self._drained.set()
            self._drained = None

    async def send(self, frame: bytes, *, high_water: int = 4 * RECV_BYTES,
                   before_waiting: Callable[[], None] | None = None) -> None:
        """Write one frame, then wait while more than `high_water` bytes are
        queued: request replies and replays push back on their own client.
        `before_waiting` is called first when it has to wait."""
        if not self.write((frame,)):
            raise ConnectionClosed(self.close_code or CLOSE_ABNORMAL)
        if before_waiting is not None and len(self._out) > high_water and not self._closed:
            before_waiting()
        while len(self._out) > high_water and not self._closed:
            if self._drained is None:
                self._drained = trio.Event()
            await self._drained.wait()
        if self._closed:
            raise ConnectionClosed(self.close_code or CLOSE_ABNORMAL)

    def ping(self) -> None:
        if not self.closing and self._parser.state is ConnectionState.OPEN:
            self.awaiting_pong = True
            self._write((self._parser.send(Ping(b"hb")),))

    # --- closing ---------------------------------------------------------------------------

    def close_soon(self, code: int, reason: str = "") -> None:
        """Queue a close frame after what is already queued; the peer has
        `close_grace` seconds to answer before the socket is dropped."""
        if self.closing:
            return
        reason = reason.encode()[:120].decode(errors="ignore")
        if self._parser.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            self._write((self._parser.send(CloseConnection(code=code, reason=reason)),))
        self._closing = True
        self._end_direct_writes()
        self.close_code = code
        self._close_deadline = trio.current_time() + self._close_grace
        if self._read_scope is not None:
            self._read_scope.deadline = min(self._read_deadline, self._close_deadline)
        if self.unpark_hook is not None:
            self.unpark_hook(self)

    async def close(self, code: int, reason: str = "") -> None:
        """Close and wait (at most the grace period) until the socket is closed."""
        self.close_soon(code, reason)
        await self.wait_closed()

    async def wait_closed(self) -> None:
        if not self._closed:
            if self._closed_event is None:
                self._closed_event = trio.Event()
            with trio.move_on_at(self._close_deadline + 0.1):
                await self._closed_event.wait()

    def abort(self) -> None:
        """Drop the socket now, without a closing handshake."""
        if self._closed:
            return
        self._closed = True
        self._closing = True
        self._end_direct_writes()
        if self.close_code is None:
            self.close_code = CLOSE_ABNORMAL
        self._out = bytearray()
        if self.unpark_hook is not None:
            self.unpark_hook(self)  # while the descriptor is still open: it leaves the parking lot's set
        trio.lowlevel.notify_closing(self._sock)
        self._sock.close()
        self._wake_drained()
        if self._closed_event is not None:
            self._closed_event.set()
        if self._read_scope is not None:
            self._read_scope.cancel()

    async def _finish(self) -> None:
        """The closing handshake is done: let queued bytes (the close frame) go, then close."""
        with trio.move_on_at(self._close_deadline if self._closing else trio.current_time() + self._close_grace):
            while self._out and not self._closed:
                if self._drained is None:
                    self._drained = trio.Event()
                await self._drained.wait()
        if not self._closed:
            try:
                self._sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self.abort()

    # --- reading ---------------------------------------------------------------------------

    def has_buffered_input(self) -> bool:
        """Whether more has been read from the client than the messages taken: it
        wrote its next frame with (or right behind) the last one."""
        return bool(self._parser._events or len(self._parser._proto._frame_decoder.buffer))  # wsproto 1.3 (pinned)

    def stop_waiting(self) -> None:
        """A receive() under way returns None now, as at its deadline; what has
        arrived of a message stays buffered for the next one."""
        if self._read_scope is not None:
            self._read_scope.cancel()

    async def receive(self, deadline: float = math.inf) -> str | bytes | None:
        """The next whole message from the client, or None when `deadline` passes
        first.  Pings are answered here and the closing handshake completed; then
        ConnectionClosed is raised."""
        while True:
            message = await self._next_message()
            if message is not None:
                return message
            if self._closed:
                raise ConnectionClosed(self.close_code or CLOSE_ABNORMAL)
            # One cancel scope for both deadlines: the caller's, and the closing
            # handshake's, which close_soon() may set while this waits.
            self._read_deadline = deadline
            wait_until = min(deadline, self._close_deadline)
            timed_out = False
            if wait_until > trio.current_time():
                with trio.CancelScope(deadline=wait_until) as scope:
                    self._read_scope = scope
                    try:
                        await trio.lowlevel.wait_readable(self._sock)
                    except trio.ClosedResourceError:
                        pass
                self._read_scope = None
                timed_out = scope.cancelled_caught
            data = b""
            if not timed_out and not self._closed:
                try:
                    data = self._sock.recv(RECV_BYTES)
                except BlockingIOError:
                    if wait_until > trio.current_time():
                        continue
                    # Due on arrival and nothing has come (what did come is read first:
                    # a parked connection is resumed to read it, server/parking.py).
                    timed_out = True
                except OSError:
                    pass
            if timed_out and not self._closed and trio.current_time() < self._close_deadline:
                return None
            if timed_out or self._closed:
                self.abort()  # the peer did not finish the closing handshake in time
                raise ConnectionClosed(self.close_code or CLOSE_ABNORMAL)
            if self._parser.state is ConnectionState.CLOSED:  # defensive: the handshake is over
                self.abort()
                raise ConnectionClosed(self.close_code or CLOSE_ABNORMAL)
            if data and not self._closing:
                message = self._whole_message(data)
                if message is not None:
                    return message
            self._parser.receive_data(data or None)

    def _whole_message(self, data: bytes) -> str | bytes | None:
        """`data` as a message when it is exactly one whole masked text or binary
        frame and the parser holds nothing (no partial frame, no fragmented
        message, no event): what nearly every command is.  Parsed here because
        it is ~7x cheaper than wsproto's generic path (3 µs against 21 µs for a
        200-byte message.send, on the event-loop thread every command runs on).
        None: let wsproto parse it (anything else, including every protocol error)."""
        first, second = data[0], data[1] if len(data) > 1 else 0
        if first not in (0x81, 0x82) or not second & 0x80:  # FIN, no RSV bits, text/binary; masked
            return None
        length, start = second & 0x7F, 6
        if length == 126:
            if len(data) < 8:
                return None
            length, start = int.from_bytes(data[2:4], "big"), 8
            if length < 126:
                return None  # not the minimal length encoding: wsproto refuses it
        elif length == 127:
            return None
        if len(data) != start + length or length > self._max_message_bytes:
            return None
        proto = self._parser._proto  # wsproto 1.3 (pinned): idle means no buffered bytes, no open message
        decoder = proto._frame_decoder
        if (self._parser._events or decoder.header is not None or len(decoder.buffer)
                or proto._message_decoder.opcode is not None or self._parts):
            return None
        mask = data[start - 4:start]
        payload = (int.from_bytes(data[start:], "little")
                   ^ int.from_bytes(mask * (length // 4 + 1), "little") & ((1 << (8 * length)) - 1)
                   ).to_bytes(length, "little")
        if first == 0x82:
            return payload
        try:
            return payload.decode("utf-8")
        except UnicodeDecodeError:
            return None  # wsproto closes with 1007

    async def _next_message(self) -> str | bytes | None:
        for event in self._parser.events():
            if isinstance(event, (TextMessage, BytesMessage)):
                if self._closing:
                    continue
                self._parts.append(event.data)
                self._parts_size += len(event.data)
                if self._parts_size > self._max_message_bytes:
                    self._parts, self._parts_size = [], 0
                    self.close_soon(CLOSE_MESSAGE_TOO_BIG, "message too big")
                    continue
                if event.message_finished:
                    parts, self._parts, self._parts_size = self._parts, [], 0
                    if isinstance(event, TextMessage):
                        return parts[0] if len(parts) == 1 else "".join(parts)
                    return parts[0] if len(parts) == 1 else b"".join(parts)
            elif isinstance(event, Ping):
                # A client that pings without reading gets no pong pile-up: with a
                # backlog the pong is skipped (RFC 6455 §5.5.3 lets a pong answer
                # only the latest ping).
                if not self.closing and len(self._out) < RECV_BYTES:
                    self._write((self._parser.send(Pong(event.payload)),))
            elif isinstance(event, Pong):
                self.awaiting_pong = False
            elif isinstance(event, CloseConnection):
                await self._closed_by_peer(event)
                raise ConnectionClosed(self.close_code or CLOSE_ABNORMAL)
        return None

    async def _closed_by_peer(self, event: CloseConnection) -> None:
        state = self._parser.state
        if self.close_code is None:
            self.close_code = event.code
        if state in (ConnectionState.REMOTE_CLOSING, ConnectionState.OPEN) and not self._closed:
            # The peer started the closing handshake (REMOTE_CLOSING) or broke the
            # protocol (OPEN: wsproto reports a parse failure as a close): answer.
            reply = event.response() if state is ConnectionState.REMOTE_CLOSING else event
            self._write((self._parser.send(reply),))
            self._closing = True
            self._end_direct_writes()
        await self._finish()


# --- accepting -------------------------------------------------------------------------------


async def accept_loop(listener: trio.SocketListener, handle: Callable[[socket.socket], Any],
                      nursery: trio.Nursery) -> None:
    """Accept TCP connections and start `handle(sock)` for each as its own task."""
    failures_unlogged, next_log = 0, float("-inf")
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                # Out of descriptors (or memory): back off until some are freed,
                # and say so at most once per interval, not at every retry.
                failures_unlogged += 1
                if trio.current_time() >= next_log:
                    log.warning("accept failed: %s; backing off", exc, extra={"failures": failures_unlogged})
                    failures_unlogged, next_log = 0, trio.current_time() + ACCEPT_FAILURE_LOG_INTERVAL
                await trio.sleep(ACCEPT_BACKOFF_SECONDS)  # not a synchronization: waiting for descriptors
                continue
            raise
        # Keep the plain non-blocking socket: writes are made synchronously from
        # the publishing task (see the module docstring).
        sock = socket.socket(fileno=stream.socket.detach())
        sock.setblocking(False)
        # A fixed task name: trio otherwise builds one string per task from the function.
        nursery.start_soon(handle, sock, name=CONNECTION_TASK_NAME)


def peer_address(sock: socket.socket) -> str:
    """The client's IP address ("" when the peer is already gone); interned, as the
    connections behind one proxy or NAT share it."""
    try:
        return sys.intern(sock.getpeername()[0])
    except OSError:
        return ""


def refuse(sock: socket.socket) -> None:
    """Answer a handshake over the connection caps with HTTP 503 and close,
    without waiting for anything (best effort: the socket is non-blocking)."""
    with contextlib.suppress(OSError):
        sock.recv(RECV_BYTES)  # what the client already sent: unread data would turn our close into a reset
    with contextlib.suppress(OSError):
        sock.send(REFUSED_RESPONSE)
        sock.shutdown(socket.SHUT_WR)
    sock.close()


PlainHttp = Callable[[str, str], Awaitable[bytes | None]]


async def handshake(sock: socket.socket, *, deadline: float, choose_subprotocol: Callable[[list[str]], str | None],
                    spawn: Callable[..., Any], max_message_bytes: int, close_grace: float,
                    plain_http: PlainHttp | None = None) -> WebSocket | None:
    """Run the HTTP upgrade.  None (socket closed) when the client does not
    complete a valid WebSocket handshake by `deadline`.  A request that is not
    an upgrade is offered to `plain_http(method, target)`: the whole response
    to send, or None for HTTP 400."""
    upgrade = H11Handshake(ConnectionType.SERVER)
    try:
        return await _upgrade(sock, upgrade, deadline, choose_subprotocol, spawn, max_message_bytes, close_grace,
                              plain_http)
    except BaseException:  # e.g. cancelled at shutdown: do not leak the socket
        trio.lowlevel.notify_closing(sock)
        sock.close()
        raise


async def _upgrade(sock: socket.socket, upgrade: H11Handshake, deadline: float,
                   choose_subprotocol: Callable[[list[str]], str | None], spawn: Callable[..., Any],
                   max_message_bytes: int, close_grace: float, plain_http: PlainHttp | None) -> WebSocket | None:
    head = b""  # the request so far, kept to read a plain request's first line
    with trio.move_on_at(deadline):
        while True:
            try:
                await trio.lowlevel.wait_readable(sock)
                data = sock.recv(RECV_BYTES)
            except BlockingIOError:
                continue
            except OSError:
                break
            if not data:
                break
            if len(head) < RECV_BYTES:
                head += data
            try:
                upgrade.receive_data(data)
                request = next((e for e in upgrade.events() if isinstance(e, Request)), None)
            except RemoteProtocolError as exc:
                line = _request_line(head) if plain_http is not None else None
                response = await plain_http(*line) if line is not None else None
                hint = exc.event_hint if isinstance(exc.event_hint, RejectConnection) else RejectConnection()
                with contextlib.suppress(OSError):
                    await _send_all(sock, response if response is not None else upgrade.send(hint))
                    sock.shutdown(socket.SHUT_WR)
                break
            if request is None:
                continue
            subprotocol = choose_subprotocol(list(request.subprotocols))
            try:
                await _send_all(sock, upgrade.send(AcceptConnection(subprotocol=subprotocol)))
            except OSError:
                break
            parser = upgrade.connection
            assert parser is not None
            parser._events = _PendingEvents()
            return WebSocket(sock, parser, subprotocol, spawn=spawn, max_message_bytes=max_message_bytes,
                             close_grace=close_grace)
    trio.lowlevel.notify_closing(sock)
    sock.close()
    return None


def _request_line(head: bytes) -> tuple[str, str] | None:
    """(method, target) of an HTTP/1.x request head, or None."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None
    return parts[0].decode("ascii", "replace"), parts[1].decode("ascii", "replace")


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
