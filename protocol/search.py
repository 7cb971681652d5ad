"""Message search (scope-model.md §3.15, §3.16; service-account.md §5.4).

`message.search` finds the messages you may read — through the same readable
predicate as `message.history`, so a private agent finds only what it may read
— newest first.

The query:
- words are matched whole, ignoring case (`websearch_to_tsquery` syntax on the
  `simple` configuration: `"a phrase"`, `-word` excludes, `or` between words);
- Chinese, Japanese, Korean, Thai and other text written without spaces is
  found by substring: `搜索` finds `全文搜索功能` (with `-` and `or` as for words);
- `has:attachment` and `mentions:me` in the query are the same as the fields
  `has_attachment` and `mentions_me`;
- attachment labels (default: the filename) are searched with the content.

Filters: `scope_id`, `author_member_id`, `after_ms`/`before_ms` (the message's
creation time, milliseconds since the epoch, after inclusive, before exclusive),
`has_attachment`, `mentions_me`.  A query with neither words nor a filter
answers `invalid` (reason `empty_query`).

Only messages you may read are examined: the readable predicate runs while
matching, so messages you cannot read never show in `has_more`, the cursor or
the budget.  Each call examines at most the deployment's candidate budget of
readable matches; `candidate_budget_exhausted` with `has_more` means "call again
with `next_cursor`".  The cursor is opaque and stable: messages sent meanwhile
never shift a page.  A withdrawn message is
unsearchable from its withdrawal's commit; an edit is searchable by its new text
from its commit.

Search is unavailable for a scope whose index is being built after an upgrade
(`scopewire search backfill` / `finalize`): searching that scope answers
`unavailable` (reason `search_not_ready`); a workspace-wide search leaves it out
and says `complete: false`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.frames import Cursor, Id, MessageInfo, Request, WorkspaceRequest

Query = Annotated[str, msgspec.Meta(max_length=500)]
SearchLimit = Annotated[int, msgspec.Meta(ge=1, le=50)]
EpochMs = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Span = Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]


class MessageSearch(WorkspaceRequest, tag="message.search"):
    """Search the messages you may read (see the module description for the query)."""

    query: Query = ""
    scope_id: Id | None = None
    author_member_id: Id | None = None
    after_ms: EpochMs | None = None
    before_ms: EpochMs | None = None
    has_attachment: bool | None = None
    mentions_me: bool = False
    cursor: Cursor | None = None
    limit: SearchLimit = 20


FRAMES = (MessageSearch,)


class SearchHit(msgspec.Struct):
    message: MessageInfo
    # Up to ~200 characters of the content around the first match, and the matches in
    # it as [start, end) offsets in code points.
    snippet: str
    highlights: list[Span]


class SearchPage(msgspec.Struct, omit_defaults=True):
    hits: list[SearchHit]
    has_more: bool
    candidate_budget_exhausted: bool
    complete: bool
    next_cursor: str | None = None


RESULTS: dict[type[Request], type[msgspec.Struct]] = {MessageSearch: SearchPage}
