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

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Email = Annotated[str, msgspec.Meta(min_length=3, max_length=320)]
Password = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Secret = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Slug = Annotated[str, msgspec.Meta(pattern="^[a-z0-9][a-z0-9-]{0,62}$")]
Handle = Annotated[str, msgspec.Meta(pattern="^[a-z0-9][a-z0-9_.-]{0,63}$")]
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


class Login(Request, tag="login"):
    """Email + password → a session token; also authenticates this connection."""

    email: Email
    password: Password


class Auth(Request, tag="auth"):
    """Authenticate this connection with a session token or an API key (exactly one)."""

    token: Secret | None = None
    api_key: Secret | None = None


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


CLIENT_FRAMES: tuple[type[Request], ...] = (
    Ping, Login, Auth, RevokeSessions,
    WorkspaceList, WorkspaceGet, WorkspaceCreate, WorkspaceSuspend,
    MemberList, MemberSetRole, MemberRemove, OwnerTransfer, AgentCreate,
    InvitationCreate, InvitationList, InvitationRevoke, InvitationAccept,
    ApiKeyCreate, ApiKeyList, ApiKeyRevoke,
)
ClientFrame = Union[CLIENT_FRAMES]  # type: ignore[valid-type]
KNOWN_OPS = frozenset(frame.__struct_config__.tag for frame in CLIENT_FRAMES)


def op_of(request: Request) -> str:
    return type(request).__struct_config__.tag  # type: ignore[return-value]


class Envelope(msgspec.Struct):
    """Just enough of a frame to answer it when the full decode fails."""

    id: Any = None
    op: Any = None


# --- server → client -------------------------------------------------------------------

class Result(msgspec.Struct, tag_field="type", tag="result"):
    id: str
    op: str
    data: Any


class Error(msgspec.Struct, tag_field="type", tag="error", omit_defaults=True):
    code: str
    message: str
    id: str | None = None
    details: dict[str, Any] = {}


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
    principal: Literal["account", "api_key"]
    account_id: str | None = None
    api_key_id: str | None = None
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


# WebSocket close codes the server uses (4000–4999 is the application range).
CLOSE_GOING_AWAY = 1001
CLOSE_UNAUTHENTICATED = 4401  # auth timeout or failed authentication
CLOSE_REVOKED = 4403          # the credential was revoked, expired, or the membership ended
