"""Benchmark: the CPU of one fanout publication against the bare socket writes it makes.

The fanout's cost at a low message rate is one publication per message to every
subscriber, on the event-loop thread (bench/fanout.py).  This measures that step alone:
in one process, --subscribers real loopback TCP connections, each with the server's own
per-connection objects — a `server.transport.WebSocket` on the accepted socket and a
`server.realtime.PushState` following one scope, its cursor at the scope's tail — and a
separate drain process reading every client end (so each write wakes a reader, as in a
deployment).  The PushStates' server and connection are stand-ins carrying only what
delivery reads (the hub, the push limits, a metrics counter, the WebSocket): no protocol,
no database, nothing else runs.

Per repeat, --publications times, alternating:

  hub       `FanoutHub.publish_many` of one publication — a lone message, or a run of
            --run-length consecutive messages (the shape a busy scope's batch publishes) —
            to every subscriber: the scope's in-step group (server/realtime.py ScopeGroup,
            which every subscriber here is in after the warm-up) and the write, the writes
            gathered and sent through io_uring in one call (server/send_ring.py, the
            server's default where the kernel allows it);
  send hub  the same with one `send()` per subscriber (`--fanout-writes send`);
  ceiling   a bare loop of `socket.send` of the same bytes to the same sockets.

Each side's thread CPU per publication (time.thread_time: not the time spent waiting
for a core) is the median over the repeat's publications; reported: hub ÷ ceiling per
repeat and its median with the spread, and the extra CPU per subscriber.  The ceiling is
the floor of what a server pays for these writes from Python with one `send()` each;
the io_uring hub can go below it (fewer system calls and no Python per send).

    python -m bench.publish                 # 5 repeats, lone messages and runs of 25
    python -m bench.publish --quick         # smoke run

Results go to bench/results/publish.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import protocol.frames  # noqa: E402,F401 - the protocol modules' import order, as the server loads them
from actors.fanout import CommittedEvent, FanoutHub  # noqa: E402
from bench.common import RECV_BYTES, machine_info, spread, write_document  # noqa: E402
from server.realtime import PushState, ScopeGroup  # noqa: E402
from server.send_ring import PublicationWrites, SendRing  # noqa: E402
from server.transport import WebSocket  # noqa: E402
from server.wire import server_frame  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "publish.json"
SCOPE, WORKSPACE = "scp_bench", "wsp_bench"
# Members the subscribers are signed in as (interned, as the server holds them).
MEMBERS = tuple(sys.intern(f"mem_bench{index}") for index in range(4))

DRAIN = """
import select, socket, sys
port, count, recv_bytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
poller = select.epoll()
by_fd = {}
for sock in socks:
    sock.setblocking(False)
    by_fd[sock.fileno()] = sock
    poller.register(sock.fileno(), select.EPOLLIN)
print("connected", flush=True)
while True:
    for fd, _ in poller.poll():
        try:
            if not by_fd[fd].recv(recv_bytes):
                sys.exit(0)
        except BlockingIOError:
            pass
"""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _connections(count: int) -> tuple[list[socket.socket], subprocess.Popen]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(count)
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, str(listener.getsockname()[1]), str(count), str(RECV_BYTES)],
                             stdout=subprocess.PIPE)
    accepted = []
    for _ in range(count):
        sock, _ = listener.accept()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as trio's listener sets it
        accepted.append(sock)
    listener.close()
    drain.stdout.readline()
    return accepted, drain


def _subscribers(hub: FanoutHub, socks: list[socket.socket], writes: PublicationWrites | None) -> None:
    config = types.SimpleNamespace(push_buffer_bytes=1 << 22, push_buffer_events=10_000)
    server = types.SimpleNamespace(hub=hub, config=config, metrics=types.SimpleNamespace(push_gap_replays=0),
                                   publication_writes=writes)
    if writes is not None:
        hub.flush_writes = writes.flush
    hub.group_factory = functools.partial(ScopeGroup, server)  # as the server sets it
    for index, sock in enumerate(socks):
        ws = WebSocket(sock, None, None, spawn=lambda *a, **k: None, max_message_bytes=1 << 20, close_grace=1.0)
        push = PushState(server, types.SimpleNamespace(ws=ws, id=f"conn{index}"), WORKSPACE,
                         MEMBERS[index % len(MEMBERS)])
        push.scope_cursors[SCOPE] = 0
        hub.follow_scope(push.subscription, SCOPE)


def _events(first_seq: int, count: int, frame: bytes) -> list[CommittedEvent]:
    events = []
    for seq in range(first_seq, first_seq + count):
        event = CommittedEvent("message.created", WORKSPACE, SCOPE, seq, seq, None)
        event.frames[False] = frame  # encoded once per event by its first recipient in the server
        events.append(event)
    return events


def measure(hubs: dict[str, FanoutHub], socks: list[socket.socket], frame: bytes, run_length: int,
            publications: int, next_seq: int, gap_s: float) -> tuple[dict[str, float], int]:
    """One repeat: `publications` publications of each hub and as many bare send loops, alternating."""
    roster = frozenset(MEMBERS)
    spent: dict[str, list[int]] = {side: [] for side in (*hubs, "ceiling")}
    joined = frame * run_length
    for _ in range(publications):
        for side, hub in hubs.items():
            items = [(event, roster) for event in _events(next_seq, run_length, frame)]
            started = time.thread_time_ns()
            hub.publish_many(items)
            spent[side].append(time.thread_time_ns() - started)
            time.sleep(gap_s)  # the readers drain: every write finds an empty socket, as at a low rate
        next_seq += run_length
        started = time.thread_time_ns()
        for sock in socks:
            sock.send(joined)
        spent["ceiling"].append(time.thread_time_ns() - started)
        time.sleep(gap_s)
    ms = {side: statistics.median(values) / 1e6 for side, values in spent.items()}
    result = {"ceiling_ms": round(ms["ceiling"], 3)}
    for side in hubs:
        prefix = "" if side == "hub" else "send_"
        result.update({f"{prefix}hub_ms": round(ms[side], 3), f"{prefix}ratio": round(ms[side] / ms["ceiling"], 3),
                       f"{prefix}extra_us_per_subscriber": round((ms[side] - ms["ceiling"]) * 1e3 / len(socks), 3)})
    return result, next_seq


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    socks, drain = _connections(args.subscribers)
    try:
        try:
            writes = PublicationWrites(SendRing.open())
        except OSError as exc:
            log(f"io_uring unavailable ({exc}): only the send() hub is measured")
            writes = None
        # Two hubs, each with its own PushStates on the same sockets: "hub" as the server runs
        # by default (io_uring where it can), "send hub" with one send() per subscriber.
        # Without io_uring the server's default is the send hub: that is "hub" then.
        hubs = {"hub": FanoutHub(), "send_hub": FanoutHub()} if writes is not None else {"hub": FanoutHub()}
        for side, hub in hubs.items():
            _subscribers(hub, socks, writes if side == "hub" else None)
        frame = server_frame(b"x" * args.payload_bytes, binary=False)
        shapes: dict[str, Any] = {}
        next_seq = 1
        for run_length in args.run_lengths:
            _, next_seq = measure(hubs, socks, frame, run_length, 20, next_seq, args.gap)  # warm-up
            repeats = []
            for repeat in range(args.repeats):
                result, next_seq = measure(hubs, socks, frame, run_length, args.publications, next_seq, args.gap)
                repeats.append(result)
                log(f"run of {run_length}, repeat {repeat}: " + ", ".join(
                    f"{side} {result[side + '_ms']} ms" for side in ("hub", "send_hub", "ceiling") if side + "_ms"
                    in result) + " per publication")
            shapes[str(run_length)] = {"run_length": run_length, "repeats": repeats,
                                       **{key: spread([r[key] for r in repeats]) for key in repeats[0]}}
        for hub in hubs.values():
            hub._groups[SCOPE].dissolve()  # each member's cursor where the group stands
            assert all(push.sink.scope_cursors[SCOPE] == next_seq - 1 for push in hub._by_scope[SCOPE]), \
                "a subscriber missed a publication"
        return {"frame_bytes": len(frame), "io_uring": writes is not None, "shapes": shapes}
    finally:
        if writes is not None:
            writes.close()
        drain.kill()
        drain.wait()
        for sock in socks:
            sock.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subscribers", type=int, default=1000, help="loopback connections (1000)")
    p.add_argument("--publications", type=int, default=300, help="publications per repeat and side (300)")
    p.add_argument("--repeats", type=int, default=5, help="repeats per shape (5)")
    p.add_argument("--run-lengths", type=lambda text: [int(x) for x in text.split(",")], default=[1, 25],
                   help="messages per publication, comma separated (1,25: a lone message, a busy batch)")
    p.add_argument("--payload-bytes", type=int, default=587, help="frame payload bytes (587: fanout.py's frame)")
    p.add_argument("--gap", type=float, default=0.005, help="seconds between publications (0.005)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 100 subscribers, 2 repeats of 50")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output ({DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    if args.quick:
        args.subscribers, args.repeats, args.publications = 100, 2, 50
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_info(("trio", "msgspec"))
    result = benchmark(args)
    write_document("publish", started, machine, args, result)
    print()
    for shape in result["shapes"].values():
        for prefix, label in (("", "hub (io_uring)" if result["io_uring"] else "hub (send)"), ("send_", "hub (send)")):
            if f"{prefix}hub_ms" not in shape:
                continue
            ratio = shape[f"{prefix}ratio"]
            print(f"run of {shape['run_length']:>3}: {label} {shape[prefix + 'hub_ms']['median']} ms, ceiling "
                  f"{shape['ceiling_ms']['median']} ms of thread CPU per publication to {args.subscribers}: "
                  f"{ratio['median']}x [{ratio['min']}-{ratio['max']}], "
                  f"{shape[prefix + 'extra_us_per_subscriber']['median']} us more per subscriber")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
