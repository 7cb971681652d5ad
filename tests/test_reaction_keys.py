import unicodedata

import pytest
from hypothesis import given, settings, strategies as st

from protocol.reaction_keys import MAX_TAG_LENGTH, InvalidReactionKey, normalize_reaction_key

ZWJ, VS16, KEYCAP = "\u200d", "\ufe0f", "\u20e3"
SCOTLAND = "\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F"


@pytest.mark.parametrize("key", [
    "👍",                                   # single pictograph
    "👍🏽",                                  # skin tone modifier
    "👨‍👩‍👧",                                # ZWJ sequence
    "🧑🏽‍💻",                                # modifier inside a ZWJ sequence
    "🏳️‍🌈",                                 # VS16 inside a ZWJ sequence
    "🕵🏽‍♀️",                                # modifier, ZWJ, text-default sign + VS16
    "🇨🇳",                                   # regional indicator pair
    "❤️",                                    # VS16
    "❤",                                     # text-default pictograph, accepted as given
    "1️⃣", "#️⃣", "*⃣",                       # keycaps, with and without VS16
    SCOTLAND,                                # tag sequence
    "©", "™",                                # pictographic, outside the SMP
    "\U0001FAE8",                            # unassigned in Unicode 14, reserved for emoji
])
def test_single_emoji_are_valid_and_unchanged(key):
    assert normalize_reaction_key(key) == key


@pytest.mark.parametrize("key", [":+1:", ":party_parrot:", ":a:", ":thumbs-up:", ":" + "x" * 126 + ":"])
def test_lowercase_tags_are_valid(key):
    assert normalize_reaction_key(key) == key


@pytest.mark.parametrize("key, reason", [
    ("", "empty"),
    (" ", "whitespace"),
    ("👍 ", "whitespace"),
    ("\n👍", "whitespace"),
    ("\x00", "control"),
    ("a", "not an emoji"),
    ("1", "not an emoji"),
    ("#", "not an emoji"),
    ("👍👍", "more than one"),
    ("🇨🇳🇺🇸", "more than one"),
    ("👍a", "more than one"),
    ("a👍", "not an emoji"),
    ("🇨", "not an emoji"),                   # lone regional indicator
    ("🇨🇳🇺", "more than one"),                # three regional indicators
    ("🏽", "not an emoji"),                   # lone skin tone
    (VS16, "not an emoji"),
    (ZWJ, "not an emoji"),
    ("👍" + ZWJ, "more than one"),            # dangling ZWJ
    ("👍" + ZWJ + "a", "more than one"),
    ("❤\ufe0e", "more than one"),             # text presentation selector
    ("1" + VS16, "not an emoji"),             # keycap base without the keycap
    ("\U0001F3F4\U000E0067\U000E0062", "more than one"),   # tag sequence without CANCEL TAG
    (":Party:", "lowercase"),
    (":PARTY:", "lowercase"),
    ("::", "tag must be"),
    (":a b:", "tag must be"),
    (":party", "tag must be"),
    (":ünï:", "tag must be"),
    (":" + "x" * 127 + ":", "longer than"),
    ("👍" * 129, "longer than"),
])
def test_invalid_keys_say_why(key, reason):
    with pytest.raises(InvalidReactionKey, match=reason):
        normalize_reaction_key(key)


def test_the_result_is_nfc_and_normalizing_is_idempotent():
    decomposed = unicodedata.normalize("NFD", "é")
    with pytest.raises(InvalidReactionKey):
        normalize_reaction_key(decomposed)            # a letter, composed or not, is no emoji
    for key in ["👍🏽", "🇨🇳", SCOTLAND, ":ok:"]:
        once = normalize_reaction_key(key)
        assert once == unicodedata.normalize("NFC", key) == normalize_reaction_key(once)


def test_invalid_key_is_a_value_error():
    assert issubclass(InvalidReactionKey, ValueError)


# --- properties ------------------------------------------------------------------

pictographs = st.sampled_from("👍❤☺🏳🕵🧑💻🌈🔥♀♂⚕🐈©™" + "\U0001FAE8")
modifiers = st.sampled_from([chr(code) for code in range(0x1F3FB, 0x1F400)])
regional = st.sampled_from([chr(code) for code in range(0x1F1E6, 0x1F200)])
tag_specs = st.text(st.sampled_from([chr(code) for code in range(0xE0020, 0xE007F)]), min_size=1, max_size=6)


@st.composite
def zwj_elements(draw):
    return draw(pictographs) + draw(st.sampled_from(["", VS16])) if draw(st.booleans()) else (
        draw(pictographs) + draw(modifiers) + draw(st.sampled_from(["", VS16]))
    )


emoji = st.one_of(
    st.lists(zwj_elements(), min_size=1, max_size=5).map(ZWJ.join),
    st.tuples(regional, regional).map("".join),
    st.tuples(st.sampled_from("0123456789#*"), st.sampled_from(["", VS16])).map(lambda t: t[0] + t[1] + KEYCAP),
    st.tuples(pictographs, tag_specs).map(lambda t: t[0] + t[1] + "\U000E007F"),
)


@given(emoji)
def test_generated_emoji_are_accepted(key):
    assert normalize_reaction_key(key) == key


@given(emoji, emoji)
def test_two_emoji_side_by_side_are_rejected(first, second):
    with pytest.raises(InvalidReactionKey):
        normalize_reaction_key(first + second)


@given(st.from_regex(r":[a-z0-9_+-]{1,126}:", fullmatch=True))
def test_generated_tags_are_accepted(key):
    assert normalize_reaction_key(key) == key


keyish = st.text(st.characters(), max_size=140) | st.text(
    st.sampled_from(":aZ0_+- \u200d\ufe0f\u20e3👍🏽🇨🇳\U000E0067\U000E007F\u0301é"), max_size=12,
)


@settings(max_examples=500)
@given(keyish)
def test_arbitrary_text_is_either_a_canonical_key_or_invalid(raw):
    try:
        key = normalize_reaction_key(raw)
    except InvalidReactionKey:
        return
    assert len(key) <= MAX_TAG_LENGTH
    assert unicodedata.is_normalized("NFC", key)
    assert normalize_reaction_key(key) == key
