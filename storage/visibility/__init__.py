"""The one visibility rule: who may read a scope and who is entitled to its
events (SPEC rule 6).  Every read surface — history, permalink, revisions,
reactions, inbox, scope.get / scope.members / channel.list, the workspace feed,
subscribe and replay fills, read checks — and the fanout roster (the scope
actor's roster, the outbox worker's, ephemeral signals) is decided here, in
SQL.  Nothing outside this package reads scope_memberships (a guardrail test checks it);
the private-agent rules (owner-private visibility, grants, People
collaborators) live in this package.

Using a scope at all needs a current (open) membership in it, held by a member
who is still active in the workspace.  The second half makes a removal take
effect at once, before the actors have closed the member's intervals (and if
the process died before they could: the departed-member sweep closes them).
Which messages a member reads is the readable predicate's question
(predicate.py): everything for a public member, the owner-private windows for
a private agent.  authority.py loads the windows a scope actor caches; the
package's other modules answer the owner-bounded collaborator views and the
lazy `@` / context-state resolvers.
"""

from __future__ import annotations

import asyncpg

from domain.plan import RosterEntry
from storage.visibility import tasks
from storage.visibility.authority import scope_authority
from storage.visibility.predicate import (
    entitled_for_message,
    explain_message,
    fetch_custom_plan,
    fetch_generic_plan,
    followers_entitled,
    message_readable_sql,
    message_visibility_sql,
    ReaderWindows,
    private_entry_holds_sql,
    private_reader_windows,
    public_reader_sql,
    quoted_sources_sql,
    readable_join,
    readable_scope_sets,
    scope_readable_sql,
)

__all__ = [
    "ENTITLED_MEMBERSHIPS", "INBOX_MEMBERSHIPS", "entitled_for_message", "entitled_roster", "explain_message", "fetch_custom_plan", "fetch_generic_plan",
    "followers_entitled",
    "message_readable_sql", "message_visibility_sql", "ReaderWindows", "private_reader_windows", "public_reader_sql", "public_rosters", "quoted_sources_sql", "readable_join", "readable_scope_sets", "roster_entries", "roster_entries_of",
    "scope_authority",
    "scope_members", "scope_readable_sql", "typing_audience", "viewer_membership",
]

# The memberships that grant reading and delivery, as a relation usable in any FROM
# (a task's 'participant' rows grant nothing: storage/visibility/tasks.py decides tasks).
# `{m}` a scope_memberships row joined to its member `{mem}` (the same rule, for a query
# that reads the member's columns too).
ENTITLED_MEMBERSHIP_JOIN = (
    "scope_memberships {m} JOIN members {mem} ON {mem}.workspace_id = {m}.workspace_id AND {mem}.id = {m}.member_id "
    "AND {m}.effective_to_seq IS NULL AND {mem}.status = 'active' AND {m}.visibility <> 'participant'"
)
ENTITLED_MEMBERSHIPS = f"(SELECT em.* FROM {ENTITLED_MEMBERSHIP_JOIN.format(m='em', mem='emm')})"

# The Inbox's memberships: the entitled ones and the state rows of the tasks the member reads.
INBOX_MEMBERSHIPS = (
    f"(SELECT * FROM {ENTITLED_MEMBERSHIPS} ie UNION ALL SELECT ip.* FROM scope_memberships ip "
    f"WHERE ip.visibility = 'participant' AND ip.effective_to_seq IS NULL "
    f"AND {tasks.task_reader_sql('ip.scope_id', 'ip.member_id')} IS NOT NULL)"
)


async def entitled_roster(conn: asyncpg.Connection, scope_id: str) -> frozenset[str]:
    """The members entitled to the scope's events."""
    return frozenset(await roster_entries(conn, scope_id))


async def public_rosters(conn: asyncpg.Connection, scope_ids: list[str]) -> dict[str, tuple[int, frozenset[str]]]:
    """Each scope's roster generation with its public members (a task has none of its
    own: left out), in one statement so that both come from one snapshot."""
    rows = await conn.fetch(
        f"SELECT s.id, s.roster_generation, array(SELECT r.member_id FROM {ENTITLED_MEMBERSHIPS} r "
        f"WHERE r.scope_id = s.id AND r.visibility = 'public') AS members "
        f"FROM scopes s WHERE s.id = ANY($1::text[]) AND s.type <> 'task'",
        scope_ids,
    )
    return {r["id"]: (r["roster_generation"], frozenset(r["members"])) for r in rows}


async def roster_entries(conn: asyncpg.Connection, scope_id: str) -> dict[str, RosterEntry]:
    """The scope actor's roster: who may write here and receives its events."""
    roster = _rosters(await conn.fetch(_ROSTER.format(scopes="r.scope_id = $1"), scope_id)).get(scope_id, {})
    if all(entry.visibility == "private" for entry in roster.values()) and await _is_task(conn, scope_id):
        # A task's readers come from its board channel; its own rows that grant anything are
        # private agents' admissions, which count while they hold (private_entry_holds_sql).
        return {**await tasks.task_roster_entries(conn, scope_id), **await _task_private_entries(conn, scope_id)}
    return roster


async def _task_private_entries(conn: asyncpg.Connection, scope_id: str) -> dict[str, RosterEntry]:
    return _rosters(await conn.fetch(_ROSTER.format(
        scopes=f"r.scope_id = $1 AND r.visibility = 'private' AND {private_entry_holds_sql('r.member_id', '$1')}"),
        scope_id)).get(scope_id, {})


async def roster_entries_of(conn: asyncpg.Connection, scope_ids: list[str]) -> dict[str, dict[str, RosterEntry]]:
    """roster_entries of many scopes in one statement, but a task's readers (they come from its board)."""
    # Scope by scope (a lateral join): with the scopes as an array the planner joined all their
    # memberships at once, ~3× the cost per row of the one-scope plan.
    return _rosters(await conn.fetch(
        f"SELECT roster.* FROM unnest($1::text[]) AS wanted(scope_id) CROSS JOIN LATERAL "
        f"({_ROSTER.format(scopes='r.scope_id = wanted.scope_id')}) roster", scope_ids))


# The state by a keyed lookup per member, not a join: right after a bulk open (a service
# account's audience) the settings table has no statistics yet, and the join's plan was
# quadratic — 6.7 s for a 9,000-member roster instead of 30 ms (bench/service_accounts.py).
# One scope is `= $1`, not a one-element array: that plan is kept generic, an array's was
# planned again on every call.
_ROSTER = (
    "SELECT r.scope_id, r.member_id, mem.kind, r.visibility, r.owner_member_id, r.last_read_seq, "
    "r.effective_from_seq, coalesce((SELECT n.state FROM scope_notification_settings n "
    "WHERE n.scope_id = r.scope_id AND n.member_id = r.member_id), 'active') AS notification_state "
    f"FROM {ENTITLED_MEMBERSHIP_JOIN.format(m='r', mem='mem')} WHERE {{scopes}}"
)


def _rosters(rows: list[asyncpg.Record]) -> dict[str, dict[str, RosterEntry]]:
    rosters: dict[str, dict[str, RosterEntry]] = {}
    for r in rows:
        rosters.setdefault(r["scope_id"], {})[r["member_id"]] = RosterEntry(
            r["member_id"], r["kind"], r["visibility"], r["owner_member_id"], r["last_read_seq"],
            r["effective_from_seq"], r["notification_state"])
    return rosters


async def typing_audience(conn: asyncpg.Connection, scope_id: str, typist: str) -> frozenset[str]:
    """Who sees `typist` typing here: the public members, and the private agents
    that would read what the typist is writing — the typist's own agents (a
    grantee's or collaborator's typing is not worth a window lookup per signal)."""
    rows = await conn.fetch(
        f"SELECT r.member_id, r.visibility FROM {ENTITLED_MEMBERSHIPS} r WHERE r.scope_id = $1 "
        f"AND (r.visibility = 'public' OR r.owner_member_id = $2 OR r.member_id = $2)",
        scope_id, typist,
    )
    audience = frozenset(r["member_id"] for r in rows)
    if all(r["visibility"] == "private" for r in rows) and await _is_task(conn, scope_id):
        return audience | await tasks.task_readers(conn, scope_id)  # a task's public readers come from its board
    return audience


async def scope_members(conn: asyncpg.Connection, scope_id: str, *,
                        include_private: bool = False) -> list[asyncpg.Record]:
    """Current public members; with include_private also the private ones, which
    carry their owner (scope-model §3.3: a public list never shows them).  A task's are its
    readers and the private agents admitted there."""
    if await _is_task(conn, scope_id):
        entries = await roster_entries(conn, scope_id)
        shown = sorted(m for m, e in entries.items() if include_private or e.visibility == "public")
        rows = await conn.fetch("SELECT mem.id AS member_id, mem.handle, mem.display_name, mem.kind FROM members mem "
                                "WHERE mem.id = ANY($1::text[]) ORDER BY mem.id", shown)
        return [{**r, "visibility": entries[r["member_id"]].visibility,
                 "owner_member_id": entries[r["member_id"]].owner_member_id,
                 "effective_from_seq": entries[r["member_id"]].effective_from_seq} for r in rows]
    return await conn.fetch(
        f"SELECT r.member_id, mem.handle, mem.display_name, mem.kind, r.visibility, r.owner_member_id, "
        f"r.effective_from_seq FROM {ENTITLED_MEMBERSHIPS} r JOIN members mem ON mem.workspace_id = r.workspace_id "
        f"AND mem.id = r.member_id WHERE r.scope_id = $1 AND ($2 OR r.visibility = 'public') ORDER BY r.member_id",
        scope_id, include_private,
    )


async def viewer_membership(conn: asyncpg.Connection, scope_id: str, viewer: str) -> asyncpg.Record | None:
    """The viewer's read state in the scope, if the membership grants reading (a task's
    reader: its participant row's cursor, 0 before it has one)."""
    row = await conn.fetchrow(
        f"SELECT r.last_read_seq, r.effective_from_seq, r.visibility, r.owner_member_id FROM {ENTITLED_MEMBERSHIPS} r "
        f"WHERE r.scope_id = $1 AND r.member_id = $2",
        scope_id, viewer,
    )
    if row is not None or not await _is_task(conn, scope_id) or not await tasks.is_task_reader(conn, scope_id,
                                                                                                viewer):
        return row
    return await conn.fetchrow(
        "SELECT coalesce((SELECT p.last_read_seq FROM scope_memberships p WHERE p.scope_id = $1 "
        "AND p.member_id = $2 AND p.effective_to_seq IS NULL), 0) AS last_read_seq, 1::bigint AS "
        "effective_from_seq, 'public' AS visibility, NULL::text AS owner_member_id", scope_id, viewer)


async def _is_task(conn: asyncpg.Connection, scope_id: str) -> bool:
    return bool(await conn.fetchval("SELECT type = 'task' FROM scopes WHERE id = $1", scope_id))


# --- memberships that no longer grant anything (closed by the departed-member path) ----------------------

async def scopes_with_open_membership(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT scope_id FROM scope_memberships WHERE workspace_id = $1 AND member_id = $2 "
        "AND effective_to_seq IS NULL ORDER BY scope_id",
        workspace_id, member_id,
    )
    return [r["scope_id"] for r in rows]


async def departed_members_with_open_memberships(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    """(workspace_id, member_id) of members no longer active in their workspace
    who still hold an open scope membership: what a removal left behind when the
    process died before closing them."""
    return await conn.fetch(
        "SELECT DISTINCT mem.workspace_id, mem.id AS member_id FROM members mem "
        "JOIN scope_memberships sm ON sm.workspace_id = mem.workspace_id AND sm.member_id = mem.id "
        "AND sm.effective_to_seq IS NULL WHERE mem.status <> 'active' ORDER BY 1, 2"
    )


async def departed_among(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                         member_ids: list[str]) -> list[str]:
    """Which of `member_ids` hold an open membership here but are no longer active
    members of the workspace (read in the closing transaction: a re-invitation
    that committed first keeps the membership open)."""
    rows = await conn.fetch(
        "SELECT sm.member_id FROM scope_memberships sm JOIN members mem ON mem.workspace_id = sm.workspace_id "
        "AND mem.id = sm.member_id WHERE sm.workspace_id = $1 AND sm.scope_id = $2 AND sm.member_id = ANY($3::text[]) "
        "AND sm.effective_to_seq IS NULL AND mem.status <> 'active' ORDER BY sm.member_id FOR SHARE OF mem",
        workspace_id, scope_id, member_ids,
    )
    return [r["member_id"] for r in rows]


# --- a service account's audience (service-account.md §3) -----------------------------------------------

async def open_members_among(conn: asyncpg.Connection, scope_id: str, member_ids: list[str]) -> set[str]:
    """Which of `member_ids` hold an open membership in the scope (the reconciler's diff)."""
    rows = await conn.fetch(
        "SELECT member_id FROM scope_memberships WHERE scope_id = $1 AND member_id = ANY($2::text[]) "
        "AND effective_to_seq IS NULL",
        scope_id, member_ids,
    )
    return {r["member_id"] for r in rows}


async def open_member_count(conn: asyncpg.Connection, scope_id: str) -> int:
    """Members the scope's messages reach now."""
    return await conn.fetchval(f"SELECT count(*) FROM {ENTITLED_MEMBERSHIPS} r WHERE r.scope_id = $1", scope_id)
