"""Prefill on the CPU: the allocator settings on and off, and where gguf rows should leave the C kernel.

    python -m ldqa.eval.bench.bench_prefill [--model qwen2.5-coder-1.5b-instruct] [--length 1416] [--threads 1,2]
        [--repeats 2] [--parts allocator,crossover] [--rows 1,4,6,8,16] [--out out/bench-prefill]

allocator: one prefill of `--length` prompt ids (`bench_runtime.prompt_ids`) with gguf weights, in child
processes with the defaults (`attention.memory.retain_freed_memory`) and with LDQA_MALLOC=system, run
interleaved `--repeats` times per thread count after one warm-up prefill each. Per run: seconds, minor page
faults and system CPU seconds of the timed prefill (getrusage). The table gives medians and system/default.

crossover: for the largest decoder-layer matrix of each GGUF block type in the model (and a random q8_0 weight of the
same shape as the first), the C kernel (`cpu_linear.linear_gguf` / `linear_q8_0`) on M rows against
dequantizing to bf16 (`dequantize_gguf` / `dequantize_q8_0` with torch.bfloat16) plus one bf16 GEMM, ms,
median of 7 after two warm-ups, in this process (allocator defaults on, as in a loaded model). The smallest M
at which the GEMM is faster is where `QLinear.gemm_rows` should be (`quant.GGUF_PREFILL_ROWS`).
Results as Markdown on stdout and in OUT/bench-prefill.md, all numbers in OUT/bench-prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(model: str, length: int, threads: int) -> dict:
    """One warm-up and one timed prefill in this process: {"prefill_s", "minor_faults", "sys_s"}."""
    import torch

    from ldqa.attention.loader import load_model
    from ldqa.eval.bench.bench_runtime import prompt_ids

    torch.set_num_threads(threads)
    lm = load_model(model, weights="gguf")
    ids = prompt_ids(lm.tokenizer, length)

    def prefill():
        cache = lm.model.new_cache(capacity=len(ids) + 16)
        with torch.no_grad():
            lm.model(torch.tensor([ids]), torch.arange(len(ids)), cache)

    prefill()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    prefill()
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"prefill_s": dt, "minor_faults": r1.ru_minflt - r0.ru_minflt, "sys_s": r1.ru_stime - r0.ru_stime}


def allocator_part(model: str, length: int, threads: list[int], repeats: int) -> dict:
    """Medians per (threads, setting) of `child` runs, interleaved; setting "default" or "system"."""
    runs = {(t, s): [] for t in threads for s in ("default", "system")}
    for _ in range(repeats):
        for t in threads:
            for setting in ("default", "system"):
                env = {**os.environ, "LDQA_MALLOC": "" if setting == "default" else "system",
                       "OMP_NUM_THREADS": str(t)}
                out = subprocess.run([sys.executable, "-m", "ldqa.eval.bench.bench_prefill", "--child",
                                      "--model", model, "--length", str(length), "--threads", str(t)],
                                     env=env, capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"threads {t} {setting}: {row}", file=sys.stderr)
                runs[(t, setting)].append(row)
    return {f"{t}/{s}": {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"runs": rows}
            for (t, s), rows in runs.items()}


def crossover_part(model: str, rows: list[int], threads: list[int]) -> dict:
    """{type name: {threads: {M: (kernel ms, gemm ms)}}} for the largest matrix of each gguf type."""
    import torch

    from ldqa.attention.loader import load_model
    from ldqa.attention.quant import QLinear, quantize_q8_0
    from ldqa.eval.bench.profile_decode import median_ms
    from ldqa.kernels import cpu_linear as C

    lm = load_model(model, weights="gguf")
    largest = {}
    for mod in lm.model.model.layers.modules():  # the decoder layers' matrices (the LM head sees one row)
        if (isinstance(mod, QLinear) and mod.fmt == "gguf"
                and mod.blocks.numel() > largest.get(mod.ggml_type, (0, None))[0]):
            largest[mod.ggml_type] = (mod.blocks.numel(), mod)
    cases = {}
    for t, (_, mod) in sorted(largest.items()):
        k = mod.in_features
        cases[C.GGUF_BLOCK_TYPES[t][0]] = (k, lambda x, b=mod.blocks, t=t: C.linear_gguf(x, b, t),
                                          lambda b=mod.blocks, t=t, k=k: C.dequantize_gguf(b, t, k, torch.bfloat16))
    first = next(iter(largest.values()))[1]
    qw, qd = quantize_q8_0(torch.randn(first.out_features, first.in_features,
                                       generator=torch.Generator().manual_seed(0)) * 0.02)
    cases["q8_0"] = (first.in_features, lambda x: C.linear_q8_0(x, qw, qd),
                     lambda: C.dequantize_q8_0(qw, qd, torch.bfloat16))
    out = {}
    for name, (k, kernel, weight) in cases.items():
        out[name] = {}
        for t in threads:
            torch.set_num_threads(t)
            out[name][t] = {}
            for m in rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                out[name][t][m] = (median_ms(lambda: kernel(x), 7),
                                   median_ms(lambda: torch.nn.functional.linear(x.to(torch.bfloat16), weight()).float(), 7))
    return out


def markdown(data: dict) -> str:
    lines = []
    if "allocator" in data:
        lines += ["| threads | prefill s, default / system | system / default | minor faults, default / system | "
                  "system CPU s, default / system |", "|---|---|---|---|---|"]
        a = data["allocator"]
        for t in sorted({int(k.split("/")[0]) for k in a}):
            d, s = a[f"{t}/default"], a[f"{t}/system"]
            lines.append(f"| {t} | {d['prefill_s']:.2f} / {s['prefill_s']:.2f} | {s['prefill_s'] / d['prefill_s']:.2f}x | "
                         f"{d['minor_faults']:,.0f} / {s['minor_faults']:,.0f} | {d['sys_s']:.2f} / {s['sys_s']:.2f} |")
        lines.append("")
    if "crossover" in data:
        c = data["crossover"]
        ms = sorted(next(iter(next(iter(c.values())).values())))
        lines += ["| type | threads | " + " | ".join(f"M = {m}" for m in ms) + " | GEMM from M |",
                  "|---|---|" + "---|" * (len(ms) + 1)]
        for name, per_t in c.items():
            for t, per_m in per_t.items():
                cross = next((m for m in ms if per_m[m][1] < per_m[m][0]), None)
                lines.append(f"| {name} | {t} | " + " | ".join(f"{per_m[m][0]:.2f} / {per_m[m][1]:.2f}" for m in ms)
                             + f" | {cross if cross is not None else '-'} |")
        lines.append("\n(kernel ms / dequantize-to-bf16 + GEMM ms)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--length", type=int, default=1416, help="prompt tokens of the allocator part")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", default="allocator,crossover")
    ap.add_argument("--rows", default="1,4,6,8,16", help="crossover: rows M of the activations")
    ap.add_argument("--out", type=Path, default=Path("out/bench-prefill"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.child:
        print(json.dumps(child(args.model, args.length, threads[0])))
        return 0
    parts = set(args.parts.split(","))
    if not parts <= {"allocator", "crossover"}:
        ap.error(f"--parts: allocator, crossover; got {args.parts!r}")
    data = {"model": args.model, "length": args.length}
    if "allocator" in parts:
        data["allocator"] = allocator_part(args.model, args.length, threads, args.repeats)
    if "crossover" in parts:
        data["crossover"] = crossover_part(args.model, [int(m) for m in args.rows.split(",")], threads)
    from ldqa.eval.bench.bench_runtime import write_report

    write_report(args.out, "bench-prefill", data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
