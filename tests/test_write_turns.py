"""Workspace write turns (actors/write_turns.py): a scope actor's batch of sends
waits for its workspace's turn before it is closed, so the sends that reach it
while the workspace's other scopes commit go into that one batch."""

from __future__ import annotations

import contextlib

import trio
import trio.testing
import trio_websocket

from actors.write_turns import TURNS_PER_WORKSPACE, WriteTurns
from tests.conftest import App
from tests.test_messaging import open_channel, team  # noqa: F401 - a fixture
from tests.test_pipelining import _auth, _replies, _sends, _slow_commits, _write_all
from tests.test_tenancy import signed_in


async def test_turns_are_fair_bounded_per_workspace_and_forgotten_when_free():
    turns = WriteTurns()
    order: list[str] = []
    holding: dict[str, int] = {"w1": 0, "w2": 0}
    most: dict[str, int] = {"w1": 0, "w2": 0}
    gates: dict[str, trio.Event] = {}

    async def writer(workspace_id: str, name: str) -> None:
        await turns.acquire(workspace_id)
        try:
            order.append(name)
            holding[workspace_id] += 1
            most[workspace_id] = max(most[workspace_id], holding[workspace_id])
            await gates[name].wait()
            holding[workspace_id] -= 1
        finally:
            turns.release(workspace_id)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            gates[f"a{i}"] = trio.Event()
            nursery.start_soon(writer, "w1", f"a{i}")
            await trio.testing.wait_all_tasks_blocked()
        gates["b0"] = trio.Event()
        nursery.start_soon(writer, "w2", "b0")
        await trio.testing.wait_all_tasks_blocked()
        # Another workspace's writes never wait behind this one's.
        assert order == ["a0", "a1", "b0"] and turns.busy("w1") and not turns.busy("w2")
        assert turns.waiting == 3
        for i in range(5):
            gates[f"a{i}"].set()
            await trio.testing.wait_all_tasks_blocked()
        gates["b0"].set()
    assert order == ["a0", "a1", "b0", "a2", "a3", "a4"]  # first come, first served
    assert most == {"w1": TURNS_PER_WORKSPACE, "w2": 1}
    assert turns.waiting == 0 and not turns._turns


async def test_a_free_turn_is_taken_without_letting_other_tasks_run_first():
    # An actor whose commit just answered its callers starts its next batch before their
    # tasks write the replies; a turn that has to be waited for is still waited for.
    turns = WriteTurns()
    ran: list[str] = []

    async def other_task() -> None:
        ran.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await turns.acquire("w1")
        await turns.acquire("w1")
        assert ran == [] and turns.busy("w1")
        turns.release("w1")
        turns.release("w1")
    assert ran == ["other"] and not turns._turns


async def test_a_writer_cancelled_while_waiting_leaves_nothing_behind():
    turns = WriteTurns()
    release = trio.Event()

    async def hold() -> None:
        await turns.acquire("w")
        await release.wait()
        turns.release("w")

    async def wait_in_vain(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await turns.acquire("w")
            raise AssertionError("a turn was free")

    async with trio.open_nursery() as nursery:
        for _ in range(TURNS_PER_WORKSPACE):
            nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        waiter = await nursery.start(wait_in_vain)
        await trio.testing.wait_all_tasks_blocked()
        assert turns.waiting == 1
        waiter.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert turns.waiting == 0
        release.set()
    assert not turns._turns
    await turns.acquire("w")  # no turn was lost to the cancelled wait
    turns.release("w")


def _waiting_for_turns(app: App) -> float:
    for line in app.server.metrics.render().decode().splitlines():
        if line.startswith("scopewire_actors_waiting_write_turn "):
            return float(line.split()[1])
    raise AssertionError("no scopewire_actors_waiting_write_turn in /metrics")


async def _inserting(app: App) -> int:
    """Writes PostgreSQL is running now: slowed by the test (the trigger's sleep) or
    waiting for a lock (the workspace's counter row)."""
    return await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() "
        "AND datname = current_database() AND (wait_event = 'PgSleep' OR wait_event_type = 'Lock')"))


async def test_sends_that_arrive_while_the_workspace_commits_share_one_batch(app: App, team):
    alpha, _, bob, _ = team
    async with await signed_in(app, alpha.owner) as owner:
        channels = [await open_channel(owner, alpha.workspace_id, slug, [bob.member_id])
                    for slug in ("turn-a", "turn-b", "turn-c")]
    late = _sends(channels[2]["id"], 5, "c", workspace_id=alpha.workspace_id)
    async with contextlib.AsyncExitStack() as stack:
        # Each send on a connection of its own: none waits for another's reply.  Each signs
        # in as it opens: a login hashes a password, and on a busy machine the last of seven
        # opened first could pass the server's authentication timeout.
        connections = []
        for _ in range(2 + len(late)):
            ws = await stack.enter_async_context(trio_websocket.open_websocket_url(app.url))
            await _auth(ws, {"op": "login", "email": bob.email, "password": bob.password})
            connections.append(ws)
        ws_a, ws_b, *ws_late = connections
        first_a, first_b = (_sends(channel["id"], 1, slug, workspace_id=alpha.workspace_id)
                            for channel, slug in zip(channels, ("a", "b")))
        async with _slow_commits(app.db, 1.0):
            # Two scopes of the workspace take both turns: one commits, one waits behind it.
            await _write_all(ws_a, first_a)
            await _write_all(ws_b, first_b)
            with trio.fail_after(30):
                while await _inserting(app) < TURNS_PER_WORKSPACE:
                    await trio.sleep(0.01)
            # The third scope's first send waits for a turn with its batch still open ...
            await _write_all(ws_late[0], late[:1])
            with trio.fail_after(30):
                while _waiting_for_turns(app) < 1:
                    await trio.sleep(0.01)
            assert await _inserting(app) == TURNS_PER_WORKSPACE  # it waits here, not on a pooled connection
            # ... and takes in the sends that reach it meanwhile.
            for ws, send in zip(ws_late[1:], late[1:]):
                await _write_all(ws, [send])
            replies = [*await _replies(ws_a, 1), *await _replies(ws_b, 1)]
            for ws in ws_late:
                replies += await _replies(ws, 1)
    assert all(r["type"] == "result" for r in replies), replies
    created = await app.db.run(lambda c: c.fetch(
        "SELECT DISTINCT created_at FROM scope_messages WHERE scope_id = $1", channels[2]["id"]))
    assert len(created) == 1, "the late sends committed in more than one batch"
    assert sorted(r["data"]["seq"] for r in replies[2:]) == [1, 2, 3, 4, 5]
