"""Platform service accounts and all-workspace broadcast (service-account.md §2.4,
§2.5, §4.5): a platform operator — a principal of the deployment, not a member
of any workspace — creates platform service accounts and broadcasts through
them to every workspace at once.

An operator authenticates with `auth` and an `operator_key` (issued by
`scopewire admin operator create`); these ops take no `workspace_id`, and an
operator's connection may call nothing workspace-scoped (`forbidden`, reason
`operator_not_member`).  Anyone else calling them gets `forbidden`, reason
`platform_operator_required`.

Every workspace — existing and created later — gets its own instance of each
platform account: a local service account (its own installation, author
member, grant and read-only `service_account` timeline whose audience is the
workspace's active humans).  A broadcast is accepted durably at once
(`waiting_provisioning`), numbered (`broadcast_seq`) once the account's
provisioning has reached the generation captured at acceptance, and then
delivered to each targeted workspace as an ordinary message of that
workspace's instance, in broadcast-seq order per workspace, exactly once.

A broadcast may carry attachments: the operator uploads each file as a
platform asset of the account (`platform.asset.upload.begin` / `.chunk` /
`.finish`, checked as a workspace attachment upload is — size, declared
SHA-256, content type against the bytes; the same `details.reason` values) and
names the stored assets in `platform.broadcast.create` (`asset_ids`, in
order).  The broadcast freezes their manifest (asset id, SHA-256, type, size,
filename, label; covered by `payload_digest`), the assets stay immutable from
then on, and every workspace delivery materializes each as an attachment of
the delivered message in the message's own transaction (its
`metadata.attachments`, read with `attachment.get` / `attachment.read` by
whoever may read the message; the bytes are stored once).  An asset no
broadcast references is deleted after the deployment's unclaimed-upload TTL.

Errors carry `details.reason`; every list takes an opaque `cursor`
(a malformed one: `invalid`, reason `bad_cursor`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from protocol.attachments import ByteSize, Chunk, ContentType, Filename, Label, Offset, Sha256
from protocol.frames import Cursor, Id, Limit, Ok, Request

AccountName = Annotated[str, msgspec.Meta(min_length=1, max_length=80)]
AccountDescription = Annotated[str, msgspec.Meta(max_length=1000)]
ClientKey = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Version = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
BroadcastTitle = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
BroadcastBody = Annotated[str, msgspec.Meta(min_length=1, max_length=40000)]
ProvisioningState = Literal["provisioning", "ready"]
BroadcastState = Literal["waiting_provisioning", "accepted", "dispatching", "completed",
                         "completed_with_exceptions", "closed"]
# Attachments one broadcast may carry.
MAX_BROADCAST_ASSETS = 10
AssetIds = Annotated[list[Id], msgspec.Meta(max_length=MAX_BROADCAST_ASSETS)]
AssetState = Literal["uploading", "stored"]
DeliveryState = Literal["queued", "leased", "waiting_instance", "waiting_audience", "retry_wait",
                        "operator_attention", "delivered", "closed", "skipped"]


# --- accounts -------------------------------------------------------------------------------------------

class PlatformSubscribe(Request, tag="platform.subscribe"):
    """Receive the platform events (`platform_service_account.*`) on this connection."""


class PlatformAccountCreate(Request, tag="platform.account.create"):
    """Create a platform service account named `name` (trimmed; unique in the
    deployment ignoring case, across platform accounts and every workspace's own
    accounts: `conflict`, reason `name_taken`).  It is then provisioned into
    every workspace (`provisioning_state` `provisioning` → `ready`)."""

    name: AccountName
    description: AccountDescription = ""


class PlatformAccountList(Request, tag="platform.account.list"):
    """Every platform account, by id."""

    cursor: Cursor | None = None
    limit: Limit = 50


class PlatformAccountGet(Request, tag="platform.account.get"):
    platform_service_account_id: Id


class PlatformAccountUpdate(Request, tag="platform.account.update"):
    """Change the profile; `expected_version` is the account's `version`
    (`conflict`, reason `version_mismatch`).  `profile_version` moves and every
    workspace instance takes the new profile (`applied_profile_version`)."""

    platform_service_account_id: Id
    expected_version: Version
    name: AccountName | None = None
    description: AccountDescription | None = None


class PlatformAccountDelete(Request, tag="platform.account.delete"):
    """Delete the account for good, in one transaction under its root lock: every
    workspace instance with its timeline and messages, every broadcast and
    delivery, and its name (free again).  The audit keeps the facts."""

    platform_service_account_id: Id
    expected_version: Version


class PlatformInstanceList(Request, tag="platform.account.instances"):
    """The account's workspace instances, by workspace id."""

    platform_service_account_id: Id
    cursor: Cursor | None = None
    limit: Limit = 50


# --- broadcasts -----------------------------------------------------------------------------------------

class BroadcastCreate(Request, tag="platform.broadcast.create"):
    """Broadcast a post to every workspace.  Accepted durably and answered at once
    (state `waiting_provisioning`, or later states on a replay); follow it with
    `platform.broadcast.get` or the `platform_service_account.broadcast_*` events.
    The same (account, operator, `client_broadcast_id`) with the same title and
    content returns the same broadcast (`replayed`); with another:
    `idempotency_conflict`.  Content hitting the deployment's moderation keywords:
    `content_blocked` (a moderation log entry is written, nothing else).
    `asset_ids`: this account's stored assets, attached in this order to every
    workspace's message (each at most once; an unknown, unfinished or other
    account's asset: `not_found`, reason `asset_not_found`)."""

    platform_service_account_id: Id
    client_broadcast_id: ClientKey
    title: BroadcastTitle
    content: BroadcastBody
    asset_ids: AssetIds = []


class BroadcastGet(Request, tag="platform.broadcast.get"):
    broadcast_id: Id


class BroadcastList(Request, tag="platform.broadcast.list"):
    """The account's broadcasts, newest acceptance first."""

    platform_service_account_id: Id
    cursor: Cursor | None = None
    limit: Limit = 50


class BroadcastDeliveryList(Request, tag="platform.broadcast.deliveries"):
    """Delivery diagnostics of a broadcast: one row per targeted workspace (and
    per `generation_excluded` settlement), by workspace id, optionally one state."""

    broadcast_id: Id
    state: DeliveryState | None = None
    cursor: Cursor | None = None
    limit: Limit = 50


class BroadcastDeliveryRetry(Request, tag="platform.delivery.retry"):
    """Requeue a delivery in `operator_attention`, `retry_wait`, `waiting_audience`
    or `waiting_instance` now, with a fresh attempt budget (`conflict`, reason
    `version_mismatch` or `not_retryable`)."""

    delivery_id: Id
    expected_version: Version


class BroadcastDeliverySettleSkip(Request, tag="platform.delivery.settle_skip"):
    """Give up on an unsettled delivery: if its message exists it settles
    `delivered`, otherwise `skipped` (audited); either way the workspace moves on
    to its next broadcast.  `conflict`, reason `version_mismatch` or
    `already_settled`."""

    delivery_id: Id
    expected_version: Version


class PlatformAuditList(Request, tag="platform.audit.list"):
    """Platform audit events, newest first; optionally one account's (also after its deletion)."""

    platform_service_account_id: Id | None = None
    cursor: Cursor | None = None
    limit: Limit = 50


# --- assets (a broadcast's attachments) -------------------------------------------------------------------

class PlatformAssetUploadBegin(Request, tag="platform.asset.upload.begin"):
    """Start uploading a file a broadcast of this account can carry: as
    `attachment.upload.begin` (allowed types, size limit, optional `sha256`,
    `label` defaulting to the filename), with the same quota of unreferenced
    uploads per operator."""

    platform_service_account_id: Id
    filename: Filename
    content_type: ContentType
    byte_size: ByteSize
    sha256: Sha256 | None = None
    label: Label | None = None


class PlatformAssetUploadChunk(Request, tag="platform.asset.upload.chunk"):
    """The next bytes of your asset upload, at `offset` = the bytes received so far
    (as `attachment.upload.chunk`)."""

    asset_id: Id
    offset: Offset
    data: Chunk


class PlatformAssetUploadFinish(Request, tag="platform.asset.upload.finish"):
    """Check and store a fully received asset (as `attachment.upload.finish`)."""

    asset_id: Id


class PlatformAssetUploadAbort(Request, tag="platform.asset.upload.abort"):
    """Delete an asset no broadcast carries yet (one that a broadcast carries:
    `conflict`, reason `asset_in_use`)."""

    asset_id: Id


class PlatformAssetGet(Request, tag="platform.asset.get"):
    asset_id: Id


FRAMES: tuple[type[Request], ...] = (
    PlatformSubscribe, PlatformAccountCreate, PlatformAccountList, PlatformAccountGet, PlatformAccountUpdate, PlatformAccountDelete, PlatformInstanceList,
    BroadcastCreate, BroadcastGet, BroadcastList, BroadcastDeliveryList, BroadcastDeliveryRetry, BroadcastDeliverySettleSkip, PlatformAuditList,
    PlatformAssetUploadBegin, PlatformAssetUploadChunk, PlatformAssetUploadFinish, PlatformAssetUploadAbort,
    PlatformAssetGet,
)


# --- results --------------------------------------------------------------------------------------------

class ProvisioningInfo(msgspec.Struct):
    """`applied_provisioning_generation` reaches `target_provisioning_generation`
    (the deployment's generation when the last pass began) once every workspace
    has an instance whose audience is ready."""

    state: ProvisioningState
    deployment_generation: int
    target_provisioning_generation: int
    applied_provisioning_generation: int
    instances: int
    instances_ready: int


class PlatformAccountInfo(msgspec.Struct, omit_defaults=True):
    id: str
    principal_id: str
    name: str
    description: str
    profile_version: int
    version: int
    provisioning_mode: Literal["all_workspaces"]
    provisioning: ProvisioningInfo
    latest_broadcast_seq: int
    created_by_operator_id: str
    created_at_ms: int
    updated_at_ms: int


class PlatformAccountPage(msgspec.Struct, omit_defaults=True):
    accounts: list[PlatformAccountInfo]
    next_cursor: str | None = None


class PlatformInstanceInfo(msgspec.Struct, omit_defaults=True):
    """A workspace's instance: its local account and timeline, the broadcast-seq
    interval it receives (`effective_from_broadcast_seq` ≤ seq, and seq <
    `effective_to_broadcast_seq` when set) and the last seq applied there."""

    workspace_id: str
    local_service_account_id: str
    scope_id: str
    opened_provisioning_generation: int
    effective_from_broadcast_seq: int
    last_applied_broadcast_seq: int
    applied_profile_version: int
    provisioning_state: Literal["identity_ready", "ready"]
    version: int
    effective_to_broadcast_seq: int | None = None


class PlatformInstancePage(msgspec.Struct, omit_defaults=True):
    instances: list[PlatformInstanceInfo]
    next_cursor: str | None = None


class TargetCounts(msgspec.Struct):
    """Recipient targets (generation-excluded settlements are counted apart, in
    `generation_excluded`, and not as targets)."""

    targets: int
    delivered: int
    skipped: int
    pending: int
    exceptions: int  # operator_attention + retry_wait
    generation_excluded: int


class PlatformAssetInfo(msgspec.Struct, omit_defaults=True):
    id: str
    platform_service_account_id: str
    uploaded_by_operator_id: str
    filename: str
    label: str
    content_type: str
    byte_size: int
    state: AssetState
    received_bytes: int
    created_at_ms: int
    max_chunk_bytes: int
    # A broadcast carries it: immutable, kept while its account lives.
    referenced: bool
    sha256: str | None = None
    # Until then an unreferenced asset is kept (absent once referenced).
    expires_at_ms: int | None = None


class BroadcastAsset(msgspec.Struct):
    """One entry of a broadcast's frozen asset manifest."""

    asset_id: str
    filename: str
    label: str
    content_type: str
    byte_size: int
    sha256: str


class BroadcastInfo(msgspec.Struct, omit_defaults=True):
    id: str
    platform_service_account_id: str
    client_broadcast_id: str
    operator_id: str
    state: BroadcastState
    required_provisioning_generation: int
    acceptance_ordinal: int
    payload_digest: str
    title: str
    content: str
    version: int
    accepted_at_ms: int
    targets: TargetCounts
    broadcast_seq: int | None = None
    sequenced_at_ms: int | None = None
    completed_at_ms: int | None = None
    replayed: bool = False
    assets: list[BroadcastAsset] = []


class BroadcastPage(msgspec.Struct, omit_defaults=True):
    broadcasts: list[BroadcastInfo]
    next_cursor: str | None = None


class BroadcastDeliveryInfo(msgspec.Struct, omit_defaults=True):
    id: str
    broadcast_id: str
    workspace_id: str
    broadcast_seq: int
    recipient_eligible: bool
    state: DeliveryState
    attempt: int
    version: int
    outcome: Literal["delivered", "generation_excluded", "skipped"] | None = None
    local_service_account_id: str | None = None
    local_message_id: str | None = None
    last_error: str | None = None
    lease_expires_at_ms: int | None = None
    next_attempt_at_ms: int | None = None


class BroadcastDeliveryPage(msgspec.Struct, omit_defaults=True):
    deliveries: list[BroadcastDeliveryInfo]
    next_cursor: str | None = None


class PlatformAuditInfo(msgspec.Struct, omit_defaults=True):
    id: str
    subject_type: Literal["platform_service_account", "broadcast", "delivery", "instance"]
    subject_id: str
    action: str
    permission_basis: str
    correlation_id: str
    created_at_ms: int
    details: dict[str, Any] = {}
    platform_service_account_id: str | None = None
    subject_version: int | None = None
    operator_id: str | None = None
    broadcast_id: str | None = None
    broadcast_seq: int | None = None


class PlatformAuditPage(msgspec.Struct, omit_defaults=True):
    events: list[PlatformAuditInfo]
    next_cursor: str | None = None


RESULTS: dict[type[Request], type[msgspec.Struct]] = {
    PlatformSubscribe: Ok, PlatformAccountCreate: PlatformAccountInfo, PlatformAccountList: PlatformAccountPage,
    PlatformAccountGet: PlatformAccountInfo, PlatformAccountUpdate: PlatformAccountInfo, PlatformAccountDelete: Ok,
    PlatformInstanceList: PlatformInstancePage, BroadcastCreate: BroadcastInfo, BroadcastGet: BroadcastInfo,
    BroadcastList: BroadcastPage, BroadcastDeliveryList: BroadcastDeliveryPage, BroadcastDeliveryRetry: BroadcastDeliveryInfo,
    BroadcastDeliverySettleSkip: BroadcastDeliveryInfo, PlatformAuditList: PlatformAuditPage,
    PlatformAssetUploadBegin: PlatformAssetInfo, PlatformAssetUploadChunk: PlatformAssetInfo,
    PlatformAssetUploadFinish: PlatformAssetInfo, PlatformAssetUploadAbort: Ok, PlatformAssetGet: PlatformAssetInfo,
}


# --- events (to every operator connection that sent platform.subscribe) ---------------------------------

class PlatformAccountChanged(msgspec.Struct):
    """`platform_service_account.created` / `.updated` / `.deleted`."""

    platform_service_account_id: str
    version: int
    name: str


class PlatformInstanceChanged(msgspec.Struct):
    """`platform_service_account.instance_changed`: a workspace instance opened or became ready."""

    platform_service_account_id: str
    workspace_id: str
    provisioning_state: Literal["identity_ready", "ready"]


class BroadcastChanged(msgspec.Struct):
    """`platform_service_account.broadcast_accepted` / `.broadcast_completed`."""

    broadcast: BroadcastInfo


class BroadcastDeliveryChanged(msgspec.Struct):
    """`platform_service_account.broadcast_delivery_changed`: an attempt failed
    (`retry_wait`), a delivery needs an operator (`operator_attention`), or an
    operator settled or requeued it."""

    delivery: BroadcastDeliveryInfo


EVENTS: dict[str, type[msgspec.Struct]] = {
    "platform_service_account.created": PlatformAccountChanged,
    "platform_service_account.updated": PlatformAccountChanged,
    "platform_service_account.deleted": PlatformAccountChanged,
    "platform_service_account.instance_changed": PlatformInstanceChanged,
    "platform_service_account.broadcast_accepted": BroadcastChanged,
    "platform_service_account.broadcast_completed": BroadcastChanged,
    "platform_service_account.broadcast_delivery_changed": BroadcastDeliveryChanged,
}
