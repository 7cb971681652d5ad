"""Graceful shutdown of a real `scopewire serve` process: on SIGTERM/SIGINT every
client gets close 1001 "going away", the closing handshakes are waited for (at
most the grace), and the process exits 0."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from wsproto.events import AcceptConnection, CloseConnection, Message

from protocol import frames
from tests.test_serve import PROJECT_ROOT, SCOPEWIRE
from tests.test_transport import RawClient


@pytest.fixture
def key_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="scopewire-shutdown-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def serve_on(database_dsn: str, key_dir: Path, *extra: str, **popen) -> tuple[trio.Process, int]:
    """`scopewire serve` on the test's database; its stderr goes to key_dir/stderr."""
    process = await trio.lowlevel.open_process(
        [*SCOPEWIRE, "serve", "--database-url", database_dsn, "--data-dir", str(key_dir), "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=open(key_dir / "stderr", "wb"), cwd=PROJECT_ROOT, **popen)
    line = b""
    with trio.fail_after(90):
        while not line.endswith(b"\n"):
            chunk = await process.stdout.receive_some(1)
            assert chunk, (key_dir / "stderr").read_text()[-3000:]
            line += chunk
    return process, int(line.decode().strip().rsplit(":", 1)[1])


async def open_client(port: int) -> RawClient:
    client, accepted = await RawClient.open_port(port)
    assert isinstance(accepted, AcceptConnection)
    await client.send(Message(data=json.dumps({"op": "ping", "id": "p"})))
    assert (await client.next_message())["id"] == "p"
    return client


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_shutdown_sends_going_away_waits_for_the_handshake_and_exits_0(database_dsn, key_dir, sig):
    process, port = await serve_on(database_dsn, key_dir)
    try:
        clients = [await open_client(port) for _ in range(3)]
        process.send_signal(sig)
        for client in clients:
            closing = await client.next_event()
            assert isinstance(closing, CloseConnection), closing
            assert closing.code == frames.CLOSE_GOING_AWAY
            await client.send(closing.response())
            with trio.fail_after(10):
                assert await client.stream.receive_some(4096) == b""  # then the server closes TCP
        with trio.fail_after(30):
            assert await process.wait() == 0
        # Stopped accepting: nobody is listening any more.
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)
    finally:
        if process.returncode is None:
            process.kill()


async def test_a_client_that_never_answers_the_close_delays_exit_by_the_grace_at_most(database_dsn, key_dir):
    process, port = await serve_on(database_dsn, key_dir, "--shutdown-grace", "1")
    try:
        silent = await open_client(port)
        process.send_signal(signal.SIGTERM)
        closing = await silent.next_event()
        assert isinstance(closing, CloseConnection) and closing.code == frames.CLOSE_GOING_AWAY
        # No reply: the server drops the socket after its grace and still exits 0.
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
