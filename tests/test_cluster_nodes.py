"""Several nodes (servers with their own pools) in one process on one database:
scope ownership, forwarding, fencing, cross-node fanout, and a hostile frame on
the forward link.  Crashes and freezes of real processes are in
tests/test_cluster_processes.py."""

from __future__ import annotations

import base64
from collections import Counter
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from actors.fanout import CommittedEvent, Roster
from actors.scope_actor import Send
from client.trio_client import ClientError, Connection
from domain.plan import ActorContext, MessageIntent
from protocol import guide
from server.app import Server
from server import cluster_fanout
from server.auth import Authenticator
from server.cluster import (LINK_CLOSING, NONCE_BYTES, _dumps, _Framed, _loads, _PeerLink, _proof, _read_exact,
                            _session_key)
from server.config import ServerConfig
from server.credentials import SessionSigner
from storage import messages
from storage.errors import LeaseLost
from storage.bridge import Database
from tests.conftest import App, Person, Tenant, add_person
from tests.test_bus import nats_server  # noqa: F401  (a fixture)
from tests.test_cluster_link import pickle_calling
from tests.test_messaging import open_channel
from tests.test_private_visibility import as_agent
from tests.test_realtime import events_for
from tests.test_tenancy import expect_error, signed_in

# Heartbeats far apart: a test that expires a node's lease by hand is not undone by one.
NODE_CONFIG = {"port": 0, "auth_timeout_seconds": 2.0, "shutdown_grace_seconds": 2.0, "node_lease_seconds": 600.0}


async def _run_node(dsn: str, signer: SessionSigner, config: dict, *, task_status) -> None:
    async with Database(dsn) as db:
        server_config = ServerConfig(**{**NODE_CONFIG, **config})
        server = Server(server_config, db, Authenticator(db, signer, server_config.session_ttl_seconds))
        # No routed-delivery sweep during a test: a delivery arrives because it was pushed.
        server.deliveries.sweep_seconds = 3600.0
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            task_status.started((App(server, db), nursery.cancel_scope))
            await trio.sleep_forever()


class Nodes:
    def __init__(self, nursery, dsn: str) -> None:
        self.nursery, self.dsn = nursery, dsn
        self.signer = SessionSigner(Ed25519PrivateKey.generate())
        self.apps: list[App] = []
        self.stops: list[trio.CancelScope] = []

    async def start(self, count: int, **config) -> list[App]:
        for _ in range(count):
            app, stop = await self.nursery.start(_run_node, self.dsn, self.signer,
                                                 {"node_id": f"node-{len(self.apps)}", **config})
            self.apps.append(app)
            self.stops.append(stop)
        return self.apps


@pytest.fixture
async def nodes(database_dsn, nursery, tenants) -> list[App]:
    return await Nodes(nursery, database_dsn).start(3)


@pytest.fixture
def alpha(tenants) -> Tenant:
    return tenants[0]


@pytest.fixture(params=["listed", "by_generation"])
def roster_travel(request, monkeypatch) -> str:
    """How a new message's readers travel: its roster listed, or (every roster counting as
    large) as the scope's roster generation plus the private members that may read it."""
    if request.param == "by_generation":
        monkeypatch.setattr(cluster_fanout, "MAX_EXPLICIT_AUDIENCE", 0)
    return request.param


@dataclass
class Following:
    """The workspace owner, signed in on one node, and bob, signed in on another and
    following the channel the owner opened with him."""
    owner: Connection
    listener: Connection
    bob: Person
    channel_id: str
    ws: dict

    async def send(self, content: str, sender: Connection | None = None) -> dict:
        return await (sender or self.owner).call("message.send", scope_id=self.channel_id, content=content, **self.ws)


@asynccontextmanager
async def bob_following(owner_node: App, listener_node: App, alpha: Tenant, slug: str,
                        password_hash: str) -> AsyncIterator[Following]:
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(owner_node.db, alpha.workspace_id, "bob@example.com", "developer", password_hash)
    async with await signed_in(owner_node, alpha.owner) as owner, await signed_in(listener_node, bob) as listener:
        channel = await open_channel(owner, alpha.workspace_id, slug, [bob.member_id])
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        yield Following(owner, listener, bob, channel["id"], ws)


async def scout_in_channel(owner: Connection, ws: dict, slug: str, members: tuple[str, ...] = ()) -> tuple[dict, str]:
    """A new channel with `members` and the agent scout, whom the owner makes; and scout's API key."""
    agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
    channel = await open_channel(owner, ws["workspace_id"], slug, [*members, agent["id"]])
    return channel, (await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws))["key"]


async def _lease(app: App, scope_id: str):
    return await app.db.run(lambda conn: conn.fetchrow("SELECT node_id, epoch FROM scope_leases WHERE scope_id = $1",
                                                       scope_id))


async def test_a_send_through_any_node_reaches_subscribers_on_every_node(nodes, alpha, member_password_hash,
                                                                        roster_travel):
    first, second, third = nodes
    async with bob_following(first, second, alpha, "live", member_password_hash) as live, \
            await signed_in(third, alpha.owner) as other_sender, await signed_in(third, live.bob) as feed:
        await feed.call("subscribe", workspace_feed=True, **live.ws)
        for i in range(5):
            await live.send(f"a{i}")
            await live.send(f"c{i}", sender=other_sender)
        received = await events_for(live.listener, 10)
        assert [e["seq"] for e in received] == list(range(1, 11))
        assert [e["data"]["content"] for e in received] == [f"{s}{i}" for i in range(5) for s in "ac"]
        assert [e["seq"] for e in await events_for(feed, 10)] == list(range(1, 11))
        await other_sender.call("reaction.add", message_id=received[0]["data"]["id"], key="👍", **live.ws)
        reactions = await events_for(live.listener, 1, "reaction.added")
        assert reactions[0]["data"]["message_id"] == received[0]["data"]["id"]
        # Big enough to travel through the bus's spill table.
        await live.owner.call("message.edit", message_id=received[0]["data"]["id"], content="x" * 20_000,
                              expected_revision=1, **live.ws)
        edited = await events_for(live.listener, 1, "message.edited")
        assert edited[0]["data"]["content"] == "x" * 20_000
    assert (await _lease(first, live.channel_id))["node_id"] == "node-0"
    assert third.server.cluster.forwarded_out >= 5 and first.server.cluster.forwarded_in >= 5
    assert second.server.cluster.bus_received > 0 and second.server.cluster.bus_resyncs == 0


async def test_forwarded_commands_answer_as_the_owner_would(nodes, alpha, member_password_hash):
    ws = {"workspace_id": alpha.workspace_id}
    first, second, _ = nodes
    carol = await add_person(first.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner, await signed_in(second, alpha.owner) as remote, \
            await signed_in(second, carol) as outsider:
        channel = await open_channel(owner, alpha.workspace_id, "private-ish", visibility="private")
        sent = await remote.call("message.send", scope_id=channel["id"], content="one", client_message_id="c-1", **ws)
        again = await remote.call("message.send", scope_id=channel["id"], content="one", client_message_id="c-1", **ws)
        assert again["id"] == sent["id"]
        await expect_error("idempotency_conflict", remote.call("message.send", scope_id=channel["id"],
                                                               content="two", client_message_id="c-1", **ws))
        await expect_error("not_found", outsider.call("message.send", scope_id=channel["id"], content="no", **ws))
        edited = await remote.call("message.edit", message_id=sent["id"], content="uno", expected_revision=1, **ws)
        assert edited["revision"] == 2
        await expect_error("conflict", remote.call("message.edit", message_id=sent["id"], content="dos",
                                                   expected_revision=1, **ws))
    assert second.server.cluster.forwarded_out >= 4


async def test_a_private_agent_on_another_node_gets_only_what_it_may_read(nodes, alpha, member_password_hash,
                                                                         roster_travel):
    ws = {"workspace_id": alpha.workspace_id}
    first, second, third = nodes
    bob = await add_person(first.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner, await signed_in(third, bob) as b:
        channel, key = await scout_in_channel(owner, ws, "project", (bob.member_id,))
        async with as_agent(second, key) as scout:
            await scout.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
            from_bob = await b.call("message.send", scope_id=channel["id"], content="from bob", **ws)
            await b.call("reaction.add", message_id=from_bob["id"], key="👀", **ws)
            await b.call("typing", scope_id=channel["id"], **ws)
            await owner.call("message.send", scope_id=channel["id"], content="from the owner", **ws)
            received = []
            with trio.fail_after(20):
                while not received or received[-1].get("data", {}).get("content") != "from the owner":
                    received.append(await scout.next_event())
    # (The channel's membership.changed event, which scout as a member may read, may reach it after it
    # subscribed, over the bus.)
    assert [(e["event"], e["data"].get("content")) for e in received if e["event"] != "membership.changed"] == [
        ("message.created", "from the owner")]


async def test_new_messages_travel_whole_and_a_roster_is_read_once_per_generation(
        nodes, alpha, member_password_hash, monkeypatch):
    monkeypatch.setattr(cluster_fanout, "MAX_EXPLICIT_AUDIENCE", 0)  # every roster travels as its generation
    first, second, _ = nodes
    remote = second.server.cluster.remote
    carol = await add_person(first.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    async with bob_following(first, second, alpha, "big", member_password_hash) as big, \
            await signed_in(second, carol) as c:
        for i in range(3):
            await big.send(f"m{i}")
            assert [e["data"]["content"] for e in await events_for(big.listener, 1)] == [f"m{i}"]
            if i == 0:
                # The channel's membership event, which came over the bus before m0, asked the log
                # who reads it if bob had subscribed by the time it arrived: counted from here on.
                logged = remote.log_reads
        assert (remote.roster_reads, remote.log_reads) == (1, logged)
        await big.owner.call("scope.invite", scope_id=big.channel_id, member_ids=[carol.member_id], **big.ws)
        await c.call("subscribe", scopes=[{"scope_id": big.channel_id}], **big.ws)
        await big.send("after the invite")
        for listener in (big.listener, c):
            assert [e["data"]["content"] for e in await events_for(listener, 1)] == ["after the invite"]
        assert remote.roster_reads == 2
        logged = remote.log_reads  # the invite's membership event asked who of bob and carol reads
        # Too big to travel whole: read from the log, in order with the one that travels whole.
        await big.send("y" * 5_000)
        await big.send("small")
        received = await events_for(big.listener, 2)
        assert [e["data"]["content"] for e in received] == ["y" * 5_000, "small"]
        assert [e["seq"] for e in received] == [5, 6]
        assert (remote.roster_reads, remote.log_reads) == (2, logged + 1)
        # One whose roster moved on before it arrived (here: named by an older generation) is read from the log.
        row = await first.db.run(lambda conn: conn.fetchrow(
            "SELECT m.*, s.roster_generation FROM scope_messages m JOIN scopes s ON s.id = m.scope_id "
            "WHERE m.scope_id = $1 AND m.seq = 6", big.channel_id))
        stale = CommittedEvent("message.created", alpha.workspace_id, big.channel_id, 6, row["workspace_global_seq"],
                               messages.committed_from_row(row))
        await remote.deliver([cluster_fanout.encode([(stale, Roster({"x"}, row["roster_generation"] - 1))])])
        assert (remote.roster_reads, remote.log_reads) == (2, logged + 2)


async def test_a_lost_bus_message_loses_no_message(nodes, alpha, member_password_hash):
    first, second, _ = nodes
    async with bob_following(first, second, alpha, "lossy", member_password_hash) as lossy:
        await lossy.send("one")
        assert [e["seq"] for e in await events_for(lossy.listener, 1)] == [1]
        # A publication that never reaches the bus (its number is skipped, as when a send fails).
        relay, first.server.hub.relay = first.server.hub.relay, None
        await lossy.send("two")
        first.server.hub.relay = relay
        first.server.cluster._bus_seq += 1
        await lossy.send("three")
        received = []
        with trio.fail_after(15):
            while not received or received[-1]["event"] != "events.missed":
                received.append(await lossy.listener.next_event())
        await lossy.send("four")
        received += await events_for(lossy.listener, 1)
    # The log is replayed from the cursor (through "three", committed before the bus message that
    # showed the gap); then the notice that events outside the log may be gone; then live again.
    assert [(e["event"], e.get("seq"), e["data"].get("content") or e["data"].get("reason")) for e in received] == [
        ("message.created", 2, "two"), ("message.created", 3, "three"), ("events.missed", None, "cluster_bus"),
        ("message.created", 4, "four")]
    assert received[2]["workspace_id"] == alpha.workspace_id and received[2]["scope_id"] == ""
    assert second.server.cluster.bus_resyncs == 1


async def test_resyncs_in_a_row_send_one_events_missed(nodes, alpha, member_password_hash):
    first, second, _ = nodes
    async with bob_following(first, second, alpha, "twice", member_password_hash) as twice, \
            await signed_in(second, twice.bob) as gone:
        await gone.call("subscribe", scopes=[{"scope_id": twice.channel_id}], **twice.ws)
        await gone.call("unsubscribe", scope_ids=[twice.channel_id], **twice.ws)
        await twice.send("one")
        second.server.cluster._resync("a transport resync")
        second.server.cluster._resync("a gap")  # before the replay task has run: the same notice
        received = []
        with trio.fail_after(15):
            while not received or received[-1]["event"] != "events.missed":
                received.append(await twice.listener.next_event())
            # Sent only now: the replay reads the log, so a "two" committed before it ran would be
            # replayed ahead of the notice.  A second notice would still be queued before "two".
            await twice.send("two")
            while received[-1].get("seq") != 2:
                received.append(await twice.listener.next_event())
        await gone.call("ping")
        assert gone.queued_events() == []  # it follows nothing any more: nothing to re-read
    # (The channel's membership.changed events may reach bob's listener first, over the bus.)
    assert [e["event"] for e in received if e["event"] != "membership.changed"] == [
        "message.created", "events.missed", "message.created"]


async def test_a_stale_owner_commits_nothing_and_its_commands_run_at_the_new_owner(nodes, alpha):
    ws = {"workspace_id": alpha.workspace_id}
    first, second, _ = nodes
    async with await signed_in(first, alpha.owner) as on_first, await signed_in(second, alpha.owner) as on_second:
        channel = await open_channel(on_first, alpha.workspace_id, "fenced")
        await on_first.call("message.send", scope_id=channel["id"], content="one", **ws)
        assert await _lease(first, channel["id"]) == ("node-0", 1)
        # node-0's lease runs out (as if it froze): node-1 takes the scope at the next command.
        await first.db.run(lambda conn: conn.execute(
            "UPDATE cluster_nodes SET heartbeat_at = now() - interval '1 hour', "
            "lease_expires_at = now() - interval '1 second' WHERE node_id = 'node-0'"))
        assert (await on_second.call("message.send", scope_id=channel["id"], content="two", **ws))["seq"] == 2
        assert await _lease(first, channel["id"]) == ("node-1", 2)
        # node-0's actor still runs with epoch 1: its batch fails the fence, commits nothing, and
        # the command runs at node-1.
        before = first.server.cluster.forwarded_out
        assert (await on_first.call("message.send", scope_id=channel["id"], content="three", **ws))["seq"] == 3
        assert first.server.cluster.forwarded_out == before + 1
        history = await on_first.call("message.history", scope_id=channel["id"], **ws)
    assert [(m["seq"], m["content"]) for m in history["messages"]] == [(1, "one"), (2, "two"), (3, "three")]
    assert await _lease(first, channel["id"]) == ("node-1", 2)


async def test_a_clean_shutdown_hands_the_scopes_over_at_once(database_dsn, nursery, alpha):
    ws = {"workspace_id": alpha.workspace_id}
    cluster = Nodes(nursery, database_dsn)
    first, second = await cluster.start(2)
    async with await signed_in(first, alpha.owner) as on_first:
        channel = await open_channel(on_first, alpha.workspace_id, "handover")
    cluster.stops[0].cancel()
    with trio.fail_after(15):
        while (await _lease(second, channel["id"]))["node_id"] is not None:
            await trio.sleep(0.05)  # the cancelled node's shutdown is running in the background
    async with await signed_in(second, alpha.owner) as on_second:
        sent = await on_second.call("message.send", scope_id=channel["id"], content="after", **ws)
    assert sent["seq"] == 1
    assert await _lease(second, channel["id"]) == ("node-1", 2)


async def test_sends_forwarded_to_an_owner_that_shuts_down_are_all_answered_and_stored_once(database_dsn, nursery,
                                                                                            alpha):
    """The owner's clean shutdown finishes the commands it holds and sends new ones back: a
    client on another node sees every send succeed (none `unavailable`), each stored once."""
    ws = {"workspace_id": alpha.workspace_id}
    cluster = Nodes(nursery, database_dsn)
    first, second = await cluster.start(2)
    async with await signed_in(first, alpha.owner) as on_first:
        channel = await open_channel(on_first, alpha.workspace_id, "draining")
    outcomes: list[str] = []

    async def sender(index: int) -> None:
        async with await signed_in(second, alpha.owner) as conn:
            for number in range(30):
                try:
                    await conn.call("message.send", scope_id=channel["id"], content=f"{index}-{number}",
                                    client_message_id=f"c-{index}-{number}", **ws)
                    outcomes.append("ok")
                except ClientError as exc:
                    outcomes.append(exc.code)
                if index == 0 and number == 5:
                    cluster.stops[0].cancel()  # the owner shuts down while the others keep sending

    async with trio.open_nursery() as senders:
        for index in range(6):
            senders.start_soon(sender, index)
    assert Counter(outcomes) == {"ok": 180}
    stored = await second.db.run(lambda conn: conn.fetch(
        "SELECT seq, content FROM scope_messages WHERE scope_id = $1 ORDER BY seq", channel["id"]))
    assert [row["seq"] for row in stored] == list(range(1, 181))
    assert sorted(row["content"] for row in stored) == sorted(f"{i}-{n}" for i in range(6) for n in range(30))
    assert (await _lease(second, channel["id"]))["node_id"] == "node-1"


async def test_requests_a_closing_node_never_read_go_back_to_the_sender_as_not_run(database_dsn, nursery, alpha):
    first, second = await Nodes(nursery, database_dsn).start(2)
    link = _PeerLink(second.server.cluster, first.server.cluster.forward_address)
    await link._connect()
    done, slot = trio.Event(), []
    link._pending[1] = (done, slot)  # sent, and not read by the owner before it closes its links
    await trio.testing.wait_all_tasks_blocked()  # the owner serves the link (past its handshake)
    await first.server.cluster.close_links()
    with trio.fail_after(10):
        await done.wait()
    ok, error = slot[0]
    assert not ok and isinstance(error, LeaseLost)  # the sender looks for the owner again and runs it there
    # A peer's link that is not ours to handle says the same, as the node's last frame.
    framed = await _open_link(second)
    await trio.testing.wait_all_tasks_blocked()
    await second.server.cluster.close_links()
    assert _loads(await framed.receive()) == LINK_CLOSING


async def test_a_client_resumes_against_another_node(nodes, alpha, member_password_hash):
    first, second, third = nodes
    async with bob_following(first, second, alpha, "resume", member_password_hash) as resume:
        for i in range(3):
            await resume.send(f"m{i}")
        cursor = (await events_for(resume.listener, 3))[-1]["seq"]
    async with await signed_in(first, alpha.owner) as owner:
        for i in range(3, 6):  # while bob is away
            await resume.send(f"m{i}", sender=owner)
        async with await signed_in(third, resume.bob) as listener:
            await listener.call("subscribe", scopes=[{"scope_id": resume.channel_id, "after_seq": cursor}],
                                **resume.ws)
            await resume.send("m6", sender=owner)
            received = await events_for(listener, 4)
    assert [(e["seq"], e["data"]["content"]) for e in received] == [(i + 1, f"m{i}") for i in range(3, 7)]


def test_the_contract_states_the_default_node_lease():
    assert "default 10 s" in guide.NODES and ServerConfig().node_lease_seconds == 10


async def test_nodes_on_the_nats_bus_fan_out_like_on_postgres(database_dsn, nursery, alpha, nats_server,
                                                             member_password_hash):
    first, second = await Nodes(nursery, database_dsn).start(2, bus="nats", nats_url=nats_server.url)
    async with bob_following(first, second, alpha, "nats", member_password_hash) as nats:
        for i in range(3):
            await nats.send(f"n{i}")
        received = await events_for(nats.listener, 3)
    assert [(e["seq"], e["data"]["content"]) for e in received] == [(1, "n0"), (2, "n1"), (3, "n2")]
    assert second.server.cluster.transport.name == "nats" and second.server.cluster.bus_received >= 3


async def test_a_routed_delivery_reaches_the_agent_daemon_on_another_node_at_once(nodes, alpha):
    ws = {"workspace_id": alpha.workspace_id}
    first, second, _ = nodes
    async with await signed_in(first, alpha.owner) as owner:
        channel, key = await scout_in_channel(owner, ws, "work")
        async with as_agent(second, key) as scout:
            await scout.call("delivery.subscribe", **ws)
            sent = await owner.call("message.send", scope_id=channel["id"], content="@scout look", **ws)
            with trio.fail_after(20):
                while (event := await scout.next_event())["event"] != "delivery":
                    pass
            await scout.call("delivery.ack", delivery_seqs=[event["data"]["delivery_seq"]], **ws)
    assert (event["data"]["message_id"], event["data"]["reason"]) == (sent["id"], "mention")


async def test_foreign_bus_messages_are_ignored(nodes, alpha, member_password_hash):
    first, second, _ = nodes
    async with bob_following(first, second, alpha, "after", member_password_hash) as after:
        # Anyone who may NOTIFY on the database can put bytes on the bus: an unsealed event for
        # everyone following the channel is dropped, and a sealed one that does not decode costs
        # a resync, never the node.
        frame = msgspec.msgpack.encode({"type": "event", "event": "message.created", "workspace_id": alpha.workspace_id,
                                        "scope_id": after.channel_id, "data": {"content": "forged"}})
        bus_item = [1, "message.edited", alpha.workspace_id, after.channel_id, None, None, frame, None, False, None]
        forged = base64.b64encode(msgspec.msgpack.encode([bus_item])).decode()
        sealed_garbage = base64.b64encode(second.server.cluster._seal(b"\xc1not msgpack")).decode()
        await first.db.run(lambda conn: conn.execute(
            "SELECT pg_notify('scopewire_bus', 'intruder.1:1:' || $1), "
            "pg_notify('scopewire_bus', 'intruder.1:2:' || $2)", forged, sealed_garbage))
        await after.send("real")
        received = []
        with trio.fail_after(20):
            while len(received) < 2:
                # (The channel's membership.changed events may reach bob's listener first, over the bus.)
                if (event := await after.listener.next_event())["event"] != "membership.changed":
                    received.append(event)
    # The garbage's resync may read "real" from the log before its notice, or come before "real" commits.
    assert sorted((e["event"], e["data"].get("content") or "") for e in received) == [
        ("events.missed", ""), ("message.created", "real")]
    assert second.server.cluster.bus_resyncs == 1


async def test_a_lone_node_publishes_nothing_on_the_bus(database_dsn, nursery, alpha):
    ws = {"workspace_id": alpha.workspace_id}
    (alone,) = await Nodes(nursery, database_dsn).start(1)
    async with await signed_in(alone, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "alone")
        await owner.call("message.send", scope_id=channel["id"], content="nobody else", **ws)
    assert not alone.server.cluster.peers_live and alone.server.cluster.bus_sent == 0


async def _open_link(node: App) -> _Framed:
    """A link to `node` opened as another node holding the key opens one (_PeerLink._connect)."""
    key = node.server.cluster.key
    host, _, port = node.server.cluster.forward_address.rpartition(":")
    stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
    server_nonce = await _read_exact(stream, NONCE_BYTES)
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    await stream.send_all(client_nonce + _proof(key, server_nonce, client_nonce))
    assert await _read_exact(stream, 1) == b"\x01"
    return _Framed(stream, _session_key(key, server_nonce, client_nonce), outgoing=0)


async def test_a_frame_that_would_run_code_drops_its_link_and_runs_nothing(database_dsn, nursery, alpha, tmp_path):
    (node,) = await Nodes(nursery, database_dsn).start(1)
    async with await signed_in(node, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "linked")
    generation = await node.db.run(lambda conn: conn.fetchval(
        "SELECT active_generation FROM workspace_execution_states WHERE workspace_id = $1", alpha.workspace_id))
    send = Send(ActorContext(alpha.workspace_id, alpha.owner.member_id, "human", None, generation),
                MessageIntent(channel["id"], "over the link"))
    link = await _open_link(node)
    await link.send(_dumps((1, channel["id"], send)))
    request_id, ok, sent = _loads(await link.receive())
    assert (request_id, ok, sent.seq, sent.content) == (1, True, 1, "over the link")  # a command runs
    marker = tmp_path / "ran"
    await link.send(pickle_calling("os", "system", f"touch '{marker}'"))
    with pytest.raises(trio.BrokenResourceError), trio.fail_after(10):
        await link.receive()  # the node hung up
    assert not marker.exists()
