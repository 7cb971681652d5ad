"""This process as one node of several on one database.

- **Node lease.** The node registers in `cluster_nodes` and renews its lease
  every third of `--node-lease-seconds`; `/readyz` fails when a renewal has not
  succeeded for a whole lease (its scopes may be taken over by then).
- **Scope ownership** (actors.registry.Ownership): `acquire` takes a scope's
  lease or names its owner (storage/leases.py has the fencing rules).
- **Forwarding.** A command for a scope another node owns runs there: it is
  sent over a TCP link between the nodes and its reply (value or error) comes
  back.  Links authenticate with a key derived from the shared session signing
  key (challenge and response, then an HMAC on every frame), and the frames
  are pickles of the actors' own command and reply objects: only a peer that
  holds the signing key — which can mint any session anyway — can send one,
  and unpickling is limited to this project's modules and plain types.
- **The bus** (server/bus.py): every publication of the local hub goes to the
  other nodes in order, and theirs come to this node's subscribers
  (server/cluster_fanout.py).  A gap in a sender's numbers or a transport
  resync replays every local subscriber from its cursors and tells it that
  events outside the log may be lost (`events.missed`).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import datetime
import decimal
import enum
import hashlib
import hmac
import io
import itertools
import logging
import pickle
import secrets
import struct
import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import asyncpg
import msgspec
import trio
from cryptography.hazmat.primitives import serialization

from actors.platform_account import PlatformCommand
from actors.scope_actor import ActorFailed, ActorUnavailable, Command
from server.bus import BusTransport, Delivery, PgNotifyTransport
from server.cluster_fanout import TICK, RemoteFanout, UnreadableBusPayload, encode, encode_feeds
from storage import cluster_bus, leases
from storage.bridge import Database
from storage.errors import DatabaseUnavailable, LeaseLost

if TYPE_CHECKING:
    from server.app import Server

log = logging.getLogger("scopewire.cluster")

HANDSHAKE_SECONDS = 5.0
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_FRAME_BYTES = 64 * 1024 * 1024
# How long an acquisition may wait for the current owner's in-flight transaction.
ACQUIRE_LOCK_TIMEOUT_MS = 2_000
# Bus messages waiting to be sent before the oldest are dropped (receivers then see a gap).
BUS_QUEUE_LIMIT = 10_000
SPILL_RETENTION_SECONDS = 300.0
MAINTENANCE_SECONDS = 60.0
# A node's last frame on a link it serves: the requests it has not answered were not run
# (request ids start at 1).
LINK_CLOSING = (0, False, None)
# Nodes gone this long are deleted (their leases were free long before).
FORGET_NODES_AFTER_SECONDS = 24 * 3600.0
# What a forwarded frame may name: the plain value types, and this project's data classes
# (dataclasses, msgspec Structs, enums, exceptions) — never a function or a module path.
_PROJECT_MODULES = ("actors.", "domain.", "storage.", "protocol.", "server.")
_PLAIN_TYPES = {
    ("builtins", name): getattr(builtins, name)
    for name in ("dict", "list", "set", "frozenset", "tuple", "bytes", "bytearray", "str", "int", "float",
                 "bool", "complex", "Exception", "ValueError", "KeyError", "TypeError", "RuntimeError")
} | {("datetime", name): getattr(datetime, name) for name in ("datetime", "date", "time", "timedelta", "timezone")} \
  | {("decimal", "Decimal"): decimal.Decimal, ("uuid", "UUID"): uuid.UUID}


def _rebuild_exception(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    # Without calling __init__: many of our errors take other arguments than their args.
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise pickle.UnpicklingError("not an exception class")
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, BaseException):
            return _rebuild_exception, (type(obj), obj.args, dict(obj.__dict__))
        if isinstance(obj, asyncpg.Record):
            return dict, (dict(obj),)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN_TYPES:
            return _PLAIN_TYPES[(module, name)]
        if module == __name__ and name == "_rebuild_exception":
            return _rebuild_exception
        if module.startswith(_PROJECT_MODULES) and "." not in name and module in sys.modules:
            found = getattr(sys.modules[module], name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(
                    found, (msgspec.Struct, enum.Enum, BaseException))):
                return found
        raise pickle.UnpicklingError(f"a forwarded frame may not name {module}.{name}")


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


def link_key(signer_private_key) -> bytes:
    """The nodes' shared link key: derived from the shared session signing key."""
    raw = signer_private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
    return hmac.new(raw, b"scopewire node link v1", hashlib.sha256).digest()


class _Framed:
    """Length-prefixed, authenticated frames on a trio stream: each frame's HMAC
    covers its direction and counter, so frames cannot be replayed or reordered."""

    def __init__(self, stream: trio.abc.Stream, key: bytes, *, outgoing: int) -> None:
        self.stream = stream
        self._key = key
        self._buffer = bytearray()
        self._sent = itertools.count()
        self._received = itertools.count()
        self._out, self._in = outgoing, 1 - outgoing
        self._send_lock = trio.Lock()

    def _mac(self, direction: int, counter: int, body: bytes) -> bytes:
        return hmac.new(self._key, struct.pack(">BQ", direction, counter) + body, hashlib.sha256).digest()

    async def send(self, body: bytes) -> None:
        async with self._send_lock:
            mac = self._mac(self._out, next(self._sent), body)
            try:
                await self.stream.send_all(struct.pack(">I", len(body)) + mac + body)
            except BaseException:
                # A frame cut short (or a counter spent without its frame) leaves the link
                # unusable for every later frame: close it; both ends see it broken.
                self.stream.socket.close()
                raise

    async def _exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            chunk = await self.stream.receive_some(max(65536, count - len(self._buffer)))
            if not chunk:
                raise trio.BrokenResourceError("link closed")
            self._buffer += chunk
        data = bytes(self._buffer[:count])
        del self._buffer[:count]
        return data

    async def receive(self) -> bytes:
        (length,) = struct.unpack(">I", await self._exactly(4))
        if length > MAX_FRAME_BYTES:
            raise trio.BrokenResourceError("frame too large")
        mac = await self._exactly(MAC_BYTES)
        body = await self._exactly(length)
        if not hmac.compare_digest(mac, self._mac(self._in, next(self._received), body)):
            raise trio.BrokenResourceError("frame authentication failed")
        return body


def _session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


def _proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"proof" + server_nonce + client_nonce, hashlib.sha256).digest()


class _PeerLink:
    """This node's connection to one peer: forwarded commands out, replies back."""

    def __init__(self, node: ClusterNode, address: str) -> None:
        self.node = node
        self.address = address
        self.framed: _Framed | None = None
        self.broken = False
        self._pending: dict[int, tuple[trio.Event, list]] = {}
        self._ids = itertools.count(1)
        self._connecting = trio.Lock()

    async def _connect(self) -> _Framed:
        async with self._connecting:
            if self.framed is not None:
                return self.framed
            host, _, port = self.address.rpartition(":")
            try:
                with trio.fail_after(HANDSHAKE_SECONDS):
                    stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
                    server_nonce = await _read_exact(stream, NONCE_BYTES)
                    client_nonce = secrets.token_bytes(NONCE_BYTES)
                    await stream.send_all(client_nonce + _proof(self.node.key, server_nonce, client_nonce))
                    if await _read_exact(stream, 1) != b"\x01":
                        log.error("a peer refused this node's link key: every node on one database must use "
                                  "the same --session-key-file", extra={"peer": self.address})
                        raise trio.BrokenResourceError("the peer refused this node's key")
            except (OSError, ValueError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                raise LeaseLost(f"cannot reach the owning node at {self.address}: {exc}") from None
            self.framed = _Framed(stream, _session_key(self.node.key, server_nonce, client_nonce), outgoing=0)
            self.node.spawn(self._read_replies, self.framed)
            return self.framed

    async def call(self, owner_node_id: str, scope_id: str, command: Command) -> Any:
        framed = await self._connect()
        request_id = next(self._ids)
        done, slot = trio.Event(), []
        self._pending[request_id] = (done, slot)
        try:
            try:
                await framed.send(_dumps((request_id, scope_id, command)))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self._fail(framed)
                raise ActorUnavailable("the link to the owning node broke; retry") from None
            while True:
                with trio.move_on_after(self.node.lease_seconds):
                    await done.wait()
                if done.is_set():
                    break
                # A slow answer is fine from a live owner; a frozen one lost its lease by now,
                # and another node may take the scope: give up on this link.
                if not await self.node.db.run(leases.node_is_live, owner_node_id):
                    self._fail(framed)
                    framed.stream.socket.close()
        finally:
            self._pending.pop(request_id, None)
        ok, value = slot[0]
        if ok:
            return value
        raise value

    async def _read_replies(self, framed: _Framed) -> None:
        unread = False
        try:
            while True:
                request_id, ok, value = _loads(await framed.receive())
                if (request_id, ok, value) == LINK_CLOSING:
                    unread = True
                    return
                waiter = self._pending.get(request_id)
                if waiter is not None:
                    waiter[1].append((ok, value))
                    waiter[0].set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("link to peer closed", extra={"peer": self.address, "why": str(exc)})
        except Exception as exc:  # noqa: BLE001 - an unreadable reply: the link is useless
            log.error("unreadable frame on a node link", extra={"peer": self.address, "error": repr(exc)})
        finally:
            self._fail(framed, unread=unread)

    def _fail(self, framed: _Framed, *, unread: bool = False) -> None:
        """The link is gone: a command already handed over may or may not have committed —
        unless the peer said it read none of them (`unread`: they run at the next owner)."""
        if self.framed is framed:
            self.framed = None
        self.broken = True
        for done, slot in list(self._pending.values()):
            if not done.is_set():
                slot.append((False, LeaseLost("the owning node shut down before running it") if unread else
                             ActorUnavailable("the owning node went away; the command may have "
                                              "committed: retry with the same client id")))
                done.set()
        self._pending.clear()


async def _read_exact(stream: trio.abc.Stream, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = await stream.receive_some(count - len(data))
        if not chunk:
            raise trio.BrokenResourceError("link closed")
        data += chunk
    return data


class NodeLease:
    """A node's own lease and the scope leases it takes (actors.registry.Ownership
    but forwarding, which ClusterNode adds; benchmarks of one node use this alone)."""

    def __init__(self, db: Database, node_id: str, lease_seconds: float) -> None:
        self.db = db
        self.node_id = node_id
        self.lease_seconds = lease_seconds
        self.forward_address = ""
        self._renewed_at: float | None = None  # trio time of the last successful renewal

    @property
    def lease_healthy(self) -> bool:
        return self._renewed_at is not None and trio.current_time() - self._renewed_at < self.lease_seconds

    async def register(self) -> None:
        started = trio.current_time()
        await self.db.run(leases.register_node, self.node_id, self.forward_address, self.lease_seconds)
        self._renewed_at = started

    async def renew(self) -> None:
        started = trio.current_time()
        if not await self.db.run(leases.renew_node, self.node_id, self.lease_seconds):
            # Marked stopped or forgotten (after a long freeze): register afresh.
            await self.db.run(leases.register_node, self.node_id, self.forward_address, self.lease_seconds)
        self._renewed_at = started

    async def acquire(self, scope_id: str, *, creating: bool = False,
                      kind: leases.LeasedKind = leases.SCOPES) -> leases.Ownership:
        if not self.lease_healthy:
            # A lease taken now would fail its first fence: renew ours first (we are evidently running).
            await self.renew()
        try:
            return await self.db.transaction(_acquire, scope_id, self.node_id, creating, kind)
        except asyncpg.LockNotAvailableError:
            raise LeaseLost(f"the {kind.name}'s owner is busy committing; retry") from None

    async def acquire_free(self, scope_ids: list[str]) -> dict[str, int]:
        """Take the free leases among these scopes in one transaction (leases.acquire_free);
        {} when that cannot be done now (each scope's first command then acquires it alone)."""
        if not self.lease_healthy:
            await self.renew()
        try:
            return await self.db.transaction(_acquire_free, scope_ids, self.node_id)
        except asyncpg.PostgresError:  # a lock timeout or deadlock against another node's batch
            return {}

    async def release(self, scope_id: str, epoch: int) -> None:
        await self.db.run(leases.release, scope_id, self.node_id, epoch)


class ClusterNode(NodeLease):
    """This process's node: lease, ownership, forwarding and the bus."""

    def __init__(self, server: Server, key: bytes) -> None:
        super().__init__(server.db, server.node_id, server.config.node_lease_seconds)
        self.server = server
        self.key = key
        # This run's name on the bus: a restarted node numbers its publications from 1 again,
        # which must not look like a gap in the last run's (node ids never contain '.').
        self.bus_sender = f"{self.node_id}.{secrets.token_hex(4)}"
        self.transport: BusTransport | None = None
        self.remote = RemoteFanout(server)
        # Links peers opened to us: (the cancel scope of their reading, set once closed).
        self._served_links: list[tuple[trio.CancelScope, trio.Event]] = []
        self._links: dict[str, _PeerLink] = {}
        self._spawn: Callable[..., Any] | None = None
        self._bus_queue: list[bytes] = []
        self._bus_wake = trio.Event()
        self._bus_seq = 0
        # Payloads put on the queue, and of them those sent, failed or dropped (flush_bus).
        self._bus_enqueued = 0
        self._bus_settled = 0
        self._bus_progress = trio.Event()
        self._last_seen: dict[str, int] = {}  # sender node → its last bus seq received
        # Another node is live: only then is anything published on the bus (one node pays nothing).
        self.peers_live = False
        # Figures for /metrics (plain ints, read at scrape time).
        self.forwarded_out = 0
        self.forwarded_in = 0
        self.bus_sent = 0
        self.bus_received = 0
        self.bus_resyncs = 0
        self.bus_dropped = 0

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._spawn is not None
        self._spawn(fn, *args)

    # --- running -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.server.config
        async with trio.open_nursery() as nursery:
            self._spawn = nursery.start_soon
            listeners = await trio.open_tcp_listeners(config.forward_port, host=config.forward_host)
            host, port = listeners[0].socket.getsockname()[:2]
            self.forward_address = config.forward_advertise or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            nursery.start_soon(trio.serve_listeners, self._serve_link, listeners)
            await self.register()
            self.transport = self._open_transport()
            channel = await self.transport.open(self.bus_sender)
            pump = getattr(self.transport, "pump", None)
            if pump is not None:
                nursery.start_soon(pump)
            nursery.start_soon(self._receive_bus, channel)
            nursery.start_soon(self._send_bus)
            nursery.start_soon(self._heartbeat)
            nursery.start_soon(self._maintain)
            self.server.hub.relay = self._relay
            self.server.deliveries.relay = self._relay_feeds
            # Tell the others at once that we are here: they relay to us from their next publication.
            self.peers_live = await self.db.run(leases.other_live_nodes, self.node_id) > 0
            if self.peers_live:
                self._enqueue(TICK)
            log.info("node up", extra={"node_id": self.node_id, "forward_address": self.forward_address,
                                       "bus": self.transport.name})
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.server.hub.relay = self.server.deliveries.relay = None
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(5):
                        try:
                            await self.server.db.run(leases.stop_node, self.node_id)
                        except DatabaseUnavailable:
                            pass  # the lease runs out instead
                        await self.transport.aclose()

    def _open_transport(self) -> BusTransport:
        config = self.server.config
        if config.bus == "nats":
            from server.bus_nats import NatsTransport  # nats-py only when asked for
            return NatsTransport(self.server.db, config.nats_url)
        return PgNotifyTransport(self.server.db)

    async def _heartbeat(self) -> None:
        while True:
            await trio.sleep(self.lease_seconds / 3)
            try:
                await self.renew()
            except DatabaseUnavailable as exc:
                log.warning("node lease renewal failed", extra={"error": str(exc)})
            try:
                self.peers_live = await self.db.run(leases.other_live_nodes, self.node_id) > 0
            except DatabaseUnavailable:
                pass
            if self.peers_live and not self._bus_queue:
                self._enqueue(TICK)  # so a lost last publication does not go unnoticed

    async def _maintain(self) -> None:
        while True:
            await trio.sleep(MAINTENANCE_SECONDS)
            try:
                await self.server.db.run(cluster_bus.prune_spill, SPILL_RETENTION_SECONDS)
                await self.server.db.run(leases.forget_stopped_nodes, FORGET_NODES_AFTER_SECONDS)
                await self.server.db.run(leases.forget_orphan_leases)
            except DatabaseUnavailable:
                pass

    # --- forwarding (the rest of actors.registry.Ownership) --------------------------------

    async def forward(self, owner: leases.Ownership, scope_id: str, command: Command) -> Any:
        link = self._links.get(owner.forward_address)
        if link is None or link.broken:
            link = self._links[owner.forward_address] = _PeerLink(self, owner.forward_address)
        self.forwarded_out += 1
        return await link.call(owner.node_id, scope_id, command)

    async def _serve_link(self, stream: trio.SocketStream) -> None:
        """A peer's link: check its key, then run its commands here."""
        try:
            with trio.fail_after(HANDSHAKE_SECONDS):
                server_nonce = secrets.token_bytes(NONCE_BYTES)
                await stream.send_all(server_nonce)
                answer = await _read_exact(stream, NONCE_BYTES + MAC_BYTES)
                client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
                if not hmac.compare_digest(proof, _proof(self.key, server_nonce, client_nonce)):
                    log.warning("a node link with a wrong key was refused")
                    await stream.send_all(b"\x00")
                    await stream.aclose()
                    return
                await stream.send_all(b"\x01")
        except (trio.TooSlowError, trio.BrokenResourceError, OSError):
            await stream.aclose()
            return
        framed = _Framed(stream, _session_key(self.key, server_nonce, client_nonce), outgoing=1)
        reading, closed = trio.CancelScope(), trio.Event()
        self._served_links.append((reading, closed))
        try:
            async with trio.open_nursery() as requests:
                with reading:
                    try:
                        while True:
                            request_id, scope_id, command = _loads(await framed.receive())
                            requests.start_soon(self._run_forwarded, framed, request_id, scope_id, command)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        log.info("peer link closed", extra={"why": str(exc)})
                    except Exception as exc:  # noqa: BLE001 - an authenticated peer sent what we cannot read
                        log.error("unreadable frame on a node link", extra={"error": repr(exc)})
            # Every request read here is answered by now.  Shutting down, say so: whatever the
            # peer sent after is unread, so it may run it elsewhere.
            if reading.cancel_called:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await framed.send(_dumps(LINK_CLOSING))
        finally:
            await stream.aclose()
            self._served_links.remove((reading, closed))
            closed.set()

    async def close_links(self) -> None:
        """A clean shutdown, once the scope actors drained: answer the forwarded commands
        under way, tell each peer that the rest were not run here, and close the links."""
        links = list(self._served_links)
        for reading, _ in links:
            reading.cancel()
        for _, closed in links:
            await closed.wait()

    async def _run_forwarded(self, framed: _Framed, request_id: int, scope_id: str,
                             command: Command | PlatformCommand) -> None:
        """Run a peer's command for a scope (or a platform account: `scope_id` is its id) we own."""
        self.forwarded_in += 1
        registry = self.server.platform if isinstance(command, PlatformCommand) else self.server.registry
        try:
            if registry is None:  # still starting: the sender looks for the owner again
                raise LeaseLost(f"node {self.node_id} is not serving yet")
            reply = (request_id, True, await registry.submit(scope_id, command, forwarded=True))
        except Exception as exc:  # noqa: BLE001 - every outcome goes back to the caller, as it would locally
            reply = (request_id, False, exc)
        try:
            body = _dumps(reply)
            _loads(body)  # what the caller could not rebuild must not be sent
        except Exception as exc:  # noqa: BLE001 - a reply that does not survive the trip
            log.error("a forwarded reply could not be sent", extra={"error": repr(exc), "scope_id": scope_id})
            body = _dumps((request_id, False, ActorFailed("the owning node's reply could not be sent")))
        try:
            await framed.send(body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the caller's link is gone; it answers unavailable itself

    # --- the bus ----------------------------------------------------------------------------

    def _relay(self, items) -> None:
        if not self.peers_live:
            self._bus_seq += 1  # not sent: a peer that appears later sees the gap and replays
            return
        try:
            payload = encode(items)
        except Exception:  # noqa: BLE001 - never break local delivery; the peers see a gap
            log.exception("a publication could not be encoded for the bus")
            self._bus_seq += 1
            return
        if payload is not None:
            self._enqueue(payload)

    def _relay_feeds(self, offered) -> None:
        if self.peers_live:
            payload = encode_feeds(offered)
            if payload is not None:
                self._enqueue(payload)

    def _enqueue(self, payload: bytes) -> None:
        if len(self._bus_queue) >= BUS_QUEUE_LIMIT:
            # Receivers see the gap in our numbers and replay from their cursors.
            del self._bus_queue[0]
            self._bus_seq += 1
            self.bus_dropped += 1
            self._bus_settled += 1
        self._bus_queue.append(payload)
        self._bus_enqueued += 1
        self._bus_wake.set()

    def _seal(self, payload: bytes) -> bytes:
        # Anyone who can NOTIFY on the database, or publish on the NATS subject, could
        # inject a bus message: only ones sealed with the nodes' shared key are read.
        return hmac.new(self.key, payload, hashlib.sha256).digest() + payload

    def _unseal(self, sealed: bytes) -> bytes | None:
        mac, payload = sealed[:MAC_BYTES], sealed[MAC_BYTES:]
        return payload if hmac.compare_digest(mac, hmac.new(self.key, payload, hashlib.sha256).digest()) else None

    async def _send_bus(self) -> None:
        while True:
            await self._bus_wake.wait()
            self._bus_wake = trio.Event()
            while self._bus_queue:
                payloads, self._bus_queue = self._bus_queue, []
                first = self._bus_seq + 1
                self._bus_seq += len(payloads)
                try:
                    await self.transport.send(self.bus_sender, first, [self._seal(p) for p in payloads])
                    self.bus_sent += len(payloads)
                except Exception as exc:  # noqa: BLE001 - lost: the receivers see a gap and replay
                    self.bus_dropped += len(payloads)
                    log.warning("bus send failed", extra={"error": str(exc), "lost": len(payloads)})
                self._bus_settled += len(payloads)
                self._bus_progress.set()
                self._bus_progress = trio.Event()

    async def flush_bus(self) -> None:
        """A clean shutdown, once the actors drained: send what they published meanwhile before
        the bus closes.  A platform broadcast the drain finished tells the other nodes' operators
        only this way: no later publication shows them a gap to replay from."""
        enqueued = self._bus_enqueued
        while self._bus_settled < enqueued:
            await self._bus_progress.wait()

    async def _receive_bus(self, channel: trio.MemoryReceiveChannel[Delivery]) -> None:
        """Deliver what other nodes published, everything waiting at once (one database
        round trip for all of it)."""
        async for delivery in channel:
            batch = [delivery]
            while True:
                try:
                    batch.append(channel.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            payloads: list[bytes] = []
            resync: str | None = None
            for delivery in batch:
                if delivery.resync:
                    resync = "bus transport resync"
                if delivery.payload is None or delivery.sender == self.bus_sender:
                    continue
                last = self._last_seen.get(delivery.sender)
                self._last_seen[delivery.sender] = delivery.seq
                if last is not None and delivery.seq != last + 1:
                    resync = f"gap in {delivery.sender}'s bus messages"
                payload = self._unseal(delivery.payload)
                if payload is None:
                    log.warning("a bus message not sealed with this cluster's key was ignored",
                                extra={"sender": delivery.sender})
                    continue
                self.peers_live = True  # whoever publishes is alive: publish to it too
                self.bus_received += 1
                payloads.append(payload)
            if resync is not None:
                self._resync(resync)
            if not payloads:
                continue
            try:
                await self.remote.deliver(payloads)
            except DatabaseUnavailable:
                self._resync("database unavailable while delivering bus messages")
            except UnreadableBusPayload as exc:
                self._resync(str(exc))
            except Exception:  # noqa: BLE001 - one bad message must not stop the node
                log.exception("bus messages could not be delivered")
                self._resync("bus messages could not be delivered")

    def _resync(self, why: str) -> None:
        """Something from another node may be lost: every subscriber here replays from its
        cursors and is told that events not in the log may be gone (`events.missed`)."""
        self.bus_resyncs += 1
        log.warning("bus resync", extra={"why": why})
        for connection in list(self.server.connections.all):
            if connection.push is not None:
                connection.push.events_missed()


async def _acquire_free(conn: asyncpg.Connection, keys: list[str], node_id: str) -> dict[str, int]:
    await conn.execute(f"SET LOCAL lock_timeout = {ACQUIRE_LOCK_TIMEOUT_MS}")
    return await leases.acquire_free(conn, keys, node_id)


async def _acquire(conn: asyncpg.Connection, key: str, node_id: str, creating: bool,
                   kind: leases.LeasedKind) -> leases.Ownership:
    await conn.execute(f"SET LOCAL lock_timeout = {ACQUIRE_LOCK_TIMEOUT_MS}")
    return await leases.acquire(conn, key, node_id, creating=creating, kind=kind)
