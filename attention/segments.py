"""The prompt as token segments: the contract between the prompt's wording (`ldqa.app.prompt`) and the
runtime that prefills it.

    [BOS][instruction]                prefix      <- shared by every prompt: Block-Attention's sink
    [Passage [1]][ (Title: ...) ...]  header_1 + body_1
    ...
    [Passage [k]][ ... ]              header_k + body_k
    [Question: ...\\nAnswer:]          question    <- always last

A body's tokens never depend on its neighbours or its rank, which is what lets its KV states be computed
once and reused (`block_attention`); only the few header tokens carry the rank. Cache slots follow the
same order, so passage p (header + body) occupies the slots `passage_spans(segments)[p]` of any cache
that holds the whole prompt: with a 3-token prefix, headers of 2 and bodies of 4 and 5 tokens, the spans
are [(3, 9), (9, 16)] and the question starts at slot 16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptSegments:
    """Token ids of the prompt's parts: prefix (BOS + instruction), per passage a header ("Passage [n]")
    and a body (title, page, text), then the question. anchors: per passage the ids of its document's
    anchor ([] for none), or None: in block modes a body is encoded after prefix + anchor (Star Attention,
    Acharya et al. 2024, sec. 2.1: each chunk of a long document sees the document's start), while the
    anchor itself is not part of the prompt (`ids`)."""

    prefix: list[int]
    headers: list[list[int]]
    passages: list[list[int]]
    question: list[int]
    anchors: list[list[int]] | None = None

    def ids(self) -> list[int]:
        """The whole prompt, in order: prefix, header 1, body 1, ..., header k, body k, question."""
        out = list(self.prefix)
        for h, p in zip(self.headers, self.passages):
            out += h + p
        return out + self.question

    def __len__(self) -> int:
        return len(self.ids())

    def with_anchor(self, ids: list[int]) -> "PromptSegments":
        """These segments with `ids` as the anchor of every passage that has none of its own (a later
        chunk's document anchor is kept): generic anchor passages (the app's `prompt.anchor_ids`) that
        every block is encoded after, so none is stored as the list's first document. Changes and
        returns self; unchanged for ids = []."""
        if ids:
            own = self.anchors or [[] for _ in self.passages]
            self.anchors = [list(a) if a else list(ids) for a in own]
        return self


def passage_spans(segments: PromptSegments) -> list[tuple[int, int]]:
    """Cache slot ranges [start, end) of each passage (header + body) in a prompt built as `segments`:
    prefix, then header_i + body_i, then the question."""
    spans, at = [], len(segments.prefix)
    for h, b in zip(segments.headers, segments.passages):
        spans.append((at, at + len(h) + len(b)))
        at += len(h) + len(b)
    return spans
