"""Pure-torch reference implementations of ldqa's attention kernels (the CPU path, and the oracle the
Triton kernels are tested against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ldqa.kernels import common


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Exact attention; see `dispatch.attention` (`causal`: q_len == k_len, no mask).

    Few query rows (decode): GQA as one grouped matmul, (b, kv, group * q_len, d) @ (b, kv, d, L), no
    copy of K/V per query head. Many rows (prefill): torch's SDPA with `enable_gqa`.
    """
    b, q_heads, n, d = q.shape
    kv_heads = k.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    scale = d**-0.5 if scale is None else scale
    if causal:
        if mask is not None or n != k.shape[2]:
            raise ValueError(f"causal attention takes as many queries as keys and no mask (q_len {n}, "
                             f"k_len {k.shape[2]})")
        if n > 16:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                  enable_gqa=kv_heads != q_heads)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if n <= 16:
        g = q_heads // kv_heads
        qg = q.reshape(b, kv_heads, g * n, d)  # (b, kvh, g*n, d): head h -> kv head h // g
        s = (qg @ k.transpose(-1, -2)) * scale  # (b, kvh, g*n, L)
        if mask is not None:
            m = mask.expand(b, q_heads, n, k.shape[2]).reshape(b, kv_heads, g * n, -1)
            s = s.masked_fill(~m, float("-inf"))
        p = torch.softmax(s.float(), dim=-1).nan_to_num_(0.0).to(v.dtype)  # empty rows -> zeros
        return (p @ v).reshape(b, q_heads, n, d)
    gqa = kv_heads != q_heads
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    empty = ~mask.any(dim=-1, keepdim=True)  # (b|1, h|1, q_len, 1): rows with nothing to attend to
    if empty.any():
        out = out.masked_fill(empty, 0.0)
    return out


# ----------------------------------------------------------------------------------------------------
# References for the Triton kernels. Same signatures and semantics as the functions of the same name in
# `ldqa.kernels.dispatch` (which documents them); all math in float32, results cast to the input dtype.

_SCORE_BUDGET = 2**25  # float32 score elements per chunk of query rows (128 MiB)


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention on grouped float32 tensors, LSE beside the output.

    q: (b, kv_heads, group, n, d); k, v: (b, kv_heads, L, d); mask: bool broadcastable to
    (b, kv_heads, group, n, L). Returns out (b, kv_heads, group, n, d), lse (b, kv_heads, group, n)
    (natural log; -inf and a zero output for rows with no allowed key).
    """
    s = torch.einsum("bhgnd,bhld->bhgnl", q, k) * scale  # (b, kvh, g, n, L)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, kvh, g, n)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])  # (b, kvh, g, n, L); exp(-inf) = 0 on empty rows
    return torch.einsum("bhgnl,bhld->bhgnd", p, v), lse


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    q_block_ids: torch.Tensor | None = None,
    k_block_ids: torch.Tensor | None = None,
    tile_mask: torch.Tensor | None = None,
    tile_size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `dispatch.prefill_attention`: dense masked softmax, query rows in chunks."""
    common.check_attention_inputs(q, k, v)
    b, hq, q_len, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    spec = common.make_mask_spec(
        q_len, k_len, d, q.dtype, q.device, causal=causal, window=window, q_pos=q_pos, k_pos=k_pos,
        q_block_ids=q_block_ids, k_block_ids=k_block_ids, tile_mask=tile_mask, tile_size=tile_size,
    )
    scale = common.resolve_scale(scale, d)
    out = torch.empty_like(q)  # (b, hq, q_len, d)
    lse = torch.empty(b, hq, q_len, dtype=torch.float32, device=q.device)  # (b, hq, q_len)
    kf, vf = k.float(), v.float()  # (b, hkv, k_len, d)
    step = max(1, _SCORE_BUDGET // max(1, b * hq * k_len))
    for r0 in range(0, q_len, step):
        rows = slice(r0, min(r0 + step, q_len))
        qf = q[:, :, rows].float().reshape(b, hkv, hq // hkv, -1, d)  # (b, hkv, g, n, d)
        mask = common.dense_mask(spec, q.device, rows)  # (n, k_len)
        o, l = _masked_attention(qf, kf, vf, mask, scale)
        out[:, :, rows] = o.reshape(b, hq, -1, d).to(q.dtype)
        lse[:, :, rows] = l.reshape(b, hq, -1)
    return out, lse


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    kv_len: int | torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    indices: torch.Tensor | None = None,
    sink: int = 0,
    window: int = 0,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `dispatch.decode_attention` (`num_splits` is accepted and ignored)."""
    kv, _ = common.check_decode_inputs(q, k_cache, v_cache, kv_len, indices, sink, window)
    b, hq, n_q, d = q.shape
    hkv, cache_len = k_cache.shape[1], k_cache.shape[2]
    if indices is not None:
        return _sparse_decode(q, k_cache, v_cache, kv, causal, indices, sink, window, scale)
    mask = common.decode_mask(
        kv, n_q, cache_len, hkv, causal=causal, indices=indices, sink=sink, window=window
    )  # (b, hkv, n_q, cache_len)
    qf = q.float().reshape(b, hkv, hq // hkv, n_q, d)  # (b, hkv, g, n_q, d)
    o, l = _masked_attention(qf, k_cache.float(), v_cache.float(), mask[:, :, None], common.resolve_scale(scale, d))
    return o.reshape(b, hq, n_q, d).to(q.dtype), l.reshape(b, hq, n_q)


def _sparse_decode(q, k_cache, v_cache, kv, causal, indices, sink, window, scale):
    """`decode_attention` with indices, reading only the selected slots (sink ∪ indices ∪ recent window):
    cost O(selected), not O(cache_len), which is what makes retrieval attention cheaper on the CPU.
    Same semantics as the masked form (`common.decode_mask`): duplicates count once, padding (-1) and
    slots >= kv_len are ignored, causal per query."""
    b, hq, n_q, d = q.shape
    hkv, cache_len = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    kvl = kv.long()[:, None, None]  # (b, 1, 1)
    zones = [indices.long().to(dev)]  # (b, hkv, n_idx)
    if sink:
        zones.append(torch.arange(sink, device=dev).expand(b, hkv, sink))
    if window:
        w = kvl - window + torch.arange(window, device=dev)  # (b, 1, window)
        zones.append(w.expand(b, hkv, window))
    idx = torch.cat(zones, dim=2).sort(dim=2).values  # (b, hkv, m)
    ok = (idx >= 0) & (idx < kvl)  # (b, hkv, m)
    ok[:, :, 1:] &= idx[:, :, 1:] != idx[:, :, :-1]  # duplicates count once
    safe = idx.clamp(0, cache_len - 1)  # (b, hkv, m)
    k_sel = _select_slots(k_cache, safe).float()  # (b, hkv, m, d)
    v_sel = _select_slots(v_cache, safe).float()  # (b, hkv, m, d)
    mask = ok[:, :, None, :].expand(b, hkv, n_q, idx.shape[2])  # (b, hkv, n_q, m)
    if causal:
        last = kvl[..., None] - n_q + torch.arange(n_q, device=dev)[None, None, :, None]  # (b, 1, n_q, 1)
        mask = mask & (idx[:, :, None, :] <= last)
    qf = q.float().reshape(b, hkv, hq // hkv, n_q, d)  # (b, hkv, g, n_q, d)
    o, l = _masked_attention(qf, k_sel, v_sel, mask[:, :, None], common.resolve_scale(scale, d))
    return o.reshape(b, hq, n_q, d).to(q.dtype), l.reshape(b, hq, n_q)


def _select_slots(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cache (b, hkv, L, d), idx (b, hkv, m) int64 in [0, L) -> (b, hkv, m, d): one index_select per
    (sequence, KV head); torch.gather with an expanded index is about 5x slower on the CPU."""
    b, hkv, m = idx.shape
    out = torch.empty(b, hkv, m, cache.shape[-1], dtype=cache.dtype, device=cache.device)
    for i in range(b):
        for h in range(hkv):  # in place: torch.stack would copy the rows a second time
            torch.index_select(cache[i, h], 0, idx[i, h], out=out[i, h])
    return out


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `dispatch.merge_lse`."""
    common.check_merge_inputs(out_a, lse_a, out_b, lse_b)
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: weights 0, no NaN
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)  # (...,)
    tot = wa + wb
    inv = torch.where(tot > 0, 1.0 / tot, torch.zeros_like(tot))
    out = (out_a.float() * (wa * inv)[..., None] + out_b.float() * (wb * inv)[..., None]).to(out_a.dtype)
    lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(tot, float("-inf")))
    return out, lse


def rope_reencode_(
    k: torch.Tensor,
    delta: int | torch.Tensor,
    *,
    theta: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    layout: str = "half",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Torch reference of `dispatch.rope_reencode_` (rotates `k` in place and returns it)."""
    rd = common.check_rope_inputs(k, delta, inv_freq, layout, rotary_dim)
    cos, sin = common.rope_tables(delta, rd, theta, inv_freq, k.device)  # (1|n, rd/2) float32
    half = rd // 2
    if layout == "half":  # pairs (i, i + rd/2)
        x1, x2 = k[..., :half], k[..., half:rd]  # views (..., n, rd/2)
    else:  # pairs (2i, 2i + 1)
        x1, x2 = k[..., 0:rd:2], k[..., 1:rd:2]
    f1, f2 = x1.float(), x2.float()  # (..., n, rd/2)
    y1 = f1 * cos - f2 * sin  # cos, sin broadcast over (batch, heads)
    y2 = f2 * cos + f1 * sin
    x1.copy_(y1)
    x2.copy_(y2)
    return k
