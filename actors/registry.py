"""The actor registry: one ScopeActor per active scope, started on demand,
gone when idle, replaced after a crash."""

from __future__ import annotations

import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Protocol

import asyncpg
import trio

from actors.fanout import FanoutHub
from actors.scope_actor import ActorUnavailable, Command, CreateScope, Reply, ScopeActor
from actors.write_turns import WriteTurns
from storage import messages
from storage.bridge import Database
from storage.errors import DatabaseUnavailable, LeaseLost, StorageError

log = logging.getLogger("scopewire.actors")

# How long a peer is taken to own a scope before the lease row is read again: a forward
# to a node that no longer owns it is answered LeaseLost and looked up at once anyway.
OWNER_CACHE_SECONDS = 5.0
# Waits between attempts to reach a scope's owner (or to take its lease once it expired).
FORWARD_RETRY_FIRST_SECONDS = 0.05
FORWARD_RETRY_MAX_SECONDS = 1.0
# How often the expiry task looks at the oldest awaited reply (it ends once none is awaited).
EXPIRY_CHECK_SECONDS = 1.0


class Owner(Protocol):
    """A scope's owner as the lease row names it (storage.leases.Ownership)."""

    node_id: str
    epoch: int
    forward_address: str


class Ownership(Protocol):
    """This node's side of the scope leases (server/cluster.py)."""

    node_id: str

    async def acquire(self, scope_id: str, *, creating: bool = False, kind: Any = None) -> Owner:
        """Take the scope's lease or name its owner; NotFound for a scope that does not
        exist unless `creating` it.  `kind`: another kind of owned row (storage.leases),
        e.g. a platform account."""

    async def acquire_free(self, scope_ids: list[str]) -> dict[str, int]:
        """Take the free leases among these scopes in one transaction: scope → epoch."""

    async def release(self, scope_id: str, epoch: int) -> None: ...

    async def forward(self, owner: Owner, scope_id: str, command: Command) -> Any:
        """Run `command` at `owner`; LeaseLost when it does not own the scope or cannot be
        reached before the command was handed over (so it is safe to send again)."""

# Seconds the current task has spent waiting on scope actors (submit to reply);
# the server reads it to time a command's "actor" phase.
actor_seconds: contextvars.ContextVar[float] = contextvars.ContextVar("scopewire_actor_seconds", default=0.0)


class SubmitOrder(Protocol):
    """The place of the current task's command among its connection's pipelined
    commands (server/pipeline.py): submitted after the one before it."""

    def follows(self, actor: ScopeActor) -> bool:
        """Whether the command before it was queued in `actor`: queued behind it there
        (first in, first out), it cannot be taken first."""

    def enqueued(self, actor: ScopeActor) -> None:
        """It is in `actor`'s mailbox: the connection may read its next command."""

    async def previous_answered(self) -> None:
        """Wait until the command before it is answered."""


# Set in the task of a pipelined command (None otherwise).
submit_order: contextvars.ContextVar[SubmitOrder | None] = contextvars.ContextVar("scopewire_submit_order",
                                                                                  default=None)


class ScopeRegistry:
    def __init__(self, db: Database, hub: FanoutHub, nursery: trio.Nursery, *, idle_seconds: float = 30.0,
                 outbox_wake: Callable[[], None] | None = None, submit_timeout_seconds: float = 30.0,
                 mailbox_size: int = 1024, on_commit: Callable[[int, float], None] | None = None,
                 offer_deliveries: Callable[[list], None] | None = None,
                 ownership: Ownership | None = None,
                 settle_later: Callable[[str, list[str]], None] | None = None) -> None:
        self.db = db
        self.settle_later = settle_later
        # Scope leases across nodes (server/cluster.py); None: this process owns every scope.
        self.ownership = ownership
        # Scopes another node owns, until when that is trusted without asking the database again.
        self._owners: dict[str, tuple[Owner, float]] = {}
        self._acquiring: dict[str, trio.Event] = {}
        self.offer_deliveries = offer_deliveries
        self.on_commit = on_commit
        # Actors start in this context, not in that of the connection whose command
        # started them: request-scoped log fields must not stick to an actor's lines.
        self._context = contextvars.copy_context()
        self.hub = hub
        self._nursery = nursery
        self._actors: dict[str, ScopeActor] = {}
        self.write_turns = WriteTurns()
        # Set by drain(): no command starts here any more.
        self.draining = False
        self._supervising = 0
        self._all_stopped = trio.Event()
        self.idle_seconds = idle_seconds
        self.outbox_wake = outbox_wake
        # Bounds a caller's whole wait: for mailbox room and for the reply.
        self.submit_timeout_seconds = submit_timeout_seconds
        # Replies awaited on the fast path, with when each submit's bound runs out.
        self._waits: deque[tuple[float, Reply]] = deque()
        self._expiring = False
        self.mailbox_size = mailbox_size
        # Wall time as actors see it (audience-mention quotas): injectable, so tests drive the window.
        self.clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)

    def _start_actor(self, scope_id: str, lease: tuple[str, int] | None,
                     view: messages.ActorView | None = None) -> ScopeActor:
        actor = ScopeActor(scope_id, self.db, self.hub, self.outbox_wake, self.idle_seconds, self.mailbox_size,
                           self.on_commit, self.offer_deliveries, clock=lambda: self.clock(), lease=lease,
                           settle_later=self.settle_later, view=view, write_turns=self.write_turns)
        self._actors[scope_id] = actor
        self._supervising += 1
        if self.draining:
            actor.mailbox.close()  # started by an acquisition that was under way: it only gives the scope back
        self._context.run(self._nursery.start_soon, self._supervise, actor)
        return actor

    async def _route(self, scope_id: str, *, forwarded: bool, creating: bool = False) -> ScopeActor | Owner:
        """This node's actor for the scope (started, taking the lease, when the scope is
        free), or the node that owns it.  A forwarded command never goes further: a node
        that does not own the scope answers LeaseLost and the sender looks again."""
        while True:
            if self.draining:
                if forwarded:  # the sender looks for the next owner, which takes the scope once we let it go
                    raise LeaseLost(f"node {self.ownership.node_id if self.ownership else ''} is shutting down")
                raise ActorUnavailable("this node is shutting down; retry")
            actor = self._actors.get(scope_id)
            if actor is not None and not actor.stopped:
                return actor
            if self.ownership is None:
                return self._start_actor(scope_id, None)
            known = self._owners.get(scope_id)
            if known is not None and known[1] > trio.current_time() and not forwarded:
                return known[0]
            pending = self._acquiring.get(scope_id)
            if pending is not None:  # one acquisition per scope at a time
                await pending.wait()
                continue
            self._acquiring[scope_id] = done = trio.Event()
            try:
                owner = await self.ownership.acquire(scope_id, creating=creating)
            finally:
                del self._acquiring[scope_id]
                done.set()
            if owner.node_id == self.ownership.node_id:
                return self._start_actor(scope_id, (owner.node_id, owner.epoch))
            if forwarded:
                raise LeaseLost(f"node {self.ownership.node_id} does not own scope {scope_id}")
            self._owners[scope_id] = (owner, trio.current_time() + OWNER_CACHE_SECONDS)
            return owner

    async def start_many(self, scope_ids: list[str]) -> None:
        """Start actors here for those of these scopes that have none, taking their free
        leases in one transaction and reading their state in two statements: a caller
        about to send one command to each of many quiet scopes (a platform broadcast)
        pays that once, not per scope.  A scope another node holds, or one whose lease
        cannot be had now, is left to its command's own acquisition (and a thread, a
        task or a scope with private members reads its own state)."""
        if self.ownership is None or self.draining:
            return
        now = trio.current_time()
        wanted = sorted({s for s in scope_ids
                         if (s not in self._actors or self._actors[s].stopped) and s not in self._acquiring
                         and not (s in self._owners and self._owners[s][1] > now)})
        if not wanted:
            return
        done = trio.Event()
        for scope_id in wanted:
            self._acquiring[scope_id] = done
        epochs: dict[str, int] = {}
        views: dict[str, messages.ActorView] = {}
        try:
            epochs = await self.ownership.acquire_free(wanted)
            # Read after the leases are ours, as an actor's own first reload is.
            views = await self.db.run(messages.load_plain_actor_views, sorted(epochs)) if epochs else {}
        except (StorageError, asyncpg.PostgresError) as exc:  # what was taken starts anyway, reading its own state
            log.info("scope actors not started together", extra={"error": str(exc)})
        finally:
            for scope_id in wanted:
                del self._acquiring[scope_id]
            done.set()
        for scope_id, epoch in epochs.items():
            if scope_id not in self._actors or self._actors[scope_id].stopped:
                self._start_actor(scope_id, (self.ownership.node_id, epoch), views.get(scope_id))

    async def _supervise(self, actor: ScopeActor) -> None:
        try:
            await actor.run()
        except LeaseLost:
            log.info("scope taken over by another node", extra={"scope_id": actor.scope_id})
        except Exception:
            log.exception("scope actor crashed", extra={"scope_id": actor.scope_id})
        finally:
            if self._actors.get(actor.scope_id) is actor:
                del self._actors[actor.scope_id]
        try:
            if actor.lease is not None and actor.lease_lost is None and self.ownership is not None:
                # Idle: give the scope back at once, so another node need not wait for our lease to run out.
                try:
                    await self.ownership.release(actor.scope_id, actor.lease[1])
                except DatabaseUnavailable:
                    pass  # it stays ours until this node's lease runs out
        finally:
            self._supervising -= 1
            if not self._supervising:
                self._all_stopped.set()

    async def drain(self) -> None:
        """A clean shutdown's first step: no command starts here any more (a forwarded one
        goes back to its sender, which finds the next owner; a local one answers
        unavailable), the commands already queued finish, and every actor stops and
        gives its scope back.  The caller bounds the wait."""
        self.draining = True
        for actor in list(self._actors.values()):
            actor.mailbox.close()
        if self._supervising:
            self._all_stopped = trio.Event()
            await self._all_stopped.wait()

    async def submit(self, scope_id: str, command: Command, *, forwarded: bool = False) -> Any:
        """Hand `command` to the scope's actor and wait for its reply.  The
        mailbox is bounded: a full mailbox makes callers wait (backpressure),
        but never longer than `submit_timeout_seconds` in all (then
        ActorUnavailable; a command already taken may still commit, which an
        idempotent retry resolves)."""
        started = time.perf_counter()
        try:
            return await self._submit(scope_id, command, forwarded)
        finally:
            actor_seconds.set(actor_seconds.get() + time.perf_counter() - started)

    async def _submit(self, scope_id: str, command: Command, forwarded: bool) -> Any:
        # The common case: this node's actor runs the scope and its mailbox has room.
        deadline = trio.current_time() + self.submit_timeout_seconds
        actor = self._actors.get(scope_id)
        order = submit_order.get()
        if (actor is not None and not actor.stopped and not self.draining
                and (order is None or order.follows(actor))):
            try:
                actor.mailbox.send_nowait(command)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass
            else:
                if order is not None:
                    order.enqueued(actor)
                self._bound_wait(command.reply, deadline)
                answered, value = await self._reply_or_retry(command, order, forwarded)
                if answered:
                    return value
        return await self._submit_waiting(scope_id, command, forwarded, deadline)

    @staticmethod
    async def _reply_or_retry(command: Command, order: SubmitOrder | None, forwarded: bool) -> tuple[bool, Any]:
        """(True, the reply), or (False, None) when the actor lost the scope's lease
        before running the command, which is then submitted again."""
        try:
            return True, await command.reply.wait()
        except LeaseLost:
            if forwarded:
                raise
            command.reply = Reply()  # nothing committed: run it at the new owner
            if order is not None:  # nor of what was queued behind it: it goes first again
                await order.previous_answered()
            return False, None

    def _bound_wait(self, reply: Reply, deadline: float) -> None:
        """Fail `reply` if it is not answered within submit_timeout_seconds.  One task
        expires them all: a cancel scope per command cost ~10 % of the event loop's
        time under load (py-spy, bench/ws_send.py)."""
        waits = self._waits
        while waits and waits[0][1].answered:
            waits.popleft()
        waits.append((deadline, reply))
        if not self._expiring:
            self._expiring = True
            self._context.run(self._nursery.start_soon, self._expire_waits)

    async def _expire_waits(self) -> None:
        """Fails the replies awaited past their bound (oldest first: every bound is the
        same length); ends once none is awaited, so it holds no nursery open."""
        waits = self._waits
        try:
            while waits:
                deadline, reply = waits[0]
                if reply.answered:
                    waits.popleft()
                elif deadline <= trio.current_time():
                    waits.popleft()
                    reply.fail(ActorUnavailable("the scope actor did not answer in time; retry"))
                else:
                    await trio.sleep_until(min(deadline, trio.current_time() + EXPIRY_CHECK_SECONDS))
        finally:
            self._expiring = False

    async def _submit_waiting(self, scope_id: str, command: Command, forwarded: bool, deadline: float) -> Any:
        """Submit through whatever has to be waited for: mailbox room, the scope's
        lease, its owner elsewhere, a fresh actor."""
        with trio.CancelScope(deadline=deadline):
            backoff = FORWARD_RETRY_FIRST_SECONDS
            while True:
                try:
                    target = await self._route(scope_id, forwarded=forwarded,
                                               creating=isinstance(command, CreateScope))
                except LeaseLost:
                    if forwarded:
                        raise
                    await trio.sleep(backoff)  # the lease changed hands meanwhile: look again
                    backoff = min(backoff * 2, FORWARD_RETRY_MAX_SECONDS)
                    continue
                order = submit_order.get()
                if isinstance(target, ScopeActor):
                    if order is not None and not order.follows(target):
                        await order.previous_answered()
                    try:
                        await target.mailbox.send(command)
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        continue  # it went idle just now: start a fresh one
                    if order is not None:
                        order.enqueued(target)
                    answered, value = await self._reply_or_retry(command, order, forwarded)
                    if answered:
                        return value
                    continue
                assert self.ownership is not None
                if order is not None:
                    await order.previous_answered()
                try:
                    return await self.ownership.forward(target, scope_id, command)
                except ActorUnavailable:
                    self._owners.pop(scope_id, None)  # whoever comes next asks the lease row again
                    raise
                except LeaseLost:
                    # It is not (or no longer) the owner, or it cannot be reached: look again,
                    # which takes the lease once the owner's has run out.
                    self._owners.pop(scope_id, None)
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, FORWARD_RETRY_MAX_SECONDS)
        raise ActorUnavailable("the scope actor did not answer in time; retry")

    def is_live(self, scope_id: str) -> bool:
        actor = self._actors.get(scope_id)
        return actor is not None and not actor.stopped

    @property
    def active(self) -> int:
        return len(self._actors)

    def mailbox_depths(self) -> list[int]:
        """Each live actor's waiting commands (read at scrape time)."""
        return [actor.mailbox_depth for actor in self._actors.values()]
