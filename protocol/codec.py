"""Decoding client frames and encoding server frames (JSON text or MessagePack)."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import ErrorCode, ProtocolError
from protocol.frames import KNOWN_OPS, ClientFrame, Envelope, Error
from protocol.validation import check_request

_json_decoder = msgspec.json.Decoder(ClientFrame)
_msgpack_decoder = msgspec.msgpack.Decoder(ClientFrame)
_json_envelope = msgspec.json.Decoder(Envelope)
_msgpack_envelope = msgspec.msgpack.Decoder(Envelope)
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def decode_request(raw: str | bytes, *, binary: bool) -> Any:
    """A typed request that passed protocol.validation, or ProtocolError
    (bad_frame | unknown_op | invalid) carrying the request id when one could
    be recovered."""
    try:
        request = (_msgpack_decoder if binary else _json_decoder).decode(raw)
    except RecursionError:
        # Nesting deeper than the interpreter's stack: no envelope is recoverable either.
        raise ProtocolError(ErrorCode.BAD_FRAME, "nested too deeply") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # MessagePack strings may not be UTF-8
        envelope = _recover_envelope(raw, binary)
        request_id = envelope.id if isinstance(envelope.id, str) and 0 < len(envelope.id) <= 64 else None
        if isinstance(envelope.op, str) and envelope.op not in KNOWN_OPS:
            error = ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {envelope.op[:64]!r}")
        else:
            error = ProtocolError(ErrorCode.BAD_FRAME, str(exc)[:500])
        error.details["id"] = request_id
        raise error from None
    check_request(request)
    return request


def _recover_envelope(raw: str | bytes, binary: bool) -> Envelope:
    try:
        envelope = (_msgpack_envelope if binary else _json_envelope).decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return Envelope()
    return envelope


def encode(frame: msgspec.Struct, *, binary: bool) -> bytes:
    """Server frame bytes (UTF-8 JSON for text frames, MessagePack for binary)."""
    return (_msgpack_encoder if binary else _json_encoder).encode(frame)


def error_frame(error: ProtocolError, request_id: str | None) -> Error:
    details = {k: v for k, v in error.details.items() if k != "id"}
    return Error(code=error.code.value, message=error.message, id=request_id, details=details)
