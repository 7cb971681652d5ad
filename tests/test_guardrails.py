"""Message-domain guardrails (scope-model.md §9) as tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from domain.plan import ActorContext, MessageIntent
from actors.scope_actor import Send
from server.auth import system_workspace_context
from storage import applier
from storage.applier import MESSAGE_DOMAIN_TABLES
from storage.bridge import lift_transaction_bound
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


# Private authority (grants, Scope Executions, People collaborators and their
# cold audit/notification rows): written by storage/private_authority.py alone.
AUTHORITY_TABLES = ("scope_private_grants", "scope_executions", "task_scope_participant_metadata",
                    "task_collaborator_events", "task_collaborator_notification_jobs")


def test_only_the_applier_writes_message_domain_rows():
    tables = "|".join(t for t in MESSAGE_DOMAIN_TABLES if t not in AUTHORITY_TABLES)
    write = re.compile(rf"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+({tables})\b")
    # The schema definition's version steps may move data once, at migration time.
    allowed = {ROOT / "storage" / "applier.py", ROOT / "storage" / "schema.py"}
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
        # A bulk fixture load (10,000 members and memberships), bounded by the test's own timeout rather
        # than the pool's per-transaction one: on a starved machine it once took past the 60 s bound.
        await lift_transaction_bound(conn)
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
    # The message row, its search doc (a projection, scope-model §9) and one outbox row
    # (counters are updates).
    assert written == 3


def _roster_writers() -> set[str]:
    """Applier functions that write scope_memberships, directly or through another."""
    tree = ast.parse((ROOT / "storage" / "applier.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef)}
    direct = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+scope_memberships\b")
    writers = {name for name, node in functions.items() if direct.search(ast.unparse(node))}
    while True:
        callers = {name for name, node in functions.items() if name not in writers and any(
            isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in writers
            for call in ast.walk(node))}
        if not callers:
            return writers
        writers |= callers


def test_only_the_scope_actor_writes_a_scope_roster():
    """The scope's actor is the only writer of its memberships, creation included
    (scope-model.md: one writer per scope): every other module may only read them."""
    writers = _roster_writers()
    assert {"apply_membership_mutations", "mark_read"} <= writers  # the scan does find them
    allowed = {ROOT / "storage" / "applier.py", ROOT / "actors" / "scope_actor.py"}
    uses = re.compile(r"\bapplier\.(" + "|".join(sorted(writers)) + r")\b|\bimport\b[^\n]*\b("
                      + "|".join(sorted(writers)) + r")\b")
    offenders = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in _sources("server", "actors", "storage", "protocol")
                 if p not in allowed for m in uses.finditer(p.read_text())]
    assert offenders == []


def test_every_read_surface_goes_through_the_one_visibility_module():
    """Who may read a scope, and who receives its events, is decided in
    storage/visibility.py alone: nothing else reads the membership (or grant)
    tables, so no read path can skip or re-implement the rule."""
    reads = re.compile(r"\b(FROM|JOIN)\s+(scope_memberships|" + "|".join(AUTHORITY_TABLES) + r")\b")
    visibility_package = set(_sources("storage/visibility"))
    # The authority writer reads only the rows it is about to change.
    allowed = visibility_package | {ROOT / "storage" / "private_authority.py"}
    offenders = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in _sources("server", "actors", "storage", "protocol")
                 if p not in allowed for m in reads.finditer(p.read_text())]
    assert offenders == []
    assert any(reads.search(p.read_text()) for p in visibility_package)  # the pattern does find reads


def test_only_the_authority_writer_writes_grants_and_collaborators():
    write = re.compile(rf"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+({'|'.join(AUTHORITY_TABLES)})\b")
    allowed = {ROOT / "storage" / "private_authority.py"}
    offenders = [str(p.relative_to(ROOT)) for p in _sources("storage", "server", "actors")
                 if p not in allowed and write.search(p.read_text())]
    assert offenders == []


def test_only_the_delivery_ledger_module_writes_routed_deliveries():
    """Delivery state moves only through storage/deliveries.py: a second writer
    could hand a delivery out twice or ack what nobody handled."""
    write = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+(member_delivery_feeds|scope_targeted_deliveries)\b")
    allowed = {ROOT / "storage" / "deliveries.py"}
    offenders = [str(p.relative_to(ROOT)) for p in _sources("storage", "server", "actors")
                 if p not in allowed and write.search(p.read_text())]
    assert offenders == []
    assert write.search((ROOT / "storage" / "deliveries.py").read_text())  # the pattern does find writes
