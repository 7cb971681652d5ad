"""Service-account commands, run by the account's scope actor inside its batch
transaction (a savepoint each): the actor that owns the scope's sequence and
roster is the one that posts into it, opens and closes its audience and erases
it.  Authority (manager, live grant, audience readiness) is re-read in that
transaction, so a manager removed a moment ago cannot post.

A post is authored by the account's service member — author, notify principal
and idempotency subject (service-account §2.2) — and carries the human manager
only as permission basis, caused-by / execution actor and optional byline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg

from actors.fanout import CommittedEvent
from actors.planner import payload_digest
from actors.scope_actor import Command, Outcome, Refused, ScopeActor, register_command
from domain.plan import ActorContext, DeliveryPolicy, MessageIntent, MessagePlan, OutboxEvent, ScopeContext
from domain.service_accounts import POST_MESSAGE_TYPE
from storage import applier, messages
from storage import service_accounts as store
from storage.errors import Conflict, NotFound
from storage.human_lifecycle import record_audit


@dataclass
class ServicePost(Command):
    title: str
    content: str
    client_message_id: str
    byline: bool
    correlation_id: str
    requires_membership = False  # a manager publishes whether or not they read the timeline


@dataclass
class ServicePostEdit(Command):
    message_id: str
    title: str
    content: str
    expected_revision: int
    reason: str
    correlation_id: str
    requires_membership = False


@dataclass
class ServicePostWithdraw(Command):
    message_id: str
    expected_revision: int
    reason: str
    correlation_id: str
    requires_membership = False


@dataclass
class SharedPin(Command):
    message_id: str
    top_notice: bool
    pinned: bool  # False: unpin
    correlation_id: str
    requires_membership = False


@dataclass
class ReconcileAudience(Command):
    """System: one bounded audience batch (storage reconcile_step) of this scope's account."""

    batch: int
    correlation_id: str
    requires_membership = False


@dataclass
class DeleteServiceAccount(Command):
    expected_version: int
    governor: bool  # the caller is a workspace owner/admin (checked by the server)
    correlation_id: str
    requires_membership = False


def post_metadata(title: str, byline_member_id: str | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"serviceAccountPost": {"title": title}}
    if byline_member_id is not None:
        metadata["byline"] = {"member_id": byline_member_id}
    return metadata


async def _authority(conn: asyncpg.Connection, state: ScopeContext, command: Command) -> asyncpg.Record:
    """The account and the caller's publishing authority, read in this transaction."""
    account = await store.publish_authority(conn, state.workspace_id, state.scope_id, command.actor.member_id)
    if not account["is_manager"]:
        raise Refused("forbidden", "only the account's managers publish", "not_a_manager")
    if not account["grant_live"]:
        raise Refused("forbidden", "the account's message.write grant is not live", "grant_revoked")
    return account


def _audit_basis(account: asyncpg.Record) -> str:
    return f"service_grant+service_account_manager:{account['id']}"


@register_command(ServicePost)
async def post(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext, command: ServicePost) -> Outcome:
    account = await _authority(conn, state, command)
    if account["audience_state"] == "provisioning":
        raise Refused("conflict", "the account's audience is not ready yet", "audience_not_ready")
    manager = command.actor.member_id
    author = account["author_member_id"]
    intent = MessageIntent(scope_id=state.scope_id, content=command.content, message_type=POST_MESSAGE_TYPE,
                           client_message_id=command.client_message_id,
                           metadata=post_metadata(command.title, manager if command.byline else None))
    service = ActorContext(workspace_id=state.workspace_id, member_id=author, member_kind="service",
                           owner_member_id=None, execution_generation=command.actor.execution_generation,
                           notify_principal_member_id=author, idempotency_subject_member_id=author)
    plan = MessagePlan(intent=intent, actor=service, digest=payload_digest(intent), live_mentions=(),
                       membership_mutations=(), explain=(),
                       outbox=(OutboxEvent("message", "message.created", DeliveryPolicy.INLINE_ORDINARY),))
    # Every manager shares the account's key space: (scope, author, subject, client id).
    existing = (await applier.find_idempotent(conn, state.scope_id, [command.client_message_id])).get(
        (author, author, command.client_message_id))
    if existing is not None:
        if bytes(existing["idempotency_payload_digest"]) != plan.digest:
            raise Conflict("idempotency_conflict", "same client_message_id, different post")
        return Outcome(messages.committed_from_row(existing, replayed=True))
    message, = await applier.insert_messages(conn, state.workspace_id, state.scope_id, [plan])
    await record_audit(conn, workspace_id=state.workspace_id, service_account_id=account["id"],
                       subject_type="message", subject_id=message.id, subject_version=1, action="message.created",
                       actor_type="human", actor_member_id=manager, permission_basis=_audit_basis(account),
                       correlation_id=command.correlation_id, caused_by_member_id=manager,
                       execution_member_id=manager, durable_author_member_id=author,
                       byline_member_id=manager if command.byline else None, message_id=message.id,
                       message_version=1, after_digest=plan.digest.hex(),
                       details={"routing_principal_member_id": author, "notify_principal_member_id": author,
                                "idempotency_subject_member_id": author,
                                "client_message_id": command.client_message_id})
    return Outcome(message, [CommittedEvent("message.created", message.workspace_id, message.scope_id, message.seq,
                                            message.workspace_global_seq, message)])


async def _own_post(conn: asyncpg.Connection, state: ScopeContext, account: asyncpg.Record,
                    message_id: str) -> asyncpg.Record:
    row = await messages.message_row(conn, state.scope_id, message_id)
    if row is None or row["author_member_id"] != account["author_member_id"]:
        raise NotFound("message")
    return row


async def _audit_change(conn: asyncpg.Connection, state: ScopeContext, account: asyncpg.Record,
                        command: ServicePostEdit | ServicePostWithdraw, revision: int, action: str,
                        comment: str | None) -> None:
    """A manager's edit or withdrawal of the account's post: the manager acts, the account stays the author."""
    manager = command.actor.member_id
    await record_audit(conn, workspace_id=state.workspace_id, service_account_id=account["id"],
                       subject_type="message", subject_id=command.message_id, subject_version=revision,
                       action=action, actor_type="human", actor_member_id=manager,
                       permission_basis=_audit_basis(account), correlation_id=command.correlation_id,
                       caused_by_member_id=manager, execution_member_id=manager,
                       durable_author_member_id=account["author_member_id"], message_id=command.message_id,
                       message_version=revision, comment=comment)


@register_command(ServicePostEdit)
async def edit(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
               command: ServicePostEdit) -> Outcome:
    account = await _authority(conn, state, command)
    before = await _own_post(conn, state, account, command.message_id)
    byline = messages.committed_from_row(before).metadata.get("byline")
    metadata = post_metadata(command.title, byline["member_id"] if byline else None)
    row = await applier.edit_message(conn, state.scope_id, command.message_id, command.actor.member_id,
                                     command.content, command.expected_revision,
                                     command.actor.execution_generation, metadata)
    await _audit_change(conn, state, account, command, row["revision"], "message.edited", command.reason or None)
    outcome = Outcome(row)
    outcome.wakes_worker = True  # message.edited leaves through the outbox
    return outcome


@register_command(ServicePostWithdraw)
async def withdraw(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                   command: ServicePostWithdraw) -> Outcome:
    account = await _authority(conn, state, command)
    await _own_post(conn, state, account, command.message_id)
    row = await applier.withdraw_message(conn, state.scope_id, command.message_id, command.actor.member_id,
                                         command.actor.execution_generation, command.expected_revision)
    await store.delete_pin(conn, state.scope_id, command.message_id)
    await _audit_change(conn, state, account, command, row["revision"], "message.withdrawn", command.reason)
    outcome = Outcome(row)
    outcome.wakes_worker = True
    return outcome


@register_command(SharedPin)
async def shared_pin(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext, command: SharedPin) -> Outcome:
    account = await _authority(conn, state, command)
    row = await messages.message_row(conn, state.scope_id, command.message_id)
    if row is None:
        raise NotFound("message")
    if command.pinned:
        if row["state"] != "visible":
            raise Conflict("message_withdrawn", "a withdrawn message cannot be pinned")
        value = await store.pin(conn, state.workspace_id, state.scope_id, command.message_id,
                                command.actor.member_id, command.top_notice)
    else:
        if not await store.delete_pin(conn, state.scope_id, command.message_id):
            raise NotFound("pin")
        value = None
    await record_audit(conn, workspace_id=state.workspace_id, service_account_id=account["id"],
                       subject_type="message", subject_id=command.message_id, subject_version=row["revision"],
                       action="pin.added" if command.pinned else "pin.removed", actor_type="human",
                       actor_member_id=command.actor.member_id, permission_basis=_audit_basis(account),
                       correlation_id=command.correlation_id, message_id=command.message_id,
                       message_version=row["revision"], details={"top_notice": command.pinned and command.top_notice})
    return Outcome(value, [CommittedEvent("pin.changed", state.workspace_id, state.scope_id, None, None, {
        "message_id": command.message_id, "pinned": command.pinned, "top_notice": command.pinned and command.top_notice,
        "member_id": command.actor.member_id})])


@register_command(ReconcileAudience)
async def reconcile(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                    command: ReconcileAudience) -> Outcome:
    step = await store.reconcile_step(conn, state.workspace_id, state.scope_id, command.batch)
    if step is None:
        return Outcome(None)
    await actor.open_members(conn, state, step.opens)
    await actor.close_members(conn, state, step.closes)
    return Outcome(await store.finish_reconcile_step(conn, step, command.correlation_id))


@register_command(DeleteServiceAccount)
async def delete(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                 command: DeleteServiceAccount) -> Outcome:
    account = await store.account_of_scope(conn, state.workspace_id, state.scope_id)
    if account["management_kind"] == "platform":
        raise Refused("forbidden", "a platform service account is deleted by the platform's operators",
                      "platform_managed")
    manager = await store.is_manager(conn, account["id"], command.actor.member_id)
    if not (manager or command.governor):
        raise Refused("forbidden", "only a manager or an owner/admin deletes the account", "not_a_manager")
    row = await store.lock_for_delete(conn, state.workspace_id, account["id"], command.expected_version)
    await store.delete_account_rows(conn, row, command.actor.member_id,
                                    "service_account_manager" if manager else "workspace_governance",
                                    command.correlation_id)
    await actor.erase_scope(conn, state)
    await store.delete_author_member(conn, row)
    return Outcome(row)


@dataclass
class UpdateCard(Command):
    """System: move an approval card (its message, by the Approvals app) to the
    approval's `approval_version`; a card already showing it is left alone."""

    card_id: str
    message_id: str
    approval_version: int
    content: str
    metadata: dict[str, Any]
    requires_membership = False


@register_command(UpdateCard)
async def update_card(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                      command: UpdateCard) -> Outcome:
    revision = await store.advance_card(conn, command.card_id, command.approval_version)
    if revision is None:
        return Outcome(None)
    row = await messages.message_row(conn, state.scope_id, command.message_id)
    if row is None:
        raise NotFound("message")
    card = {**command.metadata.get("card", {}), "card_revision": revision}
    updated = await applier.edit_message(conn, state.scope_id, command.message_id, command.actor.member_id,
                                         command.content, row["revision"], command.actor.execution_generation,
                                         {**command.metadata, "card": card})
    outcome = Outcome(updated)
    outcome.wakes_worker = True
    return outcome
