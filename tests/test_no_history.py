"""No development history in the product: README.md, the docs and the Python sources say what ldqa does
and why, and link the topic page for the measurement behind a choice; how the code got there lives in git
log and the issue notes, not in a comment: no session or issue numbers, no phrases that narrate how the code
used to be (`PATTERNS`). Dates, version numbers and measurements with their commands are fine.

Checked: README.md, every docs/**/*.md and every *.py of the packages (app, attention, eval, indexes,
kernels, retrieval, tests, ldqa) and the repository root.

The patterns want a number after "session"/"issue", so the Gradio session, a session-scoped fixture, and
"issue" as a verb or in "issue date" pass."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "attention", "eval", "indexes", "kernels", "retrieval", "tests", "ldqa")

# (written so that this file's own text matches none of them)
PATTERNS = {
    "a session number": r"\b[Ss]essions?[\s-]+\d+",
    "an issue number": r"\b[Ii]ssues?[\s-]+#?\d+",
    "until + now": r"\b[Uu]ntil\s+now\b",
    "first + version": r"\b[Ff]irst\s+version\b",
    "X + used + to": r"\b(?:that|which|it|ldqa|this)\s+used\s+to\b",
    "was X + comma + now Y": r"\b(?:was|were)\s[^.;\n]{1,60},\s+now\b",
    "was X in brackets": r"\((?:was|were)\s",
    "a session or turn before this one": r"\b(?:earlier|previous)\s+sessions?\b|\ba\s+turn\s+ago\b",
}
HISTORY = re.compile("|".join(f"(?:{p})" for p in PATTERNS.values()))


def checked_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("*.py"))]
    for pkg in PACKAGES:
        files += sorted(p for p in (ROOT / pkg).rglob("*") if p.suffix in (".py", ".c", ".h")
                        and "__pycache__" not in p.parts)
    return files


def history_references(text: str) -> list[tuple[int, str]]:
    """(line, matched text) of every development-history reference in `text`."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split())) for m in HISTORY.finditer(text)]


# Templates, so that this file itself holds no reference: the number n and the space s are filled in below.
CAUGHT = ["the study, complete in session {n}", "Sessions {n}-9 oldest first", "results.md session-{n} section",
          "docs/results.md, issue {n})", "(Issue #{n})", "issues {n} and 6", "the model ran in fp32 until{s}now",
          "the first{s}version of the kernel", "documents that{s}used to give wrong results",
          "api.py was {n} lines,{s}now 683", "683 lines (was{s}{n})", "as in earlier{s}sessions",
          "23 KB a turn{s}ago", "docs/results.md, issue\n{n}"]
PASSED = ["every browser session uses the one collection", "a 10-question session", "per-session data",
          '@pytest.fixture(scope="session")', "within 90 days of the issue date", "the issues it raises",
          "reuse an earlier run's store", "Used to recompute some tokens", "stored before or encoded just now",
          "Qwen2.5 1.5B, measured 2026-12-04 with ldqa 0.3.1", "GGUF version 3", "store schema 2"]


@pytest.mark.parametrize("text", CAUGHT)
def test_patterns_catch_history(text):
    assert history_references(text.format(n=26, s=" ")), text


@pytest.mark.parametrize("text", PASSED)
def test_patterns_pass_product_words(text):
    assert not history_references(text), text


def test_checked_files_cover_the_product():
    names = {p.relative_to(ROOT).as_posix() for p in checked_files()}
    assert {"README.md", "docs/kernels.md", "app/api.py", "attention/debias.py", "tests/test_no_history.py",
            "kernels/q8_0.c", "kernels/gguf_blocks.h"} <= names
    assert "docs/results.md" in names and not any(n.startswith(".venv/") for n in names)


def test_no_development_history_in_the_product():
    found = [f"{p.relative_to(ROOT)}:{line}: {hit!r}" for p in checked_files()
             for line, hit in history_references(p.read_text(encoding="utf-8"))]
    assert not found, ("development history in the product (say what the code does and why, or link the topic "
                       "page; git log keeps the history):\n" + "\n".join(found))
