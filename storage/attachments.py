"""Attachment rows (scope-model §3.11): uploads, their claim by a message, who may
read them, and what the garbage collector removes.  The bytes live with a
storage driver (storage/blobs.py); a row says which driver and key."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg

from storage.visibility import message_visibility_sql


async def create_upload(conn: asyncpg.Connection, *, attachment_id: str, workspace_id: str, scope_id: str,
                        uploader: str, driver: str, object_key: str, filename: str, label: str, content_type: str,
                        byte_size: int, declared_sha256: str | None, max_unclaimed_bytes: int,
                        max_unclaimed_uploads: int) -> asyncpg.Record | None:
    """The new upload's row, or None: the uploader's unclaimed uploads would exceed the
    quota (bytes or count)."""
    # The quota check and the insert under one per-member lock: parallel begins cannot overshoot it.
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('attachments:' || $1))", uploader)
    pending = await conn.fetchrow(
        "SELECT count(*) AS uploads, coalesce(sum(byte_size), 0) AS bytes FROM attachments "
        "WHERE workspace_id = $1 AND uploaded_by_member_id = $2 AND message_id IS NULL", workspace_id, uploader)
    if pending["bytes"] + byte_size > max_unclaimed_bytes or pending["uploads"] + 1 > max_unclaimed_uploads:
        return None
    payload = {"declared_sha256": declared_sha256} if declared_sha256 else {}
    return await conn.fetchrow(
        "INSERT INTO attachments (id, workspace_id, scope_id, uploaded_by_member_id, storage_driver, "
        "storage_object_key, filename, label, content_type, byte_size, payload) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb) RETURNING *",
        attachment_id, workspace_id, scope_id, uploader, driver, object_key, filename, label, content_type,
        byte_size, json.dumps(payload))


async def own_upload(conn: asyncpg.Connection, workspace_id: str, member_id: str,
                     attachment_id: str) -> asyncpg.Record | None:
    """The caller's own unclaimed upload (anything else: None, whatever the cause)."""
    return await conn.fetchrow(
        "SELECT * FROM attachments WHERE id = $1 AND workspace_id = $2 AND uploaded_by_member_id = $3 "
        "AND message_id IS NULL AND upload_state <> 'collecting'", attachment_id, workspace_id, member_id)


async def upload(conn: asyncpg.Connection, attachment_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT * FROM attachments WHERE id = $1", attachment_id)


async def mark_stored(conn: asyncpg.Connection, attachment_id: str, sha256: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "UPDATE attachments SET upload_state = 'stored', content_sha256 = $2, stored_at = now() "
        "WHERE id = $1 AND upload_state = 'uploading' AND message_id IS NULL RETURNING *", attachment_id, sha256)


async def collect_unclaimed(conn: asyncpg.Connection, attachment_id: str) -> asyncpg.Record | None:
    """Mark an unclaimed upload for deletion (an abort, a failed finish); None when a
    message claimed it first, or it is already going."""
    return await conn.fetchrow(
        "UPDATE attachments SET upload_state = 'collecting' WHERE id = $1 AND message_id IS NULL "
        "AND upload_state <> 'collecting' RETURNING *", attachment_id)


async def delete_collected(conn: asyncpg.Connection, attachment_ids: list[str]) -> None:
    """The rows whose bytes are gone."""
    await conn.execute("DELETE FROM attachments WHERE id = ANY($1::text[]) AND upload_state = 'collecting'",
                       attachment_ids)


async def readable(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                   attachment_id: str) -> asyncpg.Record | None:
    """The attachment if `viewer` may read it: its own unclaimed upload, or one whose
    message the readable predicate of history lets it read (and is not withdrawn).  A
    platform broadcast's attachment also names where its asset's bytes are
    (`asset_storage_driver`, `asset_storage_object_key`)."""
    return await conn.fetchrow(
        f"SELECT a.*, p.storage_driver AS asset_storage_driver, p.storage_object_key AS asset_storage_object_key "
        f"FROM attachments a LEFT JOIN platform_service_account_assets p ON p.id = a.platform_asset_id "
        f"WHERE a.id = $3 AND a.workspace_id = $1 "
        f"AND a.upload_state <> 'collecting' AND CASE "
        f"WHEN a.message_id IS NULL THEN a.uploaded_by_member_id = $2 "
        f"ELSE EXISTS (SELECT 1 FROM scope_messages m WHERE m.scope_id = a.scope_id AND m.id = a.message_id "
        f"AND m.state = 'visible' AND {message_visibility_sql('m', '$2')} IS NOT NULL) END",
        workspace_id, viewer, attachment_id)


async def lock_for_claim(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                         attachment_ids: list[str]) -> dict[str, asyncpg.Record]:
    """This scope's rows a send batch would claim, locked in id order until its commit (a
    concurrent claim or the garbage collector waits, then sees the claim)."""
    rows = await conn.fetch(
        "SELECT * FROM attachments WHERE id = ANY($3::text[]) AND workspace_id = $1 AND scope_id = $2 "
        "ORDER BY id FOR UPDATE", workspace_id, scope_id, attachment_ids)
    return {r["id"]: r for r in rows}


async def claim(conn: asyncpg.Connection, scope_id: str, pairs: list[tuple[str, str]]) -> None:
    """(attachment id, message id) pairs, checked and locked by lock_for_claim's caller."""
    if pairs:
        await conn.execute(
            "UPDATE attachments a SET message_id = p.message_id, claimed_at = now() "
            "FROM unnest($2::text[], $3::text[]) AS p(attachment_id, message_id) "
            "WHERE a.id = p.attachment_id AND a.scope_id = $1 AND a.message_id IS NULL",
            scope_id, [a for a, _ in pairs], [m for _, m in pairs])


async def take_garbage(conn: asyncpg.Connection, created_before: datetime, limit: int) -> list[asyncpg.Record]:
    """Mark for deletion (and return) up to `limit` of: uploads never claimed and created
    before `created_before`, attachments whose message was withdrawn, and rows an
    earlier pass or abort marked but did not finish.  A marked row is never claimed
    nor read; the caller deletes its bytes, then the row (delete_collected)."""
    return await conn.fetch(
        "WITH expired AS (SELECT id FROM attachments WHERE message_id IS NULL AND created_at < $1 "
        "ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED), "
        "released AS (SELECT id FROM attachments WHERE released_at IS NOT NULL ORDER BY released_at LIMIT $2 "
        "FOR UPDATE SKIP LOCKED), "
        "unfinished AS (SELECT id FROM attachments WHERE upload_state = 'collecting' LIMIT $2 "
        "FOR UPDATE SKIP LOCKED) "
        "UPDATE attachments SET upload_state = 'collecting' WHERE id IN "
        "(SELECT id FROM expired UNION SELECT id FROM released UNION SELECT id FROM unfinished) "
        "RETURNING id, storage_driver, storage_object_key",
        created_before, limit)


async def release(conn: asyncpg.Connection, scope_id: str, message_id: str) -> None:
    """Its message was withdrawn (in this transaction)."""
    await conn.execute("UPDATE attachments SET released_at = now() WHERE scope_id = $1 AND message_id = $2",
                       scope_id, message_id)


def info(row: asyncpg.Record) -> dict[str, Any]:
    """How a claimed attachment is described in its message's metadata."""
    return {"id": row["id"], "filename": row["filename"], "label": row["label"],
            "content_type": row["content_type"], "byte_size": row["byte_size"], "sha256": row["content_sha256"]}
