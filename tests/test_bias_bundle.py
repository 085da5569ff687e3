"""Bias curves shipped with ldqa (`ldqa.attention.bias_curve.BUNDLED`): used instead of estimating when
the cache has none of that name, for the exact model and weights they were measured on, and equal to what
this machine estimates."""

from __future__ import annotations

import json

import pytest
import torch

from ldqa.attention import bias_curve as B


def test_a_bundled_curve_is_used_and_cached_without_estimating(tmp_path):
    bundled = tmp_path / "curves.json"
    bundled.write_text(json.dumps({"curves": {"abc-k2-full-n16-s0": [0.25, 0.5]}}))
    path = tmp_path / "cache" / "abc-k2-full-n16-s0.json"

    def estimate():
        raise AssertionError("estimated although a bundled curve exists")

    assert B.load_or_estimate_bias(path, estimate, bundled).tolist() == [0.25, 0.5]
    assert json.loads(path.read_text())["bias"] == [0.25, 0.5]  # now in the cache
    # another name (another fingerprint, k or mode): estimated as before
    other = tmp_path / "cache" / "def-k2-full-n16-s0.json"
    assert B.load_or_estimate_bias(other, lambda: torch.tensor([0.1, 0.2]), bundled).tolist() == \
        pytest.approx([0.1, 0.2])
    # a missing or broken bundle never stops an estimate
    bundled.write_text("{not json")
    third = tmp_path / "cache" / "abc-k3-full-n16-s0.json"
    assert B.load_or_estimate_bias(third, lambda: torch.tensor([1.0, 2.0, 3.0]), bundled).tolist() == [1, 2, 3]
    assert B.bundled_curves(tmp_path / "missing.json") == {}


def test_shipped_curves_are_well_formed():
    data = json.loads(B.BUNDLED.read_text())
    curves, made = data["curves"], data["made_with"]
    assert curves and set(curves) == set(made)
    for name, curve in curves.items():
        k = made[name]["k"]
        assert f"-k{k}-" in name and len(curve) == k
        assert all(0 < x < 1 for x in curve) and sum(curve) < 1  # attention mass shares of each slot
    assert {m["k"] for m in made.values() if m["attention"] == "full"} >= set(range(1, 11))


def test_the_default_model_s_curves_ship_for_the_default_top_k():
    """The default model at the default top_k needs no estimate, with full attention (--debias calibrate)
    or block attention (whose default debiasing reads a curve): the demo's second setting is one of them."""
    from ldqa.app.api import DEFAULT_TOP_K
    from ldqa.attention.block_attention import BlockConfig
    from ldqa.attention.loader import DEFAULT_MODEL, default_weights

    made = json.loads(B.BUNDLED.read_text())["made_with"]
    have = {(m["model"], m["weights"], m["attention"], m["k"], m.get("anchor_passages", 0)) for m in made.values()}
    for mode in ("full", "block"):  # block: its blocks after the default anchor passages, as answers read it
        anchor = BlockConfig().resolved(mode).anchor_passages or 0
        assert (DEFAULT_MODEL, default_weights(), mode, DEFAULT_TOP_K, anchor) in have, mode


@pytest.mark.slow
def test_shipped_curves_are_those_of_the_models_they_name_and_match_an_estimate(tmp_path):
    """Each name starts with the fingerprint of the model and weights it says it was measured on, and a
    fresh estimate of k = 2 on this machine gives the shipped curve (to float noise of other CPU kernels)."""
    from ldqa.app.api import LongDocQA
    from ldqa.attention.loader import model_fingerprint

    made = json.loads(B.BUNDLED.read_text())["made_with"]
    for name, m in made.items():
        assert name.startswith(model_fingerprint(m["model"], m["weights"])[:16])
    qa = LongDocQA(store=tmp_path / "s", model="gemma3-270m")  # (the 1.5B's estimate takes minutes)
    name = qa.engine.bias_curve_path(2, "full").stem
    shipped = torch.tensor(json.loads(B.BUNDLED.read_text())["curves"][name])
    from unittest import mock

    # the estimate itself, bypassing the cache and the bundle
    with mock.patch("ldqa.attention.engine.load_or_estimate_bias", lambda path, est: est()):
        fresh = qa.engine.bias_curve(2, "full")
    assert torch.allclose(fresh, shipped, rtol=1e-3, atol=1e-5), (fresh, shipped)
