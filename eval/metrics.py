"""QA metrics.

`normalize_answer` is SQuAD v1.1's normalization (Rajpurkar et al. 2016, the official evaluate script):
lower-case, remove punctuation, remove the articles a/an/the, fold white space.
`best_subspan_em` is the metric of "Lost in the Middle" (Liu et al. 2023, TACL): 1.0 when any normalized
gold answer occurs inside the normalized prediction.
`token_f1` is SQuAD's token-level F1 (max over gold answers).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower, drop punctuation, drop articles (a, an, the), fold white space."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _norm_unicode(s: str) -> str:
    return unicodedata.normalize("NFC", s)


def best_subspan_em(prediction: str, answers: list[str]) -> float:
    """1.0 if some normalized gold answer is a substring of the normalized prediction, else 0.0.

    Empty gold answers (after normalization) never match. Raises ValueError when `answers` is empty.
    """
    if not answers:
        raise ValueError("answers is empty: best_subspan_em needs at least one gold answer")
    pred = normalize_answer(_norm_unicode(prediction))
    for a in answers:
        g = normalize_answer(_norm_unicode(a))
        if g and g in pred:
            return 1.0
    return 0.0


def exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 if the normalized prediction equals some normalized gold answer (SQuAD EM)."""
    if not answers:
        raise ValueError("answers is empty: exact_match needs at least one gold answer")
    pred = normalize_answer(_norm_unicode(prediction))
    return float(any(pred == normalize_answer(_norm_unicode(a)) for a in answers))


def token_f1(prediction: str, answers: list[str]) -> float:
    """SQuAD token F1 between the normalized prediction and each gold answer; the max is returned."""
    if not answers:
        raise ValueError("answers is empty: token_f1 needs at least one gold answer")
    pred = normalize_answer(_norm_unicode(prediction)).split()
    best = 0.0
    for a in answers:
        gold = normalize_answer(_norm_unicode(a)).split()
        common = Counter(pred) & Counter(gold)
        same = sum(common.values())
        if not pred or not gold:
            score = float(pred == gold)
        elif same == 0:
            score = 0.0
        else:
            p, r = same / len(pred), same / len(gold)
            score = 2 * p * r / (p + r)
        best = max(best, score)
    return best
