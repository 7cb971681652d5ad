"""The one table of what each push carries: `EVENTS` maps every `event` name
to the msgspec Struct in its `data`.

Message events (`message.*`) carry the message itself (a withdrawn message
with empty `content` and `metadata`) and the frame's `seq` / `global_seq` are
its cursors; every other event leaves them out.  The server converts each
payload through this table when it encodes an event (server/realtime.py), the
generated spec documents it, and the test suite validates every event frame
it receives against it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol import collaboration, deliveries, platform, service_accounts, strands
from protocol import frames as f


class ReactionChanged(msgspec.Struct):
    """`reaction.added` / `reaction.removed`: `member_id` set (or cleared) reaction `key` on `message_id`.
    Sent only when the set changed (adding an existing reaction sends nothing)."""

    message_id: str
    key: str
    member_id: str


class MembershipChanged(msgspec.Struct, omit_defaults=True):
    """A member's scope membership opened (joined, invited, created with the scope) or closed (left, removed,
    or `reason: "departed"` when the member left the workspace).  `roster_generation` grows with every roster
    change of the scope.  Sent to the roster before and after the change, so the member removed sees it too."""

    member_id: str
    action: Literal["open", "close"]
    roster_generation: int
    reason: Literal["departed"] | None = None
    # A private member (a private agent) carries its owner: public member lists leave it out.
    visibility: Literal["public", "private"] = "public"
    owner_member_id: str | None = None


class TypingSignal(msgspec.Struct):
    """Ephemeral, never stored: sent to the scope's current members.  Treat the member as typing until
    `expires_at_ms` (server clock, Unix ms) unless a later signal says otherwise."""

    member_id: str
    state: Literal["start", "stop"]
    expires_at_ms: int


class PresenceSignal(msgspec.Struct):
    """Ephemeral, never stored: sent to the workspace feed's subscribers (the frame's `scope_id` is "").
    Valid until `expires_at_ms` (server clock, Unix ms) unless refreshed."""

    member_id: str
    state: Literal["online", "away"]
    expires_at_ms: int


class ReadStateChanged(msgspec.Struct):
    """Only to the member's own connections: their read cursor in the scope moved."""

    member_id: str
    last_read_seq: int
    manual_unread: bool


class InboxChanged(msgspec.Struct, omit_defaults=True):
    """Only to the member's own connections: a personal conversation flag changed; only the fields that
    changed are present."""

    member_id: str
    notification_state: f.NotificationState | None = None
    pinned: bool | None = None
    hidden: bool | None = None


class ScopeArchived(msgspec.Struct):
    """The scope is archived: read-only from now on."""


class EventsMissed(msgspec.Struct):
    """Events that are not in the durable log may have been lost on their way from another node
    (`reason: "cluster_bus"`): every event but `message.*` — reactions, membership changes, read
    states, typing, presence, service account and platform broadcast changes.  Messages are not lost:
    what this connection's cursors missed is replayed before this event.  Re-read what such events
    keep current (scope members, reactions, read states; an operator: broadcasts and their
    deliveries).  The frame's `scope_id` is ""."""

    reason: Literal["cluster_bus"]


EVENTS: dict[str, type[msgspec.Struct]] = {
    "message.created": f.MessageInfo,
    "message.edited": f.MessageInfo,
    "message.withdrawn": f.MessageInfo,
    "reaction.added": ReactionChanged,
    "reaction.removed": ReactionChanged,
    "membership.changed": MembershipChanged,
    "typing": TypingSignal,
    "presence": PresenceSignal,
    "read_state.changed": ReadStateChanged,
    "inbox.changed": InboxChanged,
    "scope.archived": ScopeArchived,
    "events.missed": EventsMissed,
    "collaborator.changed": collaboration.CollaboratorChanged,
    **deliveries.EVENTS,
    **service_accounts.EVENTS,
    **platform.EVENTS,
    **strands.EVENTS,
}
MESSAGE_EVENTS = frozenset(name for name, payload in EVENTS.items() if payload is f.MessageInfo)


def payload(event: str, data: object) -> msgspec.Struct:
    """The typed payload of `event` (KeyError for an event with no entry: every event needs one)."""
    kind = EVENTS[event]
    return data if isinstance(data, kind) else msgspec.convert(data, kind)


def _event_frame(event: str, data: type[msgspec.Struct]) -> type[msgspec.Struct]:
    name = "".join(part.title() for part in event.replace(".", "_").split("_")) + "EventFrame"
    fields = [("event", Literal[event]), ("workspace_id", str), ("scope_id", str), ("data", data)]
    if event in MESSAGE_EVENTS:  # only message events carry cursors
        fields += [("seq", int), ("global_seq", int)]
    return msgspec.defstruct(name, fields, tag_field="type", tag="event", forbid_unknown_fields=True)


# The `event` frame of each event with its `data` typed: what a client may rely on.
EVENT_FRAMES: dict[str, type[msgspec.Struct]] = {name: _event_frame(name, data) for name, data in EVENTS.items()}
