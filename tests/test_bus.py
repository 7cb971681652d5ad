"""The cross-node bus transports (server/bus.py): PostgreSQL NOTIFY and NATS.

Every test runs two nodes, each with its own Database bridge on the test's
PostgreSQL database and its own transport; the NATS tests run a private
nats-server process and restart it for real (SIGKILL, start again on the same
port)."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.bus import BusTransport, Delivery, PgNotifyTransport
from server.bus_nats import BusPayloadTooLarge, BusUnavailable, NatsTransport
from storage import cluster_bus
from storage.bridge import Database, PoolSettings

NATS_BINARY = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/local/sbin:/usr/sbin:/sbin")
NATS_DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default max_payload (the test server keeps it)
RECEIVE_SECONDS = 10.0  # a bound on waiting for deliveries, not a synchronization


# --- a private nats-server ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class NatsServer:
    def __init__(self, binary: str, port: int, log_path: Path) -> None:
        self.binary = binary
        self.port = port
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server and return once it accepts connections (blocking)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([self.binary, "-a", "127.0.0.1", "-p", str(self.port)],
                                            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not accept connections on {self.port} within 10 s")
                time.sleep(0.02)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def nats_server(tmp_path: Path):
    if NATS_BINARY is None:
        pytest.skip("nats-server is not installed (Debian package nats-server; .ci/run installs it with apt-get)")
    server = NatsServer(NATS_BINARY, _free_port(), tmp_path / "nats-server.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()


# --- two nodes on one PostgreSQL ------------------------------------------------------------------


@dataclass
class TransportKind:
    name: str
    make: Callable[[Database], BusTransport]


@pytest.fixture(params=["postgres", "nats"])
def transport_kind(request: pytest.FixtureRequest) -> TransportKind:
    if request.param == "postgres":
        return TransportKind("postgres", PgNotifyTransport)
    server: NatsServer = request.getfixturevalue("nats_server")
    return TransportKind("nats", lambda db: NatsTransport(db, server.url, reconnect_wait=0.1, send_timeout=2.0))


@dataclass
class Node:
    node_id: str
    db: Database
    transport: BusTransport
    deliveries: trio.MemoryReceiveChannel[Delivery]


@asynccontextmanager
async def bus_node(dsn: str, make: Callable[[Database], BusTransport], node_id: str) -> AsyncIterator[Node]:
    """A node as server/cluster.py runs one: open, then the transport's pump if it has one."""
    async with Database(dsn, PoolSettings(min_size=1, max_size=4)) as db, trio.open_nursery() as nursery:
        transport = make(db)
        deliveries = await transport.open(node_id)
        pump = getattr(transport, "pump", None)
        if pump is not None:
            nursery.start_soon(pump)
        try:
            yield Node(node_id, db, transport, deliveries)
        finally:
            await transport.aclose()


@asynccontextmanager
async def two_nodes(dsn: str, make: Callable[[Database], BusTransport]) -> AsyncIterator[tuple[Node, Node]]:
    suffix = uuid.uuid4().hex[:8]  # fresh sender ids: the spill table is keyed by (node, seq)
    async with bus_node(dsn, make, f"a-{suffix}") as a, bus_node(dsn, make, f"b-{suffix}") as b:
        yield a, b


def _summary(deliveries: list[Delivery]) -> list[tuple]:
    return [(d.sender, d.seq, None if d.payload is None else len(d.payload), d.resync) for d in deliveries]


async def receive_until(node: Node, last_seqs: dict[str, int]) -> list[Delivery]:
    """Deliveries up to and including each sender's `last_seqs` entry."""
    remaining = dict(last_seqs)
    received: list[Delivery] = []
    with trio.move_on_after(RECEIVE_SECONDS):
        while remaining:
            delivery = await node.deliveries.receive()
            received.append(delivery)
            if remaining.get(delivery.sender) == delivery.seq:
                del remaining[delivery.sender]
        return received
    pytest.fail(f"{node.node_id} still waits for {remaining} after {RECEIVE_SECONDS} s; "
                f"received (sender, seq, size, resync): {_summary(received)}")


async def receive_until_resync(node: Node) -> list[Delivery]:
    received: list[Delivery] = []
    with trio.move_on_after(RECEIVE_SECONDS):
        while not (received and received[-1].resync):
            received.append(await node.deliveries.receive())
        return received
    pytest.fail(f"{node.node_id} got no resync in {RECEIVE_SECONDS} s; received: {_summary(received)}")


async def send_batches(node: Node, batches: list[list[bytes]], first_seq: int = 1) -> int:
    """Send each batch as one `send`, numbering on; returns the last seq sent."""
    seq = first_seq
    for batch in batches:
        await node.transport.send(node.node_id, seq, batch)
        seq += len(batch)
    return seq - 1


def numbered(batches: list[list[bytes]], first_seq: int = 1) -> list[tuple[int, bytes]]:
    payloads = [payload for batch in batches for payload in batch]
    return list(enumerate(payloads, start=first_seq))


def from_sender(deliveries: list[Delivery], sender: str) -> list[tuple[int, bytes | None]]:
    return [(d.seq, d.payload) for d in deliveries if d.sender == sender]


# --- both transports --------------------------------------------------------------------------------


async def test_every_node_receives_the_other_nodes_sends_in_order(database_dsn, transport_kind):
    rng = random.Random(18)
    async with two_nodes(database_dsn, transport_kind.make) as (a, b):
        sent = {
            a.node_id: [[b"a1", b"a2", b"a3"], [b"a4"], [rng.randbytes(3000) for _ in range(5)], [b"a10"]],
            b.node_id: [[b"b1"], [b"b2", b"b3"], [rng.randbytes(100) for _ in range(20)]],
        }
        last_seqs: dict[str, int] = {}
        async with trio.open_nursery() as nursery:  # both nodes send at once
            async def send_from(node: Node) -> None:
                last_seqs[node.node_id] = await send_batches(node, sent[node.node_id])
            nursery.start_soon(send_from, a)
            nursery.start_soon(send_from, b)
        assert last_seqs == {a.node_id: 10, b.node_id: 23}
        for receiver, sender in ((a, b), (b, a)):
            received = await receive_until(receiver, {sender.node_id: last_seqs[sender.node_id]})
            assert [d for d in received if d.resync] == []
            assert from_sender(received, sender.node_id) == numbered(sent[sender.node_id]), receiver.node_id
    with trio.fail_after(RECEIVE_SECONDS):  # closed: each channel ends after what it still holds
        for node in (a, b):
            async for _ in node.deliveries:
                pass


async def test_a_node_does_not_receive_its_own_sends(database_dsn, transport_kind):
    """server/bus.py: "every later send of every other node" — a node's own never come back."""
    async with two_nodes(database_dsn, transport_kind.make) as (a, b):
        await send_batches(a, [[b"a1", b"a2"], [b"a3"]])
        await b.transport.send(b.node_id, 1, [b"b1"])  # sent after a's: it arrives after them
        received = await receive_until(a, {b.node_id: 1})
        assert [(d.sender, d.seq, d.payload, d.resync) for d in received] == [(b.node_id, 1, b"b1", False)]


async def test_equal_and_empty_payloads_of_one_send_all_arrive(database_dsn, transport_kind):
    """PostgreSQL folds identical notifications of one transaction: the seq in each keeps them apart."""
    async with two_nodes(database_dsn, transport_kind.make) as (a, b):
        batch = [b"same", b"same", b"", b"same", b""]
        await a.transport.send(a.node_id, 1, batch)
        await a.transport.send(a.node_id, 6, [b"end"])
        received = await receive_until(b, {a.node_id: 6})
        assert [(d.sender, d.seq, d.payload, d.resync) for d in received] == [
            (a.node_id, seq, payload, False) for seq, payload in numbered([batch, [b"end"]])]


# --- PostgreSQL -------------------------------------------------------------------------------------


async def test_postgres_payload_over_the_notify_limit_arrives_through_the_spill_table(database_dsn):
    big = random.Random(50).randbytes(50_000)
    async with two_nodes(database_dsn, PgNotifyTransport) as (a, b):
        await a.transport.send(a.node_id, 1, [b"small", big, b"small"])
        received = await receive_until(b, {a.node_id: 3})
        assert [(d.seq, d.payload, d.resync) for d in received] == [
            (1, b"small", False), (2, big, False), (3, b"small", False)]
        spilled = await a.db.run(lambda conn: conn.fetch(
            "SELECT bus_seq, payload FROM cluster_bus_spill WHERE node_id = $1 ORDER BY bus_seq", a.node_id))
        assert [(row["bus_seq"], row["payload"]) for row in spilled] == [(2, big)]



@pytest.mark.parametrize("payloads", [[b"small"], [b"small", b"x" * 50_000]], ids=["inline", "spilled"])
async def test_a_postgres_bus_send_commits_without_waiting_for_a_wal_flush(database_dsn, payloads):
    """The bus is not durable, and a NOTIFY takes a transaction id: its commit must not be one
    more fsync'd commit beside the owner's own."""
    async with Database(database_dsn, PoolSettings(min_size=1, max_size=1)) as db:
        async def send_and_look(conn) -> tuple[str, str]:
            await conn.execute("SET synchronous_commit = on")  # a durable server's (the test cluster's is off)
            async with conn.transaction():
                await cluster_bus.notify(conn, "node-x", 1, payloads)
                inside = await conn.fetchval("SHOW synchronous_commit")  # what this transaction commits with
            return inside, await conn.fetchval("SHOW synchronous_commit")
        assert await db.run(send_and_look) == ("off", "on"), "off for the send's transaction only"


# --- NATS -------------------------------------------------------------------------------------------


def _nats(server: NatsServer) -> Callable[[Database], NatsTransport]:
    return lambda db: NatsTransport(db, server.url, reconnect_wait=0.1, send_timeout=2.0)


async def test_nats_payload_over_max_payload_is_refused_and_nothing_of_its_send_published(database_dsn,
                                                                                        nats_server):
    async with two_nodes(database_dsn, _nats(nats_server)) as (a, b):
        with pytest.raises(BusPayloadTooLarge, match="max_payload of 1048576 bytes"):
            await a.transport.send(a.node_id, 1, [b"small", bytes(NATS_DEFAULT_MAX_PAYLOAD)])
        fits = random.Random(1).randbytes(NATS_DEFAULT_MAX_PAYLOAD - 64)  # room for the header
        await a.transport.send(a.node_id, 3, [fits])
        received = await receive_until(b, {a.node_id: 3})
        assert [(d.seq, d.payload, d.resync) for d in received] == [(3, fits, False)]


async def test_nats_restart_yields_a_resync_and_later_sends_arrive(database_dsn, nats_server):
    async with two_nodes(database_dsn, _nats(nats_server)) as (a, b):
        await a.transport.send(a.node_id, 1, [b"before"])
        received = await receive_until(b, {a.node_id: 1})
        assert [(d.seq, d.payload, d.resync) for d in received] == [(1, b"before", False)]

        nats_server.kill()
        with pytest.raises(BusUnavailable):
            await a.transport.send(a.node_id, 2, [b"during"])
        await trio.to_thread.run_sync(nats_server.start)

        # Both nodes reconnected (a must be, to send; b must be, to receive what a sends next).
        await receive_until_resync(a)
        received = await receive_until_resync(b)
        await a.transport.send(a.node_id, 3, [b"after"])
        received += await receive_until(b, {a.node_id: 3})
        after_resync = received[next(i for i, d in enumerate(received) if d.resync) + 1:]
        # "during" failed to send; a publish racing the disconnect may still go out on reconnect.
        assert [(d.seq, d.payload) for d in after_resync if d.payload != b"during"] == [(3, b"after")]
        assert all(d.payload in (None, b"during", b"after") for d in received), _summary(received)


async def test_nats_open_fails_when_no_server_answers_and_leaves_nothing_running(database_dsn):
    async def nats_tasks() -> list[str]:
        return [repr(task) for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    async with Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as db:
        before = await db.on_loop(nats_tasks)
        transport = NatsTransport(db, f"nats://127.0.0.1:{_free_port()}", open_timeout=0.5, reconnect_wait=0.1)
        with pytest.raises(BusUnavailable, match="could not connect to NATS"):
            await transport.open("lonely")
        await transport.aclose()
        assert await db.on_loop(nats_tasks) == before


# --- random batches ---------------------------------------------------------------------------------

payload_batches = st.lists(st.lists(st.binary(max_size=20 * 1024), max_size=6), min_size=1, max_size=4)


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(batches=payload_batches)
def test_random_batches_arrive_intact_and_in_order(database_dsn, transport_kind, batches):
    trio.run(_round_trip, database_dsn, transport_kind, batches)


async def _round_trip(dsn: str, kind: TransportKind, batches: list[list[bytes]]) -> None:
    batches = [*batches, [b"end"]]  # at least one payload to wait for
    async with two_nodes(dsn, kind.make) as (a, b):
        last = await send_batches(a, batches)
        received = await receive_until(b, {a.node_id: last})
        assert [(d.sender, d.seq, d.payload, d.resync) for d in received] == [
            (a.node_id, seq, payload, False) for seq, payload in numbered(batches)]
