"""Scope messaging core over the WebSocket against a real PostgreSQL:
channels, DMs, threads, sends with group commit, sequences, idempotency,
mentions, edits, withdrawal, reactions, read state, inbox, history."""

from __future__ import annotations

import pytest
import trio

from actors import inline_settler
from client import ClientError, connect
from server import messaging
from storage import messages
from tests.conftest import App, Person, add_person
from tests.test_tenancy import expect_error, signed_in


@pytest.fixture
async def team(app: App, tenants, member_password_hash):
    """Alpha's owner plus two members, and Beta for cross-workspace probes."""
    alpha, beta = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "operator", member_password_hash)
    return alpha, beta, bob, carol


async def open_channel(conn, workspace_id: str, slug: str, members: list[str] = (), visibility: str = "public"):
    return await conn.call("channel.create", workspace_id=workspace_id, slug=slug, display_name=slug.title(),
                           visibility=visibility, member_ids=list(members))


async def test_send_history_and_sequences(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id])
        sent = [await owner.call("message.send", scope_id=channel["id"], content=f"hello {i}", **ws) for i in range(5)]
        sent.append(await b.call("message.send", scope_id=channel["id"], content="hi from bob", **ws))
        assert [m["seq"] for m in sent] == [1, 2, 3, 4, 5, 6]
        assert len({m["id"] for m in sent}) == 6 and all(m["id"].startswith("msg_") for m in sent)
        page = await b.call("message.history", scope_id=channel["id"], limit=4, **ws)
        assert [m["seq"] for m in page["messages"]] == [3, 4, 5, 6] and page["has_more"]
        older = await b.call("message.history", scope_id=channel["id"], before_seq=3, **ws)
        assert [m["seq"] for m in older["messages"]] == [1, 2] and not older["has_more"]
        newer = await b.call("message.history", scope_id=channel["id"], after_seq=4, **ws)
        assert [m["content"] for m in newer["messages"]] == ["hello 4", "hi from bob"]
        permalink = await b.call("message.get", message_id=sent[2]["id"], **ws)
        assert permalink["message"]["content"] == "hello 2"
        # Bad input: typed errors, nothing written.
        await expect_error("bad_frame", b.call("message.history", scope_id=channel["id"], limit=201, **ws))
        await expect_error("bad_frame", b.call("message.history", scope_id=channel["id"], limit=0, **ws))
        await expect_error("invalid", b.call("message.history", scope_id="scp_bad", **ws))
        await expect_error("bad_frame", b.call("message.send", scope_id=channel["id"], content="x" * 40001, **ws))
        await expect_error("not_found", b.call("message.get", message_id="msg_zzzzzzzzzzzzzz", **ws))
    async with await signed_in(app, carol) as c:
        # A public channel is visible but unreadable until joined.
        await expect_error("forbidden", c.call("message.history", scope_id=channel["id"], **ws))
        await expect_error("forbidden", c.call("message.send", scope_id=channel["id"], content="x", **ws))
        await expect_error("not_found", c.call("message.get", message_id=sent[0]["id"], **ws))
        await c.call("scope.join", scope_id=channel["id"], **ws)
        assert len((await c.call("message.history", scope_id=channel["id"], **ws))["messages"]) == 6
    count = await app.db.run(lambda conn: conn.fetchval("SELECT count(*) FROM scope_messages"))
    assert count == 6


async def test_private_scopes_answer_not_found_to_outsiders(app: App, team):
    alpha, beta, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        secret = await open_channel(owner, alpha.workspace_id, "secret", [bob.member_id], visibility="private")
        message = await owner.call("message.send", scope_id=secret["id"], content="classified", **ws)
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        assert (await owner.call("dm.open", member_id=bob.member_id, **ws))["id"] == dm["id"]
    async with await signed_in(app, carol) as c:
        for op, fields in (("message.history", {"scope_id": secret["id"]}), ("scope.get", {"scope_id": secret["id"]}),
                           ("scope.join", {"scope_id": secret["id"]}), ("message.history", {"scope_id": dm["id"]}),
                           ("message.send", {"scope_id": dm["id"], "content": "hi"}),
                           ("message.get", {"message_id": message["id"]}),
                           ("reaction.add", {"message_id": message["id"], "key": "👍"})):
            await expect_error("not_found", c.call(op, **fields, **ws))
        assert [s["slug"] for s in (await c.call("channel.list", **ws))["channels"]] == []


async def test_every_messaging_command_probed_across_workspaces_answers_not_found(app: App, team):
    alpha, beta, bob, _ = team
    async with await signed_in(app, beta.owner) as owner_b:
        b_channel = await open_channel(owner_b, beta.workspace_id, "b-general")
        b_message = await owner_b.call("message.send", workspace_id=beta.workspace_id, scope_id=b_channel["id"],
                                       content="beta only")
    a = {"workspace_id": alpha.workspace_id}
    b = {"workspace_id": beta.workspace_id}
    scope, message = {"scope_id": b_channel["id"]}, {"message_id": b_message["id"]}
    probes = {
        "channel.create": [dict(b, slug="x", display_name="X")],
        "channel.list": [b],
        "dm.open": [dict(a, member_id=beta.owner.member_id), dict(b, member_id=bob.member_id)],
        "scope.get": [dict(a, **scope)], "scope.members": [dict(a, **scope)], "scope.join": [dict(a, **scope)],
        "scope.leave": [dict(a, **scope)], "scope.invite": [dict(a, **scope, member_ids=[bob.member_id])],
        "scope.remove": [dict(a, **scope, member_id=beta.owner.member_id)], "scope.archive": [dict(a, **scope)],
        "message.send": [dict(a, **scope, content="x")],
        "thread.reply": [dict(a, **scope, root_message_id=b_message["id"], content="x")],
        "message.forward": [dict(a, scope_id=b_channel["id"], source_message_ids=[b_message["id"]])],
        "message.edit": [dict(a, **message, content="x", expected_revision=1)],
        "message.withdraw": [dict(a, **message)], "message.history": [dict(a, **scope)],
        "message.get": [dict(a, **message)], "reaction.add": [dict(a, **message, key="👍")],
        "reaction.remove": [dict(a, **message, key="👍")], "read.mark": [dict(a, **scope, seq=1)],
        "read.mark_unread": [dict(a, **scope)], "notification.set": [dict(a, **scope, state="mute")],
        "inbox.list": [b], "conversation.action": [dict(a, **scope, action="pin")],
    }
    assert {cls.__struct_config__.tag for cls in messaging.HANDLERS} == set(probes)
    async with await signed_in(app, alpha.owner) as conn:
        own = await open_channel(conn, alpha.workspace_id, "mine")
        # Alpha's channel cannot take Beta's messages as sources either.
        probes["message.forward"].append(dict(a, scope_id=own["id"], source_message_ids=[b_message["id"]]))
        probes["thread.reply"].append(dict(a, scope_id=own["id"], root_message_id=b_message["id"], content="x"))
        for op, variants in probes.items():
            for fields in variants:
                await expect_error("not_found", conn.call(op, **fields))
    assert await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM scope_messages WHERE workspace_id = $1", beta.workspace_id)) == 1


async def test_idempotent_sends(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "idem", [bob.member_id])
        first = await owner.call("message.send", scope_id=channel["id"], content="once", client_message_id="c-1", **ws)
        again = await owner.call("message.send", scope_id=channel["id"], content="once", client_message_id="c-1", **ws)
        assert again["id"] == first["id"] and again["seq"] == first["seq"] and again["replayed"]
        error = await expect_error("idempotency_conflict", owner.call(
            "message.send", scope_id=channel["id"], content="different", client_message_id="c-1", **ws))
        # The key is per author: Bob may use the same client id.
        async with await signed_in(app, bob) as b:
            other = await b.call("message.send", scope_id=channel["id"], content="once", client_message_id="c-1", **ws)
            assert other["id"] != first["id"]
        # Concurrent duplicates in one batch collapse to one row.
        results = []

        async def send() -> None:
            results.append(await owner.call("message.send", scope_id=channel["id"], content="burst",
                                            client_message_id="c-2", **ws))

        async with connect(app.url) as second:
            await second.login(alpha.owner.email, alpha.owner.password)
            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(send)
                nursery.start_soon(lambda: second.call("message.send", scope_id=channel["id"], content="burst",
                                                       client_message_id="c-2", **ws))
        assert len({r["id"] for r in results}) == 1
        # Replay after a real restart of the server process: tests/test_outage.py.
    rows = await app.db.run(lambda c: c.fetch("SELECT client_message_id, count(*) FROM scope_messages "
                                              "GROUP BY 1 ORDER BY 1"))
    assert [(r[0], r[1]) for r in rows] == [("c-1", 2), ("c-2", 1)]
    assert error.code == "idempotency_conflict"


async def test_concurrent_senders_get_gap_free_ordered_seqs(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    people = [alpha.owner, bob, carol]
    async with await signed_in(app, alpha.owner) as owner:
        channels = [await open_channel(owner, alpha.workspace_id, f"load-{i}", [bob.member_id, carol.member_id])
                    for i in range(3)]
    replies: list[dict] = []

    async def sender(person: Person, channel: dict, n: int) -> None:
        async with await signed_in(app, person) as conn:
            for i in range(n):
                replies.append(await conn.call("message.send", scope_id=channel["id"],
                                               content=f"{person.email} {i}", **ws))

    async with trio.open_nursery() as nursery:
        for channel in channels:
            for person in people:
                nursery.start_soon(sender, person, channel, 15)
    for channel in channels:
        seqs = sorted(r["seq"] for r in replies if r["scope_id"] == channel["id"])
        assert seqs == list(range(1, 46))
    global_seqs = sorted(r["global_seq"] for r in replies)
    assert global_seqs == list(range(1, len(replies) + 1))
    # Per author, commit order follows send order within a scope.
    for channel in channels:
        for person in people:
            mine = [r for r in replies if r["scope_id"] == channel["id"] and r["content"].startswith(person.email)]
            assert [r["seq"] for r in mine] == sorted(r["seq"] for r in mine)


async def test_workspace_global_seq_reader_never_skips_a_later_commit(app: App, team):
    """Readers paging by workspace_global_seq while many scopes commit
    concurrently: everything they ever see arrives in order, nothing below the
    cursor shows up later (the Synapse missed-event bug)."""
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channels = [await open_channel(owner, alpha.workspace_id, f"feed-{i}") for i in range(6)]
    done = trio.Event()
    seen: list[int] = []
    total = 6 * 20

    async def reader() -> None:
        cursor = 0
        while True:
            finished = done.is_set()
            rows = await app.db.run(messages.workspace_feed, alpha.workspace_id, alpha.owner.member_id, cursor, 50)
            for row in rows:
                assert row["workspace_global_seq"] == cursor + 1, "a smaller global seq committed after a larger one"
                cursor = row["workspace_global_seq"]
                seen.append(cursor)
            if finished and not rows:
                return

    async def sender(channel: dict) -> None:
        async with await signed_in(app, alpha.owner) as conn:
            for i in range(20):
                await conn.call("message.send", scope_id=channel["id"], content=str(i), **ws)

    async with trio.open_nursery() as outer:
        outer.start_soon(reader)
        async with trio.open_nursery() as senders:
            for channel in channels:
                senders.start_soon(sender, channel)
        done.set()
    assert seen == list(range(1, total + 1))


async def test_mentions_are_parsed_once_and_respect_authority(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="owner-bot", display_name="Bot", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "mentions", [bob.member_id, agent["id"]])
        bob_handle = "bob"
        sent = await owner.call("message.send", scope_id=channel["id"], **ws,
                                content=f"@{bob_handle} look, not `@carol` and\n> @carol quoted\n@owner-bot go")
        assert sent["metadata"]["mentions"] == [bob.member_id, agent["id"]]
        plain = await owner.call("message.send", scope_id=channel["id"], content="@carol is not here", **ws)
        assert "mentions" not in plain.get("metadata", {})  # not a member: stays plain text
        too_many = " ".join(f"@user{i}" for i in range(51))
        await expect_error("invalid", owner.call("message.send", scope_id=channel["id"], content=too_many, **ws))
    async with await signed_in(app, bob) as b:
        # Bob may not address the owner's private agent: plain text.
        other = await b.call("message.send", scope_id=channel["id"], content="@owner-bot do my bidding", **ws)
        assert "mentions" not in other.get("metadata", {})
        # A multi forward carries no live mentions; a single forward does.
        multi = await b.call("message.forward", scope_id=channel["id"],
                             source_message_ids=[sent["id"], plain["id"]], comment="see these", **ws)
        assert "mentions" not in multi.get("metadata", {})
        single = await b.call("message.forward", scope_id=channel["id"], source_message_ids=[sent["id"]], **ws)
        assert single["metadata"]["mentions"] == [bob.member_id]


async def test_threads_and_private_agent_admission(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        outsider_agent = await owner.call("agent.create", handle="outsider", display_name="Out", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "threads", [bob.member_id, agent["id"]])
        root = await owner.call("message.send", scope_id=channel["id"], content="root", **ws)
        reply = await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                 content="@helper @outsider please look", **ws)
        thread_id = reply["scope_id"]
        assert thread_id != channel["id"] and reply["seq"] == 1
        # The private agent of the parent was admitted by the mention; the outsider was not.
        assert reply["metadata"]["mentions"] == [agent["id"]]
        members = {m["member_id"]: m for m in (await owner.call("scope.members", scope_id=thread_id,
                                                                include_private=True, **ws))["members"]}
        assert members[agent["id"]]["visibility"] == "private"
        assert members[agent["id"]]["owner_member_id"] == alpha.owner.member_id
        assert outsider_agent["id"] not in members
        page = await owner.call("message.history", scope_id=thread_id, **ws)
        assert page["root"]["id"] == root["id"] and [m["content"] for m in page["messages"]][0].startswith("@helper")
        again = await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                 content="second", **ws)
        assert again["scope_id"] == thread_id and again["seq"] == 2
        assert (await owner.call("message.get", message_id=root["id"], **ws))["message"]["thread_scope_id"] == thread_id
    async with await signed_in(app, bob) as b:
        # Bob reads the parent, so replying joins him to the thread.
        mine = await b.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"], content="me too", **ws)
        assert mine["scope_id"] == thread_id and mine["seq"] == 3
    async with await signed_in(app, carol) as c:
        await expect_error("forbidden", c.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                               content="let me in", **ws))


async def test_edits_withdrawal_and_reactions(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "edits", [bob.member_id])
        message = await owner.call("message.send", scope_id=channel["id"], content="v1", **ws)
        await b.call("read.mark", scope_id=channel["id"], seq=1, **ws)
        edited = await owner.call("message.edit", message_id=message["id"], content="v2", expected_revision=1, **ws)
        assert (edited["revision"], edited["seq"], edited["id"]) == (2, 1, message["id"])
        error = await expect_error("conflict", owner.call("message.edit", message_id=message["id"], content="v3",
                                                          expected_revision=1, **ws))
        assert error.details["reason"] == "revision_mismatch"
        await expect_error("forbidden", b.call("message.edit", message_id=message["id"], content="hijack",
                                               expected_revision=2, **ws))
        detail = await b.call("message.get", message_id=message["id"], include_revisions=True, **ws)
        assert detail["message"]["content"] == "v2"
        assert [r["content"] for r in detail["revisions"]] == ["v1", "v2"]
        # Edits keep the read frontier.
        assert (await b.call("message.history", scope_id=channel["id"], **ws))["last_read_seq"] == 1

        for key in ("👍", "👍", ":party:"):
            await b.call("reaction.add", message_id=message["id"], key=key, **ws)
        await owner.call("reaction.add", message_id=message["id"], key="👍", **ws)
        summary = (await b.call("message.get", message_id=message["id"], **ws))["message"]["reactions"]
        assert [(r["key"], r["count"], r["me"]) for r in summary] == [("👍", 2, True), (":party:", 1, True)]
        await b.call("reaction.remove", message_id=message["id"], key=":party:", **ws)
        await expect_error("invalid", b.call("reaction.add", message_id=message["id"], key="not an emoji", **ws))
        await expect_error("invalid", b.call("reaction.add", message_id=message["id"], key="👍👍", **ws))
        reactions = await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_message_reactions"))
        activity = await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_activity_events"))
        assert (reactions, activity) == (2, 4)  # two live rows; each change is one non-message activity event
        assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_messages")) == 1

        withdrawn = await owner.call("message.withdraw", message_id=message["id"], **ws)
        assert withdrawn["state"] == "withdrawn" and withdrawn["content"] == ""
        for call in (owner.call("message.withdraw", message_id=message["id"], **ws),
                     owner.call("message.edit", message_id=message["id"], content="x", expected_revision=2, **ws),
                     b.call("reaction.add", message_id=message["id"], key="🎉", **ws)):
            assert (await expect_error("conflict", call)).details["reason"] == "message_withdrawn"
        page = await b.call("message.history", scope_id=channel["id"], **ws)
        tomb = page["messages"][0]
        assert (tomb["id"], tomb["seq"], tomb["state"], tomb["content"], tomb.get("reactions", [])) == (
            message["id"], 1, "withdrawn", "", [])


async def test_reactions_are_rate_limited_not_dropped(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    app.server.reaction_limiter.burst = 3
    app.server.reaction_limiter.rate = 0.001
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "limits")
        message = await owner.call("message.send", scope_id=channel["id"], content="react", **ws)
        keys = ["👍", "🎉", "❤️", "🚀"]
        outcomes = []
        for key in keys:
            try:
                await owner.call("reaction.add", message_id=message["id"], key=key, **ws)
                outcomes.append("ok")
            except ClientError as exc:
                outcomes.append(exc.code)
        assert outcomes == ["ok", "ok", "ok", "rate_limited"]
        summary = (await owner.call("message.get", message_id=message["id"], **ws))["message"]["reactions"]
        assert [r["key"] for r in summary] == keys[:3]


async def test_read_state_unread_counts_and_inbox(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        general = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id])
        random = await open_channel(owner, alpha.workspace_id, "random", [bob.member_id])
        quiet = await open_channel(owner, alpha.workspace_id, "quiet", [bob.member_id])
        for i in range(3):
            await owner.call("message.send", scope_id=general["id"], content=f"g{i}", **ws)
        await b.call("message.send", scope_id=general["id"], content="bob's own", **ws)
        await owner.call("message.send", scope_id=random["id"], content="r0", **ws)

        def by_scope(page):
            return {c["scope_id"]: c for c in page["conversations"]}

        inbox = by_scope(await b.call("inbox.list", **ws))
        # Bob's own message never counts as unread for Bob.
        assert inbox[general["id"]]["unread_count"] == 3 and inbox[random["id"]]["unread_count"] == 1
        assert inbox[general["id"]]["last_preview"] == "bob's own"
        assert (await b.call("read.mark", scope_id=general["id"], seq=2, **ws))["last_read_seq"] == 2
        assert (await b.call("read.mark", scope_id=general["id"], seq=1, **ws))["last_read_seq"] == 2  # forward only
        assert (await b.call("read.mark", scope_id=general["id"], seq=99, **ws))["last_read_seq"] == 4  # capped
        assert by_scope(await b.call("inbox.list", **ws))[general["id"]]["unread_count"] == 0
        await b.call("read.mark_unread", scope_id=general["id"], from_seq=2, **ws)
        row = by_scope(await b.call("inbox.list", **ws))[general["id"]]
        assert (row["unread_count"], row["manual_unread"]) == (2, True)
        first_unread = await b.call("message.history", scope_id=general["id"], from_first_unread=True, **ws)
        assert [m["content"] for m in first_unread["messages"]] == ["g1", "g2", "bob's own"]

        await b.call("conversation.action", scope_id=quiet["id"], action="pin", **ws)
        await b.call("conversation.action", scope_id=random["id"], action="hide", **ws)
        await b.call("conversation.action", scope_id=general["id"], action="mute", **ws)
        page = await b.call("inbox.list", **ws)
        order = [c["scope_id"] for c in page["conversations"]]
        assert order[0] == quiet["id"] and random["id"] not in order
        assert by_scope(page)[general["id"]]["notification_state"] == "mute"
        # A hidden conversation returns with new activity.
        await owner.call("message.send", scope_id=random["id"], content="r1", **ws)
        assert random["id"] in by_scope(await b.call("inbox.list", **ws))
        # Pagination with an opaque cursor covers everything exactly once.
        first = await b.call("inbox.list", limit=2, **ws)
        second = await b.call("inbox.list", limit=2, cursor=first["next_cursor"], **ws)
        assert "next_cursor" not in second
        assert len({c["scope_id"] for c in first["conversations"] + second["conversations"]}) == 3
        await expect_error("invalid", b.call("inbox.list", cursor="garbage!", **ws))


async def test_membership_intervals_and_roster_generation(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "roster")
        for i in range(3):
            await owner.call("message.send", scope_id=channel["id"], content=str(i), **ws)
        await owner.call("scope.invite", scope_id=channel["id"], member_ids=[bob.member_id], **ws)
        await expect_error("conflict", owner.call("scope.invite", scope_id=channel["id"],
                                                  member_ids=[bob.member_id], **ws))
        await owner.call("message.send", scope_id=channel["id"], content="after bob", **ws)
        await owner.call("scope.remove", scope_id=channel["id"], member_id=bob.member_id, **ws)
    rows = await app.db.run(lambda c: c.fetch(
        "SELECT effective_from_seq, effective_to_seq, last_read_seq FROM scope_memberships "
        "WHERE scope_id = $1 AND member_id = $2", channel["id"], bob.member_id))
    # Joined after seq 3 (baseline read), left after seq 4.
    assert [(r[0], r[1], r[2]) for r in rows] == [(4, 4, 3)]
    generation = await app.db.run(lambda c: c.fetchval("SELECT roster_generation FROM scopes WHERE id = $1",
                                                       channel["id"]))
    assert generation == 3  # create, invite, remove
    async with await signed_in(app, bob) as b:
        await expect_error("forbidden", b.call("message.history", scope_id=channel["id"], **ws))
        await b.call("scope.join", scope_id=channel["id"], **ws)
        assert len((await b.call("message.history", scope_id=channel["id"], **ws))["messages"]) == 4
        await b.call("scope.leave", scope_id=channel["id"], **ws)
    async with await signed_in(app, alpha.owner) as owner:
        await owner.call("scope.archive", scope_id=channel["id"], **ws)
        error = await expect_error("conflict", owner.call("message.send", scope_id=channel["id"], content="x", **ws))
        assert error.details["reason"] == "scope_archived"


@pytest.fixture
def settle_on_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """Request before `app`: the server's inline settler writes only when flushed."""
    monkeypatch.setattr(inline_settler, "LINGER_SECONDS", 3600)


async def test_inline_deliveries_are_settled_without_a_transaction_of_their_own(settle_on_flush, app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "settle", [bob.member_id])
        quiet = [await open_channel(owner, alpha.workspace_id, f"quiet-{i}", [bob.member_id]) for i in range(10)]
        sent = []

        async def send(scope_id: str, i: int) -> None:
            sent.append((await owner.call("message.send", scope_id=scope_id, content=f"m{i}", **ws))["id"])

        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(send, channel["id"], i)
        # One message into each of ten quiet channels: each actor's mailbox runs empty.
        for i, scope in enumerate(quiet):
            await send(scope["id"], 100 + i)
    # A busy actor marks a batch in its next batch's transaction; an idle one hands
    # its marks to the shared settler, which writes them together.
    await app.server.settler.flush()
    statuses = dict(await app.db.run(lambda c: c.fetch(
        "SELECT message_id, status FROM scope_fanout_outbox WHERE fanout_type = 'message.created'")))
    assert {statuses[m] for m in sent} == {"delivered"}
    assert app.server.settler.statements == 1


class ListSink:
    """A hub sink that keeps what it is handed."""

    def __init__(self, events: list) -> None:
        self.events = events

    def admit(self, event) -> None:
        self.events.append(event)

    def admit_run(self, run, write=False) -> None:
        return None  # event by event

    def skip(self, event) -> None:
        pass

    def write(self, frames) -> None:
        raise AssertionError("admit() returned no frame")


async def test_outbox_replays_what_a_crash_left_and_suppresses_withdrawn(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "outbox", [bob.member_id])
        kept = await owner.call("message.send", scope_id=channel["id"], content="kept", **ws)
        gone = await owner.call("message.send", scope_id=channel["id"], content="gone", **ws)
        delivered = []
        subscription = app.server.hub.subscribe(bob.member_id, ListSink(delivered))
        app.server.hub.follow_scope(subscription, channel["id"])
        await app.server.settler.flush()  # both were delivered inline (and marked) before the withdrawal
        await owner.call("message.withdraw", message_id=gone["id"], **ws)
    # Simulate a crash between commit and first delivery: back to pending and due.
    await app.db.run(lambda c: c.execute(
        "UPDATE scope_fanout_outbox SET status = 'pending', delivered_at = NULL, next_attempt_at = now() "
        "WHERE fanout_type = 'message.created'"))
    live = "SELECT count(*) FROM scope_fanout_outbox WHERE status IN ('pending', 'leased')"
    with trio.fail_after(10):  # the background worker may hold some leases meanwhile
        while await app.db.run(lambda c: c.fetchval(live)):
            await app.server.outbox.drain_once()
    statuses = dict(await app.db.run(lambda c: c.fetch(
        "SELECT message_id || ':' || fanout_type, status FROM scope_fanout_outbox")))
    assert statuses[f"{kept['id']}:message.created"] == "delivered"
    assert statuses[f"{gone['id']}:message.created"] == "suppressed"
    assert statuses[f"{gone['id']}:message.withdrawn"] == "delivered"
    assert sorted((e.event, e.data.id) for e in delivered) == [("message.created", kept["id"]),
                                                               ("message.withdrawn", gone["id"])]


async def test_bad_input_writes_nothing(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}

    async def snapshot():
        return await app.db.run(lambda c: c.fetchval(
            "SELECT (SELECT count(*) FROM scope_messages) + (SELECT count(*) FROM scope_memberships) "
            "+ (SELECT count(*) FROM scope_message_reactions) + (SELECT count(*) FROM scope_fanout_outbox) "
            "+ (SELECT count(*) FROM scopes) + (SELECT sum(latest_seq) FROM scopes)"))

    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "strict", [bob.member_id])
        message = await owner.call("message.send", scope_id=channel["id"], content="base", **ws)
        before = await snapshot()
        bad = [
            ("bad_frame", dict(op="message.send", scope_id=channel["id"], content=123)),
            ("bad_frame", dict(op="message.send", scope_id=channel["id"], content="x", extra=True)),
            ("bad_frame", dict(op="message.send", scope_id=channel["id"], content="x", client_message_id="")),
            ("bad_frame", dict(op="message.edit", message_id=message["id"], content="x", expected_revision=0)),
            ("invalid", dict(op="message.send", scope_id="nope", content="x")),
            ("bad_frame", dict(op="reaction.add", message_id=message["id"], key="")),
            ("invalid", dict(op="reaction.add", message_id=message["id"], key="two words")),
            ("not_found", dict(op="message.send", scope_id="scp_zzzzzzzzzzzzzz", content="x")),
            ("not_found", dict(op="scope.invite", scope_id=channel["id"], member_ids=["mem_zzzzzzzzzzzzzz"])),
            ("bad_frame", dict(op="channel.create", slug="Bad Slug", display_name="x")),
            ("unknown_op", dict(op="message.explode")),
        ]
        for code, fields in bad:
            op = fields.pop("op")
            await expect_error(code, owner.call(op, **fields, **ws))
        await expect_error("conflict", owner.call("channel.create", slug="strict", display_name="dup", **ws))
    assert await snapshot() == before
