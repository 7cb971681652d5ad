"""Scope and message commands: resolve and authorize the scope from the
caller's context (never from client-supplied workspace or member ids), then
hand writes to the scope's actor and reads to storage/messages.

Not found vs forbidden: a scope the caller cannot read answers `not_found`,
except a public channel (its existence is visible), which answers `forbidden`.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import asyncpg
import trio

from actors import scope_actor as cmd
from actors.fanout import CommittedEvent
from domain.credentials import CredentialProof
from domain.service_accounts import CONVERSATION_PREFIX
from domain.plan import (ActorContext, ChannelProfile, CommittedMessage, MembershipMutation, MentionCandidate,
                         MessageIntent, RosterEntry, SourceRef)
from actors.routing_tokens import MentionMode
from protocol import frames as f
from protocol import results
from protocol.errors import ErrorCode, ProtocolError
from protocol.reaction_keys import InvalidReactionKey, normalize_reaction_key
from server.context import RequestContext, WorkspaceContext
from server.rbac import Permission
from server.service_profiles import author_profile, with_profile
from storage import applier, messages, service_accounts, tenancy, visibility
from storage.errors import NotFound, StorageError
from storage.ids import is_valid_id, new_id

if TYPE_CHECKING:
    from server.app import Connection, Server

log = logging.getLogger("scopewire.messaging")

# The acting member of system commands (they pass the fence with the current generation).
SYSTEM_ACTOR = "system"


def _not_found(what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_FOUND, f"{what} not found")


def _check_id(value: str, prefix: str, what: str) -> str:
    if not is_valid_id(value, prefix):
        raise ProtocolError(ErrorCode.INVALID, f"malformed {what} id", details={"field": what})
    return value


def _actor(workspace: WorkspaceContext) -> ActorContext:
    if workspace.member_id is None:
        raise ProtocolError(ErrorCode.FORBIDDEN, "messaging needs a member")
    return ActorContext(workspace_id=workspace.workspace_id, member_id=workspace.member_id,
                        member_kind=workspace.member_kind or "human", owner_member_id=None,
                        execution_generation=workspace.execution_generation)


def _workspace(ctx: RequestContext) -> WorkspaceContext:
    if ctx.workspace is None:
        raise ProtocolError(ErrorCode.WORKSPACE_REQUIRED, "this command needs a workspace")
    return ctx.workspace


async def _scope(server: Server, ctx: RequestContext, scope_id: str, permission: Permission, *,
                 allow_discoverable: bool = False) -> tuple[WorkspaceContext, asyncpg.Record]:
    # Resolve before checking the permission: a scope the caller cannot see
    # answers not_found whatever the role (§9.5: 404 before 403).
    workspace = _workspace(ctx)
    _check_id(scope_id, "scp", "scope")
    if scope_id in ctx.scopes:
        row = ctx.scopes[scope_id]
    else:
        row = await server.db.run(messages.scope_for_viewer, workspace.workspace_id, scope_id, workspace.member_id)
    if row is None:
        raise _not_found("scope")
    if not row["readable"] and not (allow_discoverable and row["discoverable"]):
        if row["discoverable"]:
            raise ProtocolError(ErrorCode.FORBIDDEN, "join the channel first")
        raise _not_found("scope")
    return ctx.require(permission), row


async def _message_scope(server: Server, ctx: RequestContext, message_id: str,
                         permission: Permission) -> tuple[WorkspaceContext, asyncpg.Record]:
    workspace = _workspace(ctx)
    _check_id(message_id, "msg", "message")
    row = await server.db.run(messages.message_scope, workspace.workspace_id, workspace.member_id, message_id)
    if row is None:
        raise _not_found("message")
    return ctx.require(permission), row


def scope_info(row: Any, is_member: bool | None = None) -> f.ScopeInfo:
    return f.ScopeInfo(id=row["id"], type=row["type"], status=row["status"], latest_seq=row["latest_seq"],
                       slug=row["slug"], display_name=row["display_name"], description=row["description"],
                       visibility=row["visibility"], parent_scope_id=row.get("parent_scope_id"),
                       root_message_id=row.get("root_message_id"), is_member=is_member)


def _ms(value) -> int:
    return int(value.timestamp() * 1000)


def _metadata_of(message: CommittedMessage | asyncpg.Record) -> dict[str, Any]:
    metadata = message.metadata if isinstance(message, CommittedMessage) else message["metadata"]
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    return metadata or {}


def message_info(message: CommittedMessage | asyncpg.Record, reactions: list | None = None) -> f.MessageInfo:
    get = (lambda k: getattr(message, k)) if isinstance(message, CommittedMessage) else (lambda k: message[k])
    metadata = _metadata_of(message)
    return f.MessageInfo(
        id=get("id"), scope_id=get("scope_id"), seq=get("seq"), global_seq=get("workspace_global_seq"),
        author_member_id=get("author_member_id"), author_type=get("author_type"),
        message_type=get("message_type"), content=get("content"), revision=get("revision"), state=get("state"),
        created_at_ms=_ms(get("created_at")), metadata=metadata, client_message_id=get("client_message_id"),
        thread_scope_id=None if isinstance(message, CommittedMessage) else message["thread_scope_id"],
        reactions=[f.ReactionSummary(r["reaction_key"], r["count"], r["me"]) for r in reactions or []],
        replayed=message.replayed if isinstance(message, CommittedMessage) else False,
    )


async def _submit(server: Server, scope_id: str, command: cmd.Command) -> Any:
    try:
        return await server.registry.submit(scope_id, command)
    except cmd.Refused as exc:
        raise ProtocolError(ErrorCode(exc.code), exc.message,
                            details={"reason": exc.reason} if exc.reason else None) from None
    except cmd.ActorFailed:
        # The registry logged the crash once, with its traceback.
        raise ProtocolError(ErrorCode.INTERNAL, "internal error") from None


# --- members who leave the workspace -------------------------------------------------------------

# How often a server looks for memberships a removal left open (another process
# removed the member, or this one died before closing them).
DEPARTED_SWEEP_SECONDS = 30.0


async def close_departed_member(server: Server, workspace_id: str, member_id: str) -> int:
    """Close every open scope membership of a member who is no longer active in
    the workspace, each through its scope's actor (the only roster writer).
    Returns how many were closed.  Safe to repeat; a failure is left to the sweep."""
    closed = 0
    try:
        generation = await server.db.run(tenancy.current_generation, workspace_id)
        actor = ActorContext(workspace_id=workspace_id, member_id=SYSTEM_ACTOR, member_kind="system",
                             owner_member_id=None, execution_generation=generation)
        for scope_id in await server.db.run(visibility.scopes_with_open_membership, workspace_id, member_id):
            result = await server.registry.submit(scope_id, cmd.CloseDeparted(actor, (member_id,)))
            closed += len(result["closed"])
    except (StorageError, cmd.ActorFailed) as exc:
        log.warning("closing a departed member's memberships failed; the sweep retries",
                    extra={"workspace_id": workspace_id, "member_id": member_id, "error": str(exc)})
    return closed


async def sweep_departed_members(server: Server, *, interval_seconds: float = DEPARTED_SWEEP_SECONDS,
                                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """At start, then every `interval_seconds`: close what removals left open."""
    task_status.started()
    while True:
        await close_departed_members(server)
        await trio.sleep(interval_seconds)


async def close_departed_members(server: Server) -> int:
    """One sweep over every workspace; returns how many memberships it closed."""
    try:
        departed = await server.db.run(visibility.departed_members_with_open_memberships)
    except StorageError as exc:
        log.warning("departed-member sweep failed; retrying", extra={"error": str(exc)})
        return 0
    return sum([await close_departed_member(server, row["workspace_id"], row["member_id"]) for row in departed])


# --- scopes -----------------------------------------------------------------------------------

_HUMAN = MentionCandidate("", "", "human", "active", None, None)


async def _caller_as_candidate(server: Server, workspace: WorkspaceContext) -> MentionCandidate:
    """The calling member's kind, visibility and owner (read only for agents)."""
    if workspace.member_kind != "agent":
        return _HUMAN
    return await server.db.run(messages.member_candidate, workspace.workspace_id, workspace.member_id)


async def channel_create(server: Server, connection: Connection, request: f.ChannelCreate,
                         ctx: RequestContext) -> f.ScopeInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    actor = _actor(workspace)
    for member_id in request.member_ids:
        _check_id(member_id, "mem", "member")
    if (await _caller_as_candidate(server, workspace)).visibility == "private":
        # A private agent is in a scope only as its owner's private member (scope-model §5.1).
        raise ProtocolError(ErrorCode.FORBIDDEN, "a private agent does not create channels",
                            details={"reason": "private_agent_not_admitted"})
    # One transaction in the new scope's actor: the channel exists with all its
    # members or not at all (an unknown member leaves no channel behind).
    scope_id = await _submit(server, new_id("scp"), cmd.CreateScope(
        actor, "channel", (MembershipMutation(actor.member_id, "open"),),
        invitees=tuple(m for m in dict.fromkeys(request.member_ids) if m != actor.member_id),
        channel=ChannelProfile(request.slug, request.display_name, request.description, request.visibility)))
    row = await server.db.run(messages.scope_for_viewer, workspace.workspace_id, scope_id, workspace.member_id)
    return scope_info(row, True)


async def channel_list(server: Server, connection: Connection, request: f.ChannelList,
                       ctx: RequestContext) -> results.ChannelListResult:
    workspace = ctx.require(Permission.MESSAGE_READ)
    rows = await server.db.run(messages.channel_list, workspace.workspace_id, workspace.member_id)
    return results.ChannelListResult([scope_info(row, row["is_member"]) for row in rows])


async def dm_open(server: Server, connection: Connection, request: f.DmOpen, ctx: RequestContext) -> f.ScopeInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    actor = _actor(workspace)
    other_id = _check_id(request.member_id, "mem", "member")
    other = await server.db.run(messages.member_candidate, workspace.workspace_id, other_id)
    if other.status != "active":
        raise ProtocolError(ErrorCode.CONFLICT, "that member is not active")
    private = other.kind == "agent" and other.visibility == "private"
    if private and other.owner_member_id != workspace.member_id:
        raise ProtocolError(ErrorCode.FORBIDDEN, "a private agent talks only with its owner")
    caller = await _caller_as_candidate(server, workspace)
    if caller.visibility == "private":
        # The same DM seen from the agent's side: only with its owner, as a private member.
        if other_id != caller.owner_member_id:
            raise ProtocolError(ErrorCode.FORBIDDEN, "a private agent talks only with its owner")
        other, other_id, private = caller, caller.member_id, True
    pair = sorted({workspace.member_id, request.member_id})
    members = [MembershipMutation(member_id, "open", "private", other.owner_member_id)
               if member_id == other_id and private else MembershipMutation(member_id, "open")
               for member_id in pair]
    scope_id = await ensure_dm(server, actor, members)
    row = await server.db.run(messages.scope_for_viewer, workspace.workspace_id, scope_id, workspace.member_id)
    return scope_info(row, True)


async def ensure_dm(server: Server, actor: ActorContext, members: list[MembershipMutation]) -> str:
    """The one DM scope of a pair (sorted `members`), created on first use; a member of
    the pair who left the workspace and came back gets a new interval in it."""
    pair = [m.member_id for m in members]
    identity_key = f"dm:{actor.workspace_id}:" + ":".join(pair)
    scope_id = await server.db.run(messages.keyed_scope, actor.workspace_id, identity_key)
    if scope_id is None:
        scope_id = await _submit(server, new_id("scp"), cmd.CreateScope(actor, "dm", tuple(members),
                                                                        identity_key=identity_key))
    else:
        # A member of the pair who left the workspace and came back: the DM is theirs again.
        roster = await server.db.run(visibility.entitled_roster, scope_id)
        returning = tuple(member_id for member_id in pair if member_id not in roster)
        if returning:
            try:
                await _submit(server, scope_id, cmd.ChangeMembers(actor, "reopen_dm", returning))
            except ProtocolError as exc:
                if exc.details.get("reason") != "not_reopenable":  # reopened concurrently
                    raise
    return scope_id


async def scope_get(server: Server, connection: Connection, request: f.ScopeGet, ctx: RequestContext) -> f.ScopeInfo:
    _, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ, allow_discoverable=True)
    return scope_info(row, row["readable"])


async def scope_members(server: Server, connection: Connection, request: f.ScopeMembers,
                        ctx: RequestContext) -> results.ScopeMembersResult:
    _, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    return results.ScopeMembersResult([
        f.ScopeMemberInfo(member_id=m["member_id"], handle=m["handle"], display_name=m["display_name"],
                          kind=m["kind"], visibility=m["visibility"], owner_member_id=m["owner_member_id"])
        for m in await server.db.run(visibility.scope_members, row["id"], include_private=request.include_private)])


async def scope_join(server: Server, connection: Connection, request: f.ScopeJoin, ctx: RequestContext) -> f.Ok:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ, allow_discoverable=True)
    await _submit(server, row["id"], cmd.ChangeMembers(_actor(workspace), "join", (workspace.member_id,)))
    return f.Ok()


async def scope_leave(server: Server, connection: Connection, request: f.ScopeLeave, ctx: RequestContext) -> f.Ok:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    await _submit(server, row["id"], cmd.ChangeMembers(_actor(workspace), "leave", (workspace.member_id,)))
    return f.Ok()


async def scope_invite(server: Server, connection: Connection, request: f.ScopeInvite, ctx: RequestContext) -> f.Ok:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    ids = tuple(dict.fromkeys(_check_id(m, "mem", "member") for m in request.member_ids))
    await _submit(server, row["id"], cmd.ChangeMembers(_actor(workspace), "invite", ids))
    return f.Ok()


async def scope_remove(server: Server, connection: Connection, request: f.ScopeRemove, ctx: RequestContext) -> f.Ok:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    member_id = _check_id(request.member_id, "mem", "member")
    if row["type"] == "dm":
        raise ProtocolError(ErrorCode.FORBIDDEN, "a DM's roster is fixed")
    await _submit(server, row["id"], cmd.ChangeMembers(_actor(workspace), "remove", (member_id,)))
    return f.Ok()


async def scope_archive(server: Server, connection: Connection, request: f.ScopeArchive, ctx: RequestContext) -> f.Ok:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    if row["type"] == "channel" and Permission.RESOURCE_MANAGE not in workspace.permissions:
        owner = await server.db.run(messages.channel_owner, row["id"])
        if owner != workspace.member_id:
            raise ProtocolError(ErrorCode.FORBIDDEN, "only the channel owner or a resource manager archives it")
    await _submit(server, row["id"], cmd.Archive(_actor(workspace)))
    return f.Ok()


# --- sending ------------------------------------------------------------------------------------

async def _send(server: Server, workspace: WorkspaceContext, scope_id: str, intent: MessageIntent,
                proof: CredentialProof | None = None) -> f.MessageInfo:
    message = await _submit(server, scope_id, cmd.Send(_actor(workspace), intent, proof))
    return message_info(message)


def _recipients(member_ids: list[str]) -> tuple[str, ...]:
    """Explicit recipients, checked for shape only: the planner authorizes them."""
    return tuple(dict.fromkeys(_check_id(m, "mem", "recipient") for m in member_ids))


async def message_send(server: Server, connection: Connection, request: f.MessageSend,
                       ctx: RequestContext) -> f.MessageInfo:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    sources: tuple[SourceRef, ...] = ()
    if request.reply_to_message_id is not None:
        source = await server.db.run(messages.message_for_viewer, workspace.workspace_id, workspace.member_id,
                                     _check_id(request.reply_to_message_id, "msg", "message"))
        if source is None or source["scope_id"] != row["id"]:
            raise _not_found("message")
        sources = (SourceRef("reply", source["id"], source["scope_id"], source["seq"]),)
    attachment_ids = tuple(_check_id(a, "att", "attachment") for a in request.attachment_ids)
    if len(set(attachment_ids)) != len(attachment_ids):
        raise ProtocolError(ErrorCode.INVALID, "attachment_ids: an attachment is listed twice",
                            details={"field": "attachment_ids", "reason": "duplicate_attachment"})
    return await _send(server, workspace, row["id"], MessageIntent(
        scope_id=row["id"], content=request.content, message_type=request.message_type,
        client_message_id=request.client_message_id, metadata=dict(request.metadata), sources=sources,
        recipients=_recipients(request.recipient_member_ids), silent=request.silent, attachment_ids=attachment_ids),
        ctx.proof)


async def thread_reply(server: Server, connection: Connection, request: f.ThreadReply,
                       ctx: RequestContext) -> f.MessageInfo:
    workspace, parent = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    recipients = _recipients(request.recipient_member_ids)  # before the thread exists: bad input opens nothing
    root = await server.db.run(messages.message_for_viewer, workspace.workspace_id, workspace.member_id,
                               _check_id(request.root_message_id, "msg", "message"))
    if root is None or root["scope_id"] != parent["id"]:
        raise _not_found("message")
    if parent["type"] == "thread":
        raise ProtocolError(ErrorCode.INVALID, "threads do not nest")
    if parent["type"] == "service_account":
        raise ProtocolError(ErrorCode.FORBIDDEN, "a service account's timeline is read-only",
                            details={"reason": "read_only_scope"})
    if parent["type"] == "task":
        # A strand's discussion is one timeline whose readers are the board channel's:
        # reply with reply_to_message_id (a thread would need a roster of its own).
        raise ProtocolError(ErrorCode.FORBIDDEN, "a task's discussion has no threads: reply in it",
                            details={"reason": "task_discussion_is_flat"})
    thread_id = root["thread_scope_id"]
    if thread_id is None:
        thread_id = await _open_thread(server, workspace, parent["id"], root)
    else:
        await _ensure_thread_member(server, workspace, thread_id)
    return await _send(server, workspace, thread_id, MessageIntent(
        scope_id=thread_id, content=request.content, client_message_id=request.client_message_id,
        recipients=recipients))


async def _open_thread(server: Server, workspace: WorkspaceContext, parent_id: str, root: asyncpg.Record) -> str:
    """The thread scope of a root message (scope-model §5.2).  Its first members:
    the replier, the root's author, and the private agents the root addressed
    (its live mentions and explicit recipients were authorized when it was
    sent) — each only while it holds an open membership of the parent, with the
    same visibility and owner as there.  Public members the root mentioned join
    by replying, as before."""
    parent_roster = await server.db.run(visibility.roster_entries, parent_id)
    metadata = _metadata_of(root)
    addressed = [member_id for member_id in (*metadata.get("mentions", ()), *metadata.get("recipients", ()))
                 if member_id in parent_roster and parent_roster[member_id].kind == "agent"
                 and parent_roster[member_id].visibility == "private"]
    replier = parent_roster.get(workspace.member_id)
    if replier is not None and replier.visibility == "private" and replier.member_id not in (
            root["author_member_id"], *addressed):
        raise _private_agent_not_admitted()
    members = [_same_as_parent(replier) if replier else MembershipMutation(workspace.member_id, "open")]
    members += [_same_as_parent(parent_roster[member_id])
                for member_id in dict.fromkeys((root["author_member_id"], *addressed))
                if member_id != workspace.member_id and member_id in parent_roster]
    new_thread_id = new_id("scp")
    thread_id = await _submit(server, new_thread_id, cmd.CreateScope(
        _actor(workspace), "thread", tuple(members), parent_scope_id=parent_id, root_message_id=root["id"]))
    if thread_id != new_thread_id:  # another reply opened it first
        await _ensure_thread_member(server, workspace, thread_id)
    return thread_id


def _same_as_parent(entry: RosterEntry) -> MembershipMutation:
    return MembershipMutation(entry.member_id, "open", entry.visibility, entry.owner_member_id)


def _private_agent_not_admitted() -> ProtocolError:
    return ProtocolError(ErrorCode.FORBIDDEN, "a private agent enters a thread only when the thread's root or a "
                         "message in it addresses it", details={"reason": "private_agent_not_admitted"})


async def _ensure_thread_member(server: Server, workspace: WorkspaceContext, thread_id: str) -> None:
    """Anyone who can read the parent may reply: replying joins the thread —
    except a private agent, which only the thread's messages admit (§5.2)."""
    membership = await server.db.run(visibility.viewer_membership, thread_id, workspace.member_id)
    if membership is None:
        if workspace.member_kind == "agent":
            candidate = await server.db.run(messages.member_candidate, workspace.workspace_id, workspace.member_id)
            if candidate.visibility == "private":
                raise _private_agent_not_admitted()
        try:
            await _submit(server, thread_id, cmd.ChangeMembers(_actor(workspace), "join_thread",
                                                                (workspace.member_id,)))
        except ProtocolError as exc:
            if exc.details.get("reason") != "already_member":
                raise


async def message_forward(server: Server, connection: Connection, request: f.MessageForward,
                          ctx: RequestContext) -> f.MessageInfo:
    workspace, target = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_WRITE)
    sources = []
    for message_id in dict.fromkeys(request.source_message_ids):
        source = await server.db.run(messages.message_for_viewer, workspace.workspace_id, workspace.member_id,
                                     _check_id(message_id, "msg", "message"))
        if source is None or source["state"] != "visible":
            raise _not_found("message")
        sources.append(source)
    if request.mode == "owner_quote":
        return await _owner_quote(server, workspace, target, sources, request)
    single = len(sources) == 1
    # A single forward re-sends the text (its mentions are live, §5.3); several
    # are context only.
    content = sources[0]["content"] if single and not request.comment else request.comment
    return await _send(server, workspace, target["id"], MessageIntent(
        scope_id=target["id"], content=content, client_message_id=request.client_message_id,
        message_type="forward", metadata={"forwarded_message_ids": [s["id"] for s in sources]},
        sources=tuple(SourceRef("forward" if single else "multi_forward", s["id"], s["scope_id"], s["seq"])
                      for s in sources),
        mention_mode=MentionMode.SINGLE_FORWARD if single else MentionMode.MULTI_FORWARD))


async def _owner_quote(server: Server, workspace: WorkspaceContext, target: asyncpg.Record, sources: list,
                       request: f.MessageForward) -> f.MessageInfo:
    """A human shares messages they can read into a scope they write, as
    explicit context for their private agents there (collaborator-policy §4.3,
    §8.7): the comment is the text, each quoted message is frozen with its
    source and author, the quoted mentions stay inert, and nobody becomes a
    collaborator."""
    if workspace.member_kind != "human":
        raise ProtocolError(ErrorCode.FORBIDDEN, "only a human member shares an owner_quote",
                            details={"reason": "owner_quote_needs_human"})
    quote = [_frozen_quote(s) for s in sources]
    return await _send(server, workspace, target["id"], MessageIntent(
        scope_id=target["id"], content=request.comment, client_message_id=request.client_message_id,
        message_type="owner_quote", metadata={"quote": quote, "shared_by_member_id": workspace.member_id},
        sources=tuple(SourceRef("owner_quote", s["id"], s["scope_id"], s["seq"]) for s in sources),
        mention_mode=MentionMode.EXPLICIT_CONTEXT))


# A frozen quote keeps at most this much of each source's text (20 sources stay
# within one message's 40,000 characters); the source ref leads back to the rest.
QUOTE_FROZEN_CHARS = 2000


def _frozen_quote(source: asyncpg.Record) -> dict[str, Any]:
    content = source["content"]
    quote = {"source_message_id": source["id"], "source_scope_id": source["scope_id"], "source_seq": source["seq"],
             "author_member_id": source["author_member_id"], "content": content[:QUOTE_FROZEN_CHARS],
             "created_at_ms": _ms(source["created_at"])}
    if len(content) > QUOTE_FROZEN_CHARS:
        quote["truncated"] = True
    return quote


async def message_edit(server: Server, connection: Connection, request: f.MessageEdit,
                       ctx: RequestContext) -> f.MessageInfo:
    workspace, located = await _message_scope(server, ctx, request.message_id, Permission.MESSAGE_WRITE)
    row = await _submit(server, located["scope_id"], cmd.Edit(_actor(workspace), request.message_id, request.content,
                                                              request.expected_revision))
    return message_info(row)


async def message_withdraw(server: Server, connection: Connection, request: f.MessageWithdraw,
                           ctx: RequestContext) -> f.MessageInfo:
    workspace, located = await _message_scope(server, ctx, request.message_id, Permission.MESSAGE_WRITE)
    row = await _submit(server, located["scope_id"], cmd.Withdraw(_actor(workspace), request.message_id))
    info = message_info(row)
    info.content, info.metadata = "", {}
    return info


# --- reactions ---------------------------------------------------------------------------------------

async def _react(server: Server, ctx: RequestContext, message_id: str, key: str, add: bool) -> f.Ok:
    try:
        canonical = normalize_reaction_key(key)
    except InvalidReactionKey as exc:
        raise ProtocolError(ErrorCode.INVALID, f"invalid reaction key: {exc}") from None
    workspace, located = await _message_scope(server, ctx, message_id, Permission.MESSAGE_WRITE)
    if not server.reaction_limiter.take(workspace.member_id):
        raise ProtocolError(ErrorCode.RATE_LIMITED, "too many reactions; slow down")
    await _submit(server, located["scope_id"], cmd.React(_actor(workspace), message_id, canonical, add))
    return f.Ok()


async def reaction_add(server: Server, connection: Connection, request: f.ReactionAdd, ctx: RequestContext) -> f.Ok:
    return await _react(server, ctx, request.message_id, request.key, True)


async def reaction_remove(server: Server, connection: Connection, request: f.ReactionRemove,
                          ctx: RequestContext) -> f.Ok:
    return await _react(server, ctx, request.message_id, request.key, False)


# --- reads ----------------------------------------------------------------------------------------------

async def message_history(server: Server, connection: Connection, request: f.MessageHistory,
                          ctx: RequestContext) -> f.HistoryPage:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    if sum(x is not None for x in (request.before_seq, request.after_seq)) + request.from_first_unread > 1:
        raise ProtocolError(ErrorCode.INVALID, "give at most one of before_seq, after_seq, from_first_unread")
    membership = await server.db.run(visibility.viewer_membership, row["id"], workspace.member_id)
    after = request.after_seq
    if request.from_first_unread:
        after = membership["last_read_seq"] if membership else 0
    rows, has_more = await server.db.run(messages.history, workspace.workspace_id, workspace.member_id, row["id"],
                                         before_seq=request.before_seq, after_seq=after, limit=request.limit)
    reactions = await server.db.run(messages.reaction_summaries, workspace.workspace_id, workspace.member_id,
                                    [r["id"] for r in rows])
    root = None
    if row["type"] == "thread" and row["root_message_id"]:
        # The root is context, still subject to the readable predicate.
        root_row = await server.db.run(messages.message_for_viewer, workspace.workspace_id, workspace.member_id,
                                       row["root_message_id"])
        root = message_info(root_row) if root_row is not None else None
    accounts = (await server.db.run(service_accounts.accounts_by_scope, [row["id"]])
                if row["type"] == "service_account" else {})
    return f.HistoryPage(messages=[with_profile(message_info(r, reactions.get(r["id"])), accounts) for r in rows],
                         has_more=has_more, last_read_seq=membership["last_read_seq"] if membership else None,
                         root=root)


async def message_get(server: Server, connection: Connection, request: f.MessageGet,
                      ctx: RequestContext) -> f.MessageDetail:
    workspace = ctx.require(Permission.MESSAGE_READ)
    _check_id(request.message_id, "msg", "message")
    row = await server.db.run(messages.message_for_viewer, workspace.workspace_id, workspace.member_id,
                              request.message_id)
    if row is None:
        raise _not_found("message")
    reactions = await server.db.run(messages.reaction_summaries, workspace.workspace_id, workspace.member_id,
                                    [row["id"]])
    revisions = []
    if request.include_revisions:
        revisions = [f.RevisionInfo(r["revision"], r["content"], r["edited_by_member_id"], _ms(r["created_at"]))
                     for r in await server.db.run(messages.message_revisions, workspace.workspace_id,
                                                  workspace.member_id, row["id"])]
    accounts = await server.db.run(service_accounts.accounts_by_scope, [row["scope_id"]])
    return f.MessageDetail(message=with_profile(message_info(row, reactions.get(row["id"])), accounts),
                           revisions=revisions)


# --- read state, notifications, inbox ------------------------------------------------------------------------

async def read_mark(server: Server, connection: Connection, request: f.ReadMark,
                    ctx: RequestContext) -> results.ReadStateResult:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    outcome = await _submit(server, row["id"], cmd.MarkRead(_actor(workspace), request.seq))
    return results.ReadStateResult(last_read_seq=outcome["last_read_seq"])


async def read_mark_unread(server: Server, connection: Connection, request: f.ReadMarkUnread,
                           ctx: RequestContext) -> results.ReadStateResult:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    outcome = await _submit(server, row["id"], cmd.MarkRead(_actor(workspace), request.from_seq, unread=True))
    return results.ReadStateResult(last_read_seq=outcome["last_read_seq"])


async def notification_set(server: Server, connection: Connection, request: f.NotificationSet,
                           ctx: RequestContext) -> results.NotificationStateResult:
    workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    target = request.member_id
    if target is not None and target != workspace.member_id:
        _check_id(target, "mem", "member")
        # Only an agent's owner sets its state; anyone else learns nothing about the member.
        try:
            member = await server.db.run(messages.member_candidate, workspace.workspace_id, target)
        except NotFound:
            member = None
        if member is None or member.kind != "agent" or member.owner_member_id != workspace.member_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "no such agent of yours")
    outcome = await _submit(server, row["id"], cmd.SetNotification(_actor(workspace), request.state, target))
    return results.NotificationStateResult(state=outcome["state"])


async def inbox_list(server: Server, connection: Connection, request: f.InboxList, ctx: RequestContext) -> f.InboxPage:
    workspace = ctx.require(Permission.MESSAGE_READ)
    after = None
    if request.cursor is not None:
        after = messages.decode_cursor(request.cursor)
        if after is None:
            raise ProtocolError(ErrorCode.INVALID, "malformed cursor")
    rows, next_cursor = await server.db.run(messages.inbox, workspace.workspace_id, workspace.member_id,
                                            after=after, limit=request.limit)
    accounts = await server.db.run(service_accounts.accounts_by_scope,
                                   [r["scope_id"] for r in rows if r["type"] == "service_account"])
    conversations = []
    for r in rows:
        account = accounts.get(r["scope_id"])
        profile = author_profile(account) if account is not None else None
        conversations.append(f.ConversationInfo(
            scope_id=r["scope_id"], type=r["type"], latest_seq=r["latest_seq"], last_read_seq=r["last_read_seq"],
            unread_count=r["unread_count"], pinned=bool(r["pinned"]), manual_unread=r["manual_unread"],
            notification_state=r["notification_state"], activity_at_ms=int(r["activity_epoch"] * 1000),
            display_name=profile.display_name if profile else r["display_name"],
            parent_scope_id=r["parent_scope_id"], last_message_id=r["last_message_id"],
            last_author_member_id=r["last_author_member_id"], last_preview=r["last_preview"],
            conversation_id=profile.conversation_id if profile else r["scope_id"],
            kind="serviceAccount" if profile else r["type"], service_account=profile))
    return f.InboxPage(conversations=conversations, next_cursor=next_cursor)


def scope_of_conversation(conversation_id: str) -> str:
    """The scope a conversation id names: `serviceAccount:{scope_id}` or a bare scope id."""
    scope_id = conversation_id.removeprefix(CONVERSATION_PREFIX)
    _check_id(scope_id, "scp", "conversation")
    return scope_id


async def conversation_scope(server: Server, ctx: RequestContext,
                             conversation_id: str) -> tuple[WorkspaceContext, asyncpg.Record]:
    """The readable scope of a conversation id; `serviceAccount:` names only a service account's."""
    workspace, row = await _scope(server, ctx, scope_of_conversation(conversation_id), Permission.MESSAGE_READ)
    if conversation_id.startswith(CONVERSATION_PREFIX) and row["type"] != "service_account":
        raise _not_found("conversation")
    return workspace, row


async def conversation_action(server: Server, connection: Connection, request: f.ConversationAction,
                              ctx: RequestContext) -> f.Ok:
    if (request.scope_id is None) == (request.conversation_id is None):
        raise ProtocolError(ErrorCode.INVALID, "give scope_id or conversation_id", details={"field": "scope_id"})
    if request.scope_id is not None:
        workspace, row = await _scope(server, ctx, request.scope_id, Permission.MESSAGE_READ)
    else:
        workspace, row = await conversation_scope(server, ctx, request.conversation_id)
    actor = _actor(workspace)
    action = request.action
    if action in ("mute", "unmute"):
        await _submit(server, row["id"], cmd.SetNotification(actor, "mute" if action == "mute" else "active"))
    elif action == "mark_read":
        await _submit(server, row["id"], cmd.MarkRead(actor, row["latest_seq"]))
    elif action == "mark_unread":
        await _submit(server, row["id"], cmd.MarkRead(actor, None, unread=True))
    else:
        flags = {"pin": {"pinned": True}, "unpin": {"pinned": False}, "hide": {"hidden": True},
                 "restore": {"hidden": False}}[action]
        await server.db.transaction(_set_conversation_state_unit, workspace, row["id"], flags)
        # The member's own other connections see the Inbox change (nobody else does).
        server.hub.publish(CommittedEvent("inbox.changed", workspace.workspace_id, row["id"], None, None,
                                          {"member_id": workspace.member_id, **flags},
                                          audience=frozenset({workspace.member_id})))
    return f.Ok()


async def _set_conversation_state_unit(conn: asyncpg.Connection, workspace: WorkspaceContext, scope_id: str,
                                       flags: dict[str, bool]) -> None:
    await tenancy.pass_write_fence(conn, workspace.workspace_id, workspace.execution_generation)
    await applier.set_conversation_state(conn, workspace.workspace_id, workspace.member_id, scope_id, **flags)


HANDLERS = {
    f.ChannelCreate: channel_create, f.ChannelList: channel_list, f.DmOpen: dm_open, f.ScopeGet: scope_get,
    f.ScopeMembers: scope_members, f.ScopeJoin: scope_join, f.ScopeLeave: scope_leave,
    f.ScopeInvite: scope_invite, f.ScopeRemove: scope_remove, f.ScopeArchive: scope_archive,
    f.MessageSend: message_send, f.ThreadReply: thread_reply, f.MessageForward: message_forward,
    f.MessageEdit: message_edit, f.MessageWithdraw: message_withdraw, f.MessageHistory: message_history,
    f.MessageGet: message_get, f.ReactionAdd: reaction_add, f.ReactionRemove: reaction_remove,
    f.ReadMark: read_mark, f.ReadMarkUnread: read_mark_unread, f.NotificationSet: notification_set,
    f.InboxList: inbox_list, f.ConversationAction: conversation_action,
}
