"""All SQL of workspace service accounts (service-account.md §2, §3, §7):
the Service Actor substrate, accounts and their names, create requests and
approvals, approval cards, managers, audience reconcile steps, shared pins,
the audit trail and permanent delete.

Lock order, the same in every transaction that takes more than one: create
request → approval instance → name namespace → account.  Memberships of an
account's scope are written by its scope actor only (actors/service_accounts.py
hands it what a reconcile step computes here).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec

from domain.platform import PLATFORM_CHANNEL
from domain.service_accounts import (APPROVALS_SLUG, MESSAGE_WRITE, SERVICE_ACCOUNT_SLUG, identity_key, normalize_name,
                                     target_id)
from storage import applier, deliveries, human_lifecycle, visibility
from storage.errors import Conflict, NotFound
from storage.human_lifecycle import record_audit
from storage.ids import new_id

_canonical = msgspec.json.Encoder(order="sorted")

CANCELLABLE_STATES = ("submitted", "awaiting_authorization", "action_required")


class AlreadyMaterialized(Conflict):
    """A cancel after the request created its account: the account is the resource to govern now."""

    def __init__(self, service_account_id: str) -> None:
        super().__init__("create_request_already_materialized", "the request already created its account")
        self.service_account_id = service_account_id


def payload_digest(payload: dict[str, Any]) -> bytes:
    return hashlib.sha256(_canonical.encode(payload)).digest()


async def hold_workspace(conn: asyncpg.Connection, workspace_id: str) -> None:
    """Key-share the workspace row before locking any account or policy row.  A human's
    removal locks the workspace row first and then the workspace's accounts
    (storage/human_lifecycle.py); a transaction that locked an account first would
    then need the workspace row for any row it inserts (a foreign key to it) and
    deadlock against the removal.  Taking the workspace first keeps one order."""
    await conn.execute("SELECT 1 FROM workspaces WHERE id = $1 FOR KEY SHARE", workspace_id)


# --- the Service Actor substrate ------------------------------------------------------------------------

async def registration(conn: asyncpg.Connection, slug: str) -> tuple[str, str]:
    """The shared registration `slug` and its message.write capability (schema version 11 registers
    both built-ins; only read here, so no create or provisioning transaction writes a shared row)."""
    row = await conn.fetchrow(
        "SELECT d.id, c.id AS capability_id FROM service_definitions d JOIN service_capabilities c "
        "ON c.service_definition_id = d.id AND c.capability = $2 WHERE d.slug = $1",
        slug, MESSAGE_WRITE,
    )
    return row["id"], row["capability_id"]


def _handles(name: str, member_id: str) -> tuple[str, str]:
    """A service member's handle: its name's ASCII words and a piece of its own id, so it never
    waits on a handle another transaction is inserting; the whole id if even that is taken."""
    base = "".join(c if c.isascii() and c.isalnum() else "-" for c in name.casefold())
    base = "-".join(part for part in base.split("-") if part)[:40].strip("-") or "service"
    body = member_id.split("_", 1)[1]
    return f"{base}-{body[-6:]}", f"{base}-{body}"


async def install_named(conn: asyncpg.Connection, workspace_id: str, definition_id: str, capability_id: str,
                   instance_key: str, name: str) -> tuple[str, str, str]:
    """A named installation with its service member (a `members` row of kind service) and a live
    message.write grant.  Returns (installation id, service member id, author member id)."""
    installation_id, service_member_id, member_id = new_id("sin"), new_id("ssm"), new_id("mem")
    await conn.execute(
        "INSERT INTO service_installations (id, workspace_id, service_definition_id, instance_key) "
        "VALUES ($1, $2, $3, $4)",
        installation_id, workspace_id, definition_id, instance_key,
    )
    short, full = _handles(name, member_id)
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO members (id, workspace_id, kind, handle, display_name) "
                "VALUES ($1, $2, 'service', $3, $4)",
                member_id, workspace_id, short, name,
            )
    except asyncpg.UniqueViolationError:
        await conn.execute(
            "INSERT INTO members (id, workspace_id, kind, handle, display_name) VALUES ($1, $2, 'service', $3, $4)",
            member_id, workspace_id, full, name,
        )
    await conn.execute(
        "INSERT INTO service_members (id, workspace_id, service_installation_id, member_id, display_name) "
        "VALUES ($1, $2, $3, $4, $5)",
        service_member_id, workspace_id, installation_id, member_id, name,
    )
    await conn.execute(
        "INSERT INTO service_grants (id, workspace_id, service_installation_id, service_capability_id) "
        "VALUES ($1, $2, $3, $4)",
        new_id("sgr"), workspace_id, installation_id, capability_id,
    )
    return installation_id, service_member_id, member_id


async def approvals_app_member(conn: asyncpg.Connection, workspace_id: str) -> str:
    """The built-in Approvals app's author member in this workspace (installed on first use)."""
    definition_id, capability_id = await registration(conn, APPROVALS_SLUG)
    existing = await conn.fetchval(
        "SELECT sm.member_id FROM service_installations i JOIN service_members sm ON sm.service_installation_id = i.id "
        "WHERE i.service_definition_id = $1 AND i.workspace_id = $2 AND i.instance_key = 'workspace'",
        definition_id, workspace_id,
    )
    if existing is not None:
        return existing
    async with conn.transaction():  # a concurrent first use: the loser reads the winner's
        try:
            _, _, member_id = await install_named(conn, workspace_id, definition_id, capability_id, "workspace",
                                             "Approvals")
            return member_id
        except asyncpg.UniqueViolationError:
            pass
    return await approvals_app_member(conn, workspace_id)


# --- names ------------------------------------------------------------------------------------------------

async def _claim_name(conn: asyncpg.Connection, workspace_id: str, normalized: str) -> None:
    """Lock the name's namespace row; refuse a name a platform account owns or this workspace claims."""
    # Insert-or-lock in one statement: a concurrent delete of the row cannot slip in between.
    owner = await conn.fetchrow(
        "INSERT INTO service_account_name_namespaces (normalized_name) VALUES ($1) ON CONFLICT (normalized_name) "
        "DO UPDATE SET normalized_name = EXCLUDED.normalized_name RETURNING platform_service_account_id",
        normalized,
    )
    if owner["platform_service_account_id"] is not None or await name_taken(conn, workspace_id, normalized):
        raise Conflict("name_taken", "a service account with this name exists")


async def name_taken(conn: asyncpg.Connection, workspace_id: str, normalized: str) -> bool:
    return await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM service_account_name_claims WHERE workspace_id = $1 AND normalized_name = $2) "
        "OR EXISTS (SELECT 1 FROM service_account_name_namespaces WHERE normalized_name = $2 "
        "AND platform_service_account_id IS NOT NULL)",
        workspace_id, normalized,
    )


async def _release_name(conn: asyncpg.Connection, account_id: str, normalized: str) -> None:
    await conn.execute("DELETE FROM service_account_name_claims WHERE service_account_id = $1", account_id)
    await conn.execute(
        "DELETE FROM service_account_name_namespaces n WHERE n.normalized_name = $1 "
        "AND n.platform_service_account_id IS NULL AND NOT EXISTS "
        "(SELECT 1 FROM service_account_name_claims c WHERE c.normalized_name = n.normalized_name)",
        normalized,
    )


async def create_substrate(conn: asyncpg.Connection, workspace_id: str, account_id: str, principal_id: str,
                           name: str, created_by: str | None) -> tuple[str, str, str, str]:
    """An account's Service Actor substrate (§2.1): its named installation (instance key = the principal)
    with service member, author member and live message.write grant, its `service_account` scope, and the
    target binding of the two.  Returns (installation id, service member id, author member id, scope id)."""
    definition_id, capability_id = await registration(conn, SERVICE_ACCOUNT_SLUG)
    scope_id = new_id("scp")
    installation_id, service_member_id, author_member_id = await install_named(
        conn, workspace_id, definition_id, capability_id, principal_id, name)
    await applier.insert_scope(conn, scope_id=scope_id, workspace_id=workspace_id, type="service_account",
                               created_by=created_by or author_member_id,
                               identity_key=identity_key(workspace_id, principal_id))
    await conn.execute(
        "INSERT INTO service_target_bindings (id, workspace_id, service_definition_id, service_installation_id, "
        "service_member_id, capability, target_ref, scope_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        new_id("stb"), workspace_id, definition_id, installation_id, service_member_id, MESSAGE_WRITE,
        target_id(account_id), scope_id,
    )
    return installation_id, service_member_id, author_member_id, scope_id


# --- accounts -----------------------------------------------------------------------------------------

ACCOUNT_COLUMNS = (
    "a.id, a.principal_id, a.workspace_id, a.management_kind, a.author_member_id, a.message_scope_id, a.name, "
    "a.normalized_name, a.description, a.profile_version, a.audience_policy_version, a.effective_audience_version, "
    "a.audience_state, a.audience_scan_complete, a.audience_batches_done, a.version, a.created_by_member_id, "
    "a.created_at, a.updated_at, a.service_installation_id"
)


async def create_account(conn: asyncpg.Connection, *, workspace_id: str, creator_member_id: str, name: str,
                         description: str, correlation_id: str, permission_basis: str) -> asyncpg.Record:
    """The Workspace Account create transaction's rows (§7.3): name claim, named installation, service
    member, grant, message scope, target binding, account, first manager, audit.  The audience (the
    creator first) is opened by the scope's actor, in reconcile batches."""
    normalized = normalize_name(name)
    await hold_workspace(conn, workspace_id)
    # The lifecycle seq under the policy row's lock: a human joining concurrently either committed
    # before (the first pass sees them) or numbers its event after this account exists (and bumps it).
    lifecycle_seq = (await human_lifecycle.lock_workspace_policy(conn, workspace_id))["human_lifecycle_seq"]
    await _claim_name(conn, workspace_id, normalized)
    account_id = new_id("sac")
    installation_id, service_member_id, author_member_id, scope_id = await create_substrate(
        conn, workspace_id, account_id, account_id, name, creator_member_id)
    await conn.execute(
        "INSERT INTO service_accounts (id, principal_id, workspace_id, service_installation_id, service_member_id, "
        "author_member_id, message_scope_id, name, normalized_name, description, audience_policy_version, "
        "effective_audience_version, created_by_member_id) "
        "VALUES ($1, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $10, $11)",
        account_id, workspace_id, installation_id, service_member_id, author_member_id, scope_id, name, normalized,
        description, lifecycle_seq, creator_member_id,
    )
    await conn.execute(
        "INSERT INTO service_account_name_claims (workspace_id, normalized_name, service_account_id) "
        "VALUES ($1, $2, $3)",
        workspace_id, normalized, account_id,
    )
    await conn.execute(
        "INSERT INTO service_account_managers (id, workspace_id, service_account_id, member_id, added_by_member_id) "
        "VALUES ($1, $2, $3, $4, $4)",
        new_id("sam"), workspace_id, account_id, creator_member_id,
    )
    await human_lifecycle.notify_audience(conn, workspace_id)
    await record_audit(conn, workspace_id=workspace_id, service_account_id=account_id,
                       subject_type="service_account", subject_id=account_id, subject_version=1,
                       action="service_account.created", actor_type="human", actor_member_id=creator_member_id,
                       permission_basis=permission_basis, correlation_id=correlation_id,
                       after_digest=payload_digest({"name": name, "description": description}).hex(),
                       details={"name": name, "scope_id": scope_id, "author_member_id": author_member_id})
    return await account(conn, workspace_id, account_id)


async def account(conn: asyncpg.Connection, workspace_id: str, account_id: str, *,
                  lock: bool = False) -> asyncpg.Record:
    if lock:
        await hold_workspace(conn, workspace_id)
    row = await conn.fetchrow(
        f"SELECT {ACCOUNT_COLUMNS} FROM service_accounts a WHERE a.workspace_id = $1 AND a.id = $2"
        + (" FOR UPDATE" if lock else ""),
        workspace_id, account_id,
    )
    if row is None:
        raise NotFound("service account")
    return row


async def account_of_scope(conn: asyncpg.Connection, workspace_id: str, scope_id: str) -> asyncpg.Record:
    await hold_workspace(conn, workspace_id)
    row = await conn.fetchrow(
        f"SELECT {ACCOUNT_COLUMNS} FROM service_accounts a WHERE a.message_scope_id = $1 FOR SHARE", scope_id)
    if row is None:
        raise NotFound("service account")
    return row


async def accounts_by_scope(conn: asyncpg.Connection, scope_ids: list[str]) -> dict[str, asyncpg.Record]:
    """Profiles of the accounts owning these scopes (the Inbox and message reads attach them)."""
    if not scope_ids:
        return {}
    rows = await conn.fetch(
        f"SELECT {ACCOUNT_COLUMNS} FROM service_accounts a WHERE a.message_scope_id = ANY($1::text[])", scope_ids)
    return {r["message_scope_id"]: r for r in rows}


# Whether account `a`'s message.write grant is live (its installation's grant is active).
GRANT_LIVE = ("EXISTS (SELECT 1 FROM service_grants g WHERE g.service_installation_id = a.service_installation_id "
              "AND g.status = 'active')")


async def publish_authority(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                            member_id: str) -> asyncpg.Record:
    """For a post, edit, withdrawal or shared pin, in the actor's transaction: the
    account (row shared-locked against a concurrent delete or profile change),
    whether its message.write grant is live, and whether `member_id` is an
    active manager who is an active human (§4.1's authority, re-checked at write time)."""
    await hold_workspace(conn, workspace_id)
    row = await conn.fetchrow(
        f"SELECT {ACCOUNT_COLUMNS}, {GRANT_LIVE} AS grant_live, "
        "EXISTS (SELECT 1 FROM service_account_managers m JOIN members mem ON mem.workspace_id = m.workspace_id "
        "AND mem.id = m.member_id WHERE m.service_account_id = a.id AND m.member_id = $2 AND m.status = 'active' "
        "AND mem.status = 'active' AND mem.kind = 'human') AS is_manager "
        "FROM service_accounts a WHERE a.message_scope_id = $1 FOR SHARE OF a",
        scope_id, member_id,
    )
    if row is None:
        raise NotFound("service account")
    return row


async def is_manager(conn: asyncpg.Connection, account_id: str, member_id: str) -> bool:
    return await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM service_account_managers WHERE service_account_id = $1 AND member_id = $2 "
        "AND status = 'active')",
        account_id, member_id,
    )


async def managed_account_ids(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT service_account_id FROM service_account_managers WHERE workspace_id = $1 AND member_id = $2 "
        "AND status = 'active'",
        workspace_id, member_id,
    )
    return [r["service_account_id"] for r in rows]


async def directory(conn: asyncpg.Connection, workspace_id: str, query: str | None, after: list | None,
                    limit: int) -> list[asyncpg.Record]:
    """Profiles by normalized name, then id; `query` matches a prefix of any word of the name or
    description, ignoring case."""
    pattern = None
    if query and query.strip():
        pattern = "(^|[^[:alnum:]])" + _regex_escape(query.strip().casefold())
    return await conn.fetch(
        f"SELECT {ACCOUNT_COLUMNS} FROM service_accounts a WHERE a.workspace_id = $1 "
        "AND ($2::text IS NULL OR lower(a.name) ~ $2 OR lower(a.description) ~ $2) "
        "AND ($3::text IS NULL OR (a.normalized_name, a.id) > ($3, $4)) "
        "ORDER BY a.normalized_name, a.id LIMIT $5",
        workspace_id, pattern, *(after or (None, None)), limit + 1,
    )


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?()[]{}|\-" else c for c in text)


async def update_profile(conn: asyncpg.Connection, workspace_id: str, account_id: str, expected_version: int,
                         name: str | None, description: str | None, actor_member_id: str, basis: str,
                         correlation_id: str) -> asyncpg.Record:
    current = await account(conn, workspace_id, account_id)
    new_name = name if name is not None else current["name"]
    normalized = normalize_name(new_name)
    if normalized != current["normalized_name"]:
        await _claim_name(conn, workspace_id, normalized)  # namespace before the account: the lock order
    row = await account(conn, workspace_id, account_id, lock=True)
    if row["version"] != expected_version:
        raise Conflict("version_mismatch", f"the account is at version {row['version']}")
    new_description = description if description is not None else row["description"]
    if normalized != row["normalized_name"]:
        await _release_name(conn, account_id, row["normalized_name"])
        await conn.execute(
            "INSERT INTO service_account_name_claims (workspace_id, normalized_name, service_account_id) "
            "VALUES ($1, $2, $3)",
            workspace_id, normalized, account_id,
        )
    await conn.execute(
        "UPDATE service_accounts SET name = $2, normalized_name = $3, description = $4, version = version + 1, "
        "profile_version = profile_version + 1, updated_at = now() WHERE id = $1",
        account_id, new_name, normalized, new_description,
    )
    # The service member's display projection mirrors the one name (§2.1).
    await conn.execute("UPDATE service_members SET display_name = $2 WHERE id = (SELECT service_member_id "
                       "FROM service_accounts WHERE id = $1)", account_id, new_name)
    await conn.execute("UPDATE members SET display_name = $3, updated_at = now() WHERE workspace_id = $1 AND id = $2",
                       workspace_id, row["author_member_id"], new_name)
    await record_audit(conn, workspace_id=workspace_id, service_account_id=account_id,
                       subject_type="service_account", subject_id=account_id, subject_version=row["version"] + 1,
                       action="service_account.updated", actor_type="human", actor_member_id=actor_member_id,
                       permission_basis=basis, correlation_id=correlation_id,
                       before_digest=payload_digest({"name": row["name"], "description": row["description"]}).hex(),
                       after_digest=payload_digest({"name": new_name, "description": new_description}).hex())
    return await account(conn, workspace_id, account_id)


async def lock_for_delete(conn: asyncpg.Connection, workspace_id: str, account_id: str,
                          expected_version: int) -> asyncpg.Record:
    row = await account(conn, workspace_id, account_id, lock=True)
    if row["version"] != expected_version:
        raise Conflict("version_mismatch", f"the account is at version {row['version']}")
    return row


async def delete_account_rows(conn: asyncpg.Connection, row: asyncpg.Record, actor_member_id: str, basis: str,
                              correlation_id: str) -> None:
    """Everything of the account but its scope and author member (the scope actor erases the scope next,
    then delete_author_member, in the same transaction): audit first, then the create request's result
    ref, managers, name, pins, binding, grant, the account, its service member and installation."""
    account_id, workspace_id = row["id"], row["workspace_id"]
    await record_audit(conn, workspace_id=workspace_id, service_account_id=account_id,
                       subject_type="service_account", subject_id=account_id, subject_version=row["version"],
                       action="service_account.deleted", actor_type="human", actor_member_id=actor_member_id,
                       permission_basis=basis, correlation_id=correlation_id,
                       details={"name": row["name"], "scope_id": row["message_scope_id"]})
    # A request still provisioning is done: its account existed, and is gone now.
    await conn.execute(
        "UPDATE service_account_create_requests SET created_service_account_id = NULL, version = version + 1, "
        "business_state = CASE WHEN business_state = 'provisioning' THEN 'fulfilled' ELSE business_state END, "
        "fulfilled_at = coalesce(fulfilled_at, now()), updated_at = now() WHERE created_service_account_id = $1",
        account_id,
    )
    await conn.execute("DELETE FROM service_account_managers WHERE service_account_id = $1", account_id)
    await conn.execute("DELETE FROM scope_message_pins WHERE scope_id = $1", row["message_scope_id"])
    await _release_name(conn, account_id, row["normalized_name"])
    await conn.execute("DELETE FROM service_target_bindings WHERE service_installation_id = $1",
                       row["service_installation_id"])
    await conn.execute("DELETE FROM service_grants WHERE service_installation_id = $1", row["service_installation_id"])
    await conn.execute("DELETE FROM service_accounts WHERE id = $1", account_id)
    await conn.execute("DELETE FROM service_members WHERE service_installation_id = $1",
                       row["service_installation_id"])
    await conn.execute("DELETE FROM service_installations WHERE id = $1", row["service_installation_id"])


async def delete_author_member(conn: asyncpg.Connection, row: asyncpg.Record) -> None:
    """The account's author member, once its messages are gone."""
    await deliveries.delete_member_feed(conn, row["workspace_id"], row["author_member_id"])
    await conn.execute("DELETE FROM members WHERE workspace_id = $1 AND id = $2", row["workspace_id"],
                       row["author_member_id"])


# --- managers ---------------------------------------------------------------------------------------------

async def managers(conn: asyncpg.Connection, account_id: str, include_removed: bool, after: str | None,
                   limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, member_id, status, added_by_member_id, added_at, removed_at, removed_reason "
        "FROM service_account_managers WHERE service_account_id = $1 AND ($2 OR status = 'active') "
        "AND ($3::text IS NULL OR id > $3) ORDER BY id LIMIT $4",
        account_id, include_removed, after, limit + 1,
    )


async def add_manager(conn: asyncpg.Connection, workspace_id: str, account_id: str, member_id: str,
                      actor_member_id: str, basis: str, correlation_id: str) -> tuple[asyncpg.Record, int]:
    await account(conn, workspace_id, account_id, lock=True)
    member = await conn.fetchrow("SELECT kind, status FROM members WHERE workspace_id = $1 AND id = $2",
                                 workspace_id, member_id)
    if member is None:
        raise NotFound("member")
    if member["kind"] != "human" or member["status"] != "active":
        raise Conflict("not_an_active_human", "only an active human can manage a service account")
    if await is_manager(conn, account_id, member_id):
        raise Conflict("already_manager", "already a manager")
    manager_id = new_id("sam")
    await conn.execute(
        "INSERT INTO service_account_managers (id, workspace_id, service_account_id, member_id, added_by_member_id) "
        "VALUES ($1, $2, $3, $4, $5)",
        manager_id, workspace_id, account_id, member_id, actor_member_id,
    )
    version = await _bump_version(conn, account_id)
    await record_audit(conn, workspace_id=workspace_id, service_account_id=account_id,
                       subject_type="service_account", subject_id=account_id, subject_version=version,
                       action="manager.added", actor_type="human", actor_member_id=actor_member_id,
                       permission_basis=basis, correlation_id=correlation_id, details={"member_id": member_id})
    return await _manager_row(conn, manager_id), version


async def remove_manager(conn: asyncpg.Connection, workspace_id: str, account_id: str, member_id: str,
                         actor_member_id: str, basis: str, correlation_id: str) -> tuple[asyncpg.Record, int]:
    await account(conn, workspace_id, account_id, lock=True)
    active = await conn.fetch(
        "SELECT id, member_id FROM service_account_managers WHERE service_account_id = $1 AND status = 'active'",
        account_id,
    )
    target = next((r for r in active if r["member_id"] == member_id), None)
    if target is None:
        raise NotFound("manager")
    if len(active) == 1:
        raise Conflict("last_manager", "a service account keeps at least one manager")
    await conn.execute(
        "UPDATE service_account_managers SET status = 'removed', removed_at = now(), removed_by_member_id = $2, "
        "removed_reason = 'removed' WHERE id = $1",
        target["id"], actor_member_id,
    )
    version = await _bump_version(conn, account_id)
    await record_audit(conn, workspace_id=workspace_id, service_account_id=account_id,
                       subject_type="service_account", subject_id=account_id, subject_version=version,
                       action="manager.removed", actor_type="human", actor_member_id=actor_member_id,
                       permission_basis=basis, correlation_id=correlation_id,
                       details={"member_id": member_id, "reason": "removed"})
    return await _manager_row(conn, target["id"]), version


async def _manager_row(conn: asyncpg.Connection, manager_id: str) -> asyncpg.Record:
    return await conn.fetchrow(
        "SELECT id, member_id, status, added_by_member_id, added_at, removed_at, removed_reason "
        "FROM service_account_managers WHERE id = $1",
        manager_id,
    )


async def _bump_version(conn: asyncpg.Connection, account_id: str) -> int:
    return await conn.fetchval(
        "UPDATE service_accounts SET version = version + 1, updated_at = now() WHERE id = $1 RETURNING version",
        account_id,
    )


async def active_manager_ids(conn: asyncpg.Connection, account_id: str) -> list[str]:
    rows = await conn.fetch("SELECT member_id FROM service_account_managers WHERE service_account_id = $1 "
                            "AND status = 'active' ORDER BY id", account_id)
    return [r["member_id"] for r in rows]


async def governors(conn: asyncpg.Connection, workspace_id: str) -> list[str]:
    """The workspace's active owners and admins: approvers and governance viewers."""
    rows = await conn.fetch(
        "SELECT mem.id FROM workspace_memberships wm JOIN members mem ON mem.workspace_id = wm.workspace_id "
        "AND mem.workspace_membership_id = wm.id WHERE wm.workspace_id = $1 AND wm.status = 'active' "
        "AND wm.role IN ('owner', 'admin') AND mem.status = 'active' ORDER BY mem.id",
        workspace_id,
    )
    return [r["id"] for r in rows]


# --- the audience ------------------------------------------------------------------------------------------

@dataclass
class ReconcileStep:
    """One bounded reconcile batch, computed under the account's row lock: the memberships to open and
    close and where the account's progress moves."""

    account_id: str
    workspace_id: str
    scope_id: str
    opens: list[str]
    closes: list[str]
    scan_cursor: str
    scan_complete: bool
    effective_version: int
    policy_version: int


async def reconcile_step(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                         batch: int) -> ReconcileStep | None:
    """The next batch of the audience reconcile of the account owning `scope_id` (None: nothing to do).
    First pass: the next `batch` active humans by member id after the checkpoint; then the human
    lifecycle events after the applied version, each judged by the member's current state."""
    await hold_workspace(conn, workspace_id)
    row = await conn.fetchrow(
        "SELECT id, workspace_id, audience_scan_complete, audience_scan_cursor, effective_audience_version, "
        "audience_policy_version, audience_state FROM service_accounts WHERE message_scope_id = $1 FOR UPDATE",
        scope_id,
    )
    if row is None or row["audience_state"] == "ready":
        return None
    if not row["audience_scan_complete"]:
        humans = [r["id"] for r in await conn.fetch(
            "SELECT id FROM members WHERE workspace_id = $1 AND kind = 'human' AND status = 'active' AND id > $2 "
            "ORDER BY id LIMIT $3",
            workspace_id, row["audience_scan_cursor"], batch)]
        already = await visibility.open_members_among(conn, scope_id, humans)
        return ReconcileStep(row["id"], workspace_id, scope_id, [m for m in humans if m not in already], [],
                             humans[-1] if humans else row["audience_scan_cursor"], len(humans) < batch,
                             row["effective_audience_version"], row["audience_policy_version"])
    events = await conn.fetch(
        "SELECT lifecycle_seq, member_id FROM workspace_human_lifecycle_events WHERE workspace_id = $1 "
        "AND lifecycle_seq > $2 AND lifecycle_seq <= $3 ORDER BY lifecycle_seq LIMIT $4",
        workspace_id, row["effective_audience_version"], row["audience_policy_version"], batch,
    )
    members = sorted({e["member_id"] for e in events})
    active = {r["id"] for r in await conn.fetch(
        "SELECT id FROM members WHERE workspace_id = $1 AND id = ANY($2::text[]) AND kind = 'human' "
        "AND status = 'active'", workspace_id, members)}
    already = await visibility.open_members_among(conn, scope_id, members)
    effective = events[-1]["lifecycle_seq"] if len(events) == batch else row["audience_policy_version"]
    return ReconcileStep(row["id"], workspace_id, scope_id, [m for m in members if m in active and m not in already],
                         [m for m in members if m not in active and m in already], row["audience_scan_cursor"], True,
                         effective, row["audience_policy_version"])


async def finish_reconcile_step(conn: asyncpg.Connection, step: ReconcileStep,
                                correlation_id: str) -> tuple[asyncpg.Record, str | None]:
    """Record the batch's progress (the checkpoint a restart resumes from); on completion the account is
    ready and its create request fulfilled.  Returns the account and the fulfilled request id, if any."""
    if step.scan_complete and step.effective_version == step.policy_version:
        state = "ready"
    else:
        state = "reconciling" if step.scan_complete else "provisioning"
    row = await conn.fetchrow(
        "UPDATE service_accounts SET audience_scan_cursor = $2, audience_scan_complete = $3, "
        "effective_audience_version = $4, audience_state = $5, audience_batches_done = audience_batches_done + 1, "
        "updated_at = now() WHERE id = $1 RETURNING version",
        step.account_id, step.scan_cursor, step.scan_complete, step.effective_version, state,
    )
    fulfilled = None
    if state == "ready":
        # A platform instance whose audience is ready lets its account's provisioning complete (§2.4).
        platform_account_id = await conn.fetchval(
            "UPDATE platform_service_account_workspace_instances SET provisioning_state = 'ready', "
            "version = version + 1, updated_at = now() WHERE local_service_account_id = $1 "
            "AND provisioning_state <> 'ready' RETURNING platform_service_account_id", step.account_id)
        if platform_account_id is not None:  # its actor announces the instance and completes the account
            await conn.execute("SELECT pg_notify($1, $2)", PLATFORM_CHANNEL, platform_account_id)
        fulfilled = await conn.fetchval(
            "UPDATE service_account_create_requests SET business_state = 'fulfilled', fulfilled_at = now(), "
            "version = version + 1, updated_at = now() WHERE created_service_account_id = $1 "
            "AND business_state = 'provisioning' RETURNING id",
            step.account_id,
        )
    if step.opens or step.closes or state == "ready":
        await record_audit(conn, workspace_id=step.workspace_id, service_account_id=step.account_id,
                           subject_type="service_account", subject_id=step.account_id, subject_version=row["version"],
                           action="audience.reconciled" if state == "ready" else "audience.batch",
                           actor_type="system", actor_member_id=None, permission_basis="audience_policy",
                           correlation_id=correlation_id,
                           details={"opened": len(step.opens), "closed": len(step.closes),
                                    "effective_audience_version": step.effective_version,
                                    "audience_policy_version": step.policy_version, "state": state,
                                    "fulfilled_request_id": fulfilled})
    return await account(conn, step.workspace_id, step.account_id), fulfilled


async def accounts_behind(conn: asyncpg.Connection, after: tuple[str, str] | None,
                          limit: int) -> list[asyncpg.Record]:
    """Accounts whose audience is not ready, any workspace, after (workspace id, account id): the
    reconciler's queue, paged so that failing accounts cannot hide the others."""
    return await conn.fetch(
        "SELECT workspace_id, id, message_scope_id FROM service_accounts WHERE audience_state <> 'ready' "
        "AND ($1::text IS NULL OR (workspace_id, id) > ($1, $2)) ORDER BY workspace_id, id LIMIT $3",
        *(after or (None, None)), limit,
    )


# --- creation policy ------------------------------------------------------------------------------------

async def policy(conn: asyncpg.Connection, workspace_id: str) -> tuple[str, int]:
    row = await conn.fetchrow(
        "SELECT creation_policy, version FROM service_account_workspace_policies WHERE workspace_id = $1",
        workspace_id,
    )
    return (row["creation_policy"], row["version"]) if row is not None else ("approval_required", 0)


async def set_policy(conn: asyncpg.Connection, workspace_id: str, creation_policy: str, expected_version: int,
                     actor_member_id: str, correlation_id: str) -> tuple[str, int]:
    await hold_workspace(conn, workspace_id)
    row = await human_lifecycle.lock_workspace_policy(conn, workspace_id)
    if row["version"] != expected_version:
        raise Conflict("version_mismatch", f"the policy is at version {row['version']}")
    version = await conn.fetchval(
        "UPDATE service_account_workspace_policies SET creation_policy = $2, version = version + 1, "
        "updated_by_member_id = $3, updated_at = now() WHERE workspace_id = $1 RETURNING version",
        workspace_id, creation_policy, actor_member_id,
    )
    await record_audit(conn, workspace_id=workspace_id, service_account_id=None, subject_type="policy",
                       subject_id=workspace_id, subject_version=version, action="policy.updated",
                       actor_type="human", actor_member_id=actor_member_id, permission_basis="workspace_governance",
                       correlation_id=correlation_id,
                       details={"creation_policy": creation_policy, "previous": row["creation_policy"]})
    return creation_policy, version


# --- create requests ----------------------------------------------------------------------------------------

REQUEST_COLUMNS = (
    "r.id, r.workspace_id, r.requested_by_member_id, r.request_version, r.client_request_id, r.payload_snapshot, "
    "r.payload_digest, r.authorization_path, r.business_state, r.approval_instance_id, r.action_required_reason, "
    "r.cancel_client_mutation_id, r.cancel_payload_digest, r.cancel_approval_receipt_ref, "
    "r.created_service_account_id, r.version, r.created_at, r.updated_at"
)


async def request(conn: asyncpg.Connection, workspace_id: str, request_id: str, *,
                  lock: bool = False) -> asyncpg.Record:
    row = await conn.fetchrow(
        f"SELECT {REQUEST_COLUMNS} FROM service_account_create_requests r WHERE r.workspace_id = $1 AND r.id = $2"
        + (" FOR UPDATE" if lock else ""),
        workspace_id, request_id,
    )
    if row is None:
        raise NotFound("create request")
    return row


async def requests(conn: asyncpg.Connection, workspace_id: str, requester: str | None, business_state: str | None,
                   before: str | None, limit: int) -> list[asyncpg.Record]:
    """Newest first; `requester` None lists everyone's (owners and admins)."""
    return await conn.fetch(
        f"SELECT {REQUEST_COLUMNS} FROM service_account_create_requests r WHERE r.workspace_id = $1 "
        "AND ($2::text IS NULL OR r.requested_by_member_id = $2) AND ($3::text IS NULL OR r.business_state = $3) "
        "AND ($4::text IS NULL OR r.id < $4) ORDER BY r.id DESC LIMIT $5",
        workspace_id, requester, business_state, before, limit + 1,
    )


async def request_of_account(conn: asyncpg.Connection, account_id: str) -> str | None:
    return await conn.fetchval(
        "SELECT id FROM service_account_create_requests WHERE created_service_account_id = $1", account_id)


@dataclass
class Submitted:
    request: asyncpg.Record
    account: asyncpg.Record | None
    approval_id: str | None
    replayed: bool


async def _submitted_before(conn: asyncpg.Connection, workspace_id: str, requester: str, client_request_id: str,
                            digest: bytes) -> Submitted | None:
    """The request this client id already made: replayed for the same payload, a conflict for another."""
    existing = await conn.fetchrow(
        f"SELECT {REQUEST_COLUMNS} FROM service_account_create_requests r WHERE r.workspace_id = $1 "
        "AND r.requested_by_member_id = $2 AND r.client_request_id = $3",
        workspace_id, requester, client_request_id,
    )
    if existing is None:
        return None
    if bytes(existing["payload_digest"]) != digest:
        raise Conflict("idempotency_conflict", "same client_request_id, different payload")
    return Submitted(existing, None, existing["approval_instance_id"], True)


async def submit_request(conn: asyncpg.Connection, *, workspace_id: str, requester: str, governor: bool,
                         client_request_id: str, name: str, description: str, correlation_id: str) -> Submitted:
    """A create request (§2.3): replayed for the same client id and payload; under the creation policy
    either created at once (direct_create) or sent for approval (approval_required)."""
    snapshot = {"name": name, "description": description}
    digest = payload_digest(snapshot)
    existing = await _submitted_before(conn, workspace_id, requester, client_request_id, digest)
    if existing is not None:
        return existing
    creation_policy, _ = await policy(conn, workspace_id)
    if governor or creation_policy == "direct_create":
        path = "direct_create"
    elif creation_policy == "approval_required":
        path = "approval_required"
    else:
        raise Conflict("creation_not_allowed", "only owners and admins create service accounts here")
    if await name_taken(conn, workspace_id, normalize_name(name)):
        raise Conflict("name_taken", "a service account with this name exists")
    request_id = new_id("sar")
    approval_id = new_id("apv") if path == "approval_required" else None
    try:
        async with conn.transaction():
            if approval_id is not None:
                await conn.execute(
                    "INSERT INTO approval_instances (id, workspace_id, subject_type, subject_ref, subject_version, "
                    "payload_digest) VALUES ($1, $2, 'service_account_create_request', $3, 1, $4)",
                    approval_id, workspace_id, request_id, digest,
                )
            await conn.execute(
                "INSERT INTO service_account_create_requests (id, workspace_id, requested_by_member_id, "
                "client_request_id, payload_snapshot, payload_digest, authorization_path, business_state, "
                "approval_instance_id) VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9)",
                request_id, workspace_id, requester, client_request_id, json.dumps(snapshot), digest, path,
                "awaiting_authorization" if approval_id else "authorized", approval_id,
            )
    except asyncpg.UniqueViolationError:
        # The same client id committed concurrently (the insert waited for it): answer as its retry.
        existing = await _submitted_before(conn, workspace_id, requester, client_request_id, digest)
        if existing is None:
            raise
        return existing
    await record_audit(conn, workspace_id=workspace_id, service_account_id=None, subject_type="create_request",
                       subject_id=request_id, subject_version=1, action="create_request.submitted",
                       actor_type="human", actor_member_id=requester,
                       permission_basis="workspace_governance" if governor else f"creation_policy:{creation_policy}",
                       correlation_id=correlation_id, after_digest=digest.hex(),
                       details={"authorization_path": path, "approval_id": approval_id, "name": name})
    created = None
    if approval_id is not None:
        await _notify(conn, workspace_id, approval_id, "submitted", 1)
    else:
        created = await create_account(conn, workspace_id=workspace_id, creator_member_id=requester, name=name,
                                       description=description, correlation_id=correlation_id,
                                       permission_basis="workspace_governance" if governor
                                       else "creation_policy:direct_create")
        await _materialized(conn, request_id, created["id"], None, requester, correlation_id)
    return Submitted(await request(conn, workspace_id, request_id), created, approval_id, False)


async def _materialized(conn: asyncpg.Connection, request_id: str, account_id: str, decision_version: int | None,
                        actor_member_id: str, correlation_id: str) -> None:
    row = await conn.fetchrow(
        "UPDATE service_account_create_requests SET business_state = 'provisioning', created_service_account_id = $2, "
        "consumed_decision_version = $3, version = version + 1, updated_at = now() WHERE id = $1 "
        "RETURNING workspace_id, version",
        request_id, account_id, decision_version,
    )
    await record_audit(conn, workspace_id=row["workspace_id"], service_account_id=account_id,
                       subject_type="create_request", subject_id=request_id, subject_version=row["version"],
                       action="create_request.authorized", actor_type="human", actor_member_id=actor_member_id,
                       permission_basis="approval_decision" if decision_version else "direct_create",
                       correlation_id=correlation_id,
                       details={"created_service_account_id": account_id, "business_state": "provisioning"})


async def cancel_request(conn: asyncpg.Connection, *, workspace_id: str, requester: str, request_id: str,
                         expected_version: int, client_mutation_id: str,
                         correlation_id: str) -> tuple[asyncpg.Record, bool]:
    """Cancel before materialization (§2.3): closes the approval and queues one card-update intent.
    Idempotent by (requester, client_mutation_id).  Returns (request, replayed)."""
    cancel_digest = payload_digest({"request_id": request_id, "expected_version": expected_version})
    row = await request(conn, workspace_id, request_id, lock=True)  # a concurrent retry waits here, then replays
    done = await conn.fetchrow(
        f"SELECT {REQUEST_COLUMNS} FROM service_account_create_requests r WHERE r.workspace_id = $1 "
        "AND r.requested_by_member_id = $2 AND r.cancel_client_mutation_id = $3",
        workspace_id, requester, client_mutation_id,
    )
    if done is not None:
        if done["id"] != request_id or bytes(done["cancel_payload_digest"]) != cancel_digest:
            raise Conflict("idempotency_conflict", "same client_mutation_id, different cancel")
        return done, True
    if row["created_service_account_id"] is not None:
        raise AlreadyMaterialized(row["created_service_account_id"])
    if row["version"] != expected_version:
        raise Conflict("version_mismatch", f"the request is at version {row['version']}")
    if row["business_state"] not in CANCELLABLE_STATES:
        raise Conflict("not_cancellable", f"the request is {row['business_state']}")
    receipt = None
    if row["approval_instance_id"] is not None:
        approval = await conn.fetchrow(
            "UPDATE approval_instances SET state = CASE WHEN state = 'pending' THEN 'closed' ELSE state END, "
            "closed_by_mutation_id = CASE WHEN state = 'pending' THEN $2 ELSE closed_by_mutation_id END, "
            "version = CASE WHEN state = 'pending' THEN version + 1 ELSE version END, updated_at = now() "
            "WHERE id = $1 RETURNING id, version, state",
            row["approval_instance_id"], client_mutation_id,
        )
        receipt = f"{approval['id']}:{approval['version']}"
        await _notify(conn, workspace_id, approval["id"], "closed", approval["version"])
    version = row["version"] + 1
    await conn.execute(
        "UPDATE service_account_create_requests SET business_state = 'cancelled', cancelled_at = now(), "
        "cancel_client_mutation_id = $2, cancel_payload_digest = $3, cancel_approval_receipt_ref = $4, "
        "cancel_result_version = $5, version = $5, updated_at = now() WHERE id = $1",
        request_id, client_mutation_id, cancel_digest, receipt, version,
    )
    await record_audit(conn, workspace_id=workspace_id, service_account_id=None, subject_type="create_request",
                       subject_id=request_id, subject_version=version, action="create_request.cancelled",
                       actor_type="human", actor_member_id=requester, permission_basis="requester",
                       correlation_id=correlation_id,
                       details={"client_mutation_id": client_mutation_id, "approval_closure_receipt": receipt})
    return await request(conn, workspace_id, request_id), False


# --- approvals ----------------------------------------------------------------------------------------------

APPROVAL_COLUMNS = ("id, workspace_id, subject_type, subject_ref, subject_version, payload_digest, state, version, "
                    "decided_by_member_id, decision_reason, decided_at")


async def approval(conn: asyncpg.Connection, workspace_id: str, approval_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(f"SELECT {APPROVAL_COLUMNS} FROM approval_instances WHERE workspace_id = $1 AND id = $2",
                              workspace_id, approval_id)
    if row is None:
        raise NotFound("approval")
    return row


@dataclass
class Decided:
    approval: asyncpg.Record
    request: asyncpg.Record
    account: asyncpg.Record | None


async def decide(conn: asyncpg.Connection, *, workspace_id: str, approver: str, approval_id: str, decision: str,
                 expected_version: int, reason: str, card_revision: int | None, client_action_id: str | None,
                 correlation_id: str) -> Decided:
    """An approver's decision, consumed in the same transaction (§2.3): approve validates the request
    against the subject and creates the account (or leaves the request action_required); reject
    declines it.  Locks the request before the approval, as a cancel does."""
    subject = await approval(conn, workspace_id, approval_id)
    row = await request(conn, workspace_id, subject["subject_ref"], lock=True)
    current = await conn.fetchrow(f"SELECT {APPROVAL_COLUMNS} FROM approval_instances WHERE id = $1 FOR UPDATE",
                                  approval_id)
    if current["state"] != "pending":
        raise Conflict("approval_closed", f"the approval is {current['state']}")
    if current["version"] != expected_version:
        raise Conflict("version_mismatch", f"the approval is at version {current['version']}")
    version = current["version"] + 1
    await conn.execute(
        "UPDATE approval_instances SET state = $2, version = $3, decided_by_member_id = $4, decision_reason = $5, "
        "decided_at = now(), updated_at = now() WHERE id = $1",
        approval_id, "approved" if decision == "approve" else "rejected", version, approver, reason or None,
    )
    await record_audit(conn, workspace_id=workspace_id, service_account_id=None, subject_type="approval",
                       subject_id=approval_id, subject_version=version, action="approval.approved" if decision == "approve" else "approval.rejected", actor_type="human",
                       actor_member_id=approver, permission_basis="workspace_approver", correlation_id=correlation_id,
                       comment=reason or None,
                       details={"request_id": row["id"], "card_revision": card_revision,
                                "client_action_id": client_action_id})
    created = None
    if decision == "reject":
        await _set_request_state(conn, row, "declined", version, None, approver, correlation_id)
    else:
        snapshot = row["payload_snapshot"]
        snapshot = json.loads(snapshot) if isinstance(snapshot, str) else snapshot
        problem = await _consume_problem(conn, row, current, snapshot)
        if problem is not None:
            await _set_request_state(conn, row, "action_required", version, problem, approver, correlation_id)
        else:
            created = await create_account(conn, workspace_id=workspace_id,
                                           creator_member_id=row["requested_by_member_id"], name=snapshot["name"],
                                           description=snapshot["description"], correlation_id=correlation_id,
                                           permission_basis=f"approval:{approval_id}:{version}")
            await _materialized(conn, row["id"], created["id"], version, approver, correlation_id)
    await _notify(conn, workspace_id, approval_id, "decided", version)
    return Decided(await approval(conn, workspace_id, approval_id), await request(conn, workspace_id, row["id"]),
                   created)


async def _consume_problem(conn: asyncpg.Connection, row: asyncpg.Record, subject: asyncpg.Record,
                           snapshot: dict[str, Any]) -> str | None:
    """Why an approved request cannot be materialized now (the seed's action_required), or None."""
    if row["request_version"] != subject["subject_version"] or bytes(row["payload_digest"]) != bytes(
            subject["payload_digest"]):
        return "subject_mismatch"
    requester_active = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM members WHERE workspace_id = $1 AND id = $2 AND kind = 'human' "
        "AND status = 'active')",
        row["workspace_id"], row["requested_by_member_id"],
    )
    if not requester_active:
        return "requester_inactive"
    if await name_taken(conn, row["workspace_id"], normalize_name(snapshot["name"])):
        return "name_taken"
    return None


async def _set_request_state(conn: asyncpg.Connection, row: asyncpg.Record, state: str, decision_version: int,
                             reason: str | None, actor_member_id: str, correlation_id: str) -> None:
    version = await conn.fetchval(
        "UPDATE service_account_create_requests SET business_state = $2, consumed_decision_version = $3, "
        "action_required_reason = $4, version = version + 1, updated_at = now() WHERE id = $1 RETURNING version",
        row["id"], state, decision_version, reason,
    )
    await record_audit(conn, workspace_id=row["workspace_id"], service_account_id=None,
                       subject_type="create_request", subject_id=row["id"], subject_version=version,
                       action=f"create_request.{state}", actor_type="human", actor_member_id=actor_member_id,
                       permission_basis="approval_decision", correlation_id=correlation_id,
                       details={"business_state": state, "reason": reason})


# --- approval notifications: intents, cards, receipts, results ----------------------------------------------

async def _notify(conn: asyncpg.Connection, workspace_id: str, approval_id: str, kind: str, version: int) -> None:
    await conn.execute(
        "INSERT INTO approval_notification_intents (id, workspace_id, approval_instance_id, kind, approval_version) "
        "VALUES ($1, $2, $3, $4, $5)",
        new_id("ani"), workspace_id, approval_id, kind, version,
    )


async def pending_intents(conn: asyncpg.Connection, older_than_seconds: float, limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, workspace_id, approval_instance_id, kind FROM approval_notification_intents "
        "WHERE status = 'pending' AND created_at < now() - make_interval(secs => $1) ORDER BY created_at LIMIT $2",
        older_than_seconds, limit,
    )


async def intents_of(conn: asyncpg.Connection, approval_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, workspace_id, approval_instance_id, kind FROM approval_notification_intents "
        "WHERE approval_instance_id = $1 AND status = 'pending' ORDER BY created_at",
        approval_id,
    )


async def finish_intent(conn: asyncpg.Connection, intent_id: str, error: str | None) -> None:
    if error is None:
        await conn.execute("UPDATE approval_notification_intents SET status = 'done', done_at = now() WHERE id = $1",
                           intent_id)
    else:
        await conn.execute("UPDATE approval_notification_intents SET attempts = attempts + 1, last_error = $2 "
                           "WHERE id = $1", intent_id, error[:500])


async def approval_view(conn: asyncpg.Connection, approval_id: str) -> asyncpg.Record:
    """The authoritative state a card shows: the approval with its request (system read)."""
    return await conn.fetchrow(
        "SELECT a.id, a.workspace_id, a.state, a.version, a.decided_by_member_id, a.decision_reason, "
        "r.id AS request_id, r.requested_by_member_id, r.payload_snapshot, r.business_state, "
        "r.created_service_account_id, r.action_required_reason FROM approval_instances a "
        "JOIN service_account_create_requests r ON r.id = a.subject_ref WHERE a.id = $1",
        approval_id,
    )


async def cards_of(conn: asyncpg.Connection, approval_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, notification_key, role, recipient_member_id, expected_approval_version, card_revision, "
        "scope_id, message_id FROM service_notification_cards WHERE business_object_id = $1 ORDER BY id",
        approval_id,
    )


async def card(conn: asyncpg.Connection, notification_key: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT id, notification_key, role, recipient_member_id, expected_approval_version, card_revision, "
        "scope_id, message_id FROM service_notification_cards WHERE notification_key = $1",
        notification_key,
    )


async def record_card(conn: asyncpg.Connection, *, workspace_id: str, notification_key: str, role: str,
                      recipient: str, approval_id: str, approval_version: int, scope_id: str,
                      message_id: str) -> None:
    """The sidecar of a card message just written (idempotent: the key is the notification's identity)."""
    await conn.execute(
        "INSERT INTO service_notification_cards (id, workspace_id, notification_key, role, recipient_member_id, "
        "business_object_id, expected_approval_version, scope_id, message_id) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (notification_key) DO NOTHING",
        new_id("snc"), workspace_id, notification_key, role, recipient, approval_id, approval_version, scope_id,
        message_id,
    )


async def advance_card(conn: asyncpg.Connection, card_id: str, approval_version: int) -> int | None:
    """Move a card to `approval_version` (its next card_revision), or None when it already shows it."""
    return await conn.fetchval(
        "UPDATE service_notification_cards SET expected_approval_version = $2, card_revision = card_revision + 1, "
        "updated_at = now() WHERE id = $1 AND expected_approval_version < $2 RETURNING card_revision",
        card_id, approval_version,
    )


# --- shared pins ------------------------------------------------------------------------------------------

async def pin(conn: asyncpg.Connection, workspace_id: str, scope_id: str, message_id: str, member_id: str,
              top_notice: bool) -> asyncpg.Record:
    if top_notice:
        await conn.execute("UPDATE scope_message_pins SET is_top_notice = false WHERE scope_id = $1 AND is_top_notice "
                           "AND message_id <> $2", scope_id, message_id)
    return await conn.fetchrow(
        "INSERT INTO scope_message_pins (scope_id, message_id, workspace_id, is_top_notice, pinned_by_member_id) "
        "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (scope_id, message_id) DO UPDATE SET is_top_notice = $4, "
        "pinned_by_member_id = $5, pinned_at = now() RETURNING scope_id, message_id, is_top_notice, "
        "pinned_by_member_id, pinned_at",
        scope_id, message_id, workspace_id, top_notice, member_id,
    )


async def delete_pin(conn: asyncpg.Connection, scope_id: str, message_id: str) -> bool:
    return await conn.fetchval(
        "DELETE FROM scope_message_pins WHERE scope_id = $1 AND message_id = $2 RETURNING true", scope_id,
        message_id) is not None


async def pins(conn: asyncpg.Connection, scope_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT p.scope_id, p.message_id, p.is_top_notice, p.pinned_by_member_id, p.pinned_at "
        "FROM scope_message_pins p JOIN scope_messages m ON m.scope_id = p.scope_id AND m.id = p.message_id "
        "WHERE p.scope_id = $1 AND m.state = 'visible' ORDER BY p.is_top_notice DESC, p.pinned_at DESC",
        scope_id,
    )


# --- audit --------------------------------------------------------------------------------------------------

async def audit_events(conn: asyncpg.Connection, workspace_id: str, account_ids: list[str] | None,
                       before: str | None, limit: int) -> list[asyncpg.Record]:
    """Newest first; `account_ids` None: the whole workspace's (owners and admins)."""
    return await conn.fetch(
        "SELECT * FROM service_account_audit_events WHERE workspace_id = $1 "
        "AND ($2::text[] IS NULL OR service_account_id = ANY($2::text[])) AND ($3::text IS NULL OR id < $3) "
        "ORDER BY id DESC LIMIT $4",
        workspace_id, account_ids, before, limit + 1,
    )
