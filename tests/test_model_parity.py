"""ldqa's runtime against transformers: same logits (fp32), same greedy tokens."""

from __future__ import annotations

import pytest
import torch

FAMILIES = ("llama", "llama3-scaled", "qwen2", "qwen3", "gemma3")  # as in conftest._hf_config
from ldqa.attention.config import ModelConfig, UnsupportedModelError
from ldqa.attention.generate import SamplingConfig, start_generation
from ldqa.attention.loader import load_model


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _prompt(lm, n: int) -> list[int]:
    text = ("The block attention method encodes every retrieved passage independently and reuses "
            "its key and value states for later questions. ") * 30
    return ([lm.tokenizer.bos_id] if lm.tokenizer.bos_id is not None else []) + lm.tokenizer.encode(text)[: n - 1]


def _greedy_ours(lm, ids, n_new):
    gen = start_generation(lm.model, ids, lm.tokenizer.decode, [], SamplingConfig(max_new_tokens=n_new))
    for _ in gen:
        pass
    return gen.token_ids


def _greedy_hf(hf, ids, n_new):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _check(lm, hf, n_prompt, n_new, atol):
    ids = _prompt(lm, n_prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.float()
    ours = lm.model(torch.tensor([ids]), torch.arange(len(ids)), None, all_logits=True)
    assert (ours - ref).abs().max().item() < atol
    assert _greedy_ours(lm, ids, n_new) == _greedy_hf(hf, ids, n_new)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_random_model_matches_transformers(tiny_model_dir, family):
    d = tiny_model_dir(family)
    lm = load_model(str(d))
    assert lm.config.family == {"llama3-scaled": "llama"}.get(family, family)
    if family == "llama3-scaled":
        assert lm.config.rope_scaling["rope_type"] == "llama3"
    # 40 prompt tokens > Gemma's tiny sliding window of 16: the window mask is exercised
    _check(lm, _hf(d), n_prompt=40, n_new=32, atol=1e-4)


def test_incremental_decode_equals_full_forward(tiny_model_dir):
    lm = load_model(str(tiny_model_dir("gemma3")))
    ids = _prompt(lm, 30)
    full = lm.model(torch.tensor([ids]), torch.arange(len(ids)), None, all_logits=True)
    cache = lm.model.new_cache(capacity=4)  # forces the cache to grow
    lm.model(torch.tensor([ids[:20]]), torch.arange(20), cache)
    for i in range(20, len(ids)):
        step = lm.model(torch.tensor([[ids[i]]]), torch.tensor([i]), cache)
        assert torch.allclose(step[0, -1], full[0, i], atol=1e-4)


@pytest.mark.parametrize("weights", ["fp32", "q8_0", "q8_0/int8"])  # (format/prefill GEMM)
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_last_layer_runs_only_the_last_row_with_every_row_s_kv_written(tiny_model_dir, family, weights, monkeypatch):
    """A pass asked for the last token's logits runs the last layer's attention and MLP for that row only,
    through the whole pass's arithmetic (either prefill GEMM): logits as the whole layer's last row (to the
    GEMM's summation order, which with bf16 outputs flips an ulp here and there), the same K/V in the cache
    bit for bit. A pass whose rows take the C kernel (q8_0 below 32 rows,
    whose rounding depends on the row count) runs the whole layer."""
    from ldqa.attention import model as M
    from ldqa.kernels import cpu_linear

    weights, gemm = (weights + "/bf16").split("/")[:2]
    if weights == "q8_0" and not cpu_linear.available():
        pytest.skip("no C kernel on this machine")
    lm = load_model(str(tiny_model_dir(family)), weights=weights, prefill_gemm=gemm)
    rows = []
    real = M.DecoderLayer.forward

    def spy(self, x, *a, q_last=None, **k):
        out = real(self, x, *a, q_last=q_last, **k)
        rows.append((x.shape[1], out.shape[1]))
        return out

    monkeypatch.setattr(M.DecoderLayer, "forward", spy)
    n = lm.config.num_layers
    for length, alone in ((40, True), (20, weights == "fp32")):  # 40 > Gemma's tiny sliding window of 16
        ids = _prompt(lm, length)
        rows.clear()
        one, every = lm.model.new_cache(), lm.model.new_cache()
        got = lm.model(torch.tensor([ids]), torch.arange(length), one)
        ref = lm.model(torch.tensor([ids]), torch.arange(length), every, all_logits=True)
        assert rows[:n] == [(length, length)] * (n - 1) + [(length, 1 if alone else length)]
        assert rows[n:] == [(length, length)] * n
        # fp32: the summation order; q8_0: the bf16 GEMM's outputs round to bf16, where that order flips an ulp;
        # the int8 GEMM rounds its input rows to 1/127 of their largest value, where it flips a step
        tol = (1e-5 if weights == "fp32" or not alone else 1e-2 if gemm == "bf16" else 3e-2) * ref[0, -1].abs().max()
        assert got.shape == (1, 1, ref.shape[-1]) and (got[0, -1] - ref[0, -1]).abs().max() < tol
        for layer in range(n):
            assert torch.equal(one.keys(layer), every.keys(layer)) and torch.equal(one.values(layer), every.values(layer))
        # and the next token decodes the same from either cache
        a = lm.model(torch.tensor([[7]]), torch.tensor([length]), one)
        b = lm.model(torch.tensor([[7]]), torch.tensor([length]), every)
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_packaged_model_matches_transformers(name):
    lm = load_model(name)
    # the reference is transformers' own GGUF loader; ours reads the GGUF tensor by tensor
    from pathlib import Path
    from transformers import AutoModelForCausalLM

    src = Path(lm.source)
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    _check(lm, hf, n_prompt=200, n_new=32, atol=1e-3)


def test_unsupported_architecture_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported families"):
        ModelConfig.from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_special_token_text_is_plain_text(small_tokenizer):
    tok = small_tokenizer
    ids = tok.encode("before <|im_start|>system <|endoftext|> after")
    special = set(tok.hf.all_special_ids)
    assert not special & set(ids)
    assert "<|im_start|>" in tok.decode(ids)


def test_windowed_attention_equals_masked_attention():
    from ldqa.attention.model import attention_mask, windowed_attention
    from ldqa.kernels.dispatch import attention

    g = torch.Generator().manual_seed(0)
    k_pos = torch.arange(300)
    # queries: a dense run, then scattered singles (like Block-Attention headers), then a tail run
    q_pos = torch.cat([torch.arange(5, 60), torch.tensor([90, 91, 150, 220, 221, 222]), torch.arange(260, 300)])
    q = torch.randn(1, 4, len(q_pos), 32, generator=g)
    k = torch.randn(1, 2, 300, 32, generator=g)
    v = torch.randn(1, 2, 300, 32, generator=g)
    for window in (1, 7, 32, 512, None):  # None: causal by position only
        ref = attention(q, k, v, mask=attention_mask(q_pos, k_pos, window), scale=0.2)
        out = windowed_attention(q, k, v, q_pos, k_pos, window, 0.2, max_queries=16)
        assert torch.allclose(out, ref, atol=1e-5)


def test_causal_plan_reads_each_group_s_keys_up_to_its_last_query():
    from ldqa.attention.model import CAUSAL_GROUP, causal_plan

    k_pos = torch.arange(1000)
    q_pos = torch.sort(torch.randperm(1000, generator=torch.Generator().manual_seed(1))[:100]).values
    plan = causal_plan(q_pos, k_pos)
    assert [a for a, *_ in plan] == list(range(0, 100, CAUSAL_GROUP))
    for a, b, lo, hi, m in plan:
        assert lo == 0 and hi == int(q_pos[b - 1]) + 1 and m.shape == (b - a, hi)
    assert causal_plan(q_pos[:CAUSAL_GROUP], k_pos) is None  # one group: nothing to save
    assert causal_plan(q_pos.flip(0), k_pos) is None  # not ascending
