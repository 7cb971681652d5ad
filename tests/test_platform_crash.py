"""A platform broadcast across a kill -9 of the real server process (issue 15;
service-account.md §4.5, §9.4): the server is killed while one workspace's delivery
transaction is in flight (some deliveries committed, not all), restarted, and the
broadcast completes with exactly one message per targeted workspace and a gap-free
scope seq in every workspace's conversation.

The kill moment is made, not raced: the test holds one workspace's execution-state
row FOR UPDATE, so that workspace's delivery transaction (whose fence check takes it
FOR SHARE) waits in PostgreSQL while the other workspaces' deliveries commit."""

from __future__ import annotations

import signal

import trio

from client import connect
from domain.platform import client_message_id
from server.ops.platform import create_operator
from storage import tenancy
from storage.bridge import Database, PoolSettings
from tests.platform_helpers import PlatformFeed, broadcast, create_platform_account, wait_ready
from tests.test_platform_broadcast import lock_execution_state, unlock
from tests.test_outage import init_instance
from tests.test_serve import data_dir, start_serve  # noqa: F401  (data_dir is a fixture)

WORKSPACES = 30  # including the one `scopewire init` creates
LEASE = ("--platform-lease-seconds", "2")
NODE = ("--node-id", "the-node")  # the dead process's lease expires soon after the restart


async def add_workspaces(db: Database, count: int, password_hash: str) -> None:
    async def unit(conn, number: int):
        await tenancy.create_workspace(
            conn, instance_id=await tenancy.instance_id(conn), name=f"W{number}", slug=f"w-{number}", type="team",
            owner_email=f"owner-{number}@example.com", owner_display_name=f"Owner {number}",
            owner_password_hash=password_hash, single_edition=False)

    for number in range(count):
        await db.transaction(unit, number)


async def delivery_states(db: Database, broadcast_id: str) -> dict[str, str]:
    rows = await db.run(lambda c: c.fetch(
        "SELECT workspace_id, state FROM platform_service_account_broadcast_deliveries WHERE broadcast_id = $1",
        broadcast_id))
    return {r["workspace_id"]: r["state"] for r in rows}


async def test_a_broadcast_killed_mid_delivery_lands_exactly_once_everywhere_after_restart(  # noqa: F811
        data_dir, database_dsn, member_password_hash):
    # NODE: a stable node id, as a deployment on --database-url gives each node, so the
    # restarted server takes the dead one's scopes back at once (tests/test_cluster_processes.py
    # covers a takeover by another node after the lease runs out).
    args = ("--database-url", database_dsn)
    await init_instance("--data-dir", str(data_dir), *args, "--edition", "multi")
    async with Database(database_dsn, PoolSettings(min_size=1, max_size=4)) as db:
        await add_workspaces(db, WORKSPACES - 1, member_password_hash)
        workspaces = sorted(r["id"] for r in await db.run(lambda c: c.fetch("SELECT id FROM workspaces")))
        assert len(workspaces) == WORKSPACES
        operator_id, _, key = await create_operator(db, "ops")

        served = await start_serve(data_dir, *args, *NODE, *LEASE)
        async with connect(served.url) as conn:
            assert (await conn.call("auth", operator_key=key))["principal"] == "operator"
            await conn.call("platform.subscribe")
            ops = PlatformFeed(conn, operator_id, key)
            account = await create_platform_account(ops, "News")
            await wait_ready(ops, account["id"])
            # One broadcast before the kill, so the seq check spans the restart.
            earlier = await broadcast(ops, account["id"], "earlier")
            await ops.find("platform_service_account.broadcast_completed",
                           lambda d: d["broadcast"]["id"] == earlier["id"])

            blocked = workspaces[4]  # among the first leased, whatever the batch size
            killed = await _broadcast_and_kill_mid_delivery(db, ops, served, account["id"], blocked)

        served = await start_serve(data_dir, *args, *NODE, *LEASE)
        async with connect(served.url) as conn:
            await conn.call("auth", operator_key=key)
            await conn.call("platform.subscribe")
            ops = PlatformFeed(conn, operator_id, key)
            done = await ops.call("platform.broadcast.get", broadcast_id=killed["id"])
            if done["state"] != "completed":  # subscribed before reading: the event cannot slip between
                done = (await ops.find("platform_service_account.broadcast_completed",
                                       lambda d: d["broadcast"]["id"] == killed["id"]))["broadcast"]
        assert done["state"] == "completed", done
        assert done["targets"]["targets"] == done["targets"]["delivered"] == WORKSPACES, done

        await _landed_exactly_once(db, account["id"], workspaces, [earlier, killed])
        # The blocked delivery: the dead process's lease expired and the new node leased it again.
        blocked_row = await db.run(lambda c: c.fetchrow(
            "SELECT state, attempt, placement_epoch FROM platform_service_account_broadcast_deliveries "
            "WHERE broadcast_id = $1 AND workspace_id = $2", killed["id"], blocked))
        assert (blocked_row["state"], blocked_row["attempt"]) == ("delivered", 2), dict(blocked_row)
        served.process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            await served.process.wait()


async def _broadcast_and_kill_mid_delivery(db: Database, ops: PlatformFeed, served, account_id: str,
                                           blocked: str) -> dict:
    """Broadcast, and kill -9 the server once some deliveries committed and `blocked`'s waits in
    its transaction (its workspace held by the test); the broadcast's BroadcastInfo."""
    async with trio.open_nursery() as nursery:
        holder = await lock_execution_state(db, nursery, blocked)
        killed = await broadcast(ops, account_id, "killed")
        # The kill moment is read from the database: a bounded wait on the precondition (the
        # blocked delivery leased and waiting in its transaction, others committed), not on the
        # behaviour under test.
        with trio.fail_after(60):
            while True:
                states = await delivery_states(db, killed["id"])
                if states.get(blocked) == "leased" and "delivered" in states.values():
                    break
                await trio.sleep(0.02)
        served.process.send_signal(signal.SIGKILL)
        with trio.fail_after(60):
            assert await served.process.wait() == -signal.SIGKILL
        at_kill = await delivery_states(db, killed["id"])
        await unlock(db, holder)
    delivered_at_kill = sum(state == "delivered" for state in at_kill.values())
    assert 0 < delivered_at_kill < len(at_kill) and at_kill[blocked] == "leased", at_kill
    return killed


async def _landed_exactly_once(db: Database, account_id: str, workspaces: list[str], sent: list[dict]) -> None:
    """One message per workspace per broadcast, in seq order with no gap, every instance's cursor at the last."""
    for one in sent:
        rows = await db.run(lambda c: c.fetch(
                "SELECT workspace_id, count(*) AS n FROM scope_messages WHERE client_message_id = $1 GROUP BY 1",
            client_message_id(one["id"])))
        assert {r["workspace_id"]: r["n"] for r in rows} == {w: 1 for w in workspaces}
    rows = await db.run(lambda c: c.fetch(
        "SELECT m.workspace_id, array_agg(m.seq ORDER BY m.seq) AS seqs, "
        "array_agg(m.client_message_id ORDER BY m.seq) AS keys FROM scope_messages m "
        "JOIN service_accounts a ON a.message_scope_id = m.scope_id "
        "WHERE a.platform_service_account_id = $1 GROUP BY 1", account_id))
    expected = (list(range(1, len(sent) + 1)), [client_message_id(one["id"]) for one in sent])
    assert {r["workspace_id"]: (list(r["seqs"]), list(r["keys"])) for r in rows} == {w: expected for w in workspaces}
    instances = await db.run(lambda c: c.fetch(
        "SELECT workspace_id, last_applied_broadcast_seq FROM platform_service_account_workspace_instances "
        "WHERE platform_service_account_id = $1", account_id))
    assert {r["workspace_id"]: r["last_applied_broadcast_seq"] for r in instances} == {
        w: len(sent) for w in workspaces}


async def test_a_broadcast_whose_owner_is_killed_is_finished_by_another_node_exactly_once(
        tmp_path, database_dsn, member_password_hash):
    """Two nodes: the account's owner is killed mid-delivery and never comes back; the other node,
    whose operator saw the broadcast accepted, takes the account once the dead node's lease runs
    out and finishes the broadcast, once everywhere."""
    args = ("--database-url", database_dsn, "--session-key-file", str(tmp_path / "session-key.pem"),
            "--node-lease-seconds", "3", *LEASE)
    await init_instance("--data-dir", str(tmp_path / "init"), "--database-url", database_dsn, "--edition", "multi")
    async with Database(database_dsn, PoolSettings(min_size=1, max_size=4)) as db:
        await add_workspaces(db, WORKSPACES - 1, member_password_hash)
        workspaces = sorted(r["id"] for r in await db.run(lambda c: c.fetch("SELECT id FROM workspaces")))
        operator_id, _, key = await create_operator(db, "ops")
        owner = await start_serve(tmp_path / "node-a", *args, "--node-id", "node-a")
        survivor = await start_serve(tmp_path / "node-b", *args, "--node-id", "node-b")
        async with connect(owner.url) as on_owner, connect(survivor.url) as on_survivor:
            feeds = []
            for conn in (on_owner, on_survivor):
                await conn.call("auth", operator_key=key)
                await conn.call("platform.subscribe")
                feeds.append(PlatformFeed(conn, operator_id, key))
            ops, watching = feeds
            account = await create_platform_account(ops, "News")  # its creator, node-a, owns it
            await wait_ready(ops, account["id"])
            lease = await db.run(lambda c: c.fetchrow(
                "SELECT node_id, epoch FROM platform_account_leases WHERE platform_service_account_id = $1",
                account["id"]))
            assert (lease["node_id"], lease["epoch"]) == ("node-a", 1)
            killed = await _broadcast_and_kill_mid_delivery(db, ops, owner, account["id"], workspaces[4])
            with trio.fail_after(60):
                done = (await watching.find("platform_service_account.broadcast_completed",
                                            lambda d: d["broadcast"]["id"] == killed["id"]))["broadcast"]
        assert done["targets"]["targets"] == done["targets"]["delivered"] == WORKSPACES, done
        await _landed_exactly_once(db, account["id"], workspaces, [killed])
        # The blocked delivery ran in its workspace's scope actor, which may live on either node: on
        # the dead one its transaction died with it and the survivor leased it again (attempt 2); on
        # the survivor it committed once the test let go (attempt 1, its fence checked before expiry).
        blocked = await db.run(lambda c: c.fetchrow(
            "SELECT state, attempt FROM platform_service_account_broadcast_deliveries "
            "WHERE broadcast_id = $1 AND workspace_id = $2", killed["id"], workspaces[4]))
        assert blocked["state"] == "delivered" and blocked["attempt"] in (1, 2), dict(blocked)
        lease = await db.run(lambda c: c.fetchrow(
            "SELECT node_id, epoch FROM platform_account_leases WHERE platform_service_account_id = $1",
            account["id"]))
        assert (lease["node_id"], lease["epoch"]) == ("node-b", 2)
        survivor.process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            await survivor.process.wait()
