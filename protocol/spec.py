"""The machine-readable protocol spec: JSON Schema for every frame, generated
from the msgspec Structs.  `python -m protocol.spec` rewrites the committed
protocol/protocol.schema.json; a test fails when that file is stale."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Union

import msgspec

from protocol import frames, validation
from protocol.errors import ErrorCode

SPEC_PATH = Path(__file__).with_name("protocol.schema.json")

SERVER_FRAMES = (frames.Result, frames.Error, frames.Event)
RESULT_TYPES = (
    frames.PingResult, frames.HelloResult, frames.AuthResult, frames.WorkspaceInfo, frames.MemberInfo,
    frames.InvitationInfo, frames.ApiKeyInfo, frames.Ok, frames.ScopeInfo, frames.ScopeMemberInfo,
    frames.MessageInfo, frames.MessageDetail, frames.HistoryPage, frames.InboxPage, frames.SubscribeResult,
)


def build() -> dict:
    client = Union[frames.CLIENT_FRAMES]  # type: ignore[valid-type]
    server = Union[SERVER_FRAMES]  # type: ignore[valid-type]
    (client_schema, server_schema, *results), components = msgspec.json.schema_components(
        (client, server, *RESULT_TYPES), ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "scopewire WebSocket protocol",
        "description": "Client frames are requests (tagged by `op`), each answered by exactly one `result` or "
                       "`error` frame with the same `id`; server pushes are `event` frames. JSON text frames, or "
                       "MessagePack binary frames with the `scopewire.msgpack` subprotocol.",
        "protocol_version": frames.PROTOCOL_VERSION,
        "client_frame": client_schema,
        "server_frame": server_schema,
        "results": {t.__name__: r for t, r in zip(RESULT_TYPES, results)},
        "error_codes": [code.value for code in ErrorCode],
        "input_rules": {  # protocol/validation.py: breaking one answers `invalid` with details.field
            "no_nul_in_any_string": True,
            "name_fields": sorted(validation.NAME_FIELDS),
            "name_forbidden_unicode_categories": sorted(validation.FORBIDDEN_NAME_CATEGORIES),
            "client_message_types": list(validation.CLIENT_MESSAGE_TYPES),
            "reserved_metadata_keys": sorted(validation.RESERVED_METADATA_KEYS),
            "max_metadata_depth": validation.MAX_METADATA_DEPTH,
            "max_metadata_bytes": validation.MAX_METADATA_BYTES,
            "max_metadata_integer": validation.MAX_SAFE_INTEGER,
        },
        "close_codes": {"1001": "server shutting down",
                        "1002": "WebSocket protocol violation (e.g. an unmasked client frame)",
                        "1007": "a text frame that is not UTF-8",
                        "1009": "message larger than the server's frame limit",
                        str(frames.CLOSE_UNAUTHENTICATED): "authentication timeout",
                        str(frames.CLOSE_REVOKED): "credential revoked or expired, membership ended or workspace "
                                                   "suspended",
                        str(frames.CLOSE_SLOW_CONSUMER): "slow consumer: reconnect and resume from your cursors",
                        str(frames.CLOSE_IDLE): "idle timeout",
                        str(frames.CLOSE_UNAVAILABLE): "unavailable: delivery failed (e.g. the database is down); "
                                                       "reconnect and resume from your cursors"},
        "$defs": components,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    SPEC_PATH.write_text(render())
    print(f"wrote {SPEC_PATH}", file=sys.stderr)
