"""Test harness: one throwaway PostgreSQL cluster per session, a migrated
template database, and a fresh database cloned from it for every test."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from storage.bridge import Database, PoolSettings
from storage.cluster import ClusterSettings, PostgresCluster
from storage.migrations import migrate
from storage.schema import SCHEMA

TEMPLATE = "scopewire_template"
_database_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    data_dir = Path(tempfile.mkdtemp(prefix="scopewire-test-"))
    cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


async def _admin(cluster: PostgresCluster, sql: str) -> None:
    conn = await asyncpg.connect(cluster.dsn("postgres"))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def template_database(pg_cluster: PostgresCluster) -> str:
    async def build() -> None:
        await _admin(pg_cluster, f"CREATE DATABASE {TEMPLATE}")
        conn = await asyncpg.connect(pg_cluster.dsn(TEMPLATE))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    asyncio.run(build())
    return TEMPLATE


# What must match the template's for an emptied database to count as fresh: every relation,
# column, constraint, index, function, trigger and type of the public schema, and the recorded
# migrations.
_SCHEMA_FINGERPRINT = """
SELECT md5(string_agg(line, E'\\n' ORDER BY line)) FROM (
    SELECT format('rel %s %s', c.relname, c.relkind) AS line FROM pg_class c
     WHERE c.relnamespace = 'public'::regnamespace
    UNION ALL SELECT format('col %s.%s %s %s %s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
                            a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
      FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
      LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
     WHERE c.relnamespace = 'public'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
    UNION ALL SELECT format('con %s %s', conname, pg_get_constraintdef(oid)) FROM pg_constraint
     WHERE connamespace = 'public'::regnamespace
    UNION ALL SELECT format('idx %s', indexdef) FROM pg_indexes WHERE schemaname = 'public'
    UNION ALL SELECT format('fn %s %s', proname, md5(prosrc)) FROM pg_proc WHERE pronamespace = 'public'::regnamespace
    UNION ALL SELECT format('trg %s %s', tgname, tgenabled) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
     WHERE c.relnamespace = 'public'::regnamespace
    UNION ALL SELECT format('type %s', typname) FROM pg_type WHERE typnamespace = 'public'::regnamespace
    UNION ALL SELECT format('ext %s %s', extname, extversion) FROM pg_extension
    UNION ALL SELECT format('mig %s', m::text) FROM schema_migrations m
) lines
"""
_template_fingerprint: str | None = None
# Databases this worker's earlier tests used, emptied and checked: copying the template costs
# ~0.8 s of PostgreSQL CPU per test, emptying one ~0.05 s.
_emptied_databases: list[str] = []


async def _fingerprint(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(_SCHEMA_FINGERPRINT)
    finally:
        await conn.close()


async def _empty_for_reuse(cluster: PostgresCluster, name: str) -> bool:
    """Closes `name` to new sessions (a process the test left behind cannot reconnect into
    the next test's data), ends every other session and deletes every row but the recorded
    migrations and the rows the migrations' data steps seed (run again on the empty tables); False (the caller drops it) when its schema or migrations no longer match the
    template's, or another session is still there."""
    conn = await asyncpg.connect(cluster.dsn(name))
    try:
        await _admin(cluster, f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        others = "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        await conn.execute(f"SELECT pg_terminate_backend(pid, 5000) {others}")
        if await conn.fetchval(f"SELECT count(*) {others}") or \
                await conn.fetchval(_SCHEMA_FINGERPRINT) != _template_fingerprint:
            return False
        tables = await conn.fetch("SELECT quote_ident(tablename) AS name FROM pg_tables "
                                  "WHERE schemaname = 'public' AND tablename <> 'schema_migrations'")
        async with conn.transaction():
            await conn.execute("SET LOCAL session_replication_role = replica")  # no FK order, no triggers
            await conn.execute("; ".join(f"DELETE FROM {table['name']}" for table in tables))
            for statement in (statement for version in SCHEMA.versions for statement in version.after):
                await conn.execute(statement)
        return True
    finally:
        await conn.close()


@pytest.fixture
def database_dsn(pg_cluster: PostgresCluster, template_database: str) -> Iterator[str]:
    """A migrated database with no rows, for this test alone."""
    global _template_fingerprint
    if _template_fingerprint is None:
        _template_fingerprint = asyncio.run(_fingerprint(pg_cluster.dsn(template_database)))
    if _emptied_databases:
        name = _emptied_databases.pop()
        asyncio.run(_admin(pg_cluster, f"ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
    else:
        name = f"test_{next(_database_numbers)}"
        asyncio.run(_admin(pg_cluster, f"CREATE DATABASE {name} TEMPLATE {template_database}"))
    yield pg_cluster.dsn(name)
    try:
        reusable = asyncio.run(_empty_for_reuse(pg_cluster, name))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):  # e.g. a test left it refusing connections
        reusable = False
    if reusable:
        _emptied_databases.append(name)
    else:
        asyncio.run(_admin(pg_cluster, f"DROP DATABASE {name} WITH (FORCE)"))


@pytest.fixture
def empty_database_dsn(pg_cluster: PostgresCluster) -> Iterator[str]:
    """A fresh database with no schema at all."""
    name = f"empty_{next(_database_numbers)}"
    asyncio.run(_admin(pg_cluster, f"CREATE DATABASE {name}"))
    try:
        yield pg_cluster.dsn(name)
    finally:
        asyncio.run(_admin(pg_cluster, f"DROP DATABASE {name} WITH (FORCE)"))


@pytest.fixture
async def db(database_dsn: str):
    async with Database(database_dsn, PoolSettings(min_size=1, max_size=10)) as database:
        yield database


# --- an in-process server and tenants ---------------------------------------------------------

from dataclasses import dataclass  # noqa: E402

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from server import tenancy as ops  # noqa: E402
from server.app import Server  # noqa: E402
from server.auth import Authenticator  # noqa: E402
from server.config import ServerConfig  # noqa: E402
from server.credentials import SessionSigner, hash_password  # noqa: E402
from storage import tenancy  # noqa: E402

MEMBER_PASSWORD = "member-password-1"


@pytest.fixture(scope="session")
def member_password_hash() -> str:
    return hash_password(MEMBER_PASSWORD)


@dataclass
class App:
    server: Server
    db: Database

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.port}"


@pytest.fixture
def server_config(request: pytest.FixtureRequest) -> ServerConfig:
    """The test server's config; a test changes fields with
    `@pytest.mark.parametrize("server_config", [{field: value}], indirect=True)`."""
    return ServerConfig(**{"port": 0, "auth_timeout_seconds": 2.0, "expiry_sweep_seconds": 0.5,
                           "shutdown_grace_seconds": 2.0, **getattr(request, "param", {})})


@pytest.fixture
async def app(db: Database, nursery, server_config: ServerConfig) -> App:
    signer = SessionSigner(Ed25519PrivateKey.generate())
    server = Server(server_config, db, Authenticator(db, signer, server_config.session_ttl_seconds))
    await nursery.start(server.run)
    return App(server, db)


@dataclass
class Person:
    email: str
    password: str
    account_id: str
    member_id: str


@dataclass
class Tenant:
    workspace_id: str
    owner: Person


async def add_person(db: Database, workspace_id: str, email: str, role: str, password_hash: str) -> Person:
    async def unit(conn):
        account_id = await tenancy.create_account(conn, email, email.split("@")[0], password_hash)
        _, member_id = await tenancy.add_human_member(conn, workspace_id, account_id, role, None)
        return account_id, member_id

    account_id, member_id = await db.transaction(unit)
    return Person(email, MEMBER_PASSWORD, account_id, member_id)


@pytest.fixture
async def tenants(db: Database, member_password_hash: str) -> tuple[Tenant, Tenant]:
    """A multi-workspace instance with two workspaces, each with its owner."""
    first = await ops.init_instance(db, email="owner-a@example.com", display_name="Owner A",
                                    workspace_name="Alpha", workspace_slug="alpha", edition="multi",
                                    password=MEMBER_PASSWORD)
    second_owner = await db.transaction(tenancy.create_account, "owner-b@example.com", "Owner B",
                                        member_password_hash)

    async def second_workspace(conn):
        instance = await tenancy.instance_id(conn)
        return await tenancy.create_workspace(conn, instance_id=instance, name="Beta", slug="beta", type="team",
                                              owner_email="owner-b@example.com", owner_display_name="Owner B",
                                              owner_password_hash=None, single_edition=False)

    second = await db.transaction(second_workspace)
    assert second.account_id == second_owner
    return (
        Tenant(first.workspace_id, Person("owner-a@example.com", MEMBER_PASSWORD, first.account_id, first.member_id)),
        Tenant(second.workspace_id, Person("owner-b@example.com", MEMBER_PASSWORD, second.account_id,
                                           second.member_id)),
    )


# --- conformance: every server frame any test receives keeps the published contract --------------

import json  # noqa: E402
import sys  # noqa: E402

import msgspec  # noqa: E402
import trio_websocket  # noqa: E402

from client import wire as client_wire  # noqa: E402
from protocol import conformance  # noqa: E402


@dataclass
class ConformanceStats:
    validated: int = 0
    server_tests: int = 0


CONFORMANCE = ConformanceStats()


def _raw_frame(message: str | bytes) -> object:
    try:
        return msgspec.msgpack.decode(message) if isinstance(message, bytes) else json.loads(message)
    except (ValueError, msgspec.DecodeError) as exc:
        return f"undecodable frame: {exc}"


def _checked(parse, check):
    def checked_parse(event):
        message = parse(event)
        check(message)
        return message

    return staticmethod(checked_parse)


@pytest.fixture(autouse=True)
def server_frame_conformance(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Validates every frame the test receives — through the SDKs' decode path
    (client/wire.py), raw trio-websocket clients and the wsproto RawClient — against its typed
    Struct (protocol/conformance.py); the test fails on the first frame that
    does not validate or has no typed entry."""
    problems: list[str] = []

    def check(frame: object) -> None:
        CONFORMANCE.validated += 1
        problem = conformance.problem(frame)
        if problem is not None and len(problems) < 20:
            problems.append(f"{problem}\n    frame: {str(frame)[:500]}")

    raw_get_message = trio_websocket.WebSocketConnection.get_message

    async def checked_get_message(self):  # the raw test clients' receive path
        message = await raw_get_message(self)
        check(_raw_frame(message))  # the trio SDK's frames are checked here and again in client/wire.py
        return message

    monkeypatch.setattr(trio_websocket.WebSocketConnection, "get_message", checked_get_message)
    # The wsproto RawClient, under each name its module was imported as (pytest's and `tests.`).
    for module in {sys.modules.get("test_transport"), sys.modules.get("tests.test_transport")} - {None}:
        monkeypatch.setattr(module.RawClient, "parse", _checked(module.RawClient.parse, check))
    monkeypatch.setattr(client_wire, "frame_observers", [*client_wire.frame_observers, check])
    if "app" in request.fixturenames:
        CONFORMANCE.server_tests += 1
    yield
    if problems:
        pytest.fail("server frames outside the protocol contract:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist: a worker's counts join the controller's, which reports the whole run."""
    validated, server_tests = getattr(node, "workeroutput", {}).get("conformance", (0, 0))
    CONFORMANCE.validated += validated
    CONFORMANCE.server_tests += server_tests


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports
        workeroutput["conformance"] = (CONFORMANCE.validated, CONFORMANCE.server_tests)
    # A hook that silently stopped seeing frames would prove nothing.
    if CONFORMANCE.server_tests and not CONFORMANCE.validated:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nconformance: {CONFORMANCE.server_tests} server tests ran but no server frame was validated")
    elif CONFORMANCE.validated:
        print(f"\nconformance: {CONFORMANCE.validated} server frames validated against the protocol contract")


# --- a test that never finishes fails instead, and says where it waits -----------------------------------

import functools  # noqa: E402
import inspect  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

import trio  # noqa: E402

# Wall-clock seconds a trio test may run (the slowest takes about 70 s on a busy machine).
HANG_SECONDS = float(os.environ.get("SCOPEWIRE_TEST_HANG_SECONDS", "600"))


class TestRunOverrun(Exception):
    """A trio test ran past HANG_SECONDS of wall-clock time."""


def _overrun(nodeid: str) -> None:
    lines = [f"{nodeid}: still running after {HANG_SECONDS:.0f} s; its trio tasks:"]
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        lines.append(f"  task {task.name}:")
        # The whole await chain, innermost last (cr_frame alone is only the task's outer frame).
        summary = traceback.StackSummary.extract(task.iter_await_frames())
        lines += ["    " + line for line in summary.format()]
        pending += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
    print("\n".join(lines), file=sys.stderr)
    raise TestRunOverrun(f"{nodeid} ran past {HANG_SECONDS:.0f} s (task stacks on stderr)")


def _watched(test, nodeid: str):
    """`test` with a wall-clock watchdog (not trio time: MockClock tests jump it): past
    HANG_SECONDS it prints every task's stack and fails the run, so a wait without a bound
    is a named failure, not a stalled suite."""
    @functools.wraps(test)
    async def watched(*args, **kwargs):
        token = trio.lowlevel.current_trio_token()
        timer = threading.Timer(HANG_SECONDS, lambda: token.run_sync_soon(_overrun, nodeid))
        timer.daemon = True
        timer.start()
        try:
            return await test(*args, **kwargs)
        finally:
            timer.cancel()
    return watched


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.obj = _watched(item.obj, item.nodeid)
