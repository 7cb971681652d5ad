"""Connection limits, each answered with a typed error or a close code; and
ephemeral signals (typing, presence) that are never stored."""

from __future__ import annotations

import contextlib
import time

import pytest
import trio
import trio.testing

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client import ClientError, connect
from protocol import frames
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import DUMMY_PASSWORD_HASH, SessionSigner, hash_password, verify_password
from server.limits import Slots
from storage.bridge import Database, PoolSettings
from tests.conftest import App, add_person
from tests.db_faults import hold_table_lock, release_locks, wait_for_query
from tests.test_messaging import open_channel
from tests.test_realtime import events_for
from tests.test_tenancy import expect_error, signed_in


@pytest.fixture
def server_config() -> ServerConfig:
    # The pong deadline is far beyond the idle timeout: on a busy machine a late pong must
    # not close the idle connection before the idle timeout does.
    return ServerConfig(port=0, auth_timeout_seconds=2.0, shutdown_grace_seconds=1.0, commands_per_second=0.5,
                        command_burst=40, max_connections_per_member=3, heartbeat_seconds=0.2,
                        heartbeat_timeout_seconds=10.0, idle_timeout_seconds=3.0, max_frame_bytes=64 * 1024)


async def test_commands_per_connection_are_rate_limited(app: App, tenants):
    alpha, _ = tenants
    async with await signed_in(app, alpha.owner) as conn:
        outcomes = []
        for _ in range(45):
            try:
                await conn.call("ping")
                outcomes.append("ok")
            except ClientError as exc:
                outcomes.append(exc.code)
        # Burst of 40 (login used one), then rate_limited replies; the connection stays up.
        assert outcomes.count("ok") == 39 and set(outcomes[39:]) == {"rate_limited"}


async def test_connections_per_member_are_limited(app: App, tenants):
    alpha, _ = tenants
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(3):  # each connects just before its login: none sits idle meanwhile
            await (await stack.enter_async_context(connect(app.url))).login(alpha.owner.email, alpha.owner.password)
        fourth = await stack.enter_async_context(connect(app.url))
        await expect_error("rate_limited", fourth.login(alpha.owner.email, alpha.owner.password))


async def test_oversized_frames_close_the_connection_not_the_server(app: App, tenants):
    alpha, _ = tenants
    async with connect(app.url) as conn:
        with pytest.raises(Exception):
            await conn.call("ping", padding="x" * (70 * 1024))
        assert conn.close_code == 1009  # message too big
    async with connect(app.url) as conn:
        assert (await conn.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION


async def test_idle_connections_are_closed_and_heartbeats_keep_others(app: App, tenants):
    alpha, _ = tenants
    async with connect(app.url) as idle, await signed_in(app, alpha.owner) as busy:
        await idle.login(alpha.owner.email, alpha.owner.password)
        async with trio.open_nursery() as nursery:
            async def keep_busy():
                while True:
                    await busy.call("ping")
                    await trio.sleep(0.3)  # deliberate: a client that talks every 0.3 s

            nursery.start_soon(keep_busy)
            with trio.fail_after(10):
                assert await idle.wait_closed() == frames.CLOSE_IDLE
            nursery.cancel_scope.cancel()
        assert (await busy.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION


async def test_the_idle_timeout_holds_whatever_the_heartbeat_interval(db, nursery, tenants, mock_clock):
    # Virtual time stands still (the mock clock) until the test moves it.
    alpha, _ = tenants
    config = ServerConfig(port=0, idle_timeout_seconds=3.0, heartbeat_seconds=30.0, heartbeat_timeout_seconds=20.0,
                          shutdown_grace_seconds=1.0)
    server = Server(config, db, Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
    await nursery.start(server.run)
    async with await signed_in(App(server, db), alpha.owner) as idle:
        mock_clock.jump(2.5)
        await idle.ws.ping()  # answered, but control frames are not activity
        assert idle.close_code is None
        mock_clock.jump(1.0)  # 3.5 s since the last message; the next heartbeat is 26.5 s away
        mock_clock.rate = 1.0
        with trio.fail_after(5):
            assert await idle.wait_closed() == frames.CLOSE_IDLE


async def test_typing_and_presence_are_ephemeral(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "viewer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "viewer", member_password_hash)

    async def stored() -> int:
        return await app.db.run(lambda c: c.fetchval(
            "SELECT (SELECT count(*) FROM scope_messages) + (SELECT count(*) FROM scope_activity_events)"))

    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, carol) as c:
        channel = await open_channel(owner, alpha.workspace_id, "typing", [bob.member_id])
        await b.call("subscribe", workspace_feed=True, **ws)
        await c.call("subscribe", workspace_feed=True, **ws)
        before = await stored()
        await owner.call("typing", scope_id=channel["id"], **ws)
        typing = (await events_for(b, 1, "typing"))[0]
        assert typing["data"]["member_id"] == alpha.owner.member_id and typing["data"]["expires_at_ms"] > 0
        await owner.call("presence", state="away", **ws)
        for listener in (b, c):
            presence = (await events_for(listener, 1, "presence"))[0]
            assert presence["data"]["state"] == "away"
        # Carol is not in the channel: she saw presence but no typing.
        assert not [e for e in c.queued_events() if e["event"] == "typing"]
        await expect_error("not_found", c.call("typing", scope_id="scp_zzzzzzzzzzzzzz", **ws))
        outcomes = []
        for _ in range(8):
            try:
                await owner.call("typing", scope_id=channel["id"], **ws)
                outcomes.append("ok")
            except ClientError as exc:
                outcomes.append(exc.code)
        assert "rate_limited" in outcomes
        assert await stored() == before


# --- brute force and floods ---------------------------------------------------------------------------

async def start_server(db, nursery, config: ServerConfig) -> App:
    server = Server(config, db, Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()), 3600))
    await nursery.start(server.run)
    return App(server, db)


async def test_failed_logins_are_throttled_per_account_with_growing_delays(db, nursery, tenants, mock_clock, caplog):
    # Virtual time stands still (the mock clock) until the test moves it.
    alpha, _ = tenants
    app = await start_server(db, nursery, ServerConfig(port=0, shutdown_grace_seconds=1.0))
    email, right = alpha.owner.email, alpha.owner.password
    async with connect(app.url) as conn:
        for _ in range(5):  # free failures
            await expect_error("unauthenticated", conn.login(email, "wrong"))
        await expect_error("unauthenticated", conn.login(email, "wrong"))  # the 6th blocks the account 1 s
        throttled = await expect_error("rate_limited", conn.login(email, right))  # not even checked
        assert throttled.details["retry_after_seconds"] == 1.0
        await expect_error("rate_limited", conn.login(email.upper(), "wrong"))  # one account, however spelled
        mock_clock.jump(1.1)
        await expect_error("unauthenticated", conn.login(email, "wrong"))  # the 7th: 2 s
        mock_clock.jump(1.5)
        await expect_error("rate_limited", conn.login(email, right))
        mock_clock.jump(0.6)
        assert (await conn.login(email, right))["principal"] == "account"
    # One warning for the throttled account, not one per attempt.
    warnings = [r for r in caplog.records if r.getMessage() == "failed credentials: throttling"]
    assert [r.key_kind for r in warnings] == ["account"]


async def test_failed_logins_and_auths_are_throttled_per_address(db, nursery, tenants, mock_clock):
    alpha, _ = tenants
    app = await start_server(db, nursery, ServerConfig(port=0, shutdown_grace_seconds=1.0))
    async with connect(app.url) as conn:
        # 20 free failures per address, whatever the account or the credential kind.
        for number in range(10):
            await expect_error("unauthenticated", conn.login(f"nobody{number}@example.com", "wrong"))
            await expect_error("unauthenticated", conn.auth(token="not-a-token") if number % 2
                               else conn.auth(api_key="swk_not_a_key"))
        await expect_error("unauthenticated", conn.login("nobody-else@example.com", "wrong"))  # the 21st
        await expect_error("rate_limited", conn.login(alpha.owner.email, alpha.owner.password))
        await expect_error("rate_limited", conn.auth(token="not-a-token"))
        mock_clock.jump(1.1)
        assert (await conn.login(alpha.owner.email, alpha.owner.password))["principal"] == "account"


async def test_a_connection_flood_is_capped_and_authenticated_clients_keep_working(db, nursery, tenants, caplog):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    app = await start_server(db, nursery, ServerConfig(
        port=0, auth_timeout_seconds=60.0, shutdown_grace_seconds=1.0, max_unauthenticated_per_address=8,
        max_unauthenticated_connections=50, max_connections=100))
    upgrade = (b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, alpha.owner) as listener:
        channel = await open_channel(owner, alpha.workspace_id, "during-flood")
        await listener.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        flood, statuses = [], []
        for _ in range(200):  # handshakes that will never authenticate
            stream = await trio.open_tcp_stream("127.0.0.1", app.server.port)
            flood.append(stream)
            await stream.send_all(upgrade)
            response = b""
            with trio.fail_after(10):
                while b"\r\n\r\n" not in response and (chunk := await stream.receive_some(4096)):
                    response += chunk
            statuses.append(response.split(b" ", 2)[1])
        assert statuses.count(b"101") == 8 and statuses.count(b"503") == 192
        # The authenticated clients are unaffected: a send reaches the subscriber.
        sent = await owner.call("message.send", scope_id=channel["id"], content="still here", **ws)
        assert (await events_for(listener, 1))[0]["data"]["id"] == sent["id"]
        for stream in flood:
            await stream.aclose()
    refusals = [r for r in caplog.records if r.getMessage().startswith("refusing new connections")]
    assert 1 <= len(refusals) <= 3  # not one line per refused handshake
    # Once the flood is gone, the address may connect again.
    async with await signed_in(app, alpha.owner) as again:
        assert (await again.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION


async def test_a_slow_command_is_not_mistaken_for_a_dead_peer(db, nursery, tenants, mock_clock, database_dsn):
    # While a command is answered the server does not read the socket, so the
    # client's pong waits there: the heartbeat must not abort the connection.
    alpha, _ = tenants
    app = await start_server(db, nursery, ServerConfig(port=0, heartbeat_seconds=1.0, heartbeat_timeout_seconds=1.0,
                                                       shutdown_grace_seconds=1.0))
    blocked = "wait_event_type = 'Lock' AND query LIKE '%FROM accounts%'"
    async with connect(app.url) as conn, Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as admin, \
            trio.open_nursery() as tasks:
        async def real_sleep(seconds: float) -> None:  # the mock clock stands still
            await trio.to_thread.run_sync(time.sleep, seconds)

        await hold_table_lock(admin, tasks, "accounts", sleep=real_sleep)
        result, done = {}, trio.Event()

        async def log_in():
            result["login"] = await conn.login(alpha.owner.email, alpha.owner.password)
            done.set()

        tasks.start_soon(log_in)
        await wait_for_query(admin, blocked, sleep=real_sleep)  # the login waits in the database
        mock_clock.jump(1.0)  # a heartbeat: ping
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(1.5)  # past the pong deadline, the login still running
        await trio.testing.wait_all_tasks_blocked()
        await release_locks(admin)
        mock_clock.rate = 1.0
        with trio.fail_after(20):
            await done.wait()
        assert result["login"]["principal"] == "account"
        assert (await conn.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION


def test_an_unknown_email_is_checked_against_a_hash_of_the_same_scrypt_cost():
    """A login's timing does not tell registered emails from others: the stand-in hash
    costs what a real one does and matches no password."""
    real, stand_in = hash_password("a password").split("$"), DUMMY_PASSWORD_HASH.split("$")
    assert stand_in[:4] == real[:4] and len(stand_in[5]) == len(real[5])
    assert not verify_password("", DUMMY_PASSWORD_HASH) and not verify_password("a password", DUMMY_PASSWORD_HASH)


async def test_slots_admit_at_most_their_size_in_arrival_order_and_a_cancelled_waiter_takes_none():
    slots = Slots(2)
    entered: list[str] = []
    release = {name: trio.Event() for name in "abcde"}

    async def holder(name: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            async with slots:
                entered.append(name)
                await release[name].wait()

    async with trio.open_nursery() as nursery:
        for name in "abcde":
            await nursery.start(holder, name)
            await trio.testing.wait_all_tasks_blocked()
        assert entered == ["a", "b"] and slots.free == 0 and slots.waiting == 3
        sixth = await nursery.start(holder, "x")  # cancelled while it waits
        await trio.testing.wait_all_tasks_blocked()
        sixth.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert slots.waiting == 3
        release["a"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert entered == ["a", "b", "c"]
        for name in "bcde":
            release[name].set()
            await trio.testing.wait_all_tasks_blocked()
    assert entered == ["a", "b", "c", "d", "e"] and slots.free == 2 and slots.waiting == 0
