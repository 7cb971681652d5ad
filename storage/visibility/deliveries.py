"""The handout re-check of routed deliveries (scope-model.md §3.10: right before a
wake, check again that its message and authority still stand; SPEC §5 decision 3)."""

from __future__ import annotations

import asyncpg

from storage.visibility.predicate import _chain, fetch_generic_plan, message_visibility_sql, scope_readable_sql


def _active_authority_sql(owner: str, waker: str, message: str) -> str:
    """Does `waker` hold, right now, an open grant or People collaborator window of
    `owner` on `message`'s chain?  A revoke, removal, leave or expiry since the
    commit makes it false: the wake is suppressed, the message stays readable."""
    return (
        f"(EXISTS (SELECT 1 FROM scope_private_grants g WHERE g.scope_id IN {_chain(message)} "
        f"AND g.owner_member_id = {owner} AND g.grantee_member_id = {waker} AND g.effective_to_global_seq IS NULL "
        f"AND (g.expires_at IS NULL OR g.expires_at > now())) "
        f"OR EXISTS (SELECT 1 FROM scope_executions e JOIN task_scope_participant_metadata p "
        f"ON p.owner_scope_execution_id = e.id WHERE e.scope_id IN {_chain(message)} AND e.owner_member_id = {owner} "
        f"AND p.member_id = {waker} AND p.effective_to_global_seq IS NULL AND p.left_at IS NULL "
        f"AND p.removed_at IS NULL AND (p.expires_at IS NULL OR p.expires_at > now())))"
    )


async def handout_verdicts(conn: asyncpg.Connection, delivery_ids: list[str]) -> dict[str, str | None]:
    """For each delivery: None when it may be handed out now, else why not
    (`message_withdrawn`, `not_readable`, `authority_revoked`).  The recipient
    must read the message under the readable predicate; a private agent's waker
    (the author, or for an activity its actor) must still hold the authority the
    delivery was routed by."""
    rows = await conn.fetch(
        f"""
        SELECT d.id, m.state,
               -- A message-less activity (a strand assignment): the recipient must still read its scope.
               CASE WHEN d.message_id IS NULL THEN {scope_readable_sql('d.scope_id', 'd.recipient_member_id', by_id=True)}
                    ELSE {message_visibility_sql('m', 'd.recipient_member_id')} IS NOT NULL END AS readable,
               CASE WHEN d.message_id IS NOT NULL AND d.authority IN ('grant', 'collaborator') THEN
                    {_active_authority_sql('rm.owner_member_id', 'coalesce(a.actor_member_id, m.author_member_id)', 'm')}
                    ELSE true END AS authorized
        FROM scope_targeted_deliveries d
        LEFT JOIN scope_messages m ON m.scope_id = d.scope_id AND m.id = d.message_id
        JOIN members rm ON rm.workspace_id = d.workspace_id AND rm.id = d.recipient_member_id
        LEFT JOIN scope_activity_events a ON a.id = d.activity_event_id
        WHERE d.id = ANY($1::text[])
        """,
        delivery_ids,
    )
    verdicts: dict[str, str | None] = {delivery_id: "not_readable" for delivery_id in delivery_ids}
    for row in rows:
        if row["state"] == "withdrawn":
            verdicts[row["id"]] = "message_withdrawn"
        elif not row["readable"]:
            verdicts[row["id"]] = "not_readable"
        elif not row["authorized"]:
            verdicts[row["id"]] = "authority_revoked"
        else:
            verdicts[row["id"]] = None
    return verdicts


async def readable_messages(conn: asyncpg.Connection, viewer: str, message_ids: list[str]) -> dict[str, asyncpg.Record]:
    """Those of `message_ids` that `viewer` reads now (a feed listing shows nothing else), withdrawn ones blank."""
    if not message_ids:
        return {}
    rows = await fetch_generic_plan(
        conn,
        f"SELECT m.id, m.workspace_id, m.scope_id, m.seq, m.workspace_global_seq, m.author_member_id, m.author_type, "
        f"m.message_type, CASE WHEN m.state = 'withdrawn' THEN '' ELSE m.content END AS content, "
        f"CASE WHEN m.state = 'withdrawn' THEN '{{}}'::jsonb ELSE m.metadata END AS metadata, m.client_message_id, "
        f"m.created_at, m.revision, m.state FROM scope_messages m "
        f"WHERE m.id = ANY($2::text[]) AND {message_visibility_sql('m', '$1')} IS NOT NULL",
        viewer, message_ids,
    )
    return {r["id"]: r for r in rows}


async def readable_scopes(conn: asyncpg.Connection, viewer: str, scope_ids: list[str]) -> set[str]:
    """Those of `scope_ids` that `viewer` may use now."""
    if not scope_ids:
        return set()
    rows = await conn.fetch(f"SELECT s.id FROM scopes s WHERE s.id = ANY($2::text[]) AND {scope_readable_sql('s', '$1')}",
                            viewer, scope_ids)
    return {r["id"] for r in rows}
