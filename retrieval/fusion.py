"""Reciprocal rank fusion of several ranked lists of chunk ids.

Method: Cormack, Clarke & Buettcher, "Reciprocal Rank Fusion outperforms Condorcet and individual Rank
Learning Methods", SIGIR 2009.  Each list contributes ``w / (k + rank)`` to every id it holds (rank is
1-based); ids absent from a list get nothing from it.  ``k = 60`` is the paper's (and LlamaIndex's)
default: it damps the weight of the very first ranks so one list cannot dominate.

Worked example (k = 60): dense = [7, 3], bm25 = [3, 9]
    id 3: 1/(60+2) + 1/(60+1) = 0.016129 + 0.016393 = 0.032522
    id 7: 1/(60+1)            = 0.016393
    id 9: 1/(60+2)            = 0.016129
    -> [(3, 0.032522), (7, 0.016393), (9, 0.016129)]
"""

from __future__ import annotations

from collections.abc import Sequence

_TIE_DIGITS = 12  # scores equal to 12 decimals are ties (RRF scores are ~1e-2; float error ~1e-17)


def rrf(
    rankings: Sequence[Sequence[int]],
    k: float = 60,
    weights: Sequence[float] | None = None,
) -> list[tuple[int, float]]:
    """Fuse ranked id lists by reciprocal rank fusion.

    Parameters
    ----------
    rankings : sequence of sequences of int
        Each inner sequence is one ranking, best first, of stable chunk ids.  An id repeated inside one
        ranking counts only at its best (first) position.
    k : float
        Rank offset (> 0); 60 as in the paper.
    weights : sequence of float, optional
        One non-negative weight per ranking (default: all 1.0).

    Returns
    -------
    list of (int, float)
        ``(id, fused_score)`` for every id found in any ranking, best first.  Ties in score are broken
        by the best (smallest) rank the id reached in any list, then by the smaller id, so the order is
        deterministic.

    Raises
    ------
    ValueError
        If ``k <= 0``, if ``weights`` does not hold one entry per ranking, or if a weight is negative.
    """
    if k <= 0:
        raise ValueError(f"rrf: k must be > 0, got {k!r}")
    if weights is None:
        weights = [1.0] * len(rankings)
    if len(weights) != len(rankings):
        raise ValueError(f"rrf: got {len(weights)} weights for {len(rankings)} rankings; pass one per ranking")
    if any(w < 0 for w in weights):
        raise ValueError(f"rrf: weights must be >= 0, got {list(weights)!r}")
    scores: dict[int, float] = {}
    best_rank: dict[int, int] = {}
    for ranking, weight in zip(rankings, weights):
        seen: set[int] = set()
        for rank, item in enumerate(ranking, start=1):
            item = int(item)
            if item in seen:
                continue
            seen.add(item)
            scores[item] = scores.get(item, 0.0) + weight / (k + rank)
            best_rank[item] = min(best_rank.get(item, rank), rank)
    # scores are rounded for the comparison so that equal sums reached in another float order still tie
    order = sorted(scores, key=lambda i: (-round(scores[i], _TIE_DIGITS), best_rank[i], i))
    return [(i, scores[i]) for i in order]
