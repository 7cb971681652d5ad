"""Platform service accounts — operators, accounts, provisioning and delete
(issue 15 items 1, 2 and 5; service-account.md §2.4, §2.5, §9.3) over the
WebSocket against PostgreSQL: operator keys and the operator/workspace
boundary, zero to many accounts each its own principal, one name namespace
shared with the workspaces' own accounts, the accounts × workspaces cross
product (workspaces created later included), read-only local instances,
profile propagation and the cascading delete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from actors import platform_account as pa
from client import connect
from domain.platform import PLATFORM_CHANNEL
from protocol import frames
from storage import platform as platform_store
from tests.conftest import App, add_person
from tests.db_faults import hold_table_lock, release_locks
from tests.platform_helpers import (EVENT_TIMEOUT, broadcast, conversation_messages, create_platform_account, get_account,
                                    instances, local_account, operator, wait_broadcast_done, wait_ready)
from tests.service_account_helpers import Feed, create_ready, expect_reason, text_columns_naming, ws_of
from tests.test_tenancy import expect_error, signed_in

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# What a delete leaves on purpose: the audits keep the facts (subject id and version).
AUDIT_TABLES = ("platform_service_account_audit_events", "service_account_audit_events")


def scopewire(dsn: str, *args: str) -> tuple[int, object, str]:
    done = subprocess.run([sys.executable, "-m", "server.cli", *args, "--database-url", dsn],
                          capture_output=True, text=True, timeout=120, cwd=PROJECT_ROOT)
    output = json.loads(done.stdout) if done.returncode == 0 else None
    return done.returncode, output, done.stderr


async def submit(conn, ws: dict, name: str):
    return await conn.call("service_account.request.submit", client_request_id=f"c-{name}", name=name, **ws)


# --- 1. operators: their own keys, and no workspace authority ---------------------------------------------

async def test_operator_keys_authenticate_and_stay_outside_every_workspace(app: App, tenants, database_dsn: str):
    alpha, beta = tenants
    # The CLI issues a key that authenticates as the operator.
    code, issued, err = scopewire(database_dsn, "operator", "create", "--name", "night-shift")
    assert code == 0, err
    assert issued["key"].startswith("swo_") and issued["operator_id"].startswith("pop_")
    async with connect(app.url) as conn:
        result = await conn.call("auth", operator_key=issued["key"])
        assert result["principal"] == "operator" and result["operator_id"] == issued["operator_id"]
        assert "workspace_id" not in result and "member_id" not in result and not result.get("workspaces")
        assert (await conn.call("platform.account.list"))["accounts"] == []

        # An operator is no member of any workspace.
        for op, fields in (("workspace.list", {}), ("workspace.create", {"name": "Ops", "slug": "ops"}),
                           ("workspace.get", ws_of(alpha)), ("member.list", ws_of(beta)),
                           ("service_account.list", ws_of(alpha)), ("inbox.list", ws_of(alpha)),
                           ("message.send", {"scope_id": "scp_x", "content": "hi", "client_message_id": "m1",
                                             **ws_of(alpha)})):
            await expect_reason("forbidden", "operator_not_member", conn.call(op, **fields))

    # A wrong key, and no key at all, authenticate nothing.
    async with connect(app.url) as conn:
        await expect_error("unauthenticated", conn.call("auth", operator_key="swo_" + "A" * 43))
    async with connect(app.url) as conn:
        await expect_error("unauthenticated", conn.call("platform.account.list"))
    # A human (even an owner) is no operator.
    async with await signed_in(app, alpha.owner) as owner:
        await expect_reason("forbidden", "platform_operator_required",
                            owner.call("platform.account.create", name="News"))
        await expect_reason("forbidden", "platform_operator_required", owner.call("platform.account.list"))

    # Disabling an operator closes its live connections (4403) and refuses any new auth.
    async with operator(app, "soon-gone") as ops:
        await create_platform_account(ops, "Before")
        code, _, err = scopewire(database_dsn, "operator", "disable", ops.operator_id)
        assert code == 0, err
        code, listed, err = scopewire(database_dsn, "operator", "list")
        assert code == 0, err
        assert {o["id"]: o["status"] for o in listed}[ops.operator_id] == "disabled"
        with trio.fail_after(30):
            assert await ops.conn.wait_closed() == frames.CLOSE_REVOKED
    async with connect(app.url) as conn:
        await expect_error("unauthenticated", conn.call("auth", operator_key=ops.key))
        result = await conn.call("auth", operator_key=issued["key"])  # the other operator is untouched
        assert result["operator_id"] == issued["operator_id"]


# --- 1. accounts: zero to many principals, one name namespace ---------------------------------------------

async def test_accounts_are_separate_principals_sharing_one_name_namespace(app: App, tenants):
    alpha, beta = tenants
    async with operator(app) as ops, await signed_in(app, alpha.owner) as a, \
            await signed_in(app, beta.owner) as b:
        assert (await ops.call("platform.account.list"))["accounts"] == []
        news = await create_platform_account(ops, "  News  ", "Company news")
        alerts = await create_platform_account(ops, "Alerts", "Incidents")
        for account, name, description in ((news, "News", "Company news"), (alerts, "Alerts", "Incidents")):
            assert account["id"].startswith("psa_") and account["principal_id"] == account["id"]
            assert (account["name"], account["description"]) == (name, description)
            assert account["version"] == 1 and account["profile_version"] == 1
            assert account["provisioning_mode"] == "all_workspaces"
            assert account["created_by_operator_id"] == ops.operator_id
        assert news["id"] != alerts["id"]
        created = await ops.wait("platform_service_account.created", lambda d: d["platform_service_account_id"]
                                 == news["id"])
        assert created == {"platform_service_account_id": news["id"], "version": 1, "name": "News"}
        listed = (await ops.call("platform.account.list"))["accounts"]
        assert sorted(x["id"] for x in listed) == sorted([news["id"], alerts["id"]])

        # A platform name is taken in the platform (ignoring case and spaces) …
        await expect_reason("conflict", "name_taken", ops.call("platform.account.create", name="NEWS "))
        # … and in every workspace.
        for conn, tenant in ((a, alpha), (b, beta)):
            await expect_reason("conflict", "name_taken", submit(conn, ws_of(tenant), "news"))
        # A workspace account's name blocks a platform account the other way round.
        local = (await create_ready(await Feed.open(b, ws_of(beta)), "Payroll"))["account"]["profile"]
        await expect_reason("conflict", "name_taken", ops.call("platform.account.create", name="payroll"))
        await expect_reason("conflict", "name_taken", ops.call(
            "platform.account.update", platform_service_account_id=alerts["id"],
            expected_version=(await get_account(ops, alerts["id"]))["version"], name="PAYROLL"))

        # Each account keeps its own audit trail.
        for account in (news, alerts):
            events = (await ops.call("platform.audit.list", platform_service_account_id=account["id"]))["events"]
            assert events and {e["platform_service_account_id"] for e in events} == {account["id"]}
            assert any(e["subject_id"] == account["id"] and "create" in e["action"] for e in events)

        # Deleting the platform account frees its name everywhere.
        await ops.call("platform.account.delete", platform_service_account_id=news["id"],
                       expected_version=(await get_account(ops, news["id"]))["version"])
        taken = await submit(a, ws_of(alpha), "News")
        assert taken["authorization_path"] == "direct_create" and taken["created_service_account_id"]
        # Deleting the workspace account frees its name for the platform.
        account = await b.call("service_account.get", service_account_id=local["service_account_id"], **ws_of(beta))
        await b.call("service_account.delete", service_account_id=local["service_account_id"],
                     expected_version=account["version"], **ws_of(beta))
        payroll = await create_platform_account(ops, "Payroll")
        assert payroll["id"] not in (news["id"], alerts["id"])


async def test_provisioning_beside_a_workspace_create_only_reads_the_shared_registrations(app: App, tenants):
    """A platform account's provisioning locks workspace after workspace in one transaction; a
    workspace's own create runs beside it.  Neither writes the shared Service Actor registrations
    (schema version 11 registered them), so neither can wait on the other's uncommitted one."""
    _, beta = tenants
    async with trio.open_nursery() as nursery:
        # Writes to either table wait behind this lock; reads and foreign-key checks do not.
        await hold_table_lock(app.db, nursery, "service_definitions, service_capabilities", mode="SHARE")
        async with operator(app) as ops, await signed_in(app, beta.owner) as b:
            with trio.fail_after(EVENT_TIMEOUT):
                account = await create_platform_account(ops, "News")
                await create_ready(await Feed.open(b, ws_of(beta)), "Payroll")
                await wait_ready(ops, account["id"])
        await release_locks(app.db)


# --- 2. provisioning: every workspace, now and later ------------------------------------------------------

async def test_an_account_is_provisioned_into_every_workspace_including_later_ones(app: App, tenants,
                                                                                   member_password_hash):
    alpha, beta = tenants
    for name in ("ann", "ben"):
        await add_person(app.db, alpha.workspace_id, f"{name}@example.com", "developer", member_password_hash)
    async with operator(app) as ops, await signed_in(app, alpha.owner) as a, \
            await signed_in(app, beta.owner) as b:
        gamma = await a.call("workspace.create", name="Gamma", slug="gamma")
        # Alpha's audience: its 3 active humans — not an agent, not a removed human.
        await a.call("agent.create", handle="helper", display_name="Helper", **ws_of(alpha))
        gone = await add_person(app.db, alpha.workspace_id, "gone@example.com", "developer", member_password_hash)
        await a.call("member.remove", member_id=gone.member_id, **ws_of(alpha))
        humans = {alpha.workspace_id: 3, beta.workspace_id: 1, gamma["id"]: 1}
        account = await create_platform_account(ops, "News")
        assert account["provisioning"]["state"] == "provisioning"
        ready = await wait_ready(ops, account["id"])
        provisioning = ready["provisioning"]
        assert provisioning["instances"] == provisioning["instances_ready"] == 3
        assert provisioning["applied_provisioning_generation"] == provisioning["target_provisioning_generation"] \
            == provisioning["deployment_generation"]
        first = await instances(ops, account["id"])
        assert [i["workspace_id"] for i in first] == sorted(humans)
        # Existing workspaces are first covered by the account's own generation.
        generation = {i["opened_provisioning_generation"] for i in first}
        assert len(generation) == 1 and 1 <= generation.pop() <= provisioning["deployment_generation"]
        assert all(i["provisioning_state"] == "ready" and i["effective_from_broadcast_seq"] == 1
                   and i["last_applied_broadcast_seq"] == 0 and "effective_to_broadcast_seq" not in i
                   and i["applied_profile_version"] == 1 for i in first)

        # Each workspace has its own local account with the platform principal, audience = its active humans, …
        for instance in first:
            conn = b if instance["workspace_id"] == beta.workspace_id else a
            ws = {"workspace_id": instance["workspace_id"]}
            profile = await local_account(conn, instance["workspace_id"], account["id"])
            assert profile["service_account_id"] == instance["local_service_account_id"]
            assert profile["scope_id"] == instance["scope_id"] and profile["display_name"] == "News"
            detail = await conn.call("service_account.get", service_account_id=profile["service_account_id"], **ws)
            governance = detail["governance"]
            assert governance["management_kind"] == "platform" and governance["managers"] == []
            audience = await conn.call("service_account.audience.get",
                                       service_account_id=profile["service_account_id"], **ws)
            assert audience["state"] == "ready" and audience["member_count"] == humans[instance["workspace_id"]]
            # … and read-only to the workspace, even to its owner.
            sa = {"service_account_id": profile["service_account_id"], **ws}
            await expect_reason("forbidden", "platform_managed", conn.call(
                "service_account.update", expected_version=detail["version"], name="Mine", **sa))
            await expect_reason("forbidden", "platform_managed", conn.call(
                "service_account.delete", expected_version=detail["version"], **sa))
            owner_member = alpha.owner.member_id if conn is a else beta.owner.member_id
            if instance["workspace_id"] == gamma["id"]:
                owner_member = gamma["member_id"]
            await expect_reason("forbidden", "platform_managed", conn.call(
                "service_account.managers.add", member_id=owner_member, **sa))

        # Every identity row is the workspace's own (§9.3): account, installation, members, grant, binding, scope.
        rows = await app.db.run(lambda c: c.fetch(
            "SELECT a.workspace_id, a.principal_id, a.management_kind, a.service_installation_id, "
            "a.service_member_id, a.author_member_id, a.message_scope_id, "
            "(SELECT count(*) FROM service_grants g WHERE g.service_installation_id = a.service_installation_id "
            " AND g.status = 'active') AS grants, "
            "(SELECT count(*) FROM service_target_bindings t WHERE t.service_installation_id = "
            " a.service_installation_id) AS bindings, "
            "(SELECT count(*) FROM service_account_managers m WHERE m.service_account_id = a.id) AS managers "
            "FROM service_accounts a WHERE a.platform_service_account_id = $1 ORDER BY a.workspace_id",
            account["id"]))
        assert [r["workspace_id"] for r in rows] == sorted(humans)
        assert {(r["principal_id"], r["management_kind"]) for r in rows} == {(account["id"], "platform")}
        for column in ("service_installation_id", "service_member_id", "author_member_id", "message_scope_id"):
            assert len({r[column] for r in rows}) == 3, column
        assert all((r["grants"], r["bindings"], r["managers"]) == (1, 1, 0) for r in rows)

        # A workspace created later gets its instance too, from a later generation.
        delta = await b.call("workspace.create", name="Delta", slug="delta")
        # The instance opens (identity_ready); the account is ready again once its audience is.
        opened = await ops.wait("platform_service_account.instance_changed", lambda d: d["workspace_id"]
                                == delta["id"] and d["platform_service_account_id"] == account["id"])
        assert opened["provisioning_state"] == "identity_ready"
        again = await wait_ready(ops, account["id"])
        assert again["provisioning"]["instances_ready"] == 4
        assert again["provisioning"]["target_provisioning_generation"] > provisioning["target_provisioning_generation"]
        later = {i["workspace_id"]: i for i in await instances(ops, account["id"])}[delta["id"]]
        # Each instance's announcements come in the order its states were reached.
        await ops.drain()
        for workspace_id in (*humans, delta["id"]):
            assert [d["provisioning_state"] for d in ops.named(
                "platform_service_account.instance_changed", lambda d: d["workspace_id"] == workspace_id
                and d["platform_service_account_id"] == account["id"])] == ["identity_ready", "ready"], workspace_id
        assert later["opened_provisioning_generation"] > first[0]["opened_provisioning_generation"]
        profile = await local_account(b, delta["id"], account["id"])
        assert profile is not None and profile["principal_id"] == account["id"]
        assert profile["service_account_id"] == later["local_service_account_id"]


@pytest.mark.parametrize("server_config", [{"node_lease_seconds": 600.0}], indirect=True)
async def test_what_was_notified_while_the_platform_listen_was_down_is_made_up_for_when_it_is_back(
        app: App, tenants):
    """A NOTIFY sent while the node's platform LISTEN connection is down is lost: once it is back the
    node looks at every account as a '*' (a workspace created) makes it do, and claims an account no
    actor runs — not only at its periodic pass (every 200 s here)."""
    listen = f'LISTEN "{PLATFORM_CHANNEL}"'
    # The node opens its LISTEN after it reports started, and no event tells when: its backend is
    # looked for until it is there.
    with trio.fail_after(10):
        while (listener := await app.db.run(lambda c: c.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query = $1", listen))) is None:
            await trio.sleep(0.05)
    async with operator(app, "ops") as ops:
        # Written as another process would: its NOTIFY names the account, which wakes its actor only
        # where one runs, and none does.
        row = await app.db.transaction(platform_store.create_account, name="Late news", description="",
                                       operator_id=ops.operator_id, correlation_id="c-late")
        assert app.server.platform.active == 0
        await app.db.run(lambda c: c.execute("SELECT pg_terminate_backend($1)", listener))
        with trio.fail_after(10):
            account = await wait_ready(ops, row["id"])
        assert account["provisioning"]["instances_ready"] == len(tenants)
        assert app.server.platform.active == 1


# --- profile: expected version and propagation ------------------------------------------------------------

async def test_profile_updates_check_the_version_and_reach_every_instance(app: App, tenants):
    alpha, beta = tenants
    async with operator(app) as ops, await signed_in(app, alpha.owner) as a, \
            await signed_in(app, beta.owner) as b:
        feeds = {alpha.workspace_id: await Feed.open(a, ws_of(alpha)),
                 beta.workspace_id: await Feed.open(b, ws_of(beta))}
        account = await create_platform_account(ops, "News", "old")
        await wait_ready(ops, account["id"])
        local_ids = {i["workspace_id"]: i["local_service_account_id"] for i in await instances(ops, account["id"])}
        before = {ws: await feeds[ws].conn.call("service_account.get", service_account_id=local_ids[ws],
                                                workspace_id=ws) for ws in local_ids}

        target = {"platform_service_account_id": account["id"]}
        await expect_reason("conflict", "version_mismatch", ops.call(
            "platform.account.update", expected_version=account["version"] + 1, name="Headlines", **target))
        updated = await ops.call("platform.account.update", expected_version=account["version"], name="Headlines",
                                 description="new", **target)
        assert (updated["name"], updated["description"]) == ("Headlines", "new")
        assert updated["version"] == account["version"] + 1
        assert updated["profile_version"] == account["profile_version"] + 1
        await ops.wait("platform_service_account.updated", lambda d: d["platform_service_account_id"]
                       == account["id"] and d["name"] == "Headlines")
        # The old version is stale now.
        await expect_reason("conflict", "version_mismatch", ops.call(
            "platform.account.update", expected_version=account["version"], description="x", **target))

        # Every workspace sees the new profile on its local account.
        for ws, local_id in local_ids.items():
            await feeds[ws].wait("service_account.updated", lambda d: d["service_account_id"] == local_id
                                 and d["name"] == "Headlines")
            detail = await feeds[ws].conn.call("service_account.get", service_account_id=local_id, workspace_id=ws)
            profile = detail["profile"]
            assert (profile["display_name"], profile["description"]) == ("Headlines", "new")
            assert profile["principal_id"] == account["id"]
            assert profile["profile_version"] > before[ws]["profile"]["profile_version"]
        assert all(i["applied_profile_version"] == updated["profile_version"]
                   for i in await instances(ops, account["id"]))
        # The old name is free; the new one is taken.
        await expect_reason("conflict", "name_taken", submit(a, ws_of(alpha), "headlines"))
        assert (await submit(a, ws_of(alpha), "News"))["authorization_path"] == "direct_create"


# --- 5. delete: version, cascade, audit ----------------------------------------------------------------------

async def test_delete_removes_every_instance_scope_and_message_and_keeps_the_audit(app: App, tenants):
    alpha, beta = tenants
    async with operator(app) as ops, await signed_in(app, alpha.owner) as a, \
            await signed_in(app, beta.owner) as b:
        account = await create_platform_account(ops, "News")
        await wait_ready(ops, account["id"])
        sent = await broadcast(ops, account["id"], "b-1", title="Hello", content="everyone")
        done = await wait_broadcast_done(ops, sent["id"])
        assert done["state"] == "completed" and done["targets"]["delivered"] == 2
        message_ids = []
        for conn, tenant in ((a, alpha), (b, beta)):
            messages = await conversation_messages(conn, tenant.workspace_id, account["id"])
            assert [m["content"] for m in messages] == ["everyone"]
            message_ids.append(messages[0]["id"])

        rows = await app.db.run(lambda c: c.fetch(
            "SELECT a.id, a.service_installation_id, a.service_member_id, a.author_member_id, a.message_scope_id, "
            "i.id AS instance_id FROM service_accounts a JOIN platform_service_account_workspace_instances i "
            "ON i.local_service_account_id = a.id WHERE a.platform_service_account_id = $1", account["id"]))
        local_ids = {i["workspace_id"]: i["local_service_account_id"] for i in await instances(ops, account["id"])}
        deliveries = (await ops.call("platform.broadcast.deliveries", broadcast_id=sent["id"]))["deliveries"]
        doomed = [account["id"], sent["id"], *message_ids, *(d["id"] for d in deliveries),
                  *(value for row in rows for value in row.values())]
        assert len(rows) == 2 and len(deliveries) == 2
        assert await text_columns_naming(app.db, doomed, skip_tables=AUDIT_TABLES)

        current = await get_account(ops, account["id"])
        target = {"platform_service_account_id": account["id"]}
        await expect_reason("conflict", "version_mismatch", ops.call(
            "platform.account.delete", expected_version=current["version"] + 1, **target))
        await ops.call("platform.account.delete", expected_version=current["version"], **target)
        gone = await ops.wait("platform_service_account.deleted", lambda d: d["platform_service_account_id"]
                              == account["id"])
        assert gone["name"] == "News"

        # Not one row outside the audits still names the account, its instances, scopes, messages or broadcast.
        assert await text_columns_naming(app.db, doomed, skip_tables=AUDIT_TABLES) == {}
        for conn, tenant in ((a, alpha), (b, beta)):
            assert await local_account(conn, tenant.workspace_id, account["id"]) is None
            local_id = local_ids[tenant.workspace_id]
            await expect_error("not_found", conn.call("service_account.get", service_account_id=local_id,
                                                      **ws_of(tenant)))
        await expect_error("not_found", a.call("message.get", message_id=message_ids[0], **ws_of(alpha)))

        # The platform answers not_found; the audit keeps the delete with its subject and version.
        for op, fields in (("platform.account.get", target), ("platform.account.instances", target),
                           ("platform.broadcast.get", {"broadcast_id": sent["id"]}),
                           ("platform.account.delete", {"expected_version": current["version"], **target})):
            await expect_error("not_found", ops.call(op, **fields))
        events = (await ops.call("platform.audit.list", **target))["events"]
        deletion = [e for e in events if e["subject_id"] == account["id"] and "delete" in e["action"]]
        assert len(deletion) == 1
        assert deletion[0]["subject_version"] == current["version"]
        assert deletion[0]["operator_id"] == ops.operator_id

        # The name is free again, in the platform and in the workspaces.
        assert (await submit(a, ws_of(alpha), "News"))["authorization_path"] == "direct_create"
        await expect_reason("conflict", "name_taken", ops.call("platform.account.create", name="news"))
        again = await create_platform_account(ops, "Newsroom")
        assert again["id"] != account["id"]


async def test_a_delete_is_answered_when_the_actor_finds_the_account_gone_first(app: App, tenants, monkeypatch):
    """The actor's own pass can see the deleted row before the delete command has answered (the
    commit and the reply are not one step): the operator still gets the reply, not a wait forever."""
    advance_ended = trio.Event()
    advance_loop = pa.PlatformAccountActor._advance_loop

    async def advance_loop_then_tell(self):
        try:
            await advance_loop(self)
        finally:
            advance_ended.set()

    async def delete_then_let_the_pass_run_first(self, command):  # _delete, with the pass run in between
        result = await self.db.transaction(platform_store.delete_account, self.account_id, command.expected_version,
                                           command.operator_id, command.correlation_id)
        self.wake()
        await advance_ended.wait()  # the pass met the missing row and ended
        await trio.sleep(0)  # a checkpoint still inside the handler, like the bridge's hand-over
        self.deleted = True
        return result

    monkeypatch.setattr(pa.PlatformAccountActor, "_advance_loop", advance_loop_then_tell)
    monkeypatch.setattr(pa.PlatformAccountActor, "_delete", delete_then_let_the_pass_run_first)
    async with operator(app) as ops:
        account = await create_platform_account(ops, "News")
        await wait_ready(ops, account["id"])
        current = await get_account(ops, account["id"])
        with trio.fail_after(30):
            assert await ops.call("platform.account.delete", platform_service_account_id=account["id"],
                                  expected_version=current["version"]) == {"ok": True}
        await expect_error("not_found", ops.call("platform.account.get", platform_service_account_id=account["id"]))


# --- bad input: typed errors, never internal ----------------------------------------------------------------

async def test_bad_platform_input_gets_typed_errors_and_writes_nothing(app: App, tenants):
    async with operator(app) as ops:
        account = await create_platform_account(ops, "News")
        unknown = {"platform_service_account_id": "psa_" + "0" * 26}
        checks = [
            ("not_found", "platform.account.get", unknown),
            ("not_found", "platform.account.get", {"platform_service_account_id": tenants[0].workspace_id}),
            ("not_found", "platform.account.instances", unknown),
            ("not_found", "platform.account.update", {"expected_version": 1, "name": "X", **unknown}),
            ("not_found", "platform.account.delete", {"expected_version": 1, **unknown}),
            ("not_found", "platform.broadcast.get", {"broadcast_id": "pbc_nope"}),
            ("not_found", "platform.broadcast.list", unknown),
            ("bad_frame", "platform.account.get", {"platform_service_account_id": ""}),
            ("bad_frame", "platform.account.get", {"platform_service_account_id": "p" * 65}),
            ("bad_frame", "platform.account.get", {"platform_service_account_id": 7}),
            ("bad_frame", "platform.account.get", {}),
            ("bad_frame", "platform.account.create", {"name": "n" * 81}),
            ("bad_frame", "platform.account.create", {"name": ""}),
            ("bad_frame", "platform.account.create", {"name": "ok", "description": "d" * 1001}),
            ("bad_frame", "platform.account.create", {"name": ["News"]}),
            ("bad_frame", "platform.account.update", {"platform_service_account_id": account["id"],
                                                      "expected_version": 0, "name": "X"}),
            ("bad_frame", "platform.account.list", {"limit": 0}),
            ("bad_frame", "platform.account.list", {"limit": 201}),
        ]
        for code, op, fields in checks:
            error = await expect_error(code, ops.call(op, **fields))
            assert error.code != "internal"
        # A blank name (after trimming) and a malformed cursor are well-typed but invalid.
        for fields in ({"name": "   "}, {"name": "\u202eNews"}):
            await expect_error("invalid", ops.call("platform.account.create", **fields))
        await expect_reason("invalid", "bad_cursor", ops.call("platform.account.list", cursor="not-a-cursor"))
        await expect_reason("invalid", "bad_cursor", ops.call(
            "platform.account.instances", platform_service_account_id=account["id"], cursor="@@@"))
        # Nothing was written by any of them.
        assert [x["id"] for x in (await ops.call("platform.account.list"))["accounts"]] == [account["id"]]
        assert (await get_account(ops, account["id"]))["version"] == 1
