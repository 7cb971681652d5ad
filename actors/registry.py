"""The actor registry: one ScopeActor per active scope, started on demand,
gone when idle, replaced after a crash."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from actors.fanout import FanoutHub
from actors.scope_actor import ActorUnavailable, Command, ScopeActor
from storage.bridge import Database

log = logging.getLogger("scopewire.actors")


class ScopeRegistry:
    def __init__(self, db: Database, hub: FanoutHub, nursery: trio.Nursery, *, idle_seconds: float = 30.0,
                 outbox_wake: Callable[[], None] | None = None, submit_timeout_seconds: float = 30.0,
                 mailbox_size: int = 1024) -> None:
        self.db = db
        self.hub = hub
        self._nursery = nursery
        self._actors: dict[str, ScopeActor] = {}
        self.idle_seconds = idle_seconds
        self.outbox_wake = outbox_wake
        # Bounds a caller's whole wait: for mailbox room and for the reply.
        self.submit_timeout_seconds = submit_timeout_seconds
        self.mailbox_size = mailbox_size

    def _actor_for(self, scope_id: str) -> ScopeActor:
        actor = self._actors.get(scope_id)
        if actor is None or actor.stopped:
            actor = ScopeActor(scope_id, self.db, self.hub, self.outbox_wake, self.idle_seconds, self.mailbox_size)
            self._actors[scope_id] = actor
            self._nursery.start_soon(self._supervise, actor)
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

    @property
    def active(self) -> int:
        return len(self._actors)
