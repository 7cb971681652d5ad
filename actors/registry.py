"""The actor registry: one ScopeActor per active scope, started on demand,
gone when idle, replaced after a crash."""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import trio

from actors.fanout import FanoutHub
from actors.scope_actor import ActorUnavailable, Command, ScopeActor
from storage.bridge import Database

log = logging.getLogger("scopewire.actors")

# Seconds the current task has spent waiting on scope actors (submit to reply);
# the server reads it to time a command's "actor" phase.
actor_seconds: contextvars.ContextVar[float] = contextvars.ContextVar("scopewire_actor_seconds", default=0.0)


class ScopeRegistry:
    def __init__(self, db: Database, hub: FanoutHub, nursery: trio.Nursery, *, idle_seconds: float = 30.0,
                 outbox_wake: Callable[[], None] | None = None, submit_timeout_seconds: float = 30.0,
                 mailbox_size: int = 1024, on_commit: Callable[[int, float], None] | None = None,
                 offer_deliveries: Callable[[list], None] | None = None) -> None:
        self.db = db
        self.offer_deliveries = offer_deliveries
        self.on_commit = on_commit
        # Actors start in this context, not in that of the connection whose command
        # started them: request-scoped log fields must not stick to an actor's lines.
        self._context = contextvars.copy_context()
        self.hub = hub
        self._nursery = nursery
        self._actors: dict[str, ScopeActor] = {}
        self.idle_seconds = idle_seconds
        self.outbox_wake = outbox_wake
        # Bounds a caller's whole wait: for mailbox room and for the reply.
        self.submit_timeout_seconds = submit_timeout_seconds
        self.mailbox_size = mailbox_size
        # Wall time as actors see it (audience-mention quotas): injectable, so tests drive the window.
        self.clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)

    def _actor_for(self, scope_id: str) -> ScopeActor:
        actor = self._actors.get(scope_id)
        if actor is None or actor.stopped:
            actor = ScopeActor(scope_id, self.db, self.hub, self.outbox_wake, self.idle_seconds, self.mailbox_size,
                               self.on_commit, self.offer_deliveries, clock=lambda: self.clock())
            self._actors[scope_id] = actor
            self._context.run(self._nursery.start_soon, self._supervise, actor)
        return actor

    async def _supervise(self, actor: ScopeActor) -> None:
        try:
            await actor.run()
        except Exception:
            log.exception("scope actor crashed", extra={"scope_id": actor.scope_id})
        finally:
            if self._actors.get(actor.scope_id) is actor:
                del self._actors[actor.scope_id]

    async def submit(self, scope_id: str, command: Command) -> Any:
        """Hand `command` to the scope's actor and wait for its reply.  The
        mailbox is bounded: a full mailbox makes callers wait (backpressure),
        but never longer than `submit_timeout_seconds` in all (then
        ActorUnavailable; a command already taken may still commit, which an
        idempotent retry resolves)."""
        started = time.perf_counter()
        try:
            return await self._submit(scope_id, command)
        finally:
            actor_seconds.set(actor_seconds.get() + time.perf_counter() - started)

    async def _submit(self, scope_id: str, command: Command) -> Any:
        with trio.move_on_after(self.submit_timeout_seconds):
            for _ in range(3):
                actor = self._actor_for(scope_id)
                try:
                    await actor.mailbox.send(command)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    continue  # it went idle just now: start a fresh one
                return await command.reply.wait()
            raise ActorUnavailable("could not reach the scope actor; retry")
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
