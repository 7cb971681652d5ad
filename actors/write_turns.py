"""Message-writing batches per workspace, on this node: two at a time.

A batch that sends messages locks its workspace's counter row
(workspace_message_counters) from allocation to commit, so within a workspace
those batches commit one after another whatever happens here.  Waiting for
that row inside PostgreSQL, a scope actor's batch is closed before the wait:
the sends that reach its mailbox during the wait (while the other scopes of
the workspace commit) go into a later batch, and the waiting statement holds
a pooled connection.  Waiting here first, the actor closes its batch when its
write can start: it takes in everything that arrived meanwhile, and holds no
connection while it waits.  Two turns, not one: the batch that has the second
waits in PostgreSQL behind the committing one and starts the moment that
commits (with one, the next batch would start only after the commit's reply
came back here and its own statement went out: a round trip per commit).  The
counter row stays what orders the commits (other nodes, other writers).
"""

from __future__ import annotations

import trio


TURNS_PER_WORKSPACE = 2


class WriteTurns:
    """Fair (first come, first served) turns per workspace; a workspace's semaphore is
    kept only while some actor holds or awaits a turn."""

    def __init__(self) -> None:
        self._turns: dict[str, tuple[trio.Semaphore, int]] = {}
        # Actors waiting for a turn now (a metric: how much the workspaces' writes queue).
        self.waiting = 0

    def busy(self, workspace_id: str) -> bool:
        """Whether taking a turn of the workspace now would wait."""
        entry = self._turns.get(workspace_id)
        return entry is not None and entry[0].value == 0

    async def acquire(self, workspace_id: str) -> None:
        turns, users = self._turns.get(workspace_id) or (trio.Semaphore(TURNS_PER_WORKSPACE), 0)
        self._turns[workspace_id] = (turns, users + 1)
        try:
            # A free turn (none awaited: a release hands it to the first waiter) is taken
            # without yielding: an actor whose commit just answered a batch starts the next
            # one before the answered callers' tasks run (their replies would delay the
            # commit, not grow it — their next sends cannot have arrived yet).
            turns.acquire_nowait()
            return
        except trio.WouldBlock:
            pass
        self.waiting += 1
        try:
            await turns.acquire()
        except BaseException:
            self._leave(workspace_id)
            raise
        finally:
            self.waiting -= 1

    def release(self, workspace_id: str) -> None:
        self._turns[workspace_id][0].release()
        self._leave(workspace_id)

    def _leave(self, workspace_id: str) -> None:
        turns, users = self._turns[workspace_id]
        if users == 1:
            del self._turns[workspace_id]
        else:
            self._turns[workspace_id] = (turns, users - 1)
