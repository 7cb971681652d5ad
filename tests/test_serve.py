"""`scopewire serve` and friends as a user runs them: real processes, real sockets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
import trio
import trio_websocket

from storage.cluster import ClusterSettings, PostgresCluster

SCOPEWIRE = [sys.executable, "-m", "server.cli"]
PROJECT_ROOT = Path(__file__).resolve().parents[1]


_started: list[trio.Process] = []


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="scopewire-serve-"))
    yield path
    # A failed test must not leave a server (and its postgres) behind.
    while _started:
        process = _started.pop()
        try:
            running = process.returncode is None
        except RuntimeError:  # it exited: trio would close its pidfd, which needs async context
            running = False
        if running:
            process.kill()
    shutil.rmtree(path, ignore_errors=True)


class Served:
    def __init__(self, process: trio.Process, port: int, stderr_path: Path) -> None:
        self.process = process
        self.port = port
        self.stderr_path = stderr_path

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


async def start_serve(data_dir: Path, *extra: str, port: int = 0, listening: socket.socket | None = None) -> Served:
    """`listening`: serve on this socket, passed the way systemd socket activation does."""
    stderr_path = data_dir.parent / f"{data_dir.name}.stderr"
    stderr = open(stderr_path, "ab")
    argv = [*SCOPEWIRE, "serve", "--data-dir", str(data_dir), "--port", str(port), *extra]
    passed: tuple[int, ...] = ()
    if listening is not None:  # as descriptor 3, with LISTEN_PID naming the process that execs serve
        passed = (listening.fileno(),)
        argv = [sys.executable, "-c", f"import os, sys; os.dup2({passed[0]}, 3); os.close({passed[0]}); "
                "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); os.execv(sys.argv[1], sys.argv[1:])",
                *argv]
    process = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=stderr, cwd=PROJECT_ROOT,
                                               pass_fds=passed)
    stderr.close()
    _started.append(process)
    line = b""
    with trio.fail_after(90):
        while not line.endswith(b"\n"):
            chunk = await process.stdout.receive_some(1)
            if not chunk:
                raise AssertionError(f"serve exited before ready: {stderr_path.read_text()[-3000:]}")
            line += chunk
    text = line.decode().strip()
    assert text.startswith("scopewire ready on ws://127.0.0.1:"), text
    return Served(process, int(text.rsplit(":", 1)[1]), stderr_path)


async def stop_serve(served: Served, sig: int = signal.SIGTERM) -> int:
    served.process.send_signal(sig)
    with trio.fail_after(60):
        return await served.process.wait()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCOPEWIRE, *args], capture_output=True, text=True, timeout=120, cwd=PROJECT_ROOT)


async def ping(url: str) -> dict:
    async with trio_websocket.open_websocket_url(url) as ws:
        await ws.send_message(json.dumps({"op": "ping", "id": "p1"}))
        return json.loads(await ws.get_message())


async def with_scopewire_db(data_dir: Path, fn):
    """Connect to the cluster a running serve owns, the way `scopewire db url` does."""
    dsn = PostgresCluster(ClusterSettings(data_dir=data_dir)).dsn("scopewire")

    def run() -> object:
        import asyncio

        async def go():
            c = await asyncpg.connect(dsn)
            try:
                return await fn(c)
            finally:
                await c.close()

        return asyncio.run(go())

    return await trio.to_thread.run_sync(run)


async def test_serve_answers_ping_and_stops_cleanly_on_sigterm_and_sigint(data_dir: Path):
    served = await start_serve(data_dir)
    reply = await ping(served.url)
    assert reply["type"] == "result" and reply["id"] == "p1" and reply["op"] == "ping"
    assert reply["data"]["protocol_version"] == 1
    assert await stop_serve(served) == 0
    logs = [json.loads(line) for line in served.stderr_path.read_text().splitlines() if line.startswith("{")]
    assert {"shutting down", "postgres stopped", "stopped"} <= {entry["msg"] for entry in logs}
    # How fanout writes go out is said at start, either way.
    assert {"fanout writes go through io_uring",
            "io_uring unavailable; fanout writes use one send() per connection"} & {entry["msg"] for entry in logs}
    # No postmaster is left behind.
    assert not (data_dir / "pg" / "postmaster.pid").exists()

    served = await start_serve(data_dir)
    assert await stop_serve(served, signal.SIGINT) == 0


async def test_data_survives_restart_and_schema_has_no_drift(data_dir: Path):
    served = await start_serve(data_dir)
    await with_scopewire_db(data_dir, lambda c: c.execute(
        "INSERT INTO accounts (id, email_normalized, display_name) VALUES ('acc_0000000000000a', 'a@b.c', 'A')"))
    assert await stop_serve(served) == 0

    verified = run_cli("verify-schema", "--data-dir", str(data_dir))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "schema matches" in verified.stdout

    served = await start_serve(data_dir)
    count = await with_scopewire_db(data_dir, lambda c: c.fetchval("SELECT count(*) FROM accounts"))
    assert count == 1
    # Beside a running serve, the CLI uses its cluster.
    assert "up to date" in run_cli("migrate", "--data-dir", str(data_dir)).stdout
    await with_scopewire_db(data_dir, lambda c: c.execute("ALTER TABLE accounts DROP COLUMN avatar_url"))
    drifted = run_cli("verify-schema", "--data-dir", str(data_dir))
    assert drifted.returncode == 1
    assert "missing column accounts.avatar_url" in drifted.stdout
    url = run_cli("db", "url", "--data-dir", str(data_dir))
    assert url.returncode == 0 and "dbname=scopewire" in url.stdout
    # The printed command really connects.
    psql = subprocess.run(url.stdout.strip() + " -Atc 'SELECT count(*) FROM accounts'", shell=True,
                          capture_output=True, text=True, timeout=60)
    assert psql.stdout.strip() == "1", psql.stderr
    assert await stop_serve(served) == 0


async def test_autovacuum_analyses_a_young_embedded_database_within_seconds_of_new_rows(data_dir: Path):
    """Plans made before a table's first statistics are for an empty table (README: the embedded
    database); while the instance is young autovacuum must come back every few seconds, not
    PostgreSQL's default minute."""
    served = await start_serve(data_dir)

    async def add_accounts(first: int) -> None:
        await with_scopewire_db(data_dir, lambda c: c.execute(
            "INSERT INTO accounts (id, email_normalized, display_name) SELECT 'acc_' || lpad(i::text, 14, '0'), "
            "'a' || i || '@b.c', 'A' FROM generate_series($1::int, $1::int + 199) i", first))

    async def analysed_after(count: int) -> None:
        """Wait until autovacuum has analysed accounts more than `count` times."""
        with trio.fail_after(40):  # PostgreSQL's default naptime (60 s) would miss this
            while await with_scopewire_db(data_dir, lambda c: c.fetchval(
                    "SELECT autoanalyze_count FROM pg_stat_user_tables WHERE relname = 'accounts'")) <= count:
                await trio.sleep(0.5)  # another process's work: its statistics are the only signal

    await add_accounts(1)
    await analysed_after(0)
    await add_accounts(1000)  # more than 10 % + 50 new rows: due for its next analysis at once
    await analysed_after(1)
    assert await stop_serve(served) == 0


async def _configured_naptime(data_dir: Path) -> str | None:
    return await with_scopewire_db(data_dir, lambda c: c.fetchval(
        "SELECT setting FROM pg_file_settings WHERE name = 'autovacuum_naptime'"))


async def test_a_grown_up_embedded_database_has_the_default_autovacuum_naptime_after_a_restart(data_dir: Path):
    served = await start_serve(data_dir)
    assert await _configured_naptime(data_dir) == "5s"  # no message table analysed yet
    await with_scopewire_db(data_dir, lambda c: c.execute(
        "ANALYZE scopes, scope_messages, scope_fanout_outbox, scope_message_search_docs"))
    assert await stop_serve(served) == 0
    served = await start_serve(data_dir)
    assert await _configured_naptime(data_dir) is None  # PostgreSQL's default minute
    assert await with_scopewire_db(data_dir, lambda c: c.fetchval("SHOW autovacuum_naptime")) == "1min"
    assert await stop_serve(served) == 0


async def _unapplied_file_settings(data_dir: Path) -> list[dict]:
    return await with_scopewire_db(data_dir, lambda c: c.fetch(
        "SELECT sourcefile, name, setting, error FROM pg_file_settings WHERE NOT applied OR error IS NOT NULL"))


async def test_every_setting_in_the_embedded_databases_files_applies_so_a_reload_logs_no_refusal(data_dir: Path):
    """serve reloads PostgreSQL's configuration (ALTER SYSTEM of autovacuum_naptime); a restart-only
    setting in postgresql.conf that disagrees with the running value is logged as refused on every
    reload.  A cluster an older release left with initdb's max_connections line is rewritten too."""
    served = await start_serve(data_dir)
    assert await _unapplied_file_settings(data_dir) == []
    assert await stop_serve(served) == 0
    conf = data_dir / "pg" / "postgresql.conf"
    conf.write_text(conf.read_text() + "max_connections = 100\n")
    served = await start_serve(data_dir)
    assert await _unapplied_file_settings(data_dir) == []
    assert await with_scopewire_db(data_dir, lambda c: c.fetchval("SHOW max_connections")) == "200"
    assert await stop_serve(served) == 0
    assert "cannot be changed without restarting" not in (data_dir / "pg" / "log" / "postgres.log").read_text()


async def test_kill_dash_nine_then_start_recovers(data_dir: Path):
    served = await start_serve(data_dir)
    await with_scopewire_db(data_dir, lambda c: c.execute(
        "INSERT INTO accounts (id, email_normalized, display_name) VALUES ('acc_0000000000000b', 'b@b.c', 'B')"))
    postmaster_pid = int((data_dir / "pg" / "postmaster.pid").read_text().split()[0])
    served.process.kill()
    await served.process.wait()
    os.kill(postmaster_pid, signal.SIGKILL)

    served = await start_serve(data_dir)
    assert (await ping(served.url))["type"] == "result"
    assert await with_scopewire_db(data_dir, lambda c: c.fetchval("SELECT count(*) FROM accounts")) == 1
    assert await stop_serve(served) == 0


async def test_kill_dash_nine_of_server_alone_leaves_no_orphan_postmaster(data_dir: Path):
    served = await start_serve(data_dir)
    postmaster_pid = int((data_dir / "pg" / "postmaster.pid").read_text().split()[0])
    served.process.kill()
    await served.process.wait()
    # The postmaster follows its parent down (parent-death signal) or is stopped by the next start.
    served = await start_serve(data_dir)
    new_pid = int((data_dir / "pg" / "postmaster.pid").read_text().split()[0])
    assert new_pid != postmaster_pid
    assert await stop_serve(served) == 0


async def test_second_serve_on_one_data_dir_fails_clearly(data_dir: Path):
    served = await start_serve(data_dir)
    second = await trio.to_thread.run_sync(lambda: run_cli("serve", "--data-dir", str(data_dir), "--port", "0"))
    assert second.returncode != 0
    assert "in use" in second.stderr
    assert (await ping(served.url))["type"] == "result"
    assert await stop_serve(served) == 0


def assert_one_line_error(done: subprocess.CompletedProcess[str], *mentions: str) -> None:
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scopewire: "), done.stderr
    for mention in mentions:
        assert mention in lines[0], lines[0]


def test_port_in_use_fails_in_one_line_before_touching_the_data_dir(tmp_path: Path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_cli("serve", "--data-dir", str(tmp_path / "data"), "--port", str(port))
    assert_one_line_error(done, f"127.0.0.1:{port}", "in use")
    assert not (tmp_path / "data").exists()  # no cluster initialised, nothing migrated


@pytest.mark.parametrize("url, host", [
    ("postgresql://u:secret@127.0.0.1:1/db", "127.0.0.1:1"),  # nothing listens on port 1
    ("postgresql://u:secret@no-such-host.invalid/db", "no-such-host.invalid:5432"),
    ("postgresql://u:secret@[::1/db", "--database-url"),
    ("mysql://u:secret@localhost/db", "--database-url"),
    ("postgresql://u:secret@localhost:99999/db", "localhost:99999"),
    ("postgresql://u:secret@127.0.0.1:1,127.0.0.1:2/db", "127.0.0.1:1,127.0.0.1:2"),  # multi-host
])
def test_unusable_database_url_fails_in_one_line(tmp_path: Path, url: str, host: str):
    for command in (["serve", "--port", "0"], ["migrate"], ["workspace", "list"]):
        done = run_cli(*command, "--data-dir", str(tmp_path), "--database-url", url)
        assert_one_line_error(done, host)
        assert "secret" not in done.stderr


def test_missing_database_fails_in_one_line(tmp_path: Path, pg_cluster: PostgresCluster):
    socket_dir = str(pg_cluster.socket_dir)
    done = run_cli("serve", "--port", "0", "--data-dir", str(tmp_path),
                   "--database-url", pg_cluster.dsn("no_such_database"))
    assert_one_line_error(done, socket_dir, "no_such_database")


async def test_serve_uses_the_socket_passed_by_socket_activation(data_dir: Path, database_dsn: str):
    with socket.socket() as passed, socket.socket() as taken:
        for sock in (passed, taken):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        # --port names a port in use: it is ignored when systemd hands over the socket.
        served = await start_serve(data_dir, "--database-url", database_dsn, port=taken.getsockname()[1],
                                   listening=passed)
        assert served.port == passed.getsockname()[1]
        assert (await ping(served.url))["type"] == "result"
        assert await stop_serve(served) == 0


def test_every_limit_flag_reaches_the_server_config(monkeypatch):
    from server.cli import build_parser, main, server_config_from

    flags = {"--auth-timeout": 3, "--session-ttl": 120, "--commands-per-second": 7, "--max-connections-per-member": 4,
             "--idle-timeout": 50, "--heartbeat": 9, "--heartbeat-timeout": 8, "--max-frame-bytes": 5000,
             "--max-subscriptions": 6, "--push-buffer-bytes": 7000, "--push-buffer-events": 11, "--push-timeout": 2,
             "--max-connections": 300, "--max-unauthenticated": 30, "--max-unauthenticated-per-address": 3,
             "--shutdown-grace": 1.5, "--park-after-idle": 0.25, "--max-woken-connections": 9}
    argv = ["serve"] + [str(part) for flag, value in flags.items() for part in (flag, value)]
    config = server_config_from(build_parser().parse_args(argv))
    assert (config.auth_timeout_seconds, config.session_ttl_seconds, config.commands_per_second,
            config.command_burst, config.max_connections_per_member, config.idle_timeout_seconds,
            config.heartbeat_seconds, config.heartbeat_timeout_seconds, config.max_frame_bytes,
            config.max_subscriptions_per_connection, config.push_buffer_bytes, config.push_buffer_events,
            config.push_timeout_seconds, config.max_connections, config.max_unauthenticated_connections,
            config.max_unauthenticated_per_address, config.shutdown_grace_seconds, config.park_after_idle_seconds,
            config.max_woken_connections) == (3, 120, 7, 14, 4, 50, 9, 8, 5000, 6, 7000, 11, 2, 300, 30, 3, 1.5, 0.25, 9)
    # And the environment fallback, for one of them.
    monkeypatch.setenv("SCOPEWIRE_PUSH_BUFFER_BYTES", "4096")
    assert server_config_from(build_parser().parse_args(["serve"])).push_buffer_bytes == 4096
    assert server_config_from(build_parser().parse_args(["serve", "--fanout-writes", "send"])).fanout_writes == "send"
    assert server_config_from(build_parser().parse_args(["serve"])).fanout_writes == "io_uring"
    monkeypatch.setenv("SCOPEWIRE_FANOUT_WRITES", "sendfile")
    with pytest.raises(SystemExit) as refused:
        main(["serve"])
    assert refused.value.code == 2
