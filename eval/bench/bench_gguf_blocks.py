"""Per-matrix decode cost of the gguf weight format's block types against q8_0, side by side in one process.

    python -m ldqa.eval.bench.bench_gguf_blocks [--threads 1] [--reps 20] [--copies 48] [--out out/bench-gguf-blocks]

For each (block type, N x K) of Gemma 3 270M's layers (Q5_0 2048 x 640 as gate/up, Q4_K and Q6_K 640 x 2048
as down_proj) and the other 32-block types at 2048 x 640: `--copies` random matrices in that type and as
many in q8_0 (cycled, so a matrix is read from memory as in a decode step over 18 layers), one row of
activations, the kernel called directly (`ldqa_mats_linear`, no Python wrapper in the timing), the two
types interleaved call by call. Reported per type: the fastest call of each (robust to other jobs on the
machine: a call either was interrupted or not) and the median, as µs per matrix, ns per block of 32
weights and weight bytes per second, and the ratio of the fastest calls gguf / q8_0 (below 1: the block
type decodes faster than its q8_0 rounding). Writes `OUT/bench-gguf-blocks.json`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = (("Q5_0", 2048, 640), ("Q4_K", 640, 2048), ("Q6_K", 640, 2048), ("Q4_0", 2048, 640),
          ("Q4_1", 2048, 640), ("Q5_1", 2048, 640))


def random_blocks(rng, ggml_type: int, n: int, k: int) -> torch.Tensor:
    """(n, row bytes) uint8 random blocks with finite fp16 scales (and mins)."""
    from ldqa.kernels.cpu_linear import GGUF_BLOCK_TYPES

    name, per, nbytes = GGUF_BLOCK_TYPES[ggml_type]
    raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    for off in ((208,) if name == "Q6_K" else (0, 2) if name in ("Q4_1", "Q5_1", "Q4_K") else (0,)):
        raw[:, :, off:off + 2] = rng.uniform(0, 1e-3, (n, k // per)).astype(np.float16).view(np.uint8).reshape(
            n, k // per, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def main(argv=None) -> int:
    from ldqa.attention.quant import quantize_q8_0
    from ldqa.kernels import cpu_linear as C

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20, help="passes over the copies")
    ap.add_argument("--copies", type=int, default=48, help="matrices per type (cycled, to read from memory)")
    ap.add_argument("--out", type=Path, default=Path("out/bench-gguf-blocks"))
    args = ap.parse_args(argv)
    if not C.available():
        raise SystemExit(f"the C kernel is not available: {C.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    by_name = {name: t for t, (name, _, _) in C.GGUF_BLOCK_TYPES.items()}
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.1f}, {args.threads} thread(s), {args.reps} repetitions")
    print("| type | N x K | gguf µs, fastest (median) | q8_0 µs, fastest (median) | gguf ns/block | q8_0 ns/block | "
          "gguf GB/s | q8_0 GB/s | gguf / q8_0 (fastest) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    lib = C._lib()
    for name, n, k in SHAPES:
        t = by_name[name]
        gs = [random_blocks(rng, t, n, k) for _ in range(args.copies)]
        qs = [quantize_q8_0(torch.randn(n, k) * 0.02) for _ in range(args.copies)]
        x, y = torch.randn(1, k), torch.empty(1, n)
        mats = [(C.mat(t, b, None), C.mat(C.Q8_0_TYPE, w, d)) for b, (w, d) in zip(gs, qs)]
        tg, tq = [], []
        for _ in range(args.reps):
            for mg, mq in mats:
                for m, times in ((mg, tg), (mq, tq)):
                    t0 = time.perf_counter()
                    lib.ldqa_mats_linear(ctypes.byref(m), 1, x.data_ptr(), 1, k, y.data_ptr(), args.threads)
                    times.append(time.perf_counter() - t0)
        blocks = n * k / 32
        gbytes, qbytes = gs[0].numel(), qs[0][0].numel() + 2 * qs[0][1].numel()
        g, q = min(tg), min(tq)
        row = dict(type=name, n=n, k=k, gguf_us=g * 1e6, q8_0_us=q * 1e6, gguf_median_us=statistics.median(tg) * 1e6,
                   q8_0_median_us=statistics.median(tq) * 1e6, gguf_ns_per_block=g / blocks * 1e9,
                   q8_0_ns_per_block=q / blocks * 1e9, gguf_gbs=gbytes / g / 1e9, q8_0_gbs=qbytes / q / 1e9,
                   ratio=g / q)
        rows.append(row)
        print(f"| {name} | {n} x {k} | {row['gguf_us']:.0f} ({row['gguf_median_us']:.0f}) | {row['q8_0_us']:.0f} "
              f"({row['q8_0_median_us']:.0f}) | {row['gguf_ns_per_block']:.2f} | {row['q8_0_ns_per_block']:.2f} | "
              f"{row['gguf_gbs']:.1f} | {row['q8_0_gbs']:.1f} | {row['ratio']:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-gguf-blocks.json").write_text(json.dumps(
        dict(threads=args.threads, reps=args.reps, load=os.getloadavg()[0], rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
