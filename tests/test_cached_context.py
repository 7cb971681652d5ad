"""`message.send` is served from the connection's cached context
(server/auth.CachedContext) without re-reading the credential first; its batch
transaction re-checks what the context was built from.  The changes here are
written straight into the database with no NOTIFY — as another node's change
whose notification has not arrived yet — so only that in-transaction check can
refuse: the next send answers exactly as an uncached one would, and writes
nothing when refused.  The last test covers the NOTIFY side."""

from __future__ import annotations

import time

import pytest
import trio

from client import connect
from domain.credentials import CredentialProof
from storage import tenancy
from tests.conftest import App
from tests.test_messaging import open_channel, team  # noqa: F401 - a fixture
from tests.test_tenancy import expect_error, signed_in

# change → (SQL naming {workspace}, {member}, {account}, {key}; what the next send answers)
SILENT_CHANGES = {
    "key revoked": ("UPDATE api_keys SET status = 'revoked', revoked_at = now() WHERE id = '{key}'",
                    "unauthenticated"),
    "key expired": ("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE id = '{key}'",
                    "unauthenticated"),
    "session revoked": ("UPDATE accounts SET token_version = token_version + 1 WHERE id = '{account}'",
                        "unauthenticated"),
    "account disabled": ("UPDATE accounts SET status = 'disabled' WHERE id = '{account}'", "unauthenticated"),
    "member disabled": ("UPDATE members SET status = 'disabled' WHERE workspace_id = '{workspace}' "
                        "AND id = '{member}'", "forbidden"),
    "membership disabled": ("UPDATE workspace_memberships SET status = 'disabled' "
                            "WHERE workspace_id = '{workspace}' AND account_id = '{account}'", "forbidden"),
    "role without message.write": ("UPDATE workspace_memberships SET role = 'viewer' "
                                   "WHERE workspace_id = '{workspace}' AND account_id = '{account}'", "forbidden"),
    "workspace suspended": ("UPDATE workspaces SET status = 'suspended' WHERE id = '{workspace}'", "forbidden"),
    # A stale context's generation would be fenced; afresh, the send goes through.
    "generation advanced": ("UPDATE workspace_execution_states SET active_generation = active_generation + 1 "
                            "WHERE workspace_id = '{workspace}'", None),
}
# A key's own changes apply to key connections, an account's to its sessions; the rest to both.
KEY_ONLY = {"key revoked", "key expired"}
SESSION_ONLY = {"session revoked", "account disabled"}
CASES = [(credential, change) for change in SILENT_CHANGES for credential in ("api_key", "session")
         if change not in (SESSION_ONLY if credential == "api_key" else KEY_ONLY)]


async def _message_count(app: App, scope_id: str) -> int:
    return await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM scope_messages WHERE scope_id = $1",
                                                 scope_id))


@pytest.mark.parametrize(("credential", "change"), CASES)
async def test_a_silent_change_refuses_the_next_cached_send(app: App, team, credential: str, change: str):
    alpha, _, bob, _ = team
    sql, expected = SILENT_CHANGES[change]
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "team", [bob.member_id], visibility="private")
        key = await owner.call("apikey.create", name="bob", member_id=bob.member_id, **ws)
    async with connect(app.url) as sender:
        if credential == "api_key":
            await sender.auth(api_key=key["key"])
        else:
            await sender.login(bob.email, bob.password)
        # The first fills the cache; the second is served from it, its proof checked in its
        # batch's transaction; the third's in the one statement that writes it.
        for i in range(3):
            await sender.call("message.send", scope_id=channel["id"], content=f"warm {i}", **ws)
        before = await _message_count(app, channel["id"])
        statement = sql.format(workspace=alpha.workspace_id, member=bob.member_id, account=bob.account_id,
                               key=key["id"])
        await app.db.run(lambda c: c.execute(statement))
        send = sender.call("message.send", scope_id=channel["id"], content="after the change", **ws)
        if expected is None:
            await send
            assert await _message_count(app, channel["id"]) == before + 1
        else:
            await expect_error(expected, send)
            assert await _message_count(app, channel["id"]) == before
        # Every other command re-checks on its own, before it is served.
        read = sender.call("scope.get", scope_id=channel["id"], **ws)
        if expected is None or change == "role without message.write":  # a viewer still reads
            await read
        else:
            await expect_error(expected, read)


async def test_a_cached_send_after_leaving_the_scope_answers_as_an_uncached_one(app: App, team):
    """Removal from a scope goes through its actor, not through any credential
    change: the cached scope row is stale, the actor refuses, and the request is
    answered afresh — not_found for a private channel, as without a cache."""
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        private = await open_channel(owner, alpha.workspace_id, "private", [bob.member_id], visibility="private")
        public = await open_channel(owner, alpha.workspace_id, "public", [bob.member_id])
        for channel in (private, public):
            await b.call("message.send", scope_id=channel["id"], content="warm", **ws)
            await owner.call("scope.remove", scope_id=channel["id"], member_id=bob.member_id, **ws)
        before = await _message_count(app, private["id"])
        await expect_error("not_found", b.call("message.send", scope_id=private["id"], content="gone", **ws))
        assert await _message_count(app, private["id"]) == before
        error = await expect_error("forbidden", b.call("message.send", scope_id=public["id"], content="gone", **ws))
        assert error.message == "join the channel first"
        # Back in: served afresh, then from the cache again.
        await owner.call("scope.invite", scope_id=private["id"], member_ids=[bob.member_id], **ws)
        for i in range(2):
            await b.call("message.send", scope_id=private["id"], content=f"back {i}", **ws)
        assert await _message_count(app, private["id"]) == before + 2


@pytest.mark.parametrize("credential", ["api_key", "session"])
async def test_a_credential_that_expires_is_not_served_from_the_cache(app: App, team, credential: str):
    """Expiry changes no row, so the write's re-check cannot see it: the cache
    checks it on every use, as an uncached request does."""
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "team", [bob.member_id])
        key = await owner.call("apikey.create", name="bob", member_id=bob.member_id, expires_in_seconds=3600, **ws)
    async with connect(app.url) as sender:
        if credential == "api_key":
            await sender.auth(api_key=key["key"])
        else:
            await sender.login(bob.email, bob.password)
        for i in range(2):
            await sender.call("message.send", scope_id=channel["id"], content=f"warm {i}", **ws)
        before = await _message_count(app, channel["id"])
        lifetime = 3600 if credential == "api_key" else app.server.config.session_ttl_seconds
        app.server.auth.wall_clock = lambda: time.time() + lifetime + 1
        await expect_error("unauthenticated",
                           sender.call("message.send", scope_id=channel["id"], content="too late", **ws))
        assert await _message_count(app, channel["id"]) == before


async def test_any_credential_notification_drops_every_cached_context(app: App, team):
    """The NOTIFY that revokes one key also stops every other connection's
    cached context from being served (the write's re-check is the guarantee;
    this keeps the server from serving what it knows may be stale)."""
    alpha, _, bob, _ = team
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "team", [bob.member_id])
        kept = await owner.call("apikey.create", name="kept", member_id=bob.member_id, **ws)
        revoked = await owner.call("apikey.create", name="revoked", member_id=bob.member_id, **ws)
        async with connect(app.url) as sender, connect(app.url) as doomed:
            await sender.auth(api_key=kept["key"])
            await doomed.auth(api_key=revoked["key"])
            await sender.call("message.send", scope_id=channel["id"], content="fills the cache", **ws)
            [connection] = app.server.connections.of_api_key(kept["id"])
            auth = app.server.auth

            def served() -> bool:
                return auth.cached_context(connection.cached_context, None, None, channel["id"]) is not None

            assert served()
            await owner.call("apikey.revoke", api_key_id=revoked["id"], **ws)
            with trio.fail_after(10):
                await doomed.wait_closed()  # the watcher has handled the notification
            assert not served()
            await sender.call("message.send", scope_id=channel["id"], content="afresh, then cached again", **ws)
            assert served()


async def test_proofs_of_both_kinds_are_rechecked_each_by_its_own_rows(app: App, team):
    """A batch's proofs of one kind are re-read by its fences' statement; a batch holding both
    kinds (agents' keys and people's sessions) takes two statements of their own.  Either way
    exactly the proofs whose rows changed are stale."""
    alpha, _, bob, _ = team
    async with await signed_in(app, alpha.owner) as owner:
        key = await owner.call("apikey.create", name="bob", member_id=bob.member_id, workspace_id=alpha.workspace_id)

    async def proofs() -> tuple[CredentialProof, CredentialProof]:
        key_row = await app.db.run(tenancy.api_key_context_by_id, key["id"])
        session = await app.db.run(tenancy.account_session_state, bob.account_id)
        context = await app.db.run(tenancy.account_workspace_context, bob.account_id, alpha.workspace_id)
        return tenancy.key_proof(key_row), tenancy.session_proof(session, context)

    key_proof, session_proof = await proofs()
    both = {key_proof, session_proof}
    assert tenancy.proof_rows_query(both, 5) is None
    assert await app.db.run(tenancy.stale_proofs, both) == set()
    for one in (key_proof, session_proof):
        query, args = tenancy.proof_rows_query({one}, 1)
        assert tenancy.stale_among({one}, await app.db.run(lambda c: c.fetch(query, *args))) == set()
    await app.db.run(lambda c: c.execute("UPDATE api_keys SET status = 'revoked', revoked_at = now() WHERE id = $1",
                                         key["id"]))
    assert await app.db.run(tenancy.stale_proofs, both) == {key_proof}
    query, args = tenancy.proof_rows_query({key_proof}, 1)
    assert tenancy.stale_among({key_proof}, await app.db.run(lambda c: c.fetch(query, *args))) == {key_proof}
    await app.db.run(lambda c: c.execute("UPDATE accounts SET token_version = token_version + 1 WHERE id = $1",
                                         bob.account_id))
    assert await app.db.run(tenancy.stale_proofs, both) == both
