"""The one writer of private authority (scope-model.md §3.5; collaborator-policy.md
§3, §6, §8): private grants, Scope Executions, People collaborators and their
cold audit and notification rows.  It reads only the rows it is about to change
(owner-bounded lists live in storage/visibility/collaborators.py).

Windows are in workspace_global_seq (SPEC §5.7).  Every change first reads the
workspace counter row FOR SHARE: the lock is held until commit, so no message
of the workspace is numbered between that read and this commit.  A window that
opens starts at the counter + 1 (the first message committed after it); one that
closes ends at the counter (the last message committed before it).  Nothing is
moved backwards: revocation, removal, leave and expiry are never retroactive.
The counter is always read before any authority row is locked, in every
function here, so these writers never wait on each other in opposite orders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from storage import tenancy
from storage.errors import Conflict, NotFound
from storage.ids import new_id
from storage.visibility.collaborators import COLLABORATOR_COLUMNS, COLLABORATOR_FROM, GRANT_COLUMNS
from storage.visibility.predicate import EXPIRY_SWEEP_MARGIN_SECONDS

# What a collaborator's row says about how it ended (CollaboratorInfo.end_reason).
END_REMOVED, END_LEFT, END_EXPIRED = "removed", "left", "expired"


@dataclass(frozen=True)
class CollaboratorChange:
    """A committed collaborator change: the row after it, and the notification
    job an add queued (delivered after commit)."""

    change: str  # add | remove | leave | expire | update_expiry
    collaborator: asyncpg.Record
    notification_job_id: str | None = None


async def _global_seq_for_share(conn: asyncpg.Connection, workspace_id: str) -> int:
    """The workspace's latest global seq, its counter row locked FOR SHARE until commit."""
    value = await conn.fetchval(
        "SELECT latest_global_seq FROM workspace_message_counters WHERE workspace_id = $1 FOR SHARE", workspace_id)
    return value or 0


async def database_now(conn: asyncpg.Connection) -> datetime:
    """The transaction's clock, which stamps created_at / added_at."""
    return await conn.fetchval("SELECT now()")


# --- Scope Executions ----------------------------------------------------------------------------

async def ensure_execution(conn: asyncpg.Connection, workspace_id: str, owner_member_id: str, scope_id: str,
                           scope_type: str, trigger: str) -> str:
    """The owner's Scope Execution on the scope, created by this call if it is the
    first (`trigger`: first_collaborator | wake | owner_quote).  Only writes that
    need one call this; reads never create it."""
    await conn.execute(
        "INSERT INTO scope_executions (id, workspace_id, owner_member_id, scope_type, scope_id, created_trigger) "
        "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (owner_member_id, scope_type, scope_id) DO NOTHING",
        new_id("sex"), workspace_id, owner_member_id, scope_type, scope_id, trigger,
    )
    return await conn.fetchval(
        "SELECT id FROM scope_executions WHERE owner_member_id = $1 AND scope_type = $2 AND scope_id = $3",
        owner_member_id, scope_type, scope_id,
    )


# --- private grants ---------------------------------------------------------------------------------

async def _grant(conn: asyncpg.Connection, grant_id: str) -> asyncpg.Record:
    return await conn.fetchrow(f"SELECT {GRANT_COLUMNS} FROM scope_private_grants g WHERE g.id = $1", grant_id)


async def create_grant(conn: asyncpg.Connection, workspace_id: str, scope_id: str, owner: str, grantee: str,
                       expires_at: datetime | None) -> asyncpg.Record:
    """Grant `grantee` private authority for `owner`'s agents on the scope, from
    the next global seq on.  Conflict `already_granted` while one is active."""
    latest = await _global_seq_for_share(conn, workspace_id)
    # An expired grant the sweep has not closed yet still holds the live key: close it first.
    await conn.execute(
        "UPDATE scope_private_grants SET revoked_at = expires_at, effective_to_global_seq = "
        "coalesce(effective_to_global_seq, GREATEST($4::bigint, effective_from_global_seq - 1)) "
        "WHERE scope_id = $1 AND owner_member_id = $2 AND grantee_member_id = $3 AND revoked_at IS NULL "
        "AND expires_at <= now()",
        scope_id, owner, grantee, latest,
    )
    grant_id = new_id("grt")
    inserted = await conn.fetchval(
        "INSERT INTO scope_private_grants (id, workspace_id, scope_id, owner_member_id, grantee_member_id, "
        "granted_by_member_id, expires_at, effective_from_global_seq) VALUES ($1, $2, $3, $4, $5, $4, $6, $7) "
        "ON CONFLICT (scope_id, owner_member_id, grantee_member_id) WHERE revoked_at IS NULL DO NOTHING "
        "RETURNING id",
        grant_id, workspace_id, scope_id, owner, grantee, expires_at, latest + 1,
    )
    if inserted is None:
        raise Conflict("already_granted", "an active grant exists for this member here")
    return await _grant(conn, grant_id)


async def revoke_grant(conn: asyncpg.Connection, workspace_id: str, owner: str, grant_id: str) -> asyncpg.Record:
    """End the owner's grant at the current global seq (messages already inside
    it stay readable).  NotFound for anyone else's grant."""
    latest = await _global_seq_for_share(conn, workspace_id)
    row = await conn.fetchrow(
        "SELECT effective_to_global_seq, revoked_at, expires_at <= now() AS expired FROM scope_private_grants "
        "WHERE workspace_id = $1 AND id = $2 AND owner_member_id = $3 FOR UPDATE",
        workspace_id, grant_id, owner,
    )
    if row is None:
        raise NotFound("grant")
    if row["revoked_at"] is not None or row["effective_to_global_seq"] is not None or row["expired"]:
        raise Conflict("already_ended", "the grant has already ended")
    await conn.execute(
        "UPDATE scope_private_grants SET revoked_at = now(), revoked_by_member_id = owner_member_id, "
        "effective_to_global_seq = GREATEST($2::bigint, effective_from_global_seq - 1) WHERE id = $1",
        grant_id, latest,
    )
    return await _grant(conn, grant_id)


# --- People collaborators ----------------------------------------------------------------------------

async def _collaborator(conn: asyncpg.Connection, collaborator_id: str) -> asyncpg.Record:
    return await conn.fetchrow(f"SELECT {COLLABORATOR_COLUMNS} FROM {COLLABORATOR_FROM} WHERE p.id = $1",
                               collaborator_id)


async def _audit(conn: asyncpg.Connection, workspace_id: str, execution_id: str, member_id: str, event_type: str,
                 actor: str | None, payload: str = "{}") -> None:
    await conn.execute(
        "INSERT INTO task_collaborator_events (id, workspace_id, owner_scope_execution_id, member_id, event_type, "
        "actor_member_id, payload_json) VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)",
        new_id("cev"), workspace_id, execution_id, member_id, event_type, actor, payload,
    )


async def _expire_stale(conn: asyncpg.Connection, workspace_id: str, latest: int,
                        where: str, *args) -> list[asyncpg.Record]:
    """Close active rows past their expiry (matching `where`, with args from $3 on)
    at `latest`, each with an `expire` audit event."""
    expired = await conn.fetch(
        f"UPDATE task_scope_participant_metadata SET active_key = NULL, updated_at = now(), "
        f"effective_to_global_seq = GREATEST($2::bigint, effective_from_global_seq - 1) "
        f"WHERE workspace_id = $1 AND active_key IS NOT NULL AND {where} "
        f"RETURNING id, owner_scope_execution_id, member_id, expires_at",
        workspace_id, latest, *args,
    )
    for row in expired:
        await _audit(conn, workspace_id, row["owner_scope_execution_id"], row["member_id"], "expire", None)
    return expired


async def add_collaborator(conn: asyncpg.Connection, workspace_id: str, execution_id: str, member_id: str,
                           added_by: str, expires_at: datetime | None) -> CollaboratorChange:
    """Add a People collaborator on the execution from the next global seq on:
    one row, one `add` audit event, one queued `collaborator_added`
    notification.  Conflict `already_collaborator` while one is active."""
    latest = await _global_seq_for_share(conn, workspace_id)
    await _expire_stale(conn, workspace_id, latest, "owner_scope_execution_id = $3 AND member_id = $4 "
                        "AND expires_at <= now()", execution_id, member_id)
    collaborator_id = new_id("col")
    inserted = await conn.fetchval(
        "INSERT INTO task_scope_participant_metadata (id, workspace_id, owner_scope_execution_id, member_id, "
        "added_by_member_id, expires_at, effective_from_global_seq, active_key) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $4) "
        "ON CONFLICT (owner_scope_execution_id, active_key) DO NOTHING RETURNING id",
        collaborator_id, workspace_id, execution_id, member_id, added_by, expires_at, latest + 1,
    )
    if inserted is None:
        raise Conflict("already_collaborator", "this member is already an active collaborator here")
    await _audit(conn, workspace_id, execution_id, member_id, "add", added_by)
    job_id = new_id("cnj")
    await conn.execute(
        "INSERT INTO task_collaborator_notification_jobs (id, workspace_id, owner_scope_execution_id, member_id, "
        "notification_type) VALUES ($1, $2, $3, $4, 'collaborator_added')",
        job_id, workspace_id, execution_id, member_id,
    )
    return CollaboratorChange("add", await _collaborator(conn, collaborator_id), job_id)


async def _locked_active(conn: asyncpg.Connection, workspace_id: str, collaborator_id: str,
                         party: str, party_column: str) -> asyncpg.Record:
    """The collaborator row, locked, if `party` is its owner (party_column
    'e.owner_member_id') or its member ('p.member_id'); Conflict once ended."""
    row = await conn.fetchrow(
        f"SELECT p.owner_scope_execution_id, p.member_id, p.active_key IS NOT NULL AND (p.expires_at IS NULL "
        f"OR p.expires_at > now()) AS active FROM {COLLABORATOR_FROM} "
        f"WHERE p.workspace_id = $1 AND p.id = $2 AND {party_column} = $3 FOR UPDATE OF p",
        workspace_id, collaborator_id, party,
    )
    if row is None:
        raise NotFound("collaborator")
    if not row["active"]:
        raise Conflict("already_ended", "the collaborator has already ended")
    return row


async def end_collaborator(conn: asyncpg.Connection, workspace_id: str, collaborator_id: str, caller: str,
                           how: str) -> CollaboratorChange:
    """`remove` (by the owner) or `leave` (by the collaborator) at the current
    global seq.  NotFound for anyone else."""
    latest = await _global_seq_for_share(conn, workspace_id)
    row = await _locked_active(conn, workspace_id, collaborator_id, caller,
                               "e.owner_member_id" if how == "remove" else "p.member_id")
    ended_column = "removed_at" if how == "remove" else "left_at"
    await conn.execute(
        f"UPDATE task_scope_participant_metadata SET active_key = NULL, {ended_column} = now(), updated_at = now(), "
        f"effective_to_global_seq = GREATEST($2::bigint, effective_from_global_seq - 1) WHERE id = $1",
        collaborator_id, latest,
    )
    await _audit(conn, workspace_id, row["owner_scope_execution_id"], row["member_id"], how, caller)
    return CollaboratorChange(how, await _collaborator(conn, collaborator_id))


async def update_collaborator_expiry(conn: asyncpg.Connection, workspace_id: str, collaborator_id: str,
                                     owner: str, expires_at: datetime | None) -> CollaboratorChange:
    """Move (or clear) an active collaborator's expiry; the window's start stays."""
    await _global_seq_for_share(conn, workspace_id)
    row = await _locked_active(conn, workspace_id, collaborator_id, owner, "e.owner_member_id")
    await conn.execute(
        "UPDATE task_scope_participant_metadata SET expires_at = $2, updated_at = now() WHERE id = $1",
        collaborator_id, expires_at,
    )
    await _audit(conn, workspace_id, row["owner_scope_execution_id"], row["member_id"], "update_expiry", owner,
                 json.dumps({"expires_at": expires_at.isoformat() if expires_at is not None else None}))
    return CollaboratorChange("update_expiry", await _collaborator(conn, collaborator_id))


# --- expiry and notifications ---------------------------------------------------------------------------

async def expire_due(conn: asyncpg.Connection, now: datetime) -> list[CollaboratorChange]:
    """Close every grant and collaborator that expired at least
    EXPIRY_SWEEP_MARGIN_SECONDS before `now`, recording the workspace's current
    global seq as the window's upper bound (after the margin no transaction that
    began before the expiry is still numbering, so the bound is exact; reads
    test created_at < expires_at anyway).  Returns the collaborators it expired
    (each got an `expire` audit event)."""
    now = now - timedelta(seconds=EXPIRY_SWEEP_MARGIN_SECONDS)
    workspaces = [r["workspace_id"] for r in await conn.fetch(
        "SELECT workspace_id FROM scope_private_grants WHERE revoked_at IS NULL AND effective_to_global_seq IS NULL "
        "AND expires_at <= $1 UNION SELECT workspace_id FROM task_scope_participant_metadata "
        "WHERE active_key IS NOT NULL AND expires_at <= $1 ORDER BY 1",
        now)]
    changes: list[CollaboratorChange] = []
    for workspace_id in workspaces:
        # A fenced workspace is not written; reads stay exact by created_at < expires_at meanwhile.
        fence = await tenancy.execution_state_for_share(conn, workspace_id)
        if fence["write_fenced"] or fence["state"] not in tenancy.WRITABLE_STATES:
            continue
        latest = await _global_seq_for_share(conn, workspace_id)
        await conn.execute(
            "UPDATE scope_private_grants SET revoked_at = expires_at, "
            "effective_to_global_seq = GREATEST($2::bigint, effective_from_global_seq - 1) "
            "WHERE workspace_id = $1 AND revoked_at IS NULL AND effective_to_global_seq IS NULL AND expires_at <= $3",
            workspace_id, latest, now,
        )
        for row in await _expire_stale(conn, workspace_id, latest, "expires_at <= $3", now):
            changes.append(CollaboratorChange("expire", await _collaborator(conn, row["id"])))
    return changes


async def pending_notifications(conn: asyncpg.Connection, queued_before: datetime) -> list[asyncpg.Record]:
    """Notification jobs still pending that were queued before `queued_before`
    (the commit-to-delivery step did not finish), with the collaborator row each
    announces (the newest of its pair)."""
    return await conn.fetch(
        f"SELECT j.id AS job_id, c.* FROM task_collaborator_notification_jobs j "
        f"CROSS JOIN LATERAL (SELECT {COLLABORATOR_COLUMNS} FROM {COLLABORATOR_FROM} "
        f"WHERE p.workspace_id = j.workspace_id AND p.owner_scope_execution_id = j.owner_scope_execution_id "
        f"AND p.member_id = j.member_id ORDER BY p.added_at DESC, p.id DESC LIMIT 1) c "
        f"WHERE j.state = 'pending' AND j.queued_at < $1 ORDER BY j.queued_at LIMIT 500",
        queued_before,
    )


async def mark_notification_delivered(conn: asyncpg.Connection, job_id: str) -> bool:
    """Mark a job delivered (False: it was not pending any more)."""
    done = await conn.execute(
        "UPDATE task_collaborator_notification_jobs SET state = 'delivered', delivered_at = now(), "
        "updated_at = now() WHERE id = $1 AND state = 'pending'",
        job_id,
    )
    return done == "UPDATE 1"
