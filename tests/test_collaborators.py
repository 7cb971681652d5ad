"""People collaborators (collaborator-policy.md §3, §6, §7.5, §7.6, §8) over the
WebSocket against PostgreSQL: windows from the next global seq, never
retroactive, re-adds as new rows, the channel confirmation, inherited channel
rows under a thread, owner-bounded views, RBAC, the `collaborator.changed` push,
audit and notification rows, and expiry by the maintenance pass (injected clock)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import trio

from client import connect
from server.ops import collaboration as ops
from storage import private_authority, tenancy
from tests.conftest import App, add_person
from tests.db_faults import wait_for_query
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in


@pytest.fixture
async def team(app: App, tenants, member_password_hash):
    """Alpha's owner, a developer (bob), an operator (carol), an admin and a viewer."""
    alpha, _ = tenants
    people = {}
    for name, role in (("bob", "developer"), ("carol", "operator"), ("adam", "admin"), ("vera", "viewer")):
        people[name] = await add_person(app.db, alpha.workspace_id, f"{name}@example.com", role,
                                        member_password_hash)
    return alpha, people


async def db_now(app: App):
    return await app.db.run(lambda conn: conn.fetchval("SELECT now()"))


async def global_tail(app: App, workspace_id: str) -> int:
    return await app.db.run(lambda conn: conn.fetchval(
        "SELECT coalesce(max(latest_global_seq), 0) FROM workspace_message_counters WHERE workspace_id = $1",
        workspace_id))


async def next_change(conn, change: str) -> dict:
    with trio.fail_after(15):
        while True:
            event = await conn.next_event()
            if event["event"] == "collaborator.changed" and event["data"]["change"] == change:
                return event


def channel_add(scope_id: str, member_id: str, ws: dict, **extra) -> dict:
    return dict(scope_id=scope_id, member_id=member_id, confirm_channel=True, no_expiry=True, **ws, **extra)


async def test_add_opens_a_window_at_the_next_global_seq_and_notifies(app: App, team):
    alpha, people = team
    bob, carol = people["bob"], people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, carol) as c:
        await c.call("subscribe", workspace_feed=True, **ws)
        await owner.call("subscribe", workspace_feed=True, **ws)
        channel = await open_channel(owner, alpha.workspace_id, "project", [bob.member_id])
        for i in range(3):
            await owner.call("message.send", scope_id=channel["id"], content=f"before {i}", **ws)
        tail = await global_tail(app, alpha.workspace_id)
        added = await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
        assert added["effective_from_global_seq"] == tail + 1
        assert (added["member_id"], added["owner_member_id"], added["added_by_member_id"]) == (
            carol.member_id, alpha.owner.member_id, alpha.owner.member_id)
        assert (added["scope_id"], added["scope_type"], added["source"], added["active"]) == (
            channel["id"], "channel", "local", True)
        assert added["id"].startswith("col_") and added["execution_id"].startswith("sex_")
        assert "expires_at_ms" not in added and "end_reason" not in added
        # The collaborator and the owner hear about it on their own connections.
        pushed = await next_change(c, "add")
        assert pushed["data"]["collaborator"] == added and pushed["scope_id"] == channel["id"]
        assert (await next_change(owner, "add"))["data"]["collaborator"]["id"] == added["id"]
        # Bob, a member of the channel, is not told.
        async with await signed_in(app, bob) as b:
            await b.call("subscribe", workspace_feed=True, **ws)
            await owner.call("collaborator.add", **channel_add(channel["id"], people["adam"].member_id, ws))
            await next_change(owner, "add")
            await b.call("ping")
            assert not [e for e in b.queued_events() if e["event"] == "collaborator.changed"]

    async def rows(conn):
        return (await conn.fetch("SELECT created_trigger, scope_type, scope_id FROM scope_executions"),
                await conn.fetch("SELECT event_type, member_id, actor_member_id FROM task_collaborator_events "
                                 "ORDER BY event_at, id"),
                await conn.fetch("SELECT member_id, notification_type, state, delivered_at IS NOT NULL AS delivered "
                                 "FROM task_collaborator_notification_jobs ORDER BY queued_at, id"),
                await conn.fetchval("SELECT count(*) FROM scope_memberships WHERE member_id = $1", carol.member_id))

    executions, events, jobs, carol_memberships = await app.db.run(rows)
    # One execution for (owner, channel), created by the first collaborator only.
    assert [tuple(r) for r in executions] == [("first_collaborator", "channel", channel["id"])]
    assert [tuple(r) for r in events] == [("add", carol.member_id, alpha.owner.member_id),
                                          ("add", people["adam"].member_id, alpha.owner.member_id)]
    assert [tuple(r) for r in jobs] == [(carol.member_id, "collaborator_added", "delivered", True),
                                        (people["adam"].member_id, "collaborator_added", "delivered", True)]
    assert carol_memberships == 0  # a collaborator gets no scope membership


async def test_the_rules_of_who_may_be_added_where(app: App, team, member_password_hash):
    alpha, people = team
    bob, carol, vera = people["bob"], people["carol"], people["vera"]
    ws = {"workspace_id": alpha.workspace_id}
    service_id = await app.db.transaction(lambda conn: tenancy.create_agent_or_service(
        conn, alpha.workspace_id, kind="service", handle="github", display_name="GitHub", owner_member_id=None,
        visibility=None))
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "rules", [bob.member_id])
        root = await owner.call("message.send", scope_id=channel["id"], content="root", **ws)
        thread_id = (await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                      content="reply", **ws))["scope_id"]
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        add = lambda **fields: owner.call("collaborator.add", **ws, **fields)  # noqa: E731

        async def refused(code: str, reason: str | None, **fields) -> None:
            error = await expect_error(code, add(**fields))
            assert error.details.get("reason") == reason, error

        # A channel needs an explicit confirmation and an explicit expiry choice.
        await refused("invalid", "channel_confirmation_required", scope_id=channel["id"], member_id=carol.member_id)
        await refused("invalid", "channel_confirmation_required", scope_id=channel["id"], member_id=carol.member_id,
                      confirm_channel=True)
        await refused("invalid", "channel_confirmation_required", scope_id=channel["id"], member_id=carol.member_id,
                      no_expiry=True)
        far = int((await db_now(app)).timestamp() * 1000) + 3_600_000
        await refused("invalid", "conflicting_expiry", scope_id=channel["id"], member_id=carol.member_id,
                      confirm_channel=True, no_expiry=True, expires_at_ms=far)
        await refused("invalid", "expiry_in_past", scope_id=channel["id"], member_id=carol.member_id,
                      confirm_channel=True, expires_at_ms=1_000)
        await expect_error("bad_frame", add(scope_id=channel["id"], member_id=carol.member_id, confirm_channel=True,
                                            expires_at_ms=10**16))
        # DMs have no collaborators; agents, the owner and unknown members cannot be added.
        await refused("invalid", "scope_type_not_supported", scope_id=dm["id"], member_id=carol.member_id)
        await refused("invalid", "collaborator_is_agent", **channel_add(channel["id"], agent["id"], {}))
        await refused("invalid", "collaborator_is_owner", **channel_add(channel["id"], alpha.owner.member_id, {}))
        await refused("not_found", None, **channel_add(channel["id"], "mem_zzzzzzzzzzzzzz", {}))
        await refused("invalid", None, **channel_add(channel["id"], "not-an-id", {}))
        await refused("invalid", None, **channel_add("scp_bad", carol.member_id, {}))
        # With the confirmation: a channel; a thread needs none; an app (service member) may be added.
        with_expiry = await add(scope_id=channel["id"], member_id=carol.member_id, confirm_channel=True,
                                expires_at_ms=far)
        assert with_expiry["expires_at_ms"] == far
        await refused("conflict", "already_collaborator", **channel_add(channel["id"], carol.member_id, {}))
        in_thread = await add(scope_id=thread_id, member_id=carol.member_id)
        assert (in_thread["scope_type"], in_thread["active"]) == ("thread", True)
        assert (await add(scope_id=thread_id, member_id=service_id))["member_id"] == service_id
        secret = await open_channel(owner, alpha.workspace_id, "secret", visibility="private")
        removed_member = await add_person(app.db, alpha.workspace_id, "gone@example.com", "developer",
                                          member_password_hash)
        await owner.call("member.remove", member_id=removed_member.member_id, **ws)
        await refused("invalid", "collaborator_not_active", scope_id=thread_id, member_id=removed_member.member_id)
    async with await signed_in(app, bob) as b:
        # Bob is not in the secret channel: it does not exist for him.
        await expect_error("not_found", b.call("collaborator.add", scope_id=secret["id"], member_id=carol.member_id,
                                               confirm_channel=True, no_expiry=True, **ws))
        await expect_error("not_found", b.call("collaborator.list", scope_id=secret["id"], **ws))
    async with await signed_in(app, carol) as c:
        # Carol reads the public channel's existence but is not a member of it.
        await expect_error("forbidden", c.call("collaborator.add", **channel_add(channel["id"], bob.member_id, ws)))
    async with await signed_in(app, vera) as v:
        # A viewer is read-only: no adds, even in a channel they belong to.
        await v.call("scope.join", scope_id=channel["id"], **ws)
        error = await expect_error("forbidden", v.call("collaborator.add",
                                                       **channel_add(channel["id"], carol.member_id, ws)))
        assert "message.write" in error.message
        assert (await v.call("collaborator.list", scope_id=channel["id"], **ws))["collaborators"] == []
    count = await app.db.run(lambda conn: conn.fetchval("SELECT count(*) FROM task_scope_participant_metadata"))
    assert count == 3


async def test_remove_and_leave_are_not_retroactive_and_a_re_add_is_a_new_row(app: App, team):
    alpha, people = team
    bob, carol, adam = people["bob"], people["carol"], people["adam"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, carol) as c, \
            await signed_in(app, bob) as b, await signed_in(app, adam) as a:
        await c.call("subscribe", workspace_feed=True, **ws)
        channel = await open_channel(owner, alpha.workspace_id, "windows", [bob.member_id, carol.member_id,
                                                                            adam.member_id])
        first = await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
        for i in range(4):
            await c.call("message.send", scope_id=channel["id"], content=f"inside {i}", **ws)
        tail = await global_tail(app, alpha.workspace_id)
        # Only the owner removes; only the collaborator leaves; to anyone else the id does not exist.
        for conn, op in ((b, "collaborator.remove"), (a, "collaborator.remove"), (c, "collaborator.remove"),
                         (owner, "collaborator.leave"), (b, "collaborator.leave"), (a, "collaborator.update_expiry")):
            extra = {"no_expiry": True} if op == "collaborator.update_expiry" else {}
            await expect_error("not_found", conn.call(op, collaborator_id=first["id"], **extra, **ws))
        await expect_error("invalid", owner.call("collaborator.remove", collaborator_id="grt_zzzzzzzzzzzzzz", **ws))
        removed = await owner.call("collaborator.remove", collaborator_id=first["id"], **ws)
        assert (removed["active"], removed["end_reason"], removed["effective_to_global_seq"]) == (
            False, "removed", tail)
        assert removed["effective_from_global_seq"] == first["effective_from_global_seq"]
        assert (await next_change(c, "remove"))["data"]["collaborator"]["id"] == first["id"]
        error = await expect_error("conflict", owner.call("collaborator.remove", collaborator_id=first["id"], **ws))
        assert error.details["reason"] == "already_ended"
        await c.call("message.send", scope_id=channel["id"], content="after removal", **ws)
        # A re-add is a new row with a new window; the old one keeps its own.
        second = await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
        assert second["id"] != first["id"] and second["execution_id"] == first["execution_id"]
        assert second["effective_from_global_seq"] == tail + 2
        left = await c.call("collaborator.leave", collaborator_id=second["id"], **ws)
        assert (left["end_reason"], left["active"], left["effective_to_global_seq"]) == ("left", False, tail + 1)
        current = await owner.call("collaborator.list", scope_id=channel["id"], **ws)
        assert current["collaborators"] == []
        history = (await owner.call("collaborator.list", scope_id=channel["id"], include_ended=True,
                                    **ws))["collaborators"]
        assert [(r["id"], r["end_reason"], r["effective_from_global_seq"], r["effective_to_global_seq"])
                for r in history] == [(first["id"], "removed", first["effective_from_global_seq"], tail),
                                      (second["id"], "left", tail + 2, tail + 1)]
        # Leaving needs no write permission: a read-only viewer can always step out.
        viewer_row = await owner.call("collaborator.add", **channel_add(channel["id"], people["vera"].member_id, ws))
    async with await signed_in(app, people["vera"]) as v:
        assert (await v.call("collaborator.leave", collaborator_id=viewer_row["id"], **ws))["end_reason"] == "left"
    events = await app.db.run(lambda conn: conn.fetch(
        "SELECT event_type, actor_member_id FROM task_collaborator_events ORDER BY event_at, id"))
    assert [tuple(r) for r in events] == [("add", alpha.owner.member_id), ("remove", alpha.owner.member_id),
                                          ("add", alpha.owner.member_id), ("leave", carol.member_id),
                                          ("add", alpha.owner.member_id), ("leave", people["vera"].member_id)]


async def test_a_thread_lists_its_channel_collaborators_as_inherited(app: App, team):
    alpha, people = team
    bob, carol = people["bob"], people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "design", [bob.member_id])
        root = await owner.call("message.send", scope_id=channel["id"], content="review", **ws)
        other_root = await owner.call("message.send", scope_id=channel["id"], content="other", **ws)
        thread_id = (await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                      content="thread", **ws))["scope_id"]
        sibling_id = (await owner.call("thread.reply", scope_id=channel["id"], root_message_id=other_root["id"],
                                       content="sibling", **ws))["scope_id"]
        on_channel = await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
        on_thread = await owner.call("collaborator.add", scope_id=thread_id, member_id=bob.member_id, **ws)
        listed = (await owner.call("collaborator.list", scope_id=thread_id, **ws))["collaborators"]
        assert sorted((r["id"], r["source"], r["scope_id"]) for r in listed) == sorted([
            (on_channel["id"], "inherited", channel["id"]), (on_thread["id"], "local", thread_id)])
        # The channel does not inherit from its threads; a sibling thread only from the channel.
        assert [(r["id"], r["source"]) for r in (await owner.call("collaborator.list", scope_id=channel["id"],
                                                                  **ws))["collaborators"]] == [
            (on_channel["id"], "local")]
        assert [(r["id"], r["source"]) for r in (await owner.call("collaborator.list", scope_id=sibling_id,
                                                                  **ws))["collaborators"]] == [
            (on_channel["id"], "inherited")]
        overview = (await owner.call("collaborator.overview", **ws))["people"]
        assert [(p["member_id"], p["handle"], p["kind"], [s["scope_id"] for s in p["scenes"]]) for p in overview] == [
            (bob.member_id, "bob", "human", [thread_id]), (carol.member_id, "carol", "human", [channel["id"]])]
    # Nothing copied: one row per add, one execution per (owner, scope) that got one.
    counts = await app.db.run(lambda conn: conn.fetchrow(
        "SELECT (SELECT count(*) FROM task_scope_participant_metadata) AS rows, "
        "(SELECT count(*) FROM scope_executions) AS executions"))
    assert (counts["rows"], counts["executions"]) == (2, 2)


async def test_only_the_owner_sees_their_collaborators(app: App, team):
    alpha, people = team
    bob, carol, adam = people["bob"], people["carol"], people["adam"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "shared", [bob.member_id, adam.member_id])
        mine = await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
    async with await signed_in(app, bob) as b:
        bobs = await b.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
        assert bobs["execution_id"] != mine["execution_id"]  # an execution per owner
        assert [r["id"] for r in (await b.call("collaborator.list", scope_id=channel["id"],
                                               **ws))["collaborators"]] == [bobs["id"]]
    async with await signed_in(app, adam) as a:
        # A workspace admin sees none of them: there is no owner parameter to ask with.
        assert (await a.call("collaborator.overview", include_ended=True, **ws))["people"] == []
        assert (await a.call("collaborator.list", scope_id=channel["id"], include_ended=True,
                             **ws))["collaborators"] == []
        await expect_error("bad_frame", a.call("collaborator.overview", owner_member_id=alpha.owner.member_id, **ws))
        await expect_error("not_found", a.call("collaborator.remove", collaborator_id=mine["id"], **ws))
    async with await signed_in(app, alpha.owner) as owner:
        overview = (await owner.call("collaborator.overview", **ws))["people"]
        assert [[s["id"] for s in p["scenes"]] for p in overview] == [[mine["id"]]]


async def test_update_expiry_and_expiry_by_the_maintenance_pass(app: App, team):
    alpha, people = team
    bob, carol = people["bob"], people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, carol) as c:
        await c.call("subscribe", workspace_feed=True, **ws)
        channel = await open_channel(owner, alpha.workspace_id, "expiring", [bob.member_id])
        root = await owner.call("message.send", scope_id=channel["id"], content="root", **ws)
        thread_id = (await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                      content="go", **ws))["scope_id"]
        now = await db_now(app)
        soon = int((now + timedelta(minutes=5)).timestamp() * 1000)
        added = await owner.call("collaborator.add", scope_id=thread_id, member_id=carol.member_id,
                                 expires_at_ms=soon, **ws)
        for fields, reason in (({}, "expiry_required"),
                               ({"no_expiry": True, "expires_at_ms": soon}, "conflicting_expiry"),
                               ({"expires_at_ms": 1_000}, "expiry_in_past")):
            error = await expect_error("invalid", owner.call("collaborator.update_expiry", collaborator_id=added["id"],
                                                             **fields, **ws))
            assert error.details["reason"] == reason
        later = soon + 60_000
        moved = await owner.call("collaborator.update_expiry", collaborator_id=added["id"], expires_at_ms=later, **ws)
        assert (moved["expires_at_ms"], moved["effective_from_global_seq"]) == (later,
                                                                                added["effective_from_global_seq"])
        assert (await next_change(c, "update_expiry"))["data"]["collaborator"]["expires_at_ms"] == later
        await owner.call("message.send", scope_id=channel["id"], content="more", **ws)
        tail = await global_tail(app, alpha.workspace_id)
        # Not due yet at the real clock; due an hour later (the injected clock).
        assert await ops.collaborator_maintenance(app.server, now) == (0, 0)
        assert await ops.collaborator_maintenance(app.server, now + timedelta(hours=1)) == (1, 0)
        expired = (await next_change(c, "expire"))["data"]["collaborator"]
        assert (expired["id"], expired["active"], expired["end_reason"], expired["ended_at_ms"],
                expired["effective_to_global_seq"]) == (added["id"], False, "expired", later, tail)
        assert await ops.collaborator_maintenance(app.server, now + timedelta(hours=1)) == (0, 0)  # done once
        error = await expect_error("conflict", owner.call("collaborator.update_expiry", collaborator_id=added["id"],
                                                          no_expiry=True, **ws))
        assert error.details["reason"] == "already_ended"
        again = await owner.call("collaborator.add", scope_id=thread_id, member_id=carol.member_id, **ws)
        assert again["id"] != added["id"] and again["effective_from_global_seq"] == tail + 1
    events = await app.db.run(lambda conn: conn.fetch(
        "SELECT event_type, actor_member_id, payload_json FROM task_collaborator_events ORDER BY event_at, id"))
    assert [(r["event_type"], r["actor_member_id"]) for r in events] == [
        ("add", alpha.owner.member_id), ("update_expiry", alpha.owner.member_id), ("expire", None),
        ("add", alpha.owner.member_id)]


async def test_a_notification_lost_after_commit_is_delivered_by_maintenance(app: App, team):
    alpha, people = team
    carol = people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, carol) as c:
        await c.call("subscribe", workspace_feed=True, **ws)
        channel = await open_channel(owner, alpha.workspace_id, "crash")

        async def committed_without_delivery(conn):
            execution_id = await private_authority.ensure_execution(
                conn, alpha.workspace_id, alpha.owner.member_id, channel["id"], "channel", "first_collaborator")
            return await private_authority.add_collaborator(conn, alpha.workspace_id, execution_id, carol.member_id,
                                                            alpha.owner.member_id, None)

        change = await app.db.transaction(committed_without_delivery)
        now = await db_now(app)
        assert await ops.collaborator_maintenance(app.server, now) == (0, 0)  # still inside the grace
        assert await ops.collaborator_maintenance(app.server, now + timedelta(minutes=1)) == (0, 1)
        pushed = await next_change(c, "add")
        assert pushed["data"]["collaborator"]["id"] == change.collaborator["id"]
        assert await ops.collaborator_maintenance(app.server, now + timedelta(minutes=1)) == (0, 0)
    state = await app.db.run(lambda conn: conn.fetchval(
        "SELECT state FROM task_collaborator_notification_jobs WHERE id = $1", change.notification_job_id))
    assert state == "delivered"


async def test_windows_decide_what_the_owners_private_agent_reads_live_and_in_history(app: App, team):
    """The read side of a grant and of a People collaborator: the owner's private
    agent reads what they wrote inside their windows, from the next message on,
    and keeps reading it after revocation / removal (never retroactive)."""
    alpha, people = team
    bob, carol = people["bob"], people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, carol) as c:
        agent = await owner.call("agent.create", handle="scribe", display_name="Scribe", **ws)
        key = await owner.call("apikey.create", name="scribe", member_id=agent["id"], **ws)
        channel = await open_channel(owner, alpha.workspace_id, "context", [bob.member_id, carol.member_id,
                                                                             agent["id"]])
        async with connect(app.url) as scribe:
            await scribe.auth(api_key=key["key"])
            await scribe.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
            say = lambda conn, text: conn.call("message.send", scope_id=channel["id"], content=text, **ws)  # noqa
            await say(b, "bob before the grant")
            grant = await owner.call("private_grant.create", scope_id=channel["id"], grantee_member_id=bob.member_id,
                                     **ws)
            await say(b, "bob inside the grant")
            await owner.call("private_grant.revoke", grant_id=grant["id"], **ws)
            await say(b, "bob after the revocation")
            await say(c, "carol before")
            added = await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
            await say(c, "carol inside")
            await owner.call("collaborator.remove", collaborator_id=added["id"], **ws)
            await say(c, "carol after the removal")
            marker = await say(owner, "the owner, last")
            expected = ["bob inside the grant", "carol inside", "the owner, last"]
            live = []
            with trio.fail_after(15):
                while not live or live[-1]["id"] != marker["id"]:
                    event = await scribe.next_event()
                    if event["event"] == "message.created":
                        live.append(event["data"])
            assert [m["content"] for m in live] == expected
            page = await scribe.call("message.history", scope_id=channel["id"], **ws)
            assert [m["content"] for m in page["messages"]] == expected


async def test_a_thread_reads_with_its_own_and_its_channels_authority_never_a_siblings(app: App, team):
    """Chain(S): a channel collaborator covers the channel's threads; a thread grant
    covers that thread only — not its channel, not a sibling thread."""
    alpha, people = team
    bob, carol = people["bob"], people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, carol) as c:
        agent = await owner.call("agent.create", handle="scribe", display_name="Scribe", **ws)
        key = await owner.call("apikey.create", name="scribe", member_id=agent["id"], **ws)
        channel = await open_channel(owner, alpha.workspace_id, "chain", [bob.member_id, carol.member_id,
                                                                           agent["id"]])
        threads = []
        for name in ("first", "sibling"):
            root = await owner.call("message.send", scope_id=channel["id"], content=f"{name} root", **ws)
            opened = await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                      content="@scribe follow this", **ws)
            assert opened["metadata"]["mentions"] == [agent["id"]]  # the owner's mention admits the agent
            for conn in (b, c):
                await conn.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                content="joining", **ws)
            threads.append((root, opened["scope_id"]))
        (first_root, first), (sibling_root, sibling) = threads
        await owner.call("private_grant.create", scope_id=first, grantee_member_id=bob.member_id, **ws)
        await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
        async with connect(app.url) as scribe:
            await scribe.auth(api_key=key["key"])
            await scribe.call("subscribe", scopes=[{"scope_id": sibling}], **ws)
            for conn, who in ((b, "bob"), (c, "carol")):
                await conn.call("message.send", scope_id=channel["id"], content=f"{who} in the channel", **ws)
                for root, where in ((first_root, "first"), (sibling_root, "sibling")):
                    await conn.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                    content=f"{who} in {where}", **ws)
            marker = await owner.call("thread.reply", scope_id=channel["id"], root_message_id=sibling_root["id"],
                                      content="owner marker", **ws)
            live = []
            with trio.fail_after(15):
                while not live or live[-1]["id"] != marker["id"]:
                    event = await scribe.next_event()
                    if event["event"] == "message.created":
                        live.append(event["data"])
            assert [m["content"] for m in live] == ["carol in sibling", "owner marker"]

            async def read(scope_id: str) -> list[str]:
                page = await scribe.call("message.history", scope_id=scope_id, **ws)
                return [m["content"] for m in page["messages"]
                        if m["author_member_id"] in (bob.member_id, carol.member_id)]

            assert await read(channel["id"]) == ["carol in the channel"]
            assert await read(first) == ["bob in first", "carol in first"]
            assert await read(sibling) == ["carol in sibling"]


async def test_changes_and_the_expiry_pass_respect_the_write_fence(app: App, team):
    alpha, people = team
    bob, carol = people["bob"], people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, carol) as c:
        channel = await open_channel(owner, alpha.workspace_id, "fence", [bob.member_id])
        now = await db_now(app)
        soon = int((now + timedelta(minutes=5)).timestamp() * 1000)
        added = await owner.call("collaborator.add", scope_id=channel["id"], member_id=carol.member_id,
                                 confirm_channel=True, expires_at_ms=soon, **ws)
        await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=True, new_generation=False)
        for conn, op, fields in (
                (owner, "private_grant.create", {"scope_id": channel["id"], "grantee_member_id": bob.member_id}),
                (owner, "collaborator.add", channel_add(channel["id"], bob.member_id, {})),
                (owner, "collaborator.update_expiry", {"collaborator_id": added["id"], "no_expiry": True}),
                (owner, "collaborator.remove", {"collaborator_id": added["id"]}),
                (c, "collaborator.leave", {"collaborator_id": added["id"]})):
            await expect_error("fenced", conn.call(op, **fields, **ws))
        # The expiry pass leaves a fenced workspace alone, and closes the row once the fence is lifted.
        assert await ops.collaborator_maintenance(app.server, now + timedelta(hours=1)) == (0, 0)
        await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=False,
                                 new_generation=False)
        assert await ops.collaborator_maintenance(app.server, now + timedelta(hours=1)) == (1, 0)
    counts = await app.db.run(lambda conn: conn.fetchrow(
        "SELECT (SELECT count(*) FROM scope_private_grants) AS grants, "
        "(SELECT count(*) FROM task_scope_participant_metadata) AS collaborators, "
        "(SELECT count(*) FROM task_collaborator_events) AS events"))
    assert tuple(counts) == (0, 1, 2)  # the add and the expiry


async def test_a_window_opens_after_a_global_seq_allocated_but_not_yet_committed(app: App, team):
    """A send that has numbered its message but not committed yet holds the
    workspace counter row: an add waits for it (FOR SHARE) and opens its window
    after that message, so nothing committed before the add is ever inside it."""
    alpha, people = team
    carol = people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "in-flight")
        await owner.call("message.send", scope_id=channel["id"], content="creates the counter row", **ws)
        tail = await global_tail(app, alpha.workspace_id)
        waited = []

        async def in_flight_send(conn):
            # Allocate the next global seq as the Applier does; commit only once a backend waits for this
            # transaction (the add's FOR SHARE on the counter row: nothing else runs in this test).
            await conn.execute("UPDATE workspace_message_counters SET latest_global_seq = latest_global_seq + 1 "
                               "WHERE workspace_id = $1", alpha.workspace_id)
            for _ in range(600):
                if await conn.fetchval("SELECT /* in-flight */ count(*) FROM pg_stat_activity "
                                       "WHERE wait_event_type = 'Lock' AND wait_event = 'transactionid'"):
                    waited.append(True)
                    return
                # Marked too, so the test's wait_for_query sees this transaction whenever it looks.
                await conn.execute("SELECT /* in-flight */ pg_sleep(0.05)")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.db.transaction, in_flight_send)
            await wait_for_query(app.db, "query LIKE 'SELECT /* in-flight */%'")
            added = await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
        assert waited == [True]
        assert added["effective_from_global_seq"] == tail + 2


async def test_a_starting_server_closes_what_expired_while_it_was_down(app: App, team, nursery, server_config):
    """The server runs the maintenance pass itself: at start (before it counts as
    started), then every 30 s — nobody has to call it."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from server.app import Server
    from server.auth import Authenticator, SessionSigner

    alpha, people = team
    carol = people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "downtime")
        soon = int((await db_now(app) + timedelta(minutes=5)).timestamp() * 1000)
        added = await owner.call("collaborator.add", scope_id=channel["id"], member_id=carol.member_id,
                                 confirm_channel=True, expires_at_ms=soon, **ws)
    # It expired an hour ago (moved in the past, as if the server had been down).
    await app.db.run(lambda conn: conn.execute(
        "UPDATE task_scope_participant_metadata SET added_at = added_at - interval '2 hours', "
        "expires_at = now() - interval '1 hour' WHERE id = $1", added["id"]))
    server = Server(server_config, app.db, Authenticator(app.db, SessionSigner(Ed25519PrivateKey.generate()),
                                                         server_config.session_ttl_seconds))
    await nursery.start(server.run)
    row = await app.db.run(lambda conn: conn.fetchrow(
        "SELECT active_key, effective_to_global_seq FROM task_scope_participant_metadata WHERE id = $1", added["id"]))
    assert row["active_key"] is None and row["effective_to_global_seq"] is not None
