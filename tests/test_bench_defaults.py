"""bench_defaults: the study's parts are valid harness runs, its summary pairs every configuration
with full/none, and the choice rule picks accuracy first, then time to answer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ldqa.eval.bench import bench_defaults as D

pytestmark = pytest.mark.bench


def test_config_of_harness_labels():
    assert D.config_of("full") == "full/none"
    assert D.config_of("full@hybrid") == "full/none"
    assert D.config_of("block+recompute/calibrate+reorder@hybrid") == "block+recompute/calibrate+reorder"
    assert D.config_of("block/calibrate") == "block/calibrate"


def test_every_part_is_a_valid_harness_config(tmp_path):
    from ldqa.eval.harness import _validate

    args = argparse.Namespace(out=tmp_path, configs=list(D.CONFIGS), model=None, weights=None, seed=0,
                              no_progress=True, nq=tmp_path / "nq.jsonl.gz", n10=3, n20=2, positions10="1,5,10",
                              positions20="1,10,20", essays=tmp_path, pg_limit=None)
    (tmp_path / "pg-essays-longbench.jsonl").write_text("")  # found: not built from --essays
    (tmp_path / "nq.jsonl.gz").write_bytes(b"")
    for part in D.ACCURACY_PARTS:
        cfg = D.part_config(part, args)
        modes = _validate(cfg)
        assert [D.config_of(m.label) for m in modes] == list(D.CONFIGS)
        if part.startswith("pg"):
            assert all(m.collection for m in modes) and cfg.top_k == (5 if part == "pg5" else 10)
        else:
            assert cfg.n_passages == (10 if part == "nq10" else 20)


def _rows(scores: dict[str, list[float]], part: str, total_ms: dict[str, float]) -> list[dict]:
    """Harness-like rows: scores[config][i] is question i's score in that configuration."""
    rows = []
    for c, ss in scores.items():
        label = c.removesuffix("/none") + ("@hybrid" if part.startswith("pg") else "")
        for i, s in enumerate(ss):
            r = {"mode": label, "example_id": f"q{i}", "score": s, "prediction": "x" if s else "y",
                 "answers": ["x"], "ttft_ms": 100.0, "total_ms": total_ms[c], "generated_tokens": 5}
            if part.startswith("nq"):
                r["gold_position"] = 1 + i % 2
            else:
                r |= {"ttft_cold_ms": 200.0, "ttft_warm_ms": 50.0, "gold_in_retrieved": 1.0, "abstained": False}
            rows.append(r)
    return rows


def _write(out: Path, part: str, rows: list[dict]):
    """The rows as the harness's prediction cache holds them (`PredictionCache`), one settings hash."""
    from ldqa.eval.harness import PredictionCache

    (out / part).mkdir(parents=True)
    cache = PredictionCache(out / part / "predictions.sqlite")
    for r in rows:
        cache.put("h1", "b", r["mode"], r["example_id"], r)
    cache.put("h0", "b", "full", "old", rows[0])  # another settings hash: left out
    cache.close()


def test_choice_is_accuracy_first_then_time(tmp_path):
    n = 40
    base = [1.0 if i % 4 == 0 else 0.0 for i in range(n)]          # 0.25
    good = [1.0 if i % 2 == 0 else 0.0 for i in range(n)]          # 0.50: +25 points, paired
    close = [1.0 if i % 2 == 0 and i != 2 else 0.0 for i in range(n)]  # 0.475: within the best's SE
    worse_pg = [0.0] * n                                           # best on nq, far worse on pg
    configs = ["full/none", "full/calibrate", "block/calibrate+reorder", "block/none"]
    slow = {"full/none": 3000.0, "full/calibrate": 3200.0, "block/calibrate+reorder": 900.0,
                  "block/none": 500.0}
    scores_nq = {"full/none": base, "full/calibrate": good, "block/calibrate+reorder": close,
                 "block/none": [1.0] * n}
    scores_pg = {"full/none": base, "full/calibrate": good, "block/calibrate+reorder": close,
                 "block/none": worse_pg}
    _write(tmp_path, "nq10", _rows(scores_nq, "nq10", slow))
    _write(tmp_path, "pg5", _rows(scores_pg, "pg5", slow))
    session = {"ingest": {"files": 1, "chunks": 2, "chunk_tokens": 1000, "ms": 10.0}, "runs": {}}
    for c, ans_ms in (("full/none", 30000.0), ("full/calibrate", 32000.0), ("block/calibrate+reorder", 60000.0),
                      ("block/none", 5000.0)):
        session["runs"][c] = {"config": c, "precomputed": False, "bias_curve_ms": 0.0, "session_ms": ans_ms,
                              "answers_ms": ans_ms, "questions": [
                                  {"ttft_ms": 10.0, "wall_ms": ans_ms, "f1": 0.5, "em": 1.0}]}
    session["runs"]["block/calibrate+reorder +precomputed"] = {
        "config": "block/calibrate+reorder", "precomputed": True, "bias_curve_ms": 0.0, "session_ms": 99000.0,
        "answers_ms": 9000.0, "precompute": {"blocks": 2, "computed": 2, "ms": 90000.0, "kv_disk_bytes": 2e7},
        "questions": [{"ttft_ms": 10.0, "wall_ms": 9000.0, "f1": 0.5, "em": 1.0}]}
    (tmp_path / "session").mkdir()
    (tmp_path / "session" / "session.json").write_text(json.dumps(session))

    assert D.main(["--summary-only", "--out", str(tmp_path), "--configs", ",".join(configs)]) == 0
    res = json.loads((tmp_path / "results-defaults.json").read_text())
    ch = res["choice"]
    gains = ch["gains"]
    assert gains["full/calibrate"]["gain"] == pytest.approx(0.25)
    assert gains["block/none"]["worse_in"] == ["pg5"]  # -25 points on pg: never a candidate
    assert ch["best_accuracy"] == "full/calibrate"
    assert set(ch["candidates"]) == {"full/calibrate", "block/calibrate+reorder"}
    # precomputed blocks answer its session in 9 s against full/calibrate's 32 s: the faster candidate wins
    assert ch["choice"] == "block/calibrate+reorder"
    s = res["session"]["block/calibrate+reorder +precomputed"]
    assert s["precompute_ms_per_1k_tokens"] == pytest.approx(90000.0)
    assert s["kv_disk_mb_per_1k_tokens"] == pytest.approx(20.0)
    nq = res["parts"]["nq10"]
    assert nq["full/none"]["by_position"] == {"1": 0.5, "2": 0.0}
    assert nq["full/calibrate"]["vs_baseline"]["n"] == n
    md = (tmp_path / "summary-defaults.md").read_text()
    assert "fastest of them: **block/calibrate+reorder**" in md


def test_summary_needs_the_baseline():
    with pytest.raises(SystemExit):
        D.main(["--summary-only", "--configs", "block/none"])
