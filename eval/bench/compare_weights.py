"""Paired comparison of `ldqa eval` runs that differ in one setting (weight format, model, chat template).

    python -m ldqa.eval.bench.compare_weights [--mode full] [--ref-mode M]
        out/eval-weights-fp32 out/eval-weights-int8 [...]

The first directory is the reference; rows of the eval mode `full` are compared (`ldqa eval jsonl` with a
retriever writes `full@hybrid` and the like) (`--mode M` first to
pick another; `--ref-mode M` takes the reference's rows from another mode, e.g. a run's `block` rows
against its own `full` rows: `--mode block --ref-mode full DIR DIR`). For each other run: the examples both runs answered (same
`example_id`), the mean score of each (the benchmark's metric: best-subspan EM for nq-multidoc, LongBench's
F1 for jsonl), the paired difference (points) with its standard error, how many
predictions are word for word the reference's, the median TTFT and decode tokens/s of each, the token F1
of each (SQuAD's, which punishes padding that best-subspan EM rewards) with its paired difference, the
mean words per answer, and how many answers stopped at the token cap (rows with a `stop_reason`).
Where a question has several rows (nq-multidoc's gold positions pooled), its answers are not independent
(a reordering mode answers nearly the same at every position), so the standard error is also given
clustered by question (`record`; the cluster-robust estimator with the G / (G - 1) correction, equal to
the per-answer one when every question has one row), and the answers at the cap are also counted as
questions with any answer there.
Each argument is a run's directory (its `results.csv`, written by `ldqa eval`) or such a file itself,
plain or gzipped (`docs/data/weights-nq200/*.csv.gz` are the rows of docs/results.md's 200-question
runs), or several of them joined by commas, read as one run (a run extended with `ldqa eval --skip`).

nq-multidoc across gold positions: `--position P` compares the rows with the gold passage at P only,
and `--ref-position Q` pairs each with the reference's row of the same question (`record`) with the gold
passage at Q (default P), e.g. a mode's gold-first answers against full attention's gold-last ones:
`--mode block --position 1 --ref-mode full --ref-position 10 DIR DIR`.
"""

from __future__ import annotations

import csv
import gzip
import statistics
import sys
from pathlib import Path


def _rows(run: Path, mode: str, position: int | None = None) -> dict[str, dict]:
    """`run`'s rows of eval mode `mode` by example_id, or with `position` the rows with the gold passage
    there by question (`record`); `run` is a directory holding results.csv or a .csv / .csv.gz file, or
    several joined by commas. Raises FileNotFoundError naming a path that is no such file, ValueError
    when two of the files hold the same example or `position` is given for rows without gold positions."""
    rows, seen = {}, {}
    for part in str(run).split(","):
        path = Path(part) / "results.csv" if Path(part).is_dir() else Path(part)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no results.csv here; pass an `ldqa eval` output directory or its "
                                    "results.csv(.gz)")
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", newline="") as f:
            for r in csv.DictReader(f):
                if r["mode"] != mode:
                    continue
                if seen.get(r["example_id"], path) != path:
                    raise ValueError(f"{seen[r['example_id']]} and {path} both hold {mode} row {r['example_id']}; "
                                     "join runs of different questions only")
                seen[r["example_id"]] = path
                rows[r["example_id"]] = r
    if position is None:
        return rows
    if any(not r.get("gold_position") or not r.get("record") for r in rows.values()):
        raise ValueError(f"{run}: --position needs nq-multidoc rows (gold_position and record columns)")
    return {r["record"]: r for r in rows.values() if int(r["gold_position"]) == position}


def clustered_se(d: list[float], groups: list) -> float:
    """Standard error of the mean of `d` with the observations clustered by `groups` (one label per
    observation): sqrt(G / (G - 1) * sum over clusters of (sum of d - mean)^2) / n, G clusters (the
    cluster-robust CR1 estimator, Cameron & Miller 2015, sec. 2.3); with every cluster of one observation it
    is the usual stdev / sqrt(n). Raises ValueError for fewer than 2 clusters or mismatched lengths."""
    if len(d) != len(groups):
        raise ValueError(f"clustered_se: {len(d)} values for {len(groups)} cluster labels")
    mean = statistics.fmean(d)
    sums: dict = {}
    for x, g in zip(d, groups):
        sums[g] = sums.get(g, 0.0) + (x - mean)
    G = len(sums)
    if G < 2:
        raise ValueError("clustered_se: needs at least 2 clusters")
    return (G / (G - 1) * sum(v * v for v in sums.values())) ** 0.5 / len(d)


def compare(ref_dir: Path, other_dir: Path, mode: str = "full", ref_mode: str | None = None,
            position: int | None = None, ref_position: int | None = None) -> dict:
    """Paired statistics of `other_dir`'s rows of eval mode `mode` against `ref_dir`'s rows of `ref_mode`
    (default: `mode`), paired by example_id, or with `position` by question between the rows with the
    gold passage at `position` and the reference's at `ref_position` (default `position`) (see the module
    docstring). Raises ValueError when they share fewer than 2 examples, or as `_rows`."""
    if ref_position is not None and position is None:
        raise ValueError("ref_position needs position: the gold position of the compared rows")
    a = _rows(ref_dir, ref_mode or mode, ref_position or position)
    b = _rows(other_dir, mode, position)
    ids = sorted(set(a) & set(b))
    if len(ids) < 2:
        raise ValueError(f"{ref_dir} and {other_dir} share {len(ids)} examples; at least 2 are needed")
    from ldqa.eval.metrics import token_f1

    d = [float(b[i]["score"]) - float(a[i]["score"]) for i in ids]
    def med(rows, k):  # median over the rows that have a value (an abstained jsonl row has no TTFT)
        vals = [float(rows[i][k]) for i in ids if rows[i].get(k) not in (None, "")]
        return statistics.median(vals) if vals else float("nan")

    has_answers = all("answers" in r[i] for r in (a, b) for i in ids)
    for run, rows in ((ref_dir, a), (other_dir, b)):
        listed = next((i for i in ids if has_answers and rows[i]["answers"].startswith("['")), None)
        if listed is not None:
            raise ValueError(f"{run}: row {listed} lists its answers as {rows[listed]['answers'][:40]!r}; token F1 "
                             "needs them ' | '-joined, as `ldqa eval` writes results.csv")
    f1 = {n: [token_f1(r[i]["prediction"], r[i]["answers"].split(" | ")) if has_answers else 0.0 for i in ids]
          for n, r in (("a", a), ("b", b))}
    df = [y - x for x, y in zip(f1["a"], f1["b"])]
    words = lambda rows: statistics.fmean(len(rows[i]["prediction"].split()) for i in ids)  # noqa: E731
    capped = lambda rows: (sum(rows[i].get("stop_reason") == "max_new_tokens" for i in ids)  # noqa: E731
                           if all(rows[i].get("stop_reason") for i in ids) else None)
    records = [b[i].get("record") or None for i in ids]
    pooled = all(records) and len(set(records)) < len(records)  # some question answered more than once
    capped_q = lambda rows: (len({rows[i]["record"] for i in ids  # noqa: E731
                                  if rows[i].get("stop_reason") == "max_new_tokens"})
                             if pooled and capped(rows) is not None else None)
    f1_stats = {"ref_f1": statistics.fmean(f1["a"]), "f1": statistics.fmean(f1["b"]),
                "f1_diff_points": 100 * statistics.fmean(df),
                "f1_se_points": 100 * statistics.stdev(df) / len(df) ** 0.5} if has_answers else \
        dict.fromkeys(("ref_f1", "f1", "f1_diff_points", "f1_se_points"))
    return {**f1_stats,
            "ref_words": words(a), "words": words(b), "ref_at_cap": capped(a), "at_cap": capped(b),
            **{"run": str(other_dir), "n": len(ids), "ref_score": statistics.fmean(float(a[i]["score"]) for i in ids),
            "score": statistics.fmean(float(b[i]["score"]) for i in ids),
            "diff_points": 100 * statistics.fmean(d), "se_points": 100 * statistics.stdev(d) / len(d) ** 0.5,
            "se_points_by_question": 100 * clustered_se(d, records) if pooled else None,
            "questions": len(set(records)) if all(records) else None,
            "ref_questions_at_cap": capped_q(a), "questions_at_cap": capped_q(b),
            "identical_predictions": sum(a[i]["prediction"].strip() == b[i]["prediction"].strip() for i in ids),
            "ref_ttft_ms": med(a, "ttft_ms"), "ttft_ms": med(b, "ttft_ms"),
            "ref_tokens_per_s": med(a, "tokens_per_s"), "tokens_per_s": med(b, "tokens_per_s")}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = {"--mode": "full", "--ref-mode": None, "--position": None, "--ref-position": None}
    while argv[:1] and argv[0] in opts and len(argv) > 1:
        opts[argv[0]] = argv[1]
        argv = argv[2:]
    mode, ref_mode = opts["--mode"], opts["--ref-mode"]
    try:
        position, ref_position = (None if opts[k] is None else int(opts[k]) for k in ("--position", "--ref-position"))
    except ValueError:
        print(f"--position / --ref-position: a gold position (1-based), got {opts['--position']!r} / "
              f"{opts['--ref-position']!r}", file=sys.stderr)
        return 2
    if len(argv) < 2 or (ref_position is not None and position is None):
        print(__doc__, file=sys.stderr)
        return 2
    ref = Path(argv[0])
    where = lambda p: "" if p is None else f", gold at {p}"  # noqa: E731
    print(f"reference: {ref} ({ref_mode or mode} rows{where(ref_position or position)}), compared: {mode} rows"
          f"{where(position)}")
    print("| run | n | reference score | score | paired diff (points) | SE (by question) | identical | "
          "TTFT ms ref -> run | tok/s ref -> run | F1 ref -> run | F1 diff (SE) | words ref -> run | "
          "at cap ref -> run (questions) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for o in argv[1:]:
        c = compare(ref, Path(o), mode, ref_mode, position, ref_position)
        by_q = c["se_points_by_question"] is not None
        print(f"| {o} | {c['n']} | {c['ref_score']:.3f} | {c['score']:.3f} | {c['diff_points']:+.1f} | "
              f"{c['se_points']:.1f}" + (f" ({c['se_points_by_question']:.1f})" if by_q else "") + " | "
              f"{c['identical_predictions']}/{c['n']} | {c['ref_ttft_ms']:.0f} -> "
              f"{c['ttft_ms']:.0f} | {c['ref_tokens_per_s']:.1f} -> {c['tokens_per_s']:.1f} | "
              + (f"{c['ref_f1']:.3f} -> {c['f1']:.3f} | {c['f1_diff_points']:+.1f} ({c['f1_se_points']:.1f}) | "
                 if c["f1"] is not None else "- | - | ") +
              f"{c['ref_words']:.1f} -> {c['words']:.1f} | {_n(c['ref_at_cap'])} -> {_n(c['at_cap'])}"
              + (f" ({_n(c['ref_questions_at_cap'])} -> {_n(c['questions_at_cap'])})" if by_q else "") + " |")
    return 0


def _n(v) -> str:
    return "-" if v is None else str(v)


if __name__ == "__main__":
    raise SystemExit(main())
