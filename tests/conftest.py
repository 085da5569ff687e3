"""Shared fixtures: tiny random-weight models of every supported family (built with transformers, so
they double as parity references; base models: their tokenizer carries no chat template) and paths to
the shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

FAMILIES = ("llama", "llama3-scaled", "qwen2", "qwen3", "gemma3")


def _hf_config(family: str, vocab: int):
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "llama":
        return T.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True), T.LlamaForCausalLM
    if family == "llama3-scaled":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return T.LlamaConfig(**common, rope_parameters=rope), T.LlamaForCausalLM
    if family == "qwen2":
        return T.Qwen2Config(**common, rope_theta=1e6), T.Qwen2ForCausalLM
    if family == "qwen3":
        return T.Qwen3Config(**common, head_dim=32, rope_theta=1e6), T.Qwen3ForCausalLM
    if family == "gemma3":
        cfg = T.Gemma3TextConfig(**{**common, "num_hidden_layers": 4, "num_key_value_heads": 1}, head_dim=32,
                                 query_pre_attn_scalar=32, sliding_window=16,
                                 layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                              "full_attention"],
                                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
        return cfg, T.Gemma3ForCausalLM
    raise ValueError(family)


@pytest.fixture(scope="session")
def small_tokenizer():
    """SmolLM2's tokenizer (49K vocab), converted once from the packaged GGUF."""
    from ldqa.attention.loader import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, small_tokenizer):
    """factory(family) -> a Hugging Face model directory with random weights (seeded) + a tokenizer."""
    import torch

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            torch.manual_seed(0)
            cfg, cls = _hf_config(family, len(small_tokenizer.hf))
            model = cls(cfg).eval()
            with torch.no_grad():  # random norms so (1 + w) vs w mistakes show up
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(0.0, 0.3)
            d = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(d)
            small_tokenizer.hf.save_pretrained(d)
            _drop_chat_template(d)  # a base model: the chat-template path has its own tests (test_chat.py)
            made[family] = d
        return made[family]

    return make


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory):
    """factory(family) -> a tiny random-weight model directory (as `tiny_model_dir`) with a byte-level
    tokenizer made in code instead of SmolLM2's: needs no packaged model (the GPU machine has none)."""
    import torch

    from ldqa.eval.bench.gpu_check import byte_tokenizer

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            torch.manual_seed(0)
            tok = byte_tokenizer()
            cfg, cls = _hf_config(family, len(tok))
            model = cls(cfg).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(0.0, 0.3)
            d = tmp_path_factory.mktemp(f"byte-{family}")
            model.save_pretrained(d)
            tok.save_pretrained(d)
            made[family] = d
        return made[family]

    return make


def _drop_chat_template(d: Path) -> None:
    """Remove the chat template from a saved tokenizer (SmolLM2-Instruct's tokenizer ships ChatML)."""
    import json

    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = d / "tokenizer_config.json"
    if cfg.exists():
        data = json.loads(cfg.read_text())
        data.pop("chat_template", None)
        cfg.write_text(json.dumps(data, indent=1))


@pytest.fixture
def avx2_kernel_lib(tmp_path):
    """The CPU kernel library built without AVX-512 (-mno-avx512f), as a machine without it would build it:
    a ctypes.CDLL with ldqa_q8_0_linear and ldqa_mats_linear typed. Skips off x86-64."""
    import ctypes
    import platform

    from ldqa.kernels import c_library, cpu_linear

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the kernel is written for x86-64")
    assert cpu_linear.available(), cpu_linear.unavailable_reason()
    cmd = [c_library._compiler(), "-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC"]
    lib = ctypes.CDLL(str(c_library._compile(cmd, tmp_path / "kernels-avx2.so")))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ldqa_q8_0_linear.argtypes = [p, i64, i64, p, p, i64, p, i32]
    lib.ldqa_mats_linear.argtypes = [p, i32, p, i64, i64, p, i32]
    return lib


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} not present (the shared data folder sits beside the repository)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def nq_small(shared_data, tmp_path_factory) -> Path:
    """The first 12 records of the NQ-open oracle file (a small corpus keeps eval runs fast)."""
    import gzip

    path = tmp_path_factory.mktemp("nq") / "nq-small.jsonl.gz"
    with gzip.open(shared_data / "nq-open-oracle.jsonl.gz", "rt") as f, gzip.open(path, "wt") as g:
        for _, line in zip(range(12), f):
            g.write(line)
    return path
