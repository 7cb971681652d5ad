"""The cross-node bus over PostgreSQL LISTEN/NOTIFY (server/bus.py).

A NOTIFY payload is text of at most 8000 bytes and is not durable, so a bus
message travels as `node_id:bus_seq:base64` when it fits, else as
`node_id:bus_seq:*` with its bytes in `cluster_bus_spill` (inserted in the
same transaction, so the row is there when the notification arrives).  The
per-node `bus_seq` lets a receiver see that it missed messages (a gap), and
keeps equal payloads distinct (PostgreSQL folds identical notifications of
one transaction into one).
"""

from __future__ import annotations

import base64

import asyncpg

CHANNEL = "scopewire_bus"
# PostgreSQL's limit is 8000 bytes; the header (node id, seq) takes the rest.
MAX_INLINE_BYTES = 7_800
SPILLED = "*"  # never base64
# A NOTIFY takes a transaction id, so its commit waited for a WAL flush (an fsync per bus
# message, as many as the owner's own commits).  Nothing here needs to outlive a crash (the
# bus is not durable, the receivers replay from the log), so the commit does not wait.
_NOT_DURABLE = "set_config('synchronous_commit', 'off', true)"


def _inline(node_id: str, bus_seq: int, payload: bytes) -> str | None:
    text = f"{node_id}:{bus_seq}:{base64.b64encode(payload).decode()}"
    return text if len(text) <= MAX_INLINE_BYTES else None


async def notify(conn: asyncpg.Connection, node_id: str, first_seq: int, payloads: list[bytes]) -> None:
    """Send `payloads` in order, numbered from `first_seq`: one statement, so one
    transaction without a BEGIN and COMMIT round trip each."""
    texts: list[str] = []
    spilled_seqs: list[int] = []
    spilled_payloads: list[bytes] = []
    for offset, payload in enumerate(payloads):
        seq = first_seq + offset
        text = _inline(node_id, seq, payload)
        if text is None:
            spilled_seqs.append(seq)
            spilled_payloads.append(payload)
            text = f"{node_id}:{seq}:{SPILLED}"
        texts.append(text)
    if not spilled_seqs:
        # unnest yields the array in order, and the notifications queue in that order.
        await conn.execute(f"SELECT {_NOT_DURABLE}, count(pg_notify($1, t)) FROM unnest($2::text[]) AS t",
                           CHANNEL, texts)
        return
    # The spilled rows commit with the notifications (a data-modifying WITH always runs), so
    # they are there when the notifications arrive.
    await conn.execute(
        "WITH spill AS (INSERT INTO cluster_bus_spill (node_id, bus_seq, payload) "
        "SELECT $3, s, p FROM unnest($4::bigint[], $5::bytea[]) AS u(s, p)) "
        f"SELECT {_NOT_DURABLE}, count(pg_notify($1, t)) FROM unnest($2::text[]) AS t",
        CHANNEL, texts, node_id, spilled_seqs, spilled_payloads)


def parse(text: str, skip_from: str | None = None) -> tuple[str, int, bytes | None]:
    """(sender node, its bus seq, the payload — None when it was spilled, or when
    the sender is `skip_from`: a node's own messages are not decoded)."""
    node_id, seq, body = text.split(":", 2)
    return node_id, int(seq), (base64.b64decode(body) if body != SPILLED and node_id != skip_from else None)


async def spilled(conn: asyncpg.Connection, node_id: str, bus_seq: int) -> bytes | None:
    return await conn.fetchval("SELECT payload FROM cluster_bus_spill WHERE node_id = $1 AND bus_seq = $2",
                               node_id, bus_seq)


async def prune_spill(conn: asyncpg.Connection, older_than_seconds: float) -> int:
    result = await conn.execute("DELETE FROM cluster_bus_spill WHERE created_at < now() - make_interval(secs => $1)",
                                older_than_seconds)
    return int(result.split()[-1])
