"""Retrieval attention for decoding over long contexts (docs/attention.md).

Source: RetrievalAttention (Liu et al. 2024), sections 3-4: each decode step attends exactly to a static
set (the attention sink and the recent window) plus the top-k keys that a vector index over the cached
keys returns for the step's query; the two partial attentions are merged by their log-sum-exp. Related:
Quest (query-aware page selection), DuoAttention (local layers keep only a window).

Zones of the cache of one global-attention layer, slots in order (L = cached tokens, E = index end):

    [0, sink)        sink zone, always attended
    [sink, E)        indexed zone: only the top_k_keys slots the KeyIndex returns are attended
    [E, L)           recent zone, always attended (E = L - window when the index is built; tokens
                     decoded afterwards join this zone until it is twice the window, then the index
                     is rebuilt over the grown context)

Worked example, sink 2, window 3, L = 10 at build: E = 7; zones {0, 1} | {2..6} indexed | {7, 8, 9}.
With top_k_keys 2 and the index returning {3, 5}, a query attends to {0, 1, 3, 5, 7, 8, 9}. The two
parts (sink + recent, retrieved) are disjoint, so merging them by LSE is exact attention over the union.

With `estimate=True` a third part joins the merge: the estimation zone (RetroInfer, section 4), an
approximation of the attention the indexed keys *outside* the retrieved set would get, from the IVF
clusters' centroids, counts and value sums (`KeyIndex.estimate`). Gemma 3 270M's global layers attend
diffusely (the exact top-100 keys carry 65-73% of the mass); the estimate puts an approximation of the
rest back. Measured: on key-value retrieval it brought 93 of 100 answers to full attention's text (91
without it); at 32K neither variant kept full attention's text past ~8 tokens.

Step carry-over (`follow`): the previous step's best `follow` retrieved slots and their successors
(slot + 1) are scored as candidates too. Copying heads (induction heads, Olsson et al. 2022) attend to
the token after the one they attended to a step before; these keys are out of distribution for the
question's queries the aware index is built from, and on the key-value retrieval task the index alone
missed the exact top-1 key (a copied value's token, carrying up to half the attention mass) in 13 of
64 copy steps; with follow = 8 in 5 (6 recorded examples; docs/results.md).

Only layers with global attention use it (every layer of SmolLM2; Gemma 3's global layers, whose local
layers keep their sliding window). The policy (what is indexed, what is retrieved) is `RetrievalKV`; the
attention math goes through `ldqa.kernels.dispatch` (decode_attention + merge_lse).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ldqa.indexes.key_index import KeyIndex, KeyIndexConfig
from ldqa.kernels import dispatch


@dataclass
class RetrievalConfig:
    """Settings of retrieval attention.

    top_k_keys: keys retrieved per KV head per step (None = every indexed key: exact attention, the
        reference path; 200 by default: at 100, key-value retrieval over 140 pairs lost 2 of 100 copies to
        full attention, at 200 none, with the same keys touched, docs/results.md);
    window: recent-zone size (tokens); sink: sink-zone size (tokens);
    index: "aware" (query-linked + IVF, attention-aware) | "keys" (key-only IVF) | "exact" (full scan);
    scan_fraction, cluster_size: the index's search budget and cluster size (`KeyIndexConfig`);
    min_indexed: with fewer indexable keys than this the layer attends to everything (no index): below a
        few thousand keys an index touches about as many vectors as exact attention reads;
    follow: carry-over candidates per KV head: the previous step's `follow` best retrieved slots and their
        successors (0 = off; adds up to 2 * follow touched keys per step);
    estimate: add the estimation zone (cluster centroids stand in for the keys not retrieved; RetroInfer)
        to the merge; costs scoring the centroids (indexed keys / cluster_size per KV head) each step. Off by
        default: at 32K tokens it cost 0.8% more keys touched and ~1.5x the attention time (docs/results.md).
    Raises ValueError on out-of-range settings.
    """

    top_k_keys: int | None = 200
    window: int = 128
    sink: int = 4
    index: str = "aware"
    scan_fraction: float = 0.02
    cluster_size: int = 128
    min_indexed: int = 2048
    estimate: bool = False
    follow: int = 8

    def __post_init__(self):
        if self.top_k_keys is not None and self.top_k_keys < 1:
            raise ValueError(f"top_k_keys must be >= 1 or None (all keys), got {self.top_k_keys}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 token, got {self.window}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0 tokens, got {self.sink}")
        if self.follow < 0:
            raise ValueError(f"follow must be >= 0 slots, got {self.follow}")
        if self.min_indexed < 1:
            raise ValueError(f"min_indexed must be >= 1, got {self.min_indexed}")
        self.index_config()  # validates index / scan_fraction / cluster_size

    def index_config(self) -> KeyIndexConfig:
        return KeyIndexConfig(kind=self.index, scan_fraction=self.scan_fraction, cluster_size=self.cluster_size)


@dataclass
class RetrievalStats:
    """Counters of one generation. Per (global layer, decode step, KV head): keys attended (sink +
    recent + retrieved), keys touched (sink + recent + vectors the search touched), context length."""

    steps: int = 0  # (layer, step) pairs served by the index
    dense_steps: int = 0  # (layer, step) pairs that attended to everything (context under min_indexed)
    keys_attended: int = 0
    keys_touched: int = 0
    context_keys: int = 0
    builds: int = 0
    build_ms: float = 0.0
    index_kind: str = ""

    @property
    def keys_attended_per_step(self) -> float:
        """Keys attended per (layer, step) the index served, and KV head."""
        return self.keys_attended / max(1, self.steps)

    @property
    def keys_touched_per_step(self) -> float:
        """Keys touched per (layer, step) the index served, and KV head."""
        return self.keys_touched / max(1, self.steps)

    @property
    def keys_touched_fraction(self) -> float:
        """Keys touched as a share of the context's keys."""
        return self.keys_touched / max(1, self.context_keys)

    def to_dict(self) -> dict:
        """The `Answer.timings` keys of retrieval attention."""
        return {"retrieval_steps": self.steps, "retrieval_dense_steps": self.dense_steps,
                "keys_attended_per_step": self.keys_attended_per_step,
                "keys_touched_per_step": self.keys_touched_per_step,
                "keys_touched_fraction": self.keys_touched_fraction,
                "index_builds": self.builds, "index_build_ms": self.build_ms, "index_kind": self.index_kind}


@dataclass
class _LayerState:
    index: KeyIndex | None = None
    end: int = 0  # E: slots [sink, end) are indexed
    stale: bool = True
    prev: torch.Tensor | None = None  # (kv_heads, follow) the previous step's best retrieved slots


class RetrievalKV:
    """The retrieval-attention policy of one sequence; attach it to a KVCache as `cache.policy`.

    The model calls `forward` on every pass of a global layer: multi-token passes go to
    `observe_prefill(layer, q)` (it keeps the last queries: the index's view of the query distribution,
    and marks the index stale), single-token decode steps to `attend(layer, q, k, v)`.
    """

    def __init__(self, cfg: RetrievalConfig, scale: float):
        self.cfg, self.scale = cfg, scale
        self.stats = RetrievalStats(index_kind=cfg.index)
        self._layers: dict[int, _LayerState] = {}
        self._queries: dict[int, torch.Tensor] = {}

    def forward(self, layer: int, q, k, v, q_pos, k_pos, slots):
        """The model's hook (global layers): multi-token passes are observed (their attention is
        unchanged: returns None); single-token decode steps attend through the index."""
        if q.shape[2] > 1:
            self.observe_prefill(layer, q)
            return None
        return self.attend(layer, q, k, v) if slots is None else None

    def observe_prefill(self, layer: int, q: torch.Tensor) -> None:
        """q: (1, q_heads, n, d) queries of a prefill pass; keeps the last `max_queries` of them."""
        m = self.cfg.index_config().max_queries
        self._queries[layer] = q[0, :, -m:].detach().to(torch.float32, copy=True)  # (hq, m, d), not a view
        self._layers.setdefault(layer, _LayerState()).stale = True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One decode step of one global layer.

        q: (1, q_heads, 1, d), the new token's queries; k, v: (1, kv_heads, L, d), the layer's cache
        including the new token. Returns the attention output (1, q_heads, 1, d).
        """
        L, hkv = k.shape[2], k.shape[1]
        st = self._state(layer, k, v)
        if st.index is None:
            self.stats.dense_steps += 1
            return dispatch.decode_attention(q, k, v, scale=self.scale)[0]
        none = torch.full((1, hkv, 1), -1, dtype=torch.long, device=q.device)
        steady = dispatch.decode_attention(q, k, v, indices=none, sink=self.cfg.sink, window=L - st.end,
                                           scale=self.scale)
        n_static = min(self.cfg.sink, st.end) + (L - st.end)
        if self.cfg.top_k_keys is None:  # every indexed key: exact, through the same merge
            idx = torch.arange(self.cfg.sink, st.end, device=q.device).expand(1, hkv, -1)
            touched, found = st.end - self.cfg.sink, st.end - self.cfg.sink
        else:
            prior = None
            if self.cfg.follow and st.prev is not None:
                prior = torch.cat([st.prev, torch.where(st.prev >= 0, st.prev + 1, st.prev)], dim=1)
            res = st.index.search(q[0, :, 0].cpu(), self.cfg.top_k_keys, prior)  # the index is on the CPU
            idx = res.slots[None].to(q.device)  # (1, hkv, k)
            st.prev = res.slots[:, : self.cfg.follow] if self.cfg.follow else None
            touched, found = res.scanned / hkv, int((res.slots >= 0).sum()) / hkv
        retrieved = dispatch.decode_attention(q, k, v, indices=idx, scale=self.scale)
        out, lse = dispatch.merge_lse(*steady, *retrieved)
        if self.cfg.estimate and self.cfg.top_k_keys is not None and st.index.can_estimate:
            est_out, est_lse, est_touched = st.index.estimate(q[0, :, 0].cpu(), idx[0].cpu(), v[0].cpu(),
                                                              res.centroid_scores)
            out, _ = dispatch.merge_lse(out, lse, est_out.to(out.device, out.dtype).view_as(out),
                                        est_lse.to(lse.device).view_as(lse))
            touched += est_touched / hkv
        s = self.stats
        s.steps += 1
        s.keys_attended += n_static + found
        s.keys_touched += n_static + touched
        s.context_keys += L
        return out

    def _state(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> _LayerState:
        """The layer's index, (re)built when stale: after a prefill, after the cache was truncated below
        the index end, or when the recent zone has grown past twice the window."""
        st = self._layers.setdefault(layer, _LayerState())
        L = k.shape[2]
        if not st.stale and st.end <= L and L - st.end <= 2 * self.cfg.window:
            return st
        end = L - self.cfg.window
        st.stale, st.end, st.index, st.prev = False, max(end, 0), None, None
        if end - self.cfg.sink < self.cfg.min_indexed:
            st.end = L  # too short to index: everything is "recent" (dense in attend)
            return st
        t0 = time.perf_counter()
        if self.cfg.top_k_keys is not None:
            icfg = self.cfg.index_config()
            queries = self._queries.get(layer)
            if icfg.kind == "aware" and queries is None:  # no prefill seen (e.g. cache filled by extend)
                icfg.kind = "keys"
                self.stats.index_kind = "keys (no prefill queries)"
            # the index lives on the CPU (faiss k-means, its scans); on CUDA its searches move one query
            values = v[0, :, self.cfg.sink:end].cpu() if self.cfg.estimate else None
            queries = queries.cpu() if queries is not None else None
            st.index = KeyIndex(k[0, :, self.cfg.sink:end].cpu(), self.cfg.sink, icfg, self.scale, queries, values)
        else:
            st.index = True  # marker: exact path needs no structure
        self.stats.builds += 1
        self.stats.build_ms += (time.perf_counter() - t0) * 1000
        return st
