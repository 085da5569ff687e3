"""The decode backend chosen at load (`decode_runner.choose_runner`) and the path each forward pass takes:
the whole step in one C call, each layer in C around its attention, or the torch modules."""

import platform
from collections import Counter

import pytest
import torch

from ldqa.attention import decode_runner, loader
from ldqa.attention.decode_runner import CStep, TorchLayers
from ldqa.attention.retrieval_attention import RetrievalConfig, RetrievalKV
from ldqa.kernels import cpu_linear

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the q8_0 kernel is written for x86-64")


def _path(model, monkeypatch, *args, **kw) -> dict:
    """One forward pass `model(*args, **kw)`: {"stack": whole-step C runs, "c": C layer calls, "module":
    module layer calls}, zero counts left out."""
    n = Counter()

    def spy(cls, name, key):
        real = getattr(cls, name)
        m.setattr(cls, name, lambda *a, **k: n.update([key]) or real(*a, **k))

    with monkeypatch.context() as m:
        spy(cpu_linear.DecodeStack, "run", "stack")
        spy(decode_runner.FusedDecode, "__call__", "c")
        hooks = [layer.register_forward_pre_hook(lambda *a: n.update(["module"])) for layer in model.model.layers]
        try:
            model(*args, **kw)
        finally:
            for h in hooks:
                h.remove()
    return dict(n)


def _prefilled(model, n: int, batch: int = 1, policy=None):
    cache = model.new_cache(batch=batch)
    model(torch.arange(3, 3 + n).expand(batch, n), torch.arange(n), cache)
    cache.policy = policy
    return cache


class Normal:  # a policy that keeps the layers' normal attention
    def forward(self, *args):
        return None


def test_each_pass_takes_its_path(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LDQA_CPU_KERNELS", raising=False)
    monkeypatch.delenv("LDQA_KERNELS", raising=False)
    cpu_linear.reset()
    loader._LOADED.clear()
    model = loader.load_model(str(tiny_model_dir("gemma3")), weights="q8_0").model
    assert type(model.decoder) is CStep
    L, tok, at = model.cfg.num_layers, torch.tensor([[7]]), torch.tensor([20])
    whole, c_layers, modules = {"stack": 1}, {"c": L}, {"module": L}

    def path(*args, **kw):
        return _path(model, monkeypatch, *args, **kw)

    assert path(torch.arange(3, 23).view(1, -1), torch.arange(20), model.new_cache()) == modules  # a prefill
    assert path(tok, at, _prefilled(model, 20)) == whole  # a plain decode step
    # a cache policy's hook runs in torch between the C layer calls: retrieval attention, any policy
    retrieval = RetrievalKV(RetrievalConfig(), model.cfg.attn_scale)
    assert path(tok, at, _prefilled(model, 20, policy=retrieval)) == c_layers
    assert path(tok, at, _prefilled(model, 20, policy=Normal())) == c_layers
    assert path(tok, torch.tensor([19]), _prefilled(model, 20)) == c_layers  # not after the last position: a mask
    assert path(tok, at, None) == c_layers  # no cache
    assert path(tok, at, _prefilled(model, 20), n_layers=2) == {"c": 2}  # part of a pass
    assert path(tok, torch.tensor([5]), _prefilled(model, 20), slots=torch.tensor([5])) == modules  # in place
    assert path(tok.expand(2, 1), at, _prefilled(model, 20, batch=2)) == modules  # two sequences
    model.kv_dtype = torch.bfloat16
    try:
        assert path(tok, at, _prefilled(model, 20)) == c_layers  # a bf16 KV cache
    finally:
        model.kv_dtype = torch.float32
    monkeypatch.setenv("LDQA_KERNELS", "torch")
    assert path(tok, at, _prefilled(model, 20)) == c_layers  # the torch attention reference
    cpu_linear.reset()
    loader._LOADED.clear()


@pytest.mark.slow
def test_packaged_gguf_model_decodes_whole_steps_in_c_and_fp32_in_torch(monkeypatch):
    monkeypatch.delenv("LDQA_KERNELS", raising=False)
    lm = loader.load_model("gemma3-270m", weights="gguf")
    model, L = lm.model, lm.model.cfg.num_layers
    assert type(model.decoder) is CStep
    ids = torch.tensor([lm.tokenizer.encode("The kiln dries wood in")])
    n, tok = ids.shape[1], torch.tensor([[9]])

    def prefilled(policy=None):
        cache = model.new_cache()
        model(ids, torch.arange(n), cache)
        cache.policy = policy
        return cache

    assert _path(model, monkeypatch, tok, torch.tensor([n]), prefilled()) == {"stack": 1}
    retrieval = RetrievalKV(RetrievalConfig(), model.cfg.attn_scale)
    assert _path(model, monkeypatch, tok, torch.tensor([n]), prefilled(retrieval)) == {"c": L}
    ref = loader.load_model("gemma3-270m", weights="fp32").model
    assert type(ref.decoder) is TorchLayers
    cache = ref.new_cache()
    ref(ids, torch.arange(n), cache)
    assert _path(ref, monkeypatch, tok, torch.tensor([n]), cache) == {"module": L}
