"""Loading the private authority a scope actor caches (domain/authority.py)."""

from __future__ import annotations

import asyncpg

from domain.authority import AuthorityWindow, ScopeAuthority
from storage.visibility.predicate import CLOSED_BY_EXPIRY


async def scope_authority(conn: asyncpg.Connection, chain: list[str], owners: list[str]) -> ScopeAuthority:
    """Every grant and People collaborator window of `owners` on `chain` (a scope
    and, for a thread, its parent), ended ones included (they still decide what
    was readable).  No owners (no private members): no query at all."""
    if not owners:
        return ScopeAuthority()
    rows = await conn.fetch(
        f"SELECT 'grant' AS kind, g.id, g.owner_member_id, g.grantee_member_id AS author, g.scope_id, "
        f"g.effective_from_global_seq, g.effective_to_global_seq, g.expires_at, "
        f"({CLOSED_BY_EXPIRY['grant'].format(row='g')}) AS closed_by_expiry FROM scope_private_grants g "
        f"WHERE g.scope_id = ANY($1::text[]) AND g.owner_member_id = ANY($2::text[]) "
        f"UNION ALL "
        f"SELECT 'collaborator', p.id, e.owner_member_id, p.member_id, e.scope_id, p.effective_from_global_seq, "
        f"p.effective_to_global_seq, p.expires_at, ({CLOSED_BY_EXPIRY['collaborator'].format(row='p')}) "
        f"FROM scope_executions e "
        "JOIN task_scope_participant_metadata p ON p.owner_scope_execution_id = e.id "
        "WHERE e.scope_id = ANY($1::text[]) AND e.owner_member_id = ANY($2::text[])",
        chain, owners,
    )
    return ScopeAuthority.of(
        AuthorityWindow(r["kind"], r["id"], r["owner_member_id"], r["author"], r["scope_id"],
                        r["effective_from_global_seq"], r["effective_to_global_seq"], r["expires_at"],
                        r["closed_by_expiry"])
        for r in rows)
