"""Ingestion: files -> documents -> chunks -> vectors -> a store, one file's failure never stopping the rest.

    report = ingest_files(store, embedder, tokenizer.count, ChunkConfig(), ["manual.pdf", "notes/"])
    report.added, report.skipped, [f.reason for f in report.errors]

Files are walked (`loaders.iter_paths`), then handled in groups of 32: each file is loaded and chunked on
its own, the group's chunks are embedded in one batch (file by file if the batch fails), and each file is
stored in its own transaction. Same bytes as a stored document (or earlier in the batch) -> "skipped"; a
stored path with changed bytes -> "replaced". The store is anything with `get_document_by_sha`,
`get_document_by_path`, `add_document` and `flush` (`ldqa.indexes.store.Store`), passed in, so this
module stays below `indexes/`.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)


@dataclass
class FileResult:
    """What happened to one input file: status "added" | "replaced" | "skipped" (same content already
    stored) | "error" (reason says why; the store is unchanged for this file). ms: this file's own time
    (loading, chunking, its share of the batch's embedding by chunk count, storing), not the batch's.
    warnings: what the loader could not read faithfully (e.g. glyphs without a Unicode mapping) in a
    file that was stored anyway."""

    path: str
    status: str
    chunks: int = 0
    doc_id: int | None = None
    reason: str = ""
    ms: float = 0.0
    warnings: list[str] = field(default_factory=list)


@dataclass
class IngestReport:
    """Per-file results of one `ingest` call plus totals; `ms` is the wall time of the call."""

    files: list[FileResult] = field(default_factory=list)
    ms: float = 0.0

    @property
    def added(self) -> int:
        return sum(f.status in ("added", "replaced") for f in self.files)

    @property
    def skipped(self) -> int:
        return sum(f.status == "skipped" for f in self.files)

    @property
    def errors(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "error"]

    @property
    def chunks(self) -> int:
        return sum(f.chunks for f in self.files if f.status in ("added", "replaced"))

    def to_dict(self) -> dict:
        return {"files": [asdict(f) for f in self.files], "ms": self.ms, "added": self.added,
                "skipped": self.skipped, "errors": len(self.errors), "chunks": self.chunks}


def ingest_files(store, embedder, count_tokens, chunk_config, paths: str | Path | Iterable[str | Path],
                 progress: bool = False) -> IngestReport:
    """Load, chunk, embed and store files (directories are walked recursively) into `store`.

    embedder: `ldqa.retrieval.embedders.Embedder` (or anything with `encode(texts)` -> (n, dim)
    vectors); count_tokens: text -> number of LLM tokens (chunk sizes are in those); chunk_config: a
    `ChunkConfig`; progress: show a tqdm bar on stderr. Same bytes as a stored document -> "skipped"; a
    stored path with changed bytes -> "replaced" (old chunks and everything derived from them are
    dropped in the same transaction). A file that fails (unsupported type, empty, corrupt, encrypted or
    image-only PDF, binary, unreadable) gets an "error" result with the reason, logged to stderr; the
    other files go on; the store is unchanged for it. Raises nothing for bad files; raises ValueError if
    `paths` is empty. The caller serializes ingestion (`LongDocQA` holds a lock).
    """
    from ldqa.retrieval.loaders import iter_paths

    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError("ingest: no paths given; pass files or directories")
    t0 = time.perf_counter()
    report = IngestReport()
    files = iter_paths(paths)
    bar = progress_bar(files, progress, "ingest")
    try:
        for group in _groups(list(files), 32):
            report.files += _ingest_group(store, embedder, count_tokens, chunk_config, group)
            if bar is not None:
                bar.update(len(group))
    finally:
        store.flush()
        if bar is not None:
            bar.close()
    report.ms = (time.perf_counter() - t0) * 1000
    for f in report.errors:
        print(f"ldqa: {f.path}: {f.reason}", file=sys.stderr)
    for f in report.files:
        for w in f.warnings:
            log.warning("%s: %s", f.path, w)
    return report


def _ingest_group(store, embedder, count_tokens, chunk_config, paths: list[Path]) -> list[FileResult]:
    """Load and chunk each file, embed the group's chunks in one batch, store each file in its own
    transaction. A failure in any step is that file's error result only."""
    prepared, first_of, twins = [], {}, []  # twins: (FileResult, sha) of in-batch duplicates
    given = {}  # absolute path -> the path as the caller gave it (reports use the latter)
    own_ms = {}  # absolute path -> ms spent loading and chunking that file
    for p in paths:
        t0 = time.perf_counter()
        x = _prepare(store, count_tokens, chunk_config, Path(p))
        if not isinstance(x, FileResult):
            given[x[0].path] = str(p)
            own_ms[x[0].path] = _ms(t0)
            sha = x[0].sha256
            if sha in first_of:  # same bytes twice in one batch: the first one is stored
                x = FileResult(str(p), "skipped", len(x[2]), None, f"same content as {first_of[sha]}",
                               _ms(t0))
                twins.append((x, sha))
            else:
                first_of[sha] = x[0].path
        prepared.append(x)
    todo = [x for x in prepared if not isinstance(x, FileResult)]
    texts = [c.full_text for _, _, chunks in todo for c in chunks]
    t0 = time.perf_counter()
    try:
        vectors = embedder.encode(texts) if texts else None
    except Exception as e:  # embedding the batch failed: fall back to one file at a time
        log.warning("batch embedding failed (%s); embedding file by file", e)
        vectors = None
    embed_ms_per_chunk = _ms(t0) / max(1, len(texts)) if vectors is not None else 0.0
    out, row = [], 0
    for x in prepared:
        if isinstance(x, FileResult):
            out.append(x)
            continue
        doc, old, chunks = x
        t0, before = time.perf_counter(), own_ms[doc.path] + embed_ms_per_chunk * len(chunks)
        try:
            vec = vectors[row:row + len(chunks)] if vectors is not None else \
                embedder.encode([c.full_text for c in chunks])
            doc_id = store.add_document(doc, chunks, vec)
            out.append(FileResult(given[doc.path], "replaced" if old else "added", len(chunks), doc_id, "",
                                  before + _ms(t0), list(doc.meta.get("warnings", []))))
        except Exception as e:  # one bad file never stops the rest
            log.exception("ingest failed for %s", doc.path)
            out.append(FileResult(given[doc.path], "error", reason=f"{type(e).__name__}: {e}",
                                  ms=before + _ms(t0)))
        row += len(chunks)
    stored = {r.path: r.doc_id for r in out if r.status in ("added", "replaced")}
    for r, sha in twins:  # in-batch duplicates point at the stored copy
        r.doc_id = stored.get(given[first_of[sha]])
    return out

def _prepare(store, count_tokens, chunk_config, path: Path):
    """(Document, old stored row or None, chunks) for a file to store, or its FileResult when it is
    skipped (same content stored) or fails to load."""
    from ldqa.retrieval.chunking import chunk_document
    from ldqa.retrieval.loaders import LoadError, load_document

    t0 = time.perf_counter()
    try:
        doc = load_document(path)
        same = store.get_document_by_sha(doc.sha256)
        if same is not None:
            return FileResult(str(path), "skipped", same.get("n_chunks", 0), same["id"],
                              f"same content as stored document {same['path']}", _ms(t0))
        chunks = chunk_document(doc, count_tokens, chunk_config)
        if not chunks:
            raise LoadError(path, "no text to index after chunking")
        return doc, store.get_document_by_path(doc.path), chunks
    except LoadError as e:
        return FileResult(str(path), "error", reason=getattr(e, "reason", str(e)), ms=_ms(t0))
    except Exception as e:  # one bad file never stops the rest
        log.exception("ingest failed for %s", path)
        return FileResult(str(path), "error", reason=f"{type(e).__name__}: {e}", ms=_ms(t0))


def _groups(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def progress_bar(items, on: bool, desc: str):
    """A tqdm bar over `items` (updated by the caller), or None when off."""
    if not on:
        return None
    from tqdm import tqdm

    return tqdm(total=len(items), desc=desc, unit="file", file=sys.stderr)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000
