"""Where a decode step's time goes, per weight format: the LM head, the other matmuls, attention, the rest.

    python -m ldqa.eval.bench.profile_decode [--model gemma3-270m] [--formats int8] [--threads 1] [--length 1416]
                                             [--steps 10] [--compile-probe] [--out out/profile-decode]

For each format the model prefills `--length` prompt ids (the same ids as `bench_runtime`) and then runs
greedy decode steps; a step's wall time is measured without the profiler (median of `--steps`), and
torch.profiler splits the CPU time of as many steps into: the packed/quantized or float matmuls of the
linear layers (q8_0: the fused layer calls), the LM head alone (timed separately on one hidden state), the
attention products (`bmm`, or ldqa's C decode attention),
and everything else (norms, RoPE, casts, Python between ops), which is what compiling the step could at
most remove. `--compile-probe`: times the LM head as `torch.compile` of "dequantize int8, then linear"
(gpt-fast's int8 formulation) against the aten packed op, to see whether Inductor fuses the dequantization
into the matrix-vector product on this CPU.
Writes `<out>/profile-decode.json` and a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ldqa.attention.loader import load_model
from ldqa.eval.bench.bench_runtime import prompt_ids, write_report

# the fused q8_0 decode calls (decode_runner.FusedDecode) count as matmuls: their norms, RoPE and activation are a
# small part of them (a few thousand values per layer against the weight rows)
# (the whole layer stack in one call, ldqa::decode_stack, counts here too: its decode attention inside it)
MATMUL_OPS = ("aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::addmm", "aten::mm",
              "aten::linear", "ldqa::linear_q8_0", "ldqa::decode_attn_in", "ldqa::decode_attn_out",
              "ldqa::decode_stack")
ATTENTION_OPS = ("aten::bmm", "ldqa::decode_attention")  # torch's products, or ldqa's C decode attention


def median_ms(f, n: int) -> float:
    """Median wall time of f() over n calls (ms), after two warm-up calls."""
    f(), f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile_format(name: str, fmt: str, length: int, steps: int) -> dict:
    """One format's decode-step breakdown (ms per step) after prefilling `length` prompt ids."""
    lm = load_model(name, weights=fmt)
    m = lm.model
    ids = prompt_ids(lm.tokenizer, length)
    cache = m.new_cache(capacity=len(ids) + 4 * steps + 16)
    with torch.no_grad():
        logits = m(torch.tensor([ids]), torch.arange(len(ids)), cache)
        state = {"pos": len(ids), "logits": logits}

        def step():
            tok = state["logits"][0, -1].argmax().view(1, 1)
            state["logits"] = m(tok, torch.tensor([state["pos"]]), cache)
            state["pos"] += 1

        step_ms = median_ms(step, steps)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        self_ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
        h = torch.randn(1, 1, m.lm_head.in_features)
        head_ms = median_ms(lambda: m.lm_head(h), steps)
    matmul = sum(v for k, v in self_ms.items() if k in MATMUL_OPS)
    attn = sum(self_ms.get(k, 0.0) for k in ATTENTION_OPS)
    profiled = sum(self_ms.values())
    return {"model": name, "format": fmt, "prompt_tokens": len(ids), "threads": torch.get_num_threads(),
            "step_ms": step_ms, "profiled_step_ms": profiled, "lm_head_ms": head_ms,
            "other_matmuls_ms": max(matmul - head_ms, 0.0), "attention_bmm_ms": attn,
            "rest_ms": max(profiled - matmul - attn, 0.0),
            "top_ops": sorted(self_ms.items(), key=lambda kv: -kv[1])[:12]}


def compile_probe(n: int = 262144, k: int = 640) -> dict:
    """LM-head-sized int8 matrix-vector product: aten packed op against torch.compile'd dequant + linear."""
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) + 0.5
    x = torch.randn(1, k)
    aten = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w, s.bfloat16()), 10)
    out = {"shape": [n, k], "aten_int8pack_ms": aten}
    try:
        fn = torch.compile(lambda x, w, s: torch.nn.functional.linear(x, w.to(x.dtype)) * s, dynamic=False)
        t = time.perf_counter()
        fn(x, w, s)
        out["compile_s"] = time.perf_counter() - t
        out["compiled_ms"] = median_ms(lambda: fn(x, w, s), 10)
    except Exception as e:  # no C++ compiler, or Inductor cannot build for this CPU
        out["compile_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def table(rows: list[dict], probe: dict | None) -> str:
    lines = ["| model | format | threads | prompt | step (ms) | LM head | other matmuls | attention | rest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['format']} | {r['threads']} | {r['prompt_tokens']} | {r['step_ms']:.1f} | "
                     f"{r['lm_head_ms']:.1f} | {r['other_matmuls_ms']:.1f} | {r['attention_bmm_ms']:.1f} | "
                     f"{r['rest_ms']:.1f} |")
    if probe:
        lines.append("")
        if "compiled_ms" in probe:
            lines.append(f"LM head {tuple(probe['shape'])} int8: aten packed op {probe['aten_int8pack_ms']:.1f} ms, "
                         f"torch.compile dequant+linear {probe['compiled_ms']:.1f} ms "
                         f"(compile {probe['compile_s']:.1f} s)")
        else:
            lines.append(f"torch.compile probe failed: {probe['compile_error']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ldqa.eval.bench.profile_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="packaged model name or GGUF path")
    ap.add_argument("--formats", default="int8", help="comma-separated weight formats")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--length", type=int, default=1416, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed (and profiled)")
    ap.add_argument("--compile-probe", action="store_true", help="also time torch.compile on an LM-head GEMV")
    ap.add_argument("--out", default="out/profile-decode")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [profile_format(args.model, f, args.length, args.steps) for f in args.formats.split(",")]
    probe = compile_probe() if args.compile_probe else None
    write_report(Path(args.out), "profile-decode", {"rows": rows, "compile_probe": probe}, table(rows, probe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
