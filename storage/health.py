"""Read-only figures for /readyz and /metrics: the schema version the database
is at, and the fanout outbox's undelivered rows."""

from __future__ import annotations

import asyncpg

from storage.migrations import applied_version
from storage.schema import SCHEMA


async def schema_current(conn: asyncpg.Connection) -> tuple[int, int]:
    """(applied version, version this code expects)."""
    return await applied_version(conn), SCHEMA.latest_version


async def outbox_backlog(conn: asyncpg.Connection) -> tuple[int, int]:
    """(undelivered rows, rows due now): what the outbox worker still has to do.
    Both counts use the partial index on undelivered rows."""
    row = await conn.fetchrow(
        "SELECT count(*) AS undelivered, count(*) FILTER (WHERE next_attempt_at <= now()) AS due "
        "FROM scope_fanout_outbox WHERE status IN ('pending', 'leased')")
    return row["undelivered"], row["due"]
