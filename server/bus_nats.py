"""The cross-node bus over core NATS (the second `BusTransport` of server/bus.py).

nats-py is asyncio-only, so the client runs on the Database bridge's asyncio
loop (`Database.on_loop`), sharing its thread.  There is no `pump` task: the
subscription callback hands each delivery to trio through the trio token, and
one trio wakeup drains a burst into a bounded channel; when the reader falls
behind, deliveries are dropped and the next one carries `resync=True`
(storage/bridge.py's ResyncOnOverflow, which LISTEN uses too).

Core NATS is at-most-once: what is published while a node is disconnected is
lost, so after nats-py reconnects (and has subscribed again) the channel gets
`Delivery("", 0, None, resync=True)`.  If the client gives up altogether (the
server closed it for a protocol or authorization error), a new client is
connected with the same backoff and a resync follows too; the channel ends
only on `aclose`.

One NATS message per payload: a small binary header (format, bus seq, sender)
and the payload bytes.  A payload that does not fit the server's max_payload
with its header raises `BusPayloadTooLarge` before anything of that send is
published.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import struct

import nats.errors
import trio
from nats.aio.client import Client
from nats.aio.msg import Msg

from server.bus import Delivery
from storage.bridge import Database, ResyncOnOverflow

log = logging.getLogger("scopewire.bus.nats")

_HEADER = struct.Struct(">BqH")  # format, bus seq, sender length; then the sender (UTF-8), then the payload
_FORMAT = 1
_RESYNC = Delivery("", 0, None, resync=True)


class BusUnavailable(Exception):
    """NATS did not take the send: not connected, or the server did not confirm in time.
    Some of the payloads may still arrive."""


class BusPayloadTooLarge(ValueError):
    """A payload with its header exceeds the NATS server's max_payload; nothing of the send was published."""


def encode(sender: str, seq: int, payload: bytes) -> bytes:
    name = sender.encode()
    return _HEADER.pack(_FORMAT, seq, len(name)) + name + payload


def decode(data: bytes) -> tuple[str, int, bytes]:
    """(sender, bus seq, payload); ValueError when `data` is not a bus message."""
    try:
        form, seq, name_length = _HEADER.unpack_from(data)
    except struct.error as exc:
        raise ValueError("shorter than a bus header") from exc
    start = _HEADER.size + name_length
    if form != _FORMAT or len(data) < start:
        raise ValueError("not a bus message")
    return data[_HEADER.size:start].decode(), seq, data[start:]


class NatsTransport:
    """Publishes on and subscribes to `subject`; has no `pump`: deliveries reach the
    channel from the NATS callbacks.  `send` raises BusUnavailable or BusPayloadTooLarge."""

    name = "nats"

    def __init__(self, db: Database, url: str, subject: str = "scopewire.bus", *, buffer: int = 4096,
                 send_timeout: float = 5.0, open_timeout: float = 10.0, reconnect_wait: float = 1.0) -> None:
        self.db = db
        self.url = url
        self.subject = subject
        self._send_timeout = send_timeout
        self._open_timeout = open_timeout
        self._reconnect_wait = reconnect_wait
        self._send, self._receive = trio.open_memory_channel[Delivery](buffer)
        self._handover = ResyncOnOverflow(self._send)
        self._node_id = ""
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._closed = False
        # Loop side (owned by the bridge's asyncio thread).
        self._client: Client | None = None
        self._keeper: asyncio.Task | None = None
        self._stopping = False
        self._publish_lock: asyncio.Lock | None = None
        self._confirm_subject = ""
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self._confirmation_numbers = itertools.count()
        # Loop -> trio hand-over: the loop appends and wakes trio once per burst.
        self._inbox: collections.deque[Delivery] = collections.deque()
        self._wake_pending = False

    # --- trio side -------------------------------------------------------------------

    async def open(self, node_id: str) -> trio.MemoryReceiveChannel[Delivery]:
        if self._trio_token is not None:
            raise RuntimeError("NatsTransport.open called twice")
        self._node_id = node_id
        self._trio_token = trio.lowlevel.current_trio_token()
        await self.db.on_loop(self._start_on_loop)
        return self._receive

    async def send(self, sender: str, first_seq: int, payloads: list[bytes]) -> None:
        """Publish in order; returns once the NATS server has processed every payload."""
        if not payloads:
            return
        client = self._client
        if client is None or not client.is_connected:
            raise BusUnavailable(f"NATS at {self.url} is not connected")
        messages = [encode(sender, first_seq + offset, payload) for offset, payload in enumerate(payloads)]
        limit = client.max_payload
        for offset, message in enumerate(messages):
            if len(message) > limit:
                header = len(message) - len(payloads[offset])
                raise BusPayloadTooLarge(
                    f"bus payload {sender}:{first_seq + offset} is {len(payloads[offset])} bytes; with its "
                    f"{header}-byte header it exceeds the NATS server's max_payload of {limit} bytes")
        await self.db.on_loop(lambda: self._publish(messages))

    async def aclose(self) -> None:
        """Close the NATS client and end the delivery channel.  Call it before the Database's aclose."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            if self._trio_token is not None:
                await self.db.on_loop(self._stop_on_loop)
            await self._send.aclose()

    def _drain_inbox(self) -> None:
        self._wake_pending = False
        while self._inbox:
            if not self._handover.offer(self._inbox.popleft()):
                self._inbox.clear()  # the channel is closed: nothing more is taken
                return

    # --- asyncio side (the bridge's loop) --------------------------------------------

    def _push(self, delivery: Delivery) -> None:
        self._inbox.append(delivery)
        if not self._wake_pending:
            self._wake_pending = True
            assert self._trio_token is not None
            try:
                self._trio_token.run_sync_soon(self._drain_inbox)
            except trio.RunFinishedError:
                pass

    async def _start_on_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._publish_lock = asyncio.Lock()
        ready: asyncio.Future[None] = loop.create_future()
        self._keeper = loop.create_task(self._keep_connected(ready))
        await asyncio.wait({ready, self._keeper}, timeout=self._open_timeout, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            await self._stop_on_loop()
            raise BusUnavailable(f"could not connect to NATS at {self.url} within {self._open_timeout} s")

    async def _keep_connected(self, ready: asyncio.Future[None]) -> None:
        """Hold one connected client.  nats-py reconnects by itself (forever); a client
        that was closed for good is replaced after `reconnect_wait`."""
        connected_before = False
        while True:
            client = Client()
            closed = asyncio.Event()

            async def on_closed() -> None:
                closed.set()

            try:
                try:
                    await self._connect(client, on_closed)
                except Exception as exc:  # noqa: BLE001 - any failure to connect means "try again later"
                    log.warning("NATS connect failed: %r", exc)
                    await asyncio.sleep(self._reconnect_wait)
                    continue
                self._client = client
                if connected_before:
                    self._push(_RESYNC)
                else:
                    ready.set_result(None)
                connected_before = True
                await closed.wait()
                log.warning("NATS client closed (%r); connecting a new one", client.last_error)
                await asyncio.sleep(self._reconnect_wait)
            finally:
                self._client = None
                await self._close_client(client)

    async def _connect(self, client: Client, on_closed) -> None:
        await client.connect(
            self.url,
            name=f"scopewire-bus-{self._node_id}",
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=self._reconnect_wait,  # type: ignore[arg-type]  # a float works
            # No buffering while disconnected: a send then fails at once instead of
            # being published minutes later, after the receivers' resync.
            pending_size=-1,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=on_closed,
        )
        self._confirm_subject = client.new_inbox()
        await client.subscribe(self.subject, cb=self._on_message)
        await client.subscribe(self._confirm_subject, cb=self._on_confirmation)
        await self._confirm(client)  # the server has both subscriptions: every later send reaches us

    async def _publish(self, messages: list[bytes]) -> None:
        assert self._publish_lock is not None
        try:
            # The lock keeps each send's messages together and sends in submission order;
            # confirmations are awaited outside it, so sends pipeline.
            async with self._publish_lock:
                client = self._client
                if client is None or not client.is_connected:
                    raise BusUnavailable(f"NATS at {self.url} is not connected")
                for message in messages:
                    await client.publish(self.subject, message)
            await self._confirm(client)
        except asyncio.TimeoutError as exc:
            raise BusUnavailable(f"NATS at {self.url} did not confirm the send within {self._send_timeout} s") from exc
        except (nats.errors.Error, OSError) as exc:
            raise BusUnavailable(f"NATS publish failed: {exc!r}") from exc

    async def _confirm(self, client: Client) -> None:
        """Return once the server has processed everything this client sent before: a marker
        published to our own inbox comes back only after the commands queued ahead of it.
        (nats-py 2.16's `flush()` writes its PING straight to the socket, ahead of PUBs
        still queued for its flusher task, so its PONG proves nothing about them.)"""
        token = str(next(self._confirmation_numbers)).encode()
        arrived: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._confirmations[token] = arrived
        try:
            await client.publish(self._confirm_subject, token)
            await asyncio.wait_for(arrived, self._send_timeout)
        finally:
            del self._confirmations[token]

    async def _on_confirmation(self, msg: Msg) -> None:
        arrived = self._confirmations.get(msg.data)
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

    async def _on_message(self, msg: Msg) -> None:
        try:
            sender, seq, payload = decode(msg.data)
        except (ValueError, UnicodeDecodeError):
            log.warning("unreadable NATS bus message ignored (%d bytes)", len(msg.data))
            return
        if sender != self._node_id:  # NATS echoes our own (the send confirmation needs echo on)
            self._push(Delivery(sender, seq, payload))

    async def _on_reconnected(self) -> None:
        # nats-py calls this after subscribing again and a PING round trip (its SUBs are
        # written ahead of that PING): everything published from now on reaches us.
        log.warning("NATS reconnected; messages may have been lost: resync")
        self._push(_RESYNC)

    async def _on_disconnected(self) -> None:
        if not self._stopping:
            log.warning("NATS connection lost; reconnecting")

    async def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            self._push(_RESYNC)  # nats-py dropped a message for us
        log.warning("NATS: %r", exc)

    async def _stop_on_loop(self) -> None:
        self._stopping = True
        if self._keeper is not None:
            self._keeper.cancel()
            try:
                await self._keeper
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - stopping anyway
                log.exception("NATS keeper failed")

    async def _close_client(self, client: Client) -> None:
        if client.is_closed:
            return
        try:
            await asyncio.wait_for(client.close(), timeout=5)
        except Exception as exc:  # noqa: BLE001 - the client is abandoned either way
            log.warning("NATS close failed: %r", exc)
