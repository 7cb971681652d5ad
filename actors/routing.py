"""Routing decisions: who a message or activity wakes, and why (scope-model.md
§2.3, §3.4; collaborator-policy §5; strand-message §9.4.2, §9.4.5).  Pure: the
scope actor asks with its cached roster and authority; nothing here reads the
database.  The recipient's notification state decides what an authorized
address becomes (domain/routing.py)."""

from __future__ import annotations

from datetime import datetime

from domain.authority import ScopeAuthority, wake_authority
from domain.plan import RosterEntry
from domain.routing import AUTO_WAKE, DIRECT, REACTION, SILENCED_STATES, UNPUSHED_STATES, Route

# Policy reasons (actors/policy.py can_address) that name no private authority.
_MEMBER_REASONS = frozenset({"member", "thread_admission"})


def addressed(author: str, member_id: str, how: str, policy_reason: str,
              entry: RosterEntry | None) -> tuple[Route | None, str]:
    """An authorized live mention or explicit recipient (`how`): its route, or
    None and why not.  `entry` is None for a member this message admits into a
    thread (its notification state starts as `active`)."""
    if member_id == author:
        return None, "self"  # your own mention notifies nobody (strand-message §9.4.2)
    state = entry.notification_state if entry is not None else "active"
    if state in SILENCED_STATES:
        return None, state
    authority = "member" if policy_reason in _MEMBER_REASONS else policy_reason
    return Route(member_id, how, authority, push=state not in UNPUSHED_STATES), "routed"


def direct(author: str, author_kind: str, author_entry: RosterEntry | None, others: list[RosterEntry],
           authority: ScopeAuthority, now: datetime | None) -> list[tuple[Route | None, tuple[str, str]]]:
    """A DM message is addressed to the DM's other member: each one's route, or
    None and (member, why not).  An agent is woken only by a human's message (two
    agents in a DM cannot wake each other forever: they mention each other to
    do that), a private agent only by someone who may wake it; a human is told
    of every message.  The recipient's notification state decides as for a mention."""
    decided: list[tuple[Route | None, tuple[str, str]]] = []
    for entry in others:
        if entry.member_id == author:
            continue
        if entry.notification_state in SILENCED_STATES:
            decided.append((None, (entry.member_id, entry.notification_state)))
            continue
        if entry.kind == "agent" and author_kind != "human":
            decided.append((None, (entry.member_id, "agent_author")))
            continue
        authority_reason = "member"
        if entry.visibility == "private":
            found = (wake_authority(author, author_entry, entry.owner_member_id, authority, now)
                     if entry.owner_member_id is not None and now is not None else None)
            if found is None:
                decided.append((None, (entry.member_id, "private_agent_without_authority")))
                continue
            authority_reason = found[0]
        decided.append((Route(entry.member_id, DIRECT, authority_reason,
                              push=entry.notification_state not in UNPUSHED_STATES), (entry.member_id, "routed")))
    return decided


def auto_wake(author: str, author_entry: RosterEntry | None, candidates: list[RosterEntry], private_readers,
              authority: ScopeAuthority, now: datetime | None) -> list[Route]:
    """Members in `auto-wake` woken by an ordinary message of `author`: only a
    human's message (an agent's or a service's never auto-wakes anyone, so two
    auto-wake agents cannot wake each other forever); a private agent only when
    it reads the message (`private_readers`) and the author may wake it."""
    if author_entry is None or author_entry.kind != "human":
        return []
    routes = []
    for entry in candidates:
        if entry.member_id == author:
            continue
        if entry.visibility == "private":
            if entry.member_id not in private_readers or entry.owner_member_id is None or now is None:
                continue
            reason = wake_authority(author, author_entry, entry.owner_member_id, authority, now)
            if reason is None:
                continue
            routes.append(Route(entry.member_id, AUTO_WAKE, reason[0], push=True))
        else:
            routes.append(Route(entry.member_id, AUTO_WAKE, "member", push=True))
    return routes


def reaction(reactor: str, reactor_entry: RosterEntry | None, author_entry: RosterEntry | None,
             authority: ScopeAuthority, now: datetime) -> tuple[Route | None, str]:
    """A reaction added to a message of `author_entry`'s member wakes that author:
    never for your own message; a private agent only when the reactor may wake it."""
    if author_entry is None:
        return None, "author_not_a_member"
    if author_entry.member_id == reactor:
        return None, "self"
    if author_entry.notification_state in SILENCED_STATES:
        return None, author_entry.notification_state
    authority_reason = "member"
    if author_entry.visibility == "private":
        if author_entry.owner_member_id is None:
            return None, "private_agent_without_authority"
        found = wake_authority(reactor, reactor_entry, author_entry.owner_member_id, authority, now)
        if found is None:
            return None, "private_agent_without_authority"
        authority_reason = found[0]
    return Route(author_entry.member_id, REACTION, authority_reason,
                 push=author_entry.notification_state not in UNPUSHED_STATES), "routed"
