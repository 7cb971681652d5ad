"""Measurement helpers shared by the benchmark scripts: CPU, memory and process trees
from /proc, a one-shot admin connection, and a description of the machine a run used."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
# What a harness process asks of one socket read.  Below glibc's mmap threshold (128 KiB):
# a larger `recv()` buffer is mapped, faulted in, shrunk with mremap and unmapped on every
# read, and the unmapping's TLB shootdown interrupts the other cores — the server's too.  A
# 300-byte frame sent and read over loopback cost 11.9 µs with a 256 KiB read against 2.3 µs
# with 64 KiB; 1,000 fanout subscribers in 4 processes took up to 1.4 cores.
RECV_BYTES = 64 * 1024


def _stat_fields(path: str) -> list[str]:
    """Fields of a /proc stat file after the command name (field 3 onwards)."""
    return Path(path).read_text().rpartition(")")[2].split()


def thread_cpu_seconds() -> dict[str, float]:
    """utime+stime of every thread of this process, keyed by thread name."""
    out: dict[str, float] = {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = _stat_fields(f"/proc/self/task/{tid}/stat")
        except OSError:
            continue
        name = names.get(int(tid), f"tid-{tid}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    return out


def process_tree_cpu_seconds(root_pid: int | None) -> float | None:
    """utime+stime of `root_pid` (the postmaster) and its live children (backends etc.),
    and of the children that exited (autovacuum workers, closed backends) as the
    kernel adds them to their parent's cutime+cstime once it waited for them."""
    if root_pid is None:
        return None
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    total = 0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(f"/proc/{entry}/stat")
        except OSError:
            continue
        if int(entry) == root_pid or int(fields[1]) == root_pid:
            total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total / CLK_TCK


def parent_pid(pid: int) -> int | None:
    try:
        return int(_stat_fields(f"/proc/{pid}/stat")[1])
    except (OSError, ValueError, IndexError):
        return None


def _pid_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name; None once the process is gone."""
    try:
        return _stat_fields(f"/proc/{pid}/stat")
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): tells a process from a later one with its pid."""
    fields = _pid_stat(pid)
    return int(fields[19]) if fields is not None else None


def proc_cpu_s(pid: int) -> float | None:
    """utime+stime of one process (not its children)."""
    fields = _pid_stat(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _pid_stat(int(entry))
            if fields is not None:
                children[int(fields[1])].append(int(entry))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            out.append(child)
            stack.append(child)
    return out


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields)
    return (total - idle) / CLK_TCK, total / CLK_TCK


def reaped_cpu_s(pid: int) -> float:
    """cutime+cstime of one process: the CPU of its children that exited and were waited
    for (with theirs) — a PostgreSQL autovacuum worker that lived and died within a
    measured window is only there."""
    fields = _pid_stat(pid)
    return (int(fields[13]) + int(fields[14])) / CLK_TCK if fields is not None else 0.0


def softirq_threads() -> list[int]:
    """The kernel's ksoftirqd threads: network receive work that a burst of sends leaves
    beyond the softirq budget runs there, charged to no process of the sender's."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text()
            except OSError:
                continue
            if comm.startswith("ksoftirqd/"):
                found.append(int(entry))
    return found


def tree_cpu_s(pids: list[int]) -> float:
    """utime+stime summed over `pids` (those still alive), with the children each reaped."""
    return sum(c + reaped_cpu_s(p) for p, c in ((p, proc_cpu_s(p)) for p in pids) if c is not None)


def merge_counters(items) -> dict[str, int]:
    """The sum of several {name: count} dicts."""
    out: collections.Counter[str] = collections.Counter()
    for item in items:
        out.update(item)
    return dict(out)


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def spread(values: list[float | None], digits: int = 3) -> dict[str, Any]:
    """Median and [min, max] over repeats (None where a repeat had none)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "all": values}
    return {"median": round(statistics.median(present), digits), "min": round(min(present), digits),
            "max": round(max(present), digits), "all": values}


def admin(dsn: str, fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
    """Run `fn` on one short-lived connection (setup and teardown, outside any measurement)."""
    async def main() -> Any:
        conn = await asyncpg.connect(dsn)
        try:
            return await fn(conn)
        finally:
            await conn.close()

    return asyncio.run(main())


async def pg_statements_top(pg: asyncpg.Connection, limit: int = 30) -> list[dict[str, Any]]:
    """The run's costliest statements (execution and planning time), all of them summed first."""
    rows = await pg.fetch(
        "SELECT calls, plans, round(total_exec_time::numeric, 1) AS total_ms, round(mean_exec_time::numeric, 3) "
        "AS mean_ms, round(total_plan_time::numeric, 1) AS plan_ms, rows, "
        "left(regexp_replace(query, '\\s+', ' ', 'g'), 220) AS query FROM pg_stat_statements "
        "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "ORDER BY total_exec_time + total_plan_time DESC LIMIT $1", limit)
    total = await pg.fetchrow(
        "SELECT sum(calls) AS calls, round(sum(total_exec_time)::numeric, 1) AS total_ms, "
        "round(sum(total_plan_time)::numeric, 1) AS plan_ms FROM pg_stat_statements "
        "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())")
    return [{"query": "(all statements)", "calls": int(total["calls"] or 0),
             "total_ms": float(total["total_ms"] or 0), "plan_ms": float(total["plan_ms"] or 0)}] + [
        {k: (float(v) if k.endswith("_ms") else v) for k, v in dict(r).items()} for r in rows]


def machine_info(packages: tuple[str, ...]) -> dict[str, Any]:
    cpu_model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for dist in packages:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    git = {}
    with contextlib.suppress(Exception):
        git["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       timeout=10, check=False).stdout.strip()
        git["dirty_files"] = [line[3:] for line in subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        ).stdout.splitlines()]
    return {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "mem_total_kib": int(Path("/proc/meminfo").read_text().split()[1]),
        "platform": platform.platform(),
        "python_version": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "python_executable": sys.executable,
        "gil_switch_interval_s": sys.getswitchinterval(),
        "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "packages": versions,
        "git": git,
    }


def write_document(benchmark: str, started: datetime.datetime, machine: dict[str, Any], args: Any,
                   result: dict[str, Any], internal: tuple[str, ...] = ()) -> dict[str, Any]:
    """The run's JSON document (timing, machine, parameters without the `internal` ones,
    the result), written to `args.output`."""
    finished = datetime.datetime.now(datetime.timezone.utc)
    doc = {"benchmark": benchmark, "timestamp": started.isoformat(), "finished_at": finished.isoformat(),
           "duration_s": round((finished - started).total_seconds(), 1), "machine": machine,
           "parameters": {k: v for k, v in vars(args).items() if k not in (*internal, "output")}
           | {"output": str(args.output)}, **result}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    return doc
