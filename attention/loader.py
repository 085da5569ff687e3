"""Load a model and its tokenizer for ldqa's runtime, offline: the entry point.

`load_model` resolves a packaged model name, a .gguf file or a Hugging Face directory to its source
(`model_sources`), reads its weights in the chosen format from the cache (`weight_cache`, which converts
them once), builds the Transformer from them and pairs it with its tokenizer (`tokenizer`), once per
process; `load_tokenizer` gives the tokenizer alone. The weight-format and KV-cache defaults and their
checks are here too (`default_weights`, `check_weights`, `check_kv_dtype`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ldqa.attention.cache_dir import cache_root  # noqa: F401  (re-exported: callers read loader.cache_root)
from ldqa.attention.choices import PREFILL_GEMMS
from ldqa.attention.choices import prefill_gemm as choose_prefill_gemm
from ldqa.attention.config import ModelConfig
from ldqa.attention.decode_runner import choose_runner
from ldqa.attention.device import DEVICE_WEIGHTS, check_weights_on, device_kind, resolve_device
from ldqa.attention.model import Transformer
from ldqa.attention.memory import retain_freed_memory, weights_on_huge_pages
from ldqa.attention.model_packages import PACKAGED_MODELS
from ldqa.attention.model_sources import DEFAULT_MODEL, ModelLoadError, _source, weights_fingerprint
from ldqa.attention.model_sources import (  # noqa: F401  (re-exported: callers import them from the loader)
    check_model_name, gguf_architecture, gguf_expected_size, model_fingerprint, resolve_gguf)
from ldqa.attention.quant import (DEFAULT_GROUP_SIZE, WEIGHT_FORMATS, QEmbedding, QLinear, WeightFormatError,
                                  check_format, set_prefill_gemm)
from ldqa.attention.tokenizer import Tokenizer
from ldqa.attention.weight_cache import _convert, _ensure_weights, _read_cache
from ldqa.kernels import cpu_linear

log = logging.getLogger(__name__)

# the application default (LongDocQA, CLI, eval; load_model itself defaults to fp32), chosen by measurement
# (docs/models.md#weight-formats): a GGUF model's own blocks (gguf: fp32's very weights, decode as fast as
# q8_0 or faster), q8_0 for a Hugging Face directory (which has no blocks); FALLBACK_WEIGHTS where the C
# kernel both need cannot be built
DEFAULT_WEIGHTS = "gguf"
DEFAULT_WEIGHTS_HF = "q8_0"
FALLBACK_WEIGHTS = "int8"
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # choices.KV_DTYPES
INT8_GEMM_FORMATS = ("int8", "q8_0", "gguf")  # the formats whose prefill GEMM `prefill_gemm` chooses

FP16_NAMES = ("fp16", "float16", "f16", "half")
FP16_HELP = ("ldqa has no float16 format: float16 tops out at 65504, Gemma 3's activations exceed that and "
             "its logits become NaN; bf16 takes the same memory with fp32's range")


@dataclass
class LoadedModel:
    """A ready model: `model` (ldqa Transformer, eval mode), `tokenizer`, `name`, `fingerprint` (sha256
    of the weights' source, and of the weight format unless fp32; it keys KV blocks), `source` (the .gguf
    file or HF directory), `hf_dir` (config.json and tokenizer files), `weights` (format), `group_size`
    (int4's input channels per scale), `kv_dtype` ("fp32" or "bf16"), `device` ("cpu", "cuda", "cuda:N") and
    `prefill_gemm` (`choices.PREFILL_GEMMS`: how its quantized layers multiply prefill rows)."""

    name: str
    model: Transformer
    tokenizer: Tokenizer
    fingerprint: str
    source: str
    hf_dir: str
    weights: str = "fp32"
    group_size: int = DEFAULT_GROUP_SIZE
    kv_dtype: str = "fp32"
    device: str = "cpu"
    prefill_gemm: str = "bf16"

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def kv_fingerprint(self) -> str:
        """What keys the KV states this model computes (stored blocks, the memo of exact prefills): its
        `fingerprint`, and the prefill GEMM where the int8 one computes them (`quant.QLinear.prefill_gemm`).
        Bias curves stay keyed by `fingerprint`: a position bias is the weights', not a GEMM's rounding."""
        if self.prefill_gemm == "bf16" or self.weights not in INT8_GEMM_FORMATS:
            return self.fingerprint
        return hashlib.sha256(f"{self.fingerprint}:prefill-gemm={self.prefill_gemm}".encode()).hexdigest()


_LOCK = threading.Lock()
_LOADED: dict[tuple, LoadedModel] = {}


def check_kv_dtype(kv_dtype: str) -> str:
    """Validate a KV cache dtype name ("fp32" or "bf16"); returns it. Raises ValueError naming it (for a
    float16 name, saying why there is none and to use bf16)."""
    if kv_dtype in FP16_NAMES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: {FP16_HELP}; use kv_dtype 'bf16' or 'fp32'")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    return kv_dtype


def check_weights(weights: str, group_size: int = DEFAULT_GROUP_SIZE, device: str = "cpu") -> str:
    """Validate a weight format name for this machine (`quant.check_format`) and the resolved `device`
    (`device.check_weights_on`: bf16 or fp32 on CUDA); returns it.

    Raises WeightFormatError naming it: an unknown name, an int4 group size not offered, a format this
    torch build cannot run, one the device does not run; a float16 name ("fp16", "float16", ...) is
    refused saying why (Gemma 3 overflows in float16) and to use bf16, int8 or fp32.
    """
    if weights in FP16_NAMES:
        raise WeightFormatError(f"weights={weights!r}: {FP16_HELP}; use weights 'bf16', 'int8' or 'fp32'")
    try:
        check_weights_on(weights, device)
    except ValueError as e:
        raise WeightFormatError(str(e)) from None
    return check_format(weights, group_size)


def default_weights(name: str | None = None, device: str = "cpu") -> str:
    """The weight format model `name` (default: DEFAULT_MODEL) gets when none is asked for: $LDQA_WEIGHTS,
    else on CUDA (`device`, resolved) bf16 (`device.DEVICE_WEIGHTS`), on the CPU DEFAULT_WEIGHTS (gguf) for
    a GGUF model and DEFAULT_WEIGHTS_HF (q8_0) for a Hugging Face directory, or FALLBACK_WEIGHTS (int8)
    where their C kernel cannot be built on this machine (no C compiler, not x86-64 with AVX2; logged once
    with the reason) — they would then run on the slow torch reference.
    Raises WeightFormatError naming the variable when it holds no format name."""
    env = os.environ.get("LDQA_WEIGHTS")
    if env and env not in WEIGHT_FORMATS:
        why = f" ({FP16_HELP})" if env in FP16_NAMES else ""
        raise WeightFormatError(f"$LDQA_WEIGHTS={env!r} is not a weight format{why}: set it to one of "
                                f"{', '.join(WEIGHT_FORMATS)} or unset it")
    if env:
        return env
    if device_kind(device) in DEVICE_WEIGHTS:
        return DEVICE_WEIGHTS[device_kind(device)][0]
    name = name or DEFAULT_MODEL
    weights = DEFAULT_WEIGHTS if name in PACKAGED_MODELS or str(name).endswith(".gguf") else DEFAULT_WEIGHTS_HF
    if not cpu_linear.available():
        log.warning("default weights %s instead of %s: %s", FALLBACK_WEIGHTS, weights, cpu_linear.unavailable_reason())
        return FALLBACK_WEIGHTS
    return weights


def load_model(name: str = DEFAULT_MODEL, weights: str = "fp32", group_size: int = DEFAULT_GROUP_SIZE,
               kv_dtype: str = "fp32", device: str = "cpu", prefill_gemm: str | None = None) -> LoadedModel:
    """Load (once per process) a packaged model name, a .gguf path or a HF model directory.

    weights: one of `quant.WEIGHT_FORMATS` (fp32, the reference and this function's default; bf16; int8;
    int4 with `group_size` input channels per scale). The application picks its own default
    (`default_weights()`). kv_dtype: "fp32" or "bf16", the dtype of the in-memory KV cache. device: "cpu",
    "cuda" or "cuda:N" (`device.resolve_device` resolves "auto"): the weights are read on the CPU, then
    moved to the device, where they take only the formats it runs (`device.check_weights_on`: bf16 or fp32
    on CUDA); the KV caches the model makes are on the device too. prefill_gemm: "bf16" or "int8", how
    the int8, q8_0 and gguf formats multiply prefill rows (`quant.QLinear.prefill_weight`; None: the
    model's, `choices.prefill_gemm`, which reads $LDQA_PREFILL_GEMM).
    Raises ModelLoadError (missing package/file, unreadable weights), UnsupportedModelError (architecture
    or RoPE variant not implemented; the message names it and the supported ones; checked from the
    file's metadata before any conversion), WeightFormatError (unknown format, float16, or one this torch
    build cannot run), ValueError (a device torch does not see, a format it does not run, a prefill GEMM
    not in `choices.PREFILL_GEMMS`).
    """
    device = resolve_device(device)
    check_weights(weights, group_size, device)
    check_kv_dtype(kv_dtype)
    prefill_gemm = check_prefill_gemm(prefill_gemm if prefill_gemm is not None else choose_prefill_gemm(name))
    retain_freed_memory()  # a prefill's buffers are reused, not faulted in again (attention/memory.py)
    gs = group_size if weights == "int4" else DEFAULT_GROUP_SIZE
    key = (name, weights, gs, kv_dtype, device, prefill_gemm)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(name, weights, gs, kv_dtype, device, prefill_gemm)
        return _LOADED[key]


def check_prefill_gemm(gemm: str) -> str:
    """`gemm` if it is one of `choices.PREFILL_GEMMS`, else ValueError naming the choices."""
    if gemm not in PREFILL_GEMMS:
        raise ValueError(f"prefill_gemm={gemm!r}: use one of {', '.join(PREFILL_GEMMS)}")
    return gemm


def _load(name: str, weights: str, group_size: int, kv_dtype: str, device: str = "cpu",
          prefill_gemm: str = "bf16") -> LoadedModel:
    src = _source(name)
    if weights == "gguf" and src.kind != "gguf":
        raise WeightFormatError(f"weights='gguf' keeps a GGUF file's own quantized blocks, and {name} is a "
                                "Hugging Face directory: use weights='q8_0' (the same kernel, 8.5 bits per weight)")
    if src.kind == "hf" and weights in ("fp32", "bf16"):  # a dtype cast of the source: nothing to cache
        model = _build_model(src.cfg, _convert(src, weights, group_size), src.path)
    else:
        path = _ensure_weights(src, weights, group_size)
        model = _build_model(src.cfg, _read_cache(path), path)
    if device != "cpu":
        model.to(device)  # bf16 or fp32 weights (`check_weights_on`); norms and biases stay fp32
    else:
        weights_on_huge_pages(model)  # a decode step streams every weight: 2 MB pages spare the TLB misses
    model.kv_dtype = KV_DTYPES[kv_dtype]
    model.weight_format = weights
    set_prefill_gemm(model, prefill_gemm)
    model.decoder = choose_runner(model)  # q8_0 and gguf weights decode in C; prefill runs the modules
    model.model_name = name  # error messages of the runtime (generate.NonFiniteLogitsError) name it
    tok = Tokenizer(_auto_tokenizer(src.meta_dir), src.cfg.eos_token_ids)
    fp = weights_fingerprint(src.fingerprint, weights, group_size)
    return LoadedModel(name, model, tok, fp, str(src.path), str(src.meta_dir), weights, group_size, kv_dtype,
                       device, prefill_gemm)


def _auto_tokenizer(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def _build_model(cfg: ModelConfig, groups: dict[str, dict], path: Path) -> Transformer:
    """A Transformer whose linear layers and embedding are QLinear/QEmbedding built from `groups`
    ({parameter name: portable tensors}, read from `path`). Raises ModelLoadError when they do not fit
    the config."""
    with torch.device("meta"):
        model = Transformer(cfg)
    biases = {n: g["weight"] for n, g in groups.items() if n.endswith(".bias")}
    plain = {}
    try:
        for name, t in groups.items():
            mod_name, _, pname = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            if isinstance(mod, torch.nn.Linear) and pname == "weight":
                q = QLinear.from_portable(t, biases.get(mod_name + ".bias"), mod.in_features, mod.out_features)
                _set_module(model, mod_name, q)
            elif isinstance(mod, torch.nn.Embedding):
                emb = QEmbedding(t, mod.num_embeddings, mod.embedding_dim)
                _set_module(model, mod_name, emb)
                if cfg.tie_embeddings:  # the head computes with the very same quantized values
                    model.lm_head = QLinear.from_portable(t, None, mod.embedding_dim, mod.num_embeddings)
            elif pname != "bias":
                plain[name] = t["weight"]
    except (KeyError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"cached weights {path} do not fit a {cfg.family} model ({e}); delete the file "
                             "to rebuild it") from e
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if unexpected or left:
        raise ModelLoadError(f"weights in {path} do not fit a {cfg.family} model: "
                             f"missing {left[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    return model


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


_TOKENIZERS: dict[str, Tokenizer] = {}


def load_tokenizer(name: str = DEFAULT_MODEL) -> Tokenizer:
    """The tokenizer of model `name` without loading its weights (chunking needs only this)."""
    from transformers import AutoTokenizer

    with _LOCK:
        for key, lm in _LOADED.items():
            if key[0] == name:
                return lm.tokenizer
        if name not in _TOKENIZERS:
            src = _source(name)
            _TOKENIZERS[name] = Tokenizer(AutoTokenizer.from_pretrained(str(src.meta_dir)), src.cfg.eos_token_ids)
        return _TOKENIZERS[name]
