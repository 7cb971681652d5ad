"""Message-domain reads: scope state for actors, and every member-facing read
(history, permalink, reactions, read checks, inbox).  Who may read what is
decided by the storage/visibility package alone; every read here uses its SQL and
none re-implements it (a guardrail test checks that nothing here reads
scope_memberships)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from domain.authority import ScopeAuthority
from domain.plan import CommittedMessage, MentionCandidate, ScopeContext
from storage import strands, visibility
from storage.visibility import INBOX_MEMBERSHIPS, message_visibility_sql, readable_join, scope_readable_sql
from storage.errors import NotFound

log = logging.getLogger("scopewire.storage")


# --- actor state ---------------------------------------------------------------------------

_SCOPE_CONTEXT = (
    "SELECT s.id, s.workspace_id, s.type, s.status, s.parent_scope_id, s.root_message_id, s.latest_seq, "
    "s.roster_generation, p.visibility FROM scopes s LEFT JOIN scope_channel_profiles p ON p.scope_id = s.id "
)


def _scope_context(scope: asyncpg.Record, roster: dict) -> ScopeContext:
    return ScopeContext(
        scope_id=scope["id"], workspace_id=scope["workspace_id"], type=scope["type"], status=scope["status"],
        parent_scope_id=scope["parent_scope_id"], root_message_id=scope["root_message_id"],
        latest_seq=scope["latest_seq"], roster_generation=scope["roster_generation"], visibility=scope["visibility"],
        roster=roster,
    )


async def load_scope_context(conn: asyncpg.Connection, scope_id: str) -> ScopeContext | None:
    scope = await conn.fetchrow(_SCOPE_CONTEXT + "WHERE s.id = $1", scope_id)
    if scope is None:
        return None
    return _scope_context(scope, await visibility.roster_entries(conn, scope_id))


async def load_plain_actor_views(conn: asyncpg.Connection, scope_ids: list[str]) -> dict[str, ActorView]:
    """load_actor_view of many scopes in two statements, for the scopes it covers whole:
    those with no parent (neither a thread nor a task) and no private member (no
    authority to read).  The others are left out: their actors load their own."""
    scopes = await conn.fetch(_SCOPE_CONTEXT + "WHERE s.id = ANY($1::text[]) AND s.parent_scope_id IS NULL "
                              "AND s.type NOT IN ('thread', 'task')", scope_ids)
    rosters = await visibility.roster_entries_of(conn, [s["id"] for s in scopes])
    views = {}
    for scope in scopes:
        roster = rosters.get(scope["id"], {})
        if all(entry.visibility != "private" for entry in roster.values()):
            views[scope["id"]] = ActorView(_scope_context(scope, roster), None, ScopeAuthority())
    return views


@dataclass(frozen=True)
class ActorView:
    """What a scope actor caches: its scope, the thread's parent, and the private
    authority windows of the owners of the private members of both."""

    state: ScopeContext | None
    parent: ScopeContext | None
    authority: ScopeAuthority
    # A task scope's strand as its actor routes by it (watches, assignees, participants).
    strand: Any = None


async def load_actor_view(conn: asyncpg.Connection, scope_id: str, state: ScopeContext | None = None) -> ActorView:
    """The actor's view; with `state`, only the parent and the authority are read again."""
    if state is None or state.type == "task":
        # A task's roster is its board channel's readers: it moves with the parent.
        state = await load_scope_context(conn, scope_id)
    if state is None:
        return ActorView(None, None, ScopeAuthority())
    parent = None
    if state.type in ("thread", "task") and state.parent_scope_id is not None:
        parent = await load_scope_context(conn, state.parent_scope_id)
        if state.type == "task":
            # Read after its channel: a reader change committing between the two reads then shows
            # next time as a newer channel generation, never as a stale roster kept under the new one.
            state = await load_scope_context(conn, scope_id)
            if state is None:
                return ActorView(None, None, ScopeAuthority())
    chain = [state.scope_id] + ([parent.scope_id] if parent is not None else [])
    owners = sorted({e.owner_member_id for context in (state, parent) if context is not None
                     for e in context.roster.values() if e.visibility == "private" and e.owner_member_id})
    strand = None
    if state.type == "task":
        strand = await strands.load_strand_state(conn, scope_id)
        if strand is None or strand.row["state"] != "active" or strand.row["board_status"] != "active" or (
                parent is not None and parent.status != "active"):
            state.status = "archived"  # an archived strand, board or channel refuses writes
    return ActorView(state, parent, await visibility.scope_authority(conn, chain, owners), strand)


async def roster_generation(conn: asyncpg.Connection, scope_id: str) -> int | None:
    return await conn.fetchval("SELECT roster_generation FROM scopes WHERE id = $1", scope_id)


async def transaction_time(conn: asyncpg.Connection) -> datetime:
    """now() of the running transaction: the time its messages are created at."""
    return await conn.fetchval("SELECT now()")


async def mention_candidates(conn: asyncpg.Connection, workspace_id: str, handles: list[str],
                             member_ids: list[str] = ()) -> dict[str, MentionCandidate]:
    """The members named by `handles` or `member_ids` (explicit recipients), by handle."""
    if not handles and not member_ids:
        return {}
    rows = await conn.fetch(
        "SELECT id, handle, kind, status, visibility, owner_member_id FROM members "
        "WHERE workspace_id = $1 AND (handle = ANY($2::text[]) OR id = ANY($3::text[]))",
        workspace_id, handles, list(member_ids),
    )
    return {r["handle"]: MentionCandidate(r["id"], r["handle"], r["kind"], r["status"], r["visibility"],
                                          r["owner_member_id"]) for r in rows}


async def member_candidate(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> MentionCandidate:
    row = await conn.fetchrow(
        "SELECT id, handle, kind, status, visibility, owner_member_id FROM members WHERE workspace_id = $1 AND id = $2",
        workspace_id, member_id,
    )
    if row is None:
        raise NotFound("member")
    return MentionCandidate(row["id"], row["handle"], row["kind"], row["status"], row["visibility"],
                            row["owner_member_id"])


def committed_from_row(row: asyncpg.Record, *, replayed: bool = False) -> CommittedMessage:
    metadata = row["metadata"]
    return CommittedMessage(
        id=row["id"], workspace_id=row["workspace_id"], scope_id=row["scope_id"], seq=row["seq"],
        workspace_global_seq=row["workspace_global_seq"], author_member_id=row["author_member_id"],
        author_type=row["author_type"], message_type=row["message_type"], content=row["content"],
        metadata=json.loads(metadata) if isinstance(metadata, str) else metadata,
        client_message_id=row["client_message_id"], created_at=row["created_at"], revision=row["revision"],
        state=row["state"], replayed=replayed)


async def committed_message(conn: asyncpg.Connection, scope_id: str, message_id: str) -> CommittedMessage | None:
    """A message as its events carry it (system read for the outbox worker)."""
    row = await conn.fetchrow("SELECT * FROM scope_messages WHERE scope_id = $1 AND id = $2", scope_id, message_id)
    return committed_from_row(row) if row is not None else None


async def message_row(conn: asyncpg.Connection, scope_id: str, message_id: str) -> asyncpg.Record | None:
    """A message of the scope, locked for the scope actor's command that changes what hangs on it."""
    return await conn.fetchrow("SELECT * FROM scope_messages WHERE scope_id = $1 AND id = $2 FOR SHARE",
                               scope_id, message_id)


# --- scope lookups for members ------------------------------------------------------------------

async def scope_for_viewer(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                           viewer: str) -> asyncpg.Record | None:
    """The scope as the viewer may know it: None when it does not exist here;
    `readable` tells whether the viewer may read it; `discoverable` whether its
    existence may be revealed (public channels)."""
    return await conn.fetchrow(
        f"SELECT s.id, s.workspace_id, s.type, s.status, s.parent_scope_id, s.root_message_id, s.latest_seq, "
        f"s.latest_message_at, s.created_at, p.slug, p.display_name, p.description, p.visibility, "
        f"{scope_readable_sql('s', '$3')} AS readable, "
        f"(s.type = 'channel' AND p.visibility = 'public') AS discoverable FROM scopes s "
        f"LEFT JOIN scope_channel_profiles p ON p.scope_id = s.id WHERE s.workspace_id = $1 AND s.id = $2",
        workspace_id, scope_id, viewer,
    )


async def channel_list(conn: asyncpg.Connection, workspace_id: str, viewer: str) -> list[asyncpg.Record]:
    """Public channels, and private channels the viewer belongs to."""
    return await conn.fetch(
        f"SELECT s.id, s.type, s.status, s.latest_seq, s.latest_message_at, p.slug, p.display_name, p.description, "
        f"p.visibility, {scope_readable_sql('s', '$2')} AS is_member FROM scopes s "
        f"JOIN scope_channel_profiles p ON p.scope_id = s.id WHERE s.workspace_id = $1 AND s.status <> 'deleted' "
        f"AND (p.visibility = 'public' OR {scope_readable_sql('s', '$2')}) ORDER BY p.slug",
        workspace_id, viewer,
    )


async def keyed_scope(conn: asyncpg.Connection, workspace_id: str, identity_key: str) -> str | None:
    """The DM / service_account / workflow scope of an identity key, if it exists."""
    return await conn.fetchval("SELECT id FROM scopes WHERE workspace_id = $1 AND identity_key = $2",
                               workspace_id, identity_key)


async def channel_owner(conn: asyncpg.Connection, scope_id: str) -> str | None:
    return await conn.fetchval("SELECT owner_member_id FROM scope_channel_profiles WHERE scope_id = $1", scope_id)


async def message_scope(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                        message_id: str) -> asyncpg.Record | None:
    """Which scope a message is in, only if the viewer may read it."""
    return await conn.fetchrow(
        f"SELECT m.scope_id, m.seq, m.author_member_id, m.state, m.revision, "
        f"(SELECT s.type FROM scopes s WHERE s.id = m.scope_id) AS scope_type FROM scope_messages m "
        f"WHERE m.workspace_id = $1 AND m.id = $3 AND {message_visibility_sql('m', '$2')} IS NOT NULL",
        workspace_id, viewer, message_id,
    )


# --- history and permalink --------------------------------------------------------------------------

MESSAGE_COLUMNS = (
    "m.id, m.scope_id, m.seq, m.workspace_global_seq, m.author_member_id, m.author_type, m.message_type, "
    "CASE WHEN m.state = 'withdrawn' THEN '' ELSE m.content END AS content, "
    "CASE WHEN m.state = 'withdrawn' THEN '{}'::jsonb ELSE m.metadata END AS metadata, "
    "m.client_message_id, m.revision, m.state, m.created_at, m.updated_at, m.withdrawn_at, m.thread_scope_id"
)


async def history(conn: asyncpg.Connection, workspace_id: str, viewer: str, scope_id: str, *,
                  before_seq: int | None, after_seq: int | None, limit: int) -> tuple[list[asyncpg.Record], bool]:
    """A page of the scope's messages the viewer may read, in seq order, and
    whether more exist in the paging direction."""
    forward = after_seq is not None
    page = (f"m.workspace_id = $1 AND m.scope_id = $3 AND m.seq {'>' if forward else '<'} $4 "
            f"ORDER BY m.seq {'ASC' if forward else 'DESC'} LIMIT $5")
    args = (workspace_id, viewer, scope_id,
            after_seq if forward else (before_seq if before_seq is not None else 2**62), limit + 1)
    # An open public member reads every message of the scope (the predicate's first branch):
    # asked that first, in the same statement as the page, the page needs none of the
    # predicate's other branches, whose plan alone costs tens of milliseconds.
    rows = await conn.fetch(
        f"SELECT r.public_reader, page.* FROM (SELECT {visibility.public_reader_sql('$3', '$2')} AS public_reader) r "
        f"LEFT JOIN LATERAL (SELECT {MESSAGE_COLUMNS}, 'membership'::text AS visibility_reason, "
        f"NULL::text AS grant_id FROM scope_messages m WHERE r.public_reader AND {page}) page ON true", *args)
    if not rows[0]["public_reader"]:
        # A private agent's windows and its page come from one snapshot: read apart, a grant
        # committed in between would leave its messages out of a page that holds later ones,
        # and a subscriber's catch-up would step over them for good.
        async with (contextlib.nullcontext() if conn.is_in_transaction()
                    else conn.transaction(isolation="repeatable_read", readonly=True)):
            reader = await visibility.private_reader_windows(conn, scope_id, viewer)
            if reader is not None:
                return await _private_history(conn, workspace_id, viewer, scope_id, reader, before_seq=before_seq,
                                              after_seq=after_seq, limit=limit)
            rows = await visibility.fetch_generic_plan(
                conn, f"SELECT {MESSAGE_COLUMNS}, vis.visibility_reason, vis.grant_id FROM scope_messages m "
                      f"{readable_join('m', '$2')} WHERE {page}", *args)
    else:
        rows = [row for row in rows if row["id"] is not None]
    return (list(rows[:limit]) if forward else list(reversed(rows[:limit]))), len(rows) > limit


async def _private_history(conn: asyncpg.Connection, workspace_id: str, viewer: str, scope_id: str,
                           reader: visibility.ReaderWindows, *, before_seq: int | None, after_seq: int | None,
                           limit: int) -> tuple[list[asyncpg.Record], bool]:
    """history() for a private agent.  Each window of `reader` (an author and the
    range it may be read in) is one bounded scan of scope_messages_scope_author_idx,
    newest (or oldest) first; the scans are merged by seq.  Within a scope seq
    order is global-seq order, so the page bound becomes a global-seq bound on
    that index.  The readable predicate itself then checks the merged page:
    a row it refuses is left out (fail closed) and logged, never shown.
    With its generic plan: planned for each call's windows, a page cost ~30 ms of
    planning (bench/private_agents.py, 1,000,000 messages: p50 35 ms a page, 19 ms
    generic)."""
    forward = after_seq is not None
    # The page bound as a global seq: that of the nearest message, read off the
    # (scope_id, seq) key once (an InitPlan of the one statement below).
    if forward:
        bound = ("(SELECT b.workspace_global_seq FROM scope_messages b WHERE b.scope_id = $3 AND b.seq <= $7 "
                 "ORDER BY b.seq DESC LIMIT 1)")
        page_bound, order = f"m.workspace_global_seq > coalesce({bound}, 0)", "ASC"
    else:
        # Bounded from below the cursor: a message committing meanwhile above it can never widen the page.
        bound = ("(SELECT b.workspace_global_seq + 1 FROM scope_messages b WHERE b.scope_id = $3 AND b.seq < $7 "
                 "ORDER BY b.seq DESC LIMIT 1)")
        page_bound, order = f"m.workspace_global_seq < coalesce({bound}, 0)", "DESC"
    windows = list(zip(*reader.windows)) or [(), (), (), (), (), ()]
    in_interval = ("EXISTS (SELECT 1 FROM unnest($10::bigint[], $11::bigint[]) AS iv(lo, hi) "
                   "WHERE m.seq >= iv.lo AND (iv.hi IS NULL OR m.seq <= iv.hi))")
    rows = await visibility.fetch_generic_plan(
        conn,
        f"SELECT page.*, vis.visibility_reason, vis.grant_id FROM ("
        f"SELECT DISTINCT ON (candidate.seq) candidate.* FROM ("
        f"SELECT by_window.* FROM unnest($4::text[], $5::bigint[], $6::bigint[], $12::timestamptz[], "
        f"$13::bigint[], $14::bigint[]) AS w(author, lo_g, hi_g, expires_at, lo_s, hi_s) "
        f"CROSS JOIN LATERAL (SELECT {MESSAGE_COLUMNS}, m.workspace_id FROM scope_messages m "
        f"WHERE m.scope_id = $3 AND m.workspace_id = $1 AND m.author_member_id = w.author "
        f"AND m.workspace_global_seq >= greatest(coalesce(w.lo_g, 0), $9::bigint) "
        f"AND (w.hi_g IS NULL OR m.workspace_global_seq <= w.hi_g) "
        f"AND (w.expires_at IS NULL OR m.created_at < w.expires_at) "
        f"AND (w.lo_s IS NULL OR m.seq >= w.lo_s) AND (w.hi_s IS NULL OR m.seq <= w.hi_s) "
        f"AND {in_interval} AND {page_bound} "
        f"ORDER BY m.workspace_global_seq {order} LIMIT $8) by_window "
        f"UNION ALL (SELECT {MESSAGE_COLUMNS}, m.workspace_id FROM scope_messages m "
        f"WHERE m.scope_id = $3 AND m.workspace_id = $1 "
        f"AND m.id IN ({visibility.quoted_sources_sql('$3', '$2')}) AND {page_bound} "
        f"ORDER BY m.workspace_global_seq {order} LIMIT $8)"
        f") candidate ORDER BY candidate.seq {order} LIMIT $8"
        f") page LEFT JOIN LATERAL (SELECT split_part(v.value, ':', 1) AS visibility_reason, "
        f"nullif(split_part(v.value, ':', 2), '') AS grant_id FROM (SELECT "
        f"{message_visibility_sql('page', '$2')} AS value) v) vis ON true ORDER BY page.seq {order}",
        workspace_id, viewer, scope_id, list(windows[0]), list(windows[1]), list(windows[2]),
        after_seq if forward else (before_seq if before_seq is not None else 2**62), limit + 1,
        reader.floor, [lo for lo, _ in reader.intervals], [hi for _, hi in reader.intervals], list(windows[3]),
        list(windows[4]), list(windows[5]),
    )
    refused = [r["id"] for r in rows if r["visibility_reason"] is None]
    if refused:
        log.error("private history: the readable predicate refused rows the windows selected",
                  extra={"scope_id": scope_id, "viewer": viewer, "message_ids": refused})
    page = [r for r in rows[:limit] if r["visibility_reason"] is not None]
    return (page if forward else list(reversed(page))), len(rows) > limit


async def message_for_viewer(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                             message_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        f"SELECT {MESSAGE_COLUMNS}, vis.visibility_reason, vis.grant_id FROM scope_messages m "
        f"{readable_join('m', '$2')} WHERE m.workspace_id = $1 AND m.id = $3",
        workspace_id, viewer, message_id,
    )


async def readable_messages(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                            message_ids: list[str]) -> list[asyncpg.Record]:
    """Those of `message_ids` the viewer may read, visible, as history shows them, newest
    first (search hits: checked again here, and one withdrawn meanwhile is left out)."""
    return await visibility.fetch_generic_plan(
        conn,
        f"SELECT {MESSAGE_COLUMNS} FROM scope_messages m WHERE m.workspace_id = $1 AND m.id = ANY($3::text[]) "
        f"AND m.state = 'visible' AND {message_visibility_sql('m', '$2')} IS NOT NULL "
        f"ORDER BY m.workspace_global_seq DESC", workspace_id, viewer, message_ids)


async def message_revisions(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                            message_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT r.revision, r.content, r.edited_by_member_id, r.created_at FROM scope_message_revisions r "
        f"JOIN scope_messages m ON m.scope_id = r.scope_id AND m.id = r.message_id "
        f"WHERE m.workspace_id = $1 AND m.id = $3 AND m.state = 'visible' "
        f"AND {message_visibility_sql('m', '$2')} IS NOT NULL "
        f"ORDER BY r.revision",
        workspace_id, viewer, message_id,
    )


async def reaction_summaries(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                             message_ids: list[str]) -> dict[str, list[asyncpg.Record]]:
    """Per message: key, count, whether the viewer reacted; withdrawn messages show none."""
    if not message_ids:
        return {}
    rows = await conn.fetch(
        f"SELECT r.message_id, r.reaction_key, count(*) AS count, bool_or(r.member_id = $2) AS me, "
        f"min(r.created_at) AS first_at FROM scope_message_reactions r "
        f"JOIN scope_messages m ON m.scope_id = r.scope_id AND m.id = r.message_id "
        f"WHERE m.workspace_id = $1 AND r.message_id = ANY($3::text[]) AND m.state = 'visible' "
        f"AND {message_visibility_sql('m', '$2')} IS NOT NULL GROUP BY r.message_id, r.reaction_key ORDER BY first_at",
        workspace_id, viewer, message_ids,
    )
    summaries: dict[str, list[asyncpg.Record]] = {}
    for row in rows:
        summaries.setdefault(row["message_id"], []).append(row)
    return summaries


async def workspace_global_tail(conn: asyncpg.Connection, workspace_id: str) -> int:
    value = await conn.fetchval(
        "SELECT latest_global_seq FROM workspace_message_counters WHERE workspace_id = $1", workspace_id
    )
    return value or 0


async def workspace_feed(conn: asyncpg.Connection, workspace_id: str, viewer: str, after_global_seq: int,
                         limit: int) -> list[asyncpg.Record]:
    """The viewer's readable messages across the workspace, by global seq."""
    return await visibility.fetch_generic_plan(
        conn,
        f"SELECT {MESSAGE_COLUMNS} FROM scope_messages m WHERE m.workspace_id = $1 AND m.workspace_global_seq > $3 "
        f"AND {message_visibility_sql('m', '$2')} IS NOT NULL ORDER BY m.workspace_global_seq LIMIT $4",
        workspace_id, viewer, after_global_seq, limit,
    )


# --- inbox ----------------------------------------------------------------------------------------

def encode_cursor(values: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(values, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> list | None:
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, TypeError):
        return None
    if (not isinstance(values, list) or len(values) != 3 or not isinstance(values[0], int)
            or not isinstance(values[1], (int, float)) or not isinstance(values[2], str)):
        return None
    return values


UNREAD_CAP = 1000  # counted exactly up to this, reported as "at least" beyond
PREVIEW_SCAN = 200  # a private agent's Inbox preview: its latest readable message among the scope's last 200


async def inbox(conn: asyncpg.Connection, workspace_id: str, viewer: str, *, after: list | None,
                limit: int) -> tuple[list[asyncpg.Record], str | None]:
    """The viewer's conversations: pinned first, then by latest activity.  Hidden
    ones return when a newer message arrives.  Unread counts come from the read
    cursor at read time — nothing per recipient is written at send time — and
    exclude messages the viewer is the notify principal of."""
    rows = await conn.fetch(
        f"""
        WITH conv AS (
            SELECT s.id AS scope_id, s.type, s.latest_seq, s.parent_scope_id,
                   coalesce(s.latest_message_at, s.created_at) AS activity_at,
                   (c.pinned_at IS NOT NULL)::int AS pinned, c.manual_unread_at IS NOT NULL AS manual_unread,
                   sm.last_read_seq, sm.visibility AS membership_visibility,
                   coalesce(n.state, 'active') AS notification_state,
                   p.display_name, p.slug
            FROM {INBOX_MEMBERSHIPS} sm
            JOIN scopes s ON s.id = sm.scope_id
            LEFT JOIN scope_channel_profiles p ON p.scope_id = s.id
            LEFT JOIN conversation_member_states c
                   ON c.workspace_id = sm.workspace_id AND c.member_id = sm.member_id AND c.scope_id = sm.scope_id
            LEFT JOIN scope_notification_settings n ON n.scope_id = sm.scope_id AND n.member_id = sm.member_id
            WHERE sm.workspace_id = $1 AND sm.member_id = $2
              AND s.status <> 'deleted' AND s.type <> 'workflow'
              AND (c.hidden_at IS NULL OR s.latest_seq > c.hidden_through_seq)
              -- A service account's conversation begins with its first post inside the membership (§5.1).
              AND (s.type <> 'service_account' OR s.latest_seq >= sm.effective_from_seq)
        )
        SELECT conv.*, extract(epoch FROM conv.activity_at)::float8 AS activity_epoch,
               last.id AS last_message_id, last.author_member_id AS last_author_member_id,
               CASE WHEN last.state = 'withdrawn' THEN '' ELSE left(last.content, 200) END AS last_preview,
               last.state AS last_state,
               (SELECT count(*) FROM (SELECT 1 FROM scope_messages u WHERE u.scope_id = conv.scope_id
                 AND u.seq > conv.last_read_seq AND u.notify_principal_member_id <> $2 AND u.state = 'visible'
                 AND (conv.membership_visibility <> 'private' OR {message_visibility_sql('u', '$2')} IS NOT NULL)
                 LIMIT {UNREAD_CAP}) capped) AS unread_count
        FROM conv
        -- The latest message the viewer reads (a private agent: among the last
        -- {PREVIEW_SCAN} messages, so a preview never costs a scan of the scope).
        LEFT JOIN LATERAL (SELECT l.id, l.author_member_id, l.state, l.content FROM scope_messages l
                            WHERE l.scope_id = conv.scope_id AND l.seq > conv.latest_seq - {PREVIEW_SCAN}
                              AND (conv.membership_visibility <> 'private'
                                   OR {message_visibility_sql('l', '$2')} IS NOT NULL)
                            ORDER BY l.seq DESC LIMIT 1) last ON true
        WHERE $3::int IS NULL OR (conv.pinned, extract(epoch FROM conv.activity_at)::float8, conv.scope_id)
              < ($3::int, $4::float8, $5::text)
        ORDER BY conv.pinned DESC, activity_epoch DESC, conv.scope_id DESC
        LIMIT $6
        """,
        workspace_id, viewer, *(after if after else (None, None, None)), limit + 1,
    )
    page = list(rows[:limit])
    next_cursor = None
    if len(rows) > limit:
        last = page[-1]
        next_cursor = encode_cursor([last["pinned"], last["activity_epoch"], last["scope_id"]])
    return page, next_cursor
