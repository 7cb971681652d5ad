"""Property test: an agent daemon's routed feed under random schedules (issue 13;
scope-model.md §3.10), against the real server over the WebSocket.

Each example is a program over one private agent, its owner and a channel:
the owner mentions the agent; the agent connects and subscribes (with a
random `max_in_flight`), subscribes again with another bound, acks some of
what it holds (plus seqs already acked and unknown ones), and disconnects.  A
plain-Python model of the feed (pending / leased to this connection / acked,
and the handouts of each delivery) says after every step how many pushes must
arrive and which deliveries they may be.  Checked throughout: a push is only
ever a delivery that is neither acked nor already held by the connection, with
its stable dedupe key (`message:<message id>:<agent>`) and `attempt` one more
than its handouts so far; the connection never holds more than
`max_in_flight`; `delivery.ack` answers exactly what became acked;
`delivery.subscribe` reports the feed's head and what is unacked.  At the end
a fresh connection gets every unacked delivery (so every routed message is
eventually delivered), acks them, and the feed lists each sent mention once,
acked, with `delivery_seq` 1..N gap-free; the next mention is the next push.

Examples share one server and workspace (tests/test_private_visibility_model.py's
people_server); each makes its own agent and channel."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import trio
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from client import connect
from tests.conftest import MEMBER_PASSWORD
from tests.test_private_visibility_model import Base, people_server

WAIT_SECONDS = 20  # bound on a push the protocol guarantees, on a busy machine


@dataclass
class Feed:
    """The model: what the agent's feed holds, and what this connection holds."""

    agent_id: str
    message_ids: list[str] = field(default_factory=list)  # index i is delivery_seq i + 1
    acked: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)  # leased to the current connection, unacked
    handouts: dict[int, int] = field(default_factory=dict)
    max_in_flight: int = 0  # 0: no subscribed connection

    @property
    def pending(self) -> set[int]:
        return set(range(1, len(self.message_ids) + 1)) - self.acked - self.held

    def expected_pushes(self) -> int:
        return max(0, min(self.max_in_flight - len(self.held), len(self.pending)))

    def dedupe_key(self, seq: int) -> str:
        return f"message:{self.message_ids[seq - 1]}:{self.agent_id}"


class Program:
    def __init__(self, base: Base, number: int, owner, feed: Feed, channel_id: str, key: str) -> None:
        self.base, self.number, self.owner, self.feed = base, number, owner, feed
        self.channel_id, self.key = channel_id, key
        self.ws = {"workspace_id": base.workspace_id}
        self.conn = None
        self.conn_stack = contextlib.AsyncExitStack()

    async def receive_expected(self, step: tuple) -> None:
        """Exactly the pushes the model says must come now; each one checked."""
        for _ in range(self.feed.expected_pushes()):
            with trio.fail_after(WAIT_SECONDS):
                event = await self.conn.next_event()
            assert event["event"] == "delivery", (step, event)
            data = event["data"]
            seq = data["delivery_seq"]
            assert seq in self.feed.pending, (step, seq, "acked" if seq in self.feed.acked else "held", self.feed)
            assert data["dedupe_key"] == self.feed.dedupe_key(seq), (step, data)
            assert data["message_id"] == self.feed.message_ids[seq - 1], (step, data)
            assert (data["reason"], data["authority"], data["push"]) == ("mention", "owner", True), (step, data)
            assert data["attempt"] == self.feed.handouts.get(seq, 0) + 1, (step, data, self.feed.handouts)
            assert event["scope_id"] == self.channel_id
            self.feed.handouts[seq] = data["attempt"]
            self.feed.held.add(seq)

    async def send(self) -> None:
        sent = await self.owner.call("message.send", scope_id=self.channel_id,
                                     content=f"@d{self.number} job {len(self.feed.message_ids)}", **self.ws)
        self.feed.message_ids.append(sent["id"])

    async def connect(self, max_in_flight: int) -> None:
        if self.conn is not None:
            return
        self.conn = await self.conn_stack.enter_async_context(connect(self.base.url))
        await self.conn.auth(api_key=self.key)
        await self.subscribe(max_in_flight)

    async def subscribe(self, max_in_flight: int) -> None:
        subscribed = await self.conn.call("delivery.subscribe", max_in_flight=max_in_flight, **self.ws)
        assert subscribed == {"latest_delivery_seq": len(self.feed.message_ids),
                              "unacked": len(self.feed.message_ids) - len(self.feed.acked)}, (subscribed, self.feed)
        self.feed.max_in_flight = max_in_flight

    async def ack(self, picks: list[int]) -> None:
        held = sorted(self.feed.held)
        chosen = {held[i % len(held)] for i in picks} if held else set()
        # Seqs that are already acked or unknown ride along: they are left out of the answer.
        extra = {min(self.feed.acked)} if self.feed.acked else set()
        extra.add(len(self.feed.message_ids) + 7)
        answer = await self.conn.call("delivery.ack", delivery_seqs=sorted(chosen | extra), **self.ws)
        assert sorted(answer["acked"]) == sorted(chosen), (answer, chosen, self.feed)
        self.feed.acked |= chosen
        self.feed.held -= chosen

    async def disconnect(self) -> None:
        assert [e for e in self.conn.queued_events() if e["event"] == "delivery"] == [], "an unexpected push"
        await self.conn_stack.aclose()
        self.conn, self.conn_stack = None, contextlib.AsyncExitStack()
        self.feed.held.clear()  # back to the feed
        self.feed.max_in_flight = 0

    async def step(self, step: tuple) -> None:
        kind, *args = step
        if kind == "send":
            await self.send()
        elif kind == "connect":
            await self.connect(*args)
        elif self.conn is None:
            return  # acks and resubscribes need a connection
        elif kind == "resubscribe":
            await self.subscribe(*args)
        elif kind == "ack":
            await self.ack(*args)
        elif kind == "disconnect":
            await self.disconnect()
        if self.conn is not None:
            await self.receive_expected(step)

    async def finish(self) -> None:
        if self.conn is not None:
            await self.disconnect()
        await self.connect(1000)
        await self.receive_expected(("final",))
        assert self.feed.pending == set()  # every routed message delivered
        if self.feed.held:
            answer = await self.conn.call("delivery.ack", delivery_seqs=sorted(self.feed.held), **self.ws)
            assert sorted(answer["acked"]) == sorted(self.feed.held)
            self.feed.acked |= self.feed.held
            self.feed.held.clear()
        listed = (await self.conn.call("delivery.list", limit=200, **self.ws))["deliveries"]
        assert [(x["delivery_seq"], x["dedupe_key"], x["status"]) for x in listed] == [
            (seq, self.feed.dedupe_key(seq), "acked") for seq in range(1, len(self.feed.message_ids) + 1)]
        # Nothing acked is pushed again: the next push is the next mention's.
        await self.send()
        await self.receive_expected(("barrier",))
        assert self.feed.held == {len(self.feed.message_ids)}
        await self.conn_stack.aclose()


async def run_program(base: Base, number: int, program: list[tuple]) -> None:
    async with connect(base.url) as owner:
        await owner.login("o1@example.com", MEMBER_PASSWORD)
        ws = {"workspace_id": base.workspace_id}
        agent = await owner.call("agent.create", handle=f"d{number}", display_name=f"D{number}", **ws)
        channel = await owner.call("channel.create", slug=f"feed-{number}", display_name=f"Feed {number}",
                                   member_ids=[agent["id"]], **ws)
        key = (await owner.call("apikey.create", name=f"d{number}", member_id=agent["id"], **ws))["key"]
        runner = Program(base, number, owner, Feed(agent["id"]), channel["id"], key)
        try:
            for step in program:
                await runner.step(step)
            await runner.finish()
        finally:
            await runner.conn_stack.aclose()


MAX_IN_FLIGHT = st.integers(1, 4)
STEP = st.one_of(
    st.just(("send",)), st.just(("send",)), st.just(("send",)),
    st.tuples(st.just("connect"), MAX_IN_FLIGHT),
    st.tuples(st.just("resubscribe"), MAX_IN_FLIGHT),
    st.tuples(st.just("ack"), st.lists(st.integers(0, 7), max_size=3)),
    st.tuples(st.just("ack"), st.lists(st.integers(0, 7), max_size=3)),
    st.just(("disconnect",)),
)

# Programs that always run: a backlog drained through a narrow window with acks in
# between, redelivery after a disconnect, a bound raised and lowered while holding.
SCENARIOS = (
    [("send",)] * 4 + [("connect", 1), ("ack", [0]), ("disconnect",), ("connect", 2), ("ack", [1]), ("send",),
                       ("ack", [0, 1]), ("disconnect",), ("send",)],
    [("connect", 2), ("send",), ("send",), ("send",), ("resubscribe", 4), ("resubscribe", 1), ("ack", [0]),
     ("ack", [0]), ("disconnect",), ("connect", 3), ("ack", [2])],
)


def test_routed_feed_survives_random_schedules_of_sends_acks_and_reconnects(database_dsn, member_password_hash):
    numbers = itertools.count(1)
    with people_server(database_dsn, member_password_hash) as server:

        # No shrinking: it would re-run whole programs against the server; the
        # assertion names the step and the model state instead.
        @settings(max_examples=15, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=list(HealthCheck))
        @given(program=st.lists(STEP, min_size=4, max_size=24))
        def programs(program):
            server.run(run_program, server.base, next(numbers), program)

        for scenario in SCENARIOS:
            programs = example(program=scenario)(programs)

        programs()
