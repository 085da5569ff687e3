"""Kernels against their torch references and against plain float64 softmax attention.

The Triton kernels run on the CPU through Triton's interpreter, which only works when TRITON_INTERPRET=1
is set before Triton is first imported in the process. So:

- on a machine without CUDA where nothing has imported Triton yet (the CI case), this module sets
  TRITON_INTERPRET=1 at import and runs the kernel tests in-process;
- otherwise (a GPU machine, or Triton already imported), setting it here would be too late or would turn
  other modules' GPU kernels into interpreted ones, so a single test re-runs this file in a child
  process with TRITON_INTERPRET=1, and the interpreter tests of this process are skipped with a reason.

Shapes stay tiny (<= 96 tokens, tiles of 16/32): the interpreter runs every program instance in Python.

Tolerances (absolute, on outputs of magnitude ~1): float32 1e-5; float16 5e-3; bfloat16 3e-2 (the kernels
round P to the input dtype before P @ V, as FlashAttention does). LSEs are float32 everywhere: 1e-4.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available()
)
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of Triton (below, via the kernels)

from ldqa.kernels import common, dispatch, reference  # noqa: E402

NEEDS_NO_INTERPRETER = {"test_gpu_kernels_match_reference", "test_interpreter_suite_in_subprocess"}


def _interpreted(name: str):
    """ldqa.kernels.<name>, checked to be running under the Triton interpreter."""
    mod = importlib.import_module(f"ldqa.kernels.{name}")
    assert mod._INTERPRETED, f"ldqa.kernels.{name} was imported before TRITON_INTERPRET=1 was set"
    return mod


if IN_PROCESS:
    prefill, decode, lse_merge, rope = (_interpreted(n) for n in ("prefill", "decode", "lse_merge", "rope"))


@pytest.fixture(autouse=True)
def _interpreter_here_or_skip(request):
    if not IN_PROCESS and request.node.originalname not in NEEDS_NO_INTERPRETER:
        pytest.skip("interpreter tests run in a child process (test_interpreter_suite_in_subprocess): "
                    "Triton was imported, or CUDA is present, before TRITON_INTERPRET=1 could be set")


if not IN_PROCESS:

    def test_interpreter_suite_in_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-m", "not gpu", "-p", "no:cacheprovider"],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ATOL = {F32: 1e-5, F16: 5e-3, BF16: 3e-2}
LSE_ATOL = 1e-4
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------
# helpers


def rand_qkv(b, hq, hkv, q_len, k_len, d, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, q_len, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, k_len, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, k_len, d, generator=g).to(dtype)
    return q, k, v


def softmax_attention(q, k, v, mask, scale=None):
    """Plain float64 softmax attention. mask: bool broadcastable to (b, hq, q_len, k_len).
    Returns out (b, hq, q_len, d) float64 (zeros on empty rows) and lse (b, hq, q_len) (-inf there)."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vv, lse


def assert_close(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out.double(), atol=ATOL[dtype], rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "empty rows must have lse = -inf, others finite"
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite].double(), atol=LSE_ATOL, rtol=0)


def causal_mask(q_len, k_len):
    q_pos = torch.arange(q_len) + k_len - q_len
    return torch.arange(k_len)[None, :] <= q_pos[:, None]


# ----------------------------------------------------------------------------------------------------
# prefill

PREFILL_CASES = [
    # b, hq, hkv, q_len, k_len, d, dtype, causal, tile_size
    (1, 1, 1, 1, 1, 64, F32, True, (16, 16)),  # a single token
    (2, 3, 1, 37, 37, 64, F32, True, (16, 16)),  # GQA 3, ragged tiles
    (1, 4, 1, 50, 50, 256, F32, True, (32, 16)),  # Gemma 3 heads: d 256, GQA 4
    (1, 9, 1, 17, 61, 64, F32, True, (16, 32)),  # GQA 9, chunked prefill (queries after cached keys)
    (1, 9, 3, 40, 40, 64, F16, True, (16, 16)),  # SmolLM2 heads
    (1, 4, 1, 33, 33, 256, BF16, True, (16, 16)),
    (1, 2, 2, 45, 29, 64, F32, False, (16, 16)),  # GQA 1, non-causal, q_len > k_len
    (1, 8, 2, 20, 70, 64, BF16, False, (16, 32)),
]


@pytest.mark.parametrize("b,hq,hkv,q_len,k_len,d,dtype,causal,tile", PREFILL_CASES)
def test_prefill_matches_reference_and_softmax(b, hq, hkv, q_len, k_len, d, dtype, causal, tile):
    q, k, v = rand_qkv(b, hq, hkv, q_len, k_len, d, dtype)
    out, lse = prefill.prefill_attention(q, k, v, causal=causal, tile_size=tile)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, hq, q_len) and lse.dtype == F32
    ref_out, ref_lse = reference.prefill_attention(q, k, v, causal=causal, tile_size=tile)
    assert_close(out, lse, ref_out, ref_lse, dtype)
    mask = causal_mask(q_len, k_len) if causal else torch.ones(q_len, k_len, dtype=torch.bool)
    assert_close(out, lse, *softmax_attention(q, k, v, mask), dtype)


def test_prefill_custom_scale():
    q, k, v = rand_qkv(1, 2, 1, 20, 20, 64)
    out, lse = prefill.prefill_attention(q, k, v, scale=0.3, tile_size=(16, 16))
    assert_close(out, lse, *softmax_attention(q, k, v, causal_mask(20, 20), scale=0.3), F32)


@pytest.mark.parametrize("q_len,k_len", [(70, 70), (10, 90)])
def test_prefill_sliding_window(q_len, k_len):
    """Gemma 3 local layers: query at p sees p-window+1..p (here window 20 instead of 512)."""
    q, k, v = rand_qkv(1, 4, 1, q_len, k_len, 64)
    q_pos = torch.arange(q_len) + k_len - q_len
    diff = q_pos[:, None] - torch.arange(k_len)[None, :]
    mask = (diff >= 0) & (diff < 20)
    out, lse = prefill.prefill_attention(q, k, v, window=20, tile_size=(16, 16))
    assert_close(out, lse, *softmax_attention(q, k, v, mask), F32)
    assert_close(out, lse, *reference.prefill_attention(q, k, v, window=20, tile_size=(16, 16)), F32)


def test_prefill_window_never_loads_tiles_outside_it():
    """Queries at 80..89, window 20: keys 0..47 (three whole tiles) are outside every window, so they
    are poisoned with NaN; a kernel that loaded them would return NaN (0 * NaN = NaN in P @ V)."""
    q, k, v = rand_qkv(1, 2, 1, 10, 90, 64)
    mask = (lambda d: (d >= 0) & (d < 20))((torch.arange(10) + 80)[:, None] - torch.arange(90)[None, :])
    ref = softmax_attention(q, k, v, mask)
    k[:, :, :48], v[:, :, :48] = float("nan"), float("nan")
    out, lse = prefill.prefill_attention(q, k, v, window=20, tile_size=(16, 16))
    assert_close(out, lse, *ref, F32)


def block_attention_ids(sizes: list[int], last_global: bool = True) -> torch.Tensor:
    """Block ids 0, 1, ... for consecutive blocks of the given sizes; the last block is -1 (global)."""
    ids = [i for i, n in enumerate(sizes) for _ in range(n)]
    if last_global:
        ids = ids[: len(ids) - sizes[-1]] + [-1] * sizes[-1]
    return torch.tensor(ids)


def block_attention_mask(sizes: list[int]) -> torch.Tensor:
    """Block-Attention's mask, built directly: causal within each block, the last block sees all."""
    n = sum(sizes)
    mask = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for i, size in enumerate(sizes):
        end = start + size
        lo = 0 if i == len(sizes) - 1 else start
        mask[start:end, lo:end] = True
        start = end
    return mask & causal_mask(n, n)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_block_attention_mask_equals_dense(dtype):
    sizes = [20, 0, 14, 17, 12]  # one empty block (id 1 has no tokens)
    ids = block_attention_ids(sizes)
    q, k, v = rand_qkv(1, 3, 1, 63, 63, 64, dtype)
    out, lse = prefill.prefill_attention(q, k, v, q_block_ids=ids, k_block_ids=ids, tile_size=(16, 16))
    assert_close(out, lse, *softmax_attention(q, k, v, block_attention_mask(sizes)), dtype)
    ref = reference.prefill_attention(q, k, v, q_block_ids=ids, k_block_ids=ids, tile_size=(16, 16))
    assert_close(out, lse, *ref, dtype)


def test_block_attention_4x4_tile_example():
    """The worked example of docs/kernels.md: 4 tiles of 16 tokens, blocks [0, 1, 2, -1]."""
    ids = block_attention_ids([16, 16, 16, 16])
    spec = common.make_mask_spec(64, 64, 64, F32, torch.device("cpu"), q_block_ids=ids, k_block_ids=ids,
                                 tile_size=(16, 16))
    S, P, F = common.SKIP, common.PARTIAL, common.FULL
    expected = torch.tensor([[P, S, S, S], [S, P, S, S], [S, S, P, S], [F, F, F, P]], dtype=torch.int32)
    assert torch.equal(common.tile_flags(spec, torch.device("cpu")), expected)
    plan = common.tile_plan(spec, torch.device("cpu"))
    assert plan.active == 7 and plan.kt_cnt.tolist() == [1, 1, 1, 4]
    q, k, v = rand_qkv(1, 2, 1, 64, 64, 64)
    out, lse = prefill.prefill_attention(q, k, v, q_block_ids=ids, k_block_ids=ids, tile_size=(16, 16))
    assert_close(out, lse, *softmax_attention(q, k, v, block_attention_mask([16] * 4)), F32)


def test_block_ids_skip_unrelated_cached_blocks():
    """Queries of blocks 0-2 against keys that also hold a cached block 3 nobody attends to: block 3's
    key tiles are skipped entirely (poisoned with NaN, output stays finite and exact)."""
    k_ids = torch.tensor([0] * 16 + [1] * 16 + [2] * 16 + [3] * 32)
    q, k, v = rand_qkv(1, 2, 1, 48, 80, 64)
    q_pos, k_pos = torch.arange(48), torch.arange(80)
    mask = (k_ids[None, :] == k_ids[:48, None]) & (k_pos[None, :] <= q_pos[:, None])
    ref = softmax_attention(q, k, v, mask)
    k[:, :, 48:], v[:, :, 48:] = float("nan"), float("nan")
    out, lse = prefill.prefill_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, q_block_ids=k_ids[:48],
                                         k_block_ids=k_ids, tile_size=(16, 16))
    assert_close(out, lse, *ref, F32)


def test_tile_mask_block_sparse_with_empty_rows():
    """A random block-sparse tile mask (non-causal) including a query tile with no key tile at all:
    its rows return zeros and lse = -inf, without NaN; a key tile no one reads is NaN-poisoned."""
    g = torch.Generator().manual_seed(3)
    tile_mask = torch.rand(5, 4, generator=g) < 0.5  # 70 queries / 16, 64 keys / 16
    tile_mask[1] = False  # query tile 1: every row empty
    tile_mask[:, 2] = False  # key tile 2 is never read
    tile_mask[0, 0] = tile_mask[3, 1] = True
    q, k, v = rand_qkv(1, 3, 1, 70, 64, 64)
    mask = tile_mask.repeat_interleave(16, 0)[:70].repeat_interleave(16, 1)
    ref = softmax_attention(q, k, v, mask)
    k[:, :, 32:48], v[:, :, 32:48] = float("nan"), float("nan")
    out, lse = prefill.prefill_attention(q, k, v, causal=False, tile_mask=tile_mask, tile_size=(16, 16))
    assert_close(out, lse, *ref, F32)
    assert torch.all(out[:, :, 16:32] == 0) and torch.all(lse[:, :, 16:32] == NEG_INF)


def test_prefill_all_masked_rows_give_zeros_not_nan():
    """Explicit positions where the first queries precede every key: those rows attend to nothing."""
    q, k, v = rand_qkv(1, 4, 1, 20, 30, 64)
    q_pos, k_pos = torch.arange(20), torch.arange(30) + 8
    out, lse = prefill.prefill_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, tile_size=(16, 16))
    mask = k_pos[None, :] <= q_pos[:, None]
    assert_close(out, lse, *softmax_attention(q, k, v, mask), F32)
    assert torch.all(out[:, :, :8] == 0) and torch.all(lse[:, :, :8] == NEG_INF)


def test_prefill_empty_inputs():
    q, k, v = rand_qkv(1, 2, 1, 5, 0, 64)
    out, lse = prefill.prefill_attention(q, k, v)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)
    q, k, v = rand_qkv(1, 2, 1, 0, 7, 64)
    out, lse = prefill.prefill_attention(q, k, v)
    assert out.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)


def test_prefill_explicit_positions_shift_invariant():
    """A block encoded at offset 1000 (explicit positions, plan path) equals the default-position fast
    path; with a window the same holds (only position differences matter)."""
    q, k, v = rand_qkv(1, 3, 1, 45, 45, 64)
    pos = torch.arange(45) + 1000
    for window in (None, 9):
        fast = prefill.prefill_attention(q, k, v, window=window, tile_size=(16, 16))
        plan = prefill.prefill_attention(q, k, v, window=window, q_pos=pos, k_pos=pos, tile_size=(16, 16))
        torch.testing.assert_close(plan, fast, atol=1e-6, rtol=0)


def test_prefill_rejects_bad_inputs():
    q, k, v = rand_qkv(1, 3, 2, 8, 8, 64)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        prefill.prefill_attention(q, k, v)
    q, k, v = rand_qkv(1, 2, 1, 8, 8, 64)
    with pytest.raises(ValueError, match="tile_mask"):
        prefill.prefill_attention(q, k, v, tile_mask=torch.ones(2, 2, dtype=torch.bool), tile_size=(16, 16))
    with pytest.raises(ValueError, match="both q_block_ids and k_block_ids"):
        reference.prefill_attention(q, k, v, q_block_ids=torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="window"):
        reference.prefill_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="q_pos"):
        prefill.prefill_attention(q, k, v, q_pos=torch.arange(7))
    with pytest.raises(ValueError, match="q must be 4-D"):
        prefill.prefill_attention(q[0], k, v)
    with pytest.raises(ValueError, match="share a dtype"):
        reference.prefill_attention(q.half(), k, v)


# ----------------------------------------------------------------------------------------------------
# decode

DECODE_CASES = [
    # b, hq, hkv, n_q, cache_len, d, dtype, kv_len, num_splits
    (1, 1, 1, 1, 1, 64, F32, None, None),  # one key
    (2, 9, 3, 1, 90, 64, F32, [90, 33], 3),  # SmolLM2 GQA 3, ragged lengths
    (1, 4, 1, 1, 77, 256, BF16, None, 2),  # Gemma 3: d 256, GQA 4
    (2, 3, 1, 3, 50, 64, F16, [50, 7], None),  # three queries, causal among them
    (1, 4, 4, 2, 40, 64, F32, None, 7),  # GQA 1, more splits than needed
    (1, 9, 1, 1, 64, 64, F32, 64, 1),  # GQA 9
]


def decode_mask(b, hkv, n_q, cache_len, kv_len, causal=True):
    mask = torch.zeros(b, hkv, n_q, cache_len, dtype=torch.bool)
    for bi in range(b):
        for i in range(n_q):
            last = kv_len[bi] - n_q + i if causal else kv_len[bi] - 1
            mask[bi, :, i, : max(0, min(last + 1, kv_len[bi]))] = True
    return mask


def expand_to_q_heads(mask, group):  # (b, hkv, n, L) -> (b, hq, n, L)
    return mask.repeat_interleave(group, 1)


@pytest.mark.parametrize("b,hq,hkv,n_q,cache_len,d,dtype,kv_len,splits", DECODE_CASES)
def test_decode_matches_reference_and_softmax(b, hq, hkv, n_q, cache_len, d, dtype, kv_len, splits):
    q, k, v = rand_qkv(b, hq, hkv, n_q, cache_len, d, dtype)
    kv_arg = torch.tensor(kv_len) if isinstance(kv_len, list) else kv_len
    out, lse = decode.decode_attention(q, k, v, kv_len=kv_arg, num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, hq, n_q)
    assert_close(out, lse, *reference.decode_attention(q, k, v, kv_len=kv_arg), dtype)
    lens = kv_len if isinstance(kv_len, list) else [cache_len if kv_len is None else kv_len] * b
    mask = expand_to_q_heads(decode_mask(b, hkv, n_q, cache_len, lens), hq // hkv)
    assert_close(out, lse, *softmax_attention(q, k, v, mask), dtype)


def test_decode_equals_last_rows_of_prefill():
    q, k, v = rand_qkv(1, 4, 1, 61, 61, 64)
    full_out, full_lse = prefill.prefill_attention(q, k, v, tile_size=(16, 16))
    out, lse = decode.decode_attention(q[:, :, -2:], k, v, num_splits=4)
    torch.testing.assert_close(out, full_out[:, :, -2:], atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, full_lse[:, :, -2:], atol=1e-5, rtol=0)


def test_decode_sparse_selection_sink_topk_recent():
    """RetrievalAttention zones: sink (first 4 slots) + indexed slots + recent window (last 6 valid
    slots). Indices may repeat, be -1 padding, fall in the sink/recent zones or past kv_len: every
    selected slot counts exactly once."""
    b, hq, hkv, n_q, cache_len, kv_len = 3, 6, 2, 2, 90, [90, 50, 7]  # kv_len 7: recent overlaps sink
    q, k, v = rand_qkv(b, hq, hkv, n_q, cache_len, 64)
    idx = torch.tensor([
        [[5, 7, 7, -1, 40, 88, 2], [60, 61, 62, 63, 64, 65, 66]],
        [[10, 49, 47, 3, -1, -1, 70], [20, 20, 20, 21, 0, 1, 30]],
        [[5, 2, -1, 6, 6, 1, 0], [4, 4, 4, -1, -1, -1, 80]],
    ])  # (b, hkv, 7)
    mask = torch.zeros(b, hkv, n_q, cache_len, dtype=torch.bool)
    for bi in range(b):
        for h in range(hkv):
            sel = {j for j in idx[bi, h].tolist() if 0 <= j < kv_len[bi]}
            sel |= set(range(min(4, kv_len[bi]))) | set(range(kv_len[bi] - 6, kv_len[bi]))
            for i in range(n_q):
                for j in sel:
                    mask[bi, h, i, j] = j <= kv_len[bi] - n_q + i
    kw = dict(kv_len=torch.tensor(kv_len), indices=idx, sink=4, window=6)
    out, lse = decode.decode_attention(q, k, v, num_splits=3, **kw)
    assert_close(out, lse, *softmax_attention(q, k, v, expand_to_q_heads(mask, hq // hkv)), F32)
    assert_close(out, lse, *reference.decode_attention(q, k, v, **kw), F32)


def test_decode_steady_plus_retrieved_zone_merge_equals_union():
    """RetrievalAttention's merge: attention over sink+recent merged (by LSE) with attention over the
    retrieved keys equals attention over all selected keys at once."""
    q, k, v = rand_qkv(1, 4, 2, 1, 80, 64, seed=5)
    idx = torch.tensor([[[11, 30, 45, 50], [12, 13, 14, 70]]])  # disjoint from sink (0..3) and recent
    none = torch.full((1, 2, 1), -1)
    steady = decode.decode_attention(q, k, v, indices=none, sink=4, window=8)
    retrieved = decode.decode_attention(q, k, v, indices=idx)
    merged = lse_merge.merge_lse(*steady, *retrieved)
    both = decode.decode_attention(q, k, v, indices=idx, sink=4, window=8)
    torch.testing.assert_close(merged, both, atol=1e-5, rtol=0)


def test_decode_empty_cache_row():
    q, k, v = rand_qkv(2, 2, 1, 1, 20, 64)
    out, lse = decode.decode_attention(q, k, v, kv_len=torch.tensor([20, 0]))
    assert torch.all(out[1] == 0) and torch.all(lse[1] == NEG_INF) and not torch.isnan(out).any()
    assert torch.isfinite(lse[0]).all()


def test_decode_rejects_bad_inputs():
    q, k, v = rand_qkv(1, 2, 1, 1, 20, 64)
    with pytest.raises(ValueError, match="kv_len"):
        decode.decode_attention(q, k, v, kv_len=21)
    with pytest.raises(ValueError, match="indices"):
        reference.decode_attention(q, k, v, sink=4)
    with pytest.raises(ValueError, match="indices"):
        decode.decode_attention(q, k, v, indices=torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="rows"):
        decode.decode_attention(torch.randn(1, 16, 9, 64), k, v)


# ----------------------------------------------------------------------------------------------------
# LSE merge


def rand_part(shape, d, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, d, generator=g).to(dtype), 3 * torch.randn(*shape, generator=g)


def test_merge_of_key_halves_equals_attention_over_all_keys():
    q, k, v = rand_qkv(1, 3, 1, 24, 70, 64)
    part_a = prefill.prefill_attention(q, k[:, :, :29], v[:, :, :29], causal=False, tile_size=(16, 16))
    part_b = prefill.prefill_attention(q, k[:, :, 29:], v[:, :, 29:], causal=False, tile_size=(16, 16))
    out, lse = lse_merge.merge_lse(*part_a, *part_b)
    assert_close(out, lse, *softmax_attention(q, k, v, torch.ones(24, 70, dtype=torch.bool)), F32)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_merge_is_associative_and_commutative(impl):
    merge = lse_merge.merge_lse if impl == "triton" else reference.merge_lse
    a, b, c = (rand_part((2, 3, 5), 40, seed=s) for s in range(3))
    a[1][0, 0, 0] = NEG_INF  # an empty part is the identity
    left = merge(*merge(*a, *b), *c)
    right = merge(*a, *merge(*b, *c))
    swapped = merge(*merge(*c, *a), *b)
    torch.testing.assert_close(left, right, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(left, swapped, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merge(*a, *b), merge(*b, *a), atol=1e-6, rtol=1e-6)


def test_merge_empty_parts():
    a = rand_part((4,), 64)
    empty = (torch.zeros(4, 64), torch.full((4,), NEG_INF))
    out, lse = lse_merge.merge_lse(*a, *empty)
    torch.testing.assert_close((out, lse), a)
    out, lse = lse_merge.merge_lse(*empty, *empty)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF) and not torch.isnan(out).any()


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_merge_low_precision_matches_reference(dtype):
    a, b = rand_part((3, 7), 96, dtype, seed=1), rand_part((3, 7), 96, dtype, seed=2)
    out, lse = lse_merge.merge_lse(*a, *b)
    ref_out, ref_lse = reference.merge_lse(*a, *b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out.float(), atol=ATOL[dtype], rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


def test_merge_rejects_mismatched_inputs():
    a, b = rand_part((3,), 8), rand_part((4,), 8)
    with pytest.raises(ValueError, match="out_a and out_b"):
        lse_merge.merge_lse(*a, *b)
    with pytest.raises(ValueError, match="lse_b"):
        reference.merge_lse(a[0], a[1], a[0], a[1].double())


# ----------------------------------------------------------------------------------------------------
# RoPE re-encoding


def inv_freq64(rotary_dim, theta):
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def encode(x, pos, theta=1e4, layout="half", rotary_dim=None, inv_freq=None):
    """Ground truth: rotate x (..., n, d) to positions pos (n,), angles and math in float64."""
    d = x.shape[-1]
    rd = rotary_dim or d
    f = inv_freq64(rd, theta) if inv_freq is None else inv_freq.double()
    ang = pos.double()[:, None] * f[None, :]  # (n, rd/2)
    c, s = ang.cos(), ang.sin()
    y = x.double().clone()
    if layout == "half":
        x1, x2 = y[..., : rd // 2].clone(), y[..., rd // 2 : rd].clone()
        y[..., : rd // 2], y[..., rd // 2 : rd] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = y[..., 0:rd:2].clone(), y[..., 1:rd:2].clone()
        y[..., 0:rd:2], y[..., 1:rd:2] = x1 * c - x2 * s, x2 * c + x1 * s
    return y


@pytest.mark.parametrize("theta,d", [(1e4, 256), (1e5, 64), (1e6, 256)])
@pytest.mark.parametrize("delta", [1, 517, 32768, -300])
def test_rope_reencode_equals_encoding_at_new_position(theta, d, delta):
    """Gemma 3 local (10K) / global (1M) with d 256, SmolLM2 (100K) with d 64; offsets up to 32K."""
    raw = torch.randn(2, 3, 9, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pos = torch.arange(9) * 37 + 400
    keys = encode(raw, pos, theta).float()
    rope.rope_reencode_(keys, delta, theta=theta)
    torch.testing.assert_close(keys.double(), encode(raw, pos + delta, theta), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rope_composition(impl):
    """Rotate by a then b equals rotate by a + b (fp32, 1e-5)."""
    fn = rope.rope_reencode_ if impl == "triton" else reference.rope_reencode_
    keys = torch.randn(1, 2, 21, 64, generator=torch.Generator().manual_seed(1))
    two_steps, one_step = keys.clone(), keys.clone()
    fn(two_steps, 12345, theta=1e6)
    fn(two_steps, 20000, theta=1e6)
    fn(one_step, 32345, theta=1e6)
    torch.testing.assert_close(two_steps, one_step, atol=1e-5, rtol=0)
    fn(two_steps, -32345, theta=1e6)  # and back
    torch.testing.assert_close(two_steps, keys, atol=1e-5, rtol=0)


def test_rope_in_place_on_a_cache_slice_with_per_key_offsets():
    cache = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(2))
    before = cache.clone()
    delta = torch.arange(25) * 100 - 7  # (25,) one offset per key
    view = cache[:, :, 5:30]
    returned = rope.rope_reencode_(view, delta, theta=1e5)
    assert returned is view
    torch.testing.assert_close(cache[:, :, :5], before[:, :, :5], atol=0, rtol=0)
    torch.testing.assert_close(cache[:, :, 30:], before[:, :, 30:], atol=0, rtol=0)
    expected = before[:, :, 5:30].clone()
    reference.rope_reencode_(expected, delta, theta=1e5)
    torch.testing.assert_close(cache[:, :, 5:30], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, :, 5:30].double(), encode(before[:, :, 5:30], delta, 1e5), atol=1e-5, rtol=0)


def test_rope_precomputed_inv_freq_interleaved_and_partial():
    """A Llama-3-style rescaled inv_freq, the GPT-J interleaved layout, and partial rotary (first 32 of
    64 dims): all re-encode exactly, and dims past rotary_dim are untouched."""
    f = inv_freq64(32, 5e5)
    f = torch.where(torch.arange(16) >= 8, f / 8, f).float()  # a fixed per-frequency rescaling, float32
    raw = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    pos = torch.arange(11) + 3000
    for layout in ("half", "interleaved"):
        keys = encode(raw, pos, layout=layout, rotary_dim=32, inv_freq=f).float()
        rope.rope_reencode_(keys, 4096, inv_freq=f, layout=layout, rotary_dim=32)
        want = encode(raw, pos + 4096, layout=layout, rotary_dim=32, inv_freq=f)
        torch.testing.assert_close(keys.double(), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(keys[..., 32:].double(), raw[..., 32:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_rope_low_precision_matches_reference(dtype):
    keys = torch.randn(1, 2, 17, 256, generator=torch.Generator().manual_seed(6)).to(dtype)
    ours, ref = keys.clone(), keys.clone()
    rope.rope_reencode_(ours, 777, theta=1e4)
    reference.rope_reencode_(ref, 777, theta=1e4)
    torch.testing.assert_close(ours.float(), ref.float(), atol=ATOL[dtype], rtol=0)


def test_rope_rejects_bad_inputs():
    keys = torch.randn(1, 2, 5, 64)
    with pytest.raises(ValueError, match="layout"):
        rope.rope_reencode_(keys, 3, layout="neox")
    with pytest.raises(ValueError, match="delta"):
        rope.rope_reencode_(keys, torch.arange(4))
    with pytest.raises(ValueError, match="inv_freq"):
        reference.rope_reencode_(keys, 3, inv_freq=torch.ones(31))
    with pytest.raises(ValueError, match="contiguous"):
        reference.rope_reencode_(keys.transpose(-1, -2), 3)


# ----------------------------------------------------------------------------------------------------
# dispatch


def test_backend_selection(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.delenv("LDQA_KERNELS", raising=False)
    assert dispatch.backend_for(t) == "torch"
    monkeypatch.setenv("LDQA_KERNELS", "triton")
    assert dispatch.backend_for(t) == "triton"
    monkeypatch.setenv("LDQA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LDQA_KERNELS"):
        dispatch.backend_for(t)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_routes_every_kernel(monkeypatch, backend):
    """Both backends, reached through the dispatch layer, agree with plain softmax attention."""
    monkeypatch.setenv("LDQA_KERNELS", backend)
    q, k, v = rand_qkv(1, 3, 1, 19, 19, 64)
    out, lse = dispatch.prefill_attention(q, k, v, window=7, tile_size=(16, 16))
    diff = torch.arange(19)[:, None] - torch.arange(19)[None, :]
    assert_close(out, lse, *softmax_attention(q, k, v, (diff >= 0) & (diff < 7)), F32)
    d_out, d_lse = dispatch.decode_attention(q[:, :, -1:], k, v)
    assert_close(d_out, d_lse, *softmax_attention(q[:, :, -1:], k, v, torch.ones(1, 19, dtype=torch.bool)), F32)
    m_out, m_lse = dispatch.merge_lse(d_out, d_lse, d_out, d_lse)
    torch.testing.assert_close(m_out, d_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(m_lse, d_lse + math.log(2), atol=1e-6, rtol=0)
    keys = torch.randn(1, 1, 4, 64)
    moved = dispatch.rope_reencode_(keys.clone(), 10, theta=1e4)
    torch.testing.assert_close(moved.double(), encode(keys, torch.full((4,), 10)), atol=1e-5, rtol=0)
    assert dispatch.attention(q, k, v).shape == q.shape


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_attention_keeps_its_semantics(monkeypatch, backend):
    """`attention(q, k, v, mask, scale)`: GQA, dense bool mask, empty rows -> zeros, default = all keys."""
    monkeypatch.setenv("LDQA_KERNELS", backend)
    q, k, v = rand_qkv(1, 4, 2, 6, 9, 64)
    out = dispatch.attention(q, k, v)
    torch.testing.assert_close(out.double(), softmax_attention(q, k, v, torch.ones(6, 9, dtype=torch.bool))[0],
                               atol=1e-5, rtol=0)
    mask = torch.rand(6, 9, generator=torch.Generator().manual_seed(0)) < 0.5
    mask[2] = False
    out = dispatch.attention(q, k, v, mask=mask, scale=0.2)
    torch.testing.assert_close(out.double(), softmax_attention(q, k, v, mask, scale=0.2)[0], atol=1e-5, rtol=0)
    assert torch.all(out[:, :, 2] == 0)


@pytest.mark.parametrize("n", [5, 40, 300])
def test_dispatch_causal_attention_equals_the_triangle_mask(n):
    """`attention(..., causal=True)` (the model's full prefill from an empty cache) gives what the
    lower-triangle mask gives, on both sides of the 16-row split; bad combinations are refused."""
    q, k, v = rand_qkv(1, 12, 2, n, n, 64)
    tri = torch.ones(n, n, dtype=torch.bool).tril()
    want = dispatch.attention(q, k, v, mask=tri, scale=0.3)
    got = dispatch.attention(q, k, v, scale=0.3, causal=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.double(), softmax_attention(q, k, v, tri, scale=0.3)[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="as many queries as keys"):
        dispatch.attention(q[:, :, 1:], k, v, causal=True)
    with pytest.raises(ValueError, match="as many queries as keys"):
        dispatch.attention(q, k, v, mask=tri, causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU and compiled (not interpreted) Triton kernels")
def test_gpu_kernels_match_reference():  # pragma: no cover - runs only where CUDA exists
    mods = {n: importlib.import_module(f"ldqa.kernels.{n}") for n in ("prefill", "decode", "lse_merge", "rope")}
    q, k, v = (t.cuda() for t in rand_qkv(1, 8, 2, 300, 300, 128, BF16))
    ids = block_attention_ids([100, 120, 80]).cuda()
    for kw in ({}, {"window": 64}, {"causal": False}, {"q_block_ids": ids, "k_block_ids": ids}):
        out, lse = mods["prefill"].prefill_attention(q, k, v, **kw)
        ref_out, ref_lse = reference.prefill_attention(q, k, v, **kw)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    for kw in ({}, {"indices": torch.randint(0, 300, (1, 2, 40), device="cuda"), "sink": 4, "window": 32}):
        out, lse = mods["decode"].decode_attention(q[:, :, -1:], k, v, **kw)
        ref_out, ref_lse = reference.decode_attention(q[:, :, -1:], k, v, **kw)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    merged = mods["lse_merge"].merge_lse(out, lse, out, lse)
    torch.testing.assert_close(merged[0], out, atol=1e-2, rtol=0)
    keys = torch.randn(1, 2, 50, 256, device="cuda")
    moved = mods["rope"].rope_reencode_(keys.clone(), 1000, theta=1e6)
    torch.testing.assert_close(moved, reference.rope_reencode_(keys.clone(), 1000, theta=1e6), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------
# benchmark script


@pytest.mark.bench
def test_bench_smoke_mode_writes_json(tmp_path):
    from ldqa.eval.bench import bench_kernels

    out = tmp_path / "smoke.json"
    assert bench_kernels.main(["--smoke", "--out", str(out), "--max-seq", "32"]) == 0
    res = json.loads(out.read_text())
    assert res["smoke"] is True
    for key in ("prefill_causal", "prefill_block_sparse", "decode", "decode_sparse", "lse_merge", "rope_reencode"):
        assert res[key] and all(r["ms"] > 0 for r in res[key]), key
    assert {r["masked_fraction_target"] for r in res["prefill_block_sparse"]} == {0.5, 0.9}
    assert res["prefill_causal"][0]["max_abs_err_vs_sdpa"] < 1e-4
    assert set(res["targets"]) >= {"prefill_causal_ratio_vs_sdpa>=0.8", "block_sparse_90pct_speedup_vs_dense>=5",
                                   "decode_fraction_of_peak_bw>=0.6"}


@pytest.mark.bench
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine this would run the full benchmark")
def test_bench_refuses_without_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "ldqa.eval.bench.bench_kernels", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "--smoke" in proc.stderr and not (tmp_path / "x.json").exists()


def test_bench_compile_check_for_sm90_without_gpu(tmp_path):
    """`--compile-check` compiles kernels for sm_90 ahead of time (no GPU) and reports shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "compile.json"
    cmd = [sys.executable, "-m", "ldqa.eval.bench.bench_kernels", "--compile-check", "--only", "lse_merge_bf16_d64",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["variant"] == "lse_merge_bf16_d64" and 0 <= row["shared_bytes"] <= 227 * 1024
