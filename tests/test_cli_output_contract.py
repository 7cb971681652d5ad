"""The admin CLI's JSON output fields, as the README documents them: each
command run once against a real database, its keys compared with the table."""

from __future__ import annotations

from storage.bridge import Database
from tests.conftest import add_person
from tests.test_admin_cli import scopewire

# command → the keys of its JSON object (for list commands: of each element).
CLI_OUTPUT_FIELDS = {
    "init": {"workspace_id", "account_id", "member_id", "email", "password", "note"},
    "workspace create": {"workspace_id", "owner_account_id", "owner_member_id", "owner_password"},
    "workspace list": {"id", "name", "slug", "type", "status", "role", "member_id"},
    "workspace suspend": {"workspace_id", "status"},
    "workspace resume": {"workspace_id", "status"},
    "workspace fence": {"workspace_id", "write_fenced", "active_generation"},
    "member list": {"id", "kind", "handle", "display_name", "status", "owner_member_id", "visibility", "role",
                    "email"},
    "member role": {"member_id", "role"},
    "member create-agent": {"member_id", "kind"},
    "member create-service": {"member_id", "kind"},
    "invite create": {"invitation_id", "token", "expires_at", "note"},
    "invite list": {"id", "email", "role", "status", "expires_at", "accepted_at", "revoked_at", "created_at"},
    "invite revoke": {"invitation_id", "status"},
    "apikey create": {"api_key_id", "key", "member_id", "expires_at", "note"},
    "apikey list": {"id", "member_id", "name", "scopes", "status", "expires_at", "last_used_at", "created_at",
                    "revoked_at"},
    "apikey revoke": {"api_key_id", "status"},
}


async def test_every_admin_command_prints_the_documented_fields(database_dsn: str, member_password_hash: str):
    outputs: dict[str, object] = {}

    def run(name: str, *args: str) -> dict:
        code, output, err = scopewire(database_dsn, *name.split(), *args)
        assert code == 0, (name, err)
        outputs[name] = output
        return output[0] if isinstance(output, list) else output

    ws = ("--workspace", "acme")
    run("init", "--email", "root@example.com", "--name", "Root", "--workspace-name", "Acme", "--workspace-slug",
        "acme", "--edition", "multi")
    run("workspace create", "--name", "Two", "--slug", "two", "--owner-email", "two@example.com")
    run("workspace list")
    run("workspace suspend", "two")
    run("workspace resume", "two")
    run("workspace fence", "two", "--new-generation")
    agent = run("member create-agent", *ws, "--owner", "root@example.com", "--handle", "helper", "--name", "H")
    run("member create-service", *ws, "--handle", "billing", "--name", "Billing")
    invitation = run("invite create", *ws, "--email", "new@example.com")
    run("invite list", *ws)
    run("invite revoke", *ws, invitation["invitation_id"])
    key = run("apikey create", *ws, "--member", "helper")
    run("apikey list", *ws)
    run("apikey revoke", *ws, key["api_key_id"])
    run("member list", *ws)
    async with Database(database_dsn) as db:
        workspace_id = await db.run(lambda c: c.fetchval("SELECT id FROM workspaces WHERE slug = 'acme'"))
        await add_person(db, workspace_id, "dev@example.com", "developer", member_password_hash)
    run("member role", *ws, "dev@example.com", "viewer")
    assert agent["kind"] == "agent"
    assert set(outputs) == set(CLI_OUTPUT_FIELDS)
    for name, output in outputs.items():
        for item in output if isinstance(output, list) else [output]:
            assert set(item) == CLI_OUTPUT_FIELDS[name], name
