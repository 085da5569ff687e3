"""Tables in PDF pages, found by pdfplumber and written into pypdf's page text as Markdown tables.

pypdf reads a page's text in content-stream order but knows nothing of tables: a table drawn cell by
cell (reportlab's ``Table``, most report generators) comes out one cell per line, so the chunker cannot
tell rows apart or repeat the header. pdfplumber finds the tables (ruled ones from their lines, unruled
ones from the alignment of their text) and gives their cells; each table whose cells, read row by row,
are a run of consecutive words of pypdf's page text replaces that run as a Markdown pipe table (first row
the header), which the chunker keeps row-whole with its header repeated (`ldqa.retrieval.chunking`).
All other text is pypdf's, untouched; a table pdfplumber finds that does not match pypdf's text exactly
is left as pypdf gave it.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter

_MIN_ROWS = 3  # header + 2 rows, or 3 rows continuing a table from the previous page
# Unruled tables: a cell is a run of glyphs without a gap wider than 0.8 of the font size (a space in
# any font, Courier's 0.6 included, but not two, nor the padding between table cells).
_RUN_SETTINGS = {"x_tolerance_ratio": 0.8}
_UNRULED = {"vertical_strategy": "text", "horizontal_strategy": "text",
            **{f"text_{k}": v for k, v in _RUN_SETTINGS.items()}}
_Y_TOLERANCE = 3  # points; pdfplumber's default for words on one line
_RULED = {"vertical_strategy": "lines", "horizontal_strategy": "lines"}


@dataclass
class PdfTables:
    """The page texts with their tables written as Markdown, and what happened on the way.

    page_texts: one text per page; n_tables: tables written (a table continued on the next page counts
    once); warnings: sentences for `Document.meta["warnings"]` (pages pdfplumber could not read).
    """

    page_texts: list[str]
    n_tables: int = 0
    warnings: list[str] | None = None


def tables_as_markdown(data: bytes, page_texts: list[str], normalize: Callable[[str], str]) -> PdfTables:
    """Write the tables pdfplumber finds in a PDF into its pypdf page texts as Markdown pipe tables.

    Parameters
    ----------
    data : bytes
        The PDF file.
    page_texts : list of str
        pypdf's normalized text of each page (`ldqa.retrieval.loaders.normalize_text`).
    normalize : callable (str -> str)
        The same normalization, applied to each cell so that it compares with the page text.

    Returns
    -------
    PdfTables
        A page keeps its text exactly unless a table of at least `_MIN_ROWS` rows and 2 columns was
        found on it whose cells, row by row, are consecutive words of its text; those words become the
        table's rows (``| a | b |``), a separator after the first. A table that starts a page, when the
        previous page ended with a table of as many columns, continues it: its header goes above the
        rows unless they already start with it. A page (or the whole file) pdfplumber fails on keeps its
        text, with a warning; this function never raises.
    """
    try:
        import pdfplumber

        logging.getLogger("pdfminer").setLevel(logging.ERROR)  # damaged files log noisy recovery warnings
        with pdfplumber.open(io.BytesIO(data)) as pdf:
            if len(pdf.pages) != len(page_texts):
                return PdfTables(page_texts, 0, [_warning(f"pdfplumber sees {len(pdf.pages)} pages, pypdf "
                                                          f"{len(page_texts)}")])
            found, failed, error = [], [], None
            for number, page in enumerate(pdf.pages, start=1):
                try:
                    found.append(_page_tables(page, normalize))
                except Exception as exc:  # pdfminer raises many types on damaged content streams
                    found.append([])
                    failed.append(number)
                    error = error or exc
                finally:
                    page.close()
    except Exception as exc:  # an unreadable file for pdfplumber: keep pypdf's text
        return PdfTables(page_texts, 0, [_warning(f"{type(exc).__name__}: {exc}")])
    texts, n_tables = _write_tables(page_texts, found)
    if not failed:
        return PdfTables(texts, n_tables)
    listed = ", ".join(map(str, failed[:10])) + (", ..." if len(failed) > 10 else "")
    return PdfTables(texts, n_tables, [_warning(f"pdfplumber failed on page{'s' if len(failed) > 1 else ''} {listed}: "
                                                f"{type(error).__name__}: {error}")])


def _warning(what: str) -> str:
    return (f"tables could not be detected ({what}); their text is kept as plain lines, so a long table's "
            "rows may be split from its header: re-export the PDF or convert it to HTML or Markdown")


def _page_tables(page, normalize: Callable[[str], str]) -> list[list[list[str]]]:
    """Tables on one page as rows of normalized cells, top to bottom: ruled ones, then unruled ones
    outside them."""
    from pdfplumber.table import Table

    kept, boxes = [], []
    for ruled, view in ((True, page), (False, _runs_only(page))):
        for table in view.find_tables(_RULED if ruled else _UNRULED):
            if any(_overlaps(table.bbox, box) for box in boxes):
                continue
            rows = _clean(Table(page, table.cells).extract(), normalize, ruled)  # cell text with its spaces
            if rows:
                kept.append((table.bbox[1], rows))
                boxes.append(table.bbox)
    return [rows for _, rows in sorted(kept, key=lambda t: t[0])]


def _runs_only(page):
    """The page as pdfplumber's unruled-table finder should see it: no space characters (a cell is then
    a run of glyphs, whether its words are drawn with spaces or moved apart), and no line that is a single
    run (prose, headings), since the finder aligns columns over the whole page and a paragraph flush with
    a table's first column would merge its columns."""
    from pdfplumber.utils import cluster_objects

    glyphs = page.filter(lambda obj: obj.get("object_type") != "char" or not obj["text"].isspace())
    words = glyphs.extract_words(**_RUN_SETTINGS, return_chars=True)
    lines = cluster_objects(words, itemgetter("top"), _Y_TOLERANCE)
    kept = {id(ch) for line in lines if len(line) >= 2 for word in line for ch in word["chars"]}
    return page.filter(lambda obj: obj.get("object_type") != "char" or id(obj) in kept)


def _overlaps(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _clean(rows: list[list[str | None]], normalize: Callable[[str], str], ruled: bool) -> list[list[str]] | None:
    """Cells as one-line normalized text, empty rows and columns dropped; None unless at least
    `_MIN_ROWS` rows and 2 columns remain, each column with a letter or digit (a bullet list is not a
    table) and, in a table without rules, filled in at least half of the rows."""
    rows = [[" ".join(normalize(c or "").split()) for c in row] for row in rows]
    rows = [r for r in rows if any(r)]
    if len(rows) < _MIN_ROWS:
        return None
    cols = [j for j in range(len(rows[0])) if any(r[j] for r in rows)]
    rows = [[r[j] for j in cols] for r in rows]
    if len(cols) < 2 or not all(any(ch.isalnum() for r in rows for ch in r[j]) for j in range(len(cols))):
        return None
    if not ruled and any(2 * sum(bool(r[j]) for r in rows) < len(rows) for j in range(len(cols))):
        return None  # a list's hanging indent, a code listing, or wrapped cells read as rows
    return rows


def _write_tables(page_texts: list[str], found: list[list[list[list[str]]]]) -> tuple[list[str], int]:
    """Each page's text with its found tables written in, and the number of tables (continuations not
    counted)."""
    out, n_tables, carry = [], 0, None  # carry: header row of the table that ended the previous page
    for text, tables in zip(page_texts, found):
        spans = []  # (start, end, rows) in text order
        for rows in tables:
            span = _find_cells(text, [c for r in rows for c in r], spans[-1][1] if spans else 0)
            if span is not None:
                spans.append((*span, rows))
        n_tables += len(spans)
        if spans and carry is not None and not text[:spans[0][0]].strip() and len(carry) == len(spans[0][2][0]):
            start, end, rows = spans[0]
            spans[0] = (start, end, rows if rows[0] == carry else [carry] + rows)
            n_tables -= 1
        carry = spans[-1][2][0] if spans and not text[spans[-1][1]:].strip() else None
        for start, end, rows in reversed(spans):
            before, after = text[:start].rstrip(" \t"), text[end:].lstrip(" \t")
            text = (before + ("\n" if before and not before.endswith("\n") else "") + _markdown(rows)
                    + ("\n" if after and not after.startswith("\n") else "") + after)
        out.append(text)
    return out, n_tables


def _find_cells(text: str, cells: list[str], start_at: int) -> tuple[int, int] | None:
    """Character span [start, end) of `text` (from `start_at` on) whose non-blank characters are exactly
    those of `cells` in order, with white space before and after it and between every two cells (a cell
    boundary inside a word of pypdf's text means the table was misread); None if there is none."""
    pos = [i for i in range(start_at, len(text)) if not text[i].isspace()]
    squeezed = "".join(text[i] for i in pos)
    parts = ["".join(c.split()) for c in cells]
    needle = "".join(parts)
    bounds = [n for n in accumulate(len(p) for p in parts) if 0 < n < len(needle)]
    k = squeezed.find(needle) if needle else -1
    while k >= 0:
        start, end = pos[k], pos[k + len(needle) - 1] + 1
        if ((start == 0 or text[start - 1].isspace()) and (end == len(text) or text[end].isspace())
                and all(pos[k + b] > pos[k + b - 1] + 1 for b in bounds)):
            return start, end
        k = squeezed.find(needle, k + 1)
    return None


def _markdown(rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(rows[0]), "|" + "---|" * len(rows[0])] + [line(r) for r in rows[1:]])
