"""The text BM25 indexes and searches: compatibility-folded, with CJK runs split into character bigrams.

SQLite FTS5's ``unicode61`` tokenizer splits on non-letters, so a run of Chinese or Japanese characters
(written without spaces) is one token: a query for 预算 would have to match a whole sentence. And it does
not fold compatibility characters, so "ﬁ" (U+FB01, common in PDFs typeset with ligatures) never
matches "fi". `search_text` rewrites a chunk's text (and `search_terms` a question) before FTS5 sees it:

- NFKC (Unicode compatibility composition): ligatures (ﬁ ﬂ ﬃ ...), full-width Latin and digits
  (ＡＢＣ１２３), half-width katakana, superscripts, circled numbers and other presentation forms become
  their plain letters. This is the ``nfkc_cf`` normalization search engines apply before indexing
  (Elasticsearch's ``icu_normalizer``, Lucene's ``ICUNormalizer2Filter``). It is applied only to the
  searchable copy: the stored chunk text, its citation spans and what the LLM reads keep the loader's
  text (where `loaders.fold_ligatures` already folded the Latin ligatures, the one fold that never
  changes meaning).
- CJK: each maximal run of Han, Hiragana, Katakana or Hangul characters becomes its overlapping
  character bigrams (预算搬迁 -> 预算 算搬 搬迁), a run of one character that character; this is what
  Lucene's ``CJKAnalyzer`` (``CJKBigramFilter``) does, and it needs no dictionary or segmenter for any
  of the three languages. Text outside CJK runs is unchanged, so English is tokenized exactly as before.

Why bigrams rather than FTS5's ``trigram`` tokenizer or a segmenter (jieba): trigram also changes how
English is matched (substrings, no stemming), so the NQ recall in docs/results.md would move, and it
cannot match a two-character word (most Chinese words are two characters); a segmenter covers one
language and its dictionary decides what can be found. Bigrams find every two-character word and rank
longer ones by how many of their bigrams match.
"""

from __future__ import annotations

import re
import unicodedata

# Han (CJK Unified Ideographs, Extension A, Compatibility Ideographs, Extensions B-F), Hiragana, Katakana
# (with phonetic extensions), Hangul syllables and jamo. The iteration marks 々 and ー belong to words.
_CJK_RANGES = (
    "\u3005\u3006\u3007\u303b"  # 々 〆 〇 〻
    "\u3040-\u309f"  # Hiragana
    "\u30a0-\u30ff"  # Katakana (incl. ー)
    "\u31f0-\u31ff"  # Katakana phonetic extensions
    "\u3400-\u4dbf"  # CJK Extension A
    "\u4e00-\u9fff"  # CJK Unified Ideographs
    "\uf900-\ufaff"  # CJK Compatibility Ideographs
    "\u1100-\u11ff\u3130-\u318f\uac00-\ud7af"  # Hangul jamo, compatibility jamo, syllables
    "\U00020000-\U0002ebef"  # Extensions B-F
)
_CJK_RUN = re.compile(f"[{_CJK_RANGES}]+")
_CJK_CHAR = re.compile(f"[{_CJK_RANGES}]")
_WORD = re.compile(r"\w+", re.UNICODE)


def has_cjk(text: str) -> bool:
    """Whether `text` holds at least one Han, Kana or Hangul character."""
    return _CJK_CHAR.search(text) is not None


def cjk_bigrams(run: str) -> list[str]:
    """Overlapping character bigrams of a run of CJK characters; a single character stays itself."""
    if len(run) < 2:
        return [run] if run else []
    return [run[i:i + 2] for i in range(len(run) - 1)]


def _split_cjk(text: str) -> str:
    return _CJK_RUN.sub(lambda m: " " + " ".join(cjk_bigrams(m.group())) + " ", text)


def search_text(text: str) -> str:
    """The searchable copy of a chunk's text: NFKC-folded, CJK runs as space-separated bigrams.

    Idempotent on text without CJK (NFKC is), so indexing it twice gives the same tokens.
    """
    return _split_cjk(unicodedata.normalize("NFKC", text))


def search_terms(query: str) -> list[str]:
    """A question's search terms in the form `search_text` indexes them: NFKC, lower-cased, ``\\w+``
    words, each CJK run as its bigrams (a lone CJK character kept as a unigram); order kept, duplicates
    dropped. Stopword filtering is the caller's (`indexes.store.fts_query`)."""
    terms: list[str] = []
    for word in _WORD.findall(_split_cjk(unicodedata.normalize("NFKC", query).lower())):
        if word not in terms:
            terms.append(word)
    return terms
