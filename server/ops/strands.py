"""Handlers of boards and strands (protocol/strands.py).

A strand is a task scope: its writes run in the task scope's actor
(actors/strands.py), which re-reads the board channel's readers first.  Reads
go through the task authority (storage/visibility/tasks.py).  Anything the
caller cannot read answers `not_found`, the same whatever the cause
(collaborator-policy §4.2.1; SPEC §5 decision 1)."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import asyncpg
import msgspec

from actors import scope_actor as cmd
from actors import strands as strand_cmd
from actors.fanout import CommittedEvent
from domain import strands as rules
from protocol import strands as s
from protocol.errors import ErrorCode, ProtocolError
from server.context import RequestContext, WorkspaceContext
from server.messaging import _actor, _check_id, _ms, _not_found, _submit
from server.rbac import Permission, Role
from storage import messages
from storage import strands as store
from storage import tenancy
from storage.errors import Conflict
from storage.ids import new_id

if TYPE_CHECKING:
    from server.app import Connection, Server


def _governor(workspace: WorkspaceContext) -> bool:
    return workspace.role in (Role.OWNER, Role.ADMIN)


def _rule_error(exc: rules.StrandRuleError) -> ProtocolError:
    details: dict[str, Any] = {"reason": exc.reason}
    if exc.field:
        details["field"] = exc.field
    return ProtocolError(ErrorCode(exc.code), exc.message, details=details)


def _board_info(row: Any) -> s.BoardInfo:
    return s.BoardInfo(id=row["id"], channel_id=row["channel_id"], name=row["name"], status=row["status"],
                       created_by_member_id=row["created_by_member_id"], created_at_ms=_ms(row["created_at"]))


def _strand_info(view: dict[str, Any], **extra: Any) -> s.StrandInfo:
    return msgspec.convert({**view, **extra}, s.StrandInfo)


async def _fenced(server: Server, workspace: WorkspaceContext, unit, *args) -> Any:
    async def run(conn: asyncpg.Connection) -> Any:
        await tenancy.pass_write_fence(conn, workspace.workspace_id, workspace.execution_generation)
        return await unit(conn, *args)
    return await server.db.transaction(run)


async def _readable_strand(server: Server, workspace: WorkspaceContext, strand_id: str) -> asyncpg.Record:
    _check_id(strand_id, "scp", "strand")
    row = await server.db.run(store.strand_for_reader, workspace.workspace_id, strand_id, workspace.member_id)
    if row is None:
        raise _not_found("strand")
    return row


async def _view(server: Server, workspace: WorkspaceContext, row: asyncpg.Record,
                revisions: bool = False) -> s.StrandInfo:
    assignments = await server.db.run(store.assignments, [row["scope_id"]])
    watches = await server.db.run(store.my_watches, [row["scope_id"]], workspace.member_id)
    extra: dict[str, Any] = {}
    if revisions:
        extra["synthesis_revisions"] = [
            {"revision": r["revision"], "content": r["content"], "edited_by_member_id": r["edited_by_member_id"],
             "created_at_ms": _ms(r["created_at"])}
            for r in await server.db.run(store.synthesis_revisions, row["scope_id"], 50)]
    return _strand_info(rules.strand_view(row, assignments.get(row["scope_id"], []), watches.get(row["scope_id"])),
                        **extra)


async def _run(server: Server, workspace: WorkspaceContext, strand_id: str, command: cmd.Command) -> dict[str, Any]:
    """A strand command in its task scope's actor; a strand the caller cannot read is not found."""
    await _readable_strand(server, workspace, strand_id)
    try:
        return await _submit(server, strand_id, command)
    except ProtocolError as exc:
        if exc.code is ErrorCode.NOT_FOUND:
            raise _not_found("strand") from None
        raise


async def _after_write(server: Server, workspace: WorkspaceContext, strand_id: str,
                       outcome: dict[str, Any]) -> s.StrandInfo:
    watches = await server.db.run(store.my_watches, [strand_id], workspace.member_id)
    mine = watches.get(strand_id)
    view = dict(outcome["strand"])
    if mine is not None and mine["level"] is not None:
        view["my_watch"] = rules.WatchValue(mine["level"], mine["level_public"]).as_json()
    return _strand_info(view)


# --- boards ----------------------------------------------------------------------------------------------

async def board_create(server: Server, connection: Connection, request: s.BoardCreate,
                       ctx: RequestContext) -> s.BoardInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    _check_id(request.channel_id, "scp", "channel")
    name = request.name.strip()
    if not name:
        raise ProtocolError(ErrorCode.INVALID, "the name is empty", details={"reason": "empty_name"})
    row = await _fenced(server, workspace, store.create_board, workspace.workspace_id, request.channel_id, name,
                        workspace.member_id)
    return _board_info(row)


async def board_list(server: Server, connection: Connection, request: s.BoardList, ctx: RequestContext) -> s.BoardPage:
    workspace = ctx.require(Permission.MESSAGE_READ)
    if request.channel_id is not None:
        _check_id(request.channel_id, "scp", "channel")
    rows = await server.db.run(store.list_boards, workspace.workspace_id, workspace.member_id, request.channel_id)
    return s.BoardPage([_board_info(r) for r in rows])


async def _board_status(server: Server, request: s.BoardArchive | s.BoardRestore, ctx: RequestContext,
                        status: str) -> s.BoardInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    _check_id(request.board_id, "tbd", "board")
    board = await server.db.run(store.board_for_member, workspace.workspace_id, request.board_id,
                                workspace.member_id)
    if board is None:
        raise _not_found("board")
    owner = await server.db.run(messages.channel_owner, board["channel_id"])
    if owner != workspace.member_id and Permission.RESOURCE_MANAGE not in workspace.permissions:
        raise ProtocolError(ErrorCode.FORBIDDEN, "only the channel's owner or resource.manage",
                            details={"reason": "not_board_manager"})
    row = await _fenced(server, workspace, store.set_board_status, workspace.workspace_id, request.board_id, status)
    # The board's tasks re-read their authority at their next command (the channel's roster generation moved).
    return _board_info(row)


async def board_archive(server: Server, connection: Connection, request: s.BoardArchive,
                        ctx: RequestContext) -> s.BoardInfo:
    return await _board_status(server, request, ctx, "archived")


async def board_restore(server: Server, connection: Connection, request: s.BoardRestore,
                        ctx: RequestContext) -> s.BoardInfo:
    return await _board_status(server, request, ctx, "active")


# --- strands ------------------------------------------------------------------------------------------

async def strand_create(server: Server, connection: Connection, request: s.StrandCreate,
                        ctx: RequestContext) -> s.StrandInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    _check_id(request.board_id, "tbd", "board")
    title = request.title.strip()
    if not title:
        raise ProtocolError(ErrorCode.INVALID, "the title is empty", details={"reason": "empty_title"})
    try:
        tracks = rules.tracks_from_json(request.tracks)
        fields = rules.check_fields(request.fields)
    except rules.StrandRuleError as exc:
        raise _rule_error(exc) from None
    if request.client_strand_id is not None:
        existing = await server.db.run(store.strand_by_client_id, workspace.workspace_id, workspace.member_id,
                                       request.client_strand_id)
        if existing is not None:
            return await _replay(server, workspace, existing, request, title, tracks, fields)
    board = await server.db.run(store.board_for_member, workspace.workspace_id, request.board_id,
                                workspace.member_id)
    if board is None:
        raise _not_found("board")
    if board["status"] != "active" or board["channel_status"] != "active":
        raise ProtocolError(ErrorCode.CONFLICT, "the board is archived", details={"reason": "scope_archived"})
    strand_id = new_id("scp")
    try:
        await _submit(server, strand_id, cmd.CreateScope(
            _actor(workspace), "task", (), parent_scope_id=board["channel_id"],
            strand={"board_id": board["id"], "title": title, "summary": request.summary, "fields": fields,
                    "content": request.content, "tracks": tracks,
                    "accept_third_party_mention": request.accept_third_party_mention,
                    "client_strand_id": request.client_strand_id}))
    except Conflict as exc:
        if exc.reason == "client_strand_id_taken":
            # A concurrent retry with the same client id won the insert: answer with its strand.
            existing = await server.db.run(store.strand_by_client_id, workspace.workspace_id, workspace.member_id,
                                           request.client_strand_id)
            if existing is not None:
                return await _replay(server, workspace, existing, request, title, tracks, fields)
        raise
    row = await _readable_strand(server, workspace, strand_id)
    info = await _view(server, workspace, row)
    server.hub.publish(CommittedEvent("strand.changed", workspace.workspace_id, strand_id, None, None,
                                      {"change": "created", "strand": msgspec.to_builtins(info),
                                       "actor_member_id": workspace.member_id},
                                      audience=await server.db.run(store.readers, strand_id)))
    return info


async def _replay(server: Server, workspace: WorkspaceContext, existing: asyncpg.Record, request: s.StrandCreate,
                  title: str, tracks: rules.Tracks, fields: dict) -> s.StrandInfo:
    same = (existing["board_id"] == request.board_id and existing["title"] == title
            and existing["summary"] == request.summary and existing["content"] == request.content
            and store.json_value(existing["fields"]) == fields
            and store.json_value(existing["tracks"]) == rules.tracks_json(tracks))
    if not same:
        raise ProtocolError(ErrorCode.IDEMPOTENCY_CONFLICT, "same client_strand_id, different strand")
    row = await _readable_strand(server, workspace, existing["scope_id"])
    info = await _view(server, workspace, row)
    info.replayed = True
    return info


async def strand_get(server: Server, connection: Connection, request: s.StrandGet, ctx: RequestContext) -> s.StrandInfo:
    workspace = ctx.require(Permission.MESSAGE_READ)
    row = await _readable_strand(server, workspace, request.strand_id)
    return await _view(server, workspace, row, request.include_synthesis_revisions)


def _encode_cursor(values: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(values, separators=(",", ":")).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if isinstance(values, list) and len(values) == 2 and isinstance(values[1], str) and values[1].isprintable():
            at = datetime.fromisoformat(values[0])
            if at.tzinfo is not None:
                return at.astimezone(timezone.utc), values[1]
    except (ValueError, TypeError, OverflowError):
        pass
    raise ProtocolError(ErrorCode.INVALID, "malformed cursor", details={"reason": "bad_cursor"})


async def strand_list(server: Server, connection: Connection, request: s.StrandList,
                      ctx: RequestContext) -> s.StrandPage:
    workspace = ctx.require(Permission.MESSAGE_READ)
    _check_id(request.board_id, "tbd", "board")
    after = _decode_cursor(request.cursor) if request.cursor is not None else None
    if await server.db.run(store.board_for_member, workspace.workspace_id, request.board_id,
                           workspace.member_id) is None:
        raise _not_found("board")
    rows = await server.db.run(store.list_strands, workspace.workspace_id, workspace.member_id, request.board_id,
                               request.state, after, request.limit + 1)
    page = rows[:request.limit]
    ids = [r["scope_id"] for r in page]
    assignments = await server.db.run(store.assignments, ids)
    watches = await server.db.run(store.my_watches, ids, workspace.member_id)
    strands = [_strand_info(rules.strand_view(r, assignments.get(r["scope_id"], []), watches.get(r["scope_id"])))
               for r in page]
    cursor = (_encode_cursor([page[-1]["updated_at"].isoformat(), page[-1]["scope_id"]])
              if len(rows) > request.limit else None)
    return s.StrandPage(strands=strands, next_cursor=cursor)


async def strand_update(server: Server, connection: Connection, request: s.StrandUpdate,
                        ctx: RequestContext) -> s.StrandInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    changes: dict[str, Any] = {}
    if request.title is not None:
        title = request.title.strip()
        if not title:
            raise ProtocolError(ErrorCode.INVALID, "the title is empty", details={"reason": "empty_title"})
        changes["title"] = title
    for name in ("summary", "content", "fields", "synthesis_content", "accept_third_party_mention"):
        if getattr(request, name) is not None:
            changes[name] = getattr(request, name)
    if not changes:
        raise ProtocolError(ErrorCode.INVALID, "nothing to change", details={"reason": "empty_update"})
    outcome = await _run(server, workspace, request.strand_id, strand_cmd.UpdateStrand(
        _actor(workspace), request.expected_version, changes))
    return await _after_write(server, workspace, request.strand_id, outcome)


async def strand_tracks_update(server: Server, connection: Connection, request: s.StrandTracksUpdate,
                               ctx: RequestContext) -> s.StrandInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    outcome = await _run(server, workspace, request.strand_id, strand_cmd.UpdateTracks(_actor(workspace),
                                                                                         request.patch))
    return await _after_write(server, workspace, request.strand_id, outcome)


async def strand_stage_set(server: Server, connection: Connection, request: s.StrandStageSet,
                           ctx: RequestContext) -> s.StrandInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    given = request.expected_stage is not msgspec.UNSET
    outcome = await _run(server, workspace, request.strand_id, strand_cmd.SetStage(
        _actor(workspace), request.stage, given, request.expected_stage if given else None))
    return await _after_write(server, workspace, request.strand_id, outcome)


async def _lifecycle(server: Server, request: s.StrandArchive | s.StrandRestore, ctx: RequestContext,
                     state: str) -> s.StrandInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    row = await _readable_strand(server, workspace, request.strand_id)
    owner = await server.db.run(messages.channel_owner, row["channel_id"])
    if workspace.member_id not in (row["created_by_member_id"], owner) and \
            Permission.RESOURCE_MANAGE not in workspace.permissions:
        raise ProtocolError(ErrorCode.FORBIDDEN, "only the strand's creator, the channel's owner or resource.manage",
                            details={"reason": "not_strand_manager"})
    outcome = await _run(server, workspace, request.strand_id, strand_cmd.SetLifecycle(_actor(workspace), state))
    return await _after_write(server, workspace, request.strand_id, outcome)


async def strand_archive(server: Server, connection: Connection, request: s.StrandArchive,
                         ctx: RequestContext) -> s.StrandInfo:
    return await _lifecycle(server, request, ctx, "archived")


async def strand_restore(server: Server, connection: Connection, request: s.StrandRestore,
                         ctx: RequestContext) -> s.StrandInfo:
    return await _lifecycle(server, request, ctx, "active")


async def strand_default_set(server: Server, connection: Connection, request: s.StrandDefaultSet,
                             ctx: RequestContext) -> s.StrandDefault:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    if not _governor(workspace):
        raise ProtocolError(ErrorCode.FORBIDDEN, "only owners and admins set the default strand",
                            details={"reason": "not_governor"})
    if request.strand_id is not None:
        await _readable_strand(server, workspace, request.strand_id)
    given = request.expected_default_strand_id is not msgspec.UNSET
    await _fenced(server, workspace, store.set_default_strand, workspace.workspace_id, request.strand_id, given,
                  request.expected_default_strand_id if given else None, workspace.member_id)
    return s.StrandDefault(default_strand_id=request.strand_id)


async def strand_default_get(server: Server, connection: Connection, request: s.StrandDefaultGet,
                             ctx: RequestContext) -> s.StrandDefault:
    workspace = ctx.require(Permission.MESSAGE_READ)
    row = await server.db.run(store.default_strand, workspace.workspace_id)
    strand_id = row["default_strand_id"] if row is not None else None
    if strand_id is not None and await server.db.run(store.strand_for_reader, workspace.workspace_id, strand_id,
                                                      workspace.member_id) is None:
        strand_id = None  # a pointer you cannot follow is not revealed
    return s.StrandDefault(default_strand_id=strand_id)


# --- assignment -----------------------------------------------------------------------------------------

async def strand_assign(server: Server, connection: Connection, request: s.StrandAssign,
                        ctx: RequestContext) -> s.AssignmentResult:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    _check_id(request.member_id, "mem", "member")
    outcome = await _run(server, workspace, request.strand_id, strand_cmd.Assign(_actor(workspace),
                                                                                  request.member_id))
    return s.AssignmentResult(assignment_id=outcome["assignment_id"], member_id=request.member_id,
                              strand=await _after_write(server, workspace, request.strand_id, outcome))


async def strand_unassign(server: Server, connection: Connection, request: s.StrandUnassign,
                          ctx: RequestContext) -> s.StrandInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    _check_id(request.assignment_id, "asg", "assignment")
    outcome = await _run(server, workspace, request.strand_id, strand_cmd.Unassign(_actor(workspace),
                                                                                    request.assignment_id))
    return await _after_write(server, workspace, request.strand_id, outcome)


# --- watch ------------------------------------------------------------------------------------------------

async def strand_watch_set(server: Server, connection: Connection, request: s.StrandWatchSet,
                           ctx: RequestContext) -> s.WatchState:
    # Your own notification preference: a read-state write (viewers may watch too).
    workspace = ctx.require(Permission.MESSAGE_READ)
    watcher = request.watcher_member_id or workspace.member_id
    _check_id(watcher, "mem", "member")
    given = request.expected_value is not msgspec.UNSET
    try:
        value = rules.watch_value(request.level, request.level_public)
        expected = rules.expected_watch(request.expected_value) if given else None
    except rules.StrandRuleError as exc:
        raise _rule_error(exc) from None
    outcome = await _run(server, workspace, request.strand_id, strand_cmd.SetWatch(
        _actor(workspace), watcher, value, given, expected, _governor(workspace)))
    return s.WatchState(status="current", revision=outcome["revision"], value=outcome["value"])


async def strand_watch_get(server: Server, connection: Connection, request: s.StrandWatchGet,
                           ctx: RequestContext) -> s.WatchState:
    workspace = ctx.require(Permission.MESSAGE_READ)
    await _readable_strand(server, workspace, request.strand_id)
    row = await server.db.run(store.watch_row, request.strand_id, workspace.member_id)
    if row is None:
        return s.WatchState(status="never_written")
    return s.WatchState(status="current", revision=row["revision"],
                        value=rules.WatchValue(row["level"], row["level_public"]).as_json())


async def strand_watchers(server: Server, connection: Connection, request: s.StrandWatchers,
                          ctx: RequestContext) -> s.WatcherList:
    workspace = ctx.require(Permission.MESSAGE_READ)
    await _readable_strand(server, workspace, request.strand_id)
    if request.audit:
        if not _governor(workspace):
            raise ProtocolError(ErrorCode.FORBIDDEN, "the full watch list is for owners and admins",
                                details={"reason": "audit_capability_incomplete"})
        rows = await _fenced(server, workspace, store.audited_watches, workspace.workspace_id, request.strand_id,
                             workspace.member_id)
        return s.WatcherList([s.WatcherInfo(r["watcher_member_id"], r["level"], r["level_public"])
                              for r in rows if r["level"] is not None])
    rows = await server.db.run(store.watches_of, request.strand_id)
    return s.WatcherList([s.WatcherInfo(r["watcher_member_id"], r["level"], r["level_public"])
                          for r in rows if rules.projected(r["level"], r["level_public"], r["kind"],
                                                           r["watcher_member_id"] == workspace.member_id)])


# --- audience mentions and agent participation ---------------------------------------------------------------

def _governing(ctx: RequestContext) -> WorkspaceContext:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    if not _governor(workspace):
        raise ProtocolError(ErrorCode.FORBIDDEN, "owners and admins only", details={"reason": "not_governor"})
    return workspace


async def _policy_list(server: Server, workspace_id: str) -> s.AudiencePolicyList:
    policies = await server.db.run(store.audience_policies, workspace_id)
    return s.AudiencePolicyList([s.AudiencePolicyInfo(a, n) for a, n in sorted(policies.items())])


async def audience_policy_set(server: Server, connection: Connection, request: s.AudienceMentionPolicySet,
                              ctx: RequestContext) -> s.AudiencePolicyList:
    workspace = _governing(ctx)
    await _fenced(server, workspace, store.set_audience_policy, workspace.workspace_id, request.audience,
                  request.max_recipients, workspace.member_id)
    return await _policy_list(server, workspace.workspace_id)


async def audience_policy_disable(server: Server, connection: Connection, request: s.AudienceMentionPolicyDisable,
                                  ctx: RequestContext) -> s.AudiencePolicyList:
    workspace = _governing(ctx)
    await _fenced(server, workspace, store.set_audience_policy, workspace.workspace_id, request.audience, None,
                  workspace.member_id)
    return await _policy_list(server, workspace.workspace_id)


async def audience_policy_list(server: Server, connection: Connection, request: s.AudienceMentionPolicyList,
                               ctx: RequestContext) -> s.AudiencePolicyList:
    workspace = ctx.require(Permission.MESSAGE_READ)
    return await _policy_list(server, workspace.workspace_id)


def _grant_info(row: Any, now: datetime) -> s.AudienceGrantInfo:
    return s.AudienceGrantInfo(
        id=row["id"], member_id=row["member_id"], channel_id=row["channel_id"], max_operations=row["max_operations"],
        period_seconds=row["period_seconds"], granted_by_member_id=row["granted_by_member_id"],
        created_at_ms=_ms(row["created_at"]), expires_at_ms=_ms(row["expires_at"]),
        active=row["revoked_at"] is None and row["expires_at"] > now, uses=row.get("uses") or 0,
        revoked_at_ms=_ms(row["revoked_at"]) if row["revoked_at"] is not None else None)


async def audience_grant_create(server: Server, connection: Connection, request: s.AudienceMentionGrantCreate,
                                ctx: RequestContext) -> s.AudienceGrantInfo:
    workspace = _governing(ctx)
    _check_id(request.member_id, "mem", "member")
    _check_id(request.channel_id, "scp", "channel")
    now = server.registry.clock()
    row = await _fenced(server, workspace, store.create_audience_grant, workspace.workspace_id, request.member_id,
                        request.channel_id, request.max_operations, request.period_seconds,
                        now + timedelta(seconds=request.expires_in_seconds), workspace.member_id, now)
    return _grant_info(row, now)


async def audience_grant_revoke(server: Server, connection: Connection, request: s.AudienceMentionGrantRevoke,
                                ctx: RequestContext) -> s.AudienceGrantInfo:
    workspace = _governing(ctx)
    _check_id(request.grant_id, "amg", "grant")
    now = server.registry.clock()
    row = await _fenced(server, workspace, store.revoke_audience_grant, workspace.workspace_id, request.grant_id,
                        workspace.member_id, now)
    return _grant_info(row, now)


async def audience_grant_list(server: Server, connection: Connection, request: s.AudienceMentionGrantList,
                              ctx: RequestContext) -> s.AudienceGrantList:
    workspace = ctx.require(Permission.MESSAGE_READ)
    member_id = request.member_id
    if member_id is not None:
        _check_id(member_id, "mem", "member")
    if not _governor(workspace):
        member_id = workspace.member_id  # your own grants only
    now = server.registry.clock()
    rows = await server.db.run(store.list_audience_grants, workspace.workspace_id, member_id)
    return s.AudienceGrantList([_grant_info(r, now) for r in rows])


async def participation_set(server: Server, connection: Connection, request: s.AgentParticipationSet,
                            ctx: RequestContext) -> s.ParticipationInfo:
    workspace = ctx.require(Permission.MESSAGE_WRITE)
    _check_id(request.member_id, "mem", "member")
    version = await _fenced(server, workspace, store.set_participation, workspace.workspace_id, request.member_id,
                            workspace.member_id, request.accept_third_party_mention)
    return s.ParticipationInfo(request.member_id, request.accept_third_party_mention, version)


HANDLERS = {
    s.BoardCreate: board_create, s.BoardList: board_list, s.BoardArchive: board_archive,
    s.BoardRestore: board_restore, s.StrandCreate: strand_create, s.StrandGet: strand_get,
    s.StrandList: strand_list, s.StrandUpdate: strand_update, s.StrandTracksUpdate: strand_tracks_update,
    s.StrandStageSet: strand_stage_set, s.StrandArchive: strand_archive, s.StrandRestore: strand_restore,
    s.StrandDefaultSet: strand_default_set, s.StrandDefaultGet: strand_default_get, s.StrandAssign: strand_assign,
    s.StrandUnassign: strand_unassign, s.StrandWatchSet: strand_watch_set, s.StrandWatchGet: strand_watch_get,
    s.StrandWatchers: strand_watchers, s.AudienceMentionPolicySet: audience_policy_set,
    s.AudienceMentionPolicyDisable: audience_policy_disable, s.AudienceMentionPolicyList: audience_policy_list,
    s.AudienceMentionGrantCreate: audience_grant_create, s.AudienceMentionGrantRevoke: audience_grant_revoke,
    s.AudienceMentionGrantList: audience_grant_list, s.AgentParticipationSet: participation_set,
}
