"""Owner-private visibility and wake authority over the WebSocket against
PostgreSQL (scope-model.md §2.4, §3.5, §3.9, §5; collaborator-policy.md §4, §5;
SPEC rules 6, 7 and §5 decisions 2, 7, 9): what a private agent reads on every
surface and receives live, who may address it, and what an ordinary send costs."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
import trio

from client import ClientError, connect
from storage import messages
from tests.conftest import App, add_person
from tests.db_faults import hold_table_lock, release_locks, wait_for_query
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in

AUTHORITY_TABLES = re.compile(
    r"\b(scope_private_grants|scope_executions|task_scope_participant_metadata|task_collaborator_\w+)\b")


@pytest.fixture
async def world(app: App, tenants, member_password_hash):
    """Alpha's owner with a private agent in a channel shared with Bob and Carol."""
    alpha, _ = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "project", [bob.member_id, carol.member_id,
                                                                              agent["id"]])
        key = await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws)
    return alpha, bob, carol, agent, channel, key["key"], ws


@contextlib.asynccontextmanager
async def as_agent(app: App, key: str):
    async with connect(app.url) as conn:
        await conn.auth(api_key=key)
        yield conn


async def _history(conn, scope_id: str, ws: dict, **paging) -> list[str]:
    return [m["content"] for m in (await conn.call("message.history", scope_id=scope_id, **paging, **ws))["messages"]]


async def _drain(app: App, conn, count: int) -> list[dict]:
    """The next `count` message.created events (bounded wait: a missing one fails)."""
    events = []
    with trio.move_on_after(20):
        while len(events) < count:
            event = await conn.next_event()
            if event["event"] == "message.created":
                events.append(event)
        return events
    # Say which arrived and where the cursors stand (a missing one was once a catch-up that stepped over it).
    pushes = [c.push for c in app.server.connections.all if c.push is not None]
    pytest.fail(f"{len(events)} of {count} events in 20 s: {[(e['seq'], e['data']['content']) for e in events]}; "
                + "; ".join(f"cursors {p.scope_cursors} backlog {p._backlog}" for p in pushes))


async def test_a_private_agents_history_pages_are_planned_once_per_connection(app: App, world):
    """Planned for each call's windows, a private page cost ~30 ms of PostgreSQL planning
    (bench/private_agents.py); its one generic plan serves every call on a connection."""
    alpha, bob, _, agent, channel, _, ws = world
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        await owner.call("message.send", scope_id=channel["id"], content="owner", **ws)
        await b.call("message.send", scope_id=channel["id"], content="bob, not the agent's", **ws)

    async def unit(conn):
        for _ in range(8):
            for after_seq in (0, None):
                rows, _ = await messages.history(conn, alpha.workspace_id, agent["id"], channel["id"],
                                                 before_seq=None, after_seq=after_seq, limit=50)
                assert [r["content"] for r in rows] == ["owner"]
        return await conn.fetch("SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                                "WHERE statement LIKE '%DISTINCT ON (candidate.seq)%' "
                                "AND statement NOT LIKE '%pg_prepared_statements%'")

    assert sorted((s["generic_plans"], s["custom_plans"]) for s in await app.db.run(unit)) == [(8, 0), (8, 0)]


async def test_a_private_agents_history_page_is_one_snapshot_even_when_a_grant_commits_meanwhile(app: App, world,
                                                                                                 nursery):
    """The page is read after the agent's windows: a grant and messages committed between the
    two reads must not yield a page that holds a later message but not the granted one (a
    subscriber's catch-up would step over that one for good)."""
    alpha, bob, _, agent, channel, _, ws = world
    scope = channel["id"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        await owner.call("message.send", scope_id=scope, content="owner 1", **ws)
        # The page statement (it reads quoted sources) waits behind this lock; the windows do not.
        await hold_table_lock(app.db, nursery, "scope_message_sources")
        page = trio.Event()
        result = {}

        async def read_history():
            result["rows"], _ = await app.db.run(messages.history, alpha.workspace_id, agent["id"], scope,
                                                 before_seq=None, after_seq=0, limit=200)
            page.set()

        nursery.start_soon(read_history)
        await wait_for_query(app.db, "wait_event_type = 'Lock' AND query LIKE '%DISTINCT ON (candidate.seq)%'")
        await owner.call("private_grant.create", scope_id=scope, grantee_member_id=bob.member_id, **ws)
        await b.call("message.send", scope_id=scope, content="bob granted", **ws)
        await owner.call("message.send", scope_id=scope, content="owner 2", **ws)
        await release_locks(app.db)
        with trio.fail_after(20):
            await page.wait()
    # As of the windows' snapshot: nothing after it, so nothing skipped.
    assert [r["content"] for r in result["rows"]] == ["owner 1"]
    rows, _ = await app.db.run(messages.history, alpha.workspace_id, agent["id"], scope, before_seq=None,
                               after_seq=0, limit=200)
    assert [r["content"] for r in rows] == ["owner 1", "bob granted", "owner 2"]


async def test_a_private_agent_reads_what_its_owner_and_grantees_wrote_and_nothing_else(app: App, world):
    alpha, bob, carol, agent, channel, key, ws = world
    scope = channel["id"]
    async with (await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b,
                await signed_in(app, carol) as c, as_agent(app, key) as scout):
        await scout.call("subscribe", scopes=[{"scope_id": scope, "after_seq": 0}], **ws)
        await owner.call("message.send", scope_id=scope, content="owner 1", **ws)
        bob_before = await b.call("message.send", scope_id=scope, content="bob before the grant", **ws)
        grant = await owner.call("private_grant.create", scope_id=scope, grantee_member_id=bob.member_id, **ws)
        bob_during = await b.call("message.send", scope_id=scope, content="bob granted", **ws)
        await c.call("message.send", scope_id=scope, content="carol never", **ws)
        await scout.call("message.send", scope_id=scope, content="scout output", **ws)
        await owner.call("private_grant.revoke", grant_id=grant["id"], **ws)
        await b.call("message.send", scope_id=scope, content="bob after revoke", **ws)
        await owner.call("message.send", scope_id=scope, content="owner 2", **ws)

        readable = ["owner 1", "bob granted", "scout output", "owner 2"]
        # Live: exactly the readable messages, in order, nothing else.
        assert [e["data"]["content"] for e in await _drain(app, scout, 4)] == readable
        with trio.move_on_after(0.5):
            extra = await scout.next_event()
            pytest.fail(f"unexpected event {extra}")
        # Every read surface agrees.
        assert await _history(scout, scope, ws) == readable
        assert await _history(scout, scope, ws, after_seq=0, limit=2) == readable[:2]
        assert await _history(scout, scope, ws, before_seq=7, limit=2) == readable[1:3]
        await expect_error("not_found", scout.call("message.get", message_id=bob_before["id"], **ws))
        assert (await scout.call("message.get", message_id=bob_during["id"], **ws))["message"]["content"] == \
            "bob granted"
        # Reactions exist only on what it reads (and it can react only there).
        await c.call("reaction.add", message_id=bob_before["id"], key=":eyes:", **ws)
        await c.call("reaction.add", message_id=bob_during["id"], key=":eyes:", **ws)
        await expect_error("not_found", scout.call("reaction.add", message_id=bob_before["id"], key=":+1:", **ws))
        page = await scout.call("message.history", scope_id=scope, **ws)
        assert [len(m.get("reactions", [])) for m in page["messages"]] == [0, 1, 0, 0]
        # Revocation was not retroactive: the window keeps what it covered.
        assert "bob granted" in await _history(scout, scope, ws)
        # The humans still read everything.
        assert len(await _history(b, scope, ws)) == 7
    # A reconnecting agent replays exactly the same set from its cursor.
    async with as_agent(app, key) as scout:
        await scout.call("subscribe", scopes=[{"scope_id": scope, "after_seq": 0}], **ws)
        assert [e["data"]["content"] for e in await _drain(app, scout, 4)] == readable


async def test_threads_inherit_the_parent_channel_authority_never_a_siblings(app: App, world):
    alpha, bob, carol, agent, channel, key, ws = world
    scope = channel["id"]
    async with (await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b,
                await signed_in(app, carol) as c, as_agent(app, key) as scout):
        roots = [await owner.call("message.send", scope_id=scope, content=f"root {i} @scout", **ws)
                 for i in range(2)]
        first = await owner.call("thread.reply", scope_id=scope, root_message_id=roots[0]["id"],
                                 content="@scout thread one", **ws)
        second = await owner.call("thread.reply", scope_id=scope, root_message_id=roots[1]["id"],
                                  content="@scout thread two", **ws)
        t1, t2 = first["scope_id"], second["scope_id"]
        # A grant on thread one covers thread one only.
        await owner.call("private_grant.create", scope_id=t1, grantee_member_id=bob.member_id, **ws)
        await b.call("thread.reply", scope_id=scope, root_message_id=roots[0]["id"], content="bob in one", **ws)
        await b.call("thread.reply", scope_id=scope, root_message_id=roots[1]["id"], content="bob in two", **ws)
        await b.call("message.send", scope_id=scope, content="bob in the channel", **ws)
        # A grant on the channel covers the channel and every thread under it.
        await owner.call("private_grant.create", scope_id=scope, grantee_member_id=carol.member_id, **ws)
        await c.call("thread.reply", scope_id=scope, root_message_id=roots[1]["id"], content="carol in two", **ws)
        await c.call("message.send", scope_id=scope, content="carol in the channel", **ws)
        assert await _history(scout, t1, ws) == ["@scout thread one", "bob in one"]
        assert await _history(scout, t2, ws) == ["@scout thread two", "carol in two"]
        assert await _history(scout, scope, ws) == ["root 0 @scout", "root 1 @scout", "carol in the channel"]


async def test_only_the_owner_grantees_and_collaborators_may_address_a_private_agent(app: App, world):
    alpha, bob, carol, agent, channel, key, ws = world
    scope = channel["id"]

    async def executions() -> int:
        return await app.db.run(lambda conn: conn.fetchval("SELECT count(*) FROM scope_executions"))

    async with (await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b,
                await signed_in(app, carol) as c):
        plain = await owner.call("message.send", scope_id=scope, content="an ordinary message", **ws)
        assert "mentions" not in plain.get("metadata", {}) and await executions() == 0  # ordinary: no execution
        # Bob has no authority: the mention stays plain text, an explicit recipient is refused.
        denied = await b.call("message.send", scope_id=scope, content="@scout do my bidding", **ws)
        assert "mentions" not in denied.get("metadata", {})
        error = await expect_error("forbidden", b.call("message.send", scope_id=scope, content="psst",
                                                       recipient_member_ids=[agent["id"]], **ws))
        assert error.details["reason"] == "recipient_not_addressable"
        # The owner wakes it: a Scope Execution appears (trigger: wake).
        woken = await owner.call("message.send", scope_id=scope, content="@scout summarize", **ws)
        assert woken["metadata"]["mentions"] == [agent["id"]]
        assert await app.db.run(lambda conn: conn.fetchval("SELECT created_trigger FROM scope_executions")) == "wake"
        # A grantee may, and an explicit recipient is recorded by the server.
        await owner.call("private_grant.create", scope_id=scope, grantee_member_id=bob.member_id, **ws)
        granted = await b.call("message.send", scope_id=scope, content="over to you", recipient_member_ids=[agent["id"]],
                               **ws)
        assert granted["metadata"]["recipients"] == [agent["id"]]
        # A People collaborator may (Carol, on the channel, confirmed, no expiry).
        await expect_error("invalid", owner.call("collaborator.add", scope_id=scope, member_id=carol.member_id, **ws))
        collaborator = await owner.call("collaborator.add", scope_id=scope, member_id=carol.member_id,
                                        confirm_channel=True, no_expiry=True, **ws)
        assert (await c.call("message.send", scope_id=scope, content="@scout please", **ws))["metadata"]["mentions"] \
            == [agent["id"]]
        await owner.call("collaborator.remove", collaborator_id=collaborator["id"], **ws)
        assert "mentions" not in (await c.call("message.send", scope_id=scope, content="@scout again?",
                                               **ws)).get("metadata", {})
        # A client cannot forge routing: metadata.mentions / recipients are the server's.
        await expect_error("invalid", c.call("message.send", scope_id=scope, content="x",
                                             metadata={"recipients": [agent["id"]]}, **ws))
    assert await executions() == 1  # one per (owner, scope): later wakes reuse it


def _actor_statements(app: App, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], contextlib.AbstractContextManager]:
    """Every statement the scope actors' batches run while the context is open."""
    captured: list[str] = []

    def logging(method):
        async def run(*args, **kwargs):
            units = [i for i, a in enumerate(args) if getattr(a, "__name__", "") == "_write_batch"]
            if not units:
                return await method(*args, **kwargs)
            index = units[0]
            batch = args[index]

            async def logged(conn, *unit_args):
                with conn.query_logger(lambda record: captured.append(record.query)):
                    return await batch(conn, *unit_args)

            return await method(*args[:index], logged, *args[index + 1:], **kwargs)
        return run

    @contextlib.contextmanager
    def capturing() -> Iterator[None]:
        with monkeypatch.context() as patch:
            patch.setattr(app.db, "run", logging(app.db.run))
            patch.setattr(app.db, "run_overlapping", logging(app.db.run_overlapping))
            yield
    return captured, capturing()


async def test_an_ordinary_send_touches_no_authority_table(app: App, world, monkeypatch):
    """SPEC §5 decision 9: the send path authorizes from the actor's cache — even
    in a scope with private agents, grants and collaborators, an ordinary send
    (a thread reply included) reads no grant or collaborator row."""
    alpha, bob, carol, agent, channel, key, ws = world
    scope = channel["id"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        await owner.call("private_grant.create", scope_id=scope, grantee_member_id=bob.member_id, **ws)
        await owner.call("collaborator.add", scope_id=scope, member_id=carol.member_id, confirm_channel=True,
                         no_expiry=True, **ws)
        root = await owner.call("message.send", scope_id=scope, content="warm the actor @scout", **ws)
        await b.call("thread.reply", scope_id=scope, root_message_id=root["id"], content="warm the thread", **ws)
        captured, capturing = _actor_statements(app, monkeypatch)
        with capturing:
            await b.call("message.send", scope_id=scope, content="ordinary", **ws)
            await b.call("thread.reply", scope_id=scope, root_message_id=root["id"], content="ordinary reply", **ws)
        assert captured, "the capture saw the actors' transactions"
        assert [s for s in captured if AUTHORITY_TABLES.search(s)] == []


async def test_a_private_agent_enters_scopes_only_through_its_owner(app: App, world):
    """It cannot create a channel, join one, or open a DM with anyone but its
    owner — where it would hold a public membership and read everything."""
    alpha, bob, carol, agent, channel, key, ws = world
    async with await signed_in(app, alpha.owner) as owner:
        lounge = await open_channel(owner, alpha.workspace_id, "lounge")
    async with as_agent(app, key) as scout:
        error = await expect_error("forbidden", scout.call("channel.create", slug="mine", display_name="Mine",
                                                           visibility="public", member_ids=[], **ws))
        assert error.details["reason"] == "private_agent_not_admitted"
        await expect_error("forbidden", scout.call("scope.join", scope_id=lounge["id"], **ws))
        await expect_error("forbidden", scout.call("dm.open", member_id=bob.member_id, **ws))
        dm = await scout.call("dm.open", member_id=alpha.owner.member_id, **ws)
    async with await signed_in(app, alpha.owner) as owner:
        assert (await owner.call("dm.open", member_id=agent["id"], **ws))["id"] == dm["id"]  # the same DM
        members = {m["member_id"]: m for m in (await owner.call("scope.members", scope_id=dm["id"],
                                                                include_private=True, **ws))["members"]}
        assert members[agent["id"]]["visibility"] == "private"
        assert members[agent["id"]]["owner_member_id"] == alpha.owner.member_id


async def _events_until_marker(agent_conn, owner_conn, scope_id: str, ws: dict) -> list[dict]:
    """Everything the agent received up to a message its owner sends now (pushes
    on one connection keep their publish order, so nothing earlier can follow it)."""
    marker = await owner_conn.call("message.send", scope_id=scope_id, content="marker", **ws)
    received = []
    with trio.fail_after(20):
        while True:
            event = await agent_conn.next_event()
            if event["event"] == "message.created" and event["data"]["id"] == marker["id"]:
                return received
            received.append(event)


async def test_live_events_follow_the_agents_interval_typing_and_membership(app: App, world):
    """Reactions on what it cannot read (its owner's messages from before it
    joined) do not reach it; typing reaches it only from its owner; a
    membership event says a member is private, with its owner."""
    alpha, bob, carol, agent, channel, key, ws = world
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        later = await open_channel(owner, alpha.workspace_id, "later", [bob.member_id])
        await b.call("subscribe", scopes=[{"scope_id": later["id"]}], **ws)
        before = await owner.call("message.send", scope_id=later["id"], content="before the agent", **ws)
        await owner.call("scope.invite", scope_id=later["id"], member_ids=[agent["id"]], **ws)
        async with as_agent(app, key) as scout:
            await scout.call("subscribe", scopes=[{"scope_id": later["id"]}], **ws)
            await expect_error("not_found", scout.call("message.get", message_id=before["id"], **ws))
            await b.call("reaction.add", message_id=before["id"], key=":eyes:", **ws)
            await b.call("typing", scope_id=later["id"], **ws)
            # The actor answers the invite before it publishes the membership event, so the
            # agent, subscribed meanwhile, may hear of its own arrival (seen once in CI).
            received = await _events_until_marker(scout, owner, later["id"], ws)
            assert [e["event"] for e in received
                    if not (e["event"] == "membership.changed" and e["data"]["member_id"] == agent["id"])] == []
            await owner.call("typing", scope_id=later["id"], **ws)
            assert [e["event"] for e in await _events_until_marker(scout, owner, later["id"], ws)] == ["typing"]
        opened = [e["data"] for e in b.queued_events() if e["event"] == "membership.changed"]
        assert opened == [{"member_id": agent["id"], "action": "open", "roster_generation": opened[0]["roster_generation"],
                           "visibility": "private", "owner_member_id": alpha.owner.member_id}]


async def test_thread_entry_and_exit_follow_the_parent(app: App, world):
    """Not by invitation into a thread (only by being addressed there); and
    removed from the channel, it reads and is addressed in none of its threads."""
    alpha, bob, carol, agent, channel, key, ws = world
    scope = channel["id"]
    async with await signed_in(app, alpha.owner) as owner:
        root = await owner.call("message.send", scope_id=scope, content="root", **ws)
        thread = (await owner.call("thread.reply", scope_id=scope, root_message_id=root["id"], content="r",
                                   **ws))["scope_id"]
        error = await expect_error("forbidden", owner.call("scope.invite", scope_id=thread, member_ids=[agent["id"]],
                                                           **ws))
        assert error.details["reason"] == "private_agent_not_admitted"
        await owner.call("thread.reply", scope_id=scope, root_message_id=root["id"], content="@scout look", **ws)
        async with as_agent(app, key) as scout:
            assert await _history(scout, thread, ws) == ["@scout look"]
        await owner.call("scope.remove", scope_id=scope, member_id=agent["id"], **ws)
        later = await owner.call("thread.reply", scope_id=scope, root_message_id=root["id"], content="@scout after",
                                 **ws)
        assert "mentions" not in later.get("metadata", {})
        async with as_agent(app, key) as scout:
            assert await _history(scout, thread, ws) == []
            await expect_error("not_found", scout.call("message.get", message_id=later["id"], **ws))


async def test_what_the_owner_shared_is_in_the_agents_history(app: App, world):
    """An owner_quote's source is readable by the owner's agent ('source_ref') on
    every surface, history included; explain names the owner's quote, never
    another member's."""
    alpha, bob, carol, agent, channel, key, ws = world
    scope = channel["id"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        source = await b.call("message.send", scope_id=scope, content="bob says", **ws)
        mine = await open_channel(b, alpha.workspace_id, "bobs", [], visibility="private")
        await b.call("message.forward", scope_id=mine["id"], source_message_ids=[source["id"]], mode="owner_quote",
                     **ws)
        quote = await owner.call("message.forward", scope_id=scope, source_message_ids=[source["id"]],
                                 mode="owner_quote", comment="look", **ws)
        explained = await owner.call("visibility.explain", message_id=source["id"], member_id=agent["id"], **ws)
        assert (explained["reason"], explained["source_message_id"]) == ("source_ref", quote["id"])
    async with as_agent(app, key) as scout:
        assert await _history(scout, scope, ws) == ["bob says", "look"]
        assert (await scout.call("message.get", message_id=source["id"], **ws))["message"]["content"] == "bob says"


async def test_every_private_agent_command_probed_across_workspaces_answers_not_found(app: App, world, tenants,
                                                                                      member_password_hash):
    """Another workspace's scopes, messages, members, grants and collaborators are
    not found — never forbidden — whichever workspace the request names."""
    from server.ops import collaboration, private_agents

    alpha, bob, carol, agent, channel, key, ws = world
    _, beta = tenants
    b_person = await add_person(app.db, beta.workspace_id, "b-person@example.com", "developer",
                                member_password_hash)
    b = {"workspace_id": beta.workspace_id}
    async with await signed_in(app, beta.owner) as owner_b:
        b_agent = await owner_b.call("agent.create", handle="b-scout", display_name="B", **b)
        b_channel = await open_channel(owner_b, beta.workspace_id, "b-room", [b_person.member_id, b_agent["id"]])
        b_message = await owner_b.call("message.send", scope_id=b_channel["id"], content="beta only", **b)
        b_grant = await owner_b.call("private_grant.create", scope_id=b_channel["id"],
                                     grantee_member_id=b_person.member_id, **b)
        b_collaborator = await owner_b.call("collaborator.add", scope_id=b_channel["id"],
                                            member_id=b_person.member_id, confirm_channel=True, no_expiry=True, **b)
    a = ws
    scope = {"scope_id": b_channel["id"]}
    probes = {
        "private_grant.create": [dict(a, **scope, grantee_member_id=bob.member_id),
                                 dict(a, scope_id=channel["id"], grantee_member_id=b_person.member_id)],
        "private_grant.revoke": [dict(a, grant_id=b_grant["id"]), dict(b, grant_id=b_grant["id"])],
        "private_grant.list": [b],
        "collaborator.add": [dict(a, **scope, member_id=bob.member_id, confirm_channel=True, no_expiry=True),
                             dict(a, scope_id=channel["id"], member_id=b_person.member_id, confirm_channel=True,
                                  no_expiry=True)],
        "collaborator.remove": [dict(a, collaborator_id=b_collaborator["id"])],
        "collaborator.leave": [dict(a, collaborator_id=b_collaborator["id"])],
        "collaborator.update_expiry": [dict(a, collaborator_id=b_collaborator["id"], no_expiry=True)],
        "collaborator.list": [dict(a, **scope)],
        "collaborator.overview": [b],
        "private_agent.candidates": [dict(a, **scope)],
        "private_agent.contribution": [dict(a, **scope, owner_member_id=beta.owner.member_id)],
        "private_agent.context_state": [dict(a, **scope, message_ids=[b_message["id"]])],
        "visibility.explain": [dict(a, message_id=b_message["id"], member_id=b_agent["id"]),
                               dict(a, message_id=b_message["id"], member_id=agent["id"])],
    }
    ops = {cls.__struct_config__.tag for cls in (*collaboration.HANDLERS, *private_agents.HANDLERS)}
    assert ops == set(probes)
    async with await signed_in(app, alpha.owner) as conn:
        for op, variants in probes.items():
            for fields in variants:
                try:
                    answer = await conn.call(op, **fields)
                except ClientError as error:
                    assert error.code == "not_found", (op, fields, error)
                else:
                    pytest.fail(f"{op} {fields} answered {answer}")


@pytest.mark.parametrize("server_config", [{"actor_idle_seconds": 1.0}], indirect=True)
async def test_actors_started_together_hold_what_their_own_reload_reads(app: App, world):
    """ScopeRegistry.start_many (a platform broadcast's quiet scopes): one lease transaction and
    one read for the plain scopes; a scope with a private member reads its own state."""
    alpha, bob, _, agent, shared, key, ws = world
    async with await signed_in(app, alpha.owner) as owner:
        plain = await open_channel(owner, alpha.workspace_id, "plain", [bob.member_id])
    scopes = sorted([plain["id"], shared["id"]])
    views = await app.db.run(messages.load_plain_actor_views, scopes + ["scp_missing"])
    assert list(views) == [plain["id"]]
    assert views[plain["id"]] == await app.db.run(messages.load_actor_view, plain["id"])
    registry = app.server.registry
    async with await signed_in(app, bob) as b, as_agent(app, key) as scout:
        with trio.fail_after(10):  # precondition: both actors went idle and gave their scopes back
            while any(scope in registry._actors for scope in scopes):
                await trio.sleep(0.05)
        epochs = await app.db.run(lambda c: c.fetch(
            "SELECT scope_id, node_id, epoch FROM scope_leases WHERE scope_id = ANY($1::text[]) ORDER BY scope_id",
            scopes))
        assert [r["node_id"] for r in epochs] == [None, None]
        await registry.start_many(scopes)
        assert await app.db.run(lambda c: c.fetch(
            "SELECT scope_id, node_id, epoch FROM scope_leases WHERE scope_id = ANY($1::text[]) ORDER BY scope_id",
            scopes)) == [(r["scope_id"], app.server.node_id, r["epoch"] + 1) for r in epochs]
        started = {scope: registry._actors[scope] for scope in scopes}
        assert all(actor.lease == (app.server.node_id, epoch["epoch"] + 1)
                   for actor, epoch in zip(started.values(), epochs))
        # Their members write at once (the roster taken from the shared read), the private agent too.
        assert (await b.call("message.send", scope_id=plain["id"], content="hi", **ws))["seq"] == 1
        assert (await b.call("message.send", scope_id=shared["id"], content="hi", **ws))["seq"] == 1
        assert (await scout.call("message.send", scope_id=shared["id"], content="on it", **ws))["seq"] == 2
        assert all(registry._actors.get(scope) is actor for scope, actor in started.items())


async def test_a_feed_step_skipped_before_the_one_under_it_is_no_gap(app: App, world):
    """Two scopes' publications can reach the hub out of commit order.  A message
    the agent may not read that arrives before the one committed just under it is
    still a step of its feed: the next readable message is no gap, so nothing is
    replayed from the log — which would judge an old message by today's rules
    (here: an owner_quote since makes its source readable) instead of the live rule."""
    alpha, bob, carol, agent, channel, key, ws = world
    scope = channel["id"]
    hub = app.server.hub
    publish_many = hub.publish_many
    held: list = []

    def reordering(items, **kwargs):
        contents = {getattr(event.data, "content", None) for event, _ in items}
        if "owner first" in contents:
            held.append((items, kwargs))  # until the next publication has gone
            return
        publish_many(items, **kwargs)
        while held:
            earlier, earlier_kwargs = held.pop()
            publish_many(earlier, **earlier_kwargs)

    async with (await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b,
                as_agent(app, key) as scout):
        await scout.call("subscribe", workspace_feed=True, **ws)
        hub.publish_many = reordering
        try:
            first = await owner.call("message.send", scope_id=scope, content="owner first", **ws)
            unseen = await b.call("message.send", scope_id=scope, content="bob unseen", **ws)
            assert unseen["global_seq"] == first["global_seq"] + 1 and not held
        finally:
            hub.publish_many = publish_many
        quote = await owner.call("message.forward", scope_id=scope, source_message_ids=[unseen["id"]],
                                 mode="owner_quote", comment="look", **ws)
        own = await scout.call("message.send", scope_id=scope, content="scout after", **ws)
        received = [e["data"]["id"] for e in await _drain(app, scout, 3)]
        assert received == [first["id"], quote["id"], own["id"]]
        assert (await scout.call("message.get", message_id=unseen["id"], **ws))["message"]["content"] == "bob unseen"



async def test_a_busy_scopes_batches_carry_no_settle_marks_and_the_settler_marks_every_row(app: App, world,
                                                                                           monkeypatch):
    """While commands keep coming, each batch is still its one fence statement and its one
    insert statement: the rows a batch's publication delivered inline are marked by the
    node's settler in a transaction of its own, not by a later batch of the scope."""
    alpha, bob, carol, agent, channel, key, ws = world
    senders, sends_each = 8, 6
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(await signed_in(app, bob)) for _ in range(senders)]
        await clients[0].call("message.send", scope_id=channel["id"], content="warm", **ws)
        captured, capturing = _actor_statements(app, monkeypatch)

        async def send_several(client, number: int) -> None:
            for n in range(sends_each):
                await client.call("message.send", scope_id=channel["id"], content=f"busy {number}.{n}", **ws)

        with capturing:
            async with trio.open_nursery() as nursery:
                for number, client in enumerate(clients):
                    nursery.start_soon(send_several, client, number)
    inserts = [i for i, q in enumerate(captured) if "INSERT INTO scope_messages" in q]
    assert len(inserts) >= 3, "the burst took at least three batches"
    assert not [q for q in captured if "UPDATE scope_fanout_outbox" in q]
    fences = [q for q in captured if "FROM workspace_execution_states" in q]
    assert len(fences) == len(inserts) and all("scope_leases" in q for q in fences), "one fence statement each"
    await app.server.settler.flush()
    assert await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM scope_fanout_outbox WHERE scope_id = $1 AND fanout_type = 'message.created' "
        "AND status <> 'delivered'", channel["id"])) == 0

async def test_a_plain_send_is_one_statement_cached_context_or_not(app: App, world, monkeypatch):
    """A plain send is one statement, outside any transaction: the lease and execution
    fences, seq allocation, the message, its outbox row and its search document.  A send
    served from the connection's cached context has its credential's rows re-read there
    too — after its batch's transaction (fences, then the insert) first found them fresh."""
    alpha, bob, carol, agent, channel, key, ws = world
    writes = ("workspace_message_counters", "INSERT INTO scope_messages", "INSERT INTO scope_fanout_outbox",
              "INSERT INTO scope_message_search_docs")
    async with await signed_in(app, bob) as warm, await signed_in(app, bob) as fresh:
        await warm.call("message.send", scope_id=channel["id"], content="warm the actor and the cache", **ws)
        for conn, in_transaction, proof_checked in ((fresh, False, False), (warm, True, True), (warm, False, True)):
            captured, capturing = _actor_statements(app, monkeypatch)
            with capturing:
                await conn.call("message.send", scope_id=channel["id"], content="ordinary", **ws)
            if in_transaction:
                assert captured[0] == "BEGIN;" and captured[-1] == "COMMIT;", [s[:90] for s in captured]
                captured = captured[1:-1]
            assert len(captured) == (2 if in_transaction else 1), [s[:90] for s in captured]
            assert "FROM workspace_execution_states" in captured[0] and "scope_leases" in captured[0]
            assert ("JOIN accounts a" in captured[0]) == proof_checked
            assert all(part in captured[-1] for part in writes)
