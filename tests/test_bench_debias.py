"""bench_debias: the summary's paired differences and targets, and two processes sharing a run."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from ldqa.eval.bench import bench_debias as B

pytestmark = pytest.mark.bench

RECORDS = [{"question": f"q{i}?", "answers": [f"ans{i}"], "title": f"T{i}", "text": f"passage {i} says ans{i}."}
           for i in range(30)]


class FakeQA:
    """Answers right when the gold passage is first (none) or always (calibrate); counts calls."""

    def __init__(self):
        self.calls = []

    def answer(self, question, passages, attention, debias, max_new_tokens, debias_orders=None,
               debias_calibration=None, debias_strength=None):
        self.calls.append((question, debias, attention))
        i = question[1:-1]
        right = debias == "calibrate" or f"ans{i}" in passages[0]["text"]
        timings = {"ttft_ms": 10.0, "total_ms": 20.0 if debias == "none" else 25.0,
                   "reused_prefill_ms": 0.0 if debias == "none" else 5.0}
        final = [SimpleNamespace(**p) for p in passages]
        if debias == "calibrate":  # like calibrate+reorder: the passages come back in another order
            final = final[::-1]
            timings["passage_attention"] = [0.1 * (s + 1) for s in range(len(final))]
            timings["calibrated_relevance"] = [0.0, 0.0, 0.1]  # the last slot ranked first
        from ldqa.attention.debias import STRENGTH

        form = debias_calibration or "difference"
        settings = {"debias_orders": debias_orders or 1, "debias_calibration": form,
                    "debias_strength": STRENGTH[form] if debias_strength is None else debias_strength
                    } if debias.startswith("calibrate") else {}
        return SimpleNamespace(text=f"ans{i}" if right else "no", timings=timings, passages=final, settings=settings)


def _args(tmp_path, reverse=False, n=6):
    return argparse.Namespace(passages=3, positions="1,2,3", n=n, methods="none,calibrate", attention="full",
                              seed=0, out=tmp_path, reverse=reverse, debias_orders=None,
                              debias_calibration=None, debias_strength=None)


def test_summary_pairs_methods_with_none_and_checks_targets(tmp_path):
    table = B.run(FakeQA(), RECORDS, _args(tmp_path))
    none, cal = table["full/none"], table["full/calibrate"]
    assert none["em_by_position"] == {1: 1.0, 2: 0.0, 3: 0.0} and none["spread_points"] == 100
    assert cal["em_by_position"] == {1: 1.0, 2: 1.0, 3: 1.0}
    assert cal["vs_none"][2] == {"points": 100.0, "se_points": 0.0, "n": 6}
    assert cal["vs_none"][1]["points"] == 0.0
    assert cal["targets"] == {"spread_points": 0.0, "spread_met": True, "middle_gain_points": 100.0,
                              "middle_met": True, "first_gain_points": 0.0, "first_met": True}
    assert cal["extra_latency_ms"] == 10.0  # 25 + 5 (the reused prefill added back) - 20, paired
    assert "extra_latency_ms" not in none


def test_forward_and_reverse_processes_share_one_run(tmp_path):
    a, b = FakeQA(), FakeQA()
    B.run(a, RECORDS, _args(tmp_path, n=4))  # forward process did its share (all 4 questions here)
    B.run(b, RECORDS, _args(tmp_path, reverse=True, n=4))
    assert len(a.calls) == 4 * 3 * 2 and b.calls == []  # nothing redone
    rows = [json.loads(x) for x in (tmp_path / "debias-3.jsonl").read_text().splitlines()]
    assert len({(r["i"], r["position"], r["method"]) for r in rows}) == len(rows) == 24


@pytest.mark.parametrize("reverse", [False, True])
def test_partial_rows_are_resumed_not_redone(tmp_path, reverse):
    B.run(FakeQA(), RECORDS, _args(tmp_path, n=2))
    qa = FakeQA()
    B.run(qa, RECORDS, _args(tmp_path, reverse=reverse, n=4))
    assert len(qa.calls) == 2 * 3 * 2  # only the 2 new questions (the first 2 of a 4-sample are the 2-sample)


def test_extra_latency_pairs_warm_answers_only(tmp_path):
    """Block mode: the first answer of a question encodes its passages (kv_misses > 0, slow); the extra
    latency of a method is measured on warm pairs only."""
    seen = set()

    class ColdFirst(FakeQA):
        def answer(self, question, passages, attention, debias, max_new_tokens, debias_orders=None,
                   debias_calibration=None, debias_strength=None):
            ans = super().answer(question, passages, attention, debias, max_new_tokens, debias_orders,
                                 debias_calibration, debias_strength)
            cold = question not in seen
            seen.add(question)
            ans.timings |= {"kv_misses": 3 if cold else 0, "total_ms": 1000.0 if cold else ans.timings["total_ms"]}
            return ans

    args = _args(tmp_path)
    args.attention = "block"
    table = B.run(ColdFirst(), RECORDS, args)
    assert table["block/calibrate"]["extra_latency_ms"] == 10.0
    rows = [json.loads(x) for x in (tmp_path / "debias-3.jsonl").read_text().splitlines()]
    assert sum(r["kv_misses"] > 0 for r in rows) == 6  # one per question


def test_a_row_cut_off_by_a_killed_process_is_answered_again(tmp_path):
    B.run(FakeQA(), RECORDS, _args(tmp_path, n=2))
    path = tmp_path / "debias-3.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 30])  # the last row lost its end
    qa = FakeQA()
    table = B.run(qa, RECORDS, _args(tmp_path, n=2))
    assert len(qa.calls) == 1 and table["full/calibrate"]["n_per_position"] == {1: 2, 2: 2, 3: 2}
    rows = [json.loads(x) for x in path.read_text().splitlines()[-1:]]
    assert rows[0]["method"] == "calibrate"  # the redone row, on a line of its own


def test_rows_record_passage_attention_and_where_the_gold_passage_ended_up(tmp_path):
    B.run(FakeQA(), RECORDS, _args(tmp_path, n=2))
    rows = [json.loads(line) for line in (tmp_path / "debias-3.jsonl").read_text().splitlines()]
    cal = [r for r in rows if r["method"] == "calibrate"]
    assert len(cal) == 6 and all(r["passage_attention"] == [0.1, 0.2, 0.3] for r in cal)
    assert sorted((r["position"], r["gold_slot"]) for r in cal) == [(1, 3), (1, 3), (2, 2), (2, 2), (3, 1), (3, 1)]
    assert all("gold_slot" not in r for r in rows if r["method"] == "none")


def test_summary_reports_how_often_the_gold_passage_is_ranked_first(tmp_path):
    table = B.run(FakeQA(), RECORDS, _args(tmp_path, n=2))
    ranked = table["full/calibrate"]["gold_ranked_first"]  # gold ends in slot 4 - position; slot 3 ranks first
    assert ranked == {1: {"fraction": 1.0, "n": 2}, 2: {"fraction": 0.0, "n": 2}, 3: {"fraction": 0.0, "n": 2}}
    assert "gold_ranked_first" not in table["full/none"]


def test_rows_record_debias_orders_and_a_run_with_other_orders_does_not_resume_them(tmp_path):
    args = _args(tmp_path, n=2)
    args.debias_orders = 1
    B.run(FakeQA(), RECORDS, args)
    rows = [json.loads(line) for line in (tmp_path / "debias-3.jsonl").read_text().splitlines()]
    assert {r.get("debias_orders") for r in rows if r["method"] == "calibrate"} == {1}
    assert all("debias_orders" not in r for r in rows if r["method"] == "none")
    B.run(FakeQA(), RECORDS, _args(tmp_path, n=2))  # the default for full attention is 1 order too
    args.debias_orders = 2
    with pytest.raises(SystemExit, match="debias_orders=1"):
        B.run(FakeQA(), RECORDS, args)
    B.run(None, RECORDS, args)  # summarizing the rows as they are is fine
    args.methods = "none"  # a run of other methods is not blocked by calibrate rows it does not resume
    B.run(FakeQA(), RECORDS, args)


def test_first_words_is_the_start_of_the_first_non_empty_line():
    assert B.first_words("\n  Paul Williams and Roger Nichols wrote it\n(Title: x)") == "Paul Williams and Roger Nichols"
    assert B.first_words("") == "" and B.first_words("a b", n=1) == "a"


class WordyQA(FakeQA):
    """calibrate answers right only by appending the answer after five other words."""

    def answer(self, question, passages, **kw):
        ans = super().answer(question, passages, **kw)
        if kw["debias"] == "calibrate":
            ans.text = "one two three four five " + ans.text
        return ans


def test_length_control_scores_only_the_first_words(tmp_path):
    table = B.run(WordyQA(), RECORDS, _args(tmp_path))
    cal, none = table["full/calibrate"], table["full/none"]
    assert cal["em_by_position"] == {1: 1.0, 2: 1.0, 3: 1.0}  # best-subspan EM finds the late answer
    assert cal["em_first_words_by_position"] == {1: 0.0, 2: 0.0, 3: 0.0}  # the length control does not
    assert none["em_first_words_by_position"] == none["em_by_position"]
    assert cal["median_answer_words"] == 6 and none["median_answer_words"] == 1
    md = B.markdown(table, [1, 2, 3])
    assert "| full/calibrate | 0.000 | 0.000 | 0.000 | 6 |" in md


def test_spread_null_tells_a_position_effect_from_noise(tmp_path):
    positions = [1, 2, 3]
    # right only at position 1 on every question: no shuffle of the positions is that wide as often
    effect = [{"i": i, "position": p, "em": float(p == 1)} for i in range(12) for p in positions]
    null = B.spread_null(effect, positions, n_perm=200)
    assert null["n"] == 12 and null["observed_points"] == 100 and null["p_value"] < 0.01 and null["p95_points"] < 100
    # right on half the questions at every position: flat, every shuffle gives the same spread 0
    flat = [{"i": i, "position": p, "em": float(i % 2)} for i in range(12) for p in positions]
    assert B.spread_null(flat, positions, n_perm=200) == {"observed_points": 0.0, "median_points": 0.0,
                                                          "p95_points": 0.0, "p_value": 1.0, "n": 12}
    # seeded; questions missing a position are left out
    assert B.spread_null(effect + [{"i": 99, "position": 1, "em": 1.0}], positions, n_perm=50, seed=3) == \
        B.spread_null(effect, positions, n_perm=50, seed=3)
    assert B.spread_null(effect, [1]) is None
    # the rows' order in the file does not matter (two processes interleave them)
    mixed = [{"i": i, "position": p, "em": float((i * p) % 3 == 0)} for i in range(12) for p in positions]
    assert B.spread_null(mixed[::-1], positions, n_perm=50) == B.spread_null(mixed, positions, n_perm=50)
    table = B.run(FakeQA(), RECORDS, _args(tmp_path))
    assert table["full/none"]["spread_null"]["p_value"] < 0.05 and "Spread vs a method" in B.markdown(table, positions)


def test_rows_record_a_ratio_calibration_and_a_run_with_another_does_not_resume_them(tmp_path):
    args = _args(tmp_path, n=2)
    args.debias_calibration = "ratio"
    B.run(FakeQA(), RECORDS, args)
    rows = [json.loads(line) for line in (tmp_path / "debias-3.jsonl").read_text().splitlines()]
    assert {r.get("debias_calibration") for r in rows if r["method"] == "calibrate"} == {"ratio"}
    assert all("debias_calibration" not in r for r in rows if r["method"] == "none")
    with pytest.raises(SystemExit, match="debias_calibration=ratio"):
        B.run(FakeQA(), RECORDS, _args(tmp_path, n=2))  # the default for full attention is "difference"
    B.run(FakeQA(), RECORDS, args)  # resuming with the same setting is fine


def test_rows_record_the_strength_and_a_run_with_another_does_not_resume_them(tmp_path):
    args = _args(tmp_path, n=2)
    args.debias_calibration, args.debias_strength = "pearson", 1.5
    B.run(FakeQA(), RECORDS, args)
    rows = [json.loads(line) for line in (tmp_path / "debias-3.jsonl").read_text().splitlines()]
    assert {r.get("debias_strength") for r in rows if r["method"] == "calibrate"} == {1.5}
    assert all("debias_strength" not in r for r in rows if r["method"] == "none")
    args2 = _args(tmp_path, n=2)
    args2.debias_calibration = "pearson"  # the default strength for pearson is 1.0
    with pytest.raises(SystemExit, match="debias_strength=1.5, this run would use 1"):
        B.run(FakeQA(), RECORDS, args2)
    args2.debias_strength = 1.0
    with pytest.raises(SystemExit, match="--debias-strength 1.5"):
        B.run(FakeQA(), RECORDS, args2)
    B.run(FakeQA(), RECORDS, args)  # resuming with the same setting is fine


def test_rows_without_a_strength_are_taken_at_their_forms_default(tmp_path):
    """Rows written before debias_strength was recorded used STRENGTH[form]: a default run resumes them,
    a run at another strength does not."""
    rows = [{"i": 0, "position": 1, "attention": "full", "method": "calibrate", "debias_calibration": "ratio"}]
    B.check_settings(rows, None, ["calibrate"], ["full"], "ratio", None)
    B.check_settings(rows, None, ["calibrate"], ["full"], "ratio", 1.2)  # STRENGTH["ratio"]
    with pytest.raises(SystemExit, match="debias_strength=1.2"):
        B.check_settings(rows, None, ["calibrate"], ["full"], "ratio", 1.0)


def test_plot_colours_by_method_and_styles_by_attention_mode(tmp_path):
    em = {1: 0.5, 2: None, 3: 0.25}  # a missing cell is a gap, not an error
    table = {f"{mode}/{method}": {"em_by_position": em} for mode in ("full", "block")
             for method in ("none", "calibrate", "sort")}
    styles = B.plot(table, [1, 2, 3], tmp_path / "p.png", 3)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert styles["full/calibrate"][0] == styles["block/calibrate"][0] != styles["full/sort"][0]
    assert styles["full/none"][1] == styles["full/sort"][1] != styles["block/none"][1]
    assert len(set(styles.values())) == len(table)
