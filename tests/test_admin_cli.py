"""The admin CLI (`scopewire init | workspace | member | invite | apikey`) as an
operator runs it, against an external database URL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.credentials import secret_hash
from storage.bridge import Database
from tests.conftest import add_person

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def scopewire(dsn: str, *args: str) -> tuple[int, object, str]:
    done = subprocess.run([sys.executable, "-m", "server.cli", *args, "--database-url", dsn],
                          capture_output=True, text=True, timeout=120, cwd=PROJECT_ROOT)
    output = json.loads(done.stdout) if done.returncode == 0 else None
    return done.returncode, output, done.stderr


async def test_single_workspace_edition_lifecycle(database_dsn: str, member_password_hash: str):
    code, init, _ = scopewire(database_dsn, "init", "--email", "Root@Example.com", "--name", "Root",
                              "--workspace-name", "Acme", "--workspace-slug", "acme")
    assert code == 0 and init["email"] == "root@example.com" and len(init["password"]) >= 20
    code, _, err = scopewire(database_dsn, "init", "--email", "x@example.com", "--name", "X",
                             "--workspace-name", "Other", "--workspace-slug", "other")
    assert code == 1 and "already initialised" in err
    code, _, err = scopewire(database_dsn, "workspace", "create", "--name", "Two", "--slug", "two",
                             "--owner-email", "two@example.com")
    assert code == 1 and "edition_limit" in err

    code, agent, _ = scopewire(database_dsn, "member", "create-agent", "--workspace", "acme", "--owner",
                               "root@example.com", "--handle", "helper", "--name", "Helper")
    assert code == 0
    # The protocol's name rule holds for the operator too: no bidi overrides or zero-width characters.
    code, _, err = scopewire(database_dsn, "member", "create-agent", "--workspace", "acme", "--owner",
                             "root@example.com", "--handle", "spoof", "--name", "Help\u202eer")
    assert code == 1 and "invalid: display_name" in err
    code, key, _ = scopewire(database_dsn, "apikey", "create", "--workspace", "acme", "--member", "helper",
                             "--scopes", "read")
    assert code == 0 and key["key"].startswith("swk_") and key["member_id"] == agent["member_id"]
    code, keys, _ = scopewire(database_dsn, "apikey", "list", "--workspace", "acme")
    assert [k["id"] for k in keys] == [key["api_key_id"]] and "key" not in keys[0] and "key_hash" not in keys[0]
    assert scopewire(database_dsn, "apikey", "revoke", "--workspace", "acme", key["api_key_id"])[0] == 0
    code, _, err = scopewire(database_dsn, "apikey", "revoke", "--workspace", "acme", key["api_key_id"])
    assert code == 1 and "already revoked" in err

    code, invitation, _ = scopewire(database_dsn, "invite", "create", "--workspace", "acme", "--email",
                                    "new@example.com", "--role", "developer")
    assert code == 0 and invitation["token"].startswith("swi_")
    code, _, _ = scopewire(database_dsn, "invite", "create", "--workspace", "acme", "--email", "n@example.com",
                           "--role", "owner")
    assert code == 2  # argparse refuses: invitations never grant owner
    assert scopewire(database_dsn, "invite", "revoke", "--workspace", "acme", invitation["invitation_id"])[0] == 0
    code, invitations, _ = scopewire(database_dsn, "invite", "list", "--workspace", "acme")
    assert [i["status"] for i in invitations] == ["revoked"]

    async with Database(database_dsn) as db:
        person = await add_person(db, init["workspace_id"], "dev@example.com", "viewer", member_password_hash)
        stored = await db.run(lambda c: c.fetchval("SELECT count(*) FROM workspace_invitations WHERE token_hash = $1",
                                                   secret_hash(invitation["token"])))
        assert stored == 1
    assert scopewire(database_dsn, "member", "role", "--workspace", "acme", "dev@example.com", "admin")[0] == 0
    code, members, _ = scopewire(database_dsn, "member", "list", "--workspace", "acme")
    assert {m["id"]: m["role"] for m in members}[person.member_id] == "admin"
    code, _, err = scopewire(database_dsn, "member", "role", "--workspace", "acme", "root@example.com", "viewer")
    assert code == 1 and "at least one active owner" in err

    assert scopewire(database_dsn, "workspace", "suspend", "acme")[0] == 0
    code, listed, _ = scopewire(database_dsn, "workspace", "list")
    assert [(w["slug"], w["status"]) for w in listed] == [("acme", "suspended")]
    assert scopewire(database_dsn, "workspace", "resume", "acme")[0] == 0
    code, fenced, _ = scopewire(database_dsn, "workspace", "fence", "acme", "--new-generation")
    assert code == 0 and fenced == {"workspace_id": init["workspace_id"], "write_fenced": True, "active_generation": 2}
    code, _, err = scopewire(database_dsn, "invite", "create", "--workspace", "acme", "--email", "f@example.com")
    assert code == 1 and "fenced" in err
    code, _, err = scopewire(database_dsn, "member", "list", "--workspace", "wsp_zzzzzzzzzzzzzz")
    assert code == 1 and "not found" in err


@pytest.mark.parametrize("edition", ["multi"])
async def test_multi_workspace_edition_creates_workspaces(database_dsn: str, edition: str):
    assert scopewire(database_dsn, "init", "--email", "a@example.com", "--name", "A", "--workspace-name", "A",
                     "--workspace-slug", "a", "--edition", edition)[0] == 0
    code, created, _ = scopewire(database_dsn, "workspace", "create", "--name", "B", "--slug", "b",
                                 "--owner-email", "b@example.com")
    assert code == 0 and created["owner_password"]
    code, _, err = scopewire(database_dsn, "workspace", "create", "--name", "B2", "--slug", "b",
                             "--owner-email", "a@example.com")
    assert code == 1 and "taken" in err
    code, existing_owner, _ = scopewire(database_dsn, "workspace", "create", "--name", "C", "--slug", "c",
                                        "--owner-email", "a@example.com")
    assert code == 0 and existing_owner["owner_password"] is None  # an existing account keeps its password
    code, listed, _ = scopewire(database_dsn, "workspace", "list")
    assert sorted(w["slug"] for w in listed) == ["a", "b", "c"]
