"""Read-only resolvers a UI needs around private agents (collaborator-policy.md
§5.1, §7.2, §8.5, §9): the lazy `@` candidate scan, the batched check of who
holds active private authority from which owners, and the per-message context
state of an owner.

Every function here is one statement, whatever the number of candidates,
owners or messages asked about, and none writes: no Scope Execution is created,
no expired grant or collaborator is cleaned up.  "Active now" is the model's:
an open window (`effective_to_global_seq IS NULL`; a collaborator's
`active_key` set) that has not expired by the database clock.
"""

from __future__ import annotations

import asyncpg

from storage.visibility.predicate import fetch_custom_plan, message_readable_sql, window_sql

# Private agents matching a prefix looked at before authorization: a hard cap
# separate from (and well above) the result size, so other owners' agents the
# viewer may not address cannot crowd out the ones it may (§5.1).
CANDIDATE_SCAN_LIMIT = 200

# Which authority row a caller is shown when several hold: the order of the
# readable predicate's rules.
RELATION_RANK = {"same_owner_agent": 0, "grant": 1, "collaborator": 2}


# Above every character a handle may hold ([a-z0-9_.-]): handles starting with
# a prefix p are exactly those in [p, p + HANDLE_CEILING) in byte order.
HANDLE_CEILING = "{"


async def private_agent_candidates(conn: asyncpg.Connection, workspace_id: str, chain: list[str], viewer: str,
                                   prefix: str) -> tuple[list[asyncpg.Record], bool]:
    """Active private agents (not the viewer) whose handle starts with `prefix`
    and who hold an open private membership in a scope of `chain`, in handle
    byte order, at most CANDIDATE_SCAN_LIMIT of them; and whether that cap cut
    the scan short.  The byte-order operators (~>=~, ~<~) walk
    members_private_agent_handle_idx as a range, in order, whatever the
    database's collation and with a generic plan too."""
    rows = await fetch_custom_plan(
        conn,
        "SELECT mem.id, mem.handle, mem.display_name, mem.owner_member_id FROM members mem "
        "WHERE mem.workspace_id = $1 AND mem.kind = 'agent' AND mem.visibility = 'private' "
        "AND mem.handle ~>=~ $4 AND mem.handle ~<~ $5 AND mem.status = 'active' AND mem.id <> $3 "
        "AND EXISTS (SELECT 1 FROM scope_memberships sm WHERE sm.scope_id = ANY($2::text[]) "
        "AND sm.member_id = mem.id AND sm.effective_to_seq IS NULL AND sm.visibility = 'private') "
        "ORDER BY mem.handle USING ~<~ LIMIT $6",
        workspace_id, chain, viewer, prefix, prefix + HANDLE_CEILING, CANDIDATE_SCAN_LIMIT + 1,
    )
    return rows[:CANDIDATE_SCAN_LIMIT], len(rows) > CANDIDATE_SCAN_LIMIT


async def active_authority(conn: asyncpg.Connection, workspace_id: str, chain: list[str], member_id: str,
                           owners: list[str]) -> list[asyncpg.Record]:
    """Every active-now grant to `member_id` and People collaborator role of
    `member_id` from any of `owners`, on a scope of `chain`: rows of (relation,
    owner_member_id, scope_id, ref_id, expires_at).  One statement for any
    number of owners."""
    return await conn.fetch(
        "SELECT 'grant' AS relation, g.owner_member_id, g.scope_id, g.id AS ref_id, g.expires_at "
        "FROM scope_private_grants g WHERE g.workspace_id = $1 AND g.scope_id = ANY($2::text[]) "
        "AND g.owner_member_id = ANY($4::text[]) AND g.grantee_member_id = $3 AND g.revoked_at IS NULL "
        "AND g.effective_to_global_seq IS NULL AND (g.expires_at IS NULL OR g.expires_at > now()) "
        "UNION ALL "
        "SELECT 'collaborator', e.owner_member_id, e.scope_id, p.id, p.expires_at FROM scope_executions e "
        "JOIN task_scope_participant_metadata p ON p.owner_scope_execution_id = e.id "
        "WHERE e.workspace_id = $1 AND e.scope_id = ANY($2::text[]) AND e.owner_member_id = ANY($4::text[]) "
        "AND p.member_id = $3 AND p.active_key IS NOT NULL AND (p.expires_at IS NULL OR p.expires_at > now())",
        workspace_id, chain, member_id, owners,
    )


async def contribution_relations(conn: asyncpg.Connection, workspace_id: str, chain: list[str], viewer: str,
                                 owner: str) -> list[asyncpg.Record]:
    """What lets `viewer` contribute to and wake `owner`'s private agents in
    chain[0]: being another private agent of that owner with an open private
    membership there (`same_owner_agent`), or an active-now grant / collaborator
    role on the chain.  Same row shape as active_authority; one statement."""
    return await conn.fetch(
        "SELECT 'same_owner_agent' AS relation, sm.owner_member_id, sm.scope_id, NULL::text AS ref_id, "
        "NULL::timestamptz AS expires_at FROM scope_memberships sm WHERE sm.workspace_id = $1 "
        "AND sm.scope_id = ($2::text[])[1] AND sm.member_id = $3 AND sm.effective_to_seq IS NULL "
        "AND sm.visibility = 'private' AND sm.owner_member_id = $4 "
        "UNION ALL "
        "SELECT 'grant', g.owner_member_id, g.scope_id, g.id, g.expires_at FROM scope_private_grants g "
        "WHERE g.workspace_id = $1 AND g.scope_id = ANY($2::text[]) AND g.owner_member_id = $4 "
        "AND g.grantee_member_id = $3 AND g.revoked_at IS NULL AND g.effective_to_global_seq IS NULL "
        "AND (g.expires_at IS NULL OR g.expires_at > now()) "
        "UNION ALL "
        "SELECT 'collaborator', e.owner_member_id, e.scope_id, p.id, p.expires_at FROM scope_executions e "
        "JOIN task_scope_participant_metadata p ON p.owner_scope_execution_id = e.id "
        "WHERE e.workspace_id = $1 AND e.scope_id = ANY($2::text[]) AND e.owner_member_id = $4 "
        "AND p.member_id = $3 AND p.active_key IS NOT NULL AND (p.expires_at IS NULL OR p.expires_at > now())",
        workspace_id, chain, viewer, owner,
    )


async def message_context_states(conn: asyncpg.Connection, workspace_id: str, chain: list[str], owner: str,
                                 message_ids: list[str]) -> list[asyncpg.Record]:
    """For each of `message_ids` that is a message of chain[0]: whether `owner`
    may read it (`readable_reason`, the readable predicate's reason or NULL) and
    what makes it context for the owner's private agents there — the author is
    the owner or one of its private agents (`own_relation`), the author wrote
    inside one of the owner's grant / collaborator windows on the chain (the
    readable predicate's window test: global seq inside the window, created
    before it expires), or the owner shared it as an owner_quote anywhere.
    One statement for any number of ids."""
    return await conn.fetch(
        f"SELECT m.id, m.state, {message_readable_sql('m', '$4')} AS readable_reason, "
        "CASE WHEN m.author_member_id = $4 THEN 'owner' WHEN a.kind = 'agent' AND a.visibility = 'private' "
        "AND a.owner_member_id = $4 THEN 'own_agent' END AS own_relation, "
        "g.id AS grant_id, g.scope_id AS grant_scope_id, c.id AS collaborator_id, "
        "c.scope_id AS collaborator_scope_id, q.id AS quote_id, q.scope_id AS quote_scope_id "
        "FROM scope_messages m JOIN members a ON a.workspace_id = m.workspace_id AND a.id = m.author_member_id "
        "LEFT JOIN LATERAL (SELECT g.id, g.scope_id FROM scope_private_grants g "
        "WHERE g.scope_id = ANY($2::text[]) AND g.owner_member_id = $4 AND g.grantee_member_id = m.author_member_id "
        f"AND {window_sql('g', 'm', 'grant')} "
        "ORDER BY array_position($2::text[], g.scope_id), g.effective_from_global_seq LIMIT 1) g ON true "
        "LEFT JOIN LATERAL (SELECT p.id, e.scope_id FROM scope_executions e "
        "JOIN task_scope_participant_metadata p ON p.owner_scope_execution_id = e.id "
        "WHERE e.scope_id = ANY($2::text[]) AND e.owner_member_id = $4 AND p.member_id = m.author_member_id "
        f"AND {window_sql('p', 'm', 'collaborator')} "
        "ORDER BY array_position($2::text[], e.scope_id), p.effective_from_global_seq LIMIT 1) c ON true "
        "LEFT JOIN LATERAL (SELECT q.id, q.scope_id FROM scope_message_sources src "
        "JOIN scope_messages q ON q.scope_id = src.target_scope_id AND q.id = src.message_id "
        "WHERE src.workspace_id = $1 AND src.source_message_id = m.id AND src.source_kind = 'owner_quote' "
        "AND q.author_member_id = $4 ORDER BY q.workspace_global_seq LIMIT 1) q ON true "
        "WHERE m.workspace_id = $1 AND m.scope_id = ($2::text[])[1] AND m.id = ANY($3::text[])",
        workspace_id, chain, message_ids, owner,
    )
