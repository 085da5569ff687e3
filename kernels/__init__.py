"""Attention kernels: Triton on CUDA, pure torch on the CPU. Call them through `ldqa.kernels.dispatch`.

Modules: `dispatch` (the one entry point), `reference` (torch references, the CPU path), `common`
(validation, masks, tile plans, RoPE tables; no Triton), and one Triton module per kernel: `prefill`
(FlashAttention-2 forward, block-sparse), `decode` (split-KV Flash-Decoding with sparse selection),
`lse_merge` (log-sum-exp merge), `rope` (in-place RoPE re-encoding). See docs/kernels.md.
"""
