"""Database lifecycle: provision (embedded cluster or external URL), create the
database, migrate, hand out the bridge, and shut it all down in order."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import asyncpg

from storage.bridge import Database, PoolSettings
from storage.cluster import ClusterSettings, DataDirInUse, PostgresCluster
from storage.migrations import migrate

log = logging.getLogger("scopewire.storage")


@dataclass(frozen=True)
class Target:
    """Where the database is: an admin DSN (to create it) and its own DSN."""

    admin_dsn: str | None
    dsn: str
    cluster: PostgresCluster | None = None


def embedded_cluster(config) -> PostgresCluster:  # config: server.config.DatabaseConfig
    return PostgresCluster(
        ClusterSettings(
            data_dir=config.data_dir,
            binaries=config.pg_binaries,
            port=config.pg_port,
            run_as=config.pg_run_as,
        )
    )


@contextlib.contextmanager
def provisioned(config, *, share_running: bool = False) -> Iterator[Target]:
    """Start the embedded cluster (or use the external URL) for the duration.

    With `share_running`, a cluster already run by another scopewire process on
    the same data dir is used as it is (e.g. `migrate` beside a running `serve`);
    without it, that case raises DataDirInUse.

    Synchronous and meant for the main thread: the postmaster's parent-death
    signal is tied to the thread that started it.
    """
    if config.database_url:
        yield Target(admin_dsn=None, dsn=config.database_url)
        return
    cluster = embedded_cluster(config)
    try:
        cluster.start()
    except DataDirInUse:
        if not share_running:
            raise
        log.info("data dir in use by a running scopewire; using its cluster", extra={"data_dir": str(config.data_dir)})
        yield Target(admin_dsn=cluster.dsn("postgres"), dsn=cluster.dsn(config.database_name))
        return
    try:
        yield Target(admin_dsn=cluster.dsn("postgres"), dsn=cluster.dsn(config.database_name), cluster=cluster)
    finally:
        cluster.stop()


async def ensure_database(admin_dsn: str, name: str) -> bool:
    """Create database `name` if it does not exist; True when created."""

    async def create(conn: asyncpg.Connection) -> bool:
        if await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            return False
        await conn.execute(f'CREATE DATABASE "{name}" ENCODING \'UTF8\' TEMPLATE template0')
        return True

    async with Database(admin_dsn, PoolSettings(min_size=1, max_size=1)) as admin:
        return await admin.run(create)


@contextlib.asynccontextmanager
async def open_database(target: Target, database_name: str, settings: PoolSettings = PoolSettings(),
                        *, apply_migrations: bool = True) -> AsyncIterator[Database]:
    if target.admin_dsn is not None and await ensure_database(target.admin_dsn, database_name):
        log.info("created database", extra={"database": database_name})
    async with Database(target.dsn, settings) as db:
        if apply_migrations:
            applied = await db.run(migrate)
            if applied:
                log.info("applied schema versions", extra={"versions": applied})
        yield db
