"""Strand watches (issue 16; strand-message.md §8.3-§8.6) over the WebSocket
against PostgreSQL: the whole-value compare-and-set of `strand.watch.set`,
writing another member's watch (`.others`: owners and admins, never muted nor
published, audited in the same transaction, overridable by the watcher), the
watcher list each viewer may see (`strand.watchers`, its audited full read),
and who hears of a watch change (`strand.watch.changed`: the watcher and the
writer only)."""

from __future__ import annotations

import contextlib

import pytest
import trio

from tests.conftest import App
from tests.test_collaborators import team  # noqa: F401  (a fixture)
from tests.test_messaging import open_channel
from tests.test_private_visibility import as_agent
from tests.test_protocol_boundary import no_error_logs  # noqa: F401  (a fixture)
from tests.test_tenancy import expect_error, signed_in

# Every refusal here is a client error: nothing logs at error level.
pytestmark = pytest.mark.usefixtures("no_error_logs")

EVENT_BOUND = 20  # seconds a pushed event may take on a busy machine


@contextlib.asynccontextmanager
async def strand_room(app: App, team, *, agents: tuple[str, ...] = ()):  # noqa: F811
    """The team signed in (owner, bob developer, carol operator, adam admin, vera viewer),
    a channel all of them (and the public agents named by `agents`) belong to, a board and
    a strand on it.  Yields (conns by name, ids by name, strand id, ws)."""
    alpha, people = team
    ws = {"workspace_id": alpha.workspace_id}
    names = ("bob", "carol", "adam", "vera")
    async with contextlib.AsyncExitStack() as stack:
        owner = await stack.enter_async_context(await signed_in(app, alpha.owner))
        conns = {"owner": owner}
        ids = {"owner": alpha.owner.member_id}
        for name in names:
            conns[name] = await stack.enter_async_context(await signed_in(app, people[name]))
            ids[name] = people[name].member_id
        keys = {}
        for handle in agents:
            agent = await owner.call("agent.create", handle=handle, display_name=handle.title(), visibility="public",
                                     **ws)
            ids[handle] = agent["id"]
            keys[handle] = (await owner.call("apikey.create", name=handle, member_id=agent["id"], **ws))["key"]
        channel = await open_channel(owner, alpha.workspace_id, "work",
                                     [ids[n] for n in names] + [ids[h] for h in agents])
        ids["channel"] = channel["id"]
        for handle in agents:
            conns[handle] = await stack.enter_async_context(as_agent(app, keys[handle]))
        board = await owner.call("board.create", channel_id=channel["id"], name="Sprint", **ws)
        strand = await owner.call("strand.create", board_id=board["id"], title="Payments", **ws)
        yield conns, ids, strand["id"], ws


async def audit_rows(app: App, scope_id: str, action: str) -> list[tuple]:
    rows = await app.db.run(lambda conn: conn.fetch(
        "SELECT actor_member_id, target_member_id, details FROM strand_audit_events "
        "WHERE scope_id = $1 AND action = $2 ORDER BY created_at, id", scope_id, action))
    return [(r["actor_member_id"], r["target_member_id"]) for r in rows]


async def watch_row(app: App, scope_id: str, member_id: str):
    return await app.db.run(lambda conn: conn.fetchrow(
        "SELECT level, level_public, revision, written_by_member_id FROM strand_watches "
        "WHERE scope_id = $1 AND watcher_member_id = $2", scope_id, member_id))


async def refused(code: str, reason: str, coro) -> None:
    error = await expect_error(code, coro)
    assert error.details["reason"] == reason, error


# --- §8.3: whole-value compare-and-set --------------------------------------------------------------------

async def test_watch_set_is_a_whole_value_compare_and_set(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        bob = conns["bob"]
        watch = lambda **kw: bob.call("strand.watch.set", strand_id=sid, **kw, **ws)  # noqa: E731
        assert await bob.call("strand.watch.get", strand_id=sid, **ws) == {"status": "never_written"}
        # Never written: expected_value may be omitted (and a non-null guess is refused).
        await refused("conflict", "failed_precondition", watch(level="all", expected_value={"level": "all"}))
        first = await watch(level="participating")
        assert first == {"status": "current", "revision": 1, "value": {"level": "participating"}}
        # Written: omitting expected_value is never an unconditional overwrite; a wrong guess neither.
        await refused("conflict", "failed_precondition", watch(level="all"))
        await refused("conflict", "failed_precondition", watch(level="all", expected_value=None))
        await refused("conflict", "failed_precondition", watch(level="all", expected_value={"level": "all"}))
        published = await watch(level="all", level_public=True, expected_value={"level": "participating"})
        assert published == {"status": "current", "revision": 2, "value": {"level": "all", "level_public": True}}
        # {level: all, level_public: true} is matched whole: a part of it is another value.
        for partial in ({"level": "all"}, {"level": "all", "level_public": False}):
            await refused("conflict", "failed_precondition", watch(level="muted", expected_value=partial))
        assert (await bob.call("strand.get", strand_id=sid, **ws))["my_watch"] == {"level": "all", "level_public": True}
        cleared = await watch(level=None, expected_value={"level": "all", "level_public": True})
        assert cleared["status"] == "current" and cleared["revision"] == 3 and cleared.get("value") is None
        # A cleared watch is a current value `null`, never `never_written`.
        got = await bob.call("strand.watch.get", strand_id=sid, **ws)
        assert got["status"] == "current" and got["revision"] == 3 and got.get("value") is None
        assert "my_watch" not in await bob.call("strand.get", strand_id=sid, **ws)
        await refused("conflict", "failed_precondition", watch(level="all"))
        await refused("conflict", "failed_precondition", watch(level="all", expected_value={"level": "all"}))
        again = await watch(level="mentions_only", expected_value=None)
        assert again == {"status": "current", "revision": 4, "value": {"level": "mentions_only"}}
        row = await watch_row(app, sid, ids["bob"])
        assert (row["level"], row["level_public"], row["revision"]) == ("mentions_only", None, 4)
        # Another member's exact watch is their own: carol's stays never written.
        assert await conns["carol"].call("strand.watch.get", strand_id=sid, **ws) == {"status": "never_written"}


async def test_malformed_watch_writes_are_typed_errors(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        bob = conns["bob"]
        watch = lambda **kw: bob.call("strand.watch.set", strand_id=sid, **kw, **ws)  # noqa: E731
        await expect_error("bad_frame", watch(level="loud"))
        await refused("invalid", "schema_violation", watch(level=None, level_public=True))
        for bad in ({"level": "all", "extra": 1}, {"level_public": True}, {"level": "loud"},
                    {"level": "all", "level_public": "yes"}):
            await refused("invalid", "schema_violation", watch(level="all", expected_value=bad))
        for bad in ("all", [1]):
            await expect_error("bad_frame", watch(level="all", expected_value=bad))
        # A scope that is no strand (the channel itself) is not found.
        await expect_error("not_found", bob.call("strand.watch.set", strand_id=ids["channel"], level="all", **ws))
        # Nothing was written by any of them.
        assert await watch_row(app, sid, ids["bob"]) is None


# --- §8.4: writing another member's watch --------------------------------------------------------------------

async def test_writing_another_members_watch(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        bob, carol, adam, owner = conns["bob"], conns["carol"], conns["adam"], conns["owner"]
        others = lambda conn, who, **kw: conn.call("strand.watch.set", strand_id=sid,  # noqa: E731
                                                   watcher_member_id=ids[who], **kw, **ws)
        # Not an owner or admin: only your own watch.
        await refused("conflict", "watch_must_be_self", others(bob, "carol", level="all"))
        await refused("conflict", "watch_must_be_self", others(conns["vera"], "bob", level="participating"))
        # An admin never mutes nor publishes another member.
        await refused("conflict", "failed_precondition", others(adam, "bob", level="muted"))
        await refused("conflict", "failed_precondition", others(adam, "bob", level="all", level_public=True))
        assert await watch_row(app, sid, ids["bob"]) is None
        assert await audit_rows(app, sid, "watch_set_others") == []
        # participating / all (level_public omitted or false) are allowed, each with its audit row.
        written = await others(adam, "bob", level="participating")
        assert written == {"status": "current", "revision": 1, "value": {"level": "participating"}}
        assert await audit_rows(app, sid, "watch_set_others") == [(ids["adam"], ids["bob"])]
        assert (await watch_row(app, sid, ids["bob"]))["written_by_member_id"] == ids["adam"]
        # The compare-and-set binds an admin as anyone: the watch exists now.
        await refused("conflict", "failed_precondition", others(owner, "bob", level="all"))
        await others(owner, "bob", level="all", level_public=False, expected_value={"level": "participating"})
        await others(owner, "carol", level="all")
        assert await audit_rows(app, sid, "watch_set_others") == [
            (ids["adam"], ids["bob"]), (ids["owner"], ids["bob"]), (ids["owner"], ids["carol"])]
        # A member who does not read the strand cannot be watched for: not revealed.
        outsider = (await owner.call("agent.create", handle="outsider", display_name="Out", visibility="public",
                                     **ws))["id"]
        await expect_error("not_found", owner.call("strand.watch.set", strand_id=sid, watcher_member_id=outsider,
                                                   level="all", **ws))
        # The watcher overrides whatever was written for them: mute, publish, clear; no audit row for that.
        mine = await bob.call("strand.watch.get", strand_id=sid, **ws)
        assert mine == {"status": "current", "revision": 2, "value": {"level": "all", "level_public": False}}
        muted = await bob.call("strand.watch.set", strand_id=sid, level="muted", level_public=True,
                               expected_value=mine["value"], **ws)
        assert muted["value"] == {"level": "muted", "level_public": True}
        await carol.call("strand.watch.set", strand_id=sid, level=None, expected_value={"level": "all"}, **ws)
        # An admin's own watch is no .others write either.
        await adam.call("strand.watch.set", strand_id=sid, level="all", **ws)
        assert len(await audit_rows(app, sid, "watch_set_others")) == 3
        # Writing for another never reveals their muted state through a silent success: still CAS-bound.
        await refused("conflict", "failed_precondition", others(adam, "bob", level="all",
                                                                expected_value={"level": "all"}))


# --- §8.5-§8.6: who sees which watch ------------------------------------------------------------------------

def listed(answer: dict) -> dict[str, tuple]:
    return {w["member_id"]: (w["level"], w.get("level_public")) for w in answer["watchers"]}


async def test_the_watcher_list_each_viewer_sees(app: App, team):  # noqa: F811
    async with strand_room(app, team, agents=("helper", "sleeper")) as (conns, ids, sid, ws):
        own = lambda who, **kw: conns[who].call("strand.watch.set", strand_id=sid, **kw, **ws)  # noqa: E731
        await own("bob", level="all", level_public=True)          # published: everyone sees it
        await own("carol", level="participating")                  # private: only carol
        await own("vera", level="muted", level_public=True)        # muted: only vera, published or not
        await own("adam", level="mentions_only", level_public=True)  # mentions_only is "not subscribed"
        await own("helper", level="participating")                 # an agent's level is public without opt-in
        await own("sleeper", level="muted")                        # ... but never muted
        await own("owner", level="all", level_public=False)
        watchers = lambda who, **kw: conns[who].call("strand.watchers", strand_id=sid, **kw, **ws)  # noqa: E731
        public = {ids["bob"]: ("all", True), ids["helper"]: ("participating", None)}
        assert listed(await watchers("bob")) == public
        assert listed(await watchers("carol")) == {**public, ids["carol"]: ("participating", None)}
        assert listed(await watchers("vera")) == {**public, ids["vera"]: ("muted", True)}
        assert listed(await watchers("adam")) == public
        assert listed(await watchers("sleeper")) == {**public, ids["sleeper"]: ("muted", None)}
        assert listed(await watchers("owner")) == {**public, ids["owner"]: ("all", False)}
        # A cleared watch is not listed either, even to its watcher.
        await own("carol", level=None, expected_value={"level": "participating"})
        assert listed(await watchers("carol")) == public
        assert await audit_rows(app, sid, "watch_audit_read") == []
        # The full list is an audited read for owners and admins only.
        for who in ("bob", "carol", "vera", "helper"):
            await refused("forbidden", "audit_capability_incomplete", watchers(who, audit=True))
        assert await audit_rows(app, sid, "watch_audit_read") == []
        full = {ids["bob"]: ("all", True), ids["vera"]: ("muted", True), ids["adam"]: ("mentions_only", True),
                ids["helper"]: ("participating", None), ids["sleeper"]: ("muted", None),
                ids["owner"]: ("all", False)}
        assert listed(await watchers("owner", audit=True)) == full
        assert listed(await watchers("adam", audit=True)) == full
        assert await audit_rows(app, sid, "watch_audit_read") == [(ids["owner"], None), (ids["adam"], None)]
        # Access comes before watching (§8.9): a member who left the channel no longer reads the strand,
        # is no watcher in the list anyone sees, and does not learn the strand exists.
        await conns["owner"].call("scope.remove", scope_id=ids["channel"], member_id=ids["bob"], **ws)
        assert listed(await watchers("carol")) == {ids["helper"]: ("participating", None)}
        await expect_error("not_found", watchers("bob"))
        await expect_error("not_found", conns["bob"].call("strand.watch.get", strand_id=sid, **ws))
        # The audited read is the full stored state: the departed member's watch included.
        assert listed(await watchers("owner", audit=True)) == full


# --- who hears of a watch change ---------------------------------------------------------------------------

async def next_named(conn, names: tuple[str, ...]) -> dict:
    with trio.fail_after(EVENT_BOUND):
        while True:
            event = await conn.next_event()
            if event["event"] in names:
                return event


async def test_a_watch_change_reaches_only_the_watcher_and_the_writer(app: App, team):  # noqa: F811
    async with strand_room(app, team) as (conns, ids, sid, ws):
        readers = ("owner", "bob", "carol", "adam")
        for who in readers:
            await conns[who].call("subscribe", scopes=[{"scope_id": sid}], **ws)
        names = ("strand.watch.changed", "strand.changed")
        await conns["adam"].call("strand.watch.set", strand_id=sid, watcher_member_id=ids["bob"],
                                 level="participating", **ws)
        await conns["bob"].call("strand.watch.set", strand_id=sid, level="muted",
                                expected_value={"level": "participating"}, **ws)
        # A change every reader hears of is the barrier after which nothing else may arrive.
        await conns["owner"].call("strand.stage.set", strand_id=sid, stage="draft", **ws)
        seen = {}
        for who in readers:
            events = []
            while True:
                event = await next_named(conns[who], names)
                if event["event"] == "strand.changed":
                    break
                events.append(event)
            seen[who] = [(e["data"]["watcher_member_id"], e["data"]["revision"], e["data"].get("value"))
                         for e in events]
            assert all(e["scope_id"] == sid for e in events)
        assert seen == {
            "owner": [],
            "bob": [(ids["bob"], 1, {"level": "participating"}), (ids["bob"], 2, {"level": "muted"})],
            "carol": [],
            "adam": [(ids["bob"], 1, {"level": "participating"})],
        }
