"""A prefilled context, and the exact (full-attention) prefill with its memo.

A `Context` is what every way of building a context returns (`engine.Engine.context`): the prompt's
segments, the KV cache holding the whole prompt, the next-token logits (1, 1, vocab) and what it cost.
The exact prefill runs the prompt through every layer at positions 0..n-1 with the question's queries
recorded (the debias methods measure attention from them; recording changes no number), and keeps a copy
of its cache: the same prompt again (another debias method, the same question asked twice, Attention
Buckets' branch 0 after a calibrate run) starts from the copy, bit-identical to computing it anew.

    memo = PrefillMemo()
    ctx = exact_prefill(model, fingerprint, segments, max_new=64, memo=memo)     # computed: ~n tokens of work
    again = exact_prefill(model, fingerprint, segments, max_new=64, memo=memo)   # a copy of the cache
    again.reused_prefill_ms == <the first one's prefill time>                     # so reports can add it back
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ldqa.attention.debias import DebiasKV
from ldqa.attention.kv_cache import CAPACITY_SLACK
from ldqa.attention.segments import PromptSegments

# Bytes of KV cache copies a `PrefillMemo` keeps by default (least recently used first out).
PREFILL_MEMO_BYTES = 256 << 20


@dataclass
class Context:
    """A prompt prefilled into a KV cache, ready to decode.

    prompt: its PromptSegments; cache: a KVCache holding every prompt token (capacity for the answer);
    logits: next-token logits after the last prompt token, (1, 1, vocab); block_stats: the block
    runtime's `PrefillStats` (None for an exact prefill); queries: exact prefill only, layer ->
    (heads, question tokens, head_dim) recorded question queries (fp32); reused_prefill_ms: > 0 when the
    prefill was a copy of an earlier identical one, which took this long (ms); token_mass: a measured
    context (`Engine.measure`), the question's attention per cache slot, (L,) on the CPU.
    """

    prompt: PromptSegments
    cache: object
    logits: torch.Tensor
    block_stats: object = None
    queries: dict | None = None
    reused_prefill_ms: float = 0.0
    token_mass: torch.Tensor | None = None


@dataclass
class PrefillMemo:
    """Copies of recent exact prefills' caches (with their recorded queries), at most `max_bytes` in all,
    least recently used dropped first; keyed by (prompt token ids, model fingerprint, RoPE theta scale of
    the global layers)."""

    max_bytes: int = PREFILL_MEMO_BYTES
    entries: OrderedDict = field(default_factory=OrderedDict)

    @staticmethod
    def key(segments: PromptSegments, fingerprint: str, theta_scale: float = 1.0) -> tuple:
        """The memo key of an exact prefill of `segments` by the model `fingerprint` at `theta_scale`."""
        return tuple(segments.ids()), fingerprint, float(theta_scale)

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def keys(self) -> list[tuple]:
        """The keys held, least recently used first."""
        return list(self.entries)

    def clear(self) -> None:
        """Forget every kept prefill (the next ones are computed)."""
        self.entries.clear()

    def get(self, key) -> dict | None:
        """The kept entry {"cache", "logits", "queries", "ms", "bytes"} (marked as recently used), or None."""
        memo = self.entries.get(key)
        if memo is not None:
            self.entries.move_to_end(key)
        return memo

    def put(self, key, cache, logits: torch.Tensor, queries: dict, ms: float) -> None:
        """Keep copies of `cache` and `logits` (with the recorded `queries` and the prefill's time `ms`),
        dropping the least recently used entries to stay within `max_bytes`; a cache larger than
        `max_bytes` on its own is not kept."""
        size = cache.capacity * cache.nbytes() // max(1, cache.length)  # bytes of a copy, and the queries'
        size += sum(q.untyped_storage().nbytes() for q in (queries or {}).values())
        if size > self.max_bytes:
            return
        while self.entries and size + sum(m["bytes"] for m in self.entries.values()) > self.max_bytes:
            self.entries.popitem(last=False)
        self.entries[key] = {"cache": cache.clone(), "logits": logits.clone(), "queries": queries, "ms": ms,
                             "bytes": size}


def exact_prefill(model, fingerprint: str, prompt: PromptSegments, max_new: int, theta_scale: float = 1.0,
                  shared: dict | None = None, memo: PrefillMemo | None = None) -> Context:
    """Exact prefill of `prompt` (attention="full") with the question's queries recorded (for the
    debias methods' attention measurement; recording does not change the attention).

    model: an ldqa Transformer; fingerprint: its weights' identity (part of the memo key); max_new: the
    answer budget (tokens) the cache makes room for. `theta_scale` multiplies the RoPE base of the global
    layers (Attention Buckets' branches; 1 = the model). `shared`: the layers below the first global one,
    already run on this prompt (`buckets.shared_layers`); the prefill then starts there, bit-identical
    to a whole one (those layers do not see the scale).

    With a `memo`, a prompt prefilled before starts from a copy of its cache, bit-identical to computing
    it anew; the context then carries `reused_prefill_ms`, the measured time of the prefill it reused
    (with a shared start: that start's time included), so that latency reports can add it back (what a
    caller asking only this would have waited). Returns a Context with `queries` set.
    """
    ids = prompt.ids()
    key = PrefillMemo.key(prompt, fingerprint, theta_scale)
    kept = memo.get(key) if memo is not None else None
    if kept is not None:
        return Context(prompt, kept["cache"].clone(), kept["logits"].clone(), None, kept["queries"], kept["ms"])
    t0 = time.perf_counter()
    rec = DebiasKV(n_record=len(prompt.question), scale=model.cfg.attn_scale)
    if shared is None:
        cache = model.new_cache(capacity=len(ids) + max_new + CAPACITY_SLACK)
        start, shared_ms = None, 0.0
    else:  # the shared layers' K/V sit in the copy's next slots; the pass resumes at the first global layer
        cache = shared["cache"].clone()
        start, shared_ms = (shared["layer"], shared["hidden"]), shared["ms"]
    cache.policy, cache.theta_scale = rec, float(theta_scale)
    logits = model(torch.tensor([ids]), torch.arange(len(ids)), cache, start=start)  # (1, 1, vocab)
    cache.policy = None
    if memo is not None:
        memo.put(key, cache, logits, rec.queries, (time.perf_counter() - t0) * 1000 + shared_ms)
    return Context(prompt, cache, logits, None, rec.queries)


def policy_prefill(model, prompt: PromptSegments, max_new: int, policy=None) -> Context:
    """One exact pass over `prompt` with `policy` attached as the cache's attention hook (left attached:
    e.g. `RetrievalKV`, which then serves every decode step, or a `DebiasKV` recording the question's
    queries). Returns a Context without recorded queries."""
    ids = prompt.ids()
    cache = model.new_cache(capacity=len(ids) + max_new + CAPACITY_SLACK)
    cache.policy = policy
    logits = model(torch.tensor([ids]), torch.arange(len(ids)), cache)  # (1, 1, vocab)
    return Context(prompt, cache, logits, None)
