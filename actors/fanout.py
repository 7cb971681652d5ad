"""The fanout hub: where committed events go after commit.

Subscribers register per scope and/or per workspace and receive events in a
bounded trio memory channel.  A subscriber whose channel is full is cut off
(its channel is closed) rather than slowing anyone else; it resumes from its
cursor against the durable log.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(eq=False)
class Subscription:
    member_id: str
    send: trio.MemorySendChannel
    receive: trio.MemoryReceiveChannel
    scopes: set[str] = field(default_factory=set)
    workspace_id: str | None = None
    overflowed: bool = False
    # Called (synchronously) when the buffer overflows: the owner cuts the
    # connection off, even if its pusher is stuck writing to a dead socket.
    on_overflow: Callable[[], None] | None = None


class FanoutHub:
    def __init__(self) -> None:
        self._by_scope: dict[str, set[Subscription]] = defaultdict(set)
        self._by_workspace: dict[str, set[Subscription]] = defaultdict(set)
        self.published = 0

    def subscribe(self, member_id: str, *, buffer: int = 256) -> Subscription:
        send, receive = trio.open_memory_channel[CommittedEvent](buffer)
        return Subscription(member_id=member_id, send=send, receive=receive)

    def follow_scope(self, subscription: Subscription, scope_id: str) -> None:
        subscription.scopes.add(scope_id)
        self._by_scope[scope_id].add(subscription)

    def follow_workspace(self, subscription: Subscription, workspace_id: str) -> None:
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
        for scope_id in list(subscription.scopes):
            self.unfollow_scope(subscription, scope_id)
        self.unfollow_workspace(subscription)
        subscription.send.close()

    def publish(self, event: CommittedEvent, roster: frozenset[str] | set[str] | None = None) -> None:
        """Hand `event` to every subscriber entitled to it: a follower of the
        scope or of its workspace whose member is in `roster` (or the event's
        own audience).  Never blocks."""
        self.published += 1
        entitled = event.audience if event.audience is not None else roster
        targets = set(self._by_scope.get(event.scope_id, ())) | set(self._by_workspace.get(event.workspace_id, ()))
        for subscription in targets:
            if entitled is not None and subscription.member_id not in entitled:
                continue
            try:
                subscription.send.send_nowait(event)
            except trio.WouldBlock:
                subscription.overflowed = True
                self.unsubscribe(subscription)
                if subscription.on_overflow is not None:
                    subscription.on_overflow()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self.unsubscribe(subscription)
