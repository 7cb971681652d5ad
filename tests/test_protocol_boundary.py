"""Bad input at the protocol boundary (protocol/validation.py), over a live
connection against a real PostgreSQL: NUL, deep nesting, huge numbers,
invisible characters in names, forged routing metadata and reserved message
types all answer a typed error — never `internal`, never an error-level log or
a traceback — and write nothing."""

from __future__ import annotations

import json
import logging
import math

import msgspec
import pytest
import trio
import trio_websocket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import frames
from protocol.codec import decode_request
from protocol.errors import ErrorCode, ProtocolError
from protocol.validation import MAX_METADATA_DEPTH, RESERVED_METADATA_KEYS, name_text_problem
from tests.conftest import App, add_person
from tests.test_tenancy import expect_error, signed_in


@pytest.fixture
def no_error_logs(caplog):
    """Fails the test if anything logged at error level or with a traceback."""
    caplog.set_level(logging.INFO)
    yield
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [(r.name, r.getMessage(), r.exc_info) for r in bad]


async def _rows(app: App) -> int:
    return await app.db.run(lambda c: c.fetchval(
        "SELECT (SELECT count(*) FROM scope_messages) + (SELECT count(*) FROM scopes) "
        "+ (SELECT count(*) FROM members) + (SELECT count(*) FROM accounts) "
        "+ (SELECT count(*) FROM workspace_invitations) + (SELECT count(*) FROM api_keys)"))


async def _raw_reply(ws: trio_websocket.WebSocketConnection, frame: str | bytes) -> dict:
    await ws.send_message(frame)
    with trio.fail_after(30):
        while True:
            message = await ws.get_message()
            reply = msgspec.msgpack.decode(message) if isinstance(message, bytes) else json.loads(message)
            if reply.get("type") != "event":
                return reply


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# --- NUL and nesting ---------------------------------------------------------------------------

async def test_nul_in_an_unauthenticated_login_is_invalid_not_internal(app: App, tenants, no_error_logs):
    async with trio_websocket.open_websocket_url(app.url) as ws:
        for email, password in (("a\u0000@example.com", "x"), ("owner-a@example.com", "pass\u0000word")):
            reply = await _raw_reply(ws, json.dumps({"op": "login", "id": "l", "email": email, "password": password}))
            assert (reply["code"], reply["id"]) == ("invalid", "l"), reply
        reply = await _raw_reply(ws, json.dumps({"op": "ping", "id": "still here"}))
        assert reply["type"] == "result"


async def test_nul_anywhere_and_deep_metadata_are_rejected_and_write_nothing(app: App, tenants, no_error_logs):
    alpha, _ = tenants
    ws_id = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await owner.call("channel.create", slug="general", display_name="General", **ws_id)
        before = await _rows(app)
        send = {"scope_id": channel["id"], **ws_id}
        for fields in ({"content": "a\u0000b"}, {"content": "x", "client_message_id": "c\u0000"},
                       {"content": "x", "metadata": {"k\u0000": 1}}, {"content": "x", "metadata": {"k": ["\u0000"]}}):
            error = await expect_error("invalid", owner.call("message.send", **send, **fields))
            assert error.details["field"].split(".")[0].split("[")[0] in fields
        await expect_error("invalid", owner.call("channel.create", slug="s", display_name="D",
                                                 description="a\u0000", **ws_id))
        too_deep = {"a": json.loads(_deep(MAX_METADATA_DEPTH))}
        error = await expect_error("invalid", owner.call("message.send", content="x", metadata=too_deep, **send))
        assert error.details["field"].startswith("metadata.a")
        for number in (2**53, -(2**70), 10**400):
            await expect_error("invalid", owner.call("message.send", content="x", metadata={"n": number}, **send))
        await owner.call("message.send", content="fine", metadata={"a": json.loads(_deep(MAX_METADATA_DEPTH - 1))},
                         **send)
    assert await _rows(app) == before + 1
    # Nested deeper than the interpreter's stack: bad_frame, and the connection lives on.
    async with trio_websocket.open_websocket_url(app.url) as ws:
        for depth in (1_000, 100_000):
            frame = '{"op": "message.send", "id": "deep", "content": "x", "metadata": {"a": ' + _deep(depth) + "}}"
            assert (await _raw_reply(ws, frame))["code"] == "bad_frame"
        assert (await _raw_reply(ws, json.dumps({"op": "ping", "id": "p"})))["type"] == "result"


def test_msgpack_metadata_must_be_json():
    """MessagePack can carry what JSON cannot (bytes, NaN, integer keys): invalid;
    a string that is not UTF-8: bad_frame."""
    base = {"op": "message.send", "id": "m", "scope_id": "scp_x", "content": "x"}
    not_utf8 = msgspec.msgpack.encode({**base, "content": "ab"}).replace(b"\xa2ab", b"\xa2a\xff")
    with pytest.raises(ProtocolError) as caught:
        decode_request(not_utf8, binary=True)
    assert caught.value.code is ErrorCode.BAD_FRAME
    for metadata in ({"b": b"raw"}, {"f": math.nan}, {"f": math.inf}, {"d": {1: "x"}}, {"e": msgspec.msgpack.Ext(1, b"")}):
        with pytest.raises(ProtocolError) as caught:
            decode_request(msgspec.msgpack.encode({**base, "metadata": metadata}), binary=True)
        assert caught.value.code is ErrorCode.INVALID and caught.value.details["id"] == "m"


# --- names ---------------------------------------------------------------------------------------

INVISIBLES = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069",
              "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u0007", "\u0085", "\u2028", "\u2029", "\n", "\t"]


def test_the_name_rule():
    for char in INVISIBLES:
        assert name_text_problem(f"ad{char}min") is not None, hex(ord(char))
    for fine in ("Zoë Müller", "王小明", "O'Brien-Smith", "team 🚀", "admin@example.com", "a.b_c-d"):
        assert name_text_problem(fine) is None, fine


async def test_invisible_characters_in_names_and_emails_are_invalid(app: App, tenants, no_error_logs):
    alpha, _ = tenants
    ws_id = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        before = await _rows(app)
        for char in INVISIBLES:
            probes = {
                "agent.create": dict(ws_id, handle="bot", display_name=f"Bot{char}"),
                "channel.create": dict(ws_id, slug="c", display_name=f"Gen{char}eral"),
                "invitation.create": dict(ws_id, email=f"a{char}b@example.com"),
                "workspace.create": dict(name=f"Acme{char}", slug="acme"),
                "apikey.create": dict(ws_id, name=f"k{char}"),
            }
            for op, fields in probes.items():
                error = await expect_error("invalid", owner.call(op, **fields))
                assert error.details["field"] in ("display_name", "email", "name"), (op, error)
        assert await _rows(app) == before
    async with trio_websocket.open_websocket_url(app.url) as ws:
        accept = {"op": "invitation.accept", "id": "i", "token": "swi_x", "password": "long-enough-1",
                  "display_name": "Mallory\u202egnp.exe"}
        assert (await _raw_reply(ws, json.dumps(accept)))["code"] == "invalid"


# --- routing facts and message types ----------------------------------------------------------------

async def test_client_metadata_cannot_carry_routing_facts(app: App, tenants, member_password_hash, no_error_logs):
    """Forged `metadata.mentions` would wake another owner's private agent."""
    alpha, _ = tenants
    ws_id = {"workspace_id": alpha.workspace_id}
    mallory = await add_person(app.db, alpha.workspace_id, "mallory@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="secretary", display_name="Secretary", **ws_id)
        channel = await owner.call("channel.create", slug="open", display_name="Open",
                                   member_ids=[mallory.member_id, agent["id"]], **ws_id)
    before = await _rows(app)
    async with await signed_in(app, mallory) as conn:
        for key in sorted(RESERVED_METADATA_KEYS):
            error = await expect_error("invalid", conn.call("message.send", scope_id=channel["id"], content="hi",
                                                            metadata={key: [agent["id"]]}, **ws_id))
            assert error.details["field"] == f"metadata.{key}"
        # Client-owned keys are fine; routing facts come from the content alone.
        sent = await conn.call("message.send", scope_id=channel["id"], content="hi @secretary",
                               metadata={"client_tag": "x"}, **ws_id)
        assert sent["metadata"] == {"client_tag": "x"}  # the owner's private agent is not Mallory's to address
    assert await _rows(app) == before + 1


async def test_only_plain_user_message_types_are_accepted_from_clients(app: App, tenants, no_error_logs):
    alpha, _ = tenants
    ws_id = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await owner.call("channel.create", slug="types", display_name="Types", **ws_id)
        before = await _rows(app)
        for message_type in ("service_account_post", "owner_quote", "forward", "task_discussion",
                             "app_interactive_card", "system"):
            error = await expect_error("invalid", owner.call("message.send", scope_id=channel["id"], content="x",
                                                             message_type=message_type, **ws_id))
            assert error.details["field"] == "message_type"
        assert await _rows(app) == before
        for message_type in ("text", "markdown"):
            sent = await owner.call("message.send", scope_id=channel["id"], content="x", message_type=message_type,
                                    **ws_id)
            assert sent["message_type"] == message_type


# --- any JSON value in any field of any op ---------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**53 - 2, max_value=2**80)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
                | st.sampled_from(["\u0000", "a\u0000b", "\u202eevil", "\u200b", "scp_\u0000", "x" * 5000]))
HOSTILE = ["\u0000", "\u202e", "\u2066", "\u200b", "\u200d", "\ufeff", "\u0007", "\u2028", "\U0001F680", "é"]
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
# MessagePack carries more than JSON can: bytes, non-finite floats, extension types, non-string keys.
msgpack_ints = st.integers(-(2**63), 2**64 - 1)
msgpack_values = st.recursive(
    st.none() | st.booleans() | msgpack_ints | st.floats() | st.text(max_size=40) | st.binary(max_size=8)
    | st.sampled_from(["\u0000", "a\u0000b", "\u202eevil", msgspec.msgpack.Ext(1, b"x")]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10) | msgpack_ints, inner, max_size=4),
    max_leaves=12)
DEEP = "__deep__"
# Ops whose success ends this connection's session; they carry no field but `id`.
SESSION_ENDING = {frames.RevokeSessions}
FUZZED_OPS = [frame for frame in frames.CLIENT_FRAMES if frame not in SESSION_ENDING]
PLAUSIBLE_FOR = {frames.NotificationSet: {"state": "quiet"}, frames.Presence: {"state": "online"},
                 frames.ApiKeyCreate: {"scopes": ["read"]}}
# Ops whose success would shut the fuzzer out of its workspace or channel get no plausible values.
LOCKING_OUT = {frames.WorkspaceSuspend, frames.ScopeArchive, frames.ScopeLeave, frames.OwnerTransfer}


async def test_arbitrary_json_in_every_field_of_every_op_never_answers_internal(app: App, tenants,
                                                                               member_password_hash,
                                                                               no_error_logs):
    alpha, _ = tenants
    ws_id = alpha.workspace_id
    victim = await add_person(app.db, alpha.workspace_id, "victim@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        channel = await owner.call("channel.create", slug="fuzz", display_name="Fuzz", member_ids=[victim.member_id],
                                   workspace_id=ws_id)
        message = await owner.call("message.send", scope_id=channel["id"], content="root", workspace_id=ws_id)
        key = await owner.call("apikey.create", name="k", workspace_id=ws_id)
    # A plausible value per field name, so a mutated field is reached with the others valid.
    plausible = {
        "workspace_id": ws_id, "scope_id": channel["id"], "message_id": message["id"],
        "root_message_id": message["id"], "reply_to_message_id": message["id"],
        "source_message_ids": [message["id"]], "member_id": "mem_zzzzzzzzzzzzzz", "member_ids": [victim.member_id],
        "api_key_id": key["id"], "invitation_id": "inv_zzzzzzzzzzzzzz", "content": "hi", "email": "fuzz@example.com",
        "password": "fuzz-password-1", "token": "swi_nothing", "name": "Fuzz", "slug": "fuzz-slug",
        "handle": "fuzz-bot", "display_name": "Fuzz", "role": "operator", "seq": 1, "expected_revision": 1,
        "key": "👍", "state": "start", "action": "pin", "protocol_version": 1,
        "scopes": [{"scope_id": channel["id"], "after_seq": 0}],
    }
    token = trio.lowlevel.current_trio_token()
    seen_codes: set[str] = set()
    login = {"op": "login", "id": "login", "email": alpha.owner.email, "password": alpha.owner.password}
    async with trio_websocket.open_websocket_url(app.url) as text_ws, \
            trio_websocket.open_websocket_url(app.url, subprotocols=["scopewire.msgpack"]) as binary_ws:
        assert (await _raw_reply(text_ws, json.dumps(login)))["type"] == "result"
        assert (await _raw_reply(binary_ws, msgspec.msgpack.encode(login)))["type"] == "result"

        @settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def probe(data):
            op = data.draw(st.sampled_from(FUZZED_OPS), label="op")
            fields = [f for f in msgspec.structs.fields(op) if f.name != "id"]
            names = [f.name for f in fields]
            usual_values = {**plausible, **PLAUSIBLE_FOR.get(op, {})}
            body = {f.name: usual_values[f.name] for f in fields
                    if f.name in usual_values and op not in LOCKING_OUT and (f.required or data.draw(st.booleans()))}
            targets = data.draw(st.lists(st.sampled_from(names + ["id"]), unique=True, max_size=2), label="fields")
            binary = data.draw(st.booleans(), label="msgpack")
            for name in targets:
                usual = usual_values.get(name, "fuzz-request")
                choices = (msgpack_values if binary else json_values) | st.just(DEEP)
                if isinstance(usual, str):  # also reach past the type check: the usual value, made hostile
                    hostile = st.sampled_from(HOSTILE).map(lambda bad, usual=usual: usual[:3] + bad + usual[3:])
                    choices = st.one_of(hostile, hostile, hostile, choices)
                body[name] = data.draw(choices, label=name)
            body = {"op": op.__struct_config__.tag, "id": body.pop("id", "fuzz"), **body}
            depth = data.draw(st.integers(MAX_METADATA_DEPTH, 3_000))
            if binary:
                deep: list = []
                for _ in range(min(depth, 500)):  # the encoder's own stack bounds what a test can build
                    deep = [deep]
                frame = msgspec.msgpack.encode({k: deep if v == DEEP else v for k, v in body.items()})
                if data.draw(st.booleans(), label="mangle"):  # e.g. a string that is not UTF-8
                    at = data.draw(st.integers(0, len(frame) - 1))
                    frame = frame[:at] + b"\xff" + frame[at + 1:]
            else:
                frame = json.dumps(body).replace(json.dumps(DEEP), _deep(depth))
            reply = trio.from_thread.run(_raw_reply, binary_ws if binary else text_ws, frame, trio_token=token)
            assert reply["type"] in ("result", "error"), reply
            if reply["type"] == "error":
                assert reply["code"] in {c.value for c in ErrorCode} and reply["code"] != "internal", (frame, reply)
                seen_codes.add(reply["code"])

        await trio.to_thread.run_sync(probe)
    assert {"bad_frame", "invalid"} <= seen_codes, seen_codes
