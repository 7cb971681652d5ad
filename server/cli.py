"""`scopewire` command line: serve, migrate, verify-schema, db url."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

import trio

from server import logs
from server.app import Server
from server.config import DatabaseConfig, ServerConfig, default_data_dir
from storage.cluster import ClusterError
from storage.lifecycle import embedded_cluster, open_database, provisioned
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
                        help="as root: the existing unprivileged account that runs postgres (default: nobody)")
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "info"),
                        choices=("debug", "info", "warning", "error"))


def _database_config(args: argparse.Namespace) -> DatabaseConfig:
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
    _add_database_flags(serve)

    for name, text in (("migrate", "apply pending schema migrations"),
                       ("verify-schema", "compare the live schema with the definition; non-zero exit on drift")):
        _add_database_flags(commands.add_parser(name, help=text))

    db = commands.add_parser("db", help="database helpers")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    _add_database_flags(db_commands.add_parser("url", help="print how to connect with psql"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "migrate":
            return _with_database(args, _migrate)
        if args.command == "verify-schema":
            return _with_database(args, _verify)
        if args.command == "db":
            return _db_url(args)
    except ClusterError as exc:
        print(f"scopewire: {exc}", file=sys.stderr)
        return 1
    return 2


def _serve(args: argparse.Namespace) -> int:
    config = _database_config(args)
    server_config = ServerConfig(host=args.host, port=args.port, log_level=args.log_level)
    with provisioned(config) as target:
        trio.run(_serve_async, target, config, server_config)
    log.info("stopped")
    return 0


async def _serve_async(target, config: DatabaseConfig, server_config: ServerConfig) -> None:
    async with open_database(target, config.database_name) as db:
        server = Server(server_config, db)
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                port = await nursery.start(server.run)
                print(f"scopewire ready on ws://{server_config.host}:{port}", flush=True)
                log.info("ready", extra={"host": server_config.host, "port": port})
                async for signum in signals:
                    log.info("shutting down", extra={"signal": signal.Signals(signum).name})
                    break
            nursery.cancel_scope.cancel()


def _with_database(args: argparse.Namespace, action) -> int:
    config = _database_config(args)
    with provisioned(config, share_running=True) as target:
        return trio.run(action, target, config)


async def _migrate(target, config: DatabaseConfig) -> int:
    async with open_database(target, config.database_name, apply_migrations=False) as db:
        applied = await db.run(migrate)
    print(f"applied versions: {applied}" if applied else "schema is up to date")
    return 0


async def _verify(target, config: DatabaseConfig) -> int:
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
