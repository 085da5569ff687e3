"""Persistent store of Block-Attention KV blocks: per-layer keys/values of one chunk, computed once, reused.

A block is keyed by `block_key`: a sha256 over (model fingerprint, prefix token ids, the block's own
token ids), LMCache-style, so the same passage hits wherever it appears in a prompt.  The key does not
depend on the block's neighbours or position; `KVBlock.start` records the position it was encoded at so
the attention side can re-encode RoPE to its new place.

Layout of a store directory::

    <key>.safetensors   one file per block: tensors "keys", "values" (num_layers, kv_heads, n_tokens,
                        head_dim) in the store dtype; metadata {"start", "n_tokens", "checksum", "format"}
    blocks.sqlite       (WAL) blocks(key, chunk_id, n_tokens, nbytes, created_at) for invalidation by
                        chunk id; meta(key, value) records the dtype the directory holds

Files are written atomically (temp file + fsync + ``os.replace``); nothing is ever pickled.  A file whose
checksum, shapes or metadata do not check out is deleted on read and reported as a miss (the caller
recomputes).  Because keys are content hashes, a block that outlives its chunk is never *wrong*, only
wasted space: `drop_chunks` reclaims it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import operator
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from ldqa.indexes.vector_index import TMP_PREFIX, atomic_write_bytes

log = logging.getLogger(__name__)

DB_NAME = "blocks.sqlite"
SUFFIX = ".safetensors"
FORMAT = "1"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
STALE_TMP_S = 3600.0  # temp files older than this (seconds) are swept on open; younger may be in flight
_SQL_BATCH = 500  # ids per `IN (...)` query
_KEY_CHARS = frozenset("0123456789abcdef")
_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS blocks (key TEXT PRIMARY KEY, chunk_id INTEGER NULL,
        n_tokens INTEGER NOT NULL, nbytes INTEGER NOT NULL, created_at TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS blocks_chunk ON blocks (chunk_id)",
]


class CorruptBlockError(ValueError):
    """A stored block file failed a checksum, shape or metadata check (internal; `get` returns None)."""


@dataclass
class KVBlock:
    """Per-layer KV states of one block.

    keys, values : torch.Tensor, shape (num_layers, kv_heads, n_tokens, head_dim)
        One stacked tensor each, same shape, any float dtype.  Keys carry RoPE at positions
        ``start .. start + n_tokens - 1``.
    start : int
        Absolute position of the block's first token when it was encoded (>= 0).

    Raises
    ------
    TypeError, ValueError
        If keys/values are not float tensors of the same 4-d shape, or `start` is not an int >= 0.
    """

    keys: torch.Tensor
    values: torch.Tensor
    start: int

    def __post_init__(self):
        for name, t in (("keys", self.keys), ("values", self.values)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4:
                raise TypeError(f"KVBlock.{name} must be a 4-d float tensor (num_layers, kv_heads, n_tokens,"
                                f" head_dim), got {getattr(t, 'shape', type(t).__name__)}")
        if self.keys.shape != self.values.shape:
            raise ValueError(f"KVBlock: keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)}"
                             " must have the same shape")
        if isinstance(self.start, bool) or operator.index(self.start) < 0:
            raise ValueError(f"KVBlock.start must be an int >= 0, got {self.start!r}")
        self.start = operator.index(self.start)

    @property
    def n_tokens(self) -> int:
        """Number of tokens in the block (dim 2)."""
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of keys + values (element data only)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


@dataclass
class KVStoreStats:
    """Counters since the store was opened, plus current sizes (bytes, entries)."""

    hits_memory: int = 0
    hits_disk: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0  # entries dropped from the memory LRU for the byte budget (still on disk)
    corrupt: int = 0  # disk entries that failed verification and were deleted
    bytes_in_memory: int = 0
    bytes_on_disk: int = 0  # tensor payload bytes of disk entries (file headers, ~200 B each, excluded)
    entries_on_disk: int = 0

    @property
    def hit_rate(self) -> float:
        """(memory + disk hits) / lookups; 0.0 when there were no lookups."""
        hits = self.hits_memory + self.hits_disk
        return hits / (hits + self.misses) if hits + self.misses else 0.0

    def to_dict(self) -> dict:
        """All fields plus hit_rate, JSON-ready."""
        return {**asdict(self), "hit_rate": self.hit_rate}


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """A model's KV size per token in bytes: ``2 * num_layers * kv_heads * head_dim * element_size``."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _ids_bytes(name: str, ids: Sequence[int]) -> bytes:
    try:
        arr = np.asarray([operator.index(i) for i in ids], dtype="<i8")
    except TypeError as exc:
        raise TypeError(f"block_key: {name} must be a sequence of int token ids ({exc})") from None
    return len(arr).to_bytes(8, "little") + arr.tobytes()


def block_key(model_fingerprint: str, prefix_ids: Sequence[int], chunk_ids: Sequence[int]) -> str:
    """Content key of a KV block: sha256 hex (64 chars) of (fingerprint, prefix ids, chunk ids).

    Each part is length-prefixed (ids as little-endian int64), so ``([1], [2, 3])`` and ``([1, 2], [3])``
    differ; stable across processes and platforms (no Python ``hash()``).  `prefix_ids` are the tokens
    the block was encoded after (e.g. a shared system prompt), not its neighbouring chunks.

    Raises
    ------
    TypeError
        If `model_fingerprint` is not a str or an id is not an int.
    """
    if not isinstance(model_fingerprint, str):
        raise TypeError(f"block_key: model_fingerprint must be a str, got {type(model_fingerprint).__name__}")
    fp = model_fingerprint.encode("utf-8")
    h = hashlib.sha256(b"ldqa-kv-block\0" + len(fp).to_bytes(8, "little") + fp)
    h.update(_ids_bytes("prefix_ids", prefix_ids))
    h.update(_ids_bytes("chunk_ids", chunk_ids))
    return h.hexdigest()


def _checksum(keys: torch.Tensor, values: torch.Tensor) -> str:
    """sha256 hex of the raw element bytes of `keys` then `values` (C order)."""
    h = hashlib.sha256()
    for t in (keys, values):
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _owned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous CPU copy of `t` in `dtype` (never aliases the caller's storage)."""
    return torch.empty(t.shape, dtype=dtype).copy_(t)


def _check_dtype(dtype) -> torch.dtype:
    if dtype not in DTYPES.values():
        raise ValueError(f"KVBlockStore: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    return dtype


def _check_key(key: str) -> str:
    if not isinstance(key, str) or len(key) != 64 or not set(key) <= _KEY_CHARS:
        raise ValueError(f"KVBlockStore: key must be a 64-char lowercase hex string from block_key(), got {key!r}")
    return key


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class KVBlockStore:
    """KV blocks in a memory LRU (byte budget) backed by a directory of safetensors files.

    Parameters
    ----------
    directory : Path or None
        Where blocks persist (created if missing); None keeps them in memory only.
    memory_budget_bytes : int
        Byte budget of the in-memory LRU (default 256 MiB); least-recently-used blocks beyond it are
        dropped from memory only.  0 disables the memory tier.
    dtype : torch.float16 or torch.bfloat16
        Storage dtype; blocks are cast to it on `put` and returned in it by `get`.

    Raises
    ------
    ValueError
        On another dtype, a negative budget, or a directory that already holds blocks of another dtype.

    Notes
    -----
    Thread-safe: one lock guards the LRU, the SQLite connection and file I/O.  Returned blocks are
    shared with the memory tier: treat them as read-only.
    """

    def __init__(self, directory: Path | None, memory_budget_bytes: int = 256 << 20, dtype=torch.float16):
        self.dtype = _check_dtype(dtype)
        if int(memory_budget_bytes) < 0:
            raise ValueError(f"KVBlockStore: memory_budget_bytes must be >= 0, got {memory_budget_bytes!r}")
        self.memory_budget_bytes = int(memory_budget_bytes)
        self.directory = None if directory is None else Path(directory).expanduser()
        self._lock = threading.RLock()
        self._mem: OrderedDict[str, tuple[KVBlock, int | None]] = OrderedDict()  # key -> (block, chunk_id)
        self._mem_bytes = 0
        self._stats = KVStoreStats()
        self._closed = False
        self._db = self._open_db() if self.directory is not None else None

    # ---------------------------------------------------------------- setup
    def _open_db(self) -> sqlite3.Connection:
        self.directory.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.directory / DB_NAME, check_same_thread=False, timeout=30.0,
                             isolation_level=None)  # autocommit; explicit transactions below
        try:
            db.execute("PRAGMA journal_mode=WAL")
            for sql in _SCHEMA:
                db.execute(sql)
            self._check_dir_dtype(db)
            self._sweep(db)
        except BaseException:
            db.close()
            raise
        return db

    def _check_dir_dtype(self, db: sqlite3.Connection) -> None:
        name = str(self.dtype).removeprefix("torch.")
        db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('dtype', ?)", [name])
        stored = db.execute("SELECT value FROM meta WHERE key = 'dtype'").fetchone()[0]
        if stored != name:
            raise ValueError(f"KV store {self.directory} holds {stored} blocks; open it with "
                             f"dtype=torch.{stored} or use another directory")

    def _sweep(self, db: sqlite3.Connection) -> None:
        """Delete stale temp files, block files without a row, and rows without a file."""
        now = time.time()
        for p in self.directory.glob(TMP_PREFIX + "*"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > STALE_TMP_S:
                    p.unlink()
        rows = {r[0] for r in db.execute("SELECT key FROM blocks")}
        files = {p.name[: -len(SUFFIX)] for p in self.directory.glob("*" + SUFFIX)}
        for key in files - rows:
            with contextlib.suppress(OSError):
                self._path(key).unlink()
        db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in rows - files])

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; open a new KVBlockStore")

    def _path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    # ---------------------------------------------------------------- memory tier
    def _remember(self, key: str, block: KVBlock, chunk_id: int | None) -> None:
        self._forget_memory(key)
        if block.nbytes > self.memory_budget_bytes:
            return
        self._mem[key] = (block, chunk_id)
        self._mem_bytes += block.nbytes
        while self._mem_bytes > self.memory_budget_bytes:
            self._forget_memory(next(iter(self._mem)))
            self._stats.evictions += 1

    def _forget_memory(self, key: str) -> bool:
        entry = self._mem.pop(key, None)
        if entry is not None:
            self._mem_bytes -= entry[0].nbytes
        return entry is not None

    # ---------------------------------------------------------------- disk tier
    def _read(self, key: str) -> KVBlock:
        """Load and verify one file.  Raises FileNotFoundError, or CorruptBlockError on any bad content."""
        data = self._path(key).read_bytes()
        try:
            header = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
            meta = header["__metadata__"]
            tensors = safetensors.torch.load(data)
            block = KVBlock(tensors["keys"], tensors["values"], int(meta["start"]))
        except Exception as exc:  # safetensors, json, KeyError, TypeError, ValueError: all mean "unreadable"
            raise CorruptBlockError(f"unreadable ({type(exc).__name__}: {exc})") from None
        self._verify(block, meta)
        return block

    def _verify(self, block: KVBlock, meta: dict) -> None:
        if meta.get("format") != FORMAT:
            raise CorruptBlockError(f"format {meta.get('format')!r} != {FORMAT!r}")
        if block.keys.dtype != self.dtype or block.values.dtype != self.dtype:
            raise CorruptBlockError(f"dtype {block.keys.dtype}/{block.values.dtype} != store dtype {self.dtype}")
        if str(block.n_tokens) != meta.get("n_tokens"):
            raise CorruptBlockError(f"n_tokens {meta.get('n_tokens')!r} != tensor length {block.n_tokens}")
        if _checksum(block.keys, block.values) != meta.get("checksum"):
            raise CorruptBlockError("checksum mismatch")

    def _write(self, key: str, block: KVBlock, chunk_id: int | None) -> None:
        meta = {"start": str(block.start), "n_tokens": str(block.n_tokens),
                "checksum": _checksum(block.keys, block.values), "format": FORMAT}
        data = safetensors.torch.save({"keys": block.keys, "values": block.values}, metadata=meta)
        self._db.execute("INSERT OR REPLACE INTO blocks (key, chunk_id, n_tokens, nbytes, created_at)"
                         " VALUES (?, ?, ?, ?, ?)", [key, chunk_id, block.n_tokens, block.nbytes, _now()])
        try:  # row first: a crash leaves a row without a file (a miss), swept on the next open
            atomic_write_bytes(self._path(key), data)
        except BaseException:
            self._db.execute("DELETE FROM blocks WHERE key = ?", [key])
            raise

    def _delete_disk(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
        self._db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in keys])

    def _get_disk(self, key: str) -> KVBlock | None:
        try:
            return self._read(key)
        except FileNotFoundError:
            self._db.execute("DELETE FROM blocks WHERE key = ?", [key])
            return None
        except (OSError, CorruptBlockError) as exc:
            log.warning("KV block %s in %s is corrupt (%s); deleted, it will be recomputed",
                        key, self.directory, exc)
            self._stats.corrupt += 1
            self._delete_disk([key])
            return None

    # ---------------------------------------------------------------- public API
    def get(self, key: str) -> KVBlock | None:
        """The block stored under `key` (in the store dtype, on CPU), or None on a miss.

        Looks in the memory LRU first, then on disk (verifying checksum, shapes and metadata; a disk hit
        is promoted to memory).  A corrupt, truncated or unreadable file is deleted (file and row),
        counted in ``stats.corrupt``, logged, and reported as a miss.

        Raises
        ------
        ValueError
            If `key` is not a 64-char hex string (see `block_key`).
        """
        _check_key(key)
        with self._lock:
            self._check_open()
            if key in self._mem:
                self._mem.move_to_end(key)
                self._stats.hits_memory += 1
                return self._mem[key][0]
            block = self._get_disk(key) if self._db is not None else None
            if block is None:
                self._stats.misses += 1
                return None
            self._stats.hits_disk += 1
            chunk = self._db.execute("SELECT chunk_id FROM blocks WHERE key = ?", [key]).fetchone()
            self._remember(key, block, chunk[0] if chunk else None)
            return block

    def put(self, key: str, block: KVBlock, chunk_id: int | None = None) -> None:
        """Store `block` under `key` (replacing any entry), cast to the store dtype, in memory and on disk.

        Parameters
        ----------
        key : str
            From `block_key`.
        block : KVBlock
            Any float dtype and device; it is copied (the store never aliases the caller's tensors).
        chunk_id : int, optional
            The chunk the block encodes, so `drop_chunks` can remove it when the chunk goes away.

        Raises
        ------
        ValueError
            On a bad key or an empty block (n_tokens == 0).
        TypeError
            If `block` is not a KVBlock.
        OSError
            If the file cannot be written (the memory tier keeps the block).
        """
        _check_key(key)
        if not isinstance(block, KVBlock):
            raise TypeError(f"KVBlockStore.put: block must be a KVBlock, got {type(block).__name__}")
        if block.n_tokens == 0:
            raise ValueError(f"KVBlockStore.put: block {key} has no tokens; nothing to store")
        chunk_id = None if chunk_id is None else operator.index(chunk_id)
        owned = KVBlock(_owned(block.keys, self.dtype), _owned(block.values, self.dtype), block.start)
        with self._lock:
            self._check_open()
            self._stats.puts += 1
            self._remember(key, owned, chunk_id)
            if self._db is not None:
                self._write(key, owned, chunk_id)

    def drop_chunks(self, chunk_ids: Iterable[int]) -> int:
        """Remove every entry (memory, file, row) recorded for `chunk_ids`; returns how many keys went.

        Register as ``store.on_chunks_removed(kv.drop_chunks)`` so replaced or deleted documents free
        their blocks.
        """
        ids = {operator.index(i) for i in chunk_ids}
        with self._lock:
            self._check_open()
            keys = {k for k, (_, c) in self._mem.items() if c in ids}
            if self._db is not None:
                batch_ids = sorted(ids)
                for lo in range(0, len(batch_ids), _SQL_BATCH):
                    batch = batch_ids[lo: lo + _SQL_BATCH]
                    sql = f"SELECT key FROM blocks WHERE chunk_id IN ({', '.join('?' * len(batch))})"
                    keys |= {r[0] for r in self._db.execute(sql, batch)}
                self._delete_disk(keys)
            for key in keys:
                self._forget_memory(key)
        return len(keys)

    def clear(self) -> None:
        """Remove every entry from memory and disk (counters are kept)."""
        with self._lock:
            self._check_open()
            self._mem.clear()
            self._mem_bytes = 0
            if self._db is not None:
                self._delete_disk([r[0] for r in self._db.execute("SELECT key FROM blocks")])

    @property
    def stats(self) -> KVStoreStats:
        """A snapshot of the counters and current sizes."""
        with self._lock:
            self._check_open()
            n, nbytes = self._db.execute("SELECT count(*), coalesce(sum(nbytes), 0) FROM blocks").fetchone() \
                if self._db is not None else (0, 0)
            return replace(self._stats, bytes_in_memory=self._mem_bytes, bytes_on_disk=int(nbytes),
                           entries_on_disk=int(n))

    def bytes_per_token(self) -> float:
        """Average stored bytes per token over disk entries (memory entries without a directory); 0 if empty.

        Equals `kv_bytes_per_token` of the model for the store dtype when nothing hides copies or padding.
        """
        with self._lock:
            self._check_open()
            if self._db is not None:
                nbytes, tokens = self._db.execute("SELECT sum(nbytes), sum(n_tokens) FROM blocks").fetchone()
            else:
                blocks = [b for b, _ in self._mem.values()]
                nbytes, tokens = sum(b.nbytes for b in blocks), sum(b.n_tokens for b in blocks)
        return nbytes / tokens if tokens else 0.0

    def close(self) -> None:
        """Close the SQLite connection and empty the memory tier (files stay); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._mem.clear()
            self._mem_bytes = 0
            if self._db is not None:
                self._db.close()
            self._closed = True

    def __enter__(self) -> "KVBlockStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVBlockStore({str(self.directory)!r}, dtype={self.dtype}, budget={self.memory_budget_bytes} B)"
