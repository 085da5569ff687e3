"""Collections of the web app: one per user when login is on, shared ones searched beside it.

Layout of a served store directory ``<store>`` with login on::

    <store>/users/<name>/   each user's private collection (a Store, its kv/ and uploads/)
    <store>/shared/         the shared collection every user searches, read-only in the web app; the
                            documents a single-user store held when login was turned on move here
    <store>/eval-ui/        the Eval tab's cached runs

Without login ``<store>`` itself is the one collection. `serve_layout` says which directories to open
for a served store and moves a single-user store into the per-user layout (`migrate_to_per_user`):
the new collection is written beside the old one, switched in by one directory rename, and only then
are the old files removed; a crash at any point leaves the documents whole in one place or the other.

`MergedRetriever` searches a user's collection and the shared ones as one: dense lists merged by cosine
similarity (one embedding model for all), BM25 lists by score, fused by RRF as a single store's are.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from ldqa.indexes.store import DB_NAME, INDEX_NAME, copy_database, database_identity
from ldqa.indexes.vector_index import atomic_write_bytes, fsync_dir
from ldqa.retrieval.fusion import rrf
from ldqa.retrieval.retriever import EmptyCollectionError, RetrievedPassage, Retriever

USERS_DIR = "users"
SHARED_DIR = "shared"
MIGRATED = "migrated.json"  # in <store>/shared: the identity of the single-user store moved there
STAGING = ".migrating-shared"  # the copy being written; it becomes <store>/shared by one rename
LOGIN_HINT = "LDQA_UI_USER and LDQA_UI_PASSWORD, or --auth-file"


def user_dir_name(username: str) -> str:
    """The directory name of `username`'s collection under ``<store>/users``: the name itself when it is
    made of lower-case letters, digits, '_' and '-' (at most 64), else those characters kept, the others
    replaced by '_', and 8 hex digits of its sha256 appended (so "Ann", "ann" and "a/n n" never share a
    directory, on case-insensitive file systems too). Raises ValueError for an empty name."""
    if not isinstance(username, str) or not username:
        raise ValueError("a user name is needed for a per-user collection: log in")
    if re.fullmatch(r"[a-z0-9_-]{1,64}", username):
        return username
    safe = re.sub(r"[^a-z0-9_-]", "_", username.lower())[:48]
    return f"{safe}-{hashlib.sha256(username.encode()).hexdigest()[:8]}"


def serve_layout(root: str | os.PathLike, login: bool) -> tuple[Path, Path | None, str]:
    """Where the web app's collections live for the served store `root`: (the directory of the
    collection the app opens first, the per-user directory or None, a one-line note for the operator or
    ""). With `login`: (<root>/shared, <root>/users, what the migration moved), after moving a
    single-user store into the per-user layout (`migrate_to_per_user`). Without: (root, None, "").

    Raises ValueError without `login` over a store in the per-user layout (saying how to serve it), and
    as `migrate_to_per_user`.
    """
    root = Path(root).expanduser().resolve()
    if login:
        note = migrate_to_per_user(root)
        (root / USERS_DIR).mkdir(parents=True, exist_ok=True)  # marks the layout, also before anyone logs in
        return root / SHARED_DIR, root / USERS_DIR, note
    if (root / USERS_DIR).is_dir() and not (root / DB_NAME).exists():
        raise ValueError(f"store {root} holds a collection per user ({root / USERS_DIR}): serve it with login "
                         f"({LOGIN_HINT}), or serve one collection on its own with --store {root / SHARED_DIR} "
                         f"or --store {root / USERS_DIR}/NAME")
    return root, None, ""


def migrate_to_per_user(root: str | os.PathLike) -> str:
    """Move the single collection stored directly in `root` (its database, uploaded files and KV blocks)
    to ``root/shared``, where every user finds it (read-only in the web app); returns a one-line note of
    what moved ("" when `root` holds no single collection).

    Write new, then switch: the database is copied (a consistent snapshot; uploaded documents' paths
    rewritten to their new place), the uploaded files hard-linked (copied across file systems), with a
    ``migrated.json`` naming the source's identity, into ``root/.migrating-shared``; one rename makes it
    ``root/shared``; then the KV blocks are moved and the old files removed, the database last. A crash
    before the rename leaves the old store untouched (the half copy is discarded on the next start); after
    it, the next start sees the old database's identity in ``migrated.json`` and finishes the removal.

    Raises ValueError when ``root/shared`` exists and the database in `root` is not the one moved there
    (a collection made in `root` since): the message says how to resolve it.
    """
    root = Path(root).expanduser().resolve()
    shared, stage = root / SHARED_DIR, root / STAGING
    if stage.exists():
        shutil.rmtree(stage)  # a copy interrupted before its switch: the original is whole
    if not (root / DB_NAME).is_file():
        return ""
    if shared.exists():
        moved = _read_marker(shared)
        if moved is None or moved.get("identity") != database_identity(root):
            raise ValueError(
                f"store {root} holds a collection of its own ({root / DB_NAME}) beside the per-user layout "
                f"({shared}, {root / USERS_DIR}): with login on, the web app serves only those. Ingest its "
                f"documents into the shared collection (ldqa ingest FILES --store {shared}) or a user's, then "
                f"move {root / DB_NAME} and its vectors.faiss, kv/ and uploads/ out of {root}, and serve again")
        _remove_old(root, shared)
        return f"finished moving the single collection of {root} to {shared}"
    identity = _write_copy(root, stage)
    os.rename(stage, shared)  # the switch: before it, the old store is the collection; after it, the copy
    fsync_dir(root)
    _remove_old(root, shared)
    n = identity["documents"]
    return (f"login is on: the {n} document{'s' if n != 1 else ''} of {root} moved to the shared collection "
            f"{shared}, which every user searches")


def _write_copy(root: Path, stage: Path) -> dict:
    """The new shared collection in `stage`: database copy, uploads, vectors, marker. Returns the
    identity of the database copied."""
    sep = os.sep
    identity = copy_database(root, stage, relocate=(f"{root / 'uploads'}{sep}", f"{root / SHARED_DIR / 'uploads'}{sep}"))
    uploads = root / "uploads"
    if uploads.is_dir():
        shutil.copytree(uploads, stage / "uploads", copy_function=_link_or_copy)
    for name in (INDEX_NAME, INDEX_NAME + ".json"):  # derived, but copying spares a rebuild
        if (root / name).is_file():
            _link_or_copy(root / name, stage / name)
    for p in [stage / DB_NAME, *stage.rglob("*")]:
        if p.is_file():
            _fsync_file(p)
    atomic_write_bytes(stage / MIGRATED, json.dumps({"from": str(root), "identity": identity}, indent=1).encode())
    for d in [stage, *(p for p in stage.rglob("*") if p.is_dir())]:
        fsync_dir(d)
    return identity


def _remove_old(root: Path, shared: Path) -> None:
    """Remove what the switch left of the single-user store in `root`; the database goes last, so that a
    crash here is finished on the next start. Its KV blocks move to `shared` (they key the same chunks)."""
    kv = root / "kv"
    if kv.is_dir():
        if (shared / "kv").exists():
            shutil.rmtree(kv)
        else:
            os.rename(kv, shared / "kv")
    if (root / "uploads").is_dir():
        shutil.rmtree(root / "uploads")
    for name in (INDEX_NAME, INDEX_NAME + ".json", DB_NAME + "-wal", DB_NAME + "-shm", DB_NAME):
        (root / name).unlink(missing_ok=True)
    fsync_dir(root)


def _read_marker(shared: Path) -> dict | None:
    try:
        return json.loads((shared / MIGRATED).read_text())
    except (OSError, ValueError):
        return None


def _link_or_copy(src, dst) -> str:
    """Hard-link `src` at `dst` (no second copy of the bytes), else copy it."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return str(dst)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def check_shared_store(path: str | os.PathLike, root: str | os.PathLike, login: bool) -> Path:
    """The resolved directory of ``--shared-store`` `path` for the served store `root`. Raises ValueError
    naming it when it holds no collection, is `root` itself, or with `login` is ``root/shared`` (searched
    already) or a user's private collection under ``root/users``."""
    p, root = Path(path).expanduser().resolve(), Path(root).expanduser().resolve()
    if not (p / DB_NAME).is_file():
        raise ValueError(f"--shared-store {path}: no collection there (no {DB_NAME}); make one with "
                         f"`ldqa ingest FILES --store {path}`, or give the directory of an existing one")
    if p == root:
        raise ValueError(f"--shared-store {path} is the served store itself: give another collection")
    if login and p == root / SHARED_DIR:
        raise ValueError(f"--shared-store {path} is the shared collection every user searches already: "
                         "leave the option out, or give another collection")
    if login and root / USERS_DIR in p.parents:
        raise ValueError(f"--shared-store {path} is a user's private collection: give a collection outside "
                         f"{root / USERS_DIR}")
    return p


class MergedRetriever:
    """Searches several `Store`s (the first: the asker's own collection; the rest: shared ones) as one
    collection, with one `Embedder`.

    Each store gives its dense and BM25 candidate lists; the dense lists merge by cosine similarity (the
    same embedding model scored them all), the BM25 lists by score (each store's BM25 statistics are its
    own, so this merge is approximate), and hybrid fuses the two merged lists by RRF (k = 60) as a single
    store's search does. Passages keep their store's chunk and document ids.

    Raises IndexMismatchError when a store was built with another embedding model.
    """

    def __init__(self, stores, embedder):
        self.retrievers = [Retriever(s, embedder) for s in stores]  # each checks the store's embedder
        self.stores = list(stores)
        self.embedder = embedder

    def search(self, query: str, top_k: int = 5, mode: str = "hybrid", candidates: int = 50) -> list[RetrievedPassage]:
        """The `top_k` passages for `query` over every store, best first (see `Retriever.search` for the
        arguments). Raises ValueError for a bad argument, EmptyCollectionError when no store holds a
        chunk."""
        Retriever._validate(query, top_k, mode, candidates)
        sizes = [s.n_chunks() for s in self.stores]
        if not sum(sizes):
            raise EmptyCollectionError("no documents in this collection or the shared ones yet: add some first")
        qvec = self.embedder.encode_query(query) if mode != "bm25" else None
        dense, bm25 = [], []  # (score, store index, chunk id)
        for i, (store, n) in enumerate(zip(self.stores, sizes)):
            if not n:
                continue
            n_cand = min(max(int(candidates), int(top_k)), n)
            if qvec is not None:
                dense += [(s, i, cid) for cid, s in store.dense_search(qvec, n_cand)]
            if mode != "dense":
                bm25 += [(s, i, cid) for cid, s in store.bm25_search(query, n_cand)]
        dense.sort(key=lambda x: (-x[0], x[1]))  # stable: equal scores keep store order, then rank
        bm25.sort(key=lambda x: (-x[0], x[1]))
        keys = {k: n for n, k in enumerate(dict.fromkeys((i, c) for _, i, c in dense + bm25))}  # (store, chunk) -> int
        lists = [[keys[(i, c)] for _, i, c in dense], [keys[(i, c)] for _, i, c in bm25]]
        if mode == "hybrid":
            ranked = rrf(lists)
        else:
            ranked = [(keys[(i, c)], s) for s, i, c in (dense if mode == "dense" else bm25)]
        return self._passages(ranked[:int(top_k)], keys, dense, bm25)

    def _passages(self, ranked, keys, dense, bm25) -> list[RetrievedPassage]:
        where = {n: k for k, n in keys.items()}
        dense_at = {keys[(i, c)]: (r, s) for r, (s, i, c) in enumerate(dense, 1)}
        bm25_at = {keys[(i, c)]: (r, s) for r, (s, i, c) in enumerate(bm25, 1)}
        rows = {}
        for i, store in enumerate(self.stores):
            ids = [where[n][1] for n, _ in ranked if where[n][0] == i]
            rows |= {(i, r["id"]): r for r in store.get_chunks(ids)} if ids else {}
        out = []
        for n, score in ranked:
            row = rows.get(where[n])
            if row is None:  # deleted between search and fetch
                continue
            d_rank, d_score = dense_at.get(n, (None, None))
            b_rank, b_score = bm25_at.get(n, (None, None))
            out.append(RetrievedPassage(
                chunk_id=row["id"], doc_id=row["doc_id"], title=row["title"], path=row["path"], page=row["page"],
                start=row["start"], end=row["end"], text=row["text"], score=float(score),
                dense_score=d_score, bm25_score=b_score, dense_rank=d_rank, bm25_rank=b_rank,
                header=row.get("header", "")))
        return out
