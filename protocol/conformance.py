"""Does a server frame keep the published contract?  `problem(frame)` answers
None, or what is wrong: a frame whose op or event has no typed entry, a field
of the wrong type, or a field the contract does not name.

A frame is checked by converting it to its typed frame Struct
(protocol.results.RESULT_FRAMES, protocol.events.EVENT_FRAMES, frames.Error)
and re-encoding it: any difference is a field the contract does not describe."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol import frames
from protocol.errors import ErrorCode
from protocol.events import EVENT_FRAMES
from protocol.results import RESULT_FRAMES

ERROR_CODES = frozenset(code.value for code in ErrorCode)


def _typed_frame(frame: dict[str, Any]) -> type[msgspec.Struct] | str:
    kind = frame.get("type")
    if kind == "result":
        return RESULT_FRAMES.get(frame.get("op"), f"result of an op with no typed entry: {frame.get('op')!r}")
    if kind == "event":
        return EVENT_FRAMES.get(frame.get("event"), f"event with no typed entry: {frame.get('event')!r}")
    if kind == "error":
        return frames.Error
    return f"unknown frame type {kind!r}"


def problem(frame: Any) -> str | None:
    """None when `frame` (a decoded server frame) validates against its typed Struct."""
    if not isinstance(frame, dict):
        return f"a frame must be an object, got {type(frame).__name__}"
    typed = _typed_frame(frame)
    if isinstance(typed, str):
        return typed
    try:
        value = msgspec.convert(frame, typed)
    except msgspec.ValidationError as exc:
        return f"{typed.__name__}: {exc}"
    if isinstance(value, frames.Error) and value.code not in ERROR_CODES:
        return f"unknown error code {value.code!r}"
    again = msgspec.to_builtins(value)
    if again != frame:  # a MessagePack frame carries `bytes` fields as raw bytes, JSON as base64
        again = msgspec.to_builtins(value, builtin_types=(bytes,))
    if again != frame:
        return f"{typed.__name__}: fields outside the contract or a changed value: {_difference(frame, again)}"
    return None


def _difference(sent: Any, typed: Any, path: str = "$") -> str:
    if isinstance(sent, dict) and isinstance(typed, dict):
        for key in sent.keys() | typed.keys():
            if key not in typed:
                return f"{path}.{key} is not in the contract"
            if key not in sent:
                return f"{path}.{key} missing"
            if sent[key] != typed[key]:
                return _difference(sent[key], typed[key], f"{path}.{key}")
    if isinstance(sent, list) and isinstance(typed, list) and len(sent) == len(typed):
        for index, (a, b) in enumerate(zip(sent, typed)):
            if a != b:
                return _difference(a, b, f"{path}[{index}]")
    return f"{path}: sent {sent!r}"
