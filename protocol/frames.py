"""Every wire frame, as msgspec Structs.

Client → server frames are requests: `{"op": ..., "id": ..., ...}`; each gets
exactly one reply, a `result` or an `error` frame carrying the same id.
Server → client frames carry `type`.

Workspace-scoped requests take an optional `workspace_id`: an API key is bound
to its workspace (naming another answers `not_found`); a session in the
multi-workspace edition must name one (`workspace_required`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

PROTOCOL_VERSION = 1
# Requested in the WebSocket handshake: binary MessagePack frames instead of JSON text.
MSGPACK_SUBPROTOCOL = "scopewire.msgpack"
JSON_SUBPROTOCOL = "scopewire.json"  # the default: offering none means JSON too

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Email = Annotated[str, msgspec.Meta(min_length=3, max_length=320)]
Password = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Secret = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Slug = Annotated[str, msgspec.Meta(pattern="^[a-z0-9][a-z0-9-]{0,62}$")]
Handle = Annotated[str, msgspec.Meta(pattern="^[a-z0-9]([a-z0-9_.-]{0,62}[a-z0-9_])?$")]
RoleName = Literal["owner", "admin", "developer", "operator", "viewer"]
InvitableRole = Literal["admin", "developer", "operator", "viewer"]
KeyScope = Literal["read", "write", "admin"]
TtlSeconds = Annotated[int, msgspec.Meta(ge=60, le=365 * 24 * 3600)]


class Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    id: RequestId


class WorkspaceRequest(Request, kw_only=True):
    workspace_id: Id | None = None


# --- connection and auth --------------------------------------------------------------

class Ping(Request, tag="ping"):
    """Liveness check; answered with the server time. Allowed before auth."""


class Hello(Request, tag="hello"):
    """Optional first frame: agree on the protocol version. Allowed before auth."""

    protocol_version: Annotated[int, msgspec.Meta(ge=1)]
    client: Annotated[str, msgspec.Meta(max_length=200)] | None = None


class Login(Request, tag="login"):
    """Email + password → a session token; also authenticates this connection."""

    email: Email
    password: Password


class Auth(Request, tag="auth"):
    """Authenticate this connection with a session token, an API key or a platform
    operator key (exactly one)."""

    token: Secret | None = None
    api_key: Secret | None = None
    operator_key: Secret | None = None


class RevokeSessions(Request, tag="account.revoke_sessions"):
    """Revoke every session token of the calling account (ends its live connections)."""


# --- workspaces ------------------------------------------------------------------------

class WorkspaceList(Request, tag="workspace.list"):
    pass


class WorkspaceGet(WorkspaceRequest, tag="workspace.get"):
    pass


class WorkspaceCreate(Request, tag="workspace.create"):
    name: Name
    slug: Slug


class WorkspaceSuspend(WorkspaceRequest, tag="workspace.suspend"):
    pass


# --- members ---------------------------------------------------------------------------

class MemberList(WorkspaceRequest, tag="member.list"):
    pass


class MemberSetRole(WorkspaceRequest, tag="member.set_role"):
    member_id: Id
    role: RoleName


class MemberRemove(WorkspaceRequest, tag="member.remove"):
    member_id: Id


class OwnerTransfer(WorkspaceRequest, tag="owner.transfer"):
    member_id: Id


class AgentCreate(WorkspaceRequest, tag="agent.create"):
    handle: Handle
    display_name: Name
    visibility: Literal["public", "private"] = "private"


# --- invitations -----------------------------------------------------------------------

class InvitationCreate(WorkspaceRequest, tag="invitation.create"):
    email: Email
    role: InvitableRole = "viewer"
    expires_in_seconds: TtlSeconds = 7 * 24 * 3600


class InvitationList(WorkspaceRequest, tag="invitation.list"):
    pass


class InvitationRevoke(WorkspaceRequest, tag="invitation.revoke"):
    invitation_id: Id


class InvitationAccept(Request, tag="invitation.accept"):
    """Allowed before auth: a new account is created from the invitation's email
    with this password; an existing account must be signed in on this
    connection (or give its password).  Authenticates the connection."""

    token: Secret
    password: Password | None = None
    display_name: Name | None = None


# --- API keys --------------------------------------------------------------------------

class ApiKeyCreate(WorkspaceRequest, tag="apikey.create"):
    name: Name
    member_id: Id | None = None  # default: the caller's own member
    scopes: list[KeyScope] = msgspec.field(default_factory=lambda: ["read", "write"])
    expires_in_seconds: TtlSeconds | None = None


class ApiKeyList(WorkspaceRequest, tag="apikey.list"):
    pass


class ApiKeyRevoke(WorkspaceRequest, tag="apikey.revoke"):
    api_key_id: Id


# --- scopes and messages ----------------------------------------------------------------

ChannelSlug = Annotated[str, msgspec.Meta(pattern="^[a-z0-9][a-z0-9_-]{0,79}$")]
Content = Annotated[str, msgspec.Meta(max_length=40000)]
ClientMessageId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
MessageType = Annotated[str, msgspec.Meta(pattern="^[a-z][a-z0-9_.]{0,63}$")]
Description = Annotated[str, msgspec.Meta(max_length=4000)]
Limit = Annotated[int, msgspec.Meta(ge=1, le=200)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
ReactionKey = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Cursor = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
MAX_ATTACHMENTS_PER_MESSAGE = 20
AttachmentIds = Annotated[list[Id], msgspec.Meta(max_length=MAX_ATTACHMENTS_PER_MESSAGE)]
NotificationState = Literal["active", "quiet", "mute", "auto-wake", "no-wake"]
# Explicit recipients of a send: addressed like live mentions, authorized by the
# server (an unauthorized one answers `forbidden`, reason `recipient_not_addressable`).
RecipientIds = Annotated[list[Id], msgspec.Meta(max_length=20)]


class ChannelCreate(WorkspaceRequest, tag="channel.create"):
    slug: ChannelSlug
    display_name: Name
    description: Description = ""
    visibility: Literal["public", "private"] = "public"
    member_ids: Annotated[list[Id], msgspec.Meta(max_length=100)] = []


class ChannelList(WorkspaceRequest, tag="channel.list"):
    """Public channels and the private ones you belong to."""


class DmOpen(WorkspaceRequest, tag="dm.open"):
    """The one DM scope of you and `member_id` (created on first use)."""

    member_id: Id


class ScopeGet(WorkspaceRequest, tag="scope.get"):
    scope_id: Id


class ScopeMembers(WorkspaceRequest, tag="scope.members"):
    """The scope's current public members; with `include_private` also its
    private members (private agents), each marked `visibility: private` with
    its `owner_member_id`."""

    scope_id: Id
    include_private: bool = False


class ScopeJoin(WorkspaceRequest, tag="scope.join"):
    scope_id: Id


class ScopeLeave(WorkspaceRequest, tag="scope.leave"):
    scope_id: Id


class ScopeInvite(WorkspaceRequest, tag="scope.invite"):
    scope_id: Id
    member_ids: Annotated[list[Id], msgspec.Meta(min_length=1, max_length=100)]


class ScopeRemove(WorkspaceRequest, tag="scope.remove"):
    scope_id: Id
    member_id: Id


class ScopeArchive(WorkspaceRequest, tag="scope.archive"):
    scope_id: Id


class MessageSend(WorkspaceRequest, tag="message.send"):
    """A plain user message: `message_type` is `text` or `markdown` (other types
    come from their own commands); `metadata` is client-owned JSON that never
    carries routing facts (see `input_rules`).  `recipient_member_ids` address
    members explicitly, authorized like live mentions; the server lists the
    addressed ones in `metadata.recipients`."""

    scope_id: Id
    content: Content
    client_message_id: ClientMessageId | None = None
    message_type: MessageType = "text"
    metadata: dict[str, Any] = {}
    reply_to_message_id: Id | None = None
    silent: bool = False
    recipient_member_ids: RecipientIds = []
    # Stored uploads of yours in this scope (protocol/attachments.py), claimed by the message.
    attachment_ids: AttachmentIds = []


class ThreadReply(WorkspaceRequest, tag="thread.reply"):
    """Reply in the thread of `root_message_id` (in `scope_id`); the thread is
    created on the first reply, with the replier, the root's author and the
    private agents the root addressed (each still a member of `scope_id`) as
    its first members.  Replying joins the thread, except for a private agent:
    only the root or a message in the thread admits it (otherwise `forbidden`,
    reason `private_agent_not_admitted`; a strand admits private agents the
    same way, see the strands section).  `recipient_member_ids` as in
    `message.send`."""

    scope_id: Id
    root_message_id: Id
    content: Content
    client_message_id: ClientMessageId | None = None
    recipient_member_ids: RecipientIds = []


class MessageForward(WorkspaceRequest, tag="message.forward"):
    """Forward one message (its mentions stay live, as if re-sent) or several
    (context only: no live mentions) into `scope_id`.  `owner_quote` (human
    members only) shares any visible message you can read as explicit context:
    the message is your `comment`, `metadata.quote` holds a frozen copy of each
    quoted message with its source and author, `metadata.shared_by_member_id`
    is you; quoted mentions stay inert and sharing adds no collaborator."""

    scope_id: Id
    source_message_ids: Annotated[list[Id], msgspec.Meta(min_length=1, max_length=20)]
    comment: Content = ""
    client_message_id: ClientMessageId | None = None
    mode: Literal["forward", "owner_quote"] = "forward"


class MessageEdit(WorkspaceRequest, tag="message.edit"):
    message_id: Id
    content: Content
    expected_revision: Annotated[int, msgspec.Meta(ge=1)]


class MessageWithdraw(WorkspaceRequest, tag="message.withdraw"):
    message_id: Id


class MessageHistory(WorkspaceRequest, tag="message.history"):
    """A page of a scope's timeline: before a seq (default: the newest), after a
    seq, or from your first unread message."""

    scope_id: Id
    before_seq: Seq | None = None
    after_seq: Seq | None = None
    from_first_unread: bool = False
    limit: Limit = 50


class MessageGet(WorkspaceRequest, tag="message.get"):
    """Permalink: one message by id, with its revisions on request."""

    message_id: Id
    include_revisions: bool = False


class ReactionAdd(WorkspaceRequest, tag="reaction.add"):
    message_id: Id
    key: ReactionKey


class ReactionRemove(WorkspaceRequest, tag="reaction.remove"):
    message_id: Id
    key: ReactionKey


class ReadMark(WorkspaceRequest, tag="read.mark"):
    """Move your read cursor forward to `seq` (never backwards)."""

    scope_id: Id
    seq: Seq


class ReadMarkUnread(WorkspaceRequest, tag="read.mark_unread"):
    """Mark unread from `from_seq` on (or just flag the conversation)."""

    scope_id: Id
    from_seq: Annotated[int, msgspec.Meta(ge=1, le=2**53)] | None = None


class NotificationSet(WorkspaceRequest, tag="notification.set"):
    """Your notification state in `scope_id` — or, as its owner, your agent's
    (`member_id`): it decides what a mention, an explicit recipient or a reaction
    routes to the member, and whether ordinary messages wake it (`auto-wake`).
    See the README's table of states."""

    scope_id: Id
    state: NotificationState
    member_id: Id | None = None


class InboxList(WorkspaceRequest, tag="inbox.list"):
    cursor: Cursor | None = None
    limit: Limit = 50


class ConversationAction(WorkspaceRequest, tag="conversation.action", kw_only=True):
    """A personal action on one conversation, named by `scope_id` or by
    `conversation_id` (`serviceAccount:{scope_id}` for a service account's; a
    bare scope id otherwise): exactly one of the two."""

    scope_id: Id | None = None
    conversation_id: Annotated[str, msgspec.Meta(min_length=1, max_length=80)] | None = None
    action: Literal["pin", "unpin", "hide", "restore", "mute", "unmute", "mark_read", "mark_unread"]


# --- realtime subscriptions ------------------------------------------------------------

class ScopeCursor(msgspec.Struct, forbid_unknown_fields=True):
    scope_id: Id
    # Resume: every message after this seq is replayed first; None means live from now.
    after_seq: Seq | None = None


class Subscribe(WorkspaceRequest, tag="subscribe"):
    """Follow single scopes and/or the whole workspace feed (every scope you
    belong to).  With cursors, everything missed is replayed in order before
    live events, with no gap and no duplicate."""

    scopes: Annotated[list[ScopeCursor], msgspec.Meta(max_length=100)] = []
    workspace_feed: bool = False
    after_global_seq: Seq | None = None


class Unsubscribe(WorkspaceRequest, tag="unsubscribe"):
    scope_ids: Annotated[list[Id], msgspec.Meta(max_length=100)] = []
    workspace_feed: bool = False


class Typing(WorkspaceRequest, tag="typing"):
    """Ephemeral: tell the scope's members you are typing (never stored; expires by itself)."""

    scope_id: Id
    state: Literal["start", "stop"] = "start"


class Presence(WorkspaceRequest, tag="presence"):
    """Ephemeral: your presence to the workspace feed (never stored; expires unless refreshed)."""

    state: Literal["online", "away"]


CLIENT_FRAMES: tuple[type[Request], ...] = (
    Ping, Hello, Login, Auth, RevokeSessions,
    WorkspaceList, WorkspaceGet, WorkspaceCreate, WorkspaceSuspend,
    MemberList, MemberSetRole, MemberRemove, OwnerTransfer, AgentCreate,
    InvitationCreate, InvitationList, InvitationRevoke, InvitationAccept,
    ApiKeyCreate, ApiKeyList, ApiKeyRevoke,
    ChannelCreate, ChannelList, DmOpen, ScopeGet, ScopeMembers, ScopeJoin, ScopeLeave, ScopeInvite, ScopeRemove,
    ScopeArchive, MessageSend, ThreadReply, MessageForward, MessageEdit, MessageWithdraw, MessageHistory, MessageGet,
    ReactionAdd, ReactionRemove, ReadMark, ReadMarkUnread, NotificationSet, InboxList, ConversationAction,
    Subscribe, Unsubscribe, Typing, Presence,
)


def op_of(request: Request) -> str:
    return type(request).__struct_config__.tag  # type: ignore[return-value]


class Envelope(msgspec.Struct):
    """Just enough of a frame to answer it when the full decode fails."""

    id: Any = None
    op: Any = None


# --- server → client -------------------------------------------------------------------

class Result(msgspec.Struct, tag_field="type", tag="result"):
    """The reply to a request: `data` has the type protocol/results.py RESULTS names for `op`."""

    id: str
    op: str
    data: Any


class Error(msgspec.Struct, tag_field="type", tag="error", omit_defaults=True):
    code: str
    message: str
    id: str | None = None
    details: dict[str, Any] = {}


class Event(msgspec.Struct, tag_field="type", tag="event", omit_defaults=True):
    """A push: `event` names it and protocol/events.py EVENTS gives the type of
    its `data`.  `seq` / `global_seq` are the cursors to resume from (message
    events only)."""

    event: str
    workspace_id: str
    scope_id: str
    data: Any
    seq: int | None = None
    global_seq: int | None = None


class HelloResult(msgspec.Struct):
    protocol_version: int
    server: str
    max_frame_bytes: int


class SubscribeResult(msgspec.Struct, omit_defaults=True):
    scopes: list[ScopeInfo]
    workspace_feed: bool
    workspace_global_seq: int | None = None


class PingResult(msgspec.Struct):
    server_time_ms: int
    protocol_version: int = PROTOCOL_VERSION


class WorkspaceInfo(msgspec.Struct):
    id: str
    name: str
    slug: str
    type: str
    status: str
    role: str | None = None
    member_id: str | None = None


class AuthResult(msgspec.Struct, omit_defaults=True):
    principal: Literal["account", "api_key", "operator"]
    account_id: str | None = None
    api_key_id: str | None = None
    operator_id: str | None = None
    workspace_id: str | None = None
    member_id: str | None = None
    token: str | None = None
    expires_at: int | None = None
    workspaces: list[WorkspaceInfo] = []


class MemberInfo(msgspec.Struct, omit_defaults=True):
    id: str
    kind: str
    handle: str
    display_name: str
    status: str
    role: str | None = None
    email: str | None = None
    owner_member_id: str | None = None
    visibility: str | None = None


class InvitationInfo(msgspec.Struct, omit_defaults=True):
    id: str
    email: str
    role: str
    status: str
    expires_at: int
    token: str | None = None  # only in the create result, once


class ApiKeyInfo(msgspec.Struct, omit_defaults=True):
    id: str
    member_id: str
    name: str
    scopes: list[str]
    status: str
    created_at: int
    expires_at: int | None = None
    last_used_at: int | None = None
    key: str | None = None  # only in the create result, once


class Ok(msgspec.Struct):
    ok: bool = True


class ScopeInfo(msgspec.Struct, omit_defaults=True):
    id: str
    type: str
    status: str
    latest_seq: int
    slug: str | None = None
    display_name: str | None = None
    description: str | None = None
    visibility: str | None = None
    parent_scope_id: str | None = None
    root_message_id: str | None = None
    is_member: bool | None = None


class ScopeMemberInfo(msgspec.Struct, omit_defaults=True):
    member_id: str
    handle: str
    display_name: str
    kind: str
    visibility: str
    owner_member_id: str | None = None


class ReactionSummary(msgspec.Struct):
    key: str
    count: int
    me: bool


class AuthorProfile(msgspec.Struct, omit_defaults=True):
    """A service account's AuthorProfile (service-account §2.1), the same in messages,
    the Inbox, the directory, navigation, permalinks and the audit.  `member_id` is the author
    member of its posts; open it by `target_id` / `conversation_id`."""

    service_account_id: str
    principal_id: str
    actor_type: Literal["service"]
    service_kind: Literal["service_account"]
    member_id: str
    target_id: str
    display_name: str
    description: str
    conversation_id: str
    scope_id: str
    profile_version: int
    # The fixed audience: every active human of the workspace (no opt-in or out).
    audience: Literal["all_active_humans"]
    capabilities: list[str]  # what the target id opens: profile.open, conversation.open
    avatar_url: str | None = None


class MessageInfo(msgspec.Struct, omit_defaults=True):
    id: str
    scope_id: str
    seq: int
    global_seq: int
    author_member_id: str
    author_type: str
    message_type: str
    content: str
    revision: int
    state: str
    created_at_ms: int
    metadata: dict[str, Any] = {}
    client_message_id: str | None = None
    thread_scope_id: str | None = None
    reactions: list[ReactionSummary] = []
    replayed: bool = False
    # A service account's post: the account's AuthorProfile (service-account §2.1).
    author_profile: AuthorProfile | None = None


class RevisionInfo(msgspec.Struct):
    revision: int
    content: str
    edited_by_member_id: str
    created_at_ms: int


class MessageDetail(msgspec.Struct, omit_defaults=True):
    message: MessageInfo
    revisions: list[RevisionInfo] = []


class HistoryPage(msgspec.Struct, omit_defaults=True):
    messages: list[MessageInfo]
    has_more: bool
    last_read_seq: int | None = None
    root: MessageInfo | None = None  # a thread's root message, as context


class ConversationInfo(msgspec.Struct, omit_defaults=True):
    scope_id: str
    type: str
    latest_seq: int
    last_read_seq: int
    unread_count: int
    pinned: bool
    manual_unread: bool
    notification_state: str
    activity_at_ms: int
    display_name: str | None = None
    parent_scope_id: str | None = None
    last_message_id: str | None = None
    last_author_member_id: str | None = None
    last_preview: str | None = None
    # `serviceAccount:{scope_id}` for a service account's conversation (kind `serviceAccount`), else the scope id.
    conversation_id: str | None = None
    kind: str | None = None
    service_account: AuthorProfile | None = None


class InboxPage(msgspec.Struct, omit_defaults=True):
    conversations: list[ConversationInfo]
    next_cursor: str | None = None


# WebSocket close codes the server uses (4000–4999 is the application range).
CLOSE_GOING_AWAY = 1001
CLOSE_UNAUTHENTICATED = 4401  # auth timeout or failed authentication
CLOSE_REVOKED = 4403          # the credential was revoked, expired, or the membership ended
CLOSE_SLOW_CONSUMER = 4408    # the client did not keep up; reconnect and resume from your cursors
CLOSE_IDLE = 4400             # no frame from the client for idle_timeout_seconds
CLOSE_UNAVAILABLE = 1011      # the server could not deliver (e.g. database down); resume from your cursors


# Each later domain defines its ops in its own module (every frame type above
# is defined by then, so the import is not circular) and is appended here.
from protocol import (  # noqa: E402
    collaboration as _collaboration, deliveries as _deliveries, platform as _platform,
    attachments as _attachments, private_agents as _private_agents, search as _search,
    service_accounts as _service_accounts, strands as _strands)

CLIENT_FRAMES += (*_collaboration.FRAMES, *_private_agents.FRAMES, *_deliveries.FRAMES, *_service_accounts.FRAMES,
                  *_platform.FRAMES, *_strands.FRAMES, *_attachments.FRAMES, *_search.FRAMES)
ClientFrame = Union[CLIENT_FRAMES]  # type: ignore[valid-type]
KNOWN_OPS = frozenset(frame.__struct_config__.tag for frame in CLIENT_FRAMES)
