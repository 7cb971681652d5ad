"""The fixed role × permission matrix (workspace-multi-tenant.md §10.4), defined once."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    OWNER = "owner"
    ADMIN = "admin"
    DEVELOPER = "developer"
    OPERATOR = "operator"
    VIEWER = "viewer"


class Permission(str, enum.Enum):
    WORKSPACE_VIEW = "workspace.view"
    WORKSPACE_UPDATE = "workspace.update"
    WORKSPACE_DELETE = "workspace.delete"
    OWNER_TRANSFER = "owner.transfer"
    MEMBER_VIEW = "member.view"
    MEMBER_INVITE = "member.invite"
    MEMBER_UPDATE_ROLE = "member.update_role"
    MEMBER_REMOVE = "member.remove"
    RESOURCE_VIEW = "resource.view"
    RESOURCE_MANAGE = "resource.manage"
    RUNTIME_OPERATE = "runtime.operate"
    PROVIDER_SECRET_MANAGE = "provider_secret.manage"
    API_KEY_MANAGE = "api_key.manage"
    AUDIT_VIEW = "audit.view"
    DATA_EXPORT = "data.export"
    BILLING_LINK_MANAGE = "billing_link.manage"
    # Messaging (not in the seed's table, which predates messaging): what scope
    # memberships then allow.  message.read covers reading and the member's own
    # read state (read markers, notification settings, Inbox pins, joining and
    # leaving public channels, subscriptions, presence); message.write covers
    # everything that puts content or structure in front of others (send, reply,
    # forward, edit, withdraw, react, typing, creating channels, DMs and private
    # agents, inviting to or removing from scopes, archiving).
    MESSAGE_READ = "message.read"
    MESSAGE_WRITE = "message.write"


P = Permission
_READ = {P.WORKSPACE_VIEW, P.MEMBER_VIEW, P.RESOURCE_VIEW, P.MESSAGE_READ}
# Every role the seed lets do more than read participates in messaging; the
# viewer is read-only ("只读非敏感资源和监控", SPEC rule 8b).
_PARTICIPANT = _READ | {P.MESSAGE_WRITE}

ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    Role.VIEWER: frozenset(_READ),
    Role.OPERATOR: frozenset(_PARTICIPANT | {P.RUNTIME_OPERATE}),
    Role.DEVELOPER: frozenset(_PARTICIPANT | {P.RUNTIME_OPERATE, P.RESOURCE_MANAGE, P.PROVIDER_SECRET_MANAGE}),
    Role.ADMIN: frozenset(
        _PARTICIPANT
        | {P.RUNTIME_OPERATE, P.RESOURCE_MANAGE, P.PROVIDER_SECRET_MANAGE, P.WORKSPACE_UPDATE, P.MEMBER_INVITE,
           P.MEMBER_UPDATE_ROLE, P.MEMBER_REMOVE, P.API_KEY_MANAGE, P.AUDIT_VIEW, P.DATA_EXPORT}
    ),
    Role.OWNER: frozenset(Permission),
}

# Agents and service identities have no workspace role; they participate in scopes.
NON_HUMAN_PERMISSIONS = frozenset(_PARTICIPANT)

# API key scopes and the permissions each allows (a key gets role ∩ scopes).
API_KEY_SCOPES: dict[str, frozenset[Permission]] = {
    "read": frozenset({P.WORKSPACE_VIEW, P.MEMBER_VIEW, P.RESOURCE_VIEW, P.MESSAGE_READ}),
    "write": frozenset({P.MESSAGE_WRITE, P.RESOURCE_MANAGE, P.RUNTIME_OPERATE}),
    "admin": frozenset(Permission),
}
DEFAULT_API_KEY_SCOPES = ("read", "write")


def permissions_for(role: Role | None) -> frozenset[Permission]:
    return ROLE_PERMISSIONS[role] if role is not None else NON_HUMAN_PERMISSIONS


def key_scope_permissions(scopes: list[str] | tuple[str, ...]) -> frozenset[Permission]:
    allowed: set[Permission] = set()
    for scope in scopes:
        allowed |= API_KEY_SCOPES[scope]
    return frozenset(allowed)


def may_change_role(actor: Role, target_current: Role, target_new: Role) -> bool:
    """Owners may change any role, admins any but an owner's; nobody is made
    owner here (owner transfer is its own operation).  The last-owner rule is
    enforced separately, under a lock."""
    if target_new is Role.OWNER:
        return False
    if target_current is Role.OWNER:
        return actor is Role.OWNER
    return actor in (Role.OWNER, Role.ADMIN)


def may_remove(actor: Role, target: Role) -> bool:
    if target is Role.OWNER:
        return actor is Role.OWNER  # and the last-owner rule still applies
    return actor in (Role.OWNER, Role.ADMIN)
