"""The gguf weight format: the C kernel reading GGUF's quantized blocks as shipped (`gguf_blocks.h`)
against the `gguf` package's dequantization, and the packaged models loaded with their own blocks."""

import ctypes

import numpy as np
import pytest
import torch

from ldqa.attention import loader
from ldqa.attention.quant import WeightFormatError
from ldqa.kernels import cpu_linear as C

TYPES = sorted(C.GGUF_BLOCK_TYPES)  # Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K


def random_blocks(ggml_type: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(n, row bytes) uint8 of random blocks of `ggml_type`: random bits everywhere, fp16 scales (and mins)
    set to finite values of a realistic size (a random fp16 can be inf or NaN)."""
    name, per, nbytes = C.GGUF_BLOCK_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)

    def put(offset, lo, hi):
        vals = rng.uniform(lo, hi, size=(n, k // per)).astype(np.float16)
        raw[:, :, offset:offset + 2] = vals.view(np.uint8).reshape(n, k // per, 2)

    if name == "Q6_K":
        put(208, -2e-3, 2e-3)
    elif name == "Q4_K":
        put(0, 0, 2e-3), put(2, 0, 2e-3)
    else:
        put(0, -2e-2, 2e-2)
        if name in ("Q4_1", "Q5_1"):
            put(2, -0.1, 0.1)
    return torch.from_numpy(raw.reshape(n, -1))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequantize_matches_the_gguf_package_bit_for_bit(ggml_type):
    blocks = random_blocks(ggml_type, 37, 512, seed=ggml_type)
    assert torch.equal(C.dequantize_gguf(blocks, ggml_type, 512), C.dequantize_gguf_reference(blocks, ggml_type, 512))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_bf16_dequantize_rounds_as_torch_does(ggml_type):
    # a prefill's bf16 GEMM weight is dequantized straight to bf16 in C: the same bits as the fp32 values
    # rounded by torch (nearest even); 37 rows on 2 threads, so rows split between threads
    blocks = random_blocks(ggml_type, 37, 512, seed=ggml_type + 100)
    want = C.dequantize_gguf(blocks, ggml_type, 512).to(torch.bfloat16)
    got = C.dequantize_gguf(blocks, ggml_type, 512, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("m", [1, 3, 6])
def test_kernel_matches_the_reference(ggml_type, m):
    k, n = 768, 45
    blocks = random_blocks(ggml_type, n, k, seed=ggml_type * 10 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = C.linear_gguf_reference(x, blocks, ggml_type)
    scale = float(ref.abs().max())
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            y = C.linear_gguf(x, blocks, ggml_type)
        finally:
            torch.set_num_threads(1)
        # the same integer block sums, scaled in fp32 in another order
        assert float((y - ref).abs().max()) <= 1e-5 * scale, (ggml_type, m, threads)
    # and against the exact product: at most the activations' rounding, half a step per value (int16 per 32
    # weights: a step is a block's largest value / 32767; the K types' int8 per 256: / 127), times |w|
    w = C.dequantize_gguf_reference(blocks, ggml_type, k).double()
    exact = x.double() @ w.t()
    per, top = (256, 127.0) if C.GGUF_BLOCK_TYPES[ggml_type][1] == 256 else (32, 32767.0)
    half_step = (x.abs().reshape(m, k // per, per).amax(-1, keepdim=True) / top / 2).expand(m, k // per, per)
    bound = half_step.reshape(m, k).double() @ w.abs().t()
    assert bool(((y.double() - exact).abs() <= bound * 1.001 + 1e-5 * scale).all())


@pytest.mark.parametrize("ggml_type", [12, 14])  # Q4_K, Q6_K
def test_k_types_decode_at_int8_but_outlier_blocks_at_int16(ggml_type):
    # one row of x (a decode step): int8 per 256, except a block whose amax is an outlier (int16 per 32);
    # several rows (a prefill): int16 per 32 throughout
    k, n = 1024, 37
    blocks = random_blocks(ggml_type, n, k, seed=ggml_type)
    w = C.dequantize_gguf_reference(blocks, ggml_type, k).double()
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    x[0, 700] = -60.0  # block 2: amax / RMS ~ 15
    assert C.outlier_blocks(x).tolist() == [[False, False, True, False]]
    y = C.linear_gguf(x, blocks, ggml_type)
    ref = C.linear_gguf_reference(x, blocks, ggml_type)
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    # the outlier block alone: int16's rounding (tight); an ordinary block alone: int8's (looser)
    for keep, tol in ((slice(512, 768), 2e-4), (slice(0, 256), 2e-2)):
        part = torch.zeros_like(x)
        part[0, keep] = x[0, keep]
        exact = part.double() @ w.t()
        err = float((C.linear_gguf(part, blocks, ggml_type).double() - exact).abs().max())
        assert err <= tol * float(exact.abs().max()), (keep, err)
    assert float(C.linear_gguf(torch.zeros(1, k), blocks, ggml_type).abs().max()) == 0  # amax 0: no NaN
    # two rows: both at int16 per 32, as the 32-block types
    two = torch.cat([x, torch.randn(1, k, generator=torch.Generator().manual_seed(6))])
    exact = two.double() @ w.t()
    assert float((C.linear_gguf(two, blocks, ggml_type).double() - exact).abs().max()) <= 2e-4 * float(exact.abs().max())


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if C.GGUF_BLOCK_TYPES[t][1] == 32])
@pytest.mark.parametrize("k", [32, 96, 800])
def test_odd_block_counts(ggml_type, k):
    # the row loops take blocks two at a time: 1, 3 and 25 blocks leave one for the tail
    blocks = random_blocks(ggml_type, 9, k, seed=k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(k))
    ref = C.linear_gguf_reference(x, blocks, ggml_type)
    assert float((C.linear_gguf(x, blocks, ggml_type) - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert torch.equal(C.dequantize_gguf(blocks, ggml_type, k), C.dequantize_gguf_reference(blocks, ggml_type, k))


def test_avx2_build_agrees_with_the_native_build(avx2_kernel_lib):
    # the K types have AVX-512 row loops chosen at compile time (one row of x: int8 activations, VNNI; several
    # rows: int16); the AVX2-only build (-mno-avx512f) must give the same products (fp32 rounding apart)
    fn = avx2_kernel_lib.ldqa_mats_linear
    for ggml_type in TYPES:
        blocks = random_blocks(ggml_type, 29, 512, seed=ggml_type)
        for m in (1, 2):
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(ggml_type))
            native = C.linear_gguf(x, blocks, ggml_type)
            avx2 = torch.empty(m, 29)
            mat = C.Mat(ggml_type, blocks.data_ptr(), None, 29)
            assert fn(ctypes.byref(mat), 1, x.data_ptr(), m, 512, avx2.data_ptr(), 1) == 0
            assert float((avx2 - native).abs().max()) <= 1e-5 * float(native.abs().max()), (ggml_type, m)


def test_several_matrices_in_one_call_equal_one_at_a_time():
    # the fused decode computes q | k | v (mixed types: Gemma's v is Q8_0 in half the layers) in one loop
    k = 512
    q = random_blocks(6, 64, k, seed=1)  # Q5_0
    kk = random_blocks(12, 16, k, seed=2)  # Q4_K
    vq = torch.randint(-127, 128, (16, k), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    vd = torch.full((16, k // 32), 0.01, dtype=torch.float16)
    x = torch.randn(1, k)
    mats = (C.Mat * 3)(C.mat(6, q, None), C.mat(12, kk, None), C.mat(C.Q8_0_TYPE, vq, vd))
    y = torch.empty(1, 96)
    assert C._lib().ldqa_mats_linear(ctypes.addressof(mats), 3, x.data_ptr(), 1, k, y.data_ptr(), 1) == 0
    want = torch.cat([C.linear_gguf(x, q, 6), C.linear_gguf(x, kk, 12), C.linear_q8_0(x, vq, vd)], dim=1)
    assert torch.equal(y, want)


def test_bad_blocks_are_refused():
    blocks = random_blocks(6, 4, 64)
    with pytest.raises(ValueError, match="not one the kernel reads"):
        C.linear_gguf(torch.randn(1, 64), blocks, 10)  # Q2_K
    with pytest.raises(ValueError, match="Q5_0 holding 96"):
        C.linear_gguf(torch.randn(1, 96), blocks, 6)  # rows of 64 weights, x of 96
    with pytest.raises(ValueError, match="multiple of 256"):
        C.linear_gguf(torch.randn(1, 640), random_blocks(12, 4, 512)[:, :100].contiguous(), 12)  # Q4_K: 256s
    with pytest.raises(ValueError, match="neither Q8_0 nor"):
        C.mat(10, blocks, None)


def test_a_hugging_face_directory_has_no_blocks(tiny_model_dir):
    with pytest.raises(WeightFormatError, match="Hugging Face directory: use weights='q8_0'"):
        loader.load_model(str(tiny_model_dir("llama")), weights="gguf")


def _greedy(lm, ids, steps):
    m, n = lm.model, len(ids)
    cache = m.new_cache()
    with torch.no_grad():
        logits = m(torch.tensor([ids]), torch.arange(n), cache)
        first, toks = logits[0, -1].clone(), []
        for i in range(steps):
            toks.append(int(logits[0, -1].argmax()))
            logits = m(torch.tensor([[toks[-1]]]), torch.tensor([n + i]), cache)
    return first, toks


def _forced(lm, ids, toks):
    """Logits (len(toks), vocab) of the prompt's last token and after each of toks[:-1], fed in turn."""
    m, n = lm.model, len(ids)
    cache = m.new_cache()
    with torch.no_grad():
        out = [m(torch.tensor([ids]), torch.arange(n), cache)[0, -1].clone()]
        for i, t in enumerate(toks[:-1]):
            out.append(m(torch.tensor([[t]]), torch.tensor([n + i]), cache)[0, -1].clone())
    return torch.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("name, types", [("smollm2-135m", {"Q4_1"}), ("gemma3-270m", {"Q5_0", "Q4_K", "Q6_K"})])
def test_packaged_models_keep_their_blocks_and_match_fp32(name, types, monkeypatch):
    # smollm2 is a Llama: its q/k rows are un-permuted (the loader finds the permutation); gemma mixes five
    # block types, Q8_0 ones (embedding, half the v projections) become q8_0 with the same values.
    # The prompt's rows go through the C kernel here (a prompt this short would otherwise take the bf16
    # GEMM, whose weight and activation rounding moves the logits ~1-2%; its own test is above)
    from ldqa.attention import quant

    monkeypatch.setattr(quant, "GGUF_PREFILL_ROWS", 1 << 30)
    lm = loader.load_model(name, weights="gguf")
    layers = lm.model.model.layers
    found = {C.GGUF_BLOCK_TYPES[mod.ggml_type][0] for layer in layers for mod in layer.modules()
             if getattr(mod, "fmt", None) == "gguf"}
    assert found == types
    assert lm.model.decoder.kind == "c-step" and all(f is not None for f in lm.model.decoder.fused)
    ids = lm.tokenizer.encode("Question: who wrote the novel Moby-Dick, published in 1851? Answer:")
    ref = loader.load_model(name, weights="fp32")
    _, ref_toks = _greedy(ref, ids, 16)
    # the very weights of fp32 (both read the same blocks): only the activations' rounding differs. Both
    # are fed fp32's greedy tokens: the prefill (several rows: int16 activations) stays within 2e-3 of
    # fp32's logits; a decode step of the K types rounds activations to int8 per 256 (as ggml's Q8_K), which
    # moves Gemma's logits by 3-5% of their largest magnitude (measured; a wrong block reads O(1) off), so
    # the two pick the same token wherever fp32's top two are more than half a logit apart (Gemma's third
    # token of this prompt is a 0.15-logit call, which the int8 rounding may flip)
    got, want = _forced(lm, ids, ref_toks), _forced(ref, ids, ref_toks)  # (16, vocab) each
    rel = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(rel[0]) < 2e-3 and float(rel.max()) < 0.08, rel
    top2 = torch.topk(want, 2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert bool(clear.sum() >= 12) and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("ggml_type", [12, 14, 2])
def test_gguf_rows_from_the_crossover_take_the_bf16_gemm(ggml_type):
    # fewer than GGUF_PREFILL_ROWS rows run the C kernel (decode numerics); from it on, the weight is
    # dequantized straight to bf16 and multiplied in one GEMM (prefill numerics)
    from ldqa.attention.quant import GGUF_PREFILL_ROWS, QLinear

    k, n = 512, 48
    blocks = random_blocks(ggml_type, n, k, seed=7)
    lin = QLinear.from_portable({"ggml_type": ggml_type, "blocks": blocks}, None, k, n)
    assert lin.gemm_rows() == GGUF_PREFILL_ROWS
    g = torch.Generator().manual_seed(1)
    few = torch.randn(GGUF_PREFILL_ROWS - 1, k, generator=g)
    many = torch.randn(GGUF_PREFILL_ROWS, k, generator=g)
    assert torch.equal(lin(few), C.linear_gguf(few, blocks, ggml_type))
    w = C.dequantize_gguf(blocks, ggml_type, k, torch.bfloat16)
    assert torch.equal(lin(many), torch.nn.functional.linear(many.to(torch.bfloat16), w).float())
