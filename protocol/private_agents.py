"""Ops a UI and an agent runtime need around private agents: the lazy `@`
candidate resolver, contribution capability, per-message context state and
visibility diagnostics (collaborator-policy.md §5.1, §7.2; scope-model.md §3.9).

All are reads: none of them writes a row, creates a Scope Execution or cleans
up expired grants.  They are hints for a UI; the send path stays the final
authority on who may wake a private agent."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from protocol.frames import Id, Request, WorkspaceRequest

# What a user has typed after `@`: a (possibly empty) beginning of a handle.
HandlePrefix = Annotated[str, msgspec.Meta(max_length=64, pattern="^[a-z0-9_.-]*$")]
CandidateRelation = Literal["owner", "grant", "collaborator"]
ContributionRelation = Literal["owner", "same_owner_agent", "grant", "collaborator", "none"]
ContextRelation = Literal["owner", "own_agent", "grant", "collaborator", "shared"]


class PrivateAgentCandidates(WorkspaceRequest, tag="private_agent.candidates"):
    """The private agents you may address in `scope_id` whose handle starts with
    `prefix`, at most `limit` of them (by handle): your own, and other owners'
    when you hold an active grant or People collaborator role from that owner on
    this scope (or, in a thread, on its parent channel).  Run it on `@` input,
    not on first paint.  The scan before authorization is capped too:
    `scan_exhausted` says it stopped early, so a longer prefix may find more."""

    scope_id: Id
    prefix: HandlePrefix = ""
    limit: Annotated[int, msgspec.Meta(ge=1, le=20)] = 8


class PrivateAgentContribution(WorkspaceRequest, tag="private_agent.contribution"):
    """Your relation to `owner_member_id`'s private agents in `scope_id` (a
    thread includes its parent channel): whether what you write here becomes
    their context, whether you may wake them, whether you may share into their
    context.  No message is looked at."""

    scope_id: Id
    owner_member_id: Id


class PrivateAgentContextState(WorkspaceRequest, tag="private_agent.context_state"):
    """For you as an owner of private agents: which of these messages of
    `scope_id` your private agents may use as context there (and why), and which
    need an explicit share (`message.forward` mode `owner_quote`).  Ask for the
    messages a menu, selection or new arrival needs, not a whole history page."""

    scope_id: Id
    message_ids: Annotated[list[Id], msgspec.Meta(min_length=1, max_length=100)]


class VisibilityExplain(WorkspaceRequest, tag="visibility.explain"):
    """Diagnostics: may `member_id` read `message_id`, and which membership,
    grant / collaborator window or shared source makes it readable.  Only the
    member itself or its owner may ask (anyone else: `not_found`); the answer is
    `readable: false` only about a message the caller reads itself — any other
    message is `not_found`, so nothing reveals that it exists."""

    message_id: Id
    member_id: Id


class AgentCandidate(msgspec.Struct, omit_defaults=True):
    """A private agent you may address here: `relation` says why; for a grant or a
    collaborator role, `source_scope_id` is the scope it is on (this scope or the
    parent channel) and `ref_id` its grant (`grt_`) or collaborator (`col_`) id."""

    member_id: str
    handle: str
    display_name: str
    owner_member_id: str
    relation: CandidateRelation
    source_scope_id: str | None = None
    ref_id: str | None = None


class PrivateAgentCandidatesResult(msgspec.Struct):
    candidates: list[AgentCandidate]
    scan_exhausted: bool


class PrivateAgentContributionResult(msgspec.Struct, omit_defaults=True):
    """`none`: your messages are not context for that owner's agents and you cannot
    wake them.  `can_share` is true for the owner only.  For a grant or a
    collaborator role: where it is, its id, and when it expires (if it does)."""

    relation: ContributionRelation
    can_contribute_context: bool
    can_wake: bool
    can_share: bool
    source_scope_id: str | None = None
    ref_id: str | None = None
    expires_at_ms: int | None = None


class MessageContextState(msgspec.Struct, omit_defaults=True):
    """`context_eligible`: your private agents here may use it (`relation` says
    why; `ref_id` is the grant / collaborator id, or for `shared` the owner_quote
    message, in `source_scope_id`).  `share_needed`: they may not until you share
    it; `can_share` tells whether you can.  `not_found`: not a message of this
    scope that you can read."""

    message_id: str
    state: Literal["context_eligible", "share_needed", "not_found"]
    can_share: bool
    relation: ContextRelation | None = None
    source_scope_id: str | None = None
    ref_id: str | None = None


class PrivateAgentContextStateResult(msgspec.Struct):
    """One state per distinct requested id, in request order."""

    states: list[MessageContextState]


class ExplainMembership(msgspec.Struct, omit_defaults=True):
    """The member's membership interval (in scope seqs) that contains the message."""

    scope_id: str
    effective_from_seq: int
    effective_to_seq: int | None = None


class ExplainWindow(msgspec.Struct, omit_defaults=True):
    """The grant or collaborator window (in workspace global seqs) the message's author wrote in."""

    kind: Literal["grant", "collaborator"]
    scope_id: str
    effective_from_global_seq: int
    effective_to_global_seq: int | None = None
    expires_at_ms: int | None = None


class VisibilityExplainResult(msgspec.Struct, omit_defaults=True):
    """`reason` is the readable predicate's first matching rule (`membership`,
    `own_output`, `owner`, `same_owner_agent`, `grant`, `collaborator`,
    `board_channel` — a strand's reader through its board's channel —,
    `source_ref`); `source_message_id` is the owner_quote that carried a
    `source_ref` message into a scope the member belongs to."""

    readable: bool
    reason: str | None = None
    grant_id: str | None = None
    membership: ExplainMembership | None = None
    window: ExplainWindow | None = None
    source_message_id: str | None = None


FRAMES: tuple[type[Request], ...] = (
    PrivateAgentCandidates, PrivateAgentContribution, PrivateAgentContextState, VisibilityExplain)
RESULTS: dict[type[Request], type[msgspec.Struct]] = {
    PrivateAgentCandidates: PrivateAgentCandidatesResult,
    PrivateAgentContribution: PrivateAgentContributionResult,
    PrivateAgentContextState: PrivateAgentContextStateResult,
    VisibilityExplain: VisibilityExplainResult,
}
