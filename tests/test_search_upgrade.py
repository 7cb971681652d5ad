"""Search after an upgrade (scope-model §3.16): a database that had messages before
version 7 gets its search state from the migration, and the backfill and finalize
steps (what `scopewire search backfill` / `finalize` run) make it ready."""

from __future__ import annotations

from storage import search
from storage.bridge import Database
from storage.migrations import migrate
from storage.schema import SCHEMA, Schema


async def _version_6_messages(conn) -> None:
    await conn.execute("INSERT INTO accounts (id, email_normalized, display_name) "
                       "VALUES ('acc_00000000000001', 'a@example.com', 'A')")
    await conn.execute("INSERT INTO workspaces (id, instance_id, name, slug, type, created_by_account_id) "
                       "VALUES ('wsp_00000000000001', 'i', 'W', 'w', 'team', 'acc_00000000000001')")
    await conn.execute("INSERT INTO members (id, workspace_id, kind, handle, display_name) "
                       "VALUES ('mem_00000000000001', 'wsp_00000000000001', 'service', 'svc', 'Svc')")
    await conn.execute("INSERT INTO scopes (id, workspace_id, type, latest_seq) VALUES "
                       "('scp_00000000000001', 'wsp_00000000000001', 'channel', 5), "
                       "('scp_00000000000002', 'wsp_00000000000001', 'channel', 0)")
    await conn.execute(
        "INSERT INTO scope_messages (id, workspace_id, scope_id, seq, workspace_global_seq, author_member_id, "
        "author_type, notify_principal_member_id, idempotency_subject_member_id, message_type, content, state, "
        "withdrawn_at, withdrawn_by_member_id) "
        "SELECT 'msg_0000000000000' || n, 'wsp_00000000000001', 'scp_00000000000001', n, n, 'mem_00000000000001', "
        "'service', 'mem_00000000000001', 'mem_00000000000001', 'text', '旧消息 old message ' || n, "
        "CASE WHEN n = 3 THEN 'withdrawn' ELSE 'visible' END, CASE WHEN n = 3 THEN now() END, "
        "CASE WHEN n = 3 THEN 'mem_00000000000001' END FROM generate_series(1, 5) AS n")


async def test_an_upgraded_scope_is_searchable_after_backfill_and_finalize(empty_database_dsn: str):
    six = Schema(tables=SCHEMA.tables, versions=SCHEMA.versions[:6], extensions=SCHEMA.extensions)
    async with Database(empty_database_dsn) as database:
        await database.run(migrate, six)
        await database.run(_version_6_messages)
        assert (await database.run(migrate))[0] == 7
        # Only the scope that had messages waits; an empty one is ready (indexed from its first message).
        pending = await database.run(search.pending_scopes, None)
        assert [r["scope_id"] for r in pending] == ["scp_00000000000001"]
        assert not await database.run(search.scope_search_ready, "scp_00000000000001")
        assert await database.run(search.scope_search_ready, "scp_00000000000002")
        # Finalize before the backfill refuses; the backfill resumes batch by batch.
        assert (await database.transaction(search.finalize_scope, "scp_00000000000001"))["reason"] == \
            "backfill_pending"
        batches = 0
        while not await database.transaction(search.backfill_batch, "scp_00000000000001", 2):
            batches += 1
        assert batches == 2
        docs = await database.run(lambda conn: conn.fetch(
            "SELECT message_id FROM scope_message_search_docs ORDER BY seq"))
        assert [r["message_id"] for r in docs] == [f"msg_0000000000000{n}" for n in (1, 2, 4, 5)]
        assert (await database.transaction(search.finalize_scope, "scp_00000000000001"))["read_ready"]
        assert await database.run(search.scope_search_ready, "scp_00000000000001")
        assert await database.run(search.workspace_search_complete, "wsp_00000000000001", "mem_00000000000001")
        # Both steps again: nothing changes, ready stays ready.
        assert await database.transaction(search.backfill_batch, "scp_00000000000001", 2)
        assert (await database.transaction(search.finalize_scope, "scp_00000000000001"))["read_ready"]
        status = await database.run(search.status, None)
        assert [(r["read_ready"], r["backfilled_docs"], r["docs"]) for r in status] == [(True, 4, 4)]


async def test_finalize_refuses_a_scope_missing_docs(empty_database_dsn: str):
    six = Schema(tables=SCHEMA.tables, versions=SCHEMA.versions[:6], extensions=SCHEMA.extensions)
    async with Database(empty_database_dsn) as database:
        await database.run(migrate, six)
        await database.run(_version_6_messages)
        await database.run(migrate)
        while not await database.transaction(search.backfill_batch, "scp_00000000000001", 10):
            pass
        await database.run(lambda conn: conn.execute(
            "DELETE FROM scope_message_search_docs WHERE message_id = 'msg_00000000000002'"))
        result = await database.transaction(search.finalize_scope, "scp_00000000000001")
        assert result == {"scope_id": "scp_00000000000001", "read_ready": False, "reason": "docs_missing",
                          "missing_docs": 1}
        assert not await database.run(search.scope_search_ready, "scp_00000000000001")


async def _pending_list_pages(conn, index: str) -> int:
    """Pages in the GIN index's pending list, read without moving it (pgstattuple)."""
    await conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    return await conn.fetchval("SELECT pending_pages FROM pgstatginindex($1::regclass)", index)


async def test_version_12_empties_the_search_pending_lists_and_writes_straight_into_the_indexes(
        empty_database_dsn: str):
    """A send's commit never moves a pending list into the index: from version 12 the search
    projection's GIN indexes have none (fastupdate off), and what an older database had queued
    is moved by the upgrade."""
    indexes = ("scope_message_search_docs_vector_idx", "scope_message_search_docs_mentions_idx")
    async with Database(empty_database_dsn) as database:
        await database.run(migrate, Schema(tables=SCHEMA.tables, versions=SCHEMA.versions[:6],
                                           extensions=SCHEMA.extensions))
        await database.run(_version_6_messages)
        await database.run(migrate, Schema(tables=SCHEMA.tables, versions=SCHEMA.versions[:11],
                                           extensions=SCHEMA.extensions))
        while not await database.transaction(search.backfill_batch, "scp_00000000000001", 10):
            pass
        assert [await database.run(_pending_list_pages, index) for index in indexes] == [1, 1]
        assert await database.run(migrate) == [12]
        options = await database.run(lambda conn: conn.fetch(
            "SELECT relname, reloptions FROM pg_class WHERE relname = ANY($1::text[]) ORDER BY relname",
            list(indexes)))
        assert [r["reloptions"] for r in options] == [["fastupdate=off"]] * 2
        assert [await database.run(_pending_list_pages, index) for index in indexes] == [0, 0]
        # New docs go straight into the indexes, and search finds them there.
        await database.run(lambda conn: conn.execute(
            "DELETE FROM scope_message_search_docs WHERE message_id = 'msg_00000000000004'"))
        await database.run(lambda conn: conn.execute(
            "UPDATE scope_message_search_state SET backfill_cursor_seq = 0, backfill_state = 'pending' "
            "WHERE scope_id = 'scp_00000000000001'"))
        while not await database.transaction(search.backfill_batch, "scp_00000000000001", 10):
            pass
        assert [await database.run(_pending_list_pages, index) for index in indexes] == [0, 0]
        found = await database.run(lambda conn: conn.fetchval(
            "SELECT count(*) FROM scope_message_search_docs WHERE search_vector @@ to_tsquery('simple', '4')"))
        assert found == 1
