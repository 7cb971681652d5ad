"""Plain HTTP on the WebSocket port (or on --metrics-port): /healthz, /readyz
and /metrics.

A request that is not a WebSocket upgrade reaches here from the handshake
(server/transport.py) after it was admitted like any connection, so probes
count against the same connection caps as everything else.  Each answer is
one response, then the connection closes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import trio

from server.metrics import CONTENT_TYPE
from storage import health

if TYPE_CHECKING:
    from server.app import Server

log = logging.getLogger("scopewire.http")

READINESS_TIMEOUT = 2.0  # a database slower than this to answer counts as unreachable
_REASONS = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}


def response(status: int, content_type: str, body: bytes) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def _json(status: int, value: object) -> bytes:
    return response(status, "application/json", msgspec.json.encode(value))


async def answer(server: Server, method: str, target: str, *, metrics_here: bool) -> bytes | None:
    """The response to a plain HTTP request, or None: not ours (the caller
    answers 400, a WebSocket upgrade was expected)."""
    if method not in ("GET", "HEAD"):
        return None
    whole = await _answer(server, target.split("?", 1)[0], metrics_here)
    if whole is not None and method == "HEAD":
        return whole[:whole.index(b"\r\n\r\n") + 4]
    return whole


async def _answer(server: Server, path: str, metrics_here: bool) -> bytes | None:
    if path == "/healthz":
        return _json(200, {"status": "ok"})
    if path == "/readyz":
        checks = await readiness(server)
        ready = all(check["ok"] for check in checks.values())
        return _json(200 if ready else 503, {"status": "ready" if ready else "unavailable", "checks": checks})
    if path == "/metrics":
        if not metrics_here:
            return _json(404, {"error": "metrics are served on --metrics-port"})
        await server.metrics.refresh(server)
        return response(200, CONTENT_TYPE, server.metrics.render())
    return None


async def readiness(server: Server) -> dict[str, dict]:
    """database: reachable; migrations: at the version this code expects;
    accepting: the listeners are up and the server is not shutting down;
    node_lease: this node renewed its lease within the last lease period (else
    other nodes may take its scopes over)."""
    cluster = server.cluster
    checks: dict[str, dict] = {"accepting": {"ok": server.accepting},
                               "node_lease": {"ok": cluster.lease_healthy, "node_id": cluster.node_id,
                                              "lease_seconds": cluster.lease_seconds}}
    applied = expected = None
    with trio.move_on_after(READINESS_TIMEOUT):
        try:
            applied, expected = await server.db.run(health.schema_current)
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready", said in the body
            checks["database"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if applied is None:
        checks.setdefault("database", {"ok": False, "error": f"no answer within {READINESS_TIMEOUT:g}s"})
        checks["migrations"] = {"ok": False, "error": "unknown: the database did not answer"}
    else:
        checks["database"] = {"ok": True}
        checks["migrations"] = {"ok": applied == expected, "applied": applied, "expected": expected}
    return checks
