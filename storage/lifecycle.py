"""Database lifecycle: provision (embedded cluster or external URL), create the
database, migrate, hand out the bridge, supervise the embedded cluster, and shut
it all down in order."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import NoReturn
from urllib.parse import parse_qs, urlsplit

import asyncpg
import trio

from storage.bridge import Database, PoolSettings
from storage.cluster import ClusterError, ClusterSettings, DataDirInUse, PostgresCluster
from storage.errors import DatabaseUnavailable
from storage.migrations import migrate

log = logging.getLogger("scopewire.storage")

# Restarts of a postmaster that died under a running server: at most this many attempts
# within the window, waiting FIRST_RESTART_BACKOFF (doubling) before each but the first.
# Past that, serving on is pointless: the process exits so its supervisor restarts it.
RESTART_ATTEMPTS = 5
RESTART_WINDOW_SECONDS = 600.0
FIRST_RESTART_BACKOFF = 0.5


class DatabaseStartError(Exception):
    """The database named by the configuration cannot be used; the message is one line for humans."""


class ClusterLost(ClusterError):
    """The embedded cluster died and could not be restarted."""


def database_url_host(url: str) -> str:
    """Where a database URL points ("host:port", several for a multi-host URL, or the socket
    dir), for messages; DatabaseStartError when it is not a PostgreSQL URL. Never includes
    the password."""
    try:
        parts = urlsplit(url)
    except ValueError as error:
        raise DatabaseStartError(f"malformed --database-url ({error}); expected "
                                 f"postgresql://user:password@host:port/database") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise DatabaseStartError(f"malformed --database-url (scheme {parts.scheme!r}); expected "
                                 f"postgresql://user:password@host:port/database")
    query = parse_qs(parts.query)
    hosts = parts.netloc.rpartition("@")[2] or query.get("host", ["localhost"])[0]
    return hosts if ":" in hosts else f"{hosts}:{query.get('port', ['5432'])[0]}"


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
    """Raises DatabaseStartError when the database cannot be reached or logged into."""
    if target.admin_dsn is not None and await ensure_database(target.admin_dsn, database_name):
        log.info("created database", extra={"database": database_name})
    db = Database(target.dsn, settings)
    try:
        await db.start()
    except (DatabaseUnavailable, asyncpg.PostgresError, ValueError) as error:
        # Unreachable, refused, bad credentials, no such database, malformed parameters.
        cause = error.__cause__ if isinstance(error, DatabaseUnavailable) and error.__cause__ else error
        reason = " ".join(f"{type(cause).__name__}: {cause}".split())
        raise DatabaseStartError(f"cannot connect to the database at {database_url_host(target.dsn)}: "
                                 f"{reason}") from None
    try:
        if apply_migrations:
            applied = await db.run(migrate)
            if applied:
                log.info("applied schema versions", extra={"versions": applied})
        yield db
    finally:
        await db.aclose()


# Autovacuum of the embedded database.  Until autovacuum first analyses a table, its plans are for
# an empty one: each pooled connection then checks a message's foreign keys to scope_messages
# (scope_id, id) through an index that matches only scope_id, walking the scope's every message
# (a cost that grows with each one) until a visit of autovacuum invalidates that plan.  So a young
# instance is visited every YOUNG_AUTOVACUUM_NAPTIME; once the tables a message writes have
# statistics, PostgreSQL's default minute: each visit to them makes every pooled connection plan
# its statements again, and at 500 msg/s (bench/fanout.py) the 5 s visits cost ~7 ms of p99.
YOUNG_AUTOVACUUM_NAPTIME = "5s"
_MESSAGE_TABLES = ("scopes", "scope_messages", "scope_fanout_outbox", "scope_message_search_docs")
AUTOVACUUM_CHECK_SECONDS = 30.0


async def settle_autovacuum_naptime(conn: asyncpg.Connection) -> bool:
    """Set the database's autovacuum naptime by the instance's age (above); True while it is young.
    Needs a superuser (the embedded cluster's); the setting persists in postgresql.auto.conf."""
    young = await conn.fetchval(  # reltuples < 0: never vacuumed nor analysed
        "SELECT count(*) > 0 FROM unnest($1::text[]) AS t WHERE (SELECT reltuples FROM pg_class "
        "WHERE oid = to_regclass(t)) < 0", list(_MESSAGE_TABLES))
    # What the configuration files say, not this backend's view (a reload reaches it later).
    configured = await conn.fetchval(
        "SELECT setting FROM pg_file_settings WHERE name = 'autovacuum_naptime' "
        "AND sourcefile LIKE '%/postgresql.auto.conf' ORDER BY seqno DESC LIMIT 1")
    wanted = YOUNG_AUTOVACUUM_NAPTIME if young else None
    if configured != wanted:
        await conn.execute(f"ALTER SYSTEM SET autovacuum_naptime = '{wanted}'" if wanted
                           else "ALTER SYSTEM RESET autovacuum_naptime")
        await conn.execute("SELECT pg_reload_conf()")
        log.info("autovacuum naptime", extra={"naptime": wanted or "default", "young": young})
    return young


async def pace_autovacuum(db: Database, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The embedded database's naptime set once (then `task_status.started()`), and again
    every AUTOVACUUM_CHECK_SECONDS while the instance is young."""
    young = await db.run(settle_autovacuum_naptime)
    task_status.started()
    while young:
        await trio.sleep(AUTOVACUUM_CHECK_SECONDS)
        young = await db.run(settle_autovacuum_naptime)


async def supervise_cluster(cluster: PostgresCluster) -> NoReturn:
    """Restart the embedded postmaster whenever it dies under us (PostgreSQL replays its
    WAL); the bridge's pool and listeners reconnect on their own.  Raises ClusterLost
    when RESTART_ATTEMPTS attempts within RESTART_WINDOW_SECONDS did not bring it back."""
    attempts: collections.deque[float] = collections.deque()
    while True:
        await _wait_for_exit(cluster)
        while True:
            now = trio.current_time()
            while attempts and now - attempts[0] > RESTART_WINDOW_SECONDS:
                attempts.popleft()
            if len(attempts) >= RESTART_ATTEMPTS:
                raise ClusterLost(f"postgres died and {RESTART_ATTEMPTS} restarts within "
                                  f"{RESTART_WINDOW_SECONDS:g}s did not bring it back")
            if attempts:
                await trio.sleep(FIRST_RESTART_BACKOFF * 2 ** (len(attempts) - 1))
            attempts.append(trio.current_time())
            try:
                # Blocking (waits until ready); the cluster forks from its own long-lived thread.
                await trio.to_thread.run_sync(cluster.restart_after_crash)
                break
            except (ClusterError, OSError) as error:
                log.warning("restarting postgres failed", extra={"attempt": len(attempts), "error": str(error)})


async def _wait_for_exit(cluster: PostgresCluster) -> None:
    pid = cluster.postmaster_pid
    assert pid is not None
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone (and reaped)
        return
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
