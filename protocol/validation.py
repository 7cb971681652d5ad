"""Rules every decoded request passes before a handler sees it (codec.decode_request).

The Structs in frames.py check types and lengths; these are the rules a type
cannot say.  A request that breaks one answers `invalid`, with `details.field`
naming the offending field (a dotted path into metadata):

- No string anywhere (any field, any metadata key or value) contains NUL:
  PostgreSQL text cannot hold it.
- Names — `display_name`, `name`, `email`, `slug`, `handle` — contain no
  control, format or separator characters (`name_text_problem`): no bidi
  overrides or isolates (U+202A–202E, U+2066–2069), no zero-width characters
  (U+200B–200D, U+2060, U+FEFF), no C0/C1 controls, no line or paragraph
  separators.  They are shown to other members, so what is seen must be what
  is stored.
- `message.send` metadata is client-owned JSON: objects with string keys,
  arrays, strings, finite numbers, integers within ±(2^53 − 1), booleans and
  null; at most MAX_METADATA_DEPTH levels deep and MAX_METADATA_BYTES encoded.
  Its top-level keys never include RESERVED_METADATA_KEYS: routing facts
  (mentions, recipients, wake targets, sources) and owner_quote attribution
  (quote, shared_by_member_id) are written by the server alone.
- `message.send` writes only CLIENT_MESSAGE_TYPES; every other message type is
  produced by its own command (`message.forward` writes `forward` and
  `owner_quote`).
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any

import msgspec

from protocol.errors import ErrorCode, ProtocolError

CLIENT_MESSAGE_TYPES = ("text", "markdown")
RESERVED_METADATA_KEYS = frozenset({
    "mentions", "wake", "wakes", "wake_targets", "audience", "routing", "sources", "source_refs", "silent",
    "forwarded_message_ids", "quoted_message_ids", "recipients", "quote", "shared_by_member_id",
    "audience_mentions", "attachments", "attachment_ids",
})
MAX_METADATA_DEPTH = 8
MAX_METADATA_BYTES = 16_384
MAX_SAFE_INTEGER = 2**53 - 1
NAME_FIELDS = frozenset({"display_name", "name", "email", "slug", "handle"})
# Unicode general categories a name may not contain: controls (Cc), format
# characters (Cf: bidi controls, zero-width characters, BOM), surrogates (Cs),
# line and paragraph separators (Zl, Zp).
FORBIDDEN_NAME_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def name_text_problem(value: str) -> str | None:
    """Why `value` cannot be a name (display name, channel name or slug, handle,
    email), or None.  The one rule for every such field."""
    for char in value:
        if unicodedata.category(char) in FORBIDDEN_NAME_CATEGORIES:
            return f"contains the invisible or control character U+{ord(char):04X}"
    return None


def _invalid(request: Any, field: str, message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID, f"{field}: {message}", details={"field": field, "id": request.id})


def _check_strings(request: Any, value: Any, path: str) -> None:
    """NUL in any string of a Struct's fields (metadata is checked on its own)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise _invalid(request, path, "contains NUL")
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _check_strings(request, getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_strings(request, item, f"{path}[{index}]")


def _check_metadata(request: Any, metadata: dict[str, Any]) -> None:
    for key in metadata:
        if key in RESERVED_METADATA_KEYS:
            raise _invalid(request, f"metadata.{key}", "reserved: computed by the server "
                                                       f"(reserved keys: {', '.join(sorted(RESERVED_METADATA_KEYS))})")
    _check_json(request, metadata, "metadata")


def _check_json(request: Any, document: dict[str, Any], field: str) -> None:
    """A client JSON object (metadata, a strand's fields, tracks or patch): storable as
    jsonb — no NUL, finite numbers, safe integers — at most MAX_METADATA_DEPTH deep and
    MAX_METADATA_BYTES long."""
    # Iterative, so no nesting can exhaust the interpreter's stack.
    pending: list[tuple[Any, str, int]] = [(document, field, 1)]
    while pending:
        value, path, depth = pending.pop()
        if isinstance(value, dict):
            if depth > MAX_METADATA_DEPTH:
                raise _invalid(request, path, f"nested deeper than {MAX_METADATA_DEPTH} levels")
            for key, item in value.items():
                if not isinstance(key, str) or "\x00" in key:
                    raise _invalid(request, path, "object keys must be strings without NUL")
                pending.append((item, f"{path}.{key}", depth + 1))
        elif isinstance(value, list):
            if depth > MAX_METADATA_DEPTH:
                raise _invalid(request, path, f"nested deeper than {MAX_METADATA_DEPTH} levels")
            pending.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            if "\x00" in value:
                raise _invalid(request, path, "contains NUL")
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if abs(value) > MAX_SAFE_INTEGER:
                raise _invalid(request, path, "integer outside ±(2^53 - 1)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _invalid(request, path, "numbers must be finite")
        else:
            raise _invalid(request, path, "not a JSON value")
    if len(msgspec.json.encode(document)) > MAX_METADATA_BYTES:
        raise _invalid(request, field, f"larger than {MAX_METADATA_BYTES} bytes")


def check_request(request: Any) -> None:
    """ProtocolError(invalid) unless `request` (a decoded frame) passes every rule above."""
    metadata = getattr(request, "metadata", None)
    for name in request.__struct_fields__:
        if name == "metadata":
            continue
        value = getattr(request, name)
        if isinstance(value, dict):
            _check_json(request, value, name)
            continue
        _check_strings(request, value, name)
        if name in NAME_FIELDS and isinstance(value, str):
            problem = name_text_problem(value)
            if problem is not None:
                raise _invalid(request, name, problem)
    if metadata:
        _check_metadata(request, metadata)
    message_type = getattr(request, "message_type", None)
    if message_type is not None and message_type not in CLIENT_MESSAGE_TYPES:
        raise _invalid(request, "message_type", f"clients send only {', '.join(CLIENT_MESSAGE_TYPES)}; other "
                                                "types are written by their own commands")
