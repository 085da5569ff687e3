"""The int8 prefill GEMM's element-wise halves in C (kernels/int8_rows.c via kernels/cpu_linear.py): the
per-row int8 rounding of the activations and the scaling of the int32 sums, bit for bit against their torch
references, in the native build and in the AVX2-only build; `quant.linear_int8_rows` the same either way.
A kept bf16 prefill weight packed for oneDNN's GEMM gives the plain weight's product; a packed int8 one the
plain one's bits."""

import ctypes
import platform

import pytest
import torch

from ldqa.attention import quant
from ldqa.kernels import cpu_linear as C

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the kernels are written for x86-64")


@pytest.fixture(autouse=True)
def _fresh_build(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "int8-rows-cache"))
    monkeypatch.delenv("LDQA_CPU_KERNELS", raising=False)
    C.reset()
    yield
    C.reset()


def _rows(m, k, seed):
    """Rows of very different scales, an all-zero row, a row of one value, and exact ties after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[0] = 0.0
    if m > 1:
        x[1] = -2.5
    if m > 2 and k > 3:  # amax 127: x * inv is x itself, so the .5 values are exact ties (even: 2, -4, 6)
        x[2] = torch.arange(k) % 7 - 3.0
        x[2, :3] = torch.tensor([2.5, -3.5, 5.5])
        x[2, 3] = 127.0
    return x.contiguous()


# K: a whole number of AVX-512 / AVX2 vectors and not (tails of 1..31 values), the model's 1536 and 8960
@pytest.mark.parametrize("m,k", [(1, 1), (3, 7), (5, 16), (4, 33), (17, 64), (9, 95), (40, 1536), (6, 8960)])
def test_quantize_rows_matches_the_reference_bit_for_bit(m, k):
    x = _rows(m, k, seed=m * 1000 + k)
    got = C.quantize_rows_int8(x)
    assert got is not None, C.unavailable_reason()
    xq, sx = got
    rq, rs = quant.quantize_rows_int8_reference(x)
    assert xq.dtype == torch.int8 and sx.shape == (m, 1) and sx.dtype == torch.float32
    assert torch.equal(xq, rq)
    assert torch.equal(sx, rs)
    if m > 2 and k > 3:
        assert xq[2, :3].tolist() == [2, -4, 6]  # ties to even


@pytest.mark.parametrize("m,n", [(1, 1), (3, 7), (33, 256), (20, 1536), (7, 8960)])
def test_dequantize_int32_matches_torch_bit_for_bit(m, n):
    g = torch.Generator().manual_seed(m + n)
    y = torch.randint(-2**24, 2**24, (m, n), generator=g, dtype=torch.int32)
    y[0, 0] = 2**31 - 1  # not exact in fp32: rounded by the int -> float conversion as torch rounds it
    ws = torch.rand(n, generator=g) * 1e-3
    sx = torch.rand(m, 1, generator=g) * 0.1
    out = C.dequantize_int32(y, ws, sx)
    assert out is not None, C.unavailable_reason()
    assert torch.equal(out, y.float().mul_(ws).mul_(sx))
    into = torch.full((m + 2, n), 7.0)
    assert C.dequantize_int32(y, ws, sx, out=into[1:m + 1]) is not None  # rows of a larger tensor, in place
    assert torch.equal(into[1:m + 1], out) and bool((into[0] == 7).all()) and bool((into[-1] == 7).all())


def test_the_kernels_decline_what_they_do_not_take():
    x = torch.randn(4, 64)
    assert C.quantize_rows_int8(x.to(torch.bfloat16)) is None
    assert C.quantize_rows_int8(x.t()) is None  # not contiguous
    y = torch.zeros(4, 8, dtype=torch.int32)
    assert C.dequantize_int32(y, torch.ones(7), torch.ones(4, 1)) is None  # a scale per column it lacks
    assert C.dequantize_int32(y.float(), torch.ones(8), torch.ones(4, 1)) is None
    assert C.dequantize_int32(y, torch.ones(8), torch.ones(4, 1), out=torch.empty(4, 8).t().contiguous().t()) is None


@pytest.mark.parametrize("m", [1, 37, 300])
def test_linear_int8_rows_is_the_same_with_and_without_the_kernels(m, monkeypatch):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, 96, generator=g) * 3
    w = quant.Int8Weight(*quant.quantize_int8(torch.randn(50, 96, generator=g)))
    fast = quant.linear_int8_rows(x, w)
    bf = quant.linear_int8_rows(x.to(torch.bfloat16), w)  # cast to fp32, then the kernel
    monkeypatch.setenv("LDQA_CPU_KERNELS", "torch")
    C.reset()
    assert not C.available()
    assert torch.equal(quant.linear_int8_rows(x, w), fast)
    assert torch.equal(quant.linear_int8_rows(x.to(torch.bfloat16), w), bf)


def test_a_packed_bf16_weight_gives_the_plain_weights_product():
    g = torch.Generator().manual_seed(8)
    lin = quant.QLinear.from_float(torch.randn(64, 128, generator=g), torch.randn(64, generator=g), "bf16")
    w = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    packed = quant.pack_bf16(w)
    assert packed.is_mkldnn and torch.equal(packed.to_dense(), w)
    for m in (1, 20, 300):
        x = torch.randn(m, 128, generator=g)
        a, b = lin.apply_prefill(x, packed), lin.apply_prefill(x, w)
        # the same oneDNN kernel (equal bits on the machines measured); another CPU may sum in another
        # order: within a bf16 rounding of the output
        assert a.shape == (m, 64) and torch.allclose(a, b, rtol=2**-7, atol=1e-3 * float(b.abs().max()))


def _packing_exact():
    if not quant.int8_packing_exact():
        pytest.skip("oneDNN's packed int8 GEMM is missing or not exact on this CPU: int8 weights stay plain")


@pytest.mark.parametrize("m", [1, 20, 37, 300])
def test_a_packed_int8_weight_gives_the_plain_weights_bits(m):
    """The packed GEMM (activations offset by 128 with zero point 128) gives `_int_mm`'s sums, scaled in the
    same order: equal bits for rows of every scale, zero rows, +-127 extremes, into `out` too."""
    _packing_exact()
    g = torch.Generator().manual_seed(9)
    w = quant.Int8Weight(*quant.quantize_int8(torch.randn(160, 96, generator=g)))
    packed = quant.pack_int8(w)
    assert packed.packed is not None and packed.q is None and packed.scale is w.scale
    x = _rows(m, 96, seed=m)
    if m > 4:
        x[4] = torch.where(torch.arange(96) % 2 == 0, 1.0, -1.0)  # every product at +-127 x 127
    want = quant.linear_int8_rows(x, w)
    assert torch.equal(quant.linear_int8_rows(x, packed), want)
    out = torch.full((m, 160), float("nan"))
    assert quant.linear_int8_rows(x, packed, out) is out and torch.equal(out, want)


def test_int8_weights_are_packed_where_it_pays_and_kept_once(monkeypatch):
    """Only weights with at least as many outputs as inputs are packed (k, v and the MLP's down stay
    plain); the int8 format keeps its own values, a made copy is dropped for the packed one; off: plain."""
    _packing_exact()
    g = torch.Generator().manual_seed(10)
    narrow = quant.Int8Weight(*quant.quantize_int8(torch.randn(32, 96, generator=g)))
    assert quant.pack_int8(narrow) is narrow
    monkeypatch.setattr(quant, "PACK_INT8_WEIGHTS", False)
    wide = quant.Int8Weight(*quant.quantize_int8(torch.randn(128, 96, generator=g)))
    assert quant.pack_int8(wide) is wide
    monkeypatch.setattr(quant, "PACK_INT8_WEIGHTS", True)
    monkeypatch.setattr(quant, "PACK_AFTER_USES", 3)
    monkeypatch.delenv("LDQA_PREFILL_WEIGHTS", raising=False)
    x = torch.randn(40, 96, generator=g)
    for fmt in ("int8", "q8_0"):
        if fmt == "q8_0" and not C.available():
            continue
        lin = quant.QLinear.from_float(torch.randn(128, 96, generator=g), torch.randn(128, generator=g), fmt)
        lin.prefill_gemm = "int8"
        first = lin.prefill_weight(40)
        y = lin(x)  # the second use
        assert first.packed is None and lin.prefill_weight(40) is not first  # the third packs it
        kept = lin.prefill_weight(40)
        assert kept.packed is not None and lin.prefill_weight(40) is kept and torch.equal(lin(x), y)
        own = fmt == "int8"
        assert (kept.q is lin.qweight) if own else (kept.q is None)
        assert lin.kept_prefill_bytes() == 128 * 96 + 128 * 4  # the packed copy and the scales


def test_avx2_build_quantizes_as_the_native_build(avx2_kernel_lib):
    lib = avx2_kernel_lib
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ldqa_quantize_rows_int8.argtypes = [p, i64, i64, p, p, i32]
    for m, k in [(3, 7), (4, 33), (9, 95), (40, 1536)]:
        x = _rows(m, k, seed=k)
        xq = torch.empty(m, k, dtype=torch.int8)
        sx = torch.empty(m, 1)
        assert lib.ldqa_quantize_rows_int8(x.data_ptr(), m, k, xq.data_ptr(), sx.data_ptr(), 2) == 0
        rq, rs = quant.quantize_rows_int8_reference(x)
        assert torch.equal(xq, rq) and torch.equal(sx, rs)


def _weight_rows(m, k, seed):
    """`_rows`, plus a row whose amax / 127 is just below bf16's halfway point above 1 (its scale rounds
    down to 1, so its largest value divides to 127.496) and a row of values on exact ties (amax 127)."""
    x = _rows(m, k, seed)
    if m > 3:
        x[3] = torch.linspace(-1, 1, k) * 127 * 1.0039
    return x


@pytest.mark.parametrize("m, k", [(1, 5), (4, 33), (9, 95), (64, 1536), (64, 8960)])
def test_weight_rows_round_to_int8_as_torchs_ops(m, k):
    """The prefill weight's per-channel int8 (`quantize_int8`'s rows) in C equals the torch ops bit for bit:
    bf16-rounded scales, division, ties to even, an all-zero row (scale 1), vector tails."""
    w = _weight_rows(m, k, seed=k)
    q, s = C.quantize_weight_rows_int8(w)
    rq, rs = quant.quantize_weight_rows_int8_reference(w)
    assert q.dtype == torch.int8 and torch.equal(q, rq.to(torch.int8)) and torch.equal(s, rs)
    assert float(s[0]) == 1.0 and not q[0].any()


def test_quantize_int8_is_the_same_with_and_without_the_kernels(monkeypatch):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(150, 200, generator=g) * torch.logspace(-2, 2, 150)[:, None]
    fast = quant.quantize_int8(w)
    monkeypatch.setenv("LDQA_CPU_KERNELS", "torch")
    C.reset()
    assert not C.available()
    ref = quant.quantize_int8(w)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])


def test_avx2_build_rounds_weight_rows_as_the_native_build(avx2_kernel_lib):
    lib = avx2_kernel_lib
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ldqa_quantize_weight_rows_int8.argtypes = [p, i64, i64, p, p, i32]
    for m, k in [(4, 7), (9, 95), (40, 1536)]:
        w = _weight_rows(m, k, seed=k)
        q = torch.empty(m, k, dtype=torch.int8)
        s = torch.empty(m)
        assert lib.ldqa_quantize_weight_rows_int8(w.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), 2) == 0
        rq, rs = quant.quantize_weight_rows_int8_reference(w)
        assert torch.equal(q, rq.to(torch.int8)) and torch.equal(s, rs)
