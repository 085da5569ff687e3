"""Attention Buckets (Chen et al. 2023, "Fortify the Shortest Stave in Attention", sec. 3): one exact
prefill per RoPE base of the global layers, decoded together, the most confident branch choosing each
token.

A RoPE base sets where a layer's attention waveform (attention versus token distance) has its troughs;
branches with bases x1, x0.5 and x2 (`BUCKET_SCALES`) put them at different distances, so a passage that
sits in one branch's trough is seen by another. Sliding-window layers keep their base, so the layers below
the model's first global one are the same in every branch: they run once (`shared_layers`) and each
branch resumes from them (Gemma 3 270M: 5 of 18 layers saved per extra branch, answers bit-identical).

    ctx, ens, stats = bucket_context(model, fingerprint, prompt, max_new=64, scales=(1.0, 0.5, 2.0))
    gen = continue_generation(ens, ctx.cache, ctx.logits, ...)   # every step runs all 3 branches
    ens.chosen                                                     # [steps branch 0 chose, ...]
"""

from __future__ import annotations

import time

import torch

from ldqa.attention.context import Context, PrefillMemo, exact_prefill
from ldqa.attention.kv_cache import CAPACITY_SLACK, KVCache
from ldqa.attention.model import Transformer
from ldqa.attention.segments import PromptSegments


class BucketEnsemble:
    """Attention Buckets (Chen et al. 2023, "Fortify the Shortest Stave in Attention", sec. 3): the same
    context in parallel branches whose RoPE bases differ, so that the troughs of one branch's
    position-dependent attention waveform fall where another has peaks; at every step the branch whose
    next-token distribution is most confident (largest top probability) decides the token, which is then
    appended to every branch (our reading of the paper's aggregation).

    Acts as the `model` of a Generation: `ens(tokens, positions, cache)` runs every branch's cache (the
    `cache` argument is branch 0's, kept for the Generation's bookkeeping) and returns the chosen
    branch's logits (1, 1, vocab). `chosen` counts the steps each branch decided.
    """

    def __init__(self, model: Transformer, caches: list[KVCache]):
        self.model, self.caches = model, caches
        self.chosen = [0] * len(caches)

    def pick(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """The most confident of the branches' logits (each (1, 1, vocab)); counts the choice."""
        conf = [float(torch.softmax(x[0, -1].float(), -1).max()) for x in logits]
        b = max(range(len(logits)), key=conf.__getitem__)
        self.chosen[b] += 1
        return logits[b]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.pick([self.model(tokens, positions, c) for c in self.caches])


def shared_layers(model, prompt: PromptSegments, max_new: int) -> dict | None:
    """The layers of `prompt`'s exact prefill below the model's first global-attention layer, which no
    RoPE scale of the global layers changes (Gemma 3 270M: 5 sliding-window layers of 18): a dict with
    the cache holding their K/V in its next slots (not yet counted in its length), the hidden states
    (1, n, hidden) entering the first global layer, that layer's index and the time taken (ms); None
    when the first layer is global (Llama, Qwen: nothing to share)."""
    from ldqa.attention.debias import global_layers

    first = min(global_layers(model.cfg), default=0)
    if first == 0:
        return None
    t0 = time.perf_counter()
    ids = prompt.ids()
    cache = model.new_cache(capacity=len(ids) + max_new + CAPACITY_SLACK)
    hidden = model(torch.tensor([ids]), torch.arange(len(ids)), cache, n_layers=first)  # (1, n, hidden)
    return {"cache": cache, "hidden": hidden, "layer": first, "ms": (time.perf_counter() - t0) * 1000}


def bucket_context(model, fingerprint: str, prompt: PromptSegments, max_new: int, scales: tuple[float, ...],
                   memo: PrefillMemo | None = None, share_layers: bool = True):
    """One exact prefill of `prompt` per RoPE base scale in `scales` (each kept in `memo` as exact
    prefills are); with `share_layers` the layers below the first global one run once for all branches
    that are not in the memo yet (False: each branch's whole prefill, the side-by-side comparison of
    `python -m ldqa.eval.bench.diag_debias buckets-prefill`).

    Returns (branch 0's Context with the ensemble's first logits (1, 1, vocab) and the branches' summed
    `reused_prefill_ms`, the BucketEnsemble that decodes all branches, DebiasStats with debias_ms and
    debias_passes; the caller fills bucket_steps_chosen from `ens.chosen` after decoding).
    """
    from ldqa.attention.debias import DebiasStats

    t0 = time.perf_counter()
    shared = None  # the layers below the first global one are the same in every branch: run them once
    missing = sum(PrefillMemo.key(prompt, fingerprint, s) not in (memo or ()) for s in scales)
    if share_layers and missing > 1:
        shared = shared_layers(model, prompt, max_new)
    branches = [exact_prefill(model, fingerprint, prompt, max_new, s, shared, memo) for s in scales]
    ens = BucketEnsemble(model, [b.cache for b in branches])
    first = ens.pick([b.logits for b in branches])
    reused = sum(b.reused_prefill_ms for b in branches)
    return (Context(prompt, branches[0].cache, first, None, reused_prefill_ms=reused), ens,
            DebiasStats(debias_ms=(time.perf_counter() - t0) * 1000, debias_passes=len(scales)))
