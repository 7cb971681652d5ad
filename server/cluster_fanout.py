"""Cross-node fanout: committed events reach subscribers on every node.

The hub hands every publication to `encode` as well (FanoutHub.relay), and the
node sends it on the bus.  A receiving node turns it back into events for its
own hub (`RemoteFanout.deliver`):

- `message.created` travels as its cursor only (scope, seq, global seq); the
  receiver reads the rows from the durable log with, per row, which of its own
  followers may read it — the one readable predicate, one statement per scope
  for all of them.  Ordering, gaps and duplicates are then the cursors' business
  (server/realtime.py), exactly as for a local event: a gap is filled from the
  log first, a duplicate dropped.
- Every other event travels as its encoded frame with who may have it: an
  explicit audience in full (one computed for a message — a reaction's — as
  that message), a roster of up to MAX_EXPLICIT_AUDIENCE listed, a larger one
  as "who may read this message" for an event about a message, else as "the
  scope's public readers" plus the member a membership change concerns; the
  receiver answers those questions for its own followers.

A node with no follower of a scope or its workspace reads nothing for it.
A lost bus message (a gap in a sender's numbers, or a transport resync) makes
every local subscriber replay from its cursors: messages are never lost that
way; the other events of the lost message are (they were never durable).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import msgspec

from actors.fanout import CommittedEvent
from domain.routing import RoutedDelivery
from protocol.codec import encode as encode_frame
from server.realtime import event_frame
from server.wire import server_frame
from storage import messages, visibility

if TYPE_CHECKING:
    from server.app import Server

log = logging.getLogger("scopewire.cluster")

MESSAGE_CREATED = "message.created"
# A larger roster travels as a question the receiver answers for its own followers.
MAX_EXPLICIT_AUDIENCE = 256


class CursorItem(msgspec.Struct, array_like=True, tag=0):
    workspace_id: str
    scope_id: str
    seq: int
    global_seq: int


class EventItem(msgspec.Struct, array_like=True, tag=1):
    event: str
    workspace_id: str
    scope_id: str
    seq: int | None
    global_seq: int | None
    frame: bytes  # the protocol Event, MessagePack-encoded (not yet a WebSocket frame)
    # None: everyone following (no entitlement); else these members, with `readers`
    # also the scope's readers, and with `message_id` also who may read that message.
    members: list[str] | None
    readers: bool
    message_id: str | None


class FeedsItem(msgspec.Struct, array_like=True, tag=2):
    """Routed deliveries were committed to these (workspace, member) feeds."""

    feeds: list[tuple[str, str]]


Item = CursorItem | EventItem | FeedsItem
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Item])
# Carries nothing but its number: a quiet node still shows the others a gap it left.
TICK = _encoder.encode([])


def encode(items: list[tuple[CommittedEvent, Any]]) -> bytes | None:
    """A publication as one bus payload (None: nothing for other nodes)."""
    out: list[Item] = []
    for event, roster in items:
        if event.event == MESSAGE_CREATED and event.seq is not None:
            out.append(CursorItem(event.workspace_id, event.scope_id, event.seq, event.global_seq))
            continue
        members, readers, message_id = _audience(event, roster)
        out.append(EventItem(event.event, event.workspace_id, event.scope_id, event.seq, event.global_seq,
                             encode_frame(event_frame(event), binary=True), members, readers, message_id))
    return _encoder.encode(out) if out else None


def encode_feeds(offered: list[RoutedDelivery]) -> bytes | None:
    """Committed routed deliveries as one bus payload: only which feeds have new ones
    (each node's router reads them from the ledger for its own subscribers)."""
    feeds = sorted({(d.workspace_id, d.recipient_member_id) for d in offered if d.push})
    return _encoder.encode([FeedsItem(feeds)]) if feeds else None


def _audience(event: CommittedEvent, roster: Any) -> tuple[list[str] | None, bool, str | None]:
    """(members, readers, message_id) for the receiver: see EventItem."""
    message_id = _message_of(event)
    if event.audience is not None:
        # An explicit audience (one member's read state, a service account's watchers) goes
        # in full; one computed for a message (a reaction's: who may read it) as the message.
        if message_id is not None and (not isinstance(event.audience, (set, frozenset))
                                       or len(event.audience) > MAX_EXPLICIT_AUDIENCE):
            return [], False, message_id
        return sorted(event.audience), False, None
    if roster is None:
        return None, False, None
    if isinstance(roster, (set, frozenset)) and len(roster) <= MAX_EXPLICIT_AUDIENCE:
        return sorted(roster), False, None
    if message_id is not None:
        return [], False, message_id
    # A large roster: the receiver asks who of its followers are the scope's public readers.
    # A member a membership change concerns hears of it even when it just left.
    member = _field(event.data, "member_id") if event.event == "membership.changed" else None
    return ([member] if isinstance(member, str) else []), True, None


def _field(data: Any, name: str) -> Any:
    return data.get(name) if isinstance(data, dict) else getattr(data, name, None)


def _message_of(event: CommittedEvent) -> str | None:
    found = _field(event.data, "id" if event.event.startswith("message.") else "message_id")
    return found if isinstance(found, str) else None


class RemoteFanout:
    """Publishes other nodes' bus payloads to this node's subscribers."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def _followers(self, workspace_id: str, scope_id: str) -> list[str]:
        return sorted(self.server.hub.followers(workspace_id, scope_id))

    async def deliver(self, payloads: list[bytes]) -> None:
        """Publish these bus payloads (in order) to this node's subscribers."""
        items: list[Item] = []
        for payload in payloads:
            try:
                items += _decoder.decode(payload)
            except msgspec.DecodeError:
                log.warning("unreadable bus payload ignored")
        woken = [tuple(feed) for item in items if isinstance(item, FeedsItem) for feed in item.feeds]
        if woken:
            self.server.deliveries.wake(woken)
        items = [item for item in items if not isinstance(item, FeedsItem)]
        # What to ask the database, per scope with local followers.
        ranges: dict[str, list[int]] = {}
        need_readers: set[str] = set()
        about: dict[str, set[str]] = defaultdict(set)  # scope → messages whose readers are asked for
        followers: dict[str, list[str]] = {}
        for item in items:
            if item.scope_id not in followers:
                followers[item.scope_id] = self._followers(item.workspace_id, item.scope_id)
            if not followers[item.scope_id]:
                continue
            if isinstance(item, CursorItem):
                low_high = ranges.setdefault(item.scope_id, [item.seq, item.seq])
                low_high[0], low_high[1] = min(low_high[0], item.seq), max(low_high[1], item.seq)
            else:
                if item.readers:
                    need_readers.add(item.scope_id)
                if item.message_id is not None:
                    about[item.scope_id].add(item.message_id)
        asks = [(scope_id, *ranges.get(scope_id, (1, 0)), followers[scope_id], scope_id in need_readers,
                 sorted(about.get(scope_id, ()))) for scope_id in sorted(set(ranges) | need_readers | set(about))]
        answers = await self.server.db.transaction(_entitlements, asks) if asks else {}
        events: list[tuple[CommittedEvent, Any]] = []
        for item in items:
            if not followers.get(item.scope_id):
                continue
            rows, readers, by_message = answers.get(item.scope_id, ({}, frozenset(), {}))
            if isinstance(item, CursorItem):
                row = rows.get(item.seq)
                if row is None:
                    continue  # gone (the scope's messages were deleted with their account)
                events.append((CommittedEvent(MESSAGE_CREATED, item.workspace_id, item.scope_id, item.seq,
                                              item.global_seq, messages.committed_from_row(row),
                                              audience=frozenset(row["entitled"])), None))
                continue
            audience = None
            if item.members is not None:
                audience = frozenset(item.members)
                if item.readers:
                    audience |= readers
                if item.message_id is not None:
                    audience |= frozenset(by_message.get(item.message_id, ()))
            event = CommittedEvent(item.event, item.workspace_id, item.scope_id, item.seq, item.global_seq,
                                   None, audience=audience)
            event.frames[True] = server_frame(item.frame, binary=True)
            event.frames[False] = server_frame(
                msgspec.json.encode(msgspec.msgpack.decode(item.frame)), binary=False)
            events.append((event, None))
        if events:
            self.server.hub.publish_many(events, relay=False)


async def _entitlements(conn, asks) -> dict[str, tuple[dict[int, Any], frozenset[str], dict[str, list[str]]]]:
    # The predicate is a large expression: planned for each call's arguments it cost 20-50 ms
    # of planning per bus message against ~1 ms to run (bench/cluster.py, pg_stat_statements);
    # one generic plan per connection serves every call.
    await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    answers = {}
    for scope_id, from_seq, to_seq, members, readers_too, message_ids in asks:
        rows, readers, by_message = await visibility.followers_entitled(conn, scope_id, from_seq, to_seq, members,
                                                                         readers_too, message_ids)
        answers[scope_id] = ({row["seq"]: row for row in rows}, frozenset(readers), by_message)
    return answers
