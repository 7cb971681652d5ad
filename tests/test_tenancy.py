"""Tenancy kernel over the WebSocket, against a real PostgreSQL:
roles, last-owner protection, invitations, API keys, cross-workspace probes,
write fencing, revocation, secrets at rest."""

from __future__ import annotations

import time

import pytest
import trio

from client import ClientError, connect
from protocol import frames
from server import messaging
from server.ops import collaboration, private_agents, service_accounts, strands
from server import tenancy as ops
from server.auth import system_context, system_workspace_context
from server.context import RequestContext
from server.rbac import NON_HUMAN_PERMISSIONS, ROLE_PERMISSIONS, Permission, Role
from storage import tenancy
from protocol.errors import ProtocolError
from storage.errors import Conflict, WriteFenced
from tests.conftest import MEMBER_PASSWORD, App, Person, add_person


async def signed_in(app: App, person: Person):
    """An authenticated client connection (context manager)."""
    return _SignedIn(app, person)


class _SignedIn:
    def __init__(self, app: App, person: Person) -> None:
        self.app, self.person = app, person

    async def __aenter__(self):
        self._cm = connect(self.app.url)
        self.conn = await self._cm.__aenter__()
        await self.conn.login(self.person.email, self.person.password)
        return self.conn

    async def __aexit__(self, *exc):
        return await self._cm.__aexit__(*exc)


async def expect_error(code: str, coro) -> ClientError:
    with pytest.raises(ClientError) as caught:
        await coro
    assert caught.value.code == code, caught.value
    return caught.value


# --- the matrix --------------------------------------------------------------------------------

SEED_MATRIX = {  # workspace-multi-tenant.md §10.4, transcribed: owner, admin, developer, operator, viewer
    "workspace.view": "YYYYY", "workspace.update": "YYNNN", "workspace.delete": "YNNNN",
    "owner.transfer": "YNNNN", "member.view": "YYYYY", "member.invite": "YYNNN",
    "member.update_role": "YYNNN", "member.remove": "YYNNN", "resource.view": "YYYYY",
    "resource.manage": "YYYNN", "runtime.operate": "YYYYN", "provider_secret.manage": "YYYNN",
    "api_key.manage": "YYNNN", "audit.view": "YYNNN", "data.export": "YYNNN", "billing_link.manage": "YNNNN",
}


# Messaging is not in the seed's table: every role that may do more than read
# participates; the viewer only reads (SPEC rule 8b).
MESSAGING_MATRIX = {"message.read": "YYYYY", "message.write": "YYYYN"}


def test_role_matrix_is_exactly_the_seed_matrix():
    roles = [Role.OWNER, Role.ADMIN, Role.DEVELOPER, Role.OPERATOR, Role.VIEWER]
    matrix = {**SEED_MATRIX, **MESSAGING_MATRIX}
    assert set(matrix) == {p.value for p in Permission}
    for permission, allowed in matrix.items():
        for role, flag in zip(roles, allowed):
            assert (Permission(permission) in ROLE_PERMISSIONS[role]) == (flag == "Y"), (permission, role)
    # Agents and service identities have no role: they read and write scopes, nothing else.
    assert NON_HUMAN_PERMISSIONS == {Permission.WORKSPACE_VIEW, Permission.MEMBER_VIEW, Permission.RESOURCE_VIEW,
                                     Permission.MESSAGE_READ, Permission.MESSAGE_WRITE}


@pytest.mark.parametrize("role", ["admin", "developer", "operator", "viewer"])
async def test_each_role_can_do_exactly_what_the_matrix_allows(app: App, tenants, member_password_hash, role):
    alpha, _ = tenants
    actor = await add_person(app.db, alpha.workspace_id, f"{role}@example.com", role, member_password_hash)
    victim = await add_person(app.db, alpha.workspace_id, "victim@example.com", "viewer", member_password_hash)
    allowed = ROLE_PERMISSIONS[Role(role)]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, actor) as conn:
        probes = [
            (Permission.MEMBER_VIEW, conn.call("member.list", **ws)),
            (Permission.MEMBER_INVITE, conn.call("invitation.create", email=f"new-{role}@example.com", **ws)),
            (Permission.MEMBER_INVITE, conn.call("invitation.list", **ws)),
            (Permission.MEMBER_UPDATE_ROLE, conn.call("member.set_role", member_id=victim.member_id,
                                                      role="operator", **ws)),
            (Permission.API_KEY_MANAGE, conn.call("apikey.create", name="k", member_id=victim.member_id, **ws)),
            # No "for yourself" loophole: minting any key is api_key.manage.
            (Permission.API_KEY_MANAGE, conn.call("apikey.create", name="mine", **ws)),
            (Permission.API_KEY_MANAGE, conn.call("apikey.list", **ws)),
            (Permission.RESOURCE_MANAGE, conn.call("agent.create", handle=f"pub-{role}", display_name="P",
                                                   visibility="public", **ws)),
            (Permission.MESSAGE_WRITE, conn.call("agent.create", handle=f"mine-{role}", display_name="Mine", **ws)),
            (Permission.MESSAGE_WRITE, conn.call("channel.create", slug=f"by-{role}", display_name="C", **ws)),
            (Permission.MESSAGE_WRITE, conn.call("dm.open", member_id=alpha.owner.member_id, **ws)),
            (Permission.MESSAGE_READ, conn.call("channel.list", **ws)),
            (Permission.MESSAGE_READ, conn.call("inbox.list", **ws)),
            (Permission.OWNER_TRANSFER, conn.call("owner.transfer", member_id=victim.member_id, **ws)),
            (Permission.MEMBER_REMOVE, conn.call("member.remove", member_id=victim.member_id, **ws)),
            (Permission.WORKSPACE_DELETE, conn.call("workspace.suspend", **ws)),
        ]
        for permission, call in probes:
            if permission in allowed:
                await call
            else:
                await expect_error("forbidden", call)


async def test_an_admin_cannot_mint_or_revoke_an_owners_keys(app: App, tenants, member_password_hash):
    """A key acts with its member's permissions: an admin minting one for the
    owner would hold owner.transfer and workspace.delete."""
    alpha, _ = tenants
    admin = await add_person(app.db, alpha.workspace_id, "admin@example.com", "admin", member_password_hash)
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        owners_key = await owner.call("apikey.create", name="owner's", **ws)
    async with await signed_in(app, admin) as conn:
        await expect_error("forbidden", conn.call("apikey.create", name="escalate", member_id=alpha.owner.member_id,
                                                  scopes=["admin"], **ws))
        await expect_error("forbidden", conn.call("apikey.revoke", api_key_id=owners_key["id"], **ws))
        assert await conn.call("apikey.create", name="own", **ws)
    assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM api_keys")) == 2


async def test_a_viewer_reads_and_keeps_its_own_read_state_but_writes_nothing(app: App, tenants,
                                                                              member_password_hash):
    alpha, _ = tenants
    viewer = await add_person(app.db, alpha.workspace_id, "viewer@example.com", "viewer", member_password_hash)
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await owner.call("channel.create", slug="news", display_name="News", member_ids=[viewer.member_id],
                                   **ws)
        lobby = await owner.call("channel.create", slug="lobby", display_name="Lobby", **ws)
        post = await owner.call("message.send", scope_id=channel["id"], content="hello viewers", **ws)
        key = await owner.call("apikey.create", name="viewer's", member_id=viewer.member_id, **ws)

    async def rows() -> int:
        return await app.db.run(lambda c: c.fetchval(
            "SELECT (SELECT count(*) FROM scope_messages) + (SELECT count(*) FROM scopes) "
            "+ (SELECT count(*) FROM scope_message_reactions) + (SELECT count(*) FROM members)"))

    before = await rows()
    scope, message = {"scope_id": channel["id"], **ws}, {"message_id": post["id"], **ws}
    async with await signed_in(app, viewer) as conn:
        # Reads, and the member's own read state and participation.
        assert [m["content"] for m in (await conn.call("message.history", **scope))["messages"]] == ["hello viewers"]
        await conn.call("message.get", **message)
        await conn.call("scope.members", **scope)
        await conn.call("read.mark", seq=1, **scope)
        await conn.call("read.mark_unread", **scope)
        await conn.call("notification.set", state="quiet", **scope)
        await conn.call("conversation.action", action="pin", **scope)
        await conn.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        await conn.call("presence", state="online", **ws)
        await conn.call("scope.join", scope_id=lobby["id"], **ws)  # joining a public channel lets it read
        await conn.call("scope.leave", scope_id=lobby["id"], **ws)
        # Nothing that puts content or structure in front of others.
        for op, fields in (("message.send", dict(scope, content="hi")),
                           ("thread.reply", dict(scope, root_message_id=post["id"], content="hi")),
                           ("message.forward", dict(scope, source_message_ids=[post["id"]])),
                           ("reaction.add", dict(message, key="👍")),
                           ("message.edit", dict(message, content="x", expected_revision=1)),
                           ("message.withdraw", message),
                           ("typing", scope),
                           ("scope.invite", dict(scope, member_ids=[alpha.owner.member_id])),
                           ("scope.archive", scope),
                           ("channel.create", dict(ws, slug="mine", display_name="Mine")),
                           ("dm.open", dict(ws, member_id=alpha.owner.member_id)),
                           ("agent.create", dict(ws, handle="my-bot", display_name="Bot"))):
            error = await expect_error("forbidden", conn.call(op, **fields))
            assert "permission" in error.message, (op, error.message)
    async with connect(app.url) as keyed:  # a viewer's key cannot write either, whatever its scopes
        await keyed.auth(api_key=key["key"])
        await expect_error("forbidden", keyed.call("message.send", content="hi", **scope))
    assert await rows() == before


async def test_admin_cannot_touch_the_owner_and_nobody_becomes_owner_by_role(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    admin = await add_person(app.db, alpha.workspace_id, "admin@example.com", "admin", member_password_hash)
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, admin) as conn:
        await expect_error("forbidden", conn.call("member.set_role", member_id=alpha.owner.member_id,
                                                  role="viewer", **ws))
        await expect_error("forbidden", conn.call("member.remove", member_id=alpha.owner.member_id, **ws))
        await expect_error("forbidden", conn.call("member.set_role", member_id=admin.member_id, role="owner", **ws))
    async with await signed_in(app, alpha.owner) as conn:
        # The only owner cannot step down or leave.
        error = await expect_error("conflict", conn.call("member.set_role", member_id=alpha.owner.member_id,
                                                         role="admin", **ws))
        assert error.details["reason"] == "last_owner"
        await expect_error("conflict", conn.call("member.remove", member_id=alpha.owner.member_id, **ws))
        # Transfer makes the admin owner and the old owner admin.
        await conn.call("owner.transfer", member_id=admin.member_id, **ws)
        roles = {m["id"]: m["role"] for m in (await conn.call("member.list", **ws))["members"]}
        assert roles[admin.member_id] == "owner" and roles[alpha.owner.member_id] == "admin"


async def test_last_owner_survives_concurrent_demotions(app: App, tenants, member_password_hash):
    """Four owners each demote the next one at the same moment (a ring). Without
    the workspace lock every count check sees four owners and all succeed."""
    alpha, _ = tenants
    owners = [alpha.owner] + [
        await add_person(app.db, alpha.workspace_id, f"owner{i}@example.com", "owner", member_password_hash)
        for i in range(3)
    ]
    contexts = []
    for owner in owners:
        principal = (await app.server.auth.login(owner.email, owner.password)).principal
        workspace = await app.server.auth.workspace_context(principal, alpha.workspace_id, "multi")
        contexts.append(RequestContext("t", principal=principal, workspace=workspace))
    outcomes: list[str] = []
    go = trio.Event()

    async def demote(ctx: RequestContext, target: Person) -> None:
        await go.wait()
        try:
            await ops.set_member_role(app.db, ctx, target.member_id, "admin")
            outcomes.append("ok")
        except Conflict as exc:
            outcomes.append(exc.reason)
        except ProtocolError as exc:  # the actor itself was demoted first
            outcomes.append(exc.code.value)

    async with trio.open_nursery() as nursery:
        for i, ctx in enumerate(contexts):
            nursery.start_soon(demote, ctx, owners[(i + 1) % len(owners)])
        go.set()
    remaining = await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM workspace_memberships WHERE workspace_id = $1 AND role = 'owner' AND status = 'active'",
        alpha.workspace_id))
    assert remaining >= 1
    assert outcomes.count("ok") == len(owners) - remaining
    assert set(outcomes) <= {"ok", "last_owner", "forbidden"}


async def test_interleaved_owner_demotions_serialize_on_the_workspace_lock(app: App, tenants,
                                                                         member_password_hash):
    """Deterministic interleaving: A demotes owner 2 and holds its transaction
    open until B (demoting owner 1) is either blocked on the lock or finished.
    With the lock B waits, then sees one owner left and refuses."""
    import asyncio

    alpha, _ = tenants
    second = await add_person(app.db, alpha.workspace_id, "second-owner@example.com", "owner", member_password_hash)
    shared: dict = {}

    async def a(conn):
        shared["b_done"] = asyncio.Event()
        target = await tenancy.lock_membership_target(conn, alpha.workspace_id, second.member_id)
        await tenancy.set_role(conn, alpha.workspace_id, target, "admin")
        shared["a_ready"].set()
        for _ in range(3000):  # bounded (30 s): until B waits on a lock or has finished
            # Activity stats are snapshotted per transaction: drop the snapshot each poll.
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            waiting = await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                          "AND datname = current_database()")
            if waiting or shared["b_done"].is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("B neither blocked nor finished")

    async def b(conn):
        await shared["a_ready"].wait()
        try:
            target = await tenancy.lock_membership_target(conn, alpha.workspace_id, alpha.owner.member_id)
            await tenancy.set_role(conn, alpha.workspace_id, target, "admin")
            return "ok"
        except Conflict as exc:
            return exc.reason
        finally:
            shared["b_done"].set()

    async def make_event():
        shared["a_ready"] = asyncio.Event()

    await app.db._call_on_loop(make_event)
    results = {}

    async def run(name, fn):
        results[name] = await app.db.transaction(fn)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a", a)
        nursery.start_soon(run, "b", b)
    assert results["b"] == "last_owner"
    remaining = await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM workspace_memberships WHERE workspace_id = $1 AND role = 'owner' AND status = 'active'",
        alpha.workspace_id))
    assert remaining == 1


# --- invitations ---------------------------------------------------------------------------------

async def test_concurrent_acceptance_yields_one_membership(app: App, tenants):
    alpha, _ = tenants
    async with await signed_in(app, alpha.owner) as owner:
        invitation = await owner.call("invitation.create", workspace_id=alpha.workspace_id,
                                      email="racer@example.com", role="developer")
    results: list[object] = []

    async def accept() -> None:
        async with connect(app.url) as conn:
            try:
                results.append(await conn.call("invitation.accept", token=invitation["token"],
                                               password="racer-password"))
            except ClientError as exc:
                results.append(exc.code)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(accept)
    successes = [r for r in results if isinstance(r, dict)]
    assert len(successes) == 1 and sorted(r for r in results if isinstance(r, str)) == ["conflict"] * 7
    counts = await app.db.run(lambda c: c.fetchrow(
        "SELECT (SELECT count(*) FROM accounts WHERE email_normalized = 'racer@example.com') AS accounts, "
        "(SELECT count(*) FROM workspace_memberships m JOIN accounts a ON a.id = m.account_id "
        " WHERE a.email_normalized = 'racer@example.com') AS memberships"))
    assert (counts["accounts"], counts["memberships"]) == (1, 1)


async def test_invitation_rules(app: App, tenants, member_password_hash):
    alpha, beta = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        # Never owner: the protocol refuses the role outright.
        await expect_error("bad_frame", owner.call("invitation.create", email="x@example.com", role="owner", **ws))
        first = await owner.call("invitation.create", email="Carol@Example.com", role="viewer", **ws)
        resent = await owner.call("invitation.create", email="carol@example.com", role="operator", **ws)
        assert first["token"] != resent["token"] and resent["email"] == "carol@example.com"
        statuses = {i["id"]: i["status"] for i in (await owner.call("invitation.list", **ws))["invitations"]}
        assert statuses == {first["id"]: "revoked", resent["id"]: "pending"}
        revoked = await owner.call("invitation.create", email="dave@example.com", **ws)
        await owner.call("invitation.revoke", invitation_id=revoked["id"], **ws)
        await expect_error("conflict", owner.call("invitation.revoke", invitation_id=revoked["id"], **ws))
    async with connect(app.url) as conn:
        error = await expect_error("conflict", conn.call("invitation.accept", token=first["token"], password="pw123456"))
        assert error.details["reason"] == "invitation_revoked"
        await expect_error("conflict", conn.call("invitation.accept", token=revoked["token"], password="pw123456"))
        await expect_error("not_found", conn.call("invitation.accept", token="swi_" + "A" * 43, password="pw123456"))
        await expect_error("invalid", conn.call("invitation.accept", token=resent["token"], password="short"))
        accepted = await conn.call("invitation.accept", token=resent["token"], password="carol-password")
        assert [w["role"] for w in accepted["workspaces"]] == ["operator"]
        # The connection is now signed in as Carol.
        assert len((await conn.call("member.list", **ws))["members"]) == 2
    # An existing account accepts a second workspace's invitation from its own session.
    async with await signed_in(app, beta.owner) as owner_b:
        to_carol = await owner_b.call("invitation.create", workspace_id=beta.workspace_id, email="carol@example.com")
        to_other = await owner_b.call("invitation.create", workspace_id=beta.workspace_id, email="zed@example.com")
    carol = Person("carol@example.com", "carol-password", accepted["account_id"], "")
    async with await signed_in(app, carol) as conn:
        await expect_error("forbidden", conn.call("invitation.accept", token=to_other["token"]))
        result = await conn.call("invitation.accept", token=to_carol["token"])
        assert {w["id"] for w in result["workspaces"]} == {alpha.workspace_id, beta.workspace_id}
    # An expired invitation cannot be used.
    await app.db.run(lambda c: c.execute(
        "UPDATE workspace_invitations SET expires_at = now() - interval '1 second' WHERE id = $1", to_other["id"]))
    async with connect(app.url) as conn:
        error = await expect_error("conflict", conn.call("invitation.accept", token=to_other["token"],
                                                         password="zed-password"))
        assert error.details["reason"] == "invitation_expired"


# --- workspace selection and cross-workspace probes -------------------------------------------------

async def test_workspace_selection_semantics(app: App, tenants):
    alpha, beta = tenants
    async with await signed_in(app, alpha.owner) as conn:
        # Multi-workspace edition: no default workspace is ever picked.
        await expect_error("workspace_required", conn.call("member.list"))
        await expect_error("not_found", conn.call("member.list", workspace_id=beta.workspace_id))
        await expect_error("not_found", conn.call("member.list", workspace_id="wsp_zzzzzzzzzzzzzz"))
        await expect_error("not_found", conn.call("member.list", workspace_id="not-an-id"))
        created = await conn.call("workspace.create", name="Gamma", slug="gamma")
        assert created["role"] == "owner"
        assert {w["slug"] for w in (await conn.call("workspace.list"))["workspaces"]} == {"alpha", "gamma"}


async def test_every_command_probed_across_workspaces_answers_not_found(app: App, tenants, member_password_hash):
    alpha, beta = tenants
    b_member = await add_person(app.db, beta.workspace_id, "b-member@example.com", "viewer", member_password_hash)
    async with await signed_in(app, beta.owner) as owner_b:
        b_invitation = await owner_b.call("invitation.create", workspace_id=beta.workspace_id, email="q@example.com")
        b_key = await owner_b.call("apikey.create", workspace_id=beta.workspace_id, name="b")
    async with await signed_in(app, alpha.owner) as conn:
        a = {"workspace_id": alpha.workspace_id}
        b = {"workspace_id": beta.workspace_id}
        probes = {
            # Beta's workspace id with any command.
            "workspace.get": [b],
            "workspace.suspend": [b],
            "member.list": [b],
            "invitation.list": [b],
            "apikey.list": [b],
            "invitation.create": [dict(b, email="p@example.com")],
            "agent.create": [dict(b, handle="spy", display_name="Spy")],
            "apikey.create": [dict(b, name="spy"), dict(a, name="spy", member_id=b_member.member_id)],
            # Alpha's workspace with Beta's resource ids.
            "member.set_role": [dict(a, member_id=b_member.member_id, role="admin"),
                                dict(b, member_id=b_member.member_id, role="admin")],
            "member.remove": [dict(a, member_id=b_member.member_id), dict(b, member_id=b_member.member_id)],
            "owner.transfer": [dict(a, member_id=b_member.member_id), dict(b, member_id=b_member.member_id)],
            "invitation.revoke": [dict(a, invitation_id=b_invitation["id"]),
                                  dict(b, invitation_id=b_invitation["id"])],
            "apikey.revoke": [dict(a, api_key_id=b_key["id"]), dict(b, api_key_id=b_key["id"])],
            # The routed delivery feed: Beta's workspace id (the member is always the caller).
            "delivery.subscribe": [b],
            "delivery.ack": [dict(b, delivery_seqs=[1])],
            "delivery.unsubscribe": [b],
            "delivery.list": [b],
            # Search and attachments: Beta's workspace id (their own cross-workspace probes with
            # Beta's resources are in test_search and test_attachments).
            "message.search": [dict(b, query="anything")],
            "attachment.upload.begin": [dict(b, scope_id="scp_00000000000000", filename="x.txt",
                                             content_type="text/plain", byte_size=1)],
            "attachment.upload.chunk": [dict(b, attachment_id="att_00000000000000", offset=0, data="eA==")],
            "attachment.upload.finish": [dict(b, attachment_id="att_00000000000000")],
            "attachment.upload.abort": [dict(b, attachment_id="att_00000000000000")],
            "attachment.get": [dict(b, attachment_id="att_00000000000000")],
            "attachment.read": [dict(b, attachment_id="att_00000000000000")],
        }
        tenancy_ops = {cls.__struct_config__.tag for cls in frames.CLIENT_FRAMES
                       if issubclass(cls, frames.WorkspaceRequest) and cls not in messaging.HANDLERS
                       and cls not in collaboration.HANDLERS and cls not in private_agents.HANDLERS
                       and cls not in service_accounts.HANDLERS and cls not in strands.HANDLERS
                       and cls not in (frames.Subscribe, frames.Unsubscribe, frames.Typing, frames.Presence)}
        assert tenancy_ops == set(probes), ("every tenancy command must be probed (messaging: test_messaging; "
                                            "private agents: test_private_visibility; service accounts: "
                                            "test_service_account_governance; strands: test_strand_surfaces)")
        for op, variants in probes.items():
            for fields in variants:
                await expect_error("not_found", conn.call(op, **fields))
    # An API key of Alpha cannot select Beta either.
    async with await signed_in(app, alpha.owner) as conn:
        a_key = await conn.call("apikey.create", workspace_id=alpha.workspace_id, name="a", scopes=["read", "admin"])
    async with connect(app.url) as conn:
        await conn.auth(api_key=a_key["key"])
        await expect_error("not_found", conn.call("member.list", workspace_id=beta.workspace_id))
        assert len((await conn.call("member.list"))["members"]) >= 1  # its own workspace needs no selector
    # Nothing in Beta changed.
    rows = await app.db.run(lambda c: c.fetch(
        "SELECT m.role, m.status FROM workspace_memberships m WHERE m.workspace_id = $1 ORDER BY m.id",
        beta.workspace_id))
    assert [(r["role"], r["status"]) for r in rows] == [("owner", "active"), ("viewer", "active")]
    assert await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM workspace_invitations WHERE workspace_id = $1 AND status = 'pending'",
        beta.workspace_id)) == 1


async def test_suspended_workspace_and_removed_member_are_forbidden(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    viewer = await add_person(app.db, alpha.workspace_id, "v@example.com", "viewer", member_password_hash)
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, viewer) as conn:
        await conn.call("member.list", **ws)
        async with await signed_in(app, alpha.owner) as owner:
            await owner.call("member.remove", member_id=viewer.member_id, **ws)
        with trio.fail_after(10):  # the live session ends with the membership
            assert await conn.wait_closed() == frames.CLOSE_REVOKED
    async with await signed_in(app, viewer) as conn:  # the account lives on, without the workspace
        await expect_error("forbidden", conn.call("member.list", **ws))
    async with await signed_in(app, alpha.owner) as owner:
        await owner.call("workspace.suspend", **ws)
        with trio.fail_after(10):
            assert await owner.wait_closed() == frames.CLOSE_REVOKED
    async with await signed_in(app, alpha.owner) as owner:
        await expect_error("forbidden", owner.call("member.list", **ws))


# --- API keys, sessions and revocation ------------------------------------------------------------------

async def test_agent_api_key_acts_as_the_agent_within_its_scopes(app: App, tenants):
    alpha, _ = tenants
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", workspace_id=alpha.workspace_id, handle="helper",
                                 display_name="Helper")
        key = await owner.call("apikey.create", workspace_id=alpha.workspace_id, name="daemon",
                               member_id=agent["id"], scopes=["read"])
    async with connect(app.url) as daemon:
        me = await daemon.auth(api_key=key["key"])
        assert (me["principal"], me["member_id"], me["workspace_id"]) == ("api_key", agent["id"], alpha.workspace_id)
        await daemon.call("member.list")
        await expect_error("forbidden", daemon.call("invitation.create", email="x@example.com"))
        await expect_error("forbidden", daemon.call("apikey.create", name="more", scopes=["read", "write"]))
        await expect_error("forbidden", daemon.call("workspace.create", name="N", slug="n"))


async def test_revoked_key_and_token_end_live_connections_promptly(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        key = await owner.call("apikey.create", name="k", **ws)
        async with connect(app.url) as keyed, connect(app.url) as other_session:
            await keyed.auth(api_key=key["key"])
            session = await other_session.login(alpha.owner.email, alpha.owner.password)
            started = time.monotonic()
            await owner.call("apikey.revoke", api_key_id=key["id"], **ws)
            with trio.fail_after(5):
                assert await keyed.wait_closed() == frames.CLOSE_REVOKED
            key_close_seconds = time.monotonic() - started
            async with connect(app.url) as again:
                await expect_error("unauthenticated", again.auth(api_key=key["key"]))

            # Revoking sessions ends every session connection of the account, this one after its reply.
            started = time.monotonic()
            await owner.call("account.revoke_sessions")
            with trio.fail_after(5):
                assert await other_session.wait_closed() == frames.CLOSE_REVOKED
            token_close_seconds = time.monotonic() - started
    async with connect(app.url) as again:
        await expect_error("unauthenticated", again.auth(token=session["token"]))
        fresh = await again.login(alpha.owner.email, alpha.owner.password)
        assert fresh["token"] != session["token"]
    # Revocation travels by NOTIFY: well under the periodic sweep.
    assert key_close_seconds < 2 and token_close_seconds < 2


async def test_unauthenticated_connection_gets_nothing_and_times_out(app: App, tenants):
    alpha, _ = tenants
    async with connect(app.url) as conn:
        assert (await conn.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
        for op, fields in (("member.list", {"workspace_id": alpha.workspace_id}), ("workspace.list", {})):
            await expect_error("unauthenticated", conn.call(op, **fields))
        await expect_error("unauthenticated", conn.login(alpha.owner.email, "wrong-password"))
        await expect_error("unauthenticated", conn.login("nobody@example.com", "whatever"))
        await expect_error("unauthenticated", conn.auth(token="abc.def.ghi"))
        await expect_error("unauthenticated", conn.auth(api_key="swk_nope"))
        with trio.fail_after(10):
            assert await conn.wait_closed() == frames.CLOSE_UNAUTHENTICATED


async def test_expired_session_token_is_refused(app: App, tenants):
    alpha, _ = tenants
    token, _ = app.server.auth.signer.issue(alpha.owner.account_id, 1, ttl_seconds=-1)
    async with connect(app.url) as conn:
        await expect_error("unauthenticated", conn.auth(token=token))
        forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        await expect_error("unauthenticated", conn.auth(token=forged))


# --- execution fence --------------------------------------------------------------------------------------

async def test_stale_generation_writers_racing_a_fence_never_commit(app: App, tenants):
    alpha, _ = tenants
    ctx = system_context(await system_workspace_context(app.db, alpha.workspace_id))
    results: dict[str, str] = {}

    async def writer(n: int) -> None:
        email = f"w{n}@example.com"
        try:
            await ops.create_invitation(app.db, ctx, email=email, role="viewer", expires_in_seconds=3600)
            results[email] = "committed"
        except WriteFenced:
            results[email] = "fenced"

    async with trio.open_nursery() as nursery:
        for n in range(20):
            nursery.start_soon(writer, n)
        generation = await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=False,
                                              new_generation=True)
        for n in range(20, 40):
            nursery.start_soon(writer, n)
    assert generation == ctx.workspace.execution_generation + 1
    stored = {r["email"] for r in await app.db.run(tenancy.list_invitations, alpha.workspace_id)}
    assert stored == {email for email, outcome in results.items() if outcome == "committed"}
    # Everything started after the fence carried the old generation and was refused.
    assert all(results[f"w{n}@example.com"] == "fenced" for n in range(20, 40))

    # A write fence refuses even the current generation; lifting it restores writes.
    fresh = system_context(await system_workspace_context(app.db, alpha.workspace_id))
    await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=True, new_generation=False)
    with pytest.raises(WriteFenced):
        await ops.create_invitation(app.db, fresh, email="blocked@example.com", role="viewer", expires_in_seconds=60)
    async with await signed_in(app, alpha.owner) as owner:
        await expect_error("fenced", owner.call("invitation.create", workspace_id=alpha.workspace_id,
                                                email="blocked@example.com"))
    await app.db.transaction(tenancy.fence_workspace, alpha.workspace_id, write_fenced=False, new_generation=False)
    await ops.create_invitation(app.db, fresh, email="allowed@example.com", role="viewer", expires_in_seconds=60)


# --- secrets at rest ------------------------------------------------------------------------------------------

async def test_database_holds_no_plaintext_secret(app: App, tenants):
    alpha, _ = tenants
    secrets: list[str] = [MEMBER_PASSWORD]
    async with await signed_in(app, alpha.owner) as owner:
        ws = {"workspace_id": alpha.workspace_id}
        secrets.append((await owner.login(alpha.owner.email, alpha.owner.password))["token"])
        secrets.append((await owner.call("apikey.create", name="k", **ws))["key"])
        invitation = await owner.call("invitation.create", email="s@example.com", **ws)
        secrets.append(invitation["token"])
    async with connect(app.url) as conn:
        accepted = await conn.call("invitation.accept", token=invitation["token"], password="secret-password-9")
        secrets += ["secret-password-9", accepted["token"]]
    columns = await app.db.run(lambda c: c.fetch(
        "SELECT table_name, column_name, data_type FROM information_schema.columns "
        "WHERE table_schema = 'public' AND data_type IN ('text', 'bytea', 'jsonb', 'ARRAY', 'character varying')"))
    assert len(columns) > 20
    for secret in secrets:
        for core in {secret, secret[4:], secret[8:40]}:  # whole, without prefix, any long fragment
            for column in columns:
                table, name = column["table_name"], column["column_name"]
                condition = (f"position($1::bytea in {name}) > 0" if column["data_type"] == "bytea"
                             else f"position(convert_from($1::bytea, 'UTF8') in {name}::text) > 0")
                found = await app.db.run(lambda c: c.fetchval(
                    f"SELECT count(*) FROM {table} WHERE {condition}", core.encode()))
                assert found == 0, (table, name)
