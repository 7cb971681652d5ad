"""ScopeActor: the one task that writes a scope's seq, roster and memberships.

It drains its mailbox in batches and commits each batch in ONE transaction
(group commit): sends are planned (pure), checked for idempotency, allocated
consecutive seqs and inserted with one statement; other commands run in
savepoints of the same transaction, so one failing command does not fail its
neighbours.  After commit it replies to every caller; the committed events are
published while the next batch's transaction runs — or at once, when the mailbox
is empty or publishing takes this scope longer than committing — and the inline
outbox rows are marked by the node's settler (actors/inline_settler.py) in a
transaction of its own.

Across processes: an actor runs only on the node holding the scope's lease
(storage/leases.py), and every write transaction passes the lease's fence
first, so a former owner commits nothing once another node took over (the
actor then stops, and its callers' commands run at the new owner).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import datetime, timezone
from functools import partial
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar

import asyncpg
import trio

from actors.fanout import CommittedEvent, FanoutHub, Roster
from domain.plan import (
    ActorContext,
    ChannelProfile,
    CommittedMessage,
    MembershipMutation,
    MessageIntent,
    MessagePlan,
    RosterEntry,
    ScopeContext,
)
from actors import routing
from actors.planner import PlanRefused, mention_handles, plan_message
from actors.policy import can_add_member
from actors.routing_tokens import TooManyRoutingTokens
from actors.write_turns import WriteTurns
from domain.authority import ScopeAuthority, private_read_reason
from domain.credentials import CredentialProof, StaleCredential
from domain.routing import RoutedDelivery
from domain.strands import effective_level
from domain.routing import AUDIENCE_MENTION, REACTION, SILENCED_STATES, UNPUSHED_STATES, WATCH, Route
from storage import applier, deliveries, leases, messages, private_authority, strands, tenancy, visibility
from storage import attachments as attachment_rows
from storage.bridge import Database
from storage.errors import Conflict, DatabaseUnavailable, LeaseLost, NotFound, StorageError, WriteFenced

log = logging.getLogger("scopewire.actors")

MAX_BATCH = 256
# Weight of the newest sample in the actor's moving averages of publish and commit times.
_AVERAGE_WEIGHT = 0.2


def _moving_average(average: float, sample: float) -> float:
    return sample if average == 0.0 else average + (sample - average) * _AVERAGE_WEIGHT


class Refused(Exception):
    """A command the actor refuses: `code` is a protocol error code."""

    def __init__(self, code: str, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


class ActorFailed(Exception):
    """The actor hit an unexpected error (a bug, not a storage failure) while it
    held this command's batch; the server answers `internal`."""


class ActorUnavailable(DatabaseUnavailable):
    """The scope actor could not take or answer the command in time, or it
    stopped before running it; nothing is known to have committed: retry."""


class Reply:
    """A one-shot reply slot the caller awaits."""

    def __init__(self) -> None:
        self._done = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def answered(self) -> bool:
        return self._done.is_set()

    def set(self, value: Any) -> None:
        if not self._done.is_set():
            self._value = value
            self._done.set()

    def fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    async def wait(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Forwardable:
    """An actor command with a `reply` slot: forwarded to the owning node (server/cluster.py)
    without it, and given a fresh one there."""

    reply: Reply

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["reply"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reply = Reply()


# --- commands ------------------------------------------------------------------------------

@dataclass
class Command(Forwardable):
    actor: ActorContext
    reply: Reply = field(default_factory=Reply, init=False)
    # Refused unless the acting member is in the scope's roster.
    requires_membership: ClassVar[bool] = True

    async def prelock(self, conn: asyncpg.Connection) -> None:
        """Rows this command locks before anything else in its batch transaction: a lock that
        another transaction takes first (a platform account's delete) must come first here too."""


@dataclass
class CreateScope(Command):
    """Create this actor's scope and open its first memberships in one
    transaction, so the actor writes its roster from the first row on.  The
    reply is the scope id: another scope's when a DM of the same pair or a
    thread of the same root was created first (then nothing is written)."""

    scope_type: str
    initial: tuple[MembershipMutation, ...]  # decided by the caller: creator, DM pair, thread starters
    invitees: tuple[str, ...] = ()  # added by the creator, checked like scope.invite
    channel: ChannelProfile | None = None
    identity_key: str | None = None
    parent_scope_id: str | None = None
    root_message_id: str | None = None
    # A task scope's strand row, written in the same transaction (storage/strands.py).
    strand: dict[str, Any] | None = None
    requires_membership: ClassVar[bool] = False


@dataclass
class Send(Command):
    intent: MessageIntent
    # Set when the server served the request from a cached context: re-checked in this batch.
    proof: CredentialProof | None = None


@dataclass
class ChangeMembers(Command):
    requires_membership: ClassVar[bool] = False  # decided per action
    action: str  # join | join_thread | invite | leave | remove | reopen_dm
    member_ids: tuple[str, ...]


@dataclass
class CloseDeparted(Command):
    """System: close the open memberships of members who are no longer active in
    the workspace (removed or disabled); the others' are left alone."""

    member_ids: tuple[str, ...]
    requires_membership: ClassVar[bool] = False


@dataclass
class Edit(Command):
    message_id: str
    content: str
    expected_revision: int


@dataclass
class Withdraw(Command):
    message_id: str


@dataclass
class React(Command):
    message_id: str
    key: str
    add: bool


@dataclass
class MarkRead(Command):
    seq: int | None
    unread: bool = False


@dataclass
class SetNotification(Command):
    state: str
    # Whose state: the acting member's own, or (checked by the caller) an agent's by its owner.
    member_id: str | None = None
    requires_membership: ClassVar[bool] = False  # the target member must be one


@dataclass
class Archive(Command):
    requires_membership: ClassVar[bool] = False  # the handler checked ownership or resource.manage


@dataclass
class _Publication:
    """What a committed batch hands to the fanout hub."""

    items: list[tuple[CommittedEvent, frozenset[str]]] = field(default_factory=list)
    message_ids: list[str] = field(default_factory=list)
    # Routed deliveries this actor hands out first (inline_targeted).
    deliveries: list[RoutedDelivery] = field(default_factory=list)
    wake_outbox: bool = False
    published: bool = False

    def extend(self, other: _Publication) -> None:
        self.items += other.items
        self.message_ids += other.message_ids
        self.deliveries += other.deliveries
        self.wake_outbox = self.wake_outbox or other.wake_outbox


@dataclass
class Outcome:
    """What a command produced: its reply value and the events to publish after commit."""

    value: Any = None
    events: list[CommittedEvent] = field(default_factory=list)
    # A domain command changed private authority (grants, collaborators) here.
    authority_changed: bool = False
    # Routed deliveries committed with it, handed out inline after commit.
    deliveries: list[RoutedDelivery] = field(default_factory=list)
    # It wrote worker-first outbox rows (the outbox worker is woken after commit).
    wakes_worker: bool = False


class ScopeActor:
    def __init__(self, scope_id: str, db: Database, hub: FanoutHub, outbox_wake: Callable[[], None] | None = None,
                 idle_seconds: float = 30.0, mailbox_size: int = 1024,
                 on_commit: Callable[[int, float], None] | None = None,
                 offer_deliveries: Callable[[list[RoutedDelivery]], None] | None = None,
                 clock: Callable[[], datetime] | None = None, lease: tuple[str, int] | None = None,
                 settle_later: Callable[[str, list[str]], None] | None = None,
                 view: messages.ActorView | None = None, write_turns: WriteTurns | None = None) -> None:
        self.scope_id = scope_id
        # Shared by the node's actors: a batch of sends waits for its workspace's turn
        # before it is closed (actors/write_turns.py).
        self.write_turns = write_turns or WriteTurns()
        # Read for it already (ScopeRegistry.start_many): taken instead of the first reload.
        self._first_view = view
        # Takes the marks of inline deliveries when the mailbox runs empty (actors/inline_settler.py).
        self.settle_later = settle_later
        # (node id, epoch) of this node's ownership lease (storage/leases.py): every write
        # transaction passes its fence first.  None: a single process without leases.
        self.lease = lease
        # Set when the lease was lost: the commands still queued must run at the new owner.
        self.lease_lost: LeaseLost | None = None
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        # Audience mentions of the running batch's sends that passed their checks: plan index → audiences.
        self._audiences: dict[int, tuple[str, ...]] = {}
        # Hands committed routed deliveries to the process's delivery router.
        self.offer_deliveries = offer_deliveries
        # Told (batch size, seconds in the transaction) after each committed batch: metrics.
        self.on_commit = on_commit
        self.db = db
        self.hub = hub
        self.idle_seconds = idle_seconds
        self.outbox_wake = outbox_wake
        self.mailbox, self._inbox = trio.open_memory_channel[Command](mailbox_size)
        self.state: ScopeContext | None = None
        self.stopped = False
        self._roster_dirty = False
        # Private authority (grants, collaborators) changed here: reloaded after commit.
        self._authority_dirty = False
        self._roster_set: Roster = Roster()
        # Who receives every event (public members) and who receives only what the
        # readable predicate lets them (private agents), rebuilt with the roster.
        self._public_set: Roster = Roster()
        self._private_readers: tuple[RosterEntry, ...] = ()
        self._private_by_id: dict[str, RosterEntry] = {}
        # Members whose notification state here is auto-wake (routing.auto_wake).
        self._auto_wake: list[RosterEntry] = []
        # For a thread: the parent as this actor last read it (admission, inherited authority).
        self.parent: ScopeContext | None = None
        self.authority = ScopeAuthority()
        # A task scope's strand (watches, assignees, participants): what routing reads.
        self.strand: strands.StrandState | None = None
        # Owners whose Scope Execution here is known to exist (created on a first wake / owner_quote).
        self._executions: set[str] = set()
        # Ensured in the running batch: known to exist only once it commits.
        self._executions_in_batch: set[str] = set()
        # Cached contexts' proofs this actor's batches found fresh, with their rows' digest
        # then: a batch of plain sends checks them unchanged inside its one statement.
        self._proof_digests: dict[CredentialProof, str] = {}
        # Without a settler: messages delivered inline whose outbox rows are not marked
        # yet; the mark rides in the next batch's transaction, or commits alone when the
        # mailbox is empty.
        self._unsettled: list[str] = []
        # Moving averages of a publication's and of a commit's wall time here (seconds):
        # whether the next batch commits while this one is published, or after.
        self._publish_seconds = 0.0
        self._commit_seconds = 0.0

    @property
    def mailbox_depth(self) -> int:
        """Commands waiting in the mailbox."""
        return self._inbox.statistics().current_buffer_used

    async def run(self) -> None:
        """Serve until idle; a crash fails the pending commands and ends the task
        (the registry starts a fresh actor on the next command)."""
        try:
            if self._first_view is not None:
                self._take(self._first_view)
                self._first_view = None
            else:
                await self._reload()
            # Committed but not yet published: fanned out while the next batch's
            # transaction runs (or as soon as the mailbox is empty).
            pending: _Publication | None = None
            while True:
                first = None
                if pending is not None or self._unsettled:
                    try:
                        first = self._inbox.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        if pending is not None:
                            self._publish(pending)
                            pending = None
                            continue
                        await self._settle()
                if first is None:
                    try:
                        with trio.move_on_after(self.idle_seconds):
                            first = await self._inbox.receive()
                    except trio.EndOfChannel:
                        pass  # the mailbox was closed (the node drains): what it held is done
                if first is None:
                    return
                # A send's batch commits only in its workspace's turn: wait for it before the
                # batch is closed, so that it takes in the sends that arrive meanwhile.
                turn = self.state.workspace_id if self.state is not None and type(first) is Send else None
                if turn is not None:
                    if pending is not None and self.write_turns.busy(turn):
                        self._publish(pending)  # fanned out while the workspace's other scopes commit
                        pending = None
                    await self.write_turns.acquire(turn)
                try:
                    pending = await self._commit_next(first, pending)
                finally:
                    if turn is not None:
                        self.write_turns.release(turn)
                if self._publish_seconds > self._commit_seconds:
                    # Overlapped with the next commit, a publication costlier than a commit sets
                    # the pace of both, and its messages wait for that commit too: publish it
                    # first (at 1,000 subscribers × 500 msg/s, commits 10–16 → 4–7 ms and a fifth
                    # less PostgreSQL CPU; README: fanout).  Cheaper ones still overlap, which a
                    # hot scope's closed-loop senders need for their rate.
                    self._publish(pending)
                    pending = None
        finally:
            self.stopped = True
            self.mailbox.close()
            error = self.lease_lost or ActorUnavailable("scope actor stopped; retry")
            while True:
                try:
                    self._inbox.receive_nowait().reply.fail(error)
                except (trio.WouldBlock, trio.EndOfChannel):
                    break

    # --- the batch -------------------------------------------------------------------------

    async def _commit_next(self, first: Command, previous: _Publication | None) -> _Publication:
        """Close the batch `first` opens with what the mailbox holds now, commit it and
        return what it publishes; `previous` is published meanwhile."""
        batch = [first]
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        try:
            return await self._commit(batch, previous)
        except Exception as exc:
            # Every caller of the failed batch gets an answer; the registry
            # logs the crash and the next command starts a fresh actor.
            failure = (exc if isinstance(exc, DatabaseUnavailable)
                       else ActorFailed(f"scope actor failed: {type(exc).__name__}"))
            for command in batch:
                command.reply.fail(failure)
            raise
        finally:
            if previous is not None:
                self._publish(previous)  # a no-op once the overlap published it

    async def _commit(self, batch: list[Command], previous: _Publication | None = None) -> _Publication:
        """Commit `batch` in one transaction and answer its callers; return what
        it publishes.  `previous` (the last batch's publication) is fanned out
        on this thread while PostgreSQL works on this one: the two costs
        overlap instead of adding up (the caller publishes it if that never
        happened, e.g. the transaction could not start)."""
        if self.state is None:
            return await self._create(batch)
        publication = _Publication()
        settling = list(self._unsettled)
        started = time.perf_counter()
        try:
            meanwhile = partial(self._publish, previous) if previous is not None else None
            outcomes = await self.db.run_overlapping(meanwhile, self._write_batch, batch, settling)
        except LeaseLost as exc:
            # Another node owns the scope now: nothing of this batch committed, and this
            # actor must not write again; its callers retry at the owner.
            self.lease_lost = exc
            for command in batch:
                command.reply.fail(exc)
            raise
        except (StorageError, asyncpg.PostgresError) as exc:
            if self.state is not None and self.state.type == "task":
                await self._reload()  # the batch's in-memory strand updates (participants) rolled back with it
            if len(batch) > 1 and isinstance(exc, asyncpg.PostgresError):
                # One command broke the whole batch: run each alone so the rest commit.
                for command in batch:
                    publication.extend(await self._commit([command]))
                return publication
            for command in batch:
                command.reply.fail(exc)
            return publication
        del self._unsettled[:len(settling)]
        self._executions |= self._executions_in_batch
        elapsed = time.perf_counter() - started
        if previous is None:  # an overlapped commit's time is the publication's as much as its own
            self._commit_seconds = _moving_average(self._commit_seconds, elapsed)
        if self.on_commit is not None:
            self.on_commit(len(batch), elapsed)
        # Answered before anything else can fail: the batch has committed.
        for command, outcome in zip(batch, outcomes):
            if isinstance(outcome, BaseException):
                command.reply.fail(outcome)
            else:
                command.reply.set(outcome.value)
        before = self._roster_set
        if (self._roster_dirty or self._authority_dirty
                or any(isinstance(c, (ChangeMembers, CloseDeparted, Archive)) for c in batch)):
            # Rebuilt only when the roster or authority changes: copying a 10,000-member
            # roster per batch was the largest CPU cost of a send into a big scope (bench/send.py).
            await self._reload()
        roster = self._roster_set
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                continue
            publication.deliveries += outcome.deliveries
            publication.wake_outbox = publication.wake_outbox or outcome.wakes_worker
            for event in outcome.events:
                # A member who just left still hears about their own removal.
                publication.items.append(
                    (event, roster | before if event.event == "membership.changed" else self._audience(event)))
                if event.event == "message.created":
                    publication.message_ids.append(event.data.id)
                    if self.state is not None:
                        self.state.latest_seq = max(self.state.latest_seq, event.seq)
        publication.wake_outbox = publication.wake_outbox or any(isinstance(c, (Edit, Withdraw)) for c in batch)
        return publication

    async def _create(self, batch: list[Command]) -> _Publication:
        """The scope does not exist (yet): only its creation can run."""
        publication = _Publication()
        for command in batch:
            if not isinstance(command, CreateScope) or self.state is not None:
                command.reply.fail(NotFound("scope"))
                continue
            try:
                outcome = await self.db.transaction(self._apply_create, command)
            except LeaseLost as exc:
                self.lease_lost = exc
                command.reply.fail(exc)
                raise
            except (StorageError, Refused, asyncpg.PostgresError) as exc:
                command.reply.fail(exc)
                continue
            command.reply.set(outcome.value)
            if outcome.value == self.scope_id:
                await self._reload()
            publication.items += [(event, self._roster_set) for event in outcome.events]
        return publication

    async def _pass_lease_fence(self, conn: asyncpg.Connection) -> None:
        if self.lease is not None:
            await leases.pass_fence(conn, self.scope_id, *self.lease)

    async def _apply_create(self, conn: asyncpg.Connection, command: CreateScope) -> Outcome:
        await self._pass_lease_fence(conn)
        actor = command.actor
        await tenancy.pass_write_fence(conn, actor.workspace_id, actor.execution_generation)
        scope_id = await applier.insert_scope(
            conn, scope_id=self.scope_id, workspace_id=actor.workspace_id, type=command.scope_type,
            created_by=actor.member_id, identity_key=command.identity_key,
            parent_scope_id=command.parent_scope_id, root_message_id=command.root_message_id)
        if scope_id != self.scope_id:
            return Outcome(scope_id)
        if command.strand is not None:
            await strands.insert_strand(conn, scope_id=scope_id, workspace_id=actor.workspace_id,
                                        creator=actor.member_id, **command.strand)
        if command.channel is not None:
            profile = command.channel
            await applier.insert_channel_profile(
                conn, scope_id=scope_id, workspace_id=actor.workspace_id, owner=actor.member_id, slug=profile.slug,
                display_name=profile.display_name, description=profile.description, visibility=profile.visibility)
        mutations = list(command.initial)
        if command.invitees:
            # Invitees are checked as scope.invite would, against the roster so far.
            state = ScopeContext(
                scope_id=scope_id, workspace_id=actor.workspace_id, type=command.scope_type, status="active",
                parent_scope_id=command.parent_scope_id, root_message_id=command.root_message_id, latest_seq=0,
                roster_generation=0, visibility=command.channel.visibility if command.channel else None,
                roster={m.member_id: RosterEntry(m.member_id, actor.member_kind if m.member_id == actor.member_id
                                                 else "", m.visibility, m.owner_member_id, 0) for m in mutations})
            for member_id in command.invitees:
                candidate = await messages.member_candidate(conn, actor.workspace_id, member_id)
                decision = can_add_member(actor, state, candidate, None)
                if not decision.allowed:
                    code = "conflict" if decision.reason == "already_member" else "forbidden"
                    raise Refused(code, f"cannot add member: {decision.reason}", decision.reason)
                private = candidate.kind == "agent" and candidate.visibility == "private"
                mutation = MembershipMutation(member_id, "open", "private" if private else "public",
                                              candidate.owner_member_id if private else None)
                mutations.append(mutation)
                state.roster[member_id] = RosterEntry(member_id, candidate.kind, mutation.visibility,
                                                      mutation.owner_member_id, 0)
        generation = await applier.apply_membership_mutations(conn, actor.workspace_id, scope_id, mutations, 0)
        return Outcome(scope_id, [_membership_changed(actor.workspace_id, scope_id, m, generation)
                                   for m in mutations])

    async def _reload(self) -> None:
        """Read the scope, its roster, the thread's parent and the private authority afresh."""
        self._roster_dirty = self._authority_dirty = False
        view = await self.db.run(messages.load_actor_view, self.scope_id)
        self._take(view)

    def _take(self, view: messages.ActorView) -> None:
        self.state, self.parent, self.authority = view.state, view.parent, view.authority
        self.strand = view.strand
        roster = self.state.roster if self.state else {}
        # A task's roster is its board channel's readers: its own generation does not name it.
        generation = self.state.roster_generation if self.state and self.state.type != "task" else None
        self._roster_set = Roster(roster, generation)
        self._private_readers = tuple(e for e in roster.values() if e.visibility == "private")
        self._private_by_id = {e.member_id: e for e in self._private_readers}
        self._auto_wake = [e for e in roster.values() if e.notification_state == "auto-wake"]
        self._public_set = (Roster((m for m, e in roster.items() if e.visibility == "public"), generation)
                            if self._private_readers else self._roster_set)

    async def _refresh_parent(self, conn: asyncpg.Connection) -> None:
        """A thread re-reads its parent and the authority when the parent's roster
        generation moved (a membership, grant or collaborator changed there): one
        cheap read per batch instead of the parent's roster."""
        if self.parent is None:
            return
        generation = await messages.roster_generation(conn, self.parent.scope_id)
        if generation != self.parent.roster_generation:
            # Only the parent and the authority: this scope's own state is this actor's.
            self._take(await messages.load_actor_view(conn, self.scope_id, self.state))

    def _audience(self, event: CommittedEvent) -> frozenset[str] | MessageAudience:
        """Who may receive `event`: everyone on the roster, except that a private
        agent receives a message's events only when it may read the message."""
        if event.event != "message.created":
            return self._roster_set
        message = event.data
        return self._message_audience(message.author_member_id, message.seq, message.workspace_global_seq,
                                      message.created_at)

    def _message_audience(self, author: str, seq: int, global_seq: int,
                          created_at) -> frozenset[str] | MessageAudience:
        if not self._private_readers:
            return self._roster_set
        # Bound now: a reload replaces these objects, it never changes them.
        roster = self.state.roster if self.state else {}
        parent_roster = self.parent.roster if self.parent is not None else None
        authority, author_entry = self.authority, roster.get(author)

        def reads(reader: RosterEntry) -> bool:
            # In a thread, only while still a private member of the parent (scope-model §5.2).
            return ((parent_roster is None or reader.member_id in parent_roster)
                    and private_read_reason(reader, author, author_entry, authority, seq, global_seq,
                                            created_at) is not None)
        return MessageAudience(self._public_set, self._private_by_id, reads)

    def _publish(self, publication: _Publication) -> None:
        if publication.published:
            return
        publication.published = True
        started = time.perf_counter()
        # One publication per batch: each connection gets the batch in one write.
        self.hub.publish_many(publication.items)
        if publication.items:
            self._publish_seconds = _moving_average(self._publish_seconds, time.perf_counter() - started)
        # Marked delivered only once really handed over: by the node's settler when there
        # is one — its own transaction, off this actor's commit path (a mark riding in the
        # next batch cost a hot scope's batch an UPDATE and split its fence statement in
        # two) — else here (_settle).
        if self.settle_later is None:
            self._unsettled.extend(publication.message_ids)
        elif publication.message_ids:
            self.settle_later(self.scope_id, publication.message_ids)
        if publication.deliveries and self.offer_deliveries is not None:
            self.offer_deliveries(publication.deliveries)
        if publication.wake_outbox and self.outbox_wake is not None:
            self.outbox_wake()

    async def _apply_settle(self, conn: asyncpg.Connection, settling: list[str]) -> None:
        await self._pass_lease_fence(conn)
        await applier.settle_inline_delivered(conn, self.scope_id, settling)

    async def _settle(self) -> None:
        settling = list(self._unsettled)
        try:
            await self.db.transaction(self._apply_settle, settling)
        except DatabaseUnavailable:
            pass  # the outbox worker replays after the grace period
        finally:
            del self._unsettled[:len(settling)]

    async def _write_batch(self, conn: asyncpg.Connection, batch: list[Command], settling: list[str]) -> list[Any]:
        """The batch's outcomes, written in one statement when it is all plain sends whose
        gates pass (no BEGIN, no COMMIT: a quarter of the round trips), else in a transaction."""
        plans = self._plain_send_plans(batch, settling)
        if plans is not None:
            outcomes = await self._insert_plain_sends(conn, batch, plans)
            if outcomes is not None:
                return outcomes
        async with conn.transaction():
            return await self._apply_batch(conn, batch, settling)

    def _plain_send_plans(self, batch: list[Command], settling: list[str]) -> list[MessagePlan] | None:
        """The plans of a batch that `_apply_batch` would commit with nothing but the fences,
        the proofs and `applier.insert_messages`: sends into a leased channel or DM, each
        plannable from the actor's state alone (no mention, recipient, attachment, source,
        audience, wake or admission; no private agent a DM's time window concerns), whose
        cached contexts' proofs this actor has found fresh before; else None."""
        state = self.state
        if (settling or self.lease is None or state is None or self.parent is not None
                or state.type not in ("channel", "dm") or self._auto_wake
                or (state.type == "dm" and self._private_readers_here())):
            return None
        plans: list[MessagePlan] = []
        client_ids: set[str] = set()
        kinds: set[str] = set()
        for command in batch:
            if type(command) is not Send:
                return None
            intent = command.intent
            if intent.recipients or intent.attachment_ids or intent.sources or _safe_handles(intent):
                return None
            if command.proof is not None:
                if command.proof not in self._proof_digests:
                    return None
                kinds.add(command.proof.kind)
            if intent.client_message_id is not None:
                if intent.client_message_id in client_ids:
                    return None
                client_ids.add(intent.client_message_id)
            try:
                plan = plan_message(intent, command.actor, state, {}, None, self.authority, None)
            except (PlanRefused, TooManyRoutingTokens):
                return None
            if plan.routes or plan.membership_mutations or plan.executions or plan.audience_mentions:
                return None
            plans.append(plan)
        return plans if len(kinds) <= 1 else None

    async def _insert_plain_sends(self, conn: asyncpg.Connection, batch: list[Command],
                                  plans: list[MessagePlan]) -> list[Any] | None:
        """Commit `plans` in one statement gated like `_apply_batch`; None when a gate did not
        pass or a client_message_id was seen before (nothing was written: the transactional
        path then answers each command as it always does)."""
        assert self.state is not None and self.lease is not None
        state = self.state
        digests = {c.proof: self._proof_digests[c.proof] for c in batch if c.proof is not None}
        gate = leases.scope_write_gate(*self.lease, sorted({c.actor.execution_generation for c in batch}), digests)
        committed = await applier.insert_messages(conn, state.workspace_id, state.scope_id, plans, gate=gate)
        if committed is None:
            return None
        self._executions_in_batch = set()
        return [Outcome(message, [] if plan.intent.silent else [CommittedEvent(
                    "message.created", message.workspace_id, message.scope_id, message.seq,
                    message.workspace_global_seq, message)])
                for plan, message in zip(plans, committed)]

    def _remember_fresh_proofs(self, fresh: dict[CredentialProof, str]) -> None:
        if len(self._proof_digests) + len(fresh) > _PROOF_DIGESTS_KEPT:
            self._proof_digests.clear()  # revoked and rotated contexts do not accumulate
        self._proof_digests.update(fresh)

    async def _apply_batch(self, conn: asyncpg.Connection, batch: list[Command], settling: list[str]) -> list[Any]:
        assert self.state is not None
        fence = None
        # Sends served from cached contexts: their credentials' rows are re-read after the
        # fences (a revocation committed before that refuses the send), in the same
        # statement when the fences share one and the proofs are of one kind.
        proofs = {c.proof for c in batch if isinstance(c, Send) and c.proof is not None}
        stale: set[CredentialProof] | None = None
        if self.lease is not None and not settling and all(
                type(command).prelock is Command.prelock for command in batch):
            # Nothing locks between the two gates: one round trip for both.
            proof_rows = tenancy.proof_rows_query(proofs, 5) if proofs else None
            fence, rows = await leases.pass_fence_and_share_execution_state(
                conn, self.scope_id, *self.lease, self.state.workspace_id, proof_rows)
            if proof_rows is not None:
                fresh = tenancy.fresh_among(proofs, rows)
                stale = proofs - fresh.keys()
                self._remember_fresh_proofs(fresh)
        else:
            await self._pass_lease_fence(conn)
        if self.state.type == "task":
            # A task's roster is its board channel's readers: re-read when the channel's moved.
            await self._refresh_parent(conn)
        state = self.state
        assert state is not None
        for command in batch:
            await command.prelock(conn)
        if settling:
            await applier.settle_inline_delivered(conn, self.scope_id, settling)
        self._executions_in_batch = set()
        outcomes: list[Any] = [None] * len(batch)
        # One fence check per batch: the shared lock is held until commit (§10.3).
        if fence is None:
            fence = await tenancy.execution_state_for_share(conn, state.workspace_id)
        for index, command in enumerate(batch):
            if (fence["write_fenced"] or fence["state"] != "active"
                    or command.actor.execution_generation != fence["active_generation"]):
                outcomes[index] = WriteFenced("stale execution generation or fenced workspace")
        if stale is None and proofs:
            stale = await tenancy.stale_proofs(conn, proofs)
        if stale:
            for index, command in enumerate(batch):
                if outcomes[index] is None and isinstance(command, Send) and command.proof in stale:
                    outcomes[index] = StaleCredential()
        sends = [(i, c) for i, c in enumerate(batch) if isinstance(c, Send) and outcomes[i] is None]
        if sends:
            await self._apply_sends(conn, state, batch, sends, outcomes)
        for index, command in enumerate(batch):
            if outcomes[index] is not None or isinstance(command, Send):
                continue
            try:
                async with conn.transaction():  # a savepoint per command
                    outcomes[index] = await self._apply_other(conn, state, command)
            except (StorageError, Refused) as exc:
                outcomes[index] = exc
        return outcomes

    async def _apply_sends(self, conn: asyncpg.Connection, state: ScopeContext, batch: list[Command],
                           sends: list[tuple[int, Command]], outcomes: list[Any]) -> None:
        handles = sorted({h for _, c in sends for h in _safe_handles(c.intent)})
        recipient_ids = sorted({r for _, c in sends for r in c.intent.recipients})
        candidates = await messages.mention_candidates(conn, state.workspace_id, handles, recipient_ids)
        await self._refresh_parent(conn)
        # A private agent's authority is windowed by time: read now() only when one may be addressed.
        now = (await messages.transaction_time(conn)
               if self._private_readers_here() and (candidates or state.type == "dm") else None)
        plans: list[tuple[int, MessagePlan]] = []
        for index, command in sends:
            try:
                plans.append((index, plan_message(command.intent, command.actor, state, candidates, self.parent,
                                                  self.authority, now)))
            except PlanRefused as exc:
                reason = exc.decision.reason
                code = ("forbidden" if reason in ("not_a_member", "recipient_not_addressable", "read_only_scope")
                        else "conflict")
                message = ("cannot address that recipient" if reason == "recipient_not_addressable"
                           else f"cannot send: {reason}")
                outcomes[index] = Refused(code, message, reason)
            except TooManyRoutingTokens as exc:
                outcomes[index] = Refused("invalid", f"too many mentions ({exc.count})", "too_many_mentions")
        existing = await applier.find_idempotent(
            conn, state.scope_id, [p.intent.client_message_id for _, p in plans if p.intent.client_message_id])
        fresh: list[tuple[int, MessagePlan]] = []
        claimed: dict[tuple, tuple[int, MessagePlan]] = {}
        duplicates: list[tuple[int, tuple]] = []
        for index, plan in plans:
            key = None
            if plan.intent.client_message_id is not None:
                key = (plan.actor.member_id, plan.actor.idempotency_subject_member_id or plan.actor.member_id,
                       plan.intent.client_message_id)
            if key is not None and key in existing:
                row = existing[key]
                outcomes[index] = (Outcome(messages.committed_from_row(row, replayed=True)) if bytes(row["idempotency_payload_digest"]) == plan.digest
                                   else Conflict("idempotency_conflict", "same client_message_id, different payload"))
                continue
            if key is not None and key in claimed:
                duplicates.append((index, key))
                continue
            if key is not None:
                claimed[key] = (index, plan)
            fresh.append((index, plan))
        claims = await self._check_attachments(conn, state, fresh, outcomes)
        fresh = [(i, p) for i, p in fresh if outcomes[i] is None]
        self._audiences = {}
        uses = await self._authorize_audiences(conn, state, fresh, outcomes) if any(
            p.audience_mentions for _, p in fresh) else {}
        fresh = [(i, p) for i, p in fresh if outcomes[i] is None]
        if fresh:
            committed = await applier.insert_messages(conn, state.workspace_id, state.scope_id,
                                                      [p for _, p in fresh], [claims.get(i, []) for i, _ in fresh])
            if uses:
                await strands.record_audience_uses(conn, state.workspace_id, [
                    (uses[i], message.id) for (i, _), message in zip(fresh, committed) if i in uses], self.clock())
            # The global seqs are allocated (the workspace counter stays locked until
            # commit): a grant or collaborator change on the parent either committed
            # before (seen now) or ends after these messages.  Live fanout then
            # evaluates the readable predicate on current windows.
            await self._refresh_parent(conn)
            await self._ensure_executions(conn, state, [p for _, p in fresh])
            admissions: list[MembershipMutation] = []
            opened_at: dict[str, int] = {}
            for (index, plan), message in zip(fresh, committed):
                events = [] if plan.intent.silent else [CommittedEvent(
                    "message.created", message.workspace_id, message.scope_id, message.seq,
                    message.workspace_global_seq, message)]
                outcomes[index] = Outcome(message, events)
                for mutation in plan.membership_mutations:
                    if mutation.member_id not in opened_at:
                        opened_at[mutation.member_id] = message.seq
                        admissions.append(mutation)
            if admissions:
                self._roster_dirty = True
                await applier.apply_membership_mutations(conn, state.workspace_id, state.scope_id, admissions,
                                                         committed[-1].seq, opened_at)
            await self._write_routes(conn, state, fresh, committed, outcomes)
        for index, key in duplicates:
            first_index, first_plan = claimed[key]
            first = outcomes[first_index]
            if isinstance(first, Outcome) and first_plan.digest == _plan_of(plans, index).digest:
                outcomes[index] = Outcome(_as_replay(first.value))
            else:
                outcomes[index] = Conflict("idempotency_conflict", "same client_message_id, different payload")

    async def _check_attachments(self, conn: asyncpg.Connection, state: ScopeContext,
                                 fresh: list[tuple[int, MessagePlan]], outcomes: list[Any]) -> dict[int, list[dict]]:
        """The attachments each message claims (plan index → descriptions), locked until
        commit.  Each must be its author's own finished, unclaimed upload in this scope,
        claimed once in the batch; otherwise the whole message is refused `not_found`,
        whatever the cause (an id of another workspace reveals nothing)."""
        wanted = sorted({a for _, p in fresh for a in p.intent.attachment_ids})
        if not wanted:
            return {}
        locked = await attachment_rows.lock_for_claim(conn, state.workspace_id, state.scope_id, wanted)
        taken: set[str] = set()
        claims: dict[int, list[dict]] = {}
        for index, plan in fresh:
            ids = plan.intent.attachment_ids
            if not ids:
                continue
            found = [locked.get(a) for a in ids]
            if any(row is None or row["workspace_id"] != state.workspace_id or row["scope_id"] != state.scope_id
                   or row["uploaded_by_member_id"] != plan.actor.member_id or row["upload_state"] != "stored"
                   or row["message_id"] is not None or row["id"] in taken for row in found):
                outcomes[index] = Refused("not_found", "attachment not found", "attachment_not_found")
                continue
            taken.update(ids)
            claims[index] = [attachment_rows.info(row) for row in found]
        return claims

    async def _write_routes(self, conn: asyncpg.Connection, state: ScopeContext, fresh: list[tuple[int, MessagePlan]],
                            committed: list[CommittedMessage], outcomes: list[Any]) -> None:
        """Write the deliveries these messages route: the planned ones (authorized
        mentions and recipients, a DM's other member), plus the members in
        auto-wake here, decided now that each message's seq says what a private
        agent reads.  Nothing for an ordinary message nobody is addressed by or
        auto-wakes on."""
        sets: list[tuple[int, deliveries.RouteSet]] = []
        now = None
        for (index, plan), message in zip(fresh, committed):
            if state.type == "task" and self.strand is not None:
                # The author participates from here on: the next message, of this batch too (§8.7).
                self.strand.participants.add(message.author_member_id)
            if plan.intent.silent:
                continue
            routes = list(plan.routes)
            routed = {r.member_id for r in routes}
            candidates = [e for e in self._auto_wake if e.member_id not in routed]
            if candidates:
                readers: Any = ()
                if any(e.visibility == "private" for e in candidates):
                    now = now or await messages.transaction_time(conn)
                    readers = self._message_audience(message.author_member_id, message.seq,
                                                     message.workspace_global_seq, message.created_at)
                routes += routing.auto_wake(message.author_member_id, state.roster.get(message.author_member_id),
                                            candidates, readers, self.authority, now)
            audiences = self._audiences.get(index)
            if audiences:
                routes = _merge_routes(routes, self._audience_routes(state, message.author_member_id, audiences,
                                                                     await self._policies(conn, state)))
            if state.type == "task" and self.strand is not None:
                routes = self._strand_routes(state, message.author_member_id, routes)
            routes = await self._third_party_gate(conn, state, message.author_member_id, routes)
            if routes:
                sets.append((index, deliveries.RouteSet(tuple(routes), message_id=message.id)))
        if state.type == "task":
            await self.open_participants(conn, state, [p.actor.member_id for _, p in fresh])
        if not sets:
            return
        written = await deliveries.write_routes(conn, state.workspace_id, state.scope_id, [s for _, s in sets],
                                                fresh[0][1].actor.execution_generation)
        by_message: dict[str, list[RoutedDelivery]] = {}
        for delivery in written:
            by_message.setdefault(delivery.message_id, []).append(delivery)
        for index, route_set in sets:
            outcomes[index].deliveries = by_message.get(route_set.message_id, [])

    async def _authorize_audiences(self, conn: asyncpg.Connection, state: ScopeContext,
                                   fresh: list[tuple[int, MessagePlan]], outcomes: list[Any]) -> dict[int, str]:
        """strand-message §9.4.4: a send with an audience mention needs the workspace's declared
        policy for each audience (none: disabled), a live broadcast grant of its author on the
        channel (its threads and its boards' strands included), and quota left in the grant's
        period; otherwise the whole message is refused.  Returns plan index → grant used."""
        uses: dict[int, str] = {}
        channel = state.scope_id if state.type == "channel" else state.parent_scope_id
        policies = await strands.audience_policies(conn, state.workspace_id)
        now = self.clock()
        left: dict[str, tuple[str, int] | None] = {}
        # Grant rows are locked in author order: two actors on one channel never wait on each other in a cycle.
        for author in sorted({p.actor.member_id for _, p in fresh if p.audience_mentions}):
            left[author] = (await strands.usable_audience_grant(conn, state.workspace_id, author, channel, now)
                            if channel is not None else None)
        for index, plan in fresh:
            if not plan.audience_mentions:
                continue
            audiences = tuple(audience for _, audience in plan.audience_mentions)
            if any(audience not in policies for audience in audiences):
                outcomes[index] = Refused("forbidden", "audience mentions are disabled here",
                                          "audience_mention_disabled")
                continue
            author = plan.actor.member_id
            grant = left[author]
            if grant is None:
                outcomes[index] = Refused("forbidden", "no broadcast-mention grant covers this scope",
                                          "audience_mention_not_granted")
                continue
            if grant[1] <= 0:
                outcomes[index] = Refused("rate_limited", "the broadcast-mention quota is used up for now",
                                          "audience_mention_quota")
                continue
            left[author] = (grant[0], grant[1] - 1)
            uses[index] = grant[0]
            self._audiences[index] = audiences
        return uses

    def _audience_routes(self, state: ScopeContext, author: str, audiences: tuple[str, ...],
                         max_recipients: dict[str, int]) -> list[Route]:
        """The readers an authorized audience mention reaches (§9.4.3), computed now, at commit.
        Never a private agent (only its owner and those the owner authorized may wake it), never
        the author, never a muted watcher.  Over the policy's max_recipients the mention is
        degraded to plain text: nobody is notified, and the sender's answer is the same, so the
        recipient count never leaks (§9.4.3-§9.4.4)."""
        strand = self.strand

        def notifiable(member_id: str) -> bool:
            entry = state.roster.get(member_id)
            if entry is None or entry.visibility == "private" or entry.notification_state in SILENCED_STATES:
                return False
            watch = strand.watches.get(member_id) if strand is not None else None
            return member_id != author and (watch is None or watch.level != "muted")

        reached: set[str] = set()
        for audience in audiences:
            # The cap counts whom the mention would notify: never a member it can never reach.
            members = {m for m in self._audience_members(state, audience) if notifiable(m)}
            if len(members) > max_recipients.get(audience, 0):
                continue
            reached |= members
        out = []
        for member_id in sorted(reached):
            entry = state.roster[member_id]
            out.append(Route(member_id, AUDIENCE_MENTION, "member",
                             push=entry.notification_state not in UNPUSHED_STATES, reasons=(AUDIENCE_MENTION,)))
        return out

    def _audience_members(self, state: ScopeContext, audience: str) -> set[str]:
        readers = set(state.roster)
        strand = self.strand
        if audience == "effective_scope_members" or strand is None:
            return readers if audience == "effective_scope_members" else set()
        watchers = {m for m, w in strand.watches.items() if w.level in ("participating", "all")}
        participants = set(strand.participants)
        members = {"strand_participants": participants, "strand_watchers": watchers,
                   "strand_engaged": participants | watchers, "assigned_actors": set(strand.assignees)}[audience]
        return members & readers

    def _all_watchers(self, state: ScopeContext, actor: str) -> list[Route]:
        strand = self.strand
        assert strand is not None
        routes = []
        for member_id, watch in sorted(strand.watches.items()):
            entry = state.roster.get(member_id)
            if (watch.level == "all" and member_id != actor and entry is not None and entry.visibility == "public"
                    and entry.notification_state not in SILENCED_STATES):
                routes.append(Route(member_id, REACTION, "member", push=entry.notification_state not in UNPUSHED_STATES,
                                    reasons=(REACTION, WATCH)))
        return routes

    def _strand_routes(self, state: ScopeContext, author: str, routes: list[Route]) -> list[Route]:
        """A strand's watchers (strand-message §8.2, §8.7): effective level `all` or
        `participating` (explicit, or implied by an assignment or an own visible message)
        hear of every new message; `muted` silences everything, mentions included.
        A member picked for several reasons gets one delivery listing them all (§9.4.2).
        An agent watcher hears only of humans' messages, as with auto-wake."""
        strand = self.strand
        author_entry = state.roster.get(author)
        author_kind = author_entry.kind if author_entry is not None else "service"
        assert strand is not None
        by_member = {r.member_id: r for r in routes}
        out: list[Route] = []
        # Everyone else is at mentions_only with nothing addressed: not a route (O(watchers), not O(readers)).
        candidates = set(strand.watches) | strand.assignees | strand.participants | set(by_member)
        for member_id in sorted(candidates):
            entry = state.roster.get(member_id)
            if member_id == author or entry is None:
                continue
            watch = strand.watches.get(member_id)
            level = effective_level(watch.level if watch is not None else None,
                                    member_id in strand.assignees or member_id in strand.participants)
            addressed = by_member.pop(member_id, None)
            if level == "muted":
                continue
            watching = level in ("all", "participating") and entry.notification_state not in SILENCED_STATES
            if entry.visibility == "private":
                watching = False  # a private agent hears only what authority addresses to it (policy.can_address)
            elif watching and entry.kind == "agent" and author_kind != "human":
                watching = False  # agents and services never wake a watching agent: no wake loops
            if addressed is not None:
                known = addressed.reasons or (addressed.reason,)
                reasons = tuple(dict.fromkeys((*known, WATCH))) if watching else known
                out.append(dataclasses.replace(addressed, reasons=reasons))
            elif watching:
                out.append(Route(member_id, WATCH, "member", push=entry.notification_state not in UNPUSHED_STATES,
                                 reasons=(WATCH,)))
        return out + list(by_member.values())

    async def _policies(self, conn: asyncpg.Connection, state: ScopeContext) -> dict[str, int]:
        return await strands.audience_policies(conn, state.workspace_id)

    async def _third_party_gate(self, conn: asyncpg.Connection, state: ScopeContext, author: str,
                                routes: list[Route]) -> list[Route]:
        """strand-message §9.4.5: a public agent hears of a mention (direct or audience) by
        someone other than its owner only while its owner's selection, and the strand's
        ceiling, accept third-party mentions.  Judged once, at commit: later changes neither
        add nor withdraw deliveries."""
        agents = [r.member_id for r in routes
                  if (entry := state.roster.get(r.member_id)) is not None and entry.kind == "agent"
                  and entry.visibility == "public" and {r.reason, *r.reasons} & _MENTION_REASONS]
        if not agents:
            return routes
        gate = await strands.mention_gate(conn, state.workspace_id, agents)
        accepts = {agent: accepted for agent, (_, accepted) in gate.items()}
        owners = {agent: owner for agent, (owner, _) in gate.items()}
        ceiling = self.strand.row["accept_third_party_mention"] if self.strand is not None else None
        out = []
        for route in routes:
            if route.member_id in accepts and owners.get(route.member_id) != author and (
                    not accepts[route.member_id] or ceiling is False):
                kept = tuple(r for r in (route.reasons or (route.reason,)) if r not in _MENTION_REASONS)
                if not kept:
                    continue
                route = dataclasses.replace(route, reason=kept[0], reasons=kept)
            out.append(route)
        return out

    def _private_readers_here(self) -> bool:
        """Whether any private agent may be addressed here (in this scope or, for a thread, its parent)."""
        return bool(self._private_readers) or (self.parent is not None and any(
            e.visibility == "private" for e in self.parent.roster.values()))

    async def _ensure_executions(self, conn: asyncpg.Connection, state: ScopeContext,
                                 plans: list[MessagePlan]) -> None:
        """The first owner/grantee/collaborator wake of an owner's private agent, or
        the owner's first owner_quote, here creates the owner's Scope Execution
        (collaborator-policy §3.0); ordinary messages never do."""
        if state.type not in ("channel", "thread"):
            return
        for plan in plans:
            for owner, trigger in plan.executions:
                if owner not in self._executions and owner not in self._executions_in_batch:
                    await private_authority.ensure_execution(conn, state.workspace_id, owner, state.scope_id,
                                                             state.type, trigger)
                    self._executions_in_batch.add(owner)

    async def _apply_other(self, conn: asyncpg.Connection, state: ScopeContext, command: Command) -> Outcome:
        handler = _DISPATCH.get(type(command))
        if handler is None:
            domain = DOMAIN_COMMANDS.get(type(command))
            if domain is None:
                raise AssertionError(f"no handler for {type(command).__name__}")
            outcome = await domain(self, conn, state, command)
            if outcome.authority_changed:
                # Grants and collaborators are message-attention eligibility: the
                # roster generation moves (thread actors below re-read theirs).
                await applier.bump_roster_generation(conn, state.scope_id)
                self._authority_dirty = True
            return outcome
        if command.requires_membership and command.actor.member_id not in state.roster:
            raise Refused("forbidden", "not a member of this scope", "not_a_member")
        return await handler(self, conn, state, command)

    # --- roster writes other domains' commands ask for (this actor stays the scope's only roster writer) ----

    async def open_members(self, conn: asyncpg.Connection, state: ScopeContext, member_ids: list[str]) -> None:
        """Open public memberships at the tail (a new member reads the history, owes none of it)."""
        if member_ids:
            await applier.bulk_open_memberships(conn, state.workspace_id, state.scope_id, member_ids)
            self._roster_dirty = True

    async def close_members(self, conn: asyncpg.Connection, state: ScopeContext, member_ids: list[str]) -> None:
        if member_ids:
            await applier.apply_membership_mutations(conn, state.workspace_id, state.scope_id,
                                                     [MembershipMutation(m, "close") for m in member_ids],
                                                     state.latest_seq)
            self._roster_dirty = True

    async def refresh_task_authority(self, conn: asyncpg.Connection) -> None:
        await self._refresh_parent(conn)

    async def open_participants(self, conn: asyncpg.Connection, state: ScopeContext, member_ids: list[str]) -> None:
        """A task's state-only rows (read cursor, Inbox) for authorized members who lack one
        (a private agent's admission is its row)."""
        known = self.strand.participant_rows if self.strand is not None else set()
        missing = sorted(m for m in set(member_ids) - known
                         if (entry := state.roster.get(m)) is None or entry.visibility != "private")
        if missing:
            await applier.open_participant_rows(conn, state.workspace_id, state.scope_id, missing)
            self._roster_dirty = True  # known after the reload that follows the commit

    def forget_state(self) -> None:
        """Another transaction erased this scope (a platform account's delete): reload after this batch."""
        self._roster_dirty = True

    async def erase_scope(self, conn: asyncpg.Connection, state: ScopeContext) -> None:
        """Delete the scope and everything in it for good; the actor serves nothing after commit."""
        await deliveries.delete_for_scope(conn, state.scope_id)
        await applier.delete_scope(conn, state.scope_id)
        self._roster_dirty = True  # the reload after commit finds no scope

    async def _refuse_create(self, conn: asyncpg.Connection, state: ScopeContext, command: CreateScope) -> Outcome:
        raise Conflict("scope_exists", "the scope exists")

    async def _edit(self, conn: asyncpg.Connection, state: ScopeContext, command: Edit) -> Outcome:
        actor = command.actor
        current = await messages.committed_message(conn, state.scope_id, command.message_id)
        if current is not None and current.author_member_id != actor.member_id:
            raise Refused("forbidden", "only the author edits a message", "not_author")
        plan = None
        if current is not None and current.message_type in _MENTIONING_TYPES and current.state == "visible":
            plan = await self._plan_edit(conn, state, actor, current.message_type, command.content)
        metadata = None
        if plan is not None and current is not None:
            metadata = {k: v for k, v in current.metadata.items() if k not in ("mentions", "audience_mentions")}
            if plan.live_mentions:
                metadata["mentions"] = list(plan.live_mentions)
            # Authorized when sent: an edit keeps those its text still holds and never adds one (§9.4.4).
            still_there = {audience for _, audience in plan.audience_mentions}
            kept = [m for m in current.metadata.get("audience_mentions", ()) if m["audience"] in still_there]
            if kept:
                metadata["audience_mentions"] = kept
        row = await applier.edit_message(conn, state.scope_id, command.message_id, actor.member_id,
                                         command.content, command.expected_revision, actor.execution_generation,
                                         metadata)
        if row["author_member_id"] != actor.member_id:
            raise Refused("forbidden", "only the author edits a message", "not_author")
        outcome = Outcome(row)
        if plan is not None and current is not None:
            # strand-message §9.4.2: a revision notifies only the members it newly mentions.
            before = set(current.metadata.get("mentions", ()))
            # An edit admits nobody into a thread: only members already in the scope are woken.
            routes = [r for r in plan.routes if r.reason == "mention" and r.member_id not in before
                      and r.member_id in state.roster]
            if routes and state.type == "task" and self.strand is not None:
                routes = [r for r in self._strand_routes(state, actor.member_id, routes)
                          if r.member_id not in before and "mention" in (r.reasons or (r.reason,))]
            if routes:
                routes = await self._third_party_gate(conn, state, actor.member_id, routes)
                already = await deliveries.message_recipients(conn, state.scope_id, command.message_id)
                routes = [dataclasses.replace(r, reason="mention", reasons=("mention",))
                          for r in routes if r.member_id not in already]
            if routes:
                outcome.deliveries = await deliveries.write_routes(
                    conn, state.workspace_id, state.scope_id,
                    [deliveries.RouteSet(tuple(routes), message_id=command.message_id, revision=row["revision"])],
                    actor.execution_generation)
        return outcome

    async def _plan_edit(self, conn: asyncpg.Connection, state: ScopeContext, actor: ActorContext,
                         message_type: str, content: str) -> MessagePlan | None:
        """The live mentions of an edited text, decided as a send's would be (None: none count)."""
        intent = MessageIntent(scope_id=state.scope_id, content=content, message_type=message_type)
        try:
            handles = sorted(set(mention_handles(intent)))
        except TooManyRoutingTokens:
            raise Refused("invalid", "too many mentions", "too_many_mentions") from None
        candidates = await messages.mention_candidates(conn, state.workspace_id, handles) if handles else {}
        now = await messages.transaction_time(conn) if self._private_readers_here() else None
        try:
            return plan_message(intent, actor, state, candidates, self.parent, self.authority, now)
        except PlanRefused:
            return None

    async def _withdraw(self, conn: asyncpg.Connection, state: ScopeContext, command: Withdraw) -> Outcome:
        actor = command.actor
        row = await applier.withdraw_message(conn, state.scope_id, command.message_id, actor.member_id,
                                             actor.execution_generation)
        if state.type == "task":
            self._roster_dirty = True  # a withdrawn message no longer makes its author a participant
        if row["author_member_id"] != actor.member_id:
            raise Refused("forbidden", "only the author withdraws a message", "not_author")
        return Outcome(row)

    async def _react(self, conn: asyncpg.Connection, state: ScopeContext, command: React) -> Outcome:
        actor = command.actor
        if state.type == "task" and state.status != "active":
            raise Refused("conflict", "the strand is archived", "scope_archived")  # SPEC §5 decision 11
        changed, message, activity_event_id = await applier.set_reaction(
            conn, state.workspace_id, state.scope_id, command.message_id, actor.member_id, command.key, command.add)
        # Bound by the message: a private agent hears of reactions only on what it reads.
        author = state.roster.get(message["author_member_id"])
        if any(r.effective_from_seq > message["seq"] for r in self._private_readers) or (
                author is not None and author.visibility == "private" and author.effective_from_seq > message["seq"]):
            # Older than an open interval: only the predicate knows the closed ones (one query, reactions only).
            audience = await visibility.entitled_for_message(conn, state.scope_id, command.message_id)
        else:
            audience = self._message_audience(message["author_member_id"], message["seq"],
                                              message["workspace_global_seq"], message["created_at"])
        event = CommittedEvent("reaction.added" if command.add else "reaction.removed", state.workspace_id,
                               state.scope_id, None, None,
                               {"message_id": command.message_id, "key": command.key, "member_id": actor.member_id},
                               audience=audience)
        outcome = Outcome({"changed": changed}, [event] if changed else [])
        if changed and state.type == "task" and self.strand is not None:
            # In a strand a reaction (added or removed) notifies only its `all` watchers (§9.8.6).
            routes = tuple(self._all_watchers(state, actor.member_id))
            if routes:
                await deliveries.write_routes(conn, state.workspace_id, state.scope_id, [deliveries.RouteSet(
                    routes, message_id=command.message_id, activity_event_id=activity_event_id)],
                    actor.execution_generation)
                outcome.wakes_worker = True
        elif changed and command.add:
            author = state.roster.get(message["author_member_id"])
            private = author is not None and author.visibility == "private"
            now = await messages.transaction_time(conn) if private else None
            route, _ = routing.reaction(actor.member_id, state.roster.get(actor.member_id), author, self.authority, now)
            if route is not None:
                # worker_first_targeted: the outbox worker hands it out after commit.
                await deliveries.write_routes(conn, state.workspace_id, state.scope_id, [deliveries.RouteSet(
                    (route,), message_id=command.message_id, activity_event_id=activity_event_id)],
                    actor.execution_generation)
                outcome.wakes_worker = True
        return outcome

    async def _mark_read(self, conn: asyncpg.Connection, state: ScopeContext, command: MarkRead) -> Outcome:
        actor = command.actor
        if state.type == "task":
            await self.open_participants(conn, state, [actor.member_id])
        if command.unread:
            value = await applier.mark_unread(conn, state.workspace_id, state.scope_id, actor.member_id, command.seq)
        else:
            value = await applier.mark_read(conn, state.scope_id, actor.member_id, command.seq)
        event = CommittedEvent("read_state.changed", state.workspace_id, state.scope_id, None, None,
                               {"member_id": actor.member_id, "last_read_seq": value, "manual_unread": command.unread},
                               audience=frozenset({actor.member_id}))
        return Outcome({"last_read_seq": value}, [event])

    async def _set_notification(self, conn: asyncpg.Connection, state: ScopeContext,
                                command: SetNotification) -> Outcome:
        member_id = command.member_id or command.actor.member_id
        if member_id not in state.roster:
            if member_id == command.actor.member_id:
                raise Refused("forbidden", "not a member of this scope", "not_a_member")
            raise NotFound("membership")
        await applier.set_notification_state(conn, state.workspace_id, state.scope_id, member_id, command.state)
        await applier.apply_membership_mutations(conn, state.workspace_id, state.scope_id, [], state.latest_seq)
        self._roster_dirty = True  # the cached roster carries the state routing reads
        return Outcome({"state": command.state}, [CommittedEvent(
            "inbox.changed", state.workspace_id, state.scope_id, None, None,
            {"member_id": member_id, "notification_state": command.state},
            audience=frozenset({member_id, command.actor.member_id}))])

    async def _archive(self, conn: asyncpg.Connection, state: ScopeContext, command: Archive) -> Outcome:
        _refuse_fixed_audience(state)
        await applier.archive_scope(conn, state.scope_id)
        return Outcome({"status": "archived"}, [CommittedEvent("scope.archived", state.workspace_id,
                                                                state.scope_id, None, None, {})])

    async def _change_members(self, conn: asyncpg.Connection, state: ScopeContext, command: ChangeMembers) -> Outcome:
        _refuse_fixed_audience(state)
        actor = command.actor
        mutations: list[MembershipMutation] = []
        await self._refresh_parent(conn)
        parent = self.parent
        for member_id in command.member_ids:
            if command.action in ("leave", "remove"):
                if member_id not in state.roster:
                    raise NotFound("membership")
                if command.action == "remove" and actor.member_id not in state.roster:
                    raise Refused("forbidden", "not a member of this scope", "not_a_member")
                if command.action == "leave" and member_id != actor.member_id:
                    raise Refused("forbidden", "leave removes yourself only", "not_self")
                mutations.append(MembershipMutation(member_id, "close"))
                continue
            if command.action == "join_thread":
                # Replying in a thread joins it, for anyone who reads the parent.
                if parent is None or member_id != actor.member_id or member_id not in parent.roster:
                    raise Refused("forbidden", "not a member of the parent scope", "not_in_parent")
                if member_id in state.roster:
                    raise Refused("conflict", "already a member", "already_member")
                entry = parent.roster[member_id]
                if entry.visibility == "private":
                    # scope-model.md §5.2: a private agent enters a thread only when it is
                    # addressed there with authority (or wrote the root), never on its own.
                    raise Refused("forbidden", "a private agent joins a thread only when addressed there",
                                  "private_agent_not_admitted")
                mutations.append(MembershipMutation(member_id, "open", entry.visibility, entry.owner_member_id))
                continue
            candidate = await messages.member_candidate(conn, state.workspace_id, member_id)
            private = candidate.kind == "agent" and candidate.visibility == "private"
            if command.action == "reopen_dm":
                # A DM's roster is its pair (the caller found this DM by the pair's key):
                # a member of the pair who is active again gets a new interval.
                if state.type != "dm" or candidate.status != "active" or member_id in state.roster:
                    raise Refused("conflict", "the DM membership cannot be reopened", "not_reopenable")
                mutations.append(MembershipMutation(member_id, "open", "private" if private else "public",
                                                    candidate.owner_member_id if private else None))
                continue
            decision = can_add_member(actor, state, candidate, parent)
            if not decision.allowed:
                code = "conflict" if decision.reason == "already_member" else "forbidden"
                raise Refused(code, f"cannot add member: {decision.reason}", decision.reason)
            mutations.append(MembershipMutation(member_id, "open", "private" if private else "public",
                                                candidate.owner_member_id if private else None))
        generation = await applier.apply_membership_mutations(conn, state.workspace_id, state.scope_id, mutations,
                                                              state.latest_seq)
        events = [_membership_changed(state.workspace_id, state.scope_id, m, generation, state.roster.get(m.member_id))
                  for m in mutations]
        return Outcome({"roster_generation": generation}, events)

    async def _close_departed(self, conn: asyncpg.Connection, state: ScopeContext,
                              command: CloseDeparted) -> Outcome:
        departed = await visibility.departed_among(conn, state.workspace_id, state.scope_id, list(command.member_ids))
        if not departed:
            return Outcome({"closed": []})
        generation = await applier.apply_membership_mutations(
            conn, state.workspace_id, state.scope_id, [MembershipMutation(m, "close") for m in departed],
            state.latest_seq)
        return Outcome({"closed": departed}, [
            _membership_changed(state.workspace_id, state.scope_id, MembershipMutation(m, "close"), generation,
                                state.roster.get(m), reason="departed")
            for m in departed])


def _refuse_fixed_audience(state: ScopeContext) -> None:
    """A service account's roster is its audience reconciler's alone (service-account §3.1); a
    strand's readers are its board channel's members (collaborator-policy §4.2.1)."""
    if state.type == "service_account":
        raise Refused("forbidden", "a service account's audience is every active human", "fixed_audience")
    if state.type == "task":
        raise Refused("forbidden", "a strand's readers are its board channel's members; archive it with "
                      "strand.archive", "task_readers_from_board")


def _membership_changed(workspace_id: str, scope_id: str, mutation: MembershipMutation, generation: int,
                        closing: RosterEntry | None = None, reason: str | None = None) -> CommittedEvent:
    """A membership.changed event; it says whether the membership is private (and
    whose), so a public member list can leave private members out (scope-model §3.3)."""
    visibility, owner = ((closing.visibility, closing.owner_member_id) if mutation.action == "close" and closing
                         else (mutation.visibility, mutation.owner_member_id))
    data = {"member_id": mutation.member_id, "action": mutation.action, "roster_generation": generation,
            "visibility": visibility}
    if owner is not None:
        data["owner_member_id"] = owner
    if reason is not None:
        data["reason"] = reason
    return CommittedEvent("membership.changed", workspace_id, scope_id, None, None, data)


# Client-written message types: an edit of one re-reads its live mentions.
_MENTIONING_TYPES = frozenset({"text", "markdown"})

# The reasons the third-party mention gate governs.
_MENTION_REASONS = frozenset({"mention", "recipient", "audience_mention"})


def _merge_routes(first: list[Route], more: list[Route]) -> list[Route]:
    """One route per member: the first reason stays `reason`, every reason is listed."""
    by_member = {r.member_id: r for r in first}
    for route in more:
        known = by_member.get(route.member_id)
        if known is None:
            by_member[route.member_id] = route
        else:
            reasons = tuple(dict.fromkeys((*(known.reasons or (known.reason,)), *route.reasons)))
            by_member[route.member_id] = dataclasses.replace(known, reasons=reasons)
    return list(by_member.values())


class MessageAudience:
    """The members entitled to one message's events: every public member plus the
    private agents that may read it (the hub only asks `member in audience`).
    A private agent is judged when first asked about: a message costs the readers
    that follow it, not every private agent of a big scope."""

    __slots__ = ("public", "_private", "_reads", "_decided")

    def __init__(self, public: frozenset[str], private: dict[str, RosterEntry],
                 reads: Callable[[RosterEntry], bool]) -> None:
        self.public, self._private, self._reads = public, private, reads
        self._decided: dict[str, bool] = {}

    @property
    def generation(self) -> int | None:
        return self.public.generation if isinstance(self.public, Roster) else None

    def private_readers(self, limit: int) -> list[str] | None:
        """The private members entitled to it (None: more than `limit` private members)."""
        if len(self._private) > limit:
            return None
        return sorted(member_id for member_id in self._private if member_id in self)

    def __contains__(self, member_id: object) -> bool:
        if member_id in self.public:
            return True
        reader = self._private.get(member_id)  # type: ignore[call-overload]
        if reader is None:
            return False
        verdict = self._decided.get(reader.member_id)
        if verdict is None:
            verdict = self._decided[reader.member_id] = self._reads(reader)
        return verdict


# The actor's own commands (Send runs batched in _apply_sends); other domains
# register theirs in DOMAIN_COMMANDS (see register_command).
_DISPATCH: dict[type[Command], Callable[..., Any]] = {
    CreateScope: ScopeActor._refuse_create,
    ChangeMembers: ScopeActor._change_members,
    CloseDeparted: ScopeActor._close_departed,
    Edit: ScopeActor._edit,
    Withdraw: ScopeActor._withdraw,
    React: ScopeActor._react,
    MarkRead: ScopeActor._mark_read,
    SetNotification: ScopeActor._set_notification,
    Archive: ScopeActor._archive,
}

# Commands another domain module defines and handles inside this actor's batch
# transaction (a savepoint each): handler(actor, conn, state, command) -> Outcome.
DOMAIN_COMMANDS: dict[type[Command], Callable[..., Any]] = {}


def register_command(command_type: type[Command]):
    """Decorator: `command_type` is handled by the decorated function in the scope's actor."""
    def decorate(handler):
        DOMAIN_COMMANDS[command_type] = handler
        return handler
    return decorate


# Proof digests a scope actor keeps (`ScopeActor._proof_digests`): one per sender's cached context.
_PROOF_DIGESTS_KEPT = 4096


def _safe_handles(intent: MessageIntent) -> tuple[str, ...]:
    try:
        return mention_handles(intent)
    except TooManyRoutingTokens:
        return ()


def _plan_of(plans: list[tuple[int, MessagePlan]], index: int) -> MessagePlan:
    return next(p for i, p in plans if i == index)


def _as_replay(message: CommittedMessage) -> CommittedMessage:
    return dataclasses.replace(message, replayed=True)

