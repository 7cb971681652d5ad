"""The one readable predicate (SPEC rule 6; scope-model.md §3.9), in SQL.

`message_visibility_sql(m, viewer)` is a text expression: NULL when `viewer`
may not read message `m`, else its visibility reason, followed by ':' and the
grant or collaborator id when one made it readable ('grant:grt_…').

- A public member (open membership with visibility 'public', member active)
  reads every message of the scope: 'membership'.
- A private member (a private agent, owner O) reads a message of the scope only
  inside one of its own membership intervals, and only when the author is the
  agent itself ('own_output'), O ('owner'), another private agent of O inside
  its own private interval ('same_owner_agent'), or a member inside one of O's
  grant ('grant') or People collaborator ('collaborator') windows on the
  scope's chain (the scope, and for a thread or a task its parent channel —
  the board's, for a task; never a sibling).  A window covers a message by
  workspace_global_seq, and an expiring one only while created_at < expires_at:
  revocation and expiry are never retroactive in either direction.
- A private agent also reads, in any scope, the source of an owner_quote that
  its owner wrote inside the agent's interval of the quote's scope
  ('source_ref').

COALESCE and CASE evaluate lazily, so a public member pays one index probe per
row and nothing of the private branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from storage.visibility.tasks import task_open_to_agents_sql, task_reader_sql, task_readers

# A member whose membership is closed or who left the workspace reads nothing.
_ACTIVE = "EXISTS (SELECT 1 FROM members xm WHERE xm.workspace_id = {ms}.workspace_id AND xm.id = {ms}.member_id " \
          "AND xm.status = 'active')"


# The expiry sweep closes a window this long after it expired: by then every
# transaction that began before the expiry has committed, so the end seq it
# records is exact (a batch transaction lasts well under a second).
EXPIRY_SWEEP_MARGIN_SECONDS = 300

# A window closed by its expiry (not by a revoke, a removal or a leave): its
# recorded end seq is only the expiry sweep's pruning bound, and the exact test
# is created_at < expires_at — a message whose transaction began before the
# expiry may take its global seq after the sweep.
CLOSED_BY_EXPIRY = {
    "grant": "{row}.revoked_by_member_id IS NULL",
    "collaborator": "{row}.left_at IS NULL AND {row}.removed_at IS NULL",
}


async def fetch_custom_plan(conn: asyncpg.Connection, query: str, *args) -> list[asyncpg.Record]:
    """Run `query` as a statement of its own, planned for these arguments.
    asyncpg caches a prepared statement per query text, and after five runs
    PostgreSQL may switch it to one generic plan; for the queries whose best
    plan depends on the arguments (how wide a handle range, which search
    terms) that plan was measured 10-30x slower (bench/private_agents.py).
    An uncached statement is always planned for its arguments, for one more
    round trip."""
    statement = await conn.prepare(query)
    return await statement.fetch(*args)


async def fetch_generic_plan(conn: asyncpg.Connection, query: str, *args) -> list[asyncpg.Record]:
    """Run `query` with its cached generic plan.  The predicate makes a large statement:
    planned for each call's arguments it costs ~20 ms of planning (history, 5,000
    messages) against well under 1 ms to run, and PostgreSQL keeps planning it per call
    when a range it cannot bound (`seq > $n`) makes the generic plan look dearer than the
    custom ones — though that plan (the key index, then the page limit) is the one the
    custom plans pick too.  Forced generic, each pooled connection plans it once."""
    if conn.is_in_transaction():
        await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        rows = await conn.fetch(query, *args)
        await conn.execute("SET LOCAL plan_cache_mode = auto")
        return rows
    await conn.execute("BEGIN READ ONLY; SET LOCAL plan_cache_mode = force_generic_plan")  # one round trip
    try:
        rows = await conn.fetch(query, *args)
    except Exception:
        if not conn.is_closed():
            await conn.execute("ROLLBACK")
        raise  # cancelled, the pool's release rolls it back
    await conn.execute("COMMIT")
    return rows


async def readable_scope_sets(conn: asyncpg.Connection, workspace_id: str,
                              viewer: str) -> tuple[list[str], list[str]]:
    """The scopes `viewer` reads: (those it reads every message of — open public
    memberships, the task scopes of its board channels; those it reads message by
    message, through a private membership).  A narrowing for searches:
    message_visibility_sql still decides each message."""
    rows = await conn.fetch(
        f"SELECT rs.scope_id, rs.visibility FROM scope_memberships rs WHERE rs.workspace_id = $1 "
        f"AND rs.member_id = $2 AND rs.effective_to_seq IS NULL AND rs.visibility IN ('public', 'private') "
        f"AND {_ACTIVE.format(ms='rs')} "
        f"UNION ALL SELECT ts.id, 'public' FROM scopes ts WHERE ts.workspace_id = $1 AND ts.type = 'task' "
        f"AND ts.parent_scope_id IN (SELECT cm.scope_id FROM scope_memberships cm WHERE cm.workspace_id = $1 "
        f"AND cm.member_id = $2 AND cm.effective_to_seq IS NULL AND cm.visibility = 'public') "
        f"AND {task_reader_sql('ts.id', '$2')} IS NOT NULL",
        workspace_id, viewer)
    return ([r["scope_id"] for r in rows if r["visibility"] == "public"],
            [r["scope_id"] for r in rows if r["visibility"] == "private"])


def window_sql(row: str, message: str, kind: str) -> str:
    """Was `message` written inside the grant (kind 'grant') or People collaborator
    ('collaborator') window `row`?  By workspace_global_seq, and for an expiring
    window only while created_at < expires_at."""
    closed_by_expiry = CLOSED_BY_EXPIRY[kind].format(row=row)
    return (f"{message}.workspace_global_seq >= {row}.effective_from_global_seq "
            f"AND ({row}.effective_to_global_seq IS NULL OR {message}.workspace_global_seq <= {row}.effective_to_global_seq "
            f"OR ({closed_by_expiry})) "
            f"AND ({row}.expires_at IS NULL OR {message}.created_at < {row}.expires_at)")


def _chain(message: str) -> str:
    """The scope of `message` and, for a thread or task, its parent: where authority for it may come from."""
    return f"({message}.scope_id, (SELECT cs.parent_scope_id FROM scopes cs WHERE cs.id = {message}.scope_id))"


def private_entry_holds_sql(member: str, scope_id: str) -> str:
    """A private agent's membership of a thread or task grants reading only while it
    is a private member of the parent (scope-model §5.2: removal from the channel
    ends it), and of a task only while the task is open to agents (strand, board
    and channel agree and are active: SPEC §5 decision 11)."""
    return (f"NOT EXISTS (SELECT 1 FROM scopes ts WHERE ts.id = {scope_id} AND ts.parent_scope_id IS NOT NULL "
            f"AND (NOT EXISTS (SELECT 1 FROM scope_memberships tp WHERE tp.scope_id = ts.parent_scope_id "
            f"AND tp.member_id = {member} AND tp.effective_to_seq IS NULL AND tp.visibility = 'private') "
            f"OR (ts.type = 'task' AND NOT {task_open_to_agents_sql('ts.id')})))")


def _in_interval(member: str, message: str) -> str:
    return (f"EXISTS (SELECT 1 FROM scope_memberships iv WHERE iv.scope_id = {message}.scope_id "
            f"AND iv.member_id = {member} AND {message}.seq >= iv.effective_from_seq "
            f"AND (iv.effective_to_seq IS NULL OR {message}.seq <= iv.effective_to_seq))")


def author_authority_sql(message: str, owner: str) -> str:
    """Text 'grant:<id>' / 'collaborator:<id>' when `message`'s author wrote it inside
    one of `owner`'s windows on the message's chain, else NULL."""
    return (
        f"COALESCE((SELECT 'grant:' || g.id FROM scope_private_grants g WHERE g.scope_id IN {_chain(message)} "
        f"AND g.owner_member_id = {owner} AND g.grantee_member_id = {message}.author_member_id "
        f"AND {window_sql('g', message, 'grant')} ORDER BY g.created_at LIMIT 1), "
        f"(SELECT 'collaborator:' || p.id FROM scope_executions e JOIN task_scope_participant_metadata p "
        f"ON p.owner_scope_execution_id = e.id WHERE e.scope_id IN {_chain(message)} "
        f"AND e.owner_member_id = {owner} AND p.member_id = {message}.author_member_id "
        f"AND {window_sql('p', message, 'collaborator')} ORDER BY p.added_at LIMIT 1))"
    )


def _public_membership(scope_id: str, viewer: str) -> str:
    return (f"FROM scope_memberships pm WHERE pm.scope_id = {scope_id} AND pm.member_id = {viewer} "
            f"AND pm.effective_to_seq IS NULL AND pm.visibility = 'public' AND {_ACTIVE.format(ms='pm')}")


def public_reader_sql(scope_id: str, viewer: str) -> str:
    """SQL: does `viewer` hold an open public membership of the scope, as an active member?
    Then it reads every message of the scope, for the reason 'membership': the first
    branch of message_visibility_sql, which decides before any other."""
    return f"EXISTS (SELECT 1 {_public_membership(scope_id, viewer)})"


def message_visibility_sql(message: str = "m", viewer: str = "$2") -> str:
    public = f"(SELECT 'membership' {_public_membership(f'{message}.scope_id', viewer)})"
    private = (
        f"(SELECT CASE WHEN {message}.author_member_id = om.member_id THEN 'own_output' "
        f"WHEN {message}.author_member_id = om.owner_member_id THEN 'owner' "
        f"WHEN EXISTS (SELECT 1 FROM scope_memberships am WHERE am.scope_id = {message}.scope_id "
        f"AND am.member_id = {message}.author_member_id AND am.visibility = 'private' "
        f"AND am.owner_member_id = om.owner_member_id AND {message}.seq >= am.effective_from_seq "
        f"AND (am.effective_to_seq IS NULL OR {message}.seq <= am.effective_to_seq)) THEN 'same_owner_agent' "
        f"ELSE {author_authority_sql(message, 'om.owner_member_id')} END "
        f"FROM scope_memberships om WHERE om.scope_id = {message}.scope_id AND om.member_id = {viewer} "
        f"AND om.effective_to_seq IS NULL AND om.visibility = 'private' AND {_ACTIVE.format(ms='om')} "
        f"AND {_in_interval(viewer, message)} AND {private_entry_holds_sql(viewer, f'{message}.scope_id')})"
    )
    source = (
        f"(SELECT 'source_ref' FROM members vm WHERE vm.workspace_id = {message}.workspace_id AND vm.id = {viewer} "
        f"AND vm.kind = 'agent' AND vm.visibility = 'private' AND vm.status = 'active' AND EXISTS ("
        f"SELECT 1 FROM scope_message_sources src JOIN scope_messages q ON q.scope_id = src.target_scope_id "
        f"AND q.id = src.message_id JOIN scope_memberships qm ON qm.scope_id = q.scope_id AND qm.member_id = vm.id "
        f"AND qm.effective_to_seq IS NULL AND qm.visibility = 'private' "
        f"WHERE src.workspace_id = {message}.workspace_id AND src.source_message_id = {message}.id "
        f"AND src.source_kind = 'owner_quote' AND q.author_member_id = vm.owner_member_id "
        f"AND {_in_interval('vm.id', 'q')} AND {private_entry_holds_sql('vm.id', 'q.scope_id')}))"
    )
    # A task scope has no public memberships (its 'participant' rows are state only; a
    # private agent's admission is the private branch): its readers come from the board
    # channel, decided by the task authority.  Tried after the private branch, so a private
    # agent's reads elsewhere never pay for it.
    task = task_reader_sql(f"{message}.scope_id", viewer)
    return f"COALESCE({public}, {private}, {task}, {source})"


def readable_join(message: str = "m", viewer: str = "$2") -> str:
    """A join clause keeping only the rows of `message` that `viewer` may read;
    it names their reason `vis.visibility_reason` and the grant `vis.grant_id`."""
    return (f"CROSS JOIN LATERAL (SELECT split_part(v.value, ':', 1) AS visibility_reason, "
            f"nullif(split_part(v.value, ':', 2), '') AS grant_id FROM (SELECT "
            f"{message_visibility_sql(message, viewer)} AS value) v WHERE v.value IS NOT NULL) vis")


def message_readable_sql(message: str = "m", viewer: str = "$2") -> str:
    """SQL yielding the visibility reason (text) of `message` for `viewer`, or NULL."""
    return f"split_part({message_visibility_sql(message, viewer)}, ':', 1)"


def scope_readable_sql(scope: str = "s", viewer: str = "$2", *, by_id: bool = False) -> str:
    """SQL: may `viewer` use the scope `scope` at all (an open membership, public or
    private, of an active member)?  Which of its messages it reads is
    message_visibility_sql's question."""
    scope_id = scope if by_id else f"{scope}.id"
    return (f"(EXISTS (SELECT 1 FROM scope_memberships rv WHERE rv.scope_id = {scope_id} AND rv.member_id = {viewer} "
            f"AND rv.effective_to_seq IS NULL AND rv.visibility <> 'participant' AND {_ACTIVE.format(ms='rv')}) "
            f"OR {task_reader_sql(scope_id, viewer)} IS NOT NULL)")


# --- the fanout side ------------------------------------------------------------------------------

async def followers_entitled(conn: asyncpg.Connection, scope_id: str, from_seq: int, to_seq: int,
                             followers: list[str], readers_too: bool,
                             message_ids: list[str]) -> tuple[list[asyncpg.Record], list[str], dict[str, list[str]]]:
    """Another node committed messages `from_seq`..`to_seq` of the scope: each with
    the `followers` (this node's subscribed members) that may read it (`entitled`),
    by the one readable predicate; with `readers_too`, the followers that are public
    readers of the scope (for its other events); and for each of `message_ids` (events
    about a message: edits, reactions), the followers that may read that message.
    One statement per question, however many followers: the cross-node fanout's
    whole cost in the database."""
    rows: list[asyncpg.Record] = []
    if from_seq <= to_seq:
        # Only the scope's own readers are asked the predicate (a workspace feed follows
        # scopes its member is not in; locally those never get the scope's events either).
        rows = await conn.fetch(
            f"WITH readers AS (SELECT f FROM unnest($4::text[]) AS f WHERE {scope_readable_sql('$1', 'f', by_id=True)}) "
            f"SELECT m.*, ARRAY(SELECT f FROM readers WHERE {message_visibility_sql('m', 'f')} IS NOT NULL) "
            f"AS entitled FROM scope_messages m WHERE m.scope_id = $1 AND m.seq BETWEEN $2 AND $3 ORDER BY m.seq",
            scope_id, from_seq, to_seq, followers)
    readers: list[str] = []
    if readers_too:
        # Public readers only: which of a scope's events a private agent may have is the
        # sender's business (explicit audiences, or the message predicate above).
        readers = [r["f"] for r in await conn.fetch(
            f"SELECT f FROM unnest($2::text[]) AS f WHERE EXISTS (SELECT 1 FROM scope_memberships rv "
            f"WHERE rv.scope_id = $1 AND rv.member_id = f AND rv.effective_to_seq IS NULL "
            f"AND rv.visibility = 'public' AND {_ACTIVE.format(ms='rv')}) "
            f"OR {task_reader_sql('$1', 'f')} IS NOT NULL", scope_id, followers)]
    by_message: dict[str, list[str]] = {}
    if message_ids:
        for row in await conn.fetch(
                f"WITH readers AS (SELECT f FROM unnest($3::text[]) AS f "
                f"WHERE {scope_readable_sql('$1', 'f', by_id=True)}) "
                f"SELECT m.id, ARRAY(SELECT f FROM readers WHERE {message_visibility_sql('m', 'f')} IS NOT NULL) "
                f"AS entitled FROM scope_messages m WHERE m.scope_id = $1 AND m.id = ANY($2::text[])",
                scope_id, message_ids, followers):
            by_message[row["id"]] = list(row["entitled"])
    return rows, readers, by_message


async def entitled_for_message(conn: asyncpg.Connection, scope_id: str, message_id: str) -> frozenset[str]:
    """Who receives this message's events: the open public members, and the open
    private members who may read it (the outbox worker's replay); a task's readers too."""
    rows = await conn.fetch(
        f"SELECT r.member_id, r.visibility FROM scope_memberships r JOIN scope_messages m ON m.scope_id = r.scope_id "
        f"AND m.id = $2 "
        f"WHERE r.scope_id = $1 AND r.effective_to_seq IS NULL AND {_ACTIVE.format(ms='r')} "
        f"AND r.visibility <> 'participant' "
        f"AND (r.visibility = 'public' OR {message_visibility_sql('m', 'r.member_id')} IS NOT NULL)",
        scope_id, message_id,
    )
    entitled = frozenset(r["member_id"] for r in rows)
    if all(r["visibility"] == "private" for r in rows) and await conn.fetchval(
            "SELECT type = 'task' FROM scopes WHERE id = $1", scope_id):
        # A task's readers come from its board; its own rows are private admissions (above).
        return entitled | await task_readers(conn, scope_id)
    return entitled


# --- diagnostics ------------------------------------------------------------------------------------

async def explain_message(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                          message_id: str) -> asyncpg.Record | None:
    """Why `viewer` may (or may not) read the message: the reason and grant, the
    viewer's membership interval in the message's scope that contains it, the
    grant or collaborator window, and the quoted source for 'source_ref'.
    None when the message does not exist in the workspace."""
    return await conn.fetchrow(
        f"""
        SELECT m.id AS message_id, m.scope_id, m.seq, m.workspace_global_seq, m.author_member_id,
               split_part(v.value, ':', 1) AS reason, nullif(split_part(v.value, ':', 2), '') AS grant_id,
               iv.effective_from_seq, iv.effective_to_seq, iv.visibility AS membership_visibility,
               coalesce(g.scope_id, e.scope_id) AS window_scope_id,
               coalesce(g.effective_from_global_seq, p.effective_from_global_seq) AS window_from_global_seq,
               coalesce(g.effective_to_global_seq, p.effective_to_global_seq) AS window_to_global_seq,
               coalesce(g.expires_at, p.expires_at) AS window_expires_at,
               (SELECT src.message_id FROM scope_message_sources src
                  JOIN scope_messages q ON q.scope_id = src.target_scope_id AND q.id = src.message_id
                  JOIN members vm ON vm.workspace_id = q.workspace_id AND vm.id = $2
                  WHERE split_part(v.value, ':', 1) = 'source_ref'
                  AND src.workspace_id = m.workspace_id AND src.source_message_id = m.id
                  AND src.source_kind = 'owner_quote' AND q.author_member_id = vm.owner_member_id
                  AND {_in_interval('$2', 'q')} ORDER BY src.created_at LIMIT 1) AS quoted_by_message_id
        FROM scope_messages m
        CROSS JOIN LATERAL (SELECT {message_visibility_sql('m', '$2')} AS value) v
        LEFT JOIN scope_memberships iv ON iv.scope_id = m.scope_id AND iv.member_id = $2
             AND m.seq >= iv.effective_from_seq AND (iv.effective_to_seq IS NULL OR m.seq <= iv.effective_to_seq)
        LEFT JOIN scope_private_grants g ON split_part(v.value, ':', 1) = 'grant'
             AND g.id = nullif(split_part(v.value, ':', 2), '')
        LEFT JOIN task_scope_participant_metadata p ON split_part(v.value, ':', 1) = 'collaborator'
             AND p.id = nullif(split_part(v.value, ':', 2), '')
        LEFT JOIN scope_executions e ON e.id = p.owner_scope_execution_id
        WHERE m.workspace_id = $1 AND m.id = $3
        ORDER BY iv.effective_from_seq DESC NULLS LAST LIMIT 1
        """,
        workspace_id, viewer, message_id,
    )


# --- a private reader's history, without scanning what it cannot read -------------------------------

@dataclass(frozen=True)
class ReaderWindows:
    """A private reader's view of one scope, as index ranges: its own membership
    intervals (seq), and per author the ranges it may read them in — global-seq
    bounds and an expiry for grants and collaborators, seq bounds for another
    private agent of the same owner (its own intervals), none for the reader
    itself and its owner.  `floor` is the global seq of the reader's first
    message: nothing below it is read."""

    intervals: list[tuple[int, int | None]]
    windows: list[tuple[str, int | None, int | None, datetime | None, int | None, int | None]]
    floor: int


async def private_reader_windows(conn: asyncpg.Connection, scope_id: str, viewer: str) -> ReaderWindows | None:
    """None unless `viewer` is an open private member of the scope (an active
    agent; for a thread, still a private member of its parent).  The readable
    predicate's rules for this one scope as ranges, so history reads each range
    off scope_messages_scope_author_idx instead of scanning the scope: its cost
    follows what the agent reads, not the scope's size.  A window closed by its
    expiry is bounded by the end seq the expiry sweep recorded, EXPIRY_SWEEP_MARGIN
    after the expiry: no transaction that began before it is still numbering."""
    rows = await fetch_generic_plan(
        conn,
        f"""
        WITH reader AS (
            SELECT om.owner_member_id AS owner FROM scope_memberships om
             WHERE om.scope_id = $1 AND om.member_id = $2 AND om.effective_to_seq IS NULL
               AND om.visibility = 'private' AND {_ACTIVE.format(ms='om')} AND {private_entry_holds_sql('$2', '$1')}
        ), chain AS (
            SELECT $1::text AS id
            UNION ALL SELECT s.parent_scope_id FROM scopes s WHERE s.id = $1 AND s.parent_scope_id IS NOT NULL
        )
        SELECT 'interval' AS kind, $2::text AS author, NULL::bigint AS lo_g, NULL::bigint AS hi_g,
               NULL::timestamptz AS expires_at, iv.effective_from_seq AS lo_s, iv.effective_to_seq AS hi_s
          FROM scope_memberships iv, reader WHERE iv.scope_id = $1 AND iv.member_id = $2
        UNION ALL SELECT 'self', $2, NULL, NULL, NULL, NULL, NULL FROM reader
        UNION ALL SELECT 'owner', reader.owner, NULL, NULL, NULL, NULL, NULL FROM reader
        UNION ALL SELECT 'same_owner_agent', am.member_id, NULL, NULL, NULL, am.effective_from_seq, am.effective_to_seq
          FROM scope_memberships am, reader
         WHERE am.scope_id = $1 AND am.visibility = 'private' AND am.owner_member_id = reader.owner
           AND am.member_id <> $2
        UNION ALL SELECT 'grant', g.grantee_member_id, g.effective_from_global_seq, g.effective_to_global_seq,
                         g.expires_at, NULL, NULL
          FROM scope_private_grants g, reader
         WHERE g.scope_id IN (SELECT id FROM chain) AND g.owner_member_id = reader.owner
        UNION ALL SELECT 'collaborator', p.member_id, p.effective_from_global_seq, p.effective_to_global_seq,
                         p.expires_at, NULL, NULL
          FROM scope_executions e JOIN task_scope_participant_metadata p ON p.owner_scope_execution_id = e.id, reader
         WHERE e.scope_id IN (SELECT id FROM chain) AND e.owner_member_id = reader.owner
        -- Within a scope seq order is global-seq order: the floor is the global seq of the
        -- first message of the first interval, read off the (scope_id, seq) key.
        UNION ALL SELECT 'floor', NULL, (SELECT f.workspace_global_seq FROM scope_messages f WHERE f.scope_id = $1
                 AND f.seq >= (SELECT min(fv.effective_from_seq) FROM scope_memberships fv
                               WHERE fv.scope_id = $1 AND fv.member_id = $2) ORDER BY f.seq LIMIT 1),
               NULL, NULL, NULL, NULL FROM reader
        """,
        scope_id, viewer,
    )
    intervals = [(r["lo_s"], r["hi_s"]) for r in rows if r["kind"] == "interval"]
    if not intervals:
        return None
    floor = next((r["lo_g"] for r in rows if r["kind"] == "floor"), None)
    windows = [(r["author"], r["lo_g"], r["hi_g"], r["expires_at"], r["lo_s"], r["hi_s"])
               for r in rows if r["kind"] not in ("interval", "floor")]
    return ReaderWindows(intervals, windows, floor if floor is not None else 2**62)


def quoted_sources_sql(scope_id: str, viewer: str) -> str:
    """SQL selecting the messages of scope `scope_id` a private agent `viewer` reads as
    'source_ref': those its owner quoted (owner_quote) somewhere the agent reads the
    quote.  Explicit shares only, so the list stays short; history merges them with
    the per-author pages."""
    return (f"SELECT src.source_message_id FROM members vm JOIN scope_message_sources src "
            f"ON src.workspace_id = vm.workspace_id AND src.source_kind = 'owner_quote' "
            f"AND src.source_scope_id = {scope_id} "
            f"JOIN scope_messages q ON q.scope_id = src.target_scope_id AND q.id = src.message_id "
            f"AND q.author_member_id = vm.owner_member_id WHERE vm.id = {viewer} AND vm.kind = 'agent' "
            f"AND vm.visibility = 'private' AND {_in_interval('vm.id', 'q')}")
