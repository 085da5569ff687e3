"""Baseline of the main job on real input (numbers in docs/results.md): NQ-open gold passages as one collection.

Protocol (all through the public Python API):
1. Write each of the 2,655 gold passages of `nq-open-oracle.jsonl.gz` as one Markdown document
   (`# {title}` + text) and `LongDocQA.ingest` them all into a fresh store (identical passages are
   deduplicated by content, as in the product; a question's gold document is the stored document with
   its passage's content).
2. For N seeded questions: retrieval recall@1/5/10 of the gold document for dense, BM25 and hybrid;
   then `ask` with top_k=5 (hybrid, full attention, greedy): best-subspan EM, retrieval ms, TTFT ms,
   tokens/s.
Writes `results.json` (summary) and `per_question.jsonl` to --out.

    python -m ldqa.eval.bench.bench_nq --data ../shared/data/nq-open-oracle.jsonl.gz --n 200 --out out/bench-nq
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

from ldqa.eval.metrics import best_subspan_em
from ldqa.eval.nq import DEFAULT_DATA, load_nq

def write_passages(records: list[dict], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, r in enumerate(records):
        p = folder / f"{i:05d}.md"
        p.write_text(f"# {r['title']}\n\n{r['text']}\n", encoding="utf-8")
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--n", type=int, default=200, help="questions evaluated (seeded sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="answer length cap (NQ answers are short)")
    ap.add_argument("--out", type=Path, default=Path("out/bench-nq"))
    args = ap.parse_args(argv)

    from ldqa.app.api import LongDocQA

    if not args.data.exists():
        print(f"bench_nq: data file {args.data} not found (pass --data)", file=sys.stderr)
        return 2
    records = load_nq(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "store"
    paths = write_passages(records, args.out / "passages")
    qa = LongDocQA(store=store, model=args.model)
    t0 = time.perf_counter()
    report = qa.ingest(paths, progress=True)
    ingest_s = time.perf_counter() - t0
    doc_of = [f.doc_id for f in report.files]  # skipped duplicates carry the stored doc id
    print(f"ingested {len(paths)} passages in {ingest_s:.1f} s: {report.added} documents, "
          f"{report.skipped} duplicates, {len(report.errors)} errors, {qa.store.n_chunks()} chunks", file=sys.stderr)

    idx = random.Random(args.seed).sample(range(len(records)), min(args.n, len(records)))
    per_q = []
    ks = (1, 5, 10)
    hits = {m: {k: 0 for k in ks} for m in ("dense", "bm25", "hybrid")}
    from tqdm import tqdm

    with open(args.out / "per_question.jsonl", "w") as fout:
        for i in tqdm(idx, desc="questions", file=sys.stderr):
            r, gold_doc = records[i], doc_of[i]
            row = {"i": i, "question": r["question"], "answers": r["answers"]}
            for mode in hits:
                docs = [p.doc_id for p in qa.retrieve(r["question"], top_k=10, retriever=mode)]
                rank = docs.index(gold_doc) + 1 if gold_doc in docs else None
                row[f"rank_{mode}"] = rank
                for k in ks:
                    hits[mode][k] += bool(rank and rank <= k)
            ans = qa.ask(r["question"], top_k=args.top_k, retriever="hybrid", max_new_tokens=args.max_new_tokens)
            row |= {"prediction": ans.text, "em": best_subspan_em(ans.text, r["answers"]),
                    "gold_in_context": gold_doc in [p.doc_id for p in ans.passages], **ans.timings}
            per_q.append(row)
            fout.write(json.dumps(row) + "\n")
            fout.flush()

    n = len(per_q)
    med = lambda key: statistics.median(r[key] for r in per_q)  # noqa: E731
    summary = {
        "model": qa.model_name, "questions": n, "seed": args.seed, "top_k": args.top_k,
        "max_new_tokens": args.max_new_tokens,
        "passages": len(paths), "documents": qa.store.n_documents(), "chunks": qa.store.n_chunks(),
        "ingest_s": ingest_s, "store_bytes": qa.store.size_bytes(),
        "recall": {m: {f"@{k}": hits[m][k] / n for k in ks} for m in hits},
        "em_hybrid_top_k": sum(r["em"] for r in per_q) / n,
        "em_when_gold_in_context": (sum(r["em"] for r in per_q if r["gold_in_context"])
                                    / max(1, sum(r["gold_in_context"] for r in per_q))),
        "median_retrieval_ms": med("retrieval_ms"), "median_ttft_ms": med("ttft_ms"),
        "median_tokens_per_s": med("tokens_per_s"), "median_prompt_tokens": med("prompt_tokens"),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
