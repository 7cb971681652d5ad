"""The machine-readable protocol spec: JSON Schema for every frame, generated
from the msgspec Structs and the tables in protocol/results.py and
protocol/events.py.  `python -m protocol.spec` rewrites the committed
protocol/protocol.schema.json and protocol/asyncapi.json; a test fails when
either is stale."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Union

import msgspec

from protocol import frames, guide, validation
from protocol.errors import ErrorCode
from protocol.events import EVENT_FRAMES, EVENTS
from protocol.results import RESULT_FRAMES, RESULTS_BY_OP

SPEC_PATH = Path(__file__).with_name("protocol.schema.json")

# protocol/validation.py: breaking one answers `invalid` with details.field.
INPUT_RULES = {
    "no_nul_in_any_string": True,
    "name_fields": sorted(validation.NAME_FIELDS),
    "name_forbidden_unicode_categories": sorted(validation.FORBIDDEN_NAME_CATEGORIES),
    "client_message_types": list(validation.CLIENT_MESSAGE_TYPES),
    "reserved_metadata_keys": sorted(validation.RESERVED_METADATA_KEYS),
    "max_metadata_depth": validation.MAX_METADATA_DEPTH,
    "max_metadata_bytes": validation.MAX_METADATA_BYTES,
    "max_metadata_integer": validation.MAX_SAFE_INTEGER,
}

CLOSE_CODES = {
    "1001": "server shutting down",
    "1002": "WebSocket protocol violation (e.g. an unmasked client frame)",
    "1007": "a text frame that is not UTF-8",
    "1009": "message larger than the server's frame limit",
    str(frames.CLOSE_UNAUTHENTICATED): "authentication timeout",
    str(frames.CLOSE_REVOKED): "credential revoked or expired, membership ended or workspace suspended",
    str(frames.CLOSE_SLOW_CONSUMER): "slow consumer: reconnect and resume from your cursors",
    str(frames.CLOSE_IDLE): "idle timeout",
    str(frames.CLOSE_UNAVAILABLE): "unavailable: delivery failed (e.g. the database is down); reconnect and "
                                   "resume from your cursors",
}


# Every server frame with its `data` typed: errors, one result frame per op, one event frame per event.
TYPED_SERVER_FRAMES = (frames.Error, *RESULT_FRAMES.values(), *EVENT_FRAMES.values())


def _ref(struct: type) -> dict:
    return {"$ref": f"#/$defs/{struct.__name__}"}


def build() -> dict:
    client = Union[frames.CLIENT_FRAMES]  # type: ignore[valid-type]
    (client_schema, *_), components = msgspec.json.schema_components(
        (client, *TYPED_SERVER_FRAMES, *RESULTS_BY_OP.values(), *EVENTS.values()), ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "scopewire WebSocket protocol",
        "description": "Client frames are requests (tagged by `op`), each answered by exactly one `result` or "
                       "`error` frame with the same `id`; server pushes are `event` frames. JSON text frames, or "
                       "MessagePack binary frames with the `scopewire.msgpack` subprotocol. `results` names the "
                       "type of each op's `result.data`, `events` the type of each event's `data`; "
                       "`server_frame` is exactly the set of frames the server sends. Clients should ignore "
                       "fields they do not know: new optional fields may be added within a protocol version.",
        "protocol_version": frames.PROTOCOL_VERSION,
        "subprotocols": {frames.JSON_SUBPROTOCOL: "JSON text frames (also when no subprotocol is offered)",
                         frames.MSGPACK_SUBPROTOCOL: "MessagePack binary frames, same shapes (preferred when "
                                                     "both are offered)"},
        "client_frame": client_schema,
        "server_frame": {"oneOf": [_ref(t) for t in TYPED_SERVER_FRAMES]},
        "results": {op: _ref(t) for op, t in sorted(RESULTS_BY_OP.items())},
        "events": {name: _ref(t) for name, t in sorted(EVENTS.items())},
        "error_cases": guide.ERROR_CASES,
        "auth_flow": guide.AUTH_FLOW,
        "connection": guide.CONNECTION_RULES,
        "subscribe_cursors": guide.SUBSCRIBE_CURSORS,
        "history": guide.HISTORY,
        "budgets": {name: {"per_second": rate, "burst": burst, "key": key}
                    for name, (rate, burst, key) in guide.BUDGETS.items()},
        "ephemeral_ttl_ms": {"typing": guide.TYPING_TTL_MS, "presence": guide.PRESENCE_TTL_MS},
        "mentions": guide.MENTIONS,
        "handles": guide.HANDLES,
        "nodes": guide.NODES,
        "error_codes": [code.value for code in ErrorCode],
        "input_rules": INPUT_RULES,
        "close_codes": CLOSE_CODES,
        "$defs": components,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_all() -> None:
    """Rewrite both generated documents: the JSON Schema and the AsyncAPI document."""
    from protocol import asyncapi  # it builds on this module

    SPEC_PATH.write_text(render())
    asyncapi.ASYNCAPI_PATH.write_text(asyncapi.render())
    print(f"wrote {SPEC_PATH} and {asyncapi.ASYNCAPI_PATH}", file=sys.stderr)


if __name__ == "__main__":
    write_all()
