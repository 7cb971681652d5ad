"""A load tool to point at any scopewire deployment: fanout and send latency at an
offered rate, with a progress bar while it runs, a JSON report and a PNG plot.

    python -m bench.load --url ws://host:8765 --api-key "$SCOPEWIRE_API_KEY" [--scope-id S] \\
        [--subscribers 50] [--senders 4] [--rate 20] [--duration 30] [--payload 200] \\
        [--output load.json] [--plot load.png]

Every connection authenticates with the one API key: --subscribers connections
follow the scope, --senders connections send `message.send` into it at --rate
messages/s in all, open loop (on schedule whether or not earlier sends were
answered, at most --max-in-flight unanswered).  Without --scope-id the key's
member creates a channel `load-<unix time>` for the run (it needs
`channel.create`); it is left in place, as are the messages.

Measured: send → acknowledgement per send (refusals counted by error code),
send → receive per delivery (each message's content starts with its send time;
one clock, so run the tool on one machine), deliveries received / expected,
per second of the run the sends, deliveries and latency percentiles, and this
tool's own CPU: a tool process near one busy core measures its own queueing
as well (the report warns; run fewer subscribers per process).

The plot shows the delivery latency over the run (p50, p99 and max per second)
and its distribution.  matplotlib and tqdm come with the test extras.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from client.trio_client import ClientError, Connection, connect

TS_PREFIX = "load ts="
TS_DIGITS = 19  # time.time_ns()


@dataclass
class LoadConfig:
    url: str
    api_key: str
    scope_id: str | None = None
    subscribers: int = 50
    senders: int = 4
    rate: float = 20.0
    duration: float = 30.0
    payload: int = 200
    max_in_flight: int = 1000
    drain_timeout: float = 10.0
    progress: bool = True


@dataclass
class _Run:
    """What the tasks record (offsets: seconds since the window opened)."""
    start_ns: int = 0
    sent: list[float] = field(default_factory=list)  # offsets of sends attempted
    acks: list[tuple[float, float]] = field(default_factory=list)  # (offset, ack ms)
    refused: Counter = field(default_factory=Counter)
    deliveries: list[tuple[float, float]] = field(default_factory=list)  # (offset received, latency ms)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p90/p99 and max (None without values)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3)
    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "max": round(ordered[-1], 3)}


async def _authenticated(url: str, api_key: str, stack) -> tuple[Connection, dict]:
    conn = await stack.enter_async_context(connect(url))
    return conn, await conn.auth(api_key=api_key)


async def _subscriber(conn: Connection, run: _Run, received: list[int]) -> None:
    while True:
        event = await conn.next_event()
        if event.get("event") != "message.created":
            continue
        content = event["data"].get("content", "")
        if not content.startswith(TS_PREFIX):
            continue
        now = time.time_ns()
        sent_ns = int(content[len(TS_PREFIX):len(TS_PREFIX) + TS_DIGITS])
        run.deliveries.append(((now - run.start_ns) / 1e9, (now - sent_ns) / 1e6))
        received[0] += 1


async def _send_one(conn: Connection, fields: dict, run: _Run, slots: trio.Semaphore) -> None:
    sent_ns = time.time_ns()
    content = f"{TS_PREFIX}{sent_ns:0{TS_DIGITS}d} "
    content += "x" * max(0, fields.pop("payload") - len(content))
    try:
        await conn.call("message.send", content=content, **fields)
        done = time.time_ns()
        run.acks.append(((done - run.start_ns) / 1e9, (done - sent_ns) / 1e6))
    except ClientError as exc:
        run.refused[exc.code] += 1
    finally:
        slots.release()


async def _send_window(config: LoadConfig, senders: list[Connection], fields: dict, run: _Run) -> None:
    """Open loop: send i leaves at i / rate, round robin over the sender connections."""
    slots = trio.Semaphore(config.max_in_flight)
    total = int(config.rate * config.duration)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for index in range(total):
            await trio.sleep_until(start + index / config.rate)
            try:
                slots.acquire_nowait()
            except trio.WouldBlock:
                run.refused["client_in_flight_limit"] += 1
                continue
            run.sent.append((time.time_ns() - run.start_ns) / 1e9)
            nursery.start_soon(_send_one, senders[index % len(senders)], {**fields, "payload": config.payload},
                               run, slots)


async def run_load(config: LoadConfig) -> dict[str, Any]:
    """Run one load against `config.url` and return the report."""
    run = _Run()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    async with AsyncExitStack() as stack:
        first, identity = await _authenticated(config.url, config.api_key, stack)
        workspace_id = identity.get("workspace_id")
        if workspace_id is None:
            raise SystemExit("the API key must belong to a workspace member")
        ws = {"workspace_id": workspace_id}
        scope_id = config.scope_id
        if scope_id is None:
            channel = await first.call("channel.create", slug=f"load-{int(time.time())}", display_name="Load test",
                                       visibility="public", member_ids=[], **ws)
            scope_id = channel["id"]
        subscribers = [first] + [(await _authenticated(config.url, config.api_key, stack))[0]
                                 for _ in range(config.subscribers - 1)]
        senders = [(await _authenticated(config.url, config.api_key, stack))[0] for _ in range(config.senders)]
        for conn in subscribers:
            await conn.call("subscribe", scopes=[{"scope_id": scope_id}], **ws)
        received = [0]
        async with trio.open_nursery() as nursery:
            run.start_ns = time.time_ns()
            for conn in subscribers:
                nursery.start_soon(_subscriber, conn, run, received)
            bar = _progress(config)
            async with trio.open_nursery() as window:
                window.start_soon(_send_window, config, senders, {"scope_id": scope_id, **ws}, run)
                window.start_soon(_show_progress, bar, run, config.duration)
            # Drain: until every acknowledged send reached every subscriber, or no delivery for a while.
            last, quiet_since = -1, trio.current_time()
            while received[0] < len(run.acks) * len(subscribers):
                if received[0] != last:
                    last, quiet_since = received[0], trio.current_time()
                elif trio.current_time() - quiet_since > config.drain_timeout:
                    break
                await trio.sleep(0.05)
            wall_s = (time.time_ns() - run.start_ns) / 1e9
            if bar is not None:
                bar.close()
            nursery.cancel_scope.cancel()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    report = _report(config, scope_id, run, wall_s, cpu_s)
    report["_deliveries_ms"] = [ms for _, ms in run.deliveries]  # for the plot, not the JSON
    return report


def _progress(config: LoadConfig):
    if not config.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=round(config.duration), unit="s", desc="load", bar_format="{l_bar}{bar}| {n}/{total} s {postfix}")


async def _show_progress(bar, run: _Run, duration: float) -> None:
    if bar is None:
        return
    for second in range(1, round(duration) + 1):
        await trio.sleep(1.0)
        recent = [ms for offset, ms in run.deliveries[-5000:] if offset > second - 1]
        bar.set_postfix(sent=len(run.sent), acked=len(run.acks), delivered=len(run.deliveries),
                        p99_ms=percentiles(recent)["p99"], refresh=False)
        bar.update(1)


def _report(config: LoadConfig, scope_id: str, run: _Run, wall_s: float, cpu_s: float) -> dict[str, Any]:
    expected = len(run.acks) * config.subscribers
    seconds = max(1, math.ceil(max([o for o, _ in run.deliveries] + [o for o, _ in run.acks] + [0.0])))
    latencies_by_second: list[list[float]] = [[] for _ in range(seconds)]
    for offset, ms in run.deliveries:
        latencies_by_second[min(int(offset), seconds - 1)].append(ms)
    sent_by_second = Counter(int(offset) for offset in run.sent)
    per_second = [{"t": second, "sent": sent_by_second[second], "delivered": len(latencies),
                   **percentiles(latencies)} for second, latencies in enumerate(latencies_by_second)]
    busy = cpu_s / wall_s if wall_s else 0.0
    return {
        "tool": "bench.load", "config": {**asdict(config), "api_key": "(hidden)", "scope_id": scope_id},
        "wall_s": round(wall_s, 3),
        "sends": {"offered": int(config.rate * config.duration), "attempted": len(run.sent),
                  "acknowledged": len(run.acks), "refused": dict(run.refused),
                  "ack_ms": percentiles([ms for _, ms in run.acks])},
        "deliveries": {"expected": expected, "received": len(run.deliveries),
                       "fraction": round(len(run.deliveries) / expected, 4) if expected else None,
                       "per_s": round(len(run.deliveries) / wall_s, 1) if wall_s else None,
                       "latency_ms": percentiles([ms for _, ms in run.deliveries])},
        "per_second": per_second,
        "tool_cpu_busy": round(busy, 3),
        "warning": ("this tool kept about one core busy: its own queueing is in the latencies; "
                    "use fewer subscribers per process") if busy > 0.9 else None,
    }


def plot(report: dict[str, Any], deliveries_ms: list[float] | None, path: Path) -> None:
    """Latency over time (p50, p99, max per second) and the latency distribution, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (over_time, distribution) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    rows = [r for r in report["per_second"] if r["p50"] is not None]
    for key, style in (("p50", "-"), ("p99", "--"), ("max", ":")):
        over_time.plot([r["t"] for r in rows], [r[key] for r in rows], style, label=key)
    over_time.set(xlabel="second of the run", ylabel="send → receive (ms)", title="Delivery latency over time")
    over_time.legend()
    if deliveries_ms:
        distribution.hist(deliveries_ms, bins=60, log=True)
    distribution.set(xlabel="send → receive (ms)", ylabel="deliveries", title="Latency distribution")
    latency = report["deliveries"]["latency_ms"]
    figure.suptitle(f"{report['config']['subscribers']} subscribers × {report['config']['rate']:g} msg/s: "
                    f"p50 {latency['p50']} ms, p99 {latency['p99']} ms, "
                    f"{report['deliveries']['received']:,} of {report['deliveries']['expected']:,} delivered")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True, help="the server's WebSocket URL, e.g. ws://127.0.0.1:8765")
    p.add_argument("--api-key", required=True, help="an API key of a member of the workspace to load")
    p.add_argument("--scope-id", help="the scope to send into and follow (default: a new channel)")
    p.add_argument("--subscribers", type=int, default=50, help="connections following the scope (50)")
    p.add_argument("--senders", type=int, default=4, help="connections sending (4)")
    p.add_argument("--rate", type=float, default=20.0, help="messages per second, all senders together (20)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of sending (30)")
    p.add_argument("--payload", type=int, default=200, help="content characters (200)")
    p.add_argument("--max-in-flight", type=int, default=1000, help="unanswered sends at most (1000)")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="stop waiting after this long idle (10 s)")
    p.add_argument("--output", type=Path, default=Path("load.json"), help="JSON report (load.json)")
    p.add_argument("--plot", type=Path, default=Path("load.png"), help="PNG plot (load.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.subscribers < 1 or args.senders < 1 or args.rate <= 0 or args.duration <= 0:
        p.error("--subscribers and --senders must be at least 1, --rate and --duration positive")
    config = LoadConfig(url=args.url, api_key=args.api_key, scope_id=args.scope_id, subscribers=args.subscribers,
                        senders=args.senders, rate=args.rate, duration=args.duration, payload=args.payload,
                        max_in_flight=args.max_in_flight, drain_timeout=args.drain_timeout,
                        progress=not args.no_progress)
    report = trio.run(run_load, config)
    write(report, args.output, args.plot)


def write(report: dict[str, Any], output: Path, plot_path: Path) -> None:
    deliveries_ms = report.pop("_deliveries_ms", None)
    output.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, deliveries_ms, plot_path)
    sends, deliveries = report["sends"], report["deliveries"]
    print(f"sends: {sends['acknowledged']}/{sends['attempted']} acknowledged, refused {sends['refused'] or 0}, "
          f"ack p50 {sends['ack_ms']['p50']} p99 {sends['ack_ms']['p99']} ms")
    print(f"deliveries: {deliveries['received']}/{deliveries['expected']} ({deliveries['per_s']}/s), "
          f"latency p50 {deliveries['latency_ms']['p50']} p99 {deliveries['latency_ms']['p99']} "
          f"max {deliveries['latency_ms']['max']} ms")
    if report["warning"]:
        print(f"warning: {report['warning']}")
    print(f"wrote {output} and {plot_path}")


if __name__ == "__main__":
    main()
