"""The canonical routing-token (@mention) parser.

Every send path calls ``parse_routing_tokens``; nothing else may parse
mentions, so the rules below are the whole truth about who a message routes to.

Content is Markdown-ish.  Mentions inside code (fenced blocks, inline spans)
and blockquotes are inert: quoting or pasting a message must not re-route it.
The scan is linear: a line pass finds the live lines, then each paragraph is
split around inline code spans and scanned for ``@`` with a regex that has no
nested quantifiers (content is up to 40,000 characters of untrusted text).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

from domain.plan import MentionMode  # noqa: F401 - re-exported: the parser's modes

MAX_ROUTING_TOKENS = 50   # hard limit of distinct live tokens per message
MAX_HANDLE_LENGTH = 64    # the server's handle rule: [a-z0-9][a-z0-9_.-]{0,63}


@dataclass(frozen=True)
class RoutingToken:
    handle: str   # lowercased handle without '@'
    start: int    # offset of '@' in content
    end: int      # offset after the handle


class TooManyRoutingTokens(ValueError):
    def __init__(self, count: int) -> None:
        super().__init__(f"{count} routing tokens; at most {MAX_ROUTING_TOKENS} are allowed")
        self.count = count


_LINE_BREAK = re.compile(r"\r\n|\r|\n")           # CommonMark's line endings
_BLOCKQUOTE = re.compile(r" {0,3}>")
# A backtick fence's info string may not contain backticks (CommonMark), so a
# one-line "```code```" is an inline span, not a fence swallowing the rest.
_FENCE_OPEN = re.compile(r" {0,3}(?:(`{3,})[^`]*|(~{3,}).*)")
_FENCE_CLOSE = re.compile(r" {0,3}(`{3,}|~{3,})[ \t]*")
_BACKTICK_RUN = re.compile(r"`+")
# Handle characters are ASCII on purpose: str.lower() maps some non-ASCII
# letters (e.g. KELVIN SIGN) onto ASCII ones, which would forge handles.
_MENTION = re.compile(r"@([A-Za-z0-9][A-Za-z0-9_.-]*)")


def parse_routing_tokens(
    content: str, mode: MentionMode = MentionMode.NORMAL
) -> tuple[RoutingToken, ...]:
    """The distinct live routing tokens of ``content``, in order of first appearance.

    Raises TooManyRoutingTokens when there are more than MAX_ROUTING_TOKENS.
    """
    if mode in (MentionMode.MULTI_FORWARD, MentionMode.EXPLICIT_CONTEXT) or "@" not in content:
        return ()  # every token starts with "@": most messages skip the block and span scan
    first_by_handle: dict[str, RoutingToken] = {}
    for start, end in _live_ranges(content):
        for token in _tokens_in(content, start, end):
            first_by_handle.setdefault(token.handle, token)
    if len(first_by_handle) > MAX_ROUTING_TOKENS:
        raise TooManyRoutingTokens(len(first_by_handle))
    return tuple(first_by_handle.values())


def _lines(content: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each line, line break excluded."""
    start = 0
    for brk in _LINE_BREAK.finditer(content):
        yield start, brk.start()
        start = brk.end()
    yield start, len(content)


def _paragraphs(content: str) -> Iterator[tuple[int, int]]:
    """Runs of consecutive live lines, ended by blank, quoted or fenced lines.

    Inline code spans never cross a paragraph, as in CommonMark.
    """
    fence: str | None = None          # the opening fence while inside a fenced block
    para_start: int | None = None
    para_end = 0
    for start, end in _lines(content):
        line = content[start:end]
        inert = True
        if fence is not None:
            close = _FENCE_CLOSE.fullmatch(line)
            if close and close[1][0] == fence[0] and len(close[1]) >= len(fence):
                fence = None
        elif _BLOCKQUOTE.match(line):
            pass
        elif opened := _FENCE_OPEN.fullmatch(line):
            fence = opened[1] or opened[2]
        elif line.strip():
            inert = False
        if inert:
            if para_start is not None:
                yield para_start, para_end
                para_start = None
        else:
            para_start = start if para_start is None else para_start
            para_end = end
    if para_start is not None:
        yield para_start, para_end


def _live_ranges(content: str) -> Iterator[tuple[int, int]]:
    """Paragraph text outside inline code spans."""
    for para_start, para_end in _paragraphs(content):
        runs = [(m.start(), m.end()) for m in _BACKTICK_RUN.finditer(content, para_start, para_end)]
        by_length: dict[int, list[int]] = {}
        for index, (start, end) in enumerate(runs):
            by_length.setdefault(end - start, []).append(index)
        live_from = para_start
        index = 0
        while index < len(runs):
            start, end = runs[index]
            same = by_length[end - start]
            later = bisect_right(same, index)
            if later == len(same):    # no closing run of this length: literal backticks
                index += 1
                continue
            closer = same[later]
            yield live_from, start
            live_from = runs[closer][1]
            index = closer + 1
        yield live_from, para_end


def _tokens_in(content: str, start: int, end: int) -> Iterator[RoutingToken]:
    for match in _MENTION.finditer(content, start, end):
        at, raw_end = match.start(), match.end()
        if at > 0 and _glued_before(content[at - 1]):
            continue    # email address, path, or "@@x"
        if raw_end < len(content) and _glued_after(content[raw_end]):
            continue    # "@josé" must not mention "jos"; "@bob@host" is an address
        handle = match[1].rstrip(".-").lower()   # "@bob." is bob at the end of a sentence
        if len(handle) > MAX_HANDLE_LENGTH:
            continue    # no such handle can exist; a prefix would mention someone else
        yield RoutingToken(handle, at, at + 1 + len(handle))


def _glued_before(char: str) -> bool:
    return char.isalnum() or char in "_.@/"


def _glued_after(char: str) -> bool:
    return char.isalnum() or char == "@"
