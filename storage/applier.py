"""The Applier: the only code that writes message-domain rows
(scope-model.md §6.3).  A guardrail test fails if any other module contains an
INSERT/UPDATE/DELETE on a message-domain table.

In-transaction order for a send batch: allocate seqs → messages and sources →
membership mutations → notification mutations → outbox → scope counters.
Nothing here decides permissions; the Policy did that.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import asyncpg

from domain.plan import CommittedMessage, MembershipMutation, MessagePlan
from storage import attachments as attachment_rows
from storage import search
from storage.errors import Conflict, NotFound
from storage.ids import new_id
from storage.tenancy import WRITABLE_STATES, execution_state_for_share

MESSAGE_DOMAIN_TABLES = (
    "scopes", "scope_channel_profiles", "scope_memberships", "scope_notification_settings",
    "scope_private_grants", "scope_messages", "scope_message_revisions", "scope_message_sources",
    "scope_activity_events", "scope_fanout_outbox", "scope_message_reactions", "conversation_member_states",
    "workspace_message_counters",
)

# The inline owner delivers first; the worker replays only after this grace.
INLINE_GRACE_SECONDS = 30


# --- scope creation ----------------------------------------------------------------------

async def _open_membership(conn: asyncpg.Connection, workspace_id: str, scope_id: str, member_id: str,
                           latest_seq: int, visibility: str = "public", owner_member_id: str | None = None) -> None:
    """A new participation interval: it starts after the current tail, and
    everything already in the scope counts as read (service-account.md §3.2)."""
    await conn.execute(
        "INSERT INTO scope_memberships (id, workspace_id, scope_id, member_id, visibility, owner_member_id, "
        "last_read_seq, effective_from_seq) VALUES ($1, $2, $3, $4, $5, $6, $7::bigint, $7::bigint + 1)",
        new_id("smb"), workspace_id, scope_id, member_id, visibility, owner_member_id, latest_seq,
    )
    await conn.execute(
        "INSERT INTO scope_notification_settings (scope_id, member_id, workspace_id) VALUES ($1, $2, $3) "
        "ON CONFLICT (scope_id, member_id) DO NOTHING",
        scope_id, member_id, workspace_id,
    )


async def open_participant_rows(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                                member_ids: list[str]) -> None:
    """A task's state-only memberships (read cursor, Inbox), created lazily after the
    member was authorized by the task authority; they grant nothing.  A reader of the
    board channel could always read the strand, so nothing of it counts as read yet."""
    if member_ids:
        await conn.execute(
            "INSERT INTO scope_memberships (id, workspace_id, scope_id, member_id, visibility, last_read_seq, "
            "effective_from_seq) SELECT i, $1, $2, m, 'participant', 0, 1 "
            "FROM unnest($3::text[], $4::text[]) AS u(m, i) ON CONFLICT DO NOTHING",
            workspace_id, scope_id, member_ids, [new_id("smb") for _ in member_ids])


async def create_scope(conn: asyncpg.Connection, *, workspace_id: str, type: str, created_by: str | None,
                       members: list[tuple[str, str, str | None]], scope_id: str | None = None) -> str:
    """A scope and its initial memberships [(member_id, visibility, owner_member_id)]
    in one step: for fixtures and benchmarks.  The server creates scopes through
    their actor (insert_scope, then apply_membership_mutations)."""
    scope_id = scope_id or new_id("scp")
    await insert_scope(conn, scope_id=scope_id, workspace_id=workspace_id, type=type, created_by=created_by)
    await apply_membership_mutations(conn, workspace_id, scope_id, [
        MembershipMutation(member_id, "open", visibility, owner) for member_id, visibility, owner in members], 0)
    return scope_id


async def insert_scope(conn: asyncpg.Connection, *, scope_id: str, workspace_id: str, type: str,
                       created_by: str | None, identity_key: str | None = None,
                       parent_scope_id: str | None = None, root_message_id: str | None = None) -> str:
    """The scope row, without memberships.  A DM (identity key) or a thread
    (root message) exists at most once: when another transaction created it
    first, nothing is written and that scope's id is returned instead."""
    inserted = await conn.fetchval(
        "INSERT INTO scopes (id, workspace_id, type, parent_scope_id, root_message_id, identity_key, "
        "created_by_member_id, roster_generation) VALUES ($1, $2, $3, $4, $5, $6, $7, 0) "
        "ON CONFLICT DO NOTHING RETURNING id",
        scope_id, workspace_id, type, parent_scope_id, root_message_id, identity_key, created_by,
    )
    if inserted is not None:
        if root_message_id is not None:
            await conn.execute(
                "UPDATE scope_messages SET thread_scope_id = $3 WHERE scope_id = $1 AND id = $2",
                parent_scope_id, root_message_id, scope_id,
            )
        return inserted
    if identity_key is not None:
        existing = await conn.fetchval("SELECT id FROM scopes WHERE identity_key = $1", identity_key)
    else:
        existing = await conn.fetchval("SELECT id FROM scopes WHERE parent_scope_id = $1 AND root_message_id = $2",
                                       parent_scope_id, root_message_id)
    if existing is None:
        raise Conflict("scope_exists", "a scope with this id exists")
    return existing


async def insert_channel_profile(conn: asyncpg.Connection, *, scope_id: str, workspace_id: str, owner: str,
                                 slug: str, display_name: str, description: str, visibility: str) -> None:
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO scope_channel_profiles (scope_id, workspace_id, slug, display_name, description, "
                "visibility, owner_member_id) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                scope_id, workspace_id, slug, display_name, description, visibility, owner,
            )
    except asyncpg.UniqueViolationError:
        raise Conflict("slug_taken", f"a channel named {slug!r} exists") from None


async def archive_scope(conn: asyncpg.Connection, scope_id: str) -> None:
    await conn.execute(
        "UPDATE scopes SET status = 'archived', archived_at = now(), archived_until_seq = latest_seq, "
        "updated_at = now(), roster_generation = roster_generation + 1 WHERE id = $1",
        scope_id,
    )


async def set_task_scope_status(conn: asyncpg.Connection, scope_id: str, status: str) -> None:
    """A strand's archive or restore: its task scope refuses writes while archived."""
    await conn.execute(
        "UPDATE scopes SET status = $2, archived_at = CASE WHEN $2 = 'archived' THEN now() END, "
        "archived_until_seq = CASE WHEN $2 = 'archived' THEN latest_seq END, updated_at = now(), "
        "roster_generation = roster_generation + 1 WHERE id = $1 AND type = 'task'", scope_id, status)


# --- memberships -------------------------------------------------------------------------

async def apply_membership_mutations(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                                     mutations: list[MembershipMutation], latest_seq: int,
                                     opened_at_seq: dict[str, int] | None = None) -> int:
    """Open/close intervals; every eligibility mutation bumps roster_generation.
    `opened_at_seq` lets a mention-admission include the admitting message."""
    if not mutations:
        return await conn.fetchval("SELECT roster_generation FROM scopes WHERE id = $1", scope_id)
    for mutation in mutations:
        if mutation.action == "open":
            baseline = latest_seq
            if opened_at_seq and mutation.member_id in opened_at_seq:
                baseline = opened_at_seq[mutation.member_id] - 1
            await _open_membership(conn, workspace_id, scope_id, mutation.member_id, baseline,
                                   mutation.visibility, mutation.owner_member_id)
        else:
            closed = await conn.execute(
                "UPDATE scope_memberships SET effective_to_seq = $3, removed_at = now(), updated_at = now() "
                "WHERE scope_id = $1 AND member_id = $2 AND effective_to_seq IS NULL",
                scope_id, mutation.member_id, latest_seq,
            )
            if closed == "UPDATE 0":
                raise NotFound("membership")
    return await conn.fetchval(
        "UPDATE scopes SET roster_generation = roster_generation + 1, updated_at = now() WHERE id = $1 "
        "RETURNING roster_generation",
        scope_id,
    )


async def bump_roster_generation(conn: asyncpg.Connection, scope_id: str) -> int:
    """An eligibility change that is not a membership (a grant, a collaborator)."""
    return await conn.fetchval(
        "UPDATE scopes SET roster_generation = roster_generation + 1, updated_at = now() WHERE id = $1 "
        "RETURNING roster_generation",
        scope_id,
    )


async def bulk_open_memberships(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                                member_ids: list[str]) -> int:
    """Large roster imports (service-account audiences, benchmarks): one statement."""
    latest = await conn.fetchval("SELECT latest_seq FROM scopes WHERE id = $1 FOR UPDATE", scope_id)
    await conn.execute(
        "INSERT INTO scope_memberships (id, workspace_id, scope_id, member_id, last_read_seq, effective_from_seq) "
        "SELECT i, $2, $3, m, $4::bigint, $4::bigint + 1 FROM unnest($1::text[], $5::text[]) AS t(i, m)",
        [new_id("smb") for _ in member_ids], workspace_id, scope_id, latest, member_ids,
    )
    await conn.execute(
        "INSERT INTO scope_notification_settings (scope_id, member_id, workspace_id) "
        "SELECT $1, m, $2 FROM unnest($3::text[]) AS t(m) ON CONFLICT DO NOTHING",
        scope_id, workspace_id, member_ids,
    )
    return await conn.fetchval(
        "UPDATE scopes SET roster_generation = roster_generation + 1 WHERE id = $1 RETURNING roster_generation",
        scope_id,
    )


# --- the send batch ------------------------------------------------------------------------

async def find_idempotent(conn: asyncpg.Connection, scope_id: str,
                          client_ids: list[str]) -> dict[tuple[str, str, str], asyncpg.Record]:
    if not client_ids:
        return {}
    rows = await conn.fetch(
        "SELECT * FROM scope_messages WHERE scope_id = $1 AND client_message_id = ANY($2::text[])",
        scope_id, client_ids,
    )
    return {(r["author_member_id"], r["idempotency_subject_member_id"], r["client_message_id"]): r for r in rows}


async def insert_messages(conn: asyncpg.Connection, workspace_id: str, scope_id: str, plans: list[MessagePlan],
                          attachments: list[list[dict[str, Any]]] | None = None, *,
                          gate: Callable[[int], tuple[str, list]] | None = None) -> list[CommittedMessage] | None:
    """Allocate seqs and insert fresh messages (the caller handled idempotency).
    O(1) rows per message whatever the audience: the message, its sources, its
    search doc, one outbox row (none when silent).  `attachments[i]` (checked and
    locked by the caller) are claimed by message i and described in its metadata.

    `gate` (given the number of its first parameter) makes the statement stand alone,
    outside a transaction: it writes only when the gate's SELECT yields a row, and also
    only when no message of the scope holds one of the plans' client_message_ids (a
    replay is answered by the transactional path); None when nothing was written."""
    count = len(plans)
    ids = [new_id("msg") for _ in plans]
    metadata = [_metadata_for(plan) for plan in plans]
    for message_metadata, claimed in zip(metadata, attachments or ()):
        if claimed:
            message_metadata["attachments"] = claimed
    docs_sql, docs_args = search.docs_insert([
        search.doc_for(message_id=i, workspace_id=workspace_id, scope_id=scope_id, seq=None, workspace_global_seq=None,
                       author_member_id=p.actor.member_id, created_at=None, content=p.intent.content, metadata=m)
        for i, p, m in zip(ids, plans, metadata)], 24, replace=False, numbered_by="numbered")
    # One statement: the seqs, then the messages, their outbox rows and their search docs (their
    # keys on the message are checked at its end).  The workspace counter row stays locked until
    # commit: allocation order == commit order within the workspace (see storage/schema.py); the
    # scope's update reads the counter's new value, and message i of n takes tail - n + i.
    gate_sql, gate_args = gate(24 + len(docs_args)) if gate is not None else ("", [])
    # Keyed as the idempotency index is: (scope, author, subject, client_message_id).
    replay = ("AND NOT EXISTS (SELECT 1 FROM unnest($5::text[], $8::text[], $9::text[]) AS k(a, sub, c) "
              "JOIN scope_messages m ON m.scope_id = $2 AND m.author_member_id = k.a "
              "AND m.idempotency_subject_member_id = k.sub AND m.client_message_id = k.c) "
              if any(p.intent.client_message_id is not None for p in plans) else "")
    counter_source = (f"SELECT $1, $3 WHERE EXISTS (SELECT 1 FROM gate) {replay}"
                      "AND EXISTS (SELECT 1 FROM scopes WHERE id = $2)" if gate is not None else "VALUES ($1, $3)")
    tails = await conn.fetchrow(
        f"WITH {f'gate AS ({gate_sql}), ' if gate is not None else ''}"
        f"g AS (INSERT INTO workspace_message_counters (workspace_id, latest_global_seq) {counter_source} "
        "ON CONFLICT (workspace_id) DO UPDATE SET latest_global_seq = workspace_message_counters.latest_global_seq + $3 "
        "RETURNING latest_global_seq), "
        "tail AS (UPDATE scopes SET latest_seq = latest_seq + $3, latest_global_seq = (SELECT latest_global_seq FROM g), "
        "latest_message_at = now(), updated_at = now() WHERE id = $2 AND EXISTS (SELECT 1 FROM g) "
        "RETURNING latest_seq, latest_global_seq), "
        "numbered AS (SELECT u.i, tail.latest_seq - $3 + u.n AS s, tail.latest_global_seq - $3 + u.n AS g "
        "FROM tail, unnest($4::text[]) WITH ORDINALITY AS u(i, n)), "
        "outbox AS (INSERT INTO scope_fanout_outbox (id, workspace_id, scope_id, message_id, event_ref_type, "
        "event_ref_id, fanout_type, delivery_policy, dedupe_key, payload, execution_generation, next_attempt_at) "
        "SELECT oi, $1, $2, om, ort, ori, oft, odp, odk, op::jsonb, og, now() + make_interval(secs => $23) FROM unnest("
        "$14::text[], $15::text[], $16::text[], $17::text[], $18::text[], $19::text[], $20::text[], $21::text[], "
        f"$22::bigint[]) AS o(oi, om, ort, ori, oft, odp, odk, op, og) WHERE EXISTS (SELECT 1 FROM tail)), "
        f"docs AS ({docs_sql}), "
        "inserted AS (INSERT INTO scope_messages (id, workspace_id, scope_id, seq, workspace_global_seq, "
        "author_member_id, author_type, notify_principal_member_id, idempotency_subject_member_id, client_message_id, "
        "idempotency_payload_digest, message_type, content, metadata) "
        "SELECT t.i, $1, $2, numbered.s, numbered.g, a, at, n, sub, c, d, mt, ct, md::jsonb FROM unnest("
        "$4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::bytea[], $11::text[], "
        "$12::text[], $13::text[]) AS t(i, a, at, n, sub, c, d, mt, ct, md) JOIN numbered ON numbered.i = t.i) "
        "SELECT latest_seq, latest_global_seq, now() AS created_at FROM tail",  # now(): the messages' created_at
        workspace_id, scope_id, count, ids,
        [p.actor.member_id for p in plans], [p.actor.member_kind for p in plans],
        [p.actor.notify_principal_member_id or p.actor.member_id for p in plans],
        [p.actor.idempotency_subject_member_id or p.actor.member_id for p in plans],
        [p.intent.client_message_id for p in plans],
        [p.digest if p.intent.client_message_id is not None else None for p in plans],
        [p.intent.message_type for p in plans], [p.intent.content for p in plans],
        [json.dumps(m) for m in metadata],
        *_message_outbox_columns(ids, plans), INLINE_GRACE_SECONDS, *docs_args, *gate_args,
    )
    if tails is None:
        if gate is not None:
            return None
        raise NotFound("scope")
    scope_tail, global_tail, created_at = tails["latest_seq"], tails["latest_global_seq"], tails["created_at"]
    seqs = range(scope_tail - count + 1, scope_tail + 1)
    global_seqs = range(global_tail - count + 1, global_tail + 1)
    await _insert_sources(conn, workspace_id, scope_id, ids, plans)
    if attachments:
        await attachment_rows.claim(conn, scope_id, [(a["id"], message_id) for message_id, claimed
                                                     in zip(ids, attachments) for a in claimed])
    return [
        CommittedMessage(id=i, workspace_id=workspace_id, scope_id=scope_id, seq=s, workspace_global_seq=g,
                         author_member_id=p.actor.member_id, author_type=p.actor.member_kind,
                         message_type=p.intent.message_type, content=p.intent.content, metadata=m,
                         client_message_id=p.intent.client_message_id, created_at=created_at)
        for i, s, g, p, m in zip(ids, seqs, global_seqs, plans, metadata)
    ]


def _metadata_for(plan: MessagePlan) -> dict[str, Any]:
    metadata = dict(plan.intent.metadata)
    if plan.live_mentions:
        metadata["mentions"] = list(plan.live_mentions)
    if plan.recipients:
        metadata["recipients"] = list(plan.recipients)
    if plan.audience_mentions:
        # The nodes only (§9.4.3): who they reach is decided at commit and never stored.
        metadata["audience_mentions"] = [{"audience": audience, "mention_text_original": f"@{token}"}
                                         for token, audience in plan.audience_mentions]
    if plan.intent.silent:
        metadata["silent"] = True
    return metadata


async def _insert_sources(conn: asyncpg.Connection, workspace_id: str, scope_id: str, ids: list[str],
                          plans: list[MessagePlan]) -> None:
    rows = [(message_id, ordinal, workspace_id, scope_id, source.scope_id, source.seq, source.message_id,
             source.kind, f"{source.kind}:{source.message_id}")
            for message_id, plan in zip(ids, plans) for ordinal, source in enumerate(plan.intent.sources)]
    if rows:
        await conn.executemany(
            "INSERT INTO scope_message_sources (message_id, ordinal, workspace_id, target_scope_id, source_scope_id, "
            "source_seq, source_message_id, source_kind, source_dedupe_key) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            rows,
        )


def _message_outbox_columns(ids: list[str], plans: list[MessagePlan]) -> list[list[Any]]:
    """The outbox rows of fresh messages, as the nine columns insert_messages writes."""
    rows = [(new_id("obx"), message_id, event.event_ref_type, message_id, event.fanout_type, event.policy.value,
             f"{event.fanout_type}:{message_id}",
             json.dumps({"mentions": list(plan.live_mentions),
                         "explain": [[e.member_id, e.reason, e.delivered] for e in plan.explain]}),
             plan.actor.execution_generation)
            for message_id, plan in zip(ids, plans) for event in plan.outbox]
    return [list(column) for column in zip(*rows)] if rows else [[] for _ in range(9)]


async def insert_routed_outbox(conn: asyncpg.Connection, workspace_id: str, scope_id: str, fanout_type: str,
                              generation: int, rows: list[tuple]) -> None:
    """One routed-delivery outbox row per routed message or activity (storage/deliveries.py builds
    them): (id, message_id, ref_type, ref_id, policy, dedupe_key, payload json, grace seconds)."""
    columns = [list(c) for c in zip(*rows)]
    await conn.execute(
        "INSERT INTO scope_fanout_outbox (id, workspace_id, scope_id, message_id, event_ref_type, event_ref_id, "
        "fanout_type, delivery_policy, dedupe_key, payload, execution_generation, next_attempt_at) "
        "SELECT i, $1, $2, m, rt, ri, $3, dp, dk, p::jsonb, $4, now() + make_interval(secs => g) FROM unnest("
        "$5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::int[]) "
        "AS t(i, m, rt, ri, dp, dk, p, g)",
        workspace_id, scope_id, fanout_type, generation, *columns,
    )


async def enqueue_mutation(conn: asyncpg.Connection, workspace_id: str, scope_id: str, message_id: str,
                           fanout_type: str, dedupe_key: str, payload: dict, generation: int) -> None:
    """worker_first_mutation: edits and withdrawals are projected by the outbox worker."""
    await conn.execute(
        "INSERT INTO scope_fanout_outbox (id, workspace_id, scope_id, message_id, event_ref_type, event_ref_id, "
        "fanout_type, delivery_policy, dedupe_key, payload, execution_generation) "
        "VALUES ($1, $2, $3, $4, 'message', $4, $5, 'worker_first_mutation', $6, $7::jsonb, $8) "
        "ON CONFLICT (dedupe_key) DO NOTHING",
        new_id("obx"), workspace_id, scope_id, message_id, fanout_type, dedupe_key, json.dumps(payload), generation,
    )


# --- edits, withdrawal, reactions -------------------------------------------------------------

async def edit_message(conn: asyncpg.Connection, scope_id: str, message_id: str, editor: str, content: str,
                       expected_revision: int, generation: int,
                       metadata: dict[str, Any] | None = None) -> asyncpg.Record:
    """A new revision of the content (and, for a server-written type such as a
    service-account post, of its metadata); id, seq and read frontiers stay."""
    row = await conn.fetchrow(
        "SELECT workspace_id, author_member_id, revision, state, content, metadata FROM scope_messages "
        "WHERE scope_id = $1 AND id = $2 FOR UPDATE",
        scope_id, message_id,
    )
    if row is None:
        raise NotFound("message")
    if row["state"] == "withdrawn":
        raise Conflict("message_withdrawn", "the message was withdrawn")
    if row["revision"] != expected_revision:
        raise Conflict("revision_mismatch", f"the message is at revision {row['revision']}")
    if row["revision"] == 1:  # keep the original before the first edit replaces it
        await conn.execute(
            "INSERT INTO scope_message_revisions (message_id, revision, workspace_id, scope_id, content, metadata, "
            "edited_by_member_id) VALUES ($1, 1, $2, $3, $4, $5, $6)",
            message_id, row["workspace_id"], scope_id, row["content"], row["metadata"], row["author_member_id"],
        )
    revision = row["revision"] + 1
    new_metadata = json.dumps(metadata) if metadata is not None else row["metadata"]
    await conn.execute(
        "INSERT INTO scope_message_revisions (message_id, revision, workspace_id, scope_id, content, metadata, "
        "edited_by_member_id) VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7)",
        message_id, revision, row["workspace_id"], scope_id, content, new_metadata, editor,
    )
    updated = await conn.fetchrow(
        "UPDATE scope_messages SET content = $3, revision = $4, metadata = $5::jsonb, updated_at = now() "
        "WHERE scope_id = $1 AND id = $2 RETURNING *",
        scope_id, message_id, content, revision, new_metadata,
    )
    await search.write_docs(conn, [search.doc_for_row(updated)], replace=True)
    await enqueue_mutation(conn, row["workspace_id"], scope_id, message_id, "message.edited",
                           f"message.edited:{message_id}:{revision}", {"revision": revision}, generation)
    return updated


async def withdraw_message(conn: asyncpg.Connection, scope_id: str, message_id: str, actor: str,
                           generation: int, expected_revision: int | None = None) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT workspace_id, state, revision FROM scope_messages WHERE scope_id = $1 AND id = $2 FOR UPDATE",
        scope_id, message_id,
    )
    if row is None:
        raise NotFound("message")
    if row["state"] == "withdrawn":
        raise Conflict("message_withdrawn", "the message was already withdrawn")
    if expected_revision is not None and row["revision"] != expected_revision:
        raise Conflict("revision_mismatch", f"the message is at revision {row['revision']}")
    # The content becomes unrecoverable (strand-message.md §9.2): erased in the
    # row and in every revision; id, seq, author, read frontier and the
    # idempotency key and digest (no plaintext) stay.
    updated = await conn.fetchrow(
        "UPDATE scope_messages SET state = 'withdrawn', withdrawn_at = now(), withdrawn_by_member_id = $3, "
        "content = '', metadata = '{}'::jsonb, updated_at = now() WHERE scope_id = $1 AND id = $2 RETURNING *",
        scope_id, message_id, actor,
    )
    await conn.execute(
        "UPDATE scope_message_revisions SET content = '', metadata = '{}'::jsonb "
        "WHERE scope_id = $1 AND message_id = $2",
        scope_id, message_id,
    )
    # Unsearchable and its attachments unreadable from this commit on.
    await search.delete_doc(conn, scope_id, message_id)
    await attachment_rows.release(conn, scope_id, message_id)
    # Its pending deliveries are suppressed (re-checked by the worker too), and
    # their routing payload (mentions found in the text) goes with the text.
    await conn.execute(
        "UPDATE scope_fanout_outbox SET payload = '{}'::jsonb, status = CASE WHEN status IN ('pending', 'leased') "
        "THEN 'suppressed' ELSE status END, suppressed_at = CASE WHEN status IN ('pending', 'leased') THEN now() "
        "ELSE suppressed_at END, suppression_reason = CASE WHEN status IN ('pending', 'leased') "
        "THEN 'message_withdrawn' ELSE suppression_reason END, lease_owner = NULL, lease_expires_at = NULL "
        "WHERE scope_id = $1 AND message_id = $2 AND fanout_type = 'message.created'",
        scope_id, message_id,
    )
    await enqueue_mutation(conn, row["workspace_id"], scope_id, message_id, "message.withdrawn",
                           f"message.withdrawn:{message_id}", {}, generation)
    return updated


async def set_reaction(conn: asyncpg.Connection, workspace_id: str, scope_id: str, message_id: str, member_id: str,
                       key: str, add: bool) -> tuple[bool, asyncpg.Record, str | None]:
    """Assert add/remove of (member, message, key); the last committed assertion
    wins.  Returns whether the visible set changed, the message's author,
    global seq and commit time (who may hear of it), and the activity event a
    change wrote.  Removal keeps no row."""
    message = await conn.fetchrow(
        "SELECT state, author_member_id, seq, workspace_global_seq, created_at FROM scope_messages "
        "WHERE scope_id = $1 AND id = $2", scope_id, message_id
    )
    if message is None:
        raise NotFound("message")
    if message["state"] == "withdrawn":
        raise Conflict("message_withdrawn", "the message was withdrawn")
    if add:
        result = await conn.execute(
            "INSERT INTO scope_message_reactions (message_id, member_id, reaction_key, workspace_id, scope_id) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
            message_id, member_id, key, workspace_id, scope_id,
        )
    else:
        result = await conn.execute(
            "DELETE FROM scope_message_reactions WHERE message_id = $1 AND member_id = $2 AND reaction_key = $3",
            message_id, member_id, key,
        )
    changed = not result.endswith(" 0")
    activity_event_id = None
    if changed:
        activity_event_id = await _activity_event(
            conn, workspace_id, scope_id, "reaction.added" if add else "reaction.removed", "message", message_id,
            message_id, member_id, {"key": key})
    return changed, message, activity_event_id


async def assignment_activity(conn: asyncpg.Connection, workspace_id: str, scope_id: str, assignment_id: str,
                              actor_member_id: str, assignee: str) -> str:
    """The activity an assignment is (strand-message §7.1): what the assignee's delivery carries."""
    return await _activity_event(conn, workspace_id, scope_id, "strand.assigned", "strand_assignment",
                                 assignment_id, None, actor_member_id,
                                 {"assignment_id": assignment_id, "strand_id": scope_id, "member_id": assignee})


async def _activity_event(conn: asyncpg.Connection, workspace_id: str, scope_id: str, activity_type: str,
                          ref_type: str, ref_id: str, source_message_id: str | None, actor: str,
                          payload: dict) -> str:
    """A non-message activity event (never for message-created/mentions): its id."""
    activity_seq = await conn.fetchval(
        "INSERT INTO workspace_message_counters (workspace_id, latest_activity_global_seq) VALUES ($1, 1) "
        "ON CONFLICT (workspace_id) DO UPDATE SET "
        "latest_activity_global_seq = workspace_message_counters.latest_activity_global_seq + 1 "
        "RETURNING latest_activity_global_seq",
        workspace_id,
    )
    activity_event_id = new_id("act")
    await conn.execute(
        "INSERT INTO scope_activity_events (id, workspace_id, scope_id, activity_type, activity_ref_type, "
        "activity_ref_id, activity_global_seq, source_message_id, actor_member_id, payload) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb)",
        activity_event_id, workspace_id, scope_id, activity_type, ref_type, ref_id, activity_seq, source_message_id,
        actor, json.dumps(payload),
    )
    return activity_event_id


# --- read state and personal conversation state --------------------------------------------------

async def mark_read(conn: asyncpg.Connection, scope_id: str, member_id: str, seq: int) -> int:
    """Move the cursor forward only, never past the tail; clears manual unread."""
    value = await conn.fetchval(
        "UPDATE scope_memberships SET last_read_seq = GREATEST(last_read_seq, LEAST($3, s.latest_seq)), "
        "updated_at = now() FROM scopes s WHERE s.id = scope_memberships.scope_id "
        "AND scope_memberships.scope_id = $1 AND member_id = $2 AND effective_to_seq IS NULL "
        "RETURNING last_read_seq",
        scope_id, member_id, seq,
    )
    if value is None:
        raise NotFound("membership")
    await conn.execute(
        "UPDATE conversation_member_states SET manual_unread_at = NULL, updated_at = now() "
        "WHERE scope_id = $1 AND member_id = $2 AND manual_unread_at IS NOT NULL",
        scope_id, member_id,
    )
    return value


async def mark_unread(conn: asyncpg.Connection, workspace_id: str, scope_id: str, member_id: str,
                      from_seq: int | None) -> int:
    """Unread from `from_seq` on (or only flag the conversation when None)."""
    value = await conn.fetchval(
        "UPDATE scope_memberships SET last_read_seq = CASE WHEN $3::bigint IS NULL THEN last_read_seq "
        "ELSE LEAST(last_read_seq, GREATEST($3::bigint - 1, 0)) END, updated_at = now() "
        "WHERE scope_id = $1 AND member_id = $2 AND effective_to_seq IS NULL RETURNING last_read_seq",
        scope_id, member_id, from_seq,
    )
    if value is None:
        raise NotFound("membership")
    await set_conversation_state(conn, workspace_id, member_id, scope_id, manual_unread=True)
    return value


async def set_notification_state(conn: asyncpg.Connection, workspace_id: str, scope_id: str, member_id: str,
                                 state: str) -> None:
    await conn.execute(
        "INSERT INTO scope_notification_settings (scope_id, member_id, workspace_id, state) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT (scope_id, member_id) DO UPDATE SET state = EXCLUDED.state, updated_at = now()",
        scope_id, member_id, workspace_id, state,
    )


async def set_conversation_state(conn: asyncpg.Connection, workspace_id: str, member_id: str, scope_id: str, *,
                                 pinned: bool | None = None, hidden: bool | None = None,
                                 manual_unread: bool | None = None) -> None:
    await conn.execute(
        "INSERT INTO conversation_member_states (workspace_id, member_id, scope_id) VALUES ($1, $2, $3) "
        "ON CONFLICT DO NOTHING",
        workspace_id, member_id, scope_id,
    )
    await conn.execute(
        "UPDATE conversation_member_states c SET "
        "pinned_at = CASE WHEN $4::boolean IS NULL THEN pinned_at WHEN $4 THEN coalesce(pinned_at, now()) END, "
        "hidden_at = CASE WHEN $5::boolean IS NULL THEN hidden_at WHEN $5 THEN now() END, "
        "hidden_through_seq = CASE WHEN $5::boolean IS NULL THEN hidden_through_seq WHEN $5 THEN "
        "(SELECT latest_seq FROM scopes WHERE id = $3) END, "
        "manual_unread_at = CASE WHEN $6::boolean IS NULL THEN manual_unread_at WHEN $6 THEN now() END, "
        "updated_at = now() WHERE workspace_id = $1 AND member_id = $2 AND scope_id = $3",
        workspace_id, member_id, scope_id, pinned, hidden, manual_unread,
    )


# --- outbox settlement (the worker and the inline owner) -------------------------------------------

async def settle_delivered(conn: asyncpg.Connection, outbox_ids: list[str]) -> None:
    await conn.execute(
        "UPDATE scope_fanout_outbox SET status = 'delivered', delivered_at = now(), lease_owner = NULL, "
        "lease_expires_at = NULL, attempts = attempts + 1 WHERE id = ANY($1::text[]) AND status IN ('pending', 'leased')",
        outbox_ids,
    )


async def settle_inline_delivered(conn: asyncpg.Connection, scope_id: str, message_ids: list[str]) -> None:
    """The inline owner delivered these messages' message.created events.
    (scope_id, message_id) keeps the plan on the message index whatever the statistics say."""
    await conn.execute(
        "UPDATE scope_fanout_outbox SET status = 'delivered', delivered_at = now(), attempts = attempts + 1 "
        "WHERE scope_id = $1 AND message_id = ANY($2::text[]) AND fanout_type = 'message.created' "
        "AND status = 'pending'",
        scope_id, message_ids,
    )


async def settle_inline_delivered_many(conn: asyncpg.Connection, scope_ids: list[str], message_ids: list[str]) -> None:
    """settle_inline_delivered for the (scope, message) pairs of many scopes at once."""
    await conn.execute(
        "UPDATE scope_fanout_outbox o SET status = 'delivered', delivered_at = now(), attempts = o.attempts + 1 "
        "FROM unnest($1::text[], $2::text[]) AS t(scope_id, message_id) WHERE o.scope_id = t.scope_id "
        "AND o.message_id = t.message_id AND o.fanout_type = 'message.created' AND o.status = 'pending'",
        scope_ids, message_ids,
    )


async def lease_due(conn: asyncpg.Connection, owner: str, limit: int, lease_seconds: float) -> list[asyncpg.Record]:
    return await conn.fetch(
        "UPDATE scope_fanout_outbox SET status = 'leased', lease_owner = $1, "
        "lease_expires_at = now() + make_interval(secs => $3) WHERE id IN ("
        " SELECT id FROM scope_fanout_outbox WHERE status IN ('pending', 'leased') AND next_attempt_at <= now() "
        " AND (status = 'pending' OR lease_expires_at < now()) ORDER BY next_attempt_at LIMIT $2 "
        " FOR UPDATE SKIP LOCKED) RETURNING *",
        owner, limit, lease_seconds,
    )


async def settle_suppressed(conn: asyncpg.Connection, outbox_id: str, reason: str) -> None:
    await conn.execute(
        "UPDATE scope_fanout_outbox SET status = 'suppressed', suppressed_at = now(), suppression_reason = $2, "
        "lease_owner = NULL, lease_expires_at = NULL WHERE id = $1",
        outbox_id, reason,
    )


async def suppress_if_fenced(conn: asyncpg.Connection, outbox_id: str, workspace_id: str,
                             generation: int) -> str | None:
    """Right before a side effect (workspace-multi-tenant §10.3): a row written
    under an older execution generation, or in a fenced or inactive workspace,
    causes none; it is settled as suppressed and the reason returned."""
    state = await execution_state_for_share(conn, workspace_id)
    if generation != state["active_generation"]:
        reason = "stale_execution_generation"
    elif state["write_fenced"] or state["state"] not in WRITABLE_STATES:
        reason = "workspace_fenced"
    else:
        return None
    await settle_suppressed(conn, outbox_id, reason)
    return reason


async def settle_failed_attempt(conn: asyncpg.Connection, outbox_id: str, error: str, backoff_seconds: float) -> None:
    await conn.execute(
        "UPDATE scope_fanout_outbox SET attempts = attempts + 1, last_error = $2, lease_owner = NULL, "
        "lease_expires_at = NULL, next_attempt_at = now() + make_interval(secs => $3), "
        "status = CASE WHEN attempts + 1 >= max_attempts THEN 'failed' ELSE 'pending' END WHERE id = $1",
        outbox_id, error[:2000], backoff_seconds,
    )


async def delete_scope(conn: asyncpg.Connection, scope_id: str) -> None:
    """Erase a scope and every message-domain row of it, for good (a service
    account's permanent delete, service-account.md §2.5).  Its routed deliveries
    go first (storage/deliveries.py); a forward of one of its messages elsewhere
    keeps its frozen copy but loses the source reference."""
    for table in ("scope_fanout_outbox", "scope_message_reactions", "scope_activity_events",
                  "scope_message_revisions", "conversation_member_states", "scope_notification_settings",
                  "scope_memberships"):
        await conn.execute(f"DELETE FROM {table} WHERE scope_id = $1", scope_id)
    await conn.execute("DELETE FROM scope_message_sources WHERE target_scope_id = $1 OR source_scope_id = $1",
                       scope_id)
    await conn.execute("DELETE FROM scope_messages WHERE scope_id = $1", scope_id)
    await conn.execute("DELETE FROM scopes WHERE id = $1", scope_id)
    # Its lease goes too: an actor still holding it fails its next fence and stops.
    await conn.execute("DELETE FROM scope_leases WHERE scope_id = $1", scope_id)
