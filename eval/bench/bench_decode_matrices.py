"""Where a decode step's matrix time goes: each kind of matrix of every layer, multiplied with one activation
row by ldqa's C kernel, as a decode step reads it.

    python -m ldqa.eval.bench.bench_decode_matrices [--model qwen2.5-coder-1.5b-instruct] [--weights gguf]
                                                    [--threads 1] [--passes 5] [--out out/bench-decode-matrices]

For each projection (q, k, v, o, gate, up, down) the product of one random row of activations with that
matrix in all layers, one layer after another (so each matrix is read from memory, as in a decode step),
and the LM head; the fastest of `--passes` passes. Reported per kind: block type, shape, ms per token,
bytes read and GB/s; and the total, which bounds the decode rate from above (attention, norms and the rest
come on top). Random activations hold no outliers, so the K types' int8 path is timed throughout
(docs/kernels.md 5c). `--decode-steps S`: also whole greedy decode steps (the model's own forward, fused
C decode included) after a `--prompt-tokens` prompt (the sample's text, the same ids each time), the
fastest of 3 runs of S steps, as ms per step and tokens/s. Writes `<out>/bench-decode-matrices.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ldqa.attention.loader import load_model
from ldqa.kernels import cpu_linear

KINDS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
         ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _product(mod, x: torch.Tensor) -> torch.Tensor:
    """One decode row through `mod` the way the fused decode calls the kernel."""
    if getattr(mod, "fmt", None) == "gguf":
        return cpu_linear.linear_gguf(x, mod.blocks, mod.ggml_type)
    return mod(x)


def _bytes(mod) -> int:
    return sum(b.numel() * b.element_size() for b in mod.buffers())


def measure(model, passes: int) -> list[dict]:
    """Rows per matrix kind: name, type, shape, ms (fastest pass), bytes, GB/s."""
    layers = model.model.layers
    groups = [(name, [getattr(getattr(layer, part), name) for layer in layers]) for part, name in KINDS]
    groups.append(("lm_head", [model.lm_head]))
    rows = []
    for name, mods in groups:
        x = torch.randn(1, mods[0].in_features)
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            for mod in mods:
                _product(mod, x)
            best = min(best, time.perf_counter() - t)
        nbytes = sum(_bytes(m) for m in mods)
        ggml = getattr(mods[0], "ggml_type", None)
        rows.append({"matrix": name, "type": cpu_linear.GGUF_BLOCK_TYPES[ggml][0] if ggml in cpu_linear.GGUF_BLOCK_TYPES
                     else getattr(mods[0], "fmt", "?"), "shape": [mods[0].out_features, mods[0].in_features],
                     "count": len(mods), "ms": best * 1e3, "bytes": nbytes, "gb_per_s": nbytes / best / 1e9})
    return rows


def decode_step_ms(lm, prompt_tokens: int, steps: int, runs: int = 3) -> float:
    """Fastest mean time of one greedy decode step (ms) over `runs` runs of `steps` steps after prefilling
    `prompt_tokens` ids of `bench_runtime.prompt_ids`."""
    from ldqa.eval.bench.bench_runtime import prompt_ids

    ids, m = prompt_ids(lm.tokenizer, prompt_tokens), lm.model
    best = float("inf")
    for _ in range(runs):
        cache = m.new_cache()
        with torch.no_grad():
            logits = m(torch.tensor([ids]), torch.arange(len(ids)), cache)
            t0 = time.perf_counter()
            for i in range(steps):
                tok = int(logits[0, -1].argmax())
                logits = m(torch.tensor([[tok]]), torch.tensor([len(ids) + i]), cache)
            best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="packaged model name or GGUF path")
    ap.add_argument("--weights", default="gguf", help="weight format (gguf or q8_0: the decode kernel's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=0, help="also time this many whole decode steps (0: no)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt before the decode steps")
    ap.add_argument("--out", default="out/bench-decode-matrices")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, weights=args.weights)
    rows = measure(lm.model, args.passes)
    total_ms, total_b = sum(r["ms"] for r in rows), sum(r["bytes"] for r in rows)
    print(f"{args.model}, weights {args.weights}, {args.threads} thread(s), fastest of {args.passes} passes")
    print("| matrix | type | shape x count | ms per token | MB | GB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['matrix']} | {r['type']} | {r['shape'][0]} x {r['shape'][1]} x {r['count']} | {r['ms']:.2f} | "
              f"{r['bytes'] / 1e6:.0f} | {r['gb_per_s']:.1f} |")
    print(f"| all | | | {total_ms:.1f} ({1000 / total_ms:.1f} tokens/s at most) | {total_b / 1e6:.0f} | "
          f"{total_b / total_ms / 1e6:.1f} |")
    step = decode_step_ms(lm, args.prompt_tokens, args.decode_steps) if args.decode_steps else None
    if step is not None:
        print(f"whole decode step after {args.prompt_tokens} prompt tokens: {step:.1f} ms ({1000 / step:.1f} tokens/s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-decode-matrices.json").write_text(json.dumps({"settings": vars(args), "rows": rows,
                                                                 "total_ms": total_ms, "total_bytes": total_b,
                                                                 "decode_step_ms": step}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
