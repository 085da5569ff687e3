"""Weight formats of ldqa's runtime: fp32 (the reference), bf16, int8, int4 and q8_0 weight-only quantization.

Only the weight matrices of the linear layers and the token embedding (tied to the LM head in Gemma 3
and SmolLM2) are stored compactly; norms stay fp32, and the residual stream, RoPE, attention and the KV
cache keep the dtype they have today (fp32 unless a bf16 KV cache is asked for), so Block-Attention's RoPE
re-encoding stays exact. A quantized linear layer casts its input to bf16, runs PyTorch's packed
weight-only matmul and returns the result in the input's dtype.

- int8: symmetric, one scale per output channel (row): w[n, k] ~= q[n, k] * s[n], q in [-127, 127]
  (LLM.int8-style weight-only absmax quantization; Dettmers et al. 2022, sec. 3.1 without outliers).
  Matmul: aten `_weight_int8pack_mm` (x bf16 (M, K), q int8 (N, K), s bf16 (N,)).
- int4: asymmetric, one (scale, min) pair per group of `group_size` consecutive input channels:
  w[n, k] ~= (q[n, k] - 8) * scale[n, g] + zero[n, g] with zero = min + 8 * scale, q in [0, 15] (the
  convention of gpt-fast's int4 weight-only path, which the aten op expects).
  Matmul: aten `_weight_int4pack_mm_for_cpu` (CPU) / `_weight_int4pack_mm` (CUDA).

- q8_0: GGUF's (llama.cpp's) Q8_0 layout: symmetric int8 in blocks of 32 input channels, one fp16 scale
  per block, w[n, k] = d[n, k // 32] * q[n, k]. A GGUF tensor stored as Q8_0 (Gemma 3's embedding and tied
  LM head) round-trips exactly; 4-6-bit GGUF blocks fit it with a rounding far below their own step.
  Matmul: ldqa's own CPU kernel (`ldqa.kernels.cpu_linear`, C, built at first use) for decode rows, a
  dequantized bf16 (or int8) GEMM for prefill rows; no aten or torchao op reads group-wise int8 on the CPU, and the
  packed int8 op is what held decode to 0.46x llama.cpp's.

- gguf: a GGUF file's own quantized blocks, as shipped (docs/models.md#weight-formats): every matrix stored in a block type the
  kernel reads (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K; `ldqa.kernels.cpu_linear.GGUF_BLOCK_TYPES`) keeps its
  bytes, so the model computes with exactly the file's weights (the fp32 reference's, which dequantizes the
  same bytes) and decode reads 4.5-6.6 bits per weight instead of q8_0's 8.5; Q8_0 tensors are q8_0 (the
  same values), and tensors of other types (Q2_K, Q3_K, Q5_K, IQ*) are rounded to q8_0. Matmul: the same C
  kernel for decode rows (`gguf_blocks.h`), a dequantized bf16 (or int8) GEMM for prefill rows. Only a GGUF source
  has blocks: a Hugging Face directory asked for gguf is refused (use q8_0).

Prefill GEMM: a pass of many rows (PREFILL_ROWS for int8 and q8_0, GGUF_PREFILL_ROWS for gguf) multiplies
through a prefill weight made once per layer (`QLinear.prefill_weight`): the weight dequantized to bf16
for a bf16 GEMM, or, under the int8 prefill GEMM (`QLinear.prefill_gemm` from $LDQA_PREFILL_GEMM, an
opt-in; `prefill_gemm_as` and `int8_lead_rows` for block+recompute's passes), the weight rounded to int8 per output channel and
each row of activations to int8 with its own scale, one int8 GEMM with exact int32 sums (aten `_int_mm`:
oneDNN's VNNI kernels on x86), both scales applied in fp32 (`linear_int8_rows`; W8A8 with dynamic
per-token activation scales, SmoothQuant's per-token baseline, Xiao et al. 2023, sec. 3). Decode rows
(below those counts) are not affected.

Why these aten ops and not torchao: they are what gpt-fast builds on and what torchao's int4 CPU layout
calls underneath, they ship inside the pinned torch wheel (nothing more to install), and a layer here is
a few lines around one op call. torchao would add a dependency whose CPU layouts change between releases.

Storage: `quantize_portable` gives the quantized values in a layout of ours (int4: two 4-bit values per
byte, even input channel in the low nibble), which is what the weight cache stores; the op-specific
packed layout is made from it at load time (it depends on the torch version and the CPU), so a cache
written by one torch build is never fed to another's op unpacked wrongly.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn as nn

from ldqa.attention.choices import WEIGHT_FORMATS  # noqa: F401  (re-exported; torch-free for the CLI)
from ldqa.attention.choices import prefill_weights_mode
from ldqa.kernels import cpu_linear

log = logging.getLogger(__name__)

Q8_BLOCK = 32  # input channels per q8_0 block (GGUF's QK8_0)
DEFAULT_GROUP_SIZE = 64
INT4_GROUP_SIZES = (32, 64, 128, 256)
# int8 inputs with at least this many rows (tokens) dequantize the weight to bf16 for one GEMM instead of
# the packed op: on the 2-core dev machine a (512 x 640) @ (640 x 2048) product takes 20 ms packed against
# 3 ms to dequantize + 7 ms bf16 GEMM; at one row the packed op wins (0.07 ms against 3 ms)
PREFILL_ROWS = 32
# gguf inputs with at least this many rows take the same bf16 GEMM: past one row the C kernel runs its int16
# loops (a Q4_K 8,960 x 1,536 weight at one thread: 0.44 ms for 1 row, 4.3 ms for 4, 8.7 ms for 8), while
# dequantizing straight to bf16 and one GEMM costs ~4 ms; every GGUF block type crosses over at 6-8 rows, at
# 1 and 2 threads (docs/results.md, "Prefill and the allocator"). q8_0's 4-row AVX-512 tile crosses at ~18.
GGUF_PREFILL_ROWS = 8


# The rows of the pass a layer's input stands for (`pass_rows`), 0 outside one
_PASS_ROWS = contextvars.ContextVar("ldqa_pass_rows", default=0)


@contextmanager
def pass_rows(rows: int):
    """Within the block, `QLinear.forward` takes the path of an input of `rows` rows (the bf16 prefill
    GEMM where a pass of that many rows takes it) whatever its own row count: a pass that computes only its
    last row at its last layer keeps the whole pass's arithmetic there (`model.Transformer.forward`)."""
    token = _PASS_ROWS.set(rows)
    try:
        yield
    finally:
        _PASS_ROWS.reset(token)


# A prefill GEMM every layer takes within a block (`prefill_gemm_as`), "" outside one
_GEMM_OVERRIDE = contextvars.ContextVar("ldqa_prefill_gemm", default="")
# Within `int8_lead_rows(n)`: a pass's first n rows take the int8 GEMM, the others bf16; 0 outside one
_INT8_LEAD = contextvars.ContextVar("ldqa_int8_lead_rows", default=0)


@contextmanager
def prefill_gemm_as(gemm: str):
    """Within the block (this thread or task only), every `QLinear` multiplies prefill rows with the
    `gemm` GEMM ("bf16" or "int8") whatever its `prefill_gemm`: a numeric check whose tolerance is bf16's
    (`block_attention.BlockRuntime.self_check`), a pass whose states only rank (block+recompute's
    selection and measurements, `BlockRuntime.recompute_gemm`). Raises ValueError for another value."""
    from ldqa.attention.choices import PREFILL_GEMMS

    if gemm not in PREFILL_GEMMS:
        raise ValueError(f"prefill GEMM {gemm!r}: use one of {', '.join(PREFILL_GEMMS)}")
    token = _GEMM_OVERRIDE.set(gemm)
    try:
        yield
    finally:
        _GEMM_OVERRIDE.reset(token)


@contextmanager
def int8_lead_rows(n: int):
    """Within the block (this thread or task only), a prefill pass's first `n` rows take the int8 GEMM
    and its other rows the bf16 GEMM, in every `QLinear` with a prefill weight (`QLinear.prefill_weight`):
    block+recompute's recomputed passage tokens in int8, the question after them in bf16
    (`BlockRuntime.recompute_gemm`). A pass that runs only its last rows at a layer (`pass_rows`) runs
    them in bf16 there. n = 0: no split."""
    token = _INT8_LEAD.set(max(0, int(n)))
    try:
        yield
    finally:
        _INT8_LEAD.reset(token)


def int8_lead_active() -> bool:
    """Whether an `int8_lead_rows` split is in force here (`model.MLP` then multiplies whole passes)."""
    return _INT8_LEAD.get() > 0


class WeightFormatError(ValueError):
    """An unknown weight format, or one this machine's torch cannot run; the message says which to use."""


def int4_supported(device: str | torch.device = "cpu") -> bool:
    """Whether this torch build has the packed int4 matmul for `device` ("cpu" or "cuda")."""
    suffix = "" if torch.device(device).type == "cuda" else "_for_cpu"
    ops = (f"_weight_int4pack_mm{suffix}", f"_convert_weight_to_int4pack{suffix}")
    return all(hasattr(torch.ops.aten, op) for op in ops)


def int8_supported() -> bool:
    """Whether this torch build has the packed int8 weight-only matmul."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def check_format(fmt: str, group_size: int = DEFAULT_GROUP_SIZE, device: str | torch.device = "cpu") -> str:
    """Validate a weight format name (and int4's group size) for this machine; returns the name.

    Raises WeightFormatError for an unknown name, a group size not in INT4_GROUP_SIZES, or a quantized
    format whose aten op this torch build lacks (the message says to use bf16 or fp32).
    """
    if fmt not in WEIGHT_FORMATS:
        raise WeightFormatError(f"unknown weight format {fmt!r}: use one of {', '.join(WEIGHT_FORMATS)}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise WeightFormatError(f"int4 group size {group_size} is not supported: use one of "
                                f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    if fmt == "int4" and not int4_supported(device):
        raise WeightFormatError(f"weights='int4' needs torch's packed int4 matmul, which torch {torch.__version__} "
                                f"lacks on {torch.device(device).type}: use weights='int8', 'bf16' or 'fp32'")
    if fmt in ("q8_0", "gguf") and torch.device(device).type != "cpu":
        raise WeightFormatError(f"weights={fmt!r} runs on the CPU only: use weights='bf16' on {torch.device(device).type}")
    if fmt == "int8" and not int8_supported():
        raise WeightFormatError(f"weights='int8' needs torch's _weight_int8pack_mm, which torch "
                                f"{torch.__version__} lacks: use weights='bf16' or 'fp32'")
    return fmt


# --------------------------------------------------------------------------- quantize / dequantize
# rows of a weight `quantize_int8` rounds at a time: a chunk's fp32 temporaries stay in the CPU's caches
# (whole-matrix temporaries of a 8,960 x 1,536 weight are 55 MB each, faulted in afresh every time)
QUANTIZE_CHUNK_ROWS = 64


def quantize_int8(w: torch.Tensor | None, shape: tuple[int, int] | None = None,
                  rows_of=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w (N, K) float -> q (N, K) int8, scales (N,) float32 (values
    representable in bf16, as the op uses them). w ~= q * scales[:, None]; an all-zero row gets scale 1.
    Rounds QUANTIZE_CHUNK_ROWS rows at a time, each row as a whole (in C where the kernels are built,
    `quantize_weight_rows_int8_reference` elsewhere, the same bits). Without w, `shape` (N, K) and
    `rows_of(a, b)` -> rows a..b-1 of the weight as float (a quantized layer dequantizing chunk by chunk,
    `QLinear.prefill_weight`): the same result as quantizing the whole dequantized weight."""
    n, k = w.shape if w is not None else shape
    device = w.device if w is not None else "cpu"
    q = torch.empty(n, k, dtype=torch.int8, device=device)
    scales = torch.empty(n, dtype=torch.float32, device=device)
    for a in range(0, n, QUANTIZE_CHUNK_ROWS):
        b = min(n, a + QUANTIZE_CHUNK_ROWS)
        c = (w[a:b] if w is not None else rows_of(a, b)).float()  # (rows, K), a copy unless fp32: not written
        fast = cpu_linear.quantize_weight_rows_int8(c.contiguous())  # None off the CPU or unbuilt
        q[a:b], scales[a:b] = fast if fast is not None else quantize_weight_rows_int8_reference(c)
    return q, scales


def quantize_weight_rows_int8_reference(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int8`'s rounding of rows c (M, K) float32 in torch ops: (q (M, K) float32 holding the int8
    values, scales (M,) float32). The C kernel (`cpu_linear.quantize_weight_rows_int8`) gives the same bits."""
    amax = c.abs().amax(dim=1)
    sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    sc = sc.to(torch.bfloat16).float()  # the op multiplies by bf16 scales: quantize against those
    return torch.round(c / sc[:, None]).clamp_(-127, 127), sc


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q (N, K) int8, scales (N,) -> w (N, K) in `dtype`."""
    return q.to(dtype) * scales.to(dtype)[:, None]


# A kept bf16 prefill weight (`QLinear.prefill_weight`) is packed once into oneDNN's blocked GEMM layout, which
# aten's `linear` otherwise makes anew from the plain matrix on every call: the same products, on the 2-core
# machine with AMX 1.2-1.8x sooner per GEMM (docs/results.md, "Packed prefill weights"). False: plain weights
# (tests, A/B).
PACK_PREFILL_WEIGHTS = True
# A kept int8 prefill weight with at least as many outputs as inputs (attention's q and o, the MLP's gate and up)
# is packed too, for oneDNN's int8 GEMM (`pack_int8`): the same int32 sums, on the 2-core machine with AMX
# 1.1-1.75x sooner per GEMM at 30-450 rows. The others stay plain: packed, k and v are slower (0.7-0.85x) and
# the MLP's down no faster at a final pass's rows (1.0x). Packing costs ~1.9 s for the default model.
# False: plain (tests, A/B).
PACK_INT8_WEIGHTS = True
# Packed at its PACK_AFTER_USES-th pass (packing the default model's bf16 weights takes ~0.6 s): a one-shot
# `ldqa ask` (1 pass in full attention, up to 4 in block modes with their RoPE self-check) does not pay for
# a layout it would not use again; a process answering on packs during its sixth full-attention answer or
# its second block one
PACK_AFTER_USES = 6


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """A (N, K) bf16 prefill weight in oneDNN's GEMM layout (`mkldnn::_reorder_linear_weight`: an opaque
    tensor with the same values, `.to_dense()`, that `QLinear.apply_prefill` multiplies with
    `mkldnn::_linear_pointwise`); w itself where it is not packed (`PACK_PREFILL_WEIGHTS` off, not a CPU
    tensor, torch without oneDNN)."""
    if PACK_PREFILL_WEIGHTS and w.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    return w


class Int8Weight(NamedTuple):
    """A prefill weight for the int8 GEMM (`linear_int8_rows`): w (N, K) ~= q * scale[:, None], q (N, K)
    int8 in [-127, 127], scale (N,) float32 (`quantize_int8`). packed: None, or the same q in oneDNN's
    int8 GEMM layout (`pack_int8`; q is then None where it was a copy made for the GEMM)."""

    q: torch.Tensor | None
    scale: torch.Tensor
    packed: torch.Tensor | None = None


_INT8_PACKING_EXACT: bool | None = None


def int8_packing_exact() -> bool:
    """Whether oneDNN's packed int8 GEMM (`torch.ops.onednn.qlinear_pointwise`, u8 activations offset by
    128 x s8 weights) gives `torch._int_mm`'s exact int32 sums on this CPU, checked once per process on
    extreme values (every product at +-127 x 255, where a CPU without VNNI would saturate its int16
    pairs). False where this torch build lacks the ops or the sums differ."""
    global _INT8_PACKING_EXACT
    if _INT8_PACKING_EXACT is None:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(-127, 128, (48, 256), dtype=torch.int8, generator=g)
        q[:8] = 127
        q[8:16] = -127
        xq = torch.randint(-127, 128, (40, 256), dtype=torch.int8, generator=g)
        xq[:8] = 127
        xq[8:16] = -127
        try:
            packed = Int8Weight(None, torch.ones(48), torch.ops.onednn.qlinear_prepack(q, None))
            got = _int8_packed_mm(xq, torch.ones(40, 1), packed)
            _INT8_PACKING_EXACT = torch.equal(got, torch._int_mm(xq, q.t()).float())
        except (AttributeError, RuntimeError):
            _INT8_PACKING_EXACT = False
        if not _INT8_PACKING_EXACT:
            log.info("int8 prefill weights stay plain: oneDNN's packed int8 GEMM is missing or not exact here")
    return _INT8_PACKING_EXACT


def pack_int8(w: Int8Weight, own: bool = False) -> Int8Weight:
    """`w` with its q packed for oneDNN's int8 GEMM (`torch.ops.onednn.qlinear_prepack`), where that pays:
    a CPU weight with at least as many outputs as inputs, `PACK_INT8_WEIGHTS` on, and the packed GEMM
    exact here (`int8_packing_exact`); else w itself. own: q is the layer's own weight (the int8 format),
    kept; otherwise it is dropped, and the packed copy takes its memory."""
    if (w.packed is not None or not PACK_INT8_WEIGHTS or w.q.device.type != "cpu"
            or w.q.shape[0] < w.q.shape[1] or not int8_packing_exact()):
        return w
    return Int8Weight(w.q if own else None, w.scale, torch.ops.onednn.qlinear_prepack(w.q, None))


@functools.lru_cache(maxsize=16)
def _weight_zero_points(n: int) -> torch.Tensor:
    """The packed int8 GEMM's per-output-channel weight zero points, (n,) int64 zeros (symmetric weights),
    made once per width rather than on every call."""
    return torch.zeros(n, dtype=torch.int64)


def _int8_packed_mm(xq: torch.Tensor, sx: torch.Tensor, w: Int8Weight, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """xq (M, K) int8 rows with scales sx (M, 1) times a packed `Int8Weight` -> (M, N) float32, bit for bit
    `float(xq @ q.T) * scale * sx`: oneDNN multiplies u8 activations with a zero point, so the rows go in as
    xq + 128 (the sign bit flipped) with zero point 128."""
    xu = xq.view(torch.uint8).bitwise_xor(128)
    y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, w.packed, w.scale, _weight_zero_points(len(w.scale)),
                                           None, 1.0, 0, torch.float32, "none", [], "")
    return torch.mul(y, sx, out=out) if out is not None else y.mul_(sx)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) symmetric int8: x (M, K) float -> xq (M, K) int8, scale (M, 1) float32 with
    x ~= xq * scale, scale = amax / 127 (an all-zero row: scale 0, xq 0); rounding to nearest, ties to even.
    The dynamic per-token activation quantization of W8A8 (SmoothQuant, Xiao et al. 2023, sec. 3). A
    CPU matrix takes the C kernel (`cpu_linear.quantize_rows_int8`, the same bits); the torch ops of
    `quantize_rows_int8_reference` are its reference."""
    if x.device.type == "cpu" and (fast := cpu_linear.quantize_rows_int8(x.float().contiguous())) is not None:
        return fast
    return quantize_rows_int8_reference(x)


def quantize_rows_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_int8` in torch ops: x (M, K) float -> (xq (M, K) int8, scale (M, 1) float32)."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)  # (M, 1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(x * inv).to(torch.int8), amax / 127.0


def linear_int8_rows(x: torch.Tensor, w: Int8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32/bf16, w an `Int8Weight` (N, K) -> x @ w.T (M, N) float32: the rows rounded to int8
    each with its own scale (`quantize_rows_int8`), one int8 GEMM with exact int32 sums (aten `_int_mm`,
    oneDNN's VNNI kernels on x86), then both scales applied in fp32. Each row's result depends on that row
    alone. The scaling runs in the C kernel where it can (`cpu_linear.dequantize_int32`, the same bits); a
    packed weight (`pack_int8`) takes oneDNN's packed int8 GEMM, the same bits too.
    out: an (M, N) float32 tensor to write the result to (returned). Raises RuntimeError (from the op)
    where this torch build has no CPU int8 GEMM."""
    xq, sx = quantize_rows_int8(x)
    if w.packed is not None:
        return _int8_packed_mm(xq, sx, w, out)
    y = torch._int_mm(xq, w.q.t())  # (M, N) int32
    if (done := cpu_linear.dequantize_int32(y, w.scale, sx, out)) is not None:
        return done
    y = y.float().mul_(w.scale).mul_(sx)  # (mixed int32 * float32 ops take a slow path: 10x this)
    return y if out is None else out.copy_(y)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: w (N, K) float -> nibbles (N, K/2) uint8, scales (N, K/g), zeros (N, K/g)
    float32 (bf16-representable, as the op reads them), with w ~= (q - 8) * scale + zero per group of
    g = `group_size` input channels, q in [0, 15];
    byte j of a row holds q[2j] in its low and q[2j+1] in its high nibble. Raises ValueError if K is not
    a multiple of `group_size`."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    wg = w.float().reshape(n, k // group_size, group_size)  # (N, G, g)
    lo, hi = wg.amin(-1), wg.amax(-1)  # (N, G)
    # the op reads bf16 scales and zeros: round them first and quantize against the rounded values
    scales = ((hi - lo) / 15.0).clamp_(min=1e-6).to(torch.bfloat16).float()
    zeros = (lo + 8.0 * scales).to(torch.bfloat16).float()
    q = torch.round((wg - zeros[..., None]) / scales[..., None] + 8).clamp_(0, 15).to(torch.uint8)  # (N, G, g)
    q = q.reshape(n, k)
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # (N, K/2)
    return nibbles.contiguous(), scales, zeros


def unpack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """nibbles (N, K/2) uint8 -> q (N, K) uint8 in [0, 15] (low nibble = even input channel)."""
    return torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)


def dequantize_int4(nibbles, scales, zeros, dtype=torch.float32) -> torch.Tensor:
    """Inverse of `quantize_int4`: (N, K/2) uint8, (N, G), (N, G) -> w (N, K) in `dtype`."""
    n, groups = scales.shape
    q = unpack_int4(nibbles).reshape(n, groups, -1).to(dtype)  # (N, G, g)
    w = (q - 8) * scales.to(dtype)[..., None] + zeros.to(dtype)[..., None]
    return w.reshape(n, -1)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0: w (N, K) float -> q (N, K) int8, d (N, K/32) float16 with w ~= d[:, k // 32] * q[:, k],
    d = amax / 127 of each block rounded to fp16 and q rounded against that fp16 scale, q in [-127, 127];
    an all-zero block gets d = 0. A weight dequantized from a GGUF Q8_0 tensor comes back bit for bit (its
    amax is d * 127 exactly). Raises ValueError if K is not a multiple of 32."""
    n, k = w.shape
    if k % Q8_BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of the q8_0 block size {Q8_BLOCK}")
    wb = w.float().reshape(n, k // Q8_BLOCK, Q8_BLOCK)  # (N, B, 32)
    d = (wb.abs().amax(-1) / 127.0).to(torch.float16)  # (N, B)
    df = d.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round(wb * inv[..., None]).clamp_(-127, 127).to(torch.int8)  # (N, B, 32)
    return q.reshape(n, k).contiguous(), d.contiguous()


def int4_fits(n: int, k: int, group_size: int) -> bool:
    """Whether an (N, K) weight can use the packed int4 op (N a multiple of 16, K of the group size)."""
    return n % 16 == 0 and k % group_size == 0 and k % 2 == 0


# --------------------------------------------------------------------------- modules
class QLinear(nn.Module):
    """A linear layer y = x W^T + b whose W is stored in one of WEIGHT_FORMATS (weights only).

    Build with `QLinear.from_float(w, b, fmt)` or `QLinear.from_portable(tensors, ...)`.
    forward: x (..., in_features) float32/bf16 -> (..., out_features) in x's dtype. fp32 computes in fp32;
    the other formats compute the matmul with bf16 activations (fp32 accumulation inside the op).
    An int4 weight whose shape the op cannot take (N not a multiple of 16, K not of the group size) is
    stored as int8 instead (`fmt` then says int8; a log line names the layer).
    """

    # the prefill GEMM (`choices.PREFILL_GEMMS`): "bf16" or "int8" (`prefill_weight`); the loader sets the
    # model's (`choices.prefill_gemm`)
    prefill_gemm = "bf16"

    def __init__(self, in_features: int, out_features: int, fmt: str, group_size: int = DEFAULT_GROUP_SIZE):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.group_size = in_features, out_features, fmt, group_size
        self.register_buffer("bias", None)

    # -- construction
    @classmethod
    def from_float(cls, w: torch.Tensor, b: torch.Tensor | None, fmt: str, group_size: int = DEFAULT_GROUP_SIZE,
                   name: str = "") -> "QLinear":
        """Quantize a float weight w (N, K) (and bias (N,) or None) into format `fmt`."""
        return cls.from_portable(quantize_portable(w, fmt, group_size, name), b, w.shape[1], w.shape[0])

    @classmethod
    def from_portable(cls, t: dict, b: torch.Tensor | None, in_features: int, out_features: int) -> "QLinear":
        """From `quantize_portable` tensors (the weight cache's layout): packs them for this machine's op."""
        fmt = _portable_format(t)
        gs = int(t["group_size"]) if "group_size" in t else DEFAULT_GROUP_SIZE
        m = cls(in_features, out_features, fmt, gs)
        if fmt == "fp32":
            m.register_buffer("weight", t["weight"].float().contiguous())
        elif fmt == "bf16":
            m.register_buffer("weight", t["weight"].to(torch.bfloat16).contiguous())
        elif fmt == "int8":
            m.register_buffer("qweight", t["qweight"].contiguous())  # (N, K) int8
            m.register_buffer("scales", t["scales"].to(torch.bfloat16))  # (N,)
        elif fmt == "q8_0":
            m.register_buffer("qweight", t["qweight"].contiguous())  # (N, K) int8
            m.register_buffer("bscales", t["bscales"].to(torch.float16).contiguous())  # (N, K/32)
        elif fmt == "gguf":
            m.ggml_type = int(t["ggml_type"])
            m.register_buffer("blocks", t["blocks"].contiguous())  # (N, row bytes) uint8
            if m.blocks.shape != (out_features, cpu_linear.gguf_row_bytes(m.ggml_type, in_features)):  # or raises
                raise ValueError(f"gguf blocks {tuple(m.blocks.shape)} do not hold a ({out_features}, {in_features}) "
                                 f"{cpu_linear.GGUF_BLOCK_TYPES[m.ggml_type][0]} weight")
        else:
            q = unpack_int4(t["nibbles"]).to(torch.int32)  # (N, K)
            m.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            sz = torch.stack([t["scales"], t["zeros"]], dim=-1)  # (N, G, 2)
            m.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous().to(torch.bfloat16))  # (G, N, 2)
        if b is not None:
            m.bias = b.float().contiguous()
        return m

    # -- compute
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(x.numel() // self.in_features, _PASS_ROWS.get())  # (`pass_rows`)
        if self.fmt in ("q8_0", "gguf") and rows < self.gemm_rows():  # decode: the fewest ops
            x2 = x.reshape(-1, self.in_features)
            y = (cpu_linear.linear_q8_0(x2, self.qweight, self.bscales) if self.fmt == "q8_0"
                 else cpu_linear.linear_gguf(x2, self.blocks, self.ggml_type))  # (M, N) fp32
            if self.bias is not None:
                y = y + self.bias
            y = y.view(*x.shape[:-1], self.out_features)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        if self.fmt == "fp32":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.fmt == "bf16":
            y = torch.nn.functional.linear(x2.to(torch.bfloat16), self.weight)
        elif (lead := _INT8_LEAD.get()) and self.takes_gemm(rows):
            return self._apply_split(x, rows, lead)
        elif (w := self.prefill_weight(rows)) is not None:
            # many rows (prefill): dequantize once, one bf16 GEMM (int8: faster than the packed op)
            return self.apply_prefill(x, w)
        elif self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.packed,
                                                           self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _apply_split(self, x: torch.Tensor, rows: int, lead: int) -> torch.Tensor:
        """A prefill of `rows` rows under `int8_lead_rows(lead)`: x's first `lead` rows through the int8
        GEMM, the rest through bf16; x holding fewer than `rows` rows (`pass_rows`) is the pass's last rows."""
        x2 = x.reshape(-1, self.in_features)
        lead = min(lead, len(x2)) if len(x2) == rows else 0
        y = torch.empty(len(x2), self.out_features, dtype=x.dtype, device=x.device)  # each part written in place
        if lead:
            self.apply_prefill(x2[:lead], self.prefill_weight(rows, "int8"), out=y[:lead])
        if lead < len(x2):
            self.apply_prefill(x2[lead:], self.prefill_weight(rows, "bf16"), out=y[lead:])
        return y.reshape(*x.shape[:-1], self.out_features)

    def prefill_weight(self, rows: int, gemm: str | None = None) -> torch.Tensor | Int8Weight | None:
        """The weight that `forward` multiplies `rows` rows of activations with in one GEMM (int8 and q8_0
        with at least PREFILL_ROWS rows, gguf with GGUF_PREFILL_ROWS) under `gemm` (None: a `prefill_gemm_as`
        in force, else the layer's `prefill_gemm`): "bf16", the weight (N, K) dequantized to bf16; "int8",
        an `Int8Weight` (the int8 format's own values; q8_0 and gguf weights dequantized and rounded to int8
        per output channel). None where forward takes another path (fp32, bf16, int4, the packed int8 op,
        the C decode kernel).
        With `apply_prefill` it lets a caller split the rows into chunks and dequantize once
        (`MLP.forward`). Under $LDQA_PREFILL_WEIGHTS=keep (the default) the weight is made once per
        process and kept on the layer, one per prefill GEMM used (`prefill_weights_mode`), packed for
        oneDNN's GEMM at its PACK_AFTER_USES-th call (`pack_bf16`; an int8 one where that pays, `pack_int8`);
        under "dequantize" the kept ones are dropped. Raises ValueError for a bad $LDQA_PREFILL_WEIGHTS."""
        if not self.takes_gemm(rows):
            return None
        keep = prefill_weights_mode() == "keep"
        gemm = gemm or _GEMM_OVERRIDE.get() or self.prefill_gemm
        int8 = gemm == "int8"
        kept = self.__dict__.get("_kept_prefill_weight", {}) if keep else self.__dict__.pop("_kept_prefill_weight", {})
        if keep and gemm in kept:
            uses = self.__dict__.setdefault("_prefill_uses", {})
            if gemm in uses and (PACK_INT8_WEIGHTS if int8 else PACK_PREFILL_WEIGHTS):
                uses[gemm] += 1  # packed at its PACK_AFTER_USES-th pass
                if uses[gemm] >= PACK_AFTER_USES:
                    kept[gemm] = self._packed(kept[gemm])
                    del uses[gemm]  # packed, or not to be packed here
            return kept[gemm]
        if int8 and self.fmt == "int8":
            w = Int8Weight(self.qweight, self.scales.float())
        elif int8 and self.fmt in ("q8_0", "gguf"):  # dequantized and rounded a chunk of rows at a time
            w = Int8Weight(*quantize_int8(None, (self.out_features, self.in_features), self.dequantized_rows))
        elif int8:
            w = Int8Weight(*quantize_int8(self.dequantized(torch.float32)))
        elif self.fmt == "int8":
            w = self.qweight.to(torch.bfloat16) * self.scales[:, None]
        else:
            w = self.dequantized(torch.bfloat16)
        if keep:
            if PACK_AFTER_USES <= 1:
                w = self._packed(w)
            else:
                self.__dict__.setdefault("_prefill_uses", {})[gemm] = 1
            self.__dict__.setdefault("_kept_prefill_weight", {})[gemm] = w
        return w

    def _packed(self, w: torch.Tensor | Int8Weight) -> torch.Tensor | Int8Weight:
        """A kept prefill weight in oneDNN's GEMM layout where it is packed (`pack_int8`, `pack_bf16`)."""
        if isinstance(w, Int8Weight):
            return pack_int8(w, own=self.fmt == "int8" and w.q is self.qweight)
        return pack_bf16(w)

    def kept_prefill_bytes(self) -> int:
        """Bytes of the prefill weights this layer keeps now (`prefill_weight`, one per prefill GEMM used;
        the int8 format's own values under the int8 GEMM count only their fp32 scales)."""
        total = 0
        for w in self.__dict__.get("_kept_prefill_weight", {}).values():
            if isinstance(w, Int8Weight):
                own = self.fmt == "int8" and w.q is self.qweight
                total += (0 if own or w.q is None else w.q.numel()) + w.scale.numel() * 4
                total += 0 if w.packed is None else w.packed.numel()
            else:
                total += w.numel() * w.element_size()
        return total

    def row_independent(self, rows: int) -> bool:
        """Whether `forward` computes an input of `rows` rows as one op whose every row is that row's alone:
        the float formats and the prefill GEMM, bf16 or int8 (per-row scales, exact int32 sums): any subset
        of the rows, under `pass_rows(rows)`, gets the same arithmetic; not the C kernels or the packed ops,
        whose rounding depends on the row count (a gguf K-type decode row: int8 activations per 256)."""
        return self.fmt in ("fp32", "bf16") or self.takes_gemm(rows)

    def takes_gemm(self, rows: int) -> bool:
        """Whether `forward` multiplies `rows` rows through a prefill weight (`prefill_weight`): int8 and
        q8_0 from PREFILL_ROWS rows, gguf from GGUF_PREFILL_ROWS."""
        return (self.fmt == "int8" and rows >= PREFILL_ROWS) or (self.fmt in ("q8_0", "gguf") and rows >= self.gemm_rows())

    def drop_prefill_weight(self) -> None:
        """Forget the kept prefill weights (`PREFILL_WEIGHT_MODES`); the next prefill makes them again."""
        self.__dict__.pop("_kept_prefill_weight", None)
        self.__dict__.pop("_prefill_uses", None)

    def gemm_rows(self) -> int:
        """The fewest rows (tokens) `forward` multiplies through a dequantized bf16 weight: GGUF_PREFILL_ROWS
        for gguf, PREFILL_ROWS for the other formats; fewer rows of q8_0 and gguf run the C kernel."""
        return GGUF_PREFILL_ROWS if self.fmt == "gguf" else PREFILL_ROWS

    def apply_prefill(self, x: torch.Tensor, w: torch.Tensor | Int8Weight, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """x (..., in_features) float32/bf16, w the layer's `prefill_weight` -> (..., out_features) in x's
        dtype: the GEMM of forward's prefill path (bf16, or int8 for an `Int8Weight`: `linear_int8_rows`;
        bias added in x's dtype), for any number of rows. out: a contiguous (rows, out_features) tensor of
        x's dtype that receives the result (returned; the int8 GEMM's scaling writes it directly)."""
        x2 = x.reshape(-1, self.in_features)
        if isinstance(w, Int8Weight):
            direct = out if out is not None and x.dtype == torch.float32 else None
            y = linear_int8_rows(x2, w, direct).to(x.dtype)
        elif w.is_mkldnn:  # packed (`pack_bf16`)
            y = torch.ops.mkldnn._linear_pointwise(x2.to(torch.bfloat16).contiguous(), w, None, "none", [], "")
            y = y.to(x.dtype)
        else:
            y = torch.nn.functional.linear(x2.to(torch.bfloat16), w).to(x.dtype)
        if out is not None:
            if y is not out:
                out.copy_(y)
            y = out
            if self.bias is not None:
                y.add_(self.bias.to(x.dtype))
            return y
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_rows(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b-1 of `dequantized(torch.float32)`, (b - a, K) float32; q8_0 and gguf dequantize only
        those rows' blocks, the other formats the whole weight."""
        if self.fmt == "q8_0":
            return cpu_linear.dequantize_q8_0(self.qweight[a:b], self.bscales[a:b], torch.float32)
        if self.fmt == "gguf":
            return cpu_linear.dequantize_gguf(self.blocks[a:b], self.ggml_type, self.in_features, torch.float32)
        return self.dequantized(torch.float32)[a:b]

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The weight W (N, K) as this layer computes with it, in `dtype` (for tests and error reports)."""
        if self.fmt in ("fp32", "bf16"):
            return self.weight.to(dtype)
        if self.fmt == "int8":
            return dequantize_int8(self.qweight, self.scales.float(), dtype)
        if self.fmt == "q8_0":
            return cpu_linear.dequantize_q8_0(self.qweight, self.bscales, dtype)
        if self.fmt == "gguf":
            return cpu_linear.dequantize_gguf(self.blocks, self.ggml_type, self.in_features, dtype)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        wt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_and_zeros)
        return wt.t().to(dtype)

    def extra_repr(self) -> str:
        gs = f", group_size={self.group_size}" if self.fmt == "int4" else ""
        if self.fmt == "gguf":
            gs = f", type={cpu_linear.GGUF_BLOCK_TYPES[self.ggml_type][0]}"
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}{gs}"


class QEmbedding(nn.Module):
    """Token embedding stored in a weight format: forward(tokens (b, n) int64) -> (b, n, dim) float32.

    Rows are dequantized on lookup. Built from the same portable tensors as a tied LM head, so the
    embedding and the head use the very same quantized values (int8 and fp32/bf16 share the storage;
    int4 keeps its nibbles, since the op's packed layout cannot be read by row).
    """

    def __init__(self, t: dict, num_embeddings: int, dim: int):
        super().__init__()
        self.fmt = _portable_format(t)
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        for k, v in t.items():
            if k == "ggml_type":
                self.ggml_type = int(v)
            elif isinstance(v, torch.Tensor):
                self.register_buffer(k, v)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        if self.fmt in ("fp32", "bf16"):
            rows = self.weight[flat].float()
        elif self.fmt == "int8":
            rows = dequantize_int8(self.qweight[flat], self.scales[flat].float())
        elif self.fmt == "q8_0":
            rows = cpu_linear.dequantize_q8_0(self.qweight[flat], self.bscales[flat])
        elif self.fmt == "gguf":
            rows = cpu_linear.dequantize_gguf(self.blocks[flat], self.ggml_type, self.embedding_dim)
        else:
            rows = dequantize_int4(self.nibbles[flat], self.scales[flat], self.zeros[flat])
        return rows.reshape(*tokens.shape, self.embedding_dim)


def _portable_format(t: dict) -> str:
    if "blocks" in t:
        return "gguf"
    if "bscales" in t:
        return "q8_0"
    if "nibbles" in t:
        return "int4"
    if "qweight" in t:
        return "int8"
    return "bf16" if t["weight"].dtype == torch.bfloat16 else "fp32"


def quantize_portable(w: torch.Tensor, fmt: str, group_size: int = DEFAULT_GROUP_SIZE, name: str = "") -> dict:
    """A float weight w (N, K) in format `fmt`, as portable tensors (the cache's layout):
    fp32/bf16 {"weight"}; int8 {"qweight" (N, K) int8, "scales" (N,) f32}; int4 {"nibbles" (N, K/2) uint8,
    "scales", "zeros" (N, K/g) f32, "group_size" 0-dim int}; q8_0 {"qweight" (N, K) int8, "bscales"
    (N, K/32) f16}. An int4 weight the op cannot take, or a q8_0 weight whose K is not a multiple of 32,
    is int8. gguf keeps a GGUF file's blocks ({"blocks" (N, row bytes) uint8, "ggml_type" 0-dim int64}, as
    `weight_cache._gguf_blocks` reads them); a float weight asked for gguf has no blocks and is q8_0."""
    check_format(fmt, group_size)
    if fmt == "gguf":
        fmt = "q8_0"
    if fmt == "fp32":
        return {"weight": w.float().contiguous()}
    if fmt == "bf16":
        return {"weight": w.to(torch.bfloat16).contiguous()}
    if fmt == "int4" and not int4_fits(w.shape[0], w.shape[1], group_size):
        log.info("%s %s: shape does not fit the int4 op (group size %d); stored as int8", name, tuple(w.shape),
                 group_size)
        fmt = "int8"
    if fmt == "q8_0" and w.shape[1] % Q8_BLOCK:
        log.info("%s %s: in_features not a multiple of %d; stored as int8", name, tuple(w.shape), Q8_BLOCK)
        fmt = "int8"
    if fmt == "q8_0":
        q, d = quantize_q8_0(w)
        return {"qweight": q, "bscales": d}
    if fmt == "int8":
        q, s = quantize_int8(w)
        return {"qweight": q, "scales": s}
    nib, s, z = quantize_int4(w, group_size)
    return {"nibbles": nib, "scales": s, "zeros": z, "group_size": torch.tensor(group_size)}


def set_prefill_gemm(model: nn.Module, gemm: str) -> None:
    """Set the prefill GEMM ("bf16" or "int8", `choices.PREFILL_GEMMS`) of every `QLinear` of `model` (the
    loader sets the model's own at load; benchmarks switch it to compare the two on one loaded model). KV
    states computed under one setting are not those of the other: a caller that switches keeps them apart
    (`loader.LoadedModel.kv_fingerprint`). Raises ValueError for another value."""
    from ldqa.attention.choices import PREFILL_GEMMS

    if gemm not in PREFILL_GEMMS:
        raise ValueError(f"prefill GEMM {gemm!r}: use one of {', '.join(PREFILL_GEMMS)}")
    for m in model.modules():
        if isinstance(m, QLinear):
            m.prefill_gemm = gemm


def model_nbytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each tensor counted once (tied weights once; the weights
    that share one huge-page block, `memory.weights_on_huge_pages`, each by its own size)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total
