"""RoPE re-encoding of cached keys, in place, in Triton.

RoPE (Su et al. 2021, RoFormer) rotates each pair of key dimensions by angle position * inv_freq[i].
Rotations compose, R(a + b) = R(b) R(a), so keys cached at position p are moved to p + delta by one more
rotation by delta * inv_freq: no recomputation of the layer. Block-Attention (Sun et al. 2024) and
LMCache/CacheBlend use this to reuse a passage's KV cache at a new offset.

The angles are computed on the host in float64 and passed as float32 cos/sin tables (`common.rope_tables`),
so an offset of 32K positions loses nothing to float32 angle rounding; the kernel only does the 2x2
rotations in float32 and stores in the key dtype. Layouts: "half" (Hugging Face rotate_half, pairs
(i, i + rotary_dim/2): Llama, SmolLM2, Qwen, Gemma 3) and "interleaved" (GPT-J / GGUF pairs (2i, 2i+1));
dimensions >= rotary_dim are left alone (partial rotary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldqa.kernels import common


@triton.jit
def _rope_rotate(
    K, COS, SIN, n_tok, n_heads, half,
    stride_kb, stride_kh, stride_kn, stride_cos,
    PAIR_STRIDE: tl.constexpr, PAIR_OFFSET: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)  # int64: offsets of a large cache can pass 2^31 elements
    h = (bh % n_heads).to(tl.int64)
    i = tl.arange(0, BLOCK_H)  # (BH,) pair index
    mask = (toks < n_tok)[:, None] & (i < half)[None, :]
    c = tl.load(COS + toks[:, None] * stride_cos + i[None, :], mask=mask, other=1.0)  # (BT, BH) fp32
    s = tl.load(SIN + toks[:, None] * stride_cos + i[None, :], mask=mask, other=0.0)
    base = K + b * stride_kb + h * stride_kh + toks[:, None] * stride_kn
    p1 = base + (i * PAIR_STRIDE)[None, :]  # first element of each pair
    p2 = p1 + PAIR_OFFSET  # (BT, BH) second element
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(K.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * c + x1 * s).to(K.dtype.element_ty), mask=mask)


_INTERPRETED = type(_rope_rotate).__name__ == "InterpretedFunction"  # running under TRITON_INTERPRET=1


def rope_reencode_(
    k: torch.Tensor,
    delta: int | torch.Tensor,
    *,
    theta: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    layout: str = "half",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Triton in-place RoPE re-encoding; arguments as `dispatch.rope_reencode_`. Returns `k`."""
    rd = common.check_rope_inputs(k, delta, inv_freq, layout, rotary_dim)
    k4 = k if k.dim() == 4 else k.unsqueeze(0)  # a view: writes land in k
    b, h, n, _ = k4.shape
    if k4.numel() == 0:
        return k
    cos, sin = common.rope_tables(delta, rd, theta, inv_freq, k.device)  # (1|n, rd/2) float32
    half = rd // 2
    pair_stride, pair_offset = (1, half) if layout == "half" else (2, 1)
    block_h = max(1, triton.next_power_of_2(half))
    block_t = max(1, min(64, 4096 // block_h))
    _rope_rotate[(triton.cdiv(n, block_t), b * h)](
        k4, cos, sin, n, h, half,
        k4.stride(0), k4.stride(1), k4.stride(2), 0 if cos.shape[0] == 1 else cos.stride(0),
        PAIR_STRIDE=pair_stride, PAIR_OFFSET=pair_offset, BLOCK_T=block_t, BLOCK_H=block_h,
    )
    return k
