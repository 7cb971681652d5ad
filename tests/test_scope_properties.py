"""Property test: random command sequences against a ScopeActor agree with a
simple model — seq is gap-free, idempotent sends return the original,
different payloads conflict, edits need the current revision and stop at
withdrawal, reactions are a keyed set where the last assertion wins."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio

from actors.fanout import FanoutHub
from domain.plan import ActorContext, MessageIntent
from actors.registry import ScopeRegistry
from actors.scope_actor import Edit, React, Refused, Send, Withdraw
from server.auth import system_workspace_context
from server import tenancy as ops
from storage import applier
from storage.bridge import Database, PoolSettings
from storage.errors import Conflict
from tests.conftest import add_person

AUTHORS = 2
KEYS = ["👍", "🎉", ":ok:"]

send = st.tuples(st.just("send"), st.integers(0, AUTHORS - 1), st.sampled_from([None, "a", "b", "c"]),
                 st.sampled_from(["x", "y"]))
edit = st.tuples(st.just("edit"), st.integers(0, 7), st.integers(0, 2), st.sampled_from(["e1", "e2"]))
withdraw = st.tuples(st.just("withdraw"), st.integers(0, 7))
react = st.tuples(st.just("react"), st.integers(0, AUTHORS - 1), st.integers(0, 7), st.sampled_from(KEYS),
                  st.booleans())
commands = st.lists(st.one_of(send, edit, withdraw, react), min_size=1, max_size=25)


@dataclass
class ModelMessage:
    id: str
    author: int
    revision: int = 1
    withdrawn: bool = False
    reactions: set = field(default_factory=set)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(script=commands)
def test_actor_agrees_with_the_model(database_dsn, member_password_hash, script):
    # Each example is its own trio run (hypothesis drives the loop), sharing one database.
    trio.run(_check_script, database_dsn, member_password_hash, script)


async def _check_script(dsn: str, password_hash: str, script) -> None:
    async with Database(dsn, PoolSettings(min_size=1, max_size=4)) as db, trio.open_nursery() as nursery:
        registry = ScopeRegistry(db, FanoutHub(), nursery)
        authors = await _authors(db, password_hash)
        await _run_script(db, registry, authors, script)
        nursery.cancel_scope.cancel()


async def _authors(db: Database, password_hash: str) -> tuple[str, list[str]]:
    workspace_id = await db.run(lambda c: c.fetchval("SELECT id FROM workspaces WHERE slug = 'props'"))
    if workspace_id is None:
        first = await ops.init_instance(db, email="p@example.com", display_name="P", workspace_name="Props",
                                        workspace_slug="props", edition="single", password="props-password")
        await add_person(db, first.workspace_id, "second@example.com", "viewer", password_hash)
        workspace_id = first.workspace_id
    members = await db.run(lambda c: c.fetch(
        "SELECT id FROM members WHERE workspace_id = $1 ORDER BY id", workspace_id))
    return workspace_id, [r["id"] for r in members]


async def _run_script(db: Database, registry: ScopeRegistry, workspace_authors, script) -> None:
    workspace_id, authors = workspace_authors
    workspace = await system_workspace_context(db, workspace_id)
    scope_id = await db.transaction(lambda conn: applier.create_scope(
        conn, workspace_id=workspace_id, type="channel", created_by=authors[0],
        members=[(m, "public", None) for m in authors]))
    actors = [ActorContext(workspace_id, m, "human", None, workspace.execution_generation) for m in authors]
    model: list[ModelMessage] = []
    keys: dict[tuple[int, str], tuple[int, str]] = {}  # (author, client id) -> (index, content)

    for command in script:
        kind = command[0]
        if kind == "send":
            _, author, client_id, content = command
            intent = MessageIntent(scope_id=scope_id, content=content, client_message_id=client_id)
            try:
                result = await registry.submit(scope_id, Send(actors[author], intent))
                outcome = ("ok", result)
            except Conflict as exc:
                outcome = (exc.reason, None)
            known = keys.get((author, client_id)) if client_id else None
            if known is None:
                assert outcome[0] == "ok" and outcome[1].seq == len(model) + 1 and not outcome[1].replayed
                model.append(ModelMessage(outcome[1].id, author))
                if client_id:
                    keys[(author, client_id)] = (len(model) - 1, content)
            elif known[1] == content:
                assert outcome[0] == "ok" and outcome[1].replayed and outcome[1].id == model[known[0]].id
            else:
                assert outcome[0] == "idempotency_conflict"
        elif not model:
            continue
        elif kind == "edit":
            _, index, revision_offset, content = command
            target = model[index % len(model)]
            expected = target.revision - 1 + revision_offset  # offset 1 is the right revision
            try:
                await registry.submit(scope_id, Edit(actors[target.author], target.id, content,
                                                                max(expected, 1)))
                outcome = "ok"
            except Conflict as exc:
                outcome = exc.reason
            if target.withdrawn:
                assert outcome == "message_withdrawn"
            elif max(expected, 1) != target.revision:
                assert outcome == "revision_mismatch"
            else:
                assert outcome == "ok"
                target.revision += 1
        elif kind == "withdraw":
            target = model[command[1] % len(model)]
            try:
                await registry.submit(scope_id, Withdraw(actors[target.author], target.id))
                outcome = "ok"
            except Conflict as exc:
                outcome = exc.reason
            assert outcome == ("message_withdrawn" if target.withdrawn else "ok")
            target.withdrawn = True
        elif kind == "react":
            _, author, index, key, add = command
            target = model[index % len(model)]
            try:
                await registry.submit(scope_id, React(actors[author], target.id, key, add))
                outcome = "ok"
            except (Conflict, Refused) as exc:
                outcome = getattr(exc, "reason", None)
            if target.withdrawn:
                assert outcome == "message_withdrawn"
            else:
                assert outcome == "ok"
                (target.reactions.add if add else target.reactions.discard)((author, key))

    rows = await db.run(lambda c: c.fetch(
        "SELECT id, seq, revision, state FROM scope_messages WHERE scope_id = $1 ORDER BY seq", scope_id))
    assert [r["seq"] for r in rows] == list(range(1, len(model) + 1))
    assert [(r["id"], r["revision"], r["state"] == "withdrawn") for r in rows] == [
        (m.id, m.revision, m.withdrawn) for m in model]
    reactions = await db.run(lambda c: c.fetch(
        "SELECT message_id, member_id, reaction_key FROM scope_message_reactions WHERE scope_id = $1", scope_id))
    assert {(r[0], r[1], r[2]) for r in reactions} == {
        (m.id, authors[a], k) for m in model for (a, k) in m.reactions}
