"""Pipelined `message.send`: a client that writes its next sends before the
replies come has each one read as soon as the previous is in its scope actor's
mailbox, so a connection's sends share the actor's batch commits instead of
taking one batch each (a connection answered one command at a time commits at
most one send per batch).

What the client sees is what serving one command at a time gives: replies in
request order, the sends committed in request order (consecutive sends into
one scope of one workspace; anything else waits until every earlier reply is
written), each send re-checked inside its own write.  A send whose cached
context proves stale is served afresh only after the sends before it are
answered, and one whose actor lost its scope's lease is submitted again only
after them (actors/registry.SubmitOrder), so a retry cannot overtake them.  A
pipeline starts at a send read together with more of the client's input (a
client waiting for each reply is served inline, without a task per send) and
lasts while sends keep arriving before all earlier ones are answered."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import trio

from actors.registry import submit_order
from protocol import frames
from protocol.codec import decode_request
from protocol.errors import ProtocolError
from server.transport import ConnectionClosed

if TYPE_CHECKING:
    from actors.scope_actor import ScopeActor
    from server.app import Connection, Server

# Sends of one connection in flight at once (the command rate limit bounds them too).
MAX_IN_FLIGHT = 64


async def previous_answered() -> None:
    """Before a pipelined send is submitted later than its place in the
    connection's order (served afresh after a stale cached context): wait until
    the sends before it are answered."""
    order = submit_order.get()
    if order is not None:
        await order.previous_answered()


def decoded(raw: str | bytes, binary: bool) -> frames.Request | None:
    """The request, or None when it does not decode (answered with the error later)."""
    try:
        return decode_request(raw, binary=binary)
    except ProtocolError:
        return None


def pipelines(connection: Connection, request: frames.Request | None) -> bool:
    """A send the client wrote more behind (read with it): serve it and what follows as a pipeline."""
    return type(request) is frames.MessageSend and connection.ws.has_buffered_input()


class _Step:
    """One pipelined send's place in its connection's order (actors.registry.SubmitOrder)."""

    __slots__ = ("previous", "actor", "may_read_next", "answered")

    def __init__(self, previous: _Step | None) -> None:
        self.previous = previous
        self.actor: ScopeActor | None = None  # the mailbox it was last queued in
        self.may_read_next = trio.Event()  # queued, or answered
        self.answered = trio.Event()  # its reply written (or the connection gone)

    def follows(self, actor: ScopeActor) -> bool:
        return self.previous is None or self.previous.actor is actor

    def enqueued(self, actor: ScopeActor) -> None:
        self.actor = actor
        self.may_read_next.set()

    async def previous_answered(self) -> None:
        if self.previous is not None:
            await self.previous.answered.wait()

    def done(self) -> None:
        self.answered.set()
        self.may_read_next.set()
        self.previous = None  # answered in order: the chain behind it is not needed


async def serve_sends(server: Server, connection: Connection, request: frames.MessageSend,
                      raw: str | bytes) -> str | bytes | None:
    """Serve `request` and the consecutive sends into the same scope that
    follow it; return once all are answered: with the next frame read and not
    served (another op, another scope, rate limited, or a revocation to check
    first), or None when input stopped meanwhile."""
    ws = connection.ws
    target = (request.workspace_id, request.scope_id)
    in_flight: deque[trio.Event] = deque()
    previous: _Step | None = None
    try:
        async with trio.open_nursery() as nursery:
            while True:
                step = _Step(previous)
                connection.answering += 1
                nursery.start_soon(_answer_in_order, server, connection, raw, request, step)
                in_flight.append(step.answered)
                previous = step
                raw = request = None  # type: ignore[assignment]
                await step.may_read_next.wait()
                connection.give_turn_back()
                while in_flight and in_flight[0].is_set():
                    in_flight.popleft()
                if len(in_flight) >= MAX_IN_FLIGHT:
                    await in_flight.popleft().wait()
                if connection.closing or connection.recheck_after_reply or ws.closing or not connection.answering:
                    return None
                # Returns None once every reply is written (_answer_in_order stops the wait).
                raw = await ws.receive(connection.last_inbound + server.config.idle_timeout_seconds)
                if raw is None:
                    return None
                connection.last_inbound = trio.current_time()
                request = decoded(raw, connection.binary)  # type: ignore[assignment]
                if (type(request) is not frames.MessageSend or (request.workspace_id, request.scope_id) != target
                        or connection.recheck_after_reply or not connection.command_bucket.take()):
                    return raw
    except BaseExceptionGroup as group:  # what the loop raised (ConnectionClosed, Cancelled), as itself
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _answer_in_order(server: Server, connection: Connection, raw: str | bytes,
                           request: frames.MessageSend, step: _Step) -> None:
    submit_order.set(step)
    try:
        await server.answer_and_reply(connection, raw, request,
                                      reply_after=None if step.previous is None else step.previous.answered)
    except ConnectionClosed:
        pass  # the reading loop sees the close
    finally:
        step.done()
        connection.answering -= 1
        if not connection.answering:
            connection.ws.stop_waiting()
