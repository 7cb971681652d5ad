"""Operability against a real server: /healthz, /readyz and /metrics over
plain HTTP, --metrics-port, structured log context, slow-command logs and
`scopewire status`."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from client import ClientError, connect
from server.config import ServerConfig
from server.logs import JsonFormatter
from server.transport import CONNECTION_TASK_NAME
from tests.conftest import App, add_person
from tests.test_messaging import open_channel
from tests.test_tenancy import signed_in

SCOPEWIRE = [sys.executable, "-m", "server.cli"]
PROJECT_ROOT = Path(__file__).resolve().parents[1]


class HttpReply:
    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}

    def json(self) -> dict:
        return json.loads(self.body)


async def http_get(port: int, path: str, method: str = "GET") -> HttpReply:
    """One plain HTTP/1.1 request; the server answers and closes."""
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            raw = b""
            while chunk := await stream.receive_some(65536):
                raw += chunk
    return HttpReply(raw)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(port: int) -> dict[tuple[str, tuple], float]:
    reply = await http_get(port, "/metrics")
    assert reply.status == 200, reply.body
    return samples(reply.body.decode())


def value(figures: dict, name: str, **labels: str) -> float:
    return figures.get((name, tuple(sorted(labels.items()))), 0.0)


# --- the endpoints ------------------------------------------------------------------------------

async def test_health_ready_and_metrics_answer_plain_http_on_the_websocket_port(app: App):
    port = app.server.port
    health = await http_get(port, "/healthz")
    assert (health.status, health.headers["content-type"], health.json()) == (200, "application/json",
                                                                              {"status": "ok"})
    ready = await http_get(port, "/readyz")
    assert ready.status == 200, ready.body
    assert ready.json()["status"] == "ready"
    assert {name: check["ok"] for name, check in ready.json()["checks"].items()} == {
        "accepting": True, "database": True, "migrations": True, "node_lease": True}
    metrics = await http_get(port, "/metrics")
    assert metrics.status == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(metrics.body.decode())}
    assert {"scopewire_connections", "scopewire_commands", "scopewire_auth_failures",
            "scopewire_command_duration_seconds", "scopewire_actors_active", "scopewire_actor_mailbox_depth",
            "scopewire_actors_waiting_write_turn",
            "scopewire_actor_batch_size", "scopewire_actor_commit_duration_seconds", "scopewire_fanout_deliveries",
            "scopewire_fanout_bytes", "scopewire_slow_consumer_closes", "scopewire_push_gap_replays",
            "scopewire_outbox_backlog",
            "scopewire_outbox_retries", "scopewire_bridge_queue_depth",
            "scopewire_bridge_waiting_for_connection", "scopewire_db_pool_connections",
            "scopewire_node_info", "scopewire_node_lease_healthy", "scopewire_forwarded_commands",
            "scopewire_bus_messages_sent", "scopewire_bus_messages_received", "scopewire_bus_resyncs",
            "scopewire_bus_database_reads"} <= names
    # HEAD: the same status and headers, no body.
    head = await http_get(port, "/healthz", method="HEAD")
    assert (head.status, head.body) == (200, b"")
    # Anything else that is not a WebSocket upgrade is still refused.
    assert (await http_get(port, "/elsewhere")).status == 400
    assert (await http_get(port, "/healthz", method="POST")).status == 400


async def test_metrics_move_when_commands_run(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    port = app.server.port
    before = await scrape(port)
    assert value(before, "scopewire_connections", state="authenticated") == 0
    async with connect(app.url) as stranger:
        with pytest.raises(ClientError):
            await stranger.call("login", email=alpha.owner.email, password="wrong-password-1")
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "metered")
        await owner.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        for i in range(5):
            await owner.call("message.send", scope_id=channel["id"], content=f"m{i}", **ws)
        for _ in range(5):
            await owner.next_event()  # the five pushes reached this subscriber
        during = await scrape(port)
    assert value(during, "scopewire_connections", state="authenticated") == 1
    # The scrape itself is a plain HTTP request on the WebSocket port, not a handshake.
    assert value(during, "scopewire_connections", state="http") == 1
    assert value(during, "scopewire_connections", state="handshaking") == 0
    assert value(during, "scopewire_connections_parked") == 1  # idle between commands: no task (server/parking.py)
    assert value(during, "scopewire_connections_waiting_turn") == 0
    assert value(during, "scopewire_commands_total", op="message.send", outcome="ok") == 5
    assert value(during, "scopewire_commands_total", op="login", outcome="ok") == 1
    assert value(during, "scopewire_commands_total", op="login", outcome="unauthenticated") == 1
    assert value(during, "scopewire_auth_failures_total", code="unauthenticated") == 1
    assert value(during, "scopewire_command_duration_seconds_count", op="message.send") == 5
    assert value(during, "scopewire_fanout_deliveries_total") >= 5
    assert value(during, "scopewire_fanout_bytes_total") > 5 * len("m0")
    assert value(during, "scopewire_actor_batch_size_count") >= 1
    assert value(during, "scopewire_actor_batch_size_sum") >= 5  # every send went through a batch
    assert value(during, "scopewire_actor_commit_duration_seconds_count") >= 1
    assert value(during, "scopewire_actors_active") >= 1
    assert value(during, "scopewire_outbox_backlog") >= 0  # the database answered: present
    assert value(during, "scopewire_db_pool_max") == app.db.settings.max_size


async def test_routed_delivery_metrics_count_handouts_suppressions_and_feeds(app: App, tenants,
                                                                              member_password_hash):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        scope = {"scope_id": (await open_channel(owner, alpha.workspace_id, "routed", [bob.member_id]))["id"], **ws}
        withdrawn = await owner.call("message.send", content="never mind", recipient_member_ids=[bob.member_id],
                                     **scope)
        await owner.call("message.withdraw", message_id=withdrawn["id"], **ws)
        await b.call("delivery.subscribe", **ws)
        await owner.call("message.send", content="for you", recipient_member_ids=[bob.member_id], **scope)
        with trio.fail_after(30):
            event = await b.next_event()
        assert event["data"]["message"]["content"] == "for you"  # the withdrawn one never came
        during = await scrape(app.server.port)
    assert value(during, "scopewire_routed_deliveries_handed_out_total") == 1
    assert value(during, "scopewire_routed_deliveries_suppressed_total") == 1
    assert value(during, "scopewire_routed_feed_subscriptions") == 1


async def test_readyz_turns_503_while_the_database_is_unreachable_and_back(app: App, pg_cluster, database_dsn):
    name = urlsplit(database_dsn).path.lstrip("/")
    admin = pg_cluster.dsn("postgres")

    async def as_admin(*statements: str) -> None:
        def run() -> None:
            import asyncio

            async def go() -> None:
                conn = await asyncpg.connect(admin)
                try:
                    for statement in statements:
                        await conn.execute(statement)
                finally:
                    await conn.close()
            asyncio.run(go())
        await trio.to_thread.run_sync(run)

    assert (await http_get(app.server.port, "/readyz")).status == 200
    await as_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false',
                   f"SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE datname = '{name}'")
    try:
        down = await http_get(app.server.port, "/readyz")
        assert down.status == 503, down.body
        assert down.json()["status"] == "unavailable"
        assert down.json()["checks"]["database"]["ok"] is False
        assert down.json()["checks"]["database"]["error"]
        assert (await http_get(app.server.port, "/healthz")).status == 200  # the process is still up
    finally:
        await as_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    # Pool connections that died with the outage are replaced on use; the first
    # probes after it may still meet one, so readiness is awaited (bounded).
    with trio.fail_after(30):
        while (await http_get(app.server.port, "/readyz")).status != 200:
            await trio.sleep(0.2)


@pytest.fixture
def server_config(request: pytest.FixtureRequest) -> ServerConfig:
    overrides = getattr(request, "param", {})
    return ServerConfig(**{"port": 0, "auth_timeout_seconds": 2.0, "expiry_sweep_seconds": 0.5,
                           "shutdown_grace_seconds": 2.0, **overrides})


@pytest.mark.parametrize("server_config", [{"metrics_port": 0}], indirect=True)
async def test_metrics_port_serves_metrics_and_the_websocket_port_then_answers_404(app: App):
    metrics_port = app.server.metrics_port
    assert metrics_port is not None and metrics_port != app.server.port
    served = await http_get(metrics_port, "/metrics")
    assert served.status == 200 and b"scopewire_connections" in served.body
    moved = await http_get(app.server.port, "/metrics")
    assert moved.status == 404
    for port in (metrics_port, app.server.port):
        assert (await http_get(port, "/healthz")).status == 200
        assert (await http_get(port, "/readyz")).status == 200


@pytest.mark.parametrize("server_config", [{"max_unauthenticated_per_address": 2}], indirect=True)
async def test_probes_count_against_the_connection_caps(app: App):
    """A health check is admitted like any connection: it cannot be used to get
    past the caps, and while the caps are full it is refused like the rest."""
    held = [await trio.open_tcp_stream("127.0.0.1", app.server.port) for _ in range(2)]
    try:
        with trio.fail_after(30):  # precondition: both are admitted (the accept loop runs concurrently)
            while app.server.admission.unauthenticated < 2:
                await trio.sleep(0.01)
        refused = await http_get(app.server.port, "/healthz")
        assert refused.status == 503
    finally:
        for stream in held:
            await stream.aclose()
    with trio.fail_after(30):  # the server notices the closed sockets, then admits again
        while app.server.admission.unauthenticated > 0:
            await trio.sleep(0.01)
    assert (await http_get(app.server.port, "/healthz")).status == 200


# --- logs -----------------------------------------------------------------------------------------

@pytest.fixture
def json_log() -> list[dict]:
    """The server's log lines, through the production formatter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("scopewire")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    lines: list[dict] = []
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(previous)


def log_lines() -> list[dict]:
    for handler in logging.getLogger("scopewire").handlers:
        if isinstance(handler.formatter, JsonFormatter) and isinstance(handler, logging.StreamHandler):
            return [json.loads(line) for line in handler.stream.getvalue().splitlines() if line]
    raise AssertionError("no JSON log handler")


@pytest.mark.parametrize("server_config", [{"slow_command_ms": 0}], indirect=True)
async def test_slow_commands_are_logged_with_op_duration_phases_and_request_context(app: App, tenants, json_log):
    alpha, _ = tenants
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "slow")
        await owner.call("message.send", scope_id=channel["id"], content="hi", workspace_id=alpha.workspace_id)
    slow = [line for line in log_lines() if line["msg"] == "slow command"]
    sends = [line for line in slow if line.get("op") == "message.send"]
    assert len(sends) == 1, slow
    send = sends[0]
    assert send["connection"].startswith("con_") and send["request_id"]
    assert send["duration_ms"] >= 0 and send["outcome"] == "ok"
    assert set(send["phases_ms"]) == {"decode", "handler", "actor", "reply"}
    assert send["slowest_phase"] in send["phases_ms"]
    assert send["phases_ms"]["actor"] > 0  # a send waits on its scope actor
    # Every command of the connection: one connection id, each its own request id.
    assert len({line["connection"] for line in slow}) == 1
    assert len({line["request_id"] for line in slow}) == len(slow)
    assert value(await scrape(app.server.port), "scopewire_slow_commands_total") == len(slow)


# Six password checks must fit in the authentication window on a busy machine.
@pytest.mark.parametrize("server_config", [{"auth_timeout_seconds": 30.0}], indirect=True)
async def test_log_lines_inside_a_request_carry_its_connection_and_request_id(app: App, tenants, json_log):
    """The throttling warning is logged deep in the login path with no ids of
    its own: the context variables put them there."""
    alpha, _ = tenants
    async with connect(app.url) as conn:
        for attempt in range(6):  # the sixth failure starts the throttle, which logs once
            with pytest.raises(ClientError):
                await conn.call("login", email=alpha.owner.email, password=f"wrong-password-{attempt}")
    throttled = [line for line in log_lines() if line["msg"] == "failed credentials: throttling"]
    assert len(throttled) == 1, log_lines()
    assert throttled[0]["connection"].startswith("con_")
    assert throttled[0]["request_id"] and throttled[0]["op"] == "login"


# --- scopewire status -----------------------------------------------------------------------------

async def test_status_shows_the_live_servers_figures(app: App, tenants):
    alpha, _ = tenants
    ws = {"workspace_id": alpha.workspace_id}
    url = f"http://127.0.0.1:{app.server.port}"
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "status")
        await owner.call("subscribe", scopes=[{"scope_id": channel["id"]}], **ws)
        done = trio.Event()

        async def keep_sending() -> None:
            i = 0
            while not done.is_set():
                await owner.call("message.send", scope_id=channel["id"], content=f"s{i}", **ws)
                i += 1

        async def drain_events() -> None:
            while True:
                await owner.next_event()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_sending)
            nursery.start_soon(drain_events)
            try:
                with trio.fail_after(60):
                    as_json = await trio.run_process([*SCOPEWIRE, "status", "--url", url, "--json",
                                                      "--interval", "1"], capture_stdout=True, capture_stderr=True,
                                                     cwd=PROJECT_ROOT)
                    screen = await trio.run_process([*SCOPEWIRE, "status", "--url", url, "--interval", "0.5"],
                                                    capture_stdout=True, capture_stderr=True, cwd=PROJECT_ROOT)
            finally:
                done.set()
                nursery.cancel_scope.cancel()
    figures = json.loads(as_json.stdout)
    assert figures["connections"]["authenticated"] == 1
    assert figures["active_actors"] >= 1
    assert figures["sends_per_second"] > 0
    assert figures["deliveries_per_second"] > 0
    assert isinstance(figures["outbox_backlog"], int)
    text = screen.stdout.decode()
    for label in ("connections", "active actors", "sends/s", "deliveries/s", "outbox backlog"):
        assert label in text, text


def test_status_against_nothing_fails_in_one_line():
    done = subprocess.run([*SCOPEWIRE, "status", "--url", "http://127.0.0.1:9", "--interval", "0"],
                          capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "cannot reach" in done.stderr


def test_operability_flags_reach_the_server_config(monkeypatch):
    from server.cli import build_parser, server_config_from

    config = server_config_from(build_parser().parse_args(["serve", "--metrics-port", "9100",
                                                           "--slow-command-ms", "250"]))
    assert (config.metrics_port, config.slow_command_ms) == (9100, 250)
    assert server_config_from(build_parser().parse_args(["serve"])).metrics_port is None  # default: the WS port
    monkeypatch.setenv("SCOPEWIRE_METRICS_PORT", "9101")
    assert server_config_from(build_parser().parse_args(["serve"])).metrics_port == 9101


def _tasks(task: trio.lowlevel.Task):
    yield task
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            yield from _tasks(child)


# The connection's task is kept while idle (not parked, server/parking.py): the check looks at it.
@pytest.mark.parametrize("server_config", [{"park_after_idle_seconds": 60.0}], indirect=True)
async def test_scope_actors_do_not_inherit_the_connection_that_started_them(app: App, tenants):
    """An actor is started by whichever connection first writes to its scope;
    its log lines must not carry that connection's (or request's) ids."""
    from server import logs

    alpha, _ = tenants
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "context")
        await owner.call("message.send", scope_id=channel["id"], content="x", workspace_id=alpha.workspace_id)
        tasks = list(_tasks(trio.lowlevel.current_root_task()))
        actors = [t for t in tasks if "ScopeRegistry._supervise" in t.name]
        connections = [t for t in tasks if t.name == CONNECTION_TASK_NAME]
        assert actors and connections
        assert all(t.context.get(logs.connection_id) for t in connections)  # the variable is set per connection
        assert [t.context.get(logs.connection_id) for t in actors] == [None] * len(actors)
        assert [t.context.get(logs.request_id) for t in actors] == [None] * len(actors)


@pytest.mark.parametrize("server_config", [{"commands_per_second": 0.001, "command_burst": 1}], indirect=True)
async def test_commands_refused_by_the_rate_limit_are_counted(app: App):
    async with connect(app.url) as conn:
        await conn.call("ping")
        with pytest.raises(ClientError) as refused:
            await conn.call("ping")
    assert refused.value.code == "rate_limited"
    figures = await scrape(app.server.port)
    assert value(figures, "scopewire_commands_total", op="ping", outcome="ok") == 1
    assert value(figures, "scopewire_commands_total", op="unknown", outcome="rate_limited") == 1
