"""NQ-open data for benchmarks: the oracle file and multi-document examples built from it.

Multi-document construction ("NQ-open multi-doc, distractors = other questions' gold passages that do not
contain an answer"): the Lost in the Middle study (Liu et al. 2023) drew distractors from a retriever's
results, which are not in `../shared/data`; here, for question i, distractors are sampled (seeded) from
the gold passages of the *other* questions, skipping any passage whose normalized text contains one of
question i's normalized answers, and the gold passage is put at the requested position.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from ldqa.eval.metrics import normalize_answer

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "nq-open-oracle.jsonl.gz"


def load_nq(path: Path = DEFAULT_DATA) -> list[dict]:
    """Records {question, answers, title, text} of the NQ-open oracle file (gold passage = ctxs[0]).

    Raises FileNotFoundError naming the path when it is missing.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"NQ-open data file {path} not found; pass --data PATH")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            gold = r["ctxs"][0]
            out.append({"question": r["question"], "answers": r["answers"], "title": gold["title"],
                        "text": gold["text"]})
    return out


def multidoc_example(records: list[dict], i: int, n_passages: int, gold_position: int, seed: int) -> dict:
    """Question i with `n_passages` passages, its gold passage at 1-based `gold_position`.

    Returns {question, answers, passages: [{title, text}], gold_position}. Deterministic for
    (i, n_passages, seed): the distractor set does not depend on the gold position, so sweeping the
    position keeps everything else fixed. Raises ValueError on a position outside 1..n_passages.
    """
    if not 1 <= gold_position <= n_passages:
        raise ValueError(f"gold_position must be in 1..{n_passages}, got {gold_position}")
    r = records[i]
    answers = [a for a in (normalize_answer(x) for x in r["answers"]) if a]
    rng = random.Random(f"{seed}:{i}:{n_passages}")
    distractors, seen = [], {r["text"]}
    while len(distractors) < n_passages - 1:
        j = rng.randrange(len(records))
        cand = records[j]
        if j == i or cand["text"] in seen:
            continue
        norm = normalize_answer(cand["text"])
        if any(a in norm for a in answers):
            continue
        seen.add(cand["text"])
        distractors.append({"title": cand["title"], "text": cand["text"]})
    passages = distractors[: gold_position - 1] + [{"title": r["title"], "text": r["text"]}] + \
        distractors[gold_position - 1:]
    return {"question": r["question"], "answers": r["answers"], "passages": passages,
            "gold_position": gold_position}
