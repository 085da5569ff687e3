"""block+recompute's first token with the int8 prefill GEMM's element-wise halves in C (`kernels/int8_rows.c`:
the rows' int8 rounding and the scaling of the int32 sums) against the same steps in torch ops, side by side
in one process; or (--compare split) the pass's int8 and bf16 rows written into one output in place against
two outputs joined by `torch.cat`.

    OMP_NUM_THREADS=2 python -m ldqa.eval.bench.bench_int8_rows --model qwen2.5-coder-1.5b-instruct \
        [--n 3] [--passages 10] [--rounds 4] [--compare halves|split] [--out out/bench-int8-rows]

NQ-open multi-doc prompts (the first --n seeded questions, gold passage first among --passages), answered
(one token) in `block+recompute` with its default debiasing, once untimed (blocks stored, bias curve
fitted, int8 weights made), then --rounds rounds alternating the two settings (the order flipped every
round). Both compute the same bits: the answers must agree (`same_answers`). Prints and writes
OUT/int8-rows-COMPARE.json: the median first token of each setting and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example


def joined_split(self, x, rows: int, lead: int):
    """`quant.QLinear._apply_split` with the int8 and bf16 parts computed apart and joined by torch.cat."""
    import torch

    x2 = x.reshape(-1, self.in_features)
    lead = min(lead, len(x2)) if len(x2) == rows else 0
    parts = []
    if lead:
        parts.append(self.apply_prefill(x2[:lead], self.prefill_weight(rows, "int8")))
    if lead < len(x2):
        parts.append(self.apply_prefill(x2[lead:], self.prefill_weight(rows, "bf16")))
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(*x.shape[:-1], self.out_features)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=3, help="questions (the first of the seeded order)")
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compare", choices=("halves", "split"), default="halves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("out/bench-int8-rows"))
    args = ap.parse_args(argv)
    if not args.data.exists():
        raise SystemExit(f"--data {args.data}: not found (the NQ-open oracle file of ../shared/data)")

    from ldqa.app.api import LongDocQA, Passage
    from ldqa.attention import quant
    from ldqa.kernels import cpu_linear

    ours, theirs = ("c", "torch") if args.compare == "halves" else ("in_place", "cat")
    real = (cpu_linear.quantize_rows_int8, cpu_linear.dequantize_int32, quant.QLinear._apply_split)

    def use(setting: str) -> None:
        if args.compare == "halves":  # the kernels' wrappers answer None: the callers run the torch ops
            off = setting == theirs
            cpu_linear.quantize_rows_int8 = (lambda *a, **k: None) if off else real[0]
            cpu_linear.dequantize_int32 = (lambda *a, **k: None) if off else real[1]
        else:
            quant.QLinear._apply_split = joined_split if setting == theirs else real[2]

    records = load_nq(args.data)
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    args.out.mkdir(parents=True, exist_ok=True)
    store = tempfile.TemporaryDirectory(prefix="kv-", dir=args.out)
    qa = LongDocQA(store=Path(store.name), model=args.model, kv_budget_mb=4096)
    prompts = []
    for i in order[: args.n]:
        ex = multidoc_example(records, i, args.passages, 1, args.seed)
        prompts.append((ex["question"], [Passage(p["title"], p["text"]) for p in ex["passages"]]))

    def answer(q, ps):
        return qa.answer(q, ps, attention="block+recompute", debias="calibrate+reorder", max_new_tokens=1)

    for q, ps in prompts:
        answer(q, ps)
    times = {ours: [], theirs: []}
    texts = {ours: [], theirs: []}
    tokens = []
    try:
        for r in range(args.rounds):
            for setting in (ours, theirs) if r % 2 == 0 else (theirs, ours):
                use(setting)
                for q, ps in prompts:
                    a = answer(q, ps)
                    times[setting].append(a.timings.ttft_ms)
                    texts[setting].append(a.text)
                    tokens.append(a.timings.prompt_tokens)
    finally:
        use(ours)
    med = {s: statistics.median(t) for s, t in times.items()}
    res = {"model": qa.model_name, "weights": qa.weights, "threads": __import__("torch").get_num_threads(),
           "compare": args.compare, "questions": args.n, "passages": args.passages, "rounds": args.rounds,
           "median_prompt_tokens": statistics.median(tokens), "median_ttft_ms": med,
           f"{theirs}_over_{ours}": med[theirs] / med[ours], "same_answers": texts[ours] == texts[theirs]}
    (args.out / f"int8-rows-{args.compare}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    print(f"block+recompute first token: {ours} {med[ours] / 1000:.2f} s, {theirs} {med[theirs] / 1000:.2f} s, "
          f"{theirs} / {ours} {med[theirs] / med[ours]:.2f}x; same answers: {res['same_answers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
