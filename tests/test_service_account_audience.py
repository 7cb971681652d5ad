"""Workspace service accounts, the audience half (issue 14; service-account.md §3, §9.2,
§9.4) over the WebSocket against PostgreSQL: the audience converges to exactly the
workspace's active humans (never agents or service members), a human who joins later
starts at the scope's tail yet reads the whole history, leaving the workspace closes
the membership and coming back restores it, managers are in the audience like anyone
and get the same unread — and a state machine over human lifecycle operations.

Waiting is on the protocol's own signal: `service_account.audience_changed` on the
workspace feed (subscribed before the change, so it cannot be missed), never polling."""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from client import ClientError, connect
from server import tenancy as ops
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from storage import tenancy
from storage.bridge import Database
from tests.conftest import MEMBER_PASSWORD, App
from tests.server_thread import ServerThread
from tests.test_messaging import team  # noqa: F401  (a fixture)
from tests.test_tenancy import expect_error, signed_in

EVENT_BOUND = 30  # seconds an event the protocol promises may take on a busy machine


# --- helpers shared by the service-account test files ------------------------------------------

async def next_event(conn, name: str, where=lambda data: True, bound: float = EVENT_BOUND) -> dict:
    """The next push named `name` whose data satisfies `where` (others are skipped)."""
    with trio.fail_after(bound):
        while True:
            event = await conn.next_event()
            if event["event"] == name and where(event["data"]):
                return event


async def follow_workspace(conn, ws: dict) -> None:
    await conn.call("subscribe", workspace_feed=True, **ws)


async def audience_settled(conn, ws: dict, account_id: str, member_count: int | None = None) -> dict:
    """The account's AudienceInfo once it is `ready` (with `member_count` members, when
    given).  The connection must follow the workspace feed from before the change: the
    current state is read after subscribing, so the event cannot slip between."""

    def settled(audience: dict) -> bool:
        return audience["state"] == "ready" and member_count in (None, audience["member_count"])

    audience = await conn.call("service_account.audience.get", service_account_id=account_id, **ws)
    if settled(audience):
        return audience
    with trio.move_on_after(EVENT_BOUND):
        event = await next_event(conn, "service_account.audience_changed",
                                 lambda data: data["service_account_id"] == account_id and settled(data["audience"]))
        return event["data"]["audience"]
    audience = await conn.call("service_account.audience.get", service_account_id=account_id, **ws)
    raise AssertionError(f"no ready audience of {member_count} members within {EVENT_BOUND}s; now: {audience}")


async def create_account(conn, ws: dict, name: str, description: str = "") -> dict:
    """Direct create by an owner/admin; the ServiceAccountDetail once the audience is ready."""
    await follow_workspace(conn, ws)
    request = await conn.call("service_account.request.submit", client_request_id=f"create-{name}", name=name,
                              description=description, **ws)
    assert request["authorization_path"] == "direct_create", request
    account_id = request["created_service_account_id"]
    await audience_settled(conn, ws, account_id)
    return await conn.call("service_account.get", service_account_id=account_id, **ws)


async def post(conn, ws: dict, account_id: str, title: str, content: str = "body", **fields) -> dict:
    fields.setdefault("client_message_id", str(uuid.uuid4()))
    return await conn.call("service_account.post", service_account_id=account_id, title=title, content=content,
                           **fields, **ws)


async def open_memberships(db, scope_id: str) -> dict[str, dict]:
    """member id -> its open membership row, for every open membership of the scope."""
    rows = await db.run(lambda c: c.fetch(
        "SELECT id, member_id, effective_from_seq, last_read_seq FROM scope_memberships "
        "WHERE scope_id = $1 AND effective_to_seq IS NULL", scope_id))
    assert len(rows) == len({r["member_id"] for r in rows}), "two open memberships for one member"
    return {r["member_id"]: dict(r) for r in rows}


async def active_humans(db, workspace_id: str) -> set[str]:
    rows = await db.run(lambda c: c.fetch(
        "SELECT m.id FROM members m JOIN workspace_memberships w ON w.id = m.workspace_membership_id "
        "WHERE m.workspace_id = $1 AND m.kind = 'human' AND m.status = 'active' AND w.status = 'active'",
        workspace_id))
    return {r["id"] for r in rows}


async def invite(owner, ws: dict, email: str) -> str:
    return (await owner.call("invitation.create", email=email, role="developer", **ws))["token"]


async def expect_error_in(codes: tuple[str, ...], coro) -> ClientError:
    with pytest.raises(ClientError) as caught:
        await coro
    assert caught.value.code in codes, caught.value
    return caught.value


async def serve(db, nursery, **config) -> str:
    """Another in-process server on the test's database, with these config values; its URL."""
    settings = ServerConfig(port=0, auth_timeout_seconds=2.0, shutdown_grace_seconds=2.0, **config)
    server = Server(settings, db, Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()),
                                                settings.session_ttl_seconds))
    await nursery.start(server.run)
    return f"ws://127.0.0.1:{server.port}"


async def bulk_humans(db, workspace_id: str, count: int, password_hash: str, prefix: str) -> list[str]:
    """`count` active humans straight through storage (the same writes a member's
    arrival makes), in one transaction: fast enough for hundreds."""

    async def unit(conn) -> list[str]:
        member_ids = []
        for i in range(count):
            account_id = await tenancy.create_account(conn, f"{prefix}{i}@example.com", f"{prefix} {i}", password_hash)
            member_ids.append((await tenancy.add_human_member(conn, workspace_id, account_id, "viewer", None))[1])
        return member_ids

    return await db.transaction(unit)


def conversation(page: dict, scope_id: str) -> dict | None:
    return next((c for c in page["conversations"] if c["scope_id"] == scope_id), None)


# --- convergence -------------------------------------------------------------------------------

async def test_the_audience_is_exactly_the_active_humans(app: App, team):  # noqa: F811
    alpha, beta, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        scout = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        other = await create_account(owner, ws, "Other")
        news = await create_account(owner, ws, "News")
        scope_id = news["profile"]["scope_id"]
        humans = {alpha.owner.member_id, bob.member_id, carol.member_id}
        assert await active_humans(app.db, alpha.workspace_id) == humans
        members = await open_memberships(app.db, scope_id)
        assert set(members) == humans
        # Never an agent, the account's own author, another account's author, or another workspace's human.
        assert not {scout["id"], news["profile"]["member_id"], other["profile"]["member_id"],
                    beta.owner.member_id} & set(members)
        # Created on an empty scope: nothing to skip, nothing unread.
        assert {(m["effective_from_seq"], m["last_read_seq"]) for m in members.values()} == {(1, 0)}
        audience = news["governance"]["audience"]
        assert (audience["state"], audience["member_count"]) == ("ready", 3)
        assert audience["effective_audience_version"] == audience["audience_policy_version"] >= 1
        assert audience["batches_done"] >= 1
        # Managers change management, never the audience.
        await owner.call("service_account.managers.add", service_account_id=news["profile"]["service_account_id"],
                         member_id=carol.member_id, **ws)
        await owner.call("service_account.managers.remove",
                         service_account_id=news["profile"]["service_account_id"], member_id=carol.member_id, **ws)
        again = await owner.call("service_account.audience.get",
                                 service_account_id=news["profile"]["service_account_id"], **ws)
        assert (again["state"], again["member_count"], again["audience_policy_version"]) == (
            "ready", 3, audience["audience_policy_version"])
        assert await open_memberships(app.db, scope_id) == members


async def test_a_new_human_starts_at_the_tail_and_reads_the_whole_history(app: App, team):  # noqa: F811
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        news = await create_account(owner, ws, "News")
        account_id, scope_id = news["profile"]["service_account_id"], news["profile"]["scope_id"]
        before = [await post(owner, ws, account_id, f"before {i}") for i in range(3)]
        token = await invite(owner, ws, "dave@example.com")
        async with connect(app.url) as dave:
            joined = await dave.call("invitation.accept", token=token, password="dave-password")
            dave_id = next(w["member_id"] for w in joined["workspaces"] if w["id"] == alpha.workspace_id)
            await audience_settled(owner, ws, account_id, member_count=4)
            members = await open_memberships(app.db, scope_id)
            assert set(members) == await active_humans(app.db, alpha.workspace_id)
            assert (members[dave_id]["effective_from_seq"], members[dave_id]["last_read_seq"]) == (4, 3)
            history = await dave.call("message.history", scope_id=scope_id, **ws)
            assert [m["id"] for m in history["messages"]] == [m["id"] for m in before]
            assert history["last_read_seq"] == 3
            after = await post(owner, ws, account_id, "after dave")
            inbox = await dave.call("inbox.list", **ws)
            assert conversation(inbox, scope_id)["unread_count"] == 1  # only what came after joining
            assert conversation(inbox, scope_id)["last_message_id"] == after["id"]
        # The manager is in the audience like anyone: the same unread as Bob (the service
        # member is the notify principal, so the manager's own posts count for them too).
        async with await signed_in(app, bob) as b:
            assert conversation(await b.call("inbox.list", **ws), scope_id)["unread_count"] == 4
        assert conversation(await owner.call("inbox.list", **ws), scope_id)["unread_count"] == 4


async def test_leaving_the_workspace_closes_the_membership_and_coming_back_restores_it(app: App, team):  # noqa: F811
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        news = await create_account(owner, ws, "News")
        account_id, scope_id = news["profile"]["service_account_id"], news["profile"]["scope_id"]
        first = await post(owner, ws, account_id, "first")
        await owner.call("member.remove", member_id=bob.member_id, **ws)
        await audience_settled(owner, ws, account_id, member_count=2)
        assert set(await open_memberships(app.db, scope_id)) == await active_humans(app.db, alpha.workspace_id)
        closed = await app.db.run(lambda c: c.fetch(
            "SELECT effective_from_seq, effective_to_seq FROM scope_memberships WHERE scope_id = $1 "
            "AND member_id = $2", scope_id, bob.member_id))
        assert [tuple(r) for r in closed] == [(1, 1)]
        while_away = await post(owner, ws, account_id, "while bob was away")
        async with await signed_in(app, bob) as b:
            for call in (b.call("message.history", scope_id=scope_id, **ws), b.call("inbox.list", **ws),
                         b.call("message.get", message_id=first["id"], **ws)):
                await expect_error_in(("forbidden", "not_found"), call)
            # Re-invited: the same member comes back and the audience takes them in again.
            await b.call("invitation.accept", token=await invite(owner, ws, bob.email))
            await audience_settled(owner, ws, account_id, member_count=3)
            rows = await app.db.run(lambda c: c.fetch(
                "SELECT effective_from_seq, effective_to_seq, last_read_seq FROM scope_memberships "
                "WHERE scope_id = $1 AND member_id = $2 ORDER BY effective_from_seq", scope_id, bob.member_id))
            assert [(r[0], r[1]) for r in rows] == [(1, 1), (3, None)] and rows[1][2] == 2
            history = await b.call("message.history", scope_id=scope_id, **ws)
            assert [m["id"] for m in history["messages"]] == [first["id"], while_away["id"]]
            assert conversation(await b.call("inbox.list", **ws), scope_id) is None  # nothing new since the return
            await post(owner, ws, account_id, "welcome back")
            assert conversation(await b.call("inbox.list", **ws), scope_id)["unread_count"] == 1


async def test_a_removal_whose_process_died_before_closing_is_applied_by_the_reconciler(app: App, team):  # noqa: F811
    """member.remove closes the member's memberships itself; when the process that
    committed a removal dies first, the lifecycle event still reaches the audience
    (the departed sweep would only come after its 30 s period)."""
    alpha, _, _, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        news = await create_account(owner, ws, "News")
        account_id, scope_id = news["profile"]["service_account_id"], news["profile"]["scope_id"]

        async def removal_only(conn) -> None:  # what the dead process committed, and nothing after it
            await tenancy.remove_member(conn, alpha.workspace_id,
                                        await tenancy.lock_membership_target(conn, alpha.workspace_id,
                                                                             carol.member_id))

        await app.db.transaction(removal_only)
        audience = await audience_settled(owner, ws, account_id, member_count=2)
        assert audience["effective_audience_version"] == audience["audience_policy_version"]
        assert set(await open_memberships(app.db, scope_id)) == await active_humans(app.db, alpha.workspace_id)
        assert carol.member_id not in await open_memberships(app.db, scope_id)


async def test_lifecycle_changes_beyond_one_batch_are_all_applied(db, nursery, tenants, member_password_hash):
    """After the first pass, the reconciler applies the workspace's lifecycle events after
    its applied version in batches: seven humans arriving in one transaction, then two of
    them leaving in another, with batches of two, all reach the audience."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    url = await serve(db, nursery, service_account_audience_batch=2)
    async with connect(url) as owner:
        await owner.login(alpha.owner.email, MEMBER_PASSWORD)
        news = await create_account(owner, ws, "News")
        account_id, scope_id = news["profile"]["service_account_id"], news["profile"]["scope_id"]
        crowd = await bulk_humans(db, alpha.workspace_id, 7, member_password_hash, "crowd")
        await audience_settled(owner, ws, account_id, member_count=8)
        assert set(await open_memberships(db, scope_id)) == await active_humans(db, alpha.workspace_id)

        async def two_leave(conn) -> None:
            for member_id in crowd[1:3]:
                await tenancy.remove_member(conn, alpha.workspace_id,
                                            await tenancy.lock_membership_target(conn, alpha.workspace_id, member_id))

        await db.transaction(two_leave)
        audience = await audience_settled(owner, ws, account_id, member_count=6)
        assert audience["effective_audience_version"] == audience["audience_policy_version"]
        assert set(await open_memberships(db, scope_id)) == await active_humans(db, alpha.workspace_id)
        assert len(await open_memberships(db, scope_id)) == 6


async def test_a_removal_racing_a_reconcile_batch_completes_and_the_server_stays_up(db, nursery, tenants,
                                                                                      member_password_hash):
    """A member removal (it locks the workspace row, then moves every account's audience
    policy) committing while a reconcile batch holds the account row must neither deadlock
    nor take the server down.  Thirty humans arrive at once and are reconciled in batches
    of one; meanwhile tenancy's own removal runs in a transaction held, after its workspace
    lock, until a batch waits on it (a bounded look at pg_stat_activity picks the moment)."""
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    url = await serve(db, nursery, service_account_audience_batch=1)
    leaving = (await bulk_humans(db, alpha.workspace_id, 1, member_password_hash, "leaving"))[0]
    workspace_locked = threading.Event()

    async def removal(conn) -> None:
        target = await tenancy.lock_membership_target(conn, alpha.workspace_id, leaving)
        workspace_locked.set()
        for _ in range(600):  # until a batch queues behind this transaction (or, where none would, all are done)
            if await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))) "
                    "OR NOT EXISTS (SELECT 1 FROM service_accounts WHERE workspace_id = $1 "
                    "AND audience_state <> 'ready')", alpha.workspace_id):
                break
            await asyncio.sleep(0.05)
        await tenancy.remove_member(conn, alpha.workspace_id, target)

    async with connect(url) as owner:
        await owner.login(alpha.owner.email, MEMBER_PASSWORD)
        news = await create_account(owner, ws, "News")
        account_id, scope_id = news["profile"]["service_account_id"], news["profile"]["scope_id"]
        await bulk_humans(db, alpha.workspace_id, 30, member_password_hash, "crowd")
        async with trio.open_nursery() as removing:
            removing.start_soon(db.transaction, removal)
            await trio.to_thread.run_sync(workspace_locked.wait, 30)
        await audience_settled(owner, ws, account_id, member_count=31)  # the owner and the crowd
        assert set(await open_memberships(db, scope_id)) == await active_humans(db, alpha.workspace_id)
        assert leaving not in await open_memberships(db, scope_id)


async def test_a_human_joining_while_an_account_is_created_is_in_its_audience(app: App, team,  # noqa: F811
                                                                             member_password_hash):
    """A human's arrival (tenancy's own code) that has written its lifecycle event but not
    yet committed while an account is created: once both commit, the human is in the
    audience.  The arrival commits when the creation either waits on it or is ready
    (a bounded look at pg_stat_activity and the account row picks the moment)."""
    alpha, _, _, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    lifecycle_written = threading.Event()
    joined: list[str] = []

    async def joining(conn) -> None:
        account_id = await tenancy.create_account(conn, "yan@example.com", "Yan", member_password_hash)
        joined.append((await tenancy.add_human_member(conn, alpha.workspace_id, account_id, "viewer", None))[1])
        lifecycle_written.set()
        for _ in range(600):
            if await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))) "
                    "OR EXISTS (SELECT 1 FROM service_accounts WHERE workspace_id = $1 AND audience_state = 'ready')",
                    alpha.workspace_id):
                break
            await asyncio.sleep(0.05)

    async with await signed_in(app, alpha.owner) as owner:
        await follow_workspace(owner, ws)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.db.transaction, joining)
            await trio.to_thread.run_sync(lifecycle_written.wait, 30)
            request = await owner.call("service_account.request.submit", client_request_id="create-news",
                                       name="News", **ws)
        account_id = request["created_service_account_id"]
        await audience_settled(owner, ws, account_id, member_count=4)
        scope_id = (await owner.call("service_account.get", service_account_id=account_id, **ws))["profile"][
            "scope_id"]
        assert joined[0] in await open_memberships(app.db, scope_id)
        assert set(await open_memberships(app.db, scope_id)) == await active_humans(app.db, alpha.workspace_id)


async def test_nobody_changes_the_audience_by_hand(app: App, team):  # noqa: F811
    """The audience is the active humans, no opt-in or opt-out (§3.1): the generic roster
    ops refuse a service account's scope, for its managers and the workspace owner too."""
    alpha, _, bob, carol = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        news = await create_account(owner, ws, "News")
        scope_id = news["profile"]["scope_id"]
        await post(owner, ws, news["profile"]["service_account_id"], "hello")
        mine = await owner.call("agent.create", handle="owner-bot", display_name="Bot", **ws)
        public = await owner.call("agent.create", handle="shared-bot", display_name="Shared", visibility="public",
                                  **ws)
        bobs = await b.call("agent.create", handle="bob-bot", display_name="Bob's", **ws)
        members = await open_memberships(app.db, scope_id)
        attempts = {
            "bob invites his agent": lambda: b.call("scope.invite", scope_id=scope_id, member_ids=[bobs["id"]], **ws),
            "bob invites a public agent": lambda: b.call("scope.invite", scope_id=scope_id,
                                                         member_ids=[public["id"]], **ws),
            "the owner invites their agent": lambda: owner.call("scope.invite", scope_id=scope_id,
                                                                member_ids=[mine["id"]], **ws),
            "bob removes carol": lambda: b.call("scope.remove", scope_id=scope_id, member_id=carol.member_id, **ws),
            "the owner removes bob": lambda: owner.call("scope.remove", scope_id=scope_id, member_id=bob.member_id,
                                                        **ws),
            "bob leaves": lambda: b.call("scope.leave", scope_id=scope_id, **ws),
            "the owner archives it": lambda: owner.call("scope.archive", scope_id=scope_id, **ws),
        }
        outcomes = {}
        for name, attempt in attempts.items():
            try:
                await attempt()
                outcomes[name] = "done"
            except ClientError as error:
                outcomes[name] = error.code
        assert outcomes == dict.fromkeys(attempts, "forbidden"), outcomes
        key = (await owner.call("apikey.create", name="bot", member_id=public["id"], **ws))["key"]
    async with connect(app.url) as agent:
        await agent.auth(api_key=key)
        await expect_error_in(("forbidden", "not_found"), agent.call("scope.join", scope_id=scope_id, **ws))
    assert await open_memberships(app.db, scope_id) == members
    assert set(members) == await active_humans(app.db, alpha.workspace_id)
    assert await app.db.run(lambda c: c.fetchval("SELECT status FROM scopes WHERE id = $1", scope_id)) == "active"


async def test_audience_get_bad_input(app: App, team):  # noqa: F811
    alpha, beta, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        news = await create_account(owner, ws, "News")
        await expect_error("invalid", owner.call("service_account.audience.get", service_account_id="nope", **ws))
        await expect_error("not_found", owner.call("service_account.audience.get",
                                                   service_account_id="sac_zzzzzzzzzzzzzz", **ws))
    async with await signed_in(app, beta.owner) as other:
        await expect_error("not_found", other.call("service_account.audience.get", workspace_id=beta.workspace_id,
                                                   service_account_id=news["profile"]["service_account_id"]))


# --- the state machine -------------------------------------------------------------------------
# Driven over the WebSocket (invite + accept, member.remove, re-invite, agent.create) against
# one server for every example, reconciling in batches of two so a pass spans several batches.

async def _multi_workspace_instance(db: Database, url: str) -> None:
    """The server's instance: multi-workspace, as each example adds a workspace of its own."""
    await ops.init_instance(db, email="o0@example.com", display_name="O0", workspace_name="Life",
                            workspace_slug="life", edition="multi", password=MEMBER_PASSWORD)


class AudienceLifecycle(RuleBasedStateMachine):
    """A model of who is an active human; `settle` waits for the account's audience to be
    ready and checks that the open memberships of its scope are exactly the model's humans.
    Besides the WebSocket ops, two storage-level steps: several humans arriving in one
    transaction (lifecycle events pile up beyond one batch), and a removal committed by a
    process that died before closing the member's memberships (only the audience
    reconciler — or the 30 s departed sweep — closes them)."""

    numbers = itertools.count(1)

    def __init__(self, server: ServerThread, password_hash: str) -> None:
        super().__init__()
        self.server = server
        self.password_hash = password_hash
        self.number = next(self.numbers)
        self.people: dict[str, str] = {}  # email -> member id, of every human this example added
        self.active: set[str] = set()
        self.agents = 0

    def _as_owner(self, body):
        async def run():
            async with connect(self.server.url) as owner:
                await owner.login(f"owner{self.number}@example.com", MEMBER_PASSWORD)
                return await body(owner)

        return self.server.run(run)

    @initialize()
    def create(self) -> None:
        # Each example has a workspace of its own (so a replay meets the same state): its owner.
        async def unit(conn):
            return await tenancy.create_workspace(
                conn, instance_id=await tenancy.instance_id(conn), name=f"Life {self.number}",
                slug=f"life-{self.number}", type="team", owner_email=f"owner{self.number}@example.com",
                owner_display_name="Owner", owner_password_hash=self.password_hash, single_edition=False)

        workspace = self.server.run(self.server.db.transaction, unit)
        self.workspace_id, self.ws = workspace.workspace_id, {"workspace_id": workspace.workspace_id}
        self.active = {workspace.member_id}
        # An agent and another account's service member are there before the first pass too.
        self._as_owner(lambda owner: owner.call("agent.create", handle=f"early-{self.number}", display_name="Early",
                                                **self.ws))
        self._as_owner(lambda owner: create_account(owner, self.ws, f"Earlier {self.number}"))
        self.profile = self._as_owner(lambda owner: create_account(owner, self.ws, f"Lifecycle {self.number}"))[
            "profile"]
        self.check()

    @rule()
    def add_human(self) -> None:
        email = f"h{self.number}-{len(self.people)}@example.com"

        async def body(owner):
            token = await invite(owner, self.ws, email)
            async with connect(self.server.url) as conn:
                joined = await conn.call("invitation.accept", token=token, password=MEMBER_PASSWORD)
            return next(w["member_id"] for w in joined["workspaces"] if w["id"] == self.ws["workspace_id"])

        self.people[email] = self._as_owner(body)
        self.active.add(self.people[email])

    @rule(count=st.integers(2, 5))
    def add_humans_at_once(self, count: int) -> None:
        prefix = f"b{self.number}-{len(self.people)}-"
        member_ids = self.server.run(bulk_humans, self.server.db, self.workspace_id, count,
                                     self.password_hash, prefix)
        self.people.update({f"{prefix}{i}@example.com": member_id for i, member_id in enumerate(member_ids)})
        self.active.update(member_ids)

    @precondition(lambda self: any(member in self.active for member in self.people.values()))
    @rule(data=st.data())
    def remove_human_out_of_band(self, data) -> None:
        email = data.draw(st.sampled_from(sorted(e for e, m in self.people.items() if m in self.active)))

        async def unit(conn) -> None:
            target = await tenancy.lock_membership_target(conn, self.workspace_id, self.people[email])
            await tenancy.remove_member(conn, self.workspace_id, target)

        self.server.run(self.server.db.transaction, unit)
        self.active.discard(self.people[email])

    @precondition(lambda self: any(member in self.active for member in self.people.values()))
    @rule(data=st.data())
    def remove_human(self, data) -> None:
        email = data.draw(st.sampled_from(sorted(e for e, m in self.people.items() if m in self.active)))
        self._as_owner(lambda owner: owner.call("member.remove", member_id=self.people[email], **self.ws))
        self.active.discard(self.people[email])

    @precondition(lambda self: any(member not in self.active for member in self.people.values()))
    @rule(data=st.data())
    def reactivate_human(self, data) -> None:
        email = data.draw(st.sampled_from(sorted(e for e, m in self.people.items() if m not in self.active)))

        async def body(owner):
            token = await invite(owner, self.ws, email)
            async with connect(self.server.url) as conn:
                await conn.call("invitation.accept", token=token, password=MEMBER_PASSWORD)

        self._as_owner(body)
        self.active.add(self.people[email])

    @rule()
    def add_agent(self) -> None:
        self.agents += 1
        self._as_owner(lambda owner: owner.call("agent.create", handle=f"bot-{self.number}-{self.agents}",
                                                display_name="Bot", **self.ws))

    @rule()
    def settle(self) -> None:
        self.check()

    def check(self) -> None:
        async def body(owner):
            await follow_workspace(owner, self.ws)
            return await audience_settled(owner, self.ws, self.profile["service_account_id"],
                                          member_count=len(self.active))

        audience = self._as_owner(body)
        assert audience["effective_audience_version"] == audience["audience_policy_version"]
        assert self.server.run(active_humans, self.server.db, self.workspace_id) == self.active
        assert set(self.server.run(open_memberships, self.server.db, self.profile["scope_id"])) == self.active

    def teardown(self) -> None:
        if hasattr(self, "profile"):
            self.check()  # every example ends reconciled


def test_open_memberships_follow_the_active_humans(database_dsn, member_password_hash):
    config = ServerConfig(port=0, auth_timeout_seconds=5.0, shutdown_grace_seconds=1.0,
                          service_account_audience_batch=2)
    with ServerThread(database_dsn, config, _multi_workspace_instance) as server:
        # No shrinking: examples share the workspace, so a replay would not see the same state.
        run_state_machine_as_test(lambda: AudienceLifecycle(server, member_password_hash), settings=settings(
            max_examples=6, stateful_step_count=10, deadline=None, derandomize=True,
            phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck)))
