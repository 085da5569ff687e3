"""Block-reusable KV states (Block-Attention) with RoPE re-encoding and selective recomputation.

Sources: Block-Attention (Sun et al. 2024): each retrieved passage is a block whose KV states are
computed independently and reused; only the last block (the question) attends to everything; cached keys
are moved to their new positions by re-applying RoPE. CacheBlend (Yao et al. 2024, sec. 4): recompute
the KV of the few tokens per block whose states deviate most from full attention, chosen on an early
layer. The shared sink prefix follows the parallel-context-encoding analysis (a common attention sink
narrows the gap without training).

Positions and masks, a worked example (prefix P = 2 tokens, two passages of 2 tokens, headers h1, h2 of
one token, question q of 1 token; `x` = attends):

    encoding (once, stored):     block b1 = [P0 P1 | a0 a1]  positions 0 1 | 2 3
                                 block b2 = [P0 P1 | c0 c1]  positions 0 1 | 2 3
    assembled cache:   P0 P1 h1 a0 a1 h2 c0 c1 q     positions 0..8
        a0,a1 keep their stored KV, rotated by +1 (stored at 2,3 -> now 3,4)
        c0,c1 rotated by +4 (2,3 -> 6,7); only q is computed fresh:
               P0 P1 h1 a0 a1 h2 c0 c1 q
        h2     x  x  .  .  .  x             (headers "cached": a block of its own, stored at 2 -> 5)
        q      x  x  x  x  x  x  x  x  x    (the question sees everything)
        a1     x  x  .  x  x                (as encoded: the prefix and its own block only)
    With headers "fresh" the headers are computed in the question's pass instead and see everything
    before them (h2: P0..a1); that costs ~5 fresh tokens per passage.

RoPE re-encoding is exact: R(p + d) = R(d) R(p), so rotating a key computed at position p by d equals the
key computed at p + d, as long as everything before the key is the same at both positions (it is: the
block was encoded after the same prefix). A self-check at load verifies this numerically.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ldqa.attention.choices import HEADER_MODES, SELECT_METHODS
from ldqa.attention.kv_cache import KVCache
from ldqa.attention.quant import int8_lead_rows, prefill_gemm_as
from ldqa.kernels import dispatch

log = logging.getLogger(__name__)

# Within `BlockRuntime.ranking_only`: the passes built only rank (their states are dropped)
_RANKING_ONLY = contextvars.ContextVar("ldqa_ranking_only", default=False)

# block+recompute's default: the question-aware selection (`DEFAULT_SELECT`) at 30% of the passage tokens,
# the smallest share measured within noise of full attention on the default model (docs/results.md,
# "Block reuse: where the points go")
DEFAULT_RECOMPUTE_RATIO = 0.3
DEFAULT_HEADERS = "cached"
# How block+recompute chooses the tokens it recomputes (`BlockRuntime._choose`; the names are
# `choices.SELECT_METHODS`): "question" ranks every passage token by the attention the question's queries
# give it over the assembled cache and takes the top ratio of the whole context in windows of SELECT_WINDOW tokens (question-aware, as ProphetKV / A^3 /
# CacheClip, 2025); "deviation" takes the ratio of each passage whose layer-1 keys deviate most from full
# attention's (CacheBlend, Yao et al. 2025, sec. 4.3); "lead" the first ratio of each passage (header
# first). A tuple of passage ranks (1-based) recomputes those passages whole, whatever the ratio (with
# the gold passage's rank: an oracle for diagnostics).
DEFAULT_SELECT = "question"
SELECT_WINDOW = 4
# The layers whose question queries rank the tokens for "question": the first SELECT_LAYERS (None: every
# layer; the selection pass stops there). Every layer: ranking by the first 7 or 14 of the 1.5B's 28 keeps
# little of the recompute's gain (KL to full attention 0.11 against 0.03; docs/results.md)
SELECT_LAYERS = None
# How "question" scores a slot from the question's attention probabilities of each ranking layer: their
# mean over heads and question tokens ("mean"), their maximum ("max"), or the last question token's mean
# over heads ("last"); the layers' scores are averaged (`token_mass`). "mean": none measured better
SELECT_SCORES = ("mean", "max", "last")
SELECT_SCORE = "mean"
# "question": how many passages, those whose slots the question scores highest in sum, are recomputed
# whole before the windows take the rest of the budget (`BlockRuntime._top_windows`); 0: windows only.
# 0: on the default model one passage whole nearly triples the KL to full attention at 30% (0.077 against
# 0.028, 24 NQ-open prompts; docs/results.md, "The most attended passage whole")
SELECT_WHOLE = 0
# "question": the share of the passage tokens chosen in a second round (`BlockRuntime.select_refine`): the
# rest of the budget is recomputed first, the question ranks the tokens again over that cache, and its best
# windows among the tokens not yet recomputed join the final pass. 0: one round; on the default model two
# rounds are further from full attention at 30% (KL 0.059 with 10% in the second round, against 0.028, 24
# NQ-open prompts; docs/results.md, "Two rounds of selection")
SELECT_REFINE = 0.0
# Gradual filtering of the recomputed tokens (CacheBlend, Yao et al. 2025, sec. 4.3: fewer tokens
# recomputed at deeper layers): (layer j, ratio r) keeps only the best r share of the passage tokens,
# by the "question" ranking, recomputed from layer j on; the others get exact K/V at layer j from the
# hidden states they reached and keep their reused K/V above it. None: every chosen token through every layer.
# Off: on the default model it loses to recomputing fewer tokens through every layer (KL to full attention
# 0.091 at the default's work against 0.030; docs/results.md, "Block reuse: where the points go")
TAPER = None
# At most this many passage tokens recomputed by block+recompute, whatever the ratio (None: no cap): the
# share falls as the context grows past RECOMPUTE_MAX_TOKENS / ratio tokens, so the recompute's time stops
# growing with it (`capped_ratio`). Off: the gain is the share's, not a token count's (default model, 30
# passages: KL to full attention 0.338 at 512 tokens against 0.044 at 30%, block 0.405; docs/results.md)
RECOMPUTE_MAX_TOKENS = None
# Whether block modes encode a chunk of a long document after its document's anchor (its first chunk;
# `PromptSegments.anchors`, Star Attention) by default
DEFAULT_ANCHORS = False
# How many generic passages (the app's `prompt.ANCHOR_PASSAGES`) each block mode encodes every passage block
# after, beside the shared prefix, so that no block is stored as if it were the first document of the list
# (`PromptSegments.anchors`; a later chunk's document anchor takes its place where on). 0: after the
# prefix only. Measured per mode (docs/results.md, "Anchor passages"): they bring plain block attention
# within noise of full attention on NQ-open, and cost block+recompute points
DEFAULT_ANCHOR_PASSAGES = {"block": 3, "block+recompute": 0}
ANCHOR_CACHE = 8  # anchors' KV kept in memory (LRU): the documents of the last few questions


@dataclass(frozen=True)
class BlockConfig:
    """Block attention's settings. recompute_ratio: the fraction of the passage tokens recomputed in
    "block+recompute", in [0, 1]; headers: "cached" (each "Passage [n]" header a reused
    block) or "fresh" (computed with the question); select: how block+recompute chooses its tokens
    (`SELECT_METHODS` or a tuple of passage ranks); anchors: encode each chunk of a long document after
    its document's first chunk (`PromptSegments.anchors`). None = the default (`DEFAULT_RECOMPUTE_RATIO`,
    `DEFAULT_HEADERS`, `DEFAULT_SELECT`, `DEFAULT_ANCHORS`), filled by `resolved`. anchor_passages: the
    generic passages every block is encoded after (`DEFAULT_ANCHOR_PASSAGES`, per mode). Raises ValueError for
    a ratio outside [0, 1], an unknown header mode or selection, a negative anchor_passages."""

    recompute_ratio: float | None = None
    headers: str | None = None
    select: str | tuple[int, ...] | None = None
    anchors: bool | None = None
    anchor_passages: int | None = None

    def __post_init__(self):
        if self.recompute_ratio is not None and not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.headers is not None and self.headers not in HEADER_MODES:
            raise ValueError(f"block_headers={self.headers!r}: choose one of {', '.join(HEADER_MODES)}")
        check_select(self.select)
        n = self.anchor_passages
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"anchor_passages must be a whole number >= 0, got {n!r}")

    def resolved(self, mode: str) -> "BlockConfig":
        """The settings attention `mode` runs with: block modes get the default header mode and their
        default anchors and anchor passages, "block+recompute" the default ratio and selection; other modes
        use none of them (all None)."""
        if not mode.startswith("block"):
            return BlockConfig()
        anchors = DEFAULT_ANCHORS if self.anchors is None else bool(self.anchors)
        n = DEFAULT_ANCHOR_PASSAGES[mode] if self.anchor_passages is None else self.anchor_passages
        if mode != "block+recompute":
            return BlockConfig(None, self.headers or DEFAULT_HEADERS, None, anchors, n)
        ratio = DEFAULT_RECOMPUTE_RATIO if self.recompute_ratio is None else self.recompute_ratio
        return BlockConfig(ratio, self.headers or DEFAULT_HEADERS, self.select or DEFAULT_SELECT, anchors, n)


def anchor_passages_of(mode: str, n: int | None = None) -> int:
    """The anchor passages attention `mode` encodes its passage blocks after: `n`, None the mode's default
    (`DEFAULT_ANCHOR_PASSAGES`); 0 outside block modes. Raises ValueError for a negative `n`."""
    return BlockConfig(anchor_passages=n).resolved(mode).anchor_passages or 0


def check_select(select) -> None:
    """Raise ValueError unless `select` is None, one of `SELECT_METHODS` or a non-empty tuple of passage
    ranks (ints >= 1)."""
    if select is None or select in SELECT_METHODS:
        return
    if isinstance(select, tuple) and select and all(isinstance(r, int) and r >= 1 for r in select):
        return
    raise ValueError(f"recompute_select={select!r}: choose one of {', '.join(SELECT_METHODS)}, or give a tuple "
                     f"of passage ranks (1-based) to recompute whole")


@dataclass
class PrefillStats:
    """What one assembled prefill did. tokens_reused: passage tokens whose KV came from stored blocks;
    tokens_computed: tokens run through the model (the question, fresh headers, block misses, recomputed
    tokens); header_tokens_reused: header tokens whose KV came from a cached header block (headers
    "cached"); kv_hits / kv_misses: block store lookups (passage bodies); assemble_ms: time to build the
    cache (ms)."""

    mode: str = "full"
    tokens_reused: int = 0
    tokens_computed: int = 0
    tokens_recomputed: int = 0
    header_tokens_reused: int = 0
    headers: str = DEFAULT_HEADERS
    kv_hits: int = 0
    kv_misses: int = 0
    assemble_ms: float = 0.0
    encode_ms: float = 0.0

    @property
    def kv_hit_rate(self) -> float:
        n = self.kv_hits + self.kv_misses
        return self.kv_hits / n if n else 0.0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "tokens_reused": self.tokens_reused, "tokens_computed": self.tokens_computed,
                "tokens_recomputed": self.tokens_recomputed,
                "header_tokens_reused": self.header_tokens_reused, "headers": self.headers, "kv_hits": self.kv_hits, "kv_misses": self.kv_misses,
                "kv_hit_rate": self.kv_hit_rate, "assemble_ms": self.assemble_ms, "encode_ms": self.encode_ms}


def reencode_keys_(model, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """Rotate stored keys (num_layers, kv_heads, n, head_dim) by `delta` positions, in place, each layer
    with its own RoPE frequencies (Gemma 3: local theta 10K, global 1M). The layers that share
    frequencies (`model.rope_layer_groups`) are rotated in one call, with one table of angles: every key
    gets the same float operations as in a call per layer, with 28x fewer small ops for Qwen2.5's 28
    layers (plain block's first token 1.07x sooner over 10 passages, docs/results.md, "Re-encoding a
    block's layers in one call"). A bf16/fp16 KV cache is rotated in fp32 and rounded once, as a fresh key
    is rounded once."""
    if delta == 0:
        return keys
    k32 = keys if keys.dtype == torch.float32 else keys.float()  # (L, kvh, n, d)
    for inv_freq, layers in model.rope_layer_groups():
        if len(layers) == keys.shape[0]:
            dispatch.rope_reencode_(k32, delta, inv_freq=inv_freq)  # the layers as the batch dimension
        else:
            part = k32[layers]  # (len(layers), kvh, n, d), a copy
            dispatch.rope_reencode_(part, delta, inv_freq=inv_freq)
            k32[layers] = part
    if k32 is not keys:
        keys.copy_(k32)
    return keys


def capped_ratio(ratio: float, n_passage: int, max_tokens: int | None) -> float:
    """The share of `n_passage` passage tokens block+recompute recomputes: `ratio`, lowered so that at most
    `max_tokens` tokens are chosen (None: `ratio` as given). A fixed token budget past a length instead of
    a fixed share keeps the recompute's time from growing with the context (CacheBlend, Yao et al. 2025,
    recomputes a fixed share, sec. 4.3). Raises ValueError for a negative `max_tokens`."""
    if max_tokens is None or n_passage <= 0:
        return ratio
    if max_tokens < 0:
        raise ValueError(f"recompute_max_tokens must be >= 0 or None, got {max_tokens}")
    return min(ratio, max_tokens / n_passage)


@dataclass
class BlockRuntime:
    """Builds KV caches from reusable blocks for one model and one shared prefix.

    model: ldqa Transformer; fingerprint: the weights' identity (part of every block key);
    kv_store: an `ldqa.indexes.kv_store.KVBlockStore` or None (blocks are then recomputed every time).
    `enabled` is False (with `disabled_reason`) when the RoPE self-check failed: callers fall back to
    full attention.
    """

    model: object
    fingerprint: str
    kv_store: object = None
    enabled: bool = True
    disabled_reason: str = ""
    check_error: float | None = None  # the self-check's measured error (see `self_check`)
    select_layers: int | None = SELECT_LAYERS  # "question" selection: rank by the first this many layers
    select_window: int = SELECT_WINDOW  # "question" selection: the windows' tokens
    select_score: str = SELECT_SCORE  # "question" selection: SELECT_SCORES
    select_skip_first: bool = False  # "question" selection: never the first passage (nearly exact as stored)
    select_whole: int = field(default_factory=lambda: SELECT_WHOLE)  # "question": passages recomputed whole
    select_refine: float = field(default_factory=lambda: SELECT_REFINE)  # "question": second round's share
    # "question" selection: (layer, ratio) of gradual filtering; the module's TAPER when the runtime is made
    taper: tuple[int, float] | None = field(default_factory=lambda: TAPER)
    # block+recompute: at most this many passage tokens recomputed (`capped_ratio`); the module's
    # RECOMPUTE_MAX_TOKENS when the runtime is made
    recompute_max_tokens: int | None = field(default_factory=lambda: RECOMPUTE_MAX_TOKENS)
    # block+recompute's GEMM for the passage tokens it recomputes and for its ranking passes (`choices.
    # RECOMPUTE_GEMMS`): "int8" multiplies them with the int8 prefill GEMM (`quant.int8_lead_rows`), the
    # question's own rows staying bf16; the engine sets the model's (`choices.recompute_gemm`)
    recompute_gemm: str = "bf16"
    # under the int8 `recompute_gemm`, the question's rows of block+recompute's final pass in int8 too
    # (their last row at the last layer, which gives the first token, stays bf16: `quant.int8_lead_rows`);
    # off by default (docs/results.md, "The question's rows in int8")
    question_int8: bool = False
    _prefix: dict = field(default_factory=dict, repr=False)
    _headers: dict = field(default_factory=dict, repr=False)
    _anchors: OrderedDict = field(default_factory=OrderedDict, repr=False)

    @staticmethod
    @contextmanager
    def ranking_only():
        """Within the block (this thread or task only), the passes `prefill` runs only rank (position
        debiasing's measurements for block+recompute, whose final context is built again): under the int8
        `recompute_gemm` they run in int8, the stored blocks they encode on the way still in the model's
        own GEMM."""
        token = _RANKING_ONLY.set(True)
        try:
            yield
        finally:
            _RANKING_ONLY.reset(token)

    # ------------------------------------------------------------------ blocks
    def prefix_block(self, prefix_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of the shared prefix at positions 0..P-1 (computed once per runtime): two
        (num_layers, kv_heads, P, head_dim) tensors."""
        key = tuple(prefix_ids)
        if key not in self._prefix:
            cache = self.model.new_cache(capacity=len(prefix_ids))
            self.model(torch.tensor([prefix_ids]), torch.arange(len(prefix_ids)), cache)
            self._prefix[key] = cache.block(0, len(prefix_ids))
        return self._prefix[key]

    def anchor_block(self, prefix_ids: list[int], anchor_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of prefix + anchor at positions 0..P+A-1 (the prefix's own KV, then the anchor encoded after
        it), kept for the last `ANCHOR_CACHE` anchors: two (num_layers, kv_heads, P + A, head_dim)."""
        key = (tuple(prefix_ids), tuple(anchor_ids))
        if key in self._anchors:
            self._anchors.move_to_end(key)
            return self._anchors[key]
        pk, pv = self.prefix_block(prefix_ids)
        p, a = len(prefix_ids), len(anchor_ids)
        cache = self.model.new_cache(capacity=p + a)
        cache.extend(pk, pv, torch.arange(p))
        self.model(torch.tensor([anchor_ids]), torch.arange(p, p + a), cache)
        self._anchors[key] = cache.block(0, p + a)
        while len(self._anchors) > ANCHOR_CACHE:
            self._anchors.popitem(last=False)
        return self._anchors[key]

    def encode_block(self, prefix_ids: list[int], body_ids: list[int], anchor_ids: list[int] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block prefill: KV of `body_ids` encoded right after the prefix (and `anchor_ids`, when given),
        positions P(+A)..P(+A)+n-1, attending to those and to itself only. Returns keys, values
        (num_layers, kv_heads, n, head_dim)."""
        pk, pv = self.anchor_block(prefix_ids, list(anchor_ids)) if anchor_ids else self.prefix_block(prefix_ids)
        p, n = pk.shape[2], len(body_ids)
        cache = self.model.new_cache(capacity=p + n)
        cache.extend(pk, pv, torch.arange(p))
        self.model(torch.tensor([body_ids]), torch.arange(p, p + n), cache)
        return cache.block(p, p + n)

    def header_block(self, prefix_ids: list[int], header_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of a passage header ("Passage [n]") encoded as its own block after the prefix (positions
        P..P+h-1), computed once per runtime and kept in memory (a few tokens per rank, not worth the
        store). Returns private copies (num_layers, kv_heads, h, head_dim), safe to rotate in place."""
        key = (tuple(prefix_ids), tuple(header_ids))
        if key not in self._headers:
            self._headers[key] = self.encode_block(prefix_ids, header_ids)
        k, v = self._headers[key]
        return k.clone(), v.clone()

    def get_block(self, prefix_ids, body_ids, chunk_id, stats: PrefillStats, anchor_ids=()):
        """KV of a passage body encoded after the prefix (and its document's anchor, when given): from the
        store (hit) or encoded and stored (miss). The key covers prefix + anchor + body; the block's
        positions start at len(prefix) + len(anchor).

        Returns keys, values (num_layers, kv_heads, n, head_dim) in the model dtype, private copies (safe
        to rotate in place). Updates `stats` (hits, misses, tokens reused/computed, encode_ms).
        """
        dtype = self.model.kv_dtype
        key = None
        seen = list(prefix_ids) + list(anchor_ids)  # what the body attends to besides itself
        if self.kv_store is not None:
            from ldqa.indexes.kv_store import block_key

            key = block_key(self.fingerprint, seen, body_ids)
            hit = self.kv_store.get(key)
            if hit is not None and hit.n_tokens == len(body_ids) and hit.start == len(seen):
                stats.kv_hits += 1
                stats.tokens_reused += len(body_ids)
                # private copies on the model's device: rotation never touches the store
                return _to_device(hit.keys, self.model.device, dtype), _to_device(hit.values, self.model.device, dtype)
        stats.kv_misses += 1
        t0 = time.perf_counter()
        k, v = self.encode_block(prefix_ids, body_ids, anchor_ids)
        stats.encode_ms += (time.perf_counter() - t0) * 1000
        stats.tokens_computed += len(body_ids)
        if not _finite(k, v):  # never store (or use) a block of NaN/inf: every later question would reuse it
            from ldqa.attention.generate import NonFiniteLogitsError

            raise NonFiniteLogitsError(f"the KV block of passage chunk {chunk_id} ({len(body_ids)} tokens) holds "
                                       f"NaN/inf; it was not stored. Load the model with weights 'fp32' or 'bf16' "
                                       f"and kv_dtype 'fp32'; if every format fails, the model file is damaged")
        if self.kv_store is not None:
            from ldqa.indexes.kv_store import KVBlock

            ks, vs = k.to(self.kv_store.dtype), v.to(self.kv_store.dtype)
            if _finite(ks, vs):
                self.kv_store.put(key, KVBlock(k, v, len(seen)), chunk_id=chunk_id)
                # use the block as a later hit will read it (rounded to the store dtype): an answer is the
                # same whether its passages were stored before or encoded just now
                k, v = ks.to(dtype), vs.to(dtype)
            else:  # values past the store dtype's range (fp16: 65504): used as computed, not stored
                log.warning("KV block of chunk %s overflows the store's %s; used without storing it", chunk_id,
                            self.kv_store.dtype)
        return k, v

    def encode(self, blocks, on_block=None) -> PrefillStats:
        """Make sure the KV block of every (prefix ids, body ids, chunk id[, anchor ids]) in `blocks` is in
        the store (`get_block`: a hit costs a lookup, a miss an encode and a put), so later questions over
        them hit. on_block(1) is called after each block (a progress bar). Returns the PrefillStats of the
        lookups (kv_hits, kv_misses, encode_ms, tokens reused/computed)."""
        stats = PrefillStats()
        for prefix, body, chunk_id, *anchor in blocks:
            self.get_block(prefix, body, chunk_id, stats, anchor[0] if anchor else ())
            if on_block is not None:
                on_block(1)
        return stats

    # ------------------------------------------------------------------ assembly
    def prefill(self, segments, chunk_ids: list[int | None], mode: str = "block",
                recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO, extra_capacity: int = 64, policy=None,
                headers: str = DEFAULT_HEADERS, select: str | tuple[int, ...] = DEFAULT_SELECT, scores=None):
        """`assemble` plus the question, in the same single pass as the fresh tokens (recomputed tokens,
        fresh headers).

        policy: the cache's attention hook during that pass (e.g. a DebiasKV recording the question's
        queries), left attached. scores: None, or the question's attention to each passage's slots
        measured beforehand (see `_assemble`). Returns (cache holding the whole prompt, logits of the last
        prompt token (1, 1, vocab), stats).
        """
        return self._assemble(segments, chunk_ids, mode, recompute_ratio, extra_capacity, True, policy, headers,
                              select, scores)

    def prefill_orders(self, orders: list, chunk_ids: list[list[int | None]], extra_capacity: int = 64,
                       record: bool = False, headers: str = DEFAULT_HEADERS) -> list:
        """Plain block mode's `prefill` of several prompts that hold the same passages in other orders
        (position debiasing's two measurements: the given order and its reverse), with the question
        computed for all of them in one pass: each prompt's cache is assembled from the stored blocks, the
        caches are stacked as one batch (`KVCache.stack`) and the question runs once over it, so every
        linear layer's weights are read once for all of them. Each result is what `prefill` in "block"
        mode gives for that prompt, up to the GEMM's rounding on more rows.

        orders: PromptSegments with the same question and the same length; chunk_ids: one list per
        prompt; record: attach a `debias.DebiasKV` recording the question's queries. Prompts that cannot
        share a pass (another question or length, fresh headers) are prefilled one by one. Returns per
        prompt (cache of batch 1, logits of the last prompt token (1, 1, vocab), PrefillStats, recorded
        queries: layer -> (hq, T, d), or None without `record`)."""
        from ldqa.attention.debias import DebiasKV

        scale = self.model.cfg.attn_scale
        question = orders[0].question
        if (len(orders) < 2 or headers != "cached"
                or any(seg.question != question or len(seg) != len(orders[0]) for seg in orders)):
            out = []
            for seg, ids in zip(orders, chunk_ids):
                rec = DebiasKV(n_record=len(seg.question), scale=scale) if record else None
                cache, logits, stats = self.prefill(seg, ids, "block", 0.0, extra_capacity, rec, headers)
                cache.policy = None
                out.append((cache, logits, stats, rec.queries if rec else None))
            return out
        t0 = time.perf_counter()
        built = [self._assemble(seg, ids, "block", 0.0, extra_capacity, False, None, headers)
                 for seg, ids in zip(orders, chunk_ids)]
        batch = KVCache.stack([cache for cache, _, _ in built])
        length, n = batch.length, len(question)
        rec = DebiasKV(n_record=n, scale=scale) if record else None
        batch.policy = rec
        with self._gemm(0):
            logits = self.model(torch.tensor([question] * len(orders)), torch.arange(length, length + n), batch)
        batch.policy = None
        ms = (time.perf_counter() - t0) * 1000 / len(orders)  # the shared pass, split evenly
        out = []
        for b, (_, _, stats) in enumerate(built):
            stats.tokens_computed += n
            stats.assemble_ms = ms
            out.append((batch.sequence(b), logits[b:b + 1], stats, rec.queries_of(b) if rec else None))
        return out

    def assemble(self, segments, chunk_ids: list[int | None], mode: str = "block",
                 recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO, extra_capacity: int = 64,
                 headers: str = DEFAULT_HEADERS, select: str | tuple[int, ...] = DEFAULT_SELECT
                 ) -> tuple[KVCache, PrefillStats]:
        """The cache of the passages without the question (see `_assemble`): (cache, PrefillStats); the
        tokens it recomputes (block+recompute, fresh headers) are computed in place. Raises as `_assemble`."""
        cache, _, stats = self._assemble(segments, chunk_ids, mode, recompute_ratio, extra_capacity, False, None,
                                         headers, select)
        return cache, stats

    def _assemble(self, segments, chunk_ids: list[int | None], mode: str, recompute_ratio: float,
                  extra_capacity: int, with_question: bool, policy, headers: str,
                  select: str | tuple[int, ...] = DEFAULT_SELECT, scores=None):
        """Build the cache [prefix][h1][b1]...[hk][bk] for `segments` (`attention.segments.PromptSegments`),
        ready for the question to be prefilled after it (`with_question`: in the same final pass).

        mode "block": bodies from stored blocks, re-encoded to their offsets.
        mode "block+recompute": also recompute the `recompute_ratio` fraction of the passage tokens (headers
        and bodies; at most `recompute_max_tokens` of them, `capped_ratio`) that `select` chooses
        (`SELECT_METHODS`, `_choose`), or the passages at the ranks of a tuple `select` whole; ratio 1.0
        recomputes every passage token and reproduces full attention.
        headers "cached" (default): each rank's header ("Passage [n]") is a tiny block of its own, encoded
        once after the prefix and re-encoded to its offset like a body, so only the question is computed
        fresh (Block-Attention: every block but the last is encoded independently); "fresh": headers are
        computed in the question's pass, attending to everything before them (about 5 fresh tokens per
        passage: 690 of them at 16K tokens, the main TTFT cost there). Fresh headers act as an accuracy
        recovery switch for plain "block" (they are the only tokens that see across passages besides
        the question); with recomputation they make no measurable difference (docs/results.md).
        scores (block+recompute, "question" selection with the default ranking: every layer, "mean"): None,
        or one 1-D tensor per passage (in this order) of the question's attention probability per slot of
        its header and body, measured over other block caches of the same passages (position
        debiasing's measurements, `debias.debiased_context`): the windows are ranked by these and the
        selection pass is not run (a header of another length is aligned by its last tokens).
        Returns (cache, logits of the last computed token (1, 1, vocab) or None when none was computed,
        PrefillStats); `with_question` appends the question to the final pass (see `prefill`).
        Raises ValueError on an unknown mode, header mode or selection, or a ratio outside [0, 1].
        """
        check_select(select)
        if mode not in ("block", "block+recompute"):
            raise ValueError(f"assemble: mode must be 'block' or 'block+recompute', got {mode!r}")
        if headers not in HEADER_MODES:
            raise ValueError(f"assemble: headers must be one of {', '.join(HEADER_MODES)}, got {headers!r}")
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        t0 = time.perf_counter()
        stats = PrefillStats(mode=mode, headers=headers)
        prefix = segments.prefix
        cache = self.model.new_cache(capacity=len(segments) + extra_capacity)
        pk, pv = self.prefix_block(prefix)
        cache.extend(pk, pv, torch.arange(len(prefix)))
        slot_ids = list(prefix)  # token id of every cache slot
        origin = ["prefix"] * len(prefix)  # per slot: prefix, header (cached), hit (stored body), computed
        fresh, spans = [], []  # slots computed in the final pass; (start, end) of each passage (header + body)
        taper = None  # (layer j, chosen slots not recomputed from layer j on), from `self.taper`
        anchors = segments.anchors or [[] for _ in segments.passages]
        for header, body, chunk_id, anchor in zip(segments.headers, segments.passages, chunk_ids, anchors):
            at = cache.length
            if headers == "cached":
                hk, hv = self.header_block(prefix, header)
                reencode_keys_(self.model, hk, at - len(prefix))
                stats.header_tokens_reused += len(header)
            else:
                hk = hv = torch.zeros(pk.shape[0], pk.shape[1], len(header), pk.shape[3], dtype=pk.dtype,
                                      device=pk.device)
                fresh += range(at, at + len(header))  # placeholders, computed below
            cache.extend(hk, hv, torch.arange(at, at + len(header)))
            hits = stats.kv_hits
            k, v = self.get_block(prefix, body, chunk_id, stats, anchor)
            origin += ["header" if headers == "cached" else "computed"] * len(header)
            origin += ["hit" if stats.kv_hits > hits else "computed"] * len(body)
            start = at + len(header)
            reencode_keys_(self.model, k, start - len(prefix) - len(anchor))  # stored at P(+A).., now at `start`..
            cache.extend(k, v, torch.arange(start, start + len(body)))
            spans.append((at if headers == "cached" else start, start + len(body)))
            slot_ids += header + body
        if mode == "block+recompute" and (recompute_ratio > 0 or isinstance(select, tuple)):
            ratio = capped_ratio(recompute_ratio, sum(b - a for a, b in spans), self.recompute_max_tokens)
            ranked = self._choose(select, cache, slot_ids, spans, fresh, ratio, segments.question, scores)
            chosen = sorted(ranked)
            if select == "question" and self.taper is not None and ranked:
                layer, r = self.taper
                n_passage = sum(b - a for a, b in spans)
                n_keep = int(round(r * n_passage))
                if n_keep < len(ranked) < n_passage and 0 < layer < self.model.cfg.num_layers:
                    taper = (layer, set(ranked[n_keep:]))
            done = set()
            if select == "question" and self.select_refine > 0 and taper is None and ranked and not fresh:
                done, second = self._refine(cache, slot_ids, spans, ranked, question=segments.question)
                chosen = sorted(done | set(second))
            stats.tokens_recomputed = len(chosen)
            stats.header_tokens_reused -= sum(1 for i in chosen if origin[i] == "header")
            stats.tokens_reused -= sum(1 for i in chosen if origin[i] == "hit")
            fresh = sorted(set(fresh) | (set(chosen) - done))
        if with_question:  # the question joins the same pass: placeholders at the end, computed below
            at, q = cache.length, segments.question
            hk = torch.zeros(pk.shape[0], pk.shape[1], len(q), pk.shape[3], dtype=pk.dtype, device=pk.device)
            cache.extend(hk, hk, torch.arange(at, at + len(q)))
            fresh += range(at, at + len(q))
            slot_ids += q
        cache.policy = policy
        # block+recompute under the int8 recompute GEMM: the recomputed passage tokens (every fresh slot before
        # the question) in int8, the question in bf16 unless `question_int8` (not with gradual filtering,
        # whose passes are subsets); a pass that only ranks (`ranking_only`) wholly in int8
        n_bf16 = len(segments.question) if with_question and not self.question_int8 else 0
        lead = (sum(1 for i in fresh if i < len(slot_ids) - n_bf16)
                if mode == "block+recompute" and self.recompute_gemm == "int8" and taper is None else 0)
        with self._gemm(lead):
            logits = self._recompute(cache, slot_ids, fresh, taper=taper) if fresh else None
        stats.tokens_computed += len(fresh)
        stats.assemble_ms = (time.perf_counter() - t0) * 1000
        return cache, logits, stats

    def _gemm(self, lead: int):
        """The GEMM of an assembly's computed rows: a pass that only ranks (`ranking_only`) wholly in int8
        under the int8 `recompute_gemm`, else the first `lead` rows in int8 and the rest in bf16
        (`quant.int8_lead_rows`; 0: as the model's prefill)."""
        if self.recompute_gemm == "int8" and _RANKING_ONLY.get():
            return prefill_gemm_as("int8")
        return int8_lead_rows(lead)

    def _recompute(self, cache: KVCache, slot_ids: list[int], slots: list[int],
                   n_layers: int | None = None, taper: tuple[int, set] | None = None) -> torch.Tensor:
        """Compute the tokens at cache `slots` (sorted) fresh through all layers (or the first `n_layers`),
        in place; each attends to everything before it in the cache (reused and fresh alike). Returns the
        logits of the last slot, (1, 1, vocab) (with `n_layers`: the hidden states, see `model.forward`).
        taper: (layer j, dropped slots): the dropped slots (never the last) run through layers below j,
        get their layer-j K/V from the hidden states they reached there, and stop (CacheBlend's gradual
        filtering); the others go on through every layer."""
        s = torch.tensor(slots)
        ids = torch.tensor([[slot_ids[i] for i in slots]])
        if taper is None or not taper[1]:
            return self.model(ids, cache.positions[s], cache, slots=s, n_layers=n_layers)
        layer, dropped = taper
        h = self.model(ids, cache.positions[s], cache, slots=s, n_layers=layer)  # (1, n, hidden)
        drop = torch.tensor([i in dropped for i in slots])
        self.model.write_layer_kv(layer, h[:, drop], cache, s[drop])
        keep = ~drop
        return self.model(ids[:, keep], cache.positions[s[keep]], cache, slots=s[keep], n_layers=n_layers,
                          start=(layer, h[:, keep]))

    def _choose(self, select, cache: KVCache, slot_ids, spans, fresh, ratio: float, question: list[int],
                scores=None) -> list[int]:
        """The passage slots block+recompute recomputes: see `SELECT_METHODS`; "question" gives them best
        first (`_top_windows`), the others sorted. spans: (start, end) of each passage (header and body)
        in the cache; fresh: slots computed in the final pass anyway; scores: measured per-passage scores
        for "question" (see `_assemble`), or None."""
        if isinstance(select, tuple):
            return sorted(i for r in select if r <= len(spans) for i in range(*spans[r - 1]))
        if select == "lead":
            return [i for a, b in spans for i in range(a, a + int(round(ratio * (b - a))))]
        if select == "deviation":
            return self._select(cache, slot_ids, spans, fresh, ratio)
        if scores is not None and self.select_layers is None and self.select_score == "mean":
            if len(scores) != len(spans):
                raise ValueError(f"scores: {len(scores)} passages' scores for {len(spans)} passages")
            mass = torch.zeros(cache.length)
            for (a, b), sc in zip(spans, scores):
                n = min(b - a, len(sc))
                mass[b - n:b] = sc[len(sc) - n:].float().cpu()
            return self._top_windows(mass, spans, ratio, self.select_window)
        return self._select_by_question(cache, slot_ids, spans, fresh, ratio, question)

    def _refine(self, cache: KVCache, slot_ids, spans, ranked: list[int], question: list[int]
                ) -> tuple[set, list[int]]:
        """Two rounds of "question" selection (`select_refine`): of the len(ranked) slots the budget allows
        (`ranked`, best first), all but round(select_refine x passage tokens) are recomputed now, in place
        (int8 under the int8 `recompute_gemm`); the question then ranks the slots again over that cache
        (`_question_mass`) and the best windows among the slots not yet recomputed fill the rest. Returns
        (the slots recomputed here, the second round's slots), which the caller's final pass computes."""
        n_passage = sum(b - a for a, b in spans)
        n2 = min(int(round(self.select_refine * n_passage)), len(ranked))
        first = sorted(ranked[:len(ranked) - n2])
        if not first or n2 == 0:
            return set(), list(ranked)
        with self._gemm(len(first)):
            self._recompute(cache, slot_ids, first)
        mass = self._question_mass(cache, slot_ids, [], question)
        done = set(first)
        windows = []  # (score of the window's slots not yet recomputed, its open slots)
        for a, b in spans:
            for w in range(a, b, self.select_window):
                open_ = [i for i in range(w, min(w + self.select_window, b)) if i not in done]
                if open_:
                    windows.append((float(mass[open_].sum()), open_))
        windows.sort(key=lambda t: -t[0])
        second = []
        for _, open_ in windows:
            if len(second) >= n2:
                break
            second += open_[:n2 - len(second)]
        return done, second

    def _question_mass(self, cache: KVCache, slot_ids, fresh, question: list[int]) -> torch.Tensor:
        """The question's attention to each cache slot (cache length,): the question (and the `fresh`
        slots) run once over the cache, in a ranking pass whose states are dropped, the probabilities
        reduced as `_select_by_question` says."""
        from ldqa.attention.debias import DebiasKV

        length = cache.length
        q_slots = list(range(length, length + len(question)))
        k0 = cache.keys(0)  # (1, kv_heads, length, head_dim)
        zeros = torch.zeros(cache.num_layers, k0.shape[1], len(question), k0.shape[3], dtype=k0.dtype,
                            device=k0.device)
        cache.extend(zeros, zeros.clone(), torch.arange(length, length + len(question)))
        rec = DebiasKV(n_record=len(question), scale=self.model.cfg.attn_scale)
        cache.policy = rec
        try:
            with prefill_gemm_as(self.recompute_gemm):  # a ranking pass: its states are dropped below
                self._recompute(cache, slot_ids + list(question), sorted(fresh) + q_slots, self.select_layers)
            return token_mass(self.model, cache, rec.queries, torch.tensor(q_slots), cache.length,
                              self.select_score)[:length]
        finally:
            cache.policy = None
            cache.truncate(length)

    def _select_by_question(self, cache: KVCache, slot_ids, spans, fresh, ratio: float, question: list[int],
                            window: int | None = None) -> list[int]:
        """Question-aware selection over the whole context (ProphetKV, A^3, CacheClip, 2025: rank context
        tokens by the question's attention to them and recompute the top share in contiguous pieces).

        The question (and any fresh header) is run once over the assembled block cache, its queries
        recorded at the global-attention layers (`debias.DebiasKV`); each passage slot's score is the
        attention probability the question's tokens give it (mean over those layers, heads and question
        tokens, `token_mass`; `select_score` picks another reduction). With `select_layers` set, only the
        first that many layers run and rank; with `select_skip_first`, the first passage (stored right
        after the shared prefix, as in the full prompt) is never chosen. Passages are cut into windows of
        `window` tokens (default `select_window`) from their start, a window's score is its slots' sum,
        and the best windows are taken until round(ratio x passage tokens) slots are chosen (the last
        window may be cut). Cost: one pass of the question over the cache, plus (question tokens x cache
        length) scores per global layer.
        """
        window = window or self.select_window
        n_total = sum(b - a for a, b in spans)
        budget = int(round(ratio * n_total))
        if budget == 0 or len(question) == 0:
            return []
        if budget >= n_total:
            return [i for a, b in spans for i in range(a, b)]
        mass = self._question_mass(cache, slot_ids, fresh, question)
        return self._top_windows(mass, spans, ratio, window)

    def _top_windows(self, mass: torch.Tensor, spans, ratio: float, window: int) -> list[int]:
        """The "question" selection's choice from per-slot scores `mass` (cache length,): passages cut into
        windows of `window` tokens from their start, a window's score its slots' sum, the best windows
        taken until round(ratio x passage tokens) slots are chosen (the last window may be cut); with
        `select_skip_first`, never the first passage; with `select_whole` = n, the n passages of the
        largest summed score are taken whole first (cut at the budget), the windows of the others after.
        Returns the chosen slots (with `select_whole`, whole passages first, then windows best first)."""
        n_total = sum(b - a for a, b in spans)
        budget = int(round(ratio * n_total))
        if budget == 0:
            return []
        if budget >= n_total:
            return [i for a, b in spans for i in range(a, b)]
        open_spans = spans[1:] if self.select_skip_first and len(spans) > 1 else list(spans)
        chosen = []
        if self.select_whole > 0:
            ranked = sorted(open_spans, key=lambda ab: -float(mass[ab[0]:ab[1]].sum()))
            for a, b in ranked[:self.select_whole]:
                chosen += range(a, min(b, a + budget - len(chosen)))
            open_spans = ranked[self.select_whole:]
        windows = []  # (score, start, end)
        for a, b in open_spans:
            for w in range(a, b, window):
                e = min(w + window, b)
                windows.append((float(mass[w:e].sum()), w, e))
        windows.sort(key=lambda t: -t[0])
        for _, w, e in windows:
            if len(chosen) >= budget:
                break
            chosen += range(w, min(e, w + budget - len(chosen)))
        return chosen

    def _select(self, cache: KVCache, slot_ids, spans, fresh, ratio: float) -> list[int]:
        """CacheBlend token selection (Yao et al. 2024, sec. 4.3).

        Layer-0 K/V depend only on (token, position), so the reused ones are already exact; layer 0's
        *output* depends on the context. Running layer 0 for every body and header token over the
        assembled cache gives the exact full-attention input of layer 1; the layer-1 keys it implies are
        compared with the reused layer-1 keys, and per block the `ratio` fraction of tokens with the
        largest L2 deviation (summed over KV heads) is chosen. Cost: one layer of a full prefill.
        """
        slots = sorted(set(i for a, b in spans for i in range(a, b)) | set(fresh))
        s = torch.tensor(slots)
        pos = cache.positions[s]
        h = self.model(torch.tensor([[slot_ids[i] for i in slots]]), pos, cache, slots=s, n_layers=1)  # (1, n, hid)
        k1 = self.model.layer_keys(1, h, pos)  # (1, kvh, n, d)
        dev = (k1 - cache.keys(1)[:, :, s]).norm(dim=-1).sum(dim=1)[0]  # (n,)
        by_slot = dict(zip(slots, dev.tolist()))
        chosen = []
        for a, b in spans:
            ranked = sorted(range(a, b), key=lambda i: -by_slot[i])
            chosen += ranked[: int(round(ratio * (b - a)))]
        return sorted(chosen)

    # ------------------------------------------------------------------ self-check
    def self_check(self, n_tokens: int = 24, offset: int = 4096, atol: float | None = None) -> bool:
        """Numeric check that re-encoded keys equal keys computed at the target positions (all layers).

        Encodes a fixed token sequence at positions 0.. and at `offset`.., rotates the first by `offset`
        and compares: max abs error <= atol * max(1, largest key); `check_error` keeps the measured
        error / max(1, largest key). atol: 2e-3 with fp32 weights and an fp32 KV cache; otherwise 4 units
        in the last place of bf16 (4 * 2^-7 = 0.031): a bf16 cache rounds both sides, and quantized or bf16
        weights take bf16 activations into their matmuls, so the two encodings' hidden states already
        differ by bf16 rounding below the keys (measured up to 0.022 on tiny Gemma 3 in int4, fp32 cache).
        The encodings take the bf16 prefill GEMM whatever the model's (`quant.prefill_gemm_as`): the int8
        GEMM rounds each row to 1/127 of its largest value, where the two encodings' last-place differences
        flip whole steps (Gemma 3 270M: 0.1 of the largest key), which says nothing of the rotation.
        A wrong rotation errs by O(1). On failure sets enabled=False with the reason (logged); returns
        enabled.
        """
        if atol is None:
            exact = self.model.kv_dtype == torch.float32 and getattr(self.model, "weight_format", "fp32") == "fp32"
            atol = 2e-3 if exact else 4 * torch.finfo(torch.bfloat16).eps
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, min(self.model.cfg.vocab_size, 20000), (1, n_tokens), generator=g)
        caches = []
        for start in (0, offset):
            c = self.model.new_cache(capacity=n_tokens)
            with prefill_gemm_as("bf16"):  # the int8 GEMM's per-row rounding flips on the two encodings' ulps
                self.model(ids, torch.arange(start, start + n_tokens), c)
            caches.append(c.block(0, n_tokens)[0])
        moved = reencode_keys_(self.model, caches[0].clone(), offset)
        err = (moved - caches[1]).abs().max().item()
        scale = caches[1].abs().max().item()
        self.check_error = err / max(1.0, scale)
        if not err <= atol * max(1.0, scale):
            self.enabled = False
            self.disabled_reason = (f"RoPE re-encoding self-check failed (max abs error {err:.2e} at offset "
                                    f"{offset}); block reuse is off, full attention is used")
            log.warning(self.disabled_reason)
        return self.enabled


@dataclass(frozen=True)
class BlockScaling:
    """APE's attention scaling over reused blocks (Yang et al., ICLR 2025, "APE: Faster and Longer
    Context-Augmented Generation via Adaptive Parallel Encoding", sec. 4): the question's and the answer's
    attention scores to passage tokens (the shared prefix and the question itself excluded) are divided
    by `temperature` and their weights multiplied by `scale` before the softmax normalizes, so
    score' = score / temperature + log(scale). (1, 1) is plain block attention. Raises ValueError for a
    temperature or scale <= 0."""

    temperature: float = 1.0
    scale: float = 1.0

    def __post_init__(self):
        if not (self.temperature > 0 and self.scale > 0):
            raise ValueError(f"block scaling needs temperature > 0 and scale > 0, got {self}")

    @property
    def identity(self) -> bool:
        return self.temperature == 1.0 and self.scale == 1.0


@dataclass
class ScaledKV:
    """Attention hook (`kv_cache.AttentionPolicy`) applying a `BlockScaling` in the global layers: queries
    at positions >= `query_from` (the question, then each answer token) see the keys of cache slots
    [start, end) (the passages) with score / temperature + log(scale); other queries (recomputed passage
    tokens) and keys are exact. Computed with einsum in fp32 like `debias.DebiasKV` (no dispatch kernel
    takes a per-key score transform); (n x L) scores per layer for n query tokens. `inner`: another
    policy called first for its side effects (e.g. a `DebiasKV` recording the question's queries); its
    own attention output is not used."""

    scaling: BlockScaling
    start: int
    end: int
    query_from: int
    attn_scale: float
    inner: object = None

    def forward(self, layer: int, q, k, v, q_pos, k_pos, slots):
        """q: (1, hq, n, d); k, v: (1, hkv, L, d); q_pos (n,), k_pos (L,). Returns (1, hq, n, d) or None."""
        if self.inner is not None:
            self.inner.forward(layer, q, k, v, q_pos, k_pos, slots)
        rows = q_pos >= self.query_from  # (n,)
        if not bool(rows.any()):
            return None
        b, hq, n, d = q.shape
        hkv, L = k.shape[1], k.shape[2]
        qg = q.float().reshape(b, hkv, hq // hkv, n, d)
        s = torch.einsum("bhgnd,bhld->bhgnl", qg, k.float()) * self.attn_scale  # (b, hkv, g, n, L)
        cols = torch.zeros(L, dtype=torch.bool, device=q.device)
        cols[self.start:min(self.end, L)] = True
        sel = rows[:, None] & cols[None, :]  # (n, L)
        t = self.scaling
        s = torch.where(sel, s / t.temperature + float(torch.log(torch.tensor(t.scale))), s)
        s = s.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
        out = torch.einsum("bhgnl,bhld->bhgnd", torch.softmax(s, dim=-1), v.float())
        return out.reshape(b, hq, n, d).to(q.dtype)


def token_mass(model, cache: KVCache, queries: dict, q_slots: torch.Tensor, length: int,
               reduce: str = "mean") -> torch.Tensor:
    """Attention probability per cache slot from recorded queries: (length,) float on the CPU, the mean over the
    recorded layers, their query heads and the query tokens of softmax(q k^T * attn_scale) with causal
    masking by position (`reduce` "mean"; "max": each layer's maximum over heads and query tokens, "last":
    the last query token's mean over heads, each averaged over the layers). queries: layer -> (hq, T, d)
    the queries of the tokens at cache slots q_slots (T,), after RoPE (`debias.DebiasKV(n_record=T)`);
    the slots' keys must be in the cache (the scores are against its first `length` slots). Raises
    ValueError when no query was recorded or `reduce` is not one of SELECT_SCORES.

    Computed with einsum, not through `kernels.dispatch`, as `debias.passage_mass` is (it needs the
    probabilities, which no dispatch kernel returns): (hq, T, length) scores per layer."""
    if not queries:
        raise ValueError("token_mass: no recorded queries (the pass had no global-attention layer)")
    if reduce not in SELECT_SCORES:
        raise ValueError(f"token_mass: reduce must be one of {', '.join(SELECT_SCORES)}, got {reduce!r}")
    pos = cache.positions[:length]
    causal = pos[None, :] <= pos[q_slots][:, None]  # (T, L)
    total = torch.zeros(length, device=pos.device)
    for layer, q in queries.items():
        keys = cache.keys(layer)[0, :, :length].float()  # (hkv, L, d)
        hkv, _, d = keys.shape
        qg = q.view(hkv, -1, q.shape[1], d)  # (hkv, g, T, d)
        s = torch.einsum("hgtd,hld->hgtl", qg, keys) * model.cfg.attn_scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)  # (hkv, g, T, L)
        total += (p.mean(dim=(0, 1, 2)) if reduce == "mean" else p.amax(dim=(0, 1, 2)) if reduce == "max"
                  else p[:, :, -1].mean(dim=(0, 1)))
    return (total / len(queries)).cpu()


def _to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A private copy of a stored block's tensor `t` (on the CPU) in `dtype` on `device`: on CUDA through
    pinned host memory and a copy that does not block the host, so reading the next block from the store
    overlaps it (the kernels that use it run after it, in the same stream)."""
    if device.type == "cpu":
        return t.to(dtype, copy=True)
    return t.pin_memory().to(device, dtype, non_blocking=True)


def _finite(*tensors: torch.Tensor) -> bool:
    """Whether every value of the tensors is finite (one reduction each: NaN/inf propagate into the sum)."""
    return all(bool(torch.isfinite(t.float().sum())) for t in tensors)
