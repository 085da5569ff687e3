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


def _recipe() -> str:
    """block+recompute's key suffix for the default recipe (none for CacheBlend's deviation at 0.15)."""
    from ldqa.attention.block_attention import DEFAULT_RECOMPUTE_RATIO, DEFAULT_SELECT

    plain = (DEFAULT_SELECT, DEFAULT_RECOMPUTE_RATIO) == ("deviation", 0.15)
    return "" if plain else f"+select={DEFAULT_SELECT}@{DEFAULT_RECOMPUTE_RATIO:g}"


def _anchor(attention: str) -> str:
    """A block mode's key suffix for the default anchor passages (none when the default is 0)."""
    from ldqa.attention.block_attention import BlockConfig

    n = BlockConfig().resolved(attention).anchor_passages
    return f"+anchor{n}" if n else ""


@pytest.mark.parametrize("mode", sorted(KEYS))
def test_mode_cache_keys_keep_their_values(mode):
    """The recorded keys; block+recompute's carry its default recipe, and block modes' their default
    anchor passages, so answers of another recipe are not read as this one's."""
    measured = "+measured=block" if mode[0] == "block+recompute" and mode[1] != "none" else ""
    assert mode_cache_key(Mode(*mode)) == (KEYS[mode] + (_recipe() if mode[0] == "block+recompute" else "") + measured
                                           + _anchor(mode[0]))


def test_a_changed_retrieval_setting_changes_the_key():
    assert mode_cache_key(Mode("retrieval"), RetrievalConfig(top_k_keys=8)) == "retrieval/none@-#dcea80951898"
    assert mode_cache_key(Mode("retrieval"), RetrievalConfig()) == KEYS[("retrieval", "none", None)]


def test_a_recompute_recipe_other_than_deviation_at_0_15_changes_block_recompute_s_key_only():
    from ldqa.eval.harness import EvalConfig

    cfg = EvalConfig(benchmark="nq-multidoc", data="x", recompute_select="question", recompute_ratio=0.3)
    assert mode_cache_key(Mode("block+recompute", "sort"), cfg=cfg) \
        == "block+recompute/sort@-+select=question@0.3+measured=block" + _anchor("block+recompute")
    assert mode_cache_key(Mode("block+recompute", "sort"), cfg=EvalConfig(
        benchmark="nq-multidoc", data="x", recompute_select="deviation", recompute_ratio=0.15)) \
        == KEYS[("block+recompute", "sort", None)] + "+measured=block" + _anchor("block+recompute")
    assert mode_cache_key(Mode("block+recompute"), cfg=cfg) == "block+recompute/none@-+select=question@0.3" + \
        _anchor("block+recompute")
    assert mode_cache_key(Mode("block", "none", "hybrid"), cfg=cfg) == KEYS[("block", "none", "hybrid")] + _anchor("block")
    assert mode_cache_key(Mode("full"), cfg=cfg) == KEYS[("full", "none", None)]


def test_a_debias_strength_changes_the_calibrate_modes_keys_only():
    from ldqa.attention.debias import STRENGTH
    from ldqa.eval.harness import EvalConfig

    strong = EvalConfig(benchmark="nq-multidoc", data="x", debias_strength=1.8)
    default = EvalConfig(benchmark="nq-multidoc", data="x", debias_strength=STRENGTH["ratio"])
    plain = EvalConfig(benchmark="nq-multidoc", data="x")
    mode = Mode("block+recompute", "calibrate+reorder")
    assert mode_cache_key(mode, cfg=default) == mode_cache_key(mode, cfg=plain) == mode_cache_key(mode)
    assert mode_cache_key(mode, cfg=strong) != mode_cache_key(mode, cfg=plain)
    assert mode_cache_key(Mode("block", "calibrate"), cfg=strong) != mode_cache_key(Mode("block", "calibrate"))
    for m in (Mode("block+recompute", "sort"), Mode("full"), Mode("block", "none", "hybrid")):
        assert mode_cache_key(m, cfg=strong) == mode_cache_key(m, cfg=plain)


def test_block_anchors_change_the_block_modes_keys_only():
    from ldqa.eval.harness import EvalConfig

    cfg = EvalConfig(benchmark="jsonl", data="x", block_anchors=True)
    assert mode_cache_key(Mode("block", "none", "hybrid"), cfg=cfg) == "block/none@hybrid+anchors" + _anchor("block")
    assert mode_cache_key(Mode("full"), cfg=cfg) == KEYS[("full", "none", None)]


def test_anchor_passages_change_the_block_modes_keys_only():
    from ldqa.eval.harness import EvalConfig

    cfg = EvalConfig(benchmark="nq-multidoc", data="x", anchor_passages=3)
    assert mode_cache_key(Mode("block", "none", "hybrid"), cfg=cfg) == KEYS[("block", "none", "hybrid")] + "+anchor3"
    assert mode_cache_key(Mode("full"), cfg=cfg) == KEYS[("full", "none", None)]
    zero = EvalConfig(benchmark="nq-multidoc", data="x", anchor_passages=0)
    assert mode_cache_key(Mode("block", "none", "hybrid"), cfg=zero) == KEYS[("block", "none", "hybrid")]
    default = mode_cache_key(Mode("block", "none", "hybrid"), cfg=EvalConfig(benchmark="nq-multidoc", data="x"))
    assert default == KEYS[("block", "none", "hybrid")] + _anchor("block")
    recompute = mode_cache_key(Mode("block+recompute", "calibrate+reorder"), cfg=cfg)  # each block mode's own
    assert recompute.endswith("+anchor3") and recompute[:-len("+anchor3")] == mode_cache_key(
        Mode("block+recompute", "calibrate+reorder"), cfg=zero) + _anchor("block+recompute")
