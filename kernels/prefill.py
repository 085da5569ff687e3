"""Prefill attention forward, FlashAttention-2 style, in Triton.

Follows FlashAttention (Dao et al. 2022) and FlashAttention-2 (Dao 2023): the grid is (query tiles,
batch * query heads); each program keeps its query tile on chip, streams key/value tiles, and keeps an
online softmax (running max `m`, running sum `l`, in base 2 with the softmax scale folded into one
multiply), so the (q_len, k_len) score matrix is never materialized. The log-sum-exp of every row is
written beside the output so partial attentions can be merged (`lse_merge`).

Masks (the rules are in `ldqa.kernels.common`) are applied per tile: a tile is skipped (never loaded),
full (no mask arithmetic) or partial (elementwise mask). Two ways to enumerate the tiles:

- fast path (default positions, no block ids, no tile mask): each program computes its key-tile range
  in-kernel: [window start, causal diagonal), split into masked boundary tiles and unmasked inner tiles
  (the Triton tutorial's diagonal trick, extended with a sliding-window lower edge);
- plan path (explicit positions, block ids or a tile mask): the host builds a per-query-tile list of
  key tiles with PARTIAL/FULL flags (`common.tile_plan`), as block-sparse FlashAttention does, so
  Block-Attention's block-diagonal + full-last-block pattern costs only its non-empty tiles.

GQA: query head h reads KV head h // (q_heads // kv_heads); any ratio works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldqa.kernels import common

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, qpos, qblk,
    k_base, v_base, stride_kn, stride_vn, KPOS, KBLK,
    start_n, k_len, qk_scale, window, full,
    offs_n, offs_d, d_ok,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_BLOCKS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One key/value tile of the online softmax (base 2). Returns the updated (acc, m_i, l_i).

    MASKED applies the elementwise mask unless the runtime flag `full` is set (plan path: one branch-free
    loop body, so the loads stay software-pipelined).
    """
    kn = start_n + offs_n  # (BN,) key indices
    n_ok = kn < k_len
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + kn[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
    if DOT_F32:  # interpreter work-around, see _dot_in_f32
        k = k.to(tl.float32)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="tf32x3")  # (BM, BN) fp32
    else:
        qk = tl.dot(q, tl.trans(k))  # (BM, BN) fp32
    qk = qk * qk_scale
    if MASKED:
        ok = n_ok[None, :]  # (1, BN), broadcast to (BM, BN) by the rules below
        if HAS_POS:
            kpos = tl.load(KPOS + kn, mask=n_ok, other=0)  # (BN,)
        else:
            kpos = kn
        if CAUSAL:
            ok = ok & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            ok = ok & ((qpos[:, None] - kpos[None, :]) < window)
        if HAS_BLOCKS:
            kblk = tl.load(KBLK + kn, mask=n_ok, other=-2)  # (BN,)
            ok = ok & ((kblk[None, :] == qblk[:, None]) | (qblk[:, None] == -1))
        qk = tl.where(ok | full, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # (BM,)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet: avoid -inf - -inf
    p = tl.math.exp2(qk - m_safe[:, None])  # (BM, BN)
    alpha = tl.math.exp2(m_i - m_safe)  # (BM,)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + kn[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
    p = p.to(v.dtype)  # the P @ V operand in the input precision, as FlashAttention does
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="tf32x3")  # (BM, BD)
    else:
        acc = tl.dot(p, v, acc * alpha[:, None])  # (BM, BD)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["q_len", "k_len", "pos_off", "window", "max_nnz"])
def _prefill_fwd(
    Q, K, V, O, LSE,
    QPOS, KPOS, QBLK, KBLK, KT_IDX, KT_FLAG, KT_CNT,
    qk_scale, q_len, k_len, pos_off, window, n_q_heads, group, max_nnz,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_POS: tl.constexpr, HAS_BLOCKS: tl.constexpr,
    USE_PLAN: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_q_heads).to(tl.int64)  # int64: batch offsets can pass 2^31 elements
    h = (pid_bh % n_q_heads).to(tl.int64)
    kvh = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)
    if DOT_F32:
        q = q.to(tl.float32)
    if HAS_POS:
        qpos = tl.load(QPOS + offs_m, mask=m_ok, other=0)  # (BM,)
    else:
        qpos = offs_m + pos_off
    if HAS_BLOCKS:
        qblk = tl.load(QBLK + offs_m, mask=m_ok, other=-2)  # (BM,)
    else:
        qblk = offs_m
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if USE_PLAN:
        n_tiles = tl.load(KT_CNT + pid_m)
        for t in range(0, n_tiles):
            kt = tl.load(KT_IDX + pid_m * max_nnz + t)
            flag = tl.load(KT_FLAG + pid_m * max_nnz + t)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpos, qblk, k_base, v_base, stride_kn, stride_vn, KPOS, KBLK,
                kt * BLOCK_N, k_len, qk_scale, window, flag == 2, offs_n, offs_d, d_ok,
                True, CAUSAL, HAS_WINDOW, HAS_POS, HAS_BLOCKS, IEEE, DOT_F32)
    else:
        # key range of this query tile; positions are q = row + pos_off, k = column
        q_first = pid_m * BLOCK_M + pos_off  # smallest query position in the tile
        q_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, q_len) - 1 + pos_off  # largest
        hi = k_len
        hi_full = (k_len // BLOCK_N) * BLOCK_N
        if CAUSAL:
            hi = tl.maximum(tl.minimum(k_len, q_last + 1), 0)
            hi_full = tl.minimum(hi_full, (tl.maximum(q_first + 1, 0) // BLOCK_N) * BLOCK_N)
        lo = 0
        lo_full = 0
        if HAS_WINDOW:
            lo = (tl.maximum(q_first - window + 1, 0) // BLOCK_N) * BLOCK_N
            lo_full = tl.cdiv(tl.maximum(q_last - window + 1, 0), BLOCK_N) * BLOCK_N
        a_end = tl.minimum(lo_full, hi)
        b_end = tl.maximum(a_end, tl.minimum(hi_full, hi))
        for start_n in range(lo, a_end, BLOCK_N):  # window edge: masked
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpos, qblk, k_base, v_base, stride_kn, stride_vn, KPOS, KBLK,
                start_n, k_len, qk_scale, window, False, offs_n, offs_d, d_ok,
                True, CAUSAL, HAS_WINDOW, HAS_POS, HAS_BLOCKS, IEEE, DOT_F32)
        for start_n in range(a_end, b_end, BLOCK_N):  # inner tiles: no mask
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpos, qblk, k_base, v_base, stride_kn, stride_vn, KPOS, KBLK,
                start_n, k_len, qk_scale, window, False, offs_n, offs_d, d_ok,
                False, CAUSAL, HAS_WINDOW, HAS_POS, HAS_BLOCKS, IEEE, DOT_F32)
        for start_n in range(b_end, hi, BLOCK_N):  # causal diagonal and ragged tail: masked
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpos, qblk, k_base, v_base, stride_kn, stride_vn, KPOS, KBLK,
                start_n, k_len, qk_scale, window, False, offs_n, offs_d, d_ok,
                True, CAUSAL, HAS_WINDOW, HAS_POS, HAS_BLOCKS, IEEE, DOT_F32)
    has_keys = l_i > 0.0
    inv_l = tl.where(has_keys, 1.0 / tl.where(has_keys, l_i, 1.0), 0.0)  # empty rows -> zeros
    out = acc * inv_l[:, None]  # (BM, BD)
    lse = tl.where(has_keys, (m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # (BM,) natural log
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * q_len + offs_m, lse, mask=m_ok)


_INTERPRETED = type(_prefill_fwd).__name__ == "InterpretedFunction"


def _dot_in_f32(dtype: torch.dtype) -> bool:
    """True under TRITON_INTERPRET=1 for bfloat16: Triton 3.9's interpreter multiplies the raw bf16 bit
    patterns in tl.dot, so operands are widened to float32 first (after the same bf16 rounding the GPU
    path applies, so the numerics match). Never true on a GPU."""
    return _INTERPRETED and dtype == torch.bfloat16


def _launch_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int]) -> tuple[int, int]:
    """(num_warps, num_stages). For the default tiles these were checked for shared memory and register
    spills by compiling for sm_90 (`bench_kernels --compile-check`), not tuned on a GPU; smaller custom
    tiles get 4 warps, larger ones at most 2 stages."""
    if dtype == torch.float32:
        warps, stages = (8, 2) if head_dim > 128 else (4, 2)
    elif head_dim <= 64:
        warps, stages = 4, 3
    elif head_dim <= 128:
        warps, stages = 8, 3
    else:
        warps, stages = 8, 2
    dm, dn = common.default_tile_size(head_dim, dtype)
    if tile[0] * tile[1] < dm * dn:
        warps = 4
    elif tile[0] * tile[1] > dm * dn:
        stages = min(stages, 2)
    return warps, stages


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
    """Triton FlashAttention-2 forward; arguments, shapes and masks as `dispatch.prefill_attention`.

    The tiles are `tile_size` (default `common.default_tile_size(head_dim, dtype)`); a `tile_mask` is
    read at that granularity. float32 inputs use 3xTF32 tensor-core matmuls on the GPU (about float32
    accuracy); the interpreter computes in plain float32. Returns out (batch, q_heads, q_len, head_dim) in q's dtype and lse float32
    (batch, q_heads, q_len).
    """
    common.check_attention_inputs(q, k, v)
    b, hq, q_len, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    spec = common.make_mask_spec(
        q_len, k_len, d, q.dtype, q.device, causal=causal, window=window, q_pos=q_pos, k_pos=k_pos,
        q_block_ids=q_block_ids, k_block_ids=k_block_ids, tile_mask=tile_mask, tile_size=tile_size,
    )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (b, hq, q_len, d)
    lse = torch.empty(b, hq, q_len, dtype=torch.float32, device=q.device)  # (b, hq, q_len)
    if q.numel() == 0:
        return out, lse
    if k_len == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bm, bn = spec.tile_size
    dummy = torch.empty(1, dtype=torch.int32, device=q.device)
    plan, use_plan = None, spec.needs_plan
    if use_plan:
        plan = common.tile_plan(spec, q.device)
        q_pos_t, k_pos_t = spec.positions(q.device)
    has_pos = use_plan
    warps, stages = _launch_config(d, q.dtype, spec.tile_size)
    grid = (triton.cdiv(q_len, bm), b * hq)
    _prefill_fwd[grid](
        q, k, v, out, lse,
        q_pos_t if has_pos else dummy, k_pos_t if has_pos else dummy,
        spec.q_block_ids if spec.q_block_ids is not None else dummy,
        spec.k_block_ids if spec.k_block_ids is not None else dummy,
        plan.kt_idx if use_plan else dummy, plan.kt_flag if use_plan else dummy,
        plan.kt_cnt if use_plan else dummy,
        common.resolve_scale(scale, d) * LOG2E, q_len, k_len, k_len - q_len,
        spec.window or 0, hq, hq // hkv, plan.max_nnz if use_plan else 0,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=bm, BLOCK_N=bn,
        CAUSAL=spec.causal, HAS_WINDOW=spec.window is not None, HAS_POS=has_pos,
        HAS_BLOCKS=spec.q_block_ids is not None, USE_PLAN=use_plan, IEEE=q.dtype == torch.float32, DOT_F32=_dot_in_f32(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    return out, lse
