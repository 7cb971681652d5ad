"""Message-domain guardrails (scope-model.md §9) as tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.plan import ActorContext, MessageIntent
from actors.scope_actor import Send
from server.auth import system_workspace_context
from storage import applier
from storage.applier import MESSAGE_DOMAIN_TABLES
from storage.ids import new_id
from tests.conftest import App

ROOT = Path(__file__).resolve().parents[1]
SQL = re.compile(r"\b(SELECT|INSERT\s+INTO|DELETE\s+FROM)\b|\bUPDATE\s+[a-z_]+\s+SET\b")


def _sources(*packages: str) -> list[Path]:
    return [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))]


def test_no_sql_outside_storage():
    offenders = [str(p.relative_to(ROOT)) for p in _sources("server", "actors", "protocol", "client")
                 if SQL.search(p.read_text())]
    assert offenders == []


def test_only_the_applier_writes_message_domain_rows():
    tables = "|".join(MESSAGE_DOMAIN_TABLES)
    write = re.compile(rf"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+({tables})\b")
    allowed = {ROOT / "storage" / "applier.py"}
    offenders = [str(p.relative_to(ROOT)) for p in _sources("storage", "server", "actors")
                 if p not in allowed and write.search(p.read_text())]
    assert offenders == []
    assert write.search((ROOT / "storage" / "applier.py").read_text())  # the pattern does find writes


def test_one_canonical_mention_parser():
    users = [str(p.relative_to(ROOT)) for p in _sources("server", "actors", "storage", "protocol")
             if "parse_routing_tokens" in p.read_text()]
    assert sorted(users) == ["actors/planner.py", "actors/routing_tokens.py"]


@pytest.mark.parametrize("audience", [1, 10_000])
async def test_a_send_writes_the_same_rows_whatever_the_audience(app: App, tenants, audience: int):
    alpha, _ = tenants
    workspace = await system_workspace_context(app.db, alpha.workspace_id)
    member_ids = [new_id("mem") for _ in range(audience - 1)]

    async def setup(conn):
        await conn.execute(
            "INSERT INTO members (id, workspace_id, kind, handle, display_name, owner_member_id, visibility) "
            "SELECT m, $1, 'agent', 'bulk-' || m, 'Bulk', $3, 'public' FROM unnest($2::text[]) AS t(m)",
            alpha.workspace_id, member_ids, alpha.owner.member_id)
        scope_id = await applier.create_scope(conn, workspace_id=alpha.workspace_id, type="channel",
                                              created_by=alpha.owner.member_id,
                                              members=[(alpha.owner.member_id, "public", None)])
        if member_ids:
            await applier.bulk_open_memberships(conn, alpha.workspace_id, scope_id, member_ids)
        return scope_id

    scope_id = await app.db.transaction(setup)

    async def total_rows(conn) -> int:
        tables = [r[0] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        return await conn.fetchval("SELECT " + " + ".join(f"(SELECT count(*) FROM {t})" for t in tables))

    actor = ActorContext(alpha.workspace_id, alpha.owner.member_id, "human", None, workspace.execution_generation)
    await app.server.registry.submit(scope_id, Send(actor, MessageIntent(scope_id=scope_id, content="warm-up")))
    before = await app.db.run(total_rows)
    await app.server.registry.submit(scope_id, Send(actor, MessageIntent(scope_id=scope_id, content="measured")))
    written = await app.db.run(total_rows) - before
    # One message row and one outbox row (counters are updates).
    assert written == 2
