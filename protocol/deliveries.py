"""The routed delivery feed an agent daemon (or any client) consumes
(scope-model.md §3.10; collaborator-policy §5).

The server decides who a message wakes — authorized live mentions, explicit
recipients, members in `auto-wake`, reactions to your messages — and writes a
delivery for each of them, numbered per recipient (`delivery_seq`, gap-free in
commit order).  A subscribed connection receives them as `delivery` events and
acks each after handling it; an unacked one is sent again (same `dedupe_key`)
after its connection goes or its lease expires, an acked one never.  Ordinary
messages create no deliveries: read context with `message.history`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from protocol.frames import MessageInfo, Ok, Request, WorkspaceRequest

DeliverySeq = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
DeliveryReason = Literal["mention", "recipient", "direct", "auto_wake", "reaction", "watch", "assignment",
                         "audience_mention"]
DeliveryStatus = Literal["pending", "leased", "acked", "suppressed", "expired", "failed"]


class DeliverySubscribe(WorkspaceRequest, tag="delivery.subscribe"):
    """Receive your routed deliveries on this connection as `delivery` events:
    first every unacked one (oldest first), then new ones as they commit.  At most
    `max_in_flight` are unacked on this connection at a time; more follow as you
    ack.  Subscribing again changes `max_in_flight`.  Several connections of one
    member share the feed: each delivery is leased to one of them at a time."""

    max_in_flight: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100


class DeliveryAck(WorkspaceRequest, tag="delivery.ack"):
    """Acknowledge handled deliveries: they are never sent again.  Seqs already
    acked, unknown or not yours are ignored (acking is idempotent)."""

    delivery_seqs: Annotated[list[DeliverySeq], msgspec.Meta(min_length=1, max_length=256)]


class DeliveryUnsubscribe(WorkspaceRequest, tag="delivery.unsubscribe"):
    """Stop receiving deliveries here; this connection's unacked ones return to the feed."""


class DeliveryList(WorkspaceRequest, tag="delivery.list"):
    """Your feed by `delivery_seq` after `after_seq`, every status (deliveries
    recorded without a push, under `quiet`, included).  A read: leases nothing."""

    after_seq: Annotated[int, msgspec.Meta(ge=0, le=2**53)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=200)] = 50


class ActivityInfo(msgspec.Struct):
    """A non-message activity that routed a delivery (e.g. `reaction.added`)."""

    id: str
    activity_type: str
    actor_member_id: str | None
    source_message_id: str | None
    payload: dict[str, Any]


class DeliveryInfo(msgspec.Struct, omit_defaults=True):
    """One routed delivery.  `dedupe_key` is stable across redeliveries
    (`message:<message_id>:<member_id>` or `activity:<activity_id>:<member_id>`);
    `reason` says why it reached you and `authority` by whose right (owner,
    grant, collaborator, same_owner_agent, member).  `message` is the message
    (for a reaction: the message reacted to) as you may read it now; `attempt`
    counts handouts (1 on the first).  `push: false` marks a delivery recorded
    under `quiet`: listed, never pushed."""

    delivery_seq: int
    dedupe_key: str
    reason: DeliveryReason
    kind: Literal["message", "activity"]
    scope_id: str
    status: DeliveryStatus
    attempt: int
    push: bool
    created_at_ms: int
    authority: str | None = None
    message_id: str | None = None
    message: MessageInfo | None = None
    activity: ActivityInfo | None = None
    lease_expires_at_ms: int | None = None
    suppression_reason: str | None = None
    # Every reason that picked you for this message, merged into this one delivery
    # (strand-message §9.4.2), `reason` first: e.g. ["mention", "watch"].
    reasons: list[DeliveryReason] = []


class DeliverySubscribed(msgspec.Struct):
    """`latest_delivery_seq`: the newest delivery of your feed (0: none yet); `unacked`: how many wait for an ack."""

    latest_delivery_seq: int
    unacked: int


class DeliveryAcked(msgspec.Struct):
    acked: list[int]


class DeliveryPage(msgspec.Struct):
    deliveries: list[DeliveryInfo]
    next_after_seq: int | None


FRAMES: tuple[type[Request], ...] = (DeliverySubscribe, DeliveryAck, DeliveryUnsubscribe, DeliveryList)

RESULTS: dict[type[Request], type[msgspec.Struct]] = {
    DeliverySubscribe: DeliverySubscribed,
    DeliveryAck: DeliveryAcked,
    DeliveryUnsubscribe: Ok,
    DeliveryList: DeliveryPage,
}

EVENTS: dict[str, type[msgspec.Struct]] = {"delivery": DeliveryInfo}
