"""Hardening of the messaging core (issue 9): actor faults, write fences,
one-transaction creation, outbox generation re-check, unrecoverable withdrawal,
departed members, one visibility module."""

from __future__ import annotations

import math

import pytest
import trio

from actors import scope_actor
from actors.fanout import FanoutHub
from domain.plan import ActorContext, MessageIntent
from actors.registry import ScopeRegistry
from actors.scope_actor import ActorFailed, ActorUnavailable, Send
from server.auth import system_workspace_context
from server import messaging
from storage import applier, messages, tenancy, visibility
from storage.applier import MESSAGE_DOMAIN_TABLES
from storage.errors import LeaseLost, WriteFenced
from tests.conftest import App, add_person
from tests.test_messaging import ListSink, open_channel
from tests.test_tenancy import expect_error, signed_in


async def _bare_scope(db, tenant) -> tuple[str, ActorContext]:
    workspace = await system_workspace_context(db, tenant.workspace_id)
    scope_id = await db.transaction(lambda conn: applier.create_scope(
        conn, workspace_id=tenant.workspace_id, type="channel", created_by=tenant.owner.member_id,
        members=[(tenant.owner.member_id, "public", None)]))
    actor = ActorContext(tenant.workspace_id, tenant.owner.member_id, "human", None, workspace.execution_generation)
    return scope_id, actor


# --- 1. actor faults ------------------------------------------------------------------------------

def _planner_fails_on(monkeypatch, content: str) -> None:
    real = scope_actor.plan_message

    def plan(intent, *args):
        if intent.content == content:
            raise RuntimeError("injected planner fault")
        return real(intent, *args)

    monkeypatch.setattr(scope_actor, "plan_message", plan)


async def test_a_crashed_batch_answers_every_caller_and_the_actor_restarts(app: App, tenants, monkeypatch):
    alpha, _ = tenants
    scope_id, actor = await _bare_scope(app.db, alpha)
    _planner_fails_on(monkeypatch, "boom")
    outcomes: list[BaseException | object] = []

    async def submit(content: str) -> None:
        try:
            outcomes.append(await app.server.registry.submit(
                scope_id, Send(actor, MessageIntent(scope_id=scope_id, content=content))))
        except Exception as exc:  # noqa: BLE001 - collected and checked below
            outcomes.append(exc)

    with trio.fail_after(30):  # today: the callers of the failed batch wait forever
        async with trio.open_nursery() as nursery:
            # Started together, they queue while the fresh actor loads its scope: one batch.
            for content in ("a", "b", "boom", "c"):
                nursery.start_soon(submit, content)
    assert len(outcomes) == 4 and all(isinstance(o, ActorFailed) for o in outcomes), outcomes
    with trio.fail_after(30):
        message = await app.server.registry.submit(scope_id, Send(actor, MessageIntent(scope_id=scope_id,
                                                                                        content="after")))
    assert message.seq == 1  # nothing of the failed batch committed

    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        with trio.fail_after(30):
            await expect_error("internal", owner.call("message.send", scope_id=scope_id, content="boom", **ws))
            assert (await owner.call("message.send", scope_id=scope_id, content="fine", **ws))["seq"] == 2


async def test_submit_waits_a_bounded_time_for_mailbox_room_and_for_the_reply(autojump_clock, db, tenants,
                                                                             monkeypatch):
    alpha, _ = tenants
    scope_id, actor = await _bare_scope(db, alpha)

    async def stuck_commit(self, batch, previous=None):
        await trio.sleep_forever()

    monkeypatch.setattr(scope_actor.ScopeActor, "_commit", stuck_commit)
    outcomes: list[BaseException | object] = []

    async def submit(content: str) -> None:
        try:
            outcomes.append(await registry.submit(scope_id, Send(actor, MessageIntent(scope_id=scope_id,
                                                                                      content=content))))
        except Exception as exc:  # noqa: BLE001 - collected and checked below
            outcomes.append(exc)

    async with trio.open_nursery() as nursery:
        registry = ScopeRegistry(db, FanoutHub(), nursery, submit_timeout_seconds=5.0, mailbox_size=1)
        start = trio.current_time()
        async with trio.open_nursery() as callers:
            # The mailbox holds one: the others wait for room; nothing ever replies.
            for content in ("taken", "queued", "waiting"):
                callers.start_soon(submit, content)
        assert trio.current_time() - start < 6.0  # the bound, not a round-trip count
        nursery.cancel_scope.cancel()
    assert len(outcomes) == 3 and all(isinstance(o, ActorUnavailable) for o in outcomes), outcomes


async def test_a_command_queued_in_a_running_actor_is_bounded_too(autojump_clock, db, tenants, monkeypatch):
    """The fast path (the actor runs, its mailbox has room: no cancel scope per
    command) keeps the same bound, and its expiry task ends once nothing is awaited."""
    alpha, _ = tenants
    scope_id, actor = await _bare_scope(db, alpha)
    stuck = trio.Event()
    real_commit = scope_actor.ScopeActor._commit

    async def commit_until_stuck(self, batch, previous=None):
        if stuck.is_set():
            await trio.sleep_forever()
        return await real_commit(self, batch, previous)

    monkeypatch.setattr(scope_actor.ScopeActor, "_commit", commit_until_stuck)

    def send(content: str) -> Send:
        return Send(actor, MessageIntent(scope_id=scope_id, content=content))

    autojump_clock.autojump_threshold = math.inf  # real commits first: no time jumps while they run
    async with trio.open_nursery() as nursery:
        registry = ScopeRegistry(db, FanoutHub(), nursery, submit_timeout_seconds=5.0, idle_seconds=3600)
        first = await registry.submit(scope_id, send("starts the actor"))
        for n in range(3):  # answered on the fast path: nothing left for the expiry task
            assert (await registry.submit(scope_id, send(f"fast {n}"))).seq == first.seq + 1 + n
        autojump_clock.autojump_threshold = 0
        await trio.sleep(2.0)
        assert not registry._expiring
        stuck.set()
        start = trio.current_time()
        with trio.fail_after(10), pytest.raises(ActorUnavailable):
            await registry.submit(scope_id, send("never answered"))
        assert 5.0 <= trio.current_time() - start < 6.0
        nursery.cancel_scope.cancel()


# --- 2. every write passes the fence; channel.create is all or nothing ----------------------------------

async def test_conversation_actions_pass_the_execution_fence(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "fenced")
        await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=True,
                                 new_generation=False)
        for action in ("pin", "unpin", "hide", "restore", "mute", "unmute", "mark_read", "mark_unread"):
            await expect_error("fenced", owner.call("conversation.action", scope_id=channel["id"], action=action,
                                                    **ws))
        assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM conversation_member_states")) == 0
        await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=False,
                                 new_generation=False)
        await owner.call("conversation.action", scope_id=channel["id"], action="pin", **ws)
        assert (await owner.call("inbox.list", **ws))["conversations"][0]["pinned"]


async def test_channel_create_with_members_is_one_transaction(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        await expect_error("not_found", open_channel(owner, alpha.workspace_id, "team",
                                                     [bob.member_id, "mem_zzzzzzzzzzzzzz"]))
        assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scopes")) == 0
        assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_memberships")) == 0
        # The retry is not refused as slug_taken: nothing was left behind.
        channel = await open_channel(owner, alpha.workspace_id, "team", [bob.member_id])
        members = (await owner.call("scope.members", scope_id=channel["id"], **ws))["members"]
        assert sorted(m["member_id"] for m in members) == sorted([alpha.owner.member_id, bob.member_id])


# A plain send is one statement (no transaction) that passes the gates itself: each change
# below, written straight into the database (no NOTIFY), must make it write nothing.
GATE_CHANGES = {
    "lease taken again (a new epoch)": ("UPDATE scope_leases SET epoch = epoch + 1 WHERE scope_id = $1", LeaseLost),
    "workspace write-fenced": ("UPDATE workspace_execution_states SET write_fenced = true WHERE workspace_id = "
                               "(SELECT workspace_id FROM scopes WHERE id = $1)", WriteFenced),
    "workspace draining": ("UPDATE workspace_execution_states SET state = 'draining' WHERE workspace_id = "
                           "(SELECT workspace_id FROM scopes WHERE id = $1)", WriteFenced),
    "execution generation advanced": ("UPDATE workspace_execution_states SET active_generation = "
                                      "active_generation + 1 WHERE workspace_id = "
                                      "(SELECT workspace_id FROM scopes WHERE id = $1)", WriteFenced),
}


@pytest.mark.parametrize("change", GATE_CHANGES)
async def test_a_plain_send_writes_nothing_when_a_gate_of_its_one_statement_fails(app: App, tenants, monkeypatch,
                                                                                 change: str):
    alpha, _ = tenants
    scope_id, actor = await _bare_scope(app.db, alpha)
    registry = app.server.registry
    await registry.submit(scope_id, Send(actor, MessageIntent(scope_id=scope_id, content="warm")))
    statements: list[str] = []
    run_overlapping = app.db.run_overlapping

    async def logged_run(meanwhile, fn, *args, **kwargs):
        async def logged(conn, *unit_args, **unit_kwargs):
            with conn.query_logger(lambda record: statements.append(record.query)):
                return await fn(conn, *unit_args, **unit_kwargs)
        return await run_overlapping(meanwhile, logged if getattr(fn, "__name__", "") == "_write_batch" else fn,
                                     *args, **kwargs)

    sql, refusal = GATE_CHANGES[change]
    await app.db.run(lambda c: c.execute(sql, scope_id))
    monkeypatch.setattr(app.db, "run_overlapping", logged_run)
    command = Send(actor, MessageIntent(scope_id=scope_id, content="after"))
    await registry._actors[scope_id].mailbox.send(command)  # to this actor: the registry would forward
    with pytest.raises(refusal):
        await command.reply.wait()
    monkeypatch.undo()
    assert statements and statements[0].startswith("WITH gate AS"), statements[:1]  # the one statement ran first
    assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_messages WHERE scope_id = $1",
                                                 scope_id)) == 1


# --- 4. the outbox re-checks the execution generation before the side effect -----------------------------

async def test_outbox_suppresses_rows_of_an_old_generation_or_a_fenced_workspace(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "outbox")
        fenced_one = await owner.call("message.send", scope_id=channel["id"], content="one", **ws)
        stale_one = await owner.call("message.send", scope_id=channel["id"], content="two", **ws)
    delivered: list = []
    subscription = app.server.hub.subscribe(alpha.owner.member_id, ListSink(delivered))
    app.server.hub.follow_scope(subscription, channel["id"])

    async def replay(message_id: str) -> None:
        """As if the server died between commit and first delivery: due again, then drained."""
        await app.server.settler.flush()  # no mark of the inline delivery lands later
        await app.db.run(lambda c: c.execute(
            "UPDATE scope_fanout_outbox SET status = 'pending', delivered_at = NULL, next_attempt_at = now() "
            "WHERE message_id = $1", message_id))
        live = "SELECT count(*) FROM scope_fanout_outbox WHERE status IN ('pending', 'leased')"
        with trio.fail_after(30):  # the background worker may hold some leases meanwhile
            while await app.db.run(lambda c: c.fetchval(live)):
                await app.server.outbox.drain_once()

    await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=True, new_generation=False)
    await replay(fenced_one["id"])
    await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=False, new_generation=True)
    await replay(stale_one["id"])
    async with await signed_in(app, alpha.owner) as owner:  # a new connection carries the new generation
        current = await owner.call("message.send", scope_id=channel["id"], content="three", **ws)
    await replay(current["id"])
    settled = {r["message_id"]: (r["status"], r["suppression_reason"]) for r in await app.db.run(lambda c: c.fetch(
        "SELECT message_id, status, suppression_reason FROM scope_fanout_outbox"))}
    assert settled == {fenced_one["id"]: ("suppressed", "workspace_fenced"),
                       stale_one["id"]: ("suppressed", "stale_execution_generation"),
                       current["id"]: ("delivered", None)}
    assert {e.data.id for e in delivered} == {current["id"]}  # (inline and replayed)


# --- 5. withdrawal makes the content unrecoverable --------------------------------------------------------

async def _rows_containing(db, text: str) -> list[str]:
    """Every text/jsonb column of every message-domain table, scanned for `text`."""
    async def scan(conn) -> list[str]:
        columns = await conn.fetch(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public' "
            "AND table_name = ANY($1::text[]) AND data_type IN ('text', 'jsonb', 'character varying', 'bytea')",
            list(MESSAGE_DOMAIN_TABLES))
        found = []
        for table, column in columns:
            value = f"convert_from({column}, 'LATIN1')" if column.endswith("digest") else f"{column}::text"
            if await conn.fetchval(f"SELECT count(*) FROM {table} WHERE strpos({value}, $1) > 0", text):
                found.append(f"{table}.{column}")
        return found

    return await db.run(scan)


async def test_withdrawal_erases_the_content_everywhere(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    canary = "canary-7f3e"
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "redact", [bob.member_id])
        other = await owner.call("message.send", scope_id=channel["id"], content="unrelated", **ws)
        sent = await owner.call("message.send", scope_id=channel["id"], content=f"{canary} first @bob",
                                client_message_id="c-1", metadata={"note": canary}, **ws)
        await owner.call("message.edit", message_id=sent["id"], content=f"{canary} second", expected_revision=1, **ws)
        await owner.call("message.edit", message_id=sent["id"], content=f"{canary} third", expected_revision=2, **ws)
        await owner.call("reaction.add", message_id=sent["id"], key="👍", **ws)
        assert set(await _rows_containing(app.db, canary)) >= {"scope_messages.content",
                                                                 "scope_message_revisions.content"}
        withdrawn = await owner.call("message.withdraw", message_id=sent["id"], **ws)
        assert await _rows_containing(app.db, canary) == []
        # Identity, position and read frontier stay; an idempotent retry gets the tombstone.
        assert (withdrawn["id"], withdrawn["seq"], withdrawn["state"]) == (sent["id"], sent["seq"], "withdrawn")
        retry = await owner.call("message.send", scope_id=channel["id"], content=f"{canary} first @bob",
                                 client_message_id="c-1", metadata={"note": canary}, **ws)
        assert (retry["id"], retry["content"], retry["replayed"]) == (sent["id"], "", True)
        detail = await owner.call("message.get", message_id=sent["id"], include_revisions=True, **ws)
        assert detail["message"]["content"] == "" and detail.get("revisions", []) == []
        assert (await owner.call("message.get", message_id=other["id"], **ws))["message"]["content"] == "unrelated"
    async with await signed_in(app, bob) as b:
        await b.call("read.mark", scope_id=channel["id"], seq=sent["seq"], **ws)
        page = await b.call("message.history", scope_id=channel["id"], **ws)
        assert page["last_read_seq"] == sent["seq"] and [m["seq"] for m in page["messages"]] == [1, 2]


# --- 6. a member who leaves the workspace leaves every scope ----------------------------------------------

async def _open_memberships(db, member_id: str) -> list[str]:
    return [r["scope_id"] for r in await db.run(lambda c: c.fetch(
        "SELECT scope_id FROM scope_memberships WHERE member_id = $1 AND effective_to_seq IS NULL ORDER BY 1",
        member_id))]


async def test_member_removal_closes_every_scope_membership_through_the_actors(app: App, tenants,
                                                                               member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        public = await open_channel(owner, alpha.workspace_id, "open", [bob.member_id])
        private = await open_channel(owner, alpha.workspace_id, "closed", [bob.member_id], visibility="private")
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        root = await owner.call("message.send", scope_id=public["id"], content="root", **ws)
        await b.call("thread.reply", scope_id=public["id"], root_message_id=root["id"], content="reply", **ws)
        scopes = await _open_memberships(app.db, bob.member_id)
        assert len(scopes) == 4
        generations = dict(await app.db.run(lambda c: c.fetch(
            "SELECT id, roster_generation FROM scopes WHERE id = ANY($1::text[])", scopes)))
        await owner.call("subscribe", scopes=[{"scope_id": public["id"]}], **ws)
        await owner.call("member.remove", member_id=bob.member_id, **ws)
        with trio.fail_after(30):
            event = await owner.next_event()
        assert (event["event"], event["scope_id"]) == ("membership.changed", public["id"])
        assert (event["data"]["member_id"], event["data"]["action"]) == (bob.member_id, "close")
    assert await _open_memberships(app.db, bob.member_id) == []
    after = dict(await app.db.run(lambda c: c.fetch(
        "SELECT id, roster_generation FROM scopes WHERE id = ANY($1::text[])", scopes)))
    assert all(after[s] == generations[s] + 1 for s in scopes)

    # Re-invitation makes the member active again but reopens nothing by itself:
    # scopes are re-entered by an explicit join, invite or dm.open, each a new interval.
    await app.db.transaction(tenancy.add_human_member, alpha.workspace_id, bob.account_id, "developer", None)
    assert await _open_memberships(app.db, bob.member_id) == []
    async with await signed_in(app, bob) as b:
        await expect_error("forbidden", b.call("message.history", scope_id=public["id"], **ws))
        await expect_error("not_found", b.call("message.history", scope_id=private["id"], **ws))
        await expect_error("not_found", b.call("message.history", scope_id=dm["id"], **ws))
        await b.call("scope.join", scope_id=public["id"], **ws)
        assert len((await b.call("message.history", scope_id=public["id"], **ws))["messages"]) == 1
        # A DM belongs to its pair: opening it again reopens the returning member's side.
        assert (await b.call("dm.open", member_id=alpha.owner.member_id, **ws))["id"] == dm["id"]
        await b.call("message.history", scope_id=dm["id"], **ws)
    assert sorted(await _open_memberships(app.db, bob.member_id)) == sorted([public["id"], dm["id"]])


async def test_memberships_a_removal_left_open_are_closed_by_the_sweep(app: App, tenants, member_password_hash):
    """The process died between the removal commit and the actor commands."""
    alpha, _ = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "left-open", [bob.member_id])
        await owner.call("message.send", scope_id=channel["id"], content="before", workspace_id=alpha.workspace_id)

    async def remove_only(conn):
        target = await tenancy.lock_membership_target(conn, alpha.workspace_id, bob.member_id)
        await tenancy.remove_member(conn, alpha.workspace_id, target)

    await app.db.transaction(remove_only)
    assert await _open_memberships(app.db, bob.member_id) == [channel["id"]]
    # Meanwhile the departed member reads and receives nothing: the one visibility
    # rule wants an active member, on every read surface and in every roster.
    await _sees_nothing(app.db, alpha.workspace_id, bob.member_id, channel["id"])
    assert await messaging.close_departed_members(app.server) == 1
    assert await _open_memberships(app.db, bob.member_id) == []
    assert await messaging.close_departed_members(app.server) == 0


async def _sees_nothing(db, workspace_id: str, viewer: str, scope_id: str) -> None:
    message_id = await db.run(lambda c: c.fetchval("SELECT id FROM scope_messages WHERE scope_id = $1", scope_id))
    run = db.run
    assert await run(messages.message_scope, workspace_id, viewer, message_id) is None
    assert await run(messages.message_for_viewer, workspace_id, viewer, message_id) is None
    assert await run(messages.message_revisions, workspace_id, viewer, message_id) == []
    assert await run(messages.reaction_summaries, workspace_id, viewer, [message_id]) == {}
    assert await run(messages.history, workspace_id, viewer, scope_id, before_seq=None, after_seq=None,
                     limit=50) == ([], False)
    assert await run(messages.workspace_feed, workspace_id, viewer, 0, 50) == []
    assert await run(messages.inbox, workspace_id, viewer, after=None, limit=50) == ([], None)
    assert not (await run(messages.scope_for_viewer, workspace_id, scope_id, viewer))["readable"]
    assert not any(r["is_member"] for r in await run(messages.channel_list, workspace_id, viewer))
    assert await run(visibility.viewer_membership, scope_id, viewer) is None
    assert viewer not in {r["member_id"] for r in await run(visibility.scope_members, scope_id)}
    assert viewer not in await run(visibility.entitled_roster, scope_id)
    assert viewer not in (await run(messages.load_scope_context, scope_id)).roster
