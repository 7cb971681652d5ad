"""One schema definition: bootstrap = migrate, verify catches every kind of drift."""

import json

import asyncpg
import pytest

from storage.bridge import Database
from storage.migrations import applied_version, migrate, verify
from storage.schema import SCHEMA
from storage.schema_dsl import Column, Index, Schema, Table, Version


def test_definition_is_well_formed():
    SCHEMA.validate()


def test_every_tenant_table_has_a_non_null_workspace_id():
    # Deployment-level by the seeds: the shared Service Actor product registrations and the name
    # namespace that serializes workspace and platform service-account names (service-account §2.1, §2.4);
    # the platform control plane: operators, platform accounts, provisioning inputs, broadcasts, the
    # moderation log, the platform audit and the operators' broadcast assets (§2.4, §4.5); the deployment's own machinery: nodes, scope
    # and platform account ownership leases and the bus spill (no tenant data).  Rows naming one workspace carry its id.
    global_tables = {"instance_metadata", "accounts", "local_credentials", "workspaces", "service_definitions",
                     "service_capabilities", "service_account_name_namespaces", "platform_operators",
                     "platform_operator_keys", "platform_service_accounts",
                     "platform_service_account_provisioning_inputs", "platform_service_account_broadcasts",
                     "platform_moderation_logs", "platform_service_account_audit_events",
                     "platform_service_account_assets",
                     "cluster_nodes", "scope_leases", "cluster_bus_spill", "platform_account_leases"}
    for table in SCHEMA.tables:
        if table.name in global_tables:
            continue
        workspace_columns = [c for c in table.columns if c.name in ("workspace_id",)]
        assert workspace_columns, table.name
        assert not workspace_columns[0].nullable, table.name


async def test_migrated_database_has_no_drift(db: Database):
    assert await db.run(verify) == []
    assert await db.run(applied_version) == SCHEMA.latest_version


async def test_bootstrap_of_empty_database_then_idempotent(empty_database_dsn: str):
    async with Database(empty_database_dsn) as database:
        assert await database.run(migrate) == [v.number for v in SCHEMA.versions]
        assert await database.run(migrate) == []
        assert await database.run(verify) == []


@pytest.mark.parametrize(
    "sabotage, expected_fragment",
    [
        ("ALTER TABLE scopes ALTER COLUMN latest_seq DROP NOT NULL", "column scopes.latest_seq differs"),
        ("ALTER TABLE scopes ALTER COLUMN latest_seq SET DEFAULT 7", "column scopes.latest_seq differs"),
        ("ALTER TABLE members ALTER COLUMN handle TYPE varchar(80)", "column members.handle differs"),
        ("ALTER TABLE members ADD COLUMN nickname text", "unexpected column members.nickname"),
        ("ALTER TABLE members DROP CONSTRAINT members_handle_form", "missing constraint members.members_handle_form"),
        ("DROP INDEX scopes_workspace_type_idx", "missing index scopes.scopes_workspace_type_idx"),
        ("CREATE INDEX extra_idx ON scope_messages (created_at)", "unexpected index scope_messages.extra_idx"),
        ("ALTER TABLE scope_messages DROP CONSTRAINT scope_messages_scope_seq_key",
         "missing constraint scope_messages.scope_messages_scope_seq_key"),
        ("ALTER TABLE api_keys DROP CONSTRAINT api_keys_member_fkey", "missing constraint api_keys.api_keys_member_fkey"),
        ("CREATE TABLE stray (id int)", "unexpected table stray"),
        ("DROP TABLE conversation_member_states", "missing table conversation_member_states"),
        ("DELETE FROM schema_migrations", "schema version"),
        ("ALTER INDEX scope_message_search_docs_vector_idx SET (fastupdate = on)",
         "index scope_message_search_docs.scope_message_search_docs_vector_idx differs"),
    ],
)
async def test_verify_reports_each_kind_of_drift(db: Database, sabotage: str, expected_fragment: str):
    await db.run(lambda conn: conn.execute(sabotage))
    drifts = [str(d) for d in await db.run(verify)]
    assert any(expected_fragment in d for d in drifts), drifts


async def test_later_versions_are_derived_from_the_definition(empty_database_dsn: str):
    """A column and index added in version 2 migrate a version-1 database to
    exactly what bootstrap of version 2 builds."""
    v1 = Schema(
        tables=(Table("things", (Column("id", "text"), Column("b", "int", since=2)), ("id",),
                      indexes=(Index("things_b_idx", "b", since=2),
                               Index("things_id_idx", "id", storage=(("fillfactor", "70"),), storage_since=2))),
                Table("later", (Column("id", "text"),), ("id",), since=2)),
        versions=(Version(1, "one"),),
    )
    v2 = Schema(tables=v1.tables, versions=(Version(1, "one"), Version(2, "two", after=("SELECT 1",))))
    # v1 only knows version 1: elements with since=2 are not rendered.
    assert all("b int" not in s and "later" not in s for s in v1.statements_for(1))
    async with Database(empty_database_dsn) as database:
        assert await database.run(migrate, v1) == [1]
        assert await database.run(migrate, v2) == [2]
        assert await database.run(verify, v2) == []
        cols = await database.run(lambda c: c.fetch("SELECT column_name FROM information_schema.columns "
                                                     "WHERE table_name = 'things' ORDER BY 1"))
        assert [r[0] for r in cols] == ["b", "id"]
        # The storage parameter set by version 2 on an index version 1 built.
        options = await database.run(lambda c: c.fetchval(
            "SELECT reloptions FROM pg_class WHERE relname = 'things_id_idx'"))
        assert options == ["fillfactor=70"]
    assert not any("fillfactor" in s for s in v1.statements_for(1))
    assert "ALTER INDEX things_id_idx SET (fillfactor = 70)" in v2.statements_for(2)


async def test_constraints_hold_in_the_database(db: Database):
    """Spot-check that the definition's checks and composite keys are live."""
    with pytest.raises(asyncpg.CheckViolationError):
        await db.run(lambda c: c.execute(
            "INSERT INTO accounts (id, email_normalized, display_name) VALUES ('bad', 'a@b.c', 'A')"))
    with pytest.raises(asyncpg.CheckViolationError):
        await db.run(lambda c: c.execute(
            "INSERT INTO accounts (id, email_normalized, display_name) VALUES ('acc_00000000000000', 'A@B.C', 'A')"))


async def test_a_version_1_database_migrates_to_the_current_schema(empty_database_dsn: str):
    """Existing installations upgrade in place: the real version-1 schema, then
    every later version, ends exactly where a fresh bootstrap does."""
    first = Schema(tables=SCHEMA.tables, versions=SCHEMA.versions[:1], extensions=SCHEMA.extensions)
    async with Database(empty_database_dsn) as database:
        assert await database.run(migrate, first) == [1]
        assert await database.run(migrate) == [v.number for v in SCHEMA.versions[1:]]
        assert await database.run(verify) == []


async def test_version_2_moves_legacy_client_routing_keys_aside(empty_database_dsn: str):
    """Keys the server writes from version 2 on (`recipients`, `quote`,
    `shared_by_member_id`) may sit in a version-1 client's metadata; the upgrade
    renames them so they can never act as routing facts."""
    first = Schema(tables=SCHEMA.tables, versions=SCHEMA.versions[:1], extensions=SCHEMA.extensions)

    async def legacy_message(conn) -> None:
        await conn.execute("INSERT INTO accounts (id, email_normalized, display_name) "
                           "VALUES ('acc_00000000000001', 'a@example.com', 'A')")
        await conn.execute("INSERT INTO workspaces (id, instance_id, name, slug, type, created_by_account_id) "
                           "VALUES ('wsp_00000000000001', 'i', 'W', 'w', 'team', 'acc_00000000000001')")
        await conn.execute("INSERT INTO members (id, workspace_id, kind, handle, display_name) "
                           "VALUES ('mem_00000000000001', 'wsp_00000000000001', 'service', 'svc', 'Svc')")
        await conn.execute("INSERT INTO scopes (id, workspace_id, type) VALUES ('scp_00000000000001', "
                           "'wsp_00000000000001', 'channel')")
        await conn.execute(
            "INSERT INTO scope_messages (id, workspace_id, scope_id, seq, workspace_global_seq, author_member_id, "
            "author_type, notify_principal_member_id, idempotency_subject_member_id, message_type, content, metadata) "
            "VALUES ('msg_00000000000001', 'wsp_00000000000001', 'scp_00000000000001', 1, 1, 'mem_00000000000001', "
            "'service', 'mem_00000000000001', 'mem_00000000000001', 'text', 'hi', "
            "'{\"recipients\": [\"mem_x\"], \"quote\": \"q\", \"keep\": 1}')")

    async with Database(empty_database_dsn) as database:
        await database.run(migrate, first)
        await database.run(legacy_message)
        await database.run(migrate)
        metadata = await database.run(lambda conn: conn.fetchval(
            "SELECT metadata::text FROM scope_messages WHERE id = 'msg_00000000000001'"))
        assert json.loads(metadata) == {"keep": 1, "client_recipients": ["mem_x"], "client_quote": "q"}


async def test_version_11_keeps_registrations_a_first_use_made(empty_database_dsn: str):
    """Before version 11 the two Service Actor registrations were inserted on first use, under
    ids of their own; the upgrade registers only what is missing and keeps what installations
    already point at."""
    ten = Schema(tables=SCHEMA.tables, versions=SCHEMA.versions[:10], extensions=SCHEMA.extensions)

    async def first_use(conn) -> None:
        await conn.execute("INSERT INTO service_definitions (id, service_kind, slug, installation_mode) "
                           "VALUES ('sdf_00000000000001', 'service_account', 'service-account', 'named_multi_instance')")
        await conn.execute("INSERT INTO service_capabilities (id, service_definition_id, capability, delivery_contract) "
                           "VALUES ('cap_00000000000001', 'sdf_00000000000001', 'message.write', "
                           "'service_account_message')")

    async with Database(empty_database_dsn) as database:
        await database.run(migrate, ten)
        await database.run(first_use)
        assert (await database.run(migrate))[0] == 11
        registered = await database.run(lambda conn: conn.fetch(
            "SELECT d.slug, d.id, c.id AS capability_id FROM service_definitions d "
            "JOIN service_capabilities c ON c.service_definition_id = d.id ORDER BY d.slug"))
        assert [tuple(r) for r in registered] == [("approvals", "sdf_approvalsapp00", "cap_approvalsapp00"),
                                                  ("service-account", "sdf_00000000000001", "cap_00000000000001")]
