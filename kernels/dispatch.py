"""The one place the runtime calls for attention math, with the exceptions listed below.

Every attention call in `ldqa.attention` goes through a function here. Each function picks an
implementation: the Triton kernel for CUDA tensors; on the CPU the C decode attention
(`cpu_linear.decode_attention`) for one query token where it fits, else the pure-torch reference.
`LDQA_KERNELS=triton|torch` overrides the choice (``triton`` on CPU tensors needs TRITON_INTERPRET=1).
Kernel modules are imported lazily, so the CPU path never imports Triton.

The calls that bypass it, and why:

- `decode_runner.CStep.step`, the model's runner for q8_0/gguf weights (chosen at load): a plain decode
  step on the CPU (one token, one sequence, a plain fp32 cache without a policy, ascending positions, so
  no mask) runs all its layers in one C call (`cpu_linear.DecodeStack`, `ldqa_decode_stack` in
  kernels/q8_0.c), which calls the same C decode attention inside the call; going back to Python per
  layer to reach this module cost ~0.1 ms a layer (docs/kernels.md). It computes the same numbers, bit for
  bit, as the per-layer path through `decode_attention` here (tests/test_fused_decode.py);
  `LDQA_KERNELS=torch` turns it off too.
- `debias.DebiasKV.forward` and `block_attention.ScaledKV.forward`, cache policies of the global layers:
  attention with an additive per-key score bias (debiasing) or a per-key score transform (APE's block
  scaling), which no kernel here takes; einsum in fp32, for the question's tokens and each decode token.
- `debias.passage_mass` and `block_attention.token_mass`: they need the attention probabilities
  themselves (summed per passage or per slot), which the kernels here do not return.

Functions (shapes: b = batch, hq = query heads, hkv = KV heads, d = head_dim; hq % hkv == 0 and query
head h reads KV head h // (hq // hkv)):

- `attention`: exact softmax attention with an optional dense boolean mask (the model's generic path).
- `prefill_attention`: FlashAttention-2 forward with causal / sliding-window / Block-Attention block ids /
  block-sparse tile masks, explicit positions; returns (out, lse).
- `decode_attention`: split-KV decoding (Flash-Decoding) over a KV cache, optionally restricted to
  sink + retrieved indices + recent window (RetrievalAttention); returns (out, lse).
- `merge_lse`: merge two partial attentions by log-sum-exp.
- `rope_reencode_`: rotate cached keys in place by a position offset.

Every LSE is float32, natural log, -inf for a row that attended to nothing (its output is zeros).
"""

from __future__ import annotations

import importlib
import os

import torch

from ldqa.kernels import cpu_linear, reference


def _forced() -> str:
    """LDQA_KERNELS: "triton", "torch" or "" (not set). Raises ValueError for anything else."""
    forced = os.environ.get("LDQA_KERNELS", "").strip().lower()
    if forced and forced not in ("triton", "torch"):
        raise ValueError(f"LDQA_KERNELS={forced!r}: use 'triton' or 'torch'")
    return forced


def backend_for(t: torch.Tensor) -> str:
    """Return "triton" or "torch" for tensor `t` (honours LDQA_KERNELS).

    Raises ValueError when LDQA_KERNELS holds anything but "triton" or "torch".
    """
    return _forced() or ("triton" if t.is_cuda else "torch")


def _impl(t: torch.Tensor, module: str, name: str):
    """The implementation of `name` for tensor `t`: `ldqa.kernels.<module>.<name>` or the reference."""
    if backend_for(t) == "torch":
        return getattr(reference, name)
    return getattr(importlib.import_module(f"ldqa.kernels.{module}"), name)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Exact softmax attention with GQA.

    q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, k_len, head_dim) with
    q_heads % kv_heads == 0 (query head h reads KV head h // (q_heads // kv_heads));
    mask: bool, broadcastable to (batch, q_heads, q_len, k_len), True = may attend; None = attend to all.
    scale: multiplies q.k (default head_dim ** -0.5).
    causal: query i sees keys 0..i (q_len == k_len, no `mask`): the lower-triangle mask without building
    it; the kernels skip the tiles above the diagonal. Raises ValueError for q_len != k_len or a mask.
    Returns (batch, q_heads, q_len, head_dim) in q's dtype. A query row with no allowed key returns zeros.

    With the Triton backend and no mask this runs the FlashAttention kernel (non-causal); a dense mask
    always goes to torch's scaled_dot_product_attention (use `prefill_attention` for structured masks).
    One query token of one sequence in fp32 on the CPU (decode) runs ldqa's C kernel
    (`cpu_linear.decode_attention`) unless LDQA_KERNELS=torch or LDQA_CPU_KERNELS=torch.
    """
    if causal and (mask is not None or q.shape[2] != k.shape[2]):
        raise ValueError(f"causal attention takes as many queries as keys and no mask: q_len {q.shape[2]}, "
                         f"k_len {k.shape[2]}, mask {'given' if mask is not None else 'None'}")
    if mask is None and backend_for(q) == "triton":
        return prefill_attention(q, k, v, scale=scale, causal=causal)[0]
    # one decode token on the CPU: ldqa's C kernel (reads each K/V row once for the whole GQA group)
    if q.shape[2] == 1 and _forced() != "torch" and cpu_linear.decode_attention_fits(q, k, v, mask):
        return cpu_linear.decode_attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale)
    return reference.attention(q, k, v, mask=mask, scale=scale, causal=causal)


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
    """Exact attention for prefill, FlashAttention-2 (Dao 2023) with block-sparse tile skipping.

    Parameters
    ----------
    q : (b, hq, q_len, d) float16 / bfloat16 / float32, last dim contiguous
    k, v : (b, hkv, k_len, d), q's dtype and device
    scale : multiplies q.k; default d ** -0.5
    causal : key position <= query position
    window : sliding window in positions: query at p sees keys p-window+1..p (Gemma 3 local layers use
        512); None = no window
    q_pos, k_pos : int (q_len,), (k_len,) explicit positions shared by the batch; default: queries are
        the last q_len keys (q_pos = arange(q_len) + k_len - q_len, k_pos = arange(k_len))
    q_block_ids, k_block_ids : int (q_len,), (k_len,) Block-Attention block ids (>= 0), -1 for a global
        block whose queries see every key; a query sees a key iff the ids are equal or its id is -1
    tile_mask : bool (ceil(q_len / tile_m), ceil(k_len / tile_n)); False masks the whole tile
    tile_size : (tile_m, tile_n) powers of two >= 16; default `common.default_tile_size(d, q.dtype)`

    All given rules are ANDed; the kernel never loads a tile in which they allow nothing. Worked 4x4
    example: `ldqa.kernels.common` and docs/kernels.md.

    Returns
    -------
    out : (b, hq, q_len, d) in q's dtype; zeros for rows with no allowed key
    lse : (b, hq, q_len) float32 natural-log log-sum-exp of the scaled scores; -inf for empty rows

    Raises
    ------
    ValueError
        Bad shapes, dtypes, devices or mask arguments (the message names the argument).
    """
    fn = _impl(q, "prefill", "prefill_attention")
    return fn(
        q, k, v, scale=scale, causal=causal, window=window, q_pos=q_pos, k_pos=k_pos,
        q_block_ids=q_block_ids, k_block_ids=k_block_ids, tile_mask=tile_mask, tile_size=tile_size,
    )


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
    """Decode attention: a few new queries against a long KV cache, split-KV (Flash-Decoding).

    Parameters
    ----------
    q : (b, hq, n_q, d), the n_q newest tokens (already written to the cache); hq / hkv * n_q <= 128
    k_cache, v_cache : (b, hkv, cache_len, d); slot j holds the key of the j-th cached token
    kv_len : valid slots per sequence, int or int tensor (b,); default cache_len
    scale : multiplies q.k; default d ** -0.5
    causal : query i sees slots <= kv_len - n_q + i
    indices : int (b, hkv, n_idx) slots to attend to (the top-k keys from the KV index), -1 = padding;
        duplicates count once. None = attend to every valid slot.
    sink, window : with indices, also attend to slots < sink (attention sink) and the last `window` valid
        slots (recent zone), RetrievalAttention's steady zone; must be 0 without indices
    num_splits : key chunks processed in parallel (default: enough to fill the GPU); ignored on torch

    Returns
    -------
    out : (b, hq, n_q, d) in q's dtype; lse : (b, hq, n_q) float32 (-inf and zeros if nothing attended)

    Raises
    ------
    ValueError
        Bad shapes/dtypes, kv_len outside [0, cache_len], sink/window without indices.
    """
    fn = _impl(q, "decode", "decode_attention")
    return fn(
        q, k_cache, v_cache, kv_len=kv_len, scale=scale, causal=causal, indices=indices,
        sink=sink, window=window, num_splits=num_splits,
    )


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over two disjoint key sets into attention over their union.

    out = (e^lse_a * out_a + e^lse_b * out_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b),
    computed stably in float32. Associative and commutative; a part with lse = -inf is ignored, and two
    empty parts give zeros and -inf (no NaN).

    Parameters
    ----------
    out_a, out_b : (..., d) same shape, float16 / bfloat16 / float32
    lse_a, lse_b : (...) float32, natural log

    Returns
    -------
    out : (..., d) in out_a's dtype; lse : (...) float32

    Raises
    ------
    ValueError
        Mismatched shapes, dtypes or devices.
    """
    return _impl(out_a, "lse_merge", "merge_lse")(out_a, lse_a, out_b, lse_b)


def rope_reencode_(
    k: torch.Tensor,
    delta: int | torch.Tensor,
    *,
    theta: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    layout: str = "half",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Move cached keys by `delta` positions, in place: k at position p becomes k at p + delta.

    Parameters
    ----------
    k : (b, hkv, n, d) or (hkv, n, d), any strides with a contiguous last dim (e.g. a slice of the cache);
        rotated in place
    delta : int offset for all n keys, or int tensor (n,) one offset per key (negative moves back)
    theta : RoPE base of this layer (Gemma 3: 10K local, 1M global; SmolLM2: 100K)
    inv_freq : optional (rotary_dim // 2,) precomputed inverse frequencies (Llama 3 / linear scaling),
        used at their value; default 1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim) in float64
    layout : "half" (HF rotate_half, pairs (i, i + rotary_dim/2)) or "interleaved" (pairs (2i, 2i+1))
    rotary_dim : rotated leading dims (default d); the rest are untouched

    Returns
    -------
    k, rotated. Angles in float64, rotation in float32: exact to float32 rounding for |delta| up to 10^5.

    Raises
    ------
    ValueError
        Bad shapes/dtypes/layout, delta of the wrong shape, inv_freq of the wrong length.
    """
    fn = _impl(k, "rope", "rope_reencode_")
    return fn(k, delta, theta=theta, inv_freq=inv_freq, layout=layout, rotary_dim=rotary_dim)
