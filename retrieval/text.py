"""Text normalisation shared by the product and the evaluation.

`normalize_answer` is SQuAD v1.1's rule (evaluate-v1.1.py, Rajpurkar et al. 2016): the citations find an
answer's span in a passage with it (`ldqa.app.citations`), and the metrics compare answers with it
(`ldqa.eval.metrics` re-exports it). It lives here, below both, so the product never imports `eval`.

    normalize_answer("The  Eiffel Tower!") == "eiffel tower"
"""

from __future__ import annotations

import re
import string

_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 normalization (`normalize_answer` of evaluate-v1.1.py), unchanged: lower-case, drop ASCII
    punctuation, drop the whole words a/an/the, fold white space. May return "" (e.g. for "The" or "*");
    the metrics then fall back as `ldqa.eval.metrics` describes."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())
