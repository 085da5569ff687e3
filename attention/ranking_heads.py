"""Ranking heads: the attention heads whose question-to-passage attention ranks passages by relevance.

Position debiasing's `calibrate+reorder` puts the passage it ranks most relevant where the model reads best
(`debias.reorder_for_bias`). By default it ranks by the question's attention averaged over every head of
every global layer, calibrated against the position bias (`debias.two_order_relevance`). Most heads do not
look for the answer, though: a few query-focused retrieval heads do (QRHead: Zhang et al. 2025,
"Query-Focused Retrieval Heads Improve Long-Context Reasoning and Re-ranking", sec. 3: score each head by the
attention mass the query gives the gold document over a handful of labelled examples, keep the best few,
and rank by their summed mass). Where a model has ranking heads here, the block modes' two-order
measurement ranks passages by those heads' attention mass, averaged over the given and the reversed order
(the order's position bias cancels in the mean of two mirrored slots, so no bias curve is needed); the
intervention's weights and block+recompute's token selection still use every head.

The heads are chosen per model offline (`python -m ldqa.eval.bench.bench_ranking_heads`: NQ-open questions
from the end of the evaluation's seeded order, never its first 800) and shipped in `ranking_heads.json`,
keyed by model name; a model without an entry ranks by every head, as before any were chosen.
docs/results.md, "Ranking heads", has the measurement.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BUNDLED = Path(__file__).resolve().parent / "ranking_heads.json"
ABOUT = ("ranking heads (QRHead-style query-focused retrieval heads) of ldqa's packaged models, by model name: "
         "(layer, query head) pairs; written by python -m ldqa.eval.bench.bench_ranking_heads --write")


@lru_cache(maxsize=None)
def _bundled(path: Path) -> dict:
    try:
        return json.loads(path.read_text())["models"]
    except (OSError, ValueError, KeyError) as e:
        log.warning("ranking heads %s unreadable (%s): passages are ranked by every head", path, e)
        return {}


def ranking_heads(model_name: str, path: Path = BUNDLED) -> tuple[tuple[int, int], ...] | None:
    """The ranking heads of the model named `model_name` (`LoadedModel.name`), as (layer, query head)
    pairs, or None where `path` has none for it (ranking then averages every head)."""
    entry = _bundled(Path(path)).get(model_name)
    if not entry:
        return None
    return tuple((int(layer), int(head)) for layer, head in entry["heads"])


def all_heads(model) -> tuple[tuple[int, int], ...]:
    """Every (layer, query head) pair of the model's global-attention layers (the layers whose question
    queries a measurement records), layer by layer."""
    from ldqa.attention.debias import global_layers

    return tuple((layer, h) for layer in global_layers(model.cfg) for h in range(model.cfg.num_heads))


def head_masses(model, cache, queries: dict, spans, q_slots: torch.Tensor, heads) -> torch.Tensor:
    """Attention mass from the question to each passage per head, (len(heads), k) float on the CPU, rows
    in the order of `heads` ((layer, query head) pairs): the softmax attention probability the passage's
    slots get, averaged over the question's tokens. queries: layer -> (hq, T, d) recorded question queries at cache slots q_slots
    (T,); spans: k (start, end) slot ranges. Raises ValueError for a head whose layer recorded no
    queries (not a global-attention layer) or whose index is out of range.

    Computed with einsum, as `debias.passage_mass` is, and only for the listed heads' layers: a few
    (T x L) score rows per head."""
    cfg = model.cfg
    pos = cache.positions
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    rows = {}
    for layer, hs in sorted(by_layer.items()):
        if layer not in queries:
            raise ValueError(f"ranking head ({layer}, {hs[0]}): layer {layer} recorded no question queries; "
                             f"layers with queries: {sorted(queries)}")
        q = queries[layer]  # (hq, T, d)
        hq = q.shape[0]
        if any(not 0 <= h < hq for h in hs):
            raise ValueError(f"ranking heads {hs} of layer {layer}: the layer has {hq} query heads")
        keys = cache.keys(layer)[0].float()  # (hkv, L, d)
        hkv, L, _ = keys.shape
        g = hq // hkv
        idx = torch.tensor(hs)
        s = torch.einsum("htd,hld->htl", q[idx], keys[idx // g]) * cfg.attn_scale  # (n, T, L)
        causal = pos[None, :L] <= pos[q_slots][:, None]  # (T, L)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=1)  # (n, L)
        for h, row in zip(hs, torch.stack([p[:, a:b].sum(-1) for a, b in spans], dim=-1)):  # (n, k)
            rows[(layer, h)] = row
    return torch.stack([rows[(int(layer), int(h))] for layer, h in heads]).cpu()


__all__ = ["ABOUT", "BUNDLED", "ranking_heads", "head_masses", "all_heads"]
