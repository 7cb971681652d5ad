"""The delivery router: the one task per process that hands routed deliveries
(the sparse ledger, storage/deliveries.py) to the connections subscribed to
their recipients' feeds, and owns the leases of those handouts.

- A scope actor offers the deliveries it committed (inline_targeted); the
  outbox worker offers those of worker-first rows and of rows whose inline
  handout a crash lost.  Offers for members with no subscribed connection here
  cost nothing: the ledger keeps them for the next subscribe.
- A handout re-checks each delivery (storage/visibility/deliveries.py) and
  leases it to ONE connection of the recipient, at most `max_in_flight`
  unacked per connection; acks free room.
- A connection that goes (or unsubscribes) releases its leases at once; a
  lease that expires (its connection stayed but never acked, or its process
  died) is found by the sweep and handed out again.  So a delivery is sent
  until acked: at least once, with a stable dedupe key.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

import trio

from domain.routing import RoutedDelivery
from storage import applier, deliveries, messages
from storage.bridge import Database
from storage.errors import DatabaseUnavailable
from storage.visibility.deliveries import handout_verdicts

log = logging.getLogger("scopewire.deliveries")

# Rows one sweep or one subscribe reads per feed.
FILL_PAGE = 500


@dataclass(frozen=True)
class Handout:
    """One delivery as handed to a connection: its ledger row after the lease,
    the message as it is now (for a reaction: the message reacted to) and the
    activity event (None for a message wake)."""

    row: Any
    message: Any
    activity: Any


class FeedSink(Protocol):
    def send_deliveries(self, handouts: list[Handout]) -> None:
        """Write these deliveries to the connection; never blocks."""


@dataclass(eq=False)
class FeedSubscription:
    workspace_id: str
    member_id: str
    owner: str  # the connection id: the lease owner
    sink: FeedSink
    max_in_flight: int
    # Delivery seqs leased here and not acked, with their lease expiry.
    in_flight: dict[int, datetime] = field(default_factory=dict)
    # More deliveries may be waiting than were handed out (room ran out): fill again on ack.
    behind: bool = True
    active: bool = True

    def room(self, now: datetime) -> int:
        """How many more may be leased here: an expired lease no longer takes room."""
        return max(0, self.max_in_flight - sum(1 for expires in self.in_flight.values() if expires > now))

    @property
    def feed(self) -> tuple[str, str]:
        return self.workspace_id, self.member_id


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class DeliveryRouter:
    def __init__(self, db: Database, *, lease_seconds: float = 60.0, retention_hours: float = 168.0,
                 sweep_seconds: float | None = None, clock: Callable[[], datetime] = _utc_now) -> None:
        self.db = db
        self.lease_seconds = lease_seconds
        self.retention = timedelta(hours=retention_hours)
        self.sweep_seconds = sweep_seconds if sweep_seconds is not None else min(5.0, lease_seconds / 2)
        self.clock = clock
        self._subscriptions: dict[tuple[str, str], list[FeedSubscription]] = defaultdict(list)
        # Which local subscription holds a delivery, by (workspace, member, seq).
        self._holders: dict[tuple[str, str, int], FeedSubscription] = {}
        self._work_send, self._work = trio.open_memory_channel[tuple[str, Any]](math.inf)
        self.handed_out = 0
        self.suppressed = 0
        # Also told of every offer, for the other nodes' subscribers (server/cluster.py).
        self.relay: Callable[[list[RoutedDelivery]], None] | None = None

    @property
    def subscription_count(self) -> int:
        return sum(len(subscribers) for subscribers in self._subscriptions.values())

    # --- called synchronously by actors, the outbox worker and connections --------------------

    def offer(self, offered: list[RoutedDelivery]) -> None:
        """Committed deliveries to hand out now (their outbox rows are settled once offered)."""
        self._work_send.send_nowait(("offer", offered))
        if self.relay is not None:
            self.relay(offered)

    def wake(self, feeds: list[tuple[str, str]]) -> None:
        """Another node committed deliveries to these (workspace, member) feeds: the
        connections subscribed to them here fill from the ledger now, not at the sweep."""
        for feed in feeds:
            for subscription in self._subscriptions.get(feed, ()):
                subscription.behind = True
                self._work_send.send_nowait(("fill", subscription))

    def subscribe(self, subscription: FeedSubscription) -> None:
        self._subscriptions[subscription.feed].append(subscription)
        self._work_send.send_nowait(("fill", subscription))

    def update(self, subscription: FeedSubscription, max_in_flight: int) -> None:
        subscription.max_in_flight = max_in_flight
        subscription.behind = True
        self._work_send.send_nowait(("fill", subscription))

    def unsubscribe(self, subscription: FeedSubscription) -> None:
        """The connection is gone or let go: its unacked deliveries return to the feed."""
        if not subscription.active:
            return
        subscription.active = False
        subscribers = self._subscriptions.get(subscription.feed)
        if subscribers is not None and subscription in subscribers:
            subscribers.remove(subscription)
            if not subscribers:
                del self._subscriptions[subscription.feed]
        self._work_send.send_nowait(("release", subscription))

    def acked(self, workspace_id: str, member_id: str, seqs: list[int]) -> None:
        """The member acked these (from any of its connections): room frees where they were held."""
        now = self.clock()
        for seq in seqs:
            self._forget(workspace_id, member_id, seq)
        for subscription in self._subscriptions.get((workspace_id, member_id), ()):
            if subscription.behind and subscription.room(now):
                self._work_send.send_nowait(("fill", subscription))

    # --- the router task ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sweep_forever)
            while True:
                work = [await self._work.receive()]
                while True:
                    try:
                        work.append(self._work.receive_nowait())
                    except trio.WouldBlock:
                        break
                try:
                    await self._process(work)
                except Exception as exc:  # noqa: BLE001 - the router must outlive any one batch
                    # Nothing is lost: the ledger still has every unacked delivery, and
                    # the sweep hands them out again.
                    if isinstance(exc, DatabaseUnavailable):
                        log.warning("delivery router: database unavailable; the sweep retries")
                    else:
                        log.exception("delivery router: a batch failed; the sweep retries")
                    for subscribers in self._subscriptions.values():
                        for subscription in subscribers:
                            subscription.behind = True

    async def _process(self, work: list[tuple[str, Any]]) -> None:
        offered: list[RoutedDelivery] = []
        fills: dict[int, FeedSubscription] = {}
        for kind, item in work:
            if kind == "offer":
                offered += item
            elif kind == "fill":
                fills[id(item)] = item
            elif kind == "sweep":
                for subscribers in self._subscriptions.values():
                    for subscription in subscribers:
                        fills[id(subscription)] = subscription
            elif kind == "release":
                await self._release(item)
                for other in self._subscriptions.get(item.feed, ()):
                    other.behind = True
                    fills[id(other)] = other
        # Fills first: a subscribe replays the oldest unacked before anything newer
        # offered in the same batch (which its fill already covers).
        now = self.clock()
        live = [s for s in fills.values() if s.active and s.room(now)]
        if live:
            await self._fill(live)
        if offered:
            await self._hand_out_offered(offered)

    async def _hand_out_offered(self, offered: list[RoutedDelivery]) -> None:
        by_feed: dict[tuple[str, str], list[RoutedDelivery]] = defaultdict(list)
        for delivery in offered:
            # One already held here was read from the ledger by a fill first: renewing its
            # lease, once expired, is the sweep's (which takes the feed's expired leases in
            # order, failing those out of attempts), never a late offer's.
            if (delivery.workspace_id, delivery.recipient_member_id, delivery.delivery_seq) in self._holders:
                continue
            if delivery.push and (delivery.workspace_id, delivery.recipient_member_id) in self._subscriptions:
                by_feed[(delivery.workspace_id, delivery.recipient_member_id)].append(delivery)
        plan: list[tuple[FeedSubscription, list[str]]] = []
        now = self.clock()
        for feed, waiting in by_feed.items():
            waiting.sort(key=lambda d: d.delivery_seq)
            for subscription in self._by_room(feed, now):
                take = waiting[:subscription.room(now)]
                waiting = waiting[len(take):]
                if take:
                    plan.append((subscription, [d.id for d in take]))
            for subscription in self._subscriptions.get(feed, ()):
                subscription.behind = subscription.behind or bool(waiting)
        outbox_ids = sorted({d.outbox_id for d in offered})
        if plan:
            await self._hand_out(plan, settle=outbox_ids)  # settled in the handout's transaction
        else:
            await self.db.transaction(applier.settle_delivered, outbox_ids)

    async def _fill(self, subscriptions: list[FeedSubscription]) -> None:
        """Hand the free deliveries of these subscriptions' feeds out (a subscribe,
        an ack that made room, a release, the sweep)."""
        now = self.clock()
        # Read no more per feed than its connections can take now.
        wanted = {feed: min(FILL_PAGE, sum(s.room(now) for s in self._by_room(feed, now)))
                  for feed in {s.feed for s in subscriptions}}
        feeds = sorted(feed for feed, count in wanted.items() if count)
        if not feeds:
            return
        rows = await self.db.run(deliveries.free_unacked, [(w, m, wanted[(w, m)]) for w, m in feeds], now)
        by_feed: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for row in rows:
            by_feed[(row["workspace_id"], row["recipient_member_id"])].append(row)
        plan: list[tuple[FeedSubscription, list[str]]] = []
        for feed in feeds:
            waiting = by_feed.get(feed, [])
            full_page = len(waiting) == wanted[feed]
            for subscription in self._by_room(feed, now):
                take = waiting[:subscription.room(now)]
                waiting = waiting[len(take):]
                subscription.behind = bool(waiting) or full_page
                if take:
                    plan.append((subscription, [r["id"] for r in take]))
        if plan:
            await self._hand_out(plan)

    def _by_room(self, feed: tuple[str, str], now: datetime) -> list[FeedSubscription]:
        """The feed's live subscriptions with room, the emptiest first: the load spreads."""
        return sorted((s for s in self._subscriptions.get(feed, ()) if s.active and s.room(now)),
                      key=lambda s: -s.room(now))

    async def _hand_out(self, plan: list[tuple[FeedSubscription, list[str]]], settle: list[str] = ()) -> None:
        """Lease and send; `settle`: the outbox rows this handout completes."""
        now = self.clock()
        leased = await self.db.transaction(self._lease, plan, now, settle)
        for subscription, handouts in leased:
            if not handouts:
                continue
            for handout in handouts:
                key = (subscription.workspace_id, subscription.member_id, handout.row["delivery_seq"])
                previous = self._holders.get(key)
                if previous is not None and previous is not subscription:
                    previous.in_flight.pop(key[2], None)
                self._holders[key] = subscription
                subscription.in_flight[key[2]] = handout.row["lease_expires_at"]
            if subscription.active:
                self.handed_out += len(handouts)
                subscription.sink.send_deliveries(handouts)
            else:
                # Its connection went while the lease was being taken: give them back now.
                self._work_send.send_nowait(("release", subscription))

    async def _lease(self, conn, plan: list[tuple[FeedSubscription, list[str]]], now: datetime,
                     settle: list[str]) -> list[tuple[FeedSubscription, list[Handout]]]:
        ids = [i for _, chosen in plan for i in chosen]
        verdicts = await handout_verdicts(conn, ids)
        refused = {i: reason for i, reason in verdicts.items() if reason is not None}
        if refused:
            await deliveries.suppress(conn, refused, now)
            self.suppressed += len(refused)
        owner_of = {i: subscription for subscription, chosen in plan for i in chosen if i not in refused}
        leased_rows = sorted(await deliveries.lease(conn, list(owner_of), [s.owner for s in owner_of.values()], now,
                                                    self.lease_seconds) if owner_of else [],
                             key=lambda r: r["delivery_seq"])
        by_subscription: dict[int, list[Any]] = defaultdict(list)
        for row in leased_rows:
            by_subscription[id(owner_of[row["id"]])].append(row)
        result = [(subscription, by_subscription.get(id(subscription), [])) for subscription, _ in plan]
        found = await deliveries.messages_by_id(conn, sorted({r["message_id"] for r in leased_rows if r["message_id"]}))
        activity_ids = sorted({r["activity_event_id"] for r in leased_rows if r["activity_event_id"]})
        activities = await deliveries.activity_events(conn, activity_ids) if activity_ids else {}
        if settle:
            await applier.settle_delivered(conn, list(settle))
        return [(subscription, [Handout(row, messages.committed_from_row(found[row["message_id"]])
                                        if row["message_id"] else None,
                                        activities.get(row["activity_event_id"])) for row in rows])
                for subscription, rows in result]

    async def _release(self, subscription: FeedSubscription) -> None:
        seqs = sorted(subscription.in_flight)
        for seq in seqs:
            self._forget(subscription.workspace_id, subscription.member_id, seq)
        if seqs:
            await self.db.transaction(deliveries.release, subscription.workspace_id, subscription.member_id,
                                      subscription.owner, seqs)

    def _forget(self, workspace_id: str, member_id: str, seq: int) -> None:
        holder = self._holders.pop((workspace_id, member_id, seq), None)
        if holder is not None:
            holder.in_flight.pop(seq, None)

    async def expire_due(self) -> int:
        """Expire the unacked deliveries older than the retention (one bounded
        statement on the retention index: nothing to do costs one probe)."""
        now = self.clock()
        return await self.db.transaction(deliveries.expire_unacked, now - self.retention, now)

    async def _sweep_forever(self) -> None:
        """Expired leases go out again (through the router task, so one delivery is
        never leased twice at once here); old unacked deliveries expire."""
        while True:
            await trio.sleep(self.sweep_seconds)
            if self._subscriptions:
                self._work_send.send_nowait(("sweep", None))
            try:
                await self.expire_due()
            except DatabaseUnavailable:
                log.warning("delivery sweep: database unavailable; retrying")
            except Exception:  # noqa: BLE001 - the sweep must outlive any one pass
                log.exception("delivery sweep failed; retrying")
