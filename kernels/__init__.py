"""Attention kernels: Triton on CUDA, pure torch on the CPU. Call them through `ldqa.kernels.dispatch`.

Modules: `dispatch` (the one entry point), `reference` (torch references, the CPU path), `common`
(validation, masks, tile plans, RoPE tables; no Triton), and one Triton module per kernel: `prefill`
(FlashAttention-2 forward, block-sparse), `decode` (split-KV Flash-Decoding with sparse selection),
`lse_merge` (log-sum-exp merge), `rope` (in-place RoPE re-encoding). See docs/kernels.md.
"""

if __name__ == "kernels":  # pragma: no cover - exercised by tests/test_layering.py in a subprocess
    # This folder was imported as a top-level package `kernels`: the repository root is on sys.path (python -m
    # or pytest run from it). ldqa itself always imports it as `ldqa.kernels`; the name `kernels` belongs to
    # the Hugging Face distribution of that name, which transformers >= 5.25 imports. Hand the name over to it
    # when it is installed (the import system returns whatever sys.modules holds once this file has run).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real
        _spec.loader.exec_module(_real)
