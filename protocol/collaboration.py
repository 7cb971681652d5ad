"""Ops of owner-private collaboration: private grants, Scope Executions and
People collaborators (scope-model.md §3.5, collaborator-policy.md §3, §6, §8)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from protocol.frames import Id, Request, WorkspaceRequest

# Unix milliseconds up to the end of year 9999 (the largest instant the server represents).
TimestampMs = Annotated[int, msgspec.Meta(ge=1, le=253_402_300_799_999)]


# --- private grants -----------------------------------------------------------------------

class PrivateGrantCreate(WorkspaceRequest, tag="private_grant.create"):
    """Grant `grantee_member_id` (a human, agent or app, not you) private authority
    for YOUR private agents on `scope_id` (a channel, DM or thread you are a member
    of): from the next message on, what they write there is readable by your
    private agents (and by them in threads of a granted channel), and they may
    address your agents.  No membership is created; nothing already written
    becomes readable.  Optional expiry (`expires_at_ms`, in the future).
    Refusals (details.reason): `invalid` grantee_is_owner, grantee_not_active,
    expiry_in_past, scope_type_not_supported; `forbidden` owner_not_human (only a
    human owns private agents), not_a_member; `conflict` already_granted (one
    active grant per scope, owner and grantee)."""

    scope_id: Id
    grantee_member_id: Id
    expires_at_ms: TimestampMs | None = None


class PrivateGrantRevoke(WorkspaceRequest, tag="private_grant.revoke"):
    """End your grant now.  Not retroactive: what was written inside it stays
    readable to your agents.  Anyone else's grant id answers `not_found`; an
    ended grant `conflict` already_ended."""

    grant_id: Id


class PrivateGrantList(WorkspaceRequest, tag="private_grant.list"):
    """Your own grants (optionally on one scope); ended ones on request."""

    scope_id: Id | None = None
    include_ended: bool = False


# --- People collaborators ---------------------------------------------------------------------

class CollaboratorAdd(WorkspaceRequest, tag="collaborator.add"):
    """Add an active human or app member (not an agent, not you) as a People
    collaborator of YOUR private agents on `scope_id` (a channel or thread you are
    a member of, or a strand you read; DMs have none).  On a strand it is a
    task-local collaborator: its Scope Execution (`scope_type` `explicit_task`)
    is created by this first add, never by the strand alone.  Their messages there from now on become context
    for your private agents, and they may address them; ordinary messages wake
    nobody.  No membership is created, nothing earlier is backfilled.  A channel
    affects every thread under it, so it needs `confirm_channel: true` and either
    `expires_at_ms` or an explicit `no_expiry: true` (else `invalid`, reason
    `channel_confirmation_required`).  The member is notified
    (`collaborator.changed`).  Other refusals (details.reason): `invalid`
    scope_type_not_supported (DMs), collaborator_is_agent (agents take grants),
    collaborator_is_owner, collaborator_not_active, conflicting_expiry,
    expiry_in_past; `forbidden` owner_not_human, not_a_member; `conflict`
    already_collaborator, scope_archived (an archived strand)."""

    scope_id: Id
    member_id: Id
    expires_at_ms: TimestampMs | None = None
    no_expiry: bool = False
    confirm_channel: bool = False


class CollaboratorRemove(WorkspaceRequest, tag="collaborator.remove"):
    """The owner ends a collaborator now (not retroactive).  Anyone else: `not_found`;
    an ended row: `conflict` already_ended."""

    collaborator_id: Id


class CollaboratorLeave(WorkspaceRequest, tag="collaborator.leave"):
    """The collaborator ends their own collaborator row now (parent-channel rows
    are separate rows).  Needs only read access.  Anyone else: `not_found`."""

    collaborator_id: Id


class CollaboratorUpdateExpiry(WorkspaceRequest, tag="collaborator.update_expiry"):
    """The owner moves an active collaborator's expiry (`expires_at_ms`, in the
    future) or removes it (`no_expiry: true`); exactly one of the two (`invalid`
    expiry_required / conflicting_expiry)."""

    collaborator_id: Id
    expires_at_ms: TimestampMs | None = None
    no_expiry: bool = False


class CollaboratorList(WorkspaceRequest, tag="collaborator.list"):
    """Your effective collaborators on a channel, thread or strand: the scope's own
    rows (`source: local`) and, for a thread or strand, its (board) channel's
    (`source: inherited`, computed at read time, never copied)."""

    scope_id: Id
    include_ended: bool = False


class CollaboratorOverview(WorkspaceRequest, tag="collaborator.overview"):
    """Your collaborators across the workspace, grouped by person / app, each with
    the scenes (scopes) where they are yours.  Only ever your own: no role sees
    another owner's collaborators."""

    include_ended: bool = False


FRAMES: tuple[type[Request], ...] = (
    PrivateGrantCreate, PrivateGrantRevoke, PrivateGrantList, CollaboratorAdd, CollaboratorRemove,
    CollaboratorLeave, CollaboratorUpdateExpiry, CollaboratorList, CollaboratorOverview,
)


# --- results ---------------------------------------------------------------------------------------

class GrantInfo(msgspec.Struct, omit_defaults=True):
    """A private grant.  Its window is [effective_from_global_seq,
    effective_to_global_seq] in workspace_global_seq (open while active) and,
    with an expiry, only messages created before `expires_at_ms`.  An expired
    grant is closed with `revoked_at_ms` = `expires_at_ms`.  `active`: grants
    authority right now."""

    id: str
    scope_id: str
    owner_member_id: str
    grantee_member_id: str
    granted_by_member_id: str
    created_at_ms: int
    effective_from_global_seq: int
    active: bool
    expires_at_ms: int | None = None
    revoked_at_ms: int | None = None
    effective_to_global_seq: int | None = None


class GrantListResult(msgspec.Struct):
    grants: list[GrantInfo]


class CollaboratorInfo(msgspec.Struct, omit_defaults=True):
    """A People collaborator row on an owner's Scope Execution (`execution_id`).
    Window as for grants, from `added_at_ms`.  `end_reason` / `ended_at_ms` once
    it ended (removed, left, expired); `source` is `inherited` for a parent
    channel's row listed under a thread."""

    id: str
    execution_id: str
    owner_member_id: str
    scope_id: str
    scope_type: Literal["channel", "thread", "explicit_task"]
    member_id: str
    added_by_member_id: str
    added_at_ms: int
    effective_from_global_seq: int
    active: bool
    source: Literal["local", "inherited"]
    expires_at_ms: int | None = None
    ended_at_ms: int | None = None
    end_reason: Literal["removed", "left", "expired"] | None = None
    effective_to_global_seq: int | None = None


class CollaboratorListResult(msgspec.Struct):
    collaborators: list[CollaboratorInfo]


class CollaboratorPerson(msgspec.Struct):
    """One person or app and the scenes where they are your collaborator."""

    member_id: str
    handle: str
    display_name: str
    kind: Literal["human", "service"]
    scenes: list[CollaboratorInfo]


class CollaboratorOverviewResult(msgspec.Struct):
    people: list[CollaboratorPerson]


class CollaboratorChanged(msgspec.Struct):
    """`collaborator.changed`: a People collaborator row was added, removed, left,
    expired or had its expiry changed.  Only to the owner's and the
    collaborator's own connections (those following the scope or the workspace
    feed); the frame's `scope_id` is the collaborator's scope."""

    change: Literal["add", "remove", "leave", "expire", "update_expiry"]
    collaborator: CollaboratorInfo


RESULTS: dict[type[Request], type[msgspec.Struct]] = {
    PrivateGrantCreate: GrantInfo,
    PrivateGrantRevoke: GrantInfo,
    PrivateGrantList: GrantListResult,
    CollaboratorAdd: CollaboratorInfo,
    CollaboratorRemove: CollaboratorInfo,
    CollaboratorLeave: CollaboratorInfo,
    CollaboratorUpdateExpiry: CollaboratorInfo,
    CollaboratorList: CollaboratorListResult,
    CollaboratorOverview: CollaboratorOverviewResult,
}
