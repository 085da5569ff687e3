"""BM25 tokenizations side by side on NQ-open: does CJK/ligature-aware search cost English recall?

    python -m ldqa.eval.bench.bench_bm25 [--n 200] [--seed 0] [--out out/bench-bm25]

All gold passages of NQ-open (`# title` + text, as `bench_nq` ingests them) go into three in-memory
SQLite FTS5 tables, each searched with its own query rewriting, for the same seeded questions:
- ``raw unicode61`` (store schema 1): ``porter unicode61 remove_diacritics 2`` over the text as loaded; a
  question's ``\\w+`` words, lower-cased, stopwords and single letters dropped, OR'ed;
- ``search_text`` (store schema 2, the product): the same tokenizer over `search_text` (NFKC, CJK runs as
  character bigrams) with `indexes.store.fts_query`;
- ``trigram``: FTS5's ``trigram`` tokenizer over the text; each question word of 3+ characters as a
  quoted substring, OR'ed (SQLite's built-in alternative for CJK; it cannot match a query term shorter than
  three characters, which is most Chinese words).
Per variant: recall@1/5/10 of the gold passage (a byte-identical duplicate of it counts), index build
time and median query time. The same numbers as `bench_nq`'s BM25 row up to chunking (a few passages
there span two chunks). Writes `<out>/bench-bm25.json` and a markdown table.
"""

from __future__ import annotations

import argparse
import random
import re
import sqlite3
import statistics
import time
from pathlib import Path

from ldqa.eval.bench.bench_runtime import write_report
from ldqa.eval.nq import DEFAULT_DATA, load_nq
from ldqa.indexes.store import _FTS_TOKENIZE, STOPWORDS, fts_query
from ldqa.retrieval.search_text import search_text

_WORD = re.compile(r"\w+", re.UNICODE)


def schema1_query(text: str) -> str | None:
    """The question rewriting of store schema 1 (before NFKC and CJK bigrams), kept for comparison."""
    terms: list[str] = []
    for word in _WORD.findall(text.lower()):
        if word in STOPWORDS or (len(word) == 1 and not word.isdigit()) or word in terms:
            continue
        terms.append(word)
    return " OR ".join(f'"{t}"' for t in terms[:64]) if terms else None


def trigram_query(text: str) -> str | None:
    terms = [w for w in dict.fromkeys(_WORD.findall(text.lower())) if len(w) >= 3 and w not in STOPWORDS]
    return " OR ".join(f'"{t}"' for t in terms[:64]) if terms else None


VARIANTS = {
    "raw unicode61 (schema 1)": (_FTS_TOKENIZE, lambda t: t, schema1_query),
    "search_text (schema 2)": (_FTS_TOKENIZE, search_text, fts_query),
    "trigram": ("trigram", lambda t: t, trigram_query),
}


def run(data: Path, n: int, seed: int) -> dict:
    records = load_nq(data)
    texts = [f"# {r['title']}\n\n{r['text']}" for r in records]
    idx = random.Random(seed).sample(range(len(records)), min(n, len(records)))
    changed = sum(search_text(t) != t for t in texts)
    out = {"passages": len(texts), "questions": len(idx), "seed": seed,
           "passages_changed_by_search_text": changed, "variants": {}}
    for name, (tokenize, index_text, query) in VARIANTS.items():
        db = sqlite3.connect(":memory:")
        t0 = time.perf_counter()
        db.execute(f"CREATE VIRTUAL TABLE f USING fts5(t, tokenize='{tokenize}')")
        db.executemany("INSERT INTO f (rowid, t) VALUES (?, ?)", [(i, index_text(t)) for i, t in enumerate(texts)])
        build_s = time.perf_counter() - t0
        hits, times = {1: 0, 5: 0, 10: 0}, []
        for i in idx:
            q = query(records[i]["question"])
            t0 = time.perf_counter()
            rows = db.execute("SELECT rowid FROM f WHERE f MATCH ? ORDER BY bm25(f), rowid LIMIT 10",
                              [q]).fetchall() if q else []
            times.append((time.perf_counter() - t0) * 1e3)
            ranked = [texts[r[0]] for r in rows]
            rank = ranked.index(texts[i]) + 1 if texts[i] in ranked else None
            for k in hits:
                hits[k] += bool(rank and rank <= k)
        out["variants"][name] = {"recall": {f"@{k}": v / len(idx) for k, v in hits.items()},
                                 "build_s": build_s, "median_query_ms": statistics.median(times)}
        db.close()
    return out


def table(r: dict) -> str:
    lines = [f"{r['passages']} passages, {r['questions']} questions (seed {r['seed']}); "
             f"{r['passages_changed_by_search_text']} passages change under search_text (NFKC)", "",
             "| BM25 variant | recall@1 | recall@5 | recall@10 | index build s | median query ms |",
             "|---|---|---|---|---|---|"]
    for name, v in r["variants"].items():
        rc = v["recall"]
        lines.append(f"| {name} | {rc['@1']:.3f} | {rc['@5']:.3f} | {rc['@10']:.3f} | {v['build_s']:.2f} | "
                     f"{v['median_query_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ldqa.eval.bench.bench_bm25", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="NQ-open oracle file (.jsonl.gz)")
    ap.add_argument("--n", type=int, default=200, help="questions (seeded sample, as bench_nq)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench-bm25")
    args = ap.parse_args(argv)
    result = run(args.data, args.n, args.seed)
    write_report(Path(args.out), "bench-bm25", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
