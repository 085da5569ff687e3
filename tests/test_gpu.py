"""The `gpu` group: ldqa's runtime on CUDA against the CPU on the same weights. Skipped without CUDA; run by
`python -m ldqa.eval.bench.gpu_check` on a GPU machine (docs/gpu.md). The tiny models
carry a byte-level tokenizer made in code (`byte_model_dir`), so nothing packaged is needed there.

- fp32 weights and cache on CUDA: the same greedy tokens as the CPU, logits within 1e-3 (the kernels sum
  in another order; TF32 is off for fp32 matmuls by default);
- the CUDA default (bf16 weights and KV cache): the last prompt token's logits within `LOGIT_TOL` of the
  CPU's fp32, relative to the largest logit;
- block reuse's RoPE self-check on the device, fp32 and bf16 caches;
- every attention mode and debias method of the API snapshot answering through `LongDocQA` on CUDA (fp32),
  each with the CPU's answer (fp32), and the device recorded in the settings;
- KV blocks written by a CPU run reused by a CUDA run of the same collection (and the answer the same).
"""

from __future__ import annotations

import pytest
import torch

from ldqa.eval.bench.gpu_check import LOGIT_TOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAMILIES = ("llama", "llama3-scaled", "qwen2", "qwen3", "gemma3")
PASSAGES = [("Kiln manual", "The SL-30 chamber holds 3.2 cubic metres of stacked lumber."),
            ("Bulletin", "Tighten each fan hub bolt to 18 Nm with a calibrated wrench."),
            ("Log", "Fan No. 2 was replaced on 14 March 2023 after bearing noise."),
            ("Notes", "The humidity sensor fault is shown as error code E-14 on the controller.")]


def _greedy(model, ids: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after prompt `ids` (1, L) and the prompt's last-token logits (vocab,) on the CPU."""
    cache = model.new_cache(capacity=ids.shape[1] + n + 1)
    logits = model(ids, torch.arange(ids.shape[1]), cache)
    first = logits[0, -1].float().cpu()
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), torch.tensor([cache.next_position()]), cache)
    return tokens, first


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_on_cuda_gives_the_cpus_greedy_tokens(byte_model_dir, family):
    from ldqa.attention.loader import load_model

    d = str(byte_model_dir(family))
    ids = torch.randint(3, 250, (1, 48), generator=torch.Generator().manual_seed(1))
    cpu_tokens, cpu_logits = _greedy(load_model(d, weights="fp32", kv_dtype="fp32", device="cpu").model, ids, 16)
    gpu = load_model(d, weights="fp32", kv_dtype="fp32", device="cuda").model
    assert gpu.device.type == "cuda" and gpu.new_cache().keys(0).is_cuda
    gpu_tokens, gpu_logits = _greedy(gpu, ids, 16)
    assert gpu_tokens == cpu_tokens
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_on_cuda_is_within_the_stated_tolerance_of_fp32(byte_model_dir, family):
    from ldqa.attention.loader import load_model

    d = str(byte_model_dir(family))
    ids = torch.randint(3, 250, (1, 48), generator=torch.Generator().manual_seed(2))
    _, ref = _greedy(load_model(d, weights="fp32", kv_dtype="fp32", device="cpu").model, ids, 1)
    _, got = _greedy(load_model(d, weights="bf16", kv_dtype="bf16", device="cuda").model, ids, 1)
    assert (got - ref).abs().max().item() <= LOGIT_TOL * ref.abs().max().item()


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rope_reencoding_self_check_on_cuda(byte_model_dir, family, kv_dtype):
    from ldqa.attention.block_attention import BlockRuntime
    from ldqa.attention.loader import load_model

    lm = load_model(str(byte_model_dir(family)), weights="bf16" if kv_dtype == "bf16" else "fp32",
                    kv_dtype=kv_dtype, device="cuda")
    rt = BlockRuntime(lm.model, lm.fingerprint, None)
    assert rt.self_check(), rt.disabled_reason


def _qa(model_dir, store, device):
    pytest.importorskip("faiss", reason="LongDocQA's store needs faiss-cpu (gpu_check's wheels carry it)")
    pytest.importorskip("sqlite_utils", reason="LongDocQA's store needs sqlite-utils")
    from ldqa.app.api import LongDocQA

    return LongDocQA(store=store, model=str(model_dir), weights="fp32", kv_dtype="fp32", device=device)


def test_every_mode_answers_on_cuda_as_on_the_cpu(byte_model_dir, tmp_path):
    from ldqa.app.api import Passage
    from ldqa.eval.bench.api_snapshot import MODES

    d = byte_model_dir("gemma3")
    cpu, gpu = _qa(d, tmp_path / "cpu", "cpu"), _qa(d, tmp_path / "gpu", "cuda")
    passages = [Passage(t, x) for t, x in PASSAGES]
    differ = []
    for attention, debias in MODES:
        a = cpu.answer("What torque for the fan hub bolts?", passages, attention=attention, debias=debias,
                       max_new_tokens=8)
        b = gpu.answer("What torque for the fan hub bolts?", passages, attention=attention, debias=debias,
                       max_new_tokens=8)
        assert b.settings.device == "cuda" and b.timings.generated_tokens > 0, (attention, debias)
        if a.text != b.text:
            differ.append((attention, debias, a.text, b.text))
    assert not differ


def test_blocks_stored_on_the_cpu_are_reused_on_cuda(byte_model_dir, tmp_path):
    from ldqa.app.api import Passage

    d = byte_model_dir("qwen2")
    passages = [Passage(t, x) for t, x in PASSAGES]
    cpu = _qa(d, tmp_path / "s", "cpu")
    a = cpu.answer("Which error code?", passages, attention="block", debias="none", max_new_tokens=8)
    assert a.timings.to_dict()["kv_misses"] == len(passages)
    gpu = _qa(d, tmp_path / "s", "cuda")
    b = gpu.answer("Which error code?", passages, attention="block", debias="none", max_new_tokens=8)
    assert b.timings.to_dict()["kv_hits"] == len(passages) and b.text == a.text
