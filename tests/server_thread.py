"""A server running in a trio loop of its own thread, so a hypothesis test (driving its
examples from the test's thread) runs every example against one running server."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from storage.bridge import Database, PoolSettings


class ServerThread:
    """`setup(db, url)` runs once the server listens; its result is `base`.  The server, its
    pool, WebSocket URL and nursery (for tasks in its loop) are `server`, `db`, `url` and `nursery`."""

    def __init__(self, dsn: str, config: ServerConfig,
                 setup: Callable[[Database, str], Awaitable[Any]]) -> None:
        self.dsn, self.config, self.setup = dsn, config, setup
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        started = self._ready.wait(120)
        if self._failure is not None:
            raise self._failure
        assert started, "the server did not start"
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        except trio.RunFinishedError as ended:
            if exc_type is None:  # the server died and no step noticed: say why
                raise self._cause_of_death(ended) from None
            return  # the step that noticed raised why
        self._thread.join(30)

    def run(self, fn, *args):
        """`await fn(*args)` in the server's loop, from the test's thread."""
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except (trio.Cancelled, trio.RunFinishedError) as ended:
            raise self._cause_of_death(ended) from None  # the server's loop ended under this call

    def _cause_of_death(self, noticed: BaseException) -> BaseException:
        """What killed the server (once its thread has ended), else `noticed`."""
        self._thread.join(10)
        return self._failure or noticed

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the test's thread
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        async with Database(self.dsn, PoolSettings(min_size=1, max_size=10)) as db, \
                trio.open_nursery() as nursery:
            server = Server(self.config, db, Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()),
                                                          self.config.session_ttl_seconds))
            await nursery.start(server.run)
            self.server, self.db, self.url, self.nursery = server, db, f"ws://127.0.0.1:{server.port}", nursery
            self.base = await self.setup(db, self.url)
            self._token, self._stop = trio.lowlevel.current_trio_token(), trio.Event()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()
