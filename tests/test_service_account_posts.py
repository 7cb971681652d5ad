"""Workspace service accounts, posts and reading (issue 14; service-account.md §2.2,
§4.1–§4.4, §4.6, §5, §9.2, §9.4) over the WebSocket against PostgreSQL: only managers
post, once the first audience pass is done, as the account's service member; nobody
writes ordinary messages into the scope; managers share one idempotency namespace; a
post writes the same three rows whatever the audience; edits and withdrawals keep id,
seq and read frontiers; the Inbox conversation `serviceAccount:{scope}` with its
actions and the bounded multi-conversation mark-read; shared pins and the top notice;
the directory, and governance only for those who govern."""

from __future__ import annotations

import uuid

import trio

from client import connect
from tests.conftest import MEMBER_PASSWORD, App
from tests.test_messaging import open_channel, team  # noqa: F401  (team is a fixture)
from tests.test_service_account_audience import (
    audience_settled,
    bulk_humans,
    conversation,
    create_account,
    expect_error_in,
    follow_workspace,
    next_event,
    post,
    serve,
)
from tests.test_tenancy import expect_error, signed_in


def ids(profile_or_detail: dict) -> tuple[str, str, str]:
    """(service account id, scope id, author member id)"""
    profile = profile_or_detail.get("profile", profile_or_detail)
    return profile["service_account_id"], profile["scope_id"], profile["member_id"]


async def count_rows(db, sql: str, *args) -> int:
    return await db.run(lambda c: c.fetchval(sql, *args))


async def reason_of(code: str, coro) -> str | None:
    return (await expect_error(code, coro)).details.get("reason")


async def idempotency_conflict(coro) -> None:
    """design.md says conflict `idempotency_conflict`; message.send answers the code
    `idempotency_conflict` itself: either spelling, nothing else."""
    error = await expect_error_in(("conflict", "idempotency_conflict"), coro)
    assert error.code == "idempotency_conflict" or error.details.get("reason") == "idempotency_conflict", error


# --- who posts, and into what ------------------------------------------------------------------

async def test_only_managers_post_and_nobody_writes_ordinary_messages_into_the_scope(app: App, team):  # noqa: F811
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        account_id, scope_id, author_id = ids(await create_account(owner, ws, "News"))
        channel = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id])
        in_channel = await owner.call("message.send", scope_id=channel["id"], content="channel talk", **ws)
        assert await reason_of("forbidden", post(b, ws, account_id, "Mine now")) == "not_a_manager"

        sent = await post(owner, ws, account_id, "Launch", "**big** news")
        assert (sent["message_type"], sent["author_type"], sent["author_member_id"], sent["content"]) == (
            "service_account_post", "service", author_id, "**big** news")
        assert sent["metadata"] == {"serviceAccountPost": {"title": "Launch"}}  # no byline unless asked
        signed = await post(owner, ws, account_id, "Signed", byline=True)
        assert signed["metadata"] == {"serviceAccountPost": {"title": "Signed"},
                                      "byline": {"member_id": alpha.owner.member_id}}
        # Readers see the account as the author, with its profile, in history and permalinks.
        history = await b.call("message.history", scope_id=scope_id, **ws)
        assert [m["id"] for m in history["messages"]] == [sent["id"], signed["id"]]
        got = (await b.call("message.get", message_id=sent["id"], **ws))["message"]
        for message in (*history["messages"], got):
            assert (message["author_profile"]["service_account_id"], message["author_profile"]["display_name"],
                    message["author_profile"]["member_id"]) == (account_id, "News", author_id)

        # The scope is read-only for ordinary writes, a manager's included.
        for conn in (owner, b):
            assert await reason_of("forbidden", conn.call("message.send", scope_id=scope_id, content="hi",
                                                          **ws)) == "read_only_scope"
            assert await reason_of("forbidden", conn.call("thread.reply", scope_id=scope_id, root_message_id=sent["id"],
                                                          content="a reply", **ws)) == "read_only_scope"
            assert await reason_of("forbidden", conn.call("message.forward", scope_id=scope_id,
                                                          source_message_ids=[in_channel["id"]],
                                                          **ws)) == "read_only_scope"
        # Its message type belongs to the post op: no ordinary send writes it, anywhere.
        for message_type in ("service_account_post", "app_interactive_card"):
            await expect_error("invalid", owner.call("message.send", scope_id=channel["id"], content="x",
                                                     message_type=message_type, **ws))
        # Readers react.
        await b.call("reaction.add", message_id=sent["id"], key="👍", **ws)
        reactions = (await owner.call("message.get", message_id=sent["id"], **ws))["message"]["reactions"]
        assert [(r["key"], r["count"]) for r in reactions] == [("👍", 1)]

        # Managing is what lets you post: added, Carol posts; removed, she no longer does.
        await owner.call("service_account.managers.add", service_account_id=account_id, member_id=carol.member_id,
                         **ws)
        async with await signed_in(app, carol) as c:
            by_carol = await post(c, ws, account_id, "From Carol", byline=True)
            assert (by_carol["author_member_id"], by_carol["metadata"]["byline"]) == (
                author_id, {"member_id": carol.member_id})
            await owner.call("service_account.managers.remove", service_account_id=account_id,
                             member_id=carol.member_id, **ws)
            assert await reason_of("forbidden", post(c, ws, account_id, "Again")) == "not_a_manager"
    assert await count_rows(app.db, "SELECT count(*) FROM scope_messages WHERE scope_id = $1", scope_id) == 3


async def test_post_bad_input_writes_nothing(app: App, team):  # noqa: F811
    alpha, beta, _, _ = team
    ws = {"workspace_id": alpha.workspace_id}

    async def snapshot() -> int:
        return await count_rows(app.db, "SELECT (SELECT count(*) FROM scope_messages) "
                                        "+ (SELECT count(*) FROM scope_fanout_outbox) "
                                        "+ (SELECT count(*) FROM service_account_audit_events)")

    async with await signed_in(app, alpha.owner) as owner:
        account_id, scope_id, _ = ids(await create_account(owner, ws, "News"))
        before = await snapshot()
        for code, fields in (
                ("bad_frame", dict(title="")), ("bad_frame", dict(title="t" * 201)),
                ("bad_frame", dict(content="")), ("bad_frame", dict(content="x" * 40001)),
                ("bad_frame", dict(byline="yes")), ("bad_frame", dict(extra=1)),
                ("invalid", dict(service_account_id="not-an-id")),
                ("not_found", dict(service_account_id="sac_zzzzzzzzzzzzzz"))):
            await expect_error(code, owner.call("service_account.post", **{
                "service_account_id": account_id, "title": "t", "content": "c",
                "client_message_id": str(uuid.uuid4()), **fields}, **ws))
        # The client id is a UUID.
        await expect_error_in(("bad_frame", "invalid"), post(owner, ws, account_id, "t", client_message_id="c-1"))
    async with await signed_in(app, beta.owner) as other:  # another workspace's account does not exist here
        await expect_error("not_found", post(other, {"workspace_id": beta.workspace_id}, account_id, "t"))
    assert await snapshot() == before


async def test_posts_wait_for_the_first_audience_pass(db, nursery, tenants, member_password_hash):
    """A new account refuses posts until its first reconcile pass completes.  Batches of
    one over 201 humans: the pass is 201 transactions in the scope's actor, and the post
    is sent as soon as the account exists."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    await bulk_humans(db, alpha.workspace_id, 200, member_password_hash, "crowd")
    url = await serve(db, nursery, service_account_audience_batch=1)
    async with connect(url) as owner:
        await owner.login(alpha.owner.email, MEMBER_PASSWORD)
        await follow_workspace(owner, ws)
        request = await owner.call("service_account.request.submit", client_request_id="create-news", name="News",
                                   **ws)
        account_id = request["created_service_account_id"]
        assert request["business_state"] == "provisioning"
        assert await reason_of("conflict", post(owner, ws, account_id, "Too early")) == "audience_not_ready"
        during = await owner.call("service_account.audience.get", service_account_id=account_id, **ws)
        assert during["state"] == "provisioning" and during["batches_done"] < 201, during
        ready = await audience_settled(owner, ws, account_id, member_count=201)
        assert ready["batches_done"] >= 201
        fulfilled = await owner.call("service_account.request.get", request_id=request["id"], **ws)
        assert fulfilled["business_state"] == "fulfilled"
        await post(owner, ws, account_id, "Now")
    assert await count_rows(db, "SELECT count(*) FROM scope_messages WHERE message_type = 'service_account_post'") == 1


async def test_managers_share_one_client_message_id(app: App, team):  # noqa: F811
    alpha, _, _, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, carol) as c:
        account_id, scope_id, _ = ids(await create_account(owner, ws, "News"))
        await owner.call("service_account.managers.add", service_account_id=account_id, member_id=carol.member_id,
                         **ws)
        client_message_id = str(uuid.uuid4())
        results: list[dict] = []

        async def send(conn) -> None:
            results.append(await post(conn, ws, account_id, "Same", "same body",
                                      client_message_id=client_message_id))

        async with trio.open_nursery() as senders:
            for conn in (owner, c, owner, c):
                senders.start_soon(send, conn)
        assert len({r["id"] for r in results}) == 1 and len(results) == 4
        assert sorted(r.get("replayed", False) for r in results) == [False, True, True, True]
        message_id = results[0]["id"]
        # Same key, another body — or another byline, which the digest covers — is a conflict.
        await idempotency_conflict(post(c, ws, account_id, "Same", "other body", client_message_id=client_message_id))
        await idempotency_conflict(post(c, ws, account_id, "Same", "same body", byline=True,
                                        client_message_id=client_message_id))
        signed_id = str(uuid.uuid4())
        signed = await post(owner, ws, account_id, "Signed", byline=True, client_message_id=signed_id)
        await idempotency_conflict(post(c, ws, account_id, "Signed", byline=True, client_message_id=signed_id))
        again = await post(owner, ws, account_id, "Signed", byline=True, client_message_id=signed_id)
        assert (again["id"], again.get("replayed")) == (signed["id"], True)
    assert await count_rows(app.db, "SELECT count(*) FROM scope_messages WHERE scope_id = $1", scope_id) == 2
    assert await count_rows(app.db, "SELECT count(*) FROM service_account_audit_events WHERE message_id = $1",
                            message_id) == 1


PER_POST_TABLES = ("scope_messages", "scope_fanout_outbox", "service_account_audit_events")
PER_RECIPIENT_TABLES = ("scope_memberships", "scope_targeted_deliveries", "conversation_member_states",
                        "scope_notification_settings")


async def test_a_post_writes_the_same_rows_for_3_or_300_humans(app: App, team, member_password_hash):  # noqa: F811
    alpha, beta, _, _ = team
    await bulk_humans(app.db, beta.workspace_id, 299, member_password_hash, "beta")

    async def counts() -> tuple[int, ...]:
        return tuple([await count_rows(app.db, f"SELECT count(*) FROM {table}")
                      for table in PER_POST_TABLES + PER_RECIPIENT_TABLES])

    deltas = {}
    for tenant, humans in ((alpha, 3), (beta, 300)):
        ws = {"workspace_id": tenant.workspace_id}
        async with await signed_in(app, tenant.owner) as owner:
            detail = await create_account(owner, ws, "News")
            assert detail["governance"]["audience"]["member_count"] == humans
            before = await counts()
            await post(owner, ws, detail["profile"]["service_account_id"], "Hello everyone")
            deltas[humans] = tuple(after - was for after, was in zip(await counts(), before))
    assert deltas == {3: (1, 1, 1, 0, 0, 0, 0), 300: (1, 1, 1, 0, 0, 0, 0)}


# --- edit and withdraw -------------------------------------------------------------------------

async def test_edit_and_withdraw_keep_the_message_and_the_read_frontier(app: App, team):  # noqa: F811
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, carol) as c, \
            await signed_in(app, bob) as b:
        account_id, scope_id, author_id = ids(await create_account(owner, ws, "News"))
        await owner.call("service_account.managers.add", service_account_id=account_id, member_id=carol.member_id,
                         **ws)
        await b.call("subscribe", scopes=[{"scope_id": scope_id}], **ws)
        original = await post(owner, ws, account_id, "v1", "first text")
        assert (await next_event(b, "message.created"))["data"]["id"] == original["id"]
        assert (await b.call("read.mark", scope_id=scope_id, seq=original["seq"], **ws))["last_read_seq"] == 1

        edited = await c.call("service_account.post.edit", message_id=original["id"], title="v2",
                              content="second text", expected_revision=1, reason="typo", **ws)
        assert (edited["id"], edited["seq"], edited["revision"], edited["author_member_id"], edited["content"]) == (
            original["id"], original["seq"], 2, author_id, "second text")
        assert edited["metadata"]["serviceAccountPost"] == {"title": "v2"}
        event = await next_event(b, "message.edited")
        assert (event["data"]["id"], event["data"]["content"], event["data"]["metadata"]["serviceAccountPost"]) == (
            original["id"], "second text", {"title": "v2"})
        assert (await b.call("message.history", scope_id=scope_id, **ws))["last_read_seq"] == 1
        assert conversation(await b.call("inbox.list", **ws), scope_id)["unread_count"] == 0

        assert await reason_of("conflict", owner.call("service_account.post.edit", message_id=original["id"],
                                                      title="v3", content="x", expected_revision=1,
                                                      **ws)) == "revision_mismatch"
        assert await reason_of("forbidden", b.call("service_account.post.edit", message_id=original["id"],
                                                   title="v3", content="x", expected_revision=2,
                                                   **ws)) == "not_a_manager"
        # The ordinary author ops do not reach a post: its author is the account.
        await expect_error("forbidden", owner.call("message.edit", message_id=original["id"], content="x",
                                                   expected_revision=2, **ws))
        await expect_error("forbidden", owner.call("message.withdraw", message_id=original["id"], **ws))
        await expect_error("bad_frame", owner.call("service_account.post.withdraw", message_id=original["id"],
                                                   expected_revision=2, reason="", **ws))

        withdrawn = await owner.call("service_account.post.withdraw", message_id=original["id"], expected_revision=2,
                                     reason="posted in error", **ws)
        assert (withdrawn["id"], withdrawn["seq"], withdrawn["state"], withdrawn["content"]) == (
            original["id"], original["seq"], "withdrawn", "")
        assert (await next_event(b, "message.withdrawn"))["data"]["id"] == original["id"]
        for call in (c.call("service_account.post.edit", message_id=original["id"], title="v4", content="x",
                            expected_revision=withdrawn["revision"], **ws),
                     c.call("service_account.post.withdraw", message_id=original["id"],
                            expected_revision=withdrawn["revision"], reason="again", **ws)):
            assert await reason_of("conflict", call) == "message_withdrawn"
        history = await b.call("message.history", scope_id=scope_id, **ws)
        assert [(m["id"], m["seq"], m["state"]) for m in history["messages"]] == [(original["id"], 1, "withdrawn")]
        assert history["last_read_seq"] == 1

        audit = await owner.call("service_account.audit.list", service_account_id=account_id, **ws)
        trail = [e for e in reversed(audit["events"]) if e.get("message_id") == original["id"]]  # newest first
        assert [(e["subject_type"], e.get("caused_by_member_id"), e.get("execution_member_id")) for e in trail] == [
            ("message", alpha.owner.member_id, alpha.owner.member_id),
            ("message", carol.member_id, carol.member_id),
            ("message", alpha.owner.member_id, alpha.owner.member_id)]
        assert [e["action"] for e in trail] == ["message.created", "message.edited", "message.withdrawn"]
        assert [e["message_version"] for e in trail] == [1, 2, withdrawn["revision"]]
        assert trail[2]["comment"] == "posted in error"
    assert await count_rows(app.db, "SELECT count(*) FROM service_account_audit_events WHERE message_id = $1",
                            original["id"]) == 3
    assert await count_rows(app.db, "SELECT count(*) FROM scope_messages WHERE scope_id = $1", scope_id) == 1


# --- the Inbox ---------------------------------------------------------------------------------

async def test_the_inbox_conversation_and_its_actions(app: App, team):  # noqa: F811
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        account_id, scope_id, _ = ids(await create_account(owner, ws, "News"))
        conversation_id = f"serviceAccount:{scope_id}"
        channel = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id])
        await owner.call("message.send", scope_id=channel["id"], content="hello", **ws)
        # No post yet: no conversation, though Bob is in the audience.
        assert conversation(await b.call("inbox.list", **ws), scope_id) is None
        posts = [await post(owner, ws, account_id, f"post {i}") for i in range(2)]

        async def row() -> dict | None:
            return conversation(await b.call("inbox.list", **ws), scope_id)

        first = await row()
        assert (first["conversation_id"], first["kind"], first["type"], first["unread_count"]) == (
            conversation_id, "serviceAccount", "service_account", 2)
        assert (first["service_account"]["service_account_id"], first["service_account"]["display_name"],
                first["service_account"]["conversation_id"]) == (account_id, "News", conversation_id)
        assert first["last_message_id"] == posts[1]["id"]

        async def act(action: str, target: str = conversation_id) -> None:
            await b.call("conversation.action", conversation_id=target, action=action, **ws)

        await act("mark_read")
        assert ((await row())["unread_count"], (await row())["last_read_seq"]) == (0, 2)
        await act("mark_unread")
        assert (await row())["manual_unread"] is True
        await act("mark_read", scope_id)  # a bare scope id names it too
        assert (await row())["manual_unread"] is False
        await act("pin")
        assert (await b.call("inbox.list", **ws))["conversations"][0]["scope_id"] == scope_id
        assert (await row())["pinned"] is True
        await act("unpin")
        await act("hide")
        assert await row() is None
        await act("restore")
        assert (await row()) is not None
        await act("hide")
        later = await post(owner, ws, account_id, "post 2")
        assert (await row())["last_message_id"] == later["id"]  # a hidden conversation returns with activity
        await expect_error("not_found", b.call("conversation.action", conversation_id="serviceAccount:scp_zzzzzzzzzzzzzz",
                                               action="pin", **ws))
        await expect_error("invalid", b.call("conversation.action", conversation_id="serviceAccount:nope",
                                             action="pin", **ws))

        # Mute decides attention as in any other scope: both muted, both still count unread.
        await act("mute")
        await b.call("conversation.action", scope_id=channel["id"], action="mute", **ws)
        await b.call("read.mark", scope_id=channel["id"], seq=1, **ws)
        await act("mark_read")
        await owner.call("message.send", scope_id=channel["id"], content="again", **ws)
        await post(owner, ws, account_id, "post 3")
        page = await b.call("inbox.list", **ws)
        assert [(conversation(page, s)["notification_state"], conversation(page, s)["unread_count"])
                for s in (scope_id, channel["id"])] == [("mute", 1), ("mute", 1)]
        await act("unmute")
        assert (await row())["notification_state"] == "active"
        await b.call("notification.set", scope_id=scope_id, state="quiet", **ws)
        assert (await row())["notification_state"] == "quiet"
        assert await app.db.run(lambda c: c.fetchval(
            "SELECT count(*) FROM scope_targeted_deliveries WHERE scope_id = $1", scope_id)) == 0


async def test_mark_read_many(app: App, team):  # noqa: F811
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        account_id, scope_id, _ = ids(await create_account(owner, ws, "News"))
        _, other_scope, _ = ids(await create_account(owner, ws, "Other"))
        channel = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id])
        secret = await open_channel(owner, alpha.workspace_id, "secret", visibility="private")
        for i in range(3):
            await post(owner, ws, account_id, f"post {i}")
            await owner.call("message.send", scope_id=channel["id"], content=f"m{i}", **ws)
        items = [{"conversation_id": f"serviceAccount:{scope_id}", "read_through_seq": 2},
                 {"conversation_id": channel["id"], "read_through_seq": 3},
                 {"conversation_id": "serviceAccount:scp_zzzzzzzzzzzzzz", "read_through_seq": 1},
                 {"conversation_id": secret["id"], "read_through_seq": 1},
                 {"conversation_id": f"serviceAccount:{other_scope}", "read_through_seq": 9}]
        result = await b.call("conversation.mark_read_many", items=items, **ws)
        assert [(r["conversation_id"], r["status"], r.get("last_read_seq")) for r in result["results"]] == [
            (f"serviceAccount:{scope_id}", "ok", 2), (channel["id"], "ok", 3),
            ("serviceAccount:scp_zzzzzzzzzzzzzz", "not_found", None), (secret["id"], "not_found", None),
            (f"serviceAccount:{other_scope}", "ok", 0)]  # capped at the tail of an empty scope
        page = await b.call("inbox.list", **ws)
        assert conversation(page, scope_id)["unread_count"] == 1 and conversation(page, channel["id"])[
            "unread_count"] == 0
        # Forward only, like read.mark.
        again = await b.call("conversation.mark_read_many", items=[{**items[0], "read_through_seq": 1}], **ws)
        assert again["results"][0]["last_read_seq"] == 2
        duplicate = [items[0], {**items[0], "read_through_seq": 3}]
        await expect_error("invalid", b.call("conversation.mark_read_many", items=duplicate, **ws))
        too_many = [{"conversation_id": f"serviceAccount:scp_{i:014d}", "read_through_seq": 1} for i in range(101)]
        await expect_error_in(("bad_frame", "invalid"), b.call("conversation.mark_read_many", items=too_many, **ws))
        await expect_error_in(("bad_frame", "invalid"), b.call("conversation.mark_read_many", items=[], **ws))
        hundred = too_many[:100]
        assert {r["status"] for r in (await b.call("conversation.mark_read_many", items=hundred, **ws))[
            "results"]} == {"not_found"}


async def test_the_service_account_namespace_names_only_service_accounts(app: App, team):  # noqa: F811
    """`serviceAccount:{scope}` is a service account's conversation id: with a channel's id it names nothing."""
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id])
        await owner.call("message.send", scope_id=channel["id"], content="hello", **ws)
        disguised = f"serviceAccount:{channel['id']}"
        await expect_error("not_found", b.call("conversation.action", conversation_id=disguised, action="pin", **ws))
        result = await b.call("conversation.mark_read_many", items=[{"conversation_id": disguised,
                                                                     "read_through_seq": 1}], **ws)
        assert [r["status"] for r in result["results"]] == ["not_found"]
        row = conversation(await b.call("inbox.list", **ws), channel["id"])
        assert (row["pinned"], row["unread_count"]) == (False, 1)


# --- shared pins and the top notice ------------------------------------------------------------

async def test_shared_pins_and_one_top_notice(app: App, team):  # noqa: F811
    alpha, beta, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        account_id, scope_id, _ = ids(await create_account(owner, ws, "News"))
        first, second = [await post(owner, ws, account_id, f"post {i}") for i in range(2)]
        channel = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id])
        in_channel = await owner.call("message.send", scope_id=channel["id"], content="x", **ws)
        await b.call("subscribe", scopes=[{"scope_id": scope_id}], **ws)

        assert await reason_of("forbidden", b.call("pin.add", message_id=first["id"], **ws)) == "not_a_manager"
        pin = await owner.call("pin.add", message_id=first["id"], **ws)
        assert (pin["scope_id"], pin["message_id"], pin["top_notice"], pin["pinned_by_member_id"]) == (
            scope_id, first["id"], False, alpha.owner.member_id)
        changed = (await next_event(b, "pin.changed"))["data"]
        assert (changed["message_id"], changed["pinned"], changed["top_notice"], changed["member_id"]) == (
            first["id"], True, False, alpha.owner.member_id)

        async def pins() -> list[tuple[str, bool]]:
            return [(p["message_id"], p["top_notice"]) for p in (await b.call("pin.list", scope_id=scope_id,
                                                                               **ws))["pins"]]

        await owner.call("pin.add", message_id=second["id"], top_notice=True, **ws)
        assert (await pins())[0] == (second["id"], True)
        await owner.call("pin.add", message_id=first["id"], top_notice=True, **ws)  # replaces the top notice
        listed = await pins()
        assert listed[0] == (first["id"], True) and [top for _, top in listed].count(True) == 1
        assert await reason_of("forbidden", b.call("pin.remove", message_id=first["id"], **ws)) == "not_a_manager"
        await owner.call("pin.remove", message_id=first["id"], **ws)
        assert first["id"] not in [m for m, _ in await pins()]
        removed = await next_event(b, "pin.changed", lambda d: d["message_id"] == first["id"] and not d["pinned"])
        assert removed["data"]["member_id"] == alpha.owner.member_id
        assert await reason_of("invalid", owner.call("pin.add", message_id=in_channel["id"],
                                                     **ws)) == "scope_type_not_supported"
        assert await reason_of("invalid", b.call("pin.list", scope_id=channel["id"],
                                                 **ws)) == "scope_type_not_supported"
        # Every pin change is a manager's audited command.
        audit = (await owner.call("service_account.audit.list", service_account_id=account_id, **ws))["events"]
        pin_actions = [(e["action"], e["message_id"], e["details"]["top_notice"]) for e in audit
                       if e["action"].startswith("pin.")]
        assert pin_actions == [("pin.removed", first["id"], False), ("pin.added", first["id"], True),
                               ("pin.added", second["id"], True), ("pin.added", first["id"], False)]
    async with await signed_in(app, beta.owner) as other:
        await expect_error("not_found", other.call("pin.list", workspace_id=beta.workspace_id, scope_id=scope_id))


# --- the directory -----------------------------------------------------------------------------

async def test_the_directory_and_who_sees_governance(app: App, team):  # noqa: F811
    alpha, beta, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        created = {}
        for name, description in (("Weekly News", "Company announcements"), ("Wellness", "Health tips"),
                                  ("IT Desk", "Weekly maintenance windows")):
            created[name] = await create_account(owner, ws, name, description)

        async def names(conn, **query) -> list[str]:
            page = await conn.call("service_account.list", **query, **ws)
            return sorted(p["display_name"] for p in page["accounts"])

        assert await names(b) == ["IT Desk", "Weekly News", "Wellness"]  # every active human browses it
        assert await names(b, query="wee") == ["IT Desk", "Weekly News"]  # name or description prefix
        assert await names(b, query="health") == ["Wellness"]
        assert await names(b, query="NEWS") == ["Weekly News"]  # any word, any case
        assert await names(b, query="zzz") == []
        profile = next(p for p in (await b.call("service_account.list", query="it", **ws))["accounts"])
        account_id = created["IT Desk"]["profile"]["service_account_id"]
        assert {k: profile[k] for k in ("service_account_id", "actor_type", "service_kind", "target_id",
                                        "conversation_id", "audience", "description")} == {
            "service_account_id": account_id, "actor_type": "service", "service_kind": "service_account",
            "target_id": f"service-account:{account_id}",
            "conversation_id": f"serviceAccount:{created['IT Desk']['profile']['scope_id']}",
            "audience": "all_active_humans", "description": "Weekly maintenance windows"}
        # One page at a time, each account once.
        seen, cursor = [], None
        while True:
            page = await b.call("service_account.list", limit=1, **({"cursor": cursor} if cursor else {}), **ws)
            seen += [p["service_account_id"] for p in page["accounts"]]
            cursor = page.get("next_cursor")
            if cursor is None:
                break
        assert sorted(seen) == sorted(d["profile"]["service_account_id"] for d in created.values())
        assert await reason_of("invalid", b.call("service_account.list", cursor="garbage!", **ws)) == "bad_cursor"

        # Governance only for those who govern.
        as_reader = await b.call("service_account.get", service_account_id=account_id, **ws)
        assert "governance" not in as_reader and as_reader["profile"] == profile
        governance = (await owner.call("service_account.get", service_account_id=account_id, **ws))["governance"]
        assert governance["management_kind"] == "workspace"
        assert [m["member_id"] for m in governance["managers"]] == [alpha.owner.member_id]
        assert governance["audience"]["member_count"] == 3
        await owner.call("service_account.managers.add", service_account_id=account_id, member_id=carol.member_id,
                         **ws)
        async with await signed_in(app, carol) as c:
            assert "governance" in await c.call("service_account.get", service_account_id=account_id, **ws)
    async with await signed_in(app, beta.owner) as other:
        assert (await other.call("service_account.list", workspace_id=beta.workspace_id))["accounts"] == []
        await expect_error("not_found", other.call("service_account.get", workspace_id=beta.workspace_id,
                                                   service_account_id=account_id))
