"""Task authority (collaborator-policy §4.2.1): who reads and writes a task scope.

A task scope's readers are not its own members: they are the active, public
members of its board's channel, resolved here, server side, Task → board →
Channel, and only when the three agree (strands.channel_id = the board's
channel = the task scope's parent).  Every miss — another channel's id, another
workspace, a board that disagrees with the task, an inactive member, a member
who left the channel — reads as no access, the same answer whatever the cause.
A task's own memberships (visibility 'participant') carry read state only and
grant nothing.  Archived tasks, boards and channels stay readable to humans and
close to agents (SPEC §5 decision 11).

A private agent is never a reader by the board: it enters a task scope the way
it enters a thread (scope-model §5.2), with a private membership of its own,
admitted by an authorized live mention or explicit recipient while it is a
private member of the board channel; what it reads there is the owner-private
predicate's question, and only while the task is open to agents
(`task_open_to_agents_sql`).

Every read and fanout surface that meets a task scope uses these fragments;
predicate.py folds them into the one readable predicate.
"""

from __future__ import annotations

import asyncpg

from domain.plan import RosterEntry


def _task_agrees(task_scope: str, joins: str = "") -> str:
    """FROM/WHERE body: the strand of `task_scope` with its board and channel (and
    `joins`), when the three agree and neither task nor channel is deleted.
    Its aliases (ta_*) are its own: the caller's expressions are correlated into it
    and must never be shadowed by them (an outer `st.scope_id` read as the inner
    strand would make every strand readable to whoever reads one).

    Each step is a one-row lookup from the strand, written as a LATERAL subquery kept
    apart by OFFSET 0 rather than as a join: the planner then has no join order to
    search.  As joins, these fragments (three of them in the readable predicate) made
    most of its planning time — which every pooled connection pays again whenever
    autovacuum passes over a table the statement reads."""
    return (
        f"FROM strands ta_st "
        f"CROSS JOIN LATERAL (SELECT ta_b.channel_id, ta_b.status FROM task_boards ta_b "
        f"WHERE ta_b.workspace_id = ta_st.workspace_id AND ta_b.id = ta_st.board_id "
        f"AND ta_b.channel_id = ta_st.channel_id OFFSET 0) ta_tb "
        f"CROSS JOIN LATERAL (SELECT ta_t.id FROM scopes ta_t WHERE ta_t.id = ta_st.scope_id "
        f"AND ta_t.parent_scope_id = ta_tb.channel_id AND ta_t.workspace_id = ta_st.workspace_id "
        f"AND ta_t.status <> 'deleted' OFFSET 0) ta_ts "
        f"CROSS JOIN LATERAL (SELECT ta_c.status FROM scopes ta_c WHERE ta_c.id = ta_tb.channel_id "
        f"AND ta_c.workspace_id = ta_st.workspace_id AND ta_c.status <> 'deleted' OFFSET 0) ta_ch {joins}"
        f"WHERE ta_st.scope_id = {task_scope} "
    )


# Agents work in a task only while strand, board and channel are all active.
_OPEN_TO_AGENTS = "ta_st.state = 'active' AND ta_tb.status = 'active' AND ta_ch.status = 'active'"


def _task_readers(task_scope: str, member: str | None) -> str:
    """FROM/WHERE body: the board channel's readers of task `task_scope` (one, with `member`)."""
    only = f"AND ta_m.member_id = {member} " if member is not None else ""
    return _task_agrees(task_scope, (
        f"CROSS JOIN LATERAL (SELECT ta_m.member_id FROM scope_memberships ta_m "
        f"WHERE ta_m.scope_id = ta_tb.channel_id AND ta_m.effective_to_seq IS NULL "
        f"AND ta_m.visibility = 'public' {only}OFFSET 0) ta_cm "
        f"CROSS JOIN LATERAL (SELECT ta_v.kind FROM members ta_v WHERE ta_v.workspace_id = ta_st.workspace_id "
        f"AND ta_v.id = ta_cm.member_id AND ta_v.status = 'active' "
        f"AND ta_v.visibility IS DISTINCT FROM 'private' OFFSET 0) ta_vm "
    )) + f"AND (ta_vm.kind = 'human' OR ({_OPEN_TO_AGENTS}))"


def task_open_to_agents_sql(task_scope: str) -> str:
    """SQL: does the task scope `task_scope` agree with its board and channel, all three active?"""
    return f"EXISTS (SELECT 1 {_task_agrees(task_scope)} AND {_OPEN_TO_AGENTS})"


def task_reader_sql(task_scope: str, viewer: str) -> str:
    """Text 'board_channel' when `viewer` reads the task scope `task_scope`, else NULL."""
    return f"(SELECT 'board_channel' {_task_readers(task_scope, viewer)})"


async def task_readers(conn: asyncpg.Connection, scope_id: str) -> frozenset[str]:
    rows = await conn.fetch(f"SELECT ta_cm.member_id {_task_readers('$1', None)}", scope_id)
    return frozenset(r["member_id"] for r in rows)


async def task_roster_entries(conn: asyncpg.Connection, scope_id: str) -> dict[str, RosterEntry]:
    """A task actor's roster: its readers, with their read cursor (a participant row,
    if they have one) and their notification state in the task."""
    rows = await conn.fetch(
        f"SELECT ta_cm.member_id, ta_vm.kind, "
        f"coalesce((SELECT p.last_read_seq FROM scope_memberships p WHERE p.scope_id = ta_st.scope_id "
        f"AND p.member_id = ta_cm.member_id AND p.effective_to_seq IS NULL), 0) AS last_read_seq, "
        f"coalesce((SELECT n.state FROM scope_notification_settings n WHERE n.scope_id = ta_st.scope_id "
        f"AND n.member_id = ta_cm.member_id), 'active') AS notification_state {_task_readers('$1', None)}",
        scope_id,
    )
    return {r["member_id"]: RosterEntry(r["member_id"], r["kind"], "public", None, r["last_read_seq"], 1,
                                        r["notification_state"]) for r in rows}


async def is_task_reader(conn: asyncpg.Connection, scope_id: str, member_id: str) -> bool:
    return await conn.fetchval(f"SELECT {task_reader_sql('$1', '$2')} IS NOT NULL", scope_id, member_id)


async def participant_members(conn: asyncpg.Connection, scope_id: str) -> set[str]:
    """Members with a task's state-only row (they grant nothing)."""
    return {r["member_id"] for r in await conn.fetch(
        "SELECT member_id FROM scope_memberships WHERE scope_id = $1 AND effective_to_seq IS NULL "
        "AND visibility = 'participant'", scope_id)}


def channel_member_sql(channel: str, viewer: str) -> str:
    """SQL: is `viewer` an active, public, open member of the channel `channel`?"""
    return (f"EXISTS (SELECT 1 FROM scope_memberships bm JOIN members bmm ON bmm.workspace_id = bm.workspace_id "
            f"AND bmm.id = bm.member_id AND bmm.status = 'active' WHERE bm.scope_id = {channel} "
            f"AND bm.member_id = {viewer} AND bm.effective_to_seq IS NULL AND bm.visibility = 'public')")
