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


@pytest.fixture
def database_dsn(pg_cluster: PostgresCluster, template_database: str) -> Iterator[str]:
    """A fresh, migrated database for this test alone."""
    name = f"test_{next(_database_numbers)}"
    asyncio.run(_admin(pg_cluster, f"CREATE DATABASE {name} TEMPLATE {template_database}"))
    try:
        yield pg_cluster.dsn(name)
    finally:
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
