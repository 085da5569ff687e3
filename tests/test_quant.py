"""Weight formats (fp32, bf16, int8, int4): quantization round trips, the packed matmuls against the
dequantized weights, every family's logits against fp32, block reuse with quantized weights, and bad
input (unknown format, truncated or stale weight cache)."""

from __future__ import annotations

import pytest
import torch

from ldqa.attention import loader, model_sources, weight_cache
from ldqa.attention.block_attention import BlockRuntime
from ldqa.attention.generate import SamplingConfig, start_generation
from ldqa.attention.loader import load_model
from ldqa.attention.quant import (QEmbedding, QLinear, WeightFormatError, check_format, dequantize_int4,
                                  dequantize_int8, model_nbytes, quantize_int4, quantize_int8,
                                  quantize_portable, unpack_int4)

FAMILIES = ("llama", "llama3-scaled", "qwen2", "qwen3", "gemma3")  # as in conftest._hf_config
# Largest logit difference against fp32, relative to the largest fp32 logit, on the tiny random models
# (40-token prompt, int4 group 32). Measured: bf16 <= 0.014, int8 <= 0.029, int4 0.11-0.15 (random
# Gaussian weights are int4's worst case, and these models' near-flat logits make greedy agreement
# noise: it is printed, not asserted; the packaged models' agreement is in docs/results.md).
REL_TOL = {"bf16": 0.03, "int8": 0.05, "int4": 0.25, "q8_0": 0.05}


def _prompt(lm, n):
    text = "The block attention method encodes every retrieved passage independently. " * 10
    return [lm.tokenizer.bos_id] + lm.tokenizer.encode(text)[: n - 1]


def _logits(lm, ids):
    return lm.model(torch.tensor([ids]), torch.arange(len(ids)), None, all_logits=True)[0]


def _greedy(lm, ids, n):
    gen = start_generation(lm.model, ids, lm.tokenizer.decode, [], SamplingConfig(max_new_tokens=n))
    for _ in gen:
        pass
    return gen.token_ids


def test_int8_round_trip_error_is_half_a_step():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 3
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (48,)
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()  # the bf16-rounded scale still covers the row: no clamping
    assert (dequantize_int8(q, s)[5] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_quantized_in_row_chunks_equals_the_whole_matrix_at_once(dtype):
    import ldqa.attention.quant as Q

    w = (torch.randn(150, 40, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)  # 150: 2 chunks + 22
    w[70] = 0.0
    before = w.clone()
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.bfloat16).float()
    q_want = torch.round(w32 / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    q, s = Q.quantize_int8(w)
    assert Q.QUANTIZE_CHUNK_ROWS < 150 and torch.equal(q, q_want) and torch.equal(s, scales)
    assert torch.equal(w, before)  # the input is never written


@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_error_is_half_a_step(group):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    nib, s, z = quantize_int4(w, group)
    assert nib.shape == (32, 64) and nib.dtype == torch.uint8 and s.shape == (32, 128 // group)
    q = unpack_int4(nib)
    assert int(q.max()) <= 15
    # low nibble = even input channel: byte 0 of row 0 holds q[0, 0] and q[0, 1]
    assert int(nib[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    err = (dequantize_int4(nib, s, z) - w).abs().reshape(32, -1, group)
    # half a step, plus the bf16 rounding of the zero point (values at the group's ends may clamp by it)
    assert (err <= s[..., None] / 2 + z.abs()[..., None] / 128 + 1e-5).all()
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(16, 100), 64)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("rows", [5, 40])  # 3 x 40 rows: int8 takes its dequantize + bf16 GEMM path
def test_qlinear_computes_with_its_quantized_weight(fmt, rows):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(64, 128, generator=g), torch.randn(64, generator=g)
    x = torch.randn(3, rows, 128, generator=g)
    lin = QLinear.from_float(w, b, fmt, group_size=32)
    y = lin(x)
    assert y.shape == (3, rows, 64) and y.dtype == torch.float32
    t = quantize_portable(w, fmt, 32)
    deq = {"fp32": lambda: t["weight"], "bf16": lambda: t["weight"].float(),
           "int8": lambda: dequantize_int8(t["qweight"], t["scales"]),
           "int4": lambda: dequantize_int4(t["nibbles"], t["scales"], t["zeros"])}[fmt]()
    # the packed op multiplies by exactly these weights (the op's own dequantization agrees with ours)
    assert torch.allclose(lin.dequantized(), deq, atol=0.02 * float(deq.abs().max()))
    ref = x @ deq.t() + b  # fp32 matmul of the same quantized weights: only the bf16 activations differ
    tol = 1e-5 if fmt == "fp32" else 0.02
    assert (y - ref).abs().max() <= tol * ref.abs().max()
    assert (y - (x @ w.t() + b)).abs().max() <= {"fp32": 1e-5, "bf16": 0.02, "int8": 0.03, "int4": 0.2}[fmt] * ref.abs().max()


def test_int4_falls_back_to_int8_where_the_shape_does_not_fit():
    lin = QLinear.from_float(torch.randn(24, 64), None, "int4", group_size=32)  # 24 rows: not a multiple of 16
    assert lin.fmt == "int8"
    assert lin(torch.randn(2, 64)).shape == (2, 24)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_embedding_rows_are_the_heads_weights(fmt):
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    t = quantize_portable(w, fmt, 32)
    emb, head = QEmbedding(t, 64, 32), QLinear.from_portable(t, None, 32, 64)
    rows = emb(torch.tensor([[0, 5, 63]]))
    assert rows.shape == (1, 3, 32) and rows.dtype == torch.float32
    assert torch.allclose(rows[0], head.dequantized()[[0, 5, 63]], atol=0.01 * float(w.abs().max()))


def test_unknown_format_and_group_size_are_refused_by_name():
    with pytest.raises(WeightFormatError, match="unknown weight format 'int3'.*fp32, bf16, int8, int4, q8_0, gguf"):
        check_format("int3")
    with pytest.raises(WeightFormatError, match="group size 48"):
        check_format("int4", group_size=48)
    with pytest.raises(ValueError, match="kv_dtype"):
        load_model("gemma3-270m", kv_dtype="fp8")


def test_weights_env_variable(monkeypatch):
    monkeypatch.setenv("LDQA_WEIGHTS", "bf16")
    assert loader.default_weights() == "bf16"
    monkeypatch.setenv("LDQA_WEIGHTS", "q8")
    with pytest.raises(WeightFormatError, match=r"\$LDQA_WEIGHTS='q8'"):
        loader.default_weights()
    monkeypatch.delenv("LDQA_WEIGHTS")
    assert loader.default_weights() == loader.DEFAULT_WEIGHTS == "gguf"  # the packaged GGUF's own blocks
    assert loader.default_weights("smollm2-135m") == loader.default_weights("/m/x.gguf") == "gguf"
    assert loader.default_weights("/models/some-hf-dir") == loader.DEFAULT_WEIGHTS_HF == "q8_0"  # no blocks
    # where the C kernel cannot be built, the default is int8 (not gguf/q8_0 on the slow reference)
    monkeypatch.setattr(loader.cpu_linear, "available", lambda: False)
    assert loader.default_weights() == loader.default_weights("/models/some-hf-dir") == "int8"


@pytest.mark.parametrize("fmt", ["int8", "q8_0"])
def test_prefill_weight_is_dequantized_once_and_kept_unless_asked_otherwise(fmt, monkeypatch):
    """$LDQA_PREFILL_WEIGHTS=keep (default): the first prefill's bf16 weight is the one every later prefill
    multiplies with (the same tensor, the same outputs); dequantize: a new one each pass, nothing kept;
    any other value is refused by name."""
    from ldqa.kernels import cpu_linear

    if fmt == "q8_0" and not cpu_linear.available():
        pytest.skip("no C kernel on this machine")
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(64, 128, generator=g), torch.randn(40, 128, generator=g)
    monkeypatch.delenv("LDQA_PREFILL_WEIGHTS", raising=False)
    lin = QLinear.from_float(w, None, fmt)
    monkeypatch.setattr("ldqa.attention.quant.PACK_AFTER_USES", 3)
    first = lin.prefill_weight(40)
    y = lin(x)  # the second use
    assert lin.prefill_weight(40) is not first and torch.equal(lin(x), y)  # the third packs it, same products
    packed = lin.prefill_weight(40)
    assert packed.is_mkldnn and lin.prefill_weight(40) is packed and not first.is_mkldnn
    assert torch.equal(packed.to_dense(), first) and torch.equal(first, lin.dequantized(torch.bfloat16))
    assert lin.kept_prefill_bytes() == 64 * 128 * 2
    assert lin.prefill_weight(1) is None  # decode rows take the quantized kernels as before
    monkeypatch.setenv("LDQA_PREFILL_WEIGHTS", "dequantize")
    again = lin.prefill_weight(40)
    assert again is not first and lin.prefill_weight(40) is not again and torch.equal(again, first)
    assert torch.equal(lin(x), y) and "_kept_prefill_weight" not in lin.__dict__
    monkeypatch.setenv("LDQA_PREFILL_WEIGHTS", "keep")
    lin.prefill_weight(40)
    lin.drop_prefill_weight()
    assert "_kept_prefill_weight" not in lin.__dict__
    monkeypatch.setenv("LDQA_PREFILL_WEIGHTS", "cache")
    with pytest.raises(ValueError, match=r"\$LDQA_PREFILL_WEIGHTS='cache'.*keep.*dequantize"):
        lin.prefill_weight(40)


def test_rows_round_to_int8_within_half_a_step_each_with_its_own_scale():
    from ldqa.attention.quant import quantize_rows_int8

    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 96, generator=g) * torch.tensor([1.0, 10.0, 0.01, 1.0, 1.0, 1.0])[:, None]
    x[3] = 0.0
    x[4, 7] = 50.0  # one outlier coarsens its own row only
    xq, s = quantize_rows_int8(x)
    assert xq.dtype == torch.int8 and s.shape == (6, 1) and int(xq.abs().max()) == 127
    assert torch.equal(s[:, 0], x.abs().amax(1) / 127)
    assert bool(((xq.float() * s - x).abs() <= s / 2 * (1 + 1e-5)).all())
    assert not xq[3].any() and float(s[3]) == 0.0
    assert float(s[4]) > 10 * float(s[5])


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "gguf"])
def test_int8_prefill_gemm_multiplies_prefill_rows_in_int8_and_leaves_decode_rows_alone(fmt, monkeypatch):
    """Under prefill_gemm "int8" a prefill's rows are rounded to int8 per row and multiplied with the weight
    rounded to int8 per output channel: within the two roundings of x @ W.T, each row its own (a subset of
    the rows gives the same rows bit for bit, a zero row gives the bias), the int8 format with its own
    values; decode rows take the same path as under bf16; the kept weights are one per GEMM."""
    from ldqa.attention.quant import Int8Weight, linear_int8_rows
    from ldqa.kernels import cpu_linear

    if fmt != "int8" and not cpu_linear.available():
        pytest.skip("no C kernel on this machine")
    g = torch.Generator().manual_seed(5)
    k, n = 256, 48
    if fmt == "gguf":
        from pathlib import Path

        monkeypatch.syspath_prepend(str(Path(__file__).parent))
        from test_gguf_blocks import random_blocks

        lin = QLinear.from_portable({"ggml_type": 12, "blocks": random_blocks(12, n, k, seed=3)}, None, k, n)
        lin.bias = torch.randn(n, generator=g)
    else:
        lin = QLinear.from_float(torch.randn(n, k, generator=g), torch.randn(n, generator=g), fmt)
    w = lin.dequantized()
    x = torch.randn(40, k, generator=g)
    x[9] = 0.0
    decode = x[:1]
    bf16_decode = lin(decode)
    bf16 = lin(x)
    lin.prefill_gemm = "int8"
    y = lin(x)
    want = x @ w.T + lin.bias
    # the bound of the two roundings: |x| |dW| + |dx| |W| per output, each half a step
    sx, sw = x.abs().amax(1, keepdim=True) / 127, w.abs().amax(1) / 127
    bound = (x.abs() @ (sw / 2)[None, :].expand(k, n) + (sx / 2) * w.abs().sum(1)[None, :]) * 1.01 + 1e-4
    assert bool(((y - want).abs() <= bound).all())
    assert float((y - want).abs().max()) < float((bf16 - want).abs().max()) * 20  # the same order as bf16's
    assert torch.equal(lin(x[5:40])[4:], y[9:]) and torch.equal(y[9], lin.bias)
    assert torch.equal(lin(decode), bf16_decode)  # one row: the decode path, as under bf16
    kept = lin.prefill_weight(40)
    assert isinstance(kept, Int8Weight) and lin.prefill_weight(40) is kept
    assert torch.equal(linear_int8_rows(x, kept) + lin.bias, y)
    if fmt == "int8":  # the format's own int8 values, not a copy: beside the bf16 weight, only their scales
        assert kept.q is lin.qweight and lin.kept_prefill_bytes() == n * k * 2 + n * 4
    else:
        assert lin.kept_prefill_bytes() == n * k * 2 + n * k + n * 4
    lin.prefill_gemm = "bf16"
    assert torch.equal(lin(x), bf16)
    # dequantized and rounded 20 rows at a time (3 chunks): the whole dequantized weight's rounding
    monkeypatch.setattr("ldqa.attention.quant.QUANTIZE_CHUNK_ROWS", 20)
    lin.__dict__.pop("_kept_prefill_weight", None)
    chunked = lin.prefill_weight(40, "int8")
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.bfloat16).float()
    assert torch.equal(chunked.scale, scales if fmt != "int8" else lin.scales.float())
    assert torch.equal(chunked.q, torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
                       if fmt != "int8" else lin.qweight)
    assert torch.equal(lin.dequantized_rows(5, 27), w[5:27])


def test_int8_lead_rows_split_a_pass_between_the_two_gemms_and_prefill_gemm_as_overrides(monkeypatch):
    """Under int8_lead_rows(n) a pass's first n rows are what the int8 GEMM gives them and the rest what
    bf16 gives them, bit for bit; the last rows of a pass (`pass_rows`) take bf16; prefill_gemm_as sets
    every layer's GEMM within its block; decode rows and n = 0 are untouched."""
    from ldqa.attention import quant as Q
    from ldqa.kernels import cpu_linear

    if not cpu_linear.available():
        pytest.skip("no C kernel on this machine")
    g = torch.Generator().manual_seed(6)
    lin = QLinear.from_float(torch.randn(48, 128, generator=g), torch.randn(48, generator=g), "q8_0")
    x = torch.randn(40, 128, generator=g)
    bf16 = lin(x)
    with Q.prefill_gemm_as("int8"):
        int8 = lin(x)
    assert not torch.equal(int8, bf16) and torch.equal(lin(x), bf16)
    with Q.int8_lead_rows(25):
        assert Q.int8_lead_active()
        split = lin(x)
        with Q.pass_rows(40):
            last = lin(x[-1:])
        decode = cpu_linear.linear_q8_0(x[:1], lin.qweight, lin.bscales) + lin.bias
        assert torch.equal(lin(x[:1]), decode)  # a decode row: the C kernel, as always
    assert not Q.int8_lead_active()
    assert torch.equal(split[:25], int8[:25]) and torch.equal(split[25:], bf16[25:])
    assert torch.equal(last, bf16[-1:])
    with Q.int8_lead_rows(0):
        assert torch.equal(lin(x), bf16)
    with pytest.raises(ValueError, match="'fp8'"):
        with Q.prefill_gemm_as("fp8"):
            pass


def test_prefill_gemm_choice_env_and_fingerprint(tiny_model_dir, monkeypatch, tmp_path):
    """$LDQA_PREFILL_GEMM chooses the prefill GEMM (bf16 unless set); a bad value is refused by name (by
    LongDocQA when it is made); the int8 GEMM keys KV states apart from bf16's, bias curves not."""
    from ldqa.attention.choices import prefill_gemm

    monkeypatch.delenv("LDQA_PREFILL_GEMM", raising=False)
    assert prefill_gemm("qwen2.5-coder-1.5b-instruct") == prefill_gemm("gemma3-270m") == "bf16"
    d = str(tiny_model_dir("qwen2"))
    assert load_model(d, weights="q8_0").prefill_gemm == "bf16"
    monkeypatch.setenv("LDQA_PREFILL_GEMM", "int8")
    assert prefill_gemm("gemma3-270m") == "int8"
    lm8 = load_model(d, weights="q8_0")
    assert lm8.prefill_gemm == "int8" and all(m.prefill_gemm == "int8" for m in lm8.model.modules()
                                              if isinstance(m, QLinear))
    lm16 = load_model(d, weights="q8_0", prefill_gemm="bf16")
    assert lm16.model is not lm8.model and lm16.fingerprint == lm8.fingerprint
    assert lm16.kv_fingerprint == lm16.fingerprint and lm8.kv_fingerprint != lm8.fingerprint
    assert load_model(d, weights="fp32").kv_fingerprint == load_model(d, weights="fp32").fingerprint  # no int8 GEMM
    monkeypatch.setenv("LDQA_PREFILL_GEMM", "fp8")
    with pytest.raises(ValueError, match=r"\$LDQA_PREFILL_GEMM='fp8'.*bf16.*int8"):
        prefill_gemm("gemma3-270m")
    from ldqa.app.api import LongDocQA

    with pytest.raises(ValueError, match=r"\$LDQA_PREFILL_GEMM='fp8'"):
        LongDocQA(store=tmp_path / "s", model=d)
    with pytest.raises(ValueError, match="prefill_gemm='fp4'"):
        load_model(d, weights="q8_0", prefill_gemm="fp4")


def test_block_recompute_gemm_is_the_model_s_measured_one(tiny_model_dir, tmp_path, monkeypatch):
    from ldqa.app.api import LongDocQA
    from ldqa.attention import choices

    assert choices.recompute_gemm("qwen2.5-coder-1.5b-instruct", "gguf") == "int8"
    assert choices.recompute_gemm("qwen2.5-coder-1.5b-instruct", "q8_0") == "bf16"
    assert choices.recompute_gemm("gemma3-270m", "gguf") == "bf16"
    monkeypatch.setenv("LDQA_RECOMPUTE_GEMM", "bf16")
    assert choices.recompute_gemm("qwen2.5-coder-1.5b-instruct", "gguf") == "bf16"
    monkeypatch.delenv("LDQA_RECOMPUTE_GEMM")
    d = str(tiny_model_dir("llama"))
    assert LongDocQA(store=tmp_path / "a", model=d).engine.block_runtime.recompute_gemm == "bf16"
    monkeypatch.setitem(choices.DEFAULT_RECOMPUTE_GEMM, (d, "q8_0"), "int8")
    rt = LongDocQA(store=tmp_path / "b", model=d, weights="q8_0").engine.block_runtime
    assert (rt.recompute_gemm, rt.question_int8) == ("int8", False)
    monkeypatch.setenv("LDQA_RECOMPUTE_GEMM", "int8+question")
    rt = LongDocQA(store=tmp_path / "q", model=d, weights="q8_0").engine.block_runtime
    assert (rt.recompute_gemm, rt.question_int8) == ("int8", True)
    monkeypatch.setenv("LDQA_RECOMPUTE_GEMM", "int4")
    with pytest.raises(ValueError, match=r"\$LDQA_RECOMPUTE_GEMM='int4'"):
        LongDocQA(store=tmp_path / "c", model=d)


def test_int4_without_the_op_is_refused(monkeypatch):
    monkeypatch.setattr("ldqa.attention.quant.int4_supported", lambda device="cpu": False)
    with pytest.raises(WeightFormatError, match="int4.*use weights='int8'"):
        check_format("int4")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights-cache")


@pytest.fixture(autouse=True)
def _own_cache(cache_dir, monkeypatch):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(cache_dir))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_format_stays_close_to_fp32(tiny_model_dir, family):
    d = str(tiny_model_dir(family))
    ref = load_model(d)
    ids = _prompt(ref, 40)
    want = _logits(ref, ids)
    greedy_ref = _greedy(ref, ids, 32)
    sizes = {"fp32": model_nbytes(ref.model)}
    for fmt in ("bf16", "int8", "int4", "q8_0"):
        lm = load_model(d, weights=fmt, group_size=32)
        assert lm.weights == fmt and lm.model.weight_format == fmt and lm.fingerprint != ref.fingerprint
        got = _logits(lm, ids)
        rel = float((got - want).abs().max() / want.abs().max())
        # tiny Gemma's random (1 + w) sandwich norms amplify int4's error (measured 0.46)
        assert rel < (0.6 if (fmt, family) == ("int4", "gemma3") else REL_TOL[fmt]), (fmt, rel)
        sizes[fmt] = model_nbytes(lm.model)
        same = sum(a == b for a, b in zip(_greedy(lm, ids, 32), greedy_ref))
        print(f"{family} {fmt}: max rel logit diff {rel:.4f}, greedy tokens equal to fp32 {same}/32")
    assert sizes["bf16"] < 0.55 * sizes["fp32"] and sizes["int8"] < sizes["bf16"]
    assert sizes["q8_0"] < 1.1 * sizes["int8"]


def test_tied_int8_head_and_embedding_share_storage(tiny_model_dir):
    lm = load_model(str(tiny_model_dir("gemma3")), weights="int8")
    emb, head = lm.model.model.embed_tokens, lm.model.lm_head
    assert isinstance(emb, QEmbedding) and isinstance(head, QLinear)
    assert emb.qweight.untyped_storage().data_ptr() == head.qweight.untyped_storage().data_ptr()
    for name, p in lm.model.named_parameters():
        assert p.dtype == torch.float32 and "norm" in name  # norms stay fp32 parameters


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q8_0/int8"])  # (format/prefill GEMM)
def test_block_reuse_self_check_passes_with_quantized_weights(tiny_model_dir, fmt):
    fmt, gemm = (fmt + "/bf16").split("/")[:2]
    lm = load_model(str(tiny_model_dir("gemma3")), weights=fmt, group_size=32, prefill_gemm=gemm)
    rt = BlockRuntime(lm.model, lm.fingerprint)
    assert rt.self_check(), rt.disabled_reason


def test_bf16_kv_cache(tiny_model_dir):
    d = str(tiny_model_dir("gemma3"))
    ref, lm = load_model(d), load_model(d, kv_dtype="bf16")
    ids = _prompt(ref, 40)
    c = lm.model.new_cache()
    assert c.keys(0).dtype == torch.bfloat16
    out = lm.model(torch.tensor([ids[:30]]), torch.arange(30), c)
    for i in range(30, 40):
        out = lm.model(torch.tensor([[ids[i]]]), torch.tensor([i]), c)
    want = _logits(ref, ids)[-1]
    assert float((out[0, -1] - want).abs().max() / want.abs().max()) < 0.02
    rt = BlockRuntime(lm.model, lm.fingerprint)
    assert rt.self_check(), rt.disabled_reason


def test_truncated_or_stale_cache_is_rebuilt(tiny_model_dir, monkeypatch):
    d = str(tiny_model_dir("qwen3"))
    lm = load_model(d, weights="int8")
    ids = _prompt(lm, 20)
    want = _logits(lm, ids)
    src = model_sources._source(d)
    path = weight_cache._weights_path(src, "int8", 64)
    assert path.exists()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a crash halfway through someone's copy
    loader._LOADED.clear()
    again = load_model(d, weights="int8")
    assert torch.equal(_logits(again, ids), want)
    assert path.stat().st_size == len(data)
    # a cache written by another torch version is rebuilt, not fed to this one's ops
    monkeypatch.setattr(weight_cache, "_cache_metadata", lambda w, g: {"ldqa_weights": "2", "format": w,
                                                                 "group_size": str(g), "torch": "9.9"})
    loader._LOADED.clear()
    mtime = path.stat().st_mtime_ns
    load_model(d, weights="int8")
    assert path.stat().st_mtime_ns != mtime
    loader._LOADED.clear()


@pytest.mark.parametrize("weights,kv_dtype", [("int8", "bf16"), ("int4", "fp32"), ("q8_0", "fp32")])
def test_every_attention_mode_answers_with_compact_weights_and_cache(tmp_path, tiny_model_dir, weights, kv_dtype):
    from pathlib import Path

    from ldqa.app.api import LongDocQA

    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=4,
                   weights=weights, kv_dtype=kv_dtype)
    qa.ingest(Path(__file__).resolve().parents[1] / "app" / "sample" / "docs")
    for attention, debias in (("full", "none"), ("block", "none"), ("block+recompute", "none"),
                              ("retrieval", "none"), ("block", "calibrate+reorder"), ("full", "sort")):
        ans = qa.ask("What torque for the fan hub bolts?", top_k=3, attention=attention, debias=debias)
        assert ans.settings["weights"] == weights and ans.settings["kv_dtype"] == kv_dtype
        assert ans.settings.get("attention_used", attention) == attention, ans.settings.get("fallback_reason")
        assert ans.timings["generated_tokens"] >= 0
    with pytest.raises(WeightFormatError, match="unknown weight format"):
        LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), weights="q4_k")


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "fp32", "q8_0/int8"])  # (format/prefill GEMM)
def test_prefill_mlp_in_chunks_equals_the_whole_prompt(fmt, monkeypatch):
    # MLP.forward splits a long prefill into row chunks over weights dequantized once: every row is computed
    # by the same operations, so the output is the same bit for bit (fp32 projections: no chunking)
    from types import SimpleNamespace

    from ldqa.attention import model as M

    fmt, gemm = (fmt + "/bf16").split("/")[:2]
    g = torch.Generator().manual_seed(0)
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = M.MLP(cfg)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        setattr(mlp, name, QLinear.from_float(torch.randn(lin.out_features, lin.in_features, generator=g) * 0.1,
                                              None, fmt))
        getattr(mlp, name).prefill_gemm = gemm
    x = torch.randn(1, 150, 64, generator=g)
    with torch.inference_mode():
        whole = mlp(x)
        monkeypatch.setattr(M, "MLP_CHUNK_ROWS", 40)  # 4 chunks, the last one of 30 rows (< PREFILL_ROWS)
        calls = []
        real = QLinear.apply_prefill
        monkeypatch.setattr(QLinear, "apply_prefill", lambda self, xc, w: calls.append(len(xc)) or real(self, xc, w))
        chunked = mlp(x)
    assert torch.equal(chunked, whole)
    assert calls == ([] if fmt == "fp32" else [40, 40, 40, 40, 40, 40, 40, 40, 40, 30, 30, 30])
