"""Service-account identities shared by storage, actors and the server (service-account.md §2.1, §2.5)."""

from __future__ import annotations

from dataclasses import dataclass, field

SERVICE_ACCOUNT_SLUG = "service-account"
APPROVALS_SLUG = "approvals"
# What a service account's author member may do: write messages into its own scope (§2.1).
MESSAGE_WRITE = "message.write"
CONVERSATION_PREFIX = "serviceAccount:"
POST_MESSAGE_TYPE = "service_account_post"
CARD_MESSAGE_TYPE = "app_interactive_card"
NOTIFICATION_MESSAGE_TYPE = "app_notification"


def normalize_name(name: str) -> str:
    """Names are unique per workspace after trim + casefold (§2.1)."""
    return name.strip().casefold()


def identity_key(workspace_id: str, principal_id: str) -> str:
    return f"service_account:{workspace_id}:{principal_id}"


def conversation_id(scope_id: str) -> str:
    return f"{CONVERSATION_PREFIX}{scope_id}"


def target_id(account_id: str) -> str:
    return f"service-account:{account_id}"


@dataclass(frozen=True)
class ManagerChange:
    """A manager assignment a human lifecycle change ended or created (the fallback owner)."""

    service_account_id: str
    member_id: str
    action: str  # added | removed
    reason: str  # deactivated | fallback
    version: int


@dataclass
class LifecycleChange:
    """What one human lifecycle change did to the workspace's service accounts."""

    lifecycle_seq: int
    manager_changes: list[ManagerChange] = field(default_factory=list)
