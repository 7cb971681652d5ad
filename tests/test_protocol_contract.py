"""The protocol contract's words (protocol/guide.py), each checked against a
live server and a real PostgreSQL: which code each failure answers, that
errors keep the connection open, reply order, cursors, pre-join history,
mention and handle formats, budgets, and that every event type is produced
with its typed payload."""

from __future__ import annotations

import json

import msgspec
import pytest
import trio
import trio_websocket

from client import connect
from protocol import conformance, frames, guide, platform, service_accounts
from protocol.events import EVENTS
from protocol.results import RESULTS
from server import app as server_app
from server import handlers, realtime
from server.ops.platform import create_operator
from storage import tenancy
from tests.conftest import App, add_person
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in


async def _reply(ws: trio_websocket.WebSocketConnection, frame: dict | str) -> dict:
    await ws.send_message(frame if isinstance(frame, str) else json.dumps(frame))
    with trio.fail_after(30):
        while True:
            reply = json.loads(await ws.get_message())
            if reply["type"] != "event":
                return reply


def _code(case_fragment: str) -> str:
    """The code protocol/guide.py documents for the case containing `case_fragment`."""
    (code,) = [code for case, code in guide.ERROR_CASES.items() if case_fragment in case]
    return code


async def test_each_documented_failure_answers_its_code_and_keeps_the_connection(app: App, tenants):
    alpha, _ = tenants
    async with trio_websocket.open_websocket_url(app.url) as ws:
        steps = [
            ({"op": "member.list", "id": "a"}, _code("before authenticating")),
            ({"op": "login", "id": "b", "email": alpha.owner.email, "password": "wrong"}, _code("wrong password")),
            ({"op": "login", "id": "c", "email": "nobody@example.com", "password": "x"}, _code("wrong password")),
            ({"op": "auth", "id": "d", "token": "not.a.token"}, _code("session token or API key")),
            ({"op": "auth", "id": "e", "api_key": "swk_forged"}, _code("session token or API key")),
            ({"op": "hello", "id": "f", "protocol_version": 99}, _code("protocol_version")),
            ("{not json", _code("not JSON")),
            ({"op": "ping"}, _code("not JSON")),                                   # missing id
            ({"op": "message.history", "id": "g", "scope_id": "scp_x", "limit": "ten"}, _code("not JSON")),
            ({"op": "message.history", "id": "h", "scope_id": "scp_x", "limit": 0}, _code("not JSON")),
            ({"op": "ping", "id": "i", "extra": 1}, _code("not JSON")),             # unknown field
            ({"op": "agent.create", "id": "j", "handle": "Bad Handle", "display_name": "x"}, _code("not JSON")),
            ({"op": "no.such.op", "id": "k"}, _code("an `op`")),
        ]
        for frame, code in steps:
            reply = await _reply(ws, frame)
            assert reply["type"] == "error" and reply["code"] == code, (frame, reply)
            if isinstance(frame, dict) and "id" in frame:
                assert reply["id"] == frame["id"]
            # The connection stays open and usable after every error.
            assert (await _reply(ws, {"op": "ping", "id": "alive"}))["type"] == "result"
        hello = await _reply(ws, {"op": "hello", "id": "v", "protocol_version": 99})
        assert hello["details"]["supported"] == [frames.PROTOCOL_VERSION]
        login = await _reply(ws, {"op": "login", "id": "l", "email": alpha.owner.email,
                                  "password": alpha.owner.password})
        assert login["type"] == "result"
        ws_id = {"workspace_id": alpha.workspace_id}
        invalid = _code("input rule")
        for frame in ({"op": "message.send", "id": "m", "scope_id": "scp_x", "content": "a\u0000b", **ws_id},
                      {"op": "agent.create", "id": "n", "handle": "ok", "display_name": "a\u202eb", **ws_id},
                      {"op": "message.send", "id": "o", "scope_id": "scp_x", "content": "x",
                       "metadata": {"mentions": ["mem_x"]}, **ws_id},
                      {"op": "message.history", "id": "p", "scope_id": "not-an-id", **ws_id}):
            reply = await _reply(ws, frame)
            assert (reply["type"], reply.get("code")) == ("error", invalid), (frame, reply)
            assert (await _reply(ws, {"op": "ping", "id": "alive"}))["type"] == "result"


async def test_read_only_key_and_dm_invite_answer_forbidden(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "general")
        key = await owner.call("apikey.create", name="reader", scopes=["read"], **ws)
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        error = await expect_error(_code("scope.invite into a DM"),
                                   owner.call("scope.invite", scope_id=dm["id"], member_ids=[carol.member_id], **ws))
        assert error.details.get("reason") == "dm_roster_is_fixed"
    async with connect(app.url) as reader:
        await reader.auth(api_key=key["key"])
        await reader.call("message.history", scope_id=channel["id"])  # reading is allowed
        await expect_error(_code("lacking the `write` scope"),
                           reader.call("message.send", scope_id=channel["id"], content="hi"))


async def test_pipelined_requests_are_answered_in_order(app: App, tenants):
    alpha, _ = tenants
    async with trio_websocket.open_websocket_url(app.url) as ws:
        # login is slow (password hashing) and ping is instant: a server that
        # answered concurrently would reply to the pings first.
        frames_out = [{"op": "login", "id": "0", "email": alpha.owner.email, "password": alpha.owner.password}]
        frames_out += [{"op": "ping", "id": str(i)} for i in range(1, 20)]
        frames_out += [{"op": "workspace.list", "id": "20"}, {"op": "bogus", "id": "21"}, {"op": "ping", "id": "22"}]
        for frame in frames_out:
            await ws.send_message(json.dumps(frame))
        replies = []
        with trio.fail_after(30):
            while len(replies) < len(frames_out):
                replies.append(json.loads(await ws.get_message())["id"])
        assert replies == [frame["id"] for frame in frames_out]


async def test_subscribe_cursors_mean_what_the_spec_says(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "cursors")
        for i in range(3):
            await owner.call("message.send", scope_id=channel["id"], content=f"old {i}", **ws)
        async with await signed_in(app, alpha.owner) as live, await signed_in(app, alpha.owner) as replaying:
            # Omitted cursors: live from the tails the result reports.
            result = await live.call("subscribe", scopes=[{"scope_id": channel["id"]}], workspace_feed=True, **ws)
            assert result["scopes"][0]["latest_seq"] == 3
            tail = result["workspace_global_seq"]
            # after_seq: everything after it first.
            await replaying.call("subscribe", scopes=[{"scope_id": channel["id"], "after_seq": 1}], **ws)
            sent = await owner.call("message.send", scope_id=channel["id"], content="new", **ws)
            with trio.fail_after(15):
                got_live = await live.next_event()
                got_replay = [await replaying.next_event() for _ in range(3)]
            # Followed on its own and through the feed: delivered once, with both cursors.
            assert (got_live["seq"], got_live["global_seq"]) == (4, tail + 1) == (sent["seq"], sent["global_seq"])
            assert [e["seq"] for e in got_replay] == [2, 3, 4]
            assert live.queued_events() == []


async def test_messages_from_before_a_join_are_readable(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "history")
        before = [await owner.call("message.send", scope_id=channel["id"], content=f"before {i}", **ws)
                  for i in range(3)]
        await expect_error("forbidden", b.call("message.history", scope_id=channel["id"], **ws))  # join first
        await b.call("scope.join", scope_id=channel["id"], **ws)
        page = await b.call("message.history", scope_id=channel["id"], **ws)
        assert [m["id"] for m in page["messages"]] == [m["id"] for m in before]
        assert (await b.call("message.get", message_id=before[0]["id"], **ws))["message"]["content"] == "before 0"


async def test_mentions_are_member_ids_computed_by_the_server(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "mentions", [bob.member_id, carol.member_id])
        sent = await owner.call("message.send", scope_id=channel["id"],
                                content="@Carol and @bob, not `@bob` again, not @nobody", **ws)
        assert sent["metadata"]["mentions"] == [carol.member_id, bob.member_id]
        plain = await owner.call("message.send", scope_id=channel["id"], content="no one", **ws)
        assert "mentions" not in plain.get("metadata", {})  # an empty metadata object is left out


async def test_handles_follow_the_documented_rules(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    for email in ("jane.doe+work@example.com", "jane.doe+work@other.example", "ñ@example.com"):
        await add_person(app.db, alpha.workspace_id, email, "viewer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        handles = {m["email"]: m["handle"] for m in (await owner.call("member.list", **ws))["members"]}
        assert handles["jane.doe+work@example.com"] == "jane.doe-work"
        assert handles["jane.doe+work@other.example"] == "jane.doe-work-2"
        assert handles["ñ@example.com"] == "user"
        await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        await expect_error("conflict", owner.call("agent.create", handle="helper", display_name="Again", **ws))


def test_documented_budgets_and_names_are_the_servers():
    server = server_app.Server.__dataclass_fields__
    limiters = {name: server[name].default_factory() for name in ("typing_limiter", "presence_limiter",
                                                                    "reaction_limiter")}
    documented = {"typing": "typing_limiter", "presence": "presence_limiter",
                  "reaction.add / reaction.remove": "reaction_limiter"}
    for name, attribute in documented.items():
        rate, burst, _ = guide.BUDGETS[name]
        assert (limiters[attribute].rate, limiters[attribute].burst) == (rate, burst), name
    assert (guide.TYPING_TTL_MS, guide.PRESENCE_TTL_MS) == (realtime.TYPING_TTL_MS, realtime.PRESENCE_TTL_MS)
    assert (server_app.MSGPACK_SUBPROTOCOL, server_app.JSON_SUBPROTOCOL) == (frames.MSGPACK_SUBPROTOCOL,
                                                                             frames.JSON_SUBPROTOCOL)


async def test_every_event_type_is_produced_with_its_typed_payload(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "viewer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "events", [bob.member_id, carol.member_id])
        scope = {"scope_id": channel["id"], **ws}
        board = await owner.call("board.create", channel_id=channel["id"], name="Events", **ws)
        strand = await owner.call("strand.create", board_id=board["id"], title="Events", **ws)
        await b.call("subscribe", scopes=[{"scope_id": channel["id"]}, {"scope_id": strand["id"]}],
                     workspace_feed=True, **ws)
        await b.call("delivery.subscribe", **ws)
        message = await owner.call("message.send", content="hello", **scope)
        await owner.call("message.send", content="for bob", recipient_member_ids=[bob.member_id], **scope)
        await owner.call("message.edit", message_id=message["id"], content="edited", expected_revision=1, **ws)
        await owner.call("reaction.add", message_id=message["id"], key="👍", **ws)
        await owner.call("reaction.remove", message_id=message["id"], key="👍", **ws)
        await owner.call("typing", **scope)
        await owner.call("presence", state="online", **ws)
        await b.call("read.mark", seq=1, **scope)
        await owner.call("strand.stage.set", strand_id=strand["id"], stage="draft", **ws)
        await b.call("strand.watch.set", strand_id=strand["id"], level="all", **ws)
        await b.call("notification.set", state="quiet", **scope)
        await owner.call("collaborator.add", member_id=bob.member_id, confirm_channel=True, no_expiry=True, **scope)
        await owner.call("member.remove", member_id=carol.member_id, **ws)  # closes with reason "departed"
        await owner.call("message.withdraw", message_id=message["id"], **ws)
        await owner.call("scope.archive", **scope)
        app.server.cluster._resync("a publication of another node was lost")  # events.missed
        seen: dict[str, list[dict]] = {}
        with trio.fail_after(30):
            # withdrawal fans out through the outbox, so in any order
            while not set(EVENTS) - set(service_accounts.EVENTS) - set(platform.EVENTS) <= set(seen):
                event = await b.next_event()
                seen.setdefault(event["event"], []).append(event)
    for name, received in seen.items():
        for event in received:
            assert conformance.problem(event) is None
            msgspec.convert(event["data"], EVENTS[name])
    assert seen["typing"][0]["data"]["expires_at_ms"] > 0
    assert {"action": "close", "reason": "departed", "member_id": carol.member_id}.items() <= \
        seen["membership.changed"][-1]["data"].items()
    assert seen["message.withdrawn"][0]["data"]["content"] == ""


async def test_every_service_account_event_is_produced_with_its_typed_payload(app: App, tenants,
                                                                              member_password_hash):
    """The service-account events (the test above covers the rest of EVENTS)."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    seen: dict[str, list[dict]] = {}

    async def until(b, name: str) -> dict:
        with trio.fail_after(30):
            while name not in seen:
                event = await b.next_event()
                seen.setdefault(event["event"], []).append(event)
        return seen[name][-1]

    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        await b.call("subscribe", workspace_feed=True, **ws)
        approved = await b.call("service_account.request.submit", client_request_id="r1", name="News", **ws)
        await owner.call("approval.decide", approval_id=approved["approval_id"], decision="approve",
                         expected_version=1, **ws)
        account_id = (await until(b, "service_account.created"))["data"]["service_account_id"]
        await until(b, "service_account.create_request.changed")  # fulfilled: the audience is ready
        rejected = await b.call("service_account.request.submit", client_request_id="r2", name="Other", **ws)
        await owner.call("approval.decide", approval_id=rejected["approval_id"], decision="reject",
                         expected_version=1, **ws)
        cancelled = await b.call("service_account.request.submit", client_request_id="r3", name="Third", **ws)
        await b.call("service_account.request.cancel", request_id=cancelled["id"], expected_version=1,
                     client_mutation_id="c3", **ws)
        post = await b.call("service_account.post", service_account_id=account_id, title="Hello", content="Hi",
                            client_message_id="3f2b8a1e-0c4d-4e5f-9a6b-7c8d9e0f1a2b", **ws)
        await b.call("pin.add", message_id=post["id"], **ws)
        await owner.call("service_account.managers.add", service_account_id=account_id,
                         member_id=alpha.owner.member_id, **ws)
        detail = await b.call("service_account.update", service_account_id=account_id, expected_version=2,
                              description="Company news", **ws)
        await b.call("service_account.delete", service_account_id=account_id, expected_version=detail["version"],
                     **ws)
        for name in service_accounts.EVENTS:
            await until(b, name)
    for name, received in seen.items():
        for event in received:
            assert conformance.problem(event) is None
            msgspec.convert(event["data"], EVENTS[name])


@pytest.mark.parametrize("server_config", [{"platform_retry_base_seconds": 0.05, "platform_max_attempts": 2}],
                         indirect=True)
async def test_every_platform_event_is_produced_with_its_typed_payload(app: App, tenants):
    """The platform events, on an operator connection after platform.subscribe."""
    alpha, _ = tenants
    _, _, key = await create_operator(app.db, "ops")
    seen: dict[str, list[dict]] = {}

    async def until(conn, name: str, predicate=lambda data: True) -> dict:
        with trio.fail_after(30):
            while not any(predicate(e["data"]) for e in seen.get(name, [])):
                event = await conn.next_event()
                seen.setdefault(event["event"], []).append(event)
        return [e for e in seen[name] if predicate(e["data"])][-1]

    async with connect(app.url) as ops:
        await ops.call("auth", operator_key=key)
        await ops.call("platform.subscribe")
        account = await ops.call("platform.account.create", name="News")
        await until(ops, "platform_service_account.updated")  # provisioned: ready
        first = await ops.call("platform.broadcast.create", platform_service_account_id=account["id"],
                               client_broadcast_id="b1", title="Hello", content="Everyone")
        await until(ops, "platform_service_account.broadcast_completed", lambda d: d["broadcast"]["id"] == first["id"])
        # A write-fenced workspace refuses the next delivery: it waits for an operator.
        await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=True,
                                 new_generation=False)
        await ops.call("platform.broadcast.create", platform_service_account_id=account["id"],
                       client_broadcast_id="b2", title="Hello", content="again")
        stuck = (await until(ops, "platform_service_account.broadcast_delivery_changed",
                             lambda d: d["delivery"]["state"] == "operator_attention"))["data"]["delivery"]
        await ops.call("platform.delivery.settle_skip", delivery_id=stuck["id"], expected_version=stuck["version"])
        await until(ops, "platform_service_account.broadcast_completed",
                    lambda d: d["broadcast"]["state"] == "completed_with_exceptions")
        await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=False,
                                 new_generation=False)
        current = await ops.call("platform.account.get", platform_service_account_id=account["id"])
        await ops.call("platform.account.delete", platform_service_account_id=account["id"],
                       expected_version=current["version"])
        for name in platform.EVENTS:
            await until(ops, name)
    for name, received in seen.items():
        for event in received:
            assert conformance.problem(event) is None
            msgspec.convert(event["data"], EVENTS[name])


async def test_a_handler_straying_from_the_result_table_answers_internal(app: App, monkeypatch):
    async def untyped_ping(*_):
        return {"server_time_ms": 1}

    monkeypatch.setitem(handlers.PUBLIC, frames.Ping, untyped_ping)
    async with trio_websocket.open_websocket_url(app.url) as ws:
        reply = await _reply(ws, {"op": "ping", "id": "1"})
    assert (reply["type"], reply["code"]) == ("error", "internal")
    assert RESULTS[frames.Ping] is frames.PingResult


@pytest.mark.parametrize("frame, complaint", [
    ({"type": "result", "id": "1", "op": "nope", "data": {}}, "no typed entry"),
    ({"type": "event", "event": "nope", "workspace_id": "w", "scope_id": "s", "data": {}}, "no typed entry"),
    ({"type": "result", "id": "1", "op": "ping", "data": {"server_time_ms": 1, "protocol_version": 1, "x": 1}},
     "not in the contract"),
    ({"type": "result", "id": "1", "op": "channel.list", "data": []}, "Expected `object`"),
    ({"type": "event", "event": "typing", "workspace_id": "w", "scope_id": "s",
      "data": {"member_id": "m", "state": "start"}}, "expires_at_ms"),
    ({"type": "error", "code": "made_up", "message": "m"}, "unknown error code"),
])
def test_conformance_rejects_frames_outside_the_contract(frame, complaint):
    assert complaint in (conformance.problem(frame) or "")
