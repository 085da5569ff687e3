"""The CPU decode attention (`kernels/decode_attention.c`) per call, for the packaged models' GQA shapes.

    python -m ldqa.eval.bench.bench_decode_attention [--lengths 1416,8192] [--threads 1,2] [--repeats 5]
                                                     [--out out/bench-decode-attention]

One query token over `L` cached keys, as a decode step calls it: 24 caches of random K/V (one per layer,
cycled, so each call reads its K and V cold, as in a step where the weights pass through the caches between
two visits of a layer), fp32, no mask. Reports microseconds per call (median of `--repeats` passes over
the 24 caches) and the K/V bytes read per second. Writes `OUT/bench-decode-attention.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# (name, query heads, KV heads, head_dim) of the packaged models' global layers
SHAPES = [("gemma3-270m", 4, 1, 256), ("smollm2-135m", 9, 3, 64), ("qwen2.5-coder-0.5b-instruct", 14, 2, 64),
          ("qwen2.5-coder-1.5b-instruct", 12, 2, 128)]
N_CACHES = 24


def time_call(heads: int, kv_heads: int, d: int, length: int, threads: int, repeats: int) -> float:
    """Median microseconds of one `cpu_linear.decode_attention` call over `length` keys on `threads`."""
    from ldqa.kernels import cpu_linear as C

    g = torch.Generator().manual_seed(length + heads)
    caches = [(torch.randn(1, kv_heads, length, d, generator=g), torch.randn(1, kv_heads, length, d, generator=g))
              for _ in range(N_CACHES)]
    q = torch.randn(1, heads, 1, d, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, v in caches[:2]:  # warm-up (builds the library on first use)
            C.decode_attention(q, k, v, None, d ** -0.5)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for k, v in caches:
                C.decode_attention(q, k, v, None, d ** -0.5)
            runs.append((time.perf_counter() - t0) / N_CACHES * 1e6)
    finally:
        torch.set_num_threads(old)
    return statistics.median(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1416,8192")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="out/bench-decode-attention")
    args = ap.parse_args(argv)
    rows = []
    print("| model | q heads / KV heads, d | keys | threads | µs per call | K/V GB/s |")
    print("|---|---|---|---|---|---|")
    for name, h, kv, d in SHAPES:
        for length in (int(x) for x in args.lengths.split(",")):
            for t in (int(x) for x in args.threads.split(",")):
                us = time_call(h, kv, d, length, t, args.repeats)
                gbs = 2 * kv * length * d * 4 / (us * 1e-6) / 1e9
                rows.append({"model": name, "heads": h, "kv_heads": kv, "head_dim": d, "keys": length,
                             "threads": t, "us_per_call": us, "kv_gb_per_s": gbs})
                print(f"| {name} | {h} / {kv}, {d} | {length} | {t} | {us:.0f} | {gbs:.1f} |", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-decode-attention.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
