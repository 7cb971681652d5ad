"""Broadcast attachments (service-account.md §4.5) over the WebSocket against
PostgreSQL: an operator uploads platform assets, a broadcast names them, every
workspace's message claims its own attachment of each (mapped by delivery and
asset ordinal, in the message's transaction), members read the same bytes —
stored once — through the message's visibility; the manifest is frozen and
digested; referenced assets are immutable and kept, unreferenced ones expire,
and a deleted account's assets are collected."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import msgspec
import pytest
import trio
import trio_websocket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import platform as p
from protocol.attachments import MAX_CHUNK_BYTES
from protocol.errors import ErrorCode
from server.config import ServerConfig
from tests.conftest import App
from tests.platform_helpers import (conversation_messages, create_platform_account, operator, wait_broadcast_done,
                                    wait_ready)
from tests.test_protocol_boundary import HOSTILE, _raw_reply, json_values, msgpack_values, no_error_logs  # noqa: F401
from tests.test_tenancy import expect_error, signed_in

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 700  # a little over one chunk
NOTES = "release notes: 新版本\n".encode()
DAY = 24 * 3600


@pytest.fixture
def attachments_dir(tmp_path: Path) -> Path:
    return tmp_path / "attachments"


@pytest.fixture
def server_config(attachments_dir: Path) -> ServerConfig:
    return ServerConfig(port=0, auth_timeout_seconds=2.0, shutdown_grace_seconds=2.0, attachments_dir=attachments_dir,
                        unclaimed_upload_ttl_seconds=DAY)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def upload_asset(ops, account_id: str, data: bytes, *, filename: str = "banner.png",
                       content_type: str = "image/png", **extra) -> dict:
    """begin, every chunk, finish: the stored asset's info."""
    begun = await ops.call("platform.asset.upload.begin", platform_service_account_id=account_id,
                           filename=filename, content_type=content_type, byte_size=len(data), **extra)
    assert begun["state"] == "uploading" and begun["received_bytes"] == 0 and not begun["referenced"]
    for offset in range(0, len(data), MAX_CHUNK_BYTES):
        await ops.call("platform.asset.upload.chunk", asset_id=begun["id"], offset=offset,
                       data=_b64(data[offset:offset + MAX_CHUNK_BYTES]))
    return await ops.call("platform.asset.upload.finish", asset_id=begun["id"])


async def read_all(conn, workspace_id: str, attachment_id: str) -> bytes:
    out = bytearray()
    while True:
        part = await conn.call("attachment.read", workspace_id=workspace_id, attachment_id=attachment_id,
                               offset=len(out))
        out += base64.b64decode(part["data"])
        if part["eof"]:
            return bytes(out)


def _files(root: Path) -> list[bytes]:
    return [path.read_bytes() for path in root.rglob("*") if path.is_file() and "staging" not in path.parts]


async def test_a_broadcast_carries_its_assets_to_every_workspace_stored_once(app: App, tenants,
                                                                             attachments_dir: Path):
    async with operator(app) as ops:
        account = await create_platform_account(ops, "Announcements")
        await wait_ready(ops, account["id"])
        banner = await upload_asset(ops, account["id"], PNG, sha256=hashlib.sha256(PNG).hexdigest())
        notes = await upload_asset(ops, account["id"], NOTES, filename="notes.txt", content_type="text/plain",
                                   label="release notes")
        assert banner["state"] == "stored" and banner["sha256"] == hashlib.sha256(PNG).hexdigest()
        sent = await ops.call("platform.broadcast.create", platform_service_account_id=account["id"],
                              client_broadcast_id="b-1", title="New release", content="see attached",
                              asset_ids=[notes["id"], banner["id"]])
        assert [a["asset_id"] for a in sent["assets"]] == [notes["id"], banner["id"]]
        assert sent["assets"][0] == {"asset_id": notes["id"], "filename": "notes.txt", "label": "release notes",
                                     "content_type": "text/plain", "byte_size": len(NOTES),
                                     "sha256": hashlib.sha256(NOTES).hexdigest()}
        assert (await wait_broadcast_done(ops, sent["id"]))["state"] == "completed"
        # Referenced: frozen, and no longer the uploader's to delete.
        assert (await ops.call("platform.asset.get", asset_id=banner["id"]))["referenced"]
        await expect_error("conflict", ops.call("platform.asset.upload.abort", asset_id=banner["id"]))

    attached_in: dict[str, list[dict]] = {}
    for tenant in tenants:
        async with await signed_in(app, tenant.owner) as member:
            message, = await conversation_messages(member, tenant.workspace_id, account["id"])
            attached = attached_in[tenant.workspace_id] = message["metadata"]["attachments"]
            assert [(a["filename"], a["label"], a["byte_size"]) for a in attached] == [
                ("notes.txt", "release notes", len(NOTES)), ("banner.png", "banner.png", len(PNG))]
            assert await read_all(member, tenant.workspace_id, attached[0]["id"]) == NOTES
            assert await read_all(member, tenant.workspace_id, attached[1]["id"]) == PNG
            info = await member.call("attachment.get", workspace_id=tenant.workspace_id,
                                     attachment_id=attached[1]["id"])
            assert info["state"] == "claimed" and info["message_id"] == message["id"]
            found = await member.call("message.search", workspace_id=tenant.workspace_id, query="release notes",
                                      has_attachment=True)
            assert [hit["message"]["id"] for hit in found["hits"]] == [message["id"]], "found by its label"
    alpha, beta = tenants
    assert not {a["id"] for a in attached_in[alpha.workspace_id]} & {a["id"] for a in attached_in[beta.workspace_id]}
    async with await signed_in(app, beta.owner) as other:  # one workspace's attachment is not another's
        await expect_error("not_found", other.call("attachment.get", workspace_id=beta.workspace_id,
                                                   attachment_id=attached_in[alpha.workspace_id][0]["id"]))
    mappings = await app.db.run(lambda conn: conn.fetch(
        "SELECT d.workspace_id, m.asset_ordinal, m.asset_id FROM platform_service_account_delivery_assets m "
        "JOIN platform_service_account_broadcast_deliveries d ON d.id = m.delivery_id ORDER BY 1, 2"))
    assert [(r["asset_ordinal"], r["asset_id"]) for r in mappings] == [
        (0, notes["id"]), (1, banner["id"])] * 2
    # The bytes are stored once, whatever the number of workspaces.
    assert sorted(_files(attachments_dir)) == sorted([PNG, NOTES])


async def _broadcast_count(app: App) -> int:
    return await app.db.run(lambda conn: conn.fetchval("SELECT count(*) FROM platform_service_account_broadcasts"))


async def test_broadcast_assets_are_checked_digested_and_frozen(app: App, tenants):
    async with operator(app, "first") as ops, operator(app, "second") as colleague:
        account = await create_platform_account(ops, "News")
        other_account = await create_platform_account(ops, "Other")
        await wait_ready(ops, account["id"])
        banner = await upload_asset(ops, account["id"], PNG)
        elsewhere = await upload_asset(ops, other_account["id"], PNG)
        unfinished = await ops.call("platform.asset.upload.begin", platform_service_account_id=account["id"],
                                    filename="late.png", content_type="image/png", byte_size=len(PNG))

        async def create(client_id: str, asset_ids: list[str], by=ops):
            return await by.call("platform.broadcast.create", platform_service_account_id=account["id"],
                                 client_broadcast_id=client_id, title="t", content="c", asset_ids=asset_ids)

        for asset_ids in ([elsewhere["id"]], [unfinished["id"]], ["pas_0000000000zzzz"], [banner["id"], "nonsense"]):
            error = await expect_error("not_found", create("bad", asset_ids))
            if "nonsense" not in asset_ids:
                assert error.details["reason"] == "asset_not_found", error
        error = await expect_error("invalid", create("twice", [banner["id"], banner["id"]]))
        assert error.details["reason"] == "duplicate_asset"
        assert await _broadcast_count(app) == 0, "a refused broadcast writes nothing"
        assert not (await ops.call("platform.asset.get", asset_id=banner["id"]))["referenced"]

        # Only the uploader sends, finishes or aborts an upload; any operator sees and uses it.
        for call in (colleague.call("platform.asset.upload.chunk", asset_id=unfinished["id"], offset=0,
                                    data=_b64(PNG[:10])),
                     colleague.call("platform.asset.upload.finish", asset_id=unfinished["id"]),
                     colleague.call("platform.asset.upload.abort", asset_id=unfinished["id"])):
            await expect_error("not_found", call)
        assert (await colleague.call("platform.asset.get", asset_id=unfinished["id"]))["state"] == "uploading"
        first = await create("b-1", [banner["id"]], by=colleague)
        assert first["assets"][0]["asset_id"] == banner["id"]

        # The manifest is part of the digest: a replay with the same assets is the same broadcast,
        # with other assets (or none) a conflict.
        again = await create("b-1", [banner["id"]], by=colleague)
        assert again["id"] == first["id"] and again["replayed"] and again["payload_digest"] == first["payload_digest"]
        await expect_error("idempotency_conflict", create("b-1", [], by=colleague))
        plain = await create("b-2", [])
        assert plain["payload_digest"] != first["payload_digest"] and "assets" not in plain

        # Referenced assets are immutable and kept; an unreferenced one can still be aborted.
        error = await expect_error("conflict", ops.call("platform.asset.upload.abort", asset_id=banner["id"]))
        assert error.details["reason"] == "asset_in_use"
        await ops.call("platform.asset.upload.abort", asset_id=unfinished["id"])
        await expect_error("not_found", ops.call("platform.asset.get", asset_id=unfinished["id"]))
        # A member is not an operator.
        alpha = tenants[0]
        async with await signed_in(app, alpha.owner) as member:
            await expect_error("forbidden", member.call("platform.asset.get", asset_id=banner["id"]))


async def test_unreferenced_assets_expire_and_a_deleted_accounts_assets_are_collected(app: App, tenants,
                                                                                      attachments_dir: Path):
    async with operator(app) as ops:
        account = await create_platform_account(ops, "Digest")
        await wait_ready(ops, account["id"])
        kept = await upload_asset(ops, account["id"], PNG)
        idle = await upload_asset(ops, account["id"], NOTES, filename="idle.txt", content_type="text/plain")
        partial = await ops.call("platform.asset.upload.begin", platform_service_account_id=account["id"],
                                 filename="partial.png", content_type="image/png", byte_size=len(PNG))
        await ops.call("platform.asset.upload.chunk", asset_id=partial["id"], offset=0, data=_b64(PNG[:100]))
        sent = await ops.call("platform.broadcast.create", platform_service_account_id=account["id"],
                              client_broadcast_id="b-1", title="t", content="c", asset_ids=[kept["id"]])
        await wait_broadcast_done(ops, sent["id"])
        assert idle["expires_at_ms"] and "expires_at_ms" not in await ops.call("platform.asset.get",
                                                                                asset_id=kept["id"])

        collector, now = app.server.attachments, datetime.now(timezone.utc)
        await collector.collect_garbage(app.server, now + timedelta(seconds=DAY - 600))
        assert (await ops.call("platform.asset.get", asset_id=idle["id"]))["state"] == "stored"
        await collector.collect_garbage(app.server, now + timedelta(seconds=DAY + 600))
        for gone in (idle, partial):
            await expect_error("not_found", ops.call("platform.asset.get", asset_id=gone["id"]))
        assert not (attachments_dir / "staging" / partial["id"]).exists()
        assert sorted(_files(attachments_dir)) == [PNG], "the referenced asset stays, bytes and all"

        await ops.call("platform.account.delete", platform_service_account_id=account["id"],
                       expected_version=(await ops.call("platform.account.get",
                                                        platform_service_account_id=account["id"]))["version"])
    # The account's scopes (and their attachments) went with it; its assets are the collector's.
    assert await app.db.run(lambda conn: conn.fetchval("SELECT count(*) FROM attachments")) == 0
    await collector.collect_garbage(app.server, now)
    assert _files(attachments_dir) == []
    assert await app.db.run(lambda conn: conn.fetchval("SELECT count(*) FROM platform_service_account_assets")) == 0


ASSET_OPS = [p.PlatformAssetUploadBegin, p.PlatformAssetUploadChunk, p.PlatformAssetUploadFinish,
             p.PlatformAssetUploadAbort, p.PlatformAssetGet, p.BroadcastCreate]


async def test_hostile_values_in_every_field_of_the_asset_ops_never_answer_internal(app: App, tenants,
                                                                                  no_error_logs):
    """An operator's bad input of any shape to the asset ops (and a broadcast's `asset_ids`) gets a
    typed error, never `internal`, over JSON and MessagePack."""
    async with operator(app) as ops:
        account = await create_platform_account(ops, "Fuzzed")
        stored = await upload_asset(ops, account["id"], NOTES, filename="n.txt", content_type="text/plain")
        pending = await ops.call("platform.asset.upload.begin", platform_service_account_id=account["id"],
                                 filename="p.png", content_type="image/png", byte_size=len(PNG))
        key = ops.key
    plausible = {"platform_service_account_id": account["id"], "filename": "f.png", "content_type": "image/png",
                 "byte_size": 10, "asset_id": pending["id"], "offset": 0, "data": _b64(b"\x89PNG"),
                 "asset_ids": [stored["id"]], "client_broadcast_id": "fuzz", "title": "t", "content": "c"}
    token = trio.lowlevel.current_trio_token()
    seen: set[str] = set()
    auth = {"op": "auth", "id": "auth", "operator_key": key}
    async with trio_websocket.open_websocket_url(app.url) as text_ws, \
            trio_websocket.open_websocket_url(app.url, subprotocols=["scopewire.msgpack"]) as binary_ws:
        assert (await _raw_reply(text_ws, json.dumps(auth)))["type"] == "result"
        assert (await _raw_reply(binary_ws, msgspec.msgpack.encode(auth)))["type"] == "result"

        @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def probe(data):
            op = data.draw(st.sampled_from(ASSET_OPS), label="op")
            names = [f.name for f in msgspec.structs.fields(op) if f.name != "id"]
            body = {name: plausible[name] for name in names if name in plausible}
            binary = data.draw(st.booleans(), label="msgpack")
            for name in data.draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=2)):
                usual = plausible.get(name, "")
                choices = msgpack_values if binary else json_values
                if isinstance(usual, str):
                    hostile = st.sampled_from(HOSTILE).map(lambda bad, usual=usual: usual[:4] + bad + usual[4:])
                    choices = st.one_of(hostile, choices)
                body[name] = data.draw(choices, label=name)
            body = {"op": op.__struct_config__.tag, "id": "fuzz", **body}
            frame = msgspec.msgpack.encode(body) if binary else json.dumps(body)
            reply = trio.from_thread.run(_raw_reply, binary_ws if binary else text_ws, frame, trio_token=token)
            assert reply["type"] in ("result", "error"), reply
            if reply["type"] == "error":
                assert reply["code"] in {c.value for c in ErrorCode} and reply["code"] != "internal", (frame, reply)
                seen.add(reply["code"])

        await trio.to_thread.run_sync(probe)
    assert "invalid" in seen, seen
