"""Routed delivery in DMs (reason `direct`), the agent-to-agent loop guard,
retention expiry, and a connection that signs in as someone else (issue 13)."""

from __future__ import annotations

import contextlib
from datetime import timedelta


from tests.conftest import App
from tests.test_private_visibility import as_agent, world  # noqa: F401  (world is a fixture)
from tests.test_routed_delivery import feed, next_delivery, no_deliveries_pushed, router_clock  # noqa: F401
from tests.test_messaging import open_channel
from tests.test_tenancy import signed_in


async def test_a_dm_message_wakes_the_other_member_but_agents_never_wake_agents(app: App, world):  # noqa: F811
    alpha, bob, _, scout, _, scout_key, ws = world
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            contextlib.AsyncExitStack() as stack:
        herald = await owner.call("agent.create", handle="herald", display_name="Herald", visibility="public", **ws)
        herald_key = (await owner.call("apikey.create", name="herald", member_id=herald["id"], **ws))["key"]
        scout_conn = await stack.enter_async_context(as_agent(app, scout_key))
        herald_conn = await stack.enter_async_context(as_agent(app, herald_key))
        for conn in (owner, b, scout_conn, herald_conn):
            await conn.call("delivery.subscribe", **ws)
        # The owner writes to its private agent: a direct delivery, by the owner's right.
        private_dm = await owner.call("dm.open", member_id=scout["id"], **ws)
        sent = await owner.call("message.send", scope_id=private_dm["id"], content="summarise the week", **ws)
        delivery = (await next_delivery(scout_conn))["data"]
        assert (delivery["reason"], delivery["authority"], delivery["message_id"]) == ("direct", "owner", sent["id"])
        # The agent's answer is a direct delivery to the owner (a human hears of every DM message).
        answer = await scout_conn.call("message.send", scope_id=private_dm["id"], content="done", **ws)
        assert (await next_delivery(owner))["data"]["message_id"] == answer["id"]
        # A human writing to a public agent wakes it; the agent's reply reaches the human.
        public_dm = await b.call("dm.open", member_id=herald["id"], **ws)
        await b.call("message.send", scope_id=public_dm["id"], content="hello", **ws)
        assert (await next_delivery(herald_conn))["data"]["reason"] == "direct"
        reply = await herald_conn.call("message.send", scope_id=public_dm["id"], content="hi", **ws)
        assert (await next_delivery(b))["data"]["message_id"] == reply["id"]
        # Two agents in a DM never wake each other by writing there: they would forever.
        agents_dm = await herald_conn.call("dm.open", member_id=(await owner.call(
            "agent.create", handle="echo", display_name="Echo", visibility="public", **ws))["id"], **ws)
        await herald_conn.call("message.send", scope_id=agents_dm["id"], content="ping", **ws)
        # The barrier: the owner's next DM to Scout arrives, and nothing else was routed.
        barrier = await owner.call("message.send", scope_id=private_dm["id"], content="next", **ws)
        assert (await next_delivery(scout_conn))["data"]["message_id"] == barrier["id"]
        echo_id = next(m["member_id"] for m in (await herald_conn.call(
            "scope.members", scope_id=agents_dm["id"], **ws))["members"] if m["member_id"] != herald["id"])
        assert await app.db.run(lambda conn: conn.fetchval(
            "SELECT count(*) FROM scope_targeted_deliveries WHERE recipient_member_id = $1", echo_id)) == 0
        no_deliveries_pushed(herald_conn)


async def test_muted_dm_routes_nothing_and_quiet_records_without_push(app: App, world):  # noqa: F811
    alpha, bob, _, _, _, _, ws = world
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        await b.call("delivery.subscribe", **ws)
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        await b.call("notification.set", scope_id=dm["id"], state="mute", **ws)
        await owner.call("message.send", scope_id=dm["id"], content="muted", **ws)
        await b.call("notification.set", scope_id=dm["id"], state="quiet", **ws)
        quiet = await owner.call("message.send", scope_id=dm["id"], content="quiet", **ws)
        await b.call("notification.set", scope_id=dm["id"], state="active", **ws)
        loud = await owner.call("message.send", scope_id=dm["id"], content="loud", **ws)
        assert (await next_delivery(b))["data"]["message_id"] == loud["id"]  # the quiet one was never pushed
        assert [(d["message_id"], d["push"]) for d in await feed(b, ws)] == [(quiet["id"], False), (loud["id"], True)]
        # `unacked` counts what waits to be pushed: the loud one, not the quiet one.
        assert await b.call("delivery.subscribe", **ws) == {"latest_delivery_seq": 2, "unacked": 1}


async def test_unacked_deliveries_expire_after_the_retention(router_clock, app: App, world):  # noqa: F811
    alpha, bob, _, _, _, _, ws = world
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        old = await owner.call("message.send", scope_id=dm["id"], content="old news", **ws)
        assert await app.server.deliveries.expire_due() == 0  # within the retention
        assert (await feed(b, ws))[0]["status"] == "pending"
        router_clock.advance(timedelta(hours=168, seconds=1).total_seconds())
        await app.server.deliveries.expire_due()  # what the router's sweep runs (it may have run it first)
        # Nothing waits any more: a subscribe has nothing to hand out.
        assert await b.call("delivery.subscribe", **ws) == {"latest_delivery_seq": 1, "unacked": 0}
        expired = (await feed(b, ws))[0]
        assert (expired["message_id"], expired["status"], expired["suppression_reason"]) == (
            old["id"], "expired", "retention")


async def test_signing_in_as_someone_else_drops_the_previous_members_feed(app: App, world):  # noqa: F811
    alpha, bob, _, scout, _, scout_key, ws = world
    async with await signed_in(app, alpha.owner) as owner, as_agent(app, scout_key) as conn, \
            contextlib.AsyncExitStack() as stack:
        await conn.call("delivery.subscribe", **ws)
        await conn.login(bob.email, bob.password)  # the same socket is Bob's now
        dm = await owner.call("dm.open", member_id=scout["id"], **ws)
        sent = await owner.call("message.send", scope_id=dm["id"], content="for Scout only", **ws)
        # Scout's real connection gets its first handout: nothing was leased to Bob's socket.
        scout_conn = await stack.enter_async_context(as_agent(app, scout_key))
        await scout_conn.call("delivery.subscribe", **ws)
        delivery = (await next_delivery(scout_conn))["data"]
        assert (delivery["message_id"], delivery["attempt"]) == (sent["id"], 1)
        await conn.call("ping")
        assert [e for e in conn.queued_events() if e["event"] == "delivery"] == []


async def test_an_edit_wakes_only_the_members_it_newly_mentions(app: App, world):  # noqa: F811
    alpha, bob, _, _, _, _, ws = world
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        await b.call("delivery.subscribe", **ws)
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        channel = await open_channel(owner, alpha.workspace_id, "edits", [bob.member_id])
        plain = await owner.call("message.send", scope_id=channel["id"], content="later", **ws)
        await owner.call("message.edit", message_id=plain["id"], content="later @bob", expected_revision=1, **ws)
        woken = await next_delivery(b)
        assert (woken["data"]["message_id"], woken["data"]["reason"]) == (plain["id"], "mention")
        # Still mentioned, mentioned again after a removal, or withdrawn: nobody is woken twice.
        await owner.call("message.edit", message_id=plain["id"], content="later @bob!", expected_revision=2, **ws)
        await owner.call("message.edit", message_id=plain["id"], content="later", expected_revision=3, **ws)
        await owner.call("message.edit", message_id=plain["id"], content="@bob later", expected_revision=4, **ws)
        await owner.call("message.withdraw", message_id=plain["id"], **ws)
        barrier = await owner.call("message.send", scope_id=dm["id"], content="next", **ws)
        assert (await next_delivery(b))["data"]["message_id"] == barrier["id"]
        assert [d["message_id"] for d in await feed(b, ws)] == [plain["id"], barrier["id"]]


async def test_the_feed_listing_hides_what_you_no_longer_read(app: App, world):  # noqa: F811
    alpha, bob, _, _, channel, _, ws = world
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        mine = await b.call("message.send", scope_id=channel["id"], content="my idea", **ws)
        await owner.call("reaction.add", message_id=mine["id"], key="👍", **ws)
        entry = (await feed(b, ws))[0]  # written with the reaction (the outbox worker only hands it out)
        assert (entry["reason"], entry["kind"], entry["message"]["content"]) == ("reaction", "activity", "my idea")
        assert entry["activity"]["actor_member_id"] == alpha.owner.member_id
        await b.call("scope.leave", scope_id=channel["id"], **ws)
        hidden = (await feed(b, ws))[0]
        assert hidden["dedupe_key"] == entry["dedupe_key"]
        assert hidden.get("message") is None and hidden.get("activity") is None
