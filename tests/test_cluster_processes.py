"""Scale-out with real processes: three `scopewire serve` nodes on one PostgreSQL.

Nodes are killed (SIGKILL), frozen (SIGSTOP/SIGCONT) and started again while
clients send with `client_message_id` and retry what was not acknowledged.
Everything asserted is read from the database or seen by clients: acknowledged
messages are stored once, each scope's seqs have no gap, subscribers see every
seq once, a dead or frozen owner's scopes move to another node with a higher
epoch, and a frozen owner that wakes up commits nothing under its old epoch.

Waits are bounded and wait for facts (acks, events, rows, PostgreSQL's lock
waits); the clock is waited on only for a node lease to run out (the behaviour
under test) and as a client's pause before a retry.  A failure says what the
clients saw, the nodes logged and who waited for whom in the database.
The in-process cases are in tests/test_cluster_nodes.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import math
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
import trio
import trio.testing
import trio_websocket
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from client import ClientError, Connection, connect
from server.credentials import load_or_create_signer
from storage import leases
from storage.bridge import IDLE_IN_TRANSACTION_MS, TRANSACTION_TIMEOUT_MS, Database, PoolSettings
from storage.errors import LeaseLost
from storage.ids import new_id
from tests.test_operability import http_get, scrape, value
from tests.test_serve import Served, run_cli, start_serve

# Short, so a dead or frozen node's scopes move within a test; the heartbeat renews every third of it.
LEASE_SECONDS = 2
# Bounds on a busy two-core machine, not synchronisation.
CONNECT_BOUND = 5.0  # handshake and auth: a frozen node accepts TCP but never answers
CALL_BOUND = 8.0  # one send (a takeover included); past it the client tries another node
CLOSE_BOUND = 1.0  # closing a connection to a frozen node must not wait for its answer
SETUP_BOUND = 60.0
TAKEOVER_BOUND = LEASE_SECONDS + 10.0  # kill → the first commit of the dead owner's scope elsewhere
# A node frozen inside a transaction holds its locks (the scope's lease row, the workspace's
# message counter) until PostgreSQL ends that transaction (idle, or frozen mid-statement: the
# whole transaction's bound): takeovers and other sends wait for it.
FROZEN_TAKEOVER_BOUND = (LEASE_SECONDS + max(IDLE_IN_TRANSACTION_MS, TRANSACTION_TIMEOUT_MS) / 1000
                         + 2 * CALL_BOUND + 10.0)
RETRY_PAUSE = 0.05  # a client's pause before retrying, not a synchronisation

OWNER_EMAIL = "o@example.com"
RETRYABLE = (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError, OSError, trio.BrokenResourceError,
             trio.TooSlowError)


# --- nodes: real `scopewire serve` processes ------------------------------------------------------------


@dataclass
class Node:
    node_id: str
    data_dir: Path
    served: Served | None = None
    paused: bool = False

    @property
    def running(self) -> bool:
        return self.served is not None and self.served.process.returncode is None

    @property
    def url(self) -> str:
        assert self.served is not None
        return self.served.url  # a killed node keeps its last address: clients find it refusing

    def log_tail(self, lines: int = 30) -> str:
        path = self.data_dir.parent / f"{self.data_dir.name}.stderr"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {self.node_id} ---\n" + "\n".join(text.splitlines()[-lines:])


class Nodes:
    """Nodes sharing one database and one session signing key (which also keys their links)."""

    def __init__(self, dsn: str, base: Path, count: int = 3, prefix: str = "node") -> None:
        self.dsn = dsn
        self.base = base
        self.key_file = base / "session-signing-key.pem"
        load_or_create_signer(self.key_file)
        self.all = [Node(f"{prefix}-{i}", base / f"{prefix}-{i}") for i in range(count)]

    async def start(self, node: Node) -> None:
        node.served = await start_serve(node.data_dir, "--database-url", self.dsn,
                                        "--session-key-file", str(self.key_file), "--node-id", node.node_id,
                                        "--node-lease-seconds", str(LEASE_SECONDS))
        node.paused = False

    async def start_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for node in self.all:
                nursery.start_soon(self.start, node)

    async def kill(self, node: Node) -> None:
        assert node.served is not None
        node.served.process.send_signal(signal.SIGKILL)  # a stopped process dies too
        with trio.fail_after(30):
            assert await node.served.process.wait() == -signal.SIGKILL
        node.paused = False

    def pause(self, node: Node) -> None:
        assert node.served is not None
        node.served.process.send_signal(signal.SIGSTOP)
        node.paused = True

    def resume(self, node: Node) -> None:
        assert node.served is not None
        node.served.process.send_signal(signal.SIGCONT)
        node.paused = False

    def by_id(self, node_id: str) -> Node:
        return next(node for node in self.all if node.node_id == node_id)

    def logs(self) -> str:
        return "\n".join(node.log_tail() for node in self.all)

    async def aclose(self) -> None:
        for node in self.all:
            if node.running:
                await self.kill(node)


def initialise(dsn: str, data_dir: Path) -> str:
    """`scopewire init` on the test's database: the owner's password."""
    done = run_cli("init", "--data-dir", str(data_dir), "--database-url", dsn, "--email", OWNER_EMAIL,
                   "--name", "O", "--workspace-name", "W", "--workspace-slug", "w")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["password"]


@dataclass
class Session:
    """The owner's session token: valid on every node, as they share the signing key."""

    token: str
    workspace_id: str


async def sign_in(url: str, password: str) -> Session:
    async with connect(url) as conn:
        login = await conn.login(OWNER_EMAIL, password)
    return Session(login["token"], login["workspaces"][0]["id"])


async def create_channel(url: str, session: Session, slug: str) -> str:
    """A channel created through this node, which so takes its scope lease."""
    async with connect(url) as conn:
        await conn.auth(token=session.token)
        return (await conn.call("channel.create", workspace_id=session.workspace_id, slug=slug,
                                display_name=slug))["id"]


async def on_connection(url: str, session: Session, body: Callable[[Connection], Awaitable[None]]) -> bool:
    """Run `body` on a fresh authenticated connection to `url`.  False when the node
    could not be reached or the connection broke or timed out: the client moves to
    another node.  Connecting and closing are bounded (a frozen node never answers)."""
    done = False
    with trio.CancelScope(deadline=trio.current_time() + CONNECT_BOUND) as bound:
        try:
            async with connect(url) as conn:
                try:
                    await conn.auth(token=session.token)
                except ClientError as error:
                    if error.code != "unavailable":
                        raise
                else:
                    bound.deadline = math.inf
                    try:
                        await body(conn)
                        done = True
                    finally:
                        bound.deadline = trio.current_time() + CLOSE_BOUND
        except* RETRYABLE:
            pass
    return done


@contextlib.asynccontextmanager
async def bounded(seconds: float, db: Database, describe: Callable[[], str]) -> AsyncIterator[None]:
    """fail_after, failing with what the test saw and who waits for whom in the database."""
    try:
        with trio.fail_after(seconds):
            yield
    except trio.TooSlowError:
        activity = await database_activity(db)
        raise AssertionError(f"not done within {seconds:g}s: {describe()}\ndatabase:\n{activity}") from None


class Progress:
    """A counter tasks can wait on."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = trio.Event()

    def bump(self) -> None:
        self.count += 1
        self._changed.set()
        self._changed = trio.Event()

    async def reach(self, target: int) -> None:
        while self.count < target:
            await self._changed.wait()


# --- closed-loop senders that retry with the same client_message_id ----------------------------------


@dataclass
class Ledger:
    """What the senders saw."""

    acked: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # client id → (scope, seq, message id)
    acks_by_sender: dict[str, int] = field(default_factory=dict)
    unavailable: int = 0  # `unavailable` answers, each followed by a retry of the same id
    interrupted: int = 0  # sends whose connection broke or timed out unanswered (retried on another node)
    replayed: int = 0  # retries answered with the message an earlier attempt had committed
    wrong: list[str] = field(default_factory=list)  # any other answer: a failure
    # For failure messages: each sender's current step, and the last reconnects and retries.
    doing: dict[str, str] = field(default_factory=dict)
    trace: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    progress: Progress = field(default_factory=Progress)

    def note(self, name: str, what: str, *, trace: bool = True) -> None:
        self.doing[name] = f"{what} at {trio.current_time():.2f}"
        if trace:
            self.trace.append(f"{name}: {self.doing[name]}")

    def summary(self) -> str:
        return (f"acks {self.acks_by_sender}, unavailable {self.unavailable}, interrupted {self.interrupted}, "
                f"replayed {self.replayed}, wrong {self.wrong}, doing {self.doing}, last steps:\n"
                + "\n".join(f"  {line}" for line in self.trace))


async def run_sender(name: str, first_node: int, nodes: Nodes, session: Session, scopes: list[str],
                     ledger: Ledger, finished: Callable[[str], bool]) -> None:
    """Send `name-0`, `name-1`, ... one at a time, each until acknowledged: an
    unanswered send is sent again with the same client_message_id, on another node
    when its connection is gone."""
    numbers = itertools.count()
    number = next(numbers)
    in_doubt = False  # a send of `number` went out unanswered: it may have committed
    ledger.acks_by_sender[name] = 0

    async def send_until_finished(conn: Connection) -> None:
        nonlocal number, in_doubt
        while in_doubt or not finished(name):
            client_id = f"{name}-{number}"
            in_doubt = True
            ledger.note(name, f"sending {client_id}", trace=False)
            scope_id = scopes[number % len(scopes)]
            try:
                with trio.fail_after(CALL_BOUND):
                    sent = await conn.call("message.send", workspace_id=session.workspace_id, scope_id=scope_id,
                                           content=client_id, client_message_id=client_id)
            except ClientError as error:
                if error.code != "unavailable":
                    ledger.wrong.append(f"{client_id}: {error.code}: {error.message}")
                    raise
                ledger.unavailable += 1
                ledger.note(name, f"{client_id} unavailable: {error.message}")
                await trio.sleep(RETRY_PAUSE)
                continue
            except RETRYABLE as error:
                ledger.interrupted += 1
                ledger.note(name, f"{client_id} interrupted: {error!r}")
                raise
            if sent.get("replayed"):
                ledger.replayed += 1
            ledger.acked[client_id] = (scope_id, sent["seq"], sent["id"])
            ledger.acks_by_sender[name] += 1
            ledger.progress.bump()
            number, in_doubt = next(numbers), False

    for attempt in itertools.count(first_node):
        if finished(name) and not in_doubt:
            return
        node = nodes.all[attempt % len(nodes.all)]
        ledger.note(name, f"connecting to {node.node_id}")
        if not await on_connection(node.url, session, send_until_finished):
            await trio.sleep(RETRY_PAUSE)


async def send_again(url: str, session: Session, ledger: Ledger, client_ids: list[str]) -> None:
    """A client that never saw these acks sends the same messages again (through any node):
    each comes back as the message stored the first time, marked replayed."""
    async with connect(url) as conn:
        await conn.auth(token=session.token)
        for client_id in client_ids:
            scope_id, seq, message_id = ledger.acked[client_id]
            with trio.fail_after(CALL_BOUND):
                again = await conn.call("message.send", workspace_id=session.workspace_id, scope_id=scope_id,
                                        content=client_id, client_message_id=client_id)
            assert (again["id"], again["seq"], again.get("replayed")) == (message_id, seq, True), client_id


# --- subscribers that resume from their cursors ---------------------------------------------------------


class Follower:
    """Follows scopes on one node, and after a drop on the next one, resuming from its cursors.
    Keeps every message.created it received, in arrival order, across connections."""

    def __init__(self, name: str, first_node: int, scopes: list[str]) -> None:
        self.name = name
        self.first_node = first_node
        self.cursors = {scope_id: 0 for scope_id in scopes}
        self.received: dict[str, list[int]] = {scope_id: [] for scope_id in scopes}
        self.contents: dict[str, dict[int, str]] = {scope_id: {} for scope_id in scopes}
        self.sessions: list[str] = []  # the node ids it followed on, in order
        self.subscribed = trio.Event()
        self.progress = Progress()

    async def run(self, nodes: Nodes, session: Session) -> None:
        for attempt in itertools.count(self.first_node):
            node = nodes.all[attempt % len(nodes.all)]

            async def follow(conn: Connection, node: Node = node) -> None:
                await conn.call("subscribe", workspace_id=session.workspace_id,
                                scopes=[{"scope_id": s, "after_seq": c} for s, c in self.cursors.items()])
                self.sessions.append(node.node_id)
                self.subscribed.set()
                while True:
                    event = await conn.next_event()
                    if event["event"] != "message.created" or event["scope_id"] not in self.cursors:
                        continue
                    scope_id, seq = event["scope_id"], event["seq"]
                    self.received[scope_id].append(seq)
                    self.contents[scope_id][seq] = event["data"]["content"]
                    self.cursors[scope_id] = max(self.cursors[scope_id], seq)
                    self.progress.bump()

            await on_connection(node.url, session, follow)
            await trio.sleep(RETRY_PAUSE)

    def __repr__(self) -> str:
        return f"{self.name} on {self.sessions}, cursors {self.cursors}"

    async def reach(self, last_seqs: dict[str, int]) -> None:
        while any(self.cursors[scope_id] < seq for scope_id, seq in last_seqs.items()):
            await self.progress.reach(self.progress.count + 1)


def describe(followers: list[Follower]) -> str:
    return "; ".join(map(repr, followers))


# --- database facts -------------------------------------------------------------------------------------


async def stored_messages(db: Database, scopes: list[str]) -> dict[str, list[asyncpg.Record]]:
    rows = await db.run(lambda conn: conn.fetch(
        "SELECT scope_id, seq, id, client_message_id, content, created_at FROM scope_messages "
        "WHERE scope_id = ANY($1::text[]) ORDER BY scope_id, seq", scopes))
    return {scope_id: [row for row in rows if row["scope_id"] == scope_id] for scope_id in scopes}


async def lease_rows(db: Database, scopes: list[str]) -> dict[str, tuple[str | None, int]]:
    rows = await db.run(lambda conn: conn.fetch(
        "SELECT scope_id, node_id, epoch FROM scope_leases WHERE scope_id = ANY($1::text[])", scopes))
    return {row["scope_id"]: (row["node_id"], row["epoch"]) for row in rows}


async def database_activity(db: Database) -> str:
    """Who waits for whom in the database (for failure messages)."""
    rows = await db.run(lambda conn: conn.fetch(
        "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid) AS blocked_by, "
        "round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 1) AS xact_seconds, "
        "left(query, 120) AS query FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() ORDER BY pid"))
    return "\n".join(str(dict(row)) for row in rows)


async def database_now(db: Database):
    return await db.run(lambda conn: conn.fetchval("SELECT clock_timestamp()"))


async def wait_for_node_lease_to_expire(db: Database, node_id: str) -> None:
    """Readiness: the node lease has run out by the database's clock (waiting it out is the behaviour)."""
    with trio.fail_after(LEASE_SECONDS + 30):
        while True:
            left = await db.run(lambda conn: conn.fetchval(
                "SELECT extract(epoch FROM lease_expires_at - clock_timestamp()) FROM cluster_nodes "
                "WHERE node_id = $1", node_id))
            if left < 0:
                return
            await trio.sleep(float(left) + 0.05)


def assert_stored_once_without_gaps(stored: dict[str, list[asyncpg.Record]], ledger: Ledger, logs: str) -> None:
    """Every acknowledged message is stored as acknowledged; nothing is stored twice or
    unacknowledged (each sender retried until acked); each scope's seqs run 1..n."""
    for scope_id, rows in stored.items():
        assert [row["seq"] for row in rows] == list(range(1, len(rows) + 1)), f"gap in {scope_id}\n{logs}"
    rows = [row for scope_rows in stored.values() for row in scope_rows]
    client_ids = [row["client_message_id"] for row in rows]
    assert len(client_ids) == len(set(client_ids)), "a client_message_id stored twice"
    assert all(row["content"] == row["client_message_id"] for row in rows)
    by_client_id = {row["client_message_id"]: (row["scope_id"], row["seq"], row["id"]) for row in rows}
    lost = {client_id: ack for client_id, ack in ledger.acked.items() if by_client_id.get(client_id) != ack}
    assert not lost, f"acknowledged but not stored as acknowledged: {lost}\n{logs}"
    unacknowledged = set(by_client_id) - set(ledger.acked)
    assert not unacknowledged, f"stored but never acknowledged: {unacknowledged}\n{logs}"


# --- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture
async def nodes(database_dsn: str, tmp_path: Path):
    started = Nodes(database_dsn, tmp_path)
    try:
        yield started
    finally:
        await started.aclose()


@pytest.fixture
def password(database_dsn: str, tmp_path: Path) -> str:
    return initialise(database_dsn, tmp_path / "init")


# --- kill -9 of a scope owner under load -----------------------------------------------------------------

SENDERS = 6
KILL_AFTER_ACKS = 60
ACKS_AFTER_KILL = 10  # per sender
RESENT = 12  # acknowledged sends sent again after the load, as a client that lost the acks would
LOAD_BOUND = 120.0
CATCH_UP_BOUND = 30.0


async def test_kill_dash_nine_of_the_busiest_scopes_owner_loses_and_duplicates_nothing(
        nodes: Nodes, password: str, db: Database):
    await nodes.start_all()
    session = await sign_in(nodes.all[0].url, password)
    # Each node creates, and so owns, one channel; the first is the busiest.
    scopes = [await create_channel(node.url, session, f"load-{i}") for i, node in enumerate(nodes.all)]
    busiest = scopes[0]
    send_pattern = [busiest, scopes[1], busiest, scopes[2], busiest]
    followers = [Follower(f"follower-{i}", i, scopes) for i in range(len(nodes.all))]
    ledger = Ledger()
    killed = trio.Event()
    acks_at_kill: dict[str, int] = {}

    def finished(name: str) -> bool:
        return killed.is_set() and ledger.acks_by_sender[name] - acks_at_kill[name] >= ACKS_AFTER_KILL

    async with trio.open_nursery() as background:
        for follower in followers:
            background.start_soon(follower.run, nodes, session)
        with trio.fail_after(SETUP_BOUND):
            for follower in followers:
                await follower.subscribed.wait()

        async with bounded(LOAD_BOUND, db, lambda: f"load: {ledger.summary()}\n{nodes.logs()}"):
            async with trio.open_nursery() as load:
                for i in range(SENDERS):
                    load.start_soon(run_sender, f"s{i}", i, nodes, session, send_pattern, ledger, finished)
                await ledger.progress.reach(KILL_AFTER_ACKS)
                owners_before = await lease_rows(db, scopes)
                victim = nodes.by_id(owners_before[busiest][0])
                victim.served.process.send_signal(signal.SIGKILL)  # sends are in flight: the senders never pause
                acks_at_kill.update(ledger.acks_by_sender)
                acked_before_kill = list(ledger.acked)
                killed.set()
                assert await victim.served.process.wait() == -signal.SIGKILL
                dead_at = await database_now(db)  # whatever commits after this, a survivor committed

        # The last acks before the kill were mostly the dead owner's commits: sent again at the new owners.
        survivor_urls = [node.url for node in nodes.all if node is not victim]
        for i, url in enumerate(survivor_urls):
            await send_again(url, session, ledger, acked_before_kill[-RESENT:][i::len(survivor_urls)])
        stored = await stored_messages(db, scopes)
        last_seqs = {scope_id: len(rows) for scope_id, rows in stored.items()}
        async with bounded(CATCH_UP_BOUND, db, lambda: f"followers behind {last_seqs}: {describe(followers)}"):
            for follower in followers:
                await follower.reach(last_seqs)
        background.cancel_scope.cancel()

    logs = nodes.logs()
    assert not ledger.wrong, ledger.wrong
    assert ledger.interrupted >= 1, "no send was in flight on the killed node"
    assert_stored_once_without_gaps(stored, ledger, logs)

    # The dead node's scopes have a new owner, under a higher epoch, soon after the kill.
    owners_after = await lease_rows(db, scopes)
    survivors = {node.node_id for node in nodes.all if node is not victim}
    dead_scopes = [scope_id for scope_id, (node_id, _) in owners_before.items() if node_id == victim.node_id]
    for scope_id in dead_scopes:
        node_id, epoch = owners_after[scope_id]
        assert node_id in survivors and epoch > owners_before[scope_id][1], (owners_before, owners_after)
    first_commit_after_death = min(row["created_at"] for row in stored[busiest] if row["created_at"] > dead_at)
    takeover = (first_commit_after_death - dead_at).total_seconds()
    assert takeover < TAKEOVER_BOUND, f"the busiest scope took {takeover:.1f}s to commit again after the kill"

    # Every follower saw every seq once, in order — those on the killed node after resuming elsewhere.
    for follower in followers:
        for scope_id, rows in stored.items():
            assert follower.received[scope_id] == [row["seq"] for row in rows], (follower.name, scope_id)
            assert follower.contents[scope_id] == {row["seq"]: row["content"] for row in rows}
    moved = [f for f in followers if f.sessions[0] == victim.node_id]
    assert moved and all(len(f.sessions) >= 2 and f.sessions[-1] in survivors for f in moved), \
        [(f.name, f.sessions) for f in followers]


# --- a frozen owner wakes up fenced -------------------------------------------------------------------


async def metric(node: Node, name: str, **labels: str) -> float:
    return value(await scrape(node.served.port), name, **labels)


async def test_a_frozen_owner_that_wakes_up_commits_nothing_under_its_old_epoch(
        nodes: Nodes, password: str, db: Database):
    await nodes.start_all()
    frozen, taker, bystander = nodes.all
    session = await sign_in(frozen.url, password)
    scope_id = await create_channel(frozen.url, session, "fenced")
    followers = [Follower("on-frozen", 0, [scope_id]), Follower("on-bystander", 2, [scope_id])]

    async def send(conn: Connection, text: str) -> dict:
        """Until acknowledged, with the same client id each time."""
        with trio.fail_after(FROZEN_TAKEOVER_BOUND):
            while True:
                try:
                    with trio.fail_after(CALL_BOUND):
                        return await conn.call("message.send", workspace_id=session.workspace_id,
                                               scope_id=scope_id, content=text, client_message_id=text)
                except ClientError as error:
                    if error.code != "unavailable":
                        raise
                except trio.TooSlowError:
                    pass
                await trio.sleep(RETRY_PAUSE)

    async with trio.open_nursery() as background:
        for follower in followers:
            background.start_soon(follower.run, nodes, session)
        async with connect(frozen.url) as on_frozen, connect(taker.url) as on_taker:
            await on_frozen.auth(token=session.token)
            await on_taker.auth(token=session.token)
            with trio.fail_after(SETUP_BOUND):
                for follower in followers:
                    await follower.subscribed.wait()
                for i in range(3):
                    await send(on_frozen, f"before-{i}")
                # Readiness: the owner's actor is idle (its last transaction, the settling of the
                # inline deliveries, committed), so the freeze holds no lease row lock.
                while await db.run(lambda conn: conn.fetchval(
                        "SELECT count(*) FROM scope_fanout_outbox WHERE scope_id = $1 AND status = 'pending'",
                        scope_id)):
                    await trio.sleep(0.05)
            owner, epoch = (await lease_rows(db, [scope_id]))[scope_id]
            assert owner == frozen.node_id
            forwarded_out_before = await metric(frozen, "scopewire_forwarded_commands_total", direction="out")
            forwarded_in_before = await metric(taker, "scopewire_forwarded_commands_total", direction="in")

            nodes.pause(frozen)
            await wait_for_node_lease_to_expire(db, frozen.node_id)
            taken = await send(on_taker, "takeover")
            assert (await lease_rows(db, [scope_id]))[scope_id] == (taker.node_id, epoch + 1)

            async with trio.open_nursery() as waking:
                woken: list[dict] = []

                async def send_through_the_frozen_node() -> None:
                    woken.append(await send(on_frozen, "from-the-woken-node"))

                waking.start_soon(send_through_the_frozen_node)
                await trio.testing.wait_all_tasks_blocked()  # the frame is in the frozen node's socket
                nodes.resume(frozen)  # its actor still believes it owns the scope, under the old epoch
            forwarded_out = await metric(frozen, "scopewire_forwarded_commands_total", direction="out")
            forwarded_in = await metric(taker, "scopewire_forwarded_commands_total", direction="in")

        stored = (await stored_messages(db, [scope_id]))[scope_id]
        async with bounded(CATCH_UP_BOUND, db, lambda: f"followers behind {len(stored)}: {describe(followers)}"):
            for follower in followers:
                await follower.reach({scope_id: len(stored)})
        background.cancel_scope.cancel()

    logs = nodes.logs()
    assert [(row["seq"], row["content"]) for row in stored] == [
        (1, "before-0"), (2, "before-1"), (3, "before-2"), (4, "takeover"), (5, "from-the-woken-node")], logs
    assert (taken["seq"], woken[0]["seq"]) == (4, 5)
    # The woken node's fence refused its old epoch: the command ran at the new owner.
    assert forwarded_out >= forwarded_out_before + 1, \
        f"the woken node committed itself instead of forwarding to the new owner\n{logs}"
    assert forwarded_in >= forwarded_in_before + 1
    assert (await lease_rows(db, [scope_id]))[scope_id] == (taker.node_id, epoch + 1), \
        "the woken node took the scope back"
    for follower in followers:
        assert follower.received[scope_id] == [1, 2, 3, 4, 5], (follower.name, follower.received)


def test_a_stale_owner_passes_no_fence_and_a_takeover_waits_for_the_owners_commit(database_dsn: str, password: str):
    # storage/leases.py alone, on asyncpg connections (`password`: an initialised instance, for a workspace).
    asyncio.run(_stale_owner_fenced(database_dsn))


def test_leases_taken_together_are_only_those_no_live_node_holds(database_dsn: str, password: str):
    asyncio.run(_acquire_free(database_dsn))


async def _acquire_free(dsn: str) -> None:
    admin = await asyncpg.connect(dsn)
    try:
        free, ours, dead_owners, live_owners, released = scopes = [new_id("scp") for _ in range(5)]
        for scope_id in scopes:
            await admin.execute("INSERT INTO scopes (id, workspace_id, type) SELECT $1, id, 'channel' "
                                "FROM workspaces LIMIT 1", scope_id)
        for node_id in ("here", "dead", "live"):
            await leases.register_node(admin, node_id, "127.0.0.1:1", 60)
        assert (await leases.acquire(admin, ours, "here")).epoch == 1
        assert (await leases.acquire(admin, dead_owners, "dead")).epoch == 1
        assert (await leases.acquire(admin, live_owners, "live")).epoch == 1
        assert (await leases.acquire(admin, released, "live")).epoch == 1
        await leases.release(admin, released, "live", 1)
        await expire_node_lease(admin, "dead")
        taken = await leases.acquire_free(admin, scopes + [new_id("scp")], "here")
        # Free, ours again, a dead node's and a released one: each under its next epoch; the live
        # node keeps its scope; a scope that does not exist gets no lease row.
        assert taken == {free: 1, ours: 2, dead_owners: 2, released: 2}
        rows = await admin.fetch("SELECT scope_id, node_id, epoch FROM scope_leases WHERE scope_id = ANY($1::text[])",
                                 scopes)
        assert {r["scope_id"]: (r["node_id"], r["epoch"]) for r in rows} == {free: ("here", 1), ours: ("here", 2), dead_owners: ("here", 2),
                                                     live_owners: ("live", 1), released: ("here", 2)}
    finally:
        await admin.close()


async def expire_node_lease(conn: asyncpg.Connection, node_id: str) -> None:
    await conn.execute("UPDATE cluster_nodes SET heartbeat_at = clock_timestamp() - interval '2 seconds', "
                       "lease_expires_at = clock_timestamp() - interval '1 second' WHERE node_id = $1", node_id)


async def _stale_owner_fenced(dsn: str) -> None:
    admin, owner, taker = [await asyncpg.connect(dsn) for _ in range(3)]
    try:
        scope_id = new_id("scp")
        await admin.execute("INSERT INTO scopes (id, workspace_id, type) SELECT $1, id, 'channel' FROM workspaces",
                            scope_id)
        await owner.execute("CREATE TEMP TABLE written (note text)")
        await leases.register_node(admin, "old", "127.0.0.1:1", 60)
        await leases.register_node(admin, "new", "127.0.0.1:2", 60)
        assert await leases.acquire(admin, scope_id, "old") == leases.Ownership("old", 1, "")
        # A live owner keeps its scope.
        assert await leases.acquire(admin, scope_id, "new") == leases.Ownership("old", 1, "127.0.0.1:1")

        # The owner's write transaction passes the fence; then its node lease runs out.
        committing = owner.transaction()
        await committing.start()
        await leases.pass_fence(owner, scope_id, "old", 1)
        await owner.execute("INSERT INTO written VALUES ('under the fence')")
        await expire_node_lease(admin, "old")
        # The takeover waits for that transaction (its shared lock on the lease row)...
        taking = asyncio.ensure_future(leases.acquire(taker, scope_id, "new"))
        async with asyncio.timeout(10):
            while not taking.done() and not await admin.fetchval(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", taker.get_server_pid()):
                await asyncio.sleep(0.01)
        assert not taking.done(), "the takeover did not wait for the owner's open transaction"
        await committing.commit()
        # ...and happens after it, under the next epoch.
        assert await asyncio.wait_for(taking, 10) == leases.Ownership("new", 2, "")

        # The former owner passes no fence any more, not even with its node lease renewed
        # (a frozen process waking up): its transaction writes nothing.
        assert await leases.renew_node(admin, "old", 60)
        for node_id, epoch in (("old", 1), ("old", 2), ("new", 1)):
            with pytest.raises(LeaseLost):
                async with owner.transaction():
                    await leases.pass_fence(owner, scope_id, node_id, epoch)
                    await owner.execute("INSERT INTO written VALUES ($1)", f"stale {node_id} {epoch}")
        async with owner.transaction():
            await leases.pass_fence(owner, scope_id, "new", 2)
            await owner.execute("INSERT INTO written VALUES ('by the new owner')")
        # Nor does the new owner once its own node lease ran out, or once it stopped.
        await expire_node_lease(admin, "new")
        with pytest.raises(LeaseLost):
            async with owner.transaction():
                await leases.pass_fence(owner, scope_id, "new", 2)
        assert await leases.renew_node(admin, "new", 60)
        await leases.stop_node(admin, "new")
        with pytest.raises(LeaseLost):
            async with owner.transaction():
                await leases.pass_fence(owner, scope_id, "new", 2)
        assert await owner.fetch("SELECT note FROM written ORDER BY note") == [
            ("by the new owner",), ("under the fence",)]
    finally:
        for conn in (admin, owner, taker):
            await conn.close()


# --- readiness and metrics name the node ---------------------------------------------------------------


async def test_readyz_reports_the_node_lease_and_metrics_name_the_node(nodes: Nodes):
    node = nodes.all[0]
    await nodes.start(node)
    ready = await http_get(node.served.port, "/readyz")
    assert ready.status == 200, ready.body
    assert ready.json()["checks"]["node_lease"] == {"ok": True, "node_id": node.node_id,
                                                    "lease_seconds": LEASE_SECONDS}
    figures = await scrape(node.served.port)
    assert value(figures, "scopewire_node_info", node_id=node.node_id, bus="postgres") == 1
    assert value(figures, "scopewire_node_lease_healthy") == 1


# --- schedules of kills, freezes and restarts ------------------------------------------------------------

STEP_ACKS = 6  # acks the senders make after each step (alternating between the two scopes)
STEP_BOUND = FROZEN_TAKEOVER_BOUND + 20.0
# (what, which): `which` picks among the running nodes, the scopes' owners first; a kill or a
# freeze that would leave no node serving restarts a dead node instead.
ACTIONS = st.tuples(st.sampled_from(("kill", "pause", "restart")), st.integers(0, 2))
_examples = itertools.count()


# No shrinking: a failing schedule is reported as found (each example costs seconds of real processes).
@settings(max_examples=3, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(schedule=st.lists(ACTIONS, min_size=2, max_size=3))
def test_any_schedule_of_kills_freezes_and_restarts_keeps_every_ack_once_and_in_order(
        database_dsn: str, password: str, tmp_path: Path, schedule: list[tuple[str, int]]):
    # Each example is its own trio run with its own three nodes and two scopes, on one database.
    trio.run(_run_schedule, database_dsn, password, tmp_path / f"example-{next(_examples)}", schedule)


async def _run_schedule(dsn: str, password: str, base: Path, schedule: list[tuple[str, int]]) -> None:
    base.mkdir()
    nodes = Nodes(dsn, base, prefix=base.name)
    async with Database(dsn, PoolSettings(min_size=1, max_size=2)) as db:
        try:
            await _check_schedule(nodes, db, password, base.name, schedule)
        finally:
            await nodes.aclose()


async def _check_schedule(nodes: Nodes, db: Database, password: str, example: str,
                          schedule: list[tuple[str, int]]) -> None:
    await nodes.start_all()
    session = await sign_in(nodes.all[0].url, password)
    scopes = [await create_channel(nodes.all[i].url, session, f"{example}-{i}") for i in range(2)]
    ledger = Ledger()
    done = trio.Event()
    leases_seen = [await lease_rows(db, scopes)]
    steps: list[str] = []

    async def step_done() -> None:
        """The senders got on: STEP_ACKS more acks."""
        target = ledger.progress.count + STEP_ACKS
        async with bounded(STEP_BOUND, db, lambda: f"after {steps}: {ledger.summary()}\n{nodes.logs()}"):
            await ledger.progress.reach(target)
        leases_seen.append(await lease_rows(db, scopes))

    async def candidates() -> list[Node]:
        owners = {node_id for node_id, _ in (await lease_rows(db, scopes)).values()}
        return sorted((node for node in nodes.all if node.running), key=lambda n: (n.node_id not in owners, n.node_id))

    async with trio.open_nursery() as load:
        for i in range(2):
            load.start_soon(run_sender, f"{example}-s{i}", i, nodes, session, scopes, ledger,
                            lambda name: done.is_set())
        await step_done()
        for action, which in schedule:
            running = await candidates()
            if action in ("kill", "pause") and len(running) >= 2:
                node = running[which % len(running)]
                steps.append(f"{action} {node.node_id}")
                if action == "kill":
                    await nodes.kill(node)
                    await step_done()
                else:
                    nodes.pause(node)
                    await wait_for_node_lease_to_expire(db, node.node_id)
                    await step_done()  # while it is frozen: its scopes moved
                    nodes.resume(node)
                    await step_done()
            else:
                dead = [node for node in nodes.all if not node.running]
                node = dead[which % len(dead)] if dead else running[which % len(running)]
                steps.append(f"restart {node.node_id}")
                if node.running:
                    await nodes.kill(node)
                await nodes.start(node)  # the same node id, a fresh process
                await step_done()
        done.set()
    last_acks = [f"{name}-{count - 1}" for name, count in ledger.acks_by_sender.items() if count]
    await send_again(next(node for node in nodes.all if node.running).url, session, ledger, last_acks)

    logs = f"steps: {steps}\n{ledger.summary()}\n{nodes.logs()}"
    assert not ledger.wrong, ledger.wrong
    assert_stored_once_without_gaps(await stored_messages(db, scopes), ledger, logs)
    # One holder per epoch: epochs only grow, and a scope changes hands only with a new epoch.
    for scope_id in scopes:
        history = [seen[scope_id] for seen in leases_seen]
        for (node_before, epoch_before), (node_after, epoch_after) in itertools.pairwise(history):
            assert epoch_after >= epoch_before, (scope_id, history, steps)
            assert epoch_after > epoch_before or node_after in (node_before, None), (scope_id, history, steps)
        # Both scopes committed after the last step, so a running node holds each.
        assert history[-1][0] in {node.node_id for node in nodes.all if node.running}, (scope_id, history, steps)

