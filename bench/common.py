"""Measurement helpers shared by the benchmark scripts: CPU from /proc, a
one-shot admin connection, and a description of the machine a run used."""

from __future__ import annotations

import asyncio
import contextlib
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
    """utime+stime of `root_pid` (the postmaster) and its live children (backends etc.)."""
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
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def parent_pid(pid: int) -> int | None:
    try:
        return int(_stat_fields(f"/proc/{pid}/stat")[1])
    except (OSError, ValueError, IndexError):
        return None


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
