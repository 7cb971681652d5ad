"""The audience reconcile across a kill -9 of the real server process (issue 14;
service-account.md §3.3, §9.4): a new account's first pass walks the workspace's
active humans in bounded batches, checkpointing its member-id cursor in the account
row with each batch.  Killed mid-pass, the restarted process resumes from that
checkpoint — it does not start over — and converges to exactly the active humans,
each with one membership."""

from __future__ import annotations

import signal

import trio

from client import connect
from storage.bridge import Database, PoolSettings
from tests.test_outage import init_instance
from tests.test_serve import data_dir, start_serve  # noqa: F401  (data_dir is a fixture)
from tests.test_service_account_audience import (
    active_humans,
    audience_settled,
    bulk_humans,
    follow_workspace,
    open_memberships,
    post,
)

HUMANS = 300  # plus the owner
BATCH_OF_ONE = ("--service-account-audience-batch", "1")
BATCHES_BEFORE_KILL = 20


async def checkpoint(db: Database, account_id: str) -> dict:
    return dict(await db.run(lambda c: c.fetchrow(
        "SELECT audience_state, audience_scan_complete, audience_scan_cursor, audience_batches_done "
        "FROM service_accounts WHERE id = $1", account_id)))


async def test_an_interrupted_first_pass_resumes_from_its_checkpoint_and_converges(  # noqa: F811
        data_dir, database_dsn, member_password_hash):
    args = ("--database-url", database_dsn)
    password = (await init_instance("--data-dir", str(data_dir), *args))["password"]
    async with Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as db:
        workspace_id = await db.run(lambda c: c.fetchval("SELECT id FROM workspaces"))
        await bulk_humans(db, workspace_id, HUMANS, member_password_hash, "crowd")
        humans = await active_humans(db, workspace_id)
        assert len(humans) == HUMANS + 1

        served = await start_serve(data_dir, *args, *BATCH_OF_ONE)
        async with connect(served.url) as owner:
            await owner.login("o@example.com", password)
            request = await owner.call("service_account.request.submit", client_request_id="create-news",
                                       name="News")
        account_id = request["created_service_account_id"]
        # The kill moment only: some batches committed, the pass not complete.
        with trio.fail_after(60):
            while (await checkpoint(db, account_id))["audience_batches_done"] < BATCHES_BEFORE_KILL:
                await trio.sleep(0.01)
        served.process.send_signal(signal.SIGKILL)
        with trio.fail_after(60):
            assert await served.process.wait() == -signal.SIGKILL
        at_kill = await checkpoint(db, account_id)
        assert at_kill["audience_state"] == "provisioning" and not at_kill["audience_scan_complete"], (
            f"the pass finished before the kill: {at_kill}")
        scope_id = await db.run(lambda c: c.fetchval(
            "SELECT message_scope_id FROM service_accounts WHERE id = $1", account_id))
        # The checkpoint and the memberships committed together: exactly the humans up to the cursor.
        before = await open_memberships(db, scope_id)
        assert set(before) == {h for h in humans if h <= at_kill["audience_scan_cursor"]}
        assert 0 < len(before) < len(humans)

        served = await start_serve(data_dir, *args, *BATCH_OF_ONE)
        async with connect(served.url) as owner:
            await owner.login("o@example.com", password)
            await follow_workspace(owner, {})
            audience = await audience_settled(owner, {}, account_id, member_count=HUMANS + 1)
            done = await checkpoint(db, account_id)
            assert done["audience_state"] == "ready" and audience["batches_done"] == done["audience_batches_done"]
            # Resumed, not restarted: the batches after the restart covered only the humans
            # past the checkpoint (one batch each, plus at most one closing batch).
            remaining = len(humans) - len(before)
            assert at_kill["audience_batches_done"] < done["audience_batches_done"] <= (
                at_kill["audience_batches_done"] + remaining + 1), (at_kill, done)
            fulfilled = await owner.call("service_account.request.get", request_id=request["id"])
            assert fulfilled["business_state"] == "fulfilled"
            await post(owner, {}, account_id, "Everyone is here")

        after = await open_memberships(db, scope_id)
        assert set(after) == humans
        # The memberships opened before the kill are the same rows, and nobody has a second one.
        rows = await db.run(lambda c: c.fetch(
            "SELECT member_id, count(*) AS n FROM scope_memberships WHERE scope_id = $1 GROUP BY member_id",
            scope_id))
        assert {r["member_id"]: r["n"] for r in rows} == {h: 1 for h in humans}
        assert {m: after[m] for m in before} == before
