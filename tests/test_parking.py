"""An idle authenticated connection waits without a task of its own
(server/parking.py) and is served again, from where it left off, by whatever
reaches it: a command, a ping, a close from the server, its idle deadline."""

from __future__ import annotations

import json
import socket

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from wsproto.events import Message

from client import connect
from protocol import frames
from server import logs
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from server.transport import CONNECTION_TASK_NAME, RECV_BYTES
from tests.conftest import App
from tests.test_transport import RawClient
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


def _gated_pings(server: Server, monkeypatch, gate: trio.Event, held: list) -> None:
    """Pings from the first connection that sends one wait for `gate` while being answered."""
    answer = server._answer

    async def answering(connection, raw, *args):
        if b'"ping"' in (raw if isinstance(raw, bytes) else raw.encode()) and held in ([], [connection]):
            held[:] = [connection]
            await gate.wait()
        return await answer(connection, raw, *args)

    monkeypatch.setattr(server, "_answer", answering)


@pytest.mark.parametrize("server_config", [{"max_woken_connections": 1}], indirect=True)
async def test_woken_connections_beyond_the_limit_wait_their_turn_without_a_task(app: App, tenants, monkeypatch):
    """--max-woken-connections: a parked connection woken by input while the limit is
    being served waits, input unread and no task, until a served one answers its command."""
    alpha, _ = tenants
    gate, held = trio.Event(), []
    _gated_pings(app.server, monkeypatch, gate, held)
    answered: list[str] = []
    async with await signed_in(app, alpha.owner) as first, await signed_in(app, alpha.owner) as second:
        await trio.testing.wait_all_tasks_blocked()
        assert len(app.server.parking) == 2

        async def ping(name: str, client) -> None:
            await client.call("ping")
            answered.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping, "first", first)
            await trio.testing.wait_all_tasks_blocked()
            assert held and len(_connection_tasks()) == 1  # the first holds the one turn
            nursery.start_soon(ping, "second", second)
            await trio.testing.wait_all_tasks_blocked()
            assert app.server.parking.waiting_turn == 1 and len(_connection_tasks()) == 1 and answered == []
            gate.set()
        assert answered == ["first", "second"]
        await trio.testing.wait_all_tasks_blocked()
        assert app.server.parking.woken == 0 and app.server.parking.waiting_turn == 0


@pytest.mark.parametrize("grace", [0.0, 5.0])
async def test_a_woken_connection_with_part_of_a_message_gives_its_turn_back(db, nursery, tenants, mock_clock,
                                                                              grace: float):
    """A turn covers what has arrived, never a wait for the rest of a message: a client
    sending a frame a few bytes at a time does not hold up the other woken connections."""
    alpha, _ = tenants
    server = Server(ServerConfig(port=0, max_woken_connections=1, park_after_idle_seconds=grace,
                                 shutdown_grace_seconds=1.0),
                    db, Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
    await nursery.start(server.run)
    app = App(server, db)
    slow, _ = await RawClient.open(app)
    await slow.send(Message(data=json.dumps({"op": "login", "id": "login", "email": alpha.owner.email,
                                             "password": alpha.owner.password})))
    assert (await slow.next_message())["type"] == "result"
    async with await signed_in(app, alpha.owner) as other:
        mock_clock.jump(grace + 0.1)
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.parking) == 2
        frame = slow.ws.send(Message(data=json.dumps({"op": "ping", "id": "slow"})))
        await slow.stream.send_all(frame[:3])
        await trio.testing.wait_all_tasks_blocked()
        assert server.parking.woken == 0  # given back: the rest is awaited in its own task or parked again
        assert (await other.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
        await slow.stream.send_all(frame[3:])
        assert (await slow.next_message())["id"] == "slow"
    await slow.stream.aclose()


@pytest.mark.parametrize("server_config", [{"max_woken_connections": 1, "push_buffer_bytes": 256 * 2**20}],
                         indirect=True)
async def test_a_woken_connection_whose_reply_waits_for_its_client_gives_its_turn_back(app: App, tenants,
                                                                                       monkeypatch):
    """A turn never covers waiting for a client to read: a woken connection whose reply
    queues behind pushes its client has not read lets the next woken one be served."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    reader, _ = await RawClient.open(app)
    reader.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await reader.send(Message(data=json.dumps({"op": "login", "id": "login", "email": alpha.owner.email,
                                               "password": alpha.owner.password})))
    assert (await reader.next_message())["type"] == "result"
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "unread")
        await reader.send(Message(data=json.dumps({"op": "subscribe", "id": "sub", **ws,
                                                   "scopes": [{"scope_id": channel["id"]}]})))
        assert (await reader.next_message())["id"] == "sub"
        reading = next(c for c in app.server.connections.all if c.push is not None)
        while len(reading.ws._out) <= 4 * RECV_BYTES:  # pushes the reader does not read pile up
            await owner.call("message.send", scope_id=channel["id"], content="x" * 30_000, **ws)
        await trio.testing.wait_all_tasks_blocked()
        assert app.server.parking.woken == 0
        await reader.send(Message(data=json.dumps({"op": "ping", "id": "unanswered"})))
        await trio.testing.wait_all_tasks_blocked()
        assert reading.answering and app.server.parking.woken == 0  # its reply waits; its turn went back
        with trio.fail_after(10):
            assert (await owner.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
    await reader.stream.aclose()
