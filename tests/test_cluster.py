"""The embedded cluster run by root: a dedicated unprivileged account, never a shared one."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from storage import cluster as cluster_module
from storage.cluster import ClusterError, ClusterSettings, PostgresCluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="postgres runs as another account only when root")


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="scopewire-account-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def uid_of_process(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def query(cluster: PostgresCluster, sql: str) -> object:
    async def run() -> object:
        conn = await asyncpg.connect(cluster.dsn("postgres"))
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return asyncio.run(run())


def test_postgres_runs_as_the_dedicated_account_and_takes_over_a_data_dir_of_nobody(data_dir: Path):
    with PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled",
                                         run_as="nobody")) as earlier:
        assert uid_of_process(earlier.postmaster_pid) == pwd.getpwnam("nobody").pw_uid
        query(earlier, "CREATE TABLE kept AS SELECT 7 AS v")

    # The default, as after an upgrade: the same data dir, now under "scopewire".
    with PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled")) as cluster:
        account = pwd.getpwnam("scopewire")
        assert 0 < account.pw_uid and account.pw_uid != pwd.getpwnam("nobody").pw_uid
        assert account.pw_shell == "/usr/sbin/nologin"
        assert uid_of_process(cluster.postmaster_pid) == account.pw_uid
        assert query(cluster, "SELECT v FROM kept") == 7
        for directory, _, files in os.walk(data_dir / "pg"):
            for name in files:
                assert os.lstat(os.path.join(directory, name)).st_uid == account.pw_uid

    # --pg-run-as still overrides.
    with PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled",
                                         run_as="nobody")) as overridden:
        assert uid_of_process(overridden.postmaster_pid) == pwd.getpwnam("nobody").pw_uid


def test_the_default_account_is_created_when_absent_but_a_named_one_never_is(monkeypatch):
    name = f"swtest{os.getpid()}"  # a throwaway account, removed below
    monkeypatch.setattr(cluster_module, "DEFAULT_RUN_AS", name)
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    try:
        account = cluster_module._postgres_account(None)
        entry = pwd.getpwnam(name)
        assert (account.uid, account.gid) == (entry.pw_uid, entry.pw_gid)
        assert entry.pw_uid < 1000 and entry.pw_shell == "/usr/sbin/nologin"  # a system account
        assert not Path(entry.pw_dir).exists()
        assert cluster_module._postgres_account(None) == account  # found, not created twice
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)
    with pytest.raises(ClusterError, match="does not exist"):
        cluster_module._postgres_account(name)
