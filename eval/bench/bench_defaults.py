"""The defaults study (docs/defaults.md): which attention mode and debias method ldqa should answer with when the
user names none, chosen by measurement (accuracy first, then time to answer).

Every configuration in `CONFIGS` (attention/debias) is run through the eval harness (`ldqa.eval.harness`,
the public `LongDocQA` API, the same rows ``ldqa eval`` writes and resumes) on these parts:

nq10, nq20
    NQ-open multi-doc ("Lost in the Middle", Liu et al. 2023): ``--n10`` / ``--n20`` seeded questions, 10 /
    20 passages (the gold one and other questions' gold passages holding no answer string), the gold
    passage at each of ``--positions10`` / ``--positions20``; best-subspan EM. The passages are given,
    so the whole prompt is the passages (no retrieval): the position control.
pg5, pg10
    The LongBench-format file of our own questions over Paul Graham's essays (`ldqa.eval.pg_essays`, 45
    questions, 9 essays; built from ``--essays`` into ``OUT/pg-essays-longbench.jsonl``): each essay is
    its own collection (ldqa's chunker, embedder and store) and the question is answered by
    `LongDocQA.ask` over the hybrid retriever's top 5 / top 10 chunks, abstention included: the way ldqa
    is used. Token F1 (LongBench's qa_f1_score) and best-subspan EM; TTFT cold (a freshly built
    collection, no KV block stored) and warm (the same question again, blocks stored).
session
    What a user meets: one collection of the 9 essays ingested once, then, per configuration, its KV
    block store emptied and ``--session-questions`` seeded questions of the pg file asked one after the
    other with `LongDocQA.ask` (hybrid, top 5). Block configurations run twice: without precomputed KV
    blocks (the first questions encode their passages) and after `LongDocQA.precompute_kv` (what
    ``ldqa ingest`` would do), whose time and disk are reported per 1K tokens. The debias bias curve is
    computed before the clock (it is cached on disk once per model, passage count and mode).

Then `summary` compares every configuration with full/none (ldqa's default until this study) question
by question (paired differences, SE) and applies the rule `choose` states: the best mean paired gain over
the accuracy parts; among configurations whose gain is within one SE of it, the fastest 10-question
session. Writes ``OUT/results-defaults.json`` and ``OUT/summary-defaults.md``.

    OMP_NUM_THREADS=1 python -m ldqa.eval.bench.bench_defaults --parts pg5,pg10 --out out/bench-defaults &
    OMP_NUM_THREADS=1 python -m ldqa.eval.bench.bench_defaults --parts nq10,session,nq20 --out out/bench-defaults
    python -m ldqa.eval.bench.bench_defaults --summary-only --out out/bench-defaults

Needs ``../shared/data`` (NQ-open oracle file, the essays); the product never does.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

from ldqa.eval.harness import _median  # median of the values that are not None

CONFIGS = ("full/none", "full/calibrate", "block/none", "block/calibrate+reorder",
           "block+recompute/calibrate+reorder")
BASELINE = "full/none"
PARTS = ("nq10", "nq20", "pg5", "pg10", "session")
ACCURACY_PARTS = ("nq10", "nq20", "pg5", "pg10")
DEFAULT_NQ = Path("../shared/data/nq-open-oracle.jsonl.gz")
DEFAULT_ESSAYS = Path("../shared/data/pg-essays")
SESSION_TOP_K = 5


def part_config(part: str, args):
    """The harness `EvalConfig` of accuracy part `part` (one of `ACCURACY_PARTS`)."""
    from ldqa.eval.harness import EvalConfig

    common = dict(out=str(args.out / part), modes=",".join(args.configs), model=args.model, weights=args.weights,
                  seed=args.seed, progress=not args.no_progress)
    if part in ("nq10", "nq20"):
        k = 10 if part == "nq10" else 20
        return EvalConfig("nq-multidoc", str(args.nq), n_passages=k, limit=args.n10 if k == 10 else args.n20,
                          gold_positions=args.positions10 if k == 10 else args.positions20, **common)
    return EvalConfig("jsonl", str(pg_file(args)), retriever="hybrid", top_k=5 if part == "pg5" else 10,
                      limit=args.pg_limit, **common)


def pg_file(args) -> Path:
    """The LongBench-format pg-essays file under --out, built from --essays on first use."""
    from ldqa.eval.pg_essays import write_longbench

    path = args.out / "pg-essays-longbench.jsonl"
    if not path.exists():
        write_longbench(path, args.essays)
    return path


def run_part(part: str, args) -> None:
    """Answer every missing row of `part` (resumable: the harness's prediction cache)."""
    from ldqa.eval.harness import run

    t0 = time.perf_counter()
    run(part_config(part, args))
    print(f"bench_defaults: {part} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


# ------------------------------------------------------------------------------------------- session

def run_session(args) -> dict:
    """The 10-question session of every configuration over one collection of the pg essays; rows to
    ``OUT/session/session.json`` (each configuration's questions appended as it finishes, so a rerun
    skips finished ones). Returns the session result."""
    from ldqa.app.api import LongDocQA
    from ldqa.eval.metrics import best_subspan_em, token_f1
    from ldqa.eval.pg_essays import load_questions

    root = args.out / "session"
    root.mkdir(parents=True, exist_ok=True)
    path = root / "session.json"
    result = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    questions = load_questions()
    essays = sorted({q["essay"] for q in questions})
    qs = random.Random(args.seed).sample(questions, args.session_questions)
    docs = [args.essays / e for e in essays]
    qa = LongDocQA(store=root / "store", model=args.model, weights=args.weights)
    qa.warm_up()
    if "ingest" not in result:
        t0 = time.perf_counter()
        report = qa.ingest(docs)
        bad = [f for f in report.files if f.status == "error"]
        if bad:
            raise SystemExit(f"bench_defaults: session: {bad[0].path}: {bad[0].reason}")
        rows = qa.store.get_chunks(qa.store.chunk_ids(None))
        result["ingest"] = {"files": len(docs), "chunks": len(rows), "ms": (time.perf_counter() - t0) * 1000,
                            "chunk_tokens": sum(qa.tokenizer.count(r["text"]) for r in rows)}
    result |= {"questions": [q["id"] for q in qs], "top_k": SESSION_TOP_K, "model": qa.model_name,
               "weights": qa.weights}
    runs = [(c, False) for c in args.configs] + [(c, True) for c in args.configs if c.startswith("block")]
    for config, precompute in runs:
        name = config + (" +precomputed" if precompute else "")
        if name in result["runs"]:
            continue
        attention, debias = config.split("/")
        if debias.startswith("calibrate"):  # cached on disk once per model, k and mode: not a session cost
            t0 = time.perf_counter()
            qa.bias_curve(SESSION_TOP_K, attention)
            bias_ms = (time.perf_counter() - t0) * 1000
        else:
            bias_ms = 0.0
        pre_key = "precompute" if attention == "block" else f"precompute {attention}"  # block modes' own blocks
        if not (precompute and pre_key in result):  # the precomputed runs of a mode share one precomputation
            qa.kv_store.clear()
        qa.prefill_memo.clear()
        if attention.startswith("block"):
            qa.block_runtime  # noqa: B018  (the RoPE self-check, done once per LongDocQA, before the clock)
        run = {"config": config, "precomputed": precompute, "bias_curve_ms": bias_ms, "questions": []}
        if precompute:
            if pre_key not in result:  # what `ldqa ingest --precompute-kv` adds: timed once per mode
                pre = qa.precompute_kv(attention=attention)
                kv = qa.kv_store.stats
                result[pre_key] = {"blocks": pre["blocks"], "computed": pre["computed"], "ms": pre["ms"],
                                   "kv_disk_bytes": _dir_bytes(qa.store.path / "kv"),
                                   "kv_payload_bytes": kv.bytes_on_disk, "kv_entries": kv.entries_on_disk}
            else:
                qa.precompute_kv(attention=attention)  # a resumed run: every block is stored already
            run["precompute"] = result[pre_key]
        t_session = time.perf_counter()
        for q in qs:
            t0 = time.perf_counter()
            ans = qa.ask(q["question"], top_k=SESSION_TOP_K, attention=attention, debias=debias)
            wall = (time.perf_counter() - t0) * 1000
            run["questions"].append({"id": q["id"], "prediction": ans.text, "answers": q["answers"],
                                     "f1": token_f1(ans.text, q["answers"]),
                                     "em": best_subspan_em(ans.text, q["answers"]),
                                     "abstained": bool(ans.settings.get("abstained")),
                                     "ttft_ms": ans.timings.get("ttft_ms"), "wall_ms": wall,
                                     "kv_misses": ans.timings.get("kv_misses", 0),
                                     "generated_tokens": ans.timings.get("generated_tokens")})
        run["answers_ms"] = sum(q["wall_ms"] for q in run["questions"])
        # the session: the questions, plus precomputing the blocks when the run relies on them
        run["session_ms"] = (time.perf_counter() - t_session) * 1000 + run.get("precompute", {}).get("ms", 0.0)
        result["runs"][name] = run
        path.write_text(json.dumps(result, indent=1))
        print(f"bench_defaults: session {name}: {run['session_ms'] / 1000:.1f} s", file=sys.stderr)
    qa.store.close()
    qa.kv_store.close()
    return result


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------- summary

def config_of(label: str) -> str:
    """The attention/debias item of a harness mode label ("full@hybrid" -> "full/none")."""
    label = label.split("@")[0]
    return label if "/" in label else label + "/none"


def _rows(out: Path, part: str) -> list[dict] | None:
    """The part's answered rows, each "mode" rewritten as its `config_of`: read from the harness's
    prediction cache, so a part stopped halfway is summarized with what it has (its results.json is only
    written when the run ends). Rows of one settings hash: the one with the most rows, if a part's
    directory holds several (another model, seed, ...; a warning names the count left out)."""
    import sqlite3

    path = out / part / "predictions.sqlite"
    if not path.exists():
        return None
    db = sqlite3.connect(str(path))
    try:
        counts = db.execute("SELECT config, count(*) FROM predictions GROUP BY config ORDER BY 2 DESC").fetchall()
        if not counts:
            return None
        if len(counts) > 1:
            print(f"bench_defaults: {path}: rows of {len(counts)} settings; summarizing the {counts[0][1]} of "
                  f"the largest, leaving out {sum(c for _, c in counts[1:])}", file=sys.stderr)
        rows = [json.loads(r) for (r,) in db.execute("SELECT row FROM predictions WHERE config=? "
                                                     "ORDER BY created_at", (counts[0][0],))]
    finally:
        db.close()
    return [r | {"mode": config_of(r["mode"])} for r in rows]


def paired(rows: list[dict], a: str, b: str, key) -> dict | None:
    """Mean and SE of key(row of a) - key(row of b) over the examples both answered (no error rows)."""
    by = {}
    for r in rows:
        if not r.get("error") and r.get("score") is not None:
            by.setdefault(r["example_id"], {})[r["mode"]] = r
    d = [key(m[a]) - key(m[b]) for m in by.values() if a in m and b in m]
    if len(d) < 2:
        return None
    return {"n": len(d), "mean": statistics.mean(d), "se": statistics.stdev(d) / math.sqrt(len(d))}


def _em(r: dict) -> float:
    from ldqa.eval.metrics import best_subspan_em

    return best_subspan_em(r["prediction"], r["answers"])


def part_summary(rows: list[dict], configs, part: str) -> dict:
    """Per configuration: n, accuracy (the benchmark's score), best-subspan EM, paired differences vs
    BASELINE, median TTFT (cold/warm for pg), by-position accuracy (nq), answers at the token cap."""
    out = {}
    for c in configs:
        rs = [r for r in rows if r["mode"] == c and not r.get("error")]
        if not rs:
            continue
        s = {"n": len(rs), "accuracy": statistics.mean(r["score"] for r in rs),
             "em": statistics.mean(_em(r) for r in rs),
             "ttft_ms": _median(r.get("ttft_ms") for r in rs),
             "total_ms": _median(r.get("total_ms") for r in rs),
             "answer_s_sum": sum(r.get("total_ms") or 0 for r in rs) / 1000,
             "vs_baseline": paired(rows, c, BASELINE, lambda r: r["score"]) if c != BASELINE else None,
             "em_vs_baseline": paired(rows, c, BASELINE, _em) if c != BASELINE else None}
        if part.startswith("nq"):
            pos = sorted({r["gold_position"] for r in rs})
            s["by_position"] = {p: statistics.mean(r["score"] for r in rs if r["gold_position"] == p) for p in pos}
            s["spread"] = max(s["by_position"].values()) - min(s["by_position"].values())
        else:
            s |= {"ttft_cold_ms": _median(r.get("ttft_cold_ms") for r in rs),
                  "ttft_warm_ms": _median(r.get("ttft_warm_ms") for r in rs),
                  "gold_in_retrieved": statistics.mean(r["gold_in_retrieved"] for r in rs),
                  "abstained": sum(bool(r.get("abstained")) for r in rs),
                  "at_cap": sum((r.get("generated_tokens") or 0) >= 64 for r in rs)}
        out[c] = s
    return out


def session_summary(session: dict) -> dict:
    out = {}
    for name, run in session.get("runs", {}).items():
        qs = run["questions"]
        s = {"config": run["config"], "precomputed": run["precomputed"], "session_s": run["session_ms"] / 1000,
             "answers_s": run["answers_ms"] / 1000,
             "first_ttft_ms": qs[0]["ttft_ms"], "median_ttft_ms": _median(q["ttft_ms"] for q in qs),
             "median_answer_ms": _median(q["wall_ms"] for q in qs), "f1": statistics.mean(q["f1"] for q in qs),
             "em": statistics.mean(q["em"] for q in qs), "bias_curve_ms": run["bias_curve_ms"]}
        if "precompute" in run:
            p, tokens = run["precompute"], session["ingest"]["chunk_tokens"]
            s |= {"precompute_s": p["ms"] / 1000, "precompute_ms_per_1k_tokens": p["ms"] / tokens * 1000,
                  "kv_disk_mb": p["kv_disk_bytes"] / 1e6,
                  "kv_disk_mb_per_1k_tokens": p["kv_disk_bytes"] / 1e6 / tokens * 1000}
        out[name] = s
    return out


def choose(parts: dict, sessions: dict, configs) -> dict:
    """The rule: accuracy first, then time to answer. Gain = the mean over the accuracy parts present of
    each configuration's paired score difference vs BASELINE (BASELINE: 0), SE = sqrt(sum SE^2) / parts.
    Eligible: no part where the configuration is worse than the baseline by more than 2 SE. Candidates:
    eligible, with gain >= the best eligible gain - that one's SE. Among candidates, the least time answering the session's questions (block
    configurations: the better of with/without precomputed blocks; precomputing is an ingest cost, reported
    apart); without session rows, the lowest median total_ms."""
    names = [p for p in ACCURACY_PARTS if p in parts]
    gains = {}
    for c in configs:
        ds = [parts[p][c]["vs_baseline"] if c != BASELINE else {"mean": 0.0, "se": 0.0} for p in names
              if c in parts[p]]
        if len(ds) != len(names) or any(d is None for d in ds):
            continue
        worse = [p for p, d in zip(names, ds) if d["mean"] < -2 * d["se"] and d["se"] > 0]
        gains[c] = {"gain": statistics.mean(d["mean"] for d in ds),
                    "se": math.sqrt(sum(d["se"] ** 2 for d in ds)) / len(ds), "worse_in": worse}
    if not gains:
        return {"parts": names, "gains": {}, "choice": None}
    eligible = [c for c in gains if not gains[c]["worse_in"]] or list(gains)
    best = max(eligible, key=lambda c: gains[c]["gain"])
    floor = gains[best]["gain"] - gains[best]["se"]
    cands = [c for c in eligible if gains[c]["gain"] >= floor]

    def time_of(c):
        ss = [s["answers_s"] for s in sessions.values() if s["config"] == c]
        if ss:
            return min(ss)
        return statistics.mean(parts[p][c]["total_ms"] or 0 for p in names)

    choice = min(cands, key=time_of)
    return {"parts": names, "gains": gains, "best_accuracy": best, "candidates": cands, "choice": choice,
            "time_s_of_candidates": {c: time_of(c) for c in cands}}


def summary(args) -> dict:
    parts = {}
    for p in ACCURACY_PARTS:
        rows = _rows(args.out, p)
        t = part_summary(rows, args.configs, p) if rows else None
        if t:
            parts[p] = t
    spath = args.out / "session" / "session.json"
    session = json.loads(spath.read_text()) if spath.exists() else {}
    sessions = session_summary(session) if session else {}
    result = {"configs": list(args.configs), "baseline": BASELINE, "parts": parts, "session": sessions,
              "session_ingest": session.get("ingest"), "choice": choose(parts, sessions, args.configs)}
    (args.out / "results-defaults.json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    (args.out / "summary-defaults.md").write_text(md)
    print(md)
    return result


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def _d(d):
    return "-" if d is None else f"{d['mean'] * 100:+.1f} ({d['se'] * 100:.1f})"


def markdown(result: dict) -> str:
    lines = []
    for p, t in result["parts"].items():
        nq = p.startswith("nq")
        first = next(iter(t.values()))
        pos = list(first.get("by_position", {}))
        head = ["config", "n", "EM" if nq else "F1", "vs full/none (SE)"] + \
            ([f"@{q}" for q in pos] + ["spread"] if nq else ["best-subspan EM", "EM vs full/none", "gold in retrieved",
                                                           "abstained", "at 64-token cap", "TTFT cold ms",
                                                           "TTFT warm ms", "median total ms"])
        lines += [f"### {p}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c, s in t.items():
            cells = [c, str(s["n"]), _f(s["accuracy"]), _d(s["vs_baseline"])]
            if nq:
                cells += [_f(s["by_position"][q]) for q in pos] + [_f(s["spread"] * 100, "{:.1f}")]
            else:
                cells += [_f(s["em"]), _d(s["em_vs_baseline"]), _f(s["gold_in_retrieved"]), str(s["abstained"]),
                          str(s["at_cap"]), _f(s["ttft_cold_ms"], "{:,.0f}"), _f(s["ttft_warm_ms"], "{:,.0f}"),
                          _f(s["total_ms"], "{:,.0f}")]
            lines.append("| " + " | ".join(cells) + " |")
        if nq:  # the configurations of one prompt share its exact prefill (PrefillMemo): no time column
            lines += ["", "(No times: the configurations answer each prompt one after the other and reuse its exact "
                      "prefill and stored blocks, so their times are not comparable here; see the pg parts and the "
                      "session.)"]
        lines.append("")
    if result["session"]:
        ing = result["session_ingest"]
        lines += ["### session (one collection, questions asked one after the other, hybrid top 5)", "",
                  f"Collection: {ing['files']} essays, {ing['chunks']} chunks, {ing['chunk_tokens']:,} chunk tokens, "
                  f"ingested in {ing['ms'] / 1000:.1f} s.", "",
                  "| config | precomputed KV | answering s | session s (+ precompute) | first TTFT ms | median TTFT ms | median answer ms | F1 | EM | "
                  "precompute s | ms per 1K tokens | KV disk MB | MB per 1K tokens |", "|" + "---|" * 13]
        for name, s in result["session"].items():
            lines.append("| " + " | ".join([s["config"], "yes" if s["precomputed"] else "no", _f(s["answers_s"], "{:.1f}"),
                                            _f(s["session_s"], "{:.1f}"),
                                            _f(s["first_ttft_ms"], "{:,.0f}"), _f(s["median_ttft_ms"], "{:,.0f}"),
                                            _f(s["median_answer_ms"], "{:,.0f}"), _f(s["f1"]), _f(s["em"]),
                                            _f(s.get("precompute_s"), "{:.1f}"),
                                            _f(s.get("precompute_ms_per_1k_tokens"), "{:,.0f}"),
                                            _f(s.get("kv_disk_mb"), "{:.1f}"),
                                            _f(s.get("kv_disk_mb_per_1k_tokens"), "{:.2f}")]) + " |")
        lines.append("")
    ch = result["choice"]
    if ch.get("gains"):
        lines += [f"### choice (parts: {', '.join(ch['parts'])})", "",
                  "| config | mean paired gain vs full/none (points) | SE | worse than full/none in |", "|---|---|---|---|"]
        for c, g in ch["gains"].items():
            lines.append(f"| {c} | {g['gain'] * 100:+.1f} | {g['se'] * 100:.1f} | {', '.join(g['worse_in']) or '-'} |")
        lines += ["", f"Best accuracy: {ch['best_accuracy']}; candidates within its SE: {', '.join(ch['candidates'])}; "
                      f"fastest of them: **{ch['choice']}**.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/bench-defaults"))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {', '.join(PARTS)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated attention/debias items")
    ap.add_argument("--nq", type=Path, default=DEFAULT_NQ, help="NQ-open oracle file")
    ap.add_argument("--essays", type=Path, default=DEFAULT_ESSAYS, help="folder of the essays' .txt files")
    ap.add_argument("--n10", type=int, default=30, help="nq10: questions")
    ap.add_argument("--n20", type=int, default=16, help="nq20: questions")
    ap.add_argument("--positions10", default="1,5,10")
    ap.add_argument("--positions20", default="1,10,20")
    ap.add_argument("--pg-limit", type=int, default=None, help="pg5, pg10: questions (default: all 45)")
    ap.add_argument("--session-questions", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--summary-only", action="store_true", help="answer nothing; summarize the rows under --out")
    args = ap.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if BASELINE not in args.configs:
        ap.error(f"--configs must include the baseline {BASELINE}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {', '.join(bad)}; choose from {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        for p in parts:
            if p == "session":
                run_session(args)
            else:
                run_part(p, args)
    summary(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
