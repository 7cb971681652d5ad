"""Workspace service accounts (service-account.md): a Service Actor that posts,
under its own identity, into its own read-only timeline whose audience is
exactly the workspace's active humans; humans who manage it publish through it.

Creating one is a create request: direct (`direct_create`) or through an
approval by the workspace's owners and admins (`approval_required`), whose
cards arrive as messages in a DM with the built-in Approvals app.  Posts,
edits and withdrawals are ordinary messages of the account's
`service_account` scope; members read, react and keep read state there as
anywhere.  Every mutation writes an audit event in its own transaction.

Errors carry `details.reason`; see each op.  Every list takes an opaque
`cursor` (a malformed one: `invalid`, reason `bad_cursor`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from protocol.frames import AuthorProfile, Cursor, Id, Limit, MessageInfo, Ok, Request, Seq, WorkspaceRequest

AccountName = Annotated[str, msgspec.Meta(min_length=1, max_length=80)]
AccountDescription = Annotated[str, msgspec.Meta(max_length=1000)]
ClientKey = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Version = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
Reason = Annotated[str, msgspec.Meta(max_length=1000)]
PostTitle = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
PostBody = Annotated[str, msgspec.Meta(min_length=1, max_length=40000)]
# A post's client_message_id is a UUID (service-account §2.2), in its canonical text form.
PostClientId = Annotated[str, msgspec.Meta(
    pattern="^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")]
CreationPolicy = Literal["approval_required", "direct_create", "admins_only"]
BusinessState = Literal["submitted", "awaiting_authorization", "authorized", "declined", "cancelled",
                        "provisioning", "fulfilled", "action_required"]
# `serviceAccount:{scope_id}` for a service account's conversation, or a bare scope id.
ConversationId = Annotated[str, msgspec.Meta(min_length=1, max_length=80)]


# --- creation policy, create requests and approvals ----------------------------------------------------

class PolicyGet(WorkspaceRequest, tag="service_account.policy.get"):
    """The workspace's creation policy: owners and admins always create directly;
    for everyone else `direct_create`, `approval_required` (the default) or
    `admins_only` (others may not create)."""


class PolicySet(WorkspaceRequest, tag="service_account.policy.set"):
    """Owners and admins set the creation policy (`forbidden` otherwise);
    `expected_version` is the policy's current `version` (`conflict`,
    reason `version_mismatch`)."""

    creation_policy: CreationPolicy
    expected_version: Annotated[int, msgspec.Meta(ge=0, le=2**53)]


class RequestSubmit(WorkspaceRequest, tag="service_account.request.submit"):
    """Ask for a new workspace service account named `name` (trimmed; unique in
    the workspace ignoring case: `conflict`, reason `name_taken`).  The policy
    decides the path: `direct_create` creates it in the same transaction (the
    request is `provisioning`, then `fulfilled` once its audience is ready);
    `approval_required` makes the request `awaiting_authorization` and sends an
    approval card to every owner and admin, and you a pending receipt.  The
    snapshot (name, description), `request_version` and `payload_digest` are
    fixed now.  Retrying with the same `client_request_id` and payload returns
    the same request; another payload: `idempotency_conflict`.  Only humans
    (`forbidden`, reason `not_human`); under `admins_only` only owners and admins
    (`forbidden`, reason `creation_not_allowed`)."""

    client_request_id: ClientKey
    name: AccountName
    description: AccountDescription = ""


class RequestGet(WorkspaceRequest, tag="service_account.request.get"):
    """A create request: owners and admins see every one, others their own (others' ids: `not_found`)."""

    request_id: Id


class RequestList(WorkspaceRequest, tag="service_account.request.list"):
    """Create requests, newest first: all of them for owners and admins, your own otherwise."""

    business_state: BusinessState | None = None
    cursor: Cursor | None = None
    limit: Limit = 50


class RequestCancel(WorkspaceRequest, tag="service_account.request.cancel"):
    """The requester cancels a request that has not created its account yet
    (submitted, awaiting_authorization, action_required).  `expected_version` is
    the request's `version` (`conflict`, reason `version_mismatch`).  The approval
    closes (`approval_closure_receipt`) and its cards show it.  The same
    `client_mutation_id` again returns the same result.  An account already
    created: `conflict`, reason `create_request_already_materialized`, with
    `details.service_account_id`; another final state: `conflict`, reason
    `not_cancellable`; someone else's request: `forbidden` (`not_requester`) to
    owners and admins, `not_found` to others."""

    request_id: Id
    expected_version: Version
    client_mutation_id: ClientKey


class ApprovalGet(WorkspaceRequest, tag="approval.get"):
    """An approval instance: for its approvers (owners and admins) and the requester."""

    approval_id: Id


class ApprovalDecide(WorkspaceRequest, tag="approval.decide"):
    """An owner or admin approves or rejects (`forbidden`, reason `not_an_approver`
    otherwise).  `expected_version` is the approval's `version` (`conflict`,
    reason `version_mismatch`); a decided or closed approval: `conflict`, reason
    `approval_closed`.  Approving creates the account in the same transaction
    (or, when its name was taken meanwhile or the requester left, turns the
    request `action_required`); rejecting declines the request.  Every card and
    the requester's receipt then show the decision, and the requester gets one
    new result message.  `card_revision` / `client_action_id` identify the card
    action that sent it (recorded in the audit)."""

    approval_id: Id
    decision: Literal["approve", "reject"]
    expected_version: Version
    reason: Reason = ""
    card_revision: Annotated[int, msgspec.Meta(ge=1, le=2**31)] | None = None
    client_action_id: ClientKey | None = None


# --- accounts, managers, audience -----------------------------------------------------------------------

class AccountList(WorkspaceRequest, tag="service_account.list"):
    """The directory (§5.4): every active human sees every account's profile,
    optionally matching `query` (a prefix of a word of the name or description,
    ignoring case).  Listing reveals profiles only; reading an account's
    messages needs its membership."""

    query: Annotated[str, msgspec.Meta(max_length=80)] | None = None
    cursor: Cursor | None = None
    limit: Limit = 50


class AccountGet(WorkspaceRequest, tag="service_account.get"):
    """One account by id (= its principal id).  Its managers and owners/admins
    also get `governance` (managers, audience state, version)."""

    service_account_id: Id


class AccountUpdate(WorkspaceRequest, tag="service_account.update"):
    """A manager or an owner/admin changes the name and/or description
    (`expected_version`: the account's `version`).  A platform account's
    instance (`management_kind` `platform`) changes only through its platform
    account: `forbidden`, reason `platform_managed` (also for delete, managers
    and posts)."""

    service_account_id: Id
    expected_version: Version
    name: AccountName | None = None
    description: AccountDescription | None = None


class AccountDelete(WorkspaceRequest, tag="service_account.delete"):
    """Permanent delete by a manager or an owner/admin, with `expected_version`
    (`conflict`, reason `version_mismatch`): one transaction removes the account,
    its identity (installation, service member, grant, binding, author member),
    its scope with every message and member state, its managers and its name
    claim (the name is free again).  The audit keeps the subject id and version."""

    service_account_id: Id
    expected_version: Version


class ManagerList(WorkspaceRequest, tag="service_account.managers.list"):
    """The account's managers (removed ones too, with `include_removed`): for its managers and owners/admins."""

    service_account_id: Id
    include_removed: bool = False
    cursor: Cursor | None = None
    limit: Limit = 50


class ManagerAdd(WorkspaceRequest, tag="service_account.managers.add"):
    """A manager or an owner/admin (`forbidden`, reason `not_a_manager`) adds an
    active human (`invalid`, reason `not_an_active_human`) as manager.  Managing
    and publishing are one authority; the audience does not change."""

    service_account_id: Id
    member_id: Id


class ManagerRemove(WorkspaceRequest, tag="service_account.managers.remove"):
    """Remove a manager (yourself included); the last one stays (`conflict`, reason `last_manager`)."""

    service_account_id: Id
    member_id: Id


class AudienceGet(WorkspaceRequest, tag="service_account.audience.get"):
    """The fixed all-human audience's state and reconcile progress (managers and owners/admins)."""

    service_account_id: Id


# --- posts ------------------------------------------------------------------------------------------------

class Post(WorkspaceRequest, tag="service_account.post"):
    """A manager publishes a `service_account_post` (title + Markdown body)
    authored by the account: its author, notify principal and idempotency
    subject are the account's service member; you are the permission basis,
    the caused-by and execution actor, and with `byline` the byline.  All
    managers share one `client_message_id` space: a retry (by any manager) with
    the same payload returns the same message (`replayed`), another payload
    `idempotency_conflict`.  Not a manager: `forbidden` (`not_a_manager`); before
    the audience's first reconcile completes: `conflict` (`audience_not_ready`).
    Writes one message, one outbox row and one audit event whatever the audience size."""

    service_account_id: Id
    title: PostTitle
    content: PostBody
    client_message_id: PostClientId
    byline: bool = False


class PostEdit(WorkspaceRequest, tag="service_account.post.edit"):
    """A manager replaces a post's title and body at `expected_revision`
    (`conflict`, reason `revision_mismatch`).  Id, seq, order and everyone's read
    position stay."""

    message_id: Id
    title: PostTitle
    content: PostBody
    expected_revision: Version
    reason: Reason = ""


class PostWithdraw(WorkspaceRequest, tag="service_account.post.withdraw"):
    """A manager withdraws a post at `expected_revision` with a `reason`: a
    tombstone keeps its id and seq; the text is erased."""

    message_id: Id
    expected_revision: Version
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]


class AuditList(WorkspaceRequest, tag="service_account.audit.list"):
    """Audit events, newest first: owners and admins see the workspace's (or one
    account's), a manager their account's (`forbidden`, reason `not_a_manager`)."""

    service_account_id: Id | None = None
    cursor: Cursor | None = None
    limit: Limit = 50


# --- shared pins and bulk read ----------------------------------------------------------------------------

class PinAdd(WorkspaceRequest, tag="pin.add"):
    """Pin a message for everyone in a service account's timeline (its managers
    only: `forbidden`, reason `not_a_manager`); `top_notice` makes it the one top
    notice (replacing the previous one).  Other scopes: `invalid`, reason
    `scope_type_not_supported`."""

    message_id: Id
    top_notice: bool = False


class PinRemove(WorkspaceRequest, tag="pin.remove"):
    """Unpin a shared pin (managers only)."""

    message_id: Id


class PinList(WorkspaceRequest, tag="pin.list"):
    """The scope's shared pins, top notice first: for anyone who reads the scope."""

    scope_id: Id


class MarkReadItem(msgspec.Struct, forbid_unknown_fields=True):
    conversation_id: ConversationId
    read_through_seq: Seq


class ConversationMarkReadMany(WorkspaceRequest, tag="conversation.mark_read_many"):
    """Move your read cursor in up to 100 distinct conversations at once, each
    to its `read_through_seq` (never backwards), as `read.mark` would; each item
    answers `ok` with the cursor now, or `not_found`."""

    items: Annotated[list[MarkReadItem], msgspec.Meta(min_length=1, max_length=100)]


FRAMES: tuple[type[Request], ...] = (
    PolicyGet, PolicySet, RequestSubmit, RequestGet, RequestList, RequestCancel, ApprovalGet, ApprovalDecide,
    AccountList, AccountGet, AccountUpdate, AccountDelete, ManagerList, ManagerAdd, ManagerRemove, AudienceGet,
    Post, PostEdit, PostWithdraw, AuditList, PinAdd, PinRemove, PinList, ConversationMarkReadMany,
)


# --- results ------------------------------------------------------------------------------------------------

class PolicyInfo(msgspec.Struct):
    creation_policy: CreationPolicy
    version: int


class RequestPayload(msgspec.Struct):
    name: str
    description: str


class CreateRequestInfo(msgspec.Struct, omit_defaults=True):
    """A create request.  `request_version` and `payload_digest` (hex sha256 of
    the snapshot) are fixed at submit: the approval's subject; `version` moves
    with every state change (a cancel's `expected_version`)."""

    id: str
    request_version: int
    client_request_id: str
    requested_by_member_id: str
    authorization_path: Literal["direct_create", "approval_required"]
    business_state: BusinessState
    payload: RequestPayload
    payload_digest: str
    version: int
    created_at_ms: int
    updated_at_ms: int
    approval_id: str | None = None
    created_service_account_id: str | None = None
    action_required_reason: str | None = None
    cancel_client_mutation_id: str | None = None
    approval_closure_receipt: str | None = None
    replayed: bool = False


class CreateRequestPage(msgspec.Struct, omit_defaults=True):
    requests: list[CreateRequestInfo]
    next_cursor: str | None = None


class ApprovalInfo(msgspec.Struct, omit_defaults=True):
    id: str
    subject_type: Literal["service_account_create_request"]
    subject_ref: str
    subject_version: int
    payload_digest: str
    state: Literal["pending", "approved", "rejected", "closed"]
    version: int
    decided_by_member_id: str | None = None
    decision_reason: str | None = None
    decided_at_ms: int | None = None


class ApprovalDecision(msgspec.Struct):
    approval: ApprovalInfo
    request: CreateRequestInfo


# The account's AuthorProfile (defined with the message frames that carry it).
ServiceAccountProfile = AuthorProfile


class AudienceInfo(msgspec.Struct):
    """`provisioning` until the first reconcile pass completes (no posts yet);
    `reconciling` while a later human lifecycle change is applied; `ready` when
    `effective_audience_version` = `audience_policy_version`.  `member_count`:
    current memberships of active humans."""

    state: Literal["provisioning", "reconciling", "ready"]
    audience_policy_version: int
    effective_audience_version: int
    member_count: int
    batches_done: int


class ManagerInfo(msgspec.Struct, omit_defaults=True):
    member_id: str
    status: Literal["active", "removed"]
    added_at_ms: int
    added_by_member_id: str | None = None
    removed_at_ms: int | None = None
    removed_reason: Literal["removed", "deactivated"] | None = None


class Governance(msgspec.Struct, omit_defaults=True):
    version: int
    management_kind: Literal["workspace", "platform"]
    audience: AudienceInfo
    managers: list[ManagerInfo]
    created_by_member_id: str | None = None
    create_request_id: str | None = None


class ServiceAccountDetail(msgspec.Struct, omit_defaults=True):
    profile: ServiceAccountProfile
    version: int
    governance: Governance | None = None


class ServiceAccountPage(msgspec.Struct, omit_defaults=True):
    accounts: list[ServiceAccountProfile]
    next_cursor: str | None = None


class ServiceAccountDeleted(msgspec.Struct):
    service_account_id: str
    version: int


class ManagerPage(msgspec.Struct, omit_defaults=True):
    managers: list[ManagerInfo]
    next_cursor: str | None = None


class AuditEventInfo(msgspec.Struct, omit_defaults=True):
    """One audit fact: who (`actor_type`, `actor_member_id`) did `action` to
    which subject at which version, on what `permission_basis`, with the
    message's execution facts for a post (durable author = the account's
    member; caused-by / execution = the manager)."""

    id: str
    subject_type: Literal["service_account", "create_request", "approval", "message", "policy"]
    subject_id: str
    action: str
    actor_type: Literal["human", "service", "system"]
    permission_basis: str
    correlation_id: str
    created_at_ms: int
    details: dict[str, Any] = {}
    service_account_id: str | None = None
    subject_version: int | None = None
    actor_member_id: str | None = None
    caused_by_member_id: str | None = None
    execution_member_id: str | None = None
    durable_author_member_id: str | None = None
    byline_member_id: str | None = None
    message_id: str | None = None
    message_version: int | None = None
    before_digest: str | None = None
    after_digest: str | None = None
    comment: str | None = None


class AuditPage(msgspec.Struct, omit_defaults=True):
    events: list[AuditEventInfo]
    next_cursor: str | None = None


class PinInfo(msgspec.Struct):
    scope_id: str
    message_id: str
    top_notice: bool
    pinned_by_member_id: str
    pinned_at_ms: int


class PinPage(msgspec.Struct):
    pins: list[PinInfo]


class MarkReadItemResult(msgspec.Struct, omit_defaults=True):
    conversation_id: str
    status: Literal["ok", "not_found"]
    last_read_seq: int | None = None


class MarkReadManyResult(msgspec.Struct):
    results: list[MarkReadItemResult]


RESULTS: dict[type[Request], type[msgspec.Struct]] = {
    PolicyGet: PolicyInfo, PolicySet: PolicyInfo,
    RequestSubmit: CreateRequestInfo, RequestGet: CreateRequestInfo, RequestList: CreateRequestPage,
    RequestCancel: CreateRequestInfo, ApprovalGet: ApprovalInfo, ApprovalDecide: ApprovalDecision,
    AccountList: ServiceAccountPage, AccountGet: ServiceAccountDetail, AccountUpdate: ServiceAccountDetail,
    AccountDelete: ServiceAccountDeleted, ManagerList: ManagerPage, ManagerAdd: ManagerInfo,
    ManagerRemove: ManagerInfo, AudienceGet: AudienceInfo,
    Post: MessageInfo, PostEdit: MessageInfo, PostWithdraw: MessageInfo,
    AuditList: AuditPage, PinAdd: PinInfo, PinRemove: Ok, PinList: PinPage,
    ConversationMarkReadMany: MarkReadManyResult,
}


# --- events ---------------------------------------------------------------------------------------------

class ServiceAccountChanged(msgspec.Struct):
    """`service_account.created` / `.updated` / `.deleted`: to its managers and the owners/admins."""

    service_account_id: str
    principal_id: str
    version: int
    name: str


class ManagerChanged(msgspec.Struct, omit_defaults=True):
    """`service_account.manager_changed`: to the managers before and after, and the owners/admins."""

    service_account_id: str
    member_id: str
    action: Literal["added", "removed"]
    version: int
    reason: str | None = None


class AudienceChanged(msgspec.Struct):
    """`service_account.audience_changed`: a reconcile completed (or, on a first
    pass, advanced a batch): to the managers and the owners/admins."""

    service_account_id: str
    audience: AudienceInfo


class PinChanged(msgspec.Struct):
    """`pin.changed`: a shared pin was set or cleared (to the scope's members)."""

    message_id: str
    pinned: bool
    top_notice: bool
    member_id: str


EVENTS: dict[str, type[msgspec.Struct]] = {
    "service_account.create_request.submitted": CreateRequestInfo,
    "service_account.create_request.authorized": CreateRequestInfo,
    "service_account.create_request.declined": CreateRequestInfo,
    "service_account.create_request.cancelled": CreateRequestInfo,
    "service_account.create_request.changed": CreateRequestInfo,
    "service_account.created": ServiceAccountChanged,
    "service_account.updated": ServiceAccountChanged,
    "service_account.deleted": ServiceAccountChanged,
    "service_account.manager_changed": ManagerChanged,
    "service_account.audience_changed": AudienceChanged,
    "pin.changed": PinChanged,
}

