"""PlatformAccountActor (service-account §2.4, §4.5): one trio task per platform
service account, the only writer of its acceptance ordinals, broadcast seqs,
workspace-instance intervals and delivery leases.  Each step below is one
bounded transaction under the account's root lock, so a crash resumes from the
rows: provisioning by workspace-id cursor, head-of-line seq allocation,
enumeration by workspace-id cursor, and leases that expire.

Commands arrive over a trio memory channel; between them the actor advances
whatever work the rows show, then sleeps until a command, a wake (NOTIFY: a
workspace was created, an instance became ready) or the next backoff or lease
expiry.  Deliveries run concurrently (bounded) as PlatformDelivery commands in
the local scopes' actors, which check the lease in the message transaction.

With several nodes, one node's actor owns an account (storage/leases.py): every
transaction above first passes the account's lease fence, and the other nodes
forward their commands to the owner (PlatformRegistry.submit)."""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import asyncpg
import trio
from asyncpg.exceptions import TransactionRollbackError

from actors.platform_delivery import PlatformDelivery
from actors.registry import FORWARD_RETRY_FIRST_SECONDS, FORWARD_RETRY_MAX_SECONDS
from actors.scope_actor import ActorFailed, Forwardable, Refused, Reply
from domain.platform import BroadcastSnapshot, Lease, client_message_id
from domain.plan import ActorContext
from storage import leases
from storage import platform as store
from storage import platform_assets
from storage.errors import DatabaseUnavailable, LeaseLost, NotFound, StorageError
from storage.ids import new_id

log = logging.getLogger("scopewire.platform")

SYSTEM_MEMBER = "system"
PROVISION_BATCH = 50  # workspaces opened per provisioning transaction
ENUMERATION_PAGE = 500  # deliveries written per enumeration transaction
PROFILE_BATCH = 200
IDLE_RECHECK_SECONDS = 30.0  # a periodic look at the rows, whatever woke or did not wake us
OWNER_SEARCH_SECONDS = 30.0  # how long a command looks for the account's owner while the lease moves


@dataclass(frozen=True)
class PlatformSettings:
    delivery_concurrency: int = 16
    lease_seconds: float = 30.0
    max_attempts: int = 8
    retry_base_seconds: float = 1.0


@dataclass
class PlatformServices:
    """What an actor needs from the process: the database, the scope actors, this node's id, and where
    its events go (`emit(event, **ids)`, the server's projection to operators and workspaces)."""

    db: Any
    scopes: Any  # actors.registry.ScopeRegistry
    node_id: str
    settings: PlatformSettings
    emit: Callable[..., Awaitable[None]]
    # actors.registry.Ownership (its acquire/forward for platform accounts); None: no leases.
    ownership: Any = None


@dataclass
class PlatformCommand(Forwardable):
    reply: Reply = field(default_factory=Reply, init=False)


@dataclass
class AcceptBroadcast(PlatformCommand):
    operator_id: str
    client_broadcast_id: str
    title: str
    content: str
    message_type: str
    correlation_id: str
    asset_ids: tuple[str, ...] = ()


@dataclass
class UpdateProfile(PlatformCommand):
    expected_version: int
    name: str | None
    description: str | None
    operator_id: str
    correlation_id: str


@dataclass
class DeleteAccount(PlatformCommand):
    expected_version: int
    operator_id: str
    correlation_id: str


@dataclass
class RetryDelivery(PlatformCommand):
    delivery_id: str
    expected_version: int
    operator_id: str
    correlation_id: str


@dataclass
class SettleSkip(PlatformCommand):
    delivery_id: str
    expected_version: int
    operator_id: str
    correlation_id: str


class PlatformAccountActor:
    def __init__(self, account_id: str, services: PlatformServices,
                 lease: tuple[str, int] | None = None) -> None:
        self.account_id = account_id
        self.lease = lease  # (node, epoch) every write transaction is fenced by; None: no leases
        self.lease_lost = False
        self.stopped = False
        self.draining = False  # a clean shutdown: the commands queued finish, no pass starts
        self.services = services
        self.db = services.db
        self.settings = services.settings
        self.mailbox, self._inbox = trio.open_memory_channel[PlatformCommand](64)
        self._wake = trio.Event()
        # A full pass (provisioning, numbering, enumeration) is due: a command, a NOTIFY or the timer.
        # A finished delivery wakes only the dispatch part.
        self._full_pass_due = True
        self.deleted = False
        self._snapshots: dict[str, BroadcastSnapshot] = {}
        self._in_flight = 0
        self._settled_since_check = False
        # Instances whose ready state is still to be announced (id -> workspace id); None until
        # the first provisioning step reads them.
        self._unready_instances: dict[str, str] | None = None
        self._delivery_slots = trio.CapacityLimiter(self.settings.delivery_concurrency)
        # Dispatch table: one handler per command type.
        self._handlers: dict[type, Callable[[Any], Awaitable[Any]]] = {
            AcceptBroadcast: self._accept, UpdateProfile: self._update, DeleteAccount: self._delete,
            RetryDelivery: self._retry, SettleSkip: self._settle_skip,
        }

    def wake(self) -> None:
        self._full_pass_due = True
        self._wake.set()

    async def submit(self, command: PlatformCommand) -> Any:
        try:
            await self.mailbox.send(command)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._stopped_error() from None
        return await command.reply.wait()

    def drain(self) -> None:
        """Stop after the commands already queued (a clean shutdown)."""
        self.draining = True
        self._wake.set()

    def _stopped_error(self) -> StorageError:
        if self.lease_lost or self.draining:  # the registry runs the command at the (next) owner
            return LeaseLost(f"this node no longer owns platform account {self.account_id}")
        return DatabaseUnavailable("the platform account's actor stopped; retry")

    async def _write(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """`fn` in one transaction, behind the account's lease fence when leases are on."""
        if self.lease is None:
            return await self.db.transaction(fn, *args, **kwargs)
        node_id, epoch = self.lease

        async def fenced(conn) -> Any:
            await leases.pass_fence(conn, self.account_id, node_id, epoch, kind=leases.PLATFORM_ACCOUNTS)
            return await fn(conn, *args, **kwargs)
        try:
            return await self.db.transaction(fenced)
        except LeaseLost:
            self.lease_lost = True
            self._wake.set()  # the advance loop ends now, not at its next timer
            raise

    async def run(self) -> None:
        """Commands and the rows' work run side by side (a command never waits for a pass of
        deliveries); both write under the account's root row lock, which orders them."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve_commands, nursery.cancel_scope)
                await self._advance_loop()
                # The account is gone (or another node took it, or this node is shutting down): no
                # new command; the one being handled still answers (its transaction may have
                # committed), the queued ones run (or meet the missing row or the fence, and the
                # registry runs them at the new owner).
                self.mailbox.close()
        finally:
            self.stopped = True
            self.mailbox.close()
            while True:
                try:
                    self._inbox.receive_nowait().reply.fail(self._stopped_error())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break

    async def _advance_loop(self) -> None:
        failures = 0
        async with trio.open_nursery() as deliveries:
            while not self.deleted and not self.lease_lost and not self.draining:
                self._wake = trio.Event()
                full, self._full_pass_due = self._full_pass_due, False
                try:
                    progressed, full_work_progressed = await self._advance(full, deliveries)
                    failures = 0
                except NotFound:
                    break  # deleted (here or by another process): nothing is left to advance
                except LeaseLost:
                    log.info("platform account taken over by another node",
                             extra={"platform_service_account_id": self.account_id})
                    break
                except (StorageError, asyncpg.PostgresError) as exc:
                    failures += 1
                    log.warning("platform account step failed; retrying", extra={
                        "platform_service_account_id": self.account_id, "error": str(exc)})
                    progressed = full_work_progressed = False
                if progressed:
                    # Another full pass only while its own steps move (more to provision, number or
                    # enumerate); deliveries alone need only the dispatch part.
                    self._full_pass_due = self._full_pass_due or full_work_progressed
                    continue
                if not await self._sleep(failures):
                    self._full_pass_due = True  # the timer: look at every kind of work again
            if not self.draining:
                deliveries.cancel_scope.cancel()
            # Draining, the deliveries leased here run to the end: cancelled, their leases would keep
            # them from the next owner until they expire.

    async def _sleep(self, failures: int) -> bool:
        """Until woken (True) or the next timed work is due (False)."""
        if failures:
            timeout = min(IDLE_RECHECK_SECONDS, 0.5 * 2 ** failures)  # a failing step backs off
        elif self._in_flight:
            timeout = 1.0  # finishing deliveries wake us; a backoff ending meanwhile waits at most this
        else:
            try:
                due = await self.db.run(store.next_due_seconds, self.account_id)
            except StorageError:
                due = None
            timeout = IDLE_RECHECK_SECONDS if due is None else min(IDLE_RECHECK_SECONDS, due + 0.05)
        with trio.move_on_after(timeout):
            await self._wake.wait()
            return True
        return False

    async def _serve_commands(self, cancel_scope: trio.CancelScope) -> None:
        async for command in self._inbox:
            try:
                command.reply.set(await self._handlers[type(command)](command))
            except TransactionRollbackError:
                command.reply.fail(DatabaseUnavailable("the transaction met a concurrent one; retry"))
            except (Refused, StorageError, asyncpg.PostgresError) as exc:
                command.reply.fail(exc)
            except Exception as exc:  # a bug: the caller answers `internal`, the actor lives on
                log.exception("platform command failed", extra={"platform_service_account_id": self.account_id})
                command.reply.fail(ActorFailed(str(exc)))
            finally:  # cancelled mid-command (shutdown): the caller is answered, never left waiting
                command.reply.fail(self._stopped_error())
            if self.deleted or self.lease_lost:
                cancel_scope.cancel()
                return
            self.wake()

    # --- commands ------------------------------------------------------------------------------------

    async def _accept(self, command: AcceptBroadcast) -> store.Accepted:
        return await self._write(
            store.accept_broadcast, account_id=self.account_id, operator_id=command.operator_id,
            client_broadcast_id=command.client_broadcast_id, title=command.title, content=command.content,
            message_type=command.message_type, correlation_id=command.correlation_id, asset_ids=command.asset_ids)

    async def _update(self, command: UpdateProfile) -> Any:
        return await self._write(store.update_profile, self.account_id, command.expected_version,
                                         command.name, command.description, command.operator_id,
                                         command.correlation_id)

    async def _delete(self, command: DeleteAccount) -> Any:
        root, locals_ = await self._write(store.delete_account, self.account_id, command.expected_version,
                                                  command.operator_id, command.correlation_id)
        self.deleted = True
        return root, locals_

    async def _retry(self, command: RetryDelivery) -> Any:
        return await self._write(store.retry_delivery, command.delivery_id, command.expected_version,
                                         command.operator_id, command.correlation_id)

    async def _settle_skip(self, command: SettleSkip) -> Any:
        row = await self.db.run(store.delivery, command.delivery_id)
        return await self._write(store.settle_skip, command.delivery_id, command.expected_version,
                                         command.operator_id, command.correlation_id,
                                         client_message_id(row["broadcast_id"]))

    # --- advancing the rows ------------------------------------------------------------------------------

    async def _advance(self, full: bool, deliveries: trio.Nursery) -> tuple[bool, bool]:
        """One bounded step of each kind of work due: (whether any moved, whether a step of the
        full pass moved or a broadcast finished) — there may be more."""
        correlation = new_id("req")
        full_work = False
        if full:
            full_work |= await self._provision(correlation)
            full_work |= await self._profile()
            full_work |= bool(await self._write(store.allocate_step, self.account_id, correlation))
            full_work |= await self._write(store.enumerate_step, self.account_id, ENUMERATION_PAGE)
            # Excluded rows come only from enumeration: an instance excluded from a seq opened after its G,
            # so it is excluded from every earlier seq too and its excluded rows precede its eligible ones.
            full_work |= bool(await self._write(store.settle_excluded_heads, self.account_id, new_id("req")))
        settled, self._settled_since_check = self._settled_since_check, False
        dispatched = await self._dispatch(deliveries)
        if full or (settled and self._in_flight == 0):
            finished = await self._write(store.finish_broadcasts, self.account_id, correlation)
            for broadcast_id in finished:
                self._snapshots.pop(broadcast_id, None)
                await self._emit("platform_service_account.broadcast_completed", broadcast_id=broadcast_id)
            full_work |= bool(finished)
        elif settled:
            self._settled_since_check = True  # checked once the deliveries in flight are done
        return full_work or dispatched, full_work

    async def _provision(self, correlation: str) -> bool:
        # A step that fails may still have committed: the next one rereads every instance not ready.
        watching, self._unready_instances = self._unready_instances, None
        step = await self._write(store.provision_step, self.account_id, PROVISION_BATCH, correlation, watching)
        self._unready_instances = step.unready
        for instance in step.opened:
            await self._emit("platform_service_account.instance_changed", account_id=self.account_id,
                             workspace_id=instance["workspace_id"], provisioning_state="identity_ready",
                             local_service_account_id=instance["local_service_account_id"])
        # Announced here, not by the audience reconcile that made them ready (its NOTIFY wakes this
        # actor), so an operator sees an instance's states in the order they happened.
        for workspace_id in step.now_ready.values():
            await self._emit("platform_service_account.instance_changed", account_id=self.account_id,
                             workspace_id=workspace_id, provisioning_state="ready")
        if step.became_ready:
            await self._emit("platform_service_account.updated", account_id=self.account_id)
        return bool(step.opened) or step.became_ready or step.more

    async def _profile(self) -> bool:
        changed = await self._write(store.propagate_profile_step, self.account_id, PROFILE_BATCH)
        for local in changed:
            await self._emit("service_account.updated", workspace_id=local["workspace_id"], local=local)
        return bool(changed)

    async def _dispatch(self, deliveries: trio.Nursery) -> bool:
        """Lease due heads into free delivery slots: up to three times the concurrency in flight,
        topped up a concurrency's worth at a time — so while one page runs, the next two are
        leased with their scope actors started (a page of cold actors takes about as long to
        start as a page takes to deliver)."""
        page = self.settings.delivery_concurrency
        room = 3 * page - self._in_flight
        if room < page and self._in_flight:
            return False
        heads = await self._write(store.lease_heads, self.account_id, self.services.node_id,
                                           self.settings.lease_seconds, room)
        # The local scopes are mostly quiet ones: their actors start with one lease transaction for all.
        await self.services.scopes.start_many([lease.local_scope_id for lease in heads])
        for lease in heads:
            self._in_flight += 1
            deliveries.start_soon(self._deliver, lease)
        return bool(heads)

    async def _snapshot(self, broadcast_id: str) -> BroadcastSnapshot:
        snapshot = self._snapshots.get(broadcast_id)
        if snapshot is None:
            row = await self.db.run(store.broadcast, broadcast_id)
            snapshot = BroadcastSnapshot(row["id"], row["platform_service_account_id"], row["broadcast_seq"],
                                         row["title"], row["content"], bytes(row["payload_digest"]),
                                         row["operator_id"], row["correlation_id"],
                                         tuple(platform_assets.manifest_of(row)))
            self._snapshots[broadcast_id] = snapshot
        return snapshot

    async def _deliver(self, lease: Lease) -> None:
        try:
            await self._run_delivery(lease)
        finally:
            self._in_flight -= 1
            self._settled_since_check = True
            self._wake.set()

    async def _run_delivery(self, lease: Lease) -> None:
        async with self._delivery_slots:
            system = ActorContext(workspace_id=lease.workspace_id, member_id=SYSTEM_MEMBER, member_kind="system",
                                  owner_member_id=None, execution_generation=lease.execution_generation)
            try:
                await self.services.scopes.submit(lease.local_scope_id,
                                                  PlatformDelivery(system, lease, await self._snapshot(lease.broadcast_id)))
                return
            except Refused as exc:
                reason, error = exc.reason, exc.message
            except (StorageError, asyncpg.PostgresError, ActorFailed) as exc:
                reason, error = None, f"{type(exc).__name__}: {exc}"
        if reason == "stale_lease":
            return  # another lease owns it now
        if reason in ("out_of_order", "stale_placement"):
            state, delay = "queued", 0.0  # not its turn, or leased under an old placement: lease it again
        elif reason == "audience_not_ready":
            # Waits for the workspace (a fenced or suspended one reconciles nothing), spending no attempt.
            state, delay = "waiting_audience", min(60.0, 5 * self.settings.retry_base_seconds)
        else:
            attempts = await self._attempts(lease)
            exhausted = attempts >= self.settings.max_attempts
            state = "operator_attention" if exhausted else "retry_wait"
            delay = 0.0 if exhausted else min(60.0, self.settings.retry_base_seconds * 2 ** max(0, attempts - 1))
        try:
            settled = await self._write(store.settle_failure, lease, state=state, error=error or "",
                                                delay_seconds=delay)
        except StorageError as exc:
            log.warning("could not record a failed delivery; its lease expires instead",
                        extra={"delivery_id": lease.delivery_id, "error": str(exc)})
            return
        if settled is not None and state in ("retry_wait", "operator_attention"):
            log.info("platform delivery not done", extra={"delivery_id": lease.delivery_id, "state": state,
                                                          "error": error})
            await self._emit("platform_service_account.broadcast_delivery_changed", delivery_id=lease.delivery_id)

    async def _attempts(self, lease: Lease) -> int:
        try:
            return (await self.db.run(store.delivery, lease.delivery_id))["attempt"]
        except NotFound:
            return 0

    async def _emit(self, event: str, **ids: Any) -> None:
        try:
            await self.services.emit(event, **ids)
        except (StorageError, NotFound) as exc:
            log.warning("platform event not published", extra={"event": event, "error": str(exc)})


class PlatformRegistry:
    """The platform actors of this process: one per account this node owns (with several nodes,
    each account's lease decides which node; a crash resumes from the rows).  Actors start at
    boot, when an account is created, and when an account's owner is gone (`claim_unowned`);
    an account's actor ends when it is deleted or its lease is lost."""

    def __init__(self, services: PlatformServices, nursery: trio.Nursery) -> None:
        self.services = services
        self._nursery = nursery
        self._actors: dict[str, PlatformAccountActor] = {}
        self._acquiring: dict[str, trio.Event] = {}
        self.draining = False
        self._all_stopped: trio.Event | None = None
        # Actors start in this context, not in that of the request whose command started them.
        self._context = contextvars.copy_context()

    def _start(self, account_id: str, lease: tuple[str, int] | None) -> PlatformAccountActor:
        actor = PlatformAccountActor(account_id, self.services, lease)
        self._actors[account_id] = actor
        self._context.run(self._nursery.start_soon, self._supervise, actor)
        return actor

    async def _supervise(self, actor: PlatformAccountActor) -> None:
        try:
            await actor.run()
        except Exception:
            log.exception("platform actor crashed", extra={"platform_service_account_id": actor.account_id})
        finally:
            if self._actors.get(actor.account_id) is actor:
                del self._actors[actor.account_id]
            if not self._actors and self._all_stopped is not None:
                self._all_stopped.set()

    async def drain(self) -> None:
        """A clean shutdown's first step, before the scope actors drain: no command starts here
        any more (a forwarded one goes back to its sender, which finds the next owner once this
        node's leases are freed; a local one answers unavailable), the commands already queued
        finish, and every actor stops.  The caller bounds the wait."""
        self.draining = True
        if self._actors:
            self._all_stopped = trio.Event()
            for actor in list(self._actors.values()):
                actor.drain()
            await self._all_stopped.wait()

    async def _route(self, account_id: str, *, forwarded: bool) -> PlatformAccountActor | Any:
        """This node's actor for the account (taking the lease when no live node holds it), or
        the owning node (an actors.registry.Owner).  A forwarded command never goes further."""
        while True:
            if self.draining:
                if forwarded:
                    raise LeaseLost(f"node {self.services.node_id} is shutting down")
                raise DatabaseUnavailable("this node is shutting down; retry")
            actor = self._actors.get(account_id)
            if actor is not None and not actor.stopped:
                return actor
            ownership = self.services.ownership
            if ownership is None:
                return self._start(account_id, None)
            pending = self._acquiring.get(account_id)
            if pending is not None:  # one acquisition per account at a time
                await pending.wait()
                continue
            self._acquiring[account_id] = done = trio.Event()
            try:
                owner = await ownership.acquire(account_id, kind=leases.PLATFORM_ACCOUNTS)
            finally:
                del self._acquiring[account_id]
                done.set()
            if self.draining:
                continue  # the lease goes with this node's others
            if owner.node_id == ownership.node_id:
                return self._start(account_id, (owner.node_id, owner.epoch))
            if forwarded:
                raise LeaseLost(f"node {ownership.node_id} does not own platform account {account_id}")
            return owner

    async def submit(self, account_id: str, command: PlatformCommand, *, forwarded: bool = False) -> Any:
        """Run `command` in the account's actor, on whichever node owns it.  Only the search for
        an owner is bounded: a command handed to an actor runs, and its reply says how it went."""
        backoff = FORWARD_RETRY_FIRST_SECONDS
        give_up_at = trio.current_time() + OWNER_SEARCH_SECONDS
        while True:
            try:
                target = await self._route(account_id, forwarded=forwarded)
                if isinstance(target, PlatformAccountActor):
                    return await target.submit(command)
                return await self.services.ownership.forward(target, account_id, command)
            except LeaseLost:
                if forwarded:
                    raise
                if trio.current_time() + backoff > give_up_at:
                    raise DatabaseUnavailable("no node took the platform account in time; retry") from None
                command.reply = Reply()  # nothing committed: run it at the (new) owner
                await trio.sleep(backoff)  # the lease is changing hands: look again
                backoff = min(backoff * 2, FORWARD_RETRY_MAX_SECONDS)

    async def claim(self, account_id: str) -> None:
        """Start the account's actor here if no live node owns it (else its owner runs it)."""
        try:
            await self._route(account_id, forwarded=True)
        except LeaseLost:
            pass  # another node owns it
        except NotFound:
            pass  # deleted meanwhile
        except (StorageError, asyncpg.PostgresError) as exc:  # e.g. deleted while its lease row was written
            log.warning("platform account not claimed; the next pass retries",
                        extra={"platform_service_account_id": account_id, "error": str(exc)})

    async def claim_unowned(self) -> None:
        """Every account no live node owns gets its actor here: at boot, and periodically, so a
        dead owner's accounts move within its node lease."""
        ownership = self.services.ownership
        if ownership is None:
            account_ids = await self.services.db.run(store.account_ids)
        else:
            account_ids = await self.services.db.run(leases.unowned_platform_accounts, ownership.node_id)
        for account_id in account_ids:
            await self.claim(account_id)

    async def _claim_unowned_logged(self) -> None:
        try:
            await self.claim_unowned()
        except StorageError as exc:
            log.warning("platform actors not restarted; the next wake retries", extra={"error": str(exc)})

    def wake(self, account_id: str) -> None:
        """A NOTIFY arrived: '*' wakes every actor here (a workspace was created) and claims the
        accounts no live node owns; else the account's actor, if it runs here (its owner elsewhere
        hears the same NOTIFY; a dead owner's accounts are claimed by the periodic pass)."""
        if account_id == "*":
            for actor in list(self._actors.values()):
                actor.wake()
            self._nursery.start_soon(self._claim_unowned_logged)  # an actor that crashed comes back
            return
        actor = self._actors.get(account_id)
        if actor is not None and not actor.stopped:
            actor.wake()

    def start(self, account_id: str) -> None:
        """A new account: its actor starts here (this node takes its lease, unless another was quicker)."""
        self._context.run(self._nursery.start_soon, self.claim, account_id)

    @property
    def active(self) -> int:
        return len(self._actors)
