"""The trio ↔ asyncpg bridge against a real PostgreSQL."""

import asyncio
import os
import shutil
import signal
import threading
import tempfile
from pathlib import Path

import asyncpg
import pytest
import trio
import trio.testing

from storage.cluster import ClusterSettings, PostgresCluster

from storage import bridge
from storage.bridge import (Database, Notification, PoolSettings, ResyncOnOverflow, _translate,
                            lift_transaction_bound)
from storage.errors import DatabaseUnavailable


async def _one(conn):
    return await conn.fetchval("SELECT 1")


async def _recovers(database: Database, *, attempts: int) -> None:
    """Connections broken by a restart fail at most once each, typed; then it works."""
    outcomes = []
    for _ in range(attempts):
        try:
            outcomes.append(await database.run(_one))
        except DatabaseUnavailable:
            outcomes.append("unavailable")
    assert outcomes[-4:] == [1, 1, 1, 1]


async def test_units_of_work_run_concurrently_and_return_values(db: Database):
    results = []

    async def worker(n: int) -> None:
        for i in range(20):
            results.append(await db.run(lambda c, a, b: c.fetchval("SELECT $1::int * 1000 + $2::int", a, b), n, i))

    async with trio.open_nursery() as nursery:
        for n in range(32):
            nursery.start_soon(worker, n)
    assert sorted(results) == sorted(n * 1000 + i for n in range(32) for i in range(20))


async def test_idle_pooled_connections_are_kept(db: Database):
    """README: pooled connections stay open while idle (asyncpg closes them after 300 s by
    default; a fresh backend prepares every statement and introspects types again)."""
    assert db._pool._max_inactive_connection_lifetime == 0


async def test_transaction_commits_on_return_and_rolls_back_on_error(db: Database):
    await db.run(lambda c: c.execute("CREATE TABLE t (v int)"))

    async def insert_then_fail(conn):
        await conn.execute("INSERT INTO t VALUES (1)")
        raise ValueError("boom")

    with pytest.raises(ValueError):
        await db.transaction(insert_then_fail)
    await db.transaction(lambda c: c.execute("INSERT INTO t VALUES (2)"))
    assert await db.run(lambda c: c.fetch("SELECT v FROM t")) == [(2,)]


async def test_overlapping_work_runs_while_the_unit_is_in_flight(db: Database):
    handed_over = threading.Event()

    async def unit(conn):
        # Completes only if `meanwhile` runs while this unit is still running.
        if not await asyncio.get_running_loop().run_in_executor(None, handed_over.wait, 10):
            raise AssertionError("meanwhile did not run during the unit")
        return await conn.fetchval("SELECT 7")

    assert await db.run_overlapping(handed_over.set, unit) == 7

    def failing() -> None:
        raise ValueError("boom")

    # A failure of the overlapping work does not abandon the unit.
    assert await db.run_overlapping(failing, _one) == 1


async def test_an_overlapping_unit_starts_before_its_submitter_goes_on(db: Database, monkeypatch):
    # The submitter's thread runs `meanwhile`, then gives the loop thread the GIL to start the
    # unit before any other trio task runs (bounded by HAND_OVER_SECONDS, lifted here so that
    # a busy machine cannot time it out).  The loop thread is kept busy past `meanwhile`, so
    # a submitter that went on at once would let the observer run before the unit started.
    monkeypatch.setattr(bridge, "HAND_OVER_SECONDS", 30.0)
    loop_busy, started = threading.Event(), threading.Event()
    meanwhile_ran = trio.Event()
    seen_by_observer: list[bool] = []

    async def keep_loop_busy():
        loop_busy.set()
        threading.Event().wait(0.3)  # blocks the loop thread, the GIL released

    async def unit(conn):
        started.set()
        return await conn.fetchval("SELECT 7")

    async def observer():
        await meanwhile_ran.wait()
        seen_by_observer.append(started.is_set())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(db.on_loop, keep_loop_busy)
        await trio.to_thread.run_sync(loop_busy.wait)
        nursery.start_soon(observer)
        await trio.testing.wait_all_tasks_blocked()
        assert await db.run_overlapping(meanwhile_ran.set, unit) == 7
    assert seen_by_observer == [True]


async def test_query_errors_surface_as_asyncpg_errors(db: Database):
    with pytest.raises(asyncpg.UndefinedTableError):
        await db.run(lambda c: c.fetch("SELECT * FROM no_such_table"))
    assert await db.run(_one) == 1


async def test_cancelled_task_cancels_the_query_and_rolls_back(db: Database):
    await db.run(lambda c: c.execute("CREATE TABLE t (v int)"))

    async def insert_then_sleep(conn):
        await conn.execute("INSERT INTO t VALUES (1)")
        await conn.execute("SELECT pg_sleep(30)")

    with trio.move_on_after(0.5) as scope:
        await db.transaction(insert_then_sleep)
    assert scope.cancelled_caught
    # The bridge waited for the server-side cancel: nothing is still running or committed.
    active = await db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(30)%' "
        "AND state = 'active' AND pid <> pg_backend_pid()"))
    assert active == 0
    assert await db.run(lambda c: c.fetchval("SELECT count(*) FROM t")) == 0


async def test_listen_delivers_notifications_into_a_trio_channel(db: Database):
    async with db.listen("events") as notifications:
        for i in range(5):
            await db.run(lambda c, i=i: c.execute(f"NOTIFY events, 'n{i}'"))
        received = [await notifications.receive() for _ in range(5)]
    assert [n.payload for n in received] == [f"n{i}" for i in range(5)]
    assert {n.channel for n in received} == {"events"}


async def test_lost_connection_raises_typed_error_and_pool_recovers(db: Database):
    async def kill_all_others(conn):
        await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")

    # Hold a pooled connection busy, terminate it from another, and watch it fail typed.
    async def victim():
        with pytest.raises(DatabaseUnavailable):
            await db.run(lambda c: c.execute("SELECT pg_sleep(10)"))

    async def victim_is_running(conn):
        return await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(10)%' "
                                   "AND state = 'active' AND pid <> pg_backend_pid()")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(victim)
        with trio.fail_after(10):
            while not await db.run(victim_is_running):
                pass
        await db.run(kill_all_others)
    # The pool replaces dead connections: every slot works again.
    for _ in range(15):
        assert await db.run(_one) == 1


async def test_listener_resyncs_after_its_connection_is_killed(db: Database):
    async with db.listen("events") as notifications:
        await db.run(lambda c: c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                         "WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid()"))
        first = await notifications.receive()
        assert first.resync
        await db.run(lambda c: c.execute("NOTIFY events, 'after'"))
        note = await notifications.receive()
        assert note.payload == "after"


async def test_closed_bridge_refuses_work(database_dsn: str):
    database = Database(database_dsn, PoolSettings(min_size=1, max_size=2))
    await database.start()
    await database.aclose()
    with pytest.raises(DatabaseUnavailable):
        await database.run(_one)


async def test_survives_a_postgres_restart():
    data_dir = Path(tempfile.mkdtemp(prefix="scopewire-restart-"))
    cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled"))
    cluster.start()
    try:
        async with Database(cluster.dsn("postgres"), PoolSettings(min_size=2, max_size=4)) as database:
            assert await database.run(_one) == 1
            cluster.stop()
            with pytest.raises(DatabaseUnavailable):
                await database.run(_one)
            cluster.start()
            await _recovers(database, attempts=8)
    finally:
        cluster.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.mark.parametrize("error", [
    asyncpg.exceptions.InternalClientError("cannot switch to state 15; another operation (2) is in progress"),
    asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    asyncpg.exceptions.ClientCannotConnectError("cannot connect"),
    asyncpg.exceptions.ProtocolViolationError("unexpected message"),
    asyncpg.exceptions.InterfaceError("cannot perform operation: another operation is in progress"),
    asyncpg.exceptions.CannotConnectNowError("the database system is in recovery mode"),
    asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already"),
    asyncpg.exceptions.CrashShutdownError("terminating connection because of crash of another server process"),
    asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
    ConnectionResetError(104, "Connection reset by peer"),
    FileNotFoundError(2, "No such file or directory"),  # the unix socket is gone
    TimeoutError(),
])
def test_every_driver_error_of_an_outage_means_unavailable(error: BaseException):
    translated = _translate(error)
    assert isinstance(translated, DatabaseUnavailable) and translated.__cause__ is error


@pytest.mark.parametrize("error", [asyncpg.exceptions.UniqueViolationError("duplicate key"),
                                   asyncpg.exceptions.UndefinedTableError("no such table"),
                                   ValueError("a bug")])
def test_query_errors_and_bugs_are_not_an_outage(error: BaseException):
    assert _translate(error) is error


async def test_postmaster_killed_under_load_fails_every_unit_typed_and_the_pool_recovers():
    data_dir = Path(tempfile.mkdtemp(prefix="scopewire-kill-"))
    cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled"))
    cluster.start()
    try:
        async with Database(cluster.dsn("postgres"), PoolSettings(min_size=4, max_size=8)) as database:
            await database.run(lambda c: c.execute("CREATE TABLE t (v int)"))
            failures: list[BaseException] = []
            completed = [0]
            killed = trio.Event()

            async def unit(conn):
                await conn.execute("INSERT INTO t VALUES (1)")
                return await conn.fetchval("SELECT count(*) FROM t")

            async def worker() -> None:
                while not killed.is_set() or len(failures) < 16:
                    try:
                        await database.transaction(unit)
                        completed[0] += 1
                    except Exception as exc:  # noqa: BLE001 - every one is inspected below
                        failures.append(exc)
                    if killed.is_set():
                        await trio.sleep(0.01)  # no busy loop against a dead server

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for _ in range(16):
                        nursery.start_soon(worker)
                    while completed[0] < 200:
                        await trio.sleep(0.01)
                    os.kill(cluster.postmaster_pid, signal.SIGKILL)
                    killed.set()
            assert failures and all(isinstance(f, DatabaseUnavailable) for f in failures), failures

            await trio.to_thread.run_sync(cluster.restart_after_crash)
            await _recovers(database, attempts=12)
    finally:
        cluster.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


async def test_a_handover_that_overflows_drops_and_marks_the_next_item_resync():
    """LISTEN and the NATS bus never let the asyncio loop wait for trio: what does not fit is
    dropped, and the next item that fits tells the consumer to catch up."""
    send, receive = trio.open_memory_channel(1)
    handover = ResyncOnOverflow(send)
    assert handover.offer(Notification("c", "1"))
    assert handover.offer(Notification("c", "2"))  # full: dropped
    assert handover.offer(Notification("c", "3"))  # still full: dropped
    assert receive.receive_nowait() == Notification("c", "1")
    assert handover.offer(Notification("c", "4"))
    assert receive.receive_nowait() == Notification("c", "4", resync=True)
    assert handover.offer(Notification("c", "5"))
    assert receive.receive_nowait() == Notification("c", "5")
    await receive.aclose()
    assert not handover.offer(Notification("c", "6"))


async def test_every_pooled_transaction_is_bounded_as_a_whole(db):
    """A process frozen between a statement's messages leaves its transaction "active", where the
    idle-in-transaction timeout does not apply: the whole transaction's bound ends it."""
    assert await db.run(lambda conn: conn.fetchval("SHOW transaction_timeout")) == "1min"
    assert await db.run(lambda conn: conn.fetchval("SHOW idle_in_transaction_session_timeout")) == "15s"

    async def lifted(conn) -> str:
        await lift_transaction_bound(conn)
        return await conn.fetchval("SHOW transaction_timeout")
    assert await db.transaction(lifted) == "0"
    assert await db.run(lambda conn: conn.fetchval("SHOW transaction_timeout")) == "1min"  # that transaction only


async def test_units_beyond_the_pool_wait_their_turn_in_order_and_can_be_cancelled_while_waiting(database_dsn: str):
    """Units that find every pooled connection taken queue in the bridge (not as asyncio
    tasks inside the pool), start in submission order as connections free up, and one
    cancelled while queued is gone at once, without waiting for a connection."""
    release = threading.Event()
    started: list[int] = []

    async def unit(conn, index: int) -> int:
        started.append(index)
        if index < 2:  # the two holders keep their connections until released
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        return await conn.fetchval("SELECT $1::int", index)

    async def noop() -> None:
        return None

    async with Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as database:
        results: dict[int, int] = {}

        async def submit(index: int) -> None:
            results[index] = await database.run(unit, index)

        async with trio.open_nursery() as nursery:
            for index in range(5):
                nursery.start_soon(submit, index)
                await trio.testing.wait_all_tasks_blocked()  # handed over in this order
            waiting = trio.CancelScope()
            gone = trio.Event()

            async def cancelled_while_waiting() -> None:
                with waiting:
                    await database.run(unit, 99)
                gone.set()

            nursery.start_soon(cancelled_while_waiting)
            await trio.testing.wait_all_tasks_blocked()
            await database.on_loop(noop)  # the loop has drained every submission before it
            assert database.units_waiting_for_connection == 4
            assert database.pool_figures()["open"] <= 2
            waiting.cancel()
            await gone.wait()  # while both connections are still held
            assert database.units_waiting_for_connection == 3
            release.set()
        assert results == {index: index for index in range(5)}
        assert sorted(started) == [0, 1, 2, 3, 4]  # not 99
        waiters = [index for index in started if index >= 2]
        assert waiters == [2, 3, 4]
        assert database.units_waiting_for_connection == 0


async def test_a_listener_left_open_ends_with_the_bridge_without_a_destroyed_task(database_dsn: str, caplog):
    """A LISTEN keeper whose owner never exited (cancelled first) is ended when the bridge
    stops, not destroyed pending later by the garbage collector, which would log an error
    into whatever runs then."""
    import gc

    database = Database(database_dsn)
    await database.start()
    listener = database.listen("left_open")
    await listener.__aenter__()
    await database.aclose()
    del listener
    gc.collect()
    assert [r.getMessage() for r in caplog.records if "destroyed" in r.getMessage()] == []
