"""Ranking heads for a model: which attention heads rank NQ-open passages by relevance (docs/results.md,
"Ranking heads"; `ldqa.attention.ranking_heads`).

QRHead (Zhang et al. 2025, sec. 3): score every head by the attention mass the question gives the gold
passage, over a few hundred labelled questions, and rank passages by the summed mass of the best few. Here
each question (the evaluation's seeded order from --skip to --limit: by default past the first 800, which
the accuracy runs use) is measured the way the block modes measure it: its passages' blocks assembled
without anchor passages, in the given and the reversed order, the question's queries recorded, and every
head's mass per passage kept (rows in OUT/rows.jsonl; a rerun resumes). The questions are then split in
half by record: heads are scored on the first half by the share of their two-order mass that goes to the
gold passage (mean over questions), the best --heads kept, and the second half reports how often the gold
passage is ranked first by:
  all-calibrated: every head's mass, calibrated against the block bias curve (ratio form, two orders):
                  `debias.two_order_relevance`, what the block modes rank by without ranking heads;
  all-raw:        every head's mass averaged over the two orders, uncalibrated;
  heads-N:        the best N heads' mass averaged over the two orders (what `ranking_heads` does).
Writes OUT/ranking-heads.json; with --write, the chosen heads go into ldqa's bundled ranking_heads.json
under the model's name.

    python -m ldqa.eval.bench.bench_ranking_heads --model qwen2.5-coder-1.5b-instruct --out out/ranking-heads
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example

COUNTS = (1, 2, 4, 8, 16, 32, 64)


def head_scores(rows: list[dict]) -> torch.Tensor:
    """Each head's QRHead score, (n_heads,): the mean over `rows` of the share of the head's two-order mass
    (given plus reversed, per passage) that the gold passage gets. rows carry "heads" [(n_heads, k) given,
    (n_heads, k) reversed, both listed by slot] and the 1-based gold "position" in the given order."""
    total = None
    for r in rows:
        two = two_order(r)  # (n, k) per passage in the given order
        share = two[:, r["position"] - 1] / two.sum(-1).clamp_min(1e-12)
        total = share if total is None else total + share
    return total / len(rows)


def two_order(row: dict) -> torch.Tensor:
    """(n_heads, k): each head's mass per passage (given order), averaged over the given order and the
    reversed one (the reversed measurement's slot s holds passage k-1-s)."""
    given, rev = (torch.tensor(x) for x in row["heads"])
    return (given + rev.flip(-1)) / 2


def gold_first(rows: list[dict], score) -> float:
    """The fraction of `rows` whose gold passage has the highest score(row) (k,); ties count as misses."""
    hits = 0
    for r in rows:
        s = score(r)
        g = r["position"] - 1
        hits += int(bool((s[g] > torch.cat([s[:g], s[g + 1:]])).all()))
    return hits / len(rows) if rows else float("nan")


def summarize(rows: list[dict], n_heads: int, head_names: list) -> dict:
    """Select on the first half of the records, report gold ranked first on the second (module docstring)."""
    records = sorted({r["record"] for r in rows})
    cal_ids = set(records[: len(records) // 2])
    cal = [r for r in rows if r["record"] in cal_ids]
    test = [r for r in rows if r["record"] not in cal_ids]
    scores = head_scores(cal)
    best = torch.argsort(scores, descending=True, stable=True).tolist()
    positions = sorted({r["position"] for r in rows})

    def report(score) -> dict:
        return {"held_out": gold_first(test, score), "selection_half": gold_first(cal, score),
                **{f"held_out@{p}": gold_first([r for r in test if r["position"] == p], score) for p in positions}}

    out = {"rows": len(rows), "selection_questions": len(cal_ids), "held_out_questions": len(records) - len(cal_ids),
           "gold_ranked_first": {"all-calibrated": report(lambda r: torch.tensor(r["rel"])),
                                 "all-raw": report(lambda r: two_order(r).mean(0))}}
    for c in sorted(set(COUNTS) | {n_heads}):
        if c <= len(best):
            out["gold_ranked_first"][f"heads-{c}"] = report(lambda r, c=c: two_order(r)[best[:c]].mean(0))
    out["heads"] = [list(head_names[i]) for i in best[:n_heads]]
    out["head_scores"] = [round(float(scores[i]), 4) for i in best[:n_heads]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the model (default: ldqa's)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--positions", default="1,5", help="gold positions measured (1-based)")
    ap.add_argument("--skip", type=int, default=2255, help="the seeded order's questions from here ...")
    ap.add_argument("--limit", type=int, default=2655, help="... to here (the evaluation's --skip/--limit)")
    ap.add_argument("--seed", type=int, default=0, help="the evaluation's seed (question order, distractors)")
    ap.add_argument("--heads", type=int, default=8, help="heads kept")
    ap.add_argument("--write", action="store_true", help="put the chosen heads in ldqa's ranking_heads.json")
    ap.add_argument("--out", type=Path, default=Path("out/ranking-heads"))
    args = ap.parse_args(argv)

    from ldqa.app.api import LongDocQA

    args.out.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="kv-", dir=args.out))  # this process's passage blocks
    try:
        qa = LongDocQA(store=store, model=args.model, kv_budget_mb=4096)
        qa.warm_up()
        records = load_nq(args.data)
        order = list(range(len(records)))
        random.Random(args.seed).shuffle(order)  # the evaluation's order (`eval.examples._sample`)
        ids = order[: args.limit][args.skip:]
        rows = measure(qa, records, ids, [int(p) for p in args.positions.split(",")], args)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    from ldqa.attention.ranking_heads import all_heads

    names = all_heads(qa.engine.model)
    result = {"model": qa.llm.name, "passages": args.passages, "skip": args.skip, "limit": args.limit,
              **summarize(rows, args.heads, names)}
    (args.out / "ranking-heads.json").write_text(json.dumps(result, indent=1))
    for name, rep in result["gold_ranked_first"].items():
        print(f"{name:15s} held-out {rep['held_out']:.3f}  (selection half {rep['selection_half']:.3f})  " +
              "  ".join(f"{k.split('@')[1]}: {v:.3f}" for k, v in rep.items() if "@" in k))
    print("heads (layer, head):", result["heads"])
    if args.write:
        write_heads(qa.llm.name, result)
    return 0


def measure(qa, records: list[dict], ids: list[int], positions: list[int], args) -> list[dict]:
    """Every head's two-order mass per passage for questions `ids` at `positions` (rows, appended to
    OUT/rows.jsonl as they come; rows already there are kept)."""
    from ldqa.attention.debias import CALIBRATION, two_order_relevance
    from ldqa.attention.ranking_heads import all_heads

    path = args.out / "rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["record"], r["position"]) for r in rows}
    engine = qa.engine
    engine.ranking_heads = all_heads(engine.model)  # every head's mass kept by each measurement
    seen = []
    measure_orders = engine.measure_orders

    def capture(*a, **kw):
        out = measure_orders(*a, **kw)
        seen.append(out)
        return out

    engine.measure_orders = capture
    bias = qa.bias_curve(args.passages, "block", anchor_passages=0)
    with open(path, "a") as f:
        for i in ids:
            for p in positions:
                if (i, p) in done:
                    continue
                ex = multidoc_example(records, i, args.passages, p, args.seed)
                seen.clear()
                qa.answer(ex["question"], ex["passages"], attention="block", anchor_passages=0, debias="calibrate",
                          debias_orders=2, max_new_tokens=1)
                (c0, m0), (c1, m1) = seen[-1]
                rel = two_order_relevance(m0, m1, bias, CALIBRATION["block"])
                row = {"record": i, "position": p, "heads": [c0.ranking_mass.tolist(), c1.ranking_mass.tolist()],
                       "rel": rel.tolist()}
                f.write(json.dumps(row) + "\n")
                f.flush()
                rows.append(row)
    engine.measure_orders = measure_orders
    wanted = set(ids)
    return [r for r in rows if r["record"] in wanted and r["position"] in positions]


def write_heads(model: str, result: dict, path: Path | None = None) -> None:
    """Put `result`'s heads into the bundled ranking_heads.json under `model`, atomically."""
    from ldqa.attention import ranking_heads

    path = path or ranking_heads.BUNDLED
    data = json.loads(path.read_text()) if path.exists() else {"about": ranking_heads.ABOUT, "models": {}}
    data["models"][model] = {"heads": result["heads"], "made_with": {
        k: result[k] for k in ("passages", "skip", "limit", "selection_questions", "held_out_questions")}
        | {"gold_ranked_first": {k: round(v["held_out"], 3) for k, v in result["gold_ranked_first"].items()}}}
    text = re.sub(r"\[\s+(\d+),\s+(\d+)\s+\]", r"[\1, \2]", json.dumps(data, indent=1))  # a pair per line
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
    ranking_heads._bundled.cache_clear()


if __name__ == "__main__":
    sys.exit(main())
