"""Audience mentions, the third-party mention gate, mentions added by an edit and
reactions in a strand (issue 16; strand-message.md §9.4.2-§9.4.5, §9.8.6) over the
WebSocket against PostgreSQL.

Who heard of what is read from each member's routed feed (`delivery.list`, the
durable record, written in the send's transaction): absence is never shown by
waiting.  Grant expiry and quota periods run on the registry's injectable clock."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import pytest
import trio

from client import ClientError
from storage.bridge import Database, PoolSettings
from storage.errors import DatabaseUnavailable
from tests.conftest import App, add_person
from tests.db_faults import LOCK_HOLDER, release_locks, wait_for_query
from tests.test_messaging import open_channel
from tests.test_private_visibility import as_agent
from tests.test_protocol_boundary import no_error_logs  # noqa: F401  (a fixture)
from tests.test_routed_delivery import feed
from tests.test_tenancy import expect_error, signed_in

# Refusals here are normal operation: nothing logs an error.
pytestmark = pytest.mark.usefixtures("no_error_logs")

# Every audience a strand knows (`policy` allows each with a cap larger than any room here).
ALL_AUDIENCES = ("effective_scope_members", "strand_engaged", "strand_participants", "strand_watchers",
                 "assigned_actors")
HUMANS = ("bob", "carol", "adam", "vera", "erin", "dave")
AGENTS = ("pilot", "scout")


class Clock:
    """The registry's wall clock (grant expiry, quota periods), moved by the test."""

    def __init__(self) -> None:
        self.base = datetime.now(timezone.utc)
        self.offset = timedelta()

    def __call__(self) -> datetime:
        return self.base + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += timedelta(seconds=seconds)


@dataclass
class Room:
    """The owner and everyone else signed in; `channel` holds every human but Dave, the
    owner's public agent Pilot and private agent Scout; `strand` is a strand on its board."""

    app: App
    conns: dict
    ids: dict
    ws: dict
    channel: str
    board: str
    strand: str
    clock: Clock
    heads: dict = field(default_factory=dict)

    def __getitem__(self, name: str):
        return self.conns[name]

    async def send(self, who: str, scope_id: str, content: str, **extra) -> dict:
        return await self.conns[who].call("message.send", scope_id=scope_id, content=content, **extra, **self.ws)

    async def refused(self, code: str, reason: str, who: str, scope_id: str, content: str, **extra) -> ClientError:
        """A send refused with `code`/`reason` that wrote no message and no delivery."""
        before = await self.rows()
        error = await expect_error(code, self.send(who, scope_id, content, **extra))
        assert error.details.get("reason") == reason, error.details
        assert await self.rows() == before
        return error

    async def rows(self) -> tuple[int, int]:
        return await self.app.db.run(lambda conn: conn.fetchrow(
            "SELECT (SELECT count(*) FROM scope_messages), (SELECT count(*) FROM scope_targeted_deliveries)"))

    async def news(self) -> dict[str, list[tuple]]:
        """Each member's deliveries since the last call: (message id or the reacted message's id,
        reason, reasons); members with none are left out."""
        out = {}
        for who, conn in self.conns.items():
            entries = [d for d in await feed(conn, self.ws) if d["delivery_seq"] > self.heads.get(who, 0)]
            if entries:
                self.heads[who] = entries[-1]["delivery_seq"]
                out[who] = [(d.get("message_id") or d["activity"]["source_message_id"], d["reason"],
                             d.get("reasons", [])) for d in entries]
        return out

    async def policy(self, *audiences: str, max_recipients: int = 1000) -> None:
        for audience in audiences:
            await self.conns["owner"].call("audience_mention.policy.set", audience=audience,
                                           max_recipients=max_recipients, **self.ws)

    async def grant(self, who: str, channel_id: str | None = None, max_operations: int = 100,
                    period_seconds: int = 3600, expires_in_seconds: int = 3600) -> dict:
        return await self.conns["owner"].call(
            "audience_mention.grant.create", member_id=self.ids[who], channel_id=channel_id or self.channel,
            max_operations=max_operations, period_seconds=period_seconds, expires_in_seconds=expires_in_seconds,
            **self.ws)

    async def uses(self, grant: dict) -> int:
        listed = await self.conns["owner"].call("audience_mention.grant.list", **self.ws)
        return next(g for g in listed["grants"] if g["id"] == grant["id"]).get("uses", 0)


@pytest.fixture
async def cast(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    people = {name: await add_person(app.db, alpha.workspace_id, f"{name}@example.com", role, member_password_hash)
              for name, role in (("bob", "developer"), ("carol", "operator"), ("adam", "admin"),
                                 ("vera", "viewer"), ("erin", "developer"), ("dave", "developer"))}
    return alpha, people


@contextlib.asynccontextmanager
async def room(app: App, cast):
    alpha, people = cast
    ws = {"workspace_id": alpha.workspace_id}
    clock = Clock()
    app.server.registry.clock = clock
    async with contextlib.AsyncExitStack() as stack:
        owner = await stack.enter_async_context(await signed_in(app, alpha.owner))
        conns, ids = {"owner": owner}, {"owner": alpha.owner.member_id}
        for name in HUMANS:
            conns[name] = await stack.enter_async_context(await signed_in(app, people[name]))
            ids[name] = people[name].member_id
        keys = {}
        for handle, visibility in (("pilot", "public"), ("scout", "private")):
            agent = await owner.call("agent.create", handle=handle, display_name=handle.title(),
                                     visibility=visibility, **ws)
            ids[handle] = agent["id"]
            keys[handle] = (await owner.call("apikey.create", name=handle, member_id=agent["id"], **ws))["key"]
        channel = await open_channel(owner, alpha.workspace_id, "work",
                                     [ids[n] for n in HUMANS if n != "dave"] + [ids[a] for a in AGENTS])
        for handle in AGENTS:
            conns[handle] = await stack.enter_async_context(as_agent(app, keys[handle]))
        board = await owner.call("board.create", channel_id=channel["id"], name="Sprint", **ws)
        strand = await owner.call("strand.create", board_id=board["id"], title="Payments", **ws)
        yield Room(app, conns, ids, ws, channel["id"], board["id"], strand["id"], clock)


def only_audience(news: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """The deliveries that carry the audience_mention reason."""
    picked = {who: [n for n in notes if "audience_mention" in n[2]] for who, notes in news.items()}
    return {who: notes for who, notes in picked.items() if notes}


# --- §9.4.4: policy, grant, channel coverage --------------------------------------------------------------------

async def test_audience_mentions_need_a_policy_and_a_grant_covering_the_channel(app: App, cast):
    async with room(app, cast) as r:
        # Default: no policy, every audience disabled; the whole message is refused, nothing written.
        await r.refused("forbidden", "audience_mention_disabled", "owner", r.channel, "@all standup")
        await r.refused("forbidden", "audience_mention_disabled", "owner", r.strand, "@here standup")
        assert (await r["bob"].call("audience_mention.policy.list", **r.ws))["policies"] == []
        await expect_error("forbidden", r["bob"].call("audience_mention.policy.set",
                                                      audience="effective_scope_members", max_recipients=5, **r.ws))
        await r.policy("effective_scope_members")
        # A policy alone is not enough: the author needs a live grant on the channel.
        await r.refused("forbidden", "audience_mention_not_granted", "bob", r.channel, "@all standup")
        elsewhere = await open_channel(r["owner"], r.ws["workspace_id"], "elsewhere", [r.ids["bob"]])
        await r.grant("bob", elsewhere["id"])
        await r.refused("forbidden", "audience_mention_not_granted", "bob", r.channel, "@all standup")
        await r.refused("forbidden", "audience_mention_not_granted", "bob", r.strand, "@all standup")
        # Granted on the channel: the channel, its threads and its boards' strands.
        await r.grant("bob", r.channel)
        in_channel = await r.send("bob", r.channel, "@all standup")
        root = await r.send("owner", r.channel, "a thread root")
        in_thread = await r["bob"].call("thread.reply", scope_id=r.channel, root_message_id=root["id"],
                                        content="@all in the thread", **r.ws)
        in_strand = await r.send("bob", r.strand, "@all in the strand")
        for message in (in_channel, in_thread, in_strand):
            assert message["metadata"]["audience_mentions"] == [
                {"audience": "effective_scope_members", "mention_text_original": "@all"}]
        # Every reader but the author; never Dave (not in the channel) nor the private agent Scout.
        readers = ("owner", "carol", "adam", "vera", "erin", "pilot")
        expected = {who: [(m["id"], "audience_mention", ["audience_mention"]) for m in (in_channel, in_strand)]
                    for who in readers}
        # The thread's readers are its members: the root's author and Bob.
        expected["owner"].insert(1, (in_thread["id"], "audience_mention", ["audience_mention"]))
        assert await r.news() == expected
        # Another strand audience keeps its own policy: still disabled.
        await r.refused("forbidden", "audience_mention_disabled", "bob", r.strand, "@here standup")
        # A board on another channel is not covered by this channel's grant.
        other_board = await r["owner"].call("board.create", channel_id=elsewhere["id"], name="Other", **r.ws)
        other_strand = await r["owner"].call("strand.create", board_id=other_board["id"], title="Other", **r.ws)
        await r.grant("carol", r.channel)
        await r["owner"].call("scope.invite", scope_id=elsewhere["id"], member_ids=[r.ids["carol"]], **r.ws)
        await r.refused("forbidden", "audience_mention_not_granted", "carol", other_strand["id"], "@all hi")


async def test_an_expired_or_revoked_grant_stops_working(app: App, cast):
    async with room(app, cast) as r:
        await r.policy("effective_scope_members")
        expiring = await r.grant("bob", expires_in_seconds=120)
        await r.send("bob", r.channel, "@all early")
        r.clock.advance(119)
        await r.send("bob", r.strand, "@all just in time")
        r.clock.advance(2)
        await r.refused("forbidden", "audience_mention_not_granted", "bob", r.channel, "@all too late")
        await r.refused("forbidden", "audience_mention_not_granted", "bob", r.strand, "@all too late")
        listed = (await r["bob"].call("audience_mention.grant.list", **r.ws))["grants"]
        assert [(g["id"], g["active"], g["uses"]) for g in listed] == [(expiring["id"], False, 2)]
        renewed = await r.grant("bob")
        await r.send("bob", r.channel, "@all renewed")
        revoked = await r["owner"].call("audience_mention.grant.revoke", grant_id=renewed["id"], **r.ws)
        assert not revoked["active"] and revoked["revoked_at_ms"] is not None
        await r.refused("forbidden", "audience_mention_not_granted", "bob", r.channel, "@all after the revoke")
        # Only the audience mention needs the grant.
        await r.send("bob", r.channel, "plain words still go through")


async def test_the_quota_allows_max_operations_per_period_and_replays_are_free(app: App, cast):
    async with room(app, cast) as r:
        await r.policy("effective_scope_members")
        grant = await r.grant("bob", max_operations=2, period_seconds=600)
        first = await r.send("bob", r.channel, "@all one", client_message_id="one")
        # A replay answers the first send again and uses no quota.
        replay = await r.send("bob", r.channel, "@all one", client_message_id="one")
        assert replay["id"] == first["id"] and replay["replayed"]
        r.clock.advance(300)
        await r.send("bob", r.strand, "@all two")  # the grant's quota spans the channel and its strands
        error = await r.refused("rate_limited", "audience_mention_quota", "bob", r.channel, "@all three")
        assert set(error.details) == {"reason"}  # nothing about the grant or the audience's size
        assert (await r.send("bob", r.channel, "@all one", client_message_id="one"))["id"] == first["id"]
        await r.send("bob", r.channel, "no audience: no quota")
        assert await r.uses(grant) == 2
        r.clock.advance(301)  # the first use left the period, the second is still in it
        await r.send("bob", r.channel, "@all three")
        await r.refused("rate_limited", "audience_mention_quota", "bob", r.strand, "@all four")
        r.clock.advance(300)
        await r.send("bob", r.strand, "@all four")
        assert await r.uses(grant) == 4


async def test_concurrent_sends_never_exceed_the_quota(app: App, cast, database_dsn):
    """Sends of one author at once: in two scopes (two actors, two transactions that both
    want the grant) and several in one batch of one actor; the quota holds across all."""
    _, people = cast
    async with room(app, cast) as r, contextlib.AsyncExitStack() as stack, \
            Database(database_dsn, PoolSettings(min_size=1, max_size=2)) as admin:
        # Bob on six connections (a connection answers its requests in order).
        bobs = [await stack.enter_async_context(await signed_in(app, people["bob"])) for _ in range(6)]
        await r.policy("effective_scope_members")
        grant = await r.grant("bob", max_operations=3)
        outcomes: list = []

        async def send(conn, scope_id: str, text: str) -> None:
            try:
                await conn.call("message.send", scope_id=scope_id, content=text, **r.ws)
                outcomes.append("sent")
            except ClientError as error:
                outcomes.append((error.code, error.details.get("reason")))

        async def hold(conn):
            await conn.execute("SELECT 1 FROM audience_mention_grants WHERE id = $1 FOR UPDATE", grant["id"])
            await conn.execute("SELECT pg_sleep(60)")

        async def holder() -> None:
            with contextlib.suppress(DatabaseUnavailable):  # release_locks ends it
                await admin.transaction(hold)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await wait_for_query(admin, LOCK_HOLDER)
            # Preconditions, not the behaviour under test: both actors wait on the held grant row,
            # and the channel's next sends queue up behind it (they commit in one batch).
            nursery.start_soon(send, bobs[0], r.channel, "@all channel first")
            nursery.start_soon(send, bobs[1], r.strand, "@all strand first")
            with trio.fail_after(20):
                while await admin.run(lambda c: c.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%FROM audience_mention_grants%FOR UPDATE'")) < 2:
                    await trio.sleep(0.05)
            for i in range(4):
                nursery.start_soon(send, bobs[2 + i], r.channel, f"@all channel {i}")
            with trio.fail_after(20):
                while sum(app.server.registry.mailbox_depths()) < 4:
                    await trio.sleep(0.01)
            await release_locks(admin)
        assert sorted(outcomes, key=str) == [("rate_limited", "audience_mention_quota")] * 3 + ["sent"] * 3
        assert await r.uses(grant) == 3
        sent = await app.db.run(lambda conn: conn.fetchval(
            "SELECT count(*) FROM scope_messages WHERE content LIKE '@all %'"))
        assert sent == 3


# --- §9.4.3: who each audience reaches --------------------------------------------------------------------------

async def test_each_strand_audience_reaches_its_members_and_only_readers(app: App, cast):
    async with room(app, cast) as r:
        await r.policy(*ALL_AUDIENCES)
        await r.grant("owner")
        await r["bob"].call("strand.watch.set", strand_id=r.strand, level="participating", **r.ws)
        await r["erin"].call("strand.watch.set", strand_id=r.strand, level="muted", **r.ws)
        await r.send("carol", r.strand, "carol takes part")
        await r["owner"].call("strand.assign", strand_id=r.strand, member_id=r.ids["adam"], **r.ws)
        await r.news()

        def heard(message: dict, audience: list[str], watching: tuple[str, ...] = ("bob", "carol", "adam"),
                  others: tuple[str, ...] = ()) -> dict:
            """Bob (watcher), Carol (participant) and Adam (assignee) hear every message (watch);
            the audience's members get `audience_mention` too; `others` only that."""
            out = {}
            for who in watching:
                out[who] = [(message["id"], "audience_mention", ["audience_mention", "watch"]) if who in audience
                            else (message["id"], "watch", ["watch"])]
            for who in others:
                out[who] = [(message["id"], "audience_mention", ["audience_mention"])]
            return out

        participants = await r.send("owner", r.strand, "@participants review")
        assert await r.news() == heard(participants, ["carol"])  # the author never, though a participant now
        watchers = await r.send("owner", r.strand, "@watchers review")
        assert await r.news() == heard(watchers, ["bob"])  # explicit watchers; muted Erin never
        assignees = await r.send("owner", r.strand, "@assignees review")
        assert await r.news() == heard(assignees, ["adam"])
        here = await r.send("owner", r.strand, "@here review")
        assert await r.news() == heard(here, ["bob", "carol"])  # participants ∪ explicit watchers
        everyone = await r.send("owner", r.strand, "@all review")
        # Every reader but the author and muted Erin: never Dave (no channel membership) nor the
        # private agent Scout (private agents never read a task).
        assert await r.news() == heard(everyone, ["bob", "carol", "adam"], others=("vera", "pilot"))
        assert [m["audience"] for m in everyone["metadata"]["audience_mentions"]] == ["effective_scope_members"]
        # Several audiences in one message: one delivery per member.
        several = await r.send("owner", r.strand, "@here @assignees @all @all review")
        assert await r.news() == heard(several, ["bob", "carol", "adam"], others=("vera", "pilot"))
        assert several["metadata"]["audience_mentions"] == [
            {"audience": "strand_engaged", "mention_text_original": "@here"},
            {"audience": "assigned_actors", "mention_text_original": "@assignees"},
            {"audience": "effective_scope_members", "mention_text_original": "@all"}]
        # A member who left the channel no longer reads the strand: no audience reaches them.
        await r["owner"].call("scope.remove", scope_id=r.channel, member_id=r.ids["vera"], **r.ws)
        after = await r.send("owner", r.strand, "@all once more")
        assert await r.news() == heard(after, ["bob", "carol", "adam"], others=("pilot",))


async def test_the_notification_state_silences_an_audience_mention(app: App, cast):
    async with room(app, cast) as r:
        await r.policy("effective_scope_members")
        await r.grant("owner")
        await r["vera"].call("notification.set", scope_id=r.channel, state="mute", **r.ws)
        await r["carol"].call("notification.set", scope_id=r.channel, state="quiet", **r.ws)
        sent = await r.send("owner", r.channel, "@all hello")
        news = await r.news()
        assert set(news) == {"bob", "carol", "adam", "erin", "pilot"}
        pushed = {d["recipient_member_id"]: d["push"] for d in await app.db.run(lambda conn: conn.fetch(
            "SELECT recipient_member_id, push FROM scope_targeted_deliveries WHERE message_id = $1", sent["id"]))}
        assert pushed[r.ids["carol"]] is False and pushed[r.ids["bob"]] is True


async def test_a_direct_mention_and_an_audience_mention_make_one_delivery(app: App, cast):
    async with room(app, cast) as r:
        await r.policy(*ALL_AUDIENCES)
        await r.grant("owner")
        in_channel = await r.send("owner", r.channel, "@carol @all look")
        news = await r.news()
        assert news["carol"] == [(in_channel["id"], "mention", ["mention", "audience_mention"])]
        assert news["bob"] == [(in_channel["id"], "audience_mention", ["audience_mention"])]


async def test_in_a_strand_one_delivery_lists_the_mention_the_audience_and_the_watch(app: App, cast):
    async with room(app, cast) as r:
        await r.policy(*ALL_AUDIENCES)
        await r.grant("owner")
        await r["bob"].call("strand.watch.set", strand_id=r.strand, level="all", **r.ws)
        in_strand = await r.send("owner", r.strand, "@bob @carol @here look")
        assert await r.news() == {"bob": [(in_strand["id"], "mention", ["mention", "audience_mention", "watch"])],
                                  "carol": [(in_strand["id"], "mention", ["mention"])]}
        everyone = await r.send("owner", r.strand, "@vera @all look")
        news = await r.news()
        assert news["vera"] == [(everyone["id"], "mention", ["mention", "audience_mention"])]
        assert news["bob"] == [(everyone["id"], "audience_mention", ["audience_mention", "watch"])]


async def test_over_max_recipients_the_message_is_accepted_as_usual_and_nobody_is_notified(app: App, cast):
    async with room(app, cast) as r:
        await r["bob"].call("strand.watch.set", strand_id=r.strand, level="participating", **r.ws)
        await r["carol"].call("strand.watch.set", strand_id=r.strand, level="participating", **r.ws)
        await r.grant("owner")
        await r.policy("strand_watchers", max_recipients=2)
        reached = await r.send("owner", r.strand, "@watchers at the cap")
        assert only_audience(await r.news()) == {
            who: [(reached["id"], "audience_mention", ["audience_mention", "watch"])] for who in ("bob", "carol")}
        await r.policy("strand_watchers", max_recipients=1)
        degraded = await r.send("owner", r.strand, "@watchers over the cap")
        # The same answer as a success: same fields, the audience recorded; nothing counts recipients.
        assert set(degraded) == set(reached)
        assert set(degraded["metadata"]) == set(reached["metadata"])
        assert degraded["metadata"]["audience_mentions"] == reached["metadata"]["audience_mentions"]
        # The watchers still hear of it as watchers; nobody by the audience mention.
        assert await r.news() == {who: [(degraded["id"], "watch", ["watch"])] for who in ("bob", "carol")}
        # In a channel: the cap counts who the mention would notify (never the private agent Scout)...
        await r.policy("effective_scope_members", max_recipients=6)
        at_cap = await r.send("owner", r.channel, "@all six of you")
        assert await r.news() == {who: [(at_cap["id"], "audience_mention", ["audience_mention"])]
                                  for who in ("bob", "carol", "adam", "vera", "erin", "pilot")}
        # ... and over it nobody at all hears of it.
        await r.policy("effective_scope_members", max_recipients=5)
        before = await r.rows()
        quiet = await r.send("owner", r.channel, "@all too many")
        assert await r.news() == {}
        assert await r.rows() == (before[0] + 1, before[1])
        assert quiet["metadata"]["audience_mentions"] == [
            {"audience": "effective_scope_members", "mention_text_original": "@all"}]


async def test_audience_metadata_is_server_written_and_silent_or_foreign_tokens_notify_nobody(app: App, cast):
    async with room(app, cast) as r:
        await r.policy(*ALL_AUDIENCES)
        grant = await r.grant("owner")
        for metadata in ({"audience_mentions": []},
                         {"audience_mentions": [{"audience": "effective_scope_members",
                                                 "mention_text_original": "@all"}]}):
            before = await r.rows()
            await expect_error("invalid", r.send("owner", r.channel, "@all forged", metadata=metadata))
            assert await r.rows() == before
        sent = await r.send("owner", r.channel, "@all real")
        stored = (await r["bob"].call("message.get", message_id=sent["id"], **r.ws))["message"]
        # The audience and the typed token only: never who it reached.
        assert stored["metadata"]["audience_mentions"] == [
            {"audience": "effective_scope_members", "mention_text_original": "@all"}]
        await r.news()
        # A silent message notifies nobody and uses no quota.
        silent = await r.send("owner", r.channel, "@all shh", silent=True)
        assert "audience_mentions" not in silent.get("metadata", {})
        assert await r.news() == {}
        assert await r.uses(grant) == 1
        # `@here` (and the other strand audiences) mean nothing in a plain channel: plain text.
        await r["owner"].call("audience_mention.policy.disable", audience="strand_engaged", **r.ws)
        plain = await r.send("bob", r.channel, "@here @participants @watchers @assignees hi")
        assert "audience_mentions" not in plain.get("metadata", {})
        assert await r.news() == {}


async def test_a_plain_message_after_an_audience_mention_notifies_nobody(app: App, cast):
    """The audiences a send was authorized for belong to that send alone, not to whichever
    message takes its place in a later batch."""
    async with room(app, cast) as r:
        await r.policy("effective_scope_members")
        await r.grant("owner")
        await r.send("owner", r.channel, "@all first")
        assert len(await r.news()) == 6
        await r.send("owner", r.channel, "an ordinary follow-up")
        assert await r.news() == {}


# --- §9.4.5: the third-party mention gate ------------------------------------------------------------------------

async def test_a_public_agent_hears_third_parties_only_while_its_owner_allows(app: App, cast):
    async with room(app, cast) as r:
        await r.policy("effective_scope_members")
        await r.grant("bob")
        pilot = r.ids["pilot"]
        first = await r.send("bob", r.strand, "@pilot please")
        assert (await r.news())["pilot"] == [(first["id"], "mention", ["mention"])]
        # Only the agent's owner chooses: anyone else, for any member, gets not_found.
        for who, member_id in (("bob", pilot), ("adam", pilot), ("owner", r.ids["bob"]),
                               ("owner", "mem_zzzzzzzzzzzzzz")):
            await expect_error("not_found", r[who].call("agent.participation.set", member_id=member_id,
                                                        accept_third_party_mention=False, **r.ws))
        await expect_error("invalid", r["owner"].call("agent.participation.set", member_id="nobody",
                                                      accept_third_party_mention=False, **r.ws))
        chosen = await r["owner"].call("agent.participation.set", member_id=pilot, accept_third_party_mention=False,
                                       **r.ws)
        assert chosen == {"member_id": pilot, "accept_third_party_mention": False, "version": 1}
        direct = await r.send("bob", r.strand, "@pilot @carol please")
        in_channel = await r.send("bob", r.channel, "@pilot please")
        audience = await r.send("bob", r.channel, "@all please")
        news = await r.news()
        assert "pilot" not in news
        # Only the agent is spared: the other targets hear, the message keeps its mentions.
        assert (direct["id"], "mention", ["mention"]) in news["carol"]
        assert (audience["id"], "audience_mention", ["audience_mention"]) in news["carol"]
        assert direct["metadata"]["mentions"] == [pilot, r.ids["carol"]]
        assert in_channel["metadata"]["mentions"] == [pilot]
        # Its owner's mentions always pass.
        by_owner = await r.send("owner", r.channel, "@pilot please")
        assert (await r.news())["pilot"] == [(by_owner["id"], "mention", ["mention"])]
        # Never retroactive: allowing again backfills nothing, and the earlier delivery stayed.
        await r["owner"].call("agent.participation.set", member_id=pilot, accept_third_party_mention=True, **r.ws)
        assert await r.news() == {}
        assert [d["message_id"] for d in await feed(r["pilot"], r.ws)] == [first["id"], by_owner["id"]]
        again = await r.send("bob", r.channel, "@pilot please")
        assert (await r.news())["pilot"] == [(again["id"], "mention", ["mention"])]
        await r["owner"].call("agent.participation.set", member_id=pilot, accept_third_party_mention=False, **r.ws)
        assert [(d["message_id"], d["status"]) for d in await feed(r["pilot"], r.ws)] == [
            (first["id"], "pending"), (by_owner["id"], "pending"), (again["id"], "pending")]


async def test_a_strand_ceiling_keeps_third_parties_from_waking_agents_there_only(app: App, cast):
    async with room(app, cast) as r:
        await r.policy("effective_scope_members")
        await r.grant("bob")
        closed = await r["owner"].call("strand.create", board_id=r.board, title="Closed",
                                       accept_third_party_mention=False, **r.ws)
        assert closed["accept_third_party_mention"] is False
        blocked = [await r.send("bob", closed["id"], "@pilot please"), await r.send("bob", closed["id"], "@all go")]
        news = await r.news()
        assert "pilot" not in news and (blocked[1]["id"], "audience_mention", ["audience_mention"]) in news["vera"]
        by_owner = await r.send("owner", closed["id"], "@pilot please")
        open_strand = await r.send("bob", r.strand, "@pilot please")
        in_channel = await r.send("bob", r.channel, "@pilot please")
        assert (await r.news())["pilot"] == [(m["id"], "mention", ["mention"]) for m in (by_owner, open_strand,
                                                                                         in_channel)]
        reopened = await r["owner"].call("strand.update", strand_id=closed["id"], expected_version=closed["version"],
                                         accept_third_party_mention=True, **r.ws)
        assert reopened["accept_third_party_mention"] is True
        assert await r.news() == {}  # nothing backfilled
        later = await r.send("bob", closed["id"], "@pilot please")
        assert (await r.news())["pilot"] == [(later["id"], "mention", ["mention"])]


# --- §9.4.2: edits ---------------------------------------------------------------------------------------------

async def test_an_edit_notifies_only_the_members_it_newly_mentions(app: App, cast):
    async with room(app, cast) as r:
        message = await r.send("owner", r.channel, "hello @bob")
        assert await r.news() == {"bob": [(message["id"], "mention", ["mention"])]}
        revision = 1

        async def edit(content: str) -> list | None:
            nonlocal revision
            await r["owner"].call("message.edit", message_id=message["id"], content=content,
                                  expected_revision=revision, **r.ws)
            revision += 1
            stored = (await r["bob"].call("message.get", message_id=message["id"], **r.ws))["message"]
            assert (stored["revision"], stored["content"]) == (revision, content)
            return stored.get("metadata", {}).get("mentions")

        assert await edit("hello @bob @carol") == [r.ids["bob"], r.ids["carol"]]
        assert await r.news() == {"carol": [(message["id"], "mention", ["mention"])]}
        assert await edit("hello @bob") == [r.ids["bob"]]  # removing a mention notifies nobody
        assert await r.news() == {}
        assert await edit("hello @bob @carol @carol") == [r.ids["bob"], r.ids["carol"]]  # back: no second one
        assert await r.news() == {}
        assert await edit("@adam @bob only") == [r.ids["adam"], r.ids["bob"]]
        assert await r.news() == {"adam": [(message["id"], "mention", ["mention"])]}
        assert await edit("@dave is not here") is None  # not a reader: no mention, no delivery
        assert await r.news() == {}
        # Mentioned while muted (no delivery), then unmuted: still not newly mentioned by the next revision.
        await r["vera"].call("notification.set", scope_id=r.channel, state="mute", **r.ws)
        assert await edit("@vera have a look") == [r.ids["vera"]]
        await r["vera"].call("notification.set", scope_id=r.channel, state="active", **r.ws)
        assert await edit("@vera have another look") == [r.ids["vera"]]
        assert await r.news() == {}
        await r["owner"].call("message.withdraw", message_id=message["id"], **r.ws)
        assert await r.news() == {}


async def test_an_edit_in_a_strand_respects_watches_existing_deliveries_and_the_gate(app: App, cast):
    async with room(app, cast) as r:
        await r["bob"].call("strand.watch.set", strand_id=r.strand, level="all", **r.ws)
        await r["erin"].call("strand.watch.set", strand_id=r.strand, level="muted", **r.ws)
        await r["owner"].call("agent.participation.set", member_id=r.ids["pilot"], accept_third_party_mention=False,
                              **r.ws)
        message = await r.send("carol", r.strand, "a plan")
        assert await r.news() == {"bob": [(message["id"], "watch", ["watch"])]}
        await r["carol"].call("message.edit", message_id=message["id"], content="a plan @bob @erin @pilot @adam",
                              expected_revision=1, **r.ws)
        # Bob already has this message's delivery, muted Erin hears nothing, the owner's agent refuses
        # third parties: only Adam is newly told.
        assert await r.news() == {"adam": [(message["id"], "mention", ["mention"])]}
        stored = (await r["bob"].call("message.get", message_id=message["id"], **r.ws))["message"]
        assert stored["metadata"]["mentions"] == [r.ids["bob"], r.ids["erin"], r.ids["pilot"], r.ids["adam"]]


async def test_an_edit_keeps_only_the_audience_mentions_its_text_still_holds(app: App, cast):
    """An audience mention is authorized when sent: an edit may drop one (metadata follows the
    canonical revision), never add one (an added `@all` is plain text, notifies nobody)."""
    async with room(app, cast) as r:
        await r.policy("effective_scope_members", "strand_engaged")
        grant = await r.grant("owner")
        message = await r.send("owner", r.strand, "@all @here start")
        assert [m["audience"] for m in message["metadata"]["audience_mentions"]] == [
            "effective_scope_members", "strand_engaged"]
        await r.news()

        async def edit(content: str, revision: int) -> list | None:
            await r["owner"].call("message.edit", message_id=message["id"], content=content,
                                  expected_revision=revision, **r.ws)
            stored = (await r["bob"].call("message.get", message_id=message["id"], **r.ws))["message"]
            return stored.get("metadata", {}).get("audience_mentions")

        here = [{"audience": "strand_engaged", "mention_text_original": "@here"}]
        assert await edit("@here only", 1) == here
        assert await edit("@all @here again", 2) == here
        assert await edit("nobody now", 3) is None
        assert await r.news() == {}
        assert await r.uses(grant) == 1


# --- §9.8.6: reactions -----------------------------------------------------------------------------------------

async def test_a_reaction_in_a_strand_notifies_only_its_all_watchers(app: App, cast):
    async with room(app, cast) as r:
        for who, level in (("bob", "all"), ("carol", "all"), ("adam", "participating")):
            await r[who].call("strand.watch.set", strand_id=r.strand, level=level, **r.ws)
        message = await r.send("owner", r.strand, "a decision")  # the owner participates now
        await r.news()
        watched = (message["id"], "reaction", ["reaction", "watch"])
        await r["erin"].call("reaction.add", message_id=message["id"], key=":+1:", **r.ws)
        assert await r.news() == {"bob": [watched], "carol": [watched]}  # never the author, nor Adam
        await r["carol"].call("reaction.add", message_id=message["id"], key=":eyes:", **r.ws)
        assert await r.news() == {"bob": [watched]}  # never the reactor
        await r["erin"].call("reaction.remove", message_id=message["id"], key=":+1:", **r.ws)
        assert await r.news() == {"bob": [watched], "carol": [watched]}
        await r["erin"].call("reaction.remove", message_id=message["id"], key=":+1:", **r.ws)  # no change
        assert await r.news() == {}
        kinds = {(d["kind"], d["activity"]["activity_type"])
                 for d in await feed(r["bob"], r.ws) if d["kind"] != "message"}
        assert kinds == {("activity", "reaction.added"), ("activity", "reaction.removed")}


async def test_a_reaction_in_a_channel_still_notifies_the_author(app: App, cast):
    async with room(app, cast) as r:
        message = await r.send("owner", r.channel, "a decision")
        await r["bob"].call("reaction.add", message_id=message["id"], key=":+1:", **r.ws)
        assert await r.news() == {"owner": [(message["id"], "reaction", ["reaction"])]}
        await r["bob"].call("reaction.remove", message_id=message["id"], key=":+1:", **r.ws)
        assert await r.news() == {}
