"""Shared helpers for the workspace service-account tests (issue 14): a team
with every role, a workspace-feed event log, policy and create shortcuts, the
Approvals app's DM messages, and a scan for rows still naming deleted ids."""

from __future__ import annotations

import pytest
import trio

from client import ClientError
from tests.conftest import App, add_person
from tests.test_tenancy import expect_error

EVENT_TIMEOUT = 30  # generous: a busy 2-core machine
CARD_TYPES = ("app_interactive_card", "app_notification")


@pytest.fixture
async def org(app: App, tenants, member_password_hash):
    """Alpha's owner plus an admin (adam), two developers (bob, dave), an operator
    (carol) and a viewer (vera); Beta (its owner only) for cross-workspace probes."""
    alpha, beta = tenants
    people = {}
    for name, role in (("adam", "admin"), ("bob", "developer"), ("dave", "developer"), ("carol", "operator"),
                       ("vera", "viewer")):
        people[name] = await add_person(app.db, alpha.workspace_id, f"{name}@example.com", role,
                                        member_password_hash)
    return alpha, beta, people


def ws_of(tenant) -> dict:
    return {"workspace_id": tenant.workspace_id}


class Feed:
    """A connection's workspace feed with a memory: `wait` returns the first
    event (seen before or arriving later) that matches, so a test never misses
    an event that overtook the reply it was waiting for."""

    def __init__(self, conn, ws: dict) -> None:
        self.conn, self.ws = conn, ws
        self.seen: list[dict] = []
        self._taken: set[int] = set()

    @classmethod
    async def open(cls, conn, ws: dict) -> Feed:
        await conn.call("subscribe", workspace_feed=True, **ws)
        return cls(conn, ws)

    def _match(self, index: int, name: str, predicate) -> bool:
        event = self.seen[index]
        return index not in self._taken and event["event"] == name and predicate(event["data"])

    async def wait(self, name: str, predicate=lambda data: True) -> dict:
        """The data of the next not-yet-taken event `name` whose data satisfies `predicate`."""
        for index in range(len(self.seen)):
            if self._match(index, name, predicate):
                self._taken.add(index)
                return self.seen[index]["data"]
        with trio.fail_after(EVENT_TIMEOUT):
            while True:
                self.seen.append(await self.conn.next_event())
                if self._match(len(self.seen) - 1, name, predicate):
                    self._taken.add(len(self.seen) - 1)
                    return self.seen[-1]["data"]

    async def drain(self) -> list[dict]:
        """Every event delivered up to a ping round trip, without waiting for more."""
        await self.conn.call("ping")
        self.seen.extend(self.conn.queued_events())
        return self.seen

    def named(self, name: str, predicate=lambda data: True) -> list[dict]:
        return [e["data"] for e in self.seen if e["event"] == name and predicate(e["data"])]


async def set_policy(conn, ws: dict, policy: str) -> dict:
    current = await conn.call("service_account.policy.get", **ws)
    return await conn.call("service_account.policy.set", creation_policy=policy,
                           expected_version=current["version"], **ws)


async def wait_ready(feed: Feed, service_account_id: str) -> dict:
    """The audience_changed event that made the account's audience ready."""
    return await feed.wait("service_account.audience_changed",
                           lambda d: d["service_account_id"] == service_account_id
                           and d["audience"]["state"] == "ready")


async def create_ready(feed: Feed, name: str, client_request_id: str | None = None, description: str = "") -> dict:
    """A direct create by the feed's connection, returned once fulfilled:
    {"request": CreateRequestInfo, "account": ServiceAccountDetail}."""
    conn, ws = feed.conn, feed.ws
    request = await conn.call("service_account.request.submit", client_request_id=client_request_id or f"c-{name}",
                              name=name, description=description, **ws)
    assert request["authorization_path"] == "direct_create", request
    account_id = request["created_service_account_id"]
    await wait_ready(feed, account_id)
    request = await conn.call("service_account.request.get", request_id=request["id"], **ws)
    assert request["business_state"] == "fulfilled", request
    account = await conn.call("service_account.get", service_account_id=account_id, **ws)
    return {"request": request, "account": account}


async def approvals_messages(conn, ws: dict) -> list[dict]:
    """Every Approvals-app card / receipt / result in the caller's DMs, oldest first."""
    found = []
    page = await conn.call("inbox.list", limit=200, **ws)
    for conversation in page["conversations"]:
        if conversation["type"] != "dm":
            continue
        history = await conn.call("message.history", scope_id=conversation["scope_id"], limit=200, **ws)
        found.extend(m for m in history["messages"] if m["message_type"] in CARD_TYPES)
    return sorted(found, key=lambda m: (m["created_at_ms"], m["global_seq"]))


def cards_for(messages: list[dict], approval_id: str) -> list[dict]:
    return [m for m in messages if (m.get("metadata", {}).get("card") or {}).get("approval_id") == approval_id]


async def unread_in_dms(conn, ws: dict) -> int:
    page = await conn.call("inbox.list", limit=200, **ws)
    return sum(c["unread_count"] for c in page["conversations"] if c["type"] == "dm")


async def expect_reason(code: str, reason: str, coro) -> ClientError:
    error = await expect_error(code, coro)
    assert error.details.get("reason") == reason, (error, error.details)
    return error


async def expect_idempotency_conflict(coro) -> ClientError:
    """design.md writes 'conflict `idempotency_conflict`'; the protocol has a code of
    that name (message.send uses it), and the service-account ops answer with it too."""
    return await expect_error("idempotency_conflict", coro)


async def text_columns_naming(db, ids: list[str], skip_tables: tuple[str, ...] = ()) -> dict[str, int]:
    """{"table.column": rows} for every text column of every table in the public
    schema (except `skip_tables`) that still holds one of `ids`."""
    async def scan(conn):
        columns = await conn.fetch(
            "SELECT c.table_name, c.column_name FROM information_schema.columns c "
            "JOIN information_schema.tables t ON t.table_schema = c.table_schema AND t.table_name = c.table_name "
            "WHERE c.table_schema = 'public' AND t.table_type = 'BASE TABLE' "
            "AND c.data_type IN ('text', 'character varying') ORDER BY 1, 2")
        found = {}
        for table, column in columns:
            if table in skip_tables:
                continue
            count = await conn.fetchval(f'SELECT count(*) FROM "{table}" WHERE "{column}" = ANY($1::text[])', ids)
            if count:
                found[f"{table}.{column}"] = count
        return found

    return await db.run(scan)
