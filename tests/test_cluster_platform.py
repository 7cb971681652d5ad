"""Platform accounts with several nodes on one database: each account's
PlatformAccountActor runs on the one node holding its lease, any node serves
its operators (commands forwarded to the owner, events over the bus), a dead
owner's accounts move, and a stale owner's every transaction is fenced."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
import trio

from protocol import platform as p
from server.ops.platform import create_operator, publish_platform
from storage import leases
from storage import platform as platform_store
from storage import tenancy
from storage.errors import LeaseLost
from tests.conftest import App
from tests.platform_helpers import (broadcast, conversation_messages, create_platform_account, get_account, operator,
                                    wait_broadcast_done, wait_ready)
from tests.service_account_helpers import Feed
from tests.test_cluster_nodes import Nodes
from tests.test_tenancy import signed_in


@pytest.fixture
async def two_nodes(database_dsn, nursery, tenants) -> list[App]:
    return await Nodes(nursery, database_dsn).start(2)


async def _lease(app: App, account_id: str):
    return await app.db.run(lambda conn: conn.fetchrow(
        "SELECT node_id, epoch FROM platform_account_leases WHERE platform_service_account_id = $1", account_id))


async def _delivered_once_everywhere(app: App, tenants, account_id: str, contents: list[str]) -> None:
    for tenant in tenants:
        async with await signed_in(app, tenant.owner) as member:
            messages = await conversation_messages(member, tenant.workspace_id, account_id)
            assert [m["content"] for m in messages] == contents


async def _owner_first(apps: list[App], account_id: str) -> tuple[App, App]:
    """(owner, the other): whichever node claimed the account first (both hear of it)."""
    owner_id = (await _lease(apps[0], account_id))["node_id"]
    owner = next(app for app in apps if app.server.node_id == owner_id)
    return owner, next(app for app in apps if app is not owner)


async def test_an_account_runs_on_its_owner_and_any_node_serves_its_operators(two_nodes, tenants):
    async with operator(two_nodes[0], "creator") as creator:
        account = await create_platform_account(creator, "News")
        await wait_ready(creator, account["id"])
    first, second = await _owner_first(two_nodes, account["id"])
    assert first is two_nodes[0], "the node that created the account owns it"
    assert first.server.platform.active == 1 and second.server.platform.active == 0
    async with operator(second, "remote") as remote:
        # The other node forwards its operator's commands; the owner's events reach its subscription.
        sent = await broadcast(remote, account["id"], "b-1", content="from the other node")
        assert (await wait_broadcast_done(remote, sent["id"]))["state"] == "completed"
        updated = await remote.call("platform.account.update", platform_service_account_id=account["id"],
                                    expected_version=(await get_account(remote, account["id"]))["version"],
                                    name="Newsroom")
        assert updated["name"] == "Newsroom"
        await remote.wait("platform_service_account.updated", lambda d: d["name"] == "Newsroom")
    assert second.server.cluster.forwarded_out >= 2 and first.server.cluster.forwarded_in >= 2
    assert second.server.platform.active == 0
    await _delivered_once_everywhere(second, tenants, account["id"], ["from the other node"])


async def test_a_dead_owners_account_moves_and_its_stale_actor_commits_nothing(two_nodes, tenants):
    async with operator(two_nodes[0], "creator") as creator:
        account = await create_platform_account(creator, "News")
        await wait_ready(creator, account["id"])
    first, second = await _owner_first(two_nodes, account["id"])
    async with operator(first, "first") as on_first, operator(second, "second") as on_second:
        assert (await _lease(first, account["id"]))["epoch"] == 1
        # The owner stops heartbeating (its heartbeat is minutes away in this test): its node lease runs out.
        await first.db.run(lambda conn: conn.execute(
            "UPDATE cluster_nodes SET heartbeat_at = now() - interval '2 seconds', "
            "lease_expires_at = now() - interval '1 second' WHERE node_id = $1", first.server.node_id))

        # The other node takes the account at the next command for it, and runs the broadcast itself.
        sent = await broadcast(on_second, account["id"], "b-1", content="after the takeover")
        assert (await _lease(first, account["id"])) == (second.server.node_id, 2)
        assert (await wait_broadcast_done(on_second, sent["id"]))["state"] == "completed"

        # The former owner comes back to life: its actor still holds epoch 1, so its write is
        # refused and the command runs at the owner instead (forwarded), exactly once.
        await first.server.cluster.renew()
        version = (await get_account(on_first, account["id"]))["version"]
        forwarded_before = first.server.cluster.forwarded_out
        updated = await on_first.call("platform.account.update", platform_service_account_id=account["id"],
                                      expected_version=version, name="Newsroom")
        assert updated["version"] == version + 1
        assert first.server.cluster.forwarded_out == forwarded_before + 1
        assert first.server.platform.active == 0 and second.server.platform.active == 1
    await _delivered_once_everywhere(second, tenants, account["id"], ["after the takeover"])


async def test_a_dead_owners_account_is_claimed_by_the_periodic_pass_without_a_command(database_dsn, nursery,
                                                                                      tenants):
    nodes = Nodes(nursery, database_dsn)
    (first,) = await nodes.start(1)
    async with operator(first, "creator") as creator:
        account = await create_platform_account(creator, "News")
        await wait_ready(creator, account["id"])
    assert (await _lease(first, account["id"]))["node_id"] == first.server.node_id
    # Started once the first node owns the account (before, on a busy machine, its periodic
    # pass could claim the new account first).  It runs every third of its node lease: each
    # second here.
    first, second = await nodes.start(1, node_lease_seconds=3.0)
    await first.db.run(lambda conn: conn.execute(
        "UPDATE cluster_nodes SET heartbeat_at = now() - interval '2 seconds', "
        "lease_expires_at = now() - interval '1 second' WHERE node_id = $1", first.server.node_id))
    with trio.fail_after(10):
        while await _lease(second, account["id"]) != (second.server.node_id, 2):
            await trio.sleep(0.1)
    assert second.server.platform.active == 1


async def test_the_platform_fence_refuses_a_former_owner(db, tenants):
    operator_id, _, _ = await create_operator(db, "ops")
    account = await db.transaction(platform_store.create_account, name="Fenced", description="",
                                   operator_id=operator_id, correlation_id="req_test")
    kind = leases.PLATFORM_ACCOUNTS

    async def fenced(conn, node_id: str, epoch: int) -> None:
        await leases.pass_fence(conn, account["id"], node_id, epoch, kind=kind)

    async def expire(conn, node_id: str) -> None:
        await conn.execute("UPDATE cluster_nodes SET heartbeat_at = now() - interval '2 seconds', "
                           "lease_expires_at = now() - interval '1 second' WHERE node_id = $1", node_id)

    for node_id in ("old", "new"):
        await db.run(leases.register_node, node_id, f"{node_id}:1", 60)
    assert await db.transaction(leases.acquire, account["id"], "old", kind=kind) == leases.Ownership("old", 1, "")
    assert await db.transaction(leases.acquire, account["id"], "new", kind=kind) == leases.Ownership("old", 1, "old:1")
    await db.transaction(fenced, "old", 1)
    await db.run(expire, "old")
    assert await db.transaction(leases.acquire, account["id"], "new", kind=kind) == leases.Ownership("new", 2, "")
    for node_id, epoch in (("old", 1), ("new", 1)):
        with pytest.raises(LeaseLost):
            await db.transaction(fenced, node_id, epoch)
    await db.transaction(fenced, "new", 2)
    # The lease goes with its account.
    await db.transaction(platform_store.delete_account, account["id"], account["version"], operator_id, "req_test")
    assert await db.run(lambda conn: conn.fetchval("SELECT count(*) FROM platform_account_leases")) == 0


async def test_a_delete_waits_for_the_actors_fenced_transactions_without_a_deadlock(database_dsn: str, tenants):
    """The actor's transactions pass the fence (the lease row, shared) and then lock the account's
    root; the delete (whose cascade takes the lease row) must not hold the root while it waits for
    them.  On asyncpg connections of their own (`tenants`: an initialised instance)."""
    await trio.to_thread.run_sync(asyncio.run, _delete_beside_a_fenced_step(database_dsn))


async def _delete_beside_a_fenced_step(dsn: str) -> None:
    admin, step, deleting = [await asyncpg.connect(dsn) for _ in range(3)]
    try:
        operator_id, _ = await platform_store.create_operator(admin, "ops", bytes(32))
        async with admin.transaction():
            account = await platform_store.create_account(admin, name="Busy", description="",
                                                          operator_id=operator_id, correlation_id="req_test")
        await leases.register_node(admin, "owner", "127.0.0.1:1", 60)
        kind = leases.PLATFORM_ACCOUNTS
        assert (await leases.acquire(admin, account["id"], "owner", kind=kind)).epoch == 1

        # An advance step of the actor has passed the fence ...
        stepping = step.transaction()
        await stepping.start()
        await leases.pass_fence(step, account["id"], "owner", 1, kind=kind)
        # ... when the delete command's transaction starts (it passes the fence too) ...
        delete = asyncio.ensure_future(_fenced_delete(deleting, account, operator_id))
        while not await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"):
            await asyncio.sleep(0.02)  # the delete is waiting for a lock (a precondition, not the property)
        # ... and the step goes on to lock the root: it must get it, and both commit.
        await step.fetchrow("SELECT id FROM platform_service_accounts WHERE id = $1 FOR NO KEY UPDATE",
                            account["id"])
        await stepping.commit()
        root, _ = await asyncio.wait_for(delete, 30)
        assert root["id"] == account["id"]
        assert not await admin.fetchval("SELECT count(*) FROM platform_account_leases")
    finally:
        for conn in (admin, step, deleting):
            await conn.close()


async def _fenced_delete(conn: asyncpg.Connection, account, operator_id: str):
    async with conn.transaction():
        await leases.pass_fence(conn, account["id"], "owner", 1, kind=leases.PLATFORM_ACCOUNTS)
        return await platform_store.delete_account(conn, account["id"], account["version"], operator_id, "req_test")


async def test_a_clean_shutdown_of_the_owner_mid_broadcast_hands_the_account_over_with_no_failed_attempt(
        database_dsn, nursery, tenants):
    """The owner's shutdown drains its platform actors before its scope actors: deliveries in
    flight finish at the first attempt, none is dispatched into a draining scope registry (where it
    would be refused and retried later), and the account moves to the other node at once."""
    nodes = Nodes(nursery, database_dsn)
    first, second = await nodes.start(2)

    async def more_workspaces(conn) -> None:
        instance = await tenancy.instance_id(conn)
        for index in range(10):
            await tenancy.create_workspace(conn, instance_id=instance, name=f"W{index}", slug=f"w{index}",
                                           type="team", owner_email=f"owner-w{index}@example.com",
                                           owner_display_name=f"Owner {index}", owner_password_hash=None,
                                           single_edition=False)
    await first.db.transaction(more_workspaces)
    alpha = tenants[0]  # the oldest workspace: among the first delivered (leases go in workspace-id order)
    async with operator(first, "creator") as creator, operator(second, "second") as on_second, \
            await signed_in(first, alpha.owner) as member:
        account = await create_platform_account(creator, "News")
        await wait_ready(creator, account["id"])
        assert (await _lease(first, account["id"]))["node_id"] == first.server.node_id
        feed = await Feed.open(member, {"workspace_id": alpha.workspace_id})
        sent = await broadcast(creator, account["id"], "b-1", content="through a shutdown")
        await feed.wait("message.created", lambda data: data["content"] == "through a shutdown")
        nodes.stops[0].cancel()  # the owner shuts down with the broadcast's deliveries under way
        with trio.fail_after(20):
            assert (await wait_broadcast_done(on_second, sent["id"]))["state"] == "completed"
    rows = await second.db.run(lambda conn: conn.fetch(
        "SELECT state, attempt, last_error FROM platform_service_account_broadcast_deliveries "
        "WHERE broadcast_id = $1", sent["id"]))
    assert len(rows) == 12
    assert [(r["state"], r["attempt"], r["last_error"]) for r in rows] == [("delivered", 1, None)] * 12
    # The other node claims the account as soon as the owner's shutdown frees it (a NOTIFY), not at
    # its periodic pass (every 200 s here).  No event tells of a claim: the lease row is read until it
    # moves, bounded well below that pass.
    with trio.fail_after(10):
        while tuple(await _lease(second, account["id"])) != (second.server.node_id, 2):
            await trio.sleep(0.05)


async def test_a_clean_shutdown_sends_the_other_nodes_what_the_node_published_before_it_stopped(
        database_dsn, nursery, tenants):
    """A broadcast the owner's drain finishes is told to the other nodes' operators only by the
    bus (no later publication shows them a gap to replay from): the shutdown waits until the bus
    has sent it, however slow the bus."""
    nodes = Nodes(nursery, database_dsn)
    # The shutdown's grace bounds how long it waits for the bus: well beyond the slow bus below.
    first, second = await nodes.start(2, shutdown_grace_seconds=10.0)
    cluster = first.server.cluster
    # As the node's heartbeat finds it: another node is live, so publications go on the bus.
    cluster.peers_live = await first.db.run(leases.other_live_nodes, cluster.node_id) > 0
    assert cluster.peers_live
    send = cluster.transport.send

    async def slow_send(*args):
        await trio.sleep(2)  # a slow bus: far longer than the rest of this node's shutdown
        await send(*args)

    cluster.transport.send = slow_send
    async with operator(second, "watcher") as watcher:
        publish_platform(first.server, "platform_service_account.updated", p.PlatformAccountChanged(
            platform_service_account_id="psa_published_at_shutdown", version=7, name="Last words"))
        nodes.stops[0].cancel()
        with trio.fail_after(20):
            data = await watcher.find("platform_service_account.updated",
                                      lambda d: d["platform_service_account_id"] == "psa_published_at_shutdown")
    assert data["name"] == "Last words"


async def test_an_operator_is_told_when_another_nodes_platform_events_may_have_been_lost(two_nodes):
    """Platform events are not in the log, so nothing replays one lost on the bus: the operator
    is told (`events.missed`) and re-reads the broadcasts and accounts it shows."""
    first, second = two_nodes
    cluster = first.server.cluster
    cluster.peers_live = await first.db.run(leases.other_live_nodes, cluster.node_id) > 0
    assert cluster.peers_live

    def changed(name: str) -> None:
        publish_platform(first.server, "platform_service_account.updated", p.PlatformAccountChanged(
            platform_service_account_id="psa_on_the_first_node", version=1, name=name))

    async with operator(second, "watcher") as watcher:
        changed("before")
        await watcher.next_index("platform_service_account.updated", lambda d: d["name"] == "before")
        # A publication that never reaches the bus (its number is skipped, as when a send fails).
        relay, first.server.hub.relay = first.server.hub.relay, None
        changed("lost")
        first.server.hub.relay = relay
        cluster._bus_seq += 1
        changed("after the gap")  # the next one shows the gap
        missed = await watcher.next_index("events.missed")
        after = await watcher.next_index("platform_service_account.updated", lambda d: d["name"] == "after the gap")
        await watcher.drain()
    assert watcher.seen[missed]["data"] == {"reason": "cluster_bus"} and watcher.seen[missed]["workspace_id"] == ""
    assert [e["data"]["name"] for e in watcher.seen if e["event"] == "platform_service_account.updated"] == [
        "before", "after the gap"]
    assert [e["event"] for e in watcher.seen].count("events.missed") == 1 and missed < after
    assert second.server.cluster.bus_resyncs == 1
