"""Attachment uploads and reads (protocol/attachments.py) and platform assets, a
broadcast's attachments (protocol/platform.py): staging, checks, the storage
drivers, and the garbage collector.

An upload in progress is a staging file `<attachments dir>/staging/<id>`; its size
is the truth of how much arrived (a client resumes from it after a reconnect or a
server restart).  Its SHA-256 runs along in memory and is recomputed from the
file when the process lost it.  Finishing checks size, digest and content type,
then hands the file to the row's storage driver."""

from __future__ import annotations

import codecs
import fnmatch
import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import asyncpg
import trio

from protocol.errors import ErrorCode, ProtocolError
from storage import attachments as rows
from storage import platform_assets
from storage.blobs import BlobMissing, BlobStore, BlobStoreUnavailable, LocalBlobs, S3Blobs
from storage.errors import DatabaseUnavailable
from storage.ids import new_id

if TYPE_CHECKING:
    from server.app import Server
    from server.config import ServerConfig

log = logging.getLogger("scopewire.attachments")

GC_BATCH = 500
_HASH_BLOCK = 1024 * 1024
# Leading bytes the declared type must start with (one of): checked at finish.
_MAGIC: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "application/pdf": (b"%PDF-",),
    "application/zip": (b"PK\x03\x04", b"PK\x05\x06"),
    "application/gzip": (b"\x1f\x8b",),
}
_ZIP_CONTAINERS = ("application/vnd.openxmlformats-officedocument.", "application/vnd.oasis.opendocument.")
# Executables (PE, ELF, Mach-O, fat Mach-O / Java class) are refused whatever the declared type.
_EXECUTABLE = (b"MZ", b"\x7fELF", b"\xfe\xed\xfa\xce", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe", b"\xcf\xfa\xed\xfe",
               b"\xca\xfe\xba\xbe")
_UTF8_TYPES = ("text/", "application/json")


def _error(code: ErrorCode, message: str, reason: str, **details) -> ProtocolError:
    return ProtocolError(code, message, details={"reason": reason, **details})


def _not_found() -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_FOUND, "attachment not found")


def content_type_problem(content_type: str, head: bytes) -> str | None:
    """Why `head` (the first bytes) cannot be a `content_type` file, or None."""
    if head.startswith(_EXECUTABLE):
        return "an executable"
    magic = _MAGIC.get(content_type)
    if content_type.startswith(_ZIP_CONTAINERS):
        magic = _MAGIC["application/zip"]
    if content_type == "image/webp":
        return None if head[:4] == b"RIFF" and head[8:12] == b"WEBP" else "not a WebP image"
    if magic is not None and not head.startswith(magic):
        return f"not {content_type} content"
    return None


@dataclass
class _Progress:
    """An upload's running digest (bytes hashed so far == received)."""

    hasher: "hashlib._Hash"
    received: int
    lock: trio.Lock = field(default_factory=trio.Lock)
    # The upload's row as a chunk last read it: the next chunks skip the database.
    row: asyncpg.Record | None = None


class Attachments:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        root = config.attachments_dir
        # Without a directory (an embedded server, a test): a temporary one, gone at shutdown.
        self._temporary = root is None
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="scopewire-attachments-"))
            log.warning("attachments are kept in a temporary directory", extra={"path": str(root)})
        self.root = root
        self.staging = root / "staging"
        self.staging.mkdir(parents=True, exist_ok=True)
        self.drivers: dict[str, BlobStore] = {"local": LocalBlobs(root)}
        if config.attachment_s3 is not None:
            self.drivers["s3"] = S3Blobs(config.attachment_s3)
        if config.attachment_driver not in self.drivers:
            raise ValueError(f"attachment driver {config.attachment_driver!r} is not configured")
        self.default_driver = config.attachment_driver
        self._progress: dict[str, _Progress] = {}

    # --- upload ------------------------------------------------------------------------------------

    def type_allowed(self, content_type: str) -> bool:
        return any(fnmatch.fnmatchcase(content_type, pattern) for pattern in self.config.attachment_types)

    def staged(self, attachment_id: str) -> Path:
        return self.staging / attachment_id

    def received(self, attachment_id: str) -> int:
        try:
            return self.staged(attachment_id).stat().st_size
        except FileNotFoundError:
            return 0

    async def begin(self, server: Server, *, workspace_id: str, scope_id: str, member_id: str, filename: str,
                    label: str | None, content_type: str, byte_size: int,
                    sha256: str | None) -> asyncpg.Record:
        self._check_declared(content_type, byte_size)
        attachment_id = new_id("att")
        row = await server.db.transaction(
            rows.create_upload, attachment_id=attachment_id, workspace_id=workspace_id, scope_id=scope_id,
            uploader=member_id, driver=self.default_driver, object_key=f"{workspace_id}/{attachment_id}",
            filename=filename, label=label or filename, content_type=content_type, byte_size=byte_size,
            declared_sha256=sha256, max_unclaimed_bytes=self.config.max_unclaimed_upload_bytes,
            max_unclaimed_uploads=self.config.max_unclaimed_uploads)
        return await self._staged_upload(row, attachment_id)

    async def begin_asset(self, server: Server, *, account_id: str, operator_id: str, filename: str,
                          label: str | None, content_type: str, byte_size: int,
                          sha256: str | None) -> asyncpg.Record:
        """A platform asset's upload (storage/platform_assets.py): the same checks and quota
        (unreferenced uploads per operator), staged and stored like an attachment's."""
        self._check_declared(content_type, byte_size)
        asset_id = new_id("pas")
        row = await server.db.transaction(
            platform_assets.create_upload, asset_id=asset_id, account_id=account_id, operator_id=operator_id,
            driver=self.default_driver, object_key=f"platform/{account_id}/{asset_id}", filename=filename,
            label=label or filename, content_type=content_type, byte_size=byte_size, declared_sha256=sha256,
            max_unclaimed_bytes=self.config.max_unclaimed_upload_bytes,
            max_unclaimed_uploads=self.config.max_unclaimed_uploads)
        return await self._staged_upload(row, asset_id)

    def _check_declared(self, content_type: str, byte_size: int) -> None:
        if byte_size > self.config.max_attachment_bytes:
            raise _error(ErrorCode.TOO_LARGE, f"larger than {self.config.max_attachment_bytes} bytes",
                         "file_too_large", max_bytes=self.config.max_attachment_bytes)
        if not self.type_allowed(content_type):
            raise _error(ErrorCode.INVALID, f"content type {content_type} is not allowed here",
                         "content_type_not_allowed")

    async def _staged_upload(self, row: asyncpg.Record | None, upload_id: str) -> asyncpg.Record:
        if row is None:
            raise _error(ErrorCode.TOO_LARGE, "too many unclaimed uploads: send or abort some first",
                         "upload_quota_exceeded", max_unclaimed_bytes=self.config.max_unclaimed_upload_bytes,
                         max_unclaimed_uploads=self.config.max_unclaimed_uploads)
        await trio.to_thread.run_sync(self.staged(upload_id).touch)
        return row

    def upload_in_progress(self, attachment_id: str, workspace_id: str, member_id: str) -> asyncpg.Record | None:
        """The row of an upload of `member_id` this process is receiving chunks of (an
        upload's owner never changes; finishing, aborting or collecting it forgets it here)."""
        progress = self._progress.get(attachment_id)
        row = progress.row if progress is not None else None
        if row is not None and row["workspace_id"] == workspace_id and row["uploaded_by_member_id"] == member_id:
            return row
        return None

    async def _progress_of(self, attachment_id: str) -> _Progress:
        progress = self._progress.get(attachment_id)
        if progress is None:
            path = self.staged(attachment_id)

            def rehash() -> tuple[hashlib._Hash, int]:
                hasher, size = hashlib.sha256(), 0
                try:
                    with open(path, "rb") as file:
                        while block := file.read(_HASH_BLOCK):
                            hasher.update(block)
                            size += len(block)
                except FileNotFoundError:
                    pass
                return hasher, size
            hasher, size = await trio.to_thread.run_sync(rehash)
            progress = self._progress.setdefault(attachment_id, _Progress(hasher, size))
        return progress

    async def chunk(self, row: asyncpg.Record, offset: int, data: bytes) -> int:
        """Append `data` at `offset`; the bytes received after it."""
        if row["upload_state"] != "uploading":
            raise _error(ErrorCode.CONFLICT, "the upload is finished", "upload_finished")
        progress = await self._progress_of(row["id"])
        async with progress.lock:
            if self._progress.get(row["id"]) is not progress:  # finished or deleted while this waited
                raise _error(ErrorCode.CONFLICT, "the upload is finished", "upload_finished")
            if offset != progress.received:
                raise _error(ErrorCode.CONFLICT, f"expected offset {progress.received}", "offset_mismatch",
                             received_bytes=progress.received)
            if offset + len(data) > row["byte_size"]:
                raise _error(ErrorCode.TOO_LARGE, f"past the declared size of {row['byte_size']} bytes",
                             "chunk_past_end", received_bytes=progress.received)
            path = self.staged(row["id"])

            def append() -> None:
                with open(path, "r+b") as file:
                    file.seek(offset)
                    file.write(data)
                    file.truncate()
            try:
                await trio.to_thread.run_sync(append)
            except FileNotFoundError:
                raise _not_found() from None  # aborted or collected meanwhile
            except OSError as exc:  # e.g. the disk is full: nothing was acknowledged, the client retries
                log.warning("an upload chunk could not be staged", extra={"attachment_id": row["id"],
                                                                          "error": str(exc)})
                self._progress.pop(row["id"], None)  # the file may hold part of the chunk: rehash from it
                raise ProtocolError(ErrorCode.UNAVAILABLE, "the server cannot stage uploads right now",
                                    details={"reason": "store_unavailable"}) from None
            progress.hasher.update(data)
            progress.received += len(data)
            progress.row = row
            return progress.received

    async def finish(self, server: Server, row: asyncpg.Record, store: ModuleType = rows) -> asyncpg.Record:
        """`store`: the row functions of the upload's kind (storage/attachments.py, or
        storage/platform_assets.py for a platform asset)."""
        if row["upload_state"] == "stored":
            return row
        progress = await self._progress_of(row["id"])
        async with progress.lock:
            if self._progress.get(row["id"]) is not progress:  # finished or deleted while this waited
                current = await server.db.run(store.upload, row["id"])
                if current is None or current["upload_state"] != "stored":
                    raise _not_found()
                return current
            if progress.received != row["byte_size"]:
                raise _error(ErrorCode.CONFLICT, f"{progress.received} of {row['byte_size']} bytes received",
                             "upload_incomplete", received_bytes=progress.received)
            digest = progress.hasher.hexdigest()
            payload = row["payload"]
            declared = (json.loads(payload) if isinstance(payload, str) else payload).get("declared_sha256")
            problem = None
            if declared is not None and declared != digest:
                problem = _error(ErrorCode.INVALID, "the bytes do not match the declared sha256", "digest_mismatch")
            else:
                try:
                    problem = await self._content_problem(row)
                except FileNotFoundError:  # deleted meanwhile, or lost by a failed earlier finish
                    self._progress.pop(row["id"], None)
                    raise _not_found() from None
            if problem is not None:
                await self._delete(server, row, store)
                raise problem
            driver = self._driver(row["storage_driver"])
            try:
                await driver.put(row["storage_object_key"], self.staged(row["id"]))
            except FileNotFoundError:  # collected meanwhile
                raise _not_found() from None
            except BlobStoreUnavailable as exc:
                raise ProtocolError(ErrorCode.UNAVAILABLE, "the attachment store cannot be reached; finish again "
                                    "later", details={"reason": "store_unavailable"}) from exc
            stored = await server.db.transaction(store.mark_stored, row["id"], digest)
            self._progress.pop(row["id"], None)
        if stored is None:  # collected while being stored: the collector may have missed the object
            try:
                await driver.delete(row["storage_object_key"])
            except BlobStoreUnavailable:
                log.warning("an object of a collected upload may be left in the store",
                            extra={"attachment_id": row["id"], "key": row["storage_object_key"]})
            raise _not_found()
        return stored

    def _driver(self, name: str) -> BlobStore:
        driver = self.drivers.get(name)
        if driver is None:
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"the {name} attachment store is not configured on this "
                                                       "server", details={"reason": "store_unavailable"})
        return driver

    async def _delete(self, server: Server, row: asyncpg.Record, store: ModuleType) -> bool:
        """Delete an unclaimed upload now (its lock held): False when a message claimed it
        first.  Bytes the store cannot delete now are left to the collector."""
        marked = await server.db.transaction(store.collect_unclaimed, row["id"])
        self._progress.pop(row["id"], None)
        if marked is None:
            return False
        self.staged(row["id"]).unlink(missing_ok=True)
        driver = self.drivers.get(marked["storage_driver"])
        try:
            if driver is None:
                return True
            if marked["content_sha256"] is not None:
                await driver.delete(marked["storage_object_key"])
        except BlobStoreUnavailable:
            return True  # the row stays marked: the collector's next pass retries
        await server.db.transaction(store.delete_collected, [row["id"]])
        return True

    async def _content_problem(self, row: asyncpg.Record) -> ProtocolError | None:
        path, content_type = self.staged(row["id"]), row["content_type"]

        def inspect() -> str | None:
            with open(path, "rb") as file:
                problem = content_type_problem(content_type, file.read(16))
                if problem is None and content_type.startswith(_UTF8_TYPES):
                    file.seek(0)
                    decoder = codecs.getincrementaldecoder("utf-8")()
                    try:
                        while block := file.read(_HASH_BLOCK):
                            decoder.decode(block)
                        decoder.decode(b"", final=True)
                    except UnicodeDecodeError:
                        problem = "not UTF-8 text"
                return problem
        problem = await trio.to_thread.run_sync(inspect)
        if problem is None:
            return None
        return _error(ErrorCode.INVALID, f"the bytes are {problem}, not {content_type}", "content_type_mismatch")

    async def discard(self, server: Server, row: asyncpg.Record, store: ModuleType = rows) -> bool:
        """Delete an unclaimed upload: its row, its staging file, its object (after a
        chunk or a finish in progress: they hold the upload's lock).  False when a message
        claimed it (a broadcast referenced it) meanwhile."""
        async with (await self._progress_of(row["id"])).lock:
            return await self._delete(server, row, store)

    # --- read -----------------------------------------------------------------------------------------

    async def read(self, row: asyncpg.Record, offset: int, length: int) -> tuple[bytes, bool]:
        size = row["byte_size"] if row["upload_state"] == "stored" else 0
        if row["upload_state"] != "stored" or offset >= size:
            return b"", True
        length = min(length, size - offset)
        # A platform broadcast's attachment reads its asset's bytes (stored once for every workspace).
        shared = row.get("asset_storage_object_key")
        driver = self._driver(row["asset_storage_driver"] if shared is not None else row["storage_driver"])
        try:
            data = await driver.read(shared if shared is not None else row["storage_object_key"], offset, length)
        except BlobStoreUnavailable as exc:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "the attachment store cannot be reached; retry later",
                                details={"reason": "store_unavailable"}) from exc
        except BlobMissing:
            log.error("an attachment's object is missing", extra={"attachment_id": row["id"]})
            raise _not_found() from None
        return data, offset + len(data) >= size

    # --- garbage ------------------------------------------------------------------------------------

    async def collect_garbage(self, server: Server, now: datetime) -> int:
        """Delete uploads unclaimed since before now - TTL and the attachments of withdrawn
        messages, and likewise platform assets no broadcast references and those of deleted
        accounts: marked first (never claimed nor read after), then their bytes, then the
        rows.  The number deleted; a row whose bytes the store could not delete stays
        marked for the next pass."""
        cutoff = now - timedelta(seconds=self.config.unclaimed_upload_ttl_seconds)
        return (await self._collect(server, rows, cutoff)) + (await self._collect(server, platform_assets, cutoff))

    async def _collect(self, server: Server, store: ModuleType, cutoff: datetime) -> int:
        total = 0
        while True:
            taken = await server.db.transaction(store.take_garbage, cutoff, GC_BATCH)
            done = []
            for row in taken:
                self._progress.pop(row["id"], None)
                self.staged(row["id"]).unlink(missing_ok=True)
                driver = self.drivers.get(row["storage_driver"])
                try:
                    if driver is not None:  # deleting a key never written is harmless
                        await driver.delete(row["storage_object_key"])
                except BlobStoreUnavailable as exc:
                    log.warning("attachment store unavailable; deletion retried on the next pass",
                                extra={"attachment_id": row["id"], "error": str(exc)})
                    continue
                done.append(row["id"])
            await server.db.transaction(store.delete_collected, done)
            total += len(done)
            if len(taken) < GC_BATCH or len(done) < len(taken):
                return total

    async def run_collector(self, server: Server, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await self._collect_forever(server)
        finally:
            if self._temporary:
                shutil.rmtree(self.root, ignore_errors=True)

    async def _collect_forever(self, server: Server) -> None:
        while True:
            await trio.sleep(self.config.attachment_gc_seconds)
            try:
                collected = await self.collect_garbage(server, datetime.now(timezone.utc))
            except DatabaseUnavailable:
                continue  # the next round retries
            except OSError as exc:  # e.g. the attachments directory unwritable: retried next round
                log.warning("attachment garbage collection failed", extra={"error": str(exc)})
                continue
            if collected:
                log.info("attachments collected", extra={"count": collected})


def expires_at(row: asyncpg.Record, ttl_seconds: float) -> datetime | None:
    return None if row["message_id"] is not None else row["created_at"] + timedelta(seconds=ttl_seconds)

