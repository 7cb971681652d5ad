"""Real processes going away under a running service: the embedded PostgreSQL killed
under load, and the server process itself killed and started again."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import trio

from client import ClientError, connect
from storage.lifecycle import RESTART_ATTEMPTS
from tests.test_serve import data_dir, run_cli, start_serve, stop_serve  # noqa: F401

# A request may wait this long for its reply while the database restarts (connect
# timeouts, WAL recovery on a busy machine); past it, the server left it unanswered.
REPLY_BOUND = 45
SENDERS = 4
ACKS_BEFORE_KILL = 10
ACKS_AFTER_KILL = 10


def postmaster_pid(data_dir: Path) -> int:  # noqa: F811
    return int((data_dir / "pg" / "postmaster.pid").read_text().split()[0])


def log_entries(stderr_path: Path) -> list[dict]:
    return [json.loads(line) for line in stderr_path.read_text().splitlines() if line.startswith("{")]


async def init_instance(*args: str) -> dict:
    done = await trio.to_thread.run_sync(lambda: run_cli(
        "init", *args, "--email", "o@example.com", "--name", "O", "--workspace-name", "W",
        "--workspace-slug", "w"))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_postmaster_killed_under_load_every_request_answered_and_nothing_acknowledged_lost(data_dir):  # noqa: F811
    owner = await init_instance("--data-dir", str(data_dir))
    served = await start_serve(data_dir)
    async with connect(served.url) as conn:
        await conn.login("o@example.com", owner["password"])
        channel = await conn.call("channel.create", slug="load", display_name="Load")

    acked: dict[str, dict] = {}  # client_message_id -> the acknowledged message
    acks_after_kill = [0] * SENDERS
    unavailable = [0]
    killed = trio.Event()
    enough_before_kill = trio.Event()
    old_pid = postmaster_pid(data_dir)

    async def sender(index: int) -> None:
        async with connect(served.url) as conn:
            await conn.login("o@example.com", owner["password"])
            number = 0
            while acks_after_kill[index] < ACKS_AFTER_KILL:
                client_message_id = f"s{index}-{number}"
                try:
                    with trio.fail_after(REPLY_BOUND):
                        sent = await conn.call("message.send", scope_id=channel["id"], content=client_message_id,
                                               client_message_id=client_message_id)
                except ClientError as error:
                    assert error.code == "unavailable", error  # never internal, never anything else
                    unavailable[0] += 1
                    await trio.sleep(0.05)  # a client's retry pause, not a synchronisation
                    continue  # the same id again: an idempotent retry
                acked[client_message_id] = sent
                number += 1
                if killed.is_set():
                    acks_after_kill[index] += 1
                elif len(acked) >= SENDERS * ACKS_BEFORE_KILL:
                    enough_before_kill.set()

    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            for index in range(SENDERS):
                nursery.start_soon(sender, index)
            await enough_before_kill.wait()
            os.kill(old_pid, signal.SIGKILL)
            killed.set()
    # Back without operator action: the same server process, a new postmaster.
    assert served.process.returncode is None
    assert postmaster_pid(data_dir) != old_pid

    async with connect(served.url) as conn:
        await conn.login("o@example.com", owner["password"])
        stored, after = {}, 0
        while True:
            page = await conn.call("message.history", scope_id=channel["id"], after_seq=after, limit=200)
            stored.update((m["content"], m) for m in page["messages"])
            if not page["messages"]:
                break
            after = page["messages"][-1]["seq"]
    for client_message_id, sent in acked.items():
        assert stored[client_message_id]["id"] == sent["id"], client_message_id
    assert sorted(m["seq"] for m in stored.values()) == list(range(1, len(stored) + 1))  # nothing twice, no gap

    assert await stop_serve(served) == 0
    entries = log_entries(served.stderr_path)
    assert "postgres restarted" in {entry["msg"] for entry in entries}
    # An outage is not a bug: warnings, but no error and no traceback of ours.
    assert not [entry for entry in entries if entry["level"] == "error"
                or ("exc" in entry and entry["logger"].startswith("scopewire"))], entries


async def test_serve_exits_non_zero_when_the_postmaster_cannot_be_restarted(data_dir):  # noqa: F811
    served = await start_serve(data_dir)
    async with connect(served.url) as conn:
        assert (await conn.call("ping"))["protocol_version"] == 1
        # Every restart fails: the configuration no longer parses.
        with open(data_dir / "pg" / "postgresql.conf", "a") as conf:
            conf.write("\nthis is not a setting\n")
        os.kill(postmaster_pid(data_dir), signal.SIGKILL)
        with trio.fail_after(240):
            status = await served.process.wait()
            # Its clients were told it is going away.
            assert await conn.wait_closed() == 1001
    assert status == 1
    last_line = served.stderr_path.read_text().strip().splitlines()[-1]
    assert last_line == f"scopewire: postgres died and {RESTART_ATTEMPTS} restarts within 600s did not bring it back"
    attempts = [e for e in log_entries(served.stderr_path) if e["msg"] == "restarting postgres failed"]
    assert len(attempts) == RESTART_ATTEMPTS
    assert not (data_dir / "pg" / "postmaster.pid").exists()


async def test_idempotent_replay_after_the_server_process_is_killed_and_restarted(data_dir, database_dsn):  # noqa: F811
    database = ("--database-url", database_dsn)
    owner = await init_instance("--data-dir", str(data_dir), *database)
    served = await start_serve(data_dir, *database)
    async with connect(served.url) as conn:
        await conn.login("o@example.com", owner["password"])
        channel = await conn.call("channel.create", slug="idem", display_name="Idem")
        first = await conn.call("message.send", scope_id=channel["id"], content="once", client_message_id="c-1")
    assert not first.get("replayed")  # omitted when false
    served.process.kill()  # nothing in memory survives: no actor, no cache
    assert await served.process.wait() == -signal.SIGKILL

    served = await start_serve(data_dir, *database)
    async with connect(served.url) as conn:
        await conn.login("o@example.com", owner["password"])
        again = await conn.call("message.send", scope_id=channel["id"], content="once", client_message_id="c-1")
        assert (again["id"], again["seq"], again["replayed"]) == (first["id"], first["seq"], True)
        try:
            await conn.call("message.send", scope_id=channel["id"], content="different", client_message_id="c-1")
        except ClientError as error:
            assert error.code == "idempotency_conflict"
        else:
            raise AssertionError("a different payload under the same client_message_id was accepted")
        history = await conn.call("message.history", scope_id=channel["id"])
    assert [m["id"] for m in history["messages"]] == [first["id"]]
    assert await stop_serve(served) == 0
