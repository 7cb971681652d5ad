"""Connection limits, each answered with a typed error or a close code; and
ephemeral signals (typing, presence) that are never stored."""

from __future__ import annotations

import pytest
import trio

from client import ClientError, connect
from protocol import frames
from server.config import ServerConfig
from tests.conftest import App, add_person
from tests.test_messaging import open_channel
from tests.test_realtime import events_for
from tests.test_tenancy import expect_error, signed_in


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(port=0, auth_timeout_seconds=2.0, shutdown_grace_seconds=1.0, commands_per_second=0.5,
                        command_burst=40, max_connections_per_member=3, heartbeat_seconds=0.2,
                        heartbeat_timeout_seconds=1.0, idle_timeout_seconds=1.5, max_frame_bytes=64 * 1024)


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
    async with connect(app.url) as a, connect(app.url) as b, connect(app.url) as c, connect(app.url) as d:
        for conn in (a, b, c):
            await conn.login(alpha.owner.email, alpha.owner.password)
        await expect_error("rate_limited", d.login(alpha.owner.email, alpha.owner.password))


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
