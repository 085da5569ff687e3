"""GPU benchmark of ldqa's Triton kernels against torch's scaled_dot_product_attention (flash backend).

Usage::

    python -m ldqa.eval.bench.bench_kernels --out results.json      # CUDA GPU; about 2-4 minutes on an H200
    python -m ldqa.eval.bench.bench_kernels --smoke --out smoke.json # tiny shapes on the CPU (Triton interpreter)
    python -m ldqa.eval.bench.bench_kernels --compile-check --out compile.json  # no GPU: compile for sm_90

Measures, in bfloat16 at sequence lengths 1K..128K (batch 1, 32 query heads, 8 KV heads, head_dim 128 by
default):

- prefill, dense causal: TFLOP/s and the ratio to SDPA flash (target >= 0.8x);
- prefill, block-sparse (50% and 90% of tiles masked, non-causal, diagonal tiles kept): time, speedup
  over our dense non-causal kernel (target >= 5x at 90%) and over SDPA flash dense;
- split-KV decode (1 query token; full cache, and sink + top-k + recent selection): GB/s of K/V read,
  fraction of the GPU's peak memory bandwidth (target >= 60% at 128K), ratio to SDPA flash;
- LSE merge and RoPE re-encoding: GB/s (read + write) and the ratio to the torch reference.

Times are medians of CUDA-event measurements with the L2 cache flushed before each repetition. Without a
GPU the script exits with status 2 unless --smoke is given. Writes JSON (see `run`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

PEAK_BANDWIDTH_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}


@dataclass
class BenchConfig:
    """Shapes and repetitions of one benchmark run."""

    seq_lens: tuple[int, ...] = (1024, 4096, 16384, 32768, 65536, 131072)
    batch: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    sparsities: tuple[float, ...] = (0.5, 0.9)
    topk: int = 2048  # retrieved keys for sparse decode
    sink: int = 4
    recent: int = 512
    warmup: int = 2
    reps: int = 5
    tile_size: tuple[int, int] | None = None  # None = the kernel's default
    smoke: bool = False
    device: str = "cuda"
    seed: int = 0

    @classmethod
    def smoke_config(cls) -> "BenchConfig":
        """Tiny shapes for the CPU interpreter (proves the script runs, measures nothing)."""
        return cls(seq_lens=(32, 64), q_heads=4, kv_heads=2, head_dim=64, dtype="float32", topk=8, sink=2,
                   recent=8, warmup=0, reps=1, tile_size=(16, 16), smoke=True, device="cpu")


class Timer:
    """Median wall time of a callable in milliseconds (CUDA events + L2 flush on GPU)."""

    def __init__(self, device: str, warmup: int, reps: int):
        self.cuda = device == "cuda"
        self.warmup, self.reps = warmup, reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if self.cuda else None

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _sdpa(q, k, v, causal: bool, cuda: bool):
    """torch SDPA with the flash backend on CUDA (default backend on CPU); K/V already GQA-expanded."""
    if not cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _qkv(cfg: BenchConfig, q_len: int, k_len: int):
    dt = getattr(torch, cfg.dtype)
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    shape_q = (cfg.batch, cfg.q_heads, q_len, cfg.head_dim)
    shape_k = (cfg.batch, cfg.kv_heads, k_len, cfg.head_dim)
    q = torch.randn(shape_q, generator=g, device=cfg.device, dtype=dt)
    k = torch.randn(shape_k, generator=g, device=cfg.device, dtype=dt)
    v = torch.randn(shape_k, generator=g, device=cfg.device, dtype=dt)
    return q, k, v


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _attn_flops(cfg: BenchConfig, pairs: float) -> float:
    """FLOPs of attention over `pairs` (query, key) pairs per head: 2 matmuls of 2*d each."""
    return 4.0 * cfg.batch * cfg.q_heads * cfg.head_dim * pairs


def bench_prefill(cfg: BenchConfig, timer: Timer, k_mod) -> tuple[list, list]:
    """Dense causal prefill vs SDPA, then block-sparse vs our dense and SDPA dense (non-causal)."""
    from ldqa.kernels import common

    cuda, group = cfg.device == "cuda", cfg.q_heads // cfg.kv_heads
    dense_rows, sparse_rows = [], []
    for n in cfg.seq_lens:
        q, k, v = _qkv(cfg, n, n)
        ke, ve = _expand(k, group), _expand(v, group)
        ours = lambda: k_mod.prefill_attention(q, k, v, causal=True, tile_size=cfg.tile_size)  # noqa: E731
        t = timer(ours)
        ts = timer(lambda: _sdpa(q, ke, ve, True, cuda))
        err = (ours()[0].float() - _sdpa(q, ke, ve, True, cuda).float()).abs().max().item()
        flops = _attn_flops(cfg, n * (n + 1) / 2)
        dense_rows.append({
            "seq_len": n, "ms": t, "tflops": flops / t / 1e9, "sdpa_ms": ts, "sdpa_tflops": flops / ts / 1e9,
            "ratio_vs_sdpa": ts / t, "max_abs_err_vs_sdpa": err,
        })
        t_dense = timer(lambda: k_mod.prefill_attention(q, k, v, causal=False, tile_size=cfg.tile_size))
        ts_dense = timer(lambda: _sdpa(q, ke, ve, False, cuda))
        tm, tn = cfg.tile_size or common.default_tile_size(cfg.head_dim, q.dtype)
        n_qt, n_kt = math.ceil(n / tm), math.ceil(n / tn)
        for s in cfg.sparsities:
            g = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
            tile_mask = torch.rand(n_qt, n_kt, generator=g, device=cfg.device) >= s  # (n_qt, n_kt)
            diag = (torch.arange(n_qt, device=cfg.device)[:, None] * tm // tn) == torch.arange(n_kt, device=cfg.device)
            tile_mask |= diag  # keep one tile per row so no row is empty
            kw = dict(causal=False, tile_mask=tile_mask, tile_size=(tm, tn))
            t_sp = timer(lambda: k_mod.prefill_attention(q, k, v, **kw))
            kept = tile_mask.float().mean().item()
            sparse_rows.append({
                "seq_len": n, "masked_fraction_target": s, "masked_fraction": 1.0 - kept, "ms": t_sp,
                "dense_ms": t_dense, "speedup_vs_dense": t_dense / t_sp, "sdpa_dense_ms": ts_dense,
                "ratio_vs_sdpa_dense": ts_dense / t_sp,
                "effective_tflops": _attn_flops(cfg, n * n * kept) / t_sp / 1e9,
            })
        del q, k, v, ke, ve
        _free(cuda)
    return dense_rows, sparse_rows


def bench_decode(cfg: BenchConfig, timer: Timer, k_mod, peak_gbps: float | None) -> tuple[list, list]:
    """Split-KV decode of one token over the whole cache, and over sink + top-k + recent slots."""
    cuda, group = cfg.device == "cuda", cfg.q_heads // cfg.kv_heads
    elem = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    full_rows, sparse_rows = [], []
    for n in cfg.seq_lens:
        q, k, v = _qkv(cfg, 1, n)
        t = timer(lambda: k_mod.decode_attention(q, k, v))
        ke, ve = _expand(k, group), _expand(v, group)
        ts = timer(lambda: _sdpa(q, ke, ve, False, cuda))
        kv_bytes = 2 * cfg.batch * cfg.kv_heads * n * cfg.head_dim * elem
        gbps = kv_bytes / t / 1e6
        full_rows.append({
            "seq_len": n, "ms": t, "GBps": gbps, "fraction_of_peak": gbps / peak_gbps if peak_gbps else None,
            "sdpa_ms": ts, "ratio_vs_sdpa": ts / t, "sdpa_kv": "GQA-expanded K/V",
        })
        del ke, ve
        topk = min(cfg.topk, n)
        idx = torch.stack([torch.randperm(n, device=cfg.device)[:topk] for _ in range(cfg.batch * cfg.kv_heads)])
        idx = idx.view(cfg.batch, cfg.kv_heads, topk)
        kw = dict(indices=idx, sink=cfg.sink, window=cfg.recent)
        t_sp = timer(lambda: k_mod.decode_attention(q, k, v, **kw))
        n_sel = min(n, cfg.sink + topk + cfg.recent)
        sel_bytes = 2 * cfg.batch * cfg.kv_heads * n_sel * cfg.head_dim * elem
        sparse_rows.append({
            "seq_len": n, "selected_keys": n_sel, "ms": t_sp, "GBps": sel_bytes / t_sp / 1e6,
            "speedup_vs_full": t / t_sp,
        })
        del q, k, v, idx
        _free(cuda)
    return full_rows, sparse_rows


def bench_small_kernels(cfg: BenchConfig, timer: Timer, k_merge, k_rope, ref) -> tuple[list, list]:
    """LSE merge of two (b, hq, n, d) partials and in-place RoPE re-encoding of (b, hkv, n, d) keys."""
    cuda = cfg.device == "cuda"
    dt = getattr(torch, cfg.dtype)
    elem = torch.finfo(dt).bits // 8
    merge_rows, rope_rows = [], []
    for n in cfg.seq_lens:
        shape = (cfg.batch, cfg.q_heads, n, cfg.head_dim)
        oa, ob = torch.randn(shape, device=cfg.device, dtype=dt), torch.randn(shape, device=cfg.device, dtype=dt)
        la, lb = torch.randn(shape[:-1], device=cfg.device), torch.randn(shape[:-1], device=cfg.device)
        t = timer(lambda: k_merge.merge_lse(oa, la, ob, lb))
        tr = timer(lambda: ref.merge_lse(oa, la, ob, lb))
        nbytes = 3 * oa.numel() * elem + 3 * la.numel() * 4
        merge_rows.append({"seq_len": n, "ms": t, "GBps": nbytes / t / 1e6, "torch_ms": tr, "ratio_vs_torch": tr / t})
        del oa, ob, la, lb
        keys = torch.randn(cfg.batch, cfg.kv_heads, n, cfg.head_dim, device=cfg.device, dtype=dt)
        t = timer(lambda: k_rope.rope_reencode_(keys, 1000, theta=1e6))
        tr = timer(lambda: ref.rope_reencode_(keys, 1000, theta=1e6))
        nbytes = 2 * keys.numel() * elem
        rope_rows.append({"seq_len": n, "ms": t, "GBps": nbytes / t / 1e6, "torch_ms": tr, "ratio_vs_torch": tr / t})
        del keys
        _free(cuda)
    return merge_rows, rope_rows


def _free(cuda: bool) -> None:
    if cuda:
        torch.cuda.empty_cache()


def _peak_bandwidth(cfg: BenchConfig, override: float | None) -> float | None:
    """Peak memory bandwidth in GB/s: --peak-bw, else looked up by GPU name (None if unknown/CPU)."""
    if override:
        return override
    if cfg.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH_GBPS.items() if key in name), None)


def _targets(res: dict, smoke: bool) -> dict:
    """The three targets of the module docstring, evaluated on the longest measured sequence."""
    dense = res["prefill_causal"][-1]
    sp90 = [r for r in res["prefill_block_sparse"] if r["masked_fraction_target"] == 0.9]
    dec = res["decode"][-1]
    out = {
        "prefill_causal_ratio_vs_sdpa>=0.8": {"seq_len": dense["seq_len"], "value": dense["ratio_vs_sdpa"],
                                              "met": dense["ratio_vs_sdpa"] >= 0.8},
        "block_sparse_90pct_speedup_vs_dense>=5": {
            "seq_len": sp90[-1]["seq_len"] if sp90 else None,
            "value": sp90[-1]["speedup_vs_dense"] if sp90 else None,
            "met": bool(sp90) and sp90[-1]["speedup_vs_dense"] >= 5.0},
        "decode_fraction_of_peak_bw>=0.6": {"seq_len": dec["seq_len"], "value": dec["fraction_of_peak"],
                                            "met": dec["fraction_of_peak"] is not None and dec["fraction_of_peak"] >= 0.6},
    }
    if smoke:
        out["note"] = "smoke mode: tiny shapes on the CPU interpreter; these numbers mean nothing"
    return out


def run(cfg: BenchConfig, peak_override: float | None = None) -> dict:
    """Run every benchmark; returns the JSON-ready result dict."""
    import triton

    from ldqa.kernels import decode, lse_merge, prefill, reference, rope

    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    timer = Timer(cfg.device, cfg.warmup, cfg.reps)
    peak = _peak_bandwidth(cfg, peak_override)
    res = {
        "device": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "smoke": cfg.smoke,
        "peak_bandwidth_GBps": peak, "config": asdict(cfg),
    }
    res["prefill_causal"], res["prefill_block_sparse"] = bench_prefill(cfg, timer, prefill)
    res["decode"], res["decode_sparse"] = bench_decode(cfg, timer, decode, peak)
    res["lse_merge"], res["rope_reencode"] = bench_small_kernels(cfg, timer, lse_merge, rope, reference)
    res["targets"] = _targets(res, cfg.smoke)
    res["wall_s"] = time.perf_counter() - t0
    return res


def format_table(res: dict) -> str:
    """Markdown tables of the main numbers."""
    lines = [f"device: {res['device']}  torch {res['torch']}  triton {res['triton']}", "",
             "| kernel | seq | ms | throughput | vs torch |", "|---|---|---|---|---|"]
    for r in res["prefill_causal"]:
        lines.append(f"| prefill causal | {r['seq_len']} | {r['ms']:.3f} | {r['tflops']:.1f} TFLOP/s | "
                     f"{r['ratio_vs_sdpa']:.2f}x SDPA |")
    for r in res["prefill_block_sparse"]:
        lines.append(f"| prefill {r['masked_fraction_target']:.0%} masked | {r['seq_len']} | {r['ms']:.3f} | "
                     f"{r['speedup_vs_dense']:.2f}x our dense | {r['ratio_vs_sdpa_dense']:.2f}x SDPA dense |")
    for r in res["decode"]:
        frac = f" ({r['fraction_of_peak']:.0%} of peak)" if r["fraction_of_peak"] else ""
        lines.append(f"| decode split-KV | {r['seq_len']} | {r['ms']:.3f} | {r['GBps']:.0f} GB/s{frac} | "
                     f"{r['ratio_vs_sdpa']:.2f}x SDPA |")
    for r in res["decode_sparse"]:
        lines.append(f"| decode sink+top-k+recent | {r['seq_len']} | {r['ms']:.3f} | {r['GBps']:.0f} GB/s | "
                     f"{r['speedup_vs_full']:.2f}x full decode |")
    for name in ("lse_merge", "rope_reencode"):
        for r in res[name]:
            lines.append(f"| {name} | {r['seq_len']} | {r['ms']:.3f} | {r['GBps']:.0f} GB/s | "
                         f"{r['ratio_vs_torch']:.2f}x torch |")
    lines += ["", "targets:"]
    for key, val in res["targets"].items():
        lines.append(f"  {key}: {val}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# compile check: no GPU needed

_INT_PTRS = {"QPOS", "KPOS", "QBLK", "KBLK", "KT_IDX", "KT_FLAG", "KT_CNT", "KV_LEN", "IDX"}
_DATA_PTRS = {"Q", "K", "V", "O", "OA", "OB"}


def _variants(only: str | None) -> list[tuple]:
    """(name, kernel, data dtype, constexprs, num_warps, num_stages) for every launch configuration the
    wrappers can choose for head_dim 64/128/256 in bfloat16 and float32."""
    import triton

    from ldqa.kernels import common, decode, lse_merge, prefill, rope

    out = []
    for dt in (torch.bfloat16, torch.float32):
        tag = "bf16" if dt == torch.bfloat16 else "fp32"
        for d in (64, 128, 256):
            bm, bn = common.default_tile_size(d, dt)
            warps, stages = prefill._launch_config(d, dt, (bm, bn))
            for mode, causal, window, plan in (("causal", True, False, False), ("window", True, True, False),
                                               ("noncausal", False, False, False), ("plan", True, True, True)):
                c = dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_WINDOW=window,
                         HAS_POS=plan, HAS_BLOCKS=plan, USE_PLAN=plan, IEEE=dt == torch.float32, DOT_F32=False)
                out.append((f"prefill_{tag}_d{d}_{mode}", prefill._prefill_fwd, tag, c, warps, stages))
            max_rows = decode.MAX_ROWS // 2 if dt == torch.float32 and d > 128 else decode.MAX_ROWS
            for rows in (16, max_rows):
                block_n, warps, stages = decode._launch_config(rows, d, dt.itemsize)
                c = dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=rows, BLOCK_N=block_n, CAUSAL=True, HAS_IDX=True,
                         IEEE=dt == torch.float32, DOT_F32=False)
                out.append((f"decode_{tag}_d{d}_rows{rows}", decode._decode_split, tag, c, warps, stages))
            c = dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=16)
            out.append((f"decode_combine_{tag}_d{d}", decode._decode_combine, tag, c, 4, 3))
            c = dict(BLOCK_R=max(1, min(64, 4096 // d)), BLOCK_D=d)
            out.append((f"lse_merge_{tag}_d{d}", lse_merge._merge, tag, c, 4, 3))
            half = d // 2
            for stride, offset in ((1, half), (2, 1)):
                c = dict(PAIR_STRIDE=stride, PAIR_OFFSET=offset, BLOCK_T=max(1, min(64, 4096 // half)),
                         BLOCK_H=triton.next_power_of_2(half))
                out.append((f"rope_{tag}_d{d}_{'half' if stride == 1 else 'interleaved'}", rope._rope_rotate, tag,
                            c, 4, 3))
    return [v for v in out if not only or only in v[0]]


def compile_check(arch: int = 90, only: str | None = None) -> list[dict]:
    """Compile each kernel variant for sm_<arch> without a GPU (Triton's ahead-of-time path, with the
    16-byte alignment hints a real launch gets) and report shared memory, software pipelining (async
    copies), and, when Triton's ptxas can read the PTX, registers and spill bytes.

    Raises
    ------
    RuntimeError
        Under TRITON_INTERPRET=1 (kernels are interpreted functions then, and cannot be compiled).
    """
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("--compile-check needs TRITON_INTERPRET unset")
    target = GPUTarget("cuda", arch, 32)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = [os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bindir, n))]
    rows = []
    for name, fn, tag, consts, warps, stages in _variants(only):
        sig, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in consts:
                sig[arg] = "constexpr"
                continue
            if arg in _INT_PTRS or arg in _DATA_PTRS or arg.isupper():
                sig[arg] = "*i32" if arg in _INT_PTRS else f"*{tag}" if arg in _DATA_PTRS else "*fp32"
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[arg] = "fp32" if arg == "qk_scale" else "i32"
                if arg.startswith("stride"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        t0 = time.perf_counter()
        kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=target,
                                options=dict(num_warps=warps, num_stages=stages))
        row = {"variant": name, "num_warps": warps, "num_stages": stages, "shared_bytes": kernel.metadata.shared,
               "async_copies": kernel.asm["ttgir"].count("async_copy_global_to_local"),
               "compile_s": round(time.perf_counter() - t0, 2), "registers": None, "spill_bytes": None}
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "k.ptx")
            with open(ptx, "w") as f:
                f.write(kernel.asm["ptx"])
            for exe in ptxas:
                r = subprocess.run([exe, f"-arch=sm_{arch}a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                   capture_output=True, text=True)
                if r.returncode == 0:
                    regs = re.search(r"Used (\d+) registers", r.stderr)
                    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", r.stderr)
                    row["registers"] = int(regs.group(1)) if regs else None
                    row["spill_bytes"] = sum(int(x) for x in spills) if spills else 0
                    break
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 when no GPU and no --smoke)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_kernels.json", help="JSON output path")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU via the Triton interpreter")
    ap.add_argument("--max-seq", type=int, default=None, help="drop sequence lengths above this")
    ap.add_argument("--peak-bw", type=float, default=None, help="peak memory bandwidth in GB/s")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    ap.add_argument("--compile-check", action="store_true",
                    help="no GPU needed: compile every kernel variant for sm_90 and report shared memory/spills")
    ap.add_argument("--only", default=None, help="with --compile-check: variants whose name contains this")
    args = ap.parse_args(argv)
    if args.compile_check:
        rows = compile_check(only=args.only)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        for r in rows:
            print(json.dumps(r))
        limit = 227 * 1024  # sm_90 shared memory per block
        bad = [r["variant"] for r in rows if r["shared_bytes"] > limit]
        print(f"{len(rows)} variants compiled; over the {limit} B shared-memory limit: {bad or 'none'}")
        return 1 if bad else 0
    if args.smoke:
        cfg = BenchConfig.smoke_config()
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels (and Triton) are imported
        else:
            cfg.device = "cuda"
    elif not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU found; this benchmark measures GPU kernels. "
              "Run on a GPU machine, or pass --smoke to check the script on the CPU.", file=sys.stderr)
        return 2
    else:
        cfg = BenchConfig()
    if args.max_seq:
        cfg.seq_lens = tuple(n for n in cfg.seq_lens if n <= args.max_seq) or cfg.seq_lens[:1]
    if args.reps:
        cfg.reps = args.reps
    res = run(cfg, args.peak_bw)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(format_table(res))
    print(f"\nwrote {args.out} ({res['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
