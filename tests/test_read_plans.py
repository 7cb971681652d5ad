"""The readable predicate makes large statements: the reads that page through a scope or a
feed run with one cached generic plan per connection, never planned again for each call's
arguments (~20 ms of PostgreSQL planning each, on a scope with history); a public member's
history page leaves the predicate's other branches out altogether."""

from __future__ import annotations

from storage import messages
from storage.visibility import deliveries as delivery_visibility
from tests.conftest import App, add_person
from tests.test_messaging import open_channel
from tests.test_tenancy import signed_in

CALLS = 8  # PostgreSQL plans a prepared statement for its arguments at least the first five times
PREDICATE = "scope_private_grants"  # in the statement text: the predicate's grant branch


async def _plans(conn, pattern: str) -> list[tuple[int, int, bool]]:
    """(generic plans, custom plans, whether it holds the whole predicate) of the statements
    prepared on this connection whose text matches `pattern`."""
    rows = await conn.fetch("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
                            "WHERE statement LIKE $1 AND statement NOT LIKE '%pg_prepared_statements%'", pattern)
    return sorted((r["generic_plans"], r["custom_plans"], PREDICATE in r["statement"]) for r in rows)


async def test_history_feed_and_readable_reads_are_planned_once_per_connection(app: App, tenants,
                                                                               member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    outsider = await add_person(app.db, alpha.workspace_id, "out@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "plans")
        sent = [await owner.call("message.send", scope_id=channel["id"], content=f"m{i}", **ws) for i in range(3)]
    member, scope_id, message_ids = alpha.owner.member_id, channel["id"], [m["id"] for m in sent]

    async def unit(conn):
        for _ in range(CALLS):
            for viewer, count in ((member, 3), (outsider.member_id, 0)):  # the member; one it shows nothing
                for after_seq in (0, None):
                    rows, _ = await messages.history(conn, alpha.workspace_id, viewer, scope_id, before_seq=None,
                                                     after_seq=after_seq, limit=50)
                    assert len(rows) == count
            assert len(await messages.workspace_feed(conn, alpha.workspace_id, member, 0, 50)) == 3
            assert len(await messages.readable_messages(conn, alpha.workspace_id, member, message_ids)) == 3
            assert len(await delivery_visibility.readable_messages(conn, member, message_ids)) == 3
        return (await _plans(conn, "%FROM scope_messages m %"), await _plans(conn, "%WITH reader AS%"))

    pages, reader_lookup = await app.db.run(unit)
    # With the whole predicate: history both ways (for the outsider), the feed and the two
    # readable checks, each planned once; so is the private-reader lookup that a history
    # call makes when its viewer is not a public member (the outsider's).
    assert [(generic, custom) for generic, custom, whole in pages if whole] == [(CALLS, 0)] * 5
    assert [(generic, custom) for generic, custom, _ in reader_lookup] == [(2 * CALLS, 0)]
    # The public member's pages (both ways): no predicate beyond its membership, and PostgreSQL
    # settles on their generic plan after its first five.
    assert [(generic, custom) for generic, custom, whole in pages if not whole] == [(2 * CALLS - 5, 5)] * 2
