"""Reaction key validation: one emoji, or a registered-style ``:tag:``.

Keys are compared byte-for-byte, so ``normalize_reaction_key`` returns the one
canonical spelling (NFC) or refuses.  Tags are not lowercased for the caller:
":Party:" is rejected rather than silently merged with ":party:", so a client
always learns the key it will be shown.

Emoji are recognised by a small grammar over explicit code point tables
(Unicode's emoji sequence shapes) rather than a dependency.  It accepts exactly
one grapheme cluster and is stricter than UAX #29 on purpose: a dangling ZWJ,
a lone skin-tone modifier or a text-presentation selector is not a reaction.
Text-default pictographs ("❤" without U+FE0F) are accepted as given: adding
the selector would need the Emoji_Presentation table, so "❤" and "❤️" stay
distinct keys.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right

MAX_TAG_LENGTH = 128

ZWJ = 0x200D
VS16 = 0xFE0F               # emoji presentation selector
KEYCAP = 0x20E3
MODIFIERS = range(0x1F3FB, 0x1F400)          # skin tones
REGIONAL_INDICATORS = range(0x1F1E6, 0x1F200)
TAG_SPECS = range(0xE0020, 0xE007F)
CANCEL_TAG = 0xE007F
KEYCAP_BASES = frozenset(map(ord, "0123456789#*"))

# Extended_Pictographic, from the Unicode 14 emoji data.  The property spans
# unassigned blocks reserved for emoji, so newer emoji validate too.
_PICTOGRAPHIC = (
    (0x00A9, 0x00A9), (0x00AE, 0x00AE), (0x203C, 0x203C), (0x2049, 0x2049), (0x2122, 0x2122),
    (0x2139, 0x2139), (0x2194, 0x2199), (0x21A9, 0x21AA), (0x231A, 0x231B), (0x2328, 0x2328),
    (0x2388, 0x2388), (0x23CF, 0x23CF), (0x23E9, 0x23F3), (0x23F8, 0x23FA), (0x24C2, 0x24C2),
    (0x25AA, 0x25AB), (0x25B6, 0x25B6), (0x25C0, 0x25C0), (0x25FB, 0x25FE), (0x2600, 0x2605),
    (0x2607, 0x2612), (0x2614, 0x2685), (0x2690, 0x2705), (0x2708, 0x2712), (0x2714, 0x2714),
    (0x2716, 0x2716), (0x271D, 0x271D), (0x2721, 0x2721), (0x2728, 0x2728), (0x2733, 0x2734),
    (0x2744, 0x2744), (0x2747, 0x2747), (0x274C, 0x274C), (0x274E, 0x274E), (0x2753, 0x2755),
    (0x2757, 0x2757), (0x2763, 0x2767), (0x2795, 0x2797), (0x27A1, 0x27A1), (0x27B0, 0x27B0),
    (0x27BF, 0x27BF), (0x2934, 0x2935), (0x2B05, 0x2B07), (0x2B1B, 0x2B1C), (0x2B50, 0x2B50),
    (0x2B55, 0x2B55), (0x3030, 0x3030), (0x303D, 0x303D), (0x3297, 0x3297), (0x3299, 0x3299),
    (0x1F000, 0x1F0FF), (0x1F10D, 0x1F10F), (0x1F12F, 0x1F12F), (0x1F16C, 0x1F171), (0x1F17E, 0x1F17F),
    (0x1F18E, 0x1F18E), (0x1F191, 0x1F19A), (0x1F1AD, 0x1F1E5), (0x1F201, 0x1F20F), (0x1F21A, 0x1F21A),
    (0x1F22F, 0x1F22F), (0x1F232, 0x1F23A), (0x1F23C, 0x1F23F), (0x1F249, 0x1F3FA), (0x1F400, 0x1F53D),
    (0x1F546, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F774, 0x1F77F), (0x1F7D5, 0x1F7FF), (0x1F80C, 0x1F80F),
    (0x1F848, 0x1F84F), (0x1F85A, 0x1F85F), (0x1F888, 0x1F88F), (0x1F8AE, 0x1F8FF), (0x1F90C, 0x1F93A),
    (0x1F93C, 0x1F945), (0x1F947, 0x1FAFF), (0x1FC00, 0x1FFFD),
)
_PICTOGRAPHIC_STARTS = tuple(first for first, _ in _PICTOGRAPHIC)

_TAG = re.compile(r":[a-z0-9_+-]{1,126}:")
_TAG_ANY_CASE = re.compile(r":[A-Za-z0-9_+-]{1,126}:")


class InvalidReactionKey(ValueError):
    pass


def normalize_reaction_key(raw: str) -> str:
    """The canonical (NFC) form of a reaction key; InvalidReactionKey if it is not one."""
    key = unicodedata.normalize("NFC", raw)
    if not key:
        raise InvalidReactionKey("empty reaction key")
    if len(key) > MAX_TAG_LENGTH:
        raise InvalidReactionKey(f"reaction key longer than {MAX_TAG_LENGTH} characters")
    if key.startswith(":"):
        return _checked_tag(key)
    if any(_is_space_or_control(char) for char in key):
        raise InvalidReactionKey("whitespace or control character in reaction key")
    codes = [ord(char) for char in key]
    end = _emoji_end(codes, 0)
    if end == 0:
        raise InvalidReactionKey("not an emoji or :tag:")
    if end != len(codes):
        raise InvalidReactionKey("more than one emoji, or emoji mixed with text")
    return key


def _is_pictographic(code: int) -> bool:
    slot = bisect_right(_PICTOGRAPHIC_STARTS, code) - 1
    return slot >= 0 and code <= _PICTOGRAPHIC[slot][1]


def _checked_tag(key: str) -> str:
    if _TAG.fullmatch(key):
        return key
    if _TAG_ANY_CASE.fullmatch(key):
        raise InvalidReactionKey("tag names are lowercase")
    raise InvalidReactionKey("tag must be :name: with name of a-z 0-9 _ + -")


def _is_space_or_control(char: str) -> bool:
    # Cf is allowed: ZWJ and the tag characters are format characters.
    return char.isspace() or unicodedata.category(char) in ("Cc", "Cs", "Zl", "Zp")


def _emoji_end(codes: list[int], at: int) -> int:
    """Index just past the one emoji cluster starting at ``at``, or ``at`` if none does."""
    for shape in (_flag_end, _keycap_end, _tag_sequence_end, _zwj_sequence_end):
        end = shape(codes, at)
        if end > at:
            return end
    return at


def _flag_end(codes: list[int], at: int) -> int:
    pair = codes[at:at + 2]
    if len(pair) == 2 and all(code in REGIONAL_INDICATORS for code in pair):
        return at + 2
    return at


def _keycap_end(codes: list[int], at: int) -> int:
    if at < len(codes) and codes[at] in KEYCAP_BASES:
        end = _skip(codes, at + 1, VS16)
        if end < len(codes) and codes[end] == KEYCAP:
            return end + 1
    return at


def _tag_sequence_end(codes: list[int], at: int) -> int:
    """A pictograph, tag characters, then CANCEL TAG: subdivision flags."""
    if at >= len(codes) or not _is_pictographic(codes[at]):
        return at
    end = at + 1
    while end < len(codes) and codes[end] in TAG_SPECS:
        end += 1
    if end > at + 1 and end < len(codes) and codes[end] == CANCEL_TAG:
        return end + 1
    return at


def _zwj_sequence_end(codes: list[int], at: int) -> int:
    """Pictographs (each with an optional skin tone and VS16) joined by ZWJ."""
    end = _element_end(codes, at)
    while end > at and end + 1 < len(codes) and codes[end] == ZWJ:
        after = _element_end(codes, end + 1)
        if after == end + 1:
            break               # a ZWJ not followed by a pictograph ends nothing
        end = after
    return end


def _element_end(codes: list[int], at: int) -> int:
    if at >= len(codes) or not _is_pictographic(codes[at]):
        return at
    end = at + 1
    if end < len(codes) and codes[end] in MODIFIERS:
        end += 1
    return _skip(codes, end, VS16)


def _skip(codes: list[int], at: int, code: int) -> int:
    return at + 1 if at < len(codes) and codes[at] == code else at
