"""Record, or check, what `LongDocQA.ask` returns in every attention and debias mode: the guard of a refactor.

    python -m ldqa.eval.bench.api_snapshot record --model gemma3-270m --out docs/data/api-snapshot-gemma3-270m.json
    python -m ldqa.eval.bench.api_snapshot check docs/data/api-snapshot-gemma3-270m.json

Greedy decoding is deterministic, so a change that only moves code (a refactor of the attention
orchestration, the API or the loader) must give the same answers. For the bundled sample (ingested into a fresh temporary
store) and the first `--questions` of its questions, every combination of `MODES` is asked once, in a
fixed order (the KV block store warms up the same way each time), with one torch thread (reductions then
run in one order); per answer the snapshot keeps the text, the citations (n, chunk id, method, answer
span), the passages' chunk ids in prompt order, the settings (keys and values) and the timings' keys
(their values are times). `check` records again with the snapshot's own model, weights and questions and
prints every difference; it exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[2] / "app" / "sample"

# (attention, debias): every attention mode with no debiasing, and every debias method where it applies
MODES = [("full", "none"), ("block", "none"), ("block+recompute", "none"), ("retrieval", "none"),
         ("full", "calibrate"), ("full", "calibrate+reorder"), ("full", "sort"), ("full", "buckets"),
         ("block", "calibrate"), ("block", "calibrate+reorder"), ("block", "sort"),
         ("block+recompute", "calibrate+reorder")]


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def record(model: str, weights: str | None, n_questions: int, max_new_tokens: int = 24) -> dict:
    """The snapshot: {"model", "weights", "questions", "answers": [{attention, debias, question, text, ...}]}."""
    import torch

    from ldqa.app.api import LongDocQA

    questions = [json.loads(line)["question"] for line in open(SAMPLE / "questions.jsonl")][:n_questions]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            qa = LongDocQA(store=Path(tmp) / "store", model=model, weights=weights, max_new_tokens=max_new_tokens)
            qa.ingest([SAMPLE / "docs"])
            answers = []
            for attention, debias in MODES:
                for q in questions:
                    a = qa.ask(q, top_k=4, attention=attention, debias=debias)
                    answers.append({
                        "attention": attention, "debias": debias, "question": q, "text": a.text,
                        "citations": [[c.n, c.chunk_id, c.method, c.answer_start, c.answer_end] for c in a.citations],
                        "passages": [p.chunk_id for p in a.passages],
                        "settings": _jsonable(a.settings.to_dict()),
                        "timings_keys": sorted(a.timings.to_dict())})
            qa.store.close()
            return {"model": model, "weights": qa.weights, "max_new_tokens": max_new_tokens,
                    "questions": questions, "answers": answers}
    finally:
        torch.set_num_threads(threads)


def differences(old: dict, new: dict) -> list[str]:
    """Human-readable differences between two snapshots of the same model and questions ([] if equal)."""
    out = []
    if len(old["answers"]) != len(new["answers"]):
        out.append(f"{len(old['answers'])} answers recorded, {len(new['answers'])} now")
    for a, b in zip(old["answers"], new["answers"]):
        where = f"{a['attention']}/{a['debias']} {a['question'][:40]!r}"
        for key in ("text", "citations", "passages", "timings_keys"):
            if a[key] != b[key]:
                out.append(f"{where}: {key} {a[key]!r} -> {b[key]!r}")
        for k in sorted(set(a["settings"]) | set(b["settings"])):
            if a["settings"].get(k, "<absent>") != b["settings"].get(k, "<absent>"):
                out.append(f"{where}: settings[{k!r}] {a['settings'].get(k, '<absent>')!r} -> "
                           f"{b['settings'].get(k, '<absent>')!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ldqa.eval.bench.api_snapshot", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="ask every mode and write the snapshot")
    r.add_argument("--model", default="gemma3-270m", help="model name or path")
    r.add_argument("--weights", default=None, help="weight format (default: ldqa's default)")
    r.add_argument("--questions", type=int, default=2, help="how many of the sample's questions")
    r.add_argument("--out", required=True, help="snapshot file (.json)")
    c = sub.add_parser("check", help="record again and compare with a snapshot")
    c.add_argument("snapshot")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        snap = record(args.model, args.weights, args.questions)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(snap, indent=1, ensure_ascii=False) + "\n")
        print(f"{len(snap['answers'])} answers recorded in {args.out}")
        return 0
    old = json.loads(Path(args.snapshot).read_text())
    new = record(old["model"], old["weights"], len(old["questions"]), old["max_new_tokens"])
    diffs = differences(old, new)
    for d in diffs:
        print(d)
    print(f"{len(new['answers'])} answers compared: {len(diffs)} differences", file=sys.stderr)
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
