"""The LongBench-style question set over Paul Graham's essays (ldqa.eval.pg_essays): every answer is in its
evidence and every evidence in its essay (../shared/data/pg-essays), and the builder writes LongBench
records the jsonl benchmark reads."""

from __future__ import annotations

import json

import pytest

from ldqa.eval import pg_essays


def test_question_file_shape():
    qs = pg_essays.load_questions()
    assert len(qs) >= 40 and len({q["essay"] for q in qs}) >= 8
    assert len({q["id"] for q in qs}) == len(qs)
    for q in qs:  # short answers, each inside its evidence (the essay check needs the shared data, below)
        assert all(len(a.split()) <= 5 for a in q["answers"]), q["id"]
        assert all(pg_essays.fold(a) in pg_essays.fold(q["evidence"]) for a in q["answers"]), q["id"]


def test_every_answer_and_evidence_is_in_its_essay(shared_data):
    essays = shared_data / "pg-essays"
    problems = []
    for q in pg_essays.load_questions():
        problems += pg_essays.check_item(q, (essays / q["essay"]).read_text(encoding="utf-8"))
    assert problems == []


def test_check_item_catches_a_wrong_record():
    essay = "It was a picture of an AS400,\nand the headline read"
    good = {"id": "x", "essay": "e.txt", "answers": ["an AS400"], "evidence": "a picture of an AS400, and the"}
    assert pg_essays.check_item(good, essay) == []  # the line break in the essay is folded
    bad = good | {"answers": ["AS/400"], "evidence": "a photo of an AS400"}
    assert pg_essays.check_item(bad, essay) == ["x: evidence not found in e.txt",
                                                "x: answer 'AS/400' not in its evidence"]


def test_load_questions_names_the_bad_line(tmp_path):
    path = tmp_path / "q.jsonl"
    rec = {"id": "a", "essay": "e.txt", "question": "Q?", "answers": ["x"], "evidence": "x"}
    path.write_text(json.dumps(rec) + "\n" + json.dumps(rec | {"answers": []}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: needs non-empty .*answers"):
        pg_essays.load_questions(path)
    path.write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="line 2: id 'a' repeats"):
        pg_essays.load_questions(path)


def test_builder_writes_longbench_records(shared_data, tmp_path):
    out = tmp_path / "pg.jsonl"
    assert pg_essays.main(["--essays", str(shared_data / "pg-essays"), "--out", str(out)]) == 0
    items = [json.loads(line) for line in out.read_text().splitlines()]
    qs = pg_essays.load_questions()
    assert [r["_id"] for r in items] == [q["id"] for q in qs]
    for r, q in zip(items, qs):
        assert r["input"] == q["question"] and r["answers"] == q["answers"]
        assert r["context"] == (shared_data / "pg-essays" / q["essay"]).read_text(encoding="utf-8")
        assert r["length"] == len(r["context"].split()) > 2000
    with pytest.raises(FileNotFoundError, match="apple.txt: essay of question pg-apple-1 not found"):
        pg_essays.build_items(tmp_path)
