"""The outbox worker: leases due rows of scope_fanout_outbox, re-checks
the execution generation and suppression, replays the side effect (publishes the committed event), and
settles the row; failures back off exponentially up to max_attempts.  Fanout
failure never touches the committed message."""

from __future__ import annotations

import logging

import trio

from actors.fanout import CommittedEvent, FanoutHub
from actors.delivery_router import DeliveryRouter
from storage import applier, deliveries, messages, visibility
from storage.bridge import Database
from storage.errors import DatabaseUnavailable
from storage.ids import new_id

log = logging.getLogger("scopewire.outbox")


class OutboxWorker:
    def __init__(self, db: Database, hub: FanoutHub, router: DeliveryRouter | None = None, *,
                 poll_seconds: float = 2.0, batch: int = 100, lease_seconds: float = 30.0) -> None:
        self.db = db
        self.hub = hub
        self.router = router
        self.poll_seconds = poll_seconds
        self.batch = batch
        self.lease_seconds = lease_seconds
        self.owner = new_id("con")
        self.wake = trio.Event()
        self.replayed = 0
        self.failed_attempts = 0  # deliveries that failed and were scheduled for a retry

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(self.poll_seconds):
                await self.wake.wait()
            self.wake = trio.Event()
            try:
                while await self.drain_once() == self.batch:
                    pass
            except DatabaseUnavailable:
                log.warning("outbox worker: database unavailable; retrying later")

    async def drain_once(self) -> int:
        """Lease and process one batch; returns how many rows were leased."""
        rows = await self.db.transaction(applier.lease_due, self.owner, self.batch, self.lease_seconds)
        for row in rows:
            try:
                await self._deliver(row)
            except DatabaseUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of the side effect is retried
                backoff = min(2 ** row["attempts"], 300)
                self.failed_attempts += 1
                await self.db.transaction(applier.settle_failed_attempt, row["id"], repr(exc), backoff)
        return len(rows)

    async def _deliver(self, row) -> None:
        if await self.db.transaction(applier.suppress_if_fenced, row["id"], row["workspace_id"],
                                     row["execution_generation"]) is not None:
            return
        if row["fanout_type"] == deliveries.ROUTED_FANOUT:
            await self._offer_routed(row)
            return
        message = await self.db.run(messages.committed_message, row["scope_id"], row["message_id"])
        if message is None:
            await self.db.transaction(applier.settle_suppressed, row["id"], "message_missing")
            return
        # Suppression is re-checked right before the side effect.
        if row["fanout_type"] == "message.created" and message.state == "withdrawn":
            await self.db.transaction(applier.settle_suppressed, row["id"], "message_withdrawn")
            return
        # Only who may read this message now (a private agent: by the readable predicate).
        roster = await self.db.run(visibility.entitled_for_message, row["scope_id"], row["message_id"])
        self.hub.publish(CommittedEvent(row["fanout_type"], row["workspace_id"], row["scope_id"], message.seq,
                                        message.workspace_global_seq, message), roster=roster)
        await self.db.transaction(applier.settle_delivered, [row["id"]])
        self.replayed += 1

    async def _offer_routed(self, row) -> None:
        """A worker-first routed row, or one whose inline handout a crash lost: its
        unacked deliveries go to the router (which re-checks each and settles the row)."""
        pending = await self.db.run(deliveries.outbox_deliveries, row["id"])
        if self.router is None or not pending:
            await self.db.transaction(applier.settle_delivered, [row["id"]])
            return
        self.router.offer([deliveries.routed_from_row(r) for r in pending])
        self.replayed += 1
