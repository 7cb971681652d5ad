"""Handlers of owner-private collaboration ops (protocol/collaboration.py):
private grants and People collaborators, and the maintenance task that expires
them and finishes notifications a crash interrupted.

Every change runs in its scope's actor (actors/collaboration.py).  Only the
owner manages a grant or collaborator and only the collaborator leaves: to
anyone else the id answers `not_found` (its existence is never revealed), and
no op takes an owner parameter, so no role lists another owner's rows."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import trio

from actors.collaboration import (EXECUTION_TYPES, AddCollaborator, CreateGrant, EndCollaborator, RevokeGrant,
                                  UpdateCollaboratorExpiry)
from actors.fanout import CommittedEvent
from protocol import collaboration as c
from protocol.errors import ErrorCode, ProtocolError
from server.context import RequestContext, WorkspaceContext
from server.messaging import _actor, _check_id, _not_found, _scope, _submit
from server.rbac import Permission
from storage import private_authority
from storage.errors import StorageError
from storage.private_authority import CollaboratorChange
from storage.visibility import collaborators

if TYPE_CHECKING:
    from server.app import Connection, Server

log = logging.getLogger("scopewire.collaboration")

# How often a server expires due grants / collaborators and retries notifications.
MAINTENANCE_SECONDS = 30.0
# A notification job still pending this long after its commit lost its delivery (a crash).
NOTIFICATION_GRACE = timedelta(seconds=10)


def _ms(value: datetime | None) -> int | None:
    return int(value.timestamp() * 1000) if value is not None else None


def _instant(ms: int | None) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc) if ms is not None else None


def _invalid(message: str, reason: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID, message, details={"reason": reason})


def _require_human(workspace: WorkspaceContext) -> None:
    if workspace.member_kind != "human":
        raise ProtocolError(ErrorCode.FORBIDDEN, "only a human owns private agents",
                            details={"reason": "owner_not_human"})


def _expiry(expires_at_ms: int | None, no_expiry: bool) -> datetime | None:
    if expires_at_ms is not None and no_expiry:
        raise _invalid("give expires_at_ms or no_expiry, not both", "conflicting_expiry")
    return _instant(expires_at_ms)


def grant_info(row: Any) -> c.GrantInfo:
    return c.GrantInfo(
        id=row["id"], scope_id=row["scope_id"], owner_member_id=row["owner_member_id"],
        grantee_member_id=row["grantee_member_id"], granted_by_member_id=row["granted_by_member_id"],
        created_at_ms=_ms(row["created_at"]), effective_from_global_seq=row["effective_from_global_seq"],
        active=row["active"], expires_at_ms=_ms(row["expires_at"]), revoked_at_ms=_ms(row["revoked_at"]),
        effective_to_global_seq=row["effective_to_global_seq"])


def collaborator_info(row: Any, source: str = "local") -> c.CollaboratorInfo:
    if row["removed_at"] is not None:
        end_reason, ended_at = "removed", row["removed_at"]
    elif row["left_at"] is not None:
        end_reason, ended_at = "left", row["left_at"]
    elif not row["active"]:  # neither removed nor left: it ran out
        end_reason, ended_at = "expired", row["expires_at"]
    else:
        end_reason, ended_at = None, None
    return c.CollaboratorInfo(
        id=row["id"], execution_id=row["execution_id"], owner_member_id=row["owner_member_id"],
        scope_id=row["scope_id"], scope_type=row["scope_type"], member_id=row["member_id"],
        added_by_member_id=row["added_by_member_id"], added_at_ms=_ms(row["added_at"]),
        effective_from_global_seq=row["effective_from_global_seq"], active=row["active"], source=source,
        expires_at_ms=_ms(row["expires_at"]), ended_at_ms=_ms(ended_at), end_reason=end_reason,
        effective_to_global_seq=row["effective_to_global_seq"])


def _publish(server: Server, change: str, row: Any) -> c.CollaboratorInfo:
    """`collaborator.changed` to the owner's and the collaborator's own connections."""
    info = collaborator_info(row)
    server.hub.publish(CommittedEvent(
        "collaborator.changed", row["workspace_id"], info.scope_id, None, None, c.CollaboratorChanged(change, info),
        audience=frozenset({info.owner_member_id, info.member_id})))
    return info


async def _announce(server: Server, change: CollaboratorChange) -> c.CollaboratorInfo:
    """After commit: push the change, then mark an add's notification job
    delivered (left pending on failure: the maintenance task delivers it)."""
    info = _publish(server, change.change, change.collaborator)
    if change.notification_job_id is not None:
        try:
            await server.db.transaction(private_authority.mark_notification_delivered, change.notification_job_id)
        except StorageError as exc:
            log.warning("marking a collaborator notification delivered failed; maintenance retries",
                        extra={"job_id": change.notification_job_id, "error": str(exc)})
    return info


# --- private grants -----------------------------------------------------------------------------

async def private_grant_create(server: Server, connection: Connection, request: c.PrivateGrantCreate,
                               ctx: RequestContext) -> c.GrantInfo:
    workspace, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    _require_human(workspace)
    grantee = _check_id(request.grantee_member_id, "mem", "member")
    row = await _submit(server, scope["id"], CreateGrant(_actor(workspace), grantee,
                                                         _instant(request.expires_at_ms)))
    return grant_info(row)


async def private_grant_revoke(server: Server, connection: Connection, request: c.PrivateGrantRevoke,
                               ctx: RequestContext) -> c.GrantInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    grant_id = _check_id(request.grant_id, "grt", "grant")
    scope_id = await server.db.run(collaborators.owned_grant_scope, workspace.workspace_id, workspace.member_id,
                                   grant_id)
    if scope_id is None:
        raise _not_found("grant")
    return grant_info(await _submit(server, scope_id, RevokeGrant(_actor(workspace), grant_id)))


async def private_grant_list(server: Server, connection: Connection, request: c.PrivateGrantList,
                             ctx: RequestContext) -> c.GrantListResult:
    workspace = ctx.require(Permission.MESSAGE_READ)
    if request.scope_id is not None:
        _check_id(request.scope_id, "scp", "scope")
    rows = await server.db.run(collaborators.owner_grants, workspace.workspace_id, workspace.member_id,
                               request.scope_id, request.include_ended)
    return c.GrantListResult([grant_info(r) for r in rows])


# --- People collaborators ---------------------------------------------------------------------------

async def collaborator_add(server: Server, connection: Connection, request: c.CollaboratorAdd,
                           ctx: RequestContext) -> c.CollaboratorInfo:
    workspace, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    _require_human(workspace)
    member_id = _check_id(request.member_id, "mem", "member")
    expires_at = _expiry(request.expires_at_ms, request.no_expiry)
    if scope["type"] not in EXECUTION_TYPES:
        raise _invalid(f"no collaborators on a {scope['type']} scope", "scope_type_not_supported")
    if scope["type"] == "channel" and not (request.confirm_channel and (expires_at is not None or request.no_expiry)):
        # A channel reaches every thread under it: an explicit confirmation and an explicit expiry choice (§7.6).
        raise _invalid("a channel collaborator needs confirm_channel and expires_at_ms or no_expiry",
                       "channel_confirmation_required")
    change = await _submit(server, scope["id"], AddCollaborator(_actor(workspace), member_id, expires_at))
    return await _announce(server, change)


async def _route(server: Server, ctx: RequestContext, collaborator_id: str, permission: Permission,
                 party: str) -> tuple[WorkspaceContext, str]:
    """The scope of a collaborator row the caller is `party` to (owner | member); not_found otherwise."""
    workspace = ctx.require(permission)
    _check_id(collaborator_id, "col", "collaborator")
    route = await server.db.run(collaborators.collaborator_route, workspace.workspace_id, collaborator_id,
                                workspace.member_id)
    if route is None or route["owner_member_id" if party == "owner" else "member_id"] != workspace.member_id:
        raise _not_found("collaborator")
    return workspace, route["scope_id"]


async def collaborator_remove(server: Server, connection: Connection, request: c.CollaboratorRemove,
                              ctx: RequestContext) -> c.CollaboratorInfo:
    workspace, scope_id = await _route(server, ctx, request.collaborator_id, Permission.MESSAGE_WRITE, "owner")
    change = await _submit(server, scope_id, EndCollaborator(_actor(workspace), request.collaborator_id, "remove"))
    return await _announce(server, change)


async def collaborator_leave(server: Server, connection: Connection, request: c.CollaboratorLeave,
                             ctx: RequestContext) -> c.CollaboratorInfo:
    # Like scope.leave, leaving needs only read access: a read-only member can always step out.
    workspace, scope_id = await _route(server, ctx, request.collaborator_id, Permission.MESSAGE_READ, "member")
    change = await _submit(server, scope_id, EndCollaborator(_actor(workspace), request.collaborator_id, "leave"))
    return await _announce(server, change)


async def collaborator_update_expiry(server: Server, connection: Connection, request: c.CollaboratorUpdateExpiry,
                                     ctx: RequestContext) -> c.CollaboratorInfo:
    workspace, scope_id = await _route(server, ctx, request.collaborator_id, Permission.MESSAGE_WRITE, "owner")
    expires_at = _expiry(request.expires_at_ms, request.no_expiry)
    if expires_at is None and not request.no_expiry:
        raise _invalid("give expires_at_ms or no_expiry", "expiry_required")
    change = await _submit(server, scope_id, UpdateCollaboratorExpiry(_actor(workspace), request.collaborator_id,
                                                                      expires_at))
    return await _announce(server, change)


async def collaborator_list(server: Server, connection: Connection, request: c.CollaboratorList,
                            ctx: RequestContext) -> c.CollaboratorListResult:
    workspace, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    if scope["type"] not in EXECUTION_TYPES:
        raise _invalid(f"no collaborators on a {scope['type']} scope", "scope_type_not_supported")
    # A thread's and a task's effective collaborators include their (board) channel's: a runtime union.
    chain = [scope["id"]] + ([scope["parent_scope_id"]] if scope["type"] != "channel" else [])
    rows = await server.db.run(collaborators.owner_collaborators, workspace.workspace_id, workspace.member_id, chain,
                               request.include_ended)
    return c.CollaboratorListResult([
        collaborator_info(r, "local" if r["scope_id"] == scope["id"] else "inherited") for r in rows])


async def collaborator_overview(server: Server, connection: Connection, request: c.CollaboratorOverview,
                                ctx: RequestContext) -> c.CollaboratorOverviewResult:
    workspace = ctx.require(Permission.MESSAGE_READ)
    people: dict[str, c.CollaboratorPerson] = {}
    for row in await server.db.run(collaborators.owner_overview, workspace.workspace_id, workspace.member_id,
                                   request.include_ended):
        person = people.get(row["member_id"])
        if person is None:
            person = people[row["member_id"]] = c.CollaboratorPerson(
                member_id=row["member_id"], handle=row["handle"], display_name=row["display_name"],
                kind=row["kind"], scenes=[])
        person.scenes.append(collaborator_info(row))
    return c.CollaboratorOverviewResult(list(people.values()))


# --- maintenance ------------------------------------------------------------------------------------------

async def collaborator_maintenance(server: Server, now: datetime | None = None) -> tuple[int, int]:
    """One pass: expire what is due at `now` (default: the database's clock) and
    deliver notifications whose commit-to-delivery step was lost.  Returns
    (collaborators expired, notifications delivered)."""
    try:
        if now is None:
            now = await server.db.run(private_authority.database_now)
        expired = await server.db.transaction(private_authority.expire_due, now)
        for change in expired:
            _publish(server, change.change, change.collaborator)
        delivered = 0
        for row in await server.db.run(private_authority.pending_notifications, now - NOTIFICATION_GRACE):
            _publish(server, "add", row)
            delivered += await server.db.transaction(private_authority.mark_notification_delivered, row["job_id"])
    except StorageError as exc:
        log.warning("collaborator maintenance failed; retrying", extra={"error": str(exc)})
        return 0, 0
    return len(expired), delivered


async def run_collaborator_maintenance(server: Server, *, interval_seconds: float = MAINTENANCE_SECONDS,
                                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """At start (the server counts as started once this first pass is done:
    what expired while it was down is closed before it serves), then every
    `interval_seconds`."""
    await collaborator_maintenance(server)
    task_status.started()
    while True:
        await trio.sleep(interval_seconds)
        await collaborator_maintenance(server)


HANDLERS = {
    c.PrivateGrantCreate: private_grant_create, c.PrivateGrantRevoke: private_grant_revoke,
    c.PrivateGrantList: private_grant_list, c.CollaboratorAdd: collaborator_add,
    c.CollaboratorRemove: collaborator_remove, c.CollaboratorLeave: collaborator_leave,
    c.CollaboratorUpdateExpiry: collaborator_update_expiry, c.CollaboratorList: collaborator_list,
    c.CollaboratorOverview: collaborator_overview,
}
