"""diag_debias (issue 6): the ranking diagnostic's calibrations."""

from __future__ import annotations

from ldqa.eval.diag_debias import gold_first


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
