"""Malformed, truncated, oversized and wrongly typed frames over a live
connection: each gets a typed error frame, the server keeps serving, and
nothing is written."""

from __future__ import annotations

import json

import trio
import trio_websocket
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import frames
from protocol.errors import ErrorCode
from server import tenancy as ops
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from storage.bridge import Database

READ_ONLY_OPS = {"ping", "hello", "login", "auth", "workspace.list", "workspace.get", "member.list",
                 "invitation.list", "apikey.list", "channel.list", "scope.get", "scope.members", "message.history",
                 "message.get", "inbox.list", "subscribe", "unsubscribe", "typing", "presence"}

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                      max_leaves=10)
op_names = st.sampled_from(sorted(frames.KNOWN_OPS) + ["nope", "", "message.send "])
field_names = st.sampled_from(["id", "op", "scope_id", "content", "workspace_id", "limit", "message_id", "key",
                               "member_id", "email", "password", "token", "scopes", "after_seq", "zzz"])
structured = st.builds(lambda op, body: json.dumps({"op": op, **body}), op_names,
                       st.dictionaries(field_names, values, max_size=5))
garbage = st.one_of(st.text(max_size=200), st.binary(max_size=200),
                    structured.map(lambda s: s[: max(1, len(s) // 2)]))  # truncated JSON
frames_strategy = st.lists(st.one_of(structured, garbage), min_size=1, max_size=15)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=frames_strategy)
def test_hostile_frames_get_typed_errors_and_change_nothing(database_dsn, batch):
    trio.run(_hammer, database_dsn, batch)


async def _rows(db: Database) -> int:
    return await db.run(lambda c: c.fetchval(
        "SELECT (SELECT count(*) FROM scope_messages) + (SELECT count(*) FROM scopes) "
        "+ (SELECT count(*) FROM api_keys) + (SELECT count(*) FROM workspace_invitations) "
        "+ (SELECT count(*) FROM scope_memberships)"))


async def _hammer(dsn: str, batch: list) -> None:
    async with Database(dsn) as db, trio.open_nursery() as nursery:
        if await db.run(lambda c: c.fetchval("SELECT count(*) FROM workspaces")) == 0:
            await ops.init_instance(db, email="f@example.com", display_name="F", workspace_name="F",
                                    workspace_slug="f", edition="single", password="fuzz-password")
        server = Server(ServerConfig(port=0, max_frame_bytes=4096, shutdown_grace_seconds=1), db,
                        Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
        port = await nursery.start(server.run)
        before = await _rows(db)
        url = f"ws://127.0.0.1:{port}"
        accepted: list[str] = []
        async with trio_websocket.open_websocket_url(url) as ws:
            await ws.send_message(json.dumps({"op": "login", "id": "login", "email": "f@example.com",
                                              "password": "fuzz-password"}))
            assert json.loads(await ws.get_message())["type"] == "result"
            for frame in batch:
                await ws.send_message(frame)
                with trio.fail_after(10):
                    reply = json.loads(await ws.get_message())
                    while reply.get("type") == "event":
                        reply = json.loads(await ws.get_message())
                if reply["type"] == "error":
                    assert reply["code"] in {c.value for c in ErrorCode} and reply["code"] != "internal", reply
                else:
                    accepted.append(reply["op"])
            # Oversized: the connection is closed with 1009, the server lives on.
            await ws.send_message("x" * 5000)
            try:
                with trio.fail_after(10):
                    await ws.get_message()
            except trio_websocket.ConnectionClosed as closed:
                assert closed.reason.code == 1009
        async with trio_websocket.open_websocket_url(url) as ws:
            await ws.send_message(json.dumps({"op": "ping", "id": "alive"}))
            assert json.loads(await ws.get_message())["id"] == "alive"
        # Rejected frames write nothing (a frame that happens to be a valid write may).
        if not set(accepted) - READ_ONLY_OPS:
            assert await _rows(db) == before
        nursery.cancel_scope.cancel()
