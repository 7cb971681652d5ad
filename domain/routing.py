"""Routed delivery value types, shared by the planner, the scope actor, the
delivery router and storage (scope-model.md §3.10; collaborator-policy §5).

A Route is a decision made on the send path; a RoutedDelivery is the ledger row
it became at commit: what the delivery router hands to a subscribed connection."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

# Why a member receives a delivery; the first reason a member qualifies for wins.
MENTION = "mention"
RECIPIENT = "recipient"
AUTO_WAKE = "auto_wake"
REACTION = "reaction"
DIRECT = "direct"  # a message in a DM is addressed to the DM's other member
WATCH = "watch"  # a strand watcher (effective level all / participating, strand-message §8)
ASSIGNMENT = "assignment"  # assigned to a strand (§7.1)
AUDIENCE_MENTION = "audience_mention"  # an authorized @all / @here ... (§9.4.3)

# Notification states (scope-model.md §2.3, §3.4) and what they do to routing.
SILENCED_STATES = frozenset({"mute", "no-wake"})  # no delivery at all
UNPUSHED_STATES = frozenset({"quiet"})            # recorded, listed, never pushed


@dataclass(frozen=True)
class Route:
    member_id: str
    reason: str
    # Why the author may wake this member: owner | grant | collaborator | same_owner_agent | member.
    authority: str | None
    push: bool
    # Every reason that picked the member for this message, `reason` first (§9.4.2: one delivery).
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoutedDelivery:
    id: str
    workspace_id: str
    recipient_member_id: str
    delivery_seq: int
    scope_id: str
    message_id: str | None
    activity_event_id: str | None
    reason: str
    authority: str | None
    dedupe_key: str
    push: bool
    outbox_id: str
    created_at: datetime
    reasons: tuple[str, ...] = ()


def message_dedupe_key(message_id: str, member_id: str) -> str:
    return f"message:{message_id}:{member_id}"


def activity_dedupe_key(activity_event_id: str, member_id: str) -> str:
    return f"activity:{activity_event_id}:{member_id}"
