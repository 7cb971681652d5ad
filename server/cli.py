"""`scopewire` command line: serve, migrate, verify-schema, db url, and the
admin commands (init, workspace, member, invite, apikey)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shlex
import signal
import socket
import sys
from datetime import datetime
from pathlib import Path

import trio

from server import logs, status
from protocol.errors import ErrorCode, ProtocolError
from server import tenancy as ops
from server.auth import Authenticator, system_context, system_workspace_context
from server.credentials import load_or_create_signer
from server.rbac import API_KEY_SCOPES
from server.config import DEFAULT_ATTACHMENT_TYPES, NODE_ID, DatabaseConfig, ServerConfig, default_data_dir
from storage.blobs import S3Settings
from storage.cluster import ClusterError
from storage.lifecycle import (ClusterLost, DatabaseStartError, database_url_host, embedded_cluster, open_database,
                               pace_autovacuum, provisioned, supervise_cluster)
from storage import platform, search, tenancy
from storage.errors import Conflict, NotFound
from storage.ids import new_id
from storage.migrations import migrate, verify

log = logging.getLogger("scopewire")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SCOPEWIRE_{name}", default)


def _add_database_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=Path(_env("DATA_DIR") or default_data_dir()),
                        help="where the embedded PostgreSQL cluster lives (default: %(default)s)")
    parser.add_argument("--database-url", default=_env("DATABASE_URL"),
                        help="use this external PostgreSQL instead of the embedded one (SCOPEWIRE_DATABASE_URL)")
    parser.add_argument("--database-name", default=_env("DATABASE_NAME", "scopewire"))
    parser.add_argument("--pg-binaries", choices=("bundled", "system", "auto"), default=_env("PG_BINARIES", "auto"),
                        help="PostgreSQL server binaries: the pinned bundled ones, the machine's, or bundled when present")
    parser.add_argument("--pg-port", type=int, default=_env("PG_PORT"),
                        help="also listen on 127.0.0.1:PORT (default: private unix socket only)")
    parser.add_argument("--pg-run-as", default=_env("PG_RUN_AS"),
                        help="as root: the existing unprivileged account that runs postgres (default: the "
                             "dedicated 'scopewire' system account, created when absent)")
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "info"),
                        choices=("debug", "info", "warning", "error"))


def _database_config(args: argparse.Namespace) -> DatabaseConfig:
    if args.database_url:
        database_url_host(args.database_url)  # a malformed URL fails here, before anything is done
    return DatabaseConfig(
        data_dir=args.data_dir.expanduser().resolve(),
        database_url=args.database_url,
        database_name=args.database_name,
        pg_binaries=args.pg_binaries,
        pg_port=int(args.pg_port) if args.pg_port is not None else None,
        pg_run_as=args.pg_run_as,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scopewire", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the database and the WebSocket server")
    serve.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(_env("PORT", "8765")),
                       help="WebSocket port (0 picks a free one; the readiness line shows it)")
    serve.add_argument("--auth-timeout", type=float, default=float(_env("AUTH_TIMEOUT", "10")),
                       help="seconds a new connection has to authenticate (default: %(default)s)")
    serve.add_argument("--session-ttl", type=int, default=int(_env("SESSION_TTL", "3600")),
                       help="lifetime of session tokens in seconds (default: %(default)s)")
    for flag, env, default, text in (
            ("--commands-per-second", "COMMANDS_PER_SECOND", "1000", "per-connection command rate (token bucket)"),
            ("--max-connections-per-member", "MAX_CONNECTIONS_PER_MEMBER", "100", "live connections per member"),
            ("--max-connections", "MAX_CONNECTIONS", "10000", "live connections in all (beyond: HTTP 503)"),
            ("--max-unauthenticated", "MAX_UNAUTHENTICATED", "1000",
             "connections not yet authenticated, in all (beyond: HTTP 503)"),
            ("--max-unauthenticated-per-address", "MAX_UNAUTHENTICATED_PER_ADDRESS", "64",
             "connections not yet authenticated from one client address (beyond: HTTP 503)"),
            ("--shutdown-grace", "SHUTDOWN_GRACE", "5", "seconds clients get to answer the close frame at shutdown"),
            ("--idle-timeout", "IDLE_TIMEOUT", "600", "seconds without a client frame before closing (4400)"),
            ("--heartbeat", "HEARTBEAT", "30", "seconds between server pings"),
            ("--park-after-idle", "PARK_AFTER_IDLE", "0",
             "seconds an authenticated connection waits for input in a task of its own before it "
             "waits without one (memory per idle connection; 0: as soon as no input waits)"),
            ("--max-woken-connections", "MAX_WOKEN_CONNECTIONS", "128",
             "parked connections served at once; one woken by input beyond this waits its turn "
             "until a served one has answered its first command or parked again (memory in a reconnect storm)"),
            ("--heartbeat-timeout", "HEARTBEAT_TIMEOUT", "20", "seconds a ping may go unanswered before aborting"),
            ("--max-frame-bytes", "MAX_FRAME_BYTES", "262144", "largest client message (larger: closed with 1009)"),
            ("--max-subscriptions", "MAX_SUBSCRIPTIONS", "100", "scope subscriptions per connection"),
            ("--push-buffer-bytes", "PUSH_BUFFER_BYTES", "1048576", "unsent bytes before a slow consumer is cut off"),
            ("--push-buffer-events", "PUSH_BUFFER_EVENTS", "1024", "live events held behind a replay before cut-off"),
            ("--push-timeout", "PUSH_TIMEOUT", "10", "seconds a replay write may block before cut-off"),
            ("--delivery-lease-seconds", "DELIVERY_LEASE_SECONDS", "60",
             "seconds a routed delivery stays with one connection unacked before it is sent again"),
            ("--delivery-retention-hours", "DELIVERY_RETENTION_HOURS", "168",
             "hours an unacked routed delivery waits before it expires"),
            ("--service-account-audience-batch", "SERVICE_ACCOUNT_AUDIENCE_BATCH", "500",
             "members a service account's audience reconcile opens or closes per batch (1-10000)"),
            ("--platform-delivery-concurrency", "PLATFORM_DELIVERY_CONCURRENCY", "16",
             "workspace deliveries of one platform broadcast account in flight at once (1-1000)"),
            ("--platform-lease-seconds", "PLATFORM_LEASE_SECONDS", "30",
             "seconds a platform delivery's lease fences it before another attempt may take it"),
            ("--platform-max-attempts", "PLATFORM_MAX_ATTEMPTS", "8",
             "failed attempts of a platform delivery before it waits for an operator (operator_attention)")):
        serve.add_argument(flag, type=float, default=float(_env(env, default)), help=f"{text} (default: %(default)s)")
    for flag, env, default, text in (
            ("--max-attachment-bytes", "MAX_ATTACHMENT_BYTES", str(100 * 1024 * 1024), "largest upload in bytes"),
            ("--max-unclaimed-upload-bytes", "MAX_UNCLAIMED_UPLOAD_BYTES", str(1024 ** 3),
             "bytes of a member's uploads not yet claimed by a message"),
            ("--max-unclaimed-uploads", "MAX_UNCLAIMED_UPLOADS", "1000",
             "uploads of a member not yet claimed by a message"),
            ("--unclaimed-upload-ttl", "UNCLAIMED_UPLOAD_TTL", "86400",
             "seconds an upload may stay unclaimed before it is deleted"),
            ("--search-candidate-budget", "SEARCH_CANDIDATE_BUDGET", "1000",
             "matching messages one message.search examines before the readable predicate")):
        serve.add_argument(flag, type=float, default=float(_env(env, default)), help=f"{text} (default: %(default)s)")
    serve.add_argument("--fanout-writes", choices=("io_uring", "send"), default=_env("FANOUT_WRITES", "io_uring"),
                       help="how a publication reaches the subscribed connections in step: io_uring sends "
                            "them in one system call where the kernel allows it (else send), send uses one "
                            "send() per connection (default: %(default)s)")
    serve.add_argument("--attachments-dir", type=Path, default=_env("ATTACHMENTS_DIR"),
                       help="where uploads are staged and, with the local driver, stored "
                            "(default: DATA_DIR/attachments)")
    serve.add_argument("--attachment-driver", choices=("local", "s3"), default=_env("ATTACHMENT_DRIVER", "local"),
                       help="where finished uploads go (default: %(default)s)")
    serve.add_argument("--attachment-types", default=_env("ATTACHMENT_TYPES"),
                       help="comma-separated content types an upload may declare, `*` matching any subtype "
                            "(default: common documents and media)")
    serve.add_argument("--attachment-s3-endpoint", default=_env("ATTACHMENT_S3_ENDPOINT"),
                       help="S3-compatible endpoint URL (default: AWS); credentials come from "
                            "SCOPEWIRE_ATTACHMENT_S3_ACCESS_KEY / SCOPEWIRE_ATTACHMENT_S3_SECRET_KEY")
    serve.add_argument("--attachment-s3-bucket", default=_env("ATTACHMENT_S3_BUCKET"))
    serve.add_argument("--attachment-s3-region", default=_env("ATTACHMENT_S3_REGION", "us-east-1"))
    serve.add_argument("--attachment-s3-prefix", default=_env("ATTACHMENT_S3_PREFIX", ""),
                       help="key prefix of every object in the bucket")
    serve.add_argument("--metrics-port", type=int, default=_env("METRICS_PORT"),
                       help="serve /metrics (and /healthz, /readyz) on this port instead of the WebSocket port, "
                            "where /metrics then answers 404 (SCOPEWIRE_METRICS_PORT)")
    serve.add_argument("--slow-command-ms", type=float, default=float(_env("SLOW_COMMAND_MS", "500")),
                       help="log a command slower than this, with its phases (default: %(default)s)")
    serve.add_argument("--moderation-keywords-file", type=Path, default=_env("MODERATION_KEYWORDS_FILE"),
                       help="one keyword per line: a platform broadcast containing one (ignoring case) is refused "
                            "with content_blocked and logged for review")
    serve.add_argument("--node-id", default=_env("NODE_ID"),
                       help="this server's node id among the servers on one database: letters, digits, _ and -, "
                            "at most 64 (default: a fresh one per start)")
    serve.add_argument("--node-lease-seconds", type=float, default=float(_env("NODE_LEASE_SECONDS", "10")),
                       help="a node that has not renewed its lease for this long loses its scopes to the others "
                            "(default: %(default)s)")
    serve.add_argument("--forward-host", default=_env("FORWARD_HOST", "127.0.0.1"),
                       help="interface where other nodes forward commands for the scopes this node owns "
                            "(default: %(default)s)")
    serve.add_argument("--forward-port", type=int, default=int(_env("FORWARD_PORT", "0")),
                       help="port for forwarded commands (default: any free port)")
    serve.add_argument("--forward-advertise", default=_env("FORWARD_ADVERTISE"),
                       help="host:port other nodes use to reach --forward-host/--forward-port "
                            "(default: the bound address)")
    serve.add_argument("--bus", choices=("postgres", "nats"), default=_env("BUS", "postgres"),
                       help="how nodes tell each other what they committed (default: %(default)s)")
    serve.add_argument("--nats-url", default=_env("NATS_URL"), help="the NATS server for --bus nats")
    serve.add_argument("--session-key-file", type=Path, default=_env("SESSION_KEY_FILE"),
                       help="Ed25519 key that signs session tokens (default: DATA_DIR/session-signing-key.pem); "
                            "every server on one database must share it")
    _add_database_flags(serve)

    for name, text in (("migrate", "apply pending schema migrations"),
                       ("verify-schema", "compare the live schema with the definition; non-zero exit on drift")):
        _add_database_flags(commands.add_parser(name, help=text))

    _add_admin_commands(commands)

    status = commands.add_parser("status", help="one screen of a live server's figures, from its /metrics")
    status.add_argument("--url", default=_env("STATUS_URL", "http://127.0.0.1:8765"),
                        help="the server's HTTP address: its WebSocket port, or --metrics-port (default: %(default)s)")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between the two scrapes (rates)")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    db = commands.add_parser("db", help="database helpers")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    _add_database_flags(db_commands.add_parser("url", help="print how to connect with psql"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and (args.delivery_lease_seconds < 1 or args.delivery_retention_hours <= 0):
        parser.error("--delivery-lease-seconds must be at least 1 and --delivery-retention-hours positive")
    if args.command == "serve" and args.attachment_driver == "s3" and args.attachment_s3_bucket is None:
        parser.error("--attachment-driver s3 needs --attachment-s3-bucket")
    if args.command == "serve" and (args.max_attachment_bytes < 1 or args.max_unclaimed_uploads < 1
                                    or args.unclaimed_upload_ttl <= 0
                                    or not 1 <= args.search_candidate_budget <= 100_000):
        parser.error("--max-attachment-bytes, --max-unclaimed-uploads and --unclaimed-upload-ttl must be positive, "
                     "--search-candidate-budget 1-100000")
    if args.command == "serve" and args.max_woken_connections < 1:
        parser.error("--max-woken-connections must be at least 1")
    if args.command == "serve" and not 1 <= args.service_account_audience_batch <= 10_000:
        parser.error("--service-account-audience-batch must be between 1 and 10000")
    if args.command == "serve" and (not 1 <= args.platform_delivery_concurrency <= 1000
                                    or args.platform_lease_seconds < 1 or args.platform_max_attempts < 1):
        parser.error("--platform-delivery-concurrency must be 1-1000, --platform-lease-seconds and "
                     "--platform-max-attempts at least 1")
    if args.command == "serve" and (args.node_id is not None and not NODE_ID.fullmatch(args.node_id)):
        parser.error("--node-id takes letters, digits, _ and -, at most 64")
    if args.command == "serve" and (args.node_lease_seconds < 1 or not 0 <= args.forward_port <= 65535):
        parser.error("--node-lease-seconds must be at least 1 and --forward-port 0-65535")
    if args.command == "serve" and args.forward_host in ("0.0.0.0", "::", "") and not args.forward_advertise:
        parser.error("--forward-host on every interface needs --forward-advertise (the address other nodes dial)")
    if args.command == "serve" and args.fanout_writes not in ("io_uring", "send"):
        parser.error("--fanout-writes (SCOPEWIRE_FANOUT_WRITES) takes io_uring or send")
    if args.command == "serve" and args.bus == "nats" and not args.nats_url:
        parser.error("--bus nats needs --nats-url")
    logs.configure(getattr(args, "log_level", "warning"))
    if args.command == "status":
        try:
            return status.main(args.url, args.interval, args.json)
        except status.StatusError as exc:
            print(f"scopewire: {exc}", file=sys.stderr)
            return 1
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "migrate":
            return _with_database(args, _migrate)
        if args.command == "verify-schema":
            return _with_database(args, _verify)
        if args.command == "db":
            return _db_url(args)
        return _with_database(args, _run_admin)
    except (ClusterError, DatabaseStartError, ListenError) as exc:
        print(f"scopewire: {exc}", file=sys.stderr)
        return 1
    return 2


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, log_level=args.log_level,
                        auth_timeout_seconds=args.auth_timeout, session_ttl_seconds=args.session_ttl,
                        commands_per_second=args.commands_per_second,
                        command_burst=int(2 * args.commands_per_second),
                        max_connections_per_member=int(args.max_connections_per_member),
                        idle_timeout_seconds=args.idle_timeout, heartbeat_seconds=args.heartbeat,
                        park_after_idle_seconds=args.park_after_idle,
                        max_woken_connections=int(args.max_woken_connections),
                        heartbeat_timeout_seconds=args.heartbeat_timeout,
                        max_frame_bytes=int(args.max_frame_bytes),
                        max_subscriptions_per_connection=int(args.max_subscriptions),
                        push_buffer_bytes=int(args.push_buffer_bytes),
                        push_buffer_events=int(args.push_buffer_events),
                        push_timeout_seconds=args.push_timeout,
                        fanout_writes=args.fanout_writes,
                        delivery_lease_seconds=args.delivery_lease_seconds,
                        delivery_retention_hours=args.delivery_retention_hours,
                        service_account_audience_batch=int(args.service_account_audience_batch),
                        platform_delivery_concurrency=int(args.platform_delivery_concurrency),
                        platform_lease_seconds=args.platform_lease_seconds,
                        platform_max_attempts=int(args.platform_max_attempts),
                        moderation_keywords=_keywords(args.moderation_keywords_file),
                        max_connections=int(args.max_connections),
                        max_unauthenticated_connections=int(args.max_unauthenticated),
                        max_unauthenticated_per_address=int(args.max_unauthenticated_per_address),
                        shutdown_grace_seconds=args.shutdown_grace,
                        metrics_port=int(args.metrics_port) if args.metrics_port is not None else None,
                        slow_command_ms=args.slow_command_ms,
                        attachments_dir=(args.attachments_dir or args.data_dir / "attachments").expanduser().resolve(),
                        attachment_driver=args.attachment_driver,
                        attachment_s3=_s3_settings(args),
                        max_attachment_bytes=int(args.max_attachment_bytes),
                        attachment_types=(tuple(t.strip() for t in args.attachment_types.split(",") if t.strip())
                                          if args.attachment_types else DEFAULT_ATTACHMENT_TYPES),
                        unclaimed_upload_ttl_seconds=args.unclaimed_upload_ttl,
                        max_unclaimed_upload_bytes=int(args.max_unclaimed_upload_bytes),
                        max_unclaimed_uploads=int(args.max_unclaimed_uploads),
                        search_candidate_budget=int(args.search_candidate_budget),
                        node_id=args.node_id, node_lease_seconds=args.node_lease_seconds,
                        forward_host=args.forward_host, forward_port=args.forward_port,
                        forward_advertise=args.forward_advertise, bus=args.bus, nats_url=args.nats_url)


def _s3_settings(args: argparse.Namespace) -> S3Settings | None:
    if args.attachment_s3_bucket is None:
        return None
    return S3Settings(endpoint_url=args.attachment_s3_endpoint, bucket=args.attachment_s3_bucket,
                      region=args.attachment_s3_region, access_key=_env("ATTACHMENT_S3_ACCESS_KEY"),
                      secret_key=_env("ATTACHMENT_S3_SECRET_KEY"), prefix=args.attachment_s3_prefix)


def _keywords(path: Path | None) -> tuple[str, ...]:
    if path is None:
        return ()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"scopewire: cannot read --moderation-keywords-file: {exc}") from None
    return tuple(dict.fromkeys(line.strip() for line in lines if line.strip()))


class ListenError(Exception):
    """The WebSocket address cannot be listened on; the message is one line for humans."""


def inherited_listening_sockets() -> list[socket.socket]:
    """Sockets passed by systemd socket activation (sd_listen_fds(3)): LISTEN_FDS of them
    from descriptor 3, if LISTEN_PID names this process. The address then outlives the
    process: clients connecting during a restart wait in the backlog instead of being refused."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    count = os.environ.get("LISTEN_FDS", "0")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):  # not for our children
        os.environ.pop(name, None)
    sockets: list[socket.socket] = []
    try:
        for fd in range(3, 3 + int(count)):
            os.set_inheritable(fd, False)
            sockets.append(socket.socket(fileno=fd))
    except (ValueError, OSError) as error:
        raise ListenError(f"unusable sockets from socket activation (LISTEN_FDS={count}): {error}") from None
    return sockets


def bind_listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bind and listen the way trio.open_tcp_listeners does, but synchronously and first:
    a port in use fails before the database is started or migrated."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ListenError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in addresses:
            sock = socket.socket(family, kind, protocol)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
    except OSError as error:
        for sock in sockets:
            sock.close()
        reason = error.strerror[0].lower() + error.strerror[1:] if error.strerror else str(error)
        raise ListenError(f"cannot listen on {host}:{port}: {reason}") from None
    return sockets


def _serve(args: argparse.Namespace) -> int:
    config = _database_config(args)
    server_config = server_config_from(args)
    sockets = inherited_listening_sockets() or bind_listening_sockets(server_config.host, server_config.port)
    try:
        with provisioned(config) as target:
            if server_config.node_id is None and config.database_url is None:
                # The embedded database's data dir admits one server at a time (its lock), so
                # its node id can outlive a restart: a node restarted after a crash takes its
                # scopes back at once instead of waiting for its former lease to run out.
                server_config = dataclasses.replace(server_config, node_id=_persistent_node_id(config.data_dir))
            lost = trio.run(_serve_async, target, config, server_config, sockets, _session_key_file(args, config))
    finally:
        for sock in sockets:
            sock.close()
    if lost is not None:
        print(f"scopewire: {lost}", file=sys.stderr)  # last, after the shutdown's logs
        return 1
    log.info("stopped")
    return 0


async def _serve_async(target, config: DatabaseConfig, server_config: ServerConfig, sockets: list[socket.socket],
                       key_file: Path) -> ClusterLost | None:
    """Serve until SIGINT/SIGTERM, or until the embedded cluster is lost for good (returned)."""
    from server.app import Server  # here, not at the top: the admin commands start without the server's modules

    signer = load_or_create_signer(key_file)
    lost: list[ClusterLost] = []
    async with open_database(target, config.database_name) as db:
        server = Server(server_config, db, Authenticator(db, signer, server_config.session_ttl_seconds),
                        listeners=[trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in sockets])
        async with trio.open_nursery() as nursery:
            if target.cluster is not None:
                nursery.start_soon(_supervise, target.cluster, nursery.cancel_scope, lost)
                if not target.cluster.settings.throwaway:
                    await nursery.start(pace_autovacuum, db)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                port = await nursery.start(server.run)
                tune_garbage_collector()
                host = sockets[0].getsockname()[0]
                host = f"[{host}]" if ":" in host else host
                print(f"scopewire ready on ws://{host}:{port}", flush=True)
                log.info("ready", extra={"host": host, "port": port, "metrics_port": server.metrics_port})
                async for signum in signals:
                    log.info("shutting down", extra={"signal": signal.Signals(signum).name})
                    break
            nursery.cancel_scope.cancel()
    return lost[0] if lost else None


async def _supervise(cluster, serving: trio.CancelScope, lost: list[ClusterLost]) -> None:
    """Keep the embedded cluster up; when it cannot be, stop serving (exit non-zero) so
    systemd or the container runtime restarts the whole service."""
    try:
        await supervise_cluster(cluster)
    except ClusterLost as exc:
        log.error("database lost; shutting down", extra={"error": str(exc)})
        lost.append(exc)
        serving.cancel()


def tune_garbage_collector() -> None:
    """Long-lived startup objects leave the collector's view, and young
    collections run less often.  Measured by bench/fanout.py at 1,000
    subscribers: with the default thresholds 53% of the server's CPU went to
    full collections (~155 ms pauses each); with these, deliveries/s doubled."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


def _persistent_node_id(data_dir: Path) -> str:
    path = data_dir.expanduser() / "node-id"
    try:
        found = path.read_text().strip()
        if NODE_ID.fullmatch(found):
            return found
    except FileNotFoundError:
        pass
    node_id = new_id("nod")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_id + "\n")
    return node_id


def _session_key_file(args: argparse.Namespace, config: DatabaseConfig) -> Path:
    return Path(args.session_key_file) if args.session_key_file else config.data_dir / "session-signing-key.pem"


def _with_database(args: argparse.Namespace, action) -> int:
    config = _database_config(args)
    with provisioned(config, share_running=True) as target:
        return trio.run(action, target, config, args)


# --- admin commands (the instance operator: every rule applies, RBAC does not) -----------------

def _add_admin_commands(commands) -> None:
    def command(group, name: str, help_text: str, *arguments: tuple[tuple, dict]) -> None:
        parser = group.add_parser(name, help=help_text)
        for flags, options in arguments:
            parser.add_argument(*flags, **options)
        _add_database_flags(parser)

    def arg(*flags: str, **options: object) -> tuple[tuple, dict]:
        return flags, options

    workspace_flag = arg("--workspace", required=True, help="workspace id or slug")

    command(commands, "init", "create the first account, the workspace and its owner (once)",
            arg("--email", required=True), arg("--name", required=True, help="the owner's display name"),
            arg("--workspace-name", required=True), arg("--workspace-slug", required=True),
            arg("--edition", choices=("single", "multi"), default="single",
                help="single-workspace (default) or multi-workspace instance"))

    workspace = commands.add_parser("workspace", help="workspaces").add_subparsers(dest="admin", required=True)
    command(workspace, "create", "create a workspace (multi-workspace edition)",
            arg("--name", required=True), arg("--slug", required=True), arg("--owner-email", required=True),
            arg("--owner-name"))
    command(workspace, "list", "list every workspace")
    command(workspace, "suspend", "suspend a workspace (its members get forbidden)", arg("workspace"))
    command(workspace, "resume", "make a suspended workspace active again", arg("workspace"))
    command(workspace, "fence", "write-fence a workspace and/or advance its execution generation",
            arg("workspace"), arg("--new-generation", action="store_true"),
            arg("--unfence", action="store_true", help="lift the write fence"))

    member = commands.add_parser("member", help="members").add_subparsers(dest="admin", required=True)
    command(member, "list", "list a workspace's members", workspace_flag)
    command(member, "role", "change a member's role", workspace_flag, arg("member", help="member id, handle or email"),
            arg("role", choices=("admin", "developer", "operator", "viewer")))
    command(member, "create-agent", "create an agent member owned by a human", workspace_flag,
            arg("--owner", required=True, help="owner member id, handle or email"), arg("--handle", required=True),
            arg("--name", required=True), arg("--visibility", choices=("public", "private"), default="private"))
    command(member, "create-service", "create a service identity member", workspace_flag,
            arg("--handle", required=True), arg("--name", required=True))

    invite = commands.add_parser("invite", help="invitations").add_subparsers(dest="admin", required=True)
    command(invite, "create", "invite an email; prints the one-time token", workspace_flag,
            arg("--email", required=True), arg("--role", choices=("admin", "developer", "operator", "viewer"),
                                               default="viewer"),
            arg("--expires-in", type=int, default=7 * 24 * 3600, help="seconds (default: 7 days)"))
    command(invite, "list", "list invitations", workspace_flag)
    command(invite, "revoke", "revoke a pending invitation", workspace_flag, arg("invitation"))

    operator = commands.add_parser("operator", help="platform operators").add_subparsers(dest="admin", required=True)
    command(operator, "create", "create a platform operator; prints its key once", arg("--name", required=True))
    command(operator, "list", "list platform operators")
    command(operator, "disable", "disable a platform operator (its connections are refused)", arg("operator"))

    search = commands.add_parser("search", help="message search readiness after an upgrade").add_subparsers(
        dest="admin", required=True)
    every = arg("--workspace", help="workspace id or slug (default: every workspace)")
    command(search, "status", "scopes whose search index is not ready yet, and their progress", every)
    command(search, "backfill", "index the messages written before search existed (resumable, idempotent)", every,
            arg("--batch", type=int, default=1000, help="messages per transaction (default: %(default)s)"))
    command(search, "finalize", "verify backfilled scopes and make their search ready (idempotent)", every)

    apikey = commands.add_parser("apikey", help="API keys").add_subparsers(dest="admin", required=True)
    command(apikey, "create", "create an API key for a member; prints the key once", workspace_flag,
            arg("--member", required=True, help="member id, handle or email"), arg("--name", default="cli"),
            arg("--scopes", default="read,write", help="comma-separated: read, write, admin"),
            arg("--expires-in", type=int, help="seconds (default: never)"))
    command(apikey, "list", "list API keys", workspace_flag)
    command(apikey, "revoke", "revoke an API key", workspace_flag, arg("key"))


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _print_json(value: object) -> None:
    print(json.dumps(value, default=_json_default, indent=2, ensure_ascii=False))


async def _run_admin(target, config: DatabaseConfig, args: argparse.Namespace) -> int:
    async with open_database(target, config.database_name) as db:
        try:
            result = await _admin_action(db, args)
        except ProtocolError as exc:
            print(f"scopewire: {exc.code.value}: {exc.message}", file=sys.stderr)
            return 1
        except (NotFound, Conflict) as exc:
            print(f"scopewire: {exc}" + (" not found" if isinstance(exc, NotFound) else ""), file=sys.stderr)
            return 1
    _print_json(result)
    return 0


async def _admin_action(db, args: argparse.Namespace) -> object:
    command = args.command if args.command == "init" else f"{args.command} {args.admin}"
    if command == "init":
        done = await ops.init_instance(db, email=args.email, display_name=args.name,
                                       workspace_name=args.workspace_name, workspace_slug=args.workspace_slug,
                                       edition=args.edition)
        return {"workspace_id": done.workspace_id, "account_id": done.account_id, "member_id": done.member_id,
                "email": args.email.strip().lower(), "password": done.password,
                "note": "the password is shown only once"}
    if command == "workspace create":
        done = await ops.create_workspace(db, system_context(), name=args.name, slug=args.slug,
                                          owner_email=args.owner_email, owner_display_name=args.owner_name)
        return {"workspace_id": done.workspace_id, "owner_account_id": done.account_id,
                "owner_member_id": done.member_id, "owner_password": done.password}
    if command == "workspace list":
        return [dict(r) for r in await ops.list_workspaces(db, system_context())]
    if command == "operator create":
        from server.ops.platform import create_operator  # the other commands start without the broadcast actors

        operator_id, key_id, key = await create_operator(db, args.name)
        return {"operator_id": operator_id, "operator_key_id": key_id, "key": key,
                "note": "the key is shown only once"}
    if command == "operator list":
        return [dict(r) for r in await db.run(platform.operators)]
    if command == "operator disable":
        await db.transaction(platform.disable_operator, args.operator)
        return {"operator_id": args.operator, "status": "disabled"}
    if args.command == "search":
        return await _search_admin(db, args)
    workspace_ref = getattr(args, "workspace", None)
    workspace_id = await db.run(tenancy.workspace_by_slug_or_id, workspace_ref)
    ctx = system_context(await system_workspace_context(db, workspace_id))
    if command in ("workspace suspend", "workspace resume"):
        await ops.set_workspace_status(db, ctx, "suspended" if args.admin == "suspend" else "active")
        return {"workspace_id": workspace_id, "status": "suspended" if args.admin == "suspend" else "active"}
    if command == "workspace fence":
        generation = await db.transaction(tenancy.fence_workspace, workspace_id, write_fenced=not args.unfence,
                                          new_generation=args.new_generation)
        return {"workspace_id": workspace_id, "write_fenced": not args.unfence, "active_generation": generation}
    if command == "member list":
        return [dict(r) for r in await ops.list_members(db, ctx)]

    async def member(ref: str) -> str:
        return await db.run(tenancy.member_by_handle_or_email, workspace_id, ref)

    if command == "member role":
        member_id = await member(args.member)
        await ops.set_member_role(db, ctx, member_id, args.role)
        return {"member_id": member_id, "role": args.role}
    if command == "member create-agent":
        member_id = await ops.create_agent(db, ctx, handle=args.handle, display_name=args.name,
                                           visibility=args.visibility, owner_member_id=await member(args.owner))
        return {"member_id": member_id, "kind": "agent"}
    if command == "member create-service":
        return {"member_id": await ops.create_service_member(db, ctx, handle=args.handle, display_name=args.name),
                "kind": "service"}
    if command == "invite create":
        issued = await ops.create_invitation(db, ctx, email=args.email, role=args.role,
                                             expires_in_seconds=args.expires_in)
        return {"invitation_id": issued.invitation_id, "token": issued.token, "expires_at": issued.expires_at,
                "note": "the token is shown only once"}
    if command == "invite list":
        return [dict(r) for r in await ops.list_invitations(db, ctx)]
    if command == "invite revoke":
        await ops.revoke_invitation(db, ctx, args.invitation)
        return {"invitation_id": args.invitation, "status": "revoked"}
    if command == "apikey create":
        scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
        if not scopes or not set(scopes) <= set(API_KEY_SCOPES):
            raise ProtocolError(ErrorCode.INVALID, f"scopes must be among {sorted(API_KEY_SCOPES)}")
        issued = await ops.create_api_key(db, ctx, name=args.name, member_id=await member(args.member),
                                          scopes=scopes, expires_in_seconds=args.expires_in)
        return {"api_key_id": issued.api_key_id, "key": issued.key, "member_id": issued.member_id,
                "expires_at": issued.expires_at, "note": "the key is shown only once"}
    if command == "apikey list":
        return [dict(r) for r in await ops.list_api_keys(db, ctx)]
    if command == "apikey revoke":
        await ops.revoke_api_key(db, ctx, args.key)
        return {"api_key_id": args.key, "status": "revoked"}
    raise AssertionError(command)


async def _search_admin(db, args: argparse.Namespace) -> object:
    workspace_id = (await db.run(tenancy.workspace_by_slug_or_id, args.workspace)
                    if args.workspace is not None else None)
    if args.admin == "status":
        return [dict(r) for r in await db.run(search.status, workspace_id)]
    pending = await db.run(search.pending_scopes, workspace_id)
    if args.admin == "backfill":
        if args.batch < 1:
            raise ProtocolError(ErrorCode.INVALID, "--batch must be at least 1")
        for scope in pending:
            while not await db.transaction(search.backfill_batch, scope["scope_id"], args.batch):
                pass
        return {"backfilled_scopes": len(pending),
                "pending": [dict(r) for r in await db.run(search.pending_scopes, workspace_id)]}
    results = [await db.transaction(search.finalize_scope, scope["scope_id"]) for scope in pending]
    return {"finalized_scopes": sum(r["read_ready"] for r in results),
            "not_ready": [r for r in results if not r["read_ready"]]}


async def _migrate(target, config: DatabaseConfig, args: argparse.Namespace) -> int:
    async with open_database(target, config.database_name, apply_migrations=False) as db:
        applied = await db.run(migrate)
    print(f"applied versions: {applied}" if applied else "schema is up to date")
    return 0


async def _verify(target, config: DatabaseConfig, args: argparse.Namespace) -> int:
    async with open_database(target, config.database_name, apply_migrations=False) as db:
        drifts = await db.run(verify)
    for drift in drifts:
        print(f"drift: {drift}")
    if drifts:
        print(f"{len(drifts)} difference(s) between the database and the schema definition")
        return 1
    print("schema matches the definition")
    return 0


def _db_url(args: argparse.Namespace) -> int:
    config = _database_config(args)
    if config.database_url:
        print(f"psql {shlex.quote(config.database_url)}")
        return 0
    cluster = embedded_cluster(config)
    print(shlex.join(cluster.psql_command(config.database_name)))
    if not cluster.is_running():
        print("note: no scopewire is serving this data dir; start `scopewire serve` first", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
