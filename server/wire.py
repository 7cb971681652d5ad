"""Server → client WebSocket frames built once and shared by every recipient.

A server frame is unmasked (RFC 6455 §5.1), so the same bytes are valid on
every connection: fanout encodes an event and frames it once per wire format
instead of once per connection.  Written by hand because wsproto's send path
frames per connection (and keeps per-connection state we do not need here).
"""

from __future__ import annotations

import struct

OPCODE_TEXT = 0x1
OPCODE_BINARY = 0x2
_FIN = 0x80


def server_frame(payload: bytes, *, binary: bool) -> bytes:
    """One final, unmasked data frame carrying `payload` (UTF-8 JSON or MessagePack)."""
    first = _FIN | (OPCODE_BINARY if binary else OPCODE_TEXT)
    length = len(payload)
    if length < 126:
        header = struct.pack("!BB", first, length)
    elif length < 1 << 16:
        header = struct.pack("!BBH", first, 126, length)
    else:
        header = struct.pack("!BBQ", first, 127, length)
    return header + payload
