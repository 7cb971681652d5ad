"""The readable predicate makes large statements: the reads that page through a scope or a
feed run with one cached generic plan per connection, never planned again for each call's
arguments (~20 ms of PostgreSQL planning each, on a scope with history).  A private agent's
history page is covered by bench/private_agents.py (its windows need a fixture of agents)."""

from __future__ import annotations

from storage import messages
from storage.visibility import deliveries as delivery_visibility
from tests.conftest import App
from tests.test_messaging import open_channel
from tests.test_tenancy import signed_in

CALLS = 8  # PostgreSQL plans a prepared statement for its arguments at least the first five times


async def test_history_feed_and_readable_reads_are_planned_once_per_connection(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "plans")
        sent = [await owner.call("message.send", scope_id=channel["id"], content=f"m{i}", **ws) for i in range(3)]
    viewer, scope_id, message_ids = alpha.owner.member_id, channel["id"], [m["id"] for m in sent]

    async def unit(conn):
        for _ in range(CALLS):
            assert len((await messages.history(conn, alpha.workspace_id, viewer, scope_id, before_seq=None,
                                               after_seq=0, limit=50))[0]) == 3
            assert len((await messages.history(conn, alpha.workspace_id, viewer, scope_id, before_seq=None,
                                               after_seq=None, limit=50))[0]) == 3
            assert len(await messages.workspace_feed(conn, alpha.workspace_id, viewer, 0, 50)) == 3
            assert len(await messages.readable_messages(conn, alpha.workspace_id, viewer, message_ids)) == 3
            assert len(await delivery_visibility.readable_messages(conn, viewer, message_ids)) == 3
        return await conn.fetch("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
                                "WHERE (statement LIKE '%FROM scope_messages m %' OR statement LIKE '%WITH reader AS%') "
                                "AND statement NOT LIKE '%pg_prepared_statements%'")

    statements = await app.db.run(unit)
    # The four reads, and the private-reader lookup every history call starts with.
    plans = sorted((s["generic_plans"], s["custom_plans"]) for s in statements)
    assert plans == [(CALLS, 0)] * 5 + [(2 * CALLS, 0)], [(s["statement"][:80], s["generic_plans"],
                                                              s["custom_plans"]) for s in statements]
