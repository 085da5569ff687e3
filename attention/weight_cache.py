"""A model's weights in a weight format, converted once and cached.

Weights are read tensor by tensor (a GGUF tensor is dequantized with the `gguf` package, in row chunks
for the embedding; a Hugging Face directory's safetensors through `safe_open`) and stored at once in the
chosen format (`quant.WEIGHT_FORMATS`), so the peak memory of a conversion stays near the final size plus
one tensor; nothing holds the whole model in fp32 unless fp32 is asked for. The `gguf` format keeps a GGUF
tensor's own quantized blocks where the C kernel reads them (`_gguf_blocks`). The result is cached as
safetensors under the user cache dir, keyed by the source's sha256, the format and the torch version
(`_weights_path`, `_cache_metadata`); a stale or truncated file is rebuilt, never used, and later loads
read the cache (seconds).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ldqa.attention.cache_dir import cache_root
from ldqa.attention.config import UnsupportedModelError
from ldqa.attention.model import Transformer
from ldqa.attention.model_sources import CACHE_FORMAT, ModelLoadError, _Source
from ldqa.attention.quant import quantize_portable
from ldqa.kernels import cpu_linear

log = logging.getLogger(__name__)


def _weights_path(src: _Source, weights: str, group_size: int) -> Path:
    tag = f"{weights}-g{group_size}" if weights == "int4" else weights
    d = src.meta_dir if src.kind == "gguf" else cache_root() / "models" / f"hf-{src.fingerprint[:16]}-v{CACHE_FORMAT}"
    return d / f"weights-{tag}.safetensors"


def _cache_metadata(weights: str, group_size: int) -> dict:
    return {"ldqa_weights": str(CACHE_FORMAT), "format": weights, "group_size": str(group_size),
            "torch": torch.__version__.split("+")[0]}


def _ensure_weights(src: _Source, weights: str, group_size: int) -> Path:
    """Path of the cached weights of `src` in format `weights`, made tensor by tensor if missing, stale
    (another cache format or torch version) or unreadable (a truncated file is rebuilt, never used)."""
    path = _weights_path(src, weights, group_size)
    want = _cache_metadata(weights, group_size)
    if path.exists():
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            if meta == want:
                return path
            log.warning("%s was written for %s, not %s; rebuilding it", path, meta, want)
        except Exception as e:  # truncated or corrupt: rebuild from the source
            log.warning("cached weights %s are unreadable (%s); rebuilding them from %s", path, e, src.path)
    log.warning("converting %s to weight format %r and caching it in %s (once; about a minute for a "
                "270M-parameter model, more for a larger one)", src.path.name, weights, path.parent)
    state = {f"{name}::{k}": v.contiguous() for name, t in _convert(src, weights, group_size).items()
             for k, v in t.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        save_file(state, str(tmp), metadata=want)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _convert(src: _Source, weights: str, group_size: int) -> dict[str, dict]:
    """{parameter name: portable tensors} of every weight of `src` in format `weights`, read and
    converted tensor by tensor. gguf: a GGUF tensor in a block type the kernel reads keeps its bytes
    (`raw()`), the others are q8_0."""
    out = {}
    for name, rows, raw in _iter_source(src):
        blocks = raw() if weights == "gguf" and raw is not None else None
        out[name] = blocks if blocks is not None else quantize_rows(rows, weights, group_size, name)
    return out


def quantize_rows(rows, weights: str, group_size: int, name: str) -> dict:
    """Portable tensors (see `quant.quantize_portable`) of one parameter. `rows()` yields float32 row
    chunks (r, K) of a 2-D weight, quantized chunk by chunk (every format's scales are per row, so
    chunking changes nothing), or one 1-D tensor. Matrices (linear weights, embeddings) take the format;
    1-D tensors (norms, biases) stay fp32 as {"weight": tensor}."""
    parts = [quantize_portable(c, weights, group_size, name) if c.dim() == 2 else {"weight": c.float()}
             for c in rows()]
    if len(parts) == 1:
        return parts[0]
    return {k: (parts[0][k] if k == "group_size" else torch.cat([p[k] for p in parts])) for k in parts[0]}


_ROW_CHUNK = 1 << 14  # rows of a large matrix dequantized at a time (embedding: 16K x 640 fp32 = 42 MB)


def _iter_source(src: _Source):
    """(our parameter name, callable yielding float32 row chunks, callable giving the tensor's GGUF blocks
    as gguf portable tensors or None) for every weight of `src`; the third is None for a HF directory."""
    if src.kind == "gguf":
        yield from _iter_gguf(src)
    else:
        yield from _iter_hf(src)


def _iter_hf(src: _Source):
    tie = src.cfg.tie_embeddings
    for f in sorted(src.path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for key in sf.keys():
                name = _strip_prefix(key)
                if tie and name == "lm_head.weight":
                    continue
                shape = sf.get_slice(key).get_shape()

                def rows(sf=sf, key=key, shape=shape):
                    if len(shape) != 2:
                        yield sf.get_tensor(key).float()
                        return
                    sl = sf.get_slice(key)
                    for i in range(0, shape[0], _ROW_CHUNK):
                        yield sl[i:i + _ROW_CHUNK].float()

                yield name, rows, None


def _iter_gguf(src: _Source):
    """Dequantize the GGUF tensor by tensor (row chunks for large ones), renamed to HF parameter names and
    processed as transformers' GGUF loader does (Llama's q/k un-permuted, Gemma's norms minus 1)."""
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, GGUFReader, dequantize, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(src.path))
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise UnsupportedModelError(f"GGUF architecture {arch_name!r} is unknown to the gguf package")
    cfg = src.cfg
    hf_cfg = json.loads((src.meta_dir / "config.json").read_text())
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=hf_cfg)
    name_map = get_tensor_name_map(arch, cfg.num_layers)
    with torch.device("meta"):
        names = list(Transformer(cfg).state_dict())
    gguf_to_ours = {}
    for n in names:
        base, suffix = n.rsplit(".", 1)
        g = name_map.get_name(base)
        if g is not None:
            gguf_to_ours[f"{g}.{suffix}"] = n
    for t in reader.tensors:
        name = gguf_to_ours.get(t.name)
        if name is None or (cfg.tie_embeddings and name == "lm_head.weight"):
            continue
        big = t.data.ndim == 2 and t.data.shape[0] > _ROW_CHUNK and name.endswith(("embed_tokens.weight",
                                                                                    "lm_head.weight"))

        def rows(t=t, big=big):
            step = _ROW_CHUNK if big else max(1, t.data.shape[0])
            for i in range(0, t.data.shape[0], step):
                w = dequantize(t.data[i:i + step], t.tensor_type)
                w = processor.process(weights=w, name=t.name).weights
                yield torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy

        yield name, rows, (lambda t=t: _gguf_blocks(t, processor))


def _gguf_blocks(t, processor) -> dict | None:
    """The GGUF tensor `t`'s quantized bytes as gguf portable tensors ({"blocks" (N, row bytes) uint8,
    "ggml_type"}), rows in the order transformers' processing gives the dequantized weight (Llama's q/k
    un-permuted: a row permutation, found by processing the row indices); None when the kernel does not
    read its block type, it is not a matrix, or the processing is not a row permutation."""
    import numpy as np

    ttype = int(t.tensor_type)
    if ttype not in cpu_linear.GGUF_BLOCK_TYPES or t.data.ndim != 2 or len(t.shape) != 2:
        return None
    n, k = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
    if t.data.shape != (n, cpu_linear.gguf_row_bytes(ttype, k)):
        return None
    perm = np.asarray(processor.process(weights=np.arange(n, dtype=np.float32)[:, None], name=t.name).weights)
    perm = perm.reshape(-1).astype(np.int64) if perm.size == n else None
    if perm is None or not np.array_equal(np.sort(perm), np.arange(n)):
        return None
    return {"blocks": torch.from_numpy(np.ascontiguousarray(t.data[perm])), "ggml_type": torch.tensor(ttype)}


def _read_cache(path: Path) -> dict[str, dict]:
    """{parameter name: portable tensors} from a weight cache file. Raises ModelLoadError if unreadable."""
    groups: dict[str, dict] = {}
    try:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                name, part = key.split("::")
                # a copy in memory of our own: safetensors' tensors may be unaligned, and the packed
                # matmuls read with aligned vector loads (an unaligned int8 weight crashes the process)
                groups.setdefault(name, {})[part] = f.get_tensor(key).clone()
    except Exception as e:
        raise ModelLoadError(f"cached weights {path} could not be read ({e}); delete the file to rebuild it") from e
    return groups


def _strip_prefix(k: str) -> str:
    for pre in ("model.language_model.", "language_model.model."):
        if k.startswith(pre):
            return "model." + k[len(pre):]
    return k
