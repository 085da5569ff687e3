"""RRF, the MiniLM embedder and the Retriever on a tiny literal corpus (real all-MiniLM-L6-v2, local)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ldqa.indexes.store import Store
from ldqa.indexes.vector_index import IndexMismatchError
from ldqa.retrieval.embedders import Embedder
from ldqa.retrieval.fusion import rrf
from ldqa.retrieval.retriever import EmptyCollectionError, RetrievedPassage, Retriever
from ldqa.retrieval.types import Chunk, Document


# ------------------------------------------------------------------ RRF, hand-worked
def test_rrf_worked_example():
    fused = rrf([[7, 3], [3, 9]])
    assert [i for i, _ in fused] == [3, 7, 9]
    assert [s for _, s in fused] == pytest.approx([1 / 62 + 1 / 61, 1 / 61, 1 / 62])


def test_rrf_weights_and_k():
    fused = rrf([[1, 2], [2, 1]], k=1, weights=[2.0, 1.0])
    # id 1: 2/(1+1) + 1/(1+2) = 1.3333 ; id 2: 2/(1+2) + 1/(1+1) = 1.1667
    assert fused == [(1, pytest.approx(4 / 3)), (2, pytest.approx(7 / 6))]


def test_rrf_ties_broken_by_best_rank_then_id():
    # 8 and 5 both score 1/61 + 1/63 with best rank 1 -> smaller id first; 6 = 1/61; 4 and 9 = 1/62 (rank 2)
    fused = rrf([[8, 4, 5], [6, 9, 8], [5]])
    assert [i for i, _ in fused] == [5, 8, 6, 4, 9]
    assert dict(fused)[5] == pytest.approx(1 / 61 + 1 / 63)


def test_rrf_best_rank_breaks_a_score_tie_before_id():
    # k = 1: id 9 ranks (1, 5) -> 1/2 + 1/6 = 2/3 ; id 2 ranks (2, 2) -> 1/3 + 1/3 = 2/3 (a tie, up to
    # float rounding); 9 reached rank 1, so it comes first despite the larger id.
    fused = rrf([[9, 2], [10, 2, 11, 12, 9]], k=1)
    assert [i for i, _ in fused] == [9, 2, 10, 11, 12]
    assert [s for _, s in fused] == pytest.approx([2 / 3, 2 / 3, 1 / 2, 1 / 4, 1 / 5])
    fused = rrf([[5], [], [1, 2, 3]], k=1, weights=[1.0, 1.0, 2.0])
    # 1: 2/2 ; 2: 2/3 ; 5: 1/2 (rank 1) ; 3: 2/4 = 1/2 (rank 3)
    assert [i for i, _ in fused] == [1, 2, 5, 3]


def test_rrf_duplicates_and_empty():
    assert rrf([]) == []
    assert rrf([[], []]) == []
    assert rrf([[4, 4, 5]]) == [(4, pytest.approx(1 / 61)), (5, pytest.approx(1 / 63))]


@pytest.mark.parametrize("kwargs, msg", [({"k": 0}, "k must be > 0"), ({"weights": [1.0]}, "1 weights for 2"),
                                         ({"weights": [1.0, -1.0]}, ">= 0")])
def test_rrf_validates(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        rrf([[1], [2]], **kwargs)


# ------------------------------------------------------------------ embedder
@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def test_embedder_shapes_and_norms(embedder):
    assert embedder.name == "all-MiniLM-L6-v2" and embedder.dim == 384
    v = embedder.encode(["a cat", "a dog", "tax law"], batch_size=2)
    assert v.shape == (3, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    q = embedder.encode_query("a kitten")
    assert q.shape == (384,) and q.dtype == np.float32
    assert int(np.argmax(v @ q)) == 0
    np.testing.assert_allclose(q, embedder.encode(["a kitten"])[0], atol=1e-6)
    assert embedder.encode([]).shape == (0, 384)
    assert Embedder().model is embedder.model  # one model per process


def test_embedder_rejects_bad_input(embedder):
    with pytest.raises(TypeError, match="list of texts"):
        embedder.encode("one string")
    with pytest.raises(TypeError, match="must be a str"):
        embedder.encode(["ok", 3])
    with pytest.raises(ValueError, match="unknown embedding model"):
        Embedder("bert-base")


# ------------------------------------------------------------------ retriever on a literal corpus
PASSAGES = [
    ("/c/paris.txt", "Paris",
     "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France."),
    ("/c/plants.txt", "Plants", "Photosynthesis converts light energy into chemical energy stored in glucose."),
    ("/c/crash.txt", "Crash", "The stock market crashed in October 1929, starting the Great Depression."),
    ("/c/penguins.txt", "Penguins",
     "Penguins are flightless seabirds living almost exclusively in the Southern Hemisphere."),
    ("/c/python.txt", "Python", "Python is a programming language known for its readable syntax and large library."),
]


def _doc(path, title, text):
    return (Document(path=path, title=title, text=text, sha256=hashlib.sha256(text.encode()).hexdigest(), kind="txt"),
            [Chunk(text=text, start=0, end=len(text), n_tokens=len(text.split()), ordinal=0, page=1)])


@pytest.fixture(scope="module")
def corpus(embedder, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("corpus") / "st", embedder.name, embedder.dim)
    ids = {}
    for path, title, text in PASSAGES:
        doc, chunks = _doc(path, title, text)
        store.add_document(doc, chunks, embedder.encode([c.text for c in chunks]))
        ids[title] = store.get_chunks([r["id"] for r in store.db.query(
            "SELECT c.id FROM chunks c JOIN documents d ON d.id = c.doc_id WHERE d.path = ?", [path])])[0]["id"]
    store.flush()
    yield store, ids
    store.close()


def test_dense_finds_paraphrase_without_word_overlap(corpus, embedder):
    store, ids = corpus
    hits = Retriever(store, embedder).search("birds of Antarctica that cannot fly", top_k=2, mode="dense")
    assert hits[0].chunk_id == ids["Penguins"]
    assert hits[0].dense_rank == 1 and hits[0].bm25_rank is None and hits[0].score == hits[0].dense_score
    assert hits[0].score > hits[1].score


def test_bm25_exact_ids(corpus, embedder):
    store, ids = corpus
    hits = Retriever(store, embedder).search("wrought-iron lattice", top_k=5, mode="bm25")
    assert [h.chunk_id for h in hits] == [ids["Paris"]]  # no other passage shares a word
    assert hits[0].bm25_rank == 1 and hits[0].dense_score is None
    assert Retriever(store, embedder).search("what is it?", mode="bm25") == []


def test_hybrid_is_rrf_of_both_lists(corpus, embedder):
    store, ids = corpus
    r = Retriever(store, embedder)
    query = "When did the stock market crash?"
    hits = r.search(query, top_k=3, mode="hybrid", candidates=5)
    assert hits[0].chunk_id == ids["Crash"]
    assert hits[0].dense_rank == 1 and hits[0].bm25_rank == 1
    assert hits[0].score == pytest.approx(2 / 61)
    dense = [i for i, _ in store.dense_search(embedder.encode_query(query), 5)]
    bm25 = [i for i, _ in store.bm25_search(query, 5)]
    expected = rrf([dense, bm25])[:3]
    assert [(h.chunk_id, h.score) for h in hits] == [(i, pytest.approx(s)) for i, s in expected]


def test_hybrid_recovers_what_one_list_misses(corpus, embedder):
    store, ids = corpus
    # lexical cue ("glucose") + semantic cue; the top hit must be in both lists
    hits = Retriever(store, embedder).search("how do plants make glucose from sunlight", top_k=5)
    assert hits[0].chunk_id == ids["Plants"]
    assert len(hits) == 5  # dense fills the rest
    p = hits[0]
    assert isinstance(p, RetrievedPassage)
    assert (p.title, p.path, p.page, p.start, p.doc_id > 0) == ("Plants", "/c/plants.txt", 1, 0, True)
    assert p.text.startswith("Photosynthesis")


def test_top_k_clamped_to_collection(corpus, embedder):
    store, _ = corpus
    assert len(Retriever(store, embedder).search("anything at all", top_k=50, mode="dense")) == len(PASSAGES)


def test_one_document_collection(embedder, tmp_path):
    with Store(tmp_path / "one", embedder.name, embedder.dim) as store:
        doc, chunks = _doc(*PASSAGES[0])
        store.add_document(doc, chunks, embedder.encode([chunks[0].text]))
        r = Retriever(store, embedder)
        for mode in ("hybrid", "dense", "bm25"):
            hits = r.search("Eiffel Tower", top_k=5, mode=mode, candidates=50)
            assert len(hits) == 1 and hits[0].title == "Paris"


def test_empty_collection_error(embedder, tmp_path):
    with Store(tmp_path / "empty", embedder.name, embedder.dim) as store:
        msg = r"no documents ingested in store .*empty; run `ldqa ingest PATH --store .*empty`"
        with pytest.raises(EmptyCollectionError, match=msg):
            Retriever(store, embedder).search("hello")


@pytest.mark.parametrize(
    "kwargs, msg",
    [({"mode": "sparse"}, "unknown retrieval mode 'sparse'"), ({"top_k": 0}, "top_k must be an integer >= 1"),
     ({"top_k": 2.5}, "top_k"), ({"candidates": 0}, "candidates"), ({"query": "  "}, "non-empty string"),
     ({"query": None}, "non-empty string")],
)
def test_search_validates(corpus, embedder, kwargs, msg):
    store, _ = corpus
    args = {"query": "hello"} | kwargs
    with pytest.raises(ValueError, match=msg):
        Retriever(store, embedder).search(**args)


def test_retriever_rejects_other_embedder(corpus):
    store, _ = corpus

    class Other:
        name, dim = "e5-small", 384

    with pytest.raises(IndexMismatchError, match="built with model all-MiniLM-L6-v2.*opened it with e5-small"):
        Retriever(store, Other())
