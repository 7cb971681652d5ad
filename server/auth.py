"""Authentication and workspace resolution: credential → Principal →
WorkspaceContext, with the error semantics of workspace-multi-tenant.md §9.5:
missing or other-workspace → not_found; same workspace, not permitted →
forbidden; no workspace where one is needed → workspace_required; inactive
membership or suspended workspace → forbidden."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import trio

from domain.credentials import CredentialProof
from protocol.errors import ErrorCode, ProtocolError
from server.context import SYSTEM, Principal, RequestContext, WorkspaceContext
from server.credentials import (
    DUMMY_PASSWORD_HASH,
    InvalidToken,
    SessionSigner,
    secret_hash,
    verify_password,
)
from server.limits import LoginThrottle
from server.rbac import Permission, Role, key_scope_permissions, permissions_for
from storage import messages, platform, tenancy
from storage.bridge import Database
from storage.ids import is_valid_id


def unauthenticated(message: str = "invalid credentials") -> ProtocolError:
    return ProtocolError(ErrorCode.UNAUTHENTICATED, message)


def normalize_email(email: str) -> str:
    normalized = email.strip().lower()
    local, _, domain = normalized.partition("@")
    if not local or not domain or " " in normalized:
        raise ProtocolError(ErrorCode.INVALID, "not an email address")
    return normalized


@dataclass(frozen=True)
class Session:
    token: str
    expires_at: int
    principal: Principal


# Scopes a connection's cached context remembers before it starts afresh.
CACHED_SCOPES_PER_CONNECTION = 32


@dataclass(slots=True)
class CachedContext:
    """A connection's request context for `message.send` (server/handlers.py),
    reused without a database round trip.  Safe because the send's batch
    transaction re-checks `proof` (a revocation committed before the write
    refuses it, and the request is then served afresh), and dropped as soon as
    this server hears of any credential or membership change (`generation`)."""

    workspace: WorkspaceContext
    proof: CredentialProof
    generation: int
    scopes: dict[str, Any]  # scope id → its readable `scope_for_viewer` row


class Authenticator:
    def __init__(self, db: Database, signer: SessionSigner, session_ttl_seconds: int,
                 throttle: LoginThrottle | None = None) -> None:
        self.db = db
        self.cache_generation = 0
        # The clock that expires sessions and keys (a test moves it).
        self.wall_clock: Callable[[], float] = time.time
        self.signer = signer
        self.session_ttl_seconds = session_ttl_seconds
        # Failed login and auth attempts, per account and per source address (server/limits.py).
        self.throttle = throttle if throttle is not None else LoginThrottle()

    def issue(self, account_id: str, token_version: int) -> Session:
        token, claims = self.signer.issue(account_id, token_version, self.session_ttl_seconds)
        return Session(token, claims.exp, Principal(kind="account", account_id=account_id, token_version=token_version))

    async def login(self, email: str, password: str, *, source: str | None = None) -> Session:
        """A session for the email and password; rate_limited while the account
        or the source address is throttled (the password is not checked then)."""
        email = normalize_email(email)
        keys = self.throttle.keys(account=email, address=source)
        with self.throttle.attempt(keys):
            row = await self.db.run(tenancy.account_for_login, email)
            stored = row["password_hash"] if row is not None and row["password_hash"] else DUMMY_PASSWORD_HASH
            # scrypt is deliberately slow: keep it off the event loop.
            matches = await trio.to_thread.run_sync(verify_password, password, stored)
            if row is None or not matches or row["status"] != "active":
                self.throttle.failed(keys)
                raise unauthenticated("invalid email or password")
            self.throttle.succeeded(keys)
        return self.issue(row["id"], row["token_version"])

    async def check_password(self, account_id: str, email: str, password: str) -> bool:
        row = await self.db.run(tenancy.account_for_login, email)
        if row is None or row["id"] != account_id or not row["password_hash"]:
            return False
        return await trio.to_thread.run_sync(verify_password, password, row["password_hash"])

    async def from_token(self, token: str, *, source: str | None = None) -> tuple[Principal, int]:
        """The principal of a valid, unrevoked session token, and its expiry.
        Failures count against the source address (see LoginThrottle)."""
        keys = self.throttle.keys(address=source)
        with self.throttle.attempt(keys):
            try:
                try:
                    claims = self.signer.verify(token)
                except InvalidToken as exc:
                    raise unauthenticated(str(exc)) from None
                principal = Principal(kind="account", account_id=sys.intern(claims.sub),
                                      token_version=claims.token_version)
                await self.revalidate(principal, expires_at=claims.exp)
            except ProtocolError:
                self.throttle.failed(keys)
                raise
        return principal, claims.exp

    async def from_api_key(self, key: str, *, source: str | None = None) -> tuple[Principal, WorkspaceContext]:
        keys = self.throttle.keys(address=source)
        with self.throttle.attempt(keys):
            row = await self.db.transaction(tenancy.api_key_context, secret_hash(key))
            if row is None:
                self.throttle.failed(keys)
                raise unauthenticated("invalid API key")
        # Interned: a connection keeps these for its lifetime, and its push state (and the
        # workspace's other connections) hold the same ids.
        principal = Principal(kind="api_key", account_id=row["account_id"], api_key_id=row["api_key_id"],
                              key_workspace_id=sys.intern(row["workspace_id"]),
                              key_member_id=sys.intern(row["member_id"]),
                              key_scopes=tuple(sys.intern(scope) for scope in row["scopes"]))
        return principal, _api_key_workspace_context(row, principal, self.wall_clock())

    async def from_operator_key(self, key: str, *, source: str | None = None) -> Principal:
        keys = self.throttle.keys(address=source)
        with self.throttle.attempt(keys):
            row = await self.db.run(platform.operator_for_key, secret_hash(key))
            if row is None:
                self.throttle.failed(keys)
                raise unauthenticated("invalid operator key")
        return Principal(kind="operator", operator_id=row["operator_id"], operator_key_id=row["key_id"])

    async def revalidate(self, principal: Principal, expires_at: float | None = None) -> None:
        """The credential is still good: not revoked, not expired, account active."""
        if principal.kind == "account":
            if expires_at is not None and expires_at <= self.wall_clock():
                raise unauthenticated("session token expired")
            _check_session(principal, await self.db.run(tenancy.account_session_state, principal.account_id))
        elif principal.kind == "api_key":
            row = await self.db.run(tenancy.api_key_state, principal.api_key_id)
            if row is None or row["status"] != "active" or (
                    row["expires_at"] is not None and row["expires_at"].timestamp() <= self.wall_clock()):
                raise unauthenticated("API key revoked or expired")
        elif principal.kind == "operator":
            if not await self.db.run(platform.operator_key_live, principal.operator_key_id):
                raise unauthenticated("operator key revoked or operator disabled")

    async def request_workspace(self, principal: Principal, expires_at: float | None, requested: str | None,
                                edition: str | None, scope_id: str | None = None
                                ) -> tuple[WorkspaceContext, dict[str, Any], CredentialProof | None]:
        """`revalidate` and `workspace_context` in one database unit — every
        workspace request re-checks its credential and its membership, and a
        busy server should pay one round trip for it, not three — plus, when
        the request names a scope, that scope as this member may see it
        (`messages.scope_for_viewer`), returned as {scope_id: row or None};
        and the proof of the context, when a cache may keep it (`CachedContext`)."""
        if scope_id is not None and not is_valid_id(scope_id, "scp"):
            scope_id = None
        if principal.kind == "api_key":
            # The key's workspace context re-checks the key itself.
            if requested is not None and (not is_valid_id(requested, "wsp") or requested != principal.key_workspace_id):
                raise ProtocolError(ErrorCode.NOT_FOUND, "workspace not found")
            row, scope = await self.db.run(_key_context_and_scope, principal.api_key_id, scope_id)
            if row is None:
                raise unauthenticated("API key revoked")
            context = _api_key_workspace_context(row, principal, self.wall_clock())
            return context, _prefetched(scope_id, scope), tenancy.key_proof(row)
        if principal.kind != "account" or requested is None or not is_valid_id(requested, "wsp"):
            await self.revalidate(principal, expires_at)
            return await self.workspace_context(principal, requested, edition), {}, None
        if expires_at is not None and expires_at <= self.wall_clock():
            raise unauthenticated("session token expired")
        session, row, scope = await self.db.run(_session_membership_and_scope, principal.account_id, requested,
                                                scope_id)
        _check_session(principal, session)
        return _account_workspace_context(row), _prefetched(scope_id, scope), tenancy.session_proof(session, row)

    def forget_cached_contexts(self) -> None:
        """Credentials or memberships changed somewhere (or may have: a lost
        listener): no cached context is served again."""
        self.cache_generation += 1

    def cache_context(self, workspace: WorkspaceContext, scopes: dict[str, Any],
                      proof: CredentialProof | None, previous: CachedContext | None) -> CachedContext | None:
        """What a connection may serve its next sends from (see `cached_context`)."""
        if proof is None:
            return previous
        if (previous is None or previous.proof != proof or previous.generation != self.cache_generation
                or len(previous.scopes) >= CACHED_SCOPES_PER_CONNECTION):
            previous = CachedContext(workspace, proof, self.cache_generation, {})
        # Only scopes the member may read: "not found" is never served from the cache.
        previous.scopes.update((scope_id, row) for scope_id, row in scopes.items()
                               if row is not None and row["readable"])
        return previous

    def cached_context(self, cached: CachedContext | None, expires_at: float | None, requested: str | None,
                       scope_id: Any) -> CachedContext | None:
        """The connection's cached context, if it may serve this request: nothing
        revoked since (as far as this server has heard — the write re-checks the
        proof in its own transaction), unexpired, the same workspace, a scope it read."""
        if (cached is None or cached.generation != self.cache_generation
                or (requested is not None and requested != cached.workspace.workspace_id)
                or scope_id not in cached.scopes):
            return None
        now = self.wall_clock()
        if any(expiry is not None and expiry <= now for expiry in (expires_at, cached.proof.expires_at)):
            return None
        return cached

    async def workspace_context(self, principal: Principal, requested: str | None,
                                edition: str | None) -> WorkspaceContext:
        """Resolve and re-validate the workspace a request acts in."""
        if requested is not None and not is_valid_id(requested, "wsp"):
            raise ProtocolError(ErrorCode.NOT_FOUND, "workspace not found")
        if principal.kind == "api_key":
            # A key cannot select another workspace; naming one answers not_found.
            if requested is not None and requested != principal.key_workspace_id:
                raise ProtocolError(ErrorCode.NOT_FOUND, "workspace not found")
            row = await self.db.run(tenancy.api_key_context_by_id, principal.api_key_id)
            if row is None:
                raise unauthenticated("API key revoked")
            return _api_key_workspace_context(row, principal, self.wall_clock())
        if principal.kind == "system":
            if requested is None:
                raise ProtocolError(ErrorCode.WORKSPACE_REQUIRED, "name a workspace")
            return await system_workspace_context(self.db, requested)
        assert principal.account_id is not None
        if requested is None:
            if edition != "single":
                raise ProtocolError(ErrorCode.WORKSPACE_REQUIRED, "this request needs a workspace_id")
            requested = await self.db.run(tenancy.only_workspace_of, principal.account_id)
            if requested is None:
                raise ProtocolError(ErrorCode.NOT_FOUND, "workspace not found")
        row = await self.db.run(tenancy.account_workspace_context, principal.account_id, requested)
        return _account_workspace_context(row)


async def _session_membership_and_scope(conn: asyncpg.Connection, account_id: str, workspace_id: str,
                                       scope_id: str | None) -> tuple[Any, Any, Any]:
    session = await tenancy.account_session_state(conn, account_id)
    row = await tenancy.account_workspace_context(conn, account_id, workspace_id)
    scope = None
    if scope_id is not None and row is not None:
        scope = await messages.scope_for_viewer(conn, workspace_id, scope_id, row["member_id"])
    return session, row, scope


async def _key_context_and_scope(conn: asyncpg.Connection, api_key_id: str,
                                 scope_id: str | None) -> tuple[Any, Any]:
    row = await tenancy.api_key_context_by_id(conn, api_key_id)
    scope = None
    if scope_id is not None and row is not None:
        scope = await messages.scope_for_viewer(conn, row["workspace_id"], scope_id, row["member_id"])
    return row, scope


def _prefetched(scope_id: str | None, row: Any) -> dict[str, Any]:
    return {} if scope_id is None else {scope_id: row}


def _check_session(principal: Principal, row: asyncpg.Record | None) -> None:
    if row is None or row["status"] != "active" or row["token_version"] != principal.token_version:
        raise unauthenticated("session token revoked")


def _check_workspace_row(row: asyncpg.Record | None) -> None:
    if row is None or row["workspace_status"] == "deleted":
        raise ProtocolError(ErrorCode.NOT_FOUND, "workspace not found")
    if row["workspace_status"] != "active":
        raise ProtocolError(ErrorCode.FORBIDDEN, f"the workspace is {row['workspace_status']}")
    if row["member_status"] != "active" or (row["membership_status"] not in (None, "active")):
        raise ProtocolError(ErrorCode.FORBIDDEN, "your membership is not active")


def _account_workspace_context(row: asyncpg.Record | None) -> WorkspaceContext:
    _check_workspace_row(row)
    assert row is not None
    role = Role(row["role"])
    return WorkspaceContext(
        workspace_id=row["workspace_id"], member_id=row["member_id"], member_kind=row["member_kind"],
        handle=row["handle"], role=role, permissions=permissions_for(role), membership_id=row["membership_id"],
        membership_revision=row["membership_revision"], execution_generation=row["active_generation"],
    )


def _api_key_workspace_context(row: asyncpg.Record, principal: Principal, now: float) -> WorkspaceContext:
    if row["key_status"] != "active" or (row["expires_at"] is not None and row["expires_at"].timestamp() <= now):
        raise unauthenticated("API key revoked or expired")
    _check_workspace_row(row)
    if row["member_kind"] == "agent" and row["owner_status"] != "active":
        raise ProtocolError(ErrorCode.FORBIDDEN, "the agent's owner is not active")
    role = Role(row["role"]) if row["role"] is not None else None
    permissions = permissions_for(role) & key_scope_permissions(principal.key_scopes)
    return WorkspaceContext(
        workspace_id=row["workspace_id"], member_id=row["member_id"], member_kind=row["member_kind"],
        handle=row["handle"], role=role, permissions=permissions, membership_id=row["membership_id"],
        membership_revision=row["membership_revision"] or 0, execution_generation=row["active_generation"],
    )


async def system_workspace_context(db: Database, workspace_id: str) -> WorkspaceContext:
    """The operator's context (CLI): every permission, the current generation."""
    generation = await db.run(tenancy.current_generation, workspace_id)
    return WorkspaceContext(
        workspace_id=workspace_id, member_id=None, member_kind=None, handle=None, role=Role.OWNER,
        permissions=frozenset(Permission), membership_id=None, membership_revision=0,
        execution_generation=generation,
    )


def system_context(workspace: WorkspaceContext | None = None) -> RequestContext:
    return RequestContext(request_id="cli", principal=SYSTEM, workspace=workspace)
