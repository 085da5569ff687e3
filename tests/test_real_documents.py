"""Real documents that must not give wrong or missing results silently.

CJK text in BM25, typographic ligatures, glyphs without a Unicode mapping; made-up inputs of the kind
public bug reports describe. No test depends on a model answering well.
"""

from __future__ import annotations

import hashlib
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
import sqlite_utils

from ldqa.indexes import store as store_mod
from ldqa.indexes.store import Store, fts_query
from ldqa.retrieval.loaders import load_document, normalize_text, unmapped_glyphs
from ldqa.retrieval.search_text import cjk_bigrams, search_terms, search_text
from ldqa.retrieval.types import Chunk, Document

sys.path.insert(0, str(Path(__file__).parent))
from test_loaders import _assemble_pdf  # noqa: E402

DIM = 4


def _doc(path: str, texts: list[str]) -> tuple[Document, list[Chunk], np.ndarray]:
    text = "\n".join(texts)
    doc = Document(path=path, title=Path(path).stem, text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                   kind="txt")
    chunks, pos = [], 0
    for i, t in enumerate(texts):
        chunks.append(Chunk(text=t, start=pos, end=pos + len(t), n_tokens=len(t), ordinal=i))
        pos += len(t) + 1
    vecs = np.tile(np.eye(DIM, dtype=np.float32)[0], (len(texts), 1))
    return doc, chunks, vecs


CORPUS = {
    "/d/budget_zh.txt": ["今年的项目预算为三百万元，由财务部审批。"],
    "/d/move_zh.txt": ["公司计划明年春天搬迁到新的办公楼。"],
    "/d/budget_ja.txt": ["来年度の予算案は取締役会で承認されました。"],
    "/d/hangul_ko.txt": ["올해 예산은 삼백만 원입니다."],
    "/d/english.txt": ["The annual budget of the kiln workshop is three million.", "Staff move offices in spring."],
}


def _fill(s: Store) -> dict[str, int]:
    return {p: s.add_document(*_doc(p, texts)) for p, texts in CORPUS.items()}


def _top_doc(s: Store, query: str) -> str | None:
    hits = s.bm25_search(query, 3)
    if not hits:
        return None
    row = s.get_chunks([hits[0][0]])[0]
    return next(d["path"] for d in s.documents() if d["id"] == row["doc_id"])


# ------------------------------------------------------------------------------------ CJK in BM25
def test_cjk_bigrams():
    assert cjk_bigrams("预算搬迁") == ["预算", "算搬", "搬迁"]
    assert cjk_bigrams("税") == ["税"]
    assert search_terms("预算是多少?") == ["预算", "算是", "是多", "多少"]
    assert search_terms("iPhone价格") == ["iphone", "价格"]


@pytest.mark.parametrize("query, expected", [
    ("预算", "/d/budget_zh.txt"),
    ("项目预算是多少？", "/d/budget_zh.txt"),
    ("搬迁", "/d/move_zh.txt"),
    ("公司什么时候搬迁", "/d/move_zh.txt"),
    ("予算", "/d/budget_ja.txt"),
    ("予算案", "/d/budget_ja.txt"),
    ("예산", "/d/hangul_ko.txt"),
    ("kiln budget", "/d/english.txt"),
])
def test_cjk_query_ranks_matching_document_first(tmp_path, query, expected):
    with Store(tmp_path / "st", "fake", DIM) as s:
        _fill(s)
        assert _top_doc(s, query) == expected


def test_english_search_text_and_queries_unchanged():
    text = "Dogs chase cats; the SL-30 Pro's fan-hub bolts: 10 Nm (see §4.2)."
    assert search_text(text) == text  # nothing to fold, no CJK: FTS5 sees the same text as before
    assert fts_query("What torque for the fan hub bolts?") == '"torque" OR "fan" OR "hub" OR "bolts"'
    assert fts_query("a b c 7") == '"7"'


def _downgrade_to_schema1(path: Path) -> None:
    """Turn a store into what ldqa wrote before search_text existed: FTS5 over the raw text, schema 1."""
    conn = sqlite3.connect(path / store_mod.DB_NAME)
    db = sqlite_utils.Database(conn)
    for t in ("chunks_ai", "chunks_ad", "chunks_au"):
        conn.execute(f"DROP TRIGGER {t}")
    conn.execute("DROP TABLE chunks_fts")
    conn.execute("ALTER TABLE chunks DROP COLUMN search_text")
    db["chunks"].enable_fts(["text"], create_triggers=True, tokenize=store_mod._FTS_TOKENIZE)
    conn.execute("INSERT INTO chunks_fts (chunks_fts) VALUES ('rebuild')")
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()


def test_schema1_store_is_rebuilt_on_open(tmp_path):
    with Store(tmp_path / "st", "fake", DIM) as s:
        _fill(s)
        english = s.bm25_search("budget spring offices", 5)
        n = s.n_chunks()
    _downgrade_to_schema1(tmp_path / "st")
    with Store(tmp_path / "st", "fake", DIM) as s:  # schema 1's tokenizer: a CJK run is one token
        pass
    conn = sqlite3.connect(tmp_path / "st" / store_mod.DB_NAME)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
    conn.close()
    with Store(tmp_path / "st", "fake", DIM) as s:
        assert s.n_chunks() == n
        assert _top_doc(s, "预算") == "/d/budget_zh.txt"
        assert s.bm25_search("budget spring offices", 5) == english
        # the rebuilt index stays in sync with later changes
        s.add_document(*_doc("/d/new_zh.txt", ["新的仓库预算很少。"]))
        assert {_top_doc(s, "仓库")} == {"/d/new_zh.txt"}


def test_interrupted_rebuild_leaves_the_old_store_intact(tmp_path, monkeypatch):
    with Store(tmp_path / "st", "fake", DIM) as s:
        _fill(s)
    _downgrade_to_schema1(tmp_path / "st")
    calls = {"n": 0}
    real = store_mod.search_text

    def dies_midway(text):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("power cut")
        return real(text)

    monkeypatch.setattr(store_mod, "search_text", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        Store(tmp_path / "st", "fake", DIM)
    conn = sqlite3.connect(tmp_path / "st" / store_mod.DB_NAME)
    cols = {r[1] for r in conn.execute("PRAGMA table_info(chunks)")}
    assert "search_text" not in cols  # nothing half-converted
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("1",)
    # the schema-1 index still answers English queries
    assert conn.execute("SELECT count(*) FROM chunks_fts WHERE chunks_fts MATCH 'kiln'").fetchone() == (1,)
    conn.close()
    monkeypatch.setattr(store_mod, "search_text", real)
    with Store(tmp_path / "st", "fake", DIM) as s:  # the next open converts it
        assert _top_doc(s, "予算") == "/d/budget_ja.txt"


def test_newer_schema_is_refused(tmp_path):
    with Store(tmp_path / "st", "fake", DIM):
        pass
    conn = sqlite3.connect(tmp_path / "st" / store_mod.DB_NAME)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="newer ldqa"):
        Store(tmp_path / "st", "fake", DIM)


# ------------------------------------------------------------------------------------ ligatures
def test_ligatures_folded_in_text_and_spans(tmp_path):
    raw = "The \ufb01nal o\ufb03cial work\ufb02ow of the a\ufb03liate, e\ufb00ort and ba\ufb04e."
    assert normalize_text(raw) == "The final official workflow of the affiliate, effort and baffle."
    assert normalize_text("m² costs ½ of ＡＢＣ") == "m² costs ½ of ＡＢＣ"  # only ligatures are folded
    p = tmp_path / "lig.txt"
    p.write_text(raw, encoding="utf-8")
    doc = load_document(p)
    assert "affiliate" in doc.text and "\ufb03" not in doc.text


def _ligature_pdf() -> bytes:
    """One page typeset with ligature glyphs (/fi /fl /ffi through the font's /Differences), as TeX and
    InDesign output does: pypdf extracts them as U+FB01 / U+FB02 / U+FB03."""
    enc = b"<< /Type /Encoding /BaseEncoding /WinAnsiEncoding /Differences [1 /fi 2 /fl 3 /ffi] >>"
    stream = b"BT /F1 12 Tf 72 720 Td (The \\001nal o\\003cial work\\002ow of the a\\003liate.) Tj ET"
    return _pdf_page(stream, enc)


def _pdf_page(stream: bytes, encoding: bytes) -> bytes:
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding " + encoding + b" >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >>"
               b" /Contents 5 0 R >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"]
    return _assemble_pdf(objects)


def test_pdf_with_ligatures_is_searchable(tmp_path):
    p = tmp_path / "typeset.pdf"
    p.write_bytes(_ligature_pdf())
    doc = load_document(p)
    assert doc.text == "The final official workflow of the affiliate."
    assert "warnings" not in doc.meta
    with Store(tmp_path / "st", "fake", DIM) as s:
        s.add_document(doc, [Chunk(doc.text, 0, len(doc.text), 9, 0, 1)], np.eye(DIM, dtype=np.float32)[:1])
        for word in ("affiliate", "workflow", "official", "final"):
            assert len(s.bm25_search(word, 1)) == 1, word


def test_search_folds_ligatures_even_in_old_text():
    """A chunk stored before loaders folded ligatures is still found: search_text applies NFKC."""
    assert search_text("o\ufb03cial work\ufb02ow") == "official workflow"
    assert search_terms("ＡＢＣ-123 o\ufb03cial") == ["abc", "123", "official"]


# ------------------------------------------------------------------------------ unmapped glyphs
def test_pdf_glyphs_without_unicode_mapping_warn_per_file(tmp_path):
    stream = b"BT /F1 12 Tf 72 720 Td (Total \\001\\002\\003\\004 due in March.) Tj ET"
    p = tmp_path / "nomap.pdf"
    p.write_bytes(_pdf_page(stream, b"/WinAnsiEncoding"))
    doc = load_document(p)
    assert "\x01" not in doc.text and doc.text.startswith("Total")
    (w,) = doc.meta["warnings"]
    assert w.startswith("4 characters without a Unicode mapping on page 1") and "OCR" in w


def test_text_file_with_control_characters_warns(tmp_path):
    p = tmp_path / "ctl.txt"
    p.write_text("Budget \x02\x03 approved.\n" + "More ordinary text. " * 20, encoding="utf-8")
    doc = load_document(p)
    assert doc.text.startswith("Budget  approved.")
    assert doc.meta["warnings"][0].startswith("2 characters without a Unicode mapping")
    clean = tmp_path / "clean.txt"
    clean.write_text("Tabs\tand\r\nnewlines\x0care fine.", encoding="utf-8")
    assert "warnings" not in load_document(clean).meta
    assert unmapped_glyphs("a\tb\nc\r\x0c\ufffd\x00") == 2


def test_ingest_reports_the_warning_and_keeps_the_file(tiny_model_dir, tmp_path, caplog):
    from ldqa.app.api import LongDocQA

    good = tmp_path / "docs" / "good.txt"
    good.parent.mkdir()
    good.write_text("The kiln budget is three million.", encoding="utf-8")
    bad = tmp_path / "docs" / "nomap.pdf"
    bad.write_bytes(_pdf_page(b"BT /F1 12 Tf 72 720 Td (Invoice \\001\\002 total 40 EUR.) Tj ET", b"/WinAnsiEncoding"))
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=4)
    with caplog.at_level("WARNING"):
        report = qa.ingest([tmp_path / "docs"])
    by_name = {Path(f.path).name: f for f in report.files}
    assert by_name["good.txt"].status == "added" and by_name["good.txt"].warnings == []
    assert by_name["nomap.pdf"].status == "added" and "page 1" in by_name["nomap.pdf"].warnings[0]
    assert any("nomap.pdf" in r.getMessage() and "Unicode mapping" in r.getMessage() for r in caplog.records)
    assert report.to_dict()["files"][1]["warnings"] == by_name["nomap.pdf"].warnings


# ------------------------------------------------------------------------------------ tables
from ldqa.retrieval.chunking import ChunkConfig, chunk_document  # noqa: E402

HEADER = "| SKU | Product | Unit price | Stock |\n|---|---|---:|---|"


def _price_rows(n: int = 60) -> list[str]:
    return [f"| SKU-{i:04d} | Widget model {i} | {i * 1.25 + 3:.2f} EUR | {(i * 7) % 50} |" for i in range(n)]


def _words(s: str) -> int:
    return len(s.split())


def test_every_table_chunk_repeats_the_header_within_budget():
    text = "# Price list\n\nOur prices for 2025 are below.\n\n" + HEADER + "\n" + "\n".join(_price_rows()) + \
        "\n\nPrices exclude VAT. Delivery takes a week."
    doc = Document(path="/x.md", title="t", text=text, sha256="0", kind="md")
    cfg = ChunkConfig(64, 8)
    chunks = chunk_document(doc, _words, cfg)
    assert len(chunks) > 4
    rows = set(_price_rows())
    for c in chunks:
        assert c.text == text[c.start:c.end]
        assert c.n_tokens == _words(c.full_text) <= cfg.chunk_tokens
        lines = c.text.split("\n")
        has_rows = any(line in rows for line in lines)
        # no row is cut: every line that looks like a row is a whole row (or the header/separator)
        assert all(line in rows or not line.startswith("| SKU-") for line in lines)
        if has_rows:
            assert c.header == HEADER or HEADER in c.text, c
        else:
            assert c.header == ""
    # every row is in some chunk, and the last rows' chunk names the columns
    assert rows <= {line for c in chunks for line in c.text.split("\n")}
    last = next(c for c in chunks if "| SKU-0057 |" in c.text)
    assert last.full_text.startswith(HEADER)


def test_long_pdf_like_lines_are_not_cut_mid_row():
    """A table extracted from a PDF comes as one paragraph of lines; over the budget it is cut at line
    ends, never inside a row."""
    rows = [f"SKU-{i:04d} Widget model {i} {i * 1.25 + 3:.2f} EUR" for i in range(60)]
    text = "SKU Product Unit price\n" + "\n".join(rows)
    doc = Document(path="/x.pdf", title="t", text=text, sha256="0", kind="pdf")
    chunks = chunk_document(doc, _words, ChunkConfig(40, 0))
    assert len(chunks) > 3
    for c in chunks:
        assert all(line in rows or line == "SKU Product Unit price" for line in c.text.split("\n")), c.text


def _table_pdf(rows: list[tuple[str, ...]], per_page: int = 30) -> bytes:
    """A PDF whose pages draw `rows` as a table (cells at fixed x positions, as a layout program does);
    the first row (the header) is drawn on the first page only; a line of prose precedes the table."""
    pages = [rows[:per_page + 1]] + [rows[i:i + per_page] for i in range(per_page + 1, len(rows), per_page)]
    n = len(pages)
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(n)) + b"] /Count %d >>" % n,
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"]
    for i, page_rows in enumerate(pages):
        ops, y = [b"BT /F1 10 Tf"], 750
        if i == 0:
            ops.append(b"1 0 0 1 72 770 Tm (Price list for 2025. Prices exclude VAT.) Tj")
        for r in page_rows:
            for x, cell in zip((72, 180, 360, 460), r):
                ops.append(b"1 0 0 1 %d %d Tm (%s) Tj" % (x, y, cell.encode()))
            y -= 14
        stream = b"\n".join(ops + [b"ET"])
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >>"
                       b" /Contents %d 0 R >>" % (5 + 2 * i))
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    return _assemble_pdf(objects)


def _pdf_rows(n: int = 60) -> list[tuple[str, ...]]:
    return [("SKU", "Product", "Unit price", "Stock")] + [
        (f"SKU-{i:04d}", f"Widget model {i}", f"{i * 1.25 + 3:.2f} EUR", str((i * 7) % 50)) for i in range(n)]


def test_pdf_tables_become_pipe_tables_and_keep_their_header_across_pages(tmp_path):
    p = tmp_path / "prices.pdf"
    p.write_bytes(_table_pdf(_pdf_rows()))
    doc = load_document(p)
    assert doc.meta["n_pages"] == 2 and doc.meta["tables"] == 1
    header = "| SKU | Product | Unit price | Stock |\n|---|---|---|---|"
    assert doc.text.startswith("Price list for 2025. Prices exclude VAT.\n" + header + "\n| SKU-0000 |")
    page2 = doc.text[doc.pages[1].start:doc.pages[1].end]
    assert page2.startswith(header + "\n| SKU-0030 | Widget model 30 | 40.50 EUR | 10 |")  # header repeated
    chunks = chunk_document(doc, _words, ChunkConfig(48, 0))
    for c in chunks:
        if "| SKU-00" in c.text:
            assert "| SKU | Product | Unit price | Stock |" in c.full_text, c
        assert all(not line.startswith("| SKU-") or line.endswith("|") for line in c.text.split("\n"))


def test_pdf_prose_is_not_taken_for_a_table(tmp_path):
    p = tmp_path / "prose.pdf"
    from test_loaders import text_pdf

    p.write_bytes(text_pdf([["The kiln dries lumber in eleven days.", "Each fan hub bolt takes 18 Nm.",
                             "Check the seals every spring.", "Replace the filters yearly."]]))
    doc = load_document(p)
    assert "|" not in doc.text and "tables" not in doc.meta


# PDF tables as report generators draw them: found by pdfplumber, written into pypdf's text
def _site_rows(n: int = 70, blanks: bool = False) -> list[tuple[str, ...]]:
    """A header and `n` rows; with `blanks`, every seventh row has an empty last cell."""
    return [("Site", "City", "Capacity", "Manager")] + [
        (f"Site-{i:03d}", ("Lille-2", "Lyon", "Saint-Etienne")[i % 3], f"{100 + 7 * i} t",
         "" if blanks and i % 7 == 3 else f"Manager {i}") for i in range(n)]


def _pipe(row: tuple[str, ...]) -> str:
    return "| " + " | ".join(row) + " |"


def _assert_table_read_whole(doc: Document, rows: list[tuple[str, ...]]) -> None:
    """One Markdown table (continued across pages), each row on one line, no cell left as loose text; every
    chunk holding a row names the columns and holds whole rows only."""
    header, body = _pipe(rows[0]), [_pipe(r) for r in rows[1:]]
    lines = doc.text.split("\n")
    assert doc.meta["n_pages"] >= 2 and doc.meta["tables"] == 1, doc.meta
    assert set(body) <= set(lines), [b for b in body if b not in lines][:3]
    for r in rows[1:]:
        assert doc.text.count(r[0]) == 1  # the table's text is not repeated as loose lines
    assert not {"Lille-2", "Lyon", "Manager"} & {line.strip() for line in lines}
    assert any(line.startswith("Site list for 2025") for line in lines)  # the prose stays prose
    chunks = chunk_document(doc, _words, ChunkConfig(60, 8))
    assert len(chunks) > 4
    seen = set()
    for c in chunks:
        row_lines = [line for line in c.text.split("\n") if "Site-" in line]
        assert all(line in body for line in row_lines), c.text  # no row is cut
        if row_lines:  # the columns are named above the chunk's first row
            assert 0 <= c.full_text.find(header + "\n|---|") < c.full_text.find(row_lines[0]), c.full_text[:200]
        seen.update(row_lines)
    assert seen == set(body)


def _reportlab_table_pdf(path: Path, rows: list[tuple[str, ...]], ruled: bool) -> None:
    """A report made with reportlab: a paragraph, a `Table` (one text object per cell, the header on the first
    page only; with `ruled`, a grid), a paragraph."""
    from reportlab.lib import colors
    from reportlab.lib.styles import getSampleStyleSheet
    from reportlab.platypus import Paragraph, SimpleDocTemplate, Table, TableStyle

    style = getSampleStyleSheet()["Normal"]
    table = Table(rows, hAlign="LEFT")
    if ruled:
        table.setStyle(TableStyle([("GRID", (0, 0), (-1, -1), 0.5, colors.black)]))
    SimpleDocTemplate(str(path)).build([Paragraph("Site list for 2025. Capacities are in tonnes.", style), table,
                                        Paragraph("Figures are audited every year.", style)])


@pytest.mark.parametrize("ruled", [False, True], ids=["plain", "grid"])
def test_reportlab_table_keeps_its_rows_whole_and_its_header_in_every_chunk(tmp_path, ruled):
    rows = _site_rows()
    p = tmp_path / "sites.pdf"
    _reportlab_table_pdf(p, rows, ruled)
    doc = load_document(p)
    _assert_table_read_whole(doc, rows)
    assert doc.text.rstrip().endswith("Figures are audited every year.")


def _pages_pdf(streams: list[bytes]) -> bytes:
    """A PDF whose page i runs content stream i, with Helvetica as /F1 and Courier as /F2."""
    n = len(streams)
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (5 + 2 * i) for i in range(n))
               + b"] /Count %d >>" % n,
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Courier /Encoding /WinAnsiEncoding >>"]
    for i, stream in enumerate(streams):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R "
                       b"/F2 4 0 R >> >> /Contents %d 0 R >>" % (6 + 2 * i))
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    return _assemble_pdf(objects)


_COLUMNS = (72, 170, 290, 370)  # x of each column, in points


def _row_ops(row: tuple[str, ...], y: int, way: str) -> list[bytes]:
    """Content-stream operators that draw one table row at height `y`."""
    if way == "cell objects":  # one text object per cell, as most report generators write
        return [b"BT /F1 10 Tf 1 0 0 1 %d %d Tm (%s) Tj ET" % (x, y, c.encode()) for x, c in zip(_COLUMNS, row) if c]
    if way == "one TJ per row":  # Courier (6 pt a character), each cell moved to its column by a displacement
        parts, x = [], _COLUMNS[0]
        for col, c in zip(_COLUMNS, row):
            parts += [b"%d" % (-(col - x) * 100)] if col > x else []
            parts.append(b"(%s)" % c.encode())
            x = col + 6 * len(c)
        return [b"BT /F2 10 Tf 1 0 0 1 %d %d Tm [%s] TJ ET" % (_COLUMNS[0], y, b" ".join(parts))]
    padded = "".join(c.ljust((b - a) // 6) for c, a, b in zip(row, _COLUMNS, _COLUMNS[1:] + (460,))).rstrip()
    return [b"BT /F2 10 Tf 1 0 0 1 %d %d Tm (%s) Tj ET" % (_COLUMNS[0], y, padded.encode())]  # one string per row


def _drawn_table_pdf(rows: list[tuple[str, ...]], way: str, per_page: int = 40) -> bytes:
    """A paragraph line, then `rows` drawn `way`, the header on the first page only."""
    pages = [rows[:per_page + 1]] + [rows[i:i + per_page] for i in range(per_page + 1, len(rows), per_page)]
    streams = []
    for i, page_rows in enumerate(pages):
        ops = []
        if i == 0:
            ops.append(b"BT /F1 10 Tf 1 0 0 1 72 770 Tm (Site list for 2025. Capacities are in tonnes.) Tj ET")
        for k, row in enumerate(page_rows):
            ops += _row_ops(row, 750 - 14 * k, way)
        streams.append(b"\n".join(ops))
    return _pages_pdf(streams)


def test_cell_per_text_object_table_keeps_its_rows_whole_and_its_header_in_every_chunk(tmp_path):
    rows = _site_rows(blanks=True)
    p = tmp_path / "sites.pdf"
    p.write_bytes(_drawn_table_pdf(rows, "cell objects"))
    _assert_table_read_whole(load_document(p), rows)


@pytest.mark.parametrize("way", ["one TJ per row", "one space-padded string per row"])
def test_single_text_line_per_row_table_keeps_its_rows_whole_and_its_header_in_every_chunk(tmp_path, way):
    rows = _site_rows(blanks=True)
    p = tmp_path / "sites.pdf"
    p.write_bytes(_drawn_table_pdf(rows, way))
    _assert_table_read_whole(load_document(p), rows)


def test_pdf_bullet_list_is_not_taken_for_a_table(tmp_path):
    """Bullets set apart from their items line up like a column, but a list has no table's text: the page
    gives pypdf's text unchanged."""
    import pypdf

    from ldqa.retrieval.loaders import join_pages

    items = ["Check the seals every spring", "Replace the filters yearly", "Grease the fan hub bearings",
             "Calibrate the humidity sensor"]
    ops = [b"BT /F1 10 Tf 1 0 0 1 72 770 Tm (Maintenance of the kiln:) Tj ET"]
    for k, item in enumerate(items):
        ops.append(b"BT /F1 10 Tf 1 0 0 1 80 %d Tm (\x95) Tj 1 0 0 1 100 %d Tm (%s) Tj ET"
                   % (750 - 14 * k, 750 - 14 * k, item.encode()))
    p = tmp_path / "list.pdf"
    p.write_bytes(_pages_pdf([b"\n".join(ops)]))
    doc = load_document(p)
    plain = join_pages([normalize_text(page.extract_text()) for page in pypdf.PdfReader(p).pages])[0]
    assert doc.text == plain and "tables" not in doc.meta and "warnings" not in doc.meta
    assert all(f"\u2022 {item}" in doc.text for item in items)


@pytest.mark.parametrize("where", ["file", "page"])
def test_pdf_tables_failing_keeps_the_text_with_a_warning(tmp_path, monkeypatch, where):
    """When pdfplumber cannot read the file (or a page), the PDF still loads with pypdf's text, and says so."""
    import pdfplumber
    import pypdf

    from ldqa.retrieval.loaders import join_pages

    def boom(*args, **kwargs):
        raise RuntimeError("unreadable content stream")

    rows = _site_rows()
    p = tmp_path / "sites.pdf"
    p.write_bytes(_drawn_table_pdf(rows, "cell objects"))
    if where == "file":
        monkeypatch.setattr(pdfplumber, "open", boom)
    else:
        monkeypatch.setattr(pdfplumber.page.Page, "find_tables", boom)
    doc = load_document(p)
    plain = join_pages([normalize_text(page.extract_text()) for page in pypdf.PdfReader(p).pages])[0]
    assert doc.text == plain and "tables" not in doc.meta
    [warning] = doc.meta["warnings"]
    assert warning.startswith("tables could not be detected") and "unreadable content stream" in warning
    assert ("pages 1, 2" in warning) == (where == "page") and "re-export" in warning


@pytest.mark.parametrize("kind", ["md", "html", "pdf"])
def test_question_about_a_bottom_row_retrieves_a_chunk_that_names_the_columns(tiny_model_dir, tmp_path, kind):
    from ldqa.app.api import LongDocQA

    rows = _price_rows()
    if kind in ("md", "pdf"):
        body = "# Price list\n\nOur prices for 2025.\n\n" + HEADER + "\n" + "\n".join(rows) + "\n"
    else:
        cells = lambda r: "".join(f"<td>{c.strip()}</td>" for c in r.strip("|").split("|"))  # noqa: E731
        body = ("<html><head><title>Price list</title></head><body><h1>Price list</h1><p>Our prices for 2025."
                "</p><table><thead><tr><th>SKU</th><th>Product</th><th>Unit price</th><th>Stock</th></tr></thead>"
                "<tbody>" + "".join(f"<tr>{cells(r)}</tr>" for r in rows) + "</tbody></table></body></html>")
    p = tmp_path / f"prices.{kind}"
    if kind == "pdf":
        p.write_bytes(_table_pdf([tuple(c.strip() for c in r.strip("|").split("|"))
                                  for r in [HEADER.split("\n")[0]] + rows]))
    else:
        p.write_text(body, encoding="utf-8")
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=4)
    assert qa.ingest([p]).files[0].status == "added"
    assert qa.store.n_chunks() > 2
    for retriever in ("bm25", "hybrid"):
        top = qa.retrieve("What is the unit price of SKU-0057?", top_k=1, retriever=retriever)[0]
        assert "SKU-0057" in top.text
        assert "Unit price" in top.header + top.text
    # the LLM reads the header too: it is in the passage's prompt text
    from ldqa.app.prompt import build_prompt

    seg = build_prompt(qa.llm.tokenizer, [top], "?")
    assert "Unit price" in qa.llm.tokenizer.decode(seg.passages[0])


# ------------------------------------------------------------------------------------ prompt budget
from ldqa.app.prompt import PromptTooLongError, build_prompt, fit_passages, truncate_middle  # noqa: E402


class _CharTok:
    """One token per character, BOS id 1."""

    bos_id = 1

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _passages(n: int, size: int = 100) -> list:
    from ldqa.app.api import Passage

    return [Passage(f"T{i}", chr(ord("a") + i) * size) for i in range(n)]


def test_fit_passages_drops_from_the_lowest_ranked():
    tok, ps = _CharTok(), _passages(6)
    full = build_prompt(tok, ps, "Why?")
    n_full = len(full.ids())
    kept, seg, n = fit_passages(tok, ps, "Why?", n_full + 16, 16)
    assert kept == ps and n == n_full and seg.ids() == full.ids()
    kept, seg, n = fit_passages(tok, ps, "Why?", n_full + 15, 16)  # one token short: the last one goes
    assert kept == ps[:5] and seg.ids() == build_prompt(tok, ps[:5], "Why?").ids() and n == len(seg.ids())
    kept, seg, n = fit_passages(tok, ps, "Why?", n_full - 250, 16)
    assert kept == ps[:len(kept)] and n + 16 <= n_full - 250 and len(kept) == 3


def test_a_question_that_cannot_fit_is_a_clear_error():
    tok, ps = _CharTok(), _passages(3)
    long_q = "Why " * 500
    with pytest.raises(PromptTooLongError, match="over the model's context window of 1000 tokens") as e:
        fit_passages(tok, ps, long_q, 1000, 64)
    assert e.value.context_length == 1000 and e.value.needed > 2000
    alone = len(build_prompt(tok, [], "Why?").ids())
    with pytest.raises(PromptTooLongError, match="no room for a passage"):
        fit_passages(tok, ps, "Why?", alone + 64 + 50, 64)  # fits alone, but not with the best passage


def test_truncate_middle_is_longbench_rule():
    ids = list(range(10))
    assert truncate_middle(ids, 10) == ids
    assert truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert truncate_middle(ids, 5) == [0, 1, 8, 9]  # LongBench: int(max/2) from each end
    with pytest.raises(ValueError):
        truncate_middle(ids, 1)


# ------------------------------------------------------------- the budget through the API, CLI, UI, eval
def test_api_drops_lowest_ranked_passages_to_fit_the_window(tiny_model_dir, tmp_path, monkeypatch):
    from ldqa.app.api import LongDocQA

    sample = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=8)
    qa.ingest([sample])
    full = qa.ask("What torque for the fan hub bolts?", top_k=6)
    assert full.settings["passages_dropped"] == 0 and len(full.passages) == 6
    assert full.settings["context_length"] == 4096 and full.settings["max_new_tokens"] == 8
    window = full.timings["prompt_tokens"] - 200  # made-up small window: the full prompt no longer fits
    # the loaded model is cached for the whole process: restore its window afterwards
    monkeypatch.setattr(qa.llm.model.cfg, "max_position_embeddings", window)
    cut = qa.ask("What torque for the fan hub bolts?", top_k=6)
    dropped = cut.settings["passages_dropped"]
    assert dropped >= 1 and len(cut.passages) == 6 - dropped
    assert [p.chunk_id for p in cut.passages] == [p.chunk_id for p in full.passages[:6 - dropped]]
    assert cut.timings["prompt_tokens"] + 8 <= window
    assert "left out to fit the model's context window" in cut.notice
    with pytest.raises(PromptTooLongError, match="shorten the question"):
        qa.stream("why " * window, top_k=2, abstain_below=None)  # raised before anything is computed


def _answer(stop_reason: str, dropped: int = 0, cited: bool = True):
    from ldqa.app.api import Answer, Settings, Timings
    from ldqa.app.citations import Citation

    citations = [Citation(1, 7, 1, "Manual", "/x/manual.md", None, 0, 40, "contains")] if cited else []
    return Answer("q?", "An answer that goes on", citations, [],
                  Timings(stop_reason=stop_reason, retrieval_ms=1.0, ttft_ms=2.0, tokens_per_s=3.0, prompt_tokens=9,
                          total_ms=5.0),
                  Settings(top_k=3, retriever="hybrid", attention="full", model="m", weights="q8_0", kv_dtype="fp32",
                           max_new_tokens=64, passages_dropped=dropped, context_length=8192))


def test_truncation_notice_in_answer_cli_and_ui(capsys):
    from ldqa.app.cli import print_answer_details
    from ldqa.app.ui import answer_markdown

    cut, whole = _answer("max_new_tokens"), _answer("eos")
    assert cut.truncated and not whole.truncated
    assert "cut at max_new_tokens=64" in cut.notice and whole.notice == ""
    print_answer_details(cut)
    assert "note: the answer was cut at max_new_tokens=64" in capsys.readouterr().out
    print_answer_details(whole)
    assert "note:" not in capsys.readouterr().out
    assert "cut at max_new_tokens=64" in answer_markdown(cut) and "Note:" not in answer_markdown(whole)
    both = _answer("max_new_tokens", dropped=2)
    assert "2 lowest-ranked passages left out" in answer_markdown(both)
    uncited = _answer("eos", cited=False)  # no passage supports it: said, in the API and the UI
    assert "may come from the model's own knowledge" in uncited.notice and "own knowledge" in answer_markdown(uncited)


def test_eval_jsonl_max_length_cuts_the_middle_and_logs_rows(tmp_path, tiny_model_dir):
    import json

    from ldqa.eval.harness import EvalConfig, run

    data = tmp_path / "lb.jsonl"
    ctx = " ".join(f"Sentence {i} is about the kiln." for i in range(300))
    records = [{"_id": "long", "input": "What colour is the kiln?", "answers": ["blue"],
                "context": "The kiln is blue. " + ctx + " The end."},
               {"_id": "short", "input": "Who?", "answers": ["Ada"], "context": "Ada wrote it."},
               {"_id": "toolong", "input": "Why " * 400 + "?", "answers": ["x"], "context": "Some context."}]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    res = run(EvalConfig(benchmark="jsonl", data=str(data), out=str(tmp_path / "out"),
                         model=str(tiny_model_dir("gemma3")), max_length=300, max_new_tokens=8, passage_tokens=64,
                         progress=False))
    rows = {r["example_id"]: r for r in res["rows"]}
    assert rows["long"]["context_tokens_cut"] > 1000 and rows["long"]["prompt_tokens"] + 8 <= 300
    assert rows["short"]["context_tokens_cut"] == 0
    assert rows["toolong"]["error"].startswith("--max-length") and rows["toolong"]["score"] is None


def test_answer_settings_are_kept_with_the_collection(tiny_model_dir, tmp_path):
    from ldqa.app.api import LongDocQA
    from ldqa.app.cli import main

    model = str(tiny_model_dir("gemma3"))
    qa = LongDocQA(store=tmp_path / "store", model=model)
    assert qa.max_new_tokens == 64 and qa.store.answer_settings() == {}
    assert qa.save_answer_settings(200) == {"max_new_tokens": 200} and qa.max_new_tokens == 200
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        qa.save_answer_settings(0)
    qa.store.close()
    again = LongDocQA(store=tmp_path / "store", model=model)
    assert again.max_new_tokens == 200  # a new object on the same store starts from the saved setting
    assert LongDocQA(store=tmp_path / "store", model=model, max_new_tokens=16).max_new_tokens == 16
    assert main(["ask", "q?", "--store", str(tmp_path / "store"), "--model", model, "--save-settings"]) == 2


# ------------------------------------------------------------------------------------ abstention
def test_off_topic_question_abstains_without_running_the_model(tiny_model_dir, tmp_path, monkeypatch):
    from ldqa.app.api import LongDocQA
    from ldqa.app.prompt import ABSTAIN_PHRASE

    sample = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=4)
    qa.ingest([sample])
    on = qa.ask("What torque must each fan hub bolt be tightened to?", top_k=3)
    assert on.settings["abstained"] is False and on.settings["best_dense_score"] >= 0.25
    assert on.timings["generated_tokens"] >= 1
    calls = []
    monkeypatch.setattr(qa, "_answer_stream", lambda *a, **k: calls.append(a))
    off = qa.ask("Who won the 2018 FIFA World Cup?", top_k=3)
    assert calls == []  # the LLM path was never entered
    assert off.text == ABSTAIN_PHRASE and off.citations == [] and len(off.passages) == 3
    assert off.settings["abstained"] is True and off.settings["best_dense_score"] < 0.25
    assert off.timings["stop_reason"] == "abstained" and "not asked" in off.notice
    monkeypatch.undo()
    forced = qa.ask("Who won the 2018 FIFA World Cup?", top_k=3, abstain_below=None)
    assert "abstained" not in forced.settings and forced.timings["generated_tokens"] >= 1
    assert forced.citations or "may come from the model's own knowledge" in forced.notice
    assert "abstained" not in qa.ask("Who won the 2018 FIFA World Cup?", top_k=3, retriever="bm25").settings
    with pytest.raises(ValueError, match="abstain_below"):
        qa.ask("q?", abstain_below=2.0)


def test_a_derailed_answer_is_not_called_merely_cut():
    from ldqa.app.api import Answer, Settings, Timings, repeats_itself

    def ans(text):
        return Answer("q?", text, [], [], Timings(stop_reason="max_new_tokens"),
                      Settings(top_k=3, retriever="hybrid", attention="block", model="m", weights="gguf",
                               kv_dtype="fp32", max_new_tokens=64))

    # what the sample's error-code question gets in block mode, and an empty-table loop
    # (the second: the same cut by a 16-token budget, as `ldqa ask --max-new-tokens 16` gets it)
    for junk in ("1" + "0" * 63, "1" + "0" * 14, "$1,180 |\n" + "| | | |\n" * 10):
        assert repeats_itself(junk)
        assert "repeating itself: the model derailed" in ans(junk).notice
        assert "raise max_new_tokens" not in ans(junk).notice
    # real answers cut short, a real table, and short texts are not flagged
    for fine in ("The SL-30 holds a maximum load of 3.2 cubic metres of stacked lumber, which is a",
                 "| Model | Price |\n|---|---|\n| SL-30 | EUR 6,900 |\n| SL-30 Pro | EUR 8,450 |",
                 "E-03.", "no no no no no", "14 March 2023.", "SL30-2207-0450", "20 October 2024."):
        assert not repeats_itself(fine), fine
    assert "raise max_new_tokens" in ans("The SL-30 holds a maximum load of 3.2 cubic metres of stacked").notice
