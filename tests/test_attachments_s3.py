"""The S3-compatible attachment driver (storage/blobs.py S3Blobs) against a real
S3-compatible HTTP server on loopback (moto's server mode): uploads land in the
bucket, claimed ones are read back through it, and the garbage collector deletes
the objects of uploads never claimed and of withdrawn messages."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import boto3
import pytest
import trio
from moto.server import ThreadedMotoServer

from client import connect
from server.config import ServerConfig
from storage.blobs import S3Settings
from tests.conftest import App, add_person
from tests.test_attachments import BINARY_PNG, DAY, begin, read_all, send_chunks, sha256, stored_files, upload
from tests.test_messaging import open_channel
from tests.test_outage import init_instance
from tests.test_serve import data_dir, start_serve, stop_serve  # noqa: F401
from tests.test_tenancy import expect_error, signed_in

BUCKET = "scopewire-attachments"
REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "test-access-key", "aws_secret_access_key": "test-secret-key"}


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    """A local S3-compatible server on a port the OS picked (bound before it is read)."""
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        moto.stop()


@pytest.fixture
def bucket(s3_endpoint: str):
    """The bucket the deployment stores into, and a client to look inside it."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name=REGION, **CREDENTIALS)
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def server_config(tmp_path: Path, s3_endpoint: str, bucket) -> ServerConfig:
    return ServerConfig(port=0, auth_timeout_seconds=2.0, expiry_sweep_seconds=0.5, shutdown_grace_seconds=2.0,
                        attachments_dir=tmp_path / "attachments", attachment_driver="s3",
                        attachment_s3=S3Settings(endpoint_url=s3_endpoint, bucket=BUCKET, region=REGION,
                                                 access_key=CREDENTIALS["aws_access_key_id"],
                                                 secret_key=CREDENTIALS["aws_secret_access_key"]))


async def bucket_contents(client) -> list[bytes]:
    def contents() -> list[bytes]:
        listing = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
        return sorted(client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read() for item in listing)
    return await trio.to_thread.run_sync(contents)


async def test_s3_driver_stores_reads_and_collects_objects(app: App, tenants, member_password_hash, bucket,
                                                           tmp_path: Path):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    unclaimed_bytes = b"never claimed\n"
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        scope = (await open_channel(owner, alpha.workspace_id, "files", [bob.member_id], visibility="private"))["id"]
        stored = await upload(owner, ws, scope, BINARY_PNG, filename="every byte.png")
        assert stored["sha256"] == sha256(BINARY_PNG)
        # The bytes live in the bucket, not on the server's disk.
        assert await bucket_contents(bucket) == [BINARY_PNG]
        assert stored_files(tmp_path / "attachments") == {}
        message = await owner.call("message.send", scope_id=scope, content="picture", attachment_ids=[stored["id"]],
                                   **ws)
        assert await read_all(b, ws, stored["id"]) == BINARY_PNG
        # A refused upload leaves nothing in the bucket.
        refused = await begin(owner, ws, scope, b"text\n", filename="t.txt", content_type="text/plain",
                              sha256=sha256(b"other\n"))
        await send_chunks(owner, ws, refused["id"], b"text\n")
        error = await expect_error("invalid", owner.call("attachment.upload.finish", attachment_id=refused["id"],
                                                         **ws))
        assert error.details["reason"] == "digest_mismatch"
        unclaimed = await upload(owner, ws, scope, unclaimed_bytes, filename="u.txt", content_type="text/plain")
        assert await bucket_contents(bucket) == sorted([BINARY_PNG, unclaimed_bytes])

        past_the_ttl = datetime.now(timezone.utc) + timedelta(seconds=DAY + 600)
        await app.server.attachments.collect_garbage(app.server, past_the_ttl)
        await expect_error("not_found", owner.call("attachment.get", attachment_id=unclaimed["id"], **ws))
        assert await bucket_contents(bucket) == [BINARY_PNG]
        assert await read_all(b, ws, stored["id"]) == BINARY_PNG

        await owner.call("message.withdraw", message_id=message["id"], **ws)
        await expect_error("not_found", b.call("attachment.read", attachment_id=stored["id"], **ws))
        await app.server.attachments.collect_garbage(app.server, datetime.now(timezone.utc))
        assert await bucket_contents(bucket) == []


async def test_serve_flags_and_environment_select_the_s3_driver(data_dir: Path, database_dsn: str,  # noqa: F811
                                                                s3_endpoint: str, bucket,
                                                                monkeypatch: pytest.MonkeyPatch):
    # The credentials come from the environment only (never a flag in the process list).
    monkeypatch.setenv("SCOPEWIRE_ATTACHMENT_S3_ACCESS_KEY", CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("SCOPEWIRE_ATTACHMENT_S3_SECRET_KEY", CREDENTIALS["aws_secret_access_key"])
    database = ("--database-url", database_dsn)
    owner = await init_instance("--data-dir", str(data_dir), *database)
    served = await start_serve(data_dir, *database, "--attachment-driver", "s3", "--attachment-s3-endpoint",
                               s3_endpoint, "--attachment-s3-bucket", BUCKET, "--attachment-s3-region", REGION)
    async with connect(served.url) as conn:
        await conn.login("o@example.com", owner["password"])
        scope = (await conn.call("channel.create", slug="files", display_name="Files"))["id"]
        stored = await upload(conn, {}, scope, BINARY_PNG)
        await conn.call("message.send", scope_id=scope, content="picture", attachment_ids=[stored["id"]])
        assert await read_all(conn, {}, stored["id"]) == BINARY_PNG
    assert await bucket_contents(bucket) == [BINARY_PNG]
    assert await stop_serve(served) == 0
