"""The KV cache: keys, values and the absolute position of every cached token, per layer.

Positions are explicit (as in gpt-fast): attention masks are built from them, so a cache may hold tokens
whose positions are not 0..n-1 (blocks encoded at an offset, re-encoded blocks, a sink prefix).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

# Slots a context's cache holds beyond the prompt and the answer budget (max_new tokens): the decode loop
# appends one token per step, and a stop may come one step late.
CAPACITY_SLACK = 8
# A CPU cache of at least this many bytes (K and V, all layers) lives in one block of transparent huge pages
# (`memory.arena`): a decode step at long contexts reads all of it. Smaller caches stay on 4 KB pages: each
# question allocates its caches afresh (block modes three: two orders and the answer's), and the first touch
# of fresh huge pages cost ~2.5 ms per MB against ~0.2 (the kernel finds and zeroes 2 MB pages), while their
# decode gain was ~1 ms a step at 8K tokens and none at 1.4K: plain block's first token 1.35 s on 4 KB pages
# against 1.98 s with 32 MB as the threshold (docs/results.md, "KV caches on 4 KB pages")
HUGE_CACHE_BYTES = 1 << 30


@runtime_checkable
class AttentionPolicy(Protocol):
    """The contract of `KVCache.policy`: a per-sequence hook that the global-attention layers consult in
    every forward pass over the cache (prefill, recompute in place, decode). Implemented by
    `retrieval_attention.RetrievalKV` (retrieval attention at decode) and `debias.DebiasKV` (recording the
    question's queries; the debias intervention).

    forward(layer, q, k, v, q_pos, k_pos, slots): q (batch, q_heads, n, head_dim) the layer's queries
    after RoPE; k, v (batch, kv_heads, L, head_dim) every cached key and value of the layer including the
    n new ones (in the query's dtype); q_pos (n,) and k_pos (L,) absolute positions (int64); slots (n,)
    the cache slots recomputed in place, or None for appended tokens. Returns the attention output
    (batch, q_heads, n, head_dim) in q's dtype, or None for the layer's normal (exact, causal by
    position) attention. A policy may keep state across calls (recorded queries, statistics).
    """

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                k_pos: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor | None: ...


class KVCache:
    """Growable per-layer KV cache for one sequence (batch 1) or a batch that shares positions.

    keys[l], values[l]: (batch, kv_heads, capacity, head_dim); the first `length` slots are valid.
    positions: (capacity,) int64 absolute positions of the cached tokens (shared by all layers).
    Storage doubles when full, so appending n tokens one at a time costs O(n) copies amortized.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", capacity: int = 256):
        self.num_layers = num_layers
        self.length = 0
        shape = (batch, kv_heads, capacity, head_dim)
        self._k, self._v = _storage([(shape, dtype)] * (2 * num_layers), device)
        self._pos = torch.zeros(capacity, dtype=torch.long, device=device)
        self._pending = 0  # tokens appended by the forward pass in progress (committed by `advance`)
        self.policy: AttentionPolicy | None = None  # consulted by the global layers (RetrievalKV, DebiasKV)
        # RoPE base multiplier of the global-attention layers for every key in this cache (1.0: the
        # model's own base). Attention Buckets (debias="buckets") runs branches with different bases.
        self.theta_scale = 1.0

    @property
    def capacity(self) -> int:
        return self._pos.shape[0]

    def _grow(self, need: int) -> None:
        cap = self.capacity
        while cap < need:
            cap *= 2
        if cap == self.capacity:
            return
        pad = cap - self.capacity
        shape = (*self._k[0].shape[:2], cap, self._k[0].shape[3])
        k, v = _storage([(shape, self._k[0].dtype)] * (2 * self.num_layers), self._k[0].device)
        for new, old in zip(k + v, self._k + self._v):
            new[:, :, :old.shape[2]] = old
        self._k, self._v = k, v
        self._pos = torch.nn.functional.pad(self._pos, (0, pad))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Append `k`, `v` (batch, kv_heads, n, head_dim) at the end of layer `layer`.

        positions: (n,) absolute positions of the new tokens. Returns the layer's valid keys, values
        (batch, kv_heads, length + n, head_dim) and positions (length + n,). The new tokens become part
        of `length` after `advance(n)` (called once per forward pass, after the last layer).
        """
        n = k.shape[2]
        end = self.length + n
        self._grow(end)
        self._k[layer][:, :, self.length:end] = k
        self._v[layer][:, :, self.length:end] = v
        if layer == 0:
            self._pos[self.length:end] = positions
        return self._k[layer][:, :, :end], self._v[layer][:, :, :end], self._pos[:end]

    def write_at(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """Overwrite the KV of already-cached tokens at cache slots `slots` (n,) of layer `layer`.

        k, v: (batch, kv_heads, n, head_dim). Used to recompute some tokens in place (headers of reused
        blocks, CacheBlend-style selective recomputation). Returns the layer's valid keys, values and
        positions, like `write`. Positions are not changed.
        """
        self._k[layer][:, :, slots] = k.to(self._k[layer].dtype)  # the cache's dtype (fp32 or bf16)
        self._v[layer][:, :, slots] = v.to(self._v[layer].dtype)
        return self.keys(layer), self.values(layer), self.positions

    def extend(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append a whole block: keys, values (num_layers, kv_heads, n, head_dim) at `positions` (n,).

        The batch dimension is 1 here (blocks are stored per sequence).
        """
        n = keys.shape[2]
        end = self.length + n
        self._grow(end)
        for layer in range(self.num_layers):
            self._k[layer][0, :, self.length:end] = keys[layer]
            self._v[layer][0, :, self.length:end] = values[layer]
        self._pos[self.length:end] = positions
        self.length = end

    def block(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy of slots [start, end) of every layer: keys, values (num_layers, kv_heads, n, head_dim)."""
        k = torch.stack([t[0, :, start:end] for t in self._k])
        v = torch.stack([t[0, :, start:end] for t in self._v])
        return k, v

    def clone(self) -> "KVCache":
        """A deep copy (keys, values, positions, length, theta_scale) with no policy attached; costs
        `nbytes()` of memory at the current capacity."""
        c = KVCache.__new__(KVCache)
        c.num_layers, c.length, c._pending = self.num_layers, self.length, 0
        c._k, c._v = _storage(self._k + self._v, self._k[0].device)
        c._pos = self._pos.clone()
        c.policy, c.theta_scale = None, self.theta_scale
        return c

    @classmethod
    def stack(cls, caches: list["KVCache"]) -> "KVCache":
        """One cache holding the sequences of `caches` as its batch (a copy, in their order): every cache
        of batch 1, with the same length and positions (prompts that differ only in their passages' order,
        each passage's block re-encoded to its slot), dtype, capacity and `theta_scale`; no policy attached.
        Raises ValueError otherwise."""
        first = caches[0]
        for c in caches[1:]:
            if (c.length != first.length or c.capacity != first.capacity or c._k[0].shape != first._k[0].shape
                    or c._k[0].dtype != first._k[0].dtype or c.theta_scale != first.theta_scale
                    or not torch.equal(c.positions, first.positions)):
                raise ValueError("KVCache.stack: the caches differ in length, positions, capacity, shape, dtype "
                                 "or RoPE base")
        if first._k[0].shape[0] != 1:
            raise ValueError(f"KVCache.stack: caches of batch 1 only, got batch {first._k[0].shape[0]}")
        out = cls.__new__(cls)
        out.num_layers, out.length, out._pending = first.num_layers, first.length, 0
        shape = (len(caches), *first._k[0].shape[1:])
        out._k, out._v = _storage([(shape, first._k[0].dtype)] * (2 * first.num_layers), first._k[0].device)
        for dst, srcs in zip(out._k + out._v, zip(*(c._k + c._v for c in caches))):
            torch.cat(srcs, out=dst)
        out._pos = first._pos.clone()
        out.policy, out.theta_scale = None, first.theta_scale
        return out

    def sequence(self, b: int) -> "KVCache":
        """Sequence `b` of this batch as a cache of batch 1 that shares this one's storage (a view: no
        copy; a write to either shows in both until one of them grows) and copies its positions; no
        policy attached."""
        out = KVCache.__new__(KVCache)
        out.num_layers, out.length, out._pending = self.num_layers, self.length, 0
        out._k, out._v = [t[b:b + 1] for t in self._k], [t[b:b + 1] for t in self._v]
        out._pos = self._pos.clone()
        out.policy, out.theta_scale = None, self.theta_scale
        return out

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length`."""
        self.length = min(self.length, length)

    def advance(self, n: int) -> None:
        self.length += n

    def keys(self, layer: int) -> torch.Tensor:
        """Valid keys of `layer`: (batch, kv_heads, length, head_dim)."""
        return self._k[layer][:, :, : self.length]

    def values(self, layer: int) -> torch.Tensor:
        """Valid values of `layer`: (batch, kv_heads, length, head_dim)."""
        return self._v[layer][:, :, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        """(length,) absolute positions of the cached tokens."""
        return self._pos[: self.length]

    def next_position(self) -> int:
        """Position right after the last cached token (0 for an empty cache)."""
        return int(self._pos[self.length - 1]) + 1 if self.length else 0

    def nbytes(self) -> int:
        """Bytes held by the valid part of the cache (K and V, all layers)."""
        if not self.length:
            return 0
        per = self._k[0][:, :, : self.length].numel() * self._k[0].element_size()
        return 2 * per * self.num_layers


def _storage(specs: list, device) -> tuple[list, list]:
    """Keys and values per layer: `specs` holds 2 * num_layers (shape, dtype) pairs (zeros) or tensors
    (copied), the keys first. A CPU cache of HUGE_CACHE_BYTES or more is one `memory.arena` block
    (transparent huge pages); any other, one tensor per layer."""
    copy = isinstance(specs[0], torch.Tensor)
    nbytes = sum(t.numel() * t.element_size() if copy else torch.Size(t[0]).numel() * t[1].itemsize for t in specs)
    if torch.device(device).type == "cpu" and nbytes >= HUGE_CACHE_BYTES:
        from ldqa.attention.memory import arena

        tensors = arena(specs)
    elif copy:
        tensors = [t.clone() for t in specs]
    else:
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    half = len(tensors) // 2
    return tensors[:half], tensors[half:]
