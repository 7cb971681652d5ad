"""Several nodes (servers with their own pools) in one process on one database:
scope ownership, forwarding, fencing and cross-node fanout.  Crashes and freezes
of real processes are in tests/test_cluster_processes.py."""

from __future__ import annotations

import base64

import msgspec
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol import guide
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from storage.bridge import Database
from tests.conftest import App, add_person
from tests.test_bus import nats_server  # noqa: F401  (a fixture)
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


async def _lease(app: App, scope_id: str):
    return await app.db.run(lambda conn: conn.fetchrow("SELECT node_id, epoch FROM scope_leases WHERE scope_id = $1",
                                                       scope_id))


async def test_a_send_through_any_node_reaches_subscribers_on_every_node(nodes, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    first, second, third = nodes
    bob = await add_person(first.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner, await signed_in(second, bob) as listener, \
            await signed_in(third, alpha.owner) as other_sender, await signed_in(third, bob) as feed:
        channel = await open_channel(owner, alpha.workspace_id, "live", [bob.member_id])
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        await feed.call("subscribe", workspace_feed=True, **ws)
        for i in range(5):
            await owner.call("message.send", scope_id=channel["id"], content=f"a{i}", **ws)
            await other_sender.call("message.send", scope_id=channel["id"], content=f"c{i}", **ws)
        received = await events_for(listener, 10)
        assert [e["seq"] for e in received] == list(range(1, 11))
        assert [e["data"]["content"] for e in received] == [f"{s}{i}" for i in range(5) for s in "ac"]
        assert [e["seq"] for e in await events_for(feed, 10)] == list(range(1, 11))
        await other_sender.call("reaction.add", message_id=received[0]["data"]["id"], key="👍", **ws)
        reactions = await events_for(listener, 1, "reaction.added")
        assert reactions[0]["data"]["message_id"] == received[0]["data"]["id"]
        # Big enough to travel through the bus's spill table.
        await owner.call("message.edit", message_id=received[0]["data"]["id"], content="x" * 20_000,
                         expected_revision=1, **ws)
        edited = await events_for(listener, 1, "message.edited")
        assert edited[0]["data"]["content"] == "x" * 20_000
    assert (await _lease(first, channel["id"]))["node_id"] == "node-0"
    assert third.server.cluster.forwarded_out >= 5 and first.server.cluster.forwarded_in >= 5
    assert second.server.cluster.bus_received > 0 and second.server.cluster.bus_resyncs == 0


async def test_forwarded_commands_answer_as_the_owner_would(nodes, tenants, member_password_hash):
    alpha, _ = tenants
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


async def test_a_private_agent_on_another_node_gets_only_what_it_may_read(nodes, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    first, second, third = nodes
    bob = await add_person(first.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner, await signed_in(third, bob) as b:
        agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "project", [bob.member_id, agent["id"]])
        key = (await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws))["key"]
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
    assert [(e["event"], e["data"].get("content")) for e in received] == [("message.created", "from the owner")]


async def test_a_lost_bus_message_loses_no_message(nodes, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    first, second, _ = nodes
    bob = await add_person(first.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner, await signed_in(second, bob) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "lossy", [bob.member_id])
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        await owner.call("message.send", scope_id=channel["id"], content="one", **ws)
        assert [e["seq"] for e in await events_for(listener, 1)] == [1]
        # A publication that never reaches the bus (its number is skipped, as when a send fails).
        relay, first.server.hub.relay = first.server.hub.relay, None
        await owner.call("message.send", scope_id=channel["id"], content="two", **ws)
        first.server.hub.relay = relay
        first.server.cluster._bus_seq += 1
        await owner.call("message.send", scope_id=channel["id"], content="three", **ws)
        received = await events_for(listener, 2)
    assert [(e["seq"], e["data"]["content"]) for e in received] == [(2, "two"), (3, "three")]
    assert second.server.cluster.bus_resyncs == 1


async def test_a_stale_owner_commits_nothing_and_its_commands_run_at_the_new_owner(nodes, tenants):
    alpha, _ = tenants
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


async def test_a_clean_shutdown_hands_the_scopes_over_at_once(database_dsn, nursery, tenants):
    alpha, _ = tenants
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


async def test_a_client_resumes_against_another_node(nodes, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    first, second, third = nodes
    bob = await add_person(first.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "resume", [bob.member_id])
        async with await signed_in(second, bob) as listener:
            await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
            for i in range(3):
                await owner.call("message.send", scope_id=channel["id"], content=f"m{i}", **ws)
            cursor = (await events_for(listener, 3))[-1]["seq"]
        for i in range(3, 6):  # while bob is away
            await owner.call("message.send", scope_id=channel["id"], content=f"m{i}", **ws)
        async with await signed_in(third, bob) as listener:
            await listener.call("subscribe", scopes=[{"scope_id": channel["id"], "after_seq": cursor}], **ws)
            await owner.call("message.send", scope_id=channel["id"], content="m6", **ws)
            received = await events_for(listener, 4)
    assert [(e["seq"], e["data"]["content"]) for e in received] == [(i + 1, f"m{i}") for i in range(3, 7)]


def test_the_contract_states_the_default_node_lease():
    assert "default 10 s" in guide.NODES and ServerConfig().node_lease_seconds == 10


async def test_nodes_on_the_nats_bus_fan_out_like_on_postgres(database_dsn, nursery, tenants, nats_server,
                                                             member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    first, second = await Nodes(nursery, database_dsn).start(2, bus="nats", nats_url=nats_server.url)
    bob = await add_person(first.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner, await signed_in(second, bob) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "nats", [bob.member_id])
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        for i in range(3):
            await owner.call("message.send", scope_id=channel["id"], content=f"n{i}", **ws)
        received = await events_for(listener, 3)
    assert [(e["seq"], e["data"]["content"]) for e in received] == [(1, "n0"), (2, "n1"), (3, "n2")]
    assert second.server.cluster.transport.name == "nats" and second.server.cluster.bus_received >= 3


async def test_a_routed_delivery_reaches_the_agent_daemon_on_another_node_at_once(nodes, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    first, second, _ = nodes
    async with await signed_in(first, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "work", [agent["id"]])
        key = (await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws))["key"]
        async with as_agent(second, key) as scout:
            await scout.call("delivery.subscribe", **ws)
            sent = await owner.call("message.send", scope_id=channel["id"], content="@scout look", **ws)
            with trio.fail_after(20):
                while (event := await scout.next_event())["event"] != "delivery":
                    pass
            await scout.call("delivery.ack", delivery_seqs=[event["data"]["delivery_seq"]], **ws)
    assert (event["data"]["message_id"], event["data"]["reason"]) == (sent["id"], "mention")


async def test_foreign_bus_messages_are_ignored(nodes, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    first, second, _ = nodes
    bob = await add_person(first.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(first, alpha.owner) as owner, await signed_in(second, bob) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "after", [bob.member_id])
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        # Anyone who may NOTIFY on the database can put bytes on the bus: an unsealed event for
        # everyone following the channel is dropped, and a sealed one that does not decode costs
        # a resync, never the node.
        frame = msgspec.msgpack.encode({"type": "event", "event": "message.created", "workspace_id": alpha.workspace_id,
                                        "scope_id": channel["id"], "data": {"content": "forged"}})
        forged = base64.b64encode(msgspec.msgpack.encode(
            [[1, "message.edited", alpha.workspace_id, channel["id"], None, None, frame, None, False, None]])).decode()
        sealed_garbage = base64.b64encode(second.server.cluster._seal(b"\xc1not msgpack")).decode()
        await first.db.run(lambda conn: conn.execute(
            "SELECT pg_notify('scopewire_bus', 'intruder.1:1:' || $1), "
            "pg_notify('scopewire_bus', 'intruder.1:2:' || $2)", forged, sealed_garbage))
        await owner.call("message.send", scope_id=channel["id"], content="real", **ws)
        with trio.fail_after(20):
            first_event = await listener.next_event()
    assert (first_event["event"], first_event["data"]["content"]) == ("message.created", "real")


async def test_a_lone_node_publishes_nothing_on_the_bus(database_dsn, nursery, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    (alone,) = await Nodes(nursery, database_dsn).start(1)
    async with await signed_in(alone, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "alone")
        await owner.call("message.send", scope_id=channel["id"], content="nobody else", **ws)
    assert not alone.server.cluster.peers_live and alone.server.cluster.bus_sent == 0
