"""Strands: task scopes with tracks, stage, assignment and watch (strand-message.md
§2-§8; collaborator-policy §4.2.1).

A **board** is bound to one channel.  A **strand** is a task scope on a board:
its id is the task scope's id (`scp_…`), so `message.send`, `message.history`,
`subscribe`, `read.mark` and the Inbox work on it as on any scope.  Who reads
and writes a strand is decided server side from the board's channel: an active,
public member of the channel reads it and (unless archived) writes it; its own
memberships carry read state only.  A strand, board or channel you cannot use
answers `not_found` — never `forbidden` — whatever the cause.  Archived strands
refuse writes (`conflict`, reason `scope_archived`, as any archived scope) and stay readable to humans;
agents lose them.

A **private agent** is never a reader by the board.  It enters a strand's discussion as it
enters a thread: a live mention or an explicit recipient in the strand, by someone holding
authority over it (its owner, a grantee of the owner on the channel, a People collaborator
of the owner on the strand or its channel, another private agent of the owner already
there), admits it while it is a
private member of the board's channel (`scope.members` with `include_private` lists it,
with its owner).  There it reads and receives only what the owner-private predicate allows
(its own output, its owner's, its owner's other private agents', and grantees' and People
collaborators' messages inside their windows on the strand and its channel: collaborators
added on the strand itself (`collaborator.add`, an explicit-task Scope Execution) or on the
channel, a runtime union).  The strand itself — `strand.get`, `strand.list`, tracks, stage,
assignment, watch — stays its board readers': to a private agent it answers `not_found`,
as does assigning or watching on one's behalf.  Watches never wake a private agent, and
audience mentions never reach one.  It loses the strand when it leaves the channel or the
strand, board or channel is archived.

Errors carry `details.reason`: `schema_violation` (`invalid`), and for `conflict`
`failed_precondition`, `track_disabled`, `primary_track_required`,
`watch_must_be_self`, `version_mismatch`, `already_archived`, `not_archived`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from protocol.frames import Cursor, Id, Limit, Ok, Request, WorkspaceRequest

BoardName = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Title = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Summary = Annotated[str, msgspec.Meta(max_length=2048)]
Body = Annotated[str, msgspec.Meta(max_length=40000)]
Version = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
ClientKey = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Stage = Literal["draft", "proposed", "planned", "in_progress", "blocked", "done", "cancelled", "superseded"]
WatchLevel = Literal["mentions_only", "participating", "all", "muted"]
UNSET = msgspec.UNSET


# --- boards -----------------------------------------------------------------------------------------

class BoardCreate(WorkspaceRequest, tag="board.create"):
    """A board on a channel you are an active member of (writers only); names are unique per channel
    ignoring case (`conflict`, reason `board_name_taken`)."""

    channel_id: Id
    name: BoardName


class BoardList(WorkspaceRequest, tag="board.list"):
    """The boards of the channels you are a member of (of one channel with `channel_id`)."""

    channel_id: Id | None = None


class BoardArchive(WorkspaceRequest, tag="board.archive"):
    """Archive a board (its channel's owner, or `resource.manage`): its strands refuse writes and
    close to agents, humans still read them."""

    board_id: Id


class BoardRestore(WorkspaceRequest, tag="board.restore"):
    board_id: Id


# --- strands ----------------------------------------------------------------------------------------

class StrandCreate(WorkspaceRequest, tag="strand.create"):
    """Create a strand on a board.  `tracks` maps registered track names (`discussion`,
    `synthesis`) to `{enabled?, is_primary?, profile?, template?, metadata?}`; default
    `{"discussion": {}}`.  `fields` is `metadata.fields` (reserved names such as `status`,
    `stage`, `assignees`, `watchers` answer `schema_violation`).  A stage is set later with
    `strand.stage.set`.  `client_strand_id` makes a retry return the same strand."""

    board_id: Id
    title: Title
    summary: Summary | None = None
    content: Body = ""
    fields: dict[str, Any] = {}
    tracks: dict[str, Any] = msgspec.field(default_factory=lambda: {"discussion": {}})
    client_strand_id: ClientKey | None = None
    # The strand's ceiling on agents (§3 agent_participation): false keeps everyone but an
    # agent's owner from waking it by mention here; null inherits.
    accept_third_party_mention: bool | None = None


class StrandGet(WorkspaceRequest, tag="strand.get"):
    """The strand; with `include_synthesis_revisions` its synthesis revisions too (newest first, ≤ 50)."""

    strand_id: Id
    include_synthesis_revisions: bool = False


class StrandList(WorkspaceRequest, tag="strand.list"):
    """A board's strands you read, most recently updated first."""

    board_id: Id
    state: Literal["active", "archived"] | None = None
    cursor: Cursor | None = None
    limit: Limit = 50


class StrandUpdate(WorkspaceRequest, tag="strand.update"):
    """Change the description (`title`, `summary`, `content`, `fields`) and/or the synthesis
    (`synthesis_content`, each write a new revision; only while the synthesis track exists and
    is enabled: `conflict`, reason `track_disabled`).  `expected_version` is the strand's
    `version` (`conflict`, reason `version_mismatch`)."""

    strand_id: Id
    expected_version: Version
    title: Title | None = None
    summary: Summary | None = None
    content: Body | None = None
    fields: dict[str, Any] | None = None
    synthesis_content: Body | None = None
    accept_third_party_mention: bool | None = None


class StrandTracksUpdate(WorkspaceRequest, tag="strand.tracks.update"):
    """An atomic patch of the tracks registry (§4.6-§4.8): keys `tracks.<name>.<field>`
    (`enabled`, `is_primary`, `profile`, `template`, `metadata`), values
    `{"$op": "set", "value": …}` or `{"$op": "unset"}`.  A missing track is created only by
    `enabled: set true` in the same patch; closing the primary hands it to another enabled
    track in the same patch (`primary_track_required`); a primary on a disabled track is
    `track_disabled`; unregistered names, `content` and whole-entry paths are `schema_violation`."""

    strand_id: Id
    patch: dict[str, Any]


class StrandStageSet(WorkspaceRequest, tag="strand.stage.set"):
    """Compare-and-set of the stage: omit `expected_stage` (or give null) only while the strand
    has never had one; after that it must equal the current stage (`conflict`, reason
    `failed_precondition`)."""

    strand_id: Id
    stage: Stage
    expected_stage: Stage | None | msgspec.UnsetType = UNSET


class StrandArchive(WorkspaceRequest, tag="strand.archive"):
    strand_id: Id


class StrandRestore(WorkspaceRequest, tag="strand.restore"):
    strand_id: Id


class StrandDefaultSet(WorkspaceRequest, tag="strand.default.set"):
    """Point the workspace's default discussion strand (owners and admins): `strand_id` null
    clears it.  Whole-value compare-and-set: `expected_default_strand_id` may be omitted only
    while it was never set; otherwise give the current value (null included)."""

    strand_id: Id | None
    expected_default_strand_id: Id | None | msgspec.UnsetType = UNSET


class StrandDefaultGet(WorkspaceRequest, tag="strand.default.get"):
    """The default discussion strand: null when none is set or you cannot read it."""


# --- assignment -------------------------------------------------------------------------------------

class StrandAssign(WorkspaceRequest, tag="strand.assign"):
    """Assign a member who reads the strand (a strand may have several assignees); the
    assignee is notified (`assignment` delivery) unless muted.  Assigning twice is `conflict`,
    reason `already_assigned`."""

    strand_id: Id
    member_id: Id


class StrandUnassign(WorkspaceRequest, tag="strand.unassign"):
    """Tombstone an assignment by its `assignment_id`."""

    strand_id: Id
    assignment_id: Id


# --- watch ------------------------------------------------------------------------------------------

class StrandWatchSet(WorkspaceRequest, tag="strand.watch.set"):
    """Write a watch (§8): `level` null clears it (= mentions_only).  `watcher_member_id`
    defaults to you; another's needs owner/admin (`watch_must_be_self` otherwise) and may not
    mute nor publish.  `expected_value` is the whole current value (`null` once cleared) and
    may be omitted only when nothing was ever written (`failed_precondition`)."""

    strand_id: Id
    level: WatchLevel | None
    level_public: bool | None = None
    watcher_member_id: Id | None = None
    expected_value: dict[str, Any] | None | msgspec.UnsetType = UNSET


class StrandWatchGet(WorkspaceRequest, tag="strand.watch.get"):
    """Your own exact watch: `never_written`, or `current` with its revision and value."""

    strand_id: Id


class StrandWatchers(WorkspaceRequest, tag="strand.watchers"):
    """The watcher list as you may see it (§8.5): yourself fully; a human's watch only when
    they published it (`level_public`), never muted; an agent's level fully, never muted.
    `audit: true` (owners and admins) returns every watch, muted included, and records the
    read in the strand's audit (`watch_audit_read`)."""

    strand_id: Id
    audit: bool = False


# --- audience mentions (§9.4.3-§9.4.5) --------------------------------------------------------------

Audience = Literal["effective_scope_members", "strand_participants", "strand_watchers", "strand_engaged",
                   "assigned_actors"]


class AudienceMentionPolicySet(WorkspaceRequest, tag="audience_mention.policy.set"):
    """Allow an audience in this workspace (owners and admins), with the most members one
    mention may notify; an audience without a policy is disabled (the default)."""

    audience: Audience
    max_recipients: Annotated[int, msgspec.Meta(ge=1, le=100000)]


class AudienceMentionPolicyDisable(WorkspaceRequest, tag="audience_mention.policy.disable"):
    audience: Audience


class AudienceMentionPolicyList(WorkspaceRequest, tag="audience_mention.policy.list"):
    """The enabled audiences (any member may read the policy)."""


class AudienceMentionGrantCreate(WorkspaceRequest, tag="audience_mention.grant.create"):
    """Grant `ak.message.mention.broadcast` (owners and admins): to one member, on one channel
    (its threads and its boards' strands included), expiring, with a quota of
    `max_operations` messages per `period_seconds`."""

    member_id: Id
    channel_id: Id
    expires_in_seconds: Annotated[int, msgspec.Meta(ge=60, le=366 * 24 * 3600)]
    max_operations: Annotated[int, msgspec.Meta(ge=1, le=10000)]
    period_seconds: Annotated[int, msgspec.Meta(ge=1, le=31536000)]


class AudienceMentionGrantRevoke(WorkspaceRequest, tag="audience_mention.grant.revoke"):
    grant_id: Id


class AudienceMentionGrantList(WorkspaceRequest, tag="audience_mention.grant.list"):
    """Owners and admins see every grant (or one member's with `member_id`); anyone else their own."""

    member_id: Id | None = None


class AgentParticipationSet(WorkspaceRequest, tag="agent.participation.set"):
    """The owner's selection for their agent (§9.4.5): with `accept_third_party_mention` false,
    nobody but the owner wakes it by mention (direct or audience); never retroactive.  Anyone but
    the agent's owner gets `not_found`."""

    member_id: Id
    accept_third_party_mention: bool


FRAMES = (BoardCreate, BoardList, BoardArchive, BoardRestore, StrandCreate, StrandGet, StrandList, StrandUpdate,
          StrandTracksUpdate, StrandStageSet, StrandArchive, StrandRestore, StrandDefaultSet, StrandDefaultGet,
          StrandAssign, StrandUnassign, StrandWatchSet, StrandWatchGet, StrandWatchers, AudienceMentionPolicySet,
          AudienceMentionPolicyDisable, AudienceMentionPolicyList, AudienceMentionGrantCreate,
          AudienceMentionGrantRevoke, AudienceMentionGrantList, AgentParticipationSet)


# --- results ----------------------------------------------------------------------------------------

class BoardInfo(msgspec.Struct):
    id: str
    channel_id: str
    name: str
    status: Literal["active", "archived"]
    created_by_member_id: str
    created_at_ms: int


class BoardPage(msgspec.Struct):
    boards: list[BoardInfo]


class TrackInfo(msgspec.Struct, omit_defaults=True):
    enabled: bool
    is_primary: bool
    profile: str | None = None
    template: str | None = None
    metadata: dict[str, Any] = {}
    content: str | None = None  # synthesis only
    revision: int | None = None  # synthesis only


class AssignmentInfo(msgspec.Struct):
    assignment_id: str
    member_id: str


class SynthesisRevision(msgspec.Struct):
    revision: int
    content: str
    edited_by_member_id: str
    created_at_ms: int


class StrandInfo(msgspec.Struct, omit_defaults=True):
    """`primary_track` is resolved by §4.5; `is_default` is derived from the workspace's
    default strand; `assigned_member_ids` / `assignments` are the active assignments;
    `my_watch` is your own watch value (absent: none written)."""

    id: str
    board_id: str
    channel_id: str
    title: str
    content: str
    fields: dict[str, Any]
    tracks: dict[str, TrackInfo]
    primary_track: str
    state: Literal["active", "archived"]
    version: int
    latest_seq: int
    is_default: bool
    created_by_member_id: str
    created_at_ms: int
    updated_at_ms: int
    assigned_member_ids: list[str] = []
    assignments: list[AssignmentInfo] = []
    summary: str | None = None
    stage: Stage | None = None
    stage_changed_at_ms: int | None = None
    state_changed_at_ms: int | None = None
    updated_by_member_id: str | None = None
    my_watch: dict[str, Any] | None = None
    accept_third_party_mention: bool | None = None
    synthesis_revisions: list[SynthesisRevision] = []
    replayed: bool = False


class StrandPage(msgspec.Struct, omit_defaults=True):
    strands: list[StrandInfo]
    next_cursor: str | None = None


class StrandDefault(msgspec.Struct):
    default_strand_id: str | None


class AssignmentResult(msgspec.Struct):
    assignment_id: str
    member_id: str
    strand: StrandInfo


class WatchState(msgspec.Struct, omit_defaults=True):
    """`status` `never_written`, or `current` with `revision` and `value` (null: cleared)."""

    status: Literal["never_written", "current"]
    revision: int | None = None
    value: dict[str, Any] | None = None


class WatcherInfo(msgspec.Struct, omit_defaults=True):
    member_id: str
    level: WatchLevel
    level_public: bool | None = None


class WatcherList(msgspec.Struct):
    watchers: list[WatcherInfo]


class AudiencePolicyInfo(msgspec.Struct):
    audience: Audience
    max_recipients: int


class AudiencePolicyList(msgspec.Struct):
    policies: list[AudiencePolicyInfo]


class AudienceGrantInfo(msgspec.Struct, omit_defaults=True):
    id: str
    member_id: str
    channel_id: str
    max_operations: int
    period_seconds: int
    granted_by_member_id: str
    created_at_ms: int
    expires_at_ms: int
    active: bool
    uses: int = 0
    revoked_at_ms: int | None = None


class AudienceGrantList(msgspec.Struct):
    grants: list[AudienceGrantInfo]


class ParticipationInfo(msgspec.Struct):
    member_id: str
    accept_third_party_mention: bool
    version: int


RESULTS: dict[type[Request], type[msgspec.Struct]] = {
    BoardCreate: BoardInfo, BoardList: BoardPage, BoardArchive: BoardInfo, BoardRestore: BoardInfo,
    StrandCreate: StrandInfo, StrandGet: StrandInfo, StrandList: StrandPage, StrandUpdate: StrandInfo,
    StrandTracksUpdate: StrandInfo, StrandStageSet: StrandInfo, StrandArchive: StrandInfo, StrandRestore: StrandInfo,
    StrandDefaultSet: StrandDefault, StrandDefaultGet: StrandDefault, StrandAssign: AssignmentResult,
    StrandUnassign: StrandInfo, StrandWatchSet: WatchState, StrandWatchGet: WatchState, StrandWatchers: WatcherList,
    AudienceMentionPolicySet: AudiencePolicyList, AudienceMentionPolicyDisable: AudiencePolicyList,
    AudienceMentionPolicyList: AudiencePolicyList, AudienceMentionGrantCreate: AudienceGrantInfo,
    AudienceMentionGrantRevoke: AudienceGrantInfo, AudienceMentionGrantList: AudienceGrantList,
    AgentParticipationSet: ParticipationInfo,
}


# --- events (to the strand's subscribers) -------------------------------------------------------------

class StrandChanged(msgspec.Struct, omit_defaults=True):
    """`strand.changed`: the strand after a write (`change`: `created`, `updated`, `tracks`, `stage`,
    `archived`, `restored`, `assigned`, `unassigned`), with who made it."""

    change: str
    strand: StrandInfo
    actor_member_id: str


class WatchChanged(msgspec.Struct, omit_defaults=True):
    """`strand.watch.changed`: to the watcher (and the writer) only — a watch is private."""

    strand_id: str
    watcher_member_id: str
    revision: int
    value: dict[str, Any] | None = None


EVENTS: dict[str, type[msgspec.Struct]] = {
    "strand.changed": StrandChanged,
    "strand.watch.changed": WatchChanged,
}
