"""Handlers of the private-agent resolver and diagnostics ops (protocol/private_agents.py).

Each verifies once that the caller reads the scope (`not_found` otherwise, as
server/messaging.py does), resolves the bounded source chain from that row
(the scope, plus its parent channel for a thread: never a sibling thread) and
then runs a constant number of statements whatever the number of candidates,
owners or messages.  Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from protocol import private_agents as p
from protocol.errors import ErrorCode, ProtocolError
from server.context import RequestContext
from server.messaging import _check_id, _ms, _scope
from server.rbac import Permission
from storage import messages, visibility
from storage.errors import NotFound
from storage.visibility import resolvers

if TYPE_CHECKING:
    from server.app import Connection, Server


def _chain(scope: Any) -> list[str]:
    """The scope and, for a thread or task, its parent: the only scopes whose authority applies here."""
    return [scope["id"], scope["parent_scope_id"]] if scope["type"] in ("thread", "task") else [scope["id"]]


def _best(rows: Iterable[Any], chain: list[str]) -> Any | None:
    """The authority row a caller is shown: the predicate's rule order, then the nearest scope."""
    return min(rows, key=lambda r: (resolvers.RELATION_RANK[r["relation"]], chain.index(r["scope_id"])),
               default=None)


async def candidates(server: Server, connection: Connection, request: p.PrivateAgentCandidates,
                     ctx: RequestContext) -> p.PrivateAgentCandidatesResult:
    workspace, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    viewer, chain = workspace.member_id, _chain(scope)
    scanned, truncated = await server.db.run(resolvers.private_agent_candidates, workspace.workspace_id, chain,
                                             viewer, request.prefix)
    # Owner fast path: the viewer's own agents need no authority lookup at all.
    other_owners = sorted({row["owner_member_id"] for row in scanned} - {viewer})
    authority: dict[str, list[Any]] = {}
    if other_owners:
        for row in await server.db.run(resolvers.active_authority, workspace.workspace_id, chain, viewer,
                                       other_owners):
            authority.setdefault(row["owner_member_id"], []).append(row)
    found: list[p.AgentCandidate] = []
    for row in scanned:
        if len(found) == request.limit:
            break
        owner = row["owner_member_id"]
        source = None if owner == viewer else _best(authority.get(owner, ()), chain)
        if owner != viewer and source is None:
            continue
        found.append(p.AgentCandidate(
            member_id=row["id"], handle=row["handle"], display_name=row["display_name"], owner_member_id=owner,
            relation="owner" if source is None else source["relation"],
            source_scope_id=None if source is None else source["scope_id"],
            ref_id=None if source is None else source["ref_id"]))
    return p.PrivateAgentCandidatesResult(candidates=found, scan_exhausted=truncated)


async def contribution(server: Server, connection: Connection, request: p.PrivateAgentContribution,
                       ctx: RequestContext) -> p.PrivateAgentContributionResult:
    workspace, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    owner = _check_id(request.owner_member_id, "mem", "owner_member")
    if owner == workspace.member_id:
        return p.PrivateAgentContributionResult(relation="owner", can_contribute_context=True, can_wake=True,
                                                can_share=True)
    chain = _chain(scope)
    source = _best(await server.db.run(resolvers.contribution_relations, workspace.workspace_id, chain,
                                       workspace.member_id, owner), chain)
    if source is None:
        return p.PrivateAgentContributionResult(relation="none", can_contribute_context=False, can_wake=False,
                                                can_share=False)
    expires_at = source["expires_at"]
    return p.PrivateAgentContributionResult(
        relation=source["relation"], can_contribute_context=True, can_wake=True, can_share=False,
        source_scope_id=source["scope_id"], ref_id=source["ref_id"],
        expires_at_ms=_ms(expires_at) if expires_at is not None else None)


def _context_state(message_id: str, row: Any | None) -> p.MessageContextState:
    if row is None or row["readable_reason"] is None:
        return p.MessageContextState(message_id=message_id, state="not_found", can_share=False)
    # Only a visible message can be shared (a withdrawn one is a tombstone).
    can_share = row["state"] == "visible"
    if row["own_relation"] is not None:
        return p.MessageContextState(message_id=message_id, state="context_eligible", can_share=can_share,
                                     relation=row["own_relation"])
    for relation, ref, scope in (("grant", "grant_id", "grant_scope_id"),
                                 ("collaborator", "collaborator_id", "collaborator_scope_id"),
                                 ("shared", "quote_id", "quote_scope_id")):
        if row[ref] is not None:
            return p.MessageContextState(message_id=message_id, state="context_eligible", can_share=can_share,
                                         relation=relation, source_scope_id=row[scope], ref_id=row[ref])
    return p.MessageContextState(message_id=message_id, state="share_needed", can_share=can_share)


async def context_state(server: Server, connection: Connection, request: p.PrivateAgentContextState,
                        ctx: RequestContext) -> p.PrivateAgentContextStateResult:
    workspace, scope = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    ids = list(dict.fromkeys(_check_id(m, "msg", "message") for m in request.message_ids))
    rows = {row["id"]: row for row in await server.db.run(
        resolvers.message_context_states, workspace.workspace_id, _chain(scope), workspace.member_id, ids)}
    return p.PrivateAgentContextStateResult(states=[_context_state(i, rows.get(i)) for i in ids])


async def explain(server: Server, connection: Connection, request: p.VisibilityExplain,
                  ctx: RequestContext) -> p.VisibilityExplainResult:
    workspace = ctx.require(Permission.MESSAGE_READ)
    member_id = _check_id(request.member_id, "mem", "member")
    message_id = _check_id(request.message_id, "msg", "message")
    if member_id != workspace.member_id:
        try:
            member = await server.db.run(messages.member_candidate, workspace.workspace_id, member_id)
        except NotFound:
            member = None
        # Only the member itself or its owner learns what it can read; nobody else learns the member exists.
        if member is None or member.owner_member_id != workspace.member_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "member not found")
    row = await server.db.run(visibility.explain_message, workspace.workspace_id, member_id, message_id)
    if row is None or row["reason"] is None:
        # "Not readable" only about a message the caller reads; otherwise its
        # existence stays unknown (SPEC rule 8).
        if row is None or await server.db.run(messages.message_scope, workspace.workspace_id, workspace.member_id,
                                              message_id) is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "message not found")
        return p.VisibilityExplainResult(readable=False)
    membership = window = None
    if row["effective_from_seq"] is not None:
        membership = p.ExplainMembership(scope_id=row["scope_id"], effective_from_seq=row["effective_from_seq"],
                                         effective_to_seq=row["effective_to_seq"])
    if row["reason"] in ("grant", "collaborator"):
        expires_at = row["window_expires_at"]
        window = p.ExplainWindow(kind=row["reason"], scope_id=row["window_scope_id"],
                                 effective_from_global_seq=row["window_from_global_seq"],
                                 effective_to_global_seq=row["window_to_global_seq"],
                                 expires_at_ms=_ms(expires_at) if expires_at is not None else None)
    return p.VisibilityExplainResult(readable=True, reason=row["reason"], grant_id=row["grant_id"],
                                     membership=membership, window=window,
                                     source_message_id=row["quoted_by_message_id"])


HANDLERS: dict = {
    p.PrivateAgentCandidates: candidates,
    p.PrivateAgentContribution: contribution,
    p.PrivateAgentContextState: context_state,
    p.VisibilityExplain: explain,
}
