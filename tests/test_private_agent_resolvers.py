"""The read-only private-agent APIs a UI needs (collaborator-policy.md §5.1,
§7.2, §8.5, §9; scope-model.md §3.9), over the WebSocket against PostgreSQL:
the lazy `@` candidate resolver, contribution capability, per-message context
state and `visibility.explain`.

Statement counts are measured, not assumed: asyncpg query loggers record every
statement the server runs while it answers one op (see `statements_of`)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
import pytest

from client import connect
from server import logs
from storage import private_authority
from storage.ids import new_id
from storage.visibility.resolvers import CANDIDATE_SCAN_LIMIT
from tests.conftest import App, add_person
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in

AUTHORITY_TABLES = re.compile(r"\b(scope_private_grants|scope_executions|task_scope_participant_metadata)\b")


@contextlib.contextmanager
def statements_of(app: App, op: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every SQL statement the server runs while answering requests of `op`
    (authentication included): the database units that op's handler hands to
    the bridge get a query logger on their pooled connection for their run.
    Units of other ops and background tasks are left alone."""
    captured: list[str] = []

    def logging_units(method):
        async def run(fn, *args, **kwargs):
            if logs.request_op.get() != op:
                return await method(fn, *args, **kwargs)

            async def logged(conn, *unit_args, **unit_kwargs):
                with conn.query_logger(lambda record: captured.append(record.query)):
                    return await fn(conn, *unit_args, **unit_kwargs)

            return await method(logged, *args, **kwargs)
        return run

    with monkeypatch.context() as patch:
        patch.setattr(app.db, "run", logging_units(app.db.run))
        patch.setattr(app.db, "transaction", logging_units(app.db.transaction))
        yield captured


def authority_statements(statements: list[str]) -> list[str]:
    return [s for s in statements if AUTHORITY_TABLES.search(s)]


@pytest.fixture
async def team(app: App, tenants, member_password_hash):
    """Alpha's owner (who owns the private agents below) and three more humans."""
    alpha, _ = tenants
    people = [await add_person(app.db, alpha.workspace_id, f"{name}@example.com", "developer", member_password_hash)
              for name in ("bob", "carol", "dave")]
    return alpha, *people


async def private_agents(app: App, workspace_id: str, scope_ids: list[str], owner: str,
                         handles: list[str]) -> list[str]:
    """Private agents of `owner`, each a private member of every scope in `scope_ids`
    (fixture rows: the server path is agent.create + scope.invite by the owner)."""
    ids = [new_id("mem") for _ in handles]

    async def unit(conn):
        await conn.execute(
            "INSERT INTO members (id, workspace_id, kind, handle, display_name, owner_member_id, visibility) "
            "SELECT i, $1, 'agent', h, h, $2, 'private' FROM unnest($3::text[], $4::text[]) AS t(i, h)",
            workspace_id, owner, ids, handles)
        for scope_id in scope_ids:
            await conn.execute(
                "INSERT INTO scope_memberships (id, workspace_id, scope_id, member_id, visibility, owner_member_id, "
                "effective_from_seq) SELECT s, $1, $2, i, 'private', $3, (SELECT latest_seq + 1 FROM scopes "
                "WHERE id = $2) FROM unnest($4::text[], $5::text[]) AS t(i, s)",
                workspace_id, scope_id, owner, ids, [new_id("smb") for _ in ids])

    await app.db.transaction(unit)
    return ids


async def grant(app: App, workspace_id: str, scope_id: str, owner: str, grantee: str, expires_at=None):
    return await app.db.transaction(private_authority.create_grant, workspace_id, scope_id, owner, grantee,
                                    expires_at)


async def collaborate(app: App, workspace_id: str, scope_id: str, scope_type: str, owner: str, member: str):
    async def unit(conn):
        execution = await private_authority.ensure_execution(conn, workspace_id, owner, scope_id, scope_type,
                                                             "first_collaborator")
        return await private_authority.add_collaborator(conn, workspace_id, execution, member, owner, None)

    return (await app.db.transaction(unit)).collaborator


async def move_into_past(app: App, table: str, row_id: str, start: str) -> None:
    """Make an authority row one that started two hours ago and expired an hour ago
    (and that no sweep has closed yet)."""
    await app.db.run(lambda c: c.execute(
        f"UPDATE {table} SET {start} = now() - interval '2 hours', expires_at = now() - interval '1 hour' "
        f"WHERE id = $1", row_id))


async def agent_connection(stack: contextlib.AsyncExitStack, app: App, owner_conn, agent_id: str, ws: dict):
    key = await owner_conn.call("apikey.create", name=f"key-{agent_id}", member_id=agent_id, **ws)
    conn = await stack.enter_async_context(connect(app.url))
    await conn.auth(api_key=key["key"])
    return conn


# --- the `@` candidate resolver ---------------------------------------------------------------------------

async def test_own_agents_take_the_fast_path_without_any_authority_lookup(app: App, team, monkeypatch):
    alpha, bob, _, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    owner = alpha.owner.member_id
    async with await signed_in(app, alpha.owner) as o:
        channel = await open_channel(o, alpha.workspace_id, "fast", [bob.member_id])
        elsewhere = await open_channel(o, alpha.workspace_id, "elsewhere")
        mine = await private_agents(app, alpha.workspace_id, [channel["id"]], owner, ["writer", "w_x", "wax"])
        await private_agents(app, alpha.workspace_id, [elsewhere["id"]], owner, ["wanderer"])  # not a member here
        public = await o.call("agent.create", handle="wpublic", display_name="Public", visibility="public", **ws)
        await o.call("scope.invite", scope_id=channel["id"], member_ids=[public["id"]], **ws)
        with statements_of(app, "private_agent.candidates", monkeypatch) as statements:
            found = await o.call("private_agent.candidates", scope_id=channel["id"], prefix="w", **ws)
            assert [(c["handle"], c["relation"]) for c in found["candidates"]] == [
                ("w_x", "owner"), ("wax", "owner"), ("writer", "owner")]
            assert found["candidates"][2] == {"member_id": mine[0], "handle": "writer", "display_name": "writer",
                                              "owner_member_id": owner, "relation": "owner"}
            assert not found["scan_exhausted"]
            # `_` in a prefix is a literal underscore, not a LIKE wildcard.
            narrow = await o.call("private_agent.candidates", scope_id=channel["id"], prefix="w_", **ws)
            assert [c["handle"] for c in narrow["candidates"]] == ["w_x"]
            capped = await o.call("private_agent.candidates", scope_id=channel["id"], prefix="w", limit=1, **ws)
            assert [c["handle"] for c in capped["candidates"]] == ["w_x"]
        assert statements and authority_statements(statements) == []
        # Bob sees none of them: he has no grant and is no collaborator.
        async with await signed_in(app, bob) as b:
            assert (await b.call("private_agent.candidates", scope_id=channel["id"], **ws))["candidates"] == []
        # Bad input: typed errors.
        await expect_error("bad_frame", o.call("private_agent.candidates", scope_id=channel["id"], limit=21, **ws))
        await expect_error("bad_frame", o.call("private_agent.candidates", scope_id=channel["id"], prefix="W%", **ws))
        await expect_error("invalid", o.call("private_agent.candidates", scope_id="scp_bad", **ws))
    async with await signed_in(app, team[3]) as d:  # not a member of the channel
        await expect_error("forbidden", d.call("private_agent.candidates", scope_id=channel["id"], **ws))
    # Nothing was written: no Scope Execution for an owner-only lookup.
    assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_executions")) == 0


async def _candidate_statements(app: App, monkeypatch, conn, scope_id: str, ws: dict, limit: int):
    with statements_of(app, "private_agent.candidates", monkeypatch) as statements:
        found = await conn.call("private_agent.candidates", scope_id=scope_id, prefix="agent-", limit=limit, **ws)
    return found, statements


async def test_other_owners_are_checked_in_one_batch_whatever_their_number(app: App, team, member_password_hash,
                                                                         monkeypatch):
    alpha, bob, _, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    owners = [await add_person(app.db, alpha.workspace_id, f"owner{i}@example.com", "developer", member_password_hash)
              for i in range(50)]
    async with await signed_in(app, alpha.owner) as o:
        few = await open_channel(o, alpha.workspace_id, "few", [bob.member_id])
        many = await open_channel(o, alpha.workspace_id, "many", [bob.member_id])
    # "few": 2 owners, one of whom granted Bob; "many": 50 owners, every other one granted Bob
    # (alternately a grant and a People collaborator role).
    for i, owner in enumerate(owners[:2]):
        await private_agents(app, alpha.workspace_id, [few["id"]], owner.member_id, [f"agent-few-{i:02d}"])
    await grant(app, alpha.workspace_id, few["id"], owners[0].member_id, bob.member_id)
    for i, owner in enumerate(owners):
        await private_agents(app, alpha.workspace_id, [many["id"]], owner.member_id, [f"agent-many-{i:02d}"])
        if i % 4 == 0:
            await grant(app, alpha.workspace_id, many["id"], owner.member_id, bob.member_id)
        elif i % 4 == 2:
            await collaborate(app, alpha.workspace_id, many["id"], "channel", owner.member_id, bob.member_id)
    async with await signed_in(app, bob) as b:
        counts = {}
        for scope, name in ((few, "few"), (many, "many")):
            for limit in (1, 20):
                found, statements = await _candidate_statements(app, monkeypatch, b, scope["id"], ws, limit)
                counts[name, limit] = (len(statements), len(authority_statements(statements)))
                if name == "few":
                    assert [c["handle"] for c in found["candidates"]] == ["agent-few-00"]
                else:
                    expected = [f"agent-many-{i:02d}" for i in range(0, 50, 2)][:limit]
                    assert [c["handle"] for c in found["candidates"]] == expected
                    assert {c["relation"] for c in found["candidates"]} == (
                        {"grant"} if limit == 1 else {"grant", "collaborator"})
    # One authority statement, and the same statements in all, whatever K and the number of owners.
    assert len(set(counts.values())) == 1, counts
    assert counts["few", 1][1] == 1


async def test_unauthorized_owners_never_crowd_out_authorized_ones(app: App, team, member_password_hash):
    alpha, bob, carol, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as o:
        channel = await open_channel(o, alpha.workspace_id, "crowd", [bob.member_id, carol.member_id])
    # Carol's 30 agents sort before the owner's; Bob may address only the owner's.
    await private_agents(app, alpha.workspace_id, [channel["id"]], carol.member_id,
                         [f"aa-{i:02d}" for i in range(30)])
    authorized = await private_agents(app, alpha.workspace_id, [channel["id"]], alpha.owner.member_id,
                                      ["ab-1", "ab-2", "ab-3"])
    granted = await grant(app, alpha.workspace_id, channel["id"], alpha.owner.member_id, bob.member_id)
    async with await signed_in(app, bob) as b:
        found = await b.call("private_agent.candidates", scope_id=channel["id"], prefix="a", limit=2, **ws)
        assert [c["member_id"] for c in found["candidates"]] == authorized[:2]
        assert found["candidates"][0]["relation"] == "grant"
        assert found["candidates"][0]["ref_id"] == granted["id"]
        assert found["candidates"][0]["source_scope_id"] == channel["id"]
        assert not found["scan_exhausted"]
        # The scan before authorization is a hard cap too: past it, the answer is
        # underfilled and says so (a longer prefix finds the rest).
        await private_agents(app, alpha.workspace_id, [channel["id"]], carol.member_id,
                             [f"aa-more-{i:03d}" for i in range(CANDIDATE_SCAN_LIMIT)])
        found = await b.call("private_agent.candidates", scope_id=channel["id"], prefix="a", **ws)
        assert found == {"candidates": [], "scan_exhausted": True}
        found = await b.call("private_agent.candidates", scope_id=channel["id"], prefix="ab", **ws)
        assert [c["member_id"] for c in found["candidates"]] == authorized and not found["scan_exhausted"]


async def test_revoked_and_expired_authority_is_not_active(app: App, team):
    alpha, bob, carol, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    owner = alpha.owner.member_id
    async with await signed_in(app, alpha.owner) as o:
        channel = await open_channel(o, alpha.workspace_id, "ended", [bob.member_id, carol.member_id])
    [agent] = await private_agents(app, alpha.workspace_id, [channel["id"]], owner, ["helper"])
    bob_grant = await grant(app, alpha.workspace_id, channel["id"], owner, bob.member_id)
    carol_role = await collaborate(app, alpha.workspace_id, channel["id"], "channel", owner, carol.member_id)

    async def seen_by(person) -> tuple[list[str], str]:
        async with await signed_in(app, person) as conn:
            found = await conn.call("private_agent.candidates", scope_id=channel["id"], **ws)
            relation = await conn.call("private_agent.contribution", scope_id=channel["id"], owner_member_id=owner,
                                       **ws)
            return [c["member_id"] for c in found["candidates"]], relation["relation"]

    assert await seen_by(bob) == ([agent], "grant")
    assert await seen_by(carol) == ([agent], "collaborator")
    # Expired, not yet closed by the sweep: inactive by the clock alone.
    await move_into_past(app, "scope_private_grants", bob_grant["id"], "created_at")
    await move_into_past(app, "task_scope_participant_metadata", carol_role["id"], "added_at")
    assert await seen_by(bob) == ([], "none")
    assert await seen_by(carol) == ([], "none")
    # The resolvers cleaned nothing up: the expired rows are left open for the sweep.
    assert await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM scope_private_grants WHERE effective_to_global_seq IS NULL")) == 1
    assert await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM task_scope_participant_metadata WHERE active_key IS NOT NULL")) == 1
    # Re-granted, then revoked / removed.
    again = await grant(app, alpha.workspace_id, channel["id"], owner, bob.member_id)
    assert await seen_by(bob) == ([agent], "grant")
    await app.db.transaction(private_authority.revoke_grant, alpha.workspace_id, owner, again["id"])
    assert await seen_by(bob) == ([], "none")
    role = await collaborate(app, alpha.workspace_id, channel["id"], "channel", owner, carol.member_id)
    assert await seen_by(carol) == ([agent], "collaborator")
    await app.db.transaction(private_authority.end_collaborator, alpha.workspace_id, role["id"], owner, "remove")
    assert await seen_by(carol) == ([], "none")


async def _thread(conn, channel_id: str, ws: dict) -> tuple[str, str]:
    root = await conn.call("message.send", scope_id=channel_id, content="root", **ws)
    reply = await conn.call("thread.reply", scope_id=channel_id, root_message_id=root["id"], content="reply", **ws)
    return reply["scope_id"], root["id"]


async def test_a_thread_sees_its_parent_channel_authority_never_a_sibling_thread(app: App, team):
    alpha, bob, carol, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    owner = alpha.owner.member_id
    async with await signed_in(app, alpha.owner) as o:
        channel = await open_channel(o, alpha.workspace_id, "parent", [bob.member_id, carol.member_id])
        (first, first_root), (second, second_root) = await _thread(o, channel["id"], ws), await _thread(
            o, channel["id"], ws)
    [agent] = await private_agents(app, alpha.workspace_id, [channel["id"]], owner, ["helper"])
    channel_grant = await grant(app, alpha.workspace_id, channel["id"], owner, bob.member_id)
    sibling_grant = await grant(app, alpha.workspace_id, second, owner, carol.member_id)
    for person in (bob, carol):  # replying joins them to both threads
        async with await signed_in(app, person) as conn:
            for root in (first_root, second_root):
                await conn.call("thread.reply", scope_id=channel["id"], root_message_id=root, content="me", **ws)
    async with await signed_in(app, bob) as b:
        # Bob's channel grant covers both threads (the agent is a private member of the parent).
        for thread in (first, second):
            [found] = (await b.call("private_agent.candidates", scope_id=thread, **ws))["candidates"]
            assert (found["member_id"], found["relation"], found["source_scope_id"], found["ref_id"]) == (
                agent, "grant", channel["id"], channel_grant["id"])
            contribution = await b.call("private_agent.contribution", scope_id=thread, owner_member_id=owner, **ws)
            assert (contribution["relation"], contribution["source_scope_id"]) == ("grant", channel["id"])
    async with await signed_in(app, carol) as c:
        # Carol's grant on the second thread covers that thread only: not its sibling, not the parent.
        [found] = (await c.call("private_agent.candidates", scope_id=second, **ws))["candidates"]
        assert (found["relation"], found["source_scope_id"], found["ref_id"]) == ("grant", second, sibling_grant["id"])
        for scope in (first, channel["id"]):
            assert (await c.call("private_agent.candidates", scope_id=scope, **ws))["candidates"] == []
            assert (await c.call("private_agent.contribution", scope_id=scope, owner_member_id=owner,
                                 **ws))["relation"] == "none"


# --- contribution capability ----------------------------------------------------------------------------

async def test_contribution_capability_per_relation(app: App, team, monkeypatch):
    alpha, bob, carol, dave = team
    ws = {"workspace_id": alpha.workspace_id}
    owner = alpha.owner.member_id
    async with contextlib.AsyncExitStack() as stack:
        o = await stack.enter_async_context(await signed_in(app, alpha.owner))
        channel = await open_channel(o, alpha.workspace_id, "contrib", [bob.member_id, carol.member_id, dave.member_id])
        agents = [await o.call("agent.create", handle=h, display_name=h, **ws) for h in ("one", "two")]
        await o.call("scope.invite", scope_id=channel["id"], member_ids=[a["id"] for a in agents], **ws)
        expires = await app.db.run(lambda c: c.fetchval("SELECT now() + interval '1 day'"))
        bob_grant = await grant(app, alpha.workspace_id, channel["id"], owner, bob.member_id, expires)
        carol_role = await collaborate(app, alpha.workspace_id, channel["id"], "channel", owner, carol.member_id)
        agent = await agent_connection(stack, app, o, agents[0]["id"], ws)
        answers = {}
        for name, conn in (("owner", o), ("agent", agent)):
            answers[name] = await conn.call("private_agent.contribution", scope_id=channel["id"],
                                            owner_member_id=owner, **ws)
        for person in (bob, carol, dave):
            conn = await stack.enter_async_context(await signed_in(app, person))
            with statements_of(app, "private_agent.contribution", monkeypatch) as statements:
                answers[person.email] = await conn.call("private_agent.contribution", scope_id=channel["id"],
                                                        owner_member_id=owner, **ws)
            assert len(authority_statements(statements)) == 1  # one statement, no message scan
        await expect_error("invalid", o.call("private_agent.contribution", scope_id=channel["id"],
                                             owner_member_id="nope", **ws))
    assert answers["owner"] == {"relation": "owner", "can_contribute_context": True, "can_wake": True,
                                "can_share": True}
    assert answers["agent"] == {"relation": "same_owner_agent", "can_contribute_context": True, "can_wake": True,
                                "can_share": False, "source_scope_id": channel["id"]}
    assert answers["bob@example.com"] == {
        "relation": "grant", "can_contribute_context": True, "can_wake": True, "can_share": False,
        "source_scope_id": channel["id"], "ref_id": bob_grant["id"],
        "expires_at_ms": int(expires.timestamp() * 1000)}
    assert answers["carol@example.com"] == {
        "relation": "collaborator", "can_contribute_context": True, "can_wake": True, "can_share": False,
        "source_scope_id": channel["id"], "ref_id": carol_role["id"]}
    assert answers["dave@example.com"] == {"relation": "none", "can_contribute_context": False, "can_wake": False,
                                           "can_share": False}


# --- per-message context state ----------------------------------------------------------------------------

async def test_context_state_of_each_message_for_its_owner(app: App, team, monkeypatch):
    alpha, bob, carol, dave = team
    ws = {"workspace_id": alpha.workspace_id}
    owner = alpha.owner.member_id
    async with contextlib.AsyncExitStack() as stack:
        o = await stack.enter_async_context(await signed_in(app, alpha.owner))
        b, c, d = [await stack.enter_async_context(await signed_in(app, p)) for p in (bob, carol, dave)]
        channel = await open_channel(o, alpha.workspace_id, "context", [bob.member_id, carol.member_id,
                                                                        dave.member_id])
        other = await open_channel(o, alpha.workspace_id, "other", [dave.member_id])
        secret = await open_channel(d, alpha.workspace_id, "secret", visibility="private")
        agent = await o.call("agent.create", handle="reader", display_name="Reader", **ws)
        await o.call("scope.invite", scope_id=channel["id"], member_ids=[agent["id"]], **ws)
        agent_conn = await agent_connection(stack, app, o, agent["id"], ws)

        async def send(conn, text, scope=channel):
            return (await conn.call("message.send", scope_id=scope["id"], content=text, **ws))["id"]

        before_grant = await send(b, "bob before his grant")
        bob_grant = await grant(app, alpha.workspace_id, channel["id"], owner, bob.member_id)
        role = await collaborate(app, alpha.workspace_id, channel["id"], "channel", owner, carol.member_id)
        ids = {
            "owner": await send(o, "mine"), "agent": await send(agent_conn, "agent output"),
            "bob": await send(b, "bob granted"), "carol": await send(c, "carol collaborating"),
            "dave": await send(d, "dave, no relation"), "dave-shared": await send(d, "dave, shared later"),
            "other-scope": await send(d, "elsewhere", other), "unreadable": await send(d, "secret", secret),
        }
        quote = await o.call("message.forward", scope_id=channel["id"], mode="owner_quote",
                             source_message_ids=[ids["dave-shared"]], **ws)
        withdrawn = await send(d, "withdrawn later")
        await d.call("message.withdraw", message_id=withdrawn, **ws)
        asked = [before_grant, *ids.values(), withdrawn, "msg_doesnotexist00", ids["owner"]]
        result = await o.call("private_agent.context_state", scope_id=channel["id"], message_ids=asked, **ws)
        states = {s["message_id"]: s for s in result["states"]}
        assert [s["message_id"] for s in result["states"]] == asked[:-1]  # distinct ids, in request order
        assert states[ids["owner"]] == {"message_id": ids["owner"], "state": "context_eligible", "can_share": True,
                                        "relation": "owner"}
        assert states[ids["agent"]]["relation"] == "own_agent"
        assert states[ids["bob"]] == {"message_id": ids["bob"], "state": "context_eligible", "can_share": True,
                                      "relation": "grant", "source_scope_id": channel["id"],
                                      "ref_id": bob_grant["id"]}
        assert (states[ids["carol"]]["relation"], states[ids["carol"]]["ref_id"]) == ("collaborator", role["id"])
        assert states[ids["dave-shared"]] == {"message_id": ids["dave-shared"], "state": "context_eligible",
                                              "can_share": True, "relation": "shared",
                                              "source_scope_id": channel["id"], "ref_id": quote["id"]}
        # Not retroactive: Bob's message from before his grant needs a share.
        for message_id in (before_grant, ids["dave"]):
            assert states[message_id] == {"message_id": message_id, "state": "share_needed", "can_share": True}
        assert states[withdrawn] == {"message_id": withdrawn, "state": "share_needed", "can_share": False}
        for message_id in (ids["other-scope"], ids["unreadable"], "msg_doesnotexist00"):
            assert states[message_id] == {"message_id": message_id, "state": "not_found", "can_share": False}
        # Dave has no private agents here: the owner-less view of the same messages.
        daves = await d.call("private_agent.context_state", scope_id=channel["id"], message_ids=[ids["owner"]], **ws)
        assert daves["states"][0]["state"] == "share_needed"
        await expect_error("invalid", o.call("private_agent.context_state", scope_id=channel["id"],
                                             message_ids=["bad"], **ws))
        await expect_error("bad_frame", o.call("private_agent.context_state", scope_id=channel["id"],
                                               message_ids=[], **ws))
        await expect_error("not_found", o.call("private_agent.context_state", scope_id=secret["id"],
                                               message_ids=[ids["unreadable"]], **ws))


async def test_context_state_runs_the_same_statements_for_one_message_or_a_hundred(app: App, team, monkeypatch):
    alpha, bob, _, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as o, await signed_in(app, bob) as b:
        channel = await open_channel(o, alpha.workspace_id, "bulk", [bob.member_id])
        await grant(app, alpha.workspace_id, channel["id"], alpha.owner.member_id, bob.member_id)
        sent = [(await (o if i % 2 else b).call("message.send", scope_id=channel["id"], content=f"m{i}",
                                                **ws))["id"] for i in range(100)]
        counts = []
        for ids in (sent[:1], sent):
            with statements_of(app, "private_agent.context_state", monkeypatch) as statements:
                result = await o.call("private_agent.context_state", scope_id=channel["id"], message_ids=ids, **ws)
            assert {s["state"] for s in result["states"]} == {"context_eligible"} and len(result["states"]) == len(ids)
            counts.append(len(statements))
        assert counts[0] == counts[1], counts


# --- visibility.explain -----------------------------------------------------------------------------------

async def test_explain_is_for_the_member_itself_or_its_owner(app: App, team):
    alpha, bob, carol, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    owner = alpha.owner.member_id
    async with contextlib.AsyncExitStack() as stack:
        o = await stack.enter_async_context(await signed_in(app, alpha.owner))
        b = await stack.enter_async_context(await signed_in(app, bob))
        channel = await open_channel(o, alpha.workspace_id, "explain", [bob.member_id, carol.member_id])
        agent = await o.call("agent.create", handle="explained", display_name="Explained", **ws)
        await o.call("scope.invite", scope_id=channel["id"], member_ids=[agent["id"]], **ws)
        agent_conn = await agent_connection(stack, app, o, agent["id"], ws)
        before = await b.call("message.send", scope_id=channel["id"], content="before the grant", **ws)
        bob_grant = await grant(app, alpha.workspace_id, channel["id"], owner, bob.member_id)
        inside = await b.call("message.send", scope_id=channel["id"], content="inside the grant", **ws)
        for conn in (o, agent_conn):  # the owner and the agent itself
            explained = await conn.call("visibility.explain", message_id=inside["id"], member_id=agent["id"], **ws)
            assert explained["readable"] and explained["reason"] == "grant"
            assert explained["grant_id"] == bob_grant["id"]
            assert explained["membership"]["scope_id"] == channel["id"]
            assert "effective_to_seq" not in explained["membership"]
            assert explained["window"] == {"kind": "grant", "scope_id": channel["id"],
                                           "effective_from_global_seq": bob_grant["effective_from_global_seq"]}
        # "Not readable" only about a message the caller reads: the agent learns nothing of it.
        assert await o.call("visibility.explain", message_id=before["id"], member_id=agent["id"],
                            **ws) == {"readable": False}
        await expect_error("not_found", agent_conn.call("visibility.explain", message_id=before["id"],
                                                        member_id=agent["id"], **ws))
        mine = await o.call("visibility.explain", message_id=inside["id"], member_id=owner, **ws)
        assert (mine["readable"], mine["reason"], mine["membership"]["scope_id"]) == (True, "membership", channel["id"])
        # Nobody else learns anything, not even whether the member exists.
        for member_id in (agent["id"], owner, "mem_doesnotexist00"):
            await expect_error("not_found", b.call("visibility.explain", message_id=inside["id"],
                                                   member_id=member_id, **ws))
        await expect_error("not_found", agent_conn.call("visibility.explain", message_id=inside["id"],
                                                        member_id=owner, **ws))
        # An unknown message is not found.
        await expect_error("not_found", o.call("visibility.explain", message_id="msg_doesnotexist00",
                                               member_id=agent["id"], **ws))
        await expect_error("invalid", o.call("visibility.explain", message_id=inside["id"], member_id="x", **ws))
