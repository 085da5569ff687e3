"""QA metrics: SQuAD exact match and token F1, LongBench QA F1, Lost in the Middle best-subspan EM.

Reference scripts followed (re-implemented, not copied):

- SQuAD v1.1 `evaluate-v1.1.py` (Rajpurkar et al. 2016): `normalize_answer` (lower-case, drop ASCII
  punctuation, drop the whole words a/an/the, fold white space), `exact_match_score` (normalized strings
  equal), `f1_score` (bag-of-tokens F1 of the normalized strings), max over the gold answers.
- LongBench `metrics.py` (THUDM/LongBench): `qa_f1_score` is the SQuAD normalization + token F1 above;
  `qa_f1_zh_score` cuts Chinese with `jieba`, normalizes each piece with `normalize_zh_answer` (lower,
  drop ASCII and CJK punctuation, drop all white space) and drops empty pieces.
- Lost in the Middle `best_subspan_em` (nelson-liu/lost-in-the-middle, src/lost_in_the_middle/metrics.py,
  Liu et al. 2023, TACL): 1.0 when some SQuAD-normalized gold answer is a substring of the
  SQuAD-normalized prediction.

On ordinary English answers the three public functions give exactly the reference numbers. They deviate,
on purpose, in three documented places (docs/documents-and-limits.md, "Metrics"):

1. Answers that normalize to nothing. SQuAD's normalization turns "the", "an", "A" and "*" into "", so
   the references score "the" vs "an" as EM 1 (and Lost in the Middle's `"" in prediction` is true for
   every prediction). Here each gold answer is normalized at the first of three levels that leaves it at
   least one token, and the prediction is normalized at that same level (the same for EM, F1 and
   best-subspan EM):

   - level 0, SQuAD: `normalize_answer` (the reference rule; every gold with a non-article word);
   - level 1, articles kept: NFC, lower-case, ASCII punctuation dropped, white space folded;
   - level 2, punctuation kept: NFC, lower-case, white space folded.

   A gold that is empty or only white space never matches (0.0). A prediction with no token at the gold's
   level scores 0.0 (an empty prediction never scores 1; "The" against gold "The Who" is 0, as in SQuAD
   v1.1). So "the" vs "an" -> 0, "A" vs "A" -> 1, "*" vs "*" -> 1. At levels 1 and 2 best-subspan EM
   needs the gold tokens as a run of whole prediction tokens (gold "a" does not match inside "cat", gold
   "*" not inside "**bold**"), whereas at level 0 it is the reference's plain substring test. Because the
   level is chosen by the gold alone, scores against a gold that keeps a word under SQuAD's rule are the
   reference's (up to rule 2). The references' F1 for two empty strings is 0 (SQuAD v1.1) or 1 (SQuAD v2.0
   `compute_f1`); that case never reaches the F1 formula here.

2. CJK text is scored per character, the `jieba`-free version of LongBench's `qa_f1_zh_score`: after
   normalization each CJK character (Han ideographs, kana, Hangul) is a token of its own, Latin text
   keeps its white-space words ("abc北京" -> [abc, 北, 京]), and CJK punctuation and symbols (the CJK
   Symbols and Punctuation block, fullwidth ASCII punctuation, the kana middle dot, ...) are dropped at
   levels 0 and 1 and act as token separators. So `token_f1("北京市", ["北京"])` = 2 (2/3 * 1) / (2/3 + 1)
   = 0.8. The same tokens are used whatever the gold's language (a CJK run inside an English prediction
   is split per character too). Unlike LongBench's Chinese normalization, the general-punctuation marks
   (em dash, curly quotes, ellipsis) are kept, as SQuAD keeps them for English. EM compares the token
   lists, which for text without CJK is the reference's string equality; best-subspan EM compares the
   tokens joined by single spaces, which for text without CJK is the reference's normalized string.

3. Unicode: both sides are NFC-normalized first, so a decomposed accent (e + U+0301) equals the composed
   one.

`normalize_answer` itself stays the plain SQuAD rule (other modules use it for matching text).
"""

from __future__ import annotations

import string
import unicodedata
from collections import Counter

from ldqa.retrieval.text import normalize_answer  # re-exported: it lives below eval/ (the product uses it)

_PUNCT = set(string.punctuation)

# (first, last) code points treated as CJK. Inside them a character of Unicode category P* or S* is CJK
# punctuation; any other is a CJK character (one token each). Fullwidth forms are handled in _cjk_kind.
_CJK_RANGES = (
    (0x1100, 0x11FF),    # Hangul Jamo
    (0x3000, 0x303F),    # CJK Symbols and Punctuation (。、「」; 々 and 〇 are characters)
    (0x3040, 0x30FF),    # Hiragana, Katakana (ー is a character, ・ punctuation)
    (0x3130, 0x318F),    # Hangul Compatibility Jamo
    (0x31F0, 0x31FF),    # Katakana Phonetic Extensions
    (0x3400, 0x4DBF),    # CJK Unified Ideographs Extension A
    (0x4E00, 0x9FFF),    # CJK Unified Ideographs
    (0xA960, 0xA97F),    # Hangul Jamo Extended-A
    (0xAC00, 0xD7FF),    # Hangul Syllables, Hangul Jamo Extended-B
    (0xF900, 0xFAFF),    # CJK Compatibility Ideographs
    (0xFE30, 0xFE4F),    # CJK Compatibility Forms
    (0x20000, 0x2FA1F),  # CJK Extensions B-F, Compatibility Ideographs Supplement
    (0x30000, 0x323AF),  # CJK Extensions G-H
)


def _cjk_kind(ch: str) -> str | None:
    """"char" for a CJK character, "punct" for CJK punctuation or symbol, None for anything else."""
    cp = ord(ch)
    if 0xFF00 <= cp <= 0xFFEF:  # Halfwidth and Fullwidth Forms: ！，（） punctuation; ｱ halfwidth kana
        if unicodedata.category(ch)[0] in "PS":
            return "punct"
        return "char" if 0xFF66 <= cp <= 0xFFDC else None  # fullwidth Ａ/１ stay ordinary letters/digits
    for lo, hi in _CJK_RANGES:
        if lo <= cp <= hi:
            return "punct" if unicodedata.category(ch)[0] in "PS" else "char"
    return None


_LEVELS = (0, 1, 2)  # 0: SQuAD, 1: articles kept, 2: punctuation kept


def _normalize_at(s: str, level: int) -> str:
    s = unicodedata.normalize("NFC", s)
    if level == 0:
        return normalize_answer(s)
    s = s.lower()
    if level == 1:
        s = "".join(ch for ch in s if ch not in _PUNCT)
    return " ".join(s.split())


def _tokens(s: str, level: int) -> list[str]:
    """White-space words of the level's normalization, each CJK character split off as its own token;
    CJK punctuation is dropped (and separates tokens) at levels 0 and 1, kept as its own token at level 2."""
    out: list[str] = []
    for word in _normalize_at(s, level).split():
        run = ""
        for ch in word:
            kind = _cjk_kind(ch)
            if kind is None:
                run += ch
                continue
            if run:
                out.append(run)
                run = ""
            if kind == "char" or level == 2:
                out.append(ch)
        if run:
            out.append(run)
    return out


def _aligned(prediction: str, gold: str) -> tuple[list[str], list[str], int] | None:
    """(prediction tokens, gold tokens, level): the level is the first that leaves the gold a token, the
    prediction is tokenized at that level; None when the gold or the prediction has no token there."""
    for level in _LEVELS:
        g = _tokens(gold, level)
        if g:
            p = _tokens(prediction, level)
            return (p, g, level) if p else None
    return None


def _check(answers: list[str], name: str) -> None:
    if not answers:
        raise ValueError(f"answers is empty: {name} needs at least one gold answer")


def best_subspan_em(prediction: str, answers: list[str]) -> float:
    """Lost in the Middle's best-subspan EM: 1.0 if some gold answer occurs inside the prediction, else 0.0.

    Per gold answer, both sides are normalized at the gold's level (module docstring, rule 1). At level 0
    (the usual case) the test is the reference's: the normalized gold, a string, is a substring of the
    normalized prediction (CJK tokens joined by single spaces, rule 2). At levels 1 and 2 (the gold is only
    articles or punctuation) the gold's tokens must appear as a contiguous run of whole prediction tokens.
    Empty or white-space-only golds and predictions never match. Raises ValueError when `answers` is empty.
    """
    _check(answers, "best_subspan_em")
    for a in answers:
        al = _aligned(prediction, a)
        if al is None:
            continue
        p, g, level = al
        if level == 0:
            hit = " ".join(g) in " ".join(p)
        else:
            hit = f" {' '.join(g)} " in f" {' '.join(p)} "
        if hit:
            return 1.0
    return 0.0


def exact_match(prediction: str, answers: list[str]) -> float:
    """SQuAD v1.1 exact match (`exact_match_score`, max over the gold answers): 1.0 if the normalized
    prediction equals some normalized gold answer, else 0.0.

    Equality is of the token lists at the gold's level (module docstring): for text without CJK that is
    the reference's normalized-string equality; CJK compares per character ("北京 市" equals "北京市").
    An empty prediction or gold never matches, and "the" vs "an" is 0 (compared with articles kept, as the
    gold "an" is only an article).
    Raises ValueError when `answers` is empty.
    """
    _check(answers, "exact_match")
    for a in answers:
        al = _aligned(prediction, a)
        if al is not None and al[0] == al[1]:
            return 1.0
    return 0.0


def token_f1(prediction: str, answers: list[str]) -> float:
    """SQuAD v1.1 token F1 (`f1_score`) = LongBench `qa_f1_score`, with CJK per character as in LongBench's
    `qa_f1_zh_score` (without jieba); the max over the gold answers.

    F1 = 2PR / (P + R) over the bags of tokens at the gold's level (module docstring), P = common /
    len(prediction tokens), R = common / len(gold tokens); 0.0 when nothing is in common, when the gold is
    empty or white space only, or the prediction has no token at the gold's level. Raises ValueError when
    `answers` is empty.
    """
    _check(answers, "token_f1")
    best = 0.0
    for a in answers:
        al = _aligned(prediction, a)
        if al is None:
            continue
        pred, gold, _ = al
        same = sum((Counter(pred) & Counter(gold)).values())
        if same:
            p, r = same / len(pred), same / len(gold)
            best = max(best, 2 * p * r / (p + r))
    return best


def answer_in_passages(passages: list[str], answers: list[str]) -> float:
    """Whether the retrieved text holds a gold answer: 1.0 when some gold answer, normalized as the
    metrics above normalize it (its level, rule 1; CJK per character, rule 2), occurs as a run of whole
    tokens in the same normalization of one of `passages` (texts), else 0.0. Whole tokens: gold "60" is not
    found in "1960", gold "over 60" is in "got press hits in over 60 different publications". An answer
    split across two passages is not counted. Empty golds never match; no passages gives 0.0.
    Raises ValueError when `answers` is empty."""
    _check(answers, "answer_in_passages")
    for text in passages:
        for a in answers:
            al = _aligned(text, a)
            if al is not None and f" {' '.join(al[1])} " in f" {' '.join(al[0])} ":
                return 1.0
    return 0.0
