"""Idle connections without a task (issue 11, goal 4: memory per idle connection).

A connection's task waiting for its next command holds ~3.4 KB: the task, its
coroutine frames and trio's readiness wait (the epoll registration's closure and
cancel scope).  A connection idle past `park_after_idle_seconds` gives that up:
its task ends and the connection waits here, as a file descriptor in one epoll
set of this node's own and a deadline in one heap.  Readable data (a command, a
pong, the peer's close), the connection's deadline (idle timeout) or a close or
abort from another task (`WebSocket.unpark_hook`) starts a fresh task that serves
it from where it left off.  Writes never needed the task: pushes and pings go
straight to the socket.

At most `max_woken` woken connections are served at once: a reconnect storm's
thousands of commands would otherwise each hold a task, its frames and a queued
database unit together, and that burst, freed between the connections' long-lived
objects, stays in the allocator's arenas as RSS.  Beyond that a woken connection
waits its turn (its input stays in the kernel's socket buffer) until a served one
gives its turn back: when it has answered its first command, has nothing whole
to read, parks again or closes.  A turn never covers waiting for a client.
"""

from __future__ import annotations

import heapq
import itertools
import math
import select
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

_READY = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLERR | select.EPOLLHUP


class ParkingLot:
    """One node's parked connections: `park`, and `run` wakes each one into
    `resume(connection)` (called on the trio thread, once per parking) when it has
    a turn; the resumed task calls `turn_done()` once."""

    def __init__(self, resume: Callable[[Any], None], max_woken: int) -> None:
        self._resume = resume
        self._max_woken = max_woken
        self.woken = 0  # resumed connections that have not given their turn back
        self._waiting_turn: deque[Any] = deque()
        self._epoll = select.epoll()
        # fd -> (connection, parking number): the number tells a heap entry of an
        # earlier parking of the same connection (or of a reused fd) from this one.
        self._parked: dict[int, tuple[Any, int]] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, parking number, fd)
        self._numbers = itertools.count()
        self._wait: trio.CancelScope | None = None
        self._running = False
        # Every parked WebSocket's hook: one bound method, not a closure per connection.
        self._unpark_hook = self._unpark

    def __len__(self) -> int:
        """Connections waiting without a task: parked, or woken and waiting their turn."""
        return len(self._parked) + len(self._waiting_turn)

    @property
    def waiting_turn(self) -> int:
        return len(self._waiting_turn)

    def park(self, connection: Any, deadline: float) -> bool:
        """Hold `connection` (its task ends on True) until its socket is readable,
        `deadline` passes, or its WebSocket calls the hook set here.  False while
        the lot is not running: the task keeps the connection."""
        if self._epoll.closed or not self._running:
            return False
        ws = connection.ws
        fd = ws.fileno()
        number = next(self._numbers)
        self._epoll.register(fd, _READY | select.EPOLLONESHOT)
        self._parked[fd] = (connection, number)
        ws.unpark_hook = self._unpark_hook
        if deadline < math.inf:
            heapq.heappush(self._deadlines, (deadline, number, fd))
            if self._wait is not None and deadline < self._wait.deadline:
                self._wait.deadline = deadline
        return True

    def _unpark(self, ws: Any) -> None:
        parked = self._parked.get(ws.fileno())
        if parked is not None and parked[0].ws is ws:
            self._wake(ws.fileno(), parked[1])

    def _wake(self, fd: int, number: int) -> None:
        parked = self._parked.get(fd)
        if parked is None or parked[1] != number:
            return
        del self._parked[fd]
        connection = parked[0]
        connection.ws.unpark_hook = None
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass  # already closed: nothing left to unregister
        if self.woken < self._max_woken or not self._running:
            self.woken += 1
            self._resume(connection)
        else:
            self._waiting_turn.append(connection)

    def turn_done(self) -> None:
        """A resumed connection's task gives its turn back: to the longest waiting."""
        if self._waiting_turn:
            self._resume(self._waiting_turn.popleft())
        else:
            self.woken -= 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        task_status.started()
        try:
            while True:
                with trio.CancelScope(deadline=self._deadlines[0][0] if self._deadlines else math.inf) as wait:
                    self._wait = wait
                    await trio.lowlevel.wait_readable(self._epoll.fileno())
                self._wait = None
                for fd, _ in self._epoll.poll(0):
                    parked = self._parked.get(fd)
                    if parked is not None:
                        self._wake(fd, parked[1])
                now = trio.current_time()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, number, fd = heapq.heappop(self._deadlines)
                    self._wake(fd, number)
                # Entries of connections woken otherwise stay until their deadline: drop
                # them when they outnumber the parked, so the heap stays O(parked).
                if len(self._deadlines) > 2 * len(self._parked) + 64:
                    self._deadlines = [entry for entry in self._deadlines
                                       if self._parked.get(entry[2], (None, -1))[1] == entry[1]]
                    heapq.heapify(self._deadlines)
        finally:
            self._running = False
            self._wait = None
            # Whatever is still parked is served by a task again (the server's close of
            # every connection, which follows, then finishes it there).
            for fd, (_, number) in list(self._parked.items()):
                self._wake(fd, number)
            while self._waiting_turn:
                self.woken += 1
                self._resume(self._waiting_turn.popleft())
            self._epoll.close()
