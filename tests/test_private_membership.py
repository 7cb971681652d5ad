"""Private agents on the messaging surface, over the WebSocket against a real
PostgreSQL (issue 12; scope-model §3.3, §5.2, §8; collaborator-policy §4.3,
§8.7): explicit recipients on sends, owner_quote shares, thread admission of
private agents, and member lists that show private members only when asked."""

from __future__ import annotations

from client import connect
from tests.conftest import App
from tests.test_messaging import open_channel, team  # noqa: F401  (team is a fixture)
from tests.test_tenancy import expect_error, signed_in


async def _members(conn, scope_id: str, ws: dict, **fields) -> dict[str, dict]:
    return {m["member_id"]: m for m in (await conn.call("scope.members", scope_id=scope_id, **ws, **fields))["members"]}


async def _count(app: App, sql: str, *args) -> int:
    return await app.db.run(lambda c: c.fetchval(sql, *args))


async def test_explicit_recipients_reach_the_send_path_and_admit_into_the_thread(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        helper = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "recipients", [bob.member_id, helper["id"]])
        # The owner addresses its own private agent without an @mention in the text.
        root = await owner.call("message.send", scope_id=channel["id"], content="please summarize", **ws,
                                recipient_member_ids=[helper["id"], helper["id"]])
        assert root["metadata"]["recipients"] == [helper["id"]]
        assert "mentions" not in root["metadata"]
    async with await signed_in(app, bob) as b:
        # Bob opens the thread: the root's recipient, a private member of the parent, is admitted.
        reply = await b.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                             content="I can help too", **ws)
        members = await _members(b, reply["scope_id"], ws, include_private=True)
        assert set(members) == {alpha.owner.member_id, bob.member_id, helper["id"]}
        assert members[helper["id"]]["visibility"] == "private"
    async with await signed_in(app, alpha.owner) as owner:
        again = await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                 content="and this too", recipient_member_ids=[helper["id"]], **ws)
        assert again["metadata"]["recipients"] == [helper["id"]]


async def test_recipient_ids_and_server_written_metadata_are_checked(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        helper = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "shapes", [bob.member_id, helper["id"]])
        root = await owner.call("message.send", scope_id=channel["id"], content="root", **ws)
        before = await _count(app, "SELECT count(*) FROM scope_messages")
        scopes = await _count(app, "SELECT count(*) FROM scopes")
        # Bad shapes answer typed errors and write nothing (no thread opened either).
        error = await expect_error("invalid", owner.call("message.send", scope_id=channel["id"], content="x",
                                                         recipient_member_ids=["helper"], **ws))
        assert error.details["field"] == "recipient"
        await expect_error("invalid", owner.call("thread.reply", scope_id=channel["id"], content="x",
                                                 root_message_id=root["id"], recipient_member_ids=["x"], **ws))
        await expect_error("bad_frame", owner.call("message.send", scope_id=channel["id"], content="x", **ws,
                                                   recipient_member_ids=[helper["id"]] * 21))
        # Recipients, quotes and their attribution are server-written: a client cannot forge them.
        for key in ("recipients", "quote", "shared_by_member_id"):
            error = await expect_error("invalid", owner.call("message.send", scope_id=channel["id"], content="x",
                                                             metadata={key: [helper["id"]]}, **ws))
            assert error.details["field"] == f"metadata.{key}"
        assert await _count(app, "SELECT count(*) FROM scope_messages") == before
        assert await _count(app, "SELECT count(*) FROM scopes") == scopes


async def test_owner_quote_shares_a_readable_message_as_frozen_context(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, bob) as b:
        agent = await b.call("agent.create", handle="bobs-agent", display_name="Bob's agent", **ws)
        work = await open_channel(b, alpha.workspace_id, "work", [agent["id"], alpha.owner.member_id])
    async with await signed_in(app, alpha.owner) as owner:
        lounge = await open_channel(owner, alpha.workspace_id, "lounge", [bob.member_id, carol.member_id])
        secret = await open_channel(owner, alpha.workspace_id, "secret", [carol.member_id], visibility="private")
        hidden = await owner.call("message.send", scope_id=secret["id"], content="not for bob", **ws)
    async with await signed_in(app, carol) as c:
        # Carol is no collaborator of Bob's: her text reaches his agent only if Bob shares it.
        source = await c.call("message.send", scope_id=lounge["id"], content="@bob @bobs-agent ship it", **ws)
        assert source["metadata"]["mentions"] == [bob.member_id]
        second = await c.call("message.send", scope_id=lounge["id"], content="and the notes", **ws)
    async with await signed_in(app, bob) as b:
        quote = await b.call("message.forward", scope_id=work["id"], mode="owner_quote", comment="see carol's call",
                             source_message_ids=[source["id"], second["id"]], client_message_id="share-1", **ws)
        assert quote["message_type"] == "owner_quote" and quote["content"] == "see carol's call"
        assert quote["author_member_id"] == bob.member_id
        # The quoted mentions are inert: nobody is addressed by a share.
        assert "mentions" not in quote["metadata"] and "recipients" not in quote["metadata"]
        assert quote["metadata"]["shared_by_member_id"] == bob.member_id
        assert quote["metadata"]["quote"] == [
            {"source_message_id": m["id"], "source_scope_id": lounge["id"], "source_seq": m["seq"],
             "author_member_id": carol.member_id, "content": m["content"], "created_at_ms": m["created_at_ms"]}
            for m in (source, second)]
        # A message Bob cannot read cannot be shared (nor can its existence be probed).
        await expect_error("not_found", b.call("message.forward", scope_id=work["id"], mode="owner_quote",
                                               source_message_ids=[hidden["id"]], **ws))
    async with await signed_in(app, alpha.owner) as owner:
        key = await owner.call("apikey.create", name="agent", member_id=agent["id"], **ws)
    async with await signed_in(app, carol) as c:
        await c.call("message.edit", message_id=source["id"], content="changed my mind", expected_revision=1, **ws)
    async with await signed_in(app, bob) as b:
        # The quote is frozen: the source's later edit does not reach it.
        stored = (await b.call("message.get", message_id=quote["id"], **ws))["message"]
        assert stored["metadata"]["quote"][0]["content"] == "@bob @bobs-agent ship it"
    async with connect(app.url) as agent_conn:
        await agent_conn.auth(api_key=key["key"])
        # owner_quote is a human's share; an agent cannot make one.
        await expect_error("forbidden", agent_conn.call("message.forward", scope_id=work["id"], mode="owner_quote",
                                                        source_message_ids=[quote["id"]]))
    sources = await app.db.run(lambda c: c.fetch(
        "SELECT ordinal, source_kind, source_message_id, source_scope_id, source_seq FROM scope_message_sources "
        "WHERE message_id = $1 ORDER BY ordinal", quote["id"]))
    assert [tuple(r) for r in sources] == [(0, "owner_quote", source["id"], lounge["id"], source["seq"]),
                                           (1, "owner_quote", second["id"], lounge["id"], second["seq"])]
    # Sharing adds nobody as a collaborator, and nobody joins the target scope.
    assert await _count(app, "SELECT count(*) FROM task_scope_participant_metadata") == 0
    assert await _count(app, "SELECT count(*) FROM task_collaborator_events") == 0
    assert await _count(app, "SELECT count(*) FROM scope_memberships WHERE scope_id = $1 AND member_id = $2",
                        work["id"], carol.member_id) == 0


async def test_threads_admit_private_agents_of_the_parent_that_the_root_names(app: App, team):
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        helper = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        leaver = await owner.call("agent.create", handle="leaver", display_name="Leaver", **ws)
        writer = await owner.call("agent.create", handle="writer", display_name="Writer", **ws)
        outsider = await owner.call("agent.create", handle="outsider", display_name="Outsider", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "admission",
                                     [bob.member_id, carol.member_id, helper["id"], leaver["id"], writer["id"]])
        named = await owner.call("message.send", scope_id=channel["id"], **ws,
                                 content="@helper @leaver @outsider @carol take a look")
        # The outsider holds no membership of the channel: its mention is plain text.
        assert named["metadata"]["mentions"] == [helper["id"], leaver["id"], carol.member_id]
        await owner.call("scope.remove", scope_id=channel["id"], member_id=leaver["id"], **ws)
        sibling_root = await owner.call("message.send", scope_id=channel["id"], content="unrelated", **ws)
        unnamed = await owner.call("message.send", scope_id=channel["id"], content="no thread yet", **ws)
        key = await owner.call("apikey.create", name="writer", member_id=writer["id"], **ws)
    async with connect(app.url) as writer_conn:
        await writer_conn.auth(api_key=key["key"])
        report = await writer_conn.call("message.send", scope_id=channel["id"], content="status report")
    async with await signed_in(app, bob) as b:
        named_thread = (await b.call("thread.reply", scope_id=channel["id"], root_message_id=named["id"],
                                     content="on it", **ws))["scope_id"]
        report_thread = (await b.call("thread.reply", scope_id=channel["id"], root_message_id=report["id"],
                                      content="thanks", **ws))["scope_id"]
        sibling_thread = (await b.call("thread.reply", scope_id=channel["id"], root_message_id=sibling_root["id"],
                                       content="hm", **ws))["scope_id"]
        members = await _members(b, named_thread, ws, include_private=True)
        # The private agent the root addressed joins as a private member of its owner; the one that
        # left the parent does not, nor does the outsider; the mentioned public member joins by replying.
        assert set(members) == {bob.member_id, alpha.owner.member_id, helper["id"]}
        assert (members[helper["id"]]["visibility"], members[helper["id"]]["owner_member_id"]) == (
            "private", alpha.owner.member_id)
        assert members[bob.member_id]["visibility"] == "public"
        # A private agent that wrote the root joins its thread as a private member.
        members = await _members(b, report_thread, ws, include_private=True)
        assert set(members) == {bob.member_id, writer["id"]}
        assert (members[writer["id"]]["visibility"], members[writer["id"]]["owner_member_id"]) == (
            "private", alpha.owner.member_id)
        # Never into a sibling thread.
        assert set(await _members(b, sibling_thread, ws, include_private=True)) == {bob.member_id,
                                                                                     alpha.owner.member_id}
    async with connect(app.url) as writer_conn:
        await writer_conn.auth(api_key=key["key"])
        # Admitted means it may write there (as a member of the thread).
        answer = await writer_conn.call("thread.reply", scope_id=channel["id"], root_message_id=report["id"],
                                        content="follow-up")
        assert answer["scope_id"] == report_thread
        await expect_error("not_found", writer_conn.call("message.send", scope_id=named_thread, content="me too"))
        # Replying does not let a private agent into a thread nothing admitted it to, existing or new.
        for root in (named, sibling_root, unnamed):
            error = await expect_error("forbidden", writer_conn.call(
                "thread.reply", scope_id=channel["id"], root_message_id=root["id"], content="let me in"))
            assert error.details["reason"] == "private_agent_not_admitted"
    async with await signed_in(app, bob) as b:
        assert writer["id"] not in await _members(b, sibling_thread, ws, include_private=True)
        assert (await b.call("message.get", message_id=unnamed["id"], **ws))["message"].get("thread_scope_id") is None


async def test_member_lists_show_private_members_only_when_asked(app: App, team):
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        helper = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "roster", [bob.member_id, helper["id"]])
        root = await owner.call("message.send", scope_id=channel["id"], content="no agents here", **ws)
        thread = (await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                   content="just us", **ws))["scope_id"]
        dm = await owner.call("dm.open", member_id=helper["id"], **ws)
    async with await signed_in(app, bob) as b:
        public = await _members(b, channel["id"], ws)
        assert set(public) == {alpha.owner.member_id, bob.member_id}
        assert all(m["visibility"] == "public" and "owner_member_id" not in m for m in public.values())
        everyone = await _members(b, channel["id"], ws, include_private=True)
        assert set(everyone) == {alpha.owner.member_id, bob.member_id, helper["id"]}
        assert everyone[helper["id"]] == {"member_id": helper["id"], "handle": "helper", "display_name": "Helper",
                                          "kind": "agent", "visibility": "private",
                                          "owner_member_id": alpha.owner.member_id}
        await expect_error("bad_frame", b.call("scope.members", scope_id=channel["id"], include_private="yes", **ws))
    async with await signed_in(app, alpha.owner) as owner:
        # Only where it holds a membership: the parent's private member is not listed in a thread.
        assert set(await _members(owner, thread, ws, include_private=True)) == {alpha.owner.member_id}
        assert set(await _members(owner, dm["id"], ws)) == {alpha.owner.member_id}
        in_dm = await _members(owner, dm["id"], ws, include_private=True)
        assert in_dm[helper["id"]]["owner_member_id"] == alpha.owner.member_id


async def test_owner_quote_caps_frozen_text_and_replays_after_the_source_changes(app: App, team):
    """A frozen quote keeps at most QUOTE_FROZEN_CHARS of each source (marked
    truncated), and its digest covers the source refs, not the frozen copies:
    a retry after the source was edited replays the original share; the first
    share by an owner into a channel creates the owner's Scope Execution."""
    from server.messaging import QUOTE_FROZEN_CHARS

    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "quotes", [bob.member_id])
        long = await b.call("message.send", scope_id=channel["id"], content="x" * (QUOTE_FROZEN_CHARS + 500), **ws)
        share = dict(scope_id=channel["id"], mode="owner_quote", source_message_ids=[long["id"]],
                     client_message_id="share-1", **ws)
        first = await owner.call("message.forward", **share)
        frozen = first["metadata"]["quote"][0]
        assert len(frozen["content"]) == QUOTE_FROZEN_CHARS and frozen["truncated"] is True
        await b.call("message.edit", message_id=long["id"], content="short now", expected_revision=1, **ws)
        retry = await owner.call("message.forward", **share)
        assert (retry["id"], retry["replayed"]) == (first["id"], True)
    assert await _count(app, "SELECT count(*) FROM scope_executions WHERE owner_member_id = $1 AND scope_id = $2 "
                        "AND created_trigger = 'owner_quote'", alpha.owner.member_id, channel["id"]) == 1
