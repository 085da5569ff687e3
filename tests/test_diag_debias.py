"""diag_debias: the ranking diagnostic's calibrations."""

from __future__ import annotations

import pytest

from ldqa.eval.bench.diag_debias import gold_first

pytestmark = pytest.mark.bench


def test_gold_first_under_each_calibration():
    bias = [0.1, 0.1, 0.4]  # the last slot attended most whatever it holds
    rows = [{"position": 1, "mass": [0.2, 0.1, 0.3], "bias": bias},  # raw: slot 3 wins; a - b, a / b: gold
            {"position": 3, "mass": [0.1, 0.1, 0.5], "bias": bias},  # all three: gold
            {"position": 3, "mass": [0.2, 0.1, 0.45], "bias": bias}]  # raw: gold; a - b, a / b: slot 1
    out = gold_first(rows, [1, 3])
    assert out["raw"] == {1: 0.0, 3: 1.0}
    assert out["subtract"] == {1: 1.0, 3: 0.5}
    assert out["ratio"] == {1: 1.0, 3: 0.5}
    assert gold_first(rows, [2])["raw"] == {2: None}


def test_gold_first_with_a_second_measurement_in_the_reversed_order():
    bias = [0.3, 0.1, 0.1]  # slot 1 overestimated for this gold passage: one order misses it
    rows = [{"position": 1, "mass": [0.35, 0.2, 0.1], "bias": bias,
             "mass_rev": [0.4, 0.1, 0.25]}]  # per passage; gold (passage 1) sat at slot 3 (bias 0.1)
    out = gold_first(rows, [1])
    assert out["subtract"] == {1: 0.0}  # 0.05 < 0.1
    assert out["subtract-2"] == {1: 1.0}  # (0.05 + 0.3) / 2 beats (0.1 + 0) / 2 and (0 + -0.05) / 2
    assert set(out) == {"raw", "subtract", "ratio", "subtract-2", "ratio-2"}
    assert "subtract-2" not in gold_first([{k: v for k, v in rows[0].items() if k != "mass_rev"}], [1])


def test_buckets_prefill_compares_shared_and_whole_prefills(tmp_path, tiny_model_dir, monkeypatch):
    import argparse
    import json

    from ldqa.app.api import LongDocQA
    from ldqa.eval.bench.diag_debias import _buckets_prefill

    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=2)
    records = [{"question": f"What is item {i}?", "answers": [f"value {i}"], "title": f"Item {i}",
                "text": f"Item {i} has the value {i} in the catalogue of parts."} for i in range(6)]
    args = argparse.Namespace(passages=3, seed=0, out=tmp_path)
    assert _buckets_prefill(qa, records, [0, 1, 2], 2, args) == 0
    result = json.loads((tmp_path / "buckets-prefill-3.json").read_text())
    assert result["same_first_token"] and result["n"] == 3
    assert all(len(v) == 3 and min(v) > 0 for v in result["ttft_ms"].values())
    assert qa.engine.share_bucket_layers  # the default is back
