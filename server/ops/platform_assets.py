"""Handlers of platform assets, a broadcast's attachments (protocol/platform.py): an
operator uploads them for one platform account; staging, checks and storage are
server/attachments.py's, the rows storage/platform_assets.py's."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import asyncpg

from protocol import attachments as a
from protocol import platform as p
from protocol.errors import ErrorCode, ProtocolError
from protocol.frames import Ok
from server.context import RequestContext
from server.messaging import _ms
from server.ops.attachments import _check_names
from storage import platform as platform_store
from storage import platform_assets as assets
from storage.errors import NotFound
from storage.ids import is_valid_id

if TYPE_CHECKING:
    from server.app import Connection, Server


def _operator(ctx: RequestContext) -> str:
    operator_id = ctx.principal.operator_id
    assert operator_id is not None  # routed here only for operators
    return operator_id


async def _existing(server: Server, account_id: str) -> str:
    if not is_valid_id(account_id, "psa"):
        raise NotFound("platform service account")
    await server.db.run(platform_store.account, account_id)
    return account_id


def _not_found() -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_FOUND, "asset not found", details={"reason": "asset_not_found"})


def asset_info(server: Server, row: asyncpg.Record, received: int | None = None) -> p.PlatformAssetInfo:
    stored = row["upload_state"] == "stored"
    referenced = row["referenced_at"] is not None
    expiry = None if referenced else row["created_at"] + timedelta(
        seconds=server.config.unclaimed_upload_ttl_seconds)
    return p.PlatformAssetInfo(
        id=row["id"], platform_service_account_id=row["platform_service_account_id"],
        uploaded_by_operator_id=row["uploaded_by_operator_id"], filename=row["filename"], label=row["label"],
        content_type=row["content_type"], byte_size=row["byte_size"],
        state="stored" if stored else "uploading",
        received_bytes=row["byte_size"] if stored else (received if received is not None
                                                        else server.attachments.received(row["id"])),
        created_at_ms=_ms(row["created_at"]), max_chunk_bytes=a.MAX_CHUNK_BYTES, sha256=row["content_sha256"],
        referenced=referenced, expires_at_ms=_ms(expiry) if expiry is not None else None)


async def _asset(server: Server, asset_id: str) -> asyncpg.Record:
    """Any operator's view of an asset of a live account (operators share the platform)."""
    if not is_valid_id(asset_id, "pas"):
        raise _not_found()
    row = await server.db.run(assets.upload, asset_id)
    if row is None or row["upload_state"] == "collecting" or row["platform_service_account_id"] is None:
        raise _not_found()
    return row


async def _own_upload(server: Server, ctx: RequestContext, asset_id: str) -> asyncpg.Record:
    """The caller's own asset upload: only its uploader sends its bytes, finishes or aborts it."""
    row = await _asset(server, asset_id)
    if row["uploaded_by_operator_id"] != _operator(ctx):
        raise _not_found()
    return row


async def upload_begin(server: Server, connection: Connection, request: p.PlatformAssetUploadBegin,
                       ctx: RequestContext) -> p.PlatformAssetInfo:
    _check_names(request.filename, request.label)
    account_id = await _existing(server, request.platform_service_account_id)
    row = await server.attachments.begin_asset(
        server, account_id=account_id, operator_id=_operator(ctx), filename=request.filename, label=request.label,
        content_type=request.content_type, byte_size=request.byte_size, sha256=request.sha256)
    return asset_info(server, row, 0)


async def upload_chunk(server: Server, connection: Connection, request: p.PlatformAssetUploadChunk,
                       ctx: RequestContext) -> p.PlatformAssetInfo:
    row = await _own_upload(server, ctx, request.asset_id)
    received = await server.attachments.chunk(row, request.offset, request.data)
    return asset_info(server, row, received)


async def upload_finish(server: Server, connection: Connection, request: p.PlatformAssetUploadFinish,
                        ctx: RequestContext) -> p.PlatformAssetInfo:
    row = await _own_upload(server, ctx, request.asset_id)
    return asset_info(server, await server.attachments.finish(server, row, assets))


async def upload_abort(server: Server, connection: Connection, request: p.PlatformAssetUploadAbort,
                       ctx: RequestContext) -> Ok:
    row = await _own_upload(server, ctx, request.asset_id)
    if row["referenced_at"] is not None or not await server.attachments.discard(server, row, assets):
        raise ProtocolError(ErrorCode.CONFLICT, "a broadcast carries this asset", details={"reason": "asset_in_use"})
    return Ok()


async def asset_get(server: Server, connection: Connection, request: p.PlatformAssetGet,
                    ctx: RequestContext) -> p.PlatformAssetInfo:
    return asset_info(server, await _asset(server, request.asset_id))


async def check_broadcast_assets(server: Server, account_id: str, asset_ids: list[str]) -> None:
    """A typed answer before the broadcast is submitted: each named asset once, each a stored
    asset of the account (the acceptance transaction checks again, under its locks)."""
    if len(set(asset_ids)) != len(asset_ids):
        raise ProtocolError(ErrorCode.INVALID, "an asset is named twice",
                            details={"field": "asset_ids", "reason": "duplicate_asset"})
    for asset_id in asset_ids:
        row = await _asset(server, asset_id)
        if row["platform_service_account_id"] != account_id or row["upload_state"] != "stored":
            raise _not_found()


HANDLERS = {
    p.PlatformAssetUploadBegin: upload_begin, p.PlatformAssetUploadChunk: upload_chunk,
    p.PlatformAssetUploadFinish: upload_finish, p.PlatformAssetUploadAbort: upload_abort,
    p.PlatformAssetGet: asset_get,
}
