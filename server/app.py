"""The WebSocket server: accept connections, authenticate, dispatch, reply.

A connection must authenticate (`login`, `auth` or `invitation.accept`)
within `auth_timeout_seconds`, or it is closed with 4401.  Every later
command re-validates its credential and its workspace membership.  Credential
revocations committed anywhere (this process or another) arrive over
LISTEN/NOTIFY and close the affected connections with 4403 within one
notification round trip.

Shutdown order (SIGINT/SIGTERM or cancellation of `run`): stop accepting, close
every live connection with 1001 "going away", let the scope actors finish what
they hold (forwarded commands meanwhile go back to their nodes), close the
node links, stop the actors; the caller then stops the database.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from protocol import frames
from protocol.codec import decode_request, encode, error_frame
from protocol.errors import ErrorCode, ProtocolError
from actors.fanout import FanoutHub
from actors.delivery_router import DeliveryRouter, FeedSubscription
from actors.inline_settler import InlineSettler
from actors.outbox_worker import OutboxWorker
from actors.platform_account import PlatformRegistry
from actors.registry import ScopeRegistry, actor_seconds
from server import handlers, http, logs, messaging, pipeline
from server.ops.collaboration import run_collaborator_maintenance
from server.ops.platform import run_platform
from server.ops.service_accounts import AudienceReconciler
from server.ops.service_accounts import run_maintenance as run_service_account_maintenance
from server.limits import ConnectionAdmission, KeyedRateLimiter, Slots, TokenBucket, warn_if_descriptors_short
from server import transport
from server.attachments import Attachments
from server.cluster import ClusterNode, link_key
from server.parking import ParkingLot
from server.send_ring import PublicationWrites, SendRing
from server.auth import Authenticator, CachedContext
from server.config import ServerConfig
from server.context import Principal
from server.metrics import ServerMetrics
from server.ops.deliveries import release_all as release_feeds
from server.realtime import PushState, ScopeGroup
from server.transport import ConnectionClosed, WebSocket
from server.wire import server_frame
from storage import tenancy
from storage.bridge import Database
from storage.errors import Conflict, DatabaseUnavailable, Forbidden, NotFound, WriteFenced
from storage.ids import new_id

log = logging.getLogger("scopewire.server")

# Retries of a revocation check that failed on the database (a resync), doubling.
RESYNC_BACKOFF_FIRST = 0.5
RESYNC_BACKOFF_MAX = 10.0

# Concurrent connections to --metrics-port, and how long one may take to send its request.
PROBE_MAX_CONNECTIONS = 16
PROBE_REQUEST_SECONDS = 5.0

MSGPACK_SUBPROTOCOL = "scopewire.msgpack"
JSON_SUBPROTOCOL = "scopewire.json"


@dataclass(eq=False, slots=True)
class Connection:
    """One client's session over its WebSocket: who it is and what it follows."""

    ws: WebSocket
    address: str = ""  # the client's IP address
    id: str = field(default_factory=lambda: new_id("con"))
    principal: Principal | None = None
    session_expires_at: float | None = None
    closing: bool = False  # set by a handler: close (4403) after this reply
    answering: int = 0  # commands being answered (more than one only when pipelined, server/pipeline.py)
    # A revocation arrived while a command was answered: checked again after its reply.
    recheck_after_reply: bool = False
    push: PushState | None = None
    # Routed delivery feeds this connection consumes, by workspace (server/ops/deliveries.py).
    delivery_feeds: dict[str, FeedSubscription] | None = None  # created by the first delivery.subscribe
    last_inbound: float = field(default_factory=trio.current_time)
    command_bucket: TokenBucket | None = None
    # Workspaces a session has acted in (None until its first workspace request):
    # a removal or suspension there closes it.
    workspaces: set[str] | None = None
    # The context its message.send requests are served from (server/auth.CachedContext).
    cached_context: CachedContext | None = None
    # Set while it holds a turn of the parking lot's woken connections (server/parking.py).
    turn_done: Callable[[], None] | None = None

    def acted_in(self, workspace_id: str) -> None:
        if self.workspaces is None:
            self.workspaces = set()
        self.workspaces.add(workspace_id)

    def session_workspaces(self) -> set[str]:
        found = set(self.workspaces or ())
        if self.push is not None:
            found.add(self.push.workspace_id)
        return found

    @property
    def binary(self) -> bool:
        return self.ws.binary

    async def send(self, frame: Any) -> None:
        binary = self.ws.binary
        # A turn never covers waiting for the client to read.
        await self.ws.send(server_frame(encode(frame, binary=binary), binary=binary),
                           before_waiting=None if self.turn_done is None else self.give_turn_back)

    def give_turn_back(self) -> None:
        done, self.turn_done = self.turn_done, None
        if done is not None:
            done()


def _identity(principal: Principal) -> tuple:
    return principal.kind, principal.account_id, principal.key_member_id, principal.operator_id


class ConnectionRegistry:
    """Live authenticated connections, indexed by what can revoke them."""

    def __init__(self) -> None:
        self.all: set[Connection] = set()
        self._by_account: dict[str, set[Connection]] = defaultdict(set)
        self._by_api_key: dict[str, set[Connection]] = defaultdict(set)
        self._by_key_member: dict[str, set[Connection]] = defaultdict(set)

    def add(self, connection: Connection) -> None:
        self.all.add(connection)

    def authenticated(self, connection: Connection) -> None:
        principal = connection.principal
        assert principal is not None
        if principal.kind == "api_key":
            self._by_api_key[principal.api_key_id].add(connection)
            self._by_key_member[principal.key_member_id].add(connection)
        elif principal.account_id is not None:
            self._by_account[principal.account_id].add(connection)

    def remove(self, connection: Connection) -> None:
        self.all.discard(connection)
        principal = connection.principal
        if principal is None:
            return
        for index, key in ((self._by_account, principal.account_id), (self._by_api_key, principal.api_key_id),
                           (self._by_key_member, principal.key_member_id)):
            if key is not None and key in index:
                index[key].discard(connection)
                if not index[key]:
                    del index[key]

    def sessions_of(self, account_id: str) -> list[Connection]:
        return [c for c in self._by_account.get(account_id, ()) if c.principal.kind == "account"]

    def of_api_key(self, api_key_id: str) -> list[Connection]:
        return list(self._by_api_key.get(api_key_id, ()))

    def of_key_member(self, member_id: str) -> list[Connection]:
        return list(self._by_key_member.get(member_id, ()))


@dataclass
class Server:
    config: ServerConfig
    db: Database
    auth: Authenticator
    connections: ConnectionRegistry = field(default_factory=ConnectionRegistry)
    hub: FanoutHub = field(default_factory=FanoutHub)
    reaction_limiter: KeyedRateLimiter = field(default_factory=lambda: KeyedRateLimiter(5.0, 20))
    typing_limiter: KeyedRateLimiter = field(default_factory=lambda: KeyedRateLimiter(1.0, 5))
    presence_limiter: KeyedRateLimiter = field(default_factory=lambda: KeyedRateLimiter(0.2, 3))
    registry: ScopeRegistry | None = None
    outbox: OutboxWorker | None = None
    settler: InlineSettler | None = None
    deliveries: DeliveryRouter = field(init=False)
    audience: AudienceReconciler = field(init=False)
    platform: PlatformRegistry | None = None
    # This process's node id (--node-id, else fresh): it holds scope leases (server/cluster.py),
    # and leasing a platform delivery claims the workspace's placement for it.
    node_id: str = field(default_factory=lambda: new_id("nod"))
    cluster: ClusterNode = field(init=False)
    port: int | None = None
    # Already bound (the CLI binds before touching the database, to fail fast); else run() binds.
    listeners: list[trio.SocketListener] | None = None
    # Starts a task next to the connection tasks (flushes, replays); set while serving.
    spawn: Callable[..., Any] | None = None
    # A publication's gathered sends through io_uring (server/send_ring.py); set while serving.
    publication_writes: PublicationWrites | None = None
    _edition: str | None = None
    # Subscribes answered at once, one per pooled database connection.  A reconnect storm
    # sends thousands together; answered all at once, each holds its request state (the
    # handler's coroutines, its queued database units, its replay task) until the pool
    # reaches it, and that burst, freed between the subscriptions' long-lived objects,
    # stays in the allocator's arenas.  Measured at 1,000 subscribed connections (bench/
    # fanout.py): 14.7 KiB of server RSS per connection without this, 10.2 with it.
    subscribe_slots: Slots = field(init=False)
    # Idle authenticated connections, waiting without a task (server/parking.py).
    parking: ParkingLot = field(init=False)
    admission: ConnectionAdmission = field(init=False)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    accepting: bool = False  # listeners up and not shutting down (/readyz)
    metrics_port: int | None = None  # bound --metrics-port, when configured
    http_in_flight: int = 0  # plain HTTP requests (probes, scrapes) being answered on the WebSocket port
    # The --metrics-port listener has its own small caps: a scraper never competes with clients.
    probe_admission: ConnectionAdmission = field(default_factory=lambda: ConnectionAdmission(
        max_connections=PROBE_MAX_CONNECTIONS, max_unauthenticated=PROBE_MAX_CONNECTIONS,
        max_unauthenticated_per_address=PROBE_MAX_CONNECTIONS))

    def __post_init__(self) -> None:
        self.subscribe_slots = Slots(self.db.settings.max_size)
        self.parking = ParkingLot(self._resume, self.config.max_woken_connections)
        self.admission = ConnectionAdmission(
            max_connections=self.config.max_connections,
            max_unauthenticated=self.config.max_unauthenticated_connections,
            max_unauthenticated_per_address=self.config.max_unauthenticated_per_address)
        self.deliveries = DeliveryRouter(self.db, lease_seconds=self.config.delivery_lease_seconds,
                                         retention_hours=self.config.delivery_retention_hours)
        self.audience = AudienceReconciler(self)
        self.attachments = Attachments(self.config)
        if self.config.node_id:
            self.node_id = self.config.node_id
        self.cluster = ClusterNode(self, link_key(self.auth.signer.private_key))
        self.metrics.bind(self)
        self.hub.group_factory = partial(ScopeGroup, self)

    async def edition(self) -> str | None:
        if self._edition is None:
            self._edition = await self.db.run(tenancy.instance_edition)
        return self._edition

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; then close every connection (1001, bounded by the
        shutdown grace), let the scope actors finish what they hold (commands other
        nodes forwarded here among them; bounded by the grace too), then stop them."""
        warn_if_descriptors_short(self.config.max_connections)
        self._open_send_ring()
        stop = trio.Event()
        # Cancelling run() must not reach the services at once: connections still run their
        # closing handshakes and actors their queued commands.  So they are shielded, and a
        # sentinel outside turns the cancellation into a stop request (or, while still
        # starting, cancels them).
        services = trio.CancelScope(shield=True)
        async with trio.open_nursery() as outer:
            outer.start_soon(self._stop_when_cancelled, stop, services)
            try:
                with services:
                    await self._run_services(stop, task_status)
            finally:
                outer.cancel_scope.cancel()
                if self.publication_writes is not None:
                    self.publication_writes.close()  # anything published later goes out with send()

    def _open_send_ring(self) -> None:
        if self.config.fanout_writes != "io_uring":
            return
        try:
            ring = SendRing.open()
        except OSError as exc:
            log.info("io_uring unavailable; fanout writes use one send() per connection", extra={"why": str(exc)})
            return
        self.publication_writes = PublicationWrites(ring)
        self.hub.flush_writes = self.publication_writes.flush
        log.info("fanout writes go through io_uring")

    async def _stop_when_cancelled(self, stop: trio.Event, services: trio.CancelScope) -> None:
        try:
            await trio.sleep_forever()
        finally:
            stop.set()
            if not self.accepting:  # not serving (yet): nothing to close or drain
                services.cancel()

    async def _run_services(self, stop: trio.Event, task_status: trio.TaskStatus[int]) -> None:
        async with trio.open_nursery() as actors_nursery:
            self.outbox = OutboxWorker(self.db, self.hub, self.deliveries)
            outbox = self.outbox
            self.settler = settler = InlineSettler(self.db)
            self.registry = ScopeRegistry(self.db, self.hub, actors_nursery, idle_seconds=self.config.actor_idle_seconds,
                                          outbox_wake=lambda: outbox.wake.set(),
                                          on_commit=self.metrics.batch_committed,
                                          offer_deliveries=self.deliveries.offer, ownership=self.cluster,
                                          settle_later=settler.settle)
            await actors_nursery.start(settler.run)
            await actors_nursery.start(self.cluster.run)
            await actors_nursery.start(self.deliveries.run)
            await actors_nursery.start(self.outbox.run)
            await actors_nursery.start(messaging.sweep_departed_members, self)
            await actors_nursery.start(run_collaborator_maintenance, self)
            await actors_nursery.start(self.audience.run)
            await actors_nursery.start(run_service_account_maintenance, self)
            await actors_nursery.start(run_platform, self, actors_nursery)
            await actors_nursery.start(self.attachments.run_collector, self)
            try:
                await self._serve(stop, task_status=task_status)
                with trio.move_on_after(self.config.shutdown_grace_seconds):
                    if self.platform is not None:  # first: its deliveries run in scope actors
                        await self.platform.drain()
                    await self.registry.drain()
                    await settler.drain()
                    await self.cluster.close_links()
                    await self.cluster.flush_bus()
            finally:
                actors_nursery.cancel_scope.cancel()

    async def _serve(self, stop: trio.Event, *, task_status: trio.TaskStatus[int]) -> None:
        async with trio.open_nursery() as handlers_nursery:
            # Connection tasks, and the short-lived flush and replay tasks of connections.
            self.spawn = handlers_nursery.start_soon
            await handlers_nursery.start(self.parking.run)
            listeners: list[trio.SocketListener] = []
            probe_listeners: list[trio.SocketListener] = []
            try:
                async with trio.open_nursery() as background:
                    await background.start(self._watch_revocations)
                    background.start_soon(self._heartbeat)
                    listeners = self.listeners or await trio.open_tcp_listeners(self.config.port,
                                                                                host=self.config.host)
                    for listener in listeners:
                        background.start_soon(transport.accept_loop, listener, self._handle, handlers_nursery)
                    self.port = listeners[0].socket.getsockname()[1]
                    if self.config.metrics_port is not None:
                        probe_listeners = await trio.open_tcp_listeners(self.config.metrics_port,
                                                                        host=self.config.host)
                        for listener in probe_listeners:
                            background.start_soon(transport.accept_loop, listener, self._handle_probe,
                                                  handlers_nursery)
                        self.metrics_port = probe_listeners[0].socket.getsockname()[1]
                    self.accepting = True
                    task_status.started(self.port)
                    await stop.wait()
                    background.cancel_scope.cancel()
            finally:
                self.accepting = False
                for listener in listeners + probe_listeners:  # stop accepting: new clients are refused
                    await listener.aclose()
                # Each closing handshake is bounded by the grace (see _close_many); this bounds them all.
                with trio.move_on_after(self.config.shutdown_grace_seconds + 1):
                    await self._close_many([(c, "server shutting down") for c in list(self.connections.all)],
                                           frames.CLOSE_GOING_AWAY)
                handlers_nursery.cancel_scope.cancel()

    # --- connections -------------------------------------------------------------------

    @staticmethod
    def _choose_subprotocol(offered: list[str]) -> str | None:
        return next((p for p in (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL) if p in offered), None)

    async def _handle(self, sock) -> None:
        address = transport.peer_address(sock)
        if not self.admission.admit(address):
            transport.refuse(sock)
            return
        connection: Connection | None = None
        try:
            auth_deadline = trio.current_time() + self.config.auth_timeout_seconds
            ws = await transport.handshake(sock, deadline=auth_deadline, choose_subprotocol=self._choose_subprotocol,
                                           spawn=self.spawn, max_message_bytes=self.config.max_frame_bytes,
                                           close_grace=self.config.shutdown_grace_seconds,
                                           plain_http=self._plain_http)
            if ws is None:
                return
            ws.binary = ws.subprotocol == MSGPACK_SUBPROTOCOL
            connection = Connection(ws=ws, address=address,
                                    command_bucket=TokenBucket(self.config.commands_per_second,
                                                               self.config.command_burst))
            self.connections.add(connection)
        finally:
            if connection is None:
                self.admission.release(address, authenticated=False)
        await self._serve_until_parked_or_closed(connection, auth_deadline)

    def _resume(self, connection: Connection) -> None:
        """A parked connection has input, a deadline or a close: serve it in a task again."""
        connection.turn_done = self.parking.turn_done
        self.spawn(self._serve_until_parked_or_closed, connection, math.inf, name=transport.CONNECTION_TASK_NAME)

    async def _serve_until_parked_or_closed(self, connection: Connection, auth_deadline: float) -> None:
        logs.connection_id.set(connection.id)  # on every log line of this task and the tasks it starts
        parked = False
        try:
            parked = await self._serve_connection(connection, auth_deadline)
        except ConnectionClosed:
            pass
        except Exception:  # one broken connection must never take the server down
            log.exception("connection failed", extra={"connection": connection.id})
        finally:
            connection.give_turn_back()
            if not parked:
                if connection.push is not None:
                    connection.push.stop()
                release_feeds(self, connection)
                self.connections.remove(connection)
                connection.ws.abort()
                self.admission.release(connection.address, authenticated=connection.principal is not None)

    async def _plain_http(self, method: str, target: str) -> bytes | None:
        self.http_in_flight += 1
        try:
            return await http.answer(self, method, target, metrics_here=self.config.metrics_port is None)
        finally:
            self.http_in_flight -= 1

    async def _probe_http(self, method: str, target: str) -> bytes | None:
        return await http.answer(self, method, target, metrics_here=True)

    async def _handle_probe(self, sock) -> None:
        """A connection to --metrics-port: plain HTTP only."""
        address = transport.peer_address(sock)
        if not self.probe_admission.admit(address):
            transport.refuse(sock)
            return
        try:
            ws = await transport.handshake(sock, deadline=trio.current_time() + PROBE_REQUEST_SECONDS,
                                           choose_subprotocol=lambda offered: None, spawn=self.spawn,
                                           max_message_bytes=self.config.max_frame_bytes, close_grace=0,
                                           plain_http=self._probe_http)
            if ws is not None:  # a WebSocket upgrade: not served on this port
                ws.abort()
        finally:
            self.probe_admission.release(address, authenticated=False)

    async def _serve_connection(self, connection: Connection, auth_deadline: float) -> bool:
        """Answer the connection's commands until it closes (False) or, idle and
        authenticated, is parked (True: its task ends, server/parking.py).  One the
        parking lot woke holds a turn until its first command is answered."""
        ws = connection.ws
        unanswered: str | bytes | None = None  # read by a pipeline, not served by it
        while True:
            # Each connection waits on its own deadline: the idle timeout holds to
            # the moment whatever the heartbeat interval (pongs do not count).
            idle_deadline = connection.last_inbound + self.config.idle_timeout_seconds
            if unanswered is not None:
                raw, unanswered = unanswered, None
            elif connection.principal is None:
                raw = await ws.receive(min(idle_deadline, auth_deadline))
            else:
                # A woken connection first reads only what has arrived: a turn never covers a wait.
                woken = connection.turn_done is not None
                park_at = trio.current_time() + (0.0 if woken else self.config.park_after_idle_seconds)
                raw = await ws.receive(min(idle_deadline, park_at))
                if raw is None and woken:
                    connection.give_turn_back()
                    if (self.config.park_after_idle_seconds > 0 and not ws.closing
                            and trio.current_time() < idle_deadline):
                        continue  # no whole message yet: the rest is awaited here, through the grace
                if (raw is None and not ws.closing and trio.current_time() < idle_deadline
                        and self.parking.park(connection, idle_deadline)):
                    return True
            if raw is None:
                if connection.principal is None and trio.current_time() >= auth_deadline:
                    await connection.send(error_frame(ProtocolError(ErrorCode.UNAUTHENTICATED,
                                                                    "authentication timeout"), None))
                    ws.close_soon(frames.CLOSE_UNAUTHENTICATED, "authentication timeout")
                else:
                    ws.close_soon(frames.CLOSE_IDLE, "idle timeout")
                await self._drain_until_closed(ws)
                return False
            connection.last_inbound = trio.current_time()
            if not connection.command_bucket.take():
                await connection.send(self._rate_limited(raw, connection.binary))
                self.metrics.command_refused(ErrorCode.RATE_LIMITED.value)
            else:
                request = pipeline.decoded(raw, connection.binary)
                if pipeline.pipelines(connection, request):
                    self.metrics.pipelines += 1
                    unanswered = await pipeline.serve_sends(self, connection, request, raw)
                else:
                    connection.answering += 1
                    try:
                        await self.answer_and_reply(connection, raw, request)
                    finally:
                        connection.answering -= 1
                        logs.request_id.set(None)
                        logs.request_op.set(None)
                request = None
            raw = None  # the command's text is not kept while the connection idles
            connection.give_turn_back()
            if connection.closing:
                ws.close_soon(frames.CLOSE_REVOKED, "sessions revoked")
            elif connection.recheck_after_reply:
                connection.recheck_after_reply = False
                try:
                    reason = await self._revocation_reason(connection)
                except DatabaseUnavailable:
                    reason = None  # the watcher revalidates every connection once it is back
                if reason is not None:
                    ws.close_soon(frames.CLOSE_REVOKED, reason)
            if ws.closing:
                await self._drain_until_closed(ws)
                return False
            # A client pipelining commands must not starve the others.
            await trio.lowlevel.checkpoint()

    @staticmethod
    async def _drain_until_closed(ws: WebSocket) -> None:
        """Read (and drop) until the peer answers our close frame or the grace runs out."""
        while True:
            await ws.receive()

    @staticmethod
    def _rate_limited(raw: str | bytes, binary: bool) -> frames.Error:
        try:
            request_id = decode_request(raw, binary=binary).id
        except ProtocolError as exc:
            request_id = exc.details.get("id")
        return error_frame(ProtocolError(ErrorCode.RATE_LIMITED, "too many commands; slow down"), request_id)

    async def answer_and_reply(self, connection: Connection, raw: str | bytes, request: frames.Request | None,
                               *, reply_after: trio.Event | None = None) -> None:
        """Answer one command (`request`: `raw` decoded, None when it does not
        decode) and write the reply, once `reply_after` is set; count it, and log
        it with its phases when it took longer than slow_command_ms."""
        actor_seconds.set(0.0)
        marks = [time.perf_counter()]
        reply = await self._answer(connection, raw, request, marks)
        marks.append(time.perf_counter())
        if reply_after is not None:
            await reply_after.wait()
        await connection.send(reply)
        done = time.perf_counter()
        duration = done - marks[0]
        self.metrics.command_answered(logs.request_op.get(), reply, duration)
        if duration * 1000 > self.config.slow_command_ms:
            self.metrics.slow_commands += 1
            decoded = marks[1] if len(marks) == 3 else marks[0]
            actor = actor_seconds.get()
            phases = {"decode": decoded - marks[0], "handler": max(marks[-1] - decoded - actor, 0.0),
                      "actor": actor, "reply": done - marks[-1]}
            log.warning("slow command", extra={
                "duration_ms": round(duration * 1000, 1), "slowest_phase": max(phases, key=phases.__getitem__),
                "phases_ms": {name: round(seconds * 1000, 1) for name, seconds in phases.items()},
                "outcome": reply.code if isinstance(reply, frames.Error) else "ok"})

    async def _answer(self, connection: Connection, raw: str | bytes, request: frames.Request | None,
                      marks: list[float] | None = None) -> Any:
        request_id: str | None = None
        try:
            if request is None:
                request = decode_request(raw, binary=connection.binary)  # raises the error to answer
            request_id = request.id
            logs.request_id.set(request_id)
            logs.request_op.set(frames.op_of(request))
            if marks is not None:
                marks.append(time.perf_counter())
            if type(request) is frames.Subscribe:
                async with self.subscribe_slots:
                    data = await handlers.dispatch(self, connection, request)
            else:
                data = await handlers.dispatch(self, connection, request)
            return frames.Result(id=request.id, op=frames.op_of(request), data=data)
        except ProtocolError as exc:
            return error_frame(exc, request_id if request_id is not None else exc.details.get("id"))
        except NotFound as exc:
            return error_frame(ProtocolError(ErrorCode.NOT_FOUND, f"{exc} not found"), request_id)
        except Conflict as exc:
            code = {"edition_limit": ErrorCode.EDITION_LIMIT,
                    "idempotency_conflict": ErrorCode.IDEMPOTENCY_CONFLICT}.get(exc.reason, ErrorCode.CONFLICT)
            return error_frame(ProtocolError(code, str(exc), details={"reason": exc.reason}), request_id)
        except Forbidden as exc:
            return error_frame(ProtocolError(ErrorCode.FORBIDDEN, str(exc)), request_id)
        except WriteFenced:
            return error_frame(ProtocolError(ErrorCode.FENCED, "the workspace is fenced for writes; reconnect"),
                               request_id)
        except DatabaseUnavailable:
            return error_frame(ProtocolError(ErrorCode.UNAVAILABLE, "database unavailable, retry"), request_id)
        except Exception:
            log.exception("request failed", extra={"request_id": request_id, "connection": connection.id})
            return error_frame(ProtocolError(ErrorCode.INTERNAL, "internal error"), request_id)

    def check_connection_limit(self, principal: Principal) -> None:
        """At most max_connections_per_member authenticated connections per account / key member."""
        if principal.kind == "operator":
            count = sum(1 for c in self.connections.all
                        if c.principal is not None and c.principal.operator_id == principal.operator_id)
        else:
            count = len(self.connections.of_key_member(principal.key_member_id) if principal.kind == "api_key"
                        else self.connections.sessions_of(principal.account_id))
        if count >= self.config.max_connections_per_member:
            raise ProtocolError(ErrorCode.RATE_LIMITED, "too many connections for this member")

    def authenticated(self, connection: Connection, principal: Principal, expires_at: float | None) -> None:
        if connection.principal is not None:
            if _identity(connection.principal) != _identity(principal):
                # Signed in as someone else: nothing the previous identity followed may reach it.
                if connection.push is not None:
                    connection.push.stop()
                    connection.push = None
                release_feeds(self, connection)
            self.connections.remove(connection)
            self.connections.add(connection)
        else:
            self.admission.authenticated(connection.address)
        connection.principal = principal
        connection.session_expires_at = expires_at
        self.connections.authenticated(connection)

    # --- heartbeat and idle ------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        """Every heartbeat interval: ping every connection; one that has not
        answered within heartbeat_timeout_seconds is aborted.  (The idle timeout
        is each connection's own receive deadline, see _serve_connection.)"""
        async with trio.open_nursery() as checks:
            while True:
                await trio.sleep(self.config.heartbeat_seconds)
                pinged = []
                for connection in self.connections.all:
                    if not connection.ws.closing:
                        if not connection.ws.awaiting_pong:
                            connection.ws.ping()
                        pinged.append(connection)  # still awaiting an earlier pong: checked again
                checks.start_soon(self._expect_pongs, pinged)

    async def _expect_pongs(self, pinged: list[Connection]) -> None:
        await trio.sleep(self.config.heartbeat_timeout_seconds)
        for connection in pinged:
            # While a command is answered nobody reads the socket, so a pong may wait
            # there unparsed: only an idle reader's missing pong means a dead peer.
            if connection.ws.awaiting_pong and not connection.ws.closing and not connection.answering:
                log.info("no pong; aborting connection", extra={"connection": connection.id})
                connection.ws.abort()

    # --- revocation ----------------------------------------------------------------------

    async def _watch_revocations(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close connections whose credential was revoked (any process), whose
        membership or workspace ended, or whose session expired.  Wakes at least
        every `expiry_sweep_seconds`.  A database outage does not stop it: a
        check that failed is retried with backoff as a resync (every connection
        revalidated), as after a lost LISTEN connection."""
        async with self.db.listen(tenancy.AUTH_CHANNEL) as notifications:
            task_status.started()
            resync_due = False
            backoff = RESYNC_BACKOFF_FIRST
            while True:
                note = None
                with trio.move_on_after(backoff if resync_due else self.config.expiry_sweep_seconds):
                    note = await notifications.receive()
                if resync_due or note is not None:
                    self.auth.forget_cached_contexts()
                try:
                    if resync_due or (note is not None and note.resync):
                        resync_due = True
                        await self._revalidate(list(self.connections.all))
                        resync_due, backoff = False, RESYNC_BACKOFF_FIRST
                    if note is not None and note.payload:
                        await self._apply_auth_event(json.loads(note.payload))
                except DatabaseUnavailable as exc:
                    # The event may be lost: the resync covers it once the database is back.
                    log.warning("revocation check failed; resyncing", extra={"error": str(exc), "retry_in": backoff})
                    if resync_due:
                        backoff = min(backoff * 2, RESYNC_BACKOFF_MAX)
                    resync_due = True
                    self.auth.forget_cached_contexts()
                await self._close_expired()

    def _in_workspace(self, workspace_id: str) -> list[Connection]:
        """Connections acting in a workspace: its API keys' and the sessions that
        made a request in it or follow it."""
        return [c for c in self.connections.all if c.principal is not None and (
            c.principal.key_workspace_id == workspace_id or workspace_id in c.session_workspaces())]

    async def _apply_auth_event(self, event: dict) -> None:
        kind = event.get("kind")
        if kind == "account":
            await self._revalidate(self.connections.sessions_of(event["account_id"]))
        elif kind == "api_key":
            await self._revalidate(self.connections.of_api_key(event["api_key_id"]))
        elif kind == "operator":
            await self._revalidate([c for c in self.connections.all
                                    if c.principal is not None and c.principal.operator_id == event["operator_id"]])
        elif kind == "membership":
            # Every session of the member's account (each is re-checked against the
            # workspaces it acted in, or closed when the account has none left), and
            # every API key of the workspace (an agent's key ends with its owner's
            # membership).
            workspace_id, member_id = event["workspace_id"], event["member_id"]
            try:
                account_id = (await self.db.run(tenancy.member_in_workspace, workspace_id, member_id))["account_id"]
            except NotFound:
                account_id = None
            sessions = self.connections.sessions_of(account_id) if account_id is not None else []
            await self._revalidate(sessions + [c for c in self._in_workspace(workspace_id)
                                               if c.principal.kind == "api_key"])
        elif kind == "workspace":
            # Sessions that never named a workspace are closed if it was their only one.
            await self._revalidate(self._in_workspace(event["workspace_id"]) + [
                c for c in self.connections.all
                if c.principal is not None and c.principal.kind == "account" and not c.session_workspaces()])

    async def _revalidate(self, connections: list[Connection]) -> None:
        """Close (4403) those whose credential, membership or workspace is no longer
        good.  One answering a command is checked again right after its reply, so
        the command that revoked (say, a suspension) still gets its answer."""
        revoked: list[tuple[Connection, str]] = []
        for connection in connections:
            if connection.answering:
                connection.recheck_after_reply = True
                continue
            reason = await self._revocation_reason(connection)
            if reason is not None and not connection.answering:
                revoked.append((connection, reason))
            elif reason is not None:
                connection.recheck_after_reply = True
        await self._close_many(revoked)

    async def _revocation_reason(self, connection: Connection) -> str | None:
        """Why the connection must close, or None while what admitted it still holds."""
        principal = connection.principal
        if principal is None or connection.closing or connection.ws.closing:
            return None
        try:
            await self.auth.revalidate(principal)
            if principal.kind == "api_key":
                await self.auth.workspace_context(principal, None, await self.edition())
            elif principal.kind == "account":
                acted_in = connection.session_workspaces()
                for workspace_id in acted_in:
                    await self.auth.workspace_context(principal, workspace_id, await self.edition())
                if not acted_in and not any(w["status"] == "active" for w in await self.db.run(
                        tenancy.list_workspaces, principal.account_id)):
                    raise ProtocolError(ErrorCode.FORBIDDEN, "no active workspace membership left")
        except ProtocolError as exc:
            if exc.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.FORBIDDEN, ErrorCode.NOT_FOUND):
                log.info("closing revoked connection", extra={"connection": connection.id, "why": exc.message})
                return exc.message[:120]
        return None

    async def _close_expired(self) -> None:
        now = time.time()
        await self._close_many([(c, "session expired") for c in list(self.connections.all)
                                if c.session_expires_at is not None and c.session_expires_at <= now])

    async def _close_many(self, targets: list[tuple[Connection, str]], code: int = frames.CLOSE_REVOKED) -> None:
        """Start every closing handshake at once, then wait (each bounded by the
        grace period), so one client slow to answer delays nobody."""
        for connection, reason in targets:
            connection.ws.close_soon(code, reason)
        for connection, _ in targets:
            await connection.ws.wait_closed()
