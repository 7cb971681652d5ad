"""Realtime delivery over real sockets: subscriptions, order, resume without
loss or duplicates, entitlement, slow consumers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsproto.events import CloseConnection, Message, Request, TextMessage

from client import connect
from protocol import frames
from server.config import ServerConfig
from storage.bridge import Database, PoolSettings
from tests.conftest import MEMBER_PASSWORD, App, add_person
from tests.db_faults import hold_table_lock, release_locks, terminate, wait_for_query
from tests.server_thread import ServerThread
from tests.test_messaging import open_channel
from tests.test_transport import RawClient
from tests.test_tenancy import expect_error, signed_in


# Both ways a publication reaches the connections in step (server/send_ring.py).
BOTH_FANOUT_WRITES = pytest.mark.parametrize("server_config", [{"fanout_writes": "io_uring"},
                                                               {"fanout_writes": "send"}],
                                             indirect=True, ids=["io_uring", "send"])


async def events_for(conn, count: int, kind: str = "message.created") -> list[dict]:
    received = []
    with trio.fail_after(15):
        while len(received) < count:
            event = await conn.next_event()
            if event["event"] == kind:
                received.append(event)
    return received


@BOTH_FANOUT_WRITES
async def test_scope_subscribers_get_every_message_once_in_order(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    assert (app.server.publication_writes is not None) == (app.server.config.fanout_writes == "io_uring")
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "live", [bob.member_id])
        result = await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        assert [s["id"] for s in result["scopes"]] == [channel["id"]]

        async def send_from(person, n):
            async with await signed_in(app, person) as conn:
                for i in range(n):
                    await conn.call("message.send", scope_id=channel["id"], content=f"{person.email}:{i}", **ws)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_from, alpha.owner, 20)
            nursery.start_soon(send_from, bob, 20)
        received = await events_for(listener, 40)
        assert [e["seq"] for e in received] == list(range(1, 41))
        for person in (alpha.owner, bob):
            mine = [e["data"]["content"] for e in received if e["data"]["content"].startswith(person.email)]
            assert mine == [f"{person.email}:{i}" for i in range(20)]
        # Other event kinds arrive too.
        await owner.call("reaction.add", message_id=received[0]["data"]["id"], key="👍", **ws)
        reaction = (await events_for(listener, 1, "reaction.added"))[0]
        assert reaction["data"]["key"] == "👍" and reaction["scope_id"] == channel["id"]


async def test_resume_replays_what_was_missed_then_goes_live(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "resume")
        for i in range(5):
            await owner.call("message.send", scope_id=channel["id"], content=f"before {i}", **ws)
        async with await signed_in(app, alpha.owner) as listener:
            await listener.call("subscribe", scopes=[{"scope_id": channel["id"], "after_seq": 2}], **ws)
            replayed = await events_for(listener, 3)
            assert [e["seq"] for e in replayed] == [3, 4, 5]
            await owner.call("message.send", scope_id=channel["id"], content="live", **ws)
            assert [e["seq"] for e in await events_for(listener, 1)] == [6]
        for i in range(300):  # away for longer than any in-memory window
            await owner.call("message.send", scope_id=channel["id"], content=f"away {i}", **ws)
        async with await signed_in(app, alpha.owner) as listener:
            await listener.call("subscribe", scopes=[{"scope_id": channel["id"], "after_seq": 6}], **ws)
            await owner.call("message.send", scope_id=channel["id"], content="after resume", **ws)
            resumed = await events_for(listener, 301)
            assert [e["seq"] for e in resumed] == list(range(7, 308))
            assert resumed[-1]["data"]["content"] == "after resume"


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(schedule=st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=5))
def test_random_disconnects_lose_and_duplicate_nothing(database_dsn, member_password_hash, schedule):
    """Each step: send k messages while connected, drop the connection, send
    more while away, reconnect with the last seen seq."""
    trio.run(_disconnect_schedule, database_dsn, schedule)


async def _disconnect_schedule(dsn: str, schedule: list[int]) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from server import tenancy as ops
    from server.app import Server
    from server.auth import Authenticator
    from server.credentials import SessionSigner
    from storage.bridge import Database

    async with Database(dsn) as db, trio.open_nursery() as nursery:
        workspace_id = await db.run(lambda c: c.fetchval("SELECT id FROM workspaces WHERE slug = 'rt'"))
        if workspace_id is None:
            await ops.init_instance(db, email="rt@example.com", display_name="RT", workspace_name="RT",
                                    workspace_slug="rt", edition="single", password="rt-password")
        config = ServerConfig(port=0, shutdown_grace_seconds=1)
        server = Server(config, db, Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
        port = await nursery.start(server.run)
        url = f"ws://127.0.0.1:{port}"
        async with connect(url) as sender:
            await sender.login("rt@example.com", "rt-password")
            channel = await sender.call("channel.create", slug=f"rt-{len(schedule)}-{id(schedule)}",
                                        display_name="RT")
            seen: list[int] = []
            sent = 0
            for burst in schedule:
                async with connect(url) as listener:
                    await listener.login("rt@example.com", "rt-password")
                    await listener.call("subscribe", scopes=[{"scope_id": channel["id"],
                                                              "after_seq": seen[-1] if seen else 0}])
                    for _ in range(burst):
                        sent += 1
                        await sender.call("message.send", scope_id=channel["id"], content=str(sent))
                    seen += [e["seq"] for e in await events_for(listener, sent - len(seen))]
                for _ in range(burst):  # while away
                    sent += 1
                    await sender.call("message.send", scope_id=channel["id"], content=str(sent))
            async with connect(url) as listener:
                await listener.login("rt@example.com", "rt-password")
                await listener.call("subscribe", scopes=[{"scope_id": channel["id"],
                                                          "after_seq": seen[-1] if seen else 0}])
                seen += [e["seq"] for e in await events_for(listener, sent - len(seen))]
        assert seen == list(range(1, sent + 1))
        nursery.cancel_scope.cancel()


async def test_workspace_feed_delivers_entitled_scopes_in_global_order(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    # Live events that arrive while the subscribe's replay runs wait in its backlog: this
    # module's 8 (for its slow-consumer tests) is less than the 40 concurrent sends below.
    app.server.config = dataclasses.replace(app.server.config, push_buffer_events=1024)
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as listener:
        shared = [await open_channel(owner, alpha.workspace_id, f"shared-{i}", [bob.member_id]) for i in range(3)]
        private = await open_channel(owner, alpha.workspace_id, "owner-only", visibility="private")
        await owner.call("message.send", scope_id=shared[0]["id"], content="before subscribe", **ws)
        result = await listener.call("subscribe", workspace_feed=True, after_global_seq=0, **ws)
        assert result["workspace_global_seq"] == 1

        async def send_to(channel, n):
            async with await signed_in(app, alpha.owner) as conn:
                for i in range(n):
                    await conn.call("message.send", scope_id=channel["id"], content=str(i), **ws)

        async with trio.open_nursery() as nursery:
            for channel in shared + [private]:
                nursery.start_soon(send_to, channel, 10)
        received = await events_for(listener, 31)
        global_seqs = [e["global_seq"] for e in received]
        assert global_seqs == sorted(global_seqs) and len(set(global_seqs)) == 31
        assert private["id"] not in {e["scope_id"] for e in received}
        # Membership ending stops delivery at once.
        await owner.call("scope.remove", scope_id=shared[1]["id"], member_id=bob.member_id, **ws)
        removal = await events_for(listener, 1, "membership.changed")
        assert removal[0]["data"]["member_id"] == bob.member_id
        await owner.call("message.send", scope_id=shared[1]["id"], content="bob must not see", **ws)
        await owner.call("message.send", scope_id=shared[2]["id"], content="bob sees", **ws)
        after = await events_for(listener, 1)
        assert after[0]["data"]["content"] == "bob sees"


async def test_own_read_state_and_inbox_changes_reach_only_that_member(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as bob_acting, \
            await signed_in(app, bob) as bob_listening:
        channel = await open_channel(owner, alpha.workspace_id, "inbox-events", [bob.member_id])
        for conn in (owner, bob_listening):
            await conn.call("subscribe", workspace_feed=True, **ws)
        sent = await owner.call("message.send", scope_id=channel["id"], content="hello", **ws)
        await events_for(bob_listening, 1)
        await bob_acting.call("read.mark", scope_id=channel["id"], seq=sent["seq"], **ws)
        read = (await events_for(bob_listening, 1, "read_state.changed"))[0]
        assert read["data"]["member_id"] == bob.member_id and read["data"]["last_read_seq"] == sent["seq"]
        changes = {}
        for action in ("pin", "hide", "mute"):
            await bob_acting.call("conversation.action", scope_id=channel["id"], action=action, **ws)
            event = (await events_for(bob_listening, 1, "inbox.changed"))[0]
            assert event["scope_id"] == channel["id"] and event["data"]["member_id"] == bob.member_id
            changes.update(event["data"])
        assert changes["pinned"] is True and changes["hidden"] is True and changes["notification_state"] == "mute"
        # The owner follows the same feed but saw none of it: events to one
        # connection keep their order, so everything before this message is in.
        await owner.call("message.send", scope_id=channel["id"], content="barrier", **ws)
        seen = []
        with trio.fail_after(15):
            while not seen or seen[-1]["data"].get("content") != "barrier":
                seen.append(await owner.next_event())
        assert not {"read_state.changed", "inbox.changed"} & {e["event"] for e in seen}

async def test_subscriptions_need_authentication_and_entitlement(app: App, tenants):
    alpha, beta = tenants
    async with await signed_in(app, beta.owner) as owner_b:
        b_channel = await open_channel(owner_b, beta.workspace_id, "beta-secret")
    async with connect(app.url) as anonymous:
        await expect_error("unauthenticated", anonymous.call("subscribe", workspace_id=alpha.workspace_id,
                                                             workspace_feed=True))
    async with await signed_in(app, alpha.owner) as conn:
        await expect_error("not_found", conn.call("subscribe", workspace_id=alpha.workspace_id,
                                                  scopes=[{"scope_id": b_channel["id"]}]))
        await expect_error("not_found", conn.call("subscribe", workspace_id=beta.workspace_id, workspace_feed=True))
        await expect_error("not_found", conn.call("unsubscribe", workspace_id=beta.workspace_id))
        hello = await conn.call("hello", protocol_version=frames.PROTOCOL_VERSION)
        assert hello["protocol_version"] == frames.PROTOCOL_VERSION
        await expect_error("invalid", conn.call("hello", protocol_version=99))
    assert not conn.queued_events()


@pytest.fixture
def server_config(request: pytest.FixtureRequest) -> ServerConfig:
    # A long close grace: a slow consumer that reads again within it sees its 4408.
    return ServerConfig(**{"port": 0, "auth_timeout_seconds": 2.0, "expiry_sweep_seconds": 0.5,
                           "shutdown_grace_seconds": 30.0, "push_buffer_events": 8, "push_timeout_seconds": 1.0,
                           **getattr(request, "param", {})})



async def open_stuck_client(app: App) -> RawClient:
    """A raw client with a tiny receive buffer (no kernel autotuning), so the
    server's backlog for it grows as soon as it stops reading."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    await sock.connect(("127.0.0.1", app.server.port))
    client = RawClient(trio.SocketStream(sock))
    await client.send(Request(host="localhost", target="/", subprotocols=["scopewire.json"]))
    await client.next_event()
    return client


@BOTH_FANOUT_WRITES
async def test_a_stalled_client_is_cut_off_with_4408_and_others_keep_up(app: App, tenants):
    """Two clients read nothing: `unbounded` may buffer everything (so it is never
    cut off and any blocking write to it would stall the publisher for the whole
    run), `bounded` has the default 1 MiB push buffer and must get 4408.  The
    healthy subscriber receives every message meanwhile."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    count, big = 200, "x" * 30_000  # 6 MB: more than the push buffer and every kernel buffer in between
    # Live events that arrive while the healthy subscriber's first replay runs wait in its
    # backlog: this module's 8 is fewer than the sends that can arrive meanwhile on a busy
    # machine (seen once in CI).  The bounded client is cut off by bytes, not events.
    app.server.config = dataclasses.replace(app.server.config, push_buffer_events=1024)
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "firehose")

        async def stalled_subscriber():
            return await subscribe_stuck(app, alpha.owner, channel["id"], ws)

        default_config = app.server.config
        app.server.config = dataclasses.replace(default_config, push_buffer_bytes=64 << 20)
        unbounded = await stalled_subscriber()  # a connection's limit is fixed when it subscribes
        app.server.config = default_config
        bounded = await stalled_subscriber()
        # From here on the stuck clients read nothing until everyone else has everything.
        async with await signed_in(app, alpha.owner) as healthy:
            await healthy.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
            sent_at: dict[int, float] = {}
            latencies: list[float] = []

            async def drain_healthy():
                for event in await events_for(healthy, count):
                    latencies.append(trio.current_time() - sent_at[event["seq"]])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain_healthy)
                for seq in range(1, count + 1):
                    sent_at[seq] = trio.current_time()
                    await owner.call("message.send", scope_id=channel["id"], content=big, **ws)
            assert len(latencies) == count
            # Generous for a busy machine (seen: up to 7 s with the cores oversubscribed).
            # A publisher that waited on the unbounded client's socket would stall
            # until the test's timeout; one that lost 0.25 s per write to it, 50 s.
            assert max(latencies) < 20.0, max(latencies)
        await unbounded.stream.aclose()
        # Now the bounded one reads: whatever was queued before the cut-off, then close 4408.
        with trio.fail_after(20):
            while not isinstance(event := await bounded.next_event(), CloseConnection):
                assert isinstance(event, TextMessage)
        assert event.code == frames.CLOSE_SLOW_CONSUMER
        await bounded.stream.aclose()


async def subscribe_stuck(app: App, person, scope_id: str, ws: dict) -> RawClient:
    """A stuck client (open_stuck_client) signed in as `person`, subscribed to the scope."""
    stuck = await open_stuck_client(app)
    for request in ({"op": "login", "id": "1", "email": person.email, "password": person.password},
                    {"op": "subscribe", "id": "2", "scopes": [{"scope_id": scope_id}], **ws}):
        await stuck.send(Message(data=json.dumps(request)))
        while (await stuck.next_message()).get("id") != request["id"]:
            pass
    return stuck


@BOTH_FANOUT_WRITES
async def test_the_publication_that_overflows_a_connection_cuts_it_off(app: App, tenants):
    """A connection's push buffer is checked right after the send that passed it (a
    gathered send's short count or EAGAIN included), not at a later publication:
    once a send is acknowledged its publication is over, and then every subscribed
    connection holds at most its push buffer unsent, or is closing with 4408 after
    what it holds."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "overflow")
        config = app.server.config
        app.server.config = dataclasses.replace(config, push_buffer_bytes=0)  # fixed when it subscribes
        stuck = await subscribe_stuck(app, alpha.owner, channel["id"], ws)
        app.server.config = config
        [subscribed] = [c for c in app.server.connections.all if c.push is not None]
        # Once it has the first message it is in step (its cursor moves with each publication).
        await owner.call("message.send", scope_id=channel["id"], content="first", **ws)
        while (await stuck.next_message()).get("event") != "message.created":
            pass
        for sent in range(1, 500):
            await owner.call("message.send", scope_id=channel["id"], content="x" * 30_000, **ws)
            assert subscribed.ws.backlog == 0 or subscribed.ws.closing, sent
            if subscribed.ws.closing:
                break
        else:
            pytest.fail("never cut off")
        received, text = 0, ""
        with trio.fail_after(20):
            while not isinstance(event := await stuck.next_event(), CloseConnection):
                text += event.data
                if event.message_finished:
                    received += json.loads(text).get("event") == "message.created"
                    text = ""
        assert event.code == frames.CLOSE_SLOW_CONSUMER and received == sent
        await stuck.stream.aclose()


async def test_a_database_failure_during_a_replay_closes_unavailable_not_slow_consumer(app: App, tenants,
                                                                                     database_dsn):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    # The replay's first statement (the reader-window probe, a long text that
    # pg_stat_activity truncates) or its page query, waiting on the locked log.
    replay_query = ("wait_event_type = 'Lock' AND (query LIKE '%FROM scope_messages m%' "
                    "OR query LIKE '%WITH reader AS%')")
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "replayed")
        await owner.call("message.send", scope_id=channel["id"], content="missed", **ws)
    # Hold the message log locked so the replay's query waits inside the database,
    # then kill that query's connection: the replay fails with DatabaseUnavailable.
    async with Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as admin, \
            trio.open_nursery() as nursery:
        await hold_table_lock(admin, nursery, "scope_messages")
        async with await signed_in(app, alpha.owner) as resuming:
            await resuming.call("subscribe", scopes=[{"scope_id": channel["id"], "after_seq": 0}], **ws)
            with trio.fail_after(15):
                await wait_for_query(admin, replay_query)  # the replay waits in the database
            await terminate(admin, replay_query)
            with trio.fail_after(15):
                assert await resuming.wait_closed() == frames.CLOSE_UNAVAILABLE
            assert resuming.ws.closed.reason == "unavailable"
        await release_locks(admin)


# --- the workspace feed under any publication order ---------------------------------------------

@dataclasses.dataclass
class FeedWorld:
    url: str
    workspace_id: str
    shared: str   # a channel bob is in
    elsewhere: str  # a channel bob is not in


async def _feed_world(db: Database, url: str, password_hash: str) -> FeedWorld:
    from server import tenancy as ops

    first = await ops.init_instance(db, email="owner@example.com", display_name="Owner", workspace_name="Feed",
                                    workspace_slug="feed", edition="single", password=MEMBER_PASSWORD)
    bob = await add_person(db, first.workspace_id, "bob@example.com", "developer", password_hash)
    async with connect(url) as owner:
        await owner.login("owner@example.com", MEMBER_PASSWORD)
        shared = await open_channel(owner, first.workspace_id, "shared", [bob.member_id])
        elsewhere = await open_channel(owner, first.workspace_id, "elsewhere", visibility="private")
    return FeedWorld(url, first.workspace_id, shared["id"], elsewhere["id"])


async def _created_until(conn, message_id: str) -> list[str]:
    received: list[str] = []
    with trio.fail_after(15):
        while message_id not in received:
            event = await conn.next_event()
            if event["event"] == "message.created":
                received.append(event["data"]["id"])
    return received


async def _publish_out_of_order(thread: ServerThread, into_shared: list[bool], order: list[int]) -> None:
    world, server = thread.base, thread.server
    hub = server.hub
    async with connect(world.url) as owner, connect(world.url) as bob:
        await owner.login("owner@example.com", MEMBER_PASSWORD)
        await bob.login("bob@example.com", MEMBER_PASSWORD)
        await bob.call("subscribe", workspace_feed=True)
        start = await owner.call("message.send", scope_id=world.shared, content="start")
        await _created_until(bob, start["id"])  # the subscribe's own catch-up is over
        # Commit every message, but hold each one's publication back.
        held: list = []
        publish_many = hub.publish_many

        def holding(items, **kwargs):
            if any(event.scope_id in (world.shared, world.elsewhere) for event, _ in items):
                held.append((items, kwargs))
            else:
                publish_many(items, **kwargs)

        hub.publish_many = holding
        try:
            sent = [await owner.call("message.send", scope_id=world.shared if shared else world.elsewhere,
                                     content=str(index)) for index, shared in enumerate(into_shared)]
        finally:
            hub.publish_many = publish_many
        assert len(held) == len(sent)  # sent one at a time: a publication each
        replays = server.metrics.push_gap_replays
        for index in order:
            items, kwargs = held[index]
            publish_many(items, **kwargs)
        end = await owner.call("message.send", scope_id=world.shared, content="end")
        received = await _created_until(bob, end["id"])
    assert received == [m["id"] for m, shared in zip(sent, into_shared) if shared] + [end["id"]]
    # A gap, and so a read of the log, only when a message bob reads arrives before one
    # committed under it; one he does not read arriving early is just a step of his feed.
    # The publications are released without a pause, so the first gap's replay runs after
    # all of them: one read of the log, after which "end" is the next step, no gap.
    arrived: set[int] = set()
    gap = False
    for index in order:
        gap |= into_shared[index] and not arrived.issuperset(range(index))
        arrived.add(index)
    assert server.metrics.push_gap_replays - replays == int(gap), (into_shared, order)


def test_the_feed_delivers_each_readable_message_once_in_order_whatever_the_publication_order(
        database_dsn, member_password_hash):
    """Publications of different scopes can reach the hub in another order than their
    commits; a workspace-feed subscriber still gets exactly what it reads, once, in
    global order, and reads the log only for a gap under a message it reads."""
    config = ServerConfig(port=0, shutdown_grace_seconds=1.0)
    with ServerThread(database_dsn, config, lambda db, url: _feed_world(db, url, member_password_hash)) as thread:

        @settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(plan=st.lists(st.booleans(), min_size=2, max_size=7).flatmap(
            lambda into_shared: st.tuples(st.just(into_shared), st.permutations(range(len(into_shared))))))
        def publications(plan):
            thread.run(_publish_out_of_order, thread, *plan)

        publications()


async def _publish_runs(thread: ServerThread, chunks: list[int], order: list[int]) -> None:
    """Commit one message per chunk member into one channel, holding each publication
    back; publish each chunk's messages together (a run of consecutive seqs), the
    chunks in `order`.  A channel subscriber and a workspace-feed subscriber each get
    every message once, in seq order."""
    world, server = thread.base, thread.server
    hub = server.hub
    async with connect(world.url) as owner, connect(world.url) as bob, connect(world.url) as feed:
        await owner.login("owner@example.com", MEMBER_PASSWORD)
        await bob.login("bob@example.com", MEMBER_PASSWORD)
        await feed.login("bob@example.com", MEMBER_PASSWORD)
        await bob.call("subscribe", scopes=[{"scope_id": world.shared}])
        await feed.call("subscribe", workspace_feed=True)
        start = await owner.call("message.send", scope_id=world.shared, content="start")
        await _created_until(bob, start["id"])
        await _created_until(feed, start["id"])
        held: list = []
        publish_many = hub.publish_many

        def holding(items, **kwargs):
            if any(event.scope_id == world.shared for event, _ in items):
                held.append(items)
            else:
                publish_many(items, **kwargs)

        hub.publish_many = holding
        try:
            sent = [await owner.call("message.send", scope_id=world.shared, content=str(index))
                    for index in range(sum(chunks))]
        finally:
            hub.publish_many = publish_many
        assert len(held) == len(sent)
        bounds = [sum(chunks[:index]) for index in range(len(chunks) + 1)]
        replays = server.metrics.push_gap_replays
        for index in order:
            publish_many([item for items in held[bounds[index]:bounds[index + 1]] for item in items])
        end = await owner.call("message.send", scope_id=world.shared, content="end")
        expected = [m["id"] for m in sent] + [end["id"]]
        assert await _created_until(bob, end["id"]) == expected
        assert await _created_until(feed, end["id"]) == expected
    if order == sorted(order):
        assert server.metrics.push_gap_replays == replays


def test_runs_of_messages_published_together_arrive_once_in_order_whatever_the_publication_order(
        database_dsn, member_password_hash):
    """A publication of several consecutive messages of one scope goes to a subscriber
    whose cursor stands just before it in one piece (actors/fanout.py's EventRun);
    anything else — a run arriving before the one under it, a run behind the
    cursor, a feed subscriber — takes the per-event path with its gap replays."""
    config = ServerConfig(port=0, shutdown_grace_seconds=1.0)
    with ServerThread(database_dsn, config, lambda db, url: _feed_world(db, url, member_password_hash)) as thread:

        @settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(plan=st.lists(st.integers(1, 3), min_size=1, max_size=4).flatmap(
            lambda chunks: st.tuples(st.just(chunks), st.permutations(range(len(chunks))))))
        def publications(plan):
            thread.run(_publish_runs, thread, *plan)

        publications()


async def test_subscribes_are_answered_a_pooled_connection_at_a_time(app: App, tenants):
    """README: a node answers as many subscribes at once as its database pool has
    connections; the rest wait their turn, and other commands are not held back."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    slots = app.server.subscribe_slots
    capacity = slots.free
    assert capacity == app.server.db.settings.max_size
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, alpha.owner) as other:
        channel = await open_channel(owner, alpha.workspace_id, "admitted")
        for _ in range(capacity):
            slots.acquire_nowait()  # every slot busy
        answered = []

        async def subscribe() -> None:
            answered.append(await owner.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(subscribe)
            await trio.testing.wait_all_tasks_blocked()  # the command is read (it needs no database yet)
            assert slots.waiting == 1 and answered == []
            assert (await other.call("scope.get", scope_id=channel["id"], **ws))["id"] == channel["id"]
            assert slots.waiting == 1 and answered == []
            slots.release()
        assert [s["id"] for s in answered[0]["scopes"]] == [channel["id"]]
        for _ in range(capacity - 1):
            slots.release()


# --- the in-step group (server/realtime.py ScopeGroup) ----------------------------------------

def _subscribed(app: App) -> set:
    return {c for c in app.server.connections.all if c.push is not None}


async def _send_until_grouped(app: App, owner, channel_id: str, ws: dict) -> int:
    """Send until every subscribed connection is in the scope's group (each joins at the first
    publication it takes in step once its subscribe's catch-up is over): how many were sent.
    A catch-up is a history read, whose first plan on a pooled connection takes a while on a
    busy machine: no send goes out while one is still under way, so the count stays small.
    This module's push_buffer_events of 8 would cut off a subscriber whose catch-up is slow."""
    app.server.config = dataclasses.replace(app.server.config, push_buffer_events=1024)
    with trio.fail_after(30):
        for sent in range(1, 21):
            while any(c.push._backlog is not None for c in _subscribed(app)):
                await trio.sleep(0.01)  # a catch-up under way: it ends on its own
            await owner.call("message.send", scope_id=channel_id, content=f"to the group {sent}", **ws)
            group = app.server.hub._groups.get(channel_id)
            if group is not None and {c.push.subscription for c in _subscribed(app)} <= group.members.keys():
                return sent
    pytest.fail(f"the subscribers never joined the group (seq {group and group.seq}): " + "; ".join(
        f"cursor {c.push.scope_cursors.get(channel_id)} grouped {c.push._group is not None} "
        f"sends_now {c.ws.sends_now}" for c in _subscribed(app)))


async def test_a_closed_members_descriptor_reused_by_another_connection_gets_nothing_of_the_scope(app: App,
                                                                                                 tenants):
    """A group writes to its members' descriptors directly: a member whose socket closes
    must be gone from it before the descriptor can be another connection's."""
    alpha, beta = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, alpha.owner) as staying:
        channel = await open_channel(owner, alpha.workspace_id, "reused")
        await staying.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)  # the group outlives the member
        [stays] = _subscribed(app)
        async with await signed_in(app, alpha.owner) as listener:
            await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
            sent = await _send_until_grouped(app, owner, channel["id"], ws)
            assert [e["seq"] for e in await events_for(listener, sent)] == list(range(1, sent + 1))
            [member] = _subscribed(app) - {stays}
            freed = member.ws.fileno()
        with trio.fail_after(10):
            await member.ws.wait_closed()
        # Linux hands out the lowest free descriptor: the next accepted connections take it.
        outsiders, reused = [], False
        async with contextlib.AsyncExitStack() as stack:
            while not reused and len(outsiders) < 8:
                before = set(app.server.connections.all)
                outsiders.append(await stack.enter_async_context(await signed_in(app, beta.owner)))
                [accepted] = set(app.server.connections.all) - before
                reused = accepted.ws.fileno() == freed
            assert reused, "no connection took the freed descriptor"
            await owner.call("message.send", scope_id=channel["id"], content="after the close", **ws)
            for conn in outsiders:
                await conn.call("ping")  # answered after anything the publication wrote to it
                assert conn.queued_events() == []
        assert [e["data"]["content"] for e in await events_for(staying, sent + 1)][-1] == "after the close"


async def test_a_member_removed_from_the_scope_gets_none_of_its_later_messages(app: App, tenants,
                                                                           member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "leaving", [bob.member_id])
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        sent = await _send_until_grouped(app, owner, channel["id"], ws)
        assert [e["seq"] for e in await events_for(listener, sent)] == list(range(1, sent + 1))
        await owner.call("scope.remove", scope_id=channel["id"], member_id=bob.member_id, **ws)
        await owner.call("message.send", scope_id=channel["id"], content="after the removal", **ws)
        await listener.call("ping")
        assert [e for e in listener.queued_events() if e["event"] == "message.created"] == []


async def test_members_of_each_wire_format_get_the_run_in_their_own(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "formats")
        clients = {}
        for subprotocol in ("scopewire.json", "scopewire.msgpack"):
            client, _ = await RawClient.open(app, [subprotocol])
            for request in ({"op": "login", "id": "1", "email": alpha.owner.email, "password": alpha.owner.password},
                            {"op": "subscribe", "id": "2", "scopes": [{"scope_id": channel["id"]}], **ws}):
                binary = subprotocol == "scopewire.msgpack"
                await client.send(Message(data=msgspec.msgpack.encode(request) if binary else json.dumps(request)))
                while _decoded(await client.next_event()).get("id") != request["id"]:
                    pass
            clients[subprotocol] = client
        sent = await _send_until_grouped(app, owner, channel["id"], ws)
        for i in range(4):  # through the group
            await owner.call("message.send", scope_id=channel["id"], content=f"format {i}", **ws)
        for subprotocol, client in clients.items():
            received = []
            while len(received) < sent + 4:
                event = await client.next_event()
                assert isinstance(event.data, bytes) == (subprotocol == "scopewire.msgpack")
                frame = _decoded(event)
                if frame.get("event") == "message.created":
                    received.append(frame["data"]["content"])
            assert received[sent:] == [f"format {i}" for i in range(4)]
            await client.stream.aclose()


def _decoded(event) -> dict:
    return msgspec.msgpack.decode(event.data) if isinstance(event.data, bytes) else json.loads(event.data)


async def test_events_that_move_no_cursor_reach_the_members_and_keep_the_group(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, alpha.owner) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "reacting")
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        sent = await _send_until_grouped(app, owner, channel["id"], ws)
        created = await events_for(listener, sent)
        group = app.server.hub._groups[channel["id"]]
        await owner.call("reaction.add", message_id=created[-1]["data"]["id"], key="👍", **ws)
        assert (await events_for(listener, 1, "reaction.added"))[0]["data"]["key"] == "👍"
        assert app.server.hub._groups[channel["id"]] is group and len(group.members) == 1
        await owner.call("message.send", scope_id=channel["id"], content="still grouped", **ws)
        assert (await events_for(listener, 1))[0]["seq"] == sent + 1
        assert len(group.members) == 1
