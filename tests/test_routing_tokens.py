import re

import pytest
from hypothesis import given, settings, strategies as st

from actors.routing_tokens import (
    MAX_ROUTING_TOKENS,
    MentionMode,
    RoutingToken,
    TooManyRoutingTokens,
    parse_routing_tokens,
)

HANDLE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def handles(content: str, mode: MentionMode = MentionMode.NORMAL) -> list[str]:
    return [token.handle for token in parse_routing_tokens(content, mode)]


# --- handle grammar -----------------------------------------------------------

def test_a_token_carries_its_lowercased_handle_and_offsets():
    assert parse_routing_tokens("hi @Alice!") == (RoutingToken("alice", 3, 9),)


@pytest.mark.parametrize("content, expected", [
    ("@bob", ["bob"]),
    ("@bob.", ["bob"]),
    ("@bob-", ["bob"]),
    ("@bob.-.", ["bob"]),
    ("@bob_", ["bob_"]),
    ("@b.o-b_9", ["b.o-b_9"]),
    ("@0day", ["0day"]),
    ("(@bob), [@carol]; @dave: \"@eve\"", ["bob", "carol", "dave", "eve"]),
    ("@all @here", ["all", "here"]),
    ("@_bob @.bob @-bob @ bob @", []),
])
def test_handle_grammar(content, expected):
    assert handles(content) == expected


def test_handles_longer_than_sixty_four_chars_are_not_truncated_into_someone_else():
    assert handles("@" + "a" * 64) == ["a" * 64]
    assert handles("@" + "a" * 64 + ".") == ["a" * 64]
    assert handles("@" + "a" * 65) == []


def test_handle_characters_are_ascii_only():
    assert handles("@\u212aelvin") == []          # KELVIN SIGN lowercases to "k"
    assert handles("@josé @bob") == ["bob"]        # no "jos"


# --- what may precede or follow the '@' ----------------------------------------

@pytest.mark.parametrize("content", [
    "bob@example.com", "x_@bob", "x.@bob", "@@bob", "/home/@bob", "é@bob", "@bob@example.com",
])
def test_glued_at_signs_are_not_tokens(content):
    assert handles(content) == []


def test_tokens_may_start_a_line_or_follow_punctuation():
    assert handles("@a\n@b\t@c,@d(@e;@f`@g") == ["a", "b", "c", "d", "e", "f", "g"]


# --- inert regions ---------------------------------------------------------------

def test_fenced_blocks_are_inert():
    assert handles("```\n@a\n```\n@b") == ["b"]
    assert handles("~~~python\n@a\n~~~\n@b") == ["b"]
    assert handles("   ```\n@a\n   ```\n@b") == ["b"]


def test_a_fence_closes_only_with_the_same_char_and_at_least_its_length():
    assert handles("````\n```\n~~~~\n@a\n`````\n@b") == ["b"]


def test_an_unclosed_fence_runs_to_the_end():
    assert handles("@a\n```\n@b\n@c") == ["a"]


def test_four_spaces_do_not_open_a_fence():
    assert handles("    ```\n@a") == ["a"]


def test_a_one_line_triple_backtick_span_is_inline_code_not_a_fence():
    assert handles("```ls @a``` @b") == ["b"]


def test_inline_code_spans_are_inert():
    assert handles("`@a` @b") == ["b"]
    assert handles("``@a ` @b`` @c") == ["c"]


def test_a_span_closes_only_with_a_run_of_exactly_its_length():
    assert handles("`@a`` @b") == ["a", "b"]      # neither run finds its partner
    assert handles("`@a`` @b` @c") == ["c"]
    assert handles("``@a` @b") == ["a", "b"]      # unmatched run is literal


def test_inline_code_spans_cross_lines_but_not_blank_lines():
    assert handles("`@a\n@b` @c") == ["c"]
    assert handles("`@a\n\n@b` @c") == ["a", "b", "c"]


def test_blockquote_lines_are_inert():
    assert handles("> @a\n@b") == ["b"]
    assert handles("   > @a\n>@b\n    > @c") == ["c"]


# --- modes, dedup, limit ---------------------------------------------------------

def test_single_forward_parses_and_multi_forward_and_explicit_context_do_not():
    assert handles("@a", MentionMode.SINGLE_FORWARD) == ["a"]
    assert handles("@a", MentionMode.MULTI_FORWARD) == []
    assert handles("@a", MentionMode.EXPLICIT_CONTEXT) == []


def test_duplicates_keep_the_first_occurrence_in_order():
    assert parse_routing_tokens("@b @A @b @a") == (
        RoutingToken("b", 0, 2), RoutingToken("a", 3, 5),
    )


def test_the_limit_counts_distinct_live_tokens():
    at_limit = " ".join(f"@u{i}" for i in range(MAX_ROUTING_TOKENS))
    assert len(parse_routing_tokens(at_limit + " @u0" * 100 + " `@x`")) == MAX_ROUTING_TOKENS
    with pytest.raises(TooManyRoutingTokens) as raised:
        parse_routing_tokens(at_limit + " @u999 @u1000")
    assert raised.value.count == MAX_ROUTING_TOKENS + 2
    assert isinstance(raised.value, ValueError)
    assert parse_routing_tokens(at_limit + " @u999", MentionMode.MULTI_FORWARD) == ()


@pytest.mark.parametrize("content", [
    "@" * 40_000,
    "`" * 40_000,
    "@a`" * 13_333,
    "`@a" * 13_333,
    "``@" * 13_333,
    "`" + "@a " * 13_333,
    "\n".join(["```"] * 13_333),
    "```" + "`" * 39_000 + "x`",
    "@" + "a." * 20_000,
    "> " * 20_000,
    "`" * 3 + "\n" + "`" * 2 + "\n" + "`" * 4 + "\n" + "@a`b`" * 8_000,
])
def test_pathological_input_is_parsed(content):
    try:
        parse_routing_tokens(content)
    except TooManyRoutingTokens:
        pass


# --- properties ------------------------------------------------------------------

markdownish = st.text(
    st.sampled_from("@`~>aAbZ09_.-/ \n\r\té") | st.characters(), max_size=300,
)


def parse_or_none(content: str) -> tuple[RoutingToken, ...] | None:
    try:
        return parse_routing_tokens(content)
    except TooManyRoutingTokens:
        return None


@settings(max_examples=500)
@given(markdownish)
def test_tokens_are_exact_slices_of_valid_handles_unique_and_ordered(content):
    tokens = parse_or_none(content)
    if tokens is None:
        return
    for token in tokens:
        assert content[token.start:token.end].lower() == "@" + token.handle
        assert HANDLE.fullmatch(token.handle) and token.handle[-1] not in ".-"
    assert len({token.handle for token in tokens}) == len(tokens)
    assert [token.start for token in tokens] == sorted({token.start for token in tokens})


@given(markdownish)
def test_a_fenced_block_makes_anything_inert(content):
    longest_run = max((len(run) for run in re.findall("`+", content)), default=0)
    fence = "`" * max(3, longest_run + 1)
    assert parse_routing_tokens(f"{fence}\n{content}\n{fence}\n") == ()
    assert parse_routing_tokens(f"{fence}\n{content}") == ()


@given(markdownish)
def test_a_blockquote_makes_anything_inert(content):
    quoted = "\n".join("> " + line for line in re.split(r"\r\n|\r|\n", content))
    assert parse_routing_tokens(quoted) == ()


@given(markdownish)
def test_multi_forward_is_always_empty(content):
    assert parse_routing_tokens(content, MentionMode.MULTI_FORWARD) == ()
    assert parse_routing_tokens(content, MentionMode.EXPLICIT_CONTEXT) == ()


@given(st.lists(st.from_regex(HANDLE, fullmatch=True), max_size=60))
def test_plain_mentions_of_valid_handles_are_found(names):
    content = " ".join("@" + name for name in names)
    expected = list(dict.fromkeys(name.rstrip(".-") for name in names))
    if len(expected) > MAX_ROUTING_TOKENS:
        with pytest.raises(TooManyRoutingTokens):
            parse_routing_tokens(content)
    else:
        assert handles(content) == expected
