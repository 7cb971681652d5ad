"""An agent daemon: connects with the agent's API key, subscribes to its
routed feed — only what the server decided is for this agent: live mentions
by members allowed to wake it, explicit recipients, messages in its DMs,
auto-wake, reactions to its messages — and handles each delivery: reads bounded context (the few
messages up to the delivered one, through the readable predicate), prints a
JSON line, and with --reply answers in the delivery's scope (for a message
in a thread, in the thread).

    python examples/agent_daemon.py --url ws://127.0.0.1:8765 --api-key swk_... [--state-file F] [--reply]
    (or SCOPEWIRE_URL / SCOPEWIRE_API_KEY in the environment)

Deliveries are at least once (an unacked one comes again after a reconnect,
a server restart or a restart of this daemon), so handling is idempotent:
- a reply's `client_message_id` is derived from the delivery's dedupe key, so
  sending it again after a crash returns the original instead of posting twice;
- --state-file keeps the dedupe keys handled but not yet acked: one of them
  delivered again is acked without being handled again;
- a key is dropped once the server confirmed its ack (acked deliveries are
  never sent again), or at the next start when the server says its delivery
  is no longer pending or leased (the ack went through, its reply was lost to
  a crash), so the file stays small.
A crash between printing a line and recording its key prints that line again
on redelivery (with a higher `attempt`): consumers dedupe by `dedupe_key`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.resuming import ResumingClient  # noqa: E402
from client.trio_client import ClientError  # noqa: E402

log = logging.getLogger("agent_daemon")

CONTEXT_MESSAGES = 5  # bounded context: the delivered message and the few before it


class HandledKeys:
    """Dedupe keys handled but not yet acked (with their deliveries' seqs), kept in a
    file that is replaced atomically (write a temporary file, then os.replace) on
    every change."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.seqs: dict[str, int | None] = {}
        if path is not None and path.exists():
            state = json.loads(path.read_text())
            self.seqs = {key: state.get("delivery_seqs", {}).get(key) for key in state["handled"]}

    def __contains__(self, key: str) -> bool:
        return key in self.seqs

    def add(self, key: str, delivery_seq: int) -> None:
        self.seqs[key] = delivery_seq
        self._save()

    def discard(self, key: str) -> None:
        if key in self.seqs:
            del self.seqs[key]
            self._save()

    async def prune(self, client: ResumingClient) -> None:
        """Drop the keys whose deliveries can never come again.  A crash after the server
        took an ack but before its reply arrived leaves the key here, and no redelivery
        ever clears it: ask the server for each key's delivery once, at start."""
        for key, seq in list(self.seqs.items()):
            if seq is None:
                continue
            page = await client.call("delivery.list", after_seq=seq - 1, limit=1)
            found = [d for d in page["deliveries"] if d["delivery_seq"] == seq]
            if not found or found[0]["status"] not in ("pending", "leased"):
                log.info("%s was acked before this start (or is gone): forgetting it", key)
                self.discard(key)

    def _save(self) -> None:
        if self.path is None:
            return
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "w") as file:
            json.dump({"handled": sorted(self.seqs), "delivery_seqs": self.seqs}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)


def reply_id(dedupe_key: str) -> str:
    """The reply's idempotency key: the same for every redelivery of one delivery."""
    return f"reply:{dedupe_key}"


async def read_context(client: ResumingClient, delivery: dict) -> list[dict]:
    """The last few messages of the delivery's scope, ending at the delivered
    message (or the newest, for an activity without one).  The server applies
    the readable predicate: what this agent may not read is not there."""
    message = delivery.get("message")
    bound = {"before_seq": message["seq"] + 1} if message is not None else {}
    try:
        page = await client.call("message.history", scope_id=delivery["scope_id"], limit=CONTEXT_MESSAGES, **bound)
    except ClientError as exc:  # e.g. the agent left the scope since: handle without context
        log.info("no context for %s: %s", delivery["dedupe_key"], exc.code)
        return []
    return page["messages"]


async def handle(client: ResumingClient, delivery: dict, reply: bool) -> dict:
    context = await read_context(client, delivery)
    message, activity = delivery.get("message"), delivery.get("activity")
    record = {
        "dedupe_key": delivery["dedupe_key"], "delivery_seq": delivery["delivery_seq"],
        "attempt": delivery["attempt"], "reason": delivery["reason"],
        "authority": delivery.get("authority"), "kind": delivery["kind"],
        "scope_id": delivery["scope_id"], "message_id": delivery.get("message_id"),
        "from": activity["actor_member_id"] if activity else message and message["author_member_id"],
        "content": message["content"] if message else None,
        "seq": message and message["seq"],
        "context": [{"seq": m["seq"], "from": m["author_member_id"], "content": m["content"]} for m in context],
    }
    if reply and delivery["kind"] == "message":
        try:
            # Deterministic content and id: a resend after a crash returns the original.
            sent = await client.call("message.send", scope_id=delivery["scope_id"],
                                     content=f"handled {delivery['message_id']}",
                                     client_message_id=reply_id(delivery["dedupe_key"]))
            record["reply_id"] = sent["id"]
        except ClientError as exc:  # e.g. the scope was archived: nothing to retry, the delivery is still handled
            record["reply_error"] = exc.code
    return record


async def run(url: str, api_key: str, state_file: Path | None, limit: int | None, reply: bool,
              max_in_flight: int) -> None:
    handled_keys = HandledKeys(state_file)
    client = ResumingClient(url, api_key=api_key)
    client.follow_deliveries(max_in_flight=max_in_flight)
    handled = 0
    async with client.running() as events:
        await handled_keys.prune(client)
        async for event in events:
            if event["event"] != "delivery":
                continue
            delivery = event["data"]
            key = delivery["dedupe_key"]
            if key in handled_keys:
                log.info("%s was handled before its ack got through: acking it", key)
            else:
                print(json.dumps(await handle(client, delivery, reply)), flush=True)
                handled_keys.add(key, delivery["delivery_seq"])
                handled += 1
            await client.ack([delivery["delivery_seq"]])
            # The ack reply arrived: the delivery is acked (now or before) and never sent again.
            handled_keys.discard(key)
            if limit is not None and handled >= limit:
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("SCOPEWIRE_URL", "ws://127.0.0.1:8765"))
    parser.add_argument("--api-key", default=os.environ.get("SCOPEWIRE_API_KEY"))
    parser.add_argument("--state-file", type=Path,
                        help="where to keep the dedupe keys handled but not yet acked")
    parser.add_argument("--limit", type=int, help="exit after handling this many deliveries")
    parser.add_argument("--reply", action="store_true", help="reply to each delivered message in its scope")
    parser.add_argument("--max-in-flight", type=int, default=100, help="unacked deliveries held at once")
    args = parser.parse_args()
    if not args.api_key:
        parser.error("an agent API key is required (--api-key or SCOPEWIRE_API_KEY)")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    trio.run(run, args.url, args.api_key, args.state_file, args.limit, args.reply, args.max_in_flight)


if __name__ == "__main__":
    main()
