"""The protocol as an AsyncAPI 3.0 document (protocol/asyncapi.json), generated
from the same Structs and tables as protocol.schema.json: one WebSocket
channel; one `send` operation per op whose reply is its typed result or an
error; one `receive` operation per event; close codes, subprotocols and the
in-band auth flow.  `python -m protocol.spec` rewrites it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import msgspec

from protocol import frames, guide
from protocol.events import EVENT_FRAMES, EVENTS
from protocol.results import RESULT_FRAMES
from protocol.spec import CLOSE_CODES, INPUT_RULES

ASYNCAPI_PATH = Path(__file__).with_name("asyncapi.json")
CHANNEL = "connection"


def _summary(struct: type) -> str:
    doc = (struct.__doc__ or "").strip()
    return " ".join(doc.split()) if doc and not doc.startswith(("A base", "Just enough")) else ""


def _message(name: str, struct: type, title: str) -> dict:
    message = {"name": name, "title": title, "payload": {"$ref": f"#/components/schemas/{struct.__name__}"}}
    summary = _summary(struct)
    if summary:
        message["summary"] = summary[:200]
    return message


def build() -> dict:
    client_frames = frames.CLIENT_FRAMES
    _, components = msgspec.json.schema_components(
        (Union[client_frames], frames.Error, *RESULT_FRAMES.values(), *EVENT_FRAMES.values()),  # type: ignore
        ref_template="#/components/schemas/{name}")
    messages: dict[str, dict] = {"error": _message("error", frames.Error, "An error reply (or an unsolicited "
                                                                          "error, without id)")}
    operations: dict[str, dict] = {}
    channel_ref = {"$ref": f"#/channels/{CHANNEL}"}
    for request in client_frames:
        op = request.__struct_config__.tag
        messages[f"{op}.request"] = _message(f"{op}.request", request, f"{op} request")
        messages[f"{op}.result"] = _message(f"{op}.result", RESULT_FRAMES[op], f"{op} result")
        operation = {
            "action": "send",
            "channel": channel_ref,
            "title": op,
            "messages": [{"$ref": f"#/channels/{CHANNEL}/messages/{op}.request"}],
            "reply": {"channel": channel_ref,
                      "messages": [{"$ref": f"#/channels/{CHANNEL}/messages/{op}.result"},
                                   {"$ref": f"#/channels/{CHANNEL}/messages/error"}]},
        }
        if _summary(request):
            operation["summary"] = _summary(request)[:200]
            operation["description"] = _summary(request)
        operations[op] = operation
    for name, frame in EVENT_FRAMES.items():
        messages[f"{name}.event"] = _message(f"{name}.event", frame, f"{name} event")
        operations[f"on.{name}"] = {
            "action": "receive",
            "channel": channel_ref,
            "title": f"{name} event",
            "description": _summary(EVENTS[name]) or f"A `{name}` push to a subscribed connection.",
            "messages": [{"$ref": f"#/channels/{CHANNEL}/messages/{name}.event"}],
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "scopewire",
            "version": str(frames.PROTOCOL_VERSION),
            "description": "\n\n".join([
                "The scopewire realtime messaging protocol over one WebSocket. Each request (`op`) gets exactly "
                "one reply with the same `id`: its typed result or an error. Subscribed connections also "
                "receive `event` frames.",
                "Auth flow: " + guide.AUTH_FLOW,
                "Connection: " + guide.CONNECTION_RULES,
                "Subscribe cursors: " + guide.SUBSCRIBE_CURSORS,
                "History: " + guide.HISTORY,
                "Mentions: " + guide.MENTIONS,
                "Handles: " + guide.HANDLES,
                "Several nodes: " + guide.NODES,
                "Error codes by case: " + "; ".join(f"{case}: `{code}`" for case, code in guide.ERROR_CASES.items()),
                "Budgets: " + "; ".join(f"{name}: {rate}/s, burst {burst}, {key}"
                                        for name, (rate, burst, key) in guide.BUDGETS.items())
                + f". Typing signals expire {guide.TYPING_TTL_MS} ms after sending, presence {guide.PRESENCE_TTL_MS} "
                  "ms.",
            ]),
        },
        "defaultContentType": "application/json",
        "servers": {
            "scopewire": {
                "host": "localhost:8765",
                "protocol": "ws",
                "description": f"The server's WebSocket port (`wss` behind TLS). Subprotocols: "
                               f"`{frames.JSON_SUBPROTOCOL}` (or none) for JSON text frames, "
                               f"`{frames.MSGPACK_SUBPROTOCOL}` for MessagePack binary frames of the same shapes "
                               "(preferred when both are offered). No WebSocket extensions.",
            },
        },
        "channels": {
            CHANNEL: {
                "address": "/",
                "title": "The client's WebSocket connection",
                "description": "Every request, reply and event travels on the one connection.",
                "messages": {name: {"$ref": f"#/components/messages/{name}"} for name in messages},
            },
        },
        "operations": operations,
        "components": {"schemas": components, "messages": messages},
        "x-scopewire-subprotocols": {frames.JSON_SUBPROTOCOL: "application/json text frames (the default)",
                                     frames.MSGPACK_SUBPROTOCOL: "application/msgpack binary frames"},
        "x-scopewire-close-codes": CLOSE_CODES,
        "x-scopewire-input-rules": INPUT_RULES,
        "x-scopewire-error-cases": guide.ERROR_CASES,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
