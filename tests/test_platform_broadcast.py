"""Platform broadcasts end to end (issue 15 item 4; service-account.md §4.5, §9.3,
§9.4) over the WebSocket against PostgreSQL: acceptance is durable, immediate and
idempotent per (account, operator, client id); a moderation keyword blocks with a
log entry and nothing else; a broadcast reaches every workspace exactly once as an
ordinary message of the local instance's conversation; it waits for provisioning
to reach the generation it captured, and a workspace created after acceptance is
settled `generation_excluded` and reached by the next broadcast; per workspace the
messages follow broadcast-seq order; the delivery transaction refuses a stale lease
or placement and writes nothing; operators retry and settle-skip; and a state
machine over (create workspace, accept, let delivery run) checks who got what.

Holding provisioning back without sleeps (`hold_provisioning`): the audience reconciler
takes accounts in workspace-id order, one at a time; a human joining the oldest workspace
while the test holds that workspace's execution-state row makes it wait there, so no newer
instance's first audience pass runs and the account's applied generation stays put until
the test lets go.  Waiting is on events or on the protocol's status, never on time."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import trio
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from actors.platform_delivery import PlatformDelivery
from actors.scope_actor import Refused
from client import connect
from domain.plan import ActorContext
from domain.platform import BroadcastSnapshot, client_message_id
from domain.service_accounts import POST_MESSAGE_TYPE
from server import tenancy as tenancy_ops
from server.config import ServerConfig
from server.ops.platform import create_operator
from storage import tenancy
from storage import platform as store
from storage.bridge import Database
from storage.errors import DatabaseUnavailable
from storage.ids import new_id
from tests.conftest import MEMBER_PASSWORD, App, Person, Tenant, add_person
from tests.platform_helpers import (
    ACCOUNT_EVENTS,
    PlatformFeed,
    broadcast,
    create_platform_account,
    instances,
    local_account,
    operator,
    wait_broadcast_done,
    wait_ready,
)
from tests.server_thread import ServerThread
from tests.service_account_helpers import Feed
from tests.test_tenancy import expect_error, signed_in

MODERATION_KEYWORD = "forbidden-phrase"
MAX_ATTEMPTS = 2


@pytest.fixture
def server_config() -> ServerConfig:
    # Retry backoff is measured in database time (next_attempt_at), so a trio MockClock cannot skip it:
    # with two attempts a stuck delivery reaches operator_attention after one ~1 s backoff.
    return ServerConfig(port=0, auth_timeout_seconds=2.0, expiry_sweep_seconds=0.5, shutdown_grace_seconds=2.0,
                        moderation_keywords=(MODERATION_KEYWORD,), platform_max_attempts=MAX_ATTEMPTS)


# --- helpers -----------------------------------------------------------------------------------

_workspace_numbers = itertools.count(1)


async def new_workspace(db: Database, password_hash: str) -> Tenant:
    """A workspace with its owner, committed (advancing the provisioning generation)."""
    number = next(_workspace_numbers)
    email = f"owner-w{number}@example.com"

    async def unit(conn):
        return await tenancy.create_workspace(
            conn, instance_id=await tenancy.instance_id(conn), name=f"W{number}", slug=f"w-{number}", type="team",
            owner_email=email, owner_display_name=f"Owner {number}", owner_password_hash=password_hash,
            single_edition=False)

    created = await db.transaction(unit)
    return Tenant(created.workspace_id, Person(email, MEMBER_PASSWORD, created.account_id, created.member_id))


async def fence(db: Database, workspace_id: str) -> None:
    await db.transaction(tenancy.fence_workspace, workspace_id, write_fenced=True, new_generation=False)


async def unfence(db: Database, workspace_id: str) -> None:
    await db.transaction(tenancy.fence_workspace, workspace_id, write_fenced=False, new_generation=False)


async def lock_execution_state(db: Database, nursery: trio.Nursery, workspace_id: str) -> int:
    """Lock the workspace's execution-state row FOR UPDATE in a transaction of its own until
    `unlock` (or 120 s): every scope-actor batch there waits in its fence check (FOR SHARE).
    Returns once the lock is held, with the holding backend's pid."""
    token, locked, holder = trio.lowlevel.current_trio_token(), trio.Event(), {}

    def held(pid: int) -> None:
        holder["pid"] = pid
        locked.set()

    async def hold(conn):
        await conn.execute("SELECT 1 FROM workspace_execution_states WHERE workspace_id = $1 FOR UPDATE", workspace_id)
        trio.from_thread.run_sync(held, await conn.fetchval("SELECT pg_backend_pid()"), trio_token=token)
        await conn.execute("SELECT pg_sleep(120)")

    async def run() -> None:
        with contextlib.suppress(DatabaseUnavailable):  # `unlock` terminates it: that is how it ends
            await db.transaction(hold)

    nursery.start_soon(run)
    await locked.wait()
    return holder["pid"]


async def unlock(db: Database, pid: int) -> None:
    await db.run(lambda c: c.execute("SELECT pg_terminate_backend($1)", pid))


async def hold_provisioning(db: Database, nursery: trio.Nursery, oldest_workspace_id: str,
                            password_hash: str) -> int:
    """Hold back the readiness of every platform instance opened from now on, until `unlock`.
    The audience reconciler takes the accounts behind their policy in workspace-id order, one at a
    time: a human joining the oldest workspace puts its accounts behind, and with that workspace's
    execution state locked their reconcile waits in its fence check, so nothing newer (a new
    instance's first audience pass) gets its turn.  Instance opening itself is not held."""
    pid = await lock_execution_state(db, nursery, oldest_workspace_id)
    await add_person(db, oldest_workspace_id, f"hold-{next(_workspace_numbers)}@example.com", "viewer",
                     password_hash)
    return pid


async def workspace_ids(db: Database) -> set[str]:
    return {r["id"] for r in await db.run(lambda c: c.fetch("SELECT id FROM workspaces"))}


async def copies(db: Database, broadcast_id: str) -> dict[str, int]:
    """workspace id -> how many messages carry the broadcast's deterministic client id there."""
    rows = await db.run(lambda c: c.fetch(
        "SELECT workspace_id, count(*) AS n FROM scope_messages WHERE client_message_id = $1 GROUP BY 1",
        client_message_id(broadcast_id)))
    return {r["workspace_id"]: r["n"] for r in rows}


async def received(db: Database, account_id: str) -> dict[str, list[str]]:
    """workspace id -> the broadcast ids in the account's local conversation there, in scope-seq order."""
    rows = await db.run(lambda c: c.fetch(
        "SELECT m.workspace_id, m.client_message_id FROM scope_messages m "
        "JOIN service_accounts a ON a.message_scope_id = m.scope_id "
        "WHERE a.platform_service_account_id = $1 ORDER BY m.workspace_id, m.seq", account_id))
    found: dict[str, list[str]] = {}
    prefix = client_message_id("")
    for row in rows:
        assert row["client_message_id"].startswith(prefix), row
        found.setdefault(row["workspace_id"], []).append(row["client_message_id"][len(prefix):])
    return found


async def counts(db: Database, sql: str, *args) -> int:
    return await db.run(lambda c: c.fetchval(sql, *args))


async def get_broadcast(ops: PlatformFeed, broadcast_id: str) -> dict:
    return await ops.call("platform.broadcast.get", broadcast_id=broadcast_id)


async def deliveries(ops: PlatformFeed, broadcast_id: str, state: str | None = None) -> list[dict]:
    found, cursor = [], None
    while True:
        page = await ops.call("platform.broadcast.deliveries", broadcast_id=broadcast_id, limit=200,
                              **({"state": state} if state else {}), **({"cursor": cursor} if cursor else {}))
        found.extend(page["deliveries"])
        cursor = page.get("next_cursor")
        if not cursor:
            return found


async def delivery_changed(ops: PlatformFeed, broadcast_id: str, workspace_id: str, state: str) -> dict:
    data = await ops.wait("platform_service_account.broadcast_delivery_changed",
                          lambda d: d["delivery"]["broadcast_id"] == broadcast_id
                          and d["delivery"]["workspace_id"] == workspace_id and d["delivery"]["state"] == state)
    return data["delivery"]


async def ready_account(ops: PlatformFeed, name: str) -> dict:
    account = await create_platform_account(ops, name)
    return await wait_ready(ops, account["id"])


# --- acceptance -----------------------------------------------------------------------------------

async def test_accept_answers_at_once_and_is_idempotent_per_operator(app: App, tenants):
    async with operator(app, "ops") as ops, operator(app, "other-ops") as other:
        account = await ready_account(ops, "News")
        first = await broadcast(ops, account["id"], "b-1", "Title", "Body")
        assert first["state"] in ("waiting_provisioning", "accepted", "dispatching", "completed"), first
        assert not first.get("replayed") and first["operator_id"] == ops.operator_id
        assert first["client_broadcast_id"] == "b-1" and first["acceptance_ordinal"] >= 1

        again = await broadcast(ops, account["id"], "b-1", "Title", "Body")
        assert (again["id"], again["replayed"], again["payload_digest"]) == (
            first["id"], True, first["payload_digest"])
        await expect_error("idempotency_conflict", broadcast(ops, account["id"], "b-1", "Title", "Other body"))
        await expect_error("idempotency_conflict", broadcast(ops, account["id"], "b-1", "Other title", "Body"))

        # Another operator's key space is its own: the same client id is another broadcast.
        theirs = await broadcast(other, account["id"], "b-1", "Title", "Body")
        assert theirs["id"] != first["id"] and not theirs.get("replayed")
        assert theirs["operator_id"] == other.operator_id
        assert theirs["acceptance_ordinal"] > first["acceptance_ordinal"]

        for sent in (first, theirs):
            done = await wait_broadcast_done(ops, sent["id"])
            assert done["state"] == "completed", done
            assert await copies(app.db, sent["id"]) == {t.workspace_id: 1 for t in tenants}
        # A replay after completion answers the completed broadcast, still without a second copy.
        late = await broadcast(ops, account["id"], "b-1", "Title", "Body")
        assert (late["id"], late["replayed"], late["state"]) == (first["id"], True, "completed")
        assert late["broadcast_seq"] == (await get_broadcast(ops, first["id"]))["broadcast_seq"]
    assert await counts(app.db, "SELECT count(*) FROM platform_service_account_broadcasts") == 2
    assert await copies(app.db, first["id"]) == {t.workspace_id: 1 for t in tenants}


async def test_a_moderation_keyword_blocks_with_a_log_entry_and_nothing_else(app: App, tenants):
    async def snapshot() -> tuple[int, ...]:
        return tuple([await counts(app.db, f"SELECT count(*) FROM {table}") for table in (
            "platform_service_account_broadcasts", "platform_service_account_broadcast_deliveries",
            "scope_messages", "scope_fanout_outbox")])

    async with operator(app) as ops:
        account = await ready_account(ops, "News")
        before = await snapshot()
        # Case-insensitive, in the content or the title.
        await expect_error("content_blocked", broadcast(
            ops, account["id"], "bad-1", "Weekly", f"please read: {MODERATION_KEYWORD.upper()} now"))
        await expect_error("content_blocked", broadcast(ops, account["id"], "bad-2", f"A {MODERATION_KEYWORD.title()}",
                                                        "clean body"))
        assert await snapshot() == before
        logs = await app.db.run(lambda c: c.fetch(
            "SELECT platform_service_account_id, operator_id, client_broadcast_id, title, content, matched_keywords "
            "FROM platform_moderation_logs ORDER BY created_at"))
        assert [(r["platform_service_account_id"], r["operator_id"], r["client_broadcast_id"]) for r in logs] == [
            (account["id"], ops.operator_id, "bad-1"), (account["id"], ops.operator_id, "bad-2")]
        assert logs[0]["content"] == f"please read: {MODERATION_KEYWORD.upper()} now"
        assert all(MODERATION_KEYWORD in [k.lower() for k in r["matched_keywords"]] for r in logs), logs

        # A clean broadcast with the refused client id goes through (a refusal is no acceptance).
        sent = await broadcast(ops, account["id"], "bad-1", "Weekly", "all clear")
        assert not sent.get("replayed")
        assert (await wait_broadcast_done(ops, sent["id"]))["state"] == "completed"


# --- delivery -------------------------------------------------------------------------------------

async def test_a_broadcast_reaches_every_workspace_once_as_an_ordinary_message(app: App, tenants,
                                                                             member_password_hash):
    more = [await new_workspace(app.db, member_password_hash) for _ in range(3)]
    everyone = [*tenants, *more]
    async with operator(app) as ops:
        account = await ready_account(ops, "News")
        assert account["provisioning"]["instances"] == len(everyone)
        by_workspace = {i["workspace_id"]: i for i in await instances(ops, account["id"])}
        assert set(by_workspace) == {t.workspace_id for t in everyone}

        # Every workspace's owner follows the local conversation before the broadcast.
        async with trio.open_nursery() as nursery:
            live: dict[str, dict] = {}

            async def follow(tenant: Tenant, subscribed: trio.Event) -> None:
                ws = {"workspace_id": tenant.workspace_id}
                async with connect(app.url) as conn:
                    await conn.login(tenant.owner.email, tenant.owner.password)
                    scope_id = by_workspace[tenant.workspace_id]["scope_id"]
                    await conn.call("subscribe", scopes=[{"scope_id": scope_id}], **ws)
                    subscribed.set()
                    with trio.fail_after(60):
                        while True:
                            event = await conn.next_event()
                            if event["event"] == "message.created" and event["data"]["scope_id"] == scope_id:
                                live[tenant.workspace_id] = event["data"]
                                break
                    history = await conn.call("message.history", scope_id=scope_id, **ws)
                    live[tenant.workspace_id + ":history"] = history["messages"]

            for tenant in everyone:
                subscribed = trio.Event()
                nursery.start_soon(follow, tenant, subscribed)
                await subscribed.wait()
            sent = await broadcast(ops, account["id"], "hello", "Hello", "**Hello** everyone")
            done = await wait_broadcast_done(ops, sent["id"])

        assert done["state"] == "completed" and done["broadcast_seq"] == 1
        assert done["targets"] == {"targets": len(everyone), "delivered": len(everyone), "skipped": 0, "pending": 0,
                                   "exceptions": 0, "generation_excluded": 0}
        assert (await get_broadcast(ops, sent["id"]))["targets"] == done["targets"]
        rows = await deliveries(ops, sent["id"])
        assert sorted(r["workspace_id"] for r in rows) == sorted(t.workspace_id for t in everyone)
        assert all((r["state"], r["outcome"], r["recipient_eligible"], r["broadcast_seq"]) == (
            "delivered", "delivered", True, 1) for r in rows), rows
        assert await deliveries(ops, sent["id"], "queued") == []

        message_ids = set()
        for tenant in everyone:
            workspace_id = tenant.workspace_id
            message, history = live[workspace_id], live[workspace_id + ":history"]
            delivery = next(r for r in rows if r["workspace_id"] == workspace_id)
            instance = by_workspace[workspace_id]
            assert [m["id"] for m in history] == [message["id"]] == [delivery["local_message_id"]]
            assert delivery["local_service_account_id"] == instance["local_service_account_id"]
            assert (message["seq"], message["client_message_id"], message["content"], message["author_type"],
                    message["message_type"]) == (1, f"platform-broadcast:{sent['id']}", "**Hello** everyone",
                                                 "service", "service_account_post")
            profile = history[0]["author_profile"]
            assert (profile["service_account_id"], profile["principal_id"], profile["member_id"],
                    profile["display_name"]) == (instance["local_service_account_id"], account["id"],
                                                 message["author_member_id"], "News")
            message_ids.add(message["id"])
        assert len(message_ids) == len(everyone)  # each workspace its own message
        assert await copies(app.db, sent["id"]) == {t.workspace_id: 1 for t in everyone}
        # The instance records the applied seq.
        assert {i["workspace_id"]: i["last_applied_broadcast_seq"] for i in await instances(ops, account["id"])} == {
            t.workspace_id: 1 for t in everyone}


async def test_a_broadcast_waits_for_provisioning_then_gets_its_seq(app: App, tenants, nursery,
                                                                   member_password_hash):
    alpha, beta = tenants
    async with operator(app) as ops:
        account = await ready_account(ops, "News")
        first = await broadcast(ops, account["id"], "before")
        await wait_broadcast_done(ops, first["id"])

        holder = await hold_provisioning(app.db, nursery, alpha.workspace_id, member_password_hash)
        late = await new_workspace(app.db, member_password_hash)
        # Its instance opens, but cannot become ready while provisioning is held.
        await ops.wait("platform_service_account.instance_changed",
                       lambda d: d["workspace_id"] == late.workspace_id and d["provisioning_state"] == "identity_ready")
        waiting = await broadcast(ops, account["id"], "while-provisioning")
        # A later acceptance queues behind it (and is answered after the actor's next step).
        behind = await broadcast(ops, account["id"], "behind")
        for sent in (waiting, behind):
            assert sent["state"] == "waiting_provisioning" and "broadcast_seq" not in sent, sent
            assert sent["required_provisioning_generation"] > account["provisioning"]["applied_provisioning_generation"]
        now = await get_broadcast(ops, waiting["id"])
        assert now["state"] == "waiting_provisioning" and "broadcast_seq" not in now, now
        provisioning = (await ops.call("platform.account.get", platform_service_account_id=account["id"]))[
            "provisioning"]
        assert provisioning["state"] == "provisioning", provisioning
        assert provisioning["applied_provisioning_generation"] < waiting["required_provisioning_generation"]

        await unlock(app.db, holder)
        done = await wait_broadcast_done(ops, waiting["id"])
        after = await wait_broadcast_done(ops, behind["id"])
        assert (done["state"], done["broadcast_seq"], after["broadcast_seq"]) == ("completed", 2, 3)
        # Each was numbered by a step that saw the applied generation at its G (the audit records it).
        audit = await ops.call("platform.audit.list", platform_service_account_id=account["id"], limit=200)
        sequenced = {e["broadcast_id"]: e for e in audit["events"] if e["action"] == "broadcast.sequenced"}
        for sent in (waiting, behind):
            assert sequenced[sent["id"]]["details"]["applied_provisioning_generation"] >= sent[
                "required_provisioning_generation"], sequenced[sent["id"]]
        everyone = {alpha.workspace_id, beta.workspace_id, late.workspace_id}
        assert await copies(app.db, waiting["id"]) == {w: 1 for w in everyone}
        assert done["targets"]["targets"] == len(everyone) and done["targets"]["generation_excluded"] == 0
        # The new workspace joined after the first broadcast: its interval starts after seq 1.
        mine = await received(app.db, account["id"])
        assert mine[late.workspace_id] == [waiting["id"], behind["id"]]
        assert all(mine[t.workspace_id] == [first["id"], waiting["id"], behind["id"]] for t in tenants)


async def test_a_workspace_created_after_acceptance_is_excluded_then_reached_by_the_next(
        app: App, tenants, nursery, member_password_hash):
    alpha, beta = tenants
    async with operator(app) as ops:
        account = await ready_account(ops, "News")
        # Hold sequence allocation: a provisioning pass that cannot finish (its target is the
        # generation of `first`, whose instance cannot become ready) ...
        holder = await hold_provisioning(app.db, nursery, alpha.workspace_id, member_password_hash)
        first = await new_workspace(app.db, member_password_hash)
        await ops.wait("platform_service_account.instance_changed",
                       lambda d: d["workspace_id"] == first.workspace_id and d["provisioning_state"] == "identity_ready")
        # ... and a broadcast whose G is beyond that pass (`second` is created after it began).
        second = await new_workspace(app.db, member_password_hash)
        sent = await broadcast(ops, account["id"], "fence")
        assert sent["state"] == "waiting_provisioning"
        # Created after G was captured, before the broadcast is numbered: the next pass opens its
        # instance, and the broadcast is numbered only after that pass.
        late = await new_workspace(app.db, member_password_hash)

        await unlock(app.db, holder)
        done = await wait_broadcast_done(ops, sent["id"])
        recipients = {t.workspace_id for t in (alpha, beta, first, second)}
        assert done["state"] == "completed", done
        assert done["targets"] == {"targets": len(recipients), "delivered": len(recipients), "skipped": 0,
                                   "pending": 0, "exceptions": 0, "generation_excluded": 1}
        excluded = await deliveries(ops, sent["id"], "closed")
        assert [(d["workspace_id"], d["recipient_eligible"], d["outcome"]) for d in excluded] == [
            (late.workspace_id, False, "generation_excluded")]
        assert excluded[0].get("local_message_id") is None
        assert await copies(app.db, sent["id"]) == {w: 1 for w in recipients}
        instance = next(i for i in await instances(ops, account["id"]) if i["workspace_id"] == late.workspace_id)
        assert instance["opened_provisioning_generation"] > done["required_provisioning_generation"]
        assert instance["effective_from_broadcast_seq"] <= done["broadcast_seq"]
        # The exclusion settled the workspace's cursor: the next broadcast reaches it.
        assert instance["last_applied_broadcast_seq"] == done["broadcast_seq"]

        following = await broadcast(ops, account["id"], "next")
        followed = await wait_broadcast_done(ops, following["id"])
        assert followed["targets"]["targets"] == len(recipients) + 1
        assert followed["targets"]["generation_excluded"] == 0
        assert await copies(app.db, following["id"]) == {w: 1 for w in recipients | {late.workspace_id}}
        assert (await received(app.db, account["id"]))[late.workspace_id] == [following["id"]]
        async with connect(app.url) as conn:
            await conn.login(late.owner.email, late.owner.password)
            profile = await local_account(conn, late.workspace_id, account["id"])
            history = await conn.call("message.history", workspace_id=late.workspace_id, scope_id=profile["scope_id"])
            assert [m["client_message_id"] for m in history["messages"]] == [f"platform-broadcast:{following['id']}"]


async def test_per_workspace_order_follows_broadcast_seq_across_concurrent_broadcasts(app: App, tenants,
                                                                                    member_password_hash):
    beta = tenants[1]
    everyone = [*tenants, *[await new_workspace(app.db, member_password_hash) for _ in range(3)]]
    async with operator(app) as ops:
        account = await ready_account(ops, "News")
        # Beta refuses writes for a while: its deliveries pile up behind its head (the first
        # broadcast) while every other workspace receives them all.
        await fence(app.db, beta.workspace_id)
        async with trio.open_nursery() as nursery:
            accepted: list[dict] = []

            async def accept(number: int) -> None:
                accepted.append(await broadcast(ops, account["id"], f"c-{number}", f"T{number}", f"body {number}"))

            for number in range(8):
                nursery.start_soon(accept, number)
        head = min(accepted, key=lambda b: b["acceptance_ordinal"])
        stuck = await delivery_changed(ops, head["id"], beta.workspace_id, "operator_attention")
        backlog = [d for b in accepted for d in await deliveries(ops, b["id"]) if d["workspace_id"] == beta.workspace_id]
        assert len(backlog) > 1 and all(d["state"] != "delivered" for d in backlog), backlog
        await unfence(app.db, beta.workspace_id)
        await ops.call("platform.delivery.retry", delivery_id=stuck["id"], expected_version=stuck["version"])

        done = [await wait_broadcast_done(ops, sent["id"]) for sent in accepted]
        assert [b["state"] for b in done] == ["completed"] * len(done), done
        by_seq = [b["id"] for b in sorted(done, key=lambda b: b["broadcast_seq"])]
        assert sorted(b["broadcast_seq"] for b in done) == list(range(1, 9))
        # Head-of-line: seq follows acceptance order.
        assert by_seq == [b["id"] for b in sorted(done, key=lambda b: b["acceptance_ordinal"])]
        mine = await received(app.db, account["id"])
        assert mine == {t.workspace_id: by_seq for t in everyone}


# --- the execution fence -------------------------------------------------------------------------

async def workspace_writes(db: Database, workspace_id: str) -> tuple[int, int, int]:
    """Messages, fanout outbox rows and service-account audit events of the workspace."""
    return await db.run(lambda c: c.fetchrow(
        "SELECT (SELECT count(*) FROM scope_messages WHERE workspace_id = $1), "
        "(SELECT count(*) FROM scope_fanout_outbox WHERE workspace_id = $1), "
        "(SELECT count(*) FROM service_account_audit_events WHERE workspace_id = $1)", workspace_id))


async def execute(app: App, lease, snapshot: BroadcastSnapshot):
    """Run one delivery as the platform actor does: the PlatformDelivery command in the local scope's
    actor.  Returns the refusal, or None when it committed."""
    system = ActorContext(workspace_id=lease.workspace_id, member_id="system", member_kind="system",
                          owner_member_id=None, execution_generation=lease.execution_generation)
    try:
        await app.server.registry.submit(lease.local_scope_id, PlatformDelivery(system, lease, snapshot))
    except Refused as refused:
        return refused
    return None


async def test_a_stale_lease_or_placement_commits_nothing_and_the_live_lease_commits_once(app: App, tenants):
    """Two delivery workers: the first lease expired and the delivery was leased again; both
    executions run, only the live lease writes.  A placement epoch bumped between lease and
    execute refuses too.  Driven through storage and the scope actors, as the platform actor
    drives them."""
    alpha, beta = tenants
    async with operator(app) as ops:
        account = await ready_account(ops, "News")
    account_id, correlation = account["id"], new_id("req")

    async def accept_and_lease_twice(conn):
        # One transaction under the account's root lock, so its actor (awake or not) cannot number,
        # enumerate or lease this broadcast itself; afterwards every delivery holds a live lease.
        accepted = await store.accept_broadcast(
            conn, account_id=account_id, operator_id=ops.operator_id, client_broadcast_id="race", title="Race",
            content="one commit", message_type=POST_MESSAGE_TYPE, correlation_id=correlation)
        assert await store.allocate_step(conn, account_id, correlation) == [accepted.broadcast["id"]]
        assert await store.enumerate_step(conn, account_id, 500)
        # Worker 1's lease expires at once; worker 2 then leases the same deliveries (superseding it).
        first = await store.lease_heads(conn, account_id, "worker-node", 0.0, 256)
        second = await store.lease_heads(conn, account_id, "worker-node", 300.0, 256)
        return (accepted.broadcast["id"], {lease.workspace_id: lease for lease in first},
                {lease.workspace_id: lease for lease in second})

    broadcast_id, stale, live = await app.db.transaction(accept_and_lease_twice)
    assert set(stale) == set(live) == {alpha.workspace_id, beta.workspace_id}
    row = await app.db.run(store.broadcast, broadcast_id)
    snapshot = BroadcastSnapshot(row["id"], account_id, row["broadcast_seq"], row["title"], row["content"],
                                 bytes(row["payload_digest"]), row["operator_id"], row["correlation_id"])
    assert stale[beta.workspace_id].lease_token != live[beta.workspace_id].lease_token

    before = await workspace_writes(app.db, beta.workspace_id)
    outcomes: dict[str, object] = {}

    async def run(name: str, lease) -> None:
        outcomes[name] = await execute(app, lease, snapshot)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "stale", stale[beta.workspace_id])
        nursery.start_soon(run, "live", live[beta.workspace_id])
    assert outcomes["live"] is None, outcomes
    assert isinstance(outcomes["stale"], Refused) and outcomes["stale"].reason == "stale_lease", outcomes
    assert await copies(app.db, row["id"]) == {beta.workspace_id: 1}
    after = await workspace_writes(app.db, beta.workspace_id)
    assert after[0] == before[0] + 1  # one message; the stale execution added nothing
    delivered = await app.db.run(store.delivery, live[beta.workspace_id].delivery_id)
    assert delivered["state"] == "delivered" and delivered["local_message_id"]
    # Executing the stale lease again, after the commit, still writes nothing.
    again = await execute(app, stale[beta.workspace_id], snapshot)
    assert isinstance(again, Refused) and again.reason == "stale_lease"
    assert await workspace_writes(app.db, beta.workspace_id) == after

    # Alpha moves to another node between lease and execute: the lease's epoch is stale.
    lease = live[alpha.workspace_id]
    untouched = await workspace_writes(app.db, alpha.workspace_id)
    epochs = await app.db.transaction(store.claim_placements, [alpha.workspace_id], "another-node")
    assert epochs[alpha.workspace_id] == lease.placement_epoch + 1
    refused = await execute(app, lease, snapshot)
    assert isinstance(refused, Refused) and refused.reason == "stale_placement", refused
    assert await workspace_writes(app.db, alpha.workspace_id) == untouched
    assert await copies(app.db, row["id"]) == {beta.workspace_id: 1}
    still = await app.db.run(lambda c: c.fetchrow(
        "SELECT state, version, lease_token FROM platform_service_account_broadcast_deliveries WHERE id = $1",
        lease.delivery_id))
    assert tuple(still) == ("leased", lease.version, lease.lease_token)
    # Under the new epoch, a lease claiming a later seq than the one the workspace applies next is
    # out of order; a delivery the workspace has no instance for finds its instance gone.
    moved = dataclasses.replace(lease, placement_epoch=epochs[alpha.workspace_id])
    ahead = await execute(app, dataclasses.replace(moved, broadcast_seq=lease.broadcast_seq + 1), snapshot)
    assert isinstance(ahead, Refused) and ahead.reason == "out_of_order", ahead
    elsewhere = await execute(app, dataclasses.replace(moved, delivery_id=live[beta.workspace_id].delivery_id),
                              snapshot)
    assert isinstance(elsewhere, Refused) and elsewhere.reason == "stale_lease", elsewhere
    assert await workspace_writes(app.db, alpha.workspace_id) == untouched


# --- operator retry and settle-skip --------------------------------------------------------------

async def test_a_stuck_delivery_is_retried_or_skipped_by_an_operator(app: App, tenants):
    alpha, beta = tenants
    async with operator(app) as ops:
        account = await ready_account(ops, "News")
        await fence(app.db, beta.workspace_id)  # the message write into Beta is refused
        stuck = await broadcast(ops, account["id"], "stuck")
        waiting = await delivery_changed(ops, stuck["id"], beta.workspace_id, "retry_wait")
        assert waiting["attempt"] == 1 and waiting.get("last_error") and waiting.get("next_attempt_at_ms"), waiting
        attention = await delivery_changed(ops, stuck["id"], beta.workspace_id, "operator_attention")
        assert attention["attempt"] == MAX_ATTEMPTS, attention
        info = await get_broadcast(ops, stuck["id"])
        assert info["state"] == "dispatching", info
        assert (info["targets"]["delivered"], info["targets"]["exceptions"]) == (1, 1), info
        # The next broadcast reaches Alpha but queues behind the stuck one in Beta (strict seq order).
        queued = await broadcast(ops, account["id"], "queued-behind")

        mismatch = await expect_error("conflict", ops.call(
            "platform.delivery.settle_skip", delivery_id=attention["id"], expected_version=attention["version"] + 1))
        assert mismatch.details.get("reason") == "version_mismatch", mismatch
        skipped = await ops.call("platform.delivery.settle_skip", delivery_id=attention["id"],
                                 expected_version=attention["version"])
        assert (skipped["state"], skipped["outcome"]) == ("skipped", "skipped"), skipped
        done = await wait_broadcast_done(ops, stuck["id"])
        assert done["state"] == "completed_with_exceptions", done
        assert (done["targets"]["delivered"], done["targets"]["skipped"], done["targets"]["pending"]) == (1, 1, 0)
        audit = await ops.call("platform.audit.list", platform_service_account_id=account["id"])
        assert [e["action"] for e in audit["events"] if e["subject_id"] == attention["id"]], audit
        assert await copies(app.db, stuck["id"]) == {alpha.workspace_id: 1}
        settled = await expect_error("conflict", ops.call("platform.delivery.settle_skip", delivery_id=attention["id"],
                                                          expected_version=skipped["version"]))
        assert settled.details.get("reason") == "already_settled", settled

        # The skip advanced Beta's cursor: the queued broadcast is tried there next (still fenced, so it
        # too ends in operator_attention, where nothing but an operator moves it)...
        behind = await delivery_changed(ops, queued["id"], beta.workspace_id, "operator_attention")
        # ...and an operator retry after unfencing delivers it.
        await unfence(app.db, beta.workspace_id)
        retried = await ops.call("platform.delivery.retry", delivery_id=behind["id"],
                                 expected_version=behind["version"])
        assert retried["state"] in ("queued", "leased", "delivered"), retried
        assert (await wait_broadcast_done(ops, queued["id"]))["state"] == "completed"
        assert await copies(app.db, queued["id"]) == {t.workspace_id: 1 for t in tenants}
        assert (await received(app.db, account["id"]))[beta.workspace_id] == [queued["id"]]


# --- the state machine ---------------------------------------------------------------------------
# Random interleavings of creating workspaces, holding provisioning back (so broadcasts wait and
# later workspaces land inside the wait), accepting broadcasts and letting delivery run, against one
# server for every example; each example broadcasts through an account of its own.

TERMINAL = ("completed", "completed_with_exceptions", "closed")


class PlatformServer(ServerThread):
    """The server in a trio loop of its own thread, on a multi-workspace instance (its first
    workspace `base_id`), with an operator."""

    waited = 0  # broadcasts accepted while provisioning was held behind their G

    def __init__(self, dsn: str, password_hash: str) -> None:
        super().__init__(dsn, ServerConfig(port=0, auth_timeout_seconds=5.0, shutdown_grace_seconds=1.0),
                         self._instance_with_operator)
        self.password_hash = password_hash

    async def _instance_with_operator(self, db: Database, url: str) -> None:
        base = await tenancy_ops.init_instance(db, email="o0@example.com", display_name="O0", workspace_name="Base",
                                               workspace_slug="base", edition="multi", password=MEMBER_PASSWORD)
        self.base_id = base.workspace_id
        self.operator_id, _, self.operator_key = await create_operator(db, "ops")


async def settled_broadcast(ops: PlatformFeed, broadcast_id: str) -> dict:
    """The BroadcastInfo once terminal (the connection subscribed before reading, so no event is missed)."""
    info = await get_broadcast(ops, broadcast_id)
    if info["state"] in TERMINAL:
        return info
    return await wait_broadcast_done(ops, broadcast_id)


async def provisioned_to_deployment(ops: PlatformFeed, account_id: str) -> dict:
    """The account once its applied generation has reached the deployment's (every workspace has a
    ready instance): read, else wait for its next account event and read again."""
    mine = lambda data: data["platform_service_account_id"] == account_id  # noqa: E731
    position = len(ops.seen)
    while True:
        account = await ops.call("platform.account.get", platform_service_account_id=account_id)
        provisioning = account["provisioning"]
        if provisioning["applied_provisioning_generation"] >= provisioning["deployment_generation"]:
            return account
        position = await ops.next_index(ACCOUNT_EVENTS, mine, start=position) + 1


class BroadcastInterleavings(RuleBasedStateMachine):
    """The model: the order in which workspace creations and broadcast acceptances committed.
    A workspace receives exactly the broadcasts accepted after it was created (G captured at
    acceptance covers it; a later one is generation-excluded or opens after the seq), once each,
    in acceptance order (= seq order, head of line)."""

    numbers = itertools.count(1)

    def __init__(self, server: PlatformServer) -> None:
        super().__init__()
        self.server = server
        self.number = next(self.numbers)
        self.created_before: dict[str, int] = {}  # workspace id -> broadcasts accepted before it existed
        self.broadcasts: list[str] = []  # in acceptance order
        self.holder: int | None = None  # the backend holding provisioning back
        self.created_while_held = 0

    def _as_operator(self, body):
        async def run():
            async with connect(self.server.url) as conn:
                await conn.call("auth", operator_key=self.server.operator_key)
                await conn.call("platform.subscribe")
                return await body(PlatformFeed(conn, self.server.operator_id, self.server.operator_key))

        return self.server.run(run)

    @initialize()
    def create_account(self) -> None:
        for workspace_id in self.server.run(workspace_ids, self.server.db):
            self.created_before[workspace_id] = 0
        self.account_id = self._as_operator(lambda o: ready_account(o, f"Interleave {self.number}"))["id"]

    @rule()
    def create_workspace(self) -> None:
        tenant = self.server.run(new_workspace, self.server.db, self.server.password_hash)
        self.created_before[tenant.workspace_id] = len(self.broadcasts)
        self.created_while_held += self.holder is not None

    @precondition(lambda self: self.holder is None)
    @rule()
    def hold_provisioning(self) -> None:
        # Delivered first: a delivery into the locked workspace would wait in its transaction, and the
        # account's actor (which waits for its leased deliveries) would answer nothing meanwhile.
        self.check()
        self.holder = self.server.run(hold_provisioning, self.server.db, self.server.nursery,
                                      self.server.base_id, self.server.password_hash)
        self.created_while_held = 0

    @rule()
    def accept_broadcast(self) -> None:
        number = len(self.broadcasts)
        sent = self._as_operator(lambda o: broadcast(o, self.account_id, f"i-{self.number}-{number}",
                                                     f"T{number}", f"body {number}"))
        self.broadcasts.append(sent["id"])
        if self.created_while_held:  # a workspace that cannot become ready is inside its G
            assert sent["state"] == "waiting_provisioning", sent
            self.server.waited += 1

    @rule()
    def let_delivery_run(self) -> None:
        self.check()

    def check(self) -> None:
        if self.holder is not None:
            self.server.run(unlock, self.server.db, self.holder)
            self.holder, self.created_while_held = None, 0

        async def settle(o):
            await provisioned_to_deployment(o, self.account_id)
            done = [await settled_broadcast(o, b) for b in self.broadcasts]
            audit = await o.call("platform.audit.list", platform_service_account_id=self.account_id, limit=200)
            return done, audit["events"]

        done, audit = self._as_operator(settle)
        # Numbered only once provisioning had applied the generation each captured.
        applied_when_numbered = {e["broadcast_id"]: e["details"]["applied_provisioning_generation"]
                                 for e in audit if e["action"] == "broadcast.sequenced"}
        assert all(applied_when_numbered[b["id"]] >= b["required_provisioning_generation"] for b in done), audit
        assert [b["state"] for b in done] == ["completed"] * len(done), done
        assert [b["broadcast_seq"] for b in done] == list(range(1, len(done) + 1))
        got = self.server.run(received, self.server.db, self.account_id)
        expected = {w: self.broadcasts[before:] for w, before in self.created_before.items()}
        assert {w: got.get(w, []) for w in expected} == expected
        for info in done:
            assert info["targets"]["targets"] == info["targets"]["delivered"] == sum(
                before <= self.broadcasts.index(info["id"]) for before in self.created_before.values())
        # The same, from the recorded facts: the seq in the instance's interval and opened within G;
        # an instance whose interval holds the seq but opened after G is a generation_excluded settlement.
        instances_by_workspace = self.server.run(platform_instances, self.server.db, self.account_id)
        assert set(instances_by_workspace) == set(self.created_before)
        for workspace_id, instance in instances_by_workspace.items():
            assert got.get(workspace_id, []) == [
                b["id"] for b in done if instance["effective_from_broadcast_seq"] <= b["broadcast_seq"]
                and instance["opened_provisioning_generation"] <= b["required_provisioning_generation"]]
            assert instance["last_applied_broadcast_seq"] == len(done)
        for info in done:
            assert info["targets"]["generation_excluded"] == sum(
                i["effective_from_broadcast_seq"] <= info["broadcast_seq"]
                and i["opened_provisioning_generation"] > info["required_provisioning_generation"]
                for i in instances_by_workspace.values()), info

    def teardown(self) -> None:
        if hasattr(self, "account_id"):
            self.check()  # every example ends delivered


async def platform_instances(db: Database, account_id: str) -> dict[str, dict]:
    rows = await db.run(lambda c: c.fetch(
        "SELECT * FROM platform_service_account_workspace_instances WHERE platform_service_account_id = $1",
        account_id))
    return {r["workspace_id"]: dict(r) for r in rows}


def test_every_workspace_gets_exactly_the_broadcasts_accepted_after_it_existed(database_dsn, member_password_hash):
    with PlatformServer(database_dsn, member_password_hash) as server:
        # First the interleaving that matters, spelled out: a broadcast accepted while provisioning
        # is held behind its G, workspaces created inside that wait, another broadcast behind it.
        scripted = BroadcastInterleavings(server)
        scripted.create_account()
        scripted.hold_provisioning()
        scripted.create_workspace()
        scripted.create_workspace()
        scripted.accept_broadcast()
        scripted.create_workspace()
        scripted.accept_broadcast()
        scripted.let_delivery_run()
        scripted.accept_broadcast()
        scripted.teardown()
        assert server.waited == 2
        # No shrinking: examples share the deployment, so a replay would not see the same state.
        run_state_machine_as_test(lambda: BroadcastInterleavings(server), settings=settings(
            max_examples=12, stateful_step_count=10, deadline=None, derandomize=True,
            phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck)))


async def test_a_fenced_workspace_does_not_hold_the_others_back(app: App, tenants):
    """A write-fenced workspace reconciles no audience, so its instance never gets ready; the account is
    ready anyway and a broadcast reaches the other workspaces, while the fenced one's delivery waits."""
    alpha, beta = tenants
    await app.db.transaction(tenancy.fence_workspace, beta.workspace_id, write_fenced=True, new_generation=False)
    async with operator(app) as ops, await signed_in(app, alpha.owner) as owner:
        feed = await Feed.open(owner, {"workspace_id": alpha.workspace_id})
        account = await create_platform_account(ops, "News")
        ready = await wait_ready(ops, account["id"])
        assert (ready["provisioning"]["instances"], ready["provisioning"]["instances_ready"]) == (2, 1)
        sent = await broadcast(ops, account["id"], "while-fenced", content="hello alpha")
        message = await feed.wait("message.created", lambda data: data["content"] == "hello alpha")
        assert message["client_message_id"] == client_message_id(sent["id"])
        state = await ops.call("platform.broadcast.get", broadcast_id=sent["id"])
        assert state["state"] == "dispatching" and state["targets"]["targets"] == 2
