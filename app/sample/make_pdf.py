"""Write app/sample/docs/service_bulletin.pdf: a 3-page PDF with a real text layer, no dependencies.

The PDF is assembled by hand from the standard objects (catalog, page tree, pages, content streams,
the built-in Helvetica fonts with WinAnsiEncoding, an Info dictionary with /Title) and a byte-exact
cross-reference table, so any reader, pypdf included, can extract its text. The output is
deterministic (no dates), so re-running the script reproduces the committed file byte for byte.

Usage: ``python app/sample/make_pdf.py [OUTPUT]``.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

TITLE = "Service Bulletin SB-2024-07: Circulation fan hub retention"
PAGE_W, PAGE_H = 595, 842  # A4 in points (1/72 inch)
MARGIN = 64  # points
BODY_SIZE, HEAD_SIZE, LEADING = 10.5, 14, 15  # points
WRAP_CHARS = 88  # characters per body line at BODY_SIZE Helvetica within the margins

# One list per page; "# " starts a heading, every other string is a paragraph (wrapped).
PAGES: list[list[str]] = [
    [
        "# Korvel Drying Systems - Service Bulletin SB-2024-07",
        "Subject: Circulation fan hub retention on SL-30 solar kilns.",
        "Issue date: 22 July 2024. Revision 2. Category: mandatory for owners of affected kilns.",
        "# Summary",
        "On some SL-30 kilns assembled in July 2022 the hub of a KV-FAN-220 circulation fan can work "
        "loose on its shaft after several hundred operating hours. The first sign is a rattling noise at "
        "full fan speed, followed by an E-21 fan current warning on the KC-5 controller. If the kiln keeps "
        "running, the impeller can strike the fan housing and crack.",
        "Korvel traced the fault to a batch of hub bolts that were fitted without thread-locking compound "
        "at the Aberlour works. No injuries have been reported. Eleven owners reported noisy fans before "
        "the cause was found.",
        "# Action required",
        "Owners of an affected kiln must carry out the procedure on page 2, or have a Korvel technician "
        "do it, within 90 days of the issue date, that is by 20 October 2024. Until then, do not run "
        "Schedule F (sterilisation), because it holds both fans at full speed for long periods.",
        "The affected serial numbers are listed on page 3. The serial number is on the rating plate on "
        "the left door post.",
    ],
    [
        "# Procedure: re-securing the fan hub",
        "Time needed: about 1.5 hours for both fans. Tools: 13 mm socket, torque wrench with a range "
        "of at least 10 to 30 Nm, wire brush, clean cloth.",
        "Parts: kit KFK-07, supplied free of charge. The kit holds eight new M8 hub bolts, eight "
        "hardened washers with part code KW-08S, and one tube of Korvel KL-243 medium-strength "
        "thread-locking compound.",
        "1. Stop any running schedule and isolate the power at the wall switch. Wait 10 minutes for the "
        "fans to stop and the heater to cool.",
        "2. Remove the six screws of the fan access panel above the door and lift the panel off.",
        "3. Hold the impeller still with a cloth and remove the four M8 hub bolts of the first fan. "
        "Discard the old bolts and washers.",
        "4. Clean the threads in the hub with the wire brush. Put one drop of KL-243 on each new bolt.",
        "5. Fit the new bolts with the KW-08S washers and tighten them in a diagonal pattern.",
        "Tighten each hub bolt to 18 Nm. Do not exceed 22 Nm; the hub casting can crack.",
        "6. Repeat steps 3 to 5 for the second fan. Refit the access panel.",
        "7. Restore power and run the fan test from the controller menu (Service > Fans). Both fans must "
        "reach full speed within 20 seconds with no rattle and no E-21 warning.",
        "8. Write the date and SB-2024-07 in the kiln maintenance log.",
    ],
    [
        "# Affected kilns",
        "Affected serial numbers: SL30-2207-0001 to SL30-2207-0450.",
        "Kilns assembled in other months, including all kilns with serial numbers beginning SL30-2206 or "
        "SL30-2208, are not affected and need no action. Kilns assembled from August 2022 onwards have "
        "pre-coated hub bolts fitted at the works.",
        "# Reimbursement",
        "Korvel reimburses owners who do the work themselves at a flat rate of 1.5 labour hours, "
        "EUR 62 per hour, on receipt of the completed bulletin form and a photograph of the tightened "
        "hubs. Claims must reach Korvel by 30 November 2024.",
        "Owners who prefer a technician visit can book one through the service desk on "
        "+44 1340 880 215. The visit is free of charge within 300 km of Aberlour.",
        "# Contact",
        "Korvel Drying Systems Ltd., Service Department, Aberlour. E-mail: service@korvel.example. "
        "Bulletin author: Tomas Greve, field service engineer.",
    ],
]


def build_pdf(pages: list[list[str]], title: str) -> bytes:
    """Bytes of a PDF with one page per entry of `pages` (see `PAGES` for the format)."""
    n_pages = len(pages)
    # object numbers: 1 catalog, 2 page tree, 3 Helvetica, 4 Helvetica-Bold, 5 info, then page/content pairs
    page_ids = [6 + 2 * i for i in range(n_pages)]
    objects: dict[int, bytes] = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        2: b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % i for i in page_ids)
           + b"] /Count %d >>" % n_pages,
        3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
        4: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica-Bold /Encoding /WinAnsiEncoding >>",
        5: b"<< /Title " + _pdf_string(title) + b" /Producer (ldqa app/sample/make_pdf.py) >>",
    }
    for page_id, blocks in zip(page_ids, pages):
        stream = _content_stream(blocks)
        objects[page_id] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %d %d] " % (PAGE_W, PAGE_H)
                            + b"/Resources << /Font << /F1 3 0 R /F2 4 0 R >> >> /Contents %d 0 R >>"
                            % (page_id + 1))
        objects[page_id + 1] = b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"
    return _assemble(objects)


def _content_stream(blocks: list[str]) -> bytes:
    lines: list[bytes] = [b"BT", b"%d TL" % LEADING, b"%d %d Td" % (MARGIN, PAGE_H - MARGIN)]
    for block in blocks:
        if block.startswith("# "):
            lines += [b"T*", b"/F2 %g Tf" % HEAD_SIZE, _pdf_string(block[2:]) + b" Tj", b"T*"]
            continue
        lines.append(b"/F1 %g Tf" % BODY_SIZE)
        for text_line in textwrap.wrap(block, WRAP_CHARS, break_on_hyphens=False):
            lines.append(_pdf_string(text_line) + b" Tj T*")
        lines.append(b"T*")
    lines.append(b"ET")
    return b"\n".join(lines)


def _pdf_string(text: str) -> bytes:
    if not all(32 <= ord(ch) < 127 for ch in text):
        raise ValueError(f"only printable ASCII is supported in the sample PDF: {text!r}")
    escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
    return b"(" + escaped.encode("ascii") + b")"


def _assemble(objects: dict[int, bytes]) -> bytes:
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = {}
    for num in sorted(objects):
        offsets[num] = len(out)
        out += b"%d 0 obj\n" % num + objects[num] + b"\nendobj\n"
    xref_at = len(out)
    size = max(objects) + 1
    out += b"xref\n0 %d\n0000000000 65535 f \n" % size
    for num in range(1, size):
        out += b"%010d 00000 n \n" % offsets[num]
    out += b"trailer\n<< /Size %d /Root 1 0 R /Info 5 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, xref_at)
    return bytes(out)


def main(argv: list[str]) -> None:
    target = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / "docs" / "service_bulletin.pdf"
    target.write_bytes(build_pdf(PAGES, TITLE))
    print(f"wrote {target} ({target.stat().st_size} bytes, {len(PAGES)} pages)")


if __name__ == "__main__":
    main(sys.argv)
