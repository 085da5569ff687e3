"""ldqa's CPU kernels in C, built at first use into one library: the matmul of the `q8_0` weight format
(`q8_0.c`: `linear_q8_0`, and a decoder layer's decode around attention, `DecodeLayer`), the same for the
`gguf` format's blocks as shipped (`gguf_blocks.h`: `linear_gguf`, `dequantize_gguf`), the
attention of one decode token (`decode_attention.c`: `decode_attention`) and the int8 prefill GEMM's
element-wise halves (`int8_rows.c`: `quantize_rows_int8`, `dequantize_int32`).
Torch references: `linear_q8_0_reference`, `linear_gguf_reference` (the `gguf` package's dequantization),
the model's modules, `reference.attention`.

Q8_0 is GGUF's (llama.cpp's) 8-bit layout: int8 values in blocks of 32 input channels, one fp16 scale per
block, w[n, k] = d[n, k // 32] * q[n, k]. Gemma 3's GGUF stores its token embedding (the tied LM head, 63%
of the model's bytes) this way, so keeping the layout keeps those weights exactly as shipped.

Why a kernel of our own: for one decode row, PyTorch's packed int8 op (`_weight_int8pack_mm`) reads weights
at ~6 GB/s on one core of the dev machine, which holds int8 decode to 0.46x llama.cpp's (docs/results.md);
no aten or torchao op reads group-wise int8 on the CPU. The kernel widens the int8 weights to int16
and multiplies them with the activations rounded to int16 per block of 32 (`madd_epi16`: AVX2 for one row
of x; 4 rows at a time with AVX-512 where the compiler targets it; the header of `q8_0.c` says what each
does and what it measured): every block's integer dot product is exact, then scaled once by d_w * d_x in
fp32. The activation rounding is
at most 2^-16 of the block's largest value (bf16, which the aten paths use, rounds at 2^-9). llama.cpp's
Q8_0 path rounds activations to int8 instead.

The library is built at first use (`c_library`: the machine's compiler, cached; `available()`,
`unavailable_reason()`, `reset()`); where it cannot be, `linear_q8_0` and the others compute the same
product with the torch reference (correct, slow).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from ldqa.kernels.c_library import _lib, _state, available, reset, unavailable_reason  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

QK = 32  # input channels per block (GGUF's QK8_0)
MAX_K = 65536  # the kernel's stack buffer holds the scales of 2048 blocks
PROFILER_NAME = "ldqa::linear_q8_0"  # the kernel's name in torch.profiler tables


# --------------------------------------------------------------------------- reference
def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (xq (M, K) int16, xd (M, K/32) float32) with x ~= xd * xq per block of 32,
    xd = amax / 32767 (as `q8_0.c` rounds them: nearest, ties to even)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)  # (M, B, 32)
    amax = xb.abs().amax(-1)  # (M, B)
    # a correctly rounded division, as the kernel's (`32767.0 / amax` is torch's reciprocal-then-multiply,
    # one ulp off at times, and x * inv lands exactly on .5 for ~1 in 500 values: a different int16)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).to(torch.int16).reshape(m, k)
    return xq, amax / 32767.0


def quantize_activations_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32, K % 256 == 0 -> (x8 (M, K) int8, xd (M, K/256) float32) with x ~= xd * x8 per block
    of 256, xd = amax / 127 (as `q8_0.c` rounds the K types' activations: nearest, ties to even; ggml's
    Q8_K)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 256, 256)  # (M, S, 256)
    amax = xb.abs().amax(-1)  # (M, S)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    x8 = torch.round(xb * inv[..., None]).to(torch.int8).reshape(m, k)
    return x8, amax / 127.0


OUTLIER_RATIO = 12.0  # as q8_0.c's: a block of 256 whose amax is over this many times its RMS


def outlier_blocks(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) -> (M, K/256) bool: the blocks of 256 whose largest |x| is over OUTLIER_RATIO times their RMS,
    which the K types read at int16 per 32 instead of int8 per 256 (`gguf_blocks.h`)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 256, 256)
    amax = xb.abs().amax(-1)
    return amax * amax > OUTLIER_RATIO * OUTLIER_RATIO * ((xb * xb).sum(-1) / 256.0)


def linear_q8_0_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x W^T for a Q8_0 weight, in torch, with the kernel's arithmetic (int16 activations per block,
    exact integer block sums, fp32 scaling). Summation order differs from the kernel's (8-lane partial
    sums), so results agree to fp32 rounding, not bit for bit.

    x: (M, K) float32; qweight: (N, K) int8; scales: (N, K/32) float16 -> y: (M, N) float32.
    """
    m, k = x.shape
    n = qweight.shape[0]
    xq, xd = quantize_activations(x)
    # block sums are integers below 2^24, so fp32 holds them exactly
    sums = torch.einsum("mbi,nbi->mnb", xq.float().reshape(m, k // QK, QK),
                        qweight.float().reshape(n, k // QK, QK))  # (M, N, B)
    return (sums * (xd[:, None, :] * scales.float()[None])).sum(-1)


def dequantize_q8_0(qweight: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """qweight (N, K) int8, scales (N, K/32) float16 -> w (N, K) in `dtype` (w = d * q, computed in fp32)."""
    n, k = qweight.shape
    if dtype == torch.bfloat16 and qweight.is_contiguous() and scales.is_contiguous():
        lib = _state["lib"] if "lib" in _state else _lib()
        if lib is not None:  # the same values in one pass, no fp32 (N, K) copy
            w = torch.empty(n, k, dtype=torch.bfloat16)
            rc = lib.ldqa_dequantize_bf16(Q8_0_TYPE, qweight.data_ptr(), scales.data_ptr(), n, k, w.data_ptr(),
                                          torch.get_num_threads())
            _check(rc, f"dequantize_q8_0 (K {k})")
            return w
    w = qweight.float().reshape(n, k // QK, QK) * scales.float()[..., None]  # (N, B, 32)
    return w.reshape(n, k).to(dtype)


# GGUF block types the kernel reads as shipped (`gguf_blocks.h`): ggml type id -> (name, weights per block,
# bytes per block). Q8_0 (type 8) is read in the split layout above (int8 values, fp16 scales).
GGUF_BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
                    12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
Q8_0_TYPE = 8


def gguf_row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k weights in GGUF block type `ggml_type` (a key of GGUF_BLOCK_TYPES).
    Raises ValueError for another type or a k that is not a multiple of the type's block."""
    if ggml_type not in GGUF_BLOCK_TYPES:
        raise ValueError(f"GGUF block type {ggml_type} is not one the kernel reads "
                         f"({', '.join(n for n, _, _ in GGUF_BLOCK_TYPES.values())})")
    name, per, nbytes = GGUF_BLOCK_TYPES[ggml_type]
    if k % per:
        raise ValueError(f"{name} rows hold a multiple of {per} weights, not {k}")
    return k // per * nbytes


def dequantize_gguf_reference(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """blocks (N, row bytes) uint8 of GGUF block type `ggml_type` -> w (N, k) float32, by the `gguf`
    package's numpy dequantization (the reference the C `dequantize_gguf` is tested against)."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    w = dequantize(blocks.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.array(w, dtype=np.float32)).reshape(blocks.shape[0], k)


def linear_gguf_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """y = x W^T for a weight in GGUF block type `ggml_type`, in torch, with the kernel's arithmetic: x rounded
    to int16 per block of 32 (`quantize_activations`; the K types Q4_K and Q6_K with one row of x, a decode
    step: to int8 per block of 256, `quantize_activations_k`, as ggml's Q8_K, except blocks holding an
    outlier, `outlier_blocks`), W as the `gguf` package dequantizes it. Summation order
    differs from the kernel's, so results agree to fp32 rounding.

    x: (M, K) float32; blocks: (N, row bytes) uint8 -> y: (M, N) float32.
    """
    m, k = x.shape
    xq, xd = quantize_activations(x)
    xr = (xq.float().reshape(m, k // QK, QK) * xd[..., None]).reshape(m, k)  # the rounded activations
    if GGUF_BLOCK_TYPES.get(ggml_type, ("", 32))[1] == 256 and m == 1:  # decode: int8 per 256 (but outliers)
        x8, xd8 = quantize_activations_k(x)
        xr8 = (x8.float().reshape(m, k // 256, 256) * xd8[..., None])
        xr = torch.where(outlier_blocks(x)[..., None], xr.reshape(m, k // 256, 256), xr8).reshape(m, k)
    w = dequantize_gguf_reference(blocks, ggml_type, k)
    return (xr.double() @ w.double().t()).float()


def _run(name: str, fn, *args) -> int:
    """Call a kernel function; under torch.profiler, as a named range (a ctypes call is invisible to it)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(rc: int, what: str) -> None:
    if rc == 2:
        raise MemoryError(f"{what}: no memory for the kernel's scratch buffers")
    if rc:
        raise ValueError(f"{what}: the kernel rejected an input size (K must be a multiple of {QK})")


def linear_q8_0(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x W^T for a Q8_0 weight on the CPU: the C kernel when available, else the torch reference.

    x: (M, K) float32 (other float dtypes are cast); qweight: (N, K) int8 contiguous; scales: (N, K/32)
    float16 contiguous -> y: (M, N) float32. Runs on torch.get_num_threads() threads. Cost: each weight row
    is read from memory once and widened again per row of x (per 4 rows in the AVX-512 build), so it is
    meant for few rows (decode); prefill dequantizes instead.
    Raises ValueError when K is not a multiple of 32 or the shapes disagree.
    """
    m, k = x.shape
    n = qweight.shape[0]
    if k % QK or k > MAX_K or qweight.shape[1] != k or scales.shape != (n, k // QK):
        raise ValueError(f"linear_q8_0: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit (K must be a multiple of {QK}, at most {MAX_K})")
    lib = _state["lib"] if "lib" in _state else _lib()
    if lib is None or x.device.type != "cpu":
        return linear_q8_0_reference(x, qweight, scales)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    rc = _run(PROFILER_NAME, lib.ldqa_q8_0_linear, x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n,
              y.data_ptr(), torch.get_num_threads())
    _check(rc, f"linear_q8_0 (x {tuple(x.shape)})")
    return y


class Mat(ctypes.Structure):
    """A weight matrix as the kernel takes it (`ldqa_mat` in q8_0.c): ggml type, weight and scale addresses,
    rows. Q8_0 (type 8): w int8 (N, K), d fp16 (N, K/32); the GGUF block types: w uint8 (N, row bytes)."""
    _fields_ = [("type", ctypes.c_int64), ("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("n", ctypes.c_int64)]


def _check_blocks(blocks: torch.Tensor, ggml_type: int, k: int, what: str) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() \
            or blocks.shape[1] != gguf_row_bytes(ggml_type, k):
        raise ValueError(f"{what}: blocks {tuple(blocks.shape)} {blocks.dtype} are not contiguous uint8 rows of "
                         f"{GGUF_BLOCK_TYPES[ggml_type][0]} holding {k} weights each")


def linear_gguf(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """y = x W^T for a weight stored in GGUF block type `ggml_type` (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K: the
    file's own bytes), on the CPU: the C kernel (`gguf_blocks.h`) when available, else the torch reference.

    x: (M, K) float32 (other float dtypes are cast); blocks: (N, row bytes) uint8 contiguous -> y: (M, N)
    float32. Runs on torch.get_num_threads() threads; meant for few rows (decode), as `linear_q8_0`.
    Raises ValueError when the type is not one of these or the shapes disagree.
    """
    m, k = x.shape
    _check_blocks(blocks, ggml_type, k, "linear_gguf")
    lib = _state["lib"] if "lib" in _state else _lib()
    if lib is None or x.device.type != "cpu" or k > MAX_K:
        return linear_gguf_reference(x, blocks, ggml_type)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    y = torch.empty(m, blocks.shape[0], dtype=torch.float32)
    mat = Mat(ggml_type, blocks.data_ptr(), None, blocks.shape[0])
    rc = _run(PROFILER_NAME, lib.ldqa_mats_linear, ctypes.byref(mat), 1, x.data_ptr(), m, k, y.data_ptr(),
              torch.get_num_threads())
    _check(rc, f"linear_gguf (x {tuple(x.shape)}, type {ggml_type})")
    return y


def dequantize_gguf(blocks: torch.Tensor, ggml_type: int, k: int, dtype=torch.float32) -> torch.Tensor:
    """blocks (N, row bytes) uint8 of GGUF block type `ggml_type` -> w (N, k) in `dtype` (computed in fp32):
    the C kernel's dequantization (parallel over rows) when available, else the `gguf` package's.
    Raises ValueError as `linear_gguf`."""
    _check_blocks(blocks, ggml_type, k, "dequantize_gguf")
    lib = _state["lib"] if "lib" in _state else _lib()
    if lib is None:
        return dequantize_gguf_reference(blocks, ggml_type, k).to(dtype)
    if dtype == torch.bfloat16:  # rounded per row as torch rounds: no (N, k) fp32 copy written and read back
        w = torch.empty(blocks.shape[0], k, dtype=torch.bfloat16)
        rc = lib.ldqa_dequantize_bf16(ggml_type, blocks.data_ptr(), None, blocks.shape[0], k, w.data_ptr(),
                                      torch.get_num_threads())
        _check(rc, f"dequantize_gguf (type {ggml_type}, K {k})")
        return w
    w = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    rc = lib.ldqa_gguf_dequantize(ggml_type, blocks.data_ptr(), blocks.shape[0], k, w.data_ptr(),
                                  torch.get_num_threads())
    _check(rc, f"dequantize_gguf (type {ggml_type}, K {k})")
    return w.to(dtype)


# --------------------------------------------------------------------------- fused decode halves of a layer
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # the kernel's codes


def mat(ggml_type: int, w: torch.Tensor, d: torch.Tensor | None) -> Mat:
    """The kernel's view of a weight: Q8_0 (ggml_type 8) w int8 (N, K), d float16 (N, K/32); a GGUF block type
    (GGUF_BLOCK_TYPES) w uint8 (N, row bytes), d None. The tensors must stay alive while it is used."""
    if ggml_type != Q8_0_TYPE and ggml_type not in GGUF_BLOCK_TYPES:
        raise ValueError(f"weight type {ggml_type} is neither Q8_0 nor a GGUF block type the kernel reads")
    return Mat(ggml_type, w.data_ptr(), None if d is None else d.data_ptr(), w.shape[0])


class DecodeLayer:
    """One decoder layer's decode (one token of one sequence) around attention, in two C calls:
    `attn_in` (`ldqa_decode_attn_in`) and `attn_out` (`ldqa_decode_attn_out`). Built once per layer from its
    weights, whose addresses it keeps (and the tensors, alive): a call then converts only the token's
    tensors. Needs `available()`: raises RuntimeError otherwise.

    Weights: (ggml_type, w, d) triples as `mat` takes them (Q8_0, or a GGUF block type as shipped; each
    matrix its own type): q, k, v (hidden input channels; N = H*d, KV*d, KV*d), o (hidden, H*d), gate, up
    (I, hidden), down (hidden, I); bias: (H*d + 2*KV*d,) float32 (q's, k's, v's) or None.
    Norm multipliers, float32 (`RMSNorm.multiplier`: 1 + w for Gemma, w otherwise): in_norm (hidden,);
    q_norm, k_norm (head_dim,) or None (no q/k norm); Gemma 3 passes attn_norm (post-attention), ff_norm
    (pre-feedforward) and ff_out_norm (post-feedforward): x + n(o) -> h, h + n(mlp(n(h))); the other
    families pass ff_norm (post_attention_layernorm) only: x + o -> h, h + mlp(n(h)). act: "silu" or
    "gelu_tanh". Reference: the model's own modules (tests/test_fused_decode.py compares them).
    """

    def __init__(self, *, q, k, v, bias, n_heads: int, n_kv: int, head_dim: int, in_norm, q_norm, k_norm, o,
                 attn_norm, ff_norm, ff_out_norm, gate, up, down, act: str, eps: float):
        lib = _lib()
        if lib is None:
            raise RuntimeError(f"the q8_0 CPU kernel is not available: {unavailable_reason()}")
        self._keep = (q, k, v, bias, in_norm, q_norm, k_norm, o, attn_norm, ff_norm, ff_out_norm, gate, up, down)
        self._qkv = (Mat * 3)(mat(*q), mat(*k), mat(*v))
        self._gu = (Mat * 2)(mat(*gate), mat(*up))
        self._o, self._down = mat(*o), mat(*down)
        self._in, self._out = lib.ldqa_decode_attn_in, lib.ldqa_decode_attn_out
        self.n_qkv = sum(int(m.n) for m in self._qkv)
        self.hidden = int(self._o.n)
        self._in_args = (in_norm.data_ptr(), eps, ctypes.addressof(self._qkv), _ptr(bias), n_heads, n_kv, head_dim,
                         _ptr(q_norm), _ptr(k_norm))
        self._out_args = (ctypes.addressof(self._o), _ptr(attn_norm), ff_norm.data_ptr(), _ptr(ff_out_norm), eps,
                          ctypes.addressof(self._gu), int(self._gu[0].n), ACTIVATIONS[act],
                          ctypes.addressof(self._down))

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden) float32 contiguous holding one token, the layer's input; cos, sin: head_dim float32
        contiguous values, RoPE at the token's position (rotate_half layout, `model.rope_cos_sin`).
        Returns (N,) float32 = [q | k | v]: input RMSNorm, the q, k, v products (+ bias), q/k norms, RoPE.
        Raises ValueError/MemoryError when the kernel refuses."""
        out = torch.empty(self.n_qkv, dtype=torch.float32)
        rc = _run("ldqa::decode_attn_in", self._in, x.data_ptr(), self.hidden, *self._in_args, cos.data_ptr(),
                  sin.data_ptr(), out.data_ptr(), torch.get_num_threads())
        _check(rc, "decode_attn_in")
        return out

    def attn_out(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden) float32 contiguous, the layer's input (the residual stream); attn: H*d float32
        contiguous values, the attention output (heads concatenated). Returns the layer's output, x's
        shape: o_proj, norms and residual adds, gate and up, the activation, down_proj."""
        out = torch.empty(x.shape, dtype=torch.float32)
        rc = _run("ldqa::decode_attn_out", self._out, x.data_ptr(), attn.data_ptr(), self.hidden, attn.numel(),
                  *self._out_args, out.data_ptr(), torch.get_num_threads())
        _check(rc, "decode_attn_out")
        return out


class StackLayer(ctypes.Structure):
    """One layer's part of `ldqa_decode_stack` (`ldqa_layer` in q8_0.c): the weights and norms of a
    `DecodeLayer`, and per step the layer's KV cache (k_cache, v_cache: (kv_heads, capacity, head_dim)
    float32), RoPE cos/sin (head_dim,) float32 at the token's position, lo, the first slot attended, and
    attn_bias, (slot + 1,) float32 added to the attention scores of each cache slot, or NULL."""
    _fields_ = [("norm_w", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("qnorm_w", ctypes.c_void_p), ("knorm_w", ctypes.c_void_p), ("wo", ctypes.c_void_p),
                ("attn_norm_w", ctypes.c_void_p), ("ff_norm_w", ctypes.c_void_p), ("ff_out_norm_w", ctypes.c_void_p),
                ("gu", ctypes.c_void_p), ("inter", ctypes.c_int64), ("act", ctypes.c_int64), ("wd", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("lo", ctypes.c_int64), ("attn_bias", ctypes.c_void_p)]


class DecodeStack:
    """All decoder layers of one decode step (one token of one sequence) in one C call
    (`ldqa_decode_stack`): per layer `DecodeLayer.attn_in`, the new k and v written into the layer's KV
    cache, `decode_attention` over cache slots [lo, slot] without a mask, `DecodeLayer.attn_out` -- the same
    C functions in the same order as the per-layer path, so the same numbers bit for bit
    (tests/test_fused_decode.py); what it removes is the Python between them (~0.1 ms a layer, a tenth of
    Gemma 3 270M's decode step: docs/results.md).

    layers: the model's `DecodeLayer`s in order (kept alive); n_heads, n_kv, head_dim as theirs; scale
    multiplies q.k. Needs `available()`.
    """

    def __init__(self, layers: list, n_heads: int, n_kv: int, head_dim: int, eps: float, scale: float):
        self._keep = list(layers)
        self.n_layers = len(self._keep)
        self._c = (StackLayer * self.n_layers)()
        for c, lay in zip(self._c, self._keep):
            norm_w, _eps, qkv, bias, _h, _kv, _d, qn, kn = lay._in_args
            wo, an, fn, fon, _eps2, gu, inter, act, wd = lay._out_args
            c.norm_w, c.qkv, c.bias, c.qnorm_w, c.knorm_w = norm_w, qkv, bias, qn, kn
            c.wo, c.attn_norm_w, c.ff_norm_w, c.ff_out_norm_w = wo, an, fn, fon
            c.gu, c.inter, c.act, c.wd = gu, inter, act, wd
        self.hidden = self._keep[0].hidden
        self._args = (n_heads, n_kv, head_dim, eps)
        self.scale = scale
        self._fn = _lib().ldqa_decode_stack

    def run(self, x: torch.Tensor, k_caches: list, v_caches: list, rope: list, lo: list, slot: int,
            bias: list | None = None) -> None:
        """x: (..., hidden) float32 contiguous holding the token's hidden state entering layer 0; changed in
        place to the one leaving the last layer. k_caches[i], v_caches[i]: layer i's cache (1, kv_heads,
        capacity, head_dim) float32 contiguous; rope[i]: (cos, sin) float32 contiguous head_dim values;
        lo[i]: first slot attended (0 <= lo <= slot); slot: where the token's k, v are written
        (< capacity); bias: None, or per layer None or a (slot + 1,) float32 contiguous tensor added to its
        attention scores per cache slot (`decode_attention`'s bias). Raises ValueError/MemoryError when the
        kernel refuses, ValueError for a bias of another length or dtype."""
        bias = bias or [None] * self.n_layers
        for b in bias:
            if b is not None and (b.dtype != torch.float32 or b.numel() != slot + 1 or not b.is_contiguous()):
                raise ValueError(f"decode_stack: a layer's bias must be ({slot + 1},) float32 contiguous, got "
                                 f"{tuple(b.shape)} {b.dtype}")
        for c, k, v, (cos, sin), first, b in zip(self._c, k_caches, v_caches, rope, lo, bias):
            c.k_cache, c.v_cache, c.cos, c.sin, c.lo = k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(), first
            c.attn_bias = None if b is None else b.data_ptr()
        rc = _run("ldqa::decode_stack", self._fn, ctypes.addressof(self._c), self.n_layers, x.data_ptr(), self.hidden,
                  *self._args, k_caches[0].shape[2], slot, self.scale, torch.get_num_threads())
        _check(rc, "decode_stack")


def argmax(x: torch.Tensor) -> int:
    """The index of the largest value of x (n,) float32 contiguous on the CPU, the first on ties, as
    torch.argmax (x must hold no NaN: `generate.check_finite_logits` runs first): the C kernel's AVX2 pass,
    ~20x torch's for Gemma 3's 262,144 logits; torch.argmax where the kernel is not available."""
    lib = _state["lib"] if "lib" in _state else _lib()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 1 \
            or not x.numel():
        return int(torch.argmax(x))
    return int(lib.ldqa_argmax(x.data_ptr(), x.numel()))


# --------------------------------------------------------------------------- the int8 GEMM's element-wise halves
def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row symmetric int8 of x (M, K) float32 on the CPU in one C pass over each row (`int8_rows.c`):
    (xq (M, K) int8, scale (M, 1) float32), bit for bit `quant.quantize_rows_int8`'s torch reference for
    finite x. None where the library is not built or x is not a contiguous CPU float32 matrix (the caller
    runs the reference). Runs on torch.get_num_threads() threads."""
    lib = _state["lib"] if "lib" in _state else _lib()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
        return None
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, 1, dtype=torch.float32)
    _run("ldqa::quantize_rows_int8", lib.ldqa_quantize_rows_int8, x.data_ptr(), m, k, xq.data_ptr(),
         scale.data_ptr(), torch.get_num_threads())
    return xq, scale


def quantize_weight_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of a prefill weight w (M, K) float32 on the CPU rounded to int8 per output channel in one C pass
    over each row (`int8_rows.c`): (q (M, K) int8, scale (M,) float32, amax / 127 rounded to bf16), bit for
    bit the torch ops of `quant.quantize_int8` for finite w. None where the library is not built or w is not
    a contiguous CPU float32 matrix (the caller runs the torch ops). Runs on torch.get_num_threads() threads."""
    lib = _state["lib"] if "lib" in _state else _lib()
    if lib is None or w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
        return None
    m, k = w.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, dtype=torch.float32)
    _run("ldqa::quantize_weight_rows_int8", lib.ldqa_quantize_weight_rows_int8, w.data_ptr(), m, k, q.data_ptr(),
         scale.data_ptr(), torch.get_num_threads())
    return q, scale


def dequantize_int32(y: torch.Tensor, wscale: torch.Tensor, xscale: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The int8 GEMM's exact sums y (M, N) int32 -> (y * wscale[n]) * xscale[m] (M, N) float32 in one C pass
    (`int8_rows.c`), each product rounded in turn: bit for bit torch's `y.float().mul_(wscale).mul_(xscale)`.
    wscale (N,) and xscale (M, 1) float32; out: a contiguous (M, N) float32 tensor to write to (else a new
    one). None where the library is not built or an input is not contiguous on the CPU in those dtypes and
    shapes (the caller runs the torch ops). Runs on torch.get_num_threads() threads."""
    lib = _state["lib"] if "lib" in _state else _lib()
    m, n = y.shape
    if (lib is None or y.dtype != torch.int32 or wscale.dtype != torch.float32 or xscale.dtype != torch.float32
            or not (y.is_contiguous() and wscale.is_contiguous() and xscale.is_contiguous())
            or wscale.numel() != n or xscale.numel() != m or y.device.type != "cpu"
            or (out is not None and (out.shape != (m, n) or out.dtype != torch.float32 or not out.is_contiguous()
                                     or out.device.type != "cpu"))):
        return None
    out = torch.empty(m, n, dtype=torch.float32) if out is None else out
    _run("ldqa::dequantize_int32", lib.ldqa_dequantize_int32, y.data_ptr(), m, n, wscale.data_ptr(),
         xscale.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


# --------------------------------------------------------------------------- decode attention
def decode_attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `decode_attention` takes these inputs: one query token of one sequence, fp32 on the CPU,
    K/V rows contiguous (a slice of the KV cache is), a mask of one row or none, and the kernel built."""
    b, h, n, d = q.shape
    return (b == 1 and n == 1 and q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == "cpu"
            and k.shape[0] == 1 and k.stride(-1) == 1 and k.stride(-2) == d and v.stride() == k.stride()
            and d % 8 == 0 and h % k.shape[1] == 0 and h // k.shape[1] <= 16
            and (mask is None or (mask.dtype == torch.bool and mask.numel() == k.shape[2] and mask.is_contiguous()))
            and available())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of one decode token over a KV cache in one C call (`decode_attention.c`).

    q: (1, heads, 1, d) float32; k, v: (1, kv_heads, L, d) float32 with contiguous rows (a slice
    `cache[:, :, lo:hi]` of the cache is taken as is, no copy); mask: (L,) or (1, L) bool, True = may
    attend, or None; scale multiplies q.k; bias: None or (L,) float32, added to every head's score of
    key j (an additive attention bias: position debiasing's log weights, `debias.DebiasKV`). Query head h
    reads KV head h // (heads // kv_heads). Returns (1, heads, 1, d) float32; a row with no allowed key is
    zeros. Same result as `reference.attention` (softmax(q.k * scale + bias)) up to fp32 summation order
    (tests/test_cpu_linear.py). Call only where `decode_attention_fits`; raises ValueError/MemoryError
    when the kernel refuses, ValueError for a bias of another length or dtype.
    """
    lib = _lib()
    _, h, _, d = q.shape
    kvh, L = k.shape[1], k.shape[2]
    q = q.contiguous()
    out = torch.empty(1, h, 1, d, dtype=torch.float32)
    mptr = None if mask is None else mask.data_ptr()
    if bias is None:
        rc = _run("ldqa::decode_attention", lib.ldqa_decode_attention, q.data_ptr(), k.data_ptr(), v.data_ptr(), h,
                  kvh, L, d, k.stride(1), mptr, scale, out.data_ptr(), torch.get_num_threads())
    else:
        if bias.dtype != torch.float32 or bias.numel() != L or bias.device.type != "cpu":
            raise ValueError(f"decode_attention: bias must be ({L},) float32 on the CPU, got {tuple(bias.shape)} "
                             f"{bias.dtype} on {bias.device}")
        bias = bias.contiguous()
        rc = _run("ldqa::decode_attention", lib.ldqa_decode_attention_biased, q.data_ptr(), k.data_ptr(),
                  v.data_ptr(), h, kvh, L, d, k.stride(1), mptr, bias.data_ptr(), scale, out.data_ptr(),
                  torch.get_num_threads())
    _check(rc, "decode_attention")
    return out
