"""Shared helpers for the platform service-account tests (issue 15), driving the
real server over the WebSocket: an operator connection with a platform-event
memory, account create / ready, broadcast / completion, and a workspace
member's view of a platform account's conversation.

Usage:

    async with operator(app) as ops:            # ops: PlatformFeed (ops.conn, ops.operator_id)
        account = await create_platform_account(ops, "News")
        await wait_ready(ops, account["id"])
        sent = await broadcast(ops, account["id"], "b-1")
        done = await wait_broadcast_done(ops, sent["id"])
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import trio

from client import connect
from server.ops.platform import create_operator
from tests.conftest import App

EVENT_TIMEOUT = 60  # generous: provisioning every workspace on a busy 2-core machine
ACCOUNT_EVENTS = ("platform_service_account.updated", "platform_service_account.instance_changed")


class PlatformFeed:
    """An authenticated operator connection subscribed to the platform events,
    with a memory: `wait` returns the first matching event whether it arrived
    before the call or arrives later, so a test never misses an event that
    overtook the reply it was waiting for.  `call` is the connection's."""

    def __init__(self, conn, operator_id: str, key: str) -> None:
        self.conn, self.operator_id, self.key = conn, operator_id, key
        self.seen: list[dict] = []
        self._taken: set[int] = set()

    async def call(self, op: str, **fields):
        return await self.conn.call(op, **fields)

    def _matches(self, index: int, names: tuple[str, ...], predicate: Callable[[dict], bool]) -> bool:
        event = self.seen[index]
        return event["event"] in names and predicate(event["data"])

    async def next_index(self, names: str | tuple[str, ...], predicate: Callable[[dict], bool] = lambda d: True,
                         start: int = 0, take: bool = False) -> int:
        """The index in `seen` of the first event at or after `start` named one of
        `names` whose data satisfies `predicate` (not yet taken, when `take`),
        reading more from the connection as needed."""
        names = (names,) if isinstance(names, str) else names
        index = start
        with trio.fail_after(EVENT_TIMEOUT):
            while True:
                while index < len(self.seen):
                    if not (take and index in self._taken) and self._matches(index, names, predicate):
                        if take:
                            self._taken.add(index)
                        return index
                    index += 1
                self.seen.append(await self.conn.next_event())

    async def wait(self, name: str, predicate: Callable[[dict], bool] = lambda d: True) -> dict:
        """The data of the next not-yet-taken event `name` whose data satisfies `predicate`."""
        return self.seen[await self.next_index(name, predicate, take=True)]["data"]

    async def find(self, name: str, predicate: Callable[[dict], bool] = lambda d: True) -> dict:
        """The data of the first event `name` (taken or not) satisfying `predicate`, waiting if needed."""
        return self.seen[await self.next_index(name, predicate)]["data"]

    async def drain(self) -> list[dict]:
        """Every event delivered up to a ping round trip, without waiting for more."""
        await self.conn.call("ping")
        self.seen.extend(self.conn.queued_events())
        return self.seen

    def named(self, name: str, predicate: Callable[[dict], bool] = lambda d: True) -> list[dict]:
        return [e["data"] for e in self.seen if e["event"] == name and predicate(e["data"])]


@contextlib.asynccontextmanager
async def operator(app: App, name: str = "ops") -> AsyncIterator[PlatformFeed]:
    """A new platform operator (storage, as `scopewire admin operator create`
    does) with a connection authenticated by its operator key and subscribed to
    the platform events."""
    operator_id, _key_id, key = await create_operator(app.db, name)
    async with connect(app.url) as conn:
        result = await conn.call("auth", operator_key=key)
        assert result["principal"] == "operator" and result["operator_id"] == operator_id, result
        await conn.call("platform.subscribe")
        yield PlatformFeed(conn, operator_id, key)


async def create_platform_account(ops, name: str, description: str = "") -> dict:
    """platform.account.create; the PlatformAccountInfo."""
    account = await ops.call("platform.account.create", name=name, description=description)
    assert account["name"] == name.strip(), account
    return account


async def get_account(ops, account_id: str) -> dict:
    return await ops.call("platform.account.get", platform_service_account_id=account_id)


async def wait_ready(ops: PlatformFeed, account_id: str) -> dict:
    """The account (PlatformAccountInfo) once its provisioning is `ready`:
    reads it, and otherwise waits for the next `updated` / `instance_changed`
    event of the account before reading again (events, not sleeps)."""
    mine = lambda data: data["platform_service_account_id"] == account_id  # noqa: E731
    position = len(ops.seen)
    while True:
        account = await get_account(ops, account_id)
        if account["provisioning"]["state"] == "ready":
            return account
        position = await ops.next_index(ACCOUNT_EVENTS, mine, start=position) + 1


async def instances(ops, account_id: str) -> list[dict]:
    """Every InstanceInfo of the account, by workspace id (all pages)."""
    found, cursor = [], None
    while True:
        page = await ops.call("platform.account.instances", platform_service_account_id=account_id, limit=200,
                              **({"cursor": cursor} if cursor else {}))
        found.extend(page["instances"])
        cursor = page.get("next_cursor")
        if not cursor:
            return found


async def broadcast(ops, account_id: str, client_id: str, title: str = "t", content: str = "c") -> dict:
    """platform.broadcast.create; the BroadcastInfo (accepted, not yet delivered)."""
    return await ops.call("platform.broadcast.create", platform_service_account_id=account_id,
                          client_broadcast_id=client_id, title=title, content=content)


async def wait_broadcast_done(ops: PlatformFeed, broadcast_id: str) -> dict:
    """The BroadcastInfo carried by the broadcast's `broadcast_completed` event."""
    data = await ops.find("platform_service_account.broadcast_completed",
                          lambda d: d["broadcast"]["id"] == broadcast_id)
    return data["broadcast"]


async def local_account(conn, workspace_id: str, platform_account_id: str) -> dict | None:
    """The AuthorProfile of the platform account's instance in the workspace, as
    a member sees it in service_account.list (None if there is none)."""
    cursor = None
    while True:
        page = await conn.call("service_account.list", workspace_id=workspace_id, limit=200,
                               **({"cursor": cursor} if cursor else {}))
        for profile in page["accounts"]:
            if profile["principal_id"] == platform_account_id:
                return profile
        cursor = page.get("next_cursor")
        if not cursor:
            return None


async def conversation_messages(conn, workspace_id: str, platform_account_id: str) -> list[dict]:
    """Every message (MessageInfo, oldest first) of the platform account's
    conversation in the workspace, read by the connection's human."""
    profile = await local_account(conn, workspace_id, platform_account_id)
    assert profile is not None, f"no instance of {platform_account_id} in {workspace_id}"
    messages: list[dict] = []
    before = None
    while True:
        page = await conn.call("message.history", workspace_id=workspace_id, scope_id=profile["scope_id"], limit=200,
                               **({"before_seq": before} if before else {}))
        messages[:0] = page["messages"]
        if not page["has_more"] or not page["messages"]:
            return messages
        before = page["messages"][0]["seq"]
