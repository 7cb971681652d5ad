"""How far ahead the platform actor leases (README, platform broadcast, step 4): up to three times
`--platform-delivery-concurrency` deliveries are in flight — one page running, two leased with
their scope actors started — and no more until some finish."""

from __future__ import annotations

import pytest
import trio

from server.config import ServerConfig
from tests.conftest import App
from tests.platform_helpers import broadcast, operator, wait_broadcast_done
from tests.test_platform_broadcast import lock_execution_state, new_workspace, ready_account, unlock

CONCURRENCY = 1


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(port=0, auth_timeout_seconds=2.0, expiry_sweep_seconds=0.5, shutdown_grace_seconds=2.0,
                        platform_delivery_concurrency=CONCURRENCY)


async def _states(app: App, broadcast_id: str) -> dict[str, int]:
    rows = await app.db.run(lambda c: c.fetch(
        "SELECT state, count(*) AS n FROM platform_service_account_broadcast_deliveries WHERE broadcast_id = $1 "
        "GROUP BY state", broadcast_id))
    return {r["state"]: r["n"] for r in rows}


async def _blocked_backends(app: App, holders: list[int]) -> int:
    return await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE pg_blocking_pids(pid) && $1::int[]", holders))


async def test_three_pages_of_deliveries_are_leased_while_one_runs(app: App, tenants, nursery,
                                                                   member_password_hash):
    more = [await new_workspace(app.db, member_password_hash) for _ in range(2)]
    workspaces = [t.workspace_id for t in (*tenants, *more)]
    async with operator(app) as ops:
        account = await ready_account(ops, "News")
        # Every workspace's message transaction waits in its fence check: the running delivery stays running.
        holders = [await lock_execution_state(app.db, nursery, w) for w in workspaces]
        sent = await broadcast(ops, account["id"], "ahead")
        # Nothing announces a transaction waiting on a row lock: the precondition is read from PostgreSQL.
        with trio.fail_after(30):
            while await _blocked_backends(app, holders) < CONCURRENCY:
                await trio.sleep(0.05)
        # The actor leased once, as many as fit (3 x 1), started one and waits for it.
        assert await _states(app, sent["id"]) == {"leased": 3 * CONCURRENCY,
                                                  "queued": len(workspaces) - 3 * CONCURRENCY}
        for pid in holders:
            await unlock(app.db, pid)
        done = await wait_broadcast_done(ops, sent["id"])
    assert done["state"] == "completed", done
    assert await _states(app, sent["id"]) == {"delivered": len(workspaces)}
