"""Nodes and ownership leases (scale-out): of scopes, and of platform accounts.

A node is one scopewire process.  Its row's `lease_expires_at`, renewed by a
heartbeat, is the liveness of every lease it holds.  A scope (a platform
account) is owned by at most one node: the lease row names it with an `epoch`
that grows on every acquisition, and the owner's every write transaction passes
`pass_fence` first, which takes a shared lock on the lease row and checks node,
epoch and node lease.  A takeover (`acquire`) updates that row, so it waits for
the owner's in-flight transaction; after it, the former owner's fence fails and
its transaction commits nothing.  All times are the database's clock, so the
nodes' own clocks never matter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from domain.credentials import CredentialProof
from domain.platform import PLATFORM_CHANNEL
from storage import tenancy
from storage.errors import LeaseLost, NotFound


@dataclass(frozen=True)
class LeasedKind:
    """What is owned: the lease table, its key column, and the table of the owned rows."""

    name: str
    table: str
    key: str
    owned_table: str


SCOPES = LeasedKind("scope", "scope_leases", "scope_id", "scopes")
PLATFORM_ACCOUNTS = LeasedKind("platform account", "platform_account_leases", "platform_service_account_id",
                               "platform_service_accounts")
KINDS = (SCOPES, PLATFORM_ACCOUNTS)


@dataclass(frozen=True)
class Ownership:
    """Who owns a scope after an acquisition attempt."""

    node_id: str
    epoch: int
    forward_address: str  # the owner's, for forwarding commands to it


async def register_node(conn: asyncpg.Connection, node_id: str, forward_address: str, ttl_seconds: float) -> None:
    await conn.execute(
        "INSERT INTO cluster_nodes (node_id, forward_address, lease_expires_at) "
        "VALUES ($1, $2, now() + make_interval(secs => $3)) "
        "ON CONFLICT (node_id) DO UPDATE SET forward_address = EXCLUDED.forward_address, started_at = now(), "
        "heartbeat_at = now(), lease_expires_at = EXCLUDED.lease_expires_at, stopped_at = NULL",
        node_id, forward_address, ttl_seconds)


async def renew_node(conn: asyncpg.Connection, node_id: str, ttl_seconds: float) -> bool:
    """Extend the node's lease; False if the row is gone or the node was marked stopped."""
    row = await conn.fetchrow(
        "UPDATE cluster_nodes SET heartbeat_at = now(), lease_expires_at = now() + make_interval(secs => $2) "
        "WHERE node_id = $1 AND stopped_at IS NULL RETURNING node_id", node_id, ttl_seconds)
    return row is not None


async def stop_node(conn: asyncpg.Connection, node_id: str) -> None:
    """A clean shutdown: everything this node owns is free at once (epochs kept).  A platform
    account's work goes on without a command, so the other nodes hear that accounts were freed
    and claim them now rather than at their next periodic pass."""
    freed_accounts = 0
    for kind in KINDS:
        result = await conn.execute(f"UPDATE {kind.table} SET node_id = NULL WHERE node_id = $1", node_id)
        if kind is PLATFORM_ACCOUNTS:
            freed_accounts = int(result.split()[-1])
    await conn.execute("UPDATE cluster_nodes SET stopped_at = now(), heartbeat_at = now(), lease_expires_at = now() "
                       "WHERE node_id = $1", node_id)
    if freed_accounts:
        await conn.execute("SELECT pg_notify($1, '*')", PLATFORM_CHANNEL)


async def acquire(conn: asyncpg.Connection, key: str, node_id: str, *, creating: bool = False,
                  kind: LeasedKind = SCOPES) -> Ownership:
    """Take the lease of `key` (a scope, or another `kind`) when it is free, held by
    a node whose lease ran out, or held by this node (a new epoch: this node's
    previous actor for it is over).  Otherwise report the live owner.  The update
    waits for the current owner's in-flight write transaction (its shared lock), so
    a live owner is read first, without a lock: asking who owns a busy scope never
    waits.  `creating`: the scope's row does not exist yet (its creation is the
    owner's first write)."""
    table, column = kind.table, kind.key
    held = await conn.fetchrow(
        f"SELECT l.node_id, l.epoch, n.forward_address FROM {table} l JOIN cluster_nodes n "
        f"ON n.node_id = l.node_id AND n.stopped_at IS NULL AND n.lease_expires_at > clock_timestamp() "
        f"WHERE l.{column} = $1 AND l.node_id <> $2", key, node_id)
    if held is not None:
        return Ownership(held["node_id"], held["epoch"], held["forward_address"])
    # Only what exists, or a scope being created, gets a lease row.
    row = await conn.fetchrow(
        f"INSERT INTO {table} AS l ({column}, node_id) SELECT $1, $2 "
        f"WHERE $3 OR EXISTS (SELECT 1 FROM {kind.owned_table} o WHERE o.id = $1) "
        f"ON CONFLICT ({column}) DO UPDATE SET node_id = EXCLUDED.node_id, epoch = l.epoch + 1, acquired_at = now() "
        f"WHERE l.node_id IS NULL OR l.node_id = EXCLUDED.node_id OR NOT EXISTS ("
        f"  SELECT 1 FROM cluster_nodes n WHERE n.node_id = l.node_id AND n.stopped_at IS NULL "
        f"  AND n.lease_expires_at > clock_timestamp()) "
        f"RETURNING node_id, epoch", key, node_id, creating)
    if row is not None:
        return Ownership(row["node_id"], row["epoch"], "")
    if not creating and not await conn.fetchval(
            f"SELECT EXISTS (SELECT 1 FROM {kind.owned_table} WHERE id = $1)", key):
        raise NotFound(kind.name)
    held = await conn.fetchrow(
        f"SELECT l.node_id, l.epoch, n.forward_address FROM {table} l "
        f"JOIN cluster_nodes n ON n.node_id = l.node_id WHERE l.{column} = $1", key)
    if held is None:  # released meanwhile: the next attempt takes it
        raise LeaseLost(f"the {kind.name}'s lease changed hands; retry")
    return Ownership(held["node_id"], held["epoch"], held["forward_address"])


async def acquire_free(conn: asyncpg.Connection, keys: list[str], node_id: str, *,
                       kind: LeasedKind = SCOPES) -> dict[str, int]:
    """`acquire` for many keys in one statement, taking only what needs no answer about
    another owner: the leases of existing keys that are free, held by a node whose
    lease ran out, or held by this node (a new epoch).  Returns the epoch of each key
    taken; a key a live node holds is left out (`acquire` names its owner).  Rows are
    locked in key order, as every batch does."""
    table, column = kind.table, kind.key
    live_elsewhere = ("SELECT 1 FROM cluster_nodes n WHERE n.node_id = {holder} AND n.stopped_at IS NULL "
                      "AND n.lease_expires_at > clock_timestamp()")
    rows = await conn.fetch(
        f"INSERT INTO {table} AS l ({column}, node_id) SELECT k, $2 FROM unnest($1::text[]) AS k "
        f"WHERE EXISTS (SELECT 1 FROM {kind.owned_table} o WHERE o.id = k) AND NOT EXISTS ("
        f" SELECT 1 FROM {table} h WHERE h.{column} = k AND h.node_id <> $2 "
        f" AND EXISTS ({live_elsewhere.format(holder='h.node_id')})) ORDER BY k "
        f"ON CONFLICT ({column}) DO UPDATE SET node_id = EXCLUDED.node_id, epoch = l.epoch + 1, acquired_at = now() "
        f"WHERE l.node_id IS NULL OR l.node_id = EXCLUDED.node_id OR NOT EXISTS ("
        f"{live_elsewhere.format(holder='l.node_id')}) "
        f"RETURNING l.{column} AS key, l.epoch", sorted(set(keys)), node_id)
    return {r["key"]: r["epoch"] for r in rows}


async def release(conn: asyncpg.Connection, key: str, node_id: str, epoch: int, *,
                  kind: LeasedKind = SCOPES) -> None:
    """An idle actor gives its scope back (the epoch stays, so it can never pass again)."""
    await conn.execute(f"UPDATE {kind.table} SET node_id = NULL WHERE {kind.key} = $1 AND node_id = $2 AND epoch = $3",
                       key, node_id, epoch)


def _fence_query(kind: LeasedKind, key: str = "$1", node: str = "$2", epoch: str = "$3") -> str:
    """True while (key, node, epoch) — by default ($1, $2, $3) — holds the lease; locks its row shared."""
    return (f"SELECT true FROM {kind.table} l WHERE l.{kind.key} = {key} AND l.node_id = {node} AND l.epoch = {epoch} "
            f"AND EXISTS (SELECT 1 FROM cluster_nodes n WHERE n.node_id = {node} AND n.stopped_at IS NULL "
            f"AND n.lease_expires_at > clock_timestamp()) FOR SHARE OF l")


async def pass_fence(conn: asyncpg.Connection, key: str, node_id: str, epoch: int, *,
                     kind: LeasedKind = SCOPES) -> None:
    """Inside a write transaction, before its first write: hold the lease row
    shared until commit and refuse a lost or expired lease (LeaseLost: the
    transaction must roll back, nothing of it commits)."""
    if not await conn.fetchval(_fence_query(kind), key, node_id, epoch):
        raise LeaseLost(f"this node no longer owns {kind.name} {key} (epoch {epoch})")


async def pass_fence_and_share_execution_state(
        conn: asyncpg.Connection, scope_id: str, node_id: str, epoch: int, workspace_id: str,
        extra: tuple[str, list] | None = None) -> tuple[dict[str, Any], list[asyncpg.Record]]:
    """`pass_fence` for a scope, then its workspace's execution state under a shared
    lock held until commit (`tenancy.execution_state_for_share`), in one round trip: the
    two gates a scope's write batch passes first.  The lease row is locked first (the
    subquery runs before the outer row's lock), as in two statements.  `extra` — a
    SELECT whose parameters start at $5, whose first column is never NULL, and its
    arguments — is read by the same statement (a batch's credential proofs): its rows
    come back with the gate."""
    rows = await conn.fetch(
        f"WITH lease AS ({_fence_query(SCOPES)}){f', extra AS ({extra[0]})' if extra else ''} "
        "SELECT (SELECT true FROM lease) AS lease_held, e.active_generation AS gate_generation, "
        f"e.write_fenced AS gate_write_fenced, e.state AS gate_state{', extra.*' if extra else ''} "
        f"FROM workspace_execution_states e {'LEFT JOIN extra ON true ' if extra else ''}"
        "WHERE e.workspace_id = $4 FOR SHARE OF e",
        scope_id, node_id, epoch, workspace_id, *(extra[1] if extra else ()))
    if not rows:
        raise NotFound("workspace")
    gate = rows[0]
    if not gate["lease_held"]:
        raise LeaseLost(f"this node no longer owns {SCOPES.name} {scope_id} (epoch {epoch})")
    return ({"active_generation": gate["gate_generation"], "write_fenced": gate["gate_write_fenced"],
             "state": gate["gate_state"]},
            [row for row in rows if extra and row[4] is not None])


def scope_write_gate(node_id: str, epoch: int, generations: list[int],
                     proof_digests: dict[CredentialProof, str]) -> Callable[[int], tuple[str, list]]:
    """For a scope's write that is one statement (no transaction around it): a SELECT,
    numbered from the `first` it is given, that yields a row only when every gate of
    `_apply_batch` passes — the lease held (its row locked shared first), the workspace's
    execution state active, unfenced and of each of `generations` (locked shared), and each
    cached context's credential rows unchanged since `proof_digests` were read.  The
    statement writes only from that row: no row, nothing written.  It names the scope's
    workspace `$1` and the scope `$2`."""
    def gate(first: int) -> tuple[str, list]:
        proofs = tenancy.proofs_unchanged(proof_digests, first + 3) if proof_digests else ("true", [])
        return (f"SELECT 1 FROM workspace_execution_states e WHERE e.workspace_id = $1 "
                f"AND EXISTS ({_fence_query(SCOPES, '$2', f'${first}', f'${first + 1}')}) "
                f"AND NOT e.write_fenced AND e.state = 'active' AND e.active_generation = ALL(${first + 2}::bigint[]) "
                f"AND {proofs[0]} FOR SHARE OF e",
                [node_id, epoch, generations, *proofs[1]])
    return gate


async def unowned_platform_accounts(conn: asyncpg.Connection, node_id: str) -> list[str]:
    """Platform accounts no live node owns, or this node's own (a restart with the same node id)."""
    return [row["id"] for row in await conn.fetch(
        "SELECT a.id FROM platform_service_accounts a "
        "LEFT JOIN platform_account_leases l ON l.platform_service_account_id = a.id "
        "WHERE l.node_id IS NULL OR l.node_id = $1 OR NOT EXISTS (SELECT 1 FROM cluster_nodes n "
        "WHERE n.node_id = l.node_id AND n.stopped_at IS NULL AND n.lease_expires_at > clock_timestamp()) "
        "ORDER BY a.id", node_id)]


async def node_is_live(conn: asyncpg.Connection, node_id: str) -> bool:
    return await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM cluster_nodes WHERE node_id = $1 AND stopped_at IS NULL "
        "AND lease_expires_at > clock_timestamp())", node_id)


async def other_live_nodes(conn: asyncpg.Connection, node_id: str) -> int:
    return await conn.fetchval(
        "SELECT count(*) FROM cluster_nodes WHERE node_id <> $1 AND stopped_at IS NULL "
        "AND lease_expires_at > clock_timestamp()", node_id)


async def live_nodes(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT n.node_id, n.forward_address, n.heartbeat_at, n.lease_expires_at, "
        "(SELECT count(*) FROM scope_leases l WHERE l.node_id = n.node_id) AS scopes "
        "FROM cluster_nodes n WHERE n.stopped_at IS NULL AND n.lease_expires_at > clock_timestamp() "
        "ORDER BY n.node_id")


async def forget_orphan_leases(conn: asyncpg.Connection) -> int:
    """Free lease rows of scopes that do not exist (a create that failed): nothing can
    hold them, so losing their epoch cannot let a writer through."""
    result = await conn.execute(
        "DELETE FROM scope_leases l WHERE l.node_id IS NULL AND NOT EXISTS (SELECT 1 FROM scopes s "
        "WHERE s.id = l.scope_id)")
    return int(result.split()[-1])


async def forget_stopped_nodes(conn: asyncpg.Connection, older_than_seconds: float) -> int:
    """Drop nodes stopped or expired long ago (their leases are released by the FK)."""
    result = await conn.execute(
        "DELETE FROM cluster_nodes WHERE lease_expires_at < now() - make_interval(secs => $1)", older_than_seconds)
    return int(result.split()[-1])
