"""The workspace side of a platform broadcast (service-account §4.5): one
delivery, run by the local account's scope actor in its batch transaction —
the actor that owns the scope's sequence writes the message.

The execution fence is checked in that same transaction before anything is
written: the platform root (key share, so Delete waits for it), the delivery's
lease token, version and expiry, the workspace's placement epoch, and the
instance's cursor (the previous broadcast seq is applied here).  A stale fence
refuses with its reason and commits nothing.  The delivered settlement and
the instance cursor commit with the message, so a lost reply leaves a
delivery that no later lease can take again.  So do the broadcast's
attachments: each asset of its manifest becomes a workspace attachment
(mapped by delivery and asset ordinal) that the message claims."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from actors.fanout import CommittedEvent
from actors.scope_actor import Command, Outcome, Refused, ScopeActor, register_command
from actors.service_accounts import post_metadata
from domain.platform import DELIVERY_PERMISSION_BASIS, BroadcastSnapshot, Lease, client_message_id
from domain.plan import ActorContext, DeliveryPolicy, MessageIntent, MessagePlan, OutboxEvent, ScopeContext
from domain.service_accounts import POST_MESSAGE_TYPE
from storage import applier
from storage import attachments as attachment_rows
from storage import platform as store
from storage import platform_assets
from storage.errors import Conflict
from storage.human_lifecycle import audit_row
from storage.ids import new_id


@dataclass
class PlatformDelivery(Command):
    lease: Lease
    broadcast: BroadcastSnapshot
    requires_membership = False  # the trusted platform delivery service, not a member

    async def prelock(self, conn: asyncpg.Connection) -> None:
        # First in the batch: a platform delete holds the root FOR UPDATE and then needs this scope's rows.
        await store.hold_root(conn, self.broadcast.platform_service_account_id)


@register_command(PlatformDelivery)
async def deliver(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                  command: PlatformDelivery) -> Outcome:
    lease, broadcast = command.lease, command.broadcast
    try:
        fence = await store.fence_delivery(conn, lease, broadcast.platform_service_account_id, state.scope_id)
    except Conflict as exc:
        raise Refused("conflict", str(exc), exc.reason) from None
    if fence["id"] != fence["local_service_account_id"]:
        raise Refused("conflict", "the instance moved to another local account", "stale_lease")
    if fence["audience_state"] == "provisioning" or not fence["grant_live"]:
        raise Refused("conflict", "the local account's audience or grant is not ready", "audience_not_ready")
    author = fence["author_member_id"]
    try:
        attachments = await platform_assets.materialize(
            conn, delivery_id=lease.delivery_id, workspace_id=state.workspace_id, scope_id=state.scope_id,
            author_member_id=author, manifest=list(broadcast.assets),
            attachment_ids=[new_id("att") for _ in broadcast.assets]) if broadcast.assets else []
    except Conflict as exc:
        raise Refused("conflict", str(exc), exc.reason) from None
    # No idempotency lookup: the delivered settlement commits with the message, so a fence that passed
    # means no earlier attempt wrote it; the unique message key on the deterministic client id backs that.
    client_id = client_message_id(broadcast.broadcast_id)
    intent = MessageIntent(scope_id=state.scope_id, content=broadcast.content, message_type=POST_MESSAGE_TYPE,
                           client_message_id=client_id, metadata=post_metadata(broadcast.title, None))
    service = ActorContext(workspace_id=state.workspace_id, member_id=author, member_kind="service",
                           owner_member_id=None, execution_generation=command.actor.execution_generation,
                           notify_principal_member_id=author, idempotency_subject_member_id=author)
    plan = MessagePlan(intent=intent, actor=service, digest=broadcast.payload_digest, live_mentions=(),
                       membership_mutations=(), explain=(),
                       outbox=(OutboxEvent("message", "message.created",
                                           DeliveryPolicy.AUTONOMOUS_STORE_RECOVERABLE),))
    message, = await applier.insert_messages(conn, state.workspace_id, state.scope_id, [plan],
                                             attachments=[[attachment_rows.info(row) for row in attachments]]
                                             if attachments else None)
    audit = audit_row(workspace_id=state.workspace_id, service_account_id=fence["id"],
                   subject_type="message", subject_id=message.id, subject_version=1, action="message.created",
                   actor_type="system", actor_member_id=None, permission_basis=DELIVERY_PERMISSION_BASIS,
                   correlation_id=broadcast.correlation_id, durable_author_member_id=author,
                   message_id=message.id, message_version=1, after_digest=broadcast.payload_digest.hex(),
                   details={"platform_service_account_id": broadcast.platform_service_account_id,
                            "broadcast_id": broadcast.broadcast_id, "broadcast_seq": broadcast.broadcast_seq,
                            "caused_by_operator_id": broadcast.operator_id,
                            "execution_actor": "platform_broadcast_delivery",
                            "routing_principal_member_id": author, "notify_principal_member_id": author,
                            "idempotency_subject_member_id": author, "client_message_id": client_id,
                            "delivery_id": lease.delivery_id})
    await store.settle_delivered(conn, lease, fence["instance_id"], message.id, audit)
    return Outcome(message, [CommittedEvent("message.created", message.workspace_id, message.scope_id, message.seq,
                                            message.workspace_global_seq, message)])


@dataclass
class ScopeErased(Command):
    """System: a platform account's delete erased this scope in its own transaction; the live actor
    drops its state (its reload finds no scope)."""

    requires_membership = False


@register_command(ScopeErased)
async def erased(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext, command: ScopeErased) -> Outcome:
    actor.forget_state()
    return Outcome(None)
