"""Map an answer to the passages it rests on.

First choice: the [n] markers the model wrote (`method="marker"`). A small model often writes none, so
the fallback attributes the answer to the passages whose text contains it (SQuAD-normalized substring,
`method="contains"`), else to the passage with the highest share of the answer's content words when that
share is at least `min_overlap` (`method="overlap"`). Each citation carries the chunk's document, page
and character span, and where found, the answer's own span inside the document.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ldqa.retrieval.text import normalize_answer

# How a citation was found, in words for a reader (`Citation.method` -> phrase)
HOW = {"marker": "the model cited it", "contains": "holds the answer", "overlap": "shares the answer's words"}

_MARKER = re.compile(r"\[(\d{1,3})\]")


@dataclass
class Citation:
    """Passage n (1-based, as numbered in the prompt) cited by the answer.

    start, end: the chunk's character span in the document; answer_start/answer_end: the span of the
    answer text inside the document when it occurs there verbatim (case-insensitive), else None.
    """

    n: int
    chunk_id: int
    doc_id: int
    title: str
    path: str
    page: int | None
    start: int
    end: int
    method: str
    answer_start: int | None = None
    answer_end: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def cite(answer: str, passages, min_overlap: float = 0.5) -> list[Citation]:
    """Citations for `answer` over the prompt's `passages` (RetrievedPassage-like, numbered from 1)."""
    marked = sorted({int(m) for m in _MARKER.findall(answer) if 1 <= int(m) <= len(passages)})
    if marked:
        return [_make(n, passages[n - 1], "marker", answer) for n in marked]
    bare = _MARKER.sub("", answer).strip()
    norm = normalize_answer(bare)
    if not norm:
        return []
    hits = [i for i, p in enumerate(passages) if norm in normalize_answer(p.text)]
    if hits:
        return [_make(i + 1, passages[i], "contains", bare) for i in hits]
    words = set(norm.split())
    best, best_i = 0.0, -1
    for i, p in enumerate(passages):
        share = len(words & set(normalize_answer(p.text).split())) / len(words)
        if share > best:
            best, best_i = share, i
    if best_i >= 0 and best >= min_overlap:
        return [_make(best_i + 1, passages[best_i], "overlap", bare)]
    return []


def _make(n: int, p, method: str, answer: str) -> Citation:
    a_start = a_end = None
    needle = _MARKER.sub("", answer).strip().rstrip(".")
    if needle:
        i = p.text.lower().find(needle.lower())
        if i >= 0:
            a_start, a_end = p.start + i, p.start + i + len(needle)
    return Citation(n, p.chunk_id, p.doc_id, p.title, p.path, p.page, p.start, p.end, method, a_start, a_end)
