"""Platform service accounts and broadcast (service-account.md §2.4, §4.5): the
names and value types the platform actor, the workspace delivery command and
storage share."""

from __future__ import annotations

from dataclasses import dataclass

# NOTIFY channel: a provisioning input or an instance's readiness changed (payload: the account id, or
# '*' for every account).  Wakes the platform actors of every process.
PLATFORM_CHANNEL = "scopewire_platform"
# The feed platform events travel on (to operators after platform.subscribe): not a workspace, so their
# frames carry an empty workspace_id.
PLATFORM_FEED = ""
# A broadcast's message in every workspace: its deterministic client id (§4.5).
CLIENT_MESSAGE_PREFIX = "platform-broadcast:"
SETTLED_STATES = ("delivered", "closed", "skipped")
RETRYABLE_STATES = ("operator_attention", "retry_wait", "waiting_audience", "waiting_instance")
# A platform account's workspace delivery acts on this basis (§4.5's target-role table).
DELIVERY_PERMISSION_BASIS = "service_grant+platform_service_account_delivery"


def client_message_id(broadcast_id: str) -> str:
    return f"{CLIENT_MESSAGE_PREFIX}{broadcast_id}"


@dataclass(frozen=True)
class BroadcastSnapshot:
    """The immutable MessagePlan a broadcast accepted: what every workspace receives."""

    broadcast_id: str
    platform_service_account_id: str
    broadcast_seq: int
    title: str
    content: str
    payload_digest: bytes
    operator_id: str
    correlation_id: str
    # The frozen asset manifest (storage/platform_assets.py manifest_entry), in order.
    assets: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Lease:
    """A delivery's execution fence, handed from the platform actor to the workspace transaction."""

    delivery_id: str
    workspace_id: str
    local_scope_id: str
    broadcast_id: str
    broadcast_seq: int
    lease_token: str
    version: int
    placement_epoch: int
    execution_generation: int  # the workspace's, read when leased (its write fence still checks it)
