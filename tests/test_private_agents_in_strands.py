"""Private agents in strands (issue 12 on task scopes; scope-model §5.2, collaborator-policy
§3.0, §3.3, §6, §8.1, §8.4; SPEC §5 decisions 8 and 11), over the WebSocket against
PostgreSQL: a private agent enters a strand's discussion only when someone with authority
addresses it there while it is a private member of the board channel; it reads and
receives only the owner-private set (live, history, replay); task-local People
collaborators live on an explicit-task Scope Execution created by the first add, never by
the strand or a wake; the board channel's collaborators are inherited at read time; the
strand itself stays its board readers'; leaving the channel or archiving closes it."""

from __future__ import annotations

import trio

from tests.conftest import App
from tests.test_strands import Board, as_key, world  # noqa: F401  (world is a fixture)
from tests.test_tenancy import expect_error, signed_in


async def _history(conn, scope_id: str, ws: dict) -> list[str]:
    return [m["content"] for m in (await conn.call("message.history", scope_id=scope_id, **ws))["messages"]]


async def _next_message(conn) -> str:
    """The content of the next message.created event (bounded wait: a missing one fails)."""
    with trio.fail_after(20):
        while True:
            event = await conn.next_event()
            if event["event"] == "message.created":
                return event["data"]["content"]


async def _executions(app: App, scope_id: str) -> list[tuple]:
    return [tuple(r) for r in await app.db.run(lambda c: c.fetch(
        "SELECT owner_member_id, scope_type, created_trigger FROM scope_executions WHERE scope_id = $1", scope_id))]


async def _deliveries_to(app: App, member_id: str) -> int:
    return await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM scope_targeted_deliveries WHERE recipient_member_id = $1", member_id))


async def test_a_private_agent_enters_a_strand_only_when_authority_addresses_it_and_reads_the_owner_private_set(
        app: App, world: Board):
    w, ws = world, world.ws
    async with (await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as bob,
                as_key(app, w.private_key) as scout):
        # Not admitted: the strand is invisible to it, like any unknown scope.
        await expect_error("not_found", scout.call("message.history", scope_id=w.strand, **ws))
        # Bob holds no authority: his mention stays plain text and admits nothing.
        plain = await bob.call("message.send", scope_id=w.strand, content="@scout have a look", **ws)
        assert "mentions" not in plain.get("metadata", {})
        await expect_error("not_found", scout.call("message.history", scope_id=w.strand, **ws))
        public = {m["member_id"] for m in (await bob.call("scope.members", scope_id=w.strand, **ws))["members"]}
        assert w.private_agent not in public

        # Its owner addresses it: admitted, as a private member (shown with its owner when asked).
        wake = await owner.call("message.send", scope_id=w.strand, content="@scout summarize this", **ws)
        assert wake["metadata"]["mentions"] == [w.private_agent]
        members = {m["member_id"]: m for m in (await owner.call(
            "scope.members", scope_id=w.strand, include_private=True, **ws))["members"]}
        assert members[w.private_agent]["visibility"] == "private"
        assert members[w.private_agent]["owner_member_id"] == w.owner.member_id
        # The explicit task's owner-only identity is the task row: a wake creates no execution row.
        assert await _executions(app, w.strand) == []

        await scout.call("subscribe", scopes=[{"scope_id": w.strand}], **ws)
        await bob.call("message.send", scope_id=w.strand, content="bob, not for the agent", **ws)
        await owner.call("message.send", scope_id=w.strand, content="owner 2", **ws)
        # Live: Bob's message never arrives; the owner's next one does, first.
        assert await _next_message(scout) == "owner 2"
        await scout.call("message.send", scope_id=w.strand, content="scout output", **ws)
        assert await _next_message(scout) == "scout output"
        assert await _history(scout, w.strand, ws) == ["@scout summarize this", "owner 2", "scout output"]
        await expect_error("not_found", scout.call("message.get", message_id=plain["id"], **ws))
        # The humans read everything, the agent's output too.
        assert (await _history(bob, w.strand, ws))[-1] == "scout output"

        # Its Inbox lists the strand with what it reads there, nothing else.
        inbox = {c["scope_id"]: c for c in (await scout.call("inbox.list", **ws))["conversations"]}
        # The admitting message and "owner 2"; its own output is never unread, Bob's are not its.
        assert inbox[w.strand]["unread_count"] == 2
        # The strand itself stays its board readers': to the agent it does not exist.
        await expect_error("not_found", scout.call("strand.get", strand_id=w.strand, **ws))
        await expect_error("not_found", scout.call("strand.list", board_id=w.board, **ws))
        # Its admission closes only with the board channel: it cannot step out of the strand alone.
        error = await expect_error("forbidden", scout.call("scope.leave", scope_id=w.strand, **ws))
        assert error.details["reason"] == "task_readers_from_board"
        await expect_error("not_found", scout.call("strand.watch.set", strand_id=w.strand,
                                                   level="all", **ws))
        await expect_error("not_found", owner.call("strand.assign", strand_id=w.strand,
                                                   member_id=w.private_agent, **ws))
        # Having written, it participates, yet watching never wakes it: only authority does.
        before = await _deliveries_to(app, w.private_agent)
        await bob.call("message.send", scope_id=w.strand, content="bob again", **ws)
        assert await _deliveries_to(app, w.private_agent) == before

        # A task-local People collaborator: the first add creates the (owner, task) execution.
        added = await owner.call("collaborator.add", scope_id=w.strand, member_id=w.bob.member_id, **ws)
        assert added["scope_type"] == "explicit_task" and added["scope_id"] == w.strand
        assert await _executions(app, w.strand) == [(w.owner.member_id, "explicit_task", "first_collaborator")]
        as_collaborator = await bob.call("message.send", scope_id=w.strand, content="bob as collaborator", **ws)
        assert await _next_message(scout) == "bob as collaborator"
        why = await owner.call("visibility.explain", message_id=as_collaborator["id"], member_id=w.private_agent,
                               **ws)
        assert (why["reason"], why["grant_id"], why["window"]["scope_id"]) == ("collaborator", added["id"], w.strand)
        # The `@` resolver offers Bob the agent now, through the strand's collaborator row.
        offered = (await bob.call("private_agent.candidates", scope_id=w.strand, prefix="sc", **ws))["candidates"]
        assert [(c["member_id"], c["relation"], c["source_scope_id"]) for c in offered] == [
            (w.private_agent, "collaborator", w.strand)]
        # Bob may now address the agent, and his earlier messages stay unreadable (no backfill).
        addressed = await bob.call("message.send", scope_id=w.strand, content="@scout over to you", **ws)
        assert addressed["metadata"]["mentions"] == [w.private_agent]
        await owner.call("collaborator.remove", collaborator_id=added["id"], **ws)
        await bob.call("message.send", scope_id=w.strand, content="bob after removal", **ws)
        await owner.call("message.send", scope_id=w.strand, content="owner 3", **ws)
        assert await _next_message(scout) == "@scout over to you"
        assert await _next_message(scout) == "owner 3"
        assert await _history(scout, w.strand, ws) == [
            "@scout summarize this", "owner 2", "scout output", "bob as collaborator", "@scout over to you",
            "owner 3"]

    # A reconnecting agent replays exactly the same set.
    async with as_key(app, w.private_key) as scout:
        await scout.call("subscribe", scopes=[{"scope_id": w.strand, "after_seq": 0}], **ws)
        assert [await _next_message(scout) for _ in range(6)] == [
            "@scout summarize this", "owner 2", "scout output", "bob as collaborator", "@scout over to you",
            "owner 3"]


async def test_the_board_channels_collaborators_are_inherited_and_no_sibling_strand_is_entered(
        app: App, world: Board):
    w, ws = world, world.ws
    async with (await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as bob,
                as_key(app, w.private_key) as scout):
        sibling = await owner.call("strand.create", board_id=w.board, title="Another task", **ws)
        await owner.call("message.send", scope_id=w.strand, content="@scout join", **ws)
        await owner.call("message.send", scope_id=sibling["id"], content="owner in the sibling", **ws)
        # Admission into one strand is not admission into its sibling.
        await expect_error("not_found", scout.call("message.history", scope_id=sibling["id"], **ws))

        channel_grant = await owner.call("collaborator.add", scope_id=w.channel, member_id=w.bob.member_id,
                                         confirm_channel=True, no_expiry=True, **ws)
        listed = (await owner.call("collaborator.list", scope_id=w.strand, **ws))["collaborators"]
        assert [(c["id"], c["source"]) for c in listed] == [(channel_grant["id"], "inherited")]
        # The channel's collaborator is one on the strand too, computed at read time: no row copied.
        assert await _executions(app, w.strand) == []
        await bob.call("message.send", scope_id=w.strand, content="bob via the channel", **ws)
        assert await _history(scout, w.strand, ws) == ["@scout join", "bob via the channel"]


async def test_leaving_the_board_channel_or_archiving_the_strand_closes_it_to_the_private_agent(
        app: App, world: Board):
    w, ws = world, world.ws
    async with await signed_in(app, w.owner) as owner, as_key(app, w.private_key) as scout:
        await owner.call("message.send", scope_id=w.strand, content="@scout start", **ws)
        assert await _history(scout, w.strand, ws) == ["@scout start"]
        await owner.call("strand.archive", strand_id=w.strand, **ws)
        # Agents lose an archived strand (SPEC §5 decision 11): nothing readable, nothing written.
        assert await _history(scout, w.strand, ws) == []
        await expect_error("conflict", scout.call("message.send", scope_id=w.strand, content="late", **ws))
        error = await expect_error("conflict", owner.call("collaborator.add", scope_id=w.strand,
                                                          member_id=w.bob.member_id, **ws))
        assert error.details["reason"] == "scope_archived"
        assert await _executions(app, w.strand) == []  # the refused add left no execution behind
        await owner.call("strand.restore", strand_id=w.strand, **ws)
        assert await _history(scout, w.strand, ws) == ["@scout start"]
        # Removed from the board channel, its admission grants nothing any more.
        await owner.call("scope.remove", scope_id=w.channel, member_id=w.private_agent, **ws)
        assert await _history(scout, w.strand, ws) == []
        await owner.call("message.send", scope_id=w.strand, content="@scout still there?", **ws)
        assert await _history(scout, w.strand, ws) == []
