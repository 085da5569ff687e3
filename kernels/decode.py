"""Split-KV decode attention in Triton (flash-decoding), with an optional sparse key selection.

Follows Flash-Decoding (Dao, Haziza, Massa, Sizov 2023) and LeanAttention's stream-K view (Sanovar et
al. 2024): one or a few query tokens against a long KV cache leave a prefill-style grid nearly empty, so
the keys are split into `num_splits` contiguous chunks, one program per (chunk, batch, KV head), and the
partial results are merged by log-sum-exp in a second, tiny kernel. Each program handles all the query
heads of its KV head (GQA) and all n_q queries at once, so every key/value row is read from memory
exactly once: the kernel is bound by memory bandwidth, which is what the benchmark measures.

Sparse selection follows RetrievalAttention (Liu et al. 2024): with `indices`, each (batch, KV head)
attends to a "virtual" key list: the sink zone (slots 0..sink-1), then the indexed slots (the top-k keys
from the KV index, gathered), then the recent zone (the last `window` valid slots). Overlaps are masked
so that no slot counts twice (indexed slots inside the sink or recent zone, recent slots inside the sink
zone); the wrapper drops duplicate indices. Without `indices` the virtual list is just slots
0..kv_len-1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldqa.kernels import common

LOG2E = 1.4426950408889634
MAX_ROWS = 128  # query rows (q_heads per KV head * n_q) one program can hold (64 for fp32, d > 128)


@triton.jit(do_not_specialize=["n_idx", "sink", "window", "n_virt", "chunk"])
def _decode_split(
    Q, K, V, PO, PL, KV_LEN, IDX,
    qk_scale, n_q, group, n_kv_heads, n_idx, sink, window, n_virt, chunk, n_splits,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ib, stride_ih,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_IDX: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
):
    split = tl.program_id(0)
    pid = tl.program_id(1)  # b * n_kv_heads + kvh
    b = (pid // n_kv_heads).to(tl.int64)  # int64: batch offsets can pass 2^31 elements
    kvh = (pid % n_kv_heads).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)  # (BM,) row r = query head (r // n_q) of the group, query (r % n_q)
    g = rows // n_q
    qi = rows % n_q
    r_ok = rows < group * n_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + (kvh * group + g)[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)
    if DOT_F32:
        q = q.to(tl.float32)
    kv_len = tl.load(KV_LEN + b)
    last_slot = kv_len - n_q + qi  # (BM,) causal: query qi sees slots <= last_slot
    rec_start = kv_len - window  # first slot of the recent zone
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    i_base = IDX + b * stride_ib + kvh * stride_ih
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    j_lo = split * chunk
    j_hi = tl.minimum(j_lo + chunk, n_virt)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)  # (BN,) virtual key indices
        if HAS_IDX:
            in_sink = jj < sink
            in_idx = (jj >= sink) & (jj < sink + n_idx)
            idx = tl.load(i_base + (jj - sink), mask=in_idx, other=-1)  # (BN,) gathered slots
            rec = rec_start + (jj - sink - n_idx)
            slot = tl.where(in_sink, jj, tl.where(in_idx, idx, rec))  # (BN,)
            ok = (jj < j_hi) & (slot >= 0) & (slot < kv_len)
            ok = ok & tl.where(in_idx, (idx >= sink) & (idx < rec_start), True)  # no double counting
            ok = ok & tl.where(in_sink | in_idx, True, rec >= sink)
        else:
            slot = jj
            ok = (jj < j_hi) & (slot < kv_len)
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
        if DOT_F32:
            k = k.to(tl.float32)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="tf32x3")  # (BM, BN)
        else:
            qk = tl.dot(q, tl.trans(k))  # (BM, BN)
        qk = qk * qk_scale
        allowed = ok[None, :] & r_ok[:, None]  # (BM, BN)
        if CAUSAL:
            allowed = allowed & (slot[None, :] <= last_slot[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])  # (BM, BN)
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
        p = p.to(v.dtype)
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="tf32x3")
        else:
            acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new
    has = l_i > 0.0
    out = acc * tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)[:, None]  # (BM, BD)
    lse2 = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # (BM,) base 2
    part = pid * n_splits + split
    tl.store(PO + (part * BLOCK_M + rows)[:, None] * BLOCK_D + offs_d[None, :], out)
    tl.store(PL + part * BLOCK_M + rows, lse2)


@triton.jit
def _decode_combine(
    PO, PL, O, LSE, n_q, group, n_kv_heads, n_splits,
    stride_ob, stride_oh, stride_om,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)  # b * n_kv_heads + kvh
    b = (pid // n_kv_heads).to(tl.int64)
    kvh = (pid % n_kv_heads).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for sp in range(0, n_splits):
        part = pid * n_splits + sp
        lse2 = tl.load(PL + part * BLOCK_M + rows)  # (BM,)
        o = tl.load(PO + (part * BLOCK_M + rows)[:, None] * BLOCK_D + offs_d[None, :])  # (BM, BD)
        m_new = tl.maximum(m, lse2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse2 - m_safe)
        s = s * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m = m_new
    has = s > 0.0
    out = acc * tl.where(has, 1.0 / tl.where(has, s, 1.0), 0.0)[:, None]
    lse = tl.where(has, (m + tl.math.log2(tl.where(has, s, 1.0))) * 0.6931471805599453, float("-inf"))
    g = rows // n_q
    qi = rows % n_q
    r_ok = rows < group * n_q
    h = kvh * group + g  # (BM,) query head
    o_ptrs = O + b * stride_ob + h[:, None] * stride_oh + qi[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(LSE + (b * n_kv_heads * group + h) * n_q + qi, lse, mask=r_ok)


_INTERPRETED = type(_decode_split).__name__ == "InterpretedFunction"


def _dedupe(indices: torch.Tensor) -> torch.Tensor:
    """Sort each row of `indices` (batch, kv_heads, n_idx) and turn repeats into -1 (padding)."""
    idx = torch.sort(indices.to(torch.int32), dim=-1).values  # (b, kvh, n_idx)
    if idx.shape[-1] > 1:
        rep = torch.zeros_like(idx, dtype=torch.bool)
        rep[..., 1:] = idx[..., 1:] == idx[..., :-1]
        idx = idx.masked_fill(rep, -1)
    return idx.contiguous()


def _num_splits(n_virt: int, programs: int, block_n: int, device: torch.device) -> int:
    """Splits so that about two waves of programs fill the GPU, each split >= 4 key tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = triton.cdiv(2 * sms, max(1, programs))
    return max(1, min(want, triton.cdiv(n_virt, 4 * block_n)))


def _launch_config(block_m: int, block_d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages): keeps shared memory under ~200 KB and spills small on sm_90
    (checked by compiling for sm_90 over head_dim 64-256, 16-128 rows, bf16 and fp32)."""
    block_n = 64 if block_d * elem_bytes <= 256 else 32
    if elem_bytes == 4 and block_d > 128 and block_m >= 64:
        block_n = 16
    big = block_m * block_d >= 64 * 256 or (elem_bytes == 4 and block_m * block_d >= 64 * 128)
    return block_n, (8 if big else 4), (2 if big or elem_bytes == 4 else 3)


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
    """Triton split-KV decode; arguments, shapes and masks as `dispatch.decode_attention`.

    Raises
    ------
    ValueError
        Invalid inputs (see `common.check_decode_inputs`), or q_heads / kv_heads * n_q > 128 rows
        (64 for float32 with head_dim > 128; use `prefill_attention` for that many queries), or
        num_splits < 1.
    """
    kv, kv_max = common.check_decode_inputs(q, k_cache, v_cache, kv_len, indices, sink, window)
    b, hq, n_q, d = q.shape
    hkv, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    max_rows = MAX_ROWS // 2 if q.dtype == torch.float32 and d > 128 else MAX_ROWS
    if group * n_q > max_rows:
        raise ValueError(
            f"q_heads/kv_heads * n_q = {group * n_q} exceeds {max_rows} rows for {q.dtype}, head_dim {d}; "
            "decode fewer queries at once or use prefill_attention"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1 (or None to choose)")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (b, hq, n_q, d)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=q.device)  # (b, hq, n_q)
    if q.numel() == 0:
        return out, lse
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    window = min(window, cache_len)  # the recent zone never needs more than the whole cache
    if indices is None:
        idx = torch.full((b, hkv, 1), -1, dtype=torch.int32, device=q.device)
        n_idx, n_virt = 0, kv_max
    else:
        idx = _dedupe(indices.to(q.device))
        n_idx = idx.shape[-1]
        n_virt = sink + n_idx + window
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(16, triton.next_power_of_2(group * n_q))
    block_n, warps, stages = _launch_config(block_m, block_d, q.element_size())
    n_virt = max(n_virt, 1)
    splits = num_splits or _num_splits(n_virt, b * hkv, block_n, q.device)
    chunk = triton.cdiv(triton.cdiv(n_virt, splits), block_n) * block_n
    splits = triton.cdiv(n_virt, chunk)
    part_o = torch.empty(b * hkv * splits, block_m, block_d, dtype=torch.float32, device=q.device)
    part_l = torch.empty(b * hkv * splits, block_m, dtype=torch.float32, device=q.device)
    ieee, dot_f32 = q.dtype == torch.float32, _INTERPRETED and q.dtype == torch.bfloat16
    _decode_split[(splits, b * hkv)](
        q, k_cache, v_cache, part_o, part_l, kv, idx,
        common.resolve_scale(scale, d) * LOG2E, n_q, group, hkv, n_idx, sink, window, n_virt, chunk, splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        idx.stride(0), idx.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), HAS_IDX=indices is not None, IEEE=ieee, DOT_F32=dot_f32,
        num_warps=warps, num_stages=stages,
    )
    _decode_combine[(b * hkv,)](
        part_o, part_l, out, lse, n_q, group, hkv, splits,
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=4,
    )
    return out, lse
