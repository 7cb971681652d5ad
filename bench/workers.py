"""The parent's side of the benchmarks' client processes (e.g. bench/fanout.py --role
subscribers): commands on their stdin, one per line; on their stdout, JSON lines that are
either progress ({"p": ...}) or a phase reply ({"phase": ...})."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.procs import Procs


@dataclass
class Worker:
    proc: asyncio.subprocess.Process
    progress: int = 0  # measured deliveries so far
    warm: int = 0      # deliveries of earlier (warmup) messages so far
    phases: asyncio.Queue = field(default_factory=asyncio.Queue)
    reader: asyncio.Task | None = None

    @classmethod
    def started(cls, proc: asyncio.subprocess.Process) -> Worker:
        """A worker for `proc` that is already reading its stdout."""
        w = cls(proc)
        w.reader = asyncio.create_task(w.read())
        return w

    async def read(self) -> None:
        while True:
            try:
                line = await self.proc.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError) as exc:
                await self.phases.put({"phase": "unreadable", "error": str(exc)})
                return
            if not line:
                await self.phases.put({"phase": "exit"})
                return
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "p" in msg:
                self.on_progress(msg)
            else:
                await self.phases.put(msg)

    def on_progress(self, msg: dict[str, Any]) -> None:
        self.progress = msg["p"]
        self.warm = msg["w"]

    async def command(self, text: str) -> None:
        self.proc.stdin.write((text + "\n").encode())
        await self.proc.stdin.drain()

    async def expect(self, phase: str, timeout: float) -> dict[str, Any]:
        msg = await asyncio.wait_for(self.phases.get(), timeout)
        if msg.get("phase") != phase:
            raise RuntimeError(f"client process: expected {phase}, got {msg}")
        return msg


async def command_all(workers: list[Worker], text: str) -> None:
    for w in workers:
        await w.command(text)


async def expect_all(workers: list[Worker], phase: str, timeout: float) -> list[dict[str, Any]]:
    """Each worker's next phase reply, which must be `phase` (in worker order)."""
    return [await w.expect(phase, timeout) for w in workers]


async def collect_reports(workers: list[Worker]) -> list[dict[str, Any]]:
    await command_all(workers, "report")
    return await expect_all(workers, "report", 120)


async def stop_workers(procs: Procs, workers: list[Worker]) -> None:
    for w in workers:
        await procs.stop(w.proc, grace=10)
        if w.reader:
            w.reader.cancel()


async def open_window(workers: list[Worker], duration: float) -> int:
    """Tell the workers the measured window (`measure T0 T1`: T0 0.3 s from now, `duration` s
    long, ns since the epoch) and sleep until just before T0; returns T0."""
    t0 = time.time_ns() + 300_000_000
    t1 = t0 + int(duration * 1e9)
    await command_all(workers, f"measure {t0} {t1}")
    await asyncio.sleep(max(0.0, (t0 - time.time_ns()) / 1e9 - 0.05))
    return t0


async def wait_for_deliveries(workers: list[Worker], sender: Any, sent: int, subscribers: int, stall: float,
                              timeout: float, give_up: Callable[[], Any] = lambda: None) -> None:
    """The drain after `sent` sends of `sender` (a bench/fanout.py Sender): until every send it did
    not see refused reached every subscriber (the workers' progress), or no progress for `stall` s,
    or `timeout` s, or `give_up()` is true."""
    started = time.monotonic()
    last_total, last_change = -1, time.monotonic()
    while True:
        await asyncio.sleep(0.25)
        total = sum(w.progress for w in workers)
        expected = (sent - sender.answered()[1]) * subscribers
        if total != last_total:
            last_total, last_change = total, time.monotonic()
        if total >= expected or give_up():
            return
        if time.monotonic() - last_change > stall or time.monotonic() - started > timeout:
            return
