"""An idle authenticated connection waits without a task of its own
(server/parking.py) and is served again, from where it left off, by whatever
reaches it: a command, a ping, a close from the server, its idle deadline."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client import connect
from protocol import frames
from server import logs
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from server.transport import CONNECTION_TASK_NAME
from tests.conftest import App
from tests.test_messaging import open_channel
from tests.test_tenancy import signed_in


def _connection_tasks() -> list[trio.lowlevel.Task]:
    def walk(task: trio.lowlevel.Task):
        yield task
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                yield from walk(child)
    return [t for t in walk(trio.lowlevel.current_root_task()) if t.name == CONNECTION_TASK_NAME]


async def test_an_idle_connection_has_no_task_and_each_command_is_served_by_a_fresh_one(app: App, tenants,
                                                                                       monkeypatch):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    seen: list[str | None] = []
    answer = app.server._answer

    async def recording(connection, raw, *args):
        seen.append(logs.connection_id.get())
        return await answer(connection, raw, *args)

    monkeypatch.setattr(app.server, "_answer", recording)
    async with await signed_in(app, alpha.owner) as owner:
        await trio.testing.wait_all_tasks_blocked()
        assert len(app.server.parking) == 1 and _connection_tasks() == []
        channel = await open_channel(owner, alpha.workspace_id, "parked")
        assert (await owner.call("message.send", scope_id=channel["id"], content="after parking", **ws))["seq"] == 1
        await trio.testing.wait_all_tasks_blocked()
        assert len(app.server.parking) == 1 and _connection_tasks() == []
    connection_id = seen[0]
    assert connection_id is not None and seen == [connection_id] * len(seen)  # log lines keep the connection's id
    await trio.testing.wait_all_tasks_blocked()
    assert len(app.server.parking) == 0 and len(app.server.connections.all) == 0


async def test_a_parked_subscriber_gets_pushes_and_answers_pings(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, alpha.owner) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "pushes")
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        await trio.testing.wait_all_tasks_blocked()
        assert len(app.server.parking) == 2
        await listener.ws.ping()  # answered by a task the ping itself started
        sent = await owner.call("message.send", scope_id=channel["id"], content="to a parked subscriber", **ws)
        with trio.fail_after(10):
            event = await listener.next_event()
        assert event["event"] == "message.created" and event["data"]["id"] == sent["id"]


@pytest.mark.parametrize("close", ["revoked", "aborted"])
async def test_a_parked_connection_is_finished_when_the_server_closes_or_drops_it(app: App, tenants, close: str):
    """A close (revocation, shutdown, slow consumer) or an abort (no pong) from another
    task starts one for the parked connection: the closing handshake, then cleanup."""
    alpha, _ = tenants
    async with connect(app.url) as idle:
        await idle.login(alpha.owner.email, alpha.owner.password)
        await trio.testing.wait_all_tasks_blocked()
        assert len(app.server.parking) == 1
        connection = next(iter(app.server.connections.all))
        if close == "revoked":
            connection.ws.close_soon(frames.CLOSE_REVOKED, "test")
        else:
            connection.ws.abort()
        # Served again at once, not when the peer answers: the close grace runs from now.
        assert len(app.server.parking) == 0
        with trio.fail_after(10):
            code = await idle.wait_closed()
        assert code == (frames.CLOSE_REVOKED if close == "revoked" else 1006)
    await trio.testing.wait_all_tasks_blocked()
    assert len(app.server.parking) == 0 and len(app.server.connections.all) == 0


async def test_a_connection_keeps_its_task_through_the_grace_then_parks(db, nursery, tenants, mock_clock):
    """--park-after-idle: input within the grace is read by the waiting task; idle past it, the
    connection parks, and the next command is answered by a fresh task that waits the grace again."""
    alpha, _ = tenants
    server = Server(ServerConfig(port=0, park_after_idle_seconds=5.0, shutdown_grace_seconds=1.0), db,
                    Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
    await nursery.start(server.run)
    async with await signed_in(App(server, db), alpha.owner) as idle:
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.parking) == 0 and len(_connection_tasks()) == 1
        mock_clock.jump(4.9)
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.parking) == 0 and len(_connection_tasks()) == 1
        mock_clock.jump(0.2)
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.parking) == 1 and _connection_tasks() == []
        assert (await idle.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.parking) == 0 and len(_connection_tasks()) == 1
        mock_clock.jump(5.1)
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.parking) == 1
