"""The fanout hub: where committed events go after commit.

Subscribers register per scope and/or per workspace with a Sink; publishing
calls the sinks synchronously (no task switch per recipient).  A sink never
blocks: one that cannot keep up cuts its own connection off and the client
resumes from its cursor against the durable log.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol


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


MESSAGE_CREATED = "message.created"


class EventRun:
    """Consecutive new messages of one scope (seqs first_seq..last_seq without a
    hole) published together to the same entitled members: most subscribers take
    the whole run in one step instead of one step per event, and every one of a
    wire format gets the same bytes (`frames`, built by the first that needs them)."""

    # Plain attributes, not properties: every subscriber of a publication reads them.
    __slots__ = ("scope_id", "events", "first_seq", "last_seq", "frames")

    def __init__(self, scope_id: str, events: list[CommittedEvent]) -> None:
        self.scope_id = scope_id
        self.events = events
        self.first_seq: int = events[0].seq
        self.last_seq: int = events[-1].seq
        self.frames: dict[bool, bytes] = {}


class Roster(frozenset):
    """The members entitled to a scope's events, as of the scope's `roster_generation`
    (None: not the scope's own roster; a task's is its board channel's readers).  Other
    nodes cache a scope's public readers by that generation rather than ask per event."""

    __slots__ = ("generation",)
    generation: int | None

    def __new__(cls, members=(), generation: int | None = None) -> Roster:
        roster = super().__new__(cls, members)
        roster.generation = generation
        return roster


class Sink(Protocol):
    """The receiving end of a subscription.  Every method is synchronous and
    must not block: the hub calls them from the committing actor's task."""

    def admit(self, event: CommittedEvent) -> bytes | None:
        """An event the member is entitled to: the frame to write, or None."""

    def skip(self, event: CommittedEvent) -> None:
        """An event on a followed workspace that is not for this member (its
        workspace_global_seq is still a step of the feed's sequence)."""

    def admit_run(self, run: EventRun, write: bool = False) -> bytes | None:
        """A run the member is entitled to: its frames in one piece when they all
        go out now, exactly in order after what this sink sent last — and, when
        `write`, already written, or gathered to be written when the hub calls
        `flush_writes` (one call per subscriber of a publication that is this run
        alone); else None, and the hub hands the run's events to admit() one by one."""

    def write(self, frames: list[bytes]) -> None:
        """Write admitted frames, in order."""

    def join_group(self, group: InStepGroup) -> bool:
        """Whether this sink hands its delivery of the group's scope to the group: it
        stands at the group's seq, with nothing queued, no replay and no feed cursor."""


class InStepGroup(Protocol):
    """The subscribers of one scope that stand exactly at `seq` in it, nothing queued
    for them, and entitled (as of `entitled`) to its messages: the next run of the scope
    goes to all of them in one step, with no per-subscriber work (server/realtime.py).
    A member's cursor is the group's while it is in it."""

    seq: int
    entitled: Any
    members: dict[Subscription, Any]

    def take(self, run: EventRun) -> tuple[int, int]:
        """Hand `run` (the next after `seq`) to every member: (deliveries, bytes)."""

    def offer(self, subscription: Subscription) -> None:
        """The subscriber was just served up to `seq`, alone: it joins if it is in step."""

    def dissolve(self) -> None:
        """Every member leaves, each with its cursor at `seq`."""


@dataclass(eq=False, slots=True)
class Subscription:
    member_id: str
    sink: Sink
    scopes: set[str] = field(default_factory=set)
    workspace_id: str | None = None
    active: bool = True


class FanoutHub:
    def __init__(self) -> None:
        # Also handed every publication, for other nodes (server/cluster_fanout.py).
        self.relay: Callable[[list[tuple[CommittedEvent, Any]]], None] | None = None
        # Called at the end of every publication: sinks may gather their writes until then
        # (server/send_ring.py).
        self.flush_writes: Callable[[], None] | None = None
        # Makes a scope's in-step group (server/realtime.py); None: every subscriber is
        # served one by one.
        self.group_factory: Callable[[str, int, Any], InStepGroup] | None = None
        self._by_scope: dict[str, set[Subscription]] = defaultdict(set)
        self._by_workspace: dict[str, set[Subscription]] = defaultdict(set)
        self._groups: dict[str, InStepGroup] = {}
        self.published = 0
        # Frames handed to subscribers (here, and by their replays), and their bytes
        # (plain ints: read at scrape time).
        self.delivered = 0
        self.delivered_bytes = 0

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
                group = self._groups.pop(scope_id, None)
                if group is not None:
                    group.dissolve()

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

    def publish(self, event: CommittedEvent, roster: frozenset[str] | set[str] | None = None) -> None:
        self.publish_many([(event, roster)])

    def followed(self, workspace_id: str, scope_id: str) -> bool:
        """Whether anyone here follows the scope or its workspace."""
        return bool(self._by_scope.get(scope_id) or self._by_workspace.get(workspace_id))

    def followers(self, workspace_id: str, scope_id: str) -> set[str]:
        """The members following the scope, or its workspace, here."""
        found = {s.member_id for s in self._by_scope.get(scope_id, ())}
        found.update(s.member_id for s in self._by_workspace.get(workspace_id, ()))
        return found

    def publish_many(self, items: list[tuple[CommittedEvent, frozenset[str] | set[str] | None]], *,
                     relay: bool = True) -> None:
        """Hand each event, in order, to every subscriber entitled to it: a
        follower of the scope or of its workspace whose member is in the roster
        (or the event's own audience).  A batch of events leaves in one write
        per connection.  Never blocks.  Unless it came from another node
        (`relay=False`), the publication then goes to the relay too."""
        try:
            self._deliver(items)
        finally:
            if self.flush_writes is not None:
                self.flush_writes()
        if relay and self.relay is not None:
            self.relay(items)

    def _deliver(self, items: list[tuple[CommittedEvent, frozenset[str] | set[str] | None]]) -> None:
        runs = list(_runs(items))
        # One run (nearly every publication): each subscriber is written (or its write handed
        # to flush_writes) as soon as it is served.  Several: gathered here, so that a
        # connection gets the batch in one write.
        alone = len(runs) == 1
        pending: dict[Subscription, list[bytes]] = {}
        delivered = delivered_bytes = 0
        for events, entitled in runs:
            self.published += len(events)
            event = events[0]
            by_scope = self._by_scope.get(event.scope_id)
            by_workspace = self._by_workspace.get(event.workspace_id)
            # A lone message is a run too: admit_run takes and writes it in one call where it is next.
            run = (EventRun(event.scope_id, events)
                   if len(events) > 1 or (alone and event.event == MESSAGE_CREATED and event.seq is not None)
                   else None)
            group, in_group = self._group_for(event.scope_id, run if alone else None, events, entitled)
            if in_group:
                taken, taken_bytes = group.take(run)
                delivered += taken
                delivered_bytes += taken_bytes
            # Copies: a sink may unsubscribe itself (cut off) while we iterate.
            if by_scope and by_workspace:
                targets = by_scope | by_workspace
            else:
                targets = by_scope or by_workspace or ()
            targets = list(targets - group.members.keys() if in_group and targets else targets)
            for subscription in targets:
                if not subscription.active:
                    continue
                sink = subscription.sink
                if entitled is not None and subscription.member_id not in entitled:
                    for event in events:
                        sink.skip(event)
                    continue
                if run is not None:
                    frame = sink.admit_run(run, alone)
                    if frame is not None:
                        delivered += len(events)
                        delivered_bytes += len(frame)
                        if group is not None:
                            group.offer(subscription)
                        if not alone:
                            frames = pending.get(subscription)
                            if frames is None:
                                pending[subscription] = [frame]
                            else:
                                frames.append(frame)
                        continue
                frames = []
                for event in events:
                    frame = sink.admit(event)
                    if not subscription.active:
                        break  # cut off by this event
                    if frame is not None:
                        delivered += 1
                        delivered_bytes += len(frame)
                        frames.append(frame)
                if not frames:
                    continue
                if alone:
                    if subscription.active:
                        sink.write(frames)
                elif subscription in pending:
                    pending[subscription] += frames
                else:
                    pending[subscription] = frames
        for subscription, frames in pending.items():
            if subscription.active:
                subscription.sink.write(frames)
        self.delivered += delivered
        self.delivered_bytes += delivered_bytes

    def _group_for(self, scope_id: str, run: EventRun | None, events: list[CommittedEvent],
                   entitled: Any) -> tuple[InStepGroup | None, bool]:
        """The scope's in-step group for this run of a publication, and whether it takes
        the run (the publication's only run, next in the scope, for the same members) —
        or None where the subscribers are served one by one.  A run that moves cursors
        and that the group cannot take dissolves it first."""
        group = self._groups.get(scope_id)
        if group is not None:
            if run is not None and run.first_seq == group.seq + 1 and _same_members(group, entitled):
                return group, True
            if not any(e.event == MESSAGE_CREATED and e.seq is not None for e in events):
                return None, False  # no cursor moves: members are served one by one and stay
            del self._groups[scope_id]
            group.dissolve()
        if (run is not None and self.group_factory is not None and scope_id in self._by_scope
                and (entitled is None or isinstance(entitled, frozenset))):
            # Formed by the subscribers this run reaches in step (offer); it takes the next.
            group = self._groups[scope_id] = self.group_factory(scope_id, run.last_seq, entitled)
        return group, False


def _same_members(group: InStepGroup, entitled: Any) -> bool:
    """Whether `entitled` is the group's entitlement: the same object, or an equal set
    (then adopted, so that the next publication compares identity only)."""
    if entitled is group.entitled:
        return True
    if isinstance(entitled, frozenset) and isinstance(group.entitled, frozenset) and entitled == group.entitled:
        group.entitled = entitled
        return True
    return False


def _runs(items: list[tuple[CommittedEvent, frozenset[str] | set[str] | None]]):
    """The publication as (events, entitled members) runs: consecutive new messages
    of one scope in seq order with the same entitlement share a run; anything
    else is a run of one."""
    run: list[CommittedEvent] = []
    run_entitled: Any = None
    for event, roster in items:
        entitled = event.audience if event.audience is not None else roster
        if (run and entitled is run_entitled and event.event == MESSAGE_CREATED and event.seq is not None
                and run[-1].event == MESSAGE_CREATED and run[-1].scope_id == event.scope_id
                and run[-1].seq is not None and run[-1].seq + 1 == event.seq):
            run.append(event)
            continue
        if run:
            yield run, run_entitled
        run, run_entitled = [event], entitled
    if run:
        yield run, run_entitled
