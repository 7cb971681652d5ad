"""The server's WebSocket transport (server/transport.py) at the byte level,
driven by a raw socket and wsproto as the client: handshakes, control frames,
fragmentation, protocol violations and the closing handshake.  After every
misbehaving client the server still serves the next one."""

from __future__ import annotations

import contextlib
import json
import socket
import struct

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection as FrameWriter
from wsproto.events import AcceptConnection, CloseConnection, Message, Ping, Pong, Request, TextMessage

from protocol import frames
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from storage.bridge import Database
from tests.conftest import App


class RawClient:
    """A WebSocket client with nothing hidden: wsproto over a trio stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.pending: list = []

    @classmethod
    async def open(cls, app: App, subprotocols: list[str] | None = None) -> tuple[RawClient, object]:
        return await cls.open_port(app.server.port, subprotocols)

    @classmethod
    async def open_port(cls, port: int, subprotocols: list[str] | None = None) -> tuple[RawClient, object]:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await client.stream.send_all(client.ws.send(Request(host="localhost", target="/",
                                                           subprotocols=subprotocols or [])))
        return client, await client.next_event()

    async def send(self, event) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def next_event(self):
        with trio.fail_after(10):
            while not self.pending:
                data = await self.stream.receive_some(65536)
                self.ws.receive_data(data or None)
                self.pending.extend(self.ws.events())
        return self.pending.pop(0)

    @staticmethod
    def parse(event) -> dict:
        """The one place raw clients decode a server frame (the conformance fixture checks it)."""
        assert isinstance(event, TextMessage) and event.message_finished, event
        return json.loads(event.data)

    async def next_message(self) -> dict:
        return self.parse(await self.next_event())


async def assert_still_serving(app: App) -> None:
    client, accepted = await RawClient.open(app)
    assert isinstance(accepted, AcceptConnection)
    await client.send(Message(data=json.dumps({"op": "ping", "id": "alive"})))
    assert (await client.next_message())["id"] == "alive"
    await client.stream.aclose()


async def test_subprotocol_is_negotiated(app: App):
    client, accepted = await RawClient.open(app, ["other", "scopewire.json"])
    assert isinstance(accepted, AcceptConnection) and accepted.subprotocol == "scopewire.json"
    await client.stream.aclose()


async def test_plain_http_is_rejected_and_the_server_lives_on(app: App):
    stream = await trio.open_tcp_stream("127.0.0.1", app.server.port)
    await stream.send_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    response = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(4096):
            response += chunk
    assert response.startswith(b"HTTP/1.1 400")
    await assert_still_serving(app)


async def test_a_handshake_that_never_finishes_is_dropped(app: App):
    stream = await trio.open_tcp_stream("127.0.0.1", app.server.port)
    await stream.send_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n")  # never completed
    with trio.fail_after(app.server.config.auth_timeout_seconds + 5):
        assert await stream.receive_some(4096) == b""
    await assert_still_serving(app)


async def test_pings_are_answered_and_fragments_assembled(app: App):
    client, _ = await RawClient.open(app)
    await client.send(Ping(payload=b"are you there"))
    pong = await client.next_event()
    assert isinstance(pong, Pong) and pong.payload == b"are you there"
    text = json.dumps({"op": "ping", "id": "fragmented", "padding": "é" * 300})
    split = len(text) // 2
    await client.send(Message(data=text[:split], message_finished=False))
    await client.send(Ping(payload=b"between fragments"))  # control frames may interleave
    await client.send(Message(data=text[split:], message_finished=True))
    assert isinstance(await client.next_event(), Pong)
    assert (await client.next_message())["id"] == "fragmented"
    await client.stream.aclose()


async def test_the_client_closing_handshake_is_answered(app: App):
    client, _ = await RawClient.open(app)
    await client.send(CloseConnection(code=1000, reason="bye"))
    closing = await client.next_event()
    assert isinstance(closing, CloseConnection) and closing.code == 1000
    with trio.fail_after(10):
        assert await client.stream.receive_some(4096) == b""  # then the server closes TCP
    assert not app.server.connections.all


@pytest.mark.parametrize("raw_frame, code", [
    # An unmasked client frame (RFC 6455 §5.1: the server must fail the connection).
    (struct.pack("!BB", 0x81, 2) + b"hi", 1002),
    # A reserved opcode.
    (struct.pack("!BB", 0x83, 0x80) + b"\0\0\0\0", 1002),
    # Text that is not UTF-8.
    (struct.pack("!BB", 0x81, 0x82) + b"\0\0\0\0" + b"\xff\xfe", 1007),
])
async def test_protocol_violations_close_with_the_rfc_code(app: App, raw_frame: bytes, code: int):
    client, _ = await RawClient.open(app)
    await client.stream.send_all(raw_frame)
    closing = await client.next_event()
    assert isinstance(closing, CloseConnection) and closing.code == code
    await client.stream.aclose()
    await assert_still_serving(app)


async def test_server_close_codes_reach_a_raw_client(app: App):
    # Unauthenticated past the timeout: an error frame, then close 4401.
    client, _ = await RawClient.open(app)
    error = await client.next_message()
    assert error["type"] == "error" and error["code"] == "unauthenticated"
    closing = await client.next_event()
    assert isinstance(closing, CloseConnection) and closing.code == frames.CLOSE_UNAUTHENTICATED
    await client.send(closing.response())
    with trio.fail_after(10):
        assert await client.stream.receive_some(4096) == b""


async def test_a_rejected_handshake_gets_http_status(app: App):
    stream = await trio.open_tcp_stream("127.0.0.1", app.server.port)
    # A WebSocket upgrade without the key.
    await stream.send_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          b"Sec-WebSocket-Version: 13\r\n\r\n")
    response = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(4096):
            response += chunk
    assert response.split(b" ", 2)[1] in (b"400", b"426")
    await assert_still_serving(app)


# --- any TCP segmentation of any mix of fragmented messages and pings ---------------------------

message_plans = st.lists(
    st.tuples(st.integers(min_value=1, max_value=4),      # fragments of this request
              st.booleans(),                               # a ping right after its first fragment
              st.text(max_size=40)),                       # padding (any unicode)
    min_size=1, max_size=8)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=message_plans, cuts=st.lists(st.integers(min_value=1, max_value=4096), max_size=12))
def test_any_segmentation_of_the_byte_stream_gets_every_reply_in_order(database_dsn, plan, cuts):
    trio.run(_segmented, database_dsn, plan, cuts)


async def _segmented(dsn: str, plan: list, cuts: list[int]) -> None:
    wire = bytearray()
    writer = FrameWriter(ConnectionType.CLIENT)  # client frames, as after the upgrade
    pings = 0
    for number, (fragments, ping, padding) in enumerate(plan):
        text = json.dumps({"op": "ping", "id": str(number), "padding": padding}, ensure_ascii=False)
        step = max(1, len(text) // fragments)
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for index, piece in enumerate(pieces):
            wire += writer.send(Message(data=piece, message_finished=index == len(pieces) - 1))
            if ping and index == 0:
                wire += writer.send(Ping(payload=str(number).encode()))
                pings += 1
    async with Database(dsn) as db, trio.open_nursery() as nursery:
        server = Server(ServerConfig(port=0, shutdown_grace_seconds=1), db,
                        Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
        port = await nursery.start(server.run)
        # The handshake goes alone (a client may not send frames before the 101);
        # the frames after it are cut at arbitrary points.
        client, accepted = await RawClient.open_port(port)
        assert isinstance(accepted, AcceptConnection)
        rest, offset = memoryview(wire), 0
        for cut in sorted(set(cuts)) + [len(rest)]:
            if cut > offset:
                await client.stream.send_all(rest[offset:cut])
                offset = cut
        replies, pongs = [], 0
        while len(replies) < len(plan) or pongs < pings:
            event = await client.next_event()
            if isinstance(event, Pong):
                pongs += 1
            else:
                replies.append(client.parse(event)["id"])
        assert replies == [str(n) for n in range(len(plan))]
        await client.stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_client_that_pings_without_reading_cannot_grow_server_memory(app: App, tenants):
    alpha, _ = tenants
    client, _ = await RawClient.open(app)
    # Authenticated first: the flood takes longer than the auth timeout on a busy machine.
    await client.send(Message(data=json.dumps({"op": "login", "id": "login", "email": alpha.owner.email,
                                               "password": alpha.owner.password})))
    assert (await client.next_message())["type"] == "result"
    ping = client.ws.send(Ping(payload=b"p" * 125))
    pings = 300_000  # ~40 MB of pings, and not a byte read meanwhile
    with trio.fail_after(60):
        for _ in range(pings // 1000):
            await client.stream.send_all(ping * 1000)
        await client.send(Message(data=json.dumps({"op": "ping", "id": "after"})))
        # The server answers only what fits beside an empty backlog; the rest of
        # the pongs are skipped, then the reply arrives.
        pongs = 0
        while isinstance(event := await client.next_event(), Pong):
            pongs += 1
    assert client.parse(event)["id"] == "after"
    # What the kernel buffers hold is a few MB at most: far fewer pongs than pings.
    assert pongs < pings // 2
    await client.stream.aclose()


async def test_clients_that_reset_mid_handshake_do_not_hurt_the_server(app: App):
    request = (b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    for _ in range(20):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", app.server.port))
        await sock.send(request)
        # Close with a TCP reset (linger 0) while the server answers.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    await assert_still_serving(app)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(garbage=st.lists(st.binary(min_size=1, max_size=700), min_size=1, max_size=4),
       masked=st.booleans())
def test_random_bytes_after_the_handshake_never_hurt_the_server(database_dsn, garbage, masked):
    trio.run(_garbage, database_dsn, garbage, masked)


async def _garbage(dsn: str, garbage: list[bytes], masked: bool) -> None:
    async with Database(dsn) as db, trio.open_nursery() as nursery:
        server = Server(ServerConfig(port=0, shutdown_grace_seconds=1, max_frame_bytes=4096), db,
                        Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
        port = await nursery.start(server.run)
        client, _ = await RawClient.open_port(port)
        for chunk in garbage:
            if masked:  # a plausible masked frame header in front of random payload
                chunk = struct.pack("!BB", chunk[0] | 0x80, 0x80 | min(len(chunk), 125)) + b"\0\0\0\0" + chunk[:125]
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await client.stream.send_all(chunk)
        await client.stream.aclose()
        # Whatever that was, the server answers the next client.
        fresh, accepted = await RawClient.open_port(port)
        assert isinstance(accepted, AcceptConnection)
        await fresh.send(Message(data=json.dumps({"op": "ping", "id": "alive"})))
        assert (await fresh.next_message())["id"] == "alive"
        await fresh.stream.aclose()
        nursery.cancel_scope.cancel()



async def test_whole_frame_commands_bypass_wsproto_and_fragments_do_not(app: App):
    client, _ = await RawClient.open(app)
    (connection,) = app.server.connections.all
    parser = connection.ws._parser
    fed: list[bytes] = []
    feed = parser.receive_data
    parser.receive_data = lambda data: (fed.append(data), feed(data))[1]
    for number in range(3):
        await client.send(Message(data=json.dumps({"op": "ping", "id": f"whole-{number}"})))
        assert (await client.next_message())["id"] == f"whole-{number}"
    assert fed == []
    await client.send(Message(data='{"op": "ping", ', message_finished=False))
    await client.send(Message(data='"id": "in two"}'))
    assert (await client.next_message())["id"] == "in two"
    assert fed  # the fragments went through wsproto
    await client.stream.aclose()

# --- the whole-frame fast path agrees with wsproto -----------------------------------------------

def _server_side(max_message_bytes: int = 1 << 20):
    from server.transport import FrameParser as ServerParser
    from server.transport import WebSocket
    parser = ServerParser(ConnectionType.SERVER)
    return WebSocket(None, parser, None, spawn=None, max_message_bytes=max_message_bytes, close_grace=1.0), parser


def _wsproto_messages(parser, data: bytes) -> list:
    parser.receive_data(data)
    return [e for e in parser.events()]


@settings(max_examples=300, deadline=None)
@given(payload=st.one_of(st.text(max_size=300), st.binary(max_size=300),
                         st.integers(min_value=120, max_value=70_000).map(lambda n: "é" * (n // 2) + "x" * (n % 2))),
       mask=st.binary(min_size=4, max_size=4), flip=st.integers(min_value=0, max_value=10_000),
       max_message_bytes=st.sampled_from([64, 4096, 1 << 20]))
def test_a_whole_frame_reads_as_wsproto_reads_it(payload, mask, flip, max_message_bytes):
    """Any single masked frame (text, binary, every length encoding, a max-size limit, one byte
    flipped anywhere or not): the fast path returns exactly wsproto's message, or declines."""
    body = payload.encode() if isinstance(payload, str) else payload
    opcode = 0x81 if isinstance(payload, str) else 0x82
    if len(body) < 126:
        head = struct.pack("!BB", opcode, 0x80 | len(body))
    elif len(body) < 1 << 16:
        head = struct.pack("!BBH", opcode, 0x80 | 126, len(body))
    else:
        head = struct.pack("!BBQ", opcode, 0x80 | 127, len(body))
    frame = bytearray(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(body)))
    if flip < len(frame) and flip % 3:  # two in three examples with a flip in range: a corrupted frame
        frame[flip] ^= 0x5A
    ws, parser = _server_side(max_message_bytes)
    fast = ws._whole_message(bytes(frame))
    if fast is None:
        return  # declined: wsproto parses it (the server path then feeds the parser)
    events = _wsproto_messages(FrameWriter(ConnectionType.SERVER), bytes(frame))
    assert len(events) == 1 and isinstance(events[0], Message) and events[0].message_finished
    assert events[0].data == fast and len(body) <= max_message_bytes
    assert parser.state.name == "OPEN"


def test_the_fast_path_declines_while_the_parser_holds_anything():
    """A whole-looking frame must not overtake what wsproto holds: a fragmented message in
    progress (then it is a protocol error wsproto reports), or a partial frame; nor is a
    non-minimal length encoding taken (wsproto fails the connection for it)."""
    whole = FrameWriter(ConnectionType.CLIENT).send(Message(data="whole"))
    first = FrameWriter(ConnectionType.CLIENT).send(Message(data="first part", message_finished=False))
    ws, parser = _server_side()
    assert ws._whole_message(whole) == "whole"
    parser.receive_data(first)
    assert [type(e).__name__ for e in parser.events()] == ["TextMessage"]
    assert ws._whole_message(whole) is None  # a message is open
    ws, _ = _server_side()  # "whole" with a 16-bit length field where 7 bits suffice: a violation
    assert ws._whole_message(bytes([whole[0], 0x80 | 126, 0, len(whole) - 6]) + whole[2:]) is None
    ws, parser = _server_side()
    parser.receive_data(whole[:3])
    list(parser.events())
    assert ws._whole_message(whole) is None  # a partial frame is buffered
