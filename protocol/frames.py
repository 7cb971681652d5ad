"""Every wire frame, as msgspec Structs.

Client → server frames are requests: `{"op": ..., "id": ..., ...}`; each gets
exactly one reply, a `result` or an `error` frame carrying the same id.
Server → client frames carry `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

PROTOCOL_VERSION = 1

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    id: RequestId


class Ping(Request, tag="ping"):
    """Liveness check; answered with the server time."""


CLIENT_FRAMES: tuple[type[Request], ...] = (Ping,)
ClientFrame = Union[CLIENT_FRAMES]  # type: ignore[valid-type]
KNOWN_OPS = frozenset(frame.__struct_config__.tag for frame in CLIENT_FRAMES)


class Envelope(msgspec.Struct):
    """Just enough of a frame to answer it when the full decode fails."""

    id: Any = None
    op: Any = None


class Result(msgspec.Struct, tag_field="type", tag="result"):
    id: str
    op: str
    data: Any


class Error(msgspec.Struct, tag_field="type", tag="error", omit_defaults=True):
    code: str
    message: str
    id: str | None = None
    details: dict[str, Any] = {}


class PingResult(msgspec.Struct):
    server_time_ms: int
    protocol_version: int = PROTOCOL_VERSION


