"""Private grant and People collaborator changes, each run by the scope's own
actor inside its batch transaction (a savepoint each), so the actor that caches
the scope's authority windows is the one that changes them: every change sets
`authority_changed` (the actor bumps the roster generation and reloads).

The server resolved the scope and the caller's rights to name it; here, in the
transaction, the rules that depend on current state are checked."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from actors.scope_actor import Command, Outcome, Refused, ScopeActor, register_command
from domain.plan import ScopeContext
from storage import messages, private_authority

# What each scope type may carry (DMs have grants but no Scope Execution), and the
# Scope Execution's type for each: a task's is the explicit task (collaborator-policy §8.1).
GRANT_SCOPE_TYPES = ("channel", "dm", "thread")
EXECUTION_TYPES = {"channel": "channel", "thread": "thread", "task": "explicit_task"}


@dataclass
class CreateGrant(Command):
    grantee_member_id: str
    expires_at: datetime | None


@dataclass
class RevokeGrant(Command):
    grant_id: str


@dataclass
class AddCollaborator(Command):
    member_id: str
    expires_at: datetime | None


@dataclass
class EndCollaborator(Command):
    collaborator_id: str
    how: str  # remove (the owner) | leave (the collaborator)


@dataclass
class UpdateCollaboratorExpiry(Command):
    collaborator_id: str
    expires_at: datetime | None


def _require_owner_member(command: Command, state: ScopeContext) -> None:
    actor = command.actor
    if actor.member_kind != "human":
        raise Refused("forbidden", "only a human owns private agents", "owner_not_human")
    if actor.member_id not in state.roster:
        raise Refused("forbidden", "not a member of this scope", "not_a_member")


async def _check_expiry(conn: asyncpg.Connection, expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at <= await private_authority.database_now(conn):
        raise Refused("invalid", "the expiry must be in the future", "expiry_in_past")


@register_command(CreateGrant)
async def create_grant(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                       command: CreateGrant) -> Outcome:
    if state.type not in GRANT_SCOPE_TYPES:
        raise Refused("invalid", f"no private grants on a {state.type} scope", "scope_type_not_supported")
    _require_owner_member(command, state)
    owner = command.actor.member_id
    if command.grantee_member_id == owner:
        raise Refused("invalid", "you cannot grant yourself", "grantee_is_owner")
    grantee = await messages.member_candidate(conn, state.workspace_id, command.grantee_member_id)
    if grantee.status != "active":
        raise Refused("invalid", "the grantee is not an active member", "grantee_not_active")
    await _check_expiry(conn, command.expires_at)
    row = await private_authority.create_grant(conn, state.workspace_id, state.scope_id, owner,
                                               command.grantee_member_id, command.expires_at)
    return Outcome(row, authority_changed=True)


@register_command(RevokeGrant)
async def revoke_grant(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                       command: RevokeGrant) -> Outcome:
    row = await private_authority.revoke_grant(conn, state.workspace_id, command.actor.member_id, command.grant_id)
    return Outcome(row, authority_changed=True)


@register_command(AddCollaborator)
async def add_collaborator(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                           command: AddCollaborator) -> Outcome:
    if state.type not in EXECUTION_TYPES:
        raise Refused("invalid", f"no collaborators on a {state.type} scope", "scope_type_not_supported")
    _require_owner_member(command, state)
    if state.type == "task" and state.status != "active":
        raise Refused("conflict", "the strand is archived", "scope_archived")
    owner = command.actor.member_id
    if command.member_id == owner:
        raise Refused("invalid", "the owner is implicit; you cannot add yourself", "collaborator_is_owner")
    member = await messages.member_candidate(conn, state.workspace_id, command.member_id)
    if member.kind == "agent":
        # Agents get authority through grants; a People collaborator is a person or an app.
        raise Refused("invalid", "an agent cannot be a People collaborator", "collaborator_is_agent")
    if member.status != "active":
        raise Refused("invalid", "the member is not active", "collaborator_not_active")
    await _check_expiry(conn, command.expires_at)
    # A task's (owner, task) row exists only once it carries task-local collaborators (§3.0, §8.1).
    execution_id = await private_authority.ensure_execution(conn, state.workspace_id, owner, state.scope_id,
                                                            EXECUTION_TYPES[state.type], "first_collaborator")
    change = await private_authority.add_collaborator(conn, state.workspace_id, execution_id, command.member_id,
                                                      owner, command.expires_at)
    return Outcome(change, authority_changed=True)


@register_command(EndCollaborator)
async def end_collaborator(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                           command: EndCollaborator) -> Outcome:
    change = await private_authority.end_collaborator(conn, state.workspace_id, command.collaborator_id,
                                                      command.actor.member_id, command.how)
    return Outcome(change, authority_changed=True)


@register_command(UpdateCollaboratorExpiry)
async def update_collaborator_expiry(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                                     command: UpdateCollaboratorExpiry) -> Outcome:
    await _check_expiry(conn, command.expires_at)
    change = await private_authority.update_collaborator_expiry(conn, state.workspace_id, command.collaborator_id,
                                                                command.actor.member_id, command.expires_at)
    return Outcome(change, authority_changed=True)
