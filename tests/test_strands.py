"""Strands over the WebSocket against PostgreSQL (issue 16): the task authority's
fail-closed, non-enumerating matrix on every surface (collaborator-policy §4.2.1,
SPEC §5.1), the seed's normative vectors for tracks, synthesis, fields, stage and
the default strand (strand-message.md §2-§4), idempotent creation, version CAS,
typed errors for every bad input of the strand ops, and the stage compare-and-set
under concurrency."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import pytest
import trio

from client import ClientError, connect
from domain.strands import RESERVED_FIELDS
from storage.bridge import Database, PoolSettings
from storage.errors import DatabaseUnavailable
from storage.ids import new_id
from storage.visibility.tasks import task_readers
from tests.conftest import App, Person, add_person
from tests.db_faults import LOCK_HOLDER, release_locks, wait_for_query
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in


@dataclass
class Board:
    """Alpha's owner and Bob in channel `work` (with a public and a private agent),
    a board there, one strand with one message by Bob; Carol is in the workspace but
    not in the channel; channel `other` has the owner and Bob."""

    ws: dict
    owner: Person
    bob: Person
    carol: Person
    channel: str
    other_channel: str
    board: str
    strand: str
    message: str
    public_key: str
    public_agent: str
    private_key: str
    private_agent: str


@pytest.fixture
async def world(app: App, tenants, member_password_hash) -> Board:
    alpha, _ = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        public = await owner.call("agent.create", handle="herald", display_name="Herald", visibility="public", **ws)
        private = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "work", [bob.member_id, public["id"], private["id"]])
        other = await open_channel(owner, alpha.workspace_id, "other", [bob.member_id])
        public_key = (await owner.call("apikey.create", name="herald", member_id=public["id"], **ws))["key"]
        private_key = (await owner.call("apikey.create", name="scout", member_id=private["id"], **ws))["key"]
        board = await owner.call("board.create", channel_id=channel["id"], name="Sprint", **ws)
        strand = await owner.call("strand.create", board_id=board["id"], title="Pay the bills", **ws)
        message = await b.call("message.send", scope_id=strand["id"], content="hello", **ws)
    return Board(ws, alpha.owner, bob, carol, channel["id"], other["id"], board["id"], strand["id"], message["id"],
                 public_key, public["id"], private_key, private["id"])


@contextlib.asynccontextmanager
async def as_key(app: App, key: str):
    async with connect(app.url) as conn:
        await conn.auth(api_key=key)
        yield conn


def _set(value) -> dict:
    return {"$op": "set", "value": value}


def _outcome(exc: ClientError) -> tuple:
    return exc.code, exc.message, tuple(sorted(exc.details.items()))


async def _watch_expectation(app: App, strand_id: str, member_id: str) -> dict:
    """strand.watch.set's compare-and-set argument for a member (read from the DB, so
    the probe itself needs no read access)."""
    row = await app.db.run(lambda c: c.fetchrow(
        "SELECT level, level_public FROM strand_watches WHERE scope_id = $1 AND watcher_member_id = $2",
        strand_id, member_id))
    if row is None:
        return {}
    value = None if row["level"] is None else {"level": row["level"]}
    if value is not None and row["level_public"] is not None:
        value["level_public"] = row["level_public"]
    return {"expected_value": value}


async def probe(app: App, conn, ws: dict, member_id: str, strand_id: str, message_id: str) -> dict[str, object]:
    """Every surface that meets a task scope: 'ok', or the whole error (code, message, details)."""
    outcomes: dict[str, object] = {}

    async def attempt(name: str, call) -> None:
        try:
            await call
            outcomes[name] = "ok"
        except ClientError as exc:
            outcomes[name] = _outcome(exc)

    await attempt("strand.get", conn.call("strand.get", strand_id=strand_id, **ws))
    await attempt("message.history", conn.call("message.history", scope_id=strand_id, **ws))
    await attempt("message.get", conn.call("message.get", message_id=message_id, **ws))
    await attempt("subscribe", conn.call("subscribe", scopes=[{"scope_id": strand_id}], **ws))
    await attempt("message.send", conn.call("message.send", scope_id=strand_id, content="probe", **ws))
    await attempt("reaction.add", conn.call("reaction.add", message_id=message_id, key=":eyes:", **ws))
    await attempt("read.mark", conn.call("read.mark", scope_id=strand_id, seq=1, **ws))
    await attempt("strand.watch.set", conn.call("strand.watch.set", strand_id=strand_id, level="all", **ws,
                                                **await _watch_expectation(app, strand_id, member_id)))
    await attempt("strand.assign", conn.call("strand.assign", strand_id=strand_id, member_id=member_id, **ws))
    try:
        inbox = await conn.call("inbox.list", **ws)
        listed = strand_id in [c["scope_id"] for c in inbox["conversations"]]
        outcomes["inbox.list"] = "listed" if listed else "absent"
    except ClientError as exc:
        outcomes["inbox.list"] = _outcome(exc)
    return outcomes


READS = {name: "ok" for name in ("strand.get", "message.history", "message.get", "subscribe", "message.send",
                                 "reaction.add", "read.mark", "strand.watch.set", "strand.assign")} | {
    "inbox.list": "listed"}


async def assert_hidden(app: App, conn, ws: dict, member_id: str, strand_id: str, message_id: str) -> None:
    """No surface reveals the strand: every answer is not_found, exactly what a random
    well-formed id gets, the Inbox does not list it, and nothing was written."""
    before = await snapshot(app, strand_id)
    seen = await probe(app, conn, ws, member_id, strand_id, message_id)
    unknown = await probe(app, conn, ws, member_id, new_id("scp"), new_id("msg"))
    assert await snapshot(app, strand_id) == before
    assert seen == unknown, (seen, unknown)
    assert seen["inbox.list"] == "absent"
    assert {name: value[0] for name, value in seen.items() if name != "inbox.list"} == {
        name: "not_found" for name in READS if name != "inbox.list"}, seen


async def snapshot(app: App, strand_id: str) -> tuple:
    """Everything a refused strand request must leave as it was."""
    return await app.db.run(lambda c: c.fetchrow(
        "SELECT (SELECT row_to_json(st)::text FROM strands st WHERE st.scope_id = $1) AS strand, "
        "(SELECT count(*) FROM strands) AS strands, (SELECT count(*) FROM task_boards) AS boards, "
        "(SELECT count(*) FROM strand_watches) AS watches, (SELECT count(*) FROM strand_assignments) AS assignments, "
        "(SELECT count(*) FROM strand_audit_events) AS audit, "
        "(SELECT count(*) FROM strand_synthesis_revisions) AS revisions, "
        "(SELECT count(*) FROM scope_messages WHERE scope_id = $1) AS messages, "
        "(SELECT count(*) FROM scope_message_reactions WHERE scope_id = $1) AS reactions, "
        "(SELECT count(*) || ':' || coalesce(sum(last_read_seq), 0) FROM scope_memberships "
        "WHERE scope_id = $1) AS participants, "
        "(SELECT count(*) FROM workspace_default_strands) AS defaults", strand_id))


# --- the task authority (collaborator-policy §4.2.1) ------------------------------------------------------

async def test_a_channel_member_reads_and_writes_on_every_surface_and_an_outsider_sees_nothing(app: App, world):
    w = world
    async with await signed_in(app, w.bob) as b, await signed_in(app, w.carol) as c:
        assert await probe(app, b, w.ws, w.bob.member_id, w.strand, w.message) == READS
        await assert_hidden(app, c, w.ws, w.carol.member_id, w.strand, w.message)
        # The board too: another channel's board answers like a random board id.
        for op, extra in (("strand.list", {}), ("strand.create", {"title": "spoof"})):
            spoofed = await expect_error("not_found", c.call(op, board_id=w.board, **extra, **w.ws))
            unknown = await expect_error("not_found", c.call(op, board_id=new_id("tbd"), **extra, **w.ws))
            assert _outcome(spoofed) == _outcome(unknown)
        assert (await c.call("board.list", **w.ws))["boards"] == []
        # Carol cannot be assigned, nor have her watch written: not revealed as a reader.
        async with await signed_in(app, w.owner) as owner:
            refused = await expect_error("not_found", owner.call("strand.assign", strand_id=w.strand,
                                                                 member_id=w.carol.member_id, **w.ws))
            stranger = await expect_error("not_found", owner.call("strand.assign", strand_id=w.strand,
                                                                  member_id=new_id("mem"), **w.ws))
            assert _outcome(refused) == _outcome(stranger)
            refused = await expect_error("not_found", owner.call("strand.watch.set", strand_id=w.strand, level="all",
                                                                 watcher_member_id=w.carol.member_id, **w.ws))
            stranger = await expect_error("not_found", owner.call("strand.watch.set", strand_id=w.strand, level="all",
                                                                  watcher_member_id=new_id("mem"), **w.ws))
            assert _outcome(refused) == _outcome(stranger)
    participants = await app.db.run(lambda conn: conn.fetch(
        "SELECT member_id FROM scope_memberships WHERE scope_id = $1 AND visibility = 'participant'", w.strand))
    assert w.carol.member_id not in {r["member_id"] for r in participants}


async def test_reading_one_strand_opens_no_other(app: App, world):
    """The authority is per task: reading a strand of your own channel reveals no
    strand of a channel you are not in, and many readable strands are no error."""
    w = world
    async with await signed_in(app, w.carol) as c, await signed_in(app, w.owner) as owner:
        mine = await open_channel(c, w.ws["workspace_id"], "carols", [w.owner.member_id])
        board = await c.call("board.create", channel_id=mine["id"], name="Mine", **w.ws)
        first = await c.call("strand.create", board_id=board["id"], title="One", **w.ws)
        await assert_hidden(app, c, w.ws, w.carol.member_id, w.strand, w.message)
        second = await c.call("strand.create", board_id=board["id"], title="Two", **w.ws)
        await assert_hidden(app, c, w.ws, w.carol.member_id, w.strand, w.message)
        listed = await c.call("strand.list", board_id=board["id"], **w.ws)
        assert [s["id"] for s in listed["strands"]] == [second["id"], first["id"]]
        # The owner reads both channels' strands; each list holds its own board's.
        assert [s["id"] for s in (await owner.call("strand.list", board_id=w.board, **w.ws))["strands"]] == [w.strand]
        assert (await owner.call("strand.get", strand_id=first["id"], **w.ws))["board_id"] == board["id"]


async def test_leaving_the_channel_closes_the_strand_though_the_participant_row_stays(app: App, world):
    w = world
    async with await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as b:
        await b.call("read.mark", scope_id=w.strand, seq=1, **w.ws)
        await owner.call("scope.remove", scope_id=w.channel, member_id=w.bob.member_id, **w.ws)
        row = await app.db.run(lambda conn: conn.fetchrow(
            "SELECT visibility, effective_to_seq FROM scope_memberships WHERE scope_id = $1 AND member_id = $2",
            w.strand, w.bob.member_id))
        assert (row["visibility"], row["effective_to_seq"]) == ("participant", None)  # state only: grants nothing
        await assert_hidden(app, b, w.ws, w.bob.member_id, w.strand, w.message)
        await expect_error("not_found", b.call("strand.list", board_id=w.board, **w.ws))
        # Back in the channel, back in the strand.
        await owner.call("scope.invite", scope_id=w.channel, member_ids=[w.bob.member_id], **w.ws)
        assert (await b.call("strand.get", strand_id=w.strand, **w.ws))["id"] == w.strand


async def test_a_member_removed_from_the_workspace_reads_no_strand(app: App, world, member_password_hash):
    w = world
    dave = await add_person(app.db, w.ws["workspace_id"], "dave@example.com", "developer", member_password_hash)
    async with await signed_in(app, w.owner) as owner:
        await owner.call("scope.invite", scope_id=w.channel, member_ids=[dave.member_id], **w.ws)
        async with await signed_in(app, dave) as d:
            await d.call("read.mark", scope_id=w.strand, seq=1, **w.ws)
            assert (await d.call("strand.get", strand_id=w.strand, **w.ws))["id"] == w.strand
        await owner.call("member.remove", member_id=dave.member_id, **w.ws)
        async with await signed_in(app, dave) as d:
            # The workspace itself is closed to Dave: the same answer for a real and a random strand.
            real = await expect_error("forbidden", d.call("strand.get", strand_id=w.strand, **w.ws))
            unknown = await expect_error("forbidden", d.call("strand.get", strand_id=new_id("scp"), **w.ws))
            assert _outcome(real) == _outcome(unknown)
        # Nor is Dave a reader any more: not in the strand's audience, not assignable, not a watcher.
        assert dave.member_id not in await app.db.run(task_readers, w.strand)
        refused = await expect_error("not_found", owner.call("strand.assign", strand_id=w.strand,
                                                             member_id=dave.member_id, **w.ws))
        assert _outcome(refused) == _outcome(await expect_error("not_found", owner.call(
            "strand.assign", strand_id=w.strand, member_id=new_id("mem"), **w.ws)))
        await expect_error("not_found", owner.call("strand.watch.set", strand_id=w.strand, level="all",
                                                   watcher_member_id=dave.member_id, **w.ws))


async def test_another_workspaces_strand_answers_like_a_random_id(app: App, world, tenants):
    w = world
    _, beta = tenants
    wb = {"workspace_id": beta.workspace_id}
    async with await signed_in(app, beta.owner) as owner_b:
        channel = await open_channel(owner_b, beta.workspace_id, "beta-work")
        board = await owner_b.call("board.create", channel_id=channel["id"], name="Beta", **wb)
        strand = await owner_b.call("strand.create", board_id=board["id"], title="Secret", **wb)
        message = await owner_b.call("message.send", scope_id=strand["id"], content="beta only", **wb)
    before = await snapshot(app, strand["id"])
    async with await signed_in(app, w.owner) as owner:
        await assert_hidden(app, owner, w.ws, w.owner.member_id, strand["id"], message["id"])
        # Selecting Beta's workspace (Alpha's owner is no member there) reveals no more.
        seen = await probe(app, owner, wb, w.owner.member_id, strand["id"], message["id"])
        assert seen == await probe(app, owner, wb, w.owner.member_id, new_id("scp"), new_id("msg"))
        assert {v[0] for k, v in seen.items() if k != "inbox.list"} == {"not_found"}
        for op, extra in (("strand.list", {}), ("strand.create", {"title": "spoof"})):
            spoofed = await expect_error("not_found", owner.call(op, board_id=board["id"], **extra, **w.ws))
            unknown = await expect_error("not_found", owner.call(op, board_id=new_id("tbd"), **extra, **w.ws))
            assert _outcome(spoofed) == _outcome(unknown)
        await expect_error("not_found", owner.call("strand.default.set", strand_id=strand["id"], **w.ws))
        await expect_error("not_found", owner.call("strand.assign", strand_id=w.strand,
                                                   member_id=beta.owner.member_id, **w.ws))
    assert await snapshot(app, strand["id"]) == before


CORRUPTIONS = {
    # The task scope's parent is another channel of the workspace (both readable to Bob).
    "scope_parent": "UPDATE scopes SET parent_scope_id = $2 WHERE id = $1",
    # strands.channel_id disagrees with its board (the composite FK forbids it: bypassed).
    "strand_channel": "UPDATE strands SET channel_id = $2 WHERE scope_id = $1",
    # The board moved to another channel under its tasks.
    "board_channel": "UPDATE task_boards SET channel_id = $2 WHERE id = (SELECT board_id FROM strands "
                     "WHERE scope_id = $1)",
}


async def test_a_task_whose_board_channel_and_parent_disagree_is_unreadable_for_everyone(app: App, world):
    w = world

    async def rewrite(corruption: str, channel: str) -> None:
        async def unit(conn):
            await conn.execute("SET LOCAL session_replication_role = replica")  # past the FKs, as a bad write would
            assert await conn.execute(CORRUPTIONS[corruption], w.strand, channel) == "UPDATE 1"
        await app.db.transaction(unit)

    async with await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as b:
        await owner.call("strand.default.set", strand_id=w.strand, **w.ws)
        for corruption in CORRUPTIONS:
            await rewrite(corruption, w.other_channel)
            for person, conn in ((w.owner, owner), (w.bob, b)):
                await assert_hidden(app, conn, w.ws, person.member_id, w.strand, w.message)
                assert (await conn.call("strand.list", board_id=w.board, **w.ws))["strands"] == [], corruption
            for op, extra in (("strand.update", {"expected_version": 1, "title": "x"}),
                              ("strand.stage.set", {"stage": "draft"}), ("strand.archive", {}),
                              ("strand.tracks.update", {"patch": {"tracks.discussion.profile": _set("p")}})):
                await expect_error("not_found", owner.call(op, strand_id=w.strand, **extra, **w.ws))
            assert (await owner.call("strand.default.get", **w.ws))["default_strand_id"] is None
            # Repaired, it reads again (the refusals above were the mismatch, nothing else).
            await rewrite(corruption, w.channel)
            assert (await b.call("strand.get", strand_id=w.strand, **w.ws))["version"] == 1
            assert (await b.call("strand.default.get", **w.ws))["default_strand_id"] == w.strand


async def _archived_reads(app: App, w: Board, conn, member_id: str) -> None:
    """A human on an archived strand, board or channel: reads and keeps read state; writes are scope_archived."""
    seen = await probe(app, conn, w.ws, member_id, w.strand, w.message)
    seen.pop("reaction.add")  # see test_a_reaction_on_an_archived_strand_is_refused
    writes = {"message.send", "strand.assign"}
    assert {k: v for k, v in seen.items() if k not in writes} == {
        k: v for k, v in READS.items() if k not in writes | {"reaction.add"}}
    refused = {k: (seen[k][0], seen[k][2]) if seen[k] != "ok" else "ok" for k in writes}
    assert refused == {k: ("conflict", (("reason", "scope_archived"),)) for k in writes}, seen


async def test_archived_strands_boards_and_channels_stay_readable_to_humans_and_close_to_agents(app: App, world):
    w = world
    async with await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as b, \
            as_key(app, w.public_key) as herald, as_key(app, w.private_key) as scout:
        assert (await herald.call("strand.get", strand_id=w.strand, **w.ws))["id"] == w.strand
        await assert_hidden(app, scout, w.ws, w.private_agent, w.strand, w.message)  # private agents: never
        archive_restore = (
            ("strand", lambda: owner.call("strand.archive", strand_id=w.strand, **w.ws),
             lambda: owner.call("strand.restore", strand_id=w.strand, **w.ws)),
            ("board", lambda: owner.call("board.archive", board_id=w.board, **w.ws),
             lambda: owner.call("board.restore", board_id=w.board, **w.ws)),
            ("channel", lambda: owner.call("scope.archive", scope_id=w.channel, **w.ws), None),
        )
        for what, archive, restore in archive_restore:
            await archive()
            await _archived_reads(app, w, b, w.bob.member_id)
            await assert_hidden(app, herald, w.ws, w.public_agent, w.strand, w.message)
            await assert_hidden(app, scout, w.ws, w.private_agent, w.strand, w.message)
            for op, extra in (("strand.update", {"expected_version": 1, "title": "x"}),
                              ("strand.stage.set", {"stage": "draft"}),
                              ("strand.tracks.update", {"patch": {"tracks.discussion.profile": {"$op": "set",
                                                                                                "value": "p"}}})):
                error = await expect_error("conflict", owner.call(op, strand_id=w.strand, **extra, **w.ws))
                assert error.details["reason"] == "scope_archived", (what, op)
            if what != "strand":
                error = await expect_error("conflict", b.call("strand.create", board_id=w.board, title="t", **w.ws))
                assert error.details["reason"] == "scope_archived"
            if restore is not None:
                await restore()
                assert (await herald.call("strand.get", strand_id=w.strand, **w.ws))["state"] == "active"
                await assert_hidden(app, scout, w.ws, w.private_agent, w.strand, w.message)
                await herald.call("message.send", scope_id=w.strand, content=f"after {what}", **w.ws)


async def test_a_reaction_on_an_archived_strand_is_refused(app: App, world):
    w = world
    async with await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as b:
        await owner.call("strand.archive", strand_id=w.strand, **w.ws)
        error = await expect_error("conflict", b.call("reaction.add", message_id=w.message, key=":eyes:", **w.ws))
        assert error.details["reason"] == "scope_archived"


# --- the seed's normative vectors (strand-message.md §2-§4) -----------------------------------------------

async def _refused(conn, code: str, reason: str | None, op: str, app: App, watched: str, **fields) -> None:
    """A refusal with its code and reason that changes nothing (`watched`: the strand to snapshot)."""
    before = await snapshot(app, watched)
    error = await expect_error(code, conn.call(op, **fields))
    assert error.details.get("reason") == reason, (op, fields, error)
    assert await snapshot(app, watched) == before, (op, fields)


async def test_tracks_patches_follow_the_seed_vectors_atomically(app: App, world):
    w = world
    async with await signed_in(app, w.owner) as owner:
        sid = w.strand

        async def patch(**paths):
            return await owner.call("strand.tracks.update", strand_id=sid, patch=paths, **w.ws)

        def refused(code: str, reason: str, patch_: dict):
            return _refused(owner, code, reason, "strand.tracks.update", app, sid, strand_id=sid, patch=patch_, **w.ws)

        # §4.6: a track comes into being only with enabled: set true; synthesis then becomes the derived primary.
        await refused("conflict", "track_disabled", {"tracks.synthesis.profile": _set("notes")})
        enabled = await patch(**{"tracks.synthesis.enabled": _set(True)})
        assert enabled["primary_track"] == "synthesis"
        assert enabled["tracks"]["synthesis"]["is_primary"] is False and enabled["tracks"]["synthesis"]["enabled"]
        # §4.7: closing the primary needs a hand-over in the same patch.
        await refused("conflict", "primary_track_required", {"tracks.synthesis.enabled": _set(False)})
        # An explicit primary on a disabled track is track_disabled.
        await refused("conflict", "track_disabled", {"tracks.synthesis.enabled": _set(False),
                                                     "tracks.synthesis.is_primary": _set(True)})
        await refused("conflict", "track_disabled", {"tracks.discussion.enabled": _set(False),
                                                     "tracks.discussion.is_primary": _set(True)})
        # Two primaries, unregistered names, content and whole-entry paths: schema_violation.
        for bad in ({"tracks.discussion.is_primary": _set(True), "tracks.synthesis.is_primary": _set(True)},
                    {"tracks.review.enabled": _set(True)},
                    {"tracks.Discussion.enabled": _set(True)},
                    {"tracks.synthesis.content": _set("text")},
                    {"tracks.synthesis.encrypted_content": _set("text")},
                    {"tracks.synthesis": _set({"enabled": True})},
                    {"tracks": _set({})},
                    {"tracks.synthesis.enabled.x": _set(True)},
                    {"tracks.synthesis.colour": _set("red")},
                    {"tracks.synthesis.enabled": {"$op": "unset"}},
                    {"tracks.synthesis.enabled": {"$op": "merge", "value": True}},
                    {"tracks.synthesis.enabled": {"$op": "set"}},
                    {"tracks.synthesis.enabled": {"$op": "set", "value": True, "extra": 1}},
                    {"tracks.synthesis.enabled": True},
                    {"tracks.synthesis.enabled": _set("yes")},
                    {"tracks.synthesis.profile": _set("")},
                    {"tracks.synthesis.profile": _set("p" * 65)},
                    {"tracks.synthesis.metadata": _set([1])},
                    {}):
            await refused("invalid", "schema_violation", bad)
        # Atomic: a valid path beside a refused one changes nothing.
        await refused("invalid", "schema_violation", {"tracks.discussion.profile": _set("chat"),
                                                      "tracks.review.enabled": _set(True)})
        await refused("conflict", "primary_track_required", {"tracks.discussion.profile": _set("chat"),
                                                             "tracks.synthesis.enabled": _set(False)})
        # A hand-over in one patch is accepted.
        handed = await patch(**{"tracks.synthesis.enabled": _set(False), "tracks.discussion.is_primary": _set(True)})
        assert handed["primary_track"] == "discussion"
        assert handed["tracks"]["synthesis"]["enabled"] is False
        assert handed["version"] == enabled["version"] + 1
        # Unset returns a field to its default.
        unset = await patch(**{"tracks.discussion.is_primary": {"$op": "unset"},
                               "tracks.discussion.profile": _set("chat")})
        assert unset["primary_track"] == "discussion" and unset["tracks"]["discussion"]["profile"] == "chat"
        assert unset["tracks"]["discussion"]["is_primary"] is False

    async with await signed_in(app, w.bob) as b:
        # A strand with synthesis only: switching the primary to the missing discussion needs enabled: set true.
        only = await b.call("strand.create", board_id=w.board, title="Synthesis only", tracks={"synthesis": {}},
                            **w.ws)
        assert (only["primary_track"], sorted(only["tracks"])) == ("synthesis", ["synthesis"])
        await _refused(b, "conflict", "track_disabled", "strand.tracks.update", app, only["id"], strand_id=only["id"],
                       patch={"tracks.discussion.is_primary": _set(True)}, **w.ws)
        switched = await b.call("strand.tracks.update", strand_id=only["id"], patch={
            "tracks.discussion.is_primary": _set(True), "tracks.discussion.enabled": _set(True)}, **w.ws)
        assert switched["primary_track"] == "discussion"
        # The same rules hold at creation.
        for tracks, code, reason in (
                ({"discussion": {"is_primary": True}, "synthesis": {"is_primary": True}}, "invalid",
                 "schema_violation"),
                ({"review": {}}, "invalid", "schema_violation"),
                ({"synthesis": {"content": "x"}}, "invalid", "schema_violation"),
                ({}, "invalid", "schema_violation"),
                ({"discussion": {"enabled": False, "is_primary": True}}, "conflict", "track_disabled"),
                ({"discussion": {"enabled": False}}, "conflict", "primary_track_required")):
            await _refused(b, code, reason, "strand.create", app, only["id"], board_id=w.board, title="t",
                           tracks=tracks, **w.ws)


async def test_synthesis_is_written_only_while_its_track_is_enabled_and_every_revision_is_kept(app: App, world):
    w = world
    async with await signed_in(app, w.owner) as owner:
        sid = w.strand

        async def update(version: int, **fields):
            return await owner.call("strand.update", strand_id=sid, expected_version=version, **fields, **w.ws)

        # No synthesis track: synthesis is refused (with a description change too: all or nothing) ...
        await _refused(owner, "conflict", "track_disabled", "strand.update", app, sid, strand_id=sid,
                       expected_version=1, synthesis_content="draft", **w.ws)
        await _refused(owner, "conflict", "track_disabled", "strand.update", app, sid, strand_id=sid,
                       expected_version=1, title="new", synthesis_content="draft", **w.ws)
        # ... while the description stays writable.
        described = await update(1, title="Pay the bills today", summary="rent", content="body",
                                 fields={"priority": "high"})
        assert (described["title"], described["summary"], described["content"], described["fields"],
                described["version"]) == ("Pay the bills today", "rent", "body", {"priority": "high"}, 2)
        tracks = await owner.call("strand.tracks.update", strand_id=sid,
                                  patch={"tracks.synthesis.enabled": _set(True)}, **w.ws)
        first = await update(tracks["version"], synthesis_content="first")
        second = await update(first["version"], synthesis_content="second")
        assert second["tracks"]["synthesis"] == {"enabled": True, "is_primary": False, "content": "second",
                                                  "revision": 2}
        # Disabled (handing the primary back), it refuses synthesis again; the revisions stay.
        closed = await owner.call("strand.tracks.update", strand_id=sid, patch={
            "tracks.synthesis.enabled": _set(False), "tracks.discussion.is_primary": _set(True)}, **w.ws)
        await _refused(owner, "conflict", "track_disabled", "strand.update", app, sid, strand_id=sid,
                       expected_version=closed["version"], synthesis_content="third", **w.ws)
        assert (await update(closed["version"], content="still writable"))["content"] == "still writable"
        got = await owner.call("strand.get", strand_id=sid, include_synthesis_revisions=True, **w.ws)
        assert [(r["revision"], r["content"], r["edited_by_member_id"]) for r in got["synthesis_revisions"]] == [
            (2, "second", w.owner.member_id), (1, "first", w.owner.member_id)]
        assert "synthesis_revisions" not in await owner.call("strand.get", strand_id=sid, **w.ws)


async def test_reserved_field_names_are_schema_violations(app: App, world):
    w = world
    async with await signed_in(app, w.bob) as b:
        for name in sorted(RESERVED_FIELDS) + ["Status", "ASSIGNEES"]:
            await _refused(b, "invalid", "schema_violation", "strand.create", app, w.strand, board_id=w.board,
                           title="t", fields={name: "x"}, **w.ws)
            await _refused(b, "invalid", "schema_violation", "strand.update", app, w.strand, strand_id=w.strand,
                           expected_version=1, fields={"ok": 1, name: "x"}, **w.ws)
        created = await b.call("strand.create", board_id=w.board, title="t", fields={"status_note": "fine"}, **w.ws)
        assert created["fields"] == {"status_note": "fine"}


async def test_stage_is_a_compare_and_set_from_its_initial_null(app: App, world):
    w = world
    async with await signed_in(app, w.owner) as owner:
        sid = w.strand

        async def stage(**fields):
            return await owner.call("strand.stage.set", strand_id=sid, **fields, **w.ws)

        assert "stage" not in await owner.call("strand.get", strand_id=sid, **w.ws)
        await _refused(owner, "conflict", "failed_precondition", "strand.stage.set", app, sid, strand_id=sid,
                       stage="draft", expected_stage="planned", **w.ws)
        first = await stage(stage="draft")
        assert first["stage"] == "draft" and first["stage_changed_at_ms"] > 0
        for expected in ({}, {"expected_stage": None}, {"expected_stage": "planned"}):
            await _refused(owner, "conflict", "failed_precondition", "strand.stage.set", app, sid, strand_id=sid,
                           stage="planned", **expected, **w.ws)
        same = await stage(stage="draft", expected_stage="draft")
        assert same["stage_changed_at_ms"] == first["stage_changed_at_ms"] and same["version"] == first["version"] + 1
        moved = await stage(stage="in_progress", expected_stage="draft")
        assert moved["stage"] == "in_progress" and moved["stage_changed_at_ms"] >= first["stage_changed_at_ms"]
        # Null as the expected value is the initial state too.
        other = await owner.call("strand.create", board_id=w.board, title="Second", **w.ws)
        assert (await owner.call("strand.stage.set", strand_id=other["id"], stage="proposed", expected_stage=None,
                                 **w.ws))["stage"] == "proposed"


async def test_the_default_strand_pointer_is_a_whole_value_compare_and_set(app: App, world):
    w = world
    sid = w.strand
    async with await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as b, \
            await signed_in(app, w.carol) as c:
        second = (await owner.call("strand.create", board_id=w.board, title="Second", **w.ws))["id"]

        async def default_set(**fields):
            return await owner.call("strand.default.set", **fields, **w.ws)

        assert (await owner.call("strand.default.get", **w.ws))["default_strand_id"] is None
        await _refused(owner, "conflict", "failed_precondition", "strand.default.set", app, sid, strand_id=sid,
                       expected_default_strand_id=second, **w.ws)
        await _refused(b, "forbidden", "not_governor", "strand.default.set", app, sid, strand_id=sid, **w.ws)
        assert (await default_set(strand_id=sid))["default_strand_id"] == sid
        assert (await b.call("strand.get", strand_id=sid, **w.ws))["is_default"] is True
        assert (await b.call("strand.get", strand_id=second, **w.ws))["is_default"] is False
        assert (await b.call("strand.default.get", **w.ws))["default_strand_id"] == sid
        assert (await c.call("strand.default.get", **w.ws))["default_strand_id"] is None  # not revealed
        for expected in ({}, {"expected_default_strand_id": None}, {"expected_default_strand_id": second}):
            await _refused(owner, "conflict", "failed_precondition", "strand.default.set", app, sid,
                           strand_id=second, **expected, **w.ws)
        assert (await default_set(strand_id=second, expected_default_strand_id=sid))["default_strand_id"] == second
        assert (await default_set(strand_id=None, expected_default_strand_id=second))["default_strand_id"] is None
        # Cleared is a value (null), not "never set": omitting the expectation is refused now.
        await _refused(owner, "conflict", "failed_precondition", "strand.default.set", app, sid, strand_id=sid,
                       **w.ws)
        assert (await default_set(strand_id=sid, expected_default_strand_id=None))["default_strand_id"] == sid
        # An archived strand cannot become the default.
        await owner.call("strand.archive", strand_id=second, **w.ws)
        await expect_error("not_found", default_set(strand_id=second, expected_default_strand_id=sid))
        assert (await owner.call("strand.default.get", **w.ws))["default_strand_id"] == sid


async def test_create_is_idempotent_by_client_strand_id_and_update_is_a_version_compare_and_set(app: App, world):
    w = world
    async with await signed_in(app, w.bob) as b, await signed_in(app, w.owner) as owner:
        request = dict(board_id=w.board, title="Retry me", summary="s", content="c", fields={"k": 1},
                       tracks={"discussion": {"profile": "chat"}}, client_strand_id="cli-1", **w.ws)
        created = await b.call("strand.create", **request)
        assert created.get("replayed", False) is False
        again = await b.call("strand.create", **request)
        assert again["replayed"] is True and again["id"] == created["id"]
        assert {k: v for k, v in again.items() if k != "replayed"} == created
        for change in ({"title": "Other"}, {"summary": None}, {"content": "d"}, {"fields": {}},
                       {"tracks": {"discussion": {}}}, {"board_id": (await owner.call(
                           "board.create", channel_id=w.channel, name="Second board", **w.ws))["id"]}):
            await _refused(b, "idempotency_conflict", None, "strand.create", app, created["id"], **(request | change))
        # The key is the creator's: another member's same key is another strand.
        theirs = await owner.call("strand.create", **request)
        assert theirs["id"] != created["id"] and theirs.get("replayed", False) is False
        count = await app.db.run(lambda c: c.fetchval(
            "SELECT count(*) FROM strands WHERE client_strand_id = 'cli-1'"))
        assert count == 2
        # Version compare-and-set.
        updated = await b.call("strand.update", strand_id=created["id"], expected_version=created["version"],
                               title="Renamed", **w.ws)
        assert updated["version"] == created["version"] + 1
        for stale in (created["version"], updated["version"] + 1):
            await _refused(b, "conflict", "version_mismatch", "strand.update", app, created["id"],
                           strand_id=created["id"], expected_version=stale, title="Lost", **w.ws)
        assert (await b.call("strand.get", strand_id=created["id"], **w.ws))["title"] == "Renamed"


# --- bad input: typed errors, nothing changed -------------------------------------------------------------

def _bad_inputs(w: Board) -> list[tuple[str, dict, str]]:
    """(op, fields, expected code) for malformed ids, wrong types, unknown fields, oversize values."""
    sid, bid, cid, mid = w.strand, w.board, w.channel, w.bob.member_id
    long_id = "scp_" + "a" * 200
    cases: list[tuple[str, dict, str]] = []
    for bad_strand in ("scp_bad", "tbd_2s9n1ntfcntmb7", "", long_id, "scp_2s9n1ntfcntm\u00e9"):
        for op, extra in (("strand.get", {}), ("strand.update", {"expected_version": 1, "title": "x"}),
                          ("strand.tracks.update", {"patch": {"tracks.discussion.profile": _set("p")}}),
                          ("strand.stage.set", {"stage": "draft"}), ("strand.archive", {}), ("strand.restore", {}),
                          ("strand.default.set", {}), ("strand.assign", {"member_id": mid}),
                          ("strand.unassign", {"assignment_id": new_id("asg")}),
                          ("strand.watch.set", {"level": "all"}), ("strand.watch.get", {}), ("strand.watchers", {})):
            # An empty or overlong id fails the frame's Id bounds; a well-sized malformed one the id check.
            code = "bad_frame" if bad_strand in ("", long_id) else "invalid"
            cases.append((op, {"strand_id": bad_strand, **extra}, code))
    for bad_board in ("tbd_bad", sid, ""):
        code = "bad_frame" if bad_board == "" else "invalid"
        cases += [("strand.create", {"board_id": bad_board, "title": "t"}, code),
                  ("strand.list", {"board_id": bad_board}, code),
                  ("board.archive", {"board_id": bad_board}, code),
                  ("board.restore", {"board_id": bad_board}, code)]
    cases += [
        ("board.create", {"channel_id": "scp_bad", "name": "n"}, "invalid"),
        ("board.create", {"channel_id": cid, "name": ""}, "bad_frame"),
        ("board.create", {"channel_id": cid, "name": "   "}, "invalid"),
        ("board.create", {"channel_id": cid, "name": "n" * 201}, "bad_frame"),
        ("board.create", {"channel_id": cid, "name": 7}, "bad_frame"),
        ("board.create", {"channel_id": new_id("scp"), "name": "n"}, "not_found"),
        ("board.list", {"channel_id": "scp_bad"}, "invalid"),
        ("board.list", {"channel_id": 3}, "bad_frame"),
        ("board.archive", {"board_id": new_id("tbd")}, "not_found"),
        ("strand.create", {"board_id": bid, "title": "t" * 513}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": ""}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "  "}, "invalid"),
        ("strand.create", {"board_id": bid, "title": 5}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "summary": "s" * 2049}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "content": "c" * 40001}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "tracks": "discussion"}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "tracks": {"discussion": []}}, "invalid"),
        ("strand.create", {"board_id": bid, "title": "t", "tracks": {"discussion": {"enabled": "yes"}}}, "invalid"),
        ("strand.create", {"board_id": bid, "title": "t", "fields": []}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "client_strand_id": ""}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "client_strand_id": "k" * 129}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "stage": "draft"}, "bad_frame"),
        ("strand.create", {"board_id": bid, "title": "t", "bogus": 1}, "bad_frame"),
        ("strand.create", {"title": "t"}, "bad_frame"),
        ("strand.get", {"strand_id": sid, "include_synthesis_revisions": "yes"}, "bad_frame"),
        ("strand.get", {"strand_id": 12}, "bad_frame"),
        ("strand.get", {"strand_id": None}, "bad_frame"),
        ("strand.get", {"strand_id": sid, "bogus": True}, "bad_frame"),
        ("strand.list", {"board_id": bid, "limit": 0}, "bad_frame"),
        ("strand.list", {"board_id": bid, "limit": 201}, "bad_frame"),
        ("strand.list", {"board_id": bid, "state": "deleted"}, "bad_frame"),
        ("strand.list", {"board_id": bid, "cursor": "not-a-cursor"}, "invalid"),
        ("strand.list", {"board_id": bid, "cursor": "WzEsMl0"}, "invalid"),
        ("strand.update", {"strand_id": sid, "expected_version": 1}, "invalid"),
        ("strand.update", {"strand_id": sid, "expected_version": 0, "title": "x"}, "bad_frame"),
        ("strand.update", {"strand_id": sid, "expected_version": "1", "title": "x"}, "bad_frame"),
        ("strand.update", {"strand_id": sid, "expected_version": 2 ** 60, "title": "x"}, "bad_frame"),
        ("strand.update", {"strand_id": sid, "title": "x"}, "bad_frame"),
        ("strand.update", {"strand_id": sid, "expected_version": 1, "title": "t" * 513}, "bad_frame"),
        ("strand.update", {"strand_id": sid, "expected_version": 1, "title": " "}, "invalid"),
        ("strand.update", {"strand_id": sid, "expected_version": 1, "fields": "x"}, "bad_frame"),
        ("strand.update", {"strand_id": sid, "expected_version": 1, "synthesis_content": 3}, "bad_frame"),
        ("strand.update", {"strand_id": sid, "expected_version": 1, "tracks": {}}, "bad_frame"),
        ("strand.tracks.update", {"strand_id": sid, "patch": []}, "bad_frame"),
        ("strand.tracks.update", {"strand_id": sid, "patch": None}, "bad_frame"),
        ("strand.tracks.update", {"strand_id": sid}, "bad_frame"),
        ("strand.stage.set", {"strand_id": sid, "stage": "doing"}, "bad_frame"),
        ("strand.stage.set", {"strand_id": sid, "stage": None}, "bad_frame"),
        ("strand.stage.set", {"strand_id": sid, "stage": "draft", "expected_stage": "doing"}, "bad_frame"),
        ("strand.stage.set", {"strand_id": sid, "stage": "draft", "expected_stage": 1}, "bad_frame"),
        ("strand.default.set", {"strand_id": "scp_bad"}, "invalid"),
        ("strand.default.set", {"strand_id": sid, "expected_default_strand_id": 5}, "bad_frame"),
        ("strand.default.set", {}, "bad_frame"),
        ("strand.default.get", {"bogus": 1}, "bad_frame"),
        ("strand.assign", {"strand_id": sid, "member_id": "mem_bad"}, "invalid"),
        ("strand.assign", {"strand_id": sid, "member_id": sid}, "invalid"),
        ("strand.assign", {"strand_id": sid, "member_id": new_id("mem")}, "not_found"),
        ("strand.assign", {"strand_id": sid}, "bad_frame"),
        ("strand.unassign", {"strand_id": sid, "assignment_id": "asg_bad"}, "invalid"),
        ("strand.unassign", {"strand_id": sid, "assignment_id": new_id("asg")}, "not_found"),
        ("strand.watch.set", {"strand_id": sid, "level": "loud"}, "bad_frame"),
        ("strand.watch.set", {"strand_id": sid}, "bad_frame"),
        ("strand.watch.set", {"strand_id": sid, "level": "all", "level_public": "yes"}, "bad_frame"),
        ("strand.watch.set", {"strand_id": sid, "level": None, "level_public": True}, "invalid"),
        ("strand.watch.set", {"strand_id": sid, "level": "all", "watcher_member_id": "mem_bad"}, "invalid"),
        ("strand.watch.set", {"strand_id": sid, "level": "all", "watcher_member_id": new_id("mem")}, "not_found"),
        ("strand.watch.set", {"strand_id": sid, "level": "all", "expected_value": "all"}, "bad_frame"),
        ("strand.watch.set", {"strand_id": sid, "level": "all", "expected_value": {"lvl": "all"}}, "invalid"),
        ("strand.watch.set", {"strand_id": sid, "level": "all", "expected_value": {"level": "loud"}}, "invalid"),
        ("strand.watch.set", {"strand_id": sid, "level": "all",
                              "expected_value": {"level": "all", "extra": 1}}, "invalid"),
        ("strand.watchers", {"strand_id": sid, "audit": "yes"}, "bad_frame"),
    ]
    return cases


async def test_every_bad_input_gets_a_typed_error_and_changes_nothing(app: App, world, caplog):
    w = world
    async with await signed_in(app, w.owner) as owner:
        before = await snapshot(app, w.strand)
        cases = _bad_inputs(w)
        seen = {}
        for op, fields, _ in cases:
            try:
                await owner.call(op, **fields, **w.ws)
                seen[(op, repr(fields))] = "ok"
            except ClientError as exc:
                seen[(op, repr(fields))] = exc.code
        wanted = {(op, repr(fields)): expected for op, fields, expected in cases}
        mismatches = {k: (v, wanted[k]) for k, v in seen.items() if v != wanted[k]}
        assert not mismatches, "\n".join(f"{k}: {v}" for k, v in mismatches.items())
        assert await snapshot(app, w.strand) == before
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# --- compare-and-set under concurrency ------------------------------------------------------------------

async def _race_stage(w: Board, connections: dict, current: str) -> str:
    """Two stage.set calls with the same expectation on two connections at once:
    exactly one wins, the other is failed_precondition.  Returns the new stage."""
    # Both move away from the current stage (a same-value set would leave the other's expectation true).
    choices = [stage for stage in ("planned", "in_progress", "blocked") if stage != current]
    targets = dict(zip(connections, choices))
    results: dict[str, object] = {}

    async def attempt(name: str) -> None:
        try:
            results[name] = (await connections[name].call("strand.stage.set", strand_id=w.strand,
                                                          stage=targets[name], expected_stage=current,
                                                          **w.ws))["stage"]
        except ClientError as exc:
            results[name] = (exc.code, exc.details.get("reason"))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for name in connections:
                nursery.start_soon(attempt, name)
    winners = [name for name, value in results.items() if isinstance(value, str)]
    assert len(winners) == 1, results
    assert [v for v in results.values() if not isinstance(v, str)] == [("conflict", "failed_precondition")]
    return results[winners[0]]


async def test_concurrent_stage_sets_with_one_expectation_let_exactly_one_win(app: App, world, database_dsn):
    """The task actor may run both in one batch (one transaction): the second must see
    the first's write (§3.2).  Forced once: the actor is held on the strand's row lock
    by an earlier command while both calls queue behind it; then free-running."""
    w = world
    async with await signed_in(app, w.owner) as owner, await signed_in(app, w.bob) as b, \
            await signed_in(app, w.owner) as third, \
            Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as admin, trio.open_nursery() as tasks:
        connections = {"owner": owner, "bob": b}
        current = (await owner.call("strand.stage.set", strand_id=w.strand, stage="draft", **w.ws))["stage"]

        async def hold(conn):
            await conn.execute("SELECT 1 FROM strands WHERE scope_id = $1 FOR UPDATE", w.strand)
            await conn.execute("SELECT pg_sleep(60)")

        async def holder():
            with contextlib.suppress(DatabaseUnavailable):
                await admin.transaction(hold)

        tasks.start_soon(holder)
        await wait_for_query(admin, LOCK_HOLDER)
        blocker = trio.Event()

        async def held_command():
            # Its own connection: a connection answers one request at a time.
            await third.call("strand.watch.set", strand_id=w.strand, level="all", **w.ws)
            blocker.set()

        tasks.start_soon(held_command)
        await wait_for_query(admin, "wait_event_type = 'Lock' AND query LIKE '%FROM strands st%FOR UPDATE%'")
        stages = [current]

        async def forced_race():
            stages.append(await _race_stage(w, connections, current))

        async with trio.open_nursery() as racing:
            racing.start_soon(forced_race)
            with trio.fail_after(20):  # a precondition: both calls wait in the actor's mailbox behind the held batch
                while sum(app.server.registry.mailbox_depths()) < 2:
                    await trio.sleep(0.01)
            await release_locks(admin)
        with trio.fail_after(20):
            await blocker.wait()
        for _ in range(3):
            stages.append(await _race_stage(w, connections, stages[-1]))
        audit = await app.db.run(lambda c: c.fetchval(
            "SELECT count(*) FROM strand_audit_events WHERE scope_id = $1 AND action = 'stage_set'", w.strand))
        assert audit == 1 + 1 + 3  # one per accepted write, none for a refused one
