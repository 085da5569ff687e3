"""One collection on disk: documents, chunks, their vectors, a BM25 index and a faiss index.

Layout of a store directory::

    ldqa.sqlite           source of truth (WAL mode): meta, documents, chunks (+ embedding BLOBs),
                          chunks_fts (FTS5, external content, kept in sync by triggers)
    vectors.faiss         derived dense index, written atomically by `Store.flush`
    vectors.faiss.json    its sidecar {model, dim, kind, count, generation}

Every ingest/delete transaction bumps ``meta.generation``.  On open, a faiss file whose sidecar
generation or count disagrees with SQLite (a crash between the SQLite commit and the faiss write), or
that is missing or unreadable, is rebuilt from the BLOBs.  Stray ``.tmp-*`` files from an interrupted
write are ignored.

BM25 is SQLite FTS5's ``bm25()`` (Robertson & Zaragoza's Okapi BM25, k1 = 1.2, b = 0.75) over a
``porter unicode61`` tokenizer, run on each chunk's ``search_text`` column: the chunk text NFKC-folded
with CJK runs split into character bigrams (`ldqa.retrieval.search_text`); questions get the same
rewriting (`fts_query`). A store written before that column existed (schema 1, BM25 over the raw text) is
rebuilt when it is opened, in one transaction: a crash leaves it as it was, never half-converted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import sqlite_utils

from ldqa.indexes.vector_index import (
    TMP_PREFIX,
    IndexMismatchError,
    VectorIndex,
    mismatch_message,
)
from ldqa.retrieval.search_text import has_cjk, search_terms, search_text
from ldqa.retrieval.types import Chunk, Document, with_header

log = logging.getLogger(__name__)

DB_NAME = "ldqa.sqlite"
INDEX_NAME = "vectors.faiss"
SCHEMA_VERSION = 2  # 2: chunks.search_text (NFKC + CJK bigrams) is what FTS5 indexes; chunks.header
STALE_TMP_S = 3600.0  # temp files older than this (seconds) are swept on open
_SQL_BATCH = 500  # ids per `IN (...)` query, well under SQLite's variable limit
_MAX_QUERY_TERMS = 64

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS documents (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        path TEXT NOT NULL UNIQUE,
        title TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        kind TEXT NOT NULL,
        n_chars INTEGER NOT NULL,
        n_chunks INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        added_at TEXT NOT NULL,
        meta_json TEXT NOT NULL DEFAULT '{}'
    )""",
    "CREATE INDEX IF NOT EXISTS documents_sha256 ON documents (sha256)",
    """CREATE TABLE IF NOT EXISTS chunks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        doc_id INTEGER NOT NULL REFERENCES documents (id),
        ordinal INTEGER NOT NULL,
        text TEXT NOT NULL,
        start INTEGER NOT NULL,
        "end" INTEGER NOT NULL,
        page INTEGER,
        n_tokens INTEGER NOT NULL,
        embedding BLOB NOT NULL,
        search_text TEXT NOT NULL DEFAULT '',
        header TEXT NOT NULL DEFAULT ''
    )""",
    "CREATE INDEX IF NOT EXISTS chunks_doc ON chunks (doc_id, ordinal)",
]
_FTS_TOKENIZE = "porter unicode61 remove_diacritics 2"
# FTS5 over chunks.search_text (external content: the text lives once, in `chunks`), kept in sync by triggers
_FTS_SCHEMA = [
    f"""CREATE VIRTUAL TABLE chunks_fts USING fts5(search_text, tokenize='{_FTS_TOKENIZE}', content='chunks',
        content_rowid='id')""",
    """CREATE TRIGGER chunks_ai AFTER INSERT ON chunks BEGIN
        INSERT INTO chunks_fts (rowid, search_text) VALUES (new.id, new.search_text); END""",
    """CREATE TRIGGER chunks_ad AFTER DELETE ON chunks BEGIN
        INSERT INTO chunks_fts (chunks_fts, rowid, search_text) VALUES ('delete', old.id, old.search_text); END""",
    """CREATE TRIGGER chunks_au AFTER UPDATE ON chunks BEGIN
        INSERT INTO chunks_fts (chunks_fts, rowid, search_text) VALUES ('delete', old.id, old.search_text);
        INSERT INTO chunks_fts (rowid, search_text) VALUES (new.id, new.search_text); END""",
]

# Words that carry no retrieval signal in a question; a query made only of these gives no BM25 hits.
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have
    having he her here hers herself him himself his how i if in into is it its itself just me more most my
    myself no nor not now of off on once only or other our ours ourselves out over own same she should so
    some such than that the their theirs them themselves then there these they this those through to too
    under until up very was we were what when where which while who whom why will with would you your
    yours yourself yourselves s t d ll m re ve""".split()
)


def default_store_dir(name: str = "default") -> Path:
    """Where the collection `name` lives by default: ``<user data dir>/ldqa/stores/<name>``.

    The user data dir comes from platformdirs (``~/.local/share/ldqa`` on Linux).  Nothing is created.

    Raises
    ------
    ValueError
        If `name` is empty or holds characters other than letters, digits, ``.``, ``_``, ``-``
        (or starts with a dot).
    """
    from platformdirs import user_data_dir

    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", name or ""):
        raise ValueError(
            f"store name {name!r} is not valid: use letters, digits, '.', '_' or '-' (not starting with '.'),"
            " or pass a directory path with --store"
        )
    return Path(user_data_dir("ldqa")) / "stores" / name


def fts_query(text: str) -> str | None:
    """Turn a free-text question into a safe FTS5 MATCH expression.

    Words (unicode ``\\w+`` runs of the NFKC-folded, lower-cased text; a CJK run becomes its character
    bigrams, as in the index: `ldqa.retrieval.search_text.search_terms`) have stopwords and single Latin
    letters dropped, duplicates removed, each kept word double-quoted (so FTS5 reads it as a plain string, never as an operator,
    column filter or prefix), and the words OR'ed: ``what's "x" AND (y2)`` -> ``"x" OR "y2"`` (the
    ``and`` is a stopword).  Returns None when nothing is left.
    """
    terms = [w for w in search_terms(text)
             if w not in STOPWORDS and (len(w) > 1 or w.isdigit() or has_cjk(w))]
    if not terms:
        return None
    return " OR ".join(f'"{t}"' for t in terms[:_MAX_QUERY_TERMS])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _doc_bytes(doc: Document) -> int:
    """Size of the source file in bytes: meta["bytes"], else the file on disk, else the UTF-8 text."""
    if isinstance(doc.meta.get("bytes"), int):
        return doc.meta["bytes"]
    try:
        return os.path.getsize(doc.path)
    except OSError:
        return len(doc.text.encode("utf-8"))


def _doc_row(row: dict | None) -> dict | None:
    if row is not None:
        row["meta"] = json.loads(row.get("meta_json") or "{}")
    return row


class Store:
    """A persistent collection of documents, chunks and vectors with dense and BM25 search.

    Parameters
    ----------
    path : str or Path
        The store directory (created if missing).  See `default_store_dir`.
    embedder_name : str
        Name of the embedding model the caller uses (`Embedder.name`); recorded on creation.
    dim : int
        Its vector dimension.
    index_kind : {"flat", "hnsw"}, optional
        faiss index kind.  None (default) keeps the kind the store was created with ("flat" for a new
        store); another value rebuilds the derived index in that kind and records it.

    Raises
    ------
    IndexMismatchError
        If the store was built with another embedding model or dimension.
    ValueError
        On a bad `dim` or `index_kind`, a `path` that is a file, or a store written by a newer ldqa (schema
        version).

    Notes
    -----
    Thread-safe: one SQLite connection (``check_same_thread=False``) and the in-memory faiss index are
    guarded by one lock, so a web app may share a Store between request threads.  Writes from another
    process are noticed through ``meta.generation`` and trigger a faiss rebuild on the next search.
    """

    def __init__(self, path: str | os.PathLike, embedder_name: str, dim: int, index_kind: str | None = None):
        if int(dim) <= 0:
            raise ValueError(f"Store: dim must be > 0, got {dim!r}")
        if index_kind not in (None, "flat", "hnsw"):
            raise ValueError(f"Store: index_kind must be 'flat' or 'hnsw', got {index_kind!r}")
        self.path = Path(path).expanduser()
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"store {self.path} is a file, not a directory: give the collection's directory "
                             "(a new one is created)")
        self.path.mkdir(parents=True, exist_ok=True)
        self.embedder_name = embedder_name
        self.dim = int(dim)
        self._lock = threading.RLock()
        self._hooks: list[Callable[[list[int]], None]] = []
        self._closed = False
        conn = sqlite3.connect(self.path / DB_NAME, check_same_thread=False, timeout=30.0)
        self.db = sqlite_utils.Database(conn)
        try:
            self.db.enable_wal()
            self.db.execute("PRAGMA foreign_keys = ON")
            self._create_schema()
            self.index_kind = self._check_meta(index_kind)
            self._sweep_tmp()
            self._index = self._open_index()
        except BaseException:
            conn.close()
            raise
        self._dirty = False

    # ---------------------------------------------------------------- setup
    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error); the caller holds the lock."""
        self.db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.conn.execute("ROLLBACK")
            raise
        self.db.conn.execute("COMMIT")

    def _create_schema(self) -> None:
        with self._lock, self._transaction():
            for sql in _SCHEMA:
                self.db.execute(sql)
            columns = {r[1] for r in self.db.execute("PRAGMA table_info(chunks)").fetchall()}
            if "search_text" not in columns:
                self._migrate_search_text()
            if not self.db["chunks_fts"].exists():
                for sql in _FTS_SCHEMA:
                    self.db.execute(sql)

    def _migrate_search_text(self) -> None:
        """Schema 1 -> 2 inside the caller's transaction: add chunks.search_text, fill it, and rebuild the
        FTS5 index over it (schema 1 indexed the raw text, where CJK runs were single tokens and ligatures
        unfolded). Everything or nothing is committed."""
        n = self.db.execute("SELECT count(*) FROM chunks").fetchone()[0]
        log.warning("store %s: rebuilding its BM25 index for CJK and ligature search (%d chunks, once)",
                    self.path, n)
        self.db.execute("ALTER TABLE chunks ADD COLUMN search_text TEXT NOT NULL DEFAULT ''")
        if "header" not in {r[1] for r in self.db.execute("PRAGMA table_info(chunks)").fetchall()}:
            self.db.execute("ALTER TABLE chunks ADD COLUMN header TEXT NOT NULL DEFAULT ''")
        for trigger in ("chunks_ai", "chunks_ad", "chunks_au"):
            self.db.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        self.db.execute("DROP TABLE IF EXISTS chunks_fts")
        rows = self.db.execute("SELECT id, text FROM chunks").fetchall()
        self.db.conn.executemany("UPDATE chunks SET search_text = ? WHERE id = ?",
                                 [(search_text(t), i) for i, t in rows])
        for sql in _FTS_SCHEMA:
            self.db.execute(sql)
        self.db.execute("INSERT INTO chunks_fts (chunks_fts) VALUES ('rebuild')")
        if self.db.execute("SELECT 1 FROM meta WHERE key = 'schema_version'").fetchone():
            self._set_meta(schema_version=SCHEMA_VERSION)

    def _meta(self) -> dict[str, str]:
        return {r["key"]: r["value"] for r in self.db.query("SELECT key, value FROM meta")}

    def _set_meta(self, **values) -> None:
        for key, value in values.items():
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [key, str(value)])

    def answer_settings(self) -> dict:
        """This collection's saved answer settings (e.g. {"max_new_tokens": 256}); {} when none were saved.
        They live in the store's SQLite meta table under the key ``answer_settings`` (JSON)."""
        with self._lock:
            self._check_open()
            row = self.db.execute("SELECT value FROM meta WHERE key = 'answer_settings'").fetchone()
        return json.loads(row[0]) if row else {}

    def set_answer_settings(self, **values) -> dict:
        """Merge `values` (JSON-serializable) into the saved answer settings, in one transaction; returns
        them all. A value of None removes that setting."""
        with self._lock, self._transaction():
            self._check_open()
            row = self.db.execute("SELECT value FROM meta WHERE key = 'answer_settings'").fetchone()
            current = {**(json.loads(row[0]) if row else {}), **values}
            current = {k: v for k, v in current.items() if v is not None}
            self._set_meta(answer_settings=json.dumps(current, sort_keys=True))
        return current

    def check_embedder(self, name: str, dim: int) -> None:
        """Raise IndexMismatchError (naming both models and saying to re-ingest) unless the embedding
        model `name` with `dim` dimensions is the one this store was built with."""
        if name != self.embedder_name or int(dim) != self.dim:
            raise IndexMismatchError(mismatch_message(self.path, self.embedder_name, self.dim, name, int(dim)))

    def _check_meta(self, index_kind: str | None) -> str:
        with self._lock, self._transaction():
            meta = self._meta()
            if "embedder" not in meta:
                meta = {"embedder": self.embedder_name, "dim": str(self.dim), "index_kind": index_kind or "flat",
                        "generation": "0", "schema_version": str(SCHEMA_VERSION), "created_at": _now()}
                self._set_meta(**meta)
            if int(meta.get("schema_version", SCHEMA_VERSION)) > SCHEMA_VERSION:
                raise ValueError(f"store {self.path} was written by a newer ldqa (schema "
                                 f"{meta['schema_version']} > {SCHEMA_VERSION}); upgrade ldqa")
            if meta["embedder"] != self.embedder_name or int(meta["dim"]) != self.dim:
                raise IndexMismatchError(
                    mismatch_message(self.path, meta["embedder"], int(meta["dim"]), self.embedder_name, self.dim)
                )
            if index_kind and index_kind != meta.get("index_kind"):
                self._set_meta(index_kind=index_kind)
            self._generation = int(meta["generation"])
            return index_kind or meta.get("index_kind", "flat")

    def _sweep_tmp(self) -> None:
        """Delete old ``.tmp-*`` leftovers of interrupted atomic writes (young ones may be in flight)."""
        now = time.time()
        for p in self.path.glob(TMP_PREFIX + "*"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > STALE_TMP_S:
                    p.unlink()

    @property
    def _index_path(self) -> Path:
        return self.path / INDEX_NAME

    def _open_index(self) -> VectorIndex:
        """The faiss index from disk if it matches SQLite, else rebuilt from the BLOBs and saved."""
        try:
            index = VectorIndex.load(self._index_path, self.embedder_name, self.dim)
        except (FileNotFoundError, ValueError, IndexMismatchError) as exc:
            reason = str(exc)
        else:
            ids = np.sort(index.ids())  # (n,)
            db_ids = np.fromiter((r["id"] for r in self.db.query("SELECT id FROM chunks ORDER BY id")), np.int64)
            if index.kind != self.index_kind:
                reason = f"index kind {index.kind} != {self.index_kind}"
            elif index.generation != self._generation:
                reason = f"generation {index.generation} != {self._generation}"
            elif ids.shape != db_ids.shape or not np.array_equal(ids, db_ids):
                reason = f"{len(ids)} vectors != {len(db_ids)} chunks"
            else:
                return index
        log.info("rebuilding faiss index of store %s (%s)", self.path, reason)
        return self._rebuild_index(save=True)

    def _rebuild_index(self, save: bool) -> VectorIndex:
        index = VectorIndex(self.dim, self.index_kind, self.embedder_name)
        ids: list[int] = []
        vecs: list[np.ndarray] = []
        for row in self.db.query("SELECT id, embedding FROM chunks ORDER BY id"):
            ids.append(row["id"])
            vecs.append(np.frombuffer(row["embedding"], dtype=np.float32))
            if len(ids) >= 4096:
                index.add(np.asarray(ids, np.int64), np.stack(vecs))  # (4096,), (4096, dim)
                ids, vecs = [], []
        if ids:
            index.add(np.asarray(ids, np.int64), np.stack(vecs))  # (n, dim)
        self._generation = int(self._meta()["generation"])
        if save:
            try:
                index.save(self._index_path, self._generation)
            except OSError as exc:  # read-only directory: keep the index in memory
                log.warning("could not write %s: %s", self._index_path, exc)
        index.generation = self._generation
        return index

    def _current_index(self) -> VectorIndex:
        """The in-memory index, rebuilt if lost or if another process changed the store."""
        db_gen = int(self._meta()["generation"])
        if self._index is None or db_gen != self._generation:
            self._index = self._rebuild_index(save=False)
            self._dirty = True
        return self._index

    # ------------------------------------------------------------- documents
    def get_document_by_sha(self, sha: str) -> dict | None:
        """The document row whose file bytes hash to `sha` (hex sha256), or None."""
        with self._lock:
            rows = list(self.db.query("SELECT * FROM documents WHERE sha256 = ? ORDER BY id LIMIT 1", [sha]))
        return _doc_row(rows[0] if rows else None)

    def get_document_by_path(self, path: str | os.PathLike) -> dict | None:
        """The document row stored for source `path` (as given at ingest), or None."""
        with self._lock:
            rows = list(self.db.query("SELECT * FROM documents WHERE path = ?", [str(path)]))
        return _doc_row(rows[0] if rows else None)

    def documents(self) -> list[dict]:
        """All document rows, oldest first.

        Each dict has id, path, title, sha256, kind, n_chars, n_chunks, bytes (source file size),
        added_at (ISO 8601 UTC), meta_json and meta (parsed).
        """
        with self._lock:
            rows = list(self.db.query("SELECT * FROM documents ORDER BY id"))
        return [_doc_row(r) for r in rows]

    def on_chunks_removed(self, callback: Callable[[list[int]], None]) -> Callable[[list[int]], None]:
        """Register `callback(chunk_ids)`, called after a commit that removed chunks; returns it.

        Called outside the store lock; an exception in a callback is logged, not raised.
        """
        self._hooks.append(callback)
        return callback

    def _fire_removed(self, chunk_ids: list[int]) -> None:
        if not chunk_ids:
            return
        for hook in list(self._hooks):
            try:
                hook(list(chunk_ids))
            except Exception:
                log.exception("on_chunks_removed hook %r failed", hook)

    def _validate_add(self, doc: Document, chunks: Sequence[Chunk], vectors) -> np.ndarray:
        if not isinstance(doc, Document):
            raise TypeError(f"add_document: doc must be a Document, got {type(doc).__name__}")
        vecs = np.ascontiguousarray(vectors, dtype=np.float32)  # (n, dim)
        if vecs.shape != (len(chunks), self.dim):
            raise ValueError(
                f"add_document({doc.path}): vectors must be ({len(chunks)}, {self.dim}) for {len(chunks)} chunks,"
                f" got {vecs.shape}"
            )
        if not np.isfinite(vecs).all():
            raise ValueError(f"add_document({doc.path}): vectors contain NaN or inf")
        for c in chunks:
            if not isinstance(c, Chunk) or not isinstance(c.text, str):
                raise TypeError(f"add_document({doc.path}): chunks must be Chunk objects with str text")
        return vecs

    def _delete_rows(self, doc_id: int) -> list[int]:
        """Delete one document's chunk rows (FTS follows by trigger) and its row; inside a transaction."""
        ids = [r["id"] for r in self.db.query("SELECT id FROM chunks WHERE doc_id = ? ORDER BY id", [doc_id])]
        self.db.execute("DELETE FROM chunks WHERE doc_id = ?", [doc_id])
        self.db.execute("DELETE FROM documents WHERE id = ?", [doc_id])
        return ids

    def _bump_generation(self) -> None:
        self.db.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'generation'")

    def add_document(self, doc: Document, chunks: Sequence[Chunk], vectors: np.ndarray) -> int:
        """Store a document with its chunks and their vectors in one transaction.

        Parameters
        ----------
        doc : Document
        chunks : sequence of Chunk
            The document's chunks (may be empty: the document is then recorded with n_chunks = 0).
        vectors : array-like of float, shape (len(chunks), dim)
            One embedding per chunk, row-aligned with `chunks`.

        Returns
        -------
        int
            The document id.  If a document with the same sha256 is already stored, nothing changes and
            its id is returned (check `get_document_by_sha` first to skip embedding).  If another
            document is stored under the same path, it is replaced in the same transaction, and
            `on_chunks_removed` hooks get its chunk ids after the commit.

        Raises
        ------
        TypeError, ValueError
            On a non-Document, non-Chunk items, or vectors of the wrong shape or with NaN/inf.
        """
        vecs = self._validate_add(doc, chunks, vectors)
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].ordinal)  # chunk ids ascend with ordinal
        chunks = [chunks[i] for i in order]
        vecs = vecs[order] if len(order) else vecs  # (n, dim), a copy: the caller's array is untouched
        with self._lock:
            self._check_open()
            index = self._current_index()
            with self._transaction():
                same = self.db.execute("SELECT id FROM documents WHERE sha256 = ? ORDER BY id LIMIT 1",
                                       [doc.sha256]).fetchone()
                if same is not None:
                    return int(same[0])
                old = self.db.execute("SELECT id FROM documents WHERE path = ?", [str(doc.path)]).fetchone()
                removed = self._delete_rows(old[0]) if old else []
                doc_id = self._insert_rows(doc, chunks, vecs)
                new_ids = [r[0] for r in self.db.execute(
                    "SELECT id FROM chunks WHERE doc_id = ? ORDER BY id", [doc_id])]  # insertion order
                self._bump_generation()
            self._apply_to_index(index, removed, new_ids, vecs)
        self._fire_removed(removed)
        return doc_id

    def _insert_rows(self, doc: Document, chunks: Sequence[Chunk], vecs: np.ndarray) -> int:
        cur = self.db.execute(
            "INSERT INTO documents (path, title, sha256, kind, n_chars, n_chunks, bytes, added_at, meta_json)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [str(doc.path), doc.title, doc.sha256, doc.kind, len(doc.text), len(chunks), _doc_bytes(doc), _now(),
             json.dumps(doc.meta, default=str)],
        )
        doc_id = int(cur.lastrowid)
        self.db.conn.executemany(
            'INSERT INTO chunks (doc_id, ordinal, text, start, "end", page, n_tokens, embedding, search_text, header)'
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(doc_id, c.ordinal, c.text, c.start, c.end, c.page, c.n_tokens, v.tobytes(),
              search_text(with_header(getattr(c, "header", ""), c.text)), getattr(c, "header", ""))
             for c, v in zip(chunks, vecs)],
        )
        return doc_id

    def _apply_to_index(self, index: VectorIndex, removed: list[int], new_ids: list[int], vecs) -> None:
        """Mirror a committed change in the in-memory faiss index (dropped -> rebuilt on next use)."""
        try:
            index.remove(np.asarray(removed, np.int64))
            index.add(np.asarray(new_ids, np.int64), vecs)  # (n,), (n, dim)
            self._generation = int(self._meta()["generation"])
        except Exception:
            log.exception("faiss update failed; the index will be rebuilt from SQLite")
            self._index = None
        self._dirty = True

    def delete_document(self, doc_id: int) -> list[int]:
        """Delete a document, its chunks, FTS rows and vectors in one transaction.

        Returns
        -------
        list of int
            The removed chunk ids (also passed to `on_chunks_removed` hooks after the commit).

        Raises
        ------
        KeyError
            If no document has id `doc_id`.
        """
        with self._lock:
            self._check_open()
            index = self._current_index()
            with self._transaction():
                if self.db.execute("SELECT 1 FROM documents WHERE id = ?", [int(doc_id)]).fetchone() is None:
                    raise KeyError(f"no document with id {doc_id} in store {self.path}; see `ldqa list`")
                removed = self._delete_rows(int(doc_id))
                self._bump_generation()
            self._apply_to_index(index, removed, [], np.zeros((0, self.dim), np.float32))
        self._fire_removed(removed)
        return removed

    # ----------------------------------------------------------- persistence
    def flush(self) -> None:
        """Write the faiss index and its sidecar (atomically) if it changed since the last write."""
        with self._lock:
            self._check_open()
            if not self._dirty and self._index is not None:
                return
            index = self._current_index()
            index.save(self._index_path, self._generation)
            self._dirty = False

    def close(self) -> None:
        """Flush and close the database connection; further calls fail.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                self.db.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.path} is closed")

    # ---------------------------------------------------------------- search
    def dense_search(self, qvec: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Top-k chunks by inner product with `qvec` (cosine for unit vectors).

        Parameters
        ----------
        qvec : array-like of float, shape (dim,)
        k : int
            >= 1; clamped to the number of chunks.

        Returns
        -------
        list of (chunk_id, score)
            Best first; [] for an empty store.
        """
        qvec = np.asarray(qvec, dtype=np.float32)
        if qvec.shape != (self.dim,):
            raise ValueError(f"dense_search: query vector must be ({self.dim},), got {qvec.shape}")
        with self._lock:
            self._check_open()
            return self._current_index().search(qvec, k)

    def bm25_search(self, query: str, k: int) -> list[tuple[int, float]]:
        """Top-k chunks by FTS5 BM25 for a free-text `query` (sanitized by `fts_query`).

        Returns
        -------
        list of (chunk_id, score)
            score = -bm25() (higher is better), best first, ties by chunk id; [] when the query has no
            searchable words (empty, punctuation or stopwords only) or nothing matches.

        Raises
        ------
        ValueError
            If `k < 1`.
        """
        if int(k) < 1:
            raise ValueError(f"bm25_search: k must be >= 1, got {k!r}")
        match = fts_query(query)
        if match is None:
            return []
        with self._lock:
            self._check_open()
            rows = self.db.execute(
                "SELECT rowid, bm25(chunks_fts) AS s FROM chunks_fts WHERE chunks_fts MATCH ?"
                " ORDER BY s, rowid LIMIT ?",
                [match, int(k)],
            ).fetchall()
        return [(int(i), -float(s)) for i, s in rows]

    def get_chunks(self, ids: Iterable[int]) -> list[dict]:
        """Chunk rows for `ids`, in the order given; ids no longer stored are skipped.

        Each dict: id, doc_id, ordinal, text, start, end, page, n_tokens, header (table header rows read
        before the text, "" for none), title, path (of the document).
        """
        ids = [int(i) for i in ids]
        found: dict[int, dict] = {}
        with self._lock:
            self._check_open()
            for lo in range(0, len(ids), _SQL_BATCH):
                batch = ids[lo:lo + _SQL_BATCH]
                marks = ", ".join("?" * len(batch))
                for row in self.db.query(
                    'SELECT c.id, c.doc_id, c.ordinal, c.text, c.start, c."end", c.page, c.n_tokens, c.header,'
                    " d.title, d.path FROM chunks c JOIN documents d ON d.id = c.doc_id"
                    f" WHERE c.id IN ({marks})",
                    batch,
                ):
                    found[row["id"]] = row
        return [found[i] for i in ids if i in found]

    def chunk_ids(self, doc_ids: Iterable[int] | None = None) -> list[int]:
        """Ids of the chunks of `doc_ids` (all documents when None), ascending."""
        with self._lock:
            self._check_open()
            if doc_ids is None:
                return [r[0] for r in self.db.execute("SELECT id FROM chunks ORDER BY id")]
            out: list[int] = []
            docs = [int(d) for d in doc_ids]
            for lo in range(0, len(docs), _SQL_BATCH):
                batch = docs[lo:lo + _SQL_BATCH]
                marks = ", ".join("?" * len(batch))
                out += [r[0] for r in self.db.execute(f"SELECT id FROM chunks WHERE doc_id IN ({marks})", batch)]
            return sorted(out)

    def get_vectors(self, ids: Sequence[int]) -> np.ndarray:
        """Stored embeddings for `ids`, float32 (len(ids), dim), in order.  Raises KeyError on unknown ids."""
        ids = [int(i) for i in ids]
        found: dict[int, np.ndarray] = {}
        with self._lock:
            for lo in range(0, len(ids), _SQL_BATCH):
                batch = ids[lo:lo + _SQL_BATCH]
                marks = ", ".join("?" * len(batch))
                for i, blob in self.db.execute(f"SELECT id, embedding FROM chunks WHERE id IN ({marks})", batch):
                    found[i] = np.frombuffer(blob, dtype=np.float32)
        missing = [i for i in ids if i not in found]
        if missing:
            raise KeyError(f"chunk ids {missing[:10]} are not in store {self.path}")
        return np.stack([found[i] for i in ids]) if ids else np.zeros((0, self.dim), np.float32)

    # ----------------------------------------------------------------- sizes
    def n_chunks(self) -> int:
        """Number of stored chunks."""
        with self._lock:
            return int(self.db.execute("SELECT count(*) FROM chunks").fetchone()[0])

    def n_documents(self) -> int:
        """Number of stored documents."""
        with self._lock:
            return int(self.db.execute("SELECT count(*) FROM documents").fetchone()[0])

    def size_bytes(self) -> int:
        """Bytes on disk of the store's files (SQLite + WAL + faiss + sidecar), temp files excluded."""
        total = 0
        for p in self.path.iterdir():
            if p.is_file() and not p.name.startswith(TMP_PREFIX):
                with contextlib.suppress(OSError):
                    total += p.stat().st_size
        return total

    @property
    def generation(self) -> int:
        """``meta.generation``: bumped by every ingest/delete transaction."""
        with self._lock:
            return int(self._meta()["generation"])

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, embedder={self.embedder_name!r}, dim={self.dim})"


def database_identity(directory: str | os.PathLike) -> dict:
    """What identifies the collection in `directory` without its paths: {"created_at", "generation",
    "documents", "digest"} (digest: sha256 over the document ids and file hashes). Read only; a copy made
    by `copy_database` has the identity of its source, whatever paths it rewrote.

    Raises
    ------
    FileNotFoundError
        If `directory` holds no collection database.
    """
    import hashlib

    db = Path(directory).expanduser() / DB_NAME
    if not db.is_file():
        raise FileNotFoundError(f"no collection in {db.parent} (no {DB_NAME})")
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        docs = conn.execute("SELECT id, sha256 FROM documents ORDER BY id").fetchall()
    finally:
        conn.close()
    digest = hashlib.sha256("\n".join(f"{i} {s}" for i, s in docs).encode()).hexdigest()
    return {"created_at": meta.get("created_at", ""), "generation": int(meta.get("generation", 0)),
            "documents": len(docs), "digest": digest}


def copy_database(src: str | os.PathLike, dst: str | os.PathLike, relocate: tuple[str, str] | None = None) -> dict:
    """Copy the collection database of directory `src` into directory `dst` (created) as one consistent
    snapshot (SQLite's online backup, so a write in progress is either in it or not), after folding the
    source's write-ahead log into its main file. In the copy only, document paths that start with
    ``relocate[0]`` are rewritten to start with ``relocate[1]`` (files moved along with the collection).
    Returns the copy's `database_identity`. The vectors file is not copied (a store rebuilds it).

    Raises
    ------
    FileNotFoundError
        If `src` holds no collection database.
    FileExistsError
        If `dst` already holds one.
    """
    src_db, dst_db = Path(src).expanduser() / DB_NAME, Path(dst).expanduser() / DB_NAME
    if not src_db.is_file():
        raise FileNotFoundError(f"no collection in {src_db.parent} (no {DB_NAME})")
    if dst_db.exists():
        raise FileExistsError(f"{dst_db} exists: a collection is already there")
    dst_db.parent.mkdir(parents=True, exist_ok=True)
    source = sqlite3.connect(src_db, timeout=30.0)
    try:
        source.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the main file alone then holds every commit
        target = sqlite3.connect(dst_db)
        try:
            source.backup(target)
            if relocate:
                old, new = relocate
                with target:
                    target.execute("UPDATE documents SET path = ? || substr(path, ?) WHERE substr(path, 1, ?) = ?",
                                   [new, len(old) + 1, len(old), old])
        finally:
            target.close()
    finally:
        source.close()
    return database_identity(dst_db.parent)
