"""Block-reusable KV states: block prefill, RoPE re-encoding, assembly, selective recomputation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ldqa.app.prompt import build_prompt
from ldqa.attention.block_attention import BlockRuntime, reencode_keys_
from ldqa.attention.loader import load_model


@dataclass
class P:
    title: str
    text: str
    page: int | None = None


PASSAGES = [P("Kiln manual", "The SL-30 chamber holds 3.2 cubic metres of stacked lumber. " * 3),
            P("Bulletin", "Tighten each fan hub bolt to 18 Nm with a calibrated wrench. " * 4, 2),
            P("Log", "Fan No. 2 was replaced on 14 March 2023 after bearing noise. " * 2)]


@pytest.fixture(params=["gemma3", "llama"])
def lm(request, tiny_model_dir):
    return load_model(str(tiny_model_dir(request.param)))


def _full_logits(lm, ids):
    return lm.model(torch.tensor([ids]), torch.arange(len(ids)), None, all_logits=True)[0]


def test_block_prefill_equals_forward_of_prefix_plus_chunk(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES, "q?")
    rt = BlockRuntime(lm.model, "fp")
    k, v = rt.encode_block(seg.prefix, seg.passages[1])
    ids = seg.prefix + seg.passages[1]
    cache = lm.model.new_cache()
    lm.model(torch.tensor([ids]), torch.arange(len(ids)), cache)
    ref_k, ref_v = cache.block(len(seg.prefix), len(ids))
    assert torch.allclose(k, ref_k, atol=1e-4) and torch.allclose(v, ref_v, atol=1e-4)


def test_reencoded_keys_equal_keys_computed_at_target_positions(lm):
    rt = BlockRuntime(lm.model, "fp")
    assert rt.self_check()
    ids = torch.tensor([lm.tokenizer.encode("Tighten each fan hub bolt to 18 Nm.")])
    n = ids.shape[1]
    for offset in (1, 513, 32768):
        a, b = lm.model.new_cache(), lm.model.new_cache()
        lm.model(ids, torch.arange(n), a)
        lm.model(ids, torch.arange(offset, offset + n), b)
        moved = reencode_keys_(lm.model, a.block(0, n)[0], offset)
        assert (moved - b.block(0, n)[0]).abs().max().item() < 1e-5 * max(1.0, b.block(0, n)[0].abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reencoding_all_layers_at_once_equals_a_rotation_per_layer_bit_for_bit(lm, dtype):
    from ldqa.kernels import dispatch

    groups = lm.model.rope_layer_groups()
    assert sorted(i for _, layers in groups for i in layers) == list(range(lm.model.cfg.num_layers))
    thetas = {lm.model.cfg.theta_for(i) for i in range(lm.model.cfg.num_layers)}
    assert len(groups) == len(thetas)  # gemma3: local and global layers
    keys = torch.randn(lm.model.cfg.num_layers, 2, 7, lm.model.cfg.head_dim).to(dtype)
    for delta in (3, 1000, -5):
        want = keys.clone()
        for layer in range(len(want)):
            k32 = want[layer].float()
            dispatch.rope_reencode_(k32, delta, inv_freq=lm.model.freqs_for(layer))
            want[layer].copy_(k32)
        got = reencode_keys_(lm.model, keys.clone(), delta)
        assert torch.equal(got, want) and not torch.equal(got, keys)


@pytest.mark.parametrize("headers", ["cached", "fresh"])
def test_recompute_all_tokens_reproduces_full_attention(lm, headers):
    seg = build_prompt(lm.tokenizer, PASSAGES, "How much lumber does the chamber hold?")
    rt = BlockRuntime(lm.model, "fp")
    cache, stats = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=1.0, headers=headers)
    n_headers = sum(map(len, seg.headers)) if headers == "cached" else 0  # fresh headers are not "recomputed"
    assert stats.tokens_reused == 0 and stats.header_tokens_reused == 0
    assert stats.tokens_recomputed == sum(map(len, seg.passages)) + n_headers
    ids = seg.ids()
    q = seg.question
    ours = lm.model(torch.tensor([q]), torch.arange(len(ids) - len(q), len(ids)), cache, all_logits=True)[0]
    ref = _full_logits(lm, ids)[-len(q):]
    assert (ours - ref).abs().max().item() < 1e-3


def test_block_mode_differs_from_full_but_keeps_the_prefix_and_question_exact(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES, "How much lumber does the chamber hold?")
    rt = BlockRuntime(lm.model, "fp")
    cache, stats = rt.assemble(seg, [None] * 3, mode="block", headers="fresh")
    ids = seg.ids()
    assert cache.length == len(ids) - len(seg.question)
    assert torch.equal(cache.positions, torch.arange(cache.length))
    assert stats.tokens_computed == sum(map(len, seg.passages)) + sum(map(len, seg.headers))
    # the first body attends to [prefix][body] in block mode but [prefix][header][body] in full: they differ
    full = lm.model.new_cache()
    lm.model(torch.tensor([ids[:cache.length]]), torch.arange(cache.length), full)
    p = len(seg.prefix)
    assert torch.allclose(cache.block(0, p)[0], full.block(0, p)[0], atol=1e-5)  # prefix exact
    h = len(seg.headers[0])
    assert torch.allclose(cache.block(p, p + h)[0], full.block(p, p + h)[0], atol=1e-4)  # header 1 exact
    assert not torch.allclose(cache.block(0, cache.length)[0], full.block(0, cache.length)[0], atol=1e-4)


def test_partial_recompute_moves_toward_full_attention(lm):
    """CacheBlend's deviation selection: the tokens whose keys deviate most, recomputed, move the logits
    toward full attention's (the question-aware selection optimizes the answer, not this distance)."""
    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    rt = BlockRuntime(lm.model, "fp")
    ids, q = seg.ids(), seg.question
    ref = _full_logits(lm, ids)[-1]
    errs = []
    for mode, r in (("block", 0.0), ("block+recompute", 0.5), ("block+recompute", 1.0)):
        cache, _ = rt.assemble(seg, [None] * 3, mode=mode, recompute_ratio=r, select="deviation")
        out = lm.model(torch.tensor([q]), torch.arange(len(ids) - len(q), len(ids)), cache)[0, -1]
        errs.append((out - ref).abs().max().item())
    assert errs[2] < 1e-3 and errs[1] < errs[0]


def test_bad_mode_and_ratio(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES[:1], "q?")
    rt = BlockRuntime(lm.model, "fp")
    with pytest.raises(ValueError, match="mode"):
        rt.assemble(seg, [None], mode="full")
    with pytest.raises(ValueError, match="recompute_ratio"):
        rt.assemble(seg, [None], mode="block+recompute", recompute_ratio=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_real_model_reencoding_is_exact_up_to_32k(name):
    lm = load_model(name)
    rt = BlockRuntime(lm.model, lm.fingerprint)
    assert rt.self_check(), rt.disabled_reason
    ids = torch.tensor([[lm.tokenizer.bos_id] + lm.tokenizer.encode("Tighten each fan hub bolt to 18 Nm.")])
    n = ids.shape[1]
    base = lm.model.new_cache()
    lm.model(ids, torch.arange(n), base)
    for offset in (7, 4096, 32768 - n):
        direct = lm.model.new_cache()
        lm.model(ids, torch.arange(offset, offset + n), direct)
        moved = reencode_keys_(lm.model, base.block(0, n)[0].clone(), offset)  # (L, kvh, n, d)
        want = direct.block(0, n)[0]
        # layer 0: keys depend on (token, position) only, so this is RoPE alone: 1e-5 relative
        assert (moved[0] - want[0]).abs().max() <= 1e-5 * want[0].abs().max()
        # deeper layers also carry the model's float error through attention (same relative positions)
        assert (moved - want).abs().max() <= 1e-3 * want.abs().max()


def test_prefill_with_question_in_the_same_pass_equals_assemble_then_question(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES, "How much lumber does the chamber hold?")
    rt = BlockRuntime(lm.model, "fp")
    ids, q = seg.ids(), seg.question
    cache, stats = rt.assemble(seg, [None] * 3, mode="block")
    two_pass = lm.model(torch.tensor([q]), torch.arange(len(ids) - len(q), len(ids)), cache)
    cache1, one_pass, stats1 = rt.prefill(seg, [None] * 3, mode="block")
    assert cache1.length == len(ids) and stats1.tokens_computed == stats.tokens_computed + len(q)
    assert (one_pass - two_pass).abs().max().item() < 1e-4
    _, exact, _ = rt.prefill(seg, [None] * 3, mode="block+recompute", recompute_ratio=1.0)
    assert (exact[0, -1] - _full_logits(lm, ids)[-1]).abs().max().item() < 1e-3


def test_cached_headers_are_blocks_after_the_prefix_and_only_the_question_is_fresh(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES, "How much lumber does the chamber hold?")
    rt = BlockRuntime(lm.model, "fp")
    cache, _ = rt.assemble(seg, [None] * 3, mode="block")  # default: cached headers; fills the header blocks
    _, _, stats = rt.prefill(seg, [None] * 3, mode="block")
    assert stats.headers == "cached" and stats.header_tokens_reused == sum(map(len, seg.headers))
    # no store: bodies are encoded again (misses); headers come from the runtime; the question is fresh
    assert stats.tokens_computed == sum(map(len, seg.passages)) + len(seg.question)
    # header 2's KV is [prefix][header 2] encoded as a block (positions P..) and moved to its slot
    p, h0, b0 = len(seg.prefix), len(seg.headers[0]), len(seg.passages[0])
    at, h = p + h0 + b0, len(seg.headers[1])
    ref = lm.model.new_cache()
    lm.model(torch.tensor([seg.prefix + seg.headers[1]]), torch.arange(p + h), ref)
    want_k, want_v = ref.block(p, p + h)
    got_k, got_v = cache.block(at, at + h)
    assert torch.allclose(got_k, reencode_keys_(lm.model, want_k.clone(), at - p), atol=1e-4)
    assert torch.allclose(got_v, want_v, atol=1e-4)
    # layer 0 keys depend on (token, position) only: equal to the keys computed at the target positions
    gap = lm.model.new_cache()
    lm.model(torch.tensor([seg.prefix + seg.headers[1]]), torch.cat([torch.arange(p), torch.arange(at, at + h)]), gap)
    assert torch.allclose(got_k[0], gap.block(p, p + h)[0][0], atol=1e-5)
    # ...which is not what full attention gives it (it would see passage 1)
    full = lm.model.new_cache()
    lm.model(torch.tensor([seg.ids()[:at + h]]), torch.arange(at + h), full)
    assert not torch.allclose(got_k, full.block(at, at + h)[0], atol=1e-4)
    # fresh and cached headers give different logits; both are finite
    _, fresh_logits, fresh = rt.prefill(seg, [None] * 3, mode="block", headers="fresh")
    _, cached_logits, _ = rt.prefill(seg, [None] * 3, mode="block")
    assert fresh.tokens_computed == stats.tokens_computed + sum(map(len, seg.headers))
    assert torch.isfinite(cached_logits).all() and not torch.allclose(fresh_logits, cached_logits, atol=1e-4)


def test_bad_header_mode(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES[:1], "q?")
    with pytest.raises(ValueError, match="headers"):
        BlockRuntime(lm.model, "fp").assemble(seg, [None], mode="block", headers="none")


def test_a_block_encoded_now_equals_the_stored_block_read_later(lm, tmp_path):
    """Cold (miss: encoded now) and warm (hit: read from the fp16 store) give the same KV, so an answer
    does not depend on whether its passages were stored before."""
    from ldqa.attention.block_attention import PrefillStats
    from ldqa.indexes.kv_store import KVBlockStore

    seg = build_prompt(lm.tokenizer, PASSAGES, "q?")
    rt = BlockRuntime(lm.model, "fp", kv_store=KVBlockStore(tmp_path / "kv"))
    stats = PrefillStats()
    cold = rt.get_block(seg.prefix, seg.passages[1], 7, stats)
    warm = rt.get_block(seg.prefix, seg.passages[1], 7, stats)
    assert (stats.kv_misses, stats.kv_hits) == (1, 1)
    assert torch.equal(cold[0], warm[0]) and torch.equal(cold[1], warm[1])
    fresh = rt.encode_block(seg.prefix, seg.passages[1])[0]
    assert not torch.equal(fresh, cold[0])  # the fp16 rounding is there (and now on both paths)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_block_of_nan_or_inf_is_never_stored(lm, tmp_path, bad):
    from ldqa.attention.block_attention import PrefillStats
    from ldqa.attention.generate import NonFiniteLogitsError
    from ldqa.indexes.kv_store import KVBlockStore, block_key

    seg = build_prompt(lm.tokenizer, PASSAGES, "q?")
    store = KVBlockStore(tmp_path / "kv")
    rt = BlockRuntime(lm.model, "fp", kv_store=store)
    real = rt.encode_block

    def poisoned(prefix, body, anchor=()):
        k, v = real(prefix, body, anchor)
        v[0, 0, 0, 0] = bad
        return k, v

    rt.encode_block = poisoned
    with pytest.raises(NonFiniteLogitsError, match="not stored"):
        rt.get_block(seg.prefix, seg.passages[1], 7, PrefillStats())
    assert store.get(block_key("fp", seg.prefix, seg.passages[1])) is None


def test_a_block_past_the_store_dtype_is_used_but_not_stored(lm, tmp_path):
    from ldqa.attention.block_attention import PrefillStats
    from ldqa.indexes.kv_store import KVBlockStore, block_key

    seg = build_prompt(lm.tokenizer, PASSAGES, "q?")
    store = KVBlockStore(tmp_path / "kv")  # fp16: 70000 overflows it
    rt = BlockRuntime(lm.model, "fp", kv_store=store)
    real = rt.encode_block

    def big(prefix, body, anchor=()):
        k, v = real(prefix, body, anchor)
        v[0, 0, 0, 0] = 70000.0
        return k, v

    rt.encode_block = big
    k, v = rt.get_block(seg.prefix, seg.passages[1], 7, PrefillStats())
    assert float(v[0, 0, 0, 0]) == 70000.0
    assert store.get(block_key("fp", seg.prefix, seg.passages[1])) is None


@pytest.mark.parametrize("select", ["question", "deviation", "lead"])
def test_every_selection_recomputing_all_tokens_reproduces_full_attention(lm, select):
    seg = build_prompt(lm.tokenizer, PASSAGES, "How much lumber does the chamber hold?")
    rt = BlockRuntime(lm.model, "fp")
    _, exact, stats = rt.prefill(seg, [None] * 3, mode="block+recompute", recompute_ratio=1.0, select=select)
    assert stats.tokens_recomputed == sum(map(len, seg.passages)) + sum(map(len, seg.headers))
    assert (exact[0, -1] - _full_logits(lm, seg.ids())[-1]).abs().max().item() < 1e-3


def _spans(seg):
    spans, at = [], len(seg.prefix)
    for h, b in zip(seg.headers, seg.passages):
        spans.append((at, at + len(h) + len(b)))
        at += len(h) + len(b)
    return spans


def test_passage_ranks_recompute_those_passages_whole_and_nothing_else(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES, "How much lumber does the chamber hold?")
    rt = BlockRuntime(lm.model, "fp")
    block, _ = rt.assemble(seg, [None] * 3, mode="block")
    cache, stats = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.0, select=(2,))
    a, b = _spans(seg)[1]
    assert stats.tokens_recomputed == b - a
    assert not torch.allclose(cache.block(a, b)[1], block.block(a, b)[1], atol=1e-4)  # passage 2 recomputed
    a3, b3 = _spans(seg)[2]
    assert torch.equal(cache.block(a3, b3)[0], block.block(a3, b3)[0])  # passage 3 left as stored
    # passage 1 recomputed sees what full attention's sees (the prefix, its header): its KV is full's
    first, _ = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.3, select=(1,))
    a1, b1 = _spans(seg)[0]
    full = lm.model.new_cache()
    lm.model(torch.tensor([seg.ids()[:b1]]), torch.arange(b1), full)
    assert torch.allclose(first.block(a1, b1)[1], full.block(a1, b1)[1], atol=1e-4)


def test_question_selection_takes_the_budget_over_the_whole_context_in_windows(lm):
    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    rt = BlockRuntime(lm.model, "fp")
    spans = _spans(seg)
    n = sum(b - a for a, b in spans)
    for ratio in (0.1, 0.3):
        cache, _ = rt.assemble(seg, [None] * 3, mode="block")
        slot_ids = seg.prefix + [t for h, b in zip(seg.headers, seg.passages) for t in h + b]
        chosen = rt._select_by_question(cache, slot_ids, spans, [], ratio, seg.question, window=4)
        assert len(chosen) == round(ratio * n) and len(set(chosen)) == len(chosen)
        assert all(any(a <= i < b for a, b in spans) for i in chosen)  # passage slots only (no prefix)
        assert cache.length == len(seg.prefix) + n  # the scoring pass leaves the cache as it was
        # windows: at most one chosen window per passage is cut short, the rest are whole 4-token windows
        starts = {a + 4 * ((i - a) // 4) for i in chosen for a, b in spans if a <= i < b}
        assert len(starts) <= -(-len(chosen) // 4) + len(spans)


@pytest.mark.parametrize("select", ["question", "lead", "deviation"])
def test_recompute_max_tokens_caps_the_recomputed_tokens_and_keeps_the_best_of_them(lm, select):
    """recompute_max_tokens: at most that many passage tokens recomputed whatever the ratio (the share
    falls with the context's length); under it the ratio's own count; "question" keeps the best-ranked
    windows of the uncapped choice."""
    from ldqa.attention.block_attention import capped_ratio

    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    n = sum(b - a for a, b in _spans(seg))
    rt = BlockRuntime(lm.model, "fp")
    _, whole = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.5, select=select)
    rt.recompute_max_tokens = 12
    _, capped = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.5, select=select)
    if select == "question":
        assert capped.tokens_recomputed == 12 < whole.tokens_recomputed == round(0.5 * n)
    else:  # per passage: each passage's share of the capped ratio, rounded
        assert capped.tokens_recomputed <= 12 + len(PASSAGES) and capped.tokens_recomputed < whole.tokens_recomputed
    rt.recompute_max_tokens = n
    _, loose = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.5, select=select)
    assert loose.tokens_recomputed == whole.tokens_recomputed
    if select == "question":  # the capped choice is the head of the uncapped ranking
        cache, _ = rt.assemble(seg, [None] * 3, mode="block")
        slot_ids = seg.prefix + [t for h, b in zip(seg.headers, seg.passages) for t in h + b]
        best = rt._select_by_question(cache, slot_ids, _spans(seg), [], 12 / n, seg.question)
        top = rt._select_by_question(cache, slot_ids, _spans(seg), [], 0.5, seg.question)
        assert set(best) <= set(top) and len(best) == 12
    assert capped_ratio(0.3, 1000, None) == 0.3 and capped_ratio(0.3, 1000, 600) == 0.3
    assert round(capped_ratio(0.3, 4000, 600) * 4000) == 600
    with pytest.raises(ValueError, match="recompute_max_tokens"):
        capped_ratio(0.3, 1000, -1)


def test_question_selection_follows_the_question_s_attention(lm):
    """The chosen windows are the ones the question's queries attend to most (recorded and scored
    independently here with the same formula)."""
    from ldqa.attention.block_attention import token_mass
    from ldqa.attention.debias import DebiasKV

    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    rt = BlockRuntime(lm.model, "fp")
    cache, _, _ = rt.prefill(seg, [None] * 3, mode="block", policy=DebiasKV(n_record=len(seg.question)))
    rec = cache.policy
    L, q = cache.length, len(seg.question)
    mass = token_mass(lm.model, cache, rec.queries, torch.arange(L - q, L), L)
    assert mass.shape == (L,) and abs(mass.sum().item() - 1.0) < 1e-3  # a probability per slot
    spans = _spans(seg)
    block, _ = rt.assemble(seg, [None] * 3, mode="block")
    slot_ids = seg.prefix + [t for h, b in zip(seg.headers, seg.passages) for t in h + b]
    chosen = rt._select_by_question(block, slot_ids, spans, [], 0.05, seg.question, window=1)
    best = sorted(range(spans[0][0], spans[-1][1]), key=lambda i: -mass[i].item())[:len(chosen)]
    assert sorted(chosen) == sorted(best)


def test_question_selection_can_leave_the_first_passage_alone(lm):
    """select_skip_first: the same budget, none of it in the first passage; without it the first passage
    is a candidate (here it gets some of the budget)."""
    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    rt = BlockRuntime(lm.model, "fp")
    spans = _spans(seg)
    slot_ids = seg.prefix + [t for h, b in zip(seg.headers, seg.passages) for t in h + b]
    got = {}
    for skip in (False, True):
        rt.select_skip_first = skip
        cache, _ = rt.assemble(seg, [None] * 3, mode="block")
        got[skip] = rt._select_by_question(cache, slot_ids, spans, [], 0.5, seg.question, window=4)
    a, b = spans[0]
    assert len(got[True]) == len(got[False])
    assert not any(a <= i < b for i in got[True]) and any(a <= i < b for i in got[False])


def test_question_selection_can_take_the_most_attended_passages_whole():
    """select_whole=n: the n passages with the largest summed score first, whole and cut at the budget,
    then the best windows of the others; the budget is the same."""
    rt = BlockRuntime(None, "fp")
    spans = [(0, 10), (10, 20), (20, 30), (30, 40)]
    mass = torch.zeros(40)
    mass[12:14], mass[25], mass[31] = 1.0, 0.5, 0.4  # passage 2 most, then 3, then 4
    assert sorted(rt._top_windows(mass, spans, 0.3, 4)) == [*range(10, 14), *range(24, 28), *range(30, 34)]
    rt.select_whole = 1
    assert rt._top_windows(mass, spans, 0.3, 4) == [*range(10, 20), 24, 25]
    rt.select_whole = 2  # the second passage cut at the 12-slot budget
    assert rt._top_windows(mass, spans, 0.3, 4) == [*range(10, 20), 20, 21]
    rt.select_skip_first, mass[2] = True, 9.0  # the first passage is never a candidate, whole or not
    assert rt._top_windows(mass, spans, 0.3, 4) == [*range(10, 20), 20, 21]


def test_two_round_selection_recomputes_the_same_budget_and_all_of_it_reproduces_full_attention(lm):
    """select_refine: the budget is the same, the first round's slots are the head of the one-round
    ranking, the second round's are other slots ranked over the cache with the first round recomputed; at
    ratio 1.0 the two rounds recompute every token and give full attention's logits."""
    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    rt = BlockRuntime(lm.model, "fp")
    n = sum(map(len, seg.passages)) + sum(map(len, seg.headers))
    _, one = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.5)
    rt.select_refine = 0.2
    _, two = rt.assemble(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.5)
    assert two.tokens_recomputed == one.tokens_recomputed == round(0.5 * n)
    cache, _ = rt.assemble(seg, [None] * 3, mode="block")
    slot_ids = seg.prefix + [t for h, b in zip(seg.headers, seg.passages) for t in h + b]
    ranked = rt._select_by_question(cache, slot_ids, _spans(seg), [], 0.5, seg.question)
    done, second = rt._refine(cache, slot_ids, _spans(seg), ranked, seg.question)
    assert done == set(ranked[:len(ranked) - round(0.2 * n)]) and len(second) == round(0.2 * n)
    assert not done & set(second) and len(set(second)) == len(second)
    _, exact, stats = rt.prefill(seg, [None] * 3, mode="block+recompute", recompute_ratio=1.0)
    assert stats.tokens_recomputed == n
    assert (exact[0, -1] - _full_logits(lm, seg.ids())[-1]).abs().max().item() < 1e-3


def test_token_mass_reductions(lm):
    """reduce="max" is each layer's largest probability over heads and question tokens, "last" the last
    question token's mean over heads; an unknown reduction is refused by name."""
    from ldqa.attention.block_attention import token_mass
    from ldqa.attention.debias import DebiasKV

    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    cache, _, _ = BlockRuntime(lm.model, "fp").prefill(seg, [None] * 3, mode="block",
                                                       policy=DebiasKV(n_record=len(seg.question)))
    L, q, queries = cache.length, len(seg.question), cache.policy.queries
    slots = torch.arange(L - q, L)
    mean, top = (token_mass(lm.model, cache, queries, slots, L, r) for r in ("mean", "max"))
    assert (top >= mean - 1e-6).all() and not torch.allclose(top, mean)
    last = token_mass(lm.model, cache, {k: v[:, -1:] for k, v in queries.items()}, slots[-1:], L)
    assert torch.allclose(token_mass(lm.model, cache, queries, slots, L, "last"), last, atol=1e-6)
    with pytest.raises(ValueError, match="reduce"):
        token_mass(lm.model, cache, queries, slots, L, "median")


def test_question_selection_on_the_first_layers_ranks_by_those_layers_alone(lm):
    """select_layers: the selection pass stops after that many layers and ranks by the queries of the
    global-attention layers among them only (here: the first global layer)."""
    from ldqa.attention.block_attention import token_mass
    from ldqa.attention.debias import DebiasKV

    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    rt = BlockRuntime(lm.model, "fp")
    cache, _, _ = rt.prefill(seg, [None] * 3, mode="block", policy=DebiasKV(n_record=len(seg.question)))
    L, q = cache.length, len(seg.question)
    g = min(cache.policy.queries)
    rt.select_layers = g + 1
    first = token_mass(lm.model, cache, {g: cache.policy.queries[g]}, torch.arange(L - q, L), L)
    every = token_mass(lm.model, cache, cache.policy.queries, torch.arange(L - q, L), L)
    spans = _spans(seg)
    block, _ = rt.assemble(seg, [None] * 3, mode="block")
    slot_ids = seg.prefix + [t for h, b in zip(seg.headers, seg.passages) for t in h + b]
    chosen = rt._select_by_question(block, slot_ids, spans, [], 0.05, seg.question, window=1)
    ranked = sorted(range(spans[0][0], spans[-1][1]), key=lambda i: -first[i].item())
    assert sorted(chosen) == sorted(ranked[:len(chosen)])
    assert block.length == L - q  # the shortened pass leaves the cache as it was
    if len(cache.policy.queries) > 1:  # every global layer ranks otherwise here (the check can tell them apart)
        assert sorted(chosen) != sorted(sorted(range(spans[0][0], spans[-1][1]), key=lambda i: -every[i].item())[:len(chosen)])


def test_bad_selection_is_refused_by_name(lm):
    from ldqa.attention.block_attention import BlockConfig

    seg = build_prompt(lm.tokenizer, PASSAGES[:1], "q?")
    rt = BlockRuntime(lm.model, "fp")
    for bad in ("random", (), (0,), ("1",)):
        with pytest.raises(ValueError, match="recompute_select"):
            rt.assemble(seg, [None], mode="block+recompute", select=bad)
        with pytest.raises(ValueError, match="recompute_select"):
            BlockConfig(0.1, None, bad)
    assert BlockConfig(None, None, "question").resolved("block+recompute").select == "question"
    assert BlockConfig(None, None, "question").resolved("block").select is None


def test_orders_prefilled_in_one_pass_equal_each_order_prefilled_alone(lm):
    q = "How much lumber does the chamber hold?"
    orders = [build_prompt(lm.tokenizer, ps, q) for ps in (PASSAGES, PASSAGES[::-1])]
    assert orders[0].ids() != orders[1].ids() and len(orders[0]) == len(orders[1])
    rt = BlockRuntime(lm.model, "fp")
    refs = [rt.prefill(seg, [None] * 3, mode="block") for seg in orders]
    calls = []
    forward = lm.model.forward
    lm.model.forward = lambda tokens, *a, **kw: calls.append(tokens.shape) or forward(tokens, *a, **kw)
    try:
        both = rt.prefill_orders(orders, [[None] * 3] * 2, record=True)
    finally:
        del lm.model.forward
    n = len(orders[0].question)
    assert (2, n) in calls and all(shape[0] == 2 or shape[1] != n for shape in calls)  # one pass, batch of 2
    for seg, (cache, logits, stats, queries), (ref_cache, ref_logits, ref_stats) in zip(orders, both, refs):
        assert cache.length == ref_cache.length == len(seg.ids()) and cache.keys(0).shape[0] == 1
        assert stats.tokens_computed == ref_stats.tokens_computed > n  # the blocks encoded (no store), the question
        assert stats.kv_misses == ref_stats.kv_misses == 3
        assert (logits - ref_logits).abs().max().item() < 1e-4
        for layer in range(lm.model.cfg.num_layers):
            assert (cache.keys(layer) - ref_cache.keys(layer)).abs().max().item() < 1e-4
        assert set(queries) and all(t.shape[-2:] == (n, lm.model.cfg.head_dim) and t.dim() == 3
                                    for t in queries.values())
    # prompts that cannot share a pass (another question) are prefilled one by one, with the same results
    other = build_prompt(lm.tokenizer, PASSAGES[::-1], "Which bolt torque?")
    alone = rt.prefill_orders([orders[0], other], [[None] * 3] * 2)
    _, ref_logits, _ = rt.prefill(other, [None] * 3, mode="block")
    assert alone[1][3] is None and (alone[1][1] - ref_logits).abs().max().item() < 1e-5


def test_an_anchored_block_is_the_body_encoded_after_prefix_and_anchor_and_moved_to_its_slot(lm):
    from ldqa.attention.block_attention import PrefillStats

    seg = build_prompt(lm.tokenizer, PASSAGES, "How much lumber does the chamber hold?")
    anchor = lm.tokenizer.encode(" (Title: Kiln manual) Chapter 1. The SL-30 kiln dries lumber.\n\n")
    rt = BlockRuntime(lm.model, "fp")
    k, v = rt.get_block(seg.prefix, seg.passages[1], None, PrefillStats(), anchor)
    ids = seg.prefix + anchor + seg.passages[1]
    ref = lm.model.new_cache()
    lm.model(torch.tensor([ids]), torch.arange(len(ids)), ref)
    p = len(seg.prefix) + len(anchor)
    rk, rv = ref.block(p, len(ids))
    assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
    plain, _ = rt.get_block(seg.prefix, seg.passages[1], None, PrefillStats())
    assert not torch.allclose(k[-1], plain[-1], atol=1e-3)  # the anchor changed what the body saw
    # assembled with anchors: the anchor is not in the cache, the body sits at its prompt slot
    seg.anchors = [[], anchor, []]
    cache, _ = rt.assemble(seg, [None] * 3, mode="block")
    assert cache.length == len(seg.ids()) - len(seg.question)
    a = len(seg.prefix) + len(seg.headers[0]) + len(seg.passages[0]) + len(seg.headers[1])
    moved = reencode_keys_(lm.model, k.clone(), a - p)
    assert torch.allclose(cache.block(a, a + len(seg.passages[1]))[0], moved, atol=1e-5)


def test_the_anchor_is_part_of_the_block_s_key(lm, tmp_path):
    from ldqa.attention.block_attention import PrefillStats
    from ldqa.indexes.kv_store import KVBlockStore

    seg = build_prompt(lm.tokenizer, PASSAGES, "q?")
    rt = BlockRuntime(lm.model, "fp", KVBlockStore(tmp_path / "kv"))
    anchor = lm.tokenizer.encode(" (Title: Kiln manual) Chapter 1.\n\n")
    st = PrefillStats()
    for a in ((), anchor, (), anchor):
        rt.get_block(seg.prefix, seg.passages[1], 7, st, a)
    assert (st.kv_misses, st.kv_hits) == (2, 2)


def test_taper_stops_the_lesser_chosen_tokens_at_its_layer_with_exact_kv_there(lm):
    """Gradual filtering (`BlockRuntime.taper` = (j, r)): below layer j every chosen token is recomputed as
    without it; at layer j the tokens beyond the best r share get the K/V their hidden states give there;
    above j they keep the reused block K/V while the best r share (and the question) go on."""
    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    n_layers = lm.model.cfg.num_layers
    j = n_layers // 2
    rt = BlockRuntime(lm.model, "fp")
    block, _, _ = rt.prefill(seg, [None] * 3, mode="block")
    whole, _, s_whole = rt.prefill(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.5)
    rt.taper = (j, 0.2)
    cut, logits, s_cut = rt.prefill(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.5)
    assert s_cut.tokens_recomputed == s_whole.tokens_recomputed > 0
    L = block.length
    changed = [i for i in range(L) if not torch.equal(whole.keys(0)[0, :, i], block.keys(0)[0, :, i])
               or not torch.equal(whole.keys(n_layers - 1)[0, :, i], block.keys(n_layers - 1)[0, :, i])]
    top = [i for i in range(L) if not torch.equal(cut.keys(n_layers - 1)[0, :, i], block.keys(n_layers - 1)[0, :, i])]
    q = set(range(L - len(seg.question), L))
    dropped = sorted(set(changed) - set(top) - q)
    assert dropped and set(top) - q  # some chosen tokens stopped at j, some went on
    n_passage = sum(b - a for a, b in _spans(seg))
    assert len(set(top) - q) == round(0.2 * n_passage)
    d = torch.tensor(dropped)
    for layer in range(n_layers):
        got, ref = cut.keys(layer)[0][:, d], (whole if layer <= j else block).keys(layer)[0][:, d]
        gv, rv = cut.values(layer)[0][:, d], (whole if layer <= j else block).values(layer)[0][:, d]
        tol = 0 if layer != j else 1e-5
        assert (got - ref).abs().max() <= tol and (gv - rv).abs().max() <= tol, layer
    # a taper that keeps every chosen token is no taper: the same logits, bit for bit
    _, ref_logits, _ = rt.prefill(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.2)
    rt.taper = None
    _, plain, _ = rt.prefill(seg, [None] * 3, mode="block+recompute", recompute_ratio=0.2)
    rt.taper = (j, 0.2)
    assert torch.equal(ref_logits, plain) and not torch.equal(logits, plain)


def test_int8_recompute_gemm_takes_the_recomputed_tokens_in_int8_and_the_question_in_bf16(tiny_model_dir, monkeypatch):
    """block+recompute with recompute_gemm "int8": the final pass splits at the question (its recomputed
    passage tokens through the int8 GEMM, the question's rows through bf16), the selection's question pass
    runs in int8; with every token recomputed the logits stay close to full attention's (int8 rounding of
    the passage tokens only), and the bf16 runtime's are as before."""
    from ldqa.attention import quant as Q
    from ldqa.kernels import cpu_linear

    if not cpu_linear.available():
        pytest.skip("no C kernel on this machine")
    lm = load_model(str(tiny_model_dir("llama")), weights="q8_0")
    seg = build_prompt(lm.tokenizer, PASSAGES * 3, "How much lumber does the chamber hold?")
    ids, n_q = seg.ids(), len(seg.question)
    full = _full_logits(lm, ids)[-1]
    splits, gemms = [], []
    real = Q.QLinear._apply_split
    monkeypatch.setattr(Q.QLinear, "_apply_split", lambda self, x, rows, lead: splits.append((rows, lead)) or
                        real(self, x, rows, lead))
    real_pw = Q.QLinear.prefill_weight
    def spy(self, rows, gemm=None):
        w = real_pw(self, rows, gemm)
        if w is not None and gemm is None:  # (a split names its GEMMs: not recorded)
            gemms.append(Q._GEMM_OVERRIDE.get() or self.prefill_gemm)
        return w

    monkeypatch.setattr(Q.QLinear, "prefill_weight", spy)
    rt16 = BlockRuntime(lm.model, "fp")
    _, exact16, _ = rt16.prefill(seg, [None] * 9, mode="block+recompute", recompute_ratio=1.0)
    assert not splits and set(gemms) == {"bf16"}
    rt8 = BlockRuntime(lm.model, "fp", recompute_gemm="int8")
    _, exact8, stats = rt8.prefill(seg, [None] * 9, mode="block+recompute", recompute_ratio=1.0)
    n = stats.tokens_recomputed + n_q
    assert splits and set(splits) == {(n, n - n_q)}
    scale = full.abs().max()
    assert (exact16[0, -1] - full).abs().max() < 1e-2 * scale
    assert (exact8[0, -1] - full).abs().max() < 0.1 * scale and not torch.equal(exact8, exact16)
    splits.clear(), gemms.clear()
    monkeypatch.setattr(Q, "PREFILL_ROWS", 4)  # the question's few rows take the GEMM too
    rt8.prefill(seg, [None] * 9, mode="block+recompute", recompute_ratio=0.3)
    assert "int8" in gemms  # the selection's question pass (the passages' encodings: bf16)
    assert splits and all(lead == rows - n_q for rows, lead in splits)
    # a measurement that only ranks: the blocks it encodes on the way in the model's GEMM, its pass in int8
    gemms.clear()
    with rt8.ranking_only():
        rt8.prefill(seg, [None] * 9, mode="block")
    i = gemms.index("int8")
    assert set(gemms[:i]) == {"bf16"} and set(gemms[i:]) == {"int8"}
    gemms.clear()
    rt8.prefill(seg, [None] * 9, mode="block")  # plain block answers: its question in the model's GEMM
    assert set(gemms) == {"bf16"}
    # question_int8: the question's rows in int8 too, but the last row at the last layer (it gives the
    # first token: a pass of fewer rows than the split's, `pass_rows`)
    splits.clear()
    rt8q = BlockRuntime(lm.model, "fp", recompute_gemm="int8", question_int8=True)
    _, exact8q, stats = rt8q.prefill(seg, [None] * 9, mode="block+recompute", recompute_ratio=1.0)
    n = stats.tokens_recomputed + n_q
    assert (n, n) in splits and set(splits) <= {(n, n), (n, 0)}
    assert (exact8q[0, -1] - full).abs().max() < 0.1 * scale and not torch.equal(exact8q, exact8)
