"""Loaders: every format, the bundled sample, every error case, decoding and normalization."""

from __future__ import annotations

import hashlib
import io
import json
import zlib
from pathlib import Path

import pypdf
import pytest

from ldqa.retrieval import loaders
from ldqa.retrieval.loaders import SUPPORTED_EXTENSIONS, LoadError, iter_paths, load_document, normalize_text

SAMPLE = Path(__file__).resolve().parents[1] / "app" / "sample"


# ------------------------------------------------------------------------------------ PDF builders
def _assemble_pdf(objects: list[bytes], info: bytes | None = None) -> bytes:
    """A PDF from numbered objects (1 = catalog) with a correct xref table."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for num, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % num + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    trailer = b"<< /Size %d /Root 1 0 R" % (len(objects) + 1) + (b" /Info " + info if info else b"") + b" >>"
    out += b"trailer\n" + trailer + b"\nstartxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)


def text_pdf(pages: list[list[str]], title: str | None = None) -> bytes:
    """PDF whose page i shows the lines pages[i] in Helvetica (an empty list gives a blank page)."""
    n = len(pages)
    kids = b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(n))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % n,
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"]
    for i, lines in enumerate(pages):
        ops = [b"BT /F1 12 Tf 14 TL 72 720 Td"] + [b"(" + ln.encode("ascii") + b") Tj T*" for ln in lines]
        stream = b"\n".join(ops + [b"ET"])
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (5 + 2 * i))
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    info = None
    if title is not None:
        objects.append(b"<< /Title (" + title.encode("ascii") + b") >>")
        info = b"%d 0 R" % len(objects)
    return _assemble_pdf(objects, info)


def image_pdf() -> bytes:
    """One page that paints a 4x4 grey image and has no text at all (a scan)."""
    pixels = zlib.compress(bytes(range(0, 256, 16)))
    stream = b"q 200 0 0 200 100 400 cm /Im1 Do Q"
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
               b"/Resources << /XObject << /Im1 5 0 R >> >> /Contents 4 0 R >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /XObject /Subtype /Image /Width 4 /Height 4 /ColorSpace /DeviceGray "
               b"/BitsPerComponent 8 /Filter /FlateDecode /Length %d >>\nstream\n" % len(pixels)
               + pixels + b"\nendstream"]
    return _assemble_pdf(objects)


def encrypted(pdf: bytes, user: str, owner: str = "owner-secret") -> bytes:
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password=user, owner_password=owner)  # RC4-128: no extra dependency
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    p = tmp_path / name
    p.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return p


# ------------------------------------------------------------------------------------------ text
def test_txt_fields(tmp_path):
    data = "First line.\nSecond line with a fact: 42 bolts.\n".encode()
    p = write(tmp_path, "notes.txt", data)
    doc = load_document(p)
    assert doc.text == "First line.\nSecond line with a fact: 42 bolts."
    assert doc.title == "notes"
    assert doc.kind == "txt"
    assert doc.sha256 == hashlib.sha256(data).hexdigest()
    assert Path(doc.path).is_absolute() and Path(doc.path) == p.resolve()
    assert doc.pages == [] and doc.page_at(3) is None
    assert doc.meta["encoding"] == "utf-8"


def test_same_bytes_same_sha_different_bytes_different(tmp_path):
    a = load_document(write(tmp_path, "a.txt", "same text"))
    b = load_document(write(tmp_path, "b.txt", "same text"))
    c = load_document(write(tmp_path, "c.txt", "same text\n"))
    assert a.sha256 == b.sha256 != c.sha256


def test_utf8_bom_is_dropped(tmp_path):
    doc = load_document(write(tmp_path, "bom.txt", b"\xef\xbb\xbfHello BOM"))
    assert doc.text == "Hello BOM"


def test_utf16_with_bom(tmp_path):
    doc = load_document(write(tmp_path, "u16.txt", "Grüße, world".encode("utf-16")))
    assert doc.text == "Grüße, world"
    assert doc.meta["encoding"] == "utf-16"


LEGACY = [
    ("Le café de la rue Saint-André servait des crêpes et du thé. À Zürich, die Bäckerei öffnet früh; "
     "«naïve» façade — 5 € pour une crème brûlée.", "cp1252"),
    ("Grüße aus München, schöne Straße! Ça coûte très cher, señor.", "latin-1"),
    ("naïve café", "latin-1"),
    ("Zażółć gęślą jaźń. Pchnąć w tę łódź jeża lub ośm skrzyń fig. Dzień dobry, jak się masz?", "cp1250"),
    ("Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, как дела?", "cp1251"),
]


@pytest.mark.parametrize("text,encoding", LEGACY, ids=[e for _, e in LEGACY])
def test_legacy_encodings_decoded(tmp_path, text, encoding):
    doc = load_document(write(tmp_path, "legacy.txt", text.encode(encoding)))
    assert doc.text == text
    assert doc.meta["encoding"] != "utf-8"


def test_normalization_nfc_controls_newlines_blank_runs(tmp_path):
    raw = "Cafe\u0301 one\r\ntwo\rthree\x07\x1b[0m\tTAB\x00\u200bkeep\n\n\n\n  \n\nfour\x0cfive\u2028six"
    doc = load_document(write(tmp_path, "n.md", raw.replace("\x00", "")))  # NUL would mean binary
    assert doc.text == "Café one\ntwo\nthree[0m\tTAB\u200bkeep\n\nfour\nfive\nsix"
    assert "\u0301" not in doc.text and "\r" not in doc.text


def test_normalize_text_unit():
    assert normalize_text("  a\n\n\n\nb\n\n c  \n") == "a\n\nb\n\n c"
    assert normalize_text("x\x85y\u2029z") == "x\ny\n\nz"
    assert normalize_text("\ufeffA\u0308") == "Ä"


# -------------------------------------------------------------------------------------- markdown
def test_markdown_title_and_text_kept(tmp_path):
    raw = "Intro line before heading.\n\n```\n# not a title\n```\n\n# Real Title #\n\n## Part\n\n| a | b |\n|---|---|\n"
    doc = load_document(write(tmp_path, "guide.markdown", raw))
    assert doc.kind == "md"
    assert doc.title == "Real Title"
    assert doc.text == raw.strip()


def test_markdown_without_heading_uses_stem(tmp_path):
    doc = load_document(write(tmp_path, "plain-notes.md", "## Only a level-2 heading\ntext"))
    assert doc.title == "plain-notes"


# ------------------------------------------------------------------------------------------ html
HTML = """<!DOCTYPE html><html><head><title>  Pump
 Page </title><style>.leak-style { color: red }</style>
<script>var leakScript = "secret-js";</script></head>
<body><nav>Home | About</nav><article><h1>Tidal Pump</h1>
<p>The pump moves 40 litres per second at a head of 12 metres. It was designed in Bergen in 2017 and
has been sold in eleven countries since then.</p>
<table><tr><th>Model</th><th>Flow</th></tr><tr><td>TX-40</td><td>40 l/s</td></tr></table>
<p>Maintenance is due every 2,000 hours of operation, or once a year, whichever comes first.</p>
</article><script>document.write("inline-leak")</script></body></html>"""


def test_html_main_text_without_scripts_or_styles(tmp_path):
    doc = load_document(write(tmp_path, "pump.html", HTML))
    assert doc.kind == "html" and doc.title == "Pump Page"
    assert "40 litres per second" in doc.text and "2,000 hours" in doc.text
    assert "TX-40" in doc.text  # tables kept
    for leak in ("leak-style", "color: red", "secret-js", "inline-leak", "leakScript"):
        assert leak not in doc.text


def test_html_fallback_when_trafilatura_gives_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "_trafilatura_text", lambda raw: None)
    doc = load_document(write(tmp_path, "pump.htm", HTML))
    assert doc.meta["extractor"] == "html.parser"
    assert "40 litres per second" in doc.text and "TX-40" in doc.text
    assert "secret-js" not in doc.text and "leak-style" not in doc.text and "inline-leak" not in doc.text


def test_tiny_html_page_loads(tmp_path):
    doc = load_document(write(tmp_path, "tiny.html", "<html><body><p>Hi there.</p></body></html>"))
    assert doc.text == "Hi there."
    assert doc.title == "tiny"


# ------------------------------------------------------------------------------------------- pdf
def test_pdf_pages_spans_and_title(tmp_path):
    pages = [["Page one alpha.", "Second line."], ["Page two beta."], [], ["Page four delta."]]
    doc = load_document(write(tmp_path, "t.pdf", text_pdf(pages, title="Spec Sheet")))
    assert doc.kind == "pdf" and doc.title == "Spec Sheet" and doc.meta["n_pages"] == 4
    assert [s.page for s in doc.pages] == [1, 2, 3, 4]
    got = [doc.text[s.start:s.end] for s in doc.pages]
    assert got == ["Page one alpha.\nSecond line.", "Page two beta.", "", "Page four delta."]
    assert doc.text == "Page one alpha.\nSecond line.\n\nPage two beta.\n\nPage four delta."
    assert doc.page_at(doc.text.index("beta")) == 2
    assert doc.page_at(doc.text.index("delta")) == 4
    assert doc.page_at(len(doc.text)) == 4


def test_pdf_without_metadata_title_uses_stem(tmp_path):
    doc = load_document(write(tmp_path, "report-2024.pdf", text_pdf([["Hello."]])))
    assert doc.title == "report-2024"


def test_pdf_with_empty_user_password_opens(tmp_path):
    data = encrypted(text_pdf([["Secret but open."]]), user="")
    assert pypdf.PdfReader(io.BytesIO(data)).is_encrypted
    assert load_document(write(tmp_path, "open.pdf", data)).text == "Secret but open."


# ---------------------------------------------------------------------------------------- errors
ERROR_CASES = {
    "empty": ("empty.txt", lambda: b"", "no text"),
    "whitespace": ("blank.md", lambda: b" \n\t\r\n   \n", "no text"),
    "nul_bytes": ("nul.txt", lambda: b"hello\x00world\x00" * 20, "binary"),
    "control_bytes": ("ctl.txt", lambda: bytes(range(1, 32)) * 40 + b"abc", "binary"),
    "binary_no_nul": ("img.txt", lambda: bytes(range(1, 256)) * 20, "binary"),
    "binary_html": ("page.html", lambda: b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 10, "binary"),
    "truncated_pdf": ("cut.pdf", lambda: text_pdf([["Some text here."]])[:150], "corrupt"),
    "garbage_pdf": ("junk.pdf", lambda: b"%PDF-1.4\n\x01\x02 not really a pdf " * 5, "corrupt"),
    "not_a_pdf": ("fake.pdf", lambda: b"just some text", "corrupt"),
    "encrypted_pdf": ("locked.pdf", lambda: encrypted(text_pdf([["Top secret."]]), user="pw"), "password"),
    "image_only_pdf": ("scan.pdf", image_pdf, "OCR"),
    "blank_page_pdf": ("blank.pdf", lambda: text_pdf([[], []]), "no text layer"),
    "docx": ("report.docx", lambda: b"PK\x03\x04 zipped", "unsupported"),
    "no_extension": ("README", lambda: b"text", "unsupported"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_load_errors(tmp_path, case):
    name, make, needle = ERROR_CASES[case]
    p = write(tmp_path, name, make())
    with pytest.raises(LoadError) as info:
        load_document(p)
    err = info.value
    assert isinstance(err, ValueError)
    assert name in str(err) and err.path == str(p)
    assert needle.lower() in str(err).lower()


def test_unsupported_lists_supported_extensions(tmp_path):
    with pytest.raises(LoadError) as info:
        load_document(write(tmp_path, "slides.pptx", b"x"))
    for ext in SUPPORTED_EXTENSIONS:
        assert ext in str(info.value)


def test_missing_path_and_directory(tmp_path):
    with pytest.raises(LoadError, match="no such file.*check the path"):
        load_document(tmp_path / "nowhere.txt")
    with pytest.raises(LoadError, match="no such file or directory"):  # not "unsupported file type"
        load_document(tmp_path / "mistyped_folder")
    (tmp_path / "folder.md").mkdir()
    with pytest.raises(LoadError, match="directory"):
        load_document(tmp_path / "folder.md")


def test_unreadable_file(tmp_path):
    p = write(tmp_path, "secret.txt", "hidden")
    p.chmod(0)
    try:
        if _can_read(p):
            pytest.skip("running as a user that ignores file permissions (root)")
        with pytest.raises(LoadError, match="cannot read"):
            load_document(p)
    finally:
        p.chmod(0o644)


def _can_read(p: Path) -> bool:
    try:
        p.read_bytes()
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------ iter_paths
def test_iter_paths(tmp_path):
    for rel in ["b.txt", "a.md", "sub/c.pdf", "sub/deeper/d.html", "sub/skip.docx", ".hidden.txt",
                ".git/e.txt", "sub/.cache/f.md", "UPPER.HTM"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    explicit = tmp_path / "sub" / "skip.docx"
    missing = tmp_path / "missing.txt"
    got = iter_paths([tmp_path, explicit, missing, tmp_path / "a.md"])
    rel = [p.relative_to(tmp_path).as_posix() for p in got]
    assert rel == ["UPPER.HTM", "a.md", "b.txt", "sub/c.pdf", "sub/deeper/d.html", "sub/skip.docx",
                   "missing.txt"]
    assert iter_paths(str(tmp_path / "b.txt")) == [tmp_path / "b.txt"]


# -------------------------------------------------------------------------------------- sample
def test_sample_documents_load():
    docs = {p.name: load_document(p) for p in iter_paths([SAMPLE / "docs"])}
    assert sorted(docs) == ["maintenance_log.txt", "product_page.html", "service_bulletin.pdf", "sl30_manual.md"]
    assert {d.kind for d in docs.values()} == {"txt", "md", "pdf", "html"}
    assert docs["sl30_manual.md"].title == "Korvel SL-30 Solar Kiln: Owner's Manual"
    assert docs["product_page.html"].title == "Korvel SL-30 Solar Kiln | Models and Prices"
    assert docs["service_bulletin.pdf"].title.startswith("Service Bulletin SB-2024-07")
    assert len(docs["service_bulletin.pdf"].pages) == 3
    html = docs["product_page.html"].text
    assert "canary" not in html and "ff00aa" not in html and "KORVEL_TRACKING" not in html
    assert "EUR 6,900" in html  # table cell
    for name, lo in [("sl30_manual.md", 1000), ("maintenance_log.txt", 600), ("product_page.html", 450),
                     ("service_bulletin.pdf", 400)]:
        assert len(docs[name].text.split()) >= lo, name


def test_sample_questions_answerable_from_their_source():
    docs = {p.name: load_document(p) for p in iter_paths([SAMPLE / "docs"])}
    rows = [json.loads(line) for line in (SAMPLE / "questions.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 6
    assert {r["source"] for r in rows} == set(docs)
    for row in rows:
        doc = docs[row["source"]]
        for answer in row["answers"]:
            assert answer in doc.text, (row["question"], answer)
            if row["page"] is not None:
                assert doc.page_at(doc.text.index(answer)) == row["page"], row["question"]
    pdf_only = [r for r in rows if r["source"] == "service_bulletin.pdf"]
    for row in pdf_only:  # some facts live only in the PDF
        others = [d.text for n, d in docs.items() if n != "service_bulletin.pdf"]
        assert not any(row["answers"][0] in t for t in others)


def test_sample_pdf_is_reproducible(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_pdf", SAMPLE / "make_pdf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["make_pdf.py", str(tmp_path / "out.pdf")])
    assert (tmp_path / "out.pdf").read_bytes() == (SAMPLE / "docs" / "service_bulletin.pdf").read_bytes()
