"""Live connections end (4403) when what admitted them ends, told by NOTIFY alone:
the periodic sweep is off here (expiry_sweep_seconds = 3600), so nothing else
could close them.  And the watcher outlives a database failure."""

from __future__ import annotations

import json

import pytest
import trio

from client import connect
from protocol import frames
from server.config import ServerConfig
from storage import tenancy
from storage.bridge import Database, PoolSettings
from tests.conftest import App, add_person
from tests.db_faults import hold_table_lock, release_locks, terminate, wait_for_query
from tests.test_messaging import open_channel
from tests.test_tenancy import expect_error, signed_in


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(port=0, auth_timeout_seconds=5.0, expiry_sweep_seconds=3600.0, shutdown_grace_seconds=2.0)


async def test_a_revoked_api_key_is_closed_by_notify_alone(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, connect(app.url) as keyed:
        key = await owner.call("apikey.create", name="k", **ws)
        await keyed.auth(api_key=key["key"])
        await owner.call("apikey.revoke", api_key_id=key["id"], **ws)
        with trio.fail_after(10):
            assert await keyed.wait_closed() == frames.CLOSE_REVOKED


async def test_a_removed_members_session_is_closed_and_gets_no_more_pushes(app: App, tenants, member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "team", [bob.member_id])
        await b.call("subscribe", scopes=[{"scope_id": channel["id"]}], workspace_feed=True, **ws)
        await owner.call("message.send", scope_id=channel["id"], content="before", **ws)
        await owner.call("member.remove", member_id=bob.member_id, **ws)
        await owner.call("message.send", scope_id=channel["id"], content="after", **ws)
        with trio.fail_after(10):
            assert await b.wait_closed() == frames.CLOSE_REVOKED
        contents = [e["data"].get("content") for e in b.queued_events() if e["event"] == "message.created"]
        assert "after" not in contents
    async with await signed_in(app, bob) as again:  # the account lives on; the workspace is gone for it
        await expect_error("forbidden", again.call("subscribe", workspace_feed=True, **ws))


async def test_suspension_closes_the_sessions_in_the_workspace(app: App, tenants, member_password_hash):
    alpha, beta = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "viewer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, alpha.owner) as following, await signed_in(app, beta.owner) as elsewhere:
        await b.call("subscribe", workspace_feed=True, workspace_id=alpha.workspace_id)
        await following.call("subscribe", workspace_feed=True, workspace_id=alpha.workspace_id)
        await elsewhere.call("subscribe", workspace_feed=True, workspace_id=beta.workspace_id)
        await owner.call("workspace.suspend", workspace_id=alpha.workspace_id)
        with trio.fail_after(10):
            assert await b.wait_closed() == frames.CLOSE_REVOKED
            assert await following.wait_closed() == frames.CLOSE_REVOKED
        # Another workspace's subscriber is untouched.
        assert (await elsewhere.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
        assert elsewhere.close_code is None


async def test_the_revocation_watcher_survives_a_database_failure(app: App, tenants, database_dsn):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    blocked = "wait_event_type = 'Lock' AND query LIKE '%FROM api_keys%'"
    async with await signed_in(app, alpha.owner) as owner, connect(app.url) as keyed, \
            Database(database_dsn, PoolSettings(min_size=1, max_size=3)) as admin, trio.open_nursery() as nursery:
        key = await owner.call("apikey.create", name="k", **ws)
        await keyed.auth(api_key=key["key"])

        # The watcher's check of the key waits on a lock, then its database
        # connection dies under it: DatabaseUnavailable inside the watcher.
        await hold_table_lock(admin, nursery, "api_keys")
        await admin.run(lambda c: c.execute("SELECT pg_notify($1, $2)", tenancy.AUTH_CHANNEL,
                                            json.dumps({"kind": "api_key", "api_key_id": key["id"]})))
        with trio.fail_after(15):
            await wait_for_query(admin, blocked)  # the watcher's check waits in the database
        await terminate(admin, blocked)
        await release_locks(admin)
        # The server lives on, and revocation still works.
        assert (await owner.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
        await owner.call("apikey.revoke", api_key_id=key["id"], **ws)
        with trio.fail_after(15):
            assert await keyed.wait_closed() == frames.CLOSE_REVOKED


async def test_removal_closes_every_session_that_acted_in_the_workspace_and_only_those(app: App, tenants,
                                                                                      member_password_hash):
    """A session that made any request in the workspace is closed, subscribed or
    not; one that only acted in another workspace stays; a session that never
    named a workspace closes once its account has no active workspace left."""
    alpha, beta = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, beta.owner) as beta_owner, \
            await signed_in(app, bob) as acted, await signed_in(app, bob) as idle:
        await acted.call("member.list", workspace_id=alpha.workspace_id)  # no subscription
        # bob also joins beta: removal from alpha leaves him a workspace.
        invite = await beta_owner.call("invitation.create", workspace_id=beta.workspace_id, email=bob.email,
                                       role="developer")
        async with connect(app.url) as joining:
            await joining.login(bob.email, bob.password)
            await joining.call("invitation.accept", token=invite["token"])
        async with await signed_in(app, bob) as in_beta:
            await in_beta.call("member.list", workspace_id=beta.workspace_id)
            await owner.call("member.remove", member_id=bob.member_id, workspace_id=alpha.workspace_id)
            with trio.fail_after(10):
                assert await acted.wait_closed() == frames.CLOSE_REVOKED
            assert (await in_beta.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
            assert (await idle.call("ping"))["protocol_version"] == frames.PROTOCOL_VERSION
            # Removed from beta too: the idle session has no workspace left and closes.
            beta_bob = next(w["member_id"] for w in await app.db.run(tenancy.list_workspaces, bob.account_id)
                            if w["id"] == beta.workspace_id)
            await beta_owner.call("member.remove", member_id=beta_bob, workspace_id=beta.workspace_id)
            with trio.fail_after(10):
                assert await idle.wait_closed() == frames.CLOSE_REVOKED
                assert await in_beta.wait_closed() == frames.CLOSE_REVOKED
