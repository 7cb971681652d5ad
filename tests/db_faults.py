"""Faults made inside the real database: hold a table lock so that a server
query waits in PostgreSQL, see it waiting, then kill its backend."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import trio

from storage.bridge import Database
from storage.errors import DatabaseUnavailable

LOCK_HOLDER = "query = 'SELECT pg_sleep(60)'"


async def wait_for_query(admin: Database, condition: str, *,
                         sleep: Callable[[float], Awaitable[object]] = trio.sleep) -> None:
    """Until pg_stat_activity shows a backend matching `condition` (a precondition
    inside the database, not the behaviour under test).  Under a MockClock pass a
    real-time `sleep`: mock time stands still."""
    while not await admin.run(lambda c: c.fetchval(f"SELECT count(*) FROM pg_stat_activity WHERE {condition}")):
        await sleep(0.05)


async def hold_table_lock(admin: Database, nursery: trio.Nursery, table: str, *, mode: str = "ACCESS EXCLUSIVE",
                          sleep: Callable[[float], Awaitable[object]] = trio.sleep) -> None:
    """Lock `table` (or a comma-separated list) in `mode` until `release_locks` (or 60 s); return once held."""
    async def hold(conn):
        await conn.execute(f"LOCK TABLE {table} IN {mode} MODE")
        await conn.execute("SELECT pg_sleep(60)")

    async def holder():
        with contextlib.suppress(DatabaseUnavailable):
            await admin.transaction(hold)

    nursery.start_soon(holder)
    await wait_for_query(admin, LOCK_HOLDER, sleep=sleep)


async def terminate(admin: Database, condition: str) -> None:
    """Kill the backends matching `condition`: their clients see the connection die."""
    await admin.run(lambda c: c.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {condition}"))


async def release_locks(admin: Database) -> None:
    await terminate(admin, "query LIKE 'SELECT pg_sleep(60)%'")
