"""The eval harness's prediction-cache keys must keep their values for existing settings, wherever the
code that computes them moves: a changed key would orphan every cached prediction behind the numbers in
docs/results.md. The literals below are the recorded keys."""

from __future__ import annotations

import pytest

from ldqa.attention.retrieval_attention import RetrievalConfig
from ldqa.eval.harness import Mode, mode_cache_key

KEYS = {  # Mode(attention, debias, retriever) -> its recorded cache key
    ("full", "none", None): "full/none@-",
    ("full", "calibrate", None): "full/calibrate@-#30d06a8a3602",
    ("full", "calibrate+reorder", "bm25"): "full/calibrate+reorder@bm25#30d06a8a3602",
    ("full", "sort", None): "full/sort@-",
    ("full", "buckets", None): "full/buckets@-",
    ("block", "none", "hybrid"): "block/none@hybrid",
    ("block", "calibrate", None): "block/calibrate@-#6a739eb1c2e5",
    ("block+recompute", "calibrate+reorder", None): "block+recompute/calibrate+reorder@-#6a739eb1c2e5",
    ("block+recompute", "sort", None): "block+recompute/sort@-",
    ("retrieval", "none", None): "retrieval/none@-#733b910316ad",
    ("hf", "none", "bm25"): "hf/none@bm25",
}


@pytest.mark.parametrize("mode", sorted(KEYS))
def test_mode_cache_keys_keep_their_values(mode):
    assert mode_cache_key(Mode(*mode)) == KEYS[mode]


def test_a_changed_retrieval_setting_changes_the_key():
    assert mode_cache_key(Mode("retrieval"), RetrievalConfig(top_k_keys=8)) == "retrieval/none@-#dcea80951898"
    assert mode_cache_key(Mode("retrieval"), RetrievalConfig()) == KEYS[("retrieval", "none", None)]
