"""The q8_0 fused decode (decode_runner.FusedDecode: a decoder layer's decode in two C calls) against the
module path on the same weights, per family; its weights held once; the fallbacks where the kernel is missing."""

import platform
from pathlib import Path

import pytest
import torch

from ldqa.attention import loader
from ldqa.attention.decode_runner import CLayers, TorchLayers, choose_runner
from ldqa.attention.quant import model_nbytes
from ldqa.kernels import cpu_linear

FAMILIES = ("llama", "llama3-scaled", "qwen2", "qwen3", "gemma3")  # as in conftest._hf_config
pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the q8_0 kernel is written for x86-64")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fused-decode-cache"))
    monkeypatch.delenv("LDQA_CPU_KERNELS", raising=False)
    cpu_linear.reset()
    loader._LOADED.clear()
    yield
    cpu_linear.reset()
    loader._LOADED.clear()


def _decode(model, prompt: torch.Tensor, steps: int, policy=None):
    """Greedy decode after `prompt` (1, n): (tokens, logits (steps, vocab)) — every step one token; `policy`
    attached to the cache after the prompt."""
    cache = model.new_cache()
    n = prompt.shape[1]
    logits = model(prompt, torch.arange(n), cache)
    cache.policy = policy
    toks, rows = [], []
    for i in range(steps):
        tok = int(logits[0, -1].argmax())
        toks.append(tok)
        logits = model(torch.tensor([[tok]]), torch.tensor([n + i]), cache)
        rows.append(logits[0, -1].clone())
    return toks, torch.stack(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decode_matches_the_modules(tiny_model_dir, family):
    lm = loader.load_model(str(tiny_model_dir(family)), weights="q8_0")
    model = lm.model
    assert model.decoder.kind == "c-step", "the loader decodes q8_0 layers in C"
    assert all(f is not None for f in model.decoder.fused)
    prompt = torch.randint(3, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    toks_f, logits_f = _decode(model, prompt, 24)
    model.decoder = TorchLayers()
    toks_m, logits_m = _decode(model, prompt, 24)
    model.decoder = choose_runner(model)
    assert model.decoder.kind == "c-step"
    rel = float((logits_f - logits_m).abs().max() / logits_m.abs().max())
    # the same formulas in fp32, summed in another order (and the sliding window crossed: gemma3's is 16)
    assert rel < 1e-4, rel
    assert toks_f == toks_m


def test_fused_weights_are_held_once_and_prefill_uses_them(tiny_model_dir):
    d = str(tiny_model_dir("qwen2"))  # qwen2: q/k/v biases
    lm = loader.load_model(d, weights="q8_0")
    layer = lm.model.model.layers[0]
    fused, attn = lm.model.decoder.fused[0], layer.self_attn
    # the kernel reads the modules' own buffers: one copy of the weights
    qkv = fused.kernel._qkv
    assert [m.w for m in qkv] == [p.qweight.data_ptr() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert [m.d for m in qkv] == [p.bscales.data_ptr() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert fused.kernel._gu[1].w == layer.mlp.up_proj.qweight.data_ptr()
    n_q, n_k = attn.q_proj.out_features, attn.k_proj.out_features
    assert torch.equal(fused.bias[n_q:n_q + n_k], attn.k_proj.bias)
    loader._LOADED.clear()
    monkey_free = loader.load_model(d, weights="q8_0")
    monkey_free.model.decoder = TorchLayers()
    assert model_nbytes(lm.model) == model_nbytes(monkey_free.model)


def test_without_the_kernel_nothing_is_fused(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LDQA_CPU_KERNELS", "torch")
    cpu_linear.reset()
    lm = loader.load_model(str(tiny_model_dir("gemma3")), weights="q8_0")
    assert type(lm.model.decoder) is TorchLayers
    assert type(choose_runner(lm.model)) is TorchLayers
    toks, logits = _decode(lm.model, torch.tensor([[5, 6, 7, 8]]), 3)  # the module path still decodes
    assert len(toks) == 3 and torch.isfinite(logits).all()
    with pytest.raises(RuntimeError, match="not available.*LDQA_CPU_KERNELS=torch"):
        cpu_linear.DecodeLayer(q=None, k=None, v=None, bias=None, n_heads=1, n_kv=1, head_dim=32, in_norm=None,
                               q_norm=None, k_norm=None, o=None, attn_norm=None, ff_norm=None, ff_out_norm=None,
                               gate=None, up=None, down=None, act="silu", eps=1e-6)


def test_other_formats_are_not_fused(tiny_model_dir):
    lm = loader.load_model(str(tiny_model_dir("llama")), weights="int8")
    assert type(lm.model.decoder) is TorchLayers
    assert type(choose_runner(lm.model)) is TorchLayers


def test_every_attention_mode_answers_the_same_fused_and_not(tmp_path, tiny_model_dir, monkeypatch):
    # the hooks of the global layers (retrieval attention, debiasing) and block reuse sit in
    # Attention.attend, which both paths share: the answers are the same text (fused decode + C decode
    # attention against the modules + torch attention)
    from ldqa.app.api import LongDocQA

    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=6,
                   weights="q8_0")
    qa.ingest(Path(__file__).resolve().parents[1] / "app" / "sample" / "docs")
    modes = (("full", "none"), ("block", "none"), ("block+recompute", "none"), ("retrieval", "none"),
             ("block", "calibrate+reorder"), ("full", "sort"))
    q = "What torque for the fan hub bolts?"
    fused = [qa.ask(q, top_k=3, attention=a, debias=b).text for a, b in modes]
    model = qa.llm.model
    assert model.decoder.kind == "c-step"
    runner, model.decoder = model.decoder, TorchLayers()
    monkeypatch.setenv("LDQA_KERNELS", "torch")
    try:
        plain = [qa.ask(q, top_k=3, attention=a, debias=b).text for a, b in modes]
    finally:
        model.decoder = runner
    assert fused == plain


def _stack_and_layers(model, prompt: torch.Tensor, steps: int, policy=None):
    """`_decode` through the model's CStep (counting its stack calls), then through CLayers on the same fused
    layers: ((tokens, logits) of the stack, (tokens, logits) per layer, stack calls). policy: None or a
    callable making a fresh cache policy for each run."""
    step = model.decoder
    calls = []
    real = step.stack.run
    step.stack.run = lambda *a: calls.append(1) or real(*a)
    try:
        stacked = _decode(model, prompt, steps, policy() if policy else None)
    finally:
        del step.stack.run
    model.decoder = CLayers(model.model.layers, step.fused)
    try:
        layered = _decode(model, prompt, steps, policy() if policy else None)
    finally:
        model.decoder = step
    return stacked, layered, len(calls)


def _stack_model_and_prompt(tiny_model_dir, family, seed):
    """The q8_0 tiny model of `family`, whose decoder runs a decode step in one C call, and a seeded
    30-token prompt (1, 30)."""
    model = loader.load_model(str(tiny_model_dir(family)), weights="q8_0").model
    assert model.decoder.kind == "c-step"
    return model, torch.randint(3, model.cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_stack_computes_what_the_layer_by_layer_calls_compute(tiny_model_dir, family):
    # decode_runner.CStep (cpu_linear.DecodeStack): every layer of a decode step in one C call; the same C
    # functions in the same order as CLayers' FusedDecode + Attention.attend, so the logits are equal bit for
    # bit (gemma3's tiny sliding window, 16, is crossed: its sliding layers attend to a moving slice)
    model, prompt = _stack_model_and_prompt(tiny_model_dir, family, seed=2)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            (toks_s, logits_s), (toks_l, logits_l), calls = _stack_and_layers(model, prompt, 24)
            assert calls == 24  # every decode step took the stack
            assert toks_s == toks_l
            assert torch.equal(logits_s, logits_l)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_stack_runs_position_debiasing_with_the_per_layer_paths_numbers(tiny_model_dir, family):
    # a DebiasKV intervention is the global layers' attention plus a bias per slot (`decode_bias`): the stack
    # takes it (on gemma3's global layers only) and gives the per-layer path's logits (hook -> C kernel with
    # the bias) bit for bit; the intervention does change them
    from ldqa.attention.debias import DebiasKV

    model, prompt = _stack_model_and_prompt(tiny_model_dir, family, seed=4)
    log_w = torch.randn(80, generator=torch.Generator().manual_seed(5)) * 2

    def hook():
        return DebiasKV(log_w=log_w, scale=model.cfg.attn_scale)

    (toks_s, logits_s), (toks_l, logits_l), calls = _stack_and_layers(model, prompt, 12, hook)
    assert calls == 12
    assert toks_s == toks_l and torch.equal(logits_s, logits_l)
    _, plain = _decode(model, prompt, 12)
    assert (plain - logits_s).abs().max() > 1e-3


def test_decode_stack_steps_aside_where_a_step_needs_more(tiny_model_dir):
    from ldqa.attention.kv_cache import KVCache

    lm = loader.load_model(str(tiny_model_dir("gemma3")), weights="q8_0")
    model = lm.model
    prompt = torch.arange(3, 23).view(1, -1)

    def prefilled(**kw):
        cache = model.new_cache()
        model(prompt, torch.arange(20), cache)
        for k, v in kw.items():
            setattr(cache, k, v)
        return cache

    class Normal:  # a policy that keeps the layers' normal attention
        def forward(self, *args):
            return None

    tok = torch.tensor([[7]])
    # a cache of another dtype, with a policy, or positions that would need a mask: the per-layer path
    model.kv_dtype = torch.bfloat16
    try:
        assert model.decoder.step(model, tok, torch.tensor([20]), prefilled()) is None
    finally:
        model.kv_dtype = torch.float32
    assert model.decoder.step(model, tok, torch.tensor([20]), prefilled(policy=Normal())) is None
    assert model.decoder.step(model, tok, torch.tensor([19]), prefilled()) is None  # not after the last position
    assert model.decoder.step(model, tok, torch.tensor([20]), prefilled()) is not None
    # ... and those steps still decode (through the layers), as before
    cache = prefilled()
    out = model(tok, torch.tensor([19]), cache)
    assert out.shape == (1, 1, model.cfg.vocab_size) and cache.length == 21
    assert type(cache) is KVCache


def test_argmax_is_torchs():
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 15, 16, 17, 1000, 262144):
        x = torch.randn(n, generator=g)
        assert cpu_linear.argmax(x) == int(torch.argmax(x)), n
        x[n // 3] = x[n - 1] = float(x.max()) + 1  # ties: the first index, as torch
        assert cpu_linear.argmax(x) == int(torch.argmax(x)) == n // 3 if n > 1 else True
    assert cpu_linear.argmax(torch.full((40,), float("-inf"))) == 0
    assert cpu_linear.argmax(torch.tensor([-0.0, 0.0] * 10)) == 0
    assert cpu_linear.argmax(torch.arange(30.0).flip(0)[::2]) == 0  # not contiguous: torch.argmax
