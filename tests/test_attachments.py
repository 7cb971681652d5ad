"""Attachments over the WebSocket against a real PostgreSQL (scope-model.md §3.11,
protocol/attachments.py): chunked upload with resume, size/type/name/digest/quota
refusals, the claim in message.send's transaction, reads through the owning
message's visibility, and the garbage collection of unclaimed uploads."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import signal
from datetime import datetime, timedelta, timezone
from pathlib import Path

import msgspec
import pytest
import trio
import trio_websocket

from client import ClientError, connect
from protocol.attachments import MAX_CHUNK_BYTES
from server.config import ServerConfig
from tests.conftest import App, add_person
from tests.test_messaging import open_channel
from tests.test_outage import init_instance
from tests.test_private_visibility import as_agent
from tests.test_serve import data_dir, start_serve, stop_serve  # noqa: F401
from tests.test_tenancy import expect_error, signed_in

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Every byte value, several times over: 2 full chunks and a partial third.
BINARY_PNG = PNG_MAGIC + bytes(range(256)) * 1200
UNKNOWN_ATTACHMENT = "att_zzzzzzzzzzzzzz"
DAY = 86400


@pytest.fixture
def attachments_dir(tmp_path: Path) -> Path:
    return tmp_path / "attachments"


@pytest.fixture
def server_config(request: pytest.FixtureRequest, attachments_dir: Path) -> ServerConfig:
    """conftest's test server config, with the local driver's directory where the test can look."""
    return ServerConfig(**{"port": 0, "auth_timeout_seconds": 2.0, "expiry_sweep_seconds": 0.5,
                           "shutdown_grace_seconds": 2.0, "attachments_dir": attachments_dir,
                           **getattr(request, "param", {})})


@pytest.fixture
async def team(app: App, tenants, member_password_hash):
    """Alpha's owner, Bob and Carol in a private channel with the owner's private agent;
    Dave in Alpha but not in the channel; Beta for cross-workspace probes."""
    alpha, beta = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    dave = await add_person(app.db, alpha.workspace_id, "dave@example.com", "developer", member_password_hash)
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "project",
                                     [bob.member_id, carol.member_id, agent["id"]], visibility="private")
        other = await open_channel(owner, alpha.workspace_id, "other", [bob.member_id])
        key = await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws)
    return dict(alpha=alpha, beta=beta, bob=bob, carol=carol, dave=dave, channel=channel["id"],
                other=other["id"], agent_key=key["key"], ws=ws)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def begin(conn, ws: dict, scope_id: str, data: bytes, *, filename: str = "blob.png",
                content_type: str = "image/png", **extra) -> dict:
    return await conn.call("attachment.upload.begin", scope_id=scope_id, filename=filename,
                           content_type=content_type, byte_size=len(data), **extra, **ws)


async def send_chunks(conn, ws: dict, attachment_id: str, data: bytes, start: int = 0) -> dict:
    info = None
    for offset in range(start, len(data), MAX_CHUNK_BYTES):
        info = await conn.call("attachment.upload.chunk", attachment_id=attachment_id, offset=offset,
                               data=b64(data[offset:offset + MAX_CHUNK_BYTES]), **ws)
        assert info["received_bytes"] == min(offset + MAX_CHUNK_BYTES, len(data))
    return info


async def upload(conn, ws: dict, scope_id: str, data: bytes, **begin_fields) -> dict:
    """A whole upload: begin, every chunk, finish; the stored attachment's info."""
    begun = await begin(conn, ws, scope_id, data, **begin_fields)
    await send_chunks(conn, ws, begun["id"], data)
    return await conn.call("attachment.upload.finish", attachment_id=begun["id"], **ws)


async def read_all(conn, ws: dict, attachment_id: str, length: int = 100_000) -> bytes:
    """The whole stored file, read in pieces of `length` (not the upload's chunk size)."""
    out = bytearray()
    while True:
        part = await conn.call("attachment.read", attachment_id=attachment_id, offset=len(out), length=length, **ws)
        assert part["attachment_id"] == attachment_id and part["offset"] == len(out)
        piece = base64.b64decode(part["data"])
        out += piece
        if part["eof"]:
            return bytes(out)
        assert piece, "a read that is not at the end returns bytes"


async def attachment_rows(app: App) -> list[tuple[str, str, str | None]]:
    rows = await app.db.run(lambda c: c.fetch("SELECT id, upload_state, message_id FROM attachments ORDER BY id"))
    return [(r["id"], r["upload_state"], r["message_id"]) for r in rows]


async def message_count(app: App) -> int:
    return await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_messages"))


def stored_files(root: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in root.rglob("*") if path.is_file()}


class MsgpackConnection:
    """A raw client on the `scopewire.msgpack` subprotocol: chunks travel as raw bytes."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    async def send(self, op: str, **fields) -> str:
        request_id = f"mp-{next(self._ids)}"
        await self.ws.send_message(msgspec.msgpack.encode({"op": op, "id": request_id, **fields}))
        return request_id

    async def reply(self, request_id: str):
        """The reply to `request_id`, which must be the next reply on the connection."""
        with trio.fail_after(60):
            while (reply := msgspec.msgpack.decode(await self.ws.get_message())).get("type") == "event":
                pass
        assert reply.get("id") == request_id, reply
        if reply["type"] == "error":
            raise ClientError(reply["code"], reply["message"], reply.get("details"))
        return reply["data"]

    async def call(self, op: str, **fields):
        return await self.reply(await self.send(op, **fields))


@contextlib.asynccontextmanager
async def msgpack_signed_in(app: App, person):
    async with trio_websocket.open_websocket_url(app.url, subprotocols=["scopewire.msgpack"]) as ws:
        assert ws.subprotocol == "scopewire.msgpack"
        conn = MsgpackConnection(ws)
        await conn.call("login", email=person.email, password=person.password)
        yield conn


# --- upload --------------------------------------------------------------------------------------


async def test_a_chunked_binary_upload_is_stored_hashed_and_read_back_whole(app: App, team):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    async with await signed_in(app, alpha.owner) as owner:
        begun = await begin(owner, ws, scope, BINARY_PNG, filename="every byte.png", label="all the bytes")
        assert begun["id"].startswith("att_") and begun["state"] == "uploading"
        assert (begun["received_bytes"], begun["byte_size"]) == (0, len(BINARY_PNG))
        # Omitted while it is the protocol's default (the contract's convention for defaults).
        assert begun.get("max_chunk_bytes", MAX_CHUNK_BYTES) == MAX_CHUNK_BYTES
        assert begun["uploaded_by_member_id"] == alpha.owner.member_id and begun["scope_id"] == scope
        assert begun["expires_at_ms"] > begun["created_at_ms"]
        assert "sha256" not in begun and "message_id" not in begun
        await send_chunks(owner, ws, begun["id"], BINARY_PNG)
        stored = await owner.call("attachment.upload.finish", attachment_id=begun["id"], **ws)
        assert stored["state"] == "stored" and stored["sha256"] == sha256(BINARY_PNG)
        assert stored["received_bytes"] == len(BINARY_PNG)
        assert (stored["filename"], stored["label"], stored["content_type"]) == \
            ("every byte.png", "all the bytes", "image/png")
        # Finishing again answers the same stored upload.
        assert await owner.call("attachment.upload.finish", attachment_id=begun["id"], **ws) == stored
        assert await owner.call("attachment.get", attachment_id=begun["id"], **ws) == stored
        assert await read_all(owner, ws, begun["id"]) == BINARY_PNG
        assert await read_all(owner, ws, begun["id"], length=MAX_CHUNK_BYTES) == BINARY_PNG
        # A read past the end is empty and at the end.
        tail = await owner.call("attachment.read", attachment_id=begun["id"], offset=len(BINARY_PNG), **ws)
        assert (tail["data"], tail["eof"]) == ("", True)
        # The label defaults to the filename.
        plain = await upload(owner, ws, scope, b"just text\n", filename="notes.txt", content_type="text/plain")
        assert plain["label"] == "notes.txt"
    assert [state for _, state, _ in await attachment_rows(app)] == ["stored", "stored"]


async def test_msgpack_clients_upload_and_read_raw_bytes(app: App, team):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    async with msgpack_signed_in(app, alpha.owner) as owner:
        begun = await owner.call("attachment.upload.begin", scope_id=scope, filename="raw.png",
                                 content_type="image/png", byte_size=len(BINARY_PNG), sha256=sha256(BINARY_PNG),
                                 **ws)
        # Pipelined: every chunk and the finish are sent before the first answer is read.
        requests = [await owner.send("attachment.upload.chunk", attachment_id=begun["id"], offset=offset,
                                     data=BINARY_PNG[offset:offset + MAX_CHUNK_BYTES], **ws)
                    for offset in range(0, len(BINARY_PNG), MAX_CHUNK_BYTES)]
        finish = await owner.send("attachment.upload.finish", attachment_id=begun["id"], **ws)
        received = [(await owner.reply(request))["received_bytes"] for request in requests]
        assert received == [min(offset + MAX_CHUNK_BYTES, len(BINARY_PNG))
                            for offset in range(0, len(BINARY_PNG), MAX_CHUNK_BYTES)]
        stored = await owner.reply(finish)
        assert stored["sha256"] == sha256(BINARY_PNG)
        read_back = bytearray()
        while True:
            part = await owner.call("attachment.read", attachment_id=begun["id"], offset=len(read_back), **ws)
            assert isinstance(part["data"], bytes)
            read_back += part["data"]
            if part["eof"]:
                break
        assert bytes(read_back) == BINARY_PNG
    # The JSON client reads the same bytes.
    async with await signed_in(app, alpha.owner) as owner:
        assert await read_all(owner, ws, begun["id"]) == BINARY_PNG


async def test_an_interrupted_upload_resumes_from_the_received_bytes(app: App, team):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    async with await signed_in(app, alpha.owner) as owner:
        begun = await begin(owner, ws, scope, BINARY_PNG, sha256=sha256(BINARY_PNG))
        await owner.call("attachment.upload.chunk", attachment_id=begun["id"], offset=0,
                         data=b64(BINARY_PNG[:MAX_CHUNK_BYTES]), **ws)
    # The connection is gone; a new one asks where to go on from.
    async with await signed_in(app, alpha.owner) as owner:
        info = await owner.call("attachment.get", attachment_id=begun["id"], **ws)
        assert (info["state"], info["received_bytes"]) == ("uploading", MAX_CHUNK_BYTES)
        # Sending the first chunk again, or skipping ahead, is refused with where to resume.
        for wrong_offset in (0, MAX_CHUNK_BYTES + 1):
            error = await expect_error("conflict", owner.call(
                "attachment.upload.chunk", attachment_id=begun["id"], offset=wrong_offset,
                data=b64(BINARY_PNG[wrong_offset:wrong_offset + 10]), **ws))
            assert error.details["reason"] == "offset_mismatch"
            assert error.details["received_bytes"] == MAX_CHUNK_BYTES
        await send_chunks(owner, ws, begun["id"], BINARY_PNG, start=info["received_bytes"])
        stored = await owner.call("attachment.upload.finish", attachment_id=begun["id"], **ws)
        assert stored["sha256"] == sha256(BINARY_PNG)
        assert await read_all(owner, ws, begun["id"]) == BINARY_PNG
        # A stored upload takes no more chunks.
        error = await expect_error("conflict", owner.call(
            "attachment.upload.chunk", attachment_id=begun["id"], offset=len(BINARY_PNG), data=b64(b"x"), **ws))
        assert error.details["reason"] == "upload_finished"


async def test_an_upload_resumes_after_the_server_process_is_killed(data_dir: Path, database_dsn: str):  # noqa: F811
    database = ("--database-url", database_dsn)
    owner = await init_instance("--data-dir", str(data_dir), *database)
    served = await start_serve(data_dir, *database)
    async with connect(served.url) as conn:
        await conn.login("o@example.com", owner["password"])
        scope = (await conn.call("channel.create", slug="files", display_name="Files"))["id"]
        begun = await begin(conn, {}, scope, BINARY_PNG)
        await conn.call("attachment.upload.chunk", attachment_id=begun["id"], offset=0,
                        data=b64(BINARY_PNG[:MAX_CHUNK_BYTES]))
    served.process.kill()  # the running digest in memory is lost with the process
    assert await served.process.wait() == -signal.SIGKILL

    served = await start_serve(data_dir, *database)
    async with connect(served.url) as conn:
        await conn.login("o@example.com", owner["password"])
        info = await conn.call("attachment.get", attachment_id=begun["id"])
        assert (info["state"], info["received_bytes"]) == ("uploading", MAX_CHUNK_BYTES)
        await send_chunks(conn, {}, begun["id"], BINARY_PNG, start=info["received_bytes"])
        stored = await conn.call("attachment.upload.finish", attachment_id=begun["id"])
        assert stored["sha256"] == sha256(BINARY_PNG)
        assert await read_all(conn, {}, begun["id"]) == BINARY_PNG
    # `serve` keeps attachments under its data directory by default.
    assert BINARY_PNG in stored_files(data_dir / "attachments").values()
    assert await stop_serve(served) == 0


async def test_chunks_past_the_end_and_early_finish_are_refused(app: App, team):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    data = b"twelve bytes"
    async with await signed_in(app, alpha.owner) as owner:
        begun = await begin(owner, ws, scope, data, filename="t.txt", content_type="text/plain")
        error = await expect_error("too_large", owner.call(
            "attachment.upload.chunk", attachment_id=begun["id"], offset=0, data=b64(data + b"!"), **ws))
        assert error.details["reason"] == "chunk_past_end"
        await owner.call("attachment.upload.chunk", attachment_id=begun["id"], offset=0, data=b64(data[:5]), **ws)
        error = await expect_error("too_large", owner.call(
            "attachment.upload.chunk", attachment_id=begun["id"], offset=5, data=b64(data[5:] + b"!"), **ws))
        assert error.details["reason"] == "chunk_past_end"
        error = await expect_error("conflict", owner.call("attachment.upload.finish", attachment_id=begun["id"],
                                                          **ws))
        assert error.details["reason"] == "upload_incomplete"
        # Nothing of the refused chunks was kept.
        assert (await owner.call("attachment.get", attachment_id=begun["id"], **ws))["received_bytes"] == 5
        await owner.call("attachment.upload.chunk", attachment_id=begun["id"], offset=5, data=b64(data[5:]), **ws)
        stored = await owner.call("attachment.upload.finish", attachment_id=begun["id"], **ws)
        assert await read_all(owner, ws, stored["id"]) == data


async def test_a_wrong_declared_digest_deletes_the_upload(app: App, team, attachments_dir: Path):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    data = b"the real bytes\n"
    async with await signed_in(app, alpha.owner) as owner:
        begun = await begin(owner, ws, scope, data, filename="d.txt", content_type="text/plain",
                            sha256=sha256(b"other bytes\n"))
        await send_chunks(owner, ws, begun["id"], data)
        assert (attachments_dir / "staging" / begun["id"]).read_bytes() == data
        error = await expect_error("invalid", owner.call("attachment.upload.finish", attachment_id=begun["id"], **ws))
        assert error.details["reason"] == "digest_mismatch"
        await expect_error("not_found", owner.call("attachment.get", attachment_id=begun["id"], **ws))
        await expect_error("not_found", owner.call("attachment.upload.finish", attachment_id=begun["id"], **ws))
    assert await attachment_rows(app) == []
    assert stored_files(attachments_dir) == {}


async def test_begin_refuses_oversize_disallowed_types_bad_names_and_unwritable_scopes(app: App, team):
    alpha, beta, dave, ws = team["alpha"], team["beta"], team["dave"], team["ws"]
    scope = team["channel"]
    fields = {"scope_id": scope, "filename": "f.txt", "content_type": "text/plain", "byte_size": 10, **ws}
    async with await signed_in(app, alpha.owner) as owner:
        error = await expect_error("too_large", owner.call(
            "attachment.upload.begin", **{**fields, "byte_size": 100 * 2**20 + 1}))
        assert error.details["reason"] == "file_too_large"
        for content_type in ("application/x-msdownload", "application/octet-stream", "text/html"):
            error = await expect_error("invalid", owner.call(
                "attachment.upload.begin", **{**fields, "content_type": content_type}))
            assert error.details["reason"] == "content_type_not_allowed", content_type
        for filename in ("../secret.txt", "dir/f.txt", "dir\\f.txt", "bell\x07.txt", "two\nlines.txt",
                         "del\x7f.txt", "..", "."):
            error = await expect_error("invalid", owner.call("attachment.upload.begin",
                                                             **{**fields, "filename": filename}))
            assert error.details["reason"] == "bad_filename", filename
        # A label is shown as a name: no control or format (bidi, zero-width) characters either.
        for label in ("x\u202ey", "bell\x07", "zero\u200bwidth"):
            error = await expect_error("invalid", owner.call("attachment.upload.begin", **{**fields, "label": label}))
            assert error.details["reason"] == "bad_label", label
        await expect_error("bad_frame", owner.call("attachment.upload.begin", **{**fields, "filename": "x" * 256}))
        await expect_error("bad_frame", owner.call("attachment.upload.begin", **{**fields, "filename": ""}))
        # Malformed fields are the frame's problem.
        await expect_error("bad_frame", owner.call("attachment.upload.begin", **{**fields, "byte_size": 0}))
        await expect_error("bad_frame", owner.call("attachment.upload.begin",
                                                   **{**fields, "content_type": "Text/Plain"}))
        await expect_error("bad_frame", owner.call("attachment.upload.begin", **{**fields, "sha256": "abc"}))
    # A scope you may not write to is not there for you.
    async with await signed_in(app, dave) as d:
        await expect_error("not_found", d.call("attachment.upload.begin", **fields))
    async with await signed_in(app, beta.owner) as b:
        await expect_error("not_found", b.call("attachment.upload.begin", **fields))
        await expect_error("not_found", b.call("attachment.upload.begin",
                                               **{**fields, "workspace_id": beta.workspace_id}))
    assert await attachment_rows(app) == []


@pytest.mark.parametrize("content_type, data", [
    ("image/png", b"this is plain text, not a picture\n"),
    ("image/jpeg", PNG_MAGIC + b"\x00" * 32),
    ("application/pdf", b"hello"),
    ("text/plain", b"\x7fELF\x02\x01\x01\x00" + bytes(56)),
    ("text/plain", b"MZ\x90\x00" + bytes(60)),
    ("text/plain", b"caf\xe9 is not UTF-8\n"),
], ids=["text-as-png", "png-as-jpeg", "text-as-pdf", "elf-as-text", "mz-as-text", "latin1-as-text"])
async def test_bytes_that_are_not_what_the_type_says_are_refused(app: App, team, content_type: str, data: bytes):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    async with await signed_in(app, alpha.owner) as owner:
        begun = await begin(owner, ws, scope, data, filename="f", content_type=content_type)
        await send_chunks(owner, ws, begun["id"], data)
        error = await expect_error("invalid", owner.call("attachment.upload.finish", attachment_id=begun["id"], **ws))
        assert error.details["reason"] == "content_type_mismatch"
        # It never becomes claimable.
        error = await expect_error("not_found", owner.call("message.send", scope_id=scope, content="see file",
                                                           attachment_ids=[begun["id"]], **ws))
        assert error.details["reason"] == "attachment_not_found"
    assert [state for _, state, _ in await attachment_rows(app)] in ([], ["uploading"])
    assert await message_count(app) == 0


async def test_abort_deletes_an_upload_until_a_message_claims_it(app: App, team, attachments_dir: Path):
    alpha, bob, ws, scope = team["alpha"], team["bob"], team["ws"], team["channel"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        partial = await begin(owner, ws, scope, b"partial\n", filename="p.txt", content_type="text/plain")
        await owner.call("attachment.upload.chunk", attachment_id=partial["id"], offset=0, data=b64(b"part"), **ws)
        # Reading an upload in progress is refused until it is stored.
        error = await expect_error("conflict", owner.call("attachment.read", attachment_id=partial["id"], **ws))
        assert error.details["reason"] == "upload_incomplete"
        stored = await upload(owner, ws, scope, b"stored\n", filename="s.txt", content_type="text/plain")
        claimed = await upload(owner, ws, scope, b"claimed\n", filename="c.txt", content_type="text/plain")
        await owner.call("message.send", scope_id=scope, content="c", attachment_ids=[claimed["id"]], **ws)
        # Someone else's upload is not yours to abort.
        await expect_error("not_found", b.call("attachment.upload.abort", attachment_id=stored["id"], **ws))
        for upload_id in (partial["id"], stored["id"]):
            await owner.call("attachment.upload.abort", attachment_id=upload_id, **ws)
            await expect_error("not_found", owner.call("attachment.get", attachment_id=upload_id, **ws))
        await expect_error("not_found", owner.call("attachment.upload.chunk", attachment_id=partial["id"], offset=4,
                                                   data=b64(b"ial\n"), **ws))
        # A claimed attachment belongs to its message now.
        await expect_error("not_found", owner.call("attachment.upload.abort", attachment_id=claimed["id"], **ws))
        assert await read_all(b, ws, claimed["id"]) == b"claimed\n"
    assert [i for i, _, _ in await attachment_rows(app)] == [claimed["id"]]
    assert list(stored_files(attachments_dir).values()) == [b"claimed\n"]


@pytest.mark.parametrize("server_config", [{"max_unclaimed_upload_bytes": 1000}], indirect=True)
async def test_unclaimed_uploads_are_bounded_per_member(app: App, team):
    alpha, bob, ws, scope = team["alpha"], team["bob"], team["ws"], team["channel"]
    first, second = b"a" * 600, b"b" * 600
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        stored = await upload(owner, ws, scope, first, filename="a.txt", content_type="text/plain")
        error = await expect_error("too_large", begin(owner, ws, scope, second, filename="b.txt",
                                                      content_type="text/plain"))
        assert error.details["reason"] == "upload_quota_exceeded"
        # The bound is per member.
        await upload(b, ws, scope, second, filename="b.txt", content_type="text/plain")
        # Claiming frees the member's allowance.
        await owner.call("message.send", scope_id=scope, content="first", attachment_ids=[stored["id"]], **ws)
        again = await upload(owner, ws, scope, second, filename="b.txt", content_type="text/plain")
        error = await expect_error("too_large", begin(owner, ws, scope, first, filename="c.txt",
                                                      content_type="text/plain"))
        assert error.details["reason"] == "upload_quota_exceeded"
        # So does aborting.
        await owner.call("attachment.upload.abort", attachment_id=again["id"], **ws)
        await expect_error("not_found", owner.call("attachment.get", attachment_id=again["id"], **ws))
        await upload(owner, ws, scope, first, filename="c.txt", content_type="text/plain")


@pytest.mark.parametrize("server_config", [{"max_unclaimed_uploads": 2}], indirect=True)
async def test_the_number_of_unclaimed_uploads_is_bounded_per_member(app: App, team):
    """Tiny uploads cannot pile up: a count bounds them as the byte quota bounds big ones."""
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    async with await signed_in(app, alpha.owner) as owner:
        first = await upload(owner, ws, scope, b"1", filename="1.txt", content_type="text/plain")
        await begin(owner, ws, scope, b"2", filename="2.txt", content_type="text/plain")
        error = await expect_error("too_large", begin(owner, ws, scope, b"3", filename="3.txt",
                                                      content_type="text/plain"))
        assert error.details["reason"] == "upload_quota_exceeded"
        await owner.call("message.send", scope_id=scope, content="one", attachment_ids=[first["id"]], **ws)
        await begin(owner, ws, scope, b"3", filename="3.txt", content_type="text/plain")


# --- claim and read --------------------------------------------------------------------------------


async def test_a_claimed_attachment_is_read_by_whoever_reads_its_message(app: App, team):
    alpha, beta, bob, carol, dave = team["alpha"], team["beta"], team["bob"], team["carol"], team["dave"]
    ws, scope = team["ws"], team["channel"]
    async with (await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b,
                await signed_in(app, carol) as c, await signed_in(app, dave) as d,
                await signed_in(app, beta.owner) as outsider, as_agent(app, team["agent_key"]) as scout):
        stored = await upload(owner, ws, scope, BINARY_PNG, filename="plan.png", label="the plan")
        attachment = stored["id"]
        # Unclaimed: the uploader's alone.
        for reader in (b, scout):
            await expect_error("not_found", reader.call("attachment.get", attachment_id=attachment, **ws))
            await expect_error("not_found", reader.call("attachment.read", attachment_id=attachment, **ws))
        message = await owner.call("message.send", scope_id=scope, content="the plan", attachment_ids=[attachment],
                                   **ws)
        described = [{"id": attachment, "filename": "plan.png", "label": "the plan", "content_type": "image/png",
                      "byte_size": len(BINARY_PNG), "sha256": sha256(BINARY_PNG)}]
        assert message["metadata"]["attachments"] == described
        history = await b.call("message.history", scope_id=scope, **ws)
        assert history["messages"][-1]["metadata"]["attachments"] == described
        # Every reader of the message reads the file, the owner's private agent included.
        for reader in (owner, b, c, scout):
            info = await reader.call("attachment.get", attachment_id=attachment, **ws)
            assert (info["state"], info["message_id"]) == ("claimed", message["id"])
            assert "expires_at_ms" not in info
            assert await read_all(reader, ws, attachment) == BINARY_PNG
        # Bob's message is not the agent's to read (no grant): nor is its attachment.
        bobs = await upload(b, ws, scope, b"bob's notes\n", filename="bob.txt", content_type="text/plain")
        await b.call("message.send", scope_id=scope, content="notes", attachment_ids=[bobs["id"]], **ws)
        assert await read_all(c, ws, bobs["id"]) == b"bob's notes\n"
        # Nobody outside the message's readers sees either one.
        for reader, workspace in ((scout, ws), (d, ws), (outsider, ws),
                                  (outsider, {"workspace_id": beta.workspace_id})):
            for target in ([bobs["id"]] if reader is scout else [attachment, bobs["id"]]):
                await expect_error("not_found", reader.call("attachment.get", attachment_id=target, **workspace))
                await expect_error("not_found", reader.call("attachment.read", attachment_id=target, **workspace))
        # An edit keeps the message's attachments.
        edited = await owner.call("message.edit", message_id=message["id"], content="the plan, v2",
                                  expected_revision=1, **ws)
        assert edited["metadata"]["attachments"] == described
        assert (await b.call("attachment.get", attachment_id=attachment, **ws))["state"] == "claimed"
        # Withdrawing the message makes its attachment unreadable at once, for everyone.
        await owner.call("message.withdraw", message_id=message["id"], **ws)
        for reader in (owner, b, c, scout):
            await expect_error("not_found", reader.call("attachment.get", attachment_id=attachment, **ws))
            await expect_error("not_found", reader.call("attachment.read", attachment_id=attachment, **ws))
        assert await read_all(c, ws, bobs["id"]) == b"bob's notes\n"


async def test_a_send_that_cannot_claim_every_attachment_writes_nothing(app: App, team):
    alpha, bob, ws, scope, other = team["alpha"], team["bob"], team["ws"], team["channel"], team["other"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        first = await owner.call("message.send", scope_id=scope, content="before", **ws)
        mine = await upload(owner, ws, scope, b"mine\n", filename="mine.txt", content_type="text/plain")
        bobs = await upload(b, ws, scope, b"bob's\n", filename="bobs.txt", content_type="text/plain")
        elsewhere = await upload(owner, ws, other, b"other scope\n", filename="o.txt", content_type="text/plain")
        unfinished = await begin(owner, ws, scope, b"half done\n", filename="h.txt", content_type="text/plain")
        await owner.call("attachment.upload.chunk", attachment_id=unfinished["id"], offset=0, data=b64(b"half"),
                         **ws)
        claimed = await upload(owner, ws, scope, b"claimed\n", filename="c.txt", content_type="text/plain")
        await owner.call("message.send", scope_id=scope, content="claims", attachment_ids=[claimed["id"]], **ws)
        rows_before, count_before = await attachment_rows(app), await message_count(app)
        for ids in ([UNKNOWN_ATTACHMENT], [bobs["id"]], [elsewhere["id"]], [unfinished["id"]], [claimed["id"]],
                    [mine["id"], bobs["id"]], [mine["id"], claimed["id"]]):
            error = await expect_error("not_found", owner.call("message.send", scope_id=scope, content="refused",
                                                               attachment_ids=ids, client_message_id="refused",
                                                               **ws))
            assert error.details["reason"] == "attachment_not_found", ids
        error = await expect_error("invalid", owner.call("message.send", scope_id=scope, content="twice",
                                                         attachment_ids=[mine["id"], mine["id"]], **ws))
        assert error.details["reason"] == "duplicate_attachment"
        # Nothing was written: no message, no claim, the sequence goes on without a gap.
        assert await attachment_rows(app) == rows_before and await message_count(app) == count_before
        history = await b.call("message.history", scope_id=scope, **ws)
        assert [m["content"] for m in history["messages"]] == ["before", "claims"]
        assert (await owner.call("attachment.get", attachment_id=mine["id"], **ws))["state"] == "stored"
        # The client cannot write the server's list itself.
        await expect_error("invalid", owner.call("message.send", scope_id=scope, content="forged",
                                                 metadata={"attachments": [{"id": bobs["id"]}]}, **ws))
        sent = await owner.call("message.send", scope_id=scope, content="with mine", attachment_ids=[mine["id"]],
                                client_message_id="refused", **ws)
        assert sent["seq"] == first["seq"] + 2 and not sent.get("replayed")
        assert [a["id"] for a in sent["metadata"]["attachments"]] == [mine["id"]]


async def test_concurrent_sends_claim_an_attachment_once(app: App, team):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    outcomes: list[str] = []
    async with await signed_in(app, alpha.owner) as owner:
        stored = await upload(owner, ws, scope, b"contested\n", filename="c.txt", content_type="text/plain")
    go = trio.Event()

    async def send(index: int, claim: bool, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with await signed_in(app, alpha.owner) as conn:  # its own connection: truly concurrent
            task_status.started()
            await go.wait()
            try:
                await conn.call("message.send", scope_id=scope, content=f"send {index}",
                                attachment_ids=[stored["id"]] if claim else [], **ws)
                outcomes.append("sent" if claim else "plain")
            except ClientError as error:
                outcomes.append(error.details.get("reason", error.code))

    # Plain sends keep the scope's actor busy, so claims queue up and share group commit batches.
    async with trio.open_nursery() as nursery:
        for index in range(24):
            await nursery.start(send, index, index % 4 == 3)
        go.set()
    assert sorted(outcomes) == ["attachment_not_found"] * 5 + ["plain"] * 18 + ["sent"]
    assert await message_count(app) == 19


async def test_an_idempotent_retry_replays_the_claiming_send(app: App, team):
    alpha, ws, scope = team["alpha"], team["ws"], team["channel"]
    async with await signed_in(app, alpha.owner) as owner:
        files = [await upload(owner, ws, scope, f"file {i}\n".encode(), filename=f"{i}.txt",
                              content_type="text/plain") for i in range(2)]
        ids = [f["id"] for f in files]
        send = {"scope_id": scope, "content": "two files", "client_message_id": "c-1", **ws}
        first = await owner.call("message.send", attachment_ids=ids, **send)
        again = await owner.call("message.send", attachment_ids=ids, **send)
        assert again["replayed"] and again["id"] == first["id"] and again["seq"] == first["seq"]
        assert [a["id"] for a in again["metadata"]["attachments"]] == ids
        # The idempotency digest covers the attachment ids.
        await expect_error("idempotency_conflict", owner.call("message.send", attachment_ids=ids[:1], **send))
        await expect_error("idempotency_conflict", owner.call("message.send", **send))
    assert await message_count(app) == 1
    assert {message for _, _, message in await attachment_rows(app)} == {first["id"]}


# --- garbage collection ---------------------------------------------------------------------------------


async def test_unclaimed_uploads_past_the_ttl_are_collected_and_claimed_ones_stay(app: App, team,
                                                                                  attachments_dir: Path):
    alpha, bob, ws, scope = team["alpha"], team["bob"], team["ws"], team["channel"]
    kept_bytes, stored_bytes, partial_bytes, withdrawn_bytes = (
        f"{name} payload\n".encode() for name in ("kept", "stored", "partial", "withdrawn"))
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        kept = await upload(owner, ws, scope, kept_bytes, filename="kept.txt", content_type="text/plain")
        await owner.call("message.send", scope_id=scope, content="kept", attachment_ids=[kept["id"]], **ws)
        withdrawn = await upload(owner, ws, scope, withdrawn_bytes, filename="w.txt", content_type="text/plain")
        withdrawn_message = await owner.call("message.send", scope_id=scope, content="withdrawn",
                                             attachment_ids=[withdrawn["id"]], **ws)
        await owner.call("message.withdraw", message_id=withdrawn_message["id"], **ws)
        stored = await upload(b, ws, scope, stored_bytes, filename="s.txt", content_type="text/plain")
        partial = await begin(owner, ws, scope, partial_bytes, filename="p.txt", content_type="text/plain")
        await owner.call("attachment.upload.chunk", attachment_id=partial["id"], offset=0,
                         data=b64(partial_bytes[:4]), **ws)
        staged = attachments_dir / "staging" / partial["id"]
        assert staged.read_bytes() == partial_bytes[:4]
        contents = list(stored_files(attachments_dir).values())
        assert {kept_bytes, stored_bytes, withdrawn_bytes} <= set(contents)

        now = datetime.now(timezone.utc)
        # Before the TTL, a pass collects no upload.
        await app.server.attachments.collect_garbage(app.server, now + timedelta(seconds=DAY - 600))
        assert (await b.call("attachment.get", attachment_id=stored["id"], **ws))["state"] == "stored"
        assert (await owner.call("attachment.get", attachment_id=partial["id"], **ws))["received_bytes"] == 4
        assert staged.exists() and stored_bytes in stored_files(attachments_dir).values()

        await app.server.attachments.collect_garbage(app.server, now + timedelta(seconds=DAY + 600))
        await expect_error("not_found", b.call("attachment.get", attachment_id=stored["id"], **ws))
        await expect_error("not_found", owner.call("attachment.get", attachment_id=partial["id"], **ws))
        await expect_error("not_found", owner.call("attachment.upload.chunk", attachment_id=partial["id"], offset=4,
                                                   data=b64(partial_bytes[4:]), **ws))
        assert not staged.exists()
        # The claimed one stays, bytes and all; the withdrawn message's attachment is gone.
        assert [i for i, _, _ in await attachment_rows(app)] == [kept["id"]]
        assert await read_all(b, ws, kept["id"]) == kept_bytes
        assert list(stored_files(attachments_dir).values()) == [kept_bytes]
