"""A service account's AuthorProfile (service-account §2.1), built from its
account row the same way wherever it appears: posts, the Inbox, the
directory, navigation and the audit."""

from __future__ import annotations

from typing import Any

from domain.service_accounts import conversation_id, target_id
from protocol import frames as f


def author_profile(account: Any) -> f.AuthorProfile:
    return f.AuthorProfile(
        service_account_id=account["id"], principal_id=account["principal_id"], actor_type="service",
        service_kind="service_account", member_id=account["author_member_id"], target_id=target_id(account["id"]),
        display_name=account["name"], description=account["description"],
        conversation_id=conversation_id(account["message_scope_id"]), scope_id=account["message_scope_id"],
        profile_version=account["profile_version"], audience="all_active_humans",
        capabilities=["profile.open", "conversation.open"])


def with_profile(info: f.MessageInfo, accounts: dict[str, Any]) -> f.MessageInfo:
    """`info` carrying its author's profile when a service account wrote it."""
    account = accounts.get(info.scope_id)
    if account is not None and info.author_member_id == account["author_member_id"]:
        info.author_profile = author_profile(account)
    return info
