"""Session tokens carry and are checked for issuer and audience
(workspace-multi-tenant.md §9.2): a token signed with the server's own key but
naming another issuer or audience, or none, is `unauthenticated`."""

from __future__ import annotations

import json
import time

from client import connect
from server.credentials import _HEADER, SESSION_AUDIENCE, SESSION_ISSUER, _b64, _unb64
from tests.conftest import App
from tests.test_tenancy import expect_error


def _signed(app: App, claims: dict) -> str:
    """A token with these claims, signed with the server's own session key."""
    signing_input = f"{_HEADER}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(app.server.auth.signer.private_key.sign(signing_input.encode()))}"


async def test_tokens_name_issuer_and_audience_and_others_are_refused(app: App, tenants):
    alpha, _ = tenants
    async with connect(app.url) as conn:
        issued = await conn.login(alpha.owner.email, alpha.owner.password)
    payload = json.loads(_unb64(issued["token"].split(".")[1]))
    assert (payload["iss"], payload["aud"]) == (SESSION_ISSUER, SESSION_AUDIENCE)
    now = int(time.time())
    good = {"sub": alpha.owner.account_id, "iss": SESSION_ISSUER, "aud": SESSION_AUDIENCE, "iat": now,
            "exp": now + 600, "jti": "j", "token_version": payload["token_version"]}
    async with connect(app.url) as conn:
        await conn.auth(token=_signed(app, good))  # the forger's control: right claims are accepted
    forged = [dict(good, iss="cloud_control_plane"), dict(good, aud="langbot_cloud_edge"),
              {k: v for k, v in good.items() if k != "iss"}, {k: v for k, v in good.items() if k != "aud"}]
    async with connect(app.url) as conn:
        for claims in forged:
            await expect_error("unauthenticated", conn.auth(token=_signed(app, claims)))
        await expect_error("unauthenticated", conn.call("workspace.list"))

