"""Routed delivery (issue 13; scope-model.md §2.3, §2.5, §3.4, §3.8, §3.10;
collaborator-policy.md §5) over the WebSocket against PostgreSQL: who gets a
`delivery` (live mentions and explicit recipients the Policy authorized,
notification states, reactions), and the agent daemon's feed: subscribe, ack,
redelivery after a reconnect, a feed shared by two connections, the in-flight
bound, and the re-check at handout (withdrawn message, revoked authority).

Absence is never shown by waiting: `delivery.list` is the durable record, and a
later delivery that must arrive first is the barrier for "nothing was pushed"."""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta, timezone

import pytest
import trio

from actors.delivery_router import DeliveryRouter
from storage import deliveries
from tests.conftest import App, add_person
from tests.test_collaborators import channel_add
from tests.test_private_visibility import as_agent, world  # noqa: F401  (world is a fixture)
from tests.test_protocol_boundary import no_error_logs  # noqa: F401  (a fixture)
from tests.test_tenancy import expect_error, signed_in

# Routing, handouts and every refused request here are normal operation: nothing logs an error.
pytestmark = pytest.mark.usefixtures("no_error_logs")

DELIVERY_BOUND = 20  # seconds a pushed delivery may take on a busy machine


async def next_delivery(conn) -> dict:
    """The next `delivery` push (other pushes are skipped); a missing one fails the test."""
    with trio.fail_after(DELIVERY_BOUND):
        while True:
            event = await conn.next_event()
            if event["event"] == "delivery":
                return event


async def deliveries_of(conn, count: int) -> list[dict]:
    return [(await next_delivery(conn))["data"] for _ in range(count)]


async def feed(conn, ws: dict) -> list[dict]:
    """The connection member's whole delivery feed, every status, in seq order."""
    entries, after = [], 0
    while True:
        page = await conn.call("delivery.list", after_seq=after, limit=200, **ws)
        entries += page["deliveries"]
        if page.get("next_after_seq") is None:
            return entries
        after = page["next_after_seq"]


def no_deliveries_pushed(conn) -> None:
    """Nothing delivered is left unread on the connection (after a barrier delivery)."""
    assert [e for e in conn.queued_events() if e["event"] == "delivery"] == []


async def mention(conn, scope_id: str, handle: str, ws: dict, text: str = "please", **extra) -> dict:
    return await conn.call("message.send", scope_id=scope_id, content=f"@{handle} {text}", **extra, **ws)


@pytest.fixture
async def cast(app: App, world, member_password_hash):  # noqa: F811
    """The `world` (owner, Bob, Carol, the owner's private agent Scout in a shared
    channel) plus: Bob holds a grant of the owner on the channel, Carol is a People
    collaborator of the owner there, Dave is a channel member with no authority."""
    alpha, bob, carol, agent, channel, key, ws = world
    dave = await add_person(app.db, alpha.workspace_id, "dave@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        await owner.call("scope.invite", scope_id=channel["id"], member_ids=[dave.member_id], **ws)
        grant = await owner.call("private_grant.create", scope_id=channel["id"], grantee_member_id=bob.member_id,
                                 **ws)
        await owner.call("collaborator.add", **channel_add(channel["id"], carol.member_id, ws))
    return alpha, bob, carol, dave, agent, channel, key, ws, grant


@contextlib.asynccontextmanager
async def people(app: App, *persons):
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(await signed_in(app, person)) for person in persons]


async def subscribed_agent(stack: contextlib.AsyncExitStack, app: App, key: str, ws: dict, **options):
    conn = await stack.enter_async_context(as_agent(app, key))
    subscribed = await conn.call("delivery.subscribe", **options, **ws)
    return conn, subscribed


async def routed_rows(app: App) -> tuple[int, int]:
    """(delivery ledger rows, `delivery.routed` outbox rows)."""
    return await app.db.run(lambda conn: conn.fetchrow(
        "SELECT (SELECT count(*) FROM scope_targeted_deliveries), "
        "(SELECT count(*) FROM scope_fanout_outbox WHERE fanout_type = 'delivery.routed')"))


# --- 1. who is woken by a mention or an explicit recipient --------------------------------------------------

async def test_only_members_with_authority_wake_a_private_agent(app: App, cast):
    alpha, bob, carol, dave, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    async with people(app, alpha.owner, bob, carol, dave) as (owner, b, c, d), contextlib.AsyncExitStack() as stack:
        scout, subscribed = await subscribed_agent(stack, app, key, ws)
        assert subscribed == {"latest_delivery_seq": 0, "unacked": 0}
        await d.call("message.send", scope_id=scope, content="an ordinary message", **ws)
        unauthorized = await mention(d, scope, "scout", ws, "no authority")
        from_collaborator = await mention(c, scope, "scout", ws, "as a collaborator")
        # Dave's mention stays plain text: the collaborator's is the first delivery.
        first = (await next_delivery(scout))
        assert first["scope_id"] == scope
        delivery = first["data"]
        assert (delivery["reason"], delivery["authority"], delivery["kind"], delivery["delivery_seq"]) == (
            "mention", "collaborator", "message", 1)
        assert delivery["dedupe_key"] == f"message:{from_collaborator['id']}:{agent['id']}"
        assert delivery["message_id"] == from_collaborator["id"]
        assert delivery["message"]["content"] == "@scout as a collaborator"
        assert (delivery["attempt"], delivery["push"], delivery["status"]) == (1, True, "leased")
        assert delivery.get("activity") is None and delivery["lease_expires_at_ms"] > delivery["created_at_ms"]
        from_owner = await mention(owner, scope, "scout", ws, "from the owner")
        from_grantee = await mention(b, scope, "scout", ws, "from the grantee")
        later = await deliveries_of(scout, 2)
        assert [(x["message_id"], x["authority"], x["delivery_seq"]) for x in later] == [
            (from_owner["id"], "owner", 2), (from_grantee["id"], "grant", 3)]
        # An explicit recipient is one delivery; a mention and a recipient together are one, reason mention.
        explicit = await owner.call("message.send", scope_id=scope, content="for you", **ws,
                                    recipient_member_ids=[agent["id"]])
        both = await mention(owner, scope, "scout", ws, "twice addressed", recipient_member_ids=[agent["id"]])
        # Nobody else may address it explicitly; its own mention of itself wakes nobody.
        error = await expect_error("forbidden", d.call("message.send", scope_id=scope, content="x", **ws,
                                                       recipient_member_ids=[agent["id"]]))
        assert error.details["reason"] == "recipient_not_addressable"
        await mention(scout, scope, "scout", ws, "talking to myself")
        barrier = await mention(owner, scope, "scout", ws, "last")
        assert [(x["message_id"], x["reason"]) for x in await deliveries_of(scout, 3)] == [
            (explicit["id"], "recipient"), (both["id"], "mention"), (barrier["id"], "mention")]
        no_deliveries_pushed(scout)
        listed = await feed(scout, ws)
        assert [x["message_id"] for x in listed] == [from_collaborator["id"], from_owner["id"], from_grantee["id"],
                                                      explicit["id"], both["id"], barrier["id"]]
        assert unauthorized["id"] not in {x["message_id"] for x in listed}
        assert [x["delivery_seq"] for x in listed] == [1, 2, 3, 4, 5, 6]
    # One ledger row and one targeted outbox row per routed message; ordinary messages write none.
    assert await routed_rows(app) == (6, 6)


async def test_forged_routing_metadata_is_refused_and_wakes_nobody(app: App, cast):
    alpha, bob, _, _, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    async with people(app, alpha.owner, bob) as (owner, b), contextlib.AsyncExitStack() as stack:
        scout, _ = await subscribed_agent(stack, app, key, ws)
        for conn in (owner, b):
            for field in ("mentions", "recipients", "wake_targets"):
                error = await expect_error("invalid", conn.call(
                    "message.send", scope_id=scope, content="routing by hand", metadata={field: [agent["id"]]},
                    **ws))
                assert error.details["field"] == f"metadata.{field}"
        # Below the top level the keys are ordinary client data: stored, never read as routing.
        nested = await owner.call("message.send", scope_id=scope, content="nested", **ws,
                                  metadata={"app": {"mentions": [agent["id"]], "recipients": [agent["id"]]}})
        assert nested["metadata"]["app"] == {"mentions": [agent["id"]], "recipients": [agent["id"]]}
        barrier = await mention(owner, scope, "scout", ws)
        assert (await next_delivery(scout))["data"]["message_id"] == barrier["id"]
        assert [x["message_id"] for x in await feed(scout, ws)] == [barrier["id"]]
    assert await routed_rows(app) == (1, 1)
    assert await app.db.run(lambda conn: conn.fetchval("SELECT count(*) FROM scope_messages")) == 2


# --- 3. notification states --------------------------------------------------------------------------------

async def test_notification_states_decide_who_is_woken(app: App, cast):
    alpha, bob, carol, dave, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    set_state = lambda conn, state, **who: conn.call("notification.set", scope_id=scope, state=state,  # noqa: E731
                                                     **who, **ws)
    async with people(app, alpha.owner, bob, dave) as (owner, b, d), contextlib.AsyncExitStack() as stack:
        scout, _ = await subscribed_agent(stack, app, key, ws)
        # Only the agent itself and its owner set its state; to anyone else it is not found.
        assert (await set_state(owner, "mute", member_id=agent["id"]))["state"] == "mute"
        await expect_error("not_found", set_state(b, "active", member_id=agent["id"]))
        await expect_error("not_found", set_state(b, "active", member_id=alpha.owner.member_id))
        muted = await mention(owner, scope, "scout", ws, "muted")
        assert (await set_state(scout, "no-wake"))["state"] == "no-wake"
        no_wake = await mention(owner, scope, "scout", ws, "not woken")
        await set_state(owner, "quiet", member_id=agent["id"])
        quiet = await mention(owner, scope, "scout", ws, "quietly")
        await set_state(owner, "active", member_id=agent["id"])
        await owner.call("message.send", scope_id=scope, content="ordinary while active", **ws)
        active = await mention(owner, scope, "scout", ws, "loud")
        # The quiet delivery is recorded but never pushed: the active one is the first push.
        pushed = await next_delivery(scout)
        assert (pushed["data"]["message_id"], pushed["data"]["delivery_seq"]) == (active["id"], 2)
        listed = await feed(scout, ws)
        assert [(x["message_id"], x["push"], x["delivery_seq"]) for x in listed] == [
            (quiet["id"], False, 1), (active["id"], True, 2)]
        assert not {muted["id"], no_wake["id"]} & {x["message_id"] for x in listed}

        # auto-wake: a human's ordinary message wakes it (with authority); an agent's never (not even one of
        # the same owner, which may wake it by a mention), an outsider's neither.
        await set_state(owner, "auto-wake", member_id=agent["id"])
        helper = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        await owner.call("scope.invite", scope_id=scope, member_ids=[helper["id"]], **ws)
        helper_key = (await owner.call("apikey.create", name="helper", member_id=helper["id"], **ws))["key"]
        async with as_agent(app, helper_key) as h:
            await h.call("message.send", scope_id=scope, content="an agent talking", **ws)
        await d.call("message.send", scope_id=scope, content="an outsider talking", **ws)
        await scout.call("message.send", scope_id=scope, content="scout talking", **ws)
        ordinary = await owner.call("message.send", scope_id=scope, content="the owner talking", **ws)
        woken = (await next_delivery(scout))["data"]
        assert (woken["message_id"], woken["reason"], woken["authority"], woken["delivery_seq"]) == (
            ordinary["id"], "auto_wake", "owner", 3)
        assert len(await feed(scout, ws)) == 3

        # Humans get their mention deliveries on the same feed; their states apply too.
        bob_conn = await stack.enter_async_context(await signed_in(app, bob))
        await bob_conn.call("delivery.subscribe", **ws)
        await set_state(b, "mute")
        await mention(owner, scope, "bob", ws, "muted bob")
        await set_state(b, "active")
        for_bob = await mention(d, scope, "bob", ws, "hello bob")
        got = (await next_delivery(bob_conn))["data"]
        assert (got["message_id"], got["reason"], got["delivery_seq"]) == (for_bob["id"], "mention", 1)
        assert [x["message_id"] for x in await feed(b, ws)] == [for_bob["id"]]


# --- 4. reactions as activity deliveries --------------------------------------------------------------------

async def test_a_reaction_on_the_agents_message_is_an_activity_delivery(app: App, cast):
    alpha, bob, carol, dave, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    async with people(app, alpha.owner, dave) as (owner, d), contextlib.AsyncExitStack() as stack:
        scout, _ = await subscribed_agent(stack, app, key, ws)
        output = await scout.call("message.send", scope_id=scope, content="scout output", **ws)
        await scout.call("reaction.add", message_id=output["id"], key=":robot:", **ws)  # its own: nothing
        await d.call("reaction.add", message_id=output["id"], key=":eyes:", **ws)  # no authority: nothing
        await owner.call("reaction.add", message_id=output["id"], key=":+1:", **ws)
        first = (await next_delivery(scout))["data"]
        assert (first["kind"], first["reason"], first["authority"], first["delivery_seq"]) == (
            "activity", "reaction", "owner", 1)
        # The message reacted to comes along, as the agent may read it now.
        assert first["message_id"] == first["message"]["id"] == output["id"]
        activity = first["activity"]
        assert (activity["actor_member_id"], activity["source_message_id"]) == (alpha.owner.member_id, output["id"])
        assert first["dedupe_key"] == f"activity:{activity['id']}:{agent['id']}"
        await owner.call("reaction.remove", message_id=output["id"], key=":+1:", **ws)  # removal: nothing
        await owner.call("reaction.add", message_id=output["id"], key=":tada:", **ws)
        second = (await next_delivery(scout))["data"]
        assert (second["delivery_seq"], second["activity"]["source_message_id"]) == (2, output["id"])
        assert second["activity"]["id"] != activity["id"]
        no_deliveries_pushed(scout)
        assert [x["kind"] for x in await feed(scout, ws)] == ["activity", "activity"]
    # Activities are first delivered by the worker's policy; one targeted outbox row each.
    policies = await app.db.run(lambda conn: conn.fetch(
        "SELECT delivery_policy FROM scope_fanout_outbox WHERE fanout_type = 'delivery.routed'"))
    assert [r[0] for r in policies] == ["worker_first_targeted"] * 2


# --- 5. ack, redelivery, a shared feed, the in-flight bound ---------------------------------------------------

async def test_unacked_deliveries_come_back_after_a_reconnect_and_acked_ones_never(app: App, cast):
    alpha, _, _, _, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    async with people(app, alpha.owner) as (owner,):
        sent = [await mention(owner, scope, "scout", ws, f"job {i}") for i in range(3)]
        keys = [f"message:{m['id']}:{agent['id']}" for m in sent]
        async with contextlib.AsyncExitStack() as stack:
            # Never handed out: replayed on subscribe in seq order, at most max_in_flight at a time.
            scout, subscribed = await subscribed_agent(stack, app, key, ws, max_in_flight=2)
            assert subscribed == {"latest_delivery_seq": 3, "unacked": 3}
            got = await deliveries_of(scout, 2)
            assert [(x["delivery_seq"], x["dedupe_key"], x["attempt"]) for x in got] == [
                (1, keys[0], 1), (2, keys[1], 1)]
            assert [x["status"] for x in await feed(scout, ws)] == ["leased", "leased", "pending"]
            assert (await scout.call("delivery.ack", delivery_seqs=[1], **ws)) == {"acked": [1]}
            # Acking is idempotent: already acked or unknown seqs are left out.
            assert (await scout.call("delivery.ack", delivery_seqs=[1, 99], **ws)) == {"acked": []}
            third = (await next_delivery(scout))["data"]  # the freed slot
            assert (third["delivery_seq"], third["attempt"]) == (3, 1)
        async with contextlib.AsyncExitStack() as stack:
            scout, subscribed = await subscribed_agent(stack, app, key, ws)
            assert subscribed == {"latest_delivery_seq": 3, "unacked": 2}
            again = await deliveries_of(scout, 2)
            assert sorted((x["delivery_seq"], x["dedupe_key"], x["attempt"]) for x in again) == [
                (2, keys[1], 2), (3, keys[2], 2)]
            assert (await scout.call("delivery.ack", delivery_seqs=[2], **ws)) == {"acked": [2]}
        async with contextlib.AsyncExitStack() as stack:
            scout, _ = await subscribed_agent(stack, app, key, ws)
            last = (await next_delivery(scout))["data"]
            assert (last["delivery_seq"], last["attempt"]) == (3, 3)
            assert (await scout.call("delivery.ack", delivery_seqs=[3, 2], **ws)) == {"acked": [3]}
            fresh = await mention(owner, scope, "scout", ws, "new")
            assert (await next_delivery(scout))["data"]["message_id"] == fresh["id"]  # never 1, 2 or 3 again
            no_deliveries_pushed(scout)
            assert [x["status"] for x in await feed(scout, ws)] == ["acked", "acked", "acked", "leased"]


async def test_two_connections_share_the_feed_and_unsubscribe_hands_back(app: App, cast):
    alpha, _, _, _, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    received: dict[str, list[int]] = {"a": [], "b": []}
    async with people(app, alpha.owner) as (owner,), contextlib.AsyncExitStack() as stack:
        a, _ = await subscribed_agent(stack, app, key, ws, max_in_flight=3)
        b, _ = await subscribed_agent(stack, app, key, ws, max_in_flight=3)
        for i in range(6):
            await mention(owner, scope, "scout", ws, f"work {i}")

        async def collect(name: str, conn) -> None:
            while len(received["a"]) + len(received["b"]) < 6:
                received[name].append((await next_delivery(conn))["data"]["delivery_seq"])
                if len(received["a"]) + len(received["b"]) >= 6:
                    nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, "a", a)
            nursery.start_soon(collect, "b", b)
        # Each delivery leased to one connection at a time; together they hold the whole feed.
        assert sorted(received["a"] + received["b"]) == [1, 2, 3, 4, 5, 6]
        assert len(received["a"]) == len(received["b"]) == 3
        # b makes room: the next mention fills it, never a's deliveries (a still holds them).
        await b.call("delivery.ack", delivery_seqs=received["b"], **ws)
        first_fresh = await mention(owner, scope, "scout", ws, "while a holds its share")
        assert (await next_delivery(b))["data"]["message_id"] == first_fresh["id"]
        # Unsubscribing hands a's unacked deliveries back: b gets them as it has room.
        assert (await a.call("delivery.unsubscribe", **ws)) == {"ok": True}
        handed_back = await deliveries_of(b, 2)
        await b.call("delivery.ack", delivery_seqs=[7], **ws)
        handed_back += await deliveries_of(b, 1)
        assert sorted(x["delivery_seq"] for x in handed_back) == sorted(received["a"])
        assert all(x["attempt"] == 2 for x in handed_back)
        second_fresh = await mention(owner, scope, "scout", ws, "after the unsubscribe")
        await b.call("delivery.ack", delivery_seqs=received["a"], **ws)
        assert (await next_delivery(b))["data"]["message_id"] == second_fresh["id"]
        no_deliveries_pushed(a)


# --- 5b. leases that lapse on an open connection, and poison deliveries ------------------------------------------

class RouterClock:
    """The delivery router's wall clock (leases, expiry), moved by the test."""

    def __init__(self) -> None:
        self.offset = timedelta()

    def now(self) -> datetime:
        return datetime.now(timezone.utc) + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += timedelta(seconds=seconds)


def _router_with_clock(monkeypatch: pytest.MonkeyPatch, sweep_seconds: float) -> RouterClock:
    clock = RouterClock()
    original = DeliveryRouter.__init__

    def with_test_clock(self, db, **options):
        original(self, db, **options, sweep_seconds=sweep_seconds, clock=clock.now)

    monkeypatch.setattr(DeliveryRouter, "__init__", with_test_clock)
    return clock


@pytest.fixture
def router_clock(monkeypatch: pytest.MonkeyPatch) -> RouterClock:
    """Request before `app`: the server's router takes this clock, and sweeps often
    so that a lease the clock expired is found at once."""
    return _router_with_clock(monkeypatch, 0.05)


@pytest.fixture
def router_clock_no_sweep(monkeypatch: pytest.MonkeyPatch) -> RouterClock:
    """As `router_clock`, but the sweep never runs within a test: what an expired
    lease does is decided by whatever else reaches the router."""
    return _router_with_clock(monkeypatch, 3600)


LEASE = 60  # --delivery-lease-seconds' default, which the app fixture runs with


@pytest.mark.parametrize("max_in_flight", [1, 100])
async def test_a_lease_that_expires_on_an_open_connection_is_handed_out_again(router_clock, app: App, cast,
                                                                               max_in_flight):
    alpha, _, _, _, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    async with people(app, alpha.owner) as (owner,), contextlib.AsyncExitStack() as stack:
        scout, _ = await subscribed_agent(stack, app, key, ws, max_in_flight=max_in_flight)
        sent = await mention(owner, scope, "scout", ws, "handle me")
        first = (await next_delivery(scout))["data"]
        assert first["lease_expires_at_ms"] - first["created_at_ms"] >= (LEASE - 5) * 1000
        router_clock.advance(LEASE + 1)
        again = (await next_delivery(scout))["data"]  # the same connection, never acked
        assert (again["dedupe_key"], again["delivery_seq"], again["attempt"]) == (first["dedupe_key"], 1, 2)
        assert again["message_id"] == sent["id"]
        assert (await scout.call("delivery.ack", delivery_seqs=[1], **ws)) == {"acked": [1]}
        router_clock.advance(LEASE + 1)
        barrier = await mention(owner, scope, "scout", ws, "next")
        assert (await next_delivery(scout))["data"]["message_id"] == barrier["id"]
        no_deliveries_pushed(scout)


async def test_a_delivery_never_acked_fails_after_max_attempts(router_clock, app: App, cast):
    alpha, _, _, _, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    async with people(app, alpha.owner) as (owner,), contextlib.AsyncExitStack() as stack:
        scout, _ = await subscribed_agent(stack, app, key, ws)
        poison = await mention(owner, scope, "scout", ws, "crashes every daemon")
        attempts = [(await next_delivery(scout))["data"]["attempt"]]
        for _ in range(9):
            router_clock.advance(LEASE + 1)
            attempts.append((await next_delivery(scout))["data"]["attempt"])
        assert attempts == list(range(1, 11))
        # A second unacked delivery whose lease lapses at the same moment: the sweep that
        # hands it out again is the one that finds the poison (one transaction).
        other = await mention(owner, scope, "scout", ws, "an ordinary job")
        assert (await next_delivery(scout))["data"]["message_id"] == other["id"]
        router_clock.advance(LEASE + 1)
        again = (await next_delivery(scout))["data"]
        assert (again["message_id"], again["attempt"]) == (other["id"], 2)
        listed = await feed(scout, ws)
        assert [(x["message_id"], x["status"], x.get("suppression_reason"), x["attempt"]) for x in listed] == [
            (poison["id"], "failed", "max_attempts", 10), (other["id"], "leased", None, 2)]


async def test_a_late_offer_of_a_delivery_already_handed_out_does_not_renew_its_lease(router_clock_no_sweep,
                                                                                      app: App, cast):
    """A fill can read a just-committed delivery from the ledger before its inline
    offer reaches the router; that offer, arriving after the lease expired, must not
    hand it out again on its own (only the sweep renews expired leases: it takes the
    feed's expired ones in order and fails those out of attempts)."""
    alpha, _, _, _, agent, channel, key, ws, _ = cast
    scope = channel["id"]
    async with people(app, alpha.owner) as (owner,), contextlib.AsyncExitStack() as stack:
        scout, _ = await subscribed_agent(stack, app, key, ws)
        sent = await mention(owner, scope, "scout", ws, "handle me")
        first = (await next_delivery(scout))["data"]
        assert first["message_id"] == sent["id"]
        row = await app.db.run(lambda conn: conn.fetchrow(
            "SELECT * FROM scope_targeted_deliveries WHERE message_id = $1", sent["id"]))
        router_clock_no_sweep.advance(LEASE + 1)
        app.server.deliveries.offer([deliveries.routed_from_row(row)])
        barrier = await mention(owner, scope, "scout", ws, "next")
        assert (await next_delivery(scout))["data"]["message_id"] == barrier["id"]
        no_deliveries_pushed(scout)
        listed = await feed(scout, ws)
        assert [(x["message_id"], x["attempt"]) for x in listed] == [(sent["id"], 1), (barrier["id"], 1)]


# --- 6. every delivery is readable; the re-check at handout ----------------------------------------------------

async def test_every_delivery_is_readable_and_handout_rechecks_authority(app: App, cast):
    alpha, bob, carol, _, agent, channel, key, ws, grant = cast
    scope = channel["id"]
    async with people(app, alpha.owner, bob, carol) as (owner, b, c):
        delivered_while_away = [await mention(conn, scope, "scout", ws, f"from {who}")
                                for who, conn in (("owner", owner), ("bob", b), ("carol", c))]
        revoked_before_handout = await mention(b, scope, "scout", ws, "granted at commit time")
        withdrawn = await mention(owner, scope, "scout", ws, "withdrawn before handout")
        await owner.call("message.withdraw", message_id=withdrawn["id"], **ws)
        await owner.call("private_grant.revoke", grant_id=grant["id"], **ws)
        barrier = await mention(owner, scope, "scout", ws, "after the revoke")
        async with contextlib.AsyncExitStack() as stack:
            scout, _ = await subscribed_agent(stack, app, key, ws)
            got = await deliveries_of(scout, 3)
            # Nothing was handed out before the revoke: both of Bob's (grant-authorized when they
            # committed) are suppressed at handout, and so is the withdrawn one.
            assert [x["message_id"] for x in got] == [delivered_while_away[0]["id"], delivered_while_away[2]["id"],
                                                      barrier["id"]]
            for delivery in got:
                read = await scout.call("message.get", message_id=delivery["message_id"], **ws)
                assert read["message"]["id"] == delivery["message_id"]
                explained = await scout.call("visibility.explain", message_id=delivery["message_id"],
                                             member_id=agent["id"], **ws)
                assert explained["readable"]
            no_deliveries_pushed(scout)
            statuses = {x["message_id"]: (x["status"], x.get("suppression_reason")) for x in await feed(scout, ws)}
            assert statuses == {
                delivered_while_away[0]["id"]: ("leased", None),
                delivered_while_away[1]["id"]: ("suppressed", "authority_revoked"),
                delivered_while_away[2]["id"]: ("leased", None),
                revoked_before_handout["id"]: ("suppressed", "authority_revoked"),
                withdrawn["id"]: ("suppressed", "message_withdrawn"), barrier["id"]: ("leased", None)}


# --- 8. bad input ----------------------------------------------------------------------------------------------

async def test_bad_input_to_the_delivery_ops_gets_typed_errors(app: App, cast):
    alpha, bob, _, _, agent, channel, key, ws, _ = cast
    async with as_agent(app, key) as scout, people(app, alpha.owner, bob) as (owner, b):
        probes = [
            ("delivery.subscribe", {"max_in_flight": 0}), ("delivery.subscribe", {"max_in_flight": 1001}),
            ("delivery.subscribe", {"max_in_flight": "5"}), ("delivery.subscribe", {"max_in_flight": 2.5}),
            ("delivery.subscribe", {"unknown": 1}),
            ("delivery.ack", {}), ("delivery.ack", {"delivery_seqs": []}),
            ("delivery.ack", {"delivery_seqs": list(range(1, 258))}), ("delivery.ack", {"delivery_seqs": ["1"]}),
            ("delivery.ack", {"delivery_seqs": 1}), ("delivery.ack", {"delivery_seqs": [None]}),
            ("delivery.unsubscribe", {"max_in_flight": 1}),
            ("delivery.list", {"after_seq": -1}), ("delivery.list", {"limit": 0}), ("delivery.list", {"limit": 201}),
            ("delivery.list", {"after_seq": "x"}), ("delivery.list", {"limit": None}),
            ("notification.set", {"scope_id": channel["id"], "state": "loud", "member_id": agent["id"]}),
            ("notification.set", {"scope_id": channel["id"], "state": "mute", "member_id": 7}),
        ]
        for op, fields in probes:
            await expect_error("bad_frame", scout.call(op, **fields, **ws))
        # Well-typed but meaningless ids: invalid; an id that names nobody here: not_found.
        await expect_error("invalid", owner.call("notification.set", scope_id=channel["id"], state="mute",
                                                 member_id="nobody", **ws))
        await expect_error("not_found", owner.call("notification.set", scope_id=channel["id"], state="mute",
                                                   member_id="mem_zzzzzzzzzzzzzz", **ws))
        # The owner's agent must be a member of the scope it is set for.
        other = await owner.call("channel.create", slug="elsewhere", display_name="Elsewhere", **ws)
        await expect_error("not_found", owner.call("notification.set", scope_id=other["id"], state="mute",
                                                   member_id=agent["id"], **ws))
        # A human without a workspace named gets workspace_required; the connection keeps working.
        await expect_error("workspace_required", b.call("delivery.subscribe"))
        assert (await scout.call("delivery.list", **ws))["deliveries"] == []
    async with as_agent(app, key) as fresh:
        assert (await fresh.call("ping"))["protocol_version"] == 1
