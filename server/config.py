"""Server settings: command-line flags with SCOPEWIRE_* environment fallbacks."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from storage.blobs import S3Settings

ROOT_DATA_DIR = Path("/var/lib/scopewire")
# A node id travels in bus notifications (`node:seq:payload`), so it never holds a colon.
NODE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Content types an upload may declare unless the deployment says otherwise (`*` matches
# any subtype): documents and media, not executables or scriptable types (e.g. SVG, HTML).
DEFAULT_ATTACHMENT_TYPES = (
    "image/png", "image/jpeg", "image/gif", "image/webp", "application/pdf", "text/plain", "text/markdown",
    "text/csv", "application/json", "application/zip", "application/gzip", "audio/*", "video/mp4", "video/webm",
    "application/vnd.openxmlformats-officedocument.*", "application/vnd.oasis.opendocument.*",
)


def default_data_dir() -> Path:
    # initdb/postgres refuse root and must run as an unprivileged account, which
    # cannot reach root's home (mode 0700); root's default lives where it can.
    if os.geteuid() == 0:
        return ROOT_DATA_DIR
    return Path(platformdirs.user_data_dir("scopewire", appauthor=False))


@dataclass(frozen=True)
class DatabaseConfig:
    data_dir: Path
    database_url: str | None = None
    database_name: str = "scopewire"
    pg_binaries: str = "auto"        # bundled | system | auto
    pg_port: int | None = None       # None: unix socket only
    pg_run_as: str | None = None     # as root: the unprivileged account postgres runs as


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    log_level: str = "info"
    shutdown_grace_seconds: float = 5.0
    auth_timeout_seconds: float = 10.0
    session_ttl_seconds: int = 3600
    # How often session expiry is checked (revocations themselves arrive by NOTIFY at once).
    expiry_sweep_seconds: float = 5.0
    max_frame_bytes: int = 256 * 1024
    # A scope's actor stops after this long without commands (restarted on demand).
    actor_idle_seconds: float = 30.0
    # Realtime: a connection is cut off as a slow consumer past this many unsent bytes,
    # or this many live events waiting behind a replay, or when one replay write
    # blocks this long.
    push_buffer_bytes: int = 1024 * 1024
    push_buffer_events: int = 1024
    push_timeout_seconds: float = 10.0
    # "io_uring": a publication's sends to the connections in step go to the kernel in
    # one call where the kernel allows it (server/send_ring.py); "send": one send() each.
    fanout_writes: str = "io_uring"
    max_subscriptions_per_connection: int = 100
    # Limits: commands per connection (token bucket), connections per member,
    # ping/pong heartbeat and idle timeout.
    commands_per_second: float = 1000.0
    command_burst: int = 2000
    max_connections_per_member: int = 100
    # Connection flood caps (server/limits.py): handshakes beyond them get HTTP 503.
    max_connections: int = 10_000
    max_unauthenticated_connections: int = 1_000
    max_unauthenticated_per_address: int = 64
    heartbeat_seconds: float = 30.0
    heartbeat_timeout_seconds: float = 20.0
    idle_timeout_seconds: float = 600.0
    # An authenticated connection this long without input waits without a task of its
    # own (server/parking.py): memory per idle connection.  0: as soon as no input waits.
    park_after_idle_seconds: float = 0.0
    # Parked connections served at once (server/parking.py): a woken one beyond this
    # waits its turn, its input in the kernel's socket buffer.  Memory in a reconnect storm.
    max_woken_connections: int = 128
    # Routed deliveries: an unacked handout is sent again after this long; unacked
    # deliveries older than the retention expire (routed history is not an unbounded queue).
    delivery_lease_seconds: float = 60.0
    delivery_retention_hours: float = 168.0
    # A service account's audience reconciles in batches of this many members (one actor command each).
    service_account_audience_batch: int = 500
    # Platform broadcast delivery: workspace deliveries in flight per platform account, how long a
    # delivery's lease fences it, attempts before operator_attention, and the first retry's backoff
    # (doubling, at most 60 s).
    platform_delivery_concurrency: int = 16
    platform_lease_seconds: float = 30.0
    platform_max_attempts: int = 8
    platform_retry_base_seconds: float = 1.0
    # The deployment's moderation keywords (scope-model §3.6.1): a broadcast containing one, ignoring
    # case, is refused (content_blocked) and logged for review.
    moderation_keywords: tuple[str, ...] = ()
    # Operability: /metrics on its own port (None: on the WebSocket port), and the
    # duration past which a command is logged as slow, with its phases.
    metrics_port: int | None = None
    slow_command_ms: float = 500.0
    # Attachments: where uploads are staged and (driver `local`) stored — None: a temporary
    # directory (`scopewire serve` uses DATA_DIR/attachments) — the driver new uploads go
    # to, the size and type limits, and how long an upload may stay unclaimed.
    attachments_dir: Path | None = None
    attachment_driver: str = "local"
    attachment_s3: S3Settings | None = None
    max_attachment_bytes: int = 100 * 1024 * 1024
    attachment_types: tuple[str, ...] = DEFAULT_ATTACHMENT_TYPES
    unclaimed_upload_ttl_seconds: float = 24 * 3600.0
    max_unclaimed_upload_bytes: int = 1024 * 1024 * 1024
    max_unclaimed_uploads: int = 1000
    attachment_gc_seconds: float = 60.0
    # Search: matching messages examined per call before the readable predicate.
    search_candidate_budget: int = 1000
    # Scale-out (server/cluster.py): this process's node id (None: a fresh one per start),
    # how long its lease lasts without a heartbeat (its scopes are taken over after that),
    # where peers forward commands for the scopes it owns (port 0: any free port; the
    # advertised address defaults to host:port as bound), and the bus between nodes.
    node_id: str | None = None
    node_lease_seconds: float = 10.0
    forward_host: str = "127.0.0.1"
    forward_port: int = 0
    forward_advertise: str | None = None
    bus: str = "postgres"  # postgres | nats
    nats_url: str | None = None
