"""Planner: MessageIntent + ActorContext + ScopeContext + LiveMentions →
MessagePlan with an Explain per recipient (scope-model.md §6.2).
Set computation and policy calls only; no SQL."""

from __future__ import annotations

import hashlib
from datetime import datetime

import msgspec

from actors import policy, routing
from domain.plan import (
    ActorContext,
    DeliveryPolicy,
    Explain,
    MembershipMutation,
    MentionCandidate,
    MessageIntent,
    MessagePlan,
    OutboxEvent,
    ScopeContext,
)
from domain.routing import Route
from actors.routing_tokens import parse_routing_tokens
from domain.authority import ScopeAuthority
from domain.strands import AUDIENCE_TOKENS as STRAND_AUDIENCE_TOKENS

_digest_encoder = msgspec.json.Encoder(order="sorted")

SERVER_WRITTEN_METADATA = frozenset({"quote", "shared_by_member_id"})

# Addressing a private agent for one of these reasons is the owner's (or a
# collaborator's) first-class wake: it creates the owner's Scope Execution here.
WAKE_REASONS = frozenset({"owner", "grant", "collaborator"})


class PlanRefused(Exception):
    def __init__(self, decision: policy.Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


def payload_digest(intent: MessageIntent) -> bytes:
    """Canonical payload digest (scope-model.md §3.6): message type, content,
    ordered attachment ids, reply/source refs and client metadata.  Server
    generated fields (id, seq, timestamps) are not part of it."""
    canonical = {
        "message_type": intent.message_type,
        "content": intent.content,
        "attachment_ids": list(intent.attachment_ids),
        "sources": [[s.kind, s.message_id] for s in intent.sources],
        # Client-owned metadata only: an owner_quote's frozen copies are written by
        # the server from the source refs (already in the digest), so a retry after
        # the source was edited still replays the original.
        "metadata": {k: v for k, v in intent.metadata.items() if k not in SERVER_WRITTEN_METADATA},
        "silent": intent.silent,
    }
    if intent.recipients:  # absent otherwise, so digests stored before recipients existed still match
        canonical["recipients"] = sorted(set(intent.recipients))
    return hashlib.sha256(_digest_encoder.encode(canonical)).digest()


def mention_handles(intent: MessageIntent) -> tuple[str, ...]:
    """The handles of live routing tokens, by the one canonical parser."""
    return tuple(token.handle for token in parse_routing_tokens(intent.content, intent.mention_mode))


def plan_message(intent: MessageIntent, actor: ActorContext, scope: ScopeContext,
                 candidates: dict[str, MentionCandidate], parent: ScopeContext | None,
                 authority: ScopeAuthority | None = None, now: datetime | None = None) -> MessagePlan:
    decision = policy.can_write(actor, scope)
    if not decision.allowed:
        raise PlanRefused(decision)
    authority = authority if authority is not None else ScopeAuthority()
    live: list[str] = []
    recipients: list[str] = []
    admissions: dict[str, MembershipMutation] = {}
    executions: dict[str, str] = {}
    explain: list[Explain] = []
    routes: dict[str, Route] = {}

    def address(candidate: MentionCandidate, how: str) -> bool:
        allowed, admits = policy.can_address(actor, scope, candidate, parent, authority, now)
        explain.append(Explain(candidate.member_id, f"{how}:{allowed.reason}", allowed.allowed))
        if not allowed.allowed:
            return False
        if candidate.member_id not in routes and not intent.silent:
            route, why = routing.addressed(actor.member_id, candidate.member_id, how, allowed.reason,
                                           scope.roster.get(candidate.member_id))
            if route is not None:
                routes[candidate.member_id] = route
            elif why != "self":
                explain.append(Explain(candidate.member_id, f"route:{why}", False))
        private = candidate.visibility == "private"
        if admits:
            admissions.setdefault(candidate.member_id, MembershipMutation(
                member_id=candidate.member_id, action="open", visibility="private" if private else "public",
                owner_member_id=candidate.owner_member_id if private else None))
        if private and allowed.reason in WAKE_REASONS and candidate.owner_member_id is not None:
            executions.setdefault(candidate.owner_member_id, "wake")
        return True

    audiences: dict[str, str] = {}
    for handle in mention_handles(intent):
        audience = audience_of(handle, scope.type)
        if audience is not None:
            if not intent.silent:
                audiences.setdefault(audience, handle)
            continue
        if handle in policy.AUDIENCE_TOKENS:
            continue  # @here outside a strand: plain text
        candidate = candidates.get(handle)
        if candidate is None:
            continue  # not a member handle: plain text
        if address(candidate, "mention"):
            live.append(candidate.member_id)
    if intent.recipients:
        by_id = {c.member_id: c for c in candidates.values()}
        for member_id in dict.fromkeys(intent.recipients):
            candidate = by_id.get(member_id)
            if candidate is None or not address(candidate, "recipient"):
                # One answer whatever the cause: it reveals nothing about grants.
                raise PlanRefused(policy.deny("recipient_not_addressable"))
            recipients.append(member_id)
    if scope.type == "dm" and not intent.silent:
        # A DM message is addressed to the DM's other member (domain/routing.py DIRECT).
        for route, why in routing.direct(actor.member_id, actor.member_kind, scope.roster.get(actor.member_id),
                                         [e for m, e in scope.roster.items() if m not in routes], authority, now):
            if route is not None:
                routes[route.member_id] = route
            else:
                explain.append(Explain(why[0], f"route:{why[1]}", False))
    if intent.message_type == "owner_quote" and actor.member_kind == "human":
        executions.setdefault(actor.member_id, "owner_quote")
    outbox = () if intent.silent else (
        OutboxEvent("message", "message.created", DeliveryPolicy.INLINE_ORDINARY),
    )
    return MessagePlan(intent=intent, actor=actor, digest=payload_digest(intent), live_mentions=tuple(live),
                       membership_mutations=tuple(admissions.values()), outbox=outbox, explain=tuple(explain),
                       recipients=tuple(recipients), executions=tuple(executions.items()),
                       routes=tuple(routes.values()),
                       audience_mentions=tuple((token, audience) for audience, token in audiences.items()))


def audience_of(token: str, scope_type: str) -> str | None:
    """The audience an `@token` names here: `@all` in a channel, thread or strand; the
    strand audiences (`@here`, `@participants`, `@watchers`, `@assignees`) in a strand only."""
    if scope_type == "task":
        return STRAND_AUDIENCE_TOKENS.get(token)
    if token == "all" and scope_type in ("channel", "thread"):
        return "effective_scope_members"
    return None
