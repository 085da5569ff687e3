"""The attention engine: `AttentionConfig.resolved` as the one place where defaults are filled
and combinations checked, and `Engine.context` as the one dispatcher, used directly (no LongDocQA)."""

from __future__ import annotations

import pytest
import torch

from ldqa.app.prompt import build_prompt
from ldqa.attention import debias as D
from ldqa.attention.block_attention import (DEFAULT_ANCHOR_PASSAGES, DEFAULT_HEADERS, DEFAULT_RECOMPUTE_RATIO,
                                            DEFAULT_SELECT, BlockConfig)
from ldqa.attention.debias import DebiasConfig
from ldqa.attention.engine import AttentionConfig, Engine
from ldqa.attention.loader import load_model
from ldqa.attention.retrieval_attention import RetrievalConfig

PASSAGES = [{"title": "Kiln manual", "text": "The SL-30 chamber holds 3.2 cubic metres of stacked lumber."},
            {"title": "Bulletin", "text": "Tighten each fan hub bolt to 18 Nm with a calibrated wrench."},
            {"title": "Log", "text": "Fan No. 2 was replaced on 14 March 2023 after bearing noise."}]


class _P:
    def __init__(self, d):
        self.title, self.text, self.page, self.chunk_id = d["title"], d["text"], None, None


def test_resolved_fills_each_modes_defaults():
    cfg = AttentionConfig.from_kwargs("block+recompute", debias="calibrate").resolved()
    assert cfg.block == BlockConfig(DEFAULT_RECOMPUTE_RATIO, DEFAULT_HEADERS, DEFAULT_SELECT, False,
                                     DEFAULT_ANCHOR_PASSAGES["block+recompute"])
    assert cfg.settings()["recompute_select"] == DEFAULT_SELECT
    assert (cfg.debias.orders, cfg.debias.calibration) == (D.MEASURE_ORDERS["block+recompute"],
                                                          D.CALIBRATION["block+recompute"])
    assert cfg.debias.strength == D.STRENGTH[cfg.debias.calibration] and cfg.retrieval is None
    full = AttentionConfig.from_kwargs("full", recompute_ratio=0.3, block_headers="fresh", debias="sort").resolved()
    assert full.block == BlockConfig() and full.debias == DebiasConfig("sort", sort_rounds=D.SORT_ROUNDS)
    assert full.settings() == {"debias": "sort"}  # the block knobs do not apply to full attention
    r = AttentionConfig.from_kwargs("retrieval", top_k_keys="all").resolved()
    assert r.retrieval == RetrievalConfig(top_k_keys=None)
    assert AttentionConfig("retrieval").resolved().retrieval == RetrievalConfig()
    b = AttentionConfig.from_kwargs("full", debias="buckets").resolved()
    assert b.debias.bucket_scales == D.BUCKET_SCALES
    given = AttentionConfig.from_kwargs("block", debias="calibrate", debias_calibration="pearson", debias_strength=0)
    s = given.resolved().settings()
    assert s == {"debias": "calibrate", "debias_orders": 2, "debias_calibration": "pearson", "debias_strength": 0.0,
                 "block_headers": DEFAULT_HEADERS, "block_anchors": False,
                 "anchor_passages": DEFAULT_ANCHOR_PASSAGES["block"]}
    assert given.resolved().resolved() == given.resolved()  # idempotent


@pytest.mark.parametrize("kw, match", [
    ({"attention": "sparse"}, "attention='sparse'"),
    ({"attention": "block", "recompute_ratio": 1.5}, "recompute_ratio"),
    ({"attention": "block", "block_headers": "none"}, "block_headers"),
    ({"attention": "block+recompute", "recompute_select": "random"}, "recompute_select"),
    ({"attention": "full", "top_k_keys": 8}, "only apply to attention='retrieval'"),
    ({"attention": "retrieval", "nonsense": 1}, "unknown retrieval setting"),
    ({"debias": "shuffle"}, "debias='shuffle'"),
    ({"debias": "calibrate", "debias_orders": 3}, "debias_orders"),
    ({"debias": "calibrate", "debias_calibration": "log"}, "debias_calibration"),
    ({"debias": "calibrate", "debias_strength": float("nan")}, "debias_strength"),
    ({"attention": "retrieval", "debias": "sort"}, "not 'retrieval'"),
    ({"attention": "block", "debias": "buckets"}, "buckets"),
])
def test_bad_settings_are_refused_with_the_keyword_named(kw, match):
    with pytest.raises(ValueError, match=match):
        AttentionConfig.from_kwargs(**kw).resolved()


def test_sort_rounds_and_bucket_scales_are_real_fields():
    with pytest.raises(ValueError, match="sort_rounds"):
        DebiasConfig("sort", sort_rounds=0)
    with pytest.raises(ValueError, match="bucket_scales"):
        DebiasConfig("buckets", bucket_scales=(1.0, -2.0))
    assert DebiasConfig("sort", sort_rounds=1).resolved("full").sort_rounds == 1
    assert DebiasConfig("buckets", bucket_scales=[1.0, 4.0]).resolved("full").bucket_scales == (1.0, 4.0)


def test_engine_dispatches_every_mode_without_the_api(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    lm = load_model(str(tiny_model_dir("gemma3")))
    engine = Engine(lm)
    passages = [_P(p) for p in PASSAGES]

    def build(ps):
        return build_prompt(lm.tokenizer, ps, "What torque for the fan hub bolts?")

    n = len(build(passages).ids())
    full = engine.context(passages, build, AttentionConfig().resolved(), 4)
    assert full.runner is lm.model and full.context.cache.length == n and full.context.logits.shape[:2] == (1, 1)
    assert full.policy is None and full.stats is None and full.fallback_reason == ""
    block = engine.context(passages, build, AttentionConfig("block").resolved(), 4)
    assert block.context.block_stats.kv_misses == len(passages)  # no store: every block encoded
    assert not torch.equal(block.context.logits, full.context.logits)  # passages encoded apart
    # recomputing every token (ratio 1) through the block path reproduces full attention
    every = AttentionConfig("block+recompute", BlockConfig(recompute_ratio=1.0)).resolved()
    torch.testing.assert_close(engine.context(passages, build, every, 4).context.logits, full.context.logits,
                               atol=1e-4, rtol=0)
    ret = engine.context(passages, build, AttentionConfig("retrieval").resolved(), 4)
    assert ret.policy is not None and ret.context.cache.policy is ret.policy
    # sort with one round: at most two builds; buckets with two scales: two branches
    one = engine.context(passages, build, AttentionConfig(debias=DebiasConfig("sort", sort_rounds=1)).resolved(), 4)
    assert one.stats.debias_passes <= 2
    two = engine.context(passages, build, AttentionConfig(debias=DebiasConfig("buckets", bucket_scales=(1.0, 2.0)))
                         .resolved(), 4)
    assert two.stats.debias_passes == 2 and len(two.runner.caches) == 2
    with pytest.raises(RuntimeError, match="calibration"):  # no Calibration given: no bias curve
        engine.context(passages, build, AttentionConfig(debias=DebiasConfig("calibrate")).resolved(), 4)


def test_the_cli_offers_exactly_the_engines_choices():
    """The CLI spells its choices out (building the parser must not import torch: `ldqa --help` stays
    instant); this keeps them equal to the engine's."""
    from ldqa.app.cli import build_parser
    from ldqa.attention.block_attention import HEADER_MODES
    from ldqa.attention.engine import ATTENTION_MODES

    ask = build_parser()._subparsers._group_actions[0].choices["ask"]
    choices = {a.dest: a.choices for a in ask._actions if a.choices is not None}
    assert tuple(choices["attention"]) == ATTENTION_MODES
    assert tuple(choices["debias"]) == D.METHODS
    assert tuple(choices["debias_calibration"]) == D.CALIBRATION_FORMS
    assert tuple(choices["block_headers"]) == HEADER_MODES
