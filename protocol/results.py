"""The one table of what each op answers: `RESULTS` maps every request type to
the msgspec Struct its `result` frame carries in `data`.

The server checks every handler's return against it (server/handlers.py), the
generated spec documents it (protocol/spec.py, protocol/asyncapi.py), and the
test suite validates every result frame it receives against it.  List results
are objects with a named list field, so they can grow fields without breaking
clients.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol import (attachments, collaboration, deliveries, platform, private_agents, search, service_accounts,
                      strands)
from protocol import frames as f


class WorkspaceListResult(msgspec.Struct):
    """The workspaces the caller belongs to (an API key: its own)."""

    workspaces: list[f.WorkspaceInfo]


class MemberListResult(msgspec.Struct):
    """Every member of the workspace: humans, agents and services."""

    members: list[f.MemberInfo]


class InvitationListResult(msgspec.Struct):
    invitations: list[f.InvitationInfo]


class ApiKeyListResult(msgspec.Struct):
    api_keys: list[f.ApiKeyInfo]


class ChannelListResult(msgspec.Struct):
    """Public channels (`is_member` says whether you joined) and the private ones you belong to."""

    channels: list[f.ScopeInfo]


class ScopeMembersResult(msgspec.Struct):
    """The scope's current members."""

    members: list[f.ScopeMemberInfo]


class ReadStateResult(msgspec.Struct):
    """Your read cursor after the change: every message with seq <= last_read_seq is read."""

    last_read_seq: int


class NotificationStateResult(msgspec.Struct):
    state: f.NotificationState


RESULTS: dict[type[f.Request], type[msgspec.Struct]] = {
    f.Ping: f.PingResult,
    f.Hello: f.HelloResult,
    f.Login: f.AuthResult,
    f.Auth: f.AuthResult,
    f.RevokeSessions: f.Ok,
    f.WorkspaceList: WorkspaceListResult,
    f.WorkspaceGet: f.WorkspaceInfo,
    f.WorkspaceCreate: f.WorkspaceInfo,
    f.WorkspaceSuspend: f.Ok,
    f.MemberList: MemberListResult,
    f.MemberSetRole: f.Ok,
    f.MemberRemove: f.Ok,
    f.OwnerTransfer: f.Ok,
    f.AgentCreate: f.MemberInfo,
    f.InvitationCreate: f.InvitationInfo,
    f.InvitationList: InvitationListResult,
    f.InvitationRevoke: f.Ok,
    f.InvitationAccept: f.AuthResult,
    f.ApiKeyCreate: f.ApiKeyInfo,
    f.ApiKeyList: ApiKeyListResult,
    f.ApiKeyRevoke: f.Ok,
    f.ChannelCreate: f.ScopeInfo,
    f.ChannelList: ChannelListResult,
    f.DmOpen: f.ScopeInfo,
    f.ScopeGet: f.ScopeInfo,
    f.ScopeMembers: ScopeMembersResult,
    f.ScopeJoin: f.Ok,
    f.ScopeLeave: f.Ok,
    f.ScopeInvite: f.Ok,
    f.ScopeRemove: f.Ok,
    f.ScopeArchive: f.Ok,
    f.MessageSend: f.MessageInfo,
    f.ThreadReply: f.MessageInfo,
    f.MessageForward: f.MessageInfo,
    f.MessageEdit: f.MessageInfo,
    f.MessageWithdraw: f.MessageInfo,
    f.MessageHistory: f.HistoryPage,
    f.MessageGet: f.MessageDetail,
    f.ReactionAdd: f.Ok,
    f.ReactionRemove: f.Ok,
    f.ReadMark: ReadStateResult,
    f.ReadMarkUnread: ReadStateResult,
    f.NotificationSet: NotificationStateResult,
    f.InboxList: f.InboxPage,
    f.ConversationAction: f.Ok,
    f.Subscribe: f.SubscribeResult,
    f.Unsubscribe: f.Ok,
    f.Typing: f.Ok,
    f.Presence: f.Ok,
    **collaboration.RESULTS,
    **private_agents.RESULTS,
    **deliveries.RESULTS,
    **service_accounts.RESULTS,
    **platform.RESULTS,
    **strands.RESULTS,
    **attachments.RESULTS,
    **search.RESULTS,
}
assert set(RESULTS) == set(f.CLIENT_FRAMES), "every op needs exactly one result type"

RESULTS_BY_OP: dict[str, type[msgspec.Struct]] = {
    kind.__struct_config__.tag: result for kind, result in RESULTS.items()}


def _result_frame(op: str, data: type[msgspec.Struct]) -> type[f.Result]:
    name = "".join(part.title() for part in op.replace(".", "_").split("_")) + "ResultFrame"
    return msgspec.defstruct(name, [("id", str), ("op", Literal[op]), ("data", data)],
                             tag_field="type", tag="result", forbid_unknown_fields=True)


# The `result` frame of each op with its `data` typed: what a client may rely on.
RESULT_FRAMES: dict[str, type[msgspec.Struct]] = {op: _result_frame(op, data) for op, data in RESULTS_BY_OP.items()}
