"""ANN indexes over one layer's cached keys, for RetrievalAttention-style decoding (docs/attention.md).

Source: RetrievalAttention (Liu et al. 2024), section 3: decode queries and cached keys are out of
distribution for each other, so an index built on the keys alone has to scan many keys to find the ones
a query attends to; an index that knows where *queries* land (their nearest keys, linked at build time)
reaches the same recall while touching 1-3% of the keys. RetroInfer's wave index adds the cluster
ranking used here: score a cluster by softmax(q . centroid) summed over the GQA group.

Two kinds, both over the keys of every KV head of one layer:

- ``"keys"``: key-only IVF. faiss k-means puts the keys into clusters of about `cluster_size`; a search
  ranks the clusters by the group's summed softmax over the centroids and scans the best ones until
  `scan_fraction` of the keys is reached, scoring those keys exactly.
- ``"aware"``: the IVF above plus query links (a simplified RoarGraph projection). At build time each of
  the prefill's last queries (the question's tokens: the same distribution as the decode queries) is
  linked to its exact top-`link_k` keys. A search routes each of the group's queries to its `route`
  most similar stored queries (cosine: queries are in distribution with each other) and takes their
  linked keys as candidates, then fills the rest of the `scan_fraction` budget from the IVF.

Centring the keys (subtracting their mean) is a no-op for L2 k-means (translation invariant) and for a
query's ranking of keys (q . (k - mu) = q . k - q . mu, the same shift for every key), so it is not a
knob here; measured with and without it on Gemma 3 270M keys: identical recall.

Keys touched per search = centroids scored + stored queries compared + keys scored exactly. This is
what `SearchResult.scanned` counts.

Estimation zone (RetroInfer, section 4: the wave index's "estimation zone"): built with the layer's
values, each IVF cluster also keeps its key count and value sum, so `estimate` can approximate the
attention that the keys *not* retrieved would receive: every remaining key of cluster c is scored as its
centroid, logit_c = scale * q . centroid_c + log(count_c), carrying the cluster's mean value. The result
(an output and its LSE) merges with the exact parts by LSE. It restores the diffuse mass that a top-k set
misses (on Gemma 3 270M's global layers the exact top-100 keys carry only 65-73% of it) at the cost of
scoring the centroids (n / cluster_size vectors per KV head).

A search returns, per KV head, the `k` candidate slots with the highest attention mass summed over the
head's query group (softmax over the scanned keys, per query head): the same ranking as
`exact_top_k`, which defines the recall target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

KINDS = ("aware", "keys", "exact")


@dataclass
class KeyIndexConfig:
    """Settings of a `KeyIndex`.

    kind: "aware" (query links + IVF), "keys" (key-only IVF) or "exact" (scan everything: the reference);
    cluster_size: mean keys per IVF cluster (n_clusters = n_keys // cluster_size, at least 1);
    scan_fraction: keys scored exactly per search, as a fraction of the indexed keys, at least the search's k (the IVF budget;
        query-linked candidates count against it first);
    link_k: keys linked to each stored prefill query; route: stored queries each decode query follows;
    max_queries: prefill query tokens kept per layer (the last ones: the question and the text just
        before it; 128 measured better than 32/64 and about as good as 256 on Gemma 3 270M);
    kmeans_iters, seed: faiss k-means settings (deterministic for a seed).
    """

    kind: str = "aware"
    cluster_size: int = 128
    scan_fraction: float = 0.02
    link_k: int = 100
    route: int = 8
    max_queries: int = 128
    kmeans_iters: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.cluster_size < 1:
            raise ValueError(f"cluster_size must be >= 1, got {self.cluster_size}")
        if not 0.0 < self.scan_fraction <= 1.0:
            raise ValueError(f"scan_fraction must be in (0, 1], got {self.scan_fraction}")
        if self.link_k < 1 or self.route < 1 or self.max_queries < 1:
            raise ValueError("link_k, route and max_queries must be >= 1")


@dataclass
class SearchResult:
    """slots: (kv_heads, k) int64 cache slots, -1 = padding; scanned: vectors touched (all heads);
    centroid_scores: per KV head, the (g, c) scaled q . centroid scores the search computed (None for a
    head whose search did not score its centroids): `estimate` reuses them instead of scoring again."""

    slots: torch.Tensor
    scanned: int
    centroid_scores: list | None = None


def exact_top_k(q: torch.Tensor, keys: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    """Exact top-k keys per KV head by the attention mass the head's query group gives them.

    q: (q_heads, d); keys: (kv_heads, n, d). Returns (kv_heads, min(k, n)) indices into keys, best first.
    """
    hkv, n, d = keys.shape
    qg = q.float().view(hkv, -1, d)  # (hkv, g, d)
    p = torch.softmax(torch.einsum("hgd,hnd->hgn", qg, keys.float()) * scale, dim=-1).sum(1)  # (hkv, n)
    return p.topk(min(k, n), dim=-1).indices


def _kmeans(x: torch.Tensor, n_clusters: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """faiss k-means: x (n, d) float32 -> centroids (c, d), assignment (n,) int64."""
    import faiss
    import numpy as np

    xn = np.ascontiguousarray(x.numpy(), dtype="float32")
    if n_clusters <= 1:
        return x.mean(0, keepdim=True), torch.zeros(len(x), dtype=torch.long)
    km = faiss.Kmeans(xn.shape[1], n_clusters, niter=iters, seed=seed, verbose=False,
                      max_points_per_centroid=64, min_points_per_centroid=1)
    km.train(xn)
    assign = km.index.search(xn, 1)[1][:, 0]
    return torch.from_numpy(km.centroids.copy()), torch.from_numpy(assign.astype("int64"))


class _HeadIndex:
    """The IVF lists and query links of one KV head (keys live in the caller's cache, not here)."""

    def __init__(self, keys: torch.Tensor, queries: torch.Tensor | None, cfg: KeyIndexConfig, scale: float,
                 values: torch.Tensor | None = None):
        n = keys.shape[0]  # keys: (n, d) float32; values: (n, d_v) or None
        self.n = n
        c = max(1, n // cfg.cluster_size)
        self.centroids, assign = _kmeans(keys, c, cfg.kmeans_iters, cfg.seed)  # (c, d), (n,)
        self.assign = assign
        self.counts = torch.bincount(assign, minlength=len(self.centroids))  # (c,)
        self.vsum = None  # (c, d_v) float32: the estimation zone's value sums
        if values is not None:
            self.vsum = torch.zeros(len(self.centroids), values.shape[-1]).index_add_(0, assign, values.float())
        self.queries = self.links = None
        if queries is not None and len(queries):
            s = queries @ keys.T * scale  # (m, n)
            self.links = s.topk(min(cfg.link_k, n), dim=-1).indices  # (m, link_k)
            self.queries = queries / queries.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (m, d)

    def candidates(self, qg: torch.Tensor, cfg: KeyIndexConfig, scale: float, k: int = 1):
        """qg: (g, d) -> candidate key ids (m,), vectors touched to find them, and the (g, c) centroid
        scores when they were computed (else None). The budget is scan_fraction of the keys but at least
        `k` (a top-k search scores at least k keys). The plain one-head form of `KeyIndex._candidates`
        (which batches the heads): kept as its readable reference and tested against it."""
        budget = max(1, int(cfg.scan_fraction * self.n), k)
        if budget >= self.n:  # the budget covers every key: a full scan
            return torch.arange(self.n), self.n, None
        parts, touched, cscore = [], 0, None
        if self.queries is not None:
            sim = (qg / qg.norm(dim=-1, keepdim=True).clamp_min(1e-6)) @ self.queries.T  # (g, m)
            near = sim.topk(min(cfg.route, sim.shape[1]), dim=-1).indices.flatten().unique()
            parts.append(self.links[near].flatten().unique())
            touched += len(self.queries)
        left = budget - (len(parts[0]) if parts else 0)
        if left > 0:  # fill the budget from the IVF: clusters ranked by the group's summed softmax
            touched += len(self.centroids)
            cscore = qg @ self.centroids.T * scale  # (g, c)
            score = torch.softmax(cscore, dim=-1).sum(0)  # (c,)
            ranked = score.argsort(descending=True)
            cum = self.counts[ranked].cumsum(0)
            take = ranked[: int((cum < left).sum()) + 1].tolist()
            parts.append(torch.isin(self.assign, torch.tensor(take)).nonzero().flatten())  # their keys
        cand = torch.cat(parts).unique() if len(parts) > 1 else parts[0]
        return cand, touched + len(cand), cscore


class KeyIndex:
    """ANN index over the keys of one layer, all KV heads (see the module docstring).

    build: keys (kv_heads, n, d) of cache slots [base, base + n); queries (q_heads, m, d) prefill queries
    (needed by kind "aware"; ignored otherwise); values (kv_heads, n, d_v) of the same slots, optional:
    with them the index can `estimate` the keys a search leaves out. `build_ms` is the build time (ms).
    Raises ValueError on an empty key set, a kind "aware" index without queries, or values whose shape
    does not match the keys.
    """

    def __init__(self, keys: torch.Tensor, base: int, cfg: KeyIndexConfig, scale: float,
                 queries: torch.Tensor | None = None, values: torch.Tensor | None = None):
        if keys.ndim != 3 or keys.shape[1] == 0:
            raise ValueError(f"keys must be (kv_heads, n >= 1, head_dim), got {tuple(keys.shape)}")
        if cfg.kind == "aware" and queries is None:
            raise ValueError("an 'aware' KeyIndex needs the prefill queries (queries=...)")
        if values is not None and values.shape[:2] != keys.shape[:2]:
            raise ValueError(f"values {tuple(values.shape)} must be (kv_heads, n, d_v) like keys {tuple(keys.shape)}")
        t0 = time.perf_counter()
        self.cfg, self.scale, self.base = cfg, scale, base
        self.keys = keys.float()  # (hkv, n, d): a float32 view/copy used for exact scoring
        hkv, n, d = keys.shape
        self.n = n
        self.heads = []
        if cfg.kind != "exact":
            qs = None
            if cfg.kind == "aware":
                qs = queries.float()[:, -cfg.max_queries:].reshape(hkv, -1, d)  # (hkv, g*m, d) per KV head
            self.heads = [_HeadIndex(self.keys[h], None if qs is None else qs[h], cfg, scale,
                                     None if values is None else values[h]) for h in range(hkv)]
            # the heads' structures stacked, so that one search serves every KV head (same n, same c)
            self.centroids = torch.stack([h.centroids for h in self.heads])  # (hkv, c, d)
            self.assign = torch.stack([h.assign for h in self.heads])  # (hkv, n)
            self.counts = torch.stack([h.counts for h in self.heads])  # (hkv, c)
            self.queries = self.links = None
            if self.heads[0].queries is not None:
                self.queries = torch.stack([h.queries for h in self.heads])  # (hkv, m, d) unit norm
                self.links = torch.stack([h.links for h in self.heads])  # (hkv, m, link_k)
            for i, h in enumerate(self.heads):  # the heads keep views (estimate and the per-head reference)
                h.centroids, h.assign, h.counts = self.centroids[i], self.assign[i], self.counts[i]
                if self.queries is not None:
                    h.queries, h.links = self.queries[i], self.links[i]
        self.build_ms = (time.perf_counter() - t0) * 1000

    def nbytes(self) -> int:
        """Bytes the index adds beside the KV cache (centroids, lists, stored queries, links); the keys
        themselves are read from the cache (a float32 copy only when the cache is not float32)."""
        if not self.heads:
            return 0
        ts = [self.centroids, self.assign, self.counts, self.queries, self.links]
        ts += [h.vsum for h in self.heads]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def search(self, q: torch.Tensor, k: int, prior: torch.Tensor | None = None) -> SearchResult:
        """Top-k cache slots per KV head for one decode step.

        q: (q_heads, d), the step's queries (query head h belongs to KV head h // group);
        prior: (kv_heads, m) int64 cache slots to score as candidates besides what the index finds
            (the caller's carry-over from the previous step, see `RetrievalConfig.follow`); -1 and slots
            outside the index are ignored; each valid one counts as touched.
        Returns SearchResult(slots (kv_heads, k) int64 with -1 padding, scanned = vectors touched).

        All KV heads are searched at once (candidate sets as boolean masks over the keys, padded
        candidate lists for the exact scores): the same candidates, ranking and touched count as
        `_HeadIndex.candidates` head by head (tested), with a few batched ops instead of ~25 small ones per
        head (SmolLM2 has 3 KV heads in each of 30 layers); only the row gathers loop over heads.
        """
        hkv, n, d = self.keys.shape
        qg = q.float().view(hkv, -1, d)  # (hkv, g, d)
        if not self.heads:
            top = exact_top_k(q, self.keys, k, self.scale)  # (hkv, k')
            return SearchResult(_pad(top + self.base, k), hkv * n)
        mask, touched, cscores = self._candidates(qg, k)  # (hkv, n + 1) bool; column n is a dump slot
        if prior is not None:
            ids = prior - self.base  # (hkv, m)
            valid = (ids >= 0) & (ids < n)
            touched = touched + valid.sum(1)
            mask.scatter_(1, torch.where(valid, ids, n), True)
        cand, ok = _padded_ids(mask[:, :n].contiguous())  # (hkv, M) key ids, (hkv, M) bool
        kc = _rows(self.keys, cand)  # (hkv, M, d)
        s = (qg @ kc.transpose(1, 2) * self.scale).masked_fill(~ok[:, None], float("-inf"))  # (hkv, g, M)
        p = torch.softmax(s, dim=-1).sum(1)  # (hkv, M)
        top = p.topk(min(k, cand.shape[1]), dim=-1).indices  # (hkv, k')
        slots = torch.where(ok.gather(1, top), cand.gather(1, top) + self.base, -1)
        return SearchResult(_pad(slots, k), int(touched.sum()), cscores)

    def _candidates(self, qg: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Every head's candidate keys. qg: (hkv, g, d). Returns (mask (hkv, n + 1) bool over key ids
        with a spare last column, touched (hkv,) int64, centroid scores per head ((g, c) or None)).
        Budget and order as `_HeadIndex.candidates`: query links first, then IVF clusters by the
        group's summed softmax until scan_fraction of the keys (at least k) is reached."""
        hkv, n, _ = self.keys.shape
        cfg, c = self.cfg, self.centroids.shape[1]
        budget = max(1, int(cfg.scan_fraction * n), k)
        cscores: list = [None] * hkv
        mask = torch.zeros(hkv, n + 1, dtype=torch.bool)
        if budget >= n:  # the budget covers every key: a full scan
            mask[:, :n] = True
            return mask, torch.full((hkv,), n, dtype=torch.long), cscores
        touched = torch.zeros(hkv, dtype=torch.long)
        if self.queries is not None:
            qn = qg / qg.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (hkv, g, d)
            sim = qn @ self.queries.transpose(1, 2)  # (hkv, g, m)
            near = sim.topk(min(cfg.route, sim.shape[2]), dim=-1).indices.flatten(1)  # (hkv, g*route)
            linked = _rows(self.links, near)  # (hkv, g*route, link_k)
            mask.scatter_(1, linked.flatten(1), True)
            touched += self.queries.shape[1]
        left = budget - mask.sum(1)  # (hkv,)
        need = (left > 0).nonzero().flatten()  # heads whose budget the links did not fill
        if len(need):
            cs = qg.index_select(0, need) @ self.centroids.index_select(0, need).transpose(1, 2) * self.scale
            ranked = torch.softmax(cs, dim=-1).sum(1).argsort(dim=-1, descending=True)  # cs: (h', g, c)
            cum = self.counts.index_select(0, need).gather(1, ranked).cumsum(1)  # (h', c) keys in the best r+1
            n_take = (cum < left[need, None]).sum(1, keepdim=True) + 1  # (h', 1) clusters scanned
            take = torch.zeros(hkv, c, dtype=torch.bool)  # (hkv, c) by cluster; rows outside `need` stay False
            take[need] = torch.zeros(len(need), c, dtype=torch.bool).scatter_(
                1, ranked, torch.arange(c).expand(len(need), -1) < n_take)
            mask[:, :n] |= take.gather(1, self.assign)  # (hkv, n) keys of the taken clusters
            touched[need] += c
            for i, h in enumerate(need.tolist()):
                cscores[h] = cs[i]
        return mask, touched + mask.sum(1), cscores

    def _local(self, slots: torch.Tensor) -> torch.Tensor:
        """Cache slots (m,) -> key ids in this index, dropping -1 padding and slots outside it."""
        ids = slots - self.base
        return ids[(ids >= 0) & (ids < self.n)]

    @property
    def can_estimate(self) -> bool:
        """True when the index was built with values and has IVF clusters (kinds "aware" and "keys")."""
        return bool(self.heads) and self.heads[0].vsum is not None

    def estimate(self, q: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                 centroid_scores: list | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Approximate attention over the indexed keys NOT in `slots` (RetroInfer's estimation zone).

        q: (q_heads, d), the step's queries; slots: (kv_heads, k) int64 cache slots that were attended
        exactly (-1 = padding; slots outside the index are ignored); values: (kv_heads, >= base + n, d_v),
        the layer's cached values (read only at `slots`, to take the retrieved keys out of their clusters);
        centroid_scores: `SearchResult.centroid_scores` of the same step (reused where present).
        Every remaining key of cluster c is scored as the cluster's centroid: logit_c = scale * q . c +
        log(remaining count), value = the mean of the remaining values.
        Returns (out (q_heads, d_v) float32, lse (q_heads,) float32, natural log, centroids scored here,
        i.e. not reused: vectors touched); a head whose clusters are all retrieved gets zeros and
        lse = -inf (ignored by `merge_lse`).
        Raises RuntimeError when the index was built without values (see `can_estimate`).
        """
        if not self.can_estimate:
            raise RuntimeError("estimate() needs an IVF index built with values=...")
        hkv, _, d = self.keys.shape
        qg = q.float().view(hkv, -1, d)  # (hkv, g, d)
        outs, lses, touched = [], [], 0
        for h, head in enumerate(self.heads):
            ids = self._local(slots[h])
            counts, vsum = head.counts.float(), head.vsum
            if len(ids):
                a = head.assign[ids]
                counts = counts - torch.bincount(a, minlength=len(counts)).float()
                vsum = vsum.index_add(0, a, values[h, ids + self.base].float(), alpha=-1.0)
            live = counts > 0.5
            cs = centroid_scores[h] if centroid_scores is not None else None
            if cs is None:
                cs = qg[h] @ head.centroids.T * self.scale  # (g, c)
                touched += len(head.centroids)
            logits = cs + counts.clamp_min(1.0).log()  # (g, c)
            logits = logits.masked_fill(~live, float("-inf"))
            lse = torch.logsumexp(logits, dim=-1)  # (g,)
            w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # (g, c)
            mean_v = vsum / counts.clamp_min(1.0)[:, None]  # (c, d_v)
            outs.append(w @ mean_v)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses), touched


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (h, n, *rest), idx (h, m) int64 -> x[i, idx[i]] stacked: (h, m, *rest). One index_select per head
    (x may be a strided view of the KV cache: no copy of it; advanced indexing and gather with an expanded
    index are several times slower on CPU)."""
    out = torch.empty(*idx.shape, *x.shape[2:], dtype=x.dtype, device=x.device)
    for i in range(idx.shape[0]):  # written in place: torch.stack would copy every row a second time
        torch.index_select(x[i], 0, idx[i], out=out[i])
    return out


def _padded_ids(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (h, n) bool -> (ids (h, M) int64, ok (h, M) bool): each row's True columns in ascending order,
    padded with id 0 / ok False up to M = the largest row count."""
    counts = mask.sum(1)  # (h,)
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: rows ascending, cols ascending within a row
    start = torch.cumsum(counts, 0) - counts  # (h,)
    pos = torch.arange(len(rows)) - start[rows]
    m = max(1, int(counts.max()))
    ids = torch.zeros(mask.shape[0], m, dtype=torch.long)
    ok = torch.zeros(mask.shape[0], m, dtype=torch.bool)
    ids[rows, pos], ok[rows, pos] = cols, True
    return ids, ok


def _pad(idx: torch.Tensor, k: int) -> torch.Tensor:
    """(h, m) -> (h, k) int64, padded with -1 (m <= k)."""
    if idx.shape[1] >= k:
        return idx[:, :k].long()
    return torch.nn.functional.pad(idx.long(), (0, k - idx.shape[1]), value=-1)


def recall_at_k(found: torch.Tensor, exact: torch.Tensor) -> float:
    """Fraction of the exact top-k ids (h, k) found in `found` (h, k'), averaged over heads."""
    hits = [len(set(f.tolist()) & set(e.tolist())) / max(1, len(e)) for f, e in zip(found, exact)]
    return sum(hits) / len(hits)
