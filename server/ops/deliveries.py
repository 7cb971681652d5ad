"""Handlers of the routed delivery feed (protocol/deliveries.py) and the sink
that writes `delivery` events to a subscribed connection.

The workspace and the member always come from the authenticated context, never
from the request: a connection subscribes to, acks and lists only its own feed."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from actors.delivery_router import FeedSubscription, Handout
from protocol import deliveries as d
from protocol import frames as f
from protocol.codec import encode
from server.context import RequestContext
from server.messaging import _ms, message_info
from server.rbac import Permission
from server.wire import server_frame
from storage import deliveries, messages
from storage.visibility.deliveries import readable_messages, readable_scopes

if TYPE_CHECKING:
    from server.app import Connection, Server

log = logging.getLogger("scopewire.deliveries")


def delivery_info(row, message=None, activity=None) -> d.DeliveryInfo:
    """The wire form of a ledger row; `message` and `activity` as they are now."""
    info = d.DeliveryInfo(
        delivery_seq=row["delivery_seq"], dedupe_key=row["dedupe_key"], reason=row["reason"],
        kind="activity" if row["activity_event_id"] else "message", scope_id=row["scope_id"], status=row["status"],
        attempt=row["attempts"], push=row["push"], created_at_ms=_ms(row["created_at"]), authority=row["authority"],
        message_id=row["message_id"], suppression_reason=row["suppression_reason"],
        lease_expires_at_ms=_ms(row["lease_expires_at"]) if row["lease_expires_at"] is not None else None,
        reasons=list(row.get("reasons") or ()) or [row["reason"]])
    if message is not None:
        info.message = message_info(message)
    if activity is not None:
        info.activity = d.ActivityInfo(id=activity["id"], activity_type=activity["activity_type"],
                                       actor_member_id=activity["actor_member_id"],
                                       source_message_id=activity["source_message_id"],
                                       payload=_json_object(activity["payload"]))
    return info


def _json_object(value) -> dict:
    return json.loads(value) if isinstance(value, str) else dict(value or {})


class DeliverySink:
    """Writes handed-out deliveries to one connection (called by the router task)."""

    def __init__(self, connection: Connection, workspace_id: str) -> None:
        self.connection = connection
        self.workspace_id = workspace_id

    def send_deliveries(self, handouts: list[Handout]) -> None:
        ws = self.connection.ws
        if ws.closing:
            return  # its close releases the leases
        binary = ws.binary
        ws.write([server_frame(encode(f.Event(
            event="delivery", workspace_id=self.workspace_id, scope_id=h.row["scope_id"],
            data=delivery_info(h.row, h.message, h.activity)), binary=binary), binary=binary) for h in handouts])


async def subscribe(server: Server, connection: Connection, request: d.DeliverySubscribe,
                    ctx: RequestContext) -> d.DeliverySubscribed:
    workspace = ctx.require(Permission.MESSAGE_READ)
    latest, unacked = await server.db.run(deliveries.feed_state, workspace.workspace_id, workspace.member_id)
    if connection.delivery_feeds is None:
        connection.delivery_feeds = {}
    existing = connection.delivery_feeds.get(workspace.workspace_id)
    if existing is not None and existing.active:
        server.deliveries.update(existing, request.max_in_flight)
    else:
        subscription = FeedSubscription(workspace.workspace_id, workspace.member_id, connection.id,
                                        DeliverySink(connection, workspace.workspace_id), request.max_in_flight)
        connection.delivery_feeds[workspace.workspace_id] = subscription
        server.deliveries.subscribe(subscription)
    return d.DeliverySubscribed(latest_delivery_seq=latest, unacked=unacked)


async def ack(server: Server, connection: Connection, request: d.DeliveryAck, ctx: RequestContext) -> d.DeliveryAcked:
    workspace = ctx.require(Permission.MESSAGE_READ)
    seqs = sorted(set(request.delivery_seqs))
    acked = await server.db.transaction(deliveries.ack, workspace.workspace_id, workspace.member_id, seqs,
                                        server.deliveries.clock())
    server.deliveries.acked(workspace.workspace_id, workspace.member_id, acked)
    return d.DeliveryAcked(acked=acked)


async def unsubscribe(server: Server, connection: Connection, request: d.DeliveryUnsubscribe,
                      ctx: RequestContext) -> f.Ok:
    workspace = ctx.require(Permission.MESSAGE_READ)
    subscription = connection.delivery_feeds.pop(workspace.workspace_id, None) if connection.delivery_feeds else None
    if subscription is not None:
        server.deliveries.unsubscribe(subscription)
    return f.Ok()


async def list_feed(server: Server, connection: Connection, request: d.DeliveryList,
                    ctx: RequestContext) -> d.DeliveryPage:
    workspace = ctx.require(Permission.MESSAGE_READ)
    rows = await server.db.run(deliveries.feed_page, workspace.workspace_id, workspace.member_id, request.after_seq,
                               request.limit + 1)
    more = len(rows) > request.limit
    rows = rows[:request.limit]
    found = await server.db.run(readable_messages, workspace.member_id,
                                sorted({r["message_id"] for r in rows if r["message_id"]}))
    activity_ids = sorted({r["activity_event_id"] for r in rows if r["activity_event_id"]})
    activities = await server.db.run(deliveries.activity_events, activity_ids) if activity_ids else {}
    # A message-less activity (a strand assignment) shows while you read its scope.
    scopes = await server.db.run(readable_scopes, workspace.member_id,
                                 sorted({r["scope_id"] for r in rows if not r["message_id"]}))
    # What you no longer read shows as the bare delivery: no message, nor who reacted to it.
    return d.DeliveryPage(
        deliveries=[delivery_info(r, messages.committed_from_row(found[r["message_id"]]),
                                  activities.get(r["activity_event_id"])) if r["message_id"] in found
                    else delivery_info(r, None, activities.get(r["activity_event_id"]))
                    if not r["message_id"] and r["scope_id"] in scopes
                    else delivery_info(r) for r in rows],
        next_after_seq=rows[-1]["delivery_seq"] if more else None)


def release_all(server: Server, connection: Connection) -> None:
    """The connection closed: every feed it held returns its unacked deliveries."""
    for subscription in (connection.delivery_feeds or {}).values():
        server.deliveries.unsubscribe(subscription)
    connection.delivery_feeds = None


HANDLERS = {
    d.DeliverySubscribe: subscribe,
    d.DeliveryAck: ack,
    d.DeliveryUnsubscribe: unsubscribe,
    d.DeliveryList: list_feed,
}
