"""Ranking heads: per-head passage masses that agree with the all-head measurement, the block modes'
calibrate+reorder ordering passages by the model's ranking heads (and nothing else changing without them),
the bundled table's lookup, and the selection bench's scoring."""

from __future__ import annotations

import json

import pytest
import torch

from ldqa.app.api import LongDocQA, Passage
from ldqa.attention import debias as D
from ldqa.attention import ranking_heads as RH
from ldqa.eval.bench import bench_ranking_heads as B

PASSAGES = [Passage("Kiln manual", "The SL-30 chamber holds 3.2 cubic metres of stacked lumber."),
            Passage("Bulletin", "Tighten each fan hub bolt to 18 Nm with a calibrated wrench.", 2),
            Passage("Log", "Fan No. 2 was replaced on 14 March 2023 after bearing noise."),
            Passage("Notes", "The humidity sensor fault is shown as error code E-14 on the controller.")]
Q = "What torque for the fan hub bolts?"


@pytest.fixture
def tiny_qa(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    return LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("llama")), max_new_tokens=4)


def _order(answer) -> list[int]:
    return [next(i for i, p in enumerate(PASSAGES) if p.title == f.title) for f in answer.passages]


def test_every_head_s_mass_averages_to_the_measured_passage_mass(tiny_qa):
    """With every head listed, the heads' mean mass per passage, averaged over the two orders, is the mean of
    the all-head measurements in those orders (`debias.passage_mass`): one computation, two reductions."""
    tiny_qa.engine.ranking_heads = RH.all_heads(tiny_qa.engine.model)
    t = tiny_qa.answer(Q, PASSAGES, attention="block", debias="calibrate+reorder").timings
    expect = (torch.tensor(t["passage_attention"]) + torch.tensor(t["passage_attention_reversed"])) / 2
    torch.testing.assert_close(torch.tensor(t["ranking_attention"]), expect, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("attention", ["block", "block+recompute"])
def test_block_modes_order_passages_by_their_ranking_heads(tiny_qa, attention):
    """Through the API: the passage the ranking heads give the most mass sits at the slot the bias curve
    favours, and so on down; without ranking heads the order follows the calibrated relevance."""
    eng = tiny_qa.engine
    eng.ranking_heads = None
    plain = tiny_qa.answer(Q, PASSAGES, attention=attention, debias="calibrate+reorder")
    assert "ranking_attention" not in plain.timings
    bias = tiny_qa.bias_curve(len(PASSAGES), "block")
    best_first = torch.argsort(bias, descending=True).tolist()
    rel = plain.timings["calibrated_relevance"]
    assert [rel[s] for s in best_first] == sorted(rel, reverse=True)
    for head in RH.all_heads(eng.model)[::3]:
        eng.ranking_heads = (head,)
        ra = tiny_qa.answer(Q, PASSAGES, attention=attention, debias="calibrate+reorder").timings["ranking_attention"]
        assert [ra[s] for s in best_first] == sorted(ra, reverse=True)


def test_ranking_heads_decide_the_order_where_relevance_disagrees():
    """debiased_context with made-up measurements: the calibrated relevance ranks passage a first, the
    ranking heads passage c; the final order puts c at the best slot (the last), and a there without
    the heads' measurement."""
    from types import SimpleNamespace

    given = ["a", "b", "c", "d"]
    bias = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def ctx(ranking):
        return SimpleNamespace(reused_prefill_ms=0.0, block_stats=None, ranking_mass=ranking)

    def measure_orders(orders, ranked=True):
        heads = (torch.tensor([[0.1, 0.1, 0.7, 0.1]]), torch.tensor([[0.1, 0.7, 0.1, 0.1]]))  # c, both orders
        mass = torch.tensor([0.4, 0.3, 0.2, 0.1])
        return [(ctx(heads[0] if ranked else None), mass), (ctx(heads[1] if ranked else None), mass.flip(0))]

    cfg = D.DebiasConfig("calibrate+reorder", orders=2, calibration="ratio", strength=0.0)
    model = SimpleNamespace(cfg=SimpleNamespace(attn_scale=1.0))
    for ranked, last in ((True, "c"), (False, "a")):
        _, final, stats = D.debiased_context(
            model, given, cfg, 4, measure=None, build=lambda ps: ctx(None), bias_curve=lambda k: bias,
            measure_orders=lambda orders: measure_orders(orders, ranked))
        assert final[-1] == last and sorted(final) == given
        assert (stats.ranking_attention is not None) == ranked
        if ranked:
            assert stats.ranking_attention[-1] == pytest.approx(0.7)


def test_ranking_heads_leave_full_attention_and_calibrate_alone(tiny_qa):
    tiny_qa.engine.ranking_heads = RH.all_heads(tiny_qa.engine.model)[:1]
    for attention, debias in (("full", "calibrate+reorder"), ("block", "calibrate"), ("block", "sort")):
        assert "ranking_attention" not in tiny_qa.answer(Q, PASSAGES, attention=attention, debias=debias).timings


def test_head_masses_name_a_layer_without_queries_or_a_head_out_of_range(tiny_qa):
    from types import SimpleNamespace

    model = tiny_qa.engine.model
    cache = SimpleNamespace(positions=torch.arange(4), keys=lambda layer: torch.zeros(1, 1, 4, 8))
    q = {0: torch.zeros(model.cfg.num_heads, 1, 8)}
    with pytest.raises(ValueError, match="layer 5 recorded no question queries"):
        RH.head_masses(model, cache, q, [(0, 2), (2, 4)], torch.tensor([3]), [(5, 0)])
    with pytest.raises(ValueError, match="query heads"):
        RH.head_masses(model, cache, q, [(0, 2), (2, 4)], torch.tensor([3]), [(0, model.cfg.num_heads)])


def test_ranking_heads_table_lookup(tmp_path):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"about": "x", "models": {"m": {"heads": [[3, 1], [0, 2]]}}}))
    assert RH.ranking_heads("m", path) == ((3, 1), (0, 2))
    assert RH.ranking_heads("other", path) is None
    assert RH.ranking_heads("m", tmp_path / "missing.json") is None
    from ldqa.attention.model_packages import DEFAULT_MODEL

    assert RH.ranking_heads(DEFAULT_MODEL)  # the default model ships its heads


def _row(record, position, k=4, n=6, informative=3, seed=0):
    """A synthetic measurement: every head spreads its mass at random, head `informative` puts most on the
    gold passage (in both orders)."""
    g = torch.Generator().manual_seed(seed * 1000 + record * 10 + position)
    given, rev = torch.rand(n, k, generator=g), torch.rand(n, k, generator=g)
    given[informative, position - 1] += 5
    rev[informative, k - position] += 5  # the reversed measurement's slot of the gold passage
    return {"record": record, "position": position, "heads": [given.tolist(), rev.tolist()],
            "rel": torch.rand(k, generator=g).tolist()}


def test_bench_selects_the_head_that_finds_the_gold_passage(tmp_path):
    rows = [_row(r, p) for r in range(40) for p in (1, 3)]
    names = [(layer, h) for layer in range(3) for h in range(2)]
    out = B.summarize(rows, 2, names)
    assert out["heads"][0] == [1, 1]  # head 3 of the listing
    assert out["gold_ranked_first"]["heads-1"]["held_out"] == 1.0
    assert out["gold_ranked_first"]["all-calibrated"]["held_out"] < 0.6  # random relevance
    assert out["selection_questions"] == out["held_out_questions"] == 20
    path = tmp_path / "heads.json"
    B.write_heads("m", {**out, "passages": 4, "skip": 0, "limit": 40}, path)
    assert RH.ranking_heads("m", path)[0] == (1, 1)


def test_gold_first_counts_ties_as_misses():
    rows = [{"position": 2}]
    assert B.gold_first(rows, lambda r: torch.tensor([0.1, 0.5, 0.5])) == 0.0
    assert B.gold_first(rows, lambda r: torch.tensor([0.1, 0.6, 0.5])) == 1.0
