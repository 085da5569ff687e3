"""Store, VectorIndex and FTS query tests on tiny literal corpora with hand-made unit vectors."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import numpy as np
import pytest

from ldqa.indexes.store import INDEX_NAME, Store, default_store_dir, fts_query
from ldqa.indexes.vector_index import IndexMismatchError, VectorIndex, read_sidecar
from ldqa.retrieval.types import Chunk, Document

MODEL = "fake-8"
DIM = 8


def unit(i: int, j: int | None = None) -> np.ndarray:
    """Basis vector e_i (or (e_i + e_j)/sqrt2), float32 (DIM,)."""
    v = np.zeros(DIM, np.float32)
    v[i] = 1.0
    if j is not None:
        v[j] = 1.0
        v /= np.linalg.norm(v)
    return v


def make_doc(path: str, texts: list[str], dirs: list[int], title: str = "T") -> tuple:
    """A Document whose chunks are `texts` joined by spaces, with chunk vectors e_dirs[i]."""
    text = " ".join(texts)
    doc = Document(path=path, title=title, text=text, sha256=hashlib.sha256(text.encode()).hexdigest(), kind="txt")
    chunks, pos = [], 0
    for i, t in enumerate(texts):
        chunks.append(Chunk(text=t, start=pos, end=pos + len(t), n_tokens=len(t.split()), ordinal=i, page=None))
        pos += len(t) + 1
    vecs = np.stack([unit(d) for d in dirs]) if dirs else np.zeros((0, DIM), np.float32)
    return doc, chunks, vecs


CORPUS = {
    "/d/animals.txt": (["the cat sat on the mat", "dogs chase cats in the park"], [0, 1]),
    "/d/physics.txt": (["quantum chromodynamics describes the strong force"], [2]),
    "/d/food.txt": (["a recipe for banana bread with walnuts"], [3]),
}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "st", MODEL, DIM)
    yield s
    s.close()


def fill(s: Store) -> dict[str, int]:
    return {p: s.add_document(*make_doc(p, texts, dirs)) for p, (texts, dirs) in CORPUS.items()}


def chunk_ids(s: Store, path: str) -> list[int]:
    doc = s.get_document_by_path(path)
    return [r["id"] for r in s.db.query("SELECT id FROM chunks WHERE doc_id = ? ORDER BY ordinal", [doc["id"]])]


# ------------------------------------------------------------------ FTS query sanitation
@pytest.mark.parametrize(
    "query, expected",
    [
        ('what\'s "x2" AND (yak)', '"x2" OR "yak"'),
        ("Banana-bread NEAR/3 recipe*", '"banana" OR "bread" OR "near" OR "3" OR "recipe"'),
        ("the of and", None),
        ("", None),
        ("?!*:^()\"'", None),
        ("cat cat CAT", '"cat"'),
    ],
)
def test_fts_query_sanitizes(query, expected):
    assert fts_query(query) == expected


@pytest.mark.parametrize(
    "nasty",
    ['what\'s "x" AND (y)', 'NOT', 'OR OR', '"unbalanced', "col:value", "a*", "^start", "-minus +plus",
     "NEAR(cat mat)", "{curly} [square]", "cat'; DROP TABLE chunks; --", "\x00\x01", "日本語 テキスト",
     "ünïcödé"],
)
def test_bm25_never_raises_on_nasty_queries(store, nasty):
    fill(store)
    hits = store.bm25_search(nasty, 5)
    assert isinstance(hits, list)
    assert store.n_chunks() == 4  # the injection attempt did nothing


def test_bm25_stopword_and_empty_queries_give_nothing(store):
    fill(store)
    assert store.bm25_search("what is the", 5) == []
    assert store.bm25_search("   ", 5) == []
    assert store.bm25_search("zebra", 5) == []
    with pytest.raises(ValueError, match="k must be >= 1"):
        store.bm25_search("cat", 0)


# ------------------------------------------------------------------ BM25 / dense exact ids
def test_bm25_exact_ids(store):
    fill(store)
    cat, dogs = chunk_ids(store, "/d/animals.txt")
    (qcd,) = chunk_ids(store, "/d/physics.txt")
    (bread,) = chunk_ids(store, "/d/food.txt")
    assert [i for i, _ in store.bm25_search("banana bread recipe?", 10)] == [bread]
    assert [i for i, _ in store.bm25_search("What is the STRONG force?", 10)] == [qcd]
    # "mat" only in `cat`; "cats" stems to "cat": both match, `cat` matches two terms
    hits = store.bm25_search("cat on a mat", 10)
    assert [i for i, _ in hits] == [cat, dogs]
    assert hits[0][1] > hits[1][1] > 0  # higher is better


def test_dense_exact_ids_and_scores(store):
    fill(store)
    cat, dogs = chunk_ids(store, "/d/animals.txt")
    (qcd,) = chunk_ids(store, "/d/physics.txt")
    (bread,) = chunk_ids(store, "/d/food.txt")
    hits = store.dense_search(unit(2), 1)
    assert hits == [(qcd, pytest.approx(1.0))]
    hits = store.dense_search(unit(3, 1), 2)  # halfway between bread and dogs
    assert {i for i, _ in hits} == {bread, dogs}
    assert [s for _, s in hits] == pytest.approx([2 ** -0.5, 2 ** -0.5])
    with pytest.raises(ValueError, match=r"\(8,\)"):
        store.dense_search(np.ones(3), 1)


def test_k_is_clamped_on_a_one_document_collection(store):
    store.add_document(*make_doc("/d/one.txt", ["only one chunk about walruses"], [5]))
    assert len(store.dense_search(unit(0), 10)) == 1
    assert len(store.bm25_search("walruses", 10)) == 1


def test_empty_store_searches_return_nothing(store):
    assert store.dense_search(unit(0), 5) == []
    assert store.bm25_search("cat", 5) == []
    assert store.n_documents() == 0 and store.n_chunks() == 0


def test_get_chunks_preserves_order_and_fields(store):
    fill(store)
    cat, dogs = chunk_ids(store, "/d/animals.txt")
    (bread,) = chunk_ids(store, "/d/food.txt")
    rows = store.get_chunks([bread, 999_999, cat, dogs])
    assert [r["id"] for r in rows] == [bread, cat, dogs]
    assert rows[1]["text"] == "the cat sat on the mat"
    assert (rows[1]["path"], rows[1]["title"], rows[1]["start"], rows[1]["end"], rows[1]["page"]) == (
        "/d/animals.txt", "T", 0, 22, None)
    assert rows[2]["start"] == 23
    np.testing.assert_array_equal(store.get_vectors([dogs, cat]), np.stack([unit(1), unit(0)]))


# ------------------------------------------------------------------ documents: add / replace / delete
def test_documents_listing(store):
    ids = fill(store)
    docs = store.documents()
    assert [d["id"] for d in docs] == list(ids.values())
    assert docs[0]["n_chunks"] == 2 and docs[0]["n_chars"] == len("the cat sat on the mat dogs chase cats in the park")
    assert docs[0]["bytes"] > 0 and docs[0]["added_at"].endswith("+00:00") and docs[0]["meta"] == {}
    assert store.get_document_by_sha(docs[1]["sha256"])["path"] == "/d/physics.txt"
    assert store.get_document_by_sha("0" * 64) is None
    assert store.get_document_by_path("/nope") is None
    assert store.n_documents() == 3 and store.n_chunks() == 4


def test_same_sha_is_a_noop(store):
    removed = []
    store.on_chunks_removed(removed.extend)
    doc_id = store.add_document(*make_doc("/d/a.txt", ["alpha beta"], [0]))
    gen = store.generation
    again = store.add_document(*make_doc("/d/a.txt", ["alpha beta"], [1]))  # same bytes -> same sha
    assert again == doc_id
    assert store.generation == gen and store.n_chunks() == 1 and removed == []
    assert store.dense_search(unit(0), 1)[0][1] == pytest.approx(1.0)  # vectors untouched


def test_replace_by_path_swaps_chunks_fts_and_vectors(store):
    removed = []
    store.on_chunks_removed(removed.extend)
    fill(store)
    old_ids = chunk_ids(store, "/d/animals.txt")
    gen = store.generation
    new_doc = store.add_document(*make_doc("/d/animals.txt", ["giraffes eat acacia leaves"], [6]))
    assert store.generation == gen + 1
    assert removed == old_ids
    assert store.n_documents() == 3 and store.n_chunks() == 3
    assert store.get_document_by_path("/d/animals.txt")["id"] == new_doc
    assert store.bm25_search("cat mat dogs", 10) == []
    (giraffe,) = chunk_ids(store, "/d/animals.txt")
    assert [i for i, _ in store.bm25_search("giraffes", 10)] == [giraffe]
    hits = store.dense_search(unit(0), 10)
    assert not set(old_ids) & {i for i, _ in hits}
    assert hits[0][1] == pytest.approx(0.0)
    assert store.get_chunks(old_ids) == []


def test_delete_document(store):
    removed = []
    store.on_chunks_removed(removed.extend)
    ids = fill(store)
    old_ids = chunk_ids(store, "/d/animals.txt")
    assert store.delete_document(ids["/d/animals.txt"]) == old_ids
    assert removed == old_ids
    assert store.n_documents() == 2 and store.n_chunks() == 2
    assert store.bm25_search("cat", 10) == []
    assert not set(old_ids) & {i for i, _ in store.dense_search(unit(0), 10)}
    with pytest.raises(KeyError, match="no document with id"):
        store.delete_document(ids["/d/animals.txt"])


def test_chunk_ids_are_never_reused(store):
    a = store.add_document(*make_doc("/d/a.txt", ["alpha"], [0]))
    first = chunk_ids(store, "/d/a.txt")
    store.delete_document(a)
    store.add_document(*make_doc("/d/b.txt", ["beta"], [1]))
    assert chunk_ids(store, "/d/b.txt")[0] > first[0]


def test_hook_errors_do_not_break_the_store(store):
    def boom(ids):
        raise RuntimeError("hook failed")

    store.on_chunks_removed(boom)
    doc = store.add_document(*make_doc("/d/a.txt", ["alpha"], [0]))
    assert store.delete_document(doc)  # logged, not raised


@pytest.mark.parametrize(
    "vecs, err",
    [(np.zeros((2, DIM)), "must be \\(1, 8\\)"), (np.full((1, DIM), np.nan), "NaN"),
     (np.zeros((1, 3)), "got \\(1, 3\\)")],
)
def test_add_document_validates_vectors(store, vecs, err):
    doc, chunks, _ = make_doc("/d/a.txt", ["alpha"], [0])
    with pytest.raises(ValueError, match=err):
        store.add_document(doc, chunks, vecs)
    assert store.n_documents() == 0


def test_caller_vectors_are_not_mutated(store):
    doc, chunks, vecs = make_doc("/d/a.txt", ["alpha", "beta"], [0, 1])
    chunks.reverse()  # out of ordinal order
    vecs = vecs[::-1].copy()
    before = vecs.copy()
    store.add_document(doc, chunks, vecs)
    np.testing.assert_array_equal(vecs, before)
    ids = chunk_ids(store, "/d/a.txt")  # by ordinal: alpha, beta
    np.testing.assert_array_equal(store.get_vectors(ids), np.stack([unit(0), unit(1)]))


# ------------------------------------------------------------------ persistence and crash safety
def test_persistence_across_reopen(tmp_path):
    path = tmp_path / "st"
    with Store(path, MODEL, DIM) as s:
        fill(s)
        gen = s.generation
        bm = s.bm25_search("banana", 3)
    assert read_sidecar(path / INDEX_NAME)["generation"] == gen
    mtime = os.stat(path / INDEX_NAME).st_mtime_ns
    with Store(path, MODEL, DIM) as s:
        assert s.n_documents() == 3 and s.generation == gen
        assert s.bm25_search("banana", 3) == bm
        assert s.dense_search(unit(2), 1)[0][1] == pytest.approx(1.0)
    assert os.stat(path / INDEX_NAME).st_mtime_ns == mtime  # current index: loaded, not rebuilt


def test_model_mismatch_raises(tmp_path):
    path = tmp_path / "st"
    Store(path, MODEL, DIM).close()
    with pytest.raises(IndexMismatchError, match=r"built with model fake-8 \(dim 8\); you opened it with other"):
        Store(path, "other", DIM)
    with pytest.raises(IndexMismatchError, match="re-ingest"):
        Store(path, MODEL, 16)


def test_vector_index_load_mismatch(tmp_path):
    vi = VectorIndex(DIM, "flat", MODEL)
    vi.add(np.array([1]), unit(0)[None])
    vi.save(tmp_path / "v.faiss", generation=4)
    assert json.loads((tmp_path / "v.faiss.json").read_text()) == {
        "model": MODEL, "dim": DIM, "kind": "flat", "count": 1, "generation": 4}
    with pytest.raises(IndexMismatchError, match="you opened it with all-MiniLM"):
        VectorIndex.load(tmp_path / "v.faiss", "all-MiniLM-L6-v2", DIM)
    with pytest.raises(FileNotFoundError):
        VectorIndex.load(tmp_path / "missing.faiss", MODEL, DIM)
    assert VectorIndex.load(tmp_path / "v.faiss", MODEL, DIM).search(unit(0), 5) == [(1, pytest.approx(1.0))]


def _crash(s: Store) -> None:
    """Simulate a process dying: drop the connection without flushing the faiss index."""
    s.db.conn.close()
    s._closed = True


def test_crash_after_sqlite_commit_rebuilds_faiss(tmp_path):
    path = tmp_path / "st"
    s = Store(path, MODEL, DIM)
    s.add_document(*make_doc("/d/a.txt", ["alpha apples"], [0]))
    s.flush()
    s.add_document(*make_doc("/d/b.txt", ["beta bananas"], [1]))  # committed, faiss not written
    _crash(s)
    assert read_sidecar(path / INDEX_NAME)["count"] == 1
    with Store(path, MODEL, DIM) as s2:
        (b,) = chunk_ids(s2, "/d/b.txt")
        assert s2.dense_search(unit(1), 1) == [(b, pytest.approx(1.0))]
        assert [i for i, _ in s2.bm25_search("bananas", 5)] == [b]
        assert read_sidecar(path / INDEX_NAME) == {
            "model": MODEL, "dim": DIM, "kind": "flat", "count": 2, "generation": s2.generation}


def test_crash_during_faiss_write_keeps_old_index_and_rebuilds(tmp_path, monkeypatch):
    path = tmp_path / "st"
    s = Store(path, MODEL, DIM)
    s.add_document(*make_doc("/d/a.txt", ["alpha"], [0]))
    s.flush()
    old = (path / INDEX_NAME).read_bytes()
    s.add_document(*make_doc("/d/b.txt", ["beta"], [1]))

    def dying_replace(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr("ldqa.indexes.vector_index.os.replace", dying_replace)  # crash inside the save
    with pytest.raises(OSError, match="simulated"):
        s.flush()
    monkeypatch.undo()
    _crash(s)
    assert (path / INDEX_NAME).read_bytes() == old  # never torn
    with Store(path, MODEL, DIM) as s2:
        assert len(s2.dense_search(unit(1), 5)) == 2


def test_half_written_temp_file_and_corrupt_index_are_ignored(tmp_path):
    path = tmp_path / "st"
    with Store(path, MODEL, DIM) as s:
        fill(s)
    tmp = path / ".tmp-vectors.faiss.abc123"
    tmp.write_bytes(b"\x00garbage half-written faiss")
    with Store(path, MODEL, DIM) as s:
        assert s.dense_search(unit(3), 1)[0][1] == pytest.approx(1.0)
        assert s.size_bytes() > 0
    assert tmp.exists()  # young temp files are left alone (a writer may be in flight)
    (path / INDEX_NAME).write_bytes(b"torn")  # corrupt index -> rebuilt
    with Store(path, MODEL, DIM) as s:
        assert len(s.dense_search(unit(3), 10)) == 4
    assert VectorIndex.load(path / INDEX_NAME, MODEL, DIM).generation == 3


def test_hnsw_store_add_delete_reopen(tmp_path):
    path = tmp_path / "st"
    with Store(path, MODEL, DIM, index_kind="hnsw") as s:
        ids = fill(s)
        s.delete_document(ids["/d/physics.txt"])
        (bread,) = chunk_ids(s, "/d/food.txt")
        assert s.dense_search(unit(3), 1) == [(bread, pytest.approx(1.0))]
        assert len(s.dense_search(unit(2), 10)) == 3
    with Store(path, MODEL, DIM) as s:  # kind kept from creation
        assert s.index_kind == "hnsw" and s._index.kind == "hnsw"
        assert s.dense_search(unit(3), 1) == [(bread, pytest.approx(1.0))]
    with Store(path, MODEL, DIM, index_kind="flat") as s:  # switching kind rebuilds
        assert s._index.kind == "flat" and len(s.dense_search(unit(3), 10)) == 3


def test_second_store_object_sees_other_writers(tmp_path):
    path = tmp_path / "st"
    with Store(path, MODEL, DIM) as a, Store(path, MODEL, DIM) as b:
        a.add_document(*make_doc("/d/a.txt", ["alpha"], [0]))
        assert b.dense_search(unit(0), 5)[0][1] == pytest.approx(1.0)  # b rebuilt from SQLite
        assert [i for i, _ in b.bm25_search("alpha", 5)] == chunk_ids(a, "/d/a.txt")


def test_default_store_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_store_dir() == tmp_path / "ldqa" / "stores" / "default"
    assert default_store_dir("papers-2024") == tmp_path / "ldqa" / "stores" / "papers-2024"
    for bad in ["", "../up", "a/b", ".hidden"]:
        with pytest.raises(ValueError, match="not valid"):
            default_store_dir(bad)


def test_closed_store_refuses_work(tmp_path):
    s = Store(tmp_path / "st", MODEL, DIM)
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        s.bm25_search("cat", 1)


# ------------------------------------------------------------------ concurrency
def test_concurrent_search_while_adding(store):
    fill(store)
    errors: list[BaseException] = []
    stop = threading.Event()

    def searcher(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                hits = store.dense_search(rng.standard_normal(DIM).astype(np.float32), 3)
                rows = store.get_chunks([i for i, _ in hits] + [i for i, _ in store.bm25_search("cat word", 3)])
                assert all(r["text"] for r in rows)
                if stop.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=searcher, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for n in range(30):
            texts = [f"word{n} text", f"more word{n}"]
            store.add_document(*make_doc(f"/d/new{n}.txt", texts, [n % DIM, (n + 1) % DIM]))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    assert store.n_documents() == 33 and store.n_chunks() == 64
    assert len(store.dense_search(unit(0), 100)) == 64


def test_a_store_path_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="notes.txt is a file, not a directory"):
        Store(tmp_path / "notes.txt", "emb", 8)
    assert (tmp_path / "notes.txt").read_text() == "x"
