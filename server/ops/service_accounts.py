"""Handlers of workspace service accounts (protocol/service_accounts.py), the
audience reconciler and the approval notification projector.

Authority comes from the authenticated context only: a workspace owner/admin
governs (approves, sees every request and the whole audit), an account's
managers manage and publish, every active human reads the directory.  Writes
to an account's timeline and audience run in its scope's actor
(actors/service_accounts.py); governance writes run in one transaction each
here.  After a commit, events go to the members concerned on the workspace
feed, and the approval's cards are projected (and re-projected by the
maintenance task if a crash interrupted that)."""

from __future__ import annotations

import base64
import json
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import asyncpg
import msgspec
import trio

from actors import scope_actor as cmd
from actors import service_accounts as sa_cmd
from actors.fanout import CommittedEvent
from domain.plan import ActorContext, MembershipMutation, MessageIntent
from domain.service_accounts import CARD_MESSAGE_TYPE, NOTIFICATION_MESSAGE_TYPE, ManagerChange
from protocol import frames as f
from protocol import service_accounts as s
from protocol.errors import ErrorCode, ProtocolError
from server.context import RequestContext, WorkspaceContext
from server.messaging import (SYSTEM_ACTOR, _actor, _check_id, _message_scope, _ms, _scope, _submit,
                              conversation_scope, ensure_dm, message_info, scope_of_conversation)
from server.rbac import Permission, Role
from server.service_profiles import author_profile, with_profile
from storage import tenancy, visibility
from storage import service_accounts as store
from storage.errors import Conflict, DatabaseUnavailable, NotFound, StorageError
from storage.human_lifecycle import AUDIENCE_CHANNEL
from storage.ids import new_id

if TYPE_CHECKING:
    from server.app import Connection, Server

log = logging.getLogger("scopewire.service_accounts")

# How often a server re-runs what a crash left behind: reconciles and card projections.
MAINTENANCE_SECONDS = 30.0
# A card-projection intent still pending this long after its commit lost its projector (a crash).
INTENT_GRACE_SECONDS = 10.0


# --- context ---------------------------------------------------------------------------------------------

def _member(ctx: RequestContext) -> WorkspaceContext:
    workspace = ctx.require(Permission.WORKSPACE_VIEW)
    if workspace.member_id is None or workspace.member_kind != "human":
        raise ProtocolError(ErrorCode.FORBIDDEN, "service accounts are governed by humans",
                            details={"reason": "not_human"})
    return workspace


def _governor(workspace: WorkspaceContext) -> bool:
    return workspace.role in (Role.OWNER, Role.ADMIN)


def _forbidden(message: str, reason: str) -> ProtocolError:
    return ProtocolError(ErrorCode.FORBIDDEN, message, details={"reason": reason})


def _correlation() -> str:
    return new_id("req")


def _encode_cursor(values: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(values, separators=(",", ":")).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str | None, arity: int) -> list | None:
    if cursor is None:
        return None
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, TypeError):
        values = None
    if (not isinstance(values, list) or len(values) != arity
            or not all(isinstance(v, str) and len(v) <= 200 and v.isprintable() for v in values)):
        # Printable text only: a NUL or a lone surrogate would fail in the database, not here.
        raise ProtocolError(ErrorCode.INVALID, "malformed cursor", details={"reason": "bad_cursor"})
    return values


def _page(rows: list, limit: int, key) -> tuple[list, str | None]:
    page = rows[:limit]
    return page, (_encode_cursor(key(page[-1])) if len(rows) > limit else None)


def _title(value: str) -> str:
    title = value.strip()
    if not title:
        raise ProtocolError(ErrorCode.INVALID, "the title is empty", details={"reason": "empty_title"})
    return title


def _name(value: str) -> str:
    name = value.strip()
    if not name:
        raise ProtocolError(ErrorCode.INVALID, "the name is empty", details={"reason": "empty_name"})
    return name


async def _in_workspace(server: Server, workspace: WorkspaceContext, unit, *args) -> Any:
    """`unit(conn, *args)` in one transaction that passes the workspace's write fence."""
    async def run(conn: asyncpg.Connection) -> Any:
        await tenancy.pass_write_fence(conn, workspace.workspace_id, workspace.execution_generation)
        return await unit(conn, *args)
    return await server.db.transaction(run)


def _publish(server: Server, workspace_id: str, event: str, data: msgspec.Struct, audience: set[str],
             scope_id: str = "") -> None:
    server.hub.publish(CommittedEvent(event, workspace_id, scope_id, None, None, data, audience=frozenset(audience)))


# --- wire forms --------------------------------------------------------------------------------------------

def _json(value: Any) -> dict:
    return json.loads(value) if isinstance(value, str) else dict(value or {})


def request_info(row: Any, replayed: bool = False) -> s.CreateRequestInfo:
    payload = _json(row["payload_snapshot"])
    return s.CreateRequestInfo(
        id=row["id"], request_version=row["request_version"], client_request_id=row["client_request_id"],
        requested_by_member_id=row["requested_by_member_id"], authorization_path=row["authorization_path"],
        business_state=row["business_state"],
        payload=s.RequestPayload(name=payload["name"], description=payload["description"]),
        payload_digest=bytes(row["payload_digest"]).hex(), version=row["version"],
        created_at_ms=_ms(row["created_at"]), updated_at_ms=_ms(row["updated_at"]),
        approval_id=row["approval_instance_id"], created_service_account_id=row["created_service_account_id"],
        action_required_reason=row["action_required_reason"],
        cancel_client_mutation_id=row["cancel_client_mutation_id"],
        approval_closure_receipt=row["cancel_approval_receipt_ref"], replayed=replayed)


def approval_info(row: Any) -> s.ApprovalInfo:
    return s.ApprovalInfo(
        id=row["id"], subject_type=row["subject_type"], subject_ref=row["subject_ref"],
        subject_version=row["subject_version"], payload_digest=bytes(row["payload_digest"]).hex(), state=row["state"],
        version=row["version"], decided_by_member_id=row["decided_by_member_id"],
        decision_reason=row["decision_reason"],
        decided_at_ms=_ms(row["decided_at"]) if row["decided_at"] is not None else None)


def manager_info(row: Any) -> s.ManagerInfo:
    return s.ManagerInfo(member_id=row["member_id"], status=row["status"], added_at_ms=_ms(row["added_at"]),
                         added_by_member_id=row["added_by_member_id"],
                         removed_at_ms=_ms(row["removed_at"]) if row["removed_at"] is not None else None,
                         removed_reason=row["removed_reason"])


def audience_info(account: Any, member_count: int) -> s.AudienceInfo:
    return s.AudienceInfo(state=account["audience_state"], audience_policy_version=account["audience_policy_version"],
                          effective_audience_version=account["effective_audience_version"],
                          member_count=member_count, batches_done=account["audience_batches_done"])


def audit_info(row: Any) -> s.AuditEventInfo:
    return s.AuditEventInfo(
        id=row["id"], subject_type=row["subject_type"], subject_id=row["subject_id"], action=row["action"],
        actor_type=row["actor_type"], permission_basis=row["permission_basis"], correlation_id=row["correlation_id"],
        created_at_ms=_ms(row["created_at"]), details=_json(row["details"]),
        service_account_id=row["service_account_id"], subject_version=row["subject_version"],
        actor_member_id=row["actor_member_id"], caused_by_member_id=row["caused_by_member_id"],
        execution_member_id=row["execution_member_id"], durable_author_member_id=row["durable_author_member_id"],
        byline_member_id=row["byline_member_id"], message_id=row["message_id"],
        message_version=row["message_version"], before_digest=row["before_digest"],
        after_digest=row["after_digest"], comment=row["comment"])


def pin_info(row: Any) -> s.PinInfo:
    return s.PinInfo(scope_id=row["scope_id"], message_id=row["message_id"], top_notice=row["is_top_notice"],
                     pinned_by_member_id=row["pinned_by_member_id"], pinned_at_ms=_ms(row["pinned_at"]))


def _changed(account: Any) -> s.ServiceAccountChanged:
    return s.ServiceAccountChanged(service_account_id=account["id"], principal_id=account["principal_id"],
                                   version=account["version"], name=account["name"])


# --- accounts as the caller may see them -------------------------------------------------------------------------

async def _account(server: Server, workspace: WorkspaceContext, account_id: str) -> Any:
    _check_id(account_id, "sac", "service_account")
    return await server.db.run(store.account, workspace.workspace_id, account_id)


async def _governed(server: Server, workspace: WorkspaceContext, account_id: str) -> tuple[Any, bool]:
    """The account, for its managers and the owners/admins (others: forbidden `not_a_manager`).
    Returns (account, whether the caller is a manager)."""
    account = await _account(server, workspace, account_id)
    manager = await server.db.run(store.is_manager, account["id"], workspace.member_id)
    if not (manager or _governor(workspace)):
        raise _forbidden("only the account's managers and the workspace's owners/admins", "not_a_manager")
    return account, manager


def _workspace_managed(account: Any) -> None:
    """A platform account's instance is managed by the platform's operators only (service-account §2.5)."""
    if account["management_kind"] == "platform":
        raise _forbidden("a platform service account is managed by the platform's operators", "platform_managed")


def _basis(workspace: WorkspaceContext, manager: bool) -> str:
    return "service_account_manager" if manager else "workspace_governance"


async def _watchers(server: Server, workspace_id: str, account_id: str | None = None) -> set[str]:
    """Who hears of an account's governance: its managers and the owners/admins."""
    async def unit(conn: asyncpg.Connection) -> set[str]:
        members = set(await store.governors(conn, workspace_id))
        if account_id is not None:
            members |= set(await store.active_manager_ids(conn, account_id))
        return members
    return await server.db.run(unit)


async def _governance(server: Server, account: Any) -> s.Governance:
    async def unit(conn: asyncpg.Connection) -> tuple[list, int, str | None]:
        return (await store.managers(conn, account["id"], False, None, 50),
                await visibility.open_member_count(conn, account["message_scope_id"]),
                await store.request_of_account(conn, account["id"]))
    rows, count, request_id = await server.db.run(unit)
    return s.Governance(version=account["version"], management_kind=account["management_kind"],
                        audience=audience_info(account, count), managers=[manager_info(r) for r in rows[:50]],
                        created_by_member_id=account["created_by_member_id"], create_request_id=request_id)


async def _detail(server: Server, workspace: WorkspaceContext, account: Any) -> s.ServiceAccountDetail:
    manager = await server.db.run(store.is_manager, account["id"], workspace.member_id)
    governance = await _governance(server, account) if manager or _governor(workspace) else None
    return s.ServiceAccountDetail(profile=author_profile(account), version=account["version"], governance=governance)


# --- creation policy -----------------------------------------------------------------------------------------

async def policy_get(server: Server, connection: Connection, request: s.PolicyGet,
                     ctx: RequestContext) -> s.PolicyInfo:
    workspace = _member(ctx)
    creation_policy, version = await server.db.run(store.policy, workspace.workspace_id)
    return s.PolicyInfo(creation_policy=creation_policy, version=version)


async def policy_set(server: Server, connection: Connection, request: s.PolicySet,
                     ctx: RequestContext) -> s.PolicyInfo:
    workspace = _member(ctx)
    if not _governor(workspace):
        raise _forbidden("only owners and admins set the creation policy", "not_governor")
    creation_policy, version = await _in_workspace(
        server, workspace, lambda conn: store.set_policy(conn, workspace.workspace_id, request.creation_policy,
                                                         request.expected_version, workspace.member_id,
                                                         _correlation()))
    return s.PolicyInfo(creation_policy=creation_policy, version=version)


# --- create requests and approvals ---------------------------------------------------------------------------

async def request_submit(server: Server, connection: Connection, request: s.RequestSubmit,
                         ctx: RequestContext) -> s.CreateRequestInfo:
    workspace = _member(ctx)
    name = _name(request.name)
    try:
        submitted = await _in_workspace(server, workspace, lambda conn: store.submit_request(
            conn, workspace_id=workspace.workspace_id, requester=workspace.member_id, governor=_governor(workspace),
            client_request_id=request.client_request_id, name=name, description=request.description.strip(),
            correlation_id=_correlation()))
    except Conflict as exc:
        if exc.reason != "creation_not_allowed":
            raise
        raise _forbidden(str(exc), exc.reason) from None
    info = request_info(submitted.request, submitted.replayed)
    if not submitted.replayed:
        watchers = await _watchers(server, workspace.workspace_id) | {workspace.member_id}
        _publish(server, workspace.workspace_id, "service_account.create_request.submitted", info, watchers)
        if submitted.account is not None:
            _account_created(server, submitted.account, watchers)
    if submitted.approval_id is not None:
        await project_approval(server, submitted.approval_id)
    return info


def _account_created(server: Server, account: Any, watchers: set[str]) -> None:
    _publish(server, account["workspace_id"], "service_account.created", _changed(account), watchers,
             account["message_scope_id"])
    server.audience.wake()


async def _visible_request(server: Server, workspace: WorkspaceContext, request_id: str) -> Any:
    _check_id(request_id, "sar", "request")
    row = await server.db.run(store.request, workspace.workspace_id, request_id)
    if row["requested_by_member_id"] != workspace.member_id and not _governor(workspace):
        raise NotFound("create request")
    return row


async def request_get(server: Server, connection: Connection, request: s.RequestGet,
                      ctx: RequestContext) -> s.CreateRequestInfo:
    workspace = _member(ctx)
    return request_info(await _visible_request(server, workspace, request.request_id))


async def request_list(server: Server, connection: Connection, request: s.RequestList,
                       ctx: RequestContext) -> s.CreateRequestPage:
    workspace = _member(ctx)
    after = _decode_cursor(request.cursor, 1)
    rows = await server.db.run(store.requests, workspace.workspace_id,
                               None if _governor(workspace) else workspace.member_id, request.business_state,
                               after[0] if after else None, request.limit)
    page, cursor = _page(rows, request.limit, lambda r: [r["id"]])
    return s.CreateRequestPage(requests=[request_info(r) for r in page], next_cursor=cursor)


async def request_cancel(server: Server, connection: Connection, request: s.RequestCancel,
                         ctx: RequestContext) -> s.CreateRequestInfo:
    workspace = _member(ctx)
    row = await _visible_request(server, workspace, request.request_id)
    if row["requested_by_member_id"] != workspace.member_id:
        raise _forbidden("only the requester cancels a request", "not_requester")
    try:
        cancelled, replayed = await _in_workspace(server, workspace, lambda conn: store.cancel_request(
            conn, workspace_id=workspace.workspace_id, requester=workspace.member_id, request_id=row["id"],
            expected_version=request.expected_version, client_mutation_id=request.client_mutation_id,
            correlation_id=_correlation()))
    except store.AlreadyMaterialized as exc:
        raise ProtocolError(ErrorCode.CONFLICT, str(exc), details={
            "reason": exc.reason, "service_account_id": exc.service_account_id}) from None
    info = request_info(cancelled, replayed)
    if not replayed:
        watchers = await _watchers(server, workspace.workspace_id) | {workspace.member_id}
        _publish(server, workspace.workspace_id, "service_account.create_request.cancelled", info, watchers)
    if cancelled["approval_instance_id"] is not None:
        await project_approval(server, cancelled["approval_instance_id"])
    return info


async def _visible_approval(server: Server, workspace: WorkspaceContext, approval_id: str) -> Any:
    _check_id(approval_id, "apv", "approval")
    row = await server.db.run(store.approval, workspace.workspace_id, approval_id)
    if not _governor(workspace):
        subject = await server.db.run(store.request, workspace.workspace_id, row["subject_ref"])
        if subject["requested_by_member_id"] != workspace.member_id:
            raise NotFound("approval")
    return row


async def approval_get(server: Server, connection: Connection, request: s.ApprovalGet,
                       ctx: RequestContext) -> s.ApprovalInfo:
    workspace = _member(ctx)
    return approval_info(await _visible_approval(server, workspace, request.approval_id))


async def approval_decide(server: Server, connection: Connection, request: s.ApprovalDecide,
                          ctx: RequestContext) -> s.ApprovalDecision:
    workspace = _member(ctx)
    await _visible_approval(server, workspace, request.approval_id)
    if not _governor(workspace):
        raise _forbidden("only the workspace's owners and admins approve", "not_an_approver")
    decided = await _in_workspace(server, workspace, lambda conn: store.decide(
        conn, workspace_id=workspace.workspace_id, approver=workspace.member_id, approval_id=request.approval_id,
        decision=request.decision, expected_version=request.expected_version, reason=request.reason.strip(),
        card_revision=request.card_revision, client_action_id=request.client_action_id,
        correlation_id=_correlation()))
    info = request_info(decided.request)
    watchers = await _watchers(server, workspace.workspace_id) | {info.requested_by_member_id}
    event = {"provisioning": "authorized", "declined": "declined"}.get(info.business_state, "changed")
    _publish(server, workspace.workspace_id, f"service_account.create_request.{event}", info, watchers)
    if decided.account is not None:
        _account_created(server, decided.account, watchers)
    await project_approval(server, request.approval_id)
    return s.ApprovalDecision(approval=approval_info(decided.approval), request=info)


# --- accounts ---------------------------------------------------------------------------------------------

async def account_list(server: Server, connection: Connection, request: s.AccountList,
                       ctx: RequestContext) -> s.ServiceAccountPage:
    workspace = _member(ctx)
    after = _decode_cursor(request.cursor, 2)
    rows = await server.db.run(store.directory, workspace.workspace_id, request.query, after, request.limit)
    page, cursor = _page(rows, request.limit, lambda r: [r["normalized_name"], r["id"]])
    return s.ServiceAccountPage(accounts=[author_profile(r) for r in page], next_cursor=cursor)


async def account_get(server: Server, connection: Connection, request: s.AccountGet,
                      ctx: RequestContext) -> s.ServiceAccountDetail:
    workspace = _member(ctx)
    return await _detail(server, workspace, await _account(server, workspace, request.service_account_id))


async def account_update(server: Server, connection: Connection, request: s.AccountUpdate,
                         ctx: RequestContext) -> s.ServiceAccountDetail:
    workspace = _member(ctx)
    account, manager = await _governed(server, workspace, request.service_account_id)
    _workspace_managed(account)
    name = _name(request.name) if request.name is not None else None
    description = request.description.strip() if request.description is not None else None
    updated = await _in_workspace(server, workspace, lambda conn: store.update_profile(
        conn, workspace.workspace_id, account["id"], request.expected_version, name, description,
        workspace.member_id, _basis(workspace, manager), _correlation()))
    _publish(server, workspace.workspace_id, "service_account.updated", _changed(updated),
             await _watchers(server, workspace.workspace_id, account["id"]), account["message_scope_id"])
    return await _detail(server, workspace, updated)


async def account_delete(server: Server, connection: Connection, request: s.AccountDelete,
                         ctx: RequestContext) -> s.ServiceAccountDeleted:
    workspace = _member(ctx)
    account = await _account(server, workspace, request.service_account_id)
    _workspace_managed(account)
    watchers = await _watchers(server, workspace.workspace_id, account["id"])
    deleted = await _submit(server, account["message_scope_id"], sa_cmd.DeleteServiceAccount(
        _actor(workspace), request.expected_version, _governor(workspace), _correlation()))
    _publish(server, workspace.workspace_id, "service_account.deleted", _changed(deleted), watchers)
    return s.ServiceAccountDeleted(service_account_id=deleted["id"], version=deleted["version"])


# --- managers and audience ------------------------------------------------------------------------------

async def manager_list(server: Server, connection: Connection, request: s.ManagerList,
                       ctx: RequestContext) -> s.ManagerPage:
    workspace = _member(ctx)
    account, _ = await _governed(server, workspace, request.service_account_id)
    after = _decode_cursor(request.cursor, 1)
    rows = await server.db.run(store.managers, account["id"], request.include_removed, after[0] if after else None,
                               request.limit)
    page, cursor = _page(rows, request.limit, lambda r: [r["id"]])
    return s.ManagerPage(managers=[manager_info(r) for r in page], next_cursor=cursor)


async def _change_manager(server: Server, workspace: WorkspaceContext, account_id: str, member_id: str,
                          add: bool) -> s.ManagerInfo:
    account, manager = await _governed(server, workspace, account_id)
    _workspace_managed(account)
    member_id = _check_id(member_id, "mem", "member")
    before = await _watchers(server, workspace.workspace_id, account["id"])
    change = store.add_manager if add else store.remove_manager
    try:
        row, version = await _in_workspace(server, workspace, lambda conn: change(
            conn, workspace.workspace_id, account["id"], member_id, workspace.member_id, _basis(workspace, manager),
            _correlation()))
    except Conflict as exc:
        if exc.reason != "not_an_active_human":
            raise
        raise ProtocolError(ErrorCode.INVALID, str(exc), details={"reason": exc.reason}) from None
    info = manager_info(row)
    _publish(server, workspace.workspace_id, "service_account.manager_changed", s.ManagerChanged(
        service_account_id=account["id"], member_id=member_id, action="added" if add else "removed",
        version=version, reason=None if add else "removed"),
        before | await _watchers(server, workspace.workspace_id, account["id"]), account["message_scope_id"])
    return info


async def announce_manager_changes(server: Server, workspace_id: str, changes: list[ManagerChange]) -> None:
    """`service_account.manager_changed` for the assignments a human's removal ended or handed over."""
    for change in changes:
        try:
            watchers = await _watchers(server, workspace_id, change.service_account_id)
        except StorageError as exc:
            log.warning("announcing a manager change failed", extra={"error": str(exc)})
            return
        _publish(server, workspace_id, "service_account.manager_changed", s.ManagerChanged(
            service_account_id=change.service_account_id, member_id=change.member_id, action=change.action,
            version=change.version, reason=change.reason), watchers | {change.member_id})


async def manager_add(server: Server, connection: Connection, request: s.ManagerAdd,
                      ctx: RequestContext) -> s.ManagerInfo:
    return await _change_manager(server, _member(ctx), request.service_account_id, request.member_id, True)


async def manager_remove(server: Server, connection: Connection, request: s.ManagerRemove,
                         ctx: RequestContext) -> s.ManagerInfo:
    return await _change_manager(server, _member(ctx), request.service_account_id, request.member_id, False)


async def audience_get(server: Server, connection: Connection, request: s.AudienceGet,
                       ctx: RequestContext) -> s.AudienceInfo:
    workspace = _member(ctx)
    account, _ = await _governed(server, workspace, request.service_account_id)
    return audience_info(account, await server.db.run(visibility.open_member_count, account["message_scope_id"]))


# --- posts ------------------------------------------------------------------------------------------------

async def _post_info(server: Server, message: Any) -> Any:
    info = message_info(message)
    return with_profile(info, await server.db.run(store.accounts_by_scope, [info.scope_id]))


async def post(server: Server, connection: Connection, request: s.Post, ctx: RequestContext) -> Any:
    workspace = _member(ctx)
    account = await _account(server, workspace, request.service_account_id)
    _workspace_managed(account)
    message = await _submit(server, account["message_scope_id"], sa_cmd.ServicePost(
        _actor(workspace), _title(request.title), request.content, request.client_message_id.lower(),
        request.byline, _correlation()))
    return await _post_info(server, message)


async def _post_scope(server: Server, ctx: RequestContext, message_id: str) -> tuple[WorkspaceContext, Any]:
    workspace = _member(ctx)
    _, row = await _message_scope(server, ctx, message_id, Permission.WORKSPACE_VIEW)
    if row["scope_type"] != "service_account":
        raise ProtocolError(ErrorCode.INVALID, "not a service account's post", details={"reason": "not_a_post"})
    return workspace, row


async def post_edit(server: Server, connection: Connection, request: s.PostEdit, ctx: RequestContext) -> Any:
    workspace, row = await _post_scope(server, ctx, request.message_id)
    message = await _submit(server, row["scope_id"], sa_cmd.ServicePostEdit(
        _actor(workspace), request.message_id, _title(request.title), request.content, request.expected_revision,
        request.reason.strip(), _correlation()))
    return await _post_info(server, message)


async def post_withdraw(server: Server, connection: Connection, request: s.PostWithdraw, ctx: RequestContext) -> Any:
    workspace, row = await _post_scope(server, ctx, request.message_id)
    message = await _submit(server, row["scope_id"], sa_cmd.ServicePostWithdraw(
        _actor(workspace), request.message_id, request.expected_revision, request.reason.strip() or request.reason,
        _correlation()))
    return await _post_info(server, message)


# --- audit ------------------------------------------------------------------------------------------------

async def audit_list(server: Server, connection: Connection, request: s.AuditList,
                     ctx: RequestContext) -> s.AuditPage:
    workspace = _member(ctx)
    if request.service_account_id is not None:
        account, _ = await _governed(server, workspace, request.service_account_id)
        account_ids: list[str] | None = [account["id"]]
    elif _governor(workspace):
        account_ids = None
    else:
        account_ids = await server.db.run(store.managed_account_ids, workspace.workspace_id, workspace.member_id)
        if not account_ids:
            raise _forbidden("only managers and owners/admins read the audit", "not_a_manager")
    after = _decode_cursor(request.cursor, 1)
    rows = await server.db.run(store.audit_events, workspace.workspace_id, account_ids, after[0] if after else None,
                               request.limit)
    page, cursor = _page(rows, request.limit, lambda r: [r["id"]])
    return s.AuditPage(events=[audit_info(r) for r in page], next_cursor=cursor)


# --- shared pins and bulk read ----------------------------------------------------------------------------

async def _pin(server: Server, ctx: RequestContext, message_id: str, pinned: bool, top_notice: bool) -> Any:
    workspace = _member(ctx)
    _, row = await _message_scope(server, ctx, message_id, Permission.MESSAGE_READ)
    if row["scope_type"] != "service_account":
        raise ProtocolError(ErrorCode.INVALID, "shared pins are a service account's",
                            details={"reason": "scope_type_not_supported"})
    return await _submit(server, row["scope_id"], sa_cmd.SharedPin(_actor(workspace), message_id, top_notice, pinned,
                                                                   _correlation()))


async def pin_add(server: Server, connection: Connection, request: s.PinAdd, ctx: RequestContext) -> s.PinInfo:
    return pin_info(await _pin(server, ctx, request.message_id, True, request.top_notice))


async def pin_remove(server: Server, connection: Connection, request: s.PinRemove, ctx: RequestContext) -> f.Ok:
    await _pin(server, ctx, request.message_id, False, False)
    return f.Ok()


async def pin_list(server: Server, connection: Connection, request: s.PinList, ctx: RequestContext) -> s.PinPage:
    _, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    if row["type"] != "service_account":
        raise ProtocolError(ErrorCode.INVALID, "shared pins are a service account's",
                            details={"reason": "scope_type_not_supported"})
    return s.PinPage(pins=[pin_info(r) for r in await server.db.run(store.pins, row["id"])])


async def mark_read_many(server: Server, connection: Connection, request: s.ConversationMarkReadMany,
                         ctx: RequestContext) -> s.MarkReadManyResult:
    ids = [item.conversation_id for item in request.items]
    if len(set(ids)) != len(ids):
        raise ProtocolError(ErrorCode.INVALID, "each conversation at most once",
                            details={"reason": "duplicate_conversation"})
    for conversation_id in ids:  # every id well-formed before anything moves
        scope_of_conversation(conversation_id)
    results = []
    for item in request.items:
        try:
            workspace, row = await conversation_scope(server, ctx, item.conversation_id)
            outcome = await _submit(server, row["id"], cmd.MarkRead(_actor(workspace), item.read_through_seq))
        except ProtocolError as exc:
            if exc.code not in (ErrorCode.NOT_FOUND, ErrorCode.FORBIDDEN):
                raise
            results.append(s.MarkReadItemResult(conversation_id=item.conversation_id, status="not_found"))
            continue
        except NotFound:  # the membership closed meanwhile
            results.append(s.MarkReadItemResult(conversation_id=item.conversation_id, status="not_found"))
            continue
        results.append(s.MarkReadItemResult(conversation_id=item.conversation_id, status="ok",
                                            last_read_seq=outcome["last_read_seq"]))
    return s.MarkReadManyResult(results=results)


# --- approval cards (App Notification projection) ------------------------------------------------------------

# One projection of an approval at a time in this process: its intents apply in commit order.
_projecting: dict[str, trio.Lock] = defaultdict(trio.Lock)


def _card(view: Any, role: str, state: str, approval_version: int) -> tuple[str, dict[str, Any]]:
    """A card's text and metadata as the approval stood at `approval_version` in `state`."""
    payload = _json(view["payload_snapshot"])
    name = payload["name"]
    if role == "reviewer":
        text = {"pending": f"Approve the new service account “{name}”?",
                "approved": f"Approved: service account “{name}”.",
                "rejected": f"Rejected: service account “{name}”.",
                "closed": f"Withdrawn by the requester: service account “{name}”."}[state]
    elif state == "approved" and view["business_state"] == "action_required":
        text = (f"Your request for the service account “{name}” was approved but could not be carried out "
                f"({view['action_required_reason']}); cancel it and submit a new one.")
    else:
        text = {"pending": f"Your request for the service account “{name}” is waiting for approval.",
                "approved": f"Your service account “{name}” was approved.",
                "rejected": f"Your request for the service account “{name}” was rejected.",
                "closed": f"You cancelled your request for the service account “{name}”."}[state]
    return text, {"card": {
        "kind": "service_account_create_request", "role": role, "approval_id": view["id"],
        "request_id": view["request_id"], "requested_by_member_id": view["requested_by_member_id"],
        "name": name, "description": payload["description"], "state": state, "approval_version": approval_version,
        "actions": ["approve", "reject"] if role == "reviewer" and state == "pending" else [], "card_revision": 1}}


async def _send_card(server: Server, app: ActorContext, view: Any, recipient: str, key: str, role: str,
                     message_type: str, state: str, approval_version: int) -> None:
    """The notification `key`, once: a message from the Approvals app in its DM with `recipient`, and its sidecar.
    Its text is fixed by (key, state) so a retry after a crash replays the same message."""
    if await server.db.run(store.card, key) is not None:
        return
    dm = await ensure_dm(server, app, [MembershipMutation(m, "open") for m in sorted({app.member_id, recipient})])
    content, metadata = _card(view, role, state, approval_version)
    message = await _submit(server, dm, cmd.Send(app, MessageIntent(
        scope_id=dm, content=content, message_type=message_type, client_message_id=key, metadata=metadata)))
    await server.db.transaction(lambda conn: store.record_card(
        conn, workspace_id=app.workspace_id, notification_key=key, role=role, recipient=recipient,
        approval_id=view["id"], approval_version=approval_version, scope_id=dm, message_id=message.id))


async def _project(server: Server, intent: Any) -> None:
    approval_id, workspace_id = intent["approval_instance_id"], intent["workspace_id"]
    view = await server.db.run(store.approval_view, approval_id)
    app_member = await server.db.transaction(store.approvals_app_member, workspace_id)
    app = ActorContext(workspace_id=workspace_id, member_id=app_member, member_kind="service", owner_member_id=None,
                       execution_generation=await server.db.run(tenancy.current_generation, workspace_id))
    if intent["kind"] == "submitted":
        # Every card starts as the pending approval (version 1); the update below moves it on.
        for reviewer in await server.db.run(store.governors, workspace_id):
            await _send_card(server, app, view, reviewer, f"approval:{approval_id}:reviewer:{reviewer}", "reviewer",
                             CARD_MESSAGE_TYPE, "pending", 1)
        await _send_card(server, app, view, view["requested_by_member_id"], f"approval:{approval_id}:receipt",
                         "receipt", NOTIFICATION_MESSAGE_TYPE, "pending", 1)
    for card in await server.db.run(store.cards_of, approval_id):
        if card["role"] == "result" or card["expected_approval_version"] >= view["version"]:
            continue
        content, metadata = _card(view, card["role"], view["state"], view["version"])
        await _submit(server, card["scope_id"], sa_cmd.UpdateCard(app, card["id"], card["message_id"],
                                                                  view["version"], content, metadata))
    if intent["kind"] == "decided" and view["state"] in ("approved", "rejected"):
        # A new message, so the decision is unread in the requester's Inbox (§9.1).
        await _send_card(server, app, view, view["requested_by_member_id"], f"approval:{approval_id}:result",
                         "result", NOTIFICATION_MESSAGE_TYPE, view["state"], view["version"])


async def project_approval(server: Server, approval_id: str) -> None:
    """Project the approval's pending intents in order.  A failure is logged and
    left for the maintenance pass (the intent stays pending); the request that
    caused it has committed either way."""
    lock = _projecting[approval_id]
    try:
        async with lock:
            for intent in await server.db.run(store.intents_of, approval_id):
                try:
                    await _project(server, intent)
                except (StorageError, ProtocolError, cmd.ActorFailed) as exc:
                    log.warning("approval card projection failed; the maintenance pass retries",
                                extra={"approval_id": approval_id, "error": str(exc)})
                    await server.db.transaction(store.finish_intent, intent["id"], str(exc))
                    return
                await server.db.transaction(store.finish_intent, intent["id"], None)
    except DatabaseUnavailable as exc:
        log.warning("approval card projection failed; the maintenance pass retries",
                    extra={"approval_id": approval_id, "error": str(exc)})
    finally:
        if not lock.locked() and lock.statistics().tasks_waiting == 0:
            _projecting.pop(approval_id, None)


# --- the audience reconciler --------------------------------------------------------------------------------

class AudienceReconciler:
    """Brings every account's audience to its policy, one bounded batch per
    actor command, resuming from each account's checkpoint: at start (what a
    crash interrupted), when woken (a new account, a human lifecycle change)
    and every MAINTENANCE_SECONDS."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._wake = trio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen)
            task_status.started()
            while True:
                self._wake = trio.Event()
                await self.reconcile_all()
                with trio.move_on_after(MAINTENANCE_SECONDS):
                    await self._wake.wait()

    async def _listen(self) -> None:
        """Lifecycle changes and new accounts committed by any process wake this one."""
        while True:
            try:
                async with self.server.db.listen(AUDIENCE_CHANNEL) as notifications:
                    async for _ in notifications:
                        self.wake()
            except DatabaseUnavailable as exc:
                log.warning("audience LISTEN failed; the periodic pass covers it", extra={"error": str(exc)})
                await trio.sleep(MAINTENANCE_SECONDS)

    async def reconcile_all(self) -> None:
        after = None
        while True:
            try:
                behind = await self.server.db.run(store.accounts_behind, after, 100)
            except StorageError as exc:
                log.warning("audience reconcile pass failed; retrying", extra={"error": str(exc)})
                return
            for row in behind:
                await self.reconcile(row["workspace_id"], row["message_scope_id"])
            if len(behind) < 100:
                return
            after = (behind[-1]["workspace_id"], behind[-1]["id"])

    async def reconcile(self, workspace_id: str, scope_id: str) -> None:
        server = self.server
        try:
            generation = await server.db.run(tenancy.current_generation, workspace_id)
            system = ActorContext(workspace_id=workspace_id, member_id=SYSTEM_ACTOR, member_kind="system",
                                  owner_member_id=None, execution_generation=generation)
            while True:
                result = await server.registry.submit(scope_id, sa_cmd.ReconcileAudience(
                    system, server.config.service_account_audience_batch, _correlation()))
                if result is None:
                    return
                # A platform instance this made ready is announced by its account's actor.
                account, fulfilled = result
                watchers = await _watchers(server, workspace_id, account["id"])
                count = await server.db.run(visibility.open_member_count, scope_id)
                _publish(server, workspace_id, "service_account.audience_changed", s.AudienceChanged(
                    service_account_id=account["id"], audience=audience_info(account, count)), watchers, scope_id)
                if fulfilled is not None:
                    row = await server.db.run(store.request, workspace_id, fulfilled)
                    _publish(server, workspace_id, "service_account.create_request.changed", request_info(row),
                             watchers | {row["requested_by_member_id"]})
                if account["audience_state"] == "ready":
                    return
        except (StorageError, asyncpg.PostgresError, cmd.Refused, cmd.ActorFailed) as exc:
            # The batch rolled back; the next pass resumes from the account's checkpoint.
            log.warning("audience reconcile failed; retrying later",
                        extra={"scope_id": scope_id, "error": str(exc)})


async def run_maintenance(server: Server, *, interval_seconds: float = MAINTENANCE_SECONDS,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Every `interval_seconds`: project the card intents a crash left pending."""
    task_status.started()
    while True:
        await trio.sleep(interval_seconds)
        try:
            intents = await server.db.run(store.pending_intents, INTENT_GRACE_SECONDS, 100)
        except StorageError as exc:
            log.warning("approval card maintenance failed; retrying", extra={"error": str(exc)})
            continue
        for approval_id in dict.fromkeys(i["approval_instance_id"] for i in intents):
            await project_approval(server, approval_id)


HANDLERS: dict = {
    s.PolicyGet: policy_get, s.PolicySet: policy_set,
    s.RequestSubmit: request_submit, s.RequestGet: request_get, s.RequestList: request_list,
    s.RequestCancel: request_cancel, s.ApprovalGet: approval_get, s.ApprovalDecide: approval_decide,
    s.AccountList: account_list, s.AccountGet: account_get, s.AccountUpdate: account_update,
    s.AccountDelete: account_delete, s.ManagerList: manager_list, s.ManagerAdd: manager_add,
    s.ManagerRemove: manager_remove, s.AudienceGet: audience_get,
    s.Post: post, s.PostEdit: post_edit, s.PostWithdraw: post_withdraw, s.AuditList: audit_list,
    s.PinAdd: pin_add, s.PinRemove: pin_remove, s.PinList: pin_list, s.ConversationMarkReadMany: mark_read_many,
}
