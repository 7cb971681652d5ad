"""Owner-bounded reads of private grants and People collaborators: what an
owner lists and manages (collaborator-policy.md §7.5).  Every query here is
bounded by the calling owner (or, to route a leave, by the collaborator
itself): no query takes another owner's id, so a workspace owner or admin
cannot enumerate anyone else's collaborators."""

from __future__ import annotations

import asyncpg

# A grant as GrantInfo shows it; `active` is "active now" (model: not ended, not expired).
GRANT_COLUMNS = (
    "g.id, g.scope_id, g.owner_member_id, g.grantee_member_id, g.granted_by_member_id, g.created_at, "
    "g.expires_at, g.revoked_at, g.effective_from_global_seq, g.effective_to_global_seq, "
    "(g.effective_to_global_seq IS NULL AND (g.expires_at IS NULL OR g.expires_at > now())) AS active"
)

# A People collaborator as CollaboratorInfo shows it, with its execution's scope and owner.
COLLABORATOR_COLUMNS = (
    "p.id, p.workspace_id, p.owner_scope_execution_id AS execution_id, e.owner_member_id, e.scope_id, "
    "e.scope_type, p.member_id, p.added_by_member_id, p.added_at, p.expires_at, p.left_at, p.removed_at, "
    "p.effective_from_global_seq, p.effective_to_global_seq, "
    "(p.active_key IS NOT NULL AND (p.expires_at IS NULL OR p.expires_at > now())) AS active"
)
COLLABORATOR_FROM = (
    "task_scope_participant_metadata p JOIN scope_executions e "
    "ON e.workspace_id = p.workspace_id AND e.id = p.owner_scope_execution_id"
)


async def owned_grant_scope(conn: asyncpg.Connection, workspace_id: str, owner: str, grant_id: str) -> str | None:
    """The scope of the caller's own grant (None for anyone else's: never revealed)."""
    return await conn.fetchval(
        "SELECT scope_id FROM scope_private_grants WHERE workspace_id = $1 AND id = $2 AND owner_member_id = $3",
        workspace_id, grant_id, owner,
    )


async def collaborator_route(conn: asyncpg.Connection, workspace_id: str, collaborator_id: str,
                             caller: str) -> asyncpg.Record | None:
    """Scope, owner and member of a collaborator row the caller is party to (as
    its owner or as the collaborator); None otherwise."""
    return await conn.fetchrow(
        f"SELECT e.scope_id, e.owner_member_id, p.member_id FROM {COLLABORATOR_FROM} "
        f"WHERE p.workspace_id = $1 AND p.id = $2 AND (e.owner_member_id = $3 OR p.member_id = $3)",
        workspace_id, collaborator_id, caller,
    )


async def owner_grants(conn: asyncpg.Connection, workspace_id: str, owner: str, scope_id: str | None,
                       include_ended: bool) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {GRANT_COLUMNS} FROM scope_private_grants g WHERE g.workspace_id = $1 AND g.owner_member_id = $2 "
        f"AND ($3::text IS NULL OR g.scope_id = $3) AND ($4 OR (g.effective_to_global_seq IS NULL "
        f"AND (g.expires_at IS NULL OR g.expires_at > now()))) ORDER BY g.created_at, g.id",
        workspace_id, owner, scope_id, include_ended,
    )


async def owner_collaborators(conn: asyncpg.Connection, workspace_id: str, owner: str, scope_ids: list[str],
                              include_ended: bool) -> list[asyncpg.Record]:
    """The owner's collaborator rows on the executions of `scope_ids` (a scope
    and, for a thread, its parent: the effective set is their union)."""
    return await conn.fetch(
        f"SELECT {COLLABORATOR_COLUMNS} FROM {COLLABORATOR_FROM} WHERE e.workspace_id = $1 "
        f"AND e.owner_member_id = $2 AND e.scope_id = ANY($3::text[]) AND ($4 OR (p.active_key IS NOT NULL "
        f"AND (p.expires_at IS NULL OR p.expires_at > now()))) ORDER BY p.added_at, p.id",
        workspace_id, owner, scope_ids, include_ended,
    )


async def owner_overview(conn: asyncpg.Connection, workspace_id: str, owner: str,
                         include_ended: bool) -> list[asyncpg.Record]:
    """Every collaborator row of the owner, with the person's / app's identity,
    ordered by person then scene (the aggregated page groups them)."""
    return await conn.fetch(
        f"SELECT {COLLABORATOR_COLUMNS}, mem.handle, mem.display_name, mem.kind FROM {COLLABORATOR_FROM} "
        f"JOIN members mem ON mem.workspace_id = p.workspace_id AND mem.id = p.member_id "
        f"WHERE e.workspace_id = $1 AND e.owner_member_id = $2 AND ($3 OR (p.active_key IS NOT NULL "
        f"AND (p.expires_at IS NULL OR p.expires_at > now()))) ORDER BY mem.handle, p.member_id, p.added_at, p.id",
        workspace_id, owner, include_ended,
    )
