"""The fanout hub: where committed events go after commit.

Subscribers register per scope and/or per workspace with a Sink.  Publishers
(scope actors, the outbox worker, ephemeral signals) hand publications to the
hub's bounded queue and move on — an actor commits its next batch while the
previous one is fanned out — and the hub's one task delivers them in order.
Everything queued when it wakes leaves in one write per connection, and it
yields every `chunk` connections so a large fanout never stalls the other
tasks (command replies, database completions) for long.  A sink never blocks:
one that cannot keep up cuts its own connection off and the client resumes
from its cursor against the durable log.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio


@dataclass(frozen=True)
class CommittedEvent:
    """One event after commit: `event` is e.g. "message.created"."""

    event: str
    workspace_id: str
    scope_id: str
    seq: int | None
    global_seq: int | None
    data: Any
    # Members entitled to it when narrower than the scope (None: the scope's roster).
    audience: frozenset[str] | None = None
    # Wire frames of this event, built once per format by the first recipient.
    frames: dict[bool, bytes] = field(default_factory=dict, compare=False, repr=False)


class Sink(Protocol):
    """The receiving end of a subscription.  Every method is synchronous and
    must not block."""

    def deliver(self, event: CommittedEvent) -> None:
        """An event the member is entitled to: gather its frame (or hold it)."""

    def skip(self, event: CommittedEvent) -> None:
        """An event on a followed workspace that is not for this member (its
        workspace_global_seq is still a step of the feed's sequence)."""

    def flush(self) -> None:
        """Write what `deliver` gathered, in order."""


Publication = list[tuple[CommittedEvent, "frozenset[str] | set[str] | None"]]


@dataclass(eq=False)
class Subscription:
    member_id: str
    sink: Sink
    scopes: set[str] = field(default_factory=set)
    workspace_id: str | None = None
    active: bool = True


class FanoutHub:
    def __init__(self, *, queue: int = 1024, chunk: int = 64) -> None:
        self._by_scope: dict[str, set[Subscription]] = defaultdict(set)
        self._by_workspace: dict[str, set[Subscription]] = defaultdict(set)
        self._send, self._receive = trio.open_memory_channel[tuple[Publication, Callable[[], None] | None]](queue)
        self._chunk = chunk
        self.published = 0

    def subscribe(self, member_id: str, sink: Sink) -> Subscription:
        return Subscription(member_id=member_id, sink=sink)

    def follow_scope(self, subscription: Subscription, scope_id: str) -> None:
        if subscription.active:
            subscription.scopes.add(scope_id)
            self._by_scope[scope_id].add(subscription)

    def follow_workspace(self, subscription: Subscription, workspace_id: str) -> None:
        if subscription.active:
            subscription.workspace_id = workspace_id
            self._by_workspace[workspace_id].add(subscription)

    def unfollow_scope(self, subscription: Subscription, scope_id: str) -> None:
        subscription.scopes.discard(scope_id)
        subs = self._by_scope.get(scope_id)
        if subs is not None:
            subs.discard(subscription)
            if not subs:
                del self._by_scope[scope_id]

    def unfollow_workspace(self, subscription: Subscription) -> None:
        if subscription.workspace_id is not None:
            subs = self._by_workspace.get(subscription.workspace_id)
            if subs is not None:
                subs.discard(subscription)
                if not subs:
                    del self._by_workspace[subscription.workspace_id]
            subscription.workspace_id = None

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.active = False
        for scope_id in list(subscription.scopes):
            self.unfollow_scope(subscription, scope_id)
        self.unfollow_workspace(subscription)

    async def publish(self, event: CommittedEvent, roster: frozenset[str] | set[str] | None = None) -> None:
        await self.publish_many([(event, roster)])

    async def publish_many(self, items: Publication, done: Callable[[], None] | None = None) -> None:
        """Queue events for every subscriber entitled to them: a follower of the
        scope or of its workspace whose member is in the roster (or the event's
        own audience).  Waits only while the queue is full.  `done` runs once
        they have been handed to every connection."""
        if not any(event.scope_id in self._by_scope or event.workspace_id in self._by_workspace
                   for event, _ in items):
            self.published += len(items)  # nobody follows: nothing to deliver
            if done is not None:
                done()
            return
        await self._send.send((items, done))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for items, done in self._receive:
            publications = [(items, done)]
            while True:
                try:
                    publications.append(self._receive.receive_nowait())
                except trio.WouldBlock:
                    break
            await self._deliver([item for items, _ in publications for item in items])
            for _, done in publications:
                if done is not None:
                    done()

    async def _deliver(self, items: Publication) -> None:
        touched: dict[Subscription, None] = {}
        visited = 0
        for event, roster in items:
            self.published += 1
            entitled = event.audience if event.audience is not None else roster
            by_scope = self._by_scope.get(event.scope_id)
            by_workspace = self._by_workspace.get(event.workspace_id)
            # Copies: subscriptions change while this task yields.
            if by_scope and by_workspace:
                targets = list(by_scope | by_workspace)
            else:
                targets = list(by_scope or by_workspace or ())
            for subscription in targets:
                visited += 1
                if visited % self._chunk == 0:
                    await trio.lowlevel.checkpoint()
                if not subscription.active:
                    continue
                if entitled is not None and subscription.member_id not in entitled:
                    subscription.sink.skip(event)
                    continue
                subscription.sink.deliver(event)
                if len(items) == 1:
                    subscription.sink.flush()
                else:
                    touched[subscription] = None
        for subscription in touched:
            visited += 1
            if visited % self._chunk == 0:
                await trio.lowlevel.checkpoint()
            if subscription.active:
                subscription.sink.flush()
