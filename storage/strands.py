"""Strands: every SQL statement of boards, strand rows, synthesis revisions,
assignments, watches, strand audit, the default strand, audience-mention policy
and grants, and agent participation (strand-message.md §2-§9).

Writes to one strand run inside its task scope's actor batch (actors/strands.py),
so a strand has one writer; who may read one is storage/visibility/tasks.py's
question, asked in the same statements here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from domain.strands import Tracks, WatchValue, tracks_from_json, tracks_json
from storage import applier
from storage.errors import Conflict, NotFound
from storage.ids import new_id
from storage.visibility.tasks import channel_member_sql, participant_members, task_reader_sql, task_readers


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# --- boards -------------------------------------------------------------------------------------

_BOARD_COLUMNS = "b.id, b.workspace_id, b.channel_id, b.name, b.status, b.created_by_member_id, b.created_at"


async def create_board(conn: asyncpg.Connection, workspace_id: str, channel_id: str, name: str,
                       creator: str) -> asyncpg.Record:
    """A board on a channel the creator is an active member of (not_found otherwise: a
    channel you cannot use is not revealed)."""
    allowed = await conn.fetchval(
        f"SELECT EXISTS (SELECT 1 FROM scopes c WHERE c.workspace_id = $1 AND c.id = $2 AND c.type = 'channel' "
        f"AND c.status = 'active' AND {channel_member_sql('c.id', '$3')})", workspace_id, channel_id, creator)
    if not allowed:
        raise NotFound("channel")
    try:
        async with conn.transaction():
            return await conn.fetchrow(
                f"INSERT INTO task_boards AS b (id, workspace_id, channel_id, name, created_by_member_id) "
                f"VALUES ($1, $2, $3, $4, $5) RETURNING {_BOARD_COLUMNS}",
                new_id("tbd"), workspace_id, channel_id, name, creator)
    except asyncpg.UniqueViolationError:
        raise Conflict("board_name_taken", "the channel has a board of that name") from None


async def board_for_member(conn: asyncpg.Connection, workspace_id: str, board_id: str,
                           viewer: str) -> asyncpg.Record | None:
    """The board when `viewer` is an active member of its channel; None otherwise
    (whatever the cause: another workspace, no such board, not a member)."""
    return await conn.fetchrow(
        f"SELECT {_BOARD_COLUMNS}, c.status AS channel_status FROM task_boards b "
        f"JOIN scopes c ON c.id = b.channel_id AND c.workspace_id = b.workspace_id "
        f"WHERE b.workspace_id = $1 AND b.id = $2 AND c.status <> 'deleted' AND {channel_member_sql('b.channel_id', '$3')}",
        workspace_id, board_id, viewer)


async def list_boards(conn: asyncpg.Connection, workspace_id: str, viewer: str,
                      channel_id: str | None) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {_BOARD_COLUMNS}, c.status AS channel_status FROM task_boards b "
        f"JOIN scopes c ON c.id = b.channel_id AND c.workspace_id = b.workspace_id "
        f"WHERE b.workspace_id = $1 AND ($3::text IS NULL OR b.channel_id = $3) AND c.status <> 'deleted' "
        f"AND {channel_member_sql('b.channel_id', '$2')} ORDER BY b.channel_id, lower(b.name) LIMIT 500",
        workspace_id, viewer, channel_id)


async def set_board_status(conn: asyncpg.Connection, workspace_id: str, board_id: str, status: str) -> asyncpg.Record:
    row = await conn.fetchrow(
        f"UPDATE task_boards b SET status = $3, archived_at = CASE WHEN $3 = 'archived' THEN now() END, "
        f"updated_at = now() WHERE b.workspace_id = $1 AND b.id = $2 AND b.status <> $3 RETURNING {_BOARD_COLUMNS}",
        workspace_id, board_id, status)
    if row is None:
        raise Conflict("already_archived" if status == "archived" else "not_archived",
                       f"the board is already {status}")
    # Its tasks' actors re-read their authority: the channel's roster generation moves.
    await applier.bump_roster_generation(conn, row["channel_id"])
    return row


async def board_task_scopes(conn: asyncpg.Connection, board_id: str) -> list[str]:
    return [r["scope_id"] for r in await conn.fetch("SELECT scope_id FROM strands WHERE board_id = $1", board_id)]


# --- strand rows ----------------------------------------------------------------------------------

_STRAND_COLUMNS = (
    "st.scope_id, st.workspace_id, st.board_id, st.channel_id, st.title, st.summary, st.fields, st.content, "
    "st.tracks, st.synthesis_content, st.synthesis_revision, st.state, st.state_changed_at, st.stage, "
    "st.stage_changed_at, st.accept_third_party_mention, st.version, st.created_by_member_id, st.created_at, "
    "st.updated_by_member_id, st.updated_at, st.client_strand_id"
)


async def insert_strand(conn: asyncpg.Connection, *, scope_id: str, workspace_id: str, board_id: str, creator: str,
                        title: str, summary: str | None, fields: dict, content: str, tracks: Tracks,
                        accept_third_party_mention: bool | None, client_strand_id: str | None) -> None:
    """The strand row of a new task scope, in the scope's creating transaction: only on
    an active board of an active channel its creator is an active member of."""
    try:
        async with conn.transaction():
            inserted = await _insert_strand(conn, scope_id, workspace_id, board_id, creator, title, summary, fields,
                                            content, tracks, accept_third_party_mention, client_strand_id)
    except asyncpg.UniqueViolationError:
        # A concurrent create with the same client_strand_id won: the caller answers with that one.
        raise Conflict("client_strand_id_taken", "a strand with this client_strand_id exists") from None
    if inserted is None:
        raise NotFound("board")


async def _insert_strand(conn: asyncpg.Connection, scope_id: str, workspace_id: str, board_id: str, creator: str,
                         title: str, summary: str | None, fields: dict, content: str, tracks: Tracks,
                         accept_third_party_mention: bool | None, client_strand_id: str | None) -> str | None:
    return await conn.fetchval(
        f"INSERT INTO strands (scope_id, workspace_id, board_id, channel_id, title, summary, fields, content, tracks, "
        f"accept_third_party_mention, client_strand_id, created_by_member_id) "
        f"SELECT $1, b.workspace_id, b.id, b.channel_id, $5, $6, $7::jsonb, $8, $9::jsonb, $10, $11, $4 "
        f"FROM task_boards b JOIN scopes c ON c.id = b.channel_id AND c.workspace_id = b.workspace_id "
        f"WHERE b.workspace_id = $2 AND b.id = $3 AND b.status = 'active' AND c.status = 'active' "
        f"AND {channel_member_sql('b.channel_id', '$4')} FOR SHARE OF b RETURNING scope_id",
        scope_id, workspace_id, board_id, creator, title, summary, json.dumps(fields), content,
        json.dumps(tracks_json(tracks)), accept_third_party_mention, client_strand_id)


async def strand_by_client_id(conn: asyncpg.Connection, workspace_id: str, creator: str,
                              client_strand_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        f"SELECT {_STRAND_COLUMNS} FROM strands st WHERE st.workspace_id = $1 AND st.created_by_member_id = $2 "
        f"AND st.client_strand_id = $3", workspace_id, creator, client_strand_id)


# A strand as readers see it: the projection's columns (domain.strands.strand_view).
_VIEW = (
    f"SELECT {_STRAND_COLUMNS}, b.status AS board_status, s.latest_seq, "
    f"(SELECT d.default_strand_id = st.scope_id FROM workspace_default_strands d "
    f"WHERE d.workspace_id = st.workspace_id) AS is_default "
    f"FROM strands st JOIN task_boards b ON b.id = st.board_id JOIN scopes s ON s.id = st.scope_id"
)


async def strand_for_reader(conn: asyncpg.Connection, workspace_id: str, strand_id: str,
                            viewer: str) -> asyncpg.Record | None:
    """The strand when `viewer` reads its task scope (task authority); None otherwise."""
    return await conn.fetchrow(
        f"{_VIEW} WHERE st.workspace_id = $1 AND st.scope_id = $2 "
        f"AND {task_reader_sql('st.scope_id', '$3')} IS NOT NULL",
        workspace_id, strand_id, viewer)


async def list_strands(conn: asyncpg.Connection, workspace_id: str, viewer: str, board_id: str, state: str | None,
                       after: tuple[datetime, str] | None, limit: int) -> list[asyncpg.Record]:
    """A board's strands the viewer reads, most recently updated first (keyset)."""
    return await conn.fetch(
        f"{_VIEW} WHERE st.workspace_id = $1 AND st.board_id = $3 AND ($4::text IS NULL OR st.state = $4) "
        f"AND ($5::timestamptz IS NULL OR (st.updated_at, st.scope_id) < ($5, $6)) "
        f"AND {task_reader_sql('st.scope_id', '$2')} IS NOT NULL "
        f"ORDER BY st.updated_at DESC, st.scope_id DESC LIMIT $7",
        workspace_id, viewer, board_id, state, after[0] if after else None, after[1] if after else None, limit)


async def projection(conn: asyncpg.Connection, scope_id: str) -> tuple[asyncpg.Record, list[asyncpg.Record]]:
    """The strand's row as readers see it (no reader check: for its own actor's events)."""
    row = await conn.fetchrow(f"{_VIEW} WHERE st.scope_id = $1", scope_id)
    return row, (await assignments(conn, [scope_id])).get(scope_id, [])


async def strand_row(conn: asyncpg.Connection, scope_id: str, *, for_update: bool = False) -> asyncpg.Record | None:
    return await conn.fetchrow(
        f"SELECT {_STRAND_COLUMNS}, b.status AS board_status FROM strands st JOIN task_boards b ON b.id = st.board_id "
        f"WHERE st.scope_id = $1" + (" FOR UPDATE OF st" if for_update else ""), scope_id)


def row_tracks(row: asyncpg.Record) -> Tracks:
    return tracks_from_json(_json(row["tracks"]))


async def update_strand(conn: asyncpg.Connection, scope_id: str, expected_version: int, editor: str,
                        changes: dict[str, Any]) -> asyncpg.Record:
    """Write the changed columns with compare-and-set on `version`; a synthesis change
    also records its revision."""
    sets, args = [], [scope_id, expected_version, editor]
    for column in ("title", "summary", "content", "accept_third_party_mention"):
        if column in changes:
            args.append(changes[column])
            sets.append(f"{column} = ${len(args)}")
    if "fields" in changes:
        args.append(json.dumps(changes["fields"]))
        sets.append(f"fields = ${len(args)}::jsonb")
    if "synthesis_content" in changes:
        args.append(changes["synthesis_content"])
        sets.append(f"synthesis_content = ${len(args)}, synthesis_revision = synthesis_revision + 1")
    row = await conn.fetchrow(
        f"UPDATE strands st SET {', '.join(sets + ['version = version + 1', 'updated_by_member_id = $3', 'updated_at = now()'])} "
        f"WHERE st.scope_id = $1 AND st.version = $2 RETURNING {_STRAND_COLUMNS}", *args)
    if row is None:
        raise Conflict("version_mismatch", "the strand changed: read it again and retry with its version")
    if "synthesis_content" in changes:
        await conn.execute(
            "INSERT INTO strand_synthesis_revisions (scope_id, revision, workspace_id, content, edited_by_member_id) "
            "VALUES ($1, $2, $3, $4, $5)", scope_id, row["synthesis_revision"], row["workspace_id"],
            row["synthesis_content"], editor)
    return row


async def set_tracks(conn: asyncpg.Connection, scope_id: str, tracks: Tracks, editor: str) -> asyncpg.Record:
    return await conn.fetchrow(
        f"UPDATE strands st SET tracks = $2::jsonb, version = version + 1, updated_by_member_id = $3, "
        f"updated_at = now() WHERE st.scope_id = $1 RETURNING {_STRAND_COLUMNS}",
        scope_id, json.dumps(tracks_json(tracks)), editor)


async def set_stage(conn: asyncpg.Connection, scope_id: str, stage: str, editor: str) -> asyncpg.Record:
    """A same-value set keeps stage_changed_at (§3: only a real change moves it)."""
    return await conn.fetchrow(
        f"UPDATE strands st SET stage_changed_at = CASE WHEN st.stage IS DISTINCT FROM $2 THEN now() "
        f"ELSE st.stage_changed_at END, stage = $2, version = version + 1, updated_by_member_id = $3, "
        f"updated_at = now() WHERE st.scope_id = $1 RETURNING {_STRAND_COLUMNS}", scope_id, stage, editor)


async def set_state(conn: asyncpg.Connection, scope_id: str, state: str, editor: str) -> asyncpg.Record:
    """Archive or restore the strand and its task scope together (archived refuses writes)."""
    row = await conn.fetchrow(
        f"UPDATE strands st SET state = $2, state_changed_at = now(), version = version + 1, "
        f"updated_by_member_id = $3, updated_at = now() WHERE st.scope_id = $1 AND st.state <> $2 "
        f"RETURNING {_STRAND_COLUMNS}", scope_id, state, editor)
    if row is None:
        raise Conflict("already_archived" if state == "archived" else "not_archived", f"the strand is already {state}")
    await applier.set_task_scope_status(conn, scope_id, state)
    return row


async def synthesis_revisions(conn: asyncpg.Connection, scope_id: str, limit: int) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT revision, content, edited_by_member_id, created_at FROM strand_synthesis_revisions "
        "WHERE scope_id = $1 ORDER BY revision DESC LIMIT $2", scope_id, limit)


# --- the actor's cached view of its strand ----------------------------------------------------------

@dataclass
class StrandState:
    """What a task actor keeps to route notifications without a query per message."""

    row: asyncpg.Record
    tracks: Tracks
    watches: dict[str, WatchValue] = field(default_factory=dict)
    assignees: set[str] = field(default_factory=set)
    # Authors of at least one visible message here (§8.7 implicit participation, strand_participants).
    participants: set[str] = field(default_factory=set)
    # Members whose participant (read-state) row exists.
    participant_rows: set[str] = field(default_factory=set)


async def load_strand_state(conn: asyncpg.Connection, scope_id: str) -> StrandState | None:
    row = await strand_row(conn, scope_id)
    if row is None:
        return None
    watches = {r["watcher_member_id"]: WatchValue(r["level"], r["level_public"]) for r in await conn.fetch(
        "SELECT watcher_member_id, level, level_public FROM strand_watches WHERE scope_id = $1", scope_id)}
    assignees = {r["member_id"] for r in await conn.fetch(
        "SELECT member_id FROM strand_assignments WHERE scope_id = $1 AND state = 'active'", scope_id)}
    participants = {r["author_member_id"] for r in await conn.fetch(
        "SELECT DISTINCT author_member_id FROM scope_messages WHERE scope_id = $1 AND state = 'visible'", scope_id)}
    return StrandState(row, row_tracks(row), watches, assignees, participants,
                       await participant_members(conn, scope_id))


async def audit(conn: asyncpg.Connection, workspace_id: str, scope_id: str, actor: str, action: str,
                target: str | None, details: dict) -> None:
    await conn.execute(
        "INSERT INTO strand_audit_events (id, workspace_id, scope_id, actor_member_id, action, target_member_id, "
        "details) VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)",
        new_id("sau"), workspace_id, scope_id, actor, action, target, json.dumps(details))


# --- assignment (§7.1) ----------------------------------------------------------------------------

async def assign(conn: asyncpg.Connection, workspace_id: str, scope_id: str, member_id: str, by: str) -> str:
    assignment_id = new_id("asg")
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO strand_assignments (id, workspace_id, scope_id, member_id, assigned_by_member_id) "
                "VALUES ($1, $2, $3, $4, $5)", assignment_id, workspace_id, scope_id, member_id, by)
    except asyncpg.UniqueViolationError:
        raise Conflict("already_assigned", "already assigned") from None
    return assignment_id


async def unassign(conn: asyncpg.Connection, scope_id: str, assignment_id: str, by: str) -> str:
    member_id = await conn.fetchval(
        "UPDATE strand_assignments SET state = 'tombstoned', removed_at = now(), removed_by_member_id = $3 "
        "WHERE scope_id = $1 AND id = $2 AND state = 'active' RETURNING member_id", scope_id, assignment_id, by)
    if member_id is None:
        raise NotFound("assignment")
    return member_id


async def assignments(conn: asyncpg.Connection, scope_ids: list[str]) -> dict[str, list[asyncpg.Record]]:
    out: dict[str, list[asyncpg.Record]] = {}
    for row in await conn.fetch(
            "SELECT id, scope_id, member_id FROM strand_assignments WHERE scope_id = ANY($1::text[]) "
            "AND state = 'active' ORDER BY created_at, id", scope_ids):
        out.setdefault(row["scope_id"], []).append(row)
    return out


# --- watch (§8) -------------------------------------------------------------------------------------

async def watch_row(conn: asyncpg.Connection, scope_id: str, watcher: str, *,
                    for_update: bool = False) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT level, level_public, revision FROM strand_watches WHERE scope_id = $1 AND watcher_member_id = $2"
        + (" FOR UPDATE" if for_update else ""), scope_id, watcher)


async def write_watch(conn: asyncpg.Connection, workspace_id: str, scope_id: str, watcher: str, value: WatchValue,
                      writer: str) -> int:
    return await conn.fetchval(
        "INSERT INTO strand_watches AS w (scope_id, watcher_member_id, workspace_id, level, level_public, "
        "written_by_member_id) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (scope_id, watcher_member_id) DO UPDATE "
        "SET level = EXCLUDED.level, level_public = EXCLUDED.level_public, revision = w.revision + 1, "
        "written_by_member_id = EXCLUDED.written_by_member_id, updated_at = now() RETURNING revision",
        scope_id, watcher, workspace_id, value.level, value.level_public, writer)


async def watches_of(conn: asyncpg.Connection, scope_id: str, *, readers_only: bool = True) -> list[asyncpg.Record]:
    """The written watches with their watcher's kind (projection filters them, §8.5): of the
    strand's current readers only (access comes before watching, §8.9), unless `readers_only`
    is false (the audited full read)."""
    readers = f"AND {task_reader_sql('w.scope_id', 'w.watcher_member_id')} IS NOT NULL " if readers_only else ""
    return await conn.fetch(
        "SELECT w.watcher_member_id, w.level, w.level_public, w.revision, m.kind FROM strand_watches w "
        "JOIN members m ON m.workspace_id = w.workspace_id AND m.id = w.watcher_member_id "
        f"WHERE w.scope_id = $1 AND m.status = 'active' {readers}ORDER BY w.watcher_member_id", scope_id)


async def my_watches(conn: asyncpg.Connection, scope_ids: list[str], viewer: str) -> dict[str, asyncpg.Record]:
    return {r["scope_id"]: r for r in await conn.fetch(
        "SELECT scope_id, level, level_public FROM strand_watches WHERE scope_id = ANY($1::text[]) "
        "AND watcher_member_id = $2", scope_ids, viewer)}


# --- the default discussion strand (§2.1) -------------------------------------------------------------

async def default_strand(conn: asyncpg.Connection, workspace_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT default_strand_id, revision FROM workspace_default_strands WHERE workspace_id = $1", workspace_id)


async def set_default_strand(conn: asyncpg.Connection, workspace_id: str, strand_id: str | None,
                             expected_given: bool, expected: str | None, by: str) -> None:
    """Whole-value compare-and-set of the pointer; it never dangles (the strand must
    exist here, and not be archived)."""
    current = await conn.fetchrow(
        "SELECT default_strand_id FROM workspace_default_strands WHERE workspace_id = $1 FOR UPDATE", workspace_id)
    if current is None:
        if expected_given and expected is not None:
            raise Conflict("failed_precondition", "no default strand was ever set: omit expected_default_strand_id")
    elif not expected_given or expected != current["default_strand_id"]:
        raise Conflict("failed_precondition", "expected_default_strand_id does not match the current value")
    if strand_id is not None:
        ok = await conn.fetchval("SELECT EXISTS (SELECT 1 FROM strands WHERE workspace_id = $1 AND scope_id = $2 "
                                 "AND state = 'active' FOR KEY SHARE)", workspace_id, strand_id)
        if not ok:
            raise NotFound("strand")
    if current is None:
        # Nothing to lock yet: the first write wins the insert, a concurrent one fails its compare.
        first = await conn.fetchval(
            "INSERT INTO workspace_default_strands (workspace_id, default_strand_id, updated_by_member_id) "
            "VALUES ($1, $2, $3) ON CONFLICT (workspace_id) DO NOTHING RETURNING revision",
            workspace_id, strand_id, by)
        if first is None:
            raise Conflict("failed_precondition", "the default strand changed: read it again")
        return
    await conn.execute(
        "INSERT INTO workspace_default_strands AS d (workspace_id, default_strand_id, updated_by_member_id) "
        "VALUES ($1, $2, $3) ON CONFLICT (workspace_id) DO UPDATE SET default_strand_id = EXCLUDED.default_strand_id, "
        "revision = d.revision + 1, updated_by_member_id = EXCLUDED.updated_by_member_id, updated_at = now()",
        workspace_id, strand_id, by)


async def audited_watches(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                          reader: str) -> list[asyncpg.Record]:
    """Every watch, muted included, for an audit reader: the read is recorded first, in
    the same transaction (§8.5: no full watch read without its audit event)."""
    await audit(conn, workspace_id, scope_id, reader, "watch_audit_read", None, {"purpose": "watch_audit"})
    return await watches_of(conn, scope_id, readers_only=False)


async def readers(conn: asyncpg.Connection, scope_id: str) -> frozenset[str]:
    return await task_readers(conn, scope_id)


def json_value(value: Any) -> Any:
    return _json(value)


# --- audience mentions (§9.4.4): the workspace's declared policy, broadcast grants, their quota -----------

async def audience_policies(conn: asyncpg.Connection, workspace_id: str) -> dict[str, int]:
    """{audience: max_recipients} of the audiences the workspace allows (none: all disabled)."""
    return {r["audience"]: r["max_recipients"] for r in await conn.fetch(
        "SELECT audience, max_recipients FROM audience_mention_policies WHERE workspace_id = $1", workspace_id)}


async def set_audience_policy(conn: asyncpg.Connection, workspace_id: str, audience: str,
                              max_recipients: int | None, by: str) -> None:
    if max_recipients is None:
        await conn.execute("DELETE FROM audience_mention_policies WHERE workspace_id = $1 AND audience = $2",
                           workspace_id, audience)
        return
    await conn.execute(
        "INSERT INTO audience_mention_policies (workspace_id, audience, max_recipients, updated_by_member_id) "
        "VALUES ($1, $2, $3, $4) ON CONFLICT (workspace_id, audience) DO UPDATE SET "
        "max_recipients = EXCLUDED.max_recipients, updated_by_member_id = EXCLUDED.updated_by_member_id, "
        "updated_at = now()", workspace_id, audience, max_recipients, by)


_GRANT_COLUMNS = ("g.id, g.member_id, g.channel_id, g.max_operations, g.period_seconds, g.granted_by_member_id, "
                  "g.created_at, g.expires_at, g.revoked_at")


async def create_audience_grant(conn: asyncpg.Connection, workspace_id: str, member_id: str, channel_id: str,
                                max_operations: int, period_seconds: int, expires_at: datetime,
                                by: str, now: datetime) -> asyncpg.Record:
    """A grant to an active member of the workspace on one of its channels (not_found otherwise)."""
    row = await conn.fetchrow(
        f"INSERT INTO audience_mention_grants AS g (id, workspace_id, member_id, channel_id, max_operations, "
        f"period_seconds, granted_by_member_id, created_at, expires_at) "
        f"SELECT $1, $2, m.id, c.id, $5, $6, $7, $8, $9 FROM members m JOIN scopes c ON c.workspace_id = m.workspace_id "
        f"AND c.id = $4 AND c.type = 'channel' AND c.status <> 'deleted' "
        f"WHERE m.workspace_id = $2 AND m.id = $3 AND m.status = 'active' RETURNING {_GRANT_COLUMNS}",
        new_id("amg"), workspace_id, member_id, channel_id, max_operations, period_seconds, by, now, expires_at)
    if row is None:
        raise NotFound("member or channel")
    return row


async def revoke_audience_grant(conn: asyncpg.Connection, workspace_id: str, grant_id: str, by: str,
                                now: datetime) -> asyncpg.Record:
    row = await conn.fetchrow(
        f"UPDATE audience_mention_grants g SET revoked_at = $4, revoked_by_member_id = $3 "
        f"WHERE g.workspace_id = $1 AND g.id = $2 AND g.revoked_at IS NULL RETURNING {_GRANT_COLUMNS}",
        workspace_id, grant_id, by, now)
    if row is None:
        if await conn.fetchval("SELECT EXISTS (SELECT 1 FROM audience_mention_grants WHERE workspace_id = $1 "
                               "AND id = $2)", workspace_id, grant_id):
            raise Conflict("already_revoked", "the grant is already revoked")
        raise NotFound("grant")
    return row


async def list_audience_grants(conn: asyncpg.Connection, workspace_id: str,
                               member_id: str | None) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {_GRANT_COLUMNS}, (SELECT count(*) FROM audience_mention_uses u WHERE u.grant_id = g.id) AS uses "
        f"FROM audience_mention_grants g WHERE g.workspace_id = $1 AND ($2::text IS NULL OR g.member_id = $2) "
        f"ORDER BY g.created_at DESC, g.id LIMIT 500", workspace_id, member_id)


async def usable_audience_grant(conn: asyncpg.Connection, workspace_id: str, member_id: str, channel_id: str,
                                now: datetime) -> tuple[str, int] | None:
    """The member's live grant on the channel and how much quota it has left now: the
    grant row is locked, so two sends cannot both take the last use."""
    grant = await conn.fetchrow(
        "SELECT id, max_operations, period_seconds FROM audience_mention_grants WHERE workspace_id = $1 "
        "AND member_id = $2 AND channel_id = $3 AND revoked_at IS NULL AND expires_at > $4 "
        "ORDER BY expires_at DESC, id LIMIT 1 FOR UPDATE", workspace_id, member_id, channel_id, now)
    if grant is None:
        return None
    used = await conn.fetchval(
        "SELECT count(*) FROM audience_mention_uses WHERE grant_id = $1 AND used_at > $2",
        grant["id"], now - timedelta(seconds=grant["period_seconds"]))
    return grant["id"], grant["max_operations"] - used


async def record_audience_uses(conn: asyncpg.Connection, workspace_id: str, uses: list[tuple[str, str]],
                               now: datetime) -> None:
    """(grant_id, message_id) per message that used a grant."""
    if uses:
        await conn.execute(
            "INSERT INTO audience_mention_uses (grant_id, message_id, workspace_id, used_at) "
            "SELECT g, m, $1, $4 FROM unnest($2::text[], $3::text[]) AS t(g, m)",
            workspace_id, [g for g, _ in uses], [m for _, m in uses], now)


# --- agent participation (§9.4.5) ---------------------------------------------------------------------

async def set_participation(conn: asyncpg.Connection, workspace_id: str, agent_id: str, owner: str,
                            accept_third_party_mention: bool) -> int:
    """The controller's selection; only the agent's owner writes it (not_found for anyone else)."""
    is_owner = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM members WHERE workspace_id = $1 AND id = $2 AND kind = 'agent' "
        "AND owner_member_id = $3)", workspace_id, agent_id, owner)
    if not is_owner:
        raise NotFound("agent")
    return await conn.fetchval(
        "INSERT INTO agent_participation_selections AS a (workspace_id, agent_member_id, accept_third_party_mention, "
        "updated_by_member_id) VALUES ($1, $2, $3, $4) ON CONFLICT (workspace_id, agent_member_id) DO UPDATE SET "
        "accept_third_party_mention = EXCLUDED.accept_third_party_mention, version = a.version + 1, "
        "updated_by_member_id = EXCLUDED.updated_by_member_id, updated_at = now() RETURNING version",
        workspace_id, agent_id, accept_third_party_mention, owner)


async def mention_gate(conn: asyncpg.Connection, workspace_id: str,
                       agent_ids: list[str]) -> dict[str, tuple[str | None, bool]]:
    """Each agent's owner and selection; an agent its owner never configured accepts (the
    deployment default)."""
    rows = await conn.fetch(
        "SELECT m.id, m.owner_member_id, coalesce(a.accept_third_party_mention, true) AS accepts FROM members m "
        "LEFT JOIN agent_participation_selections a ON a.workspace_id = m.workspace_id AND a.agent_member_id = m.id "
        "WHERE m.workspace_id = $1 AND m.id = ANY($2::text[])", workspace_id, agent_ids)
    return {r["id"]: (r["owner_member_id"], r["accepts"]) for r in rows}
