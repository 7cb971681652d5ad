"""Request and execution context (workspace-multi-tenant.md §9.1).

Every service function receives one explicitly.  There is no global or
"current" workspace anywhere: the workspace comes from the credential (API
key) or from the request's selector, re-validated against the membership.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from domain.credentials import CredentialProof
from protocol.errors import ErrorCode, ProtocolError
from server.rbac import Permission, Role


@dataclass(frozen=True)
class Principal:
    """Who is calling, as derived from the credential."""

    kind: Literal["account", "api_key", "system", "operator"]
    account_id: str | None = None
    token_version: int | None = None
    api_key_id: str | None = None
    # An API key is bound to one workspace and one member; these come from the key.
    key_workspace_id: str | None = None
    key_member_id: str | None = None
    key_scopes: tuple[str, ...] = ()
    # A platform operator (not a member of any workspace) and the key it authenticated with.
    operator_id: str | None = None
    operator_key_id: str | None = None


SYSTEM = Principal(kind="system")


@dataclass(frozen=True)
class WorkspaceContext:
    workspace_id: str
    member_id: str | None  # None only for the system (CLI operator) context
    member_kind: str | None
    handle: str | None
    role: Role | None
    permissions: frozenset[Permission]
    membership_id: str | None
    membership_revision: int
    execution_generation: int


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    principal: Principal
    workspace: WorkspaceContext | None = None
    extra: dict = field(default_factory=dict)
    # Scopes the request names, as the member may see them (storage row or None),
    # read in the same database unit as the membership check.
    scopes: dict = field(default_factory=dict)
    # What a context served from the connection's cache was built from; a write re-checks it.
    proof: CredentialProof | None = None

    def require(self, permission: Permission) -> WorkspaceContext:
        """The workspace context, if it grants `permission`; forbidden otherwise."""
        if self.workspace is None:
            raise ProtocolError(ErrorCode.WORKSPACE_REQUIRED, "this command needs a workspace")
        if self.principal.kind != "system" and permission not in self.workspace.permissions:
            raise ProtocolError(ErrorCode.FORBIDDEN, f"missing permission {permission.value}")
        return self.workspace

    @property
    def account_id(self) -> str | None:
        return self.principal.account_id
