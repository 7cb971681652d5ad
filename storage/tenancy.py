"""Tenancy repositories: every SQL statement for accounts, workspaces,
memberships, members, invitations, API keys and execution states.

Each public function is a unit of work `fn(conn, ...)` for `Database.run` /
`Database.transaction`.  Every lookup of a tenant row uses the workspace id
and the resource id together.  Every write that belongs to a workspace first
passes the execution-generation fence (`pass_write_fence`), whose shared lock
is held until commit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from domain.credentials import CredentialProof
from domain.service_accounts import LifecycleChange
from storage import human_lifecycle, platform_inputs
from storage.errors import Conflict, Forbidden, NotFound, WriteFenced
from storage.ids import new_id

AUTH_CHANNEL = "scopewire_auth"


async def notify_auth_change(conn: asyncpg.Connection, kind: str, **ids: str) -> None:
    """Tell every server process (after commit) that credentials or memberships changed."""
    await conn.execute("SELECT pg_notify($1, $2)", AUTH_CHANNEL, json.dumps({"kind": kind, **ids}))


# --- execution fence (workspace-multi-tenant.md §10.3) ----------------------------------

WRITABLE_STATES = ("active",)


async def pass_write_fence(conn: asyncpg.Connection, workspace_id: str, generation: int) -> None:
    """Hold a shared lock on the workspace's execution state until commit and
    refuse a stale generation or a fenced workspace.  Must run inside the write
    transaction, before its first write."""
    row = await conn.fetchrow(
        "SELECT active_generation, write_fenced, state FROM workspace_execution_states "
        "WHERE workspace_id = $1 FOR SHARE",
        workspace_id,
    )
    if row is None:
        raise NotFound("workspace")
    if row["write_fenced"] or row["active_generation"] != generation or row["state"] not in WRITABLE_STATES:
        raise WriteFenced(
            f"write refused: generation {generation}, active {row['active_generation']}, "
            f"fenced={row['write_fenced']}, state={row['state']}"
        )


async def execution_state_for_share(conn: asyncpg.Connection, workspace_id: str) -> asyncpg.Record:
    """The execution state under a shared lock held until commit, for callers
    that check several commands' generations against it at once."""
    row = await conn.fetchrow(
        "SELECT active_generation, write_fenced, state FROM workspace_execution_states "
        "WHERE workspace_id = $1 FOR SHARE",
        workspace_id,
    )
    if row is None:
        raise NotFound("workspace")
    return row


async def fence_workspace(conn: asyncpg.Connection, workspace_id: str, *, write_fenced: bool,
                          new_generation: bool) -> int:
    """Take the exclusive lock (waiting for in-flight writers to commit or roll
    back), then set write_fenced and/or advance the generation.  Returns the
    active generation afterwards."""
    row = await conn.fetchrow(
        "SELECT active_generation FROM workspace_execution_states WHERE workspace_id = $1 FOR UPDATE",
        workspace_id,
    )
    if row is None:
        raise NotFound("workspace")
    generation = row["active_generation"] + (1 if new_generation else 0)
    await conn.execute(
        "UPDATE workspace_execution_states SET write_fenced = $2, active_generation = $3, updated_at = now() "
        "WHERE workspace_id = $1",
        workspace_id, write_fenced, generation,
    )
    await notify_auth_change(conn, "workspace", workspace_id=workspace_id)
    return generation


async def current_generation(conn: asyncpg.Connection, workspace_id: str) -> int:
    generation = await conn.fetchval(
        "SELECT active_generation FROM workspace_execution_states WHERE workspace_id = $1", workspace_id
    )
    if generation is None:
        raise NotFound("workspace")
    return generation


# --- instance and edition ---------------------------------------------------------------

async def instance_edition(conn: asyncpg.Connection) -> str | None:
    return await conn.fetchval("SELECT edition FROM instance_metadata")


@dataclass(frozen=True)
class NewWorkspace:
    workspace_id: str
    account_id: str
    membership_id: str
    member_id: str
    account_created: bool


async def _ensure_account(conn: asyncpg.Connection, email: str, display_name: str,
                          password_hash: str | None) -> tuple[str, bool]:
    existing = await conn.fetchval("SELECT id FROM accounts WHERE email_normalized = $1", email)
    if existing is not None:
        return existing, False
    account_id = new_id("acc")
    await conn.execute(
        "INSERT INTO accounts (id, email_normalized, display_name) VALUES ($1, $2, $3)",
        account_id, email, display_name,
    )
    if password_hash is not None:
        await conn.execute(
            "INSERT INTO local_credentials (account_id, password_hash) VALUES ($1, $2)", account_id, password_hash
        )
    return account_id, True


async def _unique_handle(conn: asyncpg.Connection, workspace_id: str, wanted: str) -> str:
    """`wanted`, or `wanted-2`, `wanted-3`... whichever is free in the workspace."""
    taken = {
        r["handle"]
        for r in await conn.fetch(
            "SELECT handle FROM members WHERE workspace_id = $1 AND (handle = $2 OR handle LIKE $3)",
            workspace_id, wanted, wanted + "-%",
        )
    }
    if wanted not in taken:
        return wanted
    n = 2
    while f"{wanted}-{n}" in taken:
        n += 1
    return f"{wanted}-{n}"


async def add_human_member(conn: asyncpg.Connection, workspace_id: str, account_id: str, role: str,
                     invited_by: str | None) -> tuple[str, str]:
    """Create (or reactivate) the membership and its human member; returns their ids."""
    account = await conn.fetchrow("SELECT email_normalized, display_name FROM accounts WHERE id = $1", account_id)
    existing = await conn.fetchrow(
        "SELECT m.id, m.status, mem.id AS member_id FROM workspace_memberships m "
        "JOIN members mem ON mem.workspace_id = m.workspace_id AND mem.workspace_membership_id = m.id "
        "WHERE m.workspace_id = $1 AND m.account_id = $2 FOR UPDATE OF m",
        workspace_id, account_id,
    )
    if existing is not None:
        if existing["status"] == "active":
            raise Conflict("already_member", "the account is already an active member")
        await conn.execute(
            "UPDATE workspace_memberships SET status = 'active', role = $3, projection_revision = projection_revision + 1, "
            "updated_at = now(), joined_at = now() WHERE workspace_id = $1 AND id = $2",
            workspace_id, existing["id"], role,
        )
        await conn.execute(
            "UPDATE members SET status = 'active', updated_at = now() WHERE workspace_id = $1 AND id = $2",
            workspace_id, existing["member_id"],
        )
        await human_lifecycle.record_human_lifecycle(conn, workspace_id, existing["member_id"], "activated")
        return existing["id"], existing["member_id"]
    membership_id, member_id = new_id("wmb"), new_id("mem")
    await conn.execute(
        "INSERT INTO workspace_memberships (id, workspace_id, account_id, role, invited_by_account_id) "
        "VALUES ($1, $2, $3, $4, $5)",
        membership_id, workspace_id, account_id, role, invited_by,
    )
    handle = await _unique_handle(conn, workspace_id, _handle_from_email(account["email_normalized"]))
    await conn.execute(
        "INSERT INTO members (id, workspace_id, kind, account_id, workspace_membership_id, handle, display_name) "
        "VALUES ($1, $2, 'human', $3, $4, $5, $6)",
        member_id, workspace_id, account_id, membership_id, handle, account["display_name"],
    )
    await human_lifecycle.record_human_lifecycle(conn, workspace_id, member_id, "activated")
    return membership_id, member_id


def _handle_from_email(email: str) -> str:
    local = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_.-") else "-" for ch in email.split("@")[0].lower())
    local = local.strip("-_.")[:48]
    return local if local and local[0].isalnum() else f"user{local}"[:48] or "user"


async def create_workspace(conn: asyncpg.Connection, *, instance_id: str, name: str, slug: str, type: str,
                           owner_email: str, owner_display_name: str, owner_password_hash: str | None,
                           single_edition: bool) -> NewWorkspace:
    """Workspace + execution state (generation 1, active) + owner account (if
    new), owner membership and owner member, in the caller's transaction."""
    account_id, created = await _ensure_account(conn, owner_email, owner_display_name, owner_password_hash)
    workspace_id = new_id("wsp")
    try:
        await conn.execute(
            "INSERT INTO workspaces (id, instance_id, name, slug, type, status, created_by_account_id, single_edition_slot) "
            "VALUES ($1, $2, $3, $4, $5, 'active', $6, $7)",
            workspace_id, instance_id, name, slug, type, account_id, 1 if single_edition else None,
        )
    except asyncpg.UniqueViolationError as exc:
        if "single_edition" in (exc.constraint_name or ""):
            raise Conflict("edition_limit", "this single-workspace instance already has its workspace") from None
        raise Conflict("slug_taken", f"workspace slug {slug!r} is taken") from None
    await conn.execute(
        "INSERT INTO workspace_execution_states (workspace_id, instance_id) VALUES ($1, $2)", workspace_id, instance_id
    )
    membership_id, member_id = await add_human_member(conn, workspace_id, account_id, "owner", None)
    # Every platform service account gets an instance in the new workspace (service-account §2.4).
    await platform_inputs.record_workspace_created(conn, workspace_id)
    return NewWorkspace(workspace_id, account_id, membership_id, member_id, created)


async def initialize_instance(conn: asyncpg.Connection, *, instance_id: str, edition: str, **workspace) -> NewWorkspace:
    """`scopewire init`: instance row, first account, its workspace and owner
    membership — one transaction, once."""
    try:
        await conn.execute("INSERT INTO instance_metadata (instance_id, edition) VALUES ($1, $2)", instance_id, edition)
    except asyncpg.UniqueViolationError:
        raise Conflict("already_initialized", "this instance is already initialised") from None
    return await create_workspace(conn, instance_id=instance_id, single_edition=edition == "single", **workspace)


async def instance_id(conn: asyncpg.Connection) -> str:
    value = await conn.fetchval("SELECT instance_id FROM instance_metadata")
    if value is None:
        raise Conflict("not_initialized", "run `scopewire init` first")
    return value


async def set_workspace_status(conn: asyncpg.Connection, workspace_id: str, status: str) -> None:
    updated = await conn.execute(
        "UPDATE workspaces SET status = $2, updated_at = now() WHERE id = $1", workspace_id, status
    )
    if updated == "UPDATE 0":
        raise NotFound("workspace")
    await notify_auth_change(conn, "workspace", workspace_id=workspace_id)


async def list_workspaces(conn: asyncpg.Connection, account_id: str | None = None) -> list[asyncpg.Record]:
    """All workspaces (operator view), or those where the account is an active member."""
    if account_id is None:
        return await conn.fetch(
            "SELECT w.id, w.name, w.slug, w.type, w.status, NULL::text AS role, NULL::text AS member_id "
            "FROM workspaces w ORDER BY w.id"
        )
    return await conn.fetch(
        "SELECT w.id, w.name, w.slug, w.type, w.status, m.role, mem.id AS member_id FROM workspace_memberships m "
        "JOIN workspaces w ON w.id = m.workspace_id "
        "JOIN members mem ON mem.workspace_id = m.workspace_id AND mem.workspace_membership_id = m.id "
        "WHERE m.account_id = $1 AND m.status = 'active' ORDER BY w.id",
        account_id,
    )


async def key_workspace(conn: asyncpg.Connection, api_key_id: str) -> list[asyncpg.Record]:
    """The one workspace an API key is bound to, shaped like list_workspaces rows."""
    return await conn.fetch(
        "SELECT w.id, w.name, w.slug, w.type, w.status, m.role, mem.id AS member_id FROM api_keys k "
        "JOIN workspaces w ON w.id = k.workspace_id "
        "JOIN members mem ON mem.workspace_id = k.workspace_id AND mem.id = k.member_id "
        "LEFT JOIN workspace_memberships m ON m.workspace_id = mem.workspace_id AND m.id = mem.workspace_membership_id "
        "WHERE k.id = $1",
        api_key_id,
    )


async def first_owner_account(conn: asyncpg.Connection, workspace_id: str) -> str:
    """The account recorded as creator of operator-made rows (the CLI has no account)."""
    return await conn.fetchval(
        "SELECT account_id FROM workspace_memberships WHERE workspace_id = $1 AND role = 'owner' "
        "AND status = 'active' ORDER BY id LIMIT 1",
        workspace_id,
    )


async def workspace_by_slug_or_id(conn: asyncpg.Connection, ref: str) -> str:
    found = await conn.fetchval("SELECT id FROM workspaces WHERE id = $1 OR slug = $1", ref)
    if found is None:
        raise NotFound("workspace")
    return found


# --- accounts and principals -------------------------------------------------------------

async def account_for_login(conn: asyncpg.Connection, email: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT a.id, a.status, a.token_version, c.password_hash FROM accounts a "
        "LEFT JOIN local_credentials c ON c.account_id = a.id WHERE a.email_normalized = $1",
        email,
    )


async def account_session_state(conn: asyncpg.Connection, account_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT id, status, token_version FROM accounts WHERE id = $1", account_id)


async def account_profile(conn: asyncpg.Connection, account_id: str) -> asyncpg.Record:
    row = await conn.fetchrow("SELECT id, email_normalized, display_name FROM accounts WHERE id = $1", account_id)
    if row is None:
        raise NotFound("account")
    return row


async def bump_token_version(conn: asyncpg.Connection, account_id: str) -> int:
    version = await conn.fetchval(
        "UPDATE accounts SET token_version = token_version + 1, updated_at = now() WHERE id = $1 RETURNING token_version",
        account_id,
    )
    if version is None:
        raise NotFound("account")
    await notify_auth_change(conn, "account", account_id=account_id)
    return version


async def set_password(conn: asyncpg.Connection, account_id: str, password_hash: str) -> None:
    await conn.execute(
        "INSERT INTO local_credentials (account_id, password_hash) VALUES ($1, $2) "
        "ON CONFLICT (account_id) DO UPDATE SET password_hash = EXCLUDED.password_hash, password_updated_at = now()",
        account_id, password_hash,
    )


_CONTEXT_COLUMNS = (
    "w.id AS workspace_id, w.status AS workspace_status, e.active_generation, e.write_fenced, "
    "mem.id AS member_id, mem.kind AS member_kind, mem.status AS member_status, mem.handle, "
    "m.id AS membership_id, m.role, m.status AS membership_status, m.projection_revision AS membership_revision"
)
# From a membership `m` to its workspace, execution state and member (the columns above).
# A request context is a chain of one-row lookups, written as LATERAL subqueries kept apart
# by OFFSET 0 rather than as joins, so the planner has no join order to search: a write
# batch's gate, which reads its senders' contexts, planned in 2.3 ms with joins, 0.7 ms so,
# and a pooled connection plans it again whenever autovacuum passes over a table it writes.
_MEMBERSHIP_CONTEXT_JOINS = (
    "CROSS JOIN LATERAL (SELECT w.id, w.status FROM workspaces w WHERE w.id = m.workspace_id OFFSET 0) w "
    "CROSS JOIN LATERAL (SELECT e.active_generation, e.write_fenced FROM workspace_execution_states e "
    "WHERE e.workspace_id = m.workspace_id OFFSET 0) e "
    "CROSS JOIN LATERAL (SELECT mem.id, mem.kind, mem.status, mem.handle FROM members mem "
    "WHERE mem.workspace_id = m.workspace_id AND mem.workspace_membership_id = m.id OFFSET 0) mem"
)


async def account_workspace_context(conn: asyncpg.Connection, account_id: str,
                                    workspace_id: str) -> asyncpg.Record | None:
    """Membership, member, workspace and execution state of an account in one
    workspace; None when it has no membership there (any status)."""
    return await conn.fetchrow(
        f"SELECT {_CONTEXT_COLUMNS} FROM workspace_memberships m {_MEMBERSHIP_CONTEXT_JOINS} "
        "WHERE m.workspace_id = $1 AND m.account_id = $2",
        workspace_id, account_id,
    )


async def only_workspace_of(conn: asyncpg.Connection, account_id: str) -> str | None:
    """The single-workspace edition's workspace, when the account belongs to it."""
    return await conn.fetchval(
        "SELECT m.workspace_id FROM workspace_memberships m JOIN workspaces w ON w.id = m.workspace_id "
        "WHERE m.account_id = $1 AND w.single_edition_slot = 1",
        account_id,
    )


_API_KEY_CONTEXT = (
    "SELECT k.id AS api_key_id, k.status AS key_status, k.expires_at, k.scopes, k.last_used_at, "
    "w.id AS workspace_id, w.status AS workspace_status, e.active_generation, e.write_fenced, "
    "mem.id AS member_id, mem.kind AS member_kind, mem.status AS member_status, mem.handle, "
    "mem.account_id, m.id AS membership_id, m.role, m.status AS membership_status, "
    "m.projection_revision AS membership_revision, owner.status AS owner_status "
    "FROM api_keys k "  # lookups, not joins: see _MEMBERSHIP_CONTEXT_JOINS
    "CROSS JOIN LATERAL (SELECT w.id, w.status FROM workspaces w WHERE w.id = k.workspace_id OFFSET 0) w "
    "CROSS JOIN LATERAL (SELECT e.active_generation, e.write_fenced FROM workspace_execution_states e "
    "WHERE e.workspace_id = k.workspace_id OFFSET 0) e "
    "CROSS JOIN LATERAL (SELECT mem.id, mem.kind, mem.status, mem.handle, mem.account_id, mem.workspace_id, "
    "mem.workspace_membership_id, mem.owner_member_id FROM members mem "
    "WHERE mem.workspace_id = k.workspace_id AND mem.id = k.member_id OFFSET 0) mem "
    "LEFT JOIN LATERAL (SELECT m.id, m.role, m.status, m.projection_revision FROM workspace_memberships m "
    "WHERE m.workspace_id = mem.workspace_id AND m.id = mem.workspace_membership_id OFFSET 0) m ON true "
    "LEFT JOIN LATERAL (SELECT owner.status FROM members owner "
    "WHERE owner.workspace_id = mem.workspace_id AND owner.id = mem.owner_member_id OFFSET 0) owner ON true "
)


async def api_key_context(conn: asyncpg.Connection, key_hash: bytes) -> asyncpg.Record | None:
    """The key and everything its principal needs; None for an unknown key.
    Marks last_used_at at most once a minute so auth stays read-mostly."""
    row = await conn.fetchrow(_API_KEY_CONTEXT + "WHERE k.key_hash = $1", key_hash)
    if row is not None:
        await conn.execute(
            "UPDATE api_keys SET last_used_at = now() WHERE id = $1 "
            "AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')",
            row["api_key_id"],
        )
    return row


async def api_key_context_by_id(conn: asyncpg.Connection, api_key_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(_API_KEY_CONTEXT + "WHERE k.id = $1", api_key_id)


# --- proofs of cached request contexts (domain/credentials.py) ------------------------------

# The columns a request context is derived from (server/auth.py): a session's
# account state and membership context; a key's context row but its last use.
_SESSION_PROOF = ("status", "token_version")
_CONTEXT_PROOF = ("workspace_status", "active_generation", "write_fenced", "member_id", "member_kind",
                  "member_status", "handle", "membership_id", "role", "membership_status", "membership_revision")
_KEY_PROOF = ("key_status", "expires_at", "scopes", *_CONTEXT_PROOF, "owner_status")


def _values(row: asyncpg.Record, columns: tuple[str, ...]) -> tuple:
    return tuple(tuple(v) if isinstance(v, list) else v for v in (row[c] for c in columns))


def key_proof(row: asyncpg.Record) -> CredentialProof:
    """The proof of a context built from `api_key_context_by_id`'s row."""
    expires_at = row["expires_at"].timestamp() if row["expires_at"] is not None else None
    return CredentialProof("api_key", row["api_key_id"], row["workspace_id"], _values(row, _KEY_PROOF), expires_at)


def session_proof(session: asyncpg.Record, context: asyncpg.Record) -> CredentialProof:
    """The proof of a context built from `account_session_state` and `account_workspace_context`."""
    return CredentialProof("account", session["id"], context["workspace_id"],
                           _values(session, _SESSION_PROOF) + _values(context, _CONTEXT_PROOF))


def _session_proof_rows(first: int) -> str:
    """The membership contexts of (account $first[i], workspace ${first + 1}[i]) with the accounts' state."""
    return (f"SELECT a.id, a.status, a.token_version, {_CONTEXT_COLUMNS} "
            f"FROM unnest(${first}::text[], ${first + 1}::text[]) AS wanted(account_id, workspace_id) "
            "JOIN accounts a ON a.id = wanted.account_id "
            "JOIN workspace_memberships m ON m.workspace_id = wanted.workspace_id AND m.account_id = a.id "
            f"{_MEMBERSHIP_CONTEXT_JOINS}")


def _with_digest(rows_sql: str, columns: tuple[str, ...]) -> str:
    """`rows_sql` with `proof_digest`: a SHA-256 of the proof's columns as PostgreSQL prints
    them, so a later statement can tell, without Python, that those rows have not changed since."""
    return (f"SELECT p.*, encode(sha256(convert_to(ROW({', '.join(f'p.{c}' for c in columns)})::text, 'UTF8')), "
            f"'hex') AS proof_digest FROM ({rows_sql}) p")


def proof_rows_query(proofs: set[CredentialProof], first: int) -> tuple[str, list] | None:
    """The SELECT of the current rows of `proofs` when all are of one kind, numbering its
    parameters from `first`, and its arguments: for a statement that reads them along with
    something else (a write batch's gate).  None for proofs of both kinds (`stale_proofs`)."""
    kinds = {p.kind for p in proofs}
    if kinds == {"api_key"}:
        return (_with_digest(_API_KEY_CONTEXT + f"WHERE k.id = ANY(${first}::text[])", _KEY_PROOF),
                [sorted({p.credential_id for p in proofs})])
    if kinds == {"account"}:
        pairs = sorted({(p.credential_id, p.workspace_id) for p in proofs})
        return (_with_digest(_session_proof_rows(first), _SESSION_PROOF + _CONTEXT_PROOF),
                [[a for a, _ in pairs], [w for _, w in pairs]])
    return None


def fresh_among(proofs: set[CredentialProof], rows: list[asyncpg.Record]) -> dict[CredentialProof, str]:
    """The proofs (of one kind) that `proof_rows_query`'s rows still match, each with its
    rows' digest (for `proofs_unchanged`)."""
    kind = next(iter(proofs)).kind if proofs else None
    current = {key_proof(row) if kind == "api_key" else session_proof(row, row): row["proof_digest"] for row in rows}
    return {proof: current[proof] for proof in proofs if proof in current}


def stale_among(proofs: set[CredentialProof], rows: list[asyncpg.Record]) -> set[CredentialProof]:
    """The proofs (of one kind) that `proof_rows_query`'s rows no longer match."""
    return proofs - fresh_among(proofs, rows).keys()


def proofs_unchanged(digests: dict[CredentialProof, str], first: int) -> tuple[str, list]:
    """A condition, with its parameters numbered from `first` and its arguments: true while
    the rows of each of `digests`' proofs (all of one kind, each found fresh by `fresh_among`)
    still have the digest they had then — so they still match the proof."""
    proofs = sorted(digests, key=lambda p: (p.credential_id, p.workspace_id))
    ids, digest_values = [p.credential_id for p in proofs], [digests[p] for p in proofs]
    kind = proofs[0].kind
    rows_sql, _ = proof_rows_query({proofs[0]}, first)  # the same parameters: ids (and workspaces) first
    if kind == "api_key":
        digests_at = first + 1
        joined = (f"unnest(${first}::text[], ${digests_at}::text[]) AS x(id, digest) "
                  "ON x.id = p.api_key_id AND x.digest = p.proof_digest")
        matched = "x.id || ' ' || x.digest"
        args = [ids, digest_values]
    else:
        digests_at = first + 2
        joined = (f"unnest(${first}::text[], ${first + 1}::text[], ${digests_at}::text[]) "
                  "AS x(id, workspace_id, digest) "
                  "ON x.id = p.id AND x.workspace_id = p.workspace_id AND x.digest = p.proof_digest")
        matched = "x.id || ' ' || x.workspace_id || ' ' || x.digest"
        args = [ids, [p.workspace_id for p in proofs], digest_values]
    # Each proof is one (credential, workspace, digest): all still match when as many distinct
    # ones match.  Two proofs of one credential (a context cached before a change) never both do.
    return (f"(SELECT count(DISTINCT {matched}) FROM ({rows_sql}) p JOIN {joined}) "
            f"= cardinality(${digests_at}::text[])", args)


async def stale_proofs(conn: asyncpg.Connection, proofs: set[CredentialProof]) -> set[CredentialProof]:
    """The proofs whose rows changed (or are gone) — at most two statements for
    any number of proofs, so a write batch re-checks all of its cached contexts at once."""
    stale: set[CredentialProof] = set()
    for kind in ("api_key", "account"):
        of_kind = {p for p in proofs if p.kind == kind}
        query = proof_rows_query(of_kind, 1)
        if query is not None:
            stale |= stale_among(of_kind, await conn.fetch(query[0], *query[1]))
    return stale


async def api_key_state(conn: asyncpg.Connection, api_key_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT status, expires_at FROM api_keys WHERE id = $1", api_key_id)


# --- members and roles ---------------------------------------------------------------------

async def list_members(conn: asyncpg.Connection, workspace_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT mem.id, mem.kind, mem.handle, mem.display_name, mem.status, mem.owner_member_id, mem.visibility, "
        "m.role, a.email_normalized AS email FROM members mem "
        "LEFT JOIN workspace_memberships m ON m.workspace_id = mem.workspace_id AND m.id = mem.workspace_membership_id "
        "LEFT JOIN accounts a ON a.id = mem.account_id "
        "WHERE mem.workspace_id = $1 ORDER BY mem.id",
        workspace_id,
    )


async def member_in_workspace(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT mem.id, mem.kind, mem.status, mem.owner_member_id, mem.account_id, m.id AS membership_id, "
        "m.role, m.status AS membership_status FROM members mem "
        "LEFT JOIN workspace_memberships m ON m.workspace_id = mem.workspace_id AND m.id = mem.workspace_membership_id "
        "WHERE mem.workspace_id = $1 AND mem.id = $2",
        workspace_id, member_id,
    )
    if row is None:
        raise NotFound("member")
    return row


async def member_by_handle_or_email(conn: asyncpg.Connection, workspace_id: str, ref: str) -> str:
    found = await conn.fetchval(
        "SELECT mem.id FROM members mem LEFT JOIN accounts a ON a.id = mem.account_id "
        "WHERE mem.workspace_id = $1 AND (mem.id = $2 OR mem.handle = $2 OR a.email_normalized = lower($2))",
        workspace_id, ref,
    )
    if found is None:
        raise NotFound("member")
    return found


async def _lock_workspace(conn: asyncpg.Connection, workspace_id: str) -> None:
    """Serializes membership mutations of one workspace (last-owner rule)."""
    if await conn.fetchval("SELECT 1 FROM workspaces WHERE id = $1 FOR UPDATE", workspace_id) is None:
        raise NotFound("workspace")


async def _active_owner_count(conn: asyncpg.Connection, workspace_id: str) -> int:
    return await conn.fetchval(
        "SELECT count(*) FROM workspace_memberships WHERE workspace_id = $1 AND role = 'owner' AND status = 'active'",
        workspace_id,
    )


async def lock_membership_target(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> asyncpg.Record:
    """Lock the workspace's membership set, then read the target human member."""
    await _lock_workspace(conn, workspace_id)
    target = await member_in_workspace(conn, workspace_id, member_id)
    if target["membership_id"] is None:
        raise Conflict("not_a_human_member", "only human members have workspace roles")
    return target


async def membership_role(conn: asyncpg.Connection, workspace_id: str, membership_id: str) -> str | None:
    """The actor's current role, read under the workspace lock (None if not active)."""
    return await conn.fetchval(
        "SELECT role FROM workspace_memberships WHERE workspace_id = $1 AND id = $2 AND status = 'active'",
        workspace_id, membership_id,
    )


async def set_role(conn: asyncpg.Connection, workspace_id: str, target: asyncpg.Record, role: str) -> None:
    """Caller has locked with lock_membership_target and checked RBAC."""
    if target["membership_status"] != "active":
        raise Conflict("inactive_member", "the membership is not active")
    if target["role"] == "owner" and role != "owner" and await _active_owner_count(conn, workspace_id) <= 1:
        raise Conflict("last_owner", "a workspace must keep at least one active owner")
    await conn.execute(
        "UPDATE workspace_memberships SET role = $3, projection_revision = projection_revision + 1, updated_at = now() "
        "WHERE workspace_id = $1 AND id = $2",
        workspace_id, target["membership_id"], role,
    )
    await notify_auth_change(conn, "membership", workspace_id=workspace_id, member_id=target["id"])


async def remove_member(conn: asyncpg.Connection, workspace_id: str,
                        target: asyncpg.Record) -> LifecycleChange:
    """Caller has locked with lock_membership_target and checked RBAC.  Returns what
    the removal did to service accounts (manager assignments it ended)."""
    if target["membership_status"] != "active":
        raise Conflict("inactive_member", "the membership is not active")
    if target["role"] == "owner" and await _active_owner_count(conn, workspace_id) <= 1:
        raise Conflict("last_owner", "a workspace must keep at least one active owner")
    await conn.execute(
        "UPDATE workspace_memberships SET status = 'removed', projection_revision = projection_revision + 1, "
        "updated_at = now() WHERE workspace_id = $1 AND id = $2",
        workspace_id, target["membership_id"],
    )
    await conn.execute(
        "UPDATE members SET status = 'removed', updated_at = now() WHERE workspace_id = $1 AND id = $2",
        workspace_id, target["id"],
    )
    change = await human_lifecycle.record_human_lifecycle(conn, workspace_id, target["id"], "deactivated")
    await notify_auth_change(conn, "membership", workspace_id=workspace_id, member_id=target["id"])
    return change


async def transfer_owner(conn: asyncpg.Connection, workspace_id: str, from_member_id: str, to_member_id: str) -> None:
    """The current owner hands ownership to another active human member and becomes admin."""
    await _lock_workspace(conn, workspace_id)
    giver = await member_in_workspace(conn, workspace_id, from_member_id)
    taker = await member_in_workspace(conn, workspace_id, to_member_id)
    if taker["membership_id"] is None or taker["membership_status"] != "active":
        raise Conflict("inactive_member", "ownership can only go to an active human member")
    if giver["role"] != "owner" or giver["membership_status"] != "active":
        raise Conflict("not_owner", "only an active owner can transfer ownership")
    if giver["id"] == taker["id"]:
        raise Conflict("same_member", "the member already owns the workspace")
    for membership_id, role in ((taker["membership_id"], "owner"), (giver["membership_id"], "admin")):
        await conn.execute(
            "UPDATE workspace_memberships SET role = $3, projection_revision = projection_revision + 1, "
            "updated_at = now() WHERE workspace_id = $1 AND id = $2",
            workspace_id, membership_id, role,
        )
    for member_id in (giver["id"], taker["id"]):
        await notify_auth_change(conn, "membership", workspace_id=workspace_id, member_id=member_id)


async def create_agent_or_service(conn: asyncpg.Connection, workspace_id: str, *, kind: str, handle: str,
                                  display_name: str, owner_member_id: str | None, visibility: str | None) -> str:
    member_id = new_id("mem")
    try:
        await conn.execute(
            "INSERT INTO members (id, workspace_id, kind, owner_member_id, visibility, handle, display_name) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7)",
            member_id, workspace_id, kind, owner_member_id, visibility, handle, display_name,
        )
    except asyncpg.UniqueViolationError:
        raise Conflict("handle_taken", f"handle {handle!r} is taken in this workspace") from None
    except asyncpg.ForeignKeyViolationError:
        raise NotFound("member") from None
    return member_id


# --- invitations ---------------------------------------------------------------------------

async def create_invitation(conn: asyncpg.Connection, workspace_id: str, *, email: str, role: str, token_hash: bytes,
                            expires_at: datetime, created_by_account_id: str) -> str:
    """Revokes the live invitation for the same email (re-send), then creates a new one."""
    if await conn.fetchval(
        "SELECT 1 FROM workspace_memberships m JOIN accounts a ON a.id = m.account_id "
        "WHERE m.workspace_id = $1 AND a.email_normalized = $2 AND m.status = 'active'",
        workspace_id, email,
    ):
        raise Conflict("already_member", "that email already belongs to an active member")
    await conn.execute(
        "UPDATE workspace_invitations SET status = 'revoked', revoked_at = now(), updated_at = now() "
        "WHERE workspace_id = $1 AND normalized_email = $2 AND status = 'pending'",
        workspace_id, email,
    )
    invitation_id = new_id("inv")
    await conn.execute(
        "INSERT INTO workspace_invitations (id, workspace_id, normalized_email, role, token_hash, expires_at, "
        "created_by_account_id) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        invitation_id, workspace_id, email, role, token_hash, expires_at, created_by_account_id,
    )
    return invitation_id


async def list_invitations(conn: asyncpg.Connection, workspace_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, normalized_email AS email, role, "
        "CASE WHEN status = 'pending' AND expires_at <= now() THEN 'expired' ELSE status END AS status, "
        "expires_at, accepted_at, revoked_at, created_at FROM workspace_invitations "
        "WHERE workspace_id = $1 ORDER BY id",
        workspace_id,
    )


async def revoke_invitation(conn: asyncpg.Connection, workspace_id: str, invitation_id: str) -> None:
    status = await conn.fetchval(
        "SELECT status FROM workspace_invitations WHERE workspace_id = $1 AND id = $2 FOR UPDATE",
        workspace_id, invitation_id,
    )
    if status is None:
        raise NotFound("invitation")
    if status != "pending":
        raise Conflict(f"invitation_{status}", f"the invitation is already {status}")
    await conn.execute(
        "UPDATE workspace_invitations SET status = 'revoked', revoked_at = now(), updated_at = now() "
        "WHERE workspace_id = $1 AND id = $2",
        workspace_id, invitation_id,
    )


async def invitation_email(conn: asyncpg.Connection, token_hash: bytes) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT normalized_email FROM workspace_invitations WHERE token_hash = $1", token_hash)


async def lock_invitation(conn: asyncpg.Connection, token_hash: bytes) -> asyncpg.Record:
    """Lock a usable invitation by token hash: concurrent acceptances queue here
    and all but the first find it accepted."""
    row = await conn.fetchrow(
        "SELECT i.id, i.workspace_id, i.normalized_email, i.role, i.status, i.expires_at <= now() AS expired, "
        "i.created_by_account_id, w.status AS workspace_status FROM workspace_invitations i "
        "JOIN workspaces w ON w.id = i.workspace_id WHERE i.token_hash = $1 FOR UPDATE OF i",
        token_hash,
    )
    if row is None:
        raise NotFound("invitation")
    if row["status"] != "pending":
        raise Conflict(f"invitation_{row['status']}", f"the invitation was already {row['status']}")
    if row["expired"]:
        raise Conflict("invitation_expired", "the invitation has expired")
    if row["workspace_status"] != "active":
        raise Forbidden("the workspace is not active")
    return row


async def accept_invitation(conn: asyncpg.Connection, invitation: asyncpg.Record, account_id: str) -> tuple[str, str]:
    """In the transaction that locked the invitation: membership + member, then consume it."""
    membership_id, member_id = await add_human_member(
        conn, invitation["workspace_id"], account_id, invitation["role"], invitation["created_by_account_id"]
    )
    await conn.execute(
        "UPDATE workspace_invitations SET status = 'accepted', accepted_at = now(), accepted_by_account_id = $2, "
        "updated_at = now() WHERE id = $1",
        invitation["id"], account_id,
    )
    return membership_id, member_id


async def create_account(conn: asyncpg.Connection, email: str, display_name: str, password_hash: str) -> str:
    account_id, created = await _ensure_account(conn, email, display_name, password_hash)
    if not created:
        raise Conflict("account_exists", "an account with that email exists; sign in to accept")
    return account_id


# --- API keys --------------------------------------------------------------------------------

async def create_api_key(conn: asyncpg.Connection, workspace_id: str, *, member_id: str, name: str, key_hash: bytes,
                         scopes: list[str], expires_at: datetime | None, created_by_account_id: str | None) -> str:
    key_id = new_id("key")
    try:
        await conn.execute(
            "INSERT INTO api_keys (id, workspace_id, member_id, name, key_hash, scopes, expires_at, created_by_account_id) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            key_id, workspace_id, member_id, name, key_hash, scopes, expires_at, created_by_account_id,
        )
    except asyncpg.ForeignKeyViolationError:
        raise NotFound("member") from None
    return key_id


async def list_api_keys(conn: asyncpg.Connection, workspace_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT k.id, k.member_id, k.name, k.scopes, k.status, k.expires_at, k.last_used_at, k.created_at, "
        "k.revoked_at FROM api_keys k WHERE k.workspace_id = $1 ORDER BY k.id",
        workspace_id,
    )


async def api_key_in_workspace(conn: asyncpg.Connection, workspace_id: str, api_key_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT k.id, k.member_id, k.status, mem.owner_member_id FROM api_keys k "
        "JOIN members mem ON mem.workspace_id = k.workspace_id AND mem.id = k.member_id "
        "WHERE k.workspace_id = $1 AND k.id = $2",
        workspace_id, api_key_id,
    )
    if row is None:
        raise NotFound("api_key")
    return row


async def revoke_api_key(conn: asyncpg.Connection, workspace_id: str, api_key_id: str) -> None:
    updated = await conn.execute(
        "UPDATE api_keys SET status = 'revoked', revoked_at = now() WHERE workspace_id = $1 AND id = $2 "
        "AND status = 'active'",
        workspace_id, api_key_id,
    )
    if updated == "UPDATE 0":
        await api_key_in_workspace(conn, workspace_id, api_key_id)  # NotFound when it is not there
        raise Conflict("api_key_revoked", "the key is already revoked")
    await notify_auth_change(conn, "api_key", api_key_id=api_key_id)
