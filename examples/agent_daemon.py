"""An agent daemon: connects with the agent's API key, follows the workspace
feed, and prints what is routed to it — messages that mention it and
messages in its DMs.  It survives server restarts without losing or
repeating anything (the client resumes from its cursors).

    python examples/agent_daemon.py --url ws://127.0.0.1:8765 --api-key swk_...
    (or SCOPEWIRE_URL / SCOPEWIRE_API_KEY in the environment)

The cursor (last workspace global seq handled) is kept in --state-file, so a
restart of the daemon itself also resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.resuming import ResumingClient  # noqa: E402


def routed_to_me(event: dict, member_id: str, dm_scopes: set[str]) -> bool:
    """Only server-computed facts decide: `metadata.mentions` is written by the
    server's mention parser and authorization (a client sending that key gets
    `invalid`), and whether a scope is a DM comes from `scope.get`."""
    if event.get("event") != "message.created":
        return False
    data = event["data"]
    if data.get("author_member_id") == member_id:
        return False
    return member_id in data.get("metadata", {}).get("mentions", []) or event["scope_id"] in dm_scopes


async def run(url: str, api_key: str, state_file: Path | None, limit: int | None) -> None:
    after = int(state_file.read_text()) if state_file and state_file.exists() else None
    client = ResumingClient(url, api_key=api_key)
    client.follow_workspace(after_global_seq=after)
    async with client.running() as events:
        await _handle(client, events, state_file, limit)


async def _handle(client: ResumingClient, events, state_file: Path | None, limit: int | None) -> None:
    handled = 0
    dm_scopes: set[str] = set()
    async for event in events:
        member_id = client.identity["member_id"]
        if event.get("event") == "message.created" and event["data"].get("author_member_id") != member_id:
            if not dm_scopes or event["scope_id"] not in dm_scopes:
                scope = await client.call("scope.get", scope_id=event["scope_id"])
                if scope["type"] == "dm":
                    dm_scopes.add(scope["id"])
        if routed_to_me(event, member_id, dm_scopes):
            print(json.dumps({"scope_id": event["scope_id"], "seq": event["seq"], "global_seq": event["global_seq"],
                              "from": event["data"]["author_member_id"], "content": event["data"]["content"]}),
                  flush=True)
            handled += 1
        if state_file and client.global_cursor is not None:
            state_file.write_text(str(client.global_cursor))
        if limit is not None and handled >= limit:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("SCOPEWIRE_URL", "ws://127.0.0.1:8765"))
    parser.add_argument("--api-key", default=os.environ.get("SCOPEWIRE_API_KEY"))
    parser.add_argument("--state-file", type=Path, help="where to keep the resume cursor")
    parser.add_argument("--limit", type=int, help="exit after this many routed messages")
    args = parser.parse_args()
    if not args.api_key:
        parser.error("an agent API key is required (--api-key or SCOPEWIRE_API_KEY)")
    trio.run(run, args.url, args.api_key, args.state_file, args.limit)


if __name__ == "__main__":
    main()
