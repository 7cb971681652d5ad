"""Migrate and verify: both derived from storage/schema.py.

`migrate(conn)` applies every version the database lacks, one transaction per
version, under an advisory lock so concurrent starters serialize.  Bootstrap of
an empty database is the same call.

`verify(conn)` renders the definition into a scratch schema inside a
transaction that is always rolled back, then compares what PostgreSQL itself
says about both schemas (tables, columns, types, nullability, defaults, keys,
checks, exclusions, indexes).  Comparing the server's own rendering avoids
re-implementing PostgreSQL's normalisation of expressions and types.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import asyncpg

from storage.bridge import lift_transaction_bound
from storage.schema import SCHEMA
from storage.schema_dsl import Schema

_MIGRATION_LOCK_KEY = 0x5C09E_1

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


async def applied_version(conn: asyncpg.Connection) -> int:
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not exists:
        return 0
    return await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_migrations")


async def migrate(conn: asyncpg.Connection, schema: Schema = SCHEMA) -> list[int]:
    """Bring the database to the latest version; returns the versions applied."""
    applied: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK_KEY)
    try:
        await conn.execute(_CREATE_LEDGER)
        current = await applied_version(conn)
        if current > schema.latest_version:
            raise RuntimeError(
                f"database schema version {current} is newer than this scopewire ({schema.latest_version})"
            )
        for version in schema.versions[current:]:
            async with conn.transaction():
                await lift_transaction_bound(conn)
                for statement in (*version.before, *schema.statements_for(version.number), *version.after):
                    await conn.execute(statement)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version.number, version.name
                )
            applied.append(version.number)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK_KEY)
    return applied


@dataclass(frozen=True)
class Drift:
    kind: str
    name: str
    expected: str | None
    found: str | None

    def __str__(self) -> str:
        if self.found is None:
            return f"missing {self.kind} {self.name}: expected {self.expected}"
        if self.expected is None:
            return f"unexpected {self.kind} {self.name}: {self.found}"
        return f"{self.kind} {self.name} differs: expected {self.expected}, found {self.found}"


_DESCRIBE_COLUMNS = """
SELECT c.relname AS table_name, a.attname AS name,
       format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull AS not_null,
       pg_get_expr(d.adbin, d.adrelid) AS default_expr
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND c.relname <> 'schema_migrations'
"""

_DESCRIBE_CONSTRAINTS = """
SELECT c.relname AS table_name, k.conname AS name, pg_get_constraintdef(k.oid, true) AS definition
FROM pg_constraint k
JOIN pg_class c ON c.oid = k.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname <> 'schema_migrations'
"""

_DESCRIBE_INDEXES = """
SELECT t.relname AS table_name, i.relname AS name, pg_get_indexdef(i.oid) AS definition
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE n.nspname = $1 AND t.relname <> 'schema_migrations'
"""


async def _describe(conn: asyncpg.Connection, namespace: str) -> dict[tuple[str, str], str]:
    """Every schema element as (kind, qualified name) -> rendered definition."""
    # Render names relative to the namespace so both schemas print alike.
    await conn.execute(f"SET LOCAL search_path TO {namespace}, public")
    found: dict[tuple[str, str], str] = {}
    for row in await conn.fetch(_DESCRIBE_COLUMNS, namespace):
        found[("table", row["table_name"])] = "table"
        nullability = "NOT NULL" if row["not_null"] else "NULL"
        default = f" DEFAULT {row['default_expr']}" if row["default_expr"] is not None else ""
        found[("column", f"{row['table_name']}.{row['name']}")] = f"{row['type']} {nullability}{default}"
    for row in await conn.fetch(_DESCRIBE_CONSTRAINTS, namespace):
        found[("constraint", f"{row['table_name']}.{row['name']}")] = row["definition"]
    for row in await conn.fetch(_DESCRIBE_INDEXES, namespace):
        definition = row["definition"].replace(f" ON {namespace}.", " ON ")
        found[("index", f"{row['table_name']}.{row['name']}")] = definition
    return found


async def verify(conn: asyncpg.Connection, schema: Schema = SCHEMA, namespace: str = "public") -> list[Drift]:
    """Every difference between the live catalog and the definition (empty: no drift)."""
    drifts: list[Drift] = []
    version = await applied_version(conn)
    if version != schema.latest_version:
        drifts.append(Drift("schema version", "schema_migrations", str(schema.latest_version), str(version)))
    installed = {r["extname"] for r in await conn.fetch("SELECT extname FROM pg_extension")}
    drifts += [Drift("extension", name, "installed", None) for name in schema.extensions if name not in installed]
    scratch = f"scopewire_verify_{secrets.token_hex(6)}"
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(f"CREATE SCHEMA {scratch}")
        await conn.execute(f"SET LOCAL search_path TO {scratch}, public")
        for version_spec in schema.versions:
            for statement in schema.statements_for(version_spec.number):
                await conn.execute(statement)
        expected = await _describe(conn, scratch)
        live = await _describe(conn, namespace)
    finally:
        await tx.rollback()
    for key in sorted(expected.keys() | live.keys()):
        want, have = expected.get(key), live.get(key)
        if want != have:
            drifts.append(Drift(key[0], key[1], want, have))
    return drifts
