"""Log-sum-exp merge of two partial attention results, in Triton.

Attention over a key set A ∪ B (disjoint) equals a weighted mix of attention over A and over B, the
weights being softmax(lse_a, lse_b): the identity behind FlashAttention's online softmax, split-KV
decoding (Flash-Decoding) and RetrievalAttention's merge of the GPU-resident steady zone with the
retrieved keys. The merge is associative and commutative, and an empty part (lse = -inf) is its
identity element.

One program merges BLOCK_R rows of head_dim values; all arithmetic in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldqa.kernels import common


@triton.jit
def _merge(
    OA, LA, OB, LB, O, L, n_rows, d,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BR,) int64 offsets
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < n_rows
    mask = r_ok[:, None] & (offs_d < d)[None, :]
    la = tl.load(LA + rows, mask=r_ok, other=float("-inf"))  # (BR,)
    lb = tl.load(LB + rows, mask=r_ok, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both parts empty: weights 0, no NaN
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    tot = wa + wb
    inv = tl.where(tot > 0.0, 1.0 / tl.where(tot > 0.0, tot, 1.0), 0.0)
    ptr = rows[:, None] * d + offs_d[None, :]
    oa = tl.load(OA + ptr, mask=mask, other=0.0).to(tl.float32)  # (BR, BD)
    ob = tl.load(OB + ptr, mask=mask, other=0.0).to(tl.float32)
    out = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    tl.store(O + ptr, out.to(O.dtype.element_ty), mask=mask)
    lse = tl.where(tot > 0.0, m_safe + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf"))
    tl.store(L + rows, lse, mask=r_ok)


_INTERPRETED = type(_merge).__name__ == "InterpretedFunction"  # running under TRITON_INTERPRET=1


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton LSE merge; arguments and results as `dispatch.merge_lse`."""
    common.check_merge_inputs(out_a, lse_a, out_b, lse_b)
    d = out_a.shape[-1]
    n_rows = lse_a.numel()
    oa, ob = out_a.contiguous(), out_b.contiguous()
    la, lb = lse_a.contiguous(), lse_b.contiguous()
    out = torch.empty_like(oa)  # (..., d)
    lse = torch.empty_like(la)  # (...,)
    if n_rows == 0 or d == 0:
        return out.zero_(), lse.copy_(torch.maximum(la, lb))
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(64, 4096 // block_d))
    _merge[(triton.cdiv(n_rows, block_r),)](oa, la, ob, lb, out, lse, n_rows, d, BLOCK_R=block_r, BLOCK_D=block_d)
    return out, lse
