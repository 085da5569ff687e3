"""Load source files (.txt, .md, .pdf, .html) into normalized `Document` records.

Every loader returns NFC-normalized text with Unix line breaks, no control characters other than
``\\n`` and ``\\t``, typographic ligatures (ﬁ ﬂ ﬃ ...) spelled out, and at most one blank line in a
row. Characters that stand for glyphs without a Unicode mapping (NUL and other control characters, U+FFFD,
typical of PDFs whose fonts lack a ToUnicode map) are dropped and counted: `Document.meta["warnings"]`
then says how many, and where.  Anything that cannot give usable text raises
`LoadError`, whose message names the file and says what to do about it.

Methods: UTF-8 first (BOM allowed), else the encoding detected by charset-normalizer; PDF text per page
with pypdf, its tables found by pdfplumber and written as Markdown tables
(`ldqa.retrieval.pdf_tables`); HTML main text with trafilatura, falling back to a plain stdlib
`html.parser` extraction for small pages trafilatura rejects.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import unicodedata
from collections.abc import Iterable
from html.parser import HTMLParser
from pathlib import Path

from ldqa.retrieval.pdf_tables import tables_as_markdown
from ldqa.retrieval.types import Document, PageSpan

SUPPORTED_EXTENSIONS: dict[str, str] = {
    ".txt": "txt",
    ".md": "md",
    ".markdown": "md",
    ".pdf": "pdf",
    ".html": "html",
    ".htm": "html",
}
"""File extension (lower case, with the dot) -> `Document.kind`."""

_MAX_BAD_CHAR_FRACTION = 0.05  # above this share of control/replacement characters a "text" is binary
_TIE_CHAOS, _TIE_COHERENCE = 0.01, 0.02  # charset-normalizer scores treated as a tie
_LINE_BREAKS = {"\r\n": "\n", "\r": "\n", "\x0b": "\n", "\x0c": "\n", "\x85": "\n",
                "\u2028": "\n", "\u2029": "\n\n"}
_BREAK_RE = re.compile("|".join(re.escape(k) for k in _LINE_BREAKS))
_BLANK_RUN_RE = re.compile(r"\n(?:[ \t]*\n){2,}")
_MD_HEADING_RE = re.compile(r"^#[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$")
# Alphabetic presentation forms (U+FB00-FB06 Latin ff fi fl ffi ffl long-s-t st, U+FB13-FB17 Armenian):
# typesetting ligatures, never a different letter; folded to the letters NFKC gives them. Only these: full
# NFKC would also rewrite m² as m2 and ½ as 1⁄2 in the text the LLM reads and citations show (BM25 search
# folds the rest, on its own copy: `ldqa.retrieval.search_text`).
LIGATURES = {cp: unicodedata.normalize("NFKC", chr(cp)) for cp in (*range(0xFB00, 0xFB07), *range(0xFB13, 0xFB18))}


class LoadError(ValueError):
    """A file that cannot be turned into a `Document`.

    Attributes
    ----------
    path : str
        The offending file, as given.
    reason : str
        What is wrong and what to do about it.
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load {self.path}: {reason}")


def load_document(path: str | Path) -> Document:
    """Read one file and return its normalized text with a title and a content hash.

    Parameters
    ----------
    path : str or Path
        A .txt, .md/.markdown, .pdf or .html/.htm file (extension matched case-insensitively).

    Returns
    -------
    Document
        `path` absolute; `sha256` of the file bytes; `title` from the HTML <title>, the first Markdown
        ``# `` heading or the PDF metadata, else the file stem; `pages` (PDF only) the character span
        of each 1-based page in `text`; `meta` holds ``encoding`` (text formats) or ``n_pages`` (PDF, with
        ``tables``, how many tables were written as Markdown tables, when there are any), and ``warnings``
        (a list of sentences) when characters without a Unicode mapping were dropped or a PDF's tables
        could not be detected.

    Raises
    ------
    LoadError
        Unsupported extension, missing or unreadable path, binary content behind a text extension,
        corrupt or password-protected PDF, PDF without a text layer, or no text at all.
    """
    p = Path(path)
    if not p.exists():  # before its extension: a mistyped directory has none
        raise LoadError(p, "no such file or directory; check the path")
    kind = SUPPORTED_EXTENSIONS.get(p.suffix.lower())
    if kind is None:
        supported = ", ".join(sorted(SUPPORTED_EXTENSIONS))
        raise LoadError(path, f"unsupported file type {p.suffix or '(no extension)'!r}; "
                              f"convert it to one of {supported}")
    data = _read_bytes(p)
    title, text, pages, meta = _LOADERS[kind](p, data)
    if not text.strip():
        raise LoadError(path, "the file has no text (empty or whitespace only); remove it or add content")
    return Document(path=str(p.resolve()), title=title or p.stem, text=text,
                    sha256=hashlib.sha256(data).hexdigest(), kind=kind, pages=pages, meta=meta)


def iter_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Expand directories into the loadable files under them.

    Parameters
    ----------
    paths : path or iterable of paths
        Files and/or directories.

    Returns
    -------
    list of Path
        Files given explicitly are kept as given (even missing ones or unsupported types, so the
        caller can report them); directories are walked recursively in sorted order, keeping files
        with a supported extension and skipping hidden files and hidden directories. Duplicates are
        dropped, first occurrence wins.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: list[Path] = []
    seen: set[Path] = set()
    for raw in paths:
        p = Path(raw)
        found = _walk(p) if p.is_dir() else [p]
        for f in found:
            if f not in seen:
                seen.add(f)
                out.append(f)
    return out


def fold_ligatures(text: str) -> str:
    """Spell out typographic ligatures (`LIGATURES`: "ﬁ" -> "fi", "ﬄ" -> "ffl"); nothing else changes."""
    return text.translate(LIGATURES)


_KEPT_CC = "\t\n\r\x0b\x0c\x85"  # control characters that are layout, not missing glyphs


def unmapped_glyphs(text: str, kept: str = _KEPT_CC) -> int:
    """How many characters of extracted `text` stand for glyphs that had no Unicode mapping: NUL and
    other control characters (category Cc) except those in `kept` (tab, line and page breaks), and U+FFFD."""
    return sum(1 for ch in text if ch == "\ufffd" or (unicodedata.category(ch) == "Cc" and ch not in kept))


def _glyph_warning(n: int, where: str, fix: str) -> list[str]:
    if not n:
        return []
    return [f"{n} character{'s' if n > 1 else ''} without a Unicode mapping{where} (NUL/control characters where "
            f"letters should be) were dropped, so words there cannot be found; {fix}"]


def normalize_text(text: str) -> str:
    """Normalize extracted text: Unix line breaks, NFC, ligatures folded, no control characters, blank
    runs collapsed.

    ``\\r\\n``, ``\\r``, form feed, vertical tab, NEL and U+2028 become ``\\n`` (U+2029 a blank line);
    the ligatures of `LIGATURES` are spelled out (`fold_ligatures`);
    other Unicode control characters (category Cc) except ``\\t`` and the byte-order mark are dropped;
    runs of two or more blank lines (whitespace-only lines count as blank) become one blank line;
    leading and trailing whitespace of the whole text is stripped.
    """
    text = _BREAK_RE.sub(lambda m: _LINE_BREAKS[m.group()], text)
    text = fold_ligatures(unicodedata.normalize("NFC", text))
    text = "".join(ch for ch in text if not _is_dropped(ch))
    return _BLANK_RUN_RE.sub("\n\n", text).strip()


def _is_dropped(ch: str) -> bool:
    if ch == "\n" or ch == "\t":
        return False
    return ch == "\ufeff" or unicodedata.category(ch) == "Cc"


def _walk(root: Path) -> list[Path]:
    files = []
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).parts
        if any(part.startswith(".") for part in rel) or not f.is_file():
            continue
        if f.suffix.lower() in SUPPORTED_EXTENSIONS:
            files.append(f)
    return files


def _read_bytes(p: Path) -> bytes:
    if not p.exists():
        raise LoadError(p, "no such file; check the path")
    if p.is_dir():
        raise LoadError(p, "is a directory; pass files, or expand it with iter_paths()")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise LoadError(p, f"cannot read the file ({exc.strerror or exc}); check its permissions") from exc


# ---------------------------------------------------------------------------------------------- text
def decode_text(path: Path, data: bytes) -> tuple[str, str]:
    """Decode bytes of a text file; return (raw text, encoding name).

    UTF-8 (optional BOM) first; a UTF-16/32 BOM is honoured; otherwise charset-normalizer's best guess.

    Raises
    ------
    LoadError
        NUL bytes without a UTF-16/32 BOM, no plausible encoding, or mostly non-text characters.
    """
    text, encoding = _decode_with_bom(data)
    if text is None:
        if b"\x00" in data:
            raise LoadError(path, "looks like a binary file (contains NUL bytes), not text; "
                                  "check that the extension matches the content")
        text, encoding = _decode_guess(path, data)
    _reject_binary(path, text)
    return text, encoding


def _decode_with_bom(data: bytes) -> tuple[str | None, str]:
    for bom, enc in ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
                     (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16")):
        if data.startswith(bom):
            try:
                return data.decode(enc), enc
            except UnicodeDecodeError:
                return None, ""
    if b"\x00" in data:
        return None, ""
    try:
        return data.decode("utf-8-sig"), "utf-8"
    except UnicodeDecodeError:
        return None, ""


def _decode_guess(path: Path, data: bytes) -> tuple[str, str]:
    """charset-normalizer's best guess; among equally plausible single-byte guesses prefer cp1252.

    Short Western European texts decode without chaos in several code pages (cp1250, cp1257, ...),
    and charset-normalizer breaks the tie arbitrarily; cp1252 (a superset of Latin-1's printable
    range) is by far the most common of them.
    """
    import charset_normalizer

    matches = charset_normalizer.from_bytes(data)
    best = matches.best()
    if best is None:
        raise LoadError(path, "not valid UTF-8 and no text encoding could be detected; it looks binary. "
                              "Re-save it as UTF-8 text")
    for m in matches:
        tied = m.chaos <= best.chaos + _TIE_CHAOS and m.coherence >= best.coherence - _TIE_COHERENCE
        if tied and "cp1252" in m.could_be_from_charset:
            try:
                return data.decode("cp1252"), "cp1252"
            except UnicodeDecodeError:
                break
    return str(best), best.encoding


def _reject_binary(path: Path, text: str) -> None:
    if not text:
        return
    bad = unmapped_glyphs(text, kept="\t\n\r\x0c")
    if bad > _MAX_BAD_CHAR_FRACTION * len(text):
        raise LoadError(path, f"looks like a binary file ({bad} of {len(text)} characters are not text); "
                              "check that the extension matches the content")


_TEXT_FIX = "check the file's encoding or re-export it as UTF-8"


def _text_meta(raw: str, encoding: str, **extra) -> dict:
    meta = {"encoding": encoding, **extra}
    warnings = _glyph_warning(unmapped_glyphs(raw), "", _TEXT_FIX)
    if warnings:
        meta["warnings"] = warnings
    return meta


def _load_txt(path: Path, data: bytes) -> tuple[str, str, list[PageSpan], dict]:
    raw, encoding = decode_text(path, data)
    return "", normalize_text(raw), [], _text_meta(raw, encoding)


def _load_md(path: Path, data: bytes) -> tuple[str, str, list[PageSpan], dict]:
    raw, encoding = decode_text(path, data)
    text = normalize_text(raw)
    return markdown_title(text), text, [], _text_meta(raw, encoding)


def markdown_title(text: str) -> str:
    """Text of the first level-1 ATX heading (``# Title``) outside fenced code blocks, or ""."""
    in_fence = False
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            in_fence = not in_fence
            continue
        m = None if in_fence else _MD_HEADING_RE.match(stripped)
        if m:
            return m.group(1).strip()
    return ""


# ----------------------------------------------------------------------------------------------- pdf
def _load_pdf(path: Path, data: bytes) -> tuple[str, str, list[PageSpan], dict]:
    reader = _open_pdf(path, data)
    try:
        raw_pages = [page.extract_text() or "" for page in reader.pages]
    except Exception as exc:  # pypdf raises many types on damaged content streams
        raise LoadError(path, f"corrupt PDF ({type(exc).__name__}: {exc}); re-export or repair it") from exc
    page_texts = [normalize_text(t) for t in raw_pages]
    if not page_texts:
        raise LoadError(path, "the PDF has no pages; re-export it")
    if not any(page_texts):
        raise LoadError(path, f"the PDF has no text layer ({len(page_texts)} pages of images or "
                              "drawings only); OCR it first, e.g. with ocrmypdf")
    tables = tables_as_markdown(data, page_texts, normalize_text)
    text, pages = join_pages(tables.page_texts)
    meta = {"n_pages": len(page_texts), **({"tables": tables.n_tables} if tables.n_tables else {})}
    warnings = list(tables.warnings or [])
    bad = {n: c for n, c in enumerate((unmapped_glyphs(t) for t in raw_pages), start=1) if c}
    if bad:
        listed = ", ".join(map(str, list(bad)[:10])) + (", ..." if len(bad) > 10 else "")
        warnings += _glyph_warning(sum(bad.values()), f" on page{'s' if len(bad) > 1 else ''} {listed}",
                                   "the PDF's fonts lack a ToUnicode map: re-export it with text, or "
                                   "OCR it (ocrmypdf --force-ocr)")
    if warnings:
        meta["warnings"] = warnings
    return _pdf_title(reader), text, pages, meta


def join_pages(page_texts: list[str]) -> tuple[str, list[PageSpan]]:
    """Join page texts with a blank line; return the text and each page's span (1-based pages).

    Empty pages get an empty span at the current offset and add no separator.
    """
    parts: list[str] = []
    pages: list[PageSpan] = []
    pos = 0
    for number, page_text in enumerate(page_texts, start=1):
        if page_text and parts:
            parts.append("\n\n")
            pos += 2
        pages.append(PageSpan(number, pos, pos + len(page_text)))
        parts.append(page_text)
        pos += len(page_text)
    return "".join(parts), pages


def _open_pdf(path: Path, data: bytes):
    import pypdf
    from pypdf.errors import DependencyError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # damaged files log noisy recovery warnings
    if not data.lstrip()[:5].startswith(b"%PDF"):
        raise LoadError(path, "corrupt PDF (no %PDF header); re-export or repair it")
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise LoadError(path, "the PDF is password-protected; decrypt it first (e.g. qpdf --decrypt "
                                  "--password=... in.pdf out.pdf)")
        _ = len(reader.pages)
    except LoadError:
        raise
    except (DependencyError, NotImplementedError) as exc:
        raise LoadError(path, f"the PDF uses encryption this install cannot open ({exc}); "
                              "decrypt it first or install the 'cryptography' package") from exc
    except Exception as exc:  # pypdf raises PdfReadError, PdfStreamError, ValueError, KeyError, ...
        raise LoadError(path, f"corrupt PDF ({type(exc).__name__}: {exc}); re-export or repair it") from exc
    return reader


def _pdf_title(reader) -> str:
    try:
        title = reader.metadata.title if reader.metadata else None
    except Exception:  # a broken Info dictionary must not sink an otherwise readable PDF
        return ""
    return " ".join(str(title).split()) if title else ""


# ---------------------------------------------------------------------------------------------- html
def _load_html(path: Path, data: bytes) -> tuple[str, str, list[PageSpan], dict]:
    raw, encoding = decode_text(path, data)
    fallback = _PlainHTML.parse(raw)
    text = normalize_text(_trafilatura_text(raw) or "")
    method = "trafilatura"
    if not text:
        text, method = normalize_text(fallback.text()), "html.parser"
    return " ".join(fallback.title.split()), text, [], _text_meta(raw, encoding, extractor=method)


def _trafilatura_text(raw: str) -> str | None:
    import trafilatura

    logging.getLogger("trafilatura").setLevel(logging.ERROR)
    try:
        return trafilatura.extract(raw, include_comments=False, include_tables=True,
                                   include_formatting=False, favor_recall=True, deduplicate=False)
    except Exception:  # trafilatura may choke on odd markup; the stdlib fallback still reads it
        return None


class _PlainHTML(HTMLParser):
    """Visible text of an HTML page: no script/style/head content; block tags start new lines."""

    _SKIP = {"script", "style", "noscript", "template", "head", "svg", "iframe", "object"}
    _BLOCK = {"p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article", "header", "footer",
              "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "dt", "dd", "hr", "main", "nav"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self._parts: list[str] = []
        self._skip_depth = 0
        self._in_title = False

    @classmethod
    def parse(cls, raw: str) -> "_PlainHTML":
        parser = cls()
        parser.feed(raw)
        parser.close()
        return parser

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "title":
            self._in_title = True
        elif tag in self._SKIP:
            self._skip_depth += 1
        elif tag in self._BLOCK:
            self._parts.append("\n")
        elif tag in ("td", "th"):
            self._parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag in self._SKIP:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag in self._BLOCK:
            self._parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skip_depth:
            self._parts.append(data)

    def text(self) -> str:
        lines = (" ".join(line.split()) for line in "".join(self._parts).split("\n"))
        return "\n".join(lines)


_LOADERS = {"txt": _load_txt, "md": _load_md, "pdf": _load_pdf, "html": _load_html}
