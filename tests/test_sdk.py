"""The client SDK and the example agent daemon against real servers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client import connect
from client.resuming import ResumingClient
from protocol import conformance
from server.app import Server
from server.auth import Authenticator
from server.credentials import SessionSigner
from tests.conftest import App
from tests.test_messaging import open_channel
from tests.test_serve import PROJECT_ROOT, data_dir, run_cli, start_serve, stop_serve  # noqa: F401
from tests.test_tenancy import signed_in


@pytest.fixture
def address() -> Iterator[socket.socket]:
    """A listening loopback socket that outlives the servers given a descriptor of it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


async def test_resuming_client_survives_a_server_restart(app: App, tenants, nursery, server_config, address):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "durable")
    # The address outlives the servers, as with socket activation, so the restart cannot lose
    # the port to another process (probing for a free port and binding it later could).
    port = address.getsockname()[1]
    signer = SessionSigner(Ed25519PrivateKey.generate())

    async def serve_once(task_status=trio.TASK_STATUS_IGNORED):
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(address.dup()))
        server = Server(server_config, app.db, Authenticator(app.db, signer, 3600), listeners=[listener])
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as inner:
                await inner.start(server.run)
                task_status.started(scope)

    first = await nursery.start(serve_once)
    url = f"ws://127.0.0.1:{port}"
    client = ResumingClient(url, email=alpha.owner.email, password=alpha.owner.password, workspace_id=alpha.workspace_id)
    client.follow(channel["id"], after_seq=0)
    seen: list[int] = []
    first_ten = trio.Event()

    async def consume():
        async with client.running() as events:
            async for event in events:
                if event["event"] == "message.created":
                    seen.append(event["seq"])
                    if len(seen) == 10:
                        first_ten.set()
                    if len(seen) == 20:
                        return

    async def send(n_from, n_to):
        async with connect(url) as conn:
            await conn.login(alpha.owner.email, alpha.owner.password)
            for i in range(n_from, n_to):
                await conn.call("message.send", scope_id=channel["id"], content=str(i), **ws)

    with trio.fail_after(30):
        async with trio.open_nursery() as inner:
            inner.start_soon(consume)
            await send(0, 10)
            await first_ten.wait()
            first.cancel()  # the server goes away (connections closed with 1001)
            await nursery.start(serve_once)  # and a new one serves the same address
            await send(10, 20)
    assert seen == list(range(1, 21))
    assert client.reconnects >= 1


async def test_agent_daemon_example_survives_a_server_restart(data_dir, address):  # noqa: F811
    init = json.loads(run_cli("init", "--data-dir", str(data_dir), "--email", "o@example.com", "--name", "O",
                              "--workspace-name", "W", "--workspace-slug", "w").stdout)
    agent = json.loads(run_cli("member", "create-agent", "--data-dir", str(data_dir), "--workspace", "w",
                               "--owner", "o@example.com", "--handle", "daemon", "--name", "Daemon").stdout)
    key = json.loads(run_cli("apikey", "create", "--data-dir", str(data_dir), "--workspace", "w",
                             "--member", "daemon").stdout)
    served = await start_serve(data_dir, listening=address)
    url = served.url
    state_file = data_dir / "daemon.cursor"
    state_file.write_text("0")  # from the beginning, so nothing sent before it connects is missed
    daemon_log = open(data_dir.parent / f"{data_dir.name}.daemon.log", "wb")
    daemon = await trio.lowlevel.open_process(
        [sys.executable, "examples/agent_daemon.py", "--url", url, "--api-key", key["key"], "--limit", "6",
         "--state-file", str(state_file)], stdout=subprocess.PIPE, stderr=daemon_log, cwd=PROJECT_ROOT)

    async with connect(url) as owner:
        await owner.login("o@example.com", init["password"])
        channel = await owner.call("channel.create", slug="ops", display_name="Ops", member_ids=[agent["member_id"]])
        for i in range(3):
            await owner.call("message.send", scope_id=channel["id"], content=f"@daemon task {i}")
        await owner.call("message.send", scope_id=channel["id"], content="not for the daemon")
    output = b""
    with trio.fail_after(30):
        while output.count(b"\n") < 3:
            output += await daemon.stdout.receive_some(65536)
    assert await stop_serve(served) == 0
    served = await start_serve(data_dir, listening=address)  # the daemon knows only this address
    async with connect(url) as owner:
        await owner.login("o@example.com", init["password"])
        for i in range(3, 6):
            await owner.call("message.send", scope_id=channel["id"], content=f"@daemon task {i}")
    with trio.fail_after(60):
        while True:
            chunk = await daemon.stdout.receive_some(65536)
            if not chunk:
                break
            output += chunk
        assert await daemon.wait() == 0
    lines = [json.loads(line) for line in output.decode().splitlines()]
    assert [line["content"] for line in lines] == [f"@daemon task {i}" for i in range(6)]
    assert await stop_serve(served) == 0


async def test_asyncio_client(app: App, tenants):
    import asyncio

    from client.asyncio_client import connect as asyncio_connect

    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "asyncio")

        async def asyncio_side() -> list[int]:
            async with asyncio_connect(app.url) as conn:
                await conn.login(alpha.owner.email, alpha.owner.password)
                await conn.call("subscribe", scopes=[{"scope_id": channel["id"], "after_seq": 0}], **ws)
                sent = await conn.call("message.send", scope_id=channel["id"], content="from asyncio", **ws)
                assert sent["seq"] == 1
                try:
                    await conn.call("message.send", scope_id="scp_zzzzzzzzzzzzzz", content="x", **ws)
                except Exception as exc:  # typed error
                    assert getattr(exc, "code", None) == "not_found"
                return [(await asyncio.wait_for(conn.next_event(), 10))["seq"]]

        assert await trio.to_thread.run_sync(asyncio.run, asyncio_side()) == [1]

        async def resuming_side() -> list[int]:
            from client.asyncio_client import ResumingAsyncioClient

            client = ResumingAsyncioClient(app.url, email=alpha.owner.email, password=alpha.owner.password,
                                           workspace_id=alpha.workspace_id)
            client.cursors.scopes[channel["id"]] = 0
            seqs = []
            async for event in client.events():
                seqs.append(event["seq"])
                if len(seqs) == 1:
                    break
            return seqs

        assert await trio.to_thread.run_sync(asyncio.run, resuming_side()) == [1]


async def test_websocat_speaks_the_protocol(app: App, tenants):
    """The README's websocat recipe: one JSON request per line in, one reply per line out."""
    from pathlib import Path

    alpha, _ = tenants
    websocat = Path(sys.executable).parent / "websocat"
    requests = [{"op": "ping", "id": "1"},
                {"op": "login", "id": "2", "email": alpha.owner.email, "password": alpha.owner.password},
                {"op": "workspace.list", "id": "3"}]
    process = await trio.lowlevel.open_process([str(websocat), "--text", app.url], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE)
    replies: dict[str, dict] = {}
    buffered = b""
    with trio.fail_after(30):
        for request in requests:  # one at a time: login must finish before workspace.list
            await process.stdin.send_all(json.dumps(request).encode() + b"\n")
            while request["id"] not in replies:
                buffered += await process.stdout.receive_some(65536)
                *lines, buffered = buffered.split(b"\n")
                replies.update((r["id"], r) for r in map(json.loads, lines) if r.get("id"))
    process.kill()
    await process.wait()
    assert [conformance.problem(reply) for reply in replies.values()] == [None] * len(replies)
    assert replies["1"]["data"]["protocol_version"] == 1
    assert replies["2"]["data"]["account_id"] == alpha.owner.account_id
    assert {w["slug"] for w in replies["3"]["data"]["workspaces"]} == {"alpha"}
