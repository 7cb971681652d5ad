"""Message search: the projection (scope_message_search_docs), its readiness
(scope_message_search_state) and the query.

The projection is written in the transaction that writes the message (send, edit,
withdraw: storage/applier.py calls in here), so a search never sees text its
message no longer has.  What a message is indexed as, and what a query asks for,
is domain/search_text.py's: words through the `simple` text search
configuration, unsegmented scripts as bigrams confirmed by substring.  Only
messages the readable predicate of history (storage/visibility) lets the viewer
read are ever examined or returned."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from domain.search_text import Item, ParsedQuery, Term, index_text
from storage import visibility
from storage.visibility import message_visibility_sql, scope_readable_sql

_DOC_COLUMNS = ("message_id, workspace_id, scope_id, seq, workspace_global_seq, author_member_id, created_at, "
                "has_attachment, mention_member_ids, search_text, search_vector")


@dataclass(frozen=True)
class SearchDoc:
    message_id: str
    workspace_id: str
    scope_id: str
    # None: numbered by the statement that inserts the message (see docs_insert's numbered_by).
    seq: int | None
    workspace_global_seq: int | None
    author_member_id: str
    created_at: datetime | None
    has_attachment: bool
    mention_member_ids: tuple[str, ...]
    text: str
    words: str
    runs: str


def doc_for(*, message_id: str, workspace_id: str, scope_id: str, seq: int | None, workspace_global_seq: int | None,
            author_member_id: str, created_at: datetime | None, content: str,
            metadata: dict[str, Any]) -> SearchDoc:
    """A visible message's search document: its content and attachment labels, its live
    mentions (server-computed metadata, never the client's)."""
    attachments = metadata.get("attachments") or []
    text, words, runs = index_text([content, *(a.get("label", "") for a in attachments)])
    return SearchDoc(message_id, workspace_id, scope_id, seq, workspace_global_seq, author_member_id, created_at,
                     bool(attachments), tuple(metadata.get("mentions") or ()), text, words, runs)


def doc_for_row(row: asyncpg.Record) -> SearchDoc:
    metadata = row["metadata"]
    return doc_for(message_id=row["id"], workspace_id=row["workspace_id"], scope_id=row["scope_id"], seq=row["seq"],
                   workspace_global_seq=row["workspace_global_seq"], author_member_id=row["author_member_id"],
                   created_at=row["created_at"], content=row["content"],
                   metadata=json.loads(metadata) if isinstance(metadata, str) else metadata)


def docs_insert(docs: list[SearchDoc], first: int, *, replace: bool,
                numbered_by: str | None = None) -> tuple[str, list[Any]]:
    """The insert of `docs` (replace: overwrite an existing doc — an edit; else keep it — the backfill
    meeting a doc the live path wrote), with its parameters numbered from `$first`, and its arguments:
    so a message's insert can carry its docs in the same statement.  `numbered_by` names a relation
    (i, s, g) of that statement giving each message id its seq and global seq (the docs' own are
    None), and the docs' created_at is then the transaction's time, as their messages'."""
    conflict = ("DO UPDATE SET has_attachment = EXCLUDED.has_attachment, mention_member_ids = "
                "EXCLUDED.mention_member_ids, search_text = EXCLUDED.search_text, "
                "search_vector = EXCLUDED.search_vector" if replace else "DO NOTHING")
    numbered = numbered_by is not None
    # (name in the unnest, element type, values); None: the statement computes it.
    columns = [
        ("i", "text", [d.message_id for d in docs]), ("w", "text", [d.workspace_id for d in docs]),
        ("s", "text", [d.scope_id for d in docs]),
        ("q", "bigint", None if numbered else [d.seq for d in docs]),
        ("g", "bigint", None if numbered else [d.workspace_global_seq for d in docs]),
        ("a", "text", [d.author_member_id for d in docs]),
        ("c", "timestamptz", None if numbered else [d.created_at for d in docs]),
        ("h", "boolean", [d.has_attachment for d in docs]),
        ("mm", "text", [" ".join(d.mention_member_ids) for d in docs]), ("tt", "text", [d.text for d in docs]),
        ("tw", "text", [d.words for d in docs]), ("tr", "text", [d.runs for d in docs])]
    given = [column for column in columns if column[2] is not None]
    seq, global_seq, created_at = ("numbered.s", "numbered.g", "now()") if numbered else ("t.q", "t.g", "t.c")
    sql = (f"INSERT INTO scope_message_search_docs ({_DOC_COLUMNS}) "
           f"SELECT t.i, t.w, t.s, {seq}, {global_seq}, t.a, {created_at}, t.h, "
           f"CASE WHEN t.mm = '' THEN '{{}}'::text[] ELSE string_to_array(t.mm, ' ') END, "
           f"t.tt, to_tsvector('simple', t.tw) || t.tr::tsvector "
           f"FROM unnest({', '.join(f'${first + k}::{kind}[]' for k, (_, kind, _) in enumerate(given))}) "
           f"AS t({', '.join(name for name, _, _ in given)})"
           f"{f' JOIN {numbered_by} numbered ON numbered.i = t.i' if numbered else ''} "
           f"ON CONFLICT (message_id) {conflict}")
    return sql, [values for _, _, values in given]


async def write_docs(conn: asyncpg.Connection, docs: list[SearchDoc], *, replace: bool) -> int:
    """Insert `docs` (see docs_insert).  Returns how many rows were written."""
    if not docs:
        return 0
    sql, args = docs_insert(docs, 1, replace=replace)
    result = await conn.execute(sql, *args)
    return int(result.rsplit(" ", 1)[-1])


async def delete_doc(conn: asyncpg.Connection, scope_id: str, message_id: str) -> None:
    await conn.execute("DELETE FROM scope_message_search_docs WHERE scope_id = $1 AND message_id = $2",
                       scope_id, message_id)


# --- the query ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SearchFilters:
    scope_id: str | None = None
    author_member_id: str | None = None
    after: datetime | None = None
    before: datetime | None = None
    has_attachment: bool | None = None
    mentions_me: bool = False


@dataclass(frozen=True)
class SearchResult:
    message_ids: list[str]           # readable messages, newest first, at most limit
    has_more: bool
    budget_exhausted: bool
    next_global_seq: int | None      # resume below this global seq


async def scope_search_ready(conn: asyncpg.Connection, scope_id: str) -> bool:
    return not await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM scope_message_search_state WHERE scope_id = $1 AND NOT read_ready)", scope_id)


async def workspace_search_complete(conn: asyncpg.Connection, workspace_id: str, viewer: str) -> bool:
    """No scope `viewer` uses is still waiting for its backfill (others stay unmentioned)."""
    return not await conn.fetchval(
        f"SELECT EXISTS (SELECT 1 FROM scope_message_search_state st WHERE st.workspace_id = $1 AND NOT st.read_ready "
        f"AND {scope_readable_sql('st.scope_id', '$2', by_id=True)})", workspace_id, viewer)


def _match_sql(query: ParsedQuery, param) -> list[str]:
    """The query as SQL conditions on d (a doc): every group, each an OR of its items."""
    def term_sql(term: Term) -> str:
        if term.unsegmented:
            # The GIN index finds docs with every bigram; strpos confirms the substring.
            return (f"(d.search_vector @@ {param(term.lexemes())}::tsquery "
                    f"AND strpos(d.search_text, {param(term.text)}) > 0)")
        return f"d.search_vector @@ websearch_to_tsquery('simple', {param(term.text)})"

    def item_sql(item: Item) -> str:
        matched = " AND ".join(term_sql(t) for t in item.terms)
        return f"NOT ({matched})" if item.negated else f"({matched})"
    return [f"({' OR '.join(item_sql(i) for i in group)})" for group in query.groups]


# A search first reads the newest docs in order, in windows of these sizes: a common term
# fills its page there at once, where the full-text index would fetch every match to
# sort them.  What is left goes through the full-text index.
RECENT_WINDOWS = (1000, 16000)


async def search(conn: asyncpg.Connection, workspace_id: str, viewer: str, query: ParsedQuery,
                 filters: SearchFilters, *, below_global_seq: int | None, budget: int, limit: int) -> SearchResult:
    """One page: the newest matching messages below the cursor that `viewer` may read,
    filters applied, at most `limit` (and at most `budget` examined).  Only messages
    the viewer may read are ever examined — in scopes it reads through a private
    membership the readable predicate runs while matching — so the ones it cannot read
    never count against the budget nor show in has_more or the cursor."""
    every_message, message_by_message = await visibility.readable_scope_sets(conn, workspace_id, viewer)
    if filters.scope_id is not None:
        every_message = [s for s in every_message if s == filters.scope_id]
        message_by_message = [s for s in message_by_message if s == filters.scope_id]
    if not every_message and not message_by_message:
        return SearchResult([], False, False, None)
    cap = min(budget, limit + 1)
    params: list[Any] = [workspace_id, every_message]

    def param(value: Any) -> str:
        params.append(value)
        return f"${len(params)}"

    readable = "d.scope_id = ANY($2::text[])"
    if message_by_message:  # only then the (large) predicate is part of the statement
        readable = (f"({readable} OR (d.scope_id = ANY({param(message_by_message)}::text[]) AND EXISTS ("
                    f"SELECT 1 FROM scope_messages m WHERE m.scope_id = d.scope_id AND m.id = d.message_id "
                    f"AND {message_visibility_sql('m', param(viewer) + '::text')} IS NOT NULL)))")
    conditions = [*_match_sql(query, param), readable]
    # Scopes still being backfilled are left out (readiness, §3.16): a short list, usually empty.
    not_ready = await conn.fetch("SELECT scope_id FROM scope_message_search_state WHERE workspace_id = $1 "
                                 "AND NOT read_ready", workspace_id)
    if not_ready:
        conditions.append(f"d.scope_id <> ALL({param([r['scope_id'] for r in not_ready])}::text[])")
    if filters.scope_id is not None:
        conditions.append(f"d.scope_id = {param(filters.scope_id)}")
    if filters.author_member_id is not None:
        conditions.append(f"d.author_member_id = {param(filters.author_member_id)}")
    if filters.after is not None:
        conditions.append(f"d.created_at >= {param(filters.after)}")
    if filters.before is not None:
        conditions.append(f"d.created_at < {param(filters.before)}")
    if filters.has_attachment is not None:
        conditions.append(f"d.has_attachment = {param(filters.has_attachment)}")
    if filters.mentions_me:
        conditions.append(f"d.mention_member_ids @> ARRAY[{param(viewer)}::text]")
    where = " AND ".join(conditions)
    shared = len(params)
    upper = below_global_seq if below_global_seq is not None else 2**62
    scope_probe = "AND d.scope_id = $4 " if filters.scope_id is not None else ""
    found: list[asyncpg.Record] = []
    for window in RECENT_WINDOWS:
        # The next `window` docs below `upper`, read in index order (an index-only probe
        # finds where the window ends): a term common enough fills its page here.
        window_end = await conn.fetchval(
            f"SELECT d.workspace_global_seq FROM scope_message_search_docs d WHERE d.workspace_id = $1 "
            f"AND d.workspace_global_seq < $2 {scope_probe}ORDER BY d.workspace_global_seq DESC OFFSET $3 - 1 LIMIT 1",
            workspace_id, upper, window, *([filters.scope_id] if filters.scope_id is not None else []))
        # OFFSET 0 fences the window off: whatever plan the statement gets, it walks the
        # window in order and stops at the page, never the full-text index's match list.
        found += await conn.fetch(
            f"SELECT d.message_id, d.workspace_global_seq AS global_seq FROM (SELECT * FROM "
            f"scope_message_search_docs w WHERE w.workspace_id = $1 AND w.workspace_global_seq < {param(upper)} "
            f"AND w.workspace_global_seq >= {param(window_end or 0)} ORDER BY w.workspace_global_seq DESC "
            f"OFFSET 0) d WHERE {where} ORDER BY d.workspace_global_seq DESC LIMIT {param(cap - len(found))}",
            *params)
        del params[shared:]
        if len(found) >= cap or window_end is None:
            break
        upper = window_end
    else:
        # The rest through the full-text index: every older match, sorted (`+ 0` keeps the
        # planner from walking the order index through a rare term's whole workspace).
        found += await visibility.fetch_custom_plan(
            conn,
            f"SELECT d.message_id, d.workspace_global_seq AS global_seq FROM scope_message_search_docs d "
            f"WHERE d.workspace_id = $1 AND d.workspace_global_seq < {param(upper)} AND {where} "
            f"ORDER BY d.workspace_global_seq + 0 DESC LIMIT {param(cap - len(found))}",
            *params)
    page = [r["message_id"] for r in found[:limit]]
    if len(found) > limit:
        return SearchResult(page, True, False, found[limit - 1]["global_seq"])
    if len(found) >= cap:
        return SearchResult(page, True, True, found[-1]["global_seq"])
    return SearchResult(page, False, False, None)


# --- readiness: backfill and finalize (the admin commands) -------------------------------------------------

async def pending_scopes(conn: asyncpg.Connection, workspace_id: str | None) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT * FROM scope_message_search_state WHERE NOT read_ready AND ($1::text IS NULL OR workspace_id = $1) "
        "ORDER BY workspace_id, scope_id", workspace_id)


async def status(conn: asyncpg.Connection, workspace_id: str | None) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT st.*, (SELECT count(*) FROM scope_message_search_docs d WHERE d.scope_id = st.scope_id) AS docs "
        "FROM scope_message_search_state st WHERE $1::text IS NULL OR st.workspace_id = $1 "
        "ORDER BY st.workspace_id, st.scope_id", workspace_id)


async def backfill_batch(conn: asyncpg.Connection, scope_id: str, batch: int) -> bool:
    """Index the next `batch` messages of a scope being backfilled; True when it is done.
    The rows are read FOR SHARE: a withdrawal committing meanwhile waits, then deletes the
    doc; an edit's doc (written by the live path) is never overwritten by older text."""
    state = await conn.fetchrow(
        "SELECT backfill_state, backfill_cursor_seq FROM scope_message_search_state WHERE scope_id = $1 FOR UPDATE",
        scope_id)
    if state is None or state["backfill_state"] == "complete":
        return True
    rows = await conn.fetch(
        "SELECT id, workspace_id, scope_id, seq, workspace_global_seq, author_member_id, created_at, content, "
        "metadata, state FROM scope_messages WHERE scope_id = $1 AND seq > $2 ORDER BY seq LIMIT $3 FOR SHARE",
        scope_id, state["backfill_cursor_seq"], batch)
    written = await write_docs(conn, [doc_for_row(r) for r in rows if r["state"] == "visible"], replace=False)
    done = len(rows) < batch
    await conn.execute(
        "UPDATE scope_message_search_state SET backfill_cursor_seq = $2, backfilled_docs = backfilled_docs + $3, "
        "backfill_state = CASE WHEN $4 THEN 'complete' ELSE backfill_state END, updated_at = now() "
        "WHERE scope_id = $1",
        scope_id, rows[-1]["seq"] if rows else state["backfill_cursor_seq"], written, done)
    return done


async def finalize_scope(conn: asyncpg.Connection, scope_id: str) -> dict[str, Any]:
    """Mark a backfilled scope ready once every visible message has its doc; a ready
    scope stays ready."""
    state = await conn.fetchrow(
        "SELECT backfill_state, read_ready FROM scope_message_search_state WHERE scope_id = $1 FOR UPDATE", scope_id)
    if state is None or state["read_ready"]:
        return {"scope_id": scope_id, "read_ready": True}
    if state["backfill_state"] != "complete":
        return {"scope_id": scope_id, "read_ready": False, "reason": "backfill_pending"}
    missing = await conn.fetchval(
        "SELECT count(*) FROM scope_messages m WHERE m.scope_id = $1 AND m.state = 'visible' AND NOT EXISTS "
        "(SELECT 1 FROM scope_message_search_docs d WHERE d.message_id = m.id)", scope_id)
    index_valid = await conn.fetchval(
        "SELECT indisvalid AND indisready FROM pg_index WHERE indexrelid = "
        "'scope_message_search_docs_vector_idx'::regclass")
    if missing or not index_valid:
        return {"scope_id": scope_id, "read_ready": False,
                "reason": "docs_missing" if missing else "index_not_valid", "missing_docs": missing}
    await conn.execute(
        "UPDATE scope_message_search_state SET finalize_state = 'complete', read_ready = true, updated_at = now() "
        "WHERE scope_id = $1", scope_id)
    return {"scope_id": scope_id, "read_ready": True}
