"""Per-connection realtime delivery: subscriptions, resume and pushes.

Each subscribed connection has one hub Subscription (bounded) and one pusher
task.  The pusher keeps cursors — the last seq sent per followed scope and
the last workspace_global_seq sent on the workspace feed — and the durable
log is the buffer: a resume cursor, or a gap between the cursor and a live
event, is filled from the database before the live event is sent; anything
at or below the cursor is dropped.  So every committed message reaches the
connection once, in order, however long it was away.

A connection that cannot keep up (its hub buffer overflows, or one push
blocks past `push_timeout_seconds`) is closed with 4408 slow_consumer; it
resumes from its cursors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
import trio_websocket

from actors.fanout import CommittedEvent, Subscription
from actors.plan import CommittedMessage
from protocol import frames as f
from protocol.codec import encode
from protocol.errors import ErrorCode, ProtocolError
from server.messaging import _scope, message_info, scope_info
from server.rbac import Permission
from server.wire import server_frame
from storage import messages

if TYPE_CHECKING:
    from server.app import Connection, Server

log = logging.getLogger("scopewire.realtime")

BACKFILL_PAGE = 200
CATCH_UP = "_catch_up"  # internal marker: replay from the cursors now


@dataclass
class PushState:
    workspace_id: str
    member_id: str
    subscription: Subscription
    scope_cursors: dict[str, int] = field(default_factory=dict)
    global_cursor: int | None = None
    pusher_started: bool = False


def _message_data(message: CommittedMessage | object, event: str):
    info = message_info(message)
    if event == "message.withdrawn" or info.state == "withdrawn":
        info.content, info.metadata = "", {}
    return info


class Pusher:
    def __init__(self, server: Server, connection: Connection, state: PushState) -> None:
        self.server = server
        self.connection = connection
        self.state = state

    async def run(self) -> None:
        try:
            async for event in self.state.subscription.receive:
                await self._handle(event)
            if self.state.subscription.overflowed:
                await self._cut_off("slow_consumer: event buffer overflow")
        except trio.TooSlowError:
            # A push was cancelled mid-frame: the stream cannot carry a close frame
            # any more, so the connection is aborted (the client sees 1006).
            self.server.hub.unsubscribe(self.state.subscription)
            await self.connection.abort()
        except trio_websocket.ConnectionClosed:
            pass
        except Exception:  # e.g. the database went away mid-replay: the client resumes later
            log.exception("pusher failed", extra={"connection": self.connection.id})
            await self._cut_off("unavailable: delivery failed, resume from your cursors")

    async def _cut_off(self, reason: str) -> None:
        log.info("cutting off slow consumer", extra={"connection": self.connection.id})
        self.server.hub.unsubscribe(self.state.subscription)
        with trio.move_on_after(self.server.config.shutdown_grace_seconds):
            try:
                await self.connection.close(f.CLOSE_SLOW_CONSUMER, reason[:120])
            except trio_websocket.ConnectionClosed:
                pass

    async def _push(self, frame: f.Event) -> None:
        with trio.fail_after(self.server.config.push_timeout_seconds):
            await self.connection.send(frame)

    async def _push_shared(self, event: CommittedEvent) -> None:
        """The live fast path: the event's frame is encoded and framed once for
        all recipients using this wire format."""
        binary = self.connection.binary
        frame = event.frames.get(binary)
        if frame is None:
            frame = event.frames[binary] = server_frame(encode(_event_frame(event), binary=binary), binary=binary)
        # No per-push cancel scope on this hot path: a pusher stuck on a dead
        # socket is caught by the overflow of its bounded buffer instead.
        await self.connection.send_frame(frame)

    async def _handle(self, event: CommittedEvent) -> None:
        if event.event == CATCH_UP:
            await self._catch_up()
            return
        if event.seq is None or event.event != "message.created":
            await self._push_shared(event)
            return
        await self._deliver_message(event)

    async def _deliver_message(self, event: CommittedEvent) -> None:
        """Send one live message event through the cursors: fill a gap from the
        database first, drop what was already sent.  Followed scopes go by their
        seq cursor; everything else on the workspace feed by the global cursor."""
        state = self.state
        message: CommittedMessage = event.data
        if message.scope_id in state.scope_cursors:
            if message.seq > state.scope_cursors[message.scope_id] + 1:
                await self._fill_scope(message.scope_id, message.seq - 1)
            if message.seq > state.scope_cursors[message.scope_id]:
                await self._push_shared(event)
                state.scope_cursors[message.scope_id] = message.seq
        elif state.global_cursor is not None:
            if message.workspace_global_seq > state.global_cursor + 1:
                await self._fill_workspace(message.workspace_global_seq - 1)
            if message.workspace_global_seq > state.global_cursor:
                await self._push_shared(event)
                state.global_cursor = message.workspace_global_seq

    async def _send_message(self, message, kind: str = "message.created") -> None:
        get = (lambda k: getattr(message, k)) if isinstance(message, CommittedMessage) else message.__getitem__
        scope_id, seq, global_seq = get("scope_id"), get("seq"), get("workspace_global_seq")
        await self._push(f.Event(event=kind, workspace_id=self.state.workspace_id, scope_id=scope_id,
                                 data=_message_data(message, kind), seq=seq, global_seq=global_seq))
        if scope_id in self.state.scope_cursors:
            self.state.scope_cursors[scope_id] = seq
        elif self.state.global_cursor is not None:
            self.state.global_cursor = global_seq

    async def _catch_up(self) -> None:
        for scope_id in list(self.state.scope_cursors):
            await self._fill_scope(scope_id, None)
        if self.state.global_cursor is not None:
            await self._fill_workspace(None)

    async def _fill_scope(self, scope_id: str, through: int | None) -> None:
        """Replay the durable log after the scope cursor (through `through`)."""
        db = self.server.db
        while True:
            cursor = self.state.scope_cursors[scope_id]
            rows, has_more = await db.run(messages.history, self.state.workspace_id, self.state.member_id, scope_id,
                                          before_seq=None, after_seq=cursor, limit=BACKFILL_PAGE)
            for row in rows:
                if through is not None and row["seq"] > through:
                    return
                await self._send_message(_with_workspace(row, self.state.workspace_id))
            if not has_more or not rows:
                return

    async def _fill_workspace(self, through: int | None) -> None:
        db = self.server.db
        while True:
            cursor = self.state.global_cursor
            rows = await db.run(messages.workspace_feed, self.state.workspace_id, self.state.member_id, cursor,
                                BACKFILL_PAGE)
            for row in rows:
                if through is not None and row["workspace_global_seq"] > through:
                    return
                if row["scope_id"] in self.state.scope_cursors:
                    # A followed scope is delivered by its own cursor; just step over it.
                    self.state.global_cursor = row["workspace_global_seq"]
                else:
                    await self._send_message(_with_workspace(row, self.state.workspace_id))
            if len(rows) < BACKFILL_PAGE:
                return


async def _abort_slow(connection: Connection) -> None:
    """The buffer overflowed: close with 4408 if the stream can still carry a
    close frame soon, else drop it (a pusher stuck mid-write holds the stream).
    Either way the client resumes from its cursors."""
    log.info("cutting off slow consumer", extra={"connection": connection.id})
    with trio.move_on_after(1.0):
        try:
            await connection.close(f.CLOSE_SLOW_CONSUMER, "slow_consumer: event buffer overflow")
            return
        except trio_websocket.ConnectionClosed:
            return
    await connection.abort()


def _event_frame(event: CommittedEvent) -> f.Event:
    data = _message_data(event.data, event.event) if event.event.startswith("message.") else event.data
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
        state = PushState(workspace.workspace_id, workspace.member_id,
                          server.hub.subscribe(workspace.member_id, buffer=server.config.push_buffer_events))
        state.subscription.on_overflow = lambda: connection.nursery.start_soon(_abort_slow, connection)
        connection.push = state
    for row, after_seq in scopes:
        state.scope_cursors[row["id"]] = after_seq if after_seq is not None else row["latest_seq"]
        server.hub.follow_scope(state.subscription, row["id"])
    current_global = None
    if request.workspace_feed:
        current_global = await server.db.run(messages.workspace_global_tail, workspace.workspace_id)
        state.global_cursor = request.after_global_seq if request.after_global_seq is not None else current_global
        server.hub.follow_workspace(state.subscription, workspace.workspace_id)
    if not state.pusher_started:
        state.pusher_started = True
        connection.nursery.start_soon(Pusher(server, connection, state).run)
    # Replay what the cursors missed, in order, before anything live.
    try:
        state.subscription.send.send_nowait(CommittedEvent(CATCH_UP, workspace.workspace_id, "", None, None, None))
    except trio.WouldBlock:
        pass  # the buffer is full: the pusher is already behind and will be cut off
    return f.SubscribeResult(scopes=[scope_info(row, True) for row, _ in scopes],
                             workspace_feed=state.global_cursor is not None, workspace_global_seq=current_global)


async def unsubscribe(server: Server, connection: Connection, request: f.Unsubscribe, ctx) -> f.Ok:
    state = connection.push
    if state is not None:
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
    roster = await server.db.run(messages.open_roster, row["id"])
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
