"""Split a `Document` into token-bounded, overlapping `Chunk`s that are exact slices of its text.

Method
------
1. Units: the text is cut after sentence ends (``.``, ``!``, ``?``, optionally followed by closing
   quotes/brackets, then white space or a line break), at blank lines (paragraphs) and before lines
   that start a Markdown heading, list item, table row or quote (hard-wrapped prose stays whole
   sentences). Each unit is the white-space-trimmed character span between cuts.
2. Each unit is counted once with `count_tokens`. A unit longer than `chunk_tokens` is replaced by its
   words; a word longer than `chunk_tokens` by character pieces found with a bounded binary search.
3. Greedy packing: units are added while the estimated size (per-call overhead + sum of unit costs)
   stays within `chunk_tokens`. The chunk text is then counted for real; if the tokenizer is not
   additive and the count is over the budget, a binary search finds the longest prefix that fits.
4. Overlap: the next chunk starts with the longest tail of whole units of the previous chunk whose
   cost is at most `overlap_tokens` (never the whole previous chunk), and always adds new text.

`count_tokens` is called about once per unit plus once per chunk, so a 160K-token book costs a few
thousand short tokenizer calls.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ldqa.retrieval.types import Chunk, Document

_CUT_RE = re.compile(
    r"(?<!^\d)(?<!^\d\d)[.!?]+[\"'”’»)\]]*(?=\s)"  # sentence end + white space (not "2. item")
    r"|^[ \t]*#{1,6}[ \t][^\n]*"  # a Markdown heading line is a unit of its own
    r"|\n[ \t]*\n"  # blank line: paragraph break
    r"|\n(?=[ \t]*(?:#{1,6}[ \t]|[-*+•][ \t]|\d{1,3}[.)][ \t]|\||>))",  # line starting a heading/item/row
    re.MULTILINE,
)
_WORD_RE = re.compile(r"\S+")
_MAX_CHARS_PER_TOKEN = 32  # bound on the first probe when splitting one huge word by characters


@dataclass
class ChunkConfig:
    """Chunk size and overlap, both in tokens of the tokenizer passed to `chunk_document`.

    chunk_tokens: hard upper bound of `count_tokens(chunk.text)` (>= 16);
    overlap_tokens: most tokens of whole trailing units repeated at the start of the next chunk
    (0 <= overlap_tokens < chunk_tokens).
    """

    chunk_tokens: int = 256
    overlap_tokens: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 16:
            raise ValueError(f"chunk_tokens must be an int >= 16, got {self.chunk_tokens!r}")
        if not isinstance(self.overlap_tokens, int) or not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise ValueError(f"overlap_tokens must be an int with 0 <= overlap_tokens < chunk_tokens "
                             f"({self.chunk_tokens}), got {self.overlap_tokens!r}")


@dataclass
class _Unit:
    start: int  # character offset into the document text
    end: int  # exclusive
    cost: int  # tokens, without the tokenizer's per-call overhead


def chunk_document(doc: Document, count_tokens: Callable[[str], int],
                   config: ChunkConfig = ChunkConfig()) -> list[Chunk]:
    """Cut `doc.text` into chunks of at most `config.chunk_tokens` tokens with sentence overlap.

    Parameters
    ----------
    doc : Document
        The loaded document; only `text` and `pages` are read.
    count_tokens : callable (str -> int)
        Token count of a string in the LLM tokenizer; need not be additive over concatenation.
    config : ChunkConfig
        Size and overlap in tokens.

    Returns
    -------
    list of Chunk
        In document order, `ordinal` 0..n-1; `text == doc.text[start:end]` with no leading/trailing
        white space; every non-white-space character lies in at least one chunk;
        `n_tokens == count_tokens(text) <= config.chunk_tokens`; `page == doc.page_at(start)`.
        Empty for a text that is empty or white space only.

    Raises
    ------
    ValueError
        If `count_tokens` gives more than `chunk_tokens` for a single character (e.g. it adds more
        special tokens than the budget allows).
    """
    counter = _Counter(count_tokens)
    units = _units(doc.text, counter, config.chunk_tokens)
    chunks: list[Chunk] = []
    first, prev_end = 0, 0
    while first < len(units):
        first, last, n_tokens = _pack(doc.text, units, first, prev_end, counter, config.chunk_tokens)
        start, end = units[first].start, units[last - 1].end
        chunks.append(Chunk(text=doc.text[start:end], start=start, end=end, n_tokens=n_tokens,
                            ordinal=len(chunks), page=doc.page_at(start)))
        first, prev_end = _next_start(units, first, last, counter.overhead, config), last
    return chunks


class _Counter:
    """`count_tokens` plus its fixed per-call overhead (special tokens such as BOS), measured once."""

    def __init__(self, count_tokens: Callable[[str], int]) -> None:
        self.count = count_tokens
        self.overhead = max(0, int(count_tokens("")))

    def cost(self, text: str) -> int:
        return max(0, int(self.count(text)) - self.overhead)


def _units(text: str, counter: _Counter, limit: int) -> list[_Unit]:
    units: list[_Unit] = []
    for start, end in _spans(text, _cut_points(text)):
        cost = counter.cost(text[start:end])
        if counter.overhead + cost <= limit:
            units.append(_Unit(start, end, cost))
        else:
            units.extend(_split_long(text, start, end, counter, limit))
    return units


def _cut_points(text: str) -> list[int]:
    return [m.end() for m in _CUT_RE.finditer(text)] + [len(text)]


def _spans(text: str, cuts: list[int]) -> list[tuple[int, int]]:
    """White-space-trimmed, non-empty spans between consecutive cut points."""
    spans, prev = [], 0
    for cut in cuts:
        m = _WORD_RE.search(text, prev, cut)
        if m:
            end = cut
            while text[end - 1].isspace():
                end -= 1
            spans.append((m.start(), end))
        prev = cut
    return spans


def _split_long(text: str, start: int, end: int, counter: _Counter, limit: int) -> list[_Unit]:
    """Words of an over-long unit; over-long words become character pieces."""
    out: list[_Unit] = []
    for m in _WORD_RE.finditer(text, start, end):
        cost = counter.cost(m.group())
        if counter.overhead + cost <= limit:
            out.append(_Unit(m.start(), m.end(), cost))
        else:
            out.extend(_split_chars(text, m.start(), m.end(), counter, limit))
    return out


def _split_chars(text: str, start: int, end: int, counter: _Counter, limit: int) -> list[_Unit]:
    """Greedy character pieces of text[start:end], each the longest prefix that fits (binary search)."""
    out: list[_Unit] = []
    pos = start
    while pos < end:
        lo, hi = 0, min(end - pos, limit * _MAX_CHARS_PER_TOKEN)  # lo fits (empty), find largest fit
        best_cost = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cost = counter.cost(text[pos:pos + mid])
            if counter.overhead + cost <= limit:
                lo, best_cost = mid, cost
            else:
                hi = mid - 1
        if lo == 0:
            raise ValueError(f"count_tokens gives more than chunk_tokens={limit} tokens for the single "
                             f"character {text[pos]!r}; raise chunk_tokens or count without special tokens")
        out.append(_Unit(pos, pos + lo, best_cost))
        pos += lo
    return out


def _pack(text: str, units: list[_Unit], first: int, prev_end: int, counter: _Counter,
          limit: int) -> tuple[int, int, int]:
    """Unit range [first, last) and real token count of the chunk that starts at unit `first`.

    Units [first, prev_end) are overlap from the previous chunk. Greedy on the estimated cost (and at
    most `limit * _MAX_CHARS_PER_TOKEN` characters); if the real count is over `limit` (a tokenizer
    that is not additive), binary-search the longest prefix that fits, keeping at least one new unit,
    and if even that is too long, drop overlap units from the front. A single unit always fits,
    because units were counted on exactly their own text.
    """
    last, total, max_chars = first, counter.overhead, limit * _MAX_CHARS_PER_TOKEN
    while last < len(units) and (last == first or (total + units[last].cost <= limit
                                                   and units[last].end - units[first].start <= max_chars)):
        total += units[last].cost
        last += 1
    n_tokens = _span_count(text, units, first, last, counter)
    if n_tokens <= limit:
        return first, last, n_tokens
    min_last = max(first, prev_end) + 1  # keep at least one unit the previous chunk did not have
    if _span_count(text, units, first, min_last, counter) <= limit:
        last = _largest_fit(lambda j: _span_count(text, units, first, j, counter) <= limit, min_last, last - 1)
    else:
        last = min_last
        first = _smallest_fit(lambda i: _span_count(text, units, i, last, counter) <= limit, first + 1, last - 1)
    return first, last, _span_count(text, units, first, last, counter)


def _span_count(text: str, units: list[_Unit], first: int, last: int, counter: _Counter) -> int:
    return int(counter.count(text[units[first].start:units[last - 1].end]))


def _largest_fit(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest j in [lo, hi] with fits(j), assuming fits(lo) and monotone decreasing."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _smallest_fit(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest i in [lo, hi] with fits(i), assuming fits(hi) and monotone increasing."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def _next_start(units: list[_Unit], first: int, last: int, overhead: int, config: ChunkConfig) -> int:
    """First unit of the next chunk: a tail of [first, last) of cost <= overlap that leaves room."""
    if last >= len(units):
        return last
    room = min(config.overlap_tokens, config.chunk_tokens - overhead - units[last].cost)
    start, tail = last, 0
    while start - 1 > first and tail + units[start - 1].cost <= room:
        start -= 1
        tail += units[start].cost
    return start
