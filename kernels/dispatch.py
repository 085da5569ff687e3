"""The one place the runtime calls for attention math.

Every attention call in `ldqa.attention` goes through a function here. Each function picks an
implementation: the Triton kernel for CUDA tensors, the pure-torch reference on the CPU.
`LDQA_KERNELS=triton|torch` overrides the choice (``triton`` on CPU tensors needs TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

from ldqa.kernels import reference


def backend_for(t: torch.Tensor) -> str:
    """Return "triton" or "torch" for tensor `t` (honours LDQA_KERNELS).

    Raises ValueError when LDQA_KERNELS holds anything but "triton" or "torch".
    """
    forced = os.environ.get("LDQA_KERNELS", "").strip().lower()
    if forced in ("triton", "torch"):
        return forced
    if forced:
        raise ValueError(f"LDQA_KERNELS={forced!r}: use 'triton' or 'torch'")
    return "triton" if t.is_cuda else "torch"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention with GQA.

    q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, k_len, head_dim) with
    q_heads % kv_heads == 0 (query head h reads KV head h // (q_heads // kv_heads));
    mask: bool, broadcastable to (batch, q_heads, q_len, k_len), True = may attend; None = attend to all.
    scale: multiplies q.k (default head_dim ** -0.5).
    Returns (batch, q_heads, q_len, head_dim) in q's dtype. A query row with no allowed key returns zeros.
    """
    return reference.attention(q, k, v, mask=mask, scale=scale)
