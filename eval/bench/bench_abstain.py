"""Does the prompt let ldqa say "not in the documents"? Abstention against answering, per instruction.

    python -m ldqa.eval.bench.bench_abstain [--n 60] [--seed 0] [--k 5] [--instructions default,framed]
                                            [--model M] [--weights W] [--out out/bench-abstain]
    python -m ldqa.eval.bench.bench_abstain --part retrieval [--n 200] [--out out/bench-abstain-retrieval]

Two abstention paths, each measured on questions whose answer is in the passages and on questions whose
answer is not.

Part `prompt` (default): the instruction asks the model to say it cannot find the answer.
For `--n` seeded NQ-open questions, two contexts of `--k` passages each, answered with full attention
through `LongDocQA.answer` (greedy, 32 new tokens), once per instruction:
- answerable: the question's gold passage at a seeded position among k-1 distractors;
- unanswerable: k distractors only.
Distractors are other questions' gold passages that contain none of this question's answers (SQuAD-
normalized substring test), drawn with a seeded generator. An answer abstains when it contains the
instruction's abstention phrase (case-insensitive; `ABSTAIN_PHRASE`), or is empty.

Reported per instruction: abstention rate on unanswerable questions (higher is better: the model says it
cannot find the answer instead of inventing one), abstention rate on answerable questions (lower is
better: refusals of questions it could answer), best-subspan EM on answerable questions, and the paired EM
difference against the first instruction with its standard error. Instructions: `default` (ldqa's
`prompt.INSTRUCTION`), `framed` (`prompt.FRAMED_INSTRUCTION`: passages framed as quoted data, with an
explicit abstention phrase), `framed-noabstain` (the data framing alone, to separate the two effects).
Writes `<out>/bench-abstain.json`, per-answer rows in `<out>/rows.jsonl`, and a markdown table.

Part `retrieval`: ldqa abstains before the LLM runs when the best retrieved passage's dense cosine
similarity (MiniLM, the product's embedder) is below a threshold. All 2,655 NQ-open gold passages
(`# title` + text, as `bench_nq` ingests them) form the collection; for `--n` seeded questions, the
answerable case searches the whole collection, the unanswerable case the collection without every passage
that contains one of the question's answers (SQuAD-normalized substring: the gold passage, its
duplicates and any other passage that happens to hold the answer), so its best hit is the nearest
passage that cannot answer. Per threshold: how often each case abstains, and, for answerable questions,
how often the gold passage would still have been retrieved in the top 5 (what a refusal throws away).
The same on the bundled sample (`app/sample`), ingested by the product: the best dense score of its six
questions (answerable) and of `OFF_TOPIC` questions (about nothing in it), each through `LongDocQA.retrieve`.
Writes `<out>/bench-abstain-retrieval.json` and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

from ldqa.app.prompt import ABSTAIN_PHRASE, FRAMED_INSTRUCTION, INSTRUCTION
from ldqa.eval.bench.bench_runtime import write_report
from ldqa.eval.metrics import best_subspan_em, normalize_answer
from ldqa.eval.nq import DEFAULT_DATA, load_nq

INSTRUCTIONS = {
    "default": INSTRUCTION,
    "framed": FRAMED_INSTRUCTION,
    "framed-noabstain": FRAMED_INSTRUCTION.split(" If the search results")[0] + "\n\n",
}


def abstains(text: str) -> bool:
    """Whether an answer says it cannot answer: empty, or it contains `ABSTAIN_PHRASE` (any case)."""
    return not text.strip() or ABSTAIN_PHRASE.lower().rstrip(".") in text.lower()


def examples(records: list[dict], n: int, k: int, seed: int) -> list[dict]:
    """Seeded (question, answers, answerable passages, unanswerable passages) per question."""
    rng = random.Random(seed)
    idx = rng.sample(range(len(records)), min(n, len(records)))
    out = []
    for i in idx:
        r = records[i]
        golds = [normalize_answer(a) for a in r["answers"] if normalize_answer(a)]
        pool = []
        while len(pool) < k:
            j = rng.randrange(len(records))
            text = normalize_answer(records[j]["text"])
            if j != i and j not in pool and not any(g in text for g in golds):
                pool.append(j)
        as_p = lambda j: {"title": records[j]["title"], "text": records[j]["text"]}  # noqa: E731
        distract = [as_p(j) for j in pool]
        pos = rng.randrange(k)
        answerable = distract[:k - 1]
        answerable.insert(pos, as_p(i))
        out.append({"i": i, "question": r["question"], "answers": r["answers"], "gold_pos": pos + 1,
                    "answerable": answerable, "unanswerable": distract})
    return out


def run(args) -> dict:
    from ldqa.app.api import LongDocQA

    records = load_nq(args.data)
    exs = examples(records, args.n, args.k, args.seed)
    qa = LongDocQA(store=Path(args.out) / "store", model=args.model, weights=args.weights)
    names = args.instructions.split(",")
    rows = []
    with open(Path(args.out) / "rows.jsonl", "w") as f:
        for ex in exs:
            for name in names:
                for kind in ("answerable", "unanswerable"):
                    ans = qa.answer(ex["question"], ex[kind], max_new_tokens=32, instruction=INSTRUCTIONS[name])
                    row = {"i": ex["i"], "instruction": name, "kind": kind, "prediction": ans.text,
                           "abstained": abstains(ans.text), "answers": ex["answers"],
                           "em": best_subspan_em(ans.text, ex["answers"]) if kind == "answerable" else None}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
            print(f"question {len(rows) // (2 * len(names))}/{len(exs)}", file=sys.stderr, flush=True)
    summary = {"n": len(exs), "k": args.k, "seed": args.seed, "model": qa.model_name, "weights": qa.weights,
               "instructions": {}}
    ref = names[0]
    em_of = {(r["instruction"], r["i"]): r["em"] for r in rows if r["kind"] == "answerable"}
    for name in names:
        mine = [r for r in rows if r["instruction"] == name]
        una = [r for r in mine if r["kind"] == "unanswerable"]
        ans_rows = [r for r in mine if r["kind"] == "answerable"]
        diffs = [em_of[(name, ex["i"])] - em_of[(ref, ex["i"])] for ex in exs]
        summary["instructions"][name] = {
            "abstain_unanswerable": sum(r["abstained"] for r in una) / len(una),
            "abstain_answerable": sum(r["abstained"] for r in ans_rows) / len(ans_rows),
            "em_answerable": sum(r["em"] for r in ans_rows) / len(ans_rows),
            "em_diff_vs_first": statistics.mean(diffs),
            "em_diff_se": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0,
        }
    return summary


def table(s: dict) -> str:
    lines = [f"{s['n']} NQ-open questions (seed {s['seed']}), {s['k']} passages, {s['model']} ({s['weights']}), "
             "full attention", "",
             "| instruction | abstains, unanswerable | abstains, answerable | EM, answerable | EM vs first (paired, SE) |",
             "|---|---|---|---|---|"]
    for name, v in s["instructions"].items():
        lines.append(f"| {name} | {v['abstain_unanswerable']:.3f} | {v['abstain_answerable']:.3f} | "
                     f"{v['em_answerable']:.3f} | {v['em_diff_vs_first']:+.3f} ({v['em_diff_se']:.3f}) |")
    return "\n".join(lines) + "\n"


THRESHOLDS = (0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
# Questions the bundled sample (a wood-drying kiln's manual, bulletins, log, price list) says nothing about
OFF_TOPIC = ("Who won the 2018 FIFA World Cup?", "What is the capital of France?", "How do I bake sourdough bread?",
             "When did the Roman Empire fall?", "What is the boiling point of water at sea level?",
             "Who wrote Pride and Prejudice?")


def sample_scores(out: Path) -> dict:
    """Best dense score (`LongDocQA.retrieve`, dense) of the sample's questions and of OFF_TOPIC ones."""
    from ldqa.app.api import LongDocQA

    sample = Path(__file__).resolve().parents[2] / "app" / "sample"
    qa = LongDocQA(store=out / "sample-store")
    qa.ingest([sample / "docs"])
    questions = [json.loads(line)["question"] for line in open(sample / "questions.jsonl")]
    best = lambda q: qa.retrieve(q, top_k=1, retriever="dense")[0].score  # noqa: E731
    return {"answerable": {q: best(q) for q in questions}, "off_topic": {q: best(q) for q in OFF_TOPIC}}


def run_retrieval(args) -> dict:
    """Best dense cosine per question with and without the passages that hold its answers."""
    import numpy as np

    from ldqa.retrieval.embedders import Embedder

    records = load_nq(args.data)
    texts = [f"# {r['title']}\n\n{r['text']}" for r in records]
    norm_texts = [normalize_answer(t) for t in texts]
    emb = Embedder()
    P = emb.encode(texts, batch_size=64, progress=True)  # (n_passages, dim)
    idx = random.Random(args.seed).sample(range(len(records)), min(args.n, len(records)))
    Q = emb.encode([records[i]["question"] for i in idx])  # (n, dim)
    sims = Q @ P.T  # cosine (rows are L2-normalized)
    ans_best, una_best, gold_top5 = [], [], []
    for row, i in enumerate(idx):
        golds = [normalize_answer(a) for a in records[i]["answers"] if normalize_answer(a)]
        holds = np.array([any(g in t for g in golds) for t in norm_texts])
        holds[i] = True
        s = sims[row]
        ans_best.append(float(s.max()))
        una_best.append(float(s[~holds].max()))
        top5 = np.argsort(-s)[:5]
        gold_top5.append(bool(holds[top5].any()))
    out = {"n": len(idx), "seed": args.seed, "passages": len(texts),
           "median_best_answerable": statistics.median(ans_best),
           "median_best_unanswerable": statistics.median(una_best), "thresholds": {}}
    for t in THRESHOLDS:
        refused = [a < t for a in ans_best]
        out["thresholds"][str(t)] = {
            "abstain_unanswerable": sum(u < t for u in una_best) / len(una_best),
            "abstain_answerable": sum(refused) / len(refused),
            "refused_with_answer_in_top5": sum(r and g for r, g in zip(refused, gold_top5)) / len(refused)}
    out["sample"] = sample_scores(Path(args.out))
    return out


def table_retrieval(r: dict) -> str:
    lines = [f"{r['n']} NQ-open questions (seed {r['seed']}), {r['passages']} passages; best dense cosine, median: "
             f"answerable {r['median_best_answerable']:.3f}, unanswerable {r['median_best_unanswerable']:.3f}", "",
             "| abstain below cosine | abstains, unanswerable | abstains, answerable | of those, answer in top 5 |",
             "|---|---|---|---|"]
    for t, v in r["thresholds"].items():
        lines.append(f"| {t} | {v['abstain_unanswerable']:.3f} | {v['abstain_answerable']:.3f} | "
                     f"{v['refused_with_answer_in_top5']:.3f} |")
    lines += ["", "Bundled sample, best dense score (`LongDocQA.retrieve`):", "", "| question | kind | best cosine |",
              "|---|---|---|"]
    for kind in ("answerable", "off_topic"):
        for q, v in r["sample"][kind].items():
            lines.append(f"| {q} | {kind.replace('_', '-')} | {v:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ldqa.eval.bench.bench_abstain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["prompt", "retrieval"], default="prompt")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="NQ-open oracle file (.jsonl.gz)")
    ap.add_argument("--n", type=int, default=None, help="questions (seeded sample; default 60, retrieval 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=5, help="passages per context")
    ap.add_argument("--instructions", default="default,framed", help=f"comma-separated of {', '.join(INSTRUCTIONS)}")
    ap.add_argument("--model", default=None, help="model name or path (default: ldqa's default)")
    ap.add_argument("--weights", default=None, help="weight format (default: ldqa's default)")
    ap.add_argument("--out", default="out/bench-abstain")
    args = ap.parse_args(argv)
    if args.part == "retrieval":
        args.n = args.n or 200
        out = Path(args.out if args.out != "out/bench-abstain" else "out/bench-abstain-retrieval")
        args.out = str(out)
        result = run_retrieval(args)
        write_report(out, "bench-abstain-retrieval", result, table_retrieval(result))
        return 0
    args.n = args.n or 60
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run(args)
    write_report(Path(args.out), "bench-abstain", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
