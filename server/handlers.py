"""Routing: one handler per request type, with its authentication needs.

A handler gets the server, the connection and a RequestContext built from the
connection's principal (re-validated for this request) and, for workspace
requests, the resolved WorkspaceContext.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from domain.credentials import StaleCredential
from protocol import frames as f
from protocol import results
from protocol.errors import ErrorCode, ProtocolError
from server import messaging, pipeline, realtime
from server.ops import (attachments, collaboration, deliveries, platform, platform_assets, private_agents, search,
                        service_accounts, strands)
from server import tenancy as ops
from server.context import RequestContext
from storage.errors import DatabaseUnavailable, StorageError

if TYPE_CHECKING:
    from server.app import Connection, Server

Handler = Callable[["Server", "Connection", Any, RequestContext | None], Awaitable[Any]]


def _epoch(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def _workspace_info(row: Any) -> f.WorkspaceInfo:
    return f.WorkspaceInfo(id=row["id"], name=row["name"], slug=row["slug"], type=row["type"], status=row["status"],
                           role=row["role"], member_id=row["member_id"])


def _member_info(row: Any) -> f.MemberInfo:
    return f.MemberInfo(id=row["id"], kind=row["kind"], handle=row["handle"], display_name=row["display_name"],
                        status=row["status"], role=row["role"], email=row["email"],
                        owner_member_id=row["owner_member_id"], visibility=row["visibility"])


def _key_info(row: Any) -> f.ApiKeyInfo:
    return f.ApiKeyInfo(id=row["id"], member_id=row["member_id"], name=row["name"], scopes=list(row["scopes"]),
                        status=row["status"], created_at=_epoch(row["created_at"]),
                        expires_at=_epoch(row["expires_at"]), last_used_at=_epoch(row["last_used_at"]))


# --- before authentication ---------------------------------------------------------------

async def ping(server: Server, connection: Connection, request: f.Ping, ctx: RequestContext | None) -> f.PingResult:
    return f.PingResult(server_time_ms=time.time_ns() // 1_000_000)


async def hello(server: Server, connection: Connection, request: f.Hello, ctx: RequestContext | None) -> f.HelloResult:
    if request.protocol_version != f.PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.INVALID, f"unsupported protocol version {request.protocol_version}",
                            details={"supported": [f.PROTOCOL_VERSION]})
    return f.HelloResult(protocol_version=f.PROTOCOL_VERSION, server="scopewire",
                         max_frame_bytes=server.config.max_frame_bytes)


async def _auth_result(server: Server, connection: Connection, token: str | None = None,
                       expires_at: int | None = None) -> f.AuthResult:
    principal = connection.principal
    assert principal is not None
    if principal.kind == "operator":
        return f.AuthResult(principal="operator", operator_id=principal.operator_id)
    ctx = RequestContext(request_id="auth", principal=principal)
    workspaces = [_workspace_info(r) for r in await ops.list_workspaces(server.db, ctx)]
    if principal.kind == "api_key":
        return f.AuthResult(principal="api_key", api_key_id=principal.api_key_id,
                            workspace_id=principal.key_workspace_id, member_id=principal.key_member_id,
                            workspaces=workspaces)
    return f.AuthResult(principal="account", account_id=principal.account_id, token=token, expires_at=expires_at,
                        workspaces=workspaces)


async def login(server: Server, connection: Connection, request: f.Login, ctx: RequestContext | None) -> f.AuthResult:
    session = await server.auth.login(request.email, request.password, source=connection.address)
    server.check_connection_limit(session.principal)
    server.authenticated(connection, session.principal, session.expires_at)
    return await _auth_result(server, connection, session.token, session.expires_at)


async def auth(server: Server, connection: Connection, request: f.Auth, ctx: RequestContext | None) -> f.AuthResult:
    if sum(value is not None for value in (request.token, request.api_key, request.operator_key)) != 1:
        raise ProtocolError(ErrorCode.BAD_FRAME, "give exactly one of token, api_key and operator_key")
    if request.token is not None:
        principal, expires_at = await server.auth.from_token(request.token, source=connection.address)
    elif request.operator_key is not None:
        principal, expires_at = await server.auth.from_operator_key(request.operator_key,
                                                                    source=connection.address), None
    else:
        principal, _ = await server.auth.from_api_key(request.api_key, source=connection.address)
        expires_at = None
    server.check_connection_limit(principal)
    server.authenticated(connection, principal, expires_at)
    return await _auth_result(server, connection)


async def accept_invitation(server: Server, connection: Connection, request: f.InvitationAccept,
                            ctx: RequestContext | None) -> f.AuthResult:
    accepted = await ops.accept_invitation(server.db, server.auth, token=request.token,
                                           principal=connection.principal, password=request.password,
                                           display_name=request.display_name)
    if accepted.session is not None:
        server.authenticated(connection, accepted.session.principal, accepted.session.expires_at)
        return await _auth_result(server, connection, accepted.session.token, accepted.session.expires_at)
    return await _auth_result(server, connection)


# --- account ---------------------------------------------------------------------------------

async def revoke_sessions(server: Server, connection: Connection, request: f.RevokeSessions,
                          ctx: RequestContext) -> f.Ok:
    await ops.revoke_sessions(server.db, ctx)
    connection.closing = True  # this connection's token is revoked too: reply, then close
    return f.Ok()


# --- workspaces -------------------------------------------------------------------------------

async def workspace_list(server: Server, connection: Connection, request: f.WorkspaceList,
                         ctx: RequestContext) -> results.WorkspaceListResult:
    return results.WorkspaceListResult([_workspace_info(row) for row in await ops.list_workspaces(server.db, ctx)])


async def workspace_get(server: Server, connection: Connection, request: f.WorkspaceGet,
                        ctx: RequestContext) -> f.WorkspaceInfo:
    workspace = ctx.workspace
    assert workspace is not None
    rows = [r for r in await ops.list_workspaces(server.db, ctx) if r["id"] == workspace.workspace_id]
    if not rows:
        raise ProtocolError(ErrorCode.NOT_FOUND, "workspace not found")
    return _workspace_info(rows[0])


async def workspace_create(server: Server, connection: Connection, request: f.WorkspaceCreate,
                           ctx: RequestContext) -> f.WorkspaceInfo:
    created = await ops.create_workspace(server.db, ctx, name=request.name, slug=request.slug)
    return f.WorkspaceInfo(id=created.workspace_id, name=request.name, slug=request.slug, type="team",
                           status="active", role="owner", member_id=created.member_id)


async def workspace_suspend(server: Server, connection: Connection, request: f.WorkspaceSuspend,
                            ctx: RequestContext) -> f.Ok:
    await ops.set_workspace_status(server.db, ctx, "suspended")
    return f.Ok()


# --- members ----------------------------------------------------------------------------------

async def member_list(server: Server, connection: Connection, request: f.MemberList,
                      ctx: RequestContext) -> results.MemberListResult:
    return results.MemberListResult([_member_info(row) for row in await ops.list_members(server.db, ctx)])


async def member_set_role(server: Server, connection: Connection, request: f.MemberSetRole,
                          ctx: RequestContext) -> f.Ok:
    await ops.set_member_role(server.db, ctx, request.member_id, request.role)
    return f.Ok()


async def member_remove(server: Server, connection: Connection, request: f.MemberRemove,
                        ctx: RequestContext) -> f.Ok:
    change = await ops.remove_member(server.db, ctx, request.member_id)
    # After the removal committed: its scope memberships close through their actors.
    await messaging.close_departed_member(server, ctx.workspace.workspace_id, request.member_id)
    await service_accounts.announce_manager_changes(server, ctx.workspace.workspace_id, change.manager_changes)
    return f.Ok()


async def owner_transfer(server: Server, connection: Connection, request: f.OwnerTransfer,
                         ctx: RequestContext) -> f.Ok:
    await ops.transfer_owner(server.db, ctx, request.member_id)
    return f.Ok()


async def agent_create(server: Server, connection: Connection, request: f.AgentCreate,
                       ctx: RequestContext) -> f.MemberInfo:
    member_id = await ops.create_agent(server.db, ctx, handle=request.handle, display_name=request.display_name,
                                       visibility=request.visibility)
    return f.MemberInfo(id=member_id, kind="agent", handle=request.handle, display_name=request.display_name,
                        status="active", owner_member_id=ctx.workspace.member_id, visibility=request.visibility)


# --- invitations --------------------------------------------------------------------------------

async def invitation_create(server: Server, connection: Connection, request: f.InvitationCreate,
                            ctx: RequestContext) -> f.InvitationInfo:
    issued = await ops.create_invitation(server.db, ctx, email=request.email, role=request.role,
                                         expires_in_seconds=request.expires_in_seconds)
    return f.InvitationInfo(id=issued.invitation_id, email=request.email.strip().lower(), role=request.role,
                            status="pending", expires_at=_epoch(issued.expires_at), token=issued.token)


async def invitation_list(server: Server, connection: Connection, request: f.InvitationList,
                          ctx: RequestContext) -> results.InvitationListResult:
    return results.InvitationListResult([f.InvitationInfo(id=row["id"], email=row["email"], role=row["role"],
                                                    status=row["status"], expires_at=_epoch(row["expires_at"]))
                                   for row in await ops.list_invitations(server.db, ctx)])


async def invitation_revoke(server: Server, connection: Connection, request: f.InvitationRevoke,
                            ctx: RequestContext) -> f.Ok:
    await ops.revoke_invitation(server.db, ctx, request.invitation_id)
    return f.Ok()


# --- API keys -----------------------------------------------------------------------------------

async def apikey_create(server: Server, connection: Connection, request: f.ApiKeyCreate,
                        ctx: RequestContext) -> f.ApiKeyInfo:
    issued = await ops.create_api_key(server.db, ctx, name=request.name, member_id=request.member_id,
                                      scopes=list(request.scopes), expires_in_seconds=request.expires_in_seconds)
    return f.ApiKeyInfo(id=issued.api_key_id, member_id=issued.member_id, name=request.name,
                        scopes=sorted(set(request.scopes)), status="active", created_at=_epoch(issued.created_at),
                        expires_at=_epoch(issued.expires_at), key=issued.key)


async def apikey_list(server: Server, connection: Connection, request: f.ApiKeyList,
                      ctx: RequestContext) -> results.ApiKeyListResult:
    return results.ApiKeyListResult([_key_info(row) for row in await ops.list_api_keys(server.db, ctx)])


async def apikey_revoke(server: Server, connection: Connection, request: f.ApiKeyRevoke,
                        ctx: RequestContext) -> f.Ok:
    await ops.revoke_api_key(server.db, ctx, request.api_key_id)
    return f.Ok()


# --- the table ------------------------------------------------------------------------------------

PUBLIC: dict[type, Handler] = {
    f.Ping: ping,
    f.Hello: hello,
    f.Login: login,
    f.Auth: auth,
    f.InvitationAccept: accept_invitation,
}
AUTHENTICATED: dict[type, Handler] = {
    f.RevokeSessions: revoke_sessions,
    f.WorkspaceList: workspace_list,
    f.WorkspaceCreate: workspace_create,
}
IN_WORKSPACE: dict[type, Handler] = {
    f.WorkspaceGet: workspace_get,
    f.WorkspaceSuspend: workspace_suspend,
    f.MemberList: member_list,
    f.MemberSetRole: member_set_role,
    f.MemberRemove: member_remove,
    f.OwnerTransfer: owner_transfer,
    f.AgentCreate: agent_create,
    f.InvitationCreate: invitation_create,
    f.InvitationList: invitation_list,
    f.InvitationRevoke: invitation_revoke,
    f.ApiKeyCreate: apikey_create,
    f.ApiKeyList: apikey_list,
    f.ApiKeyRevoke: apikey_revoke,
    **messaging.HANDLERS,
    f.Subscribe: realtime.subscribe,
    f.Unsubscribe: realtime.unsubscribe,
    f.Typing: realtime.typing,
    f.Presence: realtime.presence,
    **collaboration.HANDLERS,
    **private_agents.HANDLERS,
    **deliveries.HANDLERS,
    **service_accounts.HANDLERS,
    **strands.HANDLERS,
    **attachments.HANDLERS,
    **search.HANDLERS,
}
# A platform operator's ops (and only these for an operator).
PLATFORM: dict[type, Handler] = {**platform.HANDLERS, **platform_assets.HANDLERS}
assert set(PUBLIC) | set(AUTHENTICATED) | set(IN_WORKSPACE) | set(PLATFORM) == set(f.CLIENT_FRAMES), \
    "every op needs a handler"


# The hot write served from the connection's cached context (server/auth.CachedContext):
# its batch transaction re-checks the context's proof, so revocation keeps its effect.
SERVED_FROM_CACHE = frozenset({f.MessageSend})


async def dispatch(server: Server, connection: Connection, request: f.Request) -> Any:
    """The request's result, of exactly the type protocol.results.RESULTS names for its op."""
    result = await _route(server, connection, request)
    if type(result) is not results.RESULTS[type(request)]:
        # A handler that strays from the published contract is a bug (answered `internal`).
        raise TypeError(f"{f.op_of(request)} returned {type(result).__name__}, "
                        f"the contract says {results.RESULTS[type(request)].__name__}")
    return result


async def _route(server: Server, connection: Connection, request: f.Request) -> Any:
    kind = type(request)
    handler = PUBLIC.get(kind)
    if handler is not None:
        return await handler(server, connection, request, None)
    principal = connection.principal
    if principal is None:
        raise ProtocolError(ErrorCode.UNAUTHENTICATED, "authenticate first (login, auth or invitation.accept)")
    if kind in PLATFORM or principal.kind == "operator":
        if kind not in PLATFORM:
            raise ProtocolError(ErrorCode.FORBIDDEN, "a platform operator is not a member of any workspace",
                                details={"reason": "operator_not_member"})
        if principal.kind != "operator":
            raise ProtocolError(ErrorCode.FORBIDDEN, "only platform operators",
                                details={"reason": "platform_operator_required"})
        await server.auth.revalidate(principal)
        return await PLATFORM[kind](server, connection, request, RequestContext(request_id=request.id,
                                                                                principal=principal))
    if kind in AUTHENTICATED:
        await server.auth.revalidate(principal, expires_at=connection.session_expires_at)
        return await AUTHENTICATED[kind](server, connection, request,
                                         RequestContext(request_id=request.id, principal=principal))
    scope_id = getattr(request, "scope_id", None)
    if kind in SERVED_FROM_CACHE:
        cached = server.auth.cached_context(connection.cached_context, connection.session_expires_at,
                                            request.workspace_id, scope_id)
        if cached is not None:
            try:
                return await IN_WORKSPACE[kind](server, connection, request, RequestContext(
                    request_id=request.id, principal=principal, workspace=cached.workspace,
                    scopes={scope_id: cached.scopes[scope_id]}, proof=cached.proof))
            except StaleCredential:
                pass
            except (ProtocolError, StorageError) as exc:
                # Perhaps only the cache was stale (a scope left, a generation moved on):
                # refused writes wrote nothing, so the request is served afresh below.
                if isinstance(exc, DatabaseUnavailable) or (
                        isinstance(exc, ProtocolError) and exc.code in (ErrorCode.INTERNAL, ErrorCode.UNAVAILABLE)):
                    raise
            connection.cached_context = None
        await pipeline.previous_answered()  # served afresh: not before the sends ahead of it
    workspace, scopes, proof = await server.auth.request_workspace(principal, connection.session_expires_at,
                                                                   request.workspace_id, await server.edition(),
                                                                   scope_id)
    ctx = RequestContext(request_id=request.id, principal=principal, workspace=workspace, scopes=scopes)
    if principal.kind == "account":
        connection.acted_in(workspace.workspace_id)
    if kind in SERVED_FROM_CACHE:
        connection.cached_context = server.auth.cache_context(workspace, scopes, proof, connection.cached_context)
    return await IN_WORKSPACE[kind](server, connection, request, ctx)
