"""Policy: pure decisions with structured reasons (scope-model.md §6.1).
No I/O, no side effects; the Planner asks, the Applier never re-decides."""

from __future__ import annotations

from dataclasses import dataclass

from domain.plan import ActorContext, MentionCandidate, ScopeContext

AUDIENCE_TOKENS = frozenset({"all", "here"})


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


def allow(reason: str) -> Decision:
    return Decision(True, reason)


def deny(reason: str) -> Decision:
    return Decision(False, reason)


def can_write(actor: ActorContext, scope: ScopeContext) -> Decision:
    if scope.status != "active":
        return deny(f"scope_{scope.status}")
    if actor.member_id not in scope.roster:
        return deny("not_a_member")
    return allow("member")


def can_address(actor: ActorContext, scope: ScopeContext, candidate: MentionCandidate,
                parent: ScopeContext | None) -> tuple[Decision, bool]:
    """Whether `actor` may address `candidate` with a live mention here, and
    whether that mention admits the candidate into this (thread) scope.

    A private agent may be addressed only by its owner (owner grants and People
    collaborators extend this in later work); a mention nobody may address
    stays plain text."""
    if candidate.status != "active":
        return deny("inactive_member"), False
    private_agent = candidate.kind == "agent" and candidate.visibility == "private"
    if private_agent and candidate.owner_member_id != actor.member_id and candidate.member_id != actor.member_id:
        return deny("private_agent_without_authority"), False
    if candidate.member_id in scope.roster:
        return allow("owner" if private_agent else "member"), False
    # Thread admission (scope-model.md §5.2): a private agent joins a thread only
    # if it is already a private member of the parent scope.
    if scope.type == "thread" and parent is not None:
        parent_entry = parent.roster.get(candidate.member_id)
        if parent_entry is not None and (not private_agent or parent_entry.visibility == "private"):
            return allow("thread_admission"), True
    return deny("not_a_member"), False


def can_add_member(actor: ActorContext | None, scope: ScopeContext, candidate: MentionCandidate,
                   parent: ScopeContext | None) -> Decision:
    """Explicit invite/join into a scope."""
    if scope.status != "active":
        return deny(f"scope_{scope.status}")
    if candidate.status != "active":
        return deny("inactive_member")
    if candidate.member_id in scope.roster:
        return deny("already_member")
    if candidate.kind == "agent" and candidate.visibility == "private":
        if actor is None or candidate.owner_member_id != actor.member_id:
            return deny("private_agent_without_authority")
        if scope.type == "thread" and (parent is None or parent.roster.get(candidate.member_id) is None
                                       or parent.roster[candidate.member_id].visibility != "private"):
            return deny("private_agent_not_in_parent")
    if scope.type == "dm":
        return deny("dm_roster_is_fixed")
    if actor is not None and actor.member_id != candidate.member_id and actor.member_id not in scope.roster:
        return deny("inviter_not_a_member")
    if actor is not None and actor.member_id == candidate.member_id and not (
            scope.type == "channel" and scope.visibility == "public"):
        return deny("not_joinable")
    return allow("invited" if actor is None or actor.member_id != candidate.member_id else "joined")
