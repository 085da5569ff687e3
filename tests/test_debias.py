"""Position debiasing: bias-curve determinism, calibration algebra, the attention
intervention's identity, and reordering that keeps passages and citations right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ldqa.app.api import LongDocQA, Passage
from ldqa.app.prompt import build_prompt
from ldqa.attention import debias as D
from ldqa.attention.loader import load_model

SAMPLE = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"
PASSAGES = [Passage("Kiln manual", "The SL-30 chamber holds 3.2 cubic metres of stacked lumber."),
            Passage("Bulletin", "Tighten each fan hub bolt to 18 Nm with a calibrated wrench.", 2),
            Passage("Log", "Fan No. 2 was replaced on 14 March 2023 after bearing noise."),
            Passage("Notes", "The humidity sensor fault is shown as error code E-14 on the controller.")]


@pytest.fixture
def tiny_qa(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    return LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=6)


@pytest.fixture(params=["gemma3", "llama"])
def lm(request, tiny_model_dir):
    return load_model(str(tiny_model_dir(request.param)))


def test_intervention_with_equal_relevance_leaves_logits_unchanged(lm):
    """log w = 0 on every passage: the biased attention path must equal the model's own (1e-4), for the
    question recomputed in place and for decode steps; a nonzero weight does change the logits."""
    seg = build_prompt(lm.tokenizer, PASSAGES, "What torque for the fan hub bolts?")
    ids, m = seg.ids(), lm.model
    n_q, L = len(seg.question), len(seg.ids())

    def run(log_w):
        cache = m.new_cache(capacity=L + 8)
        m(torch.tensor([ids]), torch.arange(L), cache)
        if log_w is not None:
            cache.policy = D.DebiasKV(log_w=D.slot_bias(D.passage_spans(seg), log_w, L + 8), scale=m.cfg.attn_scale)
        slots = torch.arange(L - n_q, L)
        out = [m(torch.tensor([seg.question]), cache.positions[slots].clone(), cache, slots=slots, all_logits=True)[0]]
        for t in (11, 12, 13):
            out.append(m(torch.tensor([[t]]), torch.tensor([cache.next_position()]), cache)[0])
        return torch.cat(out)

    plain = run(None)
    torch.testing.assert_close(run(torch.zeros(len(PASSAGES))), plain, atol=1e-4, rtol=0)
    assert (run(torch.tensor([0.0, 3.0, 0.0, -3.0])) - plain).abs().max() > 1e-3


def test_calibration_algebra_flat_bias_is_identity():
    mass = torch.tensor([0.10, 0.30, 0.05, 0.20])
    flat = torch.full((4,), 0.07)
    rel = D.calibrated_relevance(mass, flat)
    assert torch.equal(torch.argsort(rel), torch.argsort(mass))
    torch.testing.assert_close(D.log_weights(rel, mass, 1.0), (mass - mass.mean()) / mass.mean())
    equal = D.calibrated_relevance(torch.full((4,), 0.2), torch.full((4,), 0.1))
    assert torch.all(D.log_weights(equal, torch.full((4,), 0.2), 2.0) == 0)
    # U-shaped bias: by relevance 2 > 3 > 1 > 0; slots by bias 0 > 3 > 1 > 2: slot 0 <- 2, slot 3 <- 3, ...
    bias = torch.tensor([0.30, 0.05, 0.04, 0.20])
    assert D.reorder_for_bias(torch.tensor([0.0, 0.1, 0.5, 0.2]), bias) == [2, 1, 0, 3]
    assert D.sort_order(torch.tensor([0.3, 0.1, 0.2])) == [1, 2, 0]  # most attended last
    with pytest.raises(ValueError, match="mass"):
        D.calibrated_relevance(mass, torch.zeros(3))


def test_two_order_relevance_cancels_a_bias_error_linear_in_the_slot():
    # observed mass = true bias + relevance; the bias estimate is off by e_s, linear in the slot
    true_bias = torch.tensor([0.10, 0.06, 0.05, 0.07, 0.12])
    rel = torch.tensor([0.30, 0.0, 0.0, 0.0, 0.0])  # passage 0 is the relevant one
    err = 0.2 * (2 - torch.arange(5.0))  # overestimates slot 0 by 0.4
    est = true_bias + err
    mass = true_bias + rel  # passage p at slot p
    mass_rev = true_bias + rel.flip(0)  # reversed order: passage 4 - s at slot s
    single = D.calibrated_relevance(mass, est)
    assert int(single.argmax()) != 0  # one order misranks the relevant passage
    two = D.two_order_relevance(mass, mass_rev, est)
    torch.testing.assert_close(two, rel)  # e_s + e_(4-s) = 0: the error cancels
    with pytest.raises(ValueError, match="mass_rev"):
        D.two_order_relevance(mass, mass_rev[:4], est)


def test_ratio_calibration_gives_the_relevant_passage_the_same_weight_at_every_slot():
    # multiplicative bias: a passage at slot s gets b_s * (1 + rho_p); U-shaped once two orders average
    bias = torch.tensor([0.04, 0.05, 0.03, 0.04, 0.05, 0.12])
    k, rho = 6, 2.0
    weights = {"difference": [], "ratio": []}
    for gold in range(k):
        boost = torch.zeros(k)
        boost[gold] = rho
        mass = bias * (1 + boost)
        mass_rev = bias * (1 + boost.flip(0))  # slot s holds passage k-1-s
        for form in weights:
            rel = D.two_order_relevance(mass, mass_rev, bias, form)
            assert int(rel.argmax()) == gold
            weights[form].append(float(D.log_weights(rel, mass, form=form)[gold]))
    diff, ratio = torch.tensor(weights["difference"]), torch.tensor(weights["ratio"])
    assert diff.max() - diff.min() > 0.5  # a - b: the gold's weight follows the bias of its two slots
    torch.testing.assert_close(ratio, torch.full((k,), ratio[0].item()))  # a / b: the same at every slot
    assert ratio[0] > 0
    flat = torch.full((4,), 0.07)
    mass = torch.tensor([0.10, 0.30, 0.05, 0.20])
    torch.testing.assert_close(D.calibrated_relevance(mass, flat, "ratio"), mass / 0.07)  # flat: a rescaling
    assert torch.all(D.log_weights(torch.ones(4), mass, form="ratio") == 0)  # equal relevance: no change
    with pytest.raises(ValueError, match="calibration form"):
        D.calibrated_relevance(mass, flat, "quotient")


def test_pearson_calibration_sits_between_difference_and_ratio():
    mass = torch.tensor([0.10, 0.30, 0.05, 0.20])
    flat = torch.full((4,), 0.07)
    rel = D.calibrated_relevance(mass, flat, "pearson")
    torch.testing.assert_close(rel, (mass - 0.07) / 0.07 ** 0.5)
    # with a flat bias the normalised weights are those of "difference"
    torch.testing.assert_close(D.log_weights(rel, mass, form="pearson", bias=flat),
                               D.log_weights(D.calibrated_relevance(mass, flat), mass))
    assert torch.all(D.log_weights(torch.ones(4), mass, form="pearson", bias=flat) == 0)
    with pytest.raises(ValueError, match="bias curve"):
        D.log_weights(rel, mass, form="pearson")
    with pytest.raises(ValueError, match="bias curve"):
        D.log_weights(rel, mass, form="pearson", bias=flat[:3])
    # one order, U-shaped multiplicative bias: the gold passage's weight varies across slots the most
    # with a - b, not at all with a / b, in between with the Pearson residual
    bias = torch.tensor([0.12, 0.05, 0.03, 0.04, 0.06, 0.20])
    k, rho = 6, 2.0
    spread = {}
    for form in ("difference", "pearson", "ratio"):
        w = []
        for gold in range(k):
            mass = bias * (1 + rho * (torch.arange(k) == gold))
            rel = D.calibrated_relevance(mass, bias, form)
            assert int(rel.argmax()) == gold
            w.append(float(D.log_weights(rel, mass, form=form, bias=bias)[gold]))
        spread[form] = max(w) / min(w)
    assert spread["ratio"] < 1.0001 < spread["pearson"] < spread["difference"]


def test_bias_curve_is_deterministic_for_a_seed_and_cached(tiny_qa):
    a = tiny_qa.bias_curve(3, "full", n_examples=2, seed=1)
    cached = list(Path(tiny_qa_cache(tiny_qa)).glob("debias/*.json"))
    assert len(cached) == 1
    cached[0].unlink()
    b = tiny_qa.bias_curve(3, "full", n_examples=2, seed=1)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert a.shape == (3,) and bool((a > 0).all()) and float(a.sum()) < 1
    assert not torch.equal(tiny_qa.bias_curve(3, "full", n_examples=2, seed=2), a)
    blocks = tiny_qa.bias_curve(3, "block", n_examples=2, seed=1)
    assert blocks.shape == (3,) and not torch.equal(blocks, a)


def tiny_qa_cache(qa) -> Path:
    from ldqa.attention.loader import cache_root

    return cache_root()


@pytest.mark.parametrize("method", ["calibrate", "calibrate+reorder", "sort"])
@pytest.mark.parametrize("attention", ["full", "block"])
def test_debias_methods_keep_passages_and_citations(tiny_qa, method, attention):
    ans = tiny_qa.answer("What torque for the fan hub bolts?", PASSAGES, attention=attention, debias=method)
    assert sorted(p.title for p in ans.passages) == sorted(p.title for p in PASSAGES)
    for c in ans.citations:  # citation numbers refer to the final order
        assert c.title == ans.passages[c.n - 1].title
    t = ans.timings
    assert t["debias_passes"] >= 1 and len(t["passage_attention"]) == len(PASSAGES)
    assert all(0 <= a <= 1 for a in t["passage_attention"])
    if method.startswith("calibrate"):
        assert len(t["passage_weights"]) == len(PASSAGES)


@pytest.mark.parametrize("method", ["calibrate", "calibrate+reorder", "sort"])
def test_block_recompute_measures_on_the_block_cache(tiny_qa, method):
    # block+recompute ranks the passages by the question's attention over the plain block cache (the pass
    # its selection makes), so it measures what block mode measures over the same blocks (those of its own
    # anchor passages), then recomputes the final order once
    from ldqa.attention.block_attention import DEFAULT_ANCHOR_PASSAGES

    q = "What torque for the fan hub bolts?"
    blk = tiny_qa.answer(q, PASSAGES, attention="block", debias=method,
                         anchor_passages=DEFAULT_ANCHOR_PASSAGES["block+recompute"])
    br = tiny_qa.answer(q, PASSAGES, attention="block+recompute", debias=method)
    assert [p.title for p in br.passages] == [p.title for p in blk.passages]
    for key in ("passage_attention", "calibrated_relevance", "passage_weights"):
        if key in blk.timings:
            torch.testing.assert_close(torch.tensor(br.timings[key]), torch.tensor(blk.timings[key]),
                                       rtol=1e-5, atol=1e-7)
    assert br.timings["tokens_recomputed"] > 0  # the answer's context is block+recompute's
    assert blk.timings.get("tokens_recomputed", 0) == 0
    # the block measurements, then one block+recompute build of the final order
    measures = 2 if method.startswith("calibrate") else blk.timings["debias_passes"]
    assert br.timings["debias_passes"] == measures + 1


def test_calibrate_reorder_reports_attention_in_the_final_passage_order(tiny_qa):
    q = "What torque for the fan hub bolts?"
    cal = tiny_qa.answer(q, PASSAGES, debias="calibrate").timings  # measured in the given order
    rr = tiny_qa.answer(q, PASSAGES, debias="calibrate+reorder")
    final = [next(i for i, p in enumerate(PASSAGES) if p.title == f.title) for f in rr.passages]
    assert final != list(range(len(PASSAGES)))  # reordered, or the check below proves nothing
    assert rr.timings["passage_attention"] == [cal["passage_attention"][i] for i in final]
    assert rr.timings["calibrated_relevance"] == [cal["calibrated_relevance"][i] for i in final]


def test_two_order_measurement_default_in_block_mode(tiny_qa):
    q = "What torque for the fan hub bolts?"
    two = tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate")
    assert two.settings["debias_orders"] == 2 and two.timings["debias_passes"] == 2
    rev = tiny_qa.answer(q, PASSAGES[::-1], attention="block", debias="calibrate", debias_orders=1)
    assert rev.settings["debias_orders"] == 1 and "passage_attention_reversed" not in rev.timings
    # the second measurement is the reversed prompt's, reported per passage in the given order
    torch.testing.assert_close(torch.tensor(two.timings["passage_attention_reversed"]),
                               torch.tensor(rev.timings["passage_attention"][::-1]), rtol=1e-4, atol=1e-6)
    bias = tiny_qa.bias_curve(len(PASSAGES), "block")
    expect = D.two_order_relevance(torch.tensor(two.timings["passage_attention"]),
                                   torch.tensor(rev.timings["passage_attention"]), bias, D.CALIBRATION["block"])
    torch.testing.assert_close(torch.tensor(two.timings["calibrated_relevance"]), expect, rtol=1e-4, atol=1e-6)
    full = tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate")
    assert full.settings["debias_orders"] == 1 and full.timings["debias_passes"] == 1
    assert "debias_orders" not in tiny_qa.answer(q, PASSAGES, attention="block", debias="sort").settings
    with pytest.raises(ValueError, match="debias_orders"):
        tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate", debias_orders=3)


def test_debias_calibration_setting(tiny_qa):
    q = "What torque for the fan hub bolts?"
    diff = tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate", debias_calibration="difference")
    ratio = tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate", debias_calibration="ratio")
    assert (diff.settings["debias_calibration"], ratio.settings["debias_calibration"]) == ("difference", "ratio")
    assert tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate").settings["debias_calibration"] == "ratio"
    assert tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate").settings["debias_calibration"] == \
        D.CALIBRATION["full"]
    bias = tiny_qa.bias_curve(len(PASSAGES), "block")
    mass, rev = (torch.tensor(ratio.timings[k]) for k in ("passage_attention", "passage_attention_reversed"))
    rel = D.two_order_relevance(mass, rev.flip(0), bias, "ratio")  # rev is per passage; the formula wants slots
    torch.testing.assert_close(torch.tensor(ratio.timings["calibrated_relevance"]), rel, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(ratio.timings["passage_weights"]),
                               D.log_weights(rel, mass, form="ratio").exp(), rtol=1e-4, atol=1e-6)
    assert "debias_calibration" not in tiny_qa.answer(q, PASSAGES, attention="block", debias="sort").settings
    with pytest.raises(ValueError, match="debias_calibration"):
        tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate", debias_calibration="quotient")


def test_debias_strength_setting_scales_the_log_weights(tiny_qa, caplog):
    q = "What torque for the fan hub bolts?"
    one = tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate", debias_calibration="pearson")
    assert one.settings["debias_strength"] == D.STRENGTH["pearson"]
    two = tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate", debias_calibration="pearson",
                         debias_strength=2.0)
    assert two.settings["debias_strength"] == 2.0
    assert two.timings["calibrated_relevance"] == one.timings["calibrated_relevance"]  # measured before it acts
    log1, log2 = (torch.tensor(a.timings["passage_weights"]).log() for a in (one, two))
    assert log1.abs().max() > 1e-3  # the passages got different weights, so the scaling shows
    torch.testing.assert_close(log2, 2 * log1, rtol=1e-4, atol=1e-6)
    # strength 0 rescales nothing: the same answer as no debiasing
    zero = tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate", debias_strength=0, max_new_tokens=8)
    assert zero.timings["passage_weights"] == [1.0] * len(PASSAGES)
    assert zero.text == tiny_qa.answer(q, PASSAGES, attention="full", debias="none", max_new_tokens=8).text
    for bad in (-0.5, float("nan"), float("inf"), True, "1.5"):
        with pytest.raises(ValueError, match="debias_strength"):
            tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate", debias_strength=bad)
    with caplog.at_level("WARNING", logger="ldqa.app.api"):
        ans = tiny_qa.answer(q, PASSAGES, attention="full", debias="sort", debias_strength=1.5)
    assert "debias_strength" not in ans.settings and "debias_strength=1.5" in caplog.text


def test_calibration_settings_ignored_by_other_methods_say_so(tiny_qa, caplog):
    q = "What torque for the fan hub bolts?"
    with caplog.at_level("WARNING", logger="ldqa.app.api"):
        ans = tiny_qa.answer(q, PASSAGES, attention="block", debias="sort", debias_calibration="pearson")
    assert "debias_calibration" not in ans.settings
    assert "debias_calibration='pearson'" in caplog.text and "ignored with debias='sort'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ldqa.app.api"):
        cal = tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate", debias_calibration="pearson")
    assert "ignored" not in caplog.text
    # the bias curve's lookup (here an estimate: the store's first calibrate question) is part of debias_ms
    assert 0 < cal.timings["bias_curve_ms"] <= cal.timings["debias_ms"]


def test_calibrate_reorder_with_two_orders_reuses_the_reversed_context(tiny_qa, monkeypatch):
    q = "What torque for the fan hub bolts?"
    cal = tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate").timings
    monkeypatch.setattr(D, "reorder_for_bias", lambda rel, bias: list(range(len(rel)))[::-1])
    rr = tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate+reorder")
    assert [p.title for p in rr.passages] == [p.title for p in PASSAGES[::-1]]
    assert rr.timings["debias_passes"] == 2  # measured twice; the reversed context was not built again
    for key in ("passage_attention", "passage_attention_reversed", "calibrated_relevance"):
        assert rr.timings[key] == cal[key][::-1]  # in the final order
    for c in rr.citations:
        assert c.title == rr.passages[c.n - 1].title


def test_pearson_weights_use_the_measured_order(tiny_qa, monkeypatch):
    q = "What torque for the fan hub bolts?"
    bias = torch.tensor([0.05, 0.30, 0.10, 0.20])  # far from flat, so the normalisation's order shows
    monkeypatch.setattr(tiny_qa.engine, "bias_curve", lambda k, mode, **kw: bias)
    cal = tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate", debias_calibration="pearson")
    assert cal.settings["debias_calibration"] == "pearson" and cal.timings["debias_passes"] == 1
    mass = torch.tensor(cal.timings["passage_attention"])
    rel = D.calibrated_relevance(mass, bias, "pearson")
    torch.testing.assert_close(torch.tensor(cal.timings["calibrated_relevance"]), rel, rtol=1e-4, atol=1e-6)
    weights = D.log_weights(rel, mass, form="pearson", bias=bias).exp()
    torch.testing.assert_close(torch.tensor(cal.timings["passage_weights"]), weights, rtol=1e-4, atol=1e-6)
    order = [2, 0, 3, 1]  # reordering moves each passage's weight with it; the normalisation stays as measured
    monkeypatch.setattr(D, "reorder_for_bias", lambda rel, bias: order)
    rr = tiny_qa.answer(q, PASSAGES, attention="full", debias="calibrate+reorder", debias_calibration="pearson")
    assert [p.title for p in rr.passages] == [PASSAGES[i].title for i in order]
    torch.testing.assert_close(torch.tensor(rr.timings["passage_weights"]), weights[order], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ["calibrate+reorder", "sort"])
def test_debiased_answer_reports_the_blocks_it_encoded(tiny_qa, method):
    # a cold store: the first build encodes every passage; the answer must say so, not the later builds' hits
    q = "What torque for the fan hub bolts?"
    cold = tiny_qa.answer(q, PASSAGES, attention="block", debias=method).timings
    assert cold["debias_passes"] >= 2  # the final context is a later build, or the check proves nothing
    assert cold["kv_misses"] == len(PASSAGES) and cold["kv_hits"] == 0 and cold["encode_ms"] > 0
    assert cold["tokens_reused"] == 0  # no passage body came from the store
    warm = tiny_qa.answer(q, PASSAGES, attention="block", debias=method).timings
    assert warm["kv_misses"] == 0 and warm["kv_hits"] == len(PASSAGES)
    assert warm["tokens_reused"] > 0 and warm["tokens_computed"] < cold["tokens_computed"]


def test_sort_moves_the_most_attended_passage_last(tiny_qa):
    ans = tiny_qa.answer("What torque for the fan hub bolts?", PASSAGES, debias="sort")
    att = ans.timings["passage_attention"]  # measured on the final order
    assert ans.timings["debias_passes"] >= 2 or att == sorted(att)


def test_debias_rejects_bad_settings(tiny_qa):
    with pytest.raises(ValueError, match="debias"):
        tiny_qa.answer("q?", PASSAGES, debias="buckets-of-fun")
    with pytest.raises(ValueError, match="not 'retrieval'"):
        tiny_qa.answer("q?", PASSAGES, attention="retrieval", debias="sort")


def test_calibration_passages_come_from_the_bundled_sample(small_tokenizer):
    from ldqa.app.api import _sample_texts
    from ldqa.attention.bias_curve import calibration_passages

    ps = calibration_passages(small_tokenizer, 5, _sample_texts(), tokens=40)
    assert len(ps) == 5 and all(p.text.strip() for p in ps)
    sample_text = " ".join(p.read_text(errors="ignore") for p in SAMPLE.iterdir() if p.suffix != ".pdf").lower()
    assert ps[0].text.split()[0].lower() in sample_text


def test_bucket_branch_with_scale_one_is_the_model_and_other_scales_change_only_global_layers(lm):
    from ldqa.attention.buckets import BucketEnsemble

    seg = build_prompt(lm.tokenizer, PASSAGES, "What torque for the fan hub bolts?")
    ids = torch.tensor([seg.ids()])
    pos = torch.arange(ids.shape[1])
    plain = lm.model(ids, pos, None)
    caches = []
    for s in (1.0, 0.5, 2.0):
        c = lm.model.new_cache(capacity=ids.shape[1] + 4)
        c.theta_scale = s
        caches.append((c, lm.model(ids, pos, c)))
    torch.testing.assert_close(caches[0][1], plain, atol=1e-5, rtol=0)  # scale 1: the model unchanged
    assert (caches[1][1] - plain).abs().max() > 1e-5  # another base: other logits (random tiny weights: slightly)
    cfg = lm.model.cfg
    first_global = cfg.layer_types.index("full")
    # layers before the first global layer are untouched by the scale; the first global layer's keys move
    for layer in range(first_global):
        torch.testing.assert_close(caches[1][0].keys(layer)[:, :, :ids.shape[1]],
                                   caches[0][0].keys(layer)[:, :, :ids.shape[1]], atol=1e-6, rtol=0)
    assert not torch.allclose(caches[1][0].keys(first_global)[:, :, :ids.shape[1]],
                              caches[0][0].keys(first_global)[:, :, :ids.shape[1]], atol=1e-4)
    # the ensemble picks the most confident branch, and appends each step to every branch
    ens = BucketEnsemble(lm.model, [c for c, _ in caches])
    conf = [float(torch.softmax(x[0, -1], -1).max()) for _, x in caches]
    best = max(range(3), key=conf.__getitem__)
    assert torch.equal(ens.pick([x for _, x in caches]), caches[best][1]) and ens.chosen[best] == 1
    n = ids.shape[1]
    ens(torch.tensor([[5]]), torch.tensor([n]), caches[0][0])
    assert all(c.length == n + 1 for c, _ in caches) and sum(ens.chosen) == 2


def test_buckets_through_the_api(tiny_qa):
    ans = tiny_qa.answer("What torque for the fan hub bolts?", PASSAGES, debias="buckets", max_new_tokens=4)
    assert ans.settings["bucket_scales"] == list(D.BUCKET_SCALES)
    assert ans.timings["debias_passes"] == len(D.BUCKET_SCALES)
    assert sum(ans.timings["bucket_steps_chosen"]) == max(1, ans.timings["generated_tokens"])
    assert [p.title for p in ans.passages] == [p.title for p in PASSAGES]  # order kept
    with pytest.raises(ValueError, match="buckets"):
        tiny_qa.answer("q?", PASSAGES, attention="block", debias="buckets")


def test_buckets_reuse_kept_exact_prefills_per_rope_scale(tiny_qa):
    """Attention Buckets' branch of scale 1 is the plain exact prefill ("none" on the same prompt leaves
    it to reuse); the other branches are kept under their own scale; answers equal fresh ones."""
    q = "What torque for the fan hub bolts?"
    tiny_qa.engine.clear_memo()
    tiny_qa.answer(q, PASSAGES, debias="none", max_new_tokens=4)
    warm = tiny_qa.answer(q, PASSAGES, debias="buckets", max_new_tokens=4)
    assert sorted(k[2] for k in tiny_qa.prefill_memo.keys()) == sorted(D.BUCKET_SCALES)
    again = tiny_qa.answer(q, PASSAGES, debias="buckets", max_new_tokens=4)
    assert 0 < warm.timings["reused_prefill_ms"] < again.timings["reused_prefill_ms"]
    tiny_qa.engine.clear_memo()
    fresh = tiny_qa.answer(q, PASSAGES, debias="buckets", max_new_tokens=4)
    assert fresh.timings["reused_prefill_ms"] == 0.0
    for a in (warm, again):
        assert a.text == fresh.text and a.timings["bucket_steps_chosen"] == fresh.timings["bucket_steps_chosen"]


def test_bucket_branches_share_the_layers_below_the_first_global_one_bit_for_bit(tiny_qa, monkeypatch):
    """Attention Buckets runs the layers before the first global layer once for all branches; each branch
    (its logits, every layer's K/V, the recorded queries) must equal its own whole prefill exactly."""
    from ldqa.attention.buckets import shared_layers
    from ldqa.attention.context import exact_prefill

    model = tiny_qa.llm.model
    first = model.cfg.layer_types.index("full")
    assert first > 0  # the tiny Gemma 3 has sliding layers first, so something is shared
    prompt = build_prompt(tiny_qa.llm.tokenizer, PASSAGES, "What torque for the fan hub bolts?")
    fp, memo = tiny_qa.llm.fingerprint, tiny_qa.prefill_memo
    calls = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(k.get("start")) or real(*a, **k))
    tiny_qa.engine.clear_memo()
    shared = shared_layers(model, prompt, 4)
    split = [exact_prefill(model, fp, prompt, 4, s, shared, memo) for s in D.BUCKET_SCALES]
    assert shared["layer"] == first and sum(c is not None for c in calls) == len(D.BUCKET_SCALES)
    tiny_qa.engine.clear_memo()
    whole = [exact_prefill(model, fp, prompt, 4, s, memo=memo) for s in D.BUCKET_SCALES]
    n = len(prompt.ids())
    for a, b in zip(split, whole):
        assert torch.equal(a.logits, b.logits) and a.cache.length == b.cache.length == n
        assert torch.equal(a.cache.positions, b.cache.positions)
        for layer in range(model.cfg.num_layers):
            assert torch.equal(a.cache.keys(layer), b.cache.keys(layer))
            assert torch.equal(a.cache.values(layer), b.cache.values(layer))
        assert a.queries.keys() == b.queries.keys()
        assert all(torch.equal(a.queries[k], b.queries[k]) for k in a.queries)
    # through the API: the shared start is used when two or more branches are not kept, and answers match
    tiny_qa.engine.clear_memo()
    calls.clear()
    ans = tiny_qa.answer("What torque for the fan hub bolts?", PASSAGES, debias="buckets", max_new_tokens=4)
    assert sum(c is not None for c in calls) == len(D.BUCKET_SCALES)
    tiny_qa.engine.share_bucket_layers = False  # whole prefills only
    calls.clear()
    tiny_qa.engine.clear_memo()
    plain = tiny_qa.answer("What torque for the fan hub bolts?", PASSAGES, debias="buckets", max_new_tokens=4)
    assert all(c is None for c in calls)
    assert ans.text == plain.text and ans.timings["bucket_steps_chosen"] == plain.timings["bucket_steps_chosen"]
    with pytest.raises(ValueError, match="start layer"):
        model(torch.tensor([[1, 2]]), torch.arange(2), None, start=(model.cfg.num_layers + 1, torch.zeros(1, 2, 8)))


def test_bias_curve_under_another_rope_scale(tiny_qa):
    a = tiny_qa.bias_curve(3, "full", n_examples=2, seed=1)
    half = tiny_qa.bias_curve(3, "full", n_examples=2, seed=1, theta_scale=0.5)
    assert half.shape == (3,) and not torch.equal(half, a)
    assert any("rope0.5" in p.name for p in Path(tiny_qa_cache(tiny_qa)).glob("debias/*.json"))
    torch.testing.assert_close(tiny_qa.bias_curve(3, "full", n_examples=2, seed=1), a, atol=0, rtol=0)
    with pytest.raises(ValueError, match="theta_scale"):
        tiny_qa.bias_curve(3, "block", n_examples=2, seed=1, theta_scale=0.5)


def test_reused_exact_prefill_gives_the_same_answers(tiny_qa):
    """Full attention keeps its last prefill: none -> calibrate -> calibrate+reorder -> none on one prompt
    reuse it (reused_prefill_ms > 0) and give exactly the answers and attention of fresh prefills."""
    q = "What torque for the fan hub bolts?"
    methods = ["none", "calibrate", "calibrate+reorder", "sort", "none"]
    warm = [tiny_qa.answer(q, PASSAGES, debias=m) for m in methods]
    fresh = []
    for m in methods:
        tiny_qa.engine.clear_memo()
        fresh.append(tiny_qa.answer(q, PASSAGES, debias=m))
    assert warm[0].timings["reused_prefill_ms"] == 0.0
    assert all(a.timings["reused_prefill_ms"] > 0 for a in warm[1:])
    assert all(a.timings["reused_prefill_ms"] == 0.0 for a in fresh)
    for w, f in zip(warm, fresh):
        assert w.text == f.text and [p.title for p in w.passages] == [p.title for p in f.passages]
        assert w.timings.get("passage_attention") == f.timings.get("passage_attention")
        assert w.timings.get("passage_weights") == f.timings.get("passage_weights")
    other = tiny_qa.answer("Which error code is the humidity sensor?", PASSAGES)
    assert other.timings["reused_prefill_ms"] == 0.0  # another prompt is computed


def test_kv_caches_stack_into_a_batch_and_come_back_as_sequences():
    from ldqa.attention.kv_cache import KVCache

    def filled(value, positions=(0, 1, 2)):
        c = KVCache(2, 1, 1, 4, capacity=4)
        for layer in range(2):
            c.write(layer, torch.full((1, 1, 3, 4), value + layer), torch.full((1, 1, 3, 4), -value),
                    torch.tensor(positions))
        c.advance(3)
        return c

    a, b = filled(1.0), filled(5.0)
    batch = KVCache.stack([a, b])
    assert batch.length == 3 and batch.keys(1).shape == (2, 1, 3, 4) and batch.policy is None
    assert torch.equal(batch.keys(1)[1], b.keys(1)[0]) and torch.equal(batch.values(0)[0], a.values(0)[0])
    one = batch.sequence(1)
    assert one.keys(0).shape == (1, 1, 3, 4) and torch.equal(one.keys(1), b.keys(1))
    assert torch.equal(one.positions, a.positions)
    one.write(0, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), torch.tensor([3]))  # decoding on it
    one.advance(1)
    assert one.length == 4 and batch.length == 3 and torch.equal(batch.sequence(0).keys(0), a.keys(0))
    for bad in (filled(2.0, (0, 1, 5)), KVCache(2, 1, 1, 4, capacity=8)):
        with pytest.raises(ValueError, match="KVCache.stack"):
            KVCache.stack([a, bad])


def test_block_modes_measure_both_orders_with_one_question_pass(tiny_qa, monkeypatch):
    rt = tiny_qa.engine.block_runtime
    calls = []
    orders = rt.prefill_orders
    monkeypatch.setattr(rt, "prefill_orders", lambda o, *a, **kw: calls.append(len(o)) or orders(o, *a, **kw))
    q = "What torque for the fan hub bolts?"
    for mode in ("block", "block+recompute"):
        calls.clear()
        ans = tiny_qa.answer(q, PASSAGES, attention=mode, debias="calibrate+reorder")
        assert calls == [2] and ans.timings["debias_passes"] >= 2 and "passage_attention_reversed" in ans.timings
    calls.clear()
    tiny_qa.answer(q, PASSAGES, attention="block", debias="calibrate", debias_orders=1)
    tiny_qa.answer(q, PASSAGES, attention="block", debias="sort")
    assert calls == []  # one order, or sort's rounds: measured one order at a time


def test_kv_cache_clone_is_independent():
    from ldqa.attention.kv_cache import KVCache

    c = KVCache(2, 1, 1, 4, capacity=4)
    for layer in range(2):
        c.write(layer, torch.ones(1, 1, 3, 4), torch.full((1, 1, 3, 4), 2.0), torch.arange(3))
    c.advance(3)
    c.theta_scale, c.policy = 2.0, object()
    d = c.clone()
    assert d.length == 3 and d.theta_scale == 2.0 and d.policy is None
    c.write_at(0, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), torch.tensor([1]))
    c.write(1, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.tensor([3, 4]))
    c.advance(2)
    assert torch.equal(d.keys(0), torch.ones(1, 1, 3, 4)) and torch.equal(d.values(1), torch.full((1, 1, 3, 4), 2.0))
    assert d.length == 3 and d.positions.tolist() == [0, 1, 2]



def test_debiasing_a_question_without_passages_answers_it_plainly(tiny_model_dir, tmp_path):
    """A retrieval that found nothing (bm25, no chunk shares a word with the question) leaves no passage to
    measure: the calibrate and sort methods answer as without debiasing instead of failing."""
    from pathlib import Path

    from ldqa.app.api import LongDocQA

    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=4)
    qa.ingest([Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"])
    q = "Zyxwv qwertz?"
    none = qa.ask(q, retriever="bm25", debias="none")
    assert none.passages == []
    for mode, method in (("full", "calibrate"), ("full", "calibrate+reorder"), ("full", "sort"),
                         ("block", "calibrate+reorder")):
        ans = qa.ask(q, retriever="bm25", attention=mode, debias=method)
        assert ans.passages == [] and ans.text == none.text, (mode, method)


@pytest.mark.parametrize("attention", ["block", "block+recompute"])
def test_final_build_computes_the_question_under_the_intervention_in_its_own_pass(tmp_path, tiny_model_dir,
                                                                                   monkeypatch, attention):
    """Block modes build the final order with the intervention as the cache's hook (context tokens recomputed
    in that pass attend normally, the question biased): the same logits and decode steps as building the
    final order plainly and recomputing the question under the intervention after it, with one pass of
    the question fewer. fp32 weights: a quantized format multiplies a pass of few rows through another
    kernel than a longer one, which would differ by its rounding, not by this logic."""
    from ldqa.attention.engine import AttentionConfig

    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    tiny_qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("llama")), weights="fp32",
                        max_new_tokens=6)

    q = "What torque for the fan hub bolts?"
    eng, llm = tiny_qa.engine, tiny_qa.engine.llm
    # a strong intervention (log weights of several units), so that biasing the wrong rows would show
    # (no anchor passages: `build` below lays out the prompt alone, as the engine's callers give it)
    cfg = AttentionConfig.from_kwargs(attention, debias="calibrate+reorder", debias_strength=40,
                                      anchor_passages=0).resolved()

    def build(ps):
        return build_prompt(llm.tokenizer, ps, q)

    calls = []
    forward = type(llm.model).forward

    def counting(self, tokens, *a, **k):
        calls.append(tokens.shape[1])
        return forward(self, tokens, *a, **k)

    monkeypatch.setattr(type(llm.model), "forward", counting)
    tiny_qa.answer(q, PASSAGES, attention=attention, debias="calibrate+reorder", debias_strength=40,
                   anchor_passages=0)  # blocks, curve

    def run():
        calls.clear()
        out = eng.context(PASSAGES, build, cfg, 8)
        ctx = out.context
        steps = [ctx.logits[0, -1]]
        for t in (11, 12, 13):
            steps.append(llm.model(torch.tensor([[t]]), torch.tensor([ctx.cache.next_position()]), ctx.cache)[0, -1])
        return out, torch.stack(steps), list(calls)

    monkeypatch.setattr(D, "measured_scores", lambda *a: None)  # both runs rank by their own selection pass
    merged, merged_logits, merged_calls = run()
    plain = D.debiased_context
    monkeypatch.setattr(D, "debiased_context", lambda *a, **k: plain(*a, **{**k, "prompt": None}))
    separate, separate_logits, separate_calls = run()
    assert [p.title for p in merged.passages] == [p.title for p in separate.passages]
    assert [p.title for p in merged.passages] != [p.title for p in PASSAGES]  # reordered: a final build ran
    assert isinstance(merged.context.cache.policy, D.DebiasKV)  # the intervention serves the decode steps
    torch.testing.assert_close(merged_logits, separate_logits, atol=1e-4, rtol=0)
    n_q = len(build(PASSAGES).question)
    merged_calls, separate_calls = merged_calls[:-3], separate_calls[:-3]  # the passes before decoding
    assert len(merged_calls) == len(separate_calls) - 1 and separate_calls[-1] == n_q


def test_measured_scores_average_the_two_orders_per_passage_in_the_final_order():
    from types import SimpleNamespace

    from ldqa.attention.segments import PromptSegments

    a, b, c = object(), object(), object()
    # given order a b c: spans (1, 4) (4, 6) (6, 10); reversed c b a: c's header one token longer
    given = SimpleNamespace(prompt=PromptSegments([0], [[1], [1], [1]], [[5, 5], [6], [7, 7, 7]], [9]),
                            token_mass=torch.arange(11, dtype=torch.float))
    rev = SimpleNamespace(prompt=PromptSegments([0], [[1, 1], [1], [1]], [[7, 7, 7], [6], [5, 5]], [9]),
                          token_mass=100 + torch.arange(11, dtype=torch.float))
    out = D.measured_scores(given, rev, [a, b, c], [c, a, b])
    # c: given slots 6-9, reversed slots 1-5 (header 2 tokens): aligned by the last 4
    torch.testing.assert_close(out[0], (torch.tensor([6., 7, 8, 9]) + torch.tensor([102., 103, 104, 105])) / 2)
    torch.testing.assert_close(out[1], (torch.tensor([1., 2, 3]) + torch.tensor([108., 109, 110])) / 2)  # a
    torch.testing.assert_close(out[2], (torch.tensor([4., 5]) + torch.tensor([106., 107])) / 2)  # b
    assert [len(x) for x in D.measured_scores(given, None, [a, b, c], [b])] == [2]
    assert D.measured_scores(SimpleNamespace(prompt=given.prompt, token_mass=None), None, [a], [a]) is None


def test_block_recompute_debiased_selection_ranks_by_the_measured_attention(tiny_qa, monkeypatch):
    """With calibrate+reorder, block+recompute's final build ranks the windows by the question's attention
    measured over the two block orders (no selection pass of its own): the measurement passes and the one
    final pass; the slots it recomputes are the best windows of those scores."""
    from ldqa.attention.block_attention import BlockRuntime

    q = "What torque for the fan hub bolts?"
    tiny_qa.answer(q, PASSAGES, attention="block+recompute", debias="calibrate+reorder")  # blocks and curve
    seen = {}
    top = BlockRuntime._top_windows

    def spy(self, mass, spans, ratio, window):
        seen["mass"], seen["spans"] = mass.clone(), list(spans)
        seen["chosen"] = top(self, mass, spans, ratio, window)
        return seen["chosen"]

    def no_pass(*a, **k):
        raise AssertionError("the selection pass ran")

    monkeypatch.setattr(BlockRuntime, "_top_windows", spy)
    monkeypatch.setattr(BlockRuntime, "_select_by_question", no_pass)
    ans = tiny_qa.answer(q, PASSAGES, attention="block+recompute", debias="calibrate+reorder")
    assert ans.timings["tokens_recomputed"] == len(seen["chosen"]) > 0
    assert all(seen["mass"][a:b].sum() > 0 for a, b in seen["spans"])  # every passage scored, as measured
    # without debiasing there is no measurement: the selection pass runs
    with pytest.raises(AssertionError, match="selection pass ran"):
        tiny_qa.answer(q, PASSAGES, attention="block+recompute", debias="none")


def test_biased_decode_step_takes_the_c_kernel_with_the_einsum_paths_result(monkeypatch):
    from ldqa.kernels import cpu_linear

    if not cpu_linear.available():
        pytest.skip("no C kernel on this machine")
    g = torch.Generator().manual_seed(3)
    L = 300
    q, k, v = torch.randn(1, 12, 1, 64, generator=g), torch.randn(1, 2, L, 64, generator=g), torch.randn(1, 2, L, 64, generator=g)
    hook = D.DebiasKV(log_w=torch.randn(L + 20, generator=g), scale=0.125)
    pos = torch.tensor([L - 1]), torch.arange(L)
    calls = []
    kernel = cpu_linear.decode_attention
    monkeypatch.setattr(cpu_linear, "decode_attention", lambda *a: calls.append(1) or kernel(*a))
    fast = hook.forward(0, q, k, v, *pos, None)
    assert calls == [1]
    monkeypatch.setattr(cpu_linear, "decode_attention_fits", lambda *a: False)
    slow = hook.forward(0, q, k, v, *pos, None)
    assert calls == [1]
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert (slow - D.DebiasKV(log_w=torch.zeros(L + 20), scale=0.125).forward(0, q, k, v, *pos, None)).abs().max() > 1e-2


def test_recorded_queries_are_copies_and_the_prefill_memo_counts_them(tiny_qa):
    """A prefill's recorded question queries own just their rows (a view would keep every row's queries of
    the pass alive with them, in each kept prefill), and the memo's byte count includes them."""
    from ldqa.attention.context import exact_prefill

    model = tiny_qa.llm.model
    prompt = build_prompt(tiny_qa.llm.tokenizer, PASSAGES, "What torque for the fan hub bolts?")
    tiny_qa.engine.clear_memo()
    memo = tiny_qa.prefill_memo
    ctx = exact_prefill(model, tiny_qa.llm.fingerprint, prompt, 4, memo=memo)
    assert ctx.queries
    own = 0
    for q in ctx.queries.values():
        assert q.dtype == torch.float32 and q.shape[1] == len(prompt.question)
        assert q.untyped_storage().nbytes() == q.numel() * 4  # its own rows only
        own += q.numel() * 4
    (entry,) = memo.entries.values()
    cache_copy = ctx.cache.capacity * ctx.cache.nbytes() // ctx.cache.length
    assert entry["bytes"] == cache_copy + own
    rec = D.DebiasKV(n_record=3, scale=1.0)
    q = torch.randn(1, 4, 10, 8)
    rec.forward(0, q, torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), torch.arange(10), torch.arange(10), None)
    assert torch.equal(rec.queries[0], q[0, :, -3:]) and rec.queries[0].untyped_storage().nbytes() == 4 * 3 * 8 * 4
