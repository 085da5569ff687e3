"""Position debiasing vs none, by gold position (docs/attention.md#position-debiasing). Same model, same prompts, one process.

NQ-open multi-doc (eval/nq.py: the gold passage plus distractors = other questions' gold passages that
contain no answer string, seeded), k passages with the gold one at each position in --positions, for
every debias method in --methods and every attention mode in --attention; best-subspan EM; TTFT and the
extra latency of each method (the median over (question, position) of its total time minus that of
"none", on warm pairs: no passage block encoded anew by either answer; the methods of one prompt share
its exact prefill, whose measured time is added back to every row that reused it). Resumable: one JSONL
row per (question, position, attention, method); two processes can share a run (--reverse). Writes
results-debias-{k}.json, summary-debias-{k}.md (EM by position, paired differences vs none with SE,
latency; a length control: EM on each answer's first 5 words) and a PNG of accuracy vs gold position;
--summary-only rewrites them from the rows.

    python -m ldqa.eval.bench.bench_debias --passages 10 --positions 1,5,10 --n 200 --out out/bench-debias
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from ldqa.eval.metrics import best_subspan_em
from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example


def run(qa, records, args) -> dict:
    """Answer every missing (question, position, attention, method) row with `qa` (None: answer nothing,
    summarize the rows there are) and return the summary table (keys "attention/method")."""
    from tqdm import tqdm

    rows_path = args.out / f"debias-{args.passages}.jsonl"
    done = {}

    def refresh():  # rows written so far, by this process or by another one sharing --out
        if rows_path.exists():
            for line in rows_path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a row cut short by a killed process: answered again
                    continue
                done[(r["i"], r["position"], r["attention"], r["method"])] = r

    refresh()
    if qa is not None:
        check_settings(done.values(), args.debias_orders, args.methods.split(","), args.attention.split(","),
                       args.debias_calibration, args.debias_strength)
    if rows_path.exists() and rows_path.stat().st_size and not rows_path.read_bytes().endswith(b"\n"):
        with open(rows_path, "a") as f:  # start new rows on a line of their own after a cut-off one
            f.write("\n")
    idx = random.Random(args.seed).sample(range(len(records)), args.n)
    positions = [int(p) for p in args.positions.split(",")]
    methods, modes = args.methods.split(","), args.attention.split(",")
    with open(rows_path, "a") as f:
        for i in tqdm(([] if qa is None else idx[::-1] if args.reverse else idx), desc=f"{args.passages} passages",
                      file=sys.stderr):
            refresh()
            for pos in positions:
                ex = multidoc_example(records, i, args.passages, pos, args.seed)
                for mode in modes:
                    for method in methods:
                        key = (i, pos, mode, method)
                        if key in done or not _applies(method, mode):
                            continue
                        calibrates = method in ("calibrate", "calibrate+reorder")  # the others ignore them
                        ans = qa.answer(ex["question"], ex["passages"], attention=mode, debias=method,
                                        max_new_tokens=32,
                                        debias_orders=args.debias_orders if calibrates else None,
                                        debias_calibration=args.debias_calibration if calibrates else None,
                                        debias_strength=args.debias_strength if calibrates else None)
                        row = {"i": i, "position": pos, "attention": mode, "method": method,
                               "prediction": ans.text, "em": best_subspan_em(ans.text, ex["answers"]),
                               "ttft_ms": ans.timings["ttft_ms"], "total_ms": ans.timings["total_ms"],
                               "debias_ms": ans.timings.get("debias_ms", 0.0),
                               "passes": ans.timings.get("debias_passes", 1),
                               "reused_prefill_ms": ans.timings.get("reused_prefill_ms", 0.0),
                               "kv_misses": ans.timings.get("kv_misses", 0)}
                        if "debias_orders" in ans.settings:
                            row["debias_orders"] = ans.settings["debias_orders"]
                        if ans.settings.get("debias_calibration", "difference") != "difference":
                            row["debias_calibration"] = ans.settings["debias_calibration"]
                        if "debias_strength" in ans.settings:
                            row["debias_strength"] = ans.settings["debias_strength"]
                        for k in ("passage_attention", "calibrated_relevance"):  # in the final passage order
                            if k in ans.timings:
                                row[k] = [round(x, 6) for x in ans.timings[k]]
                        if "passage_attention" in row:
                            row["gold_slot"] = next(s for s, p in enumerate(ans.passages, 1)
                                                    if p.title == ex["passages"][pos - 1]["title"]
                                                    and p.text == ex["passages"][pos - 1]["text"])
                        done[key] = row
                        f.write(json.dumps(row) + "\n")
                        f.flush()
    table = {}
    for mode in modes:
        for method in filter(lambda m: _applies(m, mode), methods):
            rows = [r for r in done.values() if r["attention"] == mode and r["method"] == method and r["i"] in idx]
            warm = [r for r in rows if not r.get("kv_misses")]  # latency: no passage block encoded anew

            def mean_by_position(score):  # {position: mean of score(row) over its rows, None without rows}
                vs = {p: [score(r) for r in rows if r["position"] == p] for p in positions}
                return {p: (sum(v) / len(v) if v else None) for p, v in vs.items()}

            acc = mean_by_position(lambda r: r["em"])
            vals = [a for a in acc.values() if a is not None]
            t = table[f"{mode}/{method}"] = {
                "n_per_position": {p: sum(r["position"] == p for r in rows) for p in positions},
                "em_by_position": acc,
                "spread_points": 100 * (max(vals) - min(vals)) if vals else None,
                "median_ttft_ms": statistics.median(_alone(r, "ttft_ms") for r in warm) if warm else None,
                "median_total_ms": statistics.median(_alone(r, "total_ms") for r in warm) if warm else None,
                "em_first_words_by_position": mean_by_position(
                    lambda r: best_subspan_em(first_words(r["prediction"]), records[r["i"]]["answers"])),
                "median_answer_words": statistics.median(len(r["prediction"].split()) for r in rows) if rows else None}
            null = spread_null(rows, positions, seed=args.seed)
            if null:
                t["spread_null"] = null
            ranked = gold_ranked_first(rows, positions)
            if ranked:
                t["gold_ranked_first"] = ranked
    for mode in modes:
        base = table.get(f"{mode}/none")
        for method in filter(lambda m: _applies(m, mode), methods):
            t = table[f"{mode}/{method}"]
            extra = [_alone(a, "total_ms") - _alone(b, "total_ms") for a, b in
                     (_pair(done, i, p, mode, method) for i in idx for p in positions)
                     if a and b and not a.get("kv_misses") and not b.get("kv_misses")]
            if base and method != "none" and extra:
                t["extra_latency_ms"] = statistics.median(extra)
            if base and method != "none":
                t["vs_none"] = {p: paired(done, idx, p, mode, method) for p in positions}
                t["targets"] = targets(t, base, positions)
    return table


def check_settings(rows, orders: int | None, methods: list[str], modes: list[str],
                   calibration: str | None = None, strength: float | None = None) -> None:
    """Raise SystemExit if a calibrate row in `rows` of one of the `methods` x `modes` this run answers
    was measured with other debias_orders, debias_calibration or debias_strength than the run would use
    (`orders`, `calibration`, `strength`; None: the defaults, resolved by `DebiasConfig.resolved` for the
    attention mode): resuming would mix two settings under one method name. Rows
    without the fields predate them (1 order, "difference", the form's default strength)."""
    from ldqa.attention.debias import STRENGTH, DebiasConfig

    for r in rows:
        if r["method"] in ("calibrate", "calibrate+reorder") and r["method"] in methods and r["attention"] in modes:
            run = DebiasConfig(r["method"], orders, calibration, strength).resolved(r["attention"])  # what it would use
            want = run.orders
            if r.get("debias_orders", 1) != want:
                raise SystemExit(f"{r['attention']}/{r['method']} rows here were measured with debias_orders="
                                 f"{r.get('debias_orders', 1)}, this run would use {want}: give another --out "
                                 f"(or --debias-orders {r.get('debias_orders', 1)})")
            form = run.calibration
            had_form = r.get("debias_calibration", "difference")
            if had_form != form:
                raise SystemExit(f"{r['attention']}/{r['method']} rows here were measured with debias_calibration="
                                 f"{had_form}, this run would use {form}: give another --out "
                                 f"(or --debias-calibration {had_form})")
            want = run.strength
            had = r.get("debias_strength", STRENGTH[had_form])
            if abs(had - want) > 1e-9:
                raise SystemExit(f"{r['attention']}/{r['method']} rows here were measured with debias_strength="
                                 f"{had:g}, this run would use {want:g}: give another --out "
                                 f"(or --debias-strength {had:g})")


def _pair(done: dict, i: int, pos: int, mode: str, method: str) -> tuple[dict | None, dict | None]:
    return done.get((i, pos, mode, method)), done.get((i, pos, mode, "none"))


def paired(done: dict, idx: list[int], pos: int, mode: str, method: str) -> dict | None:
    """EM of `method` minus EM of "none" (points) on the questions that have both at gold position
    `pos`: mean, standard error (SE) of the mean, n."""
    d = [100 * (a["em"] - b["em"]) for a, b in (_pair(done, i, pos, mode, method) for i in idx) if a and b]
    if not d:
        return None
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else None
    return {"points": statistics.fmean(d), "se_points": se, "n": len(d)}


def targets(t: dict, base: dict, positions: list[int]) -> dict:
    """The debiasing targets for one method: best-worst gold position spread <= 5 points; every middle
    position (not first or last) >= +10 points over "none"; position 1 not worse than "none" by more than
    1 point. Each: the measured value and whether it is met (None when a cell is missing)."""
    vs = t["vs_none"]
    mids = [vs[p]["points"] for p in positions[1:-1] if vs.get(p)]
    first = vs[positions[0]]["points"] if vs.get(positions[0]) else None
    spread = t["spread_points"]
    return {"spread_points": spread, "spread_met": None if spread is None else spread <= 5,
            "middle_gain_points": min(mids) if mids else None,
            "middle_met": (min(mids) >= 10) if mids else None,
            "first_gain_points": first, "first_met": None if first is None else first >= -1}


def spread_null(rows: list[dict], positions: list[int], n_perm: int = 1000, seed: int = 0) -> dict | None:
    """The spread (points) a method with no position effect would show on these questions: each
    question's EM values are shuffled among the gold positions (a permutation test within question),
    n_perm times, seeded. Returns the observed spread, the null's median and 95th percentile and the
    p-value of the observed spread (the fraction of permutations at least as wide), all over the
    questions answered at every position (n); None when fewer than two positions or no such question.
    Says whether a spread above 5 points is a position effect or what n questions leave as noise. The
    questions are taken in id order, so the result depends on the rows, not on their order in the file."""
    by_q: dict[int, dict[int, float]] = {}
    for r in rows:
        by_q.setdefault(r["i"], {})[r["position"]] = r["em"]
    ems = [[q[p] for p in positions] for _, q in sorted(by_q.items()) if all(p in q for p in positions)]
    if len(positions) < 2 or not ems:
        return None

    def spread(cols):
        return 100 * (max(cols) - min(cols)) / len(ems)

    observed = spread([sum(c) for c in zip(*ems)])
    rng, null = random.Random(seed), []
    for _ in range(n_perm):
        tot = [0.0] * len(positions)
        for v in ems:
            v = v[:]
            rng.shuffle(v)
            tot = [a + b for a, b in zip(tot, v)]
        null.append(spread(tot))
    null.sort()
    return {"observed_points": observed, "median_points": statistics.median(null),
            "p95_points": null[int(0.95 * (n_perm - 1))],
            "p_value": sum(x >= observed - 1e-9 for x in null) / n_perm, "n": len(ems)}


def gold_ranked_first(rows: list[dict], positions: list[int]) -> dict:
    """Per gold position: the fraction of rows whose gold passage has the highest calibrated relevance,
    ties counted as misses (the ranking "calibrate+reorder" acts on; rows without recorded relevance
    are left out), and n. Empty when no row has it."""
    out = {}
    for p in positions:
        hits = [ranked_first(r["calibrated_relevance"], r["gold_slot"] - 1)
                for r in rows if r["position"] == p and "calibrated_relevance" in r and "gold_slot" in r]
        if hits:
            out[p] = {"fraction": sum(hits) / len(hits), "n": len(hits)}
    return out


def ranked_first(scores: list[float], g: int) -> bool:
    """Whether index g scores strictly above every other (a tie is a miss)."""
    return all(scores[g] > x for j, x in enumerate(scores) if j != g)


SHORT_ANSWER_WORDS = 5


def first_words(text: str, n: int = SHORT_ANSWER_WORDS) -> str:
    """The first n words of the first non-empty line of an answer: a length control for best-subspan EM,
    which a longer answer satisfies more easily. A method whose gain holds on first_words did not buy it
    with longer answers."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return " ".join(line.split()[:n])


def _alone(row: dict, key: str) -> float:
    """A row's time (ms) as if asked alone: the methods of one prompt share its exact prefill
    (LongDocQA keeps recent prefills), so the measured time of a reused prefill is added back."""
    return row[key] + row.get("reused_prefill_ms", 0.0)


def _applies(method: str, mode: str) -> bool:
    """Attention Buckets re-encode the whole prompt with other RoPE bases: full attention only."""
    return method != "buckets" or mode == "full"


def plot(table: dict, positions: list[int], path: Path, k: int) -> dict:
    """PNG of best-subspan EM against the gold position, a line per "attention/method" in `table` (a
    colour per method, a line style per attention mode; missing cells as gaps). Returns each line's
    (colour, line style) by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    methods = list(dict.fromkeys(name.split("/", 1)[1] for name in table))
    modes = list(dict.fromkeys(name.split("/", 1)[0] for name in table))
    styles = {}
    for name, t in table.items():
        mode, method = name.split("/", 1)
        styles[name] = (f"C{methods.index(method) % 10}", ("-", "--", ":", "-.")[modes.index(mode) % 4])
        ys = [t["em_by_position"][p] for p in positions]
        ax.plot(positions, [y if y is not None else float("nan") for y in ys], marker="o", label=name,
                color=styles[name][0], linestyle=styles[name][1])
    ax.set_xlabel(f"position of the gold passage (of {k})")
    ax.set_ylabel("best-subspan EM")
    ax.set_xticks(positions)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the curves, not over them
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return styles


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--positions", default="1,5,10")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--methods", default="none,calibrate,calibrate+reorder,sort,buckets")
    ap.add_argument("--attention", default="full,block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=Path("out/bench-debias"))
    ap.add_argument("--debias-orders", type=int, choices=[1, 2], default=None,
                    help="passage orders the calibrate methods measure (default: ldqa's, 2 in block modes, 1 full)")
    ap.add_argument("--debias-calibration", choices=["difference", "ratio", "pearson"], default=None,
                    help="how the calibrate methods calibrate attention against the bias curve: a - b, a / b or "
                         "(a - b) / sqrt(b) (default: ldqa's per attention mode, ldqa.attention.debias.CALIBRATION)")
    ap.add_argument("--debias-strength", type=float, default=None,
                    help="the calibrate methods' intervention strength (default: ldqa's per calibration form, "
                         "ldqa.attention.debias.STRENGTH)")
    ap.add_argument("--summary-only", action="store_true",
                    help="load no model: summarize the rows in --out (JSON, markdown table, PNG) as they are")
    ap.add_argument("--reverse", action="store_true",
                    help="work through the questions from the last; a second process started with it on the same "
                         "--out shares the work with a forward one (rows are re-read before each question)")
    args = ap.parse_args(argv)

    from ldqa.app.api import LongDocQA

    records = load_nq(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    qa, bias, store = None, None, None
    try:
        if not args.summary_only:
            store = Path(tempfile.mkdtemp(prefix="kv-", dir=args.out))  # this process's passage blocks
            qa = LongDocQA(store=store, model=args.model, kv_budget_mb=4096)
            qa.warm_up()
            bias = {m: qa.bias_curve(args.passages, m).tolist() for m in args.attention.split(",")}
        table = run(qa, records, args)
    finally:
        if store is not None:  # up to GBs of stored blocks; the rows are what the run keeps
            shutil.rmtree(store, ignore_errors=True)
    positions = [int(p) for p in args.positions.split(",")]
    result = {"model": qa.model_name if qa else args.model, "passages": args.passages, "seed": args.seed,
              "bias_curve": bias,
              "distractors": "other questions' gold passages that contain no answer string (eval/nq.py), seeded",
              "table": table}
    (args.out / f"results-debias-{args.passages}.json").write_text(json.dumps(result, indent=1))
    plot(table, positions, args.out / f"debias-{args.passages}.png", args.passages)
    md = markdown(table, positions)
    (args.out / f"summary-debias-{args.passages}.md").write_text(md)
    print(md)
    return 0


def markdown(table: dict, positions: list[int]) -> str:
    """One row per attention/method: n, EM per gold position, paired difference vs none per position
    (points, SE), spread, median total ms of warm answers (reused prefills added back) and the extra
    over none (paired, warm); then the length control (EM on first_words, median answer words) and the
    spread against its permutation null (spread_null)."""
    def em(x):
        return "—" if x is None else f"{x:.3f}"

    head = ["attention/method", "n"] + [f"EM @{p}" for p in positions] + [f"vs none @{p} (SE)" for p in positions] + \
        ["spread", "median total ms", "extra ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in table.items():
        vs = t.get("vs_none", {})
        diffs = ["—" if not vs.get(p) else f"{vs[p]['points']:+.1f} ({vs[p]['se_points'] or 0:.1f})"
                 for p in positions]
        n = min(t["n_per_position"].values()) if t["n_per_position"] else 0
        extra = t.get("extra_latency_ms")
        lines.append("| " + " | ".join([name, str(n)] + [em(t["em_by_position"][p]) for p in positions] + diffs + [
            "—" if t["spread_points"] is None else f"{t['spread_points']:.1f}",
            "—" if t["median_total_ms"] is None else f"{t['median_total_ms']:,.0f}",
            "—" if extra is None or name.endswith("/none") else f"{extra:+,.0f}"]) + " |")
    lines += ["", f"Length control: best-subspan EM on the first {SHORT_ANSWER_WORDS} words of the answer's first "
              "line, and the median answer length (words)", "",
              "| attention/method | " + " | ".join(f"@{p}" for p in positions) + " | median words |",
              "|" + "---|" * (len(positions) + 2)]
    for name, t in table.items():
        short = t.get("em_first_words_by_position", {})
        lines.append(f"| {name} | " + " | ".join(em(short.get(p)) for p in positions) +
                     " | " + ("—" if t.get("median_answer_words") is None else f"{t['median_answer_words']:g}") + " |")
    nulls = [f"{name} {t['spread_null']['observed_points']:.1f} (n={t['spread_null']['n']}, null median {t['spread_null']['median_points']:.1f}, 95% "
             f"{t['spread_null']['p95_points']:.1f}, p {t['spread_null']['p_value']:.3f})"
             for name, t in table.items() if t.get("spread_null")]
    if nulls:
        lines += ["", "Spread vs a method with no position effect (each question's EM shuffled among the "
                  "positions, 1,000 times): " + "; ".join(nulls)]
    ranked = [f"{name}: " + ", ".join(f"@{p} {v['fraction']:.2f} (n={v['n']})"
                                      for p, v in t["gold_ranked_first"].items())
              for name, t in table.items() if t.get("gold_ranked_first")]
    if ranked:
        lines += ["", "Gold passage ranked first by calibrated relevance: " + "; ".join(ranked)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
