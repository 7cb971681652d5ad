"""A human joining, re-joining or leaving a workspace, as service accounts see
it (service-account.md §2.6, §3.3), written in the same transaction as the
membership change itself (storage/tenancy.py):

- the change is numbered in the workspace's `human_lifecycle_seq` and recorded
  in `workspace_human_lifecycle_events`, and every service account of the
  workspace gets that seq as its `audience_policy_version`: the audience
  reconciler applies the event to each account's membership (O(changed
  members), never a rescan);
- a departing human loses their manager assignments; an account left with no
  manager gets the workspace's longest-standing active owner (the seed's
  "at least one manager" invariant), audited.

The audit writer lives here too: every service-account module records through it.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from domain.service_accounts import LifecycleChange, ManagerChange
from storage.ids import new_id

# NOTIFY'd (payload: the workspace id) by every change an audience reconciler must apply.
AUDIENCE_CHANNEL = "scopewire_service_audience"


_AUDIT_COLUMNS = (
    "id, workspace_id, service_account_id, subject_type, subject_id, subject_version, action, actor_type, "
    "actor_member_id, permission_basis, caused_by_member_id, execution_member_id, durable_author_member_id, "
    "byline_member_id, message_id, message_version, correlation_id, before_digest, after_digest, comment, details"
)


def audit_insert_sql(first: int) -> str:
    """The audit insert with its 21 values numbered from `$first` (so another statement can carry it)."""
    values = ", ".join(f"${n}" for n in range(first, first + 20))
    return f"INSERT INTO service_account_audit_events ({_AUDIT_COLUMNS}) VALUES ({values}, ${first + 20}::jsonb)"


def audit_row(*, workspace_id: str, service_account_id: str | None, subject_type: str, subject_id: str,
              subject_version: int | None, action: str, actor_type: str, actor_member_id: str | None,
              permission_basis: str, correlation_id: str, caused_by_member_id: str | None = None,
              execution_member_id: str | None = None, durable_author_member_id: str | None = None,
              byline_member_id: str | None = None, message_id: str | None = None,
              message_version: int | None = None, before_digest: str | None = None,
              after_digest: str | None = None, comment: str | None = None,
              details: dict[str, Any] | None = None) -> tuple:
    """One audit event's values, in audit_insert_sql's order (its id first)."""
    return (new_id("sae"), workspace_id, service_account_id, subject_type, subject_id, subject_version, action,
            actor_type, actor_member_id, permission_basis, caused_by_member_id, execution_member_id,
            durable_author_member_id, byline_member_id, message_id, message_version, correlation_id,
            before_digest, after_digest, comment, json.dumps(details or {}))


async def record_audit(conn: asyncpg.Connection, **event: Any) -> str:
    """One audit event (audit_row's fields), in the caller's transaction."""
    row = audit_row(**event)
    await conn.execute(audit_insert_sql(1), *row)
    return row[0]


async def lock_workspace_policy(conn: asyncpg.Connection, workspace_id: str) -> asyncpg.Record:
    """The workspace's policy row (created on first use), locked until commit."""
    await conn.execute(
        "INSERT INTO service_account_workspace_policies (workspace_id) VALUES ($1) ON CONFLICT DO NOTHING",
        workspace_id,
    )
    return await conn.fetchrow(
        "SELECT creation_policy, version, human_lifecycle_seq FROM service_account_workspace_policies "
        "WHERE workspace_id = $1 FOR UPDATE",
        workspace_id,
    )


async def record_human_lifecycle(conn: asyncpg.Connection, workspace_id: str, member_id: str,
                                 action: str) -> LifecycleChange:
    """Number the change, move every account's audience policy to it and, when
    the human leaves, end their manager assignments."""
    policy = await lock_workspace_policy(conn, workspace_id)
    seq = policy["human_lifecycle_seq"] + 1
    await conn.execute(
        "UPDATE service_account_workspace_policies SET human_lifecycle_seq = $2 WHERE workspace_id = $1",
        workspace_id, seq,
    )
    await conn.execute(
        "INSERT INTO workspace_human_lifecycle_events (workspace_id, lifecycle_seq, member_id, action) "
        "VALUES ($1, $2, $3, $4)",
        workspace_id, seq, member_id, action,
    )
    await conn.execute(
        "UPDATE service_accounts SET audience_policy_version = $2, updated_at = now(), "
        "audience_state = CASE WHEN audience_state = 'ready' THEN 'reconciling' ELSE audience_state END "
        "WHERE workspace_id = $1",
        workspace_id, seq,
    )
    change = LifecycleChange(seq)
    if action == "deactivated":
        change.manager_changes = await _end_manager_assignments(conn, workspace_id, member_id,
                                                                f"human_lifecycle:{workspace_id}:{seq}")
    await notify_audience(conn, workspace_id)
    return change


async def notify_audience(conn: asyncpg.Connection, workspace_id: str) -> None:
    """Wake every server's audience reconciler when this transaction commits."""
    await conn.execute("SELECT pg_notify($1, $2)", AUDIENCE_CHANNEL, workspace_id)


async def _end_manager_assignments(conn: asyncpg.Connection, workspace_id: str, member_id: str,
                                   correlation_id: str) -> list[ManagerChange]:
    changes: list[ManagerChange] = []
    ended = await conn.fetch(
        "UPDATE service_account_managers SET status = 'removed', removed_at = now(), removed_reason = 'deactivated' "
        "WHERE workspace_id = $1 AND member_id = $2 AND status = 'active' RETURNING service_account_id",
        workspace_id, member_id,
    )
    for row in ended:
        account_id = row["service_account_id"]
        version = await conn.fetchval(
            "UPDATE service_accounts SET version = version + 1, updated_at = now() WHERE id = $1 RETURNING version",
            account_id,
        )
        await record_audit(conn, workspace_id=workspace_id, service_account_id=account_id,
                           subject_type="service_account", subject_id=account_id, subject_version=version,
                           action="manager.removed", actor_type="system", actor_member_id=None,
                           permission_basis="workspace_human_lifecycle", correlation_id=correlation_id,
                           details={"member_id": member_id, "reason": "deactivated"})
        changes.append(ManagerChange(account_id, member_id, "removed", "deactivated", version))
        if await conn.fetchval("SELECT count(*) FROM service_account_managers WHERE service_account_id = $1 "
                               "AND status = 'active'", account_id):
            continue
        # Never zero managers: the longest-standing active owner takes over (an active owner always exists).
        owner = await conn.fetchval(
            "SELECT mem.id FROM workspace_memberships wm JOIN members mem ON mem.workspace_id = wm.workspace_id "
            "AND mem.workspace_membership_id = wm.id WHERE wm.workspace_id = $1 AND wm.role = 'owner' "
            "AND wm.status = 'active' AND mem.id <> $2 ORDER BY wm.joined_at, wm.id LIMIT 1",
            workspace_id, member_id,
        )
        if owner is None:
            continue  # the workspace has no other active owner: the last-owner rule forbids this removal
        await conn.execute(
            "INSERT INTO service_account_managers (id, workspace_id, service_account_id, member_id) "
            "VALUES ($1, $2, $3, $4)",
            new_id("sam"), workspace_id, account_id, owner,
        )
        await record_audit(conn, workspace_id=workspace_id, service_account_id=account_id,
                           subject_type="service_account", subject_id=account_id, subject_version=version,
                           action="manager.fallback_assigned", actor_type="system", actor_member_id=None,
                           permission_basis="manager_invariant", correlation_id=correlation_id,
                           details={"member_id": owner, "replaces_member_id": member_id})
        changes.append(ManagerChange(account_id, owner, "added", "fallback", version))
    return changes
