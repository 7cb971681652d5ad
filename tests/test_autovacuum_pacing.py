"""The embedded database's autovacuum naptime follows the instance's age (storage/lifecycle.py):
every 5 s while a table a message writes has never been analysed, PostgreSQL's default after."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from storage.bridge import Database, PoolSettings
from storage.lifecycle import AUTOVACUUM_CHECK_SECONDS, pace_autovacuum

MESSAGE_TABLES = "scopes, scope_messages, scope_fanout_outbox, scope_message_search_docs"


async def _configured_naptime(db) -> str | None:
    return await db.run(lambda c: c.fetchval(
        "SELECT setting FROM pg_file_settings WHERE name = 'autovacuum_naptime' "
        "AND sourcefile LIKE '%/postgresql.auto.conf'"))


async def _reset(conn) -> None:
    await conn.execute("ALTER SYSTEM RESET autovacuum_naptime")
    await conn.execute("SELECT pg_reload_conf()")


@pytest.fixture
async def young_db(pg_cluster, template_database):
    """A fresh clone of the template, whose tables were never analysed (the shared test
    databases are emptied and reused, and autovacuum may have analysed them meanwhile)."""
    async with Database(pg_cluster.dsn("postgres"), PoolSettings(min_size=1, max_size=1)) as admin:
        await admin.run(lambda c: c.execute(f"CREATE DATABASE young_naptime TEMPLATE {template_database}"))
        try:
            async with Database(pg_cluster.dsn("young_naptime"), PoolSettings(min_size=1, max_size=2)) as database:
                yield database
        finally:
            await admin.run(lambda c: c.execute("DROP DATABASE young_naptime WITH (FORCE)"))


async def test_the_naptime_is_short_until_the_message_tables_have_statistics(young_db, nursery, mock_clock):
    # ALTER SYSTEM reaches the whole session cluster: leave it as found.
    db = young_db
    finished = trio.Event()

    async def pacer(task_status=trio.TASK_STATUS_IGNORED) -> None:
        await pace_autovacuum(db, task_status=task_status)
        finished.set()

    try:
        await nursery.start(pacer)  # a fresh schema: no message table analysed
        assert await _configured_naptime(db) == "5s"
        await trio.testing.wait_all_tasks_blocked()
        assert not finished.is_set()  # still young: it looks again later
        mock_clock.jump(AUTOVACUUM_CHECK_SECONDS)
        await trio.testing.wait_all_tasks_blocked()
        assert not finished.is_set() and await _configured_naptime(db) == "5s"

        await db.run(lambda c: c.execute(f"ANALYZE {MESSAGE_TABLES}"))  # autovacuum's first visit
        mock_clock.jump(AUTOVACUUM_CHECK_SECONDS)
        await finished.wait()  # grown up: no more checks
        assert await _configured_naptime(db) is None
    finally:
        await db.run(_reset)
