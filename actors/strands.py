"""Strand commands, run by the task scope's actor (its one writer) inside its batch
transaction (a savepoint each): description and synthesis, tracks, stage,
lifecycle, assignment and watch (strand-message.md §3-§8).

Each command first re-reads the board channel's roster generation (a member who
left the channel is no longer a reader), then refuses a non-reader with
`not_found` (the strand is not revealed) and a write to an archived strand with
`forbidden` (`scope_archived`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg

from actors.fanout import CommittedEvent
from actors.scope_actor import Command, Outcome, Refused, ScopeActor, register_command
from domain import strands as rules
from domain.plan import ScopeContext
from domain.routing import ASSIGNMENT, Route, SILENCED_STATES, UNPUSHED_STATES
from storage import applier, deliveries, strands as store
from storage.errors import Conflict, NotFound


@dataclass
class StrandCommand(Command):
    pass


@dataclass
class UpdateStrand(StrandCommand):
    expected_version: int
    changes: dict[str, Any]


@dataclass
class UpdateTracks(StrandCommand):
    patch: dict[str, Any]


@dataclass
class SetStage(StrandCommand):
    stage: str
    expected_given: bool
    expected: str | None


@dataclass
class SetLifecycle(StrandCommand):
    state: str  # archived | active


@dataclass
class Assign(StrandCommand):
    member_id: str


@dataclass
class Unassign(StrandCommand):
    assignment_id: str


@dataclass
class SetWatch(StrandCommand):
    watcher: str
    value: rules.WatchValue
    expected_given: bool
    expected: rules.WatchValue | None
    may_write_others: bool


def _rule_refusal(exc: rules.StrandRuleError) -> Refused:
    return Refused(exc.code, exc.message, exc.reason)


def _board_reader(state: ScopeContext, member_id: str) -> bool:
    """A reader of the strand itself, by its board channel: not a private agent admitted
    to the discussion, which reads only the messages the owner-private predicate allows."""
    entry = state.roster.get(member_id)
    return entry is not None and entry.visibility == "public"


async def _readable(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                    command: Command, *, write: bool = True) -> tuple[asyncpg.Record, rules.Tracks]:
    """The strand's current row and tracks, read in this transaction (two commands of one
    batch must see each other's writes: the compare-and-set rules read them)."""
    await actor.refresh_task_authority(conn)
    state = actor.state
    if state is None or actor.strand is None or not _board_reader(state, command.actor.member_id):
        raise NotFound("strand")
    if write and state.status != "active":
        raise Refused("conflict", "the strand is archived", "scope_archived")
    row = await store.strand_row(conn, state.scope_id, for_update=True)
    if row is None:
        raise NotFound("strand")
    return row, store.row_tracks(row)


async def _changed(conn: asyncpg.Connection, state: ScopeContext, change: str, member_id: str) -> CommittedEvent:
    row, assigned = await store.projection(conn, state.scope_id)
    return CommittedEvent("strand.changed", state.workspace_id, state.scope_id, None, None,
                          {"change": change, "strand": rules.strand_view(row, assigned), "actor_member_id": member_id})


def _with_strand(value: dict[str, Any], event: CommittedEvent) -> Outcome:
    return Outcome({**value, "strand": event.data["strand"]}, [event])


async def _audit(conn: asyncpg.Connection, state: ScopeContext, command: Command, action: str,
                 target: str | None = None, details: dict | None = None) -> None:
    await store.audit(conn, state.workspace_id, state.scope_id, command.actor.member_id, action, target, details or {})


@register_command(UpdateStrand)
async def update_strand(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                        command: UpdateStrand) -> Outcome:
    _, tracks = await _readable(actor, conn, state, command)
    changes = dict(command.changes)
    try:
        if "fields" in changes:
            rules.check_fields(changes["fields"])
        if "synthesis_content" in changes and not rules.is_active(tracks, "synthesis"):
            raise rules.precondition("track_disabled", "the synthesis track is not enabled")
    except rules.StrandRuleError as exc:
        raise _rule_refusal(exc) from None
    await store.update_strand(conn, state.scope_id, command.expected_version, command.actor.member_id, changes)
    await _audit(conn, state, command, "update", details={"fields": sorted(changes)})
    actor.forget_state()
    return _with_strand({}, await _changed(conn, state, "updated", command.actor.member_id))


@register_command(UpdateTracks)
async def update_tracks(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                        command: UpdateTracks) -> Outcome:
    _, current = await _readable(actor, conn, state, command)
    try:
        tracks = rules.apply_tracks_patch(current, command.patch)
    except rules.StrandRuleError as exc:
        raise _rule_refusal(exc) from None
    await store.set_tracks(conn, state.scope_id, tracks, command.actor.member_id)
    await _audit(conn, state, command, "tracks_update", details={"patch": command.patch})
    actor.forget_state()
    return _with_strand({}, await _changed(conn, state, "tracks", command.actor.member_id))


@register_command(SetStage)
async def set_stage(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext, command: SetStage) -> Outcome:
    row, _ = await _readable(actor, conn, state, command)
    try:
        rules.check_stage_set(row["stage"], command.stage, command.expected_given, command.expected)
    except rules.StrandRuleError as exc:
        raise _rule_refusal(exc) from None
    await store.set_stage(conn, state.scope_id, command.stage, command.actor.member_id)
    await _audit(conn, state, command, "stage_set", details={"stage": command.stage, "from": row["stage"]})
    actor.forget_state()
    return _with_strand({}, await _changed(conn, state, "stage", command.actor.member_id))


@register_command(SetLifecycle)
async def set_lifecycle(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext,
                        command: SetLifecycle) -> Outcome:
    row, _ = await _readable(actor, conn, state, command, write=False)
    parent = actor.parent
    if row["board_status"] != "active" or parent is None or parent.status != "active":
        # Only the strand's own archive is undone here: an archived board or channel keeps it read-only.
        raise Refused("conflict", "the board or channel is archived", "scope_archived")
    await store.set_state(conn, state.scope_id, command.state, command.actor.member_id)
    await _audit(conn, state, command, "archive" if command.state == "archived" else "restore")
    actor.forget_state()
    change = "archived" if command.state == "archived" else "restored"
    return _with_strand({}, await _changed(conn, state, change, command.actor.member_id))


@register_command(Assign)
async def assign(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext, command: Assign) -> Outcome:
    await _readable(actor, conn, state, command)
    state = actor.state
    entry = state.roster.get(command.member_id)
    if not _board_reader(state, command.member_id):
        # Only a reader of the strand can be assigned; anyone else is not revealed.
        raise NotFound("member")
    try:
        assignment_id = await store.assign(conn, state.workspace_id, state.scope_id, command.member_id,
                                           command.actor.member_id)
    except Conflict:
        raise Refused("conflict", "already assigned", "already_assigned") from None
    await _audit(conn, state, command, "assign", command.member_id, {"assignment_id": assignment_id})
    await actor.open_participants(conn, state, [command.member_id])
    outcome = _with_strand({"assignment_id": assignment_id},
                           await _changed(conn, state, "assigned", command.actor.member_id))
    # Assignment is an activity that notifies the assignee (§7.1, §8.7) unless they muted the strand.
    watch = actor.strand.watches.get(command.member_id) if actor.strand else None
    if (command.member_id != command.actor.member_id and entry.notification_state not in SILENCED_STATES
            and (watch is None or watch.level != "muted")):
        activity_id = await applier.assignment_activity(conn, state.workspace_id, state.scope_id, assignment_id,
                                                      command.actor.member_id, command.member_id)
        await deliveries.write_routes(conn, state.workspace_id, state.scope_id, [deliveries.RouteSet(
            (Route(command.member_id, ASSIGNMENT, "member", push=entry.notification_state not in UNPUSHED_STATES),),
            message_id=None, activity_event_id=activity_id)], command.actor.execution_generation)
        outcome.wakes_worker = True
    actor.forget_state()
    return outcome


@register_command(Unassign)
async def unassign(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext, command: Unassign) -> Outcome:
    await _readable(actor, conn, state, command)
    member_id = await store.unassign(conn, state.scope_id, command.assignment_id, command.actor.member_id)
    await _audit(conn, state, command, "unassign", member_id, {"assignment_id": command.assignment_id})
    actor.forget_state()
    return _with_strand({"member_id": member_id}, await _changed(conn, state, "unassigned", command.actor.member_id))


@register_command(SetWatch)
async def set_watch(actor: ScopeActor, conn: asyncpg.Connection, state: ScopeContext, command: SetWatch) -> Outcome:
    await _readable(actor, conn, state, command, write=False)
    state = actor.state
    if not _board_reader(state, command.watcher):
        # Watching needs read access first (§8.9); another member who cannot read is not revealed.
        raise NotFound("member")
    written = await store.watch_row(conn, state.scope_id, command.watcher, for_update=True)
    try:
        rules.check_watch_write(command.actor.member_id, command.watcher, command.value,
                                None if written is None else rules.WatchValue(written["level"],
                                                                              written["level_public"]),
                                command.expected_given, command.expected, command.may_write_others)
    except rules.StrandRuleError as exc:
        raise _rule_refusal(exc) from None
    revision = await store.write_watch(conn, state.workspace_id, state.scope_id, command.watcher, command.value,
                                       command.actor.member_id)
    if command.watcher != command.actor.member_id:
        # .others writes pair with an audit record in the same transaction (§8.4).
        await _audit(conn, state, command, "watch_set_others", command.watcher,
                     {"level": command.value.level, "revision": revision})
    await actor.open_participants(conn, state, [command.watcher])
    actor.forget_state()
    event = CommittedEvent("strand.watch.changed", state.workspace_id, state.scope_id, None, None,
                           {"strand_id": state.scope_id, "watcher_member_id": command.watcher, "revision": revision,
                            "value": command.value.as_json()},
                           audience=frozenset({command.watcher, command.actor.member_id}))
    return Outcome({"revision": revision, "value": command.value.as_json()}, [event])
