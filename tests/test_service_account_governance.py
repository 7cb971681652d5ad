"""Workspace service accounts — governance (service-account.md §2.5, §2.6, §6,
§7, §8.2, §9.1) over the WebSocket against PostgreSQL: managers (at least one,
deactivation and the owner fallback), permanent delete leaving no row behind,
the audit trail and its cursor, and every op probed across workspaces and with
bad input."""

from __future__ import annotations

import base64
import json

import uuid

from client import ClientError
from protocol import service_accounts as sa_protocol
from tests.conftest import App, add_person
from tests.service_account_helpers import (Feed, create_ready, expect_reason, org, set_policy, text_columns_naming,
                                           ws_of)
from tests.test_tenancy import expect_error, signed_in

__all__ = ["org"]  # the fixture, imported for pytest


def active(page: dict) -> list[str]:
    return [m["member_id"] for m in page["managers"] if m["status"] == "active"]


# --- 8. managers ------------------------------------------------------------------------------------------

async def test_managers_list_add_remove_and_the_last_one_stays(app: App, org, member_password_hash):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob, dave, adam, carol = people["bob"], people["dave"], people["adam"], people["carol"]
    gone = await add_person(app.db, alpha.workspace_id, "gone@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, carol) as c:
        agent = await owner.call("agent.create", handle="ops-bot", display_name="Ops bot", **ws)
        await owner.call("member.remove", member_id=gone.member_id, **ws)
        feed = await Feed.open(owner, ws)
        created = await create_ready(feed, "Ops")
        account_id = created["account"]["profile"]["service_account_id"]
        sa = {"service_account_id": account_id, **ws}
        audience_before = await owner.call("service_account.audience.get", **sa)

        # Not a manager, not an owner/admin: no changes to the list.
        await expect_reason("forbidden", "not_a_manager", b.call("service_account.managers.add",
                                                                 member_id=bob.member_id, **sa))
        await expect_reason("forbidden", "not_a_manager", c.call("service_account.managers.remove",
                                                                 member_id=alpha.owner.member_id, **sa))
        # Only active humans manage.
        for candidate in (agent["id"], gone.member_id, created["account"]["profile"]["member_id"]):
            await expect_reason("invalid", "not_an_active_human", owner.call("service_account.managers.add",
                                                                             member_id=candidate, **sa))
        await expect_error("not_found", owner.call("service_account.managers.add", member_id="mem_zzzzzzzzzzzzzz",
                                                   **sa))

        added = await owner.call("service_account.managers.add", member_id=bob.member_id, **sa)
        assert (added["member_id"], added["status"], added["added_by_member_id"]) == (
            bob.member_id, "active", alpha.owner.member_id)
        changed = await feed.wait("service_account.manager_changed", lambda d: d["member_id"] == bob.member_id)
        assert (changed["service_account_id"], changed["action"]) == (account_id, "added")
        # Now a manager, Bob adds Dave; then removes the owner (any manager may).
        assert (await b.call("service_account.managers.add", member_id=dave.member_id, **sa))["status"] == "active"
        listed = await b.call("service_account.managers.list", **sa)
        assert sorted(active(listed)) == sorted([alpha.owner.member_id, bob.member_id, dave.member_id])
        first = await b.call("service_account.managers.list", limit=2, **sa)
        rest = await b.call("service_account.managers.list", limit=2, cursor=first["next_cursor"], **sa)
        assert active(first) + active(rest) == active(listed) and not rest.get("next_cursor")
        await expect_reason("invalid", "bad_cursor", b.call("service_account.managers.list", cursor="nope", **sa))
        removed = await b.call("service_account.managers.remove", member_id=alpha.owner.member_id, **sa)
        assert (removed["status"], removed["removed_reason"]) == ("removed", "removed")
        assert (await feed.wait("service_account.manager_changed",
                                lambda d: d["action"] == "removed"))["member_id"] == alpha.owner.member_id
        await b.call("service_account.managers.remove", member_id=dave.member_id, **sa)
        # Bob is the last: he cannot leave, nobody can remove him.
        await expect_reason("conflict", "last_manager", b.call("service_account.managers.remove",
                                                               member_id=bob.member_id, **sa))
        await expect_reason("conflict", "last_manager", owner.call("service_account.managers.remove",
                                                                   member_id=bob.member_id, **sa))
        # The owner, no longer a manager, still governs: hands the account to Adam.
        await owner.call("service_account.managers.add", member_id=adam.member_id, **sa)
        await owner.call("service_account.managers.remove", member_id=bob.member_id, **sa)
        assert active(await owner.call("service_account.managers.list", **sa)) == [adam.member_id]
        history = await owner.call("service_account.managers.list", include_removed=True, **sa)
        reasons = sorted((m["member_id"], m["status"], m.get("removed_reason")) for m in history["managers"])
        assert reasons == sorted([(alpha.owner.member_id, "removed", "removed"), (bob.member_id, "removed", "removed"),
                                  (dave.member_id, "removed", "removed"), (adam.member_id, "active", None)])
        # Bob is out again: back to not_a_manager; a plain member cannot read the list.
        await expect_reason("forbidden", "not_a_manager", b.call("service_account.managers.add",
                                                                 member_id=bob.member_id, **sa))
        await expect_error("forbidden", c.call("service_account.managers.list", **sa))
        # Managers never changed the audience.
        audience_after = await owner.call("service_account.audience.get", **sa)
        assert (audience_after["audience_policy_version"], audience_after["member_count"]) == (
            audience_before["audience_policy_version"], audience_before["member_count"])


async def test_workspace_removal_of_a_manager_removes_the_assignment_and_falls_back_to_the_oldest_owner(
        app: App, org, member_password_hash):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob, dave = people["bob"], people["dave"]
    # A second, newer owner: the fallback takes the longest-standing one.
    await add_person(app.db, alpha.workspace_id, "olga@example.com", "owner", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        await set_policy(owner, ws, "direct_create")
        owner_feed = await Feed.open(owner, ws)
        async with await signed_in(app, bob) as b, await signed_in(app, dave) as d:
            solo = (await create_ready(await Feed.open(b, ws), "Bob solo"))["account"]["profile"]["service_account_id"]
            shared = (await create_ready(await Feed.open(d, ws), "Shared"))["account"]["profile"]["service_account_id"]
            await d.call("service_account.managers.add", service_account_id=shared, member_id=bob.member_id, **ws)
        await owner.call("member.remove", member_id=bob.member_id, **ws)
        # The assignments ended in the removal's own transaction.
        solo_page = await owner.call("service_account.managers.list", service_account_id=solo, include_removed=True,
                                     **ws)
        assert active(solo_page) == [alpha.owner.member_id]
        assert [(m["status"], m.get("removed_reason")) for m in solo_page["managers"]
                if m["member_id"] == bob.member_id] == [("removed", "deactivated")]
        shared_page = await owner.call("service_account.managers.list", service_account_id=shared, **ws)
        assert active(shared_page) == [dave.member_id]  # someone was left: no fallback
        audit = await owner.call("service_account.audit.list", service_account_id=solo, limit=200, **ws)
        fallbacks = [e for e in audit["events"] if e["action"] == "manager.fallback_assigned"]
        assert len(fallbacks) == 1 and fallbacks[0]["actor_type"] == "system"
        assert fallbacks[0]["details"]["member_id"] == alpha.owner.member_id
        shared_audit = await owner.call("service_account.audit.list", service_account_id=shared, limit=200, **ws)
        assert not [e for e in shared_audit["events"] if e["action"] == "manager.fallback_assigned"]
        # Managers and owners/admins hear of it: Bob's removals (reason deactivated) and the fallback.
        for account_id in (solo, shared):
            event = await owner_feed.wait("service_account.manager_changed",
                                          lambda e, a=account_id: e["service_account_id"] == a
                                          and e["member_id"] == bob.member_id and e["action"] == "removed")
            assert event["reason"] == "deactivated"
        fallback = await owner_feed.wait("service_account.manager_changed",
                                         lambda e: e["service_account_id"] == solo and e["action"] == "added"
                                         and e["member_id"] != bob.member_id)
        assert fallback["member_id"] == alpha.owner.member_id


# --- 9. delete --------------------------------------------------------------------------------------------

async def test_delete_needs_the_version_and_removes_every_row_of_the_account(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob, dave = people["bob"], people["dave"]
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, dave) as d:
        feed = await Feed.open(owner, ws)
        created = await create_ready(feed, "Doomed")
        profile = created["account"]["profile"]
        account_id, scope_id = profile["service_account_id"], profile["scope_id"]
        sa = {"service_account_id": account_id, **ws}
        await owner.call("service_account.managers.add", member_id=bob.member_id, **sa)
        # Leave state everywhere an account reaches: a post, a reaction, read state, personal and shared pins.
        post = await b.call("service_account.post", title="Hello", content="**first**",
                            client_message_id=str(uuid.uuid4()), byline=True, **sa)
        await d.call("reaction.add", message_id=post["id"], key="👍", **ws)
        await d.call("read.mark", scope_id=scope_id, seq=post["seq"], **ws)
        await d.call("conversation.action", scope_id=scope_id, action="pin", **ws)
        await d.call("notification.set", scope_id=scope_id, state="mute", **ws)
        await b.call("pin.add", message_id=post["id"], top_notice=True, **ws)
        current = await owner.call("service_account.get", **sa)  # the manager added moved the version
        renamed = await owner.call("service_account.update", expected_version=current["version"],
                                   description="soon gone", **sa)
        version = renamed["version"]

        ids = await app.db.run(lambda c: c.fetchrow(
            "SELECT a.id, a.author_member_id, a.message_scope_id, a.service_installation_id, a.service_member_id, "
            "b.id AS binding_id, (SELECT array_agg(id) FROM service_grants g "
            "  WHERE g.service_installation_id = a.service_installation_id) AS grant_ids, "
            "(SELECT array_agg(id) FROM service_account_managers m WHERE m.service_account_id = a.id) AS manager_ids "
            "FROM service_accounts a JOIN service_target_bindings b ON b.service_installation_id = "
            "a.service_installation_id WHERE a.id = $1", account_id))
        doomed_ids = [ids["id"], ids["author_member_id"], ids["message_scope_id"], ids["service_installation_id"],
                      ids["service_member_id"], ids["binding_id"], *ids["grant_ids"], *ids["manager_ids"], post["id"]]
        assert await text_columns_naming(app.db, doomed_ids, skip_tables=("service_account_audit_events",))

        await expect_reason("conflict", "version_mismatch", owner.call("service_account.delete",
                                                                       expected_version=version + 1, **sa))
        await expect_reason("forbidden", "not_a_manager", d.call("service_account.delete", expected_version=version,
                                                                 **sa))
        deleted = await b.call("service_account.delete", expected_version=version, **sa)  # a manager may
        assert deleted == {"service_account_id": account_id, "version": version}
        gone = await feed.wait("service_account.deleted", lambda e: e["service_account_id"] == account_id)
        assert gone["name"] == "Doomed"

        # Not one row anywhere still names the account, its identity, scope, messages or managers …
        assert await text_columns_naming(app.db, doomed_ids, skip_tables=("service_account_audit_events",)) == {}
        # … except the audit, which keeps the subject, and the request, which loses its account ref.
        request = await owner.call("service_account.request.get", request_id=created["request"]["id"], **ws)
        assert "created_service_account_id" not in request and request["business_state"] == "fulfilled"
        audit = await owner.call("service_account.audit.list", limit=200, **ws)
        deletion = [e for e in audit["events"] if e["subject_id"] == account_id and e["subject_type"] ==
                    "service_account" and e["subject_version"] == version and "delete" in e["action"]]
        assert len(deletion) == 1 and deletion[0]["actor_member_id"] == bob.member_id
        assert await app.db.run(lambda c: c.fetchval(
            "SELECT count(*) FROM service_account_audit_events WHERE subject_id = $1", account_id)) >= 2

        # Every id now answers not_found.
        message = {"message_id": post["id"], **ws}
        for conn, op, fields in (
                (owner, "service_account.get", sa), (owner, "service_account.update", dict(sa, expected_version=version,
                                                                                         name="x")),
                (owner, "service_account.delete", dict(sa, expected_version=version)),
                (owner, "service_account.managers.list", sa),
                (owner, "service_account.managers.add", dict(sa, member_id=dave.member_id)),
                (owner, "service_account.managers.remove", dict(sa, member_id=bob.member_id)),
                (owner, "service_account.audience.get", sa), (owner, "service_account.audit.list", sa),
                (b, "service_account.post", dict(sa, title="t", content="c", client_message_id=str(uuid.uuid4()))),
                (b, "service_account.post.edit", dict(message, title="t", content="c", expected_revision=1)),
                (b, "service_account.post.withdraw", dict(message, expected_revision=1, reason="r")),
                (d, "message.get", message), (d, "message.history", {"scope_id": scope_id, **ws}),
                (d, "reaction.add", dict(message, key="🎉")),
                (d, "read.mark", {"scope_id": scope_id, "seq": 1, **ws}),
                (b, "pin.add", message), (d, "pin.list", {"scope_id": scope_id, **ws})):
            await expect_error("not_found", conn.call(op, **fields))
        assert scope_id not in {c["scope_id"] for c in (await d.call("inbox.list", **ws))["conversations"]}
        assert account_id not in {a["service_account_id"] for a in (await d.call("service_account.list",
                                                                                 **ws))["accounts"]}
        # The name is free again.
        await create_ready(feed, "doomed", client_request_id="reborn")


# --- 10. audit --------------------------------------------------------------------------------------------

async def _all_events(conn, ws: dict, **fields) -> list[dict]:
    page = await conn.call("service_account.audit.list", limit=200, **fields, **ws)
    assert not page.get("next_cursor")
    return page["events"]


async def test_every_mutation_is_audited_and_the_audit_pages_with_a_stable_cursor(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    bob, dave, carol = people["bob"], people["dave"], people["carol"]
    # (subject_type, subject_id or None when not fixed by the contract, possible actors, version or None)
    mutations: list[tuple[str, str | None, set[str], int | None]] = []
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b, \
            await signed_in(app, carol) as c:
        feed = await Feed.open(owner, ws)
        policy = await set_policy(owner, ws, "approval_required")
        mutations.append(("policy", None, {alpha.owner.member_id}, policy["version"]))
        request = await b.call("service_account.request.submit", client_request_id="a-1", name="Audited", **ws)
        mutations.append(("create_request", request["id"], {bob.member_id}, request["version"]))
        approval = await owner.call("approval.get", approval_id=request["approval_id"], **ws)
        decided = await owner.call("approval.decide", approval_id=approval["id"], decision="approve",
                                   expected_version=approval["version"], **ws)
        mutations.append(("approval", approval["id"], {alpha.owner.member_id}, decided["approval"]["version"]))
        account_id = decided["request"]["created_service_account_id"]
        sa = {"service_account_id": account_id, **ws}
        await feed.wait("service_account.audience_changed",
                        lambda e: e["service_account_id"] == account_id and e["audience"]["state"] == "ready")
        # Created by the approver's command for the applicant: either is a fair actor.
        mutations.append(("service_account", account_id, {alpha.owner.member_id, bob.member_id}, None))
        await b.call("service_account.managers.add", member_id=dave.member_id, **sa)
        await b.call("service_account.managers.remove", member_id=dave.member_id, **sa)
        detail = await b.call("service_account.get", **sa)
        updated = await b.call("service_account.update", expected_version=detail["version"], name="Audited 2", **sa)
        mutations.append(("service_account", account_id, {bob.member_id}, updated["version"]))
        other = await b.call("service_account.request.submit", client_request_id="a-2", name="Withdrawn", **ws)
        cancelled = await b.call("service_account.request.cancel", request_id=other["id"],
                                 expected_version=other["version"], client_mutation_id="cm", **ws)
        mutations.append(("create_request", other["id"], {bob.member_id}, cancelled["version"]))
        third = await b.call("service_account.request.submit", client_request_id="a-3", name="Refused", **ws)
        refusal = await owner.call("approval.get", approval_id=third["approval_id"], **ws)
        rejected = await owner.call("approval.decide", approval_id=refusal["id"], decision="reject",
                                    expected_version=refusal["version"], **ws)
        mutations.append(("approval", refusal["id"], {alpha.owner.member_id}, rejected["approval"]["version"]))

        events = await _all_events(owner, ws)
        for subject_type, subject_id, actors, version in mutations:
            matching = [e for e in events if e["subject_type"] == subject_type
                        and subject_id in (None, e["subject_id"]) and e.get("actor_member_id") in actors]
            assert matching, (subject_type, subject_id, [(e["subject_type"], e["action"]) for e in events])
            if version is not None:
                assert version in {e.get("subject_version") for e in matching}, (subject_type, matching)
        manager_events = [e for e in events if e.get("service_account_id") == account_id
                          and e["action"].startswith("manager.") and e.get("actor_member_id") == bob.member_id]
        assert len(manager_events) == 2 and {e["details"].get("member_id") for e in manager_events} \
            == {dave.member_id}
        for event in events:
            assert event["actor_type"] in ("human", "service", "system")
            assert event["permission_basis"] and event["correlation_id"], event
            if event["actor_type"] == "human":
                assert event["actor_member_id"], event
        # One correlation id per command: the approval and the account it created share one; separate
        # commands never do.
        by_command = {}
        for event in events:
            by_command.setdefault(event["correlation_id"], set()).add((event["subject_type"], event["subject_id"]))
        approve_ids = {e["correlation_id"] for e in events if e["subject_id"] == approval["id"]}
        assert len(approve_ids) == 1
        assert ("service_account", account_id) in by_command[approve_ids.pop()]
        update_ids = {e["correlation_id"] for e in events if e["subject_id"] == account_id
                      and e.get("subject_version") == updated["version"]}
        assert len(update_ids) == 1 and len(by_command[next(iter(update_ids))]) == 1
        # Newest first, stable (created, id) order.
        stamps = [(e["created_at_ms"], e["id"]) for e in events]
        assert stamps == sorted(stamps, reverse=True) and len(set(stamps)) == len(stamps)

        # Paging with an opaque cursor covers everything exactly once, and a cursor keeps
        # its page while newer events arrive.
        pages, cursor = [], None
        while True:
            page = await owner.call("service_account.audit.list", limit=3, **({"cursor": cursor} if cursor else {}),
                                    **ws)
            pages.append(page)
            cursor = page.get("next_cursor")
            if not cursor:
                break
        assert [e["id"] for p in pages for e in p["events"]] == [e["id"] for e in events]
        second_cursor = pages[0]["next_cursor"]
        await b.call("service_account.update", expected_version=updated["version"], description="newer", **sa)
        again = await owner.call("service_account.audit.list", limit=3, cursor=second_cursor, **ws)
        assert again == pages[1]

        # A manager reads their accounts' audit only (without an id: every account they manage);
        # a plain member none; bad cursors are invalid.
        own = await _all_events(b, ws, service_account_id=account_id)
        assert own and {e.get("service_account_id") for e in own} == {account_id}
        assert [e["id"] for e in await _all_events(b, ws)] == [e["id"] for e in own]
        await expect_reason("forbidden", "not_a_manager", c.call("service_account.audit.list", **ws))
        await expect_reason("forbidden", "not_a_manager", c.call("service_account.audit.list", **sa))
        await expect_error("not_found", owner.call("service_account.audit.list",
                                                   service_account_id="sac_zzzzzzzzzzzzzz", **ws))
        for bad in ("garbage", "x" * 40, second_cursor[:-2] + "!!", second_cursor[::-1]):
            await expect_reason("invalid", "bad_cursor", owner.call("service_account.audit.list", cursor=bad, **ws))
        await expect_error("bad_frame", owner.call("service_account.audit.list", cursor="", **ws))
    rows = await app.db.run(lambda conn: conn.fetchval(
        "SELECT count(*) FROM service_account_audit_events WHERE workspace_id = $1", alpha.workspace_id))
    assert rows == len(events) + 1  # the description change after the listing


# --- 11. cross-workspace, malformed ids, bad input ----------------------------------------------------------

ALL_OPS = {frame.__struct_config__.tag for frame in sa_protocol.FRAMES}


async def test_every_op_probed_with_another_workspaces_ids_answers_not_found(app: App, org, member_password_hash):
    alpha, beta, people = org
    a, b = ws_of(alpha), ws_of(beta)
    bert = await add_person(app.db, beta.workspace_id, "bert@example.com", "developer", member_password_hash)
    async with await signed_in(app, beta.owner) as owner_b:
        feed = await Feed.open(owner_b, b)
        account = (await create_ready(feed, "Beta news"))["account"]["profile"]
        post = await owner_b.call("service_account.post", service_account_id=account["service_account_id"],
                                  title="Beta", content="only beta", client_message_id=str(uuid.uuid4()), **b)
        async with await signed_in(app, bert) as bt:
            request = await bt.call("service_account.request.submit", client_request_id="b-1", name="Beta ask", **b)
    beta_sa = {"service_account_id": account["service_account_id"]}
    beta_msg = {"message_id": post["id"]}
    probes = {
        "service_account.policy.get": [b],
        "service_account.policy.set": [dict(b, creation_policy="direct_create", expected_version=0)],
        "service_account.request.submit": [dict(b, client_request_id="x", name="x")],
        "service_account.request.get": [dict(a, request_id=request["id"])],
        "service_account.request.list": [b],
        "service_account.request.cancel": [dict(a, request_id=request["id"], expected_version=request["version"],
                                                client_mutation_id="x")],
        "approval.get": [dict(a, approval_id=request["approval_id"])],
        "approval.decide": [dict(a, approval_id=request["approval_id"], decision="approve", expected_version=1)],
        "service_account.list": [b],
        "service_account.get": [dict(a, **beta_sa)],
        "service_account.update": [dict(a, **beta_sa, expected_version=1, name="x")],
        "service_account.delete": [dict(a, **beta_sa, expected_version=1)],
        "service_account.managers.list": [dict(a, **beta_sa)],
        "service_account.managers.add": [dict(a, **beta_sa, member_id=people["bob"].member_id)],
        "service_account.managers.remove": [dict(a, **beta_sa, member_id=beta.owner.member_id)],
        "service_account.audience.get": [dict(a, **beta_sa)],
        "service_account.post": [dict(a, **beta_sa, title="x", content="x", client_message_id=str(uuid.uuid4()))],
        "service_account.post.edit": [dict(a, **beta_msg, title="x", content="x", expected_revision=1)],
        "service_account.post.withdraw": [dict(a, **beta_msg, expected_revision=1, reason="x")],
        "service_account.audit.list": [dict(a, **beta_sa)],
        "pin.add": [dict(a, **beta_msg)],
        "pin.remove": [dict(a, **beta_msg)],
        "pin.list": [dict(a, scope_id=account["scope_id"])],
        "conversation.mark_read_many": [b],
    }
    assert set(probes) == ALL_OPS
    async with await signed_in(app, alpha.owner) as owner:
        feed_a = await Feed.open(owner, a)
        own = (await create_ready(feed_a, "Alpha news"))["account"]["profile"]
        # Alpha's own account cannot take Beta's members either.
        probes["service_account.managers.add"].append(dict(a, service_account_id=own["service_account_id"],
                                                           member_id=beta.owner.member_id))
        probes["conversation.mark_read_many"][0] = dict(b, items=[{"conversation_id": own["conversation_id"],
                                                                   "read_through_seq": 1}])
        for op, variants in probes.items():
            for fields in variants:
                await expect_error("not_found", owner.call(op, **fields))
        # In Alpha, Beta's conversation is simply not there.
        marked = await owner.call("conversation.mark_read_many", items=[
            {"conversation_id": account["conversation_id"], "read_through_seq": 1}], **a)
        assert marked["results"] == [{"conversation_id": account["conversation_id"], "status": "not_found"}]
    counts = await app.db.run(lambda c: c.fetchrow(
        "SELECT (SELECT count(*) FROM service_accounts WHERE workspace_id = $1) AS accounts, "
        "(SELECT version FROM approval_instances WHERE id = $2) AS approval_version, "
        "(SELECT count(*) FROM service_account_managers WHERE workspace_id = $1) AS managers",
        beta.workspace_id, request["approval_id"]))
    assert (counts["accounts"], counts["approval_version"], counts["managers"]) == (1, 1, 1)


def crafted(values: list) -> str:
    """An opaque cursor as the server encodes one, holding `values`."""
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


async def test_a_name_whose_handle_would_end_in_a_dash_creates_its_account(app: App, org):
    """The author member's handle is derived from the name: cut to length, it stays a clean handle."""
    alpha, _, _ = org
    ws = ws_of(alpha)
    async with await signed_in(app, alpha.owner) as owner:
        feed = await Feed.open(owner, ws)
        created = await create_ready(feed, "a" * 39 + " b")
    handle = await app.db.run(lambda c: c.fetchval(
        "SELECT handle FROM members WHERE id = $1", created["account"]["profile"]["member_id"]))
    assert handle.startswith("a" * 39 + "-") and "--" not in handle and not handle.endswith("-")


async def test_malformed_ids_and_bad_input_get_typed_errors_never_internal(app: App, org):
    alpha, _, people = org
    ws = ws_of(alpha)
    async with await signed_in(app, alpha.owner) as owner:
        feed = await Feed.open(owner, ws)
        created = await create_ready(feed, "Strict")
        account_id = created["account"]["profile"]["service_account_id"]
        scope_id = created["account"]["profile"]["scope_id"]
        request_id = created["request"]["id"]

        # Malformed ids: invalid, naming the field (a well-formed id of another kind is malformed too).
        malformed = {
            "service_account.request.get": ("request_id", {}),
            "service_account.request.cancel": ("request_id", dict(expected_version=1, client_mutation_id="m")),
            "approval.get": ("approval_id", {}),
            "approval.decide": ("approval_id", dict(decision="approve", expected_version=1)),
            "service_account.get": ("service_account_id", {}),
            "service_account.update": ("service_account_id", dict(expected_version=1, name="x")),
            "service_account.delete": ("service_account_id", dict(expected_version=1)),
            "service_account.managers.list": ("service_account_id", {}),
            "service_account.managers.add": ("member_id", dict(service_account_id=account_id)),
            "service_account.managers.remove": ("member_id", dict(service_account_id=account_id)),
            "service_account.audience.get": ("service_account_id", {}),
            "service_account.audit.list": ("service_account_id", {}),
            "service_account.post": ("service_account_id", dict(title="t", content="c",
                                                                client_message_id=str(uuid.uuid4()))),
            "service_account.post.edit": ("message_id", dict(title="t", content="c", expected_revision=1)),
            "service_account.post.withdraw": ("message_id", dict(expected_revision=1, reason="r")),
            "pin.add": ("message_id", {}),
            "pin.remove": ("message_id", {}),
            "pin.list": ("scope_id", {}),
        }
        for op, (field, extra) in malformed.items():
            for bad in ("nope", "sac_short", scope_id if field != "scope_id" else account_id, "sar_" + "Z" * 14):
                error = await expect_error("invalid", owner.call(op, **{field: bad}, **extra, **ws))
                assert error.details.get("field"), (op, bad, error.details)
        # Unknown well-formed ids: not_found.
        for op, field, extra in (("service_account.get", "service_account_id", {}),
                                 ("service_account.request.get", "request_id", {}),
                                 ("approval.get", "approval_id", {}),
                                 ("service_account.managers.add", "member_id", {"service_account_id": account_id})):
            prefix = {"service_account_id": "sac", "request_id": "sar", "approval_id": "apv", "member_id": "mem"}
            await expect_error("not_found", owner.call(op, **{field: f"{prefix[field]}_zzzzzzzzzzzzzz"}, **extra,
                                                       **ws))

        # Bad input of every shape: bad_frame / invalid with a stable code, never internal.
        sa = {"service_account_id": account_id}
        bad_inputs = [
            ("service_account.policy.set", dict(creation_policy="anyone", expected_version=0)),
            ("service_account.policy.set", dict(creation_policy="direct_create", expected_version=-1)),
            ("service_account.policy.set", dict(creation_policy="direct_create")),
            ("service_account.request.submit", dict(client_request_id="", name="x")),
            ("service_account.request.submit", dict(client_request_id="x" * 129, name="x")),
            ("service_account.request.submit", dict(client_request_id="k", name="")),
            ("service_account.request.submit", dict(client_request_id="k", name=" " * 5)),
            ("service_account.request.submit", dict(client_request_id="k", name="n" * 81)),
            ("service_account.request.submit", dict(client_request_id="k", name=" " * 40 + "n" * 41)),
            ("service_account.request.submit", dict(client_request_id="k", name="x", description="d" * 1001)),
            ("service_account.request.submit", dict(client_request_id="k", name=["x"])),
            ("service_account.request.submit", dict(client_request_id="k", name="x", extra=1)),
            ("service_account.request.submit", dict(client_request_id="k", name="bad\x00name")),
            ("service_account.request.list", dict(business_state="sleeping")),
            ("service_account.request.list", dict(limit=0)),
            ("service_account.request.list", dict(limit=201)),
            ("service_account.request.cancel", dict(request_id=request_id, expected_version=0,
                                                    client_mutation_id="m")),
            ("service_account.request.cancel", dict(request_id=request_id, expected_version=1,
                                                    client_mutation_id="")),
            ("approval.decide", dict(approval_id="apv_zzzzzzzzzzzzzz", decision="maybe", expected_version=1)),
            ("approval.decide", dict(approval_id="apv_zzzzzzzzzzzzzz", decision="approve", expected_version="1")),
            ("approval.decide", dict(approval_id="apv_zzzzzzzzzzzzzz", decision="approve", expected_version=1,
                                     reason="r" * 1001)),
            ("service_account.list", dict(query="q" * 81)),
            ("service_account.list", dict(cursor="not a cursor")),
            ("service_account.update", dict(sa, expected_version=1, name="")),
            ("service_account.update", dict(sa, expected_version=1, name="   ")),
            ("service_account.update", dict(sa, expected_version=1, description=None, name=5)),
            ("service_account.delete", dict(sa, expected_version=0)),
            ("service_account.delete", dict(sa, expected_version=2**60)),
            ("service_account.managers.list", dict(sa, limit=-1)),
            ("service_account.managers.list", dict(sa, cursor="%%%")),
            ("service_account.post", dict(sa, title="", content="c", client_message_id=str(uuid.uuid4()))),
            ("service_account.post", dict(sa, title="t", content="c", client_message_id="not-a-uuid")),
            ("service_account.post", dict(sa, title="t", content="c" * 40001, client_message_id=str(uuid.uuid4()))),
            ("service_account.audit.list", dict(limit=1000)),
            ("service_account.audit.list", dict(cursor=12)),
            ("service_account.post", dict(sa, title="   ", content="c", client_message_id=str(uuid.uuid4()))),
            # Well-formed cursors holding what the database would refuse (a NUL, a lone surrogate).
            *[(op, dict(extra, cursor=crafted(values))) for values in (["\x00"], ["\ud800"])
              for op, extra in (("service_account.audit.list", {}), ("service_account.request.list", {}),
                                ("service_account.managers.list", sa))],
            *[("service_account.list", dict(cursor=crafted([v, "sac_zzzzzzzzzzzzzz"]))) for v in ("\x00", "\ud800")],
        ]
        for op, fields in bad_inputs:
            try:
                await owner.call(op, **fields, **ws)
            except ClientError as error:
                assert error.code in ("bad_frame", "invalid"), (op, fields, error)
            else:
                raise AssertionError(f"{op} {fields} was accepted")
    # Nothing bad input touched was written: still one account, one request.
    counts = await app.db.run(lambda c: c.fetchrow(
        "SELECT (SELECT count(*) FROM service_accounts) AS accounts, "
        "(SELECT count(*) FROM service_account_create_requests) AS requests, "
        "(SELECT version FROM service_account_workspace_policies WHERE workspace_id = $1) AS policy",
        alpha.workspace_id))
    assert (counts["accounts"], counts["requests"]) == (1, 1)
    assert counts["policy"] in (None, 0)

