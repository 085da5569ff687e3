"""The q8_0 weight format's CPU kernel (kernels/q8_0.c via kernels/cpu_linear.py) against its torch
reference and against an fp32 product; GGUF Q8_0 round trips; the fallbacks when it cannot be built."""

import ctypes
import platform

import numpy as np
import pytest
import torch

from ldqa.attention.quant import QEmbedding, QLinear, quantize_portable, quantize_q8_0
from ldqa.kernels import c_library
from ldqa.kernels import cpu_linear as C

X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(autouse=True)
def _fresh_build(tmp_path_factory, monkeypatch):
    """Each test decides the build again, in a cache directory of this module (the first test compiles)."""
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cpu-linear-cache"))
    monkeypatch.delenv("LDQA_CPU_KERNELS", raising=False)
    C.reset()
    yield
    C.reset()


def _q8(n, k, seed=0, scale=0.02):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    return quantize_q8_0(w)


@pytest.mark.skipif(not X86, reason="the kernel is written for x86-64")
def test_kernel_builds_on_this_machine():
    # every machine this project runs on (dev, CI) is x86-64 with AVX2 and gcc: a silent fallback to the
    # slow reference there would be a defect, so this fails instead of skipping
    assert C.available(), C.unavailable_reason()


# odd block counts (K / 32 = 1, 3, 5, 7), N of no particular multiple, M around the AVX-512 build's 4-row
# tile (1, 3, 4, 5, 8, 17, 33)
@pytest.mark.parametrize("n,k,m", [(1, 32, 1), (37, 64, 1), (300, 640, 1), (300, 640, 3), (129, 96, 5),
                                   (64, 2048, 33), (37, 224, 17), (13, 160, 4), (1, 32, 17), (31, 320, 8)])
def test_kernel_matches_reference_and_fp32(n, k, m):
    q, d = _q8(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = C.linear_q8_0(x, q, d)
    ref = C.linear_q8_0_reference(x, q, d)
    exact = x.double() @ C.dequantize_q8_0(q, d).double().t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    scale = float(exact.abs().max())
    # same integers, summed in another order: fp32 rounding only
    assert float((y - ref).abs().max()) <= 1e-5 * scale
    # against the float product of the same weights: the int16 rounding of the activations (2^-16 of a
    # block's largest value) is the only approximation
    assert float((y.double() - exact).abs().max()) <= 2e-4 * scale


def test_avx2_build_agrees_with_the_native_build(avx2_kernel_lib):
    # q8_0.c's AVX-512 4-row tile (M >= 4) is chosen at compile time; the AVX2-only build (the fallback of
    # machines without AVX-512) is built here too (-mno-avx512f) and compared with the native build: the
    # same integer block sums, so fp32 rounding only; a single row goes through the same AVX2 loop in both
    # builds, bit for bit
    fn = avx2_kernel_lib.ldqa_q8_0_linear
    for n, k, m in [(37, 224, 1), (37, 224, 17), (6, 96, 3), (129, 640, 5), (1, 32, 4)]:
        q, d = _q8(n, k, seed=n * k + m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        native = C.linear_q8_0(x, q, d)
        avx2 = torch.empty(m, n)
        for threads in (1, 2):
            assert fn(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), n, avx2.data_ptr(), threads) == 0
            assert float((avx2 - native).abs().max()) <= 1e-5 * float(native.abs().max()), (n, k, m, threads)
            if m < 4:
                assert torch.equal(avx2, native), (n, k, m, threads)


def test_extreme_values_do_not_overflow():
    # every weight +-127 and every activation at its block's maximum: the largest integer block sums
    k, n = 640, 16
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[1::2] = -127
    d = torch.full((n, k // 32), 0.5, dtype=torch.float16)
    x = torch.full((5, k), 1e4)  # 5 rows: one 4-row tile of the AVX-512 build, then one row alone
    x[1], x[2], x[4] = -3e-3, -1e4, -2.5
    y = C.linear_q8_0(x, q, d)
    want = x.double() @ C.dequantize_q8_0(q, d).double().t()
    assert torch.allclose(y.double(), want, rtol=1e-5)


def test_zero_blocks_and_zero_activations():
    q, d = _q8(40, 64)
    q[:, :32], d[:, 0] = 0, 0  # an all-zero block (quantize_q8_0 gives d = 0 for it)
    x = torch.zeros(2, 64)
    x[1, 40] = 3.0
    y = C.linear_q8_0(x, q, d)
    assert torch.equal(y[0], torch.zeros(40))
    assert torch.allclose(y[1], C.dequantize_q8_0(q, d)[:, 40] * 3.0, rtol=1e-4)


def test_bad_shapes_are_refused():
    q, d = _q8(8, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        C.linear_q8_0(torch.randn(1, 48), q[:, :48], d[:, :1])
    with pytest.raises(ValueError, match="do not fit"):
        C.linear_q8_0(torch.randn(1, 64), q, d[:, :1])


def test_gguf_q8_0_round_trips_exactly():
    # a tensor as llama.cpp stores it (gguf-py's own Q8_0 quantizer), dequantized as the loader reads
    # GGUF tensors, comes back as the very same int8 values and fp16 scales
    from gguf import GGMLQuantizationType, dequantize, quantize

    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 0.05
    raw = quantize(w, GGMLQuantizationType.Q8_0)  # (48, 8 blocks * 34 bytes)
    blocks = raw.reshape(48, 8, 34)
    d_gguf = torch.from_numpy(blocks[..., :2].copy().view(np.float16).reshape(48, 8))
    q_gguf = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(48, 256))
    q, d = quantize_q8_0(torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)))
    assert torch.equal(q, q_gguf) and torch.equal(d, d_gguf)


def test_q8_0_layer_decode_and_prefill_paths():
    w, b = torch.randn(96, 128), torch.randn(96)
    lin = QLinear.from_float(w, b, "q8_0")
    assert lin.fmt == "q8_0" and lin.qweight.dtype == torch.int8 and lin.bscales.dtype == torch.float16
    deq = lin.dequantized()
    for rows, tol in ((1, 1e-4), (5, 1e-4), (40, 0.02)):  # 40 rows: dequantized bf16 GEMM (prefill)
        x = torch.randn(2, rows, 128)
        want = x @ deq.t() + b
        assert float((lin(x) - want).abs().max()) <= tol * float(want.abs().max()), rows
    # a q8_0 weight whose input width is no multiple of 32 is stored as int8
    assert QLinear.from_float(torch.randn(8, 48), None, "q8_0").fmt == "int8"


def test_q8_0_embedding_rows_are_the_heads_weights():
    w = torch.randn(64, 32)
    t = quantize_portable(w, "q8_0")
    emb, head = QEmbedding(t, 64, 32), QLinear.from_portable(t, None, 32, 64)
    assert emb.fmt == "q8_0"
    assert torch.equal(emb(torch.tensor([[0, 5, 63]]))[0], head.dequantized()[[0, 5, 63]])


def test_env_forces_the_reference(monkeypatch):
    monkeypatch.setenv("LDQA_CPU_KERNELS", "torch")
    C.reset()
    assert not C.available() and "LDQA_CPU_KERNELS" in C.unavailable_reason()
    q, d = _q8(50, 64)
    x = torch.randn(2, 64)
    assert torch.equal(C.linear_q8_0(x, q, d), C.linear_q8_0_reference(x, q, d))


def test_no_compiler_falls_back_to_the_reference_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(c_library, "_compiler", lambda: None)
    assert not C.available()
    assert "no C compiler" in C.unavailable_reason() or not X86
    q, d = _q8(50, 64)
    x = torch.randn(1, 64)
    assert torch.equal(C.linear_q8_0(x, q, d), C.linear_q8_0_reference(x, q, d))


@pytest.mark.skipif(not X86, reason="the kernel is written for x86-64")
def test_failed_build_and_damaged_library(monkeypatch, tmp_path):
    bad = tmp_path / "q8_0.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(c_library, "_SOURCES", (bad, *c_library._SOURCES[1:]))
    assert not C.available() and "building the q8_0 CPU kernel failed" in C.unavailable_reason()
    monkeypatch.undo()
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "a"))
    C.reset()
    assert C.available()
    (lib,) = (tmp_path / "a" / "kernels").glob("q8_0-*.so")
    # a damaged copy under the name a later process would load (truncated by a crash or a full disk);
    # written to another directory: the library loaded above stays mapped and must not be touched
    damaged = tmp_path / "b" / "kernels" / lib.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(lib.read_bytes()[:100])
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "b"))
    C.reset()
    assert C.available(), C.unavailable_reason()  # rebuilt, not loaded damaged
    assert damaged.stat().st_size == lib.stat().st_size


@pytest.mark.skipif(not X86, reason="the kernel is written for x86-64")
@pytest.mark.parametrize("heads,kv_heads,L,d", [(4, 1, 512, 256), (4, 1, 1416, 256), (8, 2, 7, 64), (2, 2, 1, 64),
                                                (16, 1, 300, 256), (6, 3, 65, 64), (8, 1, 100, 256), (4, 1, 70, 40),
                                                (1, 1, 33, 32), (12, 2, 1416, 128), (14, 2, 300, 64),
                                                (9, 3, 70, 64), (5, 1, 40, 16), (3, 1, 97, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_the_reference(heads, kv_heads, L, d, threads):
    # g = heads / kv_heads of 1..8 with d a multiple of 32 (g <= 4) or 16 (g > 4) take the tiled pass (tiles
    # of 32 keys, split between threads, merged by log-sum-exp; Qwen2.5 1.5B's g = 6, 0.5B's g = 7,
    # SmolLM2's g = 3); the others (g = 16, d = 40) the generic loops
    from ldqa.kernels import dispatch, reference

    g = torch.Generator().manual_seed(L + heads)
    cap = L + 21  # a slice of a larger cache, as the model passes it (rows contiguous, heads strided)
    kc, vc = torch.randn(1, kv_heads, cap, d, generator=g), torch.randn(1, kv_heads, cap, d, generator=g)
    k, v = kc[:, :, 5:5 + L], vc[:, :, 5:5 + L]
    q = torch.randn(1, heads, 1, d, generator=g) * 3
    some = torch.rand(1, L, generator=g) > 0.4
    some[0, -1] = True
    late = torch.zeros(1, L, dtype=torch.bool)  # whole tiles (and the first thread's keys) masked
    late[0, 2 * L // 3:] = True
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for mask in (None, some, late, torch.zeros(1, L, dtype=torch.bool)):
            assert C.decode_attention_fits(q, k, v, mask)
            want = reference.attention(q, k, v, mask=mask, scale=0.07)
            got = C.decode_attention(q, k, v, mask, 0.07)
            assert got.shape == want.shape == (1, heads, 1, d)
            assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), mask
            # the model's entry point takes this path
            assert torch.equal(dispatch.attention(q, k, v, mask=mask, scale=0.07), got)
        assert torch.equal(C.decode_attention(q, k, v, torch.zeros(1, L, dtype=torch.bool), 0.07), torch.zeros_like(q))
        # an additive bias per key (position debiasing's log weights): softmax(q.k * scale + bias)
        bias = torch.randn(L, generator=g) * 2
        for mask in (None, some):
            scores = torch.einsum("hgd,hld->hgl", q[0, :, 0].view(kv_heads, -1, d), k[0]) * 0.07 + bias
            if mask is not None:
                scores = scores.masked_fill(~mask.view(1, 1, L), float("-inf"))
            want = torch.einsum("hgl,hld->hgd", torch.softmax(scores, -1), v[0]).reshape(1, heads, 1, d)
            got = C.decode_attention(q, k, v, mask, 0.07, bias)
            assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), mask
        assert torch.equal(C.decode_attention(q, k, v, None, 0.07, torch.zeros(L)), C.decode_attention(q, k, v, None, 0.07))
        with pytest.raises(ValueError, match="bias"):
            C.decode_attention(q, k, v, None, 0.07, torch.zeros(L + 1))
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not X86, reason="the kernel is written for x86-64")
@pytest.mark.parametrize("heads,kv_heads,L,d", [(12, 2, 1416, 128), (4, 1, 600, 256), (14, 2, 257, 64),
                                                (9, 3, 1000, 64), (16, 1, 300, 256)])
def test_decode_attention_does_not_depend_on_the_thread_count(heads, kv_heads, L, d):
    # the keys' partial results are fixed chunks, merged in order, whichever thread computes them
    g = torch.Generator().manual_seed(L)
    k, v = torch.randn(1, kv_heads, L, d, generator=g), torch.randn(1, kv_heads, L, d, generator=g)
    q = torch.randn(1, heads, 1, d, generator=g) * 3
    mask = torch.rand(1, L, generator=g) > 0.3
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append((C.decode_attention(q, k, v, None, 0.09), C.decode_attention(q, k, v, mask, 0.09)))
    finally:
        torch.set_num_threads(old)
    for other in outs[1:]:
        assert torch.equal(other[0], outs[0][0]) and torch.equal(other[1], outs[0][1])


def test_decode_attention_declines_what_it_does_not_take():
    q, k, v = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32)
    assert C.decode_attention_fits(q, k, v, None) == X86
    assert not C.decode_attention_fits(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert not C.decode_attention_fits(torch.randn(1, 4, 2, 32), k, v, None)  # two query tokens
    assert not C.decode_attention_fits(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, None)
    assert not C.decode_attention_fits(q, k, v, torch.ones(4, 1, 9, dtype=torch.bool))  # a mask per head


def test_decode_attention_env_forces_the_reference(monkeypatch):
    from ldqa.kernels import dispatch, reference

    q, k, v = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32)
    monkeypatch.setenv("LDQA_KERNELS", "torch")
    assert torch.equal(dispatch.attention(q, k, v), reference.attention(q, k, v))


@pytest.mark.bench
@pytest.mark.skipif(not X86, reason="the kernel is written for x86-64")
def test_bench_decode_attention_times_every_packaged_shape(tmp_path):
    import json

    from ldqa.eval.bench import bench_decode_attention as bench

    assert bench.main(["--lengths", "40", "--threads", "1", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench-decode-attention.json").read_text())
    assert [r["model"] for r in rows] == [s[0] for s in bench.SHAPES]
    assert all(r["keys"] == 40 and r["us_per_call"] > 0 for r in rows)


def test_bf16_dequantize_q8_0_rounds_as_torch_does():
    # the C path (fp16 scale x int8 in fp32, rounded to nearest even) against torch's fp32 product rounded by
    # `.to`; scales spread over many binades so that every rounding case (ties included) occurs
    q, d = _q8(29, 256, seed=3, scale=0.5)
    d = (d.float() * torch.logspace(-3, 3, 29)[:, None]).to(torch.float16)
    want = (q.float().reshape(29, 8, 32) * d.float()[..., None]).reshape(29, 256).to(torch.bfloat16)
    got = C.dequantize_q8_0(q, d, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
