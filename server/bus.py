"""The cross-node bus: how a node tells the others what it committed.

A transport carries numbered, opaque payloads from one node to every other
node in the order each sender sent them, and may lose some:
PostgreSQL NOTIFY (the default, `PgNotifyTransport`) or NATS
(`server/bus_nats.py`).  Neither is durable, so nothing relies on the bus
for correctness: a receiver that sees a gap in a sender's numbers, or a
`resync` from its transport, resumes every local subscriber from the
durable log (server/cluster_fanout.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import trio

from storage import cluster_bus
from storage.bridge import Database

log = logging.getLogger("scopewire.bus")


@dataclass(frozen=True, slots=True)
class Delivery:
    sender: str  # node id
    seq: int  # the sender's bus seq (consecutive per sender)
    payload: bytes | None  # None only with resync
    resync: bool = False  # anything before this may have been lost


class BusTransport(Protocol):
    name: str

    async def open(self, node_id: str) -> trio.MemoryReceiveChannel[Delivery]:
        """Start receiving as `node_id`: every later `send` of every other node arrives on
        the channel (a node's own are not delivered back to it)."""

    async def send(self, sender: str, first_seq: int, payloads: list[bytes]) -> None:
        """Send `payloads` in order, numbered from `first_seq`; raises on failure."""

    async def aclose(self) -> None:
        ...


class PgNotifyTransport:
    """NOTIFY on `scopewire_bus`; payloads too big for a notification go through a table."""

    name = "postgres"

    def __init__(self, db: Database, *, buffer: int = 4096) -> None:
        self.db = db
        self._buffer = buffer
        self._listener = None
        self._send, self._receive = trio.open_memory_channel[Delivery](buffer)
        self._nursery_scope: trio.CancelScope | None = None

    async def open(self, node_id: str) -> trio.MemoryReceiveChannel[Delivery]:
        self._node_id = node_id
        self._listener = self.db.listen(cluster_bus.CHANNEL, buffer=self._buffer)
        self._notifications = await self._listener.__aenter__()
        return self._receive

    async def pump(self) -> None:
        """Turn notifications into deliveries (run as a task after `open`)."""
        async with self._send:
            async for note in self._notifications:
                if note.resync and note.payload is None:
                    await self._send.send(Delivery("", 0, None, resync=True))
                    continue
                try:
                    sender, seq, payload = cluster_bus.parse(note.payload or "", skip_from=self._node_id)
                except ValueError:
                    log.warning("unreadable bus notification ignored")
                    continue
                if sender == self._node_id and not note.resync:
                    continue  # our own: never decoded
                if payload is None:
                    payload = await self._spilled(sender, seq)
                await self._send.send(Delivery(sender, seq, payload, resync=note.resync or payload is None))

    async def _spilled(self, sender: str, seq: int) -> bytes | None:
        try:
            return await self.db.run(cluster_bus.spilled, sender, seq)
        except Exception as exc:  # noqa: BLE001 - a lost message: the receiver resyncs
            log.warning("bus spill read failed", extra={"error": str(exc)})
            return None

    async def send(self, sender: str, first_seq: int, payloads: list[bytes]) -> None:
        await self.db.run(cluster_bus.notify, sender, first_seq, payloads)

    async def aclose(self) -> None:
        if self._listener is not None:
            await self._listener.__aexit__(None, None, None)
            self._listener = None
