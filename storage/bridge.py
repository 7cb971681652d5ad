"""The trio ↔ asyncpg bridge.

asyncpg only runs on asyncio.  A dedicated thread runs an asyncio+uvloop loop
that owns the asyncpg pool.  A trio task hands over a whole unit of work (one
coroutine function that runs a complete transaction) in one crossing and
sleeps; results come back through the trio token.  Crossings are batched in
both directions: a burst of submissions costs one loop wakeup, a burst of
completions costs one trio wakeup (measured: a crossing per statement costs
21–43% of throughput, so repositories never cross per statement).

Cancellation: a cancelled trio task cancels its asyncio task; asyncpg then
sends a cancel request to the server and the transaction rolls back before the
connection goes back to the pool.  The trio task waits for that to finish, so a
cancelled unit of work has really stopped when `Cancelled` is raised.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import asyncpg
import outcome
import trio
import uvloop

from storage.errors import DatabaseUnavailable

# The longest a trio thread waits, the GIL released, for the loop thread to start a unit
# handed over (run_overlapping): normally the loop thread's wakeup, ~0.1 ms.
HAND_OVER_SECONDS = 0.002
# Far above any pause between two statements of one unit of work here.
IDLE_IN_TRANSACTION_MS = 15_000
# A whole transaction's bound (PostgreSQL 17+): it also ends one that a frozen process left in
# the middle of a statement's messages (asyncpg prepares a statement in its own round trip),
# where the idle timeout does not apply.  Migrations lift it for their own transactions.
TRANSACTION_TIMEOUT_MS = 60_000

log = logging.getLogger("scopewire.db")

T = TypeVar("T")
UnitOfWork = Callable[..., Awaitable[T]]

# Errors that mean "the connection or server is gone", not "your query is wrong".
# Seen when the postmaster is killed under load: a connection dying mid-protocol
# leaves asyncpg's state machine stuck (InternalClientError "cannot switch to
# state N; another operation is in progress"), a failed ROLLBACK replaces the
# original error with InterfaceError, and during the restart the server answers
# CannotConnectNow (recovery) or TooManyConnections (backends not yet gone).
_CONNECTION_ERRORS = (
    asyncpg.exceptions.PostgresConnectionError,  # SQLSTATE class 08, e.g. ConnectionDoesNotExistError
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,  # includes ConnectionError and asyncio.TimeoutError
)


def _translate(exc: BaseException) -> BaseException:
    if isinstance(exc, _CONNECTION_ERRORS) and not isinstance(exc, asyncpg.exceptions.InterfaceWarning):
        unavailable = DatabaseUnavailable(f"database unavailable: {type(exc).__name__}: {exc}")
        unavailable.__cause__ = exc
        return unavailable
    return exc


class _Job:
    __slots__ = ("fn", "args", "kwargs", "mode", "trio_task", "asyncio_task", "cancel_requested", "result",
                 "handed_over")

    def __init__(self, fn: UnitOfWork, args: tuple, kwargs: dict, mode: str, trio_task: Any) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.mode = mode  # "transaction" | "connection" | "loop" (no connection)
        self.trio_task = trio_task
        self.asyncio_task: asyncio.Task | None = None
        self.cancel_requested = False
        self.result: outcome.Outcome | None = None
        # Held while the submitting trio thread waits for the loop thread to start the unit.
        self.handed_over: threading.Lock | None = None


@dataclass(frozen=True)
class Notification:
    channel: str
    payload: str | None
    # True on the first item after the listening connection was re-established:
    # notifications sent while it was down are lost, so consumers must resync.
    resync: bool = False


class ResyncOnOverflow:
    """The trio side of a hand-over from an asyncio loop into a bounded memory channel
    (LISTEN here, the NATS bus in server/bus_nats.py).  The loop must never wait for
    trio's consumer, so an item that does not fit is dropped, and the next one that
    fits carries resync=True: the consumer then knows to catch up from durable state.
    Items are frozen dataclasses with a `resync` field."""

    def __init__(self, send: trio.MemorySendChannel[Any]) -> None:
        self._send = send
        self._pending_resync = False  # an item was dropped since the last one handed over

    def offer(self, item: Any) -> bool:
        """Hand `item` over, or drop it when the channel is full; False once the channel
        is closed (everything after it is dropped too)."""
        if self._pending_resync and not item.resync:
            item = replace(item, resync=True)
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            self._pending_resync = True
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        else:
            self._pending_resync = False
        return True


async def lift_transaction_bound(conn: asyncpg.Connection) -> None:
    """For the rest of this transaction, no TRANSACTION_TIMEOUT_MS: one whose size grows with
    the deployment (a migration's data step, a platform account's delete across every workspace)."""
    if conn.get_server_version().major >= 17:
        await conn.execute("SET LOCAL transaction_timeout = 0")


class _PooledConnection(asyncpg.Connection):
    """A pooled connection released without asyncpg's reset statement.

    asyncpg sends `pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL` on every
    release: one more round trip and four statements per unit of work, i.e. per command
    served.  Nothing here leaves session state on a pooled connection — settings are
    `SET LOCAL`, advisory locks are transaction-scoped (the migration lock is released in
    its `finally`), cursors live inside transactions and LISTEN has its own connection —
    and asyncpg still rolls back a transaction left open before the connection is reused.
    """

    def get_reset_query(self) -> str:
        return ""


@dataclass(frozen=True)
class PoolSettings:
    min_size: int = 2
    max_size: int = 20
    command_timeout: float | None = 60.0
    connect_timeout: float = 10.0


class Database:
    """One asyncpg pool on its own asyncio thread, used from trio."""

    def __init__(self, dsn: str, settings: PoolSettings = PoolSettings()) -> None:
        self.dsn = dsn
        self.settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: asyncpg.Pool | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._submissions: collections.deque[_Job] = collections.deque()
        self._submit_wake_pending = False
        self._completions: collections.deque[_Job] = collections.deque()
        self._complete_wake_pending = False
        # Loop side: units that need a pooled connection wait here, not as asyncio tasks
        # queued on the pool, until one of the pool's max_size connections is theirs (see
        # _start_or_queue).
        self._waiting_for_connection: collections.deque[_Job] = collections.deque()
        self._units_holding_connection = 0
        self._closed = False
        # Units handed over and not yet completed (waiting for a pooled connection or running).
        self.units_in_flight = 0

    # --- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        started = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(started,), name="scopewire-db", daemon=True)
        self._thread.start()
        await trio.to_thread.run_sync(started.wait)
        try:
            await self._call_on_loop(self._open_pool)
        except BaseException:
            await self._stop_thread()
            raise

    async def aclose(self) -> None:
        """Close every connection (gracefully, then by force) and stop the thread."""
        if self._closed or self._loop is None:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            try:
                await self._call_on_loop(self._close_pool)
            finally:
                await self._stop_thread()

    async def __aenter__(self) -> Database:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _thread_main(self, started: threading.Event) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        started.set()
        try:
            loop.run_forever()
        finally:
            try:
                self._finish_leftover_tasks(loop)
            finally:
                loop.close()

    @staticmethod
    def _finish_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
        # A task still pending when the loop stops (a LISTEN keeper whose owner was
        # cancelled before its exit ran) would be destroyed later by the garbage
        # collector, logging an error into whatever runs then; end it here instead.
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.wait(leftover, timeout=5))
        loop.run_until_complete(loop.shutdown_asyncgens())

    async def _stop_thread(self) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        await trio.to_thread.run_sync(self._thread.join)

    async def _open_pool(self) -> None:
        # A transaction left open by a frozen process (SIGSTOP, a stalled VM) would hold
        # its locks — a scope lease's among them — until it resumed; PostgreSQL ends it.
        settings = {"application_name": "scopewire",
                    "idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_MS)}
        probe = await asyncpg.connect(self.dsn, timeout=self.settings.connect_timeout)
        try:
            if probe.get_server_version().major >= 17:  # older servers refuse the unknown setting
                settings["transaction_timeout"] = str(TRANSACTION_TIMEOUT_MS)
        finally:
            await probe.close()
        self._pool = await asyncpg.create_pool(
            self.dsn,
            min_size=self.settings.min_size,
            max_size=self.settings.max_size,
            command_timeout=self.settings.command_timeout,
            timeout=self.settings.connect_timeout,
            server_settings=settings,
            # Pooled connections stay open however long they idle (asyncpg closes them after 300 s):
            # a fresh backend introspects the types again (~18 ms of planning each), prepares every
            # statement again and warms its catalog caches — what a burst after five quiet minutes
            # paid (bench/broadcast.py's cold runs: 0.7 s of introspection planning alone).
            max_inactive_connection_lifetime=0,
            connection_class=_PooledConnection,
        )

    async def _close_pool(self) -> None:
        if self._pool is None:
            return
        try:
            await asyncio.wait_for(self._pool.close(), timeout=10)
        except (asyncio.TimeoutError, Exception):
            log.warning("pool did not close in time; terminating connections")
            self._pool.terminate()

    # --- running units of work -------------------------------------------------------

    async def run(self, fn: UnitOfWork[T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(conn, *args, **kwargs)` with a pooled connection, outside a transaction."""
        return await self._submit(fn, args, kwargs, "connection")

    async def transaction(self, fn: UnitOfWork[T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(conn, *args, **kwargs)` inside one transaction (committed if fn returns)."""
        return await self._submit(fn, args, kwargs, "transaction")

    async def run_overlapping(self, meanwhile: Callable[[], None] | None, fn: UnitOfWork[T], *args: Any,
                              **kwargs: Any) -> T:
        """Like `run`, for a unit on a serial critical path (a scope actor's commit): this
        thread hands the unit over, runs `meanwhile()` (whose work overlaps the database's),
        then lets the loop thread start the unit before it goes on."""
        return await self._submit(fn, args, kwargs, "connection", meanwhile, hand_over=True)

    async def on_loop(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run a pool-less coroutine on the bridge's asyncio loop: for other asyncio-only
        clients (the NATS bus transport) that should share its thread."""
        return await self._call_on_loop(fn)

    async def _call_on_loop(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run a pool-less coroutine on the loop (lifecycle operations)."""

        return await self._submit(fn, (), {}, "loop")

    async def _submit(self, fn: UnitOfWork[T], args: tuple, kwargs: dict, mode: str,
                      meanwhile: Callable[[], None] | None = None, hand_over: bool = False) -> T:
        if self._loop is None or (self._closed and mode != "loop"):
            raise DatabaseUnavailable("database bridge is not running")
        job = _Job(fn, args, kwargs, mode, trio.lowlevel.current_task())
        # Read through this local only: the loop thread clears job.handed_over when it releases it.
        handed_over = None
        if hand_over:
            handed_over = job.handed_over = threading.Lock()
            handed_over.acquire()
        self._submissions.append(job)
        self.units_in_flight += 1
        try:
            if not self._submit_wake_pending:
                self._submit_wake_pending = True
                self._loop.call_soon_threadsafe(self._drain_submissions)
            if meanwhile is not None:
                try:
                    meanwhile()
                except Exception:  # the job is already submitted: it must still be awaited
                    log.exception("work overlapping a database unit failed")
            if handed_over is not None:
                # Block this thread, the GIL released, until the loop thread has started the
                # unit.  Otherwise the loop thread, woken while this one works through a burst
                # (the replies of the batch before), gets the GIL only once the burst is over:
                # each syscall here drops it, but this thread takes it back before the woken one
                # runs (bench/ws_send.py hot: wait to start p90 2.6 → 0.16 ms).  After
                # `meanwhile`, not before: a publication's sends release the GIL for
                # milliseconds, time enough for the loop thread to start the unit.
                handed_over.acquire(timeout=HAND_OVER_SECONDS)

            def abort(_: Any) -> trio.lowlevel.Abort:
                # Never abandon the job: wait until the loop side has really stopped it.
                job.cancel_requested = True
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._cancel_on_loop, job)
                return trio.lowlevel.Abort.FAILED

            await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            self.units_in_flight -= 1
        assert job.result is not None
        if job.cancel_requested and isinstance(job.result, outcome.Error) and isinstance(
            job.result.error, asyncio.CancelledError
        ):
            await trio.lowlevel.checkpoint()  # raises the pending trio.Cancelled
            raise DatabaseUnavailable("unit of work was cancelled")
        return job.result.unwrap()

    @property
    def units_waiting_for_connection(self) -> int:
        """Units queued for a pooled connection (read from the trio thread: a snapshot)."""
        return len(self._waiting_for_connection)

    def pool_figures(self) -> dict[str, int]:
        """Pool connections (open, idle, maximum) for metrics.  Read from the trio
        thread while the loop thread owns the pool: a momentary snapshot."""
        pool = self._pool
        if pool is None:
            return {"open": 0, "idle": 0, "max": self.settings.max_size}
        return {"open": pool.get_size(), "idle": pool.get_idle_size(), "max": pool.get_max_size()}

    # --- loop side -------------------------------------------------------------------

    def _drain_submissions(self) -> None:
        self._submit_wake_pending = False
        assert self._loop is not None
        while self._submissions:
            job = self._submissions.popleft()
            if job.cancel_requested:
                self._hand_over(job)
                self._complete(job, outcome.Error(asyncio.CancelledError()))
                continue
            self._start_or_queue(job)

    @staticmethod
    def _hand_over(job: _Job) -> None:
        """The loop thread runs `job` now (or it never will): its submitter may go on."""
        if job.handed_over is not None:
            job.handed_over.release()
            job.handed_over = None

    def _start_or_queue(self, job: _Job) -> None:
        """Start `job` now, or queue it until a pooled connection is free.

        At most max_size units can hold a connection, so a unit started beyond that
        would only wait inside pool.acquire() — the same FIFO wait — but as an asyncio
        task with its coroutine, the pool's waiter future and queue entries (~2.5 KB
        by tracemalloc), which a burst of commands allocates at once and frees between
        the long-lived objects allocated meanwhile, fragmenting the allocator's arenas
        (bench/fanout.py, 1,000 subscribes at once: 16.9 → 15.2 KiB of server RSS per
        subscribed connection).  Queued here, a waiting unit is its _Job."""
        assert self._loop is not None
        if job.mode != "loop":
            if self._units_holding_connection >= self.settings.max_size:
                self._hand_over(job)  # it waits for a connection: nothing to wait for there
                self._waiting_for_connection.append(job)
                return
            self._units_holding_connection += 1
        job.asyncio_task = self._loop.create_task(self._execute(job))

    def _cancel_on_loop(self, job: _Job) -> None:
        if job.asyncio_task is not None:
            job.asyncio_task.cancel()
            # A task cancelled before its first step never enters _execute: complete it here.
            job.asyncio_task.add_done_callback(
                lambda _: self._executed(job, outcome.Error(asyncio.CancelledError())) if job.result is None else None)
        elif job in self._waiting_for_connection:
            self._waiting_for_connection.remove(job)
            self._complete(job, outcome.Error(asyncio.CancelledError()))
        # Otherwise it is still submitted and _drain_submissions completes it as cancelled.

    async def _execute(self, job: _Job) -> None:
        try:
            if job.mode == "loop":
                value = await job.fn()
            else:
                assert self._pool is not None
                async with self._pool.acquire() as conn:
                    self._hand_over(job)
                    if job.mode == "transaction":
                        async with conn.transaction():
                            value = await job.fn(conn, *job.args, **job.kwargs)
                    else:
                        value = await job.fn(conn, *job.args, **job.kwargs)
            result: outcome.Outcome = outcome.Value(value)
        except asyncio.CancelledError as exc:
            result = outcome.Error(exc)
        except BaseException as exc:  # handed to the trio task, which raises it
            result = outcome.Error(_translate(exc))
        self._executed(job, result)

    def _executed(self, job: _Job, result: outcome.Outcome) -> None:
        if job.mode != "loop":
            self._units_holding_connection -= 1
            if self._waiting_for_connection:
                self._start_or_queue(self._waiting_for_connection.popleft())
        self._complete(job, result)

    def _complete(self, job: _Job, result: outcome.Outcome) -> None:
        job.result = result
        self._completions.append(job)
        if not self._complete_wake_pending:
            self._complete_wake_pending = True
            assert self._loop is not None
            # Wake trio once, at the end of this loop iteration, so every unit
            # that completes in the same iteration shares one crossing
            # (measured: doubles completions per wakeup for insert transactions).
            self._loop.call_soon(self._wake_trio)

    def _wake_trio(self) -> None:
        assert self._trio_token is not None
        try:
            self._trio_token.run_sync_soon(self._drain_completions)
        except trio.RunFinishedError:
            pass

    # --- trio side -------------------------------------------------------------------

    def _drain_completions(self) -> None:
        self._complete_wake_pending = False
        while self._completions:
            job = self._completions.popleft()
            trio.lowlevel.reschedule(job.trio_task, outcome.Value(None))

    # --- LISTEN / NOTIFY -------------------------------------------------------------

    def listen(self, *channels: str, buffer: int = 1024) -> _Listener:
        """`async with db.listen("a", "b") as notifications:` yields a trio
        receive channel of Notification.  The buffer is bounded: when the
        consumer falls behind, notifications are dropped and the next delivered
        one carries resync=True."""
        return _Listener(self, channels, buffer)


class _Listener:
    def __init__(self, db: Database, channels: tuple[str, ...], buffer: int) -> None:
        self._db = db
        self._channels = channels
        self._send, self._receive = trio.open_memory_channel[Notification](buffer)
        self._handover = ResyncOnOverflow(self._send)
        self._conn: asyncpg.Connection | None = None
        self._keeper: asyncio.Task | None = None
        self._stopping = False
        self._ready: asyncio.Event | None = None

    async def __aenter__(self) -> trio.MemoryReceiveChannel[Notification]:
        await self._db._call_on_loop(self._start_on_loop)
        return self._receive

    async def __aexit__(self, *exc_info: object) -> None:
        with trio.CancelScope(shield=True):
            await self._db._call_on_loop(self._stop_on_loop)
            await self._send.aclose()

    # All of the below runs on the asyncio loop.

    async def _start_on_loop(self) -> None:
        self._ready = asyncio.Event()
        self._keeper = asyncio.get_running_loop().create_task(self._keep_connected())
        ready = asyncio.ensure_future(self._ready.wait())
        done, _ = await asyncio.wait({ready, self._keeper}, timeout=self._db.settings.connect_timeout * 2,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            self._keeper.cancel()
            raise DatabaseUnavailable("could not open the LISTEN connection")

    async def _keep_connected(self) -> None:
        """Hold one LISTEN connection; reconnect with backoff when it drops."""
        assert self._ready is not None
        backoff = 0.1
        first = True
        while not self._stopping:
            lost = asyncio.Event()
            try:
                conn = await asyncpg.connect(self._db.dsn, timeout=self._db.settings.connect_timeout)
                conn.add_termination_listener(lambda _c: lost.set())
                for channel in self._channels:
                    await conn.add_listener(channel, self._on_notify)
                self._conn = conn
                if not first:
                    self._push(Notification(channel="", payload=None, resync=True))
                first = False
                backoff = 0.1
                self._ready.set()
                await lost.wait()
                log.warning("LISTEN connection lost; reconnecting")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any connect failure means "retry later"
                log.warning("LISTEN connect failed: %s", exc)
            self._conn = None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        self._push(Notification(channel=channel, payload=payload))

    def _push(self, note: Notification) -> None:
        token = self._db._trio_token
        assert token is not None
        try:
            token.run_sync_soon(self._handover.offer, note)
        except trio.RunFinishedError:
            pass

    async def _stop_on_loop(self) -> None:
        self._stopping = True
        if self._keeper is not None:
            self._keeper.cancel()
            try:
                await self._keeper
            except (asyncio.CancelledError, Exception):
                pass
        if self._conn is not None and not self._conn.is_closed():
            try:
                await asyncio.wait_for(self._conn.close(), timeout=5)
            except (asyncio.TimeoutError, Exception):
                self._conn.terminate()
