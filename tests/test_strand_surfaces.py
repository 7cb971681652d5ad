"""A strand is a task scope (README "Strands"): the ordinary scope surfaces work on it
for its board channel's members, its roster follows the channel, and the roster ops
and threads that would give it a second roster are refused."""

from __future__ import annotations

import trio

from client import ClientError
from tests.conftest import App
from tests.test_collaborators import team  # noqa: F401  (a fixture)
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in


async def _next(conn, name: str) -> dict:
    with trio.fail_after(15):
        while True:
            event = await conn.next_event()
            if event["event"] == name:
                return event


async def test_a_strand_is_a_scope_of_its_board_channels_members(app: App, team):
    alpha, people = team
    bob, carol = people["bob"], people["carol"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, carol) as c:
        channel = await open_channel(owner, alpha.workspace_id, "work", [bob.member_id])
        board = await owner.call("board.create", channel_id=channel["id"], name="Sprint", **ws)
        strand = await owner.call("strand.create", board_id=board["id"], title="Payments", **ws)
        sid = strand["id"]
        assert (strand["primary_track"], strand["state"], strand["channel_id"]) == ("discussion", "active",
                                                                                    channel["id"])
        await b.call("subscribe", scopes=[{"scope_id": sid}], **ws)
        await expect_error("not_found", c.call("subscribe", scopes=[{"scope_id": sid}], **ws))
        sent = await owner.call("message.send", scope_id=sid, content="kickoff", **ws)
        assert (await _next(b, "message.created"))["data"]["id"] == sent["id"]
        await owner.call("typing", scope_id=sid, **ws)
        assert (await _next(b, "typing"))["data"]["member_id"] == alpha.owner.member_id
        staged = await owner.call("strand.stage.set", strand_id=sid, stage="planned", **ws)
        changed = await _next(b, "strand.changed")
        assert (changed["data"]["change"], changed["data"]["strand"]["stage"],
                changed["data"]["actor_member_id"]) == ("stage", "planned", alpha.owner.member_id)
        assert changed["data"]["strand"]["version"] == staged["version"]
        # The Inbox lists the strand once Bob has read state there; unread from his cursor.
        await b.call("read.mark", scope_id=sid, seq=0, **ws)
        await owner.call("message.send", scope_id=sid, content="second", **ws)
        rows = {r["scope_id"]: r for r in (await b.call("inbox.list", **ws))["conversations"]}
        assert (rows[sid]["type"], rows[sid]["unread_count"]) == ("task", 2)
        assert sid not in {r["scope_id"] for r in (await c.call("inbox.list", **ws))["conversations"]}
        assert (await b.call("notification.set", scope_id=sid, state="quiet", **ws))["state"] == "quiet"
        members = await owner.call("scope.members", scope_id=sid, **ws)
        assert {m["member_id"] for m in members["members"]} == {alpha.owner.member_id, bob.member_id}
        # Joining the channel is what lets Carol in; leaving it shuts her out again.
        await c.call("scope.join", scope_id=channel["id"], **ws)
        assert (await c.call("message.history", scope_id=sid, **ws))["messages"][0]["content"] == "kickoff"
        await c.call("scope.leave", scope_id=channel["id"], **ws)
        await expect_error("not_found", c.call("message.history", scope_id=sid, **ws))
        await expect_error("not_found", c.call("strand.get", strand_id=sid, **ws))


async def test_roster_ops_and_threads_are_refused_on_a_strand(app: App, team):
    alpha, people = team
    bob = people["bob"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "flat", [bob.member_id])
        board = await owner.call("board.create", channel_id=channel["id"], name="Board", **ws)
        sid = (await owner.call("strand.create", board_id=board["id"], title="Flat", **ws))["id"]
        root = await owner.call("message.send", scope_id=sid, content="root", **ws)
        error = await expect_error("forbidden", owner.call("thread.reply", scope_id=sid, root_message_id=root["id"],
                                                           content="reply", **ws))
        assert error.details["reason"] == "task_discussion_is_flat"
        for call in (owner.call("scope.invite", scope_id=sid, member_ids=[bob.member_id], **ws),
                     owner.call("scope.remove", scope_id=sid, member_id=bob.member_id, **ws),
                     owner.call("scope.leave", scope_id=sid, **ws),
                     owner.call("scope.archive", scope_id=sid, **ws)):
            error = await expect_error("forbidden", call)
            assert error.details["reason"] == "task_readers_from_board"
        reply = await owner.call("message.send", scope_id=sid, content="a reply", reply_to_message_id=root["id"], **ws)
        assert reply["seq"] == 2
        assert (await owner.call("strand.get", strand_id=sid, **ws))["state"] == "active"


async def test_every_strand_command_probed_across_workspaces_answers_not_found(app: App, tenants):
    """Beta's boards, strands, assignments, grants and channels named from Alpha (with either
    workspace id) answer not_found, whoever asks, and change nothing in Beta."""
    alpha, beta = tenants
    a, b = {"workspace_id": alpha.workspace_id}, {"workspace_id": beta.workspace_id}
    async with await signed_in(app, beta.owner) as owner_b:
        channel = await open_channel(owner_b, beta.workspace_id, "beta-work")
        board = await owner_b.call("board.create", channel_id=channel["id"], name="Beta", **b)
        strand = await owner_b.call("strand.create", board_id=board["id"], title="Secret", **b)
        assignment = await owner_b.call("strand.assign", strand_id=strand["id"], member_id=beta.owner.member_id,
                                        **b)
        await owner_b.call("audience_mention.policy.set", audience="effective_scope_members", max_recipients=5, **b)
        grant = await owner_b.call("audience_mention.grant.create", member_id=beta.owner.member_id,
                                   channel_id=channel["id"], expires_in_seconds=3600, max_operations=3,
                                   period_seconds=60, **b)
        agent = await owner_b.call("agent.create", handle="beta-bot", display_name="Bot", visibility="public", **b)
    sid, bid = strand["id"], board["id"]
    probes = {
        "board.create": [dict(channel_id=channel["id"], name="spy")],
        "board.archive": [dict(board_id=bid)],
        "board.restore": [dict(board_id=bid)],
        "strand.create": [dict(board_id=bid, title="spy")],
        "strand.get": [dict(strand_id=sid)],
        "strand.list": [dict(board_id=bid)],
        "strand.update": [dict(strand_id=sid, expected_version=1, title="spy")],
        "strand.tracks.update": [dict(strand_id=sid, patch={"tracks.synthesis.enabled": {"$op": "set",
                                                                                          "value": True}})],
        "strand.stage.set": [dict(strand_id=sid, stage="done")],
        "strand.archive": [dict(strand_id=sid)],
        "strand.restore": [dict(strand_id=sid)],
        "strand.default.set": [dict(strand_id=sid)],
        "strand.assign": [dict(strand_id=sid, member_id=beta.owner.member_id)],
        "strand.unassign": [dict(strand_id=sid, assignment_id=assignment["assignment_id"])],
        "strand.watch.set": [dict(strand_id=sid, level="all")],
        "strand.watch.get": [dict(strand_id=sid)],
        "strand.watchers": [dict(strand_id=sid)],
        "audience_mention.grant.create": [dict(member_id=beta.owner.member_id, channel_id=channel["id"],
                                               expires_in_seconds=3600, max_operations=1, period_seconds=60)],
        "audience_mention.grant.revoke": [dict(grant_id=grant["id"])],
        "agent.participation.set": [dict(member_id=agent["id"], accept_third_party_mention=False)],
    }
    async with await signed_in(app, alpha.owner) as conn:
        for op, variants in probes.items():
            for fields in variants:
                for workspace in (a, b):
                    await expect_error("not_found", conn.call(op, **fields, **workspace))
        # The lists and the default show nothing of Beta's.
        assert (await conn.call("board.list", **a))["boards"] == []
        assert (await conn.call("board.list", channel_id=channel["id"], **a))["boards"] == []
        assert (await conn.call("strand.default.get", **a))["default_strand_id"] is None
        assert (await conn.call("audience_mention.grant.list", **a))["grants"] == []
        assert (await conn.call("audience_mention.policy.list", **a))["policies"] == []
    async with await signed_in(app, beta.owner) as owner_b:
        after = await owner_b.call("strand.get", strand_id=sid, **b)
        assert (after["title"], after["version"], after["state"], after.get("stage")) == (
            "Secret", strand["version"], "active", None)  # an assignment is a relation, not a strand field
        assert after["assigned_member_ids"] == [beta.owner.member_id]
        grants = (await owner_b.call("audience_mention.grant.list", **b))["grants"]
        assert [(g["id"], g["active"]) for g in grants] == [(grant["id"], True)]


async def test_client_json_and_cursors_are_checked_before_anything_is_written(app: App, team):
    alpha, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "inputs")
        board = await owner.call("board.create", channel_id=channel["id"], name="Inputs", **ws)
        sid = (await owner.call("strand.create", board_id=board["id"], title="Inputs", **ws))["id"]
        deep: dict = {}
        for _ in range(12):
            deep = {"k": deep}
        bad = [
            ("strand.create", dict(board_id=board["id"], title="x", fields={"a": "b\x00c"}), "fields.a"),
            ("strand.create", dict(board_id=board["id"], title="x", fields={"a\x00": 1}), "fields"),
            ("strand.create", dict(board_id=board["id"], title="x", fields=deep), "fields.k.k.k.k.k.k.k.k"),
            ("strand.create", dict(board_id=board["id"], title="x", fields={"big": "x" * 17000}), "fields"),
            ("strand.create", dict(board_id=board["id"], title="x", tracks={"discussion": {"profile": "a\x00"}}),
             "tracks.discussion.profile"),
            ("strand.tracks.update", dict(strand_id=sid, patch={"tracks.discussion.metadata": {
                "$op": "set", "value": {"k": "\x00"}}}), "patch.tracks.discussion.metadata.value.k"),
            ("strand.update", dict(strand_id=sid, expected_version=1, fields={"n": 2**60}), "fields.n"),
        ]
        for op, fields, where in bad:
            error = await expect_error("invalid", owner.call(op, **fields, **ws))
            assert error.details["field"] == where, (op, error.details)
        # A cursor that decodes to a time outside what the database holds is a malformed cursor.
        for cursor in ("WyIwMDAxLTAxLTAxVDAwOjAwOjAwKzE0OjAwIiwgInNjcF94Il0", "WyIyMDI2LTAxLTAxVDAwOjAwOjAwIiwgIngiXQ",
                       "bm90IGpzb24"):
            error = await expect_error("invalid", owner.call("strand.list", board_id=board["id"], cursor=cursor, **ws))
            assert error.details["reason"] == "bad_cursor"
        strands = (await owner.call("strand.list", board_id=board["id"], **ws))["strands"]
        assert [(s["id"], s["version"]) for s in strands] == [(sid, 1)]


async def test_concurrent_retries_of_one_create_return_one_strand(app: App, team):
    alpha, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as first, await signed_in(app, alpha.owner) as second:
        channel = await open_channel(first, alpha.workspace_id, "retries")
        board = await first.call("board.create", channel_id=channel["id"], name="Retries", **ws)
        results: list[dict] = []

        async def create(conn) -> None:
            results.append(await conn.call("strand.create", board_id=board["id"], title="Once",
                                           client_strand_id="create-1", **ws))

        async with trio.open_nursery() as nursery:
            for conn in (first, second, first, second):
                nursery.start_soon(create, conn)
        assert len({r["id"] for r in results}) == 1
        assert sorted(r.get("replayed", False) for r in results) == [False, True, True, True]
        # Two first-time default pointers at once: exactly one wins the compare-and-set.
        other = await first.call("strand.create", board_id=board["id"], title="Other", **ws)
        outcomes: list[str] = []

        async def point(conn, strand_id: str) -> None:
            try:
                await conn.call("strand.default.set", strand_id=strand_id, **ws)
                outcomes.append("set")
            except ClientError as exc:
                outcomes.append(f"{exc.code}:{exc.details.get('reason')}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(point, first, results[0]["id"])
            nursery.start_soon(point, second, other["id"])
        assert sorted(outcomes) == ["conflict:failed_precondition", "set"]
