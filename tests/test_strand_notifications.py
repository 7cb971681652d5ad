"""Who hears of what happens in a strand (issue 16; strand-message.md §7.1,
§8.2, §8.7, §9.4.2) over the WebSocket against PostgreSQL, read from each
member's routed feed (`delivery.list`, the durable record): watch levels and
the implicit `participating` of assignees and authors, `muted` above
everything, one delivery per member and message listing every reason, the
notification state, the assignment activity, a member who left the channel,
and no rows at all for an ordinary message nobody watches."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import trio

from storage.bridge import Database, PoolSettings
from storage.errors import DatabaseUnavailable

from tests.conftest import App, add_person
from tests.db_faults import LOCK_HOLDER, release_locks, wait_for_query
from tests.test_collaborators import team  # noqa: F401  (a fixture)
from tests.test_protocol_boundary import no_error_logs  # noqa: F401  (a fixture)
from tests.test_routed_delivery import feed, routed_rows
from tests.test_strand_watch import strand_room
from tests.test_tenancy import signed_in

pytestmark = pytest.mark.usefixtures("no_error_logs")

READERS = ("owner", "bob", "carol", "adam", "vera")


async def notes(conns: dict, ws: dict, after: dict[str, int] | None = None) -> dict[str, list[tuple]]:
    """Each reader's deliveries (after the seq in `after`): (message id, reason, reasons, push)."""
    out = {}
    for who in READERS:
        entries = [d for d in await feed(conns[who], ws) if d["delivery_seq"] > (after or {}).get(who, 0)]
        out[who] = [(d.get("message_id"), d["reason"], d.get("reasons", []), d["push"]) for d in entries]
    return out


async def heads(conns: dict, ws: dict) -> dict[str, int]:
    return {who: max([d["delivery_seq"] for d in await feed(conns[who], ws)], default=0) for who in READERS}


def nothing(**who: list) -> dict[str, list]:
    return {name: who.get(name, []) for name in READERS}


async def test_watch_levels_and_mentions(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        send = lambda who, text: conns[who].call("message.send", scope_id=sid, content=text, **ws)  # noqa: E731
        await conns["bob"].call("strand.watch.set", strand_id=sid, level="all", **ws)
        await conns["carol"].call("strand.watch.set", strand_id=sid, level="participating", **ws)
        await conns["vera"].call("strand.watch.set", strand_id=sid, level="muted", **ws)
        first = await send("owner", "an ordinary message")
        # watch all / participating hear of every message of others; mentions_only (adam) and muted do not.
        assert await notes(conns, ws) == nothing(bob=[(first["id"], "watch", ["watch"], True)],
                                                 carol=[(first["id"], "watch", ["watch"], True)])
        mark = await heads(conns, ws)
        by_bob = await send("bob", "@bob talking to myself")
        # The author never hears of their own message; the owner participates now (they posted).
        assert await notes(conns, ws, mark) == nothing(owner=[(by_bob["id"], "watch", ["watch"], True)],
                                                       carol=[(by_bob["id"], "watch", ["watch"], True)])
        mark = await heads(conns, ws)
        mentioned = await send("owner", "@adam @bob @vera please look")
        # mentions_only hears of a mention; a watcher mentioned gets one delivery with both reasons;
        # muted silences the mention too.
        assert await notes(conns, ws, mark) == nothing(
            bob=[(mentioned["id"], "mention", ["mention", "watch"], True)],
            carol=[(mentioned["id"], "watch", ["watch"], True)],
            adam=[(mentioned["id"], "mention", ["mention"], True)])
        # One delivery per member and message: the dedupe keys are unique.
        for who in READERS:
            keys = [d["dedupe_key"] for d in await feed(conns[who], ws)]
            assert len(keys) == len(set(keys)), (who, keys)


async def test_implicit_participation_and_muted(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        send = lambda who, text: conns[who].call("message.send", scope_id=sid, content=text, **ws)  # noqa: E731
        owner = conns["owner"]
        # Assignment notifies the assignee (an activity) and makes them participate; not self-assignment.
        assigned = await owner.call("strand.assign", strand_id=sid, member_id=ids["adam"], **ws)
        await owner.call("strand.assign", strand_id=sid, member_id=ids["owner"], **ws)
        activity = [d for d in await feed(conns["adam"], ws)]
        assert [(d["reason"], d["kind"], d["activity"]["activity_type"], d["activity"]["payload"]["assignment_id"],
                 d["push"]) for d in activity] == [("assignment", "activity", "strand.assigned",
                                                   assigned["assignment_id"], True)]
        assert activity[0]["dedupe_key"].startswith("activity:")
        assert await feed(owner, ws) == []
        # A muted member is assigned silently, and stays silent.
        await conns["vera"].call("strand.watch.set", strand_id=sid, level="muted", **ws)
        await owner.call("strand.assign", strand_id=sid, member_id=ids["vera"], **ws)
        assert await feed(conns["vera"], ws) == []
        mark = await heads(conns, ws)
        by_bob = await send("bob", "bob starts")
        # The assignees participate: adam hears; the owner (assigned too) hears; vera is muted.
        assert await notes(conns, ws, mark) == nothing(owner=[(by_bob["id"], "watch", ["watch"], True)],
                                                       adam=[(by_bob["id"], "watch", ["watch"], True)])
        mark = await heads(conns, ws)
        by_carol = await send("carol", "carol joins")
        # Bob posted: he participates from now on (no explicit watch needed).
        assert await notes(conns, ws, mark) == nothing(owner=[(by_carol["id"], "watch", ["watch"], True)],
                                                       bob=[(by_carol["id"], "watch", ["watch"], True)],
                                                       adam=[(by_carol["id"], "watch", ["watch"], True)])
        # An explicit muted overrides an assignment and a mention; mentions_only does not undo participating.
        await conns["adam"].call("strand.watch.set", strand_id=sid, level="muted", **ws)
        await conns["bob"].call("strand.watch.set", strand_id=sid, level="mentions_only", **ws)
        mark = await heads(conns, ws)
        loud = await send("owner", "@adam @vera wake up")
        assert await notes(conns, ws, mark) == nothing(bob=[(loud["id"], "watch", ["watch"], True)],
                                                       carol=[(loud["id"], "watch", ["watch"], True)])


async def test_a_withdrawn_only_message_ends_implicit_participation(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        send = lambda who, text: conns[who].call("message.send", scope_id=sid, content=text, **ws)  # noqa: E731
        only = await send("carol", "a message carol regrets")
        twice = [await send("bob", "bob one"), await send("bob", "bob two")]
        mark = await heads(conns, ws)
        await conns["carol"].call("message.withdraw", message_id=only["id"], **ws)
        await conns["bob"].call("message.withdraw", message_id=twice[0]["id"], **ws)
        after = await send("owner", "after the withdrawals")
        # Bob still has a visible message: he participates; carol's only one is gone: she does not.
        assert await notes(conns, ws, mark) == nothing(bob=[(after["id"], "watch", ["watch"], True)])


async def test_notification_state_and_leaving_the_channel(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        send = lambda who, text: conns[who].call("message.send", scope_id=sid, content=text, **ws)  # noqa: E731
        for who in ("bob", "carol", "adam"):
            await conns[who].call("strand.watch.set", strand_id=sid, level="all", **ws)
        await conns["bob"].call("notification.set", scope_id=sid, state="quiet", **ws)
        await conns["carol"].call("notification.set", scope_id=sid, state="mute", **ws)
        await conns["adam"].call("notification.set", scope_id=sid, state="no-wake", **ws)
        quiet = await send("owner", "@bob @carol @adam for the watchers")
        # quiet: recorded, not pushed; mute and no-wake: nothing, mentions included.
        assert await notes(conns, ws) == nothing(bob=[(quiet["id"], "mention", ["mention", "watch"], False)])
        await conns["owner"].call("scope.remove", scope_id=ids["channel"], member_id=ids["bob"], **ws)
        mark = await heads(conns, ws)
        await conns["carol"].call("notification.set", scope_id=sid, state="active", **ws)
        after = await send("owner", "@bob after bob left")
        # Bob left the channel: he reads the strand no more, so nothing reaches him, watch or mention.
        assert await notes(conns, ws, mark) == nothing(carol=[(after["id"], "watch", ["watch"], True)])


async def test_ordinary_messages_nobody_watches_write_no_rows(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        for number in range(20):
            await conns["owner"].call("message.send", scope_id=sid, content=f"note {number}", **ws)
        # Only the author participates and nobody watches: no delivery, no routed outbox row.
        assert await routed_rows(app) == (0, 0)
        await conns["bob"].call("strand.watch.set", strand_id=sid, level="all", **ws)
        await conns["owner"].call("message.send", scope_id=sid, content="now bob watches", **ws)
        assert await routed_rows(app) == (1, 1)


async def test_assignment_under_notification_states_and_unassignment(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        owner = conns["owner"]
        await conns["bob"].call("notification.set", scope_id=sid, state="quiet", **ws)
        await conns["carol"].call("notification.set", scope_id=sid, state="mute", **ws)
        await conns["adam"].call("notification.set", scope_id=sid, state="no-wake", **ws)
        assignments = {who: (await owner.call("strand.assign", strand_id=sid, member_id=ids[who], **ws))
                       for who in ("bob", "carol", "adam", "vera")}
        # quiet: recorded without a push; mute and no-wake: nothing; active (vera): pushed.
        got = {who: [(d["reason"], d["push"]) for d in await feed(conns[who], ws)] for who in READERS}
        assert got == nothing(bob=[("assignment", False)], vera=[("assignment", True)])
        mark = await heads(conns, ws)
        first = await owner.call("message.send", scope_id=sid, content="for the assignees", **ws)
        assert await notes(conns, ws, mark) == nothing(bob=[(first["id"], "watch", ["watch"], False)],
                                                       vera=[(first["id"], "watch", ["watch"], True)])
        # An ended assignment no longer makes vera participate (she never posted).
        await owner.call("strand.unassign", strand_id=sid, assignment_id=assignments["vera"]["assignment_id"], **ws)
        mark = await heads(conns, ws)
        second = await owner.call("message.send", scope_id=sid, content="after the unassignment", **ws)
        assert await notes(conns, ws, mark) == nothing(bob=[(second["id"], "watch", ["watch"], False)])


async def test_a_member_who_joins_the_channel_later_is_notified(app: App, team, member_password_hash):  # noqa: F811
    alpha, _ = team
    dave = await add_person(app.db, alpha.workspace_id, "dave@example.com", "developer", member_password_hash)
    async with strand_room(app, team) as (conns, ids, sid, ws), await signed_in(app, dave) as d:
        await conns["owner"].call("message.send", scope_id=sid, content="before dave", **ws)
        await conns["owner"].call("scope.invite", scope_id=ids["channel"], member_ids=[dave.member_id], **ws)
        mentioned = await conns["bob"].call("message.send", scope_id=sid, content="@dave welcome", **ws)
        await d.call("strand.watch.set", strand_id=sid, level="all", **ws)
        watched = await conns["bob"].call("message.send", scope_id=sid, content="dave watches now", **ws)
        assert [(x["message_id"], x["reason"]) for x in await feed(d, ws)] == [
            (mentioned["id"], "mention"), (watched["id"], "watch")]


async def test_a_first_message_counts_for_the_next_one_in_the_same_batch(app: App, team, database_dsn):  # noqa: F811
    """Two messages the strand's actor commits in one transaction: the first one's author
    participates for the second (seq order is the order of §8.7, not the batch's)."""
    async with strand_room(app, team) as (conns, ids, sid, ws), \
            Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as admin:
        sent: dict[str, dict] = {}
        async with trio.open_nursery() as tasks:
            async def hold(conn):
                await conn.execute("SELECT 1 FROM strands WHERE scope_id = $1 FOR UPDATE", sid)
                await conn.execute("SELECT pg_sleep(60)")

            async def holder():
                with contextlib.suppress(DatabaseUnavailable):
                    await admin.transaction(hold)

            async def send(who: str, text: str) -> None:
                sent[who] = await conns[who].call("message.send", scope_id=sid, content=text, **ws)

            tasks.start_soon(holder)
            await wait_for_query(admin, LOCK_HOLDER)
            # A stage write waits on the held row inside the actor's batch: what follows queues up.
            tasks.start_soon(partial(conns["owner"].call, "strand.stage.set", strand_id=sid, stage="draft", **ws))
            await wait_for_query(admin, "wait_event_type = 'Lock' AND query LIKE '%FROM strands st%FOR UPDATE%'")
            for depth, (who, text) in enumerate((("carol", "carol's first"), ("bob", "bob answers")), start=1):
                tasks.start_soon(send, who, text)
                with trio.fail_after(20):  # a precondition: the sends wait in the mailbox, in this order
                    while sum(app.server.registry.mailbox_depths()) < depth:
                        await trio.sleep(0.01)
            await release_locks(admin)
        assert (sent["carol"]["seq"], sent["bob"]["seq"]) == (1, 2)
        assert await notes(conns, ws) == nothing(carol=[(sent["bob"]["id"], "watch", ["watch"], True)])


async def test_watching_agents_hear_only_of_humans_so_they_cannot_wake_each_other(app: App, team):  # noqa: F811
    async with strand_room(app, team, agents=("scout", "herald")) as (conns, ids, sid, ws):
        for handle in ("scout", "herald"):
            await conns[handle].call("strand.watch.set", strand_id=sid, level="all", **ws)
        by_scout = await conns["scout"].call("message.send", scope_id=sid, content="status: green", **ws)
        by_owner = await conns["owner"].call("message.send", scope_id=sid, content="thanks", **ws)
        for handle in ("scout", "herald"):
            entries = [(d.get("message_id"), d["reason"]) for d in await feed(conns[handle], ws)]
            # The human's message wakes both watching agents; an agent's message wakes no agent.
            assert entries == [(by_owner["id"], "watch")], (handle, entries)
        # A human watcher still hears of the agent's message.
        await conns["bob"].call("strand.watch.set", strand_id=sid, level="all", **ws)
        again = await conns["herald"].call("message.send", scope_id=sid, content="status: amber", **ws)
        assert [(d.get("message_id"), d["reason"]) for d in await feed(conns["bob"], ws)] == [(again["id"], "watch")]
        assert by_scout["seq"] == 1
