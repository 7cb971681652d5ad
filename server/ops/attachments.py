"""Handlers of attachment uploads and reads (protocol/attachments.py); the staging,
checks and storage drivers are server/attachments.py's, the rows storage/attachments.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg

from protocol import attachments as a
from protocol.errors import ErrorCode, ProtocolError
from protocol.frames import Ok
from protocol.validation import name_text_problem
from server.attachments import expires_at
from server.context import RequestContext, WorkspaceContext
from server.messaging import _check_id, _ms, _scope
from server.rbac import Permission
from storage import attachments as rows

if TYPE_CHECKING:
    from server.app import Connection, Server


def _not_found() -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_FOUND, "attachment not found")


def _info(server: Server, row: asyncpg.Record, received: int | None = None) -> a.AttachmentInfo:
    stored = row["upload_state"] == "stored"
    expiry = expires_at(row, server.config.unclaimed_upload_ttl_seconds)
    return a.AttachmentInfo(
        id=row["id"], scope_id=row["scope_id"], uploaded_by_member_id=row["uploaded_by_member_id"],
        filename=row["filename"], label=row["label"], content_type=row["content_type"], byte_size=row["byte_size"],
        state="claimed" if row["message_id"] is not None else row["upload_state"],
        received_bytes=row["byte_size"] if stored else (received if received is not None
                                                        else server.attachments.received(row["id"])),
        created_at_ms=_ms(row["created_at"]), max_chunk_bytes=a.MAX_CHUNK_BYTES, sha256=row["content_sha256"], message_id=row["message_id"],
        expires_at_ms=_ms(expiry) if expiry is not None else None)


def _check_names(filename: str, label: str | None) -> None:
    problem = name_text_problem(filename)
    if problem is None and ("/" in filename or "\\" in filename or filename in (".", "..")):
        problem = "must be a file name, not a path"
    if problem is not None:
        raise ProtocolError(ErrorCode.INVALID, f"filename: {problem}",
                            details={"field": "filename", "reason": "bad_filename"})
    problem = name_text_problem(label) if label is not None else None
    if problem is not None:
        raise ProtocolError(ErrorCode.INVALID, f"label: {problem}", details={"field": "label", "reason": "bad_label"})


async def _own_upload(server: Server, workspace: WorkspaceContext, attachment_id: str) -> asyncpg.Record:
    _check_id(attachment_id, "att", "attachment")
    row = await server.db.run(rows.own_upload, workspace.workspace_id, workspace.member_id, attachment_id)
    if row is None:
        raise _not_found()
    return row


async def upload_begin(server: Server, connection: Connection, request: a.AttachmentUploadBegin,
                       ctx: RequestContext) -> a.AttachmentInfo:
    _check_names(request.filename, request.label)
    workspace, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    if scope["type"] == "service_account":
        raise ProtocolError(ErrorCode.FORBIDDEN, "a service account's timeline is read-only",
                            details={"reason": "read_only_scope"})
    if scope["status"] != "active":
        raise ProtocolError(ErrorCode.CONFLICT, "the scope is archived", details={"reason": "scope_archived"})
    row = await server.attachments.begin(
        server, workspace_id=workspace.workspace_id, scope_id=scope["id"], member_id=workspace.member_id,
        filename=request.filename, label=request.label, content_type=request.content_type,
        byte_size=request.byte_size, sha256=request.sha256)
    return _info(server, row, 0)


async def upload_chunk(server: Server, connection: Connection, request: a.AttachmentUploadChunk,
                       ctx: RequestContext) -> a.AttachmentInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    row = (server.attachments.upload_in_progress(request.attachment_id, workspace.workspace_id, workspace.member_id)
           or await _own_upload(server, workspace, request.attachment_id))
    received = await server.attachments.chunk(row, request.offset, request.data)
    return _info(server, row, received)


async def upload_finish(server: Server, connection: Connection, request: a.AttachmentUploadFinish,
                        ctx: RequestContext) -> a.AttachmentInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    row = await _own_upload(server, workspace, request.attachment_id)
    return _info(server, await server.attachments.finish(server, row))


async def upload_abort(server: Server, connection: Connection, request: a.AttachmentUploadAbort,
                       ctx: RequestContext) -> Ok:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    if not await server.attachments.discard(server, await _own_upload(server, workspace, request.attachment_id)):
        raise _not_found()  # a message claimed it meanwhile
    return Ok()


async def _readable(server: Server, ctx: RequestContext, attachment_id: str) -> asyncpg.Record:
    workspace = ctx.require(Permission.MESSAGE_READ)
    _check_id(attachment_id, "att", "attachment")
    row = await server.db.run(rows.readable, workspace.workspace_id, workspace.member_id, attachment_id)
    if row is None:
        raise _not_found()
    return row


async def attachment_get(server: Server, connection: Connection, request: a.AttachmentGet,
                         ctx: RequestContext) -> a.AttachmentInfo:
    return _info(server, await _readable(server, ctx, request.attachment_id))


async def attachment_read(server: Server, connection: Connection, request: a.AttachmentRead,
                          ctx: RequestContext) -> a.AttachmentData:
    row = await _readable(server, ctx, request.attachment_id)
    if row["upload_state"] != "stored":
        raise ProtocolError(ErrorCode.CONFLICT, "the upload is not finished", details={"reason": "upload_incomplete"})
    data, eof = await server.attachments.read(row, request.offset, request.length)
    return a.AttachmentData(attachment_id=row["id"], offset=request.offset, data=data, eof=eof)


HANDLERS = {
    a.AttachmentUploadBegin: upload_begin, a.AttachmentUploadChunk: upload_chunk,
    a.AttachmentUploadFinish: upload_finish, a.AttachmentUploadAbort: upload_abort, a.AttachmentGet: attachment_get,
    a.AttachmentRead: attachment_read,
}
