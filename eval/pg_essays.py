"""A LongBench-style QA set over public long documents: questions of our own on Paul Graham's essays.

The questions live in ``eval/data/pg-essays-qa.jsonl`` (installed with the package as
``ldqa/eval/data/``): one record per question, ``{"id", "essay", "question", "answers", "evidence"}``,
``essay`` a file name in the essay folder and ``evidence`` the sentence (or the part of it) of that essay
that answers the question; every answer occurs verbatim in its evidence and the evidence verbatim in the
essay, white space folded (`check_item`, tests/test_pg_essays_qa.py). The essays themselves are not in
the repository: they are the test input of ``../shared/data/pg-essays`` (MIT-licensed repository
gkamradt/LLMTest_NeedleInAHaystack), read when the benchmark file is built, so the product never needs
them.

How the questions were made (45 questions, 9 essays: apple, avg, boss, gh, laundry, siliconvalley,
submarine, superangels, web20, 5 each; the longer essays, 2.1K-5.2K words, so that a whole essay is a long
context): for each essay we listed its sentences that state a checkable fact (a number, a name, a date, a
short phrase), wrote a question in our own words whose answer is a short span of that sentence, copied the
span as the answer and the sentence as the evidence, and checked both with grep against the essay text
(and with `check_item` for all of them). Questions were picked to have one answer in their essay (e.g. not
"how many" for a number the essay gives twice for different things); no question was chosen or dropped
after seeing a model's answer.

    python -m ldqa.eval.pg_essays --essays ../shared/data/pg-essays --out out/pg-essays-longbench.jsonl
    ldqa eval jsonl --data out/pg-essays-longbench.jsonl ...

writes LongBench-format records (``_id, input, answers, context, length, all_classes`` plus ``essay`` and
``evidence``): ``context`` is the whole essay, ``length`` its word count (LongBench counts words too).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

QA_PATH = Path(__file__).resolve().parent / "data" / "pg-essays-qa.jsonl"
FIELDS = ("id", "essay", "question", "answers", "evidence")


def fold(text: str) -> str:
    """`text` with every run of white space made one space, stripped (the essays break lines mid-sentence
    and sometimes lose the space after a paragraph's full stop)."""
    return re.sub(r"\s+", " ", text).strip()


def load_questions(path: str | Path = QA_PATH) -> list[dict]:
    """The question records of `path` (JSON lines with `FIELDS`), in file order.

    Raises
    ------
    ValueError naming the file and line of a record that misses a field, has an empty question or
    answers, or repeats an id.
    """
    out, seen = [], set()
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        r = json.loads(line)
        missing = [f for f in FIELDS if not r.get(f)]
        if missing or not all(isinstance(a, str) and a.strip() for a in r["answers"]):
            raise ValueError(f"{path}, line {n}: needs non-empty {', '.join(FIELDS)} (missing or empty: "
                             f"{', '.join(missing) or 'an answer'})")
        if r["id"] in seen:
            raise ValueError(f"{path}, line {n}: id {r['id']!r} repeats an earlier record")
        seen.add(r["id"])
        out.append(r)
    return out


def check_item(item: dict, essay_text: str) -> list[str]:
    """What is wrong with question record `item` against its essay's text (empty when nothing): its
    evidence must occur in the essay and each answer in its evidence, white space folded (`fold`)."""
    text, evidence = fold(essay_text), fold(item["evidence"])
    problems = [] if evidence in text else [f"{item['id']}: evidence not found in {item['essay']}"]
    return problems + [f"{item['id']}: answer {a!r} not in its evidence" for a in item["answers"]
                       if fold(a) not in evidence]


def build_items(essays: str | Path, path: str | Path = QA_PATH) -> list[dict]:
    """LongBench-format records for the questions of `path`, each with its whole essay (read from the
    folder `essays`) as ``context``.

    Raises
    ------
    FileNotFoundError naming the essay file (and the folder) when one is missing.
    ValueError when a record is malformed (`load_questions`) or fails `check_item`.
    """
    essays = Path(essays)
    texts: dict[str, str] = {}
    out = []
    for q in load_questions(path):
        if q["essay"] not in texts:
            f = essays / q["essay"]
            if not f.is_file():
                raise FileNotFoundError(f"{f}: essay of question {q['id']} not found (--essays {essays}: the "
                                        "folder of Paul Graham's essays, ../shared/data/pg-essays)")
            texts[q["essay"]] = f.read_text(encoding="utf-8")
        text = texts[q["essay"]]
        problems = check_item(q, text)
        if problems:
            raise ValueError("; ".join(problems))
        out.append({"_id": q["id"], "input": q["question"], "answers": list(q["answers"]), "context": text,
                    "length": len(text.split()), "all_classes": None, "essay": q["essay"],
                    "evidence": q["evidence"]})
    return out


def write_longbench(out: str | Path, essays: str | Path, path: str | Path = QA_PATH) -> Path:
    """Write `build_items(essays, path)` as JSON lines to `out` (parent folders created); returns `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    items = build_items(essays, path)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ldqa.eval.pg_essays", description=__doc__.split("\n")[0])
    p.add_argument("--essays", default="../shared/data/pg-essays", help="folder of the essays' .txt files")
    p.add_argument("--questions", default=str(QA_PATH), help="question file (JSON lines)")
    p.add_argument("--out", default="out/pg-essays-longbench.jsonl", help="LongBench-format file to write")
    args = p.parse_args(argv)
    path = write_longbench(args.out, args.essays, args.questions)
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    print(f"{path}: {len(items)} questions over {len({r['essay'] for r in items})} essays "
          f"({min(r['length'] for r in items)}-{max(r['length'] for r in items)} words each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
