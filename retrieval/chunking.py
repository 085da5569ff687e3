"""Split a `Document` into token-bounded, overlapping `Chunk`s that are exact slices of its text.

Method
------
1. Units: the text is cut after sentence ends (``.``, ``!``, ``?``, optionally followed by closing
   quotes/brackets, then white space or a line break), at blank lines (paragraphs) and before lines
   that start a Markdown heading, list item, table row or quote (hard-wrapped prose stays whole
   sentences). Each unit is the white-space-trimmed character span between cuts.
2. Each unit is counted once with `count_tokens`. A unit longer than `chunk_tokens` is replaced by its
   lines (so a table row extracted from a PDF as one line is never cut), a line that is still too long
   by its words, a word longer than `chunk_tokens` by character pieces (bounded binary search).
3. Greedy packing: units are added while the estimated size (per-call overhead + sum of unit costs)
   stays within `chunk_tokens`. The chunk text is then counted for real; if the tokenizer is not
   additive and the count is over the budget, a binary search finds the longest prefix that fits.
4. Overlap: the next chunk starts with the longest tail of whole units of the previous chunk whose
   cost is at most `overlap_tokens` (never the whole previous chunk), and always adds new text.
5. Tables: a Markdown pipe table (what Markdown files hold and what the HTML loader makes of ``<table>``)
   is a run of lines starting with ``|`` whose second line is a separator (``|---|:--:|``). A chunk
   that starts inside such a table, after its separator, gets the header and separator rows as
   `Chunk.header`: they go before its text wherever the chunk is read (embedding, BM25, the LLM's
   passage) and are counted in its `chunk_tokens` budget, so every piece of a long table names its
   columns. Rows are units, so no row is cut (unless one row alone is over the budget).

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
_LINE_RE = re.compile(r"[^\n]+")
_TABLE_SEP_RE = re.compile(r"[ \t]*\|?[ \t]*:?-{3,}:?[ \t]*(?:\|[ \t]*:?-{3,}:?[ \t]*)*\|?[ \t]*")
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
        `n_tokens == count_tokens(full_text) <= config.chunk_tokens` (`full_text` is `text`, preceded by
        the table header rows in `header` for a chunk that starts inside a table); `page ==
        doc.page_at(start)`.
        Empty for a text that is empty or white space only.

    Raises
    ------
    ValueError
        If `count_tokens` gives more than `chunk_tokens` for a single character (e.g. it adds more
        special tokens than the budget allows).
    """
    counter = _Counter(count_tokens)
    units = _units(doc.text, counter, config.chunk_tokens)
    headers = _table_headers(doc.text, units)
    chunks: list[Chunk] = []
    first, prev_end = 0, 0
    while first < len(units):
        wanted = headers.get(first, "")
        first, last, n_tokens, header = _pack(doc.text, units, first, prev_end, counter, config.chunk_tokens, wanted)
        if headers.get(first, "") != wanted:  # the packing moved the start into or out of a table
            first, last, n_tokens, header = _pack(doc.text, units, first, prev_end, counter, config.chunk_tokens,
                                                  headers.get(first, ""))
        start, end = units[first].start, units[last - 1].end
        chunks.append(Chunk(text=doc.text[start:end], start=start, end=end, n_tokens=n_tokens,
                            ordinal=len(chunks), page=doc.page_at(start), header=header))
        nxt = _next_start(units, first, last, counter.overhead, config, header_cost(headers.get(last, ""), counter))
        first, prev_end = nxt, last
    return chunks


def header_cost(header: str, counter: "_Counter") -> int:
    """Tokens a table header adds before a chunk's text (0 for none)."""
    return counter.cost(header + "\n") if header else 0


def _table_headers(text: str, units: list["_Unit"]) -> dict[int, str]:
    """{unit index: header rows} for every unit that is a table body row (after the separator) of a
    Markdown pipe table; the header rows are the table's first line and its separator line."""
    out: dict[int, str] = {}
    i = 0
    while i + 1 < len(units):
        a, b = units[i], units[i + 1]
        row_a, row_b = text[a.start:a.end], text[b.start:b.end]
        if (row_a.startswith("|") and "\n" not in row_a and _TABLE_SEP_RE.fullmatch(row_b)
                and text[a.end:b.start].count("\n") == 1):
            header = text[a.start:b.end]
            j = i + 2
            while j < len(units) and text[units[j].start] == "|" and text[units[j - 1].end:units[j].start].count("\n") == 1:
                out[j] = header
                j += 1
            i = j
        else:
            i += 1
    return out


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


def _split_long(text: str, start: int, end: int, counter: _Counter, limit: int, by_lines: bool = True) -> list[_Unit]:
    """Lines of an over-long unit (a PDF table's rows stay whole); over-long lines become words,
    over-long words character pieces."""
    out: list[_Unit] = []
    if by_lines and "\n" in text[start:end]:
        for m in _LINE_RE.finditer(text, start, end):
            w = _WORD_RE.search(text, m.start(), m.end())
            if w is None:
                continue
            s, e = w.start(), m.end()
            while text[e - 1].isspace():
                e -= 1
            cost = counter.cost(text[s:e])
            if counter.overhead + cost <= limit:
                out.append(_Unit(s, e, cost))
            else:
                out.extend(_split_long(text, s, e, counter, limit, by_lines=False))
        return out
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
          limit: int, header: str = "") -> tuple[int, int, int, str]:
    """Unit range [first, last) and real token count of the chunk that starts at unit `first`.

    Returns (first, last, n_tokens, header): the header is dropped (returned "") only when one table row
    with it is over the budget. Units [first, prev_end) are overlap from the previous chunk. Greedy on the estimated cost (and at
    most `limit * _MAX_CHARS_PER_TOKEN` characters); if the real count is over `limit` (a tokenizer
    that is not additive), binary-search the longest prefix that fits, keeping at least one new unit,
    and if even that is too long, drop overlap units from the front. A single unit always fits,
    because units were counted on exactly their own text.
    """
    last, total, max_chars = first, counter.overhead + header_cost(header, counter), limit * _MAX_CHARS_PER_TOKEN
    while last < len(units) and (last == first or (total + units[last].cost <= limit
                                                   and units[last].end - units[first].start <= max_chars)):
        total += units[last].cost
        last += 1
    n_tokens = _span_count(text, units, first, last, counter, header)
    if n_tokens <= limit:
        return first, last, n_tokens, header
    min_last = max(first, prev_end) + 1  # keep at least one unit the previous chunk did not have
    if _span_count(text, units, first, min_last, counter, header) <= limit:
        last = _largest_fit(lambda j: _span_count(text, units, first, j, counter, header) <= limit, min_last,
                            last - 1)
    elif _span_count(text, units, min_last - 1, min_last, counter, header) > limit:
        # one row with its table header is over the budget: the row alone (it was counted to fit)
        return min_last - 1, min_last, _span_count(text, units, min_last - 1, min_last, counter), ""
    else:
        last = min_last
        first = _smallest_fit(lambda i: _span_count(text, units, i, last, counter, header) <= limit, first + 1,
                              last - 1)
    return first, last, _span_count(text, units, first, last, counter, header), header


def _span_count(text: str, units: list[_Unit], first: int, last: int, counter: _Counter, header: str = "") -> int:
    body = text[units[first].start:units[last - 1].end]
    return int(counter.count(f"{header}\n{body}" if header else body))


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


def _next_start(units: list[_Unit], first: int, last: int, overhead: int, config: ChunkConfig,
                header_tokens: int = 0) -> int:
    """First unit of the next chunk: a tail of [first, last) of cost <= overlap that leaves room (for
    the next unit and, inside a table, the header rows)."""
    if last >= len(units):
        return last
    room = min(config.overlap_tokens, config.chunk_tokens - overhead - header_tokens - units[last].cost)
    start, tail = last, 0
    while start - 1 > first and tail + units[start - 1].cost <= room:
        start -= 1
        tail += units[start].cost
    return start
