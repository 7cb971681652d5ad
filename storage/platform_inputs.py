"""The deployment provisioning generation (service-account §2.4): Platform Account
create and Workspace create lock one boundary, advance it and record their input,
from which each platform account's actor provisions the cross product.  Apart
from storage/platform.py because Workspace create (storage/tenancy.py) writes
here too."""

from __future__ import annotations

import asyncpg

from domain.platform import PLATFORM_CHANNEL
from storage.errors import Conflict


async def notify(conn: asyncpg.Connection, account_id: str) -> None:
    """Wake the platform actor(s) of `account_id` ('*': all) in every process, at commit."""
    await conn.execute("SELECT pg_notify($1, $2)", PLATFORM_CHANNEL, account_id)


# --- the deployment provisioning generation -----------------------------------------------------------

async def next_generation(conn: asyncpg.Connection) -> int:
    """Lock the deployment generation boundary and advance it (§2.4); the row stays locked until commit."""
    generation = await conn.fetchval(
        "UPDATE instance_metadata SET platform_provisioning_generation = platform_provisioning_generation + 1 "
        "RETURNING platform_provisioning_generation")
    if generation is None:
        raise Conflict("not_initialized", "run `scopewire init` first")
    return generation


async def record_input(conn: asyncpg.Connection, generation: int, *, account_id: str | None = None,
                        workspace_id: str | None = None) -> None:
    await conn.execute(
        "INSERT INTO platform_service_account_provisioning_inputs (generation, input_kind, "
        "platform_service_account_id, workspace_id) VALUES ($1, $2, $3, $4)",
        generation, "platform_account_created" if account_id else "workspace_created", account_id, workspace_id,
    )


async def record_workspace_created(conn: asyncpg.Connection, workspace_id: str) -> None:
    """The Workspace create hook: its generation input, and a wake for every platform actor."""
    await record_input(conn, await next_generation(conn), workspace_id=workspace_id)
    await notify(conn, "*")
