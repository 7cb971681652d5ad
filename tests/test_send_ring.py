"""A publication's gathered sends through io_uring (server/send_ring.py), on real
sockets: every socket gets the bytes once, in order with what was queued before
and after, whatever each socket's buffer takes; results map to their sockets."""

from __future__ import annotations

import errno
import socket
import struct

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsproto.connection import Connection as FrameParser
from wsproto.connection import ConnectionType

from server import send_ring
from server.send_ring import PublicationWrites, SendRing
from server.transport import WebSocket

try:
    SendRing.open().close()
except OSError as unavailable:  # the server falls back to send(); nothing here to test
    pytest.skip(f"io_uring unavailable here: {unavailable}", allow_module_level=True)


def _pairs(count: int, send_buffer: int | None = None) -> list[tuple[socket.socket, socket.socket]]:
    pairs = []
    for _ in range(count):
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        if send_buffer is not None:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        pairs.append((ours, theirs))
    return pairs


def _read_all(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    got = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk


def test_one_call_sends_the_bytes_to_every_socket_across_chunks_and_ring_wraps():
    ring = SendRing.open(entries=8)
    pairs = _pairs(21)  # three chunks of at most 8 per publication; positions wrap
    try:
        sent = []
        for index in range(7):
            data = bytes([index]) * (100 + index)
            assert ring.send([ours.fileno() for ours, _ in pairs], data) is None
            sent.append(data)
        for _, theirs in pairs:
            assert _read_all(theirs) == b"".join(sent)
    finally:
        ring.close()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_a_ring_whose_sends_to_a_full_socket_would_wait_is_refused(monkeypatch):
    """The check at open: a send to a full socket must fail at once.  Without
    MSG_DONTWAIT the kernel parks it until there is room (a stalled client would
    stall the publication): such a ring is not used."""
    monkeypatch.setattr(send_ring, "_SEND_FLAGS", socket.MSG_NOSIGNAL)
    with pytest.raises(OSError, match="wait instead of failing"):
        SendRing.open()


def test_each_socket_gets_its_own_result_a_short_count_eagain_or_an_error():
    ring = SendRing.open(entries=4)
    [(healthy, healthy_peer), (full, full_peer), (reset, reset_peer), (last, last_peer)] = _pairs(4, 4096)
    try:
        reset_peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset_peer.close()
        data = b"x" * 300_000  # more than a 4 KiB send buffer takes
        fds = [healthy.fileno(), full.fileno(), reset.fileno(), last.fileno()]
        first = ring.send(fds, data)
        assert first is not None
        assert 0 < first[0] < len(data) and 0 < first[1] < len(data) and 0 < first[3] < len(data)
        assert first[2] in (-errno.EPIPE, -errno.ECONNRESET)
        # Nothing read: the same sockets are full now.
        again = ring.send([full.fileno(), healthy.fileno()], data)
        assert again == [-errno.EAGAIN, -errno.EAGAIN]
        assert _read_all(healthy_peer) == data[:first[0]]
        assert _read_all(last_peer) == data[:first[3]]
    finally:
        ring.close()
        for sock in (healthy, healthy_peer, full, full_peer, reset, last, last_peer):
            sock.close()


class _Sink:
    """What server/realtime.py's PushState does with a gathered send, minus the cut-off."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    def send_now(self, frames: bytes) -> None:
        self.ws.write_now(frames)

    def sent(self, frames: bytes, result: int) -> None:
        self.ws.sent(frames, result)


async def _publish_and_drain(plan: list[tuple[list[int], int]], connections: int) -> None:
    pairs = _pairs(connections, 4096)
    expected = [bytearray() for _ in pairs]
    writes = PublicationWrites(SendRing.open(entries=4))
    try:
        async with trio.open_nursery() as nursery:
            sockets = [WebSocket(ours, FrameParser(ConnectionType.SERVER), None, spawn=nursery.start_soon,
                                 max_message_bytes=1 << 20, close_grace=1.0) for ours, _ in pairs]
            sinks = [_Sink(ws) for ws in sockets]
            for number, (targets, size) in enumerate(plan):
                data = bytes([number % 251]) * size
                for index in targets:
                    ws = sockets[index]
                    if ws.sends_now:
                        writes.add(ws.fileno(), sinks[index], data)
                    else:  # a backlog: this one goes behind it, as PushState does
                        ws.write_now(data)
                    expected[index] += data
                writes.flush()
            for (_, theirs), want in zip(pairs, expected):
                got = bytearray()
                with trio.fail_after(10):
                    while len(got) < len(want):
                        await trio.lowlevel.wait_readable(theirs)
                        got += theirs.recv(1 << 20)
                assert got == want
    finally:
        writes.close()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=st.lists(st.tuples(st.lists(st.integers(0, 5), unique=True), st.integers(1, 40_000)),
                     min_size=1, max_size=12))
def test_every_socket_gets_every_publication_once_in_order_whatever_its_buffer_takes(plan):
    """Nobody reads until every publication is out: sockets fill, the ring reports short
    counts and EAGAIN, the rest waits in each connection's backlog behind which later
    publications queue."""
    trio.run(_publish_and_drain, plan, 6)


async def test_a_connection_whose_send_fails_is_dropped_and_the_others_get_theirs():
    pairs = _pairs(3)
    _, reset_peer = pairs[1]
    reset_peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset_peer.close()
    writes = PublicationWrites(SendRing.open(entries=4))
    try:
        async with trio.open_nursery() as nursery:
            sockets = [WebSocket(ours, FrameParser(ConnectionType.SERVER), None, spawn=nursery.start_soon,
                                 max_message_bytes=1 << 20, close_grace=1.0) for ours, _ in pairs]
            for ws in sockets:
                writes.add(ws.fileno(), _Sink(ws), b"event")
            writes.flush()
            assert [ws.closing for ws in sockets] == [False, True, False]
            assert sockets[1].close_code == 1006
            assert _read_all(pairs[0][1]) == _read_all(pairs[2][1]) == b"event"
    finally:
        writes.close()
        for ours, theirs in pairs:
            ours.close()
            if theirs is not reset_peer:
                theirs.close()
