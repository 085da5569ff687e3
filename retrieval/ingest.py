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

GROUP_FILES = 32  # files loaded, chunked and embedded (one batch) together


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
                 progress: bool = False, prepare_groups=None) -> IngestReport:
    """Load, chunk, embed and store files (directories are walked recursively) into `store`.

    embedder: `ldqa.retrieval.embedders.Embedder` (or anything with `encode(texts)` -> (n, dim)
    vectors); count_tokens: text -> number of LLM tokens (chunk sizes are in those); chunk_config: a
    `ChunkConfig`; progress: show a tqdm bar on stderr. Same bytes as a stored document -> "skipped"; a
    stored path with changed bytes -> "replaced" (old chunks and everything derived from them are
    dropped in the same transaction). A file that fails (unsupported type, empty, corrupt, encrypted or
    image-only PDF, binary, unreadable) gets an "error" result with the reason (the caller shows it); the
    other files go on; the store is unchanged for it. Raises nothing for bad files; raises ValueError if
    `paths` is empty. The caller serializes ingestion (`LongDocQA` holds a lock).
    prepare_groups: None (this process loads, chunks and embeds each group of files just before it is
    written), or groups -> an iterator of `prepare_group` results in the groups' order, computed
    elsewhere (`ldqa.app.ray_workers.prepare_on_ray`); the writes are the same either way.
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
    groups = list(_groups(list(files), GROUP_FILES))
    if prepare_groups is None:  # lazily: a group is prepared after the ones before it are stored
        stored = lambda sha: store.get_document_by_sha(sha) is not None  # noqa: E731
        prepared = (prepare_group(stored, embedder, count_tokens, chunk_config, g) for g in groups)
    else:
        prepared = prepare_groups(groups)
    try:
        for group, (items, twins) in zip(groups, prepared):
            report.files += write_group(store, embedder, items, twins)
            if bar is not None:
                bar.update(len(group))
    finally:
        store.flush()
        if bar is not None:
            bar.close()
    report.ms = (time.perf_counter() - t0) * 1000
    for f in report.files:
        for w in f.warnings:
            log.warning("%s: %s", f.path, w)
    return report


@dataclass
class PreparedFile:
    """A loaded file on its way to the store (the output of `prepare_group`, the input of `write_group`).

    given: the path as the caller gave it; doc: its `loaders.Document`; chunks: its chunks, or None when
    its bytes were already stored when it was loaded (not chunked: `write_group` reports it skipped);
    vectors: float32 (len(chunks), dim) from the group's batch, or None (embedded when written: the
    batch failed); ms: loading, chunking and its share of the batch's embedding, by chunk count.
    """

    given: str
    doc: object
    chunks: list | None
    vectors: object = None
    ms: float = 0.0


def prepare_group(stored, embedder, count_tokens, chunk_config, paths: list[Path]):
    """The compute half of ingesting one group of files: load and chunk each file, embed the group's
    chunks in one batch (file by file later if the batch fails). Touches no store, so it can run on
    another machine (`ldqa.app.ray_workers`).

    stored: sha256 hex -> whether a document with those bytes is stored (such a file is not chunked).
    Returns (items, twins): items in `paths` order, each a `PreparedFile` or the `FileResult` of a file
    that failed to load or chunk; twins: (FileResult, sha) of files whose bytes an earlier file of the
    group has (reported skipped). Raises nothing for bad files.
    """
    items, first_of, twins = [], {}, []
    for p in paths:
        t0 = time.perf_counter()
        x = _prepare(stored, count_tokens, chunk_config, Path(p))
        if isinstance(x, PreparedFile) and x.chunks is not None:
            sha = x.doc.sha256
            if sha in first_of:  # same bytes twice in one batch: the first one is stored
                x = FileResult(str(p), "skipped", len(x.chunks), None, f"same content as {first_of[sha]}", _ms(t0))
                twins.append((x, sha))
            else:
                first_of[sha] = x.doc.path
        items.append(x)
    todo = [x for x in items if isinstance(x, PreparedFile) and x.chunks is not None]
    texts = [c.full_text for x in todo for c in x.chunks]
    t0 = time.perf_counter()
    try:
        vectors = embedder.encode(texts) if texts else None
    except Exception as e:  # embedding the batch failed: fall back to one file at a time
        log.warning("batch embedding failed (%s); embedding file by file", e)
        vectors = None
    per_chunk = _ms(t0) / max(1, len(texts)) if vectors is not None else 0.0
    row = 0
    for x in todo:
        x.ms += per_chunk * len(x.chunks)
        if vectors is not None:
            x.vectors = vectors[row:row + len(x.chunks)]
        row += len(x.chunks)
    return items, twins


def write_group(store, embedder, items: list, twins: list) -> list[FileResult]:
    """The write half: store each `PreparedFile` of `prepare_group`'s result in its own transaction (its
    bytes stored by now -> "skipped"; its path stored -> "replaced"; a failure is that file's error
    result only); `FileResult` items pass through; twins get the doc_id of the copy that was stored."""
    out = []
    for x in items:
        if isinstance(x, FileResult):
            out.append(x)
            continue
        doc, t0 = x.doc, time.perf_counter()
        try:
            same = store.get_document_by_sha(doc.sha256)
            if same is not None:
                out.append(FileResult(x.given, "skipped", same.get("n_chunks", 0), same["id"],
                                      f"same content as stored document {same['path']}", x.ms + _ms(t0)))
                continue
            old = store.get_document_by_path(doc.path)
            vec = x.vectors if x.vectors is not None else embedder.encode([c.full_text for c in x.chunks])
            doc_id = store.add_document(doc, x.chunks, vec)
            out.append(FileResult(x.given, "replaced" if old else "added", len(x.chunks), doc_id, "",
                                  x.ms + _ms(t0), list(doc.meta.get("warnings", []))))
        except Exception as e:  # one bad file never stops the rest
            log.exception("ingest failed for %s", doc.path)
            out.append(FileResult(x.given, "error", reason=f"{type(e).__name__}: {e}", ms=x.ms + _ms(t0)))
    stored = {x.doc.path: r.doc_id for x, r in zip(items, out)
              if isinstance(x, PreparedFile) and r.status in ("added", "replaced")}
    for r, sha in twins:  # in-batch duplicates point at the stored copy
        first = next(x.doc.path for x in items if isinstance(x, PreparedFile) and x.doc.sha256 == sha)
        r.doc_id = stored.get(first)
    return out


def _prepare(stored, count_tokens, chunk_config, path: Path):
    """A `PreparedFile` (chunks None when `stored(sha)`: its bytes are stored already), or the file's
    FileResult when it fails to load or chunk."""
    from ldqa.retrieval.chunking import chunk_document
    from ldqa.retrieval.loaders import LoadError, load_document

    t0 = time.perf_counter()
    try:
        doc = load_document(path)
        if stored(doc.sha256):
            return PreparedFile(str(path), doc, None, ms=_ms(t0))
        chunks = chunk_document(doc, count_tokens, chunk_config)
        if not chunks:
            raise LoadError(path, "no text to index after chunking")
        return PreparedFile(str(path), doc, chunks, ms=_ms(t0))
    except LoadError as e:
        return FileResult(str(path), "error", reason=getattr(e, "reason", str(e)), ms=_ms(t0))
    except Exception as e:  # one bad file never stops the rest
        log.exception("ingest failed for %s", path)
        return FileResult(str(path), "error", reason=f"{type(e).__name__}: {e}", ms=_ms(t0))


def _groups(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def progress_bar(items, on: bool, desc: str, unit: str = "file"):
    """A tqdm bar over `items`, counted in `unit`s (updated by the caller), or None when off."""
    if not on:
        return None
    from tqdm import tqdm

    return tqdm(total=len(items), desc=desc, unit=unit, file=sys.stderr)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000
