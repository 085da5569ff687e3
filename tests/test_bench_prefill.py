"""eval/bench/bench_prefill.py's report: the crossover row and the allocator ratio read from synthetic numbers."""

import pytest

from ldqa.eval.bench.bench_prefill import markdown

pytestmark = pytest.mark.bench


def test_report_names_the_first_row_count_where_the_gemm_wins():
    data = {"crossover": {"Q4_K": {1: {1: (0.4, 5.0), 4: (4.3, 4.7), 8: (8.7, 4.0)}},
                          "q8_0": {1: {1: (0.4, 4.2), 4: (0.7, 4.0), 8: (1.4, 4.4)}}}}
    md = markdown(data)
    assert "| Q4_K | 1 | 0.40 / 5.00 | 4.30 / 4.70 | 8.70 / 4.00 | 8 |" in md
    assert "| q8_0 | 1 | 0.40 / 4.20 | 0.70 / 4.00 | 1.40 / 4.40 | - |" in md


def test_report_gives_system_over_default():
    row = {"prefill_s": 8.0, "minor_faults": 981038, "sys_s": 2.3}
    data = {"allocator": {"2/default": {"prefill_s": 6.4, "minor_faults": 0, "sys_s": 0.0}, "2/system": row}}
    assert "| 2 | 6.40 / 8.00 | 1.25x | 0 / 981,038 | 0.00 / 2.30 |" in markdown(data)
