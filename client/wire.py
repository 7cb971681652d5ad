"""The SDKs' one decode path for server frames, with observers.

Every frame either client receives goes through `decode_frame`; an observer
(for example a schema check, a debug log or a metric) sees each decoded frame.
protocol/conformance.py checks a frame against the published contract."""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec

FrameObserver = Callable[[dict], None]

# Called with every decoded server frame, in order; an observer must not block.
frame_observers: list[FrameObserver] = []


def decode_frame(raw: str | bytes) -> dict:
    """A server frame: JSON text, or MessagePack bytes (the `scopewire.msgpack` subprotocol)."""
    frame = msgspec.msgpack.decode(raw) if isinstance(raw, bytes) else json.loads(raw)
    for observe in frame_observers:
        observe(frame)
    return frame
