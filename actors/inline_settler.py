"""Marks the inline-delivered `message.created` outbox rows of many scopes in one
statement.  Every scope actor of the node hands its marks here once it published:
a message to a quiet scope (a platform broadcast's thousand workspaces, a workspace
of many quiet channels) does not cost a second transaction, and a busy scope's
batches carry no UPDATE of the rows its previous batch wrote (which also kept
its two fences from sharing one statement).

The marks wait up to LINGER_SECONDS to be written together.  A mark that never
lands (the database is away, the process dies first) only makes the outbox worker
replay the event after the inline grace period (30 s, far longer); and a node that
lost a scope's lease may still mark what it published, which is true either way."""

from __future__ import annotations

import logging

import trio

from storage import applier
from storage.bridge import Database
from storage.errors import DatabaseUnavailable

log = logging.getLogger("scopewire.outbox")

LINGER_SECONDS = 0.2
# Rows marked per statement at most.
MAX_MARKED = 2000


class InlineSettler:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.linger_seconds = LINGER_SECONDS
        self._pending: list[tuple[str, str]] = []  # (scope, message) handed over, not written yet
        self._arrived = trio.Event()
        self._hurry = trio.Event()
        self._progress = trio.Event()
        self._handed = 0
        self._done = 0
        self._closing = False
        self.statements = 0

    def settle(self, scope_id: str, message_ids: list[str]) -> None:
        """Mark these messages of `scope_id` delivered soon (never blocks)."""
        if self._closing:
            return  # the outbox worker replays them after the grace period
        self._pending += [(scope_id, message_id) for message_id in message_ids]
        self._handed += len(message_ids)
        self._arrived.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._arrived.wait()
            with trio.move_on_after(self.linger_seconds):
                await self._hurry.wait()
            self._arrived, self._hurry = trio.Event(), trio.Event()
            batch, self._pending = self._pending[:MAX_MARKED], self._pending[MAX_MARKED:]
            if self._pending:
                self._arrived.set()
            try:
                await self.db.transaction(applier.settle_inline_delivered_many, [s for s, _ in batch],
                                          [m for _, m in batch])
                self.statements += 1
            except DatabaseUnavailable:
                log.warning("inline deliveries not marked; the outbox worker replays them")
            except Exception:  # noqa: BLE001 - the settler must outlive any one statement
                log.exception("inline deliveries not marked; the outbox worker replays them")
            self._done += len(batch)
            self._progress.set()
            self._progress = trio.Event()

    async def flush(self) -> None:
        """Return once everything handed over so far was written (or given up)."""
        target = self._handed
        while self._done < target:
            progress = self._progress
            self._hurry.set()
            await progress.wait()

    async def drain(self) -> None:
        """A clean shutdown, after the scope actors stopped: write what they handed over."""
        self._closing = True
        await self.flush()
