"""Pipelined message.send (server/pipeline.py): a client that writes its next
commands before the replies come gets what serving one command at a time gives
(replies in request order, sends committed in request order, every reply read
after the writes before it) while its sends share the scope actor's batch
commits; a stale cached context or a revocation in the middle changes nothing
of that."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import pytest
import trio
import trio_websocket
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from client import connect
from server.config import ServerConfig
from protocol.frames import CLOSE_REVOKED
from storage.bridge import Database
from tests.conftest import MEMBER_PASSWORD, App
from tests.server_thread import ServerThread
from tests.test_cached_context import SILENT_CHANGES
from tests.test_messaging import open_channel, team  # noqa: F401 - a fixture
from tests.test_tenancy import signed_in


async def _auth(ws: trio_websocket.WebSocketConnection, frame: dict) -> None:
    await ws.send_message(json.dumps({"id": "auth", **frame}))
    reply = json.loads(await ws.get_message())
    assert reply["type"] == "result", reply


async def _write_all(ws: trio_websocket.WebSocketConnection, frames_out: list[dict | str]) -> None:
    for frame in frames_out:
        await ws.send_message(frame if isinstance(frame, str) else json.dumps(frame))


async def _replies(ws: trio_websocket.WebSocketConnection, count: int) -> list[dict]:
    """The next `count` replies (events skipped)."""
    replies: list[dict] = []
    with trio.fail_after(60):
        while len(replies) < count:
            frame = json.loads(await ws.get_message())
            if frame["type"] != "event":
                replies.append(frame)
    return replies


def _sends(scope_id: str, count: int, prefix: str, **extra) -> list[dict]:
    return [{"op": "message.send", "id": f"{prefix}{i}", "scope_id": scope_id, "content": f"{prefix} {i}", **extra}
            for i in range(count)]


@contextlib.asynccontextmanager
async def _slow_commits(db: Database, seconds: float = 0.02):
    """Every statement inserting messages takes `seconds` longer (a PostgreSQL
    trigger): a batch commits late enough for the commands written behind it to
    arrive first, and a read served before it commits would miss it."""
    await db.run(lambda c: c.execute(
        "CREATE FUNCTION test_slow_insert() RETURNS trigger LANGUAGE plpgsql AS "
        f"$$ BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$; "
        "CREATE TRIGGER test_slow_insert BEFORE INSERT ON scope_messages "
        "FOR EACH STATEMENT EXECUTE FUNCTION test_slow_insert()"))
    try:
        yield
    finally:
        await db.run(lambda c: c.execute("DROP TRIGGER test_slow_insert ON scope_messages; "
                                          "DROP FUNCTION test_slow_insert()"))


def _batches(app: App) -> float:
    """Batch commits of every scope actor so far."""
    (family,) = app.server.metrics.batch_size.collect()
    return next(sample.value for sample in family.samples if sample.name.endswith("_count"))


async def _scope_seqs(db: Database, scope_id: str) -> dict[str, int]:
    rows = await db.run(lambda c: c.fetch("SELECT content, seq FROM scope_messages WHERE scope_id = $1", scope_id))
    return {row["content"]: row["seq"] for row in rows}


@contextlib.asynccontextmanager
async def _bob_in_channel(app: App, team, slug: str):
    """A channel with bob in it, and a raw WebSocket signed in as bob: (workspace id, channel, socket)."""
    alpha, _, bob, _ = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, slug, [bob.member_id])
    async with trio_websocket.open_websocket_url(app.url) as ws:
        await _auth(ws, {"op": "login", "email": bob.email, "password": bob.password})
        yield alpha.workspace_id, channel, ws


async def test_pipelined_sends_share_batch_commits_in_request_order(app: App, team):
    async with _bob_in_channel(app, team, "piped") as (workspace_id, channel, ws):
        sends = _sends(channel["id"], 40, "piped", workspace_id=workspace_id)
        batches = _batches(app)
        async with _slow_commits(app.db):
            await _write_all(ws, sends)
            replies = await _replies(ws, len(sends))
    assert [r["id"] for r in replies] == [s["id"] for s in sends]
    assert all(r["type"] == "result" for r in replies), replies
    seqs = [r["data"]["seq"] for r in replies]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert (await _scope_seqs(app.db, channel["id"])) == {s["content"]: seq for s, seq in zip(sends, seqs)}
    # Served one at a time, each send would wait for the batch before it: 40 commits.
    assert _batches(app) - batches <= 10


async def test_only_a_client_writing_ahead_is_pipelined(app: App, team):
    """A client waiting for each reply is served inline (no task per send), however fast
    it answers; sends written together are served as a pipeline (counted on /metrics)."""
    metrics = app.server.metrics
    async with _bob_in_channel(app, team, "modes") as (workspace_id, channel, ws):
        pipelines = metrics.pipelines
        for send in _sends(channel["id"], 20, "waiting", workspace_id=workspace_id):
            await _write_all(ws, [send])
            await _replies(ws, 1)
        assert metrics.pipelines == pipelines
        async with _slow_commits(app.db):
            await _write_all(ws, _sends(channel["id"], 10, "ahead", workspace_id=workspace_id))
            await _replies(ws, 10)
        assert metrics.pipelines > pipelines


async def test_a_read_written_behind_pipelined_sends_sees_them(app: App, team):
    """Only sends overlap: a history read written right behind them waits until they are answered."""
    async with _bob_in_channel(app, team, "behind") as (workspace_id, channel, ws):
        sends = _sends(channel["id"], 8, "behind", workspace_id=workspace_id)
        read = {"op": "message.history", "id": "read", "scope_id": channel["id"], "workspace_id": workspace_id}
        async with _slow_commits(app.db):
            await _write_all(ws, [*sends, read])
            replies = await _replies(ws, len(sends) + 1)
    assert [r["id"] for r in replies] == [s["id"] for s in sends] + ["read"]
    assert {m["content"] for m in replies[-1]["data"]["messages"]} == {s["content"] for s in sends}


@contextlib.asynccontextmanager
async def _bob_keyed(app: App, team, slug: str):
    """A channel with bob in it, the owner's connection (open throughout), and a raw
    WebSocket authenticated with an API key of bob's: (owner, channel, key, socket)."""
    alpha, _, bob, _ = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, slug, [bob.member_id])
        key = await owner.call("apikey.create", name="bob", member_id=bob.member_id,
                               workspace_id=alpha.workspace_id)
        async with trio_websocket.open_websocket_url(app.url) as ws:
            await _auth(ws, {"op": "auth", "api_key": key["key"]})
            yield owner, channel, key, ws


@pytest.mark.parametrize("change", ["generation advanced", "key revoked"])
async def test_a_stale_cached_context_under_pipelined_sends_keeps_their_order(app: App, team, change: str):
    """The sends queued with a context that proves stale in their batch are refused
    there and served afresh (or refused for good) one after another, in order."""
    alpha = team[0]
    async with _bob_keyed(app, team, "stale") as (_, channel, key, ws):
        warm = _sends(channel["id"], 2, "warm")
        await _write_all(ws, warm)  # fills the cached context
        await _replies(ws, len(warm))
        sql, refusal = SILENT_CHANGES[change]
        await app.db.run(lambda c: c.execute(sql.format(workspace=alpha.workspace_id, key=key["id"])))
        sends = _sends(channel["id"], 30, "after")
        async with _slow_commits(app.db):
            await _write_all(ws, sends)
            replies = await _replies(ws, len(sends))
    assert [r["id"] for r in replies] == [s["id"] for s in sends]
    stored = await _scope_seqs(app.db, channel["id"])
    if refusal is None:
        assert all(r["type"] == "result" for r in replies), replies
        seqs = [r["data"]["seq"] for r in replies]
        assert seqs == sorted(seqs) == [stored[s["content"]] for s in sends]
    else:
        assert {r.get("code") for r in replies} == {refusal}
        assert set(stored) == {s["content"] for s in warm}


async def test_a_revocation_under_pipelined_sends_closes_after_the_replies_of_those_taken(app: App, team):
    """Revoked (NOTIFY) while sends are in flight: each send taken is answered, in
    order, before the 4403 close; a send is stored exactly when it was acknowledged."""
    alpha = team[0]
    async with _bob_keyed(app, team, "revoked") as (owner, channel, key, ws):
        sends = _sends(channel["id"], 200, "r")
        replies: list[dict] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_all, ws, sends)
            with trio.fail_after(60):
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    while True:
                        frame = json.loads(await ws.get_message())
                        replies.append(frame)
                        if len(replies) == 5:
                            await owner.call("apikey.revoke", api_key_id=key["id"], workspace_id=alpha.workspace_id)
            nursery.cancel_scope.cancel()  # the rest cannot be written to a closed connection
    assert closed.value.reason.code == CLOSE_REVOKED
    assert [r["id"] for r in replies] == [s["id"] for s in sends[:len(replies)]]
    acknowledged = [s["content"] for s, r in zip(sends, replies) if r["type"] == "result"]
    assert 5 <= len(acknowledged) < len(sends)
    assert sorted(await _scope_seqs(app.db, channel["id"])) == sorted(acknowledged)


# --- any mix of ops, pipelined -----------------------------------------------------------------

@dataclass
class World:
    url: str
    first: str
    second: str


async def _world(db: Database, url: str) -> World:
    from server import tenancy as ops

    instance = await ops.init_instance(db, email="owner@example.com", display_name="Owner", workspace_name="Piped",
                                       workspace_slug="piped", edition="single", password=MEMBER_PASSWORD)
    async with connect(url) as owner:
        await owner.login("owner@example.com", MEMBER_PASSWORD)
        first = await open_channel(owner, instance.workspace_id, "first")
        second = await open_channel(owner, instance.workspace_id, "second")
    return World(url, first["id"], second["id"])


OPS = ("send first", "send second", "history first", "ping", "invalid send")


async def _pipeline_plan(world: World, plan: list[str]) -> None:
    """Write every command of `plan` at once; the replies come in request order, the
    sends of both channels commit in request order (workspace_global_seq), and each
    history page holds exactly the sends written before it."""
    frames_out: list[dict | str] = []
    for index, op in enumerate(plan):
        rid = str(index)
        if op.startswith("send"):
            scope_id = world.first if op == "send first" else world.second
            frames_out.append({"op": "message.send", "id": rid, "scope_id": scope_id, "content": f"{rid} {op}"})
        elif op == "history first":
            frames_out.append({"op": "message.history", "id": rid, "scope_id": world.first, "limit": 200})
        elif op == "ping":
            frames_out.append({"op": "ping", "id": rid})
        else:
            frames_out.append({"op": "message.send", "id": rid, "scope_id": world.first, "content": 7})
    async with trio_websocket.open_websocket_url(world.url) as ws:
        await _auth(ws, {"op": "login", "email": "owner@example.com", "password": MEMBER_PASSWORD})
        await _write_all(ws, frames_out)
        replies = await _replies(ws, len(frames_out))
    assert [r["id"] for r in replies] == [str(i) for i in range(len(plan))]
    sent_first = [(index, reply["data"]["id"]) for index, (op, reply) in enumerate(zip(plan, replies))
                  if op == "send first" and reply["type"] == "result"]
    global_seqs: list[int] = []
    for index, (op, reply) in enumerate(zip(plan, replies)):
        assert reply["type"] == ("error" if op == "invalid send" else "result"), (op, reply)
        if op.startswith("send"):
            global_seqs.append(reply["data"]["global_seq"])
        elif op == "history first":
            page = {m["id"] for m in reply["data"]["messages"]}
            assert {i for at, i in sent_first if at < index} <= page
            assert not {i for at, i in sent_first if at > index} & page
    assert global_seqs == sorted(global_seqs) and len(set(global_seqs)) == len(global_seqs)


async def _run_slowly(thread: ServerThread, plan: list[str]) -> None:
    async with _slow_commits(thread.db):
        await _pipeline_plan(thread.base, plan)


def test_pipelined_commands_answer_as_if_served_one_at_a_time(database_dsn):
    config = ServerConfig(port=0, shutdown_grace_seconds=1.0)
    with ServerThread(database_dsn, config, _world) as thread:

        @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(plan=st.lists(st.sampled_from(OPS), min_size=1, max_size=30))
        @example(plan=["send first"] * 6 + ["send second", "send first", "send second"] * 3 + ["history first"])
        def plans(plan):
            thread.run(_run_slowly, thread, plan)

        plans()
