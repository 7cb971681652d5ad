"""The sparse delivery ledger: every statement on member_delivery_feeds and
scope_targeted_deliveries (scope-model.md §3.10; collaborator-policy §5).

A wake (a mention, an explicit recipient, auto-wake, a reaction) writes, in the
producing transaction, one `delivery.routed` outbox row with its recipients
frozen in the payload and one ledger row per recipient, numbered per recipient
in commit order.  The ledger row's status is the delivery's at-least-once
state: pending → leased (handed to one connection) → acked, or back to pending
when its connection goes or its lease expires; suppressed when the handout
re-check fails, failed after max_attempts handouts, expired past retention.
Ordinary messages write nothing here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from domain.plan import DeliveryPolicy
from domain.routing import Route, RoutedDelivery, activity_dedupe_key, message_dedupe_key
from storage import applier
from storage.ids import new_id

ROUTED_FANOUT = "delivery.routed"

UNACKED = ("pending", "leased")


@dataclass(frozen=True)
class RouteSet:
    """The routes of one message or one activity event, written together."""

    routes: tuple[Route, ...]
    message_id: str | None = None             # the message (for a reaction: the message reacted to)
    activity_event_id: str | None = None      # set for a non-message activity
    revision: int | None = None               # an edit's newly mentioned members (one outbox row per revision)


async def write_routes(conn: asyncpg.Connection, workspace_id: str, scope_id: str, sets: Sequence[RouteSet],
                       generation: int) -> list[RoutedDelivery]:
    """Write one outbox row per set and one ledger row per route, in the
    producing transaction.  Recipients' feed rows are locked in member order
    (the caller already holds the workspace's counter row, so writers of one
    workspace never wait on each other in a cycle)."""
    sets = [s for s in sets if s.routes]
    if not sets:
        return []
    counts: dict[str, int] = {}
    for route_set in sets:
        for route in route_set.routes:
            counts[route.member_id] = counts.get(route.member_id, 0) + 1
    members = sorted(counts)
    tails = {r["member_id"]: r["latest_delivery_seq"] for r in await conn.fetch(
        "INSERT INTO member_delivery_feeds AS f (workspace_id, member_id, latest_delivery_seq) "
        "SELECT $1, m, c FROM unnest($2::text[], $3::bigint[]) AS t(m, c) "
        "ON CONFLICT (workspace_id, member_id) DO UPDATE SET latest_delivery_seq = f.latest_delivery_seq + "
        "EXCLUDED.latest_delivery_seq RETURNING member_id, latest_delivery_seq",
        workspace_id, members, [counts[m] for m in members])}
    next_seq = {m: tails[m] - counts[m] + 1 for m in members}
    outbox_rows, delivery_rows = [], []
    for route_set in sets:
        outbox_id = new_id("obx")
        activity = route_set.activity_event_id
        ref_type, ref_id = ("activity", activity) if activity else ("message", route_set.message_id)
        policy = DeliveryPolicy.WORKER_FIRST_TARGETED if activity else DeliveryPolicy.INLINE_TARGETED
        recipients = []
        for route in route_set.routes:
            seq = next_seq[route.member_id]
            next_seq[route.member_id] += 1
            key = (activity_dedupe_key(activity, route.member_id) if activity
                   else message_dedupe_key(route_set.message_id, route.member_id))
            reasons = list(route.reasons) or [route.reason]
            delivery_rows.append((new_id("dlv"), route.member_id, seq, outbox_id, route_set.message_id, activity,
                                  route.reason, route.authority, key, route.push, "{" + ",".join(reasons) + "}"))
            recipients.append([route.member_id, route.reason, route.authority, seq, route.push, reasons])
        payload = {"recipients": recipients}
        outbox_rows.append((outbox_id, route_set.message_id, ref_type, ref_id, policy.value,
                            f"routed:{ref_id}" + (f":r{route_set.revision}" if route_set.revision else ""),
                            json.dumps(payload),
                            0 if activity else applier.INLINE_GRACE_SECONDS))
    await applier.insert_routed_outbox(conn, workspace_id, scope_id, ROUTED_FANOUT, generation, outbox_rows)
    columns = [list(c) for c in zip(*delivery_rows)]
    created = await conn.fetch(
        "INSERT INTO scope_targeted_deliveries (id, workspace_id, recipient_member_id, delivery_seq, outbox_id, "
        "scope_id, message_id, activity_event_id, reason, authority, dedupe_key, push, reasons) "
        "SELECT i, $1, r, s, o, $2, m, a, re, au, dk, p, rs::text[] FROM unnest($3::text[], $4::text[], $5::bigint[], "
        "$6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::bool[], $13::text[]) "
        "AS t(i, r, s, o, m, a, re, au, dk, p, rs) RETURNING created_at",
        workspace_id, scope_id, *columns,
    )
    created_at = created[0]["created_at"]
    return [RoutedDelivery(id=row[0], workspace_id=workspace_id, recipient_member_id=row[1], delivery_seq=row[2],
                           scope_id=scope_id, message_id=row[4], activity_event_id=row[5], reason=row[6],
                           authority=row[7], dedupe_key=row[8], push=row[9], outbox_id=row[3],
                           created_at=created_at, reasons=tuple(row[10].strip("{}").split(",")))
            for row in delivery_rows]


def routed_from_row(row: asyncpg.Record) -> RoutedDelivery:
    return RoutedDelivery(id=row["id"], workspace_id=row["workspace_id"],
                          recipient_member_id=row["recipient_member_id"], delivery_seq=row["delivery_seq"],
                          scope_id=row["scope_id"], message_id=row["message_id"],
                          activity_event_id=row["activity_event_id"], reason=row["reason"],
                          authority=row["authority"], dedupe_key=row["dedupe_key"], push=row["push"],
                          outbox_id=row["outbox_id"], created_at=row["created_at"],
                          reasons=tuple(row["reasons"] or ()))


# --- handout, ack, release -------------------------------------------------------------------------

async def lease(conn: asyncpg.Connection, delivery_ids: list[str], owners: list[str], now: datetime,
                lease_seconds: float) -> list[asyncpg.Record]:
    """Lease each of `delivery_ids` to its owner in `owners` (a connection) when it
    is free (pending, or leased with an expired lease).  A delivery whose lease
    ran out unacked max_attempts times fails instead (poison protection; a
    connection that closed released its leases, which does not count).
    Returns the leased rows."""
    await conn.execute(
        "UPDATE scope_targeted_deliveries SET status = 'failed', suppressed_at = $2, "
        "suppression_reason = 'max_attempts', lease_owner = NULL, lease_expires_at = NULL "
        "WHERE id = ANY($1::text[]) AND status = 'leased' AND lease_expires_at <= $2 "
        "AND lease_expiries + 1 >= max_attempts",
        delivery_ids, now,
    )
    return await conn.fetch(
        "UPDATE scope_targeted_deliveries d SET status = 'leased', lease_owner = t.owner, lease_expires_at = $4, "
        "attempts = d.attempts + 1, lease_expiries = d.lease_expiries + (d.status = 'leased')::int "
        "FROM unnest($1::text[], $2::text[]) AS t(id, owner) WHERE d.id = t.id "
        "AND (d.status = 'pending' OR (d.status = 'leased' AND d.lease_expires_at <= $3)) RETURNING d.*",
        delivery_ids, owners, now, now + timedelta(seconds=lease_seconds),
    )


async def suppress(conn: asyncpg.Connection, reasons: dict[str, str], now: datetime) -> None:
    """The handout re-check failed for these deliveries: they are never sent."""
    if reasons:
        await conn.execute(
            "UPDATE scope_targeted_deliveries d SET status = 'suppressed', suppressed_at = $3, "
            "suppression_reason = t.reason, lease_owner = NULL, lease_expires_at = NULL "
            "FROM unnest($1::text[], $2::text[]) AS t(id, reason) WHERE d.id = t.id AND d.status IN ('pending', 'leased')",
            list(reasons), list(reasons.values()), now,
        )


async def ack(conn: asyncpg.Connection, workspace_id: str, member_id: str, seqs: list[int],
              now: datetime) -> list[int]:
    """Ack the member's own unacked deliveries among `seqs`: the seqs acked now."""
    rows = await conn.fetch(
        "UPDATE scope_targeted_deliveries SET status = 'acked', acked_at = $4, lease_owner = NULL, "
        "lease_expires_at = NULL WHERE workspace_id = $1 AND recipient_member_id = $2 "
        "AND delivery_seq = ANY($3::bigint[]) AND status IN ('pending', 'leased') RETURNING delivery_seq",
        workspace_id, member_id, seqs, now,
    )
    return sorted(r["delivery_seq"] for r in rows)


async def release(conn: asyncpg.Connection, workspace_id: str, member_id: str, owner: str, seqs: list[int]) -> None:
    """`owner` (a connection) is gone or let go: its unacked leases return to the feed."""
    await conn.execute(
        "UPDATE scope_targeted_deliveries SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL "
        "WHERE workspace_id = $1 AND recipient_member_id = $2 AND delivery_seq = ANY($4::bigint[]) "
        "AND status = 'leased' AND lease_owner = $3",
        workspace_id, member_id, owner, seqs,
    )


async def free_unacked(conn: asyncpg.Connection, feeds: list[tuple[str, str, int]],
                       now: datetime) -> list[asyncpg.Record]:
    """The pushable deliveries of these (workspace, member, at most) feeds that
    nobody holds — pending, or leased by a lease that expired — oldest first per
    feed.  A lease held by a connection of another process is left alone until
    it expires, so two processes never hand one delivery out at once."""
    return await conn.fetch(
        "SELECT d.* FROM unnest($1::text[], $2::text[], $3::int[]) AS f(w, m, n) CROSS JOIN LATERAL ("
        " SELECT * FROM scope_targeted_deliveries WHERE workspace_id = f.w AND recipient_member_id = f.m "
        " AND status IN ('pending', 'leased') AND push AND (status = 'pending' OR lease_expires_at <= $4) "
        " ORDER BY delivery_seq LIMIT f.n) d",
        [w for w, _, _ in feeds], [m for _, m, _ in feeds], [n for _, _, n in feeds], now,
    )


async def message_recipients(conn: asyncpg.Connection, scope_id: str, message_id: str) -> set[str]:
    """Members who already have this message's delivery (its dedupe key is per member and message)."""
    return {r["recipient_member_id"] for r in await conn.fetch(
        "SELECT recipient_member_id FROM scope_targeted_deliveries WHERE scope_id = $1 AND message_id = $2 "
        "AND activity_event_id IS NULL", scope_id, message_id)}


async def messages_by_id(conn: asyncpg.Connection, message_ids: list[str]) -> dict[str, asyncpg.Record]:
    """The delivered messages as they are now (the handout re-check ran first)."""
    rows = await conn.fetch("SELECT * FROM scope_messages WHERE id = ANY($1::text[])", message_ids)
    return {r["id"]: r for r in rows}


async def outbox_deliveries(conn: asyncpg.Connection, outbox_id: str) -> list[asyncpg.Record]:
    """The pushable, still unacked deliveries of one `delivery.routed` outbox row (the worker's handoff)."""
    return await conn.fetch(
        "SELECT * FROM scope_targeted_deliveries WHERE outbox_id = $1 AND push AND status IN ('pending', 'leased') "
        "ORDER BY recipient_member_id, delivery_seq",
        outbox_id,
    )


async def feed_state(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> tuple[int, int]:
    """(latest delivery_seq, count of pushable unacked deliveries) of the member's feed."""
    row = await conn.fetchrow(
        "SELECT coalesce((SELECT latest_delivery_seq FROM member_delivery_feeds WHERE workspace_id = $1 "
        "AND member_id = $2), 0) AS latest, (SELECT count(*) FROM scope_targeted_deliveries WHERE workspace_id = $1 "
        "AND recipient_member_id = $2 AND status IN ('pending', 'leased') AND push) AS unacked",
        workspace_id, member_id,
    )
    return row["latest"], row["unacked"]


async def feed_page(conn: asyncpg.Connection, workspace_id: str, member_id: str, after_seq: int,
                    limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT * FROM scope_targeted_deliveries WHERE workspace_id = $1 AND recipient_member_id = $2 "
        "AND delivery_seq > $3 ORDER BY delivery_seq LIMIT $4",
        workspace_id, member_id, after_seq, limit,
    )


async def expire_unacked(conn: asyncpg.Connection, older_than: datetime, now: datetime, limit: int = 1000) -> int:
    """Routed history is not an unbounded queue: unacked deliveries past retention expire."""
    rows = await conn.fetch(
        "UPDATE scope_targeted_deliveries SET status = 'expired', suppressed_at = $2, suppression_reason = 'retention', "
        "lease_owner = NULL, lease_expires_at = NULL WHERE id IN (SELECT id FROM scope_targeted_deliveries "
        "WHERE status IN ('pending', 'leased') AND created_at < $1 ORDER BY created_at LIMIT $3 "
        "FOR UPDATE SKIP LOCKED) RETURNING id",
        older_than, now, limit,
    )
    return len(rows)


async def activity_events(conn: asyncpg.Connection, ids: list[str]) -> dict[str, asyncpg.Record]:
    rows = await conn.fetch(
        "SELECT id, activity_type, actor_member_id, source_message_id, payload FROM scope_activity_events "
        "WHERE id = ANY($1::text[])",
        ids,
    )
    return {r["id"]: r for r in rows}


async def delete_for_scope(conn: asyncpg.Connection, scope_id: str) -> None:
    """A scope deleted for good (a service account's delete) takes its deliveries along."""
    await conn.execute("DELETE FROM scope_targeted_deliveries WHERE scope_id = $1", scope_id)


async def delete_member_feed(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> None:
    """A member deleted for good (a service account's author) takes its feed along."""
    await conn.execute("DELETE FROM scope_targeted_deliveries WHERE workspace_id = $1 AND recipient_member_id = $2",
                       workspace_id, member_id)
    await conn.execute("DELETE FROM member_delivery_feeds WHERE workspace_id = $1 AND member_id = $2",
                       workspace_id, member_id)
