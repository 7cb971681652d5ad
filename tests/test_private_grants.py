"""Private grants (scope-model.md §3.5) over the WebSocket against PostgreSQL:
the window from the next global seq, revocation that is never retroactive,
owner-only management, who may grant what where, and expiry by the
maintenance pass with an injected clock."""

from __future__ import annotations

from datetime import timedelta

from server.ops import collaboration as ops
from tests.conftest import App
from tests.test_collaborators import db_now, global_tail, team  # noqa: F401  (team is a fixture)
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in


async def test_a_grant_opens_at_the_next_global_seq_and_revocation_keeps_its_window(app: App, team):
    alpha, people = team
    bob, adam = people["bob"], people["adam"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, adam) as a:
        channel = await open_channel(owner, alpha.workspace_id, "granted", [bob.member_id, adam.member_id])
        await b.call("message.send", scope_id=channel["id"], content="before the grant", **ws)
        tail = await global_tail(app, alpha.workspace_id)
        grant = await owner.call("private_grant.create", scope_id=channel["id"], grantee_member_id=bob.member_id, **ws)
        assert grant["id"].startswith("grt_")
        assert (grant["scope_id"], grant["owner_member_id"], grant["grantee_member_id"],
                grant["granted_by_member_id"], grant["effective_from_global_seq"], grant["active"]) == (
            channel["id"], alpha.owner.member_id, bob.member_id, alpha.owner.member_id, tail + 1, True)
        assert not {"expires_at_ms", "revoked_at_ms", "effective_to_global_seq"} & set(grant)
        error = await expect_error("conflict", owner.call("private_grant.create", scope_id=channel["id"],
                                                          grantee_member_id=bob.member_id, **ws))
        assert error.details["reason"] == "already_granted"
        for i in range(3):
            await b.call("message.send", scope_id=channel["id"], content=f"inside {i}", **ws)
        # Only the owner revokes: to the grantee and to an admin the grant does not exist.
        for conn in (b, a):
            await expect_error("not_found", conn.call("private_grant.revoke", grant_id=grant["id"], **ws))
            assert (await conn.call("private_grant.list", include_ended=True, **ws))["grants"] == []
        await expect_error("invalid", owner.call("private_grant.revoke", grant_id="col_zzzzzzzzzzzzzz", **ws))
        revoked = await owner.call("private_grant.revoke", grant_id=grant["id"], **ws)
        # Not retroactive: the window keeps its start and ends at the last message before the revocation.
        assert (revoked["active"], revoked["effective_from_global_seq"], revoked["effective_to_global_seq"]) == (
            False, tail + 1, tail + 3)
        assert revoked["revoked_at_ms"] >= grant["created_at_ms"]
        error = await expect_error("conflict", owner.call("private_grant.revoke", grant_id=grant["id"], **ws))
        assert error.details["reason"] == "already_ended"
        await b.call("message.send", scope_id=channel["id"], content="after", **ws)
        regrant = await owner.call("private_grant.create", scope_id=channel["id"], grantee_member_id=bob.member_id,
                                   **ws)
        assert regrant["id"] != grant["id"] and regrant["effective_from_global_seq"] == tail + 5
        assert [g["id"] for g in (await owner.call("private_grant.list", **ws))["grants"]] == [regrant["id"]]
        ended = (await owner.call("private_grant.list", scope_id=channel["id"], include_ended=True, **ws))["grants"]
        assert [(g["id"], g["effective_from_global_seq"], g.get("effective_to_global_seq")) for g in ended] == [
            (grant["id"], tail + 1, tail + 3), (regrant["id"], tail + 5, None)]
        other = await open_channel(owner, alpha.workspace_id, "other")
        assert (await owner.call("private_grant.list", scope_id=other["id"], include_ended=True, **ws))["grants"] == []
    rows = await app.db.run(lambda conn: conn.fetch(
        "SELECT revoked_by_member_id, revoked_at IS NOT NULL AS revoked FROM scope_private_grants ORDER BY id"))
    assert [tuple(r) for r in rows] == [(alpha.owner.member_id, True), (None, False)]
    # A grant creates no membership and no Scope Execution.
    counts = await app.db.run(lambda conn: conn.fetchrow(
        "SELECT (SELECT count(*) FROM scope_executions) AS executions, "
        "(SELECT count(*) FROM scope_memberships WHERE scope_id = $1) AS memberships", channel["id"]))
    assert (counts["executions"], counts["memberships"]) == (0, 3)


async def test_who_may_grant_whom_where(app: App, team):
    alpha, people = team
    bob, carol, vera = people["bob"], people["carol"], people["vera"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        agent = await owner.call("agent.create", handle="helper", display_name="Helper", **ws)
        channel = await open_channel(owner, alpha.workspace_id, "where", [bob.member_id, vera.member_id])
        secret = await open_channel(owner, alpha.workspace_id, "secret", visibility="private")
        root = await owner.call("message.send", scope_id=channel["id"], content="root", **ws)
        thread_id = (await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                      content="reply", **ws))["scope_id"]
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        grant = lambda **fields: owner.call("private_grant.create", **ws, **fields)  # noqa: E731
        # Channel, DM and thread take grants; agents and humans may be grantees; the grant needs no membership.
        for scope_id, grantee in ((dm["id"], bob.member_id), (thread_id, carol.member_id),
                                  (channel["id"], agent["id"])):
            assert (await grant(scope_id=scope_id, grantee_member_id=grantee))["active"]
        far = int((await db_now(app)).timestamp() * 1000) + 3_600_000
        expiring = await grant(scope_id=channel["id"], grantee_member_id=carol.member_id, expires_at_ms=far)
        assert expiring["expires_at_ms"] == far
        for fields, code, reason in (
                ({"scope_id": channel["id"], "grantee_member_id": alpha.owner.member_id}, "invalid",
                 "grantee_is_owner"),
                ({"scope_id": channel["id"], "grantee_member_id": bob.member_id, "expires_at_ms": 5},
                 "invalid", "expiry_in_past"),
                ({"scope_id": channel["id"], "grantee_member_id": "mem_zzzzzzzzzzzzzz"}, "not_found", None),
                ({"scope_id": channel["id"], "grantee_member_id": "bob"}, "invalid", None),
                ({"scope_id": "scp_zzzzzzzzzzzzzz", "grantee_member_id": bob.member_id}, "not_found", None)):
            error = await expect_error(code, grant(**fields))
            assert error.details.get("reason") == reason, error
        await expect_error("bad_frame", grant(scope_id=channel["id"], grantee_member_id=bob.member_id,
                                              expires_at_ms=-1))
        await expect_error("invalid", owner.call("private_grant.list", scope_id="nope", **ws))
    async with await signed_in(app, bob) as b:
        await expect_error("not_found", b.call("private_grant.create", scope_id=secret["id"],
                                               grantee_member_id=carol.member_id, **ws))
        # Bob grants for his own agents: a separate grant, listed only to him.
        mine = await b.call("private_grant.create", scope_id=channel["id"], grantee_member_id=carol.member_id, **ws)
        assert [g["id"] for g in (await b.call("private_grant.list", **ws))["grants"]] == [mine["id"]]
    async with await signed_in(app, vera) as v:
        error = await expect_error("forbidden", v.call("private_grant.create", scope_id=channel["id"],
                                                       grantee_member_id=bob.member_id, **ws))
        assert "message.write" in error.message
        assert (await v.call("private_grant.list", **ws))["grants"] == []


async def test_expiry_closes_a_grant_without_moving_its_window(app: App, team):
    alpha, people = team
    bob = people["bob"]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "expiry", [bob.member_id])
        now = await db_now(app)
        expires_ms = int((now + timedelta(minutes=5)).timestamp() * 1000)
        grant = await owner.call("private_grant.create", scope_id=channel["id"], grantee_member_id=bob.member_id,
                                 expires_at_ms=expires_ms, **ws)
        await b.call("message.send", scope_id=channel["id"], content="inside", **ws)
        tail = await global_tail(app, alpha.workspace_id)
        assert await ops.collaborator_maintenance(app.server, now) == (0, 0)
        assert (await owner.call("private_grant.list", **ws))["grants"][0]["active"]
        await ops.collaborator_maintenance(app.server, now + timedelta(hours=1))
        ended = (await owner.call("private_grant.list", include_ended=True, **ws))["grants"]
        assert [(g["id"], g["active"], g["revoked_at_ms"], g["effective_from_global_seq"],
                 g["effective_to_global_seq"]) for g in ended] == [
            (grant["id"], False, expires_ms, grant["effective_from_global_seq"], tail)]
        assert (await owner.call("private_grant.list", **ws))["grants"] == []
        again = await owner.call("private_grant.create", scope_id=channel["id"], grantee_member_id=bob.member_id,
                                 **ws)
        assert again["effective_from_global_seq"] == tail + 1
