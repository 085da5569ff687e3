"""Block-reusable KV states vs full attention, same model, same prompts, one process (docs/attention.md).

Two parts, each selectable:
  ttft      TTFT of full prefill vs block reuse with a cold store vs a warm store (and block+recompute
            at --recompute-ratio, warm) at total contexts of about 2K/4K/8K/16K tokens (k NQ passages of
            ~150-250 tokens plus a question); median of --repeats runs (a third of them above 8K); ratios
            full / block. block+recompute answers once untimed first, so the blocks of its own anchor
            passages (`block_attention.anchor_passages_of`) are stored when it is timed. Full attention's
            memo of exact prefills is cleared before each of its runs.
            Every mode answers with --debias (default none: the block modes' default, calibrate+reorder,
            would first fit a position bias curve for each size's passage count, 30-130 passages).
  accuracy  NQ-open multi-doc (eval/nq.py: gold + distractors from other questions' gold passages that
            contain no answer; gold at a seeded random position), best-subspan EM, for every mode in
            --modes (full, block:cached|fresh, block+recompute@R:cached|fresh: how passage headers are
            built, see BlockRuntime.assemble). Resumable: per-example rows in a JSONL file.
Also: KV store bytes per 1K tokens (vs the model's KV size), peak RSS.

    python -m ldqa.eval.bench.bench_block --part ttft --out out/bench-block
    python -m ldqa.eval.bench.bench_block --part accuracy --passages 10 --n 200 --out out/bench-block
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import tempfile
from pathlib import Path

from ldqa.eval.metrics import best_subspan_em
from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example


def _mode(spec: str) -> tuple[str, float | None, str | None]:
    """'block+recompute@0.15:cached' -> ('block+recompute', 0.15, 'cached'); 'full' -> ('full', None, None).

    The ':cached' / ':fresh' suffix picks how passage headers are built (BlockRuntime.assemble); without
    it the API default applies. (Rows written before the option existed, mode 'block' or
    'block+recompute@R' without a suffix, ran with fresh headers.)"""
    spec, _, headers = spec.partition(":")
    name, _, r = spec.partition("@")
    return name, (float(r) if r else None), (headers or None)


def ttft_part(qa, records, sizes, repeats, seed, debias: str = "none", recompute_ratio: float = 0.3) -> list[dict]:
    tok = qa.llm.tokenizer
    rng = random.Random(seed)
    rows = []
    for size in sizes:
        q = records[rng.randrange(len(records))]
        passages, n_tok = [], 0
        while n_tok < size - 100:
            r = records[rng.randrange(len(records))]
            passages.append({"title": r["title"], "text": r["text"]})
            n_tok += tok.count(r["text"]) + 12
        reps = repeats if size <= 8192 else max(1, repeats // 3)
        res = {}

        def run(mode, ratio=None, headers=None):
            if mode == "full":
                qa.engine.clear_memo()  # an exact prefill every time
            ans = qa.answer(q["question"], passages, attention=mode, max_new_tokens=1, recompute_ratio=ratio,
                            block_headers=headers, debias=debias)
            return ans.timings

        res["full"] = [run("full")["ttft_ms"] for _ in range(reps)]
        cold, warm, warm_fresh, rec = [], [], [], []
        for _ in range(reps):
            qa.kv_store.clear()
            rt = qa.block_runtime
            rt._prefix.clear()  # the shared prefix and the header blocks are computed again too:
            rt._headers.clear()  # a truly cold start
            cold.append(run("block")["ttft_ms"])
            t = run("block")
            assert t["kv_hits"] == len(passages), t
            warm.append(t["ttft_ms"])
            warm_fresh.append(run("block", headers="fresh")["ttft_ms"])
            run("block+recompute", recompute_ratio)  # its blocks (after its own anchor passages) stored: untimed
            t_rec = run("block+recompute", recompute_ratio)
            assert t_rec["kv_hits"] == len(passages), t_rec
            rec.append(t_rec["ttft_ms"])
        res |= {"block_cold": cold, "block_warm": warm, "block_warm_fresh_headers": warm_fresh,
                f"block+recompute@{recompute_ratio}_warm": rec}
        prompt_tokens = t["prompt_tokens"]
        med = {k: statistics.median(v) for k, v in res.items()}
        row = {"target_tokens": size, "prompt_tokens": prompt_tokens, "passages": len(passages), "runs": reps,
               "median_ttft_ms": med,
               "speedup_vs_full": {k: med["full"] / v for k, v in med.items() if k != "full"}}
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    return rows


def accuracy_part(qa, records, n, n_passages, modes, seed, out: Path) -> dict:
    from tqdm import tqdm

    rows_path = out / f"accuracy-{n_passages}.jsonl"
    done = {}
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["i"], r["mode"])] = r
    rng = random.Random(seed)
    idx = rng.sample(range(len(records)), n)
    positions = {i: random.Random(f"pos:{seed}:{i}").randint(1, n_passages) for i in idx}
    with open(rows_path, "a") as f:
        for i in tqdm(idx, desc=f"{n_passages} passages", file=sys.stderr):
            ex = multidoc_example(records, i, n_passages, positions[i], seed)
            for spec in modes:
                if (i, spec) in done:
                    continue
                mode, ratio, headers = _mode(spec)
                ans = qa.answer(ex["question"], ex["passages"], attention=mode, recompute_ratio=ratio,
                                max_new_tokens=32, block_headers=headers)
                row = {"i": i, "mode": spec, "gold_position": positions[i], "prediction": ans.text,
                       "em": best_subspan_em(ans.text, ex["answers"]), "ttft_ms": ans.timings["ttft_ms"],
                       "prompt_tokens": ans.timings["prompt_tokens"],
                       "tokens_reused": ans.timings.get("tokens_reused", 0)}
                done[(i, spec)] = row
                f.write(json.dumps(row) + "\n")
                f.flush()
    summary = {}
    for spec in modes:
        rows = [done[(i, spec)] for i in idx if (i, spec) in done]
        summary[spec] = {"n": len(rows), "em": sum(r["em"] for r in rows) / max(1, len(rows)),
                         "median_ttft_ms": statistics.median(r["ttft_ms"] for r in rows) if rows else None}
    for spec, s in summary.items():  # paired with full on the questions both have
        pairs = [(done[(i, spec)]["em"], done[(i, "full")]["em"]) for i in idx
                 if (i, spec) in done and (i, "full") in done]
        if spec != "full" and len(pairs) > 1:
            d = [a - b for a, b in pairs]
            s["em_minus_full_points"] = 100 * statistics.fmean(d)
            s["paired_se_points"] = 100 * statistics.stdev(d) / len(d) ** 0.5
            s["n_paired"] = len(d)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["ttft", "accuracy", "all"], default="all")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--sizes", default="2048,4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--modes", default="full,block:cached,block+recompute@0.15:cached,block:fresh,"
                                         "block+recompute@0.05:fresh,block+recompute@0.15:fresh,"
                                         "block+recompute@0.3:fresh")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--debias", default="none", help="the ttft part's debias method for every mode (default none)")
    ap.add_argument("--recompute-ratio", type=float, default=0.3,
                    help="the ttft part's block+recompute ratio (default 0.3, the API's)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=Path("out/bench-block"))
    ap.add_argument("--store", type=Path, default=None,
                    help="collection directory whose KV block store to use (and fill); default: a new one "
                         "under --out. Reusing an earlier run's store skips encoding blocks already there "
                         "(same results: blocks are content-addressed by model, prefix and tokens)")
    args = ap.parse_args(argv)

    from ldqa.app.api import LongDocQA

    records = load_nq(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.store or Path(tempfile.mkdtemp(prefix="kv-", dir=args.out))
    qa = LongDocQA(store=store, model=args.model, kv_budget_mb=4096)
    cfg = qa.llm.config
    result = {"model": qa.model_name, "seed": args.seed, "threads": __import__("torch").get_num_threads(),
              "self_check": {"enabled": qa.block_runtime.enabled, "reason": qa.block_runtime.disabled_reason}}
    if args.part in ("ttft", "all"):
        result["ttft"] = ttft_part(qa, records, [int(s) for s in args.sizes.split(",")], args.repeats, args.seed,
                                   args.debias, args.recompute_ratio)
    if args.part in ("accuracy", "all"):
        modes = args.modes.split(",")
        result["accuracy"] = {f"{args.passages}_passages": accuracy_part(
            qa, records, args.n, args.passages, modes, args.seed, args.out)}
    from ldqa.indexes.kv_store import kv_bytes_per_token

    model_kv = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, qa.kv_store.dtype)
    result["kv_store"] = {"bytes_per_1k_tokens": qa.kv_store.bytes_per_token() * 1000,
                          "model_kv_bytes_per_1k_tokens": model_kv * 1000, "stats": qa.kv_store.stats.to_dict()}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    name = f"results-{args.part}" + (f"-{args.passages}" if args.part != "ttft" else "") + ".json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
