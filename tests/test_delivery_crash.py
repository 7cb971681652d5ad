"""Routed deliveries across a kill -9 of the real server process (issue 13): the
ledger is the truth, so a delivery committed but never handed out arrives
exactly once after the restart, and one handed out but never acked comes back
(same dedupe key) once the dead process's lease expires."""

from __future__ import annotations

import contextlib
import signal

import trio

from client import connect
from tests.test_outage import init_instance
from tests.test_serve import data_dir, start_serve  # noqa: F401  (data_dir is a fixture)

# A lease this short makes the dead process's lease lapse within the test; the
# bound below is what a busy machine may need for the restart and the sweep.
SHORT_LEASE = ("--delivery-lease-seconds", "2")
REDELIVERY_BOUND = 90


async def next_delivery(conn, bound: float = 30) -> dict:
    with trio.fail_after(bound):
        while True:
            event = await conn.next_event()
            if event["event"] == "delivery":
                return event["data"]


async def kill_and_restart(served, data_dir, *args: str):  # noqa: F811
    served.process.send_signal(signal.SIGKILL)  # nothing in memory survives: no actor, no router, no lease
    with trio.fail_after(60):
        assert await served.process.wait() == -signal.SIGKILL
    return await start_serve(data_dir, *args)


@contextlib.asynccontextmanager
async def agent(url: str, key: str):
    async with connect(url) as conn:
        await conn.auth(api_key=key)
        yield conn


async def private_agent_world(url: str, password: str) -> tuple[str, str, str]:
    """The owner's private agent `scout` in a channel: (channel id, agent id, agent API key)."""
    async with connect(url) as owner:
        await owner.login("o@example.com", password)
        scout = await owner.call("agent.create", handle="scout", display_name="Scout")
        channel = await owner.call("channel.create", slug="work", display_name="Work", member_ids=[scout["id"]])
        key = (await owner.call("apikey.create", name="scout", member_id=scout["id"]))["key"]
    return channel["id"], scout["id"], key


async def owner_mentions(url: str, password: str, channel_id: str, text: str) -> dict:
    async with connect(url) as owner:
        await owner.login("o@example.com", password)
        return await owner.call("message.send", scope_id=channel_id, content=f"@scout {text}")


async def test_a_delivery_committed_before_a_kill_arrives_exactly_once_after_the_restart(data_dir, database_dsn):  # noqa: F811
    args = ("--database-url", database_dsn)
    password = (await init_instance("--data-dir", str(data_dir), *args))["password"]
    served = await start_serve(data_dir, *args)
    channel_id, scout_id, key = await private_agent_world(served.url, password)
    # Committed; nobody is subscribed, so no process ever handed it out.
    sent = await owner_mentions(served.url, password, channel_id, "wake up")
    served = await kill_and_restart(served, data_dir, *args)

    async with agent(served.url, key) as scout:
        subscribed = await scout.call("delivery.subscribe")
        assert subscribed == {"latest_delivery_seq": 1, "unacked": 1}
        delivery = await next_delivery(scout)
        assert (delivery["dedupe_key"], delivery["delivery_seq"], delivery["attempt"]) == (
            f"message:{sent['id']}:{scout_id}", 1, 1)
        assert (await scout.call("delivery.ack", delivery_seqs=[1])) == {"acked": [1]}
    async with agent(served.url, key) as scout:
        assert (await scout.call("delivery.subscribe")) == {"latest_delivery_seq": 1, "unacked": 0}
        # The next delivery is the next message's: the acked one never comes again.
        later = await owner_mentions(served.url, password, channel_id, "next")
        assert (await next_delivery(scout))["message_id"] == later["id"]
        assert [e for e in scout.queued_events() if e["event"] == "delivery"] == []


async def test_a_delivery_handed_out_but_not_acked_comes_back_after_the_dead_lease(data_dir, database_dsn):  # noqa: F811
    args = ("--database-url", database_dsn, *SHORT_LEASE)
    password = (await init_instance("--data-dir", str(data_dir), "--database-url", database_dsn))["password"]
    served = await start_serve(data_dir, *args)
    channel_id, scout_id, key = await private_agent_world(served.url, password)
    async with agent(served.url, key) as scout:
        await scout.call("delivery.subscribe")
        handed_out = []
        for text in ("handle me", "and me"):
            sent = await owner_mentions(served.url, password, channel_id, text)
            delivery = await next_delivery(scout)
            while delivery["dedupe_key"] in handed_out:  # the short lease may already have sent one again
                delivery = await next_delivery(scout)
            assert (delivery["dedupe_key"], delivery["attempt"]) == (f"message:{sent['id']}:{scout_id}", 1)
            handed_out.append(delivery["dedupe_key"])
        # The router hands out one offer after another: the second handout means the first's
        # outbox row is settled, so only its lease (held by a dead connection) can bring it back.
        served = await kill_and_restart(served, data_dir, *args)  # the agent never acked

    async with agent(served.url, key) as scout:
        assert (await scout.call("delivery.subscribe"))["unacked"] == 2
        again: dict[int, dict] = {}
        while len(again) < 2:  # (a short lease may send one twice before the other arrives)
            delivery = await next_delivery(scout, REDELIVERY_BOUND)
            again.setdefault(delivery["delivery_seq"], delivery)
        assert [(seq, again[seq]["dedupe_key"]) for seq in sorted(again)] == [(1, handed_out[0]), (2, handed_out[1])]
        assert all(x["attempt"] >= 2 for x in again.values())
        assert (await scout.call("delivery.ack", delivery_seqs=[1, 2])) == {"acked": [1, 2]}
    async with agent(served.url, key) as scout:
        assert (await scout.call("delivery.subscribe"))["unacked"] == 0
        later = await owner_mentions(served.url, password, channel_id, "next")
        assert (await next_delivery(scout))["message_id"] == later["id"]
