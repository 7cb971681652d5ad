"""Policy: pure decisions with structured reasons (scope-model.md §6.1).
No I/O, no side effects; the Planner asks, the Applier never re-decides."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from domain.authority import ScopeAuthority, wake_authority
from domain.plan import ActorContext, MentionCandidate, ScopeContext

AUDIENCE_TOKENS = frozenset({"all", "here"})

# Scopes a private agent enters only when addressed there, from its parent (scope-model §5.2).
_ADMITTING = ("thread", "task")


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
    if scope.type == "service_account":
        # Only the account posts there, through its own op (service-account §4.1): members read and react.
        return deny("read_only_scope")
    if actor.member_id not in scope.roster:
        return deny("not_a_member")
    return allow("member")


def can_address(actor: ActorContext, scope: ScopeContext, candidate: MentionCandidate,
                parent: ScopeContext | None, authority: ScopeAuthority,
                now: datetime | None) -> tuple[Decision, bool]:
    """Whether `actor` may address `candidate` here (a live mention or an explicit
    recipient), and whether that admits the candidate into this (thread) scope.

    A private agent may be addressed only by its owner, another private agent of
    the same owner in this scope, or a member holding an active grant or People
    collaborator window of the owner on this scope's chain (collaborator-policy
    §5; SPEC §5 decision 2).  Anything else stays plain text."""
    if candidate.status != "active":
        return deny("inactive_member"), False
    admits = False
    if candidate.member_id not in scope.roster:
        # Thread admission (scope-model.md §5.2): only someone already in the
        # parent, a private agent only as a private member of the parent.  A task
        # admits private agents alone, the same way (its other readers come from its board).
        parent_entry = parent.roster.get(candidate.member_id) if scope.type in _ADMITTING and parent else None
        if parent_entry is None or (_is_private_agent(candidate) and parent_entry.visibility != "private") or (
                scope.type == "task" and not _is_private_agent(candidate)):
            return deny("not_a_member"), False
        admits = True
    if not _is_private_agent(candidate):
        return allow("thread_admission" if admits else "member"), admits
    if scope.type in _ADMITTING and parent is not None and candidate.member_id not in parent.roster:
        return deny("not_a_member"), False  # removed from the channel: its membership here grants nothing
    if candidate.member_id == actor.member_id:
        return allow("own"), admits
    assert now is not None and candidate.owner_member_id is not None
    authority_reason = wake_authority(actor.member_id, scope.roster.get(actor.member_id), candidate.owner_member_id,
                                      authority, now)
    if authority_reason is None:
        return deny("private_agent_without_authority"), False
    return allow(authority_reason[0]), admits


def _is_private_agent(candidate: MentionCandidate) -> bool:
    return candidate.kind == "agent" and candidate.visibility == "private"


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
        if scope.type in _ADMITTING:
            # It enters a thread or task only when addressed there (scope-model §5.2): mention it.
            return deny("private_agent_not_admitted")
    if scope.type == "dm":
        return deny("dm_roster_is_fixed")
    if actor is not None and actor.member_id != candidate.member_id and actor.member_id not in scope.roster:
        return deny("inviter_not_a_member")
    if actor is not None and actor.member_id == candidate.member_id and not (
            scope.type == "channel" and scope.visibility == "public"):
        return deny("not_joinable")
    return allow("invited" if actor is None or actor.member_id != candidate.member_id else "joined")
