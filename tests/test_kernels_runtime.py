"""The runtime on the Triton kernels (the CUDA path, `Attention._attend_kernels`), run on the CPU through
Triton's interpreter with LDQA_KERNELS=triton, against the same runtime on the torch reference: a prompt's
prefill, greedy decode steps (split-KV decode, Gemma 3's sliding windows), block reuse and block+recompute
(explicit positions, tokens recomputed in place), with an fp32 and a bf16 KV cache (the kernels read a
bf16 cache as bf16, the reference casts it to fp32). The device moves themselves need a GPU: tests/test_gpu.py.

As in test_kernels.py, the interpreter must be switched on before Triton is first imported: here when
nothing has imported it and there is no CUDA (CI), else this file re-runs itself in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available()
)
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"

FAMILIES = ("qwen2", "gemma3", "llama3-scaled")
# |logits(kernels) - logits(torch)|: an fp32 cache computes the same sums in another order; a bf16 cache
# rounds the queries to bf16 on the kernel side (measured up to 5e-3 on tiny Gemma 3, logits of ~1)
ATOL = {"fp32": 1e-5, "bf16": 2e-2}


if not IN_PROCESS:

    def test_runtime_kernels_in_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _run(model_dir, kv_dtype: str) -> dict:
    """Logits of a 40-token prompt, 6 greedy decode steps, and block / block+recompute prefills of a
    3-passage prompt, on the backend LDQA_KERNELS selects."""
    from ldqa.attention.block_attention import BlockRuntime
    from ldqa.attention.loader import load_model
    from ldqa.attention.segments import PromptSegments

    lm = load_model(str(model_dir), weights="fp32", kv_dtype=kv_dtype)
    model = lm.model
    ids = torch.randint(3, 2000, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(capacity=64)
    out = {"prefill": model(ids, torch.arange(40), cache)}
    logits, tokens = out["prefill"], []
    for _ in range(6):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), torch.tensor([cache.next_position()]), cache)
    out["tokens"], out["decode"] = tokens, logits
    rt = BlockRuntime(model, lm.fingerprint, None)
    assert rt.self_check(), rt.disabled_reason
    seg = PromptSegments(prefix=[1, 5, 6, 7], headers=[[10, 11], [10, 12], [10, 13]],
                         passages=[list(range(100, 112)), list(range(200, 209)), list(range(300, 315))],
                         question=[50, 51, 52, 53])
    for mode in ("block", "block+recompute"):
        out[mode] = rt.prefill(seg, [None, None, None], mode=mode, recompute_ratio=0.3)[1]
    return out


@pytest.mark.skipif(not IN_PROCESS, reason="runs in a child process with TRITON_INTERPRET=1")
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_on_the_kernels_matches_the_reference(tiny_model_dir, monkeypatch, family, kv_dtype):
    from ldqa.attention import model as model_module

    d = tiny_model_dir(family)
    monkeypatch.setenv("LDQA_KERNELS", "torch")
    ref = _run(d, kv_dtype)
    monkeypatch.setenv("LDQA_KERNELS", "triton")
    calls = []
    real = model_module.Attention._attend_kernels
    monkeypatch.setattr(model_module.Attention, "_attend_kernels",
                        lambda self, *a: calls.append(1) or real(self, *a))
    got = _run(d, kv_dtype)
    assert calls, "the kernel path was not taken"
    assert got["tokens"] == ref["tokens"]
    for key in ("prefill", "decode", "block", "block+recompute"):
        err = (got[key] - ref[key]).abs().max().item()
        assert err <= ATOL[kv_dtype], (key, err)
