"""Platform assets (service-account §4.5): an operator's uploads that a platform
account's broadcasts carry as attachments.  Staged, checked and stored like a
workspace attachment (server/attachments.py, which calls the row functions below
by the same names as storage/attachments.py's); frozen once a broadcast
references them; materialized in each workspace as an attachment row whose bytes
are the asset's (`attachments.platform_asset_id`)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg

from storage.errors import Conflict, NotFound


async def create_upload(conn: asyncpg.Connection, *, asset_id: str, account_id: str, operator_id: str, driver: str,
                        object_key: str, filename: str, label: str, content_type: str, byte_size: int,
                        declared_sha256: str | None, max_unclaimed_bytes: int,
                        max_unclaimed_uploads: int) -> asyncpg.Record | None:
    """The new asset's row, or None: the operator's unreferenced uploads would exceed the quota."""
    if await conn.fetchval("SELECT 1 FROM platform_service_accounts WHERE id = $1 FOR KEY SHARE", account_id) is None:
        raise NotFound("platform service account")
    # The quota check and the insert under one per-operator lock: parallel begins cannot overshoot it.
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('platform-assets:' || $1))", operator_id)
    pending = await conn.fetchrow(
        "SELECT count(*) AS uploads, coalesce(sum(byte_size), 0) AS bytes FROM platform_service_account_assets "
        "WHERE uploaded_by_operator_id = $1 AND referenced_at IS NULL", operator_id)
    if pending["bytes"] + byte_size > max_unclaimed_bytes or pending["uploads"] + 1 > max_unclaimed_uploads:
        return None
    payload = {"declared_sha256": declared_sha256} if declared_sha256 else {}
    return await conn.fetchrow(
        "INSERT INTO platform_service_account_assets (id, platform_service_account_id, uploaded_by_operator_id, "
        "storage_driver, storage_object_key, filename, label, content_type, byte_size, payload) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb) RETURNING *",
        asset_id, account_id, operator_id, driver, object_key, filename, label, content_type, byte_size,
        json.dumps(payload))


async def upload(conn: asyncpg.Connection, asset_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT * FROM platform_service_account_assets WHERE id = $1", asset_id)


async def mark_stored(conn: asyncpg.Connection, asset_id: str, sha256: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "UPDATE platform_service_account_assets SET upload_state = 'stored', content_sha256 = $2, stored_at = now() "
        "WHERE id = $1 AND upload_state = 'uploading' RETURNING *", asset_id, sha256)


async def collect_unclaimed(conn: asyncpg.Connection, asset_id: str) -> asyncpg.Record | None:
    """Mark an asset no broadcast carries for deletion (an abort, a failed finish); None when a
    broadcast referenced it first, or it is already going."""
    return await conn.fetchrow(
        "UPDATE platform_service_account_assets SET upload_state = 'collecting' WHERE id = $1 "
        "AND referenced_at IS NULL AND upload_state <> 'collecting' RETURNING *", asset_id)


async def delete_collected(conn: asyncpg.Connection, asset_ids: list[str]) -> None:
    """The rows whose bytes are gone."""
    await conn.execute("DELETE FROM platform_service_account_assets WHERE id = ANY($1::text[]) "
                       "AND upload_state = 'collecting'", asset_ids)


async def take_garbage(conn: asyncpg.Connection, created_before: datetime, limit: int) -> list[asyncpg.Record]:
    """Mark for deletion (and return) up to `limit` of: assets never referenced and created
    before `created_before`, the assets of deleted accounts (their workspace attachments went
    with the account's scopes), and rows an earlier pass or abort marked but did not finish."""
    return await conn.fetch(
        "WITH expired AS (SELECT id FROM platform_service_account_assets WHERE referenced_at IS NULL "
        "AND created_at < $1 ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED), "
        "orphaned AS (SELECT id FROM platform_service_account_assets WHERE platform_service_account_id IS NULL "
        "LIMIT $2 FOR UPDATE SKIP LOCKED), "
        "unfinished AS (SELECT id FROM platform_service_account_assets WHERE upload_state = 'collecting' LIMIT $2 "
        "FOR UPDATE SKIP LOCKED) "
        "UPDATE platform_service_account_assets SET upload_state = 'collecting' WHERE id IN "
        "(SELECT id FROM expired UNION SELECT id FROM orphaned UNION SELECT id FROM unfinished) "
        "RETURNING id, storage_driver, storage_object_key, content_sha256",
        created_before, limit)


async def reference(conn: asyncpg.Connection, account_id: str, asset_ids: list[str]) -> list[dict[str, Any]] | None:
    """The frozen manifest of these assets, in the order given, marking them referenced (from
    now on immutable and kept); None when one is not a stored asset of the account.  The rows
    are locked in id order until the caller's commit (an abort or the collector waits)."""
    if not asset_ids:
        return []
    rows = await conn.fetch(
        "SELECT * FROM platform_service_account_assets WHERE id = ANY($1::text[]) AND platform_service_account_id = $2 "
        "AND upload_state = 'stored' ORDER BY id FOR UPDATE", asset_ids, account_id)
    by_id = {row["id"]: row for row in rows}
    if len(by_id) != len(set(asset_ids)):
        return None
    await conn.execute("UPDATE platform_service_account_assets SET referenced_at = now() "
                       "WHERE id = ANY($1::text[]) AND referenced_at IS NULL", asset_ids)
    return [manifest_entry(by_id[asset_id]) for asset_id in asset_ids]


def manifest_of(broadcast: asyncpg.Record) -> list[dict[str, Any]]:
    """A broadcast row's frozen asset manifest."""
    manifest = broadcast["asset_manifest"]
    return json.loads(manifest) if isinstance(manifest, str) else list(manifest)


def manifest_entry(row: asyncpg.Record) -> dict[str, Any]:
    """How a broadcast's manifest names an asset (and its digest covers)."""
    return {"asset_id": row["id"], "sha256": row["content_sha256"], "content_type": row["content_type"],
            "byte_size": row["byte_size"], "filename": row["filename"], "label": row["label"]}


async def materialize(conn: asyncpg.Connection, *, delivery_id: str, workspace_id: str, scope_id: str,
                      author_member_id: str, manifest: list[dict[str, Any]],
                      attachment_ids: list[str]) -> list[asyncpg.Record]:
    """A delivery's attachments in its workspace (stored, for its message to claim), with the
    (delivery, asset ordinal) mappings, in the delivery's message transaction.  Each row's bytes are
    its asset's; its own object key names no object (the collector deleting it deletes nothing)."""
    rows = await conn.fetch(
        "WITH made AS (INSERT INTO attachments (id, workspace_id, scope_id, uploaded_by_member_id, storage_driver, "
        "storage_object_key, filename, label, content_type, byte_size, content_sha256, upload_state, stored_at, "
        "platform_asset_id) "
        "SELECT m.attachment_id, $2, $3, $4, a.storage_driver, 'platform-asset-ref/' || m.attachment_id, "
        "a.filename, a.label, a.content_type, a.byte_size, a.content_sha256, 'stored', now(), a.id "
        "FROM unnest($5::text[], $6::text[]) WITH ORDINALITY AS m(attachment_id, asset_id, ordinal) "
        "JOIN platform_service_account_assets a ON a.id = m.asset_id ORDER BY m.ordinal RETURNING *), "
        "mapped AS (INSERT INTO platform_service_account_delivery_assets (delivery_id, asset_ordinal, workspace_id, "
        "asset_id, attachment_id) "
        "SELECT $1, (m.ordinal - 1)::int, $2, m.asset_id, m.attachment_id "
        "FROM unnest($5::text[], $6::text[]) WITH ORDINALITY AS m(attachment_id, asset_id, ordinal)) "
        "SELECT * FROM made",
        delivery_id, workspace_id, scope_id, author_member_id, attachment_ids,
        [entry["asset_id"] for entry in manifest])
    if len(rows) != len(attachment_ids):  # an asset left (its account's delete) before this delivery
        raise Conflict("asset_missing", "an asset of the broadcast is gone")
    by_id = {row["id"]: row for row in rows}
    return [by_id[attachment_id] for attachment_id in attachment_ids]
