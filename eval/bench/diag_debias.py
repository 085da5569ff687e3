"""Diagnostics behind the position-debiasing choices (docs/attention.md); not a benchmark of the product's answers.

rope-scales: the full-attention bias curve (found-in-the-middle calibration, `LongDocQA.bias_curve`) with
  the global layers' RoPE base multiplied by each scale: where each Attention Buckets branch has its
  troughs (Chen et al. 2023, sec. 3: branches should fill each other's troughs), and the flatness of
  the best branch per slot for the default `BUCKET_SCALES`.
ranking: on held-out NQ-open questions (seeded, none of bench_debias's questions for the same seed and
  n), the gold passage at each position among distractors (eval/nq.py), one token answered with
  debias="calibrate": how often the gold passage has the highest score under three calibrations of
  the measured attention mass a against the bias curve b: raw a, a - b (found-in-the-middle, what ldqa
  uses), a / b. Says whether a position's ranking misses come from the calibration's form. With
  --orders 2 each question is also measured with the passages reversed (debias_orders=2, what block
  modes do by default) and the two-order scores are added: "subtract-2" (ldqa's
  `two_order_relevance`) and "ratio-2" (a / b averaged over both slots).
buckets-prefill: Attention Buckets' prefill (debias="buckets", full attention, first token only, no prefill
  kept from an earlier answer) with the layers below the first global layer run once for all branches
  (ldqa's default) and with every branch prefilled whole, side by side in one process on the same held-out
  questions (the gold passage at the first of --positions), alternating which goes first; the answers'
  first tokens must be equal. Prints the median TTFT of each and their ratio.

    python -m ldqa.eval.bench.diag_debias rope-scales --scales 0.25,0.5,1,2 --out out/diag-debias
    python -m ldqa.eval.bench.diag_debias ranking --attention block --n 60 --orders 2 --out out/diag-debias
    python -m ldqa.eval.bench.diag_debias buckets-prefill --passages 20 --n 8 --out out/diag-debias
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from ldqa.eval.bench.bench_debias import ranked_first
from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example

CALIBRATIONS = {"raw": lambda a, b: a, "subtract": lambda a, b: a - b, "ratio": lambda a, b: a / b}
TWO_ORDER = {"subtract-2": "subtract", "ratio-2": "ratio"}  # the same, averaged over the given and reversed order


def gold_first(rows: list[dict], positions: list[int]) -> dict:
    """{calibration: {position: fraction of rows whose gold passage scores highest}}; rows carry
    `mass` and `bias` (k,) lists and their 1-based gold `position` (the passages in the given order);
    rows that also carry `mass_rev` (k,: each passage's mass with the order reversed, listed in the
    given order) add the two-order calibrations of TWO_ORDER (passage p's reversed slot is k-1-p)."""
    def score(r, name):
        if name in CALIBRATIONS:
            return [CALIBRATIONS[name](a, b) for a, b in zip(r["mass"], r["bias"])]
        f = CALIBRATIONS[TWO_ORDER[name]]
        return [(f(a, b) + f(a2, b2)) / 2 for a, b, a2, b2 in zip(r["mass"], r["bias"], r["mass_rev"], r["bias"][::-1])]

    names = list(CALIBRATIONS) + (list(TWO_ORDER) if rows and all("mass_rev" in r for r in rows) else [])
    out = {}
    for name in names:
        out[name] = {}
        for p in positions:
            hits = [ranked_first(score(r, name), p - 1) for r in rows if r["position"] == p]
            out[name][p] = sum(hits) / len(hits) if hits else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["rope-scales", "ranking", "buckets-prefill"])
    ap.add_argument("--scales", default="0.25,0.5,1,2", help="rope-scales: RoPE base multipliers")
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--positions", default="1,5,10")
    ap.add_argument("--attention", default="block", help="ranking: full or block")
    ap.add_argument("--n", type=int, default=60, help="ranking, buckets-prefill: held-out questions")
    ap.add_argument("--bench-n", type=int, default=200, help="ranking: questions bench_debias uses (excluded)")
    ap.add_argument("--seed", type=int, default=0, help="bench_debias's seed (its questions, the distractors)")
    ap.add_argument("--held-out-seed", type=int, default=8, help="ranking: which held-out questions")
    ap.add_argument("--orders", type=int, choices=[1, 2], default=1,
                    help="ranking: measure in the given order only (1) or also reversed (2)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=Path("out/diag-debias"))
    args = ap.parse_args(argv)

    from ldqa.app.api import LongDocQA

    args.out.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="kv-", dir=args.out))  # this process's passage blocks
    try:
        return _run(LongDocQA(store=store, kv_budget_mb=4096), args)
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _run(qa, args) -> int:
    qa.warm_up()
    if args.what == "rope-scales":
        curves = {}
        for s in (float(x) for x in args.scales.split(",")):
            curves[s] = [round(x, 5) for x in qa.bias_curve(args.passages, "full", theta_scale=s).tolist()]
            print(f"x{s:g}", curves[s], flush=True)
        from ldqa.attention.debias import BUCKET_SCALES

        branches = [curves[s] for s in BUCKET_SCALES if s in curves]
        best = [max(col) for col in zip(*branches)] if branches else None
        result = {"passages": args.passages, "curves": curves, "bucket_scales": list(BUCKET_SCALES),
                  "best_branch_per_slot": best}
        if best:
            print("best of", BUCKET_SCALES, [round(x, 3) for x in best], f"max/min {max(best) / min(best):.2f}",
                  f"(scale 1 alone: {max(curves[1.0]) / min(curves[1.0]):.2f})" if 1.0 in curves else "")
        (args.out / f"rope-scales-{args.passages}.json").write_text(json.dumps(result, indent=1))
        return 0
    records = load_nq(args.data)
    bench = set(random.Random(args.seed).sample(range(len(records)), args.bench_n))
    held_out = random.Random(args.held_out_seed).sample([i for i in range(len(records)) if i not in bench], args.n)
    positions = [int(p) for p in args.positions.split(",")]
    if args.what == "buckets-prefill":
        return _buckets_prefill(qa, records, held_out, positions[0], args)
    bias = qa.bias_curve(args.passages, args.attention).tolist()
    name = f"ranking-{args.attention}-{args.passages}" + ("-orders2" if args.orders == 2 else "")
    rows_path = args.out / f"{name}.jsonl"
    done = {(r["i"], r["position"]) for r in map(json.loads, rows_path.read_text().splitlines())} \
        if rows_path.exists() else set()
    with open(rows_path, "a") as f:
        for i in held_out:
            for p in positions:
                if (i, p) in done:
                    continue
                ex = multidoc_example(records, i, args.passages, p, args.seed)
                ans = qa.answer(ex["question"], ex["passages"], attention=args.attention, debias="calibrate",
                                max_new_tokens=1, debias_orders=args.orders)
                row = {"i": i, "position": p, "mass": ans.timings["passage_attention"], "bias": bias}
                if args.orders == 2:
                    row["mass_rev"] = ans.timings["passage_attention_reversed"]
                f.write(json.dumps(row) + "\n")
                f.flush()
    rows = [r for r in map(json.loads, rows_path.read_text().splitlines()) if r["i"] in held_out]
    result = {"attention": args.attention, "passages": args.passages, "n": args.n, "orders": args.orders,
              "gold_ranked_first": gold_first(rows, positions)}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    for name, by_pos in result["gold_ranked_first"].items():
        print(f"{name:10s}", "  ".join(f"@{p} {v:.2f}" for p, v in by_pos.items()))
    return 0


def _buckets_prefill(qa, records, held_out: list[int], position: int, args) -> int:
    """buckets-prefill (see the module docstring): writes buckets-prefill-{k}.json; exit 1 if a shared
    and a whole prefill gave different first tokens."""
    import statistics

    ms = {"shared": [], "whole": []}
    same = True
    for n, i in enumerate(held_out):
        ex = multidoc_example(records, i, args.passages, position, args.seed)
        first = {}
        for way in (["shared", "whole"] if n % 2 == 0 else ["whole", "shared"]):
            qa.engine.clear_memo()  # every branch prefilled here, none kept from the other way
            qa.engine.share_bucket_layers = way == "shared"
            ans = qa.answer(ex["question"], ex["passages"], attention="full", debias="buckets", max_new_tokens=1)
            ms[way].append(ans.timings["ttft_ms"])
            first[way] = ans.text
        same &= first["shared"] == first["whole"]
        print(f"question {i}: TTFT shared {ms['shared'][-1]:,.0f} ms, whole {ms['whole'][-1]:,.0f} ms", flush=True)
    qa.engine.share_bucket_layers = True
    med = {w: statistics.median(v) for w, v in ms.items()}
    result = {"passages": args.passages, "position": position, "n": len(held_out), "ttft_ms": ms,
              "median_ttft_ms": med, "whole_over_shared": med["whole"] / med["shared"], "same_first_token": same}
    (args.out / f"buckets-prefill-{args.passages}.json").write_text(json.dumps(result, indent=1))
    print(f"median TTFT: shared {med['shared']:,.0f} ms, whole {med['whole']:,.0f} ms "
          f"(whole / shared {result['whole_over_shared']:.2f}); same first tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
