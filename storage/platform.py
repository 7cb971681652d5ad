"""Platform service accounts and all-workspace broadcast (service-account.md §2.4,
§2.5, §4.5, §7): operators, the deployment provisioning generation, workspace
instances, broadcasts and their fenced per-workspace deliveries.

The platform account row is the root lock.  The account's actor
(actors/platform_account.py) writes ordinals, seqs, intervals and leases under
`FOR NO KEY UPDATE`; a workspace delivery holds it `FOR KEY SHARE` (so the two
do not block each other) and Delete takes `FOR UPDATE`, which waits for both."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, NoReturn

import asyncpg
import msgspec

from domain.platform import RETRYABLE_STATES, SETTLED_STATES, Lease
from domain.service_accounts import normalize_name
from storage import applier, deliveries, human_lifecycle, platform_assets, tenancy
from storage.bridge import lift_transaction_bound
from storage.errors import Conflict, NotFound
from storage.human_lifecycle import record_audit
from storage.ids import new_id
from storage.platform_inputs import next_generation, notify, record_input
from storage.service_accounts import GRANT_LIVE, create_substrate, hold_workspace

_canonical = msgspec.json.Encoder(order="sorted")


def broadcast_digest(title: str, content: str, message_type: str, manifest: list[dict] | None = None) -> bytes:
    """The canonical MessagePlan digest of a broadcast (idempotency and the workspace snapshot check):
    with its attachments, their ordered asset refs, content hashes, types, sizes and labels."""
    canonical = {"title": title, "content": content, "type": message_type}
    if manifest:
        canonical["assets"] = [[a["asset_id"], a["sha256"], a["content_type"], a["byte_size"], a["label"]]
                               for a in manifest]
    return hashlib.sha256(_canonical.encode(canonical)).digest()


# --- operators ----------------------------------------------------------------------------------------

async def create_operator(conn: asyncpg.Connection, name: str, key_hash: bytes) -> tuple[str, str]:
    operator_id, key_id = new_id("pop"), new_id("pok")
    await conn.execute("INSERT INTO platform_operators (id, name) VALUES ($1, $2)", operator_id, name)
    await conn.execute(
        "INSERT INTO platform_operator_keys (id, operator_id, name, key_hash) VALUES ($1, $2, $3, $4)",
        key_id, operator_id, name, key_hash,
    )
    return operator_id, key_id


async def operator_for_key(conn: asyncpg.Connection, key_hash: bytes) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT k.id AS key_id, k.operator_id FROM platform_operator_keys k JOIN platform_operators o "
        "ON o.id = k.operator_id WHERE k.key_hash = $1 AND k.status = 'active' AND o.status = 'active'",
        key_hash,
    )


async def operator_key_live(conn: asyncpg.Connection, key_id: str) -> bool:
    return bool(await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM platform_operator_keys k JOIN platform_operators o ON o.id = k.operator_id "
        "WHERE k.id = $1 AND k.status = 'active' AND o.status = 'active')", key_id))


async def operators(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return await conn.fetch("SELECT id, name, status, created_at, disabled_at FROM platform_operators ORDER BY id")


async def disable_operator(conn: asyncpg.Connection, operator_id: str) -> None:
    """Disable the operator; every server closes its live connections (the auth channel)."""
    updated = await conn.execute(
        "UPDATE platform_operators SET status = 'disabled', disabled_at = now() WHERE id = $1 AND status = 'active'",
        operator_id)
    if updated == "UPDATE 0" and not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM platform_operators WHERE id = $1)", operator_id):
        raise NotFound("operator")
    await tenancy.notify_auth_change(conn, "operator", operator_id=operator_id)


async def deployment_generation(conn: asyncpg.Connection) -> int:
    return await conn.fetchval("SELECT platform_provisioning_generation FROM instance_metadata") or 0


# --- accounts -----------------------------------------------------------------------------------------

ACCOUNT_COLUMNS = (
    "a.id, a.name, a.normalized_name, a.description, a.profile_version, a.version, a.provisioning_mode, "
    "a.provisioning_state, a.created_provisioning_generation, a.target_provisioning_generation, "
    "a.applied_provisioning_generation, a.provisioning_scan_complete, a.latest_broadcast_seq, "
    "a.latest_acceptance_ordinal, a.created_by_operator_id, a.created_at, a.updated_at, "
    "(SELECT platform_provisioning_generation FROM instance_metadata) AS deployment_generation, "
    "(SELECT count(*) FROM platform_service_account_workspace_instances i "
    " WHERE i.platform_service_account_id = a.id) AS instances, "
    "(SELECT count(*) FROM platform_service_account_workspace_instances i "
    " WHERE i.platform_service_account_id = a.id AND i.provisioning_state = 'ready') AS instances_ready"
)


async def platform_audit(conn: asyncpg.Connection, *, account_id: str, subject_type: str, subject_id: str,
                         subject_version: int | None, action: str, operator_id: str | None, basis: str,
                         correlation_id: str, broadcast_id: str | None = None, broadcast_seq: int | None = None,
                         details: dict[str, Any] | None = None) -> None:
    # The account id is in details too: the audit outlives the account (its foreign key is nulled).
    await conn.execute(
        "INSERT INTO platform_service_account_audit_events (id, platform_service_account_id, subject_type, "
        "subject_id, subject_version, action, operator_id, permission_basis, correlation_id, broadcast_id, "
        "broadcast_seq, details) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::jsonb)",
        new_id("pae"), account_id, subject_type, subject_id, subject_version, action, operator_id, basis,
        correlation_id, broadcast_id, broadcast_seq,
        json.dumps({"platform_service_account_id": account_id, **(details or {})}),
    )


async def _check_name_free(conn: asyncpg.Connection, normalized: str, account_id: str) -> None:
    """Lock the name's namespace row (created if new); refuse it while another platform account owns it or
    any workspace claims it (the ownership shapes are exclusive, §2.4)."""
    row = await conn.fetchrow(
        "INSERT INTO service_account_name_namespaces (normalized_name) VALUES ($1) ON CONFLICT (normalized_name) "
        "DO UPDATE SET normalized_name = EXCLUDED.normalized_name RETURNING platform_service_account_id",
        normalized,
    )
    owner = row["platform_service_account_id"]
    claimed = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM service_account_name_claims WHERE normalized_name = $1)", normalized)
    if (owner is not None and owner != account_id) or claimed:
        raise Conflict("name_taken", "a service account with this name exists")


async def _own_name(conn: asyncpg.Connection, normalized: str, account_id: str) -> None:
    await conn.execute(
        "UPDATE service_account_name_namespaces SET platform_service_account_id = $2 WHERE normalized_name = $1",
        normalized, account_id)


async def _release_platform_name(conn: asyncpg.Connection, normalized: str) -> None:
    await conn.execute(
        "UPDATE service_account_name_namespaces SET platform_service_account_id = NULL WHERE normalized_name = $1",
        normalized)
    await conn.execute(
        "DELETE FROM service_account_name_namespaces n WHERE n.normalized_name = $1 AND NOT EXISTS "
        "(SELECT 1 FROM service_account_name_claims c WHERE c.normalized_name = n.normalized_name)", normalized)


async def create_account(conn: asyncpg.Connection, *, name: str, description: str, operator_id: str,
                         correlation_id: str) -> asyncpg.Record:
    """Platform Account create (§7.3): name namespace owner, the account, its provisioning input and
    audit.  O(1): the workspaces are provisioned by the account's actor."""
    account_id = new_id("psa")
    normalized = normalize_name(name)
    await _check_name_free(conn, normalized, account_id)
    generation = await next_generation(conn)
    await conn.execute(
        "INSERT INTO platform_service_accounts (id, name, normalized_name, description, "
        "created_provisioning_generation, target_provisioning_generation, created_by_operator_id) "
        "VALUES ($1, $2, $3, $4, $5, $5, $6)",
        account_id, name, normalized, description, generation, operator_id,
    )
    await _own_name(conn, normalized, account_id)
    await record_input(conn, generation, account_id=account_id)
    await platform_audit(conn, account_id=account_id, subject_type="platform_service_account", subject_id=account_id,
                         subject_version=1, action="platform_service_account.created", operator_id=operator_id,
                         basis="platform_operator", correlation_id=correlation_id,
                         details={"name": name, "generation": generation})
    await notify(conn, account_id)
    return await account(conn, account_id)


async def account(conn: asyncpg.Connection, account_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(f"SELECT {ACCOUNT_COLUMNS} FROM platform_service_accounts a WHERE a.id = $1",
                              account_id)
    if row is None:
        raise NotFound("platform service account")
    return row


async def accounts(conn: asyncpg.Connection, after: str | None, limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {ACCOUNT_COLUMNS} FROM platform_service_accounts a WHERE ($1::text IS NULL OR a.id > $1) "
        "ORDER BY a.id LIMIT $2", after, limit)


async def account_ids(conn: asyncpg.Connection) -> list[str]:
    return [r["id"] for r in await conn.fetch("SELECT id FROM platform_service_accounts ORDER BY id")]


async def _lock_root(conn: asyncpg.Connection, account_id: str, mode: str = "NO KEY UPDATE") -> asyncpg.Record:
    row = await conn.fetchrow(f"SELECT * FROM platform_service_accounts WHERE id = $1 FOR {mode}", account_id)
    if row is None:
        raise NotFound("platform service account")
    return row


async def update_profile(conn: asyncpg.Connection, account_id: str, expected_version: int, name: str | None,
                         description: str | None, operator_id: str, correlation_id: str) -> asyncpg.Record:
    root = await _lock_root(conn, account_id)
    if root["version"] != expected_version:
        raise Conflict("version_mismatch", f"the account is at version {root['version']}")
    new_name = root["name"] if name is None else name
    new_description = root["description"] if description is None else description
    normalized = normalize_name(new_name)
    if normalized != root["normalized_name"]:
        await _check_name_free(conn, normalized, account_id)
        await _release_platform_name(conn, root["normalized_name"])
        await _own_name(conn, normalized, account_id)
    await conn.execute(
        "UPDATE platform_service_accounts SET name = $2, normalized_name = $3, description = $4, "
        "profile_version = profile_version + 1, version = version + 1, updated_at = now() WHERE id = $1",
        account_id, new_name, normalized, new_description)
    await platform_audit(conn, account_id=account_id, subject_type="platform_service_account", subject_id=account_id,
                         subject_version=root["version"] + 1, action="platform_service_account.updated",
                         operator_id=operator_id, basis="platform_operator", correlation_id=correlation_id,
                         details={"name": new_name, "profile_version": root["profile_version"] + 1})
    return await account(conn, account_id)


async def propagate_profile_step(conn: asyncpg.Connection, account_id: str,
                                 batch: int) -> list[asyncpg.Record]:
    """Bring up to `batch` instances to the account's profile version: the local account and its author
    member take the name and description.  Returns the local accounts changed."""
    root = await _lock_root(conn, account_id)
    rows = await conn.fetch(
        "SELECT i.id, i.workspace_id, i.local_service_account_id FROM platform_service_account_workspace_instances i "
        "WHERE i.platform_service_account_id = $1 AND i.applied_profile_version < $2 ORDER BY i.workspace_id "
        "LIMIT $3", account_id, root["profile_version"], batch)
    changed = []
    for row in rows:
        # Workspace, local account, then instance: the order every writer of these rows uses.
        await hold_workspace(conn, row["workspace_id"])
        local = await conn.fetchrow(
            "UPDATE service_accounts SET name = $2, normalized_name = $3, description = $4, profile_version = $5, "
            "applied_platform_profile_version = $5, version = version + 1, updated_at = now() WHERE id = $1 "
            "RETURNING id, workspace_id, principal_id, version, name, author_member_id",
            row["local_service_account_id"], root["name"], root["normalized_name"], root["description"],
            root["profile_version"])
        await conn.execute("UPDATE members SET display_name = $3 WHERE workspace_id = $1 AND id = $2",
                           row["workspace_id"], local["author_member_id"], root["name"])
        await conn.execute(
            "UPDATE service_members SET display_name = $2 WHERE member_id = $1", local["author_member_id"],
            root["name"])
        await conn.execute(
            "UPDATE platform_service_account_workspace_instances SET applied_profile_version = $2, "
            "version = version + 1, updated_at = now() WHERE id = $1", row["id"], root["profile_version"])
        changed.append(local)
    return changed


# --- provisioning ---------------------------------------------------------------------------------------

@dataclass
class ProvisionStep:
    opened: list[asyncpg.Record]  # instances opened in this step
    became_ready: bool  # the account reached its target generation
    more: bool  # the scan has more workspaces to open
    # Of the instances the caller watched (or, watching none yet, of every instance not ready):
    # those ready now, and those still not ready (id -> workspace id).
    now_ready: dict[str, str]
    unready: dict[str, str]


async def _open_instance(conn: asyncpg.Connection, root: asyncpg.Record, workspace_id: str,
                         opened_generation: int, correlation_id: str) -> asyncpg.Record:
    """Platform workspace provision (§7.3): the local account with its installation, service member,
    grant, message scope and target binding, and the binding (instance) opened at the next broadcast seq.
    The audience opens in the reconciler's batches."""
    await hold_workspace(conn, workspace_id)
    lifecycle_seq = (await human_lifecycle.lock_workspace_policy(conn, workspace_id))["human_lifecycle_seq"]
    principal = root["id"]
    local_id = new_id("sac")
    installation_id, service_member_id, author_member_id, scope_id = await create_substrate(
        conn, workspace_id, local_id, principal, root["name"], None)
    await conn.execute(
        "INSERT INTO service_accounts (id, principal_id, workspace_id, management_kind, platform_service_account_id, "
        "service_installation_id, service_member_id, author_member_id, message_scope_id, name, normalized_name, "
        "description, profile_version, applied_platform_profile_version, audience_policy_version, "
        "created_by_operator_user_id) VALUES ($1, $2, $3, 'platform', $2, $4, $5, $6, $7, $8, $9, $10, $11, $11, "
        "$12, $13)",
        local_id, principal, workspace_id, installation_id, service_member_id, author_member_id, scope_id,
        root["name"], root["normalized_name"], root["description"], root["profile_version"], lifecycle_seq,
        root["created_by_operator_id"],
    )
    latest = root["latest_broadcast_seq"]
    instance = await conn.fetchrow(
        "INSERT INTO platform_service_account_workspace_instances (id, platform_service_account_id, workspace_id, "
        "local_service_account_id, opened_provisioning_generation, effective_from_broadcast_seq, "
        "last_applied_broadcast_seq, applied_profile_version) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) "
        "RETURNING *",
        new_id("psi"), principal, workspace_id, local_id, opened_generation, latest + 1, latest,
        root["profile_version"],
    )
    await human_lifecycle.notify_audience(conn, workspace_id)
    await record_audit(conn, workspace_id=workspace_id, service_account_id=local_id, subject_type="service_account",
                       subject_id=local_id, subject_version=1, action="service_account.created", actor_type="system",
                       actor_member_id=None, permission_basis="platform_service_account_provisioning",
                       correlation_id=correlation_id,
                       details={"platform_service_account_id": principal, "scope_id": scope_id,
                                "opened_provisioning_generation": opened_generation,
                                "effective_from_broadcast_seq": latest + 1})
    return instance


async def provision_step(conn: asyncpg.Connection, account_id: str, batch: int, correlation_id: str,
                         watching: dict[str, str] | None) -> ProvisionStep:
    """One bounded provisioning transaction: move the target to the deployment generation, open the
    instances of the next `batch` workspaces that lack one (by workspace id after the cursor), and
    once the scan is complete and every instance is ready, apply the target generation.  Also which
    of the `watching` instances and those opened (None: of all not ready) an audience reconcile has
    made ready since."""
    root = await _lock_root(conn, account_id)
    deployment = await deployment_generation(conn)
    # A pass finishes (applied reaches its target) before the next begins: with workspaces created all
    # the time, broadcasts waiting for the current target still get their seq.
    if root["target_provisioning_generation"] < deployment and \
            root["applied_provisioning_generation"] == root["target_provisioning_generation"]:
        root = await conn.fetchrow(
            "UPDATE platform_service_accounts SET target_provisioning_generation = $2, provisioning_cursor = '', "
            "provisioning_scan_complete = false, provisioning_state = 'provisioning', updated_at = now() "
            "WHERE id = $1 RETURNING *", account_id, deployment)
    opened: list[asyncpg.Record] = []
    more = False
    if not root["provisioning_scan_complete"]:
        workspaces = await conn.fetch(
            "SELECT w.id, coalesce(inp.generation, 0) AS generation FROM workspaces w "
            "LEFT JOIN platform_service_account_provisioning_inputs inp ON inp.workspace_id = w.id "
            "WHERE w.id > $2 AND coalesce(inp.generation, 0) <= $3 AND NOT EXISTS (SELECT 1 FROM "
            "platform_service_account_workspace_instances i WHERE i.platform_service_account_id = $1 "
            "AND i.workspace_id = w.id) ORDER BY w.id LIMIT $4",
            account_id, root["provisioning_cursor"], root["target_provisioning_generation"], batch)
        for workspace in workspaces:
            opened.append(await _open_instance(
                conn, root, workspace["id"], max(root["created_provisioning_generation"], workspace["generation"]),
                correlation_id))
        more = len(workspaces) == batch
        await conn.execute(
            "UPDATE platform_service_accounts SET provisioning_cursor = $2, provisioning_scan_complete = $3, "
            "updated_at = now() WHERE id = $1",
            account_id, workspaces[-1]["id"] if workspaces else root["provisioning_cursor"], not more)
    became_ready = False
    if not more and root["applied_provisioning_generation"] < root["target_provisioning_generation"]:
        # A fenced or suspended workspace cannot reconcile its audience; it does not hold the others back
        # (its deliveries wait, and an operator may skip them).
        pending = await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM platform_service_account_workspace_instances i "
            "JOIN workspace_execution_states x ON x.workspace_id = i.workspace_id "
            "JOIN workspaces w ON w.id = i.workspace_id WHERE i.platform_service_account_id = $1 "
            "AND i.provisioning_state <> 'ready' AND x.state = 'active' AND NOT x.write_fenced "
            "AND w.status = 'active')", account_id)
        if not pending:
            await conn.execute(
                "UPDATE platform_service_accounts SET applied_provisioning_generation = target_provisioning_generation, "
                "provisioning_state = 'ready', updated_at = now() WHERE id = $1", account_id)
            await platform_audit(conn, account_id=account_id, subject_type="platform_service_account",
                                 subject_id=account_id, subject_version=root["version"],
                                 action="platform_service_account.provisioned", operator_id=None,
                                 basis="platform_provisioning", correlation_id=correlation_id,
                                 details={"applied_provisioning_generation": root["target_provisioning_generation"]})
            became_ready = True
    # Read last: every instance the check above found ready is among them.
    now_ready: dict[str, str] = {}
    unready: dict[str, str] = {}
    if watching is None:
        rows = await conn.fetch(
            "SELECT id, workspace_id, provisioning_state FROM platform_service_account_workspace_instances "
            "WHERE platform_service_account_id = $1 AND provisioning_state <> 'ready'", account_id)
    else:  # an instance gone with its workspace is no longer watched
        rows = await conn.fetch(
            "SELECT id, workspace_id, provisioning_state FROM platform_service_account_workspace_instances "
            "WHERE id = ANY($1::text[])", [*watching, *(instance["id"] for instance in opened)])
    for row in rows:
        (now_ready if row["provisioning_state"] == "ready" else unready)[row["id"]] = row["workspace_id"]
    return ProvisionStep(opened, became_ready, more, now_ready, unready)


async def instances(conn: asyncpg.Connection, account_id: str, after: str | None,
                    limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT i.*, sa.message_scope_id FROM platform_service_account_workspace_instances i "
        "JOIN service_accounts sa ON sa.id = i.local_service_account_id "
        "WHERE i.platform_service_account_id = $1 AND ($2::text IS NULL OR i.workspace_id > $2) "
        "ORDER BY i.workspace_id LIMIT $3", account_id, after, limit)


# --- broadcasts: accept, allocate, enumerate ---------------------------------------------------------------

BROADCAST_COLUMNS = (
    "b.id, b.platform_service_account_id, b.operator_id, b.client_broadcast_id, b.payload_digest, b.title, "
    "b.content, b.message_type, b.correlation_id, b.required_provisioning_generation, b.acceptance_ordinal, "
    "b.broadcast_seq, b.state, b.enumeration_complete, b.version, b.created_at, b.sequenced_at, b.completed_at, "
    "b.asset_manifest"
)
_COUNTS = (
    "count(*) FILTER (WHERE d.recipient_eligible) AS targets, "
    "count(*) FILTER (WHERE d.state = 'delivered') AS delivered, "
    "count(*) FILTER (WHERE d.state = 'skipped') AS skipped, "
    "count(*) FILTER (WHERE d.recipient_eligible AND d.state NOT IN ('delivered', 'closed', 'skipped')) AS pending, "
    "count(*) FILTER (WHERE d.state IN ('operator_attention', 'retry_wait')) AS exceptions, "
    "count(*) FILTER (WHERE NOT d.recipient_eligible) AS generation_excluded"
)


async def target_counts(conn: asyncpg.Connection, broadcast_id: str) -> asyncpg.Record:
    return await conn.fetchrow(
        f"SELECT {_COUNTS} FROM platform_service_account_broadcast_deliveries d WHERE d.broadcast_id = $1",
        broadcast_id)


async def broadcast(conn: asyncpg.Connection, broadcast_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(f"SELECT {BROADCAST_COLUMNS} FROM platform_service_account_broadcasts b WHERE b.id = $1",
                              broadcast_id)
    if row is None:
        raise NotFound("broadcast")
    return row


async def broadcasts(conn: asyncpg.Connection, account_id: str, before: int | None,
                     limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {BROADCAST_COLUMNS} FROM platform_service_account_broadcasts b WHERE b.platform_service_account_id = $1 "
        "AND ($2::bigint IS NULL OR b.acceptance_ordinal < $2) ORDER BY b.acceptance_ordinal DESC LIMIT $3",
        account_id, before, limit)


@dataclass
class Accepted:
    broadcast: asyncpg.Record
    replayed: bool


async def record_moderation_block(conn: asyncpg.Connection, *, account_id: str, operator_id: str,
                                  client_broadcast_id: str, title: str, content: str, matched: list[str]) -> None:
    await conn.execute(
        "INSERT INTO platform_moderation_logs (id, target_type, platform_service_account_id, operator_id, "
        "client_broadcast_id, title, content, matched_keywords) VALUES ($1, 'platform_broadcast', $2, $3, $4, $5, "
        "$6, $7)", new_id("pml"), account_id, operator_id, client_broadcast_id, title, content, matched)


async def accept_broadcast(conn: asyncpg.Connection, *, account_id: str, operator_id: str, client_broadcast_id: str,
                           title: str, content: str, message_type: str, correlation_id: str,
                           asset_ids: list[str] = ()) -> Accepted:
    """Broadcast acceptance (§4.5): capture the deployment generation G, allocate the next acceptance
    ordinal under the root lock, save the immutable snapshot (with its assets' frozen manifest) and
    its digest, waiting for provisioning."""
    root = await _lock_root(conn, account_id)
    manifest = await platform_assets.reference(conn, account_id, list(asset_ids))
    if manifest is None:
        raise NotFound("asset")
    digest = broadcast_digest(title, content, message_type, manifest)
    existing = await conn.fetchrow(
        f"SELECT {BROADCAST_COLUMNS} FROM platform_service_account_broadcasts b WHERE b.platform_service_account_id = $1 "
        "AND b.operator_id = $2 AND b.client_broadcast_id = $3", account_id, operator_id, client_broadcast_id)
    if existing is not None:
        if bytes(existing["payload_digest"]) != digest:
            raise Conflict("idempotency_conflict", "same client_broadcast_id, different broadcast")
        return Accepted(existing, True)
    # FOR SHARE: a workspace create still committing its generation is inside G or after it, never lost.
    generation = await conn.fetchval(
        "SELECT platform_provisioning_generation FROM instance_metadata FOR SHARE")
    ordinal = root["latest_acceptance_ordinal"] + 1
    broadcast_id = new_id("pbc")
    await conn.execute(
        "INSERT INTO platform_service_account_broadcasts (id, platform_service_account_id, operator_id, "
        "client_broadcast_id, payload_digest, title, content, message_type, correlation_id, "
        "required_provisioning_generation, acceptance_ordinal, asset_manifest) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::jsonb)",
        broadcast_id, account_id, operator_id, client_broadcast_id, digest, title, content, message_type,
        correlation_id, generation, ordinal, json.dumps(manifest))
    await conn.execute(
        "UPDATE platform_service_accounts SET latest_acceptance_ordinal = $2, updated_at = now() WHERE id = $1",
        account_id, ordinal)
    await platform_audit(conn, account_id=account_id, subject_type="broadcast", subject_id=broadcast_id,
                         subject_version=1, action="broadcast.accepted", operator_id=operator_id,
                         basis="platform_operator", correlation_id=correlation_id, broadcast_id=broadcast_id,
                         details={"client_broadcast_id": client_broadcast_id, "payload_digest": digest.hex(),
                                  "required_provisioning_generation": generation, "acceptance_ordinal": ordinal})
    return Accepted(await broadcast(conn, broadcast_id), False)


async def allocate_step(conn: asyncpg.Connection, account_id: str, correlation_id: str) -> list[str]:
    """Sequence allocation (§4.5): head of line by acceptance ordinal, each only once the applied
    provisioning generation has reached its G.  Returns the broadcasts numbered."""
    root = await _lock_root(conn, account_id)
    waiting = await conn.fetch(
        "SELECT id, required_provisioning_generation, operator_id FROM platform_service_account_broadcasts "
        "WHERE platform_service_account_id = $1 AND broadcast_seq IS NULL ORDER BY acceptance_ordinal LIMIT 100",
        account_id)
    seq = root["latest_broadcast_seq"]
    numbered = []
    for row in waiting:
        if row["required_provisioning_generation"] > root["applied_provisioning_generation"]:
            break  # head of line: nothing after it is numbered before it
        seq += 1
        await conn.execute(
            "UPDATE platform_service_account_broadcasts SET broadcast_seq = $2, state = 'accepted', "
            "sequenced_at = now(), version = version + 1, updated_at = now() WHERE id = $1", row["id"], seq)
        await platform_audit(conn, account_id=account_id, subject_type="broadcast", subject_id=row["id"],
                             subject_version=2, action="broadcast.sequenced", operator_id=row["operator_id"],
                             basis="platform_operator", correlation_id=correlation_id, broadcast_id=row["id"],
                             broadcast_seq=seq,
                             details={"applied_provisioning_generation": root["applied_provisioning_generation"]})
        numbered.append(row["id"])
    if numbered:
        await conn.execute("UPDATE platform_service_accounts SET latest_broadcast_seq = $2, updated_at = now() "
                           "WHERE id = $1", account_id, seq)
    return numbered


async def enumerate_step(conn: asyncpg.Connection, account_id: str, page: int) -> bool:
    """Target enumeration (§4.5), one stable page of the oldest numbered broadcast still enumerating:
    every instance whose interval contains its seq gets a delivery, eligible when the instance opened
    within the captured generation, else a `generation_excluded` cursor settlement.  False: none left."""
    await _lock_root(conn, account_id)
    row = await conn.fetchrow(
        "SELECT id, broadcast_seq, required_provisioning_generation, enumeration_cursor "
        "FROM platform_service_account_broadcasts WHERE platform_service_account_id = $1 AND state = 'accepted' "
        "ORDER BY broadcast_seq LIMIT 1", account_id)
    if row is None:
        return False
    targets = await conn.fetch(
        "SELECT i.workspace_id, i.local_service_account_id, sa.message_scope_id, "
        "i.opened_provisioning_generation <= $4 AS eligible "
        "FROM platform_service_account_workspace_instances i JOIN service_accounts sa "
        "ON sa.id = i.local_service_account_id WHERE i.platform_service_account_id = $1 AND i.workspace_id > $2 "
        "AND i.effective_from_broadcast_seq <= $3 AND (i.effective_to_broadcast_seq IS NULL "
        "OR $3 < i.effective_to_broadcast_seq) ORDER BY i.workspace_id LIMIT $5",
        account_id, row["enumeration_cursor"], row["broadcast_seq"], row["required_provisioning_generation"], page)
    if targets:
        await conn.execute(
            "INSERT INTO platform_service_account_broadcast_deliveries (id, broadcast_id, platform_service_account_id, "
            "workspace_id, local_service_account_id, local_scope_id, broadcast_seq, recipient_eligible) "
            "SELECT t.id, $1, $2, t.workspace_id, t.local_id, t.scope_id, $3, t.eligible FROM unnest($4::text[], "
            "$5::text[], $6::text[], $7::text[], $8::boolean[]) AS t(id, workspace_id, local_id, scope_id, eligible) "
            "ON CONFLICT DO NOTHING",
            row["id"], account_id, row["broadcast_seq"], [new_id("pbd") for _ in targets],
            [t["workspace_id"] for t in targets], [t["local_service_account_id"] for t in targets],
            [t["message_scope_id"] for t in targets], [t["eligible"] for t in targets])
    done = len(targets) < page
    await conn.execute(
        "UPDATE platform_service_account_broadcasts SET enumeration_cursor = $2, enumeration_complete = $3, "
        "state = CASE WHEN $3 THEN 'dispatching' ELSE state END, version = version + CASE WHEN $3 THEN 1 ELSE 0 END, "
        "updated_at = now() WHERE id = $1",
        row["id"], targets[-1]["workspace_id"] if targets else row["enumeration_cursor"], done)
    return True


# --- dispatch: heads, leases, settlements -----------------------------------------------------------------

# Per workspace, the lowest unsettled delivery, when it is the next seq that workspace applies.
_HEADS = (
    "WITH heads AS (SELECT DISTINCT ON (d.workspace_id) d.* FROM platform_service_account_broadcast_deliveries d "
    "WHERE d.platform_service_account_id = $1 AND d.state NOT IN ('delivered', 'closed', 'skipped') "
    "ORDER BY d.workspace_id, d.broadcast_seq) "
    "SELECT h.id, h.version, h.workspace_id, h.recipient_eligible, h.broadcast_seq FROM heads h "
    "JOIN platform_service_account_workspace_instances i ON i.platform_service_account_id = h.platform_service_account_id "
    "AND i.workspace_id = h.workspace_id WHERE h.broadcast_seq = i.last_applied_broadcast_seq + 1 "
)


async def settle_excluded_heads(conn: asyncpg.Connection, account_id: str, correlation_id: str) -> int:
    """Settle the `generation_excluded` heads (closed, no message) and advance their workspaces'
    cursors, so the next eligible seq there finds a continuous cursor."""
    await _lock_root(conn, account_id)
    total = 0
    for _ in range(8):  # bounded: the next pass settles what is left
        heads = await conn.fetch(_HEADS + "AND NOT h.recipient_eligible ORDER BY h.workspace_id LIMIT 500",
                                 account_id)
        if not heads:
            break
        ids = [h["id"] for h in heads]
        await conn.execute(
            "UPDATE platform_service_account_broadcast_deliveries SET state = 'closed', outcome = 'generation_excluded', "
            "version = version + 1, updated_at = now() WHERE id = ANY($1::text[])", ids)
        await conn.execute(
            "UPDATE platform_service_account_workspace_instances i SET last_applied_broadcast_seq = h.seq, "
            "version = i.version + 1, updated_at = now() FROM unnest($2::text[], $3::bigint[]) AS h(workspace_id, seq) "
            "WHERE i.platform_service_account_id = $1 AND i.workspace_id = h.workspace_id",
            account_id, [h["workspace_id"] for h in heads], [h["broadcast_seq"] for h in heads])
        total += len(heads)
    return total


async def claim_placements(conn: asyncpg.Connection, workspace_ids: list[str], node_id: str) -> dict[str, int]:
    """This node serves these workspaces: a workspace another node served moves here with a new epoch,
    which fences whatever the former node leased there."""
    # Rows this node already holds are left alone: an upsert would lock them against the workspace
    # transactions that read the epoch.
    await conn.execute(
        "INSERT INTO workspace_placements (workspace_id, node_id) SELECT w, $2 FROM unnest($1::text[]) AS w "
        "WHERE NOT EXISTS (SELECT 1 FROM workspace_placements p WHERE p.workspace_id = w AND p.node_id = $2) "
        "ON CONFLICT (workspace_id) DO UPDATE SET node_id = EXCLUDED.node_id, "
        "placement_epoch = workspace_placements.placement_epoch + 1, updated_at = now() "
        "WHERE workspace_placements.node_id <> EXCLUDED.node_id", workspace_ids, node_id)
    rows = await conn.fetch(
        "SELECT workspace_id, placement_epoch FROM workspace_placements WHERE workspace_id = ANY($1::text[])",
        workspace_ids)
    return {r["workspace_id"]: r["placement_epoch"] for r in rows}


async def lease_heads(conn: asyncpg.Connection, account_id: str, node_id: str, lease_seconds: float,
                      limit: int) -> list[Lease]:
    """Lease the due eligible heads (queued; retry_wait / waiting_* whose time came; leased whose lease
    expired): compare-and-set on each row's version, a fresh token, the expiry, the placement epoch."""
    await _lock_root(conn, account_id)
    heads = await conn.fetch(
        _HEADS + "AND h.recipient_eligible AND (h.state = 'queued' "
        "OR (h.state IN ('retry_wait', 'waiting_audience', 'waiting_instance') AND h.next_attempt_at <= now()) "
        "OR (h.state = 'leased' AND h.lease_expires_at <= now())) ORDER BY h.workspace_id LIMIT $2",
        account_id, limit)
    if not heads:
        return []
    epochs = await claim_placements(conn, [h["workspace_id"] for h in heads], node_id)
    rows = await conn.fetch(
        "UPDATE platform_service_account_broadcast_deliveries d SET state = 'leased', "
        "lease_token = gen_random_uuid()::text, lease_expires_at = now() + make_interval(secs => $4), "
        "placement_epoch = h.epoch, attempt = d.attempt + 1, version = d.version + 1, updated_at = now() "
        "FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS h(id, version, epoch) "
        "WHERE d.id = h.id AND d.version = h.version "
        "RETURNING d.id, d.workspace_id, d.local_scope_id, d.broadcast_id, d.broadcast_seq, d.lease_token, d.version, "
        "d.placement_epoch, (SELECT active_generation FROM workspace_execution_states s "
        "WHERE s.workspace_id = d.workspace_id) AS execution_generation",
        [h["id"] for h in heads], [h["version"] for h in heads], [epochs[h["workspace_id"]] for h in heads],
        float(lease_seconds))
    return [Lease(r["id"], r["workspace_id"], r["local_scope_id"], r["broadcast_id"], r["broadcast_seq"],
                  r["lease_token"], r["version"], r["placement_epoch"], r["execution_generation"]) for r in rows]


async def settle_failure(conn: asyncpg.Connection, lease: Lease, *, state: str, error: str,
                         delay_seconds: float) -> asyncpg.Record | None:
    """Release a lease that did not deliver (compare-and-set on its token and version): `state` is
    retry_wait, operator_attention, or — spending no attempt — waiting_audience or queued (not its turn,
    or its workspace moved to another placement)."""
    return await conn.fetchrow(
        "UPDATE platform_service_account_broadcast_deliveries SET state = $4, lease_token = NULL, "
        "lease_expires_at = NULL, last_error = $5, next_attempt_at = now() + make_interval(secs => $6), "
        "attempt = CASE WHEN $4 IN ('queued', 'waiting_audience') THEN attempt - 1 ELSE attempt END, "
        "version = version + 1, "
        "updated_at = now() WHERE id = $1 AND lease_token = $2 AND version = $3 AND state = 'leased' "
        "RETURNING id, version, state, attempt",
        lease.delivery_id, lease.lease_token, lease.version, state, error, float(delay_seconds))


async def finish_broadcasts(conn: asyncpg.Connection, account_id: str, correlation_id: str) -> list[str]:
    """Dispatching broadcasts with nothing unsettled complete: `closed` (no recipient target),
    `completed_with_exceptions` (some skipped) or `completed`.  Returns their ids."""
    await _lock_root(conn, account_id)
    rows = await conn.fetch(
        "SELECT b.id, b.version, b.broadcast_seq, b.operator_id, "
        "count(d.id) FILTER (WHERE d.recipient_eligible) AS targets, "
        "count(d.id) FILTER (WHERE d.state = 'skipped') AS skipped, "
        "count(d.id) FILTER (WHERE d.state = 'delivered') AS delivered "
        "FROM platform_service_account_broadcasts b LEFT JOIN platform_service_account_broadcast_deliveries d "
        "ON d.broadcast_id = b.id WHERE b.platform_service_account_id = $1 AND b.state = 'dispatching' "
        "GROUP BY b.id HAVING count(d.id) FILTER (WHERE d.state NOT IN ('delivered', 'closed', 'skipped')) = 0",
        account_id)
    done = []
    for row in rows:
        state = "closed" if row["targets"] == 0 else "completed_with_exceptions" if row["skipped"] else "completed"
        await conn.execute(
            "UPDATE platform_service_account_broadcasts SET state = $2, completed_at = now(), version = version + 1, "
            "updated_at = now() WHERE id = $1", row["id"], state)
        await platform_audit(conn, account_id=account_id, subject_type="broadcast", subject_id=row["id"],
                             subject_version=row["version"] + 1, action=f"broadcast.{state}",
                             operator_id=row["operator_id"], basis="platform_operator", correlation_id=correlation_id,
                             broadcast_id=row["id"], broadcast_seq=row["broadcast_seq"],
                             details={"targets": row["targets"], "delivered": row["delivered"],
                                      "skipped": row["skipped"]})
        done.append(row["id"])
    return done


async def next_due_seconds(conn: asyncpg.Connection, account_id: str) -> float | None:
    """Seconds until the account's next timed work (a backoff ending, a lease expiring); None: none."""
    value = await conn.fetchval(
        "SELECT extract(epoch FROM min(CASE WHEN state = 'leased' THEN lease_expires_at ELSE next_attempt_at END) "
        "- now()) FROM platform_service_account_broadcast_deliveries WHERE platform_service_account_id = $1 "
        "AND state IN ('leased', 'retry_wait', 'waiting_audience', 'waiting_instance')", account_id)
    return None if value is None else max(0.0, float(value))


# --- the workspace delivery transaction (run by the local scope's actor) ----------------------------------

async def fence_delivery(conn: asyncpg.Connection, lease: Lease, platform_account_id: str,
                         scope_id: str) -> asyncpg.Record:
    """The execution fence of a delivery, in the workspace message transaction (the platform root is
    key-shared first, by the command's prelock), as one statement that locks in the order every
    writer uses: the delivery (for update) and the workspace's placement (share), the workspace (key
    share), the local account owning `scope_id` (share), then the instance (for update) — the
    executor's LockRows node takes a row's relations in the order of its FOR clauses.  The delivery
    must still carry this lease token and version, unexpired by the clock now (not the transaction's
    start); the placement epoch must be the one leased; the instance must have applied the previous
    broadcast seq.  Returns the local account's id, author, audience state and `grant_live`, and the
    instance's `instance_id` and `local_service_account_id`; raises Conflict with the reason, or
    NotFound."""
    row = await conn.fetchrow(
        "SELECT d.state AS delivery_state, d.lease_token, d.version AS delivery_version, "
        "d.lease_expires_at > clock_timestamp() AS live, p.placement_epoch, a.id, a.author_member_id, "
        f"a.audience_state, {GRANT_LIVE} AS grant_live, i.id AS instance_id, i.local_service_account_id, "
        "i.last_applied_broadcast_seq "
        "FROM platform_service_account_broadcast_deliveries d "
        "JOIN workspace_placements p ON p.workspace_id = d.workspace_id "
        "JOIN workspaces w ON w.id = d.workspace_id "
        "JOIN service_accounts a ON a.workspace_id = d.workspace_id AND a.message_scope_id = $2 "
        "JOIN platform_service_account_workspace_instances i ON i.platform_service_account_id = $3 "
        "AND i.workspace_id = d.workspace_id "
        "WHERE d.id = $1 FOR UPDATE OF d FOR SHARE OF p FOR KEY SHARE OF w FOR SHARE OF a FOR UPDATE OF i",
        lease.delivery_id, scope_id, platform_account_id)
    if row is None:
        await _missing_fence_row(conn, lease, scope_id)
    if row["delivery_state"] != "leased" or row["lease_token"] != lease.lease_token or \
            row["delivery_version"] != lease.version or not row["live"]:
        raise Conflict("stale_lease", "the delivery's lease is no longer this one")
    if row["placement_epoch"] != lease.placement_epoch:
        raise Conflict("stale_placement", "the workspace moved to another placement epoch")
    if row["last_applied_broadcast_seq"] != lease.broadcast_seq - 1:
        raise Conflict("out_of_order", "an earlier broadcast is not applied in this workspace yet")
    return row


async def _missing_fence_row(conn: asyncpg.Connection, lease: Lease, scope_id: str) -> NoReturn:
    """Which row of the fence is gone (nothing was locked: the join found no row)."""
    found = await conn.fetchrow(
        "SELECT EXISTS (SELECT 1 FROM service_accounts WHERE message_scope_id = $2) AS account, "
        "EXISTS (SELECT 1 FROM platform_service_account_broadcast_deliveries d JOIN workspace_placements p "
        "ON p.workspace_id = d.workspace_id WHERE d.id = $1) AS delivery", lease.delivery_id, scope_id)
    if not found["account"]:
        raise NotFound("service account")
    if not found["delivery"]:
        raise Conflict("stale_lease", "the delivery's lease is no longer this one")
    raise Conflict("stale_lease", "the instance is gone")


async def hold_root(conn: asyncpg.Connection, platform_account_id: str) -> None:
    """Key-share the platform root: a delete (FOR UPDATE) waits for this transaction, or this for it."""
    await conn.execute("SELECT 1 FROM platform_service_accounts WHERE id = $1 FOR KEY SHARE", platform_account_id)


async def settle_delivered(conn: asyncpg.Connection, lease: Lease, instance_id: str, message_id: str,
                           audit: tuple) -> None:
    """The delivered settlement, the workspace cursor and the message's audit event (a
    human_lifecycle.audit_row), in the message's own transaction — one statement."""
    await conn.execute(
        f"WITH audit AS ({human_lifecycle.audit_insert_sql(5)}), "
        "settled AS (UPDATE platform_service_account_broadcast_deliveries SET state = 'delivered', "
        "outcome = 'delivered', local_message_id = $2, lease_token = NULL, lease_expires_at = NULL, "
        "last_error = NULL, version = version + 1, updated_at = now() WHERE id = $1) "
        "UPDATE platform_service_account_workspace_instances SET last_applied_broadcast_seq = $4, "
        "version = version + 1, updated_at = now() WHERE id = $3",
        lease.delivery_id, message_id, instance_id, lease.broadcast_seq, *audit)


# --- operator actions on a delivery ------------------------------------------------------------------------

DELIVERY_COLUMNS = (
    "d.id, d.broadcast_id, d.platform_service_account_id, d.workspace_id, d.local_service_account_id, "
    "d.local_scope_id, d.broadcast_seq, d.recipient_eligible, d.state, d.outcome, d.attempt, d.lease_expires_at, "
    "d.next_attempt_at, d.local_message_id, d.last_error, d.version"
)


async def delivery(conn: asyncpg.Connection, delivery_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(
        f"SELECT {DELIVERY_COLUMNS} FROM platform_service_account_broadcast_deliveries d WHERE d.id = $1",
        delivery_id)
    if row is None:
        raise NotFound("delivery")
    return row


async def deliveries_of(conn: asyncpg.Connection, broadcast_id: str, state: str | None, after: str | None,
                        limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {DELIVERY_COLUMNS} FROM platform_service_account_broadcast_deliveries d WHERE d.broadcast_id = $1 "
        "AND ($2::text IS NULL OR d.state = $2) AND ($3::text IS NULL OR d.workspace_id > $3) "
        "ORDER BY d.workspace_id LIMIT $4", broadcast_id, state, after, limit)


async def _lock_delivery(conn: asyncpg.Connection, delivery_id: str, expected_version: int) -> asyncpg.Record:
    account_id = await conn.fetchval(
        "SELECT platform_service_account_id FROM platform_service_account_broadcast_deliveries WHERE id = $1",
        delivery_id)
    if account_id is None:
        raise NotFound("delivery")
    await _lock_root(conn, account_id)
    row = await conn.fetchrow(
        "SELECT * FROM platform_service_account_broadcast_deliveries WHERE id = $1 FOR UPDATE", delivery_id)
    if row is None:
        raise NotFound("delivery")
    if row["version"] != expected_version:
        raise Conflict("version_mismatch", f"the delivery is at version {row['version']}")
    return row


async def retry_delivery(conn: asyncpg.Connection, delivery_id: str, expected_version: int, operator_id: str,
                         correlation_id: str) -> asyncpg.Record:
    row = await _lock_delivery(conn, delivery_id, expected_version)
    if row["state"] not in RETRYABLE_STATES:
        raise Conflict("not_retryable", f"a {row['state']} delivery is not retried")
    await conn.execute(
        "UPDATE platform_service_account_broadcast_deliveries SET state = 'queued', attempt = 0, "
        "next_attempt_at = now(), version = version + 1, updated_at = now() WHERE id = $1", delivery_id)
    await platform_audit(conn, account_id=row["platform_service_account_id"], subject_type="delivery",
                         subject_id=delivery_id, subject_version=row["version"] + 1, action="delivery.retried",
                         operator_id=operator_id, basis="platform_operator", correlation_id=correlation_id,
                         broadcast_id=row["broadcast_id"], broadcast_seq=row["broadcast_seq"],
                         details={"workspace_id": row["workspace_id"], "from_state": row["state"]})
    await notify(conn, row["platform_service_account_id"])
    return await delivery(conn, delivery_id)


async def settle_skip(conn: asyncpg.Connection, delivery_id: str, expected_version: int, operator_id: str,
                      correlation_id: str, client_message_id: str) -> asyncpg.Record:
    """Operator settle-skip under the same execution fence: the instance row lock and the cursor order.
    A message already written for it makes it delivered; otherwise skipped."""
    row = await _lock_delivery(conn, delivery_id, expected_version)
    if row["state"] in SETTLED_STATES:
        raise Conflict("already_settled", f"the delivery is {row['state']}")
    if not row["recipient_eligible"]:
        raise Conflict("not_a_target", "a generation_excluded settlement is not a recipient target")
    instance = await conn.fetchrow(
        "SELECT * FROM platform_service_account_workspace_instances WHERE platform_service_account_id = $1 "
        "AND workspace_id = $2 FOR UPDATE", row["platform_service_account_id"], row["workspace_id"])
    if instance["last_applied_broadcast_seq"] != row["broadcast_seq"] - 1:
        raise Conflict("out_of_order", "an earlier broadcast is not settled in this workspace yet")
    author = await conn.fetchval("SELECT author_member_id FROM service_accounts WHERE id = $1",
                                 row["local_service_account_id"])
    message_id = await conn.fetchval(
        "SELECT id FROM scope_messages WHERE scope_id = $1 AND author_member_id = $2 AND client_message_id = $3",
        row["local_scope_id"], author, client_message_id)
    state = "delivered" if message_id is not None else "skipped"
    await conn.execute(
        "UPDATE platform_service_account_broadcast_deliveries SET state = $2, outcome = $2, local_message_id = $3, "
        "lease_token = NULL, lease_expires_at = NULL, version = version + 1, updated_at = now() WHERE id = $1",
        delivery_id, state, message_id)
    await conn.execute(
        "UPDATE platform_service_account_workspace_instances SET last_applied_broadcast_seq = $2, "
        "version = version + 1, updated_at = now() WHERE id = $1", instance["id"], row["broadcast_seq"])
    await platform_audit(conn, account_id=row["platform_service_account_id"], subject_type="delivery",
                         subject_id=delivery_id, subject_version=row["version"] + 1, action=f"delivery.settled_{state}",
                         operator_id=operator_id, basis="platform_operator", correlation_id=correlation_id,
                         broadcast_id=row["broadcast_id"], broadcast_seq=row["broadcast_seq"],
                         details={"workspace_id": row["workspace_id"], "from_state": row["state"],
                                  "local_message_id": message_id})
    await notify(conn, row["platform_service_account_id"])
    return await delivery(conn, delivery_id)


# --- delete ---------------------------------------------------------------------------------------------

async def delete_account(conn: asyncpg.Connection, account_id: str, expected_version: int, operator_id: str,
                         correlation_id: str) -> tuple[asyncpg.Record, list[asyncpg.Record]]:
    """Platform Account delete (§2.4) in one transaction under the root lock (FOR UPDATE: it waits for
    in-flight workspace deliveries): audit first, then every local instance with its scope, messages and
    author member, the name, and the root (its inputs, broadcasts and deliveries cascade).  Returns the
    root and the local accounts deleted."""
    await lift_transaction_bound(conn)
    # The account's lease row goes with it (cascade), and every fenced transaction of its actor holds
    # that row shared before it locks the root: taking it first, before the root, keeps those
    # transactions from waiting on the root while this one waits on them (a deadlock).
    await conn.execute("SELECT 1 FROM platform_account_leases WHERE platform_service_account_id = $1 FOR UPDATE",
                       account_id)
    root = await _lock_root(conn, account_id, "UPDATE")
    if root["version"] != expected_version:
        raise Conflict("version_mismatch", f"the account is at version {root['version']}")
    await platform_audit(conn, account_id=account_id, subject_type="platform_service_account", subject_id=account_id,
                         subject_version=root["version"], action="platform_service_account.deleted",
                         operator_id=operator_id, basis="platform_operator", correlation_id=correlation_id,
                         details={"name": root["name"]})
    locals_ = await conn.fetch(
        "SELECT sa.* FROM service_accounts sa WHERE sa.platform_service_account_id = $1 ORDER BY sa.workspace_id",
        account_id)
    for local in locals_:
        await hold_workspace(conn, local["workspace_id"])
        await conn.fetchrow("SELECT 1 FROM service_accounts WHERE id = $1 FOR UPDATE", local["id"])
        await record_audit(conn, workspace_id=local["workspace_id"], service_account_id=local["id"],
                           subject_type="service_account", subject_id=local["id"], subject_version=local["version"],
                           action="service_account.deleted", actor_type="system", actor_member_id=None,
                           permission_basis="platform_operator", correlation_id=correlation_id,
                           details={"platform_service_account_id": account_id, "operator_id": operator_id,
                                    "scope_id": local["message_scope_id"]})
        await conn.execute("DELETE FROM platform_service_account_workspace_instances WHERE local_service_account_id = $1",
                           local["id"])
        await conn.execute("DELETE FROM scope_message_pins WHERE scope_id = $1", local["message_scope_id"])
        await conn.execute("DELETE FROM service_target_bindings WHERE service_installation_id = $1",
                           local["service_installation_id"])
        await conn.execute("DELETE FROM service_grants WHERE service_installation_id = $1",
                           local["service_installation_id"])
        await conn.execute("DELETE FROM service_accounts WHERE id = $1", local["id"])
        await conn.execute("DELETE FROM service_members WHERE service_installation_id = $1",
                           local["service_installation_id"])
        await conn.execute("DELETE FROM service_installations WHERE id = $1", local["service_installation_id"])
        await deliveries.delete_for_scope(conn, local["message_scope_id"])
        await applier.delete_scope(conn, local["message_scope_id"])
        await deliveries.delete_member_feed(conn, local["workspace_id"], local["author_member_id"])
        await conn.execute("DELETE FROM members WHERE workspace_id = $1 AND id = $2", local["workspace_id"],
                           local["author_member_id"])
    await _release_platform_name(conn, root["normalized_name"])
    await conn.execute("DELETE FROM platform_service_accounts WHERE id = $1", account_id)
    return root, locals_


# --- audit ---------------------------------------------------------------------------------------------

async def audit_events(conn: asyncpg.Connection, account_id: str | None, before: str | None,
                       limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT * FROM platform_service_account_audit_events WHERE ($1::text IS NULL "
        "OR details ->> 'platform_service_account_id' = $1) AND ($2::text IS NULL OR id < $2) "
        "ORDER BY id DESC LIMIT $3", account_id, before, limit)
