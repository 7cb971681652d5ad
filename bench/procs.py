"""The child processes of a benchmark: started so that they die with it, stopped with
whatever they leave behind (also after a failed run), their ready line read, and
(optionally) profiled with py-spy."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.common import descendants, start_time


def raise_nofile() -> int:
    """Raise this process's open-file limit to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the benchmark dies, however it dies (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


async def spawn(*argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(*argv, preexec_fn=die_with_parent, **kwargs)


class Procs:
    """Every process this benchmark starts, so all of them are stopped on the way out."""

    def __init__(self) -> None:
        self.items: list[asyncio.subprocess.Process] = []

    def add(self, proc: asyncio.subprocess.Process) -> asyncio.subprocess.Process:
        self.items.append(proc)
        return proc

    async def stop(self, proc: asyncio.subprocess.Process, grace: float = 20.0) -> None:
        if proc.returncode is None:
            # (pid, start time): a pid reused by an unrelated process is never signalled.
            tree = [(child, start_time(child)) for child in descendants(proc.pid)]
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            # Anything it left behind (e.g. a postmaster that outlived a SIGKILL): a few
            # seconds to go by itself (parent-death signal), then SIGKILL.
            for _ in range(50):
                if not any(start_time(pid) == started for pid, started in tree):
                    break
                await asyncio.sleep(0.1)
            for pid, started in tree:
                if started is not None and start_time(pid) == started:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        if proc in self.items:
            self.items.remove(proc)

    async def stop_all(self) -> None:
        for proc in list(self.items):
            with contextlib.suppress(Exception):
                await self.stop(proc)


async def run_or_failure(measure: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], failed: dict[str, Any],
                         procs: Procs) -> dict[str, Any]:
    """`measure(run)` on a fresh run dict, where it records the "stage" it is in.  If it raises:
    the traceback on stderr, every process stopped, and `failed` plus the error (with that stage)
    as the run's record, so that one failed run does not lose the others."""
    run: dict[str, Any] = {}
    try:
        return await measure(run)
    except Exception as exc:  # noqa: BLE001 - recorded in the run
        traceback.print_exc()
        await procs.stop_all()
        return {**failed, "error": f"{type(exc).__name__} during {run.get('stage')}: {exc}"[:500]}


async def read_ready(proc: asyncio.subprocess.Process, prefix: str, timeout: float, log: Path | None = None) -> str:
    """The last word of the first stdout line that starts with `prefix` (a server's "... ready on
    URL"); the rest of its stdout is read and dropped in the background, so the pipe never fills.
    `log`: where its stderr goes, named in the error if it exits first."""
    async def read() -> str:
        while True:
            line = await proc.stdout.readline()
            if not line:
                see = f"; see {log}" if log is not None else ""
                raise RuntimeError(f"server exited before '{prefix}' (code {await proc.wait()}){see}")
            text = line.decode().strip()
            if text.startswith(prefix):
                return text.rsplit(" ", 1)[1]

    url = await asyncio.wait_for(read(), timeout)
    _background(_discard_lines(proc.stdout))
    return url


_BACKGROUND: set[asyncio.Task] = set()


def _background(coro: Any) -> None:
    """A fire-and-forget task that is kept referenced until it ends."""
    task = asyncio.create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def _discard_lines(stream: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await stream.readline():
            pass


# ============================================================================ py-spy (optional)

async def start_py_spy(pid: int, seconds: float, out: Path):
    """`py-spy record` of `pid` for `seconds` into `out` (raw format); None when py-spy is not installed."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return None
    proc = await spawn(
        exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "100",
        "--format", "raw", "--output", str(out),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, out


async def finish_py_spy(proc: asyncio.subprocess.Process, out: Path) -> dict[str, Any]:
    """Wait for a start_py_spy() recording and summarize it: the top frames by self and inclusive share."""
    try:
        await asyncio.wait_for(proc.wait(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
    if not out.exists():
        return {"error": "no profile written"}
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_time[_short_frame(frames[-1])] += n
        for name in {_short_frame(f) for f in frames}:
            inclusive[name] += n
    return {"file": str(out), "samples": total,
            "self_top": [(k, round(100 * v / total, 1)) for k, v in self_time.most_common(25)] if total else [],
            "inclusive_top": [(k, round(100 * v / total, 1)) for k, v in inclusive.most_common(40)] if total else []}


def _short_frame(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (to/file.py)"
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if parts else path
    return f"{name} ({short})"
