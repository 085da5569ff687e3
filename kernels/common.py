"""Host-side pieces shared by the Triton kernels and their torch references (this module never imports
Triton, so the CPU path works without it).

Contents: input validation, the attention mask specification (`MaskSpec`) and its two renderings (a dense
boolean mask for the references, a compressed per-query-tile list of key tiles for the kernels), and the
RoPE tables used by re-encoding.

Mask semantics (shared by every attention kernel): a query at position ``qp`` with block id ``qb`` may
attend to a key at position ``kp`` with block id ``kb`` iff all of

- causal:   ``kp <= qp``                            (when ``causal``)
- window:   ``qp - kp < window``                    (when ``window`` is set; Gemma 3 local layers:
  ``window=512`` lets position p see p-511..p)
- blocks:   ``kb == qb or qb == -1``                (when block ids are given; -1 marks a global block
  whose queries see every key: Block-Attention's last block)
- tiles:    ``tile_mask[i // tile_m, j // tile_n]`` (when a tile mask is given; i, j are row/column
  indices, not positions)

hold. Rows with no allowed key return zeros and LSE = -inf.

Worked example, Block-Attention (Sun et al. 2024, "Block-Attention for Efficient RAG"): four tiles of
one token each, blocks ``[0, 1, 2, -1]`` (two passages ... the last block is the question), causal,
default positions. Allowed (row = query, column = key)::

    q\\k  0 1 2 3
    0    1 . . .      block 0 sees itself
    1    . 1 . .      block 1 sees itself (not block 0)
    2    . . 1 .
    3    1 1 1 1      the global last block sees everything before it

With tiles the same picture holds per tile: '.' tiles are skipped by the kernel (never loaded), diagonal
tiles are "partial" (the elementwise mask is applied), and the tiles of the last row left of the
diagonal are "full" (no mask arithmetic at all).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GLOBAL_BLOCK = -1  # block id of queries that see every key (Block-Attention's last block)
SKIP, PARTIAL, FULL = 0, 1, 2  # tile flags


def default_tile_size(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(tile_m, tile_n) the prefill kernel uses unless told otherwise; also the granularity a
    `tile_mask` is read at when no `tile_size` is given.

    Depends only on head_dim and dtype, never on the device, so the reference and the kernel agree.
    float32 gets smaller tiles (its 3xTF32 matmuls need more registers and shared memory).
    """
    if dtype == torch.float32:
        return (32, 32) if head_dim > 128 else (64, 32)
    return (64, 64) if head_dim > 128 else (128, 64)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """`scale` or the default head_dim ** -0.5 (softmax temperature multiplying q.k)."""
    return head_dim**-0.5 if scale is None else float(scale)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate q: (batch, q_heads, q_len, d); k, v: (batch, kv_heads, k_len, d), GQA, dtypes, devices.

    Raises
    ------
    ValueError
        On any mismatch; the message names the offending argument and the fix.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, length, head_dim); got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} is not supported; use float16, bfloat16 or float32")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3)"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q_heads={q.shape[1]} must be a positive multiple of kv_heads={k.shape[1]} (GQA)")


@dataclass
class MaskSpec:
    """Which (query, key) pairs may interact; see the module docstring for the rules.

    q_pos, k_pos: int32 (q_len,), (k_len,) or None for the default positions (queries are the last
    q_len keys: q_pos = arange(q_len) + k_len - q_len, k_pos = arange(k_len)).
    q_block_ids, k_block_ids: int32 (q_len,), (k_len,) or None. tile_mask: bool (n_q_tiles, n_k_tiles) at
    granularity `tile_size`, or None.
    """

    q_len: int
    k_len: int
    causal: bool = True
    window: int | None = None
    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    q_block_ids: torch.Tensor | None = None
    k_block_ids: torch.Tensor | None = None
    tile_mask: torch.Tensor | None = None
    tile_size: tuple[int, int] = (128, 64)

    @property
    def default_positions(self) -> bool:
        """True when positions are implicit (the kernels' fast path computes tile ranges in-kernel)."""
        return self.q_pos is None and self.k_pos is None

    @property
    def needs_plan(self) -> bool:
        """True when the kernel must follow a host-computed list of key tiles per query tile."""
        return not self.default_positions or self.q_block_ids is not None or self.tile_mask is not None

    def positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Explicit int32 positions (q_len,), (k_len,), filling in the defaults."""
        q_pos = self.q_pos
        if q_pos is None:
            q_pos = torch.arange(self.q_len, device=device, dtype=torch.int32) + (self.k_len - self.q_len)
        k_pos = self.k_pos if self.k_pos is not None else torch.arange(self.k_len, device=device, dtype=torch.int32)
        return q_pos, k_pos


def _as_index_vector(t: torch.Tensor | None, name: str, length: int, device: torch.device) -> torch.Tensor | None:
    """Validate a 1-D integer per-token vector and return it as int32 on `device`."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != length:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D tensor of length {length}; got {shape}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers; got dtype {t.dtype}")
    if t.numel() and (t.max() > 2**31 - 1 or t.min() < -(2**31)):
        raise ValueError(f"{name} values must fit in int32")
    return t.to(device=device, dtype=torch.int32)


def make_mask_spec(
    q_len: int,
    k_len: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    causal: bool = True,
    window: int | None = None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    q_block_ids: torch.Tensor | None = None,
    k_block_ids: torch.Tensor | None = None,
    tile_mask: torch.Tensor | None = None,
    tile_size: tuple[int, int] | None = None,
) -> MaskSpec:
    """Validate the mask arguments of `prefill_attention` and bundle them into a `MaskSpec`.

    Raises
    ------
    ValueError
        When a position/block-id vector has the wrong length or dtype, only one of the two block-id
        vectors is given, `window` < 1, `tile_size` is not a pair of powers of two >= 16, or
        `tile_mask` does not have shape (ceil(q_len / tile_m), ceil(k_len / tile_n)).
    """
    if window is not None and int(window) < 1:
        raise ValueError(f"window={window} must be >= 1 (or None for no sliding window)")
    if (q_block_ids is None) != (k_block_ids is None):
        raise ValueError("give both q_block_ids and k_block_ids, or neither")
    tile_size = tuple(tile_size) if tile_size is not None else default_tile_size(head_dim, dtype)
    if len(tile_size) != 2 or any(t < 16 or t & (t - 1) for t in tile_size):
        raise ValueError(f"tile_size={tile_size} must be two powers of two >= 16, e.g. (64, 64)")
    if tile_mask is not None:
        want = (math.ceil(q_len / tile_size[0]), math.ceil(k_len / tile_size[1]))
        if tile_mask.dtype != torch.bool or tuple(tile_mask.shape) != want:
            raise ValueError(
                f"tile_mask must be a bool tensor of shape {want} (tiles of {tile_size}); "
                f"got {tile_mask.dtype} {tuple(tile_mask.shape)}"
            )
        tile_mask = tile_mask.to(device)
    for name, ids in (("q_block_ids", q_block_ids), ("k_block_ids", k_block_ids)):
        if ids is not None and ids.numel() and int(ids.min()) < GLOBAL_BLOCK:
            raise ValueError(f"{name} must be >= 0 (a block) or -1 (global block); got min {int(ids.min())}")
    return MaskSpec(
        q_len=q_len,
        k_len=k_len,
        causal=bool(causal),
        window=None if window is None else int(window),
        q_pos=_as_index_vector(q_pos, "q_pos", q_len, device),
        k_pos=_as_index_vector(k_pos, "k_pos", k_len, device),
        q_block_ids=_as_index_vector(q_block_ids, "q_block_ids", q_len, device),
        k_block_ids=_as_index_vector(k_block_ids, "k_block_ids", k_len, device),
        tile_mask=tile_mask,
        tile_size=tile_size,
    )


def dense_mask(spec: MaskSpec, device: torch.device, rows: slice = slice(None)) -> torch.Tensor:
    """Render `spec` as a bool mask (n_rows, k_len), True = may attend, for query rows `rows`."""
    q_pos, k_pos = spec.positions(device)
    q_pos = q_pos[rows]  # (n,)
    allowed = torch.ones(q_pos.shape[0], spec.k_len, dtype=torch.bool, device=device)  # (n, k_len)
    if spec.causal:
        allowed &= k_pos[None, :] <= q_pos[:, None]
    if spec.window is not None:
        allowed &= (q_pos[:, None].long() - k_pos[None, :].long()) < spec.window
    if spec.q_block_ids is not None:
        qb = spec.q_block_ids[rows]  # (n,)
        allowed &= (qb[:, None] == spec.k_block_ids[None, :]) | (qb[:, None] == GLOBAL_BLOCK)
    if spec.tile_mask is not None:
        row_idx = torch.arange(spec.q_len, device=device)[rows] // spec.tile_size[0]  # (n,)
        col_idx = torch.arange(spec.k_len, device=device) // spec.tile_size[1]  # (k_len,)
        allowed &= spec.tile_mask[row_idx][:, col_idx]
    return allowed


def _tile_min_max(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile min and max of a 1-D int tensor (the last tile may be short). Returns two (n_tiles,)."""
    n_tiles = math.ceil(x.shape[0] / tile)
    pad = n_tiles * tile - x.shape[0]
    xl = x.long()
    lo = torch.nn.functional.pad(xl, (0, pad), value=2**40).view(n_tiles, tile).amin(1)  # (n_tiles,)
    hi = torch.nn.functional.pad(xl, (0, pad), value=-(2**40)).view(n_tiles, tile).amax(1)  # (n_tiles,)
    return lo, hi


def _block_tile_flags(spec: MaskSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) bool (n_qt, n_kt): some / every (query, key) pair of the tile passes the block rule."""
    tm, tn = spec.tile_size
    qb, kb = spec.q_block_ids, spec.k_block_ids
    ids, inv = torch.unique(torch.cat([qb, kb]), return_inverse=True)  # dense relabelling
    n_ids = ids.shape[0]

    def presence(lab: torch.Tensor, tile: int) -> torch.Tensor:  # (n_tiles, n_ids) float
        n_tiles = math.ceil(lab.shape[0] / tile)
        p = torch.zeros(n_tiles, n_ids, device=lab.device)
        p[torch.arange(lab.shape[0], device=lab.device) // tile, lab] = 1.0
        return p

    q_lab, k_lab = inv[: qb.shape[0]], inv[qb.shape[0] :]
    overlap = presence(q_lab, tm) @ presence(k_lab, tn).T > 0  # (n_qt, n_kt)
    q_lo, q_hi = _tile_min_max(qb, tm)
    k_lo, k_hi = _tile_min_max(kb, tn)
    q_has_global = q_lo == GLOBAL_BLOCK  # ids are >= -1 (make_mask_spec checks)
    q_all_global = q_hi == GLOBAL_BLOCK
    one_q = (q_lo == q_hi)[:, None]
    one_k = (k_lo == k_hi)[None, :]
    same = one_q & one_k & (q_lo[:, None] == k_lo[None, :])
    any_ok = overlap | q_has_global[:, None]
    all_ok = same | q_all_global[:, None]
    return any_ok, all_ok


@dataclass
class TilePlan:
    """Compressed block mask for the prefill kernel.

    kt_idx: int32 (n_qt, max_nnz), the key tiles query tile i visits (ascending, first kt_cnt[i] valid);
    kt_flag: int32 (n_qt, max_nnz), PARTIAL (apply the elementwise mask) or FULL (no masking);
    kt_cnt: int32 (n_qt,); max_nnz: int; active: int, the total number of visited tiles.
    """

    kt_idx: torch.Tensor
    kt_flag: torch.Tensor
    kt_cnt: torch.Tensor
    max_nnz: int
    active: int


def tile_flags(spec: MaskSpec, device: torch.device) -> torch.Tensor:
    """int32 (n_qt, n_kt): SKIP (no pair allowed), PARTIAL (some) or FULL (all pairs allowed).

    Conservative: a tile flagged PARTIAL may turn out fully masked or fully open, but SKIP and FULL are
    exact, so the kernel's result never depends on the flags beyond speed.
    """
    tm, tn = spec.tile_size
    n_qt, n_kt = math.ceil(spec.q_len / tm), math.ceil(spec.k_len / tn)
    q_pos, k_pos = spec.positions(device)
    q_lo, q_hi = _tile_min_max(q_pos, tm)  # (n_qt,)
    k_lo, k_hi = _tile_min_max(k_pos, tn)  # (n_kt,)
    any_ok = torch.ones(n_qt, n_kt, dtype=torch.bool, device=device)
    all_ok = torch.ones(n_qt, n_kt, dtype=torch.bool, device=device)
    if spec.causal:
        any_ok &= k_lo[None, :] <= q_hi[:, None]
        all_ok &= k_hi[None, :] <= q_lo[:, None]
    if spec.window is not None:
        any_ok &= k_hi[None, :] > q_lo[:, None] - spec.window
        all_ok &= k_lo[None, :] > q_hi[:, None] - spec.window
    if spec.q_block_ids is not None:
        b_any, b_all = _block_tile_flags(spec)
        any_ok &= b_any
        all_ok &= b_all
    if spec.tile_mask is not None:
        any_ok &= spec.tile_mask
    if spec.k_len % tn:  # the short last key tile needs bounds masking
        all_ok[:, -1] = False
    flags = torch.full((n_qt, n_kt), PARTIAL, dtype=torch.int32, device=device)
    flags[all_ok] = FULL
    flags[~any_ok] = SKIP
    return flags


def tile_plan(spec: MaskSpec, device: torch.device) -> TilePlan:
    """Compress `tile_flags(spec)` into per-query-tile lists of the key tiles to visit (CSR-like)."""
    flags = tile_flags(spec, device)  # (n_qt, n_kt)
    n_qt, n_kt = flags.shape
    active = flags != SKIP
    cnt = active.sum(1).to(torch.int32)  # (n_qt,)
    max_nnz = int(cnt.max()) if n_qt and n_kt else 0
    # stable sort puts active tiles first, in ascending key-tile order
    order = torch.sort((~active).to(torch.int8), dim=1, stable=True).indices[:, : max(max_nnz, 1)]
    kt_idx = order.to(torch.int32).contiguous()  # (n_qt, max_nnz)
    kt_flag = torch.gather(flags, 1, order).contiguous()  # (n_qt, max_nnz)
    return TilePlan(kt_idx, kt_flag, cnt.contiguous(), max_nnz, int(cnt.sum()))


# ----------------------------------------------------------------------------------------------------
# decode


def check_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: int | torch.Tensor | None,
    indices: torch.Tensor | None,
    sink: int,
    window: int,
) -> tuple[torch.Tensor, int]:
    """Validate `decode_attention` inputs; return kv_len as int32 (batch,) on q's device and its max.

    Raises
    ------
    ValueError
        Shapes/dtypes as in `check_attention_inputs`; kv_len outside [0, cache_len] or of the wrong
        shape; indices not (batch, kv_heads, n_idx) integers; negative sink or window; sink/window given
        without indices.
    """
    check_attention_inputs(q, k_cache, v_cache)
    batch, kv_heads, cache_len = k_cache.shape[:3]
    if kv_len is None or isinstance(kv_len, numbers.Integral):  # known on the host: no device sync
        n = cache_len if kv_len is None else int(kv_len)
        if not 0 <= n <= cache_len:
            raise ValueError(f"kv_len={n} must lie in [0, cache_len={cache_len}]")
        kv = torch.full((batch,), n, dtype=torch.int32, device=q.device)
        kv_max = n
    else:
        if kv_len.dim() != 1 or kv_len.shape[0] != batch or kv_len.dtype.is_floating_point:
            raise ValueError(f"kv_len must be an int or an integer tensor of shape ({batch},); got {kv_len}")
        kv = kv_len.to(device=q.device, dtype=torch.int32)
        lo, kv_max = (int(x) for x in torch.aminmax(kv)) if batch else (0, 0)
        if lo < 0 or kv_max > cache_len:
            raise ValueError(f"kv_len values must lie in [0, cache_len={cache_len}]; got {kv.tolist()}")
    if sink < 0 or window < 0:
        raise ValueError(f"sink={sink} and window={window} must be >= 0")
    if indices is None:
        if sink or window:
            raise ValueError("sink and window select zones next to `indices`; pass indices (or leave both 0)")
    elif indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, kv_heads) or indices.dtype.is_floating_point:
        raise ValueError(
            f"indices must be an integer tensor (batch={batch}, kv_heads={kv_heads}, n_idx); "
            f"got {indices.dtype} {tuple(indices.shape)}"
        )
    return kv, kv_max


def decode_mask(
    kv_len: torch.Tensor,
    n_q: int,
    cache_len: int,
    kv_heads: int,
    *,
    causal: bool,
    indices: torch.Tensor | None,
    sink: int,
    window: int,
) -> torch.Tensor:
    """Bool (batch, kv_heads, n_q, cache_len): which cache slots each decode query may attend to.

    Without `indices`: every slot < kv_len. With `indices`: sink zone (slots < sink) ∪ the indexed slots
    ∪ the recent zone (slots >= kv_len - window), all < kv_len; indices < 0 are padding. With `causal`,
    query i (of n_q, the newest tokens, already in the cache) sees slots <= kv_len - n_q + i.
    """
    batch, device = kv_len.shape[0], kv_len.device
    slot = torch.arange(cache_len, device=device)  # (cache_len,)
    kv = kv_len.long()[:, None, None, None]  # (b, 1, 1, 1)
    valid = slot[None, None, None, :] < kv  # (b, 1, 1, cache_len)
    if indices is not None:
        sel = torch.zeros(batch, kv_heads, cache_len + 1, dtype=torch.bool, device=device)
        idx = indices.long().to(device)
        idx = torch.where((idx >= 0) & (idx < cache_len), idx, cache_len)  # padding -> dump slot
        sel.scatter_(2, idx, True)
        sel = sel[:, :, None, :cache_len]  # (b, kvh, 1, cache_len)
        sel = sel | (slot < sink) | (slot >= kv - window)
        valid = valid & sel
    if causal:
        last = kv - n_q + torch.arange(n_q, device=device)[None, None, :, None]  # (b, 1, n_q, 1)
        valid = valid & (slot <= last)
    return valid.expand(batch, kv_heads, n_q, cache_len)


# ----------------------------------------------------------------------------------------------------
# LSE merge


def check_merge_inputs(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Validate `merge_lse` inputs: out_* (..., d) same shape/dtype/device, lse_* float32 (...).

    Raises
    ------
    ValueError
        When shapes, dtypes or devices disagree; the message names the argument.
    """
    if out_a.shape != out_b.shape or out_a.dtype != out_b.dtype or out_a.device != out_b.device:
        raise ValueError(
            f"out_a and out_b must share shape, dtype and device; got {tuple(out_a.shape)} {out_a.dtype} "
            f"and {tuple(out_b.shape)} {out_b.dtype}"
        )
    if out_a.dim() < 1 or out_a.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_a must be a float16/bfloat16/float32 tensor (..., d); got {out_a.dtype}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != out_a.shape[:-1] or lse.dtype != torch.float32 or lse.device != out_a.device:
            raise ValueError(
                f"{name} must be float32 of shape {tuple(out_a.shape[:-1])} on {out_a.device}; "
                f"got {lse.dtype} {tuple(lse.shape)}"
            )


# ----------------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Default RoPE inverse frequencies in float64, shape (rotary_dim // 2,):
    inv_freq[i] = 1 / theta ** (2i / rotary_dim) (RoFormer; the same values as `ldqa.attention.config`)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))


def check_rope_inputs(
    k: torch.Tensor,
    delta: int | torch.Tensor,
    inv_freq: torch.Tensor | None,
    layout: str,
    rotary_dim: int | None,
) -> int:
    """Validate `rope_reencode_` inputs and return the rotary dimension.

    Raises
    ------
    ValueError
        k not 3-D/4-D float with a contiguous last dim; delta not an int or an integer tensor of shape
        (n,) where n = k.shape[-2]; layout not "half"/"interleaved"; rotary_dim odd or > head_dim;
        inv_freq not of shape (rotary_dim // 2,).
    """
    if k.dim() not in (3, 4) or k.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"k must be a float16/bfloat16/float32 tensor (batch, kv_heads, n, head_dim) or (kv_heads, n, "
            f"head_dim); got {k.dtype} {tuple(k.shape)}"
        )
    if k.shape[-1] > 1 and k.stride(-1) != 1:
        raise ValueError("k's last dimension must be contiguous (stride 1) to be rotated in place")
    head_dim = k.shape[-1]
    rd = head_dim if rotary_dim is None else int(rotary_dim)
    if rd < 2 or rd % 2 or rd > head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in [2, head_dim={head_dim}]")
    if layout not in ("half", "interleaved"):
        raise ValueError(f"layout={layout!r}: use 'half' (HF rotate_half) or 'interleaved' (GPT-J pairs)")
    if isinstance(delta, torch.Tensor):
        if delta.dtype.is_floating_point or delta.dim() != 1 or delta.shape[0] != k.shape[-2]:
            raise ValueError(
                f"delta must be an int or an integer tensor of shape ({k.shape[-2]},) (one offset per key); "
                f"got {delta.dtype} {tuple(delta.shape)}"
            )
    elif not isinstance(delta, numbers.Integral):
        raise ValueError(f"delta must be an int or an integer tensor; got {type(delta).__name__}")
    if inv_freq is not None and (inv_freq.dim() != 1 or inv_freq.shape[0] != rd // 2):
        raise ValueError(f"inv_freq must have shape ({rd // 2},) (rotary_dim // 2); got {tuple(inv_freq.shape)}")
    return rd


def rope_tables(
    delta: int | torch.Tensor,
    rotary_dim: int,
    theta: float,
    inv_freq: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 of the re-encoding angles delta * inv_freq, computed in float64 then cast.

    Returns two tensors (n_rows, rotary_dim // 2): one row for an int delta, one per key for a tensor.
    The float64 angle keeps the rotation exact to float32 rounding even for offsets of 10^5 positions
    (a float32 product would be off by ~delta * 6e-8 rad).
    """
    f = rope_inv_freq(rotary_dim, theta, device) if inv_freq is None else inv_freq.to(device, torch.float64)
    if isinstance(delta, torch.Tensor):
        d = delta.to(device=device, dtype=torch.float64)  # (n,)
    else:
        d = torch.tensor([float(int(delta))], dtype=torch.float64, device=device)  # (1,)
    ang = d[:, None] * f[None, :]  # (n_rows, rotary_dim/2) float64
    return ang.cos().float().contiguous(), ang.sin().float().contiguous()
