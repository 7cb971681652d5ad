"""Workspace service accounts — identity, creation and approval (service-account.md
§2.1, §2.3, §2.5, §6, §8.2, §9.1) over the WebSocket against PostgreSQL: the
shared Service Actor definition with per-account rows, direct create through
provisioning to fulfilled, names unique per workspace after trim + casefold,
the approval path with its DM cards, receipt and result message, idempotent
submit, cancel, and approve racing cancel."""

from __future__ import annotations

import contextlib
import re

import trio

from client import ClientError, connect
from server.ops import service_accounts as sa_ops
from storage.errors import DatabaseUnavailable
from tests.conftest import App
from tests.db_faults import hold_table_lock, release_locks, terminate, wait_for_query
from tests.service_account_helpers import (Feed, approvals_messages, cards_for, create_ready,
                                           expect_idempotency_conflict, expect_reason, org, set_policy,
                                           unread_in_dms, wait_ready, ws_of)
from tests.test_tenancy import expect_error, signed_in

__all__ = ["org"]  # the fixture, imported for pytest

HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


# --- 1. one definition, separate identities ---------------------------------------------------------------

async def test_accounts_share_one_definition_but_own_every_identity_row(app: App, org):
    alpha, _, _ = org
    ws = ws_of(alpha)
    async with await signed_in(app, alpha.owner) as owner:
        feed = await Feed.open(owner, ws)
        first = (await create_ready(feed, "News"))["account"]["profile"]
        second = (await create_ready(feed, "Alerts"))["account"]["profile"]

    async def rows(conn):
        definitions = await conn.fetch("SELECT id, service_kind, installation_mode FROM service_definitions "
                                       "WHERE slug = 'service-account'")
        capabilities = await conn.fetch("SELECT capability, delivery_contract FROM service_capabilities "
                                        "WHERE service_definition_id = $1", definitions[0]["id"])
        accounts = await conn.fetch(
            "SELECT id, principal_id, management_kind, service_installation_id, service_member_id, author_member_id, "
            "message_scope_id FROM service_accounts WHERE workspace_id = $1 ORDER BY created_at, id",
            alpha.workspace_id)
        installations = await conn.fetch(
            "SELECT i.id, i.instance_key, d.slug FROM service_installations i "
            "JOIN service_definitions d ON d.id = i.service_definition_id WHERE i.workspace_id = $1 AND d.slug = "
            "'service-account' ORDER BY i.id", alpha.workspace_id)
        service_members = await conn.fetch(
            "SELECT id, service_installation_id, member_id FROM service_members WHERE workspace_id = $1",
            alpha.workspace_id)
        grants = await conn.fetch(
            "SELECT g.service_installation_id, c.capability, c.service_definition_id FROM service_grants g "
            "JOIN service_capabilities c ON c.id = g.service_capability_id WHERE g.workspace_id = $1 "
            "AND g.status = 'active'", alpha.workspace_id)
        bindings = await conn.fetch("SELECT service_installation_id, capability, scope_id FROM service_target_bindings "
                                    "WHERE workspace_id = $1", alpha.workspace_id)
        scopes = await conn.fetch("SELECT id, identity_key FROM scopes WHERE workspace_id = $1 "
                                  "AND type = 'service_account'", alpha.workspace_id)
        members = await conn.fetch("SELECT id, kind, display_name FROM members WHERE workspace_id = $1 "
                                   "AND kind = 'service'", alpha.workspace_id)
        return definitions, capabilities, accounts, installations, service_members, grants, bindings, scopes, members

    (definitions, capabilities, accounts, installations, service_members, grants, bindings, scopes,
     members) = await app.db.run(rows)
    # One shared definition (the platform registration) with its capability contract …
    assert [(d["service_kind"], d["installation_mode"]) for d in definitions] == [
        ("service_account", "named_multi_instance")]
    assert [(c["capability"], c["delivery_contract"]) for c in capabilities] == [
        ("message.write", "service_account_message")]
    own_installations = {a["service_installation_id"] for a in accounts}
    assert {g["service_definition_id"] for g in grants if g["service_installation_id"] in own_installations} \
        == {definitions[0]["id"]}
    # … and every per-account row separate.
    assert [a["id"] for a in accounts] == [first["service_account_id"], second["service_account_id"]]
    for account, profile in zip(accounts, (first, second)):
        assert account["principal_id"] == account["id"] == profile["principal_id"]
        assert account["management_kind"] == "workspace"
        assert account["author_member_id"] == profile["member_id"]
        assert account["message_scope_id"] == profile["scope_id"]
        assert profile["conversation_id"] == f"serviceAccount:{profile['scope_id']}"
        assert profile["target_id"] == f"service-account:{profile['service_account_id']}"
        assert (profile["actor_type"], profile["service_kind"], profile["audience"]) == (
            "service", "service_account", "all_active_humans")
        assert profile["capabilities"] == ["profile.open", "conversation.open"]
    for column in ("principal_id", "service_installation_id", "service_member_id", "author_member_id",
                   "message_scope_id"):
        assert len({a[column] for a in accounts}) == 2, column
    assert sorted(i["instance_key"] for i in installations) == sorted(a["principal_id"] for a in accounts)
    assert {i["id"] for i in installations} == {a["service_installation_id"] for a in accounts}
    by_installation = {m["service_installation_id"]: m for m in service_members}
    scope_of = {a["service_installation_id"]: a["message_scope_id"] for a in accounts}
    for account in accounts:
        installation = account["service_installation_id"]
        assert by_installation[installation]["id"] == account["service_member_id"]
        assert by_installation[installation]["member_id"] == account["author_member_id"]
        assert [g["capability"] for g in grants if g["service_installation_id"] == installation] == ["message.write"]
        assert [(b["capability"], b["scope_id"]) for b in bindings if b["service_installation_id"] == installation] \
            == [("message.write", scope_of[installation])]
    assert sorted(s["identity_key"] for s in scopes) == sorted(
        f"service_account:{alpha.workspace_id}:{a['principal_id']}" for a in accounts)
    names = {m["id"]: m["display_name"] for m in members}
    assert (names[first["member_id"]], names[second["member_id"]]) == ("News", "Alerts")


# --- 2. direct create -------------------------------------------------------------------------------------

async def test_creating_accounts_never_writes_the_shared_registrations(app: App, org):
    """Both built-in registrations exist from the migration on, and creates only read them: a
    create that inserted one on first use held that row while it went on to lock workspaces, and
    deadlocked against another workspace's create (or a platform provisioning) waiting on it."""
    alpha, _, people = org
    ws = ws_of(alpha)
    registered = await app.db.run(lambda conn: conn.fetch(
        "SELECT d.slug, d.service_kind, d.installation_mode, c.capability, c.delivery_contract "
        "FROM service_definitions d JOIN service_capabilities c ON c.service_definition_id = d.id ORDER BY d.slug"))
    assert [tuple(r) for r in registered] == [
        ("approvals", "app", "workspace_singleton", "message.write", "app_notification"),
        ("service-account", "service_account", "named_multi_instance", "message.write", "service_account_message")]
    async with trio.open_nursery() as nursery:
        # Writes to either table wait behind this lock; reads and foreign-key checks do not.
        await hold_table_lock(app.db, nursery, "service_definitions, service_capabilities", mode="SHARE")
        async with await signed_in(app, alpha.owner) as owner, await signed_in(app, people["bob"]) as b:
            with trio.fail_after(30):
                await create_ready(await Feed.open(owner, ws), "Direct")
                # Bob's request needs approval: the Approvals app is installed in the workspace on first use.
                request = await b.call("service_account.request.submit", client_request_id="ask", name="Asked",
                                       description="", **ws)
            assert request["authorization_path"] == "approval_required"
        await release_locks(app.db)


async def test_direct_create_provisions_then_fulfils_with_the_creator_as_first_manager(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob = people["bob"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        policy = await owner.call("service_account.policy.get", **ws)
        assert policy["creation_policy"] == "approval_required"  # the default
        # An owner creates directly whatever the policy.
        owner_feed = await Feed.open(owner, ws)
        submitted = await owner.call("service_account.request.submit", client_request_id="r-1", name="  Release ",
                                     description="release notes", **ws)
        assert (submitted["authorization_path"], submitted["business_state"]) == ("direct_create", "provisioning")
        account_id = submitted["created_service_account_id"]
        assert account_id.startswith("sac_") and submitted["id"].startswith("sar_")
        assert submitted["payload"] == {"name": "Release", "description": "release notes"}
        assert "approval_id" not in submitted
        ready = await wait_ready(owner_feed, account_id)
        assert ready["audience"]["effective_audience_version"] == ready["audience"]["audience_policy_version"]
        created = await owner_feed.wait("service_account.created", lambda d: d["service_account_id"] == account_id)
        assert created["name"] == "Release"
        fulfilled = await owner.call("service_account.request.get", request_id=submitted["id"], **ws)
        assert fulfilled["business_state"] == "fulfilled" and fulfilled["created_service_account_id"] == account_id
        assert fulfilled["version"] > submitted["version"]
        assert fulfilled["request_version"] == submitted["request_version"]
        detail = await owner.call("service_account.get", service_account_id=account_id, **ws)
        governance = detail["governance"]
        assert governance["audience"]["state"] == "ready"
        assert governance["created_by_member_id"] == alpha.owner.member_id
        assert governance["create_request_id"] == submitted["id"]
        assert [(m["member_id"], m["status"]) for m in governance["managers"]] == [(alpha.owner.member_id, "active")]
        # Every active human of the workspace is in the audience (owner + 5 people).
        assert governance["audience"]["member_count"] == 6

        # A developer under approval_required is not a direct creator; under direct_create they are.
        await set_policy(owner, ws, "direct_create")
        bob_feed = await Feed.open(b, ws)
        mine = await b.call("service_account.request.submit", client_request_id="r-1", name="Bob's feed", **ws)
        assert (mine["authorization_path"], mine["business_state"]) == ("direct_create", "provisioning")
        await wait_ready(bob_feed, mine["created_service_account_id"])
        managers = await b.call("service_account.managers.list",
                                service_account_id=mine["created_service_account_id"], **ws)
        assert [(m["member_id"], m["status"]) for m in managers["managers"]] == [(bob.member_id, "active")]
        assert (await b.call("service_account.request.get", request_id=mine["id"], **ws))["business_state"] \
            == "fulfilled"
        # admins_only: a developer may not even ask; an admin still creates.
        await set_policy(owner, ws, "admins_only")
        await expect_reason("forbidden", "creation_not_allowed",
                            b.call("service_account.request.submit", client_request_id="r-2", name="Nope", **ws))
    async with await signed_in(app, people["adam"]) as adam:
        by_admin = await adam.call("service_account.request.submit", client_request_id="r-1", name="Admin feed", **ws)
        assert by_admin["authorization_path"] == "direct_create"
    # A developer cannot change the policy.
    async with await signed_in(app, bob) as b:
        await expect_error("forbidden", b.call("service_account.policy.set", creation_policy="direct_create",
                                               expected_version=0, **ws))
    async with await signed_in(app, alpha.owner) as owner:
        stale = await expect_error("conflict", owner.call("service_account.policy.set",
                                                          creation_policy="direct_create", expected_version=0, **ws))
        assert stale.details.get("reason") == "version_mismatch"


async def test_only_humans_ask_for_service_accounts(app: App, org):
    alpha, _, _ = org
    ws = ws_of(alpha)
    async with await signed_in(app, alpha.owner) as owner:
        await set_policy(owner, ws, "direct_create")
        agent = await owner.call("agent.create", handle="eager-bot", display_name="Eager", **ws)
        key = (await owner.call("apikey.create", name="eager", member_id=agent["id"], **ws))["key"]
    async with connect(app.url) as bot:
        await bot.auth(api_key=key)
        await expect_reason("forbidden", "not_human", bot.call("service_account.request.submit",
                                                               client_request_id="k", name="Bot news", **ws))
    assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM service_account_create_requests")) == 0


# --- 3. names ---------------------------------------------------------------------------------------------

async def test_names_are_unique_per_workspace_after_trim_and_casefold(app: App, org):
    alpha, beta, _ = org
    ws = ws_of(alpha)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, beta.owner) as owner_b:
        feed = await Feed.open(owner, ws)
        news = await create_ready(feed, " News ")
        assert news["account"]["profile"]["display_name"] == "News"
        for clash in ("news", "NEWS", "  nEwS  ", "News "):
            await expect_reason("conflict", "name_taken", owner.call(
                "service_account.request.submit", client_request_id=f"clash-{clash!r}", name=clash, **ws))
        # casefold, not lower: "STRASSE" and "straße" are one name.
        await create_ready(feed, "Straße")
        await expect_reason("conflict", "name_taken", owner.call(
            "service_account.request.submit", client_request_id="strasse", name="STRASSE", **ws))
        # A whitespace-only name is no name at all.
        await expect_error("invalid", owner.call("service_account.request.submit", client_request_id="blank",
                                                 name="   ", **ws))
        # The same name is free in another workspace.
        feed_b = await Feed.open(owner_b, ws_of(beta))
        other = await create_ready(feed_b, "news")
        assert other["account"]["profile"]["display_name"] == "news"
        # Renaming onto a taken name conflicts too.
        alerts = await create_ready(feed, "Alerts")
        profile = alerts["account"]["profile"]
        version = alerts["account"]["version"]
        await expect_reason("conflict", "name_taken", owner.call(
            "service_account.update", service_account_id=profile["service_account_id"], expected_version=version,
            name=" NEWS", **ws))
        # Deleting frees the name.
        deleted = await owner.call("service_account.delete",
                                   service_account_id=news["account"]["profile"]["service_account_id"],
                                   expected_version=news["account"]["version"], **ws)
        assert deleted["service_account_id"] == news["account"]["profile"]["service_account_id"]
        again = await create_ready(feed, "NEWS", client_request_id="again")
        assert again["account"]["profile"]["service_account_id"] != deleted["service_account_id"]
    claims = await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM service_account_name_claims WHERE workspace_id = $1", alpha.workspace_id))
    assert claims == 3  # Straße, Alerts, NEWS


# --- 4. the approval path ---------------------------------------------------------------------------------

async def _submit_for_approval(app: App, alpha, applicant, name: str, client_request_id: str = "ask-1"):
    async with await signed_in(app, applicant) as conn:
        return await conn.call("service_account.request.submit", client_request_id=client_request_id, name=name,
                               description=f"about {name}", **ws_of(alpha))


async def test_approve_creates_once_and_converges_cards_receipt_and_result(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob, adam = people["bob"], people["adam"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, adam) as a, \
            await signed_in(app, bob) as b:
        feeds = {"owner": await Feed.open(owner, ws), "adam": await Feed.open(a, ws), "bob": await Feed.open(b, ws)}
        request = await b.call("service_account.request.submit", client_request_id="ask-1", name="Weekly",
                               description="weekly digest", **ws)
        assert (request["authorization_path"], request["business_state"]) == (
            "approval_required", "awaiting_authorization")
        assert request["requested_by_member_id"] == bob.member_id
        assert HEX_DIGEST.match(request["payload_digest"]) and request["request_version"] >= 1
        assert "created_service_account_id" not in request
        approval_id = request["approval_id"]
        approval = await owner.call("approval.get", approval_id=approval_id, **ws)
        assert (approval["subject_type"], approval["subject_ref"], approval["subject_version"],
                approval["payload_digest"], approval["state"]) == (
            "service_account_create_request", request["id"], request["request_version"], request["payload_digest"],
            "pending")
        # Requester and approvers hear of the submission.
        for who in ("bob", "owner", "adam"):
            assert (await feeds[who].wait("service_account.create_request.submitted",
                                          lambda d: d["id"] == request["id"]))["business_state"] \
                == "awaiting_authorization"
        # Each owner/admin gets a card; the applicant a pending receipt without actions.
        cards = {}
        for who, conn in (("owner", owner), ("adam", a)):
            pushed = await feeds[who].wait("message.created", lambda d: d["message_type"] == "app_interactive_card"
                                           and d["metadata"]["card"]["approval_id"] == approval_id)
            card = pushed["metadata"]["card"]
            assert (card["request_id"], card["state"]) == (request["id"], "pending") and card["actions"]
            cards[who] = pushed
            assert [m["id"] for m in cards_for(await approvals_messages(conn, ws), approval_id)] == [pushed["id"]]
        assert cards["owner"]["author_member_id"] == cards["adam"]["author_member_id"]
        approvals_app = cards["owner"]["author_member_id"]
        receipt = await feeds["bob"].wait("message.created", lambda d: d["message_type"] == "app_notification")
        assert receipt["author_member_id"] == approvals_app
        assert not (receipt.get("metadata", {}).get("card") or {}).get("actions")
        # Developers, operators and viewers are no approvers; none of them got a card.
        for name in ("bob", "dave", "carol", "vera"):
            async with await signed_in(app, people[name]) as other:
                assert not [m for m in await approvals_messages(other, ws) if m["message_type"] ==
                            "app_interactive_card"]
        unread_before = await unread_in_dms(b, ws)
        assert unread_before >= 1

        # Only an approver decides, with the approval's version.
        await expect_reason("forbidden", "not_an_approver", b.call(
            "approval.decide", approval_id=approval_id, decision="approve", expected_version=approval["version"],
            **ws))
        await expect_reason("conflict", "version_mismatch", owner.call(
            "approval.decide", approval_id=approval_id, decision="approve", expected_version=approval["version"] + 1,
            **ws))
        decided = await owner.call("approval.decide", approval_id=approval_id, decision="approve",
                                   expected_version=approval["version"], reason="looks good",
                                   card_revision=cards["owner"]["metadata"]["card"]["card_revision"],
                                   client_action_id="act-1", **ws)
        assert decided["approval"]["state"] == "approved"
        assert decided["approval"]["decided_by_member_id"] == alpha.owner.member_id
        assert decided["approval"]["version"] > approval["version"]
        consumed = decided["request"]
        account_id = consumed["created_service_account_id"]
        assert account_id.startswith("sac_") and consumed["business_state"] in ("provisioning", "fulfilled")
        # The snapshot did not move; the request's own version did.
        assert (consumed["request_version"], consumed["payload_digest"]) == (
            request["request_version"], request["payload_digest"])
        assert consumed["version"] > request["version"]
        await expect_reason("conflict", "approval_closed", a.call(
            "approval.decide", approval_id=approval_id, decision="reject",
            expected_version=decided["approval"]["version"], **ws))
        await expect_reason("conflict", "approval_closed", owner.call(
            "approval.decide", approval_id=approval_id, decision="approve",
            expected_version=decided["approval"]["version"], **ws))

        await wait_ready(feeds["bob"], account_id)
        assert (await feeds["bob"].wait("service_account.create_request.authorized",
                                        lambda d: d["id"] == request["id"]))["created_service_account_id"] == account_id
        final = await b.call("service_account.request.get", request_id=request["id"], **ws)
        assert (final["business_state"], final["created_service_account_id"]) == ("fulfilled", account_id)
        # The applicant is the first manager.
        managers = await b.call("service_account.managers.list", service_account_id=account_id, **ws)
        assert [(m["member_id"], m["status"]) for m in managers["managers"]] == [(bob.member_id, "active")]

        # Every card and the receipt converge in place: one edit, card_revision + 1.
        for who in ("owner", "adam"):
            before = cards[who]
            edited = await feeds[who].wait("message.edited", lambda d, i=before["id"]: d["id"] == i)
            assert (edited["revision"], edited["seq"]) == (before["revision"] + 1, before["seq"])
            assert edited["metadata"]["card"]["state"] == "approved"
            assert edited["metadata"]["card"]["card_revision"] == before["metadata"]["card"]["card_revision"] + 1
            assert not edited["metadata"]["card"].get("actions")
        edited_receipt = await feeds["bob"].wait("message.edited", lambda d: d["id"] == receipt["id"])
        assert edited_receipt["revision"] == receipt["revision"] + 1
        # … and the applicant gets exactly one new result message, unread.
        result = await feeds["bob"].wait("message.created", lambda d: d["message_type"] in (
            "app_notification", "app_interactive_card") and d["id"] != receipt["id"])
        assert result["author_member_id"] == approvals_app and result["scope_id"] == receipt["scope_id"]
        assert await unread_in_dms(b, ws) == unread_before + 1
        mine = await approvals_messages(b, ws)
        assert [m["id"] for m in mine] == [receipt["id"], result["id"]]
        await feeds["bob"].drain()
        assert len(feeds["bob"].named("message.created", lambda d: d["scope_id"] == receipt["scope_id"])) == 2

    async def rows(conn):
        return (await conn.fetch("SELECT created_service_account_id, business_state FROM "
                                 "service_account_create_requests WHERE workspace_id = $1", alpha.workspace_id),
                await conn.fetchval("SELECT count(*) FROM service_accounts WHERE workspace_id = $1",
                                    alpha.workspace_id),
                await conn.fetch("SELECT card_revision FROM service_notification_cards WHERE workspace_id = $1",
                                 alpha.workspace_id))

    requests, accounts, card_rows = await app.db.run(rows)
    assert [tuple(r) for r in requests] == [(account_id, "fulfilled")] and accounts == 1
    assert len(card_rows) >= 2  # the two approvers' cards at least


async def test_reject_declines_and_closes_the_approval(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob, adam = people["bob"], people["adam"]
    async with await signed_in(app, adam) as a, await signed_in(app, bob) as b:
        feed_a, feed_b = await Feed.open(a, ws), await Feed.open(b, ws)
        request = await b.call("service_account.request.submit", client_request_id="ask", name="Gossip", **ws)
        approval = await a.call("approval.get", approval_id=request["approval_id"], **ws)
        card = await feed_a.wait("message.created", lambda d: d["message_type"] == "app_interactive_card")
        receipt = await feed_b.wait("message.created", lambda d: d["message_type"] == "app_notification")
        unread = await unread_in_dms(b, ws)
        decided = await a.call("approval.decide", approval_id=approval["id"], decision="reject",
                               expected_version=approval["version"], reason="no gossip", **ws)
        assert (decided["approval"]["state"], decided["approval"]["decision_reason"]) == ("rejected", "no gossip")
        assert decided["request"]["business_state"] == "declined"
        assert "created_service_account_id" not in decided["request"]
        assert (await feed_b.wait("service_account.create_request.declined",
                                  lambda d: d["id"] == request["id"]))["business_state"] == "declined"
        edited_card = await feed_a.wait("message.edited", lambda d: d["id"] == card["id"])
        assert edited_card["metadata"]["card"]["state"] == "rejected"
        assert (await feed_b.wait("message.edited", lambda d: d["id"] == receipt["id"]))["revision"] \
            == receipt["revision"] + 1
        await feed_b.wait("message.created",
                          lambda d: d["id"] != receipt["id"] and d["scope_id"] == receipt["scope_id"])
        assert await unread_in_dms(b, ws) == unread + 1
        await expect_reason("conflict", "approval_closed", a.call(
            "approval.decide", approval_id=approval["id"], decision="approve",
            expected_version=decided["approval"]["version"], **ws))
        # A declined request cannot be cancelled any more.
        await expect_reason("conflict", "not_cancellable", b.call(
            "service_account.request.cancel", request_id=request["id"], expected_version=decided["request"]["version"],
            client_mutation_id="m-1", **ws))
    assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM service_accounts")) == 0


async def test_approval_revalidates_the_name_at_decision_time(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    async with await signed_in(app, alpha.owner) as owner:
        feed = await Feed.open(owner, ws)
        request = await _submit_for_approval(app, alpha, people["bob"], "Taken later")
        # A pending request does not hold the name: an owner takes it first.
        await create_ready(feed, "taken LATER")
        approval = await owner.call("approval.get", approval_id=request["approval_id"], **ws)
        decided = await owner.call("approval.decide", approval_id=approval["id"], decision="approve",
                                   expected_version=approval["version"], **ws)
        assert decided["approval"]["state"] == "approved"
        assert (decided["request"]["business_state"], decided["request"]["action_required_reason"]) == (
            "action_required", "name_taken")
        assert "created_service_account_id" not in decided["request"]
    assert await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM service_accounts")) == 1


async def test_card_projections_replay_without_duplicates(app: App, org):
    """A crash after the decision committed but before its projection finished
    (intents still pending, the result message sent but its sidecar not yet
    written): the maintenance pass replays every intent and converges on the
    same messages — no second card, receipt or result, no extra edit."""
    alpha, _, people = org
    ws = ws_of(alpha)
    bob = people["bob"]
    request = await _submit_for_approval(app, alpha, bob, "Replayed")
    async with await signed_in(app, alpha.owner) as owner:
        approval = await owner.call("approval.get", approval_id=request["approval_id"], **ws)
        await owner.call("approval.decide", approval_id=approval["id"], decision="approve",
                         expected_version=approval["version"], **ws)

    async def projected(conn):
        return (sorted(tuple(r) for r in await conn.fetch(
                    "SELECT m.id, m.revision, m.message_type FROM scope_messages m JOIN service_members sm "
                    "ON sm.member_id = m.author_member_id JOIN service_installations i ON i.id = "
                    "sm.service_installation_id JOIN service_definitions d ON d.id = i.service_definition_id "
                    "WHERE d.slug = 'approvals' AND m.workspace_id = $1", alpha.workspace_id)),
                sorted(tuple(r) for r in await conn.fetch(
                    "SELECT notification_key, message_id, card_revision FROM service_notification_cards "
                    "WHERE workspace_id = $1", alpha.workspace_id)))

    before_messages, before_cards = await app.db.run(projected)
    # Two reviewer cards and the receipt edited once, plus the result.
    assert sorted(r[1:] for r in before_messages) == [(1, "app_notification"), (2, "app_interactive_card"),
                                                      (2, "app_interactive_card"), (2, "app_notification")]
    await app.db.run(lambda c: c.execute(
        "UPDATE approval_notification_intents SET status = 'pending', done_at = NULL WHERE approval_instance_id = $1",
        approval["id"]))
    await app.db.run(lambda c: c.execute(
        "DELETE FROM service_notification_cards WHERE business_object_id = $1 AND role = 'result'", approval["id"]))
    await sa_ops.project_approval(app.server, approval["id"])
    assert await app.db.run(projected) == (before_messages, before_cards)
    assert await app.db.run(lambda c: c.fetchval(
        "SELECT count(*) FROM approval_notification_intents WHERE approval_instance_id = $1 AND status = 'pending'",
        approval["id"])) == 0
    async with await signed_in(app, bob) as b:
        assert len(await approvals_messages(b, ws)) == 2


# --- 5. idempotent submit ---------------------------------------------------------------------------------

async def test_submit_is_idempotent_per_client_request_id(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    async with await signed_in(app, people["bob"]) as b, await signed_in(app, people["dave"]) as d:
        first = await b.call("service_account.request.submit", client_request_id="same", name="Digest",
                             description="d", **ws)
        again = await b.call("service_account.request.submit", client_request_id="same", name="Digest",
                             description="d", **ws)
        assert (again["id"], again["version"], again["approval_id"], again["payload_digest"]) == (
            first["id"], first["version"], first["approval_id"], first["payload_digest"])
        await expect_idempotency_conflict(b.call("service_account.request.submit", client_request_id="same",
                                                 name="Digest", description="changed", **ws))
        await expect_idempotency_conflict(b.call("service_account.request.submit", client_request_id="same",
                                                 name="Other", description="d", **ws))
        # The key is the requester's: another developer may reuse it.
        other = await d.call("service_account.request.submit", client_request_id="same", name="Digest",
                             description="d", **ws)
        assert other["id"] != first["id"] and other["payload_digest"] == first["payload_digest"]
        # A request the caller did not make does not exist for them.
        await expect_error("not_found", d.call("service_account.request.get", request_id=first["id"], **ws))
        listed = await b.call("service_account.request.list", **ws)
        assert [r["id"] for r in listed["requests"]] == [first["id"]]
    async with await signed_in(app, alpha.owner) as owner:
        everything = await owner.call("service_account.request.list", business_state="awaiting_authorization", **ws)
        assert {r["id"] for r in everything["requests"]} == {first["id"], other["id"]}
        # Replays made no second approval or card.
        page1 = await owner.call("service_account.request.list", limit=1, **ws)
        page2 = await owner.call("service_account.request.list", limit=1, cursor=page1["next_cursor"], **ws)
        assert {page1["requests"][0]["id"], page2["requests"][0]["id"]} == {first["id"], other["id"]}
        assert not page2.get("next_cursor")
        await expect_reason("invalid", "bad_cursor", owner.call("service_account.request.list", cursor="garbage", **ws))
    counts = await app.db.run(lambda c: c.fetchrow(
        "SELECT (SELECT count(*) FROM service_account_create_requests) AS requests, "
        "(SELECT count(*) FROM approval_instances) AS approvals"))
    assert (counts["requests"], counts["approvals"]) == (2, 2)


# --- 6. cancel --------------------------------------------------------------------------------------------

async def test_cancel_before_materialization_closes_the_approval_and_updates_cards(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob = people["bob"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, people["dave"]) as d:
        owner_feed, bob_feed = await Feed.open(owner, ws), await Feed.open(b, ws)
        request = await b.call("service_account.request.submit", client_request_id="c1", name="Cancel me", **ws)
        card = await owner_feed.wait("message.created", lambda m: m["message_type"] == "app_interactive_card")
        receipt = await bob_feed.wait("message.created", lambda m: m["message_type"] == "app_notification")
        cancel = dict(request_id=request["id"], expected_version=request["version"], client_mutation_id="cm-1", **ws)
        # Only the requester cancels; an owner who sees it is refused, a stranger does not see it.
        await expect_reason("forbidden", "not_requester", owner.call("service_account.request.cancel", **cancel))
        await expect_error("not_found", d.call("service_account.request.cancel", **cancel))
        await expect_reason("conflict", "version_mismatch", b.call(
            "service_account.request.cancel", **{**cancel, "expected_version": request["version"] + 1}))
        cancelled = await b.call("service_account.request.cancel", **cancel)
        assert cancelled["business_state"] == "cancelled" and cancelled["version"] > request["version"]
        assert cancelled["cancel_client_mutation_id"] == "cm-1"
        approval = await owner.call("approval.get", approval_id=request["approval_id"], **ws)
        assert approval["state"] == "closed"
        assert cancelled["approval_closure_receipt"] == f"{approval['id']}:{approval['version']}"
        # A retry returns the same result; a different mutation payload conflicts.
        retried = await b.call("service_account.request.cancel", **cancel)
        assert retried.pop("replayed") is True and retried == cancelled
        elsewhere = await b.call("service_account.request.submit", client_request_id="c3", name="Elsewhere", **ws)
        await expect_idempotency_conflict(b.call("service_account.request.cancel", request_id=elsewhere["id"],
                                                 expected_version=elsewhere["version"], client_mutation_id="cm-1",
                                                 **ws))
        await expect_reason("conflict", "not_cancellable", b.call(
            "service_account.request.cancel", **{**cancel, "expected_version": cancelled["version"],
                                                 "client_mutation_id": "cm-2"}))
        await expect_reason("conflict", "approval_closed", owner.call(
            "approval.decide", approval_id=approval["id"], decision="approve", expected_version=approval["version"],
            **ws))
        assert (await owner_feed.wait("service_account.create_request.cancelled",
                                      lambda m: m["id"] == request["id"]))["business_state"] == "cancelled"
        edited_card = await owner_feed.wait("message.edited", lambda m: m["id"] == card["id"])
        assert edited_card["metadata"]["card"]["state"] == "closed"
        assert edited_card["metadata"]["card"]["card_revision"] == card["metadata"]["card"]["card_revision"] + 1
        assert not edited_card["metadata"]["card"].get("actions")
        await bob_feed.wait("message.edited", lambda m: m["id"] == receipt["id"])

        # Once the account exists, cancel points at it.
        other = await b.call("service_account.request.submit", client_request_id="c2", name="Keep me", **ws)
        pending = await owner.call("approval.get", approval_id=other["approval_id"], **ws)
        decided = await owner.call("approval.decide", approval_id=pending["id"], decision="approve",
                                   expected_version=pending["version"], **ws)
        error = await expect_reason("conflict", "create_request_already_materialized", b.call(
            "service_account.request.cancel", request_id=other["id"], expected_version=decided["request"]["version"],
            client_mutation_id="cm-3", **ws))
        assert error.details["service_account_id"] == decided["request"]["created_service_account_id"]
    counts = await app.db.run(lambda c: c.fetchrow(
        "SELECT (SELECT count(*) FROM service_accounts) AS accounts, "
        "(SELECT count(*) FROM service_account_create_requests WHERE business_state = 'cancelled') AS cancelled"))
    assert (counts["accounts"], counts["cancelled"]) == (1, 1)


# --- 7. approve racing cancel -----------------------------------------------------------------------------

REQUEST_LOCK_HOLDER = "query = 'SELECT pg_sleep(60) /* request row held */'"


async def wait_for_lock_waiters(db, count: int) -> None:
    """Until `count` client backends wait on a lock (a precondition inside the database)."""
    while await db.run(lambda c: c.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                            "AND backend_type = 'client backend'")) < count:
        await trio.sleep(0.05)


async def test_approve_racing_cancel_has_exactly_one_winner(app: App, org):
    """Both commands reach the request row lock while a third transaction holds
    it, so they truly contend; whichever wins, the other gets a typed conflict
    and the rows agree with the winner."""
    alpha, _, people = org
    ws = ws_of(alpha)
    bob = people["bob"]
    outcomes: list[tuple[str, str]] = []
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        for round_ in range(4):
            request = await b.call("service_account.request.submit", client_request_id=f"race-{round_}",
                                   name=f"Race {round_}", **ws)
            approval = await owner.call("approval.get", approval_id=request["approval_id"], **ws)
            results: dict[str, object] = {}

            async def approve() -> None:
                try:
                    results["approve"] = await owner.call("approval.decide", approval_id=approval["id"],
                                                          decision="approve", expected_version=approval["version"],
                                                          **ws)
                except ClientError as error:
                    results["approve"] = error

            async def cancel() -> None:
                try:
                    results["cancel"] = await b.call("service_account.request.cancel", request_id=request["id"],
                                                     expected_version=request["version"],
                                                     client_mutation_id=f"race-{round_}", **ws)
                except ClientError as error:
                    results["cancel"] = error

            async def hold(conn) -> None:
                await conn.execute("SELECT 1 FROM service_account_create_requests WHERE id = $1 FOR UPDATE",
                                   request["id"])
                await conn.execute("SELECT pg_sleep(60) /* request row held */")

            async def holder() -> None:
                with contextlib.suppress(DatabaseUnavailable):  # terminated on purpose: the lock is released
                    await app.db.transaction(hold)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(holder)
                await wait_for_query(app.db, REQUEST_LOCK_HOLDER)
                nursery.start_soon(approve)
                nursery.start_soon(cancel)
                with trio.fail_after(30):
                    await wait_for_lock_waiters(app.db, 2)
                await terminate(app.db, REQUEST_LOCK_HOLDER)
            winners = [op for op, value in results.items() if not isinstance(value, ClientError)]
            assert len(winners) == 1, results
            loser = "cancel" if winners == ["approve"] else "approve"
            error = results[loser]
            assert error.code == "conflict", error
            final = await b.call("service_account.request.get", request_id=request["id"], **ws)
            closed = await owner.call("approval.get", approval_id=approval["id"], **ws)
            # The loser may see the state change (materialized / closed) or the version that moved with it.
            if winners == ["approve"]:
                assert error.details.get("reason") in ("create_request_already_materialized", "version_mismatch")
                assert final["business_state"] in ("provisioning", "fulfilled")
                assert closed["state"] == "approved"
                assert await app.db.run(lambda c: c.fetchval(
                    "SELECT count(*) FROM service_accounts WHERE id = $1", final["created_service_account_id"])) == 1
            else:
                assert error.details.get("reason") in ("approval_closed", "version_mismatch"), error
                assert final["business_state"] == "cancelled" and "created_service_account_id" not in final
                assert closed["state"] == "closed"
            outcomes.append((winners[0], final["business_state"]))
    accounts = await app.db.run(lambda c: c.fetchval("SELECT count(*) FROM service_accounts"))
    assert accounts == sum(1 for winner, _ in outcomes if winner == "approve")
