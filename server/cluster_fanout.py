"""Cross-node fanout: committed events reach subscribers on every node.

The hub hands every publication to `encode` as well (FanoutHub.relay), and the
node sends it on the bus.  A receiving node turns it back into events for its
own hub (`RemoteFanout.deliver`):

- `message.created` travels whole with the owner's answer to who may read it:
  a roster of up to MAX_EXPLICIT_AUDIENCE listed, else the scope's roster
  generation and the private members that may read it.  The receiver keeps
  each followed scope's public readers by generation (one read when the roster
  changes, none per message).  A message the owner could not answer for (a
  task's, a scope with many private members), one too big for the
  publication's room, or one whose roster has moved on by the time the
  receiver asks, travels (or is taken) as its cursor (scope, seq, global seq):
  the receiver reads it from the durable log with, per row, which of its own
  followers may read it — the one readable predicate, one statement per scope.
  Ordering, gaps and duplicates are then the cursors' business
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
from collections import OrderedDict, defaultdict
from typing import TYPE_CHECKING, Any

import msgspec

from actors.fanout import CommittedEvent, Roster
from actors.scope_actor import MessageAudience
from domain.plan import CommittedMessage
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
# A shipped message lists at most this many private members that may read it (else: its cursor).
MAX_SHIPPED_PRIVATE_READERS = 256
# Messages travel whole while a publication's shipped messages fit in this many bytes
# (a NOTIFY carries 8000 base64 characters; a bigger payload costs a table round trip).
MAX_SHIPPED_MESSAGE_BYTES = 4_096
# Followed scopes whose public readers a node keeps, by roster generation (least recently used go).
PUBLIC_ROSTER_CACHE = 1_024


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


class MessageItem(msgspec.Struct, array_like=True, tag=3):
    """A new message in full with who may read it: `members`, else the scope's public
    readers at roster `generation` and the `private` members listed."""

    workspace_id: str
    scope_id: str
    seq: int
    global_seq: int
    message: msgspec.Raw  # a domain.plan.CommittedMessage
    members: list[str] | None
    generation: int | None
    private: list[str]


class FeedsItem(msgspec.Struct, array_like=True, tag=2):
    """Routed deliveries were committed to these (workspace, member) feeds."""

    feeds: list[tuple[str, str]]


Item = CursorItem | EventItem | MessageItem | FeedsItem
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Item])
_message_decoder = msgspec.msgpack.Decoder(CommittedMessage)
# Carries nothing but its number: a quiet node still shows the others a gap it left.
TICK = _encoder.encode([])


def encode(items: list[tuple[CommittedEvent, Any]]) -> bytes | None:
    """A publication as one bus payload (None: nothing for other nodes)."""
    out: list[Item] = []
    room = MAX_SHIPPED_MESSAGE_BYTES
    for event, roster in items:
        if event.event == MESSAGE_CREATED and event.seq is not None:
            shipped = _shipped_message(event, roster, room)
            if shipped is None:
                out.append(CursorItem(event.workspace_id, event.scope_id, event.seq, event.global_seq))
            else:
                room -= len(shipped.message)
                out.append(shipped)
            continue
        members, readers, message_id = _audience(event, roster)
        out.append(EventItem(event.event, event.workspace_id, event.scope_id, event.seq, event.global_seq,
                             encode_frame(event_frame(event), binary=True), members, readers, message_id))
    return _encoder.encode(out) if out else None


def _shipped_message(event: CommittedEvent, roster: Any, room: int) -> MessageItem | None:
    """The message whole with the owner's answer to who may read it, or None (it
    travels as its cursor): see the module's docstring."""
    if not isinstance(event.data, CommittedMessage) or event.global_seq is None:
        return None
    readers = event.audience if event.audience is not None else roster
    members, generation, private = None, None, []
    if isinstance(readers, (set, frozenset)) and len(readers) <= MAX_EXPLICIT_AUDIENCE:
        members = sorted(readers)
    elif isinstance(readers, Roster) and readers.generation is not None:
        generation = readers.generation
    elif isinstance(readers, MessageAudience) and readers.generation is not None:
        private = readers.private_readers(MAX_SHIPPED_PRIVATE_READERS)
        if private is None:
            return None
        generation = readers.generation
    else:
        return None
    body = _encoder.encode(event.data)
    if len(body) > room:
        return None
    return MessageItem(event.workspace_id, event.scope_id, event.seq, event.global_seq, msgspec.Raw(body),
                       members, generation, private)


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


class _PublicAndPrivate:
    """Who may read a shipped message: the scope's public readers and the private members listed."""

    __slots__ = ("public", "private")

    def __init__(self, public: frozenset[str], private: frozenset[str]) -> None:
        self.public, self.private = public, private

    def __contains__(self, member_id: object) -> bool:
        return member_id in self.public or member_id in self.private


class RemoteFanout:
    """Publishes other nodes' bus payloads to this node's subscribers."""

    def __init__(self, server: Server) -> None:
        self.server = server
        # scope → (roster generation, its public readers), for the scopes followed here.
        self._public: OrderedDict[str, tuple[int, frozenset[str]]] = OrderedDict()
        # Database reads for other nodes' publications (plain ints: read at scrape time).
        self.roster_reads = 0
        self.log_reads = 0

    def _public_at(self, scope_id: str, generation: int | None) -> frozenset[str] | None:
        known = self._public.get(scope_id)
        if known is None or known[0] != generation:
            return None
        self._public.move_to_end(scope_id)
        return known[1]

    def _knows(self, item: Item) -> bool:
        """Whether the public readers a shipped message names by generation are known here."""
        return not isinstance(item, MessageItem) or item.members is not None or self._public_at(
            item.scope_id, item.generation) is not None

    async def _learn_public_rosters(self, items: list[Item]) -> None:
        """Read the public readers of the scopes whose shipped messages name a generation not known here."""
        # A generation older than the one known here is not worth a read: the log answers for it.
        unknown = sorted({item.scope_id for item in items if not self._knows(item)
                          and (item.generation or 0) > self._public.get(item.scope_id, (-1,))[0]})
        if not unknown:
            return
        self.roster_reads += 1
        for scope_id, known in (await self.server.db.run(visibility.public_rosters, unknown)).items():
            self._public[scope_id] = known
            self._public.move_to_end(scope_id)
        while len(self._public) > PUBLIC_ROSTER_CACHE:
            self._public.popitem(last=False)

    async def deliver(self, payloads: list[bytes]) -> None:
        """Publish these bus payloads (in order) to this node's subscribers.  Raises
        UnreadableBusPayload after publishing the rest when one could not be read."""
        decoded: list[Item] = []
        unreadable = 0
        for payload in payloads:
            try:
                decoded += _decoder.decode(payload)
            except msgspec.DecodeError:
                unreadable += 1
        woken = [tuple(feed) for item in decoded if isinstance(item, FeedsItem) for feed in item.feeds]
        if woken:
            self.server.deliveries.wake(woken)
        hub = self.server.hub
        items = [item for item in decoded
                 if not isinstance(item, FeedsItem) and hub.followed(item.workspace_id, item.scope_id)]
        await self._learn_public_rosters(items)
        for index, item in enumerate(items):
            if isinstance(item, MessageItem) and not self._knows(item):
                # Its roster has moved on since it was sent: the log answers for it.
                items[index] = CursorItem(item.workspace_id, item.scope_id, item.seq, item.global_seq)
        # What to ask the database, per scope with local followers.
        ranges: dict[str, list[int]] = {}
        need_readers: set[str] = set()
        about: dict[str, set[str]] = defaultdict(set)  # scope → messages whose readers are asked for
        for item in items:
            if isinstance(item, CursorItem):
                low_high = ranges.setdefault(item.scope_id, [item.seq, item.seq])
                low_high[0], low_high[1] = min(low_high[0], item.seq), max(low_high[1], item.seq)
            elif isinstance(item, EventItem):
                if item.readers:
                    need_readers.add(item.scope_id)
                if item.message_id is not None:
                    about[item.scope_id].add(item.message_id)
        workspaces = {item.scope_id: item.workspace_id for item in items}
        asks = [(scope_id, *ranges.get(scope_id, (1, 0)), sorted(hub.followers(workspaces[scope_id], scope_id)),
                 scope_id in need_readers, sorted(about.get(scope_id, ())))
                for scope_id in sorted(set(ranges) | need_readers | set(about))]
        answers = {}
        if asks:
            self.log_reads += 1
            answers = await self.server.db.transaction(_entitlements, asks)
        events = [event for item in items if (event := self._event(item, answers)) is not None]
        if events:
            self.server.hub.publish_many(events, relay=False)
        if unreadable:
            raise UnreadableBusPayload(f"{unreadable} bus payload(s) could not be read")

    def _event(self, item: Item, answers) -> tuple[CommittedEvent, Any] | None:
        """The event an item stands for, with who may have it (None: nothing to publish)."""
        rows, readers, by_message = answers.get(item.scope_id, ({}, frozenset(), {}))
        if isinstance(item, MessageItem):
            if item.members is not None:
                entitled = frozenset(item.members)
            else:
                public = self._public[item.scope_id][1]
                entitled = _PublicAndPrivate(public, frozenset(item.private)) if item.private else public
            return CommittedEvent(MESSAGE_CREATED, item.workspace_id, item.scope_id, item.seq, item.global_seq,
                                  _message_decoder.decode(item.message)), entitled
        if isinstance(item, CursorItem):
            row = rows.get(item.seq)
            if row is None:
                return None  # gone (the scope's messages were deleted with their account)
            return CommittedEvent(MESSAGE_CREATED, item.workspace_id, item.scope_id, item.seq, item.global_seq,
                                  messages.committed_from_row(row), audience=frozenset(row["entitled"])), None
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
        event.frames[False] = server_frame(msgspec.json.encode(msgspec.msgpack.decode(item.frame)), binary=False)
        return event, None


class UnreadableBusPayload(Exception):
    """A bus payload this node cannot read (a damaged one, or another version's)."""


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
