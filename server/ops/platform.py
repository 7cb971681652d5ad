"""Handlers of platform service accounts and all-workspace broadcast
(protocol/platform.py), operator credentials, the moderation boundary of
broadcasts, and the projection of the platform actors' events to operators
and workspaces.

Operators act only here (server/handlers.py routes them); every write that
belongs to an account's serialization point goes through its
PlatformAccountActor (actors/platform_account.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from actors import platform_account as pa
from actors import scope_actor as cmd
from actors.fanout import CommittedEvent
from actors.platform_delivery import ScopeErased
from domain.platform import PLATFORM_CHANNEL, PLATFORM_FEED
from domain.plan import ActorContext
from domain.service_accounts import POST_MESSAGE_TYPE
from protocol import frames as f
from protocol import platform as p
from protocol import service_accounts as s
from protocol.errors import ErrorCode, ProtocolError
from server.context import RequestContext
from server.credentials import generate_secret, secret_hash
from server.messaging import SYSTEM_ACTOR, _ms
from server.ops.platform_assets import check_broadcast_assets
from server.ops.service_accounts import _decode_cursor, _name, _page, _publish, _title, _watchers
from server.realtime import PushState
from storage import platform as store
from storage import platform_assets
from storage import tenancy
from storage.errors import DatabaseUnavailable, NotFound, StorageError
from storage.ids import is_valid_id, new_id

if TYPE_CHECKING:
    from server.app import Connection, Server

log = logging.getLogger("scopewire.platform")

OPERATOR_KEY_PREFIX = "swo_"
WAKE_RECHECK_SECONDS = 30.0


async def create_operator(db: Any, name: str) -> tuple[str, str, str]:
    """A platform operator with one key: (operator id, key id, the key — shown once)."""
    key = generate_secret(OPERATOR_KEY_PREFIX)
    operator_id, key_id = await db.transaction(store.create_operator, name, secret_hash(key))
    return operator_id, key_id, key


def _operator(ctx: RequestContext) -> str:
    operator_id = ctx.principal.operator_id
    assert operator_id is not None  # routed here only for operators
    return operator_id


def _check(value: str, prefix: str, what: str) -> str:
    if not is_valid_id(value, prefix):
        raise NotFound(what)
    return value


def _correlation() -> str:
    return new_id("req")


def _ms_or_none(value) -> int | None:
    return None if value is None else _ms(value)


# --- wire forms ------------------------------------------------------------------------------------------

def account_info(row: Any) -> p.PlatformAccountInfo:
    return p.PlatformAccountInfo(
        id=row["id"], principal_id=row["id"], name=row["name"], description=row["description"],
        profile_version=row["profile_version"], version=row["version"], provisioning_mode=row["provisioning_mode"],
        provisioning=p.ProvisioningInfo(
            state=row["provisioning_state"], deployment_generation=row["deployment_generation"],
            target_provisioning_generation=row["target_provisioning_generation"],
            applied_provisioning_generation=row["applied_provisioning_generation"], instances=row["instances"],
            instances_ready=row["instances_ready"]),
        latest_broadcast_seq=row["latest_broadcast_seq"], created_by_operator_id=row["created_by_operator_id"],
        created_at_ms=_ms(row["created_at"]), updated_at_ms=_ms(row["updated_at"]))


def instance_info(row: Any) -> p.PlatformInstanceInfo:
    return p.PlatformInstanceInfo(
        workspace_id=row["workspace_id"], local_service_account_id=row["local_service_account_id"],
        scope_id=row["message_scope_id"], opened_provisioning_generation=row["opened_provisioning_generation"],
        effective_from_broadcast_seq=row["effective_from_broadcast_seq"],
        effective_to_broadcast_seq=row["effective_to_broadcast_seq"],
        last_applied_broadcast_seq=row["last_applied_broadcast_seq"],
        applied_profile_version=row["applied_profile_version"], provisioning_state=row["provisioning_state"],
        version=row["version"])


def broadcast_info(row: Any, counts: Any, replayed: bool = False) -> p.BroadcastInfo:
    return p.BroadcastInfo(
        id=row["id"], platform_service_account_id=row["platform_service_account_id"],
        client_broadcast_id=row["client_broadcast_id"], operator_id=row["operator_id"], state=row["state"],
        required_provisioning_generation=row["required_provisioning_generation"],
        acceptance_ordinal=row["acceptance_ordinal"], payload_digest=bytes(row["payload_digest"]).hex(),
        title=row["title"], content=row["content"], version=row["version"], accepted_at_ms=_ms(row["created_at"]),
        targets=p.TargetCounts(**dict(counts)), broadcast_seq=row["broadcast_seq"],
        sequenced_at_ms=_ms_or_none(row["sequenced_at"]), completed_at_ms=_ms_or_none(row["completed_at"]),
        replayed=replayed, assets=[p.BroadcastAsset(asset_id=entry["asset_id"], filename=entry["filename"],
                                                    label=entry["label"], content_type=entry["content_type"],
                                                    byte_size=entry["byte_size"], sha256=entry["sha256"])
                                   for entry in platform_assets.manifest_of(row)])


def delivery_info(row: Any) -> p.BroadcastDeliveryInfo:
    return p.BroadcastDeliveryInfo(
        id=row["id"], broadcast_id=row["broadcast_id"], workspace_id=row["workspace_id"],
        broadcast_seq=row["broadcast_seq"], recipient_eligible=row["recipient_eligible"], state=row["state"],
        attempt=row["attempt"], version=row["version"], outcome=row["outcome"],
        local_service_account_id=row["local_service_account_id"], local_message_id=row["local_message_id"],
        last_error=row["last_error"], lease_expires_at_ms=_ms_or_none(row["lease_expires_at"]),
        next_attempt_at_ms=_ms_or_none(row["next_attempt_at"]) if row["state"] in (
            "retry_wait", "waiting_audience", "waiting_instance") else None)


def audit_info(row: Any) -> p.PlatformAuditInfo:
    details = row["details"]
    return p.PlatformAuditInfo(
        id=row["id"], subject_type=row["subject_type"], subject_id=row["subject_id"], action=row["action"],
        permission_basis=row["permission_basis"], correlation_id=row["correlation_id"],
        created_at_ms=_ms(row["created_at"]),
        details=msgspec.json.decode(details) if isinstance(details, str) else dict(details or {}),
        platform_service_account_id=row["platform_service_account_id"], subject_version=row["subject_version"],
        operator_id=row["operator_id"], broadcast_id=row["broadcast_id"], broadcast_seq=row["broadcast_seq"])


async def _broadcast(server: Server, broadcast_id: str, replayed: bool = False) -> p.BroadcastInfo:
    async def unit(conn) -> tuple[Any, Any]:
        return await store.broadcast(conn, broadcast_id), await store.target_counts(conn, broadcast_id)
    row, counts = await server.db.run(unit)
    return broadcast_info(row, counts, replayed)


# --- events ------------------------------------------------------------------------------------------------

def publish_platform(server: Server, event: str, data: msgspec.Struct) -> None:
    """To every operator connection that sent platform.subscribe."""
    server.hub.publish(CommittedEvent(event, PLATFORM_FEED, "", None, None, data))


async def emit(server: Server, event: str, **ids: Any) -> None:
    """The platform actors' events, as frames: to operators, and a local account's change to the
    workspace's owners and admins."""
    if event == "platform_service_account.instance_changed":
        publish_platform(server, event, p.PlatformInstanceChanged(
            platform_service_account_id=ids["account_id"], workspace_id=ids["workspace_id"],
            provisioning_state=ids["provisioning_state"]))
        local = ids.get("local_service_account_id")
        if local is not None:
            watchers = await _watchers(server, ids["workspace_id"])
            _publish(server, ids["workspace_id"], "service_account.created", s.ServiceAccountChanged(
                service_account_id=local, principal_id=ids["account_id"], version=1,
                name=(await server.db.run(store.account, ids["account_id"]))["name"]), watchers)
    elif event == "platform_service_account.updated":
        row = await server.db.run(store.account, ids["account_id"])
        publish_platform(server, event, p.PlatformAccountChanged(platform_service_account_id=row["id"],
                                                         version=row["version"], name=row["name"]))
    elif event in ("platform_service_account.broadcast_completed", "platform_service_account.broadcast_accepted"):
        publish_platform(server, event, p.BroadcastChanged(broadcast=await _broadcast(server, ids["broadcast_id"])))
    elif event == "platform_service_account.broadcast_delivery_changed":
        publish_platform(server, event, p.BroadcastDeliveryChanged(
            delivery=delivery_info(await server.db.run(store.delivery, ids["delivery_id"]))))
    elif event == "service_account.updated":
        local = ids["local"]
        watchers = await _watchers(server, ids["workspace_id"])
        _publish(server, ids["workspace_id"], event, s.ServiceAccountChanged(
            service_account_id=local["id"], principal_id=local["principal_id"], version=local["version"],
            name=local["name"]), watchers)
    else:
        raise AssertionError(event)


def _registry(server: Server) -> pa.PlatformRegistry:
    assert server.platform is not None, "the platform actors run while the server serves"
    return server.platform


async def run_platform(server: Server, nursery: trio.Nursery, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Start the platform actors of the accounts no live node owns (a crash resumes from the rows;
    then every third of the node lease, so a dead node's accounts move) and wake them on NOTIFY (a
    workspace created, an instance ready) from any process."""
    config = server.config
    services = pa.PlatformServices(
        db=server.db, scopes=server.registry, node_id=server.node_id,
        settings=pa.PlatformSettings(delivery_concurrency=config.platform_delivery_concurrency,
                                     lease_seconds=config.platform_lease_seconds,
                                     max_attempts=config.platform_max_attempts,
                                     retry_base_seconds=config.platform_retry_base_seconds),
        emit=lambda event, **ids: emit(server, event, **ids), ownership=server.cluster)
    server.platform = pa.PlatformRegistry(services, nursery)
    while True:
        try:
            await server.platform.claim_unowned()
            break
        except DatabaseUnavailable as exc:
            log.warning("platform actors not started yet; retrying", extra={"error": str(exc)})
            await trio.sleep(1.0)
    nursery.start_soon(_claim_periodically, server.platform, config.node_lease_seconds / 3)
    task_status.started()
    while True:
        try:
            async with server.db.listen(PLATFORM_CHANNEL) as notifications:
                # What was notified before this LISTEN began (since the claim above, or while it was
                # down) is looked at now.
                server.platform.wake("*")
                async for notification in notifications:
                    # A resync: notifications were lost (the LISTEN connection dropped, or this task
                    # fell behind), any of them maybe a '*'.
                    server.platform.wake("*" if notification.resync else notification.payload)
        except DatabaseUnavailable as exc:
            log.warning("platform LISTEN failed; the actors' periodic pass covers it", extra={"error": str(exc)})
            await trio.sleep(WAKE_RECHECK_SECONDS)


async def _claim_periodically(registry: pa.PlatformRegistry, interval_seconds: float) -> None:
    while True:
        await trio.sleep(interval_seconds)
        try:
            await registry.claim_unowned()
        except StorageError as exc:
            log.warning("platform accounts not claimed; retrying", extra={"error": str(exc)})


# --- handlers ---------------------------------------------------------------------------------------------

async def subscribe(server: Server, connection: Connection, request: p.PlatformSubscribe,
                    ctx: RequestContext) -> f.Ok:
    if connection.push is None:
        connection.push = PushState(server, connection, PLATFORM_FEED, _operator(ctx))
        server.hub.follow_workspace(connection.push.subscription, PLATFORM_FEED)
    return f.Ok()


async def account_create(server: Server, connection: Connection, request: p.PlatformAccountCreate,
                         ctx: RequestContext) -> p.PlatformAccountInfo:
    row = await server.db.transaction(store.create_account, name=_name(request.name),
                                      description=request.description, operator_id=_operator(ctx),
                                      correlation_id=_correlation())
    _registry(server).start(row["id"])
    info = account_info(row)
    publish_platform(server, "platform_service_account.created", p.PlatformAccountChanged(
        platform_service_account_id=row["id"], version=row["version"], name=row["name"]))
    return info


async def account_list(server: Server, connection: Connection, request: p.PlatformAccountList,
                       ctx: RequestContext) -> p.PlatformAccountPage:
    after = _decode_cursor(request.cursor, 1)
    rows = await server.db.run(store.accounts, after[0] if after else None, request.limit + 1)
    page, cursor = _page(rows, request.limit, lambda r: [r["id"]])
    return p.PlatformAccountPage(accounts=[account_info(r) for r in page], next_cursor=cursor)


async def account_get(server: Server, connection: Connection, request: p.PlatformAccountGet,
                      ctx: RequestContext) -> p.PlatformAccountInfo:
    account_id = _check(request.platform_service_account_id, "psa", "platform service account")
    return account_info(await server.db.run(store.account, account_id))


async def _existing(server: Server, account_id: str) -> str:
    _check(account_id, "psa", "platform service account")
    await server.db.run(store.account, account_id)  # not_found before any actor starts
    return account_id


async def account_update(server: Server, connection: Connection, request: p.PlatformAccountUpdate,
                         ctx: RequestContext) -> p.PlatformAccountInfo:
    account_id = await _existing(server, request.platform_service_account_id)
    row = await _registry(server).submit(account_id, pa.UpdateProfile(
        request.expected_version, None if request.name is None else _name(request.name), request.description,
        _operator(ctx), _correlation()))
    publish_platform(server, "platform_service_account.updated", p.PlatformAccountChanged(
        platform_service_account_id=row["id"], version=row["version"], name=row["name"]))
    return account_info(row)


async def account_delete(server: Server, connection: Connection, request: p.PlatformAccountDelete,
                         ctx: RequestContext) -> f.Ok:
    account_id = await _existing(server, request.platform_service_account_id)
    root, locals_ = await _registry(server).submit(account_id, pa.DeleteAccount(
        request.expected_version, _operator(ctx), _correlation()))
    for local in locals_:
        if server.registry is not None and server.registry.is_live(local["message_scope_id"]):
            try:  # best effort: the delete has committed; an actor left stale finds no scope at its next reload
                await server.registry.submit(local["message_scope_id"],
                                             ScopeErased(await _system(server, local["workspace_id"])))
            except (StorageError, cmd.Refused, cmd.ActorFailed) as exc:
                log.warning("erased scope's actor not told", extra={"scope_id": local["message_scope_id"],
                                                                     "error": str(exc)})
        watchers = await _watchers(server, local["workspace_id"])
        _publish(server, local["workspace_id"], "service_account.deleted", s.ServiceAccountChanged(
            service_account_id=local["id"], principal_id=local["principal_id"], version=local["version"],
            name=local["name"]), watchers)
    publish_platform(server, "platform_service_account.deleted", p.PlatformAccountChanged(
        platform_service_account_id=account_id, version=root["version"], name=root["name"]))
    return f.Ok()


async def _system(server: Server, workspace_id: str) -> ActorContext:
    # The scope actor fences every command by the workspace's execution generation.
    return ActorContext(workspace_id=workspace_id, member_id=SYSTEM_ACTOR, member_kind="system",
                        owner_member_id=None,
                        execution_generation=await server.db.run(tenancy.current_generation, workspace_id))


async def instance_list(server: Server, connection: Connection, request: p.PlatformInstanceList,
                        ctx: RequestContext) -> p.PlatformInstancePage:
    account_id = await _existing(server, request.platform_service_account_id)
    after = _decode_cursor(request.cursor, 1)
    rows = await server.db.run(store.instances, account_id, after[0] if after else None, request.limit + 1)
    page, cursor = _page(rows, request.limit, lambda r: [r["workspace_id"]])
    return p.PlatformInstancePage(instances=[instance_info(r) for r in page], next_cursor=cursor)


def _moderate(server: Server, title: str, content: str) -> list[str]:
    """The deployment's keywords found in the broadcast (case-insensitive substrings)."""
    text = f"{title}\n{content}".casefold()
    return [keyword for keyword in server.config.moderation_keywords if keyword.casefold() in text]


async def broadcast_create(server: Server, connection: Connection, request: p.BroadcastCreate,
                           ctx: RequestContext) -> p.BroadcastInfo:
    account_id = await _existing(server, request.platform_service_account_id)
    operator_id = _operator(ctx)
    title = _title(request.title)
    matched = _moderate(server, title, request.content)
    if matched:
        await server.db.transaction(store.record_moderation_block, account_id=account_id, operator_id=operator_id,
                                    client_broadcast_id=request.client_broadcast_id, title=title,
                                    content=request.content, matched=matched)
        raise ProtocolError(ErrorCode.CONTENT_BLOCKED, "this broadcast cannot be sent",
                            details={"reason": "moderation_keyword"})
    await check_broadcast_assets(server, account_id, request.asset_ids)
    accepted = await _registry(server).submit(account_id, pa.AcceptBroadcast(
        operator_id, request.client_broadcast_id, title, request.content, POST_MESSAGE_TYPE, _correlation(),
        tuple(request.asset_ids)))
    info = await _broadcast(server, accepted.broadcast["id"], accepted.replayed)
    if not accepted.replayed:
        publish_platform(server, "platform_service_account.broadcast_accepted", p.BroadcastChanged(broadcast=info))
    return info


async def broadcast_get(server: Server, connection: Connection, request: p.BroadcastGet,
                        ctx: RequestContext) -> p.BroadcastInfo:
    return await _broadcast(server, _check(request.broadcast_id, "pbc", "broadcast"))


async def broadcast_list(server: Server, connection: Connection, request: p.BroadcastList,
                         ctx: RequestContext) -> p.BroadcastPage:
    account_id = await _existing(server, request.platform_service_account_id)
    before = _decode_cursor(request.cursor, 1)
    if before is not None and not (before[0].isascii() and before[0].isdigit() and len(before[0]) <= 18):
        raise ProtocolError(ErrorCode.INVALID, "malformed cursor", details={"reason": "bad_cursor"})

    async def unit(conn) -> list[tuple[Any, Any]]:
        rows = await store.broadcasts(conn, account_id, int(before[0]) if before else None, request.limit + 1)
        return [(row, await store.target_counts(conn, row["id"])) for row in rows]
    rows = await server.db.run(unit)
    page, cursor = _page(rows, request.limit, lambda r: [str(r[0]["acceptance_ordinal"])])
    return p.BroadcastPage(broadcasts=[broadcast_info(row, counts) for row, counts in page], next_cursor=cursor)


async def delivery_list(server: Server, connection: Connection, request: p.BroadcastDeliveryList,
                        ctx: RequestContext) -> p.BroadcastDeliveryPage:
    broadcast_id = _check(request.broadcast_id, "pbc", "broadcast")
    await server.db.run(store.broadcast, broadcast_id)
    after = _decode_cursor(request.cursor, 1)
    rows = await server.db.run(store.deliveries_of, broadcast_id, request.state, after[0] if after else None,
                               request.limit + 1)
    page, cursor = _page(rows, request.limit, lambda r: [r["workspace_id"]])
    return p.BroadcastDeliveryPage(deliveries=[delivery_info(r) for r in page], next_cursor=cursor)


async def _delivery_command(server: Server, ctx: RequestContext, delivery_id: str, expected_version: int,
                            command_type: type) -> p.BroadcastDeliveryInfo:
    _check(delivery_id, "pbd", "delivery")
    account_id = (await server.db.run(store.delivery, delivery_id))["platform_service_account_id"]
    row = await _registry(server).submit(account_id, command_type(delivery_id, expected_version, _operator(ctx),
                                                                  _correlation()))
    info = delivery_info(row)
    publish_platform(server, "platform_service_account.broadcast_delivery_changed", p.BroadcastDeliveryChanged(delivery=info))
    _registry(server).wake(account_id)
    return info


async def delivery_retry(server: Server, connection: Connection, request: p.BroadcastDeliveryRetry,
                         ctx: RequestContext) -> p.BroadcastDeliveryInfo:
    return await _delivery_command(server, ctx, request.delivery_id, request.expected_version, pa.RetryDelivery)


async def delivery_settle_skip(server: Server, connection: Connection, request: p.BroadcastDeliverySettleSkip,
                               ctx: RequestContext) -> p.BroadcastDeliveryInfo:
    return await _delivery_command(server, ctx, request.delivery_id, request.expected_version, pa.SettleSkip)


async def audit_list(server: Server, connection: Connection, request: p.PlatformAuditList,
                     ctx: RequestContext) -> p.PlatformAuditPage:
    account_id = request.platform_service_account_id
    if account_id is not None:
        _check(account_id, "psa", "platform service account")
    before = _decode_cursor(request.cursor, 1)
    rows = await server.db.run(store.audit_events, account_id, before[0] if before else None, request.limit + 1)
    page, cursor = _page(rows, request.limit, lambda r: [r["id"]])
    return p.PlatformAuditPage(events=[audit_info(r) for r in page], next_cursor=cursor)


HANDLERS: dict = {
    p.PlatformSubscribe: subscribe, p.PlatformAccountCreate: account_create, p.PlatformAccountList: account_list,
    p.PlatformAccountGet: account_get, p.PlatformAccountUpdate: account_update, p.PlatformAccountDelete: account_delete,
    p.PlatformInstanceList: instance_list, p.BroadcastCreate: broadcast_create, p.BroadcastGet: broadcast_get,
    p.BroadcastList: broadcast_list, p.BroadcastDeliveryList: delivery_list, p.BroadcastDeliveryRetry: delivery_retry,
    p.BroadcastDeliverySettleSkip: delivery_settle_skip, p.PlatformAuditList: audit_list,
}
