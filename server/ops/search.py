"""`message.search` (protocol/search.py): the query rules are domain/search_text.py's,
the SQL storage/search.py's; every hit passed the readable predicate of history."""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import asyncpg

from domain.search_text import highlight, parse_query
from protocol import search as s
from protocol.errors import ErrorCode, ProtocolError
from server.context import RequestContext
from server.messaging import _check_id, _scope, message_info
from server.rbac import Permission
from server.service_profiles import with_profile
from storage import messages, search, service_accounts

if TYPE_CHECKING:
    from server.app import Connection, Server


def _encode_cursor(global_seq: int) -> str:
    return base64.urlsafe_b64encode(f"s1:{global_seq}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> int:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        version, _, value = text.partition(":")
        global_seq = int(value)
        if version != "s1" or not 0 < global_seq <= 2**62:
            raise ValueError(text)
    except ValueError:
        raise ProtocolError(ErrorCode.INVALID, "cursor: not a cursor of message.search",
                            details={"field": "cursor", "reason": "bad_cursor"}) from None
    return global_seq


# 9999-12-31T23:59:59.999Z, the last instant a timestamp holds: later times mean "the far future".
_LAST_MS = 253_402_300_799_999


def _time(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(min(ms, _LAST_MS) / 1000, timezone.utc)


async def message_search(server: Server, connection: Connection, request: s.MessageSearch,
                         ctx: RequestContext) -> s.SearchPage:
    workspace = ctx.require(Permission.MESSAGE_READ)
    query = parse_query(request.query)
    filters = search.SearchFilters(
        author_member_id=_check_id(request.author_member_id, "mem", "member") if request.author_member_id else None,
        after=_time(request.after_ms), before=_time(request.before_ms),
        has_attachment=True if query.has_attachment else request.has_attachment,
        mentions_me=request.mentions_me or query.mentions_me)
    if request.scope_id is not None:
        _, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
        filters = search.SearchFilters(**{**filters.__dict__, "scope_id": scope["id"]})
        if not await server.db.run(search.scope_search_ready, scope["id"]):
            raise ProtocolError(ErrorCode.UNAVAILABLE, "search is being built for this scope; try again later",
                                details={"reason": "search_not_ready"})
    narrowed = (filters.scope_id, filters.author_member_id, filters.after, filters.before, filters.has_attachment)
    if not query.has_terms and not filters.mentions_me and all(v is None for v in narrowed):
        raise ProtocolError(ErrorCode.INVALID, "query: give words to find or a filter",
                            details={"field": "query", "reason": "empty_query"})
    below = _decode_cursor(request.cursor) if request.cursor is not None else None
    budget = server.config.search_candidate_budget
    workspace_id, viewer = workspace.workspace_id, workspace.member_id

    async def page_of_hits(conn: asyncpg.Connection):
        # One connection for the page's statements: each db.run is a hop to the database thread.
        result = await search.search(conn, workspace_id, viewer, query, filters, below_global_seq=below,
                                     budget=budget, limit=request.limit)
        rows = await messages.readable_messages(conn, workspace_id, viewer, result.message_ids)
        reactions = await messages.reaction_summaries(conn, workspace_id, viewer, [r["id"] for r in rows])
        accounts = await service_accounts.accounts_by_scope(conn, sorted({r["scope_id"] for r in rows}))
        complete = filters.scope_id is not None or await search.workspace_search_complete(conn, workspace_id, viewer)
        return result, rows, reactions, accounts, complete
    result, rows, reactions, accounts, complete = await server.db.run(page_of_hits)
    hits = []
    for row in rows:
        snippet, spans = highlight(row["content"], query)
        hits.append(s.SearchHit(with_profile(message_info(row, reactions.get(row["id"])), accounts), snippet,
                                [list(span) for span in spans]))
    return s.SearchPage(hits=hits, has_more=result.has_more, candidate_budget_exhausted=result.budget_exhausted,
                        complete=complete,
                        next_cursor=_encode_cursor(result.next_global_seq) if result.next_global_seq else None)


HANDLERS = {s.MessageSearch: message_search}
