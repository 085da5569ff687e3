"""Plain records passed between the loaders, the chunker, the store and the app."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PageSpan:
    """Where one page of the source lies in `Document.text`.

    page: 1-based page number (PDF) ; start, end: character offsets into `Document.text` (end exclusive).
    """

    page: int
    start: int
    end: int


@dataclass
class Document:
    """A loaded source file: normalized text plus what is needed to cite it.

    path: absolute path of the source file; title: human title (HTML <title>, first Markdown heading,
    PDF metadata, else the file stem); text: NFC-normalized text without control characters, typographic
    ligatures spelled out (`loaders.normalize_text`);
    sha256: hex digest of the *file bytes* (the document's identity: same bytes -> same document);
    pages: page spans for paged formats (PDF), empty otherwise; kind: "txt" | "md" | "pdf" | "html";
    meta: free-form extras (detected encoding, page count, ...).
    """

    path: str
    title: str
    text: str
    sha256: str
    kind: str
    pages: list[PageSpan] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def page_at(self, offset: int) -> int | None:
        """1-based page containing character `offset`, or None for unpaged documents."""
        for span in self.pages:
            if span.start <= offset < span.end:
                return span.page
        return self.pages[-1].page if self.pages else None


@dataclass
class Chunk:
    """One retrieval unit (later also the KV block): a slice of `Document.text`.

    text == document.text[start:end]; header: the header and separator rows of the table this chunk
    starts inside (after them), "" otherwise; n_tokens: length of `full_text` in the LLM tokenizer's
    tokens; page: 1-based page of `start` (None when the document has no pages); ordinal: 0-based index
    in the document.
    """

    text: str
    start: int
    end: int
    n_tokens: int
    ordinal: int
    page: int | None = None
    header: str = ""

    @property
    def full_text(self) -> str:
        """What is embedded, indexed and given to the LLM: `header` (if any), a line break, `text`."""
        return with_header(self.header, self.text)


def with_header(header: str, text: str) -> str:
    """A chunk's text preceded by its table header rows (`Chunk.header`), or the text alone."""
    return f"{header}\n{text}" if header else text
