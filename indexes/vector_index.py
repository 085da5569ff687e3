"""A small faiss wrapper: inner-product search over L2-normalized vectors, keyed by int64 chunk ids.

The index is *derived* data (the store keeps every vector in SQLite), so it is written atomically and
carries a JSON sidecar ``{model, dim, kind, count, generation}`` that lets the store decide whether the
file on disk is current or must be rebuilt.

Kinds:
- ``"flat"``: ``IndexIDMap2(IndexFlatIP)`` -- exact search, supports removal.
- ``"hnsw"``: ``IndexIDMap2(IndexHNSWFlat(METRIC_INNER_PRODUCT))`` -- approximate graph search
  (Malkov & Yashunin 2018).  HNSW cannot remove vectors, so `remove` rebuilds it from the kept vectors.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import faiss
import numpy as np

KINDS = ("flat", "hnsw")
HNSW_M = 32  # graph degree; faiss' usual default
HNSW_EF_SEARCH = 128  # candidate list size at query time (higher: better recall, slower)
HNSW_EF_CONSTRUCTION = 80
TMP_PREFIX = ".tmp-"  # temp files written by `atomic_write_bytes`; ignored (and swept) by readers


class IndexMismatchError(RuntimeError):
    """A store or index was built with another embedding model or dimension than the one opening it."""


def mismatch_message(store: str | os.PathLike, built_model: str, built_dim: int, model: str, dim: int) -> str:
    """The user-facing text of an `IndexMismatchError`."""
    opened = model if dim == built_dim else f"{model} (dim {dim})"
    return (
        f"store {store} was built with model {built_model} (dim {built_dim}); you opened it with {opened}"
        " — use a new --store or re-ingest"
    )


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically: temp file in the same directory, fsync, `os.replace`, dir fsync.

    A crash leaves either the old file or the new one, never a torn one (at worst a stray
    ``.tmp-*`` file, which readers ignore).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or new entry in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sidecar_path(path: str | os.PathLike) -> Path:
    """Path of the JSON sidecar of index file `path` (``vectors.faiss`` -> ``vectors.faiss.json``)."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """The sidecar dict of index file `path`, or None when it is missing or unreadable."""
    try:
        return json.loads(sidecar_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class VectorIndex:
    """Inner-product nearest-neighbour index over int64 ids.

    Parameters
    ----------
    dim : int
        Vector dimension (384 for all-MiniLM-L6-v2).
    kind : {"flat", "hnsw"}
        Exact flat index (default) or HNSW graph.
    model_name : str
        Name of the embedding model that produced the vectors (recorded in the sidecar).

    Raises
    ------
    ValueError
        On a non-positive `dim` or an unknown `kind`.

    Notes
    -----
    Not thread-safe by itself: the owner (`Store`) serializes calls with its lock.
    """

    def __init__(self, dim: int, kind: str = "flat", model_name: str = ""):
        if int(dim) <= 0:
            raise ValueError(f"VectorIndex: dim must be > 0, got {dim!r}")
        if kind not in KINDS:
            raise ValueError(f"VectorIndex: unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
        self.dim = int(dim)
        self.kind = kind
        self.model_name = model_name
        self.index = self._new_index()
        self.generation = 0  # as last saved/loaded

    def _new_index(self) -> faiss.IndexIDMap2:
        if self.kind == "flat":
            base = faiss.IndexFlatIP(self.dim)
        else:
            base = faiss.IndexHNSWFlat(self.dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
            base.hnsw.efSearch = HNSW_EF_SEARCH
        return faiss.IndexIDMap2(base)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def ids(self) -> np.ndarray:
        """All ids in the index, int64 (n,), in insertion order."""
        return faiss.vector_to_array(self.index.id_map).astype(np.int64)

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Add vectors under the given ids.

        Parameters
        ----------
        ids : array-like of int64, shape (n,)
            Ids, unique and not already present (the caller guarantees this; faiss does not check).
        vecs : array-like of float, shape (n, dim)
            Vectors, L2-normalized for cosine scores.

        Raises
        ------
        ValueError
            If the shapes disagree or `vecs` is not (n, dim).
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)  # (n,)
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)  # (n, dim)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim or vecs.shape[0] != ids.shape[0]:
            raise ValueError(
                f"VectorIndex.add: need ids (n,) and vecs (n, {self.dim}); got ids {ids.shape}, vecs {vecs.shape}"
            )
        if ids.size:
            self.index.add_with_ids(vecs, ids)

    def remove(self, ids) -> int:
        """Remove the given ids (unknown ids are ignored); return how many were removed.

        Flat: in place.  HNSW: rebuilt from the kept vectors (HNSW has no removal).
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)  # (r,)
        if ids.size == 0 or len(self) == 0:
            return 0
        if self.kind == "flat":
            return int(self.index.remove_ids(faiss.IDSelectorBatch(ids)))
        all_ids = self.ids()  # (n,)
        keep = ~np.isin(all_ids, ids)  # (n,)
        removed = int((~keep).sum())
        if removed:
            vecs = self.index.index.reconstruct_n(0, len(self))  # (n, dim), same order as all_ids
            self.index = self._new_index()
            self.add(all_ids[keep], vecs[keep])
        return removed

    def search(self, q: np.ndarray, k: int) -> list:
        """Top-k ids by inner product.

        Parameters
        ----------
        q : array-like of float, shape (dim,) or (m, dim)
            Query vector(s), L2-normalized for cosine scores.
        k : int
            Results wanted (>= 1); clamped to the index size.

        Returns
        -------
        list of (int, float), or list of such lists
            For a (dim,) query: ``[(id, score), ...]`` best first; for (m, dim): one such list per row.
            An empty index gives ``[]`` (or m empty lists).

        Raises
        ------
        ValueError
            If `k < 1` or `q` has the wrong shape.
        """
        if int(k) < 1:
            raise ValueError(f"VectorIndex.search: k must be >= 1, got {k!r}")
        q = np.ascontiguousarray(q, dtype=np.float32)
        single = q.ndim == 1
        q2 = q.reshape(1, -1) if single else q  # (m, dim)
        if q2.ndim != 2 or q2.shape[1] != self.dim:
            raise ValueError(f"VectorIndex.search: query must be ({self.dim},) or (m, {self.dim}), got {q.shape}")
        k = min(int(k), len(self))
        if k == 0:
            return [] if single else [[] for _ in range(q2.shape[0])]
        scores, ids = self.index.search(q2, k)  # (m, k), (m, k)
        rows = [
            [(int(i), float(s)) for i, s in zip(id_row, score_row) if i >= 0]
            for id_row, score_row in zip(ids, scores)
        ]
        return rows[0] if single else rows

    def save(self, path: str | os.PathLike, generation: int) -> None:
        """Write the index to `path` and its sidecar to ``path + ".json"``, each atomically.

        The index is written first, the sidecar second: a crash in between leaves an old sidecar
        (older generation), which tells the reader to rebuild.
        """
        path = Path(path)
        data = faiss.serialize_index(self.index).tobytes()
        atomic_write_bytes(path, data)
        sidecar = {
            "model": self.model_name,
            "dim": self.dim,
            "kind": self.kind,
            "count": len(self),
            "generation": int(generation),
        }
        atomic_write_bytes(sidecar_path(path), json.dumps(sidecar, indent=1).encode("utf-8"))
        self.generation = int(generation)

    @classmethod
    def load(cls, path: str | os.PathLike, expected_model: str, expected_dim: int) -> "VectorIndex":
        """Read an index written by `save`.

        Parameters
        ----------
        path : path
            The index file (its sidecar is ``path + ".json"``).
        expected_model, expected_dim : str, int
            The embedder the caller will query with.

        Returns
        -------
        VectorIndex
            With ``generation`` set from the sidecar.

        Raises
        ------
        FileNotFoundError
            If the index file or its sidecar is missing.
        IndexMismatchError
            If the sidecar names another model or dimension.
        ValueError
            If the file is unreadable or disagrees with its sidecar (count, dim): rebuild it.
        """
        path = Path(path)
        meta = read_sidecar(path)
        if meta is None or not path.exists():
            raise FileNotFoundError(f"no faiss index at {path} (or its sidecar {sidecar_path(path).name})")
        if meta.get("model") != expected_model or int(meta.get("dim", -1)) != int(expected_dim):
            raise IndexMismatchError(
                mismatch_message(path.parent, meta.get("model"), meta.get("dim"), expected_model, expected_dim)
            )
        kind = meta.get("kind", "flat")
        try:
            raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)
            index = faiss.deserialize_index(raw)
        except Exception as exc:  # faiss raises RuntimeError on torn/corrupt files
            raise ValueError(f"faiss index {path} is unreadable ({exc}); rebuild it") from exc
        if index.d != int(expected_dim) or index.ntotal != int(meta.get("count", -1)):
            raise ValueError(
                f"faiss index {path} holds {index.ntotal} vectors of dim {index.d}, sidecar says "
                f"{meta.get('count')} of dim {meta.get('dim')}; rebuild it"
            )
        out = cls(int(expected_dim), kind, expected_model)
        if not isinstance(index, faiss.IndexIDMap2):
            raise ValueError(f"faiss index {path} is not an id-mapped index; rebuild it")
        out.index = index
        if kind == "hnsw":
            faiss.downcast_index(index.index).hnsw.efSearch = HNSW_EF_SEARCH
        out.generation = int(meta.get("generation", -1))
        return out
