"""Planner: MessageIntent + ActorContext + ScopeContext + LiveMentions →
MessagePlan with an Explain per recipient (scope-model.md §6.2).
Set computation and policy calls only; no SQL."""

from __future__ import annotations

import hashlib

import msgspec

from actors import policy
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
from actors.routing_tokens import parse_routing_tokens

_digest_encoder = msgspec.json.Encoder(order="sorted")


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
        "attachment_ids": list(intent.metadata.get("attachment_ids", [])),
        "sources": [[s.kind, s.message_id] for s in intent.sources],
        "metadata": intent.metadata,
        "silent": intent.silent,
    }
    return hashlib.sha256(_digest_encoder.encode(canonical)).digest()


def mention_handles(intent: MessageIntent) -> tuple[str, ...]:
    """The handles of live routing tokens, by the one canonical parser."""
    return tuple(token.handle for token in parse_routing_tokens(intent.content, intent.mention_mode))


def plan_message(intent: MessageIntent, actor: ActorContext, scope: ScopeContext,
                 candidates: dict[str, MentionCandidate], parent: ScopeContext | None) -> MessagePlan:
    decision = policy.can_write(actor, scope)
    if not decision.allowed:
        raise PlanRefused(decision)
    live: list[str] = []
    admissions: list[MembershipMutation] = []
    explain: list[Explain] = []
    for handle in mention_handles(intent):
        if handle in policy.AUDIENCE_TOKENS:
            explain.append(Explain(member_id=handle, reason="audience_mention_deferred", delivered=False))
            continue
        candidate = candidates.get(handle)
        if candidate is None:
            continue  # not a member handle: plain text
        allowed, admits = policy.can_address(actor, scope, candidate, parent)
        explain.append(Explain(candidate.member_id, f"mention:{allowed.reason}", allowed.allowed))
        if not allowed.allowed:
            continue  # stays plain text
        live.append(candidate.member_id)
        if admits:
            admissions.append(MembershipMutation(
                member_id=candidate.member_id, action="open",
                visibility="private" if candidate.visibility == "private" else "public",
                owner_member_id=candidate.owner_member_id if candidate.visibility == "private" else None))
    outbox = () if intent.silent else (
        OutboxEvent("message", "message.created", DeliveryPolicy.INLINE_ORDINARY),
    )
    return MessagePlan(intent=intent, actor=actor, digest=payload_digest(intent), live_mentions=tuple(live),
                       membership_mutations=tuple(admissions), outbox=outbox, explain=tuple(explain))
