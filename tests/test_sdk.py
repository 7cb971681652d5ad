"""The client SDK and the example agent daemon against real servers."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import pytest
import trio

from client import ClientError, connect
from client.resuming import ResumingClient
from protocol import conformance
from server.app import Server
from server.auth import Authenticator
from tests.conftest import App
from tests.test_messaging import open_channel
from tests.test_private_visibility import as_agent, world  # noqa: F401  (world is a fixture)
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
    signer = app.server.auth.signer  # servers on one database share the signing key (and so the node link key)

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


DELIVERY_BOUND = 20  # seconds a pushed delivery may take on a busy machine


async def next_deliveries(events, count: int) -> list[dict]:
    """The next `count` deliveries of a resuming client's event stream (other events skipped)."""
    deliveries = []
    with trio.fail_after(DELIVERY_BOUND):
        async for event in events:
            if event["event"] == "delivery":
                deliveries.append(event["data"])
                if len(deliveries) == count:
                    return deliveries
    raise AssertionError("the event stream ended")


async def test_resuming_client_follows_acks_and_resumes_its_delivery_feed(app: App, world):  # noqa: F811
    alpha, _, _, _, channel, key, ws = world
    client = ResumingClient(app.url, api_key=key)
    client.follow_deliveries(max_in_flight=10)
    async with await signed_in(app, alpha.owner) as owner, client.running() as events:
        for text in ("one", "two"):
            await owner.call("message.send", scope_id=channel["id"], content=f"@scout {text}", **ws)
        one, two = await next_deliveries(events, 2)
        assert [(d["message"]["content"], d["reason"], d["attempt"]) for d in (one, two)] == [
            ("@scout one", "mention", 1), ("@scout two", "mention", 1)]
        assert await client.ack([one["delivery_seq"]]) == [one["delivery_seq"]]
        assert await client.ack([one["delivery_seq"]]) == []  # acking again is harmless
        # The connection drops (the server aborts it): the client reconnects and resubscribes.  Not
        # the client's own ws.aclose(): trio-websocket 0.12 can then hang, when the client's session
        # teardown cancels the reader between the close reply and setting the handshake event.
        (dropped,) = [c for c in app.server.connections.all if c.principal.api_key_id is not None]
        dropped.ws.abort()
        (again,) = await next_deliveries(events, 1)  # the acked one is not replayed before it
        assert (again["dedupe_key"], again["delivery_seq"], again["attempt"]) == (
            two["dedupe_key"], two["delivery_seq"], 2)
        assert client.reconnects == 1 and client.delivery_feed["unacked"] >= 1
        await owner.call("message.send", scope_id=channel["id"], content="@scout three", **ws)
        (three,) = await next_deliveries(events, 1)
        assert (three["message"]["content"], three["attempt"]) == ("@scout three", 1)
        assert await client.ack([two["delivery_seq"], three["delivery_seq"]]) == [
            two["delivery_seq"], three["delivery_seq"]]


async def test_asyncio_resuming_client_follows_acks_and_resumes_its_delivery_feed(app: App, world):  # noqa: F811
    import asyncio

    from client.asyncio_client import ResumingAsyncioClient
    from client.asyncio_client import connect as asyncio_connect

    alpha, _, _, _, channel, key, ws = world

    async def asyncio_side() -> None:
        client = ResumingAsyncioClient(app.url, api_key=key)
        client.follow_deliveries(max_in_flight=10)
        events = client.events()

        async def deliveries(count: int) -> list[dict]:
            found = []
            async with asyncio.timeout(DELIVERY_BOUND):
                async for event in events:
                    if event["event"] == "delivery":
                        found.append(event["data"])
                        if len(found) == count:
                            return found
            raise AssertionError("the event stream ended")

        async with asyncio_connect(app.url) as owner:
            await owner.login(alpha.owner.email, alpha.owner.password)
            for text in ("one", "two"):
                await owner.call("message.send", scope_id=channel["id"], content=f"@scout {text}", **ws)
            one, two = await deliveries(2)
            assert [(d["message"]["content"], d["attempt"]) for d in (one, two)] == [
                ("@scout one", 1), ("@scout two", 1)]
            assert await client.ack([one["delivery_seq"]]) == [one["delivery_seq"]]
            await client.connection.ws.close()  # the connection drops: the client reconnects and resubscribes
            (again,) = await deliveries(1)  # the acked one is not replayed before it
            assert (again["dedupe_key"], again["attempt"]) == (two["dedupe_key"], 2)
            assert client.reconnects == 1
            await owner.call("message.send", scope_id=channel["id"], content="@scout three", **ws)
            (three,) = await deliveries(1)
            assert (three["message"]["content"], three["attempt"]) == ("@scout three", 1)
            assert await client.ack([two["delivery_seq"], three["delivery_seq"]]) == [
                two["delivery_seq"], three["delivery_seq"]]
        await events.aclose()
        # A refusal is not retried: it ends the stream, with its code.
        with pytest.raises(ClientError) as refused:
            async for _ in ResumingAsyncioClient(app.url, api_key="swk_not-a-key").events():
                pass
        assert refused.value.code == "unauthenticated"

    await trio.to_thread.run_sync(asyncio.run, asyncio_side())


class DaemonOutput:
    """The JSON lines an example daemon process prints, read as they come."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.lines: list[dict] = []
        self._partial = b""

    def _feed(self, chunk: bytes) -> None:
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        self.lines += [json.loads(line) for line in complete]

    async def wait_for(self, count: int) -> list[dict]:
        """Block until `count` lines in all were printed."""
        with trio.fail_after(60):
            while len(self.lines) < count:
                chunk = await self.process.stdout.receive_some(65536)
                assert chunk, "the daemon exited"
                self._feed(chunk)
        return self.lines

    async def drain(self) -> list[dict]:
        """Everything printed until the process's end (it must be ending)."""
        with trio.fail_after(60):
            while chunk := await self.process.stdout.receive_some(65536):
                self._feed(chunk)
        return self.lines


async def test_agent_daemon_handles_each_routed_message_once_across_restarts(data_dir, address):  # noqa: F811
    """The example daemon gets exactly what is routed to it (the owner's mentions, in the
    channel and in a thread; not an ordinary message, not a mention by a member with no
    authority over the private agent), and survives a real server restart and a kill -9
    of itself mid-stream: every routed message handled, each reply posted once."""
    cli_ws = ("--data-dir", str(data_dir), "--workspace", "w")
    init = json.loads(run_cli("init", "--data-dir", str(data_dir), "--email", "o@example.com", "--name", "O",
                              "--workspace-name", "W", "--workspace-slug", "w").stdout)
    agent = json.loads(run_cli("member", "create-agent", *cli_ws, "--owner", "o@example.com", "--handle", "daemon",
                               "--name", "Daemon").stdout)  # private: only its owner (and grantees) wake it
    key = json.loads(run_cli("apikey", "create", *cli_ws, "--member", "daemon").stdout)
    invitation = json.loads(run_cli("invite", "create", *cli_ws, "--email", "dave@example.com",
                                    "--role", "developer").stdout)
    served = await start_serve(data_dir, listening=address)
    url = served.url
    state_file = data_dir / "daemon.state"
    daemons: list[trio.Process] = []

    async def start_daemon() -> DaemonOutput:
        with open(data_dir.parent / f"{data_dir.name}.daemon.log", "ab") as log:
            daemons.append(await trio.lowlevel.open_process(
                [sys.executable, "examples/agent_daemon.py", "--url", url, "--api-key", key["key"], "--reply",
                 "--state-file", str(state_file)], stdout=subprocess.PIPE, stderr=log, cwd=PROJECT_ROOT))
        return DaemonOutput(daemons[-1])

    @contextlib.asynccontextmanager
    async def owner_connection():
        async with connect(url) as owner:
            await owner.login("o@example.com", init["password"])
            yield owner

    async def mention(owner, text: str) -> str:
        return (await owner.call("message.send", scope_id=channel["id"], content=f"@daemon {text}"))["id"]

    try:
        first = await start_daemon()
        async with owner_connection() as owner, connect(url) as dave:
            await dave.call("invitation.accept", token=invitation["token"], password="dave-password-1",
                            display_name="Dave")
            members = (await dave.call("member.list"))["members"]
            dave_id = next(m["id"] for m in members if m.get("email") == "dave@example.com")
            channel = await owner.call("channel.create", slug="ops", display_name="Ops",
                                       member_ids=[agent["member_id"], dave_id])
            routed = [await mention(owner, f"task {i}") for i in range(3)]
            await owner.call("message.send", scope_id=channel["id"], content="not for the daemon")
            await dave.call("message.send", scope_id=channel["id"], content="@daemon dave has no authority")
        await first.wait_for(3)

        assert await stop_serve(served) == 0
        served = await start_serve(data_dir, listening=address)  # the daemon knows only this address
        async with owner_connection() as owner:
            routed += [await mention(owner, f"task {i}") for i in range(3, 5)]
            in_thread = await owner.call("thread.reply", scope_id=channel["id"], root_message_id=routed[0],
                                         content="@daemon in the thread")
            routed.append(in_thread["id"])
            dm = await owner.call("dm.open", member_id=agent["member_id"])
            in_dm = await owner.call("message.send", scope_id=dm["id"], content="a direct message, no mention")
            routed.append(in_dm["id"])
        await first.wait_for(7)

        async with owner_connection() as owner:
            routed += [await mention(owner, f"burst {i}") for i in range(3)]
            await first.wait_for(10)
            # Mid-stream: stopped, it cannot ack what is routed to it now; then it dies.
            daemons[0].send_signal(signal.SIGSTOP)
            routed += [await mention(owner, f"burst {i}") for i in range(3, 6)]
            daemons[0].kill()
            assert await daemons[0].wait() == -signal.SIGKILL
            await first.drain()
            second = await start_daemon()  # same state file
            routed.append(await mention(owner, "last"))
        lines = first.lines
        while not set(routed) <= {line["message_id"] for line in lines}:
            lines = first.lines + await second.wait_for(len(second.lines) + 1)

        assert {line["message_id"] for line in lines} == set(routed)  # nothing lost, nothing else
        assert {(line["message_id"], line["reason"], line["authority"], line["kind"]) for line in lines} == {
            (m, "direct" if m == in_dm["id"] else "mention", "owner", "message") for m in routed}
        # Each in its own scope: the thread's message in the thread, the DM's in the DM.
        assert {(line["message_id"], line["scope_id"]) for line in lines if line["message_id"] in (
            in_thread["id"], in_dm["id"])} == {(in_thread["id"], in_thread["scope_id"]), (in_dm["id"], dm["id"])}
        # Bounded context, read through the readable predicate: Dave's message is not the private agent's to read.
        context = [m["content"] for m in next(line["context"] for line in lines if line["message_id"] == routed[2])]
        assert [text for text in context if text.startswith("@daemon task")][:3] == [
            "@daemon task 0", "@daemon task 1", "@daemon task 2"]
        assert all(m["from"] != dave_id for line in lines for m in line["context"])
        # Only a kill between printing a line and recording its key can print it again, as a redelivery.
        printed = Counter(line["dedupe_key"] for line in lines)
        again = [line for line in second.lines if printed[line["dedupe_key"]] > 1]
        assert len(again) <= 1 and all(line["attempt"] > 1 for line in again)
        # Every delivery but the last is acked, so its key has left the state file — a key the killed
        # daemon handled but never acked too, once its redelivery reached the second daemon (after
        # the server saw the killed connection go), which acks it without handling it again; or one
        # whose ack the server took just before the kill, which the second daemon forgets at start.
        with trio.fail_after(30):
            while not set(json.loads(state_file.read_text())["handled"]) <= {second.lines[-1]["dedupe_key"]}:
                await trio.sleep(0.05)

        async with owner_connection() as owner:
            replies = []
            for scope_id in (channel["id"], in_thread["scope_id"], dm["id"]):
                page = await owner.call("message.history", scope_id=scope_id, limit=200)
                replies += [m for m in page["messages"] if m["author_member_id"] == agent["member_id"]]
        assert sorted(m["content"] for m in replies) == sorted(f"handled {m}" for m in routed)  # once each
        assert {(m["content"], m["scope_id"]) for m in replies if m["content"] in (
            f"handled {in_thread['id']}", f"handled {in_dm['id']}")} == {
            (f"handled {in_thread['id']}", in_thread["scope_id"]), (f"handled {in_dm['id']}", dm["id"])}
    finally:
        for daemon in daemons:
            if daemon.returncode is None:
                daemon.kill()
                await daemon.wait()
    assert await stop_serve(served) == 0


async def test_agent_daemon_acks_without_handling_again_what_it_handled_before_a_crash(app: App, world,  # noqa: F811
                                                                                        tmp_path):
    """The state a crash between recording a handled key and acking it leaves: the
    delivery comes again, and the daemon acks it without handling or replying twice."""
    alpha, _, _, agent, channel, key, ws = world
    async with await signed_in(app, alpha.owner) as owner:
        handled = await owner.call("message.send", scope_id=channel["id"], content="@scout handled before", **ws)
        new = await owner.call("message.send", scope_id=channel["id"], content="@scout new", **ws)
    state_file = tmp_path / "daemon.state"
    state_file.write_text(json.dumps({"handled": [f"message:{handled['id']}:{agent['id']}"]}))
    with trio.fail_after(60):
        daemon = await trio.run_process(
            [sys.executable, "examples/agent_daemon.py", "--url", app.url, "--api-key", key, "--reply", "--limit", "1",
             "--state-file", str(state_file)], capture_stdout=True, cwd=PROJECT_ROOT)
    assert [json.loads(line)["message_id"] for line in daemon.stdout.decode().splitlines()] == [new["id"]]
    assert json.loads(state_file.read_text())["handled"] == []  # both acked: nothing left to remember
    async with as_agent(app, key) as scout:
        feed = (await scout.call("delivery.list", **ws))["deliveries"]
        assert [(d["message_id"], d["status"]) for d in feed] == [(handled["id"], "acked"), (new["id"], "acked")]
        page = await scout.call("message.history", scope_id=channel["id"], **ws)
    assert [m["content"] for m in page["messages"] if m["author_member_id"] == agent["id"]] == [f"handled {new['id']}"]


async def test_agent_daemon_forgets_at_start_a_key_whose_ack_went_through_before_a_crash(app: App, world,  # noqa: F811
                                                                                         tmp_path):
    """A crash after the server took an ack but before its reply arrived leaves the key
    recorded, and its delivery never comes again: the next start asks and forgets it."""
    alpha, _, _, agent, channel, key, ws = world
    async with await signed_in(app, alpha.owner) as owner:
        acked = await owner.call("message.send", scope_id=channel["id"], content="@scout acked", **ws)
    async with as_agent(app, key) as scout:
        [delivery] = (await scout.call("delivery.list", **ws))["deliveries"]
        assert (await scout.call("delivery.ack", delivery_seqs=[delivery["delivery_seq"]], **ws))["acked"]
    state_file = tmp_path / "daemon.state"
    state_file.write_text(json.dumps({"handled": [delivery["dedupe_key"]],
                                      "delivery_seqs": {delivery["dedupe_key"]: delivery["delivery_seq"]}}))
    async with await signed_in(app, alpha.owner) as owner:
        new = await owner.call("message.send", scope_id=channel["id"], content="@scout new", **ws)
    with trio.fail_after(60):
        daemon = await trio.run_process(
            [sys.executable, "examples/agent_daemon.py", "--url", app.url, "--api-key", key, "--limit", "1",
             "--state-file", str(state_file)], capture_stdout=True, capture_stderr=True, cwd=PROJECT_ROOT)
    assert [json.loads(line)["message_id"] for line in daemon.stdout.decode().splitlines()] == [new["id"]]
    assert json.loads(state_file.read_text()) == {"handled": [], "delivery_seqs": {}}
    assert f"{delivery['dedupe_key']} was acked before this start" in daemon.stderr.decode()
    assert acked["id"] == delivery["message_id"]


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
