"""The text rules of message search, shared by the projection writer (storage/search.py)
and the query side: what a message is indexed as, what a query asks for, and where a
hit's matches are.

PostgreSQL's `simple` configuration splits text into words at non-word characters.
Chinese, Japanese, Thai and similar scripts put no spaces between words, so a whole
sentence would be one "word" and `搜索` would never match `全文搜索功能`.  Runs of those
scripts are therefore indexed as their bigrams and single characters: a query run is
looked up (GIN) by all its bigrams (or its one character), then confirmed as a
substring of the message's normalized text.  A trigram index (pg_trgm) cannot serve
the one- and two-character queries that are most of Chinese search: a pattern with
fewer than three characters has no trigram to look up, so every row would be read.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# Scripts written without spaces between words (and Hangul, whose words agglutinate).
_UNSEGMENTED = (
    "\u0e00-\u0eff"            # Thai, Lao
    "\u1000-\u109f"            # Myanmar
    "\u1780-\u17ff"            # Khmer
    "\u3040-\u30ff"            # Hiragana, Katakana
    "\u3400-\u4dbf"            # CJK Extension A
    "\u4e00-\u9fff"            # CJK Unified Ideographs
    "\uac00-\ud7af"            # Hangul syllables
    "\uf900-\ufaff"            # CJK Compatibility Ideographs
    "\U00020000-\U0003134f"    # CJK Extensions B-G
)
UNSEGMENTED_RUN = re.compile(f"[{_UNSEGMENTED}]+")
_OPERATORS = re.compile(r"(?<!\S)(has:attachment|mentions:me)(?!\S)", re.IGNORECASE)
_WORD = re.compile(r"\w+")
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")
# websearch syntax: an optional `-`, then a "quoted phrase" (closed or not) or a bare token.
_TOKEN = re.compile(r'(-?)(?:"([^"]*)"?|([^\s"]+))')
SNIPPET_CHARS = 200
MAX_HIGHLIGHT_TERMS = 16


def normalize(text: str) -> str:
    """NFKC (full-width letters and digits become ASCII ones) — on both sides."""
    return unicodedata.normalize("NFKC", text)


def _bigrams(run: str) -> list[str]:
    return [run] if len(run) == 1 else [run[i:i + 2] for i in range(len(run) - 1)]


def index_text(texts: list[str]) -> tuple[str, str, str]:
    """What a message is indexed as: (its normalized text, for the substring check;
    that text without the unsegmented runs, for to_tsvector('simple', ·); a tsvector
    literal of the runs' bigrams and characters)."""
    normalized = "\n".join(normalize(text) for text in texts)
    lexemes: dict[str, None] = {}
    for run in UNSEGMENTED_RUN.finditer(normalized):
        lexemes.update(dict.fromkeys(_bigrams(run.group())))
        lexemes.update(dict.fromkeys(run.group()))
    return normalized, UNSEGMENTED_RUN.sub(" ", normalized), " ".join(map(_quoted, lexemes))


def _quoted(lexeme: str) -> str:
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


@dataclass(frozen=True)
class Term:
    """One thing a hit must contain: words (websearch_to_tsquery input, a quoted phrase
    when quoted) or an unsegmented run (a substring)."""

    text: str
    unsegmented: bool

    def lexemes(self) -> str:
        """A run's tsquery literal: all its bigrams (or its one character)."""
        return " & ".join(_quoted(b) for b in dict.fromkeys(_bigrams(self.text)))


@dataclass(frozen=True)
class Item:
    """A query token: its terms must all match (none, when negated)."""

    terms: tuple[Term, ...]
    negated: bool


@dataclass(frozen=True)
class ParsedQuery:
    # Every group must match; a group matches when one of its items does (`or`).
    groups: tuple[tuple[Item, ...], ...]
    has_attachment: bool
    mentions_me: bool

    @property
    def has_terms(self) -> bool:
        return bool(self.groups)

    def positives(self) -> list[Term]:
        return [t for group in self.groups for item in group if not item.negated for t in item.terms]


def _item(text: str, quoted: bool, negated: bool) -> Item | None:
    terms = [Term(run.group(), True) for run in UNSEGMENTED_RUN.finditer(text)]
    rest = UNSEGMENTED_RUN.sub(" ", text).strip()
    if _LETTER_OR_DIGIT.search(rest):  # else websearch_to_tsquery finds no lexeme in it
        terms.insert(0, Term(f'"{rest}"' if quoted else rest, False))
    return Item(tuple(terms), negated) if terms else None


def parse_query(query: str) -> ParsedQuery:
    """websearch_to_tsquery's syntax (`"phrase"`, `-not`, `a or b`; `or` binds tighter
    than the implicit and), with unsegmented runs as substrings wherever they appear."""
    query = normalize(query)
    flags = {m.group(1).lower() for m in _OPERATORS.finditer(query)}
    query = _OPERATORS.sub(" ", query)
    groups: list[list[Item]] = []
    join_next = False
    for match in _TOKEN.finditer(query):
        negated, phrase, bare = match.group(1) == "-", match.group(2), match.group(3)
        if bare is not None and bare.lower() == "or" and not negated and groups and not join_next:
            join_next = True
            continue
        item = _item(phrase if phrase is not None else bare, phrase is not None, negated)
        if item is None:
            continue
        if join_next:
            groups[-1].append(item)
        else:
            groups.append([item])
        join_next = False
    return ParsedQuery(groups=tuple(tuple(g) for g in groups), has_attachment="has:attachment" in flags,
                       mentions_me="mentions:me" in flags)


def _needles(query: ParsedQuery) -> list[tuple[str, bool]]:
    """(text, whole word?) for each thing a hit is highlighted at."""
    needles: list[tuple[str, bool]] = []
    for term in query.positives():
        if term.unsegmented:
            needles.append((term.text, False))
        else:
            needles.extend((w, True) for w in _WORD.findall(term.text))
    return list(dict.fromkeys(needles))[:MAX_HIGHLIGHT_TERMS]


def _first(haystack: str, needle: str, whole_word: bool) -> int | None:
    """Where `needle` first occurs (as a word, when asked) — str.find, not a regex,
    so a long message costs one linear scan per needle."""
    start = 0
    for _ in range(64):
        at = haystack.find(needle, start)
        if at < 0:
            return None
        end = at + len(needle)
        if not whole_word or ((at == 0 or not haystack[at - 1].isalnum() and haystack[at - 1] != "_")
                              and (end == len(haystack) or not haystack[end].isalnum() and haystack[end] != "_")):
            return at
        start = at + 1
    return None


def highlight(content: str, query: ParsedQuery) -> tuple[str, list[tuple[int, int]]]:
    """A snippet of `content` (at most SNIPPET_CHARS) around its first match and the
    matches in it, as [start, end) code-point offsets within the snippet."""
    # Matched as indexed (NFKC, any case), where that keeps every offset in place.
    haystack = normalize(content).lower()
    if len(haystack) != len(content):
        haystack = content
    needles = [(n.lower(), whole) for n, whole in _needles(query)]
    firsts = [at for n, whole in needles if (at := _first(haystack, n, whole)) is not None]
    first = min(firsts, default=0)
    start = max(0, min(first - SNIPPET_CHARS // 4, len(content) - SNIPPET_CHARS))
    end = min(len(content), start + SNIPPET_CHARS)
    window = haystack[start:end]
    spans: list[tuple[int, int]] = []
    for needle, whole in needles:
        pattern = rf"(?<!\w){re.escape(needle)}(?!\w)" if whole else re.escape(needle)
        spans.extend(m.span() for m in re.finditer(pattern, window))
    return content[start:end], _merge(sorted(spans))


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged
