"""Tenancy operations shared by the WebSocket commands and the admin CLI.

Each takes the Database and an explicit RequestContext, checks permissions
with the fixed matrix, and runs one transaction whose first step is the
execution-generation write fence.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import asyncpg
import trio

from protocol.errors import ErrorCode, ProtocolError
from protocol.validation import name_text_problem
from domain.service_accounts import LifecycleChange
from server.auth import Authenticator, Session, normalize_email
from server.context import Principal, RequestContext, WorkspaceContext
from server.credentials import (
    API_KEY_PREFIX,
    INVITATION_PREFIX,
    generate_password,
    generate_secret,
    hash_password,
    secret_hash,
)
from server.rbac import Permission, Role, key_scope_permissions, may_change_role, may_remove
from storage import tenancy
from storage.bridge import Database
from storage.errors import Conflict
from storage.ids import is_valid_id

MIN_PASSWORD_LENGTH = 8


def _forbidden(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.FORBIDDEN, message)


def _check_names(**fields: str | None) -> None:
    """protocol.validation's name rule, here for the admin CLI too (WebSocket
    frames have passed it at the boundary already)."""
    for field, value in fields.items():
        problem = name_text_problem(value) if value is not None else None
        if problem is not None:
            raise ProtocolError(ErrorCode.INVALID, f"{field}: {problem}", details={"field": field})


def _require_id(value: str, prefix: str, what: str) -> str:
    """Malformed ids cannot name anything in any workspace: answer not_found."""
    if not is_valid_id(value, prefix):
        raise ProtocolError(ErrorCode.NOT_FOUND, f"{what} not found")
    return value


async def _hash_new_password(password: str) -> str:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ProtocolError(ErrorCode.INVALID, f"passwords need at least {MIN_PASSWORD_LENGTH} characters")
    return await trio.to_thread.run_sync(hash_password, password)


async def _write(db: Database, workspace: WorkspaceContext, fn, *args: Any) -> Any:
    """One fenced write transaction in `workspace`."""

    async def unit(conn: asyncpg.Connection) -> Any:
        await tenancy.pass_write_fence(conn, workspace.workspace_id, workspace.execution_generation)
        return await fn(conn, *args)

    return await db.transaction(unit)


def _epoch(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


# --- instance and workspaces ----------------------------------------------------------------

@dataclass(frozen=True)
class Initialized:
    workspace_id: str
    account_id: str
    member_id: str
    password: str | None


async def init_instance(db: Database, *, email: str, display_name: str, workspace_name: str, workspace_slug: str,
                        edition: str, password: str | None = None) -> Initialized:
    """`scopewire init`: first account + the workspace + owner, in one transaction.
    Returns the generated password (shown once) unless one was given."""
    _check_names(email=email, display_name=display_name, name=workspace_name, slug=workspace_slug)
    generated = password is None
    password = password if password is not None else generate_password()
    password_hash = await _hash_new_password(password)
    result = await db.transaction(
        tenancy.initialize_instance, instance_id=secrets.token_hex(8), edition=edition, name=workspace_name,
        slug=workspace_slug, type="team", owner_email=normalize_email(email), owner_display_name=display_name,
        owner_password_hash=password_hash,
    )
    return Initialized(result.workspace_id, result.account_id, result.member_id, password if generated else None)


async def create_workspace(db: Database, ctx: RequestContext, *, name: str, slug: str,
                           owner_email: str | None = None, owner_display_name: str | None = None) -> Initialized:
    """Multi-workspace edition only. A session creates it for its own account;
    the operator (CLI) names the owner, whose account is created if new."""
    _check_names(name=name, slug=slug, email=owner_email, display_name=owner_display_name)
    edition = await db.run(tenancy.instance_edition)
    if edition is None:
        raise ProtocolError(ErrorCode.CONFLICT, "run `scopewire init` first")
    if edition != "multi":
        raise ProtocolError(ErrorCode.EDITION_LIMIT, "this single-workspace instance cannot create another workspace")
    password = None
    if ctx.principal.kind == "account":
        owner = await db.run(tenancy.account_profile, ctx.principal.account_id)
        owner_email, owner_display_name, password_hash = owner["email_normalized"], owner["display_name"], None
    elif ctx.principal.kind == "system":
        if owner_email is None:
            raise ProtocolError(ErrorCode.INVALID, "name the owner's email")
        owner_email = normalize_email(owner_email)
        password = generate_password()
        password_hash = await _hash_new_password(password)
        owner_display_name = owner_display_name or owner_email.split("@")[0]
    else:
        raise _forbidden("API keys cannot create workspaces")
    instance = await db.run(tenancy.instance_id)

    async def unit(conn: asyncpg.Connection) -> tenancy.NewWorkspace:
        return await tenancy.create_workspace(
            conn, instance_id=instance, name=name, slug=slug, type="team", owner_email=owner_email,
            owner_display_name=owner_display_name, owner_password_hash=password_hash, single_edition=False,
        )

    created = await db.transaction(unit)
    return Initialized(created.workspace_id, created.account_id, created.member_id,
                       password if created.account_created else None)


async def list_workspaces(db: Database, ctx: RequestContext) -> list[asyncpg.Record]:
    if ctx.principal.kind == "system":
        return await db.run(tenancy.list_workspaces)
    if ctx.principal.kind == "api_key":
        return await db.run(tenancy.key_workspace, ctx.principal.api_key_id)
    return await db.run(tenancy.list_workspaces, ctx.principal.account_id)


async def set_workspace_status(db: Database, ctx: RequestContext, status: str) -> None:
    """Suspend (owners) or resume (operator only: a suspended workspace refuses its members)."""
    workspace = ctx.require(Permission.WORKSPACE_DELETE)
    if status == "active" and ctx.principal.kind != "system":
        raise _forbidden("only the operator can resume a workspace")
    await db.transaction(tenancy.set_workspace_status, workspace.workspace_id, status)


# --- members ----------------------------------------------------------------------------------

async def list_members(db: Database, ctx: RequestContext) -> list[asyncpg.Record]:
    workspace = ctx.require(Permission.MEMBER_VIEW)
    return await db.run(tenancy.list_members, workspace.workspace_id)


async def _actor_role_under_lock(conn: asyncpg.Connection, workspace: WorkspaceContext) -> Role:
    """Re-read the actor's role inside the locked transaction: the context was
    loaded before the lock and a concurrent change may have demoted the actor."""
    if workspace.membership_id is None:
        return Role.OWNER  # the operator (CLI)
    role = await tenancy.membership_role(conn, workspace.workspace_id, workspace.membership_id)
    if role is None:
        raise _forbidden("your membership is not active")
    return Role(role)


async def set_member_role(db: Database, ctx: RequestContext, member_id: str, role: str) -> None:
    workspace = ctx.require(Permission.MEMBER_UPDATE_ROLE)
    _require_id(member_id, "mem", "member")
    new_role = Role(role)
    if new_role is Role.OWNER:
        raise _forbidden("ownership moves only by owner transfer")

    async def unit(conn: asyncpg.Connection) -> None:
        target = await tenancy.lock_membership_target(conn, workspace.workspace_id, member_id)
        actor_role = await _actor_role_under_lock(conn, workspace)
        if not may_change_role(actor_role, Role(target["role"]), new_role):
            raise _forbidden(f"a {actor_role.value} cannot change a {target['role']}'s role")
        await tenancy.set_role(conn, workspace.workspace_id, target, new_role.value)

    await _write(db, workspace, unit)


async def remove_member(db: Database, ctx: RequestContext, member_id: str) -> LifecycleChange:
    workspace = ctx.require(Permission.MEMBER_REMOVE)
    _require_id(member_id, "mem", "member")

    async def unit(conn: asyncpg.Connection) -> LifecycleChange:
        target = await tenancy.lock_membership_target(conn, workspace.workspace_id, member_id)
        actor_role = await _actor_role_under_lock(conn, workspace)
        if not may_remove(actor_role, Role(target["role"])):
            raise _forbidden(f"a {actor_role.value} cannot remove a {target['role']}")
        return await tenancy.remove_member(conn, workspace.workspace_id, target)

    return await _write(db, workspace, unit)


async def transfer_owner(db: Database, ctx: RequestContext, member_id: str) -> None:
    workspace = ctx.require(Permission.OWNER_TRANSFER)
    _require_id(member_id, "mem", "member")
    if workspace.member_id is None:
        raise _forbidden("ownership is transferred by an owner")
    await _write(db, workspace, tenancy.transfer_owner, workspace.workspace_id, workspace.member_id, member_id)


async def create_agent(db: Database, ctx: RequestContext, *, handle: str, display_name: str, visibility: str,
                       owner_member_id: str | None = None) -> str:
    """An agent member owned by the calling human (or, from the CLI, by `owner_member_id`).
    Public agents are workspace resources and need resource.manage."""
    _check_names(handle=handle, display_name=display_name)
    workspace = ctx.require(Permission.RESOURCE_MANAGE if visibility == "public" else Permission.MESSAGE_WRITE)
    if ctx.principal.kind == "system":
        owner = _require_id(owner_member_id or "", "mem", "owner member")
    elif workspace.member_kind == "human":
        owner = workspace.member_id
    else:
        raise _forbidden("only human members own agents")

    async def unit(conn: asyncpg.Connection) -> str:
        owner_row = await tenancy.member_in_workspace(conn, workspace.workspace_id, owner)
        if owner_row["kind"] != "human" or owner_row["status"] != "active":
            raise Conflict("owner_not_active_human", "an agent's owner must be an active human member")
        return await tenancy.create_agent_or_service(
            conn, workspace.workspace_id, kind="agent", handle=handle, display_name=display_name,
            owner_member_id=owner, visibility=visibility,
        )

    return await _write(db, workspace, unit)


async def create_service_member(db: Database, ctx: RequestContext, *, handle: str, display_name: str) -> str:
    _check_names(handle=handle, display_name=display_name)
    workspace = ctx.require(Permission.RESOURCE_MANAGE)
    return await _write(db, workspace, lambda conn: tenancy.create_agent_or_service(
        conn, workspace.workspace_id, kind="service", handle=handle, display_name=display_name,
        owner_member_id=None, visibility=None))


# --- invitations --------------------------------------------------------------------------------

@dataclass(frozen=True)
class IssuedInvitation:
    invitation_id: str
    token: str
    expires_at: datetime


async def create_invitation(db: Database, ctx: RequestContext, *, email: str, role: str,
                            expires_in_seconds: int) -> IssuedInvitation:
    workspace = ctx.require(Permission.MEMBER_INVITE)
    _check_names(email=email)
    if role == Role.OWNER.value:
        raise _forbidden("invitations never grant owner")
    token = generate_secret(INVITATION_PREFIX)
    expires_at = datetime.now(timezone.utc) + timedelta(seconds=expires_in_seconds)
    creator = ctx.principal.account_id or await db.run(tenancy.first_owner_account, workspace.workspace_id)
    invitation_id = await _write(db, workspace, lambda conn: tenancy.create_invitation(
        conn, workspace.workspace_id, email=normalize_email(email), role=role, token_hash=secret_hash(token),
        expires_at=expires_at, created_by_account_id=creator))
    return IssuedInvitation(invitation_id, token, expires_at)


async def list_invitations(db: Database, ctx: RequestContext) -> list[asyncpg.Record]:
    workspace = ctx.require(Permission.MEMBER_INVITE)
    return await db.run(tenancy.list_invitations, workspace.workspace_id)


async def revoke_invitation(db: Database, ctx: RequestContext, invitation_id: str) -> None:
    workspace = ctx.require(Permission.MEMBER_INVITE)
    _require_id(invitation_id, "inv", "invitation")
    await _write(db, workspace, tenancy.revoke_invitation, workspace.workspace_id, invitation_id)


@dataclass(frozen=True)
class Accepted:
    account_id: str
    workspace_id: str
    member_id: str
    session: Session | None


async def accept_invitation(db: Database, auth: Authenticator, *, token: str, principal: Principal | None,
                            password: str | None, display_name: str | None) -> Accepted:
    """Consume the invitation: create the account (new email) or use the signed-in
    / password-proven existing one, then create or reactivate the membership —
    locked, single-use, in one transaction."""
    _check_names(display_name=display_name)
    token_hash = secret_hash(token)
    peek = await db.run(tenancy.invitation_email, token_hash)
    if peek is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, "invitation not found")
    email = peek["normalized_email"]
    existing = await db.run(tenancy.account_for_login, email)
    new_password_hash = None
    if principal is not None and principal.kind == "account":
        if existing is None or existing["id"] != principal.account_id:
            raise _forbidden("this invitation is for another email address")
    elif principal is not None:
        raise _forbidden("API keys cannot accept invitations")
    elif existing is not None:
        if password is None or not await auth.check_password(existing["id"], email, password):
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "sign in (or give the account's password) to accept")
    else:
        if password is None:
            raise ProtocolError(ErrorCode.INVALID, "choose a password for the new account")
        new_password_hash = await _hash_new_password(password)

    async def unit(conn: asyncpg.Connection) -> tuple[str, str, str]:
        invitation = await tenancy.lock_invitation(conn, token_hash)
        generation = await tenancy.current_generation(conn, invitation["workspace_id"])
        await tenancy.pass_write_fence(conn, invitation["workspace_id"], generation)
        if existing is not None:
            account_id = existing["id"]
        else:
            account_id = await tenancy.create_account(conn, email, display_name or email.split("@")[0],
                                                      new_password_hash)
        _, member_id = await tenancy.accept_invitation(conn, invitation, account_id)
        return account_id, invitation["workspace_id"], member_id

    account_id, workspace_id, member_id = await db.transaction(unit)
    session = None
    if principal is None:
        state = await db.run(tenancy.account_session_state, account_id)
        session = auth.issue(account_id, state["token_version"])
    return Accepted(account_id, workspace_id, member_id, session)


# --- API keys -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IssuedKey:
    api_key_id: str
    key: str
    member_id: str
    created_at: datetime
    expires_at: datetime | None


def _check_key_target(workspace: WorkspaceContext, member: asyncpg.Record) -> None:
    """api_key.manage (owner, admin: §10.4) covers every member's keys but an
    owner's, which only an owner manages: a key acts with its member's
    permissions, so an admin minting one for an owner would become owner."""
    if member["role"] == Role.OWNER.value and workspace.role is not Role.OWNER:
        raise _forbidden("only an owner manages an owner's API keys")


async def create_api_key(db: Database, ctx: RequestContext, *, name: str, member_id: str | None,
                         scopes: list[str], expires_in_seconds: int | None) -> IssuedKey:
    workspace = ctx.require(Permission.API_KEY_MANAGE)
    _check_names(name=name)
    target = member_id or workspace.member_id
    if target is None:
        raise ProtocolError(ErrorCode.INVALID, "name the member the key acts as")
    _require_id(target, "mem", "member")
    member = await db.run(tenancy.member_in_workspace, workspace.workspace_id, target)
    _check_key_target(workspace, member)
    if member["status"] != "active":
        raise ProtocolError(ErrorCode.CONFLICT, "the member is not active")
    # A key never carries more than the session that made it could do.
    if ctx.principal.kind == "api_key" and not key_scope_permissions(scopes) <= key_scope_permissions(
            ctx.principal.key_scopes):
        raise _forbidden("a key cannot mint a key with wider scopes")
    key = generate_secret(API_KEY_PREFIX)
    now = datetime.now(timezone.utc)
    expires_at = now + timedelta(seconds=expires_in_seconds) if expires_in_seconds else None
    key_id = await _write(db, workspace, lambda conn: tenancy.create_api_key(
        conn, workspace.workspace_id, member_id=target, name=name, key_hash=secret_hash(key),
        scopes=sorted(set(scopes)), expires_at=expires_at, created_by_account_id=ctx.principal.account_id))
    return IssuedKey(key_id, key, target, now, expires_at)


async def list_api_keys(db: Database, ctx: RequestContext) -> list[asyncpg.Record]:
    workspace = ctx.require(Permission.API_KEY_MANAGE)
    return await db.run(tenancy.list_api_keys, workspace.workspace_id)


async def revoke_api_key(db: Database, ctx: RequestContext, api_key_id: str) -> None:
    workspace = ctx.require(Permission.API_KEY_MANAGE)
    _require_id(api_key_id, "key", "API key")
    key = await db.run(tenancy.api_key_in_workspace, workspace.workspace_id, api_key_id)
    _check_key_target(workspace, await db.run(tenancy.member_in_workspace, workspace.workspace_id,
                                              key["member_id"]))
    await _write(db, workspace, tenancy.revoke_api_key, workspace.workspace_id, api_key_id)


# --- sessions -------------------------------------------------------------------------------------

async def revoke_sessions(db: Database, ctx: RequestContext) -> int:
    if ctx.principal.kind != "account":
        raise _forbidden("only a signed-in account can revoke its sessions")
    return await db.transaction(tenancy.bump_token_version, ctx.principal.account_id)

