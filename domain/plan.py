"""The value types of the send pipeline (scope-model.md §6):
MessageIntent + ActorContext + ScopeContext + LiveMentions → MessagePlan.

Every entry (human send, agent send, thread reply, DM, single and multi
forward, owner_quote) produces a MessagePlan; only the Applier writes it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from domain.routing import Route



class MentionMode(str, enum.Enum):
    """How a message's text is routed (scope-model.md §5.3)."""

    NORMAL = "normal"
    SINGLE_FORWARD = "single_forward"
    MULTI_FORWARD = "multi_forward"          # forwarding many messages must not re-notify anyone
    EXPLICIT_CONTEXT = "explicit_context"    # recipients are given explicitly, not parsed


class DeliveryPolicy(str, enum.Enum):
    """First-delivery owner and replay policy of a producer (scope-model.md §3.10.1)."""

    INLINE_ORDINARY = "inline_ordinary"
    AUTONOMOUS_STORE_RECOVERABLE = "autonomous_store_recoverable"
    INLINE_TARGETED = "inline_targeted"
    WORKER_FIRST_TARGETED = "worker_first_targeted"
    WORKER_FIRST_MUTATION = "worker_first_mutation"


@dataclass(frozen=True)
class SourceRef:
    kind: str  # reply | quote | forward | multi_forward | owner_quote | explicit_context
    message_id: str
    scope_id: str
    seq: int


@dataclass(frozen=True)
class MessageIntent:
    scope_id: str
    content: str
    message_type: str = "text"
    client_message_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    sources: tuple[SourceRef, ...] = ()
    mention_mode: MentionMode = MentionMode.NORMAL
    # Explicit recipients the client asks to address (scope-model.md §5.2, §5.3):
    # authorized by the Policy like live mentions; never trusted as given.
    recipients: tuple[str, ...] = ()
    # Silent/internal messages are stored and readable but produce no fanout
    # (explicit no-fanout rule, scope-model.md §6.5).
    silent: bool = False
    # The author's stored uploads in this scope, claimed in the send's transaction.
    attachment_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ActorContext:
    workspace_id: str
    member_id: str
    member_kind: str  # human | agent | service
    owner_member_id: str | None
    execution_generation: int
    notify_principal_member_id: str | None = None
    idempotency_subject_member_id: str | None = None


@dataclass(frozen=True)
class RosterEntry:
    member_id: str
    kind: str
    visibility: str
    owner_member_id: str | None
    last_read_seq: int
    # Where the open membership's interval starts: a private reader reads nothing before it.
    effective_from_seq: int = 1
    # The member's notification state here (scope-model.md §3.4): it decides routing.
    notification_state: str = "active"


@dataclass
class ScopeContext:
    """What the scope's actor knows about its scope (it is the only writer)."""

    scope_id: str
    workspace_id: str
    type: str
    status: str
    parent_scope_id: str | None
    root_message_id: str | None
    latest_seq: int
    roster_generation: int
    visibility: str | None  # channel profile visibility
    roster: dict[str, RosterEntry]


@dataclass(frozen=True)
class MentionCandidate:
    member_id: str
    handle: str
    kind: str
    status: str
    visibility: str | None
    owner_member_id: str | None


@dataclass(frozen=True)
class Explain:
    member_id: str
    reason: str  # e.g. "mention", "mention_not_addressable:not_a_member"
    delivered: bool


@dataclass(frozen=True)
class MembershipMutation:
    member_id: str
    action: str  # open | close
    visibility: str = "public"
    owner_member_id: str | None = None


@dataclass(frozen=True)
class ChannelProfile:
    slug: str
    display_name: str
    description: str
    visibility: str  # public | private


@dataclass(frozen=True)
class OutboxEvent:
    event_ref_type: str
    fanout_type: str
    policy: DeliveryPolicy


@dataclass
class MessagePlan:
    intent: MessageIntent
    actor: ActorContext
    digest: bytes
    live_mentions: tuple[str, ...]  # member ids that are addressable
    membership_mutations: tuple[MembershipMutation, ...]
    outbox: tuple[OutboxEvent, ...]
    explain: tuple[Explain, ...]
    recipients: tuple[str, ...] = ()  # explicit recipients that passed the Policy
    # (owner, trigger) of Scope Executions this message creates if missing (a wake, an owner_quote).
    executions: tuple[tuple[str, str], ...] = ()
    # Who this message wakes by mention or explicit recipient (auto-wake is added at commit,
    # when the message's seq decides what a private agent reads).
    routes: tuple[Route, ...] = ()
    # Audience mentions (strand-message §9.4.3) as (token, audience): authorized and expanded
    # by the scope actor at commit, never into a stored recipient list.
    audience_mentions: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CommittedMessage:
    id: str
    workspace_id: str
    scope_id: str
    seq: int
    workspace_global_seq: int
    author_member_id: str
    author_type: str
    message_type: str
    content: str
    metadata: dict[str, Any]
    client_message_id: str | None
    created_at: datetime
    revision: int = 1
    state: str = "visible"
    replayed: bool = False  # an idempotent retry: this is the original message
