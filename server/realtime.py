"""Per-connection realtime delivery: subscriptions, resume and pushes.

A subscribed connection has one PushState: the hub's sink for it.  It keeps
cursors — the last seq sent per followed scope and the last
workspace_global_seq sent on the workspace feed — and the durable log is the
buffer: a resume cursor, or a gap between a cursor and a live event, is filled
from the database before the live event is sent; anything at or below the
cursor is dropped.  So every committed message reaches the connection once, in
order, however long it was away.

Fast path (every live event in order): the hub calls `admit` from the
committing task; the event's frame, encoded once per wire format and shared
by every recipient, is written with the rest of the batch in one non-blocking
write — for a publication that is one run, gathered with every other
connection's and sent through io_uring when the publication is over, where the
node has a ring (server/send_ring.py).  No task is involved.  Connections that
take a scope's lone runs in step form its ScopeGroup, which takes the next run
for all of them at once.

Slow path (a resume, or a gap): a replay task owns delivery until the gap is
filled; live events meanwhile wait in a bounded backlog, and when it is empty
the fast path takes over again.

A connection that cannot keep up — more than `push_buffer_bytes` unsent, or a
backlog past `push_buffer_events`, or a replay write blocked past
`push_timeout_seconds` — is closed with 4408 slow_consumer and resumes from
its cursors.  Nobody else waits for it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import TYPE_CHECKING

import trio

from actors.fanout import MESSAGE_CREATED, CommittedEvent, EventRun, Subscription
from domain.plan import CommittedMessage
from protocol import events
from protocol import frames as f
from protocol.codec import encode
from protocol.errors import ErrorCode, ProtocolError
from server.messaging import _scope, message_info, scope_info
from server.rbac import Permission
from server.transport import ConnectionClosed
from server.wire import server_frame
from storage import messages, visibility
from storage.errors import DatabaseUnavailable

if TYPE_CHECKING:
    from server.app import Connection, Server

log = logging.getLogger("scopewire.realtime")

BACKFILL_PAGE = 200
SKIPPED_AHEAD_LIMIT = 256  # feed steps remembered out of order per connection
EVENTS_MISSED = "events.missed"


def _message_data(message: CommittedMessage | object, event: str):
    info = message_info(message)
    if event == "message.withdrawn" or info.state == "withdrawn":
        info.content, info.metadata = "", {}
    return info


def shared_frame(event: CommittedEvent, binary: bool) -> bytes:
    """The event's WebSocket frame in one wire format, built by its first recipient."""
    frame = event.frames.get(binary)
    if frame is None:
        frame = event.frames[binary] = server_frame(encode(event_frame(event), binary=binary), binary=binary)
    return frame


class PushState:
    """One connection's subscriptions, cursors and delivery (the hub's Sink)."""

    __slots__ = ("server", "connection", "workspace_id", "member_id", "subscription", "scope_cursors",
                 "global_cursor", "_skipped_ahead", "_ws", "_binary", "_buffer_limit", "_backlog", "_catch_up_due",
                 "_writes", "_group")

    def __init__(self, server: Server, connection: Connection, workspace_id: str, member_id: str) -> None:
        self.server = server
        self.connection = connection
        # Interned, as the connection's principal and the workspace's other subscribers hold them.
        self.workspace_id = workspace_id = sys.intern(workspace_id)
        self.member_id = member_id = sys.intern(member_id)
        self.subscription = server.hub.subscribe(member_id, self)
        self.scope_cursors: dict[str, int] = {}
        self.global_cursor: int | None = None
        # Feed steps skipped before the step under them arrived: two scopes' publications
        # can reach the hub out of commit order.  None while empty (most connections).
        self._skipped_ahead: set[int] | None = None
        self._ws = connection.ws
        self._binary = connection.ws.binary
        self._buffer_limit = server.config.push_buffer_bytes
        # The node's gathered writes of a publication (server/send_ring.py), if it has them.
        self._writes = server.publication_writes
        # Not None while the replay task owns delivery: live events wait here.
        self._backlog: deque[CommittedEvent] | None = None
        self._catch_up_due = False
        # The scope's in-step group this connection is in (at most one): its cursor there
        # is the group's, not scope_cursors'.
        self._group: ScopeGroup | None = None

    def stop(self) -> None:
        self.leave_group()
        self.server.hub.unsubscribe(self.subscription)
        self._backlog = None

    def join_group(self, group: ScopeGroup) -> bool:
        ws = self._ws
        if (self._group is not None or self._backlog is not None or self.global_cursor is not None
                or self.scope_cursors.get(group.scope_id) != group.seq or not ws.sends_now):
            return False
        self._group = group
        ws.direct_write_hook = self.leave_group
        return True

    def leave_group(self) -> None:
        """Back to being served one by one, the cursor where the group stands."""
        group = self._group
        if group is None:
            return
        self._group = None
        self._ws.direct_write_hook = None
        if group.scope_id in self.scope_cursors:
            self.scope_cursors[group.scope_id] = group.seq
        group.leave(self.subscription)

    # --- the hub's sink: synchronous, never blocks --------------------------------------------

    def admit(self, event: CommittedEvent) -> bytes | None:
        """The frame to write for this event now, or None (already sent, or
        held behind a replay)."""
        moves_cursor = event.event == MESSAGE_CREATED and event.seq is not None
        if moves_cursor and self._group is not None and event.scope_id == self._group.scope_id:
            self.leave_group()
        if self._backlog is not None:
            if len(self._backlog) >= self.server.config.push_buffer_events:
                self.cut_off("slow_consumer: event backlog overflow")
            else:
                self._backlog.append(event)
            return None
        if moves_cursor:
            verdict = self._advance(event)
            if verdict is None:
                return None  # already sent
            if not verdict:
                self.server.metrics.push_gap_replays += 1
                self._replay(event)  # a gap: fill it from the log first
                return None
        return event.frames.get(self._binary) or shared_frame(event, self._binary)

    def admit_run(self, run: EventRun, write: bool = False) -> bytes | None:
        """The run in one piece when it is exactly what this connection sends next:
        its scope cursor stands just before the run and nothing else moves with it
        (no replay, no feed cursor).  Otherwise None: event by event (admit)."""
        if self._group is not None and run.scope_id == self._group.scope_id:
            self.leave_group()
        if (self._backlog is not None or self.global_cursor is not None
                or self.scope_cursors.get(run.scope_id) != run.first_seq - 1):
            return None
        self.scope_cursors[run.scope_id] = run.last_seq
        frames = run.frames.get(self._binary)
        if frames is None:
            frames = run.frames[self._binary] = b"".join([shared_frame(e, self._binary) for e in run.events])
        if write:
            if self._writes is not None and self._ws.sends_now:
                self._writes.add(self._ws.fileno(), self, frames)  # sent when the publication is over
            else:
                self.send_now(frames)
        return frames

    def send_now(self, frames: bytes) -> None:
        if self._ws.write_now(frames) > self._buffer_limit:
            self.cut_off("slow_consumer: send buffer overflow")

    def sent(self, frames: bytes, result: int) -> None:
        """What a gathered send did (bytes taken, or -errno): the rest is queued."""
        if self._ws.sent(frames, result) > self._buffer_limit:
            self.cut_off("slow_consumer: send buffer overflow")

    def _advance(self, event: CommittedEvent) -> bool | None:
        """Move the cursor over a live message: True (next in order), False (a
        gap before it), None (at or below the cursor: a duplicate)."""
        cursor = self.scope_cursors.get(event.scope_id)
        if cursor is not None:
            if event.seq <= cursor:
                return None
            if event.seq != cursor + 1:
                return False
            self.scope_cursors[event.scope_id] = event.seq
            self._pass_global(event.global_seq)
            return True
        if self.global_cursor is None:
            return None
        if event.global_seq <= self.global_cursor:
            return None
        if event.global_seq != self.global_cursor + 1:
            return False
        self._move_global(event.global_seq)
        return True

    def _move_global(self, global_seq: int) -> None:
        """The feed cursor moves to `global_seq`, and on over the steps skipped ahead of it."""
        ahead = self._skipped_ahead
        if ahead:
            while global_seq + 1 in ahead:
                global_seq += 1
            ahead = {step for step in ahead if step > global_seq}
            self._skipped_ahead = ahead or None
        self.global_cursor = global_seq

    def _pass_global(self, global_seq: int | None) -> None:
        """A live step of the feed that is not written through the feed cursor: the
        next step moves the cursor; a later one is remembered until the ones under it
        arrive, so it does not read as a gap (bounded: past that, a replay fills it)."""
        cursor = self.global_cursor
        if cursor is None or global_seq is None or global_seq <= cursor:
            return
        if global_seq == cursor + 1:
            self._move_global(global_seq)
        elif self._skipped_ahead is None:
            self._skipped_ahead = {global_seq}
        elif len(self._skipped_ahead) < SKIPPED_AHEAD_LIMIT:
            self._skipped_ahead.add(global_seq)

    def skip(self, event: CommittedEvent) -> None:
        # A message this member may not read (elsewhere in the workspace, or one a
        # private agent may not read in a followed scope) is the next step of the
        # cursor, not a gap: nothing to fill from the log.
        if event.event != MESSAGE_CREATED or event.seq is None:
            return
        if self._group is not None and event.scope_id == self._group.scope_id:
            self.leave_group()
        cursor = self.scope_cursors.get(event.scope_id)
        if cursor is None:
            # Also while a replay runs: its fill reads only what this member may read, so
            # a step it does not deliver is one the replay would otherwise never pass.
            self._pass_global(event.global_seq)
        elif self._backlog is None and event.seq == cursor + 1:
            self.scope_cursors[event.scope_id] = event.seq
            self._pass_global(event.global_seq)

    def write(self, frames: list[bytes]) -> None:
        ws = self._ws
        ws.write(frames)
        if ws.backlog > self._buffer_limit:
            self.cut_off("slow_consumer: send buffer overflow")

    def cut_off(self, reason: str) -> None:
        """Stop delivering and close with 4408 after what is already queued; a
        client that does not finish the closing handshake in time is dropped.
        Either way it resumes from its cursors."""
        log.info("cutting off slow consumer", extra={"connection": self.connection.id, "why": reason})
        if not self.connection.ws.closing:  # counted once per connection
            self.server.metrics.slow_consumer_closes += 1
        self.stop()
        self.connection.ws.close_soon(f.CLOSE_SLOW_CONSUMER, reason)

    # --- the slow path: replay from the durable log --------------------------------------------

    def catch_up(self) -> None:
        """Replay what the cursors missed, in order, before anything live."""
        self._catch_up_due = True
        self._replay(None)

    def events_missed(self) -> None:
        """Events from another node may have been lost: replay the messages the cursors
        missed, then tell the client that the rest (not in the log) may be gone too."""
        self.catch_up()
        backlog, followed = self._backlog, self.subscription
        assert backlog is not None
        if not followed.active or not (followed.scopes or followed.workspace_id is not None):
            return  # it follows nothing (it unsubscribed): nothing of the kind was missed
        if not (backlog and backlog[-1].event == EVENTS_MISSED):  # one notice for resyncs in a row
            backlog.append(CommittedEvent(EVENTS_MISSED, self.workspace_id, "", None, None,
                                          events.EventsMissed(reason="cluster_bus")))

    def _replay(self, first: CommittedEvent | None) -> None:
        self.leave_group()
        if self._backlog is None:
            self._backlog = deque()
            self.server.spawn(self._run_replay)
        if first is not None:
            self._backlog.append(first)

    async def _run_replay(self) -> None:
        # Starts after the current publication has flushed, so order holds.
        try:
            while self._backlog is not None:
                if self._catch_up_due:
                    self._catch_up_due = False
                    await self._catch_up()
                elif self._backlog:
                    await self._replay_event(self._backlog.popleft())
                else:
                    self._backlog = None  # caught up: back to the fast path
        except ConnectionClosed:
            self.stop()
        except trio.TooSlowError:
            self.cut_off("slow_consumer: replay blocked")
        except DatabaseUnavailable:
            # Not the client's fault (so not 4408): it resumes from its cursors later.
            log.warning("replay failed: database unavailable", extra={"connection": self.connection.id})
            self.stop()
            self.connection.ws.close_soon(f.CLOSE_UNAVAILABLE, "unavailable")
        except Exception:
            log.exception("replay failed", extra={"connection": self.connection.id})
            self.stop()
            self.connection.ws.close_soon(f.CLOSE_UNAVAILABLE, "internal error")

    async def _write(self, frame: bytes) -> None:
        with trio.fail_after(self.server.config.push_timeout_seconds):
            await self.connection.ws.send(frame)
        hub = self.server.hub  # a replayed delivery counts like a live one
        hub.delivered += 1
        hub.delivered_bytes += len(frame)

    async def _replay_event(self, event: CommittedEvent) -> None:
        if event.event != MESSAGE_CREATED or event.seq is None:
            await self._write(shared_frame(event, self.connection.ws.binary))
            return
        message: CommittedMessage = event.data
        if message.scope_id in self.scope_cursors:
            if message.seq > self.scope_cursors[message.scope_id] + 1:
                await self._fill_scope(message.scope_id, message.seq - 1)
        elif self.global_cursor is not None:
            if message.workspace_global_seq > self.global_cursor + 1:
                await self._fill_workspace(message.workspace_global_seq - 1)
        if self._advance_past(event):
            await self._write(shared_frame(event, self.connection.ws.binary))

    def _advance_past(self, event: CommittedEvent) -> bool:
        """After a fill: is the event still new?  Moves its cursor to it."""
        if event.scope_id in self.scope_cursors:
            if event.seq <= self.scope_cursors[event.scope_id]:
                return False
            self.scope_cursors[event.scope_id] = event.seq
            return True
        if self.global_cursor is None or event.global_seq <= self.global_cursor:
            return False
        self._move_global(event.global_seq)
        return True

    async def _send_message(self, message, kind: str = MESSAGE_CREATED) -> None:
        get = (lambda k: getattr(message, k)) if isinstance(message, CommittedMessage) else message.__getitem__
        scope_id, seq, global_seq = get("scope_id"), get("seq"), get("workspace_global_seq")
        frame = f.Event(event=kind, workspace_id=self.workspace_id, scope_id=scope_id,
                        data=_message_data(message, kind), seq=seq, global_seq=global_seq)
        binary = self.connection.ws.binary
        await self._write(server_frame(encode(frame, binary=binary), binary=binary))
        if scope_id in self.scope_cursors:
            self.scope_cursors[scope_id] = seq
        elif self.global_cursor is not None:
            self._move_global(global_seq)

    async def _catch_up(self) -> None:
        for scope_id in list(self.scope_cursors):
            await self._fill_scope(scope_id, None)
        if self.global_cursor is not None:
            await self._fill_workspace(None)

    async def _fill_scope(self, scope_id: str, through: int | None) -> None:
        """Replay the durable log after the scope cursor (through `through`)."""
        db = self.server.db
        while scope_id in self.scope_cursors:
            cursor = self.scope_cursors[scope_id]
            rows, has_more = await db.run(messages.history, self.workspace_id, self.member_id, scope_id,
                                          before_seq=None, after_seq=cursor, limit=BACKFILL_PAGE)
            for row in rows:
                if through is not None and row["seq"] > through:
                    return
                await self._send_message(_with_workspace(row, self.workspace_id))
            if not has_more or not rows:
                return

    async def _fill_workspace(self, through: int | None) -> None:
        db = self.server.db
        while self.global_cursor is not None:
            cursor = self.global_cursor
            rows = await db.run(messages.workspace_feed, self.workspace_id, self.member_id, cursor,
                                BACKFILL_PAGE)
            for row in rows:
                if through is not None and row["workspace_global_seq"] > through:
                    return
                if row["scope_id"] in self.scope_cursors:
                    # A followed scope is delivered by its own cursor; just step over it.
                    self._move_global(row["workspace_global_seq"])
                else:
                    await self._send_message(_with_workspace(row, self.workspace_id))
            if len(rows) < BACKFILL_PAGE:
                return


class ScopeGroup:
    """The hub's in-step group of one scope (actors/fanout.py InStepGroup) for this
    node's connections: the scope's next run goes to every member with one shared frame
    per wire format and their descriptors handed to the publication's gathered writes
    as they stand — no per-connection admission (it cost ~1.5 µs per subscriber, bench/
    fanout.py 1000 × 50).  A member leaves (leave_group) before anything else moves its
    cursor and, through its socket's direct_write_hook, before a byte is queued for it
    or its socket closes."""

    __slots__ = ("server", "scope_id", "seq", "entitled", "members", "_lanes")

    def __init__(self, server: Server, scope_id: str, seq: int, entitled: frozenset[str] | None) -> None:
        self.server = server
        self.scope_id = scope_id
        self.seq = seq
        self.entitled = entitled
        self.members: dict[Subscription, PushState] = {}
        # Per wire format, the members' descriptors and sinks; None: rebuilt at the next run.
        self._lanes: dict[bool, tuple[list[int], list[PushState]]] | None = None

    def offer(self, subscription: Subscription) -> None:
        sink = subscription.sink
        if sink.join_group(self):
            self.members[subscription] = sink
            self._lanes = None

    def leave(self, subscription: Subscription) -> None:
        if self.members.pop(subscription, None) is not None:
            self._lanes = None

    def dissolve(self) -> None:
        for sink in list(self.members.values()):
            sink.leave_group()

    def take(self, run: EventRun) -> tuple[int, int]:
        lanes = self._lanes
        if lanes is None:
            lanes = self._lanes = {}
            for sink in self.members.values():
                lane = lanes.get(sink._binary)
                if lane is None:
                    lane = lanes[sink._binary] = ([], [])
                lane[0].append(sink._ws.fileno())
                lane[1].append(sink)
        self.seq = run.last_seq  # each member's cursor, before a write can make it leave
        writes = self.server.publication_writes
        delivered = delivered_bytes = 0
        for binary, (fds, sinks) in lanes.items():
            frames = run.frames.get(binary)
            if frames is None:
                frames = run.frames[binary] = b"".join([shared_frame(e, binary) for e in run.events])
            delivered += len(sinks) * len(run.events)
            delivered_bytes += len(sinks) * len(frames)
            if writes is not None:
                writes.add_many(fds, sinks, frames)
            else:
                for sink in list(sinks):
                    sink.send_now(frames)
        return delivered, delivered_bytes


def event_frame(event: CommittedEvent) -> f.Event:
    # Every payload goes through the contract's table (protocol/events.py).
    data = (_message_data(event.data, event.event) if event.event in events.MESSAGE_EVENTS
            else events.payload(event.event, event.data))
    return f.Event(event=event.event, workspace_id=event.workspace_id, scope_id=event.scope_id, data=data,
                   seq=event.seq, global_seq=event.global_seq)


def _with_workspace(row, workspace_id: str) -> dict:
    record = dict(row)
    record["workspace_id"] = workspace_id
    return record


async def subscribe(server: Server, connection: Connection, request: f.Subscribe, ctx) -> f.SubscribeResult:
    workspace = ctx.require(Permission.MESSAGE_READ)
    state = connection.push
    if state is not None and state.workspace_id != workspace.workspace_id:
        raise ProtocolError(ErrorCode.CONFLICT, "this connection already follows another workspace")
    scopes = []
    for cursor in request.scopes:
        _, row = await _scope(server, ctx, cursor.scope_id, Permission.MESSAGE_READ)
        scopes.append((row, cursor.after_seq))
    total = len(scopes) + (len(state.scope_cursors) if state else 0)
    if total > server.config.max_subscriptions_per_connection:
        raise ProtocolError(ErrorCode.RATE_LIMITED, "too many subscriptions on this connection")
    if state is None:
        state = connection.push = PushState(server, connection, workspace.workspace_id, workspace.member_id)
    state.leave_group()
    for row, after_seq in scopes:
        scope_id = sys.intern(row["id"])  # shared by every subscriber of the scope
        state.scope_cursors[scope_id] = after_seq if after_seq is not None else row["latest_seq"]
        server.hub.follow_scope(state.subscription, scope_id)
    current_global = None
    if request.workspace_feed:
        current_global = await server.db.run(messages.workspace_global_tail, workspace.workspace_id)
        state.global_cursor = request.after_global_seq if request.after_global_seq is not None else current_global
        server.hub.follow_workspace(state.subscription, workspace.workspace_id)
    state.catch_up()
    return f.SubscribeResult(scopes=[scope_info(row, True) for row, _ in scopes],
                             workspace_feed=state.global_cursor is not None, workspace_global_seq=current_global)


async def unsubscribe(server: Server, connection: Connection, request: f.Unsubscribe, ctx) -> f.Ok:
    state = connection.push
    if state is not None:
        state.leave_group()
        for scope_id in request.scope_ids:
            state.scope_cursors.pop(scope_id, None)
            server.hub.unfollow_scope(state.subscription, scope_id)
        if request.workspace_feed:
            state.global_cursor = None
            server.hub.unfollow_workspace(state.subscription)
    return f.Ok()


# --- ephemeral signals (strand-message.md §9.6) ----------------------------------------------

TYPING_TTL_MS = 6_000
PRESENCE_TTL_MS = 90_000


async def typing(server: Server, connection: Connection, request: f.Typing, ctx) -> f.Ok:
    """Goes to the scope's current members only; nothing is written."""
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    if not server.typing_limiter.take((workspace.member_id, row["id"])):
        raise ProtocolError(ErrorCode.RATE_LIMITED, "typing signals are limited to about one a second")
    roster = await server.db.run(visibility.typing_audience, row["id"], workspace.member_id)
    server.hub.publish(CommittedEvent("typing", workspace.workspace_id, row["id"], None, None, {
        "member_id": workspace.member_id, "state": request.state,
        "expires_at_ms": int(time.time() * 1000) + TYPING_TTL_MS}), roster=roster)
    return f.Ok()


async def presence(server: Server, connection: Connection, request: f.Presence, ctx) -> f.Ok:
    """Goes to the workspace feed's subscribers; nothing is written."""
    workspace = ctx.require(Permission.MESSAGE_READ)
    if not server.presence_limiter.take(workspace.member_id):
        raise ProtocolError(ErrorCode.RATE_LIMITED, "presence updates are limited")
    server.hub.publish(CommittedEvent("presence", workspace.workspace_id, "", None, None, {
        "member_id": workspace.member_id, "state": request.state,
        "expires_at_ms": int(time.time() * 1000) + PRESENCE_TTL_MS}), roster=None)
    return f.Ok()
