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
    seg = build_prompt(lm.tokenizer, PASSAGES, "When was fan No. 2 replaced?")
    rt = BlockRuntime(lm.model, "fp")
    ids, q = seg.ids(), seg.question
    ref = _full_logits(lm, ids)[-1]
    errs = []
    for mode, r in (("block", 0.0), ("block+recompute", 0.5), ("block+recompute", 1.0)):
        cache, _ = rt.assemble(seg, [None] * 3, mode=mode, recompute_ratio=r)
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

    def poisoned(prefix, body):
        k, v = real(prefix, body)
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

    def big(prefix, body):
        k, v = real(prefix, body)
        v[0, 0, 0, 0] = 70000.0
        return k, v

    rt.encode_block = big
    k, v = rt.get_block(seg.prefix, seg.passages[1], 7, PrefillStats())
    assert float(v[0, 0, 0, 0]) == 70000.0
    assert store.get(block_key("fp", seg.prefix, seg.passages[1])) is None
