"""Prometheus metrics (prometheus-client), one registry per Server.

The hot paths never call into prometheus-client: the fanout hub, the outbox
worker, the bridge and the connection caps keep plain integers, and a custom
collector reads them when /metrics is scraped.  Per command (far rarer than
deliveries) there is one dict increment and one histogram observation; per
committed actor batch, two observations.  Figures that need the database
(the outbox backlog) are fetched, with a short timeout, just before a scrape.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol import frames
from storage import health

if TYPE_CHECKING:
    from server.app import Server

log = logging.getLogger("scopewire.metrics")

# No `_created` series: they double the output and nobody here reads them.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
AUTH_OPS = frozenset({"login", "auth", "invitation.accept"})
UNKNOWN_OP = "unknown"  # the frame did not decode to a known op (label values stay bounded)
DATABASE_FIGURES_TIMEOUT = 2.0

COMMAND_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COMMIT_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.commands: defaultdict[tuple[str, str], int] = defaultdict(int)  # (op, outcome) -> count
        self.auth_failures: defaultdict[str, int] = defaultdict(int)  # error code -> count
        self.slow_consumer_closes = 0
        self.push_gap_replays = 0
        self.slow_commands = 0
        self.pipelines = 0  # runs of pipelined message.send (server/pipeline.py)
        self.command_seconds = Histogram(
            "scopewire_command_duration_seconds", "Time from a command's arrival to its reply being written",
            ["op"], buckets=COMMAND_SECONDS_BUCKETS, registry=self.registry)
        self._command_seconds_by_op: dict[str, Any] = {}
        self.batch_size = Histogram(
            "scopewire_actor_batch_size", "Commands committed together by a scope actor (group commit)",
            buckets=BATCH_SIZE_BUCKETS, registry=self.registry)
        self.commit_seconds = Histogram(
            "scopewire_actor_commit_duration_seconds", "A scope actor's batch transaction, submit to commit",
            buckets=COMMIT_SECONDS_BUCKETS, registry=self.registry)
        self.outbox_undelivered: int | None = None  # refreshed before each scrape; None: unknown
        self.outbox_due: int | None = None

    def bind(self, server: Server) -> None:
        self.registry.register(_ServerCollector(server, self))

    # --- called from the serving paths -------------------------------------------------------

    def command_answered(self, op: str | None, reply: Any, seconds: float) -> None:
        op = op if op in frames.KNOWN_OPS else UNKNOWN_OP
        outcome = reply.code if isinstance(reply, frames.Error) else "ok"
        self.commands[(op, outcome)] += 1
        if outcome != "ok" and op in AUTH_OPS:
            self.auth_failures[outcome] += 1
        child = self._command_seconds_by_op.get(op)
        if child is None:
            child = self._command_seconds_by_op[op] = self.command_seconds.labels(op)
        child.observe(seconds)

    def command_refused(self, outcome: str) -> None:
        """A command refused before it was decoded (the per-connection rate limit)."""
        self.commands[(UNKNOWN_OP, outcome)] += 1

    def batch_committed(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.commit_seconds.observe(seconds)

    # --- scraping ------------------------------------------------------------------------

    async def refresh(self, server: Server) -> None:
        """Fetch the figures that live in the database; on failure they read as unknown."""
        backlog: tuple[int | None, int | None] = (None, None)
        with trio.move_on_after(DATABASE_FIGURES_TIMEOUT):
            try:
                backlog = await server.db.run(health.outbox_backlog)
            except Exception as exc:  # noqa: BLE001 - a scrape during an outage still answers
                log.info("metrics: outbox backlog unavailable", extra={"error": f"{type(exc).__name__}: {exc}"})
        self.outbox_undelivered, self.outbox_due = backlog

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _forwarded(cluster) -> Metric:
    family = CounterMetricFamily("scopewire_forwarded_commands", "Scope commands forwarded to the owning node "
                                 "(out) and run here for another node (in)", labels=["direction"])
    family.add_metric(["out"], cluster.forwarded_out)
    family.add_metric(["in"], cluster.forwarded_in)
    return family


def _bus_reads(remote) -> Metric:
    family = CounterMetricFamily("scopewire_bus_database_reads", "Database reads for other nodes' publications: "
                                 "scopes' public readers (once per roster generation), or the log and audiences",
                                 labels=["what"])
    family.add_metric(["roster"], remote.roster_reads)
    family.add_metric(["log"], remote.log_reads)
    return family


def _gauge(name: str, documentation: str, value: float | None, labels: list[str] | None = None,
           samples: list[tuple[list[str], float]] | None = None) -> Iterator[Metric]:
    family = GaugeMetricFamily(name, documentation, value=None if labels else value, labels=labels)
    for label_values, sample in samples or ():
        family.add_metric(label_values, sample)
    if value is not None or labels:
        yield family


class _ServerCollector(Collector):
    """Reads the server's plain counters at scrape time."""

    def __init__(self, server: Server, metrics: ServerMetrics) -> None:
        self.server = server
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        server, metrics = self.server, self.metrics
        admission = server.admission
        upgraded = len(server.connections.all)
        authenticated = admission.total - admission.unauthenticated
        yield from _gauge("scopewire_connections", "Live client connections by state", None, ["state"], [
            (["handshaking"], max(admission.total - upgraded - server.http_in_flight, 0)),
            (["http"], server.http_in_flight),
            (["unauthenticated"], max(upgraded - authenticated, 0)),
            (["authenticated"], authenticated)])
        yield from _gauge("scopewire_connections_parked", "Authenticated connections idle without a task of "
                          "their own (--park-after-idle)", len(server.parking))
        yield from _gauge("scopewire_connections_waiting_turn", "Parked connections woken by input, waiting "
                          "for a turn to be served (--max-woken-connections)", server.parking.waiting_turn)

        commands = CounterMetricFamily("scopewire_commands", "Commands answered, by op and outcome (ok or the "
                                       "error code)", labels=["op", "outcome"])
        for (op, outcome), count in list(metrics.commands.items()):
            commands.add_metric([op, outcome], count)
        yield commands
        failures = CounterMetricFamily("scopewire_auth_failures", "Failed login, auth and invitation.accept "
                                       "commands, by error code", labels=["code"])
        for code, count in list(metrics.auth_failures.items()):
            failures.add_metric([code], count)
        yield failures
        yield CounterMetricFamily("scopewire_slow_commands", "Commands slower than --slow-command-ms (each logged)",
                                  value=metrics.slow_commands)
        yield CounterMetricFamily("scopewire_send_pipelines", "Runs of message.send a client wrote ahead of the "
                                  "replies, served overlapped", value=metrics.pipelines)

        registry = server.registry
        depths = registry.mailbox_depths() if registry is not None else []
        yield from _gauge("scopewire_actors_active", "Scope actors running", len(depths))
        yield from _gauge("scopewire_actor_mailbox_depth", "Commands waiting in scope actor mailboxes, in all",
                          sum(depths))
        yield from _gauge("scopewire_actor_mailbox_depth_max", "Commands waiting in the fullest actor mailbox",
                          max(depths, default=0))
        yield from _gauge("scopewire_actors_waiting_write_turn", "Scope actors holding a batch of sends open until "
                          "their workspace's turn to write (two batches per workspace at a time)",
                          registry.write_turns.waiting if registry is not None else 0)

        hub = server.hub
        yield CounterMetricFamily("scopewire_fanout_events", "Committed events published to the fanout hub",
                                  value=hub.published)
        yield CounterMetricFamily("scopewire_fanout_deliveries", "Event frames handed to subscribed connections, "
                                  "live or replayed from the log", value=hub.delivered)
        yield CounterMetricFamily("scopewire_fanout_bytes", "Bytes of event frames handed to subscribed "
                                  "connections, live or replayed", value=hub.delivered_bytes)
        cluster = server.cluster
        yield from _gauge("scopewire_node_info", "This node (always 1), labelled with its id and bus", None,
                          ["node_id", "bus"], [([cluster.node_id, server.config.bus], 1)])
        yield from _gauge("scopewire_node_lease_healthy", "1 while this node's lease is renewed in time",
                          1 if cluster.lease_healthy else 0)
        yield _forwarded(cluster)
        yield CounterMetricFamily("scopewire_bus_messages_sent", "Publications sent to the other nodes",
                                  value=cluster.bus_sent)
        yield CounterMetricFamily("scopewire_bus_messages_received", "Publications received from other nodes",
                                  value=cluster.bus_received)
        yield CounterMetricFamily("scopewire_bus_messages_lost", "Publications this node could not send",
                                  value=cluster.bus_dropped)
        yield CounterMetricFamily("scopewire_bus_resyncs", "Times every local subscriber replayed from its "
                                  "cursors because bus messages were lost", value=cluster.bus_resyncs)
        yield _bus_reads(cluster.remote)
        yield CounterMetricFamily("scopewire_slow_consumer_closes", "Connections closed with 4408 slow_consumer",
                                  value=metrics.slow_consumer_closes)
        yield CounterMetricFamily("scopewire_push_gap_replays", "Live events that found a gap under their cursor "
                                  "and waited for a fill from the database", value=metrics.push_gap_replays)

        outbox = server.outbox
        if outbox is not None:
            yield CounterMetricFamily("scopewire_outbox_replayed", "Outbox rows delivered by the outbox worker",
                                      value=outbox.replayed)
            yield CounterMetricFamily("scopewire_outbox_retries", "Outbox deliveries that failed and were "
                                      "scheduled again", value=outbox.failed_attempts)
        router = server.deliveries
        yield CounterMetricFamily("scopewire_routed_deliveries_handed_out", "Routed deliveries leased to a "
                                  "subscribed connection (first handouts and redeliveries)", value=router.handed_out)
        yield CounterMetricFamily("scopewire_routed_deliveries_suppressed", "Routed deliveries the handout "
                                  "re-check suppressed (withdrawn, unreadable, authority revoked)",
                                  value=router.suppressed)
        yield from _gauge("scopewire_routed_feed_subscriptions", "Connections subscribed to a routed delivery feed",
                          router.subscription_count)
        yield from _gauge("scopewire_outbox_backlog", "Undelivered outbox rows (absent when the database "
                          "could not be asked)", metrics.outbox_undelivered)
        yield from _gauge("scopewire_outbox_due", "Undelivered outbox rows due for the worker now",
                          metrics.outbox_due)

        db = server.db
        yield from _gauge("scopewire_bridge_queue_depth", "Database units of work handed to the bridge and "
                          "not yet completed", db.units_in_flight)
        yield from _gauge("scopewire_bridge_waiting_for_connection", "Database units of work queued until a "
                          "pooled connection is free", db.units_waiting_for_connection)
        pool = db.pool_figures()
        yield from _gauge("scopewire_db_pool_connections", "Database pool connections by state", None, ["state"], [
            (["in_use"], max(pool["open"] - pool["idle"], 0)), (["idle"], pool["idle"])])
        yield from _gauge("scopewire_db_pool_max", "Database pool size limit", pool["max"])
